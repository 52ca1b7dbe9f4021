"""envfleet.Sampler: rollouts with policy versions, exact episodes, env updates (issue 6).

The backbone is differential: each env's steps, as the sampler returns them in segments, are
compared bit for bit with a gymnasium SyncVectorEnv (SAME_STEP autoreset) run with the same seeds
and a deterministic policy, for driver inference (synchronous, first-ready pool, every backend)
and worker inference.
"""

from __future__ import annotations

import functools
import os
import signal
import threading
import time
from typing import Any

import gymnasium as gym
import numpy as np
import pytest
from gymnasium import spaces
from gymnasium.vector import AutoresetMode, SyncVectorEnv

import envfleet
from envfleet import EpisodeBatch, Sampler
from tests.envs import RaisingEnv, WaitingEnv

SEED = 7


# -- policies and envs -----------------------------------------------------------------------


class PolePolicy:
    """Deterministic CartPole policy: push towards the pole's lean. ``tag`` is reported in
    agent_infos, so a test can tell which policy object chose each action."""

    def __init__(self, tag: int = 0):
        self.tag = tag

    def __call__(self, obs: np.ndarray) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        actions = (obs[:, 2] + 0.1 * obs[:, 3] > 0).astype(np.int64)
        return actions, {"tag": np.full(len(obs), self.tag, dtype=np.int64)}

    def set_params(self, params: dict[str, int]) -> None:
        self.tag = params["tag"]


class TaskEnv(gym.Env):
    """Observation ``[task, t, env_index]``: ``task`` is an attribute the sampler updates, ``t``
    the step count within the episode (0 after reset). Episodes last ``length`` steps, or end
    early (terminated) when ``t`` hits ``env_index + 3`` for envs that ``early``."""

    def __init__(self, env_index: int = 0, length: int = 6, early: bool = False):
        self.env_index = env_index
        self.length = length
        self.early = early
        self.task = 0.0
        self.observation_space = spaces.Box(-1e6, 1e6, (3,), np.float64)
        self.action_space = spaces.Discrete(3)
        self._t = 0

    def _obs(self) -> np.ndarray:
        return np.array([self.task, self._t, self.env_index], dtype=np.float64)

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        self._t = 0
        return self._obs(), {"reset_task": self.task}

    def step(self, action: Any):
        self._t += 1
        terminated = self.early and self._t == self.env_index + 3
        truncated = not terminated and self._t >= self.length
        return self._obs(), float(action) + self.task, terminated, truncated, {"t": self._t}


def task_policy(obs: np.ndarray) -> np.ndarray:
    return (obs[:, 1].astype(np.int64) + obs[:, 2].astype(np.int64)) % 3


# -- the model -------------------------------------------------------------------------------


def model_trajectories(env_id: str, num_envs: int, steps: int) -> list[dict[str, list[Any]]]:
    """Per env, its transitions under PolePolicy in a SAME_STEP SyncVectorEnv."""
    model = SyncVectorEnv(
        [lambda: gym.make(env_id)] * num_envs, autoreset_mode=AutoresetMode.SAME_STEP
    )
    policy = PolePolicy()
    obs, _ = model.reset(seed=SEED)
    out: list[dict[str, list[Any]]] = [
        {"obs": [], "act": [], "rew": [], "term": [], "trunc": [], "next": []}
        for _ in range(num_envs)
    ]
    for _ in range(steps):
        actions, _ = policy(obs)
        next_obs, rew, term, trunc, info = model.step(actions)
        for i in range(num_envs):
            done = term[i] or trunc[i]
            after = info["final_obs"][i] if done else next_obs[i]
            for key, value in (
                ("obs", obs[i]),
                ("act", actions[i]),
                ("rew", rew[i]),
                ("term", term[i]),
                ("trunc", trunc[i]),
                ("next", after),
            ):
                out[i][key].append(np.array(value))
        obs = next_obs
    model.close()
    return out


def per_env(batch: EpisodeBatch, env: int) -> dict[str, np.ndarray]:
    """Env ``env``'s steps in the batch, its segments joined in order."""
    segments = [s for s in range(batch.num_segments) if batch.env_index[s] == env]
    part = batch.select(segments)
    return {
        "obs": part.observations,
        "act": part.actions,
        "rew": part.rewards,
        "term": part.terminated,
        "trunc": part.truncated,
        "next": part.next_observations,
    }


def assert_matches_model(batches: list[EpisodeBatch], num_envs: int) -> None:
    joined = EpisodeBatch.concatenate(*batches)
    longest = max(int(joined.lengths[joined.env_index == e].sum()) for e in range(num_envs))
    model = model_trajectories("CartPole-v1", num_envs, longest)
    for e in range(num_envs):
        got = per_env(joined, e)
        n = len(got["rew"])
        assert n > 0, f"env {e} has no steps"
        for key in got:
            want = np.stack(model[e][key][:n])
            assert got[key].dtype == want.dtype or key in ("term", "trunc"), key
            assert np.array_equal(got[key], want.astype(got[key].dtype)), f"env {e} {key}"


