"""Issue 17, items 10 and 15: spaces without a fixed size, and observation_mode.

Observation leaves without a fixed size (Text, Graph, Sequence, OneOf, custom Space
subclasses) travel beside the shared buffers; every backend must return what
gymnasium.vector.SyncVectorEnv returns for the same seeds and actions.
"""

from __future__ import annotations

import collections
import functools

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.vector import AutoresetMode, SyncVectorEnv
from gymnasium.vector.utils import batch_space, concatenate, create_empty_array

import envfleet
import envfleet._core.native
from tests.contract.test_differential import run_lockstep
from tests.envs import BoundsEnv, ReusedGraphEnv, SideActionEnv, SideObsEnv, sync_factories
from tests.helpers import assert_same

NUM_ENVS = 4
STEPS = 60
KINDS = ["text", "graph", "sequence", "sequence_stack", "oneof", "dict_text_box", "custom"]
MID_RESETS = {20: (np.array([True, False, True, False]), 99)}


def check_side_kind(make_env, kind, options, mode, **layout):
    factory = functools.partial(SideObsEnv, kind)
    fleet = make_env(factory, NUM_ENVS, autoreset_mode=mode, **{**options, **layout})
    sync = SyncVectorEnv(sync_factories(factory, NUM_ENVS), autoreset_mode=mode)
    try:
        assert fleet.single_observation_space == sync.single_observation_space
        assert fleet.observation_space == sync.observation_space
        seen = run_lockstep(fleet, sync, steps=STEPS, seed=5, mid_episode_resets=MID_RESETS)
    finally:
        sync.close()
    assert seen["ended"] > 0


def side_kind_cases(backend):
    """Every kind on serial; on the other backends the kinds that travel in distinct ways
    (every mode where workers start fast, one representative case elsewhere)."""
    if not backend.cheap:
        return [("dict_text_box", AutoresetMode.SAME_STEP)]
    kinds = (
        KINDS if backend.id == "serial" else ["dict_text_box", "graph", "sequence_stack", "custom"]
    )
    return [(kind, mode) for kind in kinds for mode in AutoresetMode]


@pytest.mark.per_backend("kind, mode", side_kind_cases)
def test_side_spaces_match_sync(make_env, backend, kind, mode):
    check_side_kind(make_env, kind, backend.options, mode, num_workers=2)


@pytest.mark.parametrize("kind", ["text", "oneof"])
def test_side_spaces_processes_driver_share_match_sync(make_env, kind):
    # The driver steps its own block (driver_envs) while the workers step theirs.
    check_side_kind(
        make_env,
        kind,
        {"backend": envfleet.Processes(driver_envs=2)},
        AutoresetMode.NEXT_STEP,
        num_workers=1,
    )


@pytest.mark.backends("serial", "processes")
def test_side_spaces_copy_false_match_sync(make_env, backend):
    factory = functools.partial(SideObsEnv, "dict_text_box")
    fleet = make_env(factory, NUM_ENVS, **backend.options, num_workers=2, copy=False)
    sync = SyncVectorEnv(sync_factories(factory, NUM_ENVS), copy=False)
    try:
        run_lockstep(fleet, sync, steps=STEPS, seed=3)
    finally:
        sync.close()


def test_side_spaces_pool_matches_single_envs(make_env):
    """First-ready pool (NEXT_STEP): each received env's observation and reward are those of
    a lone copy of it driven with the same seed and actions; observations batched by
    gymnasium's concatenate."""
    factory = functools.partial(SideObsEnv, "dict_text_box")
    fleet = make_env(factory, NUM_ENVS, backend="processes", batch_size=2)
    space = fleet.single_observation_space
    refs = [factory(env_index=e) for e in range(NUM_ENVS)]
    obs_of = {e: refs[e].reset(seed=10 + e)[0] for e in range(NUM_ENVS)}
    reward_of = dict.fromkeys(range(NUM_ENVS), 0.0)
    done = dict.fromkeys(range(NUM_ENVS), False)
    rng = np.random.default_rng(0)
    fleet.async_reset(seed=10)
    ended = 0
    for _ in range(40):
        obs, rewards, _, _, info = fleet.recv()
        ids = info["env_id"].tolist()
        want = concatenate(space, [obs_of[e] for e in ids], create_empty_array(space, len(ids)))
        assert_same(obs, want)
        assert rewards.tolist() == [reward_of[e] for e in ids]
        actions = rng.integers(0, 2, len(ids))
        for e, a in zip(ids, actions.tolist(), strict=True):
            if done[e]:  # NEXT_STEP: this action is spent on the reset
                (obs_of[e], _), reward_of[e], done[e] = refs[e].reset(), 0.0, False
            else:
                obs_of[e], reward_of[e], term, trunc, _ = refs[e].step(a)
                done[e] = term or trunc
                ended += done[e]
        fleet.send(actions, ids)
    assert ended > 0


