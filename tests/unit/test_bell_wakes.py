"""The round bell wakes only what a ring needs, and a dead worker leaves nothing on it.

A worker asleep on the bell holds its bit (``worker.sleep_bit``) in its own ``SLEEP`` control
word and sleeps with that bit as its futex bitset; a ring reads the ``SLEEP`` words of the
workers it rang and wakes those bits alone. Two costs the earlier design had (one shared
count of sleepers, every sleeper woken by every ring) are checked here on real processes:

- a ring of one worker wakes no other sleeping worker (a per-worker call round was O(W^2)
  wake-ups);
- a worker SIGKILLed asleep leaves no "asleep" mark that later rings pay a system call for
  (a count it never decremented did, for good).
"""

from __future__ import annotations

import ctypes
import multiprocessing
import multiprocessing.sharedctypes
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import gymnasium
import numpy as np
import pytest

import envfleet
import envfleet._core.native
from envfleet._backends.processes.doorbell import BELL_BYTES, RoundBell, round_bell_available
from envfleet._backends.processes.worker import (
    ACK,
    REQ,
    SLEEP,
    WORDS,
    check_control_row,
    sleep_bit,
)

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not round_bell_available(),
    reason="the round bell is Linux's (futexes) on x86-64",
)

RINGS = 20
DEADLINE_S = 20.0


def _until(condition: Any, what: str) -> None:
    """Poll ``condition`` (a real event in another process) until it holds."""
    deadline = time.monotonic() + DEADLINE_S
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.001)


_SYS_FUTEX_X86_64 = 202


def _in_futex_wait(pid: int) -> bool:
    """Process ``pid`` is blocked inside futex(2) (``/proc/PID/syscall`` names the system call
    a blocked process is in): asleep on the bell, not on its way there."""
    try:
        with open(f"/proc/{pid}/syscall") as f:
            return f.read().split()[0] == str(_SYS_FUTEX_X86_64)
    except (OSError, IndexError):
        return False


def _bell() -> RoundBell:
    check_control_row()  # the C functions read REQ, ACK and SLEEP at the worker module's indexes
    return RoundBell(
        multiprocessing.sharedctypes.RawArray(ctypes.c_uint8, BELL_BYTES), (REQ, ACK, SLEEP)
    )


@pytest.mark.timeout(60)
def test_a_ring_wakes_only_the_worker_it_rang() -> None:
    """Three processes asleep on one bell; worker 0 is rung RINGS times (each command served,
    its ACK caught up), each time with workers 1 and 2 blocked inside futex(2). They never
    wake: they count every return from their sleep that found no command due, and a ring
    that woke every sleeper would give them RINGS each."""
    bell = _bell()
    workers = 3
    control = multiprocessing.sharedctypes.RawArray(ctypes.c_int64, workers * WORDS)
    stop = multiprocessing.sharedctypes.RawValue(ctypes.c_int64, 0)
    woken = multiprocessing.sharedctypes.RawArray(ctypes.c_int64, workers)  # none due
    rows = [memoryview(control).cast("B")[8 * WORDS * w : 8 * WORDS * (w + 1)] for w in range(3)]
    words = [row.cast("q") for row in rows]
    addresses = [ctypes.addressof(control) + 8 * WORDS * w for w in range(workers)]

    def worker(w: int) -> None:
        mine = words[w]
        while True:
            if bell.sleep(addresses[w], sleep_bit(w), 30.0):
                if stop.value:
                    os._exit(0)
                mine[ACK] = mine[REQ]
            else:
                woken[w] += 1

    context = multiprocessing.get_context("fork")
    procs = [context.Process(target=worker, args=(w,)) for w in range(workers)]
    for proc in procs:
        proc.start()
    try:
        for w in range(workers):
            _until(lambda w=w: words[w][SLEEP] == sleep_bit(w), f"worker {w} asleep")
        for _ in range(RINGS):
            for w in (1, 2):  # asleep in the kernel: a ring bumping gen as it got there would
                # send it round its loop once (woken + 1) without any wake-up
                _until(lambda w=w: _in_futex_wait(procs[w].pid), f"worker {w} in futex(2)")
            words[0][REQ] += 1
            bell.ring((addresses[0],))
            _until(lambda: words[0][ACK] == words[0][REQ], "worker 0's reply")
        assert list(woken) == [0, 0, 0], "a ring woke a worker it did not ring"
    finally:
        stop.value = 1
        for w in range(workers):
            words[w][REQ] += 1
        bell.ring(tuple(addresses))
        for proc in procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
    assert [proc.exitcode for proc in procs] == [0, 0, 0]


class _SlowToReplace(gymnasium.Env[np.ndarray, np.int64]):
    """CartPole-like env whose constructor, in a process started after ``gate`` exists,
    waits until ``gate`` is removed: a replacement worker that cannot reach the bell yet."""

    observation_space = gymnasium.spaces.Box(-1.0, 1.0, (2,), np.float32)
    action_space = gymnasium.spaces.Discrete(2)

    def __init__(self, gate: str):
        path = Path(gate)
        deadline = time.monotonic() + DEADLINE_S
        while path.exists() and time.monotonic() < deadline:
            time.sleep(0.005)

    def reset(self, *, seed: int | None = None, options: Any = None) -> Any:
        super().reset(seed=seed)
        return np.zeros(2, np.float32), {}

    def step(self, action: Any) -> Any:
        return np.zeros(2, np.float32), 1.0, False, False, {}


@pytest.mark.timeout(60)
def test_a_worker_killed_asleep_leaves_no_ring_a_system_call(make_env: Any, tmp_path: Path) -> None:
    """Worker 1, asleep on the bell, is SIGKILLed and replaced by a worker still building its
    env (it cannot be asleep): a ring of worker 1 then issues no futex wake. Its dead
    predecessor's mark would make every ring of it pay one, for good."""
    speedups = envfleet._core.native.speedups
    if speedups is None:
        pytest.skip("envfleet._core._speedups is not built here")
    gate = tmp_path / "gate"
    fleet = make_env(
        lambda: _SlowToReplace(str(gate)),
        2,
        backend=envfleet.Processes(spin_s=0.0, context="fork"),
        num_workers=2,
    )
    workers = fleet._backend.transport.workers
    assert workers.bell is not None, "the round bell is not in use"
    fleet.reset(seed=0)
    words = workers.words[1]
    _until(lambda: words[SLEEP] == sleep_bit(1), "worker 1 asleep on the bell")
    os.kill(workers.procs[1].pid, signal.SIGKILL)
    workers.procs[1].join(DEADLINE_S)
    assert words[SLEEP] == sleep_bit(1), "the dead worker's mark, the case this test is about"
    gate.touch()
    try:
        workers.respawn(1, "crash")  # its replacement waits on the gate, building its env
        assert workers.procs[1].is_alive()
        before = speedups.counters()["futex_wake"]
        workers.bell.ring(workers._controls[1])
        assert speedups.counters()["futex_wake"] == before, "a ring woke a worker not asleep"
    finally:
        gate.unlink()
        fleet.close(terminate=True)  # the replacement's READY was never read
