"""What the in-process transports (``serial``, ``threads``) share: EnvGroups built in the
driver, their step-time statistics, and the replies of the groups run here; the rounds are
the round driver's (:class:`envfleet._backends.rounds.RoundDriver`), the decisions the
supervisor's."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import gymnasium
import numpy as np

from envfleet._backends.base import WorkerLayout, run_command
from envfleet._backends.supervisor import Ledger, Round
from envfleet._backends.transport import FullRound, Seen
from envfleet._core.action_log import group_recordings, new_log
from envfleet._core.buffers import Block, allocate_batch
from envfleet._core.envgroup import EnvFailure, EnvGroup
from envfleet._core.errors import EnvCrashedError, EnvError
from envfleet._core.failures import CLOSED, failure_error, mismatch_error
from envfleet._core.protocol import Command
from envfleet._core.replay import EnvRecording
from envfleet._core.stats import STATS_WORDS, StepTimer, StepTimeStats, step_time_table

__all__ = ["InProcessTransport"]

logger = logging.getLogger("envfleet")


class InProcessTransport:
    """EnvGroups in this process, one per block of ``layout.ranges`` (a
    :class:`~envfleet._backends.transport.Transport`).

    Envs are created at construction (as gymnasium's SyncVectorEnv does) and their spaces are
    checked against ``layout``'s. ``first_env``, when given, is used as env 0 instead of
    building it again. A group sent a command here (:meth:`send`) runs it at once; a subclass
    may run groups elsewhere (:meth:`inline`, :meth:`wait`). A group never dies on its own and
    is never replaced: what raised is rebuilt env by env (``Command.RESTART``).

    Raises:
        EnvError: a factory raised (``method == "make"``).
        SpaceMismatchError: an env's spaces differ from ``layout``'s.
    """

    late_what = "workers"
    late_fate = "they were killed"
    replaceable = False
    full_round: FullRound | None = None
    remote: list[int] = []  # noqa: RUF012  (no worker starts apart: nothing to wait for)

    def __init__(
        self,
        layout: WorkerLayout,
        block: Block,
        first_env: gymnasium.Env[Any, Any] | None = None,
        ledger: Ledger | None = None,
        pool: bool = False,
    ):
        self.ranges = list(layout.ranges)
        self.pool = pool
        self._every_group = frozenset(range(len(self.ranges)))
        self._closed = False
        self.ledger = ledger if ledger is not None else Ledger(layout.num_envs, None)
        self._stats = np.zeros((len(self.ranges), STATS_WORDS))
        self._timers = [StepTimer(row) for row in self._stats]
        # Per group run here: (its result, its failure), until read.
        self._replies: dict[int, tuple[Any, EnvFailure | None]] = {}
        self.batch = allocate_batch(
            layout.single_observation_space,
            layout.single_action_space,
            layout.num_envs,
            block,
        )
        self.groups: list[EnvGroup] = []
        try:
            self._build_groups(layout, first_env)
            for group in self.groups:
                mismatch = group.check_spaces()
                if mismatch is not None:
                    raise mismatch_error(mismatch)
        except EnvFailure as failure:
            self._close_groups()
            raise failure_error(failure) from failure.__cause__
        except BaseException:
            self._close_groups()
            raise

    def _build_groups(
        self, layout: WorkerLayout, first_env: gymnasium.Env[Any, Any] | None
    ) -> None:
        """Build every group into ``self.groups``, in order, here (a subclass may build them
        elsewhere); raise what a factory raised (``EnvFailure``)."""
        for w in range(len(self.ranges)):
            self.groups.append(self._new_group(layout, w, first_env))

    def _new_group(
        self,
        layout: WorkerLayout,
        w: int,
        first_env: gymnasium.Env[Any, Any] | None,
        fns: list[Any] | None = None,
    ) -> EnvGroup:
        start, stop = self.ranges[w]
        return EnvGroup(
            layout.bound_fns(start, stop) if fns is None else fns,
            start,
            self.batch,
            layout.single_observation_space,
            layout.single_action_space,
            layout.autoreset_mode,
            first_env=first_env if start == 0 else None,
            same_observation_space=layout.same_observation_space,
            action_log=new_log(layout.single_action_space, stop - start, layout.replay_steps),
        )

    @property
    def num_workers(self) -> int:
        return len(self.ranges)

    @property
    def closed(self) -> bool:
        return self._closed

    def step_times(self) -> tuple[StepTimeStats, ...]:
        return step_time_table(self._stats)

    def run_group(self, w: int, command: Command, payload: Any) -> Any:
        """Run ``command`` on group ``w`` here and now (timing its steps)."""
        return run_command(self.groups[w], command, payload, self._timers[w])

    # -- Transport ------------------------------------------------------------------------------

    def inline(self, command: Command) -> frozenset[int]:
        return self._every_group

    def send(self, w: int, command: Command, payload: Any) -> bool:
        """Run ``command`` on group ``w`` here, to the end; its reply waits for :meth:`read`."""
        try:
            self._replies[w] = (self.run_group(w, command, payload), None)
        except EnvFailure as failure:
            self._replies[w] = (None, failure)
        return True

    def run_inline(
        self, command: Command, payloads: Mapping[int, Any]
    ) -> tuple[dict[int, Any], dict[int, EnvFailure]]:
        """:meth:`send` then :meth:`read` each group of ``payloads``, in one call (the round
        driver's round when every group runs here): the results and the failures."""
        results: dict[int, Any] = {}
        failures: dict[int, EnvFailure] = {}
        groups, timers = self.groups, self._timers
        for w, payload in payloads.items():
            try:  # run_group's call, without its frame (every serial step comes here)
                results[w] = run_command(groups[w], command, payload, timers[w])
            except EnvFailure as failure:
                failures[w] = failure
        return results, failures

    def wait(
        self, workers: list[int], deadline: float | None, first: bool, spun_s: float | None = None
    ) -> Seen:
        return Seen([w for w in workers if w in self._replies])

    def read(self, w: int, done: Round) -> None:
        result, failure = self._replies.pop(w)
        if failure is None:
            done.results[w] = result
        else:
            done.failures[w] = failure

    def recordings(self, w: int) -> list[EnvRecording]:
        """Each env of group ``w``'s episode so far (for a replay), none without a log."""
        return group_recordings(self.groups[w])

    def respawn(self, w: int, reason: str) -> None:
        raise AssertionError("an in-process group is rebuilt env by env, never replaced")

    def lay_out(self, workers: list[int], probe: Any) -> bool:
        return False

    def env_error(self, w: int, failure: Any, note: str) -> EnvError:
        exc = failure_error(failure, note)
        exc.__cause__ = failure.__cause__
        return exc

    def crash_error(
        self, w: int, step: int, note: str, reason: str, starting: bool, fate: str = CLOSED
    ) -> EnvCrashedError:
        raise AssertionError("an in-process group cannot die on its own")

    def disown(self) -> None:
        pass

    def close(self, timeout: float | None, terminate: bool, busy: Sequence[int]) -> None:
        self._close_groups()

    def _close_groups(self) -> None:
        self._closed = True
        self._replies = {}
        for group in self.groups:
            group.close()
        self.groups = []
