"""The front: make()'s validation, the call state machine, actions, seeds, attributes, render."""

from __future__ import annotations

import fcntl
import functools
import os
import subprocess
import sys
import threading
import warnings

import gymnasium as gym
import numpy as np
import psutil
import pytest
from gymnasium.vector import AutoresetMode, SyncVectorEnv, VectorEnv
from gymnasium.vector.utils import batch_space
from hypothesis import given, settings
from hypothesis import strategies as st

import envfleet
from envfleet._backends.processes.plan import plan_processes
from tests.envs import (
    IndexedEnv,
    NestedSpaceEnv,
    SimpleEnv,
    TextObsEnv,
    make_indexed,
    make_indexed_kwonly,
    sync_factories,
)
from tests.helpers import assert_same

BACKENDS = ["serial", "threads", "processes"]


def cartpole():
    return gym.make("CartPole-v1")


# -- make(): configuration errors -----------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("num_envs", [0, -1, 1.5, "2", True])
def test_bad_num_envs(backend, num_envs, snapshot):
    with pytest.raises(envfleet.ConfigError, match="num_envs"):
        envfleet.make("CartPole-v1", num_envs, backend=backend)
    snapshot.assert_nothing_left()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("num_workers", [0, -1, 4, 2.0, True])
def test_bad_num_workers(backend, num_workers, snapshot):
    with pytest.raises(envfleet.ConfigError, match="num_workers"):
        envfleet.make("CartPole-v1", 3, backend=backend, num_workers=num_workers)
    snapshot.assert_nothing_left()


def test_config_error_is_envfleet_error_and_value_error():
    assert issubclass(envfleet.ConfigError, envfleet.EnvfleetError)
    assert issubclass(envfleet.ConfigError, ValueError)
    assert issubclass(envfleet.SpaceMismatchError, envfleet.ConfigError)


@pytest.mark.parametrize("backend", ["nope", "Serial", "", "process"])
def test_unknown_backend(backend):
    with pytest.raises(envfleet.ConfigError, match="unknown backend"):
        envfleet.make("CartPole-v1", 2, backend=backend)


def test_a_backend_is_one_registered_module(monkeypatch):
    """The registry's worked example: a backend that registers itself is found by make(),
    planned with the default plan and refused other backends' options; make() knows no
    backend by name."""
    from envfleet._backends import registry
    from envfleet._backends.rounds import RoundDriver
    from envfleet._backends.serial import SerialTransport

    def build(request: registry.BuildRequest) -> RoundDriver:
        return RoundDriver(
            SerialTransport(
                request.layout,
                request.block(shared=False),
                first_env=request.first_env,
                ledger=request.ledger,
                pool=request.pool,
            )
        )

    spec = registry.BackendSpec("inline", build=build)
    # Only "inline" is undone after the test: the built-in backends registered meanwhile stay.
    monkeypatch.setitem(registry._REGISTRY, "inline", None)
    assert registry.register(spec) is spec
    envs = envfleet.make(IndexedEnv, 4, backend="inline", num_workers=2)
    try:
        assert envs.backend == "inline" and envs.worker_ranges == ((0, 2), (2, 4))
        assert envs.get_attr("env_index") == (0, 1, 2, 3)
    finally:
        envs.close()
    assert "inline" not in envfleet.BACKENDS  # the public tuple lists the built-in backends


