"""docs/architecture.md's walk of the plain step is the code's actual call sequence.

The page lists, between its ``<!-- step-walk -->`` markers, the functions a plain
``envs.step(actions)`` runs on the learner's side, one per layer, in order (each numbered
item starts with the function's name in backticks). This test makes that vector env (the
defaults: processes, every env in a worker), traces one step with ``sys.setprofile`` and
checks that the Python functions of the walk were called in that order (other calls may come
between them). A name that is a function of the C module (``full_round``) is called through a
``functools.partial``, which the profiler does not report: the C module's own call counter
must have moved during the step instead.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import envfleet
import envfleet._core.native

PAGE = Path(__file__).resolve().parent.parent / "docs" / "architecture.md"
ITEM = re.compile(r"^\d+\. `([A-Za-z_][\w.]*)`", re.M)


def walk() -> list[str]:
    """The walk's function names, in the page's order."""
    text = PAGE.read_text(encoding="utf-8")
    start, end = text.index("<!-- step-walk -->"), text.index("<!-- /step-walk -->")
    return ITEM.findall(text[start:end])


def test_the_page_has_a_walk() -> None:
    names = walk()
    assert len(names) >= 5, names
    assert names[0] == "FleetVectorEnv.step"


def _in_order(wanted: list[str], calls: list[str]) -> list[str]:
    """The names of ``wanted`` not found in ``calls`` after the previous one (in order)."""
    missing, at = [], 0
    for name in wanted:
        try:
            at = calls.index(name, at) + 1
        except ValueError:
            missing.append(name)
    return missing


@pytest.mark.timeout(120)
def test_a_plain_step_makes_the_walks_calls_in_order(make_env: Any) -> None:
    speedups = envfleet._core.native.speedups
    names = walk()
    native = [n for n in names if speedups is not None and hasattr(speedups, n)]
    python = [n for n in names if n not in native]
    if speedups is None and any(n == "full_round" for n in names):
        python = [n for n in python if n != "full_round"]  # its twin runs: named in the item
    envs = make_env("CartPole-v1", 16)
    envs.reset(seed=0)
    actions = np.zeros(16, dtype=np.int64)
    envs.step(actions)  # the first step's one-time costs out of the way
    calls: list[str] = []

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            calls.append(frame.f_code.co_qualname)

    before = speedups.counters() if speedups is not None else {}
    sys.setprofile(profile)
    try:
        envs.step(actions)
    finally:
        sys.setprofile(None)
    after = speedups.counters() if speedups is not None else {}
    assert not _in_order(python, calls), (
        f"the walk's calls {_in_order(python, calls)} were not made in the page's order; "
        f"the step called: {calls}"
    )
    for name in native:
        assert after[name] > before[name], f"the C module's {name} did not run in the step"
