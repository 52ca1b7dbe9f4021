"""The processes driver waits in one piece: a reply, a death, the deadline or a Ctrl-C ends it.

A worker's death rings the driver's wait (the death watch: ``workers.DeathWatch``,
``WorkerProcesses.died``; round protocol R8) instead of the wait polling ``is_alive`` between
20 ms slices. These tests count the driver's blocking calls during a long step, and during
a step whose worker is SIGKILLed: one block each (the slices made one every 20 ms), and the
death still raises, or is restarted, as before.
"""

from __future__ import annotations

import functools
import signal
from typing import Any

import numpy as np
import pytest

import envfleet
import envfleet._core.native
from envfleet._backends.processes.doorbell import SharedSem, round_bell_available
from envfleet._backends.processes.lifecycle import WorkerProcesses
from envfleet._backends.workers import DeathWatch
from tests.envs import FaultEnv, fault_factory

FAIL_FAST = envfleet.Supervision(restart_policy=None)
SLOW_S = 0.4  # one env's slow step: twenty of the old 20 ms slices


def _counters() -> dict[str, int]:
    module = envfleet._core.native.speedups
    assert module is not None
    calls: dict[str, int] = module.counters()
    return calls


def _needs_bell() -> None:
    if envfleet._core.native.speedups is None or not round_bell_available():
        pytest.skip("no round bell here (the C module, Linux on x86-64)")


def _count_blocks(sem: SharedSem, blocks: list[int]) -> None:
    """Count each blocking wait on ``sem`` (the driver's mapping) into ``blocks``."""
    timed, untimed = sem._timedwait, sem._wait

    def timedwait(*args: Any) -> Any:
        blocks.append(1)
        return timed(*args)

    def wait(*args: Any) -> Any:
        blocks.append(1)
        return untimed(*args)

    sem._timedwait, sem._wait = timedwait, wait


def _workers(envs: Any) -> WorkerProcesses:
    workers: WorkerProcesses = envs._backend.transport.workers
    return workers


def test_a_long_full_round_is_one_sleep_on_the_bell(make_env):
    """A full step round whose worker takes SLOW_S seconds: the C round's one futex wait, and
    no Python wait after it (the old round slept one 20 ms slice in C, then the rest in
    Python, a gather_sleep every 20 ms)."""
    _needs_bell()
    envs = make_env(
        fault_factory({1: (f"sleep:{SLOW_S}", 3)}),
        2,
        backend=envfleet.Processes(driver_envs=0),
        num_workers=2,
        supervision=FAIL_FAST,
    )
    assert envs._backend._full_round is not None
    envs.reset(seed=0)
    actions = np.zeros(2, np.int64)
    envs.step(actions)
    before = _counters()
    envs.step(actions)  # the slow one (env 1's third step since make: reset is not one)
    envs.step(actions)
    after = _counters()
    assert after["gather_sleep"] == before["gather_sleep"], "a Python wait followed the C round"
    assert after["futex_wait"] - before["futex_wait"] <= 3, (
        after["futex_wait"] - before["futex_wait"]
    )
    assert after["full_round"] - before["full_round"] == 2


def test_a_death_in_a_full_round_ends_its_wait_at_once(make_env):
    """A worker SIGKILLed in a full round with no step timeout: the death watch's alarm ends
    the round's wait, the Python wait after it finds the worker dead before it sleeps (no
    gather_sleep), and the step raises EnvCrashedError as before."""
    _needs_bell()
    envs = make_env(
        fault_factory({1: ("sigkill", 3)}, wait_s=0.05),
        2,
        backend=envfleet.Processes(driver_envs=0),
        num_workers=2,
        supervision=FAIL_FAST,
    )
    envs.reset(seed=0)
    actions = np.zeros(2, np.int64)
    envs.step(actions)
    envs.step(actions)
    before = _counters()
    with pytest.raises(envfleet.EnvCrashedError) as info:
        envs.step(actions)
    after = _counters()
    assert info.value.signal == signal.SIGKILL
    assert after["gather_sleep"] == before["gather_sleep"]
    assert after["futex_wait"] - before["futex_wait"] <= 2


def test_step_wait_blocks_once_on_the_semaphore(make_env):
    """step_async/step_wait (the semaphores: the C round spins, then Python blocks): one
    blocking wait on the slow worker's done semaphore, not one per 20 ms slice."""
    envs = make_env(
        fault_factory({1: (f"sleep:{SLOW_S}", 1)}),
        2,
        backend=envfleet.Processes(driver_envs=0),
        num_workers=2,
        supervision=FAIL_FAST,
    )
    workers = _workers(envs)
    done = workers.doorbells[1].done  # type: ignore[union-attr]
    if not isinstance(done, SharedSem):
        pytest.skip("no process-shared POSIX semaphores here")
    envs.reset(seed=0)
    blocks: list[int] = []
    _count_blocks(done, blocks)
    envs.step_async(np.zeros(2, np.int64))  # env 1's first step: the slow one
    envs.step_wait()
    assert len(blocks) == 1, blocks


def test_a_pool_wait_blocks_once_and_a_death_wakes_it(make_env):
    """A first-ready pool's recv while its one busy env takes SLOW_S seconds: one blocking
    wait on the pool's shared doorbell; then a SIGKILL of a busy env's worker wakes the
    wait (its done token and the shared one, posted by the death watch) and raises."""
    envs = make_env(
        functools.partial(FaultEnv, faults={0: (f"sleep:{SLOW_S}", 1), 1: ("sigkill", 2)}),
        2,
        batch_size=1,
        num_workers=2,
        supervision=FAIL_FAST,
    )
    workers = _workers(envs)
    if not isinstance(workers.any_done, SharedSem):
        pytest.skip("no process-shared POSIX semaphores here")
    envs.async_reset(seed=0)
    envs.recv()
    envs.recv()
    blocks: list[int] = []
    _count_blocks(workers.any_done, blocks)
    envs.send(np.zeros(1, np.int64), np.array([0]))  # env 0's slow step
    obs, _, _, _, info = envs.recv()
    assert list(info["env_id"]) == [0] and len(blocks) == 1, blocks
    envs.send(np.zeros(1, np.int64), np.array([1]))  # env 1 steps (its first)
    envs.recv()
    blocks.clear()
    envs.send(np.zeros(1, np.int64), np.array([1]))  # env 1's worker SIGKILLs itself
    with pytest.raises(envfleet.EnvCrashedError):
        envs.recv()
    assert len(blocks) <= 1, blocks


def test_the_death_watch_reports_each_exit_once():
    """DeathWatch itself: each watched process reported once, when it exits (a process
    that exited before it was added, at once), none after stop()."""
    import multiprocessing
    import threading
    import time

    ctx = multiprocessing.get_context("fork")
    seen: list[int] = []
    lock = threading.Condition()

    def on_death(proc: Any) -> None:
        with lock:
            seen.append(proc.pid)
            lock.notify_all()

    watch = DeathWatch(on_death)
    quick = ctx.Process(target=time.sleep, args=(0.0,))
    slow = ctx.Process(target=time.sleep, args=(0.3,))
    quick.start()
    quick.join()  # gone (reaped) before it is watched
    slow.start()
    watch.add(quick)
    watch.add(slow)
    with lock:
        assert lock.wait_for(lambda: len(seen) == 2, timeout=30), seen
    assert sorted(seen) == sorted([quick.pid, slow.pid])
    slow.join()
    later = ctx.Process(target=time.sleep, args=(0.0,))
    later.start()
    watch.stop()
    watch.add(later)  # after stop: not watched
    later.join()
    assert not watch._watched