def test_registering_imports_neither_ray_nor_envpool():
    code = (
        "import sys, envfleet; from envfleet._backends import registry; "
        "registry.lookup('processes'); registry.lookup('threads'); registry.lookup('serial'); "
        "print(sorted(m for m in ('ray', 'envpool') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("backend", BACKENDS)
def test_unknown_env_id(backend):
    with pytest.raises(envfleet.ConfigError, match="NoSuchEnv-v0"):
        envfleet.make("NoSuchEnv-v0", 2, backend=backend)


def test_unpicklable_factory_for_processes(make_env, snapshot):
    lock = threading.Lock()

    def factory():
        with lock:  # the closure holds a lock, which cannot be pickled
            return gym.make("CartPole-v1")

    with pytest.raises(envfleet.ConfigError, match="pickle"):
        envfleet.make(factory, 2, backend="processes")
    snapshot.assert_nothing_left()
    # In-process, nothing needs pickling.
    envs = make_env(factory, 2, backend="serial")
    obs, _ = envs.reset(seed=0)
    assert obs.shape == (2, 4)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("batch_size", [5, 0, -1, 2.0, True])
def test_batch_size_outside_one_to_num_envs(backend, batch_size):
    with pytest.raises(envfleet.ConfigError, match="batch_size"):
        envfleet.make("CartPole-v1", 4, backend=backend, batch_size=batch_size)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("batch_size", [None, 4])
def test_batch_size_none_or_num_envs(make_env, backend, batch_size):
    envs = make_env("CartPole-v1", 4, backend=backend, num_workers=2, batch_size=batch_size)
    assert envs.reset(seed=0)[0].shape == (4, 4)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("policy", [object(), {"max_restarts": 3}, 0])
def test_restart_policy_not_available(backend, policy):
    with pytest.raises(envfleet.ConfigError, match="restart_policy"):
        envfleet.make(
            "CartPole-v1",
            2,
            backend=backend,
            supervision=envfleet.Supervision(restart_policy=policy),
        )


@pytest.mark.parametrize("context", ["bogus", "Fork", "thread"])
def test_bad_context(context):
    with pytest.raises(envfleet.ConfigError, match="context"):
        envfleet.make(
            "CartPole-v1",
            2,
            backend=envfleet.Processes(context=context),
        )


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("env", [cartpole, [cartpole, cartpole]], ids=["callable", "list"])
def test_env_kwargs_with_callable(backend, env):
    with pytest.raises(envfleet.ConfigError, match="env_kwargs"):
        envfleet.make(env, 2, backend=backend, env_kwargs={"max_episode_steps": 5})


@pytest.mark.parametrize("backend", BACKENDS)
def test_env_kwargs_with_id(make_env, backend):
    envs = make_env("CartPole-v1", 2, backend=backend, env_kwargs={"max_episode_steps": 3})
    envs.reset(seed=0)
    for _ in range(2):
        assert not envs.step(np.zeros(2, np.int64))[3].any()
    assert envs.step(np.zeros(2, np.int64))[3].all()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "env", [[], [cartpole, 3], 42, None], ids=["empty", "non-callable", "int", "none"]
)
def test_bad_env_argument(backend, env):
    with pytest.raises(envfleet.ConfigError):
        envfleet.make(env, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_list_length_differs_from_num_envs(backend):
    with pytest.raises(envfleet.ConfigError):
        envfleet.make([cartpole, cartpole], 3, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("step_timeout", [0, -1.0, "1"])
def test_bad_step_timeout(backend, step_timeout):
    with pytest.raises(envfleet.ConfigError, match="step_timeout"):
        envfleet.make(
            "CartPole-v1",
            2,
            backend=backend,
            supervision=envfleet.Supervision(step_timeout=step_timeout),
        )


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_autoreset_mode(backend):
    with pytest.raises(envfleet.ConfigError, match="autoreset_mode"):
        envfleet.make("CartPole-v1", 2, backend=backend, autoreset_mode="Sometimes")


@pytest.mark.parametrize("backend", BACKENDS)
def test_factory_returning_non_env(backend, snapshot):
    with pytest.raises(envfleet.ConfigError):
        envfleet.make(lambda: "not an env", 2, backend=backend)
    snapshot.assert_nothing_left()


@pytest.mark.parametrize("backend", BACKENDS)
def test_space_without_fixed_size(backend, snapshot):
    # Issue 17: such leaves travel beside the shared buffers (tests/contract/test_spaces.py).
    with envfleet.make(TextObsEnv, 2, backend=backend) as envs:
        assert envs.reset(seed=0)[0] == ("abc", "abc")
        assert envs.step(np.zeros(2, dtype=np.int64))[0] == ("abc", "abc")
    snapshot.assert_nothing_left()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "odd",
    [
        functools.partial(SimpleEnv, obs_dim=3),
        functools.partial(SimpleEnv, n_actions=3),
        lambda: gym.make("MountainCar-v0"),
    ],
    ids=["observation", "action", "other-env"],
)
@pytest.mark.parametrize("where", [1, 3])
def test_space_mismatch(backend, odd, where, snapshot):
    fns = [SimpleEnv] * 4
    if isinstance(odd, functools.partial):
        fns[where] = odd
    else:
        fns = [lambda: gym.make("CartPole-v1")] * 4
        fns[where] = odd
    with pytest.raises(envfleet.SpaceMismatchError) as info:
        envfleet.make(fns, backend=backend, num_workers=2)
    assert isinstance(info.value, envfleet.ConfigError)
    assert f"sub-environment {where}" in str(info.value)
    snapshot.assert_nothing_left()


# -- make(): defaults and the VectorEnv interface -------------------------------------------


def test_defaults(make_env):
    envs = make_env("CartPole-v1")
    assert envs.num_envs == 1
    assert envs.backend == "processes"
    assert envs.num_workers == 1
    assert envs.copy is True
    assert envs.metadata["autoreset_mode"] is AutoresetMode.NEXT_STEP


def test_default_layout_isolates_every_env_in_a_worker_per_core(make_env):
    """Default: one worker per usable core and no env in the learner's process, as every
    peer's process mode; driver_envs=k is the opt-in share."""
    cores = envfleet.usable_cores()
    envs = make_env(IndexedEnv, 4)
    assert envs.num_workers == min(4, cores)
    pids = envs.get_attr("pid")
    assert os.getpid() not in pids
    assert len(set(pids)) == min(4, cores)
    if cores > 1:
        shared = make_env(IndexedEnv, 4, backend=envfleet.Processes(driver_envs=2))
        assert shared.num_workers == min(2, cores - 1)
        assert shared.get_attr("pid")[:2] == (os.getpid(),) * 2
    assert make_env("CartPole-v1", 4, backend="serial").num_workers == 1


def test_driver_envs_zero_isolates_every_env(make_env):
    cores = len(psutil.Process().cpu_affinity())
    envs = make_env(IndexedEnv, 4, backend=envfleet.Processes(driver_envs=0))
    assert envs.num_workers == min(4, cores)
    assert os.getpid() not in envs.get_attr("pid")
    # Given num_workers alone, or a step_timeout, the driver steps nothing either.
    envs = make_env(IndexedEnv, 3, num_workers=3)
    assert os.getpid() not in envs.get_attr("pid")
    envs = make_env(IndexedEnv, 3, supervision=envfleet.Supervision(step_timeout=10.0))
    assert os.getpid() not in envs.get_attr("pid")


@pytest.mark.parametrize(
    ("num_envs", "num_workers", "driver_envs", "cores", "ranges"),
    [
        (16, None, None, 2, [(0, 8), (8, 16)]),
        (16, None, None, 4, [(0, 4), (4, 8), (8, 12), (12, 16)]),
        (16, None, 4, 4, [(0, 4), (4, 8), (8, 12), (12, 16)]),
        (5, None, None, 2, [(0, 3), (3, 5)]),
        (5, None, 2, 2, [(0, 2), (2, 5)]),
        (1, None, None, 2, [(0, 1)]),
        (16, None, None, 1, [(0, 16)]),
        (16, None, 0, 2, [(0, 8), (8, 16)]),
        (7, 3, None, 2, [(0, 3), (3, 5), (5, 7)]),
        (7, 2, 3, 2, [(0, 3), (3, 5), (5, 7)]),
        (7, None, 6, 8, [(0, 6), (6, 7)]),
    ],
)
def test_plan_processes(num_envs, num_workers, driver_envs, cores, ranges):
    plan = plan_processes(num_envs, num_workers, driver_envs, None, cores)
    assert plan.ranges == ranges
    assert plan.num_workers == len(ranges) - (plan.driver_envs > 0)
    # Never more spinners than cores.
    spinners = plan.num_workers * (plan.worker_spin_s > 0) + (plan.driver_spin_s > 0)
    assert spinners <= cores


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (lambda: {"backend": envfleet.Processes(driver_envs=4)}, "driver_envs"),
        (lambda: {"backend": envfleet.Processes(driver_envs=-1)}, "driver_envs"),
        (lambda: {"backend": envfleet.Processes(driver_envs=1.5)}, "driver_envs"),
        (
            lambda: {"num_workers": 3, "backend": envfleet.Processes(driver_envs=2)},
            "workers cannot share",
        ),
        (lambda: {"backend": envfleet.Processes(spin_s=-0.1)}, "spin_s"),
        (lambda: {"backend": envfleet.Processes(pool_layout="rows")}, "pool_layout"),
        (lambda: {"backend": envfleet.Processes(context="nope")}, "cannot find context"),
        (lambda: {"backend": 3}, "backend must be a name"),
        (
            lambda: {
                "supervision": envfleet.Supervision(step_timeout=1.0),
                "backend": envfleet.Processes(driver_envs=2),
            },
            "driver_envs=0",
        ),
    ],
)
def test_bad_processes_options(kwargs, match):
    """Bad options raise ConfigError when the option object is built or when make() reads it."""
    with pytest.raises(envfleet.ConfigError, match=match):
        envfleet.make("CartPole-v1", 4, **kwargs())


