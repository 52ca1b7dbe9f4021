"""What the learner's process was stepping when a fatal signal killed it (processes'
``driver_envs``).

An env the driver steps itself runs in the learner's process: a segfault there (or a bus
error, a floating-point trap, an illegal instruction, an abort) kills the learner, and no
``EnvCrashedError`` can report it. :func:`driver_crash_note` makes that death say what
happened on stderr before the process dies of the signal:

- :mod:`faulthandler` is enabled (every thread, to stderr) unless the user enabled it
  already (then it keeps writing where the user asked): it dumps the Python stack, the
  env's faulting frame innermost, then chains on to the handler installed before it;
- on top of it, where the C module (``_speedups.crash_note``) is built, an async-signal-safe
  handler writes one line, ``envfleet: fatal signal SIGSEGV while the learner's process was
  stepping sub-environment 3 (driver_envs=4)``, with write(2), and then calls the handler
  installed before it (faulthandler's), so the process still dies of the signal.

The env comes from one int64 word of the C module (the crash note): the driver's
:class:`~envfleet._core.envgroup.EnvGroup` writes ``(driver_envs << 32) + env index`` into it
before stepping (or resetting) each of its envs, and -1 once done (one store per env step).
A forked process starts with the note cleared (``pthread_atfork``), and a worker installs
faulthandler's handlers afresh, so a worker never reports the learner's note. Without the C
module there is no line: faulthandler alone still writes the stack.
"""

from __future__ import annotations

import ctypes
import faulthandler
import sys
from typing import Any

from envfleet._core import native

__all__ = ["NOTE_CLEAR", "NOTE_SEVERAL", "driver_crash_note", "note_base"]

NOTE_CLEAR = -1  # the note's value while the learner's process steps no env
NOTE_SEVERAL = -2  # a worker's note while it steps several envs at once (envs that wait)


def note_base(driver_envs: int, start: int) -> int:
    """What a group adds its env's position ``j`` to for the note: the note of env
    ``start + j`` of a driver that steps ``driver_envs`` envs."""
    return (driver_envs << 32) + start


def _enable_faulthandler() -> None:
    """faulthandler on (every thread, to stderr) unless the user enabled it already."""
    if faulthandler.is_enabled():
        return
    for out in (sys.stderr, sys.__stderr__, 2):
        try:
            faulthandler.enable(out, all_threads=True)  # type: ignore[arg-type]
            return
        except (AttributeError, ValueError, OSError, RuntimeError, TypeError):
            continue  # no file descriptor behind this stream (a notebook's): the next one


def driver_crash_note() -> memoryview | None:
    """Prepare this process for a fatal signal in an env it steps itself: faulthandler on
    (see the module's docstring), then the C handler installed over it. Returns the crash
    note to write (an int64 memoryview of one item), or ``None`` without the C module (then
    faulthandler alone writes the stack, without the line naming the env)."""
    _enable_faulthandler()
    install = native.function("crash_note")
    if install is None:
        return None
    address = install()
    word: Any = (ctypes.c_int64 * 1).from_address(address)
    note = memoryview(word).cast("B").cast("q")
    note[0] = NOTE_CLEAR
    return note
