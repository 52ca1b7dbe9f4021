"""``backend="envpool"``'s native path (``EnvPoolBackend.native_step``/``native_send``/
``native_recv`` and ``NativePool``) against its generic path (the same backend with the native
path switched off: every call through ``submit``/``collect``), and what the native path
promises: EnvPool's own arrays handed through, the batch kept for later partial resets, the
same typed errors with nothing sent, and a front that costs a handful of Python calls per step.
No mocks of EnvPool; no timed assertions.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

import envfleet
from envfleet import InvalidActionError, InvalidArgumentError, PoolStateError, UnsupportedError

envpool = pytest.importorskip("envpool")
from envfleet._backends.envpool import NativeLayout  # noqa: E402  (needs envpool)

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture
def generic(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[], None]]:
    """Calling it makes the next vector envs take the generic path (no native layout)."""
    yield lambda: monkeypatch.setattr(NativeLayout, "of", classmethod(lambda *a: None))


def actions_for(task: str, k: int, n: int) -> np.ndarray:
    return np.random.default_rng(k).integers(0, 6 if task == "Pong-v5" else 2, size=n)


def assert_same(ours: Any, theirs: Any) -> None:
    """Equal values, dtypes and shapes (infos: the same keys)."""
    if isinstance(theirs, dict):
        assert set(ours) == set(theirs)
        for key in theirs:
            assert_same(ours[key], theirs[key])
        return
    if isinstance(theirs, tuple):
        assert isinstance(ours, tuple) and len(ours) == len(theirs)
        for a, b in zip(ours, theirs, strict=True):
            assert_same(a, b)
        return
    ours, theirs = np.asarray(ours), np.asarray(theirs)
    assert ours.dtype == theirs.dtype and ours.shape == theirs.shape
    np.testing.assert_array_equal(ours, theirs)


@pytest.mark.parametrize("copy", [True, False])
@pytest.mark.parametrize(
    ("task", "num_envs", "steps"), [("CartPole-v1", 6, 120), ("Pong-v5", 3, 30)]
)
def test_sync_native_matches_generic(
    generic: Callable[[], None], task: str, num_envs: int, steps: int, copy: bool
) -> None:
    native = envfleet.make(task, num_envs, backend="envpool", copy=copy)
    generic()
    slow = envfleet.make(task, num_envs, backend="envpool", copy=copy)
    try:
        assert native._backend.native and not slow._backend.native
        assert_same(native.reset(seed=3), slow.reset(seed=3))
        ends = 0
        for k in range(steps):
            actions = actions_for(task, k, num_envs)
            got = native.step(actions)
            want = slow.step(actions)
            assert_same(got, want)
            ends += int(np.logical_or(got[2], got[3]).any())
            if k == steps // 2:  # a partial reset after native steps: every env's latest obs
                mask = np.arange(num_envs) % 2 == 0
                assert_same(
                    native.reset(options={"reset_mask": mask}),
                    slow.reset(options={"reset_mask": mask}),
                )
        assert task != "CartPole-v1" or ends > 0
        assert native._backend.native_calls == steps and slow._backend.native_calls == 0
        assert native.stats.workers[0].count == steps
    finally:
        native.close()
        slow.close()


def run_pool(envs: envfleet.FleetVectorEnv, task: str, rounds: int) -> dict[int, list[Any]]:
    """Per env, what recv returned for it, in order (EnvPool's threads decide which envs
    come back together, so the comparison is per env; the existing pool tests cover the
    partial resets, whose envs depend on that timing)."""
    seen: dict[int, list[Any]] = {e: [] for e in range(envs.num_envs)}
    envs.async_reset(seed=11)
    for _ in range(rounds):
        o, r, te, tr, info = envs.recv()
        ids = info["env_id"]
        assert ids.dtype == np.int32
        for j, e in enumerate(ids.tolist()):
            row = {key: value[j] for key, value in info.items() if not key.startswith("_")}
            masks = {key: bool(value[j]) for key, value in info.items() if key.startswith("_")}
            seen[e].append((o[j].copy(), r[j], te[j], tr[j], row, masks, r.dtype, o.dtype))
        envs.send(np.array([(e + len(seen[e])) % 2 for e in ids.tolist()]), ids)
    return seen


@pytest.mark.parametrize("copy", [True, False])
@pytest.mark.parametrize("task", ["CartPole-v1", "Pong-v5"])
def test_pool_native_matches_generic(generic: Callable[[], None], task: str, copy: bool) -> None:
    num_envs, rounds = (6, 90) if task == "CartPole-v1" else (4, 24)
    native = envfleet.make(task, num_envs, backend="envpool", batch_size=num_envs // 2, copy=copy)
    generic()
    slow = envfleet.make(task, num_envs, backend="envpool", batch_size=num_envs // 2, copy=copy)
    try:
        got, want = run_pool(native, task, rounds), run_pool(slow, task, rounds)
        assert native._backend.native_calls >= 2 * rounds - 1 and slow._backend.native_calls == 0
        compared = 0
        for e in range(num_envs):
            n = min(len(got[e]), len(want[e]))  # EnvPool may leave an env out for a while
            compared += n
            for a, b in zip(got[e][:n], want[e][:n], strict=True):
                np.testing.assert_array_equal(a[0], b[0])
                assert a[1:4] == b[1:4] and a[5:] == b[5:]
                assert set(a[4]) == set(b[4])
                for key in b[4]:
                    assert_same(a[4][key], b[4][key])
        assert compared >= rounds
    finally:
        native.close()
        slow.close()


def test_native_path_hands_envpool_arrays_through() -> None:
    for copy in (False, True):
        envs = envfleet.make("CartPole-v1", 4, backend="envpool", copy=copy)
        envs.reset(seed=0)
        first = envs.step(np.ones(4, dtype=np.int64))
        kept = [np.array(a, copy=True) for a in first[:4]]
        for _ in range(3):
            later = envs.step(np.zeros(4, dtype=np.int64))
        for before, now in zip(first[:4], kept, strict=True):  # nothing wrote them since
            np.testing.assert_array_equal(before, now)
        obs = later[0]
        assert type(obs.base).__name__ == "PyCapsule"  # EnvPool's own array, not a copy
        assert not np.shares_memory(obs, envs._backend.batch.observations)
        assert envs._backend.native_calls == 4
        envs.close()
    pool = envfleet.make("CartPole-v1", 4, backend="envpool", batch_size=2, copy=False)
    pool.async_reset(seed=0)
    obs, *_, info = pool.recv()
    assert type(obs.base).__name__ == "PyCapsule" and pool._backend.native_calls == 1
    pool.send(np.zeros(2, dtype=np.int64), info["env_id"])
    assert pool._backend.native_calls == 2
    pool.close()


def python_calls(fn: Callable[[], Any]) -> list[str]:
    """The Python functions ``fn`` calls (profiler ``call`` events), in order."""
    calls: list[str] = []

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            calls.append(frame.f_code.co_qualname)

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return calls[1:]  # fn itself


def test_front_costs_a_few_python_calls_per_step(generic: Callable[[], None]) -> None:
    """The front's cost per step, counted in Python calls instead of timed: the native step
    and the pool's recv + send pair make a fraction of the generic path's calls, and none of
    the generic path's machinery (a fast path that silently stopped running fails here)."""
    counts: dict[str, dict[str, int]] = {}
    generic_names = ("_prepare_step", "round", "collect", "columns_infos", "_collect", "submit")
    for path in ("native", "generic"):
        if path == "generic":
            generic()
        envs = envfleet.make("Pong-v5", 2, backend="envpool")
        envs.reset(seed=0)
        actions = np.zeros(2, dtype=np.int64)
        envs.step(actions)
        step_calls = python_calls(lambda: envs.step(actions))  # noqa: B023
        pool = envfleet.make("Pong-v5", 4, backend="envpool", batch_size=2)
        pool.async_reset(seed=0)
        ids = pool.recv()[4]["env_id"]
        for _ in range(3):
            pool.send(actions, ids)
            ids = pool.recv()[4]["env_id"]

        def pair() -> None:
            pool.send(actions, ids)  # noqa: B023
            pool.recv()  # noqa: B023

        pair_calls = python_calls(pair)
        counts[path] = {"step": len(step_calls), "pair": len(pair_calls)}
        if path == "native":
            for name in generic_names:
                assert not [c for c in step_calls + pair_calls if c.endswith(f".{name}")], name
            assert len(step_calls) <= 12 and len(pair_calls) <= 24, (step_calls, pair_calls)
        envs.close()
        pool.close()
    assert counts["native"]["step"] * 3 <= counts["generic"]["step"], counts
    assert counts["native"]["pair"] * 3 <= counts["generic"]["pair"], counts


