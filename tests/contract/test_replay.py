"""Issue 32 item 3: a failure carries a replay that reproduces it in one process.

An env with a bug its seed reaches (``tests.envs.BuggyEnv``: a draw from ``np_random`` after
action 1, over episodes that autoreset) raises, segfaults or hangs in a worker; the error's
``err.replay`` holds the env's factory, how its episode began (the seed, or the ``np_random``
state at its autoreset) and its actions since, and running it here fails again at the same
step. Real envs, real workers, real signals; timeouts are hang guards and ``step_timeout``
values, never speed bounds.
"""

from __future__ import annotations

import functools
import pickle
import signal
from typing import Any

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.vector import AutoresetMode

import envfleet
from envfleet import cli
from envfleet._core.replay import MAGIC, load_replay
from envfleet._core.replay_runner import watch_replay
from tests.envs import BuggyEnv

SEED = 7


def _buggy(how: str, p: float = 0.004) -> Any:
    return functools.partial(BuggyEnv, how=how, p=p)


def _run_to_failure(envs: Any, num_envs: int, errors: Any) -> tuple[Any, list[np.ndarray]]:
    """Reset with :data:`SEED`, step with random actions until ``errors`` is raised: the
    error and every action sent."""
    rng = np.random.default_rng(0)
    sent: list[np.ndarray] = []
    envs.reset(seed=SEED)
    with pytest.raises(errors) as info:
        for _ in range(20_000):
            actions = rng.integers(0, 2, num_envs)
            sent.append(actions)
            envs.step(actions)
    return info.value, sent


def _assert_recorded(recording: Any, sent: list[np.ndarray], env_index: int) -> None:
    """The recording holds the env's episode: its last actions are those sent to it."""
    assert recording.complete and recording.steps == len(recording.actions) > 0
    tail = [int(a[env_index]) for a in sent[-len(recording.actions) :]]
    assert [int(a) for a in recording.actions] == tail


@pytest.mark.per_backend(
    "mode",
    lambda backend: (
        [AutoresetMode.NEXT_STEP, AutoresetMode.SAME_STEP]
        if backend.cheap
        else [AutoresetMode.NEXT_STEP]
    ),
)
def test_an_env_errors_replay_raises_it_again(
    make_env: Any, backend: Any, mode: AutoresetMode, tmp_path: Any
) -> None:
    """Env 1 raises after many autoresets: ``err.replay`` holds its episode from the
    ``np_random`` state at its autoreset; run here (in memory, and from a file), it raises
    the same exception at the same step."""
    envs = make_env(
        _buggy("raise"),
        2,
        **backend.options,
        num_workers=2 if backend.workers else 1,
        autoreset_mode=mode,
    )
    err, sent = _run_to_failure(envs, 2, envfleet.EnvError)
    replay = err.replay
    assert (replay.kind, [r.env_index for r in replay.envs]) == ("error", [1])
    [recording] = replay.envs
    assert recording.start[0] == "rng"  # an autoreset's episode, long after the seed
    _assert_recorded(recording, sent, 1)
    with pytest.raises(ValueError, match="bug hit at step") as again:
        envfleet.replay(replay)
    assert str(again.value) == str(err.__cause__)
    path = str(tmp_path / "failure.replay")
    replay.save(path)
    with pytest.raises(ValueError) as from_file:
        envfleet.replay(path)
    assert str(from_file.value) == str(err.__cause__)


@pytest.mark.backends(cheap=True)
def test_a_failure_in_the_first_episode_replays_from_its_seed(make_env: Any, backend: Any) -> None:
    """A bug in the episode a seeded reset began: the replay starts from that seed."""
    envs = make_env(_buggy("raise", p=0.3), 2, **backend.options)
    err, sent = _run_to_failure(envs, 2, envfleet.EnvError)
    [recording] = err.replay.envs
    assert recording.start == ("seed", SEED + 1, None)  # reset(seed=7) seeds env 1 with 8
    _assert_recorded(recording, sent, 1)
    with pytest.raises(ValueError, match="bug hit"):
        envfleet.replay(err.replay)


