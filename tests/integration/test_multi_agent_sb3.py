"""Agents as envs through :class:`envfleet.adapters.sb3.SB3VecEnv` (issue 20, item 4): a
factory returning a PettingZoo ParallelEnv gives ``num_envs * num_agents`` SB3 rows, row
``i * A + j`` = env ``i``, agent ``j``, SuperSuit's layout.

Two references, the same seeds and actions:

- SuperSuit's own ``concat_vec_envs_v1(pettingzoo_env_to_vec_env_v1(env), N, num_cpus=0,
  base_class="stable_baselines3")``: observations, rewards, dones and terminal observations
  bit-identical on pistonball. On knights-archers-zombies, whose agents die early, SuperSuit
  needs its ``black_death_v3`` wrapper (used on its side only); that wrapper reports no done
  for an agent that dies, and ends the env's episode one step after the env ended it (it
  tests ``terminated & truncated``), so there observations and rewards are compared with
  SuperSuit until the first episode ends, and everything else with the loop below.
- :class:`RowsReference`, a serial loop over the raw ParallelEnvs written from the documented
  semantics (SB3VecEnv's docstring): every field, every step, both envs, several episodes.
"""

from __future__ import annotations

import importlib.util
import math
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest

import envfleet

pytest.importorskip("stable_baselines3")
pytest.importorskip("pettingzoo.butterfly")
ss = pytest.importorskip("supersuit")
torch = pytest.importorskip("torch")

from pettingzoo.butterfly import knights_archers_zombies_v11, pistonball_v6  # noqa: E402
from pettingzoo.utils.wrappers import BaseParallelWrapper  # noqa: E402
from stable_baselines3 import PPO  # noqa: E402
from stable_baselines3.common.vec_env import VecCheckNan  # noqa: E402
from stable_baselines3.common.vec_env.base_vec_env import tile_images  # noqa: E402

from envfleet.adapters.sb3 import SB3VecEnv  # noqa: E402
from tests.multi_agent_envs import HeteroEnv  # noqa: E402

NUM_ENVS = 3
STEPS = 40
SEED = 5


def pistonball() -> Any:
    # 3 pistons: the ball often reaches the left wall within a few steps (terminated), and
    # max_cycles ends the others (truncated)
    return pistonball_v6.parallel_env(n_pistons=3, max_cycles=6)


def kaz() -> Any:
    # line_death: an agent that touches the top or bottom wall dies (the actions steer them)
    return knights_archers_zombies_v11.parallel_env(line_death=True, max_cycles=30)


def kaz_black_death() -> Any:
    return ss.black_death_v3(kaz())


def supersuit_envs(fn: Any) -> Any:
    return ss.concat_vec_envs_v1(
        ss.pettingzoo_env_to_vec_env_v1(fn()), NUM_ENVS, num_cpus=0, base_class="stable_baselines3"
    )


class RowsReference:
    """The documented row semantics over raw ParallelEnvs, one after the other."""

    def __init__(self, fn: Any, num_envs: int):
        self.envs = [fn() for _ in range(num_envs)]
        self.agents = list(self.envs[0].possible_agents)
        self.space = self.envs[0].observation_space(self.agents[0])
        self.reset_infos: list[dict[str, Any]] = []
        self.ended: list[int] = []  # the envs whose episode ended at the last step

    def rows(self, obs: dict[str, Any]) -> list[Any]:
        zero = np.zeros(self.space.shape, self.space.dtype)
        return [obs.get(a, zero) for a in self.agents]

    def reset(self, seed: int) -> np.ndarray:
        rows, self.reset_infos = [], []
        for i, env in enumerate(self.envs):
            obs, infos = env.reset(seed=seed + i)
            rows += self.rows(obs)
            self.reset_infos += [dict(infos.get(a, {})) for a in self.agents]
        return np.stack(rows)

    def step(self, actions: np.ndarray) -> tuple[Any, ...]:
        num = len(self.agents)
        rows, rewards, dones, row_infos = [], [], [], []
        self.ended = []
        for i, env in enumerate(self.envs):
            live = list(env.agents)
            mine = {a: actions[i * num + j] for j, a in enumerate(self.agents) if a in live}
            obs, rew, terms, truncs, infos = env.step(mine)
            env_rows = self.rows(obs)
            for j, a in enumerate(self.agents):
                term, trunc = bool(terms.get(a, False)), bool(truncs.get(a, False))
                info = dict(infos.get(a, {}))
                info["TimeLimit.truncated"] = trunc and not term
                if term or trunc:
                    info["terminal_observation"] = env_rows[j]
                rewards.append(np.float32(rew.get(a, 0.0)))
                dones.append(term or trunc)
                row_infos.append(info)
            if not env.agents:  # the episode ended: reset at once
                self.ended.append(i)
                obs, infos = env.reset()
                env_rows = self.rows(obs)
                for j, a in enumerate(self.agents):
                    self.reset_infos[i * num + j] = dict(infos.get(a, {}))
            rows += env_rows
        return np.stack(rows), np.array(rewards, np.float32), np.array(dones), row_infos

    def close(self) -> None:
        for env in self.envs:
            env.close()


