"""A crash costs one episode of one env, under ``make()``'s defaults (no option set).

The rows of the "never lose a run by default" table: a segfault, an ``os._exit`` and a SIGKILL
in a worker restart it (``RestartPolicy()`` is the default); only the env its worker was inside
starts a new episode (``truncated``, ``info["env_restarted"]``), and its block-mates, brought
back from their records, give exactly what a fault-free run gives; each restart warns
:class:`envfleet.EnvRestartedWarning` naming the env, the cause, the frame and the saved
replay; an env's own ``ValueError`` still raises; a lost connection restarts that env only;
``restart_policy=None`` is the documented fail-fast. Every run is compared, step by step, with
the same run without the fault.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import warnings
from typing import Any

import gymnasium
import numpy as np
import pytest
from gymnasium.vector import AutoresetMode

import envfleet
from envfleet._core.replay import load_replay
from tests.envs import fault_at, fault_factory

NUM_ENVS = 8  # two workers of four on two cores: env 3 shares worker 0 with envs 0, 1, 2


def _run(factory: Any, steps: int, **options: Any) -> tuple[list[Any], list[str], Any]:
    """Step ``make(factory, 8, **options)`` ``steps`` times from ``reset(seed=0)`` with seeded
    actions: every step's (obs, reward, terminated, truncated, info), the restart warnings,
    and ``envs.stats``."""
    envs = envfleet.make(factory, NUM_ENVS, **options)
    rng = np.random.default_rng(7)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", envfleet.EnvRestartedWarning)
            out: list[Any] = [envs.reset(seed=0)]
            for _ in range(steps):
                out.append(envs.step(rng.integers(0, 2, NUM_ENVS)))
        stats = envs.stats
    finally:
        envs.close()
    restarts = [
        str(w.message) for w in caught if issubclass(w.category, envfleet.EnvRestartedWarning)
    ]
    return out, restarts, stats


def _env_rows(out: list[Any], e: int) -> list[tuple[Any, ...]]:
    """Env ``e``'s data at every step: observation, reward, flags, and its infos."""
    return [
        (result[0][e].tolist(), *(x[e].item() for x in result[1:-1]), repr(_row(result[-1], e)))
        for result in out
    ]


def _row(info: dict[str, Any], e: int) -> dict[str, Any]:
    """Env ``e``'s part of a batched info dict (gymnasium's layout: ``_key`` masks)."""
    return {
        key: _row(value, e) if isinstance(value, dict) else np.asarray(value[e]).tolist()
        for key, value in info.items()
        if not key.startswith("_") and info["_" + key][e]
    }


def _assert_one_episode_lost(
    base: list[Any], got: list[Any], lost: int, at: int | None = None
) -> None:
    """Every env but ``lost`` gives what the fault-free run gives at every step; ``lost`` does
    up to the one step that restarts it (``at``, where known: 1-based), where it reads
    truncated with ``env_restarted``."""
    for e in range(NUM_ENVS):
        if e != lost:
            assert _env_rows(got, e) == _env_rows(base, e), f"env {e} differs"
    restarts = [k for k, step in enumerate(got) if "env_restarted" in step[-1]]
    assert len(restarts) == 1, "one step restarts"
    k = restarts[0]
    assert at is None or k == at
    assert _env_rows(got, lost)[:k] == _env_rows(base, lost)[:k]
    obs, reward, terminated, truncated, info = got[k]
    assert truncated[lost] and not terminated[lost] and reward[lost] == 0.0
    assert np.flatnonzero(info["_env_restarted"]).tolist() == [lost]


@pytest.mark.parametrize(
    ("how", "mode"),
    [
        ("null-write", AutoresetMode.NEXT_STEP),  # a real SIGSEGV in C
        ("null-write", AutoresetMode.SAME_STEP),
        ("exit", AutoresetMode.NEXT_STEP),  # os._exit(3)
        ("sigkill", AutoresetMode.NEXT_STEP),  # as the OOM killer kills
    ],
)
def test_a_crash_costs_one_episode_of_one_env(how: str, mode: AutoresetMode) -> None:
    """CartPole x8 (episodes end and autoreset all along), env 3 crashes its worker in its
    400th step: the run goes on; envs 0-2 (its block-mates) and 4-7 are bit-identical to the
    fault-free run, env 3 ends its episode there; one warning names env 3, the cause, the
    frame and a replay file that loads."""
    base, none, _ = _run(fault_at("CartPole-v1"), 450, autoreset_mode=mode)
    got, warned, stats = _run(fault_at("CartPole-v1", 3, how, 400), 450, autoreset_mode=mode)
    assert none == []
    _assert_one_episode_lost(base, got, lost=3)
    assert (stats.crashes, stats.restarts, stats.env_restarts) == (1, 1, {3: 1})
    [message] = warned
    cause = {"null-write": "signal SIGSEGV", "exit": "exit code 3", "sigkill": "signal SIGKILL"}
    assert "worker 0 (sub-environments 0..3) died with " + cause[how] in message
    assert "sub-environment 3 starts a new episode" in message
    assert "[0, 1, 2] continue exactly" in message
    if how == "null-write":  # faulthandler wrote the faulting frame
        assert "tests/envs.py" in message and "in step" in message
    path = re.search(r"its replay: (\S+)", message)
    assert path is not None
    loaded = load_replay(path.group(1))
    assert loaded.kind == "crash" and sorted(r.env_index for r in loaded.envs) == [0, 1, 2, 3]
    os.unlink(path.group(1))


