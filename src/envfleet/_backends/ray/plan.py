"""Planning ``backend="ray"``: connect to Ray, choose the worker count and each actor's options
(:func:`plan_ray`, called through the registry when :func:`envfleet.make` plans)."""

from __future__ import annotations

import logging
import math
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import ray

from envfleet._backends.ray.actor import RemoteWorker
from envfleet._core.cores import usable_cores
from envfleet._core.errors import ConfigError

__all__ = ["RayPlan", "connect", "plan_ray"]

logger = logging.getLogger("envfleet")

# Actor options envfleet owns: Ray restarting actors or retrying tasks on its own, or running
# two commands at once, would break the supervisor's accounting and the EnvGroup's state.
_RESERVED_OPTIONS = ("max_restarts", "max_task_retries", "max_concurrency", "concurrency_groups")


@dataclass
class RayPlan:
    """Worker count and actor options for the Ray backend (see :func:`plan_ray`)."""

    num_workers: int
    actor_options: dict[str, Any]
    started: bool  # whether make() connected to (or started) Ray itself


def connect(address: str | None) -> bool:
    """Connect to Ray unless this process already is: ``ray.init(address=address)``.

    ``address=None`` starts a local cluster whose CPUs are the cores this process may use
    (:func:`envfleet._core.cores.usable_cores`), or joins the one ``RAY_ADDRESS`` names;
    ``"auto"`` joins the cluster started on this machine with ``ray start``;
    ``"ray://host:10001"`` goes through Ray Client. Returns whether it connected now. A
    cluster envfleet starts lives until this interpreter exits (or ``ray.shutdown()``); envfleet
    never shuts down a cluster.

    Raises:
        ConfigError: Ray could not connect or start.
    """
    if ray.is_initialized():
        if address is not None:
            logger.debug("ray is already initialized; ignoring address=%r", address)
        return False
    logger.info(
        "starting a local Ray cluster" if address is None else "connecting to Ray at %s", address
    )
    try:
        if address is None:
            _init_local()
        else:
            ray.init(address=address, include_dashboard=False)
    except (ConnectionError, ValueError, RuntimeError, TimeoutError) as exc:
        raise ConfigError(f"cannot connect to Ray at {address!r}: {exc}") from exc
    return True


def _init_local() -> None:
    """``ray.init()`` with the cores this process may use as a new local cluster's CPUs (Ray
    counts the host's, or its cgroup quota, but not this process's affinity). Ray refuses
    ``num_cpus`` when ``address=None`` finds a cluster to join (``RAY_ADDRESS``, or one
    started on this machine): that one keeps its own CPUs."""
    try:
        ray.init(include_dashboard=False, num_cpus=usable_cores())
    except ValueError:
        if ray.is_initialized():
            raise
        ray.init(include_dashboard=False)


