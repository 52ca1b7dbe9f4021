"""Envs that wait, at scale: hundreds of envs whose every step sleeps about 1 ms.

Three batteries, each differential (the same seeds and actions through gymnasium's own
SyncVectorEnv, whose envs' data does not depend on how long they wait):

- 256 :class:`tests.envs.WaitingEnv` (episodes of 3 to 11 steps: every env autoresets) on
  every backend in every autoreset mode, bit-identical to SyncVectorEnv; on ``processes``
  every worker says it found envs that wait and stepped its block at once;
- a first-ready pool of 1,024 envs whose observations name the env, its seed, its calls and
  the action it was sent, driven with random subsets of envs in random orders: every row is
  the env ``info["env_id"]`` says, each send is one call of that env with that action, and
  each env's data is that of a SyncVectorEnv of that env alone;
- a fault (SIGSEGV, SIGKILL, ``os._exit``, a hang past ``step_timeout``, a lost connection)
  in an env of a block that waits, under ``make()``'s defaults: what
  :class:`envfleet.RestartPolicy` documents is restarted (a worker stepping several envs at
  once cannot tell which one died: its whole block; an env that lost its connection: that
  env), each restarted env starts the episode its restart seed gives, and every other env
  is bit-identical to SyncVectorEnv.

Timeouts are hang guards and ``step_timeout`` values, never speed bounds.
"""

from __future__ import annotations

import functools
import os
import re
import time
import warnings
from typing import Any

import gymnasium as gym
import numpy as np
import pytest
from gymnasium import spaces
from gymnasium.vector import AutoresetMode, SyncVectorEnv

import envfleet
from envfleet._backends.supervisor import restart_seed
from envfleet._core.replay import load_replay
from tests.contract.test_differential import run_lockstep
from tests.envs import FaultEnv, WaitingEnv, fault_factory, sync_factories

MODES = list(AutoresetMode)
GUARD = 60.0  # seconds: a hang guard for a whole pool run, never a speed bound
WAIT_S = 0.001  # each env step sleeps this long (the GIL released)

# -- 256 envs that wait, on every backend, in every autoreset mode --------------------------

SCALE = 256
STEPS = 12  # every env's first episode (3 to 11 steps) ends within them
MID_EPISODE_RESET = {5: (np.random.default_rng(3).random(SCALE) < 0.25, 99)}  # step: mask, seed


@pytest.mark.backends("serial", "threads", "processes", "ray")
@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
def test_256_waiting_envs_match_sync_vector_env(
    make_env: Any, backend: Any, mode: AutoresetMode, monkeypatch: pytest.MonkeyPatch
) -> None:
    """WaitingEnv x256 on the backend's defaults: every reset, step, autoreset (or masked
    reset of the envs that ended, DISABLED) and a masked reset of a quarter of the envs mid
    run give SyncVectorEnv's batches bit for bit (observations, rewards, flags, sparse
    infos, final observations). ``processes`` workers and Ray actors found envs that wait
    and stepped (nearly) every round at once; serial and threads do not time their envs
    (``"unknown"``)."""
    monkeypatch.delenv("ENVFLEET_STEPPING", raising=False)  # the workers choose ("auto")
    envs = make_env(WaitingEnv, SCALE, **backend.options, autoreset_mode=mode)
    sync = SyncVectorEnv(sync_factories(WaitingEnv, SCALE, wait_s=0.0), autoreset_mode=mode)
    try:
        seen = run_lockstep(envs, sync, steps=STEPS, seed=11, mid_episode_resets=MID_EPISODE_RESET)
    finally:
        sync.close()
    assert seen["ended"] >= SCALE and seen["info_steps"] == STEPS, seen
    assert seen["masked_resets"] >= 1, seen
    if mode is AutoresetMode.SAME_STEP:
        assert seen["final_obs"] == seen["ended"], seen
    stats = envs.stats
    assert [w.count for w in stats.workers] == [STEPS] * envs.num_workers, stats.workers
    if backend.id in ("processes", "ray"):
        _assert_stepped_at_once(stats.workers)
        assert stats.env_kind == "wait"
    else:  # StepTimeStats.env_kind: only workers that time their envs know
        assert stats.env_kind == "unknown", stats.workers
        assert not any(w.concurrent or w.concurrent_steps for w in stats.workers), stats.workers


