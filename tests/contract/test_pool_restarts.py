"""``restart_policy`` in a first-ready pool (issue 18 item 3): what died, hung or raised is
rebuilt within the budget, the affected envs' episodes end as truncated and flagged with
``info["env_restarted"]``, every other env's data is exactly that of a run without the fault,
and every env keeps producing data.

Differential: each faulty run is compared, env by env, with the same run (same seeds, same
actions per env) without the fault. Real faults only: SIGKILL, ``os._exit``, a segfault
through ctypes, an exception, a hang past ``step_timeout``. Timeouts here are hang guards.
"""

from __future__ import annotations

import ctypes
import faulthandler
import os
import time
from typing import Any

import numpy as np
import pytest

import envfleet
from tests.contract.conftest import Backend
from tests.envs import FaultEnv

GUARD = 90.0  # seconds for a whole run: a hang guard, never a speed bound
NUM_ENVS = 4
ROUNDS = 9  # results per env: the reset, then 8 steps (a fault at step 5 happens once)
POLICY = envfleet.RestartPolicy(restart_on=(Exception,), max_restarts=3, window_s=600.0)

Record = tuple[bytes, float, bool, bool, bool]  # obs, reward, terminated, truncated, restarted


class OnceFaultEnv(FaultEnv):
    """:class:`tests.envs.FaultEnv` whose fault happens once per env over every rebuild when
    ``once_dir`` is given (a marker file there remembers it), with one more fault:
    ``"ctypes-segfault"`` reads address 0 through ctypes (a real segmentation fault in native
    code)."""

    def __init__(
        self,
        env_index: int,
        faults: dict[int, tuple[str, int]],
        once_dir: str | None = None,
    ):
        super().__init__(env_index, faults)
        self.marker = None if once_dir is None else os.path.join(once_dir, f"fault-{env_index}")
        if self.marker is not None and os.path.exists(self.marker):
            self.fault = None  # it happened to an earlier instance of this env

    def step(self, action: Any) -> Any:
        if self.fault is not None and self._steps + 1 == self.fault[1]:
            if self.marker is not None:
                with open(self.marker, "x"):
                    pass
            if self.fault[0] == "ctypes-segfault":
                faulthandler.disable()  # no "Fatal Python error" dump from a forked pytest
                ctypes.string_at(0)
        return super().step(action)


def faulty(faults: dict[int, tuple[str, int]], once_dir: Any = None) -> Any:
    where = None if once_dir is None else str(once_dir)

    def factory(env_index: int) -> OnceFaultEnv:
        return OnceFaultEnv(env_index, faults, where)

    return factory


def drive(envs: Any, rounds: int = ROUNDS) -> dict[int, list[Record]]:
    """recv -> send until every env has ``rounds`` results; env e's k-th action is
    ``(e + k) % 2`` whatever the timing. Returns each env's results in order."""
    envs.async_reset(seed=7)
    seen: dict[int, list[Record]] = {e: [] for e in range(envs.num_envs)}
    steps = np.zeros(envs.num_envs, dtype=np.int64)
    deadline = time.monotonic() + GUARD
    while min(map(len, seen.values())) < rounds:
        assert time.monotonic() < deadline, {e: len(v) for e, v in seen.items()}
        obs, reward, terminated, truncated, info = envs.recv(timeout=envs.step_timeout or GUARD)
        ids = info["env_id"]
        restarted = np.zeros(len(ids), dtype=np.bool_)
        if "env_restarted" in info:
            restarted = info["_env_restarted"] & info["env_restarted"].astype(np.bool_)
        for k, e in enumerate(ids.tolist()):
            seen[e].append(
                (
                    obs[k].tobytes(),
                    float(reward[k]),
                    bool(terminated[k]),
                    bool(truncated[k]),
                    bool(restarted[k]),
                )
            )
        envs.send((ids + steps[ids]) % 2, ids)
        steps[ids] += 1
    return {e: records[:rounds] for e, records in seen.items()}


