"""Replay: what each env keeps to be rebuilt at a failure, and running it again in one process.

An :class:`EnvGroup <envfleet._core.envgroup.EnvGroup>` writes every step's actions into an
:class:`ActionLog` (a ring of its last ``replay_steps`` steps) and, at each reset of an env,
how that reset began: the seed and options of a ``reset``, or the env's ``np_random`` state
just before an autoreset's ``reset()`` (:func:`reset_start`). The log lives in memory the
driver can read after the worker is gone (a processes worker's is a file the driver holds:
a segfault or a SIGKILL leaves it readable), so an :class:`~envfleet.EnvError`, an
:class:`~envfleet.EnvCrashedError` and a :class:`~envfleet.StepTimeoutError` carry a
:class:`Replay`: the factory of each env concerned, its episode's start and its actions
since, up to the failing one. :func:`run_replay` builds the envs in this process and steps
them to the failure, in the order their worker stepped them; :func:`watch_replay` runs it in
a child process and reports the call that raised, died or hung (``envfleet replay``).

The same record brings envs back to where they were in a new worker: a recycled worker's
(:func:`restore_envs`, ``envfleet.Recycle``) and a resumed vector env's (:class:`Snapshot`).

The record costs one copy of the group's action rows per step; its memory is
``replay_steps`` times one step's action rows per worker (plus ``SLOT_BYTES`` per env).
"""

from __future__ import annotations

import contextlib
import copy
import faulthandler
import functools
import io
import mmap
import os
import pickle
import select
import signal
import struct
import subprocess
import sys
import time
import traceback
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import cloudpickle
import gymnasium
import numpy as np
from gymnasium.vector.utils import batch_space, concatenate, create_empty_array, iterate

from envfleet._core import native as _native
from envfleet._core.buffers import Carver, side_leaves
from envfleet._core.errors import ConfigError, EnvfleetError, describe_exitcode
from envfleet._core.trees import tree_row

__all__ = [
    "MAGIC",
    "REPLAY_STEPS",
    "SLOT_BYTES",
    "VERSION",
    "ActionLog",
    "EnvRecording",
    "Replay",
    "ReplayFileError",
    "ReplayOutcome",
    "Snapshot",
    "load_replay",
    "file_log",
    "generator_holders",
    "new_log",
    "read_head",
    "read_log",
    "recording_of",
    "replays_of",
    "pcg64_bytes",
    "reset_start",
    "StartReader",
    "unpack_start",
    "restore_envs",
    "catch_up_envs",
    "env_state",
    "load_state",
    "log_before_step",
    "group_recordings",
    "run_replay",
    "watch_replay",
]

REPLAY_STEPS = 1000  # make()'s default replay_steps: the steps per env kept for a replay
SLOT_BYTES = 16 << 10  # per env, the most bytes of its pickled episode start (ALE's: 14 KB)
MAGIC = b"envfleet-replay\n"  # the first bytes of a replay file
VERSION = 1  # the replay file format's version, after MAGIC

_HEADER_WORDS = 5  # actions written (n), capacity, envs (K), slot bytes, episodes begun
_N = 0
_EPISODES = 4


class ReplayFileError(EnvfleetError, ValueError):
    """A file that is not a replay this envfleet can read: another file, or another version."""


# The attributes followed from an env to the objects that may hold its random generators:
# gymnasium's wrapper chain (env, unwrapped) and envfleet's PettingZoo adapter (par_env, and
# PettingZoo's conversion wrappers: aec_env, env, unwrapped).
_LINKS = ("unwrapped", "env", "par_env", "aec_env")
_GENERATORS = ("_np_random", "np_random")  # as instance attributes, never a property's


def generator_holders(env: Any) -> list[tuple[Any, str]]:
    """The objects that may hold an env's generators, each once, in the order
    :func:`_generators` looks at them (depth first along :data:`_LINKS`, from the env, no
    deeper than 8 links), with the path prefix of their attributes (``""``, ``"unwrapped."``,
    ``"env.env."``...)."""
    found: list[tuple[Any, str]] = []
    seen: set[int] = set()

    def walk(obj: Any, path: tuple[str, ...]) -> None:
        if id(obj) in seen or len(path) > 8:
            return
        seen.add(id(obj))
        found.append((obj, "".join(f"{link}." for link in path)))
        for link in _LINKS:
            try:
                nxt = getattr(obj, link, None)
            except Exception:  # a property that raises
                continue
            if nxt is not None and nxt is not obj:
                walk(nxt, (*path, link))

    walk(env, ())
    return found


def _static_attribute(cls: type, name: str) -> tuple[bool, Any]:
    """Whether ``cls`` (its MRO) defines ``name``, and what, read from the classes' own
    dicts: nothing runs."""
    for klass in cls.__mro__:
        if name in vars(klass):
            return True, vars(klass)[name]
    return False, None


def _generator_slots(holders: list[tuple[Any, str]]) -> list[tuple[Any, str, str, bool]]:
    """Where :func:`_generators` looks, per holder and name in :data:`_GENERATORS`:
    ``(holder, path, name, by_dict)``, skipping the names a holder's class makes a data
    descriptor (a property: gymnasium's ``np_random``, a wrapper's ``_np_random``), which no
    instance attribute can stand behind.

    An instance attribute is read with ``getattr`` (it comes before the class's plain
    attribute or method of that name, which is not a generator), never through the instance's
    ``__dict__``: on CPython 3.11 reading ``obj.__dict__`` turns the object's inline attribute
    values into a dict for good, and every attribute load in its methods (an env's
    ``self.state``, a wrapper's ``self.env``) then takes the slow, unspecialized path, a cost
    that shows on a CartPole step (benchmarks/README.md, the replay record's cost). Only a
    class that computes attributes (``__getattr__`` or its own ``__getattribute__``:
    PettingZoo's wrappers) is read through ``__dict__`` (``by_dict``), so that nothing of it
    runs."""
    slots = []
    for obj, prefix in holders:
        cls = type(obj)
        computes = (
            _static_attribute(cls, "__getattr__")[0]
            or _static_attribute(cls, "__getattribute__")[1] is not object.__getattribute__
        )
        if computes and getattr(obj, "__dict__", None) is None:
            continue
        for name in _GENERATORS:
            defined, attribute = _static_attribute(cls, name)
            descriptor = type(attribute)
            if defined and (hasattr(descriptor, "__set__") or hasattr(descriptor, "__delete__")):
                continue
            # A generator kept on the class is not the instance's: read the instance's dict.
            by_dict = computes or isinstance(attribute, np.random.Generator)
            slots.append((obj, prefix + name, name, by_dict))
    return slots


def _read_generators(slots: list[tuple[Any, str, str, bool]]) -> dict[str, np.random.Generator]:
    """The generators at ``slots`` (:func:`_generator_slots`) now, each once, by path."""
    found: dict[str, np.random.Generator] = {}
    for obj, path, name, by_dict in slots:
        generator = obj.__dict__.get(name) if by_dict else getattr(obj, name, None)
        if isinstance(generator, np.random.Generator):
            # Asked only from the second generator on: most envs keep one (an autoreset's
            # start reads them, on the step path).
            if found and any(generator is g for g in found.values()):
                continue
            found[path] = generator
    return found


