"""Tiny PettingZoo ParallelEnvs for the multi-agent tests (``tests/integration/
test_multi_agent.py``), importable from worker processes as ``tests.multi_agent_envs``.

:class:`HeteroEnv`: a real ``pettingzoo.ParallelEnv`` whose two agents differ in both their
observation and action spaces, deterministic given its seed, where one agent leaves early (MPE2's
``simple_world_comm_v3``, also tested, has agents with different spaces that never leave).
"""

from __future__ import annotations

from typing import Any

import gymnasium
import numpy as np
from pettingzoo import ParallelEnv

__all__ = ["FaultyEnv", "HeteroEnv", "SwarmEnv", "make_faulty"]

_OBS = {
    "scout": gymnasium.spaces.Box(0.0, 1.0, (3,), np.float32),
    "tank": gymnasium.spaces.Box(-5.0, 5.0, (2, 2), np.float64),
}
_ACT = {
    "scout": gymnasium.spaces.Discrete(4),
    "tank": gymnasium.spaces.Box(-1.0, 1.0, (2,), np.float32),
}


class HeteroEnv(ParallelEnv):
    """Two agents with different spaces: ``scout`` (Box(3) float32 observations, Discrete(4)
    actions) leaves with ``terminated`` after a random number of steps; ``tank`` (Box(2, 2)
    float64, Box(2) actions) stays until the episode's ``max_cycles``, then is truncated.
    Each agent's info carries its step count and a value drawn from the env's generator."""

    metadata = {"name": "hetero_v0", "render_modes": []}

    def __init__(self, max_cycles: int = 7):
        self.possible_agents = ["scout", "tank"]
        self.agents: list[str] = []
        self.max_cycles = max_cycles
        self.rng = np.random.default_rng()

    def observation_space(self, agent: str) -> gymnasium.Space[Any]:
        return _OBS[agent]

    def action_space(self, agent: str) -> gymnasium.Space[Any]:
        return _ACT[agent]

    def _observe(self, agent: str) -> np.ndarray:
        space = _OBS[agent]
        return self.rng.uniform(space.low, space.high).astype(space.dtype)

    def reset(self, seed: int | None = None, options: dict[str, Any] | None = None) -> Any:
        if seed is not None:
            self.rng = np.random.default_rng(seed)
        self.agents = list(self.possible_agents)
        self.steps = 0
        self.scout_leaves = int(self.rng.integers(1, self.max_cycles + 2))
        observations = {agent: self._observe(agent) for agent in self.agents}
        return observations, {agent: {"start": self.scout_leaves} for agent in self.agents}

    def step(self, actions: dict[str, Any]) -> Any:
        self.steps += 1
        observations, rewards, terminations, truncations, infos = {}, {}, {}, {}, {}
        for agent in self.agents:
            action = actions[agent]
            if agent == "scout":
                rewards[agent] = float(action) * 0.25 + self.rng.normal()
                terminations[agent] = self.steps >= self.scout_leaves
                truncations[agent] = False
            else:
                rewards[agent] = float(np.sum(action)) - 0.5
                terminations[agent] = False
                truncations[agent] = self.steps >= self.max_cycles
            observations[agent] = self._observe(agent)
            infos[agent] = {"steps": self.steps, "draw": self.rng.random()}
        self.agents = [a for a in self.agents if not (terminations[a] or truncations[a])]
        return observations, rewards, terminations, truncations, infos


class SwarmEnv(ParallelEnv):
    """Agents that join and leave: four drones with one shared space (Box(3) float32
    observations, Discrete(3) actions). Two start; an absent drone joins with probability 0.3
    per step (again after it left: the same name re-enters ``env.agents``); a present one
    leaves with ``terminated`` with probability 0.15. The episode is truncated for every
    drone present at ``max_cycles``, and ends early when none is left. Deterministic given
    its seed."""

    metadata = {"name": "swarm_v0", "render_modes": []}
    space = gymnasium.spaces.Box(-1.0, 1.0, (3,), np.float32)

    def __init__(self, max_cycles: int = 12):
        self.possible_agents = [f"drone_{k}" for k in range(4)]
        self.agents: list[str] = []
        self.max_cycles = max_cycles
        self.rng = np.random.default_rng()

    def observation_space(self, agent: str) -> gymnasium.Space[Any]:
        return self.space

    def action_space(self, agent: str) -> gymnasium.Space[Any]:
        return gymnasium.spaces.Discrete(3)

    def _observe(self) -> np.ndarray:
        return self.rng.uniform(-1.0, 1.0, 3).astype(np.float32)

    def reset(self, seed: int | None = None, options: dict[str, Any] | None = None) -> Any:
        if seed is not None:
            self.rng = np.random.default_rng(seed)
        self.agents = self.possible_agents[:2]
        self.steps = 0
        return {a: self._observe() for a in self.agents}, {a: {} for a in self.agents}

    def step(self, actions: dict[str, Any]) -> Any:
        self.steps += 1
        observations, rewards, terminations, truncations, infos = {}, {}, {}, {}, {}
        for agent in self.agents:
            rewards[agent] = float(actions[agent]) - 1.0 + self.rng.normal()
            terminations[agent] = bool(self.rng.random() < 0.15)
            truncations[agent] = self.steps >= self.max_cycles
            observations[agent] = self._observe()
            infos[agent] = {"steps": self.steps}
        staying = [a for a in self.agents if not (terminations[a] or truncations[a])]
        if staying and self.steps < self.max_cycles:
            for agent in self.possible_agents:
                if agent not in self.agents and self.rng.random() < 0.3:
                    staying.append(agent)  # joins: its first observation comes now
                    observations[agent] = self._observe()
                    infos[agent] = {"joined": self.steps}
        self.agents = [a for a in self.possible_agents if a in staying]
        return observations, rewards, terminations, truncations, infos


class FaultyEnv(HeteroEnv):
    """:class:`HeteroEnv` that misbehaves at step ``at`` of its first episode: ``"raise"``
    raises ``RuntimeError``, ``"ghost"`` returns an observation for an agent outside
    ``possible_agents``."""

    def __init__(self, fault: str, at: int = 2):
        super().__init__(max_cycles=50)
        self.fault, self.at, self.episodes = fault, at, 0

    def reset(self, seed: int | None = None, options: dict[str, Any] | None = None) -> Any:
        self.episodes += 1
        return super().reset(seed=seed, options=options)

    def step(self, actions: dict[str, Any]) -> Any:
        result = super().step(actions)
        if self.episodes == 1 and self.steps == self.at:
            if self.fault == "raise":
                raise RuntimeError("faulty env: boom")
            result[0]["ghost"] = np.zeros(3, np.float32)
        return result


def make_faulty(fault: str, faulty_index: int, env_index: int) -> ParallelEnv:
    """Env ``env_index``: a :class:`FaultyEnv` for ``faulty_index``, else a long
    :class:`HeteroEnv` (its scout leaves, its tank stays)."""
    return FaultyEnv(fault) if env_index == faulty_index else HeteroEnv(max_cycles=50)
