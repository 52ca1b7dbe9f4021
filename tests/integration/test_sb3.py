"""The stable-baselines3 adapter: differential against SB3's DummyVecEnv, the VecEnv API, PPO."""

from __future__ import annotations

import functools
from copy import deepcopy
from typing import Any

import gymnasium as gym
import numpy as np
import pytest

import envfleet
from tests.envs import (
    ActionDtypeEnv,
    FlakyEnv,
    IndexedEnv,
    make_indexed,
    make_indexed_kwonly,
    sync_factories,
)

pytest.importorskip("stable_baselines3")

from stable_baselines3 import PPO  # noqa: E402
from stable_baselines3.common.monitor import Monitor  # noqa: E402
from stable_baselines3.common.vec_env import DummyVecEnv  # noqa: E402

from envfleet.adapters.sb3 import SB3VecEnv  # noqa: E402

NUM_ENVS = 3


def assert_info_equal(got: Any, want: Any, path: str) -> None:
    """Equal keys and values; arrays of the same dtype. Python scalars in DummyVecEnv's infos
    come back from gymnasium's vector infos as numpy scalars of equal value, and an info's
    keys in the order the vector infos first saw them (over all envs)."""
    if isinstance(want, dict):
        assert isinstance(got, dict) and set(got) == set(want), f"{path}: {got} != {want}"
        for key in want:
            assert_info_equal(got[key], want[key], f"{path}[{key!r}]")
    elif isinstance(want, (list, tuple)):
        assert type(got) is type(want) and len(got) == len(want), f"{path}: {got} != {want}"
        for k, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_info_equal(g, w, f"{path}[{k}]")
    elif isinstance(want, np.ndarray):
        assert isinstance(got, np.ndarray) and got.dtype == want.dtype, f"{path}: {got!r}"
        np.testing.assert_array_equal(got, want, err_msg=path)
    else:
        assert got == want, f"{path}: {got!r} != {want!r}"
        assert type(got) is type(want) or np.asarray(got).dtype.kind == np.asarray(want).dtype.kind


def assert_obs_equal(got: Any, want: Any) -> None:
    assert type(got) is type(want)
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_array_equal(got, want)


def check_against_dummy(venv: SB3VecEnv, ref: DummyVecEnv, steps: int, seed: int) -> dict:
    """Step both with the same actions; compare everything SB3 sees. Returns counts."""
    venv.seed(seed)
    ref.seed(seed)
    assert_obs_equal(venv.reset(), ref.reset())
    assert_info_equal(venv.reset_infos, ref.reset_infos, "reset_infos")
    space = ref.action_space
    space.seed(seed)
    counts = {"dones": 0, "truncated": 0}
    for t in range(steps):
        actions = np.stack([space.sample() for _ in range(NUM_ENVS)])
        if t % 2:  # SB3's step (one vector-env step), and its two halves
            obs, rewards, dones, infos = venv.step(actions)
        else:
            venv.step_async(actions)
            obs, rewards, dones, infos = venv.step_wait()
        w_obs, w_rewards, w_dones, w_infos = ref.step(actions)
        assert_obs_equal(obs, w_obs)
        assert rewards.dtype == w_rewards.dtype == np.float32
        np.testing.assert_array_equal(rewards, w_rewards, err_msg=f"rewards at step {t}")
        assert dones.dtype == w_dones.dtype and dones.tolist() == w_dones.tolist(), t
        assert len(infos) == NUM_ENVS
        assert_info_equal(infos, w_infos, f"infos at step {t}")
        assert_info_equal(venv.reset_infos, ref.reset_infos, f"reset_infos at step {t}")
        counts["dones"] += int(dones.sum())
        counts["truncated"] += sum(info["TimeLimit.truncated"] for info in infos)
    return counts


@pytest.mark.parametrize("backend", ["serial", "processes"])
@pytest.mark.parametrize(
    "env_id, steps",
    [
        ("CartPole-v1", 120),  # terminations; Box obs, Discrete actions
        ("Pendulum-v1", 205),  # truncation at 200 steps (TimeLimit.truncated); Box actions
        ("Taxi-v4", 205),  # Discrete obs, infos with an int8 array and a float; truncation
    ],
)
def test_matches_dummy_vec_env(backend, env_id, steps):
    venv = SB3VecEnv(env_id, NUM_ENVS, backend=backend)
    ref = DummyVecEnv([lambda: gym.make(env_id)] * NUM_ENVS)
    try:
        counts = check_against_dummy(venv, ref, steps, seed=11)
        assert counts["dones"] > 0
        if env_id != "CartPole-v1":
            assert counts["truncated"] > 0
        # Seeds are used once (SB3): the next reset is unseeded in both, so only shapes match.
        assert venv._seeds == [None] * NUM_ENVS
        assert venv.reset().shape == ref.reset().shape
    finally:
        venv.close()
        ref.close()


