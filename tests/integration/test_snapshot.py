"""Issue 32 item 5: snapshots that resume a vector env exactly.

Run 300 steps, ``envs.snapshot()``, run 300 more; a vector env made with ``resume=`` on
another backend and worker count (and, once, in a fresh process from a saved file) runs the
same 300 steps: identical observations, rewards and done flags, in each autoreset mode.
"""

from __future__ import annotations

import copy
import hashlib
import pickle
import subprocess
import sys
from typing import Any

import numpy as np
import pytest
from gymnasium.vector import AutoresetMode

import envfleet

MODES = [AutoresetMode.NEXT_STEP, AutoresetMode.SAME_STEP, AutoresetMode.DISABLED]


def _digest(obs: np.ndarray) -> list[bytes]:
    return [
        hashlib.blake2b(np.ascontiguousarray(row).tobytes(), digest_size=16).digest() for row in obs
    ]


def _actions(t: int, actions: int | tuple[int, ...], num_envs: int) -> np.ndarray:
    """Step ``t``'s actions, drawn from their own seed: ``actions`` discrete actions (an int),
    or a Box in [-1, 1] of that shape (float32)."""
    rng = np.random.default_rng(t)
    if isinstance(actions, int):
        return rng.integers(0, actions, num_envs)
    return rng.uniform(-1.0, 1.0, (num_envs, *actions)).astype(np.float32)


def _steps(
    envs: Any, first: int, count: int, actions: int | tuple[int, ...], mode: AutoresetMode
) -> list[Any]:
    """``count`` steps with the actions of steps ``first, first + 1, ...`` (see
    :func:`_actions`); with DISABLED the envs that ended are reset (no seed) after each step."""
    seen = []
    for t in range(first, first + count):
        obs, rewards, terminated, truncated, _ = envs.step(_actions(t, actions, envs.num_envs))
        seen.append((_digest(obs), rewards.tolist(), terminated.tolist(), truncated.tolist()))
        if mode is AutoresetMode.DISABLED and (terminated | truncated).any():
            obs, _ = envs.reset(options={"reset_mask": terminated | truncated})
            seen.append(_digest(obs))
    return seen


CASES = [
    *[("CartPole-v1", 2, mode, 300, {}) for mode in MODES],
    ("LunarLander-v3", 4, AutoresetMode.NEXT_STEP, 300, {}),
    ("LunarLander-v3", 4, AutoresetMode.SAME_STEP, 300, {}),
    pytest.param(
        "ALE/Pong-v5",
        6,
        AutoresetMode.NEXT_STEP,
        300,
        {"supervision": envfleet.Supervision(replay_steps=4000)},
        marks=pytest.mark.atari,
    ),
    # MuJoCo: episodes cut at 200 steps, so that autoresets (whose start is the generator's
    # state: HalfCheetah's reset noise) fall on both sides of the snapshot.
    *[
        ("HalfCheetah-v5", (6,), mode, 300, {"env_kwargs": {"max_episode_steps": 200}})
        for mode in MODES
    ],
]


@pytest.mark.parametrize(
    "env_id, actions, mode, steps, kwargs",
    CASES,
    ids=lambda v: getattr(v, "value", v) if not isinstance(v, dict) else "",
)
def test_a_resumed_vector_env_continues_the_run_exactly(
    make_env: Any,
    env_id: str,
    actions: int | tuple[int, ...],
    mode: AutoresetMode,
    steps: int,
    kwargs: Any,
) -> None:
    if env_id.startswith("ALE/"):
        pytest.importorskip("ale_py")
    if env_id.startswith("HalfCheetah"):
        pytest.importorskip("mujoco")  # envfleet[mujoco]
    first = make_env(env_id, 4, backend="processes", num_workers=2, autoreset_mode=mode, **kwargs)
    first.reset(seed=1)
    _steps(first, 0, steps, actions, mode)
    state = pickle.loads(pickle.dumps(first.snapshot()))  # it travels
    expected = _steps(first, steps, steps, actions, mode)
    again = make_env(
        env_id, 4, backend="threads", num_workers=3, autoreset_mode=mode, resume=state, **kwargs
    )
    assert _steps(again, steps, steps, actions, mode) == expected


