"""The supervisor (DESIGN §2, layer 5; §4): restart policy, restart budget and statistics.

The transports do the mechanics (a process backend kills and respawns a worker, an EnvGroup
rebuilds one env); this module decides whether a restart may happen, derives the seeds of
rebuilt envs, and keeps the counters and step-time statistics that ``envs.stats`` reports.
"""

from __future__ import annotations

import collections
import logging
import math
import numbers
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

import numpy as np

from envfleet._errors import ConfigError
from envfleet._protocol import Command, InfoEvent, RestartRequest

logger = logging.getLogger("envfleet")

RESTARTABLE = (Command.STEP, Command.RESET)  # the commands whose failures a policy restarts

_T = TypeVar("_T")

__all__ = [
    "BUCKETS_PER_OCTAVE",
    "NUM_BUCKETS",
    "STATS_WORDS",
    "FleetStats",
    "RestartBudget",
    "RestartPolicy",
    "StepTimeStats",
    "StepTimer",
    "log_env_restart",
    "merge_events",
    "restart_seed",
    "step_time_table",
]


@dataclass(frozen=True)
class RestartPolicy:
    """Rebuild failed sub-environments instead of failing fast (DESIGN §4).

    At most ``max_restarts`` restarts within any ``window_s`` seconds, for the whole vector
    env, as an Erlang/OTP supervisor's intensity and period: the failure that would exceed the
    budget fails fast with the typed error it would have raised without a policy.

    What is restarted, on ``step`` and ``reset``:

    - an env that raises: only that env, rebuilt from its factory inside its worker;
    - a worker that dies (segfault, ``os._exit``, SIGKILL, OOM kill) or hangs past the timeout
      (it is killed): the worker, with every env it held.

    Each restart counts one. Rebuilt envs keep their ``env_index`` and are reset with a seed
    derived from their last seed and their restart count (:func:`restart_seed`). On that step
    they return ``reward 0.0``, ``terminated False``, ``truncated True``, the new episode's
    first observation, and ``info["env_restarted"] = True`` (with gymnasium's
    ``info["_env_restarted"]`` mask). With ``AutoresetMode.SAME_STEP`` there is no
    ``final_obs`` for them (the episode's last observation died with the env). Every other env's
    data is exactly what it would have been without the fault.

    Errors in ``call``, ``get_attr``, ``set_attr`` and ``render`` are the caller's and are not
    restarted: they raise as without a policy.

    Args:
        max_restarts: restarts allowed within any ``window_s`` seconds (>= 0; 0 never restarts).
        window_s: the window, in seconds (> 0).

    Raises:
        ConfigError: a negative ``max_restarts`` or a ``window_s`` that is not > 0.
    """

    max_restarts: int = 3
    window_s: float = 60.0

    def __post_init__(self) -> None:
        if (
            isinstance(self.max_restarts, bool)
            or not isinstance(self.max_restarts, numbers.Integral)
            or self.max_restarts < 0
        ):
            raise ConfigError(f"max_restarts must be an integer >= 0, got {self.max_restarts!r}")
        if not isinstance(self.window_s, numbers.Real) or not self.window_s > 0:
            raise ConfigError(f"window_s must be seconds > 0, got {self.window_s!r}")


def restart_seed(seed: int | None, restarts: int) -> int | None:
    """The seed a rebuilt env is reset with: ``None`` for an env never seeded, else a 32-bit
    seed drawn from ``numpy.random.SeedSequence(seed, spawn_key=(restarts,))``, so the same
    original seed and restart count always give the same seed, and each restart a new one."""
    if seed is None:
        return None
    state = np.random.SeedSequence(int(seed), spawn_key=(int(restarts),)).generate_state(1)
    return int(state[0])