def check_segments(batch: EpisodeBatch) -> None:
    """Structural invariants of any EpisodeBatch."""
    assert batch.lengths.min() >= 1
    assert batch.lengths.sum() == batch.num_steps
    last = batch.starts + batch.lengths - 1
    done = batch.terminated | batch.truncated
    inner = np.ones(batch.num_steps, dtype=bool)
    inner[last] = False
    assert not done[inner].any(), "an episode end inside a segment"
    assert len(batch.env_infos) == batch.num_steps
    for value in batch.agent_infos.values():
        assert len(value) == batch.num_steps


# -- differential ----------------------------------------------------------------------------

DRIVER_CASES = {
    "serial": dict(backend="serial"),
    "threads": dict(backend="threads", num_workers=2),
    "processes": dict(backend="processes"),
    "processes-2workers": dict(backend="processes", num_workers=2),
    "pool-processes": dict(backend="processes", batch_size=2),
    "pool-threads": dict(backend="threads", batch_size=3),
    "pool-serial": dict(backend="serial", batch_size=2, num_workers=6),
}


@pytest.mark.parametrize("case", list(DRIVER_CASES))
def test_driver_inference_matches_sync_vector_env(case: str) -> None:
    with Sampler(
        "CartPole-v1", PolePolicy(), 6, inference="driver", seed=SEED, **DRIVER_CASES[case]
    ) as sampler:
        batches = [sampler.sample(250), sampler.sample(170)]
        for batch in batches:
            check_segments(batch)
            assert (batch.policy_version == 0).all()
        assert batches[0].num_steps >= 250 and batches[1].num_steps >= 170
    assert_matches_model(batches, 6)


@pytest.mark.parametrize("num_workers", [1, 2, 3])
def test_worker_inference_matches_sync_vector_env(num_workers: int) -> None:
    with Sampler(
        "CartPole-v1",
        PolePolicy(),
        6,
        inference="worker",
        num_workers=num_workers,
        seed=SEED,
        segment_length=16,
    ) as sampler:
        batches = [sampler.sample(300), sampler.sample(100)]
        assert batches[0].num_steps >= 300 and batches[1].num_steps >= 100
        # Rollouts come first-come: sample on until every env has sent some.
        while len(set(np.concatenate([b.env_index for b in batches]).tolist())) < 6:
            assert len(batches) < 100, "a worker sent nothing"
            batches.append(sampler.sample(50))
        for batch in batches:
            check_segments(batch)
    assert_matches_model(batches, 6)


def test_segments_cut_at_episode_ends_and_sample_ends() -> None:
    factory = lambda env_index: TaskEnv(env_index, length=5, early=True)  # noqa: E731
    with Sampler(factory, task_policy, 3, backend="serial", seed=0) as sampler:
        first = sampler.sample(12)  # 4 steps per env: env 0 ends at t=3, env 1 at 4...
        second = sampler.sample(12)
    for batch in (first, second):
        check_segments(batch)
    # env 0 terminates at t=3, env 1 at t=4, env 2 at t=5 (the episode's length too).
    env0 = first.select(first.env_index == 0)
    assert env0.lengths.tolist() == [3, 1]
    assert env0.terminated[2] and env0.complete.tolist() == [True, False]
    assert np.array_equal(env0.last_observations[:, 1], [3, 1])  # final obs, then the cut
    env2 = second.select(second.env_index == 2)
    assert env2.lengths.tolist() == [1, 3] and env2.terminated.tolist() == [1, 0, 0, 0]
    assert not env2.truncated.any()
    # The cut segment goes on in the next batch: t continues from 4.
    assert second.select(second.env_index == 2).observations[0, 1] == 4
    assert first.env_infos[0] == {"t": 1}
    assert env0.env_infos[2] == {"t": 3}  # the step's own info at an episode end


class InfoEnv(gym.Env):
    """Infos of every kind gymnasium batches differently: ints, floats, bools, numpy scalars,
    arrays, nested dicts, objects, a key of its own named ``env_id``, steps without an info,
    and at an episode's end a step info unlike the reset's that follows it. Episodes of env
    ``i`` last ``3 + i`` steps. The observation is ``[t, env_index]`` in a Dict space."""

    def __init__(self, env_index: int = 0):
        self.env_index = env_index
        self.observation_space = spaces.Dict(
            {"t": spaces.Box(0, 100, (1,), np.float32), "i": spaces.Discrete(8)}
        )
        self.action_space = spaces.Discrete(2)
        self._t = 0

    def _obs(self) -> dict[str, Any]:
        return {"t": np.array([self._t], np.float32), "i": self.env_index}

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        self._t = 0
        return self._obs(), {"reset": True, "n": np.int32(self.env_index)}

    def step(self, action: Any):
        self._t += 1
        truncated = self._t >= 3 + self.env_index
        info: dict[str, Any] = {}
        if self._t % 2 or truncated:  # every other step has no info
            info = {
                "t": self._t,
                "x": self._t / 4,
                "odd": bool(self._t % 2),
                "f32": np.float32(action),
                "vec": np.full(2, self._t, np.int16),
                "nested": {"a": self._t, "b": {"c": 0.5}},
                "name": f"e{self.env_index}",
                "env_id": 99,
            }
        return self._obs(), 1.0, False, truncated, info


