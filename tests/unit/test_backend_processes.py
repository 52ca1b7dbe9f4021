"""The processes backend's failure model: errors, crashes, hangs, clean shutdown.

Every test here uses real worker processes. Timeouts are hang guards only: nothing asserts how
fast anything happens.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import glob
import logging
import multiprocessing
import os
import signal
import subprocess
import sys
import tempfile
import time
import weakref
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.vector import SyncVectorEnv

import envfleet
from tests.envs import CrashEnv, IndexedEnv, RaisingEnv, sync_factories
from tests.helpers import assert_same, wait_gone

ROOT = Path(__file__).resolve().parents[2]
ENVS_FILE = "envs.py"

# (num_envs, num_workers, failing env index, its worker)
FAILING = [(4, 2, 1, 0), (4, 2, 3, 1), (5, 3, 4, 2)]

FAIL_FAST: dict[str, Any] = {
    "supervision": envfleet.Supervision(restart_policy=None)
}  # the opt-out of make()'s restarts


def _raising(fail_index, fail_in, fail_after=4):
    return functools.partial(
        RaisingEnv, fail_index=fail_index, fail_in=fail_in, fail_after=fail_after
    )


def _zeros(n):
    return np.zeros(n, np.int64)


# -- an env raises: EnvError ----------------------------------------------------------------


@pytest.mark.parametrize(("num_envs", "num_workers", "index", "worker"), FAILING)
@pytest.mark.parametrize("backend", ["processes", "serial"])
def test_env_raises_in_step(make_env, snapshot, backend, num_envs, num_workers, index, worker):
    factory = _raising(index, "step", fail_after=4)
    envs = make_env(factory, num_envs, backend=backend, num_workers=num_workers)
    sync = SyncVectorEnv(sync_factories(factory, num_envs))
    assert_same(envs.reset(seed=0), sync.reset(seed=0), "reset")
    for t in range(4):
        assert_same(envs.step(_zeros(num_envs)), sync.step(_zeros(num_envs)), f"step {t}")
    with pytest.raises(envfleet.EnvError) as info:
        envs.step(_zeros(num_envs))
    err = info.value
    assert err.env_index == index
    assert err.method == "step"
    assert "boom" in str(err)
    cause = err.__cause__
    assert isinstance(cause, ValueError)
    assert str(cause) == f"boom in step 5 of env {index}"
    if backend == "processes":
        assert err.worker_index == worker
        remote = cause.__cause__
        assert isinstance(remote, envfleet.RemoteTraceback)
        assert "boom" in str(remote)
        assert ENVS_FILE in str(remote)
        assert "Traceback" in str(remote)
    else:
        assert err.worker_index is None
    with pytest.raises(ValueError):
        sync.step(_zeros(num_envs))

    # The vector env is still usable; after a reset it is a SyncVectorEnv again.
    assert not envs.closed
    assert_same(envs.reset(seed=1), sync.reset(seed=1), "reset after the error")
    for t in range(4):
        assert_same(envs.step(_zeros(num_envs)), sync.step(_zeros(num_envs)), f"again {t}")
    assert envs.get_attr("env_index") == tuple(range(num_envs))
    sync.close()
    envs.close()
    snapshot.assert_nothing_left()


@pytest.mark.parametrize(("num_envs", "num_workers", "index", "worker"), FAILING)
@pytest.mark.parametrize("backend", ["processes", "serial"])
def test_env_raises_in_reset(make_env, snapshot, backend, num_envs, num_workers, index, worker):
    factory = _raising(index, "reset")
    envs = make_env(factory, num_envs, backend=backend, num_workers=num_workers)
    envs.reset(seed=0)
    with pytest.raises(envfleet.EnvError) as info:
        envs.reset(seed=0, options={"explode": True})
    err = info.value
    assert (err.env_index, err.method) == (index, "reset")
    assert isinstance(err.__cause__, ValueError)
    assert "boom in reset" in str(err.__cause__)
    if backend == "processes":
        assert err.worker_index == worker
        assert isinstance(err.__cause__.__cause__, envfleet.RemoteTraceback)
        assert "boom in reset" in str(err.__cause__.__cause__)
        assert ENVS_FILE in str(err.__cause__.__cause__)
    else:
        assert err.worker_index is None

    # Options travel with a reset mask: only a masked reset that includes the env raises.
    others = np.ones(num_envs, np.bool_)
    others[index] = False
    envs.reset(options={"reset_mask": others, "explode": True})
    with pytest.raises(envfleet.EnvError) as info:
        envs.reset(options={"reset_mask": ~others, "explode": True})
    assert info.value.env_index == index

    sync = SyncVectorEnv(sync_factories(factory, num_envs))
    assert_same(envs.reset(seed=2), sync.reset(seed=2), "reset after the error")
    assert_same(envs.step(_zeros(num_envs)), sync.step(_zeros(num_envs)), "step")
    sync.close()
    envs.close()
    snapshot.assert_nothing_left()


@pytest.mark.parametrize("backend", ["processes", "serial"])
def test_env_raises_in_init(backend, snapshot):
    with pytest.raises(envfleet.EnvError) as info:
        envfleet.make(_raising(3, "init"), 4, backend=backend, num_workers=2)
    err = info.value
    assert (err.env_index, err.method) == (3, "make")
    assert isinstance(err.__cause__, ValueError)
    if backend == "processes":
        assert err.worker_index == 1
        assert ENVS_FILE in str(err.__cause__.__cause__)
    snapshot.assert_nothing_left()


def test_env_error_in_several_workers_names_the_first(make_env):
    """Two workers fail in one step: the error names the lowest worker; both replies are read."""

    factory = functools.partial(RaisingEnv, fail_index=-1, fail_after=1)
    envs = make_env(factory, 4, backend="processes", num_workers=2)
    envs.set_attr("fail_index", [1, 1, 2, 2])  # env 1 (worker 0) and env 2 (worker 1) fail
    envs.reset(seed=0)
    envs.step(_zeros(4))
    with pytest.raises(envfleet.EnvError) as info:
        envs.step(_zeros(4))
    assert (info.value.env_index, info.value.worker_index) == (1, 0)
    # Worker 1's error reply was consumed too: the next calls get their own replies.
    envs.set_attr("fail_index", -1)
    sync = SyncVectorEnv(sync_factories(factory, 4))
    assert_same(envs.reset(seed=5), sync.reset(seed=5), "reset")
    for t in range(3):
        assert_same(envs.step(_zeros(4)), sync.step(_zeros(4)), f"step {t}")
    sync.close()


# -- a worker dies: EnvCrashedError ---------------------------------------------------------


def _worker_pids(envs, snapshot, num_envs):
    """Pids of the workers per env, checked against the processes that appeared."""
    pids = envs.get_attr("pid")
    assert len(pids) == num_envs
    assert set(pids) == set(snapshot.new_workers())
    assert os.getpid() not in pids
    return pids


def _assert_closed_after_crash(envs, snapshot, num_envs):
    assert envs.closed
    with pytest.raises(envfleet.ClosedEnvironmentError):
        envs.step(_zeros(num_envs))
    with pytest.raises(envfleet.ClosedEnvironmentError):
        envs.reset(seed=0)
    envs.close()
    snapshot.assert_nothing_left()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("context", ["fork", "forkserver"])
@pytest.mark.parametrize(
    ("how", "exitcode", "signum"),
    [("segfault", -signal.SIGSEGV, signal.SIGSEGV), ("exit", 3, None)],
)
def test_worker_dies_in_step(make_env, snapshot, context, how, exitcode, signum):
    factory = functools.partial(CrashEnv, crash_index=3, crash_after=4, how=how)
    envs = make_env(
        factory, 5, backend=envfleet.Processes(context=context), num_workers=2, **FAIL_FAST
    )
    pids = _worker_pids(envs, snapshot, 5)
    assert pids[0] == pids[2] != pids[3] == pids[4]
    envs.reset(seed=0)
    for _ in range(4):
        envs.step(_zeros(5))
    with pytest.raises(envfleet.EnvCrashedError) as info:
        envs.step(_zeros(5))
    err = info.value
    assert err.worker_index == 1
    assert err.env_indices == [3, 4]
    assert err.env_index == 3
    assert err.exitcode == exitcode
    assert err.signal == signum
    assert err.step == 4
    if signum is not None:
        assert signal.Signals(signum).name in str(err)
    else:
        assert "exit code 3" in str(err)
    _assert_closed_after_crash(envs, snapshot, 5)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("context", "worker"), [("fork", 0), ("fork", 1), ("forkserver", 1), ("spawn", 1)]
)
def test_worker_killed_between_steps(make_env, snapshot, context, worker):
    """A worker SIGKILLed while idle (OOM killer, kill -9): the next step names it."""
    envs = make_env(
        IndexedEnv, 4, backend=envfleet.Processes(context=context), num_workers=2, **FAIL_FAST
    )
    pids = _worker_pids(envs, snapshot, 4)
    envs.reset(seed=0)
    for _ in range(2):
        envs.step(_zeros(4))
    victim = pids[2 * worker]
    os.kill(victim, signal.SIGKILL)
    assert not wait_gone([victim], timeout=30)
    with pytest.raises(envfleet.EnvCrashedError) as info:
        envs.step(_zeros(4))
    err = info.value
    assert err.worker_index == worker
    assert err.env_indices == [2 * worker, 2 * worker + 1]
    assert err.exitcode == -signal.SIGKILL
    assert err.signal == signal.SIGKILL
    assert err.step == 2
    _assert_closed_after_crash(envs, snapshot, 4)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("call", ["reset", "get_attr"])
def test_worker_killed_before_other_calls(make_env, snapshot, call):
    """A worker SIGKILLed while idle: reset and get_attr raise EnvCrashedError too."""
    envs = make_env(IndexedEnv, 4, backend="processes", num_workers=2, **FAIL_FAST)
    pids = _worker_pids(envs, snapshot, 4)
    envs.reset(seed=0)
    os.kill(pids[3], signal.SIGKILL)
    assert not wait_gone([pids[3]], timeout=30)
    with pytest.raises(envfleet.EnvCrashedError) as info:
        if call == "reset":
            envs.reset(seed=1)
        else:
            envs.get_attr("env_index")
    assert info.value.worker_index == 1
    assert info.value.env_indices == [2, 3]
    assert info.value.signal == signal.SIGKILL
    _assert_closed_after_crash(envs, snapshot, 4)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("context", ["fork", "forkserver"])
def test_worker_killed_while_busy(make_env, snapshot, context):
    """SIGKILL to a worker stuck in a step: step_wait raises instead of waiting forever."""
    factory = functools.partial(CrashEnv, crash_index=1, crash_after=1, how="hang")
    envs = make_env(
        factory, 3, backend=envfleet.Processes(context=context), num_workers=3, **FAIL_FAST
    )
    pids = _worker_pids(envs, snapshot, 3)
    envs.reset(seed=0)
    envs.step(_zeros(3))
    envs.step_async(_zeros(3))  # env 1 now sleeps in step; envs 0 and 2 answer
    os.kill(pids[1], signal.SIGKILL)
    with pytest.raises(envfleet.EnvCrashedError) as info:
        envs.step_wait()
    err = info.value
    assert (err.worker_index, err.env_indices, err.env_index) == (1, [1], 1)
    assert err.exitcode == -signal.SIGKILL
    assert err.step == 1
    _assert_closed_after_crash(envs, snapshot, 3)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["segfault", "exit"])
def test_worker_dies_while_building_envs(snapshot, how):
    factory = functools.partial(CrashEnv, crash_index=2, how=how, crash_in="init")
    with pytest.raises(envfleet.EnvCrashedError) as info:
        envfleet.make(factory, 4, backend="processes", num_workers=2)
    assert info.value.worker_index == 1
    assert info.value.env_indices == [2, 3]
    assert info.value.exitcode == (-signal.SIGSEGV if how == "segfault" else 3)
    snapshot.assert_nothing_left()


# -- a worker hangs: StepTimeoutError -------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("context", ["fork", "forkserver"])
def test_step_timeout(make_env, snapshot, context):
    factory = functools.partial(CrashEnv, crash_index=2, crash_after=2, how="hang")
    envs = make_env(
        factory,
        6,
        backend=envfleet.Processes(context=context),
        num_workers=3,
        supervision=envfleet.Supervision(step_timeout=1.0, restart_policy=None),
    )
    assert envs.step_timeout == 1.0
    envs.reset(seed=0)
    for _ in range(2):
        envs.step(_zeros(6))
    with pytest.raises(envfleet.StepTimeoutError) as info:
        envs.step(_zeros(6))
    err = info.value
    assert isinstance(err, multiprocessing.TimeoutError)
    assert isinstance(err, envfleet.EnvfleetError)
    assert err.env_indices == [2, 3]  # only worker 1 did not answer
    assert err.timeout == 1.0
    _assert_closed_after_crash(envs, snapshot, 6)


@pytest.mark.timeout(60)
def test_step_wait_timeout_argument(make_env, snapshot):
    factory = functools.partial(CrashEnv, crash_index=0, crash_after=0, how="hang")
    envs = make_env(factory, 2, backend="processes", num_workers=2, **FAIL_FAST)
    assert envs.step_timeout is None
    envs.reset(seed=0)
    envs.step_async(_zeros(2))
    with pytest.raises(envfleet.StepTimeoutError) as info:
        envs.step_wait(timeout=0.5)
    assert info.value.env_indices == [0]
    assert info.value.timeout == 0.5
    _assert_closed_after_crash(envs, snapshot, 2)


@pytest.mark.timeout(60)
def test_step_timeout_bounds_calls(make_env, snapshot):
    envs = make_env(
        IndexedEnv,
        3,
        backend="processes",
        num_workers=3,
        supervision=envfleet.Supervision(step_timeout=1.0),
    )
    assert envs.call("add", 1) == (1, 2, 3)
    with pytest.raises(envfleet.StepTimeoutError) as info:
        envs.call("hang")
    assert info.value.env_indices == [0, 1, 2]
    _assert_closed_after_crash(envs, snapshot, 3)


def test_step_timeout_not_hit_by_normal_steps(make_env):
    envs = make_env(
        "CartPole-v1",
        4,
        backend="processes",
        num_workers=2,
        supervision=envfleet.Supervision(step_timeout=30.0),
    )
    sync = SyncVectorEnv([lambda: gym.make("CartPole-v1")] * 4)
    assert_same(envs.reset(seed=0), sync.reset(seed=0), "reset")
    for t in range(50):
        actions = np.array([t % 2, 0, 1, (t // 3) % 2])
        assert_same(envs.step(actions), sync.step(actions), f"step {t}")
    sync.close()


# -- close -----------------------------------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("context", ["fork", "spawn", "forkserver"])
@pytest.mark.parametrize("num_workers", [1, 3])
def test_close_leaves_nothing(snapshot, context, num_workers):
    envs = envfleet.make(
        IndexedEnv,
        3,
        backend=envfleet.Processes(context=context),
        num_workers=num_workers,
    )
    pids = _worker_pids(envs, snapshot, 3)
    assert len(set(pids)) == num_workers
    envs.reset(seed=0)
    envs.step(_zeros(3))
    envs.close()
    assert envs.closed
    assert not wait_gone(list(set(pids)), timeout=0)
    snapshot.assert_nothing_left()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("terminate", [False, True])
def test_close_with_step_pending(snapshot, terminate):
    envs = envfleet.make("CartPole-v1", 4, backend="processes", num_workers=2)
    envs.reset(seed=0)
    envs.step_async(_zeros(4))
    # close() with a call pending warns, as gymnasium's AsyncVectorEnv does
    with pytest.warns(UserWarning, match="Calling `close` while waiting for a pending call"):
        envs.close(terminate=terminate)
    assert envs.closed
    snapshot.assert_nothing_left()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("terminate", [False, True])
def test_close_with_hanging_step_pending(snapshot, terminate):
    factory = functools.partial(CrashEnv, crash_index=1, crash_after=0, how="hang")
    envs = envfleet.make(factory, 2, backend="processes", num_workers=2)
    envs.reset(seed=0)
    envs.step_async(_zeros(2))
    with pytest.warns(UserWarning, match="Calling `close` while waiting for a pending call"):
        envs.close(timeout=1.0, terminate=terminate)
    assert envs.closed
    snapshot.assert_nothing_left()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["hang", "hang-ignore-term", "segfault", "exit"])
def test_close_is_bounded_when_an_env_misbehaves_in_close(snapshot, caplog, how):
    factory = functools.partial(CrashEnv, crash_index=1, how=how, crash_in="close")
    envs = envfleet.make(factory, 3, backend="processes", num_workers=2)
    envs.reset(seed=0)
    envs.step(_zeros(3))
    with caplog.at_level(logging.WARNING, logger="envfleet"):
        envs.close(timeout=1.0)
    assert envs.closed
    if how.startswith("hang"):
        # Issue 32 item 1: a close that times out logs the hung worker's stacks first.
        [record] = [r for r in caplog.records if "did not close its envs" in r.getMessage()]
        text = record.getMessage()
        assert text.startswith("worker 0 did not close its envs within 1 s (at ")  # envs 0, 1
        assert "in crash_process" in text and "in close" in text
    snapshot.assert_nothing_left()


@pytest.mark.timeout(60)
def test_close_with_reset_pending(snapshot):
    envs = envfleet.make(IndexedEnv, 3, backend="processes", num_workers=3)
    envs.reset_async(seed=0)
    with pytest.warns(UserWarning, match="Calling `close` while waiting for a pending call"):
        envs.close()
    snapshot.assert_nothing_left()


@pytest.mark.timeout(60)
def test_close_after_env_error_and_garbage_collection(snapshot):
    envs = envfleet.make(_raising(2, "step", fail_after=0), 3, backend="processes")
    envs.reset(seed=0)
    with pytest.raises(envfleet.EnvError):
        envs.step(_zeros(3))
    envs.close()
    snapshot.assert_nothing_left()
    # An env that is dropped without close() is closed when collected.
    dropped = envfleet.make(
        IndexedEnv,
        2,
        backend=envfleet.Processes(driver_envs=0),
    )
    pids = list(set(dropped.get_attr("pid")))
    del dropped
    gc.collect()
    assert not wait_gone(pids, timeout=30)
    snapshot.assert_nothing_left()


class Abort(BaseException):
    """Not an ``Exception``: an env's step raising it is no env error, it leaves the step
    (as KeyboardInterrupt or SystemExit would)."""


class AbortingEnv(IndexedEnv):
    """Env ``abort_index`` raises :class:`Abort` in its ``abort_at``-th step."""

    def __init__(self, env_index: int = -1, abort_index: int = 0, abort_at: int = 3):
        super().__init__(env_index)
        self.aborts = env_index == abort_index
        self.abort_at = abort_at
        self.steps = 0

    def step(self, action):
        self.steps += 1
        if self.aborts and self.steps == self.abort_at:
            raise Abort(f"env {self.env_index}, step {self.steps}")
        return super().step(action)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("call", ["step", "step_async"])
def test_a_base_exception_out_of_full_round_closes_the_backend(
    make_env, snapshot, monkeypatch, step_path, call
):
    """A BaseException that leaves the transport's full_round (the C full step round)
    mid-round, the workers rung and their replies unread, shuts the backend down: a later
    call could read a stale reply. Env 0 runs in the driver's own block (driver_envs=1),
    which full_round steps after ringing the workers, and raises :class:`Abort` there;
    through step() (step_round) and through step_async/step_wait (the round's finish).
    Without the C module there is no full_round: the same Abort leaves the general round
    (the driver's block run after the workers were sent their commands), with the same end.
    The vector env is closed, every worker process is gone and reaped, its reply region
    unmapped, nothing left in /dev/shm."""
    factory = functools.partial(AbortingEnv, abort_index=0, abort_at=3)
    envs = make_env(
        factory,
        3,
        backend=envfleet.Processes(driver_envs=1),
        num_workers=2,
    )
    backend = envs._backend
    workers = backend.transport.workers
    has_c = step_path == "c"
    assert (backend._full_round is not None) == has_c, "the full round runs where C does"
    procs = [p for p in workers.procs if p is not None]
    pids = [p.pid for p in procs]
    assert len(pids) == 2 and wait_gone(pids, timeout=0) == pids  # they run
    envs.reset(seed=0)
    for _ in range(2):
        envs.step(_zeros(3))
    escaped = []
    full_round = backend._full_round

    def watched_full_round(ring, wait_s):
        try:
            return full_round(ring, wait_s)
        except BaseException as exc:
            escaped.append(exc)
            raise

    if has_c:
        monkeypatch.setattr(backend, "_full_round", watched_full_round)
    with pytest.raises(Abort, match="env 0, step 3"):
        if call == "step":
            envs.step(_zeros(3))
        else:
            envs.step_async(_zeros(3))
            envs.step_wait()
    assert [type(exc) for exc in escaped] == ([Abort] if has_c else [])  # left full_round
    assert backend.closed and workers.closed
    assert envs.closed
    assert wait_gone(pids, timeout=10) == []  # a hang guard: close() joined them already
    for proc in procs:  # released by close(), which Process.close() refuses while it runs
        with pytest.raises(ValueError, match="process object is closed"):
            proc.is_alive()
    assert all(region is None for region in workers.regions)
    snapshot.assert_nothing_left()
    with pytest.raises(envfleet.ClosedEnvironmentError):
        envs.step(_zeros(3))


DRIVER = """
import faulthandler, signal, sys, time
# Every thread's stack on SIGUSR1 (asked for before a driver that hangs is killed). Ctrl-C
# raises KeyboardInterrupt as in a terminal, also where the tests run with SIGINT ignored (a
# background job of a non-interactive shell): Python leaves an inherited SIG_IGN as it is.
faulthandler.register(signal.SIGUSR1, all_threads=True)
signal.signal(signal.SIGINT, signal.default_int_handler)
signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])
import numpy as np
import envfleet
from tests.envs import IndexedEnv

