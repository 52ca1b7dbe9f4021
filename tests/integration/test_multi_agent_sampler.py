"""The Sampler over PettingZoo parallel envs (issue 20): one policy on agent rows, per-agent
segments with ``env_index`` and ``agent_index``.

The backbone: with a deterministic policy, each (env, agent) stream of the batch, in every
inference mode, equals a serial reference loop over the raw ParallelEnv (same seeds): the
agent's observations, actions, rewards, terminated and truncated, step for step, and its
segments end where its episode ends. Envs: pistonball (agents leave together) and
knights-archers-zombies with ``line_death`` (agents die early: their segments end first).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import envfleet

pytest.importorskip("pettingzoo.butterfly")
from pettingzoo.butterfly import knights_archers_zombies_v11, pistonball_v6  # noqa: E402

from tests.multi_agent_envs import HeteroEnv, SwarmEnv  # noqa: E402

NUM_ENVS = 4
SEED = 5
STEPS = 120


def pistonball() -> Any:
    return pistonball_v6.parallel_env(n_pistons=3, max_cycles=9)


def kaz() -> Any:
    return knights_archers_zombies_v11.parallel_env(line_death=True, max_cycles=25)


def swarm() -> Any:
    return SwarmEnv(max_cycles=12)


ENVS = {"pistonball": pistonball, "kaz": kaz, "swarm": swarm}


class RowPolicy:
    """Deterministic: each row's action is a function of its observation and of its agent
    (row ``i * A + j`` is agent ``j``). It steers kaz's first agent up, into the wall, so that
    agents die before their episode ends. Returns a per-row info too."""

    def __init__(self, num_agents: int, num_actions: int | None):
        self.num_agents = num_agents
        self.num_actions = num_actions  # None: pistonball's Box(1) actions
        self.offset = 0.0

    def set_params(self, offset: float) -> None:
        self.offset = float(offset)

    def __call__(self, obs: np.ndarray) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        n = obs.shape[0]
        flat = obs.reshape(n, -1).astype(np.float64)
        score = flat[:, : min(flat.shape[1], 300)].sum(1) + self.offset
        agent = np.arange(n) % self.num_agents
        if self.num_actions is not None:
            actions = (np.floor(np.abs(score) * 7.0).astype(np.int64) + agent) % self.num_actions
            actions[agent == 0] = 1
        else:
            actions = np.tanh(score / 5e4 - 1.0 + 0.1 * agent).astype(np.float32).reshape(n, 1)
        return actions, {"score": score}


def policy_for(name: str) -> RowPolicy:
    env = ENVS[name]()
    space = env.action_space(env.possible_agents[0])
    return RowPolicy(len(env.possible_agents), getattr(space, "n", None))


Streams = dict[tuple[int, int], list[tuple[Any, ...]]]


Events = dict[tuple[int, int], list[int]]


def reference_streams(name: str, steps: int) -> tuple[Streams, Events, Events]:
    """(env, agent) -> its steps: (obs, action, reward, terminated, truncated, score), from a
    serial loop over the raw ParallelEnvs, autoreset as the Sampler does (SAME_STEP); and
    (env, agent) -> where in its steps it left while other agents went on, and where it
    joined an episode in progress."""
    policy = policy_for(name)
    streams: Streams = {}
    early: Events = {}
    joins: Events = {}
    for i in range(NUM_ENVS):
        env = ENVS[name]()
        agents = list(env.possible_agents)
        space = env.observation_space(agents[0])
        obs, _ = env.reset(seed=SEED + i)
        for _ in range(steps):
            live = list(env.agents)
            rows = np.stack([obs.get(a, np.zeros(space.shape, space.dtype)) for a in agents])
            actions, infos = policy(rows)
            out, rewards, terms, truncs, _ = env.step(
                {a: actions[j] for j, a in enumerate(agents) if a in live}
            )
            for j, a in enumerate(agents):
                if a not in live:
                    continue
                term = bool(terms.get(a, False))
                trunc = bool(truncs.get(a, False)) or (a not in env.agents and not term)
                row = (rows[j], actions[j], float(rewards.get(a, 0.0)), term, trunc)
                streams.setdefault((i, j), []).append((*row, infos["score"][j]))
                if a not in env.agents and env.agents:
                    early.setdefault((i, j), []).append(len(streams[(i, j)]) - 1)
            for j, a in enumerate(agents):
                if a not in live and a in env.agents:  # its next step is its first
                    joins.setdefault((i, j), []).append(len(streams.get((i, j), [])))
            obs = out
            if not env.agents:
                obs, _ = env.reset()
        env.close()
    return streams, early, joins


def batch_streams(batch: envfleet.EpisodeBatch) -> Streams:
    assert batch.agent_index is not None
    streams: Streams = {}
    for s, start in enumerate(batch.starts.tolist()):
        key = (int(batch.env_index[s]), int(batch.agent_index[s]))
        for t in range(start, start + int(batch.lengths[s])):
            row = (batch.observations[t], batch.actions[t], float(batch.rewards[t]))
            flags = (bool(batch.terminated[t]), bool(batch.truncated[t]))
            streams.setdefault(key, []).append((*row, *flags, batch.agent_infos["score"][t]))
    return streams


@pytest.mark.parametrize("inference", ["driver", "worker", "auto", "pool"])
@pytest.mark.parametrize("name", list(ENVS))
def test_agent_streams_equal_the_serial_reference(name: str, inference: str) -> None:
    """ "pool": driver inference over a first-ready pool (``batch_size = num_envs / 2``)."""
    pool = {"batch_size": NUM_ENVS // 2} if inference == "pool" else {}
    sampler = envfleet.Sampler(
        ENVS[name], policy_for(name), NUM_ENVS, seed=SEED, num_workers=2, backend="processes",
        segment_length=8, inference="driver" if inference == "pool" else inference, **pool,
    )  # fmt: skip
    try:
        assert sampler.possible_agents == tuple(ENVS[name]().possible_agents)
        first = sampler.sample(STEPS // 2)
        second = sampler.sample(STEPS // 2)
    finally:
        sampler.close()
    batch = envfleet.EpisodeBatch.concatenate(first, second)
    got = batch_streams(batch)
    want, early, joins = reference_streams(name, STEPS * 3)
    assert got, "no agent steps sampled"
    for key, steps in got.items():
        ref = want[key]
        assert len(steps) <= len(ref), key
        for t, (a, b) in enumerate(zip(steps, ref, strict=False)):
            where = f"env {key[0]} agent {key[1]} step {t}"
            np.testing.assert_array_equal(a[0], b[0], err_msg=where + " observation")
            np.testing.assert_array_equal(a[1], b[1], err_msg=where + " action")
            assert a[2:] == b[2:], where
    # segments end exactly where the agent's flags are set, and nowhere else but a cut
    last = batch.starts + batch.lengths - 1
    inner = np.ones(batch.num_steps, bool)
    inner[last] = False
    assert not (batch.terminated[inner] | batch.truncated[inner]).any()
    # What each env is here for, in the steps compared above: agents that die while others
    # go on (kaz, swarm), agents that join an episode in progress, some again (swarm).
    died = [t for key, ts in early.items() for t in ts if t < len(got.get(key, []))]
    assert bool(died) == (name in ("kaz", "swarm")), "agents that left early"
    joined = [t for key, ts in joins.items() for t in ts if t < len(got.get(key, []))]
    assert bool(joined) == (name == "swarm"), "agents that joined"


def test_policy_updates_reach_the_workers_through_the_agent_rows() -> None:
    """update_policy(params) loads them into each worker's copy (set_params, reached through
    the agent-row wrapper); later actions follow the new parameters."""
    sampler = envfleet.Sampler(
        pistonball, policy_for("pistonball"), NUM_ENVS, inference="worker", seed=SEED,
        num_workers=2, backend="processes", segment_length=4,
    )  # fmt: skip
    try:
        before = sampler.sample(16)
        assert set(before.policy_version.tolist()) == {0}
        sampler.update_policy(1e6)  # tanh saturates: every action 1.0
        after = sampler.sample(16)
    finally:
        sampler.close()
    assert set(after.policy_version.tolist()) == {1}
    np.testing.assert_array_equal(after.actions, np.ones_like(after.actions))
    assert not np.all(before.actions == 1.0)


def test_exact_episodes_are_whole_agent_episodes() -> None:
    sampler = envfleet.Sampler(
        kaz, policy_for("kaz"), NUM_ENVS, inference="driver", seed=SEED, backend="serial"
    )
    try:
        batch = sampler.sample_episodes(1)
    finally:
        sampler.close()
    assert batch.agent_index is not None and batch.complete.all()
    assert set(batch.env_index.tolist()) <= set(range(NUM_ENVS))
    for piece in batch.split():
        assert piece.agent_index is not None and len(piece.agent_index) == 1


def test_agents_with_different_spaces_are_refused() -> None:
    with pytest.raises(envfleet.ConfigError, match="one observation space|one action space"):
        envfleet.Sampler(lambda: HeteroEnv(max_cycles=6), lambda obs: obs, 2, backend="serial")


def test_an_agent_that_leaves_unflagged_ends_truncated_and_a_restart_truncates_all() -> None:
    """agent_batch on a recorded packed batch: agent 1 leaves ``env.agents`` after step 1
    with no flag (read as truncated, as the adapter reads such an env); step 2 is a restart
    (every acting agent's segment ends truncated, reward 0)."""
    from envfleet._sampler.multi_agent_rollout import agent_batch

    def packed(masks: list[list[bool]], rewards: list[list[float]]) -> dict[str, np.ndarray]:
        n = len(masks)
        return {
            "observation": np.arange(n * 2, dtype=np.float32).reshape(n, 2, 1),
            "reward": np.array(rewards),
            "terminated": np.zeros((n, 2), bool),
            "truncated": np.zeros((n, 2), bool),
            "agent_mask": np.array(masks),
        }

    obs = packed([[True, True], [True, True], [True, False]], [[0, 0], [1, 2], [3, 4]])
    batch = envfleet.EpisodeBatch(
        observations=obs,
        actions=np.arange(6).reshape(3, 2),
        rewards=np.zeros(3),
        terminated=np.zeros(3, bool),
        truncated=np.array([False, False, True]),
        last_observations=packed([[True, False]], [[9, 9]]),
        env_index=np.array([0]),
        policy_version=np.array([0]),
        lengths=np.array([3]),
        env_infos=[{"a": {"x": 1}}, {}, {"env_restarted": True}],
    )
    out = agent_batch(batch, ["a", "b"])
    assert out.agent_index is not None
    assert out.agent_index.tolist() == [0, 1] and out.lengths.tolist() == [3, 2]
    np.testing.assert_array_equal(out.rewards, [1, 3, 0, 2, 4])
    np.testing.assert_array_equal(out.truncated, [False, False, True, False, True])
    assert not out.terminated.any()
    np.testing.assert_array_equal(out.actions, [0, 2, 4, 1, 3])
    assert out.env_infos[0] == {"x": 1} and out.env_infos[2] == {"env_restarted": True}


def test_a_policy_returning_a_list_works_as_for_single_agent_envs() -> None:
    sampler = envfleet.Sampler(swarm, lambda obs: [2] * len(obs), 2, seed=SEED, backend="serial")
    try:
        batch = sampler.sample(10)
    finally:
        sampler.close()
    assert batch.num_steps > 0 and (np.asarray(batch.actions) == 2).all()
