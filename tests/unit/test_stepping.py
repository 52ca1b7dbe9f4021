"""envfleet._core.stepping (issue 50): the crew that steps a worker's envs at once, the choice
between one after another and at once, and the stacks that name the env's thread. Real
threads; an order forced by a barrier or a semaphore, never hoped for from a sleep."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest

from envfleet._core.errors import ConfigError
from envfleet._core.stacks import innermost
from envfleet._core.stats import STEPPING_WORDS
from envfleet._core.stepping import (
    DECIDE_AFTER,
    FIRST_SAMPLES,
    MIN_WAIT_S,
    PROBE_EVERY,
    PROBE_EVERY_MAX,
    SAMPLE_EVERY,
    SAMPLE_EVERY_MAX,
    AdaptiveStepping,
    Crew,
    stepping_mode,
)


def test_a_crew_runs_each_member_on_its_own_named_thread() -> None:
    crew = Crew(4)
    try:
        seen: dict[int, str] = {}
        for _ in range(3):  # the same threads every round
            crew.run(lambda t: seen.__setitem__(t, threading.current_thread().name))
            assert seen[0] == threading.current_thread().name
            assert [seen[t] for t in (1, 2, 3)] == [
                "envfleet-env-1",
                "envfleet-env-2",
                "envfleet-env-3",
            ]
    finally:
        crew.close()
    for thread in crew.threads:
        thread.join(5)
        assert not thread.is_alive()


def test_a_crews_members_run_at_once() -> None:
    """Every member is inside the task at the same time (a barrier of four: members run one
    after another would break it), and run() returns once all have left it."""
    crew = Crew(4)
    barrier = threading.Barrier(4, timeout=10)
    left: list[int] = []

    def task(t: int) -> None:
        barrier.wait()
        left.append(t)

    try:
        crew.run(task)
    finally:
        crew.close()
    assert sorted(left) == [0, 1, 2, 3]


def test_a_members_exception_reaches_the_caller_after_every_member_is_done() -> None:
    crew = Crew(3)
    done: list[int] = []

    def task(t: int) -> None:
        if t == 1:
            raise SystemExit(3)
        done.append(t)

    try:
        with pytest.raises(SystemExit):
            crew.run(task)
        assert sorted(done) == [0, 2]
        crew.run(lambda t: done.append(10 + t))  # the crew still works
        assert sorted(done)[2:] == [10, 11, 12]
    finally:
        crew.close()


def _words() -> np.ndarray:
    return np.zeros(STEPPING_WORDS)


def _teach(stepping: AdaptiveStepping, cpu_s: float, wall_s: float, blocks: int, n: int) -> None:
    for _ in range(n):
        stepping._learn(cpu_s * stepping.size, wall_s * stepping.size, blocks, stepping.size)


def test_envs_that_wait_are_stepped_at_once_and_published() -> None:
    words = _words()
    stepping = AdaptiveStepping(4, words)
    assert (stepping.kind, stepping.concurrent, words[0]) == ("unknown", False, 0.0)
    _teach(stepping, 20e-6, 5e-3, 4, DECIDE_AFTER)  # 5 ms a step, 20 us of CPU, blocking
    assert (stepping.kind, stepping.concurrent) == ("wait", True)
    assert words[0] == 2.0 and words[2] == 1.0 and 0 < words[1] < 0.01


def test_envs_that_compute_stay_one_after_another() -> None:
    stepping = AdaptiveStepping(4, _words())
    _teach(stepping, 50e-6, 52e-6, 0, 10)
    assert (stepping.kind, stepping.concurrent) == ("compute", False)


def test_a_preempted_thread_that_never_blocks_is_not_taken_for_a_waiting_one() -> None:
    """CPU-bound envs on a busy machine: the wall time runs far past the CPU time (the thread
    waited for a core), but the thread never blocked: they compute."""
    stepping = AdaptiveStepping(4, _words())
    _teach(stepping, 50e-6, 3e-3, 0, 10)
    assert (stepping.kind, stepping.concurrent) == ("compute", False)


def test_waits_too_short_for_a_hand_off_stay_one_after_another() -> None:
    stepping = AdaptiveStepping(4, _words())
    _teach(stepping, 5e-6, 5e-6 + MIN_WAIT_S / 4, 4, 10)
    assert not stepping.concurrent


def test_concurrent_envs_that_start_computing_go_back() -> None:
    stepping = AdaptiveStepping(4, _words())
    _teach(stepping, 20e-6, 5e-3, 4, DECIDE_AFTER)
    assert stepping.concurrent
    _teach(stepping, 2e-3, 2.1e-3, 0, 20)
    assert (stepping.kind, stepping.concurrent) == ("compute", False)


def test_forced_modes_and_a_block_of_one() -> None:
    assert AdaptiveStepping(4, None, "concurrent").concurrent
    sequential = AdaptiveStepping(4, None, "sequential")
    _teach(sequential, 20e-6, 5e-3, 4, 10)
    assert sequential.kind == "wait" and not sequential.concurrent
    alone = AdaptiveStepping(1, None)
    _teach(alone, 20e-6, 5e-3, 1, 10)
    assert alone.kind == "wait" and not alone.concurrent
    with pytest.raises(ConfigError):
        AdaptiveStepping(4, None, "sometimes")


def test_stepping_mode_reads_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ENVFLEET_STEPPING", raising=False)
    assert stepping_mode() == "auto"
    monkeypatch.setenv("ENVFLEET_STEPPING", " Sequential ")
    assert stepping_mode() == "sequential"
    monkeypatch.setenv("ENVFLEET_STEPPING", "fast")
    with pytest.raises(ConfigError, match="ENVFLEET_STEPPING"):
        stepping_mode()


def test_a_concurrent_round_keeps_env_order_and_counts_itself() -> None:
    """The envs of a round at once finish in any order (env 1 after env 2 here, env 0 first:
    on the first rounds one env steps alone, timed); their events and failures come back in
    env order, and the round is counted in the published words."""
    words = _words()
    stepping = AdaptiveStepping(3, words, "concurrent")
    finished: list[int] = []
    two_done = threading.Semaphore(0)

    def step_envs(pairs: Any, resets: bool, events: list[Any], log: Any) -> list[Any] | None:
        [(j, action)] = list(pairs)
        if j == 1:  # finishes after env 2, which runs meanwhile
            assert two_done.acquire(timeout=10)
        finished.append(j)
        if j == 2:
            two_done.release()
        events.append((j, {"action": action}))
        return [f"failure {j}"] if j != 1 else None

    events: list[Any] = []
    try:
        failures, quiet = stepping.step(step_envs, iter([10, 11, 12]), False, events, None)
    finally:
        stepping.close()
    assert finished == [0, 2, 1] and stepping.samples == 1
    assert events == [(0, {"action": 10}), (1, {"action": 11}), (2, {"action": 12})]
    assert failures == ["failure 0", "failure 2"] and quiet == 0
    assert words[3] == 1.0


FAULTHANDLER_TEXT = """\
Thread 0x00007f0000000002 (most recent call first):
  File "/sim/env.py", line 42 in step
  File "/x/envfleet/_core/envgroup.py", line 460 in _step_envs
  File "/x/envfleet/_core/stepping.py", line 330 in member
  File "/x/envfleet/_core/stepping.py", line 170 in _serve

