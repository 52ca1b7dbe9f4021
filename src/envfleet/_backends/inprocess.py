"""What the in-process backends (``serial``, ``threads``) share: EnvGroups built in the
driver, step-time statistics, and the mechanics of rebuilding envs that raised; the decisions
are the supervisor's (:class:`envfleet._backends.supervisor.Supervisor`, DESIGN §4)."""

from __future__ import annotations

import logging
from typing import Any

import gymnasium
import numpy as np

from envfleet._backends.base import (
    Backend,
    WorkerLayout,
    failure_error,
    mismatch_error,
    run_command,
)
from envfleet._backends.supervisor import Ledger, Round, Supervisor
from envfleet._core.buffers import Block, allocate_batch
from envfleet._core.envgroup import EnvFailure, EnvGroup
from envfleet._core.errors import EnvCrashedError, EnvError
from envfleet._core.protocol import Command, RestartRequest
from envfleet._core.stats import STATS_WORDS, StepTimer, StepTimeStats, step_time_table

__all__ = ["InProcessBackend"]

logger = logging.getLogger("envfleet")


class InProcessBackend(Backend):
    """EnvGroups in this process, one per block of ``layout.ranges``.

    Envs are created at construction (as gymnasium's SyncVectorEnv does) and their spaces are
    checked against ``layout``'s. ``first_env``, when given, is used as env 0 instead of
    building it again. Subclasses decide where each group runs (:meth:`run_group`).

    Raises:
        EnvError: a factory raised (``method == "make"``).
        SpaceMismatchError: an env's spaces differ from ``layout``'s.
    """

    def __init__(
        self,
        layout: WorkerLayout,
        block: Block,
        first_env: gymnasium.Env[Any, Any] | None = None,
        ledger: Ledger | None = None,
    ):
        self.ranges = list(layout.ranges)
        self._closed = False
        self.ledger = ledger if ledger is not None else Ledger(layout.num_envs, None)
        self._stats = np.zeros((len(self.ranges), STATS_WORDS))
        self._timers = [StepTimer(row) for row in self._stats]
        self._command = Command.STEP
        self.supervisor = Supervisor(self)
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
        )

    @property
    def closed(self) -> bool:
        return self._closed

    def step_times(self) -> tuple[StepTimeStats, ...]:
        return step_time_table(self._stats)

    def run_group(self, w: int, command: Command, payload: Any) -> Any:
        """Run ``command`` on group ``w`` here and now (timing its steps)."""
        return run_command(self.groups[w], command, payload, self._timers[w])

    def settle(
        self, results: dict[int, Any], failures: dict[int, EnvFailure], step: int
    ) -> dict[int, Any]:
        """The supervisor's decision on a synchronous round (:meth:`Supervisor.settle`).

        Raises:
            EnvError: the first failure, when not restarted (the backend stays usable), or a
                failure while rebuilding (the backend is closed).
        """
        if not failures:
            return results
        return self.supervisor.settle(self._round(results, failures), None, step, self._command)

    def ready_results(
        self, results: dict[int, Any], failures: dict[int, EnvFailure], step: int
    ) -> dict[int, Any]:
        """For a first-ready pool: ``results`` plus any kept from an earlier call, the envs
        that raised rebuilt under the restart policy; else one env error per call, the rest
        kept for the next calls (:meth:`Supervisor.ready`)."""
        return self.supervisor.ready(self._round(results, failures), None, step)

    @staticmethod
    def _round(results: dict[int, Any], failures: dict[int, EnvFailure]) -> Round:
        done = Round()
        done.results, done.failures = results, failures
        return done

    # -- the mechanics the supervisor uses (Supervised) ---------------------------------------

    def env_error(self, w: int, failure: Any, note: str) -> EnvError:
        exc = failure_error(failure, note)
        exc.__cause__ = failure.__cause__
        return exc

    def crash_error(
        self, w: int, step: int, note: str, reason: str, starting: bool
    ) -> EnvCrashedError:
        raise AssertionError("an in-process group cannot die on its own")

    def replace_workers(
        self, workers: list[int], done: Round, timeout: float | None, step: int
    ) -> None:
        raise AssertionError("an in-process group is rebuilt env by env, never replaced")

    def restart_envs(
        self, requests: dict[int, RestartRequest], timeout: float | None, step: int
    ) -> Round:
        """Rebuild the envs of each request in its group, here; stop at the first that
        fails (the group is half rebuilt: the supervisor gives up)."""
        done = Round()
        for w, request in requests.items():
            try:
                done.results[w] = self.groups[w].restart(request)
            except EnvFailure as failure:
                done.failures[w] = failure
                break
        return done

    def _close_groups(self) -> None:
        self._closed = True
        for group in self.groups:
            group.close()
        self.groups = []
