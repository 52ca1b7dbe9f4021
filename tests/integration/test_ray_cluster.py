"""Issue 52: on a Ray cluster every node is like the driver's.

A real multi-node Ray cluster on this machine (``ray.cluster_utils.Cluster``): the driver's
node and two more, each with its own temporary directories (Ray's, and ``TMPDIR`` for the
actors' files) and custom resources that place env actors on them. A guard (the autouse
``guard`` fixture) fails every test in which envfleet's driver code opens a path or a
``/proc`` entry of a process on another node, signals one or asks psutil about one: what
the driver learns of an actor elsewhere comes through Ray, from the envfleet helper of that
node.

- an env error, a hang (with its hang reports) and a segfault in an actor on another node
  carry the same ``err.stacks`` and ``err.replay`` as in an actor on the driver's node, in
  one vector env with one actor on each (``envfleet replay`` reruns the far crash here);
- a leaking actor is recycled by its memory on both nodes, the run bit-identical to one
  without recycling, and ``envs.stats.memory`` reads both;
- a lost node, and a lost helper, cost only their own envs under a restart policy: the
  other envs' data is what it would have been (tests/unit/test_supervisor.py's model);
  without budget left, a lost helper is an ``EnvCrashedError`` that says so.

Real actors, real faults, a real node removed; timeouts are hang guards and
``step_timeout`` values, never speed bounds.
"""

from __future__ import annotations

import builtins
import functools
import inspect
import os
import re
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest

import envfleet
from envfleet._backends import workers
from envfleet._core.replay import load_replay
from envfleet._core.replay_runner import watch_replay
from envfleet._core.stacks import innermost
from tests.envs import FaultSeriesEnv, FlakyEnv, LeakyEnv
from tests.helpers import wait_gone
from tests.unit.test_supervisor import Model, _actions, _assert_result, _assert_stats, _play

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.ray  # every test here runs on a real local multi-node Ray cluster

ENVFLEET = str(Path(envfleet.__file__).resolve().parent) + os.sep
GONE = "its node's envfleet helper is gone"  # what an error says of a lost helper
WAIT = 60.0  # seconds: a hang guard for Ray to see an actor die, never a speed bound
# One actor on the driver's node and one on the far node: each node has one "slot".
SLOT = {"num_cpus": 0.1, "resources": {"slot": 1}}


@dataclass
class Nodes:
    """The module's cluster: the node ids of the driver's node (``head``) and of the far
    node, the far node's Ray node object (the last test removes it) and its temporary
    directory (the guard keeps the driver out of it)."""

    cluster: Any
    head: str
    far: str
    far_node: Any
    far_dir: str
    resident: list[Any]  # ObjectRefs: a Ray worker's resident memory, one on each node


@pytest.fixture(scope="module")
def cluster() -> Iterator[Nodes]:
    """Two Ray nodes on this machine, this process connected to the first:

    - ``head``, the driver's node: 1 CPU, ``slot: 1``, ``lossy: 2``, ``near: 1``;
    - ``far``: 1 CPU, ``slot: 1``, ``lossy: 1``, ``far: 1``, its own Ray temporary
      directory and ``TMPDIR`` (where its actors make their stack files and action logs).

    A node's death is seen within a second (Ray's health checks every 0.2 s)."""
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()
    checks = {"health_check_period_ms": 200, "health_check_failure_threshold": 3}
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 1,
            "include_dashboard": False,
            "include_log_monitor": False,  # nothing here reads the actors' output
            "no_monitor": True,  # nor autoscales
            "resources": {"slot": 1, "lossy": 2, "near": 1},
            "_system_config": checks,
        },
    )
    far_dir = tempfile.mkdtemp(prefix="ef-far-")
    try:
        far = cluster.add_node(
            num_cpus=1,
            resources={"slot": 1, "lossy": 1, "far": 1},
            temp_dir=os.path.join(far_dir, "ray"),
            env_vars={"TMPDIR": far_dir},
            object_store_memory=80 * 2**20,
        )
        ray.init(address=cluster.address, log_to_driver=False)
        head = ray.get_runtime_context().get_node_id()
        # Where an env actor's memory starts, on each node: asked now, read when needed.
        probe = ray.remote(num_cpus=0)(_resident)
        resident = [probe.options(resources={node: 0.01}).remote() for node in ("near", "far")]
        yield Nodes(cluster, head, far.node_id, far, far_dir, resident)
    finally:
        if ray.is_initialized():
            ray.shutdown()
        cluster.shutdown()
        shutil.rmtree(far_dir, ignore_errors=True)


