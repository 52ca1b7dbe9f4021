"""``backend="processes"``: EnvGroups in worker processes, data in shared memory.

Each worker holds a contiguous block of envs. Observations, actions, rewards, terminations
and truncations live in one shared :class:`envfleet._core.buffers.Block`; per worker, a few shared
control words carry the :class:`Command` and the reply status. A full step round (every
worker, a plain step) is signalled by the
:class:`~envfleet._backends.processes.doorbell.RoundBell` (C, x86-64 Linux); every other
command, and every round where the bell is absent, by the worker's
:class:`~envfleet._backends.processes.doorbell.Doorbell` (two semaphores, spin-then-block),
which then carries the request and the reply's wake-up. Only what does not fit the buffers is
pickled: reset options, call arguments and results, non-empty infos, errors. Requests travel
on the worker's pipe, after its doorbell rang; a reply goes in the worker's shared mailbox
(:data:`MAILBOX_BYTES`) when it fits, else on the pipe, so the infos an env returns every step
(Atari's) cost no system call.

Optionally the driver steps the first block of envs itself while the workers step theirs
(``driver_envs``), so that on a machine with few cores no core idles while the driver waits.
Those envs then live in the driver process: their Python exceptions are reported as usual, but
a native crash in them takes the driver down with it, after writing to stderr the env's index
and its faulting Python frame (:mod:`envfleet._core.crash_note`).

Every wait also watches the workers: a worker that dies (segfault, ``os._exit``, SIGKILL)
wakes the driver's wait at once (the death watch rings it:
:meth:`~envfleet._backends.processes.lifecycle.WorkerProcesses.died`), which raises
:class:`envfleet.EnvCrashedError` or restarts it instead of hanging. Workers exit when the
driver dies: Linux SIGKILLs them (``PR_SET_PDEATHSIG``), and a blocked worker also checks
between slices that the driver is still there.

This module holds the driver's side (:class:`ProcessesTransport`, the primitives
:class:`envfleet._backends.rounds.RoundDriver` runs every round over, and the C step round)
and the registration; the workers' lifecycle is :mod:`~envfleet._backends.processes.lifecycle`.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import logging
import multiprocessing.util  # noqa: F401  (its exit handler, registered first: _close_at_exit)
import os
import pickle
import sys
import time
import weakref
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from typing import Any, cast

from envfleet._backends.base import run_command
from envfleet._backends.processes.doorbell import (
    TIGHT_SPIN_S,
    Doorbell,
    RoundBell,
    SharedSem,
    SpinBudget,
)
from envfleet._backends.processes.lifecycle import DEFAULT_CLOSE_TIMEOUT, WorkerProcesses
from envfleet._backends.processes.plan import (
    DEFAULT_SPIN_S,
    ProcessesPlan,
    hosted_pool_plan,
    plan_processes,
)
from envfleet._backends.processes.worker import (
    ACK,
    CMD_PAYLOAD,
    GATHER,
    REPLY_BYTES,
    REPLY_PAYLOAD,
    REQ,
    SLEEP,
    STATUS,
    check_control_row,
)
from envfleet._backends.registry import (
    BackendSpec,
    BuildRequest,
    Plan,
    PlanRequest,
    register,
)
from envfleet._backends.rounds import RoundDriver
from envfleet._backends.supervisor import Round
from envfleet._backends.transport import NOTHING, FullRound, Seen
from envfleet._core import native as _speedups
from envfleet._core.action_log import new_log
from envfleet._core.buffers import Batch
from envfleet._core.cores import usable_cores
from envfleet._core.crash_note import driver_crash_note, note_base
from envfleet._core.envgroup import EnvFailure, EnvGroup
from envfleet._core.errors import EnvCrashedError, EnvError
from envfleet._core.failures import CLOSED, failure_error, mismatch_error, remote_env_error
from envfleet._core.protocol import Command, Failure, RoundOutcome, Status
from envfleet._core.replay import EnvRecording
from envfleet._core.stats import StepTimer, StepTimeStats, WorkerMemory, step_time_table

__all__ = ["DEFAULT_CLOSE_TIMEOUT", "DEFAULT_SPIN_S", "ProcessesTransport"]

logger = logging.getLogger("envfleet")

# The hot path's Enum members as module globals (an Enum member lookup is slow).
_STEP, _ERROR = Command.STEP, int(Status.ERROR)


# The most seconds recover() waits, for all the workers that replied, for each one's token: on
# the round bell, until it sleeps on its next command (it does once its spin budget,
# DEFAULT_SPIN_S, runs out: within milliseconds); on the semaphores it comes just after the ACK.
RECOVER_S = 1.0


class ProcessesTransport:
    """Worker processes holding contiguous blocks of envs over one shared block (a
    :class:`~envfleet._backends.transport.Transport`: the rounds are the round driver's).

    Args:
        request: make()'s :class:`BuildRequest`: the factories (cloudpickled), the start
            method, the ledger (a restart policy needs an empty driver block), a first-ready
            pool (no driver block then), and env 0: built in the driver
            (``request.first_env``: the driver block's env 0, else closed), or, with every
            env in a worker, by the first worker, whose spaces size the shared block
            (``request.learn``), handed to the workers on their pipes.
        plan: the :class:`ProcessesPlan`: the driver's share (``driver_envs > 0``: the driver
            steps the first block itself) and the spin budgets (seconds; 0: always block).

    Its workers are spawned here; the round driver waits for their ``READY`` replies
    (``start_timeout``) and checks them.

    Raises:
        EnvError: a factory raised while building the driver's own envs (``method == "make"``).
        SpaceMismatchError: the driver's own envs' spaces differ from env 0's.
    """

    late_what = "workers"
    late_fate = "they were killed"
    replaceable = True

    def __init__(self, request: BuildRequest, plan: ProcessesPlan):
        driver_group = plan.driver_envs > 0
        self.ranges = list(request.plan.ranges)
        self.ledger = request.ledger
        self.pool = request.pool
        assert self.ledger.policy is None or not driver_group, "restarts need every env in a worker"
        assert not (request.pool and driver_group), "a first-ready pool has every env in a worker"
        self.workers = workers = WorkerProcesses(request, plan.worker_spin_s, plan.hosts)
        self._owner_pid = os.getpid()
        _OPEN.add(self)  # closed at interpreter exit, if still open (_close_at_exit)
        self._driver_block_timer = StepTimer(workers.stats[0])
        self._driver_block: EnvGroup | None = None
        self._driver_block_reply: tuple[Any, EnvFailure | None] | None = None  # until read
        groups = len(self.ranges)
        self._budgets = [SpinBudget(plan.driver_spin_s) for _ in range(groups)]
        self._any_budget = SpinBudget(plan.driver_spin_s)
        self._round_budget = SpinBudget(plan.driver_spin_s)  # a full round's, on the bell
        self.remote = list(range(1 if driver_group else 0, groups))
        self._inline = frozenset((0,)) if driver_group else frozenset()
        self.full_round: FullRound | None = None
        # After a full round whose outcome a Ctrl-C lost, every remote worker can be waited
        # for again (RoundDriver._fast_round): on the round bell, arrivals and ACKs are in
        # shared memory and the round takes no token.
        self.regathers = False
        # A forked worker flushes the stdio buffers it inherits when it exits: flush them
        # here so nothing the driver printed is printed again.
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        first_env = request.first_env
        try:
            for g in self.remote:
                if workers.lead(g) == g:  # a host process starts with all its groups
                    workers.start(g)
            workers.memory.start()
            if driver_group:
                # Built while the workers build theirs; env 0 is the one make() already built.
                env0, first_env = first_env, None  # the group owns it now
                layout = workers.layout
                self._driver_block = EnvGroup(
                    layout.bound_fns(*self.ranges[0]),
                    0,
                    cast(Batch, workers.batch),
                    layout.single_observation_space,
                    layout.single_action_space,
                    layout.autoreset_mode,
                    first_env=env0,
                    same_observation_space=layout.same_observation_space,
                    action_log=new_log(
                        layout.single_action_space, self.ranges[0][1], layout.replay_steps
                    ),
                )
                mismatch = self._driver_block.check_spaces()
                if mismatch is not None:
                    raise mismatch_error(mismatch)
                # A fatal signal in one of these envs kills the learner: it names the env first.
                self._driver_block.note_crashes(
                    driver_crash_note(), note_base(plan.driver_envs, self.ranges[0][0])
                )
            if first_env is not None:
                first_env.close()
                first_env = None
            self.full_round = self._bind_full_round()
            self.regathers = self.full_round is not None and workers.bell is not None
        except EnvFailure as failure:
            self.close(None, True, ())
            raise failure_error(failure) from failure.__cause__
        except BaseException:
            if first_env is not None:
                first_env.close()
            self.close(None, True, ())
            raise

    @property
    def num_workers(self) -> int:
        """Worker processes (the driver's own block, if any, is not one; a host process
        serving several groups is one)."""
        return sum(1 for g in self.remote if self.workers.lead(g) == g)

    @property
    def closed(self) -> bool:
        return self.workers.closed

    @property
    def batch(self) -> Batch:
        """The shared block's arrays (once laid out: at the start, after env 0's probe)."""
        return cast(Batch, self.workers.batch)

    # -- Transport ------------------------------------------------------------------------------

    def inline(self, command: Command) -> frozenset[int]:
        return self._inline

    def send(self, g: int, command: Command, payload: Any) -> bool:
        if g in self._inline:  # the driver's own block, stepped while the workers step theirs
            block = cast(EnvGroup, self._driver_block)
            try:
                result = run_command(block, command, payload, self._driver_block_timer)
            except EnvFailure as failure:
                self._driver_block_reply = (None, failure)
            else:
                self._driver_block_reply = (result, None)
            return True
        self.workers.request(g, command, payload is not None)
        if payload is not None:
            try:
                cast(Connection, self.workers.conns[g]).send_bytes(
                    pickle.dumps(payload, pickle.HIGHEST_PROTOCOL)
                )
            except OSError:  # the worker died since its last reply
                return False
        return True

    def flush(self) -> None:
        """After a round's commands were sent: ring the hosts serving in turns."""
        self.workers.ring_hosts()

    def wait(
        self,
        workers: list[int],
        deadline: float | None,
        first: bool,
        spun_s: float | None = None,
    ) -> Seen:
        """A first-ready pool's wait: on the pool's shared doorbell, then every worker's
        reply taken; else on the first worker's doorbell (``spun_s``: the full round
        already spun and slept that long on it). Either blocks in one piece until a reply,
        a death of a worker of ``workers`` (the death watch rings the wait:
        :meth:`WorkerProcesses.died`) or ``deadline``."""
        workers_ = self.workers
        doorbells, words, dead = workers_.doorbells, workers_.words, workers_.dead
        replied = workers_.replied  # its done token taken, with ACK caught up (R8)
        g = workers[0]
        if g in self._inline:
            return Seen([g])

        def alive() -> bool:
            return not dead or dead.isdisjoint(workers)

        if first:
            # A token per reply; a reply may be found before its token is taken (then a
            # later wait wakes with nothing new, and waits again).
            Doorbell.wait(workers_.any_done, self._any_budget, deadline, alive)
            ready = [h for h in workers if replied(h)]
            return Seen(ready, {h: "" for h in workers if h in dead and h not in ready})
        if workers_.bell is not None and words[g][GATHER]:
            return self._gather_wait(workers, deadline, alive, spun_s)
        got = Doorbell.wait(
            cast(Doorbell, doorbells[g]).done, self._budgets[g], deadline, alive, spun_s
        )
        if got and words[g][REQ] == words[g][ACK]:
            return Seen([g])
        ready, found = [], {}
        for h in workers:
            if h == g and got:  # the death watch's token
                found[h] = ""
            elif h in dead:
                if replied(h):
                    ready.append(h)  # it replied, then exited
                else:
                    found[h] = ""
        return Seen(ready, found) if ready or found else NOTHING

    def busy(self, workers: list[int]) -> list[int]:
        """The workers of ``workers`` alive and still running their command: a look that
        leaves every reply's token where it is (a Ctrl-C's note asks it, and the round goes
        on after): ``REQ`` ahead of ``ACK``, on the round bell as on the semaphores."""
        words, procs = self.workers.words, self.workers.procs
        return [
            g
            for g in workers
            if g not in self._inline and procs[g].is_alive() and words[g][REQ] != words[g][ACK]
        ]

    def recover(self, workers: list[int]) -> list[int]:
        """After a Ctrl-C in a wait on ``workers``: those that replied, each one's done token
        taken now unless the interrupted wait took it (and lost the news: an interrupt is
        raised at any bytecode, also just after a take). ``ACK`` caught up with ``REQ`` is a
        reply; its token is posted after the ``ACK`` (R6), so once the worker sleeps on its
        next command (``SLEEP`` set, on the round bell), is dead or had :data:`RECOVER_S`
        seconds, the token is either there (taken here) or was taken. A full round's replies
        (``GATHER``) have no token."""
        words, procs, doorbells = self.workers.words, self.workers.procs, self.workers.doorbells
        replied = []
        end = time.monotonic() + RECOVER_S
        for g in workers:
            w = words[g]
            if g in self._inline or w[REQ] != w[ACK]:
                continue
            if not w[GATHER]:
                done = cast(Doorbell, doorbells[g]).done
                while not done.acquire(False):
                    if w[SLEEP] or not procs[g].is_alive() or time.monotonic() > end:
                        done.acquire(False)  # posted before it slept, or taken before
                        break
                    time.sleep(0.0002)
            replied.append(g)
        return replied

    def rewake(self) -> None:
        """After a Ctrl-C in a first-ready wait: give back the pool's shared doorbell token,
        which the wait may have taken before it looked who replied (a spare one only wakes a
        later wait with nothing new, which waits again)."""
        if self.workers.any_done is not None:
            self.workers.any_done.release()

    def _gather_wait(
        self,
        workers: list[int],
        deadline: float | None,
        alive: Callable[[], bool],
        spun_s: float | None,
    ) -> Seen:
        """Wait for a full round's workers (their commands were rung on the round bell,
        GATHER): until every one arrived (the bell's count at 0, or each one's ACK caught up
        with its REQ), one died (the bell's alarm wakes the wait: R8), or the deadline;
        report the ones that replied by then."""
        words, dead = self.workers.words, self.workers.dead
        gate = _Gathered(cast(RoundBell, self.workers.bell), [words[h] for h in workers])
        if Doorbell.wait(gate, self._round_budget, deadline, alive, spun_s):
            return Seen(list(workers))
        ready = [h for h in workers if words[h][REQ] == words[h][ACK]]
        found = {h: "" for h in workers if h in dead and h not in ready}
        return Seen(ready, found) if ready or found else NOTHING

    def read(self, g: int, done: Round) -> None:
        """Read the reply of worker ``g``, whose done semaphore was just taken, into ``done``."""
        if g in self._inline:
            result, failure = cast(tuple[Any, Any], self._driver_block_reply)
            self._driver_block_reply = None
            if failure is None:
                done.results[g] = result
            else:
                done.failures[g] = failure
            return
        words = self.workers.words[g]  # its items are Python ints (a numpy int64 compares slowly)
        status, where, payload = words[STATUS], words[REPLY_PAYLOAD], None
        if where:
            try:
                payload = self.workers.payload(g, where, words[REPLY_BYTES])
            except (EOFError, OSError):
                done.crashed[g] = ""
                return
        if status == _ERROR:
            done.failures[g] = cast(Failure, payload)
        else:
            done.results[g] = payload

    def _bind_full_round(self) -> FullRound | None:
        """:attr:`full_round`: ``_speedups.full_round`` bound to this transport's workers;
        ``None`` without the C step path, the shared POSIX semaphores, or in a first-ready
        pool (the Python round rings and waits for each worker then). It rings every worker
        (unless step_async did), steps the driver's own block, spins on the replies, then
        waits on the round bell until ``wait_s`` (a death's alarm or a Ctrl-C ends it too):
        ``None`` when the round is complete, else a
        :class:`~envfleet._core.protocol.RoundOutcome` of what it left. (No reference to self
        in it: a cycle would keep the shared memory past close until the GC runs.)"""
        full_round = _speedups.function("full_round")
        round_plan = _speedups.function("round_plan")
        doorbells = [self.workers.doorbells[g] for g in self.remote]
        bell = self.workers.bell
        if (
            full_round is None
            or round_plan is None
            or self.workers.any_done is not None
            or not all(
                type(d.request) is SharedSem and type(d.done) is SharedSem
                for d in cast(list[Doorbell], doorbells)
            )
        ):
            return None
        check_control_row()
        driver_block = None
        if self._driver_block is not None:
            driver_block = functools.partial(self._driver_block_timer.call, self._driver_block.step)
        plan = round_plan(  # full_round's one handle: what each round reads, parsed once
            tuple(cast(Doorbell, d).request.address for d in doorbells),
            tuple(cast(Doorbell, d).done.address for d in doorbells),
            tuple(int(self.workers.control[g].ctypes.data) for g in self.remote),
            [self._budgets[g] for g in self.remote],
            driver_block,
            EnvFailure,
            TIGHT_SPIN_S,
            int(Command.STEP),
            int(Status.OK),
            None if bell is None else bell.address,
            self._round_budget,
            RoundOutcome,
        )
        return functools.partial(full_round, plan)

    def step_times(self) -> tuple[StepTimeStats, ...]:
        return step_time_table(self.workers.stats)

    # -- hosts (a first-ready pool's one-env groups, several to a process) ---------------------

    def host_mates(self, groups: Sequence[int]) -> list[int]:
        """The groups that share a worker process with one of ``groups``, not in it (they go
        down with it)."""
        return sorted({m for g in groups for m in self.workers.mates(g)} - set(groups))

    def hosted(self, g: int) -> bool:
        """Whether group ``g`` shares its worker process with other groups."""
        return len(self.workers.mates(g)) > 1

    def kill(self, groups: Sequence[int]) -> None:
        self.workers.kill(groups)

    def fault_group(self, g: int) -> int | None:
        return self.workers.fault_group(g)

    def replied(self, g: int) -> bool:
        return self.workers.replied(g)

    def respawn_all(self, reasons: dict[int, str]) -> None:
        self.workers.respawn_all(reasons)

    def pending_step(self, g: int) -> tuple[list[EnvRecording], list[Any]] | None:
        """Hosted group ``g``, its process gone while it was sent a plain step: its envs'
        episodes before that step and the step's actions, to take it again in a new
        process: from its log when the step began (recorded: its count ahead of the one it
        last replied with), else its episodes so far and the actions in the batch; ``None``
        when not known (no log, a step with a payload)."""
        count = self.workers.log_count(g)
        if count is None or self.workers.words[g][CMD_PAYLOAD]:
            return None
        if count[0] > count[1]:
            recordings, actions = self.workers.before_step(g)
        else:
            start, stop = self.ranges[g]
            recordings = self.workers.recordings(g)
            actions = [_row(self.batch.actions, e) for e in range(start, stop)]
        if len(recordings) != len(actions):
            return None
        return recordings, actions

    def respawn(self, g: int, reason: str) -> None:
        self.workers.respawn(g, reason)

    def stacks(self, workers: list[int]) -> dict[int, str]:
        return self.workers.stacks(workers)

    def recordings(self, g: int) -> list[EnvRecording]:
        return self.workers.recordings(g)

    def log_head(self, g: int) -> tuple[int, int, Any] | None:
        return self.workers.log_head(g)

    def running_env(self, g: int) -> int | None:
        return self.workers.running_env(g)

    def before_step(self, g: int) -> tuple[list[EnvRecording], list[Any]]:
        return self.workers.before_step(g)

    def rss(self, g: int) -> int | None:
        return self.workers.rss(g)

    def worker_memory(self) -> tuple[WorkerMemory, ...]:
        return self.workers.worker_memory()

    def lay_out(self, workers: list[int], probe: Any) -> bool:
        return self.workers.lay_out(workers, probe)

    def crash_error(
        self, w: int, step: int, note: str, reason: str, starting: bool, fate: str = CLOSED
    ) -> EnvCrashedError:
        return self.workers.crash_error(w, step, note, reason, starting, fate)

    def disown(self) -> None:
        self.workers.disown()

    def close(self, timeout: float | None, terminate: bool, busy: Sequence[int]) -> None:
        """Close the driver's own envs, if any, and every worker (:meth:`WorkerProcesses.close`:
        ask, terminate, kill, within ``timeout``)."""
        if self.workers.closed:
            return
        if self._driver_block is not None:
            self._driver_block.close()
        self.workers.close(timeout, terminate, busy)

    def env_error(self, w: int, failure: Any, note: str) -> EnvError:
        if isinstance(failure, EnvFailure):  # the driver's own block
            exc = failure_error(failure, note)
            exc.__cause__ = failure.__cause__
            return exc
        return remote_env_error(cast(Failure, failure).errors[0], w, note)


