"""The spin budget's rule, written once in C (``_speedups.c``: ``budget_caught``,
``budget_blocked``, exported as ``budget_adapt``), against :class:`SpinBudget`'s Python twin
(the rule where the C module is absent), on random sequences of waits: the same three doubles,
bit for bit, after every wait."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import envfleet._core.native
from envfleet._backends.processes.doorbell import SpinBudget

pytestmark = pytest.mark.skipif(
    envfleet._core.native.speedups is None, reason="envfleet._core._speedups is not built here"
)

# A wait: caught while spinning (None), or spun out and blocked for that many seconds.
WAITS = st.lists(
    st.one_of(st.none(), st.floats(0.0, 1.0, allow_nan=False), st.sampled_from([5e-4, 1e-3])),
    max_size=60,
)


def _twin(max_s: float) -> SpinBudget:
    """A SpinBudget that runs the Python rule (``budget_adapt`` disabled while it is made)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(envfleet._core.native, "disabled", frozenset({"budget_adapt"}))
        return SpinBudget(max_s)


@settings(max_examples=200, deadline=None)
@given(max_s=st.sampled_from([0.0, 1e-6, 1e-3, 2e-3, 0.05]), waits=WAITS)
def test_the_c_rule_and_the_python_twin_adapt_the_same_budget(
    max_s: float, waits: list[float | None]
) -> None:
    c, python = SpinBudget(max_s), _twin(max_s)
    assert c.adapt is not None and python.adapt is None  # the C rule really runs on one side
    for wait_s in waits:
        for budget in (c, python):
            if wait_s is None:
                budget.caught()
            else:
                budget.blocked(wait_s)
        assert list(c.words) == list(python.words), wait_s


def test_a_spin_budget_halves_when_it_blocks_long_and_grows_when_caught() -> None:
    budget = SpinBudget(1e-3)
    budget.blocked(1.0)
    assert budget.budget_s == 5e-4
    budget.caught()
    assert budget.budget_s == 5e-4 + 1e-3 / 16
    budget.blocked(1e-4)  # short enough for a longer spin to have caught it
    assert budget.budget_s == pytest.approx(5e-4 + 2e-3 / 16)