@pytest.mark.parametrize("backend", ["serial", "processes"])
def test_infos_of_every_kind_match_dummy_vec_env(backend):
    """FlakyEnv's step infos (int, float, array, nested dict, string) and reset infos."""
    venv = SB3VecEnv(FlakyEnv, NUM_ENVS, backend=backend)
    ref = DummyVecEnv(sync_factories(FlakyEnv, NUM_ENVS))
    try:
        counts = check_against_dummy(venv, ref, 80, seed=2)
        assert counts["dones"] > 0 and counts["truncated"] > 0
    finally:
        venv.close()
        ref.close()


def test_restarted_env_ends_its_episode_truncated():
    policy = envfleet.RestartPolicy(restart_on=(Exception,), max_restarts=5, window_s=60)
    factory = functools.partial(FlakyEnv, faults={1: "raise"}, fault_after=3)
    venv = SB3VecEnv(
        factory,
        NUM_ENVS,
        backend="processes",
        supervision=envfleet.Supervision(restart_policy=policy),
    )
    try:
        venv.seed(0)
        venv.reset()
        restarted = []
        for _ in range(6):
            obs, _, dones, infos = venv.step(np.zeros(NUM_ENVS, dtype=np.int64))
            if infos[1].get("env_restarted"):
                restarted.append(infos[1])
                assert dones[1] and infos[1]["TimeLimit.truncated"] is True
                assert infos[1]["terminal_observation"].shape == (3,)
        assert restarted and venv.fleet.stats.restarts > 0
    finally:
        venv.close()


def test_options_per_env(make_env):
    """set_options with different options per env (CartPole's reset bounds), as DummyVecEnv."""
    venv = SB3VecEnv("CartPole-v1", NUM_ENVS, backend="processes")
    ref = DummyVecEnv([lambda: gym.make("CartPole-v1")] * NUM_ENVS)
    try:
        for options in (
            [{"low": -0.01, "high": 0.01}, {}, {"low": -0.2, "high": 0.2}],
            {"low": -0.3, "high": 0.3},
        ):
            venv.set_options(options)
            ref.set_options(options)
            check_against_dummy(venv, ref, 20, seed=5)
            assert venv._options == [{}] * NUM_ENVS
    finally:
        venv.close()
        ref.close()


def test_attributes_and_methods_act_on_indices_only():
    venv = SB3VecEnv(make_indexed, 4, backend="processes", num_workers=2)
    try:
        assert venv.get_attr("env_index") == [0, 1, 2, 3]
        assert venv.get_attr("env_index", indices=[3, 1]) == [3, 1]
        assert venv.get_attr("env_index", indices=2) == [2]
        venv.set_attr("value", "x", indices=[1, 2])
        assert venv.get_attr("value") == [None, "x", "x", None]
        assert venv.env_method("add", 10, y=1, indices=[2, 0]) == [13, 11]
        # A method with a side effect runs on the chosen envs only.
        venv.env_method("__setattr__", "value", 7, indices=3)
        assert venv.get_attr("value") == [None, "x", "x", 7]
        assert venv.has_attr("value") and not venv.has_attr("no_such_attribute")
        with pytest.raises(AttributeError):
            venv.get_attr("no_such_attribute", indices=[0])
        with pytest.raises(envfleet.EnvError):
            venv.env_method("no_such_method")
        assert len(set(venv.get_attr("pid"))) == 2  # the envs live in 2 worker processes
        assert venv.env_is_wrapped(Monitor) == [False] * 4
    finally:
        venv.close()


