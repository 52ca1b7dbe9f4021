"""stable-baselines3 adapter: :class:`SB3VecEnv`, an SB3 ``VecEnv`` over an envfleet vector env.

::

    from stable_baselines3 import PPO
    from envfleet.adapters.sb3 import SB3VecEnv

    venv = SB3VecEnv("CartPole-v1", 8, backend="processes")
    model = PPO("MlpPolicy", venv, n_steps=128).learn(100_000)
    venv.close()

It follows the API and semantics of the installed stable-baselines3 (2.x) ``VecEnv``, as its
``DummyVecEnv`` and ``SubprocVecEnv`` implement them; the same seeds and actions give the same
results as ``DummyVecEnv``. Needs ``pip install 'envfleet[sb3]'``.

A factory that returns a PettingZoo ``ParallelEnv`` gives agents as envs, SuperSuit's layout
(``num_envs * num_agents`` rows, row ``i * A + j`` = env ``i``, agent ``j``)::

    from pettingzoo.butterfly import pistonball_v6

    venv = SB3VecEnv(lambda: pistonball_v6.parallel_env(n_pistons=4), 8)
    venv.num_envs                      # 32 rows: 8 envs x 4 agents
    model = PPO("CnnPolicy", venv, n_steps=128).learn(100_000)
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import operator
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import gymnasium
import numpy as np
from gymnasium import spaces
from gymnasium.vector import AutoresetMode

from envfleet._core.buffers import is_leaf
from envfleet._core.errors import ConfigError, InvalidActionError
from envfleet._core.trees import tree_copy, tree_row
from envfleet._front.factories import GymMake, check_gymnasium_id
from envfleet._front.make import make
from envfleet._front.multi_agent_vector_env import MultiAgentVectorEnv
from envfleet._front.options import Processes, Ray
from envfleet._front.vector_env import FleetVectorEnv
from envfleet.adapters._sb3_agents import AgentRows
from envfleet.adapters._sb3_shim import SHIM_METHOD, ShimFactory
from envfleet.adapters.infos import split_infos

try:
    from stable_baselines3.common.vec_env.base_vec_env import (
        VecEnv,
        VecEnvIndices,
        VecEnvObs,
        VecEnvStepReturn,
        tile_images,
    )
except ImportError as _exc:  # pragma: no cover - depends on the installed extras
    raise ConfigError(
        f"envfleet.adapters.sb3 needs stable-baselines3 ({_exc}): pip install 'envfleet[sb3]'"
    ) from _exc

__all__ = ["SB3VecEnv"]

_FIXED = ("autoreset_mode", "batch_size", "copy", "output")


class SB3VecEnv(VecEnv):
    """A stable-baselines3 ``VecEnv`` whose sub-environments run on an envfleet backend.

    Built on :func:`envfleet.make` with ``autoreset_mode=SAME_STEP`` (gymnasium's mode that
    matches SB3's autoreset) and ``copy=False`` (this class copies what SB3 keeps, once).
    Semantics, as stable-baselines3's ``DummyVecEnv``/``SubprocVecEnv``:

    - :meth:`step_wait` returns ``(obs, rewards: float32[num_envs], dones: bool[num_envs],
      infos: list[dict])``; ``dones = terminated | truncated``. A done env's observation is
      the first of its next episode; ``infos[i]["terminal_observation"]`` holds the last one
      of the episode that ended, and ``infos[i]["TimeLimit.truncated"]`` is ``truncated and
      not terminated`` (set for every env); ``reset_infos[i]`` gets the new episode's reset
      info. Observations are ``[num_envs, *shape]`` of the space's dtype (dict/tuple of them
      for Dict/Tuple spaces), fresh arrays at every call.
    - :meth:`reset` returns observations only; it seeds env ``i`` with ``_seeds[i]`` (set by
      :meth:`seed`: ``seed + i``) and passes ``_options[i]`` (set by ``set_options``), then
      forgets both, as SB3 does (seeds and options are used once).
    - ``env_method``, ``get_attr``, ``set_attr`` and ``env_is_wrapped`` act only on the envs
      in ``indices`` (``None``: all; an int: that one; a negative index counts from the end,
      as in a list), results in the order of ``indices``. ``get_attr`` raises
      ``AttributeError`` for a missing attribute; ``set_attr`` sets the attribute on the
      outermost wrapper of your env, as SB3's ``setattr(env, ...)``.
    - ``render``/``get_images``: SB3's ``VecEnv.render`` over the envs' ``render()`` frames
      (``render_mode="rgb_array"``).

    Infos come from gymnasium's vector infos, split per env: Python ``int``/``float`` values
    an env returns come back as numpy scalars of equal value, and an info's keys in the order
    the vector infos first saw them (over all envs), SB3's two keys last.

    With a ``restart_policy``, an env rebuilt after a fault ends its episode as truncated with
    ``info["env_restarted"]``; it has no last observation, so ``terminal_observation`` is
    then the new episode's first.

    **PettingZoo parallel envs: agents as envs.** When ``env`` returns a
    ``pettingzoo.ParallelEnv`` (:func:`envfleet.make` gives a
    :class:`envfleet.MultiAgentVectorEnv`), each agent is one SB3 env, SuperSuit's layout
    (``concat_vec_envs_v1(pettingzoo_env_to_vec_env_v1(env), N, base_class=
    "stable_baselines3")``): ``num_envs = N * A`` rows, row ``i * A + j`` = env ``i``, agent
    ``j`` (``possible_agents`` order); ``observation_space``/``action_space`` are the agents'
    one space (heterogeneous agents: ``ConfigError``). Actions are ``[N * A, *shape]``; an
    agent's row of actions is dropped while it is not in ``env.agents``. Per row:

    - observations ``[N * A, *shape]``, rewards ``float32``, ``dones`` = the agent's
      ``terminated | truncated``, ``infos[row]`` = the agent's info: as SuperSuit's
      ``MarkovVectorEnv`` and ``ConcatVecEnv`` (rewards cast to float32 there too; its dones
      are ``uint8`` on one process, ``bool`` here as SB3 expects).
    - agents not in ``env.agents`` give zeroed observations, zero rewards, no dones and an
      empty info ("black death", SuperSuit's ``black_death_v3``, which SuperSuit needs for
      agents that leave; envfleet needs no wrapper). On the step an agent leaves, its row has
      its own last observation, reward and flags (``black_death_v3`` reports no done for an
      agent until the whole env is done, and then every agent's).
    - an env's episode ends when ``env.agents`` is empty; it is reset at once, as SuperSuit's
      ``MarkovVectorEnv`` resets it, and its rows hold the new episode's observations.
    - ``infos[row]["terminal_observation"]`` on every done row: the agent's last observation
      (SuperSuit sets it only when the env ends, with zeros for agents that left, and reads
      it from the env's info dict); ``infos[row]["TimeLimit.truncated"]`` on every row, as
      SB3's (SuperSuit has none); ``reset_infos[row]`` gets the agent's reset info (SuperSuit
      merges it into the step's info).
    - :meth:`seed` gives env ``i`` (all its rows) ``seed + i``, as SuperSuit's
      ``ConcatVecEnv.reset(seed)``; ``set_options`` gives env ``i`` its first row's options.
    - ``get_attr``, ``set_attr``, ``env_method`` and ``env_is_wrapped`` take row indices and
      act on those rows' envs, once per env (the ParallelEnv itself: its attributes, its
      methods, ``setattr`` on it; no gymnasium wrapper is found), the env's result repeated
      for each of its rows. ``get_images`` gives each row its env's frame; ``render()`` in
      ``"rgb_array"`` tiles one frame per env.
    - an env rebuilt by a ``restart_policy``: each of its rows is done, truncated, with
      ``env_restarted`` and the new episode's first observation as ``terminal_observation``.

    Args:
        env: a gymnasium id (with ``env_kwargs``), a factory returning a ``gymnasium.Env``
            or a ``pettingzoo.ParallelEnv`` (it may take a keyword ``env_index``), or a list
            of factories (one per env), as :func:`envfleet.make` takes it.
        num_envs: number of sub-environments (default 1, or ``len(env)``); with agents as
            envs, ``N``, and the SB3 ``num_envs`` is ``N * A``.
        backend: ``"serial"``, ``"threads"``, ``"processes"`` (default) or ``"ray"``, or
            :class:`envfleet.Processes` / :class:`envfleet.Ray` with options.
        env_kwargs: keyword arguments of ``gymnasium.make`` (with an id only).
        start_method: SB3's ``SubprocVecEnv`` argument, envfleet's ``Processes(context=)``: the
            ``multiprocessing`` start method of the worker processes (``None``: envfleet's
            default). Also taken positionally, as ``SubprocVecEnv(env_fns, start_method)``.
        **make_kwargs: other :func:`envfleet.make` arguments (``num_workers``,
            ``supervision``, ...), except those this class fixes: ``autoreset_mode``,
            ``batch_size``, ``copy``, ``output``.

    Attributes:
        fleet: the underlying :class:`envfleet.FleetVectorEnv` (``fleet.stats``, ...).

    Raises:
        ValueError: an unknown ``start_method`` (multiprocessing's own error, as
            ``SubprocVecEnv``).
        ConfigError: as :func:`envfleet.make`; an argument this class fixes; the ``envpool``
            backend (its envs are no Python factories to wrap); agents that do not share one
            observation space and one action space.
        envfleet.InvalidActionError: from ``step``/``step_async`` with agents as envs,
            actions that are not ``[N * A, *shape]`` (nothing is sent).
    """

    fleet: FleetVectorEnv

    def __init__(
        self,
        env: str | Callable[..., gymnasium.Env[Any, Any]] | Sequence[Callable[..., Any]],
        num_envs: int | None = None,
        *,
        backend: str | Processes | Ray = "processes",
        env_kwargs: dict[str, Any] | None = None,
        start_method: str | None = None,
        **make_kwargs: Any,
    ):
        if isinstance(num_envs, str):  # SubprocVecEnv(env_fns, start_method), positionally
            num_envs, start_method = None, num_envs
        if start_method is not None:
            # multiprocessing's own check and ValueError, as SubprocVecEnv's get_context.
            multiprocessing.get_context(start_method)
            if isinstance(backend, Processes) and backend.context not in (None, start_method):
                raise ConfigError(
                    "start_method (SB3's name) and Processes(context=...) (envfleet's) are the "
                    "same argument; pass one"
                )
            if isinstance(backend, Processes):
                backend = dataclasses.replace(backend, context=start_method)
            elif backend == "processes":
                backend = Processes(context=start_method)
            else:
                raise ConfigError(
                    f"start_method is a worker process's start method: backend={backend!r} "
                    "starts no processes"
                )
        fixed = sorted(set(make_kwargs) & set(_FIXED))
        if fixed:
            raise ConfigError(f"SB3VecEnv sets {', '.join(fixed)} itself; leave them out")
        if backend == "envpool":
            raise ConfigError(
                "SB3VecEnv wraps Python env factories; backend='envpool' has none. Use "
                "'serial', 'threads', 'processes' or 'ray'"
            )
        venv = make(
            _shim_factories(env, env_kwargs),
            num_envs,
            backend=backend,
            autoreset_mode=AutoresetMode.SAME_STEP,
            copy=False,
            **make_kwargs,
        )
        self._multi: MultiAgentVectorEnv | None = None
        self._rows: AgentRows | None = None  # agents as envs (a multi-agent vector env)
        try:
            if isinstance(venv, MultiAgentVectorEnv):
                self._multi, self.fleet = venv, venv.vector_env
                self._rows = AgentRows(
                    venv.num_envs,
                    venv.possible_agents,
                    self.fleet.get_attr("agent_observation_spaces")[0],
                    self.fleet.get_attr("agent_action_spaces")[0],
                )
                rows = (self._rows.num_rows, self._rows.observation_space)
                super().__init__(*rows, self._rows.action_space)
            else:
                self.fleet = venv
                super().__init__(
                    self.fleet.num_envs,
                    self.fleet.single_observation_space,
                    self.fleet.single_action_space,
                )
        except BaseException:
            venv.close(terminate=True)
            raise

    # -- step and reset ------------------------------------------------------------------------

    def step_async(self, actions: np.ndarray) -> None:
        """Send ``actions`` (``[num_envs, *shape]``; for a Dict or Tuple action space also
        SB3's list of one action per env) to the envs; collect with :meth:`step_wait`. Each
        env gets its action in the caller's dtype, as ``SubprocVecEnv`` sends it.

        Raises:
            envfleet.InvalidActionError: actions of the wrong shape or dtype (nothing is sent).
        """
        if self._rows is None:
            self.fleet.step_async(self._batched(actions))
        else:
            assert self._multi is not None
            self._multi.step_async(self._rows.actions(actions))

    def step_wait(self) -> VecEnvStepReturn:
        """Wait for the step: ``(obs, rewards float32[n], dones bool[n], infos list[dict])``.

        Raises:
            envfleet.EnvError, envfleet.EnvCrashedError, envfleet.StepTimeoutError: as
                :meth:`envfleet.FleetVectorEnv.step_wait`.
        """
        if self._rows is None:
            return self._sb3_step(*self.fleet.step_wait())
        assert self._multi is not None
        return self._agents_result(self._multi.step_wait())

    def step(self, actions: np.ndarray) -> VecEnvStepReturn:
        """SB3's ``step`` (``step_async`` then ``step_wait``, which SB3's algorithms call back
        to back) as one vector-env :meth:`envfleet.FleetVectorEnv.step`, which takes the fast
        step round (``step_async``/``step_wait`` do not). Same results and errors as the two
        calls.
        """
        if self._rows is not None:
            assert self._multi is not None
            return self._agents_result(self._multi.step(self._rows.actions(actions)))
        return self._sb3_step(*self.fleet.step(self._batched(actions)))

    def _batched(self, actions: Any) -> Any:
        """SB3's per-env actions for a Dict or Tuple action space (a list with one action per
        env, which ``DummyVecEnv`` and ``SubprocVecEnv`` index by env; for Dict, a tuple too)
        as gymnasium's batched actions; any other actions as they are. Each leaf keeps the
        caller's dtype, so each env gets what SB3's vec envs hand it.

        Raises:
            envfleet.InvalidActionError: not one action per env, or an env's action that
                does not fit the space's structure or shape (nothing is sent).
        """
        space = self.action_space
        per_env = (isinstance(space, spaces.Dict) and isinstance(actions, (list, tuple))) or (
            isinstance(space, spaces.Tuple) and isinstance(actions, list)
        )
        if not per_env:
            return actions
        if len(actions) != self.num_envs:
            raise InvalidActionError(
                f"actions: expected one action per env ({self.num_envs}), got {len(actions)}"
            )
        return _stack_actions(space, actions, "actions")

    def _agents_result(self, result: Any) -> VecEnvStepReturn:
        """A multi-agent step's results as agent rows (see the class)."""
        assert self._rows is not None
        obs, rewards, dones, infos, reset_infos = self._rows.step(*result)
        for row, info in reset_infos.items():
            self.reset_infos[row] = info
        return obs, rewards, dones, infos

    def _sb3_step(
        self,
        obs: Any,
        reward: np.ndarray,
        terminated: np.ndarray,
        truncated: np.ndarray,
        vector_infos: dict[str, Any],
    ) -> VecEnvStepReturn:
        """A vector env's step results in SB3's convention (see :meth:`step_wait`)."""
        dones = np.logical_or(terminated, truncated)
        observations = tree_copy(obs)
        infos = split_infos(vector_infos, self.num_envs)
        for i in range(self.num_envs):
            info = infos[i]
            if not dones[i]:
                info["TimeLimit.truncated"] = False
                continue
            # SAME_STEP: the env's reset info, plus final_obs / final_info of the ended episode.
            final_obs = info.pop("final_obs", None)
            step_info = dict(info.pop("final_info", {}))
            if final_obs is None:  # rebuilt by a restart policy: no last observation
                final_obs = tree_row(observations, i)
                step_info["env_restarted"] = info.pop("env_restarted", True)
            self.reset_infos[i] = info
            step_info["TimeLimit.truncated"] = bool(truncated[i] and not terminated[i])
            step_info["terminal_observation"] = final_obs
            infos[i] = step_info
        return observations, reward.astype(np.float32), dones, infos

    def reset(self) -> VecEnvObs:
        """Reset every env with the seeds of :meth:`seed` and the options of ``set_options``.

        Returns:
            The observations (``[num_envs, *shape]``, fresh arrays); ``reset_infos`` holds
            each env's reset info. Seeds and options are used once, as in SB3.
        """
        rows = self._rows
        seeds = list(self._seeds) if rows is None else rows.per_env(self._seeds)
        env_options = self._options if rows is None else rows.per_env(self._options)
        options: dict[str, Any] | None = None
        if all(opts == env_options[0] for opts in env_options):
            options = dict(env_options[0]) if env_options[0] else None
        else:
            # envfleet passes one options dict to every env: each env's own options go to
            # its wrapper first, which uses them in place of that one at this reset.
            per_env = dict(enumerate(env_options))
            self.fleet.call(SHIM_METHOD, "set_options", frozenset(per_env), per_env)
        self._reset_seeds()
        self._reset_options()
        if self._multi is not None and rows is not None:
            obs, vector_infos = self._multi.reset(seed=seeds, options=options)
            self.reset_infos = rows.agent_infos(vector_infos)
            return rows.observations(obs)
        obs, vector_infos = self.fleet.reset(seed=seeds, options=options)
        self.reset_infos = split_infos(vector_infos, self.num_envs)
        return tree_copy(obs)

    def seed(self, seed: int | None = None) -> Sequence[int | None]:
        """SB3's ``seed``: the seeds of the next :meth:`reset` (used once), ``seed + i`` for env
        ``i``; with agents as envs, every row of env ``i`` reads ``seed + i`` (see the class).
        ``None`` draws a random ``seed``, as SB3."""
        seeds = super().seed(seed)
        if self._rows is not None:
            self._seeds = list(self._rows.row_seeds(int(seeds[0] or 0)))
        return self._seeds

    def close(self) -> None:
        """Close the envs and release workers and shared memory (bounded, see envfleet)."""
        self.fleet.close()

    # -- attributes, methods, wrappers -----------------------------------------------------------

    def _targets(self, indices: VecEnvIndices) -> list[int]:
        """The env of each row in ``indices`` (a row is an env, unless agents are envs); a
        negative index counts from the end, as SB3's vec envs index their lists.

        Raises:
            IndexError: an index outside ``[-num_envs, num_envs)`` (nothing is sent).
        """
        n = self.num_envs
        rows = []
        for i in self._get_indices(indices):
            row = operator.index(i)
            if not -n <= row < n:
                raise IndexError(f"index {row} is out of range for {n} envs")
            rows.append(row % n)
        return rows if self._rows is None else [self._rows.env_of(row) for row in rows]

    def _on_targets(self, op: str, name: Any, indices: VecEnvIndices, *args: Any, **kw: Any) -> Any:
        targets = self._targets(indices)
        results = self.fleet.call(SHIM_METHOD, op, frozenset(targets), name, *args, **kw)
        return [results[i] for i in targets]

    def get_attr(self, attr_name: str, indices: VecEnvIndices = None) -> list[Any]:
        """The attribute ``attr_name`` of the envs in ``indices`` (``get_wrapper_attr``).

        Raises:
            AttributeError: an env has no such attribute (as SB3's VecEnvs).
        """
        values = []
        for found, value in self._on_targets("get_attr", attr_name, indices):
            if not found:
                raise AttributeError(value)
            values.append(value)
        return values

    def set_attr(self, attr_name: str, value: Any, indices: VecEnvIndices = None) -> None:
        """``setattr(env, attr_name, value)`` on the envs in ``indices``."""
        self._on_targets("set_attr", attr_name, indices, value)

    def env_method(
        self,
        method_name: str,
        *method_args: Any,
        indices: VecEnvIndices = None,
        **method_kwargs: Any,
    ) -> list[Any]:
        """Call ``method_name(*method_args, **method_kwargs)`` on the envs in ``indices``.

        Raises:
            envfleet.EnvError: the method raised (its exception chained as ``__cause__``).
        """
        results = self._on_targets(
            "env_method", method_name, indices, *method_args, **method_kwargs
        )
        return [value for _, value in results]

    def env_is_wrapped(
        self,
        wrapper_class: type[gymnasium.Wrapper[Any, Any, Any, Any]],
        indices: VecEnvIndices = None,
    ) -> list[bool]:
        """Whether each env in ``indices`` is wrapped in ``wrapper_class`` (SB3's
        ``env_util.is_wrapped``; envfleet's own index wrapper is not counted)."""
        return [bool(value) for _, value in self._on_targets("is_wrapped", wrapper_class, indices)]

    def get_images(self) -> Sequence[np.ndarray | None]:
        """Each env's ``render()`` frame; ``None`` for every env unless
        ``render_mode == "rgb_array"`` (with a warning, as SB3's DummyVecEnv)."""
        if self.render_mode != "rgb_array":
            warnings.warn(
                f"The render mode is {self.render_mode}, but this method assumes it is "
                "`rgb_array` to obtain images.",
                stacklevel=2,
            )
            return [None] * self.num_envs
        frames = list(self.fleet.render())
        return frames if self._rows is None else [frames[env] for env in self._targets(None)]

    def render(self, mode: str | None = None) -> np.ndarray | None:
        """SB3's ``VecEnv.render``; with agents as envs, ``"rgb_array"`` tiles one frame per
        env (not one per row)."""
        if self._rows is None or (mode or self.render_mode) != "rgb_array":
            return super().render(mode)
        if self.render_mode != "rgb_array":
            return super().render(mode)  # SB3's warning, and None
        return tile_images(list(self.fleet.render()))

    def __repr__(self) -> str:
        return f"SB3VecEnv({self.fleet!r})"


def _stack_actions(space: spaces.Space[Any], items: Sequence[Any], where: str) -> Any:
    """One action per env (``items``) as the batched actions of ``space``: fixed-size leaves
    stacked in the caller's dtype (gymnasium's ``concatenate`` would cast them to the space's),
    other leaves a tuple of the values, as gymnasium batches them."""
    if isinstance(space, spaces.Dict):
        for action in items:
            if not isinstance(action, Mapping) or set(action) != set(space.spaces):
                got = sorted(action) if isinstance(action, Mapping) else type(action).__name__
                raise InvalidActionError(
                    f"{where}: expected per env a dict with keys {sorted(space.spaces)}, got {got}"
                )
        return {
            key: _stack_actions(sub, [action[key] for action in items], f"{where}[{key!r}]")
            for key, sub in space.spaces.items()
        }
    if isinstance(space, spaces.Tuple):
        for action in items:
            if not isinstance(action, (tuple, list)) or len(action) != len(space.spaces):
                raise InvalidActionError(
                    f"{where}: expected per env a tuple of {len(space.spaces)} actions"
                )
        return tuple(
            _stack_actions(sub, [action[k] for action in items], f"{where}[{k}]")
            for k, sub in enumerate(space.spaces)
        )
    if not is_leaf(space):
        return tuple(items)
    try:
        return np.stack([np.asarray(action) for action in items])
    except ValueError as exc:  # rows of different shapes
        raise InvalidActionError(f"{where}: the envs' actions do not stack ({exc})") from exc


def _shim_factories(
    env: str | Callable[..., gymnasium.Env[Any, Any]] | Sequence[Callable[..., Any]],
    env_kwargs: dict[str, Any] | None,
) -> ShimFactory | list[ShimFactory]:
    if isinstance(env, str):
        check_gymnasium_id(env)
        return ShimFactory(GymMake(env, env_kwargs))
    if env_kwargs is not None:
        raise ConfigError("env_kwargs is only for a gymnasium id; bind arguments in your factory")
    if callable(env):
        return ShimFactory(env)
    if isinstance(env, Iterable) and not isinstance(env, (str, bytes)):
        fns = list(env)
        if fns and all(callable(fn) for fn in fns):
            shims: dict[int, ShimFactory] = {}
            return [shims.setdefault(id(fn), ShimFactory(fn)) for fn in fns]
    raise ConfigError(
        "env must be a gymnasium id, a callable returning a gymnasium.Env, or a non-empty list "
        f"of such callables; got {type(env).__name__}"
    )