def test_a_step_past_step_timeout_costs_one_episode() -> None:
    """Env 2 hangs in its 30th step: past ``step_timeout`` its worker is killed and replaced;
    only env 2 starts a new episode, named in the warning with the frame it hung in."""
    base, _, _ = _run(fault_factory({}), 40, supervision=envfleet.Supervision(step_timeout=5.0))
    got, warned, stats = _run(
        fault_factory({2: ("hang", 30)}), 40, supervision=envfleet.Supervision(step_timeout=5.0)
    )
    _assert_one_episode_lost(base, got, lost=2, at=30)
    assert stats.timeouts == 1 and stats.restarts == 1
    [message] = warned
    assert "did not answer within 5.0 s" in message and "in crash_process" in message
    assert "sub-environment 2 starts a new episode" in message


def test_a_worker_killed_between_steps_restarts_its_whole_block() -> None:
    """A worker SIGKILLed from outside while it runs no env code (between two steps): nothing
    tells which env to blame, so its four envs start new episodes; the run goes on and the
    other worker's envs are untouched."""
    zeros = np.zeros(NUM_ENVS, np.int64)
    envs = envfleet.make(fault_factory({}), NUM_ENVS)
    base = envfleet.make(fault_factory({}), NUM_ENVS)
    try:
        envs.reset(seed=0)
        base.reset(seed=0)
        for _ in range(5):
            envs.step(zeros)
            base.step(zeros)
        pid = envs._backend.transport.workers.procs[1].pid
        os.kill(pid, signal.SIGKILL)
        os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)
        for k in range(2):
            if k == 0:
                with pytest.warns(envfleet.EnvRestartedWarning, match=r"\[4, 5, 6, 7\] start"):
                    obs, _, _, truncated, info = envs.step(zeros)
                assert truncated.tolist() == [False] * 4 + [True] * 4
                assert np.flatnonzero(info["_env_restarted"]).tolist() == [4, 5, 6, 7]
            else:
                obs = envs.step(zeros)[0]
            assert np.array_equal(obs[:4], base.step(zeros)[0][:4])
    finally:
        envs.close()
        base.close()


def test_several_envs_in_flight_restart_their_whole_block(monkeypatch: Any) -> None:
    """A worker stepping its envs at once (envs that wait, stepped concurrently) cannot tell
    which one segfaulted: every env of its block starts a new episode, as the warning says,
    and the other worker's envs are bit-identical to the fault-free run."""
    monkeypatch.setenv("ENVFLEET_STEPPING", "concurrent")
    base, _, _ = _run(fault_factory({}, wait_s=0.001), 30)
    got, warned, _ = _run(fault_factory({1: ("null-write", 20)}, wait_s=0.001), 30)
    for e in range(4, NUM_ENVS):
        assert _env_rows(got, e) == _env_rows(base, e)
    assert np.flatnonzero(got[20][-1]["_env_restarted"]).tolist() == [0, 1, 2, 3]
    [message] = warned
    assert "sub-environments [0, 1, 2, 3] start a new episode" in message


def test_an_env_exception_still_raises_under_the_defaults() -> None:
    """An env's own ``ValueError`` raises ``EnvError[ValueError]``, as gymnasium's vector envs
    raise it: a restart would hide a bug."""
    envs = envfleet.make(fault_at("CartPole-v1", 3, "raise:ValueError", 5), NUM_ENVS)
    try:
        envs.reset(seed=0)
        with warnings.catch_warnings():
            warnings.simplefilter("error", envfleet.EnvRestartedWarning)
            for _ in range(4):
                envs.step(np.zeros(NUM_ENVS, np.int64))
            with pytest.raises(envfleet.EnvError) as info:
                envs.step(np.zeros(NUM_ENVS, np.int64))
        assert isinstance(info.value, ValueError) and info.value.env_index == 3
        assert envs.stats.restarts == 0
    finally:
        envs.close()


