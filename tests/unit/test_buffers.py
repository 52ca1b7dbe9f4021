"""copy=True results without a copy (envfleet._core.buffers.ObservationSlabs).

With ``copy=True`` a result is the caller's: no later call may change it. The serial, threads
and processes backends keep that promise by handing out arrays over spare observation buffers
that no live result uses, instead of copying. These tests keep results (whole, as views, as
torch tensors, one leaf of a dict) across many later steps and resets and check them, bit for
bit, against SyncVectorEnv's copies; and they check that the spare buffers are really used.
"""

from __future__ import annotations

import gc
from copy import deepcopy
from typing import Any

import gymnasium as gym
import numpy as np
import pytest
import torch
from gymnasium.vector import AutoresetMode, SyncVectorEnv
from gymnasium.vector.utils import batch_space

import envfleet
import envfleet._front.results
from tests.envs import NestedSpaceEnv, sync_factories
from tests.helpers import assert_same

BACKENDS = ["serial", "threads", "processes"]
LAYOUTS = {
    "serial": {},
    "threads": {"num_workers": 2},
    "processes": {"num_workers": 2, "backend": envfleet.Processes(driver_envs=1)},
}
NUM_ENVS = 4


@pytest.fixture(autouse=True)
def spare_slabs_for_small_observations(monkeypatch):
    """The observations here are below SPARE_SLABS_MIN_BYTES, where results are copied by
    default: give them spare slabs anyway (test_slabs_only_where_they_pay checks the rule)."""
    monkeypatch.setattr(envfleet._front.results, "SPARE_SLABS_MIN_BYTES", 0)


class FrameEnv(gym.Env):
    """A 32x32 RGB frame that changes with the action and the seed."""

    observation_space = gym.spaces.Box(0, 255, (32, 32, 3), np.uint8)
    action_space = gym.spaces.Discrete(2)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self._frame = self.np_random.integers(0, 256, (32, 32, 3), dtype=np.uint8)
        return self._frame.copy(), {}

    def step(self, action):
        self._frame = np.roll(self._frame, 1 + int(action), axis=0)
        return self._frame.copy(), 1.0, False, False, {}


def first_leaf(tree: Any) -> np.ndarray:
    while isinstance(tree, (dict, tuple)):
        tree = next(iter(tree.values())) if isinstance(tree, dict) else tree[0]
    return tree


def keep(obs: Any, t: int) -> Any:
    """What a caller might hold on to from step ``t``'s observations (None: nothing)."""
    kind = t % 5
    if kind == 0:
        return obs  # the whole result
    if kind == 1:
        return first_leaf(obs)[1:3]  # a view of some rows of one leaf
    if kind == 2:
        return torch.from_numpy(first_leaf(obs)[0])  # a tensor sharing one row
    if kind == 3:
        return None
    return first_leaf(obs).reshape(-1)  # a reshaped view


def as_numpy(kept: Any) -> Any:
    return kept.numpy() if isinstance(kept, torch.Tensor) else kept


def pair(case: str, backend: str, mode: AutoresetMode) -> tuple[Any, SyncVectorEnv]:
    if case == "CartPole-v1":
        fleet = envfleet.make(
            "CartPole-v1", NUM_ENVS, autoreset_mode=mode, **{"backend": backend, **LAYOUTS[backend]}
        )
        sync = SyncVectorEnv([lambda: gym.make("CartPole-v1")] * NUM_ENVS, autoreset_mode=mode)
    else:
        fleet = envfleet.make(
            NestedSpaceEnv,
            NUM_ENVS,
            autoreset_mode=mode,
            **{"backend": backend, **LAYOUTS[backend]},
        )
        sync = SyncVectorEnv(sync_factories(NestedSpaceEnv, NUM_ENVS), autoreset_mode=mode)
    return fleet, sync


