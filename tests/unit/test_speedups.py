"""The optional C step path (envfleet._core._speedups) against its Python twins and SyncVectorEnv.

Most tests run twice through the ``step_path`` fixture: with the C functions, and with them
turned off. Both must give SyncVectorEnv's results bit for bit, and the same errors, for the
values and forms where the C code takes over (plain floats and bools, contiguous observations
of the buffer's dtype) and for those it hands back to numpy and Python. The last ones read the
C module's call counters: on every backend that has a C path, a real vector env must go
through it (nothing else notices when a fast path silently stops running).
"""

from __future__ import annotations

import functools
import importlib
import os
import subprocess
import sys
import textwrap
import time
from typing import Any

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.vector import AutoresetMode, SyncVectorEnv

import envfleet
import envfleet._core.native
from envfleet._core.protocol import Command
from tests.envs import RaisingEnv, SideActionEnv, SparseInfoEnv, ValuesEnv, sync_factories
from tests.helpers import assert_same

NUM_ENVS = 3


def test_speedups_are_built():
    """The install builds the C extension wherever a C compiler is (CI, this machine): a
    silent fallback to Python would leave the C path untested."""
    if os.environ.get("ENVFLEET_NO_SPEEDUPS", "").strip() not in ("", "0"):
        pytest.skip("ENVFLEET_NO_SPEEDUPS is set")
    assert envfleet._core.native.speedups is not None


def lockstep(fleet: Any, sync: SyncVectorEnv, steps: int = 6) -> None:
    assert_same(fleet.reset(seed=5), sync.reset(seed=5), "reset")
    for t in range(steps):
        actions = np.array([(t + i) % 2 for i in range(sync.num_envs)])
        assert_same(fleet.step(actions), sync.step(actions), f"step {t}")


REWARDS = [
    1.5,
    -3,
    True,
    np.float64(0.1),
    np.float32(0.1),
    np.int64(7),
    np.float16(0.5),
    2**70,
    np.array(1.25),
    None,  # numpy writes NaN
]
FLAGS = [True, False, np.bool_(True), np.bool_(False), 1, 0.0, np.int8(2), np.array(True)]


@pytest.mark.parametrize("reward", REWARDS, ids=repr)
def test_rewards_convert_as_numpy_does(make_env, step_path, reward):
    factory = functools.partial(ValuesEnv, reward=reward)
    fleet = make_env(factory, NUM_ENVS, backend="serial")
    lockstep(fleet, SyncVectorEnv(sync_factories(factory, NUM_ENVS)))


@pytest.mark.parametrize("flag", FLAGS, ids=repr)
@pytest.mark.parametrize("which", ["terminated", "truncated"])
def test_done_flags_convert_as_numpy_does(make_env, step_path, flag, which):
    factory = functools.partial(ValuesEnv, **{which: flag})
    fleet = make_env(factory, NUM_ENVS, backend="serial")
    lockstep(fleet, SyncVectorEnv(sync_factories(factory, NUM_ENVS)))


def first_step_errors(make_env: Any, factory: Any) -> tuple[BaseException, envfleet.EnvError]:
    """What SyncVectorEnv's first step raises, and the EnvError envfleet's raises."""
    sync = SyncVectorEnv(sync_factories(factory, NUM_ENVS))
    fleet = make_env(factory, NUM_ENVS, backend="serial")
    sync.reset(seed=0)
    fleet.reset(seed=0)
    actions = np.zeros(NUM_ENVS, dtype=np.int64)
    with pytest.raises(Exception) as want:
        sync.step(actions)
    with pytest.raises(envfleet.EnvError) as got:
        fleet.step(actions)
    assert got.value.env_index == 0
    return want.value, got.value


@pytest.mark.parametrize("reward", ["abc", object()], ids=["str", "object"])
def test_a_reward_numpy_refuses_is_an_env_error(make_env, step_path, reward):
    want, got = first_step_errors(make_env, functools.partial(ValuesEnv, reward=reward))
    assert isinstance(want, (TypeError, ValueError))
    assert "step (result)" in str(got)
    assert type(got.__cause__) is type(want)


