"""A toy transport, ``backend="toy"``: the round driver's primitives and nothing else.

Each worker's EnvGroup lives in this process; a command sent to it is kept and runs when the
driver reads the reply. Everything else (the synchronous round, the first-ready pool, calls,
tasks, restarts, the supervisor's decisions) is :class:`envfleet._backends.rounds.RoundDriver`'s:
this module holds no loop over pending workers. The contract suite runs on it as on ``serial``
(tests/contract/conftest.py), which shows that a transport needs only these primitives.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from envfleet._backends.base import run_command
from envfleet._backends.registry import BackendSpec, BuildRequest, register
from envfleet._backends.rounds import RoundDriver
from envfleet._backends.supervisor import Round
from envfleet._backends.transport import Seen
from envfleet._core.action_log import new_log
from envfleet._core.buffers import allocate_batch
from envfleet._core.envgroup import EnvFailure, EnvGroup
from envfleet._core.errors import EnvCrashedError, EnvError
from envfleet._core.failures import CLOSED, failure_error, mismatch_error
from envfleet._core.protocol import Command
from envfleet._core.stats import STATS_WORDS, StepTimer, StepTimeStats, step_time_table


class ToyTransport:
    """Groups in this process that run a command when its reply is read."""

    late_what, late_fate = "workers", "they were killed"
    replaceable = False  # a group never dies: what raised is rebuilt env by env
    full_round = None
    remote: list[int] = []  # noqa: RUF012  (built here: no READY to wait for)

    def __init__(self, request: BuildRequest):
        layout = request.layout
        self.ranges = list(layout.ranges)
        self.ledger, self.pool = request.ledger, request.pool
        self.batch = allocate_batch(
            layout.single_observation_space,
            layout.single_action_space,
            layout.num_envs,
            request.block(shared=False),
        )
        self._stats = np.zeros((len(self.ranges), STATS_WORDS))
        self._timers = [StepTimer(row) for row in self._stats]
        self._sent: dict[int, tuple[Command, Any]] = {}
        self.groups: list[EnvGroup] = []
        self.closed = False
        try:
            for start, stop in self.ranges:
                self.groups.append(
                    EnvGroup(
                        layout.bound_fns(start, stop),
                        start,
                        self.batch,
                        layout.single_observation_space,
                        layout.single_action_space,
                        layout.autoreset_mode,
                        first_env=request.first_env if start == 0 else None,
                        same_observation_space=layout.same_observation_space,
                        action_log=new_log(
                            layout.single_action_space, stop - start, layout.replay_steps
                        ),
                    )
                )
                mismatch = self.groups[-1].check_spaces()
                if mismatch is not None:
                    raise mismatch_error(mismatch)
        except EnvFailure as failure:
            self.close(None, True, ())
            raise failure_error(failure) from failure.__cause__
        except BaseException:
            self.close(None, True, ())
            raise

    @property
    def num_workers(self) -> int:
        return len(self.ranges)

    def inline(self, command: Command) -> frozenset[int]:
        return frozenset()

    def send(self, w: int, command: Command, payload: Any) -> bool:
        self._sent[w] = (command, payload)
        return True

    def wait(
        self, workers: list[int], deadline: float | None, first: bool, spun_s: float | None = None
    ) -> Seen:
        return Seen(list(workers))  # every reply is ready: it is computed when read

    def read(self, w: int, done: Round) -> None:
        command, payload = self._sent.pop(w)
        try:
            done.results[w] = run_command(self.groups[w], command, payload, self._timers[w])
        except EnvFailure as failure:
            done.failures[w] = failure

    def respawn(self, w: int, reason: str) -> None:
        raise AssertionError("a toy group never dies")

    def lay_out(self, workers: list[int], probe: Any) -> bool:
        return False

    def env_error(self, w: int, failure: Any, note: str) -> EnvError:
        error = failure_error(failure, note)
        error.__cause__ = failure.__cause__
        return error

    def crash_error(
        self, w: int, step: int, note: str, reason: str, starting: bool, fate: str = CLOSED
    ) -> EnvCrashedError:
        raise AssertionError("a toy group never dies")

    def step_times(self) -> tuple[StepTimeStats, ...]:
        return step_time_table(self._stats)

    def disown(self) -> None:
        pass

    def close(self, timeout: float | None, terminate: bool, busy: Sequence[int]) -> None:
        self.closed = True
        self._sent = {}
        for group in self.groups:
            group.close()
        self.groups = []


register(BackendSpec("toy", build=lambda request: RoundDriver(ToyTransport(request))))
