"""Restart mode (``restart_policy``): failed envs and workers are rebuilt, within a budget.

Every test drives a real vector env with real faults (an env that raises, a worker that
segfaults, exits, hangs or is SIGKILLed) next to a :class:`Model`: gymnasium's
``SyncVectorEnv`` of the same envs without the fault, with each restart applied the way the
contract says (a fresh env reset with ``restart_seed(its last seed, its restart count)``), and
compares every result bit for bit: the rebuilt envs' rows against the model's fresh envs, every
other env's rows against what they would have been without the fault, for many steps after.

Faults fire on a cue the model can compute (the ``fault_after + 1``-th ``step()`` call of an
env), once (``marker``) or every time (the budget tests). Timeouts are hang guards only:
nothing asserts how fast anything happens.
"""

from __future__ import annotations

import functools
import math
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gymnasium.vector import AutoresetMode, SyncVectorEnv, VectorEnv

import envfleet
from envfleet._backends.supervisor import restart_seed
from envfleet._core.stats import NUM_BUCKETS, STATS_WORDS, StepTimer, step_time_table
from tests.envs import FlakyEnv, sync_factories
from tests.helpers import assert_same, wait_gone

ROOT = Path(__file__).resolve().parents[2]
POLICY = envfleet.RestartPolicy(restart_on=(Exception,), max_restarts=10, window_s=600.0)
NEXT, SAME, DISABLED = AutoresetMode.NEXT_STEP, AutoresetMode.SAME_STEP, AutoresetMode.DISABLED
MODES = [NEXT, SAME, DISABLED]
HANG_TIMEOUT = 3.0  # the timeout a hanging worker runs into; a hang guard for the others


def _flaky(faults, *, fault_in="step", fault_after=3, marker=None):
    return functools.partial(
        FlakyEnv, faults=faults, fault_in=fault_in, fault_after=fault_after, marker=marker
    )


def _marker(tmp_path: Path) -> str:
    return str(tmp_path / "fired")


def _actions(t: int, num_envs: int) -> np.ndarray:
    return np.array([(t + 2 * i) % 3 for i in range(num_envs)], dtype=np.int64)


class _Batcher:
    """gymnasium's own info batching (``VectorEnv._add_info``) for one env's info."""

    _add_info = VectorEnv._add_info

    def __init__(self, num_envs: int):
        self.num_envs = num_envs


def _batched(num_envs: int, info: dict[str, Any], row: int) -> dict[str, Any]:
    return _Batcher(num_envs)._add_info({}, info, row)


# -- the model -------------------------------------------------------------------------------


class Model:
    """What restart mode must return: a SyncVectorEnv of fault-free envs plus the restarts.

    ``faults``: faulty env -> the rows rebuilt when it fails in step (the env alone when it
    raises; every env of its worker when the worker dies). The model sees a fault come when its
    own fault-free copy of the env reaches the same ``step()`` call (``calls``) as the faulty
    one, which has the same trajectory until then.
    """

    def __init__(
        self,
        num_envs: int,
        mode: AutoresetMode = NEXT,
        faults: dict[int, list[int]] | None = None,
        fault_after: int = 3,
        once: bool = True,
    ):
        self.num_envs = num_envs
        self.mode = mode
        self.sync = SyncVectorEnv(sync_factories(FlakyEnv, num_envs), autoreset_mode=mode)
        self.faults = faults or {}
        self.fault_after = fault_after
        self.once = once
        self.fired: set[int] = set()
        self.seeds: list[int | None] = [None] * num_envs  # each env's last seed
        self.restarts = [0] * num_envs
        self.done = np.zeros(num_envs, np.bool_)  # ended episodes (DISABLED: reset them first)
        self.t = 0  # steps so far
        self.events: list[tuple[int, list[int]]] = []  # (step, rebuilt rows) per restart step

    def reset(self, seed=None, mask=None, explode=False, rows=()):
        """The fault-free reset, then ``rows`` rebuilt after it (an env raised or died in it)."""
        n = self.num_envs
        seeds = [seed + i for i in range(n)] if isinstance(seed, int) else seed or [None] * n
        for i, s in enumerate(seeds):
            if s is not None and (mask is None or mask[i]):
                self.seeds[i] = s
        options: dict[str, Any] = {}
        if mask is not None:
            options["reset_mask"] = np.array(mask, np.bool_)
        if explode:
            options["explode"] = True
        want = self.sync.reset(seed=seed, options=options or None)
        if mask is None:
            self.done[:] = False
        else:
            self.done[np.asarray(mask)] = False
        return want, self._restart(sorted(rows), after_step=False)

    def step(self, actions, rows=None):
        """The fault-free step, then the rebuilt rows: ``rows``, or those of the faults due."""
        want = self.sync.step(actions)
        if rows is None:
            due: set[int] = set()
            for i, fault_rows in self.faults.items():
                if self.sync.envs[i].calls == self.fault_after + 1 and i not in self.fired:
                    if self.once:
                        self.fired.add(i)
                    due.update(fault_rows)
            rows = sorted(due)
        rebuilt = self._restart(rows, after_step=True)
        if rows:
            self.events.append((self.t, list(rows)))
        self.t += 1
        self.done = want[2] | want[3]
        self.done[list(rows)] = True  # truncated
        return want, rebuilt

    def _restart(self, rows, after_step):
        """Swap a fresh env in for each row, reset with its restart seed; its (obs, info)."""
        out = {}
        for i in rows:
            self.restarts[i] += 1
            env = FlakyEnv(env_index=i)
            obs, info = env.reset(seed=restart_seed(self.seeds[i], self.restarts[i]))
            self.sync.envs[i].close()
            self.sync.envs[i] = env
            self.sync._env_obs[i] = obs
            self.sync._autoreset_envs[i] = after_step  # as after any truncation
            out[i] = (obs, {**info, "env_restarted": True})
        return out

    def env_restarts(self) -> dict[int, int]:
        return {i: n for i, n in enumerate(self.restarts) if n}

    def close(self):
        self.sync.close()