def _resident() -> int:
    """A Ray worker's resident memory (bytes) once it has imported envfleet and stepped one
    of tests.envs' LeakyEnv without a leak: where an env actor of them starts, within a few
    MiB."""
    import envfleet  # noqa: F401  (as an env actor has)

    env = LeakyEnv(leak_kb=0)
    env.reset(seed=0)
    env.step(0)
    return int(psutil.Process().memory_info().rss)


# -- the guard: envfleet's driver code never touches a process or file of another node ---------


class OffNodeGuard:
    """Patches the driver's readers (``os.open``, ``open``, ``os.kill``, ``psutil.Process``,
    ``psutil.pid_exists``) so that envfleet's code reaching a process of another node (a
    descendant of its raylet) or a path of one (``/proc/PID/...``, the node's temporary
    directories) is recorded in :attr:`violations` and fails as it would on another machine
    (no such file, no such process)."""

    def __init__(self, nodes: Nodes):
        self.raylets = [nodes.far_node.all_processes["raylet"][0].process.pid]
        self.dirs = [os.path.realpath(nodes.far_dir) + os.sep]
        self.violations: list[str] = []
        self._inside = threading.local()

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        real_open, real_os_open, real_kill = builtins.open, os.open, os.kill
        real_init, real_exists = psutil.Process.__init__, psutil.pid_exists

        def guarded_open(file: Any, *args: Any, **kwargs: Any) -> Any:
            self._path(file, "open")
            return real_open(file, *args, **kwargs)

        def guarded_os_open(path: Any, *args: Any, **kwargs: Any) -> Any:
            self._path(path, "os.open")
            return real_os_open(path, *args, **kwargs)

        def guarded_kill(pid: int, sig: int) -> None:
            if self._pid(pid, f"os.kill({pid}, {sig})"):
                raise ProcessLookupError(pid)
            real_kill(pid, sig)

        def guarded_init(process: Any, pid: int | None = None) -> None:
            if pid is not None and self._pid(pid, f"psutil.Process({pid})"):
                raise psutil.NoSuchProcess(pid)
            real_init(process, pid)

        def guarded_exists(pid: int) -> bool:
            return not self._pid(pid, f"psutil.pid_exists({pid})") and real_exists(pid)

        monkeypatch.setattr(builtins, "open", guarded_open)
        monkeypatch.setattr(os, "open", guarded_os_open)
        monkeypatch.setattr(os, "kill", guarded_kill)
        monkeypatch.setattr(psutil.Process, "__init__", guarded_init)
        monkeypatch.setattr(psutil, "pid_exists", guarded_exists)

    def _path(self, path: Any, how: str) -> None:
        if isinstance(path, int) or not self._from_envfleet():
            return
        text = os.fsdecode(path) if isinstance(path, (str, bytes, os.PathLike)) else ""
        match = re.match(r"/proc/(\d+)(/|$)", text)
        if match and self._pid(int(match.group(1)), f"{how}({text!r})"):
            raise FileNotFoundError(text)
        full = os.path.realpath(text) if text else ""
        if any(full.startswith(d) for d in self.dirs):
            self.violations.append(f"{how}({text!r}): a path of another node")
            raise FileNotFoundError(text)

    def _pid(self, pid: int, what: str) -> bool:
        """Whether ``pid`` is a process of another node reached from envfleet's code (then
        recorded)."""
        if getattr(self._inside, "on", False) or not self._from_envfleet():
            return False
        self._inside.on = True
        try:
            off = set(self.raylets)
            for raylet in self.raylets:
                try:
                    off.update(p.pid for p in psutil.Process(raylet).children(recursive=True))
                except psutil.Error:
                    continue
        finally:
            self._inside.on = False
        if pid in off:
            self.violations.append(f"{what}: a process of another node")
            return True
        return False

    def _from_envfleet(self) -> bool:
        """Whether envfleet's code is on the calling stack (the driver's side of it)."""
        frame = sys._getframe(2)
        while frame is not None:
            if frame.f_code.co_filename.startswith(ENVFLEET):
                return True
            frame = frame.f_back
        return False


