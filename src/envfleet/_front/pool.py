"""The first-ready pool (EnvPool's asynchronous interface) of the front: ``async_reset``,
``send`` and ``recv`` with each env's state (idle: awaiting an action; running; ready: its
result waits for ``recv``). :class:`FirstReadyPool` is a collaborator that
:class:`envfleet.FleetVectorEnv` holds: the vector env checks its own call state and counts
its steps, the pool keeps every env's state and runs the calls; :func:`envfleet.make` builds a
pool for ``batch_size < num_envs``.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import gymnasium
import numpy as np
from gymnasium.vector.utils import create_empty_array

from envfleet._backends.base import Backend, NativeBackend
from envfleet._core.buffers import fixed_leaf_flags, fixed_part, is_leaf, side_leaves
from envfleet._core.errors import (
    EnvError,
    InvalidArgumentError,
    PoolStateError,
    UnsupportedError,
)
from envfleet._core.infos import batch_infos
from envfleet._core.protocol import Command, ResetRequest
from envfleet._core.trees import tree_scatter, tree_slice, tree_take
from envfleet._front.checks import check_actions, check_gymnasium_ids, seeds_per_env
from envfleet._front.results import ResultBuffers

__all__ = ["IDLE", "READY", "RUNNING", "FirstReadyPool", "NativePool", "PoolState"]

IDLE, RUNNING, READY = 0, 1, 2  # an env's state in the pool

# The vector env's submit (FleetVectorEnv._submit): a command to the workers of ``payloads``.
Submit = Callable[[Command, dict[int, Any]], None]


@dataclass
class PoolState:
    """A first-ready pool's part of an :class:`envfleet.Snapshot`.

    Attributes:
        ready: the envs whose results wait for ``recv``, in the order it returns them.
        observations, rewards, terminations, truncations: their results (rows in that
            order).
        infos: per ready env, the infos that come with its result.
        sent: envs sent an action whose worker had not stepped yet (its other envs had
            none).
        actions: their actions (rows in that order).
    """

    ready: list[int]
    observations: Any
    rewards: np.ndarray
    terminations: np.ndarray
    truncations: np.ndarray
    infos: dict[int, list[dict[str, Any]]]
    sent: list[int]
    actions: Any


class FirstReadyPool:
    """Every env's state in the pool and the pool's calls, for one vector env.

    Args:
        backend: the vector env's backend (its ranges, batch, ledger, ``collect_ready``).
        outputs: the vector env's result buffers (spare slabs, leaves without a fixed size).
        single_action_space: the action space of one env.
        batch_size: envs per :meth:`recv` (``None``: every env; ``< num_envs``: a pool).
        copy: :meth:`recv` returns copies (else views where the envs form one run).

    Attributes:
        batch_size, is_pool: as the vector env's.
        started: :meth:`async_reset` was called.
        env_state: per env, ``IDLE``, ``RUNNING`` or ``READY`` (``int8[num_envs]``).
    """

    def __init__(
        self,
        backend: Backend,
        outputs: ResultBuffers,
        single_action_space: gymnasium.Space[Any],
        batch_size: int | None,
        copy: bool,
    ):
        self.backend = backend
        self.outputs = outputs
        self.single_action_space = single_action_space
        self.copy = copy
        self.num_envs = num_envs = int(backend.batch.rewards.shape[0])
        self.batch_size = num_envs if batch_size is None else batch_size
        self.is_pool = self.batch_size < num_envs
        self.env_state = np.zeros(num_envs, dtype=np.int8)
        self._has_action = np.zeros(num_envs, dtype=np.bool_)
        # Ready envs queue in the order they finished, with their infos.
        self._ready: collections.deque[int] = collections.deque()
        self._ready_infos: dict[int, list[dict[str, Any]]] = {}
        self.started = False
        self._in_flight: dict[int, np.ndarray] = {}  # worker -> its envs in its pending command
        ranges = backend.ranges
        sizes = [stop - start for start, stop in ranges]
        self._group_of = np.repeat(np.arange(len(ranges)), sizes)
        self._group_of_list: list[int] = self._group_of.tolist()
        self._group_sizes = np.array(sizes)
        # Every group one env (a hosted pool's default): env e is group e.
        self._one_env_groups = all(size == 1 for size in sizes)
        # Per group, its envs (shared by every command sent to it; never written).
        self._group_envs = [np.arange(start, stop) for start, stop in ranges]
        for envs in self._group_envs:
            envs.flags.writeable = False
        self._action_leaf = is_leaf(single_action_space)
        self._side_actions = bool(side_leaves(single_action_space))
        # Action leaves without a fixed size: per env, its values until its worker steps.
        self._pool_side_actions: list[list[Any]] = [[] for _ in range(num_envs)]
        self._fixed_leaves = fixed_leaf_flags(single_action_space)

    def async_reset(
        self, seed: int | Sequence[int | None] | None, env_ids: Any, submit: Submit
    ) -> None:
        """See :meth:`envfleet.FleetVectorEnv.async_reset` (``submit``: the vector env's)."""
        ids = check_gymnasium_ids(env_ids, self.num_envs)
        self.outputs.drop_slabs()
        mask = np.zeros(self.num_envs, dtype=np.bool_)
        mask[ids] = True
        groups = [w for w, (a, b) in enumerate(self.backend.ranges) if mask[a:b].any()]
        in_groups = np.isin(self._group_of, groups)
        running = np.flatnonzero(in_groups & (self.env_state == RUNNING)).tolist()
        if running:
            raise PoolStateError(
                f"sub-environments {running} are still running; recv() their results before "
                "async_reset()",
                running,
            )
        if env_ids is not None:
            busy = np.flatnonzero(mask & ((self.env_state != IDLE) | self._has_action))
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
            start, stop = self.backend.ranges[w]
            local = None if env_ids is None else mask[start:stop]
            payloads[w] = ResetRequest(seeds[start:stop], None, local)
            self.backend.ledger.note_seeds(start, seeds[start:stop], local)
            self._in_flight[w] = np.flatnonzero(mask[start:stop]) + start
        if env_ids is None:
            self._ready.clear()
            self._ready_infos.clear()
            self._has_action[:] = False
        submit(Command.RESET, payloads)
        self.env_state[mask] = RUNNING
        self.started = True

    def send(self, actions: Any, env_ids: Any, submit: Submit) -> None:
        """See :meth:`envfleet.FleetVectorEnv.send` (``submit``: the vector env's)."""
        if not self.started:
            raise PoolStateError("call async_reset() before send()")
        ids = check_gymnasium_ids(env_ids, self.num_envs)
        state = self.env_state[ids]
        if np.count_nonzero(state) or np.count_nonzero(self._has_action[ids]):
            bad = [int(e) for e in ids[(state != 0) | self._has_action[ids]]]
            e = bad[0]
            why = (
                "is still running"
                if self.env_state[e] == RUNNING
                else "has a result not received yet (recv() it first)"
                if self.env_state[e] == READY
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
            and actions.shape == (n, *self.backend.batch.actions.shape[1:])
            and actions.dtype == self.backend.batch.actions.dtype
        ):
            self.backend.batch.actions[ids] = actions
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
            tree_scatter(self.backend.batch.actions, ids, staged)
            for k, e in enumerate(ids.tolist()):  # leaves without a fixed size: per env
                self._pool_side_actions[e] = [values[k] for values in side]
        self._has_action[ids] = True
        self.outputs.drop_slabs()
        if self._one_env_groups and not self._side_actions:
            # Each env its own group: every env of ``ids`` steps now.
            envs = ids.tolist()
            submit(Command.STEP, dict.fromkeys(envs))
            self.env_state[ids] = RUNNING
            self._has_action[ids] = False
            flying, group_envs = self._in_flight, self._group_envs
            for e in envs:
                flying[e] = group_envs[e]
            return
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
                    start, stop = self.backend.ranges[w]
                    values = iter(zip(*self._pool_side_actions[start:stop], strict=True))
                    payloads[w] = [None if fixed else next(values) for fixed in self._fixed_leaves]
        if payloads:
            submit(Command.STEP, payloads)
            stepping = np.concatenate([self._group_envs[w] for w in payloads])
            self.env_state[stepping] = RUNNING
            self._has_action[stepping] = False
            for w in payloads:
                self._in_flight[w] = self._group_envs[w]

    def recv(
        self, timeout: float | None, steps: int
    ) -> tuple[Any, np.ndarray, np.ndarray, np.ndarray, dict[str, Any]]:
        """See :meth:`envfleet.FleetVectorEnv.recv`: the result of the vector env's ``steps``-th
        step; ``timeout``: each env's bound (seconds), ``None`` for none. The front passes its
        ``step_timeout`` here when ``recv`` is called with ``timeout=None``.

        Raises: as it, except that the vector env marks itself closed."""
        if not self.started:
            raise PoolStateError("call async_reset() before recv()")
        need = self.batch_size
        ready = self._ready
        if len(ready) < need:
            in_flight = len(ready) + int(np.count_nonzero(self.env_state == RUNNING))
            if in_flight < need:
                raise PoolStateError(
                    f"recv() returns {need} envs but only {in_flight} are running or ready; "
                    "send() actions to more envs first"
                )
            while len(ready) < need:
                self._collect(timeout, steps)
        if len(ready) == need:  # the common case: take the whole queue at once
            ids_list = list(ready)
            ready.clear()
        else:
            popleft = ready.popleft
            ids_list = [popleft() for _ in range(need)]
        ids = np.array(ids_list, dtype=np.int32)
        self.env_state[ids] = IDLE
        batch = self.backend.batch
        first = ids_list[0]
        if not self.copy and ids_list == list(range(first, first + need)):  # one run: views
            obs = tree_slice(batch.observations, first, first + need)
        else:
            obs = tree_take(batch.observations, ids)
        if self.outputs.side_spaces:
            obs = self.outputs.fill_side(obs, ids_list, self.copy)
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

    def _collect(self, timeout: float | None, steps: int) -> None:
        """Wait for the next envs to finish and queue them as ready, with their infos.

        Raises: as :meth:`recv`."""
        ranges = self.backend.ranges
        try:
            # The backend bounds each worker's time from its own send by ``timeout``.
            results = self.backend.collect_ready(timeout, steps)
        except EnvError as exc:
            if not self.is_pool:
                # batch_size == num_envs: as for step(), the whole batch is lost and every
                # env awaits an action again.
                self.backend.drop_kept()
                self._in_flight.clear()
                self._ready.clear()
                self._ready_infos.clear()
                self.env_state[:] = IDLE
                raise
            w = int(self._group_of[exc.env_index])
            self.env_state[self._in_flight.pop(w, np.arange(*ranges[w]))] = IDLE
            raise
        if self.outputs.side_spaces:
            results = self.outputs.take_side(results)
        if not results:
            return
        flying, ready_infos = self._in_flight, self._ready_infos
        if self._one_env_groups:  # env e is group e
            ready = sorted(results)
            for w in ready:
                del flying[w]
            self.env_state[ready] = READY
            self._ready.extend(ready)
        else:
            done = [flying.pop(w) for w in sorted(results)]
            envs = done[0] if len(done) == 1 else np.concatenate(done)
            self.env_state[envs] = READY
            self._ready.extend(envs.tolist())
        for events in results.values():  # an env's infos all come from its one worker
            for index, info in events or ():
                ready_infos.setdefault(index, []).append(info)

    # -- snapshots ---------------------------------------------------------------------------

    def take(self, timeout: float | None, steps: int) -> PoolState:
        """The pool's state for a snapshot, once every env sent an action has finished (its
        result queued for :meth:`recv`, as if the learner had waited for it).

        Raises:
            PoolStateError: no :meth:`async_reset` yet.
            UnsupportedError: spaces with leaves without a fixed size (their values live
                outside the rows a snapshot copies).
            EnvError, EnvCrashedError, StepTimeoutError: as :meth:`recv`, while they finish.
        """
        if not self.started:
            raise PoolStateError("call async_reset() before snapshot()")
        if self.outputs.side_spaces or self._side_actions:
            raise UnsupportedError(
                "snapshot() of a pool whose spaces have leaves without a fixed size"
            )
        while (self.env_state == RUNNING).any():
            self._collect(timeout, steps)
        batch = self.backend.batch
        ready = list(self._ready)
        rows = np.array(ready, dtype=np.int64)
        sent = np.flatnonzero(self._has_action)
        return PoolState(
            ready,
            tree_take(batch.observations, rows),
            batch.rewards[rows].copy(),
            batch.terminations[rows].copy(),
            batch.truncations[rows].copy(),
            {e: list(self._ready_infos.get(e, ())) for e in ready},
            sent.tolist(),
            tree_take(batch.actions, sent),
        )

    def restore(self, state: PoolState | None, submit: Submit) -> None:
        """Take over ``state`` (:meth:`take`; ``None``: a synchronous vector env's snapshot,
        every env awaiting an action) in a new pool whose envs were brought to where the
        snapshot's were: the ready envs' results are queued for :meth:`recv`, and the actions
        sent to envs whose worker had not stepped yet are sent again."""
        self.started = True
        self.env_state[:] = IDLE
        self._has_action[:] = False
        self._ready.clear()
        self._ready_infos.clear()
        if state is None:
            return
        batch = self.backend.batch
        rows = np.array(state.ready, dtype=np.int64)
        tree_scatter(batch.observations, rows, state.observations)
        batch.rewards[rows] = state.rewards
        batch.terminations[rows] = state.terminations
        batch.truncations[rows] = state.truncations
        self.env_state[rows] = READY
        self._ready.extend(state.ready)
        self._ready_infos.update({e: list(i) for e, i in state.infos.items() if i})
        if state.sent:
            self.send(state.actions, np.array(state.sent, dtype=np.int64), submit)

    def assert_no_pool(self, name: str) -> None:
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
        busy = self.env_state == RUNNING
        if stepping:
            busy |= self.env_state == READY
        if busy.any():
            envs = np.flatnonzero(busy).tolist()
            raise PoolStateError(
                f"calling `{name}` while sub-environments {envs} are running or have results "
                "not received yet; recv() them first",
                envs,
            )

    def finish(self, timeout: float | None, terminate: bool, steps: int) -> bool:
        """On close: let envs sent actions and not received finish (within ``timeout``);
        returns whether the workers must be terminated instead."""
        if (self.env_state == RUNNING).any() and not terminate:
            try:
                self.backend.collect(timeout if timeout is not None else 5.0, steps)
            except Exception:  # the vector env is going away; their results are dropped
                terminate = True
        self.env_state[:] = IDLE
        return terminate


class NativePool(FirstReadyPool):
    """The first-ready pool of a backend whose native library runs it
    (:class:`envfleet._backends.base.NativeBackend`: EnvPool's asynchronous mode):
    :meth:`send` and :meth:`recv` check what :class:`FirstReadyPool`'s do, then call the
    library at once. Every env is its own "worker" there and the library's ``recv`` returns
    exactly ``batch_size`` envs, so no env waits in a ready queue: an env is idle (awaiting an
    action) or running.
    """

    def __init__(
        self,
        backend: NativeBackend,
        outputs: ResultBuffers,
        single_action_space: gymnasium.Space[Any],
        batch_size: int | None,
        copy: bool,
    ):
        super().__init__(backend, outputs, single_action_space, batch_size, copy)
        self._running = 0  # envs sent an action (or reset) and not received
        actions = backend.batch.actions
        self._fast_actions = self._action_leaf and not self._side_actions
        self._action_row, self._action_dtype = actions.shape[1:], actions.dtype

    def async_reset(
        self, seed: int | Sequence[int | None] | None, env_ids: Any, submit: Submit
    ) -> None:
        """See :meth:`envfleet.FleetVectorEnv.async_reset`."""
        super().async_reset(seed, env_ids, submit)
        self._running = int(np.count_nonzero(self.env_state == RUNNING))

    def send(self, actions: Any, env_ids: Any, submit: Submit) -> None:
        """See :meth:`envfleet.FleetVectorEnv.send`; the checks and errors are
        :meth:`FirstReadyPool.send`'s (it raises them, nothing sent), the send the library's."""
        if not self.started:
            raise PoolStateError("call async_reset() before send()")
        n = self.num_envs
        state = self.env_state
        # The common case (EnvPool's own int32 env ids) in a few C calls: take() raises
        # IndexError for an id >= n, and for a negative one read as unsigned; count_nonzero
        # is a fraction of the cost of .any() or a ufunc reduction.
        ids = None
        if type(env_ids) is np.ndarray and env_ids.dtype == np.int32 and env_ids.ndim == 1:
            try:
                if env_ids.size and not np.count_nonzero(state.take(env_ids.view(np.uint32))):
                    ids = env_ids
            except IndexError:
                pass
        if ids is None:
            ids = check_gymnasium_ids(env_ids, n).astype(np.int32)
            if np.count_nonzero(state[ids]):
                super().send(actions, ids, submit)  # raises its PoolStateError
                raise AssertionError("unreachable: an env not awaiting an action was sent")
        count = len(ids)
        state.put(ids, RUNNING)
        # Envs are idle (0) or running (1) here: a repeated id counts once.
        if np.count_nonzero(state) != self._running + count:
            state.put(ids, IDLE)
            check_gymnasium_ids(ids, n)  # raises its InvalidArgumentError
            raise AssertionError("unreachable: repeated env ids passed check_gymnasium_ids")
        if not (
            self._fast_actions
            and type(actions) is np.ndarray
            and actions.dtype == self._action_dtype
            and actions.shape[1:] == self._action_row
            and actions.shape[0] == count
        ):
            try:
                actions = self._staged(actions, count)
            except BaseException:
                state.put(ids, IDLE)
                raise
        self._running += count
        cast(NativeBackend, self.backend).native_send(actions, ids)

    def _staged(self, actions: Any, count: int) -> Any:
        """``actions`` for ``count`` envs checked and converted to the space's dtype.

        Raises:
            InvalidActionError: as :meth:`FirstReadyPool.send`."""
        staged = create_empty_array(fixed_part(self.single_action_space), count)
        leaves: list[tuple[np.ndarray | None, Any]] = []
        check_actions(self.single_action_space, staged, actions, "actions", leaves, count)
        for target, value in leaves:
            if target is not None:
                target[...] = value
        return staged

    def recv(
        self, timeout: float | None, steps: int
    ) -> tuple[Any, np.ndarray, np.ndarray, np.ndarray, dict[str, Any]]:
        """See :meth:`envfleet.FleetVectorEnv.recv` (EnvPool's ``recv`` cannot be bounded:
        ``timeout`` is not used)."""
        if not self.started:
            raise PoolStateError("call async_reset() before recv()")
        need = self.batch_size
        if self._running < need:
            raise PoolStateError(
                f"recv() returns {need} envs but only {self._running} are running or ready; "
                "send() actions to more envs first"
            )
        results = cast(NativeBackend, self.backend).native_recv(self.copy)
        self.env_state.put(results[4]["env_id"], IDLE)
        self._running -= need
        return results

    def take(self, timeout: float | None, steps: int) -> PoolState:
        """Refused: the native library's envs cannot be recorded (no snapshot)."""
        raise UnsupportedError(
            "snapshot() is not available on backend='envpool': EnvPool's envs are native, "
            "with no Python env objects to record"
        )
