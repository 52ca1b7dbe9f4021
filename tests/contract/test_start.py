"""Regression tests of issue 17's start and threads defects: an env constructor that hangs
(``start_timeout``), an env raising ``SystemExit``/``KeyboardInterrupt``/``GeneratorExit`` in
a worker thread, an env hanging in ``close``.

Real envs, real threads and worker processes, real hangs.
"""

from __future__ import annotations

import fcntl
import importlib
import inspect
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import envfleet
from envfleet._backends.replacement import WorkerReplacement
from envfleet._core.stacks import innermost
from tests.envs import FaultEnv


class StartEnv(FaultEnv):
    """Env ``hang_index`` sleeps ``hang_s`` seconds in its constructor (or, with
    ``in_close``, in ``close``), or, given ``held_by`` (a file's path), waits in its
    constructor until no one holds that file's lock; env ``raise_index`` raises
    ``raise_type()`` in its ``raise_after``-th step. Given ``rebuilt_marker`` (a file's path),
    env ``hang_index``'s first build makes that file and waits for nothing, and every later
    build (a replacement's) sleeps ``hang_s``. ``faults``: as :class:`FaultEnv`'s."""

    def __init__(
        self,
        env_index: int = 0,
        hang_index: int = -1,
        hang_s: float = 1000.0,
        in_close: bool = False,
        raise_index: int = -1,
        raise_type: type[BaseException] = SystemExit,
        raise_after: int = 2,
        held_by: str | None = None,
        rebuilt_marker: str | None = None,
        faults: dict[int, tuple[str, int]] | None = None,
    ):
        super().__init__(env_index, faults)
        self.hang = env_index == hang_index
        if self.hang and rebuilt_marker is not None and not Path(rebuilt_marker).exists():
            Path(rebuilt_marker).touch()
            self.hang = False
        self.hang_s = hang_s
        self.in_close = in_close
        self.raises = raise_type if env_index == raise_index else None
        self.raise_after = raise_after
        if self.hang and held_by is not None:
            with open(held_by) as lock:
                fcntl.flock(lock, fcntl.LOCK_SH)  # blocks while the test holds LOCK_EX
        elif self.hang and not in_close:
            time.sleep(hang_s)

    def step(self, action: Any):
        if self.raises is not None and self._steps + 1 == self.raise_after:
            raise self.raises()
        return super().step(action)

    def close(self) -> None:
        if self.hang and self.in_close:
            time.sleep(self.hang_s)


def start_factory(**knobs: Any) -> Any:
    def factory(env_index: int) -> StartEnv:
        return StartEnv(env_index, **knobs)

    return factory


@pytest.mark.backends("processes", "threads")
def test_start_timeout_bounds_a_hanging_constructor(
    backend: Any, snapshot: Any, make_env: Any
) -> None:
    """Issue 17 item 5: env 2's constructor sleeps 1000 s; make() hung for good."""
    start = time.monotonic()
    with pytest.raises(envfleet.StartTimeoutError) as info:
        make_env(
            start_factory(hang_index=2),
            4,
            **backend.options,
            num_workers=4,
            supervision=envfleet.Supervision(start_timeout=2.0),
        )
    assert time.monotonic() - start < 15.0
    assert info.value.env_indices == [2] and info.value.timeout == 2.0
    assert "2" in str(info.value) and "start_timeout" in str(info.value)
    # Issue 32 item 1: the stack of the worker building env 2 (worker 2), its constructor's
    # sleep innermost, taken before it was given up; the message names that frame.
    lines, first = inspect.getsourcelines(StartEnv.__init__)
    line = first + next(i for i, text in enumerate(lines) if "time.sleep(hang_s)" in text)
    where = f"{inspect.getsourcefile(StartEnv)}:{line} in __init__"
    assert list(info.value.stacks) == [2] and innermost(info.value.stacks[2]) == where
    assert f"2 at {where}" in str(info.value)
    snapshot.assert_nothing_left()


@pytest.mark.ray
def test_start_timeout_on_ray(make_env: Any) -> None:
    """Issue 17 item 5 on Ray: the actor building env 1 is killed after start_timeout."""
    with pytest.raises(envfleet.StartTimeoutError) as info:
        make_env(
            start_factory(hang_index=1),
            2,
            backend="ray",
            num_workers=2,
            supervision=envfleet.Supervision(start_timeout=20.0),
        )
    assert info.value.env_indices == [1]


