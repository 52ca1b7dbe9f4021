"""The Sampler's recorders: StepLog (the synchronous loops' cheap one) lays out and cuts steps
exactly as Recorder does, and step infos keep an ended episode's own info."""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np
import pytest
from gymnasium import spaces
from gymnasium.vector.utils import batch_space

from envfleet import Sampler
from envfleet._core.infos import batch_infos
from envfleet._sampler.rollout import (
    EpisodeBatch,
    Recorder,
    StepLog,
    final_observations,
    step_infos,
)

K = 3
SPACE = spaces.Dict({"pos": spaces.Box(-10, 10, (2,), np.float32), "count": spaces.Discrete(100)})


def _random_steps(rng: np.random.Generator, steps: int) -> list[dict[str, Any]]:
    """Steps of K envs in SAME_STEP autoreset: observations, actions, rewards, flags, the
    vector info (final observations and infos where an episode ended, some envs' own infos),
    and a policy version that changes twice."""
    batched = batch_space(SPACE, K)
    batched.seed(int(rng.integers(1 << 30)))
    SPACE.seed(int(rng.integers(1 << 30)))  # the final observations: the same data per seed
    out = []
    obs = batched.sample()
    for t in range(steps):
        after = batched.sample()
        terminated = rng.random(K) < 0.15
        truncated = ~terminated & (rng.random(K) < 0.1)
        events: list[tuple[int, dict[str, Any]]] = []
        for j in range(K):
            if terminated[j] or truncated[j]:
                final = SPACE.sample()
                events.append((j, {"final_obs": final, "final_info": {"t": t, "j": j}}))
                if rng.random() < 0.5:
                    events.append((j, {"reset_note": 1.5}))
            elif rng.random() < 0.3:
                events.append((j, {"t": t}))
        out.append(
            dict(
                obs=obs,
                actions=rng.integers(0, 4, K),
                rewards=rng.random(K),
                terminated=terminated,
                truncated=truncated,
                after=after,
                version=0 if t < 7 else 1 if t < 13 else 2,
                agent_infos={"logp": rng.random(K).astype(np.float32)},
                info=batch_infos(events, K),
            )
        )
        obs = after
    return out


def _assert_batches_equal(got: EpisodeBatch, want: EpisodeBatch) -> None:
    for name in ("rewards", "terminated", "truncated", "env_index", "policy_version", "lengths"):
        a, b = getattr(got, name), getattr(want, name)
        assert a.dtype == b.dtype and np.array_equal(a, b), name
    for name in ("observations", "last_observations"):
        for key in SPACE.spaces:
            a, b = getattr(got, name)[key], getattr(want, name)[key]
            assert a.dtype == b.dtype and np.array_equal(a, b), (name, key)
    assert got.actions.dtype == want.actions.dtype
    assert np.array_equal(got.actions, want.actions)
    assert np.array_equal(got.agent_infos["logp"], want.agent_infos["logp"])
    assert got.env_infos == want.env_infos


@pytest.mark.parametrize("seed", range(5))
def test_step_log_builds_what_the_recorder_builds(seed: int) -> None:
    rng = np.random.default_rng(seed)
    steps = _random_steps(rng, 20)
    ids = np.array([4, 5, 6])
    log, recorder = StepLog(ids), Recorder()
    for s in steps:
        done = s["terminated"] | s["truncated"]
        log.add(
            s["obs"], s["actions"], s["rewards"], s["terminated"], s["truncated"], s["after"],
            s["version"], s["agent_infos"], s["info"], done,
        )  # fmt: skip
        recorder.add(
            ids, s["obs"], s["actions"], s["rewards"], s["terminated"], s["truncated"],
            final_observations(s["after"], s["info"], done), s["version"], s["agent_infos"],
            step_infos(s["info"], ids, done),
        )  # fmt: skip
    got, want = log.build(), recorder.build()
    assert got is not None and want is not None
    assert got.num_segments > K  # cut at episode ends and version changes, not only the end
    assert got.terminated.any() and got.truncated.any()
    _assert_batches_equal(got, want)
    assert log.build() is None and log.num_steps == 0  # empty afterwards


def test_step_log_copies_what_the_caller_may_reuse() -> None:
    log = StepLog(np.arange(2))
    obs = np.zeros((2, 1), np.float32)
    actions, rewards, flags = np.array([1, 2]), np.array([0.5, 1.0]), np.zeros(2, bool)
    log.add(obs, actions, rewards, flags, flags, obs + 1, 0, {}, {}, flags)
    actions[:], rewards[:], flags[:] = 9, 9.0, True  # a policy's or env's buffers, reused
    batch = log.build()
    assert batch is not None
    assert batch.actions.tolist() == [1, 2] and batch.rewards.tolist() == [0.5, 1.0]
    assert not batch.terminated.any() and batch.lengths.tolist() == [1, 1]
    assert batch.last_observations.ravel().tolist() == [1.0, 1.0]


def test_an_ended_episode_keeps_its_info_when_no_env_has_another() -> None:
    # Every env ended this step and their resets returned empty infos: the vector info has
    # only final_obs/final_info, and the step's own info is still each env's final_info.
    obs = np.zeros((2, 1), np.float32)
    events = [(j, {"final_obs": obs[j], "final_info": {"x": j + 1}}) for j in range(2)]
    info = batch_infos(events, 2)
    done = np.ones(2, dtype=bool)
    assert step_infos(info, np.arange(2), done) == [{"x": 1}, {"x": 2}]


def test_the_sampler_returns_the_last_steps_info_of_a_lone_env() -> None:
    class Env(gym.Env):
        """Episodes of 3 steps whose last step alone has an info."""

        observation_space = spaces.Box(0, 10, (1,), np.float32)
        action_space = spaces.Discrete(2)

        def reset(self, *, seed: int | None = None, options: Any = None) -> Any:
            super().reset(seed=seed)
            self.t = 0
            return np.zeros(1, np.float32), {}

        def step(self, action: Any) -> Any:
            self.t += 1
            end = self.t == 3
            return np.full(1, self.t, np.float32), 1.0, end, False, {"end": True} if end else {}

    with Sampler(Env, lambda obs: np.zeros(len(obs), np.int64), 1, backend="serial") as sampler:
        batch = sampler.sample(6)
    assert batch.env_infos[:3] == [{}, {}, {"end": True}]
    assert batch.env_infos[3:6] == [{}, {}, {"end": True}]
