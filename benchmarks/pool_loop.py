"""The first-ready pool loop against the plain loop, with a torch policy choosing every action.

Two workloads (issue 19's): ``CartPole-v1`` x16 with an MLP 64-64 tanh policy, and
``ALE/Pong-v5`` x8 (``frameskip=1`` + ``AtariPreprocessing(frame_skip=4, screen_size=84,
grayscale_obs=True)`` + ``FrameStackObservation(4)``, observations / 255) with the Nature CNN:
the workloads and CleanRL's actors of ``envfleet bench --policy`` (``envfleet.bench``). torch
runs with one thread; actions are sampled from a Categorical over the policy's logits.

Systems, on ``backend="processes"`` with make()'s defaults otherwise:

- ``plain``: ``envfleet.make(env, N)``; loop: policy on the N observations -> ``step``;
- ``pool``: ``envfleet.make(env, N, batch_size=N/2)``, ``async_reset``; loop: ``recv`` ->
  policy on the batch -> ``send(actions, info["env_id"])`` (EnvPool's asynchronous loop);
- ``pool-wK`` (``--pool-workers K ...``): the pool with ``num_workers=K``.

Each (workload, system) is measured ``--repeats`` times for ``--seconds`` after a warm-up, the
systems interleaved (the order rotates every repetition); the table gives medians of steps/s
and the median, over repetitions, of each system's ratio to ``plain`` in the same repetition,
and the driver's CPU time per env step (less disturbed by other load than steps/s). A second
table gives each workload's ideal plain and pool rates from ``T_p`` (the policy's time for a
batch) and ``t_env`` (one env's step), measured first (see :func:`bounds`).

Run: ``python benchmarks/pool_loop.py`` (about 2 minutes on 2 cores); results go to
``benchmarks/results/pool_loop.{md,json}``.
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
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gymnasium
import numpy as np
import torch

import envfleet
from envfleet.bench import TorchPolicy, make_env

RESULTS = Path(__file__).resolve().parent / "results"


# The benchmark's workloads and CleanRL's actors, as envfleet bench --policy builds them.
WORKLOADS: dict[str, tuple[Callable[[], gymnasium.Env[Any, Any]], int, str]] = {
    "CartPole-v1": (functools.partial(make_env, "CartPole-v1"), 16, "mlp"),
    "ALE/Pong-v5": (functools.partial(make_env, "ALE/Pong-v5", True), 8, "cnn"),
}


def make_act(kind: str, env: gymnasium.Env[Any, Any]) -> Callable[[np.ndarray], np.ndarray]:
    """obs batch (numpy) -> sampled actions (int64 numpy): envfleet.bench.TorchPolicy."""
    return TorchPolicy(kind, env.observation_space, env.action_space, seed=0)


Rate = tuple[float, float]  # (steps/s, the driver's CPU µs per env step)


def plain_rate(envs: Any, act: Callable[[np.ndarray], np.ndarray], seconds: float) -> Rate:
    obs, _ = envs.reset(seed=0)
    n = envs.num_envs
    warm_end = time.perf_counter() + min(0.5, seconds / 4)
    while time.perf_counter() < warm_end:
        obs, *_ = envs.step(act(obs))
    steps, start, cpu = 0, time.perf_counter(), time.process_time()
    while time.perf_counter() - start < seconds:
        obs, *_ = envs.step(act(obs))
        steps += n
    return steps / (time.perf_counter() - start), (time.process_time() - cpu) / steps * 1e6


def pool_rate(envs: Any, act: Callable[[np.ndarray], np.ndarray], seconds: float) -> Rate:
    envs.async_reset(seed=0)
    b = envs.batch_size
    warm_end = time.perf_counter() + min(0.5, seconds / 4)
    while time.perf_counter() < warm_end:
        obs, *_, info = envs.recv()
        envs.send(act(obs), info["env_id"])
    steps, start, cpu = 0, time.perf_counter(), time.process_time()
    while time.perf_counter() - start < seconds:
        obs, *_, info = envs.recv()
        envs.send(act(obs), info["env_id"])
        steps += b
    return steps / (time.perf_counter() - start), (time.process_time() - cpu) / steps * 1e6


def _median_s(call: Callable[[], Any], seconds: float) -> float:
    for _ in range(3):
        call()
    times: list[float] = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end or len(times) < 5:
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bounds(name: str, seconds: float = 1.0) -> dict[str, float]:
    """``T_p`` for a batch of N and of N/2, one env's step ``t_env`` (all in this process,
    seconds), and the ideal rates: the plain loop's ``N / (T_p(N) + N t_env / cores)`` (its
    policy and its envs take turns), the pool's ``B / max(T_p(B), (T_p(B) + B t_env) /
    cores)`` (policy and envs perfectly overlapped) with B = N/2."""
    env_fn, n, kind = WORKLOADS[name]
    env = env_fn()
    act = make_act(kind, env)
    obs, _ = env.reset(seed=0)
    tp = {b: _median_s(functools.partial(act, np.stack([obs] * b)), seconds) for b in (n, n // 2)}

    def env_step() -> None:
        _, _, terminated, truncated, _ = env.step(env.action_space.sample())
        if terminated or truncated:
            env.reset()

    t_env = _median_s(env_step, seconds)
    env.close()
    cores = len(os.sched_getaffinity(0))
    b = n // 2
    plain = n / (tp[n] + n * t_env / cores)
    pool = b / max(tp[b], (tp[b] + b * t_env) / cores)
    return {"tp_n": tp[n], "tp_half": tp[b], "t_env": t_env, "plain": plain, "pool": pool}


def systems(name: str, pool_workers: list[int]) -> dict[str, Callable[[float], Rate]]:
    env_fn, n, kind = WORKLOADS[name]
    probe = env_fn()
    act = make_act(kind, probe)
    probe.close()

    def plain(seconds: float) -> Rate:
        with envfleet.make(env_fn, n) as envs:
            return plain_rate(envs, act, seconds)

    def pool(workers: int | None) -> Callable[[float], Rate]:
        def run(seconds: float) -> Rate:
            with envfleet.make(env_fn, n, batch_size=n // 2, num_workers=workers) as envs:
                return pool_rate(envs, act, seconds)

        return run

    table = {"plain": plain, "pool": pool(None)}
    for k in pool_workers:
        table[f"pool-w{k}"] = pool(k)
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--envs", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--pool-workers", type=int, nargs="*", default=[])
    parser.add_argument("--out", default="pool_loop")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    ideal = {}
    for name in args.envs:
        ideal[name] = bounds(name)
        print(name, "bounds", ideal[name], file=sys.stderr)
        table = systems(name, args.pool_workers)
        rates: dict[str, list[float]] = {}
        cpus: dict[str, list[float]] = {}
        ratios: dict[str, list[float]] = {}
        for r in range(args.repeats):
            names = list(table)
            names = names[r % len(names) :] + names[: r % len(names)]  # rotate the order
            got = {system: table[system](args.seconds) for system in names}
            for system, (rate, cpu) in got.items():
                rates.setdefault(system, []).append(rate)
                cpus.setdefault(system, []).append(cpu)
                ratios.setdefault(system, []).append(rate / got["plain"][0])
            print(name, r, {k: round(v[0]) for k, v in got.items()}, file=sys.stderr)
        for system in table:
            rows.append(
                {
                    "env": name,
                    "num_envs": WORKLOADS[name][1],
                    "system": system,
                    "steps_per_s": statistics.median(rates[system]),
                    "driver_cpu_us_per_step": statistics.median(cpus[system]),
                    "x_plain": statistics.median(ratios[system]),
                    "runs": rates[system],
                }
            )
    command = "python benchmarks/pool_loop.py " + " ".join(
        argv if argv is not None else sys.argv[1:]
    )
    lines = [
        "# Pool loop (batch_size = num_envs / 2) against the plain loop, torch policy",
        "",
        f"`{command.strip()}` on {os.cpu_count()} cores, Python {platform.python_version()}, "
        f"torch {torch.__version__} (1 thread), envfleet {envfleet.__version__}; medians of "
        f"{args.repeats} runs of {args.seconds:g} s, interleaved.",
        "",
        "| env | N | system | steps/s | x plain | driver CPU µs/step |",
        "|---|---:|---|---:|---:|---:|",
    ]
    for row in rows:
        lines.append(
            f"| {row['env']} | {row['num_envs']} | {row['system']} | "
            f"{row['steps_per_s']:,.0f} | {row['x_plain']:.2f} | "
            f"{row['driver_cpu_us_per_step']:.1f} |"
        )
    lines += [
        "",
        "Ideal rates from T_p and t_env measured in the driver (policy and envs on the cores, "
        "no transport): the plain loop alternates policy and envs, the pool overlaps them.",
        "",
        "| env | T_p(N) µs | T_p(N/2) µs | t_env µs | plain ideal | pool ideal | pool/plain |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, b in ideal.items():
        lines.append(
            f"| {name} | {b['tp_n'] * 1e6:.0f} | {b['tp_half'] * 1e6:.0f} | "
            f"{b['t_env'] * 1e6:.1f} | {b['plain']:,.0f} | {b['pool']:,.0f} | "
            f"{b['pool'] / b['plain']:.2f} |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.out}.md").write_text(text)
    (RESULTS / f"{args.out}.json").write_text(
        json.dumps({"rows": rows, "bounds": ideal, "command": command}, indent=2)
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