def _replacing(make_env: Any, tmp_path: Path, hang_s: float, **supervision: Any) -> Any:
    """Two envs, one a worker, under a restart policy, reset and stepped once: env 1's worker
    exits in the next step, and its replacement's constructor sleeps ``hang_s``."""
    factory = start_factory(
        hang_index=1,
        hang_s=hang_s,
        rebuilt_marker=str(tmp_path / "built"),
        faults={1: ("exit", 2)},
    )
    policy = envfleet.RestartPolicy(restart_on=(Exception,), max_restarts=1, window_s=600.0)
    envs = make_env(
        factory,
        2,
        backend="processes",
        num_workers=2,
        supervision=envfleet.Supervision(restart_policy=policy, **supervision),
    )
    envs.reset(seed=0)
    envs.step(np.zeros(2, dtype=np.int64))
    return envs


def test_a_replacement_is_built_within_start_timeout_not_step_timeout(
    make_env: Any, tmp_path: Path
) -> None:
    """A worker replaced under a restart policy builds its envs as at the start: within
    ``start_timeout``, even when that is longer than the step's ``step_timeout``. The
    replacement's constructor takes 3 s, three times the step's timeout (bounded by
    ``step_timeout``, as it was, the step raised ``StepTimeoutError``)."""
    envs = _replacing(make_env, tmp_path, 3.0, step_timeout=1.0)
    _, _, terminated, truncated, info = envs.step(np.zeros(2, dtype=np.int64))
    assert info["env_restarted"].tolist() == [False, True]
    assert truncated.tolist() == [False, True] and not terminated.any()
    assert envs.stats.restarts == 1 and envs.stats.timeouts == 0
    envs.step(np.zeros(2, dtype=np.int64))  # the rebuilt env steps on


def test_a_replacement_past_start_timeout_raises_and_closes(
    make_env: Any, snapshot: Any, tmp_path: Path
) -> None:
    """A replacement whose constructor hangs is given up after ``start_timeout``:
    ``StartTimeoutError`` names its env and its constructor's frame, the vector env is closed
    and no process or shared memory is left."""
    envs = _replacing(make_env, tmp_path, 1000.0, start_timeout=2.0)
    with pytest.raises(envfleet.StartTimeoutError) as info:
        envs.step(np.zeros(2, dtype=np.int64))
    assert info.value.env_indices == [1] and info.value.timeout == 2.0
    assert "rebuilt within 2.0 s (start_timeout)" in str(info.value)
    assert "the vector env closed" in str(info.value)
    assert innermost(info.value.stacks[1]).endswith(" in __init__")
    assert envs.closed
    snapshot.assert_nothing_left()


@pytest.mark.parametrize("value", [0, -1.0, "5", float("nan")])
def test_start_timeout_is_checked(value: Any) -> None:
    with pytest.raises(envfleet.ConfigError, match="start_timeout"):
        envfleet.make(
            "CartPole-v1",
            2,
            backend="serial",
            supervision=envfleet.Supervision(start_timeout=value),
        )


SMALL_DEFAULT_S = 0.2  # make()'s default start_timeout in the test below


