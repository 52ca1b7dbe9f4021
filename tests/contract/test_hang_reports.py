"""Hang reports (``envfleet.HangWarning``) and the note a Ctrl-C carries.

Every hang here is real and bounded: an env whose step (or a called method) blocks in
:func:`stuck_in_step` for a second or two, with ``hang_report_delay=0.3``; the reports are
recorded as they are warned, with the time they came, and checked for the busy env's index,
its worker and the hung frame's function; the results after the hang are checked too. The
Ctrl-C tests run a small script in a fresh interpreter that interrupts itself with SIGINT
while an env hangs, and check the note on the ``KeyboardInterrupt``, that the script ends
soon, and that it leaves no worker process.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import subprocess
import sys
import textwrap
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import pytest
from gymnasium import spaces

import envfleet

ROOT = Path(__file__).resolve().parents[2]
DELAY = 0.3  # hang_report_delay of these tests, seconds
HANG_S = 1.6  # a hang that sees two reports: after 0.3 s and 0.6 s later (doubled)
SHORT_S = 0.8  # a hang that sees one report


def stuck_in_step(seconds: float) -> None:
    """Where a hung env blocks: the frame a report must name."""
    time.sleep(seconds)


class HangEnv(gym.Env):
    """Env ``hung`` (``-1``: every env) blocks ``hang_s`` seconds in :func:`stuck_in_step`
    in its step number ``at_step`` (once), and in ``stall`` (a method for ``call``). Its
    reward is its ``env_index``."""

    def __init__(self, env_index: int = 0, hung: int = 1, at_step: int = 2, hang_s: float = HANG_S):
        self.env_index = env_index
        self.hangs = hung in (-1, env_index)
        self.at_step = at_step
        self.hang_s = hang_s
        self.steps = 0
        self.observation_space = spaces.Box(-1.0, 1.0, (2,), np.float32)
        self.action_space = spaces.Discrete(2)

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        return np.full(2, self.env_index / 10, np.float32), {}

    def step(self, action: Any):
        self.steps += 1
        if self.hangs and self.steps == self.at_step:
            stuck_in_step(self.hang_s)
        obs = np.full(2, self.env_index / 10, np.float32)
        return obs, float(self.env_index), False, False, {}

    def stall(self) -> int:
        if self.hangs:
            stuck_in_step(self.hang_s)
        return self.env_index


def hang_env(**kwargs: Any) -> Any:
    return functools.partial(HangEnv, **kwargs)


@contextlib.contextmanager
def reports() -> Iterator[list[tuple[float, str]]]:
    """The HangWarnings warned inside, each ``(time.monotonic() when warned, its text)``
    (whichever thread warned it); every other warning goes on as before."""
    got: list[tuple[float, str]] = []
    with warnings.catch_warnings():
        warnings.simplefilter("always", envfleet.HangWarning)
        shown = warnings.showwarning

        def show(message: Any, category: Any, *args: Any, **kwargs: Any) -> None:
            if issubclass(category, envfleet.HangWarning):
                got.append((time.monotonic(), str(message)))
            else:
                shown(message, category, *args, **kwargs)

        warnings.showwarning = show
        yield got


def _assert_names(text: str, envs: str, worker: str) -> None:
    assert envs in text, text
    assert worker in text, text
    assert "stuck_in_step" in text, text


def _assert_doubling(got: list[tuple[float, str]], started: float) -> None:
    """The first report after the delay, the second about twice the delay later."""
    assert len(got) >= 2, got
    first, second = got[0][0] - started, got[1][0] - got[0][0]
    assert DELAY * 0.9 <= first <= DELAY + 0.5, first
    assert 2 * DELAY * 0.75 <= second <= 2 * DELAY + 0.5, second


def _actions(n: int) -> np.ndarray:
    return np.zeros(n, np.int64)


# -- hang reports -----------------------------------------------------------------------------


def test_serial_env_in_the_calling_thread_is_reported_then_at_doubled_intervals(
    make_env: Any,
) -> None:
    """The reporter thread watches the env run in the learner's own thread."""
    envs = make_env(
        hang_env(),
        2,
        backend="serial",
        num_workers=2,
        supervision=envfleet.Supervision(hang_report_delay=DELAY),
    )
    envs.reset(seed=0)
    envs.step(_actions(2))
    with reports() as got:
        started = time.monotonic()
        _, rewards, *_ = envs.step(_actions(2))
    _assert_names(got[0][1], "sub-environment 1 ", "worker 1")
    assert "run in the calling thread" in got[0][1]
    _assert_doubling(got, started)
    assert rewards.tolist() == [0.0, 1.0]
    with reports() as got:
        _, rewards, *_ = envs.step(_actions(2))
    assert got == [] and rewards.tolist() == [0.0, 1.0]


