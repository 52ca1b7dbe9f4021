"""The supervisor (layer 6 in docs/architecture.md): what happens when a worker or an env fails.

One implementation for every transport (serial, threads, processes, ray) and mode (a
synchronous round, a first-ready pool's): the round driver
(:class:`envfleet._backends.rounds.RoundDriver`) reports to it in a :class:`Round` (what one
wait on the workers found: results, env failures, dead workers, late workers), and
:class:`Supervisor` decides. It keeps per worker the deadline bookkeeping of a pool (when each
worker was sent its command), applies the restart policy within its budget (rebuilding only
what failed, through the round driver: :class:`Supervised`; it never calls a transport), and
has the one "broken" path: shut the backend down and raise the typed error
(:class:`~envfleet.EnvCrashedError`, :class:`~envfleet.StepTimeoutError`,
:class:`~envfleet.EnvError`). :class:`Ledger` keeps the
counters and seeds; the step-time statistics live in :mod:`envfleet._core.stats`.
"""

from __future__ import annotations

import collections
import itertools
import logging
import numbers
import os
import pickle
import re
import sys
import tempfile
import time
import traceback
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, NoReturn, Protocol, TypeVar, cast

import numpy as np

from envfleet._core.envgroup import PartialFailure
from envfleet._core.errors import (
    ConfigError,
    EnvCrashedError,
    EnvError,
    EnvfleetError,
    EnvRestartedWarning,
    RemoteTraceback,
    StepTimeoutError,
)
from envfleet._core.failures import CLOSED
from envfleet._core.hangs import warn_at
from envfleet._core.protocol import Command, Failure, InfoEvent, RestartRequest
from envfleet._core.replay import replays_of
from envfleet._core.stacks import first_at
from envfleet._core.stats import FleetStats, StepTimeStats, WorkerMemory

logger = logging.getLogger("envfleet")

# The commands whose failures a policy restarts (a task: the Sampler's worker inference).
RESTARTABLE = (Command.STEP, Command.RESET, Command.TASK)
FAILURES_KEPT = 100  # the failures a restart policy survived that envs.stats.failures keeps
RESTARTED = "restarted by the restart policy"  # a survived crash's fate, in its message

_T = TypeVar("_T")

__all__ = [
    "CONNECTION_ERRORS",
    "DEFAULT_RESTART_POLICY",
    "RESTARTED",
    "Ledger",
    "Rebuild",
    "RestartPolicy",
    "Round",
    "Supervised",
    "Supervisor",
    "events_of",
    "failed_envs",
    "log_env_restart",
    "merge_events",
    "restart_seed",
    "save_replay",
    "timeout_error",
    "warn_restarted",
]


# What a restart policy restarts of the exceptions an env raises by default: a lost connection to
# an external simulator, as ML-Agents restarts a Unity env on its communication error.
CONNECTION_ERRORS: tuple[type[BaseException], ...] = (
    ConnectionError,
    BrokenPipeError,
    TimeoutError,
)


