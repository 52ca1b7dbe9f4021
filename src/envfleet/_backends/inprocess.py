"""What the in-process backends (``serial``, ``threads``) share: EnvGroups built in the
driver, step-time statistics, and the restart of envs that raised (DESIGN §4)."""

from __future__ import annotations

import logging
from typing import Any, cast

import gymnasium
import numpy as np

from envfleet._backends.base import (
    Backend,
    WorkerLayout,
    failure_error,
    mismatch_error,
    run_command,
)
from envfleet._buffers import Block, allocate_batch
from envfleet._envgroup import EnvFailure, EnvGroup, PartialFailure
from envfleet._protocol import Command
from envfleet._supervisor import (
    STATS_WORDS,
    Ledger,
    StepTimer,
    StepTimeStats,
    log_env_restart,
    merge_events,
    step_time_table,
)

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
        self._kept: dict[int, Any] = {}  # pool results held back by an error (ready_results)
        self._kept_failures: dict[int, EnvFailure] = {}
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

    def drop_kept(self) -> None:
        self._kept, self._kept_failures = {}, {}

    def run_group(self, w: int, command: Command, payload: Any) -> Any:
        """Run ``command`` on group ``w`` here and now (timing its steps)."""
        return run_command(self.groups[w], command, payload, self._timers[w])

    def settle(self, results: dict[int, Any], failures: dict[int, EnvFailure]) -> dict[int, Any]:
        """Rebuild the envs that raised when the restart policy allows it, else raise.

        Raises:
            EnvError: the first failure, when not restarted (the backend stays usable), or a
                failure while rebuilding (the backend is closed).
        """
        if not failures:
            return results
        ledger = self.ledger
        failed = {
            w: getattr(failure, "failures", [failure]) for w, failure in sorted(failures.items())
        }
        ledger.count_env_errors(failures.values())
        note = ledger.refusal(
            self._command,
            all(isinstance(failure, PartialFailure) for failure in failures.values()),
            sum(map(len, failed.values())),
        )
        if note is not None:
            first = failures[min(failures)]
            raise failure_error(first, note) from first.__cause__
        for w, envs in failed.items():
            for f in envs:
                cause = f.__cause__
                log_env_restart(f.env_index, f.method, type(cause).__name__, str(cause))
            indices = [f.env_index for f in envs]
            request = ledger.restart_request(self.ranges[w][0], indices, self._command, True)
            try:
                events = self.groups[w].restart(request)
            except EnvFailure as failure:
                self.close(None, True)  # the group is half rebuilt: give up, as processes do
                raise failure_error(failure) from failure.__cause__
            for e in indices:
                ledger.restarted([e])
            results[w] = merge_events(cast(PartialFailure, failures[w]).events, events)
        return results

    def ready_results(
        self, results: dict[int, Any], failures: dict[int, EnvFailure]
    ) -> dict[int, Any]:
        """For a first-ready pool: ``results`` plus any kept from an earlier call; when an env
        failed, keep them for the next call and raise the first failure."""
        self.ledger.count_env_errors(failures.values())
        results = {**self._kept, **results}
        failures = {**self._kept_failures, **failures}
        self._kept, self._kept_failures = {}, {}
        if failures:
            # One error per call; the rest waits for the next calls, so each is reported.
            self._kept = results
            w = min(failures)
            first = failures.pop(w)
            self._kept_failures = failures
            raise failure_error(first) from first.__cause__
        return results

    def _close_groups(self) -> None:
        self._closed = True
        for group in self.groups:
            group.close()
        self.groups = []
