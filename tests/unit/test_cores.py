"""Cores as the machine grants them (issue 19 item 5): CPU affinity and a cgroup v2 ``cpu.max``
quota, the smaller of the two, read by make()'s default plans."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import envfleet
from envfleet._core import cores as _cores
from envfleet._core.cores import cpu_max_cores, quota_cores, usable_cores

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("text", "cores"),
    [
        ("max 100000\n", None),
        ("max", None),
        ("150000 100000\n", 2),
        ("50000 100000\n", 1),
        ("100000 100000", 1),
        ("200000 100000", 2),
        ("200001 100000", 3),
        ("400000 200000", 2),
        ("1000 1000000", 1),
        ("300000", 3),  # the kernel's default period
        ("", None),
        ("garbage 100000", None),
        ("1 2 3", None),
        ("0 100000", None),
        ("100000 0", None),
    ],
)
def test_cpu_max_parsing(text: str, cores: int | None) -> None:
    assert cpu_max_cores(text) == cores


def _tree(tmp_path: Path, proc: str, files: dict[str, str]) -> tuple[str, str]:
    """A fake ``/proc/self/cgroup`` holding ``proc`` and a cgroup root with ``files``
    (relative path -> contents); returns (root, proc file)."""
    root = tmp_path / "cgroup"
    root.mkdir()
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    proc_file = tmp_path / "proc_cgroup"
    proc_file.write_text(proc)
    return str(root), str(proc_file)


def test_quota_read_from_the_process_cgroup(tmp_path: Path) -> None:
    root, proc = _tree(
        tmp_path,
        "0::/user.slice/job.scope\n",
        {
            "user.slice/job.scope/cpu.max": "150000 100000\n",
            "other.slice/cpu.max": "50000 100000\n",  # another cgroup's quota: not ours
        },
    )
    assert quota_cores(root, proc) == 2


def test_a_parent_quota_bounds_its_children(tmp_path: Path) -> None:
    root, proc = _tree(
        tmp_path,
        "0::/a/b\n",
        {"a/b/cpu.max": "400000 100000\n", "a/cpu.max": "150000 100000\n"},
    )
    assert quota_cores(root, proc) == 2


@pytest.mark.parametrize(
    ("proc", "files"),
    [
        ("0::/job\n", {"job/cpu.max": "max 100000\n"}),  # no quota
        ("0::/job\n", {}),  # no cpu.max (the cpu controller not enabled)
        # cgroup v1 only: no "0::" line, a v2-looking file under the root is not ours
        ("4:cpu,cpuacct:/job\n1:name=systemd:/job\n", {"cpu.max": "50000 100000\n"}),
        ("", {"cpu.max": "50000 100000\n"}),
    ],
)
def test_no_quota(tmp_path: Path, proc: str, files: dict[str, str]) -> None:
    root, proc_file = _tree(tmp_path, proc, files)
    assert quota_cores(root, proc_file) is None
    assert usable_cores(root, proc_file) == _cores.affinity_cores()


def test_no_cgroup_file_means_affinity_alone(tmp_path: Path) -> None:
    missing = str(tmp_path / "absent")
    assert quota_cores(missing, missing) is None
    assert usable_cores(missing, missing) == len(os.sched_getaffinity(0))


def test_a_namespaced_cgroup_reads_the_root(tmp_path: Path) -> None:
    """In a container the process's cgroup is ``/`` and the root holds its quota."""
    root, proc = _tree(tmp_path, "0::/\n", {"cpu.max": "50000 100000\n"})
    assert quota_cores(root, proc) == 1
    assert usable_cores(root, proc) == 1


@pytest.mark.parametrize(
    ("affinity", "quota", "usable"),
    [
        (4, "150000 100000", 2),
        (1, "300000 100000", 1),
        (3, "max 100000", 3),
        (2, "200000 100000", 2),
    ],
)
def test_the_smaller_of_affinity_and_quota_wins(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, affinity: int, quota: str, usable: int
) -> None:
    root, proc = _tree(tmp_path, "0::/job\n", {"job/cpu.max": quota})
    monkeypatch.setattr(_cores, "affinity_cores", lambda: affinity)
    assert usable_cores(root, proc) == usable


def test_affinity_is_the_real_mask() -> None:
    assert _cores.affinity_cores() == len(os.sched_getaffinity(0))
    assert 1 <= envfleet.usable_cores() <= _cores.affinity_cores()


