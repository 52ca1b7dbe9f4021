"""Step-time statistics and the counters ``envs.stats`` reports (layer 7 in docs/architecture.md).

Each worker records how long its EnvGroup takes to step (:class:`StepTimer`, into a row of
shared memory where workers are processes); :func:`step_time_table` reads every row at once;
:class:`FleetStats` is the snapshot ``envs.stats`` returns.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

from envfleet._core import native as _native

_T = TypeVar("_T")

__all__ = [
    "BUCKETS_PER_OCTAVE",
    "NUM_BUCKETS",
    "CONCURRENT",
    "CONCURRENT_STEPS",
    "CPU_FRACTION",
    "KIND",
    "KIND_COMPUTE",
    "KIND_WAIT",
    "STATS_WORDS",
    "STEPPING_WORDS",
    "FleetStats",
    "StepTimeStats",
    "StepTimer",
    "WorkerMemory",
    "env_kind",
    "step_time_table",
]

BUCKETS_PER_OCTAVE = 4
NUM_BUCKETS = 128  # quarter octaves from 1 µs: up to 2**32 µs (about 71 minutes)
# After the histogram, what a processes worker learned of its envs (envfleet._core.stepping):
# their kind (KIND_COMPUTE, KIND_WAIT; 0: not known yet), their CPU time over their wall time,
# whether it steps them concurrently now (1.0) and how many rounds it stepped so.
KIND, CPU_FRACTION, CONCURRENT, CONCURRENT_STEPS = range(2 + NUM_BUCKETS, 6 + NUM_BUCKETS)
STEPPING_WORDS = 4
KIND_COMPUTE, KIND_WAIT = 1.0, 2.0
# per worker: count, total seconds, histogram, then the stepping words
STATS_WORDS = 2 + NUM_BUCKETS + STEPPING_WORDS


class StepTimer:
    """Records one worker's step times into its row of a float64 ``[workers, STATS_WORDS]``
    array (shared memory for process backends, so the driver reads it at any time)."""

    __slots__ = ("_words", "call", "row")

    def __init__(self, row: np.ndarray):
        self.row = row
        # Written through a memoryview of the row: a worker records once per step, and three
        # numpy scalar updates cost more there (benchmarks/README.md).
        self._words = row.data.cast("B").cast("d")
        self.call: Callable[[Callable[[], _T]], _T]
        """``fn()``, its time recorded when it returns (in C where envfleet._core.native has it)."""
        fast = _native.function("timed_call")
        # (A subclass that overrides record() gets it called, so it times in Python.)
        if (
            fast is not None
            and type(self).record is StepTimer.record
            and row.flags.c_contiguous
            and row.dtype == np.float64
        ):
            self.call = functools.partial(fast, row.ctypes.data, BUCKETS_PER_OCTAVE, NUM_BUCKETS)
        else:
            self.call = self._call

    def _call(self, fn: Callable[[], _T]) -> _T:
        """The Python twin of the C ``timed_call``."""
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
    """Step times of one worker: how long its EnvGroup took to step its envs, per batch, and
    what kind of env it found them to be.

    Attributes:
        count: batches stepped.
        mean_s, p50_s, p99_s: mean, median and 99th percentile in seconds (``nan`` before the
            first step). The percentiles come from a quarter-octave histogram: within about
            ±9 %.
        env_kind: ``"compute"`` (the envs' steps keep the CPU busy), ``"wait"`` (they mostly
            wait: on a simulator, a server, a sleep) or ``"unknown"`` (not timed yet, or a
            backend whose workers do not time it: only ``processes`` workers do). A worker
            times its first rounds, then one in 16 (in up to 256 while its envs compute): the
            CPU time of the thread that steps its envs against the wall time.
        cpu_fraction: the envs' CPU time over their wall time, 0 to about 1 (``nan`` where
            ``env_kind`` is ``"unknown"``).
        concurrent: the worker steps its envs all at once now (each on a thread of its own
            crew), as it does while they wait; else one after another.
        concurrent_steps: batches it stepped all at once so far.
    """

    count: int
    mean_s: float
    p50_s: float
    p99_s: float
    env_kind: str = "unknown"
    cpu_fraction: float = math.nan
    concurrent: bool = False
    concurrent_steps: int = 0


def _quantile(hist: np.ndarray, count: float, q: float) -> float:
    cumulative = np.cumsum(hist)
    b = int(np.searchsorted(cumulative, q * count, side="left"))
    return 2.0 ** ((b + 0.5) / BUCKETS_PER_OCTAVE) * 1e-6


_KINDS = {KIND_COMPUTE: "compute", KIND_WAIT: "wait"}


def step_time_table(rows: np.ndarray) -> tuple[StepTimeStats, ...]:
    """:class:`StepTimeStats` per row of a ``[workers, STATS_WORDS]`` array, read now."""
    out = []
    for row in np.array(rows, dtype=np.float64, copy=True):  # one snapshot of every row
        count = float(row[0])
        kind = _KINDS.get(float(row[KIND]), "unknown")
        stepping = (
            kind,
            float(row[CPU_FRACTION]) if kind != "unknown" else math.nan,
            bool(row[CONCURRENT]),
            int(row[CONCURRENT_STEPS]),
        )
        if count <= 0:
            out.append(StepTimeStats(0, math.nan, math.nan, math.nan, *stepping))
            continue
        hist = row[2 : 2 + NUM_BUCKETS]
        out.append(
            StepTimeStats(
                int(count),
                float(row[1]) / count,
                _quantile(hist, count, 0.5),
                _quantile(hist, count, 0.99),
                *stepping,
            )
        )
    return tuple(out)


def env_kind(workers: tuple[StepTimeStats, ...]) -> str:
    """The kind of env the workers found (:attr:`StepTimeStats.env_kind`): ``"wait"`` or
    ``"compute"`` when every worker that knows says so, ``"varied"`` when they differ,
    ``"unknown"`` when none knows.

    Example::

        env_kind(envs.stats.workers)  # "wait" for a remote simulator; envs.stats.env_kind
    """
    kinds = {w.env_kind for w in workers} - {"unknown"}
    if not kinds:
        return "unknown"
    return kinds.pop() if len(kinds) == 1 else "varied"


@dataclass(frozen=True)
class WorkerMemory:
    """One worker process's memory, as sampled about once a second (``envs.stats.memory``).

    Attributes:
        rss_bytes: its resident memory when last sampled, ``None`` before the first sample.
        episodes: episodes its envs began, counted in the worker (since it started).
        growth_per_1000_episodes: the slope of its resident memory against those episodes
            over the last samples (least squares), in bytes per 1,000 episodes; ``None``
            until the samples span enough episodes. A steady growth logs a warning naming
            the worker's envs, a leak suspect (see :class:`envfleet.Recycle`).
    """

    rss_bytes: int | None
    episodes: int
    growth_per_1000_episodes: float | None


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
        recycled: workers replaced under :class:`envfleet.Recycle`.
        memory: per worker process, its resident memory and how it grows
            (:class:`WorkerMemory`), in worker order; empty where the backend has no worker
            processes of its own (serial, threads, ray, envpool).
        failures: the last 100 failures a restart policy survived, oldest first, each the
            typed error it would have raised without one (:class:`~envfleet.EnvError`,
            :class:`~envfleet.EnvCrashedError`, :class:`~envfleet.StepTimeoutError`), with
            its ``stacks`` and ``replay``.
    """

    restarts: int = 0
    env_restarts: dict[int, int] = field(default_factory=dict)
    timeouts: int = 0
    crashes: int = 0
    env_errors: int = 0
    workers: tuple[StepTimeStats, ...] = ()
    recycled: int = 0
    memory: tuple[WorkerMemory, ...] = ()
    failures: tuple[Any, ...] = ()

    @property
    def env_kind(self) -> str:
        """The kind of env the workers found: ``"compute"``, ``"wait"``, ``"varied"`` (workers
        differ) or ``"unknown"`` (see :attr:`StepTimeStats.env_kind`).

        Example::

            envs = envfleet.make(make_remote_simulator, 16)
            ...  # some steps
            envs.stats.env_kind  # "wait": each worker steps its envs all at once
        """
        return env_kind(self.workers)
