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

from tests.envs import SideObsEnv, sync_factories
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
