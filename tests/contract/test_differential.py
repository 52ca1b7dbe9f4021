"""Differential tests: envfleet against gymnasium.vector.SyncVectorEnv, bit for bit.

For every backend, the same seeds and actions give bit-identical observations,
rewards, terminations, truncations and infos to SyncVectorEnv, in every autoreset mode,
whatever num_workers is. ``backend`` is the contract's (tests/contract/conftest.py): each test
runs on every entry of its BACKENDS unless it names the ones it is about.
"""

from __future__ import annotations

import functools
from copy import deepcopy
from typing import Any

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.vector import AutoresetMode, SyncVectorEnv
from gymnasium.vector.utils import batch_space
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import envfleet
import envfleet._core.native
import envfleet._core.rows
import envfleet._front.results
from tests.envs import FormObsEnv, MixedObsEnv, NestedSpaceEnv, SparseInfoEnv, sync_factories
from tests.helpers import assert_same

NUM_ENVS = 5
WORKERS = [1, 2, NUM_ENVS]  # one worker, a count that does not divide NUM_ENVS, one per env
STEPS = 300
MODES = list(AutoresetMode)
MID_EPISODE_RESETS = {  # step -> (reset mask, seed)
    40: (np.array([True, False, True, False, False]), 1234),
    117: (np.array([False, True, False, False, True]), None),
}


@pytest.fixture(autouse=True)
def spare_slabs_for_small_observations(monkeypatch, request):
    """copy=True results come from spare slabs only for observations of at least
    SPARE_SLABS_MIN_BYTES, larger than these: lower the bar in every case but those with one
    worker, so that both the slabs and the copies are checked against SyncVectorEnv."""
    params = getattr(request.node, "callspec", None)
    layout = params.params.get("layout") if params is not None else None
    if layout != {"num_workers": 1}:
        monkeypatch.setattr(envfleet._front.results, "SPARE_SLABS_MIN_BYTES", 0)


def gym_case(env_id: str, **kwargs: Any) -> tuple[Any, dict[str, Any] | None, Any]:
    """(env for envfleet.make, env_kwargs, SyncVectorEnv factories builder)."""
    return (
        env_id,
        kwargs or None,
        lambda n: [functools.partial(gym.make, env_id, **kwargs)] * n,
    )


def custom_case(cls: Any) -> tuple[Any, None, Any]:
    return cls, None, lambda n: sync_factories(cls, n)


ENV_CASES = {
    "CartPole-v1": gym_case("CartPole-v1"),
    "Pendulum-v1": gym_case("Pendulum-v1", max_episode_steps=60),
    "MountainCarContinuous-v0": gym_case("MountainCarContinuous-v0", max_episode_steps=80),
    "FrozenLake-v1": gym_case("FrozenLake-v1"),
    "Taxi-v4": gym_case("Taxi-v4", max_episode_steps=50),
    "LunarLander-v3": gym_case("LunarLander-v3", max_episode_steps=100),
    "nested": custom_case(NestedSpaceEnv),
    "sparse-info": custom_case(SparseInfoEnv),
    "mixed-obs": custom_case(MixedObsEnv),
}


def masked_reset(fleet, sync, mask: np.ndarray, seed: int | None, where: str) -> None:
    """Reset the envs in ``mask`` on both and compare (each gets its own options dict)."""
    got = fleet.reset(seed=seed, options={"reset_mask": mask.copy()})
    want = sync.reset(seed=seed, options={"reset_mask": mask.copy()})
    assert_same(got, want, where)