@pytest.fixture(autouse=True)
def guard(cluster: Nodes, monkeypatch: pytest.MonkeyPatch) -> Iterator[OffNodeGuard]:
    """Every test here: envfleet's driver code never reaches another node's files or
    processes (the test fails at its end if it did)."""
    watcher = OffNodeGuard(cluster)
    watcher.install(monkeypatch)
    yield watcher
    assert not watcher.violations, f"the driver reached another node: {watcher.violations}"


def test_the_guard_catches_the_driver_reaching_another_node(
    guard: OffNodeGuard, tmp_path: Path
) -> None:
    """The guard is no test that cannot fail: envfleet's readers, called here on another
    node's raylet and temporary directory, are caught and fail as on another machine."""
    pid = guard.raylets[0]
    watch = workers.MemoryWatch()
    watch.watch(0, pid)
    watch.sample()  # psutil.Process(pid): caught, no sample
    assert watch.last(0) is None
    with tempfile.TemporaryFile() as stacks:  # os.kill(pid, STACKS_SIGNAL): caught
        assert workers.ask_stacks({0: (pid, stacks.fileno())}, lambda w: True, 0.0) == {}
    for path in (f"/proc/{pid}/status", os.path.join(guard.dirs[0], "x.replay")):
        with pytest.raises(FileNotFoundError):
            load_replay(path)  # open
    found, guard.violations[:] = list(guard.violations), []
    assert len(found) == 4, found
    assert found[0].startswith(f"psutil.Process({pid})") and found[1].startswith("os.kill")


# -- what each node's actors give -------------------------------------------------------------


def _nodes(envs: Any) -> list[str]:
    """Per worker, the node its actor runs on (asked of the actors, through Ray)."""
    return [node for node, _ in envs._backend.transport.placement()]


def _wait_dead(actor: Any) -> None:
    """Wait until Ray reports ``actor`` dead (a call on it raises), within :data:`WAIT`."""
    deadline = time.monotonic() + WAIT
    while True:
        try:
            ray.get(actor.where.remote(), timeout=WAIT)
        except ray.exceptions.RayActorError:
            return
        assert time.monotonic() < deadline, "the actor did not die"
        time.sleep(0.02)


def _fault_line(marker: str) -> str:
    """``tests/envs.py:LINE`` of the line of FaultSeriesEnv.step that holds ``marker``."""
    lines, first = inspect.getsourcelines(FaultSeriesEnv.step)
    offset = next(i for i, line in enumerate(lines) if marker in line)
    return f"{inspect.getsourcefile(FaultSeriesEnv)}:{first + offset}"


# (fault, in its env's step since built): a raise; in the rebuilt env, a segfault; in the new
# actor's env, a hang: 0.8 s, then (unless spared) 60 s more.
SERIES = (("raise", 2), ("null-write", 4), ("sleep:0.8", 6), ("sleep:60", 6))


