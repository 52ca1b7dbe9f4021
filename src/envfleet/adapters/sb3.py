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
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import gymnasium
import numpy as np
from gymnasium.vector import AutoresetMode

from envfleet._errors import ConfigError
from envfleet._front.factories import GymMake, check_env_id
from envfleet._front.make import make
from envfleet._front.vector_env import FleetVectorEnv
from envfleet._trees import tree_copy, tree_row
from envfleet.adapters._sb3_shim import SHIM_METHOD, ShimFactory
from envfleet.adapters.infos import split_infos

try:
    from stable_baselines3.common.vec_env.base_vec_env import (
        VecEnv,
        VecEnvIndices,
        VecEnvObs,
        VecEnvStepReturn,
    )
except ImportError as _exc:  # pragma: no cover - depends on the installed extras
    raise ConfigError(
        f"envfleet.adapters.sb3 needs stable-baselines3 ({_exc}): pip install 'envfleet[sb3]'"
    ) from _exc

__all__ = ["SB3VecEnv"]

_FIXED = ("autoreset_mode", "batch_size", "copy", "output", "device", "pin_memory")


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
      in ``indices`` (``None``: all; an int: that one), results in the order of ``indices``.
      ``get_attr`` raises ``AttributeError`` for a missing attribute; ``set_attr`` sets the
      attribute on the outermost wrapper of your env, as SB3's ``setattr(env, ...)``.
    - ``render``/``get_images``: SB3's ``VecEnv.render`` over the envs' ``render()`` frames
      (``render_mode="rgb_array"``).

    Infos come from gymnasium's vector infos, split per env: Python ``int``/``float`` values
    an env returns come back as numpy scalars of equal value, and an info's keys in the order
    the vector infos first saw them (over all envs), SB3's two keys last.

    With a ``restart_policy``, an env rebuilt after a fault ends its episode as truncated with
    ``info["env_restarted"]``; it has no last observation, so ``terminal_observation`` is
    then the new episode's first.

    Args:
        env: a gymnasium id (with ``env_kwargs``), a factory returning a ``gymnasium.Env``
            (it may take a keyword ``env_index``), or a list of factories (one per env), as
            :func:`envfleet.make` takes it.
        num_envs: number of sub-environments (default 1, or ``len(env)``).
        backend: ``"serial"``, ``"threads"``, ``"processes"`` (default) or ``"ray"``.
        env_kwargs: keyword arguments of ``gymnasium.make`` (with an id only).
        **make_kwargs: other :func:`envfleet.make` arguments (``num_workers``,
            ``step_timeout``, ``restart_policy``, ``context``, ...), except those this class
            fixes: ``autoreset_mode``, ``batch_size``, ``copy``, ``output``, ``device``,
            ``pin_memory``.

    Attributes:
        fleet: the underlying :class:`envfleet.FleetVectorEnv` (``fleet.stats``, ...).

    Raises:
        ConfigError: as :func:`envfleet.make`; an argument this class fixes; the ``envpool``
            backend (its envs are no Python factories to wrap).
    """

    def __init__(
        self,
        env: str | Callable[..., gymnasium.Env[Any, Any]] | Sequence[Callable[..., Any]],
        num_envs: int | None = None,
        *,
        backend: str = "processes",
        env_kwargs: dict[str, Any] | None = None,
        **make_kwargs: Any,
    ):
        fixed = sorted(set(make_kwargs) & set(_FIXED))
        if fixed:
            raise ConfigError(f"SB3VecEnv sets {', '.join(fixed)} itself; leave them out")
        if backend == "envpool":
            raise ConfigError(
                "SB3VecEnv wraps Python env factories; backend='envpool' has none. Use "
                "'serial', 'threads', 'processes' or 'ray'"
            )
        self.fleet: FleetVectorEnv = make(
            _shim_factories(env, env_kwargs),
            num_envs,
            backend=backend,
            autoreset_mode=AutoresetMode.SAME_STEP,
            copy=False,
            **make_kwargs,
        )
        try:
            super().__init__(
                self.fleet.num_envs,
                self.fleet.single_observation_space,
                self.fleet.single_action_space,
            )
        except BaseException:
            self.fleet.close(terminate=True)
            raise

    # -- step and reset ------------------------------------------------------------------------

    def step_async(self, actions: np.ndarray) -> None:
        """Send ``actions`` (``[num_envs, *shape]``) to the envs; collect with :meth:`step_wait`.

        Raises:
            envfleet.InvalidActionError: actions of the wrong shape or dtype (nothing is sent).
        """
        self.fleet.step_async(actions)

    def step_wait(self) -> VecEnvStepReturn:
        """Wait for the step: ``(obs, rewards float32[n], dones bool[n], infos list[dict])``.

        Raises:
            envfleet.EnvError, envfleet.EnvCrashedError, envfleet.StepTimeoutError: as
                :meth:`envfleet.FleetVectorEnv.step_wait`.
        """
        return self._sb3_step(*self.fleet.step_wait())

    def step(self, actions: np.ndarray) -> VecEnvStepReturn:
        """SB3's ``step`` (``step_async`` then ``step_wait``, which SB3's algorithms call back
        to back) as one vector-env :meth:`envfleet.FleetVectorEnv.step`, which takes the fast
        step round (``step_async``/``step_wait`` do not). Same results and errors as the two
        calls.
        """
        return self._sb3_step(*self.fleet.step(actions))

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
        options: dict[str, Any] | None = None
        if all(opts == self._options[0] for opts in self._options):
            options = dict(self._options[0]) if self._options[0] else None
        else:
            # envfleet passes one options dict to every env: each env's own options go to
            # its wrapper first, which uses them in place of that one at this reset.
            per_env = dict(enumerate(self._options))
            self._on_targets("set_options", per_env, None)
        obs, vector_infos = self.fleet.reset(seed=list(self._seeds), options=options)
        self.reset_infos = split_infos(vector_infos, self.num_envs)
        self._reset_seeds()
        self._reset_options()
        return tree_copy(obs)

    def close(self) -> None:
        """Close the envs and release workers and shared memory (bounded, see envfleet)."""
        self.fleet.close()

    # -- attributes, methods, wrappers -----------------------------------------------------------

    def _targets(self, indices: VecEnvIndices) -> list[int]:
        return [int(i) for i in self._get_indices(indices)]

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
        return list(self.fleet.render())

    def __repr__(self) -> str:
        return f"SB3VecEnv({self.fleet!r})"


def _shim_factories(
    env: str | Callable[..., gymnasium.Env[Any, Any]] | Sequence[Callable[..., Any]],
    env_kwargs: dict[str, Any] | None,
) -> ShimFactory | list[ShimFactory]:
    if isinstance(env, str):
        check_env_id(env)
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
