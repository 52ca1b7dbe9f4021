"""Typed errors of envfleet.

Every error derives from :class:`EnvfleetError`. The call-state errors also derive from
gymnasium's own classes (``gymnasium.error.AlreadyPendingCallError`` and friends), so code
written against ``gymnasium.vector.AsyncVectorEnv`` keeps catching them.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import signal as _signal
from collections.abc import Mapping, Sequence
from typing import Any

import gymnasium.error

__all__ = [
    "AlreadyPendingCallError",
    "ClosedEnvironmentError",
    "ConfigError",
    "EnvCrashedError",
    "EnvError",
    "EnvRestartedWarning",
    "EnvfleetError",
    "HangWarning",
    "InvalidActionError",
    "InvalidArgumentError",
    "NoAsyncCallError",
    "PoolStateError",
    "RemoteTraceback",
    "ResetNeededError",
    "SpaceMismatchError",
    "StartTimeoutError",
    "StepTimeoutError",
    "UnsupportedError",
    "WrongProcessError",
]


class EnvfleetError(Exception):
    """Base class of every error envfleet raises.

    Every one pickles with its fields (``env_indices``, ``timeout``...), also those whose
    constructor takes more than the message: it is rebuilt from its class, ``args`` and
    attributes, not by calling the constructor again (``Exception``'s own pickling passes
    only ``args``).
    """

    def __reduce__(self) -> tuple[Any, ...]:
        return _rebuild_error, (type(self), self.args, self.__dict__)


def _rebuild_error(cls: type[BaseException], args: tuple[Any, ...], state: dict[str, Any]) -> Any:
    error = cls.__new__(cls, *args)
    error.args = args
    error.__dict__.update(state)
    return error


class ConfigError(EnvfleetError, ValueError):
    """Bad arguments to :func:`envfleet.make`, found before any worker starts.

    Raised for: ``num_envs < 1``, ``num_workers`` out of ``[1, num_envs]``, an unknown backend,
    an unknown gymnasium id, a factory that cannot be pickled for the worker processes, a
    space the backend cannot hold in shared memory.
    """


class SpaceMismatchError(ConfigError, RuntimeError):
    """The sub-environments' spaces do not fit together: with ``observation_mode="same"``
    (the default) their observation spaces differ, otherwise they differ in shape or dtype;
    or their action spaces differ.

    It derives from ``RuntimeError`` too: gymnasium's SyncVectorEnv and AsyncVectorEnv raise
    that for the same checks.
    """


class InvalidArgumentError(EnvfleetError, ValueError, TypeError):
    """A bad argument to a call on a running vector env (seeds, reset mask, set_attr values).

    It derives from both ``ValueError`` and ``TypeError`` because gymnasium raises one or the
    other for the same checks. Raised before anything is sent to a worker.
    """


class InvalidActionError(InvalidArgumentError):
    """Actions whose structure, shape or dtype do not fit the batched action space.

    Raised by ``step``/``step_async`` before anything is sent to a worker; the vector env is
    left exactly as it was.
    """


class ResetNeededError(EnvfleetError, gymnasium.error.ResetNeeded):
    """``step`` in ``AutoresetMode.DISABLED`` while some sub-environment has ended its episode.

    gymnasium's SyncVectorEnv asserts the same condition; envfleet checks it before sending the
    actions. ``env_indices`` lists the sub-environments that must be reset first (for example
    with ``reset(options={"reset_mask": mask})``).
    """

    def __init__(self, message: str, env_indices: Sequence[int]):
        super().__init__(message)
        self.env_indices = list(env_indices)


class RemoteTraceback(Exception):
    """Carries the formatted traceback of an exception raised in another process.

    It is set as the ``__cause__`` of the re-raised remote exception, the way
    ``concurrent.futures.ProcessPoolExecutor`` does, so that printing the error shows both
    tracebacks.
    """

    def __init__(self, tb: str):
        super().__init__(tb)
        self.tb = tb

    def __str__(self) -> str:
        return self.tb


class EnvError(EnvfleetError):
    """An exception raised inside a sub-environment (step, reset, call, get_attr, set_attr, render).

    Attributes:
        env_index: global index of the sub-environment that raised (``0 <= env_index < num_envs``).
        worker_index: index of the worker that holds it (``None`` for in-process backends).
        method: the environment method that raised, e.g. ``"step"`` or ``"reset"``.
        replay: for ``step`` and ``reset``, what reproduces it in one process
            (:class:`envfleet.Replay`: ``err.replay.save(path)``, then ``envfleet replay
            PATH``); ``None`` for other methods and with ``replay_steps=0``.

    The original exception is chained as ``__cause__``; for a process backend its own
    ``__cause__`` is a :class:`RemoteTraceback` with the worker-side traceback text.

    The error raised is also an instance of the original exception's type where that type
    allows it (:func:`env_error_type`), so ``except ValueError`` written for gymnasium's
    vector envs, which re-raise the env's own exception, still catches it.
    """

    def __init__(self, message: str, env_index: int, worker_index: int | None, method: str):
        # Not super(): in an env_error_type class that would run the original type's
        # __init__, whose arguments are its own.
        Exception.__init__(self, message)
        self.env_index = env_index
        self.worker_index = worker_index
        self.method = method
        self.replay: Any = None

    def __reduce__(self) -> tuple[Any, ...]:
        original = getattr(type(self), "original_type", None)
        return (
            _rebuild_env_error,
            (original, str(self), self.env_index, self.worker_index, self.method),
            self.__dict__,
        )


_ENV_ERROR_TYPES: dict[type[BaseException], type[EnvError]] = {}
_OSERROR_FIELDS = ("errno", "strerror", "filename", "filename2")


def env_error_type(original: type[BaseException] | None) -> type[EnvError]:
    """:class:`EnvError`, or a cached subclass of both it and ``original``
    (named ``EnvError[ValueError]`` etc.) where Python allows one.

    ``original`` must be an ``Exception`` subclass that is not an envfleet error and whose
    layout admits the second base; otherwise (``KeyboardInterrupt``, a ``TypeError`` on
    class creation) it is plain :class:`EnvError`.
    """
    if (
        original is None
        or not issubclass(original, Exception)
        or issubclass(original, EnvfleetError)
    ):
        return EnvError
    cls = _ENV_ERROR_TYPES.get(original)
    if cls is None:
        try:
            cls = type(
                f"EnvError[{original.__name__}]",
                (EnvError, original),
                {
                    "__module__": __name__,
                    "__str__": BaseException.__str__,  # the message, not KeyError's repr
                    "original_type": original,
                },
            )
        except TypeError:  # layout conflict, a final class, a metaclass conflict
            cls = EnvError
        _ENV_ERROR_TYPES[original] = cls
    return cls


def make_env_error(
    message: str,
    env_index: int,
    worker_index: int | None,
    method: str,
    original: BaseException | None = None,
) -> EnvError:
    """An :class:`EnvError` that is also of ``type(original)`` where possible
    (:func:`env_error_type`), carrying ``original``'s attributes (its ``__dict__`` and, for
    an ``OSError``, ``errno``/``strerror``/``filename``); plain :class:`EnvError` when the
    original type's ``__new__`` refuses these arguments."""
    cls = env_error_type(None if original is None else type(original))
    if cls is EnvError:
        return EnvError(message, env_index, worker_index, method)
    try:
        exc = cls(message, env_index, worker_index, method)
    except Exception:  # the original type's __new__ wants arguments of its own
        return EnvError(message, env_index, worker_index, method)
    if isinstance(original, OSError):
        for name in _OSERROR_FIELDS:
            with contextlib.suppress(AttributeError, TypeError):
                setattr(exc, name, getattr(original, name))
    for name, value in getattr(original, "__dict__", {}).items():
        if name not in exc.__dict__:
            exc.__dict__[name] = value
    return exc


