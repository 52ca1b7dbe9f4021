"""``envfleet.Sampler``: rollouts with policy versions (DESIGN §2, layer 6).

Two ways to run the policy:

- ``inference="driver"`` (ML-Agents' SubprocessEnvManager, RLlib's EnvRunner): the policy runs
  in this process on batched observations, the envs step in an envfleet vector env. With a
  first-ready pool (``batch_size < num_envs``) the policy runs on one batch while the other
  envs step, as ML-Agents' step queue hands back whichever workers are ready.
- ``inference="worker"`` (garage's MultiprocessingSampler): a picklable policy is copied into
  worker processes, which step their envs and stream segments of rollouts back without a
  round trip to the driver per step.

Every step is tagged with the version of the policy that chose its action. After
:meth:`Sampler.update_policy`, steps of older versions are dropped and counted (or, with
``keep_stale=True``, returned with their tag, for off-policy learners).
"""

from __future__ import annotations

import collections
import contextlib
import enum
import logging
import multiprocessing
import numbers
import os
import queue
import signal
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

import cloudpickle
import gymnasium
import numpy as np
from gymnasium.vector import AutoresetMode
from gymnasium.vector.utils import create_empty_array

from envfleet._backends.base import (
    accepts_env_index,
    bind_env_index,
    remote_env_error,
    worker_ranges,
)
from envfleet._backends.processes import _die_with_parent, _remote_error
from envfleet._backends.registry import usable_cores
from envfleet._buffers import side_leaves, tree_scatter
from envfleet._errors import (
    ClosedEnvironmentError,
    ConfigError,
    EnvCrashedError,
    EnvError,
    InvalidArgumentError,
    StepTimeoutError,
    describe_exitcode,
)
from envfleet._front.factories import env_factories
from envfleet._front.make import make
from envfleet._front.vector_env import FleetVectorEnv
from envfleet._protocol import RemoteError
from envfleet._rollout import EpisodeBatch, Recorder, final_observations, step_infos, tree_rows

__all__ = ["Sampler", "SamplerStats", "SamplerTimers", "TimerStat"]

logger = logging.getLogger("envfleet")

Policy = Callable[[Any], Any]


# -- timers ----------------------------------------------------------------------------------


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


class _Timers:
    """Named stopwatches: ``with timers.time("policy"): ...`` adds to ``policy``."""

    def __init__(self) -> None:
        self.totals: dict[str, list[float]] = {}

    @contextlib.contextmanager
    def time(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            entry = self.totals.setdefault(name, [0.0, 0])
            entry[0] += time.perf_counter() - t0
            entry[1] += 1

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
    """

    policy_version: int = 0
    env_version: int = 0
    steps_returned: int = 0
    stale_steps_dropped: int = 0
    stale_steps_kept: int = 0
    env_update_steps_dropped: int = 0


# -- messages between the driver and sampler workers -----------------------------------------


class SamplerCommand(enum.Enum):
    """What the driver asks a sampler worker."""

    RUN = 1  # step and stream rollouts
    PAUSE = 2  # stop stepping (keep the envs' state)
    UPDATE_POLICY = 3  # payload: _PolicyUpdate
    UPDATE_ENVS = 4  # payload: _EnvUpdate
    EPISODES = 5  # payload: episodes to collect (int)
    CLOSE = 6


@dataclass
class _Control:
    command: SamplerCommand
    payload: Any = None


@dataclass
class _PolicyUpdate:
    version: int
    blob: bytes  # cloudpickled policy, or parameters when ``params``
    params: bool


@dataclass
class _EnvUpdate:
    version: int
    blob: bytes  # cloudpickled fn(vector_env) that applies the update


@dataclass
class _Ready:
    worker: int
    observation_space: gymnasium.Space[Any]
    action_space: gymnasium.Space[Any]


@dataclass
class _Rollout:
    worker: int
    batch: EpisodeBatch
    env_version: int
    timers: dict[str, TimerStat]


@dataclass
class _Episodes:
    worker: int
    batch: EpisodeBatch
    timers: dict[str, TimerStat]


@dataclass
class _WorkerFailed:
    worker: int
    error: RemoteError


@dataclass
class _WorkerSpec:
    worker: int
    start: int
    env_fns: bytes  # cloudpickled list of factories (global env_index bound in the worker)
    policy: bytes
    policy_version: int
    seeds: list[int | None]
    policy_seed: int | None
    segment_length: int
    parent_pid: int
    start_method: str


# -- policy helpers --------------------------------------------------------------------------


def _integer(value: Any, name: str, error: type[Exception], low: int | None = 1) -> int:
    """``value`` as an int (not a bool), at least ``low``; else ``error``."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise error(f"{name} must be an integer, got {value!r}")
    if low is not None and value < low:
        raise error(f"{name} must be an integer >= {low}, got {value!r}")
    return int(value)


def _to_numpy(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: _to_numpy(v) for key, v in value.items()}
    if isinstance(value, tuple):
        return tuple(_to_numpy(v) for v in value)
    if hasattr(value, "detach"):  # a torch tensor
        value = value.detach().cpu().numpy()
    return np.asarray(value)


def _check_recordable(
    observation_space: gymnasium.Space[Any], action_space: gymnasium.Space[Any]
) -> None:
    """Raise :class:`ConfigError` for spaces with leaves without a fixed size (Text, Graph,
    ...: ``envfleet._buffers.side_leaves``), which episode arrays cannot record."""
    for what, space in (("observation", observation_space), ("action", action_space)):
        leaves = side_leaves(space)
        if leaves:
            raise ConfigError(
                f"the Sampler records {what}s into arrays; the {what} space {space} has "
                f"leaves without a fixed size: {leaves}; use envfleet.make directly"
            )


def _act(policy: Policy, observations: Any) -> tuple[Any, dict[str, np.ndarray]]:
    """Run the policy: ``actions`` or ``(actions, agent_infos)`` as numpy."""
    out = policy(observations)
    if isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], dict):
        actions, agent_infos = out
        return _to_numpy(actions), {key: _to_numpy(v) for key, v in agent_infos.items()}
    return _to_numpy(out), {}


