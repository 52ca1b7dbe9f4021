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

import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

import gymnasium
import numpy as np

import envfleet
from envfleet import _cores
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
from envfleet._errors import ConfigError, EnvfleetError
from envfleet._front.factories import check_env_id, register_namespace

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

logger = logging.getLogger("envfleet")

#: The gymnasium vector envs envfleet is compared with.
BASELINES: tuple[str, ...] = ("gym-sync", "gym-async")
#: Every system :func:`measure` knows: the envfleet backends, then the baselines.
SYSTEMS: tuple[str, ...] = (*envfleet.BACKENDS, *BASELINES)
#: Number of pre-drawn batched actions that the timed loop cycles through.
ACTION_BANK = 64

_CHUNK_S = 0.002  # aim: read the clock about every 2 ms
_MAX_CHUNK = 64  # ... and at least every 64 batch steps
_PROGRESS_EVERY_S = 0.1  # at most ten progress callbacks per second while timing


class BenchError(EnvfleetError):
    """A system failed while being measured; ``system`` names it, ``__cause__`` is the error."""

    def __init__(self, message: str, system: str, env_id: str):
        super().__init__(message)
        self.system = system
        self.env_id = env_id


@dataclass(frozen=True)
class BenchResult:
    """Throughput of one system on one environment.

    Attributes:
        system: ``"serial"``, ``"processes"``, ``"gym-sync"`` or ``"gym-async"``.
        env_id: the gymnasium id.
        num_envs: number of sub-environments.
        steps_per_s: env steps per second, summed over all sub-environments
            (``num_envs * batch_steps / seconds``).
        batch_steps: number of ``step`` calls in the timed window (each steps every env).
        seconds: length of the timed window in seconds (at least the time budget).
        startup_s: seconds to build the vector env and reset it (not part of ``seconds``).
    """

    system: str
    env_id: str
    num_envs: int
    steps_per_s: float
    batch_steps: int
    seconds: float
    startup_s: float


@dataclass(frozen=True)
class BenchProgress:
    """Where the measurement of one system stands; passed to a :data:`ProgressCallback`.

    Attributes:
        env_id: the gymnasium id.
        system: the system being measured.
        phase: ``"start"`` (building the env), ``"warmup"``, ``"measure"`` (timed window
            running) or ``"done"``.
        elapsed_s: seconds of the timed window so far (0 before ``"measure"``).
        budget_s: the time budget of the timed window in seconds.
        batch_steps: ``step`` calls in the timed window so far.
        steps_per_s: env steps per second so far (0 before ``"measure"``).
    """

    env_id: str
    system: str
    phase: Literal["start", "warmup", "measure", "done"]
    elapsed_s: float
    budget_s: float
    batch_steps: int
    steps_per_s: float


#: Called with a :class:`BenchProgress` at each phase change and at most ten times per second
#: during the timed window; the time it takes is counted in the timed window, so keep it short.
ProgressCallback = Callable[[BenchProgress], None]


def measure(
    env_id: str,
    num_envs: int,
    systems: Sequence[str],
    seconds: float,
    *,
    seed: int = 0,
    warmup_s: float = 0.25,
    progress: ProgressCallback | None = None,
) -> list[BenchResult]:
    """Measure the throughput of each system on ``env_id``, one system after the other.

    Args:
        env_id: a gymnasium id, e.g. ``"CartPole-v1"`` or ``"ALE/Pong-v5"``.
        num_envs: number of sub-environments of every system.
        systems: names from :data:`SYSTEMS`, each at most once; measured in this order.
        seconds: time budget of each system's timed window, in seconds (> 0). Building,
            resetting, warming up and closing come on top of it.
        seed: seed of ``reset`` (env i gets ``seed + i``) and of the action bank.
        warmup_s: seconds of untimed stepping before the timed window; capped at half of
            ``seconds``, and at least one step is taken.
        progress: optional callback, see :data:`ProgressCallback`.

    Returns:
        One :class:`BenchResult` per system, in the order of ``systems``.

    Raises:
        ConfigError: unknown or repeated system, ``num_envs < 1``, ``seconds <= 0``, unknown
            env id or missing ale-py; raised before any env is built.
        BenchError: a system failed while being built, stepped or closed.
    """
    _check_args(num_envs, seconds, warmup_s)
    if not systems:
        raise ConfigError("no system to measure")
    seen: set[str] = set()
    for system in systems:
        _check_system(system)
        if system in seen:
            raise ConfigError(f"system {system!r} is given twice")
        seen.add(system)
    check_env_id(env_id)
    return [
        measure_system(
            env_id, num_envs, system, seconds, seed=seed, warmup_s=warmup_s, progress=progress
        )
        for system in systems
    ]