@pytest.mark.parametrize("mode", [AutoresetMode.NEXT_STEP, AutoresetMode.DISABLED], ids=str)
@pytest.mark.parametrize("case", ["CartPole-v1", "nested"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_kept_results_never_change(backend, case, mode):
    """Results held (whole or in part) through later steps and masked resets stay what they
    were: bit-identical to SyncVectorEnv's copies of the same steps.

    Each held piece is checked and let go one to four steps later, so the spare slabs keep
    being freed and reused, with pieces of earlier results still alive in them.
    """
    fleet, sync = pair(case, backend, mode)
    try:
        space = batch_space(sync.single_action_space, NUM_ENVS)
        space.seed(3)
        held: list[tuple[int, str, Any, Any]] = []  # (release step, where, envfleet's, sync's)
        in_slabs = 0  # pieces that were still in a spare slab when let go

        def hold(t: int, where: str, got: Any, want: Any, how: int) -> None:
            piece = keep(got, how)
            if piece is not None:
                held.append((t + 1 + t % 4, where, piece, as_numpy(keep(want, how))))

        obs, _ = fleet.reset(seed=5)
        want, _ = sync.reset(seed=5)
        hold(0, "reset", obs, want, 0)
        for t in range(150):
            actions = space.sample()
            obs, _, terminated, truncated, _ = fleet.step(deepcopy(actions))
            want = sync.step(deepcopy(actions))[0]
            assert_same(obs, want, f"step {t}")
            hold(t, f"step {t}", obs, want, t)
            ended = terminated | truncated
            del obs  # the caller keeps only what it holds
            if t % 30 == 29 or (mode is AutoresetMode.DISABLED and ended.any()):
                mask = ended if ended.any() else np.arange(NUM_ENVS) % 2 == 0
                got, _ = fleet.reset(seed=t, options={"reset_mask": mask.copy()})
                want, _ = sync.reset(seed=t, options={"reset_mask": mask.copy()})
                assert_same(got, want, f"masked reset at {t}")
                hold(t, f"masked reset at {t}", got, want, t + 1)
                del got
            for item in [item for item in held if item[0] <= t]:
                _, where, piece, want = item
                assert_same(as_numpy(piece), want, f"{where}, read at step {t}")
                in_slabs += slab_of(fleet, as_numpy(piece)) in (1, 2)
                held.remove(item)
        for _, where, piece, want in held:
            assert_same(as_numpy(piece), want, f"{where}, read at the end")
        assert in_slabs >= 20, in_slabs  # many held pieces lived in spare slabs, not copies
    finally:
        fleet.close()
        sync.close()


def slab_of(envs: Any, obs: np.ndarray) -> int | None:
    """Which observation slab ``obs`` (a first leaf) lies in (0: the batch's own buffer)."""
    for k, slab in enumerate(envs._backend.batch.observation_slabs):
        if np.shares_memory(obs, first_leaf(slab)):
            return k
    return None


@pytest.mark.parametrize("backend", BACKENDS)
def test_results_are_handed_out_not_copied(make_env, backend):
    envs = make_env("CartPole-v1", NUM_ENVS, **{"backend": backend, **LAYOUTS[backend]})
    actions = np.zeros(NUM_ENVS, np.int64)
    assert len(envs._backend.batch.observation_slabs) == 1 + envfleet._front.results.SPARE_SLABS
    first, _ = envs.reset(seed=0)
    second = envs.step(actions)[0]
    # Both live results lie in spare slabs, different ones.
    assert {slab_of(envs, first), slab_of(envs, second)} == {1, 2}
    # Every spare slab is in use: the next result is a copy of the batch's own buffer.
    third = envs.step(actions)[0]
    assert slab_of(envs, third) is None
    # Once a result and its views are gone, its slab is used again.
    view = second[1:]
    del second
    gc.collect()
    assert slab_of(envs, envs.step(actions)[0]) is None  # the view still holds its slab
    del view
    fourth = envs.step(actions)[0]
    assert slab_of(envs, fourth) in (1, 2)
    assert slab_of(envs, first) != slab_of(envs, fourth)


@pytest.mark.parametrize("backend", BACKENDS)
def test_slabs_only_where_they_pay(make_env, backend, monkeypatch):
    views = make_env("CartPole-v1", NUM_ENVS, backend=backend, copy=False)
    pool = make_env("CartPole-v1", NUM_ENVS, backend=backend, batch_size=2, num_workers=2)
    for envs in (views, pool):
        assert len(envs._backend.batch.observation_slabs) == 1
    # Small observations (CartPole's: 16 bytes an env) are copied: cheaper than a hand-out.
    monkeypatch.setattr(envfleet._front.results, "SPARE_SLABS_MIN_BYTES", 4 << 10)
    small = make_env("CartPole-v1", NUM_ENVS, backend=backend)
    assert small._backend.batch.slab is None
    # Frames (3 KiB an env, 12 KiB a batch) are handed out.
    frames = make_env(FrameEnv, NUM_ENVS, **{"backend": backend, **LAYOUTS[backend]})
    assert frames._backend.batch.slab is not None
    sync = SyncVectorEnv([FrameEnv] * NUM_ENVS)
    want, _ = sync.reset(seed=1)
    got, _ = frames.reset(seed=1)
    assert_same(got, want, "reset")
    for t in range(3):
        assert_same(
            frames.step(np.ones(NUM_ENVS, np.int64))[0],
            sync.step(np.ones(NUM_ENVS, np.int64))[0],
            f"step {t}",
        )
    assert slab_of(frames, got) in (1, 2)
    sync.close()
    # Spare slabs larger than the cap together are not made; results are copies then.
    monkeypatch.setattr(envfleet._front.results, "SPARE_SLABS_MIN_BYTES", 0)
    monkeypatch.setattr(envfleet._front.results, "SPARE_SLABS_MAX_BYTES", 2 * 4 * 4 * NUM_ENVS - 1)
    capped = make_env("CartPole-v1", NUM_ENVS, backend=backend)
    assert capped._backend.batch.slab is None
    first, _ = capped.reset(seed=0)
    assert slab_of(capped, first) is None


def rows(tree: Any, ids: np.ndarray) -> Any:
    if isinstance(tree, dict):
        return {key: rows(value, ids) for key, value in tree.items()}
    if isinstance(tree, tuple):
        return tuple(rows(value, ids) for value in tree)
    return tree[ids]


def lockstep_steps(fleet: Any, sync: SyncVectorEnv, space: Any, steps: int) -> list[Any]:
    """Step both ``steps`` times, comparing; returns the first step's results of both (the
    others are dropped, so the latest result is in a spare slab)."""
    held = []
    for t in range(steps):
        actions = space.sample()
        got = fleet.step(deepcopy(actions))[0]
        want = sync.step(deepcopy(actions))[0]
        assert_same(got, want, f"step {t}")
        if t == 0:
            held.append((got, want))
        del got  # only the first result is held
    return held


def started_pair(make_env: Any, backend: str) -> tuple[Any, SyncVectorEnv, Any, list[Any]]:
    """envfleet and SyncVectorEnv over NestedSpaceEnv, reset and stepped 3 times in lockstep:
    (envfleet's, SyncVectorEnv, the action space, the first step's results held). The latest
    result is in a spare slab, and no result holds it."""
    fleet = make_env(NestedSpaceEnv, NUM_ENVS, **{"backend": backend, **LAYOUTS[backend]})
    sync = SyncVectorEnv(sync_factories(NestedSpaceEnv, NUM_ENVS))
    try:
        space = batch_space(sync.single_action_space, NUM_ENVS)
        space.seed(1)
        assert_same(fleet.reset(seed=2), sync.reset(seed=2), "reset")
        held = lockstep_steps(fleet, sync, space, 3)
        assert fleet._outputs.latest in (1, 2)
    except BaseException:
        sync.close()
        raise
    return fleet, sync, space, held


@pytest.mark.parametrize("backend", BACKENDS)
def test_copy_false_after_slabs(make_env, backend):
    """copy=False reads the batch's own buffer: switching to it after results went to spare
    slabs moves the latest observations there first (a masked reset shows the others')."""
    fleet, sync, space, held = started_pair(make_env, backend)
    try:
        assert slab_of(fleet, first_leaf(held[0][0])) in (1, 2)
        fleet.copy = False
        mask = np.array([False, True, False, False])
        got = fleet.reset(seed=4, options={"reset_mask": mask.copy()})
        assert_same(got, sync.reset(seed=4, options={"reset_mask": mask.copy()}), "reset")
        assert slab_of(fleet, first_leaf(got[0])) == 0
        fleet.copy = True
        held += lockstep_steps(fleet, sync, space, 3)
        assert slab_of(fleet, first_leaf(held[-1][0])) is None  # copies from now on
        assert fleet._backend.batch.slab[0] == 0
        for t, (got, want) in enumerate(held):
            assert_same(got, want, f"result {t}, read at the end")
    finally:
        sync.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_pool_calls_after_slabs(make_env, backend):
    """The first-ready calls (send/recv with batch_size == num_envs) read the batch's own
    buffer: after them, a masked reset still shows every other env's latest row."""
    fleet, sync, space, held = started_pair(make_env, backend)
    try:
        fleet.async_reset(seed=9)
        got = fleet.recv()
        want, _ = sync.reset(seed=9)
        assert_same(got[0], rows(want, got[4]["env_id"]), "pool reset")
        for t in range(3):
            actions = space.sample()
            fleet.send(deepcopy(actions))
            got = fleet.recv()
            want = sync.step(deepcopy(actions))[0]
            assert_same(got[0], rows(want, got[4]["env_id"]), f"pool step {t}")
        mask = np.array([True, False, False, True])
        got = fleet.reset(seed=4, options={"reset_mask": mask.copy()})
        assert_same(got, sync.reset(seed=4, options={"reset_mask": mask.copy()}), "reset")
        for t, (got, want) in enumerate(held):
            assert_same(got, want, f"result {t}, read at the end")
    finally:
        sync.close()