def _generators(
    env: Any, holders: list[tuple[Any, str]] | None = None
) -> dict[str, np.random.Generator]:
    """Every ``numpy`` generator an env keeps in an ``np_random`` (or ``_np_random``)
    attribute of itself or of what it wraps (:data:`_LINKS`), by its path from the env
    (``"unwrapped._np_random"``; a PettingZoo env's ``"unwrapped.par_env.aec_env.unwrapped
    .np_random"``); each generator once, at the first path found; an instance attribute,
    never a property's value (:func:`_generator_slots`). ``holders``: the env's
    :func:`generator_holders`, found before (an env's wrappers stay the same objects for its
    life, while its generators are replaced: a seeded reset makes a new one), else found
    now."""
    if holders is None:
        holders = generator_holders(env)
    return _read_generators(_generator_slots(holders))


# A packed episode start (StartReader.packed) begins with these bytes; a pickle (protocol 2 and
# later) begins with 0x80. Then the pickled tuple of the generators' paths, its length first
# (uint32), then each generator's pcg64_bytes in that order.
_PACKED = b"\xffPCG"
_PCG64_BYTES = 40


def pcg64_bytes(bit_generator: np.random.PCG64) -> bytes:
    """A PCG64 bit generator's state as 40 bytes: its 128-bit state and increment
    (little-endian), ``has_uint32`` (int32) and ``uinteger`` (uint32): the Python twin of
    ``_speedups.pcg64_raw``, which copies them from the generator's memory. The inverse of
    :func:`_pcg64_state`.

    Example::

        raw = pcg64_bytes(np.random.default_rng(0).bit_generator)  # len(raw) == 40
    """
    state = bit_generator.state
    return (
        state["state"]["state"].to_bytes(16, "little")
        + state["state"]["inc"].to_bytes(16, "little")
        + struct.pack("<iI", state["has_uint32"], state["uinteger"])
    )


def _pcg64_state(raw: bytes) -> dict[str, Any]:
    """The ``bit_generator.state`` dict of :func:`pcg64_bytes`'s 40 bytes."""
    has_uint32, uinteger = struct.unpack_from("<iI", raw, 32)
    return {
        "bit_generator": "PCG64",
        "state": {
            "state": int.from_bytes(raw[:16], "little"),
            "inc": int.from_bytes(raw[16:32], "little"),
        },
        "has_uint32": has_uint32,
        "uinteger": uinteger,
    }


_pcg64_c_agrees: bool | None = None  # the C copy gave the twin's bytes (None: not checked yet)
_NUMPY_PCG64_LAYOUT = np.lib.NumpyVersion(np.__version__) < "3.0.0"


def _pcg64_read() -> tuple[Callable[[Any], bytes], bool]:
    """How to read :func:`pcg64_bytes`: ``(read, by_address)``: the C copy
    (``_speedups.pcg64_raw``, given the bit generator's ``ctypes.state_address``) where it runs
    here and gives the twin's bytes (checked once per process, on a generator with half a
    64-bit draw buffered), else the twin (given the bit generator). Looked up when a
    :class:`StartReader` is made."""
    global _pcg64_c_agrees
    raw = _native.function("pcg64_raw")
    # The C copy follows numpy's pcg64_state as numpy 1.17 to 2.x lay it out: a numpy of
    # another major version could lay it out otherwise (even the check could then read a
    # wild pointer), so it gets the twin.
    if raw is None or not _NUMPY_PCG64_LAYOUT:
        return pcg64_bytes, False
    if _pcg64_c_agrees is None:
        probe = np.random.PCG64(12345)
        np.random.Generator(probe).integers(0, 2**32, dtype=np.uint32)  # has_uint32 = 1
        _pcg64_c_agrees = raw(probe.ctypes.state_address) == pcg64_bytes(probe)
    return (raw, True) if _pcg64_c_agrees else (pcg64_bytes, False)


def unpack_start(blob: bytes) -> tuple[Any, ...]:
    """An episode start as :class:`ActionLog` keeps it (a pickle, or
    :meth:`StartReader.packed`'s form) as :func:`reset_start` gives it.

    Raises:
        pickle.UnpicklingError, struct.error: ``blob`` is neither.
    """
    if not blob.startswith(_PACKED):
        return cast(tuple[Any, ...], pickle.loads(blob))
    at = len(_PACKED)
    (size,) = struct.unpack_from("<I", blob, at)
    at += 4
    paths = pickle.loads(blob[at : at + size])
    at += size
    states = {}
    for path in paths:
        states[path] = _pcg64_state(blob[at : at + _PCG64_BYTES])
        at += _PCG64_BYTES
    return ("rng", states, None, None)


class StartReader:
    """:func:`reset_start` of one env, what stays the same over the env's life found once:
    where its generators may be (:func:`_generator_slots`, read again at every call, since a
    seeded reset replaces the generator) and its ``unwrapped`` env. An EnvGroup keeps one per
    env and calls :meth:`packed` at every episode start, so it is on the step path (an
    episode of CartPole is about 20 steps): the same start as :func:`reset_start`'s, with
    less work.

    Example::

        read = StartReader(env)
        start = read()            # == reset_start(env)
        blob = read.packed()      # unpack_start(blob) == start
        env.reset()
    """

    __slots__ = (
        "_by_address",
        "_key",
        "_one",
        "_one_generator",
        "_plan",
        "_read",
        "_slots",
        "_unwrapped",
        "env",
    )

    def __init__(self, env: gymnasium.Env[Any, Any]):
        self.env = env
        self._slots = _generator_slots(generator_holders(env))
        self._unwrapped: Any = env.unwrapped
        self._read, self._by_address = _pcg64_read()
        # packed()'s plan for the generators it last found (their paths and objects: a
        # seeded reset replaces them, an autoreset does not): the paths' prefix and what
        # _read is given per generator, or None where one is not a PCG64.
        self._key: dict[str, np.random.Generator] | None = None
        self._plan: tuple[bytes, list[Any]] | None = None
        # Most envs have one place a generator may be (gymnasium's: the unwrapped env's
        # _np_random): there packed() checks the planned generator is still the one there
        # without building the dict of generators.
        slots = self._slots
        self._one = (slots[0][0], slots[0][2]) if len(slots) == 1 and not slots[0][3] else None
        self._one_generator: np.random.Generator | None = None

    def __call__(self, options: Any = None) -> tuple[Any, ...]:
        return _start(self._unwrapped, _read_generators(self._slots), options)

    def packed(self, options: Any = None) -> bytes:
        """The start as :class:`ActionLog` keeps it (:func:`unpack_start` reads it back).

        Where every generator is a PCG64 (gymnasium's), the env keeps no ALE state and there
        are no options (an autoreset's start), it is each generator's :func:`pcg64_bytes`
        behind the paths' pickle, both planned once per set of generators (the C copy reads
        a state without building ``bit_generator.state``'s dict; ``benchmarks/README.md``
        has its cost). Else the pickled start.
        """
        one, plan, generator = self._one, self._plan, self._one_generator
        if (
            one is not None
            and generator is not None
            and plan is not None
            and options is None
            and getattr(one[0], one[1], None) is generator
            and getattr(self._unwrapped, "ale", None) is None
        ):
            return plan[0] + self._read(plan[1][0])
        generators = _read_generators(self._slots)
        if options is None and getattr(self._unwrapped, "ale", None) is None:
            # The same paths and the same objects (a generator compares by identity).
            if generators != self._key:
                self._key, self._plan = generators, self._planned(generators)
                self._one_generator = (
                    next(iter(generators.values())) if len(generators) == 1 else None
                )
            if self._plan is not None:
                prefix, sources = self._plan
                return prefix + b"".join(map(self._read, sources))
        start = _start(self._unwrapped, generators, options)
        return pickle.dumps(start, pickle.HIGHEST_PROTOCOL)

    def _planned(
        self, generators: dict[str, np.random.Generator]
    ) -> tuple[bytes, list[Any]] | None:
        """:meth:`packed`'s plan for ``generators``: the packed form's prefix (the paths'
        pickle) and each generator's source for ``_read``, or None where one is not a PCG64."""
        sources = []
        for generator in generators.values():
            bit_generator = generator.bit_generator
            if type(bit_generator) is not np.random.PCG64:
                return None
            sources.append(
                bit_generator.ctypes.state_address if self._by_address else bit_generator
            )
        names = pickle.dumps(tuple(generators), pickle.HIGHEST_PROTOCOL)
        return _PACKED + struct.pack("<I", len(names)) + names, sources


