"""The learner's-loop benchmark (``envfleet bench --policy``'s core in envfleet.bench).

Structure, the bound's formula and the install messages only: no timed assertions.
"""

from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys
import time
from types import SimpleNamespace

import cloudpickle
import gymnasium
import numpy as np
import pytest

from envfleet import ConfigError
from envfleet._sampler.auto_inference import policy_on_gpu
from envfleet.bench import (
    POLICY_SYSTEMS,
    PUFFER_INSTALL,
    ROLLOUT_STEPS,
    STORE_SYSTEMS,
    TORCH_INSTALL,
    TorchPolicy,
    Workload,
    check_workload,
    groups_bound,
    measure_policy_loop,
    one_call_bound,
    overlap_bound,
    policy_table,
    require_torch,
    schedule_bound,
    schedule_sizes,
    schedule_splits,
    schedule_structures,
    time_in_loop,
    usable_cores,
    workers_bound,
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


def test_schedule_sizes_halve_and_quarter_the_batch():
    assert schedule_sizes(16) == (16, 8, 4)
    assert schedule_sizes(10) == (10, 5, 2)  # 4 groups of 2 or 3: the smaller size
    assert schedule_sizes(3) == (3, 1)  # no 4 groups of 3 envs
    assert schedule_sizes(2) == (2, 1)
    assert schedule_sizes(1) == (1,)
    with pytest.raises(ConfigError):
        schedule_sizes(0)


def test_many_cores_add_a_worker_per_core_to_the_splits():
    """On 16 cores a loop can run the policy in 8 workers of one Pong env each: the bound
    takes that structure (a Sampler's worker inference on 16 cores ran it, above a bound of
    2 and 4 workers only)."""
    assert schedule_splits(16, cores=16) == (2, 4, 8, 16)
    assert schedule_splits(8, cores=16) == (2, 4, 8)
    assert schedule_splits(16, cores=2) == (2, 4)
    assert schedule_sizes(8, cores=16) == (8, 4, 2, 1)
    # A CNN whose time is proportional to its batch, 1 ms of env: 8 workers of one env win.
    times = {8: 6.4e-3, 4: 3.2e-3, 2: 1.6e-3, 1: 0.8e-3}
    best, structure = schedule_bound(8, times, 1e-3, 16)
    assert structure == "policy in each of 8 workers"
    assert best == pytest.approx(8 / 1.8e-3)
    with pytest.raises(ConfigError, match="missing at batch sizes \\[1\\]"):
        schedule_bound(8, {8: 1e-3, 4: 1e-3, 2: 1e-3}, 1e-3, 16)


def test_each_structure_on_hand_computed_numbers():
    # One call: T_p(16) = 100 us, then 16 * 1 us over 2 cores: 108 us a cycle.
    assert one_call_bound(16, 100e-6, 1e-6, 2) == pytest.approx(16 / 108e-6)
    # 2 groups: 2 * 10 us of policy on one core; (20 + 16 * 10) / 4 = 45 us over the cores.
    assert groups_bound(16, 2, 10e-6, 10e-6, 4) == pytest.approx(16 / 45e-6)
    # ... and the driver's 4 calls of 50 us are the cycle when the envs are light.
    assert groups_bound(16, 4, 50e-6, 1e-6, 8) == pytest.approx(16 / 200e-6)
    # 4 workers: 40 us of policy + 4 envs * 1 us each; the cores hold (160 + 16) / 8 = 22 us.
    assert workers_bound(16, 4, 40e-6, 1e-6, 8) == pytest.approx(16 / 44e-6)
    # ... and on 2 cores the cores' share, (160 + 16) / 2 = 88 us, is the cycle.
    assert workers_bound(16, 4, 40e-6, 1e-6, 2) == pytest.approx(16 / 88e-6)
    # One group or one worker on one core is one call.
    assert groups_bound(4, 1, 1e-3, 0.5e-3, 1) == pytest.approx(one_call_bound(4, 1e-3, 0.5e-3, 1))
    assert workers_bound(4, 1, 1e-3, 0.5e-3, 1) == pytest.approx(4 / 3e-3)


def test_schedule_bound_a_policy_whose_cost_does_not_shrink_is_best_in_one_call():
    t_policy = {16: 100e-6, 8: 100e-6, 4: 100e-6}
    structures = schedule_structures(16, t_policy, 1e-6, 1)
    assert structures == pytest.approx(
        {
            "one call": 16 / 116e-6,  # 100 + 16
            "2 groups alternating": 16 / 216e-6,  # max(200, 200 + 16)
            "4 groups alternating": 16 / 416e-6,  # max(400, 400 + 16)
            "policy in each of 2 workers": 16 / 216e-6,  # max(100 + 8, 200 + 16)
            "policy in each of 4 workers": 16 / 416e-6,  # max(100 + 4, 400 + 16)
        }
    )
    assert list(structures) == [
        "one call",
        "2 groups alternating",
        "4 groups alternating",
        "policy in each of 2 workers",
        "policy in each of 4 workers",
    ]
    best, structure = schedule_bound(16, t_policy, 1e-6, 1)
    assert structure == "one call" and best == pytest.approx(16 / 116e-6)
    # On 2 cores, 2 workers tie with one call (100 + 8 = (200 + 16) / 2): the first is named.
    assert schedule_bound(16, t_policy, 1e-6, 2) == (pytest.approx(16 / 108e-6), "one call")


def test_schedule_bound_a_policy_cost_proportional_to_n_on_many_cores_is_best_in_workers():
    t_policy = {n: 10e-6 * n for n in (16, 8, 4, 2)}  # 8 cores: up to 8 groups or workers
    structures = schedule_structures(16, t_policy, 1e-6, 8)
    assert structures == pytest.approx(
        {
            "one call": 16 / 162e-6,  # 160 + 16 / 8
            "2 groups alternating": 16 / 160e-6,  # max(2 * 80, (160 + 16) / 8)
            "4 groups alternating": 16 / 160e-6,  # max(4 * 40, (160 + 16) / 8)
            "8 groups alternating": 16 / 160e-6,  # max(8 * 20, (160 + 16) / 8)
            "policy in each of 2 workers": 16 / 88e-6,  # max(80 + 8, 22)
            "policy in each of 4 workers": 16 / 44e-6,  # max(40 + 4, 22)
            "policy in each of 8 workers": 16 / 22e-6,  # max(20 + 2, 22)
        }
    )
    best, structure = schedule_bound(16, t_policy, 1e-6, 8)
    assert structure == "policy in each of 8 workers" and best == pytest.approx(16 / 22e-6)
    # The overlap bound keeps the policy's batch whole, on one core: the schedule passes it.
    overlap = overlap_bound(16, 160e-6, 1e-6, 8)
    assert overlap == pytest.approx(16 / 160e-6) and overlap < best


def test_schedule_bound_heavy_envs_and_a_fixed_policy_cost_alternate_two_groups():
    # T_p = 10 us at every size, t_env = 10 us, 4 cores: one call 10 + 40 = 50 us; 2 groups
    # max(20, (20 + 160) / 4) = 45 us; 4 groups max(40, 50) = 50 us; 2 workers
    # max(10 + 80, 45) = 90 us; 4 workers max(10 + 40, 50) = 50 us.
    best, structure = schedule_bound(16, {16: 10e-6, 8: 10e-6, 4: 10e-6}, 10e-6, 4)
    assert structure == "2 groups alternating" and best == pytest.approx(16 / 45e-6)


def test_schedule_bound_small_batches_and_bad_numbers():
    # N = 2: no 4-way split; N = 1: one call only.
    assert list(schedule_structures(2, {2: 1e-3, 1: 1e-3}, 1e-3, 2)) == [
        "one call",
        "2 groups alternating",
        "policy in each of 2 workers",
    ]
    assert schedule_bound(1, {1: 1e-3}, 1e-3, 4) == (pytest.approx(1 / 1.25e-3), "one call")
    with pytest.raises(ConfigError, match=r"missing at batch sizes \[4\]"):
        schedule_bound(16, {16: 1e-3, 8: 1e-3}, 1e-3, 2)
    with pytest.raises(ConfigError):
        groups_bound(4, 5, 1e-3, 1e-3, 2)
    with pytest.raises(ConfigError):
        workers_bound(4, 0, 1e-3, 1e-3, 2)
    with pytest.raises(ConfigError):
        one_call_bound(4, -1.0, 1e-3, 2)
    with pytest.raises(ConfigError):
        schedule_bound(4, {4: 1e-3, 2: 1e-3, 1: 1e-3}, 1e-3, 0)


class _SleepyEnv(gymnasium.Env):
    """Each step sleeps ``1 ms``; episodes of 5 steps."""

    observation_space = CARTPOLE_OBS
    action_space = gymnasium.spaces.Discrete(2)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return np.zeros(4, np.float32), {}

    def step(self, action):
        time.sleep(0.001)
        self.t += 1
        return np.full(4, self.t, np.float32), 1.0, self.t >= 5, False, {}


def test_time_in_loop_splits_the_policys_time_from_the_envs():
    """The loop bound's costs: the policy's seconds per call and one env's per step, each
    with the other's time left out (lower bounds only: the sleeps; no timed upper bound
    beyond telling the two apart)."""
    calls: list[int] = []

    def policy(obs):
        calls.append(len(obs))
        time.sleep(0.05)
        return np.zeros(len(obs), np.int64)

    workload = SimpleNamespace(env_id="sleepy", factory=lambda: _SleepyEnv)
    t_policy, t_env, steps = time_in_loop(workload, 3, policy, 0, 0.2)
    assert set(calls) == {3} and steps == 3 * (len(calls) - 3)  # 3 untimed calls first
    # Counted into the envs, the policy would make t_env at least 0.05 / 3 + 0.001.
    assert t_policy >= 0.05 and 0.001 <= t_env < 0.01


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
        TorchPolicy("cnn", PONG_OBS, box)
    with pytest.raises(ConfigError, match="Discrete action space or a Box"):
        TorchPolicy("mlp", CARTPOLE_OBS, gymnasium.spaces.MultiBinary(3))
    with pytest.raises(ConfigError, match="unknown policy"):
        TorchPolicy("rnn", CARTPOLE_OBS, gymnasium.spaces.Discrete(2))


def test_the_mlp_on_a_box_is_a_gaussian_within_the_bounds():
    """CleanRL's continuous-action actor: float32 actions of the Box's shape, drawn around
    the actor's means (log std 0), clipped to the bounds, reproducible from the seed."""
    box = gymnasium.spaces.Box(-0.5, 0.5, (2, 3), np.float32)
    policy = TorchPolicy("mlp", CARTPOLE_OBS, box, seed=1)
    obs = np.zeros((64, 4), np.float32)
    actions = policy(obs)
    assert actions.shape == (64, 2, 3) and actions.dtype == np.float32
    assert actions.min() >= -0.5 and actions.max() <= 0.5
    assert len(np.unique(actions)) > 10  # drawn, not the means
    assert np.array_equal(TorchPolicy("mlp", CARTPOLE_OBS, box, seed=1)(obs), actions)


def test_a_mujoco_workload_without_mujoco_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "mujoco", None)  # find_spec("mujoco") answers None
    with pytest.raises(ConfigError, match=r"envfleet\[mujoco\]"):
        check_workload(Workload("HalfCheetah-v5", 8, "mlp"))


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
    # T_p at N and N / 2 (no quarter of 2 envs), and the schedule bound from them.
    assert list(bound.t_policy_by_n) == [2, 1] and all(t > 0 for t in bound.t_policy_by_n.values())
    assert bound.t_policy_by_n[2] == bound.t_policy_s
    assert bound.structures == schedule_structures(
        2, bound.t_policy_by_n, bound.t_env_s, bound.cores
    )
    assert (bound.schedule_steps_per_s, bound.schedule_structure) == schedule_bound(
        2, bound.t_policy_by_n, bound.t_env_s, bound.cores
    )
    assert [r.system for r in report.results] == list(POLICY_SYSTEMS)
    has_puffer = importlib.util.find_spec("pufferlib") is not None
    has_envpool = importlib.util.find_spec("envpool") is not None
    for r in report.results:
        if r.system.startswith("puffer") and not has_puffer:
            assert r.skipped == PUFFER_INSTALL and r.runs == ()
            assert math.isnan(r.steps_per_s)
            continue
        if r.system.startswith("envpool") and not has_envpool:
            assert r.skipped is not None and "pip install" in r.skipped and r.runs == ()
            continue
        assert r.skipped is None
        assert len(r.runs) == 2 and all(rate > 0 for rate in r.runs)
        assert r.steps_per_s == pytest.approx(float(np.median(r.runs)))
        assert r.of_bound == pytest.approx(r.steps_per_s / bound.steps_per_s)
        assert r.of_schedule_bound == pytest.approx(r.steps_per_s / bound.schedule_steps_per_s)
    by_system = {r.system: r for r in report.results}
    # Each repetition's ratio is to the faster gymnasium loop of that repetition.
    gym = zip(by_system["gym-sync"].runs, by_system["gym-async"].runs, strict=True)
    best = [max(a, b) for a, b in gym]
    # The peers: gymnasium's, PufferLib's and EnvPool's own loops (each where installed).
    peer_loops = ("gym-sync", "gym-async", "puffer-sync", "puffer-async", "envpool")
    peers = [by_system[p].runs for p in peer_loops]
    best_peer = [max(rates) for rates in zip(*(runs for runs in peers if runs), strict=True)]
    plain = by_system["envfleet"].runs
    store = by_system["envfleet-store"].runs
    for r in report.results:
        if r.runs:
            for got, refs in (
                (r.vs_best_gym, best),
                (r.vs_best_peer, best_peer),
                (r.vs_envfleet_loop, plain),
                (r.vs_envfleet_store, store),
            ):
                ratios = [rate / ref for rate, ref in zip(r.runs, refs, strict=True)]
                assert got == pytest.approx(float(np.median(ratios)))
    assert by_system["envfleet"].vs_envfleet_loop == pytest.approx(1.0)
    assert by_system["envfleet-store"].vs_envfleet_store == pytest.approx(1.0)
    # The default Sampler says, per repetition, which inference its calibration chose.
    notes = by_system["sampler"].notes
    assert len(notes) == 2
    assert all(n.split(" ")[0] in ("driver", "worker") and "calibrated" in n for n in notes)
    # ... and its report, the schedule bound filled in from the bound's T_p(n).
    assert all("of the schedule bound" in n and "its own t_env" in n for n in notes)
    assert all(not r.notes for r in report.results if r.system != "sampler")
    table = policy_table(report)
    assert f"sampler: {notes[0]}" in table
    assert f"schedule bound {bound.schedule_steps_per_s:,.0f} steps/s" in table
    assert f"({bound.schedule_structure})" in table and "T_p(1) = " in table
    assert "| of overlap bound | of schedule bound |" in table
    assert "| vs envfleet loop | vs envfleet store |" in table
    for system in STORE_SYSTEMS:  # the loop a learner writes, marked as such
        assert f"| {system} (the loop a learner writes) |" in table
    assert f"T = {ROLLOUT_STEPS}" in table
    assert "| envfleet |" in table and "| gym-sync |" in table
    # How often "auto" kept the mode that ran faster in the same repetition.
    driver, worker = by_system["sampler-driver"].runs, by_system["sampler-worker"].runs
    faster = ["worker" if w > d else "driver" for d, w in zip(driver, worker, strict=True)]
    kept = sum(n.split(" ")[0] == f for n, f in zip(notes, faster, strict=True))
    assert report.auto_kept == (kept, 2)
    assert f"in {kept} of 2 repetitions" in table


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
    from envfleet.bench._policy_loop import Resets, _plain_loop

    closers: list = []
    envs = gymnasium.vector.SyncVectorEnv([_ThreeStepEnv] * 2)  # NEXT_STEP autoreset
    plain = _plain_loop(envs, 2, lambda obs: np.zeros(len(obs), np.int64), 0, closers)
    # Steps 1-3 are transitions; step 4 resets both envs (actions ignored); and again.
    assert [plain() for _ in range(8)] == [2, 2, 2, 0, 2, 2, 2, 0]
    for close in closers:
        close()
    resets = Resets(4)
    assert resets.taken([0, 1], [True, False], [False, False]) == 2
    assert resets.taken([2, 0], [False, False], [False, True]) == 1  # env 0's was a reset
    assert resets.taken([0, 1], [False, False], [False, False]) == 1  # and again: truncated


