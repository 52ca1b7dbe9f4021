"""The first-ready pool: ``make(..., batch_size=B)`` with ``async_reset``, ``send`` and ``recv``.

EnvPool's asynchronous interface on every backend: routing of actions and results by env id,
per-env equality with a single gymnasium env, a slow env that holds up nobody, every error
case (nothing sent, pool state unchanged), ``copy=False`` views, SAME_STEP infos sized
``batch_size`` and ``close`` with envs still running.

Timeouts here are hang guards only; no test asserts how fast anything runs.
"""

from __future__ import annotations

import functools
import os
import time
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import pytest
from gymnasium import spaces
from gymnasium.vector import AutoresetMode

import envfleet
from envfleet import (
    ConfigError,
    EnvError,
    InvalidActionError,
    InvalidArgumentError,
    PoolStateError,
    StepTimeoutError,
    usable_cores,
)
from envfleet._core.cores import pool_workers

BACKENDS = ["serial", "threads", "processes"]
GUARD = 30.0  # seconds: a hang guard for every recv, never a speed bound


def episode_len(env_index: int) -> int:
    """Episodes of 2 to 4 steps; even envs terminate, odd envs truncate."""
    return 2 + env_index % 3


class RouteEnv(gym.Env):
    """``obs = [env_index, steps since reset, last action received (-1 after a reset)]``.

    ``reward = steps since reset``; the episode ends after :func:`episode_len` steps
    (terminated for even envs, truncated for odd ones); step infos carry ``step_count``.

    Test knobs, each for the env indices listed with it:

    - ``gate``/``gated``: reset and step wait until the file ``gate`` exists (own guard 20 s);
    - ``sleep_s``/``slow``: reset and step sleep ``sleep_s`` seconds;
    - ``fail_at``/``failing``: the env's ``fail_at``-th step call (since it was built) raises;
    - ``marker_dir``: each finished step writes ``step-<env>-<n>``, close writes ``closed-<env>``.
    """

    metadata: dict[str, Any] = {"render_modes": []}

    def __init__(
        self,
        env_index: int = 0,
        *,
        gate: str | None = None,
        gated: tuple[int, ...] = (),
        sleep_s: float = 0.0,
        slow: tuple[int, ...] = (),
        fail_at: int | None = None,
        failing: tuple[int, ...] = (),
        marker_dir: str | None = None,
    ):
        self.env_index = env_index
        self.observation_space = spaces.Box(-1e9, 1e9, (3,), np.float64)
        self.action_space = spaces.Discrete(10**6)
        self.length = episode_len(env_index)
        self.gate = gate if env_index in gated else None
        self.sleep_s = sleep_s if env_index in slow else 0.0
        self.fail_at = fail_at if env_index in failing else None
        self.marker_dir = marker_dir
        self.steps = 0
        self.last = -1
        self.calls = 0

    def _wait(self) -> None:
        if self.gate is not None:
            deadline = time.monotonic() + 20.0
            while not os.path.exists(self.gate):
                if time.monotonic() > deadline:
                    raise TimeoutError("the test never opened the gate")
                time.sleep(0.005)
        if self.sleep_s:
            time.sleep(self.sleep_s)

    def _obs(self) -> np.ndarray:
        return np.array([self.env_index, self.steps, self.last], dtype=np.float64)

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        self._wait()
        self.steps, self.last = 0, -1
        return self._obs(), {}

    def step(self, action: Any):
        self._wait()
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError(f"env {self.env_index} fails on purpose")
        self.steps += 1
        self.last = int(action)
        done = self.steps >= self.length
        terminated = done and self.env_index % 2 == 0
        truncated = done and not terminated
        if self.marker_dir is not None:
            Path(self.marker_dir, f"step-{self.env_index}-{self.calls}").touch()
        return self._obs(), float(self.steps), terminated, truncated, {"step_count": self.steps}

    def close(self) -> None:
        if self.marker_dir is not None:
            Path(self.marker_dir, f"closed-{self.env_index}").touch()


_RESET = object()  # the pending "action" of an env whose reset result is due