def _load_params(policy: Any, params: Any) -> None:
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


def _seed_policy(policy: Any, seed: int | None) -> None:
    method = getattr(policy, "seed", None)
    if callable(method):
        method(seed)


def _policy_seed(seed: int | None, worker: int) -> int | None:
    if seed is None:
        return None
    return int(np.random.SeedSequence(seed, spawn_key=(worker,)).generate_state(1)[0])


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


def _step_and_record(
    venv: FleetVectorEnv,
    policy: Policy,
    obs: Any,
    ids: np.ndarray,
    version: int,
    recorder: Recorder,
    timers: _Timers,
) -> tuple[Any, np.ndarray]:
    """One synchronous step of every env of ``venv`` (envs ``ids``) under ``policy``, recorded
    with ``version``; returns the next observations and whether each episode ended."""
    with timers.time("policy"):
        actions, agent_infos = _act(policy, obs)
    with timers.time("env_step"):
        next_obs, rewards, terminated, truncated, info = venv.step(actions)
    done = terminated | truncated
    recorder.add(
        ids,
        obs,
        actions,
        rewards,
        terminated,
        truncated,
        final_observations(next_obs, info, done),
        np.full(len(ids), version),
        agent_infos,
        step_infos(info, ids, done),
    )
    return next_obs, done


# -- the sampler worker (worker inference) ---------------------------------------------------


class _ZeroArg:
    """A factory called with no arguments (it hides any ``env_index`` parameter)."""

    def __init__(self, fn: Callable[[], gymnasium.Env[Any, Any]]):
        self.fn = fn

    def __call__(self) -> gymnasium.Env[Any, Any]:
        return self.fn()


def _worker_main(spec: _WorkerSpec, conn: Connection, control: Any) -> None:
    _die_with_parent(spec.parent_pid, spec.start_method)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the driver's to handle
    try:
        _Worker(spec, conn, control).serve()
    except (EOFError, BrokenPipeError, ConnectionResetError):
        pass  # the driver is gone
    finally:
        conn.close()