class CountingSpeedups:
    """envfleet._core.native.speedups with a count of the calls of each C function."""

    def __init__(self, module):
        self.module = module
        self.calls: collections.Counter[str] = collections.Counter()

    def __getattr__(self, name):
        attr = getattr(self.module, name)
        if not callable(attr):
            return attr

        def counted(*args, **kwargs):
            self.calls[name] += 1
            return attr(*args, **kwargs)

        return counted


@pytest.mark.parametrize("kind", [None, "dict_text_box"], ids=["cartpole", "side-leaves"])
def test_c_step_path_still_runs(make_env, monkeypatch, kind):
    """The C result write runs for plain spaces (with its joined row write) and for spaces
    with side leaves too (their values are collected after it, in Python)."""
    if envfleet._core.native.speedups is None:
        pytest.skip("envfleet._core._speedups is not built here")
    counting = CountingSpeedups(envfleet._core.native.speedups)
    monkeypatch.setattr(envfleet._core.native, "speedups", counting)
    env = "CartPole-v1" if kind is None else functools.partial(SideObsEnv, kind)
    fleet = make_env(env, NUM_ENVS, backend="serial")
    fleet.reset(seed=0)
    for _ in range(10):
        fleet.step(np.zeros(NUM_ENVS, dtype=np.int64))
    assert counting.calls["write_results"] >= 10
    if kind is None:
        assert counting.calls["write_rows"] >= 10


@pytest.mark.parametrize("kind", [None, "dict_text_box"], ids=["cartpole", "side-leaves"])
def test_c_step_round_still_runs(make_env, monkeypatch, kind):
    """processes: the driver's C step round (one call per step) runs for plain spaces and
    with side-leaf observations (their values come back as a reply to read)."""
    if envfleet._core.native.speedups is None:
        pytest.skip("envfleet._core._speedups is not built here")
    counting = CountingSpeedups(envfleet._core.native.speedups)
    monkeypatch.setattr(envfleet._core.native, "speedups", counting)
    env = "CartPole-v1" if kind is None else functools.partial(SideObsEnv, kind)
    fleet = make_env(env, NUM_ENVS, backend="processes", num_workers=2)
    fleet.reset(seed=0)
    for _ in range(10):
        fleet.step(np.zeros(NUM_ENVS, dtype=np.int64))
    assert counting.calls["full_round"] == 10


@pytest.mark.backends("serial", "processes")
def test_side_spaces_python_step_path_match_sync(make_env, monkeypatch, backend):
    monkeypatch.setattr(envfleet._core.native, "speedups", None)
    monkeypatch.setenv("ENVFLEET_NO_SPEEDUPS", "1")
    check_side_kind(
        make_env, "dict_text_box", backend.options, AutoresetMode.SAME_STEP, num_workers=2
    )


def test_torch_output_refuses_side_leaves(snapshot):
    """Tensors cannot hold strings or graphs: output="torch" refuses such a space with a
    ConfigError naming it, and leaves no worker behind."""
    pytest.importorskip("torch")
    factory = functools.partial(SideObsEnv, "dict_text_box")
    with pytest.raises(envfleet.ConfigError, match="Text"):
        envfleet.make(factory, 2, backend="processes", num_workers=2, output="torch")
    snapshot.assert_nothing_left()