@pytest.mark.backends("processes", "processes-spawn", "ray")
def test_a_crash_replays_the_same_segfault_in_a_watched_child(
    make_env: Any, snapshot: Any, backend: Any, tmp_path: Any
) -> None:
    """Env 1 writes at address 0 (a real SIGSEGV) after many autoresets: the EnvCrashedError's
    replay holds both envs of the dead worker (read from the file its process wrote: a Ray
    actor's too, through its node's helper), and ``envfleet replay`` sees the child die of
    SIGSEGV in env 1's step where the worker did. Fail-fast (``restart_policy=None``): the
    first crash is the one replayed, not the last of the default policy's restarts (a new
    Ray actor each, minutes on a loaded host)."""
    envs = make_env(
        _buggy("null-write"),
        4,
        **backend.options,
        num_workers=2,
        supervision=envfleet.Supervision(restart_policy=None),
    )
    err, sent = _run_to_failure(envs, 4, envfleet.EnvCrashedError)
    assert err.signal == (None if backend.name == "ray" else signal.SIGSEGV)  # Ray: no exit code
    replay = err.replay
    assert replay.kind == "crash" and [r.env_index for r in replay.envs] == [0, 1]
    _assert_recorded(replay.envs[1], sent, 1)
    path = str(tmp_path / "crash.replay")
    replay.save(path)
    outcome = watch_replay(path, stderr=open(tmp_path / "child.err", "w"))  # noqa: SIM115
    assert (outcome.how, outcome.reproduced, outcome.detail) == ("died", True, "signal SIGSEGV")
    assert (outcome.env_index, outcome.step) == (1, replay.envs[1].steps)
    assert "Segmentation fault" in (tmp_path / "child.err").read_text()
    if backend.name != "ray":  # Ray's own processes outlive the vector env
        snapshot.assert_nothing_left()  # no worker, no stack file, no action-log file


@pytest.mark.backends("threads", "processes")
def test_a_hangs_replay_hangs_at_the_same_step(make_env: Any, backend: Any, tmp_path: Any) -> None:
    """Env 1 sleeps past ``step_timeout`` after many autoresets: the StepTimeoutError's replay
    hangs again at env 1's same step, which the watcher reports."""
    envs = make_env(
        _buggy("sleep:60"),
        2,
        **backend.options,
        num_workers=2,
        supervision=envfleet.Supervision(step_timeout=1.0),
    )
    err, sent = _run_to_failure(envs, 2, envfleet.StepTimeoutError)
    replay = err.replay
    assert (replay.kind, replay.timeout_s) == ("hang", 1.0)
    recording = next(r for r in replay.envs if r.env_index == 1)
    _assert_recorded(recording, sent, 1)
    path = str(tmp_path / "hang.replay")
    replay.save(path)
    outcome = watch_replay(path, stderr=open(tmp_path / "child.err", "w"))  # noqa: SIM115
    assert (outcome.how, outcome.reproduced) == ("hung", True)
    assert (outcome.env_index, outcome.step, outcome.method) == (1, recording.steps, "step")
    assert "in step" in (tmp_path / "child.err").read_text()  # its stack, before the kill


@pytest.mark.backends("serial", "processes")
def test_the_first_ready_pools_errors_carry_a_replay(make_env: Any, backend: Any) -> None:
    """In a first-ready pool (send/recv), env 1's error carries its replay too."""
    envs = make_env(_buggy("raise", p=0.05), 3, **backend.options, batch_size=2)
    envs.async_reset(seed=SEED)
    rng = np.random.default_rng(1)
    with pytest.raises(envfleet.EnvError) as info:
        for _ in range(5_000):
            _, _, _, _, infos = envs.recv()
            envs.send(rng.integers(0, 2, len(infos["env_id"])), infos["env_id"])
    [recording] = info.value.replay.envs
    assert recording.env_index == 1 and recording.complete
    with pytest.raises(ValueError, match="bug hit"):
        envfleet.replay(info.value.replay)


