"""``envfleet.ProcessEnv``: one env in its own worker process, with real processes and envs.

Every result is compared bit for bit (``assert_same``) with the same env run in this process
by gymnasium itself, for the same seeds and actions. Leaks are checked with ``Snapshot``
(child processes and ``/dev/shm`` entries). Nothing here depends on timing: waits on a
condition use a timeout only as a hang guard.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import gymnasium
import numpy as np
import psutil
import pytest
from gymnasium import spaces

import envfleet
from envfleet._backends.supervisor import restart_seed
from tests.envs import CrashEnv, IndexedEnv, NestedSpaceEnv, RaisingEnv, make_indexed_kwonly
from tests.helpers import Snapshot, assert_same

HANG_GUARD_S = 30.0  # only bounds a wait that would otherwise hang a broken build

# -- envs of this module ---------------------------------------------------------------------


class EchoEnv(gymnasium.Env):
    """Reports the seed and options each reset got; its observations follow ``np_random``."""

    def __init__(self):
        self.observation_space = spaces.Box(-1.0, 1.0, (3,), np.float32)
        self.action_space = spaces.Discrete(3)
        self.resets = 0

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        self.resets += 1
        info = {"seed": seed, "options": options, "resets": self.resets}
        return self.np_random.uniform(-1.0, 1.0, 3).astype(np.float32), info

    def step(self, action: Any):
        obs = self.np_random.uniform(-1.0, 1.0, 3).astype(np.float32)
        return obs, float(action), False, False, {"action": int(action)}

    def scale(self, x: float, *, factor: float = 1.0, offset: float = 0.0) -> float:
        return x * factor + offset


class GateEnv(gymnasium.Env):
    """Each step waits until the file ``gate`` exists, so a step stays in flight for as long
    as the test wants (it creates the file to let it finish)."""

    def __init__(self, gate: str):
        self.gate = gate
        self.observation_space = spaces.Box(0.0, 100.0, (2,), np.float32)
        self.action_space = spaces.Discrete(4)
        self.value = 0
        self._t = 0

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        self._t = 0
        return np.zeros(2, np.float32), {}

    def step(self, action: Any):
        deadline = time.monotonic() + HANG_GUARD_S
        while not os.path.exists(self.gate) and time.monotonic() < deadline:
            time.sleep(0.002)
        self._t += 1
        obs = np.array([self._t, int(action)], np.float32)
        return obs, float(action), False, False, {"t": self._t}

    def add(self, x: int) -> int:
        return self._t + x


# The driver-side hook of ``test_second_call_while_result_is_read_raises``: an info dict whose
# ``keys()`` (called by ``dict(info)`` in the driver, after the worker's reply was received)
# pauses the thread that completes the future until the test lets it go on.
_INFO_ARMED = threading.Event()
_INFO_ENTERED = threading.Event()
_INFO_RELEASE = threading.Event()


class GatedInfo(dict):
    def __iter__(self):  # makes dict(info) go through keys()
        return iter(list(super().keys()))

    def keys(self):
        if _INFO_ARMED.is_set():
            _INFO_ARMED.clear()
            _INFO_ENTERED.set()
            _INFO_RELEASE.wait(HANG_GUARD_S)
        return super().keys()


class GatedInfoEnv(gymnasium.Env):
    """Observation ``[t, action]``; its step infos are ``GatedInfo`` dicts."""

    def __init__(self):
        self.observation_space = spaces.Box(0.0, 1000.0, (2,), np.float32)
        self.action_space = spaces.Discrete(10)
        self._t = 0

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        self._t = 0
        return np.zeros(2, np.float32), {}

    def step(self, action: Any):
        self._t += 1
        obs = np.array([self._t, int(action)], np.float32)
        return obs, 0.0, False, False, GatedInfo(t=self._t)


def in_space_order(value: Any, space: gymnasium.Space) -> Any:
    """``value`` with its dict keys in ``space``'s order (gymnasium's ``Dict`` sorts its keys;
    a vector env's observations follow the space, whatever order the env built its dict in)."""
    if isinstance(space, spaces.Dict):
        return {key: in_space_order(value[key], sub) for key, sub in space.spaces.items()}
    if isinstance(space, spaces.Tuple):
        return tuple(in_space_order(v, sub) for v, sub in zip(value, space.spaces, strict=True))
    return value