def test_processes_worker_is_reported_then_at_doubled_intervals(make_env: Any) -> None:
    """The default layout: env 1 runs in a worker process; the learner's wait reports it,
    with the stacks its worker wrote (the same text as a StepTimeoutError's)."""
    envs = make_env(
        hang_env(),
        2,
        backend="processes",
        supervision=envfleet.Supervision(hang_report_delay=DELAY),
    )
    envs.reset(seed=0)
    envs.step(_actions(2))
    with reports() as got:
        started = time.monotonic()
        _, rewards, *_ = envs.step(_actions(2))
    text = got[0][1]
    assert text.startswith("envfleet: step has waited"), text
    _assert_names(text, "(sub-environments [1])", "worker")
    assert "Current thread" in text  # faulthandler's format, as err.stacks
    _assert_doubling(got, started)
    assert rewards.tolist() == [0.0, 1.0]


def test_processes_driver_block_is_reported(make_env: Any) -> None:
    """``driver_envs=1``: env 0 runs in the driver's own block, in the learner's thread
    (inside the C step round)."""
    envs = make_env(
        hang_env(hung=0, hang_s=SHORT_S),
        2,
        backend=envfleet.Processes(driver_envs=1),
        num_workers=1,
        supervision=envfleet.Supervision(hang_report_delay=DELAY),
    )
    envs.reset(seed=0)
    envs.step(_actions(2))
    with pytest.warns(envfleet.HangWarning) as record:
        _, rewards, *_ = envs.step(_actions(2))
    text = str(record[0].message)
    _assert_names(text, "sub-environment 0 ", "worker 0")
    assert rewards.tolist() == [0.0, 1.0]


def test_threads_worker_is_reported(make_env: Any) -> None:
    envs = make_env(
        hang_env(hang_s=SHORT_S),
        2,
        backend="threads",
        num_workers=2,
        supervision=envfleet.Supervision(hang_report_delay=DELAY),
    )
    envs.reset(seed=0)
    envs.step(_actions(2))
    with pytest.warns(envfleet.HangWarning) as record:
        _, rewards, *_ = envs.step(_actions(2))
    _assert_names(str(record[0].message), "(sub-environments [1])", "thread 1")
    assert rewards.tolist() == [0.0, 1.0]


def test_call_is_reported(make_env: Any) -> None:
    envs = make_env(
        hang_env(hang_s=SHORT_S),
        2,
        backend="processes",
        num_workers=2,
        supervision=envfleet.Supervision(hang_report_delay=DELAY),
    )
    with pytest.warns(envfleet.HangWarning) as record:
        values = envs.call("stall")
    text = str(record[0].message)
    assert text.startswith("envfleet: call has waited"), text
    _assert_names(text, "(sub-environments [1])", "worker 1")
    assert list(values) == [0, 1]


def test_pool_recv_is_reported(make_env: Any) -> None:
    """A first-ready pool's recv with every env hung names every busy worker."""
    envs = make_env(
        hang_env(hung=-1, at_step=1, hang_s=SHORT_S),
        2,
        backend="processes",
        num_workers=2,
        batch_size=1,
        supervision=envfleet.Supervision(hang_report_delay=DELAY),
    )
    envs.async_reset(seed=0)
    ids = [int(envs.recv()[4]["env_id"][0]) for _ in range(2)]
    assert sorted(ids) == [0, 1]
    envs.send(_actions(2), np.array([0, 1]))
    with pytest.warns(envfleet.HangWarning) as record:
        _, rewards, _, _, info = envs.recv()
    _assert_names(str(record[0].message), "(sub-environments [0, 1])", "workers [0, 1]")
    assert rewards.tolist() == [float(info["env_id"][0])]


def _zero_policy(observations: Any) -> np.ndarray:
    return np.zeros(len(observations), np.int64)


def test_sampler_round_is_reported() -> None:
    """Worker inference: the learner waits on a worker's round of steps with its policy."""
    sampler = envfleet.Sampler(
        hang_env(hang_s=SHORT_S),
        _zero_policy,
        2,
        inference="worker",
        num_workers=2,
        segment_length=4,
        seed=0,
        backend="processes",
        supervision=envfleet.Supervision(hang_report_delay=DELAY),
    )
    try:
        with pytest.warns(envfleet.HangWarning) as record:
            batch = sampler.sample(8)
    finally:
        sampler.close()
    _assert_names(str(record[0].message), "(sub-environments [1])", "worker 1")
    assert batch.num_steps >= 8


def test_process_env_is_reported() -> None:
    with envfleet.ProcessEnv(
        hang_env(hung=0, hang_s=SHORT_S), supervision=envfleet.Supervision(hang_report_delay=DELAY)
    ) as penv:
        penv.reset(seed=0)
        penv.step(0)
        with pytest.warns(envfleet.HangWarning) as record:
            obs, reward, *_ = penv.step(0)
    _assert_names(str(record[0].message), "(sub-environments [0])", "worker 0")
    assert reward == 0.0 and obs.tolist() == [0.0, 0.0]


