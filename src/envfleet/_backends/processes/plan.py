"""How ``backend="processes"`` lays out its envs: worker count, the driver's share, spin
budgets (:func:`plan_processes`, DESIGN §3)."""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Any

from envfleet._backends.base import worker_ranges
from envfleet._core.errors import ConfigError

__all__ = ["DEFAULT_SPIN_S", "ProcessesPlan", "plan_processes"]

DEFAULT_SPIN_S = 0.002  # the most a wait polls before it blocks, in seconds


@dataclass
class ProcessesPlan:
    """How the processes backend lays out its envs (see :func:`plan_processes`)."""

    ranges: list[tuple[int, int]]  # one block per group; the driver's first when driver_envs
    num_workers: int
    driver_envs: int
    driver_spin_s: float
    worker_spin_s: float


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

    Defaults (DESIGN §3): with ``c`` usable cores (``cores``: the process's affinity and
    cgroup quota, :func:`envfleet._core.cores.usable_cores`), ``c - 1`` workers (at least 1, at most
    ``num_envs - 1``) and the driver steps an equal share of the envs itself, so that every
    core steps envs and nobody idles on a round trip. Given ``num_workers`` alone, the driver
    steps none. Waiters spin at most ``spin_s`` seconds (default :data:`DEFAULT_SPIN_S`) and
    only while spinners do not outnumber the cores: the driver spins only if
    ``num_workers + 1 <= cores``, the workers only if ``num_workers <= cores``.

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
    if num_workers is None:
        if driver_envs is None:
            num_workers = max(1, min(num_envs - 1, cores - 1))
            driver_envs = num_envs // (num_workers + 1) if num_envs > 1 and cores > 1 else 0
            if driver_envs == 0:
                num_workers = max(1, min(num_envs, cores))
        else:
            num_workers = max(1, min(num_envs - driver_envs, cores - 1 if driver_envs else cores))
    elif driver_envs is None:
        driver_envs = 0
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
