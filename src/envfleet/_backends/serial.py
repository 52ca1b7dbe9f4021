"""``backend="serial"``: the EnvGroups run in the calling process, one after the other."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from envfleet._backends.inprocess import InProcessBackend
from envfleet._core.envgroup import EnvFailure
from envfleet._core.protocol import Command

__all__ = ["SerialBackend"]


class SerialBackend(InProcessBackend):
    """Runs each worker's EnvGroup in the driver, in worker order, when submitted."""

    _results: dict[int, Any] = {}  # noqa: RUF012  (replaced per instance)
    _failures: dict[int, EnvFailure] = {}  # noqa: RUF012

    def submit(self, command: Command, payloads: Mapping[int, Any], step: int) -> None:
        self.supervisor.sent(payloads, command)  # a pool's envs fail and restart after it
        self._run(command, payloads)

    def round(
        self, command: Command, payloads: Mapping[int, Any], timeout: float | None, step: int
    ) -> dict[int, Any]:
        # Synchronous: settled with this very command, so there is no send to note.
        self._run(command, payloads)
        return self.collect(timeout, step)

    def _run(self, command: Command, payloads: Mapping[int, Any]) -> None:
        # Added to the results not yet collected: a first-ready pool submits several times.
        self._results, self._failures = dict(self._results), dict(self._failures)
        self._command = command
        for w in sorted(payloads):
            try:
                self._results[w] = self.run_group(w, command, payloads[w])
            except EnvFailure as failure:
                self._failures[w] = failure

    def inline_groups(self, command: Command) -> frozenset[int]:
        return frozenset(range(len(self.ranges)))

    def collect(self, timeout: float | None, step: int) -> dict[int, Any]:
        results, failures = self._results, self._failures
        self._results, self._failures = {}, {}
        return self.settle(results, failures, step)

    def collect_ready(self, timeout: float | None, step: int) -> dict[int, Any]:
        results, failures = self._results, self._failures
        self._results, self._failures = {}, {}
        return self.ready_results(results, failures, step)

    def close(self, timeout: float | None, terminate: bool) -> None:
        self._close_groups()


# -- registration (envfleet._backends.registry) ----------------------------------------------

from envfleet._backends.registry import BackendSpec, BuildRequest, register  # noqa: E402


def _build(request: BuildRequest) -> SerialBackend:
    return SerialBackend(
        request.layout,
        request.block(shared=False),
        first_env=request.first_env,
        ledger=request.ledger,
    )


register(BackendSpec("serial", build=_build))
