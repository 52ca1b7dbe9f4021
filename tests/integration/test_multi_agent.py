"""PettingZoo parallel envs through ``envfleet.make`` (issue 20): every backend and autoreset
mode gives bit-identical observations, rewards, flags, agent masks and infos to a serial
reference loop over the raw ParallelEnvs with the same seeds and actions.

The reference packs the raw envs' dicts itself, following the documented layout
(:class:`envfleet.MultiAgentVectorEnv`), and batches infos with gymnasium's own ``_add_info``.
Envs: pistonball (image observations, every agent leaves together), knights-archers-zombies
with ``line_death`` (agents die early: black death), MPE2's ``simple_world_comm_v3`` (six agents
whose observation and action spaces differ: the dict layout) and
``tests.multi_agent_envs.HeteroEnv`` (agents with different spaces, one of which leaves early).
"""

from __future__ import annotations

import functools
from typing import Any

import gymnasium
import numpy as np
import pytest
from gymnasium.vector import AutoresetMode

import envfleet

pytest.importorskip("pettingzoo.butterfly")
pytest.importorskip("mpe2")
from pettingzoo.butterfly import knights_archers_zombies_v11, pistonball_v6  # noqa: E402

from tests.multi_agent_envs import HeteroEnv, SwarmEnv, make_faulty  # noqa: E402

NUM_ENVS = 3
STEPS = 40
SEED = 11


def pistonball() -> Any:
    return pistonball_v6.parallel_env(n_pistons=4, max_cycles=7)


def kaz() -> Any:
    # line_death: an agent that touches the top or bottom wall dies (the test steers them)
    return knights_archers_zombies_v11.parallel_env(line_death=True, max_cycles=30)


def hetero() -> Any:
    return HeteroEnv(max_cycles=6)


def world_comm() -> Any:
    # Farama's MPE2 (PettingZoo's MPE, moved out): six agents in three kinds, whose
    # observation spaces (34 or 28 floats) and action spaces (Discrete 20 or 5) differ
    from mpe2 import simple_world_comm_v3

    return simple_world_comm_v3.parallel_env(max_cycles=8)


def swarm() -> Any:
    return SwarmEnv(max_cycles=12)


ENVS = {
    "pistonball": pistonball,
    "kaz": kaz,
    "hetero": hetero,
    "world_comm": world_comm,
    "swarm": swarm,
}
MODES = [AutoresetMode.NEXT_STEP, AutoresetMode.SAME_STEP]


