"""PettingZoo parallel envs in a first-ready pool (``batch_size < num_envs``: EnvPool's
``async_reset``/``send``/``recv``) and with ``output="torch"`` (issue 20): each env's rows
equal the serial reference loop over the raw ParallelEnvs (``tests.integration.
test_multi_agent.Reference``) with the same seeds and actions, in whatever order the pool
hands the envs back; torch output equals numpy output.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from gymnasium.vector import AutoresetMode

import envfleet

pytest.importorskip("pettingzoo.butterfly")

from tests.integration.test_multi_agent import ENVS, SEED, Reference, assert_same  # noqa: E402

NUM_ENVS = 4
BATCH = 2
RECVS = 60


class _Rows:
    """The batch of one env's actions, seen through ``Reference.step_env``'s ``actions[i]``."""

    def __init__(self, row: Any):
        self.row = row

    def __getitem__(self, i: int) -> Any:
        return self.row


def _row(batch: Any, k: int) -> Any:
    if isinstance(batch, dict):
        return {agent: value[k] for agent, value in batch.items()}
    return batch[k]


def _ref_step(ref: Reference, i: int, action: Any, mode: AutoresetMode) -> tuple[Any, ...]:
    """Env ``i`` of the reference, one pool step with ``action`` (one env's actions)."""
    if isinstance(action, dict):
        actions: Any = {agent: _Rows(value) for agent, value in action.items()}
    else:
        actions = _Rows(action)
    if mode is AutoresetMode.NEXT_STEP and ref.done[i]:
        packed, _ = ref.reset_env(i, None)
        return packed["observation"], packed, packed
    packed, _, ref.done[i] = ref.step_env(i, actions)
    if mode is AutoresetMode.SAME_STEP and ref.done[i]:
        reset, _ = ref.reset_env(i, None)
        return reset["observation"], packed, reset
    return packed["observation"], packed, packed


@pytest.mark.parametrize("mode", [AutoresetMode.NEXT_STEP, AutoresetMode.SAME_STEP], ids=str)
@pytest.mark.parametrize("name", list(ENVS))
def test_pool_rows_equal_the_reference(name: str, mode: AutoresetMode) -> None:
    """recv -> actions -> send on processes with one env per worker: every env handed back
    has the observation, per-agent rewards and flags and agent mask the reference gives it."""
    fn = ENVS[name]
    envs = envfleet.make(
        fn,
        NUM_ENVS,
        backend="processes",
        batch_size=BATCH,
        num_workers=NUM_ENVS,
        autoreset_mode=mode,
    )
    ref = Reference(fn, NUM_ENVS, mode)
    want: dict[int, tuple[Any, ...]] = {}
    for i in range(NUM_ENVS):
        packed, _ = ref.reset_env(i, SEED + i)
        want[i] = (packed["observation"], packed, packed)
    seen, ended = set(), 0
    try:
        assert envs.is_pool and envs.batch_size == BATCH
        envs.async_reset(seed=SEED)
        envs.action_space.seed(SEED)
        for r in range(RECVS):
            obs, rewards, terminated, truncated, infos = envs.recv()
            env_ids = infos["env_id"]
            assert rewards.shape == (BATCH, len(ref.agents)) and rewards.dtype == np.float64
            for k, i in enumerate(env_ids.tolist()):
                observation, last, now = want[i]
                where = f"recv {r} env {i}"
                assert_same(_row(obs, k), observation, where)
                np.testing.assert_array_equal(rewards[k], last["reward"], err_msg=where)
                np.testing.assert_array_equal(terminated[k], last["terminated"], err_msg=where)
                np.testing.assert_array_equal(truncated[k], last["truncated"], err_msg=where)
                np.testing.assert_array_equal(infos["agent_mask"][k], now["agent_mask"], where)
                ended += bool(last["terminated"].any() or last["truncated"].any())
                seen.add(i)
            actions = envs.action_space.sample()  # [num_envs, ...]: the first BATCH rows
            batch = (
                {agent: value[:BATCH] for agent, value in actions.items()}
                if isinstance(actions, dict)
                else actions[:BATCH]
            )
            if name == "kaz":  # "down" into the wall (line_death): the first agent dies early
                batch[:, 0] = 1
            for k, i in enumerate(env_ids.tolist()):
                want[i] = _ref_step(ref, i, _row(batch, k), mode)
            envs.send(batch, env_ids)
    finally:
        envs.close()
        ref.close()
    assert seen == set(range(NUM_ENVS)), "an env never came back"
    assert ended > 0, "no agent finished: the test saw no episode end"


def test_pool_refuses_bad_actions_before_sending() -> None:
    envs = envfleet.make(ENVS["hetero"], NUM_ENVS, backend="serial", batch_size=BATCH)
    try:
        envs.async_reset(seed=SEED)
        _, _, _, _, infos = envs.recv()
        actions = envs.action_space.sample()
        partial = {agent: value[:BATCH] for agent, value in list(actions.items())[:-1]}
        with pytest.raises(envfleet.InvalidActionError, match="no actions for agent"):
            envs.send(partial, infos["env_id"])
        batch = {agent: value[:BATCH] for agent, value in actions.items()}
        envs.send(batch, infos["env_id"])  # as if the bad call never happened
        envs.recv()
    finally:
        envs.close()


@pytest.mark.parametrize("backend", ["serial", "processes"])
@pytest.mark.parametrize("name", list(ENVS))
def test_torch_output_equals_numpy_output(name: str, backend: str) -> None:
    torch = pytest.importorskip("torch")
    fn = ENVS[name]
    mode = AutoresetMode.SAME_STEP
    tenvs = envfleet.make(fn, 3, backend=backend, output="torch", autoreset_mode=mode)
    nenvs = envfleet.make(fn, 3, backend="serial", autoreset_mode=mode)

    def numpy_of(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: numpy_of(v) for k, v in value.items()}
        assert isinstance(value, torch.Tensor)
        return value.numpy()

    try:
        tobs, tinfo = tenvs.reset(seed=SEED)
        nobs, ninfo = nenvs.reset(seed=SEED)
        assert_same(numpy_of(tobs), nobs, "reset")
        np.testing.assert_array_equal(tinfo["agent_mask"], ninfo["agent_mask"])
        nenvs.action_space.seed(SEED)
        for t in range(25):
            actions = nenvs.action_space.sample()
            got, want = tenvs.step(actions), nenvs.step(actions)
            for k in range(4):
                assert_same(numpy_of(got[k]), want[k], f"step {t} [{k}]")
            np.testing.assert_array_equal(got[4]["agent_mask"], want[4]["agent_mask"])
    finally:
        tenvs.close()
        nenvs.close()


def test_tensordicts_are_per_agent() -> None:
    pytest.importorskip("tensordict")
    envs = envfleet.make(ENVS["pistonball"], 2, backend="serial", output="torch")
    try:
        td = envs.reset_tensordict(seed=SEED)
        agents = len(envs.possible_agents)
        assert td["observation"].shape[:2] == (2, agents)
        assert td["done"].shape == (2, agents, 1) and not td["done"].any()
        assert td["agent_mask"].all()
        actions = envs.action_space.sample()
        td = envs.step_tensordict(actions)
        for key in ("reward", "terminated", "truncated", "done"):
            assert td[key].shape == (2, agents, 1), key
        assert td["agent_mask"].shape == (2, agents)
    finally:
        envs.close()


def test_torchrl_env_refuses_a_multi_agent_env() -> None:
    pytest.importorskip("torchrl")
    from envfleet.adapters.torchrl import FleetTorchRLEnv

    venv = envfleet.make(
        ENVS["pistonball"], 2, backend="serial", autoreset_mode=AutoresetMode.DISABLED
    )
    try:
        with pytest.raises(envfleet.ConfigError, match="single-agent"):
            FleetTorchRLEnv(venv)
    finally:
        venv.close()
