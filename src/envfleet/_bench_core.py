"""The core of ``envfleet bench``: env steps per second of envfleet backends and of their
peers (other libraries' vector envs, :mod:`envfleet._bench_peers`) on the same environment,
swept over ``num_envs``, with the machine's limit beside them (see :mod:`envfleet.bench`, which
re-exports it, for the systems and the method).
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import logging
import math
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import envfleet
from envfleet._bench_peers import (
    PEERS,
    Stepper,
    action_bank,
    build_peer,
    make_gym_env,
    peer_unavailable,
)
from envfleet._cores import usable_cores
from envfleet._errors import ConfigError, EnvfleetError
from envfleet._front.factories import check_env_id

__all__ = [
    "ACTION_BANK",
    "BASELINES",
    "LIMIT",
    "PEERS",
    "SYSTEMS",
    "BenchError",
    "BenchProgress",
    "BenchReport",
    "BenchResult",
    "LimitResult",
    "Machine",
    "ProgressCallback",
    "Skipped",
    "baseline_ratios",
    "bench_error",
    "bench_rows",
    "check_args",
    "describe_machine",
    "measure",
    "measure_limit",
    "measure_system",
    "run_bench",
    "timed_loop",
    "unavailable",
]

logger = logging.getLogger("envfleet")

#: The gymnasium vector envs every result is compared with (the ratio columns).
BASELINES: tuple[str, ...] = ("gym-sync", "gym-async")
#: Every system :func:`measure` knows: the envfleet backends, then the peers (the baselines
#: first among them).
SYSTEMS: tuple[str, ...] = (*envfleet.BACKENDS, *PEERS)
#: The name of the machine's limit in progress reports (:func:`measure_limit`).
LIMIT = "limit"
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
        system: a name from :data:`SYSTEMS` (``"processes"``, ``"gym-async"``, ...).
        env_id: the gymnasium id.
        num_envs: number of sub-environments.
        steps_per_s: env steps per second, summed over all sub-environments
            (``num_envs * batch_steps / seconds``).
        batch_steps: number of ``step`` calls in the timed window (each steps every env).
        seconds: length of the timed window in seconds (at least the time budget).
        startup_s: seconds to build the vector env and reset it (not part of ``seconds``).
        runs: with repetitions (:func:`run_bench`), the steps/s of each, in order; the other
            fields are those of the median one (the lower median for an even count).
    """

    system: str
    env_id: str
    num_envs: int
    steps_per_s: float
    batch_steps: int
    seconds: float
    startup_s: float
    runs: tuple[float, ...] = ()


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
        num_envs: number of sub-environments (1 for the limit's plain loop).
    """

    env_id: str
    system: str
    phase: Literal["start", "warmup", "measure", "done"]
    elapsed_s: float
    budget_s: float
    batch_steps: int
    steps_per_s: float
    num_envs: int = 0


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
    check_args(num_envs, seconds, warmup_s)
    _check_systems(systems)
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
        ConfigError: bad arguments, unknown system or env id, or a peer that cannot run here
            (not installed: the message says what to install; ``envpool-native`` on an env
            EnvPool does not have), before anything is built.
        BenchError: the system failed while being built, stepped or closed.
    """
    check_args(num_envs, seconds, warmup_s)
    _check_system(system)
    check_env_id(env_id)
    warmup_s = min(warmup_s, seconds / 2)

    def report(phase: Any, elapsed: float = 0.0, steps: int = 0) -> None:
        if progress is not None:
            rate = num_envs * steps / elapsed if elapsed > 0 else 0.0
            progress(BenchProgress(env_id, system, phase, elapsed, seconds, steps, rate, num_envs))

    reason = peer_unavailable(system, env_id)
    if reason is not None:
        raise ConfigError(reason)
    report("start")
    logger.debug("bench: building %s with %d x %s", system, num_envs, env_id)
    try:
        start = time.perf_counter()
        envs = _build(env_id, num_envs, system, seed)
    except ConfigError:
        raise
    except Exception as exc:
        raise bench_error(exc, "building", system, env_id) from exc
    finished = False
    try:
        envs.reset()
        startup_s = time.perf_counter() - start
        bank = action_bank(envs.single_action_space, num_envs, seed, ACTION_BANK, envs.action_dtype)

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
        raise bench_error(exc, "stepping", system, env_id) from exc
    finally:
        try:
            envs.close(not finished)
        except Exception as exc:
            if finished:  # otherwise the error being raised already says what went wrong
                raise bench_error(exc, "closing", system, env_id) from exc
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


@dataclass(frozen=True)
class LimitResult:
    """The machine's limit on one environment: one plain env loop per usable core, summed.

    One env is stepped in a plain Python loop (random actions from the same kind of bank as
    the vector envs get, reset at each episode's end) and its rate is multiplied by the usable
    cores: what the cores could do for this env with no vector env at all, assuming each core
    runs one such loop as fast as this one did.

    Attributes:
        env_id: the gymnasium id.
        cores: usable cores (:func:`envfleet.bench.usable_cores`).
        single_steps_per_s: steps per second of the one plain loop.
        steps_per_s: ``cores * single_steps_per_s``, env steps per second.
        steps: steps of the plain loop in its timed window.
        seconds: length of that window in seconds.
        runs: with repetitions, ``steps_per_s`` of each; the other fields are the median's.
    """

    env_id: str
    cores: int
    single_steps_per_s: float
    steps_per_s: float
    steps: int
    seconds: float
    runs: tuple[float, ...] = ()


@dataclass(frozen=True)
class Skipped:
    """A system :func:`run_bench` left out on one env, and why (e.g. how to install it)."""

    system: str
    env_id: str
    reason: str


@dataclass(frozen=True)
class Machine:
    """What a benchmark ran on, for its title and its raw figures.

    Attributes:
        cores: usable cores of this process (affinity and cgroup quota).
        cpu_model: the CPU's model name (``/proc/cpuinfo`` on Linux), else the platform's word.
        system: operating system and architecture, e.g. ``"Linux x86_64"``.
        python: the Python version.
        versions: distribution name -> version of envfleet, gymnasium, numpy and of each
            measured system's library that is installed.
    """

    cores: int
    cpu_model: str
    system: str
    python: str
    versions: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class BenchReport:
    """Everything one ``envfleet bench`` run measured.

    Attributes:
        machine: the :class:`Machine`.
        seconds: timed seconds per measurement.
        repeats: repetitions (systems interleaved within each; medians reported).
        limits: one :class:`LimitResult` per env id.
        results: one :class:`BenchResult` per (env id, num_envs, system), in that order.
        skipped: the systems left out, and why.
    """

    machine: Machine
    seconds: float
    repeats: int
    limits: tuple[LimitResult, ...]
    results: tuple[BenchResult, ...]
    skipped: tuple[Skipped, ...] = ()


def measure_limit(
    env_id: str,
    seconds: float,
    *,
    seed: int = 0,
    warmup_s: float = 0.25,
    cores: int | None = None,
    progress: ProgressCallback | None = None,
) -> LimitResult:
    """Measure the machine's limit on ``env_id``: one plain env loop, times the usable cores.

    The loop is ``env.step(action)`` then, when the episode ends, ``env.reset()``, timed by
    :func:`timed_loop` like every system; its actions are the first column of the bank a
    vector env of ``cores`` envs would get.

    Args:
        env_id: a gymnasium id.
        seconds: timed seconds (> 0); warm-up and building come on top.
        seed: seed of ``reset`` and of the action bank.
        warmup_s: untimed seconds first (capped at ``seconds / 2``).
        cores: cores to multiply by (default: :func:`envfleet.bench.usable_cores`).
        progress: optional callback; its events name the system :data:`LIMIT`.

    Returns:
        A :class:`LimitResult`.

    Raises:
        ConfigError: bad arguments, unknown env id or missing ale-py.
        BenchError: the env failed while being built or stepped.

    Example::

        measure_limit("CartPole-v1", 1.0).steps_per_s  # e.g. 2 cores x 150k = 300k steps/s
    """
    check_args(1, seconds, warmup_s)
    check_env_id(env_id)
    cores = usable_cores() if cores is None else cores
    if isinstance(cores, bool) or not isinstance(cores, int) or cores < 1:
        raise ConfigError(f"cores must be an integer >= 1, got {cores!r}")
    warmup_s = min(warmup_s, seconds / 2)

    def report(phase: Any, elapsed: float = 0.0, steps: int = 0) -> None:
        if progress is not None:
            rate = steps / elapsed if elapsed > 0 else 0.0
            progress(BenchProgress(env_id, LIMIT, phase, elapsed, seconds, steps, rate, 1))

    report("start")
    try:
        env = make_gym_env(env_id)
    except ConfigError:
        raise
    except Exception as exc:
        raise bench_error(exc, "building", LIMIT, env_id) from exc
    try:
        env.reset(seed=seed)
        bank = [a[0] for a in action_bank(env.action_space, cores, seed, ACTION_BANK)]
        env_step, env_reset = env.step, env.reset

        def step(action: Any) -> None:
            _, _, terminated, truncated, _ = env_step(action)
            if terminated or truncated:
                env_reset()

        report("warmup")
        steps, elapsed = timed_loop(
            step,
            bank,
            seconds,
            warmup_s,
            before_timing=lambda: report("measure"),
            progress=None if progress is None else lambda t, n: report("measure", t, n),
        )
    except Exception as exc:
        raise bench_error(exc, "stepping", LIMIT, env_id) from exc
    finally:
        env.close()
    report("done", elapsed, steps)
    single = steps / elapsed
    return LimitResult(env_id, cores, single, cores * single, steps, elapsed)


def run_bench(
    env_ids: Sequence[str],
    num_envs: Sequence[int],
    systems: Sequence[str],
    seconds: float,
    *,
    repeats: int = 1,
    seed: int = 0,
    warmup_s: float = 0.25,
    progress: ProgressCallback | None = None,
) -> BenchReport:
    """Measure every system on every env id at every ``num_envs``, and each env's limit.

    For each env id and repetition: its limit (:func:`measure_limit`), then for each
    ``num_envs`` every system (:func:`measure_system`), the systems' order rotated by one
    from one repetition to the next so that none always follows the same one. A peer that
    cannot run here (not installed, or ``envpool-native`` on an env EnvPool does not have) is
    left out and named in ``skipped`` with the reason, never an error.

    Args:
        env_ids: gymnasium ids, e.g. ``["CartPole-v1", "ALE/Pong-v5"]``.
        num_envs: sub-environment counts to sweep, e.g. ``[4, 16, 64]``.
        systems: names from :data:`SYSTEMS`.
        seconds: timed seconds per measurement (> 0).
        repeats: repetitions (>= 1); results and limits are their medians.
        seed: seed of every reset and action bank.
        warmup_s: untimed seconds before each timed window (capped at ``seconds / 2``).
        progress: optional callback, see :data:`ProgressCallback`.

    Returns:
        A :class:`BenchReport`; its results come per env id, then num_envs, then system in
        the order of ``systems``.

    Raises:
        ConfigError: unknown or repeated system, no env id, bad numbers, unknown env id or
            missing ale-py; raised before anything runs.
        BenchError: a system failed while being built, stepped or closed.

    Example::

        report = run_bench(["CartPole-v1"], [4, 16], ["processes", "gym-async"], 1.0)
        [(r.num_envs, r.system, round(r.steps_per_s)) for r in report.results]
    """
    env_ids = list(dict.fromkeys(env_ids))
    if not env_ids:
        raise ConfigError("no env id to measure")
    sizes = list(dict.fromkeys(num_envs))
    if not sizes:
        raise ConfigError("no num_envs to measure")
    for n in sizes:
        check_args(n, seconds, warmup_s)
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ConfigError(f"repeats must be an integer >= 1, got {repeats!r}")
    _check_systems(systems)
    for env_id in env_ids:
        check_env_id(env_id)
    skipped = unavailable(env_ids, systems)
    left_out = {(s.env_id, s.system) for s in skipped}
    active = {e: [s for s in systems if (e, s) not in left_out] for e in env_ids}
    limit_runs: dict[str, list[LimitResult]] = {e: [] for e in env_ids}
    runs: dict[tuple[str, int, str], list[BenchResult]] = {}
    for env_id in env_ids:
        chosen = active[env_id]
        for rep in range(repeats):
            limit_runs[env_id].append(
                measure_limit(env_id, seconds, seed=seed, warmup_s=warmup_s, progress=progress)
            )
            shift = rep % len(chosen) if chosen else 0
            for n in sizes:
                for system in chosen[shift:] + chosen[:shift]:
                    result = measure_system(
                        env_id, n, system, seconds, seed=seed, warmup_s=warmup_s,
                        progress=progress,
                    )  # fmt: skip
                    runs.setdefault((env_id, n, system), []).append(result)
    limits = []
    for env_id in env_ids:
        rates = tuple(r.steps_per_s for r in limit_runs[env_id])
        mid = _median_of(list(limit_runs[env_id]), lambda r: r.steps_per_s)
        limits.append(LimitResult(**{**asdict(mid), "runs": rates}))
    results = []
    for env_id in env_ids:
        for n in sizes:
            for system in active[env_id]:
                done = runs[env_id, n, system]
                mid_result = _median_of(done, lambda r: r.steps_per_s)
                rates = tuple(r.steps_per_s for r in done)
                results.append(BenchResult(**{**asdict(mid_result), "runs": rates}))
    return BenchReport(
        machine=describe_machine(systems, env_ids),
        seconds=float(seconds),
        repeats=repeats,
        limits=tuple(limits),
        results=tuple(results),
        skipped=tuple(skipped),
    )


def unavailable(env_ids: Sequence[str], systems: Sequence[str]) -> list[Skipped]:
    """The systems that cannot run here on each env id, and why, without building anything:
    a peer whose library is not installed (the reason says what to install), or
    ``envpool-native`` on an env that is not one of EnvPool's native tasks.

    Example: without pufferlib, ``unavailable(["CartPole-v1"], ["processes", "puffer-mp"])``
    is ``[Skipped("puffer-mp", "CartPole-v1", "puffer-mp (...) is not installed: pip install
    pufferlib-core --no-deps")]``.
    """
    out = []
    for env_id in env_ids:
        for system in systems:
            reason = peer_unavailable(system, env_id)
            if reason is not None:
                out.append(Skipped(system, env_id, reason))
    return out


def bench_rows(report: BenchReport) -> list[dict[str, Any]]:
    """A report's results as JSON-ready dicts, one per (env id, num_envs, system).

    Each row has the fields of :class:`BenchResult` (``runs`` as a list) and: ``ratios``
    (:func:`baseline_ratios`), ``limit_steps_per_s`` (the env's :class:`LimitResult`),
    ``of_limit`` (``steps_per_s / limit_steps_per_s``) and ``machine`` (the fields of
    :class:`Machine`; the same in every row, so that each row stands alone).
    """
    limits = {lim.env_id: lim.steps_per_s for lim in report.limits}
    machine = asdict(report.machine)
    rows = []
    for r, ratio in zip(report.results, baseline_ratios(report.results), strict=True):
        limit = limits.get(r.env_id)
        row = asdict(r)
        row["runs"] = list(r.runs)
        row["ratios"] = ratio
        row["limit_steps_per_s"] = limit
        row["of_limit"] = r.steps_per_s / limit if limit else None
        row["machine"] = machine
        rows.append(row)
    return rows


def describe_machine(systems: Sequence[str] = (), env_ids: Sequence[str] = ()) -> Machine:
    """The :class:`Machine` this process runs on, with the versions of envfleet, gymnasium,
    numpy and of the libraries of ``systems`` and ``env_ids`` (ale-py for ``ALE/`` ids) that are
    installed."""
    dists = ["envfleet", "gymnasium", "numpy"]
    if any(e.startswith("ALE/") for e in env_ids):
        dists.append("ale-py")
    wanted = {
        "sb3-subproc": "stable-baselines3",
        "envpool-native": "envpool",
        "puffer-mp": "pufferlib-core",
        "ray": "ray",
        "envpool": "envpool",
    }
    dists += [wanted[s] for s in systems if s in wanted]
    versions = {}
    for dist in dict.fromkeys(dists):
        try:
            versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            if dist == "envfleet":
                versions[dist] = envfleet.__version__
            elif dist == "pufferlib-core":  # PufferLib's full distribution has the same module
                with contextlib.suppress(importlib.metadata.PackageNotFoundError):
                    versions["pufferlib"] = importlib.metadata.version("pufferlib")
    return Machine(
        cores=usable_cores(),
        cpu_model=_cpu_model(),
        system=f"{platform.system()} {platform.machine()}".strip(),
        python=platform.python_version(),
        versions=versions,
    )


# -- helpers -------------------------------------------------------------------------------


def check_args(num_envs: int, seconds: float, warmup_s: float) -> None:
    if isinstance(num_envs, bool) or not isinstance(num_envs, int) or num_envs < 1:
        raise ConfigError(f"num_envs must be an integer >= 1, got {num_envs!r}")
    if not (isinstance(seconds, (int, float)) and math.isfinite(seconds) and seconds > 0):
        raise ConfigError(f"seconds must be a finite number > 0, got {seconds!r}")
    if not (isinstance(warmup_s, (int, float)) and math.isfinite(warmup_s) and warmup_s >= 0):
        raise ConfigError(f"warmup_s must be a finite number >= 0, got {warmup_s!r}")


def _check_systems(systems: Sequence[str]) -> None:
    if not systems:
        raise ConfigError("no system to measure")
    seen: set[str] = set()
    for system in systems:
        _check_system(system)
        if system in seen:
            raise ConfigError(f"system {system!r} is given twice")
        seen.add(system)


def _median_of(items: list[Any], key: Callable[[Any], float]) -> Any:
    """The item whose key is the (lower) median of the keys."""
    value = statistics.median_low([key(item) for item in items])
    return next(item for item in items if key(item) == value)


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return " ".join(line.split(":", 1)[1].split())
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def _check_system(system: str) -> None:
    if system not in SYSTEMS:
        raise ConfigError(f"unknown system {system!r}; available systems: {', '.join(SYSTEMS)}")


def _build(env_id: str, num_envs: int, system: str, seed: int) -> Stepper:
    if system not in envfleet.BACKENDS:
        return build_peer(system, env_id, num_envs, seed)
    envs = envfleet.make(env_id, num_envs, backend=system)
    return Stepper(
        envs.single_action_space,
        envs.step,
        lambda: envs.reset(seed=seed),
        lambda terminate: envs.close(terminate=terminate),
    )


def bench_error(exc: Exception, doing: str, system: str, env_id: str) -> BenchError:
    return BenchError(
        f"{system} failed while {doing} {env_id!r}: {type(exc).__name__}: {exc}", system, env_id
    )
