"""Compatibility with code written for gymnasium's AsyncVectorEnv (issue 17, item 15).

Timeouts of ``*_wait(timeout=)``, the error types gymnasium's callers catch
(``multiprocessing.TimeoutError``, ``RuntimeError`` for space mismatches, the env's own
exception type) and the warning of ``close()`` with a call pending.
"""

from __future__ import annotations

import functools
import multiprocessing
import time
from typing import Any

import gymnasium
import numpy as np
import pytest

import envfleet
from tests.envs import CustomEnvException, NewArgsException, SlowEnv, TypedRaisingEnv
from tests.helpers import start_pending_call

HANG = 3600.0


def _slow(
    delays: dict[int, float] | None = None, reset_delays: dict[int, float] | None = None
) -> Any:
    return functools.partial(SlowEnv, delays=delays, reset_delays=reset_delays)


# Two envs, env 1 in a worker (process or thread) of its own, env 0 where the layout puts it.
_WORKER_LAYOUTS = {
    "processes": {
        "backend": envfleet.Processes(driver_envs=0),
        "num_workers": 2,
    },
    "threads": {"backend": "threads", "num_workers": 2},
}


@pytest.mark.parametrize(
    "backend,method",
    [
        ("processes", "step"),
        ("processes", "reset"),
        ("processes", "call"),
        ("threads", "step"),
        ("threads", "reset"),
    ],
)
def test_wait_timeout_raises_timeout_error(make_env, snapshot, backend, method):
    """A ``*_wait(timeout=)`` on a hung worker raises, after about ``timeout`` seconds, an
    error that is both envfleet's StepTimeoutError and gymnasium's multiprocessing.TimeoutError;
    the vector env is closed and (processes) nothing is left behind."""
    delays = {1: HANG} if method != "reset" else None
    reset_delays = {1: HANG} if method == "reset" else None
    envs = make_env(_slow(delays, reset_delays), 2, **_WORKER_LAYOUTS[backend])
    if method == "reset":
        started = time.monotonic()
        wait = start_pending_call(envs, method)
    else:
        wait = start_pending_call(envs, method)
        started = time.monotonic()
    assert time.monotonic() - started < 5.0, "the *_async call waited for the hung env"
    with pytest.raises(multiprocessing.TimeoutError) as raised:
        wait(timeout=0.5)
    elapsed = time.monotonic() - started
    assert isinstance(raised.value, envfleet.StepTimeoutError)
    assert 1 in raised.value.env_indices
    assert 0.4 < elapsed < 10.0
    assert envs.closed
    envs.close(terminate=True)
    if backend == "processes":
        snapshot.assert_nothing_left()


# Layouts where env 0 runs in the calling thread (the driver's block, the inline group, serial).
CALLING_THREAD_LAYOUTS = pytest.mark.parametrize(
    "layout",
    [
        {
            "backend": envfleet.Processes(driver_envs=1),
            "num_workers": 1,
        },
        {"backend": "threads", "num_workers": 2},
        {"backend": "serial"},
    ],
    ids=["processes-driver-block", "threads", "serial"],
)


@CALLING_THREAD_LAYOUTS
@pytest.mark.parametrize("method", ["step", "reset"])
def test_async_returns_at_once_and_wait_times_out(make_env, snapshot, layout, method):
    """Env 0 steps in the calling thread (the driver's block, the inline thread group,
    serial): ``*_async`` still returns at once, as gymnasium's does, and a wait whose
    timeout the call overran raises the timeout error once env 0 is done (it cannot be
    interrupted) instead of returning as if in time."""
    delay = 1.5
    delays = {0: delay} if method == "step" else None
    reset_delays = {0: delay} if method == "reset" else None
    envs = make_env(_slow(delays, reset_delays), 2, **layout)
    if method == "step":
        envs.reset(seed=0)
    started = time.monotonic()
    if method == "step":
        envs.step_async(np.zeros(2, dtype=np.int64))
    else:
        envs.reset_async(seed=0)
    assert time.monotonic() - started < delay / 2, "the *_async call ran env 0 to the end"
    with pytest.raises(multiprocessing.TimeoutError) as raised:
        (envs.step_wait if method == "step" else envs.reset_wait)(timeout=0.2)
    assert isinstance(raised.value, envfleet.StepTimeoutError)
    assert 0 in raised.value.env_indices
    assert "cannot be interrupted" in str(raised.value)
    assert envs.closed
    assert envs.stats.timeouts == 1  # counted once, by the supervisor's broken path
    envs.close(terminate=True)
    snapshot.assert_nothing_left()


@CALLING_THREAD_LAYOUTS
def test_async_then_wait_in_time_gives_the_results(make_env, layout):
    """Deferring the calling thread's envs to the wait changes no result."""
    envs = make_env(_slow({0: 0.05, 1: 0.05}), 2, **layout)
    envs.reset_async(seed=3)
    obs, _ = envs.reset_wait(timeout=30)
    envs.step_async(np.array([1, 0]))
    _, rewards, *_ = envs.step_wait(timeout=30)
    envs.call_async("slow")
    assert envs.call_wait(timeout=30) == (0, 1)
    ref = envfleet.make(_slow(), 2, backend="serial")
    want, _ = ref.reset(seed=3)
    ref.close()
    np.testing.assert_array_equal(obs, want)
    np.testing.assert_array_equal(rewards, [0.0, 1.0])


@pytest.mark.parametrize("backend", ["processes", "threads", "serial"])
def test_space_mismatch_is_a_runtime_error(snapshot, backend):
    """Sub-environments with different spaces raise SpaceMismatchError, which gymnasium's
    callers catch as ``RuntimeError`` (AsyncVectorEnv's type for it)."""
    fns = [functools.partial(gymnasium.make, "CartPole-v1") for _ in range(3)]
    fns[1] = functools.partial(gymnasium.make, "FrozenLake-v1")
    with pytest.raises(RuntimeError) as raised:
        envfleet.make(fns, backend=backend, num_workers=3)
    assert isinstance(raised.value, envfleet.SpaceMismatchError)
    snapshot.assert_nothing_left()


def test_env_exception_whose_type_refuses_envfleets_arguments_is_a_plain_env_error(make_env):
    """A type whose ``__new__`` takes its own arguments cannot be instantiated as the
    combined class: the error is then a plain EnvError, the original chained as its cause."""
    envs = make_env(functools.partial(TypedRaisingEnv, kind="new"), 2, backend="serial")
    envs.reset(seed=0)
    with pytest.raises(envfleet.EnvError) as raised:
        envs.step(np.zeros(2, dtype=np.int64))
    assert type(raised.value) is envfleet.EnvError
    assert isinstance(raised.value.__cause__, NewArgsException)


def test_env_exception_type_in_process_env():
    with envfleet.ProcessEnv(functools.partial(TypedRaisingEnv, kind="key", fail_index=0)) as penv:
        penv.reset(seed=0)
        with pytest.raises(KeyError) as raised:
            penv.step(0)
        assert isinstance(raised.value, envfleet.EnvError)
        assert raised.value.env_index == 0


def test_env_exception_type_in_sampler():
    sampler = envfleet.Sampler(
        functools.partial(TypedRaisingEnv, kind="custom"),
        lambda o: np.zeros(len(o), dtype=np.int64),
        2,
        num_workers=2,
    )
    try:
        with pytest.raises(CustomEnvException) as raised:
            sampler.sample(10)
        assert isinstance(raised.value, envfleet.EnvError)
        assert raised.value.env_index == 1
        assert raised.value.code == 7
    finally:
        sampler.close()