def run(
    make_env: Any, faults: dict[int, tuple[str, int]], once_dir: Any = None, **kwargs: Any
) -> Any:
    """The vector env and its :func:`drive` results (each fault once, its marker in
    ``once_dir``); without faults, closed already."""
    envs = make_env(faulty(faults, once_dir), NUM_ENVS, batch_size=2, **kwargs)
    seen = drive(envs)
    if not faults:
        envs.close()
    return envs, seen


def assert_rebuilt(
    faulty_run: dict[int, list[Record]],
    clean: dict[int, list[Record]],
    restarted: set[int],
    at_step: int,
) -> None:
    """Unaffected envs: exactly the clean run's data. Rebuilt envs: the clean run's data up
    to the fault, then a truncated, flagged result with reward 0, then more results."""
    for e in range(NUM_ENVS):
        if e not in restarted:
            assert faulty_run[e] == clean[e], f"env {e} was not affected, yet its data differs"
            assert not any(r[4] for r in faulty_run[e])
            continue
        records = faulty_run[e]
        assert records[:at_step] == clean[e][:at_step], f"env {e} before its fault"
        _, reward, terminated, truncated, flagged = records[at_step]
        assert (reward, terminated, truncated, flagged) == (0.0, False, True, True), e
        assert not any(r[4] for r in records[at_step + 1 :])
        assert len(records) == ROUNDS  # it kept producing data


CRASHES = ["sigkill", "exit", "ctypes-segfault"]


@pytest.mark.parametrize("how", CRASHES)
def test_processes_pool_rebuilds_a_dead_worker(
    how: str, make_env: Any, snapshot: Any, tmp_path: Any
) -> None:
    # One env per worker: only the env of the dead worker is rebuilt.
    kwargs = {
        "backend": "processes",
        "supervision": envfleet.Supervision(restart_policy=POLICY),
        "num_workers": NUM_ENVS,
    }
    envs, got = run(make_env, {3: (how, 5)}, tmp_path, **kwargs)
    _, clean = run(make_env, {}, **kwargs)
    assert_rebuilt(got, clean, {3}, at_step=5)
    stats = envs.stats
    assert (stats.restarts, stats.crashes, stats.env_restarts) == (1, 1, {3: 1})
    envs.close()
    snapshot.assert_nothing_left()


def test_processes_pool_rebuilds_only_the_env_a_dead_worker_was_inside(
    make_env: Any, tmp_path: Any
) -> None:
    """Two envs per worker: the worker dies inside env 2's step; env 2 is rebuilt, env 3 (its
    block-mate) is brought back from its record, and every env but 2 is untouched."""
    kwargs = {
        "backend": "processes",
        "supervision": envfleet.Supervision(restart_policy=POLICY),
        "num_workers": 2,
    }
    envs, got = run(make_env, {2: ("sigkill", 5)}, tmp_path, **kwargs)
    _, clean = run(make_env, {}, **kwargs)
    assert_rebuilt(got, clean, {2}, at_step=5)
    assert envs.stats.env_restarts == {2: 1} and envs.stats.restarts == 1


@pytest.mark.backends("serial", "threads", "processes")
@pytest.mark.parametrize("num_workers", [4, 2])
def test_pool_rebuilds_an_env_that_raised(
    backend: Backend, num_workers: int, make_env: Any, tmp_path: Any
) -> None:
    """Only the env that raised is rebuilt, also when it shares its worker with another."""
    kwargs = {
        **backend.options,
        "supervision": envfleet.Supervision(restart_policy=POLICY),
        "num_workers": num_workers,
    }
    envs, got = run(make_env, {1: ("raise", 5)}, tmp_path, **kwargs)
    _, clean = run(make_env, {}, **kwargs)
    assert_rebuilt(got, clean, {1}, at_step=5)
    stats = envs.stats
    assert (stats.restarts, stats.env_errors, stats.crashes) == (1, 1, 0)