def ignoring_sigterm(env_index=0):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # as SDL's envs take SIGTERM
    return IndexedEnv(env_index)

factory = ignoring_sigterm if sys.argv[2].endswith("sigterm-ignored") else IndexedEnv
envs = envfleet.make(factory, 2, backend=envfleet.Processes(context=sys.argv[1]), num_workers=2)
envs.reset(seed=0)
print(" ".join(str(pid) for pid in envs.get_attr("pid")), flush=True)
if sys.argv[2].startswith("idle"):
    time.sleep(3600)
actions = np.zeros(2, dtype=np.int64)
while True:
    envs.step(actions)
"""


@pytest.mark.timeout(90)
@pytest.mark.parametrize("activity", ["idle", "stepping"])
@pytest.mark.parametrize("context", ["fork", "spawn", "forkserver"])
def test_workers_exit_when_driver_is_killed(context, activity):
    driver = subprocess.Popen(
        [sys.executable, "-c", DRIVER, context, activity],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        line = driver.stdout.readline()
        pids = [int(pid) for pid in line.split()]
        assert len(pids) == 2 and pids[0] != pids[1] and driver.pid not in pids
        assert wait_gone(pids, timeout=0) == pids  # the workers run
        driver.kill()
        driver.wait(30)
        assert wait_gone(pids, timeout=30) == []
        # Issue 32: the workers' stack files have no name on disk once opened: none is left.
        left = glob.glob(os.path.join(tempfile.gettempdir(), f"envfleet-stacks-{driver.pid}-*"))
        assert left == []
    finally:
        driver.kill()
        driver.wait(30)
        driver.stdout.close()


def _hung_driver(driver: subprocess.Popen) -> str:
    """What a driver that did not exit in time was doing: whether it still ran, its state and
    signal masks (/proc), and its stderr, which ends with every thread's stack (its
    faulthandler answers SIGUSR1) when it still ran. It is killed then."""
    returncode = driver.poll()  # None: it runs; else a process it started holds its pipes
    try:
        with open(f"/proc/{driver.pid}/status", encoding="ascii") as status_file:
            keys = ("State:", "SigPnd:", "ShdPnd:", "SigBlk:", "SigIgn:", "SigCgt:")
            status = ", ".join(
                " ".join(line.split()) for line in status_file if line.startswith(keys)
            )
    except OSError:
        status = "gone"
    driver.send_signal(signal.SIGUSR1)  # no-op once it exited
    with contextlib.suppress(subprocess.TimeoutExpired):
        driver.communicate(timeout=5)  # its stacks (all of its stderr if it exits meanwhile)
    driver.kill()
    try:
        _, stderr = driver.communicate(timeout=30)
    except subprocess.TimeoutExpired as exc:  # a process it started still holds its stderr
        partial = exc.stderr or b""
        stderr = partial.decode(errors="replace") if isinstance(partial, bytes) else partial
    return f"exit code then: {returncode}; {status}; its stderr:\n{stderr}"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("activity", ["idle", "stepping", "idle-sigterm-ignored"])
def test_ctrl_c_in_driver_is_quiet_and_leaves_nothing(activity):
    """Ctrl-C: one KeyboardInterrupt traceback (the driver's), none per worker, no worker left;
    also when the workers' envs ignore SIGTERM (at interpreter exit envfleet closes what is
    still open before multiprocessing's exit handler, which would SIGTERM each worker and wait
    for it without a timeout)."""
    driver = subprocess.Popen(
        [sys.executable, "-c", DRIVER, "fork", activity],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        pids = [int(pid) for pid in driver.stdout.readline().split()]
        assert len(pids) == 2 and driver.pid not in pids
        time.sleep(0.3)  # let it step for a while
        driver.send_signal(signal.SIGINT)
        try:
            _, stderr = driver.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the driver did not exit within 30 s of SIGINT; {_hung_driver(driver)}")
        assert driver.returncode != 0
        assert stderr.count("Traceback") == 1, stderr
        assert stderr.count("KeyboardInterrupt") == 1, stderr
        assert wait_gone(pids, timeout=30) == []
    finally:
        driver.kill()
        driver.wait(30)


class InfoSizeEnv(gym.Env):
    """Infos whose size the action picks: 0 none, 1 a few bytes, 2 a 100 KB array (larger than
    a worker's mailbox, so its reply takes the pipe)."""

    observation_space = gym.spaces.Box(-1.0, 1.0, (2,), np.float32)
    action_space = gym.spaces.Discrete(3)

    def __init__(self, env_index: int = 0):
        self.env_index = env_index

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return self.np_random.uniform(-1, 1, 2).astype(np.float32), {}

    def step(self, action):
        obs = self.np_random.uniform(-1, 1, 2).astype(np.float32)
        info: dict = {}
        if action == 1:
            info = {"env": self.env_index, "u": float(obs[0])}
        elif action == 2:
            info = {"big": np.full(100_000 // 8, self.env_index, np.float64)}
        return obs, 0.0, False, False, info


def test_replies_in_the_mailbox_or_on_the_pipe(make_env):
    """A pickled reply that fits a worker's mailbox goes there, a larger one on the pipe;
    both give SyncVectorEnv's infos, in any mix across workers and steps."""
    from envfleet._backends.processes import worker as processes

    assert processes.MAILBOX_BYTES < 100_000
    fleet = make_env(InfoSizeEnv, 4, num_workers=2, backend=envfleet.Processes(driver_envs=0))
    sync = SyncVectorEnv(sync_factories(InfoSizeEnv, 4))
    where = fleet._backend.transport.workers.control[:, processes.REPLY_PAYLOAD]
    try:
        assert_same(fleet.reset(seed=3), sync.reset(seed=3), "reset")
        seen = set()
        rng = np.random.default_rng(0)
        for t in range(40):
            actions = rng.integers(0, 3, 4)
            assert_same(fleet.step(actions.copy()), sync.step(actions.copy()), f"step {t}")
            for g, (start, stop) in enumerate(fleet._backend.ranges):
                sizes = set(actions[start:stop].tolist())
                want = (
                    processes.ON_PIPE if 2 in sizes else (processes.IN_MAILBOX if 1 in sizes else 0)
                )
                assert where[g] == want, (t, g, actions)
                seen.add(want)
        assert seen == {0, processes.IN_MAILBOX, processes.ON_PIPE}
    finally:
        sync.close()


def _big_reply(group, n):
    """A task's reply with arrays above and below the reply region's threshold."""
    return {
        "big": np.arange(n, dtype=np.float64) + group.start,
        "small": np.full(3, group.start),
        "transposed": [np.ones((n // 8, 8), np.uint8).T],
    }


def test_large_arrays_of_a_reply_come_through_the_reply_region(snapshot):
    """Arrays of REGION_MIN_BYTES or more in a reply travel through the worker's reply
    region (a new one, its descriptor on the pipe, when it must grow) and come out equal,
    writable and the caller's; the rest of the reply is pickled as before."""
    from envfleet._backends.processes import worker as processes

    fleet = envfleet.make("CartPole-v1", 4, num_workers=2)
    where = fleet._backend.transport.workers.control[:, processes.REPLY_PAYLOAD]
    groups = dict.fromkeys(range(2))
    try:
        seen = []
        for n in (10, 1 << 17, 1 << 17, 1 << 20, 1 << 14):
            fleet.run_in_workers_async(_big_reply, {g: n for g in groups})
            out = fleet.run_in_workers_wait()
            for g, (start, _) in enumerate(fleet.worker_ranges):
                reply = out[g]
                assert np.array_equal(reply["big"], np.arange(n) + start)
                assert reply["small"].tolist() == [start] * 3
                assert reply["transposed"][0].shape == (8, n // 8)
                assert reply["transposed"][0].all()
                reply["big"][:] = -1  # the caller's: writable, and no longer the region's
            seen.append(int(where[0]) & ~3)
        assert seen == [
            0,  # small: pickled whole
            processes.IN_REGION | processes.NEW_REGION,  # the first region
            processes.IN_REGION,  # reused
            processes.IN_REGION | processes.NEW_REGION,  # grown
            0,  # every array below the threshold
        ]
        assert all(region is not None for region in fleet._backend.transport.workers.regions)
    finally:
        fleet.close()
    assert all(region is None for region in fleet._backend.transport.workers.regions)
    snapshot.assert_nothing_left()


def test_a_restarted_worker_sends_a_reply_region_of_its_own(snapshot):
    """A worker killed and restarted (restart policy) starts without a region: its next
    large reply brings a new one, and the driver reads that one, not the dead worker's."""
    from envfleet._backends.processes import worker as processes

    policy = envfleet.RestartPolicy(restart_on=(Exception,), max_restarts=5, window_s=60)
    fleet = envfleet.make(
        "CartPole-v1", 4, num_workers=2, supervision=envfleet.Supervision(restart_policy=policy)
    )
    where = fleet._backend.transport.workers.control[:, processes.REPLY_PAYLOAD]
    groups = {0: 1 << 17, 1: 1 << 17}
    try:
        fleet.reset(seed=0)
        fleet.run_in_workers_async(_big_reply, groups)
        fleet.run_in_workers_wait()
        os.kill(fleet._backend.transport.workers.procs[1].pid, signal.SIGKILL)
        fleet._backend.transport.workers.procs[1].join()
        info = fleet.step(_zeros(4))[4]  # restarts worker 1
        start, stop = fleet.worker_ranges[1]
        assert info["_env_restarted"][start:stop].all() and not info["_env_restarted"][:start].any()
        fleet.run_in_workers_async(_big_reply, groups)
        out = fleet.run_in_workers_wait()
        assert int(where[0]) & ~3 == processes.IN_REGION  # worker 0 kept its region
        assert int(where[1]) & ~3 == processes.IN_REGION | processes.NEW_REGION
        for g, (start, _) in enumerate(fleet.worker_ranges):
            assert np.array_equal(out[g]["big"], np.arange(1 << 17) + start)
    finally:
        fleet.close()
    snapshot.assert_nothing_left()


# -- the worker-process toolkit (envfleet._backends.workers) ---------------------------------


def _exit_with(code: int) -> None:
    os._exit(code)


def _sleep_then_send(conn: multiprocessing.connection.Connection) -> None:
    conn.send("hello")
    time.sleep(30)


def test_workers_watch_reports_deaths_with_exit_codes_and_readable_pipes():
    from envfleet._backends.workers import join_all, spawn, watch

    exits = spawn("fork", _exit_with, (3,), "envfleet-test-exit")
    reader, writer = multiprocessing.Pipe(duplex=False)
    talker = spawn("fork", _sleep_then_send, (writer,), "envfleet-test-talker")
    writer.close()
    try:
        join_all([exits], 10.0)
        assert reader.poll(10.0)  # the talker has sent: both events are there for one watch
        found = watch([exits, talker], [reader], timeout=10.0)
        assert [(d.index, d.exitcode) for d in found.dead] == [(0, 3)]
        assert found.readable == [0] and reader.recv() == "hello"
        talker.kill()
        join_all([talker], 10.0)
        found = watch([exits, talker], timeout=0)
        assert [(d.index, d.exitcode) for d in found.dead] == [(0, 3), (1, -signal.SIGKILL)]
    finally:
        talker.kill()
        talker.join()
        reader.close()


def test_workers_remote_error_carries_the_exception_and_its_traceback():
    from envfleet._backends.workers import remote_error
    from envfleet._core.errors import RemoteTraceback
    from envfleet._core.failures import remote_cause

    def boom() -> None:
        raise KeyError("the key")

    try:
        boom()
    except KeyError as exc:
        error = remote_error(exc, 5, "step")
    assert (error.env_index, error.method, error.type_name) == (5, "step", "KeyError")
    assert "in boom" in error.traceback
    cause, original = remote_cause(error)
    assert cause is original and isinstance(cause, KeyError) and cause.args == ("the key",)
    assert isinstance(cause.__cause__, RemoteTraceback)
    assert "in boom" in str(cause.__cause__)

    class Unpicklable(Exception):
        def __reduce__(self):
            raise TypeError("no")

    error = remote_error(Unpicklable("x"), 1, "reset")
    assert error.exception is None
    cause, original = remote_cause(error)
    assert original is None and isinstance(cause, RuntimeError) and "Unpicklable: x" in str(cause)


SEGFAULT_AFTER_ANOTHER_HANDLER = """
import faulthandler, signal, sys
import numpy as np
faulthandler.enable()  # as pytest does
signal.signal(signal.SIGSEGV, signal.SIG_DFL)  # then another library takes SIGSEGV (pygame)
import envfleet
from tests.envs import fault_factory
envs = envfleet.make(
    fault_factory({1: ("null-write", 3)}), 2, backend=envfleet.Processes(context=sys.argv[1]),
    num_workers=2, supervision=envfleet.Supervision(restart_policy=None),
)
envs.reset(seed=0)
try:
    for _ in range(3):
        envs.step(np.zeros(2, dtype=np.int64))
except envfleet.EnvCrashedError as err:
    print(err.signal, "Segmentation fault" in err.stacks, "in step)" in str(err))
"""


@pytest.mark.timeout(90)
@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_a_segfaults_stack_comes_whoever_took_sigsegv_in_the_driver(context):
    """Issue 32 item 2: a driver that enabled faulthandler and then let another library take
    SIGSEGV (pygame's parachute does; the full suite's render tests did) hands a forked worker
    both: the worker's faulthandler is still the one that answers its segfault."""
    done = subprocess.run(
        [sys.executable, "-c", SEGFAULT_AFTER_ANOTHER_HANDLER, context],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.stdout.split() == [str(int(signal.SIGSEGV)), "True", "True"], done.stderr


@pytest.mark.parametrize(
    "recycle", [None, envfleet.Recycle(max_steps=10**9)], ids=["plain", "recycle"]
)
def test_a_closed_vector_env_is_freed_without_the_garbage_collector(recycle):
    """No reference cycle holds a closed processes vector env's workers: their shared memory
    goes at once, not when the garbage collector runs (else multiprocessing's heap grows a
    new arena per make while the old ones wait: benchmarks/soak.py's open files grow)."""
    gc.collect()
    gc.disable()
    try:
        envs = envfleet.make(
            "CartPole-v1",
            2,
            backend="processes",
            num_workers=2,
            supervision=envfleet.Supervision(recycle=recycle),
        )
        envs.reset(seed=0)
        envs.step(np.zeros(2, dtype=np.int64))
        workers = weakref.ref(envs._backend.transport.workers)
        driver = weakref.ref(envs._backend)
        envs.close()
        del envs
        assert workers() is None and driver() is None
    finally:
        gc.enable()


ASKED_THEN_FAULTS = """
import ctypes, sys
from envfleet._backends.workers import watch_stacks
out = watch_stacks(sys.argv[1])
print("ready", flush=True)
sys.stdin.readline()
ctypes.memset(0, 0, 1)  # a real SIGSEGV, when told
"""


@pytest.mark.timeout(60)
def test_an_ask_for_stacks_keeps_a_fatal_dump_in_the_file():
    """A worker asked for its stacks (a hang report) writes them after what its file holds;
    asked again just as it dies of a segfault (before its death is seen), its fatal dump is
    still in the file, and :func:`~envfleet._backends.workers.fatal_stacks` gives that dump
    alone. The ask used to empty the file first, and so lost the crash's stacks (the Ray
    cluster test saw it once under load)."""
    from envfleet._backends.workers import ask_stacks, fatal_stacks, read_text

    fd, path = tempfile.mkstemp(prefix="envfleet-test-stacks-")
    child = subprocess.Popen(
        [sys.executable, "-c", ASKED_THEN_FAULTS, path],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout.readline() == "ready\n"
        answers = ask_stacks({0: (child.pid, fd)}, lambda w: child.poll() is None)
        assert "most recent call first" in answers[0], answers
        assert fatal_stacks(answers[0]) == ""  # an answer is not a fatal dump
        child.stdin.write("go\n")
        child.stdin.flush()
        os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)  # dead, not yet reaped
        assert ask_stacks({0: (child.pid, fd)}, lambda w: False, wait_s=0.5) == {}
        text = read_text(fd)
        fatal = fatal_stacks(text)
        assert text.startswith(answers[0]), text
        assert fatal.startswith("Fatal Python error: Segmentation fault"), text
        assert answers[0] not in fatal and "in <module>" in fatal, fatal
    finally:
        child.kill()
        child.communicate()
        os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    assert child.returncode == -signal.SIGSEGV
