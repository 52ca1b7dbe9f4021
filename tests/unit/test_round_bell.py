"""The processes backend's round bell (Linux futexes, ``doorbell.RoundBell``): a full step
round costs the driver a constant number of wake and wait system calls, whatever the worker
count; and the bell really runs (a fast path that silently stopped running would pass every
other test). The bell is the C module's (round protocol R9): without it every command goes
on the workers' semaphores, and the results are the same.

Nothing here is timed: the counts are of system calls, with spinning turned off
(``spin_s=0``) so that every worker sleeps between rounds and every ring needs a wake-up.
"""

from __future__ import annotations

import ctypes
import faulthandler
import functools
import mmap
import multiprocessing
import multiprocessing.sharedctypes
import os
import resource
import signal
import sys
import time
from typing import Any

import numpy as np
import pytest
from gymnasium.vector import SyncVectorEnv

import envfleet
import envfleet._core.native
from envfleet._backends.processes import doorbell, lifecycle, worker
from envfleet._backends.processes.doorbell import (
    BELL_BYTES,
    TIGHT_SPIN_S,
    RoundBell,
    SpinBudget,
    round_bell_available,
)
from envfleet._core.protocol import Command, Status
from envfleet._core.stats import BUCKETS_PER_OCTAVE, NUM_BUCKETS, STATS_WORDS
from tests.envs import CrashEnv, IndexedEnv, sync_factories
from tests.helpers import assert_same

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not round_bell_available(),
    reason="the round bell is Linux's (futexes)",
)

ROUNDS = 40
WORKER_COUNTS = (1, 2, 4)


def _transport(fleet: Any) -> Any:
    return fleet._backend.transport


def _driver_syscalls() -> dict[str, int]:
    """The futex system calls this process (the driver) issued so far."""
    calls = envfleet._core.native.speedups.counters()  # type: ignore[union-attr]
    return {"futex_wake": calls["futex_wake"], "futex_wait": calls["futex_wait"]}


def _expect(bell: RoundBell, workers: int) -> None:
    """A full round of ``workers`` arrivals starts (R5), as the C full round sets it."""
    ctypes.c_int32.from_address(bell.address + doorbell._REMAINING).value = workers


def _worker_calls(env: Any) -> tuple[int, dict[str, int]]:
    speedups = envfleet._core.native.speedups
    return os.getpid(), ({} if speedups is None else speedups.counters())


@pytest.mark.timeout(120)
def test_a_full_round_costs_the_driver_constant_system_calls(make_env):
    """W = 1, 2, 4 workers, every one asleep when its round is rung: per round the driver
    issues at most one wake and
    at most one blocking wait (plus a slice's end now and then on a loaded machine), the
    same for every W. The semaphores' round issued one post per sleeping worker and up to
    one wait per worker."""
    seen = {}
    for workers in WORKER_COUNTS:
        fleet = make_env(
            IndexedEnv,
            4,
            backend=envfleet.Processes(spin_s=0.0),
            num_workers=workers,
        )
        transport = _transport(fleet)
        assert transport.workers.bell is not None, "the round bell is not in use"
        assert transport.full_round is not None, "no full round: each worker is rung alone"
        fleet.reset(seed=0)
        actions = np.zeros(4, dtype=np.int64)
        fleet.step(actions)
        before = _driver_syscalls()
        started = time.monotonic()
        for _ in range(ROUNDS):
            fleet.step(actions)
        elapsed = time.monotonic() - started
        after = _driver_syscalls()
        wakes = after["futex_wake"] - before["futex_wake"]
        waits = after["futex_wait"] - before["futex_wait"]
        # A blocked wait ends at the last arrival or at a slice's end (BLOCK_SLICE_S): no more
        # than one slice end per slice of the run's time, however many workers.
        slices = int(elapsed / doorbell.BLOCK_SLICE_S) + 1
        assert wakes <= ROUNDS, (workers, wakes)
        assert waits <= ROUNDS + slices, (workers, waits)
        seen[workers] = (wakes, waits)
        fleet.close()
    # The bell really ran: asleep workers needed waking, an asleep driver its wake-up. (Summed
    # over the worker counts: a worker still on its way to sleep when its round is rung needs
    # no wake, which can happen to every round of one run.)
    assert sum(w for w, _ in seen.values()) > 0 and sum(w for _, w in seen.values()) > 0, seen


