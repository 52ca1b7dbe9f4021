"""Throughput measurement: the core of ``envfleet bench`` (DESIGN §2, layer 7).

Measures env steps per second of envfleet backends and of gymnasium's own vector envs on the
same environment, so that the numbers can be compared. Nothing here prints: results come back
as dataclasses and progress goes to an optional callback; the CLI (:mod:`envfleet.cli`)
renders both.

The learner's loop (``envfleet bench --policy``): :func:`measure_policy_loop` steps every
system of :data:`POLICY_SYSTEMS` with a torch policy choosing the actions (CleanRL's PPO actor,
:class:`TorchPolicy`) and compares each with the overlap bound (:func:`overlap_bound`).

Systems:

- ``"serial"``, ``"processes"``: ``envfleet.make(env_id, num_envs, backend=name)`` with every
  other argument at its default.
- ``"gym-sync"``: ``gymnasium.vector.SyncVectorEnv([lambda: gymnasium.make(env_id)] * num_envs)``.
- ``"gym-async"``: ``gymnasium.vector.AsyncVectorEnv`` on the same factories (its defaults:
  ``shared_memory=True``, the platform's start method).

Method, the same for every system: build the vector env and ``reset(seed=0)``; draw a fixed
bank of :data:`ACTION_BANK` batched actions from ``envs.action_space`` seeded with the same seed
(so drawing actions is not timed); warm up; then step through the bank for the time budget,
reading the clock every few steps (a batch of steps lasts at most about 2 ms), and close the
env whatever happens. Throughput counts env steps summed over all sub-environments:
``num_envs * batch_steps / seconds``.
"""

from __future__ import annotations

from envfleet._bench_core import (
    ACTION_BANK,
    BASELINES,
    SYSTEMS,
    BenchError,
    BenchProgress,
    BenchResult,
    ProgressCallback,
    baseline_ratios,
    measure,
    measure_system,
    timed_loop,
)
from envfleet._bench_policies import (
    POLICY_KINDS,
    TORCH_INSTALL,
    TorchPolicy,
    Workload,
    check_workload,
    make_env,
    require_torch,
    workloads,
)
from envfleet._front.factories import check_env_id
from envfleet._policy_loop import (
    POLICY_SYSTEMS,
    PUFFER_INSTALL,
    PolicyBound,
    PolicyLoopReport,
    PolicyLoopResult,
    measure_bound,
    measure_policy_loop,
    overlap_bound,
    policy_report_dict,
    policy_table,
    usable_cores,
)

__all__ = [
    "ACTION_BANK",
    "BASELINES",
    "POLICY_KINDS",
    "POLICY_SYSTEMS",
    "PUFFER_INSTALL",
    "SYSTEMS",
    "TORCH_INSTALL",
    "BenchError",
    "BenchProgress",
    "BenchResult",
    "PolicyBound",
    "PolicyLoopReport",
    "PolicyLoopResult",
    "ProgressCallback",
    "TorchPolicy",
    "Workload",
    "baseline_ratios",
    "check_env_id",
    "check_workload",
    "make_env",
    "measure",
    "measure_bound",
    "measure_policy_loop",
    "measure_system",
    "overlap_bound",
    "policy_report_dict",
    "policy_table",
    "require_torch",
    "timed_loop",
    "usable_cores",
    "workloads",
]
