"""Torch outputs (envfleet.torch): zero-copy tensors, copy semantics, TensorDicts, make()."""

from __future__ import annotations

import sys

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.vector import SyncVectorEnv

import envfleet
from tests.envs import NestedSpaceEnv, sync_factories

torch = pytest.importorskip("torch")
pytest.importorskip("tensordict")

from envfleet.torch import TorchVectorEnv  # noqa: E402

NUM_ENVS = 4
STEPS = 60  # CartPole with random actions: several episodes end within 60 steps


def cartpole_actions(steps: int = STEPS) -> np.ndarray:
    return np.random.default_rng(7).integers(0, 2, size=(steps, NUM_ENVS))


def reference_cartpole(actions: np.ndarray) -> list[tuple[np.ndarray, ...]]:
    """gymnasium's SyncVectorEnv on the same seeds and actions: (obs, reward, term, trunc)."""
    ref = SyncVectorEnv([lambda: gym.make("CartPole-v1")] * NUM_ENVS)
    obs, _ = ref.reset(seed=0)
    out = [(obs,)]
    for a in actions:
        obs, rew, term, trunc, _ = ref.step(a)
        out.append((obs, rew, term, trunc))
    ref.close()
    return out


def address(array: np.ndarray) -> int:
    return int(array.__array_interface__["data"][0])


def test_zero_copy_views_of_shared_memory(make_env):
    """copy=False on the CPU: tensors over envfleet's shared buffers, built once, never copied."""
    actions = cartpole_actions()
    want = reference_cartpole(actions)
    tenvs = make_env("CartPole-v1", NUM_ENVS, backend="processes", output="torch", copy=False)
    assert isinstance(tenvs, TorchVectorEnv) and isinstance(tenvs, gym.vector.VectorEnv)
    fleet = tenvs.unwrapped
    assert isinstance(fleet, envfleet.FleetVectorEnv) and fleet.copy is False
    # The vector env's own results are the shared buffers: the same arrays at every call.
    np_obs, _ = fleet.reset(seed=0)
    np_rew, np_term, np_trunc = fleet.step(actions[0])[1:4]

    obs, info = tenvs.reset(seed=0)
    assert obs.dtype == torch.float32 and obs.shape == (NUM_ENVS, 4)
    assert obs.data_ptr() == address(np_obs)
    np.testing.assert_array_equal(obs.numpy(), want[0][0])
    first = None
    for t, a in enumerate(actions):
        step_actions = torch.as_tensor(a) if t % 2 else a  # tensors and numpy both work
        got = tenvs.step(step_actions)
        o, r, te, tr, _ = got
        assert (o.dtype, r.dtype, te.dtype, tr.dtype) == (
            torch.float32,
            torch.float64,
            torch.bool,
            torch.bool,
        )
        assert o.data_ptr() == address(np_obs) and r.data_ptr() == address(np_rew)
        assert te.data_ptr() == address(np_term) and tr.data_ptr() == address(np_trunc)
        if first is None:
            first = got[:4]
        else:  # no copy per step: the very same tensor objects every step
            assert all(x is y for x, y in zip(got[:4], first, strict=True))
        for g, w in zip((o, r, te, tr), want[t + 1], strict=True):
            np.testing.assert_array_equal(g.numpy(), w)
    # A tensor kept from an earlier step shows the latest values: it is a view (valid until
    # the next call, as documented).
    assert first is not None
    np.testing.assert_array_equal(first[0].numpy(), want[-1][0])


def test_copy_true_tensors_stay_valid(make_env):
    """copy=True (the default): each step's tensors own their data."""
    actions = cartpole_actions(10)
    want = reference_cartpole(actions)
    tenvs = make_env("CartPole-v1", NUM_ENVS, backend="serial", output="torch")
    obs, _ = tenvs.reset(seed=0)
    kept = [obs]
    for a in actions:
        kept.append(tenvs.step(torch.as_tensor(a))[0])
    assert len({t.data_ptr() for t in kept}) == len(kept)
    for got, w in zip(kept, want, strict=True):
        np.testing.assert_array_equal(got.numpy(), w[0])


