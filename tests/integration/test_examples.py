"""The examples: ``examples/ppo.py`` (the PPO the examples and ``benchmarks/train.py`` share:
GAE, the update), ``examples/ppo_cartpole.py`` (PPO with the Sampler, driver inference),
``examples/ppo_atari.py`` (PPO on Atari, over the Sampler or gymnasium's AsyncVectorEnv) and
``examples/gpu_policy.py`` (a torch policy on CUDA when there is a GPU, else on the CPU)."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from envfleet import EpisodeBatch  # noqa: E402

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"envfleet_examples_{name}", EXAMPLES / name)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def cartpole() -> ModuleType:
    return _load("ppo_cartpole.py")


@pytest.fixture(scope="module")
def ppo(cartpole) -> ModuleType:
    """examples/ppo.py, the module the examples import."""
    return cartpole.ppo


# -- examples/ppo.py -------------------------------------------------------------------------


def test_gae_by_hand(ppo):
    # Two steps of one column, the episode ending at the second: 1 + 0.5 * 1 and 1.
    out = ppo.gae(np.ones((2, 1)), np.zeros((2, 1)), np.zeros((2, 1)), np.array([[1.0], [0.0]]),
                  0.5, 1.0)  # fmt: skip
    np.testing.assert_array_equal(out, [[1.5], [1.0]])


def test_segments_and_the_rollout_layout_give_the_same_advantages(ppo):
    """A [T, N] rollout with episode ends, cut into segments (as the Sampler returns it):
    segment_gae gives the same advantages as gae over the rollout."""
    rng = np.random.default_rng(0)
    t_steps, n = 12, 3
    rewards = rng.normal(size=(t_steps, n))
    values = rng.normal(size=(t_steps, n)).astype(np.float32)  # as a policy records them
    last_values = rng.normal(size=n)
    terminated = rng.random((t_steps, n)) < 0.15
    truncated = ~terminated & (rng.random((t_steps, n)) < 0.1)
    final_values = rng.normal(size=(t_steps, n))
    next_values = np.concatenate([values[1:], last_values[None]])
    next_values = np.where(truncated, final_values, next_values)
    next_values[terminated] = 0.0
    expected = ppo.gae(rewards, values, next_values, ~(terminated | truncated), 0.99, 0.95)

    order, ends, lengths, env_index = [], [], [], []
    for env in range(n):
        begin = 0
        for t in range(t_steps):
            if terminated[t, env] or truncated[t, env] or t == t_steps - 1:
                order += [(r, env) for r in range(begin, t + 1)]
                ends.append(next_values[t, env])
                lengths.append(t + 1 - begin)
                env_index.append(env)
                begin = t + 1
    rows, cols = np.array(order).T
    batch = EpisodeBatch(
        observations=np.zeros((len(order), 1), np.float32),
        actions=np.zeros(len(order), np.int64),
        rewards=rewards[rows, cols],
        terminated=terminated[rows, cols],
        truncated=truncated[rows, cols],
        last_observations=np.zeros((len(lengths), 1), np.float32),
        env_index=np.array(env_index),
        policy_version=np.zeros(len(lengths), np.int64),
        lengths=np.array(lengths),
        agent_infos={"value": values[rows, cols]},
    )
    advantages, returns = ppo.segment_gae(batch, np.array(ends), 0.99, 0.95)
    np.testing.assert_allclose(advantages, expected[rows, cols], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(returns, expected[rows, cols] + values[rows, cols], rtol=1e-6)


def _transitions(n: int, seed: int) -> tuple[np.ndarray, ...]:
    """``n`` made-up CartPole transitions: observations, actions, advantages, returns."""
    rng = np.random.default_rng(seed)
    obs = rng.normal(size=(n, 4)).astype(np.float32)
    actions = rng.integers(0, 2, n)
    return obs, actions, *rng.normal(size=(2, n)).astype(np.float32)


def test_stale_steps_take_decoupled_ppo_and_current_ones_plain_ppo(ppo):
    """A prefetched batch's steps were chosen by the policy before the last update: they take
    decoupled PPO's objective (clipped around the policy before this update, weighted by its
    ratio to the one that chose them, truncated at 1). With no stale step, or stale steps whose
    weights are 1, it is plain PPO, bit for bit; weights below 1 change the update."""
    from torch.distributions import Categorical

    config = ppo.PPOConfig(128, 256, 10, 1e-3, True, 0.99, 0.95)
    n = 256
    obs, actions, advantages, returns = _transitions(n, seed=0)

    def update(stale: np.ndarray | None, behaviour_shift: float = 0.0) -> str:
        agent = ppo.Agent((4,), 2, "mlp", seed=3)
        learner = ppo.PPO(agent, config, seed=3)
        with torch.no_grad():
            logits, _ = agent(agent.prepare(obs))
            logp = Categorical(logits=logits, validate_args=False).log_prob(
                torch.as_tensor(actions)
            )
        behaviour = logp.numpy() - behaviour_shift
        learner.update(obs, actions, behaviour, advantages, returns, 3e-4, stale)
        return learner.digest()

    plain = update(None)
    assert update(np.zeros(n, dtype=np.bool_)) == plain
    assert update(np.ones(n, dtype=np.bool_)) == plain
    stale = np.ones(n, dtype=np.bool_)
    # A behaviour policy likelier than the proximal one: weights below 1, another update.
    assert update(stale, -0.3) not in (plain, update(None, -0.3))
    # One less likely: weights above 1, truncated to 1 (V-trace's rho), as if current.
    assert update(stale, 0.3) == plain


def test_the_clipped_value_loss_holds_back_values_moved_past_the_clip(ppo):
    """``clip_value`` (CleanRL's ``clip_vloss``): with the recorded values the agent's own,
    one gradient step is the unclipped one; with recorded values far off (5 > clip), the
    value's error is the clipped one, whose gradient is 0, and the update differs."""
    n = 64
    obs, actions, advantages, returns = _transitions(n, seed=1)

    def update(clip_value: bool, shift: float) -> np.ndarray:
        config = ppo.PPOConfig(16, n, 1, 1e-3, False, 0.99, 0.95, clip_value=clip_value)
        agent = ppo.Agent((4,), 2, "mlp", seed=3)
        learner = ppo.PPO(agent, config, seed=3)
        _, infos = ppo.Policy(agent, seed=3)(obs)
        values = infos["value"] + shift
        learner.update(obs, actions, infos["logp"], advantages, returns, 1e-3, None, values)
        return torch.cat([p.detach().flatten() for p in agent.parameters()]).numpy()

    np.testing.assert_allclose(update(True, 0.0), update(False, 0.0), rtol=0, atol=1e-6)
    moved = np.abs(update(True, 5.0) - update(False, 5.0)).max()
    assert moved > 1e-4  # Adam's first step moves a weight by about lr = 1e-3


def test_segment_gae_bootstraps_per_segment(ppo):
    """Terminated: no bootstrap; truncated and cut segments: the value of last_observations;
    the recursion never crosses a segment boundary (next env, next episode)."""
    # segments: env 0 terminated (3 steps), env 0 cut by the sample (2), env 1 truncated (2),
    # env 2 cut (1)
    lengths = np.array([3, 2, 2, 1])
    rewards = np.array([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0])
    terminated = np.zeros(8, dtype=bool)
    truncated = np.zeros(8, dtype=bool)
    terminated[2] = True
    truncated[6] = True
    values = np.array([0.5, -1.0, 2.0, 0.25, 1.5, -0.5, 3.0, 1.0], dtype=np.float32)
    batch = EpisodeBatch(
        observations=np.zeros((8, 4), np.float32),
        actions=np.zeros(8, np.int64),
        rewards=rewards,
        terminated=terminated,
        truncated=truncated,
        last_observations=np.zeros((4, 4), np.float32),
        env_index=np.array([0, 0, 1, 2]),
        policy_version=np.zeros(4, np.int64),
        lengths=lengths,
        agent_infos={"value": values},
    )
    last_values = np.array([100.0, 10.0, 20.0, 30.0])  # segment 0's must be ignored
    gamma, lam = 0.9, 0.8
    advantages, returns = ppo.segment_gae(batch, last_values, gamma, lam)

    expected = []
    for s, (start, n) in enumerate(zip(batch.starts, lengths, strict=True)):
        ended = terminated[start + n - 1]
        v = list(values[start : start + n].astype(np.float64))
        following = v[1:] + [0.0 if ended else last_values[s]]
        deltas = [rewards[start + t] + gamma * following[t] - v[t] for t in range(n)]
        for t in range(n):  # A_t = sum_k (gamma lam)^k delta_{t+k}, within the segment
            expected.append(sum((gamma * lam) ** k * deltas[t + k] for k in range(n - t)))
    np.testing.assert_allclose(advantages, expected, rtol=1e-6)
    np.testing.assert_allclose(returns, np.array(expected) + values, rtol=1e-6)

    # lambda = 1: returns are the discounted rewards plus the discounted bootstrap
    _, returns = ppo.segment_gae(batch, last_values, gamma, 1.0)
    np.testing.assert_allclose(returns[:3], [1 + 0.9 * 2 + 0.81 * 3, 2 + 0.9 * 3, 3], rtol=1e-6)
    np.testing.assert_allclose(returns[3:5], [4 + 0.9 * 5 + 0.81 * 10, 5 + 0.9 * 10], rtol=1e-6)
    np.testing.assert_allclose(returns[5:7], [6 + 0.9 * 7 + 0.81 * 20, 7 + 0.9 * 20], rtol=1e-6)
    np.testing.assert_allclose(returns[7:], [8 + 0.9 * 30], rtol=1e-6)


@pytest.mark.parametrize("criterion", ["eval", "train"])
def test_ppo_cartpole_runs(cartpole, criterion):
    """A few updates on a tiny budget (an unreachable target; eval from the first update):
    the whole code path runs, stops at the budget, and is reproducible. About 2-4 s."""
    argv = [
        *("--num-envs", "4", "--steps-per-update", "64", "--total-steps", "1024"),
        *("--epochs", "2", "--target", "1e9", "--eval-gate", "0", "--eval-episodes", "3"),
        *("--criterion", criterion, "--seed", "3", "--quiet"),
    ]
    result = cartpole.main(argv)
    assert result["reached"] is False
    assert result["steps"] == 1024
    assert result["updates"] == 4
    assert result["episodes"] > 0 and result["train_return"] > 0
    assert (criterion == "eval") == (not math.isnan(result["eval_return"]))
    again = cartpole.main(argv)
    for key in ("steps", "episodes", "train_return", "eval_return"):
        assert again[key] == result[key] or (math.isnan(again[key]) and math.isnan(result[key])), (
            key
        )


def test_ppo_cartpole_learns_from_steps_collected_during_the_update(cartpole):
    """``--prefetch``: the same budget, every update after the first learning from the batch
    collected during the one before (one version behind): it runs, and reproducibly."""
    argv = [
        *("--num-envs", "4", "--steps-per-update", "64", "--total-steps", "1024"),
        *("--epochs", "2", "--target", "1e9", "--seed", "3", "--quiet", "--prefetch"),
    ]
    result = cartpole.main(argv)
    assert (result["steps"], result["updates"]) == (1024, 4)
    assert result["episodes"] > 0
    assert cartpole.main(argv)["train_return"] == result["train_return"]


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("criterion", ["eval", "train"])
def test_ppo_cartpole_reaches_the_target(cartpole, criterion):
    """PPO with the default settings (seed 1) reaches CartPole-v1's threshold, 475.

    ``eval``: the greedy policy's mean return over 10 seeded episodes; about 24k env steps,
    2-5 s of training on the 2-core development machine (20 s when it was loaded).
    ``train``: the mean of the last 20 complete training episodes; about 40k steps, 5-15 s
    (40 s loaded)."""
    result = cartpole.main(["--criterion", criterion, "--quiet"])
    assert result["reached"], result
    if criterion == "eval":
        assert result["eval_return"] >= 475
    else:
        assert result["train_return"] >= 475


# -- examples/ppo_atari.py -------------------------------------------------------------------


@pytest.fixture(scope="module")
def ppo_atari() -> Iterator[ModuleType]:
    pytest.importorskip("ale_py")
    pytest.importorskip("cv2")  # gymnasium's AtariPreprocessing resizes with OpenCV
    module = _load("ppo_atari.py")
    # The example's env factory must reach worker processes, which cannot import a module
    # loaded from a file path: pickle it by value, as cloudpickle does for a script's __main__.
    cloudpickle = pytest.importorskip("cloudpickle")
    cloudpickle.register_pickle_by_value(module)
    yield module
    cloudpickle.unregister_pickle_by_value(module)


@pytest.mark.atari
def test_plain_rollout_batch_cuts_segments_where_episodes_end(ppo_atari):
    """The gym-async loop's [steps, n] rollout as segments: env 0 terminates at step 1 and is
    truncated at the last step (two complete segments, their final observations); env 1 runs
    on (one segment cut by the end, the observation after the last step)."""
    steps, n = 5, 2
    obs = np.arange(steps * n, dtype=np.uint8).reshape(steps, n, 1)
    terminated = np.zeros((steps, n), dtype=bool)
    truncated = np.zeros((steps, n), dtype=bool)
    terminated[1, 0] = truncated[4, 0] = True
    columns = {
        "actions": np.arange(steps * n).reshape(steps, n) + 100,
        "rewards": np.arange(steps * n, dtype=np.float64).reshape(steps, n) / 2,
        "terminated": terminated,
        "truncated": truncated,
        "logp": -np.arange(steps * n, dtype=np.float32).reshape(steps, n),
        "value": np.arange(steps * n, dtype=np.float32).reshape(steps, n) * 3,
    }
    final = {(1, 0): np.array([201], np.uint8), (4, 0): np.array([204], np.uint8)}
    next_obs = np.array([[210], [211]], np.uint8)
    batch = ppo_atari.plain_rollout_batch(obs, columns, final, next_obs)

    rows = [0, 2, 4, 6, 8, 1, 3, 5, 7, 9]  # env 0's steps 0..4, then env 1's (t * n + env)
    assert batch.lengths.tolist() == [2, 3, 5]
    assert batch.env_index.tolist() == [0, 0, 1]
    assert batch.complete.tolist() == [True, True, False]
    assert batch.observations[:, 0].tolist() == rows
    assert batch.actions.tolist() == [r + 100 for r in rows]
    np.testing.assert_array_equal(batch.rewards, np.array(rows) / 2)
    np.testing.assert_array_equal(batch.agent_infos["logp"], -np.array(rows, np.float32))
    np.testing.assert_array_equal(batch.agent_infos["value"], np.array(rows, np.float32) * 3)
    assert np.flatnonzero(batch.terminated).tolist() == [1]
    assert np.flatnonzero(batch.truncated).tolist() == [4]
    assert batch.last_observations[:, 0].tolist() == [201, 204, 211]


@pytest.mark.atari
def test_plain_rollout_batch_leaves_envpools_reset_steps_out(ppo_atari):
    """EnvPool's rollout: env 0 terminates at step 1, step 2 is its reset (not a transition,
    left out), and a new episode runs from step 3 to the end; env 1 runs on. The segments
    hold the transitions only, the first episode's final observation is its last step's."""
    steps, n = 5, 2
    obs = np.arange(steps * n, dtype=np.uint8).reshape(steps, n, 1)
    terminated = np.zeros((steps, n), dtype=bool)
    terminated[1, 0] = True
    valid = np.ones((steps, n), dtype=bool)
    valid[2, 0] = False
    zeros = np.zeros((steps, n), dtype=np.float32)
    columns = {
        "actions": np.arange(steps * n).reshape(steps, n),
        "rewards": np.arange(steps * n, dtype=np.float64).reshape(steps, n),
        "terminated": terminated,
        "truncated": np.zeros((steps, n), dtype=bool),
        "logp": zeros,
        "value": zeros,
    }
    final = {(1, 0): np.array([201], np.uint8)}
    next_obs = np.array([[210], [211]], np.uint8)
    batch = ppo_atari.plain_rollout_batch(obs, columns, final, next_obs, valid)
    assert batch.lengths.tolist() == [2, 2, 5]
    assert batch.env_index.tolist() == [0, 0, 1]
    assert batch.observations[:, 0].tolist() == [0, 2, 6, 8, 1, 3, 5, 7, 9]  # not row 4
    assert batch.last_observations[:, 0].tolist() == [201, 210, 211]
    assert np.flatnonzero(batch.terminated).tolist() == [1]


ATARI_SMOKE = [
    *("--num-envs", "2", "--num-steps", "16", "--total-steps", "64"),
    *("--seed", "5", "--log-every", "0"),
]


@pytest.mark.atari
def test_ppo_atari_prefetch_smoke(ppo_atari):
    """``--prefetch``: the second update learns from the batch collected during the first."""
    result = ppo_atari.main([*ATARI_SMOKE, "--vector", "envfleet", "--prefetch"])
    assert (result["steps"], result["updates"]) == (64, 2)
    assert all(math.isfinite(x) for x in result["losses"])


@pytest.mark.atari
@pytest.mark.parametrize("vector", ["envfleet", "gym-async", "envpool"])
def test_ppo_atari_smoke(ppo_atari, vector):
    """Pong, 2 envs x 16 steps per update, 2 updates, on either vector env (the Sampler with
    its default inference mode; EnvPool's own Atari): the steps asked for are sampled, every
    loss is finite, and the update changed the model. A few seconds."""
    if vector == "envpool":
        pytest.importorskip("envpool")
    result = ppo_atari.main([*ATARI_SMOKE, "--vector", vector])
    assert result["vector"] == vector
    assert result["steps"] == 64
    assert result["updates"] == 2
    assert len(result["losses"]) == 2 and all(math.isfinite(x) for x in result["losses"])
    initial = ppo_atari.ppo.Agent((4, 84, 84), result["model"].actor.out_features, "cnn", seed=5)
    trained = dict(result["model"].named_parameters())
    changed = [
        name
        for name, before in initial.named_parameters()
        if not torch.equal(before, trained[name])
    ]
    assert set(changed) == set(trained), set(trained) - set(changed)


@pytest.mark.atari
def test_ppo_atari_same_ppo_on_both_vector_envs(ppo_atari):
    """With the Sampler's driver inference (the policy on all envs' observations each step,
    as the plain loop calls it) and the same seeds, both vector envs give the same rollouts,
    hence the same losses and the same trained weights: the comparison is of the vector envs
    alone. (16 steps: no Pong episode ends, so the segments come in the same order.)"""
    fleet = ppo_atari.main([*ATARI_SMOKE, "--vector", "envfleet", "--inference", "driver"])
    plain = ppo_atari.main([*ATARI_SMOKE, "--vector", "gym-async"])
    assert fleet["losses"] == plain["losses"]
    weights = dict(plain["model"].named_parameters())
    for name, value in fleet["model"].named_parameters():
        assert torch.equal(value, weights[name]), name


def test_gpu_policy_runs_on_the_cpu_and_picks_cuda_when_there_is_one():
    """The quickstart's GPU example runs where there is no GPU (CPU here), on the default
    processes backend, and counts the episodes that its vector RecordEpisodeStatistics saw;
    ``"auto"`` picks CUDA exactly when torch sees a GPU."""
    example = _load("gpu_policy.py")
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert example.pick_device("auto").type == expected
    result = example.run("CartPole-v1", num_envs=4, steps=200, device="cpu", num_workers=2)
    assert result["device"] == "cpu"
    assert result["steps_per_s"] > 0
    assert result["episodes"] > 0 and result["mean_return"] > 0


def test_ppo_cartpole_survives_a_sigterm_bit_for_bit(tmp_path):
    """Preemption, as a scheduler does it: a real SIGTERM to a training process once its 3rd
    update is logged. It saves at the end of the update in progress and exits 0; a second
    process resumes from the checkpoint, and every update's weights digest and training
    return equal the uninterrupted run's (12 updates, processes backend, the defaults)."""
    argv = [
        *("--num-envs", "4", "--steps-per-update", "64", "--total-steps", str(12 * 4 * 64)),
        *("--epochs", "2", "--target", "1e9", "--seed", "5", "--backend", "processes"),
    ]
    script = [sys.executable, str(EXAMPLES / "ppo_cartpole.py"), *argv, "--quiet"]
    env = {**os.environ, "PYTHONPATH": str(EXAMPLES.parent / "src")}
    whole = tmp_path / "whole.jsonl"
    subprocess.run([*script, "--trace", str(whole)], check=True, timeout=300, env=env)
    want = [json.loads(line) for line in whole.read_text().splitlines()]
    assert [r["update"] for r in want] == list(range(1, 13))

    trace, ckpt = tmp_path / "cut.jsonl", tmp_path / "run.ckpt"
    cut = [*script, "--trace", str(trace), "--checkpoint", str(ckpt)]
    proc = subprocess.Popen(cut, env=env)
    try:
        deadline = time.monotonic() + 240
        while not (trace.exists() and len(trace.read_text().splitlines()) >= 3):
            assert proc.poll() is None and time.monotonic() < deadline, "no 3rd update"
            time.sleep(0.05)  # polls the trace file; the signal goes once it has 3 lines
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 0
    finally:
        proc.kill()
    first = [json.loads(line) for line in trace.read_text().splitlines()]
    assert 3 <= len(first) < 12 and ckpt.exists()
    subprocess.run(
        [*cut, "--resume", str(ckpt)], check=True, timeout=300, env={**env, "PYTHONHASHSEED": "1"}
    )
    got = [json.loads(line) for line in trace.read_text().splitlines()]
    assert got == want