def run_lockstep(fleet, sync, *, steps: int, seed: int, mid_episode_resets=None) -> dict[str, int]:
    """Drive ``fleet`` and ``sync`` with the same seeds and actions, comparing every result.

    Returns counts of what the run exercised (episode ends, infos seen, masked resets).
    """
    mode = sync.metadata["autoreset_mode"]
    assert fleet.metadata["autoreset_mode"] is mode
    actions_space = batch_space(sync.single_action_space, sync.num_envs)
    actions_space.seed(seed + 1)
    seen = {"ended": 0, "info_steps": 0, "masked_resets": 0, "final_obs": 0}

    assert_same(fleet.reset(seed=seed), sync.reset(seed=seed), "reset")
    for t in range(steps):
        actions = actions_space.sample()
        got = fleet.step(deepcopy(actions))
        want = sync.step(deepcopy(actions))
        assert_same(got, want, f"step {t}")
        ended = want[2] | want[3]
        seen["ended"] += int(ended.sum())
        seen["info_steps"] += bool(want[4])
        seen["final_obs"] += int(want[4].get("_final_obs", np.zeros(1, bool)).sum())
        if mode is AutoresetMode.DISABLED and ended.any():
            # Alternate unseeded and seeded resets of the envs that ended.
            masked_reset(fleet, sync, ended, None if t % 2 else t, f"reset of ended envs at {t}")
            seen["masked_resets"] += 1
        if mid_episode_resets and t in mid_episode_resets:
            mask, reset_seed = mid_episode_resets[t]
            masked_reset(fleet, sync, mask, reset_seed, f"mid-episode reset at {t}")
            seen["masked_resets"] += 1
    return seen


# Every case in every mode with several worker counts on serial (the reference's own loop) and
# processes (the default backend), the latter also with its defaults (a worker per core, no
# env in the driver) and the opt-in share (the driver steps the first envs). The others run a
# representative subset, LIGHT_CASES: threads and the toy transport share the round driver
# that processes runs the whole matrix through, and spawned interpreters and Ray actors start
# each worker as a new process, slow on the 2-core machine.
def worker_layouts(backend) -> list[dict[str, Any]]:
    extra = [{}, {"num_workers": 2, "driver_envs": 2}] if backend.id == "processes" else []
    return [{"num_workers": w} for w in WORKERS] + extra


# Every env case in NEXT_STEP mode; every mode for the cases with nested spaces and sparse
# infos of many types (what the workers send back besides the rows); one worker, one per env
# and the default.
LIGHT_CASES = [(case, AutoresetMode.NEXT_STEP, {"num_workers": 2}) for case in ENV_CASES] + [
    (case, mode, {"num_workers": 2})
    for case in ("nested", "sparse-info")
    for mode in (AutoresetMode.SAME_STEP, AutoresetMode.DISABLED)
]
LIGHT_CASES += [
    ("CartPole-v1", AutoresetMode.SAME_STEP, {"num_workers": 1}),
    ("nested", AutoresetMode.NEXT_STEP, {"num_workers": NUM_ENVS}),
    ("sparse-info", AutoresetMode.DISABLED, {}),
]


FULL_MATRIX = ("serial", "processes")


def differential_cases(backend) -> list[tuple[str, AutoresetMode, dict[str, Any]]]:
    if backend.id not in FULL_MATRIX:
        return LIGHT_CASES
    return [(c, m, lay) for c in ENV_CASES for m in MODES for lay in worker_layouts(backend)]


@pytest.mark.per_backend("case, mode, layout", differential_cases)
def test_matches_sync_vector_env(make_env, case, backend, layout, mode):
    env, env_kwargs, sync_fns = ENV_CASES[case]
    fleet = make_env(
        env, NUM_ENVS, autoreset_mode=mode, env_kwargs=env_kwargs, **backend.with_layout(layout)
    )
    sync = SyncVectorEnv(sync_fns(NUM_ENVS), autoreset_mode=mode)
    try:
        if "num_workers" in layout:
            assert fleet.num_workers == layout["num_workers"]
        assert fleet.single_observation_space == sync.single_observation_space
        assert fleet.single_action_space == sync.single_action_space
        assert fleet.observation_space == sync.observation_space
        assert fleet.action_space == sync.action_space
        seen = run_lockstep(
            fleet, sync, steps=STEPS, seed=17, mid_episode_resets=MID_EPISODE_RESETS
        )
    finally:
        sync.close()
    # The run must have exercised episode ends (autoreset or masked reset) and masked resets.
    assert seen["ended"] > 0
    assert seen["masked_resets"] >= len(MID_EPISODE_RESETS)
    if mode is AutoresetMode.SAME_STEP:
        assert seen["final_obs"] == seen["ended"]
    if case == "sparse-info":
        assert seen["info_steps"] > 0


