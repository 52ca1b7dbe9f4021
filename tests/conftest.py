"""Fixtures shared by the envfleet tests."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import envfleet
import envfleet._native
from tests.helpers import Snapshot


@pytest.fixture
def make_env() -> Iterator[Callable[..., envfleet.FleetVectorEnv]]:
    """``envfleet.make`` whose vector envs are closed when the test ends, even when it fails."""
    created: list[envfleet.FleetVectorEnv] = []

    def make(*args: Any, **kwargs: Any) -> envfleet.FleetVectorEnv:
        if kwargs.get("backend") == "ray":
            ensure_ray()
        envs = envfleet.make(*args, **kwargs)
        created.append(envs)
        return envs

    yield make
    for envs in created:
        envs.close(terminate=True)


@pytest.fixture(params=["c", "python"])
def step_path(request: Any, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run the test with envfleet's C step path (``envfleet._native``), then without it: the
    Python twin of every C function. Set before the vector env is made; workers inherit it
    (``fork``) or read ``ENVFLEET_NO_SPEEDUPS`` when they import envfleet (spawn, forkserver)."""
    if request.param == "python":
        monkeypatch.setattr(envfleet._native, "speedups", None)
        monkeypatch.setenv("ENVFLEET_NO_SPEEDUPS", "1")
    elif envfleet._native.speedups is None:
        pytest.skip("envfleet._speedups is not built here (or ENVFLEET_NO_SPEEDUPS is set)")
    return str(request.param)


@pytest.fixture
def snapshot() -> Snapshot:
    """Child processes and /dev/shm entries before the test; call ``assert_nothing_left()``."""
    return Snapshot.take()


RAY_CPUS = 2  # logical CPUs of the tests' local Ray cluster (the development machine's cores)


def ensure_ray() -> None:
    """Start the tests' local Ray cluster, unless this process is connected to Ray already."""
    import ray

    if not ray.is_initialized():
        ray.init(num_cpus=RAY_CPUS, include_dashboard=False, log_to_driver=False)


@pytest.fixture
def ray_cluster() -> Any:
    """A real local Ray cluster (started once per test module); yields the ``ray`` module."""
    ensure_ray()
    import ray

    return ray


@pytest.fixture(scope="module", autouse=True)
def _shutdown_ray_after_module() -> Iterator[None]:
    """Shut down a Ray cluster a test module started, so that no Ray process outlives it
    (the leak checks of the other modules count every child process)."""
    yield
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()
