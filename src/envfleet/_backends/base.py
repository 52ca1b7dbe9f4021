"""What every backend implements, and the pieces they share."""

from __future__ import annotations

import abc
import contextlib
import functools
import inspect
import os
import pickle
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import gymnasium
from gymnasium.vector import AutoresetMode

from envfleet._buffers import Batch
from envfleet._envgroup import EnvFailure, EnvGroup
from envfleet._errors import (
    ConfigError,
    EnvError,
    EnvfleetError,
    RemoteTraceback,
    SpaceMismatchError,
    StepTimeoutError,
    WrongProcessError,
    make_env_error,
)
from envfleet._protocol import Command, Failure, RemoteError
from envfleet._supervisor import Ledger, StepTimer, StepTimeStats, log_env_restart, merge_events

__all__ = [
    "Backend",
    "RemoteWorkersBackend",
    "WorkerLayout",
    "accepts_env_index",
    "bind_env_index",
    "remote_env_error",
    "start_error",
    "run_command",
    "worker_ranges",
]

EnvFn = Callable[..., gymnasium.Env[Any, Any]]
_T = TypeVar("_T")


def worker_ranges(num_envs: int, num_workers: int) -> list[tuple[int, int]]:
    """Contiguous blocks ``[start, stop)`` of envs per worker, sizes differing by at most one.

    The first ``num_envs % num_workers`` workers hold one env more. When ``num_workers``
    divides ``num_envs`` every worker holds ``num_envs // num_workers`` envs.
    """
    base, extra = divmod(num_envs, num_workers)
    ranges = []
    start = 0
    for w in range(num_workers):
        stop = start + base + (1 if w < extra else 0)
        ranges.append((start, stop))
        start = stop
    return ranges


def accepts_env_index(fn: Callable[..., Any]) -> bool:
    """Whether ``fn`` takes a keyword argument named ``env_index``."""
    try:
        parameters = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    param = parameters.get("env_index")
    return param is not None and param.kind in (
        inspect.Parameter.POSITIONAL_OR_KEYWORD,
        inspect.Parameter.KEYWORD_ONLY,
    )


def bind_env_index(
    fn: EnvFn, env_index: int, accepts: bool
) -> Callable[[], gymnasium.Env[Any, Any]]:
    """A zero-argument factory: ``fn(env_index=env_index)`` when ``fn`` accepts it, else ``fn``."""
    return functools.partial(fn, env_index=env_index) if accepts else fn


@dataclass
class WorkerLayout:
    """Everything a backend needs to build its EnvGroups.

    Attributes:
        env_fns: one factory per env (may repeat the same object); not yet bound to env_index.
        accepts_index: per env, whether its factory takes ``env_index``.
        single_observation_space, single_action_space: spaces of one sub-environment.
        autoreset_mode: as gymnasium's.
        ranges: ``[start, stop)`` per worker, contiguous, in order.
        same_observation_space: ``observation_mode == "same"`` (see EnvGroup).
    """

    env_fns: Sequence[EnvFn]
    accepts_index: Sequence[bool]
    single_observation_space: gymnasium.Space[Any]
    single_action_space: gymnasium.Space[Any]
    autoreset_mode: AutoresetMode
    ranges: Sequence[tuple[int, int]]
    same_observation_space: bool = True

    @property
    def num_envs(self) -> int:
        return len(self.env_fns)

    def bound_fns(self, start: int, stop: int) -> list[Callable[[], gymnasium.Env[Any, Any]]]:
        """Zero-argument factories of envs ``[start, stop)``, bound to their ``env_index``."""
        return [
            bind_env_index(self.env_fns[i], i, self.accepts_index[i]) for i in range(start, stop)
        ]


def run_command(group: EnvGroup, command: Command, payload: Any, timer: StepTimer) -> Any:
    """Run ``command`` on ``group`` here and now, recording a step's duration in ``timer``.

    The one dispatch of commands to an EnvGroup for the backends that call it directly
    (``serial``, ``threads``, each ``ray`` actor). Returns what travels back to the front.

    Raises:
        EnvFailure: an env raised (:class:`PartialFailure` for some envs of a step or reset).
    """
    if command is Command.STEP:
        if payload is not None:  # the values of the action leaves without a fixed size
            return timer.call(functools.partial(group.step, payload))
        return timer.call(group.step)
    return group.run(command, payload)


