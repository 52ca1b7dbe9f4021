"""Fixtures shared by the envfleet tests, and the ``ray`` marker's guard.

Layout: tests/unit/ (one file per module), tests/contract/ (the backend contract: every
backend passes it; tests/contract/conftest.py lists the backends), tests/integration/
(adapters, the Sampler, ProcessEnv, the command line, examples, soak, EnvPool, gymnasium
compatibility). The fast run, ``python -m pytest -q -m "not ray and not slow"``, starts no
Ray: every test that starts Ray carries the ``ray`` marker, and a test without it that starts
Ray fails.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import envfleet
import envfleet._core.native
from tests.helpers import Snapshot


@pytest.fixture
def make_env(request: pytest.FixtureRequest) -> Iterator[Callable[..., envfleet.FleetVectorEnv]]:
    """``envfleet.make`` whose vector envs are closed when the test ends, even when it fails."""
    created: list[envfleet.FleetVectorEnv] = []

    def make(*args: Any, **kwargs: Any) -> envfleet.FleetVectorEnv:
        if kwargs.get("backend") == "ray":
            _require_ray_marker(request.node)
            ensure_ray()
        envs = envfleet.make(*args, **kwargs)
        created.append(envs)
        return envs

    yield make
    for envs in created:
        envs.close(terminate=True)


@pytest.fixture(params=["c", "python"])
def step_path(request: Any, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run the test with envfleet's C step path (``envfleet._core.native``), then without it: the
    Python twin of every C function. Set before the vector env is made; workers inherit it
    (``fork``) or read ``ENVFLEET_NO_SPEEDUPS`` when they import envfleet (spawn, forkserver)."""
    if request.param == "python":
        monkeypatch.setattr(envfleet._core.native, "speedups", None)
        monkeypatch.setenv("ENVFLEET_NO_SPEEDUPS", "1")
    elif envfleet._core.native.speedups is None:
        pytest.skip("envfleet._core._speedups is not built here (or ENVFLEET_NO_SPEEDUPS is set)")
    return str(request.param)


@pytest.fixture
def snapshot() -> Snapshot:
    """Child processes and /dev/shm entries before the test; call ``assert_nothing_left()``."""
    return Snapshot.take()


RAY_CPUS = 2  # logical CPUs of the tests' local Ray cluster (the development machine's cores)


def ensure_ray() -> None:
    """Start the tests' local Ray cluster, unless this process is connected to Ray already.

    ``address="local"``: always a cluster of its own, never one that another test run on this
    machine started (``ray.init()`` alone would join that one)."""
    import ray

    if not ray.is_initialized():
        ray.init(address="local", num_cpus=RAY_CPUS, include_dashboard=False, log_to_driver=False)


@pytest.fixture
def ray_cluster(request: pytest.FixtureRequest) -> Any:
    """A real local Ray cluster (started once per test module); yields the ``ray`` module."""
    _require_ray_marker(request.node)
    ensure_ray()
    import ray

    return ray


@pytest.fixture(scope="session", autouse=True)
def _sb3_logs_in_pytests_temp(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """SB3's ``learn()`` makes a log folder at each call, in the system's temporary directory
    unless ``SB3_LOGDIR`` names one (``stable_baselines3.common.logger.configure``): keep
    them in pytest's temporary directory, which pytest removes with its old runs."""
    patch = pytest.MonkeyPatch()
    patch.setenv("SB3_LOGDIR", str(tmp_path_factory.mktemp("sb3-logs")))
    yield
    patch.undo()


@pytest.fixture(scope="module", autouse=True)
def _shutdown_ray_after_module() -> Iterator[None]:
    """Shut down a Ray cluster a test module started, so that no Ray process outlives it
    (the leak checks of the other modules count every child process)."""
    yield
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()


def _ray_running() -> bool:
    ray = sys.modules.get("ray")
    return ray is not None and bool(ray.is_initialized())


def _require_ray_marker(node: pytest.Item) -> None:
    if node.get_closest_marker("ray") is None:
        pytest.fail(f"{node.nodeid} starts Ray without the ray marker (@pytest.mark.ray)")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark ``ray`` every test that asks for the ``ray_cluster`` fixture or runs on the ray
    backend by a parameter (the contract's backends carry their marks themselves)."""
    for item in items:
        callspec = getattr(item, "callspec", None)
        params = callspec.params.values() if callspec is not None else ()
        uses_fixture = "ray_cluster" in getattr(item, "fixturenames", ())
        if uses_fixture or any(isinstance(v, str) and v == "ray" for v in params):
            item.add_marker(pytest.mark.ray)


@pytest.fixture(autouse=True)
def _ray_only_where_marked(request: pytest.FixtureRequest) -> Iterator[None]:
    """Fail a test that started Ray (through ``envfleet.make`` or ``ray.init``) without the
    ``ray`` marker: the fast run (``-m "not ray"``) must start no Ray."""
    if request.node.get_closest_marker("ray") is not None:
        yield
        return
    before = _ray_running()
    yield
    if not before and _ray_running():
        pytest.fail(f"{request.node.nodeid} started Ray without the ray marker (@pytest.mark.ray)")