def test_a_snapshot_file_resumes_in_a_fresh_process(make_env: Any, tmp_path: Any) -> None:
    """Saved to a file, loaded in another Python process on ``serial``: the same steps."""
    first = make_env("CartPole-v1", 4, backend="processes", num_workers=2)
    first.reset(seed=5)
    _steps(first, 0, 300, 2, AutoresetMode.NEXT_STEP)
    path = tmp_path / "run.snapshot"
    first.snapshot().save(str(path))
    expected = _steps(first, 300, 300, 2, AutoresetMode.NEXT_STEP)
    out = tmp_path / "seen.pickle"
    script = (
        "import pickle, sys, envfleet\n"
        "from gymnasium.vector import AutoresetMode\n"
        "from tests.integration.test_snapshot import _steps\n"
        "state = envfleet.Snapshot.load(sys.argv[1])\n"
        "envs = envfleet.make('CartPole-v1', 4, backend='serial', resume=state)\n"
        "seen = _steps(envs, 300, 300, 2, AutoresetMode.NEXT_STEP)\n"
        "open(sys.argv[2], 'wb').write(pickle.dumps(seen))\n"
    )
    subprocess.run([sys.executable, "-c", script, str(path), str(out)], check=True, timeout=120)
    assert pickle.loads(out.read_bytes()) == expected


def test_what_cannot_be_snapshotted_or_resumed_says_why(make_env: Any, tmp_path: Any) -> None:
    # Box2D's world does not pickle: LunarLander cannot be checkpointed past replay_steps
    long = make_env(
        "LunarLander-v3", 2, backend="serial", supervision=envfleet.Supervision(replay_steps=3)
    )
    long.reset(seed=0)
    for _ in range(5):
        long.step(np.zeros(2, np.int64))
    with pytest.raises(envfleet.UnsupportedError, match="longer than replay_steps=3"):
        long.snapshot()
    none = make_env(
        "CartPole-v1", 2, backend="serial", supervision=envfleet.Supervision(replay_steps=0)
    )
    none.reset(seed=0)
    with pytest.raises(envfleet.UnsupportedError, match="replay_steps > 0"):
        none.snapshot()
    pool = make_env("CartPole-v1", 2, backend="serial", batch_size=1)
    with pytest.raises(envfleet.PoolStateError, match="async_reset"):
        pool.snapshot()
    pool.async_reset(seed=0)  # two results wait for recv(): not for a synchronous vector env
    waiting = pool.snapshot()
    with pytest.raises(envfleet.ConfigError, match="resume it into a pool"):
        envfleet.make("CartPole-v1", 2, backend="serial", resume=waiting)
    ok = make_env("CartPole-v1", 2, backend="serial")
    ok.reset(seed=0)
    state = ok.snapshot()
    with pytest.raises(envfleet.ConfigError, match="snapshot is of 2 envs"):
        envfleet.make("CartPole-v1", 3, backend="serial", resume=state)
    with pytest.raises(envfleet.ConfigError, match="resume must be an envfleet.Snapshot"):
        envfleet.make("CartPole-v1", 2, backend="serial", resume={"not": "a snapshot"})
    other = tmp_path / "other"
    other.write_bytes(b"\x80\x04not one")
    with pytest.raises(envfleet.ReplayFileError, match="not an envfleet snapshot file"):
        envfleet.Snapshot.load(str(other))


def _pool_run(envs: Any, rounds: int, counts: dict[int, int], seen: dict[int, list[Any]]) -> None:
    """``rounds`` of recv -> send on a first-ready pool, each env's action a function of its
    own step count (so that the order envs come in does not matter); each env's results in
    ``seen`` (per env, in its own order)."""
    for _ in range(rounds):
        obs, rewards, terminated, truncated, info = envs.recv()
        ids = info["env_id"]
        for k, e in enumerate(ids.tolist()):
            seen.setdefault(e, []).append(
                (
                    _digest(obs[k : k + 1])[0],
                    float(rewards[k]),
                    bool(terminated[k]),
                    bool(truncated[k]),
                )
            )
        actions = np.array(
            [np.random.default_rng([e, counts.get(e, 0)]).integers(0, 2) for e in ids.tolist()]
        )
        for e in ids.tolist():
            counts[e] = counts.get(e, 0) + 1
        envs.send(actions, ids)