class Reference:
    """The serial loop over raw ParallelEnvs: packs their dicts in the documented layout and
    autoresets them as gymnasium's vector envs do in ``mode``."""

    def __init__(self, fn: Any, num_envs: int, mode: AutoresetMode):
        self.envs = [fn() for _ in range(num_envs)]
        self.agents = list(self.envs[0].possible_agents)
        self.stacked_obs = _same([self.envs[0].observation_space(a) for a in self.agents])
        self.stacked_act = _same([self.envs[0].action_space(a) for a in self.agents])
        self.mode = mode
        self.done = [False] * num_envs
        self.truncated_exit = [False] * num_envs

    def zero(self, agent: str) -> Any:
        space = self.envs[0].observation_space(agent)
        return np.zeros(space.shape, space.dtype)

    def pack(
        self,
        i: int,
        obs: dict[str, Any],
        rewards: dict[str, Any],
        terms: dict[str, Any],
        truncs: dict[str, Any],
    ) -> dict[str, Any]:
        env = self.envs[i]
        rows = [obs[a] if a in obs else self.zero(a) for a in self.agents]
        by_agent = dict(zip(self.agents, rows, strict=True))
        return {
            "observation": np.stack(rows) if self.stacked_obs else by_agent,
            "reward": np.array([float(rewards.get(a, 0.0)) for a in self.agents]),
            "terminated": np.array([bool(terms.get(a, False)) for a in self.agents]),
            "truncated": np.array([bool(truncs.get(a, False)) for a in self.agents]),
            "agent_mask": np.array([a in env.agents for a in self.agents]),
        }

    def reset_env(self, i: int, seed: int | None) -> tuple[dict[str, Any], dict[str, Any]]:
        obs, infos = self.envs[i].reset(seed=seed)
        self.done[i], self.truncated_exit[i] = False, False
        return self.pack(i, obs, {}, {}, {}), dict(infos)

    def reset(self, seed: int) -> tuple[Any, dict[str, Any]]:
        results = [self.reset_env(i, seed + i) for i in range(len(self.envs))]
        batch = self.batch(results, [None] * len(self.envs))
        return batch[0], batch[4]

    def step_env(self, i: int, actions: Any) -> tuple[dict[str, Any], dict[str, Any], bool]:
        env = self.envs[i]
        live = list(env.agents)
        if self.stacked_act:
            mine = {a: actions[i][j] for j, a in enumerate(self.agents) if a in live}
        else:
            mine = {a: actions[a][i] for a in live}
        obs, rewards, terms, truncs, infos = env.step(mine)
        for a in live:
            if a not in env.agents and not terms.get(a, False):
                self.truncated_exit[i] = True
        return self.pack(i, obs, rewards, terms, truncs), dict(infos), not env.agents

    def step(self, actions: Any) -> tuple[Any, ...]:
        results, finals = [], []
        for i in range(len(self.envs)):
            final = None
            if self.mode is AutoresetMode.NEXT_STEP and self.done[i]:
                packed, info = self.reset_env(i, None)
            else:
                packed, info, self.done[i] = self.step_env(i, actions)
                if self.mode is AutoresetMode.SAME_STEP and self.done[i]:
                    final = (packed, info)
                    packed, info = self.reset_env(i, None)
            results.append((packed, info))
            finals.append(final)
        return self.batch(results, finals)

    def batch(self, results: list[Any], finals: list[Any]) -> tuple[Any, ...]:
        n = len(results)
        packs = [r[0] for r in results]
        if self.stacked_obs:
            observations: Any = np.stack([p["observation"] for p in packs])
        else:
            observations = {a: np.stack([p["observation"][a] for p in packs]) for a in self.agents}
        last = [p if f is None else f[0] for p, f in zip(packs, finals, strict=True)]
        keys = ("reward", "terminated", "truncated")
        rows = {key: np.stack([p[key] for p in last]) for key in keys}
        infos: dict[str, Any] = {}
        vec = _info_batcher(n)
        for i, (_, info) in enumerate(results):
            infos = vec._add_info(infos, info, i)
        if any(f is not None for f in finals):
            final_infos: dict[str, Any] = {}
            for i, f in enumerate(finals):
                if f is not None:
                    final_infos = vec._add_info(final_infos, f[1], i)
            final_obs = np.array([None] * n, dtype=object)
            for i, f in enumerate(finals):
                if f is not None:
                    final_obs[i] = f[0]["observation"]
            infos["final_obs"], infos["_final_obs"] = (
                final_obs,
                np.array([f is not None for f in finals]),
            )
            infos["final_info"] = final_infos
            infos["_final_info"] = infos["_final_obs"].copy()
        infos["agent_mask"] = np.stack([p["agent_mask"] for p in packs])
        return observations, rows["reward"], rows["terminated"], rows["truncated"], infos

    def close(self) -> None:
        for env in self.envs:
            env.close()


def _same(spaces: list[gymnasium.Space[Any]]) -> bool:
    return all(s == spaces[0] for s in spaces)


def _info_batcher(n: int) -> Any:
    vec = gymnasium.vector.VectorEnv()
    vec.num_envs = n
    return vec


