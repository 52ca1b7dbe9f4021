"""The synchronous vector env of the front (layer 5 in docs/architecture.md):
:class:`FleetVectorEnv`.

One vector env class for every backend; :func:`envfleet.make` builds it. It validates input
before anything reaches a worker (:mod:`envfleet._front.checks`), owns the call state machine
(idle / waiting-reset / waiting-step / waiting-call, with gymnasium's AsyncVectorEnv errors),
assembles infos in gymnasium's convention (:mod:`envfleet._core.infos`) and hands results
out through :mod:`envfleet._front.results`; it holds a
:class:`envfleet._front.pool.FirstReadyPool`, which keeps the first-ready pool's env states and
runs its calls.
"""

from __future__ import annotations

import contextlib
import logging
import os
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

import cloudpickle
import gymnasium
import numpy as np
from gymnasium.vector import AutoresetMode, VectorEnv
from gymnasium.vector.async_vector_env import AsyncState
from gymnasium.vector.utils import batch_space

from envfleet._backends.base import Backend, DisownedBackend, native_of
from envfleet._core.action_log import group_recordings, restore_envs
from envfleet._core.buffers import caller_leaves, is_leaf, side_leaves
from envfleet._core.errors import (
    AlreadyPendingCallError,
    ClosedEnvironmentError,
    InvalidArgumentError,
    NoAsyncCallError,
    PoolStateError,
    ResetNeededError,
    UnsupportedError,
)
from envfleet._core.infos import one_env_info, vector_infos
from envfleet._core.protocol import CallRequest, Command, ResetRequest, SetAttrRequest, TaskRequest
from envfleet._core.replay import EnvRecording, Snapshot
from envfleet._core.stats import FleetStats
from envfleet._front.checks import check_actions, check_name, check_reset_mask, seeds_per_env
from envfleet._front.pool import FirstReadyPool, NativePool
from envfleet._front.results import ResultBuffers

__all__ = ["FleetVectorEnv"]

logger = logging.getLogger("envfleet")

# Every vector env of this process, so that a forked child disowns them (below).
_LIVE: weakref.WeakSet[FleetVectorEnv] = weakref.WeakSet()


def _disown_after_fork() -> None:
    """In a child forked from this process: its vector envs are the parent's. Each now
    refuses every call (WrongProcessError) and closes nothing, and multiprocessing's exit
    handler no longer counts their workers as this process's children to terminate."""
    for venv in list(_LIVE):
        venv._disown()


os.register_at_fork(after_in_child=_disown_after_fork)


# Enum members of the step's hot path as globals: an Enum member lookup costs more than a
# global's (benchmarks/README.md).
_NO_CALL, _DISABLED, _STEP = AsyncState.DEFAULT, AutoresetMode.DISABLED, Command.STEP