def _assert_stepped_at_once(workers: Any) -> None:
    """Every worker found envs that wait and steps them at once, as it did (nearly) every
    round."""
    assert workers, "no worker statistics"
    for w, worker in enumerate(workers):
        seen = f"worker {w}: {worker}"
        assert worker.env_kind == "wait" and worker.concurrent, seen
        # From the first round on; a first step slowed on a busy machine (its CPU time past
        # half its wall time) may keep a round or two one after another.
        assert worker.concurrent_steps >= STEPS - 3, seen


# -- the first-ready pool's routing, x1,024 --------------------------------------------------

POOL_ENVS = 1024
POOL_SEED = 7
ACTIONS = 1 << 20  # distinct enough that an action reaching the wrong env shows
OUT, HELD, SENT = 0, 1, 2  # an env, as the driver below sees it: stepping or ready, received
# and awaiting an action, sent one while a block-mate awaits its own (its block not stepping)


class RoutedEnv(gym.Env):
    """An env that waits and says who it is: its observation is ``[env_index, the seed of
    its first reset, its calls so far (resets and steps), the action it was just sent (-1
    after a reset), a draw from np_random]``; every step sleeps ``wait_s``; episodes end at
    random (np_random); infos name the env, and some give its calls."""

    def __init__(self, env_index: int = 0, wait_s: float = WAIT_S):
        self.env_index, self.wait_s = env_index, wait_s
        self.observation_space = spaces.Box(-1, 2**40, (5,), np.int64)
        self.action_space = spaces.Discrete(ACTIONS)
        self.seed, self.calls = -1, 0

    def _obs(self, action: int) -> np.ndarray:
        draw = int(self.np_random.integers(0, 2**40))
        return np.array([self.env_index, self.seed, self.calls, action, draw], np.int64)

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        if self.seed < 0 and seed is not None:
            self.seed = seed
        self.calls += 1
        return self._obs(-1), {"env": np.int64(self.env_index)}

    def step(self, action: Any):
        if self.wait_s:
            time.sleep(self.wait_s)
        self.calls += 1
        obs = self._obs(int(action))
        reward = float(self.np_random.normal())
        terminated, truncated = bool(self.np_random.random() < 0.05), False
        if not terminated:
            truncated = bool(self.np_random.random() < 0.03)
        info: dict[str, Any] = {"env": np.int64(self.env_index)}
        if self.np_random.random() < 0.5:
            info["calls"] = np.int64(self.calls)
        return obs, reward, terminated, truncated, info


def _row(info: dict[str, Any], k: int) -> dict[str, Any]:
    """Row ``k`` of a batched info dict (gymnasium's layout: ``_key`` masks): its keys that
    row has, each as (dtype, value); without the pool's ``env_id``."""
    return {
        key: _row(value, k)
        if isinstance(value, dict)
        else (np.asarray(value[k]).dtype.str, np.asarray(value[k]).tolist())
        for key, value in info.items()
        if not key.startswith("_") and key != "env_id" and info["_" + key][k]
    }


Record = tuple[bytes, float, bool, bool, dict[str, Any]]  # obs, reward, terminated, truncated


