"""``backend="serial"``: the EnvGroups run in the calling process, one after the other."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import gymnasium

from envfleet.backends.base import Backend, WorkerLayout, failure_error, mismatch_error
from envfleet.buffers import Block, allocate_batch
from envfleet.envgroup import EnvFailure, EnvGroup
from envfleet.protocol import Command

__all__ = ["SerialBackend"]


class SerialBackend(Backend):
    """Runs each worker's EnvGroup in the driver, in worker order, when submitted.

    Envs are created at construction (as gymnasium's SyncVectorEnv does) and their spaces are
    checked against ``layout``'s. ``first_env``, when given, is used as env 0 instead of
    building it again.
    """

    def __init__(
        self, layout: WorkerLayout, block: Block, first_env: gymnasium.Env[Any, Any] | None = None
    ):
        self.ranges = list(layout.ranges)
        self.batch = allocate_batch(
            layout.single_observation_space,
            layout.single_action_space,
            layout.num_envs,
            block,
        )
        self.groups: list[EnvGroup] = []
        try:
            for start, stop in self.ranges:
                group = EnvGroup(
                    layout.bound_fns(start, stop, first_env),
                    start,
                    self.batch,
                    layout.single_observation_space,
                    layout.single_action_space,
                    layout.autoreset_mode,
                )
                self.groups.append(group)
                mismatch = group.check_spaces()
                if mismatch is not None:
                    raise mismatch_error(mismatch)
        except EnvFailure as failure:
            self.close(None, False)
            raise failure_error(failure) from failure.__cause__
        except BaseException:
            self.close(None, False)
            raise
        self._results: dict[int, Any] = {}
        self._failure: EnvFailure | None = None

    def submit(self, command: Command, payloads: Mapping[int, Any], step: int) -> None:
        self._results = {}
        self._failure = None
        for w in sorted(payloads):
            try:
                self._results[w] = self.groups[w].run(command, payloads[w])
            except EnvFailure as failure:
                self._failure = self._failure or failure

    def collect(self, timeout: float | None, step: int) -> dict[int, Any]:
        results, failure = self._results, self._failure
        self._results, self._failure = {}, None
        if failure is not None:
            raise failure_error(failure) from failure.__cause__
        return results

    def close(self, timeout: float | None, terminate: bool) -> None:
        for group in self.groups:
            group.close()
        self.groups = []