def _start(
    unwrapped: Any, generators: dict[str, np.random.Generator], options: Any
) -> tuple[Any, ...]:
    state = {path: g.bit_generator.state for path, g in generators.items()}
    native = None
    ale = getattr(unwrapped, "ale", None)
    if ale is not None and hasattr(ale, "cloneState"):
        with contextlib.suppress(Exception):
            native = ("ale", pickle.dumps(ale.cloneState(include_rng=True)))
    return ("rng", state, native, options)


def _set_generator(env: Any, path: str, state: dict[str, Any]) -> None:
    """Give the env a generator in the state ``state`` at ``path`` (:func:`_generators`)."""
    *links, name = path.split(".")
    obj = env
    for link in links:
        obj = getattr(obj, link)
    bit_generator = getattr(np.random, state["bit_generator"])()
    bit_generator.state = state
    setattr(obj, name, np.random.Generator(bit_generator))


def reset_start(
    env: gymnasium.Env[Any, Any], options: Any = None, holders: list[tuple[Any, str]] | None = None
) -> tuple[Any, ...]:
    """How a ``reset`` without a seed (an autoreset's, or one given ``seed=None``) begins:
    ``("rng", states, native, options)``: the state of every ``numpy`` generator the env
    keeps, by path (its ``np_random``; a PettingZoo env's own, under envfleet's adapter:
    :func:`_generators`), the random state the env keeps elsewhere where the field has an
    API for it (an Atari env's ALE state with its generator,
    ``ale.cloneState(include_rng=True)``, pickled; else ``None``), and the reset's options.
    ``holders``: the env's :func:`generator_holders`, kept by the caller from an earlier call (else
    found now: most of this function's cost)."""
    return _start(env.unwrapped, _generators(env, holders), options)


# -- checkpoints: an env's whole state mid-episode ---------------------------------------------

# The native objects an env's Python state refers to, by the unwrapped env's attribute: kept
# out of a checkpoint's pickle (they do not pickle), their state taken through their own API.
_NATIVE = ("ale", "model", "data")


def _layers(env: Any) -> list[Any]:
    """The wrapper chain, outermost first, down to the unwrapped env (``.env`` links)."""
    layers = [env]
    while isinstance(getattr(layers[-1], "env", None), gymnasium.Env) and len(layers) < 64:
        layers.append(layers[-1].env)
    return layers


class _StatePickler(cloudpickle.Pickler):
    """Pickles an env's layers' attributes, each layer itself and each native object by
    reference (``persistent_id``): a checkpoint is loaded into another env of the same
    factory, in place."""

    def __init__(self, out: Any, refs: dict[int, tuple[str, Any]]):
        super().__init__(out, protocol=pickle.HIGHEST_PROTOCOL)
        self.refs = refs

    def persistent_id(self, obj: Any) -> Any:
        ref = self.refs.get(id(obj))
        return None if ref is None else ref[0]


def _refs(layers: list[Any]) -> dict[int, tuple[str, Any]]:
    unwrapped = layers[-1]
    refs = {id(layer): (f"layer:{i}", layer) for i, layer in enumerate(layers)}
    for name in _NATIVE:
        obj = vars(unwrapped).get(name)
        if obj is not None:
            refs[id(obj)] = (f"native:{name}", obj)
    return refs


def _native_state(unwrapped: Any) -> tuple[str, Any] | None:
    """What the unwrapped env's native simulator holds, through its own API: ALE's state with
    its generator (``cloneState(include_rng=True)``), MuJoCo's integration state
    (``mj_getState``: time, ``qpos``, ``qvel``, actuators, warm start, controls...)."""
    ale = vars(unwrapped).get("ale")
    if ale is not None and hasattr(ale, "cloneState"):
        return ("ale", pickle.dumps(ale.cloneState(include_rng=True)))
    model, data = vars(unwrapped).get("model"), vars(unwrapped).get("data")
    if model is not None and data is not None and type(model).__module__.startswith("mujoco"):
        import mujoco

        spec = mujoco.mjtState.mjSTATE_INTEGRATION
        state = np.empty(mujoco.mj_stateSize(model, spec), dtype=np.float64)
        mujoco.mj_getState(model, data, state, spec)
        return ("mujoco", state)
    return None


def _set_native(unwrapped: Any, native: tuple[str, Any] | None) -> None:
    if native is None:
        return
    if native[0] == "ale":
        unwrapped.ale.restoreState(pickle.loads(native[1]))
    else:
        import mujoco

        spec = mujoco.mjtState.mjSTATE_INTEGRATION
        mujoco.mj_setState(unwrapped.model, unwrapped.data, native[1], spec)
        mujoco.mj_forward(unwrapped.model, unwrapped.data)