@pytest.mark.parametrize("result", ["list", "namedtuple", "generator"])
@pytest.mark.parametrize("terminated", [False, True], ids=["stepping", "autoresetting"])
def test_step_results_in_other_containers_unpack(make_env, step_path, result, terminated):
    """Step and reset results in other containers unpack as in Python; with every episode
    ending, every other step is NEXT_STEP's autoreset (the reset result, reward 0)."""
    factory = functools.partial(ValuesEnv, result=result, terminated=terminated)
    fleet = make_env(factory, NUM_ENVS, backend="serial")
    lockstep(fleet, SyncVectorEnv(sync_factories(factory, NUM_ENVS)))


@pytest.mark.parametrize("result", ["short", "long"])
def test_step_results_of_the_wrong_length_fail_as_in_python(make_env, step_path, result):
    """Python's unpacking error, with its message, is the env's error."""
    want, got = first_step_errors(make_env, functools.partial(ValuesEnv, result=result))
    assert type(want) is ValueError
    assert type(got.__cause__) is ValueError
    assert str(got.__cause__) == str(want)


class _Interrupting(ValuesEnv):
    def step(self, action: Any):
        if self.env_index == 1:
            raise KeyboardInterrupt
        return super().step(action)


class _BadInfo(dict):
    def __bool__(self) -> bool:
        raise RuntimeError("no truth value")


def test_keyboard_interrupt_in_an_env_propagates(make_env, step_path):
    """Only Exceptions become env errors; KeyboardInterrupt leaves the step, as it leaves
    SyncVectorEnv's."""
    fleet = make_env(_Interrupting, NUM_ENVS, backend="serial")
    fleet.reset(seed=0)
    with pytest.raises(KeyboardInterrupt):
        fleet.step(np.zeros(NUM_ENVS, dtype=np.int64))


def test_an_info_without_truth_value_raises_in_both_paths(make_env, step_path):
    """EnvGroup asks each info's truth value (to pass on only non-empty ones); an info that
    has none raises that error, not an env error, in the C loop as in the Python one."""
    factory = functools.partial(ValuesEnv, info=_BadInfo(x=1))
    fleet = make_env(factory, NUM_ENVS, backend="serial")
    fleet.reset(seed=0)
    with pytest.raises(RuntimeError, match="no truth value"):
        fleet.step(np.zeros(NUM_ENVS, dtype=np.int64))


# -- the processes worker's loop -----------------------------------------------------------


@pytest.mark.parametrize("driver_envs", [0, 2], ids=["isolated", "driver-share"])
@pytest.mark.parametrize("spin_s", [None, 0.0], ids=["spinning", "blocking"])
def test_worker_loop_matches_sync_vector_env(make_env, step_path, spin_s, driver_envs):
    """Workers that catch their requests spinning step in the C loop; with spin_s=0 every
    request is taken by a blocking wait and dispatched in Python, and the driver's C round
    leaves every wait to Python too. Infos (every other step here), autoresets and resets
    between steps reply through Python in both cases."""
    env = SparseInfoEnv
    sync = SyncVectorEnv(sync_factories(env, 4), autoreset_mode=AutoresetMode.NEXT_STEP)
    layout = {"num_workers": 2} if driver_envs == 0 else {"num_workers": 1}
    fleet = make_env(
        env, 4, backend=envfleet.Processes(driver_envs=driver_envs, spin_s=spin_s), **layout
    )
    assert_same(fleet.reset(seed=1), sync.reset(seed=1))
    space = gym.vector.utils.batch_space(sync.single_action_space, 4)
    space.seed(2)
    for t in range(120):
        actions = space.sample()
        assert_same(fleet.step(actions), sync.step(actions), f"step {t}")
        if t % 40 == 39:
            mask = np.array([True, False, False, True])
            assert_same(
                fleet.reset(seed=t, options={"reset_mask": mask}),
                sync.reset(seed=t, options={"reset_mask": mask}),
            )
            assert fleet.get_attr("env_index") == (0, 1, 2, 3)
    # Every step was timed, whichever loop ran it (the driver's block counts as a worker).
    assert [w.count for w in fleet.stats.workers] == [120, 120]


