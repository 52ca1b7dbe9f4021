"""Hang reports and Ctrl-C notes: what a round's wait tells about the envs it waits on.

No wait is silent (:meth:`HangReporter.report_hangs`): a Python wait of the round driver
(:class:`~envfleet._backends.rounds.RoundDriver`) is capped at the next hang report's time, and
past it warns :class:`envfleet.HangWarning` with the stacks of the workers still to reply, then
waits on; the groups run in the calling thread mark an :class:`~envfleet._core.hangs.InlineRun`
that a reporter thread watches. A ``KeyboardInterrupt`` in a wait carries a note naming the busy
envs and their stacks (:meth:`HangReporter._interrupted`), taken at the interrupt, before the
round is completed or closed.

:class:`HangReporter` is a mixin of the round driver: the report and the note, written once for
every wait; when each report is due is the wait's own schedule, and what a Ctrl-C does to the
round (completed, undone, or the vector env closed) the round's (:mod:`envfleet._backends.rounds`).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, cast

from envfleet._backends.transport import Transport
from envfleet._core.hangs import (
    InlineRun,
    add_note,
    busy_blocks,
    describe_inline,
    env_in_frames,
    hang_message,
    traceback_frames,
    warn_hang,
    watch_inline,
)
from envfleet._core.protocol import Command
from envfleet._core.stacks import first_at

__all__ = ["HangReporter"]

logger = logging.getLogger("envfleet")


class HangReporter:
    """The round driver's hang reports and Ctrl-C notes (a mixin: the state it reads is the
    driver's, declared here)."""

    transport: Transport
    ranges: Sequence[tuple[int, int]]
    late_what: str
    _command: Command  # the command the round runs
    _hang_delay: float | None  # the Python waits' report delay (None: none)
    _busy: InlineRun  # the mark of the runs of envs in the calling thread

    if TYPE_CHECKING:

        def stacks(self, workers: list[int]) -> dict[int, str]: ...

    def report_hangs(self, delay: float | None) -> None:
        """Warn :class:`envfleet.HangWarning` when a call waits on busy envs past ``delay``
        seconds, then after twice that, four times, ... (``None``: never). The Python waits
        report the workers still to reply; the envs this transport runs in the calling
        thread are watched by the reporter thread (:func:`envfleet._core.hangs.watch_inline`).
        """
        self._hang_delay = delay
        if delay is not None:
            self._busy.delay = delay
            if any(self.transport.inline(c) for c in Command):
                watch_inline(self._busy)

    def _noun(self) -> str:
        """How a report names one worker: ``"thread"`` (threads) or ``"worker"``."""
        return "thread" if self.late_what == "threads" else "worker"

    def _report_hang(
        self, workers: list[int], waited_s: float, next_s: float, starting: bool
    ) -> None:
        """Warn :class:`envfleet.HangWarning` that ``workers`` have not replied for
        ``waited_s`` seconds, with their stacks (none for workers still starting: a worker
        asked for its stacks before it watches the signal would die of it)."""
        stacks = {} if starting else self.stacks(list(workers))
        missing = (
            "stack not taken while its worker starts"
            if starting
            else "stack not available (the worker did not write it in time, or this backend "
            "takes none here: serial, or a Ray actor whose node's helper is gone)"
        )
        what = "start" if starting else self._command.name.lower()
        message = hang_message(
            what, waited_s, next_s, self.ranges, workers, stacks, self._noun(), missing
        )
        warn_hang(message, sys._getframe(1))

    def _still_busy(self, workers: Sequence[int]) -> list[int]:
        """The workers of ``workers`` that have not replied (nor died): the transport's
        ``busy`` where it has one (it takes nothing: processes, whose waits take a reply's
        token), else each asked with a wait whose deadline has passed (the in-process
        transports and Ray: their waits take nothing a later wait would miss)."""
        probe = getattr(self.transport, "busy", None)
        if probe is not None:
            return cast(list[int], probe(list(workers)))
        busy = []
        for w in workers:
            seen = self.transport.wait([w], 0.0, False)
            if not seen.ready and not seen.dead:
                busy.append(w)
        return busy

    def _interrupted(
        self, exc: BaseException, workers: Sequence[int], what: str | None = None
    ) -> None:
        """Note on ``exc``, a ``KeyboardInterrupt`` (anything else is left as it is), where
        it came: the env run in this thread whose frame its traceback holds, else the busy
        ``workers`` with their stacks, taken now (before the round is completed or closed). Once
        per exception; never raises but a second interrupt."""
        if not isinstance(exc, KeyboardInterrupt) or getattr(exc, "_envfleet_noted", False):
            return
        try:
            exc._envfleet_noted = True  # type: ignore[attr-defined]
            what = what or self._command.name.lower()
            group, env_index = env_in_frames(traceback_frames(exc.__traceback__))
            if group is not None:
                tb = exc.__traceback__
                while tb is not None and tb.tb_next is not None:
                    tb = tb.tb_next
                at = ""
                if tb is not None:
                    code = tb.tb_frame.f_code
                    at = f" at {code.co_filename}:{tb.tb_lineno} in {code.co_name}"
                where = describe_inline(self.ranges, group, env_index)
                add_note(exc, f"envfleet: Ctrl-C interrupted {where}{at}, busy in {what}")
                return
            busy = self._still_busy(workers)
            if not busy:
                return
            noun = self._noun()
            stacks = self.stacks(busy) if what != "start" else {}
            envs = [e for w in busy for e in range(*self.ranges[w])]
            add_note(
                exc,
                f"envfleet: Ctrl-C interrupted the wait on {noun}s {busy} (sub-environments "
                f"{envs}){first_at(stacks, busy, noun)}, busy in {what}; their "
                "stacks, taken at the interrupt:\n" + busy_blocks(self.ranges, busy, stacks, noun),
            )
        except Exception:  # the note is a help: never mask the interrupt
            logger.debug("could not note where the interrupt came", exc_info=True)