def env_state(env: gymnasium.Env[Any, Any]) -> bytes | None:
    """A checkpoint of ``env`` now, mid-episode: every layer's attributes (the wrapper stack's:
    TimeLimit's counter, frame stacks, normalisers' statistics; the env's own, its generators
    included), pickled with the layers and native objects by reference, and the native
    simulator's state through its API (:func:`_native_state`); compressed. ``None`` where it
    cannot be taken: an attribute that does not pickle (Box2D's world, a window), or a native
    object this module has no API for. Loaded by :func:`load_state` into an env of the same
    factory. Not a pickle of the env: gymnasium's ``EzPickle`` envs (LunarLander, MuJoCo,
    ALE) pickle as their constructor arguments, a fresh env."""
    layers = _layers(env)
    unwrapped = layers[-1]
    refs = _refs(layers)
    native_names = [n for n in _NATIVE if vars(unwrapped).get(n) is not None]
    try:
        native = _native_state(unwrapped)
        if native_names and native is None:
            return None
        parts = [
            {k: v for k, v in vars(layer).items() if not (k == "env" and i < len(layers) - 1)}
            for i, layer in enumerate(layers)
        ]
        out = io.BytesIO()
        _StatePickler(out, refs).dump((len(layers), parts, native))
    except Exception:
        return None
    return zlib.compress(out.getvalue(), 1)


def load_state(env: gymnasium.Env[Any, Any], blob: bytes) -> None:
    """Bring ``env`` (built by the same factory as the checkpointed one) to the state of
    :func:`env_state`'s ``blob``, in place.

    Raises:
        ValueError: ``env``'s wrapper stack is not the checkpointed one's.
    """
    layers = _layers(env)
    refs = {name: obj for name, obj in _refs(layers).values()}

    class _Unpickler(pickle.Unpickler):
        def persistent_load(self, pid: Any) -> Any:
            return refs[pid]

    count, parts, native = _Unpickler(io.BytesIO(zlib.decompress(blob))).load()
    if count != len(layers):
        raise ValueError(f"a checkpoint of {count} layers loaded into an env of {len(layers)}")
    for layer, part in zip(layers, parts, strict=True):
        vars(layer).update(part)
    _set_native(layers[-1], native)


def _begin(env: gymnasium.Env[Any, Any], start: tuple[Any, ...]) -> Any:
    """Reset ``env`` as the recorded episode began (or load its checkpoint: ``("state",
    blob)``); returns ``reset``'s result (``None`` for a checkpoint)."""
    if start[0] == "seed":
        return env.reset(seed=start[1], options=start[2])
    if start[0] == "state":
        load_state(env, start[1])
        return None
    states, native, options = start[1], start[2], start[3]
    unwrapped: Any = env.unwrapped
    for path, state in states.items():
        _set_generator(env, path, state)
    if native is not None and native[0] == "ale":
        unwrapped.ale.restoreState(pickle.loads(native[1]))
    return env.reset(options=options)