def expected(result: tuple, space: gymnasium.Space) -> tuple:
    """A plain env's reset or step result with its observation in ``space``'s key order."""
    return (in_space_order(result[0], space), *result[1:])


def open_gate(path: Path) -> None:
    path.touch()


def worker_pid(snapshot: Snapshot) -> int:
    pids = snapshot.new_workers()
    assert len(pids) == 1, f"expected one worker process, found {pids}"
    return pids[0]


def wait_until(predicate: Any, what: str) -> None:
    deadline = time.monotonic() + HANG_GUARD_S
    while not predicate():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.005)


# -- 1. differential: ProcessEnv against the env run here by gymnasium ----------------------


def test_cartpole_matches_gymnasium_across_episodes(snapshot):
    env = gymnasium.make("CartPole-v1")
    rng = np.random.default_rng(7)
    episodes = 0
    with envfleet.ProcessEnv("CartPole-v1") as penv:
        assert_same(penv.reset(seed=42), env.reset(seed=42))
        for _ in range(400):
            action = int(rng.integers(2))
            got = penv.step(action)
            assert_same(got, env.step(action))
            if got[2] or got[3]:
                episodes += 1
                # Alternate seeded and unseeded resets: unseeded ones go on with the env's
                # own generator, on both sides.
                seed = 1000 + episodes if episodes % 2 else None
                assert_same(penv.reset(seed=seed), env.reset(seed=seed))
    assert episodes >= 5
    snapshot.assert_nothing_left()


def test_cartpole_env_kwargs_and_numpy_actions():
    env = gymnasium.make("CartPole-v1", max_episode_steps=5)
    with envfleet.ProcessEnv("CartPole-v1", env_kwargs={"max_episode_steps": 5}) as penv:
        assert penv.spec.max_episode_steps == 5
        assert_same(penv.reset(seed=3), env.reset(seed=3))
        for action in [np.int64(0), np.int32(1), np.array(0), 1, 0]:
            got = penv.step(action)
            assert_same(got, env.step(action))
        assert got[3] and not got[2]  # the TimeLimit of env_kwargs truncated the episode
        with pytest.raises(envfleet.ResetNeededError):
            penv.step(0)


def test_factory_lambda_with_dict_observations_matches():
    want_env = NestedSpaceEnv(max_len=12)
    with envfleet.ProcessEnv(lambda: NestedSpaceEnv(max_len=12)) as penv:
        assert penv.observation_space == want_env.observation_space
        assert penv.action_space == want_env.action_space
        space = want_env.observation_space
        penv.action_space.seed(5)
        ends = 0
        assert_same(penv.reset(seed=11), expected(want_env.reset(seed=11), space))
        for _ in range(200):
            action = penv.action_space.sample()
            got = penv.step(action)
            assert_same(got, expected(want_env.step(action), space))
            if got[2] or got[3]:
                ends += 1
                options = {"episode": ends}
                want = expected(want_env.reset(options=options), space)
                assert_same(penv.reset(options=options), want)
        assert ends >= 5


def test_reset_seed_and_options_reach_the_env():
    want_env = EchoEnv()
    with envfleet.ProcessEnv(EchoEnv) as penv:
        for kwargs in [
            {"seed": 5},
            {},
            {"options": {"level": 3, "nested": {"a": [1, 2]}}},
            {"seed": 9, "options": {"x": np.arange(3)}},
        ]:
            got = penv.reset(**kwargs)
            want = want_env.reset(**kwargs)
            assert_same(got, want)
            assert got[1]["seed"] == kwargs.get("seed")
            for action in [2, 0, 1]:
                assert_same(penv.step(action), want_env.step(action))


# -- 2. the Future API -----------------------------------------------------------------------


