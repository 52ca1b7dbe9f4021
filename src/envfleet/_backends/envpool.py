"""``backend="envpool"``: EnvPool's native (C++) tasks behind the same front and contract.

EnvPool (https://envpool.readthedocs.io) steps its own C++ implementations of many tasks
(``envpool.list_all_envs()``: ``"CartPole-v1"``, ``"Pendulum-v1"``, ``"Pong-v5"``, ...) on a
pool of native threads. This backend drives one ``envpool.make(task_id, env_type="gymnasium")``
pool and writes what it returns into envfleet's :class:`~envfleet._core.buffers.Batch`, so the front
(:class:`envfleet.FleetVectorEnv`) validates input, runs the call state machine and the
first-ready pool bookkeeping, and raises the same typed errors as for every other backend.

How EnvPool's behaviour maps onto the contract (measured on envpool 1.2.5, see the tests):

- **Layout.** Synchronous (``batch_size`` ``None`` or ``num_envs``): one native pool with
  ``batch_size == num_envs`` and one "worker" holding every env. First-ready pool
  (``batch_size < num_envs``): a native asynchronous pool with the same ``batch_size`` and one
  "worker" per env, so the front routes each env on its own; ``recv()`` returns the
  ``batch_size`` envs that EnvPool's own ``recv()`` hands back. ``num_workers`` is therefore 1
  or ``num_envs``; EnvPool's threads are ``env_kwargs["num_threads"]``.
- **Autoreset.** EnvPool resets an env on the step *after* its episode ended: that step ignores
  its action and returns the reset observation with reward 0, ``terminated=False``,
  ``truncated=False`` and the reset's info, which is gymnasium's ``AutoresetMode.NEXT_STEP``.
  ``SAME_STEP`` is emulated in synchronous mode: an env that ended is stepped once more at
  once (EnvPool resets it, the action is ignored), its reset observation replaces the final
  one, which goes to ``info["final_obs"]`` with ``info["final_info"]``, as gymnasium does.
  ``DISABLED`` (synchronous mode) relies on the front refusing to step an env that ended
  before it is reset (:class:`envfleet.ResetNeededError`); an explicit reset (``reset_mask``)
  is EnvPool's ``reset(env_id)``. A first-ready pool takes only ``NEXT_STEP``: EnvPool's
  native batch has a fixed size, so it cannot wait for the extra step of one env.
- **Seeds.** EnvPool seeds its envs when the pool is created: env ``i`` gets ``seed + i``
  (EnvPool's own rule, the same as envfleet's), or ``seed[i]`` for a list. ``reset(seed=s)``
  and ``async_reset(seed=s)`` therefore create the native pool again with those seeds (unless
  it was created with them and has not run since), which resets every env. Before any seeded
  reset the envs follow the pool's creation seed: ``env_kwargs["seed"]``, else EnvPool's
  default (42), so ``reset()`` without a seed is deterministic, unlike gymnasium's.
  The trajectories are EnvPool's: its CartPole is not bit-identical to gymnasium's.
- **Infos.** EnvPool's info keys (``elapsed_step``; Atari: ``lives``, ``reward``,
  ``terminated``, ``ram``; ...), minus its ``env_id``/``players`` bookkeeping, in gymnasium's
  vector convention (``info[key]`` with the ``info["_key"]`` mask), with the dtypes
  ``VectorEnv._add_info`` gives; ``recv()`` adds ``info["env_id"]``.
- **The native path.** Where the task's layout allows it (one action array, one
  observation array, one player per env: EnvPool's classic-control, Atari, MuJoCo... tasks),
  ``step`` and the pool's ``send``/``recv`` call EnvPool's native ``_send``/``_recv``
  directly (:class:`NativeLayout`), as its own Python ``step``/``send``/``recv`` do, minus
  their per-call conversions, and hand EnvPool's arrays through: they are new arrays at each
  ``recv`` (EnvPool's state buffers are not reused while an array holds them), so the caller
  owns them with ``copy=True`` as with ``copy=False``. ``copy=True`` also keeps the
  observations in envfleet's batch (a later partial reset returns every env's); ``copy=False``
  writes them there only when a later call needs them (:meth:`EnvPoolBackend.settle`).
- **Not available.** ``call``, ``get_attr``, ``set_attr`` (there are no Python env objects),
  reset ``options`` other than ``reset_mask``, a seeded partial reset, timeouts (EnvPool's
  ``recv`` cannot be bounded). ``render()`` works when ``env_kwargs["render_mode"]`` is
  ``"rgb_array"`` (EnvPool renders every env).
"""