def _rebuild_env_error(
    original: type[BaseException] | None,
    message: str,
    env_index: int,
    worker_index: int | None,
    method: str,
) -> EnvError:
    """Unpickle an :class:`EnvError` (its ``__dict__`` is restored by pickle)."""
    cls = env_error_type(original)
    try:
        return cls(message, env_index, worker_index, method)
    except Exception:
        return EnvError(message, env_index, worker_index, method)


def describe_exitcode(exitcode: int | None) -> str:
    """'exit code 3', 'signal SIGSEGV' or 'still running' for a process exit code."""
    if exitcode is None:
        return "still running"
    if exitcode < 0:
        try:
            return f"signal {_signal.Signals(-exitcode).name}"
        except ValueError:
            return f"signal {-exitcode}"
    return f"exit code {exitcode}"


class EnvCrashedError(EnvfleetError):
    """A worker process died (segfault, ``os._exit``, SIGKILL, out-of-memory kill, ...).

    Under the ``spawn`` and ``forkserver`` start methods, a worker that could not start
    because the main module, which it imports first, starts worker processes when imported
    (the script lacks ``if __name__ == "__main__":``; multiprocessing's "bootstrapping phase"
    error) is reported with this error too: its message says so and names the fix (that
    guard, or ``backend=envfleet.Processes(context="fork")`` on Linux), and the worker's stack
    is chained as ``__cause__`` (a :class:`RemoteTraceback`).

    Attributes:
        env_index: the first sub-environment the dead worker held.
        env_indices: every sub-environment the dead worker held.
        worker_index: the dead worker.
        exitcode: the process exit code (negative: killed by signal ``-exitcode``).
        signal: the signal number that killed it, or ``None``.
        step: how many ``step`` calls the vector env had completed when the crash was seen.
        stacks: a ``str`` (one worker died, so one text; not the ``dict`` of
            :attr:`StepTimeoutError.stacks`): for a worker process killed by a fatal signal
            (SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT), what its faulthandler wrote: every
            thread's stack at the fault, innermost frame first (the message names the env's
            innermost frame); ``""`` for a death that leaves none (SIGKILL, ``os._exit``) and
            for a Ray actor whose node was lost with it (on Ray the envfleet helper of the
            actor's node reads the file, on every node). Read it as text:
            ``print(err.stacks or "no stack")``.
        rss_bytes: the worker process's resident memory when last seen (sampled about once
            a second), ``None`` where unknown; a SIGKILL's message gives it (the OOM killer
            kills so).
        replay: the dead worker's envs' episodes up to the crash (:class:`envfleet.Replay`),
            which ``envfleet replay`` runs in a child process it watches; ``None`` with
            ``replay_steps=0`` and for a Ray actor whose node was lost with it (the record
            is a file of its node, which that node's envfleet helper reads).
    """

    def __init__(
        self,
        message: str,
        *,
        env_indices: Sequence[int],
        worker_index: int,
        exitcode: int | None,
        step: int,
        stacks: str = "",
        rss_bytes: int | None = None,
    ):
        super().__init__(message)
        self.stacks = stacks
        self.rss_bytes = rss_bytes
        self.env_indices = list(env_indices)
        self.env_index = self.env_indices[0] if self.env_indices else -1
        self.worker_index = worker_index
        self.exitcode = exitcode
        self.signal = -exitcode if exitcode is not None and exitcode < 0 else None
        self.step = step
        self.replay: Any = None


