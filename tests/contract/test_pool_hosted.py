"""A first-ready pool under the default workers hands each env back when that env finishes.

``envfleet.make(env, n, batch_size=b)`` on ``backend="processes"`` with no ``num_workers``
puts each env in a group of its own and hosts the groups a core's worth to a worker process
(``host_main``): the process count stays one per usable core, yet an env that takes long (a
straggler, a simulator that stalls, a hang) holds up none of the envs it shares its process
with. Supervision stays per env: a segfault or a hang past ``step_timeout`` in one env of a
host restarts that env alone (named in the EnvRestartedWarning), and its host-mates' data is
exactly that of a run without the fault.

Every test here uses ``2 * usable_cores()`` envs, so that each process hosts two envs (env 0
and env 1 share one): before hosting, those were one block, handed back whole. Blocking is
on a file latch the test releases; timeouts are hang guards, never speed bounds.
"""

from __future__ import annotations

import os
import pickle
import threading
import time
from typing import Any

import gymnasium as gym
import numpy as np
import pytest
from gymnasium import spaces

import envfleet
from envfleet._core.cores import usable_cores
from tests.contract.test_pool_restarts import OnceFaultEnv, Record

GUARD = 90.0  # seconds: a hang guard, never a speed bound
NUM_ENVS = 2 * max(2, usable_cores())  # two envs per worker process (env 0 with env 1)
ROUNDS = 9  # results per env: the reset, then 8 steps (a fault at step 5 happens once)


class LatchEnv(gym.Env):
    """Observes ``[env_index, steps]``. Env ``blocked``'s step number ``at_step`` waits until
    the file ``latch`` exists (the test creates it to release the env)."""

    def __init__(self, env_index: int, latch: str, blocked: int = 1, at_step: int = 1):
        self.env_index, self.latch, self.blocked, self.at_step = env_index, latch, blocked, at_step
        self.observation_space = spaces.Box(0, 10_000, (2,), np.int64)
        self.action_space = spaces.Discrete(2)
        self.steps = 0

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        self.steps = 0
        return np.array([self.env_index, 0], dtype=np.int64), {}

    def step(self, action: Any):
        self.steps += 1
        if self.env_index == self.blocked and self.steps == self.at_step:
            deadline = time.monotonic() + GUARD
            while not os.path.exists(self.latch):  # the test releases it
                assert time.monotonic() < deadline, "the test never released the latch"
                time.sleep(0.001)
        return np.array([self.env_index, self.steps], dtype=np.int64), 1.0, False, False, {}


def latched(latch: str) -> Any:
    def factory(env_index: int) -> LatchEnv:
        return LatchEnv(env_index, latch)

    return factory


