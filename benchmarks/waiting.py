"""Envs that wait: envfleet's defaults against gymnasium's AsyncVectorEnv and one env per worker.

Three synthetic envs whose step waits as a step that talks to an external simulator does
(``time.sleep`` stands for the simulator: the process uses no CPU and releases the GIL):

- ``wait``: each step sleeps ``--wait-ms`` (5 ms by default; 20 ms for the remote-simulator
  targets at x64, x256 and x1,024);
- ``straggler``: each step sleeps 0.2 ms, and one step in 20 (drawn from the env's seeded RNG)
  8 ms: a simulator that mostly answers fast but sometimes stalls;
- ``mixed``: each step computes for 0.5 ms (a busy loop in Python), then sleeps 2 ms.

Systems, side by side in one run (the order rotates between repetitions):

- ``lone-env``: one env stepped alone in a plain loop in this process, its rate times ``n``:
  what ``n`` envs would make if each ran alone, this machine's timers and step included (a
  2 ms sleep wakes about 0.1-0.6 ms late on a shared VM); the realistic limit;

- ``gym-async``: ``gymnasium.vector.AsyncVectorEnv`` (a process per env), the reference;
- ``envfleet``: ``envfleet.make(env, n)``, the defaults (a worker per usable core, each
  stepping its block of envs all at once when they wait);
- ``envfleet-sequential``: the same with ``ENVFLEET_STEPPING=sequential`` (every worker steps
  its envs one after another, as before issue 50);
- ``envfleet-per-env``: ``envfleet.make(env, n, num_workers=n)``, one env per worker;
- ``envfleet-pool`` (``straggler`` only): ``envfleet.make(env, n, batch_size=n // 2)``, the
  first-ready pool driven as EnvPool's loop (``recv`` the first ``n // 2``, ``send`` their
  actions back).
- ``envfleet-pool-per-env`` (``straggler`` only): the same pool with ``num_workers=n``.

The synchronous systems are stepped with zero actions; rates are env steps per second summed
over the envs, counted from ``reset`` (``--warmup 0``, the default: whatever the workers take
to learn their envs is in the figure). The table gives each system's median steps/s; its
ratio to the physical bound (``× bound``: ``N / t_wait`` for ``wait``; ``N`` over the mean
step, 0.59 ms, for ``straggler``; for ``mixed`` the smaller of ``N / 2.5 ms`` and the CPU bound,
usable cores / 0.5 ms); its ratios to ``gym-async`` and to ``envfleet-per-env`` (or, for the
pools, ``envfleet-pool-per-env``: medians of the per-repetition ratios); the memory of its
process tree (PSS summed over the learner and every worker, GiB, at the end of the last
repetition); and what envfleet's workers found (``envs.stats.env_kind``, and how many of them
stepped their envs all at once at the end). ``gym-async`` is left out above
``--gym-async-max`` envs (256): a process per env, it needs about 33 GiB at x1,024.

Run: ``python benchmarks/waiting.py`` (about 4 minutes on 2 cores), ``--quick`` for a look
(0.5 s per measurement, 1 repetition); results go to ``benchmarks/results/waiting.{md,json}``
(``--out NAME``). The issue's targets::

    python benchmarks/waiting.py --envs wait --wait-ms 20 --num-envs 64 256 1024 \
        --systems gym-async envfleet --seconds 12 --out waiting-20ms
    python benchmarks/waiting.py --envs wait --num-envs 16 64 --systems gym-async envfleet
    python benchmarks/waiting.py --envs straggler mixed --num-envs 16 64
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gymnasium
import numpy as np
import psutil
from gymnasium import spaces

import envfleet

RESULTS = Path(__file__).resolve().parent / "results"
ENVS = ("wait", "straggler", "mixed")
SYSTEMS = (
    "lone-env",
    "gym-async",
    "envfleet",
    "envfleet-sequential",
    "envfleet-per-env",
    "envfleet-pool",
    "envfleet-pool-per-env",
)


class WaitingEnv(gymnasium.Env[np.ndarray, np.int64]):
    """A step that waits (``time.sleep``) as one that talks to a simulator does; see the
    module docstring for ``kind``."""

    def __init__(self, kind: str = "wait", wait_s: float = 0.005):
        if kind not in ENVS:
            raise ValueError(f"kind must be one of {ENVS}, got {kind!r}")
        self.kind, self.wait_s = kind, wait_s
        self.observation_space = spaces.Box(-1.0, 1.0, (4,), np.float32)
        self.action_space = spaces.Discrete(2)

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> Any:
        super().reset(seed=seed)
        return np.zeros(4, np.float32), {}

    def step(self, action: Any) -> Any:
        rng = self.np_random
        if self.kind == "wait":
            time.sleep(self.wait_s)
        elif self.kind == "straggler":
            time.sleep(0.008 if rng.random() < 0.05 else 0.0002)
        else:  # mixed: 0.5 ms of CPU, then 2 ms waiting
            end = time.perf_counter() + 0.0005
            while time.perf_counter() < end:
                pass
            time.sleep(0.002)
        return rng.uniform(-1, 1, 4).astype(np.float32), 1.0, False, False, {}


def _sync_rate(envs: Any, n: int, seconds: float, warmup: float) -> float:
    envs.reset(seed=0)
    actions = np.zeros(n, np.int64)
    end = time.perf_counter() + warmup
    while time.perf_counter() < end:
        envs.step(actions)
    steps, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        envs.step(actions)
        steps += n
    return steps / (time.perf_counter() - start)


def _pool_rate(envs: Any, seconds: float, warmup: float) -> float:
    envs.async_reset(seed=0)
    b = envs.batch_size
    actions = np.zeros(b, np.int64)
    end = time.perf_counter() + warmup
    while time.perf_counter() < end:
        *_, info = envs.recv()
        envs.send(actions, info["env_id"])
    steps, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        *_, info = envs.recv()
        envs.send(actions, info["env_id"])
        steps += b
    return steps / (time.perf_counter() - start)


def bound(kind: str, n: int, wait_s: float) -> float:
    """The physical limit of ``n`` envs of ``kind``, env steps/s (module docstring)."""
    if kind == "wait":
        return n / wait_s
    if kind == "straggler":
        return n / (0.95 * 0.0002 + 0.05 * 0.008)
    return min(n / 0.0025, envfleet.usable_cores() / 0.0005)


def tree_gib() -> float:
    """PSS of this process and all its children, GiB (shared pages counted once)."""
    me = psutil.Process()
    total = 0
    for proc in [me, *me.children(recursive=True)]:
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            total += proc.memory_full_info().pss
    return total / 2**30


def _found(envs: Any) -> str:
    """What envfleet's workers found: the env kind and how many step all at once."""
    workers = envs.stats.workers
    at_once = sum(w.concurrent for w in workers)
    return f"{envs.stats.env_kind}, {at_once}/{len(workers)} at once"