# -- comparisons -----------------------------------------------------------------------------


def _assert_info_rows(got, want, rows, path="info"):
    """For each row of ``rows``: the same info keys reported, with the same values."""
    both = {**got, **want}
    keys = [k for k in both if not (k.startswith("_") and k[1:] in both)]
    for key in keys:
        g_mask, w_mask = got.get(f"_{key}"), want.get(f"_{key}")
        for r in rows:
            g_has = g_mask is not None and bool(g_mask[r])
            w_has = w_mask is not None and bool(w_mask[r])
            assert g_has == w_has, f"{path}[{key!r}] row {r}: reported {g_has}, want {w_has}"
            if not w_has:
                continue
            g, w = got[key], want[key]
            if isinstance(w, dict):
                assert isinstance(g, dict), f"{path}[{key!r}]: {type(g).__name__}, want dict"
                _assert_info_rows(g, w, [r], f"{path}[{key!r}]")
            else:
                assert g.dtype == w.dtype, f"{path}[{key!r}]: dtype {g.dtype} != {w.dtype}"
                assert_same(g[r], w[r], f"{path}[{key!r}][{r}]")


def _assert_result(got, want, rebuilt, label="result"):
    """``got`` (a step's 5 or a reset's 2 results) is ``want`` with the ``rebuilt`` rows
    replaced as the contract says; with nothing rebuilt, bit-identical to ``want``."""
    if not rebuilt:
        assert_same(got, want, label)
        return
    after_step = len(want) == 5
    num_envs = len(want[0])
    rows = sorted(rebuilt)
    healthy = [i for i in range(num_envs) if i not in rebuilt]
    assert len(got) == len(want)
    assert_same(got[0][healthy], want[0][healthy], f"{label} obs")
    for i, (obs, _) in rebuilt.items():
        assert_same(got[0][i], obs, f"{label} obs of rebuilt env {i}")
    if after_step:
        for k, name in ((1, "rewards"), (2, "terminations"), (3, "truncations")):
            assert_same(got[k][healthy], want[k][healthy], f"{label} {name}")
        assert_same(got[1][rows], np.zeros(len(rows)), f"{label} rewards of rebuilt envs")
        assert_same(got[2][rows], np.zeros(len(rows), np.bool_), f"{label} terminated")
        assert_same(got[3][rows], np.ones(len(rows), np.bool_), f"{label} truncated")
    infos = got[-1]
    mask = np.zeros(num_envs, np.bool_)
    mask[rows] = True
    assert_same(infos["_env_restarted"], mask, f"{label} info['_env_restarted']")
    assert infos["env_restarted"][rows].all()
    if "final_obs" in infos:  # SAME_STEP: the last observation died with the env
        assert not infos["_final_obs"][rows].any(), f"{label}: final_obs of a rebuilt env"
    _assert_info_rows(infos, want[-1], healthy, f"{label} info")
    for i, (_, info) in rebuilt.items():
        _assert_info_rows(infos, _batched(num_envs, info, i), [i], f"{label} info")