class _Worker:
    def __init__(self, spec: _WorkerSpec, conn: Connection, control: Any):
        self.spec = spec
        self.conn = conn
        self.control = control
        self.timers = _Timers()
        self.recorder = Recorder()
        self.policy_version = spec.policy_version
        self.env_version = 0
        self.steps_in_chunk = 0
        self.venv: FleetVectorEnv | None = None

    def fail(self, exc: BaseException, method: str) -> None:
        cause = exc.__cause__ if isinstance(exc, EnvError) and exc.__cause__ else exc
        # The worker's vector env counts its envs from 0: report the global index.
        env_index = self.spec.start + (exc.env_index if isinstance(exc, EnvError) else 0)
        method = exc.method if isinstance(exc, EnvError) else method
        self.conn.send(_WorkerFailed(self.spec.worker, _remote_error(cause, env_index, method)))

    def serve(self) -> None:
        spec = self.spec
        try:
            fns = cloudpickle.loads(spec.env_fns)
            # Bound to their global index, behind a zero-argument callable (make() must not
            # bind the local index again).
            bound = [
                _ZeroArg(bind_env_index(fn, spec.start + j, accepts_env_index(fn)))
                for j, fn in enumerate(fns)
            ]
            self.venv = make(
                bound, len(bound), backend="serial", autoreset_mode=AutoresetMode.SAME_STEP
            )
            self.policy = cloudpickle.loads(spec.policy)
            _seed_policy(self.policy, spec.policy_seed)
            self.obs, _ = self.venv.reset(seed=spec.seeds)
        except Exception as exc:
            self.fail(exc, "make")
            return
        venv = self.venv
        self.ids = np.arange(spec.start, spec.start + venv.num_envs)
        self.conn.send(_Ready(spec.worker, venv.single_observation_space, venv.single_action_space))
        running = False
        try:
            while True:
                try:
                    if running:
                        message = self.control.get_nowait()
                    else:
                        with self.timers.time("waiting"):
                            message = self.control.get(timeout=1.0)
                except queue.Empty:
                    if running:
                        try:
                            self.step(self.recorder)
                        except Exception as exc:
                            self.fail(exc, "step")
                            return
                        if self.steps_in_chunk >= spec.segment_length:
                            self.flush()
                    elif os.getppid() != spec.parent_pid:
                        return  # the driver is gone
                    continue
                command = message.command
                try:
                    if command is SamplerCommand.CLOSE:
                        return
                    if command is SamplerCommand.RUN:
                        running = True
                    elif command is SamplerCommand.PAUSE:
                        running = False
                    elif command is SamplerCommand.UPDATE_POLICY:
                        self.flush()
                        self.update_policy(message.payload)
                    elif command is SamplerCommand.UPDATE_ENVS:
                        self.flush()
                        update: _EnvUpdate = message.payload
                        cloudpickle.loads(update.blob)(venv, spec.start)
                        self.obs, _ = venv.reset()
                        self.env_version = update.version
                    elif command is SamplerCommand.EPISODES:
                        self.flush()
                        running = False
                        self.episodes(int(message.payload))
                except Exception as exc:
                    self.fail(exc, command.name.lower())
                    return
        finally:
            venv.close()

    def update_policy(self, update: _PolicyUpdate) -> None:
        value = cloudpickle.loads(update.blob)
        if update.params:
            _load_params(self.policy, value)
        else:
            self.policy = value
            _seed_policy(self.policy, _policy_seed(self.spec.policy_seed, update.version))
        self.policy_version = update.version

    def step(self, recorder: Recorder) -> np.ndarray:
        """One step of every env, recorded; returns the envs whose episode ended."""
        venv = self.venv
        assert venv is not None
        self.obs, done = _step_and_record(
            venv, self.policy, self.obs, self.ids, self.policy_version, recorder, self.timers
        )
        self.steps_in_chunk += 1
        return done

    def flush(self) -> None:
        """Send the steps recorded so far as one rollout."""
        self.steps_in_chunk = 0
        batch = self.recorder.build()
        if batch is not None:
            with self.timers.time("waiting"):
                self.conn.send(
                    _Rollout(self.spec.worker, batch, self.env_version, self.timers.snapshot())
                )

    def episodes(self, n: int) -> None:
        """Reset every env and step until ``n`` episodes ended; send the first ``n`` to end
        (by step, then env index), whole."""
        venv = self.venv
        assert venv is not None
        self.obs, _ = venv.reset()
        recorder = Recorder()
        ended: list[tuple[int, int]] = []  # (env, its k-th episode), in order of ending
        counts = np.zeros(venv.num_envs, dtype=np.int64)
        while len(ended) < n:
            done = self.step(recorder)
            for j in np.flatnonzero(done).tolist():
                ended.append((j, int(counts[j])))
                counts[j] += 1
        self.steps_in_chunk = 0
        batch = recorder.build()
        assert batch is not None
        self.conn.send(
            _Episodes(
                self.spec.worker,
                _pick_episodes(batch, ended[:n], self.spec.start),
                self.timers.snapshot(),
            )
        )


