"""Regression tests of issue 17's input and identity defects: an env that reuses its info
dict under SAME_STEP autoreset, bad input that reached the envs, ``"module:EnvId"`` ids, a
fork after make().

Differential against gymnasium's SyncVectorEnv where results are compared.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import gymnasium as gym
import numpy as np
import pytest
from gymnasium import spaces
from gymnasium.vector import AutoresetMode, SyncVectorEnv

import envfleet
from tests.helpers import assert_same


class ReusedInfoEnv(gym.Env):
    """Returns one info dict object from every step and reset, changed in place each time
    (a scalar, an array and a nested dict); episodes of ``3 + env_index`` steps."""

    def __init__(self, env_index: int = 0):
        self.env_index = env_index
        self.observation_space = spaces.Box(-1.0, 1.0, (2,), np.float32)
        self.action_space = spaces.Discrete(2)
        self.info: dict[str, Any] = {"where": {}, "trace": np.zeros(2)}
        self.t = 0

    def _fill(self, phase: str) -> dict[str, Any]:
        self.info["phase"] = phase
        self.info["t"] = self.t
        self.info["trace"][:] = (self.t, self.env_index)  # the same array, changed in place
        self.info["where"]["phase"] = phase  # the same nested dict
        return self.info

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        self.t = 0
        return self.np_random.uniform(-1, 1, 2).astype(np.float32), self._fill("reset")

    def step(self, action: Any):
        self.t += 1
        obs = self.np_random.uniform(-1, 1, 2).astype(np.float32)
        return obs, float(self.t), self.t >= 3 + self.env_index, False, self._fill("step")


def _reused_info_fns(num_envs: int) -> list[Any]:
    return [lambda k=k: ReusedInfoEnv(k) for k in range(num_envs)]


def reused_info_modes(backend: Any) -> list[AutoresetMode]:
    return list(AutoresetMode) if backend.cheap else [AutoresetMode.SAME_STEP]


@pytest.mark.per_backend("mode", reused_info_modes)
def test_env_reusing_its_info_dict_matches_sync(
    backend: Any, mode: AutoresetMode, make_env: Any
) -> None:
    """Issue 17 item 9: under SAME_STEP, final_info showed the reset's values (the env had
    changed the dict in place since the step that ended the episode)."""
    num_envs = 3
    ref = SyncVectorEnv(_reused_info_fns(num_envs), autoreset_mode=mode)
    envs = make_env(_reused_info_fns(num_envs), num_envs, **backend.options, autoreset_mode=mode)
    assert_same(envs.reset(seed=0), ref.reset(seed=0), "reset")
    ended = np.zeros(num_envs, dtype=bool)
    for i in range(12):
        if mode is AutoresetMode.DISABLED and ended.any():
            mask = {"reset_mask": ended}
            assert_same(envs.reset(options=mask), ref.reset(options=mask), f"reset {i}")
        actions = np.zeros(num_envs, dtype=np.int64)
        want = ref.step(actions)
        assert_same(envs.step(actions), want, f"step {i}")
        ended = want[2] | want[3]
    ref.close()


MODULE_ID = "tests.envs_registered:EnvfleetTest/ShortCartPole-v0"


def _forget_registered_module() -> None:
    """As in a fresh interpreter: neither the module nor its id are known."""
    sys.modules.pop("tests.envs_registered", None)
    gym.registry.pop("EnvfleetTest/ShortCartPole-v0", None)


def test_module_colon_env_id_imports_the_module(backend: Any, make_env: Any) -> None:
    """Issue 17 item 11: "module:EnvId" ids failed with ConfigError: unknown environment id;
    now the driver and every worker import the module first, as gymnasium.make does."""
    _forget_registered_module()
    kwargs = {"num_workers": 2} if "context" in backend.options else {}
    envs = make_env(MODULE_ID, 2, **backend.options, **kwargs)
    ref = SyncVectorEnv([lambda: gym.make(MODULE_ID) for _ in range(2)])
    assert_same(envs.reset(seed=3), ref.reset(seed=3), "reset")
    for i in range(25):  # past the registered 20-step limit
        actions = np.array([i % 2, 1 - i % 2])
        assert_same(envs.step(actions), ref.step(actions), f"step {i}")
    ref.close()


def test_module_colon_env_id_with_a_missing_module() -> None:
    with pytest.raises(envfleet.ConfigError, match="no_such_module_here"):
        envfleet.make("no_such_module_here:Foo-v0", 2, backend="serial")


# A driver that makes a vector env, forks a child that does ``CHILD`` and exits, then steps
# on; it prints its results (and the child's) as JSON. Run in a fresh interpreter: the child
# of a normal interpreter exit runs every exit handler, as a user's would.
FORK_DRIVER = """
import json, multiprocessing, os, sys
import numpy as np
import envfleet

