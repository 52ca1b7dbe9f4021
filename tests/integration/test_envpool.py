"""``backend="envpool"``: EnvPool's native tasks through envfleet's front, against envpool itself.

Every differential test drives envfleet and a raw ``envpool.make(..., env_type="gymnasium")``
pool with the same seed and actions and asserts identical observations, rewards, terminations,
truncations (and infos where EnvPool has them). The first-ready pool is compared env by env:
an EnvPool env's trajectory depends only on its own seed and actions, not on which envs share a
native batch. No mocks; no timed assertions.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from gymnasium.vector import AutoresetMode

import envfleet
from envfleet import (
    ClosedEnvironmentError,
    ConfigError,
    InvalidActionError,
    InvalidArgumentError,
    PoolStateError,
    ResetNeededError,
    UnsupportedError,
)

envpool = pytest.importorskip("envpool")

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def raw(task: str, num_envs: int, **kwargs: Any) -> Any:
    return envpool.make(task, env_type="gymnasium", num_envs=num_envs, **kwargs)


def actions_for(task: str, rng: np.random.Generator, n: int) -> np.ndarray:
    if task == "Pendulum-v1":
        return rng.uniform(-2, 2, size=(n, 1)).astype(np.float32)
    return rng.integers(0, 6 if task == "Pong-v5" else 2, size=n)


def assert_infos_equal(ours: dict[str, Any], theirs: dict[str, Any]) -> None:
    """EnvPool's batched infos (all envs) against ours in gymnasium's vector convention."""
    for key, value in theirs.items():
        if key in ("env_id", "players"):
            continue
        np.testing.assert_array_equal(np.asarray(ours[key], dtype=np.asarray(value).dtype), value)
        assert ours[f"_{key}"].all()


@pytest.mark.parametrize(
    ("task", "num_envs", "steps"),
    [("CartPole-v1", 5, 300), ("Pendulum-v1", 3, 250), ("Pong-v5", 2, 40)],
)
def test_sync_matches_envpool(
    make_env: Callable[..., envfleet.FleetVectorEnv], task: str, num_envs: int, steps: int
) -> None:
    envs = make_env(task, num_envs, backend="envpool")
    assert envs.num_workers == 1 and envs.backend == "envpool"
    ref = raw(task, num_envs, seed=11)
    obs, info = envs.reset(seed=11)
    ref_obs, ref_info = ref.reset()
    np.testing.assert_array_equal(obs, ref_obs)
    assert obs.dtype == envs.single_observation_space.dtype
    assert_infos_equal(info, ref_info)
    rng = np.random.default_rng(0)
    ends = 0
    for _ in range(steps):
        a = actions_for(task, rng, num_envs)
        o, r, te, tr, inf = envs.step(a)
        ro, rr, rte, rtr, rinf = ref.step(a)
        np.testing.assert_array_equal(o, ro)
        np.testing.assert_array_equal(r, rr)
        np.testing.assert_array_equal(te, rte)
        np.testing.assert_array_equal(tr, rtr)
        assert r.dtype == np.float64 and te.dtype == np.bool_ and tr.dtype == np.bool_
        assert_infos_equal(inf, rinf)
        ends += int(np.count_nonzero(te | tr))
    if task != "Pong-v5":
        assert ends > 0  # the autoreset (NEXT_STEP, EnvPool's own) was exercised
    ref.close()


def test_sync_send_recv_infos_equal_step_infos(
    make_env: Callable[..., envfleet.FleetVectorEnv],
) -> None:
    """The batched infos of step() are what gymnasium's _add_info builds env by env (the
    send/recv path), dtypes included (Atari's bool ``terminated`` info is an object array)."""
    a_envs = make_env("Pong-v5", 2, backend="envpool")
    b_envs = make_env("Pong-v5", 2, backend="envpool", batch_size=2)
    a_envs.reset(seed=3)
    b_envs.async_reset(seed=3)
    b_envs.recv()
    for t in range(5):
        act = np.array([t % 6, (t + 1) % 6])
        _, ra, _, _, ia = a_envs.step(act)
        b_envs.send(act)
        _, rb, _, _, ib = b_envs.recv()
        np.testing.assert_array_equal(ra, rb)
        np.testing.assert_array_equal(ib.pop("env_id"), [0, 1])
        assert ia.keys() == ib.keys()
        for key in ia:
            assert ia[key].dtype == ib[key].dtype, key
            np.testing.assert_array_equal(ia[key], ib[key])


def run_pool_per_env(envs: envfleet.FleetVectorEnv, steps_per_env: int) -> dict[int, list]:
    """Drive a first-ready pool with action f(env, k) = (env + k) % 2 for its k-th step; per env
    the (obs, reward, terminated, truncated, elapsed_step) of each result, reset first."""
    seen: dict[int, list] = {e: [] for e in range(envs.num_envs)}
    envs.async_reset(seed=7)
    while min(len(v) for v in seen.values()) <= steps_per_env:
        o, r, te, tr, info = envs.recv()
        ids = info["env_id"]
        assert ids.dtype == np.int32 and ids.shape == (envs.batch_size,)
        for k, e in enumerate(ids.tolist()):
            seen[e].append((o[k].copy(), r[k], te[k], tr[k], info["elapsed_step"][k]))
        envs.send(np.array([(e + len(seen[e]) - 1) % 2 for e in ids.tolist()]), ids)
    envs.recv()  # the envs still running, before close
    return seen


def test_first_ready_pool_matches_envpool_per_env(
    make_env: Callable[..., envfleet.FleetVectorEnv],
) -> None:
    num_envs, steps = 6, 120
    envs = make_env("CartPole-v1", num_envs, backend="envpool", batch_size=3)
    assert envs.is_pool and envs.num_workers == num_envs
    seen = run_pool_per_env(envs, steps)
    ref = raw("CartPole-v1", num_envs, seed=7)
    o, info = ref.reset()
    expected: dict[int, list] = {
        e: [(o[e], 0.0, False, False, info["elapsed_step"][e])] for e in range(num_envs)
    }
    for k in range(steps):
        o, r, te, tr, info = ref.step(np.array([(e + k) % 2 for e in range(num_envs)]))
        for e in range(num_envs):
            expected[e].append((o[e], r[e], te[e], tr[e], info["elapsed_step"][e]))
    ends = 0
    for e in range(num_envs):
        for got, want in zip(seen[e][: steps + 1], expected[e], strict=True):
            np.testing.assert_array_equal(got[0], want[0])
            assert got[1:] == tuple(want[1:])
            ends += int(got[2] or got[3])
    assert ends > 0
    ref.close()


def test_pool_partial_async_reset(make_env: Callable[..., envfleet.FleetVectorEnv]) -> None:
    envs = make_env("CartPole-v1", 4, backend="envpool", batch_size=2)
    envs.async_reset(seed=0)
    for _ in range(6):
        _, _, _, _, info = envs.recv()
        ids = info["env_id"]
        envs.send(np.ones(2, dtype=np.int64), ids)
    o, r, te, tr, info = envs.recv()  # these two await actions: reset them instead
    ids = info["env_id"]
    assert (info["elapsed_step"] > 0).all()
    with pytest.raises(InvalidArgumentError):  # EnvPool cannot seed a partial reset
        envs.async_reset(seed=[1, 2], env_ids=ids)
    envs.async_reset(env_ids=ids)
    got: dict[int, tuple] = {}
    while not set(ids.tolist()) <= set(got):
        o, r, te, tr, info = envs.recv()
        for k, e in enumerate(info["env_id"].tolist()):
            got[e] = (o[k], r[k], te[k], tr[k], info["elapsed_step"][k])
        envs.send(np.zeros(2, dtype=np.int64), info["env_id"])
    for e in ids.tolist():
        obs, reward, term, trunc, elapsed = got[e]
        assert (reward, term, trunc, elapsed) == (0.0, False, False, 0)
        assert (np.abs(obs) <= 0.05).all()  # CartPole's reset state


def test_sync_partial_reset_matches_envpool(
    make_env: Callable[..., envfleet.FleetVectorEnv],
) -> None:
    envs = make_env("CartPole-v1", 4, backend="envpool")
    ref = raw("CartPole-v1", 4, seed=2)
    envs.reset(seed=2)
    ref.reset()
    for _ in range(3):
        o, *_ = envs.step(np.ones(4, dtype=np.int64))
        ref.step(np.ones(4, dtype=np.int64))
    mask = np.array([False, True, False, True])
    obs, info = envs.reset(options={"reset_mask": mask})
    ref_obs, ref_info = ref.reset(np.array([1, 3], dtype=np.int32))
    np.testing.assert_array_equal(obs[mask], ref_obs)
    np.testing.assert_array_equal(obs[~mask], o[~mask])  # the others kept their observation
    np.testing.assert_array_equal(info["_elapsed_step"], mask)
    for _ in range(20):
        a = np.array([0, 1, 1, 0])
        o, r, te, tr, _ = envs.step(a)
        ro, rr, rte, rtr, _ = ref.step(a)
        np.testing.assert_array_equal(o, ro)
        np.testing.assert_array_equal(r, rr)
        np.testing.assert_array_equal(te | tr, rte | rtr)
    ref.close()


def test_same_step_matches_envpool_with_extra_reset_step(
    make_env: Callable[..., envfleet.FleetVectorEnv],
) -> None:
    """SAME_STEP: the final observation and info go to info["final_obs"]/["final_info"] and the
    observation is the reset one EnvPool returns on the next step of that env."""
    n = 4
    envs = make_env("CartPole-v1", n, backend="envpool", autoreset_mode="SameStep")
    ref = raw("CartPole-v1", n, seed=5)
    np.testing.assert_array_equal(envs.reset(seed=5)[0], ref.reset()[0])
    rng = np.random.default_rng(1)
    ends = 0
    for _ in range(150):
        a = rng.integers(0, 2, size=n)
        o, r, te, tr, info = envs.step(a)
        ro, rr, rte, rtr, rinfo = ref.step(a)
        np.testing.assert_array_equal(r, rr)
        np.testing.assert_array_equal(te, rte)
        np.testing.assert_array_equal(tr, rtr)
        done = rte | rtr
        if done.any():
            ends += int(done.sum())
            ids = np.flatnonzero(done).astype(np.int32)
            reset_obs, _, _, _, reset_info = ref.step(np.zeros(len(ids), np.int64), ids)
            np.testing.assert_array_equal(info["_final_obs"], done)
            for k, e in enumerate(ids.tolist()):
                np.testing.assert_array_equal(info["final_obs"][e], ro[e])
                assert info["final_info"]["elapsed_step"][e] == rinfo["elapsed_step"][e]
                np.testing.assert_array_equal(o[e], reset_obs[k])
                assert info["elapsed_step"][e] == 0
            np.testing.assert_array_equal(o[~done], ro[~done])
        else:
            np.testing.assert_array_equal(o, ro)
            assert "final_obs" not in info
    assert ends > 0
    ref.close()


def test_disabled_needs_explicit_reset(make_env: Callable[..., envfleet.FleetVectorEnv]) -> None:
    envs = make_env("CartPole-v1", 2, backend="envpool", autoreset_mode=AutoresetMode.DISABLED)
    ref = raw("CartPole-v1", 2, seed=0)
    envs.reset(seed=0)
    ref.reset()
    done = np.zeros(2, dtype=np.bool_)
    while not done.any():
        _, _, te, tr, _ = envs.step(np.ones(2, dtype=np.int64))
        ref.step(np.ones(2, dtype=np.int64))
        done = te | tr
    with pytest.raises(ResetNeededError) as caught:
        envs.step(np.ones(2, dtype=np.int64))
    assert caught.value.env_indices == np.flatnonzero(done).tolist()
    with pytest.raises(InvalidArgumentError):  # a seeded partial reset: refused, nothing reset
        envs.reset(seed=[1, 2], options={"reset_mask": done})
    with pytest.raises(ResetNeededError):
        envs.step(np.ones(2, dtype=np.int64))
    obs, _ = envs.reset(options={"reset_mask": done})
    ref_obs, _ = ref.reset(np.flatnonzero(done).astype(np.int32))
    np.testing.assert_array_equal(obs[done], ref_obs)
    o, *_ = envs.step(np.zeros(2, dtype=np.int64))
    ro, *_ = ref.step(np.zeros(2, dtype=np.int64))
    np.testing.assert_array_equal(o, ro)
    ref.close()


def test_seeds(make_env: Callable[..., envfleet.FleetVectorEnv]) -> None:
    envs = make_env("CartPole-v1", 3, backend="envpool")
    # no seed yet: EnvPool's default creation seed (42), env i gets 42 + i
    np.testing.assert_array_equal(envs.reset()[0], raw("CartPole-v1", 3).reset()[0])
    first = envs.reset(seed=9)[0]
    np.testing.assert_array_equal(first, raw("CartPole-v1", 3, seed=9).reset()[0])
    for _ in range(5):
        envs.step(np.ones(3, dtype=np.int64))
    np.testing.assert_array_equal(envs.reset(seed=9)[0], first)  # re-seeded: same start
    seeds = [4, 100, 7]
    np.testing.assert_array_equal(
        envs.reset(seed=seeds)[0], raw("CartPole-v1", 3, seed=seeds).reset()[0]
    )
    single = raw("CartPole-v1", 1, seed=101).reset()[0]
    np.testing.assert_array_equal(envs.reset(seed=100)[0][1], single[0])  # env i: seed + i
    with pytest.raises(InvalidArgumentError):
        envs.reset(seed=[1, None, 3])
    with pytest.raises(InvalidArgumentError):
        envs.reset(seed=2**40)
    with pytest.raises(InvalidArgumentError):
        envs.reset(options={"other": 1})
    created = make_env("CartPole-v1", 3, backend="envpool", env_kwargs={"seed": 9})
    np.testing.assert_array_equal(created.reset()[0], first)


def test_bad_actions_and_ids_send_nothing(
    make_env: Callable[..., envfleet.FleetVectorEnv],
) -> None:
    envs = make_env("CartPole-v1", 3, backend="envpool")
    ref = raw("CartPole-v1", 3, seed=1)
    envs.reset(seed=1)
    ref.reset()
    for bad in (np.ones(2, dtype=np.int64), np.ones((3, 2)), "x", np.full(3, 0.5)):
        with pytest.raises(InvalidActionError):
            envs.step(bad)
    o, *_ = envs.step([1, 0, 1])
    np.testing.assert_array_equal(o, ref.step(np.array([1, 0, 1]))[0])

    pool = make_env("CartPole-v1", 4, backend="envpool", batch_size=2)
    with pytest.raises(PoolStateError):
        pool.send(np.ones(2, dtype=np.int64), [0, 1])  # before async_reset
    pool.async_reset(seed=0)
    _, _, _, _, info = pool.recv()
    ids = info["env_id"]
    with pytest.raises(InvalidArgumentError):
        pool.send(np.ones(2, dtype=np.int64), [0, 4])
    with pytest.raises(InvalidArgumentError):
        pool.send(np.ones(2, dtype=np.int64), [ids[0], ids[0]])
    others = sorted(set(range(4)) - set(ids.tolist()))
    with pytest.raises(PoolStateError):
        pool.send(np.ones(2, dtype=np.int64), others)  # still running / not received
    with pytest.raises(InvalidActionError):
        pool.send(np.ones(3, dtype=np.int64), ids)
    with pytest.raises(PoolStateError):
        pool.step(np.ones(4, dtype=np.int64))
    pool.send(np.ones(2, dtype=np.int64), ids)
    pool.recv()
    pool.recv()


def test_refused_modes_and_options() -> None:
    for mode, match in ((AutoresetMode.SAME_STEP, "next_step"), (AutoresetMode.DISABLED, "pool")):
        with pytest.raises(ConfigError, match=match):
            envfleet.make("CartPole-v1", 4, backend="envpool", batch_size=2, autoreset_mode=mode)
    for option, value in [
        ("num_workers", 2),
        ("supervision", envfleet.Supervision(step_timeout=1.0)),
        ("supervision", envfleet.Supervision(restart_policy=envfleet.RestartPolicy())),
        ("supervision", envfleet.Supervision(recycle=envfleet.Recycle(max_steps=10))),
        ("observation_mode", "different"),
    ]:
        with pytest.raises(ConfigError, match="envpool"):
            envfleet.make("CartPole-v1", 2, backend="envpool", **{option: value})
    with pytest.raises(ConfigError, match="Pong-v5"):
        envfleet.make("ALE/Pong-v5", 2, backend="envpool")
    with pytest.raises(ConfigError, match="not an EnvPool task"):
        envfleet.make("NoSuchTask-v0", 2, backend="envpool")
    with pytest.raises(ConfigError, match="task id"):
        envfleet.make(lambda: None, 2, backend="envpool")
    with pytest.raises(ConfigError, match="num_envs"):
        envfleet.make("CartPole-v1", 2, backend="envpool", env_kwargs={"num_envs": 3})
    with pytest.raises(ConfigError, match="envpool.make"):
        envfleet.make("CartPole-v1", 2, backend="envpool", env_kwargs={"no_such_option": 1})
    with pytest.raises(ConfigError):
        envfleet.make("CartPole-v1", 2, backend="envpool", batch_size=3)
    with pytest.raises(ConfigError):
        envfleet.make("CartPole-v1", 2, backend="envpool", autoreset_mode="Sometimes")


def test_missing_envpool_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "envpool", None)  # what `import envpool` sees uninstalled
    with pytest.raises(ConfigError, match=r"pip install 'envfleet\[envpool\]'"):
        envfleet.make("CartPole-v1", 2, backend="envpool")