@pytest.mark.backends("serial", "processes")
@pytest.mark.parametrize("inference", ["driver", "worker"])
def test_a_samplers_env_error_carries_a_replay(backend: Any, inference: str) -> None:
    """A Sampler's env error carries its replay, with the policy in the driver or in the
    workers (where the actions never pass the driver)."""
    sampler = envfleet.Sampler(
        _buggy("raise", p=0.05),
        lambda obs: (obs[:, 0] > 0.5).astype(np.int64),
        2,
        inference=inference,
        seed=SEED,
        backend=backend.name,
    )
    try:
        with pytest.raises(envfleet.EnvError) as info:
            for _ in range(100):
                sampler.sample(64)
    finally:
        sampler.close()
    [recording] = info.value.replay.envs
    assert recording.env_index == 1 and recording.complete
    with pytest.raises(ValueError, match="bug hit"):
        envfleet.replay(info.value.replay)


def test_an_episode_longer_than_replay_steps_is_not_replayable(make_env: Any) -> None:
    """An episode past ``replay_steps`` actions of an env whose state cannot be checkpointed
    has lost its start: the replay says so."""
    buggy = functools.partial(BuggyEnv, how="raise", p=0.01, checkpoint=False)
    envs = make_env(buggy, 2, backend="serial", supervision=envfleet.Supervision(replay_steps=2))
    err, _ = _run_to_failure(envs, 2, envfleet.EnvError)
    [recording] = err.replay.envs
    assert not recording.complete and "longer than replay_steps=2" in recording.why
    with pytest.raises(ValueError, match="cannot be replayed: its episode is longer"):
        envfleet.replay(err.replay)


def test_replay_steps_0_keeps_no_record(make_env: Any) -> None:
    envs = make_env(
        _buggy("raise", p=0.3),
        2,
        backend="processes",
        supervision=envfleet.Supervision(replay_steps=0),
    )
    err, _ = _run_to_failure(envs, 2, envfleet.EnvError)
    assert err.replay is None


@pytest.mark.parametrize("bad", [-1, 1.5, "10", True])
def test_a_bad_replay_steps_is_a_config_error(bad: Any) -> None:
    with pytest.raises(envfleet.ConfigError, match="replay_steps"):
        envfleet.make(
            "CartPole-v1", 2, backend="serial", supervision=envfleet.Supervision(replay_steps=bad)
        )


def test_the_cli_reproduces_refuses_and_says_when_it_did_not(
    make_env: Any, tmp_path: Any, capsys: Any
) -> None:
    """``envfleet replay PATH``: 0 and "reproduced" for a replay that fails again, 1 for one
    that raises another exception than the recorded one and for one that runs through (its
    last action dropped), 2 for a file that is not a replay, checked
    before anything is unpickled."""
    envs = make_env(_buggy("raise", p=0.05), 2, backend="serial")
    err, _ = _run_to_failure(envs, 2, envfleet.EnvError)
    path = str(tmp_path / "a.replay")
    err.replay.save(path)
    assert cli.main(["replay", path]) == 0
    assert capsys.readouterr().out.startswith("reproduced: sub-environment 1 raised in step ")
    err.replay.failure = "sub-environment 1 raised in step: KeyError: not this one"
    other_failure = str(tmp_path / "other-failure.replay")
    err.replay.save(other_failure)
    assert cli.main(["replay", other_failure]) == 1  # raised, but not the same exception
    assert capsys.readouterr().out.startswith("not reproduced, another failure: ")
    err.replay.envs[0].actions.pop()
    short = str(tmp_path / "short.replay")
    err.replay.save(short)
    assert cli.main(["replay", short]) == 1
    assert capsys.readouterr().out.startswith("not reproduced: ")
    other = tmp_path / "other.replay"
    other.write_bytes(b"\x80\x04not a replay")  # a pickle would run code: never unpickled
    assert cli.main(["replay", str(other)]) == 2
    assert "is not an envfleet replay file" in capsys.readouterr().err
    newer = tmp_path / "newer.replay"
    newer.write_bytes(MAGIC + (99).to_bytes(2, "little") + b"...")
    with pytest.raises(envfleet.ReplayFileError, match="format version 99"):
        load_replay(str(newer))


