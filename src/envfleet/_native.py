"""The optional C step path (``envfleet._speedups``, built from ``_speedups.c``).

:data:`speedups` is the loaded module, or ``None`` when it was not built (no C compiler at
install time) or ``ENVFLEET_NO_SPEEDUPS=1`` is set in the environment. Every use of it has a
Python twin next to it that gives the same results (the differential tests run both): the C
code only removes interpreter overhead around the env calls of the step path, it never changes
what an env sees or what the caller gets.

It is looked up when an :class:`~envfleet._envgroup.EnvGroup`, a doorbell semaphore, a
:class:`~envfleet._supervisor.StepTimer` or a processes backend is built, so setting
``envfleet._native.speedups = None`` before ``envfleet.make`` turns it off for that vector env
(and, under ``fork``, for its workers).
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import numpy as np

__all__ = ["speedups"]


def _load() -> ModuleType | None:
    if os.environ.get("ENVFLEET_NO_SPEEDUPS", "").strip() not in ("", "0"):
        return None
    try:
        module = importlib.import_module("envfleet._speedups")
    except ImportError:
        return None
    # The numpy scalar types whose conversions into the result buffers it does itself.
    module.register_types(np.bool_, np.float32)
    return module


speedups: ModuleType | None = _load()
