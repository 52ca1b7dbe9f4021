"""The doorbell's adaptive spin budget and its shared-memory semaphores."""

from __future__ import annotations

import ctypes
import multiprocessing
import multiprocessing.sharedctypes
import time

import pytest

from envfleet._backends.processes.doorbell import SEM_SLOT, Doorbell, SpinBudget


def test_spin_budget_halves_when_spins_run_out_and_grows_back_when_they_pay():
    budget = SpinBudget(0.002)
    assert budget.budget_s == pytest.approx(0.002)
    budget.blocked(0.010)  # spun out, and the wait was long: spinning wasted the core
    budget.blocked(0.010)
    assert budget.budget_s == pytest.approx(0.0005)
    for _ in range(100):
        budget.blocked(0.010)
    assert budget.budget_s < 1e-9  # oversubscribed or slow peer: block at once
    for _ in range(16):
        budget.caught()
    assert budget.budget_s == pytest.approx(0.002)  # bounded by max_s
    budget.caught()
    assert budget.budget_s == pytest.approx(0.002)


def test_spin_budget_grows_after_short_blocked_waits():
    budget = SpinBudget(0.002)
    for _ in range(100):
        budget.blocked(0.010)
    budget.blocked(0.0005)  # short enough for a spin to have caught it
    assert budget.budget_s == pytest.approx(0.002 / 16, rel=1e-3)


def test_zero_budget_never_spins():
    budget = SpinBudget(0.0)
    budget.caught()
    assert budget.budget_s == 0.0


def _ring_back(bell: Doorbell, rounds: int) -> None:
    for _ in range(rounds):
        assert Doorbell.wait(bell.request, SpinBudget(0.001), None, lambda: True)
        bell.done.release()  # as the worker replies (processes/worker.py)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("context", ["fork", "spawn"])
@pytest.mark.parametrize("spin_s", [0.0, 0.002])
def test_doorbell_round_trips_between_processes(context, spin_s):
    ctx = multiprocessing.get_context(context)
    region = multiprocessing.sharedctypes.RawArray(ctypes.c_uint8, 2 * SEM_SLOT)
    bell = Doorbell(ctx, region, 0)
    proc = ctx.Process(target=_ring_back, args=(bell, 200))
    proc.start()
    budget = SpinBudget(spin_s)
    for _ in range(200):
        bell.request.release()  # as the driver rings (WorkerProcesses.request)
        assert Doorbell.wait(bell.done, budget, None, proc.is_alive)
    proc.join(30)
    assert proc.exitcode == 0


def test_wait_gives_up_at_the_deadline_and_when_the_peer_is_gone():
    region = multiprocessing.sharedctypes.RawArray(ctypes.c_uint8, 2 * SEM_SLOT)
    bell = Doorbell(multiprocessing.get_context("fork"), region, 0)
    assert not Doorbell.wait(bell.done, SpinBudget(0.001), time.monotonic() + 0.05, lambda: True)
    assert not Doorbell.wait(bell.done, SpinBudget(0.001), None, lambda: False)
    bell.done.release()
    assert Doorbell.wait(bell.done, SpinBudget(0.001), None, lambda: False)  # posted: taken
