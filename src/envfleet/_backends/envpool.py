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

from envfleet._backends.base import Backend
from envfleet._backends.registry import BackendSpec, NativeRequest, register
from envfleet._backends.supervisor import Ledger
from envfleet._core.buffers import (
    Block,
    allocate_batch,
    batch_nbytes,
    check_fixed_size,
)
from envfleet._core.errors import ConfigError, InvalidArgumentError, UnsupportedError
from envfleet._core.infos import InfoAdder, columns_infos, split_infos
from envfleet._core.protocol import Command, InfoEvent, ResetRequest
from envfleet._core.stats import STATS_WORDS, StepTimer, StepTimeStats, step_time_table
from envfleet._core.trees import tree_map, tree_row, tree_scatter, tree_take

__all__ = ["EnvPoolBackend", "open_envpool"]

# envpool.make arguments that envfleet sets itself.
_RESERVED_KWARGS = {
    "num_envs": "num_envs",
    "batch_size": "batch_size",
    "env_type": "(always 'gymnasium')",
    "gym_reset_return_info": "(always True)",
}
# EnvPool's own bookkeeping in its infos, not env data.
_SKIP_INFO = ("env_id", "players")


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


def _refusal(names: Sequence[str]) -> ConfigError:
    """make()'s options given that EnvPool cannot honour (the registry's ``refusal``)."""
    return ConfigError(
        f"{', '.join(names)}: not an option of backend='envpool' (EnvPool runs its envs on "
        "its own native threads: set env_kwargs={'num_threads': ...}; it cannot bound, "
        "restart or isolate them)"
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
    pool = batch < num_envs
    try:
        mode = AutoresetMode(request.autoreset_mode)
    except ValueError as exc:
        raise ConfigError(f"unknown autoreset_mode {request.autoreset_mode!r}") from exc
    if pool and mode is not AutoresetMode.NEXT_STEP:
        raise ConfigError(
            f"autoreset_mode={mode.name}: a first-ready pool on backend='envpool' takes only "
            "AutoresetMode.NEXT_STEP, EnvPool's own autoreset (its fixed-size native batch "
            "cannot wait for the extra step SAME_STEP needs, and a pool always autoresets)"
        )
    kwargs = dict(request.env_kwargs or {})
    reserved = sorted(set(kwargs) & set(_RESERVED_KWARGS))
    if reserved:
        raise ConfigError(
            f"env_kwargs {reserved}: set by envfleet for backend='envpool' "
            "(use make's num_envs and batch_size)"
        )
    return EnvPoolBackend(envpool, task_id, num_envs, batch, mode, kwargs)


class EnvPoolBackend(Backend):
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
        self._pending_ids = self._all_ids
        self._t0 = 0.0
        self._dummy_action: Any = None

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
        if command is Command.STEP:
            if self.is_pool:
                ids = np.fromiter(payloads, dtype=np.int32, count=len(payloads))
                ids.sort()
                actions = tree_take(self.batch.actions, ids)
                self._pool.send(actions, env_id=ids)
            else:
                self._t0 = time.perf_counter()
                self._pool.send(self.batch.actions, env_id=self._all_ids)
                self._command, self._pending_ids = command, self._all_ids
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
            self._command, self._pending_ids = command, ids
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
        refuses=("num_workers", "step_timeout", "restart_policy", "context", "observation_mode"),
        refusal=_refusal,
    )
)