def test_storing_loop_writes_the_rollout_and_counts_transitions():
    from envfleet.bench._policy_loop import StoringLoop

    assert STORE_SYSTEMS == (
        "gym-sync-store",
        "gym-async-store",
        "puffer-sync-store",
        "envpool-store",
        "envfleet-store",
    )
    assert all(s.removesuffix("-store") in POLICY_SYSTEMS for s in STORE_SYSTEMS)
    closers: list = []
    envs = gymnasium.vector.SyncVectorEnv([_ThreeStepEnv] * 2)  # NEXT_STEP autoreset
    calls = []

    def policy(obs):
        calls.append(obs.copy())
        return np.full(len(obs), len(calls) % 2, np.int64)

    store = StoringLoop(envs, 2, policy, 0, closers, steps=3)
    assert store.obs.shape == (3, 2, 1) and store.obs.dtype == np.float32
    assert store.actions.shape == (3, 2) and store.actions.dtype == np.int64
    assert store.rewards.shape == (3, 2) and store.rewards.dtype == np.float32
    assert store.dones.shape == (3, 2) and store.dones.dtype == np.bool_
    # The same count as the plain loop: step 4 only resets (NEXT_STEP), not a transition.
    assert [store() for _ in range(4)] == [2, 2, 2, 0]
    # Rows 0-2 held steps 1-3 (observations 0, 1, 2; done at the third); step 4 wrapped
    # around into row 0: it saw the last observation (3) and its result is the reset's.
    np.testing.assert_array_equal(store.obs[:, :, 0], [[3, 3], [1, 1], [2, 2]])
    np.testing.assert_array_equal(store.dones, [[False, False], [False, False], [True, True]])
    np.testing.assert_array_equal(store.actions, [[1, 1], [1, 1], [0, 0]])
    np.testing.assert_array_equal(store.rewards, np.zeros((3, 2), np.float32))
    assert store.t == 1
    # The stored observations are the ones the policy saw, copied (not the env's buffer).
    np.testing.assert_array_equal(store.obs[1], calls[2])
    for close in closers:
        close()
    assert ROLLOUT_STEPS == 128