@pytest.mark.parametrize("backend_name", ["serial", "processes"])
def test_no_report_with_none(make_env: Any, backend_name: str) -> None:
    envs = make_env(
        hang_env(hang_s=SHORT_S),
        2,
        backend=backend_name,
        num_workers=2,
        supervision=envfleet.Supervision(hang_report_delay=None),
    )
    envs.reset(seed=0)
    with reports() as got:
        envs.step(_actions(2))
        _, rewards, *_ = envs.step(_actions(2))
    assert got == []
    assert rewards.tolist() == [0.0, 1.0]


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf"), "60", True])
def test_bad_delay_is_a_config_error(bad: Any) -> None:
    with pytest.raises(envfleet.ConfigError, match="hang_report_delay"):
        envfleet.make(
            hang_env(),
            2,
            backend="processes",
            supervision=envfleet.Supervision(hang_report_delay=bad),
        )
    with pytest.raises(envfleet.ConfigError, match="hang_report_delay"):
        envfleet.Sampler(
            hang_env(), _zero_policy, 2, supervision=envfleet.Supervision(hang_report_delay=bad)
        )
    with pytest.raises(envfleet.ConfigError, match="hang_report_delay"):
        envfleet.ProcessEnv(hang_env(), supervision=envfleet.Supervision(hang_report_delay=bad))


@pytest.mark.ray
def test_ray_actor_is_reported(make_env: Any) -> None:
    envs = make_env(
        hang_env(hang_s=SHORT_S),
        2,
        backend="ray",
        num_workers=2,
        supervision=envfleet.Supervision(hang_report_delay=DELAY),
    )
    envs.reset(seed=0)
    envs.step(_actions(2))
    with pytest.warns(envfleet.HangWarning) as record:
        _, rewards, *_ = envs.step(_actions(2))
    text = str(record[0].message)
    assert "(sub-environments [1])" in text and "worker 1" in text, text
    # The actor's stacks, taken by its node's helper (tests/integration/test_ray_cluster.py:
    # on another node too).
    assert "stuck_in_step" in text and "stack not available" not in text, text
    assert rewards.tolist() == [0.0, 1.0]


# -- Ctrl-C -----------------------------------------------------------------------------------

SCRIPT = textwrap.dedent(
    """
    import json, multiprocessing, os, signal, sys, threading, time
    import numpy as np
    import psutil
    import envfleet
    from tests.contract.test_hang_reports import hang_env

    if __name__ == "__main__":
        # Ctrl-C raises KeyboardInterrupt as in a terminal, also where the tests run with
        # SIGINT ignored (a background job of a non-interactive shell): Python leaves an
        # inherited SIG_IGN as it is.
        signal.signal(signal.SIGINT, signal.default_int_handler)
        envs = envfleet.make(hang_env(hang_s=30.0), 2, backend=sys.argv[1])
        envs.reset(seed=0)
        envs.step(np.zeros(2, np.int64))
        threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT)).start()
        notes = None
        try:
            envs.step(np.zeros(2, np.int64))
        except KeyboardInterrupt as exc:
            notes = getattr(exc, "__notes__", None)
        envs.close()
        left = [p.pid for p in multiprocessing.active_children()]
        for proc in psutil.Process().children(recursive=True):  # not multiprocessing's helpers
            cmdline = " ".join(proc.cmdline())
            if "resource_tracker" not in cmdline and "forkserver" not in cmdline:
                left.append(cmdline)
        print(json.dumps({"notes": notes, "left": left}))
    """
)


@pytest.mark.parametrize("backend_name", ["processes", "serial"])
def test_ctrl_c_notes_where_it_was(tmp_path: Path, backend_name: str) -> None:
    script = tmp_path / "interrupted.py"
    script.write_text(SCRIPT)
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, str(script), backend_name],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *sys.path])},
        capture_output=True,
        text=True,
        timeout=60,
    )
    elapsed = time.monotonic() - started
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["notes"], (done.stdout, done.stderr)
    note = "\n".join(result["notes"])
    assert note.startswith("envfleet: Ctrl-C interrupted"), note
    assert "sub-environment" in note and "1" in note.split("stuck_in_step")[0], note
    assert "stuck_in_step" in note, note
    if backend_name == "serial":
        assert "sub-environment 1 " in note, note
    else:
        assert "(sub-environments [1])" in note and "stacks" in note, note
    assert result["left"] == [], (result, done.stderr)
    assert elapsed < 20.0, elapsed  # the env hangs 30 s: the interrupt ended the wait
