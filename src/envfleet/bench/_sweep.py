"""The sweep of ``envfleet bench``: every system on every env id at every ``num_envs``, each
env's limit (one plain env loop times the usable cores), and the machine they ran on (see
:mod:`envfleet.bench`, which re-exports it).
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import platform
import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import envfleet
from envfleet import ConfigError, check_gymnasium_id, usable_cores
from envfleet.bench._core import (
    ACTION_BANK,
    LIMIT,
    BenchProgress,
    BenchResult,
    ProgressCallback,
    baseline_ratios,
    bench_error,
    check_args,
    check_systems,
    measure_system,
    timed_loop,
)
from envfleet.bench._peers import action_bank, make_gym_env, peer_unavailable

__all__ = [
    "BenchReport",
    "LimitResult",
    "Machine",
    "Skipped",
    "bench_rows",
    "describe_machine",
    "measure_limit",
    "run_bench",
    "unavailable",
]


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
    check_gymnasium_id(env_id)
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
    check_systems(systems)
    for env_id in env_ids:
        check_gymnasium_id(env_id)
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