def _play(envs, model, steps, step=None):
    """Step ``envs`` and the model ``steps`` times with the same actions, checking each result.

    With AutoresetMode.DISABLED, envs whose episodes ended are reset first (masked), after
    checking that stepping raises ResetNeededError for exactly those envs.
    """
    step = step or envs.step
    for _ in range(steps):
        actions = _actions(model.t, envs.num_envs)
        if model.mode is DISABLED and model.done.any():
            mask = model.done.copy()
            with pytest.raises(envfleet.ResetNeededError) as info:
                envs.step(actions)
            assert info.value.env_indices == np.flatnonzero(mask).tolist()
            want, _ = model.reset(mask=mask)
            got = envs.reset(options={"reset_mask": mask})
            _assert_result(got, want, {}, f"reset before step {model.t}")
        want, rebuilt = model.step(actions)
        _assert_result(step(actions), want, rebuilt, f"step {model.t - 1}")


def _assert_stats(envs, model, restarts, *, crashes=0, timeouts=0, env_errors=0):
    stats = envs.stats
    assert isinstance(stats, envfleet.FleetStats)
    assert stats.restarts == restarts
    assert stats.env_restarts == model.env_restarts()
    assert (stats.crashes, stats.timeouts, stats.env_errors) == (crashes, timeouts, env_errors)


def _make(make_env, factory, num_envs, num_workers, mode=NEXT, backend="processes", **kwargs):
    kwargs.setdefault("supervision", envfleet.Supervision(restart_policy=POLICY))
    return make_env(
        factory,
        num_envs,
        backend=backend,
        num_workers=num_workers,
        autoreset_mode=mode,
        **kwargs,
    )


def _check_closed(envs, snapshot):
    assert envs.closed
    with pytest.raises(envfleet.ClosedEnvironmentError):
        envs.step(_actions(0, envs.num_envs))
    envs.close()
    snapshot.assert_nothing_left()


# -- configuration -----------------------------------------------------------------------------


def test_config_errors():
    assert envfleet.RestartPolicy() == envfleet.RestartPolicy(max_restarts=10, window_s=60.0)
    for kwargs in ({"max_restarts": -1}, {"window_s": 0}, {"window_s": -1.0}):
        with pytest.raises(envfleet.ConfigError):
            envfleet.RestartPolicy(**kwargs)
    envfleet.RestartPolicy(
        restart_on=(Exception,), max_restarts=0, window_s=0.001
    )  # the bounds themselves are fine
    with pytest.raises(envfleet.ConfigError, match="restart_policy"):
        envfleet.make(
            FlakyEnv, 2, backend="serial", supervision=envfleet.Supervision(restart_policy="x")
        )
    with pytest.raises(envfleet.ConfigError, match="a restart policy cannot rebuild"):
        envfleet.make(
            FlakyEnv,
            4,
            backend=envfleet.Processes(driver_envs=2),
            supervision=envfleet.Supervision(restart_policy=POLICY),
        )


def test_restart_seed():
    assert restart_seed(None, 1) is None
    seeds = {(s, k): restart_seed(s, k) for s in (0, 1, 7) for k in (1, 2, 3)}
    assert seeds == {(s, k): restart_seed(s, k) for s in (0, 1, 7) for k in (1, 2, 3)}
    assert len(set(seeds.values())) == len(seeds)  # a new seed per env and per restart
    assert all(isinstance(v, int) and 0 <= v < 2**32 for v in seeds.values())


# -- an env raises: only that env is rebuilt ------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.name)
@pytest.mark.parametrize(
    ("backend", "num_envs", "num_workers", "index"),
    [("processes", 6, 2, 4), ("processes", 3, 3, 1), ("serial", 6, 2, 4)],
)
def test_env_raises_in_step(make_env, tmp_path, backend, num_envs, num_workers, index, mode):
    factory = _flaky({index: "raise"}, fault_after=5, marker=_marker(tmp_path))
    envs = _make(make_env, factory, num_envs, num_workers, mode, backend)
    model = Model(num_envs, mode, faults={index: [index]}, fault_after=5)
    _assert_result(envs.reset(seed=7), *model.reset(seed=7), "reset")
    pids = envs.get_attr("pid")
    _play(envs, model, 30)
    assert len(model.events) == 1 and model.events[0][1] == [index]
    _assert_stats(envs, model, 1, env_errors=1)
    assert envs.get_attr("pid") == pids  # rebuilt inside its worker
    assert not envs.closed
    model.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("backend", "num_envs", "num_workers", "index"),
    [("processes", 6, 2, 4), ("processes", 3, 3, 0), ("serial", 4, 2, 1)],
)
def test_env_raises_in_reset(make_env, backend, num_envs, num_workers, index):
    """Rebuilt with a seed derived from that reset's seed; again from a masked, unseeded one."""
    factory = _flaky({index: "raise"}, fault_in="reset")  # raises in every explosive reset
    envs = _make(make_env, factory, num_envs, num_workers, backend=backend)
    model = Model(num_envs)
    _assert_result(envs.reset(seed=3), *model.reset(seed=3), "reset")
    _play(envs, model, 4)
    got = envs.reset(seed=11, options={"explode": True})
    _assert_result(got, *model.reset(seed=11, explode=True, rows=[index]), "explosive reset")
    _play(envs, model, 12)
    mask = np.zeros(num_envs, np.bool_)
    mask[[index, (index + 1) % num_envs]] = True
    got = envs.reset(options={"reset_mask": mask, "explode": True})
    want = model.reset(mask=mask, explode=True, rows=[index])
    _assert_result(got, *want, "masked explosive reset")  # restart_seed(11 + index, 2)
    _play(envs, model, 12)
    assert model.restarts[index] == 2
    _assert_stats(envs, model, 2, env_errors=2)
    model.close()


