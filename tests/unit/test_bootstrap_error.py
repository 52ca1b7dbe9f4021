"""Issue 41 item 4: a script that starts workers on import (no ``if __name__ == "__main__":``)
under ``spawn`` or ``forkserver``: the error says so and names the fix.

Every ``spawn`` and ``forkserver`` worker imports the main module first; one that starts
workers there meets multiprocessing's "bootstrapping phase" error. Each test runs a script in
a fresh interpreter (the main module must be a file for the workers to import it), with
bounded timeouts; nothing asserts how fast anything happens.
"""

from __future__ import annotations

import functools
import multiprocessing
import os
import subprocess
import sys
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest

import envfleet
from tests.envs import CrashEnv, RaisingEnv

ROOT = Path(__file__).resolve().parents[2]
GUARD = 'if __name__ == "__main__":'
FORK = 'backend=envfleet.Processes(context="fork")'

# The README's usage block, as a user runs it: no main guard.
UNGUARDED = """
import sys
import envfleet
backend = envfleet.Processes(context=sys.argv[1])
envs = envfleet.make("CartPole-v1", num_envs=4, num_workers=2, backend=backend)
envs.reset(seed=0)
envs.close()
print("ok")
"""

GUARDED = """
import sys
import envfleet
if __name__ == "__main__":
    backend = envfleet.Processes(context=sys.argv[1])
    envs = envfleet.make("CartPole-v1", num_envs=4, num_workers=2, backend=backend)
    envs.reset(seed=0)
    envs.close()
    print("ok")
"""

# Guarded, but the workers cannot import the main module for another reason: they die
# with exit code 1 before they start, as above, yet this is no bootstrapping error.
FAILS_IN_THE_WORKERS = """
import sys
import envfleet
if __name__ != "__main__":
    raise ImportError("only the workers meet this")
if __name__ == "__main__":
    backend = envfleet.Processes(context=sys.argv[1])
    envs = envfleet.make("CartPole-v1", num_envs=4, num_workers=2, backend=backend)
    envs.close()
"""


def _run(tmp_path: Path, source: str, context: str, temp: Path) -> subprocess.CompletedProcess[str]:
    """Run ``source`` as the main module (a file) with ``context``; TMPDIR is ``temp``, a
    folder of its own (short: the fork server's socket is made there), so that the test sees
    what the run left there."""
    script = tmp_path / "train.py"
    script.write_text(source)
    env = dict(os.environ, TMPDIR=str(temp))
    env["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT / "src"), *filter(None, [os.environ.get("PYTHONPATH")])]
    )
    return subprocess.run(
        [sys.executable, str(script), context],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def _last_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    return lines[-1] if lines else ""


@pytest.mark.timeout(90)
@pytest.mark.parametrize("context", ["spawn", "forkserver"])
def test_a_script_that_starts_workers_on_import_is_told_the_fix(tmp_path, short_tmp_path, context):
    done = _run(tmp_path, UNGUARDED, context, short_tmp_path)
    assert done.returncode == 1, done.stderr
    assert "ok" not in done.stdout
    error = _last_line(done.stderr)
    assert error.startswith("envfleet._core.errors.EnvCrashedError: worker "), done.stderr
    assert "while starting, because the main module starts worker processes" in error
    assert f"({tmp_path / 'train.py'}, line 5)" in error  # where the script starts them
    assert f"under the {context!r} start method" in error
    assert GUARD in error and FORK in error
    # The worker's stack, with multiprocessing's own error, is the cause; the workers
    # themselves exit quietly: one traceback for the cause, one for the error.
    assert "bootstrapping phase" in done.stderr
    assert "RemoteTraceback" in done.stderr
    assert done.stderr.count("Traceback (most recent call last)") == 2, done.stderr
    # No worker file left behind (one that bootstrapped late must not recreate its file).
    assert [p.name for p in short_tmp_path.iterdir() if p.name.startswith("envfleet")] == []


@pytest.mark.timeout(90)
@pytest.mark.parametrize("context", ["spawn", "forkserver"])
def test_the_same_script_with_the_main_guard_runs(tmp_path, short_tmp_path, context):
    done = _run(tmp_path, GUARDED, context, short_tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["ok"]


@pytest.mark.timeout(90)
def test_workers_that_cannot_import_the_main_module_otherwise_are_not_told_so(
    tmp_path, short_tmp_path
):
    done = _run(tmp_path, FAILS_IN_THE_WORKERS, "spawn", short_tmp_path)
    assert done.returncode == 1
    error = _last_line(done.stderr)
    assert error.startswith("envfleet._core.errors.EnvCrashedError: worker "), done.stderr
    assert "died with exit code 1 after 0 steps" in error
    assert "main module" not in error and GUARD not in error and FORK not in error
    assert "only the workers meet this" in done.stderr  # the workers' own traceback


# -- in this process: other deaths at start keep their own message ------------------------


@pytest.mark.timeout(90)
def test_a_worker_that_exits_in_an_envs_init_under_spawn_is_not_told_so(snapshot):
    factory = functools.partial(CrashEnv, crash_index=2, how="exit", crash_in="init")
    with pytest.raises(envfleet.EnvCrashedError) as info:
        envfleet.make(
            factory,
            4,
            backend=envfleet.Processes(context="spawn"),
            num_workers=2,
        )
    err = info.value
    assert (err.worker_index, err.exitcode) == (1, 3)
    message = str(err)
    assert "died with exit code 3 after 0 steps" in message
    assert "main module" not in message and GUARD not in message and FORK not in message
    assert err.__cause__ is None
    snapshot.assert_nothing_left()


@pytest.mark.timeout(90)
def test_a_factory_that_raises_under_spawn_is_not_told_so(snapshot):
    factory = functools.partial(RaisingEnv, fail_index=3, fail_in="init")
    with pytest.raises(envfleet.EnvError) as info:
        envfleet.make(
            factory,
            4,
            backend=envfleet.Processes(context="spawn"),
            num_workers=2,
        )
    assert info.value.env_index == 3
    assert "main module" not in str(info.value) and GUARD not in str(info.value)
    snapshot.assert_nothing_left()


class ProcessNameEnv(gym.Env):
    """Tells the name of the process that built it."""

    observation_space = gym.spaces.Box(-1.0, 1.0, (1,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def __init__(self) -> None:
        self.process_name = multiprocessing.current_process().name

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return np.zeros(1, np.float32), {}

    def step(self, action):
        return np.zeros(1, np.float32), 0.0, False, False, {}


@pytest.mark.timeout(90)
@pytest.mark.parametrize("context", ["spawn", "forkserver"])
def test_a_started_worker_has_its_plain_name(make_env, context):
    """The report path a worker's name carries through its bootstrap is gone once it runs."""
    envs = make_env(
        ProcessNameEnv,
        2,
        backend=envfleet.Processes(context=context),
        num_workers=2,
    )
    assert list(envs.get_attr("process_name")) == ["envfleet-worker-0", "envfleet-worker-1"]
