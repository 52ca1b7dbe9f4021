"""The learner's loop: every system stepped by a real torch policy, against two bounds.

Workloads (CleanRL's PPO actor on the CPU, ``torch.set_num_threads(1)``, Categorical
sampling; see ``envfleet.bench.TorchPolicy``):

- ``cartpole``: ``CartPole-v1`` x16, MLP 64-64 tanh;
- ``lunarlander``: ``LunarLander-v3`` x16, the same MLP;
- ``pong``: ``ALE/Pong-v5`` x8, Nature CNN, ``frameskip=1`` + ``AtariPreprocessing(frame_skip=4,
  screen_size=84, grayscale_obs=True)`` + ``FrameStackObservation(4)``, observations / 255;
- ``halfcheetah``: ``HalfCheetah-v5`` x8 (MuJoCo: ``pip install 'envfleet[mujoco]'``), the MLP
  with a Gaussian head (CleanRL's continuous-action PPO actor);
- ``cartpole64`` and ``atari32``: the learner's loops of a 16-core machine (issue 42, item 5):
  ``CartPole-v1`` x64 with the MLP, and ``pong``'s Atari as trained (sticky actions 0.25,
  ALE v5's default) x32 with the CNN; not in the default set, which a 2-core machine runs.

Systems (``envfleet.bench.POLICY_SYSTEMS``): gymnasium's SyncVectorEnv and AsyncVectorEnv in a
plain loop (obs -> policy -> step); PufferLib 3's ``Multiprocessing`` vector env, one worker in
a plain loop and two workers with recv/send (a row with the install command when pufferlib is
missing); EnvPool's own gymnasium API on the task doing the workload's work (its native
task; an Atari workload's frames as its wrappers make them, ``envfleet.bench._policy_loop
.envpool_workload_task``) in a plain loop and in the storing one (CleanRL's
``ppo_atari_envpool.py`` rollout; skipped where EnvPool is missing or has no such task);
envfleet's ``make()`` in a plain loop; envfleet's first-ready pool
(``batch_size = N/2``: recv -> policy -> send); ``envfleet.Sampler`` with driver and with worker
inference (``sample(64 N)`` in a loop). The loop a learner writes, ``gym-sync-store``,
``gym-async-store``, ``puffer-sync-store``, ``envpool-store`` and ``envfleet-store``: the
plain loop of the same system that also writes each step's observations, actions, rewards and
dones (terminated | truncated) into preallocated ``[T, N, ...]`` numpy arrays (T = 128,
wrapping around), as CleanRL's PPO rollout does. Every system counts transitions: a step
that only resets an env whose episode ended in the step before (gymnasium's ``NEXT_STEP``
autoreset, PufferLib's, EnvPool's; the action is ignored) is not one.

The bounds, from ``T_p(n)`` the policy's time on a batch of n (measured at n = N, N/2, N/4),
``t_env`` one env's step time in a plain loop (measured) and ``cores`` those this process may
use (affinity): the overlap bound ``N / max(T_p(N), (T_p(N) + N t_env) / cores)``, one policy
call on the whole batch overlapping the envs, which no loop reaches; and the schedule bound, the
best of the structures a loop can take (``envfleet.bench.schedule_structures``): one call then
the envs, ``N / (T_p(N) + N t_env / cores)``; k = 2, 4 groups alternating,
``N / max(k T_p(N/k), (k T_p(N/k) + N t_env) / cores)``; the policy in each of w = 2, 4
workers, ``N / max(T_p(N/w) + N/w t_env, (w T_p(N/w) + N t_env) / cores)``; the table names the
structure that attains it. Each workload's systems are interleaved over ``--repeats``
repetitions; the table gives median steps/s, its fraction of each bound and the median of the
per-repetition ratios to the faster gymnasium loop, the fastest peer, envfleet's plain loop
and envfleet's storing loop. This is the code of ``envfleet bench --policy {mlp,cnn}``
(``envfleet.bench.measure_policy_loop``), run over several workloads.

Run: ``python benchmarks/policy_loop.py [--workloads cartpole,pong] [--repeats 3]
[--seconds 2] [--json FILE]``. Needs torch; Pong needs ale-py and OpenCV.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
from pathlib import Path

from envfleet.bench import (
    POLICY_SYSTEMS,
    Workload,
    check_workload,
    measure_policy_loop,
    policy_report_dict,
    policy_table,
    require_torch,
)

WORKLOADS = {
    "cartpole": Workload("CartPole-v1", 16, "mlp"),
    "lunarlander": Workload("LunarLander-v3", 16, "mlp"),
    "pong": Workload("ALE/Pong-v5", 8, "cnn", atari=True),
    "halfcheetah": Workload("HalfCheetah-v5", 8, "mlp"),
    "cartpole64": Workload("CartPole-v1", 64, "mlp"),
    "atari32": Workload("ALE/Pong-v5", 32, "cnn", atari=True),
}
DEFAULT_WORKLOADS = ("cartpole", "lunarlander", "pong", "halfcheetah")


def _names(text: str, available: list[str], kind: str) -> list[str]:
    names = [part.strip() for part in text.split(",") if part.strip()]
    for name in names:
        if name not in available:
            raise SystemExit(f"unknown {kind} {name!r}; choose from {', '.join(available)}")
    return list(dict.fromkeys(names))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--workloads", default=",".join(DEFAULT_WORKLOADS), help="comma-separated")
    parser.add_argument("--systems", default=",".join(POLICY_SYSTEMS), help="comma-separated")
    parser.add_argument("--seconds", type=float, default=2.0, help="timed seconds per system")
    parser.add_argument("--repeats", type=int, default=3, help="repetitions, interleaved")
    parser.add_argument("--json", type=Path, default=None, metavar="FILE", help="write JSON")
    parser.add_argument(
        "--device", default="cpu", help="torch device of the policy (cpu; cuda where a GPU is)"
    )
    args = parser.parse_args(argv)
    chosen = [WORKLOADS[w] for w in _names(args.workloads, list(WORKLOADS), "workload")]
    systems = _names(args.systems, list(POLICY_SYSTEMS), "system")
    require_torch()
    for workload in chosen:
        check_workload(workload)

    def progress(name: str, system: str, rep: int) -> None:
        print(f"  {name}: {system} (repetition {rep + 1})", file=sys.stderr, flush=True)

    print(f"`{' '.join(['python', 'benchmarks/policy_loop.py', *(argv or sys.argv[1:])])}`\n")
    reports = []
    for workload in chosen:
        report = measure_policy_loop(
            workload,
            systems,
            args.seconds,
            repeats=args.repeats,
            progress=progress,
            device=args.device,
        )
        reports.append(report)
        print(policy_table(report), flush=True)
    if args.json is not None:
        doc = {
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "python": platform.python_version(),
            "machine": platform.machine(),
            "device": args.device,
            "argv": argv if argv is not None else sys.argv[1:],
            "reports": [policy_report_dict(r) for r in reports],
        }
        args.json.write_text(json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
