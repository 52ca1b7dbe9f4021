"""The backend contract's failure model, on every backend.

An env that raises in ``step`` or ``reset`` gives an ``EnvError`` naming it that is also of
the env's own exception type; with ``restart_policy=None`` (the fail-fast opt-out; the default
restarts them: test_restart_default.py) a worker that dies (exit, SIGKILL, segfault) gives an
``EnvCrashedError`` naming its envs, and one that hangs a ``StepTimeoutError``; either closes
the vector env and leaves nothing behind. Real envs, real workers, real faults; timeouts
are hang guards and ``step_timeout`` values, never speed bounds.
"""

from __future__ import annotations

import functools
import inspect
import multiprocessing
import pickle
import signal
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import envfleet
from envfleet._backends import workers
from envfleet._core.stacks import innermost
from tests.envs import (
    CustomEnvException,
    FaultEnv,
    FaultSeriesEnv,
    MemoryHogEnv,
    TypedRaisingEnv,
    fault_factory,
)

FAIL_FAST: dict[str, Any] = {
    "supervision": envfleet.Supervision(restart_policy=None)
}  # the opt-out of make()'s restarts

KINDS = {
    "value": ValueError,
    "key": KeyError,
    "os": FileNotFoundError,
    "custom": CustomEnvException,
}


def _zeros(n: int) -> np.ndarray:
    return np.zeros(n, dtype=np.int64)


def assert_env_error(error: BaseException, kind: str, method: str = "step") -> None:
    """``error`` is env 1's EnvError for ``raise_in_env(kind)`` in ``method``: of the env's
    exception type too, with its fields, and it pickles."""
    assert isinstance(error, envfleet.EnvError)
    assert isinstance(error, KINDS[kind])
    assert (error.env_index, error.method) == (1, method)
    assert str(error).startswith("sub-environment 1")  # EnvError's text, not KeyError's repr
    assert isinstance(error.__cause__, KINDS[kind])
    if kind == "os":
        assert (error.errno, error.strerror) == (2, "no such thing")
    if kind == "custom":
        assert error.code == 7
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is type(error)
    assert (copy.env_index, copy.worker_index, copy.method) == (1, error.worker_index, method)
    assert str(copy) == str(error)


def raising_layout(backend: Any) -> dict[str, Any]:
    """Env 1 in a worker of its own where the backend has workers (processes: env 0 in the
    driver's block)."""
    if backend.workers == "processes":
        return backend.with_layout({"num_workers": 2, "driver_envs": 1})
    return backend.with_layout({"num_workers": 2} if backend.workers else {})


@pytest.mark.per_backend("kind", lambda backend: sorted(KINDS) if backend.cheap else ["value"])
def test_env_exception_is_also_of_its_own_type(make_env: Any, backend: Any, kind: str) -> None:
    """An env's exception reaches the caller as an EnvError (with its fields) that is also an
    instance of the env's exception type, so ``except ValueError`` written for gymnasium
    catches it; it pickles, and the vector env stays usable."""
    envs = make_env(
        functools.partial(TypedRaisingEnv, kind=kind),
        3,
        **raising_layout(backend),
    )
    envs.reset(seed=0)
    with pytest.raises(KINDS[kind]) as raised:
        envs.step(_zeros(3))
    assert_env_error(raised.value, kind)
    with pytest.raises(KINDS[kind]) as raised:
        envs.reset(seed=0, options={"explode": True})
    assert_env_error(raised.value, kind, "reset")
    assert not envs.closed
    obs, _ = envs.reset(seed=1)
    assert obs.shape[0] == 3


