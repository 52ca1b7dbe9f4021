"""The backend contract's lifecycle: ``close`` leaves nothing behind, a second ``close`` is a
no-op, a closed vector env refuses every call, and ``close`` with a call pending warns with
gymnasium's AsyncVectorEnv text, on every backend. Leaks are counted with the ``snapshot``
fixture (child processes and ``/dev/shm`` entries)."""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import pytest

import envfleet
from tests.envs import IndexedEnv, SlowEnv
from tests.helpers import start_pending_call


def _layout(backend: Any) -> dict[str, Any]:
    return {"num_workers": 2} if backend.workers else {}


def test_close_leaves_nothing_and_twice_is_a_no_op(
    make_env: Any, snapshot: Any, backend: Any
) -> None:
    envs = make_env(IndexedEnv, 3, **backend.options, **_layout(backend))
    envs.reset(seed=0)
    envs.step(np.zeros(3, dtype=np.int64))
    envs.close()
    assert envs.closed
    if backend.owns_processes:
        snapshot.assert_nothing_left()
    envs.close()
    envs.close(terminate=True)
    assert envs.closed


@pytest.mark.parametrize(
    "call",
    [
        lambda e: e.step(np.zeros(3, dtype=np.int64)),
        lambda e: e.reset(seed=0),
        lambda e: e.call("slow"),
        lambda e: e.get_attr("env_index"),
        lambda e: e.step_async(np.zeros(3, dtype=np.int64)),
    ],
    ids=["step", "reset", "call", "get_attr", "step_async"],
)
def test_a_closed_vector_env_refuses_every_call(make_env: Any, backend: Any, call: Any) -> None:
    envs = make_env(SlowEnv, 3, **backend.options, **_layout(backend))
    envs.reset(seed=0)
    envs.close()
    with pytest.raises(envfleet.ClosedEnvironmentError):
        call(envs)


def pending_cases(backend: Any) -> list[tuple[bool, str]]:
    if not backend.cheap:
        return [(False, "step"), (True, "reset")]
    return [(terminate, p) for terminate in (False, True) for p in ("step", "reset", "call")]


@pytest.mark.per_backend("terminate, pending", pending_cases)
def test_close_with_a_pending_call_warns_as_gymnasium(
    make_env: Any, snapshot: Any, backend: Any, terminate: bool, pending: str
) -> None:
    """``close()`` with a call pending warns with gymnasium's AsyncVectorEnv.close text and
    category (``UserWarning`` through ``gymnasium.logger.warn``), terminating or not."""
    envs = make_env(SlowEnv, 2, **backend.options)
    start_pending_call(envs, pending)
    text = f"Calling `close` while waiting for a pending call to `{pending}` to complete."
    with pytest.warns(UserWarning, match=re.escape(text)):
        envs.close(terminate=terminate)
    assert envs.closed
    if backend.owns_processes:
        snapshot.assert_nothing_left()


@pytest.mark.backends(pool=True)
def test_close_with_pool_envs_in_flight_leaves_nothing(
    make_env: Any, snapshot: Any, backend: Any
) -> None:
    """A first-ready pool closed while envs it sent actions to are still stepping."""
    envs = make_env(IndexedEnv, 4, **backend.options, batch_size=2, **_layout(backend))
    envs.async_reset(seed=0)
    for _ in range(3):
        *_, info = envs.recv()
        envs.send(np.zeros(len(info["env_id"]), dtype=np.int64), info["env_id"])
    envs.close()
    assert envs.closed
    with pytest.raises(envfleet.ClosedEnvironmentError):
        envs.recv()
    if backend.owns_processes:
        snapshot.assert_nothing_left()