@pytest.mark.filterwarnings("ignore::envfleet.HangWarning")  # the new actors' start: long
def test_every_failure_is_reported_from_another_node_as_from_the_drivers(
    make_env: Any, cluster: Nodes, tmp_path: Path
) -> None:
    """Env 0 and env 1, one actor each, one on the driver's node and one on the far node,
    seeded alike and given the same actions: each raises in its 2nd step and, rebuilt,
    segfaults in its 4th. Under a restart policy (4 restarts) each failure is kept
    (``envs.stats.failures``): the far actor's errors carry the near one's stacks and
    replays, and ``envfleet replay`` reruns the far crash here. Then, in the new actors,
    both envs hang (the hang reports name both, with their stacks), the near one for 0.8 s
    and the far one past the step's 1.5 s: the StepTimeoutError (no budget left) carries
    the far actor's stacks and replay."""
    marker = str(tmp_path / "fired")
    factory = functools.partial(FaultSeriesEnv, series=SERIES, marker=marker)
    envs = make_env(
        factory,
        2,
        backend=envfleet.Ray(actor_options=SLOT),
        num_workers=2,
        supervision=envfleet.Supervision(
            hang_report_delay=0.4,
            restart_policy=envfleet.RestartPolicy(
                restart_on=(Exception,), max_restarts=4, window_s=600.0
            ),
        ),
    )
    nodes = _nodes(envs)
    assert sorted(nodes) == sorted([cluster.head, cluster.far])
    near, far = nodes.index(cluster.head), nodes.index(cluster.far)
    zeros = np.zeros(2, np.int64)
    envs.reset(seed=[7, 7])
    # Each failure ends its envs' episodes: their next step resets them (NEXT_STEP). The
    # raise in step 2; the autoreset; the segfault in step 7; the autoreset; 5 steps.
    for _ in range(13):
        envs.step(zeros)
    assert envs.stats.restarts == 4

    by_kind: dict[str, dict[int, Any]] = {}
    for err in envs.stats.failures:
        kind = "EnvError" if isinstance(err, envfleet.EnvError) else type(err).__name__
        by_kind.setdefault(kind, {})[err.worker_index] = err
    assert sorted(by_kind) == ["EnvCrashedError", "EnvError"], by_kind
    segfault_line = _fault_line("memset")
    for kind, pair in by_kind.items():
        assert sorted(pair) == [0, 1], (kind, pair)
        for w, err in pair.items():
            seen = f"{kind} of worker {w}: {err}\n{getattr(err, 'stacks', '')}"
            if kind == "EnvCrashedError":  # what faulthandler wrote at the fault
                assert innermost(err.stacks) == f"{segfault_line} in step", seen
                assert f"at {segfault_line} in step" in str(err), seen
            assert [r.env_index for r in err.replay.envs] == [w], seen
        _assert_same_recording(pair[near].replay.envs[0], pair[far].replay.envs[0], kind)
    for k in (0, 1):  # a replay reruns the env's calls, not what it keeps in files
        Path(f"{marker}-{far}-{k}").unlink()
    with pytest.raises(ValueError, match=f"boom in step 2 of env {far}"):
        envfleet.replay(by_kind["EnvError"][far].replay)
    by_kind["EnvCrashedError"][far].replay.save(str(tmp_path / "far.replay"))
    with open(tmp_path / "child.err", "w") as child_err:
        outcome = watch_replay(str(tmp_path / "far.replay"), stderr=child_err)
    assert (outcome.how, outcome.detail, outcome.env_index) == ("died", "signal SIGSEGV", far)

    # The hang, in the new actors (placed anew: which is where, asked again): reported
    # with both actors' stacks; the far one's past the timeout, the near one spared.
    for k in (0, 1):  # as they were before the replays ran
        Path(f"{marker}-{far}-{k}").touch()
    nodes = _nodes(envs)
    near, far = nodes.index(cluster.head), nodes.index(cluster.far)
    Path(f"{marker}-{near}-3").touch()
    envs.step_async(zeros)
    with (
        pytest.warns(envfleet.HangWarning) as reports,
        pytest.raises(envfleet.StepTimeoutError) as info,
    ):
        envs.step_wait(timeout=1.5)
    sleep_line = _fault_line("time.sleep(float")
    sleep_at = f"line {sleep_line.rsplit(':', 1)[1]} in step"
    first = str(reports[0].message)
    assert "on workers [0, 1] (sub-environments [0, 1])" in first, first
    assert "stack not available" not in first and first.count(sleep_at) == 2, first
    err = info.value
    assert err.env_indices == [far] and list(err.stacks) == [far], str(err)
    assert innermost(err.stacks[far]) == f"{sleep_line} in step", err.stacks
    # a step_wait(timeout=) of the caller's raises whatever the restart policy's budget
    assert f"at {sleep_line} in step" in str(err), str(err)
    [hung] = err.replay.envs
    assert err.replay.kind == "hang" and hung.env_index == far and hung.complete
    assert hung.steps == 6, hung  # the env's 6 steps since it was built, the hang's included
    assert envs.closed


