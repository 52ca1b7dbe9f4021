"""A fatal signal in an env the learner's process steps itself (processes' ``driver_envs``)
dies loudly: before the process dies of the signal, stderr names the env (a line from the C
module's handler) and shows its faulting Python frame (faulthandler's dump, which that
handler chains to), and a faulthandler the user enabled before make() still gets its dump.
An env in a worker still gives EnvCrashedError with the learner alive.

Each case runs in a fresh interpreter (a script in a subprocess): the learner really dies.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import envfleet._core.native

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux's fatal signals"),
    pytest.mark.timeout(180),
]

# Env ``crash_index`` reads address 0 (a real SIGSEGV, in C) in its third step; every
# other env behaves. The script prints each step it finished, flushed.
SCRIPT = """\
import ctypes
import faulthandler
import functools
import sys

import gymnasium as gym
import numpy as np

import envfleet


class SegfaultEnv(gym.Env):
    def __init__(self, crash: bool):
        self.crash, self.steps = crash, 0
        self.observation_space = gym.spaces.Box(-1.0, 1.0, (2,), np.float32)
        self.action_space = gym.spaces.Discrete(2)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return np.zeros(2, np.float32), {}

    def step(self, action):
        self.steps += 1
        if self.crash and self.steps == 3:
            ctypes.string_at(0)  # THE FAULT
        return np.zeros(2, np.float32), 1.0, False, False, {}


def factories(crash_index):
    return [functools.partial(SegfaultEnv, crash=i == crash_index) for i in range(4)]


def run(crash_index, context=None):
    envs = envfleet.make(
        factories(crash_index),
        backend=envfleet.Processes(context=context, driver_envs=2),
        num_workers=2,
    )
    envs.reset(seed=0)
    for t in range(5):
        try:
            envs.step(np.zeros(4, dtype=np.int64))
        except envfleet.EnvCrashedError as err:
            print(f"EnvCrashedError env {err.env_index} worker {err.worker_index}", flush=True)
            return
        print(f"stepped {t + 1}", flush=True)
    envs.close()