def test_last_seed_is_the_last_reset_with_a_seed(make_env, tmp_path):
    factory = _flaky({1: "raise"}, fault_after=4, marker=_marker(tmp_path))
    envs = _make(make_env, factory, 4, 2)
    model = Model(4, faults={1: [1]}, fault_after=4)
    _assert_result(envs.reset(seed=10), *model.reset(seed=10), "reset")
    mask = np.array([True, False, True, True])
    got = envs.reset(seed=30, options={"reset_mask": mask})
    _assert_result(got, *model.reset(seed=30, mask=mask), "masked reset")
    _assert_result(envs.reset(), *model.reset(), "unseeded reset")  # the last seeds stay
    _assert_result(envs.reset(seed=[None, None, 50, None]), *model.reset([None, None, 50, None]))
    assert model.seeds == [30, 11, 50, 33]
    _play(envs, model, 10)
    assert len(model.events) == 1  # env 1 was reset with restart_seed(11, 1)
    model.close()


# -- a worker dies: it is respawned with all its envs; the env it was inside loses its episode,
# the others are brought back from their records ------------------------------------------


# (how, autoreset mode, context, num_envs, num_workers, faulty env, rows of its worker)
DEATHS = [
    ("segfault", NEXT, "fork", 6, 2, 4, [3, 4, 5]),
    ("segfault", SAME, "fork", 6, 2, 4, [3, 4, 5]),
    ("segfault", DISABLED, "fork", 6, 2, 4, [3, 4, 5]),
    ("segfault", NEXT, "fork", 3, 3, 1, [1]),
    ("exit", NEXT, "fork", 6, 3, 2, [2, 3]),
    ("exit", SAME, "spawn", 4, 2, 1, [0, 1]),
    ("segfault", NEXT, "forkserver", 6, 2, 1, [0, 1, 2]),
]


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    ("how", "mode", "context", "num_envs", "num_workers", "index", "rows"),
    DEATHS,
    ids=[f"{d[0]}-{d[1].name}-{d[2]}-{d[3]}x{d[4]}" for d in DEATHS],
)
def test_worker_dies_in_step(
    make_env, snapshot, tmp_path, how, mode, context, num_envs, num_workers, index, rows
):
    factory = _flaky({index: how}, fault_after=4, marker=_marker(tmp_path))
    envs = _make(
        make_env, factory, num_envs, num_workers, mode, backend=envfleet.Processes(context=context)
    )
    model = Model(num_envs, mode, faults={index: [index]}, fault_after=4)
    _assert_result(envs.reset(seed=5), *model.reset(seed=5), "reset")
    pids = envs.get_attr("pid")
    _play(envs, model, 25)
    assert len(model.events) == 1 and model.events[0][1] == [index]
    _assert_stats(envs, model, 1, crashes=1)
    new_pids = envs.get_attr("pid")
    for i in range(num_envs):
        assert (new_pids[i] != pids[i]) == (i in rows), f"pid of env {i}"
    assert len(set(new_pids)) == num_workers
    envs.close()
    snapshot.assert_nothing_left()
    model.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["segfault", "exit"])
