"""Env factories of the front: gymnasium ids as picklable factories (:class:`GymMake`), the
factory list make() takes, their pickling for other processes, and building one env.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from typing import Any

import cloudpickle
import gymnasium

from envfleet._core.envgroup import not_an_env_error
from envfleet._core.errors import ConfigError
from envfleet._core.failures import env_error

__all__ = [
    "EnvFactory",
    "GymMake",
    "build_env",
    "check_gymnasium_id",
    "env_factories",
    "pickle_factories",
    "register_namespace",
]

EnvFactory = Callable[..., gymnasium.Env[Any, Any]]


class GymMake:
    """Picklable factory ``gymnasium.make(env_id, **env_kwargs)``.

    Ids in the ``ALE/`` namespace import ``ale_py`` first, which registers the Atari envs;
    ``"module:EnvId"`` ids import ``module`` first (in each worker too), as gymnasium does.
    """

    def __init__(self, env_id: str, env_kwargs: dict[str, Any] | None = None):
        self.env_id = env_id
        self.env_kwargs = dict(env_kwargs or {})

    def __call__(self) -> gymnasium.Env[Any, Any]:
        return gymnasium.make(register_namespace(self.env_id), **self.env_kwargs)

    def __repr__(self) -> str:
        return f"GymMake({self.env_id!r}, {self.env_kwargs!r})"


def register_namespace(env_id: str) -> str:
    """Import what registers ``env_id`` and return the id without its module: the module of
    a ``"module:EnvId"`` id (as ``gymnasium.make`` does), the package of a namespace where
    one is known (ALE).

    Raises:
        ConfigError: the module, or the namespace's package, cannot be imported.
    """
    if ":" in env_id:
        module, env_id = env_id.split(":", 1)
        try:
            importlib.import_module(module)
        except ImportError as exc:
            raise ConfigError(
                f"cannot import module {module!r} of environment id {module}:{env_id}: {exc}"
            ) from exc
    if env_id.startswith("ALE/"):
        try:
            import ale_py
        except ImportError as exc:
            raise ConfigError(f"{env_id!r} needs ale-py: pip install 'envfleet[atari]'") from exc
        gymnasium.register_envs(ale_py)
    return env_id


def check_gymnasium_id(gymnasium_id: str) -> None:
    """Check that ``gymnasium_id`` is a registered gymnasium id, importing its namespace (ALE)
    or its module (``"module:EnvId"``, gymnasium's form) first, as :func:`envfleet.make` does
    before it builds anything; afterwards ``gymnasium.make(gymnasium_id)`` finds it.

    Example::

        envfleet.check_gymnasium_id("ALE/Pong-v5")   # imports ale_py, which registers ALE/
        envfleet.check_gymnasium_id("CartPole-v2")   # ConfigError: unknown environment id ...

    Raises:
        ConfigError: the id is unknown, or it needs a package that is missing (``ALE/`` ids
            need ale-py: ``pip install 'envfleet[atari]'``).
    """
    try:
        gymnasium.spec(register_namespace(gymnasium_id))
    except gymnasium.error.Error as exc:
        raise ConfigError(f"unknown environment id {gymnasium_id!r}: {exc}") from exc


def env_factories(
    env: str | EnvFactory | Sequence[EnvFactory], env_kwargs: dict[str, Any] | None
) -> tuple[list[EnvFactory], int]:
    """make()'s ``env`` as a list of factories and the ``num_envs`` it implies: one
    :class:`GymMake` for a gymnasium id (1), the callable (1), or the list (its length).

    Raises:
        ConfigError: an unknown id, ``env_kwargs`` without an id, or anything else as ``env``.
    """
    if isinstance(env, str):
        check_gymnasium_id(env)
        return [GymMake(env, env_kwargs)], 1
    if env_kwargs is not None:
        raise ConfigError("env_kwargs is only for a gymnasium id; bind arguments in your factory")
    if callable(env):
        return [env], 1
    if isinstance(env, Sequence) and len(env) > 0 and all(callable(fn) for fn in env):
        fns: list[EnvFactory] = [fn for fn in env if callable(fn)]
        return fns, len(fns)
    raise ConfigError(
        "env must be a gymnasium id, a callable returning a gymnasium.Env, or a non-empty list "
        f"of such callables; got {type(env).__name__}"
    )


def pickle_factories(env_fns: Sequence[EnvFactory]) -> list[bytes]:
    """One cloudpickle blob per env for other processes (a factory repeated is pickled once).

    Raises:
        ConfigError: a factory cannot be pickled (naming its env).
    """
    blobs: dict[int, bytes] = {}
    out = []
    for i, fn in enumerate(env_fns):
        if id(fn) not in blobs:
            try:
                blobs[id(fn)] = cloudpickle.dumps(fn)
            except Exception as exc:
                raise ConfigError(
                    f"the factory of sub-environment {i} cannot be pickled for the worker "
                    f"processes ({type(exc).__name__}: {exc}); use backend='serial' or make it "
                    "picklable"
                ) from exc
        out.append(blobs[id(fn)])
    return out


def build_env(fn: Callable[[], gymnasium.Env[Any, Any]], env_index: int) -> gymnasium.Env[Any, Any]:
    """``fn()``, env ``env_index``, in this process.

    Raises:
        EnvError: the factory raised (``method == "make"``), or returned no ``gymnasium.Env``.
    """
    try:
        env = fn()
    except ConfigError:
        raise
    except Exception as exc:
        raise env_error(env_index, None, "make", f"{type(exc).__name__}: {exc}", exc) from exc
    if not isinstance(env, gymnasium.Env):
        raise not_an_env_error(env, env_index)
    return env
