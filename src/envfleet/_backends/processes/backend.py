"""``backend="processes"``: EnvGroups in worker processes, data in shared memory (DESIGN §1, §3).

Each worker holds a contiguous block of envs. Observations, actions, rewards, terminations
and truncations live in one shared :class:`envfleet._core.buffers.Block`; per worker, a few shared
control words carry the :class:`Command` and the reply status, and a
:class:`~envfleet._backends.processes.doorbell.Doorbell` (two semaphores, spin-then-block)
carries the "go" and the "done". Only what does not fit the buffers is pickled: reset options, call
arguments and results, non-empty infos, errors. Requests travel on the worker's pipe, after
its doorbell rang; a reply goes in the worker's shared mailbox (:data:`MAILBOX_BYTES`) when
it fits, else on the pipe, so the infos an env returns every step (Atari's) cost no system
call.

Optionally the driver steps the first block of envs itself while the workers step theirs
(``driver_envs``), so that on a machine with few cores no core idles while the driver waits.
Those envs then live in the driver process: their Python exceptions are reported as usual, but
a native crash in them takes the driver down with it.

Every wait also watches the workers: a worker that dies (segfault, ``os._exit``, SIGKILL)
raises :class:`envfleet.EnvCrashedError` within one blocking slice instead of hanging. Workers
exit when the driver dies: Linux SIGKILLs them (``PR_SET_PDEATHSIG``), and a blocked worker
also checks between slices that the driver is still there.

This module holds the driver's side (:class:`ProcessesBackend`: its rounds, the C step round,
the first-ready pool) and the registration; starting, restarting and closing the worker
processes is :mod:`envfleet._backends.processes.lifecycle` (the backend's base class); the
worker process and the shared-memory layout both sides read are
:mod:`envfleet._backends.processes.worker`; the plan is :mod:`envfleet._backends.processes.plan`.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import mmap
import multiprocessing
import multiprocessing.sharedctypes
import os
import pickle
import sys
import time
from collections.abc import Callable, Mapping
from multiprocessing import reduction
from multiprocessing.connection import Connection
from typing import Any, cast

from envfleet._backends.base import (
    failure_error,
    mismatch_error,
    remote_env_error,
    run_command,
)
from envfleet._backends.processes.doorbell import (
    SEM_SLOT,
    TIGHT_SPIN_S,
    Doorbell,
    SharedSem,
    SpinBudget,
    shared_semaphore,
)
from envfleet._backends.processes.lifecycle import DEFAULT_CLOSE_TIMEOUT, WorkerProcesses
from envfleet._backends.processes.plan import DEFAULT_SPIN_S, ProcessesPlan, plan_processes
from envfleet._backends.processes.worker import (
    CMD,
    CMD_PAYLOAD,
    GROUP_BYTES,
    IN_MAILBOX,
    IN_REGION,
    MAILBOX_BYTES,
    NEW_REGION,
    REPLY_BYTES,
    REPLY_PAYLOAD,
    STATUS,
    control_words,
    mailbox,
    native_layout,
    read_region,
    stats_rows,
    word_view,
)
from envfleet._backends.registry import (
    BackendSpec,
    BuildRequest,
    Plan,
    PlanRequest,
    register,
)
from envfleet._backends.supervisor import Round, Supervisor
from envfleet._backends.workers import watch
from envfleet._core import native as _speedups
from envfleet._core.cores import usable_cores
from envfleet._core.envgroup import EnvFailure, EnvGroup
from envfleet._core.errors import (
    ConfigError,
    EnvError,
    EnvfleetError,
)
from envfleet._core.protocol import Command, Failure, RestartRequest, Status
from envfleet._core.stats import STATS_WORDS, StepTimer, StepTimeStats, step_time_table

__all__ = ["DEFAULT_CLOSE_TIMEOUT", "DEFAULT_SPIN_S", "ProcessesBackend"]

logger = logging.getLogger("envfleet")

# The hot path's Enum members as module globals (an Enum member lookup is slow).
_STEP, _ERROR = Command.STEP, int(Status.ERROR)


class ProcessesBackend(WorkerProcesses):
    """Worker processes holding contiguous blocks of envs over one shared block.

    Args:
        request: make()'s :class:`BuildRequest`: the factories (cloudpickled), the start
            method, the ledger (with a restart policy, failed envs and dead or hung workers
            are rebuilt; the driver's own block must then be empty), a first-ready pool
            (workers may be sent commands while others run, and :meth:`collect_ready` returns
            whichever finish first; no driver block then), ``start_timeout``, and env 0: built
            in the driver (``request.first_env``: used as the driver's env 0 when the driver
            steps a block, else closed), or, with every env in a worker (``driver_envs=0``),
            built by the first worker, which sends its spaces back (``request.learn``): no
            env is built in the driver then, and the shared block is allocated once they are
            known and handed to the workers on their pipes.
        plan: the :class:`ProcessesPlan`: the driver's share (``driver_envs > 0``: the driver
            steps the first block itself, no process for it) and the spin budgets (the most
            seconds a wait polls before blocking, in the driver and in each worker; 0: always
            block; the budget adapts to the waits seen).

    Raises:
        EnvError: a factory raised while building an env (``method == "make"``).
        SpaceMismatchError: an env's spaces differ from env 0's (or the given pair's).
        EnvCrashedError: a worker died while starting.
        StartTimeoutError: the workers did not build their envs within ``start_timeout``.
    """

    def __init__(self, request: BuildRequest, plan: ProcessesPlan):
        driver_group = plan.driver_envs > 0
        self.ranges = list(request.plan.ranges)
        self.ledger = request.ledger
        assert self.ledger.policy is None or not driver_group, "restarts need every env in a worker"
        self._blobs, self._accepts = request.blobs, request.accepts_index
        self._worker_spin_s = plan.worker_spin_s
        # Every env in a worker: env 0's spaces come from its worker, the block after them.
        self._block_fd: int | None = None
        self._layout_later = request.first_env is None
        if not self._layout_later:
            self._lay_out(request.layout, request.block(shared=True))
        self._ctx: Any = cast(Any, multiprocessing.get_context(request.context))
        groups = len(self.ranges)
        # Per group: one cache line of control words, then the doorbell's two semaphores.
        self._control_raw: Any = multiprocessing.sharedctypes.RawArray(
            ctypes.c_uint8, groups * GROUP_BYTES
        )
        self._control = control_words(self._control_raw)
        # The same words as one int64 memoryview per group: ~2x cheaper to write than numpy.
        self._words = [word_view(row) for row in self._control]
        self._mail_raw: Any = multiprocessing.sharedctypes.RawArray(
            ctypes.c_uint8, groups * MAILBOX_BYTES
        )
        self._mailboxes = [mailbox(self._mail_raw, g) for g in range(groups)]
        self._stats_raw: Any = multiprocessing.sharedctypes.RawArray(
            ctypes.c_double, groups * STATS_WORDS
        )
        self._stats = stats_rows(self._stats_raw)
        self._local_timer = StepTimer(self._stats[0])
        self.supervisor = Supervisor(self)
        self._any_raw: Any = None
        self._any_done: Any = None
        if request.pool:
            assert not driver_group, "a first-ready pool has every env in a worker"
            self._any_raw = multiprocessing.sharedctypes.RawArray(ctypes.c_uint8, SEM_SLOT)
            self._any_done = shared_semaphore(self._ctx, self._any_raw, 0)
        self._command = Command.STEP
        self._local: EnvGroup | None = None
        self._local_result: Any = None
        self._local_failure: EnvFailure | None = None
        self._procs: list[Any] = [None] * groups
        self._conns: list[Connection | None] = [None] * groups
        # Per worker, the driver's mapping of its reply region (ReplyRegion), once it sent one.
        self._regions: list[mmap.mmap | None] = [None] * groups
        self._doorbells: list[Doorbell | None] = [None] * groups
        self._budgets = [SpinBudget(plan.driver_spin_s) for _ in range(groups)]
        self._any_budget = SpinBudget(plan.driver_spin_s)
        self._remote = list(range(1 if driver_group else 0, groups))
        self._pending: list[int] = []
        self._step_round: Callable[[bool], tuple[Any, Any, int, list[int], float]] | None = None
        self._closed = False
        # A forked worker flushes the stdio buffers it inherits when it exits: flush them
        # here so nothing the driver printed is printed again.
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        first_env = request.first_env
        try:
            for g in self._remote:
                self.start_worker(g)
            if driver_group:
                # Built while the workers build theirs; env 0 is the one make() already built.
                env0, first_env = first_env, None  # the group owns it now
                layout = self._layout
                self._local = EnvGroup(
                    layout.bound_fns(*self.ranges[0]),
                    0,
                    self.batch,
                    layout.single_observation_space,
                    layout.single_action_space,
                    layout.autoreset_mode,
                    first_env=env0,
                    same_observation_space=layout.same_observation_space,
                )
                mismatch = self._local.check_spaces()
                if mismatch is not None:
                    raise mismatch_error(mismatch)
            if first_env is not None:
                first_env.close()
                first_env = None
            self.check_ready(self.await_started(self._remote, request, request.start_timeout))
            self._step_round = self._bind_step_round()
        except EnvFailure as failure:
            self.close(timeout=None, terminate=True)
            raise failure_error(failure) from failure.__cause__
        except BaseException:
            if first_env is not None:
                first_env.close()
            self.close(timeout=None, terminate=True)
            raise

    @property
    def num_workers(self) -> int:
        """Worker processes (the driver's own block, if any, is not one)."""
        return len(self._remote)

    # -- Backend --------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._closed

    def submit(self, command: Command, payloads: Mapping[int, Any], step: int) -> None:
        self.supervisor.guarded(self._submit, command, payloads, step)

    def collect(self, timeout: float | None, step: int) -> dict[int, Any]:
        return self.supervisor.guarded(self._collect, timeout, step)

    def inline_groups(self, command: Command) -> frozenset[int]:
        return frozenset((0,)) if self._local is not None else frozenset()

    def round(
        self, command: Command, payloads: Mapping[int, Any], timeout: float | None, step: int
    ) -> dict[int, Any]:
        return self.supervisor.guarded(self._round, command, payloads, timeout, step)

    def finish(
        self, command: Command, inline: Mapping[int, Any], timeout: float | None, step: int
    ) -> dict[int, Any]:
        # step_wait of a plain step: step_async rang every worker, the driver's own block is
        # left: the C round runs it and spins on the replies, without ringing again.
        if (
            command is _STEP
            and self._step_round is not None
            and self._pending == self._remote
            and list(inline) == [0]
            and inline[0] is None
        ):
            return self.supervisor.guarded(self._fast_step_round, timeout, step, False)
        return super().finish(command, inline, timeout, step)

    def _round(
        self, command: Command, payloads: Mapping[int, Any], timeout: float | None, step: int
    ) -> dict[int, Any]:
        if (
            command is _STEP
            and self._step_round is not None
            and not self._pending
            and len(payloads) == len(self.ranges)
        ):
            return self._fast_step_round(timeout, step)
        self._submit(command, payloads, step)
        return self._collect(timeout, step)

    def _fast_step_round(
        self, timeout: float | None, step: int, ring: bool = True
    ) -> dict[int, Any]:
        """A step's _submit and _collect, with the ringing (unless ``ring`` is false: a
        step_async rang already), the driver's own block and the spin on each worker's reply
        in C (_speedups.step_round); what that leaves (a reply to read, a worker still
        running, a failure) goes the Python way, in _collect, with what is left of
        ``timeout`` after the driver's own block."""
        self._command = _STEP
        self._pending = remote = self._remote
        started = time.monotonic()
        local_result, local_failure, taken, unread, spun_s = self._step_round(ring)  # type: ignore[misc]
        if taken == len(remote) and not unread and local_failure is None:
            self._pending = []
            results = dict.fromkeys(remote)  # every worker replied OK, with nothing to read
            if self._local is not None and local_result is not None:
                results[0] = local_result
            return results
        done = Round()
        fail_fast = not self.ledger.restarts_on(_STEP)
        for i in range(taken):
            if i in unread:
                self._read_reply(remote[i], done, step, fail_fast)
            else:
                done.results[remote[i]] = None
        self._pending = remote[taken:]
        self._local_result, self._local_failure = local_result, local_failure
        if timeout is not None and not ring:
            timeout = max(0.0, timeout - (time.monotonic() - started))
        return self._collect(timeout, step, done, spun_s if self._pending else None)

    def _bind_step_round(self) -> Callable[[bool], tuple[Any, Any, int, list[int], float]] | None:
        """_speedups.step_round bound to this backend's workers, or ``None`` where it does not
        apply (no C step path, not the shared POSIX semaphores, a first-ready pool)."""
        step_round = _speedups.function("step_round")
        doorbells = [self._doorbells[g] for g in self._remote]
        if (
            step_round is None
            or self._any_done is not None
            or not all(
                type(d.request) is SharedSem and type(d.done) is SharedSem
                for d in cast(list[Doorbell], doorbells)
            )
        ):
            return None
        native_layout()
        local = None
        if self._local is not None:
            local = functools.partial(self._local_timer.call, self._local.step)
        return functools.partial(
            step_round,
            tuple(cast(Doorbell, d).request.address for d in doorbells),
            tuple(cast(Doorbell, d).done.address for d in doorbells),
            tuple(int(self._control[g].ctypes.data) for g in self._remote),
            [self._budgets[g] for g in self._remote],
            local,
            EnvFailure,
            TIGHT_SPIN_S,
            int(Command.STEP),
            int(Status.OK),
        )

    def step_times(self) -> tuple[StepTimeStats, ...]:
        return step_time_table(self._stats)

    def _submit(self, command: Command, payloads: Mapping[int, Any], step: int) -> None:
        self._command = command
        words = self._words
        if len(payloads) == len(self.ranges):
            remote = self._remote  # every group (a step, or any synchronous call)
        else:
            procs = self._procs
            remote = sorted(g for g in payloads if procs[g] is not None)
        code = int(command)
        for g in remote:
            payload = payloads[g]
            words[g][CMD] = code
            words[g][CMD_PAYLOAD] = payload is not None
            self._doorbells[g].request.release()  # type: ignore[union-attr]
            if payload is not None:
                try:
                    cast(Connection, self._conns[g]).send_bytes(
                        pickle.dumps(payload, pickle.HIGHEST_PROTOCOL)
                    )
                except OSError:  # the worker died since its last reply
                    if self.ledger.restarts_on(command):
                        continue  # the wait for its reply finds it dead and restarts it
                    self._pending = []
                    self.supervisor.crashed(g, step)
        if self._any_done is not None and command is not Command.RESTART:
            self.supervisor.sent(remote, command)  # a pool's deadlines and restarts
        # A pool adds to the workers still running; a synchronous call has none pending.
        self._pending = sorted(set(self._pending).union(remote)) if self._pending else remote
        self._local_result, self._local_failure = None, None
        if self._local is not None and 0 in payloads:
            # The driver's own block, stepped while the workers step theirs.
            try:
                self._local_result = run_command(
                    self._local, command, payloads[0], self._local_timer
                )
            except EnvFailure as failure:
                self._local_failure = failure

    def _collect(
        self,
        timeout: float | None,
        step: int,
        done: Round | None = None,
        spun_s: float | None = None,
    ) -> dict[int, Any]:
        local_result, local_failure = self._local_result, self._local_failure
        self._local_result, self._local_failure = None, None
        fail_fast = not self.ledger.restarts_on(self._command)
        done = self._collect_remote(timeout, step, fail_fast, done, spun_s)
        if local_failure is not None:
            # Every env that raised counts, the workers' as well as the driver's own.
            self.ledger.count_env_errors([local_failure, *done.failures.values()])
            raise failure_error(local_failure) from local_failure.__cause__
        results = self.supervisor.settle(done, timeout, step, self._command)
        if self._local is not None and local_result is not None:
            results[0] = local_result
        return results

    def collect_ready(self, timeout: float | None, step: int) -> dict[int, Any]:
        """First-ready pool: wait until at least one pending worker has replied; return the
        replies of every worker done by then (worker index -> result).

        Raises:
            EnvError: an env raised; the other replies read with it, and any other env error,
                are kept for the next calls (one error per call).
            EnvCrashedError: a pending worker died; the backend is shut down.
            StepTimeoutError: no worker replied within ``timeout`` seconds; shut down.
        """
        return self.supervisor.guarded(self._collect_ready, timeout, step)

    def _collect_ready(self, timeout: float | None, step: int) -> dict[int, Any]:
        supervisor = self.supervisor
        if supervisor.has_kept():
            return supervisor.take_kept()
        if self._any_done is None:  # synchronous: every env is pending, wait for them all
            return self._collect(timeout, step)
        procs, doorbells = self._procs, self._doorbells
        # Without a restart policy a dead or late worker raises at once; with one, it is
        # noted in the round and the supervisor rebuilds it.
        fail_fast = self.ledger.policy is None

        def alive() -> bool:
            return all(procs[g].is_alive() for g in self._pending)

        while True:
            # Each pending worker has ``timeout`` seconds from its send: the wait ends at the
            # first of those deadlines, and a worker past its own is late whatever the others
            # reply meanwhile.
            deadline = supervisor.deadline(self._pending, timeout)
            # A token per reply; a reply may be found before its token is taken (then a later
            # wait wakes with nothing new, and waits again).
            woke = Doorbell.wait(self._any_done, self._any_budget, deadline, alive)
            ready = [g for g in self._pending if cast(Doorbell, doorbells[g]).done.acquire(False)]
            done = Round()
            # Every call looks at every pending worker: a dead or late one is reported even
            # while others keep replying (an exited worker's reply was taken above, if any).
            unread = [g for g in self._pending if g not in ready]
            for exit_ in watch([procs[g] for g in unread]).dead:
                if fail_fast:
                    supervisor.crashed(unread[exit_.index], step)
                done.crashed[unread[exit_.index]] = ""
            if deadline is not None and (not woke or time.monotonic() >= deadline):
                waiting = [g for g in self._pending if g not in ready and g not in done.crashed]
                late = supervisor.late(waiting, timeout)
                if late:
                    if fail_fast:
                        supervisor.timed_out(late, timeout)
                    done.late = late
            if not ready and not done.failed:
                continue
            gone = {*ready, *done.crashed, *done.late}
            self._pending = [g for g in self._pending if g not in gone]
            for g in ready:
                self._read_reply(g, done, step, fail_fast)
            return supervisor.ready(done, timeout, step)

    def _collect_remote(
        self,
        timeout: float | None,
        step: int,
        fail_fast: bool,
        done: Round | None = None,
        spun_s: float | None = None,
    ) -> Round:
        """Wait for every pending worker and read its reply.

        ``fail_fast``: a dead worker or the timeout raises at once (and closes the backend);
        otherwise they are noted in the returned round, and so are env failures, for
        the supervisor. ``done``: the round so far (what step_round read); ``spun_s``: the
        first pending worker's reply was already spun for that long.
        """
        pending = self._pending
        self._pending = []
        deadline = None if timeout is None else time.monotonic() + timeout
        done = Round() if done is None else done
        procs, doorbells, budgets = self._procs, self._doorbells, self._budgets
        # Every wait watches every worker still to reply: a death is seen at once, whatever
        # the worker waited on is doing.
        waiting = list(pending)

        def alive() -> bool:
            return all(procs[h].is_alive() for h in waiting)

        while waiting:
            g = waiting[0]
            sem = cast(Doorbell, doorbells[g]).done
            if Doorbell.wait(sem, budgets[g], deadline, alive, spun_s):
                spun_s = None
                waiting.pop(0)
                self._read_reply(g, done, step, fail_fast)
                continue
            spun_s = None
            dead = [waiting[exit_.index] for exit_ in watch([procs[h] for h in waiting]).dead]
            for h in dead:
                waiting.remove(h)
                if h != g and cast(Doorbell, doorbells[h]).done.acquire(False):
                    self._read_reply(h, done, step, fail_fast)  # it replied, then exited
                    continue
                done.crashed[h] = ""
                if fail_fast:
                    self.supervisor.crashed(h, step)
            if not dead:  # the deadline passed
                waiting.pop(0)
                done.late.append(g)
        if done.late and fail_fast:
            self.supervisor.timed_out(done.late, timeout)
        return done

    def _read_reply(self, g: int, done: Round, step: int, fail_fast: bool) -> None:
        """Read the reply of worker ``g``, whose done semaphore was just taken, into ``done``."""
        words = self._words[g]  # its items are Python ints (a numpy int64 compares slowly)
        status = words[STATUS]
        payload = None
        where = words[REPLY_PAYLOAD]
        if where:
            try:
                payload = self._reply_payload(g, where, words[REPLY_BYTES])
            except (EOFError, OSError):
                done.crashed[g] = ""
                if fail_fast:
                    self.supervisor.crashed(g, step)
                return
        if status == _ERROR:
            done.failures[g] = cast(Failure, payload)
        else:
            done.results[g] = payload

    def _reply_payload(self, g: int, where: int, size: int) -> Any:
        """Worker ``g``'s reply payload: from its mailbox or its pipe (``where``), with its
        large buffers from its reply region (worker.ReplyRegion).

        Raises:
            EOFError, OSError: the pipe closed (the worker died while sending).
        """
        conn = cast(Connection, self._conns[g])
        if where & NEW_REGION:  # the worker's new reply region: its descriptor comes first
            try:
                fd = reduction.recv_handle(conn)
            except RuntimeError as exc:  # recvfds: no descriptor came
                raise EOFError(str(exc)) from exc
            try:
                old, self._regions[g] = (
                    self._regions[g],
                    mmap.mmap(fd, os.fstat(fd).st_size, prot=mmap.PROT_READ),
                )
            finally:
                os.close(fd)
            if old is not None:
                old.close()
        blob = self._mailboxes[g][:size] if where & IN_MAILBOX else conn.recv_bytes()
        if where & IN_REGION:
            return read_region(self._regions[g], blob)
        return pickle.loads(blob)

    # -- the mechanics the supervisor uses (Supervised) ---------------------------------------

    def env_error(self, w: int, failure: Any, note: str) -> EnvError:
        return remote_env_error(cast(Failure, failure).errors[0], w, note)

    def replace_workers(
        self, workers: list[int], done: Round, timeout: float | None, step: int
    ) -> None:
        for g in workers:
            why = "died" if g in done.crashed else "did not answer in time"
            logger.warning("worker %d %s; restarting it and its envs", g, why)
            self.respawn(g)
        others = [g for g in self._pending if g not in workers]  # a pool's, still running
        try:
            ready = self.await_started(workers, None, timeout, step)
            self._pending = others
            self.check_ready(ready)
        except EnvfleetError:  # a rebuilt worker could not start: give up
            self.close(timeout=0, terminate=True)
            raise

    def restart_envs(
        self, requests: dict[int, RestartRequest], timeout: float | None, step: int
    ) -> Round:
        command = self._command
        others = [g for g in self._pending if g not in requests]  # a pool's, still running
        self._pending = []
        self._submit(Command.RESTART, requests, step)
        self._command = command
        done = self._collect_remote(timeout, step, fail_fast=True)
        self._pending = others
        return done


# -- registration (envfleet._backends.registry) ---------------------------------------------


def _plan(request: PlanRequest) -> Plan:
    """:func:`plan_processes` for make()'s arguments: a first-ready pool, a timeout or a
    restart policy put every env in a worker (only a worker can be stopped or rebuilt)."""
    driver_envs = request.options["driver_envs"]
    if request.pool and driver_envs:
        raise ConfigError("a first-ready pool steps every env in a worker (driver_envs=0)")
    if request.step_timeout is not None or request.restart_policy is not None:
        if driver_envs:
            raise ConfigError(
                "step_timeout and restart_policy cannot cover envs the driver steps "
                "itself; use driver_envs=0 (the default when either is set)"
            )
        driver_envs = 0
    plan = plan_processes(
        request.num_envs,
        request.num_workers,
        driver_envs,
        request.options["spin_s"],
        usable_cores(),
    )
    # Every env in a worker: make() builds none in the driver (env 0's spaces come from it).
    return Plan(plan.ranges, plan, driver_free=plan.driver_envs == 0)


def _build(request: BuildRequest) -> ProcessesBackend:
    return ProcessesBackend(request, request.plan.details)


register(
    BackendSpec(
        "processes",
        build=_build,
        plan=_plan,
        options=("driver_envs", "spin_s"),
        pickles_factories=True,
    )
)