def _assert_same_recording(a: Any, b: Any, what: str) -> None:
    """Two envs' recordings hold the same episode (start, steps and actions)."""
    assert (a.start, a.complete, a.steps) == (b.start, b.complete, b.steps), what
    actions = [[np.asarray(x).tolist() for x in r.actions] for r in (a, b)]
    assert actions[0] == actions[1], what


def _steps(envs: Any, steps: int) -> list[tuple[np.ndarray, ...]]:
    """``reset(seed=3)``, then ``steps`` steps of random actions (seeded): every result."""
    obs, _ = envs.reset(seed=3)
    rng = np.random.default_rng(0)
    seen = [(obs.copy(),)]
    for _ in range(steps):
        obs, reward, terminated, truncated, _ = envs.step(rng.integers(0, 2, envs.num_envs))
        seen.append((obs.copy(), reward.copy(), terminated.copy(), truncated.copy()))
    return seen


def _sampled(envs: Any) -> list[int]:
    """Each actor's resident memory, once its node's helper has sampled it (within
    :data:`WAIT`): ``envs.stats.memory``, read through the helpers."""
    deadline = time.monotonic() + WAIT
    while True:
        memory = envs.stats.memory
        if len(memory) == envs.num_workers and all(m.rss_bytes for m in memory):
            return [int(m.rss_bytes) for m in memory]
        assert time.monotonic() < deadline, memory
        time.sleep(0.05)


def test_a_leaking_actor_is_recycled_on_every_node(make_env: Any, cluster: Nodes) -> None:
    """Two leaking envs (1 MiB more each step), one actor on the driver's node and one on
    the far node, with ``max_rss_mb`` 64 MiB above where a Ray worker of such an env starts:
    each actor is recycled (once in 160 steps: the limit is looked at every 32) by its memory
    as read by its node's helper, on its own node, the
    run bit-identical to one without recycling (serial, no leak: the leak is not in the
    data), and ``envs.stats.memory`` reads both actors."""
    leaky = functools.partial(LeakyEnv, leak_kb=1024, episode_steps=5, step_s=0.0)
    starts = ray.get(cluster.resident, timeout=WAIT)
    recycle = envfleet.Recycle(max_rss_mb=max(starts) / 2**20 + 64)
    envs = make_env(
        leaky,
        2,
        backend=envfleet.Ray(actor_options=SLOT),
        num_workers=2,
        supervision=envfleet.Supervision(recycle=recycle),
    )
    before = envs._backend.transport.placement()
    assert sorted(node for node, _ in before) == sorted([cluster.head, cluster.far])
    got = _steps(envs, 160)
    after = envs._backend.transport.placement()
    assert envs.stats.recycled >= 2, envs.stats
    # Each actor was replaced, on its own node: the far one by what its helper read.
    assert [node for node, _ in after] == [node for node, _ in before]
    assert all(a[1] != b[1] for a, b in zip(after, before, strict=True)), (before, after)
    assert all(rss > 0 for rss in _sampled(envs))  # each new actor's, from its node's helper
    # A snapshot of actors on both nodes (each actor's record, through Ray) resumes here.
    state, actions = envs.snapshot(), np.array([1, 0])
    want_next = envs.step(actions)
    plain = make_env(
        functools.partial(LeakyEnv, leak_kb=0, episode_steps=5, step_s=0.0), 2, backend="serial"
    )
    for t, (a, b) in enumerate(zip(_steps(plain, 160), got, strict=True)):
        for x, y in zip(a, b, strict=True):
            assert np.array_equal(x, y), f"step {t} differs"
    resumed = make_env(
        functools.partial(LeakyEnv, leak_kb=0, episode_steps=5, step_s=0.0),
        2,
        backend="serial",
        resume=state,
    )
    for x, y in zip(resumed.step(actions)[:4], want_next[:4], strict=True):
        assert np.array_equal(x, y), "the resumed step differs"