class RestartBudget:
    """Counts restarts in a sliding window of ``policy.window_s`` seconds."""

    def __init__(self, policy: RestartPolicy):
        self.policy = policy
        self._times: collections.deque[float] = collections.deque()

    def take(self, count: int = 1) -> bool:
        """Spend ``count`` restarts now if the budget allows all of them; return whether it did."""
        now = time.monotonic()
        while self._times and now - self._times[0] > self.policy.window_s:
            self._times.popleft()
        if len(self._times) + count > self.policy.max_restarts:
            return False
        self._times.extend([now] * count)
        return True

    def describe(self) -> str:
        return (
            f"restart budget exhausted ({self.policy.max_restarts} restarts within "
            f"{self.policy.window_s:g} s)"
        )


# -- step-time statistics ----------------------------------------------------------------------

BUCKETS_PER_OCTAVE = 4
NUM_BUCKETS = 128  # quarter octaves from 1 µs: up to 2**32 µs (about 71 minutes)
STATS_WORDS = 2 + NUM_BUCKETS  # per worker: count, total seconds, histogram


class StepTimer:
    """Records one worker's step times into its row of a float64 ``[workers, STATS_WORDS]``
    array (shared memory for process backends, so the driver reads it at any time)."""

    __slots__ = ("_words", "row")

    def __init__(self, row: np.ndarray):
        self.row = row
        # Written through a memoryview of the row: a worker records once per step, and three
        # numpy scalar updates cost ~0.7 µs there against ~0.35 µs this way.
        self._words = row.data.cast("B").cast("d")

    def call(self, fn: Callable[[], _T]) -> _T:
        """``fn()``, its time recorded when it returns."""
        t0 = time.perf_counter()
        result = fn()
        self.record(time.perf_counter() - t0)
        return result

    def record(self, seconds: float) -> None:
        words = self._words
        words[0] += 1.0
        words[1] += seconds
        us = seconds * 1e6  # its quarter-octave bucket; bucket 0 holds everything up to 1 µs
        b = 0 if us <= 1.0 else min(NUM_BUCKETS - 1, int(BUCKETS_PER_OCTAVE * math.log2(us)))
        words[2 + b] += 1.0


@dataclass(frozen=True)
class StepTimeStats:
    """Step times of one worker: how long its EnvGroup took to step its envs, per batch.

    Attributes:
        count: batches stepped.
        mean_s, p50_s, p99_s: mean, median and 99th percentile in seconds (``nan`` before the
            first step). The percentiles come from a quarter-octave histogram: within about
            ±9 %.
    """

    count: int
    mean_s: float
    p50_s: float
    p99_s: float


def _quantile(hist: np.ndarray, count: float, q: float) -> float:
    cumulative = np.cumsum(hist)
    b = int(np.searchsorted(cumulative, q * count, side="left"))
    return 2.0 ** ((b + 0.5) / BUCKETS_PER_OCTAVE) * 1e-6


def step_time_table(rows: np.ndarray) -> tuple[StepTimeStats, ...]:
    """:class:`StepTimeStats` per row of a ``[workers, STATS_WORDS]`` array, read now."""
    out = []
    for row in np.array(rows, dtype=np.float64, copy=True):  # one snapshot of every row
        count = float(row[0])
        if count <= 0:
            out.append(StepTimeStats(0, math.nan, math.nan, math.nan))
            continue
        hist = row[2:]
        out.append(
            StepTimeStats(
                int(count),
                float(row[1]) / count,
                _quantile(hist, count, 0.5),
                _quantile(hist, count, 0.99),
            )
        )
    return tuple(out)


@dataclass(frozen=True)
class FleetStats:
    """What the supervisor has seen so far (``envs.stats``; a snapshot, readable at any time).

    Attributes:
        restarts: envs and workers rebuilt under the restart policy.
        env_restarts: per env index, how often it was rebuilt (only envs rebuilt at least once).
        timeouts: waits that ran past their timeout.
        crashes: workers found dead.
        env_errors: exceptions raised by envs (restarted or not).
        workers: per worker, its step-time statistics, in worker order.
    """

    restarts: int = 0
    env_restarts: dict[int, int] = field(default_factory=dict)
    timeouts: int = 0
    crashes: int = 0
    env_errors: int = 0
    workers: tuple[StepTimeStats, ...] = ()


