"""What both kinds of Sampler inference share (layer 4 in docs/architecture.md): timers and
counters, the policy helpers, one recorded step, and the :class:`Inference` base that
:mod:`envfleet._sampler.driver_inference` and :mod:`envfleet._sampler.worker_inference` implement.
"""

from __future__ import annotations

import abc
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from envfleet._core.errors import InvalidArgumentError
from envfleet._front.vector_env import FleetVectorEnv
from envfleet._sampler.rollout import EpisodeBatch, StepLog

__all__ = [
    "Inference",
    "Policy",
    "SamplerStats",
    "SamplerTimers",
    "TimerStat",
    "Timers",
    "act",
    "load_params",
    "pick_episodes",
    "policy_seed",
    "seed_policy",
    "step_and_record",
]

Policy = Callable[[Any], Any]


# -- timers and counters ---------------------------------------------------------------------


@dataclass(frozen=True)
class TimerStat:
    """Time spent in one activity: ``total_s`` seconds over ``count`` calls."""

    total_s: float = 0.0
    count: int = 0

    @property
    def mean_s(self) -> float:
        """Seconds per call (``nan`` before the first)."""
        return self.total_s / self.count if self.count else float("nan")

    def __add__(self, other: TimerStat) -> TimerStat:
        return TimerStat(self.total_s + other.total_s, self.count + other.count)


class _Stopwatch:
    """One named stopwatch of :class:`Timers` (a context manager; not re-entrant)."""

    __slots__ = ("entry", "t0")

    def __init__(self, entry: list[float]):
        self.entry = entry
        self.t0 = 0.0

    def __enter__(self) -> None:
        self.t0 = time.perf_counter()

    def __exit__(self, *exc_info: object) -> None:
        entry = self.entry
        entry[0] += time.perf_counter() - self.t0
        entry[1] += 1


class Timers:
    """Named stopwatches: ``with timers.time("policy"): ...`` adds to ``policy``. Each name's
    stopwatch is made once (it runs on every step of the Sampler's loops)."""

    def __init__(self) -> None:
        self.totals: dict[str, list[float]] = {}
        self._watches: dict[str, _Stopwatch] = {}

    def time(self, name: str) -> _Stopwatch:
        watch = self._watches.get(name)
        if watch is None:
            watch = self._watches[name] = _Stopwatch(self.totals.setdefault(name, [0.0, 0]))
        return watch

    def snapshot(self) -> dict[str, TimerStat]:
        return {name: TimerStat(total, int(count)) for name, (total, count) in self.totals.items()}


@dataclass(frozen=True)
class SamplerTimers:
    """Where the sampler's time went, as ML-Agents' hierarchical timers merge its workers'.

    Attributes:
        driver: timers of this process: ``policy`` (driver inference), ``env_step`` (waiting
            for the vector env), ``waiting`` (worker inference: waiting for rollouts).
        workers: per worker, in worker order: ``env_step`` and ``policy`` (worker inference),
            ``waiting`` (blocked handing rollouts over or paused); with driver inference,
            ``env_step`` from the vector env's per-worker step times.
        merged: the workers' timers summed by name.
    """

    driver: dict[str, TimerStat]
    workers: list[dict[str, TimerStat]]
    merged: dict[str, TimerStat]


@dataclass
class SamplerStats:
    """Counters of a :class:`Sampler`.

    Attributes:
        policy_version: the current policy version (0 until the first update).
        env_version: how many :meth:`Sampler.update_envs` calls have been made.
        steps_returned: transitions returned by :meth:`Sampler.sample` and
            :meth:`Sampler.sample_episodes`.
        stale_steps_dropped: transitions of an older policy version, dropped.
        stale_steps_kept: transitions of an older policy version, returned (``keep_stale``).
        env_update_steps_dropped: transitions stepped before the last env update, dropped.
        env_restarts: envs the vector env's restart policy rebuilt during worker inference.
    """

    policy_version: int = 0
    env_version: int = 0
    steps_returned: int = 0
    stale_steps_dropped: int = 0
    stale_steps_kept: int = 0
    env_update_steps_dropped: int = 0
    env_restarts: int = 0


# -- policy helpers --------------------------------------------------------------------------


def to_numpy(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: to_numpy(v) for key, v in value.items()}
    if isinstance(value, tuple):
        return tuple(to_numpy(v) for v in value)
    if hasattr(value, "detach"):  # a torch tensor
        value = value.detach().cpu().numpy()
    return np.asarray(value)


def act(policy: Policy, observations: Any) -> tuple[Any, dict[str, np.ndarray]]:
    """Run the policy: ``actions`` or ``(actions, agent_infos)`` as numpy."""
    out = policy(observations)
    if isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], dict):
        actions, agent_infos = out
        return to_numpy(actions), {key: to_numpy(v) for key, v in agent_infos.items()}
    return to_numpy(out), {}


def load_params(policy: Any, params: Any) -> None:
    """Load ``params`` into ``policy``: ``load_state_dict`` (torch), ``set_params``, or garage's
    ``set_param_values``.

    Raises:
        InvalidArgumentError: the policy has none of them.
    """
    for name in ("load_state_dict", "set_params", "set_param_values"):
        method = getattr(policy, name, None)
        if callable(method):
            method(params)
            return
    raise InvalidArgumentError(
        f"update_policy() got parameters, but the policy {policy!r} has no load_state_dict, "
        "set_params or set_param_values to load them; pass a new policy instead"
    )


def seed_policy(policy: Any, seed: int | None) -> None:
    method = getattr(policy, "seed", None)
    if callable(method):
        method(seed)