def test_non_blocking_calls_return_futures_with_the_blocking_results():
    env = gymnasium.make("CartPole-v1")
    with envfleet.ProcessEnv("CartPole-v1") as penv:
        future = penv.reset(seed=8, blocking=False)
        assert isinstance(future, concurrent.futures.Future)
        assert_same(future.result(), env.reset(seed=8))
        for action in [0, 1, 1, 0, 1]:
            future = penv.step(action, blocking=False)
            assert isinstance(future, concurrent.futures.Future)
            assert_same(future.result(), env.step(action))
        future = penv.call("gravity", blocking=False)
        assert isinstance(future, concurrent.futures.Future)
        assert future.result() == env.unwrapped.gravity
        # blocking and non-blocking calls interleave freely once a future is done
        assert_same(penv.step(0), env.step(0))
    with envfleet.ProcessEnv(EchoEnv) as penv:
        future = penv.call("scale", 2.0, blocking=False, factor=3.0, offset=0.5)
        assert future.result() == 6.5


def test_second_call_while_pending_raises_and_loses_nothing(tmp_path):
    gate = tmp_path / "gate"
    want_env = GateEnv(str(tmp_path / "open"))
    (tmp_path / "open").touch()
    with envfleet.ProcessEnv(functools.partial(GateEnv, str(gate))) as penv:
        assert_same(penv.reset(seed=1), want_env.reset(seed=1))
        future = penv.step(2, blocking=False)
        others = [
            lambda: penv.step(1),
            lambda: penv.step(1, blocking=False),
            lambda: penv.reset(),
            lambda: penv.reset(seed=3, blocking=False),
            lambda: penv.call("add", 1),
            lambda: penv.call("add", 1, blocking=False),
            lambda: penv.set_attr("value", 5),
            lambda: penv.get_attr("value"),
            lambda: penv.render(),
        ]
        for other in others:
            with pytest.raises(envfleet.AlreadyPendingCallError) as info:
                other()
            assert isinstance(info.value, gymnasium.error.AlreadyPendingCallError)
        # the cached attributes need no round trip
        assert penv.observation_space == want_env.observation_space
        assert penv.action_space == want_env.action_space
        assert penv.render_mode is None
        assert not future.done()
        open_gate(gate)
        assert_same(future.result(), want_env.step(2))
        # the refused calls changed nothing: the env goes on from the first step
        assert penv.get_attr("value") == 0
        assert_same(penv.step(3), want_env.step(3))
        assert penv.call("add", 10) == 12


def test_second_call_while_result_is_read_raises():
    """The future of a step is still pending while its thread reads the results; a second
    call then must raise AlreadyPendingCallError (it is accepted instead, and its step can
    overwrite the shared observation buffer the first future is copying from)."""
    _INFO_ARMED.clear()
    _INFO_ENTERED.clear()
    _INFO_RELEASE.clear()
    with envfleet.ProcessEnv(GatedInfoEnv) as penv:
        penv.reset(seed=0)
        _INFO_ARMED.set()
        first = penv.step(4, blocking=False)
        second = None
        try:
            assert _INFO_ENTERED.wait(HANG_GUARD_S), "the step's info was never read"
            assert not first.done()
            with contextlib.suppress(envfleet.AlreadyPendingCallError):
                second = penv.step(7, blocking=False)
        finally:
            _INFO_RELEASE.set()
        obs, _, _, _, info = first.result()
        if second is not None:
            second.result()
        assert second is None, "a second step was accepted while the first future was pending"
        assert_same(obs, np.array([1, 4], np.float32))
        assert info == {"t": 1}


def test_futures_of_several_envs_step_in_parallel(snapshot):
    seeds = [3, 4, 5]
    envs = [gymnasium.make("CartPole-v1") for _ in seeds]
    penvs = [envfleet.ProcessEnv("CartPole-v1") for _ in seeds]
    try:
        assert len(snapshot.new_workers()) == len(seeds)
        futures = [p.reset(seed=s, blocking=False) for p, s in zip(penvs, seeds, strict=True)]
        done, not_done = concurrent.futures.wait(futures, timeout=HANG_GUARD_S)
        assert not not_done
        for future, env, seed in zip(futures, envs, seeds, strict=True):
            assert_same(future.result(), env.reset(seed=seed))
        rng = np.random.default_rng(0)
        for _ in range(60):
            actions = [int(a) for a in rng.integers(2, size=len(seeds))]
            futures = [p.step(a, blocking=False) for p, a in zip(penvs, actions, strict=True)]
            done, not_done = concurrent.futures.wait(futures, timeout=HANG_GUARD_S)
            assert not not_done and len(done) == len(seeds)
            for k, (future, env, action) in enumerate(zip(futures, envs, actions, strict=True)):
                got = future.result()
                assert_same(got, env.step(action))
                if got[2] or got[3]:
                    assert_same(penvs[k].reset(), env.reset())
    finally:
        for penv in penvs:
            penv.close()
    snapshot.assert_nothing_left()