def test_native_pool_bad_input_sends_nothing() -> None:
    pool = envfleet.make("CartPole-v1", 4, backend="envpool", batch_size=2)
    ref = envfleet.make("CartPole-v1", 4, backend="envpool", batch_size=2)
    with pytest.raises(PoolStateError):
        pool.send(np.ones(2, dtype=np.int64), np.array([0, 1], dtype=np.int32))
    pool.async_reset(seed=5)
    ref.async_reset(seed=5)
    ids = pool.recv()[4]["env_id"]
    ref_ids = ref.recv()[4]["env_id"]
    others = np.array(sorted(set(range(4)) - set(ids.tolist())), dtype=np.int32)
    bad_ids = [
        (InvalidArgumentError, np.array([ids[0], -1], dtype=np.int32)),
        (InvalidArgumentError, np.array([ids[0], 4], dtype=np.int32)),
        (InvalidArgumentError, np.array([ids[0], ids[0]], dtype=np.int32)),
        (InvalidArgumentError, np.array([], dtype=np.int32)),
        (PoolStateError, others),  # still running
        (PoolStateError, np.array([ids[0], others[0]], dtype=np.int32)),
    ]
    for error, bad in bad_ids:
        with pytest.raises(error):
            pool.send(np.ones(len(bad), dtype=np.int64), bad)
    for bad_actions in (np.ones(3, dtype=np.int64), np.full(2, 0.5), "x", np.ones((2, 1))):
        with pytest.raises(InvalidActionError):
            pool.send(bad_actions, ids)
    with pytest.raises(UnsupportedError):
        pool.snapshot()
    assert (pool._pool.env_state[ids] == 0).all() and pool._pool._running == 2
    # Nothing was sent: the pool goes on as one that never saw the bad calls (env by env:
    # EnvPool's threads decide which envs come back together).
    seen: list[dict[int, list[Any]]] = [{e: [] for e in range(4)} for _ in range(2)]
    for _ in range(20):
        pool.send(np.ones(2, dtype=np.int32), ids.tolist())  # another dtype and a list
        ref.send(np.ones(2, dtype=np.int64), ref_ids)
        for envs, record in zip((pool, ref), seen, strict=True):
            o, r, *_, info = envs.recv()
            for j, e in enumerate(info["env_id"].tolist()):
                record[e].append((o[j].tolist(), r[j]))
            if envs is pool:
                ids = info["env_id"]
            else:
                ref_ids = info["env_id"]
    for e in range(4):
        n = min(len(seen[0][e]), len(seen[1][e]))
        assert n >= 3 and seen[0][e][:n] == seen[1][e][:n]
    pool.close()
    ref.close()


