"""Fixtures shared by the envfleet tests."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

import envfleet
from tests.helpers import Snapshot


@pytest.fixture
def make_env() -> Iterator[Callable[..., envfleet.FleetVectorEnv]]:
    """``envfleet.make`` whose vector envs are closed when the test ends, even when it fails."""
    created: list[envfleet.FleetVectorEnv] = []

    def make(*args: Any, **kwargs: Any) -> envfleet.FleetVectorEnv:
        envs = envfleet.make(*args, **kwargs)
        created.append(envs)
        return envs

    yield make
    for envs in created:
        envs.close(terminate=True)


@pytest.fixture
def snapshot() -> Snapshot:
    """Child processes and /dev/shm entries before the test; call ``assert_nothing_left()``."""
    return Snapshot.take()