class Model:
    """What each env must return next, under NEXT_STEP autoreset, given what it was sent.

    ``check`` asserts that every returned row comes from the env reported in ``env_id``, that
    it was sent exactly one action (or reset) since its last result, that it echoes that action
    and that its step count is the next one (nothing lost, nothing duplicated).
    """

    def __init__(self, num_envs: int):
        self.num_envs = num_envs
        self.pending: dict[int, Any] = {}
        self.steps = [0] * num_envs
        self.done = [False] * num_envs
        self.received = [0] * num_envs  # results checked per env
        self.resync: set[int] = set()  # envs whose step count is unknown (after an EnvError)
        self.next_action = 1000

    def reset_all(self) -> None:
        self.pending = dict.fromkeys(range(self.num_envs), _RESET)
        self.resync.clear()

    def actions_for(self, ids: Any) -> np.ndarray:
        ids = [int(e) for e in ids]
        actions = np.arange(self.next_action, self.next_action + len(ids), dtype=np.int64)
        self.next_action += len(ids)
        for e, a in zip(ids, actions.tolist(), strict=True):
            assert e not in self.pending, f"env {e} sent twice"
            self.pending[e] = a
        return actions

    def forget(self, ids: Any) -> None:
        """Envs whose action was dropped by an EnvError; their step counts resync."""
        for e in ids:
            self.pending.pop(int(e), None)
            self.resync.add(int(e))

    def check(self, result: tuple[Any, ...], batch_size: int) -> np.ndarray:
        obs, rewards, terminated, truncated, info = result
        ids = info["env_id"]
        assert isinstance(ids, np.ndarray) and ids.dtype == np.int32
        assert ids.shape == (batch_size,)
        assert len(set(ids.tolist())) == batch_size, f"repeated env ids {ids}"
        assert obs.shape == (batch_size, 3) and obs.dtype == np.float64
        assert rewards.shape == (batch_size,) and rewards.dtype == np.float64
        assert terminated.shape == (batch_size,) and terminated.dtype == np.bool_
        assert truncated.shape == (batch_size,) and truncated.dtype == np.bool_
        self.check_rows(ids, obs, rewards, terminated, truncated, info)
        return ids

    def check_rows(self, ids, obs, rewards, terminated, truncated, info) -> None:
        for k, e in enumerate(ids.tolist()):
            assert e in self.pending, f"env {e} returned a result without being sent anything"
            action = self.pending.pop(e)
            row = obs[k].tolist()
            assert row[0] == e, f"row {k} reported as env {e} comes from env {row[0]}"
            if e in self.resync:
                self.resync.discard(e)
                assert row[2] in (-1, action), f"env {e} got no action {action}: {row}"
                self.steps[e] = int(row[1])
                self.done[e] = bool(terminated[k] or truncated[k])
            elif action is _RESET or self.done[e]:
                assert row == [e, 0, -1], f"env {e}: expected its reset obs, got {row}"
                if action is not _RESET:  # a NEXT_STEP autoreset step
                    assert rewards[k] == 0.0
                    assert not terminated[k] and not truncated[k]
                self.steps[e], self.done[e] = 0, False
            else:
                s = self.steps[e] + 1
                assert row == [e, s, action], f"env {e}: expected {[e, s, action]}, got {row}"
                assert rewards[k] == float(s)
                done = s >= episode_len(e)
                assert terminated[k] == (done and e % 2 == 0)
                assert truncated[k] == (done and e % 2 == 1)
                assert info["_step_count"][k] and info["step_count"][k] == s
                self.steps[e], self.done[e] = s, done
            self.received[e] += 1


def route_factory(**kwargs: Any) -> Any:
    return functools.partial(RouteEnv, **kwargs) if kwargs else RouteEnv


def pool(make_env, backend: str, num_envs: int, batch_size: int, **kwargs: Any):
    env = kwargs.pop("env", None) or route_factory(**kwargs.pop("knobs", {}))
    return make_env(env, num_envs, backend=backend, batch_size=batch_size, **kwargs)