def test_num_envs_defaults_to_list_length(make_env):
    envs = make_env([cartpole] * 3, backend="serial")
    assert envs.num_envs == 3


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", [*AutoresetMode, "SameStep", "Disabled"], ids=str)
def test_is_vector_env_with_metadata(make_env, backend, mode):
    envs = make_env("CartPole-v1", 2, backend=backend, autoreset_mode=mode)
    sync = SyncVectorEnv([cartpole] * 2, autoreset_mode=mode)
    assert isinstance(envs, VectorEnv)
    assert isinstance(envs, envfleet.FleetVectorEnv)
    assert envs.metadata["autoreset_mode"] is AutoresetMode(mode)
    assert envs.metadata == sync.metadata
    assert envs.render_mode is None
    assert envs.single_observation_space == sync.single_observation_space
    assert envs.observation_space == sync.observation_space
    assert envs.action_space == sync.action_space
    sync.close()


# -- actions --------------------------------------------------------------------------------


def _bad_cartpole_actions():
    return {
        "too-many": np.zeros(4, np.int64),
        "too-few": np.zeros(2, np.int64),
        "extra-dim": np.zeros((3, 1), np.int64),
        "float": np.zeros(3, np.float64),
        "float32": np.zeros(3, np.float32),
        "complex": np.zeros(3, np.complex64),
        "string": np.array(["a", "b", "c"]),
        "dict": {"a": np.zeros(3, np.int64)},
        "scalar": 0,
    }


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bad", list(_bad_cartpole_actions()))
def test_invalid_discrete_actions(make_env, backend, bad):
    envs = make_env("CartPole-v1", 3, backend=backend, num_workers=2)
    sync = SyncVectorEnv([cartpole] * 3)
    assert_same(envs.reset(seed=4), sync.reset(seed=4), "reset")
    with pytest.raises(envfleet.InvalidActionError) as info:
        envs.step(_bad_cartpole_actions()[bad])
    assert isinstance(info.value, envfleet.InvalidArgumentError)
    with pytest.raises(envfleet.InvalidActionError):
        envs.step_async(_bad_cartpole_actions()[bad])
    # Nothing was sent: the env continues as a SyncVectorEnv that never saw the bad calls.
    for t in range(3):
        actions = np.array([1, 0, 1])
        assert_same(envs.step(actions), sync.step(actions), f"step {t}")
    sync.close()


