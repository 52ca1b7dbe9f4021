"""The threads backend's own behaviour; the differential and front tests cover its contract."""

from __future__ import annotations

import functools
import threading
import time

import gymnasium as gym
import numpy as np
import pytest
from gymnasium import spaces
from gymnasium.vector import SyncVectorEnv

import envfleet
from tests.envs import RaisingEnv, sync_factories
from tests.helpers import assert_same


class SlowEnv(gym.Env):
    """Env ``slow_index`` sleeps ``sleep_s`` in every step (a stand-in for a hung simulator)."""

    def __init__(self, env_index: int = 0, slow_index: int = 1, sleep_s: float = 3.0):
        self.env_index, self.slow_index, self.sleep_s = env_index, slow_index, sleep_s
        self.observation_space = spaces.Box(-1.0, 1.0, (2,), np.float32)
        self.action_space = spaces.Discrete(2)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return np.zeros(2, np.float32), {}

    def step(self, action):
        if self.env_index == self.slow_index:
            time.sleep(self.sleep_s)
        return np.zeros(2, np.float32), 1.0, False, False, {}


def _envfleet_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("envfleet-thread")]


def test_each_group_runs_in_its_own_thread(make_env):
    """Every group but the first (run by the caller) steps in a thread named after it."""
    seen: dict[int, str] = {}

    class WhereEnv(RaisingEnv):
        def step(self, action):
            seen[self.env_index] = threading.current_thread().name
            return super().step(action)

    envs = make_env(functools.partial(WhereEnv, fail_index=-1), 4, backend="threads", num_workers=2)
    assert envs.num_workers == 2
    envs.reset(seed=0)
    envs.step(np.zeros(4, np.int64))
    assert seen[0] == seen[1] == threading.current_thread().name
    assert seen[2] == seen[3] == "envfleet-thread-1"


def test_threads_stop_on_close():
    before = len(_envfleet_threads())
    envs = envfleet.make("CartPole-v1", 6, backend="threads", num_workers=3)
    envs.reset(seed=0)
    assert len(_envfleet_threads()) == before + 2
    envs.close()
    assert len(_envfleet_threads()) == before


@pytest.mark.timeout(60)
def test_step_timeout_closes_and_names_the_late_envs():
    factory = functools.partial(SlowEnv, slow_index=3, sleep_s=3.0)
    envs = envfleet.make(
        factory,
        4,
        backend="threads",
        num_workers=2,
        supervision=envfleet.Supervision(step_timeout=0.5),
    )
    envs.reset(seed=0)
    with pytest.raises(envfleet.StepTimeoutError) as info:
        envs.step(np.zeros(4, np.int64))
    assert info.value.env_indices == [2, 3]
    assert info.value.timeout == 0.5
    assert envs.closed
    assert envs.stats.timeouts == 1
    with pytest.raises(envfleet.ClosedEnvironmentError):
        envs.step(np.zeros(4, np.int64))


def test_env_error_leaves_it_usable_and_restart_policy_rebuilds(make_env):
    factory = functools.partial(RaisingEnv, fail_index=3, fail_in="step", fail_after=2)
    envs = make_env(factory, 4, backend="threads", num_workers=2)
    envs.reset(seed=0)
    for _ in range(2):
        envs.step(np.zeros(4, np.int64))
    with pytest.raises(envfleet.EnvError) as info:
        envs.step(np.zeros(4, np.int64))
    assert (info.value.env_index, info.value.method) == (3, "step")
    assert isinstance(info.value.__cause__, ValueError)
    assert not envs.closed

    policy = envfleet.RestartPolicy(restart_on=(Exception,), max_restarts=5, window_s=60)
    fleet = make_env(
        factory,
        4,
        backend="threads",
        num_workers=2,
        supervision=envfleet.Supervision(restart_policy=policy),
    )
    sync = SyncVectorEnv(sync_factories(functools.partial(RaisingEnv, fail_index=-1), 4))
    assert_same(fleet.reset(seed=0), sync.reset(seed=0))
    for t in range(4):
        obs, reward, terminated, truncated, info = fleet.step(np.zeros(4, np.int64))
        want = sync.step(np.zeros(4, np.int64))
        assert_same(obs[:3], want[0][:3], f"obs {t}")  # envs 0-2 never fail
        assert_same(reward[:3], want[1][:3], f"reward {t}")
        if t == 2:
            assert truncated[3] and info["env_restarted"][3] and not info["env_restarted"][:3].any()
    assert fleet.stats.restarts == 1 and fleet.stats.env_restarts == {3: 1}