def _row(tree: Any, i: int) -> Any:
    """Row ``i`` of a batched tree of arrays (the batch's actions), a copy."""
    if isinstance(tree, dict):
        return {key: _row(leaf, i) for key, leaf in tree.items()}
    if isinstance(tree, tuple):
        return tuple(_row(leaf, i) for leaf in tree)
    return tree[i].copy()


class _Gathered:
    """A full round's arrivals as the "semaphore" Doorbell.wait takes: ``acquire(False)``
    polls (no system call), ``acquire(True, timeout)`` sleeps on the round bell."""

    __slots__ = ("bell", "words")

    def __init__(self, bell: RoundBell, words: list[memoryview]):
        self.bell, self.words = bell, words

    def _all_acked(self) -> bool:
        return all(w[REQ] == w[ACK] for w in self.words)

    def acquire(self, block: bool = True, timeout: float | None = None) -> bool:
        bell = self.bell
        if bell.gathered() or self._all_acked():
            return True
        if not block:
            return False
        # A worker that died never arrives: the count stays above 0, the death watch's alarm
        # ends the sleep, and the survivors' ACKs tell who replied.
        return bell.gather_sleep(timeout) or self._all_acked()


# -- interpreter exit -----------------------------------------------------------------------

# Every transport of this process, until collected (a closed one stays, and is skipped).
_OPEN: weakref.WeakSet[ProcessesTransport] = weakref.WeakSet()