def measure_system(
    env_id: str,
    num_envs: int,
    system: str,
    seconds: float,
    *,
    seed: int = 0,
    warmup_s: float = 0.25,
    progress: ProgressCallback | None = None,
) -> BenchResult:
    """Measure the throughput (env steps/s) of one system; see :func:`measure` for the arguments.

    Raises:
        ConfigError: bad arguments, unknown system or env id (before anything is built).
        BenchError: the system failed while being built, stepped or closed.
    """
    _check_args(num_envs, seconds, warmup_s)
    _check_system(system)
    check_env_id(env_id)
    warmup_s = min(warmup_s, seconds / 2)

    def report(phase: Any, elapsed: float = 0.0, steps: int = 0) -> None:
        if progress is not None:
            rate = num_envs * steps / elapsed if elapsed > 0 else 0.0
            progress(BenchProgress(env_id, system, phase, elapsed, seconds, steps, rate))

    report("start")
    logger.debug("bench: building %s with %d x %s", system, num_envs, env_id)
    try:
        start = time.perf_counter()
        envs = _build(env_id, num_envs, system)
    except ConfigError:
        raise
    except Exception as exc:
        raise _bench_error(exc, "building", system, env_id) from exc
    finished = False
    try:
        envs.reset(seed=seed)
        startup_s = time.perf_counter() - start
        envs.action_space.seed(seed)
        bank = [envs.action_space.sample() for _ in range(ACTION_BANK)]

        report("warmup")
        steps, elapsed = timed_loop(
            envs.step,
            bank,
            seconds,
            warmup_s,
            before_timing=lambda: report("measure"),
            progress=None if progress is None else lambda t, n: report("measure", t, n),
        )
        finished = True
    except Exception as exc:
        raise _bench_error(exc, "stepping", system, env_id) from exc
    finally:
        try:
            envs.close(terminate=not finished)
        except Exception as exc:
            if finished:  # otherwise the error being raised already says what went wrong
                raise _bench_error(exc, "closing", system, env_id) from exc
    result = BenchResult(
        system=system,
        env_id=env_id,
        num_envs=num_envs,
        steps_per_s=num_envs * steps / elapsed,
        batch_steps=steps,
        seconds=elapsed,
        startup_s=startup_s,
    )
    logger.debug("bench: %s", result)
    report("done", elapsed, steps)
    return result


def timed_loop(
    step: Callable[[Any], Any],
    bank: Sequence[Any],
    seconds: float,
    warmup_s: float,
    *,
    before_timing: Callable[[], None] | None = None,
    progress: Callable[[float, int], None] | None = None,
) -> tuple[int, float]:
    """Call ``step`` on the actions of ``bank`` in turn: warm up, then time ``seconds``.

    The warm-up lasts ``min(warmup_s, seconds / 2)`` seconds (at least one step); the timed
    window then reads the clock about every 2 ms (at least every 64 steps), judged from the
    warm-up's pace, so that reading it costs nothing measurable. ``before_timing`` is called
    between the two (a barrier, a progress report); ``progress(elapsed_s, steps)`` at most ten
    times a second during the window. This is the one measuring method of ``envfleet bench``
    and ``benchmarks/scaling.py``.

    Returns:
        (steps taken in the timed window, its length in seconds).
    """
    warmup_s = min(warmup_s, seconds / 2)
    size = len(bank)
    i = 0
    t0 = time.perf_counter()
    while True:
        step(bank[i % size])
        i += 1
        warm = time.perf_counter() - t0
        if warm >= warmup_s:
            break
    chunk = max(1, min(_MAX_CHUNK, int(_CHUNK_S * i / warm))) if warm > 0 else 1
    if before_timing is not None:
        before_timing()
    steps = 0
    t0 = time.perf_counter()
    last_report = t0
    while True:
        for _ in range(chunk):
            step(bank[i % size])
            i += 1
        steps += chunk
        now = time.perf_counter()
        if now - t0 >= seconds:
            return steps, now - t0
        if progress is not None and now - last_report >= _PROGRESS_EVERY_S:
            last_report = now
            progress(now - t0, steps)