def _bad_nested_actions(n):
    space = batch_space(NestedSpaceEnv().action_space, n)
    space.seed(0)
    good = space.sample()
    move, force = good["move"], good["force"]
    return {
        "missing-key": {"move": move},
        "extra-key": {"move": move, "force": force, "jump": move},
        "wrong-key": {"move": move, "forc": force},
        "tuple": (move, force),
        "array": force,
        "float-move": {"move": move.astype(np.float64), "force": force},
        "force-shape": {"move": move, "force": force[:, :1]},
        "move-shape": {"move": move[:-1], "force": force},
        "force-complex": {"move": move, "force": force.astype(np.complex64)},
    }


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bad", list(_bad_nested_actions(3)))
def test_invalid_nested_actions(make_env, backend, bad):
    envs = make_env(NestedSpaceEnv, 3, backend=backend, num_workers=2)
    sync = SyncVectorEnv(sync_factories(NestedSpaceEnv, 3))
    assert_same(envs.reset(seed=9), sync.reset(seed=9), "reset")
    with pytest.raises(envfleet.InvalidActionError):
        envs.step(_bad_nested_actions(3)[bad])
    space = batch_space(sync.single_action_space, 3)
    space.seed(1)
    for t in range(3):
        actions = space.sample()
        assert_same(envs.step(actions), sync.step(actions), f"step {t}")
    sync.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_actions_that_cast_safely_are_accepted(make_env, backend):
    """int32 or a list of ints for Discrete, as gymnasium's SyncVectorEnv accepts them."""
    envs = make_env("CartPole-v1", 3, backend=backend)
    sync = SyncVectorEnv([cartpole] * 3)
    assert_same(envs.reset(seed=0), sync.reset(seed=0), "reset")
    for actions in (np.array([0, 1, 1], np.int32), [1, 1, 0], (0, 0, 1)):
        assert_same(envs.step(actions), sync.step(np.asarray(actions)), f"{actions!r}")
    sync.close()


# -- seeds and reset masks ------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "seed", [[1, 2], [1, 2, 3, 4], [], "abc", 1.5, {"a": 1}], ids=lambda s: repr(s)
)
def test_bad_seeds(make_env, backend, seed):
    envs = make_env("CartPole-v1", 3, backend=backend)
    with pytest.raises(envfleet.InvalidArgumentError):
        envs.reset(seed=seed)
    with pytest.raises(envfleet.InvalidArgumentError):
        envs.reset_async(seed=seed)
    # gymnasium raises ValueError or TypeError for these: both still catch it.
    with pytest.raises(ValueError):
        envs.reset(seed=seed)
    with pytest.raises(TypeError):
        envs.reset(seed=seed)
    assert envs.reset(seed=[3, 4, 5])[0].shape == (3, 4)
    assert envs.np_random_seed == (3, 4, 5)