# Without the C step path (envfleet._core.native): every case and mode on the serial backend and
# on the processes backend's default layout (a worker per core), through the Python twins of
# the C functions, and the opt-in share (the driver steps two envs) in NEXT_STEP mode. The
# tests above run with it, where it is built.
def python_path_cases(backend) -> list[tuple[str, AutoresetMode, dict[str, Any]]]:
    layout = {"num_workers": 2} if backend.id == "serial" else {}
    cases = [(c, m, layout) for c in ENV_CASES for m in MODES]
    if backend.id == "processes":
        share = {"num_workers": 1, "backend": envfleet.Processes(driver_envs=2)}
        cases += [(c, AutoresetMode.NEXT_STEP, share) for c in ENV_CASES]
    return cases


@pytest.mark.backends("serial", "processes")
@pytest.mark.per_backend("case, mode, layout", python_path_cases)
def test_python_step_path_matches_sync_vector_env(
    make_env, monkeypatch, case, backend, layout, mode
):
    monkeypatch.setattr(envfleet._core.native, "speedups", None)
    monkeypatch.setenv("ENVFLEET_NO_SPEEDUPS", "1")
    test_matches_sync_vector_env(make_env, case, backend, layout, mode)


def test_masked_reset_mid_episode_next_step(make_env, backend):
    """A masked reset mid-episode in NEXT_STEP mode, also of an env waiting for its autoreset."""
    fleet = make_env(SparseInfoEnv, 4, **backend.options, num_workers=2)
    sync = SyncVectorEnv(sync_factories(SparseInfoEnv, 4))
    assert_same(fleet.reset(seed=3), sync.reset(seed=3), "reset")
    rng = np.random.default_rng(0)
    resets_of_ended = 0
    for t in range(120):
        actions = rng.integers(0, 3, size=4)
        want = sync.step(actions.copy())
        assert_same(fleet.step(actions.copy()), want, f"step {t}")
        ended = want[2] | want[3]
        if t % 3 == 0:
            # Reset env 1 and whichever envs just ended, except env 3: it autoresets itself.
            mask = ended.copy()
            mask[1] = True
            mask[3] = False
            resets_of_ended += int(ended[[0, 2]].any())
            masked_reset(fleet, sync, mask, t if t % 2 else None, f"masked reset at {t}")
    sync.close()
    assert resets_of_ended > 0  # the masked resets also cleared pending autoresets


def test_reset_with_list_of_seeds(make_env, backend):
    fleet = make_env("CartPole-v1", 4, **backend.options, num_workers=2)
    sync = SyncVectorEnv([lambda: gym.make("CartPole-v1")] * 4)
    seeds = [11, 5, 11, 2**31]
    assert_same(fleet.reset(seed=seeds), sync.reset(seed=list(seeds)), "reset")
    assert fleet.np_random_seed == tuple(seeds)
    # Envs 0 and 2 share a seed, so they start in the same state.
    obs, _ = fleet.reset(seed=seeds)
    np.testing.assert_array_equal(obs[0], obs[2])
    assert not np.array_equal(obs[0], obs[1])
    actions = np.array([0, 1, 1, 0])
    assert_same(fleet.step(actions), sync.step(actions), "step after list reset")
    sync.close()


def test_reset_with_some_seeds_none(make_env, backend):
    fleet = make_env("CartPole-v1", 3, **backend.options, num_workers=3)
    sync = SyncVectorEnv([lambda: gym.make("CartPole-v1")] * 3)
    obs, info = fleet.reset(seed=[7, None, 9])
    want_obs, want_info = sync.reset(seed=[7, None, 9])
    np.testing.assert_array_equal(obs[[0, 2]], want_obs[[0, 2]])
    assert info == want_info == {}
    seeds = fleet.np_random_seed
    assert (seeds[0], seeds[2]) == (7, 9)
    assert seeds[1] not in (7, 9)
    sync.close()


