"""Multi-agent rollouts for the Sampler: the policy sees agents as rows, and each agent's
experience comes back as segments of its own, tagged with its index (layer 4 in
docs/architecture.md).

The Sampler steps a multi-agent vector env's packed vector env (``MultiAgentVectorEnv.
vector_env``, whose observation per env is the adapter's Dict: ``observation [A, ...]``,
``reward [A]``, ``terminated [A]``, ``truncated [A]``, ``agent_mask [A]``; see
:mod:`envfleet._front.multi_agent`) with :class:`AgentRowsPolicy`, and turns what it records into
per-agent segments with :func:`agent_batch`. This is SuperSuit's convention for training one
policy shared by all agents (``pettingzoo_env_to_vec_env_v1``: agents are rows of the batch),
with each segment keeping its env and its agent, as garage's ``EpisodeBatch`` keeps its env.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import gymnasium
import numpy as np

from envfleet._core.trees import tree_map
from envfleet._front.multi_agent import shared_agent_space
from envfleet._sampler.rollout import EpisodeBatch

__all__ = ["AgentRowsPolicy", "agent_batch", "agent_spaces"]


def agent_spaces(venv: Any) -> tuple[gymnasium.Space[Any], ...]:
    """The one observation space and the one action space every agent of ``venv``'s envs
    has (``venv``: a multi-agent vector env's packed vector env).

    Raises:
        ConfigError: the agents' spaces differ (the Sampler stacks agents as rows of one
            batch: one policy shared by every agent, SuperSuit's convention).
    """
    return tuple(
        shared_agent_space(
            venv.get_attr(f"agent_{what}_spaces")[0],
            what,
            "the Sampler runs one policy on every agent's rows",
            "Use envfleet.make's MultiAgentVectorEnv (a dict by agent) directly",
        )
        for what in ("observation", "action")
    )


class AgentRowsPolicy:
    """The user's policy over agent rows, as the Sampler calls it on packed observations.

    Called on a batch of ``n`` envs' packed observations, it calls ``policy`` on the agents'
    observations as ``n * A`` rows (``[n * A, *agent_shape]``, row ``i * A + j`` = env ``i``,
    agent ``j``; agents not in ``env.agents`` included, with their zeroed rows) and returns the
    actions as ``[n, A, *action_shape]`` (and agent infos ``[n, A, ...]``), which the adapter
    hands to the env (dropping those of absent agents). Attributes it lacks (``seed``,
    ``load_state_dict``, ``parameters``...) are the policy's.
    """

    def __init__(self, policy: Any, num_agents: int):
        self.policy = policy
        self.num_agents = int(num_agents)

    def __call__(self, packed: Any) -> Any:
        observations = packed["observation"]
        n = _rows(observations)
        rows = tree_map(lambda x: x.reshape(n * self.num_agents, *x.shape[2:]), observations)
        out = self.policy(rows)
        if isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], dict):
            actions, infos = out
            return self._by_env(actions, n), {k: self._by_env(v, n) for k, v in infos.items()}
        return self._by_env(out, n)

    def _by_env(self, value: Any, n: int) -> Any:
        if isinstance(value, dict):
            return {k: self._by_env(v, n) for k, v in value.items()}
        if isinstance(value, tuple):
            return tuple(self._by_env(v, n) for v in value)
        if not hasattr(value, "reshape"):  # a list, a scalar per row...: as numpy
            value = np.asarray(value)
        return value.reshape(n, self.num_agents, *value.shape[1:])

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name == "policy":  # pickling looks these up first
            raise AttributeError(name)
        return getattr(self.policy, name)

    def __repr__(self) -> str:
        return f"AgentRowsPolicy({self.policy!r}, num_agents={self.num_agents})"


def _rows(tree: Any) -> int:
    while isinstance(tree, (dict, tuple)):
        tree = next(iter(tree.values())) if isinstance(tree, dict) else tree[0]
    return int(tree.shape[0])


def agent_batch(batch: EpisodeBatch, agents: Sequence[str]) -> EpisodeBatch:
    """Per-agent segments from a batch recorded over packed multi-agent observations.

    An agent's segment is a run of steps it acted in (it was in ``env.agents``) within one of
    ``batch``'s env segments; it ends where the agent's ``terminated`` or ``truncated`` is set
    or it left ``env.agents`` (then read as truncated, as the adapter reads an env whose
    agents leave unflagged), or where the env segment ends. Segments come in env-segment
    order, then agent order. Each step's reward and flags are the agent's own (the packed
    observation after the step holds them; the episode's final observation where it ended).
    A step whose env was rebuilt (``env_infos`` ``env_restarted``) ends every acting agent's
    segment, truncated, with reward 0. Step infos are the agent's info (``env_restarted``
    added where set).
    """
    obs, following = batch.observations, batch.next_observations
    mask = np.asarray(obs["agent_mask"], dtype=np.bool_)
    rewards = np.array(following["reward"], dtype=np.float64)
    terminated = np.array(following["terminated"], dtype=np.bool_)
    truncated = np.array(following["truncated"], dtype=np.bool_)
    left = mask & ~np.asarray(following["agent_mask"], dtype=np.bool_)
    restarted = np.zeros(len(mask), dtype=np.bool_)
    for t, info in enumerate(batch.env_infos):
        restarted[t] = bool(info.get("env_restarted"))
    if restarted.any():  # the observation after it is the one acted on: nothing to read
        rewards[restarted] = 0.0
        terminated[restarted] = False
        truncated[restarted] = mask[restarted]
        left[restarted] = mask[restarted]
    truncated |= left & ~terminated & ~truncated
    ends = terminated | truncated | left
    rows: list[np.ndarray] = []
    columns: list[int] = []
    lengths: list[int] = []
    seg_of: list[int] = []
    lasts: list[int] = []
    for s, (start, length) in enumerate(
        zip(batch.starts.tolist(), batch.lengths.tolist(), strict=True)
    ):
        for j in range(len(agents)):
            run: list[int] = []
            for t in range(start, start + length):
                if not mask[t, j]:
                    continue
                run.append(t)
                if ends[t, j] or t == start + length - 1:
                    rows.append(np.array(run, dtype=np.int64))
                    columns.append(j)
                    lengths.append(len(run))
                    seg_of.append(s)
                    lasts.append(t)
                    run = []
    index = np.concatenate(rows) if rows else np.zeros(0, dtype=np.int64)
    agent = np.repeat(np.array(columns, dtype=np.int64), lengths)
    last_rows = np.array(lasts, dtype=np.int64)
    last_agents = np.array(columns, dtype=np.int64)
    segments = np.array(seg_of, dtype=np.int64)
    names = list(agents)
    env_infos = []
    for t, j in zip(index.tolist(), agent.tolist(), strict=True):
        info = batch.env_infos[t] if batch.env_infos else {}
        own = dict(info.get(names[j], {}) or {})
        if restarted[t]:
            own["env_restarted"] = True
        env_infos.append(own)
    return EpisodeBatch(
        observations=tree_map(lambda x: x[index, agent], obs["observation"]),
        actions=tree_map(lambda x: np.asarray(x)[index, agent], batch.actions),
        rewards=rewards[index, agent],
        terminated=terminated[index, agent],
        truncated=truncated[index, agent],
        last_observations=tree_map(lambda x: x[last_rows, last_agents], following["observation"]),
        env_index=batch.env_index[segments],
        policy_version=batch.policy_version[segments],
        lengths=np.array(lengths, dtype=np.int64),
        agent_infos={k: np.asarray(v)[index, agent] for k, v in batch.agent_infos.items()},
        env_infos=env_infos,
        agent_index=last_agents,
    )
