"""PettingZoo parallel envs as gymnasium envs: the per-sub-env adapter of the front's multi-agent
envs (layer 5 in docs/architecture.md).

:class:`ParallelEnvAdapter` is a ``gymnasium.Env`` over one ``pettingzoo.ParallelEnv``. Its
observation is a ``Dict`` of array leaves (the agents' observations, per-agent rewards, flags
and the agent mask), so every backend carries it in its shared buffers unchanged, steps it with
its own loop and autoresets it in its own modes; :class:`envfleet.MultiAgentVectorEnv` unpacks
the batch. Nothing here imports pettingzoo: a ParallelEnv is recognised by its interface
(:func:`is_parallel_env`).

The layout, per sub-env, agents in ``possible_agents`` order (``A`` agents):

- ``"observation"``: ``[A, *agent_shape]`` (``gymnasium.vector.utils.batch_space`` of the
  agents' one space) when every agent has the same observation space, else a ``Dict`` keyed by
  agent name, in ``possible_agents`` order;
- ``"reward"``: ``float64[A]``; ``"terminated"``, ``"truncated"``: ``bool[A]``;
- ``"agent_mask"``: ``bool[A]``, the agent is in ``env.agents`` after the call.

Where the conventions come from: agents as a dimension of one stacked array for agents that
share their spaces, and a key per group otherwise, is TorchRL's ``PettingZooWrapper`` (its
default groups agents by name; here each heterogeneous agent is its own key). Agents padded to
``possible_agents`` with a mask is PufferLib's PettingZoo emulation (``pad_agent_data`` and
``mask``). Zeroed rows for agents that left, whose actions are dropped before the env sees
them, is SuperSuit's ``black_death``. The env's own episode ends when ``env.agents`` is empty,
as PufferLib's emulation and SuperSuit's ``black_death`` end it (TorchRL ends a parallel env's
episode when any agent is done, by default).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import gymnasium
import numpy as np
from gymnasium.vector.utils import batch_space, concatenate, create_empty_array, iterate

from envfleet._core.errors import ConfigError, EnvfleetError

__all__ = [
    "MULTI_AGENT_KEY",
    "AgentError",
    "MultiAgentFactory",
    "ParallelEnvAdapter",
    "is_parallel_env",
    "multi_agent_factories",
    "multi_agent_of",
    "shared_agent_space",
]

# The metadata key of an adapted env: its agents (possible_agents). make() learns from it,
# through env 0's probe, that the vector env is multi-agent, wherever env 0 was built.
MULTI_AGENT_KEY = "envfleet.multi_agent"


class AgentError(EnvfleetError, ValueError):
    """A multi-agent env returned data for an agent outside its ``possible_agents``, or actions
    name agents that are not the env's.

    Raised in the env, by the adapter (the vector env reports it as :class:`envfleet.EnvError`
    naming the env's index, this error as its ``__cause__``); ``agent`` is the agent's name.
    """

    def __init__(self, message: str, agent: Any = None):
        super().__init__(message)
        self.agent = agent


def is_parallel_env(env: Any) -> bool:
    """Whether ``env`` looks like a ``pettingzoo.ParallelEnv``: ``possible_agents`` and a
    callable ``observation_space(agent)``, and not a ``gymnasium.Env``."""
    return (
        not isinstance(env, gymnasium.Env)
        and isinstance(getattr(env, "possible_agents", None), Sequence)
        and callable(getattr(env, "observation_space", None))
        and callable(getattr(env, "action_space", None))
    )


def multi_agent_of(metadata: dict[str, Any]) -> tuple[str, ...] | None:
    """The agents of an adapted env from its ``metadata`` (env 0's probe), or ``None`` for a
    single-agent env."""
    agents = metadata.get(MULTI_AGENT_KEY)
    return None if agents is None else tuple(agents)


def shared_agent_space(
    spaces: dict[str, gymnasium.Space[Any]], what: str, user: str, remedy: str
) -> gymnasium.Space[Any]:
    """The one ``what`` ("observation" or "action") space every agent of ``spaces`` (by agent,
    in ``possible_agents`` order) has, for ``user``, a layer that stacks agents as rows.

    Raises:
        ConfigError: two agents' spaces differ; the message names them, then ``remedy``.
    """
    agents = list(spaces)
    first = spaces[agents[0]]
    for agent in agents[1:]:
        if spaces[agent] != first:
            raise ConfigError(
                f"{user}, which needs one {what} space shared by every agent: {agents[0]!r} "
                f"has {first}, {agent!r} has {spaces[agent]}. {remedy}"
            )
    return first


def _same(spaces: Sequence[gymnasium.Space[Any]]) -> bool:
    return all(space == spaces[0] for space in spaces[1:])


def _agents_space(spaces: dict[str, gymnasium.Space[Any]]) -> gymnasium.Space[Any]:
    """``[A, ...]`` for one shared space, else a Dict by agent in the given order."""
    values = list(spaces.values())
    if _same(values):
        return batch_space(values[0], len(values))
    return gymnasium.spaces.Dict(OrderedDict(spaces))


def _zero(space: gymnasium.Space[Any]) -> Any:
    """One zeroed value of ``space`` (black death), read-only."""
    batch = create_empty_array(space, 1, np.zeros)
    value = next(iter(iterate(batch_space(space, 1), batch)))
    for leaf in _leaves(value):
        leaf.flags.writeable = False
    return value


def _leaves(value: Any) -> list[np.ndarray]:
    if isinstance(value, dict):
        return [leaf for sub in value.values() for leaf in _leaves(sub)]
    if isinstance(value, tuple):
        return [leaf for sub in value for leaf in _leaves(sub)]
    return [value] if isinstance(value, np.ndarray) else []


class ParallelEnvAdapter(gymnasium.Env[dict[str, Any], Any]):
    """A ``gymnasium.Env`` over one ``pettingzoo.ParallelEnv`` (see the module's layout).

    ``step(action)``: ``action`` is ``[A, ...]`` (agents with one shared action space) or a
    dict by agent; only the agents in ``env.agents`` get theirs. Returns the packed
    observation, the sum of the agents' rewards (float, ``possible_agents`` order),
    ``terminated``/``truncated`` for the env's episode (it ends when ``env.agents`` is empty:
    terminated when every agent's last flag was ``terminated``, else truncated) and the
    per-agent infos, keyed by agent name (gymnasium's info batching batches them).

    Raises:
        AgentError: the env returned an observation, reward or flag for an agent outside
            ``possible_agents``; a dict of actions lacks a live agent's.
    """

    def __init__(self, env: Any):
        self.par_env = env
        self.possible_agents: tuple[str, ...] = tuple(env.possible_agents)
        if not self.possible_agents:
            raise AgentError(f"{self._name()}: possible_agents is empty")
        self._index = {agent: j for j, agent in enumerate(self.possible_agents)}
        obs_spaces = {a: env.observation_space(a) for a in self.possible_agents}
        act_spaces = {a: env.action_space(a) for a in self.possible_agents}
        self.agent_observation_spaces = obs_spaces
        self.agent_action_spaces = act_spaces
        self._stacked_obs = _same(list(obs_spaces.values()))
        self._stacked_act = _same(list(act_spaces.values()))
        self._obs_space = obs_spaces[self.possible_agents[0]]
        self._zeros = {a: _zero(space) for a, space in obs_spaces.items()}
        num = len(self.possible_agents)
        flags = gymnasium.spaces.Box(0, 1, (num,), np.bool_)  # type: ignore[arg-type]
        self.observation_space = gymnasium.spaces.Dict(
            OrderedDict(
                observation=_agents_space(obs_spaces),
                reward=gymnasium.spaces.Box(-np.inf, np.inf, (num,), np.float64),
                terminated=flags,
                truncated=flags,
                agent_mask=flags,
            )
        )
        self.action_space = _agents_space(act_spaces)
        self._agent_actions = (
            batch_space(act_spaces[self.possible_agents[0]], num) if self._stacked_act else None
        )
        self.metadata = dict(getattr(env, "metadata", None) or {})
        self.metadata[MULTI_AGENT_KEY] = self.possible_agents
        self.render_mode = getattr(env, "render_mode", None)
        self._truncated_exit = False

    def _name(self) -> str:
        meta = getattr(self.par_env, "metadata", None) or {}
        return str(meta.get("name") or type(self.par_env).__name__)

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        observations, infos = self.par_env.reset(seed=seed, options=options)
        self._truncated_exit = False
        self._check_agents("an observation at reset", observations)
        num = len(self.possible_agents)
        remaining = set(self.par_env.agents)
        packed = self._pack(observations, {}, np.zeros(num, bool), np.zeros(num, bool), remaining)
        return packed, dict(infos)

    def step(self, action: Any) -> tuple[dict[str, Any], float, bool, bool, dict[str, Any]]:
        live = list(self.par_env.agents)
        actions = self._agent_actions_of(action, live)
        observations, rewards, terminations, truncations, infos = self.par_env.step(actions)
        for what, values in (
            ("an observation", observations),
            ("a reward", rewards),
            ("a terminated flag", terminations),
            ("a truncated flag", truncations),
        ):
            self._check_agents(what, values)
        num = len(self.possible_agents)
        index = self._index
        terminated = np.zeros(num, bool)
        truncated = np.zeros(num, bool)
        for agent, flag in terminations.items():
            terminated[index[agent]] = bool(flag)
        for agent, flag in truncations.items():
            truncated[index[agent]] = bool(flag)
        remaining = set(self.par_env.agents)
        for agent in live:
            if agent not in remaining and not terminations.get(agent, False):
                self._truncated_exit = True
        packed = self._pack(observations, rewards, terminated, truncated, remaining)
        done = not remaining
        episode_terminated = done and not self._truncated_exit
        episode_truncated = done and self._truncated_exit
        reward = float(packed["reward"].sum())
        return packed, reward, episode_terminated, episode_truncated, dict(infos)

    def _agent_actions_of(self, action: Any, live: list[str]) -> dict[str, Any]:
        index = self._index
        if self._agent_actions is not None:
            # An array of actions is its own rows (what iterate() would yield, without
            # materialising every row); other containers go through gymnasium's iterate.
            rows = (
                action
                if isinstance(action, np.ndarray)
                else list(iterate(self._agent_actions, action))
            )
            return {agent: rows[index[agent]] for agent in live if agent in index}
        if not isinstance(action, dict):
            raise AgentError(
                f"{self._name()}: expected a dict of actions by agent, got {type(action).__name__}"
            )
        missing = [agent for agent in live if agent not in action]
        if missing:
            raise AgentError(f"{self._name()}: no action for live agent {missing[0]!r}", missing[0])
        return {agent: action[agent] for agent in live}

    def _check_agents(self, what: str, values: dict[str, Any]) -> None:
        if values.keys() <= self._index.keys():
            return
        for agent in values:
            if agent not in self._index:
                raise AgentError(
                    f"{self._name()} returned {what} for agent {agent!r}, which is not in its "
                    f"possible_agents {list(self.possible_agents)}",
                    agent,
                )

    def _pack(
        self,
        observations: dict[str, Any],
        rewards: dict[str, Any],
        terminated: np.ndarray,
        truncated: np.ndarray,
        remaining: set[str],
    ) -> dict[str, Any]:
        agents = self.possible_agents
        zeros = self._zeros
        items = [observations[a] if a in observations else zeros[a] for a in agents]
        obs: Any
        if self._stacked_obs:
            # np.empty: concatenate writes every row (no zero fill of a buffer about to be
            # overwritten).
            out: Any = create_empty_array(self._obs_space, len(agents), np.empty)
            obs = concatenate(self._obs_space, items, out)
        else:
            obs = OrderedDict(zip(agents, items, strict=True))
        return OrderedDict(
            observation=obs,
            reward=np.array([float(rewards.get(a, 0.0)) for a in agents], np.float64),
            terminated=terminated,
            truncated=truncated,
            agent_mask=np.array([a in remaining for a in agents], bool),
        )

    def render(self) -> Any:
        return self.par_env.render()

    def close(self) -> None:
        self.par_env.close()

    def __getattr__(self, name: str) -> Any:
        # call()/get_attr() reach the ParallelEnv's own attributes (state(), ...).
        if name.startswith("_") or name == "par_env":
            raise AttributeError(name)
        return getattr(self.par_env, name)

    def __repr__(self) -> str:
        return f"ParallelEnvAdapter({self._name()})"


class MultiAgentFactory:
    """A factory that returns ``fn(**kwargs)`` wrapped in :class:`ParallelEnvAdapter` when it
    is a ParallelEnv, and unchanged otherwise; make() wraps every factory in one, so each
    worker adapts the envs it builds. It pickles when ``fn`` does."""

    def __init__(self, fn: Callable[..., Any]):
        self.fn = fn

    def __call__(self, **kwargs: Any) -> Any:
        env = self.fn(**kwargs)
        return ParallelEnvAdapter(env) if is_parallel_env(env) else env

    def __repr__(self) -> str:
        return repr(self.fn)


def multi_agent_factories(env_fns: Sequence[Callable[..., Any]]) -> list[Callable[..., Any]]:
    """Each factory wrapped in a :class:`MultiAgentFactory`, a factory repeated wrapped once
    (so it is still pickled once)."""
    wrapped: dict[int, MultiAgentFactory] = {}
    return [wrapped.setdefault(id(fn), MultiAgentFactory(fn)) for fn in env_fns]