from __future__ import annotations

import numbers
import time
from collections.abc import Mapping, Sequence
from typing import Any

import gymnasium
import numpy as np
from gymnasium.vector import AutoresetMode

from envfleet._backends.base import NativeBackend
from envfleet._backends.registry import BackendSpec, NativeRequest, register
from envfleet._backends.supervisor import Ledger
from envfleet._core.buffers import (
    Block,
    allocate_batch,
    batch_nbytes,
    check_fixed_size,
)
from envfleet._core.errors import ConfigError, InvalidArgumentError, UnsupportedError
from envfleet._core.infos import InfoAdder, columns_infos, split_infos, vector_dtype
from envfleet._core.protocol import Command, InfoEvent, ResetRequest
from envfleet._core.stats import STATS_WORDS, StepTimer, StepTimeStats, step_time_table
from envfleet._core.trees import tree_map, tree_row, tree_scatter, tree_take, tree_write

__all__ = ["EnvPoolBackend", "NativeLayout", "open_envpool"]

# envpool.make arguments that envfleet sets itself.
_RESERVED_KWARGS = {
    "num_envs": "num_envs",
    "batch_size": "batch_size",
    "env_type": "(always 'gymnasium')",
    "gym_reset_return_info": "(always True)",
}
# EnvPool's own bookkeeping in its infos, not env data.
_SKIP_INFO = ("env_id", "players")


class NativeLayout:
    """Where EnvPool's native ``_send``/``_recv`` lists hold what envfleet needs, for a task
    whose layout allows the native path (:meth:`of`); ``None`` from :meth:`of` otherwise.

    EnvPool's Python ``send`` builds ``[env_id, players.env_id, action]`` (its
    ``_action_keys``; one player per env: ``players.env_id == env_id``) and its ``recv``
    unflattens ``_recv()``'s list by ``_state_keys`` (``obs``, ``reward``, ``done``,
    ``trunc``, ``elapsed_step``, ``info:<key>``...) into gymnasium's ``(obs, reward,
    terminated = done & ~trunc, truncated, info)``, ``info`` holding the ``info:`` keys in
    sorted order, then ``elapsed_step`` (EnvPool 1.2.5's ``EnvPoolMixin.send``/``recv`` and
    its gymnasium ``_to``).

    Attributes:
        action_dtype: the dtype EnvPool's action array takes (``int32`` for Discrete).
        obs, reward, done, trunc, env_id: indexes into ``_recv()``'s list.
        infos: ``(key, index)`` per info key envfleet returns, in EnvPool's order.
    """

    def __init__(self, pool: Any):
        state = list(pool._state_keys)
        index = {key: k for k, key in enumerate(state)}
        self.action_dtype = np.dtype(pool._spec._action_spec[-1][0])
        self.obs = index["obs"]
        self.reward = index["reward"]
        self.done = index["done"]
        self.trunc = index["trunc"]
        self.env_id = index["info:env_id"]
        own = sorted(
            key[len("info:") :]
            for key in state
            if key.startswith("info:")
            and key[len("info:") :] not in _SKIP_INFO
            and not key.startswith("info:players.")
        )
        self.infos = [(key, index[f"info:{key}"]) for key in own]
        self.infos.append(("elapsed_step", index["elapsed_step"]))
        # Per info key: does its column pass as EnvPool returns it (gymnasium's
        # VectorEnv._add_info keeps a numeric dtype; columns_infos decides the others).
        self.passes: dict[str, bool] = {}

    @classmethod
    def of(cls, pool: Any, observation_space: Any, action_space: Any) -> NativeLayout | None:
        """The layout of ``pool``'s task, or ``None`` where the native path does not apply
        (Dict spaces, several players per env, keys other than EnvPool 1.2.5's)."""
        try:
            actions = list(pool._action_keys)
            state = list(pool._state_keys)
            players = int(pool.config.get("max_num_players", 1))
        except AttributeError:  # another EnvPool than the one this was written against
            return None
        if actions[:2] != ["env_id", "players.env_id"] or len(actions) != 3 or players != 1:
            return None
        if isinstance(observation_space, gymnasium.spaces.Dict) or isinstance(
            action_space, gymnasium.spaces.Dict
        ):
            return None
        needed = {"obs", "reward", "done", "trunc", "elapsed_step", "info:env_id"}
        nested = [
            key
            for key in state
            if key.startswith("info:") and "." in key and not key.startswith("info:players.")
        ]
        if not needed <= set(state) or nested:
            return None
        return cls(pool)