def recv_all_resets(envs, model: Model) -> None:
    """async_reset and receive every env's reset result (batch_size must divide num_envs)."""
    envs.async_reset(seed=0)
    model.reset_all()
    for _ in range(envs.num_envs // envs.batch_size):
        model.check(envs.recv(timeout=GUARD), envs.batch_size)
    assert not model.pending


# -- 1. routing --------------------------------------------------------------------------------

LAYOUTS = [
    pytest.param(7, None, 1, id="N7-B1"),
    pytest.param(7, None, 3, id="N7-B3"),
    pytest.param(7, None, 6, id="N7-B6"),
    pytest.param(6, 3, 1, id="N6-W3-B1"),
    pytest.param(6, 3, 3, id="N6-W3-B3"),
    pytest.param(6, 3, 5, id="N6-W3-B5"),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("num_envs", "num_workers", "batch_size"), LAYOUTS)
def test_routing_every_row_action_and_step_goes_to_its_env(
    make_env, backend, num_envs, num_workers, batch_size
):
    envs = pool(make_env, backend, num_envs, batch_size, num_workers=num_workers)
    assert envs.is_pool and envs.batch_size == batch_size
    default = pool_workers(num_envs, batch_size, usable_cores())
    if backend == "processes":  # each env a group, hosted by a worker process per core
        default = min(num_envs, usable_cores())
    assert envs.num_workers == (default if num_workers is None else num_workers)
    rng = np.random.default_rng(num_envs * 10 + batch_size)
    model = Model(num_envs)
    envs.async_reset(seed=0)
    model.reset_all()
    # The envs running or ready, as the test sees them: a worker's block of envs starts once
    # each of its envs has been sent an action, and its envs come back together.
    blocks = [range(a, b) for a, b in envs._backend.ranges]
    live = set(range(num_envs))

    def send(part: Any) -> None:
        envs.send(model.actions_for(part), part.tolist() if len(part) % 2 else part)
        for block in blocks:
            if all(e in model.pending and e not in live for e in block):
                live.update(block)

    def recv() -> np.ndarray:
        assert len(live) >= batch_size
        ids = model.check(envs.recv(timeout=GUARD), batch_size)
        assert set(ids.tolist()) <= live
        live.difference_update(ids.tolist())
        return ids

    deadline = time.monotonic() + GUARD
    rounds = 0
    # 40 rounds, and more until every env has come back a few times: a first-ready pool may
    # serve the others meanwhile (e.g. while a worker is slow to start on a loaded machine).
    while rounds < 40 or min(model.received) < 3:
        assert time.monotonic() < deadline, f"results per env: {model.received}"
        rounds += 1
        # Send in a shuffled order, in two parts: each action must still reach its env.
        ids = rng.permutation(recv())
        cut = int(rng.integers(0, len(ids) + 1))
        for part in (ids[:cut], ids[cut:]):
            if len(part):
                send(part)
    # Everything sent comes back exactly once: receive what is in flight until fewer than
    # batch_size envs are; recv then refuses.
    while len(live) >= batch_size:
        recv()
    with pytest.raises(PoolStateError):
        envs.recv(timeout=GUARD)


# -- 2. per env, the same as a single gymnasium env --------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("batch_size", [1, 4])
def test_each_env_matches_a_single_gymnasium_env(make_env, backend, batch_size):
    num_envs, seed, min_steps = 5, 123, 40
    envs = make_env("CartPole-v1", num_envs, backend=backend, batch_size=batch_size)
    refs = [gym.make("CartPole-v1") for _ in range(num_envs)]
    action_of = [e % 2 for e in range(num_envs)]  # a fixed action per env: short episodes
    want: dict[int, tuple[Any, ...]] = {}
    ref_done = [False] * num_envs
    episodes = [0] * num_envs
    counts = [0] * num_envs
    envs.async_reset(seed=seed)
    for e in range(num_envs):
        obs, _ = refs[e].reset(seed=seed + e)
        want[e] = (obs, 0.0, False, False)
    try:
        # A hang guard; ends once every env has taken min_steps. First-ready: on two cores
        # a host process that sleeps is served rarely (its envs may get a twentieth of the
        # recvs).
        for _ in range(20_000):
            if min(counts) >= min_steps:
                break
            obs, rewards, terminated, truncated, info = envs.recv(timeout=GUARD)
            ids = info["env_id"].tolist()
            for k, e in enumerate(ids):
                w_obs, w_rew, w_term, w_trunc = want.pop(e)
                assert obs[k].dtype == w_obs.dtype and obs[k].tobytes() == w_obs.tobytes(), (
                    f"env {e}, result {counts[e]}: {obs[k]} != {w_obs}"
                )
                assert (rewards[k], terminated[k], truncated[k]) == (w_rew, w_term, w_trunc)
                counts[e] += 1
            for e in ids:  # what each env must return for the action it is sent now
                if ref_done[e]:
                    o, _ = refs[e].reset()
                    want[e] = (o, 0.0, False, False)
                    ref_done[e] = False
                else:
                    o, r, t, tr, _ = refs[e].step(action_of[e])
                    want[e] = (o, float(r), bool(t), bool(tr))
                    ref_done[e] = t or tr
                    episodes[e] += ref_done[e]
            envs.send(np.array([action_of[e] for e in ids]), ids)
    finally:
        for ref in refs:
            ref.close()
    assert min(counts) >= min_steps
    assert min(episodes) >= 2, f"episodes per env {episodes}: too few ended"


def _row(tree: Any, k: int) -> Any:
    if isinstance(tree, dict):
        return {key: _row(value, k) for key, value in tree.items()}
    if isinstance(tree, tuple):
        return tuple(_row(value, k) for value in tree)
    return tree[k]


def _row_infos(info: dict[str, Any], k: int) -> dict[str, Any]:
    """Row ``k`` of gymnasium-convention infos: the keys whose ``_key`` mask is set."""
    return {
        key: value[k]
        for key, value in info.items()
        if not key.startswith("_") and key != "env_id" and info[f"_{key}"][k]
    }


@pytest.mark.parametrize("backend", BACKENDS)
def test_nested_spaces_match_a_single_env_per_env_id(make_env, backend):
    """Dict/Tuple observations and a Dict action (the staged, scattered send path): each env
    gets its own actions and returns what a single env would, infos included."""
    from tests.envs import NestedSpaceEnv

    num_envs, batch_size, seed = 5, 2, 7
    envs = make_env(
        functools.partial(NestedSpaceEnv, max_len=6),
        num_envs,
        backend=backend,
        batch_size=batch_size,
    )
    space, act_space = envs.single_observation_space, envs.single_action_space
    refs = [NestedSpaceEnv(env_index=e, max_len=6) for e in range(num_envs)]
    rng = np.random.default_rng(0)
    want: dict[int, tuple[Any, ...]] = {}
    ref_done = [False] * num_envs
    counts, episodes = [0] * num_envs, [0] * num_envs
    envs.async_reset(seed=seed)
    for e in range(num_envs):
        obs, info = refs[e].reset(seed=seed + e)
        want[e] = (obs, 0.0, False, False, info)
    deadline = time.monotonic() + GUARD
    while min(counts) < 15:
        assert time.monotonic() < deadline, f"results per env: {counts}"
        obs, rewards, terminated, truncated, info = envs.recv(timeout=GUARD)
        ids = info["env_id"].tolist()
        for k, e in enumerate(ids):
            w_obs, w_rew, w_term, w_trunc, w_info = want.pop(e)
            got = spaces.flatten(space, _row(obs, k))
            assert got.tobytes() == spaces.flatten(space, w_obs).tobytes(), f"env {e}"
            assert (rewards[k], terminated[k], truncated[k]) == (w_rew, w_term, w_trunc)
            assert _row_infos(info, k) == w_info, f"env {e}"
            counts[e] += 1
        moves = rng.integers(0, 4, len(ids))
        forces = rng.uniform(-1, 1, (len(ids), 2)).astype(np.float32)
        for j, e in enumerate(ids):
            if ref_done[e]:
                o, i = refs[e].reset()
                want[e] = (o, 0.0, False, False, i)
                ref_done[e] = False
            else:
                action = {"move": int(moves[j]), "force": forces[j]}
                assert act_space.contains(action)
                o, r, t, tr, i = refs[e].step(action)
                want[e] = (o, float(r), bool(t), bool(tr), i)
                ref_done[e] = t or tr
                episodes[e] += ref_done[e]
        envs.send({"move": moves, "force": forces}, ids)
    assert min(episodes) >= 1, episodes


# -- 3. a slow env holds up nobody -------------------------------------------------------------


@pytest.mark.parametrize("backend", ["threads", "processes"])
def test_a_slow_env_never_holds_up_the_others(make_env, backend, tmp_path):
    num_envs, rounds = 4, 12
    gate = tmp_path / "gate"
    envs = pool(make_env, backend, num_envs, num_envs - 1, knobs={"gate": str(gate), "gated": (0,)})
    model = Model(num_envs)
    envs.async_reset()
    model.reset_all()
    try:
        # Env 0 waits at its gate (in reset) until the test opens it: a recv that needed it
        # would hang, so each of these rounds is served by the three fast envs alone.
        for k in range(1, rounds + 1):
            ids = model.check(envs.recv(timeout=GUARD), num_envs - 1)
            assert sorted(ids.tolist()) == [1, 2, 3]
            assert model.received == [0, k, k, k]
            envs.send(model.actions_for(ids), ids)
    finally:
        gate.touch()
    # Once the gate opens, env 0 comes back like any other (when it has noticed: it polls).
    deadline = time.monotonic() + GUARD
    while model.received[0] < 2:
        assert time.monotonic() < deadline, f"env 0 never came back: {model.received}"
        ids = model.check(envs.recv(timeout=GUARD), num_envs - 1)
        envs.send(model.actions_for(ids), ids)


# -- 4. errors -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("backend", "kwargs"),
    [
        pytest.param("serial", {"batch_size": 0}, id="batch0"),
        pytest.param("serial", {"batch_size": 5}, id="batch-above-N"),
        pytest.param("threads", {"batch_size": -1}, id="batch-negative"),
        pytest.param("serial", {"batch_size": 2.0}, id="batch-float"),
        pytest.param(
            "threads", {"batch_size": 2, "autoreset_mode": AutoresetMode.DISABLED}, id="disabled"
        ),
        pytest.param("serial", {"batch_size": 3, "autoreset_mode": "Disabled"}, id="disabled-str"),
        pytest.param(envfleet.Processes(driver_envs=1), {"batch_size": 2}, id="driver-envs"),
    ],
)
def test_pool_config_errors(make_env, snapshot, backend, kwargs):
    with pytest.raises(ConfigError):
        make_env(RouteEnv, 4, backend=backend, **kwargs)
    snapshot.assert_nothing_left()


