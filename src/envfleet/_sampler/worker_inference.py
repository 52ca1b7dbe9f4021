"""Worker inference (garage's MultiprocessingSampler, Sample Factory's rollout workers): each
worker of the vector env runs its own copy of the policy next to its envs.

:func:`sampler_round` is the task (``Command.TASK``, through
``FleetVectorEnv.run_in_workers_async``) that a worker runs for one round: it steps its envs
(its ``EnvGroup``, with the group's own step loop) under its policy copy, records the steps
and hands the rollout back. The policy copy and the envs' current observations stay in the
group's ``task_state`` between rounds. :class:`WorkerInference` is the driver's side: it
sends each worker what it lacks of the current policy with the round, and keeps one round in
flight between ``sample`` calls with ``background``.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import cloudpickle
import numpy as np

from envfleet._core.buffers import caller_leaves
from envfleet._core.envgroup import EnvGroup, PartialFailure
from envfleet._core.errors import ConfigError, UnsupportedError
from envfleet._core.infos import batch_infos
from envfleet._core.trees import tree_copy, tree_row, tree_write
from envfleet._front.vector_env import FleetVectorEnv
from envfleet._sampler.inference import (
    Inference,
    Policy,
    SamplerStats,
    Timers,
    TimerStat,
    act,
    load_params,
    pick_episodes,
    policy_seed,
    seed_policy,
)
from envfleet._sampler.rollout import EpisodeBatch, StepLog

__all__ = [
    "PolicyUpdate",
    "WorkerInference",
    "WorkerInferenceState",
    "sampler_round",
    "worker_snapshot",
]


# -- what the driver and the task exchange --------------------------------------------------


@dataclass
class PolicyUpdate:
    """A policy version for the workers: the policy object, or parameters for their copies."""

    version: int
    blob: bytes  # cloudpickled policy, or parameters when ``params``
    params: bool


@dataclass
class RoundRequest:
    """One round of worker inference, for one worker: its argument of :func:`sampler_round`."""

    worker: int
    steps: int  # steps per env (a rollout), or whole episodes wanted (``episodes``)
    episodes: bool
    restart: bool  # the envs were reset: start from the observations in the buffers
    env_version: int
    policy: PolicyUpdate | None  # None: go on with the worker's policy
    policy_seed: int | None  # seed of a new policy object (``seed(seed)``, when it has one)
    resume: WorkerResume | None = None  # a resumed sampler's first round: the worker's state


@dataclass
class WorkerResume:
    """A worker's part of a worker-inference snapshot (:func:`worker_snapshot`)."""

    policy: bytes | None  # its policy copy, cloudpickled with its randomness; None: it has none
    version: int  # that copy's policy version
    obs: Any  # the observations its next round acts on
    salvage: StepLog | None  # a round an env's exception cut: its steps so far
    salvage_env_version: int


@dataclass
class WorkerInferenceState:
    """What :meth:`WorkerInference.snapshot` takes: each worker's :class:`WorkerResume`, the
    policy version each worker's copy has, the policy update not yet sent, and the rollouts a
    background round collected for the next ``sample``."""

    workers: list[WorkerResume]
    version_of: list[int]
    update: PolicyUpdate | None
    carry: list[Rollout]
    worker_ranges: list[tuple[int, int]]


@dataclass
class Rollout:
    """A worker's round of ``steps`` steps per env, recorded, with its timers."""

    worker: int
    batch: EpisodeBatch
    env_version: int
    timers: dict[str, TimerStat]


@dataclass
class Episodes:
    """A worker's whole episodes (``Sampler.sample_episodes``), with its timers."""

    worker: int
    batch: EpisodeBatch
    timers: dict[str, TimerStat]


# -- the task, in each worker ----------------------------------------------------------------


STATE_KEY = "envfleet.sampler"  # the sampler's entry in the group's task_state
# The step info of an env whose episode an exception ended (it is restarted, or the sampler
# fails): as the vector env flags a restarted env.
RESTARTED_KEY = "env_restarted"
RESTARTED = {RESTARTED_KEY: True}