def test_worker_dies_in_reset(make_env, snapshot, how):
    factory = _flaky({4: how}, fault_in="reset")
    envs = _make(make_env, factory, 6, 2)
    model = Model(6)
    _assert_result(envs.reset(seed=1), *model.reset(seed=1), "reset")
    _play(envs, model, 3)
    got = envs.reset(seed=20, options={"explode": True})
    _assert_result(got, *model.reset(seed=20, explode=True, rows=[3, 4, 5]), "explosive reset")
    _play(envs, model, 15)
    _assert_stats(envs, model, 1, crashes=1)
    envs.close()
    snapshot.assert_nothing_left()
    model.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("call", "context", "num_envs", "num_workers", "rows"),
    [
        ("step", "fork", 6, 2, [0, 1, 2]),
        ("step", "spawn", 4, 4, [3]),
        ("reset", "fork", 6, 3, [2, 3]),
    ],
)
def test_worker_killed_between_steps(
    make_env, snapshot, call, context, num_envs, num_workers, rows
):
    """SIGKILL from outside while the worker idles: the next step or reset respawns it."""
    envs = _make(
        make_env, FlakyEnv, num_envs, num_workers, backend=envfleet.Processes(context=context)
    )
    model = Model(num_envs)
    _assert_result(envs.reset(seed=2), *model.reset(seed=2), "reset")
    _play(envs, model, 3)
    pids = envs.get_attr("pid")
    os.kill(pids[rows[0]], signal.SIGKILL)
    assert not wait_gone([pids[rows[0]]], timeout=30)
    if call == "step":
        actions = _actions(model.t, num_envs)
        _assert_result(envs.step(actions), *model.step(actions, rows=rows), "step after kill")
    else:
        _assert_result(envs.reset(seed=9), *model.reset(seed=9, rows=rows), "reset after kill")
    _play(envs, model, 12)
    _assert_stats(envs, model, 1, crashes=1)
    new_pids = envs.get_attr("pid")
    assert [i for i in range(num_envs) if new_pids[i] != pids[i]] == rows
    envs.close()
    snapshot.assert_nothing_left()
    model.close()


# -- a worker hangs: it is killed and respawned -----------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("timeout_via", "num_envs", "num_workers", "index", "rows"),
    [("step_timeout", 6, 3, 3, [2, 3]), ("step_timeout", 3, 3, 1, [1])],
)
def test_worker_hangs(
    make_env, snapshot, tmp_path, timeout_via, num_envs, num_workers, index, rows
):
    factory = _flaky({index: "hang"}, fault_after=3, marker=_marker(tmp_path))
    step_timeout = HANG_TIMEOUT if timeout_via == "step_timeout" else None
    envs = _make(
        make_env,
        factory,
        num_envs,
        num_workers,
        supervision=envfleet.Supervision(step_timeout=step_timeout),
    )
    model = Model(num_envs, faults={index: [index]}, fault_after=3)  # its block: rows

    def step_wait_with_timeout(actions):
        envs.step_async(actions)
        return envs.step_wait(timeout=HANG_TIMEOUT)

    step = step_wait_with_timeout if timeout_via == "step_wait" else None
    _assert_result(envs.reset(seed=4), *model.reset(seed=4), "reset")
    pids = envs.get_attr("pid")
    _play(envs, model, 15, step)
    assert len(model.events) == 1 and model.events[0][1] == [index]
    _assert_stats(envs, model, 1, timeouts=1)
    new_pids = envs.get_attr("pid")
    assert [i for i in range(num_envs) if new_pids[i] != pids[i]] == rows
    envs.close()
    snapshot.assert_nothing_left()
    model.close()


# -- several failures in one step -----------------------------------------------------------


@pytest.mark.timeout(60)
def test_several_failures_in_one_step(make_env, snapshot, tmp_path):
    """Two envs of worker 0 raise while worker 1 dies: three restarts, one step.

    SAME_STEP: every env's step() runs on every step, so all three fail on step 3."""
    faults = {1: "raise", 2: "raise", 4: "segfault"}
    envs = _make(make_env, _flaky(faults, marker=_marker(tmp_path)), 6, 2, SAME)
    model = Model(6, SAME, faults={1: [1], 2: [2], 4: [4]})
    _assert_result(envs.reset(seed=8), *model.reset(seed=8), "reset")
    _play(envs, model, 20)
    assert model.events == [(3, [1, 2, 4])]
    _assert_stats(envs, model, 3, crashes=1, env_errors=2)
    envs.close()
    snapshot.assert_nothing_left()
    model.close()


@pytest.mark.timeout(60)
def test_a_step_wait_timeout_raises_whatever_the_policy(make_env, snapshot, tmp_path):
    """``step_wait(timeout=)`` is the caller's own bound, gymnasium's: a worker late for it
    raises ``StepTimeoutError`` (also ``multiprocessing.TimeoutError``) under a restart policy
    too; the policy restarts workers past ``step_timeout``."""
    factory = _flaky({1: "hang"}, fault_after=3, marker=_marker(tmp_path))
    envs = _make(make_env, factory, 3, 3)
    envs.reset(seed=4)
    for t in range(3):
        envs.step(_actions(t, 3))
    envs.step_async(_actions(3, 3))
    with pytest.raises(multiprocessing.TimeoutError) as info:
        envs.step_wait(timeout=HANG_TIMEOUT)
    assert isinstance(info.value, envfleet.StepTimeoutError) and 1 in info.value.env_indices
    assert envs.closed and envs.stats.restarts == 0
    snapshot.assert_nothing_left()