@dataclass(frozen=True)
class RestartPolicy:
    """Rebuild what failed instead of failing fast: ``make()``'s default is ``RestartPolicy()``.

    At most ``max_restarts`` restarts within any ``window_s`` seconds, for the whole vector
    env, as an Erlang/OTP supervisor's intensity and period (ML-Agents rate-limits its Unity
    restarts the same way): the failure that would exceed the budget fails fast with the typed
    error it would have raised without a policy. The default, 10 within 60 s, survives the rare
    fault a long run meets (a segfault, an OOM kill, a dropped simulator) and stops a crash
    loop (a fault that recurs every few seconds is a bug) within a minute.

    What is restarted, on ``step`` and ``reset``:

    - a worker that dies (segfault, ``os._exit``, SIGKILL, OOM kill, a lost Ray actor) or
      runs past ``step_timeout`` (it is killed): a new worker is started for its envs. On
      ``backend="processes"`` the worker marks which env it is inside before each call into
      env code: only that env is rebuilt and starts a new episode; its block-mates are brought
      back to where they were from their records and take the step again, so their data is
      what it would have been without the fault. Where the worker was stepping several envs
      at once (envs that wait, stepped concurrently) or in another backend, every env of the
      worker starts a new episode;
    - an env whose step or reset raises one of ``restart_on`` (by default a lost connection:
      ``ConnectionError``, ``BrokenPipeError``, ``TimeoutError``): only that env, rebuilt from
      its factory inside its worker. Any other exception raises as in gymnasium, restart
      policy or not: a restart would hide a bug and loop. ``restart_on=(Exception,)`` restarts
      every env exception, ``restart_on=()`` none.

    The failures of one round (a step, a reset, a pool's ``recv``) count one restart against
    the budget, however many envs and workers they rebuild: a remote simulator that drops the
    connections of all its 1,024 envs at once is one fault, not 1,024. Each rebuild warns
    :class:`envfleet.EnvRestartedWarning` once, naming the
    env, the cause, the faulting frame and the file its replay was saved to. Rebuilt envs keep
    their ``env_index`` and are reset with a seed derived from their last seed and their
    restart count (:func:`restart_seed`). On that step they return ``reward 0.0``,
    ``terminated False``, ``truncated True``, the new episode's first observation, and
    ``info["env_restarted"] = True`` (with gymnasium's ``info["_env_restarted"]`` mask). With
    ``AutoresetMode.SAME_STEP`` there is no ``final_obs`` for them (the episode's last
    observation died with the env). Every other env's data is exactly what it would have been
    without the fault.

    Errors in ``call``, ``get_attr``, ``set_attr`` and ``render`` are the caller's and are not
    restarted: they raise as without a policy.

    In a first-ready pool (``batch_size < num_envs``) the same holds for each worker's own
    command (``send`` steps, ``async_reset`` resets): the rebuilt envs come back from
    ``recv`` flagged as above while the other workers keep running. ``serial`` and ``threads``
    run every env in this process: a native crash there ends the process, whatever the
    policy, and a thread cannot be killed, so on ``threads`` a step past ``step_timeout``
    fails fast; only ``restart_on`` exceptions are restarted there.

    ``Supervision(restart_policy=None)`` is the opt-out: every failure fails fast with its typed
    error (:class:`envfleet.EnvCrashedError`, :class:`envfleet.StepTimeoutError`).

    Args:
        max_restarts: restarts allowed within any ``window_s`` seconds (>= 0; 0 never restarts).
        window_s: the window, in seconds (> 0).
        restart_on: the exception types an env may raise in ``step`` or ``reset`` that are
            restarted like a crash (a tuple of exception classes).

    Raises:
        ConfigError: a negative ``max_restarts``, a ``window_s`` that is not > 0, or a
            ``restart_on`` that is not a tuple of exception classes.

    Example::

        envs = envfleet.make("CartPole-v1", 8)  # RestartPolicy(): crashes restart
        strict = envfleet.make(  # fail fast
            "CartPole-v1", 8, supervision=envfleet.Supervision(restart_policy=None)
        )
        everything = envfleet.RestartPolicy(restart_on=(Exception,))
        lenient = envfleet.make(
            "CartPole-v1", 8, supervision=envfleet.Supervision(restart_policy=everything)
        )
    """

    max_restarts: int = 10
    window_s: float = 60.0
    restart_on: tuple[type[BaseException], ...] = CONNECTION_ERRORS

    def __post_init__(self) -> None:
        if (
            isinstance(self.max_restarts, bool)
            or not isinstance(self.max_restarts, numbers.Integral)
            or self.max_restarts < 0
        ):
            raise ConfigError(f"max_restarts must be an integer >= 0, got {self.max_restarts!r}")
        if not isinstance(self.window_s, numbers.Real) or not self.window_s > 0:
            raise ConfigError(f"window_s must be seconds > 0, got {self.window_s!r}")
        if not isinstance(self.restart_on, tuple) or not all(
            isinstance(t, type) and issubclass(t, BaseException) for t in self.restart_on
        ):
            raise ConfigError(
                f"restart_on must be a tuple of exception classes, got {self.restart_on!r}"
            )

    def restarts(self, exception: BaseException | None) -> bool:
        """Whether an env's ``exception`` (``None``: not known here) is restarted."""
        return exception is not None and isinstance(exception, self.restart_on)