def test_pool_config_accepted(make_env):
    """The boundaries of batch_size: 1 and N (N: synchronous, send/recv still work)."""
    assert make_env(RouteEnv, 4, backend="serial", batch_size=1).is_pool
    assert not make_env(RouteEnv, 4, backend="serial", batch_size=4).is_pool
    envs = make_env(
        RouteEnv,
        4,
        backend=envfleet.Processes(driver_envs=0),
        batch_size=2,
    )
    # A worker process per usable core (each env a group of its own, hosted by them).
    assert envs.is_pool and envs.num_workers == min(4, usable_cores())


@pytest.mark.parametrize("backend", ["processes", "threads"])
def test_the_default_workers_follow_the_cores_not_the_envs(make_env, backend):
    """Issue 42: a pool's default is a worker per usable core (EnvPool's thread per core), not
    one per env, which costs a process wake-up on each side of every env step."""
    cores = usable_cores()
    envs = make_env(RouteEnv, 4 * cores, backend=backend, batch_size=2 * cores)
    assert envs.is_pool and envs.num_workers == cores < envs.num_envs
    envs.async_reset(seed=0)
    _, _, _, _, info = envs.recv()
    assert len(info["env_id"]) == 2 * cores


@pytest.mark.parametrize(
    ("num_envs", "batch_size", "cores", "workers"),
    [
        (64, 32, 16, 16),  # blocks of 4, 8 a batch
        (64, 16, 16, 16),
        (16, 8, 2, 2),  # blocks of 8: one a batch
        (16, 8, 16, 16),  # one env per worker when the cores allow it
        (12, 4, 8, 6),  # 8 and 7 workers cannot split 12 envs evenly; 6 (blocks of 2) can
        (8, 3, 4, 8),  # no block fills a batch of 3 exactly: one env per worker
        (7, 6, 2, 7),
        (6, 2, 1, 6),
        (3, 1, 8, 3),
    ],
)
def test_pool_workers(num_envs, batch_size, cores, workers):
    assert pool_workers(num_envs, batch_size, cores) == workers


BAD_IDS = [
    pytest.param([-1], id="negative"),
    pytest.param([4], id="N"),
    pytest.param([0, 99], id="one-unknown"),
    pytest.param([1, 1], id="repeated"),
    pytest.param([], id="empty"),
    pytest.param([0.0, 1.0], id="floats"),
    pytest.param(["0"], id="strings"),
    pytest.param([[0, 1]], id="2-D"),
    pytest.param([True, False], id="bools"),
]


@pytest.mark.parametrize("backend", BACKENDS)
def test_invalid_env_ids_send_nothing(make_env, backend):
    envs = pool(make_env, backend, 4, 2)
    model = Model(4)
    recv_all_resets(envs, model)
    for bad in BAD_IDS:
        ids = bad.values[0]
        actions = np.zeros(np.asarray(ids).size, dtype=np.int64)
        with pytest.raises(InvalidArgumentError):
            envs.send(actions, ids)
    # The pool is unchanged: every env still awaits its action, and the actions arrive.
    envs.send(model.actions_for([3, 0]), np.array([3, 0], dtype=np.uint8))
    envs.send(model.actions_for([1, 2]), (1, 2))
    for _ in range(2):
        model.check(envs.recv(timeout=GUARD), 2)
    assert model.received == [2, 2, 2, 2]


@pytest.mark.parametrize("backend", BACKENDS)
def test_invalid_actions_send_nothing(make_env, backend):
    envs = pool(make_env, backend, 4, 2)
    model = Model(4)
    recv_all_resets(envs, model)
    bad_actions = [
        np.zeros(3, dtype=np.int64),  # 3 actions for 2 ids
        np.zeros((2, 1), dtype=np.int64),  # a wrong shape
        np.zeros(2, dtype=np.float64),  # float for a Discrete action
        np.array(["a", "b"]),
        np.int64(0),  # a scalar for two envs
    ]
    for actions in bad_actions:
        with pytest.raises(InvalidActionError):
            envs.send(actions, [0, 1])
    with pytest.raises(InvalidActionError):
        envs.send(np.zeros(3, dtype=np.int64))  # every env (the default) needs 4 actions
    envs.send(model.actions_for([0, 1]).astype(np.int32), [0, 1])  # same-kind casting works
    envs.send(model.actions_for([2, 3]).tolist(), [2, 3])
    for _ in range(2):
        model.check(envs.recv(timeout=GUARD), 2)
    assert model.received == [2, 2, 2, 2]