Thread 0x00007f0000000003 (most recent call first):
  File "/x/envfleet/_core/stepping.py", line 165 in _serve

Current thread 0x00007f0000000001 (most recent call first):
  File "/x/envfleet/_core/stepping.py", line 150 in run
  File "/x/envfleet/_core/envgroup.py", line 410 in step
"""


def test_innermost_names_the_thread_that_runs_an_env() -> None:
    """A worker stepping its envs at once: the signal finds its main thread waiting for the
    crew; the frame named is the env's, in the crew thread inside EnvGroup's per-env loop."""
    assert innermost(FAULTHANDLER_TEXT) == "/sim/env.py:42 in step"
    plain = FAULTHANDLER_TEXT.split("\n\n")[2]  # no thread in the loop: the current one
    assert innermost(plain) == "/x/envfleet/_core/stepping.py:150 in run"


def test_a_worker_of_envs_that_compute_times_ever_fewer_rounds() -> None:
    """One after another, every round is timed at first (the first one twice: env 0 alone,
    then the others), then one in 16, 32, ... up to one in SAMPLE_EVERY_MAX while the envs
    keep computing; the caller steps the others untimed."""
    stepping = AdaptiveStepping(2, None)
    quiet_runs = []

    def step_envs(pairs: Any, resets: bool, events: list[Any], log: Any) -> list[Any] | None:
        for _ in pairs:
            sum(range(2000))  # CPU only
        return None

    for _ in range(FIRST_SAMPLES + 7):
        _, quiet = stepping.step(step_envs, iter([0, 0]), False, [], None)
        quiet_runs.append(quiet)
    assert stepping.kind == "compute" and not stepping.concurrent
    assert quiet_runs[: FIRST_SAMPLES - 2] == [0] * (FIRST_SAMPLES - 2)
    assert quiet_runs[FIRST_SAMPLES - 2 :] == [
        min(SAMPLE_EVERY << k, SAMPLE_EVERY_MAX) - 1 for k in range(9)
    ]


def _threads_of_each_env(stepping: AdaptiveStepping, work: Any, size: int) -> list[str]:
    """One round of ``stepping``: the name of the thread each env stepped on."""
    names = [""] * size

    def step_envs(pairs: Any, resets: bool, events: list[Any], log: Any) -> list[Any] | None:
        for j, _ in pairs:
            names[j] = threading.current_thread().name
            work()
        return None

    stepping.step(step_envs, iter([0] * size), False, [], None)
    return names


def test_envs_that_wait_are_stepped_at_once_from_the_first_round() -> None:
    """Learned within the first round: env 0 steps alone on the worker's thread, is seen to
    wait (a 5 ms sleep), and the other 99 step at once on the crew, each on its own thread,
    in that same round; no round of one after another first."""
    stepping = AdaptiveStepping(100, _words())
    event = threading.Event()
    try:
        names = _threads_of_each_env(stepping, lambda: event.wait(0.005), 100)
        assert names[0] == threading.current_thread().name
        assert names[1:] == [f"envfleet-env-{j}" for j in range(1, 100)]
        assert stepping.concurrent
    finally:
        stepping.close()


def test_envs_that_compute_stay_on_the_workers_thread_from_the_first_round() -> None:
    stepping = AdaptiveStepping(8, _words())
    try:
        for _ in range(3):
            names = _threads_of_each_env(stepping, lambda: sum(range(5000)), 8)
            assert names == [threading.current_thread().name] * 8
        assert stepping.crew is None  # no thread was ever started
    finally:
        stepping.close()


def test_a_crew_of_hundreds_runs_them_all_at_once_round_after_round() -> None:
    """Members wake one another in a chain: all 300 are inside the task at once (a barrier of
    300), for several rounds, and close() ends every thread."""
    crew = Crew(300)
    barrier = threading.Barrier(300, timeout=30)
    try:
        for _ in range(3):
            crew.run(lambda t: barrier.wait())
    finally:
        crew.close()
    for thread in crew.threads:
        thread.join(10)
        assert not thread.is_alive()


def test_run_each_resets_envs_that_wait_at_once_and_others_in_turn() -> None:
    """A block's reset before any step: env 0 alone, timed; the others on the crew if it
    waited (env j on member j), on the worker's thread if it computed."""
    for work, crew_used in ((lambda: threading.Event().wait(0.003), True), (lambda: None, False)):
        stepping = AdaptiveStepping(6, _words())
        names = [""] * 6

        def task(j: int, log: Any, names: list[str] = names, work: Any = work) -> None:
            names[j] = threading.current_thread().name
            work()

        try:
            stepping.run_each(task, [0, 2, 3, 5], None)
        finally:
            stepping.close()
        me = threading.current_thread().name
        if crew_used:
            assert names == [me, "", "envfleet-env-2", "envfleet-env-3", "", "envfleet-env-5"]
        else:
            assert names == [me, "", me, me, "", me]


def test_probes_grow_rarer_while_the_envs_keep_waiting() -> None:
    """While concurrent, one env steps alone, timed (a sample), 64 rounds after the block
    went concurrent (its first), then 64 later, 128 later, 256 later... up to one in
    PROBE_EVERY_MAX: each probe's wait is a round's."""
    stepping = AdaptiveStepping(2, _words(), "auto")
    probes: list[int] = []

    def step_envs(pairs: Any, resets: bool, events: list[Any], log: Any) -> list[Any] | None:
        for _ in pairs:
            threading.Event().wait(0.0005)
        return None

    try:
        for _ in range(1 + 64 + 64 + 128 + 2):
            before = stepping.samples
            stepping.step(step_envs, iter([0, 0]), False, [], None)
            if stepping.samples > before:
                probes.append(stepping.rounds)
    finally:
        stepping.close()
    assert stepping.concurrent
    assert [r for r in probes if r > DECIDE_AFTER] == [65, 65 + 64, 65 + 64 + 128], probes
    assert PROBE_EVERY == 64 and PROBE_EVERY_MAX == 1024
