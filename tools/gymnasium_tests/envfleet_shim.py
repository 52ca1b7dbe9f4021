"""pytest plugin for running gymnasium's own vector tests against envfleet.

Loaded with ``-p envfleet_shim`` (this folder and ``tools/`` on ``PYTHONPATH``) before the test
modules are imported. It always records, per test, whether the test created an
``AsyncVectorEnv`` and its outcome (``tools/dropin.py``'s hooks). With ``ENVFLEET_SHIM=1`` it
also replaces ``gymnasium.vector.AsyncVectorEnv`` (as the tests and ``gymnasium.make_vec``
see it) with :class:`AsyncVectorEnv` below, which maps gymnasium's arguments to
``envfleet.make(list(env_fns), backend="processes", ...)``.
"""

from __future__ import annotations

from typing import Any

import gymnasium.vector
import gymnasium.vector.async_vector_env
from dropin import (  # noqa: F401  (the recording hooks, for pytest to find here)
    note,
    pytest_runtest_logreport,
    pytest_runtest_protocol,
    pytest_sessionfinish,
    shim_on,
)
from gymnasium.vector import AutoresetMode

import envfleet

_ORIGINAL = gymnasium.vector.AsyncVectorEnv


class _ShimMeta(type):
    def __instancecheck__(cls, obj: Any) -> bool:
        return isinstance(obj, envfleet.FleetVectorEnv)

    def __subclasscheck__(cls, sub: type) -> bool:
        return issubclass(sub, envfleet.FleetVectorEnv)


class AsyncVectorEnv(metaclass=_ShimMeta):
    """``gymnasium.vector.AsyncVectorEnv(...)`` -> ``envfleet.make(..., backend="processes")``.

    ``shared_memory``, ``daemon`` and ``max_concurrency`` have no envfleet counterpart and are
    ignored (envfleet always uses shared memory for fixed-size spaces); ``worker`` (a custom
    worker function) is refused.
    """

    def __new__(
        cls,
        env_fns: Any,
        shared_memory: bool = True,
        copy: bool = True,
        context: str | None = None,
        daemon: bool = True,
        worker: Any = None,
        observation_mode: Any = "same",
        autoreset_mode: Any = AutoresetMode.NEXT_STEP,
        max_concurrency: int | None = None,
    ) -> Any:
        note()
        if worker is not None:
            raise TypeError("the envfleet shim does not support AsyncVectorEnv(worker=...)")
        kwargs: dict[str, Any] = {
            "backend": envfleet.Processes(context=context),
            "copy": copy,
            "autoreset_mode": autoreset_mode,
        }
        if not (isinstance(observation_mode, str) and observation_mode == "same"):
            kwargs["observation_mode"] = observation_mode  # a TypeError where make lacks it
        return envfleet.make(list(env_fns), **kwargs)


class _Recording(_ORIGINAL):
    """gymnasium's own AsyncVectorEnv, noting which test created one."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        note()
        super().__init__(*args, **kwargs)


_REPLACEMENT: type = AsyncVectorEnv if shim_on() else _Recording
_REPLACEMENT.__name__ = "AsyncVectorEnv"
for _module in (gymnasium.vector, gymnasium.vector.async_vector_env):
    setattr(_module, "AsyncVectorEnv", _REPLACEMENT)  # noqa: B010  (mypy: a type's name)