DEFAULT_RESTART_POLICY = RestartPolicy()  # make()'s default (``restart_policy=None`` opts out)


def restart_seed(seed: int | None, restarts: int) -> int | None:
    """The seed a rebuilt env is reset with: ``None`` for an env never seeded, else a 32-bit
    seed drawn from ``numpy.random.SeedSequence(seed, spawn_key=(restarts,))``, so the same
    original seed and restart count always give the same seed, and each restart a new one."""
    if seed is None:
        return None
    state = np.random.SeedSequence(int(seed), spawn_key=(int(restarts),)).generate_state(1)
    return int(state[0])


class Ledger:
    """The driver's record of failures and restarts, and of each env's last seed."""

    def __init__(self, num_envs: int, policy: RestartPolicy | None):
        self.policy = policy
        self._restart_times: collections.deque[float] = collections.deque()  # the budget's
        self.seeds: list[int | None] = [None] * num_envs
        self.env_restarts = [0] * num_envs
        self.restarts = 0
        self.timeouts = 0
        self.crashes = 0
        self.env_errors = 0
        self.recycled = 0
        # A caller's own *_wait(timeout=) is running (the front sets it): a worker late for it
        # raises StepTimeoutError, as gymnasium's AsyncVectorEnv raises, whatever the policy;
        # the policy restarts workers past step_timeout.
        self.wait_bound = False
        # The vector env is closing (the front sets it): a failure while pending calls finish
        # is not restarted, the workers go anyway.
        self.closing = False
        # The last failures a restart policy survived, each the error it would have raised.
        self.failures: collections.deque[EnvfleetError] = collections.deque(maxlen=FAILURES_KEPT)

    def note_seeds(self, start: int, seeds: list[int | None], mask: Any) -> None:
        """Remember the seeds a reset gives envs ``start, start + 1, ...`` (``mask``: reset
        only where True; ``None``: all)."""
        for j, seed in enumerate(seeds):
            if seed is not None and (mask is None or mask[j]):
                self.seeds[start + j] = int(seed)

    def restarts_on(self, command: Command) -> bool:
        """Whether a failure of ``command`` is restarted under the policy (:data:`RESTARTABLE`)."""
        return self.policy is not None and not self.closing and command in RESTARTABLE

    def refusal(
        self,
        commands: Command | Iterable[Command],
        only_envs_failed: bool,
        count: int,
        exceptions: Iterable[BaseException | None] = (),
    ) -> str | None:
        """Grant ``count`` restarts after ``commands`` failed (``None``; the budget, at most
        ``max_restarts`` in a sliding window of ``window_s`` seconds, is spent), or refuse them,
        returning the note for the fail-fast error: empty when nothing is restarted at all, the
        budget's message when it is exhausted.

        ``commands``: the command, or each failed worker's (a first-ready pool's workers may
        run different ones). ``only_envs_failed``: every failure is an env's own, the rest of
        its group completed (else the group's state is unknown and it cannot be rebuilt in
        place). ``exceptions``: what each env that raised raised (``None`` where it did not
        travel); every one must be of the policy's ``restart_on``.
        """
        if isinstance(commands, Command):
            commands = (commands,)
        if not (only_envs_failed and all(self.restarts_on(c) for c in commands)):
            return ""
        policy = cast(RestartPolicy, self.policy)
        if not all(policy.restarts(exc) for exc in exceptions):
            return ""
        now, times = time.monotonic(), self._restart_times
        while times and now - times[0] > policy.window_s:
            times.popleft()
        if len(times) + count > policy.max_restarts:
            return (
                f"restart budget exhausted ({policy.max_restarts} restarts within "
                f"{policy.window_s:g} s)"
            )
        times.extend([now] * count)
        return None

    def restarted(self, env_indices: Any) -> None:
        """One restart (a worker's, or one env's) rebuilt ``env_indices``."""
        self.restarts += 1
        for e in env_indices:
            self.env_restarts[e] += 1

    def restart_request(
        self, start: int, env_indices: list[int], after: Command, rebuild: bool
    ) -> RestartRequest:
        """The request that rebuilds ``env_indices`` of a group starting at env ``start``,
        each seeded by :func:`restart_seed` for its next restart."""
        seeds = [restart_seed(self.seeds[e], self.env_restarts[e] + 1) for e in env_indices]
        return RestartRequest([e - start for e in env_indices], seeds, after, rebuild)

    def count_env_errors(self, failures: Iterable[Any]) -> None:
        """Count each env exception in ``failures`` once (``stats.env_errors``), whichever
        backend and mode reported it: an in-process group's ``EnvFailure`` (a
        ``PartialFailure`` holds one per env that raised) or a worker's ``protocol.Failure``
        (one ``RemoteError`` per env)."""
        for failure in failures:
            per_env = getattr(failure, "failures", None) or getattr(failure, "errors", None)
            self.env_errors += len(per_env) if per_env else 1

    def snapshot(
        self, workers: tuple[StepTimeStats, ...], memory: tuple[WorkerMemory, ...] = ()
    ) -> FleetStats:
        return FleetStats(
            restarts=self.restarts,
            env_restarts={e: n for e, n in enumerate(self.env_restarts) if n},
            timeouts=self.timeouts,
            crashes=self.crashes,
            env_errors=self.env_errors,
            workers=workers,
            recycled=self.recycled,
            memory=memory,
            failures=tuple(self.failures),
        )


