"""``envfleet.Sampler``: rollouts with policy versions (layer 4 in docs/architecture.md).

Three ways to run the policy:

- ``inference="auto"`` (the default): both of the below over one vector env, calibrated on the
  first steps, keeping the faster (:mod:`envfleet._sampler.auto_inference`); ``Sampler.report()``
  says which and why.
- ``inference="driver"`` (ML-Agents' SubprocessEnvManager, RLlib's EnvRunner): the policy runs
  in this process on batched observations, the envs step in an envfleet vector env. With a
  first-ready pool (``batch_size < num_envs``) the policy runs on one batch while the other
  envs step, as ML-Agents' step queue hands back whichever workers are ready.
- ``inference="worker"`` (garage's MultiprocessingSampler): a picklable policy is copied into
  each worker of the vector env, which steps its envs with it and hands segments of rollouts
  back without a round trip to the driver per step.

Both run over an envfleet vector env, on any backend, with its supervision:
:mod:`envfleet._sampler.driver_inference` and :mod:`envfleet._sampler.worker_inference`
implement them.

Every step is tagged with the version of the policy that chose its action. After
:meth:`Sampler.update_policy`, steps of older versions are dropped and counted (or, with
``keep_stale=True``, returned with their tag, for off-policy learners).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import copy
import dataclasses
import logging
import math
import os
import random
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import cloudpickle
import gymnasium
import numpy as np
from gymnasium.vector import AutoresetMode
from gymnasium.vector.utils import batch_space

from envfleet._core.buffers import side_leaves
from envfleet._core.errors import (
    ClosedEnvironmentError,
    ConfigError,
    InvalidArgumentError,
    UnsupportedError,
)
from envfleet._core.replay import Snapshot
from envfleet._core.trees import tree_copy, tree_slice
from envfleet._front.make import make
from envfleet._front.multi_agent_vector_env import MultiAgentVectorEnv
from envfleet._front.options import DEFAULT_SUPERVISION, Settings, Supervision, backend_of, check
from envfleet._front.vector_env import FleetVectorEnv
from envfleet._sampler.auto_inference import (
    AutoInference,
    SamplerReport,
    per_env_step_time,
    policy_on_gpu,
    sampler_report,
)
from envfleet._sampler.driver_inference import DriverInference, PoolInference
from envfleet._sampler.inference import (
    Inference,
    Policy,
    SamplerStats,
    SamplerTimers,
    Timers,
    TimerStat,
    load_params,
)
from envfleet._sampler.multi_agent_rollout import AgentRowsPolicy, agent_batch, agent_spaces
from envfleet._sampler.rollout import EpisodeBatch
from envfleet._sampler.worker_inference import (
    PolicyUpdate,
    WorkerInference,
    WorkerInferenceState,
)
from envfleet.bounds import schedule_bound, schedule_sizes, time_policy

__all__ = ["Sampler"]

logger = logging.getLogger("envfleet")


# -- policy helpers --------------------------------------------------------------------------


def _integer(value: Any, name: str, error: type[Exception], low: int | None = 1) -> int:
    """``value`` as an int (not a bool), at least ``low``; else ``error``."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise error(f"{name} must be an integer, got {value!r}")
    if low is not None and value < low:
        raise error(f"{name} must be an integer >= {low}, got {value!r}")
    return int(value)


def _check_recordable(
    observation_space: gymnasium.Space[Any], action_space: gymnasium.Space[Any]
) -> None:
    """Raise :class:`ConfigError` for spaces with leaves without a fixed size (Text, Graph,
    ...: ``envfleet._core.buffers.side_leaves``), which episode arrays cannot record."""
    for what, space in (("observation", observation_space), ("action", action_space)):
        leaves = side_leaves(space)
        if leaves:
            raise ConfigError(
                f"the Sampler records {what}s into arrays; the {what} space {space} has "
                f"leaves without a fixed size: {leaves}; use envfleet.make directly"
            )


class _SetAttributes:
    """An env update that sets attributes (``set_wrapper_attr``): one dict for every env, or
    one dict per env (global env order)."""

    def __init__(self, values: dict[str, Any] | list[dict[str, Any]]):
        self.values = values

    def __call__(self, venv: FleetVectorEnv, first_env: int) -> None:
        if isinstance(self.values, dict):
            for name, value in self.values.items():
                venv.set_attr(name, [value] * venv.num_envs)
            return
        rows = self.values[first_env : first_env + venv.num_envs]
        for name in rows[0]:
            venv.set_attr(name, [row[name] for row in rows])