# -- 3. attributes, call, render ---------------------------------------------------------


def test_attributes_forward_to_the_remote_env():
    env = gymnasium.make("CartPole-v1")
    with envfleet.ProcessEnv("CartPole-v1") as penv:
        assert penv.gravity == env.unwrapped.gravity == 9.8
        assert penv.get_attr("masspole") == env.unwrapped.masspole
        assert penv.spec == env.spec
        assert penv.metadata == env.metadata
        assert penv.render_mode is None
        assert penv.observation_space == env.observation_space
        assert penv.action_space == env.action_space
        for name in ("observation_space", "action_space", "metadata", "render_mode", "spec"):
            assert name in vars(penv), f"{name} is not cached"

        # set_attr changes the remote env: its dynamics follow the new gravity
        penv.set_attr("gravity", 3.0)
        env.unwrapped.gravity = 3.0
        assert penv.gravity == 3.0
        assert_same(penv.reset(seed=2), env.reset(seed=2))
        for action in [1, 1, 0, 1, 0, 0]:
            assert_same(penv.step(action), env.step(action))

        assert not hasattr(penv, "missing")
        assert getattr(penv, "missing", "default") == "default"
        with pytest.raises(AttributeError, match="missing") as info:
            penv.missing  # noqa: B018
        assert isinstance(info.value.__cause__, envfleet.EnvError)
        # a failed lookup leaves the env usable
        assert_same(penv.step(1), env.step(1))


def test_call_a_method_with_arguments():
    with envfleet.ProcessEnv(EchoEnv) as penv:
        assert penv.call("scale", 2.0) == 2.0
        assert penv.call("scale", 2.0, factor=4.0) == 8.0
        assert penv.call("scale", 1.5, offset=1.0, factor=2.0) == 4.0
        penv.reset(seed=0)
        assert penv.call("resets") == 1  # not callable: its value
        assert penv.resets == 1
    with envfleet.ProcessEnv(IndexedEnv) as penv:
        assert penv.env_index == 0  # a factory taking env_index gets 0
        assert penv.call("add", 2, y=3) == 5
        penv.set_attr("value", {"k": [1, 2]})
        assert penv.value == {"k": [1, 2]}
        assert penv.get_attr("value") == {"k": [1, 2]}
        assert penv.pid != os.getpid()
        with pytest.raises(envfleet.EnvError) as info:
            penv.call("add", "x")
        assert isinstance(info.value.__cause__, TypeError)
        assert penv.call("add", 1) == 1


def test_render_rgb_array_frames():
    env = gymnasium.make("CartPole-v1", render_mode="rgb_array")
    with envfleet.ProcessEnv("CartPole-v1", env_kwargs={"render_mode": "rgb_array"}) as penv:
        assert penv.render_mode == "rgb_array"
        assert_same(penv.reset(seed=4), env.reset(seed=4))
        frame = penv.render()
        assert frame.dtype == np.uint8 and frame.ndim == 3 and frame.shape[2] == 3
        assert_same(frame, env.render())
        assert_same(penv.step(1), env.step(1))
        assert_same(penv.render(), env.render())
    factory = functools.partial(make_indexed_kwonly, render_mode="rgb_array")
    with envfleet.ProcessEnv(factory) as penv:
        assert penv.render_mode == "rgb_array"
        penv.reset(seed=0)
        assert_same(penv.render(), np.full((5, 7, 3), 0, dtype=np.uint8))


# -- 4. errors raised by the env -------------------------------------------------------------