class ActionLog:
    """One EnvGroup's record: its last ``capacity`` steps' action rows and each env's start.

    Laid over ``memory`` (``uint8``, :meth:`nbytes` long; a new array when ``None``): a
    header, per env the index of its episode's first action and its pickled start, then the
    ring ``[capacity, K, *action]`` (as ``create_empty_array(batch_space(space, K), capacity)``).
    An action space with leaves of no fixed size (Text, Sequence, Graph) keeps its ring in a
    Python list instead, which dies with its process.
    """

    def __init__(
        self,
        action_space: gymnasium.Space[Any],
        size: int,
        capacity: int,
        memory: np.ndarray | None = None,
    ):
        self.size, self.capacity = size, capacity
        if memory is None:
            memory = np.zeros(self.nbytes(action_space, size, capacity), dtype=np.uint8)
        self._single_space = action_space
        self._batched_space = batch_space(action_space, size)
        self._listed = bool(side_leaves(action_space))
        self._list: list[Any] = []
        parts = _lay_out(Carver(memory), self._batched_space, size, capacity, self._listed)
        self.header, self.starts, self.start_bytes, self.slots, self.ring = parts[:5]
        # Each env's episode before its last (its start index, start bytes and slot): what a
        # worker that died in the very step an env began a new episode brings that env back
        # from (before_step).
        self.prev_starts, self.prev_start_bytes, self.prev_slots = parts[5:]
        # The same words as memoryviews: a step's and an episode start's writes go through
        # these (an item write of a memoryview costs a fraction of a numpy one's).
        self._header = self.header.data
        # The header's words as a memoryview: ``words[0]`` is the group steps recorded (what
        # a group reads after each step to see whether a checkpoint is due).
        self.words = self._header
        self._starts = self.starts.data
        self._start_bytes = self.start_bytes.data
        self._slots = self.slots.data.cast("B")
        self._prev_starts = self.prev_starts.data
        self._prev_start_bytes = self.prev_start_bytes.data
        self._prev_slots = self.prev_slots.data.cast("B")
        # record()'s byte copy: the array it was last given, when a row of the ring is the
        # same bytes (dtype, shape, both contiguous), with their memoryviews.
        self._source: Any = None
        self._source_bytes: Any = None
        self._ring_bytes: Any = None
        self._row_bytes = 0

    @staticmethod
    def nbytes(action_space: gymnasium.Space[Any], size: int, capacity: int) -> int:
        carve = Carver(None)
        listed = bool(side_leaves(action_space))
        _lay_out(carve, batch_space(action_space, size), size, capacity, listed)
        return carve.offset

    def open(self) -> None:
        """Start a new log over the memory (the writer's side, once)."""
        self.header[:] = (0, self.capacity, self.size, SLOT_BYTES, 0)
        self.start_bytes[:] = -1
        self.prev_start_bytes[:] = -1

    @staticmethod
    def head_nbytes(size: int) -> int:
        """The bytes of a log's header and per-env starts (what :func:`read_head` reads)."""
        carve = Carver(None)
        _lay_out_head(carve, size)
        return carve.offset

    def recordings(self, start: int) -> list[EnvRecording]:
        """Every env's episode so far, in order (``start``: env 0's index in the vector
        env)."""
        return [self.recording(j, start + j) for j in range(self.size)]

    def restore(self, recordings: Sequence[EnvRecording]) -> None:
        """Write the episodes of ``recordings`` (one per env, in order) as if this group had
        run them: the action rows in their steps' order, each env's start at its first
        action (a recycled worker's new group continues the old one's record)."""
        longest = max((len(r.actions) for r in recordings), default=0)
        space = self._single_space
        for t in range(longest):
            row = []
            for j, r in enumerate(recordings):
                k = t - (longest - len(r.actions))
                if k == 0:
                    self.began(j, cast(tuple, r.start))
                # Envs not yet in their episode at this step: any valid action stands in.
                row.append(r.actions[max(k, 0)] if r.actions else space.sample())
            self.record(concatenate(space, row, cast(Any, create_empty_array(space, self.size))))
        for j, r in enumerate(recordings):
            if not r.actions:
                self.began(j, cast(tuple, r.start))

    def recorder(self, actions: Any) -> Callable[[], Any]:
        """:meth:`record` of ``actions`` as a call of no arguments, for a group that hands its
        log the same action buffer every step: in C (``_speedups.log_row``: a byte copy and
        the count) where a row of the ring is that buffer's bytes (the same dtype and shape,
        both C-contiguous), else :meth:`record`. ``actions`` must outlive the call."""
        log_row = _native.function("log_row")
        ring = self.ring
        if (
            log_row is not None
            and not self._listed
            and type(actions) is np.ndarray
            and isinstance(ring, np.ndarray)
            and actions.dtype == ring.dtype
            and actions.shape == ring.shape[1:]
            and actions.flags.c_contiguous
            and ring.flags.c_contiguous
        ):
            return functools.partial(
                log_row,
                self.header.ctypes.data,
                ring.ctypes.data,
                actions.ctypes.data,
                actions.nbytes,
                self.capacity,
            )
        return functools.partial(self.record, actions)

    def record(self, actions: Any) -> None:
        """Keep one step's action rows (the group's batched action)."""
        n = self._header[_N]
        if self._listed:
            if len(self._list) < self.capacity:
                self._list.append(None)
            self._list[n % self.capacity] = copy.deepcopy(
                list(iterate(self._batched_space, actions))
            )
        elif actions is self._source:
            # The same buffer as the last step's (a group's action rows): a byte copy.
            at = (n % self.capacity) * self._row_bytes
            self._ring_bytes[at : at + self._row_bytes] = self._source_bytes
        elif isinstance(actions, np.ndarray):
            self.ring[n % self.capacity] = actions
            ring = self.ring
            if (
                actions.dtype == ring.dtype
                and actions.shape == ring.shape[1:]
                and actions.flags.c_contiguous
                and ring.flags.c_contiguous
            ):
                self._source, self._source_bytes = actions, actions.data.cast("B")
                self._ring_bytes, self._row_bytes = ring.data.cast("B"), actions.nbytes
        else:
            _write_row(self.ring, n % self.capacity, actions)
        self._header[_N] = n + 1

    def began(self, j: int, start: tuple[Any, ...] | bytes) -> None:
        """Env ``j`` (local) begins an episode at the next action, as ``start`` says (or as
        its bytes, :meth:`StartReader.packed`, say)."""
        if type(start) is bytes:
            blob = start
        else:
            try:
                blob = pickle.dumps(start, pickle.HIGHEST_PROTOCOL)
            except Exception:
                blob = b""
        self._header[_EPISODES] += 1
        kept = self._start_bytes[j]  # the episode before this one, kept (before_step)
        self._prev_starts[j] = self._starts[j]
        self._prev_start_bytes[j] = kept
        at = j * SLOT_BYTES
        if kept > 0:
            self._prev_slots[at : at + kept] = self._slots[at : at + kept]
        self._starts[j] = self._header[_N]
        size = len(blob)
        if 0 < size <= SLOT_BYTES:
            self._slots[at : at + size] = blob
            self._start_bytes[j] = size
        else:
            self._start_bytes[j] = -1

    def rebase(self, j: int, start: tuple[Any, ...]) -> bool:
        """Env ``j`` (local) checkpointed (``start``: ``("state", blob)``,
        :func:`env_state`): its record starts anew at the next action, no episode begun, so
        that it never needs more than ``capacity`` actions. ``False`` (nothing changed) when
        the checkpoint does not fit its slot."""
        blob = pickle.dumps(start, pickle.HIGHEST_PROTOCOL)
        if len(blob) > SLOT_BYTES:
            return False
        episodes = int(self.header[_EPISODES])
        self.began(j, blob)
        self._header[_EPISODES] = episodes  # a checkpoint begins no episode (the recycler's count)
        return True

    def recording(self, j: int, env_index: int) -> EnvRecording:
        """What env ``j`` (local; ``env_index`` in the vector env) did in its episode so far."""
        n, first, length = int(self.header[_N]), int(self.starts[j]), int(self.start_bytes[j])
        return self._recording_of(j, env_index, first, n, length, self.slots)

    def before_step(self, start: int) -> tuple[list[EnvRecording], list[Any]]:
        """Every env's episode as it stood before the group's last step began (``start``: env
        0's index in the vector env), and each env's action of that step: what a worker that
        died or hung inside that step brings its envs back from, to take the step again. An
        env that began a new episode during the step (an autoreset) is given the episode
        before it."""
        n = int(self.header[_N])
        if n <= 0:
            return [], []
        recordings = []
        for j in range(self.size):
            first, length, slots = int(self.starts[j]), int(self.start_bytes[j]), self.slots
            if first == n:  # began during the step: the episode before it
                first, length = int(self.prev_starts[j]), int(self.prev_start_bytes[j])
                slots = self.prev_slots
            recordings.append(self._recording_of(j, start + j, first, n - 1, length, slots))
        i = (n - 1) % self.capacity
        return recordings, [self._row(i, j) for j in range(self.size)]

    def _recording_of(
        self, j: int, env_index: int, first: int, n: int, length: int, slots: np.ndarray
    ) -> EnvRecording:
        """Env ``j``'s episode from action ``first`` up to (not including) action ``n``, its
        start ``length`` bytes of ``slots[j]`` (-1: none kept)."""
        count = n - first
        if length < 0 or count > self.capacity or count < 0:
            why = (
                "its episode began before the record (no reset seen)"
                if length < 0
                else f"its episode is longer than replay_steps={self.capacity}"
            )
            return EnvRecording(env_index, None, [], complete=False, why=why, steps=max(count, 0))
        begun = unpack_start(slots[j, :length].tobytes())
        actions = [self._row(t % self.capacity, j) for t in range(first, n)]
        return EnvRecording(env_index, begun, actions, complete=True, why="", steps=count)

    def _row(self, i: int, j: int) -> Any:
        if self._listed:
            return self._list[i][j]
        return tree_row(_take(self.ring, i), j)


def _lay_out_head(carve: Carver, size: int) -> tuple[np.ndarray, np.ndarray]:
    """A log's header and each env's episode start (the index of its first action): the
    first bytes of every log, all a counter-reader needs (:func:`read_head`)."""
    return carve((_HEADER_WORDS,), np.int64), carve((size,), np.int64)


def _lay_out(
    carve: Carver, batched_space: gymnasium.Space[Any], size: int, capacity: int, listed: bool
) -> tuple[Any, ...]:
    """The views of a log, in the order :class:`ActionLog` lays them: header, starts, each
    start's pickled bytes (-1: none, or too large to keep) and slot, the ring (``None`` for an
    action space kept in a Python list), then the same three of each env's episode before."""
    header, starts = _lay_out_head(carve, size)
    start_bytes = carve((size,), np.int64)
    slots = carve((size, SLOT_BYTES), np.uint8)
    ring = None if listed else create_empty_array(batched_space, capacity, fn=carve)
    prev_starts = carve((size,), np.int64)
    prev_start_bytes = carve((size,), np.int64)
    prev_slots = carve((size, SLOT_BYTES), np.uint8)
    return header, starts, start_bytes, slots, ring, prev_starts, prev_start_bytes, prev_slots


def new_log(action_space: gymnasium.Space[Any], size: int, replay_steps: int) -> ActionLog | None:
    """A group's :class:`ActionLog` in this process's memory, ``None`` with ``replay_steps=0``."""
    return ActionLog(action_space, size, replay_steps) if replay_steps > 0 else None