class _ApplyToEnvs:
    """An env update that calls ``fn(env)`` on every env."""

    def __init__(self, fn: Callable[[gymnasium.Env[Any, Any]], Any]):
        self.fn = fn

    def __call__(self, venv: FleetVectorEnv, first_env: int) -> None:
        venv.apply(self.fn)


# -- the sampler -----------------------------------------------------------------------------


def _no_progress(n: int) -> None:
    """The progress callback of a batch collected in the background (none is shown)."""


_GENERATORS: tuple[type, ...] = (np.random.Generator, np.random.RandomState, random.Random)


def _generators(value: Any, found: dict[int, Any], depth: int = 0) -> None:
    """The random generators among ``value``'s attributes, items and their own (a few
    levels down), by id into ``found``."""
    torch = sys.modules.get("torch")
    kinds = _GENERATORS if torch is None else (*_GENERATORS, torch.Generator)
    if isinstance(value, kinds):
        found[id(value)] = value
        return
    if depth >= 4:
        return
    if isinstance(value, dict):
        children: Any = value.values()
    elif isinstance(value, (list, tuple)):
        children = value
    else:
        children = getattr(value, "__dict__", {}).values()
    for child in children:
        if isinstance(child, (dict, list, tuple, *kinds)) or hasattr(child, "__dict__"):
            _generators(child, found, depth + 1)


def behaviour_copy(policy: Any) -> Any:
    """A copy of ``policy`` to collect ahead with (``copy.deepcopy``: its parameters as they
    are now) that shares its random generators (numpy, ``random``, torch generators among
    its attributes), so the random stream goes on from one batch to the next as without
    ``prefetch``."""
    memo: dict[int, Any] = {}
    _generators(policy, memo)
    return copy.deepcopy(policy, memo)


@dataclasses.dataclass
class SamplerSnapshot:
    """A :class:`Sampler`'s state between two ``sample`` calls (:meth:`Sampler.snapshot`).
    Picklable; ``Sampler(..., resume=state)`` continues from it.

    Attributes:
        vector_env: the vector env's :class:`envfleet.Snapshot`.
        observations: driver inference: the observations the policy acts on next
            (``[num_envs, *obs_shape]``; packed, for a PettingZoo env), or over a first-ready
            pool each env's last observation, action and the version that chose it
            (``PoolInference``); worker inference: ``None`` (each worker's are in
            ``workers``).
        stats: the sampler's counters (:class:`SamplerStats`), the policy version included.
        inference: the inference that ran: ``"driver"`` or ``"worker"``.
        seed: the sampler's ``seed`` (the seeds of policy copies sent to workers derive
            from it).
        workers: worker inference: each worker's policy copy (pickled, its generator
            included), the observations it acts on next, the policy update not yet sent, and
            a background round's rollouts; ``None`` for driver inference.
        reason: why ``inference="auto"`` chose that inference ("as asked" otherwise).
        ahead: with ``prefetch``, the batch collected ahead, which the next ``sample``
            returns first (``None`` without).
    """

    vector_env: Snapshot
    observations: Any
    stats: SamplerStats
    inference: str = "driver"
    seed: int | None = None
    workers: WorkerInferenceState | None = None
    reason: str = "as asked"
    ahead: EpisodeBatch | None = None


