"""TorchRL adapter: TorchRL's own ``GymWrapper`` over an envfleet vector env.

TorchRL wraps batched gymnasium vector envs itself (``torchrl.envs.GymWrapper``): the batch
size is ``[num_envs]`` and ``env.rollout(n)`` returns a TensorDict of ``[num_envs, n]``. An
envfleet vector env is a gymnasium ``VectorEnv``, so no adapter class is needed; these
functions build one the way TorchRL accepts it::

    from envfleet.adapters.torchrl import make_torchrl_env

    env = make_torchrl_env("CartPole-v1", 8, backend="processes")
    rollout = env.rollout(100, break_when_any_done=False)   # batch_size [8, 100]
    env.close()

What TorchRL needs (from torchrl's ``GymWrapper`` for gymnasium >= 1.1):

- ``autoreset_mode``: ``DISABLED`` (TorchRL's preferred mode: it resets finished envs itself
  through gymnasium's ``reset_mask``) or ``SAME_STEP`` (TorchRL reads ``final_obs`` from the
  infos); TorchRL refuses ``NEXT_STEP``.
- ``copy=True``: TorchRL keeps the arrays a step returns (the next step's ``"observation"``
  is the previous ``("next", "observation")``), so they must not be envfleet's reused views.
- Importing torchrl sets multiprocessing's start method to ``"spawn"`` (TorchRL's default):
  envfleet's ``processes`` backend then starts its workers with spawn unless you pass
  ``context="fork"``.

Needs ``pip install 'envfleet[torchrl]'``.
"""

from __future__ import annotations

from typing import Any

from gymnasium.vector import AutoresetMode

from envfleet._errors import ConfigError
from envfleet._front.make import make
from envfleet._front.vector_env import FleetVectorEnv

try:
    from torchrl.envs import EnvBase, GymWrapper
except ImportError as _exc:  # pragma: no cover - depends on the installed extras
    raise ConfigError(
        f"envfleet.adapters.torchrl needs torchrl ({_exc}): pip install 'envfleet[torchrl]'"
    ) from _exc

__all__ = ["make_torchrl_env", "to_torchrl"]

_MODES = (AutoresetMode.DISABLED, AutoresetMode.SAME_STEP)


def to_torchrl(env: FleetVectorEnv, **wrapper_kwargs: Any) -> EnvBase:
    """Wrap ``env`` in TorchRL's ``GymWrapper`` (batch size ``[env.num_envs]``).

    Args:
        env: an envfleet vector env made with ``autoreset_mode`` ``DISABLED`` or
            ``SAME_STEP``, ``copy=True`` and no ``batch_size`` (no first-ready pool).
        **wrapper_kwargs: passed to ``GymWrapper`` (``device``, ``categorical_action_encoding``,
            ...).

    Returns:
        A TorchRL env: ``GymWrapper`` itself for ``DISABLED``; for ``SAME_STEP``, TorchRL's
        ``TransformedEnv`` over it with its ``VecGymEnvTransform``. Closing it closes ``env``.

    Raises:
        ConfigError: ``NEXT_STEP`` autoreset, ``copy=False``, or a first-ready pool.
    """
    if env.autoreset_mode not in _MODES:
        raise ConfigError(
            f"TorchRL wraps vector envs with autoreset_mode DISABLED or SAME_STEP, not "
            f"{env.autoreset_mode}; make the env with autoreset_mode=AutoresetMode.DISABLED"
        )
    if not env.copy:
        raise ConfigError(
            "TorchRL keeps the arrays a step returns: make the env with copy=True (views of "
            "envfleet's buffers are rewritten by the next step)"
        )
    if env.is_pool:
        raise ConfigError("TorchRL steps every env at once: a first-ready pool cannot be wrapped")
    return GymWrapper(env, **wrapper_kwargs)


def make_torchrl_env(
    env: Any,
    num_envs: int | None = None,
    *,
    autoreset_mode: AutoresetMode = AutoresetMode.DISABLED,
    wrapper_kwargs: dict[str, Any] | None = None,
    **make_kwargs: Any,
) -> EnvBase:
    """:func:`envfleet.make` then :func:`to_torchrl`: a TorchRL env over envfleet.

    Args:
        env, num_envs, **make_kwargs: as :func:`envfleet.make` (``backend``, ``num_workers``,
            ``env_kwargs``, ``context``, ...); ``copy``, ``batch_size`` and ``output`` are
            fixed by what TorchRL needs.
        autoreset_mode: ``DISABLED`` (default, TorchRL's preferred) or ``SAME_STEP``.
        wrapper_kwargs: keyword arguments of TorchRL's ``GymWrapper``.

    Raises:
        ConfigError: as :func:`envfleet.make` and :func:`to_torchrl`; ``copy``,
            ``batch_size`` or ``output`` given.
    """
    fixed = sorted({"copy", "batch_size", "output", "device", "pin_memory"} & set(make_kwargs))
    if fixed:
        raise ConfigError(
            f"make_torchrl_env sets {', '.join(fixed)} itself; pass GymWrapper's own options "
            "(device=...) in wrapper_kwargs"
        )
    if autoreset_mode not in _MODES:
        raise ConfigError(f"autoreset_mode must be DISABLED or SAME_STEP, got {autoreset_mode}")
    venv = make(env, num_envs, autoreset_mode=autoreset_mode, copy=True, **make_kwargs)
    try:
        return to_torchrl(venv, **(wrapper_kwargs or {}))
    except BaseException:
        venv.close(terminate=True)
        raise