@pytest.mark.parametrize("env", ["CartPole-v1", NestedSpaceEnv], ids=["CartPole", "nested"])
def test_reset_seed_none_structure(make_env, backend, env):
    """seed=None is random: only the structure can be compared with SyncVectorEnv."""
    fleet = make_env(env, 4, **backend.options, num_workers=2)
    fns = [lambda: gym.make(env)] * 4 if isinstance(env, str) else sync_factories(env, 4)
    sync = SyncVectorEnv(fns)
    obs, info = fleet.reset(seed=None)
    want_obs, want_info = sync.reset(seed=None)
    assert fleet.observation_space.contains(obs)
    assert gym.vector.utils.batch_space(fleet.single_observation_space, 4) == sync.observation_space
    _assert_same_structure(obs, want_obs)
    assert set(info) == set(want_info)
    # Each env drew its own seed: the workers do not share one random state.
    seeds = fleet.np_random_seed
    assert len(set(seeds)) == 4
    obs, *_ = fleet.step(fleet.action_space.sample())
    assert fleet.observation_space.contains(obs)
    sync.close()


def _assert_same_structure(got: Any, want: Any) -> None:
    assert type(got) is type(want)
    if isinstance(want, dict):
        assert list(got) == list(want)
        for key in want:
            _assert_same_structure(got[key], want[key])
    elif isinstance(want, tuple):
        assert len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            _assert_same_structure(g, w)
    else:
        assert got.shape == want.shape and got.dtype == want.dtype


def test_copy_false_returns_views_copy_true_does_not(make_env, backend):
    views = make_env("CartPole-v1", 3, **backend.options, num_workers=2, copy=False)
    copies = make_env("CartPole-v1", 3, **backend.options, num_workers=2, copy=True)
    left, right = np.zeros(3, np.int64), np.ones(3, np.int64)

    obs_reset, _ = views.reset(seed=0)
    obs1, rew1, term1, trunc1, _ = views.step(left)
    saved = obs1.copy()
    obs2, rew2, term2, trunc2, _ = views.step(right)
    # The first step's observation is a view: it now shows the second step's.
    assert not np.array_equal(obs1, saved)
    np.testing.assert_array_equal(obs1, obs2)
    np.testing.assert_array_equal(obs_reset, obs2)
    for first, second in [(obs1, obs2), (rew1, rew2), (term1, term2), (trunc1, trunc2)]:
        assert np.shares_memory(first, second)

    c_reset, _ = copies.reset(seed=0)
    c_obs1, c_rew1, c_term1, c_trunc1, _ = copies.step(left)
    c_saved = c_obs1.copy()
    c_obs2, c_rew2, c_term2, c_trunc2, _ = copies.step(right)
    np.testing.assert_array_equal(c_obs1, c_saved)
    np.testing.assert_array_equal(c_obs1, saved)  # same seeds and actions as the views run
    np.testing.assert_array_equal(c_obs2, obs2)
    assert not np.array_equal(c_reset, c_obs2)
    for first, second in [(c_obs1, c_obs2), (c_rew1, c_rew2), (c_term1, c_term2)]:
        assert not np.shares_memory(first, second)
    assert not np.shares_memory(c_trunc1, c_trunc2)


def test_copy_false_nested_views(make_env, backend):
    fleet = make_env(NestedSpaceEnv, 3, **backend.options, num_workers=3, copy=False)
    sync = SyncVectorEnv(sync_factories(NestedSpaceEnv, 3), copy=False)
    space = batch_space(sync.single_action_space, 3)
    space.seed(0)
    fleet.reset(seed=1)
    sync.reset(seed=1)
    a1, a2 = space.sample(), space.sample()
    first = fleet.step(deepcopy(a1))[0]
    sync.step(deepcopy(a1))
    second = fleet.step(deepcopy(a2))[0]
    want = sync.step(deepcopy(a2))[0]
    assert_same(first, want, "first step's view after the second step")
    assert_same(second, want, "second step")
    sync.close()


CONTEXT_CASES = [
    ("fork", "CartPole-v1"),
    ("spawn", "CartPole-v1"),
    ("forkserver", "CartPole-v1"),
    ("spawn", "sparse-info"),
    ("forkserver", "nested"),
]


