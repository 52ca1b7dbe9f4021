"""Envs that wait (issue 50): a processes worker steps its block all at once when its envs wait
and one after another when they compute, and every contract holds either way.

Real worker processes, real gymnasium envs and SyncVectorEnv as the reference: the batches
are bit-identical in every autoreset mode, whether the worker chose (``ENVFLEET_STEPPING``
unset: ``auto``) or was made to step its envs at once (``concurrent``); the workers say what
they found (``envs.stats``), so a concurrent path that silently stopped running fails here; a
hang and a segfault in an env of a block stepped at once are reported with that env's frame.
Timeouts are hang guards and ``step_timeout`` values, never speed bounds.
"""

from __future__ import annotations

import inspect
import signal
from typing import Any

import numpy as np
import pytest
from gymnasium.vector import AutoresetMode, SyncVectorEnv

import envfleet
from envfleet._core.stacks import innermost
from tests.contract.test_differential import run_lockstep
from tests.envs import FaultEnv, WaitingEnv, fault_factory, sync_factories

NUM_ENVS = 5  # two workers on two cores: blocks of 3 and 2 envs
STEPS = 60
MODES = list(AutoresetMode)


def _workers_stepped_at_once(envs: Any, at_least: int) -> None:
    """Every worker found envs that wait and stepped at least ``at_least`` rounds at once."""
    workers = envs.stats.workers
    assert workers, "no worker statistics"
    for w, stats in enumerate(workers):
        seen = f"worker {w}: {stats}"
        assert stats.env_kind == "wait", seen
        assert stats.concurrent, seen
        assert stats.concurrent_steps >= at_least, seen
        assert 0.0 <= stats.cpu_fraction < 0.5, seen
    assert envs.stats.env_kind == "wait"


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
@pytest.mark.parametrize("stepping", ["auto", "concurrent"])
def test_waiting_envs_match_sync_vector_env(
    make_env: Any, monkeypatch: pytest.MonkeyPatch, mode: AutoresetMode, stepping: str
) -> None:
    """Envs that sleep 1 ms a step, on make()'s defaults (a worker per core): the batches
    are SyncVectorEnv's bit for bit (observations, rewards, done flags, infos, final
    observations, masked resets), and the workers stepped their envs at once: chosen after
    the first three rounds (``auto``), or from the first (``concurrent``)."""
    monkeypatch.setenv("ENVFLEET_STEPPING", stepping)  # the workers read it as they start
    envs = make_env(WaitingEnv, NUM_ENVS, autoreset_mode=mode, num_workers=2)
    sync = SyncVectorEnv(sync_factories(WaitingEnv, NUM_ENVS), autoreset_mode=mode)
    try:
        seen = run_lockstep(envs, sync, steps=STEPS, seed=7)
    finally:
        sync.close()
    assert seen["ended"] > 0 and seen["info_steps"] > 0
    _workers_stepped_at_once(envs, STEPS - 3 if stepping == "auto" else STEPS)


def _waiting_resets(env_index: int = 0) -> WaitingEnv:
    return WaitingEnv(env_index, reset_wait_s=0.002)


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
def test_envs_whose_reset_waits_reset_at_once(make_env: Any, mode: AutoresetMode) -> None:
    """Resets that wait (2 ms) are a block's first round too: env 0 resets alone on the
    worker's thread, the others at once on the crew's, from the very first reset; resets
    (masked ones too) and steps stay SyncVectorEnv's bit for bit."""
    envs = make_env(_waiting_resets, 8, autoreset_mode=mode, num_workers=2)
    sync = SyncVectorEnv(sync_factories(_waiting_resets, 8), autoreset_mode=mode)
    try:
        envs.reset(seed=1)
        threads = envs.get_attr("reset_thread")
        for start in (0, 4):  # the blocks: envs 0-3 and 4-7
            assert not threads[start].startswith("envfleet-env-"), threads
            assert all(t.startswith("envfleet-env-") for t in threads[start + 1 : start + 4])
        seen = run_lockstep(envs, sync, steps=30, seed=7)
    finally:
        sync.close()
    assert seen["ended"] > 0


@pytest.mark.backends("serial", "threads")
def test_waiting_envs_in_process_match_sync_vector_env(make_env: Any, backend: Any) -> None:
    """serial and threads step each block one env after another, as before; the same
    batches, and no worker claims to have timed its envs."""
    envs = make_env(WaitingEnv, NUM_ENVS, **backend.options, num_workers=2)
    sync = SyncVectorEnv(sync_factories(WaitingEnv, NUM_ENVS))
    try:
        run_lockstep(envs, sync, steps=20, seed=3)
    finally:
        sync.close()
    assert envs.stats.env_kind == "unknown"
    assert not any(w.concurrent_steps for w in envs.stats.workers)


@pytest.mark.backends("ray")
def test_waiting_envs_on_ray_actors_are_stepped_at_once(make_env: Any, backend: Any) -> None:
    """Each Ray actor's group learns its envs wait and steps them at once from the first
    round, as a processes worker does; the batches stay SyncVectorEnv's."""
    envs = make_env(WaitingEnv, NUM_ENVS, **backend.options, num_workers=2)
    sync = SyncVectorEnv(sync_factories(WaitingEnv, NUM_ENVS))
    try:
        run_lockstep(envs, sync, steps=20, seed=3)
    finally:
        sync.close()
    _workers_stepped_at_once(envs, 19)