def assert_remote_chain(error: BaseException, cause: type, text: str) -> None:
    assert isinstance(error, envfleet.EnvError)
    assert error.env_index == 0
    assert isinstance(error.__cause__, cause)
    assert text in str(error.__cause__)
    remote = error.__cause__.__cause__
    assert isinstance(remote, envfleet.RemoteTraceback)
    assert text in remote.tb and "Traceback" in remote.tb
    assert "tests/envs.py" in remote.tb or "test_process_env.py" in remote.tb


def test_env_error_in_step_blocking_and_from_future(snapshot):
    want_env = RaisingEnv(fail_after=2)
    with envfleet.ProcessEnv(functools.partial(RaisingEnv, fail_after=2)) as penv:
        assert_same(penv.reset(seed=0), want_env.reset(seed=0))
        for action in [1, 0]:
            assert_same(penv.step(action), want_env.step(action))
        with pytest.raises(envfleet.EnvError) as info:
            penv.step(1)
        assert info.value.method == "step"
        assert_remote_chain(info.value, ValueError, "boom in step 3 of env 0")
        assert not penv.closed

        # the env is still there, in the state the failed step left it in
        future = penv.step(0, blocking=False)
        with pytest.raises(envfleet.EnvError) as info:
            future.result()
        assert_remote_chain(info.value, ValueError, "boom in step 4 of env 0")
        assert not penv.closed

        # a reset makes it usable again (no ResetNeededError: the error is not an episode end)
        assert_same(penv.reset(seed=5), want_env.reset(seed=5))
        assert_same(penv.step(1), want_env.step(1))
        assert len(snapshot.new_workers()) == 1
    snapshot.assert_nothing_left()


def test_env_error_in_reset_with_options():
    want_env = RaisingEnv(fail_in="reset")
    with envfleet.ProcessEnv(functools.partial(RaisingEnv, fail_in="reset")) as penv:
        with pytest.raises(envfleet.EnvError) as info:
            penv.reset(seed=1, options={"explode": True})
        assert info.value.method == "reset"
        assert_remote_chain(info.value, ValueError, "boom in reset of env 0")
        future = penv.reset(options={"explode": True}, blocking=False)
        with pytest.raises(envfleet.EnvError):
            future.result()
        assert_same(penv.reset(seed=1, options={"explode": False}), want_env.reset(seed=1))
        assert_same(penv.step(1), want_env.step(1))


def test_factory_error_at_start(snapshot):
    # the factory fails at once (env 0 is first built in this process, for its spaces)
    with pytest.raises(envfleet.EnvError) as info:
        envfleet.ProcessEnv(functools.partial(RaisingEnv, fail_in="init"))
    assert isinstance(info.value.__cause__, ValueError)
    assert "boom in __init__" in str(info.value.__cause__)
    snapshot.assert_nothing_left()


def _fails_in_workers(driver_pid: int) -> gymnasium.Env:
    if os.getpid() != driver_pid:
        raise RuntimeError("no env in a worker")
    return IndexedEnv()


def test_factory_error_in_the_worker(snapshot):
    with pytest.raises(envfleet.EnvError) as info:
        envfleet.ProcessEnv(functools.partial(_fails_in_workers, os.getpid()))
    assert isinstance(info.value.__cause__, RuntimeError)
    assert isinstance(info.value.__cause__.__cause__, envfleet.RemoteTraceback)
    assert "no env in a worker" in info.value.__cause__.__cause__.tb
    snapshot.assert_nothing_left()


def test_start_with_an_unknown_id_or_a_bad_env_is_a_config_error(snapshot):
    with pytest.raises(envfleet.ConfigError):
        envfleet.ProcessEnv("NoSuchEnv-v0")
    with pytest.raises(envfleet.ConfigError):
        envfleet.ProcessEnv(42)  # type: ignore[arg-type]
    snapshot.assert_nothing_left()


# -- 5. crashes, timeouts, restarts ----------------------------------------------------------


