"""Where a round goes as the workers grow: the anatomy of ``make(ENV, N, num_workers=W)``.

For each worker count ``W`` (every env in a worker: ``driver_envs=0``), one run of
``--seconds`` synchronous steps with random actions drawn in advance, and per round (one
``step()`` of the vector env):

- steps/s (env steps, summed over the sub-environments);
- the driver's CPU time and system time (``getrusage``), its voluntary and involuntary
  context switches (a voluntary one is a wait that blocked: a wake-up);
- the workers' CPU and system time and context switches, summed over the workers (psutil),
  and each worker's time stepping its envs (the group's step, from ``envs.stats``), the rest
  of the round being the time it waited for its command and handed its results back;
- an env's step in a worker (a worker's stepping time over its envs) against the same env
  stepped alone in a plain loop in this process, before the runs (``alone``): the ratio is
  how much slower an env steps in a worker.

``--env noop`` steps a no-op env (the vector env's own cost): on a small machine this is the
proxy for a large one (issue 42, item 7): the driver's system calls and CPU per round against
``W`` tell whether the round's cost grows with the workers, whatever the cores. The fit
``driver CPU per round = a + b * W`` is printed with each run.

Run: ``python benchmarks/scale.py --env CartPole-v1 --num-envs 64 --workers 1,2,4,8``
(about ``len(workers) * (seconds + 2)`` seconds); ``--json FILE`` keeps every figure with the
machine and the commit. Nothing here is asserted: a smoke test runs it briefly.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import gymnasium
import numpy as np
import psutil
from compare_commits import NoopEnv  # the same no-op env (benchmarks/ is this script's path)

import envfleet
from envfleet.bench import describe_machine

ROOT = Path(__file__).resolve().parent.parent


def factory(env: str) -> Any:
    return NoopEnv if env == "noop" else env


def alone_us(env: str, seconds: float) -> float:
    """µs per step of one env in a plain loop in this process (its resets included)."""
    e = NoopEnv() if env == "noop" else gymnasium.make(env)
    e.reset(seed=0)
    e.action_space.seed(0)
    actions = [e.action_space.sample() for _ in range(256)]
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        for a in actions:
            _, _, terminated, truncated, _ = e.step(a)
            if terminated or truncated:
                e.reset()
        n += len(actions)
    e.close()
    return (time.perf_counter() - start) / n * 1e6


def _workers_usage(procs: list[psutil.Process]) -> tuple[float, float, int, int]:
    user = system = voluntary = involuntary = 0
    for p in procs:
        t, c = p.cpu_times(), p.num_ctx_switches()
        user += t.user
        system += t.system
        voluntary += c.voluntary
        involuntary += c.involuntary
    return user, system, voluntary, involuntary


def measure(env: str, num_envs: int, workers: int, seconds: float) -> dict[str, Any]:
    envs = envfleet.make(
        factory(env), num_envs, num_workers=workers, backend=envfleet.Processes(driver_envs=0)
    )
    try:
        envs.reset(seed=0)
        envs.action_space.seed(0)
        bank = [envs.action_space.sample() for _ in range(64)]
        for i in range(200):
            envs.step(bank[i & 63])
        procs = psutil.Process().children()
        stepped0 = [w.count * w.mean_s for w in envs.stats.workers]
        counts0 = [w.count for w in envs.stats.workers]
        w0, r0 = _workers_usage(procs), resource.getrusage(resource.RUSAGE_SELF)
        rounds, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            for i in range(16):
                envs.step(bank[i & 63])
            rounds += 16
        wall = time.perf_counter() - start
        w1, r1 = _workers_usage(procs), resource.getrusage(resource.RUSAGE_SELF)
        stats = envs.stats.workers
        stepped = [s.count * s.mean_s - s0 for s, s0 in zip(stats, stepped0, strict=True)]
        counts = [s.count - c0 for s, c0 in zip(stats, counts0, strict=True)]
    finally:
        envs.close()
    per_round = 1e6 / rounds
    envs_per_worker = num_envs / workers
    stepping_us = statistics.mean(t / max(c, 1) * 1e6 for t, c in zip(stepped, counts, strict=True))
    return {
        "workers": workers,
        "steps_per_s": rounds * num_envs / wall,
        "round_us": wall * per_round,
        "driver_cpu_us": (r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime) * per_round,
        "driver_sys_us": (r1.ru_stime - r0.ru_stime) * per_round,
        "driver_wakeups": (r1.ru_nvcsw - r0.ru_nvcsw) / rounds,
        "driver_preempted": (r1.ru_nivcsw - r0.ru_nivcsw) / rounds,
        "workers_cpu_us": (w1[0] + w1[1] - w0[0] - w0[1]) * per_round,
        "workers_sys_us": (w1[1] - w0[1]) * per_round,
        "workers_wakeups": (w1[2] - w0[2]) / rounds,
        "workers_preempted": (w1[3] - w0[3]) / rounds,
        "worker_stepping_us": stepping_us,
        "worker_waiting_us": wall * per_round - stepping_us,
        "env_step_in_worker_us": stepping_us / envs_per_worker,
    }


def fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least squares ``y = a + b x``."""
    if len(xs) < 2:
        return (ys[0] if ys else 0.0), 0.0
    b, a = np.polyfit(np.asarray(xs, float), np.asarray(ys, float), 1)
    return float(a), float(b)


