"""examples/external_simulator.py (issue 50): envs whose step talks over a socket to a simulator
process of their own, under make()'s defaults. Real simulator processes on 127.0.0.1, real
sockets, a real SIGKILL; SyncVectorEnv over the same envs is the reference."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest
from gymnasium.vector import SyncVectorEnv

import envfleet
from tests.helpers import assert_same

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
sys.path.insert(0, str(EXAMPLES))  # workers are forked: they find the module in sys.modules
import external_simulator  # noqa: E402

NUM_ENVS = 4


def simulator_env() -> Any:
    return external_simulator.ExternalSimulatorEnv(latency_s=0.001, lifetime_s=120.0)


def test_a_killed_simulator_is_its_envs_error_and_the_others_stay_exact(
    make_env: Any, snapshot: Any
) -> None:
    """Four envs, each with its simulator, on make()'s defaults with a restart policy, stepped
    in lockstep with SyncVectorEnv over the same envs. Env 2's simulator is SIGKILLed: that
    step's failure is env 2's EnvError (a ConnectionError, its own exception), env 2 is
    rebuilt with a new simulator (its row: truncated, ``env_restarted``), and every other
    env's results stay SyncVectorEnv's bit for bit, then and after."""
    envs = make_env(
        simulator_env,
        NUM_ENVS,
        num_workers=2,
        supervision=envfleet.Supervision(restart_policy=envfleet.RestartPolicy(1, 60.0)),
    )
    sync = SyncVectorEnv([simulator_env] * NUM_ENVS)
    try:
        assert_same(envs.reset(seed=5), sync.reset(seed=5), "reset")
        rng = np.random.default_rng(0)
        for t in range(30):
            actions = rng.integers(0, 2, NUM_ENVS)
            assert_same(envs.step(actions.copy()), sync.step(actions.copy()), f"step {t}")
        assert envs.stats.env_kind == "wait", envs.stats.workers
        pids = envs.get_attr("simulator_pid")
        assert len(set(pids)) == NUM_ENVS and os.getpid() not in pids
        _kill(pids[2])
        others = [0, 1, 3]  # the reference's env 2 has its own simulator, alive: not compared
        for t in range(30, 40):
            actions = rng.integers(0, 2, NUM_ENVS)
            got = envs.step(actions.copy())
            want = sync.step(actions.copy())
            if t == 30:  # env 2 fails in this step and is rebuilt
                assert got[3][2] and got[4]["env_restarted"][2]
                assert list(np.flatnonzero(got[4]["_env_restarted"])) == [2]
            for k in range(4):  # observations, rewards, terminated, truncated
                assert_same(got[k][others], want[k][others], f"step {t}, result {k}")
    finally:
        sync.close()
    failure = envs.stats.failures[-1]
    assert isinstance(failure, envfleet.EnvError) and isinstance(failure, ConnectionError)
    assert failure.env_index == 2 and failure.method == "step", repr(failure)
    assert envs.stats.restarts == 1
    new_pid = envs.get_attr("simulator_pid")[2]
    assert new_pid != pids[2] and psutil.pid_exists(new_pid)
    envs.close()
    snapshot.assert_nothing_left()  # every simulator stopped with its env


def _kill(pid: int) -> None:
    """SIGKILL the simulator ``pid`` (a worker's child, not ours) and wait until it is dead:
    gone, or a zombie until its env's close reaps it (its socket is closed either way)."""
    victim = psutil.Process(pid)
    victim.send_signal(signal.SIGKILL)
    for _ in range(1000):
        try:
            if victim.status() == psutil.STATUS_ZOMBIE:
                return
        except psutil.NoSuchProcess:
            return
        time.sleep(0.01)
    raise AssertionError(f"simulator {pid} still runs 10 s after SIGKILL")


def test_without_a_restart_policy_the_dead_simulator_is_env_2s_error(make_env: Any) -> None:
    """The same kill with the fail-fast opt-out (``restart_policy=None``): the step raises env 2's
    EnvError, which is also a ConnectionError."""
    envs = make_env(
        simulator_env,
        NUM_ENVS,
        num_workers=2,
        supervision=envfleet.Supervision(restart_policy=None),
    )
    envs.reset(seed=0)
    for _ in range(10):
        envs.step(np.zeros(NUM_ENVS, dtype=np.int64))
    _kill(envs.get_attr("simulator_pid")[2])
    with pytest.raises(ConnectionError) as info:
        envs.step(np.zeros(NUM_ENVS, dtype=np.int64))
    assert isinstance(info.value, envfleet.EnvError)
    assert info.value.env_index == 2 and info.value.method == "step"


def test_the_example_runs_and_says_its_envs_wait() -> None:
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / "external_simulator.py"), "--num-envs", "4"]
        + ["--steps", "60"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "env steps/s" in proc.stdout and "the envs wait" in proc.stdout, proc.stdout