@pytest.mark.parametrize("backend", ["serial", "processes"])
def test_worker_inference_records_infos_as_driver_inference_does(backend: str) -> None:
    """Worker inference records each step's info from the envs' own dicts (``as_batched``),
    driver inference from the vector env's batched info: the same values, types and dtypes,
    and the same final observations."""
    policy = lambda obs: (obs["t"][:, 0] % 2).astype(np.int64)  # noqa: E731
    runs = {}
    for inference in ("driver", "worker"):
        with Sampler(
            InfoEnv, policy, 4, seed=SEED, backend=backend, inference=inference,
            segment_length=10, **({"num_workers": 2} if backend == "processes" else {}),
        ) as sampler:  # fmt: skip
            runs[inference] = EpisodeBatch.concatenate(*(sampler.sample(40) for _ in range(2)))
    driver, worker = runs["driver"], runs["worker"]
    assert driver.num_steps == worker.num_steps and worker.num_steps >= 80
    assert np.array_equal(driver.env_index, worker.env_index)
    assert np.array_equal(driver.lengths, worker.lengths)
    for key in ("t", "i"):
        assert np.array_equal(driver.last_observations[key], worker.last_observations[key])
        assert np.array_equal(driver.observations[key], worker.observations[key])
    assert any(worker.env_infos) and not all(worker.env_infos)

    def described(value: Any) -> Any:  # a value with its type (and dtype), all the way down
        if isinstance(value, dict):
            return {key: described(v) for key, v in value.items()}
        if isinstance(value, np.ndarray):
            return ("array", value.dtype.str, value.tolist())
        return (type(value).__name__, value)

    done = worker.terminated | worker.truncated
    for want, got, end in zip(driver.env_infos, worker.env_infos, done, strict=True):
        assert described(got) == described(want)
        assert "reset" not in got  # an ended episode's step info, not its reset's
        # A vector info's env_id is the pool's: left out of a step's info, not of a final one.
        assert ("env_id" in got) == bool(end)


# -- policy versions -------------------------------------------------------------------------


def test_update_policy_in_driver_mode_bumps_the_version() -> None:
    with Sampler("CartPole-v1", PolePolicy(tag=0), 4, backend="serial", seed=0) as sampler:
        sampler.sample(40)
        assert sampler.update_policy(PolePolicy(tag=5)) == 1
        batch = sampler.sample(40)
        assert (batch.policy_version == 1).all() and (batch.agent_infos["tag"] == 5).all()
        sampler.update_policy({"tag": 9})  # parameters: loaded with set_params
        batch = sampler.sample(40)
        assert (batch.policy_version == 2).all() and (batch.agent_infos["tag"] == 9).all()
        assert sampler.policy.tag == 9
    # A policy with no way to load parameters refuses them; the version stays.
    with Sampler("CartPole-v1", task_policy, 2, backend="serial") as sampler:
        with pytest.raises(envfleet.InvalidArgumentError, match="load_state_dict"):
            sampler.update_policy({"w": 1})
        assert sampler.policy_version == 0


def test_pool_drops_actions_in_flight_at_an_update() -> None:
    with Sampler(
        "CartPole-v1", PolePolicy(tag=0), 4, backend="processes", batch_size=2, seed=0
    ) as sampler:
        sampler.sample(60)
        sampler.update_policy(PolePolicy(tag=1))
        batch = sampler.sample(60)
        # Every env had one action of version 0 in flight: exactly those steps are dropped.
        assert sampler.stats.stale_steps_dropped == 4
        assert (batch.policy_version == 1).all() and (batch.agent_infos["tag"] == 1).all()
        check_segments(batch)


def test_pool_keep_stale_returns_tagged_steps() -> None:
    with Sampler(
        "CartPole-v1",
        PolePolicy(tag=0),
        4,
        backend="serial",
        batch_size=2,
        num_workers=4,
        seed=0,
        keep_stale=True,
    ) as sampler:
        sampler.sample(20)
        sampler.update_policy(PolePolicy(tag=1))
        batch = sampler.sample(20)
    stale = batch.select(batch.policy_version == 0)
    assert stale.num_steps == 4 == sampler.stats.stale_steps_kept
    assert (stale.agent_infos["tag"] == 0).all()
    fresh = batch.select(batch.policy_version == 1)
    assert fresh.num_steps >= 20 and (fresh.agent_infos["tag"] == 1).all()


@pytest.mark.parametrize("keep_stale", [False, True])
def test_policy_update_races_with_streaming_workers(keep_stale: bool) -> None:
    """Workers step in the background (``background=True``): when the update lands, a round of
    the old policy is being stepped. None of it comes back as current data; with keep_stale it
    comes back tagged with its version."""
    with Sampler(
        "CartPole-v1",
        PolePolicy(tag=0),
        4,
        inference="worker",
        num_workers=2,
        seed=0,
        segment_length=8,
        background=True,
        keep_stale=keep_stale,
    ) as sampler:
        sampler.sample(64)  # background: a round of version 0 is in flight when it returns
        sampler.update_policy(PolePolicy(tag=1))
        batch = sampler.sample(200)
        stats = sampler.stats
        current = batch.policy_version == 1
        fresh = batch.select(current)
        assert fresh.num_steps >= 200
        assert (fresh.agent_infos["tag"] == 1).all(), "a step of the old policy tagged as new"
        if keep_stale:
            assert stats.stale_steps_kept > 0 and stats.stale_steps_dropped == 0
            old = batch.select(~current)
            assert (old.policy_version == 0).all() and (old.agent_infos["tag"] == 0).all()
        else:
            assert current.all()
            assert stats.stale_steps_dropped > 0 and stats.stale_steps_kept == 0
        # Parameters instead of a policy object reach the workers too.
        sampler.update_policy({"tag": 2})
        batch = sampler.sample(50)
        fresh = batch.select(batch.policy_version == 2)
        assert fresh.num_steps >= 50 and (fresh.agent_infos["tag"] == 2).all()