backend, child = sys.argv[1], sys.argv[2]
if backend == "processes":
    kwargs = {"num_workers": 2, "backend": envfleet.Processes(context="fork")}
else:
    kwargs = {"backend": backend}
envs = envfleet.make("CartPole-v1", 4, **kwargs)
envs.reset(seed=0)
envs.step(np.array([0, 1, 0, 1]))
child_saw = None
if child != "none":
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        saw = "nothing"
        if child == "step":
            try:
                envs.step(np.array([1, 1, 1, 1]))
                saw = "stepped"
            except envfleet.WrongProcessError as exc:
                saw = f"WrongProcessError {exc.owner_pid}"
        os.write(write, saw.encode())
        os.close(write)
        sys.exit(0)  # a normal interpreter exit: atexit handlers and finalizers run
    os.close(write)
    child_saw = os.read(read, 200).decode()
    os.waitpid(pid, 0)
obs = [envs.step(np.array([i % 2, 1, 0, 1]))[0].tolist() for i in range(20)]
envs.close()
print(json.dumps({"obs": obs, "child": child_saw, "pid": os.getpid()}))
"""


def _run_fork_driver(backend: str, child: str) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-c", FORK_DRIVER, backend, child],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("child", ["exits", "step"])
@pytest.mark.backends("processes", "threads", "serial")
def test_fork_after_make_leaves_the_parent_untouched(backend: Any, child: str) -> None:
    """Issue 17 item 13: a child forked after make() that simply exited killed the parent's
    workers (the parent's next step: EnvCrashedError ... SIGTERM); a child that stepped the
    parent's vector env changed the parent's data. Now the parent's results are those of a
    run without the fork, and the child gets WrongProcessError."""
    want = _run_fork_driver(backend.name, "none")
    got = _run_fork_driver(backend.name, child)
    assert got["obs"] == want["obs"]
    if child == "step":
        assert got["child"] == f"WrongProcessError {got['pid']}"
    else:
        assert got["child"] == "nothing"


def _bad_calls(num_envs: int) -> dict[str, Any]:
    """Each a call that must raise a typed EnvfleetError before anything reaches a worker."""
    mask = np.zeros(num_envs, dtype=bool)
    return {
        "seed -1": lambda e: e.reset(seed=-1),
        "seed list with -5": lambda e: e.reset(seed=[0, -5, 1]),
        "seed list with 1.5": lambda e: e.reset(seed=[0, 1.5, 1]),
        "seed list with '5'": lambda e: e.reset(seed=[0, "5", 1]),
        "seed list too short": lambda e: e.reset(seed=[0, 1]),
        "seed 1.5": lambda e: e.reset(seed=1.5),
        "options not a dict": lambda e: e.reset(options=[("reset_mask", None)]),
        "reset_mask all False": lambda e: e.reset(options={"reset_mask": mask}),
        "reset_mask of ints": lambda e: e.reset(options={"reset_mask": mask.astype(int)}),
        "reset_mask too short": lambda e: e.reset(options={"reset_mask": mask[:-1]}),
        # An integer action outside the space is not refused: gymnasium hands it to the env
        # (whose own check may raise; some envs take it), and so does envfleet.
        "actions of floats": lambda e: e.step(np.array([0.0, 1.5, 1.0])),
        "actions too few": lambda e: e.step(np.array([0, 1])),
        "call(5)": lambda e: e.call(5),
        "get_attr(None)": lambda e: e.get_attr(None),
        "set_attr(7, 1)": lambda e: e.set_attr(7, 1),
        "set_attr values too few": lambda e: e.set_attr("foo", [1, 2]),
    }


BAD_CALLS = list(_bad_calls(3))


def test_bad_input_is_refused_and_changes_nothing(backend: Any, make_env: Any) -> None:
    """Issue 17 item 6: bad seeds, options, masks, actions and names reached the envs
    (EnvError from a worker after some envs had reset or stepped) or were accepted. Each is
    now a typed EnvfleetError raised before anything is sent, and the vector env then gives
    exactly what SyncVectorEnv gives without the bad call."""
    # Integer actions outside the action space are not bad input here: SyncVectorEnv hands
    # them to the env, and gymnasium's own vector tests step an env with one.
    num_envs = 3
    envs = make_env("CartPole-v1", num_envs, **backend.options, num_workers=num_envs)
    ref = SyncVectorEnv([lambda: gym.make("CartPole-v1") for _ in range(num_envs)])
    rng = np.random.default_rng(0)
    assert_same(envs.reset(seed=0), ref.reset(seed=0), "reset")
    for name, bad_call in _bad_calls(num_envs).items():
        for _ in range(2):  # some steps, so that a partial reset would show
            actions = rng.integers(0, 2, num_envs)
            assert_same(envs.step(actions), ref.step(actions), f"step before {name}")
        with pytest.raises(envfleet.EnvfleetError) as info:
            bad_call(envs)
        assert not isinstance(info.value, envfleet.EnvError), (name, info.value)
        assert isinstance(info.value, (ValueError, TypeError)), (name, info.value)
        actions = rng.integers(0, 2, num_envs)
        assert_same(envs.step(actions), ref.step(actions), f"step after {name}")
    assert_same(envs.reset(seed=5), ref.reset(seed=5), "reset at the end")
    ref.close()


BAD_SENDS = {
    "actions of strings": lambda e, ids: e.send(np.array(["a", "b"]), ids),
    "actions of floats": lambda e, ids: e.send(np.array([0.5, 1.0]), ids),
    "env id out of range": lambda e, ids: e.send(np.zeros(2, np.int64), np.array([0, 9])),
    "env id -1": lambda e, ids: e.send(np.zeros(2, np.int64), np.array([-1, ids[0]])),
    "repeated env ids": lambda e, ids: e.send(np.zeros(2, np.int64), np.array([ids[0]] * 2)),
    "env ids of floats": lambda e, ids: e.send(np.zeros(2, np.int64), ids.astype(float)),
    "async_reset seed -1": lambda e, ids: e.async_reset(seed=-1, env_ids=ids),
}


@pytest.mark.backends(pool=True, cheap=True)
def test_bad_send_is_refused_and_changes_nothing(backend: Any, make_env: Any) -> None:
    """Issue 17 item 6, first-ready pool: every bad send is refused before anything is sent
    (before the fix an async_reset with seed -1 reached the envs), and each env's results
    are then those of a pool that never saw it (env e's k-th action is (e + k) % 2, so its
    results depend on nothing else)."""
    kwargs = {"batch_size": 2, "num_workers": 4}
    envs = make_env("CartPole-v1", 4, **backend.options, **kwargs)
    ref = make_env("CartPole-v1", 4, backend="serial", **kwargs)
    results: dict[int, dict[int, list[Any]]] = {id(envs): {}, id(ref): {}}
    for pool in (envs, ref):
        pool.async_reset(seed=0)
        results[id(pool)] = {e: [] for e in range(4)}

    def rounds() -> Any:
        """The bad sends, then good rounds until every env of both pools has come back at
        least twice (a first-ready pool hands back whichever envs are ready: under load a
        slow worker's env may wait many rounds)."""
        yield from BAD_SENDS.items()
        for _ in range(500):
            if all(len(r) >= 2 for pool in results.values() for r in pool.values()):
                return
            yield "none", None
        raise AssertionError("an env never came back")

    for name, bad_send in rounds():
        for pool in (envs, ref):
            by_env = results[id(pool)]
            obs, rewards, terminated, truncated, info = pool.recv()
            ids = info["env_id"]
            for k, e in enumerate(ids.tolist()):
                by_env[e].append((obs[k].tobytes(), float(rewards[k]), bool(terminated[k])))
            if pool is envs and bad_send is not None:
                with pytest.raises(envfleet.EnvfleetError) as raised:
                    bad_send(pool, ids)
                assert not isinstance(raised.value, envfleet.EnvError), (name, raised.value)
            actions = np.array([(e + len(by_env[e])) % 2 for e in ids.tolist()])
            pool.send(actions, ids)
    got, want = results[id(envs)], results[id(ref)]
    for e in range(4):
        n = min(len(got[e]), len(want[e]))
        assert n >= 2, (e, len(got[e]), len(want[e]))
        assert got[e][:n] == want[e][:n], f"sub-environment {e}"
