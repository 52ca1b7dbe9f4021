"""Driver inference (ML-Agents' SubprocessEnvManager, RLlib's EnvRunner): the policy runs in
this process on batched observations; the envs step in the vector env, synchronously or as a
first-ready pool whose envs step while the policy runs on the batch that came back.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from gymnasium.vector.utils import create_empty_array

from envfleet._core.trees import tree_copy, tree_rows, tree_scatter
from envfleet._front.vector_env import FleetVectorEnv
from envfleet._sampler.inference import (
    Inference,
    Policy,
    SamplerStats,
    Timers,
    TimerStat,
    act,
    pick_episodes,
    step_and_record,
)
from envfleet._sampler.rollout import (
    EpisodeBatch,
    Recorder,
    StepLog,
    final_observations,
    step_infos,
)

__all__ = ["DriverInference", "PoolInference"]


@dataclass
class PoolInference:
    """Driver inference's state over a first-ready pool, per env: the observation its last
    action was chosen on, that action, its agent infos and the version that chose it (-1:
    none, the env was reset)."""

    observations: Any
    actions: Any
    agent_infos: dict[str, np.ndarray]
    action_version: np.ndarray


class DriverInference(Inference):
    """The policy here, the envs in the vector env (see :class:`Inference`)."""

    def __init__(
        self,
        venv: FleetVectorEnv,
        stats: SamplerStats,
        timers: Timers,
        keep_stale: bool,
        seed: int | None,
    ):
        super().__init__(venv, stats, timers, keep_stale, seed)
        n = venv.num_envs
        # Without ``copy``, the vector env hands back views of its buffers, which its next
        # step overwrites: the observations an action was chosen on are kept as a copy.
        self.own: Callable[[Any], Any] = (lambda obs: obs) if venv.copy else tree_copy
        self.ids = np.arange(n)
        self.obs: Any = None
        # A pool's envs in flight: the observation and action sent to each, the agent infos
        # that came with the action, and the policy version that chose it (-1: none).
        self.pool_obs: Any = None
        self.pool_actions: Any = None
        self.pool_agent_infos: dict[str, np.ndarray] = {}
        self.action_version = np.full(n, -1, dtype=np.int64)

    def reset(self, seed: int | None) -> None:
        if self.venv.is_pool:
            self.venv.async_reset(seed=seed)
            self.action_version[:] = -1
        else:
            self.obs = self.own(self.venv.reset(seed=seed)[0])

    def sample(
        self, policy: Policy, num_steps: int, advance: Callable[[int], None]
    ) -> EpisodeBatch:
        if not self.started:
            self.restart_envs()
        recorder = self.new_log()
        current = 0
        while current < num_steps:
            _, versions, _ = self.step(policy, recorder)
            n = int(np.count_nonzero(versions == self.version()))
            current += n
            advance(n)
        batch = recorder.build()
        assert batch is not None
        return self.keep_current(batch)

    def new_log(self) -> Recorder | StepLog:
        """What :meth:`step` records into: a pool's envs come in any order (a
        :class:`Recorder`), a synchronous vector env's all together (a :class:`StepLog`)."""
        return Recorder() if self.venv.is_pool else StepLog(self.ids)

    def step(
        self, policy: Policy, recorder: Recorder | StepLog
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """One step (synchronous: into a :class:`StepLog`) or one recv and send (pool: into a
        :class:`Recorder`), recorded.

        Returns:
            (the envs of the recorded steps, their policy versions, whether their episode
            ended).
        """
        venv = self.venv
        version = self.version()
        if not venv.is_pool:
            assert isinstance(recorder, StepLog)
            try:
                self.obs, done = step_and_record(
                    venv, policy, self.obs, version, recorder, self.timers, self.own
                )
            except KeyboardInterrupt as exc:
                # Ctrl-C: the vector env completed the step (envfleet._backends.rounds); its
                # transition is dropped with this sample, the next acts on its observations.
                completed = getattr(exc, "_envfleet_step", None)
                if completed is not None:
                    self.obs = self.own(completed[0])
                raise
            return self.ids, np.full(venv.num_envs, version), done
        assert isinstance(recorder, Recorder)
        with self.timers.time("env_step"):
            next_obs, rewards, terminated, truncated, info = venv.recv()
        ids = info["env_id"].astype(np.int64)
        done = terminated | truncated
        acted = np.flatnonzero(self.action_version[ids] >= 0)  # else: a reset's result
        rows = ids[acted]
        versions = self.action_version[rows]
        if rows.size:
            infos = step_infos(info, ids, done)
            recorder.add(
                rows,
                tree_rows(self.pool_obs, rows),
                tree_rows(self.pool_actions, rows),
                rewards[acted],
                terminated[acted],
                truncated[acted],
                tree_rows(final_observations(next_obs, info, done), acted),
                versions,
                {key: value[rows] for key, value in self.pool_agent_infos.items()},
                [infos[k] for k in acted.tolist()],
            )
        with self.timers.time("policy"):
            actions, agent_infos = act(policy, next_obs)
        self._remember(ids, next_obs, actions, agent_infos)
        with self.timers.time("env_step"):
            venv.send(actions, ids)
        self.action_version[ids] = version
        return rows, versions, done[acted]

    def _remember(
        self, ids: np.ndarray, obs: Any, actions: Any, agent_infos: dict[str, np.ndarray]
    ) -> None:
        """Keep, per env, the observation and action sent (their transition comes later)."""
        venv, n = self.venv, self.venv.num_envs
        if self.pool_obs is None:
            self.pool_obs = create_empty_array(venv.single_observation_space, n)
            self.pool_actions = create_empty_array(venv.single_action_space, n)
        tree_scatter(self.pool_obs, ids, obs)
        tree_scatter(self.pool_actions, ids, actions)
        for key, value in agent_infos.items():
            if key not in self.pool_agent_infos:
                self.pool_agent_infos[key] = np.zeros((n, *value.shape[1:]), dtype=value.dtype)
            self.pool_agent_infos[key][ids] = value

    def pool_state(self) -> PoolInference:
        """Over a pool: each env's last observation and action, the version that chose the
        action (-1: none) and its agent infos (for a snapshot)."""
        return PoolInference(
            self.pool_obs, self.pool_actions, dict(self.pool_agent_infos), self.action_version
        )

    def restore_pool(self, state: PoolInference) -> None:
        """Take over a snapshot's :meth:`pool_state`."""
        self.pool_obs, self.pool_actions = state.observations, state.actions
        self.pool_agent_infos = dict(state.agent_infos)
        self.action_version = np.array(state.action_version, dtype=np.int64)

    def settle(self) -> None:
        """Pool: receive every env in flight (their steps are dropped), so that all are idle."""
        venv = self.venv
        if not venv.is_pool or not self.started:
            return
        for _ in range(venv.num_envs // venv.batch_size):
            _, _, _, _, info = venv.recv()
            dropped = int(np.count_nonzero(self.action_version[info["env_id"]] >= 0))
            self.stats.env_update_steps_dropped += dropped
        self.action_version[:] = -1

    def episodes(self, policy: Policy, n: int) -> EpisodeBatch:
        venv = self.venv
        if not venv.is_pool:
            self.started = True
            self.obs = self.own(venv.reset()[0])
            whole = np.ones(venv.num_envs, dtype=np.bool_)
        else:
            if not self.started:
                self.restart_envs()
            whole = self.action_version < 0  # envs that just reset: their next episode is whole
        recorder = self.new_log()
        ranges = venv.worker_ranges
        worker_of = np.repeat(np.arange(len(ranges)), [b - a for a, b in ranges])
        counts = np.zeros(venv.num_envs, dtype=np.int64)  # episodes each env ended
        picked: list[list[tuple[int, int]]] = [[] for _ in ranges]
        while any(len(p) < n for p in picked):
            rows, _, done = self.step(policy, recorder)
            for e in rows[done].tolist():
                if whole[e] and len(picked[worker_of[e]]) < n:
                    picked[worker_of[e]].append((e, int(counts[e])))
                counts[e] += 1
                whole[e] = True
        batch = recorder.build()
        assert batch is not None
        return pick_episodes(batch, [pick for worker in picked for pick in worker], 0)

    def worker_timers(self) -> list[dict[str, TimerStat]]:
        """Per worker, ``env_step`` from the vector env's per-worker step times."""
        if self.venv.closed:
            return []
        return [
            {"env_step": TimerStat(s.count * s.mean_s if s.count else 0.0, s.count)}
            for s in self.venv.stats.workers
        ]