def env_error(
    env_index: int,
    worker_index: int | None,
    method: str,
    cause_text: str,
    original: BaseException | None = None,
) -> EnvError:
    """The :class:`EnvError` for an env that raised ``original`` (also of its type where
    possible: :func:`envfleet._errors.make_env_error`)."""
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
    traceback as its own cause."""
    cause: BaseException | None = None
    if error.exception is not None:
        with contextlib.suppress(Exception):
            cause = pickle.loads(error.exception)
    original: BaseException | None = cause if isinstance(cause, BaseException) else None
    if not isinstance(cause, BaseException):
        cause = RuntimeError(f"{error.type_name}: {error.message}")
    cause.__cause__ = RemoteTraceback(error.traceback)
    text = f"{error.type_name}: {error.message}" + (f" ({note})" if note else "")
    exc = env_error(error.env_index, worker_index, error.method, text, original)
    exc.__cause__ = cause
    return exc


class Backend(abc.ABC):
    """A transport between the front and its EnvGroups.

    The front writes actions into ``batch.actions``, calls :meth:`submit` with one payload per
    worker that must act, then :meth:`collect` for their results, in worker order. Results
    carry only what does not live in ``batch`` (infos, call results).
    """

    batch: Batch
    ranges: Sequence[tuple[int, int]]
    ledger: Ledger  # failures, restarts and seeds, for the supervisor and ``envs.stats``

    @property
    def num_workers(self) -> int:
        return len(self.ranges)

    @property
    def closed(self) -> bool:
        """Whether the backend has shut down (after close, a crash, a timeout, an interrupt)."""
        return False

    @abc.abstractmethod
    def submit(self, command: Command, payloads: Mapping[int, Any], step: int) -> None:
        """Start ``command`` on the workers named in ``payloads`` (worker index -> payload).

        ``step`` is the number of completed steps, for error reports.

        Raises:
            EnvCrashedError: a worker died since its last reply; the backend is shut down.
        """

    @abc.abstractmethod
    def collect(self, timeout: float | None, step: int) -> dict[int, Any]:
        """Wait for every submitted worker and return worker index -> result, in worker order.

        With a restart policy (``ledger.policy``), a step or reset in which envs raised, or
        workers died or ran past ``timeout``, rebuilds them while the budget allows and
        returns every result, the rebuilt envs' included (see :class:`RestartPolicy`).

        Raises:
            EnvError: an env raised; every other worker's reply has been read first, so the
                backend stays usable (unless rebuilding an env failed: then it is shut down).
            EnvCrashedError: a worker died; the backend is shut down.
            StepTimeoutError: ``timeout`` (seconds) expired; the backend is shut down.
        """

    def disown(self) -> None:  # noqa: B027  (most backends hold nothing a fork could break)
        """In a process forked from the one that made this backend: forget what is the
        maker's (workers, threads) without touching it; the backend is not used again."""

    def inline_groups(self, command: Command) -> frozenset[int]:
        """The groups :meth:`submit` runs in the calling thread, to the end, for ``command``.

        No timeout can interrupt them; the front's asynchronous calls (``step_async`` and
        friends) submit them at the wait instead, so that ``*_async`` returns at once.
        """
        return frozenset()

    def round(
        self, command: Command, payloads: Mapping[int, Any], timeout: float | None, step: int
    ) -> dict[int, Any]:
        """:meth:`submit` then :meth:`collect`, in one call (the synchronous ``step()``).

        A backend may override it with a shorter path; errors are those of the two calls.
        """
        self.submit(command, payloads, step)
        return self.collect(timeout, step)

    def collect_ready(self, timeout: float | None, step: int) -> dict[int, Any]:
        """First-ready pool: wait until at least one submitted worker is done and return the
        results of every worker done by then. Workers may be submitted to while others run.
        ``timeout``: seconds each worker may take from the :meth:`submit` that started it; a
        worker past it raises :class:`StepTimeoutError` even while others keep replying, and
        a dead worker raises :class:`EnvCrashedError` at the first call after its death.

        Raises: as :meth:`collect`.
        """
        return self.collect(timeout, step)

    def drop_kept(self) -> None:  # noqa: B027  (a backend that keeps nothing has nothing to do)
        """Forget results and errors :meth:`collect_ready` kept for its next calls."""

    @abc.abstractmethod
    def step_times(self) -> tuple[StepTimeStats, ...]:
        """Per worker, the step-time statistics so far (no round trip to the workers)."""

    @abc.abstractmethod
    def close(self, timeout: float | None, terminate: bool) -> None:
        """Close every env and release every process and buffer; bounded by ``timeout``."""


class DisownedBackend:
    """What a vector env holds in a process forked from the one that made it: every use
    raises :class:`WrongProcessError`; ``close`` does nothing (the maker's workers are not
    this process's to close)."""

    closed = False

    def __init__(self, owner_pid: int):
        self.owner_pid = owner_pid

    def close(self, timeout: float | None, terminate: bool) -> None:
        pass

    def __getattr__(self, name: str) -> Any:
        raise WrongProcessError(
            f"this vector env was made by process {self.owner_pid} and cannot be used in "
            f"process {os.getpid()}, forked from it: make one in this process instead",
            self.owner_pid,
        )