def timeout_error(
    backend: Supervised,
    late: list[int],
    timeout: float | None,
    stacks: dict[int, str],
    fate: str,
) -> StepTimeoutError:
    """The :class:`StepTimeoutError` of ``late`` workers (their ``stacks``, the first one's
    replay; ``fate``: what became of them), built while they are still there to read."""
    envs = [e for w in late for e in range(*backend.ranges[w])]
    error = StepTimeoutError(
        f"{backend.late_what} {late} (sub-environments {envs}) did not answer within "
        f"{timeout} s{first_at(stacks, late)}; {fate}",
        envs,
        float(timeout if timeout is not None else 0.0),
        stacks,
    )
    recordings = backend.recordings(late[0]) if late else []
    error.replay = replays_of("hang", str(error), recordings, backend.factories, timeout)
    return error


def log_env_restart(failed: list[tuple[int, str, str, str]]) -> None:
    """One log line for a worker's envs that raised and are restarted (``failed``: each
    ``(env_index, method, type name, message)``): the first named, the others counted, so
    that a simulator lost by 512 envs of a worker is one line, not 512."""
    if not failed:
        return
    more = f" (and {len(failed) - 1} more of its worker's envs)" if len(failed) > 1 else ""
    logger.warning("sub-environment %d raised in %s (%s: %s)%s; restarting it", *failed[0], more)


_REPLAYS_SAVED = itertools.count()


def save_replay(error: EnvfleetError) -> str:
    """Save ``error``'s replay (``error.replay``) to a new file under the temporary folder's
    ``envfleet-replays``: what a restart's warning names; ``""`` where there is none or it
    could not be written (:func:`warn_restarted` says why)."""
    replay = getattr(error, "replay", None)
    if replay is None:
        return ""
    folder = os.path.join(tempfile.gettempdir(), "envfleet-replays")
    path = os.path.join(folder, f"{os.getpid()}-{next(_REPLAYS_SAVED)}.replay")
    try:
        os.makedirs(folder, exist_ok=True)
        replay.save(path)
    except Exception:
        logger.warning("could not save the replay of a restart to %s", path, exc_info=True)
        return ""
    return path


