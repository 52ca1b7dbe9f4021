"""Starting, recycling and replacing workers: the round driver's side of a worker's life.

:class:`WorkerReplacement` is a mixin of the round driver
(:class:`~envfleet._backends.rounds.RoundDriver`), over the transport's primitives and the
driver's rounds:

- **starting**: :meth:`WorkerReplacement._start` waits for just spawned workers' ``READY``
  replies (within ``start_timeout``), has the transport lay them out
  (:meth:`~envfleet._backends.transport.Transport.lay_out`) and checks their envs; at the start and
  whenever a worker is replaced;
- **recycling** (``envfleet.Recycle``): after step rounds, the idle workers past a limit are
  replaced by new ones whose envs continue their episodes
  (:func:`~envfleet._core.action_log.restore_envs`);
- **settling** a round (:meth:`WorkerReplacement.settle`): the
  :class:`~envfleet._backends.supervisor.Supervisor` decides (it raises, or answers a
  :class:`~envfleet._backends.supervisor.Rebuild`; it calls no rebuilding), and
  :meth:`WorkerReplacement._rebuild` carries it out: the groups that go down with a host
  process without being at fault spared (``_spare``), the dead and hung workers replaced
  (``_replace_workers``: the transport's
  :meth:`~envfleet._backends.transport.Transport.respawn`, then the start), the envs that
  did not lose their episode brought back (``_lost_envs``, ``_bring_up``), and a round of
  ``Command.RESTART`` on those workers only (``_side_round``);
- the **read-outs** these and the supervisor take of the transport: a worker's recordings,
  stacks, action-log counters and memory.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

from envfleet._backends.recycle import Recycle, Recycler
from envfleet._backends.supervisor import (
    RESTARTED,
    Ledger,
    Rebuild,
    Round,
    Supervisor,
    events_of,
    failed_envs,
    log_env_restart,
    merge_events,
    timeout_error,
    warn_restarted,
)
from envfleet._backends.transport import Transport
from envfleet._core.action_log import catch_up_envs, restore_envs
from envfleet._core.buffers import Batch
from envfleet._core.errors import (
    EnvCrashedError,
    EnvError,
    EnvfleetError,
    StartTimeoutError,
    StepTimeoutError,
)
from envfleet._core.failures import CLOSED, mismatch_error, start_error
from envfleet._core.protocol import Command, TaskRequest
from envfleet._core.replay import EnvRecording
from envfleet._core.stacks import at, first_at
from envfleet._core.stats import WorkerMemory

__all__ = ["WorkerReplacement"]

logger = logging.getLogger("envfleet")

_STEP, _RESTART, _TASK = Command.STEP, Command.RESTART, Command.TASK


class WorkerReplacement:
    """The round driver's starting, recycling and replacing of workers (a mixin: the state
    and the rounds it uses are the driver's, declared here)."""

    transport: Transport
    ranges: Sequence[tuple[int, int]]
    ledger: Ledger
    batch: Batch
    late_what: str
    late_fate: str
    factories: Any
    supervisor: Supervisor
    _pending: list[int]  # the workers with a command still running
    _command: Command  # the command the round runs
    _start_timeout: float | None
    _late_stacks: dict[int, str] | None  # spare()'s, for replace_workers
    _recycler: Recycler | None
    wait_replies: Callable[..., Round]  # wait for workers' replies, read into a round

    if TYPE_CHECKING:

        def close(self, timeout: float | None, terminate: bool) -> None: ...  # Supervised's

        def _submit(self, command: Command, payloads: Mapping[int, Any], step: int) -> None: ...

        def env_error(self, w: int, failure: Any, note: str) -> EnvError: ...

        def crash_error(
            self, w: int, step: int, note: str, reason: str, starting: bool, fate: str = CLOSED
        ) -> EnvCrashedError: ...

    # -- starting workers ----------------------------------------------------------------------

    def _start(self, workers: list[int], timeout: float | None, step: int, at_start: bool) -> None:
        """Wait for ``workers``, just spawned, to build their envs (within ``timeout``
        seconds in all: ``start_timeout``, also for a replacement), lay them out
        (:meth:`Transport.lay_out`: at the start with env 0's probe) and check them; raise for
        the first that could not.

        Raises:
            StartTimeoutError: past ``timeout`` (a replacement's: the vector env closed).
            EnvError, ConfigError, SpaceMismatchError, EnvCrashedError: as :class:`RoundDriver`.
        """
        transport = self.transport
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            done = self.wait_replies(workers, deadline, timeout, step, True, starting=True)
            _check_built(done)
            probe = done.results.get(0) if at_start else None
            if transport.lay_out(workers, probe):
                done = self.wait_replies(workers, deadline, timeout, step, True, starting=True)
        except StepTimeoutError as exc:
            raise self._late_start(exc, timeout, "built" if at_start else "rebuilt") from None
        _check_built(done)
        for w in sorted(done.results):
            if done.results[w] is not None:
                raise mismatch_error(done.results[w])

    def _start_respawned(self, workers: list[int], step: int) -> None:
        """:meth:`_start` of respawned ``workers``; one that cannot start is the broken path."""
        try:
            self._start(workers, self._start_timeout, step, at_start=False)
        except EnvfleetError as error:
            self.supervisor.broken(error)

    def _late_start(
        self, exc: StepTimeoutError, timeout: float | None, what: str
    ) -> StartTimeoutError:
        """``exc``, a wait past ``start_timeout`` while workers were ``what`` ("built" at the
        start; later the vector env closed), as the :class:`StartTimeoutError` it is."""
        envs = set(exc.env_indices)
        late = [w for w, (a, b) in enumerate(self.ranges) if envs.intersection(range(a, b))]
        fate = "" if what == "built" else " and the vector env closed"
        return StartTimeoutError(
            f"sub-environments {exc.env_indices} were not {what} within {timeout} s "
            f"(start_timeout){first_at(exc.stacks, late)}; their {self.late_what} {late} "
            f"were killed{fate}",
            exc.env_indices,
            float(timeout if timeout is not None else 0.0),
            exc.stacks,
        )

    # -- what the transport tells of a worker --------------------------------------------------

    def recordings(self, w: int) -> list[EnvRecording]:
        """Worker ``w``'s envs' episodes so far (for a replay), where the transport's
        ``recordings`` outlive it (in-process, processes, Ray); else none."""
        read = getattr(self.transport, "recordings", None)
        return read(w) if read is not None else []

    def stacks(self, workers: list[int]) -> dict[int, str]:
        """Each of ``workers``' stacks, taken now (the transport's ``stacks``, where it has
        one: processes, threads and Ray), worker -> text."""
        take = getattr(self.transport, "stacks", None)
        return take(workers) if take is not None else {}

    # -- recycling (envfleet.Recycle) ----------------------------------------------------------

    def recycle_with(self, policy: Recycle) -> None:
        """Recycle the workers past ``policy``'s limits from now on (the transport gives
        ``log_head`` and ``rss``, and may give ``counters``: processes, Ray)."""
        # A proxy, as the supervisor's: no reference cycle keeps the workers past close.
        self._recycler = Recycler(policy, cast(Any, weakref.proxy(self)))

    def log_head(self, w: int) -> tuple[int, int, Any] | None:
        """Worker ``w``'s action-log counters (:func:`envfleet._core.action_log.read_head`)."""
        return cast(Any, self.transport).log_head(w)

    def counters(self) -> list[tuple[tuple[int, int, Any] | None, int | None]]:
        """Per worker: its action-log counters and its resident memory (the recycler's look):
        the transport's ``counters`` where it has one (Ray: one question to each node's
        helper), else the transport's ``log_head`` and ``rss`` of each worker."""
        transport = cast(Any, self.transport)
        read = getattr(transport, "counters", None)
        if read is not None:
            return cast(list[tuple[tuple[int, int, Any] | None, int | None]], read())
        return [(transport.log_head(w), transport.rss(w)) for w in range(len(self.ranges))]

    def memory(self) -> list[int | None] | None:
        """Per worker its resident memory as last sampled (the transport's ``rss``: processes),
        for the recycler's look without the logs; ``None`` where the transport has none
        (Ray: its nodes' helpers answer :meth:`counters`)."""
        rss = getattr(self.transport, "rss", None)
        if rss is None or getattr(self.transport, "counters", None) is not None:
            return None
        return [rss(w) for w in range(len(self.ranges))]

    def worker_memory(self) -> tuple[WorkerMemory, ...]:
        read = getattr(self.transport, "worker_memory", None)
        return read() if read is not None else ()

    def _recycle_due(self, step: int) -> None:
        for w in cast(Recycler, self._recycler).due():
            self._recycle(w, step)

    def _recycle(self, w: int, step: int) -> None:
        """Replace idle worker ``w`` with a new one whose envs continue its envs' episodes:
        building them and bringing them up to date, each within ``start_timeout``."""
        recycler = cast(Recycler, self._recycler)
        recordings = self.recordings(w)
        if not recycler.replayable(w, recordings):
            return
        self.transport.respawn(w, "recycle")
        self._start_respawned([w], step)
        request = TaskRequest(restore_envs, (recordings, self._ended_episodes(w)))
        self._bring_up(w, request, step, "recycling its worker")
        self.ledger.recycled += 1
        recycler.recycled(w, self.log_head(w))

    # -- settling a round: the supervisor decides, the driver rebuilds --------------------------

    def settle(
        self,
        done: Round,
        timeout: float | None,
        step: int,
        command: Command | None,
        pool: bool = False,
    ) -> dict[int, Any]:
        """Every worker's result of ``done``, after what failed in it is rebuilt as the
        supervisor decides (:meth:`Supervisor.decide`: it raises where the restart policy
        does not cover the failure); the rebuilt envs' infos carry ``env_restarted`` (see
        :class:`~envfleet.RestartPolicy`). ``command`` and ``pool``: as there.

        Raises:
            EnvError: an env raised and is not restarted (the backend stays usable), or a
                rebuilt env failed again (the backend is shut down).
            EnvCrashedError, StepTimeoutError: a worker died or ran late and is not
                restarted; the backend is shut down.
        """
        plan = self.supervisor.decide(done, timeout, step, command, pool)
        if plan is None:
            return done.results
        return self._rebuild(plan, done, timeout, step)

    def _ready(self, done: Round, timeout: float | None, step: int) -> dict[int, Any]:
        """A first-ready pool's round: settled with each worker's own command; then what is
        ready, this round's and what earlier calls kept (:meth:`Supervisor.take_kept`).
        Without a restart policy (or when it does not cover the failure) one env error is
        raised per call and the rest is kept for the next calls."""
        supervisor = self.supervisor
        supervisor.keep(self.settle(done, timeout, step, None, pool=True))
        return supervisor.take_kept()

    def _rebuild(
        self, plan: Rebuild, done: Round, timeout: float | None, step: int
    ) -> dict[int, Any]:
        """Carry out ``plan`` for ``done``: spare the groups hosted with a dead or hung one,
        replace the dead and hung workers (their envs that did not lose their episode caught
        up), restart the envs that raised; warn and count each restart."""
        ledger, failed, respawn, after = self.ledger, plan.failed, plan.respawn, plan.after
        # Groups hosted with a dead or hung one (their process goes too): those not at fault
        # are brought back as they were; the others join the dead.
        spared, dropped = self._spare(done, after) if respawn else ({}, [])
        if respawn:
            respawn = sorted([*done.crashed, *done.late])
            failed = {w: envs for w, envs in failed.items() if w in done.failures}
        ledger.crashes += len(done.crashed)
        for w, f in sorted(done.failures.items()):
            error = self.env_error(w, f, "")
            log_env_restart(failed_envs(f))
            ledger.failures.append(error)
            warn_restarted(error, failed[w], list(range(*self.ranges[w])))
        crashes = {  # before they are replaced
            w: self.crash_error(w, step, "", reason, False, RESTARTED)
            for w, reason in sorted(done.crashed.items())
        }
        caught: dict[int, list[Any] | None] = {}
        if respawn:
            lost = {w: self._lost_envs(w, after[w]) for w in respawn}  # before they go
            hung = self._replace_workers(sorted({*respawn, *spared}), done, timeout, step)
            for w, (request, sent) in sorted(spared.items()):
                events = self._bring_up(w, request, step, "bringing its envs back")
                if sent:  # its command taken again: its result
                    done.results[w] = events
            for w in respawn:
                envs, catch_up = lost[w]
                died: EnvfleetError = crashes[w] if w in crashes else hung[w]
                ledger.failures.append(died)
                if catch_up is not None:
                    caught[w] = self._bring_up(w, catch_up, step, "bringing its envs back")
                failed[w] = envs
                warn_restarted(died, envs, list(range(*self.ranges[w])))
        requests = {
            w: ledger.restart_request(self.ranges[w][0], envs, after[w], w not in respawn)
            for w, envs in failed.items()
        }
        restarted = self._side_round(_RESTART, requests, timeout, step)
        if restarted.failures:
            w = min(restarted.failures)
            self.supervisor.broken(self.env_error(w, restarted.failures[w], ""))
        results = done.results
        for w, envs in failed.items():
            if w in respawn:
                ledger.restarted(envs)
            else:
                for e in envs:
                    ledger.restarted([e])
            results[w] = merge_events(
                events_of(done.failures.get(w)), caught.get(w), restarted.results.get(w)
            )
        for w in dropped:  # rebuilt while idle: the front sent it nothing to answer
            results.pop(w, None)
        return dict(sorted(results.items()))

    def _replace_workers(
        self, workers: list[int], done: Round, timeout: float | None, step: int
    ) -> dict[int, StepTimeoutError]:
        """Kill ``workers`` (dead or hung) and start new ones with their envs, ready to serve;
        leave every other worker's pending command as it is. Shut down and raise when one
        cannot start. Returns the error each hung one would have raised (with its stacks,
        taken before it was killed)."""
        others = [w for w in self._pending if w not in workers]  # a pool's, still running
        late = [w for w in workers if w in done.late]
        # Taken by spare() before a host was killed, else now.
        stacks, self._late_stacks = self._late_stacks or self.stacks(late), None
        message = "worker %d did not answer in time%s; its stacks before it was killed:\n%s"
        for w, text in stacks.items():
            logger.warning(message, w, at(text), text)
        fate = "killed and restarted by the restart policy"
        hung = {  # what each would have raised
            w: timeout_error(self, [w], timeout, {w: stacks[w]} if w in stacks else {}, fate)
            for w in late
        }
        reasons = {w: done.crashed.get(w, "late" if w in done.late else "host") for w in workers}
        respawn_all = getattr(self.transport, "respawn_all", None)
        if respawn_all is not None:
            respawn_all(reasons)  # a host process once for all its groups
        else:
            for w in workers:
                self.transport.respawn(w, reasons[w])
        self._start_respawned(workers, step)
        self._pending = others
        return hung

    def _spare(
        self, done: Round, after: dict[int, Command]
    ) -> tuple[dict[int, tuple[TaskRequest, bool]], list[int]]:
        """Before the dead and hung workers of ``done`` are replaced: where one is a group
        hosted with others in one process (a first-ready pool's default), the groups that go
        down with its process without being at fault, and how each is brought back in the
        new one. Their process is killed here (the hung groups' stacks taken first).

        At fault: a hung group; of a process that died, the group whose env a fatal signal
        hit (its handler's note), or, where not known (SIGKILL, ``os._exit``), each group
        that was inside its env. Every other group of the process is *spared*: one that had
        replied has its reply read; one sent a plain step takes it again from its record
        (:func:`~envfleet._core.action_log.catch_up_envs`); one idle, or whose reply was read,
        is brought to where it was (:func:`~envfleet._core.action_log.restore_envs`). A group
        that cannot be (no complete record, a reset or call in flight) is at fault too: it is
        added to ``done.crashed`` (and ``after``, its command).

        Returns:
            spared: group -> (its bring-up task, whether it was sent a command: the task's
                result is then its result);
            dropped: idle groups whose envs are rebuilt (restarted after ``RESET``) whose
                restart result must not reach the front (it sent them nothing).
        """
        transport = cast(Any, self.transport)
        hosted = getattr(transport, "hosted", None)
        down = [*done.crashed, *done.late]
        if hosted is None or not any(hosted(w) for w in down):
            return {}, []
        self._late_stacks = self.stacks(list(done.late))  # before their process goes
        everyone = sorted({*down, *transport.host_mates(down)})
        transport.kill(everyone)
        culprits = set(done.late)
        for w in done.crashed:
            fault = transport.fault_group(w)
            if fault is not None:
                culprits.add(fault)
            elif transport.running_env(w) is not None:
                culprits.add(w)  # inside its env when its process died: it may be the one
        pending = {*self._pending, *done.crashed, *done.late}
        commands = self.supervisor.commands
        spared: dict[int, tuple[TaskRequest, bool]] = {}
        dropped: list[int] = []
        for w in everyone:
            if w in culprits:
                continue
            request = None
            if w in pending:
                command = after.get(w, commands.get(w, _STEP))
                if transport.replied(w):
                    done.crashed.pop(w, None)
                    transport.read(w, done)  # its reply, read as any other
                    if w in done.results:
                        request = self._restore_request(w)
                        pending.discard(w)  # answered: brought back, its result kept
                    else:  # it failed, or its reply was cut short: as at fault
                        done.failures.pop(w, None)
                elif command is _STEP:
                    caught = transport.pending_step(w)
                    if caught is not None and all(r.complete for r in caught[0]):
                        recordings, actions = caught
                        ended = self._ended_episodes(w)
                        request = TaskRequest(catch_up_envs, (recordings, actions, ended, []))
                if request is None:
                    done.crashed.setdefault(w, "")
                    after.setdefault(w, command)
                    continue
                done.crashed.pop(w, None)
                spared[w] = (request, w in pending)
                continue
            request = self._restore_request(w)
            if request is None:  # idle, no complete record: rebuilt, its result dropped
                done.crashed.setdefault(w, "")
                after[w] = Command.RESET
                dropped.append(w)
                continue
            spared[w] = (request, False)
        for w in culprits:  # at fault though it was not found dead yet
            if w in everyone and w not in done.crashed and w not in done.late:
                done.crashed[w] = ""
                if w not in pending:
                    after[w] = Command.RESET
                    dropped.append(w)
                else:
                    after.setdefault(w, commands.get(w, _STEP))
        self._pending = [w for w in self._pending if w not in spared]
        return spared, dropped

    def _restore_request(self, w: int) -> TaskRequest | None:
        """The task that brings worker ``w``'s envs in a new worker to where its record says
        they are (:func:`~envfleet._core.action_log.restore_envs`); ``None`` without a complete
        record."""
        recordings = self.recordings(w)
        start, stop = self.ranges[w]
        if len(recordings) != stop - start or not all(r.complete for r in recordings):
            return None
        return TaskRequest(restore_envs, (recordings, self._ended_episodes(w)))

    def first_crashed(self, crashed: Mapping[int, str]) -> int:
        """Of the dead workers ``crashed``, the one to name: the group whose env a fatal
        signal hit where a host process tells (its other groups died with it), else the
        first found."""
        fault_group = getattr(self.transport, "fault_group", None)
        if fault_group is not None:
            for w in crashed:
                fault = fault_group(w)
                if fault in crashed:
                    return cast(int, fault)
            running = getattr(self.transport, "running_env", None)
            for w in crashed:
                if running is not None and running(w) is not None:
                    return w
        return next(iter(crashed))

    def _lost_envs(self, w: int, command: Command) -> tuple[list[int], TaskRequest | None]:
        """Before worker ``w``, dead or hung in ``command``, is replaced: the envs (global
        indices) that lose their episode, and the catch-up that brings its other envs back
        (:func:`~envfleet._core.action_log.catch_up_envs`; ``None``: every env of ``w`` loses
        its episode).

        Only the env the worker was inside loses it, where the transport tells which
        (``running_env``: processes) and the others' records before the step are whole
        (``before_step``), in a step; everywhere else (a reset, a worker that ran no env code
        or several envs at once, a record past ``replay_steps``, Ray) every env of ``w``."""
        start, stop = self.ranges[w]
        everything = list(range(start, stop))
        transport = cast(Any, self.transport)
        running = getattr(transport, "running_env", None)
        if command is not _STEP or running is None:
            return everything, None
        env = running(w)
        if env is None or not start <= env < stop:  # no env, or several at once
            return everything, None
        recordings, actions = transport.before_step(w)
        if len(recordings) != stop - start or not all(
            r.complete for r in recordings if r.env_index != env
        ):
            return everything, None
        done = self._ended_episodes(w)
        return [env], TaskRequest(catch_up_envs, (recordings, actions, done, [env - start]))

    def _bring_up(self, w: int, request: TaskRequest, step: int, doing: str) -> Any:
        """Run ``request`` (a task that brings a new worker's envs up to date: a recycled
        worker's, a replacement's catch-up) on worker ``w`` within ``start_timeout``, part of
        building it; its result. ``doing``: what the error says was under way.

        Raises:
            StartTimeoutError: past ``start_timeout`` (the vector env closed).
            EnvError: an env raised in it (the vector env closed).
        """
        try:
            done = self._side_round(_TASK, {w: request}, self._start_timeout, step)
        except StepTimeoutError as exc:
            raise self._late_start(exc, self._start_timeout, "brought up to date") from None
        if done.failures:
            self.supervisor.broken(self.env_error(w, done.failures[w], doing))
        return done.results.get(w)

    def _ended_episodes(self, w: int) -> list[bool]:
        """Per env of worker ``w``, whether its last step ended its episode (its rows' flags:
        a step in which a worker died or hung wrote none of them)."""
        start, stop = self.ranges[w]
        batch = self.batch
        return (batch.terminations[start:stop] | batch.truncations[start:stop]).tolist()

    def _side_round(
        self, command: Command, payloads: dict[int, Any], timeout: float | None, step: int
    ) -> Round:
        """Run ``command`` on the workers of ``payloads`` only and wait for them (a restart,
        a recycled worker's restore), leaving the round in progress as it was: a pool's
        other workers still running, the command they run."""
        running = self._command
        others = [w for w in self._pending if w not in payloads]  # a pool's, still running
        self._pending = []
        self._submit(command, payloads, step)
        self._command = running
        pending, self._pending = self._pending, others
        deadline = None if timeout is None else time.monotonic() + timeout
        return self.wait_replies(pending, deadline, timeout, step, fail_fast=True)


def _check_built(done: Round) -> None:
    """Raise for the first worker that could not build its envs."""
    if done.failures:
        w = min(done.failures)
        raise start_error(done.failures[w].errors[0], w)
