"""``backend="ray"`` against ``backend="processes"`` on one machine.

Envs (steps per second summed over the sub-environments, ``--num-envs`` of them, default 16):

- ``CartPole-v1``: a step costs a few microseconds: the transport's overhead is everything;
- ``Synthetic-500us`` and ``Synthetic-5ms``: each step busy-loops 0.5 ms or 5 ms (costlier
  simulators): the transport's overhead is amortised over the work.

Systems:

- ``processes``: envfleet's default layout (a worker per core but one, the driver steps a share);
- ``processes-isolated``: ``num_workers=cores``, every env in a worker (as ray's layout);
- ``ray``: ``backend="ray"`` on a local Ray cluster started by this script (one actor per core,
  envs in contiguous blocks, results through Ray's object store).

Each (env, system) is measured ``--repeats`` times for ``--seconds`` after a warm-up, the
systems interleaved; the table gives medians and, per repetition, the ratio to ``processes``
(median). The Ray cluster's own processes (GCS, raylet) stay up through every measurement.
Run: ``python benchmarks/ray_vs_processes.py``; results go to
``benchmarks/results/ray.{md,json}``.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import gymnasium
import numpy as np
from gymnasium import spaces

import envfleet

RESULTS = Path(__file__).resolve().parent / "results"


class BusyEnv(gymnasium.Env[np.ndarray, np.int64]):
    """Each step busy-loops ``cost_s`` seconds (CPU-bound work, as a simulator's)."""

    def __init__(self, cost_s: float = 0.0005):
        self.cost_s = cost_s
        self.observation_space = spaces.Box(-1.0, 1.0, (8,), np.float32)
        self.action_space = spaces.Discrete(2)

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        return np.zeros(8, np.float32), {}

    def step(self, action: Any):
        end = time.perf_counter() + self.cost_s
        while time.perf_counter() < end:
            pass
        return self.np_random.uniform(-1, 1, 8).astype(np.float32), 1.0, False, False, {}


ENVS: dict[str, Any] = {
    "CartPole-v1": "CartPole-v1",
    "Synthetic-500us": BusyEnv,
    "Synthetic-5ms": functools.partial(BusyEnv, cost_s=0.005),
}


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _make(system: str, env: Any, num_envs: int) -> envfleet.FleetVectorEnv:
    if system == "processes":
        return envfleet.make(env, num_envs, backend="processes")
    if system == "processes-isolated":
        return envfleet.make(env, num_envs, backend="processes", num_workers=_cores())
    return envfleet.make(env, num_envs, backend="ray")


def _rate(envs: envfleet.FleetVectorEnv, seconds: float) -> float:
    envs.reset(seed=0)
    actions = np.zeros(envs.num_envs, np.int64)
    for _ in range(50):
        envs.step(actions)
    steps, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        envs.step(actions)
        steps += envs.num_envs
    return steps / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-envs", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--systems", default="processes,processes-isolated,ray")
    args = parser.parse_args()
    systems = args.systems.split(",")

    import ray

    ray.init(num_cpus=_cores(), include_dashboard=False, log_to_driver=False)
    rates: dict[str, dict[str, list[float]]] = {e: {s: [] for s in systems} for e in ENVS}
    for env_name, env in ENVS.items():
        for r in range(args.repeats):
            for system in systems:
                envs = _make(system, env, args.num_envs)
                try:
                    rate = _rate(envs, args.seconds)
                finally:
                    envs.close()
                rates[env_name][system].append(rate)
                print(f"{env_name:16s} {system:20s} rep {r}: {rate:12,.0f} steps/s", flush=True)
    ray.shutdown()

    rows = []
    for env_name, by_system in rates.items():
        base = by_system.get("processes")
        for system, values in by_system.items():
            ratio = (
                statistics.median(v / b for v, b in zip(values, base, strict=True))
                if base
                else float("nan")
            )
            rows.append(
                {
                    "env": env_name,
                    "system": system,
                    "steps_per_s": statistics.median(values),
                    "runs": values,
                    "x_processes": ratio,
                }
            )
    info = {
        "command": " ".join(["python", "benchmarks/ray_vs_processes.py", *sys.argv[1:]]),
        "cores": _cores(),
        "python": platform.python_version(),
        "envfleet": envfleet.__version__,
        "ray": ray.__version__,
        "num_envs": args.num_envs,
        "seconds": args.seconds,
        "repeats": args.repeats,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "ray.json").write_text(json.dumps({"info": info, "rows": rows}, indent=2) + "\n")
    lines = [
        f"# backend='ray' against backend='processes': num_envs={args.num_envs}",
        "",
        f"`{info['command']}` on {info['cores']} cores, Python {info['python']}, envfleet "
        f"{info['envfleet']}, ray {info['ray']}; medians of {args.repeats} runs of "
        f"{args.seconds:g} s.",
        "",
        "| env | system | steps/s | × processes |",
        "|---|---|---:|---:|",
    ]
    for row in rows:
        lines.append(
            f"| {row['env']} | {row['system']} | {row['steps_per_s']:,.0f} | "
            f"{row['x_processes']:.2f} |"
        )
    (RESULTS / "ray.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