class Steps(Protocol):
    """What :func:`step_and_record` steps: a vector env, or a worker's envs (GroupEnvs)."""

    def step(self, actions: Any) -> tuple[Any, np.ndarray, np.ndarray, np.ndarray, dict[str, Any]]:
        """gymnasium's ``VectorEnv.step``."""


def step_and_record(
    venv: Steps,
    policy: Policy,
    obs: Any,
    version: int,
    log: StepLog,
    timers: Timers,
    own: Callable[[Any], Any],
) -> tuple[Any, np.ndarray]:
    """One synchronous step of every env of ``venv`` under ``policy``, recorded in ``log``
    with ``version``; returns the next observations (``own(...)`` of what ``venv.step``
    returned: the caller's, never written to again) and whether each episode ended.

    ``obs`` must be the caller's own arrays, never written to again (they are recorded
    without a copy); ``own`` is the identity where ``venv.step`` returns such arrays (a
    worker's copy of its buffers), else a copy.
    """
    with timers.time("policy"):
        actions, agent_infos = act(policy, obs)
    with timers.time("env_step"):
        next_obs, rewards, terminated, truncated, info = venv.step(actions)
    next_obs = own(next_obs)
    done = terminated | truncated
    log.add(
        obs, actions, rewards, terminated, truncated, next_obs, version, agent_infos, info, done
    )
    return next_obs, done


def policy_seed(seed: int | None, worker: int) -> int | None:
    if seed is None:
        return None
    return int(np.random.SeedSequence(seed, spawn_key=(worker,)).generate_state(1)[0])


def pick_episodes(batch: EpisodeBatch, picks: list[tuple[int, int]], start: int) -> EpisodeBatch:
    """The segments of ``picks`` (local env, k-th ended episode of that env), in that order."""
    complete = np.flatnonzero(batch.complete)
    by_env: dict[int, list[int]] = {}
    for s in complete.tolist():
        by_env.setdefault(int(batch.env_index[s]) - start, []).append(s)
    return batch.select([by_env[env][k] for env, k in picks])


# -- the two kinds of inference --------------------------------------------------------------


class Inference(abc.ABC):
    """How a :class:`envfleet.Sampler` runs its policy over its vector env.

    Args:
        venv: the vector env (``AutoresetMode.SAME_STEP``).
        stats: the sampler's counters (``policy_version`` is the current version).
        timers: the driver's timers.
        keep_stale: return steps of older policy versions (tagged) instead of dropping them.
        seed: the first reset's seed (env ``i`` gets ``seed + i``).
    """

    def __init__(
        self,
        venv: FleetVectorEnv,
        stats: SamplerStats,
        timers: Timers,
        keep_stale: bool,
        seed: int | None,
    ):
        self.venv = venv
        self.stats = stats
        self.timers = timers
        self.keep_stale = keep_stale
        self.seed = seed
        self.started = False  # the envs were reset once (with ``seed``)
        # While the sampler collects ahead (``prefetch``): the version its steps carry, that
        # of the policy copy they are chosen with, whatever update comes meanwhile.
        self.frozen_version: int | None = None

    def version(self) -> int:
        """The policy version the steps sampled now carry: the current one, or while
        collecting ahead, the one that collection began with."""
        frozen = self.frozen_version
        return self.stats.policy_version if frozen is None else frozen

    def restart_envs(self) -> None:
        """Reset every env: with ``seed`` the first time, after that continuing each env's
        random generator (an env update, whole episodes)."""
        seed = None if self.started else self.seed
        self.started = True
        self.reset(seed)

    @abc.abstractmethod
    def reset(self, seed: int | None) -> None:
        """Reset every env with ``seed`` (env ``i``: ``seed + i``; ``None``: go on)."""

    @abc.abstractmethod
    def sample(
        self, policy: Policy, num_steps: int, advance: Callable[[int], None]
    ) -> EpisodeBatch:
        """At least ``num_steps`` steps of the current version (see ``Sampler.sample``)."""

    @abc.abstractmethod
    def episodes(self, policy: Policy, n: int) -> EpisodeBatch:
        """``n`` whole episodes per worker (see ``Sampler.sample_episodes``)."""

    @property
    def wants_policy_updates(self) -> bool:
        """Whether :meth:`update_policy` needs the policy pickled (workers hold copies)."""
        return False

    def update_policy(self, update: Any) -> None:  # noqa: B027  (driver inference: nothing)
        """The policy changed (``update``: see
        :class:`envfleet._sampler.worker_inference.PolicyUpdate`)."""

    def settle(self) -> None:  # noqa: B027  (nothing in flight by default)
        """Finish what is in flight before the envs change (an env update)."""

    @abc.abstractmethod
    def worker_timers(self) -> list[dict[str, TimerStat]]:
        """Per worker, its timers (``env_step``, ``policy``)."""

    def close(self, timeout: float | None) -> None:
        """Close the vector env (bounded by ``timeout`` seconds)."""
        self.venv.close(timeout=timeout, terminate=self.venv.closed)

    def keep_current(self, batch: EpisodeBatch) -> EpisodeBatch:
        """``batch`` without the steps of older policy versions (counted), or with them
        (``keep_stale``, counted too); while collecting ahead, ``batch`` as it is (the
        sampler keeps what it returns when it is asked for it)."""
        if self.frozen_version is not None:
            return batch
        current = batch.policy_version == self.stats.policy_version
        if current.all():
            return batch
        stale = int(batch.lengths[~current].sum())
        if self.keep_stale:
            self.stats.stale_steps_kept += stale
            return batch
        self.stats.stale_steps_dropped += stale
        return batch.select(current)