def test_each_envs_generators_are_looked_for_along_its_wrappers_once(monkeypatch: Any) -> None:
    """An autoreset's start is the env's generator states (``reset_start``); the objects
    that may hold them are found once per env (``generator_holders``, by its
    ``StartReader``) and kept, and the
    states are still those of the generators the env has at each reset: after a seeded reset
    (a new generator object in each env) and autoresets, a snapshot resumes exactly."""
    from envfleet._core import env_state

    calls: list[Any] = []
    real = env_state.generator_holders

    def counted(env: Any) -> Any:
        calls.append(env)
        return real(env)

    monkeypatch.setattr(env_state, "generator_holders", counted)  # StartReader's look-up
    zeros = np.zeros(2, dtype=np.int64)
    envs = envfleet.make("CartPole-v1", 2, backend="serial")
    resumed = None
    try:
        envs.reset(seed=SEED)
        for _ in range(100):  # several autoresets per env
            envs.step(zeros)
        assert len(calls) == 2 and calls[0] is not calls[1]
        envs.reset(seed=SEED + 1)
        for _ in range(100):
            envs.step(zeros)
        assert len(calls) == 2
        resumed = envfleet.make("CartPole-v1", 2, backend="serial", resume=envs.snapshot())
        for _ in range(100):
            want, got = envs.step(zeros)[0], resumed.step(zeros)[0]
            assert np.array_equal(want, got)
    finally:
        envs.close()
        if resumed is not None:
            resumed.close()


def make_atari(env_id: str) -> Any:
    ale_py = pytest.importorskip("ale_py")
    gym.register_envs(ale_py)
    return gym.make(env_id)


class _OuterEnvWithItsOwnGenerator(gym.Env):  # type: ignore[type-arg]
    """An env that steps an inner env (``self.env``) and draws from its own generator too,
    seeded at its first reset: two generators, at ``""`` and ``"env."`` paths."""

    def __init__(self) -> None:
        self.env = gym.make("CartPole-v1")
        self.observation_space, self.action_space = (
            self.env.observation_space,
            self.env.action_space,
        )

    def reset(self, *, seed: Any = None, options: Any = None) -> Any:
        super().reset(seed=seed)
        self.np_random.random()
        return self.env.reset(seed=seed, options=options)

    def step(self, action: Any) -> Any:
        return self.env.step(action)


@pytest.mark.parametrize(
    "make_env",
    [
        pytest.param(lambda: gym.make("CartPole-v1"), id="CartPole"),
        pytest.param(_OuterEnvWithItsOwnGenerator, id="two-generators"),
        pytest.param(lambda: make_atari("ALE/Pong-v5"), id="Pong", marks=pytest.mark.atari),
    ],
)
def test_a_start_reader_reads_what_reset_start_reads(make_env: Any) -> None:
    """StartReader, kept per env on the step path, reads the same start as reset_start at
    every episode start: before the first seeded reset, after it (a new generator), after a
    wrapper made one of its own, and with an ALE state."""
    from envfleet._core.env_state import StartReader, reset_start

    env = make_env()
    read = StartReader(env)
    try:
        assert pickle.dumps(read()) == pickle.dumps(reset_start(env))
        for seed in (SEED, None, None, SEED + 1, None):
            env.reset(seed=seed)
            env.step(env.action_space.sample())
            start, want = read({"k": 1}), reset_start(env, {"k": 1})
            assert pickle.dumps(start) == pickle.dumps(want)
            assert start[1]  # the states of the generators it has now
    finally:
        env.close()


