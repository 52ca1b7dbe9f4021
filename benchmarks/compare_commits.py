"""The same workloads on two commits of envfleet, side by side in one run (before/after a change).

For a change that must not cost speed (issue 18's redesign), this measures both trees in one
run, interleaved, each measurement in a fresh interpreter whose ``PYTHONPATH`` points at that
tree's ``src/`` (the C extension is built in place in a temporary worktree of the base commit):

- ``cartpole16``: ``envfleet.make("CartPole-v1", 16)`` (processes, defaults), steps/s;
- ``pong8``: ``envfleet.make("ALE/Pong-v5", 8)`` (processes, defaults), steps/s;
- ``noop-processes`` / ``noop-serial``: µs per ``step()`` of one no-op env (the round trip);
- ``pool``: 16 straggler envs (0.2 ms a step, 8 ms one step in 20), ``batch_size=8``,
  ``recv()`` → ``send()``, steps/s.
- ``sampler-worker``: ``envfleet.Sampler("CartPole-v1", policy, 16, inference="worker")``
  (processes, defaults) with a numpy policy (the sign of the pole's lean), ``sample(1024)`` in
  a loop, transitions/s.

Only the public API is used, so any two commits compare. The table gives, per workload, the
median of each tree and the median of the per-repetition ratios (after / before), over the
whole timed run and over its quiet part: each run is timed in slices of 16 steps, and the
quiet figure is the rate of its fastest tenth of slices (:data:`QUIET`). On a shared machine
whose neighbours load it in bursts, a run's overall rate swings by ±10 % between repetitions
of one commit; its fastest slices are the ones no neighbour slowed, and their ratio is the one
that can show a few per cent (the pool and the sampler, whose slices are not alike, report
their overall rate twice).

Run: ``python benchmarks/compare_commits.py [--base REV] [--head HEAD] [--repeats 9]``; the base
defaults to :data:`REFERENCE`, the pinned reference of the step path.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import gymnasium
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
WORKLOADS = ("cartpole16", "pong8", "noop-processes", "noop-serial", "pool", "sampler-worker")
# The pinned reference of the step path (issue 42): a change to it is compared with this commit,
# --repeats 9 at least, and the table goes into its commit message.
REFERENCE = "50f379e"
# The quantile of a run's 16-step slice times whose rate is its quiet figure.
QUIET = 0.1


# -- the child: one measurement with whichever envfleet PYTHONPATH gives ----------------------


class NoopEnv(gymnasium.Env):  # type: ignore[type-arg]
    """Does nothing: the cost of a step is the vector env's own."""

    observation_space = gymnasium.spaces.Box(0, 1, (1,), np.float32)
    action_space = gymnasium.spaces.Discrete(2)

    def reset(self, *, seed: Any = None, options: Any = None) -> Any:
        super().reset(seed=seed)
        return np.zeros(1, np.float32), {}

    def step(self, action: Any) -> Any:
        return np.zeros(1, np.float32), 0.0, False, False, {}


class StragglerEnv(gymnasium.Env):  # type: ignore[type-arg]
    """Each step sleeps 0.2 ms, one in 20 (seeded) 8 ms: a simulator that sometimes stalls."""

    observation_space = gymnasium.spaces.Box(0, 1, (4,), np.float32)
    action_space = gymnasium.spaces.Discrete(2)

    def reset(self, *, seed: Any = None, options: Any = None) -> Any:
        super().reset(seed=seed)
        return np.zeros(4, np.float32), {}

    def step(self, action: Any) -> Any:
        time.sleep(0.008 if self.np_random.random() < 0.05 else 0.0002)
        return np.zeros(4, np.float32), 1.0, False, False, {}


def _timed(step: Any, seconds: float, warmup: float) -> tuple[int, float, float]:
    """``step`` for ``seconds`` after ``warmup``: (calls, seconds, seconds a call took in the
    run's quiet slices: the :data:`QUIET` quantile of its 16-call slices)."""
    end = time.perf_counter() + warmup
    while time.perf_counter() < end:
        step()
    n, t0 = 0, time.perf_counter()
    end = t0 + seconds
    slices = []
    last = t0
    while True:
        for _ in range(16):
            step()
        n += 16
        now = time.perf_counter()
        slices.append(now - last)
        last = now
        if now >= end:
            quiet = float(np.quantile(slices, QUIET)) / 16
            return n, now - t0, quiet


def lean_policy(obs: Any) -> Any:
    """CartPole: push towards the pole's lean (int64 actions, the space's dtype)."""
    return (np.asarray(obs)[:, 2] > 0).astype(np.int64)