@pytest.mark.parametrize("fail_index", [0, 3], ids=["driver-env", "worker-env"])
@pytest.mark.parametrize("driver_envs", [0, 2], ids=["isolated", "driver-share"])
def test_step_rounds_report_env_errors_and_go_on(make_env, step_path, driver_envs, fail_index):
    """An env error in the driver's own block or in a worker's, in the C round or the Python
    one, is the step's EnvError; the vector env stays usable."""
    factory = functools.partial(RaisingEnv, fail_index=fail_index, fail_after=3)
    layout = {"num_workers": 2} if driver_envs == 0 else {"num_workers": 1}
    fleet = make_env(factory, 4, backend=envfleet.Processes(driver_envs=driver_envs), **layout)
    fleet.reset(seed=0)
    actions = np.zeros(4, dtype=np.int64)
    for _ in range(3):
        fleet.step(actions)
    with pytest.raises(envfleet.EnvError) as info:
        fleet.step(actions)
    assert info.value.env_index == fail_index
    assert f"boom in step 4 of env {fail_index}" in str(info.value.__cause__)
    # The vector env stays usable: reset the failed env, and step on.
    fleet.reset(seed=1)
    _, rewards, *_ = fleet.step(np.ones(4, dtype=np.int64))
    np.testing.assert_array_equal(rewards, [2.0, 2.0, 2.0, 2.0])


def test_without_speedups_in_spawned_workers():
    """ENVFLEET_NO_SPEEDUPS=1 turns the C path off in the driver and in spawned workers, and
    envfleet still runs (as it does where the extension could not be built)."""
    script = textwrap.dedent(
        """
        import importlib, numpy as np, envfleet, envfleet._core.native
        assert envfleet._core.native.speedups is None
        backend = envfleet.Processes(context="spawn", driver_envs=0)
        envs = envfleet.make("CartPole-v1", 4, backend=backend, num_workers=2)
        envs.reset(seed=0)
        for _ in range(20):
            envs.step(np.zeros(4, dtype=np.int64))
        flags = envs.apply(lambda env: importlib.import_module("envfleet._core.native").speedups)
        assert flags == (None,) * 4, flags
        envs.close()
        print("ok")
        """
    )
    env = {**os.environ, "ENVFLEET_NO_SPEEDUPS": "1"}
    out = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


# -- the C path runs: its counters advance ---------------------------------------------------

COUNTED_STEPS = 20
# counters() also counts the futex system calls the C code issued (not functions).
SYSCALL_COUNTERS = {"futex_wake", "futex_wait"}


def c_counters() -> dict[str, int]:
    """Calls of each C function in this process."""
    module = envfleet._core.native.speedups
    assert module is not None
    calls: dict[str, int] = module.counters()
    return calls


def _worker_counters(env: Any) -> tuple[int, dict[str, int]]:
    return os.getpid(), importlib.import_module("envfleet._core.native").speedups.counters()


def worker_counters(fleet: Any) -> dict[int, dict[str, int]]:
    """Each worker process's C counters, by pid (envs in the driver left out)."""
    return {pid: calls for pid, calls in fleet.apply(_worker_counters) if pid != os.getpid()}


def step_cartpole(fleet: Any) -> None:
    fleet.reset(seed=0)
    for t in range(COUNTED_STEPS):
        fleet.step(np.full(fleet.num_envs, t % 2, dtype=np.int64))


