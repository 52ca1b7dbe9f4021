"""Running a replay again in one process.

:func:`run_replay` builds a :class:`~envfleet._core.replay.Replay`'s envs in this process and
steps them to the failure, in the order their worker stepped them; :func:`watch_replay` runs
it in a child process and reports the call that raised, died or hung (``envfleet replay``).
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import select
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from envfleet._core.env_state import begin
from envfleet._core.errors import describe_exitcode
from envfleet._core.replay import Replay, load_replay

__all__ = [
    "ReplayOutcome",
    "run_replay",
    "watch_replay",
]


Progress = Callable[[int, int, str], None]


def run_replay(
    replay: Replay | str,
    progress: Progress | None = None,
    stop_at: tuple[int, int] | None = None,
) -> int:
    """Build the replay's envs in this process and step them to the failure.

    Each env is built from its factory and reset as its episode began (its seed and options,
    or its ``np_random`` state at its autoreset), then stepped with its recorded actions; the
    envs of one worker go step by step in their worker's order. ``progress(env_index, step,
    method)`` is called before each env call (``step`` counts the episode's actions, 0 for
    its reset). An env whose randomness comes from its seed and ``np_random`` fails here as
    it failed in its worker: the same exception (raised from here), the same segfault, the
    same hang. ``stop_at=(env_index, step)`` enters :mod:`pdb` just before that call.

    Returns:
        The env calls made, when none failed (the failure did not reproduce).

    Raises:
        ReplayFileError: a path that is not a replay file (see
            :func:`~envfleet._core.replay.load_replay`).
        ValueError: an env's record is not whole (``EnvRecording.why``).
        Exception: what an env raised.
    """
    if isinstance(replay, str):
        replay = load_replay(replay)
    for r in replay.envs:
        if not r.complete:
            raise ValueError(f"sub-environment {r.env_index} cannot be replayed: {r.why}")
    envs = {r.env_index: replay.factories[r.env_index]() for r in replay.envs}
    calls = 0
    try:
        longest = max((len(r.actions) for r in replay.envs), default=0)
        for t in range(longest):
            for r in replay.envs:
                k = t - (longest - len(r.actions))
                if k < 0:
                    continue
                env = envs[r.env_index]
                if k == 0:
                    _call(progress, stop_at, r.env_index, 0, "reset")
                    begin(env, r.start)  # type: ignore[arg-type]
                    calls += 1
                _call(progress, stop_at, r.env_index, k + 1, "step")
                env.step(r.actions[k])  # (pdb: `step` goes into the env's step)
                calls += 1
        for r in [r for r in replay.envs if not r.actions]:  # a failure in the reset itself
            _call(progress, stop_at, r.env_index, 0, "reset")
            begin(envs[r.env_index], r.start)  # type: ignore[arg-type]
            calls += 1
    finally:
        for env in envs.values():
            with contextlib.suppress(Exception):  # an env that just failed may fail to close
                env.close()
    return calls


def _call(
    progress: Progress | None,
    stop_at: tuple[int, int] | None,
    env_index: int,
    step: int,
    method: str,
) -> None:
    if progress is not None:
        progress(env_index, step, method)
    if stop_at == (env_index, step):
        import pdb  # noqa: T100  (asked for: envfleet replay --pdb)

        pdb.Pdb().set_trace(sys._getframe(1))


@dataclass
class ReplayOutcome:
    """What :func:`watch_replay` saw when it ran a replay in a child process.

    Attributes:
        how: ``"raised"``, ``"died"``, ``"hung"`` or ``"completed"`` (nothing failed).
        reproduced: whether that is the replay's own failure: ``error`` raised the same
            exception (its type and message), ``crash`` died, ``hang`` hung.
        env_index, step, method: the env call that failed (``step``: its episode's actions
            so far, 0 for its ``reset``); ``None`` when none did.
        detail: ``"ValueError: ..."``, ``"signal SIGSEGV"`` or ``"no answer within 5 s"``.
        calls: the env calls made.
    """

    how: str
    reproduced: bool
    env_index: int | None
    step: int | None
    method: str | None
    detail: str
    calls: int


_KINDS = {"error": "raised", "crash": "died", "hang": "hung"}


def watch_replay(path: str, timeout_s: float | None = None, stderr: Any = None) -> ReplayOutcome:
    """Run the replay at ``path`` in a child Python process and watch it: what it raised,
    the signal it died of, or the call it hung in (no next call within ``timeout_s``
    seconds; default the replay's own step timeout for a hang, else none; the child's
    stacks go to ``stderr`` before it is killed).

    Raises:
        ReplayFileError: ``path`` is not a replay file (checked here before the child runs).
    """
    replay = load_replay(path)
    if timeout_s is None and replay.kind == "hang":
        timeout_s = replay.timeout_s or 10.0
    read, write = os.pipe()
    try:
        child = subprocess.Popen(
            [sys.executable, "-c", _CHILD, path, str(write)],
            pass_fds=(write,),
            stderr=stderr,
        )
    finally:
        os.close(write)
    last: tuple[int, int, str] | None = None
    calls, how, detail, buffer = 0, "", "", b""
    try:
        with os.fdopen(read, "rb", buffering=0) as pipe:
            while not how:
                ready, _, _ = select.select([pipe], [], [], timeout_s)
                if not ready:
                    how, detail = "hung", f"no answer within {timeout_s:g} s"
                    with contextlib.suppress(ProcessLookupError):
                        child.send_signal(signal.SIGUSR1)  # its stacks, to stderr
                        time.sleep(0.5)
                    break
                chunk = pipe.read(65536)
                if not chunk:  # the child is gone
                    break
                buffer += chunk
                while b"\n" in buffer and not how:
                    line, buffer = buffer.split(b"\n", 1)
                    word, _, rest = line.decode("utf-8", "replace").partition(" ")
                    if word == "call":
                        env_index, step, method = rest.split(" ")
                        last, calls = (int(env_index), int(step), method), calls + 1
                    elif word == "raised":
                        how, detail = "raised", rest
                    elif word == "done":
                        how = "completed"
    finally:
        if child.poll() is None and how in ("hung", ""):
            child.kill()
        code = child.wait()
    if not how:
        how, detail = "died", describe_exitcode(code)
    failed: tuple[Any, Any, Any] = (None, None, None) if how == "completed" or not last else last
    # The same failure: for an env error, the same exception (type and message) too.
    same = _KINDS.get(replay.kind) == how and (how != "raised" or detail in replay.failure)
    return ReplayOutcome(how, same, *failed, detail, calls)


def _child(path: str, fd: int) -> int:
    """The child process of :func:`watch_replay`: run the replay, telling each call."""
    faulthandler.enable(sys.stderr, all_threads=True)
    faulthandler.register(signal.SIGUSR1, sys.stderr, all_threads=True)
    out = os.fdopen(fd, "wb", buffering=0)

    def progress(env_index: int, step: int, method: str) -> None:
        out.write(f"call {env_index} {step} {method}\n".encode())

    try:
        calls = run_replay(path, progress)
    except Exception as exc:
        traceback.print_exc()
        text = f"{type(exc).__name__}: {exc}".replace("\n", " ")
        out.write(f"raised {text}\n".encode())
        return 1
    out.write(f"done {calls}\n".encode())
    return 0


_CHILD = (
    "import sys; from envfleet._core.replay_runner import _child; "
    "sys.exit(_child(sys.argv[1], int(sys.argv[2])))"
)