def test_wrapping_a_view_env_with_copy_true_clones(make_env):
    fleet = make_env("CartPole-v1", NUM_ENVS, backend="serial", copy=False)
    tenvs = TorchVectorEnv(fleet, copy=True)
    a, _ = tenvs.reset(seed=0)
    b = tenvs.step(np.zeros(NUM_ENVS, dtype=np.int64))[0]
    assert a.data_ptr() != b.data_ptr()
    assert not torch.equal(a, b)


def test_explicit_cpu_device_is_zero_copy(make_env):
    tenvs = make_env(
        "CartPole-v1",
        NUM_ENVS,
        backend="serial",
        output=envfleet.TorchOutput(device="cpu"),
    )
    assert tenvs.device == torch.device("cpu") and tenvs.copy is True
    obs, _ = tenvs.reset(seed=0)
    assert obs.device.type == "cpu"


def test_nested_spaces_dict_actions_and_tensordict(make_env):
    """Dict/Tuple observations as nested tensors and nested TensorDict keys; dict actions."""
    n = 3
    tenvs = make_env(NestedSpaceEnv, n, backend="processes", output="torch", copy=False)
    ref = SyncVectorEnv(sync_factories(NestedSpaceEnv, n))
    rng = np.random.default_rng(3)
    obs, _ = tenvs.reset(seed=5)
    want, _ = ref.reset(seed=5)
    assert isinstance(obs, dict) and isinstance(obs["tup"], tuple)
    np.testing.assert_array_equal(obs["box"].numpy(), want["box"])
    np.testing.assert_array_equal(obs["tup"][0].numpy(), want["tup"][0])
    for _ in range(25):
        move = rng.integers(0, 4, size=n)
        force = rng.uniform(-1, 1, size=(n, 2)).astype(np.float32)
        td = tenvs.step_tensordict({"move": torch.as_tensor(move), "force": torch.tensor(force)})
        w_obs, w_rew, w_term, w_trunc, _ = ref.step({"move": move, "force": force})
        assert td.batch_size == torch.Size([n])
        for key in ("box", "disc", "multi_disc", "multi_bin"):
            np.testing.assert_array_equal(td["observation", key].numpy(), w_obs[key])
        np.testing.assert_array_equal(td["observation", "tup", "0"].numpy(), w_obs["tup"][0])
        np.testing.assert_array_equal(td["observation", "tup", "1"].numpy(), w_obs["tup"][1])
        np.testing.assert_array_equal(td["reward"].numpy(), w_rew[:, None])
        np.testing.assert_array_equal(td["terminated"].numpy(), w_term[:, None])
        np.testing.assert_array_equal(td["truncated"].numpy(), w_trunc[:, None])
        np.testing.assert_array_equal(td["done"].numpy(), (w_term | w_trunc)[:, None])
    ref.close()


def test_tensordict_keys_shapes_and_sharing(make_env):
    tenvs = make_env("CartPole-v1", NUM_ENVS, backend="processes", output="torch", copy=False)
    td = tenvs.reset_tensordict(seed=0)
    assert td.batch_size == torch.Size([NUM_ENVS])
    assert set(td.keys()) == {"observation", "terminated", "truncated", "done"}
    assert td["done"].shape == (NUM_ENVS, 1) and not td["done"].any()
    obs, reward, terminated, truncated, _ = tenvs.step(np.zeros(NUM_ENVS, dtype=np.int64))
    td = tenvs.step_tensordict(torch.ones(NUM_ENVS, dtype=torch.int64))
    assert set(td.keys()) == {"observation", "reward", "terminated", "truncated", "done"}
    assert td["observation"].shape == (NUM_ENVS, 4) and td["observation"].dtype == torch.float32
    assert td["reward"].shape == (NUM_ENVS, 1) and td["reward"].dtype == torch.float64
    for key in ("terminated", "truncated", "done"):
        assert td[key].shape == (NUM_ENVS, 1) and td[key].dtype == torch.bool
    # Zero-copy: the TensorDict's entries are views of the tensors step() returns.
    assert td["observation"].data_ptr() == obs.data_ptr()
    assert td["reward"].data_ptr() == reward.data_ptr()
    assert td["terminated"].data_ptr() == terminated.data_ptr()
    assert td["truncated"].data_ptr() == truncated.data_ptr()
    assert torch.equal(td["done"], td["terminated"] | td["truncated"])


