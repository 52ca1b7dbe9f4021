"""The learner's-loop benchmark (``envfleet bench --policy``'s core in envfleet.bench).

Structure, the bound's formula and the install messages only: no timed assertions (DESIGN §6).
"""

from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys

import cloudpickle
import gymnasium
import numpy as np
import pytest

from envfleet import ConfigError
from envfleet._sampler.auto_inference import policy_on_gpu
from envfleet.bench import (
    POLICY_SYSTEMS,
    PUFFER_INSTALL,
    TORCH_INSTALL,
    TorchPolicy,
    Workload,
    check_workload,
    measure_policy_loop,
    overlap_bound,
    policy_table,
    require_torch,
    usable_cores,
    workloads,
)

torch = pytest.importorskip("torch")

CARTPOLE_OBS = gymnasium.spaces.Box(-np.inf, np.inf, (4,), np.float32)
PONG_OBS = gymnasium.spaces.Box(0, 255, (4, 84, 84), np.uint8)


# -- the bound -------------------------------------------------------------------------------


def test_overlap_bound_policy_bound():
    # T_p = 141 us exceeds (141 + 16 * 8.2) / 2 = 136.1 us: the policy bounds the loop.
    assert overlap_bound(16, 141e-6, 8.2e-6, 2) == pytest.approx(16 / 141e-6)


def test_overlap_bound_env_bound():
    # (2.7 ms + 8 * 414 us) / 2 = 3.006 ms exceeds T_p = 2.7 ms: the envs bound the loop.
    assert overlap_bound(8, 2.7e-3, 414e-6, 2) == pytest.approx(8 / 3.006e-3)


def test_overlap_bound_one_core_is_the_serial_sum():
    assert overlap_bound(4, 1e-3, 0.5e-3, 1) == pytest.approx(4 / 3e-3)


@pytest.mark.parametrize(
    "args", [(0, 1e-3, 1e-3, 2), (4, 1e-3, 1e-3, 0), (4, -1.0, 1e-3, 2), (4, 0.0, 0.0, 2)]
)
def test_overlap_bound_rejects_bad_numbers(args):
    with pytest.raises(ConfigError):
        overlap_bound(*args)


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity here")
def test_usable_cores_follows_the_affinity_mask():
    code = (
        "import os; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})\n"
        "from envfleet.bench import usable_cores; print(usable_cores())\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "1"
    assert usable_cores() == len(os.sched_getaffinity(0))


# -- install messages ------------------------------------------------------------------------


def test_missing_torch_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch raises ImportError
    with pytest.raises(ConfigError, match=r"pip install 'envfleet\[torch\]'"):
        require_torch()
    with pytest.raises(ConfigError, match="needs torch"):
        TorchPolicy("mlp", CARTPOLE_OBS, gymnasium.spaces.Discrete(2))
    with pytest.raises(ConfigError, match="needs torch"):
        measure_policy_loop(workloads("mlp", num_envs=2)[0], ["gym-sync"], 0.1)
    assert "envfleet[torch]" in TORCH_INSTALL


def test_missing_opencv_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "cv2", None)  # find_spec("cv2") answers None
    pong = Workload("ALE/Pong-v5", 2, "cnn", atari=True)
    if importlib.util.find_spec("ale_py") is None:
        with pytest.raises(ConfigError, match=r"envfleet\[atari\]"):
            check_workload(pong)
    else:
        with pytest.raises(ConfigError, match="opencv-python-headless"):
            check_workload(pong)
    check_workload(workloads("mlp")[0])  # nothing needed


# -- workloads and policies ----------------------------------------------------------------


def test_workloads_defaults_and_overrides():
    assert workloads("mlp") == [Workload("CartPole-v1", 16, "mlp")]
    assert workloads("cnn") == [Workload("ALE/Pong-v5", 8, "cnn", atari=True)]
    assert workloads("mlp", ["LunarLander-v3"], 4) == [Workload("LunarLander-v3", 4, "mlp")]
    with pytest.raises(ConfigError, match="unknown policy"):
        workloads("rnn")


def test_mlp_policy_samples_actions_and_pickles():
    policy = TorchPolicy("mlp", CARTPOLE_OBS, gymnasium.spaces.Discrete(2), seed=3)
    obs = np.random.default_rng(0).normal(size=(64, 4)).astype(np.float32)
    actions = policy(obs)
    assert actions.shape == (64,) and actions.dtype == np.int64
    assert set(actions.tolist()) <= {0, 1}
    twin = TorchPolicy("mlp", CARTPOLE_OBS, gymnasium.spaces.Discrete(2), seed=3)
    np.testing.assert_array_equal(twin(obs), actions)  # same seed, same weights and draws
    copy = cloudpickle.loads(cloudpickle.dumps(twin))
    copy.seed(7)
    twin.seed(7)
    np.testing.assert_array_equal(copy(obs), twin(obs))


def test_cnn_policy_on_frame_stacks():
    policy = TorchPolicy("cnn", PONG_OBS, gymnasium.spaces.Discrete(6), seed=0)
    obs = np.random.default_rng(0).integers(0, 256, (3, 4, 84, 84), dtype=np.uint8)
    actions = policy(obs)
    assert actions.shape == (3,) and actions.dtype == np.int64
    assert ((actions >= 0) & (actions < 6)).all()


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_policy_on_a_device_returns_numpy_actions_on_the_cpu(device):
    """``device=`` puts the weights and the computation there (``--device`` of the
    benchmark); the actions come back as a numpy array. CUDA only where a GPU is."""
    torch = pytest.importorskip("torch")
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device here")
    policy = TorchPolicy("mlp", CARTPOLE_OBS, gymnasium.spaces.Discrete(2), 3, device)
    assert next(policy.actor.parameters()).device.type == device
    actions = policy(np.zeros((8, 4), np.float32))
    assert isinstance(actions, np.ndarray) and actions.shape == (8,)
    assert actions.dtype == np.int64 and set(actions.tolist()) <= {0, 1}
    # The Sampler sees where it is: a GPU policy runs driver inference under "auto".
    assert policy_on_gpu(policy) is (device == "cuda")