def test_a_blocked_env_holds_up_none_of_its_process_mates(make_env: Any, tmp_path: Any) -> None:
    """Env 1 blocks in its first step until released; env 0, which shares its worker
    process (its block before), comes back from recv() meanwhile, step after step, as does
    every other env; each result is routed to its env_id."""
    latch = str(tmp_path / "latch")
    envs = make_env(latched(latch), NUM_ENVS, batch_size=NUM_ENVS // 2, backend="processes")
    # A group per env, hosted by a worker process per usable core.
    assert envs.num_workers == usable_cores() and len(envs._backend.ranges) == NUM_ENVS
    envs.async_reset(seed=0)
    steps = np.zeros(NUM_ENVS, dtype=np.int64)  # results received per env, the reset's too
    others = [e for e in range(NUM_ENVS) if e != 1]
    deadline = time.monotonic() + GUARD
    # Until env 0 and every other env has come back from at least 3 steps while env 1 is
    # still blocked: with env 0 in env 1's block, env 0 never could.
    while steps[others].min() < 4 or steps[1] < 1:
        assert time.monotonic() < deadline, steps.tolist()
        obs, _, _, _, info = envs.recv(timeout=GUARD)
        ids = info["env_id"]
        assert 1 not in ids.tolist() or steps[1] == 0, "env 1 came back while blocked"
        for k, e in enumerate(ids.tolist()):
            assert obs[k].tolist() == [e, steps[e]], (e, obs[k])  # routed to its env
            steps[e] += 1
        # Env 1 came back from its reset: send it its action too; it blocks in that step.
        envs.send(np.zeros(len(ids), dtype=np.int64), ids)
    assert steps[1] == 1  # its reset only: its first step is still blocked
    open(latch, "w").close()  # release env 1
    while steps[1] < 2:
        assert time.monotonic() < deadline, steps.tolist()
        obs, _, _, _, info = envs.recv(timeout=GUARD)
        ids = info["env_id"]
        for k, e in enumerate(ids.tolist()):
            assert obs[k].tolist() == [e, steps[e]], (e, obs[k])
            steps[e] += 1
        envs.send(np.zeros(len(ids), dtype=np.int64), ids)


def test_pool_layout_blocks_hands_back_a_workers_block_together(
    make_env: Any, tmp_path: Any
) -> None:
    """``Processes(pool_layout="blocks")`` lays the pool out in a block per worker, as a pool
    with ``num_workers`` given: the workers' blocks fill a batch exactly, and its results are
    routed to their envs as the per-env layout's are."""
    latch = tmp_path / "latch"
    latch.touch()  # released from the start: no env blocks
    backend = envfleet.Processes(pool_layout="blocks")
    envs = make_env(latched(str(latch)), NUM_ENVS, batch_size=NUM_ENVS // 2, backend=backend)
    blocks = envs._backend.ranges
    assert len(blocks) < NUM_ENVS and all(b - a > 1 for a, b in blocks), blocks
    envs.async_reset(seed=0)
    for _ in range(4):
        obs, _, _, _, info = envs.recv()
        ids = info["env_id"].tolist()
        assert len(ids) == NUM_ENVS // 2
        whole = [list(range(a, b)) for a, b in blocks if a in ids]
        assert sorted(ids) == sorted(e for block in whole for e in block)  # whole blocks
        assert obs[:, 0].tolist() == ids  # each row its env's
        envs.send(np.zeros(len(ids), dtype=np.int64), ids)


def drive(envs: Any, rounds: int = ROUNDS) -> dict[int, list[Record]]:
    """recv -> send until every env has ``rounds`` results; env e's k-th action is
    ``(e + k) % 2`` whatever the timing (as tests/contract/test_pool_restarts.py's)."""
    envs.async_reset(seed=7)
    seen: dict[int, list[Record]] = {e: [] for e in range(envs.num_envs)}
    steps = np.zeros(envs.num_envs, dtype=np.int64)
    deadline = time.monotonic() + GUARD
    while min(map(len, seen.values())) < rounds:
        assert time.monotonic() < deadline, {e: len(v) for e, v in seen.items()}
        obs, reward, terminated, truncated, info = envs.recv(timeout=envs.step_timeout or GUARD)
        ids = info["env_id"]
        restarted = np.zeros(len(ids), dtype=np.bool_)
        if "env_restarted" in info:
            restarted = info["_env_restarted"] & info["env_restarted"].astype(np.bool_)
        for k, e in enumerate(ids.tolist()):
            seen[e].append(
                (
                    obs[k].tobytes(),
                    float(reward[k]),
                    bool(terminated[k]),
                    bool(truncated[k]),
                    bool(restarted[k]),
                )
            )
        envs.send((ids + steps[ids]) % 2, ids)
        steps[ids] += 1
    return {e: records[:rounds] for e, records in seen.items()}


def faulty(faults: dict[int, tuple[str, int]], once_dir: Any = None) -> Any:
    where = None if once_dir is None else str(once_dir)

    def factory(env_index: int) -> OnceFaultEnv:
        return OnceFaultEnv(env_index, faults, where)

    return factory


def run(make_env: Any, faults: dict[int, tuple[str, int]], once_dir: Any = None, **kwargs: Any):
    envs = make_env(
        faulty(faults, once_dir), NUM_ENVS, batch_size=NUM_ENVS // 2, backend="processes", **kwargs
    )
    return envs, drive(envs)


@pytest.mark.parametrize(
    ("fault", "kwargs"),
    [
        (("ctypes-segfault", 5), {}),
        (("sleep:60", 5), {"supervision": envfleet.Supervision(step_timeout=2.0)}),
    ],
    ids=["segfault", "hang"],
)
def test_a_fault_in_one_env_of_a_process_restarts_that_env_alone(
    fault: tuple[str, int], kwargs: dict[str, Any], make_env: Any, snapshot: Any, tmp_path: Any
) -> None:
    """Under the default restart policy, env 1 segfaults (or hangs past step_timeout) in its
    5th step: its process goes (killed, for the hang), env 1 is restarted and named, and
    env 0, which shared that process, and every other env give exactly the data of a run
    without the fault."""
    with pytest.warns(envfleet.EnvRestartedWarning) as warned:
        envs, got = run(make_env, {1: fault}, tmp_path, **kwargs)
    assert envs.num_workers == usable_cores() and len(envs._backend.ranges) == NUM_ENVS
    messages = [
        str(w.message) for w in warned if issubclass(w.category, envfleet.EnvRestartedWarning)
    ]
    assert len(messages) == 1, messages
    assert "sub-environment 1 starts a new episode" in messages[0], messages[0]
    clean_envs, clean = run(make_env, {}, **kwargs)
    clean_envs.close()
    for e in range(NUM_ENVS):
        if e == 1:
            continue
        assert got[e] == clean[e], f"env {e} was not at fault, yet its data differs"
    records = got[1]
    assert records[:5] == clean[1][:5]
    _, reward, terminated, truncated, flagged = records[5]
    assert (reward, terminated, truncated, flagged) == (0.0, False, True, True)
    assert len(records) == ROUNDS  # it kept producing data
    stats = envs.stats
    assert stats.env_restarts == {1: 1} and stats.restarts == 1
    envs.close()
    snapshot.assert_nothing_left()


def test_a_hang_report_names_the_env_its_thread_runs(make_env: Any, tmp_path: Any) -> None:
    """Env 1 blocks in its first step and recv() waits on it alone: the HangWarning names
    env 1's group and the frame of env 1's step, from its own thread's stack (its process
    runs other threads: env 0's among them)."""
    latch = str(tmp_path / "latch")
    envs = make_env(
        latched(latch),
        NUM_ENVS,
        batch_size=1,
        backend="processes",
        supervision=envfleet.Supervision(hang_report_delay=0.5),
    )
    envs.async_reset(seed=0)
    for _ in range(NUM_ENVS):  # every reset's result
        envs.recv(timeout=GUARD)
    envs.send(np.zeros(1, dtype=np.int64), np.array([1]))
    envs.send(np.zeros(1, dtype=np.int64), np.array([0]))
    _, _, _, _, info = envs.recv(timeout=GUARD)
    assert info["env_id"].tolist() == [0]  # env 0 came back; env 1 is blocked
    try:
        with pytest.warns(envfleet.HangWarning) as record:

            def release_once_reported() -> None:  # the latch opens after the report
                deadline = time.monotonic() + GUARD
                while not len(record) and time.monotonic() < deadline:
                    time.sleep(0.01)
                open(latch, "w").close()

            threading.Thread(target=release_once_reported, daemon=True).start()
            obs, _, _, _, info = envs.recv(timeout=GUARD)
    finally:
        open(latch, "w").close()
    assert info["env_id"].tolist() == [1] and obs[0].tolist() == [1, 1]
    text = str(record[0].message)
    assert "(sub-environments [1])" in text, text
    assert "test_pool_hosted.py" in text and " in step" in text, text


def _pool_run(envs: Any, rounds: int, counts: dict[int, int], seen: dict[int, list[Any]]):
    """``rounds`` of recv -> send, each env's action a function of its own step count."""
    for _ in range(rounds):
        obs, rewards, terminated, truncated, info = envs.recv(timeout=GUARD)
        ids = info["env_id"]
        for k, e in enumerate(ids.tolist()):
            seen.setdefault(e, []).append(
                (obs[k].tobytes(), float(rewards[k]), bool(terminated[k]), bool(truncated[k]))
            )
        actions = np.array(
            [np.random.default_rng([e, counts.get(e, 0)]).integers(0, 2) for e in ids.tolist()]
        )
        for e in ids.tolist():
            counts[e] = counts.get(e, 0) + 1
        envs.send(actions, ids)


def test_a_snapshot_of_a_hosted_pool_resumes_elsewhere(make_env: Any) -> None:
    """A hosted pool snapshotted with envs in flight, resumed on threads: every env goes on
    with the same results."""
    kwargs: dict[str, Any] = {"batch_size": NUM_ENVS // 2}
    first = make_env("CartPole-v1", NUM_ENVS, backend="processes", **kwargs)
    first.async_reset(seed=5)
    counts: dict[int, int] = {}
    _pool_run(first, 60, counts, {})
    state = pickle.loads(pickle.dumps(first.snapshot()))
    resumed_counts = dict(counts)
    # First-ready: on two cores a host process that sleeps is served rarely (its envs may
    # get a twentieth of the recvs), so both runs are long enough for 5 results of each env.
    expected: dict[int, list[Any]] = {}
    _pool_run(first, 400, counts, expected)
    again = make_env("CartPole-v1", NUM_ENVS, backend="threads", resume=state, **kwargs)
    got: dict[int, list[Any]] = {}
    _pool_run(again, 400, resumed_counts, got)
    for e in range(NUM_ENVS):
        n = min(len(expected.get(e, [])), len(got.get(e, [])))
        assert n >= 5, (e, n)
        assert got[e][:n] == expected[e][:n], e
