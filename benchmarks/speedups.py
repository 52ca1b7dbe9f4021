"""Each C function of envfleet's optional step path against its Python twin, side by side.

For every function the C module (``envfleet._core._speedups``) has, the same workload runs with the
C function and with its Python twin, turned off one piece at a time through
``envfleet._core.native.disabled`` (read when a vector env is made; its workers inherit it under
``fork``, the default start method on Linux):

- **micro** (per call, µs): the caller of that one function, with the function in C and in
  Python (an EnvGroup of CartPole-v1 x16's result and observation writes, and a processes
  no-op step round trip for the worker loop and the driver's round). The functions dropped
  after this measured within noise end to end (the env step loop, the doorbell's post, poll
  and spin, StepTimer.call) had theirs here too: ``benchmarks/results/speedups.md``;
- **end to end** (steps/s): CartPole-v1 x16 and ALE/Pong-v5 x8 (when ale-py is installed) on
  the processes backend with default settings, and CartPole-v1 x16 as a first-ready pool
  (``batch_size=8``), with every C function ("all C"), with none ("no C"), and with all but
  one. Each configuration is measured against "all C" in pairs of adjacent short windows (the
  order alternating, the pairs of all configurations shuffled), so that load from other
  processes hits both sides of a pair alike; a window's steps/s come from its median step
  time. ``gain`` is the median over the pairs of steps/s with all C over steps/s without that
  one function (quartiles beside it); the row "all C (again)" pairs two identical vector
  envs: its median distance from 1 is the noise floor, and a function "pays" when its gain
  exceeds 1 by more than that.

Run: ``python benchmarks/speedups.py [--seconds S] [--repeats R] [--out NAME]``; the markdown
table goes to stdout and ``benchmarks/results/NAME.md``, raw numbers to ``NAME.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import platform
import random
import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import gymnasium
import numpy as np
from gymnasium import spaces

import envfleet
import envfleet._core.native as native

MICRO_CALLS = 2000
WARMUP_STEPS = 20  # untimed steps at the start of each window: the workers wake up
_alive: list[Any] = []  # the micro benchmarks' vector envs (they close when collected)


class NoopEnv(gymnasium.Env[np.ndarray, int]):
    """A step that does nothing: what is left is the vector env's own cost."""

    observation_space = spaces.Box(-1.0, 1.0, (4,), np.float32)
    action_space = spaces.Discrete(2)

    def __init__(self) -> None:
        self._obs = np.zeros(4, np.float32)

    def reset(self, *, seed: int | None = None, options: Any = None) -> tuple[np.ndarray, dict]:
        super().reset(seed=seed)
        return self._obs, {}

    def step(self, action: int) -> tuple[np.ndarray, float, bool, bool, dict]:
        return self._obs, 0.0, False, False, {}


def pieces() -> list[str]:
    """The C module's step-path functions (those the callers look up)."""
    if native.speedups is None:
        raise SystemExit("envfleet._core._speedups is not built (or ENVFLEET_NO_SPEEDUPS is set)")
    return sorted(n for n in dir(native.speedups) if n in MICRO)


@contextlib.contextmanager
def without(names: set[str] | frozenset[str]) -> Iterator[None]:
    """Objects built inside run the Python twins of ``names``."""
    saved = native.disabled
    native.disabled = frozenset(names)
    try:
        yield
    finally:
        native.disabled = saved


def per_call_us(fn: Callable[[], Any], calls: int = MICRO_CALLS) -> float:
    clock = time.perf_counter
    t0 = clock()
    for _ in range(calls):
        fn()
    return (clock() - t0) / calls * 1e6


# -- micro: one caller per function, with the function in C or in Python ----------------------


def serial_group(off: set[str]) -> Any:
    with without(off):
        envs = envfleet.make("CartPole-v1", 16, backend="serial")
    _alive.append(envs)
    envs.reset(seed=0)
    return envs._backend.transport.groups[0]


def micro_write_results(off: set[str]) -> Callable[[], Any]:
    group = serial_group(off)
    group.step()
    return group._write_results


