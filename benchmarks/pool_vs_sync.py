"""The first-ready pool against the synchronous loop, random actions, ``make()`` defaults.

For each case ``ENV:NUM_ENVS`` two loops over ``envfleet.make(ENV, NUM_ENVS)`` with its default
backend and workers, random actions drawn in advance:

- ``sync``: ``step(actions)`` on every env;
- ``pool``: ``make(..., batch_size=B)`` (default ``B = NUM_ENVS // 2``) driven as EnvPool's
  asynchronous loop: ``recv()`` B envs, ``send()`` their actions back by ``info["env_id"]``.

Each loop runs ``--repeats`` times for ``--seconds`` after a warm-up, the two interleaved; the
table gives median env steps per second, the median ratio pool / sync within each repetition
and the workers each loop got (issue 42, item 4: the pool's default workers follow the usable
cores, and the pool must not fall below the synchronous loop on CartPole).

Run: ``python benchmarks/pool_vs_sync.py [--cases CartPole-v1:64 ALE/Pong-v5:64]``; results go
to ``benchmarks/results/pool_vs_sync.{md,json}`` (``--out``) with the machine and the commit.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import envfleet
from envfleet.bench import describe_machine

RESULTS = Path(__file__).resolve().parent / "results"


def measured_on() -> dict[str, Any]:
    """The commit measured and the machine (envfleet.bench's description): ``commit``,
    ``line`` (CPU model, usable cores, date, for a table's header) and ``doc`` (for JSON)."""
    machine = describe_machine()
    commit = subprocess.run(
        ["git", "-C", str(RESULTS.parent), "rev-parse", "--short", "HEAD"],
        capture_output=True,
        text=True,
    ).stdout.strip()
    line = f"{machine.cpu_model}, {machine.cores} usable cores, {time.strftime('%Y-%m-%d')}"
    return {
        "commit": commit,
        "line": line,
        "doc": {"commit": commit, "machine": dataclasses.asdict(machine)},
    }


def save(out: str, header: str, lines: list[str], doc: dict[str, Any]) -> None:
    """Print the table and write ``<out>.md`` (header and table) and ``<out>.json`` (``doc``);
    ``out`` is a name under benchmarks/results or a path prefix."""
    table = "\n".join(lines) + "\n"
    print(table)
    path = Path(out) if "/" in out else RESULTS / out
    path.parent.mkdir(parents=True, exist_ok=True)
    path.with_suffix(".md").write_text(header + table)
    path.with_suffix(".json").write_text(json.dumps(doc, indent=1))


def _loop(env: str, n: int, batch: int | None) -> tuple[Callable[[], int], Any]:
    """(one call: the env steps it did, the vector env)."""
    envs = envfleet.make(env, n, batch_size=batch)
    envs.action_space.seed(0)
    bank = [envs.action_space.sample() for _ in range(64)]
    k = 0
    if batch is None:
        envs.reset(seed=0)

        def step() -> int:
            nonlocal k
            k += 1
            envs.step(bank[k & 63])
            return n

        return step, envs
    envs.async_reset(seed=0)

    def pair() -> int:
        nonlocal k
        k += 1
        info = envs.recv()[-1]
        envs.send(bank[k & 63][:batch], info["env_id"])
        return batch

    return pair, envs


def measure(call: Callable[[], int], seconds: float, warmup: float) -> float:
    end = time.perf_counter() + warmup
    while time.perf_counter() < end:
        call()
    steps, start = 0, time.perf_counter()
    while (now := time.perf_counter()) - start < seconds:
        steps += call()
    return steps / (now - start)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", default=["CartPole-v1:64", "ALE/Pong-v5:64"])
    parser.add_argument("--batch-fraction", type=float, default=0.5)
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--warmup", type=float, default=0.5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="pool_vs_sync")
    args = parser.parse_args(argv)
    rows = []
    for case in args.cases:
        env, n_text = case.rsplit(":", 1)
        n = int(n_text)
        batch = max(1, int(n * args.batch_fraction))
        rates: dict[str, list[float]] = {"sync": [], "pool": []}
        workers: dict[str, int] = {}
        for rep in range(args.repeats):
            for mode in ("sync", "pool"):
                call, envs = _loop(env, n, None if mode == "sync" else batch)
                try:
                    rates[mode].append(measure(call, args.seconds, args.warmup))
                    workers[mode] = envs.num_workers
                finally:
                    envs.close()
                print(f"{case} {mode} rep {rep}: {rates[mode][-1]:,.0f} steps/s", file=sys.stderr)
        rows.append(
            {
                "env": env,
                "num_envs": n,
                "batch_size": batch,
                "sync": statistics.median(rates["sync"]),
                "pool": statistics.median(rates["pool"]),
                "ratio": statistics.median(
                    p / s for p, s in zip(rates["pool"], rates["sync"], strict=True)
                ),
                "sync_all": rates["sync"],
                "pool_all": rates["pool"],
                "sync_workers": workers["sync"],
                "pool_workers": workers["pool"],
            }
        )
    where = measured_on()
    lines = [
        "| env | num_envs | sync steps/s (workers) | pool steps/s (workers, batch) | pool / sync |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['env']} | {r['num_envs']} | {r['sync']:,.0f} ({r['sync_workers']}) | "
            f"{r['pool']:,.0f} ({r['pool_workers']}, {r['batch_size']}) | {r['ratio']:.2f} |"
        )
    header = (
        "# The first-ready pool against the synchronous loop\n\n"
        f"envfleet {envfleet.__version__} at {where['commit']}, {where['line']}; median of "
        f"{args.repeats} x {args.seconds} s, interleaved; random actions, make() defaults.\n\n"
        f"Command: `python benchmarks/pool_vs_sync.py {' '.join(argv or sys.argv[1:])}`\n\n"
    )
    save(args.out, header, lines, {"args": vars(args), **where["doc"], "rows": rows})


if __name__ == "__main__":
    main()
