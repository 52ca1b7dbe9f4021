"""RowWriter (envfleet._core.rows): each strategy writes a slab's rows as gymnasium's
``concatenate`` would, for observations that fit it and, through its own fallback, for those
that do not (another dtype, not C-contiguous, a list, an ndarray subclass, another shape), or
raises as ``concatenate`` does and names the first observation it refuses; and the C copy
really runs where it applies (its counter advances), in a writer and in a group's step."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from gymnasium import spaces
from gymnasium.vector.utils import concatenate, create_empty_array

import envfleet
import envfleet._core.native
import envfleet._core.rows
from envfleet._core.rows import JOIN_MAX_BYTES, RowWriter
from tests.helpers import assert_same

K = 3  # the group's envs
BOX = spaces.Box(-10.0, 10.0, (2, 4), np.float32)
BIG_BOX = spaces.Box(0, 255, (4, 84, 84), np.uint8)  # a Pong frame stack: above JOIN_MAX_BYTES
NEEDS_C = pytest.mark.skipif(
    envfleet._core.native.speedups is None, reason="envfleet._core._speedups is not built here"
)


class Sub(np.ndarray):
    """An ndarray subclass: not an exact ndarray, so not copied byte for byte."""


def c_write_rows() -> Any:
    return envfleet._core.native.function("write_rows")


def c_writes() -> int:
    speedups = envfleet._core.native.speedups
    return 0 if speedups is None else int(speedups.counters()["write_rows"])


def group_rows(space: spaces.Space[Any], layout: str) -> tuple[np.ndarray, Any]:
    """A batch of K + 2 envs and a function giving the group's K rows (envs 1..K) in it or
    in a copy of it, as the group sees them: ``"contiguous"`` (a slice of the batch) or
    ``"strided"`` (every other column of a wider batch: rows whose first two axes merge into
    one view, but not C-contiguous)."""
    if layout == "contiguous":
        return create_empty_array(space, K + 2), lambda batch: batch[1 : K + 1]
    assert layout == "strided" and isinstance(space, spaces.Box)
    wide = np.zeros((K + 2, *space.shape[:-1], 2 * space.shape[-1]), space.dtype)
    return wide, lambda batch: batch[..., ::2][1 : K + 1]


def observations_of(space: spaces.Space[Any], form: str, seed: int = 0) -> list[Any]:
    """K observations of ``space``; env 1's in ``form``, the others plain."""
    space.seed(seed)
    obs = [space.sample() for _ in range(K)]
    plain = obs[1]
    if form == "plain":
        pass
    elif form == "other dtype":  # cast by same_kind
        obs[1] = plain.astype(np.float64 if plain.dtype.kind == "f" else np.int64)
    elif form == "not contiguous":
        twice = np.repeat(plain, 2, axis=-1)
        obs[1] = twice[..., ::2]
        assert not obs[1].flags.c_contiguous
    elif form == "fortran":
        obs[1] = np.asfortranarray(plain)
    elif form == "list":
        obs[1] = plain.tolist()
    elif form == "subclass":
        obs[1] = plain.view(Sub)
    elif form == "wrong shape":  # refused by gymnasium's concatenate
        obs[1] = plain.reshape(-1)[:-1]
    elif form == "wrong kind":  # a float into an integer buffer: refused (same_kind)
        obs[1] = plain.astype(np.float64) + 0.5
    else:
        raise AssertionError(form)
    return obs


def outcome(write: Any) -> tuple[str, Any]:
    try:
        write()
    except Exception as exc:
        return "raised", type(exc)
    return "wrote", None


def assert_writes_as_gymnasium(
    writer: RowWriter, batch: np.ndarray, rows_of: Any, space: Any, obs: list[Any]
) -> None:
    """``writer.write()`` leaves the batch as gymnasium's concatenate into the same rows of a
    copy of it leaves that copy, or both raise the same error and the writer names the first
    observation that concatenate refuses on its own."""
    want_batch = batch.copy()
    want = outcome(lambda: concatenate(space, obs, rows_of(want_batch)))
    got = outcome(writer.write)
    assert got == want
    if got[0] == "wrote":
        assert_same(batch, want_batch)
        return
    probe = create_empty_array(space, 1)
    refused = [
        j
        for j, o in enumerate(obs)
        if outcome(lambda o=o: concatenate(space, [o], probe))[0] == "raised"
    ]
    assert writer.misfit() == refused[0]


FORMS = [
    "plain",
    "other dtype",
    "not contiguous",
    "fortran",
    "list",
    "subclass",
    "wrong shape",
    "wrong kind",
]


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize(
    "strategy, space, layout",
    [
        pytest.param("c", BOX, "contiguous", marks=NEEDS_C),
        pytest.param("c", BIG_BOX, "contiguous", marks=NEEDS_C),
        ("joined", BOX, "contiguous"),
        ("concatenate", BIG_BOX, "contiguous"),  # above JOIN_MAX_BYTES
        ("concatenate", BOX, "strided"),  # not C-contiguous
    ],
    ids=["c", "c-big", "joined", "concatenate-big", "concatenate-strided"],
)
def test_array_strategies_write_as_gymnasium(strategy, space, layout, form):
    batch, rows_of = group_rows(space, layout)
    obs = observations_of(space, form)
    writer = RowWriter(obs, rows_of(batch), space, c_write_rows() if strategy == "c" else None)
    assert writer.strategy == strategy
    before = c_writes()
    assert_writes_as_gymnasium(writer, batch, rows_of, space, obs)
    if strategy == "c":  # the C copy runs for exact contiguous ndarrays, and only for them
        copied = form in ("plain", "fortran") and obs[1].flags.c_contiguous
        assert c_writes() - before == copied