class PoolDriver:
    """Drives a first-ready pool with random subsets of the envs it received, in random
    orders, and checks every result against what each env must have been sent.

    ``state`` is each env as the driver left it (OUT, HELD, SENT): a block steps once every
    env of it was sent an action; the driver sends every held env when too few envs are out
    for the next ``recv``."""

    def __init__(self, envs: Any, rng: np.random.Generator):
        self.envs, self.rng = envs, rng
        n = envs.num_envs
        # The pool's units of hand-back: a worker's block given num_workers, one env each
        # under make()'s default layout (one-env groups hosted a core's worth to a process).
        self.blocks = [np.arange(start, stop) for start, stop in envs._backend.ranges]
        self.block_of = np.repeat(np.arange(len(self.blocks)), [len(b) for b in self.blocks])
        self.state = np.full(n, OUT, np.int8)
        self.calls = np.zeros(n, np.int64)  # calls each env took, as its results show
        self.next_action = np.full(n, -1, np.int64)  # what its next result must show
        self.ended = np.zeros(n, np.bool_)  # its last result ended an episode
        self.actions: list[list[int]] = [[] for _ in range(n)]  # sent, in order
        self.records: list[list[Record]] = [[] for _ in range(n)]
        self.sizes: list[int] = []  # envs per send

    def send(self, ids: np.ndarray) -> None:
        if not ids.size:
            return
        actions = self.rng.integers(0, ACTIONS, ids.size)
        self.envs.send(actions, ids)
        self.sizes.append(ids.size)
        self.state[ids] = SENT
        # NEXT_STEP: the call after an episode's end is its reset, which ignores the action.
        self.next_action[ids] = np.where(self.ended[ids], -1, actions)
        for e, a in zip(ids.tolist(), actions.tolist(), strict=True):
            self.actions[e].append(a)
        for w in np.unique(self.block_of[ids]).tolist():
            if (self.state[self.blocks[w]] == SENT).all():
                self.state[self.blocks[w]] = OUT

    def recv(self) -> None:
        envs, state = self.envs, self.state
        if np.count_nonzero(state == OUT) < envs.batch_size:
            self.send(np.flatnonzero(state == HELD))
        obs, reward, terminated, truncated, info = envs.recv(timeout=GUARD)
        ids = info["env_id"]
        assert ids.dtype == np.int32 and ids.shape == (envs.batch_size,), ids
        assert np.unique(ids).size == ids.size, f"an env twice in one batch: {ids}"
        assert (state[ids] == OUT).all(), f"results of envs not stepping: {ids[state[ids] != OUT]}"
        for w in np.unique(self.block_of[ids]).tolist():  # a worker's envs in index order
            mine = ids[self.block_of[ids] == w]
            assert (np.diff(mine) > 0).all(), f"worker {w}'s envs out of order: {mine}"
        self.calls[ids] += 1
        # Row k is env ids[k]'s: its index, its seed, one call more, the action it was sent.
        np.testing.assert_array_equal(obs[:, 0], ids, "env index")
        np.testing.assert_array_equal(obs[:, 1], POOL_SEED + ids, "seed")
        np.testing.assert_array_equal(obs[:, 2], self.calls[ids], "calls")
        np.testing.assert_array_equal(obs[:, 3], self.next_action[ids], "action")
        assert info["_env"].all(), info["_env"]
        np.testing.assert_array_equal(info["env"], ids, "info['env']")
        if "calls" in info:
            got = info["calls"][info["_calls"]]
            np.testing.assert_array_equal(got, self.calls[ids[info["_calls"]]], "info['calls']")
        for k, e in enumerate(ids.tolist()):
            self.records[e].append(
                (
                    obs[k].tobytes(),
                    float(reward[k]),
                    bool(terminated[k]),
                    bool(truncated[k]),
                    _row(info, k),
                )
            )
        self.ended[ids] = terminated | truncated
        state[ids] = HELD
        held = np.flatnonzero(state == HELD)
        self.rng.shuffle(held)
        self.send(held[: self.rng.integers(0, held.size + 1)])


def _solo_records(e: int, actions: list[int], count: int) -> list[Record]:
    """Env ``e`` alone in a SyncVectorEnv: its reset (seed POOL_SEED + e) and its steps with
    ``actions``, ``count`` results in all; a reset's reward and flags as the pool gives them."""
    sync = SyncVectorEnv([functools.partial(RoutedEnv, env_index=e, wait_s=0.0)])
    obs, info = sync.reset(seed=POOL_SEED + e)
    out: list[Record] = [(obs[0].tobytes(), 0.0, False, False, _row(info, 0))]
    for a in actions[: count - 1]:
        obs, reward, terminated, truncated, info = sync.step(np.array([a]))
        out.append(
            (
                obs[0].tobytes(),
                float(reward[0]),
                bool(terminated[0]),
                bool(truncated[0]),
                _row(info, 0),
            )
        )
    sync.close()
    return out


POOL_LAYOUTS = [
    # 16 blocks of 64 and batches of 100: batches end inside blocks, a block's rest waits.
    pytest.param({"num_workers": 16}, 100, 300, id="16-workers-batch-100"),
    # 32 blocks of 32, a batch a block.
    pytest.param({"num_workers": 32}, 32, 200, id="32-workers-batch-32"),
    # make()'s own layout for a batch of half the envs: each env handed back on its own.
    pytest.param({}, 512, 24, id="default-workers-batch-512"),
]


