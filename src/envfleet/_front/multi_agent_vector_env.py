"""The public multi-agent vector env: :class:`MultiAgentVectorEnv`, a thin layer over a
:class:`envfleet.FleetVectorEnv` whose sub-envs are PettingZoo ParallelEnvs adapted by
:mod:`envfleet._front.multi_agent`. It unpacks each batch into per-agent arrays; the backends, the
autoreset modes and the supervision are the vector env's own.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from gymnasium.vector import AutoresetMode, VectorWrapper

from envfleet._core.errors import InvalidActionError
from envfleet._core.replay import Snapshot
from envfleet._front.vector_env import FleetVectorEnv

__all__ = ["MultiAgentVectorEnv"]


class MultiAgentVectorEnv(VectorWrapper[Any, Any, Any, Any, Any]):
    """A vector env of PettingZoo parallel envs: what :func:`envfleet.make` returns for a
    factory that returns a ``pettingzoo.ParallelEnv`` (duck-typed: ``possible_agents`` and
    ``observation_space(agent)``; an AEC env goes through ``pettingzoo.utils.aec_to_parallel``
    first). ``N`` = ``num_envs``, ``A`` = ``len(possible_agents)``, agents in
    ``possible_agents`` order.

    Layout:

    - observations: ``[N, A, *agent_shape]`` when every agent has the same observation space
      (``single_observation_space`` is ``batch_space(agent_space, A)``), else a dict by agent
      name, each ``[N, *shape]`` (``single_observation_space`` a ``Dict`` by agent);
    - actions: likewise ``[N, A, *agent_shape]`` or a dict by agent, by the action spaces;
      actions of agents not in ``env.agents`` are dropped before the env sees them;
    - rewards ``float64[N, A]``, terminated and truncated ``bool[N, A]``: each agent's own;
    - ``infos["agent_mask"]`` ``bool[N, A]``: the agent is in ``env.agents`` after the call
      (it acts at the next step). Agents that are not have zeroed observation rows, zero
      rewards and false flags from the step after they left ("black death"); on the step
      they leave, their row holds their last observation, reward and flags; an agent that
      joins an episode in progress has its first observation (and its mask) on the step it
      joins;
    - ``infos[agent]``: each agent's info, batched in gymnasium's convention
      (``infos["_" + agent]`` says which envs have one).

    An env rebuilt by a ``restart_policy`` (``infos["env_restarted"]``) reads truncated for
    every agent, beside its reset observation.

    The convention sources: agents as a dimension (TorchRL's ``PettingZooWrapper``, which
    stacks agents of one group), padding to ``possible_agents`` with a mask (PufferLib's
    PettingZoo emulation), zeroed rows for agents that left (SuperSuit's ``black_death``).

    A sub-env's episode ends when ``env.agents`` is empty: then it is autoreset per
    ``autoreset_mode`` as any env. Every mode works: with ``SAME_STEP``, a finished env's
    rewards and flags of its last step are returned (read from ``infos["final_obs"]``) beside
    its reset observation, and ``infos["final_obs"][i]`` is its last observation in the layout
    above. The wrapped vector env (``vector_env``) sees, per env, a packed ``Dict``
    observation and the sum of the agents' rewards as its scalar reward.

    Example::

        from pettingzoo.butterfly import pistonball_v6

        envs = envfleet.make(lambda: pistonball_v6.parallel_env(n_pistons=4), 8)
        obs, infos = envs.reset(seed=0)            # uint8[8, 4, 457, 120, 3]
        actions = envs.action_space.sample()       # float32[8, 4, 1]
        obs, rewards, terminated, truncated, infos = envs.step(actions)
        rewards.shape, infos["agent_mask"].shape   # (8, 4), (8, 4)

    Raises:
        InvalidActionError: from ``step``, before anything is sent: actions of the wrong
            shape or dtype, or a dict of actions whose agents are not ``possible_agents``.
        EnvError: a sub-env raised, with its index; an :class:`envfleet.AgentError` as its
            ``__cause__`` where the env returned data for an agent outside
            ``possible_agents``.
    """

    def __init__(self, env: FleetVectorEnv, possible_agents: tuple[str, ...]):
        super().__init__(env)
        self.vector_env = env
        self.possible_agents = tuple(possible_agents)
        packed_single: Any = env.single_observation_space
        packed: Any = env.observation_space
        self.single_observation_space = packed_single["observation"]
        self.observation_space = packed["observation"]
        self.single_action_space = env.single_action_space
        self.action_space = env.action_space
        self.autoreset_mode: AutoresetMode = env.autoreset_mode

    @property
    def num_agents(self) -> int:
        """``A``, the number of possible agents."""
        return len(self.possible_agents)

    def reset(
        self, *, seed: int | list[int | None] | None = None, options: dict[str, Any] | None = None
    ) -> tuple[Any, dict[str, Any]]:
        """Reset as :meth:`FleetVectorEnv.reset` (``options={"reset_mask": ...}`` with
        ``DISABLED``). Returns (observations, infos with ``agent_mask`` ``bool[N, A]``)."""
        packed, infos = self.vector_env.reset(seed=seed, options=options)
        infos["agent_mask"] = packed["agent_mask"]
        return packed["observation"], infos

    def snapshot(self) -> Snapshot:
        """:meth:`FleetVectorEnv.snapshot` of the packed vector env: ``envfleet.make(...,
        resume=state)`` with the same PettingZoo factory continues exactly (each env's own
        generator, the PettingZoo env's ``np_random``, travels with it)."""
        return self.vector_env.snapshot()

    def step(self, actions: Any) -> tuple[Any, np.ndarray, np.ndarray, np.ndarray, dict[str, Any]]:
        """Step every env. Returns (observations, rewards ``float64[N, A]``, terminated
        ``bool[N, A]``, truncated ``bool[N, A]``, infos with ``agent_mask`` ``bool[N, A]``).

        Raises:
            InvalidActionError: see the class; nothing is sent then.
        """
        self._check_actions(actions)
        return self._unpack(self.vector_env.step(actions))

    def step_async(self, actions: Any) -> None:
        """Start a step of every env (gymnasium's ``step_async``); :meth:`step_wait` collects it.

        Raises:
            InvalidActionError: as :meth:`step`; nothing is sent then.
        """
        self._check_actions(actions)
        self.vector_env.step_async(actions)

    def step_wait(
        self, timeout: float | None = None
    ) -> tuple[Any, np.ndarray, np.ndarray, np.ndarray, dict[str, Any]]:
        """Wait for :meth:`step_async`; results as :meth:`step` returns them."""
        return self._unpack(self.vector_env.step_wait(timeout=timeout))

    # -- the first-ready pool (EnvPool's send/recv), with batch_size < num_envs ----------------

    @property
    def is_pool(self) -> bool:
        """Whether this is a first-ready pool (``batch_size < num_envs``)."""
        return bool(self.vector_env.is_pool)

    @property
    def batch_size(self) -> int:
        """Envs per :meth:`recv` (``num_envs`` unless a first-ready pool)."""
        return int(self.vector_env.batch_size)

    def async_reset(self, seed: Any = None, env_ids: Any = None) -> None:
        """Reset envs without waiting, as :meth:`FleetVectorEnv.async_reset`; :meth:`recv`
        returns them as they finish."""
        self.vector_env.async_reset(seed=seed, env_ids=env_ids)

    def send(self, actions: Any, env_ids: Any = None) -> None:
        """Send actions to some envs, as :meth:`FleetVectorEnv.send`: ``actions`` are
        ``[len(env_ids), A, *shape]`` (or a dict by agent, each ``[len(env_ids), *shape]``).

        Raises:
            InvalidActionError: as :meth:`step`; else as :meth:`FleetVectorEnv.send`. Nothing
                is sent then.
        """
        self._check_actions(actions)
        self.vector_env.send(actions, env_ids)

    def recv(
        self, timeout: float | None = None
    ) -> tuple[Any, np.ndarray, np.ndarray, np.ndarray, dict[str, Any]]:
        """The first ``batch_size`` envs to finish, as :meth:`FleetVectorEnv.recv`, in this
        class's layout over the batch: observations ``[batch_size, A, ...]``, rewards
        ``float64[batch_size, A]``, flags ``bool[batch_size, A]``, ``infos["agent_mask"]``
        ``bool[batch_size, A]`` and ``infos["env_id"]`` ``int32[batch_size]`` (EnvPool's).
        A reset env's rewards and flags are zeros (its observation is the reset one)."""
        return self._unpack(self.vector_env.recv(timeout=timeout))

    # -- unpacking -------------------------------------------------------------------------

    def _check_actions(self, actions: Any) -> None:
        if not isinstance(actions, dict):
            return  # a stacked array: the vector env checks its shape and dtype
        agents = set(self.possible_agents)
        for agent in list(actions):
            if agent not in agents:
                raise InvalidActionError(
                    f"actions for agent {agent!r}, not in possible_agents "
                    f"{list(self.possible_agents)}"
                )
        missing = [agent for agent in self.possible_agents if agent not in actions]
        if missing:
            raise InvalidActionError(
                f"no actions for agent {missing[0]!r} (a dict of actions has every agent "
                "of possible_agents; actions of agents not in env.agents are ignored)"
            )

    def _unpack(
        self, result: tuple[Any, Any, Any, Any, dict[str, Any]]
    ) -> tuple[Any, np.ndarray, np.ndarray, np.ndarray, dict[str, Any]]:
        """The packed batch ``result`` of the wrapped vector env, in this class's layout."""
        packed, _, _, _, infos = result
        rewards, terminated, truncated = packed["reward"], packed["terminated"], packed["truncated"]
        final = infos.get("_final_obs")
        if final is not None and final.any():  # SAME_STEP: the last step's rows are there
            rewards, terminated, truncated = rewards.copy(), terminated.copy(), truncated.copy()
            final_obs = np.empty(len(final), dtype=object)
            for i in np.flatnonzero(final):
                last = infos["final_obs"][i]
                rewards[i], terminated[i], truncated[i] = (
                    last["reward"],
                    last["terminated"],
                    last["truncated"],
                )
                final_obs[i] = last["observation"]
            infos["final_obs"] = final_obs
        restarted = infos.get("_env_restarted")
        if restarted is not None and restarted.any():  # its episode was cut: every agent's
            truncated = truncated.copy()
            truncated[restarted] = True
        infos["agent_mask"] = packed["agent_mask"]
        return packed["observation"], rewards, terminated, truncated, infos

    def call(self, name: str, *args: Any, **kwargs: Any) -> tuple[Any, ...]:
        """Call ``name`` on each env's adapter (its ParallelEnv's attributes are reached
        through it)."""
        return self.vector_env.call(name, *args, **kwargs)

    def get_attr(self, name: str) -> tuple[Any, ...]:
        """Each env's ``name`` (the adapter's, else its ParallelEnv's)."""
        return self.vector_env.get_attr(name)

    def set_attr(self, name: str, values: Any) -> None:
        """Set ``name`` on each env's adapter."""
        self.vector_env.set_attr(name, values)