def test_storing_loop_over_envfleet_copies_each_step():
    """envfleet's observations are views of its shared block; the rollout keeps copies."""
    import envfleet
    from envfleet.bench._policy_loop import StoringLoop

    closers: list = []
    envs = envfleet.make(_ThreeStepEnv, 2)
    store = StoringLoop(envs, 2, lambda obs: np.zeros(len(obs), np.int64), 0, closers, steps=4)
    try:
        assert [store() for _ in range(4)] == [2, 2, 2, 0]
        np.testing.assert_array_equal(store.obs[:, :, 0], [[0, 0], [1, 1], [2, 2], [3, 3]])
        np.testing.assert_array_equal(store.dones[:, 0], [False, False, True, False])
    finally:
        for close in closers:
            close()


def test_envpool_systems_do_the_workloads_work():
    """The ``envpool`` systems run EnvPool's own task doing a workload's work: an Atari
    workload's frames as its gymnasium wrappers make them (the same observation space), and
    the storing loop over EnvPool writes its rollout and counts transitions as over
    gymnasium's vector envs (an env's reset step after its end is not one)."""
    pytest.importorskip("envpool")
    from envfleet.bench._peers import EnvPoolVector
    from envfleet.bench._policy_loop import StoringLoop, envpool_workload_task

    atari = Workload("ALE/Pong-v5", 2, "cnn", atari=True)
    if importlib.util.find_spec("ale_py") is not None:
        task = envpool_workload_task(atari)
        assert task is not None
        name, kwargs = task
        assert name == "Pong-v5" and kwargs["repeat_action_probability"] == 0.25
        pool = EnvPoolVector(task, 2, 0)
        env = atari.factory()()
        try:
            obs = pool.reset(seed=0)[0]
            assert obs.shape == (2, *env.observation_space.shape)
            assert obs.dtype == env.observation_space.dtype
        finally:
            pool.close()
            env.close()
    assert envpool_workload_task(Workload("Taxi-v4", 2, "mlp")) is None  # not an EnvPool task
    task = envpool_workload_task(Workload("CartPole-v1", 4, "mlp"))
    assert task == ("CartPole-v1", {})
    closers: list = []
    pool = EnvPoolVector(task, 4, 0)
    loop = StoringLoop(pool, 4, lambda obs: np.zeros(len(obs), dtype=np.int64), 0, closers, 8)
    try:
        taken = [loop() for _ in range(40)]  # always left: every episode ends within 40 steps
        assert loop.t == 40 % 8 and loop.dones.any()
        assert sum(taken) < 160  # the reset steps after the episodes' ends are not counted
        assert np.array_equal(loop.actions, np.zeros((8, 4), dtype=np.int64))
    finally:
        for close in closers:
            close()