def baseline_ratios(results: Sequence[BenchResult]) -> list[dict[str, float]]:
    """Each result's throughput relative to each baseline measured alongside it.

    For every result, a dict ``{baseline: result.steps_per_s / baseline_result.steps_per_s}``
    over the baselines (``"gym-sync"``, ``"gym-async"``) present in ``results`` with the same
    ``env_id`` and ``num_envs``; a baseline's ratio to itself is 1.0. A ratio above 1 means
    faster than the baseline. Returns one dict per result, in the order of ``results``.
    """
    base: dict[tuple[str, int, str], float] = {
        (r.env_id, r.num_envs, r.system): r.steps_per_s for r in results if r.system in BASELINES
    }
    out = []
    for r in results:
        ratios = {}
        for name in BASELINES:
            ref = base.get((r.env_id, r.num_envs, name))
            if ref is not None and ref > 0:
                ratios[name] = r.steps_per_s / ref
        out.append(ratios)
    return out


# -- helpers -------------------------------------------------------------------------------


def _check_args(num_envs: int, seconds: float, warmup_s: float) -> None:
    if isinstance(num_envs, bool) or not isinstance(num_envs, int) or num_envs < 1:
        raise ConfigError(f"num_envs must be an integer >= 1, got {num_envs!r}")
    if not (isinstance(seconds, (int, float)) and math.isfinite(seconds) and seconds > 0):
        raise ConfigError(f"seconds must be a finite number > 0, got {seconds!r}")
    if not (isinstance(warmup_s, (int, float)) and math.isfinite(warmup_s) and warmup_s >= 0):
        raise ConfigError(f"warmup_s must be a finite number >= 0, got {warmup_s!r}")


def _check_system(system: str) -> None:
    if system not in SYSTEMS:
        raise ConfigError(f"unknown system {system!r}; available systems: {', '.join(SYSTEMS)}")


def _build(env_id: str, num_envs: int, system: str) -> gymnasium.vector.VectorEnv[Any, Any, Any]:
    if system in envfleet.BACKENDS:
        return envfleet.make(env_id, num_envs, backend=system)

    def make_env() -> gymnasium.Env[Any, Any]:
        # gymnasium.make(env_id), after registering the id's namespace (ALE) in this process,
        # which may be a freshly spawned worker.
        register_namespace(env_id)
        return gymnasium.make(env_id)

    env_fns = [make_env] * num_envs
    if system == "gym-sync":
        return gymnasium.vector.SyncVectorEnv(env_fns)
    return gymnasium.vector.AsyncVectorEnv(env_fns)


def _bench_error(exc: Exception, doing: str, system: str, env_id: str) -> BenchError:
    return BenchError(
        f"{system} failed while {doing} {env_id!r}: {type(exc).__name__}: {exc}", system, env_id
    )


# -- the learner's loop (envfleet bench --policy) ------------------------------------------

#: The systems of the learner's-loop benchmark, in the order of its table.
POLICY_SYSTEMS: tuple[str, ...] = (
    "gym-sync",
    "gym-async",
    "puffer-sync",
    "puffer-async",
    "envfleet",
    "envfleet-pool",
    "sampler-driver",
    "sampler-worker",
)
#: What to install for the PufferLib rows when pufferlib is missing.
PUFFER_INSTALL = "pip install pufferlib-core --no-deps"
_GYM_LOOPS = ("gym-sync", "gym-async")


