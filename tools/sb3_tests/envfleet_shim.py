"""pytest plugin for running stable-baselines3's own vec-env tests against envfleet.

Loaded with ``-p envfleet_shim`` (this folder and ``tools/`` on ``PYTHONPATH``) before the test
modules are imported. It always records, per test, whether the test created the replaced class
and its outcome (``tools/dropin.py``'s hooks). With ``ENVFLEET_SHIM=1`` it also replaces that
class, as ``stable_baselines3.common.vec_env`` and its module export it, by a subclass of
``envfleet.adapters.sb3.SB3VecEnv``:

- ``SubprocVecEnv(env_fns, start_method=None)`` (the default, ``ENVFLEET_SB3_REPLACE`` unset)
  becomes ``SB3VecEnv(env_fns, start_method=start_method)`` (the processes backend): the one
  line a user changes.
- ``DummyVecEnv(env_fns)`` (``ENVFLEET_SB3_REPLACE=DummyVecEnv``) becomes
  ``SB3VecEnv(env_fns, backend="serial")``, for the tests of SB3's vec-env wrappers, which
  wrap a ``DummyVecEnv``. It has no ``envs`` list (the envs live in envfleet's groups).
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from typing import Any

import gymnasium
import stable_baselines3.common.vec_env as vec_env
from dropin import (  # noqa: F401  (the recording hooks, for pytest to find here)
    note,
    pytest_runtest_logreport,
    pytest_runtest_protocol,
    pytest_sessionfinish,
    shim_on,
)

from envfleet.adapters.sb3 import SB3VecEnv

_NAME = os.environ.get("ENVFLEET_SB3_REPLACE", "SubprocVecEnv")
_MODULES = {
    "SubprocVecEnv": "stable_baselines3.common.vec_env.subproc_vec_env",
    "DummyVecEnv": "stable_baselines3.common.vec_env.dummy_vec_env",
}
if _NAME not in _MODULES:
    raise SystemExit(f"ENVFLEET_SB3_REPLACE={_NAME!r}: choose from {sorted(_MODULES)}")
_ORIGINAL: type = getattr(vec_env, _NAME)

EnvFns = list[Callable[[], gymnasium.Env[Any, Any]]]


class SubprocVecEnv(SB3VecEnv):
    """``SubprocVecEnv(env_fns, start_method)`` -> ``SB3VecEnv(env_fns, start_method=...)``."""

    def __init__(self, env_fns: EnvFns, start_method: str | None = None) -> None:
        note()
        super().__init__(env_fns, start_method=start_method)


class DummyVecEnv(SB3VecEnv):
    """``DummyVecEnv(env_fns)`` -> ``SB3VecEnv(env_fns, backend="serial")``."""

    def __init__(self, env_fns: EnvFns) -> None:
        note()
        super().__init__(env_fns, backend="serial")


class _Recording(_ORIGINAL):  # type: ignore[valid-type,misc]
    """SB3's own class, noting which test created one."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        note()
        super().__init__(*args, **kwargs)


_REPLACEMENT: type = {"SubprocVecEnv": SubprocVecEnv, "DummyVecEnv": DummyVecEnv}[_NAME]
if not shim_on():
    _REPLACEMENT = _Recording
_REPLACEMENT.__name__ = _REPLACEMENT.__qualname__ = _NAME
for _module in (vec_env, importlib.import_module(_MODULES[_NAME])):
    setattr(_module, _NAME, _REPLACEMENT)
# SB3's helpers that imported the name before this plugin ran.
for _user in (
    "stable_baselines3.common.env_util",
    "stable_baselines3.common.vec_env.vec_video_recorder",
):
    _loaded = importlib.import_module(_user)
    if getattr(_loaded, _NAME, None) is _ORIGINAL:
        setattr(_loaded, _NAME, _REPLACEMENT)
