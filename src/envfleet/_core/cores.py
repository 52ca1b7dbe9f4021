"""The cores this process may use: its CPU affinity and a cgroup v2 ``cpu.max`` quota, the
smaller of the two (:func:`usable_cores`); and the memory it may use: the machine's and a
cgroup v2 ``memory.max`` limit, the smaller (:func:`usable_memory`).

Worker counts and spin budgets read :func:`usable_cores`, never the host's ``os.cpu_count()``:
in a container limited to two CPUs on a 64-core host, or a job pinned to a few cores with
``taskset``, only those cores run the workers, and more busy workers than that only take turns.

The quota is read from cgroup v2: the process's cgroup path is the ``0::<path>`` line of
``/proc/self/cgroup``, and ``<root>/<path>/cpu.max`` (and each parent's, up to ``<root>``)
holds ``"<quota> <period>"`` in microseconds, or ``"max <period>"`` for no quota. A quota of
``q`` per period ``p`` lets the cgroup run ``q / p`` cores' worth, rounded up here (at least 1).
Under cgroup v1, or where no cgroup file can be read, the affinity alone counts.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import psutil

__all__ = [
    "CGROUP_ROOT",
    "PROC_CGROUP",
    "affinity_cores",
    "cpu_max_cores",
    "memory_max_bytes",
    "pool_workers",
    "quota_cores",
    "usable_cores",
    "usable_memory",
]

CGROUP_ROOT = "/sys/fs/cgroup"  # where the cgroup v2 hierarchy is mounted
PROC_CGROUP = "/proc/self/cgroup"  # this process's cgroups, one line per hierarchy


def affinity_cores() -> int:
    """The cores in this process's CPU affinity mask (``os.sched_getaffinity``; psutil where
    Python has no such call; ``os.cpu_count()`` where neither can say), at least 1.

    Example:
        >>> affinity_cores() >= 1
        True
    """
    if hasattr(os, "sched_getaffinity"):
        try:
            return max(1, len(os.sched_getaffinity(0)))
        except OSError:
            pass
    try:
        return max(1, len(psutil.Process().cpu_affinity() or []))
    except (AttributeError, NotImplementedError, psutil.Error):
        return max(1, os.cpu_count() or 1)


def cpu_max_cores(text: str) -> int | None:
    """The cores a cgroup v2 ``cpu.max`` file's contents grant: ``ceil(quota / period)``, at
    least 1; ``None`` for no quota (``"max"``) or contents that are not a quota.

    Args:
        text: the file's contents, ``"<quota> <period>"`` (microseconds, integers) or
            ``"max <period>"``; a lone ``"<quota>"`` takes the kernel's default period
            (100000).

    Example:
        >>> cpu_max_cores("150000 100000"), cpu_max_cores("50000 100000"), cpu_max_cores("max")
        (2, 1, None)
    """
    fields = text.split()
    if not fields or len(fields) > 2 or fields[0] == "max":
        return None
    try:
        quota = int(fields[0])
        period = int(fields[1]) if len(fields) == 2 else 100_000
    except ValueError:
        return None
    if quota <= 0 or period <= 0:
        return None
    return max(1, math.ceil(quota / period))


def _cgroup_v2_path(proc_cgroup: str) -> str | None:
    """This process's cgroup v2 path (the ``0::<path>`` line), or ``None`` without one."""
    try:
        lines = Path(proc_cgroup).read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and controllers == "":
            return path
    return None


def _cgroup_values(name: str, root: str, proc_cgroup: str) -> list[str]:
    """The contents of this process's cgroup v2 file ``name`` and of each parent's up to
    ``root`` (innermost first); none where there is no cgroup v2 line or no file to read."""
    path = _cgroup_v2_path(proc_cgroup)
    if path is None:
        return []
    parts = [part for part in path.split("/") if part not in ("", ".", "..")]
    texts = []
    for depth in range(len(parts), -1, -1):
        try:
            texts.append(Path(root, *parts[:depth], name).read_text())
        except OSError:
            continue
    return texts


