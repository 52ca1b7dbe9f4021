"""Hang reports (:class:`envfleet.HangWarning`) and the note a Ctrl-C carries.

A call that waits on busy sub-environments past ``hang_report_delay`` seconds warns, and
warns again after twice the delay, four times, ... while it keeps waiting (``step_timeout``,
if any, still decides when to give up). Two watchers, one schedule:

- **Envs elsewhere** (worker processes, threads, Ray actors): the round driver's own wait
  (:class:`envfleet._backends.rounds.RoundDriver`) is capped at the next report time; the
  report names the workers still to reply, with their stacks (the transport's ``stacks``).
- **Envs run in the calling thread** (``serial``, the ``processes`` driver's own block, any
  group a transport runs here): that thread cannot watch itself. The run marks an
  :class:`InlineRun` busy and idle (a counter: no clock read, no allocation), and one daemon
  reporter thread per process (:func:`watch_inline`, started at the first one) looks at
  every registered mark a few times per delay; a run it sees busy for the delay is
  reported with the running thread's stack (:func:`sys._current_frames`), the env found in
  it (:func:`env_in_frames`).

A ``KeyboardInterrupt`` raised while the learner waits on envs carries a note
(:func:`add_note`) naming the busy envs and their stacks (:func:`busy_blocks`), taken at the
interrupt (the round driver then completes the round, :mod:`envfleet._backends.rounds`); in
an env run in the calling thread, the env whose frame the traceback holds.
"""

from __future__ import annotations

import contextlib
import logging
import math
import numbers
import os
import sys
import threading
import time
import types
import warnings
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

from envfleet._core.envgroup import EnvGroup
from envfleet._core.errors import ConfigError, HangWarning
from envfleet._core.stacks import first_at, format_frames

__all__ = [
    "DEFAULT_HANG_REPORT_DELAY",
    "InlineRun",
    "add_note",
    "busy_blocks",
    "check_hang_report_delay",
    "env_in_frames",
    "hang_message",
    "runs_envs_here",
    "warn_at",
    "warn_hang",
    "watch_inline",
]

logger = logging.getLogger("envfleet")

DEFAULT_HANG_REPORT_DELAY = 60.0  # seconds (make()'s hang_report_delay)
_TICKS_PER_DELAY = 8  # the reporter thread's looks at a mark per delay
_MIN_TICK_S = 0.005

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_F = TypeVar("_F", bound=Callable[..., Any])


def check_hang_report_delay(value: Any, name: str = "hang_report_delay") -> float | None:
    """``value`` as seconds (a float), or ``None`` (no reports).

    Raises:
        ConfigError: anything but ``None`` or a finite number of seconds > 0.
    """
    if value is None:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Real)
        or not math.isfinite(float(value))
        or not float(value) > 0
    ):
        raise ConfigError(
            f"{name} must be None (no hang reports) or seconds > 0, got {value!r}; e.g. {name}=60.0"
        )
    return float(value)


# -- what a report says -----------------------------------------------------------------------


def busy_blocks(
    ranges: Sequence[tuple[int, int]],
    workers: Iterable[int],
    stacks: dict[int, str],
    noun: str,
    missing: str = "stack not available",
) -> str:
    """One block per busy worker: its envs, the worker, and its stacks (indented) or why
    there are none (``missing``)."""
    blocks = []
    for w in workers:
        envs = list(range(*ranges[w]))
        text = stacks.get(w)
        if text:
            body = "\n".join("    " + line for line in text.rstrip("\n").splitlines())
            blocks.append(f"  sub-environments {envs} ({noun} {w}), its stacks:\n{body}")
        else:
            blocks.append(f"  sub-environments {envs} ({noun} {w}): {missing}")
    return "\n".join(blocks)


def hang_message(
    what: str,
    waited_s: float,
    next_s: float,
    ranges: Sequence[tuple[int, int]],
    workers: Sequence[int],
    stacks: dict[int, str],
    noun: str,
    missing: str = "stack not available",
) -> str:
    """The text of a :class:`HangWarning`: the call (``what``), how long it has waited,
    each busy worker's envs and stacks, and when the next report comes."""
    envs = [e for w in workers for e in range(*ranges[w])]
    return (
        f"envfleet: {what} has waited {waited_s:.3g} s on {noun}s {list(workers)} "
        f"(sub-environments {envs}){first_at(stacks, workers, noun)}; still waiting, next "
        f"report in {next_s:.3g} s (hang_report_delay; step_timeout kills, this does not):\n"
        + busy_blocks(ranges, workers, stacks, noun, missing)
    )