@pytest.mark.parametrize("form", ["plain", "other dtype", "list", "wrong kind"])
def test_stack_strategy_writes_as_gymnasium(form):
    """An array space of ndim 0 (Discrete): np.stack, as gymnasium's concatenate."""
    space = spaces.Discrete(5)
    batch, rows_of = group_rows(space, "contiguous")
    space.seed(1)
    obs: list[Any] = [np.int64(space.sample()) for _ in range(K)]
    if form == "other dtype":
        obs[1] = np.int8(obs[1])
    elif form == "list":
        obs[1] = [int(obs[1])]
    elif form == "wrong kind":
        obs[1] = 1.5
    writer = RowWriter(obs, rows_of(batch), space, c_write_rows())
    assert writer.strategy == "stack"
    assert_writes_as_gymnasium(writer, batch, rows_of, space, obs)


@pytest.mark.parametrize("form", ["plain", "list leaf", "missing key"])
def test_tree_strategy_writes_as_gymnasium(form):
    space = spaces.Dict({"pos": BOX, "kind": spaces.Discrete(3)})
    batch = create_empty_array(space, K + 2)
    rows = {key: leaf[1 : K + 1] for key, leaf in batch.items()}
    space.seed(2)
    obs = [space.sample() for _ in range(K)]
    if form == "list leaf":
        obs[2] = {"pos": obs[2]["pos"].tolist(), "kind": obs[2]["kind"]}
    elif form == "missing key":
        obs[2] = {"pos": obs[2]["pos"]}
    writer = RowWriter(obs, rows, space, c_write_rows())
    assert writer.strategy == "tree"
    want = {key: leaf.copy() for key, leaf in batch.items()}
    want_rows = {key: leaf[1 : K + 1] for key, leaf in want.items()}
    expected = outcome(lambda: concatenate(space, obs, want_rows))
    assert outcome(writer.write) == expected
    if expected[0] == "wrote":
        assert_same(batch, want)
    else:
        assert writer.misfit() == 2


def test_the_rows_follow_the_list_in_place():
    """A writer reads the group's list as it is when it writes: the group only changes it in
    place (each env's slot), never rebinds it."""
    batch, rows_of = group_rows(BOX, "contiguous")
    rows = rows_of(batch)
    obs = observations_of(BOX, "plain")
    writer = RowWriter(obs, rows, BOX, c_write_rows())
    for seed in range(3):
        obs[:] = observations_of(BOX, "plain", seed)
        writer.write()
        assert_same(rows, np.stack(obs))


@pytest.mark.parametrize("strategy", ["joined", "concatenate"])
def test_join_max_bytes_picks_joined_or_numpy(monkeypatch, strategy):
    rows_bytes = K * BOX.shape[0] * BOX.shape[1] * 4
    limit = rows_bytes if strategy == "joined" else rows_bytes - 1
    assert rows_bytes <= JOIN_MAX_BYTES
    monkeypatch.setattr(envfleet._core.rows, "JOIN_MAX_BYTES", limit)
    batch, rows_of = group_rows(BOX, "contiguous")
    assert RowWriter(observations_of(BOX, "plain"), rows_of(batch), BOX).strategy == strategy


@NEEDS_C
def test_c_write_rows_calls_its_fallback_only_when_the_rows_do_not_fit():
    """The C write_rows: the rows by memcpy (returns None, fallback not called), or fallback()
    called and its result or error returned, with nothing written."""
    write_rows = c_write_rows()
    out = np.zeros((K, 4), np.float32)
    obs = [np.full(4, j, np.float32) for j in range(K)]
    called: list[int] = []

    def fallback() -> str:
        called.append(1)
        return "numpy"

    args = (np.ndarray, np.dtype(np.float32), (4,), out.ctypes.data, out[0].nbytes)
    assert write_rows(obs, *args, fallback) is None
    assert called == [] and out.tolist() == [[j] * 4 for j in range(K)]
    out[:] = 0
    obs[2] = obs[2].astype(np.float64)
    assert write_rows(obs, *args, fallback) == "numpy"
    assert called == [1] and not out.any()

    def refuse() -> None:
        raise ValueError("does not fit")

    with pytest.raises(ValueError, match="does not fit"):
        write_rows(obs, *args, refuse)


@NEEDS_C
def test_a_groups_step_writes_its_rows_in_c():
    """A serial group of CartPoles writes its rows with the C copy at each step (a writer
    that silently stopped choosing it, or a C call that stopped copying, fails here); with
    write_rows turned off, its Python twin (the joined bytes) writes the same rows."""
    envs = envfleet.make("CartPole-v1", 4, backend="serial")
    saved = envfleet._core.native.disabled
    envfleet._core.native.disabled = frozenset({"write_rows"})
    try:
        twin = envfleet.make("CartPole-v1", 4, backend="serial")
    finally:
        envfleet._core.native.disabled = saved
    try:
        assert [w.strategy for w in envs._backend.transport.groups[0]._writers] == ["c"]
        assert [w.strategy for w in twin._backend.transport.groups[0]._writers] == ["joined"]
        assert_same(envs.reset(seed=0), twin.reset(seed=0))
        actions = np.zeros(4, dtype=np.int64)
        for _ in range(5):
            before = c_writes()
            got = envs.step(actions)
            assert c_writes() - before == 1
            assert_same(got, twin.step(actions))
            assert c_writes() - before == 1
    finally:
        envs.close()
        twin.close()
