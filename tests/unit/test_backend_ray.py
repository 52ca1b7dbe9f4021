"""``backend="ray"``: Ray actors holding EnvGroups, on a real local Ray cluster.

The differential suite (tests/contract/test_differential.py) checks that the Ray backend is
bit-identical to SyncVectorEnv. Here: placement and options, every kind of fault (an env
raises, an actor segfaults, exits, is killed or hangs), close leaves no actor alive, the
restart policy, the first-ready pool, a two-node cluster with a custom resource and joining a
running cluster by address. Nothing is mocked; timeouts are hang guards only.
"""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import psutil
import pytest
from gymnasium import spaces
from gymnasium.vector import AutoresetMode, SyncVectorEnv

import envfleet
from tests.conftest import RAY_CPUS
from tests.envs import CrashEnv, FlakyEnv, IndexedEnv, RaisingEnv, sync_factories
from tests.helpers import assert_same, wait_gone
from tests.unit import test_pool, test_supervisor
from tests.unit.test_supervisor import Model, _assert_result, _assert_stats, _flaky, _marker, _play

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.ray  # every test here runs on a real local Ray cluster

ROOT = Path(__file__).resolve().parents[2]
POLICY = envfleet.RestartPolicy(restart_on=(Exception,), max_restarts=10, window_s=600.0)
GONE = 30.0  # seconds: a hang guard for processes to exit, never a speed bound


class NodeEnv(gym.Env):
    """Records the Ray node and the process it was built in."""

    def __init__(self, env_index: int = 0):
        self.env_index = env_index
        self.node_id = ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
        self.pid = os.getpid()
        self.observation_space = spaces.Box(-1.0, 1.0, (2,), np.float32)
        self.action_space = spaces.Discrete(2)

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        return self.np_random.uniform(-1.0, 1.0, 2).astype(np.float32), {}

    def step(self, action: Any):
        return self.np_random.uniform(-1.0, 1.0, 2).astype(np.float32), 1.0, False, False, {}


@pytest.fixture(scope="module")
def cluster() -> Any:
    """A real Ray cluster of two nodes on this machine, for the whole module: the head
    (1 CPU) and a node with 1 CPU and a custom resource ``simulator: 2``. Yields (cluster,
    the simulator node's id)."""
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()
    cluster = Cluster(
        initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False}
    )
    try:
        simulator = cluster.add_node(num_cpus=1, resources={"simulator": 2})
        cluster.wait_for_nodes()
        yield cluster, simulator.node_id
    finally:
        if ray.is_initialized():
            ray.shutdown()
        cluster.shutdown()


@pytest.fixture
def ray_cluster(cluster: Any) -> Any:
    """This process connected to the module's two-node cluster (overrides conftest's)."""
    if not ray.is_initialized():
        ray.init(address=cluster[0].address, log_to_driver=False)
    return ray


def _actor_pids(envs: envfleet.FleetVectorEnv) -> list[int]:
    return sorted({pid for _, pid in envs._backend.transport.placement()})


def _assert_gone(pids: list[int]) -> None:
    assert wait_gone(pids, timeout=GONE) == [], f"Ray actors still running: {pids}"


# -- layout, options, the basic calls ----------------------------------------------------------