def machine() -> dict[str, Any]:
    """envfleet.bench's description of this machine (CPU model, usable cores, versions), with
    the commit measured and the date."""
    commit = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    described = dataclasses.asdict(describe_machine())
    return {**described, "commit": commit, "date": time.strftime("%Y-%m-%d")}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--env", default="CartPole-v1", help="a gymnasium id, or noop")
    p.add_argument("--num-envs", type=int, default=64)
    p.add_argument("--workers", default="1,2,4,8", help="comma-separated worker counts")
    p.add_argument("--seconds", type=float, default=2.0)
    p.add_argument("--json", default=None, help="write every figure here")
    args = p.parse_args(argv)
    counts = [int(w) for w in args.workers.split(",") if int(w) <= args.num_envs]
    alone = alone_us(args.env, min(args.seconds, 1.0))
    rows = [measure(args.env, args.num_envs, w, args.seconds) for w in counts]
    for row in rows:
        row["env_step_alone_us"] = alone
        row["slowdown_in_worker"] = row["env_step_in_worker_us"] / alone
    a, b = fit([r["workers"] for r in rows], [r["driver_cpu_us"] for r in rows])
    # Without the system time: on a machine with a core per worker the workers spin between
    # rounds instead of sleeping, and the round's futex wake of W sleepers (the kernel's work,
    # in the driver's system time here) is not paid (issue 42, item 7: the 16-core bound).
    a_user, b_user = fit(
        [r["workers"] for r in rows], [r["driver_cpu_us"] - r["driver_sys_us"] for r in rows]
    )
    print(
        f"{args.env} x{args.num_envs}, every env in a worker, {args.seconds:g} s a run "
        f"({os.cpu_count()} CPUs, {envfleet.usable_cores()} usable); per round:"
    )
    print(
        "| W | steps/s | round µs | driver CPU µs | driver sys µs | driver wake-ups | "
        "workers CPU µs | workers sys µs | workers wake-ups | a worker stepping µs | "
        "waiting µs | env step in a worker µs (x alone) |"
    )
    print("|" + "---:|" * 12)
    for r in rows:
        print(
            f"| {r['workers']} | {r['steps_per_s']:,.0f} | {r['round_us']:.1f} | "
            f"{r['driver_cpu_us']:.1f} | {r['driver_sys_us']:.1f} | {r['driver_wakeups']:.2f} | "
            f"{r['workers_cpu_us']:.1f} | {r['workers_sys_us']:.1f} | "
            f"{r['workers_wakeups']:.2f} | {r['worker_stepping_us']:.1f} | "
            f"{r['worker_waiting_us']:.1f} | {r['env_step_in_worker_us']:.2f} "
            f"({r['slowdown_in_worker']:.2f}) |"
        )
    print(
        f"env step alone: {alone:.2f} µs; driver CPU per round ~ {a:.1f} + {b:.2f} x W µs "
        f"(without its system time: {a_user:.1f} + {b_user:.2f} x W µs)"
    )
    if args.json:
        document = {
            "command": sys.argv,
            "machine": machine(),
            "env": args.env,
            "num_envs": args.num_envs,
            "driver_cpu_fit_us": {"a": a, "b_per_worker": b},
            "driver_user_fit_us": {"a": a_user, "b_per_worker": b_user},
            "rows": rows,
        }
        Path(args.json).write_text(json.dumps(document, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