class FleetVectorEnv(VectorEnv[Any, Any, np.ndarray]):
    """A ``gymnasium.vector.VectorEnv`` over an envfleet backend; build it with :func:`make`.

    Results follow ``gymnasium.vector.SyncVectorEnv`` exactly: observations batched as
    ``create_empty_array`` lays them out (``[num_envs, *shape]`` of the space's dtype, or
    dict/tuple of those), ``reward: float64[num_envs]``, ``terminated: bool[num_envs]``,
    ``truncated: bool[num_envs]``, infos as ``info[key]`` arrays with ``info["_key"]`` masks.
    The asynchronous calls and their errors follow ``gymnasium.vector.AsyncVectorEnv``.
    """

    # As gymnasium's vector envs: "same", "different" or (observation_space, single one);
    # set by make().
    observation_mode: str | tuple[gymnasium.Space[Any], gymnasium.Space[Any]] = "same"

    def __init__(
        self,
        backend: Backend,
        *,
        backend_name: str,
        single_observation_space: gymnasium.Space[Any],
        single_action_space: gymnasium.Space[Any],
        metadata: dict[str, Any],
        render_mode: str | None,
        autoreset_mode: AutoresetMode,
        step_timeout: float | None,
        copy: bool,
        batch_size: int | None = None,
    ):
        self._backend = backend
        self._owner_pid = os.getpid()
        _LIVE.add(self)
        self.backend = backend_name
        self.num_envs = backend.batch.rewards.shape[0]
        self.num_workers = backend.num_workers
        self._every_group: dict[int, Any] = dict.fromkeys(range(len(backend.ranges)))
        self._action_leaf = is_leaf(single_action_space)
        self.single_observation_space = single_observation_space
        self.single_action_space = single_action_space
        self.observation_space = batch_space(single_observation_space, self.num_envs)
        self.action_space = batch_space(single_action_space, self.num_envs)
        self.autoreset_mode = autoreset_mode
        self.metadata = metadata
        self.metadata["autoreset_mode"] = autoreset_mode
        self.render_mode = render_mode
        self.step_timeout = step_timeout
        self.copy = copy
        self._state = AsyncState.DEFAULT
        # What an asynchronous call left for its wait to run in this thread (inline).
        self._deferred: tuple[Command, dict[int, Any]] | None = None
        self._unbatched_infos = False
        self._needs_reset = np.zeros(self.num_envs, dtype=np.bool_)
        self._steps = 0
        self.closed = False
        is_pool = batch_size is not None and batch_size < self.num_envs
        # copy=True results handed out without a copy where the batch has spare slabs, and
        # observation leaves without a fixed size (results.ResultBuffers).
        self._outputs = ResultBuffers(
            backend.batch, single_observation_space, slabs=copy and not is_pool
        )
        # The first-ready pool's env states and calls (async_reset, send, recv).
        native = native_of(backend)
        self._pool = (
            NativePool(native, self._outputs, single_action_space, batch_size, copy)
            if native is not None and is_pool
            else FirstReadyPool(backend, self._outputs, single_action_space, batch_size, copy)
        )
        self.batch_size = self._pool.batch_size
        self.is_pool = self._pool.is_pool
        # Action leaves without a fixed size, and leaves of another dtype than the space's:
        # their values go to each worker with the step command (EnvGroup.step's
        # leaf_actions); the step's payloads, or every group's None.
        self._side_actions = bool(side_leaves(single_action_space))
        self._step_payloads: dict[int, Any] = self._every_group
        self._plan_plain_step()

    # -- reset -----------------------------------------------------------------------------

    def reset(
        self,
        *,
        seed: int | Sequence[int | None] | None = None,
        options: dict[str, Any] | None = None,
    ) -> tuple[Any, dict[str, Any]]:
        """Reset the sub-environments (all, or those in ``options["reset_mask"]``).

        Args:
            seed: ``None`` (random), an int (env i gets ``seed + i``) or one seed per env.
            options: passed to each env's ``reset``; the key ``"reset_mask"`` (``bool[num_envs]``
                ndarray with at least one True) resets only those envs, as in gymnasium.

        Returns:
            (observations, infos) as gymnasium's SyncVectorEnv.reset.

        Raises:
            InvalidArgumentError: bad seeds or reset mask (nothing is sent).
            EnvError, EnvCrashedError, StepTimeoutError: see :meth:`reset_wait`.
        """
        self.reset_async(seed=seed, options=options)
        return self.reset_wait()

    def reset_async(
        self, seed: int | Sequence[int | None] | None = None, options: dict[str, Any] | None = None
    ) -> None:
        """Start a reset; collect it with :meth:`reset_wait` (gymnasium's AsyncVectorEnv API)."""
        self._assert_idle("reset_async")
        seeds = seeds_per_env(seed, self.num_envs)
        if options is not None and not isinstance(options, dict):
            raise InvalidArgumentError(f"options must be None or a dict, got {options!r}")
        mask = None
        if options is not None and "reset_mask" in options:
            options = dict(options)
            mask = check_reset_mask(options.pop("reset_mask"), self.num_envs)
        payloads = {}
        for w, (start, stop) in enumerate(self._backend.ranges):
            local_mask = None if mask is None else mask[start:stop]
            if local_mask is not None and not local_mask.any():
                continue
            payloads[w] = ResetRequest(seeds[start:stop], options, local_mask)
            self._backend.ledger.note_seeds(start, seeds[start:stop], local_mask)
        self._outputs.pick_slab(every_env=mask is None, copy=self.copy)
        self._submit_async(Command.RESET, payloads)  # a backend may refuse it: nothing changes
        self._needs_reset[slice(None) if mask is None else mask] = False
        self._state = AsyncState.WAITING_RESET

    def reset_wait(self, timeout: float | None = None) -> tuple[Any, dict[str, Any]]:
        """Wait for :meth:`reset_async`; ``timeout`` in seconds (default ``step_timeout``).

        Raises:
            NoAsyncCallError: no reset is pending.
            EnvError: an env raised in reset (its exception chained as ``__cause__``).
            EnvCrashedError: a worker died; the vector env is closed.
            StepTimeoutError: the timeout expired; the vector env is closed. Also a
                ``multiprocessing.TimeoutError``, as gymnasium's. Envs stepped in this thread
                (the driver's block, serial) cannot be interrupted: a timeout they overran is
                raised once they are done.
        """
        results = self._wait(AsyncState.WAITING_RESET, "reset_wait", timeout)
        infos = self._infos(results)
        return self._outputs.observations(self.copy), infos

    # -- step ------------------------------------------------------------------------------

    @property
    def unbatched_infos(self) -> bool:
        """True: a step's or reset's infos are the one env's own info dict, not batched (set
        by :class:`envfleet.ProcessEnv`)."""
        return self._unbatched_infos

    @unbatched_infos.setter
    def unbatched_infos(self, value: bool) -> None:
        self._unbatched_infos = bool(value)
        self._plan_plain_step()

    def _plan_plain_step(self) -> None:
        """The plain step's preconditions that hold for the vector env's life, in one place
        (the others, checked by :meth:`step` at each call: actions of the action buffer's own
        type, shape and dtype, no call pending, not closed, no pool started).

        - ``_native_step`` (a backend whose native library steps, EnvPool; not a pool;
          ``NEXT_STEP`` autoreset, the library's own): the library's arrays handed through.
        - ``_step_round`` (one action leaf, whose buffer the actions fill as they are; not a
          pool; autoreset on, so no env waits for a reset to be checked):
          ``backend.step_round``, whose ``None`` stands for "every env stepped, no info".
        - ``_copy_rows``: that ``None`` is answered with the batch's rows copied and ``{}``
          (one observation leaf, no slabs or side leaves to assemble, ``copy``, infos
          batched).
        """
        backend = self._backend
        mode, pool = self.autoreset_mode, self._pool.is_pool
        native = native_of(backend)
        self._native_step = (
            native.native_step
            if native is not None and not pool and mode is AutoresetMode.NEXT_STEP
            else None
        )
        self._step_round = (
            backend.step_round
            if self._action_leaf and not pool and mode is not AutoresetMode.DISABLED
            else None
        )
        outputs = self._outputs
        self._copy_rows = (
            self._step_round is not None
            and is_leaf(self.single_observation_space)
            and outputs.slabs is None
            and not outputs.side_spaces
            and self.copy
            and not self._unbatched_infos
        )
        self._action_shape = backend.batch.actions.shape if self._action_leaf else None
        self._action_dtype = backend.batch.actions.dtype if self._action_leaf else None

    def step(self, actions: Any) -> tuple[Any, np.ndarray, np.ndarray, np.ndarray, dict[str, Any]]:
        """Step every sub-environment with its action; autoreset per ``autoreset_mode``.

        Args:
            actions: batched actions fitting ``action_space`` (``[num_envs, *shape]`` per leaf)
                of a dtype that casts to the space's (same-kind casting). Each env gets its
                row in the caller's dtype, as gymnasium's SyncVectorEnv and AsyncVectorEnv
                hand it (a float64 action for a float32 Box reaches the env as float64): the
                fast round takes actions of the space's own dtype; another dtype travels with
                the step command.

        Returns:
            (observations, rewards ``float64[num_envs]``, terminations ``bool[num_envs]``,
            truncations ``bool[num_envs]``, infos), as gymnasium's SyncVectorEnv.step.

        Raises:
            InvalidActionError: actions of the wrong structure, shape or dtype (nothing is sent).
            ResetNeededError: ``AutoresetMode.DISABLED`` and some env needs a reset first.
            EnvError, EnvCrashedError, StepTimeoutError: see :meth:`step_wait`.
        """
        if (
            type(actions) is np.ndarray
            and actions.dtype == self._action_dtype
            and actions.shape == self._action_shape
            and self._state is _NO_CALL
            and not self.closed
            and not self._pool.started
        ):
            # The plain step (_plan_plain_step): nothing to check beyond the above.
            native = self._native_step
            if native is not None:
                try:
                    answer = native(actions, self.copy)
                except BaseException:
                    self.closed = self._backend.closed
                    raise
                self._steps += 1
                return answer
            step_round = self._step_round
            if step_round is not None:
                self._stage_actions(actions)
                try:
                    results = step_round(self.step_timeout, self._steps)
                except BaseException as exc:
                    self._interrupted_step(exc)
                    raise
                return self._step_outputs(results)
        # step_async then step_wait, with the submit and the wait in one backend call (the
        # round itself picks its fast path).
        self._prepare_step(actions, "step_async")
        try:
            results = self._backend.round(
                _STEP, self._step_payloads, self.step_timeout, self._steps
            )
        except BaseException as exc:
            # A crash, a timeout or an interrupt may have shut the backend down.
            self._interrupted_step(exc)
            raise
        return self._step_outputs(results)

    def _interrupted_step(self, exc: BaseException) -> None:
        """A step that raised ``exc``: the vector env is closed if the backend is. A Ctrl-C
        whose round the backend completed (``_envfleet_completed``, see
        :mod:`envfleet._backends.rounds`) counts as a step that returned: the step count
        and the autoreset bookkeeping move on, so the next step goes on from it. Its
        outputs (infos dropped) ride on the interrupt as ``_envfleet_step``, for the
        Sampler to act on next."""
        self.closed = self._backend.closed
        if not self.closed and getattr(exc, "_envfleet_completed", False):
            exc._envfleet_step = self._step_outputs({})  # type: ignore[attr-defined]

    def step_async(self, actions: Any) -> None:
        """Start a step; collect it with :meth:`step_wait` (gymnasium's AsyncVectorEnv API)."""
        self._prepare_step(actions, "step_async")
        self._submit_async(Command.STEP, self._step_payloads)
        self._state = AsyncState.WAITING_STEP

    def _prepare_step(self, actions: Any, name: str) -> None:
        """Check that a step may start and write ``actions`` into the action buffer."""
        if self.closed or self._pool.started or self.is_pool or self._state is not _NO_CALL:
            self._assert_idle(name)  # raises, except for a started pool with no env pending
        if self.autoreset_mode is _DISABLED and self._needs_reset.any():
            pending = np.flatnonzero(self._needs_reset).tolist()
            raise ResetNeededError(
                f"autoreset_mode=DISABLED and sub-environments {pending} ended their episodes; "
                "reset them first, e.g. reset(options={'reset_mask': mask})",
                pending,
            )
        if (  # the common case, checked without the general walk (shape None: not one leaf)
            type(actions) is np.ndarray
            and actions.shape == self._action_shape
            and actions.dtype == self._action_dtype
        ):
            self._stage_actions(actions)
            return
        out = self._backend.batch.actions
        leaves: list[tuple[np.ndarray | None, Any]] = []
        check_actions(self.single_action_space, out, actions, "actions", leaves, self.num_envs)
        # Each env gets its row in the caller's dtype, as gymnasium's vector envs hand it
        # (iterate over the caller's batch): a leaf whose dtype differs from the buffer's
        # travels with the step command, beside the buffer's cast copy; so do the leaves
        # without a fixed size.
        for target, value in leaves:
            if target is not None:
                target[...] = value
        self._stage_actions(None)
        travel = caller_leaves(self.single_action_space, out, actions)
        if travel is not None:
            self._step_payloads = {
                w: [None if v is None else v[start:stop] for v in travel]
                for w, (start, stop) in enumerate(self._backend.ranges)
            }

    def _stage_actions(self, actions: np.ndarray | None) -> None:
        """Write ``actions``, an array of the action buffer's own shape and dtype (the one
        leaf: the assignment casts nothing; ``None``: already written), for a step of every
        group with no payload, and pick the step's observation slab."""
        if actions is not None:
            self._backend.batch.actions[...] = actions
        self._step_payloads = self._every_group
        if self._outputs.slabs is not None:
            self._outputs.pick_slab(True, self.copy)

    def step_wait(
        self, timeout: float | None = None
    ) -> tuple[Any, np.ndarray, np.ndarray, np.ndarray, dict[str, Any]]:
        """Wait for :meth:`step_async`; ``timeout`` in seconds (default ``step_timeout``). A
        worker late for a ``timeout`` given here raises, as gymnasium's ``AsyncVectorEnv``
        raises, whatever the restart policy (which restarts workers past ``step_timeout``).

        Raises:
            NoAsyncCallError: no step is pending.
            EnvError: an env raised in step or its autoreset; this batch is lost, the other
                envs did step, and the vector env stays usable.
            EnvCrashedError: a worker died; the vector env is closed.
            StepTimeoutError: the timeout expired; the vector env is closed (as
                :meth:`reset_wait`).

        With a ``restart_policy``, those failures rebuild what failed instead, within the
        policy's budget, and the step returns every env's result (see
        :class:`envfleet.RestartPolicy`); past the budget they raise as above.

        Ctrl-C (``KeyboardInterrupt``) while it waits completes the step, then raises: the
        vector env stays usable and the next step goes on from the completed one (see
        docs/concepts/supervision.md).
        """
        try:
            results = self._wait(AsyncState.WAITING_STEP, "step_wait", timeout)
        except BaseException as exc:
            self._interrupted_step(exc)
            raise
        return self._step_outputs(results)

    def _step_outputs(
        self, results: dict[int, Any] | None
    ) -> tuple[Any, np.ndarray, np.ndarray, np.ndarray, dict[str, Any]]:
        """A finished step's results, as step_wait returns them; ``results`` ``None``:
        ``backend.step_round``'s "every env stepped, no info"."""
        self._steps += 1
        batch = self._backend.batch
        if results is None:
            if self._copy_rows:  # the plain step's answer (_plan_plain_step)
                return (
                    batch.observations.copy(),
                    batch.rewards.copy(),
                    batch.terminations.copy(),
                    batch.truncations.copy(),
                    {},
                )
            results = {}
        outputs = self._outputs
        if outputs.side_spaces or self.unbatched_infos or any(results.values()):
            infos = self._infos(results)
        else:
            infos = {}  # no env had an info (the common case): vector_infos's answer
        if self.autoreset_mode is _DISABLED:
            np.logical_or(batch.terminations, batch.truncations, out=self._needs_reset)
        if self.copy:
            return (
                outputs.observations(True),
                batch.rewards.copy(),
                batch.terminations.copy(),
                batch.truncations.copy(),
                infos,
            )
        obs = outputs.observations(False) if outputs.side_spaces else batch.observations
        return obs, batch.rewards, batch.terminations, batch.truncations, infos

    # -- the first-ready pool (EnvPool's interface; _front/pool.py) -------------------------

    def async_reset(
        self, seed: int | Sequence[int | None] | None = None, env_ids: Any = None
    ) -> None:
        """Reset envs without waiting; :meth:`recv` returns them as they finish (EnvPool's
        ``async_reset``; ``env_ids`` adds partial resets, as EnvPool's ``reset(env_id)``).

        Args:
            seed: ``None``, an int (env i gets ``seed + i``) or one seed per env reset.
            env_ids: ``None``: every env; results of envs that finished but were not received
                are dropped. Else the envs to reset (distinct ints), each awaiting an action
                and held by a worker with none of its envs running.

        Raises:
            PoolStateError: envs are still running (recv them first), an env of ``env_ids``
                is not awaiting an action, or a synchronous call is pending.
            InvalidArgumentError: bad seeds or env ids. Nothing is sent on any error.
        """
        self._assert_pool_idle("async_reset")
        self._pool.async_reset(seed, env_ids, self._submit)

    def send(self, actions: Any, env_ids: Any = None) -> None:
        """Send actions to some envs without waiting (EnvPool's ``send``).

        Args:
            actions: batched actions for ``env_ids``: ``[len(env_ids), *shape]`` per leaf of the
                action space, converted to its dtype (same-kind casting), as EnvPool's action
                buffers convert them (a synchronous ``step`` hands the caller's dtype instead).
            env_ids: distinct env indices (int array-like); ``None``: every env, as EnvPool.
                Each must be awaiting an action: returned by :meth:`recv` and not yet sent one.
                A worker steps once every env it holds has its action.

        Raises:
            InvalidArgumentError: an unknown or repeated env id, or no env id.
            InvalidActionError: actions of the wrong structure, shape or dtype.
            PoolStateError: an env not awaiting an action, no :meth:`async_reset` yet, or a
                synchronous call pending. Nothing is sent when anything is wrong.
        """
        if self.closed or self._state is not _NO_CALL:
            self._assert_pool_idle("send")
        self._pool.send(actions, env_ids, self._submit)

    def recv(
        self, timeout: float | None = None
    ) -> tuple[Any, np.ndarray, np.ndarray, np.ndarray, dict[str, Any]]:
        """The results of the first ``batch_size`` envs to finish (EnvPool's ``recv``).

        Envs come in the order they finished (a worker's envs in index order). Each returned
        env then awaits its next action.

        Args:
            timeout: seconds each env may take from the :meth:`send` (or
                :meth:`async_reset`) that started it. ``None`` (the default) takes the vector
                env's ``step_timeout`` (``Supervision(step_timeout=...)``), so the wait is unbounded
                only when ``step_timeout`` is ``None`` too (``make``'s default); with a
                ``step_timeout`` set, ``recv`` has no unbounded form, and a longer wait passes
                a larger number. An env past it raises :class:`StepTimeoutError` even while
                others keep finishing.

        Returns:
            (observations ``[batch_size, *shape]``, rewards ``float64[batch_size]``,
            terminations ``bool[batch_size]``, truncations ``bool[batch_size]``, infos): infos
            in gymnasium's convention over the batch, plus ``info["env_id"]``
            (``int32[batch_size]``), as EnvPool. Observations are one indexed copy; with
            ``copy=False`` and envs that form one ascending run they are views of the shared
            buffer, valid until the next call.

        Raises:
            PoolStateError: fewer than ``batch_size`` envs running or ready, or no
                :meth:`async_reset` yet.
            EnvError: an env raised; its block of envs awaits actions again, results of other
                envs that finished are kept for the next :meth:`recv`.
            EnvCrashedError, StepTimeoutError: a worker died, or nothing finished in time;
                the vector env is closed.
        """
        if self.closed or self._state is not _NO_CALL:
            self._assert_pool_idle("recv")
        results = self._from_pool(
            self._pool.recv, self.step_timeout if timeout is None else timeout
        )
        self._steps += 1
        return results

    def _from_pool(self, call: Callable[[float | None, int], Any], timeout: float | None) -> Any:
        """``call(timeout, steps)`` on the pool; the vector env is closed if the backend
        is when it raises."""
        try:
            return call(timeout, self._steps)
        except BaseException:
            # A crash, a timeout or an interrupt may have shut the backend down.
            self.closed = self._backend.closed
            raise

    def _assert_pool_idle(self, name: str) -> None:
        self._assert_running()
        if self._state is not AsyncState.DEFAULT:
            raise PoolStateError(
                f"calling `{name}` while a call to `{self._state.value}` is pending"
            )

    # -- call, attributes, render ----------------------------------------------------------

    def call(self, name: str, *args: Any, **kwargs: Any) -> tuple[Any, ...]:
        """Call ``name`` on every sub-environment (its value when not callable).

        Follows gymnasium's ``SyncVectorEnv.call``: ``env.get_wrapper_attr(name)``, called
        with ``args``/``kwargs`` when callable. Returns a tuple with one result per env.

        Raises:
            EnvError: an env raised (e.g. ``AttributeError`` for a missing attribute).
        """
        self.call_async(name, *args, **kwargs)
        return self.call_wait()

    def call_async(self, name: str, *args: Any, **kwargs: Any) -> None:
        """Start :meth:`call`; collect it with :meth:`call_wait`."""
        self._assert_idle("call_async")
        check_name(name)
        request = CallRequest(name, args, kwargs)
        self._submit_async(Command.CALL, dict.fromkeys(self._every_group, request))
        self._state = AsyncState.WAITING_CALL

    def call_wait(self, timeout: float | None = None) -> tuple[Any, ...]:
        """Wait for :meth:`call_async`; returns one result per env, in env order.

        Raises:
            EnvError: an env raised. StepTimeoutError: as :meth:`reset_wait`.
        """
        results = self._wait(AsyncState.WAITING_CALL, "call_wait", timeout)
        return tuple(value for w in sorted(results) for value in results[w])

    def snapshot(self) -> Snapshot:
        """The vector env's state now, between two steps: ``envfleet.make(..., resume=state)``
        continues exactly from it (see :class:`envfleet.Snapshot`). An envfleet addition, as
        asked of gymnasium since 2022 (Gymnasium #94).

        Each env's episode so far comes from its action log (``Supervision(replay_steps=)``), read
        in its worker. A first-ready pool first lets every env sent an action finish: the
        snapshot holds the results waiting for ``recv`` (in the order ``recv`` returns
        them) and the actions sent to envs whose worker has not stepped yet; a pool resumed
        from it returns them first. Example::

            state = envs.snapshot()
            state.save("run.snapshot")
            ...  # later, in another process, on any backend and worker count:
            envs = envfleet.make("CartPole-v1", 16, resume=envfleet.Snapshot.load("run.snapshot"))
            envs.step(actions)  # what the first vector env's next step would have returned

        Raises:
            UnsupportedError: ``replay_steps=0``; an env whose episode is longer than
                ``replay_steps`` and whose state cannot be checkpointed (it does not pickle:
                Box2D's; every other env is checkpointed as it goes, so a snapshot works at
                any step); a pool whose spaces have leaves without a fixed size.
            AlreadyPendingCallError, PoolStateError: a call is pending.
            EnvError, EnvCrashedError, StepTimeoutError: a pool's env failed while finishing
                its step (as :meth:`recv`).
        """
        pool = None
        if self.is_pool or self._pool.started:
            self._assert_pool_idle("snapshot")
            # Every env sent an action finishes first: its result waits for recv().
            pool = self._from_pool(self._pool.take, self.step_timeout)
        else:
            self._assert_idle("snapshot")
        for _ in range(3):
            self.run_in_workers_async(group_recordings, dict.fromkeys(self._every_group))
            results = self.run_in_workers_wait()
            # A worker that died meanwhile, rebuilt by a restart policy, answers with its
            # restarted envs' infos instead: ask again, their new episodes are recorded.
            answered = all(_recordings(result) for result in results.values())
            if answered:
                break
        if not answered:
            raise UnsupportedError("snapshot(): workers died each of 3 times it asked them")
        recordings = [r for w in sorted(results) for r in results[w]]
        if len(recordings) != self.num_envs:
            raise UnsupportedError("snapshot() needs the envs' action logs: replay_steps > 0")
        for r in recordings:
            if not r.complete:
                raise UnsupportedError(
                    f"snapshot() cannot take sub-environment {r.env_index}: {r.why} (raise "
                    "make()'s replay_steps, or snapshot between episodes)"
                )
        batch = self._backend.batch
        return Snapshot(
            self.num_envs,
            self.autoreset_mode.value,
            recordings,
            np.logical_or(batch.terminations, batch.truncations).tolist(),
            self._steps,
            list(self._backend.ledger.seeds),
            pool,
        )

    def resume(self, state: Snapshot) -> None:
        """Bring every env to where ``state`` (:meth:`snapshot`) left it: the next
        :meth:`step` continues that run. ``envfleet.make(..., resume=state)`` calls it.

        Raises:
            ConfigError: ``state`` is not a :class:`envfleet.Snapshot`, or of another number
                of envs or autoreset mode; a pool's snapshot with results waiting for
                ``recv`` into a synchronous vector env.
        """
        Snapshot.check(state, self.num_envs, self.autoreset_mode.value, self.is_pool)
        self._assert_idle("resume")
        arguments = {
            w: (state.recordings[start:stop], state.done[start:stop])
            for w, (start, stop) in enumerate(self._backend.ranges)
        }
        self.run_in_workers_async(restore_envs, arguments)
        self.run_in_workers_wait()
        self._steps = state.steps
        self._needs_reset[:] = state.done if self.autoreset_mode is _DISABLED else False
        self._backend.ledger.seeds[:] = state.seeds
        if self.is_pool or state.pool is not None:
            self._pool.restore(state.pool, self._submit)

    def apply(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[Any, ...]:
        """Call ``function(env, *args, **kwargs)`` on every sub-environment, where it lives.

        An envfleet addition to gymnasium's API (:meth:`call` takes only a method name): the
        function is cloudpickled, so a lambda or closure works with every backend, and runs
        in the worker that holds the env (each env sees its own copy of the function). It is
        how :meth:`envfleet.Sampler.update_envs` changes a task parameter inside the workers.

        Returns:
            One result per env, in env order (results are pickled back from workers).

        Raises:
            InvalidArgumentError: ``function`` is not callable or cannot be pickled.
            EnvError: the function raised for an env (its exception chained as ``__cause__``).
        """
        if not callable(function):
            raise InvalidArgumentError(f"apply() needs a callable, got {function!r}")
        try:
            blob = cloudpickle.dumps(function)
        except Exception as exc:
            raise InvalidArgumentError(f"apply() could not pickle {function!r}: {exc}") from exc
        name = getattr(function, "__qualname__", type(function).__name__)
        self._assert_idle("apply")
        request = CallRequest(f"apply({name})", args, kwargs, function=blob)
        self._submit(Command.CALL, dict.fromkeys(self._every_group, request))
        self._state = AsyncState.WAITING_CALL
        return self.call_wait()

    def run_in_workers_async(
        self, function: Callable[[Any, Any], Any], arguments: Mapping[int, Any]
    ) -> None:
        """Start ``function(group, arguments[w])`` in each worker ``w`` named in ``arguments``,
        where its envs live; collect the results with :meth:`run_in_workers_wait`.

        Not part of envfleet's public API, though its name has no underscore: envfleet's own
        code is its only user (the :class:`envfleet.Sampler`'s worker inference, snapshots),
        the ``group`` it hands the function is a private class, and it may change without
        notice; the API reference leaves it out. ``group`` is the worker's ``EnvGroup``,
        which owns the envs ``worker_ranges[w]`` and their rows of the buffers and steps them
        with the same loop as :meth:`step`. The worker is watched as in a step: a crash, a
        hang past the timeout or an env's exception is reported with the usual typed errors.

        Args:
            function: a module-level function (pickled by reference for worker processes).
            arguments: worker index -> its argument (pickled for worker processes).

        Raises:
            InvalidArgumentError: a worker index outside ``range(len(worker_ranges))``.
            AlreadyPendingCallError: another call is pending.
        """
        self._assert_idle("run_in_workers_async")
        workers = range(len(self._backend.ranges))
        if not arguments or any(w not in workers for w in arguments):
            raise InvalidArgumentError(
                f"run_in_workers needs worker indices in {workers}, got {sorted(arguments)}"
            )
        payloads = {w: TaskRequest(function, argument) for w, argument in arguments.items()}
        self._submit_async(Command.TASK, payloads)
        self._state = AsyncState.WAITING_CALL

    def run_in_workers_wait(self, timeout: float | None = None) -> dict[int, Any]:
        """Wait for :meth:`run_in_workers_async`: worker index -> what its function returned.
        Not part of the public API, as :meth:`run_in_workers_async`.

        Raises:
            NoAsyncCallError: nothing was started. EnvError: an env (or the function) raised.
            EnvCrashedError: a worker died. StepTimeoutError: past ``timeout`` seconds
            (default: ``step_timeout``); the vector env is then closed.
        """
        return self._wait(AsyncState.WAITING_CALL, "run_in_workers_wait", timeout)

    @property
    def worker_ranges(self) -> tuple[tuple[int, int], ...]:
        """Per worker, the ``[start, stop)`` env indices it holds, in worker order."""
        return tuple((int(start), int(stop)) for start, stop in self._backend.ranges)

    def get_attr(self, name: str) -> tuple[Any, ...]:
        """The attribute ``name`` of every sub-environment (gymnasium's ``get_attr``)."""
        return self.call(name)

    def set_attr(self, name: str, values: Any) -> None:
        """Set attribute ``name`` on every sub-environment.

        Args:
            values: a list or tuple with one value per env, or one value for all envs.

        Raises:
            InvalidArgumentError: a list or tuple whose length is not ``num_envs``.
            EnvError: an env raised while setting it.
        """
        self._assert_idle("set_attr")
        check_name(name)
        if not isinstance(values, (list, tuple)):
            values = [values] * self.num_envs
        if len(values) != self.num_envs:
            raise InvalidArgumentError(
                "values must be a list or tuple with length equal to the number of environments. "
                f"Got `{len(values)}` values for {self.num_envs} environments."
            )
        payloads = {
            w: SetAttrRequest(name, list(values[start:stop]))
            for w, (start, stop) in enumerate(self._backend.ranges)
        }
        self._submit(Command.SET_ATTR, payloads)
        self._state = AsyncState.WAITING_CALL
        self._wait(AsyncState.WAITING_CALL, "set_attr", None)

    def render(self) -> tuple[Any, ...]:
        """``env.render()`` of every sub-environment, in env order (gymnasium's SyncVectorEnv)."""
        self._assert_idle("render")
        self._submit(Command.RENDER, self._every_group)
        self._state = AsyncState.WAITING_CALL
        results = self._wait(AsyncState.WAITING_CALL, "render", None)
        return tuple(frame for w in sorted(results) for frame in results[w])

    @property
    def stats(self) -> FleetStats:
        """What the supervisor has seen: restarts, timeouts, crashes, env errors, and per
        worker its step-time statistics (mean, p50, p99 in seconds). A snapshot, read without
        a round trip to the workers, at any time (also while a step is pending)."""
        return self._backend.ledger.snapshot(
            self._backend.step_times(), self._backend.worker_memory()
        )

    @property
    def np_random_seed(self) -> tuple[int, ...]:  # type: ignore[override]
        """The ``np_random_seed`` of every sub-environment (as gymnasium's SyncVectorEnv)."""
        return self.get_attr("np_random_seed")

    @property  # type: ignore[misc]
    def np_random(self) -> tuple[np.random.Generator, ...]:  # type: ignore[override]
        """The ``np_random`` generator of every sub-environment (as gymnasium's SyncVectorEnv)."""
        return self.get_attr("np_random")

    # -- close -----------------------------------------------------------------------------

    def close_extras(self, timeout: float | None = None, terminate: bool = False) -> None:
        """Close the sub-environments and release workers and shared memory.

        Args:
            timeout: seconds the envs get to close before their workers are terminated, then
                killed; ``None``: a default of a few seconds. Always bounded.
            terminate: ``True``: terminate the workers at once without closing the envs.

        Warns:
            UserWarning: a call is pending (gymnasium's AsyncVectorEnv text); without
                ``terminate`` it is waited for (within ``timeout``) and its result dropped.
        """
        if self._state is not AsyncState.DEFAULT:
            # gymnasium's AsyncVectorEnv.close_extras: the same text, through its logger (a
            # UserWarning), terminating or not.
            gymnasium.logger.warn(
                f"Calling `close` while waiting for a pending call to `{self._state.value}` "
                "to complete."
            )
        self._backend.ledger.closing = True  # nothing is restarted on the way out
        if self._state is not AsyncState.DEFAULT and not terminate:
            try:
                self._wait(self._state, "close", timeout if timeout is not None else 5.0)
            except Exception:  # the vector env is going away; the pending result is dropped
                terminate = True
        self._state = AsyncState.DEFAULT
        self._deferred = None
        terminate = self._pool.finish(timeout, terminate, self._steps)  # envs sent actions
        self._backend.close(timeout, terminate)

    def _disown(self) -> None:
        """See :func:`_disown_after_fork`: in a forked child only."""
        backend = self._backend
        if isinstance(backend, DisownedBackend):
            return
        with contextlib.suppress(Exception):
            backend.disown()
        self._backend = cast(Backend, DisownedBackend(self._owner_pid))
        # What held the maker's backend: the pool, and the step paths bound to it.
        self._pool.backend = self._backend
        self._native_step = self._step_round = None

    def __enter__(self) -> FleetVectorEnv:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        """Close on leaving a ``with`` block (terminating the workers if it raised)."""
        self.close(terminate=exc_info[0] is not None)

    def __del__(self) -> None:
        if not getattr(self, "closed", True) and hasattr(self, "_backend"):
            with contextlib.suppress(Exception):
                self.close(terminate=True)

    def __repr__(self) -> str:
        return (
            f"FleetVectorEnv(backend={self.backend!r}, num_envs={self.num_envs}, "
            f"num_workers={self.num_workers})"
        )

    # -- helpers ---------------------------------------------------------------------------

    def _assert_running(self) -> None:
        if self.closed:
            raise ClosedEnvironmentError(
                f"Trying to operate on `{type(self).__name__}`, after a call to `close()`."
            )

    def _assert_idle(self, name: str) -> None:
        self._assert_running()
        if self.is_pool or (self._pool.started and self._pool.env_state.any()):
            self._pool.assert_no_pool(name)
        if self._state is not AsyncState.DEFAULT:
            raise AlreadyPendingCallError(
                f"Calling `{name}` while waiting for a pending call to "
                f"`{self._state.value}` to complete",
                str(self._state.value),
            )

    def _submit(self, command: Command, payloads: dict[int, Any]) -> None:
        try:
            self._backend.submit(command, payloads, self._steps)
        except BaseException:
            # A crashed worker or an interrupt may have shut the backend down.
            self.closed = self._backend.closed
            raise

    def _submit_async(self, command: Command, payloads: dict[int, Any]) -> None:
        """Submit what runs elsewhere now; what the backend would run here, in the calling
        thread (its ``inline``), waits for :meth:`_wait`, so ``*_async`` returns at once
        and the wait's timeout counts it (as gymnasium's AsyncVectorEnv, whose ``*_async``
        only sends)."""
        inline = self._backend.inline(command)
        later = {w: p for w, p in payloads.items() if w in inline}
        now = {w: p for w, p in payloads.items() if w not in inline}
        if now or not later:
            self._submit(command, now)
        self._deferred = (command, later) if later else None

    def _wait(self, expected: AsyncState, name: str, timeout: float | None) -> dict[int, Any]:
        self._assert_running()
        if self._state is not expected:
            raise NoAsyncCallError(
                f"Calling `{name}` without any prior call to `{expected.value}_async`.",
                expected.value,
            )
        explicit = timeout
        if timeout is None:
            timeout = self.step_timeout
        deferred, self._deferred = self._deferred, None
        ledger = self._backend.ledger
        ledger.wait_bound = explicit is not None  # its timeout raises, as gymnasium's
        try:
            if deferred is None:
                return self._backend.collect(timeout, self._steps)
            # The groups left for the wait run here, to the end: no timeout can stop them (one
            # that ran past the wait's own timeout is raised once they are done).
            return self._backend.finish(*deferred, timeout, self._steps, explicit)
        except BaseException:
            # A crash, a timeout or an interrupt may have shut the backend down.
            self.closed = self._backend.closed
            raise
        finally:
            ledger.wait_bound = False
            self._state = AsyncState.DEFAULT

    def _infos(self, results: dict[int, Any]) -> dict[str, Any]:
        if self._outputs.side_spaces:
            results = self._outputs.take_side(results)
        if self.unbatched_infos:
            return one_env_info(results)  # envfleet.ProcessEnv: the one env's own info dict
        return vector_infos(results, self.num_envs)


def _recordings(result: Any) -> bool:
    """Whether a worker's answer to ``group_recordings`` is its envs' recordings."""
    return isinstance(result, list) and all(isinstance(r, EnvRecording) for r in result)
