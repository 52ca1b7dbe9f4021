"""Spin-then-block signalling between the driver and one worker.

A :class:`Doorbell` is a pair of semaphores (``request``: driver to worker, ``done``: worker to
driver). Ringing is one ``sem_post``, a user-space atomic when nobody sleeps on the semaphore.
Waiting first polls with ``sem_trywait`` for a bounded, adaptive budget (:class:`SpinBudget`),
then sleeps on the semaphore: the driver in one piece until its deadline (a worker's death
posts the semaphore: the death watch, R8), a worker in short slices, between which it checks
that its driver lives. Semaphore operations are full memory barriers: what
one side wrote to shared memory before ringing is visible to the other once its wait returns.

On Linux the semaphores are unnamed POSIX semaphores (``sem_init`` with ``pshared=1``) placed
in a shared memory region the caller provides, so they have no name and leave nothing in
/dev/shm whatever way the processes end. Elsewhere they are ``multiprocessing`` semaphores.

A round trip is far cheaper when both sides spin than when both block, and blocking costs
about what a pipe's round trip does (benchmarks/README.md has the figures).

The round protocol
------------------

Where it runs (Linux on x86-64, not a first-ready pool), the driver rings its workers on one
:class:`RoundBell` instead of their request semaphores. Its rules, stated here once; the code
that keeps one cites it by number (``round protocol R4``):

- **R1, the words.** Each worker has a control row of ``worker.WORDS`` int64 words on cache
  lines of its own (C: ``control_t``; ``worker.CONTROL_ROW`` its mirror). The driver writes
  ``CMD``, ``CMD_PAYLOAD``, ``GATHER`` and ``REQ``; the worker writes ``STATUS``,
  ``REPLY_PAYLOAD``, ``REPLY_BYTES``, ``ACK`` and ``SLEEP``. The bell holds ``gen`` (the
  generation), ``remaining`` (a full round's arrivals still due), ``dwait`` (1 while the
  driver sleeps on them) and ``dead`` (1 while a worker's death is unanswered: R8).
- **R2, a command.** A command is due while ``REQ != ACK``. The driver writes the command's
  words, then ``REQ + 1`` (a release store); a worker reads ``REQ`` (an acquire load) before
  the command's words.
- **R3, the ring.** After the ``REQ`` stores, the driver bumps ``gen`` (sequentially
  consistent), then reads the ``SLEEP`` words of the workers it rang and wakes the bits they
  hold with one ``FUTEX_WAKE_BITSET``; none when none of them sleeps.
- **R4, a sleep.** A waiting worker spins on ``REQ``, then stores its bit
  (``worker.sleep_bit``) in ``SLEEP``, reads ``gen``, reads ``REQ`` again, and only then
  sleeps on ``gen`` with its bit as the futex bitset (all sequentially consistent); it clears
  ``SLEEP`` when it wakes. With R3, either the driver sees the bit or the worker sees the new
  ``REQ``: no wake-up is lost, and a ring wakes only the workers it rang (and those 32 groups
  apart, which share their bit, find nothing due and sleep again).
- **R5, a full round.** A full step round's commands carry ``GATHER = 1``, and the driver sets
  ``remaining`` to the worker count before any of their ``REQ`` moves. *Gather* means this
  and only this: the driver counting a full round's arrivals on the bell (``GATHER``,
  ``gather_arrive``, ``gather_block``, ``gather_sleep``, ``gather_round``).
- **R6, a reply.** A worker writes its ``STATUS`` and reply words, then, for a full round, its
  arrival (``remaining - 1``), then ``ACK`` = the ``REQ`` it read (a release store); for any
  other command, ``ACK`` then its done semaphore. Never ``ACK`` before the arrival: a driver
  that finds every ``ACK`` caught up (R8) knows every arrival landed, and none can land after
  it set ``remaining`` for the next round (which would end that round one worker early, its
  rows unread).
- **R7, the driver's sleep.** The driver spins on ``remaining``, then stores ``dwait = 1``,
  reads ``remaining`` again and sleeps on ``dwait`` while it is not 0; the arrival that brings
  ``remaining`` to 0 swaps ``dwait`` to 0 and, if it was 1, wakes the driver (the other
  arrivals wake no one).
- **R8, deaths and new workers.** A worker that dies never arrives: the driver's death watch
  (``WorkerProcesses.died``, a thread blocked on the workers' pidfds) marks its groups dead,
  then stores the bell's ``dead`` word and swaps ``dwait`` to 0 (``bell_alarm``: the driver's
  sleep ends, and R7's sleep does not begin while ``dead`` is set), then posts the done
  semaphore of each of its groups whose ``ACK`` is behind ``REQ``, and the pool's shared one.
  The driver takes the survivors' replies by ``ACK == REQ``; a done token taken with ``ACK``
  behind ``REQ`` is the watch's. A new or restarted worker starts with ``ACK = REQ - 1`` (its
  ``READY`` due: a death while it builds wakes the start's wait), ``GATHER = 0`` and
  ``SLEEP = 0`` (its predecessor's commands are answered or lost with it, and it holds no bit
  on the bell); ``dead`` is cleared once no dead worker is left unreplaced.
  After a Ctrl-C in a wait, ``ProcessesTransport.recover`` takes replies by ``ACK == REQ``
  too, also where commands go on the semaphores (a first-ready pool, no bell): there the
  driver counts ``REQ`` before it posts the request semaphore, and R6's ``ACK`` comes before
  the done semaphore's post, each ordered by the semaphore.
- **R9, the CPUs and the C module.** The bell's own words and system calls are the C
  module's alone (``_speedups.c``: ``bell_ring``, ``bell_sleep``, ``bell_arrive``,
  ``gather_sleep``, ``bell_alarm``, ``full_round``, ``serve_steps``), which keeps R2-R8's
  orders with atomic instructions, correct on any CPU; without the C module there is no bell,
  and every command goes on the workers' semaphores. The Python side still stores a
  command's words and ``REQ`` (``WorkerProcesses.request``), a new worker's words and its
  ``READY`` due (``WorkerProcesses._spec``, ``WorkerProcesses.lay_out``) and a reply's ``ACK``
  (``_Worker.ring_done``) with plain stores, in order only under x86-64's
  total store order: so the bell runs on :data:`ROUND_BELL_MACHINES` only, and
  tests/unit/test_round_protocol_structure.py keeps those stores inside those functions.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import sys
import time
from collections.abc import Callable
from typing import Any

from envfleet._core import native

__all__ = [
    "BELL_BYTES",
    "BLOCK_SLICE_S",
    "IDLE_SLICE_MAX_S",
    "ROUND_BELL_MACHINES",
    "SEM_SLOT",
    "TIGHT_SPIN_S",
    "Doorbell",
    "RoundBell",
    "SharedSem",
    "SpinBudget",
    "round_bell_available",
    "shared_semaphore",
]

BLOCK_SLICE_S = 0.02  # seconds a blocked waiter sleeps before checking liveness again
# An idle worker waits for its next command for as long as the driver likes: its slices grow
# from BLOCK_SLICE_S to this, so a vector env that nobody steps costs ~0 CPU (a ring still
# wakes it at once; only noticing the driver's death takes up to this long).
IDLE_SLICE_MAX_S = 1.0
TIGHT_SPIN_S = 20e-6  # seconds a wait polls without yielding the core (within its budget)
_yield: Callable[[], None] = getattr(os, "sched_yield", lambda: None)
SEM_SLOT = 64  # bytes reserved per semaphore in the shared region (glibc's sem_t: 32)


class SpinBudget:
    """How long a waiter polls before it blocks, adapted online (additive increase,
    multiplicative decrease, as adaptive mutexes do).

    A wait that spins out (its budget ran out and it had to block) halves the budget: the peer
    is slow, or is not running at all because the cores are oversubscribed, and then spinning
    only takes the CPU the peer needs. A wait that is caught while spinning, or that blocked
    but ended soon enough for a spin to have caught it, adds ``step_s`` (``max_s / 16``). The
    rule is C's (``budget_caught``, ``budget_blocked``; here through ``budget_adapt``); the
    Python twin below runs where the C module is absent (``tests/unit/test_spin_budget.py``
    holds the two equal). On a quiet machine with short waits the budget stays near
    ``max_s`` (wake-ups as fast as a spin sees them); with long waits, or other processes
    competing for the cores, it falls to almost nothing and waiters block at once. After its first
    :data:`TIGHT_SPIN_S` (far below a scheduler slice) the spin loop yields the core
    (``sched_yield``) between polls, so a spinner never holds a core another runnable process
    could use for long.

    Its numbers (``budget_s``, ``max_s``, ``step_s``, seconds) live in :attr:`words`, three
    C doubles at :attr:`address`, where the C step path (``_speedups.c``'s ``spin_budget_t``)
    reads and adapts them in place, with no Python attribute in the way.

    Args:
        max_s: the most seconds one wait may spin; 0 disables spinning.
    """

    __slots__ = ("adapt", "address", "words")

    def __init__(self, max_s: float):
        max_s = max(0.0, max_s)
        self.words = (ctypes.c_double * 3)(max_s, max_s, max_s / 16)
        self.address = ctypes.addressof(self.words)
        self.adapt = native.function("budget_adapt")  # (address, wait_s; < 0: caught)

    @property
    def budget_s(self) -> float:
        """Seconds the next wait may spin."""
        return self.words[0]

    def caught(self) -> None:
        """A wait ended while spinning."""
        if self.adapt is not None:
            return self.adapt(self.address, -1.0)
        words = self.words
        words[0] = min(words[1], words[0] + words[2])

    def blocked(self, wait_s: float) -> None:
        """A wait spun out and blocked; it lasted ``wait_s`` seconds in all."""
        if self.adapt is not None:
            return self.adapt(self.address, wait_s)
        words = self.words
        if wait_s <= words[1] / 2:  # a longer spin would have caught it
            words[0] = min(words[1], words[0] + words[2])
        else:
            words[0] /= 2


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _load_libc() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        for name in ("init", "post", "trywait", "timedwait", "wait", "getvalue"):
            getattr(libc, f"sem_{name}").restype = ctypes.c_int
        return libc
    except (OSError, AttributeError):
        return None


_libc = _load_libc()


class SharedSem:
    """An unnamed process-shared POSIX semaphore at ``offset`` bytes into a shared RawArray.

    It pickles as (region, offset) while a process is being started, and each process binds
    it to its own mapping of the region.
    """

    def __init__(self, region: Any, offset: int):
        self.region = region
        self.offset = offset
        self._bind()
        if _libc.sem_init(self.ptr, 1, 0) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"sem_init: {os.strerror(err)}")

    def _bind(self) -> None:
        self.address = address = ctypes.addressof(self.region) + self.offset
        self.ptr = ctypes.c_void_p(address)
        self._timedwait, self._wait = _libc.sem_timedwait, _libc.sem_wait
        ptr, trywait = self.ptr, _libc.sem_trywait
        self._post = functools.partial(_libc.sem_post, ptr)
        self._getvalue = _libc.sem_getvalue
        self._poll: Callable[[], bool] = lambda: bool(trywait(ptr) == 0)

    def __getstate__(self) -> tuple[Any, int]:
        return self.region, self.offset

    def __setstate__(self, state: tuple[Any, int]) -> None:
        self.region, self.offset = state
        self._bind()

    def release(self) -> None:
        self._post()

    def value(self) -> int:
        """The semaphore's count now (no system call)."""
        count = ctypes.c_int(0)
        self._getvalue(self.ptr, ctypes.byref(count))
        return count.value

    def acquire(self, block: bool = True, timeout: float | None = None) -> bool:
        """Take the semaphore: ``False`` when not posted within ``timeout`` seconds (``None``:
        no bound) or a signal ended the wait (its Python handler runs once this returns)."""
        if not block:
            return self._poll()
        if timeout is None:
            return bool(self._wait(self.ptr) == 0)
        deadline = time.time() + timeout
        ts = _Timespec(int(deadline), int((deadline % 1.0) * 1e9))
        return bool(self._timedwait(self.ptr, ctypes.byref(ts)) == 0)


def shared_semaphore(ctx: Any, region: Any, offset: int) -> Any:
    """A semaphore (value 0) for processes of ``ctx``: an unnamed POSIX one at ``offset`` bytes
    into the shared ``region`` (:data:`SEM_SLOT` bytes) where the platform has them, else a
    ``multiprocessing`` semaphore."""
    if _libc is not None:
        try:
            return SharedSem(region, offset)
        except OSError:
            pass  # no process-shared unnamed semaphores here
    return ctx.Semaphore(0)


class Doorbell:
    """Request and completion signals for one worker.

    Create it in the driver before the worker starts and hand it over as a process argument.

    Args:
        ctx: the ``multiprocessing`` context the worker is started with (for the fallback).
        region: a shared ``RawArray`` with room for two :data:`SEM_SLOT` slots at ``offset``.
        offset: byte offset of the first slot in ``region``.
    """

    def __init__(self, ctx: Any, region: Any, offset: int):
        self.request = shared_semaphore(ctx, region, offset)
        self.done = shared_semaphore(ctx, region, offset + SEM_SLOT)

    @staticmethod
    def wait(
        sem: Any,
        budget: SpinBudget,
        deadline: float | None,
        alive: Callable[[], bool],
        spun_s: float | None = None,
        max_slice_s: float | None = None,
    ) -> bool:
        """Wait until ``sem`` is posted; ``False`` when ``deadline`` passed or ``alive()`` failed.

        Args:
            sem: the semaphore to take (``request`` or ``done``).
            budget: spin budget, updated with this wait's length.
            deadline: ``time.monotonic()`` value after which to give up, or ``None``.
            alive: asked before blocking and after each wake-up (a signal's too) or slice;
                a ``False`` ends the wait.
            spun_s: the caller already spun this long on ``sem`` (the C worker loop did):
                block at once, and count those seconds in the wait's length.
            max_slice_s: a worker's wait on its driver, which no death watch rings: blocking
                slices double from :data:`BLOCK_SLICE_S` up to this (seconds), how long a
                death may go unnoticed. ``None``: the driver's wait, one block until
                ``deadline``, which a death ends (the death watch posts ``sem``:
                :class:`~envfleet._backends.workers.DeathWatch`).
        """
        acquire = sem.acquire
        clock = time.perf_counter
        if spun_s is not None:
            start = clock() - spun_s
        else:
            if acquire(False):
                budget.caught()
                return True
            start = now = clock()
            spin_until = start + budget.budget_s
            # Poll back to back at first (a poll costs less than a yield, so a ring is seen
            # sooner: benchmarks/README.md), then yield the core between polls.
            tight_until = min(spin_until, start + TIGHT_SPIN_S)
            while now < spin_until:
                if now >= tight_until:
                    _yield()
                if acquire(False):
                    budget.caught()
                    return True
                now = clock()
        if max_slice_s is None:  # the driver's wait: one block, which a death rings too
            while alive():  # asked first: a death before the block rang no one
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    break
                if acquire(True, left):  # False: the deadline, or a signal (asked again)
                    budget.blocked(clock() - start)
                    return True
            return bool(acquire(False))
        block_s = BLOCK_SLICE_S
        while True:
            slice_s = block_s if deadline is None else min(block_s, deadline - time.monotonic())
            if slice_s <= 0:
                return bool(acquire(False))
            if acquire(True, slice_s):
                budget.blocked(clock() - start)
                return True
            if not alive():
                return bool(acquire(False))
            block_s = min(max_slice_s, block_s * 2)


# -- the round bell (Linux, x86-64) ----------------------------------------------------------

BELL_BYTES = 64  # the round bell's words, on a cache line of their own
# The round bell's 32-bit words (byte offsets; R1): the generation, a full round's arrivals
# still due, the driver asleep on those. Only ``remaining`` is read here (gathered).
_REMAINING = 4


ROUND_BELL_MACHINES = frozenset({"x86_64"})
"""The CPUs on which the round bell runs (round protocol R9); everywhere else
:func:`round_bell_available` is False and every command is rung on the worker's POSIX
semaphores (full barriers)."""


def round_bell_available(machine: str | None = None) -> bool:
    """A :class:`RoundBell` works here: Linux (futexes), on a CPU of
    :data:`ROUND_BELL_MACHINES` (x86-64), with the C module's bell functions (R9).

    Args:
        machine: the CPU architecture as the kernel names it (``x86_64``, ``aarch64``...);
            default this machine's, ``os.uname().machine``.
    """
    if machine is None:
        machine = os.uname().machine if hasattr(os, "uname") else ""
    return (
        sys.platform.startswith("linux")
        and machine in ROUND_BELL_MACHINES
        and _native_bell() is not None
    )


class RoundBell:
    """One vector env's wake-up word and arrival count (Linux futexes), shared by the driver
    and every worker, which keep the round protocol (the module's R1-R9): the driver rings
    the workers it wrote a command to with one generation bump and at most one
    ``FUTEX_WAKE_BITSET``, whatever their number, and a full round's last arrival wakes the
    driver. Its system calls are the C module's (R9): the bell exists only where they run
    (:func:`round_bell_available`).

    Args:
        region: the bell's :data:`BELL_BYTES` of shared memory.
        layout: the indexes of the ``REQ``, ``ACK`` and ``SLEEP`` words in a worker's int64
            control row (``worker.REQ``, ``worker.ACK``, ``worker.SLEEP``).

    Raises:
        RuntimeError: the C module's bell functions do not run in this process.
    """

    def __init__(self, region: Any, layout: tuple[int, int, int]):
        self.region = region
        self.layout = layout
        self._bind()

    def _bind(self) -> None:
        self.address = address = ctypes.addressof(self.region)
        self._words = (ctypes.c_int32 * 3).from_address(address)
        native = _native_bell()
        if native is None:
            raise RuntimeError("the round bell needs envfleet._core._speedups' bell functions")
        self._native = native

    def __getstate__(self) -> Any:
        return self.region, self.layout

    def __setstate__(self, state: Any) -> None:
        self.region, self.layout = state
        self._bind()

    # -- the driver's side --

    def ring(self, controls: tuple[int, ...]) -> None:
        """Wake the workers whose control rows are at the addresses ``controls`` (their
        ``REQ`` bumped before): round protocol R3."""
        self._native.bell_ring(self.address, controls)

    def gathered(self) -> bool:
        """A full round's every worker arrived (``remaining`` is 0: R5, R6)."""
        return bool(self._words[_REMAINING // 4] == 0)

    def gather_sleep(self, timeout_s: float | None) -> bool:
        """The driver's blocking wait for the last arrival (at most ``timeout_s``; ``None``:
        no bound), ended at once by a death (:meth:`alarm`) or a signal: R7, R8."""
        return bool(
            self._native.gather_sleep(self.address, -1.0 if timeout_s is None else timeout_s)
        )

    def alarm(self, on: bool) -> None:
        """The death watch's side (R8): ``on``, a worker died, and the driver's full-round wait
        ends (and does not sleep again) until the death is answered (``alarm(False)``, once
        every dead worker is replaced)."""
        self._native.bell_alarm(self.address, on)

    # -- a worker's side --

    def sleep(self, address: int, bit: int, timeout_s: float) -> bool:
        """A worker's blocking wait (no spin) until its command is due (``REQ != ACK`` in its
        control row, at ``address``), a ring of a worker sharing its ``bit``, or
        ``timeout_s``: whether one is due. Round protocol R4."""
        return bool(self._native.bell_sleep(self.address, address, bit, timeout_s))

    def arrive(self) -> None:
        """A worker's arrival on a full round (before its ``ACK``: R6); the last wakes the
        driver (R7)."""
        self._native.bell_arrive(self.address)


_BELL_FUNCTIONS = frozenset(
    {"bell_ring", "bell_sleep", "bell_arrive", "gather_sleep", "bell_alarm"}
)


def _native_bell() -> Any:
    """The C module when its round-bell functions run here, else ``None`` (no round bell)."""
    module = native.speedups
    if module is None or native.disabled & _BELL_FUNCTIONS:
        return None
    return module
