"""TorchRL over envfleet: GymWrapper rollouts, against envfleet itself and gymnasium."""

from __future__ import annotations

import multiprocessing

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.vector import AutoresetMode, SyncVectorEnv

import envfleet

torch = pytest.importorskip("torch")
# Importing torchrl sets multiprocessing's start method to "spawn" for the whole process:
# keep the rest of the test session on its own default.
_start_method = multiprocessing.get_start_method(allow_none=True)
pytest.importorskip("torchrl")
multiprocessing.set_start_method(_start_method, force=True)

from torchrl.envs import GymWrapper  # noqa: E402

from envfleet.adapters.torchrl import make_torchrl_env, to_torchrl  # noqa: E402

NUM_ENVS = 4
STEPS = 80  # CartPole with random actions: several episodes end (and restart) within 80 steps


def cartpole_policy(seed: int = 0):
    """A deterministic policy: one-hot CartPole actions from a seeded generator, step by step."""
    actions = np.random.default_rng(seed).integers(0, 2, size=(STEPS, NUM_ENVS))
    step = iter(range(STEPS))

    def policy(td):
        td["action"] = torch.nn.functional.one_hot(torch.as_tensor(actions[next(step)]), 2)
        return td

    return policy, actions


def test_rollout_shapes_and_keys():
    env = make_torchrl_env("CartPole-v1", NUM_ENVS, backend="processes")
    try:
        assert env.batch_size == torch.Size([NUM_ENVS])
        env.set_seed(0)
        policy, _ = cartpole_policy()
        td = env.rollout(STEPS, policy, break_when_any_done=False)
        assert td.batch_size == torch.Size([NUM_ENVS, STEPS])
        keys = set(td.keys(include_nested=True))
        for key in ("observation", "action", "done", "terminated", "truncated"):
            assert key in keys and ("next", key if key != "action" else "reward") in keys
        assert td["observation"].shape == (NUM_ENVS, STEPS, 4)
        assert td["observation"].dtype == torch.float32
        assert td["action"].shape == (NUM_ENVS, STEPS, 2)
        assert td["next", "reward"].shape == (NUM_ENVS, STEPS, 1)
        assert td["next", "done"].shape == (NUM_ENVS, STEPS, 1)
        assert td["next", "done"].dtype == torch.bool
        assert td["next", "done"].any()  # episodes ended, and TorchRL reset those envs
        assert (td["next", "reward"] == 1.0).all()
    finally:
        env.close()


@pytest.mark.parametrize("backend", ["serial", "processes"])
def test_rollout_values_match_envfleet_and_gymnasium(backend):
    """The rollout is what envfleet's own numpy API gives for the same seed and actions (TorchRL
    resets finished envs through reset_mask), and what TorchRL gives over gymnasium."""
    env = make_torchrl_env("CartPole-v1", NUM_ENVS, backend=backend, context="fork")
    policy, actions = cartpole_policy()
    try:
        env.set_seed(0)
        td = env.rollout(STEPS, policy, break_when_any_done=False)
    finally:
        env.close()

    # The same run, by hand, on envfleet's numpy API: GymWrapper.set_seed(0) resets with seed
    # 0, the rollout resets again, and each finished env is reset alone before its next step.
    ref = envfleet.make(
        "CartPole-v1", NUM_ENVS, backend=backend, autoreset_mode=AutoresetMode.DISABLED
    )
    try:
        ref.reset(seed=0)
        obs, _ = ref.reset()
        for t in range(STEPS):
            np.testing.assert_array_equal(td["observation"][:, t].numpy(), obs)
            obs, reward, terminated, truncated, _ = ref.step(actions[t])
            nxt = td["next"][:, t]
            np.testing.assert_array_equal(nxt["observation"].numpy(), obs)
            np.testing.assert_array_equal(nxt["reward"].numpy()[:, 0], reward.astype(np.float32))
            np.testing.assert_array_equal(nxt["terminated"].numpy()[:, 0], terminated)
            np.testing.assert_array_equal(nxt["truncated"].numpy()[:, 0], truncated)
            np.testing.assert_array_equal(nxt["done"].numpy()[:, 0], terminated | truncated)
            done = terminated | truncated
            if done.any():
                obs, _ = ref.reset(options={"reset_mask": done})
    finally:
        ref.close()

    # And TorchRL over gymnasium's own SyncVectorEnv gives the very same rollout.
    gym_env = GymWrapper(
        SyncVectorEnv(
            [lambda: gym.make("CartPole-v1")] * NUM_ENVS, autoreset_mode=AutoresetMode.DISABLED
        )
    )
    policy, _ = cartpole_policy()
    try:
        gym_env.set_seed(0)
        want = gym_env.rollout(STEPS, policy, break_when_any_done=False)
    finally:
        gym_env.close()
    assert (td == want).all()


def test_same_step_mode_matches_gymnasium():
    env = make_torchrl_env(
        "CartPole-v1",
        NUM_ENVS,
        backend="processes",
        autoreset_mode=AutoresetMode.SAME_STEP,
        context="fork",
    )
    gym_env = GymWrapper(
        SyncVectorEnv(
            [lambda: gym.make("CartPole-v1")] * NUM_ENVS, autoreset_mode=AutoresetMode.SAME_STEP
        )
    )
    try:
        results = []
        for e in (env, gym_env):
            e.set_seed(3)
            policy, _ = cartpole_policy(seed=1)
            results.append(e.rollout(STEPS, policy, break_when_any_done=False))
        assert results[0]["next", "done"].any()
        assert (results[0] == results[1]).all()
    finally:
        env.close()
        gym_env.close()


def test_refusals(make_env):
    with pytest.raises(envfleet.ConfigError, match="DISABLED or SAME_STEP"):
        to_torchrl(make_env("CartPole-v1", 2, backend="serial"))  # NEXT_STEP
    with pytest.raises(envfleet.ConfigError, match="copy=True"):
        to_torchrl(
            make_env(
                "CartPole-v1",
                2,
                backend="serial",
                autoreset_mode=AutoresetMode.DISABLED,
                copy=False,
            )
        )
    with pytest.raises(envfleet.ConfigError, match="copy"):
        make_torchrl_env("CartPole-v1", 2, backend="serial", copy=False)