@pytest.mark.parametrize(("how", "blocking"), [("segfault", True), ("exit", False)])
def test_crash_in_step_raises_and_closes(snapshot, how, blocking):
    factory = functools.partial(CrashEnv, crash_index=0, crash_after=2, how=how)
    penv = envfleet.ProcessEnv(factory, supervision=envfleet.Supervision(restart_policy=None))
    penv.reset(seed=0)
    penv.step(0)
    penv.step(1)
    with pytest.raises(envfleet.EnvCrashedError) as info:
        if blocking:
            penv.step(0)
        else:
            penv.step(0, blocking=False).result()
    error = info.value
    assert error.env_index == 0 and error.env_indices == [0]
    if how == "segfault":
        assert error.signal == signal.SIGSEGV
    else:
        assert error.exitcode == 3 and error.signal is None
    assert penv.closed
    snapshot.assert_nothing_left()  # the crash itself released the worker and the buffers
    with pytest.raises(envfleet.ClosedEnvironmentError):
        penv.step(0)
    with pytest.raises(envfleet.ClosedEnvironmentError):
        penv.reset()
    penv.close()
    penv.close()
    snapshot.assert_nothing_left()


def test_step_timeout_on_a_hanging_env(snapshot):
    factory = functools.partial(CrashEnv, crash_index=0, crash_after=1, how="hang")
    penv = envfleet.ProcessEnv(
        factory,
        supervision=envfleet.Supervision(step_timeout=1.5, restart_policy=None),
    )
    penv.reset(seed=0)
    penv.step(0)
    with pytest.raises(envfleet.StepTimeoutError) as info:
        penv.step(0)
    assert isinstance(info.value, envfleet.EnvfleetError)
    assert info.value.timeout == 1.5 and info.value.env_indices == [0]
    assert penv.closed
    snapshot.assert_nothing_left()
    with pytest.raises(envfleet.ClosedEnvironmentError):
        penv.step(0)
    penv.close()


def test_step_timeout_from_a_future(snapshot):
    factory = functools.partial(CrashEnv, crash_index=0, crash_after=0, how="hang")
    penv = envfleet.ProcessEnv(
        factory,
        supervision=envfleet.Supervision(step_timeout=1.5, restart_policy=None),
    )
    penv.reset(seed=0)
    with pytest.raises(envfleet.StepTimeoutError):
        penv.step(0, blocking=False).result(timeout=HANG_GUARD_S)
    assert penv.closed
    penv.close()
    snapshot.assert_nothing_left()


def test_restart_policy_rebuilds_after_a_crash(snapshot):
    factory = functools.partial(CrashEnv, crash_index=0, crash_after=2, how="exit")
    want_env = CrashEnv(crash_index=0, crash_after=2, how="exit")
    policy = envfleet.RestartPolicy(restart_on=(Exception,), max_restarts=2, window_s=3600.0)
    with envfleet.ProcessEnv(
        factory, supervision=envfleet.Supervision(restart_policy=policy)
    ) as penv:
        first_pid = penv.pid
        assert_same(penv.reset(seed=6), want_env.reset(seed=6))
        for action in [0, 1]:
            assert_same(penv.step(action), want_env.step(action))
        obs, reward, terminated, truncated, info = penv.step(0)  # the worker dies here
        assert (reward, terminated, truncated) == (0.0, False, True)
        assert info == {"env_restarted": True}
        # the rebuilt env was reset with the seed derived from its last seed
        restarted = CrashEnv(crash_index=0, crash_after=2, how="exit")
        assert_same(obs, restarted.reset(seed=restart_seed(6, 1))[0])
        assert not penv.closed
        assert penv.pid != first_pid
        stats = penv.stats
        assert (stats.restarts, stats.crashes, stats.env_restarts) == (1, 1, {0: 1})
        # the episode was truncated: reset first, as after any truncation
        with pytest.raises(envfleet.ResetNeededError):
            penv.step(0)
        assert_same(penv.reset(seed=9), want_env.reset(seed=9))
        assert_same(penv.step(1), want_env.step(1))
        assert len(snapshot.new_workers()) == 1
    snapshot.assert_nothing_left()


# -- 6. Ctrl-C and bad inputs ----------------------------------------------------------------