def _import_envpool() -> Any:
    try:
        import envpool
    except ImportError as exc:
        raise ConfigError(
            "backend='envpool' needs the envpool package: pip install 'envfleet[envpool]'"
        ) from exc
    return envpool


def _check_task(envpool: Any, task_id: Any) -> str:
    if not isinstance(task_id, str):
        raise ConfigError(
            "backend='envpool' takes an EnvPool task id (a str such as 'CartPole-v1' or "
            f"'Pong-v5', see envpool.list_all_envs()), not {type(task_id).__name__}: EnvPool "
            "runs its own C++ tasks, not gymnasium envs or factories"
        )
    tasks = envpool.list_all_envs()
    if task_id in tasks:
        return task_id
    if task_id.startswith("ALE/") and task_id[4:] in tasks:
        raise ConfigError(
            f"{task_id!r} is gymnasium's ALE id; EnvPool's task is {task_id[4:]!r}, with other "
            "defaults: EnvPool applies DeepMind-style preprocessing (84x84 grayscale, 4 stacked "
            "frames, frame_skip=4, up to 30 no-op starts, fire reset, "
            "repeat_action_probability=0), gymnasium's ALE/...-v5 returns raw 210x160 RGB "
            "frames with sticky actions (0.25). Pass the EnvPool id, "
            f"make({task_id[4:]!r}, backend='envpool'), if that is what you want"
        )
    raise ConfigError(
        f"{task_id!r} is not an EnvPool task; see envpool.list_all_envs() (EnvPool ids have "
        "no namespace for Atari: 'Pong-v5')"
    )


def _as_int(value: Any, low: int, high: int) -> bool:
    return (
        isinstance(value, numbers.Integral)
        and not isinstance(value, bool)
        and low <= int(value) <= high
    )