def assert_same(actual: Any, expected: Any, where: str = "") -> None:
    """Bit-identical trees: same keys, types, dtypes, shapes and values."""
    if isinstance(expected, tuple):
        assert isinstance(actual, tuple) and len(actual) == len(expected), where
        for k, (a, e) in enumerate(zip(actual, expected, strict=True)):
            assert_same(a, e, f"{where}[{k}]")
    elif isinstance(expected, dict):
        assert isinstance(actual, dict), where
        assert sorted(actual) == sorted(expected), f"{where}: {sorted(actual)}"
        for key in expected:
            assert_same(actual[key], expected[key], f"{where}[{key!r}]")
    elif isinstance(expected, np.ndarray) and expected.dtype == object:
        assert isinstance(actual, np.ndarray) and actual.shape == expected.shape, where
        for k in range(len(expected)):
            assert_same(actual[k], expected[k], f"{where}[{k}]")
    elif isinstance(expected, np.ndarray):
        assert isinstance(actual, np.ndarray), f"{where}: {type(actual)}"
        assert actual.dtype == expected.dtype, f"{where}: {actual.dtype} != {expected.dtype}"
        np.testing.assert_array_equal(actual, expected, err_msg=where, strict=True)
    else:
        assert actual == expected and type(actual) is type(expected), f"{where}: {actual!r}"


def steer(name: str, actions: Any, rng: np.random.Generator) -> Any:
    """``actions`` with kaz's archers sent "down" into the wall (``line_death``): they die
    early, apart (every other env's actions unchanged)."""
    if name == "kaz":
        actions[:, 0] = 1
        actions[:, 1] = np.where(rng.random(NUM_ENVS) < 0.2, 1, actions[:, 1])
    return actions


def run_differential(
    backend: str, name: str, mode: AutoresetMode, **kwargs: Any
) -> tuple[list[Any], list[Any]]:
    """Step ``make`` and the reference together; returns the masks seen, and per step which
    envs were autoreset on it (``SAME_STEP``)."""
    fn = ENVS[name]
    envs = envfleet.make(fn, NUM_ENVS, backend=backend, autoreset_mode=mode, **kwargs)
    ref = Reference(fn, NUM_ENVS, mode)
    masks, resets = [], []
    try:
        assert isinstance(envs, envfleet.MultiAgentVectorEnv)
        assert envs.possible_agents == tuple(ref.agents)
        assert_same(envs.reset(seed=SEED), ref.reset(SEED), "reset")
        envs.action_space.seed(SEED)
        rng = np.random.default_rng(SEED)
        for t in range(STEPS):
            actions = steer(name, envs.action_space.sample(), rng)
            got = envs.step(actions)
            want = ref.step(actions)
            for k, part in enumerate(("obs", "rewards", "terminated", "truncated", "infos")):
                assert_same(got[k], want[k], f"step {t} {part}")
            masks.append(got[4]["agent_mask"].copy())
            resets.append(got[4].get("_final_obs", np.zeros(NUM_ENVS, bool)).copy())
    finally:
        envs.close()
        ref.close()
    return masks, resets


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
@pytest.mark.parametrize("name", list(ENVS))
@pytest.mark.parametrize("backend", ["serial", "threads", "processes"])
def test_bit_identical_to_a_serial_loop(backend: str, name: str, mode: AutoresetMode) -> None:
    masks, resets = run_differential(backend, name, mode)
    # Each env exercises what it is here for: agents leaving one by one (black death) in kaz
    # and hetero, every agent at once in pistonball and world_comm, agents joining in swarm;
    # several episodes in every env.
    partial = [m for step in masks for m in step if m.any() and not m.all()]
    assert bool(partial) == (name in ("kaz", "hetero", "swarm"))
    joined = [
        (t, i)
        for t in range(1, len(masks))
        for i in range(NUM_ENVS)
        if masks[t - 1][i].any() and (masks[t][i] & ~masks[t - 1][i]).any() and not resets[t][i]
    ]
    assert bool(joined) == (name == "swarm")


@pytest.mark.ray
@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
@pytest.mark.parametrize("name", list(ENVS))
def test_bit_identical_on_ray(ray_cluster: Any, name: str, mode: AutoresetMode) -> None:
    run_differential("ray", name, mode, num_workers=2)