def plan_ray(
    num_envs: int,
    num_workers: int | None,
    address: str | None,
    options: Mapping[str, Any] | None,
) -> RayPlan:
    """Connect to Ray and choose the worker count and each actor's options.

    Defaults: ``num_workers = min(num_envs, the cluster's CPUs)``; each actor asks for
    ``num_cpus=1`` when every actor fits the CPUs free now, else for the largest share of a
    CPU with which they fit (Ray's CPUs are logical: a share packs more actors per core), else
    (no CPU free: other actors hold them all) for none, with a warning; and
    ``scheduling_strategy="SPREAD"``. ``options`` override these and go to the actor's
    ``.options(...)`` (``num_cpus``, ``num_gpus``, ``resources={"simulator": 1}``,
    ``scheduling_strategy``, ``runtime_env``, ``memory``, ...). Actors that fit the cluster
    but not what is free now wait for it
    (:class:`envfleet._backends.ray.backend.RayTransport` warns while they wait).

    Raises:
        ConfigError: ``options`` is not a mapping, holds an option envfleet owns
            (``max_restarts``, ``max_task_retries``, ``max_concurrency``), an option Ray
            rejects, or asks for resources with which ``num_workers`` actors cannot all fit
            on the cluster's nodes alive now, even idle (they would never start); Ray could
            not connect.
    """
    if options is not None and not isinstance(options, Mapping):
        raise ConfigError(f"actor_options must be None or a dict, got {type(options).__name__}")
    options = dict(options or {})
    reserved = sorted(set(options) & set(_RESERVED_OPTIONS))
    if reserved:
        raise ConfigError(
            f"actor_options {reserved} are envfleet's to set: it restarts actors itself "
            "(restart_policy) and runs one command at a time in each"
        )
    started = connect(address)
    nodes = [dict(node["Resources"]) for node in ray.nodes() if node.get("Alive")]
    cpus = sum(float(node.get("CPU", 0.0)) for node in nodes)
    if num_workers is None:
        num_workers = max(1, min(num_envs, int(cpus)))
    actor_options: dict[str, Any] = {"scheduling_strategy": "SPREAD", **options}
    try:
        asked: dict[str, float] = {
            "GPU": float(actor_options.get("num_gpus") or 0.0),
            **{str(k): float(v) for k, v in (actor_options.get("resources") or {}).items()},
        }
    except (TypeError, ValueError, AttributeError) as exc:
        raise ConfigError(f"actor_options: bad resource amounts ({exc})") from exc
    if "num_cpus" in options:
        asked["CPU"] = float(options["num_cpus"] or 0.0)
    else:
        free = _free_resources(nodes)
        share = _cpu_share(free, asked, num_workers)
        if share == 0.0:
            logger.warning(
                "the Ray cluster has no CPU free for %d actors (other actors hold them): "
                "they ask for none (pass envfleet.Ray(actor_options={'num_cpus': ...}) to wait "
                "instead)",
                num_workers,
            )
        actor_options["num_cpus"] = asked["CPU"] = share
    fit = _actors_fitting(nodes, asked)
    if fit < num_workers:
        wanted = ", ".join(f"{amount:g} {name}" for name, amount in asked.items() if amount)
        raise ConfigError(
            f"{num_workers} Ray actors asking for {wanted} each cannot all be placed: the "
            f"cluster's {len(nodes)} nodes hold {fit} of them (they have "
            f"{_describe(nodes, asked)}); lower num_workers or the amounts in actor_options "
            "(fractions work, e.g. num_cpus=0.5), or add nodes"
        )
    try:
        RemoteWorker.options(**actor_options)
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"actor_options rejected by Ray: {exc}") from exc
    return RayPlan(num_workers, actor_options, started)


def _actors_fitting(nodes: list[dict[str, float]], asked: Mapping[str, float]) -> int:
    """How many actors asking for ``asked`` (resource -> amount) the nodes hold in all."""
    wanted = {name: amount for name, amount in asked.items() if amount > 0}
    if not wanted:
        return sys.maxsize if nodes else 0
    return sum(
        min(int(float(node.get(name, 0.0)) / amount + 1e-9) for name, amount in wanted.items())
        for node in nodes
    )


def _free_resources(nodes: list[dict[str, float]]) -> list[dict[str, float]]:
    """The resources free now on each live node (Ray's developer API; the nodes' totals
    where it is not there, as through Ray Client)."""
    try:
        from ray._private.state import available_resources_per_node

        return [dict(free) for free in available_resources_per_node().values()]
    except Exception:
        return nodes


def _cpu_share(nodes: list[dict[str, float]], asked: Mapping[str, float], workers: int) -> float:
    """1 CPU, or the largest share of a CPU (in Ray's 1e-4 steps) with which ``workers``
    actors also asking for ``asked`` fit ``nodes``, or 0."""
    if _actors_fitting(nodes, {**asked, "CPU": 1.0}) >= workers:
        return 1.0
    shares = {
        math.floor(float(node.get("CPU", 0.0)) / k * 1e4) / 1e4
        for node in nodes
        for k in range(1, workers + 1)
    }
    for share in sorted(shares, reverse=True):
        if 0 < share < 1 and _actors_fitting(nodes, {**asked, "CPU": share}) >= workers:
            return share
    return 0.0


def _describe(nodes: list[dict[str, float]], asked: Mapping[str, float]) -> str:
    names = [name for name, amount in asked.items() if amount]
    return "; ".join(
        ", ".join(f"{float(node.get(name, 0.0)):g} {name}" for name in names) for node in nodes
    )
