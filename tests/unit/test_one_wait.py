"""Every round of the round driver waits in one place: :meth:`RoundDriver.wait_replies`.

A synchronous step, reset and call, a first-ready pool's ``recv`` and a worker's start all
wait on their workers through it (the C step round may take every reply before it, and then
nothing is left to wait for); a second loop over :meth:`Transport.wait` beside it fails here.
"""

from __future__ import annotations

import ast
import inspect
from typing import Any

import numpy as np
import pytest

import envfleet
from envfleet._backends import rounds
from envfleet._backends.rounds import RoundDriver


def test_rounds_py_calls_the_transports_wait_in_wait_replies_alone() -> None:
    tree = ast.parse(inspect.getsource(rounds))
    callers = [
        function.name
        for function in ast.walk(tree)
        if isinstance(function, ast.FunctionDef)
        for call in ast.walk(function)
        if isinstance(call, ast.Call)
        and isinstance(call.func, ast.Attribute)
        and call.func.attr == "wait"
        and "transport" in ast.unparse(call.func.value)
    ]
    assert callers == ["wait_replies"]


@pytest.mark.parametrize("backend", ["threads", "processes"])
def test_the_pool_and_the_synchronous_rounds_wait_in_wait_replies(
    backend: str, monkeypatch: Any
) -> None:
    waits: list[bool] = []
    original = RoundDriver.wait_replies

    def counted(self: RoundDriver, *args: Any, **kwargs: Any) -> Any:
        waits.append(bool(kwargs.get("pool", False)))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(RoundDriver, "wait_replies", counted)
    with envfleet.make("CartPole-v1", 4, backend=backend, num_workers=2) as envs:
        assert bool(waits) is (backend == "processes")  # the start: each worker's READY
        assert not any(waits)
        waits.clear()
        envs.reset(seed=0)
        envs.call("reset")  # a call: no C round, a Python wait (unless run in this thread)
        synchronous = len(waits)
        assert synchronous >= 1 and not any(waits)
    with envfleet.make("CartPole-v1", 4, backend=backend, num_workers=2, batch_size=2) as pool:
        waits.clear()
        pool.async_reset(seed=0)
        for _ in range(6):
            _, _, _, _, info = pool.recv()
            pool.send(np.zeros(len(info["env_id"]), dtype=np.int64), info["env_id"])
        assert waits and all(waits)
