"""Fixtures shared by the envfleet tests, and the ``ray`` marker's guard.

Layout: tests/unit/ (one file per module), tests/contract/ (the backend contract: every
backend passes it; tests/contract/conftest.py lists the backends), tests/integration/
(adapters, the Sampler, ProcessEnv, the command line, examples, soak, EnvPool, gymnasium
compatibility). The fast run, ``python -m pytest -q -m "not ray and not slow"``, starts no
Ray: every test that starts Ray carries the ``ray`` marker, and a test without it that starts
Ray fails.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
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
def short_tmp_path() -> Iterator[Path]:
    """A new empty folder right under the system's temporary directory, removed after the
    test: a TMPDIR or RAY_TMPDIR whose sockets' paths stay under AF_UNIX's 107 bytes
    (pytest's ``tmp_path`` is longer under pytest-xdist, ``.../popen-gw0/...``)."""
    path = Path(tempfile.mkdtemp(prefix="ef-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


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
    """A real local Ray cluster (one for all the Ray tests, which run first); yields the
    ``ray`` module."""
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


@pytest.fixture(scope="session", autouse=True)
def _shutdown_ray_at_the_end() -> Iterator[None]:
    """Shut down the tests' Ray cluster when the session ends, so that no Ray process outlives
    it."""
    yield
    _shutdown_ray()


def _shutdown_ray() -> None:
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()


def _ray_running() -> bool:
    ray = sys.modules.get("ray")
    return ray is not None and bool(ray.is_initialized())


def _require_ray_marker(node: pytest.Item) -> None:
    if node.get_closest_marker("ray") is None:
        pytest.fail(f"{node.nodeid} starts Ray without the ray marker (@pytest.mark.ray)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark ``ray`` every test that asks for the ``ray_cluster`` fixture or runs on the ray
    backend by a parameter (the contract's backends carry their marks themselves), and run the
    Ray tests first, one after another, so that one Ray cluster serves them all (started by
    the first, shut down before any other test: the leak checks count every child process).

    Under pytest-xdist (``-n``, ``--dist loadgroup``), the Ray tests are one group, run by one
    worker while the other takes the rest, and the tests of a module whose fixtures last the
    module are one group each, so that no fixture runs twice."""
    for item in items:
        callspec = getattr(item, "callspec", None)
        params = callspec.params.values() if callspec is not None else ()
        uses_fixture = "ray_cluster" in getattr(item, "fixturenames", ())
        if uses_fixture or any(isinstance(v, str) and v == "ray" for v in params):
            item.add_marker(pytest.mark.ray)
    items.sort(key=lambda item: item.get_closest_marker("ray") is None)  # stable
    if config.pluginmanager.hasplugin("xdist"):
        for item in items:
            if item.get_closest_marker("ray") is not None:
                item.add_marker(pytest.mark.xdist_group("ray"))
            elif _has_module_fixture(item):
                item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))


def _has_module_fixture(item: pytest.Item) -> bool:
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return False
    return any(
        d.scope in ("module", "class", "package")
        for defs in info.name2fixturedefs.values()
        for d in defs
    )


@pytest.fixture(autouse=True)
def _ray_only_where_marked(request: pytest.FixtureRequest) -> Iterator[None]:
    """Fail a test that started Ray (through ``envfleet.make`` or ``ray.init``) without the
    ``ray`` marker: the fast run (``-m "not ray"``) must start no Ray."""
    if request.node.get_closest_marker("ray") is not None:
        yield
        return
    _shutdown_ray()  # the Ray tests before it are done: their cluster goes
    before = _ray_running()
    yield
    if not before and _ray_running():
        pytest.fail(f"{request.node.nodeid} started Ray without the ray marker (@pytest.mark.ray)")
