"""``backend="ray"``: EnvGroups in Ray actors, on one machine or across a cluster.

Each worker is a Ray actor holding a contiguous block of envs in an :class:`EnvGroup` over
buffers of its own (the block's rows only: actors on other nodes share no memory with the
driver). A step sends the block's actions with the command; the actor steps its envs (the same
EnvGroup code as every backend) and returns its rows (observations, rewards, terminations,
truncations), the non-empty infos and the step's duration, through Ray's object store; the
driver writes the rows into its own batch. Actors are placed by Ray's scheduler: by default
``"SPREAD"`` across the cluster's nodes, each asking for one CPU (or an even share of the
cluster's CPUs when there are more workers than CPUs); ``ray_options`` changes that (custom
resources for nodes that have a simulator, GPUs, placement groups, node affinity).

Failures map to the same typed errors as the other backends: an env that raises is an
:class:`envfleet.EnvError` (its exception and the actor's traceback chained); an actor that
dies (segfault, ``os._exit``, ``ray.kill``, its node lost) is an :class:`envfleet.EnvCrashedError`
(Ray does not report a process exit code: ``exitcode`` is ``None`` and the message gives Ray's
reason); a wait past the timeout kills the late actors and raises
:class:`envfleet.StepTimeoutError`. A restart policy rebuilds envs inside their actor and
replaces dead or hung actors with new ones (placed by the same options).

This module holds the driver's side (:class:`RayTransport`: the primitives the round driver,
:class:`envfleet._backends.rounds.RoundDriver`, runs every round over) and the registration;
the actor is
:mod:`envfleet._backends.ray.actor`, the plan (connecting to Ray, the worker count, the
actors' options) :mod:`envfleet._backends.ray.plan`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any, cast

import numpy as np
import psutil
import ray
import ray.exceptions

from envfleet._backends.base import EnvProbe
from envfleet._backends.ray.actor import ActorLayout, ActorSpec, RemoteWorker, Reply
from envfleet._backends.ray.plan import RayPlan, plan_ray
from envfleet._backends.rounds import RoundDriver, Seen, StepAll
from envfleet._backends.supervisor import Round
from envfleet._backends.workers import ask_stacks, read_bytes, read_text
from envfleet._core.buffers import allocate_batch
from envfleet._core.errors import (
    ConfigError,
    EnvCrashedError,
    EnvError,
)
from envfleet._core.failures import CLOSED, remote_env_error
from envfleet._core.protocol import Command, Failure, RemoteError, Status
from envfleet._core.replay import ActionLog, EnvRecording, log_recordings, read_head
from envfleet._core.stacks import at
from envfleet._core.stats import STATS_WORDS, StepTimer, StepTimeStats, step_time_table
from envfleet._core.trees import tree_slice, tree_write

__all__ = ["DEFAULT_CLOSE_TIMEOUT", "RayPlan", "RayTransport", "plan_ray"]

logger = logging.getLogger("envfleet")

DEFAULT_CLOSE_TIMEOUT = 5.0  # seconds for the actors to close their envs before being killed
_KILL_GRACE = 2.0  # seconds close() waits for Ray to confirm that killed actors are gone
_START_WARN_S = 30.0  # seconds between warnings while actors wait to be placed


# -- the driver side ----------------------------------------------------------------------------


class RayTransport:
    """One Ray actor per block of envs; results come back through Ray's object store (a
    :class:`~envfleet._backends.rounds.Transport`: the rounds are the round driver's).

    Args:
        request: make()'s :class:`BuildRequest`: the factories (cloudpickled), the ledger
            (with a restart policy, envs that raise are rebuilt in their actor, and dead or
            hung actors are replaced), a first-ready pool (:meth:`wait` reports whichever
            actors finish first). No env is built in the driver: the actor that holds env 0
            sends env 0's spaces in its ``READY`` reply (:meth:`lay_out`), then every actor
            lays its envs over buffers of its rows (:meth:`EnvfleetWorker.attach`).
        actor_options: passed to each actor's ``.options(...)`` (see :func:`plan_ray`).

    Its actors are started here; the round driver waits for their ``READY`` replies.
    """

    late_what = "Ray actors of workers"
    late_fate = "they were killed"
    replaceable = True
    step_all: StepAll | None = None
    spun_s: float | None = None

    def __init__(self, request: BuildRequest, actor_options: Mapping[str, Any] | None = None):
        self.ranges = list(request.plan.ranges)
        self.ledger = request.ledger
        self.pool = request.pool
        self._request = request
        self._blobs, self._accepts = request.blobs, request.accepts_index
        self._options = dict(actor_options or {})
        self._layout: ActorLayout | None = None  # once env 0's spaces are known
        self.batch: Any = None
        workers = len(self.ranges)
        self.remote = list(range(workers))
        self._stats = np.zeros((workers, STATS_WORDS))
        self._timers = [StepTimer(row) for row in self._stats]
        self._actors: list[Any] = [None] * workers
        self._refs: dict[int, Any] = {}  # worker -> ObjectRef of its running command
        self._commands: dict[int, Command | None] = {}  # its command; None: starting
        self._got: dict[int, Reply] = {}  # replies read in one call, until read
        # Per worker on this node: its actor's pid and the driver's descriptor of its stack
        # file, and of its action log (opened at lay_out; an actor on another node has none).
        self._stack_files: dict[int, tuple[int, int]] = {}
        self._log_files: dict[int, int] = {}
        self._closed = False
        first_env = request.first_env
        try:
            for w in range(workers):
                self._start_actor(w)
            if first_env is not None:
                first_env.close()
                first_env = None
        except BaseException:
            if first_env is not None:
                first_env.close()
            self.close(0, True, ())
            raise

    @property
    def num_workers(self) -> int:
        return len(self.ranges)

    @property
    def closed(self) -> bool:
        return self._closed

    def step_times(self) -> tuple[StepTimeStats, ...]:
        return step_time_table(self._stats)

    def disown(self) -> None:
        pass

    def placement(self) -> list[tuple[str, int]]:
        """Per worker, the (Ray node id, process id) of its actor (a round trip to each)."""
        return list(ray.get([actor.where.remote() for actor in self._actors]))

    # -- starting actors ----------------------------------------------------------------------

    def _start_actor(self, w: int) -> None:
        """Start worker ``w``'s actor; its ``READY`` reply comes through :meth:`wait`."""
        start, stop = self.ranges[w]
        spec = ActorSpec(
            worker_index=w,
            start=start,
            stop=stop,
            env_fns=self._blobs[start:stop],
            accepts_index=list(self._accepts[start:stop]),
        )
        self._actors[w] = actor = RemoteWorker.options(**self._options).remote(spec)
        self._refs[w], self._commands[w] = actor.ready.remote(), None

    def respawn(self, w: int, reason: str) -> None:
        self._drop_stack_file(w)
        if reason == "recycle":
            start, stop = self.ranges[w]
            logger.info("recycling worker %d (sub-environments %d..%d)", w, start, stop - 1)
        else:
            why = "did not answer in time" if reason == "late" else f"died ({reason})"
            logger.warning("Ray actor of worker %d %s; replacing it and its envs", w, why)
        with contextlib.suppress(Exception):
            ray.kill(self._actors[w], no_restart=True)
        self._start_actor(w)

    def lay_out(self, workers: list[int], probe: Any) -> bool:
        """Every actor lays its envs over buffers of its rows once env 0's spaces are known:
        at the start from env 0's ``READY`` (``probe``), when the driver's batch is made."""
        if self._layout is None:
            request = self._request
            if request.probe is None:
                request.learn(cast(EnvProbe, probe))
            layout = request.layout
            self.batch = allocate_batch(
                layout.single_observation_space,
                layout.single_action_space,
                layout.num_envs,
                request.block(shared=False),
            )
            self._layout = ActorLayout(
                layout.single_observation_space,
                layout.single_action_space,
                layout.autoreset_mode,
                layout.same_observation_space,
                layout.replay_steps,
            )
        self._open_stack_files(workers)
        for w in workers:
            self._refs[w], self._commands[w] = self._actors[w].attach.remote(self._layout), None
        return True

    def _open_stack_files(self, workers: list[int]) -> None:
        """Open the stack file and the action log of each of ``workers``' actors that runs
        on this node, through ``/proc/PID/fd`` (the files have no name: nothing is left on
        disk; no stacks, replays after a crash or recycling where there is no /proc)."""
        with contextlib.suppress(Exception):  # a dead actor: the wait says so
            here = ray.get_runtime_context().get_node_id()
            places = ray.get([self._actors[w].stack_file.remote() for w in workers], timeout=10)
            for w, (node, pid, stacks, log) in zip(workers, places, strict=True):
                self._drop_stack_file(w)
                if node != here:
                    continue
                with contextlib.suppress(OSError):
                    self._stack_files[w] = (pid, os.open(f"/proc/{pid}/fd/{stacks}", os.O_RDWR))
                    self._log_files[w] = os.open(f"/proc/{pid}/fd/{log}", os.O_RDONLY)

    def _drop_stack_file(self, w: int) -> None:
        entry, log = self._stack_files.pop(w, None), self._log_files.pop(w, None)
        if entry is not None:
            os.close(entry[1])
        if log is not None:
            os.close(log)

    # -- what the recycler and replays read (actors on this node) -----------------------------

    def log_head(self, w: int) -> tuple[int, int, Any] | None:
        """Worker ``w``'s action-log counters (:func:`envfleet._core.replay.read_head`),
        ``None`` for an actor on another node."""
        start, stop = self.ranges[w]
        fd = self._log_files.get(w)
        return read_head(read_bytes(fd, ActionLog.head_nbytes(stop - start)), stop - start)

    def rss(self, w: int) -> int | None:
        """Worker ``w``'s actor's resident memory now, in bytes (``None`` off this node)."""
        entry = self._stack_files.get(w)
        if entry is None:
            return None
        try:
            return int(psutil.Process(entry[0]).memory_info().rss)
        except psutil.Error:
            return None

    def recordings(self, w: int) -> list[EnvRecording]:
        """Each of worker ``w``'s envs' episode so far, from the action log its actor writes
        to a file of this node (readable after it died or while it hangs); none off this
        node or without a log."""
        fd, layout = self._log_files.get(w), self._layout
        if fd is None or layout is None:
            return []
        start, stop = self.ranges[w]
        return log_recordings(read_bytes(fd), layout.single_action_space, start, stop)

    def stacks(self, workers: list[int]) -> dict[int, str]:
        """Each of ``workers``' actors' stacks, asked for by a signal, where the actor runs
        on this node (:func:`~envfleet._backends.workers.ask_stacks`)."""
        targets = {w: self._stack_files[w] for w in workers if w in self._stack_files}
        return ask_stacks(targets, lambda w: psutil.pid_exists(self._stack_files[w][0]))

    # -- Transport ------------------------------------------------------------------------------

    def inline(self, command: Command) -> frozenset[int]:
        return frozenset()

    def send(self, w: int, command: Command, payload: Any) -> bool:
        start, stop = self.ranges[w]
        rows = tree_slice(self.batch.actions, start, stop) if command is Command.STEP else None
        # A dead actor's call returns a reference that raises when read: read() sees it.
        self._refs[w] = self._actors[w].run.remote((command, payload, rows))
        self._commands[w] = command
        return True

    def wait(self, workers: list[int], deadline: float | None, first: bool) -> Seen:
        """``ray.wait`` on the workers' replies (a dead actor's reply is ready: it raises
        when read). While actors are starting and Ray cannot place them, a warning every
        :data:`_START_WARN_S` seconds."""
        refs = [self._refs[w] for w in workers]
        starting = any(self._commands[w] is None for w in workers)
        began = time.monotonic() if starting else 0.0
        while True:
            wait_s = None if deadline is None else max(0.0, deadline - time.monotonic())
            if starting and (wait_s is None or wait_s > _START_WARN_S):
                wait_s = _START_WARN_S
            if first:
                found, _ = ray.wait(refs, num_returns=1, timeout=wait_s)
                ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
                ready_set = {*found, *ready}
            else:
                ready, _ = ray.wait(refs, num_returns=len(refs), timeout=wait_s)
                ready_set = set(ready)
            if len(ready_set) == len(refs) and not first:
                # The common case: every reply is there; read them in one call.
                # An actor that died or whose method raised: read() reads them one by one.
                with contextlib.suppress(ray.exceptions.RayError):
                    self._got.update(zip(workers, ray.get(refs), strict=True))
            if ready_set or not starting:
                return Seen([w for w, ref in zip(workers, refs, strict=True) if ref in ready_set])
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                return Seen([])
            if now - began < _START_WARN_S:  # ray.wait came back a little early: wait on
                continue
            began = now
            logger.warning(
                "Ray actors %s have not started after %g s: is the cluster short of the "
                "resources they ask for (%s)? Still waiting",
                workers,
                _START_WARN_S,
                self._options,
            )

    def read(self, w: int, done: Round) -> None:
        ref = self._refs.pop(w)
        reply = self._got.pop(w, None)
        if reply is None:
            try:
                reply = ray.get(ref)
            except ray.exceptions.RayTaskError as exc:
                # The actor's method raised outside any env (e.g. infos Ray cannot pickle).
                cause = exc.cause if isinstance(getattr(exc, "cause", None), BaseException) else exc
                command = self._commands[w]
                error = RemoteError(
                    self.ranges[w][0],
                    "make" if command is None else command.name.lower(),
                    type(cause).__qualname__,
                    str(cause),
                    str(exc),
                    None,
                )
                done.failures[w] = Failure([error])
                return
            except ray.exceptions.RayError as exc:  # the actor died, or its node
                done.crashed[w] = _reason(exc)
                return
        self._take(w, reply, done)

    def _take(self, w: int, reply: Reply, done: Round) -> None:
        """Write the rows of worker ``w``'s reply into the batch; note its result."""
        status, payload, rows, seconds = reply
        if rows is not None:
            start, stop = self.ranges[w]
            b = self.batch
            tree_write(tree_slice(b.observations, start, stop), rows[0])
            b.rewards[start:stop] = rows[1]
            b.terminations[start:stop] = rows[2]
            b.truncations[start:stop] = rows[3]
        if status == Status.ERROR:
            done.failures[w] = cast(Failure, payload)
            return
        done.results[w] = payload
        if self._commands[w] is Command.STEP:
            self._timers[w].record(seconds)

    def env_error(self, w: int, failure: Any, note: str) -> EnvError:
        return remote_env_error(cast(Failure, failure).errors[0], w, note)

    def crash_error(
        self, w: int, step: int, note: str, reason: str, starting: bool, fate: str = CLOSED
    ) -> EnvCrashedError:
        start, stop = self.ranges[w]
        when = "while starting" if starting else f"after {step} steps"
        entry = self._stack_files.get(w)
        stacks = read_text(entry[1]) if entry is not None else ""
        return EnvCrashedError(
            f"the Ray actor of worker {w} (sub-environments {start}..{stop - 1}) died {when}"
            f"{at(stacks)}{f' ({reason})' if reason else ''}; {note + '; ' if note else ''}{fate}",
            env_indices=range(start, stop),
            worker_index=w,
            exitcode=None,
            step=step,
            stacks=stacks,
        )

    # -- close ----------------------------------------------------------------------------------

    def close(self, timeout: float | None, terminate: bool, busy: Sequence[int]) -> None:
        """Close the envs, then kill every actor; bounded.

        Without ``terminate`` and with no command pending, each actor closes its envs within
        ``timeout`` seconds (default :data:`DEFAULT_CLOSE_TIMEOUT`, shared by all). Then every
        actor is killed (``ray.kill``), and close waits up to a couple of seconds for Ray to
        confirm that they are gone.
        """
        if self._closed:
            return
        self._closed = True
        actors = [actor for actor in self._actors if actor is not None]
        graceful = not terminate and not busy
        if busy and not terminate:
            logger.warning("closing while Ray actors %s are busy; killing them", sorted(busy))
        self._refs, self._got = {}, {}
        self._actors = [None] * len(self._actors)
        for w in list(self._stack_files):
            self._drop_stack_file(w)
        if not actors or not ray.is_initialized():
            return
        with contextlib.suppress(Exception):
            if graceful:
                refs = [actor.close.remote() for actor in actors]
                limit = DEFAULT_CLOSE_TIMEOUT if timeout is None else timeout
                ray.wait(refs, num_returns=len(refs), timeout=limit)
        for actor in actors:
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)
        with contextlib.suppress(Exception):
            # Calls on a killed actor fail once Ray has seen it die: wait for that, bounded.
            probes = [actor.where.remote() for actor in actors]
            ray.wait(probes, num_returns=len(probes), timeout=_KILL_GRACE)