def micro_write_rows(off: set[str]) -> Callable[[], Any]:
    group = serial_group(off)
    group.step()
    return group._writers[0].write


def micro_round_trip(off: set[str]) -> Callable[[], Any]:
    with without(off):
        envs = envfleet.make(NoopEnv, 2, backend="processes")
    _alive.append(envs)
    envs.reset(seed=0)
    actions = np.zeros(2, dtype=np.int64)
    return lambda: envs.step(actions)


MICRO: dict[str, tuple[str, Callable[[set[str]], Callable[[], Any]]]] = {
    "write_results": ("EnvGroup._write_results, x16", micro_write_results),
    "write_rows": ("RowWriter.write (EnvGroup's rows), x16", micro_write_rows),
    "serve_steps": ("processes no-op step, NoopEnv x2", micro_round_trip),
    "full_round": ("processes no-op step, NoopEnv x2", micro_round_trip),
}


def run_micro(names: list[str], repeats: int) -> list[dict[str, Any]]:
    calls = {
        (n, mode): MICRO[n][1](set() if mode == "C" else {n})
        for n in names
        for mode in ("C", "Python")
    }
    times: dict[tuple[str, str], list[float]] = {k: [] for k in calls}
    keys = list(calls)
    for _ in range(repeats):
        random.shuffle(keys)
        for key in keys:
            times[key].append(per_call_us(calls[key]))
    rows = []
    for n in names:
        c, py = times[(n, "C")], times[(n, "Python")]
        rows.append(
            {
                "function": n,
                "workload": MICRO[n][0],
                "c_us": min(c),
                "python_us": min(py),
                "ratio": min(py) / min(c),
            }
        )
    return rows


# -- end to end -----------------------------------------------------------------------------


def measure_sps(envs: Any, seconds: float, pool: bool) -> float:
    """Steps/s over a window of ``seconds``, from the median time of one step (one
    ``recv()`` + ``send()`` of a pool): a step that another process preempted counts as
    much as any other, so load from outside moves the figure less than a mean would."""
    clock = time.perf_counter
    times: list[float] = []
    if pool:
        batch = envs.batch_size
        actions = np.zeros(batch, dtype=np.int64)
        for _ in range(WARMUP_STEPS):
            *_, info = envs.recv()
            envs.send(actions, info["env_id"])
        t0 = now = clock()
        while now - t0 < seconds:
            *_, info = envs.recv()
            envs.send(actions, info["env_id"])
            times.append(clock() - now)
            now = clock()
        return batch / statistics.median(times)
    space = envs.action_space
    space.seed(0)
    actions = np.stack([space.sample() for _ in range(8)])
    for k in range(WARMUP_STEPS):
        envs.step(actions[k % 8])
    t0 = now = clock()
    while now - t0 < seconds:
        envs.step(actions[len(times) % 8])
        times.append(clock() - now)
        now = clock()
    return envs.num_envs / statistics.median(times)