def warn_restarted(error: EnvfleetError, lost: list[int], block: list[int]) -> None:
    """Warn :class:`~envfleet.EnvRestartedWarning` that the restart policy survived ``error``:
    ``lost``, the envs that start a new episode, of ``block``, the envs of the worker (or
    the env) that failed; with the file its replay was saved to (:func:`save_replay`)."""
    path = save_replay(error)
    kept = [e for e in block if e not in lost]
    if len(lost) == 1:
        ends = f"sub-environment {lost[0]} starts a new episode"
        if kept:
            ends += f"; {kept} continue exactly"
    else:
        ends = f"sub-environments {lost} start a new episode"
    replay = (
        f"its replay: {path} (envfleet replay {path})"
        if path
        else "no replay was saved (replay_steps=0, or its record died with its worker)"
    )
    where = raised_at(error)
    at = f" (raised at {where})" if where else ""
    warn_at(
        EnvRestartedWarning(f"envfleet restarted after: {error}{at}. {ends}; {replay}"),
        sys._getframe(1),
    )


_FRAME_LINE = re.compile(r'^\s*File "([^"]+)", line (\d+), in (.+)$', re.MULTILINE)


def raised_at(error: BaseException) -> str:
    """``file:line in function`` of the innermost frame that raised an env's exception under
    ``error`` (an :class:`~envfleet.EnvError`): from its traceback here, or from the
    :class:`~envfleet.RemoteTraceback` a worker sent; ``""`` for other errors (a crash's
    message names its frame already)."""
    if not isinstance(error, EnvError):
        return ""
    cause = error.__cause__
    while cause is not None:
        if isinstance(cause, RemoteTraceback):
            frames = _FRAME_LINE.findall(cause.tb)
            if frames:
                path, line, function = frames[-1]
                return f"{path}:{line} in {function}"
            return ""
        if cause.__cause__ is None and cause.__traceback__ is not None:
            frame = traceback.extract_tb(cause.__traceback__)[-1]
            return f"{frame.filename}:{frame.lineno} in {frame.name}"
        cause = cause.__cause__
    return ""


def merge_events(*lists: list[InfoEvent] | None) -> list[InfoEvent] | None:
    """Info events of one group from several lists, in env order (``None`` when none)."""
    events = [event for events in lists for event in events or ()]
    return sorted(events, key=lambda event: event[0]) or None


# -- after a round: the one implementation of every backend's supervision ----------------------


class Round:
    """What one wait on the workers found (a plain class: one is made per round).

    Attributes:
        results: worker -> its reply (what travels back to the front).
        failures: worker -> its failure: a ``protocol.Failure`` from a worker elsewhere, an
            ``EnvFailure`` (a ``PartialFailure`` for some envs) from a group in this process.
        crashed: worker -> why it died (Ray's reason; empty where the exit code says it),
            in the order found.
        late: workers past their timeout, in worker order.
    """

    __slots__ = ("crashed", "failures", "late", "results")

    def __init__(self) -> None:
        self.results: dict[int, Any] = {}
        self.failures: dict[int, Any] = {}
        self.crashed: dict[int, str] = {}
        self.late: list[int] = []

    @property
    def failed(self) -> bool:
        return bool(self.failures or self.crashed or self.late)


def failed_envs(failure: Any) -> list[tuple[int, str, str, str]]:
    """``(env index, method, type name, message)`` of each env that failed in ``failure``
    (a ``protocol.Failure`` or an ``EnvFailure``, see :class:`Round`)."""
    if isinstance(failure, Failure):
        return [(e.env_index, e.method, e.type_name, e.message) for e in failure.errors]
    per_env = failure.failures if isinstance(failure, PartialFailure) else [failure]
    return [(f.env_index, f.method, type(f.__cause__).__name__, str(f.__cause__)) for f in per_env]


def env_exceptions(failure: Any) -> list[BaseException | None]:
    """What each env that failed in ``failure`` (see :func:`failed_envs`) raised: its exception,
    unpickled from a worker's reply, or ``None`` where it did not pickle."""
    if isinstance(failure, Failure):
        return [_unpickled(e.exception) for e in failure.errors]
    per_env = failure.failures if isinstance(failure, PartialFailure) else [failure]
    return [f.__cause__ for f in per_env]


