"""How ``backend="processes"`` lays out its envs: worker count, the driver's share, spin
budgets (:func:`plan_processes`)."""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Any

from envfleet._backends.base import worker_ranges
from envfleet._core.errors import ConfigError

__all__ = ["DEFAULT_SPIN_S", "ProcessesPlan", "hosted_pool_plan", "plan_processes"]

DEFAULT_SPIN_S = 0.002  # the most a wait polls before it blocks, in seconds


@dataclass
class ProcessesPlan:
    """How the processes backend lays out its envs (see :func:`plan_processes`)."""

    ranges: list[tuple[int, int]]  # one block per group; the driver's first when driver_envs
    num_workers: int
    driver_envs: int
    driver_spin_s: float
    worker_spin_s: float
    # A first-ready pool's one-env groups, per worker process (host_main: a thread per group);
    # None: a process per group.
    hosts: list[list[int]] | None = None


def _is_int(value: Any, low: int, high: int) -> bool:
    return (
        isinstance(value, numbers.Integral)
        and not isinstance(value, bool)
        and low <= int(value) <= high
    )


def plan_processes(
    num_envs: int,
    num_workers: int | None,
    driver_envs: int | None,
    spin_s: float | None,
    cores: int,
) -> ProcessesPlan:
    """Choose worker count, the driver's share and spin budgets for the processes backend.

    Defaults: with ``c`` usable cores (``cores``: the process's affinity and cgroup quota,
    :func:`envfleet._core.cores.usable_cores`), ``min(num_envs, c)`` workers and every env in
    a worker (``driver_envs=0``), as every peer's process mode keeps its envs out of the
    learner's process: a segfault, a hang or a leak in an env is then a worker's, which the
    supervisor reports and can restart. ``driver_envs=k`` (opt-in) has the driver step the
    first ``k`` envs itself while ``c - 1`` workers step the rest (given no ``num_workers``),
    so that on few cores nobody idles on a round trip: a speed-up for envs of a few µs a
    step, none for real ones, and those ``k`` envs can take the learner down with them.
    Waiters spin at most ``spin_s`` seconds (default :data:`DEFAULT_SPIN_S`) and only while
    spinners do not outnumber the cores: the driver spins only if ``num_workers + 1 <=
    cores``, the workers only if ``num_workers <= cores``.

    Example::

        plan_processes(16, None, None, None, cores=2).ranges  # [(0, 8), (8, 16)]
        plan_processes(16, None, 8, None, cores=2).ranges  # [(0, 8), (8, 16)]: 0..7 here

    Raises:
        ConfigError: ``driver_envs`` outside ``[0, num_envs - num_workers]`` (every worker
            needs one env), or ``spin_s`` negative.
    """
    if spin_s is None:
        spin_s = DEFAULT_SPIN_S
    if not (isinstance(spin_s, numbers.Real) and spin_s >= 0):
        raise ConfigError(f"spin_s must be None or seconds >= 0, got {spin_s!r}")
    if driver_envs is not None and not _is_int(driver_envs, 0, num_envs - 1):
        raise ConfigError(
            f"driver_envs must be an integer in [0, {num_envs - 1}] (at least one env must go "
            f"to a worker; use backend='serial' to step every env in the driver), got "
            f"{driver_envs!r}"
        )
    if driver_envs is None:
        driver_envs = 0  # every env in a worker, unless the caller opts in to a share
    if num_workers is None:
        num_workers = max(1, min(num_envs - driver_envs, cores - 1 if driver_envs else cores))
    if num_workers > num_envs - driver_envs:
        raise ConfigError(
            f"{num_workers} workers cannot share the {num_envs - driver_envs} envs the driver "
            f"does not step (driver_envs={driver_envs})"
        )
    ranges = [(0, driver_envs)] if driver_envs else []
    ranges += [
        (driver_envs + a, driver_envs + b)
        for a, b in worker_ranges(num_envs - driver_envs, num_workers)
    ]
    return ProcessesPlan(
        ranges=ranges,
        num_workers=num_workers,
        driver_envs=driver_envs,
        driver_spin_s=float(spin_s) if num_workers + 1 <= cores else 0.0,
        worker_spin_s=float(spin_s) if num_workers <= cores else 0.0,
    )


def hosted_pool_plan(num_envs: int, spin_s: float | None, cores: int) -> ProcessesPlan:
    """A first-ready pool's default layout: one env per group (each env's result handed back
    when it finishes), the groups served by ``min(num_envs, cores)`` worker processes
    (contiguous runs, a thread per group: ``host_main``), which cost what a worker per core
    does. Hosted groups never spin for their command (their threads share a core); the
    driver spins as with one worker per process.

    Example::

        hosted_pool_plan(8, None, cores=2).hosts  # [[0, 1, 2, 3], [4, 5, 6, 7]]
    """
    plan = plan_processes(num_envs, num_envs, 0, spin_s, cores)
    processes = max(1, min(num_envs, cores))
    plan.hosts = [list(range(a, b)) for a, b in worker_ranges(num_envs, processes)]
    spin = DEFAULT_SPIN_S if spin_s is None else float(spin_s)
    plan.driver_spin_s = spin if processes + 1 <= cores else 0.0
    plan.worker_spin_s = spin if processes <= cores else 0.0  # a host serving in turns
    return plan