def usable_cores() -> int:
    """The number of cores this process may run on: the smaller of its CPU affinity and its
    cgroup's CPU quota (:func:`envfleet._cores.usable_cores`, what envfleet's defaults use)."""
    return _cores.usable_cores()


def overlap_bound(num_envs: int, t_policy: float, t_env: float, cores: int) -> float:
    """The overlap bound of a learner's loop, in env steps per second.

    ``num_envs / max(t_policy, (t_policy + num_envs * t_env) / cores)``: the policy's work on
    one batch and the envs' work on one step of every env, perfectly overlapped on ``cores``
    cores, with the policy's batch never split. No loop can beat it.

    Args:
        num_envs: envs per batch (``N``).
        t_policy: seconds the policy takes for one batch of ``N`` observations (``T_p``).
        t_env: seconds one env takes for one step in a plain loop.
        cores: cores available (:func:`usable_cores`).

    Raises:
        ConfigError: ``num_envs`` or ``cores`` below 1, a negative time, or both times 0.

    Example::

        overlap_bound(16, 141e-6, 8.2e-6, 2)  # 16 / max(141e-6, 136.1e-6) = 113475.2
    """
    if num_envs < 1 or cores < 1:
        raise ConfigError(f"num_envs and cores must be >= 1, got {num_envs} and {cores}")
    if t_policy < 0 or t_env < 0 or t_policy + t_env <= 0:
        raise ConfigError(f"times must be >= 0 and not both 0, got {t_policy} and {t_env}")
    return num_envs / max(t_policy, (t_policy + num_envs * t_env) / cores)


@dataclass(frozen=True)
class PolicyBound:
    """The measured overlap bound of one workload (see :func:`overlap_bound`).

    Attributes:
        t_policy_s: median seconds of the policy on one batch of ``num_envs`` observations.
        t_env_s: seconds per step of one env in a plain loop (autoresetting, random actions).
        cores: cores this process may use.
        steps_per_s: the bound, env steps per second.
    """

    t_policy_s: float
    t_env_s: float
    cores: int
    steps_per_s: float


@dataclass(frozen=True)
class PolicyLoopResult:
    """One system's throughput in the learner's loop on one workload.

    Attributes:
        system: a name from :data:`POLICY_SYSTEMS`.
        steps_per_s: median over repetitions of env steps per second (``nan`` when skipped).
        of_bound: ``steps_per_s`` over the workload's bound.
        vs_best_gym: median over repetitions of this system's steps/s over the faster of
            gymnasium's two loops in the same repetition (``nan`` without a gymnasium loop).
        runs: steps/s of each repetition.
        skipped: why the system was not measured (e.g. how to install it), else ``None``.
    """

    system: str
    steps_per_s: float
    of_bound: float
    vs_best_gym: float
    runs: tuple[float, ...]
    skipped: str | None = None


@dataclass(frozen=True)
class PolicyLoopReport:
    """The learner's-loop measurement of one workload: its bound and one row per system.

    Attributes:
        env_id, num_envs, policy: the workload (``policy`` is ``"mlp"`` or ``"cnn"``).
        seconds: timed seconds per system and repetition.
        repeats: repetitions (systems interleaved within each).
        bound: the measured :class:`PolicyBound`.
        results: one :class:`PolicyLoopResult` per system, in the order asked.
    """

    env_id: str
    num_envs: int
    policy: str
    seconds: float
    repeats: int
    bound: PolicyBound
    results: tuple[PolicyLoopResult, ...]