def test_envs_that_compute_are_stepped_one_after_another(make_env: Any) -> None:
    """CartPole's steps keep the CPU busy: every worker says "compute" and never stepped its
    envs at once."""
    envs = make_env("CartPole-v1", 4, num_workers=2)
    envs.reset(seed=0)
    actions = np.zeros(4, dtype=np.int64)
    for _ in range(200):
        envs.step(actions)
    for w, stats in enumerate(envs.stats.workers):
        assert stats.env_kind == "compute", f"worker {w}: {stats}"
        assert not stats.concurrent and stats.concurrent_steps == 0, f"worker {w}: {stats}"
    assert envs.stats.env_kind == "compute"


def _fault_line(marker: str) -> str:
    """``tests/envs.py:LINE`` of the line of FaultEnv.step that holds ``marker``."""
    lines, first = inspect.getsourcelines(FaultEnv.step)
    offset = next(i for i, line in enumerate(lines) if marker in line)
    return f"{inspect.getsourcefile(FaultEnv)}:{first + offset}"


def _step_into_fault(envs: Any, rounds: int) -> None:
    """Step until just before the fault, then check worker 1 steps its envs at once."""
    envs.reset(seed=0)
    for _ in range(rounds):
        envs.step(np.zeros(4, dtype=np.int64))
    assert envs.stats.workers[1].concurrent, envs.stats.workers[1]


def test_a_hang_in_a_block_stepped_at_once_names_the_envs_frame(
    make_env: Any, snapshot: Any
) -> None:
    """Env 3 (worker 1's second env, which a thread of the worker's crew steps) sleeps far
    past ``step_timeout`` in its 10th step while its block is stepped at once: the
    StepTimeoutError names worker 1's envs, carries its stacks, and names env 3's frame (the
    sleep in FaultEnv.step), not the worker's main thread waiting for its crew."""
    envs = make_env(
        fault_factory({3: ("sleep:60", 10)}, wait_s=0.002),
        4,
        num_workers=2,
        supervision=envfleet.Supervision(step_timeout=2.0, restart_policy=None),
    )
    _step_into_fault(envs, 9)
    with pytest.raises(envfleet.StepTimeoutError) as info:
        envs.step(np.zeros(4, dtype=np.int64))
    err = info.value
    where = f"{_fault_line('time.sleep(float')} in step"
    assert 3 in err.env_indices and list(err.stacks) == [1], str(err)
    assert innermost(err.stacks[1]) == where, err.stacks[1]
    assert f"worker 1 at {where}" in str(err)
    assert envs.closed
    snapshot.assert_nothing_left()


def test_a_hang_among_hundreds_of_envs_stepped_at_once_names_the_envs_frame(
    make_env: Any,
) -> None:
    """Env 7 of a block of 240 stepped at once hangs: faulthandler dumps 100 threads at most,
    newest first, which leaves env 7's thread out; the stacks the worker adds after the dump
    (the threads inside an env) hold it, so the StepTimeoutError names its frame."""
    envs = make_env(
        fault_factory({7: ("sleep:60", 4)}, wait_s=0.002),
        240,
        num_workers=1,
        supervision=envfleet.Supervision(step_timeout=3.0, restart_policy=None),
    )
    envs.reset(seed=0)
    for _ in range(3):
        envs.step(np.zeros(240, dtype=np.int64))
    assert envs.stats.workers[0].concurrent, envs.stats.workers[0]
    with pytest.raises(envfleet.StepTimeoutError) as info:
        envs.step(np.zeros(240, dtype=np.int64))
    err = info.value
    where = f"{_fault_line('time.sleep(float')} in step"
    assert innermost(err.stacks[0]) == where, err.stacks[0][-3000:]
    assert f"worker 0 at {where}" in str(err)


def test_a_segfault_in_a_block_stepped_at_once_is_an_env_crashed_error(
    make_env: Any, snapshot: Any
) -> None:
    """Env 3 writes at address 0 (a real SIGSEGV) in a crew thread while its block is
    stepped at once: EnvCrashedError for worker 1 (envs 2 and 3) with the fault's stack,
    whose innermost frame is env 3's."""
    envs = make_env(
        fault_factory({3: ("null-write", 10)}, wait_s=0.002),
        4,
        num_workers=2,
        supervision=envfleet.Supervision(restart_policy=None),
    )
    _step_into_fault(envs, 9)
    with pytest.raises(envfleet.EnvCrashedError) as info:
        envs.step(np.zeros(4, dtype=np.int64))
    err = info.value
    where = f"{_fault_line('ctypes.memset(0, 0, 1)')} in step"
    seen = f"{err}\n{err.stacks}"
    assert (err.worker_index, err.env_indices, err.signal) == (1, [2, 3], signal.SIGSEGV), seen
    assert "Segmentation fault" in err.stacks, seen
    assert innermost(err.stacks) == where, seen
    assert f"at {where})" in str(err), seen
    assert err.replay is not None and err.replay.complete, seen
    assert [r.env_index for r in err.replay.envs] == [2, 3], seen
    snapshot.assert_nothing_left()


def test_an_env_error_in_a_block_stepped_at_once_names_that_env(make_env: Any) -> None:
    """Env 3 raises in its 10th step while its block is stepped at once: an EnvError naming
    env 3 (also a ValueError), and the vector env stays usable."""
    envs = make_env(fault_factory({3: ("raise", 10)}, wait_s=0.002), 4, num_workers=2)
    _step_into_fault(envs, 9)
    with pytest.raises(ValueError) as info:
        envs.step(np.zeros(4, dtype=np.int64))
    assert isinstance(info.value, envfleet.EnvError)
    assert info.value.env_index == 3 and "boom in step 10 of env 3" in str(info.value.__cause__)
    assert not envs.closed
    envs.reset(seed=1)
    envs.step(np.zeros(4, dtype=np.int64))