def test_env_is_wrapped():
    def monitored(env_index):
        env = gym.make("CartPole-v1")
        return Monitor(env) if env_index % 2 == 0 else env

    venv = SB3VecEnv(monitored, 4, backend="processes")
    try:
        assert venv.env_is_wrapped(Monitor) == [True, False, True, False]
        assert venv.env_is_wrapped(Monitor, indices=[1, 0]) == [False, True]
        assert venv.env_is_wrapped(gym.wrappers.TimeLimit) == [True] * 4
    finally:
        venv.close()


def test_render_and_get_images():
    factory = functools.partial(make_indexed_kwonly, render_mode="rgb_array")
    venv = SB3VecEnv(factory, 4, backend="serial")
    try:
        assert venv.render_mode == "rgb_array"
        images = venv.get_images()
        assert [int(img[0, 0, 0]) for img in images] == [0, 1, 2, 3]
        tiled = venv.render(mode="rgb_array")
        assert tiled is not None and tiled.shape == (10, 14, 3)  # 2 x 2 tiles of 5 x 7
    finally:
        venv.close()
    venv = SB3VecEnv(IndexedEnv, 2, backend="serial")
    try:
        with pytest.warns(UserWarning):
            assert venv.get_images() == [None, None]
    finally:
        venv.close()


def test_fixed_arguments_refused():
    with pytest.raises(envfleet.ConfigError, match="autoreset_mode"):
        SB3VecEnv("CartPole-v1", 2, autoreset_mode="next_step")
    with pytest.raises(envfleet.ConfigError, match="copy"):
        SB3VecEnv("CartPole-v1", 2, copy=True)
    with pytest.raises(envfleet.ConfigError, match="envpool"):
        SB3VecEnv("CartPole-v1", 2, backend="envpool")
    with pytest.raises(envfleet.ConfigError, match="env_kwargs"):
        SB3VecEnv(make_indexed, 2, env_kwargs={"x": 1})


def test_ppo_trains_through_the_adapter():
    """SB3's PPO runs its rollouts and updates through the adapter on worker processes."""
    torch = pytest.importorskip("torch")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the policy's one thread beside the workers on a small machine
    venv = SB3VecEnv(lambda: Monitor(gym.make("CartPole-v1")), 4, backend="processes")
    try:
        model = PPO("MlpPolicy", venv, n_steps=64, batch_size=256, n_epochs=1, seed=0, device="cpu")
        model.learn(total_timesteps=2048)
        assert model.num_timesteps == 2048
        assert model._n_updates == 2048 // (64 * 4)  # one epoch of one batch per rollout
        assert len(model.ep_info_buffer) > 0  # Monitor's episodes reached SB3 through infos
        assert all(ep["l"] > 0 and ep["r"] == ep["l"] for ep in model.ep_info_buffer)
        assert venv.fleet.stats.crashes == 0
    finally:
        venv.close()
        torch.set_num_threads(threads)


def test_sb3_step_takes_the_fast_step_round():
    """SB3's ``VecEnv.step`` (what its algorithms call) goes through the vector env's C step
    round, which ``step_async``/``step_wait`` do not take: its counter advances once a step."""
    speedups = envfleet._core.native.speedups
    if speedups is None:
        pytest.skip("envfleet._core._speedups is not built here")
    venv = SB3VecEnv("CartPole-v1", NUM_ENVS, backend="processes")
    try:
        venv.reset()
        before = speedups.counters()["full_round"]
        for t in range(10):
            venv.step(np.full(NUM_ENVS, t % 2))
        assert speedups.counters()["full_round"] - before == 10
    finally:
        venv.close()


# -- drop-in for SubprocVecEnv (SB3's own tests/test_vec_envs.py, tools/sb3_tests/) ------------


@pytest.mark.parametrize("backend", ["serial", "processes"])
def test_negative_indices_count_from_the_end(backend):
    """SB3's test_vecenv_custom_calls: ``indices=[0, -1]`` are the first and the last env, as
    SB3's vec envs index their lists; an index out of range raises before anything is sent."""
    venv = SB3VecEnv(make_indexed, 4, backend=backend, num_workers=2)
    try:
        assert venv.get_attr("env_index", indices=[0, -1]) == [0, 3]
        assert venv.get_attr("env_index", indices=-2) == [2]
        venv.env_method("set_wrapper_attr", "value", 12, indices=[0, -1])
        assert venv.get_attr("value") == [12, None, None, 12]
        venv.set_attr("value", 5, indices=np.array([-3]))
        assert venv.get_attr("value") == [12, 5, None, 12]
        assert venv.env_is_wrapped(Monitor, indices=[-1]) == [False]
        for bad in (4, -5, [0, 9]):
            with pytest.raises(IndexError, match="out of range"):
                venv.env_method("set_wrapper_attr", "value", 0, indices=bad)
        assert venv.get_attr("value") == [12, 5, None, 12]  # nothing was sent
    finally:
        venv.close()