def test_processes_runs_the_c_round_and_worker_loop(make_env):
    """CartPole-v1 x16 on processes with default settings: every step goes through the
    driver's C step round, and each worker enters its C loop of plain steps."""
    if envfleet._core.native.speedups is None:
        pytest.skip("envfleet._core._speedups is not built here")
    fleet = make_env("CartPole-v1", 16, backend="processes")
    fleet.reset(seed=0)
    driver, workers = c_counters(), worker_counters(fleet)
    assert workers, "no env runs in a worker process"
    step_cartpole(fleet)
    driver_after, workers_after = c_counters(), worker_counters(fleet)
    assert driver_after["full_round"] - driver["full_round"] == COUNTED_STEPS
    for pid, calls in workers_after.items():
        assert calls["serve_steps"] > workers[pid]["serve_steps"], f"worker {pid}"
        for name in ("write_results", "write_rows"):
            assert calls[name] - workers[pid][name] >= COUNTED_STEPS, f"worker {pid}: {name}"


def test_a_round_with_per_leaf_actions_is_not_the_c_rounds(make_env):
    """``round(STEP, payloads)`` whose payloads carry per-leaf actions (a Text action space:
    the actions travel with the command, not in the shared buffers) takes the Python round,
    whoever calls it: the C round reads only the buffers and would drop them. The backend's
    round is called directly, as any caller may; its results are SyncVectorEnv's."""
    if envfleet._core.native.speedups is None:
        pytest.skip("envfleet._core._speedups is not built here")
    factory = functools.partial(SideActionEnv, "text")
    fleet = make_env(factory, 4, backend="processes", num_workers=2)
    sync = SyncVectorEnv(sync_factories(factory, 4))
    assert fleet._backend._full_round is not None  # the C round is there to be taken
    fleet.reset(seed=3)
    sync.reset(seed=3)
    words = ("a", "bb", "ccc", "dddd")
    for t in range(6):
        actions = tuple(words[(t + i) % 4] for i in range(4))
        fleet._prepare_step(actions, "step")
        payloads = fleet._step_payloads
        assert all(p is not None for p in payloads.values())
        results = fleet._backend.round(Command.STEP, payloads, None, fleet._steps)
        got = fleet._step_outputs(results)
        want = sync.step(actions)
        for g, w in zip(got[:4], want[:4], strict=True):
            np.testing.assert_array_equal(g, w)
    sync.close()


def test_step_wait_finishes_the_step_in_the_c_round(make_env):
    """With the driver's share (driver_envs): step_async rings the workers; step_wait runs
    the driver's own block and spins on the replies in the C step round (without ringing
    again), as step() does: its counter advances once a step, and the results are step()'s."""
    if envfleet._core.native.speedups is None:
        pytest.skip("envfleet._core._speedups is not built here")
    layout = {"backend": envfleet.Processes(driver_envs=8), "num_workers": 1}
    fleet = make_env("CartPole-v1", 16, **layout)
    ref = make_env("CartPole-v1", 16, **layout)
    fleet.reset(seed=0)
    ref.reset(seed=0)
    before = c_counters()["full_round"]
    for t in range(COUNTED_STEPS):
        actions = np.full(16, t % 2, dtype=np.int64)
        fleet.step_async(actions)
        got = fleet.step_wait()
        want = ref.step(actions)
        for a, b in zip(got[:4], want[:4], strict=True):
            np.testing.assert_array_equal(a, b)
    # ref's steps count too: both paths take the round once a step.
    assert c_counters()["full_round"] - before == 2 * COUNTED_STEPS