def open_envpool(request: NativeRequest) -> EnvPoolBackend:
    """The backend of ``make(task_id, num_envs, backend="envpool", ...)`` over an EnvPool pool
    (see :func:`envfleet.make` and this module's docstring for the mapping).

    ``request`` holds make()'s ``env`` (an EnvPool task id, ``envpool.list_all_envs()``),
    ``num_envs`` (default 1), ``batch_size`` (``None``/``num_envs``: synchronous;
    ``1 <= batch_size < num_envs``: a first-ready pool over EnvPool's asynchronous mode),
    ``autoreset_mode`` (``NEXT_STEP``, EnvPool's own; ``SAME_STEP`` or ``DISABLED`` in
    synchronous mode only) and ``env_kwargs`` (for ``envpool.make``: ``seed``,
    ``num_threads``, ``thread_affinity_offset``, ``max_episode_steps``, task options such as
    Atari's ``stack_num``/``frame_skip``, ``render_mode``; not ``num_envs``, ``batch_size``
    or ``env_type``).

    Raises:
        ConfigError: envpool is not installed (``pip install 'envfleet[envpool]'``), an
            unknown task id (or gymnasium's ``ALE/`` id, naming EnvPool's), a bad
            ``num_envs``/``batch_size``/``autoreset_mode``, an autoreset mode EnvPool cannot
            match, reserved or rejected ``env_kwargs``.
    """
    envpool = _import_envpool()
    task_id = _check_task(envpool, request.env)
    num_envs = 1 if request.num_envs is None else request.num_envs
    if not _as_int(num_envs, 1, 2**31 - 1):
        raise ConfigError(f"num_envs must be an integer >= 1, got {num_envs!r}")
    num_envs = int(num_envs)
    batch_size = request.batch_size
    if batch_size is not None and not _as_int(batch_size, 1, num_envs):
        raise ConfigError(f"batch_size must be None or an integer in [1, {num_envs}]")
    batch = num_envs if batch_size is None else int(batch_size)
    mode = AutoresetMode(request.autoreset_mode)  # make() parsed it (options table checked)
    kwargs = dict(request.env_kwargs or {})
    reserved = sorted(set(kwargs) & set(_RESERVED_KWARGS))
    if reserved:
        raise ConfigError(
            f"env_kwargs {reserved}: set by envfleet for backend='envpool' "
            "(use make's num_envs and batch_size)"
        )
    return EnvPoolBackend(envpool, task_id, num_envs, batch, mode, kwargs)