def _pick_episodes(batch: EpisodeBatch, picks: list[tuple[int, int]], start: int) -> EpisodeBatch:
    """The segments of ``picks`` (local env, k-th ended episode of that env), in that order."""
    complete = np.flatnonzero(batch.complete)
    by_env: dict[int, list[int]] = {}
    for s in complete.tolist():
        by_env.setdefault(int(batch.env_index[s]) - start, []).append(s)
    return batch.select([by_env[env][k] for env, k in picks])


# -- the sampler -----------------------------------------------------------------------------


class Sampler:
    """Collects experience with a policy, tagged with policy versions.

    The policy is a callable on a batch of observations (``[n, *obs_shape]`` per leaf, numpy)
    returning actions (``[n, *act_shape]``, numpy or torch), or ``(actions, agent_infos)`` with
    ``agent_infos`` a dict of ``[n, ...]`` arrays kept with each step (e.g. log-probabilities
    and values for PPO).

    Args:
        env: a gymnasium id, a zero-argument factory, or a list of factories (as
            :func:`envfleet.make`).
        policy: the policy (see above). With ``inference="worker"`` it must pickle
            (cloudpickle); each worker gets its own copy, and a policy with a ``seed(seed)``
            method is seeded per worker (from ``seed``) so that their randomness differs.
        num_envs: number of sub-environments.
        inference: ``"driver"``: the policy runs here, the envs in an envfleet vector env
            (``backend``, ``batch_size``, ``num_workers``... via ``make_kwargs``).
            ``"worker"``: the policy runs in ``num_workers`` sampler processes that stream
            rollouts of ``segment_length`` steps per env.
        num_workers: workers (vector-env workers for ``"driver"``, sampler processes for
            ``"worker"``; default ``min(num_envs, usable cores)`` for ``"worker"``).
        seed: env ``i`` is reset with ``seed + i`` at the start (``None``: random).
        keep_stale: ``False``: steps of an older policy version are dropped and counted in
            :attr:`stats`. ``True``: they are returned with their ``policy_version`` tag (they
            do not count towards ``num_steps``).
        segment_length: ``"worker"``: steps per env a worker gathers before sending them.
        background: ``"worker"``: keep stepping between :meth:`sample` calls (bounded by the
            pipe: a worker waits when the driver does not read), as asynchronous actors do;
            default ``False``: the workers step only during sampling.
        progress: a progress bar (rich) on :meth:`sample`: ``None``: when stderr is a
            terminal and ``num_steps >= 10_000``; ``True``/``False``: always/never.
        env_kwargs, context: as :func:`envfleet.make`.
        timeout: ``"worker"``: seconds to wait for any worker message before
            :class:`envfleet.StepTimeoutError`; ``None``: no bound. ``"driver"``: pass
            ``step_timeout`` in ``make_kwargs``.
        make_kwargs: ``"driver"``: more arguments for :func:`envfleet.make` (``backend``,
            ``batch_size``, ``step_timeout``, ``restart_policy``, ``copy``...). The sampler
            uses ``AutoresetMode.SAME_STEP``. A first-ready pool needs ``num_envs`` to be a
            multiple of ``batch_size``.

    Raises:
        ConfigError: bad arguments, an unpicklable policy or factory for ``"worker"``.
    """

    def __init__(
        self,
        env: Any,
        policy: Policy,
        num_envs: int = 1,
        *,
        inference: str = "driver",
        num_workers: int | None = None,
        seed: int | None = None,
        keep_stale: bool = False,
        segment_length: int = 64,
        background: bool = False,
        progress: bool | None = None,
        env_kwargs: dict[str, Any] | None = None,
        context: str | None = None,
        timeout: float | None = None,
        **make_kwargs: Any,
    ):
        if not callable(policy):
            raise ConfigError(f"policy must be callable on a batch of observations: {policy!r}")
        if inference not in ("driver", "worker"):
            raise ConfigError(f"inference must be 'driver' or 'worker', got {inference!r}")
        num_envs = _integer(num_envs, "num_envs", ConfigError)
        segment_length = _integer(segment_length, "segment_length", ConfigError)
        if seed is not None:
            seed = _integer(seed, "seed", ConfigError, low=None)
        if timeout is not None and not (isinstance(timeout, numbers.Real) and timeout > 0):
            raise ConfigError(f"timeout must be None or seconds > 0, got {timeout!r}")
        if "autoreset_mode" in make_kwargs:
            raise ConfigError("the Sampler sets autoreset_mode itself (SAME_STEP)")
        self.inference = inference
        self.num_envs = int(num_envs)
        self.seed = None if seed is None else int(seed)
        self.keep_stale = bool(keep_stale)
        self.progress = progress
        self.stats = SamplerStats()
        self._policy = policy
        self._timers = _Timers()
        self._closed = False
        self._owner_pid = os.getpid()  # a forked copy of the sampler closes nothing (close)
        self._venv: FleetVectorEnv | None = None
        self._procs: list[Any] = []
        self._conns: list[Connection] = []
        self._controls: list[Any] = []
        self._worker_timers: list[dict[str, TimerStat]] = []
        self._carry: list[_Rollout] = []
        self._inbox: collections.deque[Any] = collections.deque()  # read, not yet handled
        self._running = False
        self._background = bool(background)
        self._timeout = None if timeout is None else float(timeout)
        if inference == "driver":
            if background:
                raise ConfigError("background is an option of inference='worker'")
            self._venv = make(
                env,
                self.num_envs,
                num_workers=num_workers,
                autoreset_mode=AutoresetMode.SAME_STEP,
                env_kwargs=env_kwargs,
                context=context,
                **make_kwargs,
            )
            venv = self._venv
            self.single_observation_space = venv.single_observation_space
            self.single_action_space = venv.single_action_space
            try:
                _check_recordable(venv.single_observation_space, venv.single_action_space)
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
            self._envs_started = False
            self._obs: Any = None
            self._pool_obs: Any = None
            self._pool_actions: Any = None
            self._pool_agent_infos: dict[str, np.ndarray] = {}
            self._action_version = np.full(self.num_envs, -1, dtype=np.int64)
            self._action_env_version = np.zeros(self.num_envs, dtype=np.int64)
        else:
            if make_kwargs:
                raise ConfigError(
                    f"{sorted(make_kwargs)} are options of inference='driver' (envfleet.make)"
                )
            self._start_workers(env, env_kwargs, num_workers, context, int(segment_length))

    # -- public API ------------------------------------------------------------------------

    @property
    def policy_version(self) -> int:
        """The current policy version: 0, then one more per :meth:`update_policy`."""
        return self.stats.policy_version

    @property
    def policy(self) -> Policy:
        """The driver's copy of the policy."""
        return self._policy

    @property
    def vector_env(self) -> FleetVectorEnv | None:
        """``inference="driver"``: the vector env the envs step in."""
        return self._venv

    @property
    def timers(self) -> SamplerTimers:
        """Timers of the driver and of each worker, merged (see :class:`SamplerTimers`)."""
        if self._venv is not None and not self._venv.closed:
            workers = [
                {"env_step": TimerStat(s.count * s.mean_s if s.count else 0.0, s.count)}
                for s in self._venv.stats.workers
            ]
        else:
            workers = [dict(t) for t in self._worker_timers]
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
        with self._progress(int(num_steps)) as advance:
            if self._venv is not None:
                batch = self._sample_driver(int(num_steps), advance)
            else:
                batch = self._sample_workers(int(num_steps), advance)
        self.stats.steps_returned += batch.num_steps
        return batch

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
        if self._venv is not None:
            batch = self._episodes_driver(int(n_per_worker))
        else:
            batch = self._episodes_workers(int(n_per_worker))
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
            _load_params(self._policy, policy_or_params)
        elif policy_or_params is not None:
            self._policy = policy_or_params
        version = self.stats.policy_version + 1
        if self._venv is None:
            value = policy_or_params if params else self._policy
            try:
                blob = cloudpickle.dumps(value)
            except Exception as exc:
                raise InvalidArgumentError(f"the policy update does not pickle: {exc}") from exc
            self._broadcast(
                _Control(SamplerCommand.UPDATE_POLICY, _PolicyUpdate(version, blob, params))
            )
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
        if self._venv is not None:
            self._drain_pool()
            apply(self._venv, 0)
            self.stats.env_version = version
            self._restart_driver_envs()
        else:
            try:
                blob = cloudpickle.dumps(apply)
            except Exception as exc:
                raise InvalidArgumentError(f"the env update does not pickle: {exc}") from exc
            self._broadcast(_Control(SamplerCommand.UPDATE_ENVS, _EnvUpdate(version, blob)))
            self.stats.env_version = version
        return version

    def close(self, timeout: float | None = None) -> None:
        """Close the envs and stop the workers (bounded by ``timeout`` seconds, default 5)."""
        if self._closed:
            return
        self._closed = True
        if os.getpid() != self._owner_pid:
            return  # a forked copy: the workers are the maker's, which keeps using them
        if self._venv is not None:
            self._venv.close(timeout=timeout)
            return
        for control in self._controls:
            with contextlib.suppress(Exception):
                control.put(_Control(SamplerCommand.CLOSE))
        deadline = time.monotonic() + (5.0 if timeout is None else timeout)
        for proc in self._procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
                proc.join(1.0)
        for control in self._controls:
            control.cancel_join_thread()
            control.close()
        for conn in self._conns:
            conn.close()

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

    # -- driver inference ------------------------------------------------------------------

    def _restart_driver_envs(self) -> None:
        """Reset every env (at the start, with ``seed``; after an env update)."""
        venv = self._venv
        assert venv is not None
        seed = None if self._envs_started else self.seed
        self._envs_started = True
        if venv.is_pool:
            venv.async_reset(seed=seed)
            self._action_version[:] = -1
        else:
            self._obs, _ = venv.reset(seed=seed)

    def _sample_driver(self, num_steps: int, advance: Callable[[int], None]) -> EpisodeBatch:
        if not self._envs_started:
            self._restart_driver_envs()
        recorder = Recorder()
        current = 0
        while current < num_steps:
            _, versions, _ = self._driver_step(recorder)
            n = int(np.count_nonzero(versions == self.stats.policy_version))
            current += n
            advance(n)
        batch = recorder.build()
        assert batch is not None
        return self._keep_current(batch)

    def _driver_step(self, recorder: Recorder) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """One step (synchronous) or one recv and send (pool), recorded.

        Returns:
            (the envs of the recorded steps, their policy versions, whether their episode
            ended).
        """
        venv = self._venv
        assert venv is not None
        version = self.stats.policy_version
        if not venv.is_pool:
            ids = np.arange(self.num_envs)
            self._obs, done = _step_and_record(
                venv, self._policy, self._obs, ids, version, recorder, self._timers
            )
            return ids, np.full(self.num_envs, version), done
        with self._timers.time("env_step"):
            next_obs, rewards, terminated, truncated, info = venv.recv()
        ids = info["env_id"].astype(np.int64)
        done = terminated | truncated
        acted = np.flatnonzero(self._action_version[ids] >= 0)  # else: a reset's result
        rows = ids[acted]
        versions = self._action_version[rows]
        if rows.size:
            infos = step_infos(info, ids, done)
            recorder.add(
                rows,
                tree_rows(self._pool_obs, rows),
                tree_rows(self._pool_actions, rows),
                rewards[acted],
                terminated[acted],
                truncated[acted],
                tree_rows(final_observations(next_obs, info, done), acted),
                versions,
                {key: value[rows] for key, value in self._pool_agent_infos.items()},
                [infos[k] for k in acted.tolist()],
            )
        with self._timers.time("policy"):
            actions, agent_infos = _act(self._policy, next_obs)
        self._remember_pool(ids, next_obs, actions, agent_infos)
        with self._timers.time("env_step"):
            venv.send(actions, ids)
        self._action_version[ids] = version
        return rows, versions, done[acted]

    def _remember_pool(
        self, ids: np.ndarray, obs: Any, actions: Any, agent_infos: dict[str, np.ndarray]
    ) -> None:
        """Keep, per env, the observation and action sent (their transition comes later)."""
        venv = self._venv
        assert venv is not None
        if self._pool_obs is None:
            self._pool_obs = create_empty_array(venv.single_observation_space, self.num_envs)
            self._pool_actions = create_empty_array(venv.single_action_space, self.num_envs)
        tree_scatter(self._pool_obs, ids, obs)
        tree_scatter(self._pool_actions, ids, actions)
        for key, value in agent_infos.items():
            if key not in self._pool_agent_infos:
                self._pool_agent_infos[key] = np.zeros(
                    (self.num_envs, *value.shape[1:]), dtype=value.dtype
                )
            self._pool_agent_infos[key][ids] = value

    def _drain_pool(self) -> None:
        """Pool: receive every env in flight (their steps are dropped), so that all are idle."""
        venv = self._venv
        assert venv is not None
        if not venv.is_pool or not self._envs_started:
            return
        for _ in range(venv.num_envs // venv.batch_size):
            _, _, _, _, info = venv.recv()
            dropped = int(np.count_nonzero(self._action_version[info["env_id"]] >= 0))
            self.stats.env_update_steps_dropped += dropped
        self._action_version[:] = -1

    def _episodes_driver(self, n: int) -> EpisodeBatch:
        venv = self._venv
        assert venv is not None
        if not venv.is_pool:
            self._envs_started = True
            self._obs, _ = venv.reset()
            whole = np.ones(self.num_envs, dtype=np.bool_)
        else:
            if not self._envs_started:
                self._restart_driver_envs()
            whole = self._action_version < 0  # envs that just reset: their next episode is whole
        recorder = Recorder()
        worker_of = np.repeat(
            np.arange(len(self.worker_ranges)), [b - a for a, b in self.worker_ranges]
        )
        counts = np.zeros(self.num_envs, dtype=np.int64)  # episodes each env ended
        picked: list[list[tuple[int, int]]] = [[] for _ in self.worker_ranges]
        while any(len(p) < n for p in picked):
            rows, _, done = self._driver_step(recorder)
            for e in rows[done].tolist():
                if whole[e] and len(picked[worker_of[e]]) < n:
                    picked[worker_of[e]].append((e, int(counts[e])))
                counts[e] += 1
                whole[e] = True
        batch = recorder.build()
        assert batch is not None
        return _pick_episodes(batch, [pick for worker in picked for pick in worker], 0)

    # -- worker inference ------------------------------------------------------------------

    def _start_workers(
        self,
        env: Any,
        env_kwargs: dict[str, Any] | None,
        num_workers: int | None,
        context: str | None,
        segment_length: int,
    ) -> None:
        env_fns, default = env_factories(env, env_kwargs)
        if len(env_fns) == 1:
            env_fns = env_fns * self.num_envs
        elif len(env_fns) != self.num_envs:
            raise ConfigError(f"got {len(env_fns)} env factories for num_envs={self.num_envs}")
        if num_workers is None:
            num_workers = min(self.num_envs, usable_cores())
        num_workers = _integer(num_workers, "num_workers", ConfigError)
        if num_workers > self.num_envs:
            raise ConfigError(f"num_workers must be an integer in [1, {self.num_envs}]")
        try:
            policy_blob = cloudpickle.dumps(self._policy)
        except Exception as exc:
            raise ConfigError(f"inference='worker' needs a picklable policy: {exc}") from exc
        if context is not None and context not in multiprocessing.get_all_start_methods():
            raise ConfigError(f"context={context!r} is not a start method here")
        ctx: Any = multiprocessing.get_context(context)
        self.worker_ranges = tuple(worker_ranges(self.num_envs, int(num_workers)))
        try:
            for w, (start, stop) in enumerate(self.worker_ranges):
                try:
                    fns_blob = cloudpickle.dumps(list(env_fns[start:stop]))
                except Exception as exc:
                    raise ConfigError(f"the env factories do not pickle: {exc}") from exc
                spec = _WorkerSpec(
                    worker=w,
                    start=start,
                    env_fns=fns_blob,
                    policy=policy_blob,
                    policy_version=0,
                    seeds=[
                        None if self.seed is None else self.seed + i for i in range(start, stop)
                    ],
                    policy_seed=_policy_seed(self.seed, w),
                    segment_length=segment_length,
                    parent_pid=os.getpid(),
                    start_method=ctx.get_start_method(),
                )
                parent_conn, child_conn = ctx.Pipe(duplex=False)
                control = ctx.Queue()
                proc = ctx.Process(
                    target=_worker_main,
                    args=(spec, child_conn, control),
                    name=f"envfleet-sampler-{w}",
                    daemon=True,
                )
                proc.start()
                child_conn.close()
                self._procs.append(proc)
                self._conns.append(parent_conn)
                self._controls.append(control)
                self._worker_timers.append({})
            ready = 0
            while ready < len(self._procs):
                message = self._receive(None)
                if isinstance(message, _Ready):
                    ready += 1
                    self.single_observation_space = message.observation_space
                    self.single_action_space = message.action_space
                    _check_recordable(message.observation_space, message.action_space)
        except BaseException:
            self.close(timeout=1.0)
            raise

    def _broadcast(self, message: _Control) -> None:
        for control in self._controls:
            control.put(message)

    def _receive(self, timeout: float | None) -> Any:
        """The next message of any worker; workers with messages waiting are read in turn.

        Raises:
            EnvError: a worker's env raised (the sampler is closed).
            EnvCrashedError: a worker died (the sampler is closed).
            StepTimeoutError: nothing came within ``timeout`` seconds (the sampler is closed).
        """
        while not self._inbox:
            by_conn = {conn: w for w, conn in enumerate(self._conns)}
            by_sentinel = {proc.sentinel: w for w, proc in enumerate(self._procs)}
            ready = wait([*self._conns, *by_sentinel], timeout)
            if not ready:
                assert timeout is not None
                self.close(timeout=1.0)
                raise StepTimeoutError(
                    f"no sampler worker sent anything within {timeout} s; workers closed",
                    list(range(self.num_envs)),
                    timeout,
                )
            dead = []
            for r in ready:
                if r in by_conn:
                    try:
                        self._inbox.append(r.recv())
                    except (EOFError, OSError):
                        dead.append(by_conn[r])
                else:
                    dead.append(by_sentinel[r])
            failed = [m for m in self._inbox if isinstance(m, _WorkerFailed)]
            if failed:
                error = remote_env_error(failed[0].error, failed[0].worker, "sampler closed")
                self.close(timeout=1.0)
                raise error
            if dead and not self._inbox:
                self._crashed(min(dead))
        message = self._inbox.popleft()
        if isinstance(message, (_Rollout, _Episodes)):
            self._worker_timers[message.worker] = message.timers
        return message

    def _crashed(self, w: int) -> None:
        proc = self._procs[w]
        proc.join(1.0)
        start, stop = self.worker_ranges[w]
        self.close(timeout=1.0)
        raise EnvCrashedError(
            f"sampler worker {w} (sub-environments {start}..{stop - 1}) died: "
            f"{describe_exitcode(proc.exitcode)}",
            env_indices=list(range(start, stop)),
            worker_index=w,
            exitcode=proc.exitcode,
            step=self.stats.steps_returned,
        )

    def _accept(self, message: _Rollout, out: list[EpisodeBatch]) -> int:
        """Keep what is current of a rollout in ``out``; returns its current-version steps."""
        batch = message.batch
        if message.env_version < self.stats.env_version:
            self.stats.env_update_steps_dropped += batch.num_steps
            return 0
        kept = self._keep_current(batch)
        if kept.num_segments:
            out.append(kept)
        return int(kept.lengths[kept.policy_version == self.stats.policy_version].sum())

    def _keep_current(self, batch: EpisodeBatch) -> EpisodeBatch:
        current = batch.policy_version == self.stats.policy_version
        if current.all():
            return batch
        stale = int(batch.lengths[~current].sum())
        if self.keep_stale:
            self.stats.stale_steps_kept += stale
            return batch
        self.stats.stale_steps_dropped += stale
        return batch.select(current)

    def _sample_workers(self, num_steps: int, advance: Callable[[int], None]) -> EpisodeBatch:
        out: list[EpisodeBatch] = []
        current = 0
        carry, self._carry = self._carry, []
        for message in carry:
            n = self._accept(message, out)
            current += n
            advance(n)
        if current < num_steps and not self._running:
            self._broadcast(_Control(SamplerCommand.RUN))
            self._running = True
        while current < num_steps:
            with self._timers.time("waiting"):
                message = self._receive(self._timeout)
            if isinstance(message, _Rollout):
                n = self._accept(message, out)
                current += n
                advance(n)
        if not self._background:
            self._broadcast(_Control(SamplerCommand.PAUSE))
            self._running = False
        return EpisodeBatch.concatenate(*out)

    def _episodes_workers(self, n: int) -> EpisodeBatch:
        self._broadcast(_Control(SamplerCommand.EPISODES, n))
        self._running = False
        episodes: dict[int, EpisodeBatch] = {}
        while len(episodes) < len(self._procs):
            with self._timers.time("waiting"):
                message = self._receive(self._timeout)
            if isinstance(message, _Episodes):
                episodes[message.worker] = message.batch
            elif isinstance(message, _Rollout):
                self._carry.append(message)  # streamed before the request: for sample()
        return EpisodeBatch.concatenate(*(episodes[w] for w in sorted(episodes)))

    # -- helpers ---------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed or (self._venv is not None and self._venv.closed):
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