def test_step_wait_of_per_leaf_actions_is_not_the_c_rounds(make_env):
    """step_async/step_wait with per-leaf actions (a Text action space) and the driver's
    share: the driver's own block's payload carries its actions, so step_wait finishes the
    step the Python way (the C round would drop them); the results are SyncVectorEnv's."""
    if envfleet._core.native.speedups is None:
        pytest.skip("envfleet._core._speedups is not built here")
    factory = functools.partial(SideActionEnv, "text")
    layout = {"backend": envfleet.Processes(driver_envs=2), "num_workers": 1}
    fleet = make_env(factory, 4, **layout)
    sync = SyncVectorEnv(sync_factories(factory, 4))
    assert fleet._backend._full_round is not None  # the C round is there to be taken
    fleet.reset(seed=5)
    sync.reset(seed=5)
    words = ("a", "bb", "ccc", "dddd")
    before = c_counters()["full_round"]
    for t in range(6):
        actions = tuple(words[(t + i) % 4] for i in range(4))
        fleet.step_async(actions)
        got = fleet.step_wait()
        want = sync.step(actions)
        for g, w in zip(got[:4], want[:4], strict=True):
            np.testing.assert_array_equal(g, w)
    assert c_counters()["full_round"] == before
    sync.close()


@pytest.mark.parametrize("context", ["spawn", "forkserver"])
def test_spawned_workers_run_the_c_writes(make_env, context):
    """Workers that unpickle the spaces (spawn, forkserver; also the default once a library
    such as torchrl sets the start method) write their rows in C too: their buffer's dtype
    is an equal but distinct object, and the step path compares dtypes by identity."""
    if envfleet._core.native.speedups is None:
        pytest.skip("envfleet._core._speedups is not built here")
    fleet = make_env(
        "CartPole-v1",
        4,
        backend=envfleet.Processes(context=context),
        num_workers=2,
    )
    fleet.reset(seed=0)
    workers = worker_counters(fleet)
    step_cartpole(fleet)
    for pid, calls in worker_counters(fleet).items():
        for name in ("write_results", "write_rows"):
            assert calls[name] - workers[pid][name] >= COUNTED_STEPS, f"worker {pid}: {name}"


@pytest.mark.parametrize("backend", ["serial", "threads"])
def test_in_process_backends_run_the_c_writes(make_env, backend):
    """CartPole-v1 x16 on serial and threads: each group's step writes its results and its
    observation rows in C, and is timed in C (each worker's stats row counts every step)."""
    if envfleet._core.native.speedups is None:
        pytest.skip("envfleet._core._speedups is not built here")
    fleet = make_env("CartPole-v1", 16, backend=backend)
    before = c_counters()
    step_cartpole(fleet)
    after = c_counters()
    for name in ("write_results", "write_rows", "timed_call"):
        assert after[name] - before[name] >= COUNTED_STEPS, name
    assert all(w.count >= COUNTED_STEPS for w in fleet.stats.workers)


def test_timed_call_records_as_its_python_twin():
    """C timed_call and StepTimer's Python twin record a call the same way: one count, its
    seconds, and the quarter-octave bucket of those seconds (StepTimer.record's)."""
    if envfleet._core.native.speedups is None:
        pytest.skip("envfleet._core._speedups is not built here")
    from envfleet._core.stats import STATS_WORDS, StepTimer

    rows = np.zeros((2, STATS_WORDS))
    c_timer = StepTimer(rows[0])
    envfleet._core.native.disabled = frozenset({"timed_call"})
    try:
        python_timer = StepTimer(rows[1])
    finally:
        envfleet._core.native.disabled = frozenset()
    assert c_timer.call != python_timer.call  # one in C, one in Python
    for seconds in (0.0, 0.0004, 0.003):
        before = rows.copy()
        assert c_timer.call(lambda s=seconds: time.sleep(s) or "c") == "c"
        assert python_timer.call(lambda s=seconds: time.sleep(s) or "py") == "py"
        for k in range(2):
            got = rows[k] - before[k]
            assert got[0] == 1.0 and got[1] > 0.0
            reference = np.zeros(STATS_WORDS)
            StepTimer(reference).record(got[1])
            assert np.array_equal(got[2:], reference[2:]), (k, seconds)