# -- exact episodes --------------------------------------------------------------------------


def check_whole_episodes(batch: EpisodeBatch) -> None:
    assert batch.complete.all()
    for s, (start, n) in enumerate(zip(batch.starts, batch.lengths, strict=True)):
        t = batch.observations[start : start + n, 1]
        assert np.array_equal(t, np.arange(n)), f"segment {s} is not a whole episode: t={t}"


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(inference="driver", backend="processes", num_workers=2),
        dict(inference="driver", backend="serial", batch_size=2, num_workers=4),
        dict(inference="worker", num_workers=2),
        dict(backend="processes", num_workers=2, segment_length=2),
    ],
    ids=["driver", "driver-pool", "worker", "auto"],
)
def test_sample_episodes_returns_exactly_n_whole_episodes_per_worker(kwargs: dict) -> None:
    factory = lambda env_index: TaskEnv(env_index, length=7, early=True)  # noqa: E731
    with Sampler(factory, task_policy, 4, seed=0, **kwargs) as sampler:
        sampler.sample(10)  # episodes in progress: they must not be returned as whole
        for n in (1, 3):
            batch = sampler.sample_episodes(n)
            ranges = sampler.worker_ranges
            assert batch.num_segments == n * len(ranges)
            check_whole_episodes(batch)
            for w, (start, stop) in enumerate(ranges):
                envs = batch.env_index[w * n : (w + 1) * n]
                assert ((envs >= start) & (envs < stop)).all(), "not in worker order"
        sampler.update_policy(task_policy)
        batch = sampler.sample_episodes(2)
        assert (batch.policy_version == 1).all()
        # sample() goes on afterwards.
        assert sampler.sample(20).num_steps >= 20


def test_sample_episodes_takes_the_first_to_end() -> None:
    """One worker, envs whose episodes end at t = index + 3: env 0's come first."""
    factory = lambda env_index: TaskEnv(env_index, length=50, early=True)  # noqa: E731
    with Sampler(factory, task_policy, 3, inference="worker", num_workers=1, seed=0) as sampler:
        batch = sampler.sample_episodes(4)
    # Ends: env0 at 3, env1 at 4, env2 at 5, env0 at 6 -> the first four in that order.
    assert batch.env_index.tolist() == [0, 1, 2, 0]
    assert batch.lengths.tolist() == [3, 4, 5, 3]


# -- env updates -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(inference="driver", backend="processes", num_workers=2),
        dict(inference="driver", backend="processes", batch_size=2),
        dict(inference="worker", num_workers=2, background=True, segment_length=4),
        dict(backend="processes", num_workers=2, segment_length=4),  # calibrating throughout
    ],
    ids=["driver", "driver-pool", "worker-background", "auto"],
)
def test_env_updates_are_visible_in_the_next_batch(kwargs: dict) -> None:
    factory = lambda env_index: TaskEnv(env_index, length=6)  # noqa: E731
    with Sampler(factory, task_policy, 4, seed=0, **kwargs) as sampler:
        batch = sampler.sample(30)
        assert (batch.observations[:, 0] == 0).all()
        sampler.update_envs({"task": 2.5})
        batch = sampler.sample(30)
        assert (batch.observations[:, 0] == 2.5).all() and (
            batch.last_observations[:, 0] == 2.5
        ).all()
        assert (batch.rewards >= 2.5).all()
        # Episodes restart after an update: each env's first step starts at t = 0.
        for env in set(batch.env_index.tolist()):
            assert batch.select(batch.env_index == env).observations[0, 1] == 0
        sampler.update_envs(
            lambda env: setattr(env.unwrapped, "task", 10.0 + env.unwrapped.env_index)
        )
        batch = sampler.sample(30)
        assert np.array_equal(batch.observations[:, 0], 10.0 + batch.observations[:, 2])
        sampler.update_envs([{"task": -float(i)} for i in range(4)])
        batch = sampler.sample(30)
        assert np.array_equal(batch.observations[:, 0], -batch.observations[:, 2])
        assert sampler.stats.env_version == 3


def test_bad_env_updates_are_refused_before_anything_is_sent() -> None:
    factory = lambda env_index: TaskEnv(env_index)  # noqa: E731
    with Sampler(factory, task_policy, 2, inference="worker", num_workers=2, seed=0) as sampler:
        for bad in (3, [{"task": 1}], [{"task": 1}, {"other": 2}], {1: 2}):
            with pytest.raises(envfleet.InvalidArgumentError):
                sampler.update_envs(bad)
        assert sampler.stats.env_version == 0
        assert sampler.sample(10).num_steps >= 10


# -- errors, crashes, arguments --------------------------------------------------------------