def test_processes_pool_replaces_a_hung_worker(make_env: Any, snapshot: Any, tmp_path: Any) -> None:
    kwargs = {
        "backend": "processes",
        "supervision": envfleet.Supervision(restart_policy=POLICY, step_timeout=2.0),
        "num_workers": NUM_ENVS,
    }
    envs, got = run(make_env, {2: ("sleep:60", 5)}, tmp_path, **kwargs)
    _, clean = run(make_env, {}, **kwargs)
    assert_rebuilt(got, clean, {2}, at_step=5)
    assert envs.stats.timeouts == 1 and envs.stats.restarts == 1
    envs.close()
    snapshot.assert_nothing_left()


def test_threads_pool_hang_still_ends_the_vector_env(make_env: Any) -> None:
    """A thread cannot be killed: under a restart policy too, a hung thread is a
    StepTimeoutError (the envs that raise are rebuilt, above)."""
    envs = make_env(
        faulty({2: ("sleep:10", 5)}),
        NUM_ENVS,
        backend="threads",
        batch_size=2,
        supervision=envfleet.Supervision(restart_policy=POLICY, step_timeout=1.0),
    )
    with pytest.raises(envfleet.StepTimeoutError) as info:
        drive(envs)
    assert 2 in info.value.env_indices and envs.closed


def exhaustion_cases(backend: Backend) -> list[tuple[str, type[Exception]]]:
    """Every backend: an env that raises; where a worker can die alone, a crash and a hang."""
    cases: list[tuple[str, type[Exception]]] = [("raise", envfleet.EnvError)]
    if backend.workers == "processes":
        cases += [
            ("sigkill", envfleet.EnvCrashedError),
            ("ctypes-segfault", envfleet.EnvCrashedError),
            ("sleep:60", envfleet.StepTimeoutError),
        ]
    return cases


@pytest.mark.backends("serial", "threads", "processes")
@pytest.mark.per_backend("how, error", exhaustion_cases)
def test_pool_budget_exhaustion_raises_the_typed_error(
    backend: Backend, how: str, error: type[Exception], make_env: Any, snapshot: Any
) -> None:
    """One restart allowed; env 1 fails, is rebuilt, and fails again 3 steps later: that
    failure raises what it would raise without a policy, naming the exhausted budget."""
    envs = make_env(
        faulty({1: (how, 3)}),
        NUM_ENVS,
        **backend.options,
        batch_size=2,
        supervision=envfleet.Supervision(
            restart_policy=envfleet.RestartPolicy(
                restart_on=(Exception,), max_restarts=1, window_s=600.0
            ),
            step_timeout=2.0 if how.startswith("sleep") else None,
        ),
    )
    with pytest.raises(error, match="restart budget exhausted") as info:
        drive(envs, rounds=20)
    assert envs.stats.restarts == 1
    if error is envfleet.EnvError:
        assert isinstance(info.value, ValueError) and info.value.env_index == 1
        assert not envs.closed  # an env error leaves the pool usable
    else:
        assert envs.closed
    envs.close()
    if backend.owns_processes:
        snapshot.assert_nothing_left()


@pytest.mark.ray
@pytest.mark.parametrize("how", ["sigkill", "raise", "sleep:60"])
def test_ray_pool_rebuilds(how: str, make_env: Any, tmp_path: Any) -> None:
    kwargs: dict[str, Any] = {
        "backend": "ray",
        "num_workers": 2,
        "supervision": envfleet.Supervision(
            restart_policy=POLICY, step_timeout=3.0 if how.startswith("sleep") else None
        ),
    }
    envs, got = run(make_env, {3: (how, 5)}, tmp_path, **kwargs)
    _, clean = run(make_env, {}, **kwargs)
    # An actor holds envs 2 and 3: a dead or hung one takes both; an exception only env 3.
    assert_rebuilt(got, clean, {3} if how == "raise" else {2, 3}, at_step=5)
    assert envs.stats.restarts == 1