def file_log(
    path: str | None, action_space: gymnasium.Space[Any], size: int, replay_steps: int
) -> ActionLog | None:
    """A worker's :class:`ActionLog` over the file at ``path`` (made by the driver, which holds
    a descriptor and reads it with :func:`read_log`); the file's name is removed once it is
    open. ``None`` without a path or with ``replay_steps=0``."""
    if path is None or replay_steps <= 0:
        return None
    fd = os.open(path, os.O_RDWR)
    try:
        with contextlib.suppress(OSError):
            os.unlink(path)
        return fd_log(fd, action_space, size, replay_steps)
    finally:
        os.close(fd)


def fd_log(
    fd: int, action_space: gymnasium.Space[Any], size: int, replay_steps: int
) -> ActionLog | None:
    """A worker's :class:`ActionLog` over the open file ``fd`` (sized to it, mapped; ``fd``
    stays the caller's), ``None`` with ``replay_steps=0``."""
    if replay_steps <= 0:
        return None
    nbytes = ActionLog.nbytes(action_space, size, replay_steps)
    os.ftruncate(fd, nbytes)
    memory = mmap.mmap(fd, nbytes)
    return ActionLog(action_space, size, replay_steps, np.frombuffer(memory, dtype=np.uint8))


def read_log(data: bytes, action_space: gymnasium.Space[Any], size: int) -> ActionLog | None:
    """The :class:`ActionLog` a worker wrote (``data``: its file's bytes), ``None`` when it
    wrote none (it never laid out its envs, or keeps no log) or another layout."""
    if len(data) < 8 * _HEADER_WORDS:
        return None
    memory = np.frombuffer(data, dtype=np.uint8)
    _n, capacity, envs, slot, _episodes = (
        int(v) for v in memory[: 8 * _HEADER_WORDS].view(np.int64)
    )
    if envs != size or slot != SLOT_BYTES or capacity <= 0:
        return None
    if len(data) < ActionLog.nbytes(action_space, size, capacity):
        return None
    return ActionLog(action_space, size, capacity, memory)


def log_recordings(
    data: bytes, action_space: gymnasium.Space[Any], start: int, stop: int
) -> list[EnvRecording]:
    """Each env's episode so far (envs ``start`` to ``stop - 1``) from the bytes of the
    action log a worker wrote to its file (:func:`read_log`); none when it wrote none."""
    log = read_log(data, action_space, stop - start)
    return [] if log is None else log.recordings(start)


def log_before_step(
    data: bytes, action_space: gymnasium.Space[Any], start: int, stop: int
) -> tuple[list[EnvRecording], list[Any]]:
    """:meth:`ActionLog.before_step` of the action log a worker wrote to its file (envs
    ``start`` to ``stop - 1``); nothing when it wrote none."""
    log = read_log(data, action_space, stop - start)
    return ([], []) if log is None else log.before_step(start)


def catch_up_envs(
    group: Any, argument: tuple[list[EnvRecording], list[Any], list[bool], list[int]]
) -> Any:
    """A task (``Command.TASK``) run in the group of a worker started in place of one that
    died or hung inside a step: bring every env but the ``lost`` ones (local indices: the env
    the old worker was inside, restarted after this) to where it was before that step, from
    its record (``recordings``: :meth:`ActionLog.before_step`), with its autoreset flag
    (``done``: whether its step before ended its episode), then take the step again with the
    same ``actions`` (one per env), as the old worker would have. Returns the step's info
    events (the group's :meth:`~envfleet._core.envgroup.EnvGroup.step_only`)."""
    recordings, actions, done, lost = argument
    _bring_back(group, recordings, done, lost)
    return group.step_only(actions, [j for j in range(group.size) if j not in lost])


def read_head(data: bytes, size: int) -> tuple[int, int, np.ndarray] | None:
    """From the first :meth:`ActionLog.head_nbytes` bytes of a worker's log: its group steps,
    the episodes its envs began and each env's episode start (the index of its first
    action); ``None`` before the worker opened its log."""
    if len(data) < ActionLog.head_nbytes(size):
        return None
    header, starts = _lay_out_head(Carver(np.frombuffer(data, dtype=np.uint8)), size)
    if int(header[2]) != size:
        return None
    return int(header[_N]), int(header[_EPISODES]), starts.copy()


def restore_envs(group: Any, argument: tuple[list[EnvRecording], list[bool]]) -> None:
    """A task (``Command.TASK``) run in a new group (a recycled worker's, a resumed vector
    env's): bring each env to where it was, by running its episode (``recordings``, one per
    env) from its start, and continue its record; ``done``: per env, whether its last step
    ended its episode (with NEXT_STEP its next step resets it). Nothing is written to the
    batch's rows."""
    recordings, done = argument
    _bring_back(group, recordings, done, ())


def _bring_back(
    group: Any, recordings: list[EnvRecording], done: list[bool], skip: Sequence[int]
) -> None:
    """Run each env of ``group`` but ``skip`` (local indices) through its recorded episode
    from its start (or checkpoint), continue the group's record with ``recordings`` and set
    its autoreset flags (``done``)."""
    for j, (env, r) in enumerate(zip(group.envs, recordings, strict=True)):
        if j not in skip:
            _begin(env, cast(tuple, r.start))
            for action in r.actions:
                env.step(action)
    if group.action_log is not None:
        group.action_log.restore(recordings)
    group.resume_autoreset(done)


def group_recordings(group: Any, argument: Any = None) -> list[EnvRecording]:
    """A task: each env of ``group``'s episode so far (none without an action log)."""
    log = group.action_log
    return [] if log is None else log.recordings(group.start)


def _write_row(ring: Any, i: int, actions: Any) -> None:
    if isinstance(ring, dict):
        for key, leaf in ring.items():
            _write_row(leaf, i, actions[key])
    elif isinstance(ring, tuple):
        for k, leaf in enumerate(ring):
            _write_row(leaf, i, actions[k])
    else:
        ring[i] = actions


def _take(ring: Any, i: int) -> Any:
    if isinstance(ring, dict):
        return {key: _take(leaf, i) for key, leaf in ring.items()}
    if isinstance(ring, tuple):
        return tuple(_take(leaf, i) for leaf in ring)
    return ring[i]


@dataclass
class EnvRecording:
    """One env's episode up to a failure.

    Attributes:
        env_index: the env's index in its vector env.
        start: how the episode began: ``("seed", seed, options)`` (a ``reset``) or
            ``("rng", generator_states, native, options)`` (an autoreset, or a reset
            without a seed: see :func:`reset_start`); ``None`` when not ``complete``.
        actions: every action of the episode, in order, the failing one last.
        complete: whether the record holds the whole episode (``why`` says what is missing).
        steps: the episode's actions up to the failure.
    """

    env_index: int
    start: tuple[Any, ...] | None
    actions: list[Any]
    complete: bool
    why: str
    steps: int