@pytest.mark.parametrize("backend", BACKENDS)
def test_pool_state_errors(make_env, backend):
    num_envs = 6
    envs = pool(make_env, backend, num_envs, 2)
    model = Model(num_envs)
    with pytest.raises(PoolStateError):
        envs.send(np.zeros(2, dtype=np.int64), [0, 1])
    with pytest.raises(PoolStateError):
        envs.recv(timeout=GUARD)
    envs.async_reset(seed=0)
    model.reset_all()
    # Every env is running (or ready, its result not received): none awaits an action.
    with pytest.raises(PoolStateError) as info:
        envs.send(np.zeros(1, dtype=np.int64), [0])
    assert info.value.env_indices == [0]
    with pytest.raises(PoolStateError):
        envs.async_reset()  # envs still running
    ids = model.check(envs.recv(timeout=GUARD), 2)
    others = sorted(set(range(num_envs)) - set(ids.tolist()))
    # A valid env together with one that is not awaiting an action: nothing is sent.
    with pytest.raises(PoolStateError) as info:
        envs.send(np.zeros(2, dtype=np.int64), [int(ids[0]), others[0]])
    assert info.value.env_indices == [others[0]]
    envs.send(model.actions_for(ids), ids)
    with pytest.raises(PoolStateError):
        envs.send(np.zeros(1, dtype=np.int64), [int(ids[1])])  # sent already: now running
    # Receive everything, then send to one env only: recv has fewer than batch_size.
    held: list[int] = []
    while len(model.pending) >= 2:
        held += model.check(envs.recv(timeout=GUARD), 2).tolist()
    assert not model.pending and len(held) == num_envs
    envs.send(model.actions_for(held[:1]), held[:1])
    with pytest.raises(PoolStateError):
        envs.recv(timeout=GUARD)
    # The pool is unchanged by those errors: the other envs are sent and all come back.
    envs.send(model.actions_for(held[1:]), held[1:])
    while len(model.pending) >= 2:
        model.check(envs.recv(timeout=GUARD), 2)
    assert not model.pending
    assert sorted(model.received) == [2] * 4 + [3] * 2


@pytest.mark.parametrize("backend", BACKENDS)
def test_send_twice_to_a_block_waiting_for_its_other_envs(make_env, backend):
    """With 2 envs per worker, an env sent an action waits for its partner: sending it again
    is an error, and the block steps once the partner has its action."""
    envs = pool(make_env, backend, 4, 2, num_workers=2)
    model = Model(4)
    recv_all_resets(envs, model)
    envs.send(model.actions_for([0]), [0])
    with pytest.raises(PoolStateError, match="already sent"):
        envs.send(np.zeros(1, dtype=np.int64), [0])
    with pytest.raises(PoolStateError):
        envs.recv(timeout=GUARD)  # nothing runs: env 0 waits for env 1
    envs.send(model.actions_for([1]), [1])
    ids = model.check(envs.recv(timeout=GUARD), 2)
    assert sorted(ids.tolist()) == [0, 1]


@pytest.mark.parametrize("backend", BACKENDS)
def test_pool_refuses_synchronous_calls(make_env, backend):
    envs = pool(make_env, backend, 4, 2)
    actions = np.zeros(4, dtype=np.int64)
    for when in ("before async_reset", "while running"):
        with pytest.raises(PoolStateError):
            envs.step(actions)
        with pytest.raises(PoolStateError):
            envs.reset()
        with pytest.raises(PoolStateError):
            envs.step_async(actions)
        with pytest.raises(PoolStateError):
            envs.reset_async()
        if when == "while running":
            with pytest.raises(PoolStateError):
                envs.call("steps")
        else:
            envs.async_reset(seed=0)
    model = Model(4)
    model.reset_all()
    for _ in range(2):
        ids = model.check(envs.recv(timeout=GUARD), 2)
        envs.send(model.actions_for(ids), ids)


@pytest.mark.parametrize("backend", BACKENDS)
def test_sync_mode_send_recv_and_step_mix(make_env, backend):
    """batch_size == num_envs: send/recv work (EnvPool's sync mode); step/reset/call refuse
    while envs sent via send() run, and work once they are received."""
    num_envs = 4
    envs = pool(make_env, backend, num_envs, num_envs)
    assert not envs.is_pool
    model = Model(num_envs)
    recv_all_resets(envs, model)
    envs.send(model.actions_for(range(num_envs)))  # env_ids default: every env
    with pytest.raises(PoolStateError):
        envs.step(np.zeros(num_envs, dtype=np.int64))
    with pytest.raises(PoolStateError):
        envs.reset()
    with pytest.raises(PoolStateError):
        envs.call("steps")
    with pytest.raises(PoolStateError):
        envs.async_reset()
    model.check(envs.recv(timeout=GUARD), num_envs)
    # step() now continues the same envs, in env order.
    for _ in range(5):
        actions = model.actions_for(range(num_envs))
        obs, rewards, terminated, truncated, info = envs.step(actions)
        model.check_rows(np.arange(num_envs), obs, rewards, terminated, truncated, info)
    assert envs.call("steps") == tuple(model.steps)
    envs.send(model.actions_for([2, 0, 3, 1]), [2, 0, 3, 1])
    model.check(envs.recv(timeout=GUARD), num_envs)
    obs, _ = envs.reset(seed=1)
    assert obs[:, 1].tolist() == [0] * num_envs


