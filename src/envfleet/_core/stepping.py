"""How a worker steps its block of envs: one after another, or all at once (issue 50).

Two kinds of env:

- **Envs that compute** (a physics step, a frame rendered on the CPU, CartPole): their step
  keeps a core busy. A worker steps its block one env after another; more at once would only
  take turns on the GIL.
- **Envs that wait** (on a Unity build, a game server, a robot, a remote simulator, a browser;
  ``time.sleep`` stands for one): their step mostly waits, using no CPU and, in a socket read
  or a sleep, not holding the GIL. Stepped one after another, K envs of a worker wait K times
  in a row; stepped at once, their waits overlap.

:class:`AdaptiveStepping` learns which kind a worker's envs are from their own steps, from
the first round on: in its first round env 0 steps alone, timed, and the others step at once
in that same round if it waited, else one after another, timed. Then on the first rounds
and one round in :data:`SAMPLE_EVERY` (one in up to :data:`SAMPLE_EVERY_MAX` while they keep
computing: the other rounds cost nothing more), the CPU time of the thread that steps them
(``time.thread_time()``) against the wall time (``time.perf_counter()``), and how often that
thread blocked (its voluntary context switches, Linux: a thread only preempted on a busy
machine waits too, for a core, but never blocks). When the envs spend more than half their
step waiting (CPU under :data:`ENTER_BELOW` of the wall time), wait at least
:data:`MIN_WAIT_S` a step and block at least every other step, the worker steps its block
concurrently on a crew of threads (:class:`Crew`: the worker's own thread and one more per
env, up to :data:`MAX_THREADS` in all, each env always on the same one, so that hundreds of
waits overlap); it goes back to one after another when they compute (CPU over
:data:`LEAVE_ABOVE`). While concurrent, one env steps alone every :data:`PROBE_EVERY` rounds
(a different one each time), so that its CPU and wall time are its own, not stretched by the
other envs' turns on the GIL; the probe's own wait is a round's, so while the envs keep
waiting the interval doubles up to :data:`PROBE_EVERY_MAX` rounds.

Either way each env's results, infos, failures and autoreset bookkeeping land in env order,
as :class:`~envfleet._core.envgroup.EnvGroup` writes them stepping one after another: the
batch is bit-identical to gymnasium's SyncVectorEnv. ``ENVFLEET_STEPPING`` in the environment
of the process that starts the workers overrides the choice: ``sequential`` (an env that must
always be stepped from the thread that built it), ``concurrent``, or ``auto`` (the default).

What a worker learned is written into the last words of its step-time row
(:data:`envfleet._core.stats.STEPPING_WORDS`), which ``envs.stats.workers`` reads.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np

from envfleet._core.crash_note import NOTE_CLEAR, NOTE_SEVERAL
from envfleet._core.errors import ConfigError
from envfleet._core.stats import (
    CONCURRENT,
    CONCURRENT_STEPS,
    CPU_FRACTION,
    KIND,
    KIND_COMPUTE,
    KIND_WAIT,
    STEPPING_WORDS,
)

try:
    import resource
except ImportError:  # Windows
    resource = None  # type: ignore[assignment]

__all__ = [
    "ENTER_BELOW",
    "LEAVE_ABOVE",
    "MAX_THREADS",
    "MIN_WAIT_S",
    "PROBE_EVERY",
    "PROBE_EVERY_MAX",
    "SAMPLE_EVERY",
    "SAMPLE_EVERY_MAX",
    "STEPPING_MODES",
    "AdaptiveStepping",
    "Crew",
    "stepping_mode",
]

SAMPLE_EVERY = 16  # one round in this many is timed (after the first FIRST_SAMPLES)
SAMPLE_EVERY_MAX = 256  # ... one in up to this many while the envs keep computing
FIRST_SAMPLES = 4  # rounds timed one after the other at the start
DECIDE_AFTER = 3  # timed stretches before the kind is reported (the choice is made from the first)
PROBE_EVERY = 64  # while concurrent: one env steps alone, timed, once in this many rounds
PROBE_EVERY_MAX = 1024  # ... once in up to this many while the envs keep waiting
ENTER_BELOW = 0.5  # CPU time over wall time under which the envs wait
LEAVE_ABOVE = 0.7  # ... over which a concurrent worker goes back to one after another
MIN_WAIT_S = 100e-6  # the least waiting per env step worth a thread hand-off
MAX_THREADS = 1024  # a crew's threads at most, the worker's own one included
SMOOTH = 0.25  # weight of a new timed round in the running CPU and wall times
MIN_BLOCKS = 0.5  # the least times per env step that the thread blocks, for envs that wait

STEPPING_MODES = ("auto", "sequential", "concurrent")
# Per-thread resource usage (Linux); elsewhere no count of blocking: MIN_BLOCKS is not asked.
_RUSAGE_THREAD: int | None = getattr(resource, "RUSAGE_THREAD", None)


def _blocks() -> int:
    """The times the calling thread blocked so far (its voluntary context switches: a sleep,
    a socket read, a lock); 0 where the system does not count them per thread."""
    return 0 if _RUSAGE_THREAD is None else resource.getrusage(_RUSAGE_THREAD).ru_nvcsw


def _measure(run: Callable[[], Any]) -> tuple[Any, tuple[float, float, float]]:
    """``run()``'s result, and (the calling thread's CPU seconds, the wall seconds, the
    times the thread blocked) while it ran."""
    t0, c0, b0 = time.perf_counter(), time.thread_time(), _blocks()
    result = run()
    return result, (time.thread_time() - c0, time.perf_counter() - t0, float(_blocks() - b0))


def _waiting(cpu_s: float, wall_s: float, blocks: float) -> bool:
    """Steps of ``cpu_s`` CPU and ``wall_s`` wall seconds, the thread blocking ``blocks``
    times in each, wait: CPU under :data:`ENTER_BELOW` of the wall time, at least
    :data:`MIN_WAIT_S` off the CPU a step, and the thread blocked (in a sleep, a read, a
    lock) at least every other step, which a thread only made to wait for a core
    (preempted, on a busy machine) does not."""
    return (
        cpu_s < ENTER_BELOW * wall_s
        and wall_s - cpu_s >= MIN_WAIT_S
        and (_RUSAGE_THREAD is None or blocks >= MIN_BLOCKS)
    )


def stepping_mode() -> str:
    """``ENVFLEET_STEPPING`` from the environment: ``"auto"`` (default), ``"sequential"`` or
    ``"concurrent"``.

    Raises:
        ConfigError: any other value.
    """
    mode = os.environ.get("ENVFLEET_STEPPING", "auto").strip().lower() or "auto"
    if mode not in STEPPING_MODES:
        raise ConfigError(
            f"ENVFLEET_STEPPING must be one of {', '.join(STEPPING_MODES)}, got {mode!r}"
        )
    return mode


class Crew:
    """``size`` members that run a task together: the caller (member 0) and ``size - 1``
    daemon threads named ``envfleet-env-<t>``, started here, each waiting on its own lock.

    :meth:`run` hands ``task(t)`` to every member and returns once all have returned. A
    thread waiting for its turn uses no CPU. The members wake in a chain (member ``t`` wakes
    ``t + 1`` before it runs the task): woken all at once, hundreds of threads would fight
    for the GIL together, and each fight costs CPU.

    Example::

        crew = Crew(4)
        out = [0] * 4
        crew.run(lambda t: out.__setitem__(t, t * t))  # out == [0, 1, 4, 9]
        crew.close()
    """

    def __init__(self, size: int):
        if size < 1:
            raise ValueError(f"a crew has at least 1 member, got {size}")
        self.size = size
        self._task: Callable[[int], None] | None = None
        self._go = [threading.Lock() for _ in range(size)]
        for lock in self._go:
            lock.acquire()
        self._done = threading.Lock()
        self._done.acquire()
        self._finished: Iterator[int] = itertools.count(1)
        self._error: BaseException | None = None
        self.threads = [
            threading.Thread(target=self._serve, args=(t,), name=f"envfleet-env-{t}", daemon=True)
            for t in range(1, size)
        ]
        for thread in self.threads:
            thread.start()

    def run(self, task: Callable[[int], None]) -> None:
        """``task(t)`` for every member ``t`` in ``[0, size)`` at once; returns when all
        returned.

        Raises:
            BaseException: the first exception a member raised (``task`` should catch its
                own: another member's exception arrives here only after every member is done).
        """
        self._task, self._error = task, None
        self._finished = itertools.count(1)
        if self.size > 1:
            self._go[1].release()  # each member wakes the next one (_serve)
        error: BaseException | None = None
        try:
            task(0)
        except BaseException as exc:
            error = exc
        if self.size > 1:
            self._done.acquire()  # the last thread to finish releases it
        self._task = None
        error = error or self._error
        if error is not None:
            raise error

    def _serve(self, t: int) -> None:
        go = self._go[t]
        after = self._go[t + 1] if t + 1 < self.size else None
        while True:
            go.acquire()
            if after is not None:
                # Woken one after another, not all at once: hundreds of threads woken together
                # would all fight for the GIL, and each fight costs CPU (a chain costs one
                # wake-up per member).
                after.release()
            task = self._task
            if task is None:
                return  # closed
            try:
                task(t)
            except BaseException as exc:  # reported by run(), in the caller's thread
                if self._error is None:
                    self._error = exc
            # itertools.count's next() is atomic under the GIL: one thread sees the last count.
            if next(self._finished) == self.size - 1:
                self._done.release()

    def close(self) -> None:
        """Let every thread end (they are daemons: one stuck in an env is left behind)."""
        self._task = None
        if self.size > 1:
            self._go[1].release()  # and on down the chain


class _LockedLog:
    """An :class:`~envfleet._core.action_log.ActionLog`'s ``began`` under a lock: the envs of a
    concurrent round record their episode starts from several threads, and ``began`` counts
    episodes in a shared word."""

    __slots__ = ("_lock", "_log")

    def __init__(self, log: Any, lock: threading.Lock):
        self._log, self._lock = log, lock

    def began(self, j: int, start: Any) -> None:
        with self._lock:
            self._log.began(j, start)


class AdaptiveStepping:
    """A worker's choice between stepping its ``size`` envs one after another and all at
    once (module docstring), and the concurrent rounds themselves.

    Args:
        size: the envs of the block (K). A block of one env is always stepped in the
            worker's own thread (its kind is still measured and reported).
        words: the :data:`~envfleet._core.stats.STEPPING_WORDS` last float64 words of the
            worker's step-time row, where the choice is published; or ``None``.
        mode: ``"auto"``, ``"sequential"`` or ``"concurrent"`` (:func:`stepping_mode`).
    """

    def __init__(self, size: int, words: np.ndarray | None, mode: str = "auto"):
        if mode not in STEPPING_MODES:
            raise ConfigError(f"stepping mode must be one of {STEPPING_MODES}, got {mode!r}")
        self.size = size
        self.mode = mode
        self.concurrent = mode == "concurrent" and size >= 2
        self.rounds = 0
        # One round in this many is timed, one after another (doubled before its first use).
        self.every = SAMPLE_EVERY // 2
        self.samples = 0
        self.cpu_s = 0.0  # smoothed CPU seconds of one env step
        self.wall_s = 0.0  # smoothed wall seconds of one env step
        self.blocks = 0.0  # smoothed times the stepping thread blocked per env step
        self.crew: Crew | None = None
        self._log_lock = threading.Lock()
        # The group's crash note (EnvGroup.note_crashes), NOTE_SEVERAL while envs step at once.
        self.note: memoryview | None = None
        self._probe = 0  # the env that steps alone at the next probe
        self.probe_every = PROBE_EVERY  # rounds between probes (doubles while they wait)
        self._next_probe = PROBE_EVERY  # the round of the next probe
        self._words: Any = None  # memoryview of float64 words
        if words is not None:
            assert words.shape == (STEPPING_WORDS,)
            words[:] = 0.0
            self._words = words.data.cast("B").cast("d")
        self._publish()

    @property
    def cpu_fraction(self) -> float:
        """The envs' CPU time over their wall time (``nan`` before the first timed round)."""
        return self.cpu_s / self.wall_s if self.samples and self.wall_s > 0 else float("nan")

    @property
    def kind(self) -> str:
        """``"wait"``, ``"compute"`` or ``"unknown"`` (not timed enough yet)."""
        if self.samples < DECIDE_AFTER:
            return "unknown"
        return "wait" if self._waits() else "compute"

    def _waits(self) -> bool:
        """The envs wait, by their smoothed step times (:func:`_waiting`)."""
        return _waiting(self.cpu_s, self.wall_s, self.blocks)

    def step(
        self,
        step_envs: Callable[[Iterable[tuple[int, Any]], bool, list[Any], Any], list[Any] | None],
        actions: Iterable[Any],
        resets: bool,
        events: list[Any],
        log: Any,
    ) -> tuple[list[Any] | None, int]:
        """Step the block with ``step_envs(pairs, resets, events, log)`` (EnvGroup's loop
        over ``(env, action)`` pairs, which returns its failures or ``None``): over every
        pair at once in the worker's thread, timed, or, concurrently, over one pair per call
        in the crew's threads, the events and failures then joined in env order.

        Returns:
            ``(failures, quiet)``: the failures, and how many rounds the caller may now
            step one after another, untimed, without asking (0 while concurrent).
        """
        self.rounds += 1
        if not self.concurrent and self.samples == 0 and self.mode == "auto" and self.size >= 2:
            return self._first_round(step_envs, list(actions), resets, events, log), 0
        if not self.concurrent:
            failures, timed = _measure(lambda: step_envs(enumerate(actions), resets, events, log))
            self._learn(*timed, self.size)
            return failures, self._quiet_rounds()
        failures = self._step_concurrently(step_envs, list(actions), resets, events, log)
        return failures, 0

    def _first_round(
        self,
        step_envs: Callable[[Iterable[tuple[int, Any]], bool, list[Any], Any], list[Any] | None],
        actions: list[Any],
        resets: bool,
        events: list[Any],
        log: Any,
    ) -> list[Any] | None:
        """The block's first round: env 0 alone, timed; the other envs at once if its step
        waited, else one after another, timed. So a worker of envs that wait overlaps their
        waits from its first round on (its block of 512 envs that wait 20 ms takes one wait,
        not 512 in a row), and one of envs that compute has lost nothing but a clock read."""
        first, timed = _measure(lambda: step_envs(((0, actions[0]),), resets, events, log))
        self._learn(*timed, 1)
        if self.concurrent:
            rest = self._step_concurrently(step_envs, actions, resets, events, log, skip=0)
        else:
            pairs = itertools.islice(enumerate(actions), 1, None)
            rest, timed = _measure(lambda: step_envs(pairs, resets, events, log))
            self._learn(*timed, self.size - 1)
        if first and rest:
            return first + rest
        return first or rest

    def run_each(self, task: Callable[[int, Any], None], indices: list[int], log: Any) -> None:
        """``task(j, log)`` for each env ``j`` of ``indices`` (local, in order), at once while
        the block's envs are seen to wait, else one after another: a reset of the block (a
        simulator's reset waits as its step does). Before any step has been timed, the first
        env's task runs alone, timed, and the others at once if it waited. Concurrent tasks
        get ``log`` behind a lock (``None`` stays ``None``) and the crash note reads
        :data:`~envfleet._core.crash_note.NOTE_SEVERAL` meanwhile; each task keeps its own
        results (the caller joins them in env order).

        Raises:
            BaseException: what a task let out (a task catches its env's ``Exception``).
        """
        rest = indices
        if not self.concurrent and self.mode == "auto" and self.samples == 0 and indices:
            _, timed = _measure(lambda: task(indices[0], log))
            rest = indices[1:]
            if not _waiting(*timed):
                rest = []
                for j in indices[1:]:
                    task(j, log)
        elif not (self.concurrent or self.mode == "concurrent"):
            for j in indices:
                task(j, log)
            rest = []
        if len(rest) < 2:
            for j in rest:
                task(j, log)
            return
        shared = None if log is None else _LockedLog(log, self._log_lock)
        due = [False] * self.size
        for j in rest:
            due[j] = True
        self._run_at_once(lambda j: task(j, shared), due.__getitem__)

    def _run_at_once(self, run_env: Callable[[int], None], due: Callable[[int], bool]) -> None:
        """``run_env(j)`` for every env ``j`` of the block that is ``due(j)``, at once on the
        crew (made at its first use; env ``j`` always on member ``j % members``), the crash
        note reading :data:`~envfleet._core.crash_note.NOTE_SEVERAL` meanwhile: several envs
        in flight, no one env to name if the worker dies."""
        crew = self.crew
        if crew is None:
            crew = self.crew = Crew(min(self.size, MAX_THREADS))
        members, size = crew.size, self.size
        note = self.note
        if note is not None:
            note[0] = NOTE_SEVERAL

        def member(t: int) -> None:
            for j in range(t, size, members):
                if due(j):
                    run_env(j)

        try:
            crew.run(member)
        finally:
            if note is not None:
                note[0] = NOTE_CLEAR

    def _quiet_rounds(self) -> int:
        """Rounds to step untimed before the next timed one, one after another: none while
        concurrent or in the first rounds, then ``every - 1``; ``every`` doubles from
        :data:`SAMPLE_EVERY` up to :data:`SAMPLE_EVERY_MAX` while the envs keep computing (a
        worker of CPU-bound envs times ever fewer rounds), and falls back to
        :data:`SAMPLE_EVERY` at any other finding."""
        if self.concurrent:
            return 0
        if self.samples < FIRST_SAMPLES:
            return 0
        if self.kind == "compute":
            self.every = min(2 * self.every, SAMPLE_EVERY_MAX)
        else:
            self.every = SAMPLE_EVERY
        self.rounds += self.every - 1  # the rounds the caller steps untimed
        return self.every - 1

    def _step_concurrently(
        self,
        step_envs: Callable[[Iterable[tuple[int, Any]], bool, list[Any], Any], list[Any] | None],
        actions: list[Any],
        resets: bool,
        events: list[Any],
        log: Any,
        skip: int = -1,
    ) -> list[Any] | None:
        """Step every env but ``skip`` (already stepped, its events in ``events``) at once."""
        size = self.size
        per_env: list[list[Any]] = [[] for _ in range(size)]
        failed: list[list[Any] | None] = [None] * size
        probe = skip
        if skip < 0 and (self.rounds >= self._next_probe or self.samples < DECIDE_AFTER):
            if self.rounds >= self._next_probe:
                self._next_probe = self.rounds + self.probe_every
                self.probe_every = min(2 * self.probe_every, PROBE_EVERY_MAX)
            # One env alone, timed as one after another times them: its own CPU and wall
            # (on the first rounds too where the envs were stepped at once from the start).
            probe, self._probe = self._probe, (self._probe + 1) % size
            pair = ((probe, actions[probe]),)
            failed[probe], timed = _measure(lambda: step_envs(pair, resets, per_env[probe], log))
            self._learn(*timed, 1)
        shared = None if log is None else _LockedLog(log, self._log_lock)

        def step_env(j: int) -> None:
            failed[j] = step_envs(((j, actions[j]),), resets, per_env[j], shared)

        self._run_at_once(step_env, probe.__ne__)
        words = self._words
        if words is not None:
            words[CONCURRENT_STEPS - KIND] += 1.0
        for env_events in per_env:
            if env_events:
                events.extend(env_events)
        failures = [f for env_failures in failed if env_failures for f in env_failures]
        return failures or None

    def _learn(self, cpu_s: float, wall_s: float, blocks: float, steps: int) -> None:
        """One timed stretch of ``steps`` env steps, one after another in one thread: its CPU
        and wall seconds and how often the thread blocked; choose again."""
        cpu_s, wall_s, blocks = cpu_s / steps, wall_s / steps, blocks / steps
        if self.samples == 0:
            self.cpu_s, self.wall_s, self.blocks = cpu_s, wall_s, blocks
        else:
            self.cpu_s += SMOOTH * (cpu_s - self.cpu_s)
            self.wall_s += SMOOTH * (wall_s - self.wall_s)
            self.blocks += SMOOTH * (blocks - self.blocks)
        self.samples += 1
        if self.mode == "auto" and self.size >= 2:  # chosen from the first timed env step on
            if self.concurrent:
                # Hysteresis: back to one after another only when clearly computing.
                leave = (
                    self.cpu_s > LEAVE_ABOVE * self.wall_s
                    or self.wall_s - self.cpu_s < MIN_WAIT_S / 2
                    or (_RUSAGE_THREAD is not None and self.blocks < MIN_BLOCKS / 2)
                )
                self.concurrent = not leave
            else:
                self.concurrent = self._waits()
                if self.concurrent:  # probes as often as at first, until they keep waiting
                    self.probe_every, self._next_probe = PROBE_EVERY, self.rounds + PROBE_EVERY
        self._publish()

    def _publish(self) -> None:
        words = self._words
        if words is None:
            return
        kind = self.kind
        words[0] = KIND_WAIT if kind == "wait" else KIND_COMPUTE if kind == "compute" else 0.0
        words[CPU_FRACTION - KIND] = self.cpu_fraction
        words[CONCURRENT - KIND] = 1.0 if self.concurrent else 0.0

    def close(self) -> None:
        """Let the crew's threads end."""
        if self.crew is not None:
            self.crew.close()
            self.crew = None