def _bad_masks():
    return {
        "list": [True, False, True],
        "int-dtype": np.array([1, 0, 1]),
        "short": np.array([True, False]),
        "2d": np.array([[True, False, True]]),
        "all-false": np.zeros(3, np.bool_),
        "scalar": np.bool_(True),
    }


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bad", list(_bad_masks()))
def test_bad_reset_mask(make_env, backend, bad):
    envs = make_env("CartPole-v1", 3, backend=backend, num_workers=2)
    sync = SyncVectorEnv([cartpole] * 3)
    assert_same(envs.reset(seed=1), sync.reset(seed=1), "reset")
    with pytest.raises(envfleet.InvalidArgumentError, match="reset_mask"):
        envs.reset(options={"reset_mask": _bad_masks()[bad]})
    # Nothing happened: the next step is what SyncVectorEnv gives.
    actions = np.array([0, 1, 0])
    assert_same(envs.step(actions), sync.step(actions), "step")
    sync.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_reset_needed_in_disabled_mode(make_env, backend):
    envs = make_env(
        "CartPole-v1", 3, backend=backend, autoreset_mode=AutoresetMode.DISABLED, num_workers=1
    )
    envs.reset(seed=0)
    ended = np.zeros(3, np.bool_)
    for _ in range(500):
        _, _, term, trunc, _ = envs.step(np.ones(3, np.int64))
        ended = term | trunc
        if ended.any():
            break
    assert ended.any()
    with pytest.raises(envfleet.ResetNeededError) as info:
        envs.step(np.ones(3, np.int64))
    assert isinstance(info.value, gym.error.ResetNeeded)
    assert info.value.env_indices == np.flatnonzero(ended).tolist()
    # Resetting only some other env is not enough; resetting the ended ones is.
    if not ended.all():
        envs.reset(options={"reset_mask": ~ended})
        with pytest.raises(envfleet.ResetNeededError):
            envs.step(np.ones(3, np.int64))
    envs.reset(options={"reset_mask": ended})
    envs.step(np.ones(3, np.int64))


# -- the call state machine -----------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_step_async_twice(make_env, backend):
    envs = make_env("CartPole-v1", 2, backend=backend)
    envs.reset(seed=0)
    envs.step_async(np.zeros(2, np.int64))
    for call in (
        lambda: envs.step_async(np.zeros(2, np.int64)),
        lambda: envs.reset_async(seed=0),
        lambda: envs.reset(seed=0),
        lambda: envs.step(np.zeros(2, np.int64)),
        lambda: envs.call("np_random_seed"),
        lambda: envs.get_attr("np_random_seed"),
        lambda: envs.set_attr("x", 1),
        lambda: envs.render(),
    ):
        with pytest.raises(envfleet.AlreadyPendingCallError):
            call()
        with pytest.raises(gym.error.AlreadyPendingCallError):
            call()
    with pytest.raises(envfleet.NoAsyncCallError):
        envs.reset_wait()
    obs, rew, *_ = envs.step_wait()
    assert obs.shape == (2, 4)
    np.testing.assert_array_equal(rew, [1.0, 1.0])


@pytest.mark.parametrize("backend", BACKENDS)
def test_wait_without_async(make_env, backend):
    envs = make_env("CartPole-v1", 2, backend=backend)
    for call in (envs.step_wait, envs.reset_wait, envs.call_wait):
        with pytest.raises(envfleet.NoAsyncCallError):
            call()
        with pytest.raises(gym.error.NoAsyncCallError):
            call()
    envs.reset_async(seed=0)
    with pytest.raises(envfleet.NoAsyncCallError):
        envs.step_wait()
    obs, _ = envs.reset_wait()
    assert obs.shape == (2, 4)
    with pytest.raises(envfleet.NoAsyncCallError):
        envs.reset_wait()


@pytest.mark.parametrize("backend", BACKENDS)
def test_async_matches_sync_calls(make_env, backend):
    envs = make_env("CartPole-v1", 3, backend=backend, num_workers=2)
    sync = SyncVectorEnv([cartpole] * 3)
    envs.reset_async(seed=2)
    assert_same(envs.reset_wait(timeout=30), sync.reset(seed=2), "reset")
    for t in range(5):
        actions = np.array([t % 2, 1, 0])
        envs.step_async(actions)
        assert_same(envs.step_wait(timeout=30), sync.step(actions), f"step {t}")
    sync.close()


class HeldCartPole(gym.Wrapper):
    """CartPole whose step first waits until no one holds the lock of the file at
    ``lock_path`` (the test holds it to keep a worker from replying)."""

    def __init__(self, lock_path: str):
        super().__init__(gym.make("CartPole-v1"))
        self.lock_path = lock_path

    def step(self, action):
        with open(self.lock_path) as lock:
            fcntl.flock(lock, fcntl.LOCK_SH)  # blocks while the test holds LOCK_EX
        return self.env.step(action)


