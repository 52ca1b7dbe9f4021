"""The round driver: every round of every transport, written once.

A *transport* (``serial``, ``threads``, ``processes``, ``ray``) moves commands to its workers
and replies back through the few primitives of :class:`~envfleet._backends.transport.Transport`;
:class:`RoundDriver`, the one :class:`~envfleet._backends.base.Backend` the front talks to,
runs every round over it (the synchronous round, the first-ready pool's, calls and tasks,
the Sampler's worker rounds, ProcessEnv's calls, the start and replacement of workers:
:class:`~envfleet._backends.replacement.WorkerReplacement`):

1. **command out**: :meth:`Transport.send` to each worker of the round (the groups run in
   the calling thread, :meth:`Transport.inline`, last, so the others run meanwhile);
2. **replies, deaths, deadline in**: :meth:`RoundDriver.wait_replies`, the one wait, over
   :meth:`Transport.wait` (it watches replies, deaths and the deadline at once, as CPython's
   ``concurrent.futures.ProcessPoolExecutor`` waits on result pipes and process sentinels),
   each reply read into the :class:`Round` by :meth:`Transport.read`;
3. **settle** (:meth:`WorkerReplacement.settle`): the
   :class:`~envfleet._backends.supervisor.Supervisor` decides (the one broken path, or a
   :class:`~envfleet._backends.supervisor.Rebuild` within the restart policy) and this driver
   rebuilds what it answers; the supervisor calls neither this driver's rounds nor a transport.

A transport may lend one accelerator, :attr:`Transport.full_round`: the synchronous step round
in C (``processes``), which answers ``None`` when the round is complete, else a
:class:`~envfleet._core.protocol.RoundOutcome` whose rest (a reply to read, a worker still
running, a failure) goes through the same Python round.

No wait is silent: a wait is capped at the next hang report's time (:class:`_HangReports`),
and a ``KeyboardInterrupt`` in a wait carries a note naming the busy envs and their stacks
(:class:`~envfleet._backends.hang_reports.HangReporter`).

Ctrl-C keeps the run. One in a synchronous round's wait (the C step round's too) is
*deferred*: the round is completed and settled, within ``step_timeout`` when set, else
:data:`INTERRUPT_GRACE_S`, then the interrupt is raised (``_envfleet_completed``: the front
counts the step). A first-ready pool's wait is *undone*: the workers that had not replied stay
pending, the replies that came are kept for the next call. A second Ctrl-C, the grace running
out, an interrupt while a reply is read, in a submit (a command half sent) or inside an env
run in this thread (its step half done) closes the vector env. An interrupt may come just
after a wait took a reply's token and before it said so: the transport's ``recover`` (from the
workers' ``REQ``/``ACK`` words) tells who replied, and a pool's wait gives back a shared token
it may have taken (``rewake``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any, NoReturn, cast

from envfleet._backends.base import Backend
from envfleet._backends.hang_reports import HangReporter
from envfleet._backends.recycle import Recycler
from envfleet._backends.replacement import WorkerReplacement
from envfleet._backends.supervisor import RESTARTABLE, Round, Supervisor
from envfleet._backends.transport import Transport
from envfleet._core.errors import EnvCrashedError, EnvError, EnvfleetError
from envfleet._core.failures import CLOSED
from envfleet._core.hangs import (
    DEFAULT_HANG_REPORT_DELAY,
    InlineRun,
    add_note,
    env_in_frames,
    runs_envs_here,
    traceback_frames,
)
from envfleet._core.protocol import Command, RoundOutcome
from envfleet._core.replay import recording_of, replays_of
from envfleet._core.stats import StepTimeStats

__all__ = ["RoundDriver"]

_STEP, _RESTART = Command.STEP, Command.RESTART

# Seconds a round interrupted by Ctrl-C may take to complete when the call has no
# step_timeout (with one, the step_timeout bounds it). An env's step is milliseconds, a slow
# one (a physics substep loop, a render) well under a second: 5 s completes any step that is
# not hung, yet gives a terminal back soon after Ctrl-C on a hung env (a second Ctrl-C gives
# it back at once). Past it the vector env closes, as an interrupt did before.
INTERRUPT_GRACE_S = 5.0


class RoundDriver(HangReporter, WorkerReplacement, Backend):
    """The one :class:`~envfleet._backends.base.Backend`: every round over ``transport``
    (its hang reports and Ctrl-C notes :class:`HangReporter`'s, its workers' start and
    replacement :class:`WorkerReplacement`'s).

    Args:
        transport: its workers, spawned (their ``READY`` replies not yet read).
        start: the workers whose ``READY`` replies to wait for (none: the transport built
            its envs already).
        start_timeout: seconds the workers may take to build their envs (``None``: no bound),
            at the start and whenever a worker is replaced (restart policy, recycling).

    Raises:
        EnvError, ConfigError: a worker could not build its envs.
        SpaceMismatchError: an env's spaces differ from env 0's.
        EnvCrashedError: a worker died while starting.
        StartTimeoutError: the workers did not build their envs within ``start_timeout``.
    """

    transport: Transport

    def __init__(
        self,
        transport: Transport,
        start: list[int] | None = None,
        start_timeout: float | None = None,
    ):
        self.transport = transport
        self.ranges = transport.ranges
        self.ledger = transport.ledger
        self.late_what, self.late_fate = transport.late_what, transport.late_fate
        self.supervisor = Supervisor(self)
        self._pending: list[int] = []
        self._start_timeout = start_timeout
        self._command = _STEP
        self._pool = transport.pool
        self._full_round = transport.full_round
        # The transport's, or None: a bound method of self here would be a reference cycle,
        # which keeps the workers' shared memory past close until the garbage collector runs.
        self._run_inline = getattr(transport, "run_inline", None)
        # The transport's, or None: after each round's sends (processes: ring the hosts).
        self._flush = getattr(transport, "flush", None)
        self._late_stacks: dict[int, str] | None = None  # _spare()'s, for _replace_workers
        self._remote = transport.remote
        self._num_remote = len(self._remote)
        self._num_workers = len(self.ranges)
        self._every_group: dict[int, Any] = dict.fromkeys(range(self._num_workers))
        self._recycler: Recycler | None = None
        # A Ctrl-C whose round is being completed, raised once it is (_defer, _deliver).
        self._interrupt: KeyboardInterrupt | None = None
        # The commands every group runs here when sent them (not in a pool: a pool's sends
        # and reads are apart).
        self._inline_every = frozenset(
            c for c in Command if not self._pool and len(transport.inline(c)) == len(self.ranges)
        )
        # Hang reports (report_hangs): the delay of the Python waits' reports, and the mark
        # of the runs of envs in the calling thread (the reporter thread watches it).
        self._hang_delay: float | None = None
        self._busy = InlineRun(self, self.ranges, DEFAULT_HANG_REPORT_DELAY)
        # The C step round steps the driver's own block (processes, driver_envs > 0).
        self._driver_block_busy = self._busy if self._num_remote < self._num_workers else None
        if start:
            try:
                self._start(start, start_timeout, 0, at_start=True)
            except BaseException:
                transport.close(None, True, ())
                raise
        self.batch = transport.batch  # known once the workers are laid out

    @property
    def num_workers(self) -> int:
        return self.transport.num_workers

    @property
    def closed(self) -> bool:
        return self.transport.closed

    # -- the front's calls ----------------------------------------------------------------

    def inline(self, command: Command) -> frozenset[int]:
        return self.transport.inline(command)

    def submit(self, command: Command, payloads: Mapping[int, Any], step: int) -> None:
        self.supervisor.guarded(self._submit, command, payloads, step)

    def collect(self, timeout: float | None, step: int) -> dict[int, Any]:
        """See :meth:`Backend.collect`. A Ctrl-C in the wait completes the round, then raises
        (the module's docstring)."""
        stepped = self._command is _STEP
        return self._completed(self.supervisor.guarded, (self._collect, timeout, step), stepped)

    def round(
        self, command: Command, payloads: Mapping[int, Any], timeout: float | None, step: int
    ) -> dict[int, Any]:
        """See :meth:`Backend.round`; a Ctrl-C in its wait completes it, then raises (the
        module's docstring); one inside an env run in this thread closes the backend."""
        return self._completed(self._round_of, (command, payloads, timeout, step), command is _STEP)

    def _round_of(
        self, command: Command, payloads: Mapping[int, Any], timeout: float | None, step: int
    ) -> dict[int, Any]:
        """:meth:`round`'s round: the C one where :meth:`_c_round` says it applies, else
        Python's."""
        ring = self._c_round(command, payloads)
        if ring is not None:
            results = self._fast_round(timeout, step, ring)
            return {} if results is None else results
        return self._any_round(command, payloads, timeout, step)

    def _c_round(self, command: Command, payloads: Mapping[int, Any]) -> bool | None:
        """Whether the round of ``command`` with ``payloads`` (worker -> payload) goes through
        :attr:`Transport.full_round` (:meth:`step_round` asks the same inline): ``True`` to
        ring every worker (a step of every group, none pending), ``False`` to finish what
        step_async rang (every remote worker pending, ``payloads`` the driver's own block's),
        ``None`` for the Python round, also for any payload (the C round reads the actions
        from the shared buffers only)."""
        if command is not _STEP or self._full_round is None:
            return None
        if any(payload is not None for payload in payloads.values()):
            return None
        if not self._pending and len(payloads) == self._num_workers:
            return True
        if self._pending == self._remote and list(payloads) == [0]:
            return False
        return None

    def _completed(self, run: Callable[..., dict[int, Any]], args: tuple, stepped: bool) -> Any:
        """``run(*args)`` (its last argument the step count), then the recycler's look after a
        step round; a completed Ctrl-C is raised after it (:meth:`_deliver`), what ends it as
        :meth:`_ended` says."""
        try:
            results = run(*args)
            if stepped and self._recycler is not None and self._interrupt is None:
                self._recycle_due(args[-1])
        except BaseException as error:
            self._raise_ended(error)
        if self._interrupt is not None:
            self._deliver()
        return results

    def step_round(self, timeout: float | None, step: int) -> dict[int, Any] | None:
        """The plain synchronous step (``round(STEP, every group's None, ...)``): ``None`` when
        every group stepped and no env had an info, else the round's results; through
        :attr:`Transport.full_round` where there is one and nothing is pending."""
        if self._full_round is not None and not self._pending:
            fast = self._fast_round(timeout, step, True)
            recycler = self._recycler
            if recycler is not None:  # its countdown here, its look every CHECK_EVERY rounds
                if recycler.countdown > 1:
                    recycler.countdown -= 1
                else:
                    self._recycle_due(step)
            return fast
        results = self.round(_STEP, self._every_group, timeout, step)
        return results if any(results.values()) else None

    @runs_envs_here
    def _any_round(
        self, command: Command, payloads: Mapping[int, Any], timeout: float | None, step: int
    ) -> dict[int, Any]:
        """Every round :meth:`round` does not take through :attr:`Transport.full_round`: groups
        run here to the end, or the commands sent and their replies waited for and read, guarded."""
        if (
            not self._pending
            and len(payloads) == self._num_workers
            and command in self._inline_every
        ):
            # Every group runs here as it is sent its command, to the end: each reply is
            # there to read at once (the wait would report each one ready), and
            # nothing is left in flight to guard.
            self._command = command
            run_inline = self._run_inline or self._send_and_read
            busy = self._busy  # the reporter thread watches this run (report_hangs)
            busy.runs = (busy.runs + 1) & 255
            try:
                results, failures = run_inline(command, payloads)
            except KeyboardInterrupt as exc:
                # Inside an env's step, reset or task here: its group stopped half way (the
                # envs after it not run, the buffers half written), which cannot be
                # completed: the vector env closes. A call, get_attr, set_attr or render
                # writes no buffer: the vector env stays as the envs are.
                self._interrupted(exc, ())
                if command in RESTARTABLE:
                    self.close(timeout=0, terminate=True)
                raise
            finally:
                busy.runs = (busy.runs + 1) & 255
            if failures:
                done = Round()
                done.results, done.failures = results, failures
                return self.settle(done, timeout, step, command)
            return results
        return self.supervisor.guarded(self._round, command, payloads, timeout, step)

    def finish(
        self,
        command: Command,
        inline: Mapping[int, Any],
        timeout: float | None,
        step: int,
        late_after: float | None = None,
    ) -> dict[int, Any]:
        started = time.monotonic()
        # step_wait of a plain step: step_async sent every other worker its command and left
        # the driver's own block: the C round runs it and waits for the replies.
        ring = self._c_round(command, inline)
        if ring is not None:
            results = self._fast_round(timeout, step, ring)
            if results is None:
                results = {}
        else:
            results = super().finish(command, inline, timeout, step)
        elapsed = time.monotonic() - started
        if late_after is not None and elapsed > late_after:
            self.supervisor.ran_late_here(inline, late_after, elapsed)
        if command is _STEP and self._recycler is not None:
            self._recycle_due(step)
        return results

    def collect_ready(self, timeout: float | None, step: int) -> dict[int, Any]:
        """First-ready pool: wait until at least one pending worker has replied; return the
        replies of every worker done by then (worker index -> result).

        Raises:
            EnvError: an env raised; the other replies read with it, and any other env error,
                are kept for the next calls (one error per call).
            EnvCrashedError: a pending worker died; the backend is shut down.
            StepTimeoutError: a worker ran past ``timeout`` seconds from its own send.

        Ctrl-C: a first-ready pool's wait is *undone* (every pending worker stays pending,
        what was found meanwhile is kept for the next call), and the interrupt raised; with
        ``batch_size == num_envs`` (a synchronous round) the round is *completed* and its
        results kept for the next call. Either way the next call goes on as if the
        interrupted one had not been made (a pool) or had returned (kept results).
        """
        try:
            results = self._collect_ready(timeout, step)
        except BaseException as error:
            if not getattr(error, "_envfleet_kept", False):
                self.supervisor.abandon(error)
            self._raise_ended(error)
        if self._interrupt is not None:
            self.supervisor.keep(results)
            self._deliver()
        return results

    def step_times(self) -> tuple[StepTimeStats, ...]:
        return self.transport.step_times()

    def disown(self) -> None:
        self.transport.disown()

    def close(self, timeout: float | None, terminate: bool) -> None:
        pending, self._pending = self._pending, []
        self.transport.close(timeout, terminate, pending)

    # -- the round ----------------------------------------------------------------------------

    @runs_envs_here
    def _submit(self, command: Command, payloads: Mapping[int, Any], step: int) -> None:
        self._command = command
        transport = self.transport
        inline = transport.inline(command)
        if self._pool and command is not _RESTART:
            self.supervisor.sent(payloads, command)  # a pool's deadlines and restarts
        # A pool adds to the workers still running; a synchronous call has none pending.
        if self._pending:
            workers = sorted(payloads)
            self._pending = sorted({*self._pending, *workers})
        else:
            workers = self._pending = sorted(payloads)
        for w in workers:
            # A worker found dead since its last reply: under a restart policy the wait
            # finds it dead and replaces it.
            if (
                w not in inline
                and not transport.send(w, command, payloads[w])
                and not self.ledger.restarts_on(command)
            ):
                self._pending = []
                self.supervisor.crashed(w, step)
        flush = self._flush
        if flush is not None:
            flush()
        if not inline:
            return
        busy = self._busy  # the reporter thread watches this run (report_hangs)
        busy.runs = (busy.runs + 1) & 255
        try:
            for w in workers:  # the groups run here, while the others run theirs
                if w in inline:
                    transport.send(w, command, payloads[w])
        except KeyboardInterrupt as exc:
            self._interrupted(exc, [w for w in workers if w not in inline])
            raise
        finally:
            busy.runs = (busy.runs + 1) & 255

    def _round(
        self, command: Command, payloads: Mapping[int, Any], timeout: float | None, step: int
    ) -> dict[int, Any]:
        self._submit(command, payloads, step)
        return self._collect(timeout, step)

    def _send_and_read(
        self, command: Command, payloads: Mapping[int, Any]
    ) -> tuple[dict[int, Any], dict[int, Any]]:
        """Send each group run here its command and read its reply at once (what a
        transport's ``run_inline`` does in one call): the round's results and failures."""
        transport = self.transport
        done = Round()
        for w, payload in payloads.items():
            transport.send(w, command, payload)
            transport.read(w, done)
        return done.results, done.failures

    def _collect(
        self,
        timeout: float | None,
        step: int,
        done: Round | None = None,
        spun_s: float | None = None,
        waited_s: float = 0.0,
    ) -> dict[int, Any]:
        pending, self._pending = self._pending, []
        deadline = None if timeout is None else time.monotonic() + timeout - waited_s
        fail_fast = not self.ledger.restarts_on(self._command)
        done = self.wait_replies(pending, deadline, timeout, step, fail_fast, done, spun_s=spun_s)
        return self.settle(done, timeout, step, self._command)

    @runs_envs_here
    def _fast_round(self, timeout: float | None, step: int, ring: bool) -> dict[int, Any] | None:
        """The synchronous step round through :attr:`Transport.full_round` (``ring``: send
        every worker its command; false: step_async did): ``None`` when it took every reply,
        each "OK, no payload", and the driver's own block had no event (the rows are the whole
        answer); else the round's results, finished the Python way. Guarded by the
        supervisor's rule (:meth:`Supervisor.abandon`) itself: the plain step's one frame here.

        Ctrl-C: raised when the C call returns, its outcome lost. On the round bell (the
        transport's ``regathers``: no token taken) every remote worker is waited for again,
        which completes the round; elsewhere (step_wait's semaphores, an env of the driver's
        own block interrupted in its step) the backend closes."""
        self._command = _STEP
        started = 0.0 if ring else time.monotonic()  # step_wait's timeout counts from here
        busy = self._driver_block_busy  # the driver's own block runs in this thread: its mark
        hang = self._hang_delay  # the wait ends at the first of the timeout and the report
        if timeout is None:
            wait_s = -1.0 if hang is None else hang
        else:
            wait_s = timeout if hang is None or timeout < hang else hang
        try:
            if busy is not None:
                busy.runs = (busy.runs + 1) & 255
            try:
                outcome = self._full_round(ring, wait_s)  # type: ignore[misc]
            except KeyboardInterrupt as exc:
                self._interrupted(exc, self._remote)
                if not (ring and self._regathers(exc)):
                    raise
                outcome = RoundOutcome(None, None, 0, [], 0.0)  # wait for every worker
            finally:
                if busy is not None:
                    busy.runs = (busy.runs + 1) & 255
            if outcome is None:  # complete: the rows are the whole answer
                if self._pending:  # step_async's, all replied
                    self._pending = []
                return None
            results = self._finish_full_round(outcome, timeout, step, ring, started)
        except BaseException as exc:
            self.supervisor.abandon(exc)
            self._raise_ended(exc)
        if self._interrupt is not None:
            self._deliver()
        return results

    def _regathers(self, exc: KeyboardInterrupt) -> bool:
        """Whether the C step round interrupted by ``exc`` (its outcome lost) can be completed
        by waiting for every remote worker again (see :meth:`_fast_round`); if so, defer
        ``exc`` until it is."""
        if not getattr(self.transport, "regathers", False):
            return False
        group, _ = env_in_frames(traceback_frames(exc.__traceback__))
        return group is None and self._defer(exc)

    def _finish_full_round(
        self,
        outcome: RoundOutcome,
        timeout: float | None,
        step: int,
        ring: bool,
        started: float,
    ) -> dict[int, Any]:
        """The results of a full round's ``outcome`` that left something to do: read the
        replies it left unread and wait for the workers it did not take, within what is left
        of ``timeout`` (from ``started`` where step_async rang)."""
        remote = self._remote
        transport = self.transport
        done = Round()
        if outcome.driver_block_failure is not None:
            done.failures[0] = outcome.driver_block_failure
        elif outcome.driver_block_result is not None:
            done.results[0] = outcome.driver_block_result
        taken, unread = outcome.taken, outcome.unread
        for i in range(taken):
            if i in unread:
                transport.read(remote[i], done)
            else:
                done.results[remote[i]] = None
        if taken == len(remote) and not done.failed:
            self._pending = []
            return done.results  # every reply read: nothing to wait for or settle
        self._check_crashed(done, step, not self.ledger.restarts_on(_STEP))
        self._pending = remote[taken:]
        # What the round waited counts against the timeout (from step_async's send where it
        # rang), and the wait on the first worker not taken counts what it spun on it.
        waited = (outcome.spun_s or 0.0) if ring else time.monotonic() - started
        spun_s = outcome.spun_s if self._pending else None
        return self._collect(timeout, step, done, spun_s, waited)

    def wait_replies(
        self,
        workers: list[int],
        deadline: float | None,
        timeout: float | None,
        step: int,
        fail_fast: bool,
        done: Round | None = None,
        starting: bool = False,
        spun_s: float | None = None,
        pool: bool = False,
    ) -> Round:
        """The one wait of every round: wait for the replies of ``workers`` and read them into
        a round (``done``: the round so far), until every one replied or, ``pool``, until any
        did (a first-ready pool's round: ``workers`` is the pending list, each worker's
        deadline ``timeout`` seconds from its own send, and the workers that replied, died or
        ran late leave it).

        ``fail_fast``: a dead worker or the deadline raises at once (and shuts down);
        otherwise they are noted in the round for the supervisor. ``spun_s``: seconds a full
        round already spun on the first of ``workers`` (its wait counts them).

        Ctrl-C (not ``starting``, not ``pool``) completes the round: the wait goes on, until
        ``deadline`` or, without one, :data:`INTERRUPT_GRACE_S` seconds (past it the backend
        closes and the interrupt is raised); the interrupt is kept for the front's call to
        raise once the round is settled (:meth:`_deliver`). A second one, or one while a reply
        is read, is raised at once (the caller's guard closes the backend). A pool's wait is
        undone instead: every worker that had not replied stays pending, the replies the wait
        had taken are kept for the next call (:meth:`Supervisor.keep_round`).
        """
        transport, supervisor = self.transport, self.supervisor
        done = Round() if done is None else done
        waiting = workers if pool else list(workers)
        reports = _HangReports(self._hang_delay, spun_s or 0.0)
        graced = False  # the deadline is the grace of a Ctrl-C's completion
        if self._interrupt is not None and deadline is None and not pool:
            deadline, graced = time.monotonic() + INTERRUPT_GRACE_S, True
        while waiting:
            in_wait = True  # a pool's Ctrl-C here undoes the call: nothing was taken
            reading = False
            try:
                if pool:
                    deadline = supervisor.deadline(waiting, timeout)
                limit, capped = reports.cap(deadline)
                seen = transport.wait(waiting, limit, pool, spun_s)
                in_wait, spun_s = False, None
                late: list[int] = []
                if pool and deadline is not None and time.monotonic() >= deadline:
                    # A worker past its own deadline is late whatever the others replied.
                    rest = [w for w in waiting if w not in seen.ready and w not in seen.dead]
                    late = supervisor.late(rest, timeout)
                if not seen.ready and not seen.dead and not late:
                    if capped and (not pool or reports.due()):  # report, wait on
                        self._report_hang(waiting, *reports.advance(), starting)
                    elif graced:
                        break  # the grace ran out: give up (out of this try)
                    elif not pool:
                        done.late.append(waiting.pop(0))  # the deadline passed
                    continue  # (a pool: a wake-up with nothing new)
                reading = True
                for w in seen.ready:
                    waiting.remove(w)
                    transport.read(w, done)
                reading = False
                for w, reason in seen.dead.items():
                    waiting.remove(w)
                    done.crashed[w] = reason
                for w in late:
                    waiting.remove(w)
                done.late += late
                self._check_crashed(done, step, fail_fast, starting)
                if pool:
                    break
            except KeyboardInterrupt as exc:
                self._interrupted(exc, waiting, "start" if starting else None)
                if pool:
                    if in_wait and self._interrupt is None:
                        self._undo_wait(exc, waiting)
                    raise
                if starting or reading or not self._defer(exc):
                    self._pending = waiting  # still running: close() treats them as busy
                    raise
                self._recover(waiting, done)
                if deadline is None:
                    deadline, graced = time.monotonic() + INTERRUPT_GRACE_S, True
        if waiting and not pool:  # left by the grace's end
            self._give_up(waiting)
        wait_bound = self.ledger.wait_bound and not pool
        if done.late and (fail_fast or not transport.replaceable or wait_bound):
            self._pending = sorted({*waiting, *done.late})  # close() treats them as busy
            supervisor.timed_out(done.late, timeout)
        return done

    def _undo_wait(self, exc: KeyboardInterrupt, waiting: list[int]) -> None:
        """Undo a first-ready pool's wait that ``exc`` interrupted: give back the shared token
        it may have taken (``rewake``), keep for the next call the replies it had taken."""
        rewake = getattr(self.transport, "rewake", None)
        if rewake is not None:
            rewake()
        kept = Round()
        self._recover(waiting, kept)
        if kept.results or kept.failures:  # for the next call (else lost for good)
            self.supervisor.keep_round(kept)
        exc._envfleet_kept = True  # type: ignore[attr-defined]  # undone, not closed
        add_note(exc, "envfleet: the wait was undone; the vector env is usable")

    def _recover(self, waiting: list[int], done: Round) -> None:
        """After a Ctrl-C in a wait on ``waiting``, which may have come just after the wait
        took a reply's token: read into ``done`` the replies the transport's account of who
        replied (processes: ``recover``, from REQ/ACK) names; they leave ``waiting``."""
        recover = getattr(self.transport, "recover", None)
        if recover is not None:
            for w in recover(waiting):
                waiting.remove(w)
                self.transport.read(w, done)

    def _check_crashed(
        self, done: Round, step: int, fail_fast: bool, starting: bool = False
    ) -> None:
        if done.crashed and fail_fast:
            w = self.first_crashed(done.crashed)
            self._pending = []
            self.supervisor.crashed(w, step, reason=done.crashed[w], starting=starting)

    def _collect_ready(self, timeout: float | None, step: int) -> dict[int, Any]:
        supervisor = self.supervisor
        if supervisor.has_kept():
            unsettled = supervisor.take_unsettled()
            if unsettled is not None:
                return self._ready(unsettled, timeout, step)
            return supervisor.take_kept()
        if not self._pool:  # synchronous send/recv: every env is pending, wait for them all
            return self._collect(timeout, step)
        # Without a restart policy a dead or late worker raises at once; with one, it is
        # noted in the round and the supervisor rebuilds it.
        fail_fast = self.ledger.policy is None
        done = self.wait_replies(self._pending, None, timeout, step, fail_fast, pool=True)
        return self._ready(done, timeout, step)

    # -- a Ctrl-C's round: kept, completed, then raised -----------------------------------------

    def _defer(self, exc: KeyboardInterrupt) -> bool:
        """Keep ``exc`` to raise once the interrupted round is complete; ``False`` (and a
        note) when one is kept already: ``exc`` is a second Ctrl-C, which ends the
        completion wait (the caller's guard closes the backend)."""
        first = self._interrupt
        if first is None:
            self._interrupt = exc
            return True
        self._interrupt = None
        if exc is not first:
            add_note(
                exc,
                f"envfleet: a second Ctrl-C ended the wait for the interrupted "
                f"{self._command.name.lower()} to complete; the vector env closed",
            )
        return False

    def _give_up(self, waiting: list[int]) -> NoReturn:
        """The round a Ctrl-C interrupted did not complete within :data:`INTERRUPT_GRACE_S`
        (``waiting``: the workers still busy): close the backend and raise the interrupt."""
        exc = cast(KeyboardInterrupt, self._interrupt)
        self._interrupt = None
        add_note(
            exc,
            f"envfleet: the interrupted {self._command.name.lower()} did not complete within "
            f"{INTERRUPT_GRACE_S:g} s (INTERRUPT_GRACE_S; step_timeout is None); the vector "
            "env closed",
        )
        self._pending = waiting  # still running: close() treats them as busy
        self.close(timeout=0, terminate=True)
        raise exc

    def _deliver(self) -> NoReturn:
        """Raise the Ctrl-C kept while its round completed: the round is settled, the
        backend as if the call had returned (``_envfleet_completed``: the front counts it)."""
        exc = cast(KeyboardInterrupt, self._interrupt)
        self._interrupt = None
        exc._envfleet_completed = True  # type: ignore[attr-defined]
        add_note(
            exc,
            f"envfleet: the interrupted {self._command.name.lower()} completed (its results "
            "dropped); the vector env is usable",
        )
        raise exc

    def _raise_ended(self, error: BaseException) -> NoReturn:
        """Raise what a front call ending with ``error`` raises (:meth:`_ended`): ``error``
        itself, or the kept Ctrl-C with ``error`` as its cause."""
        raised = self._ended(error)
        if raised is error:
            raise error
        raise raised from error

    def _ended(self, error: BaseException) -> BaseException:
        """What a front call ending with ``error`` raises, a Ctrl-C kept or not (the kept one
        is forgotten). The completed round's envfleet error: a crash or a timeout (the vector
        env closed) raises the Ctrl-C, the error as its cause, so the learner's ``except
        KeyboardInterrupt`` still runs; an env error (the vector env usable, the front's
        bookkeeping needs it) is raised as without the interrupt, noting it."""
        kept, self._interrupt = self._interrupt, None
        if kept is None or kept is error or not isinstance(error, EnvfleetError):
            return error
        if not self.closed:
            add_note(error, "envfleet: a Ctrl-C came while this call waited; it ended so")
            return error
        add_note(
            kept,
            f"envfleet: the interrupted {self._command.name.lower()} did not complete "
            f"({type(error).__name__}: {error}); the vector env closed",
        )
        return kept

    # -- the mechanics the supervisor uses (Supervised) ---------------------------------------

    def env_error(self, w: int, failure: Any, note: str) -> EnvError:
        error = self.transport.env_error(w, failure, note)
        recording = recording_of(failure, error.env_index)
        if recording is not None:
            error.replay = replays_of("error", str(error), [recording], self.factories)
        return error

    def crash_error(
        self, w: int, step: int, note: str, reason: str, starting: bool, fate: str = CLOSED
    ) -> EnvCrashedError:
        error = self.transport.crash_error(w, step, note, reason, starting, fate)
        error.replay = replays_of("crash", str(error), self.recordings(w), self.factories)
        return error


class _HangReports:
    """The hang reports' schedule over one call's waits (:meth:`RoundDriver.report_hangs`):
    the first after ``delay`` seconds from the first wait, then after twice that, four
    times, ...; ``delay`` ``None``: none. One clock read for the first wait, none after."""

    __slots__ = ("at", "delay", "gap", "started", "waited_s")

    def __init__(self, delay: float | None, waited_s: float = 0.0):
        self.delay = delay
        self.waited_s = waited_s  # what a wait before the first one (the C round's) waited
        self.started = self.at = self.gap = 0.0

    def cap(self, deadline: float | None) -> tuple[float | None, bool]:
        """The end of the next wait: ``deadline``, or the next report's time where that
        comes first (then ``True``)."""
        if self.delay is None:
            return deadline, False
        if not self.gap:  # the first wait: its one clock read
            self.gap, self.started = self.delay, time.monotonic() - self.waited_s
            self.at = self.started + self.delay
        if deadline is None or self.at < deadline:
            return self.at, True
        return deadline, False

    def due(self) -> bool:
        """The next report's time has passed (a wait that may return early asks)."""
        return time.monotonic() >= self.at

    def advance(self) -> tuple[float, float]:
        """The report due now: (seconds waited, seconds to the next one); the schedule
        moves on to the next."""
        self.gap *= 2
        waited = self.at - self.started
        self.at += self.gap
        return waited, self.gap
