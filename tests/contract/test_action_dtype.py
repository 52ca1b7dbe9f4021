"""Each env gets its action in the caller's dtype, as gymnasium's vector envs hand it.

gymnasium's ``SyncVectorEnv`` and ``AsyncVectorEnv`` iterate over the caller's batched actions,
so a float64 action for a float32 Box reaches the env as float64; envfleet's shared action
buffer holds the space's dtype, and a leaf of another dtype travels with the step command
(``FleetVectorEnv.step``). Bit-identical to ``SyncVectorEnv`` on every backend, with a real env
(Pendulum-v1 computes in float64 from the action it is handed) and with nested and side
leaves; the fast step round still runs for actions of the space's own dtype.
"""

from __future__ import annotations

import functools
from copy import deepcopy

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.vector import AutoresetMode, SyncVectorEnv

import envfleet
import envfleet._core.native
from tests.envs import ActionDtypeEnv, sync_factories
from tests.helpers import assert_same

NUM_ENVS = 4


def float64_actions(space: gym.Space, rng: np.random.Generator) -> object:
    """A batch of actions of ``space`` whose Box leaves are float64 (not the space's float32)
    and whose Discrete leaves are int32 (not int64)."""
    if isinstance(space, gym.spaces.Dict):
        return {key: float64_actions(sub, rng) for key, sub in space.spaces.items()}
    if isinstance(space, gym.spaces.Box):
        return rng.uniform(-1.0, 1.0, space.shape)  # float64, with bits float32 cannot hold
    if isinstance(space, gym.spaces.MultiDiscrete):  # a batch of Discrete
        return rng.integers(0, space.nvec).astype(np.int32)
    assert isinstance(space, gym.spaces.Tuple)  # a batch of Text
    return tuple("abcd"[: 1 + int(k)] for k in rng.integers(0, 4, len(space.spaces)))


def lockstep(fleet, sync, steps: int, seed: int) -> int:
    """Step both with the same float64 batches; every result bit for bit. Returns the number of
    info dicts compared that name the leaves' dtypes."""
    rng = np.random.default_rng(seed)
    assert_same(fleet.reset(seed=seed), sync.reset(seed=seed), "reset")
    named = 0
    for t in range(steps):
        actions = float64_actions(sync.action_space, rng)
        got = fleet.step(deepcopy(actions))
        want = sync.step(deepcopy(actions))
        assert_same(got, want, f"step {t}")
        named += "move" in want[4]
    return named


def handed(info: dict) -> set[str]:
    """What the envs that stepped were handed (an env autoresetting this step reports none)."""
    return set(info["move"][info["_move"]].tolist())


def cases(backend):
    kinds = ["box", "dict", "side"] if backend.cheap else ["dict"]
    return [(kind, {"num_workers": 2}) for kind in kinds]


@pytest.mark.per_backend("kind, layout", cases)
def test_actions_reach_the_env_in_the_callers_dtype(make_env, backend, kind, layout):
    factory = functools.partial(ActionDtypeEnv, kind)
    fleet = make_env(factory, NUM_ENVS, **backend.options, **layout)
    sync = SyncVectorEnv(sync_factories(factory, NUM_ENVS))
    try:
        named = lockstep(fleet, sync, steps=30, seed=3)
    finally:
        sync.close()
    assert named > 0
    # The info says what the env got: float64 for the Box leaf, whatever the space's dtype.
    _, _, _, _, info = fleet.step(float64_actions(sync.action_space, np.random.default_rng(0)))
    assert handed(info) == {"ndarray:float64"}


@pytest.mark.parametrize("mode", list(AutoresetMode))
def test_pendulum_with_float64_actions_matches_sync(make_env, backend, mode):
    """Pendulum-v1's float32 Box action, stepped with a float64 policy's output: the env
    computes in float64 from what it is handed, so a cast in between changes the bits."""
    fleet = make_env("Pendulum-v1", NUM_ENVS, **backend.options, autoreset_mode=mode)
    sync = SyncVectorEnv([lambda: gym.make("Pendulum-v1")] * NUM_ENVS, autoreset_mode=mode)
    rng = np.random.default_rng(5)
    try:
        assert_same(fleet.reset(seed=11), sync.reset(seed=11), "reset")
        for t in range(220):  # past the 200-step time limit: autoreset in each mode
            actions = rng.uniform(-2.0, 2.0, (NUM_ENVS, 1))
            assert_same(fleet.step(actions.copy()), sync.step(actions.copy()), f"step {t}")
            if mode is AutoresetMode.DISABLED and t == 199:
                mask = np.ones(NUM_ENVS, dtype=bool)
                assert_same(
                    fleet.reset(options={"reset_mask": mask}),
                    sync.reset(options={"reset_mask": mask}),
                    "reset after the time limit",
                )
    finally:
        sync.close()


@pytest.mark.backends("processes")
def test_the_fast_step_round_runs_for_the_spaces_own_dtype(make_env, backend):
    """Actions of the space's dtype take the C step round (its counter advances once a step);
    another dtype travels with the step command instead, and the results stay exact."""
    speedups = envfleet._core.native.speedups
    if speedups is None:
        pytest.skip("envfleet._core._speedups is not built here")
    fleet = make_env(functools.partial(ActionDtypeEnv, "box"), NUM_ENVS, **backend.options)
    fleet.reset(seed=0)
    before = speedups.counters()["full_round"]
    for _ in range(5):
        _, _, _, _, info = fleet.step(np.zeros((NUM_ENVS, 2), dtype=np.float32))
        assert handed(info) == {"ndarray:float32"}
    assert speedups.counters()["full_round"] - before == 5
    before = speedups.counters()["full_round"]
    _, _, _, _, info = fleet.step(np.zeros((NUM_ENVS, 2)))
    assert handed(info) == {"ndarray:float64"}
    assert speedups.counters()["full_round"] == before
    # Back to the space's dtype: the buffer alone again, on the fast round.
    _, _, _, _, info = fleet.step(np.zeros((NUM_ENVS, 2), dtype=np.float32))
    assert handed(info) == {"ndarray:float32"}
    assert speedups.counters()["full_round"] - before == 1


@pytest.mark.backends("serial", "processes")
def test_the_pool_casts_to_the_spaces_dtype_as_envpool_does(make_env, backend):
    """A first-ready pool's ``send`` writes EnvPool's way: into the space's dtype."""
    factory = functools.partial(ActionDtypeEnv, "box")
    fleet = make_env(factory, NUM_ENVS, **backend.options, batch_size=2)
    fleet.async_reset(seed=0)
    checked = 0
    for _ in range(6):
        _, _, _, _, info = fleet.recv()
        ids = info["env_id"]
        if "move" in info:  # a step's info (a reset's has none)
            assert handed(info) == {"ndarray:float32"}
            checked += 1
        fleet.send(np.zeros((len(ids), 2)), ids)  # float64 actions
    assert checked > 0
