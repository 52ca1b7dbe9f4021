"""Issue 17, items 10 and 15: spaces without a fixed size, and observation_mode.

Observation leaves without a fixed size (Text, Graph, Sequence, OneOf, custom Space
subclasses) travel beside the shared buffers; every backend must return what
gymnasium.vector.SyncVectorEnv returns for the same seeds and actions.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
from gymnasium.vector import AutoresetMode, SyncVectorEnv
from gymnasium.vector.utils import concatenate, create_empty_array

from tests.envs import SideObsEnv, sync_factories
from tests.helpers import assert_same
from tests.test_differential import run_lockstep

NUM_ENVS = 4
STEPS = 60
KINDS = ["text", "graph", "sequence", "sequence_stack", "oneof", "dict_text_box", "custom"]
MID_RESETS = {20: (np.array([True, False, True, False]), 99)}


def check_side_kind(make_env, kind, backend, mode, **layout):
    factory = functools.partial(SideObsEnv, kind)
    fleet = make_env(factory, NUM_ENVS, backend=backend, autoreset_mode=mode, **layout)
    sync = SyncVectorEnv(sync_factories(factory, NUM_ENVS), autoreset_mode=mode)
    try:
        assert fleet.single_observation_space == sync.single_observation_space
        assert fleet.observation_space == sync.observation_space
        seen = run_lockstep(fleet, sync, steps=STEPS, seed=5, mid_episode_resets=MID_RESETS)
    finally:
        sync.close()
    assert seen["ended"] > 0


@pytest.mark.parametrize("mode", list(AutoresetMode), ids=lambda m: m.value)
@pytest.mark.parametrize("kind", KINDS)
def test_side_spaces_serial_match_sync(make_env, kind, mode):
    check_side_kind(make_env, kind, "serial", mode, num_workers=2)


@pytest.mark.parametrize("mode", list(AutoresetMode), ids=lambda m: m.value)
@pytest.mark.parametrize("kind", ["dict_text_box", "graph", "sequence_stack", "custom"])
@pytest.mark.parametrize("backend", ["threads", "processes"])
def test_side_spaces_other_backends_match_sync(make_env, backend, kind, mode):
    check_side_kind(make_env, kind, backend, mode, num_workers=2)


@pytest.mark.parametrize("kind", ["text", "oneof"])
def test_side_spaces_processes_driver_share_match_sync(make_env, kind):
    # The driver steps its own block (driver_envs) while the workers step theirs.
    check_side_kind(
        make_env, kind, "processes", AutoresetMode.NEXT_STEP, num_workers=1, driver_envs=2
    )


def test_side_spaces_ray_match_sync(make_env):
    check_side_kind(make_env, "dict_text_box", "ray", AutoresetMode.SAME_STEP, num_workers=2)


@pytest.mark.parametrize("backend", ["serial", "processes"])
def test_side_spaces_copy_false_match_sync(make_env, backend):
    factory = functools.partial(SideObsEnv, "dict_text_box")
    fleet = make_env(factory, NUM_ENVS, backend=backend, num_workers=2, copy=False)
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
