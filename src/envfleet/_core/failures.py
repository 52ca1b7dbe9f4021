"""The typed errors built from a failure: one place for what the front and every
transport raise when an env fails, so that two layers share them from below.

- :func:`env_error`: the :class:`~envfleet.EnvError` of an env that raised (also of the env's
  exception type where it can be: :func:`envfleet._core.errors.make_env_error`);
- :func:`failure_error`: the same for an env that raised in this process (an
  :class:`~envfleet._core.envgroup.EnvFailure`);
- :func:`remote_cause`, :func:`remote_env_error`: the driver's side of an exception raised in a
  worker (a :class:`~envfleet._core.protocol.RemoteError`: its type, message, traceback and the
  exception pickled), chained as ``__cause__`` as ``concurrent.futures.ProcessPoolExecutor``
  chains a worker's traceback;
- :func:`start_error`, :func:`mismatch_error`: a worker that could not start, an env whose
  spaces differ from env 0's.
"""

from __future__ import annotations

import contextlib
import pickle
from typing import Any

from envfleet._core.envgroup import EnvFailure
from envfleet._core.errors import (
    ConfigError,
    EnvError,
    EnvfleetError,
    RemoteTraceback,
    SpaceMismatchError,
    make_env_error,
)
from envfleet._core.protocol import RemoteError

__all__ = [
    "CLOSED",
    "env_error",
    "failure_error",
    "mismatch_error",
    "remote_cause",
    "remote_env_error",
    "start_error",
]

# What became of the vector env after a worker's crash, as its EnvCrashedError says
# (the default; a restart policy's survived crash says it was restarted instead).
CLOSED = "the vector env was closed"


def env_error(
    env_index: int,
    worker_index: int | None,
    method: str,
    cause_text: str,
    original: BaseException | None = None,
) -> EnvError:
    """The :class:`EnvError` for an env that raised ``original`` (also of its type where
    possible: :func:`envfleet._core.errors.make_env_error`)."""
    where = f"sub-environment {env_index}" + (
        f" (worker {worker_index})" if worker_index is not None else ""
    )
    return make_env_error(
        f"{where} raised in {method}: {cause_text}", env_index, worker_index, method, original
    )


def mismatch_error(mismatch: tuple[int, str]) -> SpaceMismatchError:
    """The error for ``EnvGroup.check_spaces``'s (env_index, description) of a mismatch."""
    env_index, problem = mismatch
    return SpaceMismatchError(
        f"sub-environment {env_index} has another space than env 0: {problem}"
    )


def failure_error(failure: EnvFailure, note: str = "") -> EnvError:
    """The :class:`EnvError` for an env that raised in this process (no worker index)."""
    cause = failure.__cause__
    text = f"{type(cause).__name__}: {cause}" + (f" ({note})" if note else "")
    return env_error(failure.env_index, None, failure.method, text, cause)


def start_error(error: RemoteError, worker_index: int) -> EnvfleetError:
    """The error for a worker that could not build its envs: a :class:`ConfigError` raised
    there (a factory that returned no ``gymnasium.Env``) as itself, else the env's
    :class:`EnvError` (:func:`remote_env_error`)."""
    if error.exception is not None:
        with contextlib.suppress(Exception):
            cause = pickle.loads(error.exception)
            if isinstance(cause, ConfigError):
                return cause
    return remote_env_error(error, worker_index, "")


def remote_env_error(error: RemoteError, worker_index: int, note: str) -> EnvError:
    """The :class:`EnvError` for an env error reported by a worker: the remote exception
    (unpickled, else rebuilt as a ``RuntimeError``) chained as ``__cause__``, with the remote
    traceback as its own cause (:func:`remote_cause`)."""
    cause, original = remote_cause(error)
    text = f"{error.type_name}: {error.message}" + (f" ({note})" if note else "")
    exc = env_error(error.env_index, worker_index, error.method, text, original)
    exc.__cause__ = cause
    return exc


def remote_cause(error: RemoteError) -> tuple[BaseException, BaseException | None]:
    """The driver's side of :func:`remote_error`: ``(cause, original)``.

    ``cause`` is the remote exception unpickled (else a ``RuntimeError`` naming its type and
    message), with the remote traceback as its ``__cause__``
    (:class:`~envfleet._core.errors.RemoteTraceback`); chain it as ``__cause__`` of the error
    raised. ``original`` is the unpickled exception, ``None`` when it did not unpickle.
    """
    cause: Any = None
    if error.exception is not None:
        with contextlib.suppress(Exception):
            cause = pickle.loads(error.exception)
    original = cause if isinstance(cause, BaseException) else None
    if original is None:
        cause = RuntimeError(f"{error.type_name}: {error.message}")
    cause.__cause__ = RemoteTraceback(error.traceback)
    return cause, original