def memory_max_bytes(text: str) -> int | None:
    """The bytes a cgroup v2 ``memory.max`` file's contents allow; ``None`` for no limit
    (``"max"``) or contents that are not a number.

    Example:
        >>> memory_max_bytes("1073741824\n"), memory_max_bytes("max")
        (1073741824, None)
    """
    try:
        value = int(text.strip())
    except ValueError:
        return None
    return value if value > 0 else None


def usable_memory(root: str = CGROUP_ROOT, proc_cgroup: str = PROC_CGROUP) -> int:
    """The memory this process's tree may use, in bytes: the smaller of the machine's
    (``psutil.virtual_memory().total``) and its cgroup v2 ``memory.max`` limits (its cgroup's
    and every parent's: a container's memory limit), which is where the OOM killer strikes.

    Example:
        >>> usable_memory() <= psutil.virtual_memory().total
        True
    """
    limits = [memory_max_bytes(t) for t in _cgroup_values("memory.max", root, proc_cgroup)]
    return min([int(psutil.virtual_memory().total), *(v for v in limits if v is not None)])


def quota_cores(root: str = CGROUP_ROOT, proc_cgroup: str = PROC_CGROUP) -> int | None:
    """The cores this process's cgroup v2 CPU quota grants: the smallest :func:`cpu_max_cores`
    of its cgroup's ``cpu.max`` and every parent's up to ``root`` (a parent's quota bounds
    its children); ``None`` where there is no quota, no cgroup v2 line or no file to read.

    Args:
        root: where the cgroup v2 hierarchy is mounted.
        proc_cgroup: the file that lists this process's cgroups.

    Example:
        >>> quota_cores(root="/nonexistent") is None
        True
    """
    found = [c for t in _cgroup_values("cpu.max", root, proc_cgroup) if (c := cpu_max_cores(t))]
    return min(found) if found else None


def usable_cores(root: str = CGROUP_ROOT, proc_cgroup: str = PROC_CGROUP) -> int:
    """The cores this process may use: the smaller of its CPU affinity
    (``os.sched_getaffinity``) and its cgroup v2 ``cpu.max`` quota (the affinity alone where
    there is no quota), at least 1. envfleet's default worker counts and spin budgets read it,
    never ``os.cpu_count()``, and so does ``envfleet bench``'s limit.

    Args:
        root: where the cgroup v2 hierarchy is mounted (tests point it at a temporary tree).
        proc_cgroup: the file that lists this process's cgroups.

    Example:
        >>> 1 <= usable_cores() <= (os.cpu_count() or 1)
        True
    """
    cores = affinity_cores()
    quota = quota_cores(root, proc_cgroup)
    return cores if quota is None else max(1, min(cores, quota))


def pool_workers(num_envs: int, batch_size: int, cores: int) -> int:
    """The default worker count of a first-ready pool of ``num_envs`` envs answering
    ``batch_size`` at a time on ``cores`` usable cores: the most workers, up to the cores, whose
    equal blocks fill a batch exactly; else one env per worker (``num_envs``).

    A worker steps its block once every env of it has its action and hands the block back
    whole, so a batch must be whole blocks: an env of a block left over after a ``recv`` would
    keep the rest of its block waiting for an action the caller sends only after a later
    ``recv``. EnvPool runs one thread per core whatever the number of envs; one process per
    env costs a process wake-up on each side of every env step, and more processes than
    cores take turns.

    Example:
        >>> pool_workers(64, 32, 16), pool_workers(16, 8, 2), pool_workers(8, 3, 4)
        (16, 2, 8)
    """
    for w in range(max(1, min(num_envs, cores)), 0, -1):
        if num_envs % w == 0 and batch_size % (num_envs // w) == 0:
            return w
    return num_envs