@pytest.mark.parametrize(("layout", "batch_size", "recvs"), POOL_LAYOUTS)
def test_1024_env_pool_routes_every_row_to_its_env(
    make_env: Any,
    monkeypatch: pytest.MonkeyPatch,
    layout: dict[str, Any],
    batch_size: int,
    recvs: int,
) -> None:
    """RoutedEnv x1,024 in a first-ready pool, ``recvs`` recv/send rounds, each sending a
    random subset of the envs received so far in a random order: every row returned is the
    env its ``info["env_id"]`` names (its index, its seed, its infos), no env comes back
    before its block was sent its actions nor twice in a batch, a worker's envs come in
    index order, each send is exactly one call of the env with the action sent to it
    (NEXT_STEP: the reset after an episode's end ignores it), and each env's data is what
    a SyncVectorEnv of that env alone gives with the same seed and actions."""
    monkeypatch.delenv("ENVFLEET_STEPPING", raising=False)
    envs = make_env(RoutedEnv, POOL_ENVS, batch_size=batch_size, **layout)
    assert envs.batch_size == batch_size and envs.num_envs == POOL_ENVS
    driver = PoolDriver(envs, np.random.default_rng(batch_size))
    envs.async_reset(seed=POOL_SEED)
    deadline = time.monotonic() + GUARD
    for _ in range(recvs):
        assert time.monotonic() < deadline, "the pool did not answer in time (a hang guard)"
        driver.recv()
    counts = np.array([len(r) for r in driver.records])
    assert counts.sum() == recvs * batch_size
    assert counts.min() >= 2, f"envs never stepped: {np.flatnonzero(counts < 2)}"
    assert sum(r[2] or r[3] for rs in driver.records for r in rs) > 0, "no episode ended"
    assert len(set(driver.sizes)) > 1 and len(driver.sizes) >= recvs // 2, driver.sizes
    for e in range(POOL_ENVS):
        want = _solo_records(e, driver.actions[e], len(driver.records[e]))
        assert driver.records[e] == want, f"env {e} differs from SyncVectorEnv"
    assert envs.stats.env_kind == "wait", envs.stats.workers


# -- faults in a block of envs that wait, under make()'s defaults ----------------------------

FAULT_ENVS = 64  # two workers of 32: env 45 is worker 1's 14th
FAULTY = 45
FAULT_AT = 13  # its 13th step: past the first rounds a worker times, on no round a power of two
FAULT_STEPS = 20  # a rebuilt env would fault again in its own 13th step: after the run
FAULT_SEED = 100


class LostLinkEnv(FaultEnv):
    """:class:`tests.envs.FaultEnv` with one more fault, ``"connection"``: its step raises
    ``ConnectionError`` (a simulator's connection lost), after its wait."""

    def step(self, action: Any):
        if self.fault == ("connection", self._steps + 1):
            self._steps += 1
            time.sleep(self.wait_s)
            raise ConnectionError(
                f"lost the simulator in step {self._steps} of env {self.env_index}"
            )
        return super().step(action)


FAULTS: dict[str, tuple[Any, dict[str, Any], str]] = {  # factory, make() options, cause
    "null-write": (fault_factory({FAULTY: ("null-write", FAULT_AT)}, WAIT_S), {}, "signal SIGSEGV"),
    "segfault": (fault_factory({FAULTY: ("segfault", FAULT_AT)}, WAIT_S), {}, "signal SIGSEGV"),
    "sigkill": (fault_factory({FAULTY: ("sigkill", FAULT_AT)}, WAIT_S), {}, "signal SIGKILL"),
    "exit": (fault_factory({FAULTY: ("exit", FAULT_AT)}, WAIT_S), {}, "exit code 3"),
    "hang": (
        fault_factory({FAULTY: ("sleep:60", FAULT_AT)}, WAIT_S),
        {"supervision": envfleet.Supervision(step_timeout=2.0)},
        "did not answer within 2.0 s",
    ),
    "connection": (
        functools.partial(LostLinkEnv, faults={FAULTY: ("connection", FAULT_AT)}, wait_s=WAIT_S),
        {},
        "ConnectionError: lost the simulator in step 13 of env 45",
    ),
}


def _records(result: Any, e: int) -> Record:
    """Env ``e``'s part of a step's result, or of a reset's (reward 0, no episode end)."""
    if len(result) == 2:
        return result[0][e].tobytes(), 0.0, False, False, _row(result[1], e)
    obs, reward, terminated, truncated, info = result
    return (
        obs[e].tobytes(),
        float(reward[e]),
        bool(terminated[e]),
        bool(truncated[e]),
        _row(info, e),
    )


def _restarted_records(e: int, actions: list[np.ndarray], mode: AutoresetMode) -> list[Record]:
    """Env ``e`` rebuilt in step FAULT_AT: the new episode its restart seed gives (reward 0,
    truncated, ``env_restarted``), then the steps after it, in gymnasium's ``mode``
    (NEXT_STEP: that truncation's autoreset first)."""
    env = FaultEnv(e)
    obs, _ = env.reset(seed=restart_seed(FAULT_SEED + e, 1))
    out: list[Record] = [(obs.tobytes(), 0.0, False, True, {"env_restarted": ("|b1", True)})]
    later = actions[FAULT_AT:]
    if mode is AutoresetMode.NEXT_STEP:
        obs, info = env.reset()
        out.append((obs.tobytes(), 0.0, False, False, info))
        later = later[1:]
    for a in later:
        obs, reward, terminated, truncated, info = env.step(a[e])
        out.append((obs.tobytes(), float(reward), terminated, truncated, info))
    return out