def test_policy_refuses_spaces_it_cannot_drive():
    box = gymnasium.spaces.Box(-1.0, 1.0, (2,), np.float32)
    with pytest.raises(ConfigError, match="Discrete"):
        TorchPolicy("mlp", CARTPOLE_OBS, box)
    with pytest.raises(ConfigError, match="unknown policy"):
        TorchPolicy("rnn", CARTPOLE_OBS, gymnasium.spaces.Discrete(2))


# -- the measurement -------------------------------------------------------------------------


def test_measure_policy_loop_every_system_tiny_budget():
    report = measure_policy_loop(
        workloads("mlp", num_envs=2)[0], POLICY_SYSTEMS, 0.05, repeats=2, warmup_s=0.01
    )
    assert (report.env_id, report.num_envs, report.policy) == ("CartPole-v1", 2, "mlp")
    bound = report.bound
    assert bound.t_policy_s > 0 and bound.t_env_s > 0 and bound.cores == usable_cores()
    assert bound.steps_per_s == pytest.approx(
        overlap_bound(2, bound.t_policy_s, bound.t_env_s, bound.cores)
    )
    assert [r.system for r in report.results] == list(POLICY_SYSTEMS)
    has_puffer = importlib.util.find_spec("pufferlib") is not None
    for r in report.results:
        if r.system.startswith("puffer") and not has_puffer:
            assert r.skipped == PUFFER_INSTALL and r.runs == ()
            assert math.isnan(r.steps_per_s)
            continue
        assert r.skipped is None
        assert len(r.runs) == 2 and all(rate > 0 for rate in r.runs)
        assert r.steps_per_s == pytest.approx(float(np.median(r.runs)))
        assert r.of_bound == pytest.approx(r.steps_per_s / bound.steps_per_s)
    by_system = {r.system: r for r in report.results}
    # Each repetition's ratio is to the faster gymnasium loop of that repetition.
    gym = zip(by_system["gym-sync"].runs, by_system["gym-async"].runs, strict=True)
    best = [max(a, b) for a, b in gym]
    peers = [by_system[p].runs for p in ("gym-sync", "gym-async", "puffer-sync", "puffer-async")]
    best_peer = [max(rates) for rates in zip(*(runs for runs in peers if runs), strict=True)]
    plain = by_system["envfleet"].runs
    for r in report.results:
        if r.runs:
            for got, refs in (
                (r.vs_best_gym, best),
                (r.vs_best_peer, best_peer),
                (r.vs_envfleet_loop, plain),
            ):
                ratios = [rate / ref for rate, ref in zip(r.runs, refs, strict=True)]
                assert got == pytest.approx(float(np.median(ratios)))
    assert by_system["envfleet"].vs_envfleet_loop == pytest.approx(1.0)
    # The default Sampler says, per repetition, which inference its calibration chose.
    notes = by_system["sampler"].notes
    assert len(notes) == 2
    assert all(n.split(" ")[0] in ("driver", "worker") and "calibrated" in n for n in notes)
    assert all(not r.notes for r in report.results if r.system != "sampler")
    table = policy_table(report)
    assert f"sampler: {notes[0]}" in table


def test_measure_policy_loop_rejects_bad_arguments():
    workload = workloads("mlp", num_envs=2)[0]
    with pytest.raises(ConfigError, match="unknown system"):
        measure_policy_loop(workload, ["gym-sync", "bogus"], 0.1)
    with pytest.raises(ConfigError, match="repeats"):
        measure_policy_loop(workload, ["gym-sync"], 0.1, repeats=0)
    with pytest.raises(ConfigError, match="no system"):
        measure_policy_loop(workload, [], 0.1)


class _ThreeStepEnv(gymnasium.Env):
    """Episodes of exactly three steps."""

    observation_space = gymnasium.spaces.Box(0, 3, (1,), np.float32)
    action_space = gymnasium.spaces.Discrete(2)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return np.zeros(1, np.float32), {}

    def step(self, action):
        self.t += 1
        return np.full(1, self.t, np.float32), 0.0, self.t == 3, False, {}


def test_loops_count_transitions_not_the_steps_that_only_reset():
    from envfleet.bench._policy_loop import _plain_loop, _Resets

    closers: list = []
    envs = gymnasium.vector.SyncVectorEnv([_ThreeStepEnv] * 2)  # NEXT_STEP autoreset
    plain = _plain_loop(envs, 2, lambda obs: np.zeros(len(obs), np.int64), 0, closers)
    # Steps 1-3 are transitions; step 4 resets both envs (actions ignored); and again.
    assert [plain() for _ in range(8)] == [2, 2, 2, 0, 2, 2, 2, 0]
    for close in closers:
        close()
    resets = _Resets(4)
    assert resets.taken([0, 1], [True, False], [False, False]) == 2
    assert resets.taken([2, 0], [False, False], [False, True]) == 1  # env 0's was a reset
    assert resets.taken([0, 1], [False, False], [False, False]) == 1  # and again: truncated