class EnvPoolBackend(NativeBackend):
    """Drives one ``envpool.make(task_id, env_type="gymnasium", ...)`` pool (module docstring).

    Synchronous mode: ``ranges == [(0, num_envs)]``; a step is ``send(all actions)`` in
    :meth:`submit` and ``recv()`` in :meth:`collect`, whose result is the infos already in
    gymnasium's vector convention (a dict over every env). First-ready pool:
    ``ranges == [(e, e + 1) for each env]``; :meth:`submit` sends the actions of the envs
    named, :meth:`collect_ready` is one EnvPool ``recv()`` and returns one info event per env.

    Raises (constructor):
        ConfigError: ``envpool.make`` refused the arguments, or a space without a fixed size.
    """

    def __init__(
        self,
        envpool: Any,
        task_id: str,
        num_envs: int,
        batch_size: int,
        autoreset_mode: AutoresetMode,
        env_kwargs: dict[str, Any],
    ):
        self._envpool = envpool
        self.task_id = task_id
        self.num_envs = num_envs
        self.batch_size = batch_size
        self.is_pool = batch_size < num_envs
        self.autoreset_mode = autoreset_mode
        self._kwargs = env_kwargs
        self._closed = False
        seed = env_kwargs.pop("seed", None)
        self._pool: Any = None
        self._seeds: list[int] | None = None
        self._create(seed)  # seed None: EnvPool's default
        native: Any = self._pool
        self.single_observation_space: gymnasium.Space[Any] = native.observation_space
        self.single_action_space: gymnasium.Space[Any] = native.action_space
        self.metadata: dict[str, Any] = dict(getattr(native, "metadata", {}) or {})
        self.render_mode: str | None = native.render_mode
        try:
            check_fixed_size(self.single_observation_space, "observation")
            check_fixed_size(self.single_action_space, "action")
        except ConfigError:
            self.close(None, True)
            raise
        obs, act = self.single_observation_space, self.single_action_space
        self.batch = allocate_batch(
            obs, act, num_envs, Block(batch_nbytes(obs, act, num_envs), shared=False)
        )
        self.ranges = [(e, e + 1) for e in range(num_envs)] if self.is_pool else [(0, num_envs)]
        self.ledger = Ledger(num_envs, None)
        self._stats = np.zeros((len(self.ranges), STATS_WORDS))
        self._timer = StepTimer(self._stats[0])
        self._all_ids = np.arange(num_envs, dtype=np.int32)
        self._resetting = np.zeros(num_envs, dtype=np.bool_)  # a reset's result is pending
        self._command: Command | None = None  # synchronous mode: what collect() receives
        self._t0 = 0.0
        self._dummy_action: Any = None
        # The native path (module docstring): EnvPool's own layout, or None.
        layout = NativeLayout.of(native, obs, act)
        self.native = layout is not None and autoreset_mode is AutoresetMode.NEXT_STEP
        self._layout: Any = layout
        self._all_ids_bytes = self._all_ids.tobytes()
        self._stale: Any = None  # copy=False: the observations the batch has not got yet
        self._masks: dict[int, np.ndarray] = {}  # read-only all-True info masks, per rows
        self.native_calls = 0  # native_step/_send/_recv calls (the tests' witness)

    # -- the native pool -------------------------------------------------------------------

    def _create(self, seed: int | Sequence[int] | None) -> None:
        """(Re)create the native pool; ``seed``: an int (env i: seed + i), one per env, or
        ``None`` (EnvPool's default)."""
        if self._pool is not None:
            self._pool.close()
            self._pool = None
        kwargs = dict(self._kwargs)
        if seed is not None:
            kwargs["seed"] = seed
        try:
            self._pool = self._envpool.make(
                self.task_id,
                env_type="gymnasium",
                num_envs=self.num_envs,
                batch_size=self.batch_size,
                **kwargs,
            )
        except (AssertionError, ValueError, TypeError, KeyError, RuntimeError) as exc:
            raise ConfigError(
                f"envpool.make({self.task_id!r}, num_envs={self.num_envs}, "
                f"batch_size={self.batch_size}, **{kwargs!r}) failed: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        self._seeds = seeds_of(
            int(self._pool.config["seed"]) if seed is None else seed, self.num_envs
        )
        self._fresh = True  # created with self._seeds and not run since

    def _reseed(self, seeds: list[int | None], ids: np.ndarray) -> None:
        """Create the pool again when a reset of ``ids`` gives seeds (every env must get one).

        Raises:
            InvalidArgumentError: seeds for some envs only, or for a partial reset.
        """
        given = [seeds[e] for e in ids.tolist()]
        if all(s is None for s in given):
            return
        if len(ids) != self.num_envs or any(s is None for s in given):
            raise InvalidArgumentError(
                "backend='envpool' seeds its envs only when it creates the native pool, so a "
                "seeded reset must reset every env with a seed for each (or seed=None for none)"
            )
        full = [int(s) for s in given if s is not None]
        for s in full:
            if not -(2**31) <= s < 2**31:
                raise InvalidArgumentError(f"EnvPool seeds are int32; got {s}")
        if self._fresh and full == self._seeds:
            return  # created with exactly these seeds and not run since
        self._create(full)

    # -- Backend ---------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._closed

    def submit(self, command: Command, payloads: Mapping[int, Any], step: int) -> None:
        """Send ``command`` to EnvPool for the envs of the workers in ``payloads``.

        Raises:
            UnsupportedError: ``call``/``get_attr``/``set_attr``, or ``render`` without
                ``render_mode="rgb_array"``.
            InvalidArgumentError: reset options, or seeds EnvPool cannot honour (see
                :meth:`_reseed`). Nothing is sent on any error.
        """
        self.settle()  # a partial reset must find every other env's latest observation
        if command is Command.STEP:
            if self.is_pool:
                ids = np.fromiter(payloads, dtype=np.int32, count=len(payloads))
                ids.sort()
                actions = tree_take(self.batch.actions, ids)
                self._pool.send(actions, env_id=ids)
            else:
                self._t0 = time.perf_counter()
                self._pool.send(self.batch.actions, env_id=self._all_ids)
                self._command = command
            self._fresh = False
        elif command is Command.RESET:
            mask = np.zeros(self.num_envs, dtype=np.bool_)
            seeds: list[int | None] = [None] * self.num_envs
            for w, request in payloads.items():
                assert isinstance(request, ResetRequest)
                if request.options:
                    raise InvalidArgumentError(
                        f"backend='envpool' resets take no options but reset_mask; got "
                        f"{sorted(request.options)}"
                    )
                start, stop = self.ranges[w]
                local = np.ones(stop - start, np.bool_) if request.mask is None else request.mask
                mask[start:stop] = local
                seeds[start:stop] = request.seeds
            ids = np.flatnonzero(mask).astype(np.int32)
            self._reseed(seeds, ids)
            self._pool._reset(ids)  # EnvPool's reset(env_id) without its blocking recv
            self._resetting[ids] = True
            self._command = command
            self._fresh = False
        elif command is Command.RENDER:
            if self.render_mode != "rgb_array":
                raise UnsupportedError(
                    "render() on backend='envpool' needs env_kwargs={'render_mode': "
                    f"'rgb_array'}} (got render_mode={self.render_mode!r})"
                )
            self._command = command
        else:
            raise UnsupportedError(
                f"{command.name.lower()} (call, get_attr, set_attr) is not available on "
                "backend='envpool': EnvPool's envs are native, with no Python env objects"
            )

    def collect(self, timeout: float | None, step: int) -> dict[int, Any]:
        """Receive the synchronous step or reset: ``{0: infos}``, the infos already in
        gymnasium's vector convention over every env (:func:`envfleet._core.infos.vector_infos`
        takes them as they are).
        ``timeout`` is ignored: EnvPool's ``recv`` cannot be bounded. In a first-ready pool
        it returns ``{}`` at once (``close()`` lets EnvPool finish what is running)."""
        command, self._command = self._command, None
        if self.is_pool or command is None:
            return {}
        if command is Command.RENDER:
            frames = self._pool.render(env_ids=self._all_ids)
            return {0: list(frames)}
        obs, reward, terminated, truncated, info = self._pool.recv()
        ids = info["env_id"]
        in_order = self._write(ids, obs, reward, terminated, truncated)
        infos = columns_infos(info, ids, self.num_envs, in_order, _SKIP_INFO)
        if command is Command.STEP:
            if self.autoreset_mode is AutoresetMode.SAME_STEP:
                adder = InfoAdder(self.num_envs)
                for e, info_e in self._same_step(ids, obs, terminated, truncated, info):
                    infos = adder.add(infos, info_e, e)
            self._timer.record(time.perf_counter() - self._t0)
        return {0: infos}

    def collect_ready(self, timeout: float | None, step: int) -> dict[int, Any]:
        """One EnvPool ``recv()``: ``{env: [(env, info)]}`` for the envs it returned (in
        synchronous mode ``{0: events}`` for every env). ``timeout`` is ignored, as in
        :meth:`collect`."""
        self._command = None
        self.settle()
        obs, reward, terminated, truncated, info = self._pool.recv()
        ids = info["env_id"]
        self._write(ids, obs, reward, terminated, truncated)
        rows = split_infos(info, len(ids), _SKIP_INFO)
        if self.is_pool:
            return {int(e): [(int(e), row)] for e, row in zip(ids.tolist(), rows, strict=True)}
        events: list[InfoEvent] = [(int(e), row) for e, row in zip(ids.tolist(), rows, strict=True)]
        if self.autoreset_mode is AutoresetMode.SAME_STEP:
            extra = self._same_step(ids, obs, terminated, truncated, info)
            if extra:
                events = sorted(
                    [ev for ev in events if ev[0] not in {e for e, _ in extra}] + extra,
                    key=lambda ev: ev[0],
                )
        return {0: events}

    def step_times(self) -> tuple[StepTimeStats, ...]:
        """Synchronous mode: the send-to-recv time of each ``step``; a first-ready pool
        records none (EnvPool's envs finish on its threads, not per worker)."""
        return step_time_table(self._stats)

    def close(self, timeout: float | None, terminate: bool) -> None:
        """Close the native pool (EnvPool joins its threads; envs still running finish)."""
        self._closed = True
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    # -- the native path (NativeLayout) ----------------------------------------------------

    def native_step(
        self, actions: np.ndarray, copy: bool
    ) -> tuple[Any, np.ndarray, np.ndarray, np.ndarray, dict[str, Any]]:
        """A synchronous step of every env by EnvPool's native calls (``native`` is True).

        Args:
            actions: ``[num_envs, *shape]`` of the action space's dtype (the front checked
                them; EnvPool takes them converted to its own dtype, as its ``send`` does).
            copy: the front's ``copy``: True keeps the observations in the batch now, False
                only once another call needs them (:meth:`settle`).

        Returns:
            As :meth:`envfleet.FleetVectorEnv.step`: EnvPool's arrays (rewards as float64,
            ``terminated = done & ~trunc``), infos in gymnasium's vector convention.
        """
        self.native_calls += 1
        self._fresh = False
        layout, pool, ids = self._layout, self._pool, self._all_ids
        t0 = time.perf_counter()
        pool._send([ids, ids, actions.astype(layout.action_dtype)])
        state = pool._recv()
        self._timer.record(time.perf_counter() - t0)
        if state[layout.env_id].tobytes() != self._all_ids_bytes:  # rows in env order
            order = np.argsort(state[layout.env_id], kind="stable")
            state = [np.asarray(value)[order] for value in state]
        obs = state[layout.obs]
        truncated = state[layout.trunc]
        terminated = np.greater(state[layout.done], truncated)  # done & ~trunc
        infos = self._native_infos(state, self.num_envs, copy)
        if copy:
            tree_write(self.batch.observations, obs)
        else:
            self._stale = obs
        return obs, state[layout.reward].astype(np.float64), terminated, truncated, infos

    def native_send(self, actions: np.ndarray, env_ids: np.ndarray) -> None:
        """A first-ready pool's ``send`` by EnvPool's native call: ``actions``
        (``[len(env_ids), *shape]``, the action space's dtype) to distinct ``env_ids``
        (``int32``), each awaiting an action (the front checked them)."""
        self.native_calls += 1
        self._fresh = False
        self._pool._send([env_ids, env_ids, actions.astype(self._layout.action_dtype)])

    def native_recv(
        self, copy: bool
    ) -> tuple[Any, np.ndarray, np.ndarray, np.ndarray, dict[str, Any]]:
        """A first-ready pool's ``recv`` by EnvPool's native call: the ``batch_size`` envs
        EnvPool returns, as :meth:`envfleet.FleetVectorEnv.recv` (``info["env_id"]`` names
        them; a reset's result reads reward 0, not terminated or truncated)."""
        self.native_calls += 1
        layout = self._layout
        state = self._pool._recv()
        ids = state[layout.env_id]
        reward = state[layout.reward].astype(np.float64)
        truncated = state[layout.trunc]
        terminated = np.greater(state[layout.done], truncated)  # done & ~trunc
        if np.count_nonzero(self._resetting):  # (a fraction of .any()'s cost)
            resetting = self._resetting[ids]
            if resetting.any():
                reward[resetting] = 0.0
                terminated[resetting] = False
                truncated = np.where(resetting, False, truncated)
                self._resetting[ids[resetting]] = False
        infos = self._native_infos(state, len(ids), copy)
        infos["env_id"] = ids
        return state[layout.obs], reward, terminated, truncated, infos

    def settle(self) -> None:
        """Write into the batch the observations a ``copy=False`` native step handed out
        without keeping (any call that reads or partly writes the batch comes here first)."""
        stale, self._stale = self._stale, None
        if stale is not None:
            tree_write(self.batch.observations, stale)

    def _native_infos(self, state: list[Any], n: int, copy: bool) -> dict[str, Any]:
        """The infos of ``n`` rows of ``_recv()``'s ``state`` in gymnasium's vector
        convention, as :func:`columns_infos` builds them (EnvPool's columns pass as they are
        where their dtype does; the masks are all True)."""
        layout = self._layout
        out: dict[str, Any] = {}
        for key, k in layout.infos:
            value = state[k]
            passes = layout.passes.get(key)
            if passes is None:
                passes = layout.passes[key] = vector_dtype(value) == value.dtype
            if not passes:
                out.update(columns_infos({key: value}, np.arange(n), n, True))
                continue
            mask = self._masks.get(n)
            if mask is None:
                mask = self._masks[n] = np.ones(n, dtype=np.bool_)
                mask.flags.writeable = False
            out[key] = value
            out[f"_{key}"] = mask.copy() if copy else mask
        return out

    # -- helpers ---------------------------------------------------------------------------

    def _write(
        self,
        ids: np.ndarray,
        obs: Any,
        reward: np.ndarray,
        terminated: np.ndarray,
        truncated: np.ndarray,
    ) -> bool:
        """Write EnvPool's rows for envs ``ids`` into the batch; a reset reads 0/False.
        Returns whether ``ids`` is every env in order."""
        batch = self.batch
        in_order = len(ids) == self.num_envs and bool((ids == self._all_ids).all())
        rows: Any = slice(None) if in_order else ids
        tree_scatter(batch.observations, rows, obs)
        batch.rewards[rows] = reward
        batch.terminations[rows] = terminated
        batch.truncations[rows] = truncated
        resetting = self._resetting[ids]
        if resetting.any():
            reset_ids = ids[resetting]
            batch.rewards[reset_ids] = 0.0
            batch.terminations[reset_ids] = False
            batch.truncations[reset_ids] = False
            self._resetting[reset_ids] = False
        return in_order

    def _same_step(
        self,
        ids: np.ndarray,
        obs: Any,
        terminated: np.ndarray,
        truncated: np.ndarray,
        info: dict[str, Any],
    ) -> list[InfoEvent]:
        """SAME_STEP for the envs of ``ids`` whose episode just ended: step them once more at
        once (EnvPool resets them and ignores the action) and write their reset observation
        over the final one. Returns, in env order, per env that ended the events gymnasium's
        SyncVectorEnv adds: ``{"final_obs", "final_info"}``, then the reset's info."""
        done = np.logical_or(terminated, truncated)
        if not done.any():
            return []
        rows = np.flatnonzero(done)
        done_ids = ids[rows]
        all_rows = split_infos(info, len(ids), _SKIP_INFO)
        final = {
            int(ids[k]): {"final_obs": tree_row(obs, int(k)), "final_info": all_rows[int(k)]}
            for k in rows.tolist()
        }
        if self._dummy_action is None:
            self._dummy_action = tree_map(np.zeros_like, self.batch.actions)
        self._pool.send(tree_take(self._dummy_action, done_ids), env_id=done_ids)
        reset_obs, _, _, _, reset_info = self._pool.recv()
        got = reset_info["env_id"]
        tree_scatter(self.batch.observations, got, reset_obs)
        reset_rows = dict(
            zip(got.tolist(), split_infos(reset_info, len(got), _SKIP_INFO), strict=True)
        )
        events: list[InfoEvent] = []
        for e in sorted(final):
            events.append((e, final[e]))
            events.append((e, reset_rows[e]))
        return events


def seeds_of(seed: int | Sequence[int] | None, num_envs: int) -> list[int] | None:
    """EnvPool's per-env seeds for a creation ``seed``: ``seed + i``, a list as is, or None."""
    if seed is None:
        return None
    if isinstance(seed, Sequence):
        return [int(s) for s in seed]
    return [int(seed) + i for i in range(num_envs)]


register(
    BackendSpec(
        "envpool",
        native=open_envpool,
    )
)
