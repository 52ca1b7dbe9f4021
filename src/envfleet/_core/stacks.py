"""Stacks of a hung or crashed worker, as text: finding the cause.

One format for every backend: :mod:`faulthandler`'s, every thread with its Python frames,
innermost first::

    Current thread 0x00007f... (most recent call first):
      File "/path/to/env.py", line 42 in step
      File ".../envfleet/_core/envgroup.py", line 310 in step
      ...

A worker process writes it itself (``faulthandler`` on a signal, and at a fatal signal);
a thread's stack is formatted here from its frame (:func:`format_frames`).
:func:`innermost` names the innermost frame of the thread that ran the env, for a message.
"""

from __future__ import annotations

import re
import types
from collections.abc import Iterable, Mapping

__all__ = ["at", "first_at", "format_frames", "innermost", "runs_env"]

_FRAME = re.compile(r'^\s+File "(?P<file>.*)", line (?P<line>\d+) in (?P<function>.*)$')


def format_frames(frame: types.FrameType | None, ident: int, current: bool = True) -> str:
    """The stack of ``frame`` (a thread's innermost frame) in faulthandler's format: its
    header (``Current thread``, or ``Thread`` when ``current`` is false) and one line per
    frame, innermost first."""
    head = "Current thread" if current else "Thread"
    lines = [f"{head} 0x{ident:016x} (most recent call first):"]
    while frame is not None:
        code = frame.f_code
        lines.append(f'  File "{code.co_filename}", line {frame.f_lineno} in {code.co_name}')
        frame = frame.f_back
    return "\n".join(lines) + "\n"


# The frames of EnvGroup's per-env loop and per-env reset (envgroup.py's ``_step_envs`` and
# ``reset_env``): a thread with one runs an env. A worker that steps its envs all at once
# runs them in its crew's threads (_core/stepping.py) while its main thread, the one a signal
# interrupts, waits for them.
_ENV_FUNCTIONS = ("_step_envs", "reset_env")
_ENV_LOOP = re.compile(
    r'^\s+File ".*envgroup\.py", line \d+ in (?:_step_envs|reset_env)$', re.MULTILINE
)


def runs_env(frame: types.FrameType | None) -> bool:
    """Whether a thread whose innermost frame is ``frame`` is inside an env (its stack holds
    EnvGroup's ``_step_envs`` or ``reset_env``)."""
    while frame is not None:
        code = frame.f_code
        if code.co_name in _ENV_FUNCTIONS and code.co_filename.endswith("envgroup.py"):
            return True
        frame = frame.f_back
    return False


def innermost(stacks: str) -> str | None:
    """``file:line in function`` of the innermost frame of the thread that ran the env: of
    the threads in EnvGroup's per-env loop (``_step_envs``), the ``Current thread`` (the
    thread a signal interrupted, or that faulted) if it is one, else the first; without
    one, the ``Current thread`` block's first frame, else the first frame of the text;
    ``None`` without one.

    Example::

        innermost(err.stacks[1])  # '/path/to/env.py:42 in step'
    """
    blocks = stacks.split("\n\n")
    current = [b for b in blocks if b.lstrip().startswith("Current thread")]
    running = [b for b in blocks if _ENV_LOOP.search(b)]
    chosen = [b for b in current if b in running] or running or current or blocks
    for block in chosen:
        for line in block.splitlines():
            match = _FRAME.match(line)
            if match:
                return f"{match['file']}:{match['line']} in {match['function']}"
    return None


def at(stacks: str) -> str:
    """`` (at file:line in function)`` of ``stacks``' innermost frame (:func:`innermost`),
    for a message; ``""`` without one."""
    frame = innermost(stacks) if stacks else None
    return f" (at {frame})" if frame else ""


def first_at(stacks: Mapping[int, str], workers: Iterable[int], noun: str = "worker") -> str:
    """`` (worker W at file:line in function)`` for the first of ``workers`` whose stacks
    name a frame, for a message; ``""`` when none does."""
    for w in workers:
        frame = innermost(stacks[w]) if w in stacks else None
        if frame:
            return f" ({noun} {w} at {frame})"
    return ""