@pytest.mark.parametrize("num_workers", [1, 2])
def test_a_plain_step_takes_the_backends_step_round(make_env, monkeypatch, num_workers, tmp_path):
    """processes: a step whose actions are of the space's own shape and dtype goes from
    step() straight to the backend's step_round (the C full round), never
    through the general round(), and its answer to _step_outputs (None: every group stepped,
    no env had an info, answered with the rows copied). A round whose workers do not reply
    within the step round's one wait, which ends at the first hang report (held here: every
    env's step waits on a file lock that the test lets go only once the driver waits for the
    replies the general way, after the report) is finished by that wait, and its results go
    through _step_outputs. The results
    stay SyncVectorEnv's, episode ends and autoresets included. (Without the C module there
    is no full round, and a plain step goes through round(): the differential suite's Python
    step path covers it.)"""
    if envfleet._core.native.speedups is None:
        pytest.skip("envfleet._core._speedups is not built here: no full round")
    lock_path = tmp_path / "step.lock"
    lock_path.touch()
    factory = functools.partial(HeldCartPole, str(lock_path))
    envs = make_env(
        factory,
        3,
        backend="processes",
        num_workers=num_workers,
        supervision=envfleet.Supervision(hang_report_delay=0.05),
    )
    sync = SyncVectorEnv([cartpole] * 3)
    assert_same(envs.reset(seed=4), sync.reset(seed=4), "reset")

    def refuse(*args, **kwargs):
        raise AssertionError("the general round ran")

    answers, outputs = [], []
    step_round, step_outputs = envs._step_round, envs._step_outputs

    def recorded_round(*args):
        answers.append(step_round(*args))
        return answers[-1]

    def recorded_outputs(results):
        outputs.append(results)
        return step_outputs(results)

    transport = envs._backend.transport
    wait = transport.wait
    holding, let_go = [False], []

    def releasing_wait(*args):
        # The driver waits for replies the general way: the step round gave up on them.
        if holding[0]:
            fcntl.flock(held, fcntl.LOCK_UN)
            holding[0] = False
            let_go.append(len(answers))
        return wait(*args)

    monkeypatch.setattr(envs._backend, "round", refuse)
    monkeypatch.setattr(envs, "_step_round", recorded_round)
    monkeypatch.setattr(envs, "_step_outputs", recorded_outputs)
    monkeypatch.setattr(transport, "wait", releasing_wait)
    held_steps = set(range(3, 60, 8))
    rng = np.random.default_rng(0)
    ended = 0
    with open(lock_path) as held, warnings.catch_warnings():  # no worker inherits it
        warnings.simplefilter("ignore", envfleet.HangWarning)  # the held steps' reports
        for t in range(60):
            if t in held_steps:
                fcntl.flock(held, fcntl.LOCK_EX)  # no worker holds it: each replied
                holding[0] = True
            actions = rng.integers(0, 2, 3)
            result = envs.step(actions)
            ended += int(result[2].sum())
            assert_same(result, sync.step(actions), f"step {t}")
            assert not holding[0], f"step {t} returned before its workers were let go"
    assert ended > 0
    assert len(answers) == 60
    # Each held step was let go from the general wait, inside its own step_round.
    assert let_go == sorted(held_steps), let_go
    # A worker that spun out is waited for the general way, and its results read.
    spun_out = [answers[t] for t in sorted(held_steps)]
    assert all(answer is not None for answer in spun_out), spun_out
    # A round complete within the spin (the common case) is answered None by the C round
    # itself, no outcome built, and so by step_round.
    complete = [answers[t] for t in range(60) if t not in held_steps]
    assert None in complete, complete
    assert outputs == answers
    sync.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_everything_after_close(backend, snapshot):
    envs = envfleet.make("CartPole-v1", 2, backend=backend)
    envs.reset(seed=0)
    envs.close()
    assert envs.closed
    snapshot.assert_nothing_left()
    for call in (
        lambda: envs.reset(seed=0),
        lambda: envs.reset_async(),
        envs.reset_wait,
        lambda: envs.step(np.zeros(2, np.int64)),
        lambda: envs.step_async(np.zeros(2, np.int64)),
        envs.step_wait,
        lambda: envs.call("np_random_seed"),
        lambda: envs.get_attr("np_random_seed"),
        lambda: envs.set_attr("x", 1),
        envs.render,
    ):
        with pytest.raises(envfleet.ClosedEnvironmentError):
            call()
        with pytest.raises(gym.error.ClosedEnvironmentError):
            call()
    envs.close()  # closing twice is fine