class _Mt19937Env(gym.Env):  # type: ignore[type-arg]
    """CartPole's spaces, its generator an MT19937 one (not gymnasium's PCG64)."""

    observation_space = gym.spaces.Box(-1.0, 1.0, (4,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def reset(self, *, seed: Any = None, options: Any = None) -> Any:
        if seed is not None or not hasattr(self, "_np_random") or self._np_random is None:
            self._np_random = np.random.Generator(np.random.MT19937(seed))
        return self._np_random.random(4).astype(np.float32), {}

    def step(self, action: Any) -> Any:
        return self._np_random.random(4).astype(np.float32), 0.0, False, False, {}


@pytest.mark.parametrize(
    "make_env",
    [
        pytest.param(lambda: gym.make("CartPole-v1"), id="CartPole"),
        pytest.param(_OuterEnvWithItsOwnGenerator, id="two-generators"),
        pytest.param(_Mt19937Env, id="MT19937"),
        pytest.param(lambda: make_atari("ALE/Pong-v5"), id="Pong", marks=pytest.mark.atari),
    ],
)
def test_a_packed_start_reads_back_as_reset_start(make_env: Any) -> None:
    """What the record keeps of an episode start (StartReader.packed: each PCG64 generator's
    40 bytes where every generator is one, the env keeps no ALE state and there are no
    options; else the pickled start) reads back (unpack_start) as reset_start's start, with
    a draw's buffered half (has_uint32) too; the packed form is taken where it applies."""
    from envfleet._core.env_state import StartReader, reset_start, unpack_start

    env = make_env()
    read = StartReader(env)
    plain = type(env.unwrapped).__name__ != "AtariEnv" and not isinstance(
        env.unwrapped, _Mt19937Env
    )
    try:
        for seed in (SEED, None, SEED + 1, None):
            env.reset(seed=seed)
            env.step(env.action_space.sample())
            for generator in replay_generators(env):
                generator.integers(0, 2**32, dtype=np.uint32)  # half a draw buffered
            blob = read.packed()
            assert blob.startswith(b"\xffPCG") == plain
            np.testing.assert_equal(unpack_start(blob), reset_start(env))
            with_options = read.packed({"k": 1})
            assert not with_options.startswith(b"\xffPCG")
            np.testing.assert_equal(unpack_start(with_options), reset_start(env, {"k": 1}))
    finally:
        env.close()


def replay_generators(env: Any) -> list[np.random.Generator]:
    from envfleet._core.env_state import _generators

    return list(_generators(env).values())


def test_the_action_log_copies_a_groups_action_rows_as_bytes() -> None:
    """A group hands its log the same action buffer every step: after the first step the log
    copies its bytes (and keeps exactly what numpy's assignment would); another array, or
    one of another dtype, goes through numpy."""
    from envfleet._core.action_log import ActionLog

    log = ActionLog(gym.spaces.Box(-1.0, 1.0, (3,), np.float32), 4, 5)
    log.open()
    rows = np.zeros((4, 3), np.float32)
    rng = np.random.default_rng(0)
    written = []
    for _ in range(12):  # past the ring's capacity: it wraps
        rows[:] = rng.uniform(-1, 1, (4, 3))
        log.record(rows)
        written.append(rows.copy())
    assert log._source is rows  # the byte copy ran
    for t in range(7, 12):
        assert np.array_equal(log.ring[t % 5], written[t])
    other = rng.uniform(-1, 1, (4, 3))  # float64: numpy converts, as before
    log.record(other)
    assert np.array_equal(log.ring[12 % 5], other.astype(np.float32))
    assert log._source is rows