class RemoteWorkersBackend(Backend):
    """The supervisor's decision for backends whose workers live apart (``processes``,
    ``ray``), written once: after a round in which envs raised or workers died or hung,
    rebuild them within the restart policy's budget, or raise the typed error."""

    _command: Command
    # A first-ready pool reports one env error per call: what a round read beside it waits
    # here for the next calls, so nothing finished is lost and every failed block is reported.
    _kept: dict[int, Any]  # worker -> reply
    _kept_failures: list[tuple[int, Failure]]  # (worker, failure), in worker order

    def drop_kept(self) -> None:
        self._kept, self._kept_failures = {}, []

    def _take_kept(self) -> dict[int, Any] | None:
        """What an earlier pool round kept: raise its next env error (:class:`EnvError`),
        else return its replies and forget them; ``None`` when nothing is kept."""
        if self._kept_failures:
            w, failure = self._kept_failures.pop(0)
            raise remote_env_error(failure.errors[0], w, "")
        if self._kept:
            kept, self._kept = self._kept, {}
            return kept
        return None

    def _ready_replies(
        self, results: dict[int, Any], failures: dict[int, Failure]
    ) -> dict[int, Any]:
        """A pool round's replies; with env failures, raise the first worker's error
        (:class:`EnvError`) and keep the rest, replies and failures, for the next calls."""
        if not failures:
            return results
        self._kept.update(results)
        self.ledger.count_env_errors(failures.values())
        ordered = sorted(failures.items())
        self._kept_failures.extend(ordered[1:])
        w, failure = ordered[0]
        raise remote_env_error(failure.errors[0], w, "")

    @abc.abstractmethod
    def _raise_crashed_worker(self, done: Any, step: int, note: str) -> None:
        """Shut down and raise :class:`EnvCrashedError` for the first dead worker of ``done``."""

    _late_noun = "workers"  # how a timeout names the late workers

    def _guarded(self, call: Callable[..., _T], *args: Any) -> _T:
        """``call(*args)``; shut down if it ends with anything but an envfleet error.

        Interrupted (Ctrl-C) or broken between sending commands to workers and reading their
        replies, a later call could read a stale reply, so the backend shuts down instead.
        """
        try:
            return call(*args)
        except EnvfleetError:
            raise
        except BaseException:
            self.close(timeout=0, terminate=True)
            raise

    def _raise_timeout(self, late: list[int], timeout: float, note: str = "") -> None:
        """Shut down and raise :class:`StepTimeoutError` for the late workers."""
        envs = [e for w in late for e in range(*self.ranges[w])]
        self.close(timeout=0, terminate=True)
        raise StepTimeoutError(
            f"{self._late_noun} {late} (sub-environments {envs}) did not answer within "
            f"{timeout} s; {note + '; ' if note else ''}they were killed and the vector env closed",
            envs,
            timeout,
        )

    @abc.abstractmethod
    def _replace_workers(
        self, workers: list[int], done: Any, timeout: float | None, step: int
    ) -> None:
        """Kill ``workers`` and start new ones with their envs, ready to serve (shut down and
        raise if one cannot start)."""

    @abc.abstractmethod
    def _run_restarts(self, requests: dict[int, Any], timeout: float | None, step: int) -> Any:
        """Send ``Command.RESTART`` with ``requests`` and wait for every reply (a round)."""

    def settle(self, done: Any, timeout: float | None, step: int) -> dict[int, Any]:
        """Rebuild what failed in ``done`` when the restart policy allows it, else raise.

        Env errors leave the backend usable; a dead or hung worker shuts it down unless it is
        replaced. Returns every worker's result, the rebuilt envs' included.
        """
        ledger = self.ledger
        ledger.count_env_errors(done.failures.values())
        failed_envs = {w: [e.env_index for e in f.errors] for w, f in sorted(done.failures.items())}
        respawn = sorted([*done.crashed, *done.late])
        note = ledger.refusal(
            self._command,
            all(f.partial for f in done.failures.values()),
            len(respawn) + sum(map(len, failed_envs.values())),
        )
        if note is not None:
            if done.crashed:
                self._raise_crashed_worker(done, step, note)
            if done.late:
                self._raise_timeout(done.late, cast(float, timeout), note)
            w = min(done.failures)
            raise remote_env_error(done.failures[w].errors[0], w, note)
        ledger.crashes += len(done.crashed)
        for f in done.failures.values():
            for error in f.errors:
                log_env_restart(error.env_index, error.method, error.type_name, error.message)
        if respawn:
            self._replace_workers(respawn, done, timeout, step)
            for w in respawn:
                failed_envs[w] = list(range(*self.ranges[w]))
        requests = {
            w: ledger.restart_request(self.ranges[w][0], envs, self._command, w not in respawn)
            for w, envs in failed_envs.items()
        }
        command = self._command
        restarted = self._run_restarts(requests, timeout, step)
        self._command = command
        if restarted.failures:
            w = min(restarted.failures)
            exc = remote_env_error(restarted.failures[w].errors[0], w, "")
            self.close(timeout=0, terminate=True)
            raise exc
        results = done.results
        for w, envs in failed_envs.items():
            if w in respawn:
                ledger.restarted(envs)
            else:
                for e in envs:
                    ledger.restarted([e])
            failure = done.failures.get(w)
            events = None if failure is None else failure.events
            results[w] = merge_events(events, restarted.results.get(w))
        return results