@pytest.mark.parametrize(("context", "case"), CONTEXT_CASES)
def test_start_methods(make_env, context, case):
    env, env_kwargs, sync_fns = ENV_CASES[case]
    mode = AutoresetMode.SAME_STEP if case == "sparse-info" else AutoresetMode.NEXT_STEP
    fleet = make_env(
        env,
        4,
        backend=envfleet.Processes(context=context),
        num_workers=2,
        env_kwargs=env_kwargs,
        autoreset_mode=mode,
    )
    sync = SyncVectorEnv(sync_fns(4), autoreset_mode=mode)
    seen = run_lockstep(fleet, sync, steps=100, seed=5)
    sync.close()
    assert seen["ended"] > 0
    assert fleet.get_attr("spec")[0] == sync.get_attr("spec")[0]


def pong_modes(backend) -> list[AutoresetMode]:
    return [AutoresetMode.NEXT_STEP, AutoresetMode.SAME_STEP][: 2 if backend.cheap else 1]


@pytest.mark.atari
@pytest.mark.per_backend("mode", pong_modes)
def test_atari_pong(make_env, backend, mode):
    ale_py = pytest.importorskip("ale_py")
    gym.register_envs(ale_py)
    fleet = make_env("ALE/Pong-v5", 2, **backend.options, num_workers=2, autoreset_mode=mode)
    sync = SyncVectorEnv([lambda: gym.make("ALE/Pong-v5")] * 2, autoreset_mode=mode)
    assert fleet.single_observation_space.shape == (210, 160, 3)
    seen = run_lockstep(fleet, sync, steps=50, seed=0)
    assert seen["info_steps"] == 50
    sync.close()


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
def test_car_racing_on_threads(make_env, mode):
    """Issue 17 item 8: CarRacing-v3 on threads differed from SyncVectorEnv from the first
    reset: SDL2_gfx's polygon fill (pygame.gfxdraw), called in every step and reset, is not
    thread-safe; the threads backend now serializes it (threads.serialize_gfxdraw)."""
    fleet = make_env("CarRacing-v3", 3, backend="threads", num_workers=3, autoreset_mode=mode)
    sync = SyncVectorEnv([lambda: gym.make("CarRacing-v3")] * 3, autoreset_mode=mode)
    run_lockstep(fleet, sync, steps=25, seed=0)
    sync.close()


@st.composite
def layouts(draw, max_envs, driver_share=False):
    num_envs = draw(st.integers(1, max_envs))
    driver_envs = draw(st.integers(0, num_envs - 1)) if driver_share else None
    num_workers = draw(st.integers(1, num_envs - (driver_envs or 0)))
    mode = draw(st.sampled_from(MODES))
    seed = draw(st.integers(0, 2**31 - 1))
    return (
        num_envs,
        {"num_workers": num_workers, "driver_envs": driver_envs},
        mode,
        seed,
    )


def _check_layout(backend, num_envs, layout, mode, seed):
    driver_envs = layout.pop("driver_envs")
    if driver_envs is not None:  # the processes backend's opt-in share
        backend = envfleet.Processes(driver_envs=driver_envs)
    fleet = envfleet.make(SparseInfoEnv, num_envs, backend=backend, autoreset_mode=mode, **layout)
    sync = SyncVectorEnv(sync_factories(SparseInfoEnv, num_envs), autoreset_mode=mode)
    try:
        assert fleet.get_attr("env_index") == tuple(range(num_envs))
        run_lockstep(fleet, sync, steps=40, seed=seed)
    finally:
        fleet.close()
        sync.close()


@settings(
    max_examples=40, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow]
)
@given(layouts(max_envs=12))
def test_any_layout_serial(layout):
    _check_layout("serial", *layout)


@settings(
    max_examples=10, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow]
)
@given(layouts(max_envs=7, driver_share=True))
def test_any_layout_processes(layout):
    _check_layout("processes", *layout)