def _unpickled(blob: bytes | None) -> BaseException | None:
    if blob is None:
        return None
    try:
        exc = pickle.loads(blob)
    except Exception:
        return None
    return exc if isinstance(exc, BaseException) else None


def _only_envs_failed(failure: Any) -> bool:
    """Whether only some envs of the group failed, the others completed (see Ledger.refusal)."""
    return failure.partial if isinstance(failure, Failure) else isinstance(failure, PartialFailure)


def events_of(failure: Any) -> list[InfoEvent] | None:
    """The infos of the envs that completed beside the failed ones."""
    return failure.events if isinstance(failure, (Failure, PartialFailure)) else None


@dataclass(slots=True)
class Rebuild:
    """What :meth:`Supervisor.decide` answers for a round whose failures the restart policy
    covers: the round driver rebuilds them (``WorkerReplacement.settle``).

    Attributes:
        failed: worker -> the envs (global indices) that raised, to restart.
        respawn: the dead and late workers, to replace, in order.
        after: worker -> the command its envs restart after.
    """

    failed: dict[int, list[int]]
    respawn: list[int]
    after: dict[int, Command]


class Supervised(Protocol):
    """What the round driver lends its :class:`Supervisor`: the read-outs its errors are built
    from, and ``close`` for the broken path. The supervisor calls nothing else: what it
    decides to rebuild it answers (:class:`Rebuild`), and the round driver does it.

    Attributes:
        ranges: ``[start, stop)`` of envs per worker.
        ledger: the counters and seeds (shared with the front).
        late_what: how a timeout names the late workers (``"workers"``, ``"threads"``).
        late_fate: what became of them (``"they were killed"``).
    """

    ranges: Any
    ledger: Ledger
    late_what: str
    late_fate: str

    def close(self, timeout: float | None, terminate: bool) -> None:
        """Shut down: every worker, process and buffer."""

    def env_error(self, w: int, failure: Any, note: str) -> EnvError:
        """The typed error of worker ``w``'s first failed env (``note``: why not restarted),
        its exception chained as ``__cause__``."""
        ...

    def crash_error(
        self, w: int, step: int, note: str, reason: str, starting: bool, fate: str = CLOSED
    ) -> EnvCrashedError:
        """The typed error of worker ``w``, found dead after ``step`` steps (or while
        ``starting``); ``reason``: what :class:`Round` noted."""
        ...

    def stacks(self, workers: list[int]) -> dict[int, str]:
        """Each hung worker's stacks (:mod:`envfleet._core.stacks`), where they can be taken."""
        ...

    factories: Any  # env index -> its zero-argument factory (for a replay), or None

    def recordings(self, w: int) -> list[Any]:
        """Worker ``w``'s envs' episodes so far (:class:`~envfleet._core.replay.EnvRecording`),
        where its record outlives it."""
        ...

    def first_crashed(self, crashed: dict[int, str]) -> int:
        """Of the dead workers ``crashed``, the one a crash error names."""
        ...


