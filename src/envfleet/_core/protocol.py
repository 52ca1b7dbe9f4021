"""Typed control messages between the front and the EnvGroups.

Control is tiny: a one-byte :class:`Command` and, off the hot path, a small pickled dataclass.
Data never travels here; it lives in the shared :class:`envfleet._core.buffers.Batch`.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

__all__ = [
    "CallRequest",
    "Command",
    "Failure",
    "InfoEvent",
    "SideValues",
    "RemoteError",
    "ResetRequest",
    "RestartRequest",
    "RoundOutcome",
    "SetAttrRequest",
    "Status",
]

# (global env index, that env's info dict), replayed in order through VectorEnv._add_info.
InfoEvent = tuple[int, dict[str, Any]]


class SideValues(dict[str, Any]):
    """One env's observation values at the leaves without a fixed size (Text, Graph, ...),
    which have no shared buffer: ``self["values"]``, in ``envfleet._core.buffers.side_leaves``
    order. They travel as the info of an extra :data:`InfoEvent` ``(env_index, SideValues(...))``
    with the reply of the command that wrote the observation (so restarts and merges carry them
    as infos); the front takes them out (``type(info) is SideValues``) before it batches infos.
    """


class RoundOutcome(NamedTuple):
    """What a full step round (the C round of ``_speedups.full_round``) left to the driver,
    which reads it by these names (``RoundDriver._finish_full_round``). A complete round
    (every remote reply taken, none to read, the driver's own block neither failed nor had
    an event) answers ``None`` instead.

    Attributes:
        driver_block_result: the driver's own block's events (its step's return), or ``None``
            (no block, or it failed).
        driver_block_failure: the ``EnvFailure`` the driver's own block raised, or ``None``.
        taken: the workers whose replies the round took, counted from the first of the
            transport's ``remote`` workers (all of them, or the first that were caught up
            when a spin ran out; 0 or all on the round bell).
        unread: the indexes (into ``remote``) of the taken workers whose reply is not
            "OK, no payload": the driver reads those.
        spun_s: seconds the round already spun and slept on the first worker it did not
            take (the driver's next wait on it counts them), or ``None``.
    """

    driver_block_result: Any
    driver_block_failure: Any
    taken: int
    unread: list[int]
    spun_s: float | None


class Command(enum.IntEnum):
    """What an EnvGroup is asked to do."""

    STEP = 1
    RESET = 2
    CALL = 3
    SET_ATTR = 4
    RENDER = 5
    CLOSE = 6
    RESTART = 7
    TASK = 8  # run a function with the whole group, in its worker (TaskRequest)


class Status(enum.IntEnum):
    """First byte of every reply from a worker."""

    READY = 1  # the worker built its envs and is waiting for commands
    OK = 2
    ERROR = 3


@dataclass
class ResetRequest:
    """Reset the group's envs; ``seeds`` and ``mask`` are local to the group (length K)."""

    seeds: list[int | None]
    options: dict[str, Any] | None
    mask: np.ndarray | None = None


@dataclass
class CallRequest:
    """``env.get_wrapper_attr(name)``, called with the arguments when callable (gymnasium).

    With ``function`` (a cloudpickled ``fn(env, *args, **kwargs)``), that function is called on
    each env instead, and ``name`` only names it in error reports.
    """

    name: str
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    function: bytes | None = None


@dataclass
class TaskRequest:
    """Call ``function(group, argument)`` once, in the worker that holds the group.

    ``function`` must pickle by reference (a module-level function) for the backends whose
    workers are other processes; ``argument`` is pickled with it. What it returns travels back
    to the front (pickled, for those backends). The Sampler's worker inference is such a task.
    """

    function: Callable[[Any, Any], Any]
    argument: Any = None


@dataclass
class SetAttrRequest:
    """``env.set_wrapper_attr(name, value)`` with one value per env of the group."""

    name: str
    values: list[Any]


@dataclass
class RemoteError:
    """An exception raised in a worker, as it travels back to the front.

    ``exception`` is the pickled exception when it pickles, else ``None`` (the front then
    rebuilds a ``RuntimeError`` from ``type_name`` and ``message``).
    """

    env_index: int
    method: str
    type_name: str
    message: str
    traceback: str
    exception: bytes | None
    recording: Any = None  # the env's episode so far (envfleet._core.replay.EnvRecording)


@dataclass
class RestartRequest:
    """Rebuild (``rebuild``) and reset the group's envs ``indices`` (local) with ``seeds``.

    ``after`` is the command that failed (``STEP`` or ``RESET``): after a step the envs also
    report ``truncated=True``. A freshly started worker is sent ``rebuild=False``: its envs
    are new already.
    """

    indices: list[int]
    seeds: list[int | None]
    after: Command
    rebuild: bool = True


@dataclass
class Failure:
    """The reply of a worker whose command failed (with ``Status.ERROR``).

    ``partial``: only the envs in ``errors`` failed, in a step or reset; the group's other envs
    completed (their infos are ``events``), so the failed ones can be rebuilt. Otherwise the
    whole command failed and ``errors`` holds one error.
    """

    errors: list[RemoteError]
    events: list[InfoEvent] | None = None
    partial: bool = False
