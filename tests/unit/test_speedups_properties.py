"""Each C function of envfleet._core._speedups against its Python twin, on random inputs.

The Python implementation is the reference. For each function, two vector envs of the same
scripted envs are made once: one with the C function, one with its Python twin (named in
``envfleet._core.native.disabled``, or ``envfleet._core.native.speedups = None``, while it is made;
forked workers inherit that). Each example gives both the same random script (rewards of
many types and values, NaN included, numpy scalars, bools and ints as done flags,
observations of random dtypes, shapes, contiguity and array subclasses, results in other
containers or of the wrong length, env exceptions) and asserts the same results, bit for bit,
or the same error; and that the C side really ran the function (its counter advanced).

- ``write_results``, ``write_rows``: the serial backend, the one function off on one side.
- ``full_round``, ``serve_steps``: the processes backend with the driver's block and a worker
  each holding envs, every C function off on one side.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import gymnasium as gym
import numpy as np
import pytest
from gymnasium import spaces
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import envfleet
import envfleet._core.native
from tests.helpers import assert_same

NUM_ENVS = 4
MAX_STEPS = 5

pytestmark = pytest.mark.skipif(
    envfleet._core.native.speedups is None, reason="envfleet._core._speedups is not built here"
)


class ScriptedEnv(gym.Env):
    """Each step returns the next entry of ``script`` (set by the test), in its form:
    ``("ok" | "list" | "short" | "long", (obs, reward, terminated, truncated, info))`` or
    ``("raise", message)``. Without a script it steps with zeros."""

    observation_space = spaces.Box(-np.inf, np.inf, (3,), np.float32)
    action_space = spaces.Discrete(2)

    def __init__(self, env_index: int = 0):
        self.env_index = env_index
        self.script: list[tuple[str, Any]] = []
        self._t = 0

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        self._t = 0
        return np.full(3, self.env_index, np.float32), {}

    def step(self, action: Any):
        if not self.script:
            return np.zeros(3, np.float32), 0.0, False, False, {}
        kind, values = self.script[self._t % len(self.script)]
        self._t += 1
        if kind == "raise":
            raise RuntimeError(f"{values} (env {self.env_index}, action {action})")
        if kind == "list":
            return list(values)
        if kind == "short":
            return values[:4]
        if kind == "long":
            return (*values, None)
        return values


# -- strategies ------------------------------------------------------------------------------

rewards = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.floats(width=32).map(np.float32),
    st.floats(width=16).map(np.float16),
    st.floats().map(np.float64),
    st.integers(-(2**70), 2**70),
    st.integers(-(2**63), 2**63 - 1).map(np.int64),
    st.booleans(),
    st.booleans().map(np.bool_),
    st.sampled_from([None, "abc", np.array(1.25)]),
)
flags = st.one_of(
    st.booleans(),
    st.booleans().map(np.bool_),
    st.integers(0, 2),
    st.sampled_from([0.0, 1.0, np.int8(2), np.array(True), None]),
)
DTYPES = ["float32", "float64", "float16", "int8", "uint8", "int64", "bool"]
SHAPES = [(3,), (3,), (3,), (2,), (1, 3), (3, 1)]


class SubArray(np.ndarray):
    """An ndarray subclass: numpy writes it, the C row write leaves it to numpy."""


@st.composite
def observations(draw: st.DrawFn) -> np.ndarray:
    dtype = np.dtype(draw(st.sampled_from(DTYPES)))
    shape = draw(st.sampled_from(SHAPES))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    values = rng.uniform(-100.0, 100.0, (2, *shape))
    if draw(st.booleans()):
        values[0, ...] = np.nan  # NaN casts to integer dtypes as numpy decides
    with np.errstate(invalid="ignore"):
        full = values.astype(dtype) if dtype != np.bool_ else values > 0
    # Row 0 of a (2, ...) array is C-contiguous; a column of its transpose is not.
    obs = full[0] if draw(st.booleans()) else np.ascontiguousarray(full.T)[..., 0].T
    return obs.view(SubArray) if draw(st.integers(0, 4)) == 0 else obs


infos = st.one_of(
    st.just({}), st.dictionaries(st.sampled_from(["a", "b"]), st.integers(-3, 3), max_size=2)
)
entries = st.one_of(
    st.tuples(
        st.sampled_from(["ok", "ok", "ok", "list", "short", "long"]),
        st.tuples(observations(), rewards, flags, flags, infos),
    ),
    st.tuples(st.just("raise"), st.sampled_from(["boom", "bang"])),
)


def float32_row(seed: int, contiguous: bool) -> np.ndarray:
    """A float32 observation of the space's shape, C-contiguous or a strided column."""
    column = np.random.default_rng(seed).random((3, 2), np.float32)[:, 0]
    return np.ascontiguousarray(column) if contiguous else column


