"""``backend="ray"``: EnvGroups in Ray actors, on one machine or across a cluster.

Each worker is a Ray actor holding a contiguous block of envs in an :class:`EnvGroup` over
buffers of its own (the block's rows only: actors on other nodes share no memory with the
driver). A step sends the block's actions with the command; the actor steps its envs (the same
EnvGroup code as every backend) and returns its rows (observations, rewards, terminations,
truncations), the non-empty infos and the step's duration, through Ray's object store; the
driver writes the rows into its own batch. Actors are placed by Ray's scheduler: by default
``"SPREAD"`` across the cluster's nodes, each asking for one CPU (or an even share of the
cluster's CPUs when there are more workers than CPUs); ``envfleet.Ray(actor_options=...)``
changes that (custom resources for nodes that have a simulator, GPUs, placement groups, node
affinity).

Failures map to the same typed errors as the other backends: an env that raises is an
:class:`envfleet.EnvError` (its exception and the actor's traceback chained); an actor that
dies (segfault, ``os._exit``, ``ray.kill``, its node lost) is an :class:`envfleet.EnvCrashedError`
(Ray does not report a process exit code: ``exitcode`` is ``None`` and the message gives Ray's
reason); a wait past the timeout kills the late actors and raises
:class:`envfleet.StepTimeoutError`. A restart policy rebuilds envs inside their actor and
replaces dead or hung actors with new ones (placed by the same options).

Every node is like the driver's: one envfleet helper per node that holds env actors
(:mod:`envfleet._backends.ray.helper`) holds their stack files and action logs open and reads
them for the driver through Ray: the stacks of a hung actor (``err.stacks``, hang reports),
what a dead one's faulthandler wrote, the replay of a crash or a hang (``err.replay``), the
recycler's counters and memory, ``envs.stats.memory``. The driver opens no file and no
``/proc`` entry of an actor. An env actor dies with its helper, so a helper's death is
reported (and, under a restart policy, repaired) as its actors' death.

This module holds the driver's side (:class:`RayTransport`: the primitives the round driver,
:class:`envfleet._backends.rounds.RoundDriver`, runs every round over) and the registration;
the actor is
:mod:`envfleet._backends.ray.actor`, the plan (connecting to Ray, the worker count, the
actors' options) :mod:`envfleet._backends.ray.plan`.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any, cast

import numpy as np
import ray
import ray.exceptions

from envfleet._backends.base import EnvProbe
from envfleet._backends.ray.actor import ActorLayout, ActorSpec, RemoteWorker, Reply
from envfleet._backends.ray.helper import GONE, NodeHelpers, reason
from envfleet._backends.ray.plan import RayPlan, plan_ray
from envfleet._backends.rounds import RoundDriver
from envfleet._backends.supervisor import Round
from envfleet._backends.transport import FullRound, Seen
from envfleet._backends.workers import STACKS_WAIT_S
from envfleet._core.action_log import log_recordings, read_head
from envfleet._core.buffers import allocate_batch
from envfleet._core.errors import (
    EnvCrashedError,
    EnvError,
)
from envfleet._core.failures import CLOSED, remote_env_error
from envfleet._core.protocol import Command, Failure, RemoteError, Status
from envfleet._core.replay import EnvRecording
from envfleet._core.stacks import at
from envfleet._core.stats import (
    KIND,
    STATS_WORDS,
    StepTimer,
    StepTimeStats,
    WorkerMemory,
    step_time_table,
)
from envfleet._core.trees import tree_slice, tree_write

__all__ = ["DEFAULT_CLOSE_TIMEOUT", "RayPlan", "RayTransport", "plan_ray"]

logger = logging.getLogger("envfleet")

DEFAULT_CLOSE_TIMEOUT = 5.0  # seconds for the actors to close their envs before being killed
_KILL_GRACE = 2.0  # seconds close() waits for Ray to confirm that killed actors are gone
_START_WARN_S = 30.0  # seconds between warnings while actors wait to be placed


# -- the driver side ----------------------------------------------------------------------------


class RayTransport:
    """One Ray actor per block of envs; results come back through Ray's object store (a
    :class:`~envfleet._backends.transport.Transport`: the rounds are the round driver's).

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
    full_round: FullRound | None = None

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
        # The helper of each node that holds actors: their stack files and action logs.
        self._helpers = NodeHelpers(self.ranges, self._options)
        self._closed = False
        first_env = request.first_env
        try:
            self._helpers.prestart()
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
        self._helpers.forget(w)
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
        at the start from env 0's ``READY`` (``probe``), when the driver's batch is made.
        First each actor is handed to the helper of its node (started there if it has none:
        :meth:`NodeHelpers.adopt`), and told to die with it."""
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
        helper_pids = self._helpers.adopt({w: self._actors[w] for w in workers})
        for w in workers:
            self._refs[w] = self._actors[w].attach.remote(self._layout, helper_pids.get(w))
            self._commands[w] = None
        return True

    # -- what the recycler, replays and reports read: through each node's helper -------------

    def counters(self) -> list[tuple[tuple[int, int, Any] | None, int | None]]:
        """Per worker: its action-log counters (:func:`envfleet._core.action_log.read_head`) and
        its actor's resident memory now in bytes (``None`` each where unknown): one call to
        each node's helper, all at once (the recycler's look)."""
        found = self._helpers.counters(range(len(self.ranges)))
        looks: list[tuple[tuple[int, int, Any] | None, int | None]] = []
        for w, (start, stop) in enumerate(self.ranges):
            head, rss = found.get(w, (b"", None))
            looks.append((read_head(head, stop - start), rss))
        return looks

    def log_head(self, w: int) -> tuple[int, int, Any] | None:
        """Worker ``w``'s action-log counters (:func:`envfleet._core.action_log.read_head`),
        ``None`` where unknown."""
        start, stop = self.ranges[w]
        head, _ = self._helpers.counters([w]).get(w, (b"", None))
        return read_head(head, stop - start)

    def rss(self, w: int) -> int | None:
        """Worker ``w``'s actor's resident memory now, in bytes (``None`` where unknown)."""
        return self._helpers.counters([w]).get(w, (b"", None))[1]

    def worker_memory(self) -> tuple[WorkerMemory, ...]:
        """Per actor: its resident memory last sampled by its node's helper, the episodes
        its envs began and its growth per 1,000 episodes (``envs.stats.memory``)."""
        found = self._helpers.memory(range(len(self.ranges)))
        return tuple(WorkerMemory(*found.get(w, (None, 0, None))) for w in range(len(self.ranges)))

    def recordings(self, w: int) -> list[EnvRecording]:
        """Each of worker ``w``'s envs' episode so far, from the action log its actor writes
        to a file of its node, read by that node's helper (after the actor died, or while it
        hangs); none without a log, or when its helper is gone."""
        layout = self._layout
        if layout is None:
            return []
        start, stop = self.ranges[w]
        return log_recordings(self._helpers.log(w), layout.single_action_space, start, stop)

    def stacks(self, workers: list[int]) -> dict[int, str]:
        """Each of ``workers``' actors' stacks, asked for now by a signal from the helper of
        its node (:meth:`envfleet._backends.ray.helper.NodeHelper.stacks`), every node at
        once."""
        return self._helpers.stacks(workers, STACKS_WAIT_S)

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

    def wait(
        self, workers: list[int], deadline: float | None, first: bool, spun_s: float | None = None
    ) -> Seen:
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
                done.crashed[w] = self._helpers.lost.get(w) or reason(exc)
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
            if isinstance(seconds, tuple):  # with what the actor's group learned of its envs
                seconds, *stepping = seconds
                self._stats[w, KIND:] = stepping
            self._timers[w].record(seconds)

    def env_error(self, w: int, failure: Any, note: str) -> EnvError:
        return remote_env_error(cast(Failure, failure).errors[0], w, note)

    def crash_error(
        self, w: int, step: int, note: str, reason: str, starting: bool, fate: str = CLOSED
    ) -> EnvCrashedError:
        start, stop = self.ranges[w]
        when = "while starting" if starting else f"after {step} steps"
        found = self._helpers.report(w)
        stacks, seen, gone = "", None, ""
        if isinstance(found, str):
            if w not in self._helpers.lost:
                # An actor dies with its helper (or with the node of both): what the helper
                # held for it (its stacks, its replay) is lost with them.
                gone = f"; {GONE} ({found}), and the actor's stacks and replay with it"
        else:
            stacks, seen = found
        where = at(stacks)
        if not stacks and seen is not None:  # a death without a stack: SIGKILL, the OOM's way
            where = (
                f" (its resident memory last seen: {seen[0] / 2**20:.1f} MiB, "
                f"{seen[1]:.1f} s before)"
            )
        return EnvCrashedError(
            f"the Ray actor of worker {w} (sub-environments {start}..{stop - 1}) died {when}"
            f"{where}{f' ({reason})' if reason else ''}{gone}; "
            f"{note + '; ' if note else ''}{fate}",
            env_indices=range(start, stop),
            worker_index=w,
            exitcode=None,
            step=step,
            stacks=stacks,
            rss_bytes=None if seen is None else seen[0],
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
        helpers = self._helpers.close()
        if not actors or not ray.is_initialized():
            return
        with contextlib.suppress(Exception):
            if graceful:
                refs = [actor.close.remote() for actor in actors]
                limit = DEFAULT_CLOSE_TIMEOUT if timeout is None else timeout
                ray.wait(refs, num_returns=len(refs), timeout=limit)
        for actor in [*actors, *helpers]:  # (an env actor would die with its helper too)
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)
        with contextlib.suppress(Exception):
            # Calls on a killed actor fail once Ray has seen it die: wait for that, bounded.
            probes = [actor.where.remote() for actor in actors]
            probes += [helper.close.remote() for helper in helpers]
            ray.wait(probes, num_returns=len(probes), timeout=_KILL_GRACE)


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
    """Connect to Ray (``envfleet.Ray(address=...)``) and plan the actors (:func:`plan_ray`).

    Raises:
        ConfigError: :func:`plan_ray`'s errors.
    """
    address = request.options.get("ray_address")
    options = request.options.get("ray_options")
    plan = plan_ray(request.num_envs, request.num_workers, address, options)
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
        pickles_factories=True,
        spare_slabs=False,  # the actors' results are copied into the block, not written there
    )
)
