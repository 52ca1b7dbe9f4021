"""The first-ready pool (EnvPool's asynchronous interface) of the front: ``async_reset``,
``send`` and ``recv`` with each env's state (idle: awaiting an action; running; ready: its
result waits for ``recv``). A mixin of :class:`envfleet.FleetVectorEnv`, so a pool is a
vector env with every method of one; :func:`envfleet.make` builds a pool for
``batch_size < num_envs``.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import gymnasium
import numpy as np
from gymnasium.vector.async_vector_env import AsyncState
from gymnasium.vector.utils import create_empty_array

from envfleet._backends.base import Backend
from envfleet._core.buffers import fixed_leaf_flags, fixed_part
from envfleet._core.errors import EnvError, InvalidArgumentError, PoolStateError
from envfleet._core.infos import batch_infos
from envfleet._core.protocol import Command, ResetRequest
from envfleet._core.trees import tree_scatter, tree_slice, tree_take
from envfleet._front.checks import check_actions, check_env_ids, seeds_per_env
from envfleet._front.results import ResultBuffers

__all__ = ["IDLE", "READY", "RUNNING", "FirstReadyPool"]

IDLE, RUNNING, READY = 0, 1, 2  # an env's state in the pool


class FirstReadyPool:
    """The pool's calls and state, mixed into :class:`envfleet.FleetVectorEnv` (which gives
    the attributes and helpers declared below)."""

    _backend: Backend
    _outputs: ResultBuffers
    _state: AsyncState
    _steps: int
    _action_leaf: bool
    _side_actions: bool
    num_envs: int
    copy: bool
    closed: bool
    step_timeout: float | None
    single_action_space: gymnasium.Space[Any]

    if TYPE_CHECKING:

        def _assert_running(self) -> None: ...
        def _submit(self, command: Command, payloads: dict[int, Any]) -> None: ...

    def _init_pool(self, batch_size: int | None) -> None:
        """Every env idle; ``batch_size`` envs per recv (``None``: every env)."""
        self.batch_size = self.num_envs if batch_size is None else batch_size
        self.is_pool = self.batch_size < self.num_envs
        self._env_state = np.zeros(self.num_envs, dtype=np.int8)
        self._has_action = np.zeros(self.num_envs, dtype=np.bool_)
        # Ready envs queue in the order they finished, with their infos.
        self._ready: collections.deque[int] = collections.deque()
        self._ready_infos: dict[int, list[dict[str, Any]]] = {}
        self._pool_started = False
        self._in_flight: dict[int, np.ndarray] = {}  # worker -> its envs in its pending command
        ranges = self._backend.ranges
        sizes = [stop - start for start, stop in ranges]
        self._group_of = np.repeat(np.arange(len(ranges)), sizes)
        self._group_of_list: list[int] = self._group_of.tolist()
        self._group_sizes = np.array(sizes)
        # Per group, its envs (shared by every command sent to it; never written).
        self._group_envs = [np.arange(start, stop) for start, stop in ranges]
        for envs in self._group_envs:
            envs.flags.writeable = False
        # Action leaves without a fixed size: per env, its values until its worker steps.
        self._pool_side_actions: list[list[Any]] = [[] for _ in range(self.num_envs)]
        self._fixed_leaves = fixed_leaf_flags(self.single_action_space)

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
        ids = check_env_ids(env_ids, self.num_envs)
        self._outputs.drop_slabs()
        mask = np.zeros(self.num_envs, dtype=np.bool_)
        mask[ids] = True
        groups = [w for w, (a, b) in enumerate(self._backend.ranges) if mask[a:b].any()]
        in_groups = np.isin(self._group_of, groups)
        running = np.flatnonzero(in_groups & (self._env_state == RUNNING)).tolist()
        if running:
            raise PoolStateError(
                f"sub-environments {running} are still running; recv() their results before "
                "async_reset()",
                running,
            )
        if env_ids is not None:
            busy = np.flatnonzero(mask & ((self._env_state != IDLE) | self._has_action))
            if busy.size:
                raise PoolStateError(
                    f"sub-environments {busy.tolist()} are not awaiting an action (a result "
                    "not received yet, or an action already sent); only those can be reset",
                    busy.tolist(),
                )
        if env_ids is not None and isinstance(seed, Sequence) and not isinstance(seed, str):
            if len(seed) != len(ids):
                raise InvalidArgumentError(
                    f"got {len(seed)} seeds for {len(ids)} env ids; give one seed per env id"
                )
            seeds: list[int | None] = [None] * self.num_envs
            for e, s_ in zip(ids.tolist(), seed, strict=True):
                seeds[e] = s_
        else:
            seeds = seeds_per_env(seed, self.num_envs)
        payloads = {}
        for w in groups:
            start, stop = self._backend.ranges[w]
            local = None if env_ids is None else mask[start:stop]
            payloads[w] = ResetRequest(seeds[start:stop], None, local)
            self._backend.ledger.note_seeds(start, seeds[start:stop], local)
            self._in_flight[w] = np.flatnonzero(mask[start:stop]) + start
        if env_ids is None:
            self._ready.clear()
            self._ready_infos.clear()
            self._has_action[:] = False
        self._submit(Command.RESET, payloads)
        self._env_state[mask] = RUNNING
        self._pool_started = True

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
        self._assert_pool_idle("send")
        if not self._pool_started:
            raise PoolStateError("call async_reset() before send()")
        ids = check_env_ids(env_ids, self.num_envs)
        state = self._env_state[ids]
        if state.any() or self._has_action[ids].any():
            bad = [int(e) for e in ids[(state != 0) | self._has_action[ids]]]
            e = bad[0]
            why = (
                "is still running"
                if self._env_state[e] == RUNNING
                else "has a result not received yet (recv() it first)"
                if self._env_state[e] == READY
                else "was already sent an action"
            )
            raise PoolStateError(
                f"sub-environments {bad} are not awaiting an action: sub-environment {e} {why}",
                bad,
            )
        n = len(ids)
        if (
            self._action_leaf
            and type(actions) is np.ndarray
            and actions.shape == (n, *self._backend.batch.actions.shape[1:])
            and actions.dtype == self._backend.batch.actions.dtype
        ):
            self._backend.batch.actions[ids] = actions
        else:
            staged = create_empty_array(fixed_part(self.single_action_space), n)
            # Cast to the space's dtype, as EnvPool's action buffers do (the synchronous
            # step hands each env the caller's dtype instead, as gymnasium does).
            leaves: list[tuple[np.ndarray | None, Any]] = []
            check_actions(self.single_action_space, staged, actions, "actions", leaves, n)
            side = [value for target, value in leaves if target is None]
            for target, value in leaves:
                if target is not None:
                    target[...] = value
            tree_scatter(self._backend.batch.actions, ids, staged)
            for k, e in enumerate(ids.tolist()):  # leaves without a fixed size: per env
                self._pool_side_actions[e] = [values[k] for values in side]
        self._has_action[ids] = True
        self._outputs.drop_slabs()
        # The groups of ``ids`` whose every env now has its action: those step.
        group_of = self._group_of_list
        touched = {group_of[e] for e in ids.tolist()}
        sizes = self._group_sizes
        full = np.bincount(self._group_of[self._has_action], minlength=len(sizes)) == sizes
        payloads: dict[int, Any] = {}
        for w in sorted(touched):
            if full[w]:
                payloads[w] = None
                if self._side_actions:  # as EnvGroup.step's leaf_actions (None: the buffer)
                    start, stop = self._backend.ranges[w]
                    values = iter(zip(*self._pool_side_actions[start:stop], strict=True))
                    payloads[w] = [None if fixed else next(values) for fixed in self._fixed_leaves]
        if payloads:
            self._submit(Command.STEP, payloads)
            stepping = np.concatenate([self._group_envs[w] for w in payloads])
            self._env_state[stepping] = RUNNING
            self._has_action[stepping] = False
            for w in payloads:
                self._in_flight[w] = self._group_envs[w]

    def recv(
        self, timeout: float | None = None
    ) -> tuple[Any, np.ndarray, np.ndarray, np.ndarray, dict[str, Any]]:
        """The results of the first ``batch_size`` envs to finish (EnvPool's ``recv``).

        Envs come in the order they finished (a worker's envs in index order). Each returned
        env then awaits its next action.

        Args:
            timeout: seconds each env may take from the :meth:`send` (or
                :meth:`async_reset`) that started it (default ``step_timeout``; ``None``: no
                bound). An env past it raises :class:`StepTimeoutError` even while others
                keep finishing.

        Returns:
            (observations ``[batch_size, *shape]``, rewards ``float64[batch_size]``,
            terminations ``bool[batch_size]``, truncations ``bool[batch_size]``, infos): infos
            in gymnasium's convention over the batch, plus ``info["env_id"]``
            (``int32[batch_size]``), as EnvPool. Observations are one gather copy; with
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
        self._assert_pool_idle("recv")
        if not self._pool_started:
            raise PoolStateError("call async_reset() before recv()")
        need = self.batch_size
        in_flight = len(self._ready) + int(np.count_nonzero(self._env_state == RUNNING))
        if in_flight < need:
            raise PoolStateError(
                f"recv() returns {need} envs but only {in_flight} are running or ready; "
                "send() actions to more envs first"
            )
        if timeout is None:
            timeout = self.step_timeout
        ranges = self._backend.ranges
        while len(self._ready) < need:
            try:
                # The backend bounds each worker's time from its own send by ``timeout``.
                results = self._backend.collect_ready(timeout, self._steps)
            except EnvError as exc:
                if not self.is_pool:
                    # batch_size == num_envs: as for step(), the whole batch is lost and every
                    # env awaits an action again.
                    self._backend.drop_kept()
                    self._in_flight.clear()
                    self._ready.clear()
                    self._ready_infos.clear()
                    self._env_state[:] = IDLE
                    raise
                w = int(self._group_of[exc.env_index])
                self._env_state[self._in_flight.pop(w, np.arange(*ranges[w]))] = IDLE
                raise
            except BaseException:
                self.closed = self._backend.closed
                raise
            if self._outputs.side_spaces:
                results = self._outputs.take_side(results)
            if not results:
                continue
            flying, ready_infos = self._in_flight, self._ready_infos
            done = [flying.pop(w) for w in sorted(results)]
            envs = done[0] if len(done) == 1 else np.concatenate(done)
            self._env_state[envs] = READY
            self._ready.extend(envs.tolist())
            for events in results.values():  # an env's infos all come from its one worker
                for index, info in events or ():
                    ready_infos.setdefault(index, []).append(info)
        popleft = self._ready.popleft
        ids_list = [popleft() for _ in range(need)]
        ids = np.array(ids_list, dtype=np.int32)
        self._env_state[ids] = IDLE
        self._steps += 1
        batch = self._backend.batch
        first = ids_list[0]
        if not self.copy and ids_list == list(range(first, first + need)):  # one run: views
            obs = tree_slice(batch.observations, first, first + need)
        else:
            obs = tree_take(batch.observations, ids)
        if self._outputs.side_spaces:
            obs = self._outputs.fill_side(obs, ids_list, self.copy)
        # Row k of the batch is env ids[k]; an env may have several infos (a reset's, then a
        # step's), added in order.
        ready_infos = self._ready_infos
        events = (
            [(k, info) for k, e in enumerate(ids_list) for info in ready_infos.pop(e, ())]
            if ready_infos
            else []
        )
        infos = batch_infos(events, need)
        infos["env_id"] = ids
        return obs, batch.rewards[ids], batch.terminations[ids], batch.truncations[ids], infos

    def _assert_pool_idle(self, name: str) -> None:
        self._assert_running()
        if self._state is not AsyncState.DEFAULT:
            raise PoolStateError(
                f"calling `{name}` while a call to `{self._state.value}` is pending"
            )

    def _assert_no_pool(self, name: str) -> None:
        """Refuse a synchronous call that does not fit the pool's state (see PoolStateError)."""
        stepping = name in ("reset_async", "step_async")
        if stepping and self.is_pool:
            raise PoolStateError(
                f"`{name}` is not available on a first-ready pool (batch_size="
                f"{self.batch_size} < num_envs={self.num_envs}); use async_reset(), send() "
                "and recv()"
            )
        # Envs running after send() would answer this call's wait; a step or reset would
        # also overwrite the results of envs not yet received.
        busy = self._env_state == RUNNING
        if stepping:
            busy |= self._env_state == READY
        if busy.any():
            envs = np.flatnonzero(busy).tolist()
            raise PoolStateError(
                f"calling `{name}` while sub-environments {envs} are running or have results "
                "not received yet; recv() them first",
                envs,
            )

    def _finish_pool(self, timeout: float | None, terminate: bool) -> bool:
        """On close: let envs sent actions and not received finish (within ``timeout``);
        returns whether the workers must be terminated instead."""
        if (self._env_state == RUNNING).any() and not terminate:
            try:
                self._backend.collect(timeout if timeout is not None else 5.0, self._steps)
            except Exception:  # the vector env is going away; their results are dropped
                terminate = True
        self._env_state[:] = IDLE
        return terminate