def aec_pistonball() -> Any:
    from pettingzoo.utils.conversions import aec_to_parallel

    return aec_to_parallel(pistonball_v6.env(n_pistons=3, max_cycles=7))


def test_an_aec_env_through_aec_to_parallel(monkeypatch: pytest.MonkeyPatch) -> None:
    """An AEC env goes through PettingZoo's ``aec_to_parallel`` (as the docs say) and is then
    stepped as any parallel env, bit-identical to the serial loop over the same conversion."""
    monkeypatch.setitem(ENVS, "aec", aec_pistonball)
    run_differential("processes", "aec", AutoresetMode.SAME_STEP)


def test_processes_without_driver_env_learns_the_agents_from_a_worker() -> None:
    """Env 0 built in a worker (driver_envs=0): its probe's metadata says multi-agent."""
    run_differential(envfleet.Processes(driver_envs=0), "hetero", AutoresetMode.NEXT_STEP)


def test_layouts() -> None:
    stacked = envfleet.make(pistonball, 2, backend="serial")
    hetero_envs = envfleet.make(hetero, 2, backend="serial")
    try:
        assert stacked.single_observation_space.shape == (4, 457, 120, 3)
        assert stacked.observation_space.shape == (2, 4, 457, 120, 3)
        assert stacked.action_space.shape == (2, 4, 1)
        assert list(hetero_envs.single_observation_space.spaces) == ["scout", "tank"]
        assert hetero_envs.observation_space["tank"].shape == (2, 2, 2)
        assert hetero_envs.action_space["scout"] == gymnasium.spaces.MultiDiscrete([4, 4])
        assert hetero_envs.get_attr("possible_agents") == (("scout", "tank"),) * 2
        assert hetero_envs.get_attr("max_cycles") == (6, 6)  # the ParallelEnv's own
        assert hetero_envs.num_envs == 2 and hetero_envs.num_agents == 2
    finally:
        stacked.close()
        hetero_envs.close()


@pytest.mark.parametrize("backend", ["serial", "processes"])
def test_bad_actions_raise_before_anything_is_sent(backend: str) -> None:
    """Wrong shapes, or a dict of actions without every agent, are refused at the front; the
    envs then continue exactly as the reference."""
    envs = envfleet.make(hetero, NUM_ENVS, backend=backend)
    ref = Reference(hetero, NUM_ENVS, AutoresetMode.NEXT_STEP)
    try:
        assert_same(envs.reset(seed=SEED), ref.reset(SEED))
        actions = envs.action_space.sample()
        with pytest.raises(envfleet.InvalidActionError, match="tank"):
            envs.step({"scout": actions["scout"]})
        with pytest.raises(envfleet.InvalidActionError, match="ghost"):
            envs.step({**actions, "ghost": actions["scout"]})
        with pytest.raises(envfleet.InvalidActionError, match="shape"):
            envs.step({**actions, "tank": actions["tank"][:, :1]})
        assert_same(envs.step(actions), ref.step(actions))
    finally:
        envs.close()
        ref.close()
    stacked = envfleet.make(pistonball, 2, backend=backend)
    try:
        stacked.reset(seed=0)
        with pytest.raises(envfleet.InvalidActionError, match="shape"):
            stacked.step(np.zeros((2, 3, 1), np.float32))
    finally:
        stacked.close()


@pytest.mark.parametrize("backend", ["serial", "processes"])
def test_an_agent_outside_possible_agents_is_an_env_error(backend: str) -> None:
    factory = functools.partial(make_faulty, "ghost", 1)
    envs = envfleet.make(factory, NUM_ENVS, backend=backend)
    try:
        envs.reset(seed=0)
        envs.step(envs.action_space.sample())
        with pytest.raises(envfleet.EnvError, match="ghost") as caught:
            envs.step(envs.action_space.sample())
        assert caught.value.env_index == 1 and caught.value.method == "step"
        assert "hetero_v0" in str(caught.value) and "AgentError" in str(caught.value)
    finally:
        envs.close()


