"""The error types (envfleet._core.errors, re-exported by envfleet): their hierarchy, which lets
code written for gymnasium's vector envs catch them, their fields, and pickling."""

from __future__ import annotations

import multiprocessing
import pickle
import signal
from typing import Any

import gymnasium
import pytest

import envfleet

# (error, the types code written for gymnasium or the standard library catches it as)
HIERARCHY = [
    (envfleet.ConfigError, (ValueError,)),
    (envfleet.SpaceMismatchError, (envfleet.ConfigError, RuntimeError)),
    (envfleet.InvalidArgumentError, (ValueError, TypeError)),
    (envfleet.InvalidActionError, (envfleet.InvalidArgumentError,)),
    (envfleet.ResetNeededError, (gymnasium.error.ResetNeeded,)),
    (envfleet.StepTimeoutError, (multiprocessing.TimeoutError,)),
    (envfleet.StartTimeoutError, (multiprocessing.TimeoutError,)),
    (envfleet.AlreadyPendingCallError, (gymnasium.error.AlreadyPendingCallError,)),
    (envfleet.NoAsyncCallError, (gymnasium.error.NoAsyncCallError,)),
    (envfleet.ClosedEnvironmentError, (gymnasium.error.ClosedEnvironmentError,)),
    (envfleet.UnsupportedError, (NotImplementedError,)),
    (envfleet.EnvError, ()),
    (envfleet.EnvCrashedError, ()),
    (envfleet.WrongProcessError, ()),
    (envfleet.PoolStateError, ()),
]


@pytest.mark.parametrize(("error", "bases"), HIERARCHY, ids=[e.__name__ for e, _ in HIERARCHY])
def test_every_error_is_an_envfleet_error_and_what_gymnasium_callers_catch(
    error: type[Exception], bases: tuple[type[Exception], ...]
) -> None:
    assert issubclass(error, envfleet.EnvfleetError)
    for base in bases:
        assert issubclass(error, base), (error, base)


def test_env_crashed_error_fields() -> None:
    err = envfleet.EnvCrashedError(
        "worker 1 died", env_indices=[2, 3], worker_index=1, exitcode=-signal.SIGSEGV, step=4
    )
    assert (err.env_index, err.env_indices, err.worker_index, err.step) == (2, [2, 3], 1, 4)
    assert (err.exitcode, err.signal) == (-signal.SIGSEGV, signal.SIGSEGV)
    exited = envfleet.EnvCrashedError(
        "worker 0 exited", env_indices=[0], worker_index=0, exitcode=3, step=0
    )
    assert (exited.exitcode, exited.signal) == (3, None)


def _roundtrip(error: Exception) -> Any:
    return pickle.loads(pickle.dumps(error))


def test_env_error_pickles_with_its_fields() -> None:
    err = envfleet.EnvError("sub-environment 1 raised in step", 1, 0, "step")
    copy = _roundtrip(err)
    assert type(copy) is envfleet.EnvError
    assert (copy.env_index, copy.worker_index, copy.method) == (1, 0, "step")
    assert str(copy) == str(err)


@pytest.mark.parametrize(
    "error",
    [
        envfleet.SpaceMismatchError("sub-environment 1", [1]),
        envfleet.PoolStateError("env 2 is running", [2]),
        envfleet.RemoteTraceback("Traceback (most recent call last): ..."),
        envfleet.ConfigError("num_envs must be at least 1"),
    ],
    ids=lambda e: type(e).__name__,
)
def test_errors_pickle_with_their_fields(error: Exception) -> None:
    copy = _roundtrip(error)
    assert type(copy) is type(error)
    assert str(copy) == str(error)
    assert vars(copy) == vars(error)


@pytest.mark.parametrize(
    "error",
    [
        envfleet.EnvCrashedError("died", env_indices=[1], worker_index=0, exitcode=-9, step=3),
        envfleet.StepTimeoutError("late", [1], 2.0),
        envfleet.StartTimeoutError("late", [1], 2.0),
        envfleet.WrongProcessError("forked", 5),
        envfleet.ResetNeededError("reset first", [1]),
    ],
    ids=lambda e: type(e).__name__,
)
def test_errors_with_keyword_fields_pickle(error: Exception) -> None:
    """Errors whose constructor takes more than the message pickle too (a worker's or a Ray
    actor's error travels pickled)."""
    copy = _roundtrip(error)
    assert type(copy) is type(error) and str(copy) == str(error)
    assert vars(copy) == vars(error)