@dataclass
class Replay:
    """What reproduces a failure in one process: ``envfleet.replay(err.replay)``.

    An :class:`~envfleet.EnvError` (raised in ``step`` or ``reset``) carries the failed env's;
    an :class:`~envfleet.EnvCrashedError` and a :class:`~envfleet.StepTimeoutError` carry every
    env of the dead or hung worker (which one did it is not known to the driver), replayed in
    their worker's order. ``err.replay`` is ``None`` where the record died with its worker
    (a Ray actor lost with its node) or ``replay_steps=0``.

    Attributes:
        kind: ``"error"`` (an env raised), ``"crash"`` (its worker died) or ``"hang"``.
        failure: the error's message.
        envs: each env's :class:`EnvRecording`.
        factories: env index -> its zero-argument factory.
        timeout_s: for a hang, the step timeout (seconds) the worker ran past.

    Example::

        try:
            envs.step(actions)
        except envfleet.EnvError as err:
            err.replay.save("failure.replay")  # then: envfleet replay failure.replay

    A replay file holds pickled factories: load only files you made, as ``torch.load`` warns.
    """

    kind: str
    failure: str
    envs: list[EnvRecording]
    factories: dict[int, Callable[[], gymnasium.Env[Any, Any]]] = field(repr=False)
    timeout_s: float | None = None

    @property
    def complete(self) -> bool:
        """Whether every env's episode is recorded whole (a replay can run)."""
        return all(r.complete for r in self.envs)

    def save(self, path: str) -> None:
        """Write one file: :data:`MAGIC`, the format version, then the replay (cloudpickle)."""
        _save(self, path, MAGIC)


def _save(obj: Any, path: str, magic: bytes) -> None:
    out = io.BytesIO()
    out.write(magic)
    out.write(VERSION.to_bytes(2, "little"))
    cloudpickle.dump(obj, out)
    with open(path, "wb") as f:
        f.write(out.getvalue())


def _load(path: str, magic: bytes, cls: type[Any], what: str) -> Any:
    """The ``cls`` saved at ``path`` by :func:`_save`, its header checked first."""
    with open(path, "rb") as f:
        head = f.read(len(magic) + 2)
        if head[: len(magic)] != magic:
            raise ReplayFileError(f"{path} is not an envfleet {what} file (no {what} header)")
        version = int.from_bytes(head[len(magic) :], "little")
        if version != VERSION:
            raise ReplayFileError(
                f"{path} is a {what} file of format version {version}; this envfleet reads "
                f"version {VERSION}"
            )
        obj = pickle.load(f)
    if not isinstance(obj, cls):
        raise ReplayFileError(f"{path} holds a {type(obj).__name__}, not a {cls.__name__}")
    return obj


def load_replay(path: str) -> Replay:
    """The :class:`Replay` saved at ``path``; its header and version are checked before
    anything is unpickled.

    Raises:
        ReplayFileError: ``path`` is not an envfleet replay file, or of another version.
    """
    return cast(Replay, _load(path, MAGIC, Replay, "replay"))


SNAPSHOT_MAGIC = b"envfleet-snapshot\n"  # the first bytes of a snapshot file


@dataclass
class Snapshot:
    """A vector env's state between two steps, from which ``envfleet.make(..., resume=state)``
    continues exactly: ``state = envs.snapshot()``.

    Per env, its episode so far, as a replay holds it (how it began: its seed, or its
    ``np_random`` state at its autoreset and, for an Atari env, ALE's own state; its actions
    since), and whether its last step ended it; the vector env's step count and autoreset
    mode. A resumed vector env (any backend, any worker count) rebuilds each env from the
    factory given to ``make`` and runs its episode again, so that its next ``step`` returns
    what the uninterrupted run would have, bit for bit, for envs whose randomness lives in
    their seed and ``np_random``. It holds no factory: ``make`` is given the env again.

    Attributes:
        num_envs: sub-environments.
        autoreset_mode: the ``AutoresetMode``'s value.
        recordings: per env, its :class:`EnvRecording`.
        done: per env, whether its last step ended its episode.
        steps: the vector env's ``step`` calls so far.
        seeds: per env, its last reset seed (for a restart policy's seeds).
        pool: a first-ready pool's state (``envfleet._front.pool.PoolState``: the results
            waiting for ``recv``, the actions sent to envs not yet stepped); ``None`` for a
            synchronous vector env.

    ``save(path)`` writes it with a header; :meth:`load` checks the header before it
    unpickles. Load only files you made.
    """

    num_envs: int
    autoreset_mode: str
    recordings: list[EnvRecording]
    done: list[bool]
    steps: int
    seeds: list[int | None]
    pool: Any = None

    def save(self, path: str) -> None:
        """Write one file: a header, the format version, then the snapshot (pickled)."""
        _save(self, path, SNAPSHOT_MAGIC)

    @staticmethod
    def check(state: Any, num_envs: int, autoreset_mode: str, pool: bool) -> Snapshot:
        """``state`` when a vector env of ``num_envs`` envs in ``autoreset_mode`` (its value)
        can resume from it.

        Raises:
            ConfigError: not a :class:`Snapshot`; of another number of envs or autoreset
                mode; a pool's snapshot with results waiting for ``recv`` or actions not yet
                stepped, into a synchronous vector env (``pool`` false).
        """
        if not isinstance(state, Snapshot):
            raise ConfigError(f"resume must be an envfleet.Snapshot, got {state!r}")
        if state.num_envs != num_envs or state.autoreset_mode != autoreset_mode:
            raise ConfigError(
                f"this snapshot is of {state.num_envs} envs in autoreset mode "
                f"{state.autoreset_mode!r}; this vector env has {num_envs} in "
                f"{autoreset_mode!r}"
            )
        taken = state.pool
        if not pool and taken is not None and (taken.ready or taken.sent):
            raise ConfigError(
                "this snapshot of a first-ready pool has results waiting for recv() or "
                "actions not yet stepped: resume it into a pool (batch_size)"
            )
        return state

    @staticmethod
    def load(path: str) -> Snapshot:
        """The snapshot saved at ``path``.

        Raises:
            ReplayFileError: not an envfleet snapshot file, or of another format version.
        """
        return cast(Snapshot, _load(path, SNAPSHOT_MAGIC, Snapshot, "snapshot"))


Progress = Callable[[int, int, str], None]