def test_a_lost_helper_or_node_costs_only_its_envs(make_env: Any, cluster: Nodes) -> None:
    """Two actors of two envs each, asking for one ``lossy`` each: one on the driver's node,
    one on the far node (the driver's node's second one is held by a placement group).
    Under a restart policy every result is the model's (tests/unit/test_supervisor.py:
    every other env's data what it would have been): the far node's helper is killed (its
    actor dies with it, and is replaced there with a new helper), then the far node is
    removed (its actor is replaced on the driver's node). The failures kept say what
    happened, with Ray's reason."""
    from ray.util.placement_group import placement_group, remove_placement_group

    held = placement_group([{"lossy": 1, "near": 0.01}])
    ray.get(held.ready(), timeout=WAIT)
    envs = make_env(
        FlakyEnv,
        4,
        backend=envfleet.Ray(actor_options={"num_cpus": 0.1, "resources": {"lossy": 1}}),
        num_workers=2,
        supervision=envfleet.Supervision(
            restart_policy=envfleet.RestartPolicy(
                restart_on=(Exception,), max_restarts=10, window_s=600.0
            )
        ),
    )
    nodes = _nodes(envs)
    assert sorted(nodes) == sorted([cluster.head, cluster.far])
    far = nodes.index(cluster.far)
    far_rows = list(range(*envs.worker_ranges[far]))
    model = Model(4)
    _assert_result(envs.reset(seed=2), *model.reset(seed=2), "reset")
    _play(envs, model, 3)

    ray.kill(envs._backend.transport._helpers.nodes[cluster.far])
    _wait_dead(envs._backend.transport._actors[far])
    actions = _actions(model.t, 4)
    _assert_result(envs.step(actions), *model.step(actions, rows=far_rows), "helper lost")
    _play(envs, model, 3)
    helper_loss = envs.stats.failures[-1]
    assert isinstance(helper_loss, envfleet.EnvCrashedError), helper_loss
    assert helper_loss.worker_index == far and GONE in str(helper_loss), str(helper_loss)
    assert _nodes(envs) == nodes  # replaced on the far node, with a new helper

    remove_placement_group(held)  # the driver's node can take the far node's actor
    cluster.cluster.remove_node(cluster.far_node, allow_graceful=False)
    _wait_dead(envs._backend.transport._actors[far])
    actions = _actions(model.t, 4)
    _assert_result(envs.step(actions), *model.step(actions, rows=far_rows), "node lost")
    _play(envs, model, 3)
    node_loss = envs.stats.failures[-1]
    assert isinstance(node_loss, envfleet.EnvCrashedError), node_loss
    assert node_loss.worker_index == far and "node" in str(node_loss), str(node_loss)
    assert node_loss.stacks == "", node_loss.stacks
    assert _nodes(envs) == [cluster.head, cluster.head]
    _assert_stats(envs, model, 2, crashes=2)
    model.close()
    # The far node's helper was dropped with its node; the one left goes with the actors.
    helpers = envs._backend.transport._helpers.pids
    assert list(helpers) == [cluster.head], helpers
    pids = [pid for _, pid in envs._backend.transport.placement()] + list(helpers.values())
    envs.close()
    assert wait_gone(pids, timeout=WAIT) == []