@pytest.mark.parametrize("backend", ["serial", "processes"])
@pytest.mark.parametrize("kind", ["dict", "tuple"])
def test_per_env_actions_of_dict_and_tuple_spaces_match_dummy_vec_env(backend, kind):
    """SB3's test_vecenv_dict_spaces and _tuple_spaces: SB3 hands ``step`` a list with one
    action per env for Dict and Tuple action spaces (DummyVecEnv and SubprocVecEnv index it
    by env); each env gets its own action, in the caller's dtype, as DummyVecEnv hands it."""
    factory = functools.partial(ActionDtypeEnv, kind)
    venv = SB3VecEnv(factory, NUM_ENVS, backend=backend)
    ref = DummyVecEnv(sync_factories(factory, NUM_ENVS))
    rng = np.random.default_rng(1)
    try:
        venv.seed(4)
        ref.seed(4)
        assert_obs_equal(venv.reset(), ref.reset())
        space = ref.action_space
        space.seed(2)
        for t in range(20):
            actions = [space.sample() for _ in range(NUM_ENVS)]
            if t % 3 == 1:  # a float64 Box leaf, as a float64 policy would give
                for e, a in enumerate(actions):
                    move = rng.uniform(-1.0, 1.0, 2)
                    actions[e] = {**a, "move": move} if kind == "dict" else (move, a[1])
            if t % 2:
                venv.step_async(deepcopy(actions))
                obs, rewards, dones, infos = venv.step_wait()
            else:
                obs, rewards, dones, infos = venv.step(deepcopy(actions))
            w_obs, w_rewards, w_dones, w_infos = ref.step(deepcopy(actions))
            assert_obs_equal(obs, w_obs)
            np.testing.assert_array_equal(rewards, w_rewards)
            assert dones.tolist() == w_dones.tolist()
            assert_info_equal(infos, w_infos, f"infos at step {t}")
    finally:
        venv.close()
        ref.close()


def test_per_env_actions_are_checked_before_anything_is_sent():
    venv = SB3VecEnv(functools.partial(ActionDtypeEnv, "dict"), NUM_ENVS, backend="processes")
    try:
        venv.reset()
        sample = venv.action_space.sample
        with pytest.raises(envfleet.InvalidActionError, match="one action per env"):
            venv.step([sample() for _ in range(NUM_ENVS - 1)])
        with pytest.raises(envfleet.InvalidActionError, match="keys"):
            venv.step([sample() for _ in range(NUM_ENVS - 1)] + [{"move": np.zeros(2)}])
        with pytest.raises(envfleet.InvalidActionError, match="shape"):
            venv.step([{"move": np.zeros(3), "pick": 0} for _ in range(NUM_ENVS)])
        obs, _, _, _ = venv.step([sample() for _ in range(NUM_ENVS)])  # usable, as before
        assert obs.shape == (NUM_ENVS, 3)
    finally:
        venv.close()


def test_start_method_as_subproc_vec_env_takes_it():
    """SB3's test_subproc_start_method: ``SubprocVecEnv(env_fns, start_method=...)``, also
    positionally; an unknown method raises multiprocessing's own ValueError."""
    fns = [functools.partial(make_indexed, i) for i in range(2)]
    for venv in (SB3VecEnv(fns, start_method="spawn"), SB3VecEnv(fns, "forkserver")):
        try:
            assert venv.get_attr("env_index") == [0, 1]
            assert venv.reset().shape[0] == 2
        finally:
            venv.close()
    with pytest.raises(ValueError, match=r"cannot find context for 'illegal_method'"):
        SB3VecEnv(fns, start_method="illegal_method")
    with pytest.raises(ValueError, match=r"cannot find context for 'illegal_method'"):
        envfleet.make(fns, backend=envfleet.Processes(context="illegal_method"))
    with pytest.raises(envfleet.ConfigError, match="same argument"):
        SB3VecEnv(fns, start_method="spawn", backend=envfleet.Processes(context="fork"))