def _reason(exc: BaseException) -> str:
    """The first lines of Ray's account of an actor's death, on one line."""
    text = " ".join(str(exc).split())
    return text[:300] + ("..." if len(text) > 300 else "")


# -- plan and registration (envfleet._backends.registry) -------------------------------------

from envfleet._backends.base import worker_ranges  # noqa: E402
from envfleet._backends.registry import (  # noqa: E402
    BackendSpec,
    BuildRequest,
    Plan,
    PlanRequest,
    register,
)


def _plan(request: PlanRequest) -> Plan:
    """Connect to Ray (``ray_address``) and plan the actors (:func:`plan_ray`).

    Raises:
        ConfigError: ``ray_address`` is not a string, or :func:`plan_ray`'s errors.
    """
    address = request.options["ray_address"]
    if address is not None and not isinstance(address, str):
        raise ConfigError(f"ray_address must be None or a string, got {address!r}")
    plan = plan_ray(request.num_envs, request.num_workers, address, request.options["ray_options"])
    # Every env in an actor: make() builds none in the driver (env 0's spaces come from it).
    return Plan(worker_ranges(request.num_envs, plan.num_workers), plan, driver_free=True)


def _build(request: BuildRequest) -> RoundDriver:
    plan: RayPlan = request.plan.details
    transport = RayTransport(request, plan.actor_options)
    return RoundDriver(transport, transport.remote, request.start_timeout)


register(
    BackendSpec(
        "ray",
        build=_build,
        plan=_plan,
        options=("ray_address", "ray_options"),
        pickles_factories=True,
        spare_slabs=False,  # the actors' results are copied into the block, not written there
    )
)