def test_start_timeout_none_waits_for_a_slow_constructor(
    make_env: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """``start_timeout=None`` is no bound, not make()'s default one. The default is made
    SMALL_DEFAULT_S here (make()'s default ``supervision``; the bound is the driver's, so no
    worker needs to see it), and env 1's constructor waits on a file lock the test holds.
    With the default, make() gives up on that constructor; with None, make() returns once
    the test lets the constructor go, which it does a second after the driver began waiting
    for its workers: past any deadline the default set."""
    make_module = importlib.import_module("envfleet._front.make")
    small = envfleet.Supervision(start_timeout=SMALL_DEFAULT_S)
    monkeypatch.setitem(make_module.make.__kwdefaults__, "supervision", small)
    lock_path = tmp_path / "constructor.lock"
    lock_path.touch()
    factory = start_factory(hang_index=1, held_by=str(lock_path))
    with open(lock_path) as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        # The default does give up on this constructor (else the rest would prove nothing).
        with pytest.raises(envfleet.StartTimeoutError) as info:
            make_env(factory, 2, backend="processes", num_workers=2)
        assert info.value.env_indices == [1] and info.value.timeout == SMALL_DEFAULT_S

        waiting, made = threading.Event(), threading.Event()
        began: list[float] = []
        start = WorkerReplacement._start

        def watched_start(self: WorkerReplacement, *args: Any, **kwargs: Any) -> None:
            began.append(time.monotonic())
            waiting.set()  # the driver begins waiting for its workers (its deadline, if any)
            start(self, *args, **kwargs)

        monkeypatch.setattr(WorkerReplacement, "_start", watched_start)

        def let_go() -> None:
            waiting.wait(60)
            made.wait(SMALL_DEFAULT_S + 1.0)  # only a failed make() ends this early
            fcntl.flock(held, fcntl.LOCK_UN)

        releaser = threading.Thread(target=let_go, daemon=True)
        releaser.start()
        try:
            envs = make_env(
                factory,
                2,
                backend="processes",
                num_workers=2,
                supervision=envfleet.Supervision(start_timeout=None),
            )
        finally:
            made.set()
            waiting.set()
            releaser.join()
        # make() waited for the constructor longer than the default allows.
        assert time.monotonic() - began[0] > SMALL_DEFAULT_S + 1.0
    obs, _ = envs.reset(seed=0)
    assert obs.shape == (2, 2)


@pytest.mark.parametrize("raised", [SystemExit, KeyboardInterrupt, GeneratorExit])
@pytest.mark.backends("threads", "processes")
def test_env_raising_a_base_exception_gives_an_env_error(
    backend: Any, raised: type[BaseException], make_env: Any, snapshot: Any
) -> None:
    """Issue 17 item 4: SystemExit inside an env's step ended its thread and the caller
    waited for good. Now an EnvError carries it."""
    envs = make_env(
        start_factory(raise_index=1, raise_type=raised), 2, **backend.options, num_workers=2
    )
    envs.reset(seed=0)
    envs.step(np.zeros(2, dtype=np.int64))
    done = threading.Event()
    caught: list[BaseException] = []

    def step() -> None:
        try:
            envs.step(np.zeros(2, dtype=np.int64))
        except BaseException as exc:
            caught.append(exc)
        done.set()

    # In a thread of its own, so a regression fails the test instead of hanging it.
    threading.Thread(target=step, daemon=True).start()
    assert done.wait(30), "step() hung"
    assert isinstance(caught[0], envfleet.EnvError), caught
    assert caught[0].env_index == 1
    assert isinstance(caught[0].__cause__, raised)
    envs.close()
    if backend.workers == "processes":
        snapshot.assert_nothing_left()


def test_threads_close_returns_when_an_env_hangs_in_close() -> None:
    """Issue 17 item 4: close() of a threads vector env whose env hangs in close()."""
    envs = envfleet.make(
        start_factory(hang_index=1, in_close=True), 2, backend="threads", num_workers=2
    )
    envs.reset(seed=0)
    start = time.monotonic()
    envs.close(timeout=2.0)
    assert time.monotonic() - start < 6.0
    assert envs.closed


def returns_not_an_env(bad_index: int, bad: Any) -> Any:
    def factory(env_index: int) -> Any:
        return bad if env_index == bad_index else StartEnv(env_index)

    return factory


def _no_env_cases(backend: Any) -> list[tuple[Any, int]]:
    if not backend.cheap:  # one case: its path is the processes one
        return [(None, 3)]
    return [(bad, bad_index) for bad in [None, "CartPole-v1"] for bad_index in [0, 3]]


@pytest.mark.per_backend("bad, bad_index", _no_env_cases)
def test_factory_returning_no_env_is_a_config_error_naming_it(
    backend: Any, bad: Any, bad_index: int, snapshot: Any, make_env: Any
) -> None:
    """Issue 17 item 7: serial and threads raised AttributeError; processes an EnvError
    naming sub-environment 2 when env 3 returned the bad object."""
    with pytest.raises(envfleet.ConfigError) as info:
        make_env(returns_not_an_env(bad_index, bad), 4, **backend.options, num_workers=2)
    message = str(info.value)
    assert f"sub-environment {bad_index} returned {bad!r}" in message
    assert not isinstance(info.value, envfleet.EnvError)
    if backend.owns_processes:
        snapshot.assert_nothing_left()
