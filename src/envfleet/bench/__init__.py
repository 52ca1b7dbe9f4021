"""Throughput measurement: the core of ``envfleet bench`` (layer 2 in docs/architecture.md).

Measures env steps per second of envfleet backends and of their peers (other libraries'
vector envs) on the same environment, swept over ``num_envs``, beside the machine's limit, so
that the numbers can be compared (:func:`run_bench`; :func:`plot_report` draws them). Nothing
here prints: results come back as dataclasses and progress goes to an optional callback; the
CLI (:mod:`envfleet.cli`) renders both.

The learner's loop (``envfleet bench --policy``): :func:`measure_policy_loop` steps every
system of :data:`POLICY_SYSTEMS` with a torch policy choosing the actions (CleanRL's PPO actor,
:class:`TorchPolicy`) and compares each with the overlap bound (:func:`overlap_bound`) and the
schedule bound (:func:`schedule_bound`: the best of the structures a loop can take,
:func:`schedule_structures`, from the policy's time at the sizes of :func:`schedule_sizes`).
Its ``*-store`` systems (:data:`STORE_SYSTEMS`) are the loop a learner writes: the plain loop
storing each step's observations, actions, rewards and dones in ``[T, N, ...]`` arrays
(``T =`` :data:`ROLLOUT_STEPS`, CleanRL's rollout).

Systems:

- ``"serial"``, ``"processes"``: ``envfleet.make(env_id, num_envs, backend=name)`` with every
  other argument at its default.
- ``"gym-sync"``: ``gymnasium.vector.SyncVectorEnv([lambda: gymnasium.make(env_id)] * num_envs)``.
- ``"gym-async"``: ``gymnasium.vector.AsyncVectorEnv`` on the same factories (its defaults:
  ``shared_memory=True``, the platform's start method).
- ``"sb3-subproc"``: stable-baselines3's ``SubprocVecEnv`` on the same factories, with the
  start method ``gym-async`` uses.
- ``"envpool-native"``: ``envpool.make_gymnasium`` on EnvPool's native task of the env id
  (:func:`envpool_task`; ``ALE/Pong-v5`` runs ``Pong-v5`` set to gymnasium's work: raw RGB
  frames, frameskip 4, sticky actions 0.25, no no-op starts, no fire reset; EnvPool still
  max-pools the last two frames), ``num_threads`` capped at the usable cores.
- ``"puffer-mp"``: PufferLib's ``Multiprocessing`` vector env stepping every env at once, on
  as many workers as divide ``num_envs`` while leaving one usable core to its driver.

Tuning (``envfleet tune``): :func:`tune` measures the candidates of :func:`tune_grid`
(backends, worker counts, ``driver_envs``, a first-ready pool, the Sampler's inference) with
a policy in the learner's loop and says which ``envfleet.make``/``envfleet.Sampler`` call to
use (:func:`tune_table` renders its :class:`TuneReport`).

Time to a score, a PPO trained over every system, is no part of the package (a library of
vector envs ships no trainer): it is the script ``benchmarks/train.py`` of the repository, on
these public names, with the examples' PPO (``examples/ppo.py``).

A peer whose library is missing is left out with :data:`PEER_INSTALL`'s command
(:func:`unavailable`). The limit (:func:`measure_limit`): one env stepped in a plain Python
loop, its rate times the usable cores.

Method, the same for every system: build the vector env and ``reset(seed=0)``; draw a fixed
bank of :data:`ACTION_BANK` batched actions from ``envs.action_space`` seeded with the same seed
(so drawing actions is not timed); warm up; then step through the bank for the time budget,
reading the clock every few steps (a batch of steps lasts at most about 2 ms), and close the
env whatever happens. Throughput counts env steps summed over all sub-environments:
``num_envs * batch_steps / seconds``.
"""

from __future__ import annotations

from envfleet import check_gymnasium_id, usable_cores
from envfleet.bench._core import (
    ACTION_BANK,
    BASELINES,
    LIMIT,
    PEERS,
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
from envfleet.bench._peers import PEER_INSTALL, envpool_task, puffer_workers
from envfleet.bench._plot import (
    PLOT_DPI,
    PLOT_INSTALL,
    PLOT_LEGEND_INCHES,
    PLOT_PANEL_INCHES,
    machine_line,
    plot_report,
    require_matplotlib,
)
from envfleet.bench._policies import (
    POLICY_KINDS,
    TORCH_INSTALL,
    TorchPolicy,
    Workload,
    check_workload,
    make_env,
    require_torch,
    workloads,
)
from envfleet.bench._policy_loop import (
    POLICY_SYSTEMS,
    PUFFER_INSTALL,
    ROLLOUT_STEPS,
    STORE_SYSTEMS,
    PolicyBound,
    PolicyLoopReport,
    PolicyLoopResult,
    groups_bound,
    measure_bound,
    measure_policy_loop,
    one_call_bound,
    overlap_bound,
    policy_report_dict,
    policy_table,
    schedule_bound,
    schedule_sizes,
    schedule_splits,
    schedule_structures,
    time_in_loop,
    workers_bound,
)
from envfleet.bench._sweep import (
    BenchReport,
    LimitResult,
    Machine,
    Skipped,
    bench_rows,
    describe_machine,
    measure_limit,
    run_bench,
    unavailable,
)
from envfleet.bench._tune import (
    TuneCandidate,
    TuneProgress,
    TuneReport,
    TuneResult,
    tune,
    tune_grid,
    tune_report_dict,
    tune_table,
    tune_workers,
)

__all__ = [
    "ACTION_BANK",
    "BASELINES",
    "LIMIT",
    "PEERS",
    "PEER_INSTALL",
    "PLOT_DPI",
    "PLOT_INSTALL",
    "PLOT_LEGEND_INCHES",
    "PLOT_PANEL_INCHES",
    "POLICY_KINDS",
    "POLICY_SYSTEMS",
    "PUFFER_INSTALL",
    "ROLLOUT_STEPS",
    "STORE_SYSTEMS",
    "SYSTEMS",
    "TORCH_INSTALL",
    "BenchError",
    "BenchProgress",
    "BenchReport",
    "BenchResult",
    "LimitResult",
    "Machine",
    "PolicyBound",
    "PolicyLoopReport",
    "PolicyLoopResult",
    "ProgressCallback",
    "Skipped",
    "TorchPolicy",
    "TuneCandidate",
    "TuneProgress",
    "TuneReport",
    "TuneResult",
    "Workload",
    "baseline_ratios",
    "bench_rows",
    "check_gymnasium_id",
    "check_workload",
    "describe_machine",
    "envpool_task",
    "groups_bound",
    "machine_line",
    "make_env",
    "measure",
    "measure_bound",
    "measure_limit",
    "measure_policy_loop",
    "measure_system",
    "one_call_bound",
    "overlap_bound",
    "plot_report",
    "policy_report_dict",
    "policy_table",
    "puffer_workers",
    "require_matplotlib",
    "require_torch",
    "run_bench",
    "schedule_bound",
    "schedule_sizes",
    "schedule_splits",
    "schedule_structures",
    "time_in_loop",
    "timed_loop",
    "tune",
    "tune_grid",
    "tune_report_dict",
    "tune_table",
    "tune_workers",
    "unavailable",
    "usable_cores",
    "workers_bound",
    "workloads",
]