class GroupEnvs:
    """A worker's envs (its EnvGroup, ``AutoresetMode.SAME_STEP``) as a vector env of their
    own: SyncVectorEnv's results over those envs, but for the infos, which stay the envs' own
    (``StepLog.add_events`` records them as the vector info would give them). Each step runs
    the group's own step loop (the one a vector env step runs)."""

    def __init__(self, group: EnvGroup):
        self.group = group
        self.num_envs = group.size
        self.obs: Any = None  # the observations the next actions are chosen on
        self.failure: PartialFailure | None = None  # envs that raised in the last step

    def observations(self) -> Any:
        """A copy of the envs' current observations (the buffers' rows)."""
        return tree_copy(self.group.buffers.observations)

    def step(
        self, actions: Any
    ) -> tuple[Any, np.ndarray, np.ndarray, np.ndarray, list[tuple[int, dict[str, Any]]]]:
        """Step every env with ``actions``: (observations, a copy; rewards, terminations,
        truncations, the buffers' own; the step's info events ``(row, info)``, rows counted
        from 0, as :meth:`EnvGroup.step` returns them)."""
        group, buffers = self.group, self.group.buffers
        tree_write(buffers.actions, actions)
        # Each env gets the policy's dtype, as a vector env's step hands the caller's.
        leaves = caller_leaves(group.single_action_space, buffers.actions, actions)
        start = group.start
        try:
            events = group.step(leaves)
            self.failure = None
        except PartialFailure as failure:
            # The other envs stepped: their transitions are kept. Those that raised end their
            # episode here, truncated and flagged, as the vector env reports a restarted env;
            # their final observation is the one they acted on.
            self.failure = failure
            events = list(failure.events or ())
            for f in failure.failures:
                j = f.env_index - start
                buffers.rewards[j], buffers.terminations[j], buffers.truncations[j] = 0, 0, 1
                final = tree_row(self.obs, j)
                events.append((f.env_index, {"final_obs": final, "final_info": RESTARTED}))
            events.sort(key=lambda event: event[0])
        if start:
            events = [(i - start, info) for i, info in events]
        obs = tree_copy(buffers.observations)
        return obs, buffers.rewards, buffers.terminations, buffers.truncations, events


class WorkerState:
    """What the sampler keeps in a worker between rounds: its policy copy and its envs'
    current observations."""

    def __init__(self, group: EnvGroup):
        self.envs = GroupEnvs(group)
        self.policy: Any = None  # installed by the first round's request
        self.version = 0
        self.ids = np.arange(group.start, group.stop)
        self.obs: Any = None
        self.timers = Timers()
        # A round cut by an env's exception: its steps so far (the failing one included), and
        # the env version they belong to, returned with the next round.
        self.salvage: StepLog | None = None
        self.salvage_env_version = 0

    def resume(self, taken: WorkerResume) -> None:
        """Take over a snapshot's worker state (a resumed sampler's first round)."""
        if taken.policy is not None:
            self.policy = cloudpickle.loads(taken.policy)
        self.version = taken.version
        self.obs = taken.obs
        self.salvage, self.salvage_env_version = taken.salvage, taken.salvage_env_version

    def install(self, request: RoundRequest) -> None:
        update = request.policy
        if update is None:
            return
        value = cloudpickle.loads(update.blob)
        if update.params:
            load_params(self.policy, value)
        else:
            self.policy = value
            seed_policy(value, request.policy_seed)
        self.version = update.version

    def step(self, log: StepLog) -> np.ndarray:
        """One step of every env, recorded; returns the envs whose episode ended.

        Raises:
            PartialFailure: envs raised; the step is recorded (those envs truncated).
        """
        envs, obs, timers = self.envs, self.obs, self.timers
        envs.obs = obs
        with timers.time("policy"):
            actions, agent_infos = act(self.policy, obs)
        with timers.time("env_step"):
            after, rewards, terminated, truncated, events = envs.step(actions)
        done = terminated | truncated
        if envs.failure is None:
            log.add_events(
                obs, actions, rewards, terminated, truncated, after, self.version, agent_infos,
                events, done,
            )  # fmt: skip
        else:
            # Envs raised: an env may then have two ends in one step (its episode's, and its
            # failed autoreset's restart), which the vector info merges as it always has.
            info = batch_infos(events, envs.num_envs)
            log.add(
                obs, actions, rewards, terminated, truncated, after, self.version, agent_infos,
                info, done,
            )  # fmt: skip
        self.obs = after
        if envs.failure is not None:
            raise envs.failure
        return done

    def episodes(self, n: int) -> EpisodeBatch:
        """Step until ``n`` episodes ended; the first ``n`` to end (by step, then env index),
        whole (the envs were reset just before)."""
        log = StepLog(self.ids)
        ended: list[tuple[int, int]] = []  # (env, its k-th episode), in order of ending
        counts = np.zeros(self.envs.num_envs, dtype=np.int64)
        while len(ended) < n:
            done = self.step(log)
            for j in np.flatnonzero(done).tolist():
                ended.append((j, int(counts[j])))
                counts[j] += 1
        batch = log.build()
        assert batch is not None
        return pick_episodes(batch, ended[:n], int(self.ids[0]))