@pytest.mark.parametrize("name", ["ConnectionError", "BrokenPipeError", "TimeoutError"])
def test_a_lost_connection_restarts_that_env(name: str) -> None:
    """A lost connection to a simulator (``ConnectionError``, ``BrokenPipeError``,
    ``TimeoutError`` from the env's step) restarts that env only, as ML-Agents restarts on its
    communication error; every other env is bit-identical to the fault-free run."""
    base, _, _ = _run(fault_at("CartPole-v1"), 60)
    got, warned, stats = _run(fault_at("CartPole-v1", 5, f"raise:{name}", 50), 60)
    _assert_one_episode_lost(base, got, lost=5)
    assert stats.env_errors == 1 and stats.restarts == 1
    [message] = warned
    assert f"{name}" in message and "sub-environment 5 starts a new episode" in message


def test_restart_on_widens_and_narrows() -> None:
    """``RestartPolicy(restart_on=...)`` chooses which env exceptions restart: widened to
    every ``Exception``, a ``ValueError`` restarts; narrowed to none, a ``ConnectionError``
    raises."""
    wide = envfleet.RestartPolicy(restart_on=(Exception,))
    got, warned, _ = _run(
        fault_at("CartPole-v1", 3, "raise:ValueError", 5),
        8,
        supervision=envfleet.Supervision(restart_policy=wide),
    )
    assert got[5][3][3] and len(warned) == 1
    narrow = envfleet.RestartPolicy(restart_on=())
    with pytest.raises(envfleet.EnvError) as info:
        _run(
            fault_at("CartPole-v1", 3, "raise:ConnectionError", 5),
            8,
            supervision=envfleet.Supervision(restart_policy=narrow),
        )
    assert isinstance(info.value, ConnectionError)
    with pytest.raises(envfleet.ConfigError, match="restart_on"):
        envfleet.RestartPolicy(restart_on=(ValueError, "x"))  # type: ignore[arg-type]


def test_restart_policy_none_fails_fast() -> None:
    """The documented opt-out: ``restart_policy=None`` gives today's typed error at once."""
    with pytest.raises(envfleet.EnvCrashedError, match="signal SIGSEGV") as info:
        _run(
            fault_at("CartPole-v1", 3, "null-write", 5),
            8,
            supervision=envfleet.Supervision(restart_policy=None),
        )
    assert info.value.worker_index == 0


def test_the_default_budget_fails_a_crash_loop() -> None:
    """A crash loop exhausts the default budget (10 restarts within 60 s): the 11th crash
    fails fast with the typed error, naming the budget."""
    assert envfleet.RestartPolicy() == envfleet.RestartPolicy(10, 60.0)
    with pytest.raises(envfleet.EnvCrashedError, match="restart budget exhausted"):
        _run(fault_at("CartPole-v1", 3, "exit", 1), 40)


class _SharedSimulator(gymnasium.Wrapper):  # type: ignore[type-arg]
    """CartPole behind a connection that every env loses at once: each env raises
    ``ConnectionError`` in its ``lost_at``-th step since it was built (a simulator that all
    the envs talk to, gone)."""

    def __init__(self, lost_at: int = 5):
        super().__init__(gymnasium.make("CartPole-v1"))
        self.lost_at, self._steps = lost_at, 0

    def step(self, action: Any) -> Any:
        self._steps += 1
        if self._steps == self.lost_at:
            raise ConnectionError("the shared simulator is gone")
        return self.env.step(action)


def test_a_round_that_loses_every_env_is_one_restart(caplog: pytest.LogCaptureFixture) -> None:
    """All 8 envs lose their connection in the same step: one fault, one restart of the
    budget (``RestartPolicy(1, 60)`` grants it), every env rebuilt, one log line and one
    warning per worker, each naming the frame that raised; the same again 5 steps later is a
    second one, past the budget: it raises, naming the budget."""
    with caplog.at_level(logging.WARNING, logger="envfleet"):
        got, warned, stats = _run(
            _SharedSimulator,
            7,
            supervision=envfleet.Supervision(restart_policy=envfleet.RestartPolicy(1, 60)),
        )
    assert all(got[5][4]["env_restarted"]) and all(got[5][3])  # truncated, restarted
    assert stats.env_errors == NUM_ENVS and stats.restarts >= 1
    lines = [r.getMessage() for r in caplog.records if "restarting it" in r.getMessage()]
    workers = len(stats.workers)
    assert len(lines) == workers and len(warned) == workers, (lines, warned)
    assert all(f"(and {NUM_ENVS // workers - 1} more of its worker's envs)" in x for x in lines)
    assert all(f"(raised at {__file__}:" in x and " in step). " in x for x in warned), warned
    with pytest.raises(envfleet.EnvError, match="restart budget exhausted") as info:
        _run(
            _SharedSimulator,
            12,
            supervision=envfleet.Supervision(restart_policy=envfleet.RestartPolicy(1, 60)),
        )
    assert isinstance(info.value, ConnectionError)