Measure = Callable[[float, float], tuple[float, str, float]]


def systems(kind: str, n: int, wait_s: float = 0.005) -> dict[str, Measure]:
    """Each system's measurement: ``(seconds, warmup) -> (steps/s, what the workers found,
    the process tree's GiB)``."""

    def env_fn() -> WaitingEnv:
        return WaitingEnv(kind, wait_s)

    def gym_async(seconds: float, warmup: float) -> tuple[float, str, float]:
        envs = gymnasium.vector.AsyncVectorEnv([env_fn] * n, shared_memory=True)
        try:
            return _sync_rate(envs, n, seconds, warmup), "", tree_gib()
        finally:
            envs.close()

    def fleet(stepping: str = "auto", **kwargs: Any) -> Measure:
        def run(seconds: float, warmup: float) -> tuple[float, str, float]:
            before = os.environ.get("ENVFLEET_STEPPING")
            os.environ["ENVFLEET_STEPPING"] = stepping  # read by the workers as they start
            try:
                envs = envfleet.make(env_fn, n, **kwargs)
            finally:
                if before is None:
                    del os.environ["ENVFLEET_STEPPING"]
                else:
                    os.environ["ENVFLEET_STEPPING"] = before
            with envs:
                if "batch_size" in kwargs:
                    rate = _pool_rate(envs, seconds, warmup)
                else:
                    rate = _sync_rate(envs, n, seconds, warmup)
                return rate, _found(envs), tree_gib()

        return run

    def lone_env(seconds: float, warmup: float) -> tuple[float, str, float]:
        # One env stepped in a plain loop here, its rate times n: what n envs would make if
        # each ran alone, with this machine's own sleep (its timers wake late) and step.
        env = env_fn()
        env.reset(seed=0)
        steps, start = 0, time.perf_counter()
        while time.perf_counter() - start < min(seconds, 2.0):
            env.step(0)
            steps += 1
        return n * steps / (time.perf_counter() - start), "", 0.0

    table = {
        "lone-env": lone_env,
        "gym-async": gym_async,
        "envfleet": fleet(),
        "envfleet-sequential": fleet("sequential"),
        "envfleet-per-env": fleet(num_workers=n),
    }
    if kind == "straggler":
        table["envfleet-pool"] = fleet(batch_size=max(1, n // 2))
        table["envfleet-pool-per-env"] = fleet(batch_size=max(1, n // 2), num_workers=n)
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--envs", nargs="+", choices=ENVS, default=list(ENVS))
    parser.add_argument("--num-envs", nargs="+", type=int, default=[16, 64])
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    parser.add_argument("--wait-ms", type=float, default=5.0, help="the wait env's sleep")
    parser.add_argument("--gym-async-max", type=int, default=256, help="most envs for gym-async")
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--warmup", type=float, default=0.0, help="seconds not counted")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="0.5 s per measurement, 1 repeat")
    parser.add_argument("--out", default="waiting")
    args = parser.parse_args(argv)
    if args.quick:
        args.seconds, args.repeats = 0.5, 1
    wait_s = args.wait_ms / 1e3
    rows = []
    for kind in args.envs:
        for n in args.num_envs:
            table = {
                k: v
                for k, v in systems(kind, n, wait_s).items()
                if k in args.systems and not (k == "gym-async" and n > args.gym_async_max)
            }
            rates: dict[str, list[float]] = {name: [] for name in table}
            found: dict[str, str] = {}
            gib: dict[str, float] = {}
            for r in range(args.repeats):
                names = list(table)
                names = names[r % len(names) :] + names[: r % len(names)]  # rotate the order
                for name in names:
                    rate, seen, gib[name] = table[name](args.seconds, args.warmup)
                    rates[name].append(rate)
                    found[name] = seen
                print(kind, n, r, {k: round(v[-1]) for k, v in rates.items()}, file=sys.stderr)
            for name in table:
                row: dict[str, Any] = {
                    "env": kind,
                    "num_envs": n,
                    "system": name,
                    "steps_per_s": statistics.median(rates[name]),
                    "runs": rates[name],
                    "found": found[name],
                    "x_bound": statistics.median(rates[name]) / bound(kind, n, wait_s),
                    "tree_gib": gib[name],
                }
                per_env = "envfleet-pool-per-env" if "pool" in name else "envfleet-per-env"
                for ref, key in (
                    ("gym-async", "x_gym_async"),
                    (per_env, "x_per_env"),
                    ("lone-env", "x_lone"),
                ):
                    if ref in rates:
                        row[key] = statistics.median(
                            a / b for a, b in zip(rates[name], rates[ref], strict=True)
                        )
                rows.append(row)
    given = argv if argv is not None else sys.argv[1:]
    command = " ".join(["python benchmarks/waiting.py", *given])
    lines = [
        "# Envs that wait",
        "",
        f"`{command}` on {os.cpu_count()} cores ({envfleet.usable_cores()} usable), Python "
        f"{platform.python_version()}, envfleet {envfleet.__version__}, gymnasium "
        f"{gymnasium.__version__}; medians of {args.repeats} runs of {args.seconds:g} s "
        f"counted from reset after {args.warmup:g} s; wait {args.wait_ms:g} ms.",
        "",
        "| env | n | system | steps/s | × bound | × lone-env | × gym-async | × per-env | "
        "tree GiB | workers found |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for row in rows:
        x_gym = f"{row['x_gym_async']:.2f}" if "x_gym_async" in row else "-"
        x_per = f"{row['x_per_env']:.2f}" if "x_per_env" in row else "-"
        x_lone = f"{row['x_lone']:.2f}" if "x_lone" in row else "-"
        gib = f"{row['tree_gib']:.2f}" if row["tree_gib"] else "-"
        lines.append(
            f"| {row['env']} | {row['num_envs']} | {row['system']} | {row['steps_per_s']:,.0f} "
            f"| {row['x_bound']:.2f} | {x_lone} | {x_gym} | {x_per} | {gib} "
            f"| {row['found'] or '-'} |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    RESULTS.mkdir(exist_ok=True)
    out = Path(args.out) if os.sep in args.out else RESULTS / args.out
    out.with_suffix(".md").write_text(text)
    out.with_suffix(".json").write_text(json.dumps({"command": command, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