@pytest.mark.parametrize("backend", ["threads", "processes"])
@pytest.mark.parametrize("how", ["recv-timeout", "step_timeout"])
def test_recv_timeout_closes_the_pool(make_env, snapshot, backend, how):
    knobs = {"sleep_s": 2.0, "slow": (0, 1, 2)}  # nothing finishes within the timeout
    if how == "step_timeout":
        envs = pool(
            make_env, backend, 3, 2, knobs=knobs, supervision=envfleet.Supervision(step_timeout=0.3)
        )
    else:
        envs = pool(make_env, backend, 3, 2, knobs=knobs)
    envs.async_reset()
    with pytest.raises(StepTimeoutError):
        envs.recv(timeout=0.3) if how == "recv-timeout" else envs.recv()
    assert envs.closed
    envs.close()
    snapshot.assert_nothing_left()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("num_workers", [None, 3])
def test_env_error_keeps_the_results_of_the_others(make_env, backend, num_workers):
    """Env 2 raises on its first step (after the others finished, most likely): recv raises
    EnvError; every other env's result still arrives once; env 2's block awaits actions."""
    num_envs, batch_size = 6, 2
    knobs = {"fail_at": 1, "failing": (2,), "sleep_s": 0.2, "slow": (2,)}
    envs = pool(make_env, backend, num_envs, batch_size, num_workers=num_workers, knobs=knobs)
    block = [2] if num_workers is None else [2, 3]
    model = Model(num_envs)
    recv_all_resets(envs, model)
    envs.send(model.actions_for(range(num_envs)))
    errors: list[EnvError] = []
    for _ in range(10):  # until the error was raised and fewer than batch_size are left
        if errors and len(model.pending) < batch_size:
            break
        try:
            ids = model.check(envs.recv(timeout=GUARD), batch_size)
            assert not set(ids.tolist()) & set(block)
        except EnvError as exc:
            errors.append(exc)
            model.forget(block)
    assert len(errors) == 1, errors
    assert errors[0].env_index == 2 and errors[0].method == "step"
    # The failed block awaits actions again; everything else comes back exactly once.
    envs.send(model.actions_for(block), block)
    while len(model.pending) >= batch_size:
        model.check(envs.recv(timeout=GUARD), batch_size)
    assert not model.pending
    assert model.received == [2] * num_envs
    # And the pool goes on.
    envs.send(model.actions_for(range(num_envs)))
    for _ in range(num_envs // batch_size):
        model.check(envs.recv(timeout=GUARD), batch_size)
    assert model.received == [3] * num_envs


@pytest.mark.parametrize("backend", BACKENDS)
def test_two_envs_raising_together_are_both_reported(make_env, backend, tmp_path):
    """Two envs failing in the same wait: each EnvError is raised by a recv, and both envs
    await actions again (the second failure must not be dropped, its env left 'running')."""
    num_envs, batch_size = 4, 2
    knobs = {"fail_at": 1, "failing": (1, 3), "marker_dir": str(tmp_path)}
    # One env per worker: the two failing envs' blocks come back on their own.
    envs = pool(make_env, backend, num_envs, batch_size, knobs=knobs, num_workers=num_envs)
    model = Model(num_envs)
    recv_all_resets(envs, model)
    envs.send(model.actions_for(range(num_envs)))
    # Both failing envs have raised before the next recv (the others wrote their markers).
    deadline = time.monotonic() + GUARD
    while not all((tmp_path / f"step-{e}-1").exists() for e in (0, 2)):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    time.sleep(0.5)
    failed = []
    for _ in range(4):
        try:
            model.check(envs.recv(timeout=GUARD), batch_size)
        except EnvError as exc:
            failed.append(exc.env_index)
            model.forget([exc.env_index])
        except PoolStateError:
            break
    assert sorted(failed) == [1, 3]
    envs.send(model.actions_for([1, 3]), [1, 3])  # both await actions again
    model.check(envs.recv(timeout=GUARD), batch_size)


@pytest.mark.parametrize("backend", BACKENDS)
def test_async_reset_results_have_zero_reward_and_no_flags(make_env, backend):
    """A reset row reads reward 0, terminated/truncated False (EnvPool), not the values of the
    env's previous step."""
    num_envs = 4
    envs = pool(make_env, backend, num_envs, 2)
    model = Model(num_envs)
    recv_all_resets(envs, model)
    for _ in range(3):  # env 0 and env 1 end their 2-step episodes: terminated/truncated
        envs.send(model.actions_for([0, 1]), [0, 1])
        model.check(envs.recv(timeout=GUARD), 2)
    envs.send(model.actions_for([2, 3]), [2, 3])
    model.check(envs.recv(timeout=GUARD), 2)
    envs.async_reset(seed=5)
    for _ in range(2):
        _, rewards, terminated, truncated, info = envs.recv(timeout=GUARD)
        assert rewards.tolist() == [0.0, 0.0], info["env_id"]
        assert not terminated.any() and not truncated.any()


@pytest.mark.parametrize("backend", ["threads", "processes"])
def test_close_waits_for_envs_still_running(snapshot, backend, tmp_path):
    knobs = {"sleep_s": 0.3, "slow": (0, 1, 2, 3), "marker_dir": str(tmp_path)}
    envs = envfleet.make(route_factory(**knobs), 4, backend=backend, batch_size=2)
    try:
        envs.async_reset()
        _, _, _, _, info = envs.recv(timeout=GUARD)
        ids = info["env_id"].tolist()
        envs.send(np.array([7, 7]), ids)
    finally:
        envs.close()
    assert envs.closed
    # The envs sent actions finished their step, then every env was closed normally.
    for e in ids:
        assert (tmp_path / f"step-{e}-1").exists(), f"env {e}'s step did not finish"
    for e in range(4):
        assert (tmp_path / f"closed-{e}").exists(), f"env {e} was not closed"
    snapshot.assert_nothing_left()


def test_close_with_a_hung_env_is_bounded(snapshot, tmp_path):
    knobs = {"gate": str(tmp_path / "never"), "gated": (1,)}
    envs = envfleet.make(route_factory(**knobs), 3, backend="processes", batch_size=2)
    try:
        envs.async_reset()
        envs.recv(timeout=GUARD)  # envs 0 and 2; env 1 hangs in its reset
    finally:
        envs.close(timeout=0.5)
    assert envs.closed
    snapshot.assert_nothing_left()


# -- 5. copy=False views, copy=True copies ---------------------------------------------------------


def _shared_obs(envs) -> np.ndarray:
    return envs._backend.batch.observations  # the backend's batched observation buffer


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("copy", [False, True])
def test_copy_false_gives_views_of_ascending_runs(make_env, backend, copy):
    num_envs, batch_size = 6, 3
    # One env per worker, so that any three envs sent run, whichever worker holds them.
    envs = pool(make_env, backend, num_envs, batch_size, copy=copy, num_workers=num_envs)
    batch = envs._backend.batch  # the backend's batched buffers
    model = Model(num_envs)
    recv_all_resets(envs, model)
    seen = {True: 0, False: 0}
    # Only the envs just sent run, so each recv returns exactly those three.
    for send_ids in [[0, 2, 4], [1, 3, 5], [0, 1, 2], [3, 4, 5], [5, 1, 3], [4, 2, 0]] * 2:
        envs.send(model.actions_for(send_ids), send_ids)
        obs, *rest = result = envs.recv(timeout=GUARD)
        ids = model.check(result, batch_size)
        assert sorted(ids.tolist()) == sorted(send_ids)
        run = bool(np.all(np.diff(ids) == 1))
        assert np.shares_memory(obs, batch.observations) == (run and not copy), (ids, copy)
        owns = (batch.rewards, batch.terminations, batch.truncations)
        for arr, own in zip(rest[:3], owns, strict=True):
            assert not np.shares_memory(arr, own)  # always the caller's own arrays
        seen[run] += 1
    assert seen[False] >= 4  # [0, 2, 4] and [1, 3, 5] are never runs
    if backend == "serial":  # completion in index order: [0, 1, 2] and [3, 4, 5] are runs
        assert seen[True] >= 4


# -- 6. SAME_STEP infos and info["env_id"] ---------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_same_step_infos_are_sized_batch_size(make_env, backend):
    num_envs, batch_size = 6, 4
    envs = pool(make_env, backend, num_envs, batch_size, autoreset_mode=AutoresetMode.SAME_STEP)
    steps = [0] * num_envs
    reset_due = set(range(num_envs))
    envs.async_reset(seed=3)
    finals = 0
    for r in range(30):
        obs, rewards, terminated, truncated, info = envs.recv(timeout=GUARD)
        ids = info["env_id"]
        assert ids.dtype == np.int32 and ids.shape == (batch_size,)
        assert obs[:, 0].tolist() == ids.tolist()
        done = terminated | truncated
        if done.any():
            finals += 1
            assert info["final_obs"].dtype == object
            assert info["final_obs"].shape == (batch_size,)
            assert info["_final_obs"].tolist() == done.tolist()
            assert info["_final_info"].tolist() == done.tolist()
        else:
            assert "final_obs" not in info
        for k, e in enumerate(ids.tolist()):
            if e in reset_due:  # the result of async_reset
                reset_due.discard(e)
                assert obs[k].tolist() == [e, 0, -1] and not done[k]
                steps[e] = 0
                continue
            s = steps[e] + 1
            assert rewards[k] == s
            assert done[k] == (s >= episode_len(e))
            if done[k]:
                assert info["final_obs"][k].tolist()[:2] == [e, s]
                assert info["final_info"]["step_count"][k] == s
                assert obs[k].tolist() == [e, 0, -1]  # the next episode's first obs
                s = 0
            else:
                assert obs[k].tolist()[:2] == [e, s]
                if "final_obs" in info:
                    assert info["final_obs"][k] is None
            steps[e] = s
        envs.send(np.arange(batch_size) + 10 * r, ids)
    assert finals >= 3


# -- other start methods --------------------------------------------------------------------------


def test_routing_with_forkserver_workers(make_env):
    """Worker processes that import this module (the factory is pickled by reference)."""
    num_envs, batch_size = 4, 3
    envs = pool(make_env, envfleet.Processes(context="forkserver"), num_envs, batch_size)
    model = Model(num_envs)
    envs.async_reset()
    model.reset_all()
    deadline = time.monotonic() + GUARD
    while min(model.received) < 3:  # every env, however slow its worker was to start
        assert time.monotonic() < deadline, f"results per env: {model.received}"
        ids = model.check(envs.recv(timeout=GUARD), batch_size)
        envs.send(model.actions_for(ids), ids)


@pytest.mark.parametrize("backend", ["serial", "threads", "processes"])
@pytest.mark.parametrize("num_workers", [None, 2])
def test_partial_async_reset(make_env, backend, num_workers):
    """async_reset(env_ids=...) resets only those envs, seeded as a full reset would seed them;
    the others keep their episodes, and busy envs are refused with nothing sent."""
    n = 4
    envs = make_env("CartPole-v1", n, batch_size=2, backend=backend, num_workers=num_workers)
    envs.async_reset(seed=10)
    got: dict[int, np.ndarray] = {}
    while len(got) < n:
        obs, *_, info = envs.recv()
        got.update(zip(info["env_id"].tolist(), obs, strict=True))
    # every env awaits an action: step all once, receive all
    envs.send(np.zeros(n, np.int64), np.arange(n))
    stepped: dict[int, tuple[np.ndarray, float]] = {}
    while len(stepped) < n:
        obs, reward, *_, info = envs.recv()
        for k, e in enumerate(info["env_id"].tolist()):
            stepped[e] = (obs[k], float(reward[k]))
    with pytest.raises(envfleet.InvalidArgumentError):
        envs.async_reset(seed=[1, 2, 3], env_ids=[1, 3])  # one seed per env id
    envs.async_reset(seed=[101, 103], env_ids=[1, 3])
    if num_workers == 2:  # env 0 shares its worker with env 1, which is resetting
        with pytest.raises(envfleet.PoolStateError, match="still running"):
            envs.async_reset(env_ids=[0])
    with pytest.raises(envfleet.PoolStateError, match="still running"):
        envs.async_reset(env_ids=[1])
    reset: dict[int, tuple] = {}
    while len(reset) < 2:
        obs, reward, terminated, truncated, info = envs.recv()
        for k, e in enumerate(info["env_id"].tolist()):
            reset[e] = (obs[k], reward[k], terminated[k], truncated[k])
    assert sorted(reset) == [1, 3]
    for e, seed in ((1, 101), (3, 103)):
        want, _ = gym.make("CartPole-v1").reset(seed=seed)
        assert np.array_equal(reset[e][0], want)
        assert (reset[e][1], reset[e][2], reset[e][3]) == (0.0, False, False)
    # envs 0 and 2 kept their episodes: their next step continues from their stepped state
    envs.send(np.zeros(n, np.int64), np.arange(n))
    after: dict[int, np.ndarray] = {}
    while len(after) < n:
        obs, *_, info = envs.recv()
        after.update(zip(info["env_id"].tolist(), obs, strict=True))
    for e in (0, 2):
        model = gym.make("CartPole-v1")
        model.reset(seed=10 + e)
        model.step(0)
        assert np.array_equal(after[e], model.step(0)[0])


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", ["serial", "threads", "processes"])
def test_sync_mode_env_error_loses_the_batch_and_carries_on(make_env, backend):
    """batch_size == num_envs: an env error in recv loses that batch, as step() would, and
    every env awaits an action again (no env is left running for ever)."""
    from tests.envs import RaisingEnv

    factory = functools.partial(RaisingEnv, fail_index=1, fail_in="step", fail_after=1)
    envs = make_env(factory, 4, batch_size=4, backend=backend, num_workers=2)
    envs.async_reset(seed=0)
    envs.recv()
    envs.send(np.zeros(4, np.int64))
    envs.recv()
    envs.send(np.zeros(4, np.int64))
    with pytest.raises(envfleet.EnvError) as info:
        envs.recv()
    assert info.value.env_index == 1
    with pytest.raises(envfleet.PoolStateError, match="only 0 are running"):
        envs.recv()
    envs.async_reset(seed=1)  # env 1 is fine again after a reset
    _, _, _, _, info = envs.recv()
    assert sorted(info["env_id"].tolist()) == [0, 1, 2, 3]


@pytest.mark.parametrize(
    "env_ids, message",
    [
        ([3, 5, 3], r"repeated env ids \[3\]"),
        ([1, 1, 2, 2], r"repeated env ids \[1, 2\]"),
        ([0, 8], r"unknown env ids \[8\]"),
        ([], "env_ids is empty"),
    ],
)
def test_send_names_bad_env_ids_and_sends_nothing(env_ids: list[int], message: str) -> None:
    envs = envfleet.make("CartPole-v1", 8, backend="serial", batch_size=4, num_workers=8)
    try:
        envs.async_reset(seed=0)
        _, _, _, _, info = envs.recv()
        with pytest.raises(envfleet.InvalidArgumentError, match=message):
            envs.send(np.zeros(len(env_ids), dtype=np.int64), env_ids)
        envs.send(np.zeros(4, dtype=np.int64), info["env_id"])  # the pool goes on
        assert len(envs.recv()[4]["env_id"]) == 4
    finally:
        envs.close()


def test_a_ctrl_c_just_after_the_wait_took_replies_loses_none(monkeypatch):
    """A Ctrl-C raised just after a pool's wait took the replies' tokens (an interrupt comes
    at any bytecode; the wait's account of who replied is then lost) undoes the recv, and
    the replies it had taken come back in the next recvs: every env once, none lost (they
    used to be: their tokens gone, those envs were never seen again, here a
    StepTimeoutError). The workers' REQ/ACK words tell who replied, on the semaphores a
    pool runs on as on the round bell."""
    from envfleet._backends.processes.worker import ACK, REQ

    envs = envfleet.make(
        "CartPole-v1",
        4,
        batch_size=2,
        num_workers=4,
        supervision=envfleet.Supervision(step_timeout=GUARD, restart_policy=None),
    )
    try:
        transport = envs._backend.transport
        envs.async_reset(seed=0)
        words = transport.workers.words
        end = time.monotonic() + GUARD
        while not all(w[REQ] == w[ACK] for w in words):  # every worker replied
            assert time.monotonic() < end, "the resets never replied"
            time.sleep(0.001)
        real_wait = transport.wait

        def wait_then_interrupted(*args: Any, **kwargs: Any) -> Any:
            real_wait(*args, **kwargs)  # takes the tokens of every reply
            raise KeyboardInterrupt

        monkeypatch.setattr(transport, "wait", wait_then_interrupted)
        with pytest.raises(KeyboardInterrupt) as info:
            envs.recv()
        assert "the wait was undone" in "\n".join(getattr(info.value, "__notes__", []))
        monkeypatch.undo()
        assert not envs.closed
        seen = [envs.recv()[4]["env_id"].tolist() for _ in range(2)]
        assert sorted(e for ids in seen for e in ids) == [0, 1, 2, 3], seen
        for _ in range(3):  # each env sent an action comes back once per send
            envs.send(np.zeros(4, np.int64), np.arange(4))
            ids = [e for _ in range(2) for e in envs.recv()[4]["env_id"].tolist()]
            assert sorted(ids) == [0, 1, 2, 3], ids
    finally:
        envs.close()