# -- call, get_attr, set_attr, render, env_index ---------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("num_workers", [1, 2, 5])
@pytest.mark.parametrize(
    "factory", [IndexedEnv, make_indexed, make_indexed_kwonly], ids=["class", "function", "kwonly"]
)
def test_env_index_passed_to_factory(make_env, backend, num_workers, factory):
    envs = make_env(factory, 5, backend=backend, num_workers=num_workers)
    assert envs.get_attr("env_index") == tuple(range(5))
    envs.reset(seed=0)
    _, rewards, *_ = envs.step(np.zeros(5, np.int64))
    np.testing.assert_array_equal(rewards, np.arange(5, dtype=np.float64))


@pytest.mark.parametrize("backend", BACKENDS)
def test_env_index_in_a_list_of_factories(make_env, backend):
    fns = [make_indexed, IndexedEnv, lambda: IndexedEnv(env_index=100)]
    envs = make_env(fns, backend=backend, num_workers=2)
    assert envs.get_attr("env_index") == (0, 1, 100)


@pytest.mark.parametrize("backend", BACKENDS)
def test_workers_hold_contiguous_blocks(make_env, backend):
    envs = make_env(IndexedEnv, 5, backend=backend, num_workers=2)
    pids = envs.get_attr("pid")
    if backend == "processes":
        # Envs 0..2 in worker 0, envs 3..4 in worker 1 (the first worker holds one more).
        assert pids[0] == pids[1] == pids[2] != pids[3] == pids[4]
        assert len(set(pids)) == 2
    else:
        assert set(pids) == {psutil.Process().pid}


@pytest.mark.parametrize("backend", BACKENDS)
def test_call(make_env, backend):
    envs = make_env(IndexedEnv, 4, backend=backend, num_workers=2)
    assert envs.call("add", 10) == (10, 11, 12, 13)
    assert envs.call("add", 10, y=100) == (110, 111, 112, 113)
    # A non-callable attribute is returned as it is, like gymnasium's call.
    assert envs.call("env_index") == (0, 1, 2, 3)
    with pytest.raises(envfleet.EnvError) as info:
        envs.call("no_such_attribute")
    assert isinstance(info.value.__cause__, AttributeError)
    assert info.value.env_index == 0
    assert envs.call("add", 1) == (1, 2, 3, 4)  # still usable


@pytest.mark.parametrize("backend", BACKENDS)
def test_call_and_get_attr_match_sync(make_env, backend):
    envs = make_env("CartPole-v1", 3, backend=backend, num_workers=2)
    sync = SyncVectorEnv([cartpole] * 3)
    envs.reset(seed=8)
    sync.reset(seed=8)
    for name in ("np_random_seed", "gravity", "spec", "render_mode"):
        assert envs.get_attr(name) == sync.get_attr(name), name
    assert envs.np_random_seed == (8, 9, 10)
    draws = [g.random() for g in envs.np_random]
    assert draws == [g.random() for g in sync.np_random]
    sync.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_set_attr(make_env, backend):
    envs = make_env(IndexedEnv, 5, backend=backend, num_workers=2)
    envs.set_attr("value", ["a", 1, None, 2.5, (3,)])
    assert envs.get_attr("value") == ("a", 1, None, 2.5, (3,))
    envs.set_attr("value", (5, 6, 7, 8, 9))
    assert envs.get_attr("value") == (5, 6, 7, 8, 9)
    envs.set_attr("value", 7)
    assert envs.get_attr("value") == (7,) * 5
    envs.set_attr("value", {"shared": 1})  # a non-sequence value goes to every env
    assert envs.get_attr("value") == ({"shared": 1},) * 5
    for wrong in ([1, 2, 3, 4], [1] * 6, ()):
        with pytest.raises(envfleet.InvalidArgumentError):
            envs.set_attr("value", wrong)
    assert envs.get_attr("value") == ({"shared": 1},) * 5
    # set_attr reaches the env (through wrappers, like set_wrapper_attr).
    envs.set_attr("env_index", [10, 11, 12, 13, 14])
    envs.reset(seed=0)
    np.testing.assert_array_equal(envs.step(np.zeros(5, np.int64))[1], np.arange(10, 15))


@pytest.mark.parametrize("backend", BACKENDS)
def test_render_custom_env(make_env, backend):
    factory = functools.partial(make_indexed_kwonly, render_mode="rgb_array")
    envs = make_env(factory, 3, backend=backend, num_workers=2)
    assert envs.render_mode == "rgb_array"
    envs.reset(seed=0)
    frames = envs.render()
    assert isinstance(frames, tuple) and len(frames) == 3
    for i, frame in enumerate(frames):
        assert frame.shape == (5, 7, 3) and frame.dtype == np.uint8
        assert (frame == i).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_render_cartpole_rgb_array(make_env, backend):
    pytest.importorskip("pygame", reason="CartPole's rgb_array rendering needs pygame")
    envs = make_env("CartPole-v1", 2, backend=backend, env_kwargs={"render_mode": "rgb_array"})
    sync = SyncVectorEnv([lambda: gym.make("CartPole-v1", render_mode="rgb_array")] * 2)
    envs.reset(seed=0)
    sync.reset(seed=0)
    frames = envs.render()
    assert len(frames) == 2
    for frame, want in zip(frames, sync.render(), strict=True):
        assert frame.shape == (400, 600, 3)
        np.testing.assert_array_equal(frame, want)
    sync.close()