@pytest.mark.parametrize(
    "forms",
    [
        ("float32",),
        ("float32", "float32-strided"),
        ("float32", "float32", "float32-fortran"),
        ("float32", "float64"),
        ("int32",),
        ("float32", "float32-subclass"),
        ("float32", "float32-swapped"),
    ],
)
@pytest.mark.backends("serial", "processes")
def test_observation_forms_match_sync_vector_env(make_env, backend, forms, step_path):
    """Groups whose observations are all C-contiguous arrays of the buffer's dtype write them
    as joined bytes (memcpy'd, with the C step path); a strided, Fortran-ordered, subclassed,
    byte-swapped, float64 or int32 observation in the group sends it to numpy's copy (which
    casts). Both give SyncVectorEnv's bytes."""
    factory = functools.partial(FormObsEnv, forms=forms)
    sync = SyncVectorEnv(sync_factories(factory, 6))
    fleet = make_env(factory, 6, **backend.options, num_workers=2)
    assert_same(fleet.reset(seed=3), sync.reset(seed=3))
    for t in range(20):
        actions = np.array([(t + i) % 2 for i in range(6)])
        assert_same(fleet.step(actions), sync.step(actions))


def test_contiguous_observations_are_written_without_numpy(make_env, monkeypatch, step_path):
    """The joined-bytes write (or its C twin) really runs for C-contiguous observations of the
    buffer's dtype (CartPole's): with numpy's concatenate and stack made to fail, stepping
    still matches."""
    sync = SyncVectorEnv([lambda: gym.make("CartPole-v1")] * 4)
    fleet = make_env("CartPole-v1", 4, backend="serial")
    assert_same(fleet.reset(seed=0), sync.reset(seed=0))

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("numpy wrote the observations")

    monkeypatch.setattr(np, "concatenate", refuse)
    monkeypatch.setattr(np, "stack", refuse)
    for t in range(30):
        actions = np.array([(t * i) % 2 for i in range(4)])
        fleet_result = fleet.step(actions)
        monkeypatch.undo()  # SyncVectorEnv writes its observations with numpy
        assert_same(fleet_result, sync.step(actions))
        monkeypatch.setattr(np, "concatenate", refuse)
        monkeypatch.setattr(np, "stack", refuse)


def test_large_observation_rows_are_copied_once(make_env, monkeypatch, step_path):
    """Rows larger than JOIN_MAX_BYTES (Atari frames) are copied once, where the join would
    copy them twice: by the C write_rows on the C step path, else by np.concatenate; the
    results are the same."""
    monkeypatch.setattr(envfleet._core.rows, "JOIN_MAX_BYTES", 4 * 4 * 4 - 1)  # 4 CartPole rows
    speedups = envfleet._core.native.speedups
    sync = SyncVectorEnv([lambda: gym.make("CartPole-v1")] * 4)
    fleet = make_env("CartPole-v1", 4, backend="serial")
    calls = []
    concatenate = np.concatenate

    def counted(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("out") is not None:  # a write into the rows (numpy's own calls: not)
            calls.append(1)
        return concatenate(*args, **kwargs)

    assert_same(fleet.reset(seed=0), sync.reset(seed=0))
    rows_before = 0 if speedups is None else speedups.counters()["write_rows"]
    for t in range(10):
        actions = np.array([(t * i) % 2 for i in range(4)])
        monkeypatch.setattr(np, "concatenate", counted)
        fleet_result = fleet.step(actions)
        monkeypatch.setattr(np, "concatenate", concatenate)
        assert_same(fleet_result, sync.step(actions))
    if step_path == "c":
        assert speedups.counters()["write_rows"] - rows_before == 10
        assert calls == []
    else:
        assert len(calls) == 10


def test_wrong_observation_shape_raises_as_sync_vector_env(make_env, backend):
    """An observation of the wrong shape is refused, as SyncVectorEnv's np.stack refuses it,
    whatever fast path writes the observations; the error names the env."""
    factory = functools.partial(MixedObsEnv, bad_shape_at=3)
    sync = SyncVectorEnv(sync_factories(factory, 4))
    fleet = make_env(factory, 4, **backend.options)
    sync.reset(seed=0)
    fleet.reset(seed=0)
    actions = np.zeros(4, dtype=np.int64)
    for _ in range(2):
        assert_same(fleet.step(actions), sync.step(actions))
    with pytest.raises(ValueError):
        sync.step(actions)
    with pytest.raises(envfleet.EnvError) as info:
        fleet.step(actions)
    # The first env whose observation does not fit is named (one that just autoreset fits).
    assert info.value.env_index in range(4)
    assert "step (observation)" in str(info.value)