@pytest.mark.parametrize("inference", ["driver", "worker"])
def test_env_error_is_raised_with_the_remote_traceback(inference: str) -> None:
    factory = lambda env_index: RaisingEnv(env_index, fail_index=1, fail_after=5)  # noqa: E731
    kwargs: dict[str, Any] = {"num_workers": 2}
    if inference == "driver":
        kwargs["backend"] = "processes"
    sampler = Sampler(
        factory, lambda o: np.zeros(len(o), dtype=np.int64), 2, inference=inference, **kwargs
    )
    with pytest.raises(envfleet.EnvError) as info:  # noqa: PT012
        for _ in range(1000):  # worker 0's rollouts may come first: sample on until it comes
            sampler.sample(100)
    assert info.value.env_index == 1
    assert isinstance(info.value.__cause__, ValueError)
    assert "boom" in str(info.value.__cause__)
    chain, cause = [], info.value.__cause__
    while cause is not None:
        chain.append(cause)
        cause = cause.__cause__
    assert any(isinstance(c, envfleet.RemoteTraceback) for c in chain)
    sampler.close()


def test_worker_crash_is_reported_and_nothing_is_left(snapshot: Any) -> None:
    sampler = Sampler(
        "CartPole-v1",
        PolePolicy(),
        4,
        inference="worker",
        num_workers=2,
        seed=0,
        supervision=envfleet.Supervision(restart_policy=None),  # fail fast
    )
    sampler.sample(20)
    pid = sampler.vector_env.apply(lambda env: os.getpid())[2]  # env 2's worker: worker 1
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(envfleet.EnvCrashedError) as info:
        sampler.sample(100_000)
    assert info.value.worker_index == 1 and info.value.env_indices == [2, 3]
    with pytest.raises(envfleet.ClosedEnvironmentError):
        sampler.sample(10)
    sampler.close()
    snapshot.assert_nothing_left()


def test_worker_timeout() -> None:
    class Slow(gym.Wrapper):
        def step(self, action: Any) -> Any:
            time.sleep(5)
            return super().step(action)

    factory = lambda: Slow(gym.make("CartPole-v1"))  # noqa: E731
    with (
        Sampler(
            factory,
            PolePolicy(),
            2,
            inference="worker",
            num_workers=1,
            supervision=envfleet.Supervision(step_timeout=0.5),
        ) as sampler,
        pytest.raises(envfleet.StepTimeoutError),
    ):
        sampler.sample(10)


def test_close_leaves_nothing(snapshot: Any) -> None:
    for inference in ("driver", "worker"):
        sampler = Sampler("CartPole-v1", PolePolicy(), 4, inference=inference, num_workers=2)
        sampler.sample(50)
        sampler.close()
        sampler.close()  # idempotent
        with pytest.raises(envfleet.ClosedEnvironmentError):
            sampler.sample(1)
    snapshot.assert_nothing_left()


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(inference="gpu"), "inference"),
        (dict(num_envs=0), "num_envs"),
        (dict(segment_length=0, inference="worker"), "segment_length"),
        (dict(inference="worker", batch_size=2), "inference='driver'"),
        (dict(background=True), "background"),
        (dict(autoreset_mode="next_step"), "SAME_STEP"),
        (dict(num_envs=5, batch_size=2, backend="serial"), "multiple of batch_size"),
        (dict(inference="worker", num_workers=9), "num_workers"),
        (dict(supervision=None), "supervision"),
        (dict(backend="envpool", inference="worker"), "backend='envpool' has no Python workers"),
        (dict(output="torch"), "numpy observations"),
    ],
)
def test_bad_arguments(kwargs: dict, match: str, snapshot: Any) -> None:
    num_envs = kwargs.pop("num_envs", 4)
    with pytest.raises(envfleet.ConfigError, match=match):
        Sampler("CartPole-v1", PolePolicy(), num_envs, **kwargs)
    snapshot.assert_nothing_left()


def test_unpicklable_policy_for_workers() -> None:
    import threading

    lock = threading.Lock()
    with pytest.raises(envfleet.ConfigError, match="picklable"):
        Sampler("CartPole-v1", lambda o, lock=lock: np.zeros(len(o), int), 2, inference="worker")


def test_bad_sample_arguments() -> None:
    with Sampler("CartPole-v1", PolePolicy(), 2, backend="serial") as sampler:
        for bad in (0, -3, 2.5, True, "10"):
            with pytest.raises(envfleet.InvalidArgumentError):
                sampler.sample(bad)  # type: ignore[arg-type]
            with pytest.raises(envfleet.InvalidArgumentError):
                sampler.sample_episodes(bad)  # type: ignore[arg-type]
        assert sampler.sample(5).num_steps >= 5


# -- timers, progress, batch helpers ---------------------------------------------------------


def test_timers_are_merged_from_the_workers() -> None:
    with Sampler("CartPole-v1", PolePolicy(), 4, inference="worker", num_workers=2) as sampler:
        sampler.sample(200)
        for _ in range(100):  # rollouts come first-come: until both workers have reported
            timers = sampler.timers
            if all("env_step" in worker for worker in timers.workers):
                break
            sampler.sample(50)
    assert len(timers.workers) == 2
    for worker in timers.workers:
        assert worker["env_step"].count > 0 and worker["policy"].count > 0
    assert timers.merged["env_step"].count == sum(w["env_step"].count for w in timers.workers)
    assert timers.merged["env_step"].total_s > 0 and timers.driver["waiting"].count > 0
    with Sampler(
        "CartPole-v1", PolePolicy(), 4, inference="driver", backend="processes", num_workers=2
    ) as sampler:
        sampler.sample(200)
        timers = sampler.timers
    assert timers.driver["policy"].count >= 50 and timers.driver["env_step"].count >= 50
    assert [w["env_step"].count for w in timers.workers] == [50, 50]