@pytest.mark.backends(isolated=True)
@pytest.mark.parametrize("how", ["exit", "sigkill", "segfault"])
def test_worker_death_is_an_env_crashed_error_naming_its_envs(
    make_env: Any, snapshot: Any, backend: Any, how: str
) -> None:
    """Env 1's worker dies in env 1's third step: that step raises EnvCrashedError naming
    env 1 and its worker; the vector env is closed and (own processes) nothing is left."""
    envs = make_env(fault_factory({1: (how, 3)}), 2, **backend.options, num_workers=2, **FAIL_FAST)
    envs.reset(seed=0)
    for _ in range(2):
        envs.step(_zeros(2))
    with pytest.raises(envfleet.EnvCrashedError) as info:
        envs.step(_zeros(2))
    err = info.value
    assert (err.env_indices, err.env_index, err.worker_index) == ([1], 1, 1)
    if backend.workers == "processes":
        if how == "exit":
            assert (err.exitcode, err.signal) == (3, None)
        else:
            assert err.signal == (signal.SIGKILL if how == "sigkill" else signal.SIGSEGV)
    assert envs.closed and envs.stats.crashes == 1
    with pytest.raises(envfleet.ClosedEnvironmentError):
        envs.step(_zeros(2))
    if backend.owns_processes:
        snapshot.assert_nothing_left()


@pytest.mark.backends(workers=True)
def test_hung_env_is_a_step_timeout_error_naming_it(
    make_env: Any, snapshot: Any, backend: Any
) -> None:
    """Env 1 sleeps far past ``step_timeout`` in its third step: that step raises
    StepTimeoutError (also gymnasium's multiprocessing.TimeoutError) naming env 1, and the
    vector env is closed."""
    envs = make_env(
        fault_factory({1: ("sleep:60", 3)}),
        2,
        **backend.options,
        num_workers=2,
        supervision=envfleet.Supervision(step_timeout=2.0, restart_policy=None),
    )
    envs.reset(seed=0)
    for _ in range(2):
        envs.step(_zeros(2))
    with pytest.raises(envfleet.StepTimeoutError) as info:
        envs.step(_zeros(2))
    assert isinstance(info.value, multiprocessing.TimeoutError)
    assert (info.value.env_indices, info.value.timeout) == ([1], 2.0)
    assert envs.closed
    if backend.workers == "processes":
        snapshot.assert_nothing_left()


def _fault_lines(marker: str, count: int = 1, env: type = FaultEnv) -> list[str]:
    """``tests/envs.py:LINE`` of the line of ``env.step`` that holds ``marker`` and of the
    ``count - 1`` lines after it."""
    lines, first = inspect.getsourcelines(env.step)
    offset = next(i for i, line in enumerate(lines) if marker in line)
    path = inspect.getsourcefile(env)
    return [f"{path}:{first + offset + k}" for k in range(count)]


@pytest.mark.backends("threads", "processes", "processes-spawn", "ray")
@pytest.mark.per_backend(
    "how", lambda backend: ["sleep"] if backend.workers == "threads" else ["sleep", "spin"]
)
def test_a_hung_envs_stack_comes_with_its_step_timeout(
    make_env: Any, snapshot: Any, backend: Any, how: str
) -> None:
    """Issue 32 item 1: env 1 hangs in its third step, in a C call (``time.sleep``) or in a
    Python loop; the StepTimeoutError carries the stacks of worker 1 taken before it was
    killed (``err.stacks``), and its message names the env's innermost frame."""
    envs = make_env(
        fault_factory({1: (f"{how}:60", 3)}),
        2,
        **backend.options,
        num_workers=2,
        supervision=envfleet.Supervision(step_timeout=1.0, restart_policy=None),
    )
    envs.reset(seed=0)
    for _ in range(2):
        envs.step(_zeros(2))
    with pytest.raises(envfleet.StepTimeoutError) as info:
        envs.step(_zeros(2))
    err = info.value
    # A signal finds the Python loop on either of its two lines (the test, the body).
    lines = (
        _fault_lines("time.sleep(float")
        if how == "sleep"
        else _fault_lines("while time.monotonic()", 2)
    )
    assert list(err.stacks) == [1]
    where = innermost(err.stacks[1])
    assert where in [f"{line} in step" for line in lines]
    assert f"worker 1 at {where}" in str(err)
    # A Ray actor's other threads (Ray's own) may come first; the hung one is marked.
    assert "Current thread" in err.stacks[1] and "in step" in err.stacks[1]
    if backend.name != "ray":
        assert err.stacks[1].startswith("Current thread")
    if backend.workers == "processes":
        snapshot.assert_nothing_left()  # no worker, and no stack file, left