def test_defaults_calls_attributes_render_stats(make_env, ray_cluster, cluster):
    factory = functools.partial(IndexedEnv, render_mode="rgb_array")
    envs = make_env(factory, 5, backend="ray")
    assert envs.backend == "ray" and envs.num_workers == min(5, RAY_CPUS)
    assert envs.worker_ranges == ((0, 3), (3, 5))
    options = envs._backend.transport._options
    assert options["scheduling_strategy"] == "SPREAD" and options["num_cpus"] <= 1.0
    # SPREAD: one actor on each of the two nodes.
    placement = envs._backend.transport.placement()
    assert {node for node, _ in placement} == {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    pids = envs.get_attr("pid")
    assert pids == (pids[0],) * 3 + (pids[3],) * 2 and pids[0] != pids[3] != os.getpid()
    assert sorted({pid for _, pid in placement}) == sorted({pids[0], pids[3]})

    assert [w.count for w in envs.stats.workers] == [0, 0]
    envs.reset(seed=0)
    for t in range(12):
        envs.step(np.full(5, t % 2))
    workers = envs.stats.workers
    assert [w.count for w in workers] == [12, 12]
    assert all(w.mean_s > 0 and 0 < w.p50_s <= w.p99_s for w in workers)

    assert envs.call("add", 1, y=2) == (3, 4, 5, 6, 7)
    envs.set_attr("value", ["a", "b", "c", "d", "e"])
    assert envs.get_attr("value") == ("a", "b", "c", "d", "e")
    envs.set_attr("value", 7)
    assert envs.get_attr("value") == (7,) * 5
    frames = envs.render()
    assert len(frames) == 5 and all(f[0, 0, 0] == i for i, f in enumerate(frames))
    assert envs.metadata["render_fps"] == 4 and envs.render_mode == "rgb_array"
    with pytest.raises(envfleet.EnvError) as info:
        envs.get_attr("missing")
    assert isinstance(info.value.__cause__, AttributeError)
    assert envs.call("add", 0) == (0, 1, 2, 3, 4)  # still usable
    envs.close()
    _assert_gone(sorted(set(pids)))


def test_more_workers_than_cpus_share_them(make_env, ray_cluster):
    envs = make_env(IndexedEnv, 3, backend="ray", num_workers=3)
    # Two 1-CPU nodes hold 3 actors of half a CPU (less when CPUs are still held by others).
    assert envs._backend.transport._options["num_cpus"] <= 0.5
    assert envs.get_attr("env_index") == (0, 1, 2)
    pids = envs.get_attr("pid")
    assert len(set(pids)) == 3 and os.getpid() not in pids


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (lambda: {"backend": envfleet.Ray(actor_options=["num_cpus"])}, "must be None or a dict"),
        (lambda: {"backend": envfleet.Ray(actor_options={"max_restarts": 3})}, "envfleet's to set"),
        (lambda: {"backend": envfleet.Ray(actor_options={"num_cpus": 2})}, "nodes hold 0 of them"),
        (lambda: {"backend": envfleet.Ray(actor_options={"resources": {"gizmo": 1}})}, "0 gizmo"),
        (lambda: {"backend": envfleet.Ray(actor_options={"no_such_option": 1})}, "rejected by Ray"),
        (lambda: {"backend": envfleet.Ray(address=5)}, "address must be"),
    ],
)
def test_config_errors(ray_cluster, kwargs, match):
    with pytest.raises(envfleet.ConfigError, match=match):
        envfleet.make(IndexedEnv, 4, num_workers=2, **kwargs())


def test_unpicklable_factory(ray_cluster):
    lock = threading.Lock()

    def factory():
        assert lock is not None
        return IndexedEnv()

    with pytest.raises(envfleet.ConfigError, match="cannot be pickled"):
        envfleet.make(factory, 2, backend="ray")


MISSING_RAY = """
import sys
sys.modules["ray"] = None  # as if ray were not installed
import envfleet
try:
    envfleet.make("CartPole-v1", 2, backend="ray")
except envfleet.ConfigError as exc:
    print(exc)
"""