# A driver that makes an envpool vector env, forks a child that calls it, then goes on; it
# prints the child's exit code (0: WrongProcessError) and its own results after the fork.
FORK_DRIVER = """
import os, sys, warnings
import numpy as np
warnings.filterwarnings("ignore")
import envfleet

mode = sys.argv[1]
if mode == "sync":
    envs = envfleet.make("CartPole-v1", 4, backend="envpool")
    envs.reset(seed=0)
    envs.step(np.zeros(4, dtype=np.int64))
else:
    envs = envfleet.make("CartPole-v1", 4, backend="envpool", batch_size=2)
    envs.async_reset(seed=0)
    ids = envs.recv()[4]["env_id"]
pid = os.fork()
if pid == 0:
    try:
        if mode == "sync":
            envs.step(np.zeros(4, dtype=np.int64))
        else:
            envs.send(np.zeros(2, dtype=np.int64), ids)
        os._exit(3)  # it stepped the maker's EnvPool
    except envfleet.WrongProcessError:
        os._exit(0)
    except BaseException:
        os._exit(4)
_, status = os.waitpid(pid, 0)
code = os.waitstatus_to_exitcode(status)
if mode == "sync":
    after = envs.step(np.ones(4, dtype=np.int64))[1].tolist()
else:
    envs.send(np.zeros(2, dtype=np.int64), ids)
    after = envs.recv()[1].tolist()
envs.close()
print(code, len(after))
"""


@pytest.mark.parametrize("mode", ["sync", "pool"])
def test_a_forked_child_cannot_call_the_native_path(mode: str) -> None:
    """A child forked after make() gets WrongProcessError from the native step and the native
    pool's send (the bound native step and the pool's backend are the maker's: calling EnvPool
    there would run on threads the fork did not copy), and the parent goes on."""
    done = subprocess.run(
        [sys.executable, "-c", FORK_DRIVER, mode], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    code, rows = done.stdout.split()
    assert (code, rows) == ("0", "4" if mode == "sync" else "2")
