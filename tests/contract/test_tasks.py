"""The backend contract for tasks (``FleetVectorEnv.run_in_workers_async``/``_wait``, what the
Sampler's worker inference runs on): whatever a task returns comes back as it is, on every
backend: arrays (whose truth value is ambiguous), falsy values, empty containers."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from tests.envs import IndexedEnv


def _rows(group: Any, kind: str) -> Any:
    """A task: the worker's env indices as an array, or a falsy value."""
    if kind == "array":
        return np.arange(group.start, group.stop)
    return {"zero": 0, "empty-list": [], "empty-dict": {}, "none": None}[kind]


@pytest.mark.parametrize("kind", ["array", "zero", "empty-list", "empty-dict", "none"])
def test_a_task_result_comes_back_as_it_is(make_env: Any, backend: Any, kind: str) -> None:
    layout = {"num_workers": 2} if backend.workers else {}
    envs = make_env(IndexedEnv, 4, **backend.options, **layout)
    envs.reset(seed=0)
    ranges = envs.worker_ranges
    envs.run_in_workers_async(_rows, dict.fromkeys(range(len(ranges)), kind))
    results = envs.run_in_workers_wait()
    assert sorted(results) == list(range(len(ranges)))
    for w, (start, stop) in enumerate(ranges):
        if kind == "array":
            np.testing.assert_array_equal(results[w], np.arange(start, stop))
        elif kind in ("empty-list", "none"):
            assert results[w] in ([], None)  # an empty list travels as "no events"
        else:
            assert results[w] == {"zero": 0, "empty-dict": {}}[kind]
            assert type(results[w]) is type({"zero": 0, "empty-dict": {}}[kind])
    # The vector env goes on stepping after tasks.
    envs.step(np.zeros(4, dtype=np.int64))
    envs.close()