# -- observation_mode (gymnasium 1.4's SyncVectorEnv/AsyncVectorEnv argument) --------------


@pytest.mark.backends("serial", "processes")
def test_observation_mode_same_refuses_differing_spaces(backend, snapshot):
    """The default "same" refuses sub-environments whose spaces differ, with gymnasium's
    error type (RuntimeError), as a typed envfleet error naming the env."""
    with pytest.raises(RuntimeError):
        SyncVectorEnv(sync_factories(BoundsEnv, 3))
    with pytest.raises(envfleet.SpaceMismatchError, match="sub-environment 1") as info:
        envfleet.make(BoundsEnv, 3, **backend.options, num_workers=3)
    assert isinstance(info.value, RuntimeError)
    snapshot.assert_nothing_left()


def test_observation_mode_different_matches_sync(make_env, backend):
    layout = {"num_workers": 2} if backend.workers else {}
    fleet = make_env(BoundsEnv, 3, **backend.options, observation_mode="different", **layout)
    sync = SyncVectorEnv(sync_factories(BoundsEnv, 3), observation_mode="different")
    try:
        assert fleet.observation_mode == "different"
        assert fleet.single_observation_space == sync.single_observation_space
        assert fleet.observation_space == sync.observation_space
        assert fleet.observation_space != batch_space(fleet.single_observation_space, 3)
        run_lockstep(fleet, sync, steps=30, seed=2)
    finally:
        sync.close()


def test_observation_mode_different_cartpole_wrappers(make_env):
    """CartPole copies whose observation bounds are rescaled differently per env."""

    def factory(env_index):
        env = gym.make("CartPole-v1")
        bound = np.float32(10.0 + env_index)
        space = gym.spaces.Box(-bound, bound, (4,), np.float32)
        return gym.wrappers.TransformObservation(env, lambda obs: obs, space)

    fleet = make_env(factory, 3, backend="processes", num_workers=3, observation_mode="different")
    sync = SyncVectorEnv(sync_factories(factory, 3), observation_mode="different")
    try:
        assert fleet.observation_space == sync.observation_space
        run_lockstep(fleet, sync, steps=30, seed=4)
    finally:
        sync.close()


@pytest.mark.backends("serial", "processes")
def test_observation_mode_different_refuses_other_shapes(backend, snapshot):
    """Spaces must still share shape and dtype (gymnasium: ValueError from
    batch_differing_spaces, which runs before its RuntimeError check)."""
    factory = functools.partial(BoundsEnv, grow=True)
    with pytest.raises(ValueError):
        SyncVectorEnv(sync_factories(factory, 2), observation_mode="different")
    with pytest.raises(envfleet.SpaceMismatchError, match="sub-environment 1") as info:
        envfleet.make(factory, 2, **backend.options, num_workers=2, observation_mode="different")
    assert isinstance(info.value, ValueError)
    snapshot.assert_nothing_left()


def test_observation_mode_explicit_spaces(make_env):
    """A (observation_space, single_observation_space) pair is used as given; every env's
    space must share its shape and dtype."""
    single = gym.spaces.Box(-10.0, 10.0, (2,), np.float32)
    batched = batch_space(single, 3)
    fleet = make_env(
        BoundsEnv, 3, backend="processes", num_workers=2, observation_mode=(batched, single)
    )
    sync = SyncVectorEnv(sync_factories(BoundsEnv, 3), observation_mode=(batched, single))
    try:
        assert fleet.single_observation_space is single
        assert fleet.observation_space is batched
        run_lockstep(fleet, sync, steps=20, seed=8)
    finally:
        sync.close()


def test_observation_mode_bad_values_are_refused():
    with pytest.raises(ValueError):
        SyncVectorEnv(sync_factories(BoundsEnv, 2), observation_mode="other")
    with pytest.raises(envfleet.ConfigError, match="observation_mode"):
        envfleet.make(BoundsEnv, 2, backend="serial", observation_mode="other")
    with pytest.raises(TypeError):
        SyncVectorEnv(sync_factories(BoundsEnv, 2), observation_mode=(1, 2))
    with pytest.raises(envfleet.ConfigError, match="observation_mode"):
        envfleet.make(BoundsEnv, 2, backend="serial", observation_mode=(1, 2))