def test_calls_refused_render_supported(make_env: Callable[..., envfleet.FleetVectorEnv]) -> None:
    envs = make_env("CartPole-v1", 2, backend="envpool")
    envs.reset(seed=0)
    with pytest.raises(UnsupportedError):
        envs.call("anything")
    with pytest.raises(UnsupportedError):
        envs.get_attr("spec")
    with pytest.raises(UnsupportedError):
        envs.set_attr("x", 1)
    with pytest.raises(UnsupportedError, match="render_mode"):
        envs.render()
    envs.step(np.zeros(2, dtype=np.int64))  # still usable after each refusal
    shown = make_env("CartPole-v1", 2, backend="envpool", env_kwargs={"render_mode": "rgb_array"})
    assert shown.render_mode == "rgb_array"
    shown.reset(seed=0)
    frames = shown.render()
    assert len(frames) == 2 and frames[0].dtype == np.uint8 and frames[0].shape[-1] == 3


def test_close(make_env: Callable[..., envfleet.FleetVectorEnv]) -> None:
    envs = make_env("CartPole-v1", 2, backend="envpool")
    envs.reset(seed=0)
    envs.close()
    envs.close()  # idempotent
    with pytest.raises(ClosedEnvironmentError):
        envs.step(np.zeros(2, dtype=np.int64))
    pool = make_env("CartPole-v1", 4, backend="envpool", batch_size=2)
    pool.async_reset(seed=0)
    _, _, _, _, info = pool.recv()
    pool.send(np.zeros(2, dtype=np.int64), info["env_id"])
    pool.close()  # envs still running: EnvPool lets them finish
    with pytest.raises(ClosedEnvironmentError):
        pool.recv()
    with envfleet.make("Pendulum-v1", 2, backend="envpool", copy=False) as envs:
        obs, _ = envs.reset(seed=0)
        assert obs.shape == (2, 3) and obs.dtype == np.float32
    assert envs.closed


def test_the_native_step_keeps_the_same_books_as_the_others(
    make_env: Callable[..., envfleet.FleetVectorEnv], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The plain step's native branch (EnvPool's own calls) counts a step only once it
    returned, and after an exception the vector env is closed exactly when its backend is,
    as the step round's and the general round's branches do."""
    envs = make_env("CartPole-v1", 2, backend="envpool")
    envs.reset(seed=0)
    assert envs._native_step is not None, "the native branch does not run"
    actions = np.zeros(2, dtype=np.int64)
    envs.step(actions)
    assert envs._steps == 1
    native = envs._native_step

    def broken(*args: Any) -> Any:
        envs._backend.close(timeout=0, terminate=True)  # what a broken library leaves
        raise RuntimeError("the native library failed")

    monkeypatch.setattr(envs, "_native_step", broken)
    with pytest.raises(RuntimeError, match="native library"):
        envs.step(actions)
    assert envs._steps == 1, "a failed native step was counted"
    assert envs.closed, "the backend closed under the step, the vector env did not say so"
    with pytest.raises(ClosedEnvironmentError):
        envs.step(actions)
    assert native is not broken
