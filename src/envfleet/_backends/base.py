"""What every backend implements, and the pieces they share."""

from __future__ import annotations

import abc
import contextlib
import functools
import inspect
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import gymnasium
from gymnasium.vector import AutoresetMode

from envfleet._backends.supervisor import Ledger
from envfleet._core.action_log import REPLAY_STEPS
from envfleet._core.buffers import Batch
from envfleet._core.envgroup import EnvFailure, EnvGroup, not_an_env_error
from envfleet._core.errors import (
    WrongProcessError,
)
from envfleet._core.protocol import Command
from envfleet._core.stats import StepTimer, StepTimeStats, WorkerMemory

__all__ = [
    "Backend",
    "EnvProbe",
    "NativeBackend",
    "Prebuilt",
    "WorkerLayout",
    "accepts_env_index",
    "bind_env_index",
    "build_group_envs",
    "native_of",
    "none_if_empty",
    "run_command",
    "worker_ranges",
]

EnvFn = Callable[..., gymnasium.Env[Any, Any]]


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
        replay_steps: the steps each env keeps for a replay (0: none; see
            :mod:`envfleet._core.action_log`).
    """

    env_fns: Sequence[EnvFn]
    accepts_index: Sequence[bool]
    single_observation_space: gymnasium.Space[Any]
    single_action_space: gymnasium.Space[Any]
    autoreset_mode: AutoresetMode
    ranges: Sequence[tuple[int, int]]
    same_observation_space: bool = True
    replay_steps: int = REPLAY_STEPS

    @property
    def num_envs(self) -> int:
        return len(self.env_fns)

    def bound_fns(self, start: int, stop: int) -> list[Callable[[], gymnasium.Env[Any, Any]]]:
        """Zero-argument factories of envs ``[start, stop)``, bound to their ``env_index``."""
        return [
            bind_env_index(self.env_fns[i], i, self.accepts_index[i]) for i in range(start, stop)
        ]


@dataclass(frozen=True)
class EnvProbe:
    """What env 0 tells of itself, for :func:`envfleet.make`: its spaces, ``metadata`` and
    ``render_mode``. Built in the driver (env 0 built there) or in the worker that holds env 0
    (a plan with no env in the driver: :attr:`envfleet._backends.registry.Plan.driver_free`),
    which sends it back pickled."""

    observation_space: gymnasium.Space[Any]
    action_space: gymnasium.Space[Any]
    metadata: dict[str, Any]
    render_mode: str | None

    @classmethod
    def of(cls, env: gymnasium.Env[Any, Any]) -> EnvProbe:
        return cls(env.observation_space, env.action_space, dict(env.metadata), env.render_mode)


def build_group_envs(
    fns: Sequence[Callable[[], gymnasium.Env[Any, Any]]], start: int
) -> list[gymnasium.Env[Any, Any]]:
    """Build envs ``start, start + 1, ...`` from their zero-argument factories, as
    :class:`EnvGroup` builds them, before the group's buffers exist (a worker that learns the
    spaces from its own envs); every env built is closed if one fails.

    Raises:
        EnvFailure: a factory raised (``method == "make"``, the exception as ``__cause__``).
        ConfigError: a factory returned no ``gymnasium.Env``.
    """
    envs: list[gymnasium.Env[Any, Any]] = []
    try:
        for j, fn in enumerate(fns):
            try:
                env = fn()
            except Exception as exc:
                raise EnvFailure(start + j, "make") from exc
            if not isinstance(env, gymnasium.Env):
                raise not_an_env_error(env, start + j)
            envs.append(env)
    except BaseException:
        for env in envs:
            with contextlib.suppress(Exception):
                env.close()
        raise
    return envs


class Prebuilt:
    """A zero-argument factory that hands out an env already built the first time it is
    called, then calls ``fn`` (an :class:`EnvGroup` keeps its factories to rebuild an env)."""

    def __init__(self, env: gymnasium.Env[Any, Any], fn: Callable[[], gymnasium.Env[Any, Any]]):
        self.env: gymnasium.Env[Any, Any] | None = env
        self.fn = fn

    def __call__(self) -> gymnasium.Env[Any, Any]:
        env, self.env = self.env, None
        return env if env is not None else self.fn()


def run_command(group: EnvGroup, command: Command, payload: Any, timer: StepTimer) -> Any:
    """Run ``command`` on ``group`` here and now, recording a step's duration in ``timer``.

    The one dispatch of commands to an EnvGroup for the backends that call it directly
    (``serial``, ``threads``, each ``ray`` actor). Returns what travels back to the front.

    Raises:
        EnvFailure: an env raised (:class:`PartialFailure` for some envs of a step or reset).
    """
    if command is Command.STEP:
        if payload is not None:  # actions not read from the buffer (EnvGroup.step)
            return timer.call(functools.partial(group.step, payload))
        return timer.call(group.step)
    return group.run(command, payload)


def none_if_empty(result: Any) -> Any:
    """What a worker replies for a command's ``result``: ``None`` for no events (an empty
    list or tuple), else the result as it is (a task may return an array, ``0``...)."""
    if isinstance(result, (list, tuple)) and not result:
        return None
    return result


class Backend(abc.ABC):
    """What the front calls: the rounds between the front and its EnvGroups.

    The front writes actions into ``batch.actions``, calls :meth:`submit` with one payload per
    worker that must act, then :meth:`collect` for their results, in worker order. Results
    carry only what does not live in ``batch`` (infos, call results).

    :class:`envfleet._backends.rounds.RoundDriver` implements it once for every transport
    (``serial``, ``threads``, ``processes``, ``ray``); ``envpool``'s native pool implements
    it over EnvPool's own C++ threads.
    """

    batch: Batch
    ranges: Sequence[tuple[int, int]]
    ledger: Ledger  # failures, restarts and seeds, for the supervisor and ``envs.stats``
    late_what = "workers"  # how a timeout names the late workers (Supervisor.timed_out)
    late_fate = "they were killed"  # what became of them
    # Per env index, its zero-argument factory (set by make()): what a replay rebuilds it from.
    factories: Sequence[Callable[[], gymnasium.Env[Any, Any]]] | None = None

    @property
    def num_workers(self) -> int:
        return len(self.ranges)

    def worker_memory(self) -> tuple[WorkerMemory, ...]:
        """Per worker process, its memory as sampled (``envs.stats.memory``); ``()`` where
        the backend has no worker processes of its own."""
        return ()

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

    def inline(self, command: Command) -> frozenset[int]:
        """The groups :meth:`submit` runs in the calling thread, to the end, for ``command``.

        No timeout can interrupt them; the front's asynchronous calls (``step_async`` and
        friends) submit them at the wait instead, so that ``*_async`` returns at once.
        """
        return frozenset()

    def finish(
        self,
        command: Command,
        inline: Mapping[int, Any],
        timeout: float | None,
        step: int,
        late_after: float | None = None,
    ) -> dict[int, Any]:
        """Finish an asynchronous call (``step_wait`` and friends): :meth:`submit` the groups
        that :meth:`inline` left for the wait (``inline``), which run here to the end,
        then :meth:`collect` with what is left of ``timeout`` (seconds).

        ``late_after``: the wait's own timeout (``*_wait(timeout=)``); the round driver,
        whose groups run here, raises :class:`StepTimeoutError` through its supervisor when
        the call took longer. A backend may override it with a shorter path; errors are those
        of the two calls.
        """
        started = time.monotonic()
        self.submit(command, inline, step)
        if timeout is not None:
            timeout = max(0.0, timeout - (time.monotonic() - started))
        return self.collect(timeout, step)

    def round(
        self, command: Command, payloads: Mapping[int, Any], timeout: float | None, step: int
    ) -> dict[int, Any]:
        """:meth:`submit` then :meth:`collect`, in one call (the synchronous ``step()``).

        A backend may override it with a shorter path; errors are those of the two calls.
        """
        self.submit(command, payloads, step)
        return self.collect(timeout, step)

    def step_round(self, timeout: float | None, step: int) -> dict[int, Any] | None:
        """A synchronous step of every group, its actions in ``batch.actions`` (the front's
        plain step): what ``round(STEP, every group's None, timeout, step)`` does, except that
        ``None`` may stand for results that carry nothing (every group stepped, no env had an
        info). A backend may override it with a shorter path (the round driver does).

        Raises: as :meth:`round`.
        """
        return self.round(Command.STEP, dict.fromkeys(range(len(self.ranges))), timeout, step)

    def collect_ready(self, timeout: float | None, step: int) -> dict[int, Any]:
        """First-ready pool: wait until at least one submitted worker is done and return the
        results of every worker done by then. Workers may be submitted to while others run.
        ``timeout``: seconds each worker may take from the :meth:`submit` that started it; a
        worker past it raises :class:`StepTimeoutError` even while others keep replying, and
        a dead worker raises :class:`EnvCrashedError` at the first call after its death.
        With a restart policy (``ledger.policy``) they, and envs that raise, are rebuilt
        within its budget instead, and their results returned, flagged
        (:meth:`envfleet._backends.supervisor.Supervisor.ready`).

        Raises: as :meth:`collect`.
        """
        return self.collect(timeout, step)

    def drop_kept(self) -> None:
        """Forget results and errors :meth:`collect_ready` kept for its next calls."""
        supervisor = getattr(self, "supervisor", None)
        if supervisor is not None:
            supervisor.drop_kept()

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


class NativeBackend(Backend):
    """A backend whose native library steps the whole batch itself (``envpool``): where
    :attr:`native` holds, the front hands its arrays through :meth:`native_step`,
    :meth:`native_send` and :meth:`native_recv` instead of rounds."""

    native: bool  # the library's own path runs (set by the backend when it is built)

    @abc.abstractmethod
    def native_step(self, actions: Any, copy: bool) -> tuple[Any, Any, Any, Any, dict[str, Any]]:
        """A synchronous step of every env in the native library."""

    @abc.abstractmethod
    def native_send(self, actions: Any, env_ids: Any) -> None:
        """A first-ready pool's send in the native library."""

    @abc.abstractmethod
    def native_recv(self, copy: bool) -> tuple[Any, Any, Any, Any, dict[str, Any]]:
        """A first-ready pool's recv in the native library."""


def native_of(backend: Backend) -> NativeBackend | None:
    """``backend`` where its native library's own path runs, else None."""
    return backend if isinstance(backend, NativeBackend) and backend.native else None
