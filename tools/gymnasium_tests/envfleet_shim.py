"""pytest plugin for running gymnasium's own vector tests against envfleet.

Loaded with ``-p envfleet_shim`` (this folder on ``PYTHONPATH``) before the test modules are
imported. It always records, per test, whether the test created an ``AsyncVectorEnv`` and its
outcome (into the JSON file named by ``ENVFLEET_SHIM_REPORT``). With ``ENVFLEET_SHIM=1`` it
also replaces ``gymnasium.vector.AsyncVectorEnv`` (as the tests and ``gymnasium.make_vec``
see it) with :class:`AsyncVectorEnv` below, which maps gymnasium's arguments to
``envfleet.make(list(env_fns), backend="processes", ...)``.
"""

from __future__ import annotations

import json
import os
from typing import Any

import gymnasium.vector
import gymnasium.vector.async_vector_env
import pytest
from gymnasium.vector import AutoresetMode

import envfleet

_ORIGINAL = gymnasium.vector.AsyncVectorEnv
_current: dict[str, Any] = {"test": None}
_involved: set[str] = set()
_outcomes: dict[str, str] = {}


def _note() -> None:
    if _current["test"] is not None:
        _involved.add(_current["test"])


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
        _note()
        if worker is not None:
            raise TypeError("the envfleet shim does not support AsyncVectorEnv(worker=...)")
        kwargs: dict[str, Any] = {
            "backend": "processes",
            "copy": copy,
            "context": context,
            "autoreset_mode": autoreset_mode,
        }
        if not (isinstance(observation_mode, str) and observation_mode == "same"):
            kwargs["observation_mode"] = observation_mode  # a TypeError where make lacks it
        return envfleet.make(list(env_fns), **kwargs)


class _Recording(_ORIGINAL):
    """gymnasium's own AsyncVectorEnv, noting which test created one."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        _note()
        super().__init__(*args, **kwargs)


_REPLACEMENT: type = AsyncVectorEnv if os.environ.get("ENVFLEET_SHIM") == "1" else _Recording
_REPLACEMENT.__name__ = "AsyncVectorEnv"
for _module in (gymnasium.vector, gymnasium.vector.async_vector_env):
    setattr(_module, "AsyncVectorEnv", _REPLACEMENT)  # noqa: B010  (mypy: a type's name)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: Any) -> Any:
    _current["test"] = item.nodeid
    yield
    _current["test"] = None


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.failed:
        _outcomes[report.nodeid] = "failed"
    elif report.when == "call" or report.skipped:
        _outcomes.setdefault(report.nodeid, report.outcome)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    path = os.environ.get("ENVFLEET_SHIM_REPORT")
    if path:
        with open(path, "w") as f:
            json.dump({"outcomes": _outcomes, "involved": sorted(_involved)}, f, indent=1)