def test_a_crashing_env_is_reported_with_its_index() -> None:
    envs = envfleet.make(functools.partial(make_faulty, "raise", 2), NUM_ENVS, backend="processes")
    try:
        envs.reset(seed=0)
        envs.step(envs.action_space.sample())
        with pytest.raises(envfleet.EnvError, match="boom") as caught:
            envs.step(envs.action_space.sample())
        assert caught.value.env_index == 2
    finally:
        envs.close()


def test_a_crashing_env_is_restarted_under_a_restart_policy() -> None:
    """The faulty env is rebuilt: it reads truncated for every agent with env_restarted and a
    fresh episode (every agent live); the others step on."""
    envs = envfleet.make(
        functools.partial(make_faulty, "raise", 1),
        NUM_ENVS,
        backend="processes",
        supervision=envfleet.Supervision(
            restart_policy=envfleet.RestartPolicy(restart_on=(Exception,), max_restarts=2)
        ),
    )
    try:
        envs.reset(seed=0)
        envs.step(envs.action_space.sample())
        obs, rewards, terminated, truncated, infos = envs.step(envs.action_space.sample())
        assert infos["_env_restarted"].tolist() == [False, True, False]
        assert truncated[1].all() and not terminated[1].any()
        assert infos["agent_mask"][1].all()
        assert rewards.shape == (NUM_ENVS, 2)
        envs.step(envs.action_space.sample())  # and it steps on
    finally:
        envs.close()


def test_single_agent_envs_are_unchanged() -> None:
    envs = envfleet.make("CartPole-v1", 2, backend="serial")
    try:
        assert type(envs) is envfleet.FleetVectorEnv
        assert "envfleet.multi_agent" not in envs.metadata
    finally:
        envs.close()


def _rows(batch: Any, i: int) -> Any:
    """Env ``i``'s row of a batched observation (stacked, or a dict by agent)."""
    if isinstance(batch, dict):
        return {agent: value[i] for agent, value in batch.items()}
    return batch[i]


@pytest.mark.parametrize("name", list(ENVS))
@pytest.mark.parametrize("backend", ["serial", "processes"])
def test_disabled_autoreset_with_reset_masks_is_bit_identical(backend: str, name: str) -> None:
    """``AutoresetMode.DISABLED``: an env whose agents are all gone is reset through
    ``reset(options={"reset_mask": ...})`` (gymnasium's way), and only it: every step and every
    masked reset equals the serial loop over the raw ParallelEnvs."""
    fn = ENVS[name]
    mode = AutoresetMode.DISABLED
    envs = envfleet.make(fn, NUM_ENVS, backend=backend, autoreset_mode=mode)
    ref = Reference(fn, NUM_ENVS, mode)
    resets = 0
    try:
        assert_same(envs.reset(seed=SEED), ref.reset(SEED), "reset")
        envs.action_space.seed(SEED)
        rng = np.random.default_rng(SEED)
        for t in range(STEPS):
            actions = steer(name, envs.action_space.sample(), rng)
            got = envs.step(actions)
            want = ref.step(actions)
            for k, part in enumerate(("obs", "rewards", "terminated", "truncated", "infos")):
                assert_same(got[k], want[k], f"step {t} {part}")
            done = ~got[4]["agent_mask"].any(axis=1)
            if not done.any():
                continue
            resets += 1
            obs, infos = envs.reset(options={"reset_mask": done})
            for i in np.flatnonzero(done).tolist():
                packed, info = ref.reset_env(i, None)
                assert_same(_rows(obs, i), packed["observation"], f"reset {t} env {i}")
                np.testing.assert_array_equal(infos["agent_mask"][i], packed["agent_mask"])
            for i in np.flatnonzero(~done).tolist():  # the others kept their observation
                assert_same(_rows(obs, i), _rows(got[0], i), f"reset {t} kept env {i}")
    finally:
        envs.close()
        ref.close()
    assert resets > 0, "no episode ended: the test saw no masked reset"