def test_sigint_to_the_worker_is_ignored(snapshot):
    env = gymnasium.make("CartPole-v1")
    with envfleet.ProcessEnv("CartPole-v1") as penv:
        pid = worker_pid(snapshot)
        sig_ignored = int(
            next(
                line.split()[1]
                for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                if line.startswith("SigIgn:")
            ),
            16,
        )
        assert sig_ignored & (1 << (signal.SIGINT - 1)), "the worker does not ignore SIGINT"
        assert_same(penv.reset(seed=1), env.reset(seed=1))
        for action in [0, 1, 1]:
            os.kill(pid, signal.SIGINT)
            assert_same(penv.step(action), env.step(action))
        assert_same(penv.step(0, blocking=False).result(), env.step(0))
        assert psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        assert snapshot.new_workers() == [pid]
    snapshot.assert_nothing_left()


@pytest.mark.parametrize(
    "bad",
    [np.array([0, 1]), np.array([[1]]), "left", 0.5, np.float32(1.0), None, [0, 1], {"a": 1}],
    ids=lambda v: type(v).__name__ + str(np.shape(v) if not isinstance(v, dict) else ""),
)
def test_invalid_action_is_refused_before_sending(bad):
    env = gymnasium.make("CartPole-v1")
    with envfleet.ProcessEnv("CartPole-v1") as penv:
        assert_same(penv.reset(seed=2), env.reset(seed=2))
        assert_same(penv.step(1), env.step(1))
        for blocking in (True, False):
            with pytest.raises(envfleet.InvalidActionError):
                penv.step(bad, blocking=blocking)
        # nothing reached the env and nothing is pending
        assert_same(penv.step(0), env.step(0))


def test_invalid_dict_action_is_refused():
    want_env = NestedSpaceEnv()
    with envfleet.ProcessEnv(NestedSpaceEnv) as penv:
        space = want_env.observation_space
        assert_same(penv.reset(seed=3), expected(want_env.reset(seed=3), space))
        good = {"move": 1, "force": np.array([0.5, -0.5], np.float32)}
        for bad in [
            {"move": 1},
            {"move": 1, "force": np.zeros(2, np.float32), "extra": 0},
            {"move": 1, "force": np.zeros(3, np.float32)},
            {"move": 1.5, "force": np.zeros(2, np.float32)},
            (1, np.zeros(2, np.float32)),
            1,
        ]:
            with pytest.raises(envfleet.InvalidActionError):
                penv.step(bad)
        assert_same(penv.step(good), expected(want_env.step(good), space))


def test_step_after_the_episode_ended_needs_a_reset():
    env = gymnasium.make("CartPole-v1")
    with envfleet.ProcessEnv("CartPole-v1") as penv:
        assert_same(penv.reset(seed=0), env.reset(seed=0))
        terminated = False
        steps = 0
        while not terminated:
            got = penv.step(1)
            assert_same(got, env.step(1))
            terminated = got[2]
            steps += 1
            assert steps < 200
        for blocking in (True, False, True):
            with pytest.raises(envfleet.ResetNeededError) as info:
                penv.step(0, blocking=blocking)
            assert isinstance(info.value, gymnasium.error.ResetNeeded)
        assert not penv.closed
        assert_same(penv.reset(seed=1), env.reset(seed=1))
        assert_same(penv.step(0), env.step(0))


# -- 7. life cycle ---------------------------------------------------------------------------


def test_start_later(snapshot):
    env = gymnasium.make("CartPole-v1")
    penv = envfleet.ProcessEnv("CartPole-v1", start=False)
    assert snapshot.new_workers() == []
    with pytest.raises(envfleet.ClosedEnvironmentError):
        penv.step(0)
    penv.start()
    pid = worker_pid(snapshot)
    penv.start()  # a second start does nothing
    assert snapshot.new_workers() == [pid]
    assert penv.observation_space == env.observation_space
    assert_same(penv.reset(seed=4), env.reset(seed=4))
    assert_same(penv.step(1), env.step(1))
    penv.close()
    assert penv.closed
    snapshot.assert_nothing_left()


def test_context_manager(snapshot):
    with envfleet.ProcessEnv("CartPole-v1") as penv:
        assert not penv.closed
        penv.reset(seed=0)
        penv.step(0)
        assert len(snapshot.new_workers()) == 1
    assert penv.closed
    snapshot.assert_nothing_left()
    # leaving on an exception terminates the worker
    with pytest.raises(KeyError), envfleet.ProcessEnv("CartPole-v1") as penv:
        penv.reset(seed=0)
        raise KeyError("leave")
    assert penv.closed
    snapshot.assert_nothing_left()