def measure_policy_loop(
    workload: Any,
    systems: Sequence[str] = POLICY_SYSTEMS,
    seconds: float = 2.0,
    *,
    repeats: int = 1,
    seed: int = 0,
    warmup_s: float = 0.25,
    progress: Callable[[str, str, int], None] | None = None,
) -> PolicyLoopReport:
    """Measure the learner's loop (observations -> torch policy -> step) of every system.

    Each system is built, warmed up, timed for ``seconds`` and closed; within a repetition
    the systems run one after the other, and each repetition starts one system later (so no
    system always follows the same one). The bound is measured first. A PufferLib system is
    skipped, with :data:`PUFFER_INSTALL` as its reason, when pufferlib is missing.

    Loops: ``gym-*``, ``puffer-sync``, ``envfleet``: ``actions = policy(obs)``,
    ``obs = envs.step(actions)[0]``; ``envfleet-pool`` (``batch_size = num_envs // 2``) and
    ``puffer-async``: ``recv`` -> policy -> ``send``; ``sampler-*``: ``Sampler.sample(n)``,
    counting the transitions returned.

    Args:
        workload: a :class:`Workload` (see :func:`workloads`).
        systems: names from :data:`POLICY_SYSTEMS`.
        seconds: timed seconds per system and repetition (> 0).
        repeats: repetitions (>= 1); steps/s and ratios are medians over them.
        seed: seed of the envs' reset and of the policy.
        warmup_s: untimed seconds before each timed window (capped at ``seconds / 2``).
        progress: called with ``(workload name, system, repetition)`` before each system.

    Returns:
        A :class:`PolicyLoopReport`.

    Raises:
        ConfigError: torch, ale-py or OpenCV missing (the message says how to install it),
            an unknown env id or system, bad numbers.
        BenchError: a system failed while being built or run.
    """
    require_torch()
    check_env_id(workload.env_id)
    check_workload(workload)
    _check_args(workload.num_envs, seconds, warmup_s)
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ConfigError(f"repeats must be an integer >= 1, got {repeats!r}")
    for system in systems:
        if system not in POLICY_SYSTEMS:
            raise ConfigError(
                f"unknown system {system!r}; available systems: {', '.join(POLICY_SYSTEMS)}"
            )
    systems = list(dict.fromkeys(systems))
    if not systems:
        raise ConfigError("no system to measure")
    bound = measure_bound(workload, seed=seed)
    skipped = {s: PUFFER_INSTALL for s in systems if s.startswith("puffer") and not _has_puffer()}
    active = [s for s in systems if s not in skipped]
    runs: dict[str, list[float]] = {s: [] for s in active}
    ratios: dict[str, list[float]] = {s: [] for s in active}
    for rep in range(repeats):
        shift = rep % len(active) if active else 0
        for system in active[shift:] + active[:shift]:
            if progress is not None:
                progress(workload.name, system, rep)
            runs[system].append(
                _measure_loop(workload, system, seconds, min(warmup_s, seconds / 2), seed)
            )
        best_gym = max((runs[s][-1] for s in _GYM_LOOPS if s in runs), default=math.nan)
        for system in active:
            ratios[system].append(runs[system][-1] / best_gym)
    results = []
    for system in systems:
        if system in skipped:
            nan = math.nan
            results.append(PolicyLoopResult(system, nan, nan, nan, (), skipped[system]))
            continue
        rate = _median(runs[system])
        results.append(
            PolicyLoopResult(
                system,
                rate,
                rate / bound.steps_per_s,
                _median(ratios[system]),
                tuple(runs[system]),
            )
        )
    return PolicyLoopReport(
        workload.env_id,
        workload.num_envs,
        workload.policy,
        float(seconds),
        repeats,
        bound,
        tuple(results),
    )


