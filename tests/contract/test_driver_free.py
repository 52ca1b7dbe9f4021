"""Issue 21 item 4: with every env in a worker (``processes`` with ``driver_envs=0``, ``ray``),
make() builds no env in the driver's process: the spaces, metadata and render mode come from
the worker that holds env 0.

The proof is a factory that refuses to run in the test's own process (:class:`RefuseDriver`):
there make() must succeed and step bit for bit as SyncVectorEnv over plain envs; with a plan
that puts envs in the driver (the processes default, serial, threads), it must fail at once
with a clear error.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.vector import SyncVectorEnv
from gymnasium.vector.utils import batch_space

import envfleet
from tests.envs import FaultEnv, fault_factory
from tests.helpers import assert_same

NUM_ENVS = 4
STEPS = 120


class DriverBuildError(RuntimeError):
    """An env was built in the process that must build none."""


class RefuseDriver:
    """A factory that raises :class:`DriverBuildError` in process ``driver_pid`` (a simulator
    that cannot be built twice, or not in the learner's process), else builds ``env_id``."""

    def __init__(self, driver_pid: int, env_id: str = "CartPole-v1", **kwargs: Any):
        self.driver_pid = driver_pid
        self.env_id = env_id
        self.kwargs = kwargs

    def __call__(self) -> gym.Env[Any, Any]:
        if os.getpid() == self.driver_pid:
            raise DriverBuildError(
                f"{self.env_id} must not be built in the driver's process (pid {self.driver_pid})"
            )
        return gym.make(self.env_id, **self.kwargs)


def driver_free(backend: Any) -> dict[str, Any]:
    """make()'s options that select ``backend`` with every env in a worker."""
    return backend.with_layout({"driver_envs": 0} if backend.name == "processes" else {})


def run_both(fleet: Any, sync: SyncVectorEnv, steps: int) -> None:
    """Reset both with the same seeds and step both with the same actions; bit for bit."""
    assert_same(fleet.reset(seed=7), sync.reset(seed=7), "reset")
    rng = np.random.default_rng(0)
    for t in range(steps):
        actions = rng.integers(0, 2, NUM_ENVS)
        assert_same(fleet.step(actions.copy()), sync.step(actions.copy()), f"step {t}")


@pytest.mark.backends(isolated=True)
def test_no_env_is_built_in_the_driver(backend: Any, make_env: Any, snapshot: Any) -> None:
    factory = RefuseDriver(os.getpid(), render_mode="rgb_array")
    fleet = make_env(factory, NUM_ENVS, **driver_free(backend), num_workers=2)
    # The reference: the same envs, built in this process (serial), and gymnasium's own.
    kwargs = {"render_mode": "rgb_array"}
    here = make_env("CartPole-v1", NUM_ENVS, backend="serial", env_kwargs=kwargs)
    sync = SyncVectorEnv([functools.partial(gym.make, "CartPole-v1", **kwargs)] * NUM_ENVS)
    try:
        # What make() took from env 0, in its worker, is what env 0 says of itself.
        assert fleet.single_observation_space == here.single_observation_space
        assert fleet.single_action_space == here.single_action_space
        assert fleet.observation_space == here.observation_space
        assert fleet.action_space == here.action_space
        assert fleet.metadata == here.metadata
        assert fleet.render_mode == here.render_mode == "rgb_array"
        run_both(fleet, sync, STEPS)
    finally:
        sync.close()
    fleet.close()
    if backend.owns_processes:
        snapshot.assert_nothing_left()


@pytest.mark.backends("serial", "threads", "processes")
def test_a_plan_with_envs_in_the_driver_fails_at_once(backend: Any, make_env: Any) -> None:
    """The processes plan's opt-in share steps envs in the driver (serial and threads every
    env): the refusing factory is called there, and make() raises its error, no hang."""
    share = (
        backend.with_layout({"driver_envs": 1, "num_workers": 1})
        if backend.name == "processes"
        else backend.options
    )
    with pytest.raises(envfleet.EnvError) as info:
        make_env(RefuseDriver(os.getpid()), NUM_ENVS, **share)
    assert info.value.env_index == 0 and info.value.method == "make"
    assert isinstance(info.value.__cause__, DriverBuildError)
    assert "must not be built in the driver's process" in str(info.value)


@pytest.mark.backends("processes")
@pytest.mark.parametrize(
    "knobs",
    [{}, {"batch_size": 2}, {"supervision": envfleet.Supervision(step_timeout=30.0)}],
    ids=["defaults", "pool", "timeout"],
)
def test_default_pool_and_timeout_layouts_build_no_env_in_the_driver(
    backend: Any, knobs: dict[str, Any], make_env: Any
) -> None:
    """make()'s defaults, a first-ready pool and a step timeout put every env in a worker
    (driver_envs=0): no env is built in the driver either."""
    fleet = make_env(RefuseDriver(os.getpid()), NUM_ENVS, **backend.options, **knobs)
    if "batch_size" in knobs:
        fleet.async_reset(seed=1)
        obs, *_ = fleet.recv()
        assert obs.shape == (2, 4)
    else:
        obs, _ = fleet.reset(seed=1)
        assert obs.shape == (NUM_ENVS, 4)


@pytest.mark.backends("processes")
def test_a_restarted_worker_gets_the_spaces_and_the_block(backend: Any, make_env: Any) -> None:
    """With a restart policy every env is in a worker; the worker that dies is rebuilt (its
    new process gets the spaces and the shared block on its pipe) and its envs step on."""
    fleet = make_env(
        fault_factory({2: ("sigkill", 3)}),
        NUM_ENVS,
        **backend.options,
        num_workers=2,
        supervision=envfleet.Supervision(
            restart_policy=envfleet.RestartPolicy(restart_on=(Exception,), max_restarts=2)
        ),
    )
    fleet.reset(seed=0)
    for _ in range(2):
        fleet.step(np.zeros(NUM_ENVS, dtype=np.int64))
    _, _, _, truncated, info = fleet.step(np.zeros(NUM_ENVS, dtype=np.int64))
    # processes: env 2, which its worker was inside, starts anew; env 3 goes on from its record
    lost = [2] if backend.workers == "processes" else [2, 3]
    assert truncated.tolist() == [e in lost for e in range(NUM_ENVS)] and "env_restarted" in info
    assert fleet.stats.crashes == 1
    # The next step resets the rebuilt envs (NEXT_STEP), the one after steps them.
    _, rewards, *_ = fleet.step(np.zeros(NUM_ENVS, dtype=np.int64))
    assert rewards.tolist() == [0.0 if e in lost else 1.0 for e in range(NUM_ENVS)]
    obs, rewards, *_ = fleet.step(np.zeros(NUM_ENVS, dtype=np.int64))
    assert rewards.tolist() == [1.0] * NUM_ENVS
    assert np.all(np.abs(obs) <= 1.0) and np.all(obs[2:] != 0.0)


@pytest.mark.backends(isolated=True, cheap=True)
def test_a_failure_of_env_0_in_its_worker_names_it(backend: Any, make_env: Any) -> None:
    with pytest.raises(envfleet.EnvError) as info:
        make_env(RefuseDriver(-1, "NoSuchEnv-v0"), NUM_ENVS, **driver_free(backend))
    assert info.value.env_index == 0 and info.value.method == "make"
    assert "NoSuchEnv" in str(info.value)


def _action_space_differs(index: int, env_index: int) -> gym.Env[Any, Any]:
    env = FaultEnv(env_index)
    if env_index == index:
        env.action_space = gym.spaces.Discrete(5)
    return env


@pytest.mark.backends(isolated=True, cheap=True)
def test_spaces_are_checked_against_env_0s_from_its_worker(
    backend: Any, make_env: Any, snapshot: Any
) -> None:
    factory = functools.partial(_action_space_differs, 3)
    with pytest.raises(envfleet.SpaceMismatchError, match="sub-environment 3 has another space"):
        make_env(factory, NUM_ENVS, **driver_free(backend), num_workers=2)
    snapshot.assert_nothing_left()


@pytest.mark.backends(isolated=True, cheap=True)
def test_a_given_observation_space_pair_is_used(backend: Any, make_env: Any) -> None:
    """observation_mode=(batched, single): the single space is the given one, checked against
    every env's (shape and dtype), env 0's included, in the workers."""
    single = gym.spaces.Box(-10.0, 10.0, (4,), np.float32)
    batched = batch_space(single, NUM_ENVS)
    fleet = make_env(
        RefuseDriver(os.getpid()),
        NUM_ENVS,
        **driver_free(backend),
        observation_mode=(batched, single),
    )
    assert fleet.single_observation_space == single and fleet.observation_space == batched
    obs, _ = fleet.reset(seed=3)
    assert obs.shape == (NUM_ENVS, 4)