@pytest.mark.parametrize(
    ("fault", "mode"),
    [(fault, AutoresetMode.NEXT_STEP) for fault in FAULTS]
    + [(fault, AutoresetMode.SAME_STEP) for fault in ("null-write", "connection")],
    ids=lambda v: getattr(v, "value", v),
)
def test_a_fault_in_a_block_that_waits_restarts_what_the_policy_says(
    make_env: Any,
    snapshot: Any,
    monkeypatch: pytest.MonkeyPatch,
    fault: str,
    mode: AutoresetMode,
) -> None:
    """FaultEnv x64 (each step sleeps 1 ms) in two workers, on make()'s defaults otherwise
    (the default RestartPolicy; ``step_timeout`` only for the hang): env 45 faults in its
    13th step while worker 1 steps its block at once (its stats say so). A crash or a hang
    restarts worker 1's whole block (the worker cannot tell which env it was in), a lost
    connection env 45 alone; each restarted env reads truncated, reward 0,
    ``env_restarted`` in that step and goes on in the episode its restart seed gives; every
    other env, worker 0's all along, is bit-identical to SyncVectorEnv. One
    EnvRestartedWarning says so, with a replay that loads."""
    monkeypatch.delenv("ENVFLEET_STEPPING", raising=False)
    factory, options, cause = FAULTS[fault]
    envs = make_env(factory, FAULT_ENVS, num_workers=2, autoreset_mode=mode, **options)
    sync = SyncVectorEnv(sync_factories(FaultEnv, FAULT_ENVS, wait_s=0.0), autoreset_mode=mode)
    rng = np.random.default_rng(5)
    actions = [rng.integers(0, 2, FAULT_ENVS) for _ in range(FAULT_STEPS)]
    got: list[Any] = [envs.reset(seed=FAULT_SEED)]
    want: list[Any] = [sync.reset(seed=FAULT_SEED)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", envfleet.EnvRestartedWarning)
        for t, a in enumerate(actions, start=1):
            if t == FAULT_AT:
                before = envs.stats.workers
            got.append(envs.step(a.copy()))
            want.append(sync.step(a.copy()))
    sync.close()
    stats = envs.stats
    envs.close()

    blocks = np.array_split(np.arange(FAULT_ENVS), envs.num_workers)
    w = next(k for k, b in enumerate(blocks) if FAULTY in b)
    block = blocks[w].tolist()
    assert before[w].env_kind == "wait" and before[w].concurrent, before[w]
    lost = [FAULTY] if fault == "connection" else block
    for e in range(FAULT_ENVS):
        rows = [_records(result, e) for result in got]
        if e not in lost:
            assert rows == [_records(result, e) for result in want], f"env {e} differs"
            continue
        assert rows[:FAULT_AT] == [_records(r, e) for r in want[:FAULT_AT]], f"env {e} before"
        assert rows[FAULT_AT:] == _restarted_records(e, actions, mode), f"env {e} after"
    restarted = [np.flatnonzero(r[-1].get("_env_restarted", [])).tolist() for r in got]
    assert restarted == [[]] * FAULT_AT + [lost] + [[]] * (FAULT_STEPS - FAULT_AT)
    assert (stats.restarts, stats.env_restarts) == (1, {e: 1 for e in lost})
    counts = {"hang": (0, 1, 0), "connection": (0, 0, 1)}.get(fault, (1, 0, 0))
    assert (stats.crashes, stats.timeouts, stats.env_errors) == counts

    messages = [
        str(m.message) for m in caught if issubclass(m.category, envfleet.EnvRestartedWarning)
    ]
    replays = [m.group(1) for m in map(re.compile(r"its replay: (\S+)").search, messages) if m]
    loaded = [load_replay(path) for path in replays]
    for path in replays:
        os.unlink(path)
    [message] = messages
    assert cause in message, message
    if fault == "connection":
        mates = [e for e in block if e != FAULTY]
        assert f"sub-environment {FAULTY} starts a new episode; {mates} continue exactly" in message
    else:
        assert f"sub-environments {block} start a new episode" in message, message
    assert len(loaded) == 1 and FAULTY in [r.env_index for r in loaded[0].envs], message
    snapshot.assert_nothing_left()
