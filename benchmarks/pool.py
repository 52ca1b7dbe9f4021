"""First-ready pool against barrier-synchronised vector envs, on envs whose step cost varies.

Two synthetic envs (steps per second summed over all envs; the issue's setting):

- ``straggler``: each step sleeps 0.2 ms, and one step in 20 (drawn from the env's seeded RNG)
  sleeps 8 ms instead: a simulator that mostly answers fast but sometimes stalls.
- ``cpu-variable``: each step busy-loops for an exponentially distributed time (mean 0.3 ms):
  CPU-bound work of varying cost.

Systems, each with ``--num-envs`` envs (default 16):

- ``gym-async``: gymnasium's ``AsyncVectorEnv`` (every step waits for the slowest env);
- ``envfleet-sync``: ``envfleet.make(..., backend="processes")`` stepped synchronously;
- ``envfleet-pool``: ``envfleet.make(..., batch_size=B)`` (default B = num_envs / 2), driven
  as EnvPool's asynchronous loop: ``recv()`` B envs, ``send()`` their actions back;
- ``envfleet-pool-threads``: the same on ``backend="threads"``.

Each (env, system) is measured ``--repeats`` times for ``--seconds`` after a warm-up, the
systems interleaved; the table gives medians and the ratio to gym-async within each repetition
(median). Run: ``python benchmarks/pool.py``; results go to ``benchmarks/results/pool.{md,json}``.
"""

from __future__ import annotations

import argparse
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
from gymnasium import spaces

import envfleet

RESULTS = Path(__file__).resolve().parent / "results"


class VariableCostEnv(gymnasium.Env[np.ndarray, np.int64]):
    """A step whose cost varies: ``kind="straggler"`` sleeps, ``kind="cpu-variable"`` spins."""

    def __init__(self, kind: str = "straggler"):
        self.kind = kind
        self.observation_space = spaces.Box(-1.0, 1.0, (4,), np.float32)
        self.action_space = spaces.Discrete(2)

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        return np.zeros(4, np.float32), {}

    def step(self, action: Any):
        rng = self.np_random
        if self.kind == "straggler":
            time.sleep(0.008 if rng.random() < 0.05 else 0.0002)
        else:
            end = time.perf_counter() + rng.exponential(0.0003)
            while time.perf_counter() < end:
                pass
        return rng.uniform(-1, 1, 4).astype(np.float32), 1.0, False, False, {}


def _sync_rate(envs: Any, num_envs: int, seconds: float) -> float:
    envs.reset(seed=0)
    actions = np.zeros(num_envs, np.int64)
    for _ in range(20):
        envs.step(actions)
    steps, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        envs.step(actions)
        steps += num_envs
    return steps / (time.perf_counter() - start)


def _pool_rate(envs: Any, seconds: float) -> float:
    envs.async_reset(seed=0)
    b = envs.batch_size
    actions = np.zeros(b, np.int64)
    for _ in range(20):
        *_, info = envs.recv()
        envs.send(actions, info["env_id"])
    steps, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        *_, info = envs.recv()
        envs.send(actions, info["env_id"])
        steps += b
    return steps / (time.perf_counter() - start)


def systems(kind: str, n: int, b: int) -> dict[str, Callable[[float], float]]:
    def env_fn() -> VariableCostEnv:
        return VariableCostEnv(kind)

    def gym_async(seconds: float) -> float:
        envs = gymnasium.vector.AsyncVectorEnv([env_fn] * n, shared_memory=True)
        try:
            return _sync_rate(envs, n, seconds)
        finally:
            envs.close()

    def fleet_sync(seconds: float) -> float:
        with envfleet.make(env_fn, n) as envs:
            return _sync_rate(envs, n, seconds)

    def fleet_pool(backend: str) -> Callable[[float], float]:
        def run(seconds: float) -> float:
            with envfleet.make(env_fn, n, batch_size=b, backend=backend) as envs:
                return _pool_rate(envs, seconds)

        return run

    return {
        "gym-async": gym_async,
        "envfleet-sync": fleet_sync,
        "envfleet-pool": fleet_pool("processes"),
        "envfleet-pool-threads": fleet_pool("threads"),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--envs", nargs="+", default=["straggler", "cpu-variable"])
    parser.add_argument("--num-envs", type=int, default=16)
    parser.add_argument("--batch-size", type=int, default=None)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="pool")
    args = parser.parse_args(argv)
    n = args.num_envs
    b = args.batch_size or max(1, n // 2)
    rows = []
    for kind in args.envs:
        rates: dict[str, list[float]] = {}
        ratios: dict[str, list[float]] = {}
        table = systems(kind, n, b)
        for r in range(args.repeats):
            names = list(table)
            names = names[r % len(names) :] + names[: r % len(names)]  # rotate the order
            got = {name: table[name](args.seconds) for name in names}
            for name, rate in got.items():
                rates.setdefault(name, []).append(rate)
                ratios.setdefault(name, []).append(rate / got["gym-async"])
            print(kind, r, {k: round(v) for k, v in got.items()}, file=sys.stderr)
        for name in table:
            rows.append(
                {
                    "env": kind,
                    "system": name,
                    "steps_per_s": statistics.median(rates[name]),
                    "x_gym_async": statistics.median(ratios[name]),
                    "runs": rates[name],
                }
            )
    command = "python benchmarks/pool.py " + " ".join(argv if argv is not None else sys.argv[1:])
    lines = [
        f"# First-ready pool: num_envs={n}, batch_size={b}",
        "",
        f"`{command.strip()}` on {os.cpu_count()} cores, Python {platform.python_version()}, "
        f"envfleet {envfleet.__version__}, gymnasium {gymnasium.__version__}; medians of "
        f"{args.repeats} runs of {args.seconds:g} s.",
        "",
        "| env | system | steps/s | × gym-async |",
        "|---|---|---:|---:|",
    ]
    for row in rows:
        lines.append(
            f"| {row['env']} | {row['system']} | {row['steps_per_s']:,.0f} | "
            f"{row['x_gym_async']:.2f} |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.out}.md").write_text(text)
    (RESULTS / f"{args.out}.json").write_text(
        json.dumps({"num_envs": n, "batch_size": b, "rows": rows, "command": command}, indent=2)
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