# -- the budget ---------------------------------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("max_restarts", [0, 2])
@pytest.mark.parametrize(("backend", "worker"), [("processes", 1), ("serial", None)])
def test_budget_exhausted_env_error(make_env, backend, worker, max_restarts):
    """An env that raises every third step: restarted ``max_restarts`` times, then EnvError."""
    policy = envfleet.RestartPolicy(
        restart_on=(Exception,), max_restarts=max_restarts, window_s=600.0
    )
    envs = _make(
        make_env,
        _flaky({2: "raise"}, fault_after=2),
        4,
        2,
        backend=backend,
        supervision=envfleet.Supervision(restart_policy=policy),
    )
    model = Model(4, faults={2: [2]}, fault_after=2, once=False)
    _assert_result(envs.reset(seed=0), *model.reset(seed=0), "reset")
    # Its 3rd step() call raises; after a restart, the autoreset step and 3 more calls.
    _play(envs, model, 2 + 4 * max_restarts)
    assert model.events == [(2 + 4 * k, [2]) for k in range(max_restarts)]
    with pytest.raises(envfleet.EnvError) as info:
        envs.step(_actions(model.t, 4))
    err = info.value
    assert (err.env_index, err.worker_index, err.method) == (2, worker, "step")
    assert "restart budget exhausted" in str(err)
    assert isinstance(err.__cause__, ValueError)
    assert str(err.__cause__) == "boom in step of env 2"
    if backend == "processes":
        assert isinstance(err.__cause__.__cause__, envfleet.RemoteTraceback)
    _assert_stats(envs, model, max_restarts, env_errors=max_restarts + 1)

    # Still usable; env 2 still raises, and the budget is still spent.
    assert not envs.closed
    obs, _ = envs.reset(seed=40)
    assert_same(obs, np.stack([FlakyEnv(env_index=i).reset(seed=40 + i)[0] for i in range(4)]))
    with pytest.raises(envfleet.EnvError, match="restart budget exhausted") as info:
        envs.step(_actions(0, 4))
    assert info.value.env_index == 2
    _assert_stats(envs, model, max_restarts, env_errors=max_restarts + 2)
    model.close()


@pytest.mark.timeout(60)
def test_one_steps_failures_are_one_restart(make_env):
    """Two envs raise in one step with one restart left: one restart rebuilds both (a round's
    failures are one fault, as one lost simulator is for all its envs); their next failing
    step is past the budget."""
    policy = envfleet.RestartPolicy(restart_on=(Exception,), max_restarts=1, window_s=600.0)
    factory = _flaky({1: "raise", 2: "raise"}, fault_after=2)  # both fail on step 2
    envs = _make(make_env, factory, 4, 2, supervision=envfleet.Supervision(restart_policy=policy))
    model = Model(4, faults={1: [1], 2: [2]}, fault_after=2, once=False)
    _assert_result(envs.reset(seed=0), *model.reset(seed=0), "reset")
    _play(envs, model, 3)  # the 3rd step() call raises in envs 1 and 2
    assert model.events == [(2, [1, 2])]
    _play(envs, model, 3)  # after the restart, the autoreset step and 2 more calls
    with pytest.raises(envfleet.EnvError, match="restart budget exhausted") as info:
        envs.step(_actions(model.t, 4))
    assert (info.value.env_index, info.value.worker_index) == (1, 0)
    _assert_stats(envs, model, 2, env_errors=4)  # two rebuilds (one per worker), one fault
    model.close()


@pytest.mark.timeout(60)
def test_budget_window_slides(make_env):
    """A restart more than ``window_s`` seconds after the last one fits the budget again."""
    policy = envfleet.RestartPolicy(restart_on=(Exception,), max_restarts=1, window_s=0.3)
    envs = _make(
        make_env,
        _flaky({1: "raise"}, fault_after=2),
        2,
        1,
        backend="serial",
        supervision=envfleet.Supervision(restart_policy=policy),
    )
    model = Model(2, faults={1: [1]}, fault_after=2, once=False)
    _assert_result(envs.reset(seed=0), *model.reset(seed=0), "reset")
    _play(envs, model, 3)
    assert model.events == [(2, [1])]
    _play(envs, model, 2)
    time.sleep(0.4)  # at least window_s after the first restart
    _play(envs, model, 2)
    assert model.events == [(2, [1]), (6, [1])]
    _assert_stats(envs, model, 2, env_errors=2)
    model.close()