def test_missing_ray_is_a_config_error():
    out = subprocess.run(
        [sys.executable, "-c", MISSING_RAY], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert "pip install 'envfleet[ray]'" in out.stdout


# -- faults, fail-fast ------------------------------------------------------------------------


def test_env_raises_in_step(make_env, ray_cluster):
    factory = functools.partial(RaisingEnv, fail_index=3, fail_after=2)
    envs = make_env(factory, 4, backend="ray", num_workers=2)
    envs.reset(seed=0)
    for _ in range(2):
        envs.step(np.zeros(4, np.int64))
    with pytest.raises(envfleet.EnvError) as info:
        envs.step(np.zeros(4, np.int64))
    err = info.value
    assert (err.env_index, err.worker_index, err.method) == (3, 1, "step")
    assert isinstance(err.__cause__, ValueError) and "boom in step 3" in str(err.__cause__)
    assert isinstance(err.__cause__.__cause__, envfleet.RemoteTraceback)
    assert "RaisingEnv" in str(err.__cause__.__cause__) or "raise ValueError" in str(
        err.__cause__.__cause__
    )
    assert not envs.closed and envs.stats.env_errors == 1
    obs, _ = envs.reset(seed=1)  # still usable
    assert obs.shape == (4, 3)


def test_env_raises_in_make(ray_cluster):
    factory = functools.partial(RaisingEnv, fail_index=2, fail_in="init")
    with pytest.raises(envfleet.EnvError) as info:
        envfleet.make(factory, 4, backend="ray", num_workers=2)
    assert (info.value.env_index, info.value.worker_index, info.value.method) == (2, 1, "make")
    assert isinstance(info.value.__cause__, ValueError)


def test_actor_segfaults_in_step(make_env, ray_cluster):
    factory = functools.partial(CrashEnv, crash_index=3, how="segfault")
    envs = make_env(
        factory, 4, backend="ray", supervision=envfleet.Supervision(restart_policy=None)
    )  # fail fast
    envs.reset(seed=0)
    pids = _actor_pids(envs)
    for _ in range(3):
        envs.step(np.zeros(4, np.int64))
    with pytest.raises(envfleet.EnvCrashedError) as info:
        envs.step(np.zeros(4, np.int64))
    err = info.value
    assert (err.worker_index, err.env_indices, err.env_index, err.step) == (1, [2, 3], 2, 3)
    assert err.exitcode is None and "Ray actor of worker 1" in str(err)
    assert envs.closed and envs.stats.crashes == 1
    with pytest.raises(envfleet.ClosedEnvironmentError):
        envs.step(np.zeros(4, np.int64))
    _assert_gone(pids)


def test_actor_killed_from_outside(make_env, ray_cluster):
    envs = make_env(
        IndexedEnv,
        4,
        backend="ray",
        num_workers=2,
        supervision=envfleet.Supervision(restart_policy=None),
    )
    envs.reset(seed=0)
    pids = _actor_pids(envs)
    killed = envs._backend.transport.placement()[0][1]
    ray.kill(envs._backend.transport._actors[0])
    # ray.kill returns before the actor is gone: step only once it is, or the step may finish.
    assert wait_gone([killed], timeout=GONE) == []
    with pytest.raises(envfleet.EnvCrashedError) as info:
        envs.step(np.zeros(4, np.int64))
    assert (info.value.worker_index, info.value.env_indices) == (0, [0, 1])
    _assert_gone(pids)


def test_a_segfaulting_actor_is_restarted_by_default(make_env, ray_cluster):
    """make()'s default restart policy on Ray: the actor is replaced, its envs start new
    episodes (the whole actor's block on Ray), the restart warns, and the run goes on."""
    factory = functools.partial(CrashEnv, crash_index=3, how="segfault")
    envs = make_env(factory, 4, backend="ray")
    envs.reset(seed=0)
    for _ in range(3):
        envs.step(np.zeros(4, np.int64))
    with pytest.warns(envfleet.EnvRestartedWarning, match=r"sub-environments \[2, 3\] start"):
        _, _, _, truncated, info = envs.step(np.zeros(4, np.int64))
    assert truncated.tolist() == [False, False, True, True]
    assert np.flatnonzero(info["_env_restarted"]).tolist() == [2, 3]
    envs.step(np.zeros(4, np.int64))
    assert envs.stats.crashes == 1 and envs.stats.restarts == 1 and not envs.closed


def test_actor_dies_while_starting(ray_cluster):
    factory = functools.partial(CrashEnv, crash_index=3, how="exit", crash_in="init")
    with pytest.raises(envfleet.EnvCrashedError, match="while starting") as info:
        envfleet.make(factory, 4, backend="ray", num_workers=2)
    assert info.value.worker_index == 1


@pytest.mark.parametrize("via", ["step_timeout"])
def test_hang_past_the_timeout_kills_the_actors(make_env, ray_cluster, via):
    factory = functools.partial(CrashEnv, crash_index=2, how="hang", crash_after=1)
    timeout = 1.0
    envs = make_env(
        factory,
        4,
        backend="ray",
        num_workers=2,
        supervision=envfleet.Supervision(
            step_timeout=timeout if via == "step_timeout" else None, restart_policy=None
        ),  # fail fast
    )
    envs.reset(seed=0)
    pids = _actor_pids(envs)
    envs.step(np.zeros(4, np.int64))
    envs.step_async(np.zeros(4, np.int64))
    with pytest.raises(envfleet.StepTimeoutError) as info:
        envs.step_wait(timeout=timeout if via == "step_wait" else None)
    assert (info.value.env_indices, info.value.timeout) == ([2, 3], timeout)
    assert envs.closed and envs.stats.timeouts == 1
    _assert_gone(pids)


@pytest.mark.parametrize("pending", [False, True])
def test_close_leaves_no_actor_alive(ray_cluster, tmp_path, pending):
    envs = envfleet.make(FlakyEnv, 4, backend="ray", num_workers=2)
    envs.reset(seed=0)
    pids = _actor_pids(envs)
    assert len(pids) == 2 and all(psutil.pid_exists(pid) for pid in pids)
    # One envfleet helper per node that holds actors, in a process of its own; gone too.
    nodes = {node for node, _ in envs._backend.transport.placement()}
    helpers = envs._backend.transport._helpers.pids
    assert set(helpers) == nodes and len(set(helpers.values())) == len(nodes)
    pids += [pid for pid in helpers.values() if pid is not None]
    assert all(psutil.pid_exists(pid) for pid in pids) and os.getpid() not in pids
    if pending:
        envs.step_async(np.zeros(4, np.int64))
        with pytest.warns(UserWarning, match="Calling `close` while waiting for a pending call"):
            envs.close(terminate=True)
    else:
        envs.close()
    assert envs.closed
    _assert_gone(pids)
    envs.close()  # idempotent


def test_close_with_a_hung_env_is_bounded(ray_cluster):
    factory = functools.partial(CrashEnv, crash_index=1, how="hang", crash_after=0)
    envs = envfleet.make(factory, 2, backend="ray", num_workers=2)
    envs.reset(seed=0)
    pids = _actor_pids(envs)
    envs.step_async(np.zeros(2, np.int64))
    with pytest.warns(UserWarning, match="Calling `close` while waiting for a pending call"):
        envs.close(timeout=0.5)  # the step never finishes: the actors are killed
    _assert_gone(pids)


# -- the restart policy -------------------------------------------------------------------------


def test_env_raises_is_rebuilt_in_its_actor(make_env, ray_cluster, tmp_path):
    test_supervisor.test_env_raises_in_step(
        make_env, tmp_path, "ray", 6, 2, 4, AutoresetMode.SAME_STEP
    )


def test_env_raises_in_reset_is_rebuilt(make_env, ray_cluster):
    test_supervisor.test_env_raises_in_reset(make_env, "ray", 6, 2, 4)


def test_restart_budget_exhausted(make_env, ray_cluster):
    test_supervisor.test_budget_exhausted_env_error(make_env, "ray", 1, 1)


def test_errors_in_calls_are_not_restarted(make_env, ray_cluster):
    test_supervisor.test_errors_in_calls_are_not_restarted(make_env, "ray")


@pytest.mark.parametrize(
    ("how", "mode", "index", "rows"),
    [
        ("segfault", AutoresetMode.NEXT_STEP, 4, [3, 4, 5]),
        ("exit", AutoresetMode.DISABLED, 1, [0, 1, 2]),
    ],
)
def test_dead_actor_is_replaced(make_env, ray_cluster, tmp_path, how, mode, index, rows):
    factory = _flaky({index: how}, fault_after=4, marker=_marker(tmp_path))
    envs = make_env(
        factory,
        6,
        backend="ray",
        num_workers=2,
        autoreset_mode=mode,
        supervision=envfleet.Supervision(restart_policy=POLICY),
    )
    model = Model(6, mode, faults={index: rows}, fault_after=4)
    _assert_result(envs.reset(seed=5), *model.reset(seed=5), "reset")
    pids = envs.get_attr("pid")
    _play(envs, model, 20)
    assert len(model.events) == 1 and model.events[0][1] == rows
    _assert_stats(envs, model, 1, crashes=1)
    new_pids = envs.get_attr("pid")
    assert [i for i in range(6) if new_pids[i] != pids[i]] == rows
    envs.close()
    _assert_gone(sorted(set(pids) | set(new_pids)))
    model.close()


def test_hung_actor_is_replaced(make_env, ray_cluster, tmp_path):
    factory = _flaky({3: "hang"}, fault_after=3, marker=_marker(tmp_path))
    envs = make_env(
        factory,
        4,
        backend="ray",
        num_workers=2,
        supervision=envfleet.Supervision(step_timeout=2.0, restart_policy=POLICY),
    )
    model = Model(4, faults={3: [2, 3]}, fault_after=3)
    _assert_result(envs.reset(seed=4), *model.reset(seed=4), "reset")
    pids = envs.get_attr("pid")
    _play(envs, model, 12)
    _assert_stats(envs, model, 1, timeouts=1)
    new_pids = envs.get_attr("pid")
    assert [i for i in range(4) if new_pids[i] != pids[i]] == [2, 3]
    _assert_gone([pids[2]])
    model.close()


def test_actor_killed_between_steps_is_replaced(make_env, ray_cluster):
    envs = make_env(
        FlakyEnv,
        4,
        backend="ray",
        num_workers=2,
        supervision=envfleet.Supervision(restart_policy=POLICY),
    )
    model = Model(4)
    _assert_result(envs.reset(seed=2), *model.reset(seed=2), "reset")
    _play(envs, model, 3)
    pids = envs.get_attr("pid")
    os.kill(pids[3], signal.SIGKILL)
    assert not wait_gone([pids[3]], timeout=GONE)
    actions = np.array([0, 1, 2, 0])
    _assert_result(envs.step(actions), *model.step(actions, rows=[2, 3]), "step after kill")
    _play(envs, model, 8)
    _assert_stats(envs, model, 1, crashes=1)
    model.close()


def test_budget_exhausted_crash_fails_fast(make_env, ray_cluster):
    policy = envfleet.RestartPolicy(restart_on=(Exception,), max_restarts=0)
    envs = make_env(
        _flaky({3: "segfault"}, fault_after=2),
        4,
        backend="ray",
        num_workers=2,
        supervision=envfleet.Supervision(restart_policy=policy),
    )
    envs.reset(seed=0)
    for t in range(2):
        envs.step(np.full(4, t % 3))
    with pytest.raises(envfleet.EnvCrashedError, match="restart budget exhausted") as info:
        envs.step(np.zeros(4, np.int64))
    assert info.value.worker_index == 1 and envs.closed


# -- the first-ready pool ---------------------------------------------------------------------


def test_pool_routing(make_env, ray_cluster):
    test_pool.test_routing_every_row_action_and_step_goes_to_its_env(make_env, "ray", 6, 3, 3)


def test_pool_env_error_keeps_the_others(make_env, ray_cluster):
    test_pool.test_env_error_keeps_the_results_of_the_others(make_env, "ray", 3)


def test_pool_sync_mode(make_env, ray_cluster):
    test_pool.test_sync_mode_send_recv_and_step_mix(make_env, "ray")


def test_pool_recv_timeout_kills_the_actors(make_env, ray_cluster, tmp_path):
    gate = str(tmp_path / "gate")
    envs = test_pool.pool(
        make_env,
        "ray",
        4,
        2,
        knobs={"gate": gate, "gated": (0, 1, 2, 3)},
        num_workers=2,
        supervision=envfleet.Supervision(restart_policy=None),
    )
    envs.async_reset(seed=0)
    with pytest.raises(envfleet.StepTimeoutError):
        envs.recv(timeout=1.0)
    assert envs.closed


# -- the cluster's nodes, and joining a cluster by address --------------------------------------


def test_custom_resource_places_actors_on_its_node(ray_cluster, cluster):
    _, simulator_node = cluster
    options = {"resources": {"simulator": 1}}
    envs = envfleet.make(
        NodeEnv,
        4,
        backend=envfleet.Ray(actor_options=options),
        num_workers=2,
    )
    try:
        # The simulator node has one CPU: each actor gets half of it at most.
        assert envs._backend.transport._options["num_cpus"] <= 0.5
        assert set(envs.get_attr("node_id")) == {simulator_node}
        assert {node for node, _ in envs._backend.transport.placement()} == {simulator_node}
    finally:
        envs.close()
    # Three actors needing one simulator each do not fit the cluster's two.
    with pytest.raises(envfleet.ConfigError, match="simulator"):
        envfleet.make(
            NodeEnv,
            3,
            backend=envfleet.Ray(actor_options=options),
            num_workers=3,
        )


def _wait_for_free_cpus(timeout: float = GONE) -> None:
    """Wait until every CPU of the cluster is free again: Ray releases a killed actor's
    resources after ``close()`` returns, and ``SPREAD`` places actors where CPUs are free."""
    deadline = time.monotonic() + timeout
    total = ray.cluster_resources().get("CPU", 0.0)
    while ray.available_resources().get("CPU", 0.0) < total:
        assert time.monotonic() < deadline, "the cluster's CPUs were not released"
        time.sleep(0.05)


def test_joins_a_running_cluster_by_address(cluster):
    if ray.is_initialized():
        _wait_for_free_cpus()  # the tests before closed their actors; Ray frees them after
        ray.shutdown()  # this process leaves the cluster, which keeps running
    envs = envfleet.make(
        NodeEnv,
        4,
        backend=envfleet.Ray(address=cluster[0].address),
    )
    assert ray.is_initialized()
    nodes = {node["NodeID"] for node in ray.nodes() if node["Alive"]}
    assert len(nodes) == 2 and cluster[1] in nodes
    spread = envs.get_attr("node_id")
    assert set(spread) == nodes and spread[0] == spread[1] and spread[2] == spread[3]
    sync = SyncVectorEnv(sync_factories(NodeEnv, 4))
    assert_same(envs.reset(seed=0)[0], sync.reset(seed=0)[0])
    actions = np.array([0, 1, 1, 0])
    assert_same(envs.step(actions)[:4], sync.step(actions)[:4])
    envs.close()
    sync.close()
    # envfleet never shuts down a cluster it joined.
    assert ray.is_initialized()
    assert len([node for node in ray.nodes() if node["Alive"]]) == 2
