"""The Ray actor of ``backend="ray"``: one worker's EnvGroup over buffers of its block's rows.

:class:`EnvfleetWorker` builds the block's envs when Ray creates it (the actor of env 0 tells
env 0's spaces: the driver builds no env), lays them over buffers of the block's rows once the
driver sends the spaces (:meth:`~EnvfleetWorker.attach`) and runs one command at a time; every
method returns a :data:`Reply`. The driver's side is
:class:`envfleet._backends.ray.backend.RayTransport`; :data:`RemoteWorker` is the class as a Ray
actor.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from dataclasses import dataclass
from typing import Any, cast

import cloudpickle
import gymnasium
import numpy as np
import ray
from gymnasium.vector import AutoresetMode

from envfleet._backends.base import (
    EnvProbe,
    Prebuilt,
    bind_env_index,
    build_group_envs,
    none_if_empty,
    run_command,
)
from envfleet._backends.workers import die_with, remote_error, watch_stacks
from envfleet._core.action_log import REPLAY_STEPS, fd_log
from envfleet._core.buffers import Block, allocate_batch, batch_nbytes
from envfleet._core.envgroup import EnvFailure, EnvGroup, PartialFailure
from envfleet._core.protocol import Command, Failure, Status
from envfleet._core.stats import STATS_WORDS, STEPPING_WORDS, StepTimer
from envfleet._core.trees import tree_write

__all__ = ["ActorLayout", "ActorSpec", "EnvfleetWorker", "RemoteWorker", "Reply"]

_DATA_COMMANDS = (Command.STEP, Command.RESET, Command.RESTART)

# What every actor call returns: (status, payload, the group's rows or None, step seconds;
# a step's: (seconds, *the group's STEPPING_WORDS))).
Reply = tuple[Status, Any, Any, Any]


@dataclass
class ActorSpec:
    """What an actor receives at creation: its block of envs."""

    worker_index: int
    start: int
    stop: int
    env_fns: list[bytes]  # cloudpickled factories, one per env of the block
    accepts_index: list[bool]


@dataclass
class ActorLayout:
    """What an actor gets once env 0's spaces are known (:meth:`EnvfleetWorker.attach`)."""

    single_observation_space: gymnasium.Space[Any]
    single_action_space: gymnasium.Space[Any]
    autoreset_mode: AutoresetMode
    same_observation_space: bool = True
    replay_steps: int = REPLAY_STEPS


class _LastStepTimer(StepTimer):
    """A StepTimer over a private row that also keeps the last step's seconds (sent back)."""

    __slots__ = ("seconds",)

    def __init__(self) -> None:
        super().__init__(np.zeros(STATS_WORDS))
        self.seconds = 0.0

    def record(self, seconds: float) -> None:
        super().record(seconds)
        self.seconds = seconds


