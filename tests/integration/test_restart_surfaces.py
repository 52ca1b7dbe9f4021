"""The restart default on every surface a user trains with: a real segfault (a write at address
0) in one env's 5th step, once, no option set, and the run goes on.

The first-ready pool, the Sampler in both inference modes, ``ProcessEnv``, stable-baselines3's
``VecEnv`` and TorchRL's ``EnvBase`` are each built on ``envfleet.make()``'s defaults
(``RestartPolicy()``): the crash restarts the env (``env_restarted``, truncated), one
``EnvRestartedWarning`` says so, and the next steps run.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

import numpy as np
import pytest

import envfleet
from tests.envs import fault_at


def _segfault(tmp_path: Any, index: int = 1) -> Any:
    """A CartPole factory whose env ``index`` segfaults in its 5th step, once per test."""
    return fault_at("CartPole-v1", index, "null-write", 5, marker=str(tmp_path / "faulted"))


def _restarts(run: Any) -> tuple[Any, list[str]]:
    """``run()`` with every EnvRestartedWarning recorded: its result and the warnings."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", envfleet.EnvRestartedWarning)
        result = run()
    return result, [
        str(w.message) for w in caught if issubclass(w.category, envfleet.EnvRestartedWarning)
    ]


def test_the_pool_restarts_by_default(tmp_path: Any) -> None:
    envs = envfleet.make(_segfault(tmp_path), 4, batch_size=2)

    def run() -> list[int]:
        envs.async_reset(seed=0)
        restarted: list[int] = []
        after = 0  # recv calls since the restart came back
        for _ in range(5000):  # a first-ready pool may serve one worker for a while
            _, _, _, truncated, info = envs.recv()
            if "env_restarted" in info:
                restarted += [int(e) for e in info["env_id"][info["_env_restarted"]]]
                assert truncated[info["_env_restarted"]].all()
            envs.send(np.zeros(2, np.int64), info["env_id"])
            after += bool(restarted)
            if after > 20:
                break
        return restarted

    try:
        restarted, warned = _restarts(run)
    finally:
        envs.close()
    assert restarted == [1] and len(warned) == 1 and "SIGSEGV" in warned[0]


@pytest.mark.parametrize("inference", ["driver", "worker"])
def test_the_sampler_restarts_by_default(tmp_path: Any, inference: str) -> None:
    def policy(obs: Any) -> Any:
        return (obs[:, 2] > 0).astype(np.int64)

    with envfleet.Sampler(_segfault(tmp_path), policy, 4, inference=inference, seed=0) as sampler:
        batches, warned = _restarts(lambda: [sampler.sample(32) for _ in range(4)])
    assert len(warned) == 1 and "SIGSEGV" in warned[0]
    assert len(batches) == 4 and all(b.num_steps >= 32 for b in batches)


def test_process_env_restarts_by_default(tmp_path: Any) -> None:
    penv = envfleet.ProcessEnv(functools.partial(_segfault(tmp_path, 0), env_index=0))

    def run() -> list[Any]:
        penv.reset(seed=0)
        steps = []
        for _ in range(12):
            steps.append(penv.step(0))
            if steps[-1][2] or steps[-1][3]:
                penv.reset()
        return steps

    try:
        steps, warned = _restarts(run)
    finally:
        penv.close()
    restarted = [k for k, (*_, info) in enumerate(steps) if info.get("env_restarted")]
    assert restarted == [4] and steps[4][3] is True and len(warned) == 1


def test_sb3_restarts_by_default(tmp_path: Any) -> None:
    pytest.importorskip("stable_baselines3")
    from envfleet.adapters.sb3 import SB3VecEnv

    venv = SB3VecEnv(_segfault(tmp_path, 0), 2)

    def run() -> list[Any]:
        venv.reset()
        out = []
        for _ in range(8):
            venv.step_async(np.zeros(2, np.int64))
            out.append(venv.step_wait())
        return out

    try:
        steps, warned = _restarts(run)
    finally:
        venv.close()
    _, _, done, infos = steps[4]
    assert done[0] and infos[0].get("TimeLimit.truncated") is True and len(warned) == 1


def test_torchrl_restarts_by_default(tmp_path: Any) -> None:
    pytest.importorskip("torchrl")
    from envfleet.adapters.torchrl import make_torchrl_env

    env = make_torchrl_env(_segfault(tmp_path), 4)
    try:
        rollout, warned = _restarts(lambda: env.rollout(8, break_when_any_done=False))
    finally:
        env.close()
    truncated = rollout["next", "truncated"].squeeze(-1)
    assert bool(truncated[1, 4]) and len(warned) == 1


def test_close_restarts_nothing(tmp_path: Any) -> None:
    """A worker that dies while ``close()`` lets the pool's pending steps finish is not
    rebuilt on the way out: no restart, no warning, and close returns."""
    envs = envfleet.make(_first_step_fault(tmp_path), 4, batch_size=2)
    envs.async_reset(seed=0)
    sent = set()
    while 1 not in sent:  # until env 1 is sent the action it dies of (its 1st step)
        info = envs.recv()[-1]
        envs.send(np.zeros(2, np.int64), info["env_id"])
        sent.update(int(e) for e in info["env_id"])
    (_, warned) = _restarts(lambda: envs.close())
    assert warned == [] and envs.stats.restarts == 0


def _first_step_fault(tmp_path: Any) -> Any:
    return fault_at("CartPole-v1", 1, "null-write", 1, marker=str(tmp_path / "faulted"))