def run_replay(
    replay: Replay | str,
    progress: Progress | None = None,
    stop_at: tuple[int, int] | None = None,
) -> int:
    """Build the replay's envs in this process and step them to the failure.

    Each env is built from its factory and reset as its episode began (its seed and options,
    or its ``np_random`` state at its autoreset), then stepped with its recorded actions; the
    envs of one worker go step by step in their worker's order. ``progress(env_index, step,
    method)`` is called before each env call (``step`` counts the episode's actions, 0 for
    its reset). An env whose randomness comes from its seed and ``np_random`` fails here as
    it failed in its worker: the same exception (raised from here), the same segfault, the
    same hang. ``stop_at=(env_index, step)`` enters :mod:`pdb` just before that call.

    Returns:
        The env calls made, when none failed (the failure did not reproduce).

    Raises:
        ReplayFileError: a path that is not a replay file (see :func:`load_replay`).
        ValueError: an env's record is not whole (``EnvRecording.why``).
        Exception: what an env raised.
    """
    if isinstance(replay, str):
        replay = load_replay(replay)
    for r in replay.envs:
        if not r.complete:
            raise ValueError(f"sub-environment {r.env_index} cannot be replayed: {r.why}")
    envs = {r.env_index: replay.factories[r.env_index]() for r in replay.envs}
    calls = 0
    try:
        longest = max((len(r.actions) for r in replay.envs), default=0)
        resets_last = [r for r in replay.envs if not r.actions]
        for t in range(longest):
            for r in replay.envs:
                k = t - (longest - len(r.actions))
                if k < 0:
                    continue
                env = envs[r.env_index]
                if k == 0:
                    _call(progress, stop_at, r.env_index, 0, "reset")
                    _begin(env, r.start)  # type: ignore[arg-type]
                    calls += 1
                _call(progress, stop_at, r.env_index, k + 1, "step")
                env.step(r.actions[k])  # (pdb: `step` goes into the env's step)
                calls += 1
        for r in resets_last:  # a failure in the reset that began the episode
            _call(progress, stop_at, r.env_index, 0, "reset")
            _begin(envs[r.env_index], r.start)  # type: ignore[arg-type]
            calls += 1
    finally:
        for env in envs.values():
            with contextlib.suppress(Exception):  # an env that just failed may fail to close
                env.close()
    return calls


def _call(
    progress: Progress | None,
    stop_at: tuple[int, int] | None,
    env_index: int,
    step: int,
    method: str,
) -> None:
    if progress is not None:
        progress(env_index, step, method)
    if stop_at == (env_index, step):
        import pdb  # noqa: T100  (asked for: envfleet replay --pdb)

        pdb.Pdb().set_trace(sys._getframe(1))


@dataclass
class ReplayOutcome:
    """What :func:`watch_replay` saw when it ran a replay in a child process.

    Attributes:
        how: ``"raised"``, ``"died"``, ``"hung"`` or ``"completed"`` (nothing failed).
        reproduced: whether that is the replay's own failure: ``error`` raised the same
            exception (its type and message), ``crash`` died, ``hang`` hung.
        env_index, step, method: the env call that failed (``step``: its episode's actions
            so far, 0 for its ``reset``); ``None`` when none did.
        detail: ``"ValueError: ..."``, ``"signal SIGSEGV"`` or ``"no answer within 5 s"``.
        calls: the env calls made.
    """

    how: str
    reproduced: bool
    env_index: int | None
    step: int | None
    method: str | None
    detail: str
    calls: int


_KINDS = {"error": "raised", "crash": "died", "hang": "hung"}


def watch_replay(path: str, timeout_s: float | None = None, stderr: Any = None) -> ReplayOutcome:
    """Run the replay at ``path`` in a child Python process and watch it: what it raised,
    the signal it died of, or the call it hung in (no next call within ``timeout_s``
    seconds; default the replay's own step timeout for a hang, else none; the child's
    stacks go to ``stderr`` before it is killed).

    Raises:
        ReplayFileError: ``path`` is not a replay file (checked here before the child runs).
    """
    replay = load_replay(path)
    if timeout_s is None and replay.kind == "hang":
        timeout_s = replay.timeout_s or 10.0
    read, write = os.pipe()
    try:
        child = subprocess.Popen(
            [sys.executable, "-c", _CHILD, path, str(write)],
            pass_fds=(write,),
            stderr=stderr,
        )
    finally:
        os.close(write)
    last: tuple[int, int, str] | None = None
    calls, how, detail = 0, "", ""
    buffer = b""
    try:
        with os.fdopen(read, "rb", buffering=0) as pipe:
            while not how:
                ready, _, _ = select.select([pipe], [], [], timeout_s)
                if not ready:
                    how, detail = "hung", f"no answer within {timeout_s:g} s"
                    with contextlib.suppress(ProcessLookupError):
                        child.send_signal(signal.SIGUSR1)  # its stacks, to stderr
                        time.sleep(0.5)
                    break
                chunk = pipe.read(65536)
                if not chunk:  # the child is gone
                    break
                buffer += chunk
                while b"\n" in buffer and not how:
                    line, buffer = buffer.split(b"\n", 1)
                    word, _, rest = line.decode("utf-8", "replace").partition(" ")
                    if word == "call":
                        env_index, step, method = rest.split(" ")
                        last, calls = (int(env_index), int(step), method), calls + 1
                    elif word == "raised":
                        how, detail = "raised", rest
                    elif word == "done":
                        how = "completed"
    finally:
        if child.poll() is None and how in ("hung", ""):
            child.kill()
        code = child.wait()
    if not how:
        how = "died"
        detail = describe_exitcode(code)
    failed = None if how == "completed" else last
    # The same failure: for an env error, the same exception (type and message) too.
    same = _KINDS.get(replay.kind) == how and (how != "raised" or detail in replay.failure)
    return ReplayOutcome(
        how,
        same,
        failed[0] if failed else None,
        failed[1] if failed else None,
        failed[2] if failed else None,
        detail,
        calls,
    )


def _child(path: str, fd: int) -> int:
    """The child process of :func:`watch_replay`: run the replay, telling each call."""
    faulthandler.enable(sys.stderr, all_threads=True)
    faulthandler.register(signal.SIGUSR1, sys.stderr, all_threads=True)
    out = os.fdopen(fd, "wb", buffering=0)

    def progress(env_index: int, step: int, method: str) -> None:
        out.write(f"call {env_index} {step} {method}\n".encode())

    try:
        calls = run_replay(path, progress)
    except Exception as exc:
        traceback.print_exc()
        text = f"{type(exc).__name__}: {exc}".replace("\n", " ")
        out.write(f"raised {text}\n".encode())
        return 1
    out.write(f"done {calls}\n".encode())
    return 0


_CHILD = (
    "import sys; from envfleet._core.replay import _child; "
    "sys.exit(_child(sys.argv[1], int(sys.argv[2])))"
)


def recording_of(failure: Any, env_index: int) -> EnvRecording | None:
    """The recording of env ``env_index`` in a failure as a transport reports it: an
    :class:`~envfleet._core.envgroup.EnvFailure` (its ``failures`` for a partial one) or a
    :class:`~envfleet._core.protocol.Failure` of remote errors; ``None`` when it has none."""
    for item in [failure, *getattr(failure, "failures", ()), *getattr(failure, "errors", ())]:
        recording = getattr(item, "recording", None)
        if recording is not None and getattr(item, "env_index", None) == env_index:
            return cast(EnvRecording, recording)
    return None


def replays_of(
    kind: str,
    failure: str,
    recordings: Sequence[EnvRecording],
    factories: Sequence[Callable[[], gymnasium.Env[Any, Any]]] | None,
    timeout_s: float | None = None,
) -> Replay | None:
    """A :class:`Replay` of ``recordings`` with their factories (``factories[env_index]``),
    or ``None`` when there is nothing to replay."""
    if not recordings or factories is None:
        return None
    return Replay(
        kind,
        failure,
        list(recordings),
        {r.env_index: factories[r.env_index] for r in recordings},
        timeout_s,
    )
