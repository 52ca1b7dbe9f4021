"""TorchRL over envfleet: FleetTorchRLEnv (an EnvBase) against gymnasium, TorchRL's own checks,
its collector and PPO loss, and the output="torch" layout."""

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

from torchrl.data import Bounded, Categorical, Composite, OneHot, Unbounded  # noqa: E402
from torchrl.envs import GymWrapper  # noqa: E402
from torchrl.envs.utils import check_env_specs  # noqa: E402

from envfleet.adapters.torchrl import (  # noqa: E402
    FleetTorchRLEnv,
    make_torchrl_env,
    space_to_spec,
    to_torchrl,
)

NUM_ENVS = 4
# CartPole with random actions ends (and restarts) several episodes within 80 steps; Pendulum
# truncates every episode at its time limit, so its rollout runs past one.
STEPS = {"CartPole-v1": 80, "Pendulum-v1": 210}


def actions_for(env_id: str, steps: int, seed: int = 0) -> np.ndarray:
    """Seeded actions as gymnasium takes them: CartPole indices, Pendulum float32 torques."""
    rng = np.random.default_rng(seed)
    if env_id == "CartPole-v1":
        return rng.integers(0, 2, size=(steps, NUM_ENVS))
    return rng.uniform(-2.0, 2.0, size=(steps, NUM_ENVS, 1)).astype(np.float32)


def replay(actions: np.ndarray, encode):
    """A TorchRL policy that plays ``actions`` step by step (``encode``: numpy -> tensor)."""
    step = iter(range(len(actions)))

    def policy(td):
        td["action"] = encode(actions[next(step)])
        return td

    return policy


def one_hot(a: np.ndarray):
    return torch.nn.functional.one_hot(torch.as_tensor(a), 2)


def encoder(env_id: str):
    return one_hot if env_id == "CartPole-v1" else torch.as_tensor


def fleet_env(env_id: str, backend: str = "processes", **kwargs) -> FleetTorchRLEnv:
    if backend == "processes":
        backend = envfleet.Processes(context="fork")
    return make_torchrl_env(env_id, NUM_ENVS, backend=backend, **kwargs)


def gym_vector(env_id: str) -> SyncVectorEnv:
    return SyncVectorEnv(
        [lambda: gym.make(env_id)] * NUM_ENVS, autoreset_mode=AutoresetMode.DISABLED
    )


@pytest.mark.parametrize("env_id", ["CartPole-v1", "Pendulum-v1"])
def test_check_env_specs_and_spec_layout(env_id):
    env = fleet_env(env_id)
    try:
        check_env_specs(env)  # TorchRL's own check: a rollout's keys, shapes and dtypes
        assert env.batch_size == torch.Size([NUM_ENVS])
        obs = env.observation_spec["observation"]
        assert isinstance(obs, Bounded)  # CartPole: some bounds finite, so not Unbounded
        assert obs.shape == (NUM_ENVS, 4 if env_id == "CartPole-v1" else 3)
        assert obs.dtype == torch.float32
        if env_id == "CartPole-v1":
            assert isinstance(env.action_spec, OneHot) and env.action_spec.shape == (NUM_ENVS, 2)
        else:
            assert isinstance(env.action_spec, Bounded) and env.action_spec.shape == (NUM_ENVS, 1)
            assert env.action_spec.space.high.max().item() == 2.0
        assert env.reward_spec.shape == (NUM_ENVS, 1)
        assert env.reward_spec.dtype == torch.float32
        assert set(env.done_spec.keys()) == {"done", "terminated", "truncated"}
        for spec in env.done_spec.values():
            assert spec.shape == (NUM_ENVS, 1) and spec.dtype == torch.bool
    finally:
        env.close()
    assert env.is_closed and env.venv.closed


@pytest.mark.parametrize("env_id", ["CartPole-v1", "Pendulum-v1"])
def test_rollout_bit_identical_to_gymnasium(env_id):
    """Every value of a rollout is gymnasium's SyncVectorEnv's for the same seeds and actions,
    finished envs reset through reset_mask (TorchRL's '_reset' masks)."""
    steps = STEPS[env_id]
    actions = actions_for(env_id, steps)
    env = fleet_env(env_id)
    try:
        env.set_seed(0)
        td = env.rollout(steps, replay(actions, encoder(env_id)), break_when_any_done=False)
    finally:
        env.close()
    assert td.batch_size == torch.Size([NUM_ENVS, steps])
    assert td["next", "done"].any()  # episodes ended and the rollout reset those envs

    # set_seed(0) resets with seed 0 (GymWrapper's convention), the rollout resets again.
    ref = gym_vector(env_id)
    try:
        ref.reset(seed=0)
        obs, _ = ref.reset()
        for t in range(steps):
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