@pytest.mark.atari
@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_render_pong_rgb_array(make_env, backend):
    """rgb_array rendering of a real gymnasium env that needs no pygame (ALE)."""
    ale_py = pytest.importorskip("ale_py")
    gym.register_envs(ale_py)
    kwargs = {"render_mode": "rgb_array"}
    envs = make_env("ALE/Pong-v5", 2, backend=backend, num_workers=2, env_kwargs=kwargs)
    sync = SyncVectorEnv([lambda: gym.make("ALE/Pong-v5", **kwargs)] * 2)
    assert envs.render_mode == "rgb_array"
    envs.reset(seed=0)
    sync.reset(seed=0)
    for _ in range(3):
        envs.step(np.array([2, 3]))
        sync.step(np.array([2, 3]))
    frames = envs.render()
    assert len(frames) == 2
    for frame, want in zip(frames, sync.render(), strict=True):
        assert frame.shape == (210, 160, 3)
        np.testing.assert_array_equal(frame, want)
    sync.close()


# -- infos: the column-by-column fast path against gymnasium's _add_info ------------------

INFO_KEYS = ["lives", "frame", "x", "_x", "final_obs", "name"]
SCALAR_VALUES = [  # one strategy per type gymnasium batches into an array of that dtype
    st.integers(-5, 5),
    st.floats(allow_nan=False, width=32),
    st.booleans(),
    st.integers(-5, 5).map(np.int32),
    st.floats(allow_nan=False, width=32).map(np.float32),
    st.booleans().map(np.bool_),
]
INFO_VALUES = st.one_of(
    *SCALAR_VALUES,
    st.text(max_size=3),
    st.integers(0, 3).map(np.arange),
    st.fixed_dictionaries({"inner": st.integers(0, 3)}),
)


@st.composite
def info_events(draw):
    """(num_envs, events): per env with an info, (env index, info dict). Half the time every
    info has the same keys and each key values of one scalar type (the fast path's case);
    else keys, order and types vary, and env indices may be out of order or repeated."""
    num_envs = draw(st.integers(1, 6))
    indices = sorted(draw(st.sets(st.integers(0, num_envs - 1), min_size=1)))
    keys = draw(st.lists(st.sampled_from(INFO_KEYS), min_size=1, max_size=3, unique=True))
    if draw(st.booleans()):
        values = {key: draw(st.sampled_from(SCALAR_VALUES)) for key in keys}
        return num_envs, [(i, {key: draw(values[key]) for key in keys}) for i in indices]
    if draw(st.booleans()):
        indices = draw(st.permutations([*indices, indices[0]]))
    events = [(i, {key: draw(INFO_VALUES) for key in draw(st.permutations(keys))}) for i in indices]
    return num_envs, events


class _Infos(VectorEnv):
    def __init__(self, num_envs):
        self.num_envs = num_envs


@pytest.mark.slow
@given(info_events())
@settings(max_examples=300, deadline=None)
def test_flat_infos_match_gymnasium_add_info(case):
    """Where the fast path answers, it gives exactly what adding the infos one by one with
    gymnasium's VectorEnv._add_info gives (dtypes, values, masks, key order)."""
    from envfleet._core.infos import flat_infos

    num_envs, events = case
    want: dict = {}
    adder = _Infos(num_envs)
    try:
        for index, info in events:
            want = adder._add_info(want, info, index)
    except Exception:  # infos gymnasium cannot batch (an int array given a string or a dict)
        assert flat_infos(events, num_envs) is None
        return
    got = flat_infos(events, num_envs)
    if got is not None:
        assert_same(got, want)
        assert len({id(value) for value in got.values()}) == len(got)  # no shared arrays


def test_flat_infos_take_atari_infos():
    """Atari's infos (the same int keys from every env, every step) take the fast path."""
    from envfleet._core.infos import flat_infos

    info = {"lives": 3, "episode_frame_number": 8, "frame_number": 12}
    for indices in ([0, 1, 2, 3], [1, 3]):
        events = [(i, dict(info, lives=i)) for i in indices]
        got = flat_infos(events, 4)
        assert got is not None
        want: dict = {}
        for index, env_info in events:
            want = _Infos(4)._add_info(want, env_info, index)
        assert_same(got, want)
    assert flat_infos([(0, info), (1, dict(info, lives=3.0))], 2) is None  # int and float