class Sampler:
    """Collects experience with a policy, tagged with policy versions.

    The policy is a callable on a batch of observations (``[n, *obs_shape]`` per leaf, numpy)
    returning actions (``[n, *act_shape]``, numpy or torch), or ``(actions, agent_infos)`` with
    ``agent_infos`` a dict of ``[n, ...]`` arrays kept with each step (e.g. log-probabilities
    and values for PPO).

    Multi-agent envs (a factory returning a PettingZoo ``ParallelEnv``, as
    :func:`envfleet.make` takes it): one policy shared by every agent, called on agent rows,
    SuperSuit's convention. The policy gets ``[n * A, *agent_obs_shape]`` (row ``i * A + j``:
    env ``i``, agent ``j`` of ``possible_agents``; agents not in ``env.agents`` included with
    zeroed observations) and returns ``[n * A, *agent_act_shape]`` (actions of absent agents
    are dropped). :meth:`sample` then returns one segment per agent's run of steps, each with
    its ``env_index`` and ``agent_index``: the agent's observations, actions, rewards
    (``float64``, its own), ``terminated``/``truncated`` (its own; an agent that left
    ``env.agents`` unflagged reads truncated) and its own infos. ``num_steps`` counts env
    steps (each gives one row per acting agent). Every agent needs the same observation and
    action spaces (else ``ConfigError``); :attr:`single_observation_space` and
    :attr:`single_action_space` are an agent's, :attr:`possible_agents` the env's agents
    (``None`` for a single-agent env).

    ==================  ============================================================================
    ``env``             a gymnasium id, a factory or a list of factories (as :func:`envfleet.make`)
    ``policy``          the policy (above); worker inference needs one that pickles (cloudpickle)
    ``num_envs``        sub-environments (default 1)
    ``inference``       ``"auto"`` (default: the faster here, measured), ``"driver"``, ``"worker"``
    ``seed``            env ``i`` is reset with ``seed + i`` at the start (``None``: random)
    ``keep_stale``      return steps of older policy versions (tagged) instead of dropping them
    ``segment_length``  worker inference: steps per env a worker collects before sending them
    ``background``      worker inference: keep stepping between :meth:`sample` calls
    ``prefetch``        collect the next batch while the learner updates (Sample Factory's way)
    ``progress``        a progress bar on :meth:`sample` (``None``: when stderr is a terminal)
    ``resume``          a :meth:`snapshot` to continue exactly
    ``**make_kwargs``   :func:`envfleet.make`'s: ``backend``, ``num_workers``, ``supervision``...
    ==================  ============================================================================

    Driver inference runs the policy here on every env's observations; worker inference runs a
    copy beside each worker's envs (one with a ``seed(seed)`` method is seeded per worker) for
    ``segment_length`` steps per round.
    The Sampler uses ``AutoresetMode.SAME_STEP``. ``supervision.step_timeout`` bounds a step
    of driver inference and a round of worker inference (``segment_length`` steps of a
    worker's envs with its policy calls); ``supervision.hang_report_delay`` reports either.
    With a restart policy, worker inference goes on past what it rebuilds: an env that raised
    ends its episode on that step (``truncated``, ``env_infos`` ``{"env_restarted": True}``)
    and a worker that died or hung loses the steps of its round. docs/concepts/sampler.md
    explains inference, prefetch, stale steps and snapshots.

    Raises:
        ConfigError: bad arguments, an unpicklable policy or factory for ``"worker"``.
        StartTimeoutError: the envs were not built within ``supervision.start_timeout``.

    Example::

        sampler = envfleet.Sampler("CartPole-v1", policy, 8, inference="worker", seed=0)
        batch = sampler.sample(4096)  # EpisodeBatch: observations [T, 4], rewards float64[T]
    """

    def __init__(
        self,
        env: Any,
        policy: Policy,
        num_envs: int = 1,
        *,
        inference: str = "auto",
        seed: int | None = None,
        keep_stale: bool = False,
        segment_length: int = 64,
        background: bool = False,
        prefetch: bool = False,
        progress: bool | None = None,
        resume: SamplerSnapshot | None = None,
        **make_kwargs: Any,
    ):
        if not callable(policy):
            raise ConfigError(f"policy must be callable on a batch of observations: {policy!r}")
        if inference not in ("auto", "driver", "worker"):
            raise ConfigError(f"inference must be 'auto', 'driver' or 'worker', got {inference!r}")
        num_envs = _integer(num_envs, "num_envs", ConfigError)
        segment_length = _integer(segment_length, "segment_length", ConfigError)
        if seed is not None:
            seed = _integer(seed, "seed", ConfigError, low=None)
        supervision = make_kwargs.get("supervision", DEFAULT_SUPERVISION)
        if not isinstance(supervision, Supervision):
            raise ConfigError(f"supervision must be an envfleet.Supervision, got {supervision!r}")
        batch_size = make_kwargs.get("batch_size")
        check(
            Settings(
                backend=backend_of(make_kwargs.get("backend", "processes"))[0],
                pool=batch_size not in (None, num_envs),
                autoreset_mode=AutoresetMode.SAME_STEP,  # the Sampler's
                autoreset_mode_given="autoreset_mode" in make_kwargs,
                output="numpy" if make_kwargs.get("output", "numpy") == "numpy" else "torch",
                supervision=supervision,
                sampler=True,
                inference=inference,
                prefetch=bool(prefetch),
                background=bool(background),
            )
        )
        if resume is not None:
            if not isinstance(resume, SamplerSnapshot):
                raise ConfigError(f"resume must be a Sampler.snapshot(), got {resume!r}")
            if inference not in (resume.inference, "auto"):
                raise ConfigError(
                    f"this snapshot was taken with inference={resume.inference!r}: resume it "
                    f"with inference={resume.inference!r} or 'auto'"
                )
            make_kwargs["resume"] = resume.vector_env
            seed = resume.seed
        self.inference = inference
        self.num_envs = int(num_envs)
        self.seed = None if seed is None else int(seed)
        self.keep_stale = bool(keep_stale)
        self.progress = progress
        self.stats = SamplerStats()
        self._policy = policy
        self._timers = Timers()
        self._closed = False
        self._owner_pid = os.getpid()  # a forked copy of the sampler closes nothing (close)
        self._sample_s = 0.0  # seconds spent in sample() (the report's steps/s)
        self._sampled = 0  # steps sample() returned
        self._prefetch = bool(prefetch)
        self._ahead: concurrent.futures.Future[EpisodeBatch] | None = None  # collecting ahead
        self._ahead_of: Inference | None = None  # the inference collecting it
        self._pending: EpisodeBatch | None = None  # collected ahead, for the next sample()
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        if prefetch:
            try:
                copy.deepcopy(policy)
            except Exception as exc:
                raise ConfigError(
                    f"prefetch samples with a copy of the policy (copy.deepcopy): {exc}"
                ) from exc
        why_not_worker = ""
        recycle = supervision.explicit_recycle
        if inference == "auto" and resume is not None and resume.inference == "driver":
            why_not_worker = f"resumed a snapshot of driver inference ({resume.reason})"
        if inference == "auto" and not why_not_worker:
            why_not_worker = self._why_not_worker(policy, make_kwargs.get("batch_size"))
            if not why_not_worker and recycle:
                why_not_worker = "recycle replaces workers between the vector env's steps"
            if not why_not_worker:
                make_kwargs["copy"] = False  # as worker inference needs, below
        if inference == "worker":
            try:
                cloudpickle.dumps(policy)
            except Exception as exc:
                raise ConfigError(f"inference='worker' needs a picklable policy: {exc}") from exc
            # The task reads its envs' observations from the buffers: no spare slabs.
            make_kwargs["copy"] = False
        venv = make(env, self.num_envs, autoreset_mode=AutoresetMode.SAME_STEP, **make_kwargs)
        # A PettingZoo env: the Sampler steps the packed vector env under the
        # MultiAgentVectorEnv, with the policy on agent rows
        # (envfleet._sampler.multi_agent_rollout).
        self.possible_agents: tuple[str, ...] | None = None
        if isinstance(venv, MultiAgentVectorEnv):
            self.possible_agents = venv.possible_agents
            venv = venv.vector_env
        self._venv: FleetVectorEnv = venv
        try:
            _check_recordable(venv.single_observation_space, venv.single_action_space)
            if self.possible_agents is None:
                self.single_observation_space = venv.single_observation_space
                self.single_action_space = venv.single_action_space
            else:
                spaces = agent_spaces(venv)
                self.single_observation_space, self.single_action_space = spaces
        except ConfigError:
            venv.close()
            raise
        self.worker_ranges = venv.worker_ranges
        if venv.is_pool and venv.num_envs % venv.batch_size:
            venv.close()
            raise ConfigError(
                "a Sampler over a first-ready pool needs num_envs to be a multiple of "
                f"batch_size (got {venv.num_envs} and {venv.batch_size}), so that it can "
                "drain the pool before an env update"
            )
        self._inference: Inference
        if inference == "driver":
            self._inference = DriverInference(
                venv, self.stats, self._timers, self.keep_stale, self.seed
            )
        elif inference == "auto":
            worker = None
            if not why_not_worker and len(venv.worker_ranges) < 2:
                why_not_worker = "one group of envs: no worker's policy could overlap another's"
            if not why_not_worker:
                worker = WorkerInference(
                    venv, self.stats, self._timers, self.keep_stale, self.seed,
                    int(segment_length), False, None,
                )  # fmt: skip
            self._inference = AutoInference(
                venv, self.stats, self._timers, self.keep_stale, self.seed,
                int(segment_length), worker, why_not_worker,
            )  # fmt: skip
        else:
            self._inference = WorkerInference(
                venv,
                self.stats,
                self._timers,
                self.keep_stale,
                self.seed,
                int(segment_length),
                bool(background),
                None,  # a round is bounded by the vector env's step_timeout
            )
        if resume is not None:
            try:
                self._resume(resume)
            except ConfigError:
                venv.close()
                raise

    # -- public API ------------------------------------------------------------------------

    def snapshot(self) -> SamplerSnapshot:
        """The sampler's state between two :meth:`sample` calls: ``Sampler(..., resume=state)``
        (the same env, ``num_envs`` and policy) continues exactly, its next ``sample`` the
        one this sampler's would have returned, bit for bit, for envs whose randomness lives
        in their seed and ``np_random`` (see :class:`envfleet.Snapshot`). It holds the vector
        env's :class:`envfleet.Snapshot`, the counters (:attr:`stats`, the policy version
        included) and, per inference: the observations the policy acts on next (driver), or
        each worker's policy copy, pickled with its generator, and observations (worker; a
        background round is collected first and its rollouts kept). The driver's policy and
        its parameters are the caller's to keep (``update_policy`` them into the resumed
        sampler, or give it the same policy object).

        Raises:
            UnsupportedError: before the first ``sample``; while ``inference="auto"``
                calibrates (its first ``6 * num_envs * segment_length`` steps); and as
                :meth:`envfleet.FleetVectorEnv.snapshot`.
        """
        self._check_open()
        self._join_ahead()  # its batch travels in the snapshot
        inference = self._inference
        reason = "as asked"
        if isinstance(inference, AutoInference):
            if inference.chosen is None:
                raise UnsupportedError(
                    "Sampler.snapshot() while inference='auto' calibrates (its first "
                    "6 * num_envs * segment_length steps): sample on, then take it"
                )
            reason = inference.reason
            inference = inference.active
        if not inference.started:
            raise UnsupportedError("Sampler.snapshot() before the first sample(): nothing to take")
        if isinstance(inference, WorkerInference):
            workers = inference.snapshot()  # first: it collects a background round
            return SamplerSnapshot(
                self._venv.snapshot(), None, dataclasses.replace(self.stats), "worker",
                self.seed, workers, reason, self._pending,
            )  # fmt: skip
        assert isinstance(inference, DriverInference)
        if self._venv.is_pool:  # each env's last observation, action and its version
            vector_env = self._venv.snapshot()  # first: the envs in flight finish
            observations: Any = copy.deepcopy(inference.pool_state())
        else:
            vector_env, observations = self._venv.snapshot(), tree_copy(inference.obs)
        return SamplerSnapshot(
            vector_env, observations, dataclasses.replace(self.stats), "driver", self.seed,
            None, reason, self._pending,
        )  # fmt: skip

    @property
    def policy_version(self) -> int:
        """The current policy version: 0, then one more per :meth:`update_policy`."""
        return self.stats.policy_version

    @property
    def policy(self) -> Policy:
        """The driver's copy of the policy."""
        return self._policy

    @property
    def vector_env(self) -> FleetVectorEnv:
        """The vector env the envs step in (its ``stats``, ``worker_ranges``...); for a
        multi-agent env, the packed vector env under its ``MultiAgentVectorEnv``."""
        return self._venv

    @property
    def timers(self) -> SamplerTimers:
        """Timers of the driver and of each worker, merged (see :class:`SamplerTimers`)."""
        workers = self._inference.worker_timers()
        merged: dict[str, TimerStat] = {}
        for timers in workers:
            for name, stat in timers.items():
                merged[name] = merged.get(name, TimerStat()) + stat
        return SamplerTimers(self._timers.snapshot(), workers, merged)

    def sample(self, num_steps: int) -> EpisodeBatch:
        """At least ``num_steps`` transitions of the current policy version.

        Episodes in progress go on from one call to the next: a segment cut at the end of a
        call has ``complete == False``, and the episode continues in the next call's batch.

        Returns:
            An :class:`EpisodeBatch`; with ``keep_stale``, older versions' segments too.

        Raises:
            InvalidArgumentError: ``num_steps`` is not a positive integer.
            ClosedEnvironmentError: the sampler is closed.
            EnvError, EnvCrashedError, StepTimeoutError: an env raised, a worker died, or
                nothing arrived within the timeout (the sampler is closed after the last two).
        """
        self._check_open()
        num_steps = _integer(num_steps, "num_steps", InvalidArgumentError)
        t0 = time.perf_counter()
        with self._progress(int(num_steps)) as advance:
            if self._prefetch or self._pending is not None:
                batch = self._sample_ahead(int(num_steps), advance)
            else:
                batch = self._inference.sample(self._runnable(), int(num_steps), advance)
        self._sampled += batch.num_steps  # env steps (the report's steps/s)
        batch = self._per_agent(batch)
        self._sample_s += time.perf_counter() - t0
        self.stats.steps_returned += batch.num_steps
        return batch

    def report(self, *, schedule: bool = False) -> SamplerReport:
        """How fast :meth:`sample` ran, against the overlap bound, and which inference ran
        and why (see :class:`SamplerReport`).

        The times come from the sampler's timers (:attr:`timers`): ``T_p`` is the policy's
        time on all ``num_envs`` observations where the driver ran it (driver inference, or
        the calibration of ``"auto"``), ``t_env`` the workers' env step time per env.

        Args:
            schedule: also give the schedule bound (:func:`envfleet.bounds.schedule_bound`):
                a copy of the policy (``copy.deepcopy``, its generators its own) is timed
                here on ``N``, ``N/2``, ``N/4``... rows (down to a worker per core) of
                observations drawn from the observation space, about 0.1 s per size, with
                the global generators of ``random``, ``numpy`` and torch's CPU put back
                after, so the run's random streams are untouched. Needs an env step time
                (``t_env``: the workers' timers, or the vector env's step times); without it
                the schedule fields stay empty.

        Example::

            sampler.sample(10_000)
            print(sampler.report(schedule=True))  # inference: worker (...), schedule bound ...
        """
        inference = self._inference
        if isinstance(inference, AutoInference):
            mode, choice = inference.mode, inference.reason
            if inference.chosen is None:
                choice = "calibrating"
            calibration = inference.measured
        else:
            mode, choice, calibration = self.inference, "as asked", {}
        timers = self.timers
        # T_p on all num_envs rows: where the driver ran the policy on whole batches.
        policy = timers.driver.get("policy")
        full = policy is not None and policy.count and not self._venv.is_pool
        t_policy = policy.mean_s if full and policy is not None else float("nan")
        # Each env's step time from the vector env's own step times (driver inference).
        stats = self._venv.stats
        steps = ((s.mean_s * s.count, s.count) for s in stats.workers)
        report = sampler_report(
            mode, choice, self._sampled, self._sample_s, timers, self.worker_ranges,
            self.num_envs, t_policy, calibration,
            per_env_step_time(steps, self.worker_ranges), stats.env_kind,
        )  # fmt: skip
        if schedule and math.isfinite(report.t_env_s):
            curve = self._policy_curve(report.cores)
            best, structure = schedule_bound(self.num_envs, curve, report.t_env_s, report.cores)
            report = report.with_schedule_bound(curve, best, structure)
        return report

    def _policy_curve(self, cores: int) -> dict[int, float]:
        """``T_p(n)`` at :func:`envfleet.bounds.schedule_sizes`, timed on a copy of the policy
        (see :meth:`report`)."""
        space = batch_space(self._venv.single_observation_space, self.num_envs)
        space.seed(0)
        observations = space.sample()
        policy = copy.deepcopy(self._runnable())
        states = random.getstate(), np.random.get_state()
        torch = sys.modules.get("torch")
        torch_state = torch.get_rng_state() if torch is not None else None
        try:
            return {
                n: time_policy(policy, tree_slice(observations, 0, n), 0.1)
                for n in schedule_sizes(self.num_envs, cores)
            }
        finally:
            random.setstate(states[0])
            np.random.set_state(states[1])
            if torch is not None:
                torch.set_rng_state(torch_state)

    def sample_episodes(self, n_per_worker: int) -> EpisodeBatch:
        """Exactly ``n_per_worker`` whole episodes from each worker, in worker order (garage's
        ``obtain_exact_episodes``), all of the current policy version.

        Within a worker, episodes come in the order they ended (ties by env index). Worker
        inference resets the workers' envs first; driver inference resets them too (a
        first-ready pool instead skips each env's episode in progress). The episodes that end
        first are taken, so short episodes are favoured when a worker holds several envs.

        Raises:
            InvalidArgumentError: ``n_per_worker`` is not a positive integer.
            EnvError, EnvCrashedError, StepTimeoutError: as :meth:`sample`.
        """
        self._check_open()
        n_per_worker = _integer(n_per_worker, "n_per_worker", InvalidArgumentError)
        self._join_ahead()  # what was collected ahead stays for the next sample()
        batch = self._per_agent(self._inference.episodes(self._runnable(), int(n_per_worker)))
        self.stats.steps_returned += batch.num_steps
        return batch

    def update_policy(self, policy_or_params: Any = None) -> int:
        """Install a new policy, or new parameters, and bump the policy version.

        Args:
            policy_or_params: a callable: the new policy. ``None``: the policy object given
                before was changed in place (e.g. by an optimizer); workers get a fresh copy
                of it. Anything else: parameters, loaded with the policy's
                ``load_state_dict`` (torch), ``set_params`` or ``set_param_values`` (garage),
                here and in every worker.

        Returns:
            The new policy version. Steps chosen by older versions are dropped from now on
            (or kept with their tag, with ``keep_stale``).

        Raises:
            InvalidArgumentError: parameters for a policy that cannot load them, or a policy
                that does not pickle for the workers (nothing is sent).
        """
        self._check_open()
        params = policy_or_params is not None and not callable(policy_or_params)
        if params:
            load_params(self._policy, policy_or_params)
        elif policy_or_params is not None:
            self._policy = policy_or_params
        version = self.stats.policy_version + 1
        if self._inference.wants_policy_updates:
            value = policy_or_params if params else self._runnable()
            try:
                blob = cloudpickle.dumps(value)
            except Exception as exc:
                raise InvalidArgumentError(f"the policy update does not pickle: {exc}") from exc
            self._inference.update_policy(PolicyUpdate(version, blob, params))
        self.stats.policy_version = version
        return version

    def update_envs(self, update: Any) -> int:
        """Change the envs, inside their workers, before the next batch (garage's env_update,
        ML-Agents' reset parameters): e.g. a task parameter for a curriculum.

        Args:
            update: ``fn(env)``, called on every sub-environment (cloudpickled; it may be a
                lambda); or a dict ``{attribute: value}`` set on every env
                (``set_wrapper_attr``); or a list of ``num_envs`` such dicts, one per env
                (same keys).

        Every env is then reset (continuing its random generator): episodes in progress are
        dropped, and no step taken before the update appears in a later batch.

        Returns:
            The env version (the number of updates so far).

        Raises:
            InvalidArgumentError: an update of another kind, a list of the wrong length or
                with different keys, or one that does not pickle (nothing is sent).
            EnvError: the update raised in an env.
        """
        self._check_open()
        apply = self._env_update(update)
        version = self.stats.env_version + 1
        self._join_ahead()
        if self._pending is not None:  # stepped before the update: dropped
            self.stats.env_update_steps_dropped += self._pending.num_steps
            self._pending = None
        self._inference.settle()
        apply(self._venv, 0)
        self.stats.env_version = version
        self._inference.restart_envs()
        return version

    def close(self, timeout: float | None = None) -> None:
        """Close the envs and stop the workers (bounded by ``timeout`` seconds, default 5)."""
        if self._closed:
            return
        self._closed = True
        if os.getpid() != self._owner_pid:
            return  # a forked copy: the workers are the maker's, which keeps using them
        if self._ahead is not None:  # what it collects goes with the sampler
            with contextlib.suppress(Exception):
                self._ahead.result(timeout=5.0 if timeout is None else timeout)
        if self._executor is not None:
            self._executor.shutdown(wait=False)
        self._inference.close(timeout)

    def __enter__(self) -> Sampler:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            with contextlib.suppress(Exception):
                self.close(timeout=1.0)

    def __repr__(self) -> str:
        return (
            f"Sampler(inference={self.inference!r}, num_envs={self.num_envs}, "
            f"policy_version={self.policy_version})"
        )

    # -- helpers ---------------------------------------------------------------------------

    def _sample_ahead(self, num_steps: int, advance: Callable[[int], None]) -> EpisodeBatch:
        """``sample`` with ``prefetch`` (or a snapshot's batch collected ahead): what was
        collected ahead (its steps one version behind kept, older ones as ``keep_stale``
        says), topped up with the current policy, then with ``prefetch`` the next batch
        begun in the background."""
        self._join_ahead()
        out: list[EpisodeBatch] = []
        got = 0
        if self._pending is not None:
            ahead, self._pending = self._keep_ahead(self._pending), None
            out.append(ahead)
            got = ahead.num_steps
            advance(got)
        if got < num_steps:
            out.append(self._inference.sample(self._runnable(), num_steps - got, advance))
        batch = EpisodeBatch.concatenate(*out)
        if self._prefetch:
            self._start_ahead(num_steps)
        return batch

    def _keep_ahead(self, batch: EpisodeBatch) -> EpisodeBatch:
        """Steps collected ahead: those of the current version and of the one before it are
        returned (the latter counted as stale, kept); older ones per ``keep_stale``."""
        version = self.stats.policy_version
        recent = batch.policy_version >= version - 1
        stale = batch.policy_version < version
        self.stats.stale_steps_kept += int(batch.lengths[stale & recent].sum())
        if recent.all() or self.keep_stale:
            self.stats.stale_steps_kept += int(batch.lengths[~recent].sum())
            return batch
        self.stats.stale_steps_dropped += int(batch.lengths[~recent].sum())
        return batch.select(recent)

    def _start_ahead(self, num_steps: int) -> None:
        """Begin collecting the next ``num_steps`` in the background, with a copy of the
        policy as it is now (its version frozen on the inference that samples)."""
        inference = self._inference
        if isinstance(inference, AutoInference):
            if inference.chosen is None:
                return  # calibrating: sample() steps in the foreground
            inference = inference.active
        policy = behaviour_copy(self._runnable())
        inference.frozen_version = self.stats.policy_version
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="envfleet-prefetch"
            )
        self._ahead_of = inference
        self._ahead = self._executor.submit(inference.sample, policy, num_steps, _no_progress)

    def _join_ahead(self) -> None:
        """Wait for the batch collected ahead, if any (kept for the next ``sample``).

        Raises:
            EnvError, EnvCrashedError, StepTimeoutError: as :meth:`sample`, from the envs
                while collecting ahead.
        """
        ahead, inference = self._ahead, self._ahead_of
        if ahead is None or inference is None:
            return
        self._ahead = self._ahead_of = None
        try:
            self._pending = ahead.result()
        finally:
            inference.frozen_version = None

    def _resume(self, state: SamplerSnapshot) -> None:
        """Continue ``state`` (the vector env was made with its ``Snapshot``): the inference's
        state and the counters."""
        inference = self._inference
        if isinstance(inference, AutoInference):
            # Calibrated before: run what the snapshot's sampler ran.
            active = inference.worker if state.inference == "worker" else inference.driver
            if active is None:
                raise ConfigError(
                    f"this snapshot ran worker inference, which cannot run here: {inference.reason}"
                )
            inference.pieces, inference.chosen = [], state.inference
            inference.reason = f"resumed a snapshot ({state.reason})"
            inference.active, inference.started = active, True
            inference = active
        if state.inference == "worker":
            assert isinstance(inference, WorkerInference) and state.workers is not None
            inference.resume(state.workers)
        else:
            assert isinstance(inference, DriverInference)
            if self._venv.is_pool != isinstance(state.observations, PoolInference):
                raise ConfigError(
                    "a Sampler's snapshot over a first-ready pool resumes over a pool "
                    "(batch_size), and one over a synchronous vector env over one"
                )
            if isinstance(state.observations, PoolInference):
                inference.restore_pool(state.observations)
            else:
                inference.obs = state.observations
            inference.started = True
        for name, value in vars(state.stats).items():
            setattr(self.stats, name, value)
        self._pending = state.ahead

    def _runnable(self) -> Policy:
        """The policy as the inference runs it: over agent rows for a multi-agent env."""
        if self.possible_agents is None:
            return self._policy
        return AgentRowsPolicy(self._policy, len(self.possible_agents))

    def _per_agent(self, batch: EpisodeBatch) -> EpisodeBatch:
        """``batch`` in per-agent segments for a multi-agent env; else as it is."""
        if self.possible_agents is None:
            return batch
        return agent_batch(batch, self.possible_agents)

    @staticmethod
    def _why_not_worker(policy: Policy, batch_size: Any) -> str:
        """Why ``"auto"`` may not run worker inference ("" when it may)."""
        if batch_size is not None:
            return "a first-ready pool (batch_size) runs driver inference"
        if policy_on_gpu(policy):
            return "the policy has parameters on a GPU: it runs in the driver"
        try:
            cloudpickle.dumps(policy)
        except Exception as exc:
            return f"the policy does not pickle for the workers ({type(exc).__name__})"
        return ""

    def _check_open(self) -> None:
        if self._closed or self._venv.closed:
            raise ClosedEnvironmentError("Trying to use a Sampler after close().")

    def _env_update(self, update: Any) -> Callable[[FleetVectorEnv, int], None]:
        if callable(update):
            return _ApplyToEnvs(update)
        if isinstance(update, dict):
            if not all(isinstance(key, str) for key in update):
                raise InvalidArgumentError("update_envs(): attribute names must be strings")
            return _SetAttributes(dict(update))
        if isinstance(update, (list, tuple)):
            rows = list(update)
            if len(rows) != self.num_envs or not all(isinstance(r, dict) for r in rows):
                raise InvalidArgumentError(
                    f"update_envs(): a list needs {self.num_envs} dicts, one per env"
                )
            if any(set(r) != set(rows[0]) for r in rows) or not rows[0]:
                raise InvalidArgumentError("update_envs(): every dict needs the same keys")
            return _SetAttributes(rows)
        raise InvalidArgumentError(
            "update_envs() takes fn(env), a dict of attributes, or a list of such dicts; "
            f"got {type(update).__name__}"
        )

    @contextlib.contextmanager
    def _progress(self, total: int) -> Iterator[Callable[[int], None]]:
        show = self.progress
        if show is None:
            show = total >= 10_000 and sys.stderr.isatty()
        if not show:
            yield lambda n: None
            return
        from rich.progress import Progress

        with Progress(transient=True) as bar:
            task = bar.add_task(f"sampling (policy v{self.policy_version})", total=total)
            yield lambda n: bar.advance(task, n)