class EnvfleetWorker:
    """The Ray actor of one worker: an EnvGroup over buffers of the block's K rows.

    Every method returns ``(status, payload, rows, seconds)``: ``rows`` is ``None`` or the
    block's (observations, rewards ``float64[K]``, terminations ``bool[K]``, truncations
    ``bool[K]``); ``seconds`` the last step's duration.
    """

    def __init__(self, spec: ActorSpec):
        self.spec = spec
        # Its stacks at a hang (asked for by a signal) and at a fatal signal, into a file of
        # this node, nameless once open: the envfleet helper of this node opens it through
        # /proc/PID/fd (place, NodeHelper.adopt) and reads it for the driver, and nothing is
        # left on disk whatever becomes of either.
        fd, path = tempfile.mkstemp(prefix="envfleet-ray-stacks-", suffix=".txt")
        os.close(fd)
        self._stacks = watch_stacks(path)
        # Its envs' action log, in a nameless file of this node that the helper reads the
        # same way (a replay after a crash or a hang, the recycler's counters).
        self._log_fd, path = tempfile.mkstemp(prefix="envfleet-ray-log-")
        os.unlink(path)
        self.group: EnvGroup | None = None
        self.timer = _LastStepTimer()
        # What the group learned of its envs (they compute or wait; _core/stepping.py), sent
        # with every step's reply into the driver's statistics row of this actor.
        self._stepping_words = np.zeros(STEPPING_WORDS)
        self.batch: Any = None
        self.fns: list[Any] = []
        self.built: list[gymnasium.Env[Any, Any]] = []
        self.startup: tuple[Status, Any]
        try:
            self.fns = [
                bind_env_index(cloudpickle.loads(blob), spec.start + j, spec.accepts_index[j])
                for j, blob in enumerate(spec.env_fns)
            ]
            self.built = build_group_envs(self.fns, spec.start)
            # The driver builds no env: the actor of env 0 tells its spaces.
            probe = EnvProbe.of(self.built[0]) if spec.start == 0 else None
            self.startup = (Status.READY, probe)
        except Exception as exc:
            self.startup = (Status.ERROR, _start_failure(exc, spec.start))

    def ready(self) -> Reply:
        """Whether the envs were built: READY with env 0's :class:`EnvProbe` (the actor that
        holds env 0) or ``None``, or ERROR."""
        status, payload = self.startup
        return status, payload, None, 0.0

    def attach(self, layout: ActorLayout, helper_pid: int | None = None) -> Reply:
        """Lay the envs built over buffers of the block's rows, with env 0's spaces: READY
        with a space mismatch (``(env_index, description)``) or ``None``, or ERROR. From now
        on this actor dies with process ``helper_pid``, the envfleet helper of its node that
        holds its files (:func:`~envfleet._backends.workers.die_with`), if given."""
        spec = self.spec
        if helper_pid is not None:
            die_with(helper_pid)
        try:
            size = spec.stop - spec.start
            obs_space, act_space = layout.single_observation_space, layout.single_action_space
            block = Block(batch_nbytes(obs_space, act_space, size), shared=False)
            self.batch = allocate_batch(obs_space, act_space, size, block)
            fns = [Prebuilt(env, fn) for env, fn in zip(self.built, self.fns, strict=True)]
            self.group = EnvGroup(
                fns,
                spec.start,
                self.batch,
                obs_space,
                act_space,
                layout.autoreset_mode,
                batch_offset=spec.start,
                same_observation_space=layout.same_observation_space,
                action_log=fd_log(self._log_fd, act_space, size, layout.replay_steps),
            )
            self.built = []  # the group's now
            self.group.adapt_stepping(self._stepping_words)  # as a processes worker's group
            return Status.READY, self.group.check_spaces(), None, 0.0
        except Exception as exc:
            return Status.ERROR, _start_failure(exc, spec.start), None, 0.0

    def run(self, message: tuple[Command, Any, Any]) -> Reply:
        """Run ``(command, payload, actions)`` on the group; ``actions`` (the block's rows)
        come with a step. (One argument: Ray serializes each argument on its own.)"""
        command, payload, actions = message
        group = cast(EnvGroup, self.group)
        if actions is not None:
            tree_write(group.buffers.actions, actions)
        status = Status.OK
        try:
            result = run_command(group, command, payload, self.timer)
            if command in (Command.CALL, Command.RENDER, Command.TASK):
                cloudpickle.dumps(result)  # fails here, reported, rather than inside Ray
        except PartialFailure as failure:
            errors = [remote_error(f, f.env_index, f.method) for f in failure.failures]
            status, result = Status.ERROR, Failure(errors, failure.events or None, partial=True)
        except EnvFailure as failure:
            error = remote_error(failure, failure.env_index, failure.method)
            status, result = Status.ERROR, Failure([error])
        except Exception as exc:  # a bug outside any env, or a result that does not pickle
            what = (
                "pickling the result"
                if command in (Command.CALL, Command.RENDER, Command.TASK)
                else None
            )
            error = remote_error(exc, group.start, what or command.name.lower())
            status, result = Status.ERROR, Failure([error])
        rows = None
        if command in _DATA_COMMANDS:
            b = self.batch
            rows = (b.observations, b.rewards, b.terminations, b.truncations)
        if command is Command.STEP:
            return status, none_if_empty(result), rows, (self.timer.seconds, *self._stepping_words)
        return status, none_if_empty(result), rows, self.timer.seconds

    def where(self) -> tuple[str, int]:
        """(Ray node id, process id) of this actor."""
        return ray.get_runtime_context().get_node_id(), os.getpid()

    def place(self) -> tuple[str, int, int, int]:
        """(Ray node id, process id, descriptors of its stack file and of its action log):
        the envfleet helper of that node opens ``/proc/PID/fd/FD``
        (:meth:`envfleet._backends.ray.helper.NodeHelper.adopt`)."""
        node = ray.get_runtime_context().get_node_id()
        return node, os.getpid(), self._stacks.fileno(), self._log_fd

    def close(self) -> None:
        for env in self.built:  # built, but never laid out
            with contextlib.suppress(Exception):
                env.close()
        self.built = []
        if self.group is not None:
            self.group.close()
            self.group = None


def _start_failure(exc: Exception, start: int) -> Failure:
    """The reply's payload for an actor that could not build or lay out its envs."""
    if isinstance(exc, EnvFailure):
        return Failure([remote_error(exc, exc.env_index, exc.method)])
    return Failure([remote_error(exc, start, "make")])


RemoteWorker: Any = ray.remote(EnvfleetWorker)