def warn_hang(message: str, frame: types.FrameType | None) -> None:
    """Warn :class:`HangWarning` ``message``, located at the caller's line that waits: the
    first frame outside envfleet above envfleet's own in ``frame``'s stack (``frame``: its
    innermost); every report is shown (no once-per-location registry), unless filtered."""
    warn_at(HangWarning(message), frame)


def warn_at(warning: Warning, frame: types.FrameType | None) -> None:
    """Warn ``warning`` located at the user's line: the first frame outside envfleet above
    envfleet's own in ``frame``'s stack (``frame``: its innermost); shown every time (no
    once-per-location registry), unless filtered."""
    filename, lineno = "<envfleet>", 0
    inside = False
    while frame is not None:
        name = frame.f_code.co_filename
        if name.startswith(_PACKAGE):
            inside = True
        elif inside or not filename.startswith("<"):
            filename, lineno = name, frame.f_lineno
            if inside:
                break
        frame = frame.f_back
    warnings.warn_explicit(warning, type(warning), filename, lineno)


def add_note(exc: BaseException, note: str) -> None:
    """``exc.add_note(note)``; on Python 3.10, which has no ``add_note``, appended to
    ``exc.__notes__`` (what 3.11's ``add_note`` does)."""
    add = getattr(exc, "add_note", None)
    if add is not None:
        add(note)
        return
    notes = getattr(exc, "__notes__", None)
    if not isinstance(notes, list):
        notes = []
        exc.__notes__ = notes  # type: ignore[attr-defined]
    notes.append(note)


def env_in_frames(frames: Iterable[types.FrameType]) -> tuple[EnvGroup | None, int | None]:
    """The :class:`EnvGroup` and the env (its global index) that ``frames`` (outermost
    first) are running: the innermost group's frame, and below it the frame of a method of
    one of its envs (``None`` where none is found)."""
    group: EnvGroup | None = None
    env_index: int | None = None
    for frame in frames:
        try:
            owner = frame.f_locals.get("self")
        except Exception:  # a frame whose locals cannot be read
            continue
        if isinstance(owner, EnvGroup):
            group, env_index = owner, None
        elif group is not None and env_index is None and owner is not None:
            for j, env in enumerate(group.envs):
                if owner is env:
                    env_index = group.start + j
                    break
    return group, env_index


def traceback_frames(tb: types.TracebackType | None) -> list[types.FrameType]:
    """The frames of traceback ``tb``, outermost first."""
    frames = []
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    return frames


def stack_frames(frame: types.FrameType | None) -> list[types.FrameType]:
    """The frames of a stack whose innermost frame is ``frame``, outermost first."""
    frames = []
    while frame is not None:
        frames.append(frame)
        frame = frame.f_back
    return frames[::-1]


def describe_inline(
    ranges: Sequence[tuple[int, int]], group: EnvGroup | None, env_index: int | None
) -> str:
    """``sub-environment E (worker W, run in this thread)`` for an env run in the calling
    thread, as :func:`env_in_frames` found it."""
    if group is None:
        return "the sub-environments run in the calling thread"
    w = next((w for w, (a, _) in enumerate(ranges) if a == group.start), None)
    where = f"worker {w}, run in the calling thread"
    if env_index is None:
        return f"sub-environments {list(range(group.start, group.stop))} ({where})"
    return f"sub-environment {env_index} ({where})"


# -- envs run in the calling thread: the reporter thread --------------------------------------

# The code of the functions that run envs in the calling thread and mark an InlineRun: the
# reporter finds the running thread by one of their frames whose ``self`` owns the mark.
_RUN_CODES: set[types.CodeType] = set()


def runs_envs_here(fn: _F) -> _F:
    """Mark ``fn`` (a method) as one that runs envs in the calling thread while its
    ``self``'s :class:`InlineRun` is busy: the reporter thread looks for its frame."""
    _RUN_CODES.add(fn.__code__)
    return fn