@pytest.mark.parametrize("mode", [AutoresetMode.NEXT_STEP, AutoresetMode.SAME_STEP], ids=str)
def test_a_first_ready_pool_resumes_with_its_results_waiting(
    make_env: Any, mode: AutoresetMode
) -> None:
    """A pool of 6 envs (3 workers, ``batch_size=2``) snapshotted right after a send (envs in
    flight: they finish first, their results wait in the snapshot), resumed on another
    backend: every env goes on with the same results, whatever order they come in."""
    kwargs: dict[str, Any] = {"batch_size": 2, "autoreset_mode": mode}
    first = make_env("CartPole-v1", 6, backend="processes", num_workers=3, **kwargs)
    first.async_reset(seed=5)
    counts: dict[int, int] = {}
    _pool_run(first, 150, counts, {})
    state = pickle.loads(pickle.dumps(first.snapshot()))
    assert state.pool is not None and len(state.pool.ready) >= 2
    resumed_counts = dict(counts)
    expected: dict[int, list[Any]] = {}
    _pool_run(first, 150, counts, expected)
    again = make_env("CartPole-v1", 6, backend="threads", num_workers=2, resume=state, **kwargs)
    got: dict[int, list[Any]] = {}
    _pool_run(again, 150, resumed_counts, got)
    # Each env's results in its own order; the pools may interleave envs differently, so
    # compare each env over the steps both saw.
    for e in range(6):
        n = min(len(expected.get(e, [])), len(got.get(e, [])))
        assert n >= 20, (e, n)
        assert got[e][:n] == expected[e][:n], e


def test_a_pools_actions_sent_to_a_worker_not_yet_stepped_travel(make_env: Any) -> None:
    """One worker of two envs, ``batch_size=1``: env 0 is sent its action while env 1's result
    waits, so the worker has not stepped. The snapshot holds both; the resumed pool returns
    env 1's result, then steps the worker once env 1 has its action too, as the first would."""
    first = make_env("CartPole-v1", 2, backend="processes", num_workers=1, batch_size=1)
    first.async_reset(seed=2)
    counts: dict[int, int] = {}
    _pool_run(first, 41, counts, {})
    state = pickle.loads(pickle.dumps(first.snapshot()))
    assert state.pool is not None and len(state.pool.sent) == 1 and len(state.pool.ready) == 1
    resumed_counts = dict(counts)
    expected: dict[int, list[Any]] = {}
    _pool_run(first, 60, counts, expected)
    again = make_env("CartPole-v1", 2, backend="serial", batch_size=1, resume=state)
    got: dict[int, list[Any]] = {}
    _pool_run(again, 60, resumed_counts, got)
    assert got == expected


def _pistonball() -> Any:
    from pettingzoo.butterfly import pistonball_v6

    return pistonball_v6.parallel_env(n_pistons=4, max_cycles=25)


@pytest.mark.parametrize("mode", [AutoresetMode.NEXT_STEP, AutoresetMode.SAME_STEP], ids=str)
def test_a_pettingzoo_vector_env_resumes_exactly(make_env: Any, mode: AutoresetMode) -> None:
    """Pistonball (episodes of 25 cycles, so that autoresets happen): the PettingZoo env's own
    generator travels in the snapshot, and the resumed MultiAgentVectorEnv continues."""
    pytest.importorskip("pettingzoo.butterfly")

    def steps(envs: Any, first: int) -> list[Any]:
        seen = []
        for t in range(first, first + 60):
            actions = np.random.default_rng(t).uniform(-1, 1, (2, 4, 1)).astype(np.float32)
            obs, rewards, terminated, truncated, _ = envs.step(actions)
            seen.append((_digest(obs), rewards.tolist(), terminated.tolist(), truncated.tolist()))
        return seen

    first = make_env(_pistonball, 2, backend="processes", num_workers=2, autoreset_mode=mode)
    first.reset(seed=3)
    steps(first, 0)
    state = pickle.loads(pickle.dumps(first.snapshot()))
    expected = steps(first, 60)
    again = make_env(_pistonball, 2, backend="serial", autoreset_mode=mode, resume=state)
    assert steps(again, 60) == expected