def test_progress_bar(capsys: Any) -> None:
    with Sampler("CartPole-v1", PolePolicy(), 2, backend="serial", progress=True) as sampler:
        assert sampler.sample(100).num_steps >= 100
    with Sampler("CartPole-v1", PolePolicy(), 2, backend="serial") as sampler:
        sampler.sample(20_000)  # not a terminal: no bar by default
    assert "sampling" not in capsys.readouterr().err


def test_episode_batch_helpers() -> None:
    factory = lambda env_index: TaskEnv(env_index, length=4)  # noqa: E731
    with Sampler(factory, task_policy, 2, backend="serial", seed=0) as sampler:
        a, b = sampler.sample(10), sampler.sample(6)
    both = EpisodeBatch.concatenate(a, b)
    assert both.num_steps == a.num_steps + b.num_steps
    assert both.num_segments == a.num_segments + b.num_segments
    parts = both.split()
    assert [p.num_steps for p in parts] == both.lengths.tolist()
    assert EpisodeBatch.concatenate(*parts).rewards.tolist() == both.rewards.tolist()
    nxt = a.next_observations
    last = a.starts + a.lengths - 1
    inner = np.setdiff1d(np.arange(a.num_steps), last)
    assert np.array_equal(nxt[inner], a.observations[inner + 1])
    assert np.array_equal(nxt[last], a.last_observations)
    with pytest.raises(ValueError):
        EpisodeBatch.concatenate()


# -- worker inference on the vector env's own workers (issue 18) ------------------------------


@pytest.mark.parametrize(
    "backend",
    ["serial", "threads", "processes", pytest.param("ray", marks=pytest.mark.ray)],
)
def test_worker_inference_on_every_backend_matches_sync_vector_env(backend: str) -> None:
    """The policy copies run in the backend's own workers, next to their envs: every env's
    steps are those of a SyncVectorEnv with the same seeds and policy."""
    if backend == "ray":
        from tests.conftest import ensure_ray

        ensure_ray()
    with Sampler(
        "CartPole-v1",
        PolePolicy(),
        6,
        inference="worker",
        backend=backend,
        num_workers=2,
        seed=SEED,
        segment_length=16,
    ) as sampler:
        assert sampler.worker_ranges == ((0, 3), (3, 6))
        batches = [sampler.sample(300), sampler.sample(100)]
        for batch in batches:
            check_segments(batch)
        assert batches[0].num_steps >= 300 and batches[1].num_steps >= 100
        # Every env stepped exactly as many steps in each round: 16 per round per env.
        steps = np.bincount(np.concatenate([b.env_index for b in batches]), minlength=6)
        assert (steps > 0).all()
    assert_matches_model(batches, 6)


class HangsAfter(gym.Wrapper):
    """CartPole whose env ``hang_index`` blocks for good in its ``steps``-th step."""

    def __init__(self, env_index: int, hang_index: int, steps: int):
        super().__init__(gym.make("CartPole-v1"))
        self.hangs = env_index == hang_index
        self.steps = steps

    def step(self, action: Any) -> Any:
        self.steps -= 1
        if self.hangs and self.steps <= 0:
            threading.Event().wait()  # never set
        return super().step(action)


def test_worker_inference_reports_a_hung_env_while_other_workers_run(snapshot: Any) -> None:
    """One env hangs, the other worker keeps delivering: the round's timeout still fires,
    names the hung env's worker, and leaves nothing behind."""
    factory = lambda env_index: HangsAfter(env_index, hang_index=3, steps=40)  # noqa: E731
    sampler = Sampler(
        factory,
        PolePolicy(),
        4,
        inference="worker",
        num_workers=2,
        seed=0,
        supervision=envfleet.Supervision(step_timeout=2.0),
    )
    with pytest.raises(envfleet.StepTimeoutError) as info:
        for _ in range(100):
            sampler.sample(64)
    assert info.value.env_indices == [2, 3]
    with pytest.raises(envfleet.ClosedEnvironmentError):
        sampler.sample(1)
    sampler.close()
    snapshot.assert_nothing_left()


class HangsInWorkers(gym.Wrapper):
    """CartPole whose construction blocks for good in any process but ``driver_pid``'s."""

    def __init__(self, driver_pid: int):
        if os.getpid() != driver_pid:
            threading.Event().wait()  # never set
        super().__init__(gym.make("CartPole-v1"))


def test_worker_inference_honours_the_start_timeout(snapshot: Any) -> None:
    factory = functools.partial(HangsInWorkers, os.getpid())
    with pytest.raises(envfleet.StartTimeoutError):
        Sampler(
            factory,
            PolePolicy(),
            2,
            inference="worker",
            num_workers=2,
            supervision=envfleet.Supervision(start_timeout=1.0),
        )
    snapshot.assert_nothing_left()