@pytest.mark.timeout(120)
def test_workers_sleep_on_the_bell_and_step_in_the_c_loop(make_env):
    """With the C step path, each worker waits for its commands on the bell (bell_sleep)
    and steps in its C loop (serve_steps), and the driver's C round runs once a step."""
    speedups = envfleet._core.native.speedups
    if speedups is None:
        pytest.skip("envfleet._core._speedups is not built here")
    fleet = make_env(
        IndexedEnv,
        4,
        backend=envfleet.Processes(spin_s=0.0),
        num_workers=2,
    )
    fleet.reset(seed=0)
    before_workers = dict(fleet.apply(_worker_calls))
    before = speedups.counters()["full_round"]
    actions = np.zeros(4, dtype=np.int64)
    for _ in range(ROUNDS):
        fleet.step(actions)
    assert speedups.counters()["full_round"] - before == ROUNDS
    after_workers = dict(fleet.apply(_worker_calls))
    assert len(after_workers) == 2
    for pid, calls in after_workers.items():
        assert calls["bell_sleep"] > before_workers[pid]["bell_sleep"], pid
        assert calls["serve_steps"] > before_workers[pid]["serve_steps"], pid


@pytest.mark.timeout(120)
@pytest.mark.parametrize("bell", [True, False], ids=["bell", "semaphores"])
@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_results_match_sync_with_and_without_the_bell(
    make_env, monkeypatch, step_path, bell, context
):
    """Steps, resets with a mask, calls and step_async/step_wait give SyncVectorEnv's
    results with the bell and with the per-worker semaphores it replaces (the platforms
    without futexes), on both step paths: without the C module there is no bell (R9), and
    every command goes on the semaphores."""
    if not bell:  # the path of the CPUs without the bell: the workers' semaphores
        monkeypatch.setattr(
            lifecycle, "round_bell_available", lambda: doorbell.round_bell_available("aarch64")
        )
    n = 5
    fleet = make_env(
        IndexedEnv,
        n,
        backend=envfleet.Processes(context=context),
        num_workers=3,
    )
    assert (_transport(fleet).workers.bell is not None) == (bell and step_path == "c")
    sync = SyncVectorEnv(sync_factories(IndexedEnv, n))
    try:
        assert_same(fleet.reset(seed=3), sync.reset(seed=3), "reset")
        for t in range(12):
            actions = np.array([(t + i) % 2 for i in range(n)])
            if t % 3 == 2:
                fleet.step_async(actions)
                got = fleet.step_wait()
            else:
                got = fleet.step(actions)
            assert_same(got, sync.step(actions), f"step {t}")
        mask = np.array([True, False, True, False, False])
        assert_same(
            fleet.reset(seed=7, options={"reset_mask": mask}),
            sync.reset(seed=7, options={"reset_mask": mask}),
            "masked reset",
        )
        assert list(fleet.get_attr("env_index")) == list(sync.get_attr("env_index"))
        for t in range(4):
            actions = np.ones(n, dtype=np.int64)
            assert_same(fleet.step(actions), sync.step(actions), f"after reset {t}")
    finally:
        sync.close()


@pytest.mark.timeout(120)
def test_a_worker_dying_mid_round_is_restarted_and_the_bell_goes_on(make_env):
    """A worker that segfaults inside a full round never arrives: the driver, asleep on the
    bell, finds it dead between two slices; the restart policy replaces it alone, and the
    new worker answers the bell's next rounds (REQ/ACK consistent, the count reset each
    round)."""
    n = 4
    factory = functools.partial(CrashEnv, crash_index=3, crash_after=5, how="segfault")
    fleet = make_env(
        factory,
        n,
        backend=envfleet.Processes(spin_s=0.0),
        num_workers=2,
        supervision=envfleet.Supervision(
            restart_policy=envfleet.RestartPolicy(restart_on=(Exception,), max_restarts=5)
        ),
    )
    transport = _transport(fleet)
    assert transport.workers.bell is not None
    fleet.reset(seed=0)
    pids = [p.pid for p in transport.workers.procs]
    actions = np.zeros(n, dtype=np.int64)
    truncated_at = []
    for t in range(10):
        _, _, _, truncated, _ = fleet.step(actions)
        if truncated.any():
            truncated_at.append((t, truncated.tolist()))
    # the env the dead worker was inside; env 2, its block-mate, goes on from its record
    assert truncated_at == [(5, [False, False, False, True])]
    after = [p.pid for p in transport.workers.procs]
    assert after[0] == pids[0], "the worker that lived was restarted too"
    assert after[1] != pids[1], "the dead worker was not replaced"
    assert fleet.stats.crashes == 1