# -- action spaces without a fixed size ------------------------------------------------------


def check_side_actions(make_env, kind, options, mode, steps=40, **layout):
    factory = functools.partial(SideActionEnv, kind)
    fleet = make_env(factory, NUM_ENVS, autoreset_mode=mode, **{**options, **layout})
    sync = SyncVectorEnv(sync_factories(factory, NUM_ENVS), autoreset_mode=mode)
    try:
        assert fleet.action_space == sync.action_space
        seen = run_lockstep(fleet, sync, steps=steps, seed=6, mid_episode_resets=MID_RESETS)
    finally:
        sync.close()
    assert seen["ended"] > 0


def side_action_cases(backend):
    """Every kind and mode where workers start fast (the processes backend also with the
    driver stepping a share); one case elsewhere."""
    if not backend.cheap:
        return [("dict", AutoresetMode.NEXT_STEP, {"num_workers": 2})]
    layouts = [{"num_workers": 2}]
    if backend.id == "processes":
        layouts.append({"num_workers": 1, "backend": envfleet.Processes(driver_envs=2)})
    return [(k, m, lay) for lay in layouts for k in ["text", "dict"] for m in AutoresetMode]


@pytest.mark.per_backend("kind, mode, layout", side_action_cases)
def test_side_actions_match_sync(make_env, backend, layout, kind, mode):
    check_side_actions(make_env, kind, backend.options, mode, **layout)


def test_side_actions_of_the_wrong_length_are_refused(make_env):
    fleet = make_env(functools.partial(SideActionEnv, "text"), 3, backend="processes")
    fleet.reset(seed=0)
    with pytest.raises(envfleet.InvalidActionError, match="3"):
        fleet.step(("a", "b"))
    assert fleet.step(("a", "bb", "ccc"))[1].tolist() == [1.0, 2.0, 3.0]


def test_side_actions_pool_match_single_envs(make_env):
    """First-ready pool: each env steps with the Text/Box action sent to it (as a lone copy
    driven with the same seed and actions does)."""
    factory = functools.partial(SideActionEnv, "dict")
    fleet = make_env(factory, NUM_ENVS, backend="processes", batch_size=2)
    refs = [factory(env_index=e) for e in range(NUM_ENVS)]
    obs_of = {e: refs[e].reset(seed=30 + e)[0] for e in range(NUM_ENVS)}
    done = dict.fromkeys(range(NUM_ENVS), False)
    fleet.async_reset(seed=30)
    ended = 0
    for t in range(40):
        obs, _, _, _, info = fleet.recv()
        ids = info["env_id"].tolist()
        np.testing.assert_array_equal(obs, np.stack([obs_of[e] for e in ids]))
        words = tuple("abcd"[: 1 + (t + e) % 4] for e in ids)
        moves = np.float32([[0.5, 0.25 * e] for e in ids])
        for k, e in enumerate(ids):
            if done[e]:
                obs_of[e], done[e] = refs[e].reset()[0], False
            else:
                obs_of[e], _, term, trunc, _ = refs[e].step({"word": words[k], "move": moves[k]})
                done[e] = term or trunc
                ended += done[e]
        fleet.send({"word": words, "move": moves}, ids)
    assert ended > 0


def test_process_env_side_leaves_match_the_env():
    """ProcessEnv unbatches by the space: a Text observation is the env's string, and a Text
    action reaches the env as the str given."""
    factory = functools.partial(SideObsEnv, "dict_text_box")
    ref = factory()
    with envfleet.ProcessEnv(factory) as env:
        assert_same(env.reset(seed=3), ref.reset(seed=3))
        for t in range(30):
            got, want = env.step(t % 2), ref.step(t % 2)
            assert_same(got, want)
            if want[2] or want[3]:
                assert_same(env.reset(seed=t), ref.reset(seed=t))
    factory = functools.partial(SideActionEnv, "text")
    ref = factory()
    with envfleet.ProcessEnv(factory) as env:
        assert_same(env.reset(seed=3), ref.reset(seed=3))
        for word in ["a", "bb", "abc"] * 5:
            got, want = env.step(word), ref.step(word)
            assert_same(got, want)
            if want[2] or want[3]:
                assert_same(env.reset(), ref.reset())


