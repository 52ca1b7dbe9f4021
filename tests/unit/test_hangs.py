"""envfleet._core.hangs: the delay's check, the report schedule of a run in the calling
thread (with the reporter's clock given, no sleeps), the message, and the note on 3.10."""

from __future__ import annotations

from typing import Any

import pytest

import envfleet
from envfleet._core.hangs import (
    InlineRun,
    add_note,
    busy_blocks,
    check_hang_report_delay,
    hang_message,
)


class _Owner:
    pass


class _Recorded(InlineRun):
    __slots__ = ("reports",)

    def report(self, runs: int, waited_s: float, next_s: float) -> None:
        self.reports.append((runs, round(waited_s, 6), round(next_s, 6)))


def _mark(delay: float) -> Any:
    owner = _Owner()
    mark = _Recorded(owner, [(0, 1), (1, 2)], delay)
    mark.reports = []
    return mark, owner


def test_delay_is_checked() -> None:
    assert check_hang_report_delay(None) is None
    assert check_hang_report_delay(2) == 2.0
    for bad in (0, -0.5, float("nan"), float("inf"), "1", True):
        with pytest.raises(envfleet.ConfigError, match="hang_report_delay"):
            check_hang_report_delay(bad)


def test_a_run_is_reported_after_the_delay_then_at_doubling_intervals() -> None:
    mark, _owner = _mark(1.0)
    mark.runs = 1  # busy
    for now in (10.0, 10.5, 10.99):
        mark.check(now)
    assert mark.reports == []
    mark.check(11.0)  # 1 s after it was first seen
    mark.check(12.9)
    mark.check(13.0)  # 2 s later
    mark.check(16.9)
    mark.check(17.0)  # 4 s later
    assert mark.reports == [(1, 1.0, 2.0), (1, 3.0, 4.0), (1, 7.0, 8.0)]


def test_an_idle_mark_or_a_new_run_starts_over() -> None:
    mark, _owner = _mark(1.0)
    mark.runs = 1
    mark.check(0.0)
    mark.runs = 2  # idle: never reported
    mark.check(5.0)
    mark.runs = 3  # a new run: its own delay, from when it is seen
    mark.check(6.0)
    mark.check(6.5)
    assert mark.reports == []
    mark.check(7.0)
    assert mark.reports == [(3, 1.0, 2.0)]


def test_a_wrapped_counter_is_still_one_run() -> None:
    mark, _owner = _mark(1.0)
    runs = 0
    for _ in range(1000):
        runs = (runs + 1) & 255
    assert 0 <= runs <= 255
    mark.runs = 255  # odd: busy
    mark.check(0.0)
    mark.check(1.0)
    assert mark.reports == [(255, 1.0, 2.0)]


def test_message_names_envs_workers_and_stacks() -> None:
    stacks = {1: 'Current thread 0x1 (most recent call first):\n  File "e.py", line 3 in spin\n'}
    text = hang_message("step", 0.3, 0.6, [(0, 2), (2, 3)], [0, 1], stacks, "worker")
    assert text.startswith("envfleet: step has waited 0.3 s on workers [0, 1]")
    assert "(sub-environments [0, 1, 2])" in text
    assert "(worker 1 at e.py:3 in spin)" in text
    assert "sub-environments [0, 1] (worker 0): stack not available" in text
    assert '    File "e.py", line 3 in spin' in busy_blocks([(0, 2), (2, 3)], [1], stacks, "worker")


def test_note_falls_back_to_dunder_notes_without_add_note() -> None:
    class Old(KeyboardInterrupt):
        add_note = None  # as on Python 3.10

    exc = Old()
    add_note(exc, "first")
    add_note(exc, "second")
    assert exc.__notes__ == ["first", "second"]
    modern = KeyboardInterrupt()
    add_note(modern, "note")
    assert modern.__notes__ == ["note"]