# The values the C writes take over (plain floats, ints, bools, numpy.float32/float64 rewards;
# bool and numpy.bool_ flags; exact, C-contiguous float32 rows of the space's shape).
plain_entries = st.tuples(
    st.just("ok"),
    st.tuples(
        st.builds(float32_row, st.integers(0, 2**32), st.booleans()),
        st.one_of(
            st.floats(),
            st.integers(-(2**70), 2**70),
            st.booleans(),
            st.floats(width=32).map(np.float32),
            st.floats().map(np.float64),
        ),
        st.one_of(st.booleans(), st.booleans().map(np.bool_)),
        st.one_of(st.booleans(), st.booleans().map(np.bool_)),
        infos,
    ),
)


def script_of(entry: st.SearchStrategy[Any]) -> st.SearchStrategy[list[list[Any]]]:
    per_env = st.lists(entry, min_size=1, max_size=3)
    return st.lists(per_env, min_size=NUM_ENVS, max_size=NUM_ENVS)


scripts = st.one_of(script_of(plain_entries), script_of(entries))


# -- the pair of vector envs -----------------------------------------------------------------


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[Any, Any]]:
    """(C path, Python path): processes, the driver's block and one worker, spinning long
    enough that workers catch their requests in the C loop."""
    kwargs: dict[str, Any] = {
        "backend": envfleet.Processes(driver_envs=2, spin_s=0.01),
        "num_workers": 1,
    }
    fast = envfleet.make(ScriptedEnv, NUM_ENVS, **kwargs)
    saved = envfleet._core.native.speedups
    envfleet._core.native.speedups = None
    try:
        slow = envfleet.make(ScriptedEnv, NUM_ENVS, **kwargs)
    finally:
        envfleet._core.native.speedups = saved
    yield fast, slow
    fast.close(terminate=True)
    slow.close(terminate=True)


@pytest.fixture(scope="module")
def serial_pairs() -> Iterator[dict[str, tuple[Any, Any]]]:
    """For each EnvGroup write in C: (with it, without it), on the serial backend."""
    pairs = {}
    for name in ("write_results", "write_rows"):
        fast = envfleet.make(ScriptedEnv, NUM_ENVS, backend="serial")
        saved = envfleet._core.native.disabled
        envfleet._core.native.disabled = frozenset({name})
        try:
            pairs[name] = fast, envfleet.make(ScriptedEnv, NUM_ENVS, backend="serial")
        finally:
            envfleet._core.native.disabled = saved
    yield pairs
    for pair in pairs.values():
        for envs in pair:
            envs.close()


def outcome(call: Any) -> tuple[str, Any]:
    """What a call returned, or the error it raised, in a comparable form."""
    try:
        return "returned", call()
    except envfleet.EnvError as exc:
        cause = exc.__cause__
        return "raised", (type(exc), exc.env_index, str(exc), type(cause), str(cause))


def counters() -> dict[str, int]:
    assert envfleet._core.native.speedups is not None
    calls: dict[str, int] = envfleet._core.native.speedups.counters()
    return calls


def run_both(pair: tuple[Any, Any], script: list[Any], steps: int, actions: int) -> int:
    """Reset and step both vector envs of ``pair`` alike, asserting the same outcomes; the
    number of steps that returned."""
    fast, slow = pair
    for envs in pair:
        envs.set_attr("script", script)
    assert_same(fast.reset(seed=3), slow.reset(seed=3), "reset")
    batch = np.array([(actions >> i) & 1 for i in range(NUM_ENVS)], dtype=np.int64)
    for t in range(steps):
        got, want = outcome(lambda: fast.step(batch)), outcome(lambda: slow.step(batch))
        assert_same(got, want, f"step {t}")
        if got[0] == "raised":
            return t
    return steps


PROPERTIES = settings(
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@pytest.mark.parametrize("name", ["write_results", "write_rows"])
@settings(PROPERTIES, max_examples=150)
@given(script=scripts, steps=st.integers(1, MAX_STEPS), actions=st.integers(0, 2**NUM_ENVS - 1))
def test_envgroup_writes_match_python(serial_pairs, name, script, steps, actions):
    before = counters()[name]
    run_both(serial_pairs[name], script, steps, actions)
    plain = all(kind == "ok" and is_plain(values) for env in script for kind, values in env)
    if plain:  # the C function wrote every step (its counter counts the writes it did)
        assert counters()[name] - before == steps + (name == "write_rows"), f"{name} in C"


def is_plain(values: tuple[Any, ...]) -> bool:
    obs, reward, terminated, truncated, _ = values
    return (
        type(obs) is np.ndarray
        and obs.dtype == np.float32
        and obs.shape == (3,)
        and obs.flags.c_contiguous
        and type(reward) in (float, int, bool, np.float32, np.float64)
        and not (type(reward) is int and abs(reward) > 2**1023)
        and all(type(f) in (bool, np.bool_) for f in (terminated, truncated))
    )


@settings(PROPERTIES, max_examples=40)
@given(script=scripts, steps=st.integers(1, MAX_STEPS), actions=st.integers(0, 2**NUM_ENVS - 1))
def test_processes_full_round_and_worker_loop_match_python(pair, script, steps, actions):
    before = counters()["full_round"]
    run_both(pair, script, steps, actions)
    assert counters()["full_round"] > before, "the driver's C step round did not run"