class InlineRun:
    """The mark of the runs of envs in the calling thread, for one vector env.

    The run adds 1 to :attr:`runs` when it starts and when it ends, modulo 256 (a small int:
    no allocation, no clock read): odd, busy. The reporter thread (:func:`watch_inline`)
    reads it a few times per delay: the same odd value for ``delay`` seconds is one run
    that long.

    Args:
        owner: the object whose methods (:func:`runs_envs_here`) run the envs (their
            ``self``: the round driver); held weakly.
        ranges: ``[start, stop)`` of envs per worker.
        delay: seconds before the first report (then twice that, four times, ...).
    """

    __slots__ = (
        "__weakref__",
        "_gap",
        "_next",
        "_seen",
        "_since",
        "delay",
        "owner",
        "ranges",
        "runs",
    )

    def __init__(self, owner: Any, ranges: Sequence[tuple[int, int]], delay: float):
        self.runs = 0
        self.owner = weakref.ref(owner)
        self.ranges = list(ranges)
        self.delay = delay
        self._seen = -1
        self._since = 0.0
        self._next = 0.0
        self._gap = delay

    def check(self, now: float) -> None:
        """The reporter's look at time ``now``: note a new run, report one past its time."""
        runs = self.runs
        if not runs & 1:
            return
        if runs != self._seen:
            self._seen, self._since, self._gap = runs, now, self.delay
            self._next = now + self.delay
            return
        if now < self._next:
            return
        waited, gap = now - self._since, self._gap * 2
        self._gap, self._next = gap, self._next + gap
        self.report(runs, waited, gap)

    def report(self, runs: int, waited_s: float, next_s: float) -> None:
        """Warn that the run ``runs`` has gone on ``waited_s`` seconds: the env it runs and
        the running thread's stack, found by the run's frame."""
        owner = self.owner()
        if owner is None:
            return
        found = _running_thread(owner)
        if found is None or self.runs != runs:
            return  # it ended meanwhile
        ident, top = found
        frames = stack_frames(top)
        group, env_index = env_in_frames(frames)
        stack = format_frames(top, ident)
        message = (
            f"envfleet: {describe_inline(self.ranges, group, env_index)} has run for "
            f"{waited_s:.3g} s (at least) in this thread; still waiting, next report in "
            f"{next_s:.3g} s (hang_report_delay; no timeout can stop an env run in the "
            f"calling thread). Its stack:\n"
            + "\n".join("    " + line for line in stack.rstrip("\n").splitlines())
        )
        del frames, top
        warn_hang(message, _frame_of(ident))


def _frame_of(ident: int) -> types.FrameType | None:
    return sys._current_frames().get(ident)


def _running_thread(owner: Any) -> tuple[int, types.FrameType] | None:
    """The thread (its id and innermost frame) with a frame of a :func:`runs_envs_here`
    method of ``owner``."""
    me = threading.get_ident()
    for ident, top in sys._current_frames().items():
        if ident == me:
            continue
        frame: types.FrameType | None = top
        while frame is not None:
            if frame.f_code in _RUN_CODES:
                with contextlib.suppress(Exception):
                    if frame.f_locals.get("self") is owner:
                        return ident, top
            frame = frame.f_back
    return None


_marks: weakref.WeakSet[InlineRun] = weakref.WeakSet()
_lock = threading.Lock()
_wake = threading.Event()
_reporter: threading.Thread | None = None
_reporter_pid = 0


def watch_inline(mark: InlineRun) -> None:
    """Have the reporter thread watch ``mark`` (while it lives); start the thread, once per
    process, at the first mark."""
    global _reporter, _reporter_pid
    with _lock:
        _marks.add(mark)
        if _reporter is None or _reporter_pid != os.getpid() or not _reporter.is_alive():
            _reporter_pid = os.getpid()
            _reporter = threading.Thread(target=_serve, name="envfleet-hang-reporter", daemon=True)
            _reporter.start()
    _wake.set()


def _serve() -> None:
    """The reporter thread: look at every mark a few times per its delay; sleep while
    there is none."""
    while True:
        marks = list(_marks)
        if not marks:
            _wake.wait()
            _wake.clear()
            continue
        tick = max(min(m.delay for m in marks) / _TICKS_PER_DELAY, _MIN_TICK_S)
        del marks  # a mark goes with its vector env
        if _wake.wait(tick):
            _wake.clear()
        now = time.monotonic()
        for mark in list(_marks):
            try:
                mark.check(now)
            except Exception:  # a filter that turns the warning into an error, ...
                logger.debug("hang report failed", exc_info=True)