def test_rollout_equals_torchrl_gymwrapper_over_gymnasium():
    """TorchRL's own GymWrapper over gymnasium's SyncVectorEnv gives the very same TensorDict."""
    actions = actions_for("CartPole-v1", STEPS["CartPole-v1"])
    results = []
    for env in (fleet_env("CartPole-v1", backend="serial"), GymWrapper(gym_vector("CartPole-v1"))):
        try:
            env.set_seed(3)
            results.append(
                env.rollout(len(actions), replay(actions, one_hot), break_when_any_done=False)
            )
        finally:
            env.close()
    assert results[0]["next", "done"].any()
    assert set(results[0].keys(True)) == set(results[1].keys(True))
    assert (results[0] == results[1]).all()


@pytest.mark.parametrize("env_id", ["CartPole-v1", "Pendulum-v1"])
def test_partial_reset_resets_only_the_masked_envs(env_id):
    actions = actions_for(env_id, 12, seed=5)
    encode = encoder(env_id)
    mask = np.array([True, False, False, True])
    env = fleet_env(env_id)
    ref = gym_vector(env_id)
    try:
        td = env.reset(seed=7)
        want, _ = ref.reset(seed=7)
        np.testing.assert_array_equal(td["observation"].numpy(), want)
        for t in range(6):
            td["action"] = encode(actions[t])
            td = env.step(td)["next"].clone()
            want = ref.step(actions[t])[0]
        before = td["observation"].clone()
        td["_reset"] = torch.as_tensor(mask).unsqueeze(-1)
        td = env.reset(td)
        want, _ = ref.reset(options={"reset_mask": mask})
        np.testing.assert_array_equal(td["observation"].numpy(), want)
        assert not td["done"].any()
        # The envs outside the mask kept their state; the masked ones were reset.
        assert torch.equal(td["observation"][~mask], before[~mask])
        assert not torch.equal(td["observation"][mask], before[mask])
        td["_reset"] = torch.zeros(NUM_ENVS, 1, dtype=torch.bool)
        kept = td["observation"].clone()
        td = env.reset(td)  # an empty mask resets nothing
        assert torch.equal(td["observation"], kept)
        for t in range(6, 12):  # and every env goes on as gymnasium's
            td["action"] = encode(actions[t])
            nxt = env.step(td)["next"]
            want = ref.step(actions[t])[0]
            np.testing.assert_array_equal(nxt["observation"].numpy(), want)
            td = nxt.clone()
    finally:
        env.close()
        ref.close()


