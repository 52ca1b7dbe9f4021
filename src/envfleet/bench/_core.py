"""The core of ``envfleet bench``: env steps per second of envfleet backends and of their
peers (other libraries' vector envs, :mod:`envfleet.bench._peers`) on the same environment,
swept over ``num_envs``, with the machine's limit beside them (see :mod:`envfleet.bench`, which
re-exports it, for the systems and the method).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import envfleet
from envfleet import ConfigError, EnvfleetError, check_gymnasium_id
from envfleet.bench._peers import (
    PEERS,
    Stepper,
    action_bank,
    build_peer,
    peer_unavailable,
)

__all__ = [
    "json_ready",
    "ACTION_BANK",
    "BASELINES",
    "LIMIT",
    "PEERS",
    "SYSTEMS",
    "BenchError",
    "BenchProgress",
    "BenchResult",
    "ProgressCallback",
    "baseline_ratios",
    "bench_error",
    "check_args",
    "check_systems",
    "measure",
    "measure_system",
    "timed_loop",
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
    check_systems(systems)
    check_gymnasium_id(env_id)
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
    check_gymnasium_id(env_id)
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


# -- helpers -------------------------------------------------------------------------------


def check_args(num_envs: int, seconds: float, warmup_s: float) -> None:
    if isinstance(num_envs, bool) or not isinstance(num_envs, int) or num_envs < 1:
        raise ConfigError(f"num_envs must be an integer >= 1, got {num_envs!r}")
    if not (isinstance(seconds, (int, float)) and math.isfinite(seconds) and seconds > 0):
        raise ConfigError(f"seconds must be a finite number > 0, got {seconds!r}")
    if not (isinstance(warmup_s, (int, float)) and math.isfinite(warmup_s) and warmup_s >= 0):
        raise ConfigError(f"warmup_s must be a finite number >= 0, got {warmup_s!r}")


def check_systems(systems: Sequence[str]) -> None:
    if not systems:
        raise ConfigError("no system to measure")
    seen: set[str] = set()
    for system in systems:
        _check_system(system)
        if system in seen:
            raise ConfigError(f"system {system!r} is given twice")
        seen.add(system)


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


def json_ready(value: Any) -> Any:
    """``value`` with every float that is not finite (``nan``, ``inf``) as ``None`` (JSON
    has neither), through dicts, lists and tuples (tuples become lists)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_ready(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_ready(v) for v in value]
    return value