def _lean(obs: np.ndarray) -> np.ndarray:
    """A deterministic CartPole policy: push the way the pole leans."""
    return (obs[:, 2] + 0.1 * obs[:, 3] > 0).astype(np.int64)


class _Noisy:
    """A stochastic CartPole policy with its own generator (seeded per worker copy through
    ``seed``, as the Sampler seeds copies): it leans with probability 0.8."""

    def __init__(self) -> None:
        self.rng = np.random.default_rng(0)

    def seed(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)

    def __call__(self, obs: np.ndarray) -> np.ndarray:
        lean = _lean(obs)
        flip = self.rng.random(len(obs)) < 0.2
        return np.where(flip, 1 - lean, lean)


FIELDS = ["observations", "actions", "rewards", "terminated", "truncated"]
FIELDS += ["last_observations", "env_index", "policy_version", "lengths"]


def _same_batches(got: Any, expected: Any) -> None:
    assert got.num_steps == expected.num_steps
    for name in FIELDS:
        assert np.array_equal(getattr(got, name), getattr(expected, name)), name


def test_a_samplers_snapshot_resumes_its_next_batch_exactly() -> None:
    """A driver-inference Sampler, its policy updated once: the resumed sampler (another
    backend) returns the same next batch, policy version included."""
    first = envfleet.Sampler(
        "CartPole-v1", _lean, 4, inference="driver", seed=3, backend="processes", num_workers=2
    )
    try:
        first.sample(200)
        first.update_policy()
        first.sample(200)
        state = pickle.loads(pickle.dumps(first.snapshot()))
        expected = first.sample(300)
    finally:
        first.close()
    again = envfleet.Sampler(
        "CartPole-v1", _lean, 4, inference="driver", backend="serial", resume=state
    )
    try:
        got = again.sample(300)
        assert again.policy_version == 1
    finally:
        again.close()
    _same_batches(got, expected)


@pytest.mark.parametrize("background", [False, True], ids=["foreground", "background"])
def test_a_worker_inference_snapshot_resumes_exactly(background: bool) -> None:
    """Worker inference: each worker's policy copy travels with its generator, a policy
    update not yet sent travels too, and a background round's rollouts are kept; the resumed
    sampler (same workers, a fresh set of processes) returns the same next batches."""
    kwargs: dict[str, Any] = {"inference": "worker", "backend": "processes", "num_workers": 2}
    kwargs.update(segment_length=16, background=background)
    first = envfleet.Sampler("CartPole-v1", _Noisy(), 4, seed=5, **kwargs)
    try:
        first.sample(300)
        state = pickle.loads(pickle.dumps(first.snapshot()))
        expected = [first.sample(300)]
        first.update_policy()  # sent with the next round: the second snapshot holds it
        second = pickle.loads(pickle.dumps(first.snapshot()))
        expected.append(first.sample(300))
    finally:
        first.close()
    for taken, batch in ((state, expected[0]), (second, expected[1])):
        again = envfleet.Sampler("CartPole-v1", _Noisy(), 4, resume=taken, **kwargs)
        try:
            _same_batches(again.sample(300), batch)
        finally:
            again.close()
    assert state.workers is not None and state.workers.update is None
    assert second.workers is not None and second.workers.update is not None


