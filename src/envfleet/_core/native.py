"""The optional C step path (``envfleet._core._speedups``, built from ``_core/_speedups.c``).

:data:`speedups` is the loaded module, or ``None`` when it was not built (no C compiler at
install time) or ``ENVFLEET_NO_SPEEDUPS=1`` is set in the environment. Every C function but
the round bell's (``bell_ring``, ``bell_sleep``, ``bell_arrive``, ``gather_sleep``,
``bell_alarm``: without C, rounds signal through the doorbell's semaphores instead) has a
Python twin next to its caller that is the reference: the C code only removes interpreter
overhead around the env calls of the step path, it never changes what an env sees or what the
caller gets (``tests/unit/test_speedups_properties.py`` compares the two on random inputs).

It holds what measurably pays end to end (``benchmarks/speedups.py``): ``write_results`` and
``write_rows`` (an EnvGroup's result and observation writes), ``serve_steps`` (a processes
worker's loop of plain steps) and ``full_round`` (the processes driver's full step round). Callers
look a function up with :func:`function` when an :class:`~envfleet._core.envgroup.EnvGroup` or a
processes backend (driver or worker) is built, so setting ``envfleet._core.native.speedups = None``
(or naming functions in :data:`disabled`) before ``envfleet.make`` turns them off for that
vector env (and, under ``fork``, for its workers).

``pcg64_raw`` copies a PCG64 generator's state for the replay record's episode start at
each autoreset (``_core/env_state.py``: ``StartReader.packed``; its twin ``pcg64_bytes``), and
``log_row`` each step's action rows into the record's ring (``ActionLog.recorder``; its twin
``ActionLog.record``), and ``budget_adapt`` a spin budget after each wait (the rule the C
waits adapt by; its twin ``SpinBudget.caught``/``blocked``, ``tests/unit/test_spin_budget.py``).

The processes backend's round bell (Linux futexes, ``_backends/processes/doorbell.py``) has
its C side here too: ``bell_ring``, ``bell_sleep``, ``bell_arrive``, ``gather_sleep`` and
``bell_alarm``, and
``full_round`` / ``serve_steps`` given the bell's address.

``crash_note`` is no step-path function: it installs the fatal-signal handler that names the
env the processes driver was stepping itself when its process died (``_core/crash_note.py``).

The module counts the calls of each of its functions (``speedups.counters()``, a dict of
name to calls in this process; ``speedups.reset_counters()``; the two writes count only the
calls where they wrote rather than handing back to numpy), and the futex system calls its
code issued (``futex_wake``, ``futex_wait``): the tests use them to notice a fast path that
silently stopped running, and a full round whose system calls grow with the workers again.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from types import ModuleType
from typing import Any

import numpy as np

__all__ = ["disabled", "function", "speedups"]


def _load() -> ModuleType | None:
    if os.environ.get("ENVFLEET_NO_SPEEDUPS", "").strip() not in ("", "0"):
        return None
    try:
        module = importlib.import_module("envfleet._core._speedups")
    except ImportError:
        return None
    # The numpy scalar types whose conversions into the result buffers it does itself.
    module.register_types(np.bool_, np.float32)
    return module


speedups: ModuleType | None = _load()

disabled: frozenset[str] = frozenset()
"""Names of C functions whose Python twin runs instead (``benchmarks/speedups.py`` measures
each piece this way)."""


def function(name: str) -> Callable[..., Any] | None:
    """The C function ``name`` of :data:`speedups`, or ``None`` where the caller runs its
    Python twin (the module is not loaded, or ``name`` is in :data:`disabled`).

    Example: ``full_round = envfleet._core.native.function("full_round")``.
    """
    module = speedups
    if module is None or name in disabled:
        return None
    fn: Callable[..., Any] = getattr(module, name)
    return fn
