"""The control messages (envfleet._core.protocol): one-byte commands and statuses, and requests
and replies that survive the pickling they travel with."""

from __future__ import annotations

import pickle

import numpy as np

from envfleet._core.protocol import (
    CallRequest,
    Command,
    Failure,
    RemoteError,
    ResetRequest,
    RestartRequest,
    SetAttrRequest,
    SideValues,
    Status,
)
from tests.helpers import assert_same


def test_commands_and_statuses_are_distinct_single_bytes() -> None:
    for enum_type in (Command, Status):
        values = [member.value for member in enum_type]
        assert len(set(values)) == len(values)
        assert all(0 < v < 256 for v in values)
        assert all(bytes([v])[0] == v for v in values)


def test_requests_and_replies_pickle() -> None:
    error = RemoteError(1, "step", "ValueError", "boom", "Traceback ...", pickle.dumps(None))
    messages = [
        ResetRequest([0, None], {"x": 1}, np.array([True, False])),
        CallRequest("render", (1,), {"mode": "rgb_array"}),
        SetAttrRequest("gravity", [9.8, 1.6]),
        RestartRequest([1], [7], Command.STEP, rebuild=False),
        Failure([error], [(1, {"a": 1})], partial=True),
    ]
    for message in messages:
        copy = pickle.loads(pickle.dumps(message))
        assert type(copy) is type(message)
        assert_same(vars(copy), vars(message))


def test_side_values_keep_their_type_through_pickle() -> None:
    """The front tells side values from infos by their type."""
    copy = pickle.loads(pickle.dumps(SideValues(values=["text"])))
    assert type(copy) is SideValues and copy == {"values": ["text"]}
