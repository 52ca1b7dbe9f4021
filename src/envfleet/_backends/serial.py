"""``backend="serial"``: the EnvGroups run in the calling process, one after the other, each
when the round driver sends it its command (:class:`InProcessTransport` as it is)."""

from __future__ import annotations

from envfleet._backends.inprocess import InProcessTransport
from envfleet._backends.registry import BackendSpec, BuildRequest, register
from envfleet._backends.rounds import RoundDriver

__all__ = ["SerialTransport"]


class SerialTransport(InProcessTransport):
    """Runs each worker's EnvGroup in the driver, in worker order, when sent its command."""


def _build(request: BuildRequest) -> RoundDriver:
    return RoundDriver(
        SerialTransport(
            request.layout,
            request.block(shared=False),
            first_env=request.first_env,
            ledger=request.ledger,
            pool=request.pool,
        )
    )


register(BackendSpec("serial", build=_build))