def assert_array_same(actual: Any, expected: Any, where: str) -> None:
    assert isinstance(actual, np.ndarray), f"{where}: {type(actual)}"
    assert actual.dtype == expected.dtype, f"{where}: {actual.dtype} != {expected.dtype}"
    np.testing.assert_array_equal(actual, expected, err_msg=where, strict=True)


def assert_infos_same(actual: list[dict[str, Any]], expected: list[dict[str, Any]], where: str):
    assert len(actual) == len(expected), where
    for row, (got, want) in enumerate(zip(actual, expected, strict=True)):
        assert sorted(got) == sorted(want), f"{where} row {row}: {sorted(got)} != {sorted(want)}"
        for key, value in want.items():
            if isinstance(value, np.ndarray):
                assert_array_same(got[key], value, f"{where} row {row} {key}")
            else:
                assert got[key] == value and type(got[key]) is type(value), f"{where} {key}"


def actions_for(name: str, venv: SB3VecEnv, rng: np.random.Generator) -> np.ndarray:
    actions = np.stack([venv.action_space.sample() for _ in range(venv.num_envs)])
    if name == "kaz":  # archer_0 walks "down" into the wall; archer_1 now and then (line_death)
        num = venv.num_envs // NUM_ENVS
        actions[0::num] = 1
        actions[1::num] = np.where(rng.random(NUM_ENVS) < 0.2, 1, actions[1::num])
    return actions


