"""TorchRL adapter: a ``torchrl.envs.EnvBase`` over an envfleet vector env.

:class:`FleetTorchRLEnv` is a TorchRL env of its own (not TorchRL's ``GymWrapper``): batch size
``[num_envs]``, specs built from the gymnasium spaces, TorchRL's root/``"next"`` layout, and
partial resets through ``"_reset"`` masks, so TorchRL's collectors, transforms and losses run on
it directly::

    from envfleet.adapters.torchrl import make_torchrl_env
    from torchrl.envs.utils import check_env_specs

    env = make_torchrl_env("CartPole-v1", 8, backend="processes")
    check_env_specs(env)
    env.set_seed(0)
    rollout = env.rollout(100, break_when_any_done=False)   # batch_size [8, 100]
    rollout["next", "reward"]                               # torch.float32[8, 100, 1]
    env.close()

Each convention and where it comes from (TorchRL's ``EnvBase`` contract, and its
``GymWrapper`` over gymnasium vector envs where the contract leaves a choice):

- ``reset`` returns the root entries (observations, ``done``/``terminated``/``truncated`` all
  False); ``step`` writes ``"next"`` (observations, ``reward``, the done flags) beside the
  root, and ``torchrl.envs.utils.step_mdp`` moves ``"next"`` to the root (``EnvBase``).
- Done flags and rewards have a trailing dimension of 1: ``bool[num_envs, 1]`` flags
  (``Categorical(2, dtype=torch.bool)`` specs), ``reward: float32[num_envs, 1]`` (an
  ``Unbounded`` spec of torch's default dtype, as ``GymWrapper`` makes it; gymnasium's float64
  rewards are rounded to float32 once, deterministically).
- A finished env stays finished until TorchRL resets it with a ``"_reset"`` mask
  (``bool[num_envs, 1]``, ``EnvBase.maybe_reset``): only the masked envs are reset, through
  gymnasium's ``reset_mask`` option, so the vector env runs with ``AutoresetMode.DISABLED``
  (the mode ``GymWrapper`` prefers for gymnasium >= 1.1).
- ``set_seed(seed)`` resets every env now with ``reset(seed=seed)`` (env ``i`` gets
  ``seed + i``, gymnasium's vector convention), as ``GymWrapper`` does; the next ``reset``
  continues from there.
- ``Discrete`` actions are one-hot (``OneHot``, ``int64``) unless
  ``categorical_action_encoding=True`` (``Categorical``), ``GymWrapper``'s default and option.
  ``MultiDiscrete`` actions: ``MultiOneHot`` / ``MultiCategorical``.

Where this adapter departs from ``GymWrapper``, it keeps envfleet's ``output="torch"`` layout
(:meth:`envfleet.torch.TorchVectorEnv.reset_tensordict` and ``step_tensordict`` produce this
env's root and ``"next"`` entries): ``Dict`` observations are nested under ``"observation"``
(``td["observation", "key"]``; ``GymWrapper`` puts their keys at the root), ``Tuple`` ones under
``"observation", "0"``, ... (``GymWrapper`` stacks them), and ``Discrete`` observations are
their raw index (``Categorical``; ``GymWrapper`` one-hot encodes them).

Importing torchrl sets multiprocessing's start method to ``"spawn"`` (TorchRL's default):
envfleet's ``processes`` backend then starts its workers with spawn unless you pass
``backend=envfleet.Processes(context="fork")``. Needs ``pip install 'envfleet[torchrl]'``.
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium.vector import AutoresetMode, VectorEnv

from envfleet._core.errors import ConfigError
from envfleet._front.make import make
from envfleet.torch import TorchVectorEnv

try:
    import torch
    from tensordict import TensorDictBase
    from torchrl.data import (
        Binary,
        Bounded,
        Categorical,
        Composite,
        MultiCategorical,
        MultiOneHot,
        OneHot,
        TensorSpec,
        Unbounded,
    )
    from torchrl.envs import EnvBase
except ImportError as _exc:  # pragma: no cover - depends on the installed extras
    raise ConfigError(
        f"envfleet.adapters.torchrl needs torchrl ({_exc}): pip install 'envfleet[torchrl]'"
    ) from _exc

__all__ = ["FleetTorchRLEnv", "make_torchrl_env", "space_to_spec", "to_torchrl"]

_FLAGS = ("done", "terminated", "truncated")


def _torch_dtype(dtype: Any) -> torch.dtype:
    return torch.from_numpy(np.empty(0, dtype=dtype)).dtype


def space_to_spec(
    space: gym.Space[Any],
    *,
    action: bool = False,
    categorical_action_encoding: bool = False,
    device: Any = None,
) -> TensorSpec:
    """The TorchRL spec of one (unbatched) gymnasium space, as :class:`FleetTorchRLEnv` uses it.

    TorchRL's own conversion (``torchrl.envs.libs.gym._gym_to_torchrl_spec_transform``) is
    private, so this one builds TorchRL's public spec classes with its rules:

    - ``Box(low, high, shape, dtype)``: ``Unbounded`` when every bound is infinite (or the
      dtype's extremes), else ``Bounded(low, high)``; same shape and dtype.
    - ``Discrete(n)``: actions ``OneHot(n)`` (``int64[n]``), or ``Categorical(n)`` of the
      space's dtype with ``categorical_action_encoding``; observations ``Categorical(n)``,
      ``int64[]`` (the raw index, as ``output="torch"`` gives it).
    - ``MultiDiscrete(nvec)`` (one-dimensional): actions ``MultiOneHot(nvec)`` or
      ``MultiCategorical(nvec)``; observations ``MultiCategorical(nvec)`` of the space's dtype.
    - ``MultiBinary(n)``: ``Binary(n)``, ``int8``.
    - ``Dict``/``Tuple`` (observations only): ``Composite`` keyed by the dict's keys, or
      ``"0"``, ``"1"``, ... for a tuple.

    Args:
        space: a gymnasium space of one env (``env.single_observation_space``).
        action: whether ``space`` is an action space (discrete encodings differ).
        categorical_action_encoding: ``Discrete``/``MultiDiscrete`` actions as indices.
        device: the specs' device (``None``: none).

    Raises:
        ConfigError: a space with no spec here: ``Discrete``/``MultiDiscrete`` with a
            nonzero ``start``, a ``MultiDiscrete`` of more than one dimension, a ``Dict`` or
            ``Tuple`` action space, or any other space (Text, Graph, Sequence, ...).

    Example::

        >>> space_to_spec(gym.spaces.Discrete(2), action=True)
        OneHot(shape=torch.Size([2]), ...)
    """
    one_hot = action and not categorical_action_encoding
    if isinstance(space, gym.spaces.Box):
        dtype = _torch_dtype(space.dtype)
        low = torch.as_tensor(space.low, dtype=dtype, device=device)
        high = torch.as_tensor(space.high, dtype=dtype, device=device)
        info = torch.finfo(dtype) if dtype.is_floating_point else torch.iinfo(dtype)
        if bool(((low == -np.inf) | (low == info.min)).all()) and bool(
            ((high == np.inf) | (high == info.max)).all()
        ):
            return Unbounded(space.shape, dtype=dtype, device=device)
        return Bounded(low, high, space.shape, dtype=dtype, device=device)
    if isinstance(space, gym.spaces.Discrete):
        if int(space.start) != 0:
            raise ConfigError(f"{space}: TorchRL's discrete specs start at 0, this one does not")
        n = int(space.n)
        if one_hot:
            return OneHot(n, dtype=torch.long, device=device)
        dtype = _torch_dtype(space.dtype) if action else torch.int64
        return Categorical(n, shape=(), dtype=dtype, device=device)
    if isinstance(space, gym.spaces.MultiDiscrete):
        if space.nvec.ndim != 1 or bool((space.start != 0).any()):
            raise ConfigError(
                f"{space}: only one-dimensional MultiDiscrete spaces starting at 0 have a "
                "TorchRL spec here"
            )
        nvec = [int(n) for n in space.nvec]
        if one_hot:
            return MultiOneHot(nvec, dtype=torch.long, device=device)
        return MultiCategorical(nvec, dtype=_torch_dtype(space.dtype), device=device)
    if isinstance(space, gym.spaces.MultiBinary):
        return Binary(
            n=int(np.prod(space.shape)), shape=space.shape, dtype=torch.int8, device=device
        )
    if isinstance(space, gym.spaces.Dict | gym.spaces.Tuple) and not action:
        items = space.spaces.items() if isinstance(space, gym.spaces.Dict) else enumerate(space)
        return Composite(
            {str(k): space_to_spec(s, device=device) for k, s in items}, shape=(), device=device
        )
    raise ConfigError(
        f"no TorchRL spec for the {'action' if action else 'observation'} space {space}: "
        "FleetTorchRLEnv takes Box, Discrete, MultiDiscrete and MultiBinary spaces (and "
        "Dict/Tuple observations)"
    )


def _autoreset_mode(env: VectorEnv[Any, Any, Any]) -> Any:
    mode = getattr(env, "autoreset_mode", None)
    return env.metadata.get("autoreset_mode") if mode is None else mode


class FleetTorchRLEnv(EnvBase):
    """A TorchRL env (``torchrl.envs.EnvBase``) over a vector env: batch size ``[num_envs]``.

    Entries (``N = num_envs``; the module docstring gives each convention's source):

    ==============================  ========================================================
    key                             value
    ==============================  ========================================================
    ``"observation"``               ``[N, *shape]`` of the observation space's dtype (for
                                    CartPole ``float32[N, 4]``); Dict/Tuple spaces nested
    ``"action"`` (input)            ``int64[N, n]`` one-hot for ``Discrete(n)`` (``[N]``
                                    indices with ``categorical_action_encoding``), the
                                    space's dtype and ``[N, *shape]`` for ``Box``
    ``("next", "reward")``          ``float32[N, 1]``
    ``"done"``, ``"terminated"``,   ``bool[N, 1]``, at the root after ``reset`` and in
    ``"truncated"``                 ``"next"`` after ``step`` (``done = terminated |
                                    truncated``)
    ==============================  ========================================================

    The wrapped env's values come through unchanged (observations, flags; rewards rounded to
    float32): a rollout is bit-identical to the same seeds and actions on gymnasium's
    ``SyncVectorEnv`` with ``autoreset_mode=DISABLED``, finished envs reset through
    ``reset_mask``. The tensors of each step are that step's own (the adapter reads the env
    through :class:`envfleet.torch.TorchVectorEnv` with ``copy=True``), so a rollout may keep
    them.

    Args:
        env: a gymnasium vector env with ``autoreset_mode=DISABLED``: an
            :class:`envfleet.FleetVectorEnv` (``copy`` either way), or any other, gymnasium's
            included. Closing this env closes it.
        device: where the tensors and specs live (``None``: the CPU, no spec device).
        categorical_action_encoding: ``Discrete`` actions as indices (``Categorical``) rather
            than one-hot (``OneHot``), as ``GymWrapper``'s option of that name.

    Raises:
        ConfigError: another autoreset mode (a first-ready pool has none but NEXT_STEP and
            SAME_STEP), a multi-agent env, a space without a spec (:func:`space_to_spec`),
            torch or tensordict missing.

    Example::

        >>> venv = envfleet.make("Pendulum-v1", 4, autoreset_mode=AutoresetMode.DISABLED)
        >>> env = FleetTorchRLEnv(venv)
        >>> td = env.rand_step(env.reset())       # td["next", "observation"]: float32[4, 3]
        >>> env.close()                            # closes venv too
    """

    def __init__(
        self,
        env: VectorEnv[Any, Any, Any],
        *,
        device: Any = None,
        categorical_action_encoding: bool = False,
    ):
        if getattr(env, "possible_agents", None) is not None:
            raise ConfigError(
                "FleetTorchRLEnv is single-agent; a multi-agent env (envfleet.MultiAgentVectorEnv) "
                "gives tensors with output='torch' and TensorDicts with its reset_tensordict and "
                "step_tensordict"
            )
        if _autoreset_mode(env) != AutoresetMode.DISABLED:
            raise ConfigError(
                "FleetTorchRLEnv resets finished envs itself (TorchRL's '_reset' masks): make "
                f"the env with autoreset_mode=AutoresetMode.DISABLED, not {_autoreset_mode(env)}"
            )
        super().__init__(device=device, batch_size=torch.Size([env.num_envs]))
        self._tenv = TorchVectorEnv(env, device=device, copy=True)
        self.venv = env
        n = env.num_envs
        obs = space_to_spec(env.single_observation_space, device=device)
        act = space_to_spec(
            env.single_action_space,
            action=True,
            categorical_action_encoding=categorical_action_encoding,
            device=device,
        )
        self.observation_spec = Composite(observation=obs.expand(n, *obs.shape), shape=(n,))
        self.action_spec = act.expand(n, *act.shape)
        self.reward_spec = Unbounded(shape=(n, 1), dtype=torch.float32, device=device)
        flag = Categorical(2, shape=(n, 1), dtype=torch.bool, device=device)
        self.done_spec = Composite({k: flag.clone() for k in _FLAGS}, shape=(n,))
        self.is_closed = False

    @property
    def num_envs(self) -> int:
        """The number of sub-environments (the batch size)."""
        return int(self.venv.num_envs)

    def _reset(self, tensordict: TensorDictBase | None = None, **kwargs: Any) -> TensorDictBase:
        """Reset the envs ``tensordict["_reset"]`` marks (``bool[N, 1]``), or every env.

        Returns the root entries for every env (TorchRL keeps the input's entries for the envs
        not reset): ``"observation"`` and the done flags, all False.
        """
        options = dict(kwargs.pop("options", None) or {})
        if tensordict is not None and "_reset" in tensordict:
            mask = tensordict.get("_reset").reshape(self.num_envs).cpu().numpy()
            if not mask.any():  # gymnasium refuses an empty reset_mask: nothing to reset
                kept = tensordict.select("observation", *_FLAGS, strict=False)
                return kept.clone()
            if not mask.all():
                options["reset_mask"] = mask
        return self._tenv.reset_tensordict(seed=kwargs.pop("seed", None), options=options or None)

    def _step(self, tensordict: TensorDictBase) -> TensorDictBase:
        """Step every env with ``tensordict["action"]``; returns the ``"next"`` entries."""
        actions = self.action_spec.to_numpy(tensordict.get("action"), safe=False)
        out = self._tenv.step_tensordict(actions)
        out.set("reward", out.get("reward").to(torch.float32))
        return out

    def _set_seed(self, seed: int | None) -> None:
        """Reset every env now with ``reset(seed=seed)`` (TorchRL's ``GymWrapper`` does so)."""
        self._tenv.reset(seed=seed)

    def close(self, *, raise_if_closed: bool = True) -> None:
        """Close the wrapped vector env (its workers, its shared memory), then this env."""
        if not self.is_closed:
            self.venv.close()
        super().close(raise_if_closed=raise_if_closed)


def to_torchrl(
    env: VectorEnv[Any, Any, Any],
    *,
    device: Any = None,
    categorical_action_encoding: bool = False,
) -> FleetTorchRLEnv:
    """:class:`FleetTorchRLEnv` over ``env`` (made with ``autoreset_mode=DISABLED``).

    Raises:
        ConfigError: as :class:`FleetTorchRLEnv`.

    Example::

        >>> env = to_torchrl(envfleet.make("CartPole-v1", 8, autoreset_mode=AutoresetMode.DISABLED))
    """
    return FleetTorchRLEnv(
        env, device=device, categorical_action_encoding=categorical_action_encoding
    )


def make_torchrl_env(
    env: Any,
    num_envs: int | None = None,
    *,
    device: Any = None,
    categorical_action_encoding: bool = False,
    **make_kwargs: Any,
) -> FleetTorchRLEnv:
    """:func:`envfleet.make` with ``autoreset_mode=DISABLED``, then :class:`FleetTorchRLEnv`.

    Args:
        env, num_envs, **make_kwargs: as :func:`envfleet.make` (``backend``, ``num_workers``,
            ``env_kwargs``, ``context``, ...).
        device, categorical_action_encoding: as :class:`FleetTorchRLEnv`.

    Raises:
        ConfigError: as :func:`envfleet.make` and :class:`FleetTorchRLEnv`;
            ``autoreset_mode``, ``batch_size`` or ``output`` given (the adapter sets or does
            not use them).

    Example::

        >>> fork = envfleet.Processes(context="fork")
        >>> env = make_torchrl_env("CartPole-v1", 8, backend=fork)
        >>> env.rollout(10).batch_size                       # torch.Size([8, 10])
    """
    fixed = sorted({"autoreset_mode", "batch_size", "output"} & set(make_kwargs))
    if fixed:
        raise ConfigError(
            f"make_torchrl_env sets {', '.join(fixed)} itself: TorchRL resets finished envs "
            "(autoreset_mode=DISABLED) and steps every env at once"
        )
    make_kwargs.setdefault("copy", False)  # the adapter copies each step into its own tensors
    venv = make(env, num_envs, autoreset_mode=AutoresetMode.DISABLED, **make_kwargs)
    try:
        return FleetTorchRLEnv(
            venv, device=device, categorical_action_encoding=categorical_action_encoding
        )
    except BaseException:
        venv.close(terminate=True)
        raise