class Supervisor:
    """Every backend's decisions after a round with failures, in one place.

    - **Deadlines** of a first-ready pool: when each worker was sent its command
      (:meth:`sent`), the first deadline to wait for (:meth:`deadline`), who is past it
      (:meth:`late`).
    - **The one broken path**: :meth:`crashed`, :meth:`timed_out`, :meth:`broken` shut the
      backend down and raise the typed error; :meth:`guarded` does so for anything but an
      envfleet error (an interrupt between sending and reading could leave a stale reply).
    - **After a round** (:meth:`decide`): raise, or answer what to rebuild within the
      restart policy's budget (:class:`Rebuild`, which the round driver carries out: the
      supervisor calls no rebuilding itself). Env errors leave the backend usable; a dead or
      hung worker shuts it down unless it is replaced.
    - **A pool's kept results**: a pool reports one env error per call; what a round read
      beside it waits here for the next calls, so nothing finished is lost.
    """

    def __init__(self, backend: Supervised):
        # A proxy: the backend holds its supervisor, and a reference cycle would keep its
        # processes, pipes and buffers until the garbage collector runs.
        self.backend: Supervised = cast(Supervised, weakref.proxy(backend))
        self.ledger = backend.ledger
        self.sent_at: dict[int, float] = {}  # a pool's: worker -> when it was sent a command
        self.commands: dict[int, Command] = {}  # a pool's: worker -> the command it runs
        self._kept: dict[int, Any] = {}
        self._kept_failures: dict[int, Any] = {}
        self._unsettled: Round | None = None  # keep_round's

    # -- deadlines --------------------------------------------------------------------------

    def sent(self, workers: Iterable[int], command: Command) -> None:
        """Note that ``workers`` were sent ``command`` now."""
        now = time.monotonic()
        for w in workers:
            self.sent_at[w] = now
            self.commands[w] = command

    def deadline(self, workers: Iterable[int], timeout: float | None) -> float | None:
        """The first of ``workers``' deadlines (``time.monotonic()`` seconds), each ``timeout``
        seconds from its own send; ``None`` without a timeout or a worker."""
        if timeout is None:
            return None
        sent = [self.sent_at[w] for w in workers]
        return min(sent) + timeout if sent else None

    def late(self, workers: Iterable[int], timeout: float | None) -> list[int]:
        """The workers of ``workers`` past ``timeout`` seconds since their send, in order."""
        if timeout is None:
            return []
        now = time.monotonic()
        return sorted(w for w in workers if now >= self.sent_at[w] + timeout)

    # -- the one broken path ------------------------------------------------------------------

    def guarded(self, call: Callable[..., _T], *args: Any) -> _T:
        """``call(*args)``; shut down if it ends with anything but an envfleet error.

        Broken between sending commands to workers and reading their replies, a later call
        could read a stale reply, so the backend shuts down instead. A Ctrl-C in a round's
        wait does not reach here: the round driver completes the round first (see
        :mod:`envfleet._backends.rounds`); one that does (a second Ctrl-C, one while a
        reply is read) shuts down.
        """
        try:
            return call(*args)
        except BaseException as exc:
            self.abandon(exc)
            raise

    def abandon(self, exc: BaseException) -> None:
        """The guard's rule, for :meth:`guarded` and the round that guards itself
        (``RoundDriver._fast_round``): ``exc`` ending a call shuts the backend down unless it
        is an envfleet error (which left the backend as it should be)."""
        if not isinstance(exc, EnvfleetError):
            self.backend.close(timeout=0, terminate=True)

    def broken(self, error: EnvfleetError) -> NoReturn:
        """Shut the backend down and raise ``error``."""
        self.backend.close(timeout=0, terminate=True)
        raise error

    def crashed(
        self, w: int, step: int, note: str = "", reason: str = "", starting: bool = False
    ) -> NoReturn:
        """Count worker ``w``'s death, shut down and raise :class:`EnvCrashedError`."""
        self.ledger.crashes += 1
        self.broken(self.backend.crash_error(w, step, note, reason, starting))

    def ran_late_here(self, late: Iterable[int], timeout: float, elapsed: float) -> NoReturn:
        """A wait whose ``late`` groups ran in the calling thread took ``elapsed`` seconds,
        past its ``timeout``: they could not be interrupted, so it is known once they are done.
        Count the timeout, shut down and raise :class:`StepTimeoutError` (the results are
        dropped, as after any timeout)."""
        self.ledger.timeouts += 1
        envs = [e for w in sorted(late) for e in range(*self.backend.ranges[w])]
        self.broken(
            StepTimeoutError(
                f"the call did not finish within {timeout} s (it took {elapsed:.3f} s); "
                f"sub-environments {envs} run in the calling thread and cannot be interrupted, "
                "so it is reported once they are done; the vector env is closed",
                envs,
                float(timeout),
            )
        )

    def timed_out(
        self, late: list[int], timeout: float | None, note: str = "", counted: bool = False
    ) -> NoReturn:
        """Count the timeout (unless ``counted``), shut down (the late workers are killed or,
        threads, left behind) and raise :class:`StepTimeoutError`."""
        backend = self.backend
        if not counted:
            self.ledger.timeouts += 1
        stacks = backend.stacks(late)  # before they are killed
        fate = f"{note + '; ' if note else ''}{backend.late_fate} and the vector env closed"
        error = timeout_error(backend, late, timeout, stacks, fate)
        backend.close(timeout=0, terminate=True)
        raise error from None

    # -- after a round ------------------------------------------------------------------------

    def decide(
        self,
        done: Round,
        timeout: float | None,
        step: int,
        command: Command | None,
        pool: bool = False,
    ) -> Rebuild | None:
        """What to do about the failures in ``done``: ``None`` when there are none; else count
        them and raise when the restart policy does not cover them (the one broken path for
        a dead or late worker; an env error leaves the backend usable), or answer the
        :class:`Rebuild` it allows, for the round driver to carry out.

        ``command``: what every worker ran; ``None``: each its own (:meth:`sent`, a pool).
        ``pool``: when env errors are not restarted, keep the round's other results and
        failures for the next calls (:meth:`take_kept`).

        Raises:
            EnvError: an env raised and is not restarted (the backend stays usable).
            EnvCrashedError, StepTimeoutError: a worker died or ran late and is not
                restarted; the backend is shut down.
        """
        backend, ledger = self.backend, self.ledger
        if not done.failed:
            return None
        ledger.count_env_errors(done.failures.values())
        if done.late:
            ledger.timeouts += 1
        failed = {w: [e[0] for e in failed_envs(f)] for w, f in sorted(done.failures.items())}
        respawn = sorted([*done.crashed, *done.late])
        after = {
            w: command if command is not None else self.commands[w] for w in [*failed, *respawn]
        }
        note = ledger.refusal(
            after.values(),
            all(_only_envs_failed(f) for f in done.failures.values()),
            1,  # one round's failures are one restart: a simulator lost by 1,024 envs is one
            [exc for f in done.failures.values() for exc in env_exceptions(f)],
        )
        if note is not None:
            if done.crashed:
                w = backend.first_crashed(done.crashed)
                self.crashed(w, step, note, reason=done.crashed[w])
            if done.late:
                self.timed_out(done.late, timeout, note, counted=True)
            w = min(done.failures)
            if pool:
                self._kept.update(done.results)
                self._kept_failures.update((v, f) for v, f in done.failures.items() if v != w)
            raise backend.env_error(w, done.failures[w], note)
        return Rebuild(failed, respawn, after)

    def keep(self, results: dict[int, Any]) -> None:
        """Keep ``results`` (worker -> result) for the next calls: a round completed after a
        Ctrl-C, whose call raised the interrupt instead of returning them."""
        self._kept.update(results)

    def keep_round(self, done: Round) -> None:
        """Keep ``done`` for the next call to settle (:meth:`take_unsettled`): the replies a
        first-ready pool's wait had taken when a Ctrl-C undid it (read after the interrupt)."""
        self._unsettled = done

    def take_unsettled(self) -> Round | None:
        """The round :meth:`keep_round` kept (forgotten here), ``None`` if none."""
        done, self._unsettled = self._unsettled, None
        return done

    def has_kept(self) -> bool:
        """Whether earlier pool rounds kept results, errors or a round for the next calls."""
        return bool(self._kept or self._kept_failures or self._unsettled is not None)

    def take_kept(self) -> dict[int, Any]:
        """Raise the next kept env error (:class:`EnvError`, in worker order), else return the
        kept results (worker -> result) and forget them."""
        if self._kept_failures:
            w = min(self._kept_failures)
            raise self.backend.env_error(w, self._kept_failures.pop(w), "")
        kept, self._kept = self._kept, {}
        return kept

    def drop_kept(self) -> None:
        """Forget what :meth:`keep`, :meth:`decide` and :meth:`keep_round` kept."""
        self._kept, self._kept_failures, self._unsettled = {}, {}, None