class _TimedOut(EnvfleetError, multiprocessing.TimeoutError):
    """What :class:`StepTimeoutError` and :class:`StartTimeoutError` share: the envs not
    done in time, the timeout (seconds) and the late workers' stacks."""

    def __init__(
        self,
        message: str,
        env_indices: Sequence[int],
        timeout: float,
        stacks: Mapping[int, str] | None = None,
    ):
        super().__init__(message)
        self.env_indices = list(env_indices)
        self.timeout = timeout
        self.stacks = dict(stacks or {})
        self.replay: Any = None


class StepTimeoutError(_TimedOut):
    """A wait ran past its timeout (``step_timeout`` or ``step_wait(timeout=)``), in seconds.

    It also derives from ``multiprocessing.TimeoutError``, the error gymnasium's AsyncVectorEnv
    raises on a timed-out wait. Unlike gymnasium, the workers still running are killed and the
    vector env is closed: their late results could otherwise be mistaken for the next call's.

    Attributes:
        env_indices: the sub-environments whose workers had not answered.
        timeout: the timeout that expired, in seconds.
        stacks: a ``dict[int, str]`` (several workers can be late at once, so one text
            each; not the ``str`` of :attr:`EnvCrashedError.stacks`): key, the index of a
            late worker; value, the stacks of its threads taken just before it was killed
            (faulthandler's format, innermost frame first; the message names the env's
            innermost frame). A late worker whose stacks could not be taken has no key, and
            the dict is ``{}`` where the backend cannot take them (``serial``). Read it per
            worker:
            ``for worker, text in err.stacks.items(): print(worker, text)``.
        replay: the first hung worker's envs' episodes up to the hang (:class:`envfleet.Replay`;
            ``envfleet replay`` reports the step where it hangs again); ``None`` with
            ``replay_steps=0``.
    """


