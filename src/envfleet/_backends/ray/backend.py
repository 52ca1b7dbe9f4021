"""``backend="ray"``: EnvGroups in Ray actors, on one machine or across a cluster (DESIGN §2).

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

This module holds the driver's side (:class:`RayBackend`) and the registration; the actor is
:mod:`envfleet._backends.ray.actor`, the plan (connecting to Ray, the worker count, the
actors' options) :mod:`envfleet._backends.ray.plan`.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterable, Mapping
from typing import Any, cast

import numpy as np
import ray
import ray.exceptions

from envfleet._backends.base import (
    Backend,
    EnvProbe,
    mismatch_error,
    remote_env_error,
    start_error,
)
from envfleet._backends.ray.actor import ActorLayout, ActorSpec, RemoteWorker, Reply
from envfleet._backends.ray.plan import RayPlan, plan_ray
from envfleet._backends.supervisor import Round, Supervisor
from envfleet._core.buffers import allocate_batch
from envfleet._core.errors import (
    ConfigError,
    EnvCrashedError,
    EnvError,
    EnvfleetError,
    StartTimeoutError,
)
from envfleet._core.protocol import Command, Failure, RemoteError, RestartRequest, Status
from envfleet._core.stats import STATS_WORDS, StepTimer, StepTimeStats, step_time_table
from envfleet._core.trees import tree_slice, tree_write

__all__ = ["DEFAULT_CLOSE_TIMEOUT", "RayBackend", "RayPlan", "plan_ray"]

logger = logging.getLogger("envfleet")

DEFAULT_CLOSE_TIMEOUT = 5.0  # seconds for the actors to close their envs before being killed
_KILL_GRACE = 2.0  # seconds close() waits for Ray to confirm that killed actors are gone
_START_WARN_S = 30.0  # seconds between warnings while actors wait to be placed


# -- the driver side ----------------------------------------------------------------------------


class RayBackend(Backend):
    """One Ray actor per block of envs; results come back through Ray's object store.

    Args:
        request: make()'s :class:`BuildRequest`: the factories (cloudpickled), the ledger
            (with a restart policy, envs that raise are rebuilt in their actor, and dead or
            hung actors are replaced), a first-ready pool (:meth:`collect_ready` returns
            whichever actors finish first) and ``start_timeout``. No env is built in the
            driver: the actor that holds env 0 sends env 0's spaces (``request.learn``), then
            every actor lays its envs over buffers of its rows (:meth:`EnvfleetWorker.attach`).
        actor_options: passed to each actor's ``.options(...)`` (see :func:`plan_ray`).

    Raises:
        EnvError: a factory raised while building an env (``method == "make"``).
        SpaceMismatchError: an env's spaces differ from env 0's (or the given pair's).
        EnvCrashedError: an actor died while starting.
        StartTimeoutError: the actors did not build their envs within ``start_timeout``.
    """

    late_what = "Ray actors of workers"

    def __init__(self, request: BuildRequest, actor_options: Mapping[str, Any] | None = None):
        self.ranges = list(request.plan.ranges)
        self.ledger = request.ledger
        self._blobs, self._accepts = request.blobs, request.accepts_index
        self._options = dict(actor_options or {})
        self._pool = request.pool
        self._start_timeout = request.start_timeout
        self._layout: ActorLayout | None = None  # once env 0's spaces are known
        self._probe: EnvProbe | None = None  # env 0's, from its actor
        workers = len(self.ranges)
        self._stats = np.zeros((workers, STATS_WORDS))
        self._timers = [StepTimer(row) for row in self._stats]
        self._actors: list[Any] = [None] * workers
        self._pending: dict[int, Any] = {}  # worker -> ObjectRef of its running command
        self._command = Command.STEP
        self.supervisor = Supervisor(self)
        self._closed = False
        first_env = request.first_env
        try:
            for w in range(workers):
                self._start_actor(w)
            if first_env is not None:
                first_env.close()
                first_env = None
            self._check_ready(self._await_ready(range(workers), step=0, request=request))
        except BaseException:
            if first_env is not None:
                first_env.close()
            self.close(timeout=0, terminate=True)
            raise

    # -- actors -----------------------------------------------------------------------------

    def _start_actor(self, w: int) -> None:
        start, stop = self.ranges[w]
        spec = ActorSpec(
            worker_index=w,
            start=start,
            stop=stop,
            env_fns=self._blobs[start:stop],
            accepts_index=list(self._accepts[start:stop]),
        )
        self._actors[w] = RemoteWorker.options(**self._options).remote(spec)

    def _await_ready(
        self, workers: Iterable[int], step: int, request: BuildRequest | None = None
    ) -> Round:
        """Wait (unbounded, warning while Ray cannot place them; ``start_timeout`` at most in
        all) for the new actors to build their envs, then to lay them out with env 0's
        spaces: at the start (``request``) learned from the actor of env 0 first. Returns the
        round of the layouts (a space mismatch or ``None``); a dead actor raises at once, and
        one that could not build its envs (:meth:`_check_built`)."""
        workers = list(workers)
        timeout = self._start_timeout
        deadline = None if timeout is None else time.monotonic() + timeout
        self._check_built(self._await(workers, step, deadline, None))
        if request is not None:
            if request.probe is None:
                request.learn(cast(EnvProbe, self._probe))
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
            )
        return self._await(workers, step, deadline, self._layout)

    def _await(
        self, workers: list[int], step: int, deadline: float | None, layout: ActorLayout | None
    ) -> Round:
        """The actors' replies to ``ready`` (``layout`` ``None``) or ``attach(layout)``."""
        if layout is None:
            refs = {w: self._actors[w].ready.remote() for w in workers}
        else:
            refs = {w: self._actors[w].attach.remote(layout) for w in workers}
        waiting = list(refs.values())
        timeout = self._start_timeout
        while True:
            wait_s = _START_WARN_S
            if deadline is not None:
                wait_s = max(0.0, min(wait_s, deadline - time.monotonic()))
            _, waiting = ray.wait(waiting, num_returns=len(waiting), timeout=wait_s)
            if not waiting:
                break
            late = [w for w, ref in refs.items() if ref in waiting]
            if deadline is not None and time.monotonic() >= deadline:
                envs = [e for w in late for e in range(*self.ranges[w])]
                self.close(timeout=0, terminate=True)
                raise StartTimeoutError(
                    f"sub-environments {envs} were not built within {timeout} s "
                    f"(start_timeout); their Ray actors {late} were killed",
                    envs,
                    cast(float, timeout),
                )
            logger.warning(
                "Ray actors %s have not started after %g s: is the cluster short of the "
                "resources they ask for (%s)? Still waiting",
                late,
                _START_WARN_S,
                self._options,
            )
        done = self._wait(refs, None, step, fail_fast=True, starting=True)
        if layout is None and 0 in done.results:
            self._probe = cast(EnvProbe, done.results[0])
        return done

    def _check_built(self, done: Round) -> None:
        """Raise for the first actor that could not build its envs."""
        if done.failures:
            w = min(done.failures)
            raise start_error(done.failures[w].errors[0], w)

    def _check_ready(self, done: Round) -> None:
        """Raise for the first actor that could not start (an env error or a space mismatch)."""
        self._check_built(done)
        for w in sorted(done.results):
            if done.results[w] is not None:
                raise mismatch_error(done.results[w])

    def placement(self) -> list[tuple[str, int]]:
        """Per worker, the (Ray node id, process id) of its actor (a round trip to each)."""
        return list(ray.get([actor.where.remote() for actor in self._actors]))

    # -- Backend ---------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._closed

    def step_times(self) -> tuple[StepTimeStats, ...]:
        return step_time_table(self._stats)

    def submit(self, command: Command, payloads: Mapping[int, Any], step: int) -> None:
        self.supervisor.guarded(self._submit, command, payloads)

    def _submit(self, command: Command, payloads: Mapping[int, Any]) -> None:
        self._command = command
        actions = self.batch.actions
        if command is not Command.RESTART:
            self.supervisor.sent(payloads, command)
        for w in sorted(payloads):
            start, stop = self.ranges[w]
            rows = tree_slice(actions, start, stop) if command is Command.STEP else None
            # A dead actor's call returns a reference that raises when read: collect sees it.
            self._pending[w] = self._actors[w].run.remote((command, payloads[w], rows))

    def collect(self, timeout: float | None, step: int) -> dict[int, Any]:
        return self.supervisor.guarded(self._collect, timeout, step)

    def _collect(self, timeout: float | None, step: int) -> dict[int, Any]:
        refs, self._pending = self._pending, {}
        fail_fast = not self.ledger.restarts_on(self._command)
        done = self._wait(refs, timeout, step, fail_fast)
        results = self.supervisor.settle(done, timeout, step, self._command)
        return dict(sorted(results.items()))

    def collect_ready(self, timeout: float | None, step: int) -> dict[int, Any]:
        """First-ready pool: wait until at least one pending actor has replied; return the
        replies of every actor done by then (worker index -> result).

        Raises:
            EnvError: an env raised; the other replies read with it, and any other env error,
                are kept for the next calls (one error per call).
            EnvCrashedError: a pending actor died; the backend is shut down.
            StepTimeoutError: no actor replied within ``timeout`` seconds; shut down.
        """
        return self.supervisor.guarded(self._collect_ready, timeout, step)

    def _collect_ready(self, timeout: float | None, step: int) -> dict[int, Any]:
        supervisor = self.supervisor
        if supervisor.has_kept():
            return supervisor.take_kept()
        if not self._pool:  # synchronous send/recv: every env is pending, wait for them all
            return self._collect(timeout, step)
        # Without a restart policy a dead or late actor raises at once; with one, it is noted
        # in the round and the supervisor replaces it.
        fail_fast = self.ledger.policy is None
        pending = self._pending
        refs = list(pending.values())
        # Each actor has ``timeout`` seconds from its own send: one past it is late even while
        # others keep replying.
        deadline = supervisor.deadline(pending, timeout)
        wait_s = None if deadline is None else max(0.0, deadline - time.monotonic())
        first, _ = ray.wait(refs, num_returns=1, timeout=wait_s)
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        ready_set = set(ready) | set(first)
        late = supervisor.late([w for w, ref in pending.items() if ref not in ready_set], timeout)
        if late and fail_fast:
            supervisor.timed_out(late, timeout)
        if not ready_set and not late:
            return {}
        done_refs = {w: ref for w, ref in pending.items() if ref in ready_set}
        for w in [*done_refs, *late]:
            del pending[w]
        done = self._wait(done_refs, None, step, fail_fast)
        done.late = late
        return dict(sorted(supervisor.ready(done, timeout, step).items()))

    # -- waiting and reading replies ----------------------------------------------------------

    def _wait(
        self,
        refs: Mapping[int, Any],
        timeout: float | None,
        step: int,
        fail_fast: bool,
        starting: bool = False,
    ) -> Round:
        """Wait up to ``timeout`` seconds for the replies ``refs`` (worker -> ObjectRef), in
        worker order, and read them; an actor's death ends its wait at once.

        ``fail_fast``: a dead actor or the timeout raises at once (and closes the backend);
        otherwise they are noted in the returned round, with env failures, for the supervisor.
        """
        done = Round()
        if not refs:
            return done
        order = list(refs.values())
        ready, late = ray.wait(order, num_returns=len(order), timeout=timeout)
        if not late:
            # The common case: every reply is there; read them in one call.
            try:
                replies = ray.get(order)
            except ray.exceptions.RayError:
                pass  # an actor died or its method raised: read them one by one below
            else:
                for w, reply in zip(refs, replies, strict=True):
                    self._take(w, reply, done, starting)
                return done
        finished = set(ready)
        for w, ref in refs.items():  # in worker order
            if ref in finished:
                self._read(w, ref, done, step, fail_fast, starting)
        done.late = sorted(w for w, ref in refs.items() if ref not in finished)
        if done.late and fail_fast:
            self.supervisor.timed_out(done.late, timeout)
        return done

    def _read(
        self, w: int, ref: Any, done: Round, step: int, fail_fast: bool, starting: bool
    ) -> None:
        try:
            reply = ray.get(ref)
        except ray.exceptions.RayTaskError as exc:
            # The actor's method raised outside any env (e.g. infos that Ray cannot pickle).
            cause = exc.cause if isinstance(getattr(exc, "cause", None), BaseException) else exc
            error = RemoteError(
                self.ranges[w][0],
                "make" if starting else self._command.name.lower(),
                type(cause).__qualname__,
                str(cause),
                str(exc),
                None,
            )
            done.failures[w] = Failure([error])
            return
        except ray.exceptions.RayError as exc:  # the actor died, or its node
            reason = _reason(exc)
            done.crashed[w] = reason
            if fail_fast:
                self.supervisor.crashed(w, step, reason=reason, starting=starting)
            return
        self._take(w, reply, done, starting)

    def _take(self, w: int, reply: Reply, done: Round, starting: bool) -> None:
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
        if self._command is Command.STEP and not starting:
            self._timers[w].record(seconds)

    # -- the mechanics the supervisor uses (Supervised) ---------------------------------------

    def env_error(self, w: int, failure: Any, note: str) -> EnvError:
        return remote_env_error(cast(Failure, failure).errors[0], w, note)

    def crash_error(
        self, w: int, step: int, note: str, reason: str, starting: bool
    ) -> EnvCrashedError:
        start, stop = self.ranges[w]
        when = "while starting" if starting else f"after {step} steps"
        return EnvCrashedError(
            f"the Ray actor of worker {w} (sub-environments {start}..{stop - 1}) died {when}"
            f"{f' ({reason})' if reason else ''}; {note + '; ' if note else ''}"
            "the vector env was closed",
            env_indices=range(start, stop),
            worker_index=w,
            exitcode=None,
            step=step,
        )

    def replace_workers(
        self, workers: list[int], done: Round, timeout: float | None, step: int
    ) -> None:
        for w in workers:
            why = f"died ({done.crashed[w]})" if w in done.crashed else "did not answer in time"
            logger.warning("Ray actor of worker %d %s; replacing it and its envs", w, why)
            with contextlib.suppress(Exception):
                ray.kill(self._actors[w], no_restart=True)
            self._start_actor(w)
        try:
            self._check_ready(self._await_ready(workers, step))
        except EnvfleetError:  # a new actor could not start: give up
            self.close(timeout=0, terminate=True)
            raise

    def restart_envs(
        self, requests: dict[int, RestartRequest], timeout: float | None, step: int
    ) -> Round:
        command = self._command
        self._submit(Command.RESTART, requests)
        refs = {w: self._pending.pop(w) for w in requests}  # a pool's others still run
        try:
            return self._wait(refs, timeout, step, fail_fast=True)
        finally:
            self._command = command

    # -- close ----------------------------------------------------------------------------------

    def close(self, timeout: float | None, terminate: bool) -> None:
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
        graceful = not terminate and not self._pending
        if self._pending and not terminate:
            logger.warning(
                "closing while Ray actors %s are busy; killing them", sorted(self._pending)
            )
        self._pending = {}
        self._actors = [None] * len(self._actors)
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


def _build(request: BuildRequest) -> RayBackend:
    plan: RayPlan = request.plan.details
    return RayBackend(request, plan.actor_options)


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