# Pinned to one core, before envfleet is imported: make()'s default plans and usable_cores()
# must see one core (the worker processes inherit the mask).
ONE_CORE = """
import json, os, sys
os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
import envfleet
from envfleet import usable_cores
from tests.envs import IndexedEnv
out = {"usable": usable_cores(), "affinity": len(os.sched_getaffinity(0))}
with envfleet.make(IndexedEnv, 4) as envs:
    pids = envs.get_attr("pid")
    out["processes_workers"] = envs.num_workers
    out["driver_envs"] = sum(pid == os.getpid() for pid in pids)
    out["worker_pids"] = len(set(pids) - {os.getpid()})
with envfleet.make(IndexedEnv, 4, backend="threads") as envs:
    out["threads_workers"] = envs.num_workers
print(json.dumps(out))
"""


def _plan_in_subprocess(code: str) -> dict[str, int]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO / "src"), str(REPO), *filter(None, [env.get("PYTHONPATH")])]
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        env=env,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs sched_setaffinity")
def test_a_real_one_core_affinity_mask_gives_one_core_plans() -> None:
    """On this machine (two or more usable cores) the default plan has a worker per core
    and the threads backend two threads; pinned to one core, one worker steps every env and
    one thread."""
    if envfleet.usable_cores() < 2:
        pytest.skip("needs two usable cores to tell one core's plan from the machine's")
    got = _plan_in_subprocess(ONE_CORE)
    assert got["affinity"] == 1
    assert got["usable"] == 1
    assert got["processes_workers"] == 1
    assert got["driver_envs"] == 0
    assert got["worker_pids"] == 1
    assert got["threads_workers"] == 1


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs sched_setaffinity")
def test_the_machine_plan_differs_from_the_one_core_plan() -> None:
    """The same script unpinned: a worker per core (and no env in the driver, as pinned),
    threads one per core, so the one-core test above sees the mask and not a plan that never
    changes."""
    cores = envfleet.usable_cores()
    if cores < 2:
        pytest.skip("needs two usable cores")
    got = _plan_in_subprocess(ONE_CORE.replace("os.sched_setaffinity(", "(lambda *a: None)("))
    assert got["usable"] == cores
    assert got["driver_envs"] == 0
    assert got["processes_workers"] == min(4, cores)
    assert got["worker_pids"] == min(4, cores)
    assert got["threads_workers"] == min(4, cores)


# Pinned to one core: a local Ray cluster that make() starts has one CPU, so one actor.
RAY_ONE_CORE = """
import json, os
os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
import ray
import envfleet
from tests.envs import IndexedEnv
with envfleet.make(IndexedEnv, 4, backend="ray") as envs:
    out = {"cpus": ray.cluster_resources().get("CPU"), "ray_workers": envs.num_workers}
ray.shutdown()
print(json.dumps(out))
"""


@pytest.mark.ray
@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs sched_setaffinity")
def test_a_local_ray_cluster_has_the_usable_cores(
    monkeypatch: pytest.MonkeyPatch, short_tmp_path: Path
) -> None:
    """Ray counts the host's CPUs (or its cgroup quota), not the affinity mask: make() starts
    its local cluster with the usable cores. RAY_TMPDIR of its own: ``ray.init()`` would join
    a cluster another test run on this machine started, and that one keeps its CPUs."""
    pytest.importorskip("ray")
    if envfleet.usable_cores() < 2:
        pytest.skip("needs two usable cores to tell one core's cluster from the machine's")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("RAY_TMPDIR", str(short_tmp_path))
    got = _plan_in_subprocess(RAY_ONE_CORE)
    assert got == {"cpus": 1.0, "ray_workers": 1}


# Pinned to one core, joining a running cluster of three CPUs that RAY_ADDRESS names: that
# cluster keeps its CPUs (Ray refuses num_cpus when it joins one).
RAY_JOIN = """
import json, os
os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
import ray
from ray.cluster_utils import Cluster
import envfleet
from tests.envs import IndexedEnv
cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 3, "include_dashboard": False})
os.environ["RAY_ADDRESS"] = cluster.address
try:
    with envfleet.make(IndexedEnv, 4, backend="ray") as envs:
        out = {"cpus": ray.cluster_resources().get("CPU"), "ray_workers": envs.num_workers}
finally:
    ray.shutdown()
    cluster.shutdown()
print(json.dumps(out))
"""


@pytest.mark.ray
@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs sched_setaffinity")
def test_joining_a_cluster_keeps_its_cpus(
    monkeypatch: pytest.MonkeyPatch, short_tmp_path: Path
) -> None:
    pytest.importorskip("ray")
    monkeypatch.setenv("RAY_TMPDIR", str(short_tmp_path))
    got = _plan_in_subprocess(RAY_JOIN)
    assert got == {"cpus": 3.0, "ray_workers": 3}