def run_end_to_end(
    env_id: str,
    num_envs: int,
    names: list[str],
    repeats: int,
    seconds: float,
    pool: bool,
    together: tuple[str, ...] = (),
) -> dict[str, Any]:
    """Each configuration against "all C" in pairs of adjacent windows, the order of each
    pair alternating; a configuration's gain is the median over its pairs."""
    configs: dict[str, set[str]] = {"all C": set(), "all C (again)": set(), "no C": set(names)}
    configs.update({f"all but {n}": {n} for n in names})
    if together:
        configs[f"all but {', '.join(together)}"] = set(together)
    kwargs: dict[str, Any] = {"backend": "processes"}
    if pool:
        kwargs["batch_size"] = num_envs // 2
    vector_envs = {}
    try:
        for label, off in configs.items():
            with without(off):
                envs = envfleet.make(env_id, num_envs, **kwargs)
            if pool:
                envs.async_reset(seed=0)
            else:
                envs.reset(seed=0)
            vector_envs[label] = envs
        sps: dict[str, list[float]] = {label: [] for label in configs}
        gains: dict[str, list[float]] = {label: [] for label in configs}
        others = [label for label in configs if label != "all C"]
        for r in range(repeats):
            random.shuffle(others)
            for label in others:
                pair = ["all C", label] if r % 2 else [label, "all C"]
                got = {k: measure_sps(vector_envs[k], seconds, pool) for k in pair}
                sps["all C"].append(got["all C"])
                sps[label].append(got[label])
                gains[label].append(got["all C"] / got[label])
    finally:
        for envs in vector_envs.values():
            envs.close()
    noise = [abs(g - 1) for g in gains["all C (again)"]]
    threshold = max(statistics.median(noise), 0.01)
    rows = []
    for label in configs:
        g = gains[label] or [1.0]
        rows.append(
            {
                "config": label,
                "steps_per_s": statistics.median(sps[label]),
                "gain": statistics.median(g),
                "gain_q1": float(np.quantile(g, 0.25)),
                "gain_q3": float(np.quantile(g, 0.75)),
                "raw": sps[label],
            }
        )
    return {"env": env_id, "num_envs": num_envs, "pool": pool, "noise": threshold, "rows": rows}


def markdown(micro: list[dict[str, Any]], tables: list[dict[str, Any]], args: Any) -> str:
    lines = [
        f"# C step path vs Python twins ({platform.machine()}, {args.repeats} repetitions, "
        f"{args.seconds:g} s windows; medians)",
        "",
        "## Micro (per call)",
        "",
        "| function | workload | C µs | Python µs | Python / C |",
        "|---|---|---:|---:|---:|",
    ]
    for r in micro:
        lines.append(
            f"| {r['function']} | {r['workload']} | {r['c_us']:.2f} | {r['python_us']:.2f} "
            f"| {r['ratio']:.2f} |"
        )
    for t in tables:
        kind = f" pool (batch_size={t['num_envs'] // 2})" if t["pool"] else ""
        lines += [
            "",
            f"## {t['env']} x{t['num_envs']}, processes{kind} (noise floor {t['noise']:.1%})",
            "",
            "| config | steps/s | gain of all C over it (quartiles) | verdict |",
            "|---|---:|---:|---|",
        ]
        for r in t["rows"]:
            verdict = ""
            if r["config"].startswith("all but"):
                verdict = "pays" if r["gain"] - 1 > t["noise"] else "within noise"
            lines.append(
                f"| {r['config']} | {r['steps_per_s']:,.0f} | {r['gain']:.3f} "
                f"({r['gain_q1']:.3f}..{r['gain_q3']:.3f}) | {verdict} |"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=0.2)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--micro-repeats", type=int, default=9)
    parser.add_argument("--envs", nargs="*", default=["cartpole", "pong", "pool"])
    parser.add_argument("--out", default="speedups")
    parser.add_argument(
        "--together", default="", help="also measure these functions off at once (a,b,...)"
    )
    args = parser.parse_args()
    names = pieces()
    together = tuple(n for n in args.together.split(",") if n)
    micro = run_micro(names, args.micro_repeats)
    for envs in _alive:
        envs.close()
    tables = []
    if "cartpole" in args.envs:
        tables.append(
            run_end_to_end("CartPole-v1", 16, names, args.repeats, args.seconds, False, together)
        )
    if "pong" in args.envs and importlib.util.find_spec("ale_py") is not None:
        import ale_py

        gymnasium.register_envs(ale_py)
        tables.append(run_end_to_end("ALE/Pong-v5", 8, names, args.repeats, args.seconds, False))
    if "pool" in args.envs:
        tables.append(run_end_to_end("CartPole-v1", 16, names, args.repeats, args.seconds, True))
    text = markdown(micro, tables, args)
    print(text)
    out = Path(args.out)
    if out.parent == Path("."):
        out = Path(__file__).parent / "results" / out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text(text)
    out.with_suffix(".json").write_text(json.dumps({"micro": micro, "tables": tables}, indent=1))


if __name__ == "__main__":
    main()
