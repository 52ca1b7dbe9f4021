"""The bounds of a learner's loop (the Sampler's report and ``envfleet bench --policy``).

The overlap bound assumes one policy call on the whole batch, overlapped with the envs; the
schedule bound is the best of the structures a loop can take (one call then the envs; groups
alternating; the policy in each worker), from the policy's time at each batch size
(``T_p(n)``, :func:`time_policy`). All times in seconds, all bounds in env steps per second.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping
from typing import Any

from envfleet._core.errors import ConfigError

__all__ = [
    "groups_bound",
    "one_call_bound",
    "overlap_bound",
    "schedule_bound",
    "schedule_sizes",
    "schedule_splits",
    "schedule_structures",
    "time_policy",
    "workers_bound",
]


def overlap_bound(num_envs: int, t_policy: float, t_env: float, cores: int) -> float:
    """The overlap bound of a learner's loop, in env steps per second.

    ``num_envs / max(t_policy, (t_policy + num_envs * t_env) / cores)``: the policy's work on
    one batch and the envs' work on one step of every env, perfectly overlapped on ``cores``
    cores, with the policy's batch never split. No loop can beat it.

    Args:
        num_envs: envs per batch (``N``).
        t_policy: seconds the policy takes for one batch of ``N`` observations (``T_p``).
        t_env: seconds one env takes for one step in a plain loop.
        cores: cores available (:func:`envfleet.usable_cores`).

    Raises:
        ConfigError: ``num_envs`` or ``cores`` below 1, a negative time, or both times 0.

    Example::

        overlap_bound(16, 141e-6, 8.2e-6, 2)  # 16 / max(141e-6, 136.1e-6) = 113475.2
    """
    if num_envs < 1 or cores < 1:
        raise ConfigError(f"num_envs and cores must be >= 1, got {num_envs} and {cores}")
    if t_policy < 0 or t_env < 0 or t_policy + t_env <= 0:
        raise ConfigError(f"times must be >= 0 and not both 0, got {t_policy} and {t_env}")
    return num_envs / max(t_policy, (t_policy + num_envs * t_env) / cores)


def _check_schedule(num_envs: int, parts: int, t_policy: float, t_env: float, cores: int) -> None:
    """Refuse what no bound of a structure of ``parts`` groups or workers can be computed from."""
    if num_envs < 1 or cores < 1:
        raise ConfigError(f"num_envs and cores must be >= 1, got {num_envs} and {cores}")
    if not 1 <= parts <= num_envs:
        raise ConfigError(f"groups or workers must be in 1..num_envs, got {parts}")
    if t_policy < 0 or t_env < 0 or t_policy + t_env <= 0:
        raise ConfigError(f"times must be >= 0 and not both 0, got {t_policy} and {t_env}")


def one_call_bound(num_envs: int, t_policy: float, t_env: float, cores: int) -> float:
    """The "one call" structure's bound, in env steps per second: the policy on the whole
    batch, then every env stepped, spread over ``cores`` cores (the plain loop's structure).

    ``num_envs / (t_policy + num_envs * t_env / cores)``.

    Args:
        num_envs: envs per batch (``N``).
        t_policy: seconds of the policy on a batch of ``N`` observations (``T_p(N)``).
        t_env: seconds one env takes for one step in a plain loop.
        cores: cores available.

    Raises:
        ConfigError: ``num_envs`` or ``cores`` below 1, a negative time, or both times 0.

    Example::

        one_call_bound(16, 100e-6, 1e-6, 2)  # 16 / (100e-6 + 8e-6) = 148148.1
    """
    _check_schedule(num_envs, 1, t_policy, t_env, cores)
    return num_envs / (t_policy + num_envs * t_env / cores)


def groups_bound(
    num_envs: int, groups: int, t_policy_group: float, t_env: float, cores: int
) -> float:
    """The "``groups`` groups alternating" structure's bound, in env steps per second: the
    driver runs the policy on one group while the other groups' envs step.

    A cycle has ``groups`` policy calls of ``T_p(N / groups)`` in sequence on one core and
    ``N`` env steps spread over the cores: ``num_envs / max(groups * t_policy_group,
    (groups * t_policy_group + num_envs * t_env) / cores)``.

    Args:
        num_envs: envs per batch (``N``).
        groups: groups of ``N / groups`` envs (1 to ``N``).
        t_policy_group: seconds of the policy on one group's observations (``T_p(N/groups)``).
        t_env: seconds one env takes for one step in a plain loop.
        cores: cores available.

    Raises:
        ConfigError: ``groups`` outside 1..``num_envs``, or as :func:`one_call_bound`.

    Example::

        groups_bound(16, 2, 10e-6, 10e-6, 4)  # 16 / max(20e-6, 45e-6) = 355555.6
    """
    _check_schedule(num_envs, groups, t_policy_group, t_env, cores)
    policy = groups * t_policy_group
    return num_envs / max(policy, (policy + num_envs * t_env) / cores)


def workers_bound(
    num_envs: int, workers: int, t_policy_share: float, t_env: float, cores: int
) -> float:
    """The "policy in each of ``workers`` workers" structure's bound, in env steps per
    second: each worker runs its own copy of the policy on its share of the envs, then steps
    them.

    A worker's cycle is ``T_p(N / workers) + (N / workers) * t_env``, and the cores hold
    all the workers' work: ``num_envs / max(t_policy_share + num_envs / workers * t_env,
    (workers * t_policy_share + num_envs * t_env) / cores)``.

    Args:
        num_envs: envs per batch (``N``).
        workers: workers of ``N / workers`` envs each (1 to ``N``).
        t_policy_share: seconds of the policy on one worker's observations
            (``T_p(N/workers)``).
        t_env: seconds one env takes for one step in a plain loop.
        cores: cores available.

    Raises:
        ConfigError: ``workers`` outside 1..``num_envs``, or as :func:`one_call_bound`.

    Example::

        workers_bound(16, 4, 40e-6, 1e-6, 8)  # 16 / max(44e-6, 22e-6) = 363636.4
    """
    _check_schedule(num_envs, workers, t_policy_share, t_env, cores)
    worker = t_policy_share + num_envs / workers * t_env
    return num_envs / max(worker, (workers * t_policy_share + num_envs * t_env) / cores)


#: The splits of the batch the schedule bound tries: groups alternating, workers with a policy.
_SPLITS = (2, 4)


def schedule_splits(num_envs: int, cores: int = 1) -> tuple[int, ...]:
    """The ``k`` of the split structures (``k`` groups, ``k`` workers): 2 and 4, and the
    larger powers of two up to ``cores`` (a worker per core: on 16 cores, 8 workers of one
    Pong env each are a structure a loop takes), each at most ``N``.

    Example::

        schedule_splits(16, cores=16)  # (2, 4, 8, 16)
    """
    splits, k = [], 2
    while k <= num_envs and (k in _SPLITS or k <= cores):
        splits.append(k)
        k *= 2
    return tuple(splits)


def schedule_sizes(num_envs: int, cores: int = 1) -> tuple[int, ...]:
    """The batch sizes at which the schedule bound needs the policy's time: ``N`` and
    ``N // k`` for each ``k`` of :func:`schedule_splits` (distinct, largest first).

    A ``k`` that does not divide ``N`` takes the smaller groups' size, so that the bound stays
    one: a cycle's calls on groups of unequal sizes take at least ``k`` calls on the smaller.

    Example::

        schedule_sizes(16)  # (16, 8, 4)
    """
    if num_envs < 1:
        raise ConfigError(f"num_envs must be >= 1, got {num_envs}")
    sizes = [num_envs] + [num_envs // k for k in schedule_splits(num_envs, cores)]
    return tuple(dict.fromkeys(sizes))


def schedule_structures(
    num_envs: int, t_policy_by_n: Mapping[int, float], t_env: float, cores: int
) -> dict[str, float]:
    """Each structure a loop can take, and its bound in env steps per second.

    The structures, in this order: ``"one call"`` (:func:`one_call_bound`), ``"k groups
    alternating"`` (:func:`groups_bound`) and ``"policy in each of k workers"``
    (:func:`workers_bound`) for each ``k`` of :func:`schedule_splits`.

    Args:
        num_envs: envs per batch (``N``).
        t_policy_by_n: seconds of the policy on a batch of ``n`` observations, for every ``n``
            of :func:`schedule_sizes` (more are ignored).
        t_env: seconds one env takes for one step in a plain loop.
        cores: cores available.

    Raises:
        ConfigError: a size of :func:`schedule_sizes` missing from ``t_policy_by_n``, or as
            the structures' functions.
    """
    missing = [n for n in schedule_sizes(num_envs, cores) if n not in t_policy_by_n]
    if missing:
        raise ConfigError(f"the policy's time is missing at batch sizes {missing}")
    out = {"one call": one_call_bound(num_envs, t_policy_by_n[num_envs], t_env, cores)}
    splits = schedule_splits(num_envs, cores)
    for k in splits:
        t = t_policy_by_n[num_envs // k]
        out[f"{k} groups alternating"] = groups_bound(num_envs, k, t, t_env, cores)
    for k in splits:
        t = t_policy_by_n[num_envs // k]
        out[f"policy in each of {k} workers"] = workers_bound(num_envs, k, t, t_env, cores)
    return out


def schedule_bound(
    num_envs: int, t_policy_by_n: Mapping[int, float], t_env: float, cores: int
) -> tuple[float, str]:
    """The schedule bound of a learner's loop: the best of :func:`schedule_structures`, in
    env steps per second, and the name of the structure that attains it (on a tie, the first
    in that order).

    Unlike :func:`overlap_bound`, it assumes only what some loop can do: split the batch and
    pay the policy's time on each part (``T_p(n)`` measured at each size). Arguments and
    errors as :func:`schedule_structures`.

    Example::

        # A policy whose time does not shrink with the batch: one call is best.
        schedule_bound(16, {16: 100e-6, 8: 100e-6, 4: 100e-6}, 1e-6, 1)  # (137931.0, "one call")
    """
    structures = schedule_structures(num_envs, t_policy_by_n, t_env, cores)
    best = max(structures, key=lambda name: structures[name])
    return structures[best], best


def time_policy(policy: Callable[[Any], Any], batch: Any, seconds: float) -> float:
    """The median seconds of ``policy(batch)`` over about ``seconds`` (at least 5 timed calls),
    after 3 untimed ones (``T_p`` at ``len(batch)`` rows)."""
    times: list[float] = []
    deadline = time.perf_counter() + seconds
    for i in range(1_000_000):
        t0 = time.perf_counter()
        policy(batch)
        t1 = time.perf_counter()
        if i >= 3:  # warm-up calls
            times.append(t1 - t0)
        if t1 >= deadline and len(times) >= 5:
            break
    return float(statistics.median(times))