@pytest.mark.parametrize("inference", ["driver", "worker"])
def test_sampler_refuses_side_leaves(inference, snapshot):
    """The Sampler records observations and actions into arrays: spaces with leaves
    without a fixed size are refused with a ConfigError naming them (no process left)."""
    factory = functools.partial(SideObsEnv, "dict_text_box")
    with pytest.raises(envfleet.ConfigError, match="Text"):
        envfleet.Sampler(factory, lambda obs: np.zeros(2, np.int64), 2, inference=inference)
    snapshot.assert_nothing_left()


@pytest.mark.backends("serial", "threads", "processes")
@pytest.mark.per_backend(
    "fail", lambda backend: ["raise", "exit"] if backend.workers == "processes" else ["raise"]
)
def test_side_leaves_after_restarts(make_env, backend, fail):
    """With a restart policy, a rebuilt env (or a respawned worker's envs) reports its new
    observation at the side leaves too: every row is each env's latest observation."""
    factory = functools.partial(SideObsEnv, "dict_text_box", fail=fail, fail_index=2)
    fleet = make_env(
        factory,
        NUM_ENVS,
        **backend.options,
        num_workers=2,
        supervision=envfleet.Supervision(
            restart_policy=envfleet.RestartPolicy(
                restart_on=(Exception,), max_restarts=100, window_s=60.0
            )
        ),
    )
    space = fleet.single_observation_space

    def check(obs):
        latest = fleet.get_attr("last_obs")
        assert_same(obs, concatenate(space, latest, create_empty_array(space, NUM_ENVS)))

    check(fleet.reset(seed=1)[0])
    restarted = 0
    for _ in range(30):
        obs, _, _, _, info = fleet.step(np.zeros(NUM_ENVS, dtype=np.int64))
        restarted += int(info.get("_env_restarted", np.zeros(1, bool)).sum())
        check(obs)
    assert restarted > 0


@pytest.mark.backends("serial", "threads", "processes")
def test_side_leaves_copy_true_results_are_the_callers(make_env, backend):
    """copy=True: as SyncVectorEnv's deepcopy, a result's side-leaf values do not change when
    the env rewrites the objects it returned."""
    fleet = make_env(ReusedGraphEnv, 2, **backend.options, num_workers=2)
    sync = SyncVectorEnv(sync_factories(ReusedGraphEnv, 2))
    try:
        got_first, want_first = fleet.reset(seed=0)[0], sync.reset(seed=0)[0]
        kept = [g.nodes.copy() for g in got_first]
        for _ in range(3):
            assert_same(fleet.step(np.zeros(2, np.int64)), sync.step(np.zeros(2, np.int64)))
        assert_same(got_first, want_first)
        for graph, nodes in zip(got_first, kept, strict=True):
            np.testing.assert_array_equal(graph.nodes, nodes)
    finally:
        sync.close()


@pytest.mark.backends("serial", "processes")
def test_observation_mode_different_survives_restarts(make_env, backend):
    """A rebuilt env's space is checked as at start: with "different", same shape and dtype
    (its bounds differ from env 0's)."""
    factory = functools.partial(BoundsEnv, fail_step=3)
    fleet = make_env(
        factory,
        3,
        **backend.options,
        num_workers=3,
        observation_mode="different",
        supervision=envfleet.Supervision(
            restart_policy=envfleet.RestartPolicy(
                restart_on=(Exception,), max_restarts=10, window_s=60.0
            )
        ),
    )
    fleet.reset(seed=0)
    restarted = 0
    for _ in range(8):
        *_, info = fleet.step(np.zeros(3, dtype=np.int64))
        restarted += int(info.get("_env_restarted", np.zeros(1, bool)).sum())
    assert restarted >= 2