class _OneTorchThread:
    """Torch on one intra-op thread while any round runs in this process, as Sample
    Factory's rollout workers run: each group of envs is one busy thread, and the vector
    env's plan never has more groups than cores, so the policy copies never oversubscribe
    them. Rounds may run at once in one process (the threads backend, or the driver's own
    group): the first to enter sets one thread, the last to leave restores the user's count
    (the driver's group runs its rounds in the user's process)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.inside = 0
        self.before = 1

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        torch = sys.modules.get("torch")
        if torch is None:  # the policy does not use torch (or has not imported it yet)
            yield
            return
        with self.lock:
            if self.inside == 0:
                self.before = torch.get_num_threads()
                if self.before != 1:
                    torch.set_num_threads(1)
            self.inside += 1
        try:
            yield
        finally:
            with self.lock:
                self.inside -= 1
                if self.inside == 0 and self.before != 1:
                    torch.set_num_threads(self.before)


one_torch_thread = _OneTorchThread()


def sampler_round(group: EnvGroup, request: RoundRequest) -> Rollout | Episodes:
    """The task (``Command.TASK``) a worker runs for one round of worker inference: step its
    envs with its own copy of the policy (torch on one thread: :func:`one_torch_thread`),
    ``request.steps`` steps (a rollout) or until ``request.steps`` episodes ended, and return
    them recorded."""
    with one_torch_thread():
        return _round(group, request)


def worker_snapshot(group: EnvGroup, restart: bool) -> WorkerResume:
    """The task (``Command.TASK``) that takes a worker's sampler state for a snapshot: its
    policy copy (pickled as it is now, its generator included), and the observations its next
    round acts on (the buffers' rows when it restarts from them: ``restart``)."""
    state: WorkerState | None = group.task_state.get(STATE_KEY)
    if state is None or state.policy is None:
        obs = tree_copy(group.buffers.observations)
        return WorkerResume(None, -1, obs, None, 0)
    obs = state.envs.observations() if restart or state.obs is None else tree_copy(state.obs)
    blob = cloudpickle.dumps(state.policy)
    return WorkerResume(blob, state.version, obs, state.salvage, state.salvage_env_version)


def _round(group: EnvGroup, request: RoundRequest) -> Rollout | Episodes:
    state: WorkerState | None = group.task_state.get(STATE_KEY)
    if state is None or request.resume is not None:
        state = group.task_state[STATE_KEY] = WorkerState(group)
        if request.resume is not None:
            state.resume(request.resume)
    if state.policy is None and (request.policy is None or request.policy.params):
        raise RuntimeError("the sampler's policy copy in this worker is gone")
    state.install(request)
    if request.restart or state.obs is None:
        state.obs = state.envs.observations()
    if request.episodes:
        try:
            episodes = state.episodes(request.steps)
        except PartialFailure:
            state.obs = None  # the driver asks again, from a reset
            raise
        return Episodes(request.worker, episodes, state.timers.snapshot())
    log = StepLog(state.ids)
    if state.salvage is not None and state.salvage_env_version == request.env_version:
        log = state.salvage
    state.salvage = None
    try:
        for _ in range(request.steps):
            state.step(log)
    except PartialFailure:
        # Reported to the supervisor, which rebuilds the envs or gives up; the steps so far
        # come back with the next round, which starts from the envs' observations then.
        state.salvage, state.salvage_env_version = log, request.env_version
        state.obs = None
        raise
    batch = log.build()
    assert batch is not None
    return Rollout(request.worker, batch, request.env_version, state.timers.snapshot())


# -- the driver's side -----------------------------------------------------------------------


class WorkerInference(Inference):
    """The policy in each worker, next to its envs (see :class:`Inference`).

    Args:
        policy: the sampler's policy (pickled for the workers' first round).
        segment_length: steps per env in a round.
        background: keep one round in flight between :meth:`sample` calls.
        timeout: seconds a round may take (``None``: the vector env's ``step_timeout``).
    """

    def __init__(
        self,
        venv: FleetVectorEnv,
        stats: SamplerStats,
        timers: Timers,
        keep_stale: bool,
        seed: int | None,
        segment_length: int,
        background: bool,
        timeout: float | None,
    ):
        super().__init__(venv, stats, timers, keep_stale, seed)
        self.segment_length = segment_length
        self.background = background
        self.timeout = timeout
        n = len(venv.worker_ranges)
        self.timers_of: list[dict[str, TimerStat]] = [{} for _ in range(n)]
        self.version_of = [-1] * n  # the policy version each worker has
        self.update: PolicyUpdate | None = None  # the last update_policy()'s
        # Per worker: its envs were reset or rebuilt, so it starts from the buffers' rows.
        self.restart_of = [True] * n
        self.in_flight = False  # a round runs in the workers (background)
        self.carry: list[Rollout] = []  # rollouts collected before an update, for sample()
        self.resume_of: list[WorkerResume] | None = None  # a snapshot's, for the first round

    def snapshot(self) -> WorkerInferenceState:
        """The workers' sampler state, between two rounds (a background round is collected
        first, its rollouts kept for the next ``sample``).

        Raises:
            UnsupportedError: workers died each of 3 times it asked them.
        """
        self.settle()
        n = len(self.version_of)
        for _ in range(3):
            arguments = {w: self.restart_of[w] or self.version_of[w] < 0 for w in range(n)}
            self.venv.run_in_workers_async(worker_snapshot, arguments)
            results = self.venv.run_in_workers_wait(self.timeout)
            taken = [results[w] for w in range(n)]
            if all(isinstance(r, WorkerResume) for r in taken):
                break
            for w, result in enumerate(taken):
                if not isinstance(result, WorkerResume):  # rebuilt by the restart policy
                    self.version_of[w], self.restart_of[w] = -1, True
        else:
            raise UnsupportedError("Sampler.snapshot(): workers died each of 3 times it asked")
        for w, resume in enumerate(taken):
            if resume.policy is None:  # no copy: the next round sends one, as to a new worker
                self.version_of[w] = -1
        return WorkerInferenceState(
            taken, list(self.version_of), self.update, list(self.carry),
            [(int(a), int(b)) for a, b in self.venv.worker_ranges],
        )  # fmt: skip

    def resume(self, state: WorkerInferenceState) -> None:
        """Continue from ``state`` (:meth:`snapshot`): the first round hands each worker its
        policy copy and observations.

        Raises:
            ConfigError: the vector env's workers hold other envs than the snapshot's.
        """
        ranges = [(int(a), int(b)) for a, b in self.venv.worker_ranges]
        if ranges != state.worker_ranges:
            raise ConfigError(
                "a worker-inference snapshot resumes on the same workers (each holds its own "
                f"policy copy): the snapshot's hold envs {state.worker_ranges}, these {ranges}"
            )
        self.resume_of = list(state.workers)
        self.version_of = list(state.version_of)
        self.update, self.carry = state.update, list(state.carry)
        self.restart_of = [False] * len(ranges)
        self.started = True

    def reset(self, seed: int | None) -> None:
        self.venv.reset(seed=seed)
        self.restart_of = [True] * len(self.restart_of)

    @property
    def wants_policy_updates(self) -> bool:
        return True

    def update_policy(self, update: Any) -> None:
        self.update = update  # sent with the next round

    def worker_timers(self) -> list[dict[str, TimerStat]]:
        return [dict(t) for t in self.timers_of]

    def close(self, timeout: float | None) -> None:
        if self.in_flight and not self.venv.closed:
            # A background round: its rollouts are dropped with the sampler.
            with contextlib.suppress(Exception):  # going away, and so are its rollouts
                self.venv.run_in_workers_wait(5.0 if timeout is None else timeout)
        super().close(timeout)

    def requests(self, policy: Policy, steps: int, episodes: bool) -> dict[int, RoundRequest]:
        """Each worker's part of the next round, with what it lacks of the current policy."""
        version = self.version()
        update = self.update
        requests = {}
        for w, had in enumerate(self.version_of):
            sent: PolicyUpdate | None = None
            seed = None  # only a new policy object is seeded (WorkerState.install)
            if had != version:
                if update is not None and update.version == version and had == version - 1:
                    sent = update  # the update itself: parameters, or a new policy object
                else:  # a worker without the policy (the first round): a whole copy
                    sent = PolicyUpdate(version, cloudpickle.dumps(policy), False)
                seed = policy_seed(self.seed, w)
                if version and not sent.params:
                    seed = policy_seed(seed, version)
            resume = None if self.resume_of is None else self.resume_of[w]
            requests[w] = RoundRequest(
                w, steps, episodes, self.restart_of[w], self.stats.env_version, sent, seed, resume
            )
            self.version_of[w] = version
            self.restart_of[w] = False
        self.resume_of = None
        return requests

    def start_round(self, policy: Policy, steps: int, episodes: bool = False) -> None:
        if not self.started:
            self.restart_envs()
        self.venv.run_in_workers_async(sampler_round, self.requests(policy, steps, episodes))
        self.in_flight = True

    def finish_round(self) -> list[Any]:
        """The round's results, in worker order (their timers noted).

        Raises:
            EnvError, EnvCrashedError, StepTimeoutError: as the vector env's ``step``.
        """
        with self.timers.time("waiting"):
            try:
                results = self.venv.run_in_workers_wait(self.timeout)
            finally:
                self.in_flight = False
        out = []
        for w in sorted(results):
            message = results[w]
            if isinstance(message, (Rollout, Episodes)):
                self.timers_of[w] = message.timers
                out.append(message)
                continue
            # The restart policy rebuilt this worker's failed envs, or the whole worker: the
            # result is their restart's infos. A rebuilt worker lost its policy copy and its
            # round; a worker whose envs raised keeps the steps so far for the next round.
            # Either way its next round starts from the envs' observations in the buffers.
            self.version_of[w] = -1
            self.stats.env_restarts += sum(
                1 for _, info in message or () if info.get(RESTARTED_KEY)
            )
        return out

    def settle(self) -> None:
        """Collect a background round, keeping its rollouts for the next :meth:`sample`."""
        if self.in_flight:
            self.carry.extend(self.finish_round())

    def accept(self, message: Rollout, out: list[EpisodeBatch]) -> int:
        """Keep what is current of a rollout in ``out``; returns its current-version steps."""
        batch = message.batch
        if message.env_version < self.stats.env_version:
            self.stats.env_update_steps_dropped += batch.num_steps
            return 0
        kept = self.keep_current(batch)
        if kept.num_segments:
            out.append(kept)
        return int(kept.lengths[kept.policy_version == self.version()].sum())

    def sample(
        self, policy: Policy, num_steps: int, advance: Callable[[int], None]
    ) -> EpisodeBatch:
        out: list[EpisodeBatch] = []
        current = 0
        carry, self.carry = self.carry, []
        while True:
            for message in carry:
                n = self.accept(message, out)
                current += n
                advance(n)
            if current >= num_steps:
                break
            if not self.in_flight:
                self.start_round(policy, self.segment_length)
            carry = self.finish_round()
        if self.background:
            self.start_round(policy, self.segment_length)
        return EpisodeBatch.concatenate(*out)

    def episodes(self, policy: Policy, n: int) -> EpisodeBatch:
        self.settle()
        if not self.started:
            self.restart_envs()
        while True:
            self.restart_envs()  # whole episodes: every env starts a new one
            self.start_round(policy, n, episodes=True)
            episodes = self.finish_round()
            if len(episodes) == len(self.version_of):
                return EpisodeBatch.concatenate(*(message.batch for message in episodes))
            # A worker's envs were restarted: its episodes are not whole; ask every one again.