if __name__ == "__main__":  # spawned workers import this module
{body}
"""


def _run(tmp_path: Path, body: str, no_speedups: bool = False) -> subprocess.CompletedProcess:
    script = tmp_path / "crash.py"
    script.write_text(SCRIPT.replace("{body}", textwrap.indent(textwrap.dedent(body), "    ")))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    env.pop("PYTHONFAULTHANDLER", None)  # the script's own faulthandler state is the test's
    env.pop("ENVFLEET_NO_SPEEDUPS", None)
    if no_speedups:
        env["ENVFLEET_NO_SPEEDUPS"] = "1"
    return subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=150,
    )


def _fault_frame(tmp_path: Path) -> str:
    """faulthandler's line for the env's faulting frame in the script."""
    lines = (tmp_path / "crash.py").read_text().splitlines()
    [number] = [i + 1 for i, line in enumerate(lines) if "# THE FAULT" in line]
    return f'File "{tmp_path / "crash.py"}", line {number} in step'


NOTE_LINE = (
    "envfleet: fatal signal SIGSEGV while the learner's process was stepping "
    "sub-environment 1 (driver_envs=2)"
)


def _needs_speedups() -> None:
    if envfleet._core.native.speedups is None:
        pytest.skip("envfleet._core._speedups is not built here (the line is its handler's)")


def test_a_segfault_in_the_drivers_share_names_the_env_and_its_frame(tmp_path: Path) -> None:
    """Env 1, stepped by the learner's process (driver_envs=2), segfaults in its third step:
    the process dies of SIGSEGV, and stderr holds the line naming env 1, then faulthandler's
    dump of every thread with the env's faulting frame (enabled by make(): the script did
    not enable it)."""
    _needs_speedups()
    out = _run(tmp_path, "run(crash_index=1)")
    shown = f"rc {out.returncode}\nstdout:\n{out.stdout}\nstderr:\n{out.stderr}"
    assert out.returncode == -signal.SIGSEGV, shown
    assert out.stdout.splitlines() == ["stepped 1", "stepped 2"], shown
    assert NOTE_LINE in out.stderr, shown
    assert "Fatal Python error: Segmentation fault" in out.stderr, shown
    assert _fault_frame(tmp_path) in out.stderr, shown
    # The line first (the C handler), then faulthandler's dump (chained to).
    assert out.stderr.index(NOTE_LINE) < out.stderr.index(_fault_frame(tmp_path)), shown


def test_a_faulthandler_enabled_by_the_user_still_gets_its_dump(tmp_path: Path) -> None:
    """The user enabled faulthandler into a file before make(): make() keeps it (the dump,
    with the faulting frame, goes to that file, chained to from envfleet's handler), the line
    naming the env goes to stderr, and the process dies of SIGSEGV."""
    _needs_speedups()
    body = """
        with open("user-faults.txt", "w") as user_file:
            faulthandler.enable(file=user_file, all_threads=False)
            run(crash_index=1)
    """
    out = _run(tmp_path, body)
    shown = f"rc {out.returncode}\nstdout:\n{out.stdout}\nstderr:\n{out.stderr}"
    assert out.returncode == -signal.SIGSEGV, shown
    assert NOTE_LINE in out.stderr, shown
    dump = (tmp_path / "user-faults.txt").read_text()
    assert "Fatal Python error: Segmentation fault" in dump, shown + f"\nfile:\n{dump}"
    assert _fault_frame(tmp_path) in dump, shown + f"\nfile:\n{dump}"
    assert "Fatal Python error" not in out.stderr, shown  # the user's file, not stderr


def test_without_the_c_module_faulthandler_alone_writes_the_frame(tmp_path: Path) -> None:
    """ENVFLEET_NO_SPEEDUPS=1: no line naming the env (it is the C handler's), but make()
    still enabled faulthandler, whose dump shows the env's faulting frame."""
    out = _run(tmp_path, "run(crash_index=1)", no_speedups=True)
    shown = f"rc {out.returncode}\nstdout:\n{out.stdout}\nstderr:\n{out.stderr}"
    assert out.returncode == -signal.SIGSEGV, shown
    assert "envfleet: fatal signal" not in out.stderr, shown
    assert "Fatal Python error: Segmentation fault" in out.stderr, shown
    assert _fault_frame(tmp_path) in out.stderr, shown


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_a_segfault_in_a_worker_is_still_an_env_crashed_error(tmp_path: Path, context: str) -> None:
    """A vector env with a driver share is made first (its handler installed in the learner);
    then, in a second one whose workers start after that (forked: they inherit it), env 3,
    in a worker, segfaults: the learner gets EnvCrashedError naming env 3 and lives on, and
    nothing claims the learner was stepping an env."""
    body = f"""
        first = envfleet.make(
            factories(crash_index=-1), backend=envfleet.Processes(driver_envs=2), num_workers=2
        )
        first.reset(seed=0)
        first.step(np.zeros(4, dtype=np.int64))
        run(crash_index=3, context={context!r})
        first.step(np.zeros(4, dtype=np.int64))
        first.close()
        print("learner alive", flush=True)
    """
    out = _run(tmp_path, body)
    shown = f"rc {out.returncode}\nstdout:\n{out.stdout}\nstderr:\n{out.stderr}"
    assert out.returncode == 0, shown
    assert out.stdout.splitlines() == [
        "stepped 1",
        "stepped 2",
        "EnvCrashedError env 3 worker 2",
        "learner alive",
    ], shown
    assert "envfleet: fatal signal" not in out.stderr, shown


def test_a_forked_process_starts_with_the_note_cleared(tmp_path: Path) -> None:
    """The note is set while the learner steps one of its envs; a process forked from it
    (a worker started meanwhile) reads it cleared, so its own fatal signal never claims the
    learner's env."""
    _needs_speedups()
    body = """
        import ctypes, os
        from envfleet._core.crash_note import driver_crash_note, note_base

        note = driver_crash_note()
        note[0] = note_base(4, 0) + 3
        word = ctypes.c_int64.from_address(envfleet._core.native.speedups.crash_note())
        assert word.value == (4 << 32) + 3
        pid = os.fork()
        if pid == 0:
            os._exit(0 if word.value == -1 else 1)
        _, status = os.waitpid(pid, 0)
        print("child", os.waitstatus_to_exitcode(status), "parent", word.value == (4 << 32) + 3)
    """
    out = _run(tmp_path, body)
    shown = f"rc {out.returncode}\nstdout:\n{out.stdout}\nstderr:\n{out.stderr}"
    assert out.returncode == 0, shown
    assert out.stdout.strip() == "child 0 parent True", shown
