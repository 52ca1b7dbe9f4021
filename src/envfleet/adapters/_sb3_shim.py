"""The worker side of :class:`envfleet.adapters.sb3.SB3VecEnv` (imports no stable-baselines3).

stable-baselines3's ``env_method``, ``get_attr``, ``set_attr`` and ``env_is_wrapped`` act on
chosen envs (``indices``) only. gymnasium's ``call`` reaches every env, so each env is
wrapped in :class:`SB3Shim`, which knows its global index and acts only when it is chosen.
A factory that returns a PettingZoo ``ParallelEnv`` gets it adapted here
(:class:`envfleet._front.multi_agent.ParallelEnvAdapter`, as :func:`envfleet.make` would adapt
it) and the adapter wrapped: the ops then act on the ParallelEnv itself. This module is kept free of
stable-baselines3 (and torch) so that workers load it fast.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

import gymnasium

from envfleet._backends.base import accepts_env_index
from envfleet._front.multi_agent import ParallelEnvAdapter, is_parallel_env

__all__ = ["SHIM_METHOD", "SB3Shim", "ShimFactory"]

SHIM_METHOD = "envfleet_sb3"  # the shim's method, reached through gymnasium's call()


class SB3Shim(gymnasium.Wrapper[Any, Any, Any, Any]):
    """A transparent wrapper that runs stable-baselines3's per-env calls on its env.

    ``step``, ``reset``, ``render`` and ``close`` pass through unchanged. Over a
    :class:`ParallelEnvAdapter`, the ops act on its ParallelEnv (``par_env``): attributes,
    methods and ``setattr`` are the PettingZoo env's, and no gymnasium wrapper is found.
    """

    def __init__(self, env: gymnasium.Env[Any, Any], env_index: int):
        super().__init__(env)
        self.envfleet_env_index = env_index
        self._parallel: Any = env.par_env if isinstance(env, ParallelEnvAdapter) else None
        self._next_options: dict[str, Any] | None = None  # this env's options for next reset

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[Any, dict[str, Any]]:
        """The env's reset; options set by the ``"set_options"`` op replace ``options`` once."""
        if self._next_options is not None:
            options, self._next_options = (self._next_options or None), None
        return self.env.reset(seed=seed, options=options)

    def envfleet_sb3(
        self, op: str, targets: Collection[int], name: Any, *args: Any, **kwargs: Any
    ) -> tuple[bool, Any] | None:
        """Run ``op`` if this env is among ``targets``; ``None`` otherwise.

        Ops, as stable-baselines3's SubprocVecEnv worker runs them on its env:
        ``"env_method"``: ``env.get_wrapper_attr(name)(*args, **kwargs)``; ``"get_attr"``:
        ``env.get_wrapper_attr(name)``; ``"set_attr"``: ``setattr(env, name, args[0])``;
        ``"is_wrapped"``: whether a wrapper in the chain is an instance of ``name`` (SB3's
        ``env_util.is_wrapped``). ``"set_options"``: ``name`` maps env indices to the
        options of their next reset (SB3's per-env ``_options``). Returns ``(True, result)``,
        or ``(False, message)`` for a ``get_attr`` of a missing attribute.
        """
        if self.envfleet_env_index not in targets:
            return None
        env: Any = self.env if self._parallel is None else self._parallel
        if op == "env_method":
            return True, self._attr(env, name)(*args, **kwargs)
        if op == "get_attr":
            try:
                return True, self._attr(env, name)
            except AttributeError as exc:
                return False, str(exc)
        if op == "set_attr":
            setattr(env, name, args[0])
            return True, None
        if op == "set_options":
            self._next_options = dict(name.get(self.envfleet_env_index) or {})
            return True, None
        if op == "is_wrapped":
            inner: Any = env
            while isinstance(inner, gymnasium.Wrapper):
                if isinstance(inner, name):
                    return True, True
                inner = inner.env
            return True, False
        raise ValueError(f"unknown op {op!r}")

    def _attr(self, env: Any, name: str) -> Any:
        if self._parallel is None:
            return env.get_wrapper_attr(name)
        return getattr(env, name)


class ShimFactory:
    """Picklable factory: the wrapped factory's env in an :class:`SB3Shim` with its index (a
    ParallelEnv adapted first, in a :class:`ParallelEnvAdapter`)."""

    def __init__(self, factory: Callable[..., Any]):
        self.factory = factory
        self.accepts_index = accepts_env_index(factory)

    def __call__(self, env_index: int) -> Any:
        env = self.factory(env_index=env_index) if self.accepts_index else self.factory()
        if is_parallel_env(env):
            return SB3Shim(ParallelEnvAdapter(env), env_index)
        if not isinstance(env, gymnasium.Env):
            return env  # not an env: envfleet.make reports it
        return SB3Shim(env, env_index)

    def __repr__(self) -> str:
        return f"ShimFactory({self.factory!r})"