@pytest.mark.parametrize("backend", ["serial", "processes"])
def test_pistonball_is_bit_identical_to_supersuit(backend: str) -> None:
    venv = SB3VecEnv(pistonball, NUM_ENVS, backend=backend)
    theirs = supersuit_envs(pistonball)
    ref = RowsReference(pistonball, NUM_ENVS)
    ends = 0
    try:
        assert venv.num_envs == theirs.num_envs == NUM_ENVS * 3
        assert venv.observation_space == theirs.observation_space
        assert venv.action_space == theirs.action_space
        assert venv.seed(SEED) == [SEED + row // 3 for row in range(venv.num_envs)]
        obs = venv.reset()
        their_obs, their_reset_infos = theirs.venv.reset(seed=SEED)  # SuperSuit's seeding
        assert_array_same(obs, their_obs, "reset")
        assert_array_same(obs, ref.reset(SEED), "reset (reference)")
        assert venv.reset_infos == their_reset_infos == ref.reset_infos
        venv.action_space.seed(SEED)
        rng = np.random.default_rng(SEED)
        for t in range(STEPS):
            actions = actions_for("pistonball", venv, rng)
            if t % 2:
                got = venv.step(actions)
            else:  # SB3's two-call form
                venv.step_async(actions)
                got = venv.step_wait()
            want = theirs.step(actions)
            where = f"step {t}"
            for k, part in enumerate(("obs", "rewards")):
                assert_array_same(got[k], want[k], f"{where} {part}")
            # SuperSuit's dones are uint8 on one process (its ConcatVecEnv), bool on several
            assert_array_same(got[2], want[2].astype(bool), f"{where} dones")
            # its infos: the agent's, terminal_observation when the env ended; no SB3 key
            mine = [{k: v for k, v in i.items() if k != "TimeLimit.truncated"} for i in got[3]]
            assert_infos_same(mine, want[3], where)
            ref_obs, ref_rewards, ref_dones, ref_infos = ref.step(actions)
            assert_array_same(got[0], ref_obs, f"{where} obs (reference)")
            assert_array_same(got[1], ref_rewards, f"{where} rewards (reference)")
            assert_array_same(got[2], ref_dones, f"{where} dones (reference)")
            assert_infos_same(got[3], ref_infos, f"{where} (reference)")
            assert venv.reset_infos == ref.reset_infos
            ends += int(got[2].sum())
        assert ends >= NUM_ENVS * 3  # several episodes ended in every env
    finally:
        venv.close()
        theirs.close()
        ref.close()


@pytest.mark.parametrize("backend", ["serial", "processes"])
def test_agents_that_die_early(backend: str) -> None:
    """knights-archers-zombies: archers die apart (black death rows); observations and rewards
    equal SuperSuit's (with black_death_v3) until the first episode ends; every field equals
    the reference loop at every step."""
    venv = SB3VecEnv(kaz, NUM_ENVS, backend=backend)
    theirs = supersuit_envs(kaz_black_death)
    ref = RowsReference(kaz, NUM_ENVS)
    compared, deaths, episodes = 0, 0, 0
    try:
        venv.seed(SEED)
        obs = venv.reset()
        assert_array_same(obs, theirs.venv.reset(seed=SEED)[0], "reset")
        assert_array_same(obs, ref.reset(SEED), "reset (reference)")
        venv.action_space.seed(SEED)
        rng = np.random.default_rng(SEED)
        for t in range(STEPS):
            actions = actions_for("kaz", venv, rng)
            got = venv.step(actions)
            ref_obs, ref_rewards, ref_dones, ref_infos = ref.step(actions)
            where = f"step {t}"
            assert_array_same(got[0], ref_obs, f"{where} obs (reference)")
            assert_array_same(got[1], ref_rewards, f"{where} rewards (reference)")
            assert_array_same(got[2], ref_dones, f"{where} dones (reference)")
            assert_infos_same(got[3], ref_infos, where)
            assert venv.reset_infos == ref.reset_infos
            if episodes == 0:
                want = theirs.step(actions)
                if not ref.ended:  # SuperSuit's (black_death_v3) episodes end a step late
                    assert_array_same(got[0], want[0], f"{where} obs (SuperSuit)")
                    assert_array_same(got[1], want[1], f"{where} rewards (SuperSuit)")
                    compared += 1
                    deaths += int(got[2].sum())  # no episode ended: each done is a death
            episodes += len(ref.ended)
        assert compared >= 10 and deaths >= 2  # agents died while SuperSuit was compared
        assert episodes >= NUM_ENVS
    finally:
        venv.close()
        theirs.close()
        ref.close()


def test_heterogeneous_agents_are_refused() -> None:
    with pytest.raises(envfleet.ConfigError, match="shared by every agent"):
        SB3VecEnv(HeteroEnv, 2, backend="serial")


def rgb_pistonball() -> Any:
    return pistonball_v6.parallel_env(n_pistons=3, max_cycles=6, render_mode="rgb_array")


def test_attributes_methods_seeds_and_render_by_row() -> None:
    venv = SB3VecEnv(rgb_pistonball, 2, backend="serial")
    try:
        assert venv.num_envs == 6 and venv.render_mode == "rgb_array"
        venv.seed(SEED)
        venv.reset()
        assert (
            venv.get_attr("possible_agents", [0, 5]) == [["piston_0", "piston_1", "piston_2"]] * 2
        )
        venv.set_attr("envfleet_probe", 7, indices=[4])  # env 1's ParallelEnv, once
        assert venv.get_attr("envfleet_probe", [3, 4, 5]) == [7, 7, 7]
        with pytest.raises(AttributeError):
            venv.get_attr("envfleet_probe", [2])
        states = venv.env_method("state", indices=[0, 3])
        assert len(states) == 2 and states[0].shape == states[1].shape
        assert not np.array_equal(states[0], states[1])  # seeds SEED and SEED + 1
        assert venv.env_is_wrapped(envfleet.FleetVectorEnv) == [False] * 6
        images = venv.get_images()
        assert len(images) == 6 and images[0] is images[2] and images[3] is images[5]
        frame = venv.render()
        assert frame is not None
        np.testing.assert_array_equal(frame, tile_images([images[0], images[3]]))
    finally:
        venv.close()


def small_pistonball() -> Any:
    env = pistonball_v6.parallel_env(n_pistons=3, max_cycles=20)
    env = ss.color_reduction_v0(env, mode="B")
    return ss.resize_v1(env, x_size=16, y_size=16)


def test_ppo_learns_through_agent_rows() -> None:
    """SB3's PPO (MlpPolicy) over the rows, NaN/inf checked by SB3's VecCheckNan: it runs a
    few hundred agent steps, its losses are finite and its parameters change."""
    venv = SB3VecEnv(small_pistonball, 2, backend="serial")
    try:
        model = PPO(
            "MlpPolicy",
            VecCheckNan(venv, raise_exception=True),
            n_steps=32,
            batch_size=64,
            n_epochs=2,
            seed=SEED,
        )
        before = {k: v.clone() for k, v in model.policy.state_dict().items()}
        model.learn(total_timesteps=300, log_interval=1)
        assert model.num_timesteps == 384  # 2 rollouts of 32 steps x 6 rows
        losses = {k: v for k, v in model.logger.name_to_value.items() if k.endswith("loss")}
        assert "train/loss" in losses and all(math.isfinite(v) for v in losses.values())
        after = model.policy.state_dict()
        changed = [
            k for k, v in before.items() if v.is_floating_point() and not torch.equal(v, after[k])
        ]
        assert changed and "action_net.weight" in changed
    finally:
        venv.close()


# -- examples/ppo_pistonball.py ------------------------------------------------------------


@pytest.fixture(scope="module")
def ppo_pistonball() -> Iterator[ModuleType]:
    path = Path(__file__).resolve().parents[2] / "examples" / "ppo_pistonball.py"
    spec = importlib.util.spec_from_file_location("envfleet_examples_ppo_pistonball", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    # The factory must reach worker processes, which cannot import a module loaded from a
    # file path: pickle it by value, as cloudpickle does for a script's __main__.
    cloudpickle = pytest.importorskip("cloudpickle")
    cloudpickle.register_pickle_by_value(module)
    yield module
    cloudpickle.unregister_pickle_by_value(module)


def test_ppo_pistonball_smoke(ppo_pistonball: ModuleType) -> None:
    """The example on processes, small: 2 envs x 3 pistons, 48 x 48 observations, two
    rollouts of 32 steps: the steps asked for are taken and SB3's losses are finite."""
    argv = [
        *("--total-timesteps", "300", "--num-envs", "2", "--n-pistons", "3"),
        *("--max-cycles", "20", "--size", "48", "--n-steps", "32", "--batch-size", "64"),
        *("--n-epochs", "1", "--verbose", "0"),
    ]
    result = ppo_pistonball.main(argv)
    assert result["rows"] == 6 and result["steps"] == 384
    assert result["losses"] and all(math.isfinite(v) for v in result["losses"].values())


class CrashOnce(BaseParallelWrapper):  # type: ignore[misc]
    """Pistonball that raises at its second step."""

    def __init__(self, env: Any):
        super().__init__(env)
        self.steps = 0

    def step(self, actions: dict[str, Any]) -> Any:
        self.steps += 1
        if self.steps == 2:
            raise RuntimeError("crash once: boom")
        return super().step(actions)


def crashing_pistonball(env_index: int) -> Any:
    env = pistonball_v6.parallel_env(n_pistons=3, max_cycles=50)
    return CrashOnce(env) if env_index == 1 else env


def test_a_restarted_env_ends_its_rows_episodes() -> None:
    """Under a restart policy, env 1 is rebuilt at its second step: its rows are done,
    truncated, with env_restarted and the new episode's first observation as terminal one."""
    venv = SB3VecEnv(
        crashing_pistonball,
        NUM_ENVS,
        backend="processes",
        supervision=envfleet.Supervision(
            restart_policy=envfleet.RestartPolicy(restart_on=(Exception,), max_restarts=1)
        ),
    )
    try:
        venv.seed(SEED)
        venv.reset()
        actions = np.zeros((venv.num_envs, 1), np.float32)
        venv.step(actions)
        obs, rewards, dones, infos = venv.step(actions)
        assert dones[3:6].all()  # (the other envs may end their episodes on their own)
        for row in (3, 4, 5):
            assert infos[row]["env_restarted"] is True
            assert infos[row]["TimeLimit.truncated"] is True
            assert_array_same(infos[row]["terminal_observation"], obs[row], f"row {row}")
        assert all("env_restarted" not in infos[row] for row in (0, 1, 2, 6, 7, 8))
    finally:
        venv.close()