@pytest.mark.backends(isolated=True)
def test_a_segfaults_stack_comes_with_its_crash_error(
    make_env: Any, snapshot: Any, backend: Any
) -> None:
    """Issue 32 item 2: env 1 writes at address 0 in its third step (a real SIGSEGV); the
    EnvCrashedError carries what the worker's faulthandler wrote at the fault
    (``err.stacks``), and its message names the env's innermost frame. On Ray, from the
    actor's file, read by its node's helper (Ray gives no exit code)."""
    envs = make_env(
        fault_factory({1: ("null-write", 3)}), 2, **backend.options, num_workers=2, **FAIL_FAST
    )
    envs.reset(seed=0)
    for _ in range(2):
        envs.step(_zeros(2))
    with pytest.raises(envfleet.EnvCrashedError) as info:
        envs.step(_zeros(2))
    err = info.value
    [where] = _fault_lines("ctypes.memset(0, 0, 1)")
    seen = f"{err}\n{err.stacks}"  # what the assertions below read, shown if one fails
    assert err.worker_index == 1, seen
    if backend.owns_processes:
        assert err.signal == signal.SIGSEGV, seen
    assert "Segmentation fault" in err.stacks, seen
    assert innermost(err.stacks) == f"{where} in step", seen
    assert f"at {where} in step)" in str(err), seen
    if backend.owns_processes:
        snapshot.assert_nothing_left()


@pytest.mark.backends(isolated=True)
def test_a_hang_reports_stacks_are_not_a_later_deaths(
    make_env: Any, snapshot: Any, backend: Any, tmp_path: Path
) -> None:
    """Env 1 hangs 0.8 s in its 2nd step, and is reported (``hang_report_delay=0.3``: its
    worker writes its stacks to its stack file when asked by a signal); then it is SIGKILLed
    in its 4th. A SIGKILL leaves no stacks: the EnvCrashedError carries none and names no
    frame, though the file still holds the hang report's answer (once read as the crash's)."""
    marker = str(tmp_path / "fired")
    for k in (0, 1):
        Path(f"{marker}-0-{k}").touch()  # env 0 is spared both faults
    series = (("sleep:0.8", 2), ("sigkill", 4))
    envs = make_env(
        functools.partial(FaultSeriesEnv, series=series, marker=marker),
        2,
        **backend.options,
        num_workers=2,
        supervision=envfleet.Supervision(restart_policy=None, hang_report_delay=0.3),
    )
    envs.reset(seed=0)
    [hung] = _fault_lines("time.sleep(float(", env=FaultSeriesEnv)
    with pytest.warns(envfleet.HangWarning) as reports:
        for _ in range(2):
            envs.step(_zeros(2))
    assert any(hung in str(r.message) for r in reports), [str(r.message) for r in reports]
    envs.step(_zeros(2))
    with pytest.raises(envfleet.EnvCrashedError) as info:
        envs.step(_zeros(2))
    err = info.value
    seen = f"{err}\n{err.stacks}"
    assert err.worker_index == 1, seen
    if backend.owns_processes:
        assert err.signal == signal.SIGKILL, seen
    assert err.stacks == "", seen
    assert hung not in str(err), seen
    if backend.owns_processes:
        snapshot.assert_nothing_left()


@pytest.mark.backends(processes=True)
def test_a_sigkilled_worker_is_reported_with_its_last_memory(
    make_env: Any, snapshot: Any, backend: Any, monkeypatch: Any
) -> None:
    """Issue 32 item 2: env 1 takes 256 MiB, then is SIGKILLed (the OOM killer's way, which
    leaves no stack); the EnvCrashedError gives the worker's resident memory last seen."""
    monkeypatch.setattr(workers, "RSS_PERIOD_S", 0.05)  # the driver's sampling thread
    envs = make_env(
        functools.partial(MemoryHogEnv, mb=256, kill_at=20),
        2,
        **backend.options,
        num_workers=2,
        **FAIL_FAST,
    )
    envs.reset(seed=0)
    with pytest.raises(envfleet.EnvCrashedError) as info:
        for _ in range(20):
            envs.step(_zeros(2))
    err = info.value
    assert err.signal == signal.SIGKILL and err.stacks == ""
    assert err.rss_bytes is not None and err.rss_bytes >= 256 * 2**20
    assert "its resident memory last seen: " in str(err)
    snapshot.assert_nothing_left()