def test_the_c_module_holds_what_pays():
    """The functions benchmarks/speedups.py found to pay end to end, and no others: adding
    one back is a measured decision (with its property test and its counter test)."""
    if envfleet._core.native.speedups is None:
        pytest.skip("envfleet._core._speedups is not built here")
    functions = set(c_counters()) - SYSCALL_COUNTERS
    assert functions == {
        "serve_steps",
        "full_round",
        "timed_call",
        "write_results",
        "write_rows",
        # The processes round bell's (Linux futexes): a full round's one ring and one sleep,
        # and the death watch's alarm that ends that sleep (it needs a store-load fence).
        "bell_ring",
        "bell_sleep",
        "bell_arrive",
        "gather_sleep",
        "bell_alarm",
        # The replay record's episode start at each autoreset: a PCG64 state as bytes (half
        # of the record's cost on CartPole, benchmarks/README.md).
        "pcg64_raw",
        # The replay record's copy of each step's action rows.
        "log_row",
    }
    assert set(c_counters()) >= SYSCALL_COUNTERS
    for name in functions:
        assert envfleet._core.native.function(name) is getattr(envfleet._core.native.speedups, name)


def test_disabled_functions_run_their_python_twin(make_env, monkeypatch):
    """A function named in envfleet._core.native.disabled is not called; the others still are."""
    if envfleet._core.native.speedups is None:
        pytest.skip("envfleet._core._speedups is not built here")
    monkeypatch.setattr(envfleet._core.native, "disabled", frozenset({"write_rows"}))
    fleet = make_env("CartPole-v1", 16, backend="serial")
    before = c_counters()
    step_cartpole(fleet)
    after = c_counters()
    assert after["write_rows"] == before["write_rows"]
    assert after["write_results"] - before["write_results"] >= COUNTED_STEPS


# -- the control row: one C struct, one Python mirror ------------------------------------------


def test_the_control_row_is_one_c_struct_mirrored_in_python():
    """``_speedups.c``'s ``control_t`` is the worker module's row word for word: each field at
    the index of its Python name, the struct within the row's ``WORDS``."""
    speedups = pytest.importorskip("envfleet._core._speedups")
    from envfleet._backends.processes import worker

    row = speedups.control_row()
    assert row.pop("USED") <= worker.WORDS
    assert row == worker.CONTROL_ROW
    assert sorted(row.values()) == list(range(len(row)))  # every word once, none skipped
    for name, index in row.items():
        assert getattr(worker, name) == index


def test_a_c_module_with_another_control_row_is_refused(monkeypatch):
    """A C module built from other sources (its control row not the Python mirror's) is
    refused where the C step path binds, as :func:`check_control_row` documents, instead of
    stepping on the wrong words."""
    pytest.importorskip("envfleet._core._speedups")
    from envfleet._backends.processes import worker

    moved = dict(zip(worker.CONTROL_ROW, [6, 3, 0, 5, 1, 7, 2, 4, 8], strict=True))
    monkeypatch.setattr(worker, "CONTROL_ROW", moved)
    with pytest.raises(RuntimeError, match="built from other sources"):
        worker.check_control_row()
    monkeypatch.undo()
    worker.check_control_row()  # the real mirror passes


def test_pcg64_raw_is_pcg64_bytes_and_runs_at_autoresets():
    """_speedups.pcg64_raw (the C copy of a PCG64 state) gives env_state.pcg64_bytes's 40 bytes
    for generators in many states, a buffered half draw among them; and an EnvGroup's record
    reads every autoreset's start with it (the counter of the fast path)."""
    from envfleet._core import env_state
    from envfleet._core.env_state import pcg64_bytes

    speedups = envfleet._core.native.speedups
    if speedups is None:
        pytest.skip("envfleet._core._speedups is not built here")
    if not env_state._NUMPY_PCG64_LAYOUT:
        pytest.skip("a numpy whose PCG64 layout the C copy does not know: the twin runs")
    rng = np.random.default_rng(0)
    for seed in rng.integers(0, 2**63, size=50):
        generator = np.random.default_rng(int(seed))
        generator.random(int(seed % 7))
        if seed % 2:
            generator.integers(0, 2**32, dtype=np.uint32)
        bit_generator = generator.bit_generator
        raw = speedups.pcg64_raw(bit_generator.ctypes.state_address)
        assert raw == pcg64_bytes(bit_generator)
    envs = envfleet.make("CartPole-v1", 2, backend="serial")
    try:
        envs.reset(seed=0)
        before = speedups.counters()["pcg64_raw"]
        ended = 0
        for _ in range(200):
            _, _, terminated, truncated, _ = envs.step(np.zeros(2, dtype=np.int64))
            ended += int(np.count_nonzero(terminated | truncated))
        assert ended > 2
        assert speedups.counters()["pcg64_raw"] - before >= ended - 2  # one per autoreset
    finally:
        envs.close()