class StartTimeoutError(_TimedOut):
    """Sub-environments were not built within ``start_timeout`` seconds of ``make()``, or of
    their worker's replacement (restart policy, recycling).

    The workers building them were killed (threads, which cannot be killed, were left behind
    as daemon threads), the vector env is closed and nothing else is left: no process, no
    shared memory. Like
    :class:`StepTimeoutError` it is also a ``multiprocessing.TimeoutError``.

    Attributes:
        env_indices: the sub-environments not built in time (with ``threads``, the one each
            late thread was building and those after it in its block).
        timeout: the ``start_timeout`` that expired, in seconds.
        stacks: a ``dict[int, str]``, as :attr:`StepTimeoutError.stacks`: worker index ->
            the stacks of its threads when it was given up.
    """


class AlreadyPendingCallError(EnvfleetError, gymnasium.error.AlreadyPendingCallError):
    """An asynchronous call was started while another one is pending (gymnasium's semantics)."""


class NoAsyncCallError(EnvfleetError, gymnasium.error.NoAsyncCallError):
    """A ``*_wait`` call without its matching ``*_async`` call (gymnasium's semantics)."""


class ClosedEnvironmentError(EnvfleetError, gymnasium.error.ClosedEnvironmentError):
    """A call on a vector env that was closed (gymnasium's semantics)."""


class WrongProcessError(EnvfleetError):
    """A vector env used in a process forked from the one that made it (``os.fork``, a
    ``fork``-started ``multiprocessing`` child, a torch ``DataLoader`` worker).

    Its workers, shared memory and threads belong to the process that made it, which keeps
    using them; the forked copy refuses every call (``close()`` does nothing there), so the
    maker's results are exactly what they would have been without the fork.

    Attributes:
        owner_pid: the process that made the vector env.
    """

    def __init__(self, message: str, owner_pid: int):
        super().__init__(message)
        self.owner_pid = owner_pid


class PoolStateError(EnvfleetError):
    """A call that does not fit the first-ready pool's state; nothing was sent.

    Raised by ``send`` for an env that is not awaiting an action (still running, its result
    not received yet, or already sent one), by ``recv`` when fewer than ``batch_size`` envs
    are running or ready, by ``send``/``recv`` before ``async_reset``, and by ``step``,
    ``reset`` and the other synchronous calls while pool envs are in flight, or on a pool
    (``batch_size < num_envs``), which only ``async_reset``/``send``/``recv`` drive.

    Attributes:
        env_indices: the envs concerned, where there are some.
    """

    def __init__(self, message: str, env_indices: Sequence[int] = ()):
        super().__init__(message)
        self.env_indices = list(env_indices)


class UnsupportedError(EnvfleetError, NotImplementedError):
    """A call the backend cannot do, refused before anything is sent.

    Raised by ``call``, ``get_attr``, ``set_attr`` and (without ``render_mode="rgb_array"``)
    ``render`` on ``backend="envpool"``, whose native envs have no Python objects. It also
    derives from ``NotImplementedError``.
    """


class HangWarning(UserWarning):
    """A call has waited on busy sub-environments longer than ``hang_report_delay`` seconds.

    Warned (:mod:`warnings`) while the call keeps waiting: first after the delay, then again
    after twice the delay, four times, ... Its message names each busy env (its global
    index), its worker, and the worker's stacks now (faulthandler's format, innermost frame
    first, as :attr:`StepTimeoutError.stacks`; a Ray actor's on any node, taken by the
    envfleet helper of its node), or why they were not taken. Nothing is killed:
    ``step_timeout`` does that.

    Example::

        warnings.simplefilter("ignore", envfleet.HangWarning)  # no report at all
        quiet = envfleet.Supervision(hang_report_delay=None)  # or none for one vector env
        envs = envfleet.make("CartPole-v1", 8, supervision=quiet)
    """


class EnvRestartedWarning(UserWarning):
    """A sub-environment was rebuilt by the restart policy (``Supervision(restart_policy=...)``,
    on by default) instead of failing the call.

    Warned (:mod:`warnings`) once per restart, at the call that found the failure. Its message
    names the env whose episode ended (its global index; the whole block where the worker ran
    several envs at once), the cause (a signal, an exit code, a step past ``step_timeout``, a
    lost connection), the faulting frame where one was written, and the file its replay was
    saved to (``envfleet replay PATH`` reproduces the failure in one process). The failure
    itself is kept in ``envs.stats.failures`` as the error it would have raised.

    Example::

        warnings.simplefilter("error", envfleet.EnvRestartedWarning)  # a restart raises
        fail_fast = envfleet.Supervision(restart_policy=None)  # or: fail fast
        envs = envfleet.make("CartPole-v1", 8, supervision=fail_fast)
    """
