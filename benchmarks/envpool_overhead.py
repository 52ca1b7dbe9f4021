"""What ``backend="envpool"`` costs on top of EnvPool itself.

For each task and num_envs, four loops over the same native pool configuration:

- ``sync``: ``step(actions)`` on every env (raw: ``envpool.make(..., env_type="gymnasium")``;
  envfleet: ``envfleet.make(task, n, backend="envpool")``);
- ``pool``: EnvPool's asynchronous loop with ``batch_size = num_envs // 2``: ``recv()`` a
  batch, ``send()`` its actions back by ``info["env_id"]``.

Systems: ``raw`` (EnvPool), ``envfleet`` (``copy=True``, the default) and ``envfleet-view``
(``copy=False``). Each is measured ``--repeats`` times for ``--seconds`` after a warm-up,
systems interleaved; the table gives median env steps per second and the median ratio to raw
within each repetition. EnvPool's threads: ``--threads`` (default: EnvPool's own default).
A second table gives the front's own cost, which a busy machine barely moves: µs of Python
per call with EnvPool's native ``_send``/``_recv`` stubbed out (:func:`front_cost_us`; raw
EnvPool's figure is its own Python wrappers).

Run: ``python benchmarks/envpool_overhead.py``; results go to
``benchmarks/results/envpool.{md,json}``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from pool_vs_sync import measured_on, save  # benchmarks/ is this script's path

import envfleet

RESULTS = Path(__file__).resolve().parent / "results"
SYSTEMS = ("raw", "envfleet", "envfleet-view")
# Atari as CleanRL trains it on EnvPool (84x84 gray, 4 stacked frames: EnvPool's defaults)
# with gymnasium's sticky actions.
AS_TRAINED = "repeat_action_probability=0.25"


def _options(text: str) -> dict[str, Any]:
    """``KEY=VALUE,...`` as envpool.make options (values as Python literals where they parse)."""
    import ast

    options: dict[str, Any] = {}
    for item in filter(None, text.split(",")):
        key, value = item.split("=", 1)
        try:
            options[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            options[key] = value
    return options


def _loop(system: str, task: str, n: int, mode: str, kwargs: dict[str, Any]) -> Any:
    """(step function returning the env steps it did, the env)."""
    import envpool

    batch = n if mode == "sync" else n // 2
    rng = np.random.default_rng(0)
    num_actions = 6 if task.endswith("-v5") else 2
    actions = rng.integers(0, num_actions, size=(64, n))
    k = 0
    if system == "raw":
        env: Any = envpool.make(
            task, env_type="gymnasium", num_envs=n, batch_size=batch, seed=0, **kwargs
        )
    else:
        env = envfleet.make(
            task,
            n,
            backend="envpool",
            batch_size=None if mode == "sync" else batch,
            copy=system == "envfleet",
            env_kwargs={"seed": 0, **kwargs},
        )
    if mode == "sync":
        env.reset()

        def step() -> int:
            nonlocal k
            k += 1
            env.step(actions[k % 64])
            return n

    else:
        env.async_reset()

        def step() -> int:
            nonlocal k
            k += 1
            info = env.recv()[-1]
            env.send(actions[k % 64, :batch], info["env_id"])
            return batch

    return step, env


def front_cost_us(
    system: str, task: str, n: int, mode: str, kwargs: dict[str, Any], calls: int, repeats: int
) -> float:
    """µs of Python per ``step`` (sync) or ``recv`` + ``send`` pair (pool) with EnvPool's
    native ``_send``/``_recv`` replaced by stubs (``_send`` does nothing, ``_recv`` hands back
    copies of one real batch): what the front around EnvPool costs, raw EnvPool's own Python
    wrappers included, which a busy machine barely moves (the best of ``repeats``)."""
    step, env = _loop(system, task, n, mode, kwargs)
    native = env if system == "raw" else env._backend._pool
    if mode == "sync":
        ids = np.arange(n, dtype=np.int32)
        native._send([ids, ids, np.zeros(n, dtype=native._spec._action_spec[-1][0])])
    state = native._recv()
    cls = type(native)
    cls._send = lambda self, values: None
    cls._recv = lambda self: [value.copy() for value in state]
    try:
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            for _ in range(calls):
                step()
            best = min(best, (time.perf_counter() - start) / calls * 1e6)
    finally:
        del cls._send, cls._recv  # EnvPool's own methods again
        env.close()
    return best


def measure(step: Callable[[], int], seconds: float, warmup: float) -> float:
    end = time.perf_counter() + warmup
    while time.perf_counter() < end:
        step()
    steps = 0
    t0 = time.perf_counter()
    end = t0 + seconds
    while (now := time.perf_counter()) < end:
        steps += step()
    return steps / (now - t0)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--cases",
        nargs="+",
        default=["CartPole-v1:64", f"Pong-v5:64:{AS_TRAINED}"],
        help="TASK:NUM_ENVS[:KEY=VALUE,...] (EnvPool task ids and envpool.make options; "
        f"Atari as trained: {AS_TRAINED})",
    )
    parser.add_argument("--modes", nargs="+", default=["sync", "pool"])
    parser.add_argument("--seconds", type=float, default=1.5)
    parser.add_argument("--warmup", type=float, default=0.3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument(
        "--front-calls", type=int, default=3000, help="calls per timing of the front's cost"
    )
    parser.add_argument("--out", default="envpool")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    kwargs = {} if args.threads is None else {"num_threads": args.threads}
    rows = []
    for case in args.cases:
        task, n, *extra = case.split(":")
        options = {**kwargs, **_options(extra[0] if extra else "")}
        for mode in args.modes:
            rates: dict[str, list[float]] = {s: [] for s in SYSTEMS}
            for rep in range(args.repeats):
                for system in SYSTEMS:
                    step, env = _loop(system, task, int(n), mode, options)
                    try:
                        rates[system].append(measure(step, args.seconds, args.warmup))
                    finally:
                        env.close()
                    print(
                        f"{task} n={n} {mode} {system} rep {rep}: {rates[system][-1]:,.0f} steps/s",
                        file=sys.stderr,
                    )
            row: dict[str, Any] = {
                "task": task + (f" ({extra[0]})" if extra else ""),
                "num_envs": int(n),
                "mode": mode,
            }
            for system in SYSTEMS:
                row[f"{system}_front_us"] = front_cost_us(
                    system, task, int(n), mode, options, args.front_calls, 5
                )
            for system in SYSTEMS:
                row[system] = statistics.median(rates[system])
                row[f"{system}_all"] = rates[system]
                row[f"{system}_ratio"] = statistics.median(
                    a / b for a, b in zip(rates[system], rates["raw"], strict=True)
                )
            rows.append(row)
    lines = [
        "| task | num_envs | mode | raw EnvPool steps/s | envfleet steps/s (ratio) | "
        "envfleet copy=False (ratio) |",
        "|---|---:|---|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['task']} | {r['num_envs']} | {r['mode']} | {r['raw']:,.0f} | "
            f"{r['envfleet']:,.0f} ({r['envfleet_ratio']:.2f}) | "
            f"{r['envfleet-view']:,.0f} ({r['envfleet-view_ratio']:.2f}) |"
        )
    lines += [
        "",
        "The front's own cost: µs of Python per step (sync) or recv + send pair (pool) with "
        "EnvPool's native `_send`/`_recv` stubbed out (raw: EnvPool's own Python wrappers; "
        f"best of 5 x {args.front_calls} calls).",
        "",
        "| task | num_envs | mode | raw EnvPool µs | envfleet µs (ratio) | "
        "envfleet copy=False µs (ratio) |",
        "|---|---:|---|---:|---:|---:|",
    ]
    for r in rows:
        raw_us = r["raw_front_us"]
        lines.append(
            f"| {r['task']} | {r['num_envs']} | {r['mode']} | {raw_us:.1f} | "
            f"{r['envfleet_front_us']:.1f} ({r['envfleet_front_us'] / raw_us:.2f}) | "
            f"{r['envfleet-view_front_us']:.1f} ({r['envfleet-view_front_us'] / raw_us:.2f}) |"
        )
    import envpool

    where = measured_on()
    header = (
        f"# backend='envpool' against raw EnvPool\n\n"
        f"envpool {envpool.__version__}, envfleet {envfleet.__version__} at {where['commit']}, "
        f"{where['line']}; median of {args.repeats} x {args.seconds} s; "
        "pool: batch_size = num_envs // 2; "
        f"ratio = envfleet / raw (median per repetition).\n\n"
        f"Command: `python benchmarks/envpool_overhead.py {' '.join(argv or sys.argv[1:])}`\n\n"
    )
    save(args.out, header, lines, {"args": vars(args), **where["doc"], "rows": rows})


if __name__ == "__main__":
    main()