class Ledger:
    """The driver's record of failures and restarts, and of each env's last seed."""

    def __init__(self, num_envs: int, policy: RestartPolicy | None):
        self.policy = policy
        self.budget = RestartBudget(policy) if policy is not None else None
        self.seeds: list[int | None] = [None] * num_envs
        self.env_restarts = [0] * num_envs
        self.restarts = 0
        self.timeouts = 0
        self.crashes = 0
        self.env_errors = 0

    def note_seeds(self, start: int, seeds: list[int | None], mask: Any) -> None:
        """Remember the seeds a reset gives envs ``start, start + 1, ...`` (``mask``: reset
        only where True; ``None``: all)."""
        for j, seed in enumerate(seeds):
            if seed is not None and (mask is None or mask[j]):
                self.seeds[start + j] = int(seed)

    def allow(self, count: int = 1) -> bool:
        """Whether ``count`` more restarts fit the policy's budget (and spend them if so)."""
        return self.budget is not None and self.budget.take(count)

    def restarts_on(self, command: Command) -> bool:
        """Whether a failure of ``command`` is restarted under the policy (step and reset)."""
        return self.policy is not None and command in RESTARTABLE

    def refusal(self, command: Command, only_envs_failed: bool, count: int) -> str | None:
        """Grant ``count`` restarts after ``command`` failed (``None``; the budget is spent),
        or refuse them, returning the note for the fail-fast error: empty when nothing is
        restarted at all, the budget's message when it is exhausted.

        ``only_envs_failed``: every failure is an env's own, the rest of its group completed
        (else the group's state is unknown and it cannot be rebuilt in place).
        """
        if not (self.restarts_on(command) and only_envs_failed):
            return ""
        if not self.allow(count):
            return cast(RestartBudget, self.budget).describe()
        return None

    def restarted(self, env_indices: Any) -> None:
        """One restart (a worker's, or one env's) rebuilt ``env_indices``."""
        self.restarts += 1
        for e in env_indices:
            self.env_restarts[e] += 1

    def restart_request(
        self, start: int, env_indices: list[int], after: Command, rebuild: bool
    ) -> RestartRequest:
        """The request that rebuilds ``env_indices`` of a group starting at env ``start``,
        each seeded by :func:`restart_seed` for its next restart."""
        seeds = [restart_seed(self.seeds[e], self.env_restarts[e] + 1) for e in env_indices]
        return RestartRequest([e - start for e in env_indices], seeds, after, rebuild)

    def count_env_errors(self, failures: Iterable[Any]) -> None:
        """Count each env exception in ``failures`` once (``stats.env_errors``), whichever
        backend and mode reported it: an in-process group's ``EnvFailure`` (a
        ``PartialFailure`` holds one per env that raised) or a worker's ``protocol.Failure``
        (one ``RemoteError`` per env)."""
        for failure in failures:
            per_env = getattr(failure, "failures", None) or getattr(failure, "errors", None)
            self.env_errors += len(per_env) if per_env else 1

    def snapshot(self, workers: tuple[StepTimeStats, ...]) -> FleetStats:
        return FleetStats(
            restarts=self.restarts,
            env_restarts={e: n for e, n in enumerate(self.env_restarts) if n},
            timeouts=self.timeouts,
            crashes=self.crashes,
            env_errors=self.env_errors,
            workers=workers,
        )


def log_env_restart(env_index: int, method: str, type_name: str, message: str) -> None:
    logger.warning(
        "sub-environment %d raised in %s (%s: %s); restarting it",
        env_index,
        method,
        type_name,
        message,
    )


def merge_events(*lists: list[InfoEvent] | None) -> list[InfoEvent] | None:
    """Info events of one group from several lists, in env order (``None`` when none)."""
    events = [event for events in lists for event in events or ()]
    return sorted(events, key=lambda event: event[0]) or None