def test_the_bell_wakes_a_sleeping_process_and_gathers_its_arrival():
    """The bell's primitives across two processes (fork): a worker asleep on the bell sees its
    REQ move, replies (arrival, then ACK: R6); the driver, asleep on the count, wakes at the
    last arrival (R7)."""
    worker.check_control_row()  # the C bell reads control_t, the worker module's row
    region = multiprocessing.sharedctypes.RawArray(ctypes.c_uint8, BELL_BYTES)
    control = multiprocessing.sharedctypes.RawArray(ctypes.c_int64, worker.WORDS)
    req, ack, rounds = worker.REQ, worker.ACK, 50
    bell = RoundBell(region, (req, ack, worker.SLEEP))
    words = memoryview(control).cast("B").cast("q")
    address = ctypes.addressof(control)

    def sleeper() -> None:
        for _ in range(rounds):
            while not bell.sleep(address, 1, 1.0):
                pass
            due = words[req]
            bell.arrive()
            words[ack] = due  # after the arrival, as _Worker.ring_done
        os._exit(0)

    proc = multiprocessing.get_context("fork").Process(target=sleeper)
    proc.start()
    try:
        for _ in range(rounds):
            _expect(bell, 1)
            words[req] += 1
            bell.ring((address,))
            deadline = time.monotonic() + 10
            while not bell.gather_sleep(0.02):
                assert time.monotonic() < deadline and proc.is_alive()
    finally:
        proc.join(10)
        if proc.is_alive():
            proc.kill()
    assert proc.exitcode == 0


def test_the_c_workers_arrival_lands_before_its_ack():
    """A worker's ACK follows its arrival (R6), on the C step path, where no arrival can be
    slowed: the C worker loop (``serve_steps``: bell_arrive) is stopped at the very store of
    its ACK, and its arrival must have landed by then.

    A forked process runs ``serve_steps`` over one control row laid across a page boundary,
    ACK the first word of the second page. The step it calls makes that page read-only in
    the child, so the reply's writes (STATUS, REPLY_PAYLOAD, on the first page) go through
    and the ACK store faults: the child dies of SIGSEGV there. The row and the bell are
    shared with this process, which then reads them: the reply written, the ACK not, and
    the round's count at 0, the arrival landed."""
    speedups = pytest.importorskip("envfleet._core._speedups")
    written_first = (worker.CMD, worker.CMD_PAYLOAD, worker.STATUS, worker.REPLY_PAYLOAD)
    written_first += (worker.REQ, worker.GATHER)
    assert max(written_first) < worker.ACK < worker.WORDS  # ACK alone on the second page
    worker.check_control_row()
    page = mmap.PAGESIZE
    rows = mmap.mmap(-1, 2 * page)  # anonymous and shared: the forked child writes here
    base = ctypes.addressof(ctypes.c_char.from_buffer(rows))
    address = base + page - 8 * worker.ACK
    words = (ctypes.c_int64 * worker.WORDS).from_address(address)
    words[worker.CMD], words[worker.CMD_PAYLOAD] = int(Command.STEP), 0
    words[worker.GATHER], words[worker.REQ], words[worker.ACK] = 1, 1, 0  # a full round's step
    region = multiprocessing.sharedctypes.RawArray(ctypes.c_uint8, BELL_BYTES)
    bell = RoundBell(region, (worker.REQ, worker.ACK, worker.SLEEP))
    _expect(bell, 1)
    sems = (ctypes.c_uint8 * 64)()  # the semaphores a bell's full round leaves alone
    timer = np.zeros(STATS_WORDS)
    budget = SpinBudget(0.0)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]

    def child() -> None:
        faulthandler.disable()
        signal.signal(signal.SIGSEGV, signal.SIG_DFL)  # die of the fault, unreported
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        steps = []

        def step() -> None:
            steps.append(1)
            if len(steps) > 1:
                os._exit(3)  # the command is still due: no ACK was stored
            if libc.mprotect(base + page, page, mmap.PROT_READ) != 0:
                os._exit(4)
            return None  # no events: serve_steps replies itself

        speedups.serve_steps(
            ctypes.addressof(sems),
            ctypes.addressof(sems) + 32,
            None,
            address,
            step,
            timer.ctypes.data,
            budget.address,
            TIGHT_SPIN_S,
            int(Command.STEP),
            int(Status.OK),
            BUCKETS_PER_OCTAVE,
            NUM_BUCKETS,
            bell.address,
        )
        os._exit(5)  # it returned: the ACK store did not fault

    proc = multiprocessing.get_context("fork").Process(target=child)
    proc.start()
    proc.join(30)
    if proc.is_alive():
        proc.kill()
        proc.join()
    assert proc.exitcode == -signal.SIGSEGV, proc.exitcode
    assert words[worker.STATUS] == int(Status.OK) and words[worker.REPLY_PAYLOAD] == 0
    assert words[worker.ACK] == 0  # the store that faulted
    assert bell.gathered(), "the worker stored its ACK before its arrival landed"