def _close_at_exit() -> None:
    """At interpreter exit (after an uncaught KeyboardInterrupt too), close every transport of
    this process still open, as a vector env dropped without ``close()`` is: its workers
    terminated (SIGTERM, then SIGKILL a second later), its shared memory and files released.

    It runs before multiprocessing's own exit handler (registered first, so run last), which
    would SIGTERM every daemonic worker and then join each without a timeout: forever for a
    worker whose env ignores or catches SIGTERM (SDL's do), so that a Ctrl-C never ended the
    driver. The vector env's ``__del__`` would close it only after that, at finalization."""
    for transport in list(_OPEN):
        if transport._owner_pid != os.getpid() or transport.closed:
            continue  # a forked child's copy (disowned), or closed already
        with contextlib.suppress(Exception):  # exiting: nothing left to report it to
            transport.close(0, True, ())


# multiprocessing.util registers its exit handler when first imported (imported above); atexit
# runs handlers last registered first, so this one runs before it.
atexit.register(_close_at_exit)


# -- registration (envfleet._backends.registry) ---------------------------------------------


def _plan(request: PlanRequest) -> Plan:
    """:func:`plan_processes` for make()'s arguments (the options table,
    :data:`envfleet._front.options.RULES`, has refused what cannot go with a driver share)."""
    cores, spin_s, num_workers = usable_cores(), request.options["spin_s"], request.num_workers
    if request.pool and num_workers is None:
        # A first-ready pool's default (make() left the worker count to it): one env per
        # group, the groups hosted a core's worth to a process.
        plan = hosted_pool_plan(request.num_envs, spin_s, cores)
        return Plan(plan.ranges, plan, driver_free=True)
    driver_envs = request.options["driver_envs"]
    plan = plan_processes(request.num_envs, num_workers, driver_envs, spin_s, cores)
    # Every env in a worker: make() builds none in the driver (env 0's spaces come from it).
    return Plan(plan.ranges, plan, driver_free=plan.driver_envs == 0)


def _build(request: BuildRequest) -> RoundDriver:
    transport = ProcessesTransport(request, request.plan.details)
    return RoundDriver(transport, transport.remote, request.start_timeout)


register(
    BackendSpec(
        "processes",
        build=_build,
        plan=_plan,
        pickles_factories=True,
        recycles_by_default=True,
    )
)
