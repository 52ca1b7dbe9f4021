"""Agents as envs: the rows of :class:`envfleet.adapters.sb3.SB3VecEnv` over a multi-agent
vector env (imports no stable-baselines3).

:class:`AgentRows` turns what :class:`envfleet.MultiAgentVectorEnv` returns (``[N, A, ...]``,
agents in ``possible_agents`` order) into stable-baselines3's per-env convention with one row
per agent, SuperSuit's layout (``pettingzoo_env_to_vec_env_v1`` + ``concat_vec_envs_v1``):
``N * A`` rows, row ``i * A + j`` = env ``i``, agent ``j``. The semantics, and where each comes
from, are in :class:`envfleet.adapters.sb3.SB3VecEnv`'s docstring.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import gymnasium
import numpy as np

from envfleet._core.errors import InvalidActionError
from envfleet._core.infos import split_infos
from envfleet._core.trees import tree_copy, tree_map, tree_row
from envfleet._front.multi_agent import shared_agent_space

__all__ = ["AgentRows"]


_SB3_ROWS = "SB3VecEnv presents agents as envs (SuperSuit's layout: one row per agent)"
_SB3_REMEDY = (
    "Pad them to one space (SuperSuit's pad_observations_v0 / pad_action_space_v0) or use "
    "envfleet.make, whose MultiAgentVectorEnv keys different spaces by agent"
)


class AgentRows:
    """The row layout of ``N`` envs of ``A`` agents: row ``i * A + j`` is env ``i``, agent ``j``.

    Args:
        num_envs: ``N``.
        possible_agents: the agents, in ``possible_agents`` order (``A`` of them).
        observation_spaces, action_spaces: each agent's space (env 0's).

    Raises:
        ConfigError: the agents do not share one observation space and one action space.
    """

    def __init__(
        self,
        num_envs: int,
        possible_agents: Sequence[str],
        observation_spaces: dict[str, gymnasium.Space[Any]],
        action_spaces: dict[str, gymnasium.Space[Any]],
    ):
        self.num_envs = num_envs
        self.agents = tuple(possible_agents)
        self.num_agents = len(self.agents)
        self.num_rows = num_envs * self.num_agents
        self.observation_space = shared_agent_space(
            observation_spaces, "observation", _SB3_ROWS, _SB3_REMEDY
        )
        self.action_space = shared_agent_space(action_spaces, "action", _SB3_ROWS, _SB3_REMEDY)

    def env_of(self, row: int) -> int:
        """The env of ``row``."""
        return row // self.num_agents

    def per_env(self, row_values: Sequence[Any]) -> list[Any]:
        """Each env's value of per-row values (seeds, options): its first row's."""
        return [row_values[i * self.num_agents] for i in range(self.num_envs)]

    def row_seeds(self, seed: int) -> list[int]:
        """Row ``i * A + j`` gets ``seed + i``: env ``i`` is reset with ``seed + i``, as
        SuperSuit's ``ConcatVecEnv.reset(seed)`` seeds its ``i``-th ParallelEnv."""
        return [seed + self.env_of(row) for row in range(self.num_rows)]

    def actions(self, actions: Any) -> np.ndarray:
        """``[N * A, *shape]`` actions as the vector env's ``[N, A, *shape]``.

        Raises:
            InvalidActionError: not ``N * A`` rows of the agents' action shape.
        """
        array = np.asarray(actions)
        shape = tuple(self.action_space.shape or ())
        if array.shape != (self.num_rows, *shape):
            raise InvalidActionError(
                f"expected actions of shape {(self.num_rows, *shape)} (num_envs * num_agents "
                f"rows of the agents' action shape), got {array.shape}"
            )
        return array.reshape(self.num_envs, self.num_agents, *shape)

    def observations(self, obs: Any) -> Any:
        """``[N, A, *shape]`` observations as fresh ``[N * A, *shape]`` arrays."""
        return tree_map(lambda x: x.reshape(self.num_rows, *x.shape[2:]).copy(), obs)

    def agent_infos(self, infos: dict[str, Any]) -> list[dict[str, Any]]:
        """Each row's agent info: ``infos[agent]`` of its env, ``{}`` where the env has none."""
        per_env = split_infos(infos, self.num_envs, skip=("final_obs", "agent_mask"))
        return [dict(env_info.get(agent) or {}) for env_info in per_env for agent in self.agents]

    def step(
        self,
        obs: Any,
        rewards: np.ndarray,
        terminated: np.ndarray,
        truncated: np.ndarray,
        infos: dict[str, Any],
    ) -> tuple[Any, np.ndarray, np.ndarray, list[dict[str, Any]], dict[int, dict[str, Any]]]:
        """One multi-agent step (``SAME_STEP``) as rows: ``(obs, rewards float32[N * A], dones
        bool[N * A], infos, reset_infos)``, ``reset_infos`` by row for the envs that were reset.
        """
        rows = self.observations(obs)
        flat_terminated = terminated.reshape(-1)
        flat_truncated = truncated.reshape(-1)
        dones = np.logical_or(flat_terminated, flat_truncated)
        row_infos = self.agent_infos(infos)
        ended = infos.get("_final_obs")
        restarted = infos.get("_env_restarted")
        reset_infos: dict[int, dict[str, Any]] = {}
        if ended is not None and ended.any():
            # An env that was reset: its rows' infos are its reset infos (to reset_infos), the
            # last step's are in final_info.
            last_infos = self.agent_infos(infos.get("final_info", {}))
            for i in np.flatnonzero(ended).tolist():
                for row in range(i * self.num_agents, (i + 1) * self.num_agents):
                    reset_infos[row] = row_infos[row]
                    row_infos[row] = last_infos[row]
        for row in range(self.num_rows):
            info = row_infos[row]
            if not dones[row]:
                info["TimeLimit.truncated"] = False
                continue
            i, j = divmod(row, self.num_agents)
            if ended is not None and ended[i]:
                terminal = tree_copy(tree_row(infos["final_obs"][i], j))
            else:  # the agent left while its env runs on, or the env was rebuilt (restart)
                terminal = tree_copy(tree_row(rows, row))
                if restarted is not None and restarted[i]:
                    info["env_restarted"] = True
            info["TimeLimit.truncated"] = bool(flat_truncated[row] and not flat_terminated[row])
            info["terminal_observation"] = terminal
        flat_rewards = rewards.reshape(-1).astype(np.float32)
        return rows, flat_rewards, dones, row_infos, reset_infos