def test_close_is_idempotent_and_later_calls_raise(snapshot):
    penv = envfleet.ProcessEnv(IndexedEnv)
    penv.reset(seed=0)
    assert "running" in repr(penv)
    penv.close()
    assert penv.closed
    assert "closed" in repr(penv)
    snapshot.assert_nothing_left()
    penv.close()
    penv.close(terminate=True)
    snapshot.assert_nothing_left()
    calls = [
        lambda: penv.step(0),
        lambda: penv.step(0, blocking=False),
        lambda: penv.reset(),
        lambda: penv.reset(seed=1, blocking=False),
        lambda: penv.call("add", 1),
        lambda: penv.get_attr("value"),
        lambda: penv.set_attr("value", 1),
        lambda: penv.render(),
        lambda: penv.value,
        lambda: penv.stats,
    ]
    for call in calls:
        with pytest.raises(envfleet.ClosedEnvironmentError) as info:
            call()
        assert isinstance(info.value, gymnasium.error.ClosedEnvironmentError)
    # the cached attributes stay readable
    assert penv.action_space == spaces.Discrete(2)


def test_close_waits_for_a_pending_step(snapshot, tmp_path):
    gate = tmp_path / "gate"
    penv = envfleet.ProcessEnv(functools.partial(GateEnv, str(gate)))
    penv.reset(seed=0)
    future = penv.step(3, blocking=False)
    assert not future.done()
    timer = threading.Timer(0.2, open_gate, args=(gate,))
    timer.start()
    try:
        penv.close()  # waits up to 5 s for the step in flight
    finally:
        timer.cancel()
    assert future.done()
    assert_same(future.result(), (np.array([1, 3], np.float32), 3.0, False, False, {"t": 1}))
    assert penv.closed
    snapshot.assert_nothing_left()


def test_close_ends_a_step_that_never_finishes(snapshot, tmp_path):
    """close() kills a worker whose step never ends; the step's future must then fail with an
    envfleet error. (The untyped error comes from the future's thread polling the worker's
    Process object after close() closed it; the rare poll that falls between the worker's
    death and that gives EnvCrashedError, hence several rounds.)"""
    errors = []
    for terminate in [False, True, True, True, True, True]:
        penv = envfleet.ProcessEnv(functools.partial(GateEnv, str(tmp_path / "never")))
        penv.reset(seed=0)
        future = penv.step(0, blocking=False)
        with pytest.warns(UserWarning, match="Calling `close` while waiting for a pending call"):
            penv.close(timeout=0.2, terminate=terminate)
        assert penv.closed
        snapshot.assert_nothing_left()
        errors.append(future.exception(timeout=HANG_GUARD_S))
    assert all(isinstance(e, envfleet.EnvfleetError) for e in errors), f"futures raised {errors}"


def test_garbage_collected_env_leaves_nothing(snapshot):
    import gc

    penv = envfleet.ProcessEnv("CartPole-v1")
    penv.reset(seed=0)
    assert len(snapshot.new_workers()) == 1
    del penv
    gc.collect()
    snapshot.assert_nothing_left()


@pytest.mark.parametrize("context", ["spawn", "forkserver"])
def test_other_start_methods(snapshot, context):
    want_env = IndexedEnv(env_index=0)
    env = gymnasium.make("CartPole-v1")
    with envfleet.ProcessEnv(IndexedEnv, context=context) as penv:
        pid = penv.pid
        assert pid != os.getpid()
        assert snapshot.new_workers() == [pid]
        assert_same(penv.reset(seed=3), want_env.reset(seed=3))
        assert_same(penv.step(1, blocking=False).result(), want_env.step(1))
        assert penv.call("add", 2) == 2
    snapshot.assert_nothing_left()
    if context == "spawn":
        with envfleet.ProcessEnv("CartPole-v1", context=context) as penv:
            assert_same(penv.reset(seed=5), env.reset(seed=5))
            for action in [0, 1, 1]:
                assert_same(penv.step(action), env.step(action))
        snapshot.assert_nothing_left()