@pytest.mark.parametrize("backend", ["serial", "threads"])
def test_env_0_is_rebuilt_in_the_driver(make_env, tmp_path, backend):
    factory = _flaky({0: "raise"}, fault_after=2, marker=_marker(tmp_path))
    envs = _make(make_env, factory, 2, 1, backend=backend)
    envs.reset(seed=0)
    for t in range(3):
        envs.step(_actions(t, 2))
    assert envs.stats.restarts == 1
    assert envs.get_attr("calls") == (0, 3)  # env 0 is a new env: no step() call yet


@pytest.mark.timeout(60)
def test_budget_exhausted_crash(make_env, snapshot):
    policy = envfleet.RestartPolicy(restart_on=(Exception,), max_restarts=1, window_s=600.0)
    envs = _make(
        make_env,
        _flaky({3: "segfault"}, fault_after=2),
        4,
        2,
        supervision=envfleet.Supervision(restart_policy=policy),
    )
    model = Model(4, faults={3: [3]}, fault_after=2, once=False)
    _assert_result(envs.reset(seed=0), *model.reset(seed=0), "reset")
    _play(envs, model, 6)
    assert model.events == [(2, [3])]
    with pytest.raises(envfleet.EnvCrashedError) as info:
        envs.step(_actions(6, 4))
    err = info.value
    assert "restart budget exhausted" in str(err)
    assert (err.worker_index, err.env_indices, err.env_index) == (1, [2, 3], 2)
    assert (err.exitcode, err.signal, err.step) == (-signal.SIGSEGV, signal.SIGSEGV, 6)
    _check_closed(envs, snapshot)
    _assert_stats(envs, model, 1, crashes=2)  # readable after close
    model.close()


@pytest.mark.timeout(60)
def test_budget_exhausted_timeout(make_env, snapshot):
    """``max_restarts=0`` never restarts: the hang fails fast, as without a policy."""
    policy = envfleet.RestartPolicy(restart_on=(Exception,), max_restarts=0)
    envs = _make(
        make_env,
        _flaky({1: "hang"}, fault_after=1),
        4,
        2,
        supervision=envfleet.Supervision(restart_policy=policy, step_timeout=HANG_TIMEOUT),
    )
    model = Model(4)
    envs.reset(seed=0)
    model.reset(seed=0)
    _play(envs, model, 1)
    with pytest.raises(envfleet.StepTimeoutError) as info:
        envs.step(_actions(1, 4))
    assert "restart budget exhausted" in str(info.value)
    assert (info.value.env_indices, info.value.timeout) == ([0, 1], HANG_TIMEOUT)
    _check_closed(envs, snapshot)
    _assert_stats(envs, model, 0, timeouts=1)
    model.close()


# -- what is not restarted --------------------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", ["processes", "serial"])
def test_errors_in_calls_are_not_restarted(make_env, backend):
    envs = _make(make_env, _flaky({1: "raise"}, fault_in="render"), 4, 2, backend=backend)
    model = Model(4)
    _assert_result(envs.reset(seed=0), *model.reset(seed=0), "reset")
    pids = envs.get_attr("pid")
    with pytest.raises(envfleet.EnvError) as info:
        envs.call("explode")
    assert info.value.env_index == 0 and isinstance(info.value.__cause__, ValueError)
    with pytest.raises(envfleet.EnvError) as info:
        envs.get_attr("missing")
    assert isinstance(info.value.__cause__, AttributeError)
    with pytest.raises(envfleet.EnvError) as info:
        envs.set_attr("readonly", 1)
    assert isinstance(info.value.__cause__, AttributeError)
    with pytest.raises(envfleet.EnvError) as info:
        envs.render()
    assert info.value.env_index == 1
    stats = envs.stats
    assert (stats.restarts, stats.env_restarts) == (0, {})
    assert envs.get_attr("pid") == pids
    _play(envs, model, 10)  # nothing was rebuilt: the envs go on as if nothing happened
    model.close()


# -- statistics -------------------------------------------------------------------------------