def test_an_auto_samplers_snapshot_resumes_in_the_mode_it_chose() -> None:
    """``inference="auto"``: no snapshot while it calibrates; after, the snapshot resumes in
    the mode it chose, without calibrating again, and continues exactly."""
    kwargs: dict[str, Any] = {"backend": "processes", "num_workers": 2, "segment_length": 8}
    policy = _Noisy()  # driver inference draws from it: the caller keeps it, as its weights
    first = envfleet.Sampler("CartPole-v1", policy, 4, seed=1, **kwargs)
    try:
        first.sample(50)
        with pytest.raises(envfleet.UnsupportedError, match="calibrates"):
            first.snapshot()
        first.sample(6 * 4 * 8)  # the calibration's pieces: 6 rounds of 4 envs x 8 steps
        mode = first.report().inference
        state = pickle.loads(pickle.dumps(first.snapshot()))
        kept = copy.deepcopy(policy)
        expected = first.sample(200)
    finally:
        first.close()
    assert state.inference == mode
    again = envfleet.Sampler("CartPole-v1", kept, 4, resume=state, **kwargs)
    try:
        _same_batches(again.sample(200), expected)
        assert again.report().inference == mode
        assert "resumed a snapshot (calibrated" in again.report().choice
    finally:
        again.close()


@pytest.mark.parametrize("inference", ["driver", "worker"])
def test_a_multi_agent_samplers_snapshot_resumes_exactly(inference: str) -> None:
    """A PettingZoo env (pistonball, episodes of 25 cycles) under the Sampler, with a policy
    on agent rows: the resumed sampler returns the same per-agent segments."""
    pytest.importorskip("pettingzoo.butterfly")

    class Pistons:
        def __init__(self) -> None:
            self.rng = np.random.default_rng(0)

        def seed(self, seed: int) -> None:
            self.rng = np.random.default_rng(seed)

        def __call__(self, obs: np.ndarray) -> np.ndarray:
            return self.rng.uniform(-1, 1, (len(obs), 1)).astype(np.float32)

    kwargs: dict[str, Any] = {"inference": inference, "backend": "processes", "num_workers": 2}
    policy = Pistons()
    first = envfleet.Sampler(_pistonball, policy, 2, seed=2, segment_length=10, **kwargs)
    try:
        first.sample(40)
        state = pickle.loads(pickle.dumps(first.snapshot()))
        kept = copy.deepcopy(policy)  # the driver's draws: the caller keeps its policy
        expected = first.sample(60)
    finally:
        first.close()
    again = envfleet.Sampler(_pistonball, kept, 2, segment_length=10, resume=state, **kwargs)
    try:
        got = again.sample(60)
    finally:
        again.close()
    _same_batches(got, expected)
    assert np.array_equal(got.agent_index, expected.agent_index)


def _per_env(batch: Any) -> dict[int, list[Any]]:
    """Each env's steps in a batch, in its own order: (observation, action, reward)."""
    out: dict[int, list[Any]] = {}
    starts = np.concatenate([[0], np.cumsum(batch.lengths)[:-1]])
    for seg, (start, n) in enumerate(zip(starts.tolist(), batch.lengths.tolist(), strict=True)):
        rows = out.setdefault(int(batch.env_index[seg]), [])
        for t in range(start, start + n):
            obs = batch.observations[t].tobytes()
            rows.append((obs, int(batch.actions[t]), float(batch.rewards[t])))
    return out


def test_a_samplers_snapshot_over_a_first_ready_pool_resumes_each_env() -> None:
    """Driver inference over a pool (``batch_size=2`` of 6): the snapshot lets the envs in
    flight finish and keeps each env's last observation, action and version; the resumed
    sampler's envs go on as the first one's, whatever order they come in."""
    kwargs: dict[str, Any] = {"inference": "driver", "batch_size": 2}
    first = envfleet.Sampler(
        "CartPole-v1", _lean, 6, seed=8, backend="processes", num_workers=3, **kwargs
    )
    try:
        first.sample(300)
        state = pickle.loads(pickle.dumps(first.snapshot()))
        expected = _per_env(first.sample(600))
    finally:
        first.close()
    again = envfleet.Sampler("CartPole-v1", _lean, 6, backend="threads", resume=state, **kwargs)
    try:
        got = _per_env(again.sample(600))
    finally:
        again.close()
    for e in range(6):
        n = min(len(expected[e]), len(got[e]))
        assert n >= 30 and got[e][:n] == expected[e][:n], e
    with pytest.raises(envfleet.ConfigError, match="into a pool"):
        envfleet.Sampler("CartPole-v1", _lean, 6, inference="driver", resume=state)