# -- worker inference under a restart policy (issue 18: one supervisor) -----------------------


class OnceFaultEnv(gym.Env):
    """Random 2-d observations (seeded), episodes of ``length`` steps. Env ``fault_index``
    does ``how`` (``"raise"`` or ``"sigkill"`` of its process) in its ``at_step``-th step, or
    (``"raise-reset"``) raises in the first autoreset after it, once per ``marker`` file: a
    rebuilt env does not fault again."""

    def __init__(self, env_index: int, marker: str, how: str, fault_index: int, at_step: int):
        self.observation_space = spaces.Box(-1.0, 1.0, (2,), np.float32)
        self.action_space = spaces.Discrete(2)
        self.faulty = how != "none" and env_index == fault_index
        self.marker, self.how, self.at_step = marker, how, at_step
        self.length = 7 + env_index
        self._steps = self._t = 0

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> Any:
        super().reset(seed=seed)
        if (
            self.faulty
            and self.how == "raise-reset"
            and self._steps >= self.at_step
            and not os.path.exists(self.marker)
        ):
            open(self.marker, "w").close()
            raise ValueError(f"boom in the reset after step {self._steps}")
        self._t = 0
        return self.np_random.uniform(-1.0, 1.0, 2).astype(np.float32), {"t": 0}

    def step(self, action: Any) -> Any:
        self._steps += 1
        self._t += 1
        if (
            self.faulty
            and self.how != "raise-reset"
            and self._steps == self.at_step
            and not os.path.exists(self.marker)
        ):
            open(self.marker, "w").close()
            if self.how == "sigkill":
                os.kill(os.getpid(), signal.SIGKILL)
                time.sleep(60)  # the signal is delivered before this returns
            raise ValueError(f"boom in step {self._steps}")
        obs = self.np_random.uniform(-1.0, 1.0, 2).astype(np.float32)
        return obs, float(action), False, self._t >= self.length, {"t": self._t}


def sign_policy(obs: np.ndarray) -> np.ndarray:
    return (obs[:, 0] > 0).astype(np.int64)


def env_stream(batches: list[EpisodeBatch], e: int) -> dict[str, np.ndarray]:
    """Env ``e``'s steps, in order, from a list of batches."""
    batch = EpisodeBatch.concatenate(*batches)
    rows = np.concatenate(
        [
            np.arange(s, s + n)
            for s, n in zip(batch.starts, batch.lengths, strict=True)
            if batch.env_index[np.searchsorted(batch.starts, s)] == e
        ]
        or [np.zeros(0, dtype=np.int64)]
    )
    return {
        "obs": batch.observations[rows],
        "act": batch.actions[rows],
        "rew": batch.rewards[rows],
        "trunc": batch.truncated[rows],
        "next": batch.next_observations[rows],
    }


def run_with_fault(marker: str, how: str, fault_index: int, **kwargs: Any) -> tuple[Any, Any]:
    factory = functools.partial(
        OnceFaultEnv, marker=marker, how=how, fault_index=fault_index, at_step=13
    )
    with Sampler(
        lambda env_index: factory(env_index),
        sign_policy,
        4,
        inference="worker",
        num_workers=2,
        seed=3,
        segment_length=8,
        supervision=envfleet.Supervision(
            restart_policy=envfleet.RestartPolicy(
                restart_on=(Exception,), max_restarts=2, window_s=600.0
            )
        ),
        **kwargs,
    ) as sampler:
        batches = [sampler.sample(64) for _ in range(6)]
        return batches, sampler.stats


def test_worker_inference_an_autoreset_that_raises_after_an_episode_end(tmp_path: Any) -> None:
    """Env 1's episode ends at its 16th step and the autoreset after it raises: that step is
    recorded as the vector env batches it (its end, then its restart): truncated, reward 0,
    its own info with the restart flag, on the observation it acted on; the other envs are
    untouched and env 1 goes on from its restart."""
    clean, _ = run_with_fault(str(tmp_path / "none"), "none", 1, backend="processes")
    faulty, stats = run_with_fault(str(tmp_path / "fault"), "raise-reset", 1, backend="processes")
    assert stats.env_restarts == 1
    for e in (0, 2, 3):
        got, want = env_stream(faulty, e), env_stream(clean, e)
        n = min(len(got["rew"]), len(want["rew"]))
        for key in got:
            assert np.array_equal(got[key][:n], want[key][:n]), f"env {e} {key}"
    joined = EpisodeBatch.concatenate(*faulty)
    flagged = [k for k, info in enumerate(joined.env_infos) if info.get("env_restarted")]
    assert len(flagged) == 1
    k = flagged[0]
    assert joined.env_infos[k] == {"t": 8, "env_restarted": True}
    assert joined.truncated[k] and joined.rewards[k] == 0.0
    stream = env_stream(faulty, 1)
    assert np.array_equal(stream["next"][15], stream["obs"][15])  # its 16th step
    assert len(stream["rew"]) >= 20  # it goes on after its restart