def test_log_row_records_as_its_twin_and_runs_every_step():
    """ActionLog.recorder's C copy (_speedups.log_row) leaves the ring, the step count, the
    episode starts and the recordings exactly as ActionLog.record (its twin) does, past a
    wrap of the ring; and an EnvGroup's record runs it once per step (its counter)."""
    from envfleet._core.action_log import ActionLog

    speedups = envfleet._core.native.speedups
    if speedups is None:
        pytest.skip("envfleet._core._speedups is not built here")
    space = gym.spaces.Box(-1.0, 1.0, (3,), np.float32)
    c_log, twin = ActionLog(space, 4, 5), ActionLog(space, 4, 5)
    c_log.open()
    twin.open()
    rows = np.zeros((4, 3), np.float32)
    c_record = c_log.recorder(rows)
    assert isinstance(c_record, functools.partial) and c_record.func is speedups.log_row
    rng = np.random.default_rng(0)
    for t in range(12):  # past the ring's capacity: it wraps
        rows[...] = rng.uniform(-1.0, 1.0, rows.shape)
        if t % 3 == 0:
            for log in (c_log, twin):
                log.began(t % 4, ("seed", t, None))
        c_record()
        twin.record(rows)
        assert c_log.ring.tobytes() == twin.ring.tobytes()
        np.testing.assert_array_equal(c_log.header, twin.header)
        np.testing.assert_array_equal(c_log.starts, twin.starts)
    for c_recording, twin_recording in zip(c_log.recordings(0), twin.recordings(0), strict=True):
        np.testing.assert_array_equal(c_recording.actions, twin_recording.actions)
    assert any(r.complete and len(r.actions) for r in c_log.recordings(0))
    envs = envfleet.make("CartPole-v1", 2, backend="serial")
    try:
        envs.reset(seed=0)
        before = speedups.counters()["log_row"]
        for _ in range(50):
            envs.step(np.zeros(2, dtype=np.int64))
        assert speedups.counters()["log_row"] - before == 50
    finally:
        envs.close()


def test_full_round_takes_the_plan_its_transport_built_once():
    """``full_round(plan, ring, wait_s)``: ``round_plan`` checks the workers' entries once (one
    per worker in each, a tuple subclass for the outcome), and ``full_round`` refuses anything
    but a plan. A plan of no workers and no driver's block is a complete round: ``None``."""
    speedups = pytest.importorskip("envfleet._core._speedups")
    from envfleet._backends.processes.doorbell import SpinBudget
    from envfleet._core.failures import EnvFailure
    from envfleet._core.protocol import RoundOutcome

    budget = SpinBudget(0.0)
    common = (None, EnvFailure, 0.0, 0, 0, None, budget)
    with pytest.raises(ValueError, match="one entry per worker"):
        speedups.round_plan((), (1,), (), [], *common, RoundOutcome)
    with pytest.raises(TypeError, match="tuple subclass"):
        speedups.round_plan((), (), (), [], *common, dict)
    with pytest.raises(TypeError):
        speedups.round_plan([], (), (), [], *common, RoundOutcome)
    with pytest.raises(ValueError):
        speedups.full_round(object(), True, -1.0)
    plan = speedups.round_plan((), (), (), [], *common, RoundOutcome)
    assert speedups.full_round(plan, True, 0.0) is None
    assert speedups.full_round(plan, False, 0.0) is None