def test_step_timer_histogram():
    """StepTimer's count, total and quarter-octave histogram give the mean exactly and the
    percentiles within the documented ±9 %, from sub-microsecond steps to the last bucket."""
    rows = np.zeros((2, STATS_WORDS))
    timer = StepTimer(rows[1])  # a row of a shared table, as the processes backend has
    durations = [10e-6] * 90 + [1e-3] * 10
    for seconds in durations:
        timer.record(seconds)
    stats = step_time_table(rows)
    assert stats[0].count == 0 and stats[1].count == 100
    assert stats[1].mean_s == pytest.approx(sum(durations) / 100)
    assert stats[1].p50_s == pytest.approx(10e-6, rel=0.09)
    assert stats[1].p99_s == pytest.approx(1e-3, rel=0.09)
    rows[1] = 0.0
    timer.record(0.5e-6)  # up to 1 µs: the first bucket
    timer.record(1e9)  # beyond the last bucket: counted in it
    assert rows[1, 2] == 1.0 and rows[1, 1 + NUM_BUCKETS] == 1.0 and rows[1, 0] == 2.0


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("backend", "num_workers"), [("processes", 3), ("serial", 2)])
def test_stats(make_env, backend, num_workers):
    envs = _make(make_env, FlakyEnv, 6, num_workers, backend=backend)
    before = envs.stats
    assert before == envfleet.FleetStats(
        restarts=0,
        env_restarts={},
        timeouts=0,
        crashes=0,
        env_errors=0,
        workers=before.workers,
        recycled=0,
        memory=before.memory,
    )
    assert len(before.workers) == num_workers
    # Per worker process (none on serial): its memory, episodes and their growth.
    assert len(before.memory) == (num_workers if backend == "processes" else 0)
    assert all(m.episodes == 0 and m.growth_per_1000_episodes is None for m in before.memory)
    for w in before.workers:
        assert isinstance(w, envfleet.StepTimeStats)
        assert w.count == 0 and math.isnan(w.mean_s) and math.isnan(w.p99_s)
    envs.reset(seed=0)
    for t in range(15):
        envs.step(_actions(t, 6))
    envs.step_async(_actions(15, 6))
    pending = envs.stats  # readable while a step is pending
    assert pending.restarts == 0 and len(pending.workers) == num_workers
    envs.step_wait()
    envs.reset(seed=1)  # resets are not steps
    after = envs.stats
    assert before.workers[0].count == 0  # a snapshot
    for w in after.workers:
        assert w.count == 16
        assert math.isfinite(w.mean_s) and w.mean_s > 0
        assert 0 < w.p50_s <= w.p99_s and math.isfinite(w.p99_s)


@pytest.mark.timeout(60)
def test_identical_runs_give_identical_results(make_env, tmp_path):
    def run(marker):
        factory = _flaky({0: "raise", 3: "segfault"}, fault_after=4, marker=marker)
        envs = _make(make_env, factory, 4, 2)
        results = [envs.reset(seed=123)]
        for t in range(15):
            results.append(envs.step(_actions(t, 4)))
        assert envs.stats.restarts == 2
        envs.close()
        return results

    first, second = run(str(tmp_path / "a")), run(str(tmp_path / "b"))
    rebuilt = [np.flatnonzero(r[-1].get("_env_restarted", [])).tolist() for r in first]
    assert sorted(i for rows in rebuilt for i in rows) == [0, 3]
    assert_same(first, second)


# -- a SIGKILLed driver ---------------------------------------------------------------------------

DRIVER = """
import os, signal, sys, time
import numpy as np
import envfleet
from tests.envs import FlakyEnv
from tests.helpers import wait_gone
policy = envfleet.RestartPolicy(restart_on=(Exception,), max_restarts=5, window_s=600)
envs = envfleet.make(FlakyEnv, 4, backend=envfleet.Processes(context=sys.argv[1]),
                     num_workers=2, supervision=envfleet.Supervision(restart_policy=policy))
envs.reset(seed=0)
victim = envs.get_attr("pid")[0]
os.kill(victim, signal.SIGKILL)
assert not wait_gone([victim], timeout=30)
actions = np.zeros(4, dtype=np.int64)
envs.step(actions)  # respawns worker 0
pids = envs.get_attr("pid")
print(envs.stats.restarts, victim, " ".join(str(pid) for pid in pids), flush=True)
if sys.argv[2] == "idle":
    time.sleep(3600)
while True:
    envs.step(actions)
"""


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    ("context", "activity"), [("fork", "idle"), ("fork", "stepping"), ("forkserver", "stepping")]
)
def test_workers_exit_when_driver_is_killed(snapshot, context, activity):
    """Respawned workers, too, exit when the driver is SIGKILLed; nothing is left."""
    driver = subprocess.Popen(
        [sys.executable, "-c", DRIVER, context, activity],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        restarts, victim, *pids = (int(x) for x in driver.stdout.readline().split())
        assert restarts == 1
        assert len(pids) == 4 and pids[0] == pids[1] != pids[2] == pids[3]
        assert victim not in pids and driver.pid not in pids
        workers = sorted(set(pids))
        assert wait_gone(workers, timeout=0) == workers  # they run
        driver.kill()
        driver.wait(30)
        assert wait_gone(workers, timeout=30) == []
    finally:
        driver.kill()
        driver.wait(30)
        driver.stdout.close()
    snapshot.assert_nothing_left()