def measure(workload: str, seconds: float) -> tuple[float, float]:
    """One run of ``workload``: (its figure over the whole run, the same over its quiet
    slices; the pool's and the sampler's: their overall figure twice)."""
    import envfleet

    if workload == "sampler-worker":
        sampler = envfleet.Sampler(
            "CartPole-v1", lean_policy, 16, inference="worker", seed=0, progress=False
        )
        try:
            sampler.sample(1024)  # warm-up: the workers get the policy, envs reset
            steps, t0 = 0, time.perf_counter()
            while time.perf_counter() - t0 < seconds:
                steps += sampler.sample(1024).num_steps
            rate = steps / (time.perf_counter() - t0)
            return rate, rate
        finally:
            sampler.close()
    if workload == "pool":
        envs = envfleet.make(StragglerEnv, 16, batch_size=8)
        try:
            envs.async_reset(seed=0)
            actions = np.zeros(8, dtype=np.int64)

            def pool_step() -> None:
                *_, info = envs.recv()
                envs.send(actions, info["env_id"])

            n, t, _ = _timed(pool_step, seconds, 0.3)
            return 8 * n / t, 8 * n / t
        finally:
            envs.close(terminate=True)
    if workload.startswith("noop"):
        backend = workload.split("-")[1]
        envs = envfleet.make(NoopEnv, 1, backend=backend)
        scale = 1e6  # µs per step
    else:
        env_id, num_envs = ("CartPole-v1", 16) if workload == "cartpole16" else ("ALE/Pong-v5", 8)
        envs = envfleet.make(env_id, num_envs)
        scale = 0.0
    try:
        envs.reset(seed=0)
        envs.action_space.seed(0)
        bank = [envs.action_space.sample() for _ in range(64)]
        k = [0]

        def step() -> None:
            envs.step(bank[k[0] & 63])
            k[0] += 1

        n, t, quiet = _timed(step, seconds, 0.5)
        if scale:
            return scale * t / n, scale * quiet
        return envs.num_envs * n / t, envs.num_envs / quiet
    finally:
        envs.close()


# -- the parent: two trees, interleaved -------------------------------------------------------


def prepare_base(base: str, where: Path) -> Path:
    """A worktree of ``base`` with its C extension built in place; returns its src/."""
    subprocess.run(
        ["git", "-C", str(ROOT), "worktree", "add", "-f", "--detach", str(where), base],
        check=True,
        capture_output=True,
    )
    subprocess.run(
        [sys.executable, "setup.py", "build_ext", "--inplace"],
        cwd=where,
        check=True,
        capture_output=True,
    )
    return where / "src"


def run_child(src: Path, workload: str, seconds: float) -> tuple[float, float]:
    env = dict(os.environ, PYTHONPATH=str(src))
    out = subprocess.run(
        [
            sys.executable,
            __file__,
            "--child",
            workload,
            "--seconds",
            str(seconds),
            "--src",
            str(src),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    if out.returncode:
        raise RuntimeError(f"{workload} on {src}: {out.stderr[-2000:]}")
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    return float(figures["value"]), float(figures["quiet"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--base",
        default=REFERENCE,
        help=f"the commit to compare with (default {REFERENCE}, the pinned reference of the "
        "step path)",
    )
    p.add_argument("--head", default=None, help="the tree after it (default: this checkout)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--seconds", type=float, default=2.0)
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--src", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        import envfleet

        if args.src and not envfleet.__file__.startswith(args.src):
            raise SystemExit(f"envfleet came from {envfleet.__file__}, not {args.src}")
        value, quiet = measure(args.child, args.seconds)
        print(json.dumps({"value": value, "quiet": quiet}))
        return 0
    workloads = args.workloads.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        trees = {"before": prepare_base(args.base, Path(tmp) / "base")}
        if args.head:
            trees["after"] = prepare_base(args.head, Path(tmp) / "head")
        else:
            trees["after"] = ROOT / "src"
        values: dict[str, dict[str, list[tuple[float, float]]]] = {
            w: {"before": [], "after": []} for w in workloads
        }
        try:
            for r in range(args.repeats):
                order = ["before", "after"] if r % 2 == 0 else ["after", "before"]
                for w in workloads:
                    for tree in order:
                        values[w][tree].append(run_child(trees[tree], w, args.seconds))
                print(f"repetition {r + 1}/{args.repeats} done", file=sys.stderr)
        finally:
            for tree in ("base", "head"):
                subprocess.run(
                    [
                        "git",
                        "-C",
                        str(ROOT),
                        "worktree",
                        "remove",
                        "--force",
                        str(Path(tmp) / tree),
                    ],
                    capture_output=True,
                )
    print(
        f"| workload (base {args.base}) | before | after | after / before (median of ratios) "
        "| quiet slices: before | after | after / before |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for w in workloads:
        unit = " µs/step" if w.startswith("noop") else " steps/s"
        cells = []
        for k in (0, 1):
            b = [v[k] for v in values[w]["before"]]
            a = [v[k] for v in values[w]["after"]]
            ratios = [y / x for x, y in zip(b, a, strict=True)]
            cells.append(
                f"{statistics.median(b):,.1f}{unit} | {statistics.median(a):,.1f}{unit} "
                f"| {statistics.median(ratios):.3f}"
            )
        print(f"| {w} | {cells[0]} | {cells[1]} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