def policy_report_dict(report: PolicyLoopReport) -> dict[str, Any]:
    """A learner's-loop report as a JSON-ready dict (``nan`` becomes ``None``): the fields of
    :class:`PolicyLoopReport`, ``bound`` and ``results`` nested as dicts."""

    def clean(value: Any) -> Any:
        if isinstance(value, float) and value != value:
            return None
        if isinstance(value, dict):
            return {k: clean(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [clean(v) for v in value]
        return value

    return dict(clean(asdict(report)))


def policy_table(report: PolicyLoopReport) -> str:
    """A learner's-loop report as Markdown: a line on the workload and its bound, then a table
    of ``system | steps/s | of bound | vs best gym`` (a skipped system says why)."""
    b = report.bound
    lines = [
        f"{report.env_id} x{report.num_envs}, {report.policy} policy: bound "
        f"{b.steps_per_s:,.0f} steps/s (T_p = {b.t_policy_s * 1e6:,.0f} us, "
        f"t_env = {b.t_env_s * 1e6:,.1f} us, {b.cores} cores); {report.seconds:g} s per "
        f"system, {report.repeats} repetition(s), medians",
        "",
        "| system | steps/s | of bound | vs best gym |",
        "|---|---:|---:|---:|",
    ]
    for r in report.results:
        if r.skipped is not None:
            lines.append(f"| {r.system} | not installed: {r.skipped} | - | - |")
        else:
            lines.append(
                f"| {r.system} | {r.steps_per_s:,.0f} | {r.of_bound:.2f} | {r.vs_best_gym:.2f} |"
            )
    return "\n".join(lines) + "\n"


def measure_bound(workload: Any, *, seed: int = 0, seconds: float = 0.5) -> PolicyBound:
    """Measure ``T_p`` and ``t_env`` of a workload and its overlap bound.

    ``T_p``: the median time of the policy on a batch of ``num_envs`` observations (one
    env's reset observation repeated), over about ``seconds``. ``t_env``: one env stepped in a
    plain loop with random actions drawn in advance (reset at each episode's end) for about
    ``seconds``, its seconds per step.

    Raises:
        ConfigError: torch missing. BenchError: the env failed.
    """
    try:
        env = workload.factory()()
    except Exception as exc:
        raise _bench_error(exc, "building", "bound", workload.env_id) from exc
    try:
        obs, _ = env.reset(seed=seed)
        policy = TorchPolicy(workload.policy, env.observation_space, env.action_space, seed)
        batch = np.repeat(np.asarray(obs)[None], workload.num_envs, axis=0)
        times: list[float] = []
        deadline = time.perf_counter() + seconds
        for i in range(1_000_000):
            t0 = time.perf_counter()
            policy(batch)
            t1 = time.perf_counter()
            if i >= 3:  # warm-up calls
                times.append(t1 - t0)
            if t1 >= deadline and len(times) >= 5:
                break
        t_policy = _median(times)
        env.action_space.seed(seed)
        bank = [env.action_space.sample() for _ in range(ACTION_BANK)]
        steps = 0
        t0 = time.perf_counter()
        while True:
            for _ in range(16):
                _, _, terminated, truncated, _ = env.step(bank[steps % ACTION_BANK])
                steps += 1
                if terminated or truncated:
                    env.reset()
            elapsed = time.perf_counter() - t0
            if elapsed >= seconds:
                break
        t_env = elapsed / steps
    except ConfigError:
        raise
    except Exception as exc:
        raise _bench_error(exc, "measuring the bound of", "bound", workload.env_id) from exc
    finally:
        env.close()
    cores = usable_cores()
    return PolicyBound(
        t_policy, t_env, cores, overlap_bound(workload.num_envs, t_policy, t_env, cores)
    )


def _median(values: Sequence[float]) -> float:
    import statistics

    return float(statistics.median(values)) if values else math.nan


def _has_puffer() -> bool:
    import importlib.util

    return importlib.util.find_spec("pufferlib") is not None


def _measure_loop(workload: Any, system: str, seconds: float, warmup_s: float, seed: int) -> float:
    """Env steps per second of one system's learner loop on ``workload``."""
    n = workload.num_envs
    factory = workload.factory()
    probe = factory()
    try:
        obs_space, act_space = probe.observation_space, probe.action_space
    finally:
        probe.close()
    policy = TorchPolicy(workload.policy, obs_space, act_space, seed)
    closers: list[Callable[[], None]] = []
    finished = False
    try:
        try:
            advance = _loop(system, factory, n, policy, seed, closers)
        except ConfigError:
            raise
        except Exception as exc:
            raise _bench_error(exc, "building", system, workload.env_id) from exc
        try:
            steps, elapsed = _time_advance(advance, seconds, warmup_s)
        except Exception as exc:
            raise _bench_error(exc, "running", system, workload.env_id) from exc
        finished = True
    finally:
        for close in closers:
            try:
                close()
            except Exception as exc:
                if finished:
                    raise _bench_error(exc, "closing", system, workload.env_id) from exc
    return steps / elapsed


def _time_advance(advance: Callable[[], int], seconds: float, warmup_s: float) -> tuple[int, float]:
    """Call ``advance`` (which returns env steps taken) through a warm-up (at least one call),
    then for ``seconds``; returns (env steps in the timed window, its length in seconds)."""
    t0 = time.perf_counter()
    while True:
        advance()
        if time.perf_counter() - t0 >= warmup_s:
            break
    steps = 0
    t0 = time.perf_counter()
    while True:
        steps += advance()
        elapsed = time.perf_counter() - t0
        if elapsed >= seconds:
            return steps, elapsed


def _loop(
    system: str,
    factory: Callable[[], Any],
    n: int,
    policy: Callable[[Any], Any],
    seed: int,
    closers: list[Callable[[], None]],
) -> Callable[[], int]:
    """Build ``system`` and return its loop's one iteration (returning env steps taken);
    what must be closed goes into ``closers``."""
    if system in ("gym-sync", "gym-async", "envfleet"):
        envs: Any
        if system == "envfleet":
            envs = envfleet.make(factory, n)
        elif system == "gym-sync":
            envs = gymnasium.vector.SyncVectorEnv([factory] * n)
        else:
            envs = gymnasium.vector.AsyncVectorEnv([factory] * n)
        closers.append(envs.close)
        obs = envs.reset(seed=seed)[0]

        def plain() -> int:
            nonlocal obs
            obs = envs.step(policy(obs))[0]
            return n

        return plain
    if system == "envfleet-pool":
        batch = max(1, n // 2)
        pool = envfleet.make(factory, n, batch_size=batch)
        closers.append(pool.close)
        pool.async_reset(seed=seed)

        def pool_step() -> int:
            obs, _, _, _, info = pool.recv()
            pool.send(policy(obs), info["env_id"])
            return batch

        return pool_step
    if system in ("sampler-driver", "sampler-worker"):
        inference = system.removeprefix("sampler-")
        sampler = envfleet.Sampler(
            factory, policy, n, inference=inference, seed=seed, progress=False
        )
        closers.append(sampler.close)
        chunk = n * 64

        def sample() -> int:
            return int(sampler.sample(chunk).num_steps)

        return sample
    return _puffer_loop(system, factory, n, policy, seed, closers)


def _puffer_loop(
    system: str,
    factory: Callable[[], Any],
    n: int,
    policy: Callable[[Any], Any],
    seed: int,
    closers: list[Callable[[], None]],
) -> Callable[[], int]:
    """PufferLib 3's ``Multiprocessing`` vector env: ``puffer-sync``, one worker stepped in a
    plain loop; ``puffer-async``, two workers (when ``n`` is even), ``recv``/``send`` of half
    the envs."""
    import functools

    import pufferlib.emulation
    import pufferlib.vector

    creator = functools.partial(pufferlib.emulation.GymnasiumPufferEnv, env_creator=factory)
    if system == "puffer-sync":
        venv = pufferlib.vector.make(
            creator, num_envs=n, num_workers=1, batch_size=n,
            backend=pufferlib.vector.Multiprocessing,
        )  # fmt: skip
        closers.append(venv.close)
        obs = venv.reset(seed=seed)[0]

        def plain() -> int:
            nonlocal obs
            obs = venv.step(policy(obs))[0]
            return n

        return plain
    workers = 2 if n % 2 == 0 else 1
    batch = n // workers
    venv = pufferlib.vector.make(
        creator, num_envs=n, num_workers=workers, batch_size=batch,
        backend=pufferlib.vector.Multiprocessing,
    )  # fmt: skip
    closers.append(venv.close)
    venv.async_reset(seed)

    def recv_send() -> int:
        obs = venv.recv()[0]
        venv.send(policy(obs))
        return batch

    return recv_send