@pytest.mark.parametrize(
    ("how", "backend"),
    [("raise", "processes"), ("sigkill", "processes"), ("raise", "threads")],
)
def test_worker_inference_restarts_what_failed_and_leaves_the_rest(
    how: str, backend: str, tmp_path: Any
) -> None:
    """An env raises, or its worker is SIGKILLed, in the middle of a round: the restart policy
    rebuilds it; every env outside the failed worker (and, for an exception, every env of it
    but the one that raised) yields exactly the steps of a run without the fault; every env
    keeps producing data."""
    clean, _ = run_with_fault(str(tmp_path / "none"), "none", 1, backend=backend)
    faulty, stats = run_with_fault(str(tmp_path / "fault"), how, 1, backend=backend)
    assert stats.env_restarts == (1 if how == "raise" else 2)  # the worker's two envs
    untouched = [0, 2, 3] if how == "raise" else [2, 3]
    for e in range(4):
        got, want = env_stream(faulty, e), env_stream(clean, e)
        assert len(got["rew"]) >= 20, f"env {e} stopped producing data"
        if e in untouched:
            n = min(len(got["rew"]), len(want["rew"]))
            for key in got:
                assert np.array_equal(got[key][:n], want[key][:n]), f"env {e} {key}"
    for batch in faulty:
        check_segments(batch)
    if how == "raise":
        # The env that raised ends its episode there, truncated and flagged, on the
        # observation it acted on; its next episode starts from its restart.
        joined = EpisodeBatch.concatenate(*faulty)
        flagged = [k for k, info in enumerate(joined.env_infos) if info.get("env_restarted")]
        assert len(flagged) == 1
        k = flagged[0]
        assert joined.truncated[k] and not joined.terminated[k] and joined.rewards[k] == 0.0
        stream = env_stream(faulty, 1)
        want = env_stream(clean, 1)
        fault_step = 12  # the 13th step since make
        for key in ("obs", "act"):
            assert np.array_equal(stream[key][: fault_step + 1], want[key][: fault_step + 1])
        assert stream["trunc"][fault_step]
        assert np.array_equal(stream["next"][fault_step], stream["obs"][fault_step])


def pendulum_policy(obs: np.ndarray) -> np.ndarray:
    """A deterministic float64 torque for Pendulum-v1's float32 Box: bits a float32 cannot
    hold, so a cast on the way to the env shows in what the env computes."""
    return np.clip(np.asarray(obs, dtype=np.float64)[:, :1] * 1.7 + 0.1234567891234, -2.0, 2.0)


@pytest.mark.parametrize(
    "inference, options",
    [
        ("driver", {"backend": "serial"}),
        ("driver", {"backend": "processes", "num_workers": 2}),
        ("worker", {"backend": "processes", "num_workers": 2}),
        ("worker", {"backend": "threads", "num_workers": 2}),
    ],
)
def test_the_policys_dtype_reaches_the_env_as_in_sync_vector_env(inference, options) -> None:
    """A float64 policy on a float32 Box: every mode hands each env the policy's own float64
    action, as a SyncVectorEnv loop does, so the transitions equal that loop's bit for bit."""
    num_envs, steps = 4, 60
    sampler = Sampler("Pendulum-v1", pendulum_policy, num_envs, inference=inference, seed=SEED,
                      segment_length=8, progress=False, **options)  # fmt: skip
    try:
        batch = EpisodeBatch.concatenate(*[sampler.sample(num_envs * 8) for _ in range(4)])
    finally:
        sampler.close()
    model = SyncVectorEnv(
        [lambda: gym.make("Pendulum-v1")] * num_envs, autoreset_mode=AutoresetMode.SAME_STEP
    )
    obs, _ = model.reset(seed=SEED)
    want: list[list[np.ndarray]] = [[] for _ in range(num_envs)]
    for _ in range(steps):
        obs, _, _, _, _ = model.step(pendulum_policy(obs))
        for e in range(num_envs):
            want[e].append(obs[e].copy())
    model.close()
    for e in range(num_envs):
        got = per_env(batch, e)["next"]
        assert len(got) > 0, f"env {e} has no steps"
        assert got.dtype == np.float32
        np.testing.assert_array_equal(got, np.stack(want[e][: len(got)]), err_msg=f"env {e}")


def _zeros(obs: np.ndarray) -> np.ndarray:
    return np.zeros(len(obs), dtype=np.int64)


@pytest.mark.parametrize(
    ("env", "kind"), [("waiting", "wait"), ("CartPole-v1", "compute")], ids=["wait", "compute"]
)
def test_worker_inference_steps_waiting_envs_at_once_and_the_report_says_so(
    env: str, kind: str
) -> None:
    """Issue 50: the workers' own step loop (worker inference) learns the kind of its envs as
    a vector env's does: envs that sleep 1 ms a step are stepped all at once, CartPole's one
    after another, and ``Sampler.report()`` says which it saw."""
    factory = WaitingEnv if env == "waiting" else env
    with Sampler(factory, _zeros, 4, inference="worker", num_workers=2, seed=SEED) as sampler:
        for _ in range(4):
            sampler.sample(256)
        report = sampler.report()
        workers = sampler.vector_env.stats.workers
    assert report.env_kind == kind, workers
    assert f"envs: {kind} (" in str(report)
    if kind == "wait":
        assert all(w.concurrent and w.concurrent_steps > 0 for w in workers), workers
    else:
        assert not any(w.concurrent_steps for w in workers), workers