def test_a_sampler_snapshot_where_it_is_not_built_says_so() -> None:
    driver = envfleet.Sampler("CartPole-v1", _lean, 2, inference="driver", backend="serial")
    try:
        with pytest.raises(envfleet.UnsupportedError, match="before the first sample"):
            driver.snapshot()
        driver.sample(10)
        state = driver.snapshot()
    finally:
        driver.close()
    with pytest.raises(envfleet.ConfigError, match="taken with inference='driver'"):
        envfleet.Sampler("CartPole-v1", _lean, 2, inference="worker", resume=state)
    worker = envfleet.Sampler(
        "CartPole-v1", _Noisy(), 4, inference="worker", backend="processes", num_workers=2
    )
    try:
        worker.sample(10)
        taken = worker.snapshot()
    finally:
        worker.close()
    with pytest.raises(envfleet.ConfigError, match="resumes on the same workers"):
        envfleet.Sampler(
            "CartPole-v1", _Noisy(), 4, inference="worker", backend="processes",
            num_workers=3, resume=taken,
        )  # fmt: skip


def _snapshot_past_replay_steps(
    make_env: Any, env_id: str, num_envs: int, replay_steps: int, at: int, more: int
) -> Any:
    """``at`` steps (far past ``replay_steps`` into an episode), a snapshot, ``more`` steps;
    the same ``more`` steps from ``make(..., resume=snapshot)`` give the same results, bit
    for bit. Returns the snapshot."""
    envs = make_env(env_id, num_envs, supervision=envfleet.Supervision(replay_steps=replay_steps))
    space = envs.single_action_space
    space.seed(0)
    actions = [np.stack([space.sample() for _ in range(num_envs)]) for _ in range(at + more)]
    envs.reset(seed=0)
    for t in range(at):
        envs.step(actions[t])
    state = envs.snapshot()
    want = [envs.step(actions[t])[:4] for t in range(at, at + more)]
    envs.close()
    again = make_env(
        env_id, num_envs, supervision=envfleet.Supervision(replay_steps=replay_steps), resume=state
    )
    got = [again.step(actions[t])[:4] for t in range(at, at + more)]
    for k, (a, b) in enumerate(zip(got, want, strict=True)):
        for x, y in zip(a, b, strict=True):
            assert np.array_equal(x, y), f"step {at + k} differs after the resume"
    # No record holds more than replay_steps actions: each began at a checkpoint.
    assert all(r.complete and r.steps <= replay_steps for r in state.recordings)
    return state


def test_a_snapshot_at_any_step_of_cartpole(make_env: Any) -> None:
    """CartPole x4 under the defaults, replay_steps=40, snapshot at step 300: episodes run
    past 40 steps, their envs are checkpointed (their state pickles, TimeLimit's counter and
    np_random included) and the resumed run is bit-exact."""
    state = _snapshot_past_replay_steps(make_env, "CartPole-v1", 4, 40, 300, 60)
    assert any(r.start[0] == "state" for r in state.recordings)


@pytest.mark.atari
def test_a_snapshot_mid_episode_of_pong(make_env: Any) -> None:
    """ALE/Pong-v5 x2 (episodes of thousands of steps), replay_steps=50, snapshot at step
    180: ALE's state with its generator (cloneState) is the checkpoint."""
    pytest.importorskip("ale_py")
    state = _snapshot_past_replay_steps(make_env, "ALE/Pong-v5", 2, 50, 180, 60)
    assert all(r.start[0] == "state" for r in state.recordings)


def test_a_snapshot_mid_episode_of_halfcheetah(make_env: Any) -> None:
    """HalfCheetah-v5 x2 (1,000-step episodes), replay_steps=100, snapshot at step 250:
    MuJoCo's integration state (mj_getState: time, qpos, qvel, warm start) is the
    checkpoint."""
    pytest.importorskip("mujoco")
    state = _snapshot_past_replay_steps(make_env, "HalfCheetah-v5", 2, 100, 250, 60)
    assert all(r.start[0] == "state" for r in state.recordings)