def test_sync_collector_with_clip_ppo_loss():
    """TorchRL's SyncDataCollector and ClipPPOLoss (with GAE) train on it for 3 iterations."""
    from tensordict.nn import TensorDictModule

    try:
        from torchrl.collectors import SyncDataCollector
    except ImportError:  # torchrl >= 0.14 names its direct (in-process) collector Collector
        from torchrl.collectors import Collector as SyncDataCollector
    from torchrl.modules import OneHotCategorical, ProbabilisticActor, ValueOperator
    from torchrl.objectives import ClipPPOLoss
    from torchrl.objectives.value import GAE

    torch.manual_seed(0)
    env = fleet_env("CartPole-v1")
    actor = ProbabilisticActor(
        TensorDictModule(
            torch.nn.Sequential(torch.nn.Linear(4, 32), torch.nn.Tanh(), torch.nn.Linear(32, 2)),
            in_keys=["observation"],
            out_keys=["logits"],
        ),
        in_keys=["logits"],
        spec=env.action_spec,
        distribution_class=OneHotCategorical,
        return_log_prob=True,
    )
    critic = ValueOperator(
        torch.nn.Sequential(torch.nn.Linear(4, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1)),
        in_keys=["observation"],
    )
    loss_fn = ClipPPOLoss(actor, critic)
    advantage = GAE(gamma=0.99, lmbda=0.95, value_network=critic, average_gae=True)
    optim = torch.optim.Adam(loss_fn.parameters(), lr=1e-2)
    start = [p.detach().clone() for p in loss_fn.parameters()]
    collector = SyncDataCollector(env, actor, frames_per_batch=128, total_frames=3 * 128)
    iterations = 0
    try:
        for batch in collector:
            assert batch.batch_size == torch.Size([NUM_ENVS, 128 // NUM_ENVS])
            with torch.no_grad():
                advantage(batch)
            losses = loss_fn(batch.reshape(-1))
            total = losses["loss_objective"] + losses["loss_critic"] + losses["loss_entropy"]
            assert torch.isfinite(total)
            optim.zero_grad()
            total.backward()
            optim.step()
            iterations += 1
    finally:
        collector.shutdown()
        env.close()
    assert iterations == 3
    assert all(not torch.equal(p, q) for p, q in zip(loss_fn.parameters(), start, strict=True))


def test_output_torch_tensordicts_have_the_envbase_layout(make_env):
    """output="torch"'s reset_tensordict/step_tensordict are this env's root and "next"
    entries: same keys, shapes and values (the EnvBase rounds rewards to float32)."""
    tenvs = make_env("CartPole-v1", NUM_ENVS, backend="serial", output="torch")
    env = fleet_env("CartPole-v1", backend="serial")
    actions = actions_for("CartPole-v1", 30, seed=2)
    try:
        root = env.reset(seed=1)
        want = tenvs.reset_tensordict(seed=1)
        assert set(root.keys(True)) == set(want.keys(True))
        assert (root == want).all()
        for t in range(30):
            root["action"] = one_hot(actions[t])
            nxt = env.step(root)["next"]
            want = tenvs.step_tensordict(torch.as_tensor(actions[t]))
            assert set(nxt.keys(True)) == set(want.keys(True))
            for key in want.keys(True, True):
                assert nxt[key].shape == want[key].shape
            assert want["reward"].dtype == torch.float64 and nxt["reward"].dtype == torch.float32
            assert torch.equal(nxt["reward"], want["reward"].float())
            assert (nxt.exclude("reward") == want.exclude("reward")).all()
            root = env.reset(nxt.clone().set("_reset", nxt["done"])) if nxt["done"].any() else nxt
            if want["done"].any():
                tenvs.reset(options={"reset_mask": want["done"][:, 0].numpy()})
    finally:
        env.close()


def test_space_to_spec_follows_torchrl_conventions():
    box = space_to_spec(gym.spaces.Box(-np.inf, np.inf, (3,), np.float64))
    assert isinstance(box, Unbounded) and box.dtype == torch.float64 and box.shape == (3,)
    action = space_to_spec(gym.spaces.Discrete(3), action=True)
    assert isinstance(action, OneHot) and action.shape == (3,) and action.dtype == torch.long
    index = space_to_spec(gym.spaces.Discrete(3), action=True, categorical_action_encoding=True)
    assert isinstance(index, Categorical) and index.shape == ()
    nested = space_to_spec(
        gym.spaces.Dict(
            pos=gym.spaces.Box(0.0, 1.0, (2,), np.float32),
            pair=gym.spaces.Tuple((gym.spaces.Discrete(4), gym.spaces.MultiBinary(2))),
        )
    )
    assert isinstance(nested, Composite)
    assert set(nested.keys(True, True)) == {"pos", ("pair", "0"), ("pair", "1")}
    assert isinstance(nested["pair", "0"], Categorical)
    with pytest.raises(envfleet.ConfigError, match="start at 0"):
        space_to_spec(gym.spaces.Discrete(3, start=1), action=True)
    with pytest.raises(envfleet.ConfigError, match="no TorchRL spec"):
        space_to_spec(gym.spaces.Dict(a=gym.spaces.Discrete(2)), action=True)
    with pytest.raises(envfleet.ConfigError, match="no TorchRL spec"):
        space_to_spec(gym.spaces.Text(5))


def test_torchrl_gymwrapper_still_wraps_a_same_step_fleet_env():
    """TorchRL's own GymWrapper also accepts an envfleet vector env (SAME_STEP, copy=True)."""
    fleet = envfleet.make(
        "CartPole-v1",
        NUM_ENVS,
        backend=envfleet.Processes(context="fork"),
        autoreset_mode=AutoresetMode.SAME_STEP,
    )
    gym_env = SyncVectorEnv(
        [lambda: gym.make("CartPole-v1")] * NUM_ENVS, autoreset_mode=AutoresetMode.SAME_STEP
    )
    actions = actions_for("CartPole-v1", STEPS["CartPole-v1"], seed=1)
    results = []
    for e in (GymWrapper(fleet), GymWrapper(gym_env)):
        try:
            e.set_seed(3)
            results.append(
                e.rollout(len(actions), replay(actions, one_hot), break_when_any_done=False)
            )
        finally:
            e.close()
    assert results[0]["next", "done"].any()
    assert (results[0] == results[1]).all()


def test_refusals(make_env):
    with pytest.raises(envfleet.ConfigError, match="DISABLED"):
        to_torchrl(make_env("CartPole-v1", 2, backend="serial"))  # NEXT_STEP
    same_step = make_env("CartPole-v1", 2, backend="serial", autoreset_mode=AutoresetMode.SAME_STEP)
    with pytest.raises(envfleet.ConfigError, match="DISABLED"):
        to_torchrl(same_step)
    with pytest.raises(envfleet.ConfigError, match="autoreset_mode"):
        make_torchrl_env("CartPole-v1", 2, autoreset_mode=AutoresetMode.SAME_STEP)
    with pytest.raises(envfleet.ConfigError, match="batch_size"):
        make_torchrl_env("CartPole-v1", 4, batch_size=2)


def test_wraps_gymnasium_vector_envs_and_a_copying_fleet_env(make_env):
    """Any DISABLED vector env works, and copy=True fleet envs give the same rollout."""
    actions = actions_for("CartPole-v1", 40, seed=4)
    envs = [
        to_torchrl(gym_vector("CartPole-v1")),
        to_torchrl(
            make_env(
                "CartPole-v1",
                NUM_ENVS,
                backend=envfleet.Processes(context="fork"),
                copy=True,
                autoreset_mode=AutoresetMode.DISABLED,
            )
        ),
    ]
    results = []
    for env in envs:
        try:
            env.set_seed(9)
            results.append(env.rollout(40, replay(actions, one_hot), break_when_any_done=False))
        finally:
            env.close()
    assert (results[0] == results[1]).all()