def test_step_async_wait_call_and_attributes(make_env):
    tenvs = make_env("CartPole-v1", 2, backend="processes", output="torch")
    tenvs.reset(seed=1)
    tenvs.step_async(torch.zeros(2, dtype=torch.int64))
    obs, reward, *_ = tenvs.step_wait(timeout=30)
    assert isinstance(obs, torch.Tensor) and reward.tolist() == [1.0, 1.0]
    assert tenvs.get_attr("spec")[0].id == "CartPole-v1"
    tenvs.set_attr("custom", [1, 2])
    assert tenvs.call("custom") == (1, 2)


def test_output_errors_before_any_worker_starts(snapshot):
    with pytest.raises(envfleet.ConfigError, match="output must be one of"):
        envfleet.make("CartPole-v1", 2, output="jax")
    with pytest.raises(envfleet.ConfigError, match="pin_memory must be a bool"):
        envfleet.make("CartPole-v1", 2, output=envfleet.TorchOutput(pin_memory="yes"))
    with pytest.raises(envfleet.ConfigError, match="not a first-ready pool's send/recv"):
        envfleet.make("CartPole-v1", 4, batch_size=2, output="torch")
    with pytest.raises(envfleet.ConfigError, match="not available"):
        envfleet.make(
            "CartPole-v1",
            2,
            output=envfleet.TorchOutput(device="no-such-device"),
        )
    if not torch.cuda.is_available():
        with pytest.raises(envfleet.ConfigError, match="not available"):
            envfleet.make(
                "CartPole-v1",
                2,
                output=envfleet.TorchOutput(device="cuda"),
            )
        with pytest.raises(envfleet.ConfigError, match="pin_memory=True needs an accelerator"):
            envfleet.make(
                "CartPole-v1",
                2,
                output=envfleet.TorchOutput(pin_memory=True),
            )
    snapshot.assert_nothing_left()


def test_missing_torch_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` now raises ImportError
    with pytest.raises(envfleet.ConfigError, match=r"pip install 'envfleet\[torch\]'"):
        envfleet.make("CartPole-v1", 2, backend="serial", output="torch")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("pin_memory", [False, True])
def test_cuda_transfer(make_env, pin_memory):
    actions = cartpole_actions(20)
    want = reference_cartpole(actions)
    tenvs = make_env(
        "CartPole-v1",
        NUM_ENVS,
        output=envfleet.TorchOutput(device="cuda", pin_memory=pin_memory),
    )
    obs, _ = tenvs.reset(seed=0)
    kept = [obs]
    for a in actions:
        obs, reward, terminated, truncated, _ = tenvs.step(torch.as_tensor(a, device="cuda"))
        assert obs.device.type == reward.device.type == terminated.device.type == "cuda"
        kept.append(obs)
    for got, w in zip(kept, want, strict=True):  # device tensors are yours to keep
        np.testing.assert_array_equal(got.cpu().numpy(), w[0])
    td = tenvs.step_tensordict(torch.zeros(NUM_ENVS, dtype=torch.int64, device="cuda"))
    assert td.device.type == "cuda"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_pinned_cpu_buffers(make_env):
    tenvs = make_env(
        "CartPole-v1", NUM_ENVS, output=envfleet.TorchOutput(pin_memory=True), copy=False
    )
    obs, _ = tenvs.reset(seed=0)
    assert obs.is_pinned()
    obs2 = tenvs.step(np.zeros(NUM_ENVS, dtype=np.int64))[0]
    assert obs2.data_ptr() == obs.data_ptr()  # preallocated, reused: valid until the next call
