"""The random and native state of an env, and how its episodes begin.

At each reset of an env, how that reset began: the seed and options of a ``reset``, or the
env's ``np_random`` state just before an autoreset's ``reset()`` (:func:`reset_start`; an
EnvGroup reads it through a :class:`StartReader` per env, on the step path); an env's whole
state mid-episode (a checkpoint: :func:`env_state`, :func:`load_state`); and :func:`begin`,
which starts an env as a recorded episode began.
"""

from __future__ import annotations

import contextlib
import io
import pickle
import struct
import zlib
from collections.abc import Callable
from typing import Any, cast

import cloudpickle
import gymnasium
import numpy as np

from envfleet._core import native as _native

__all__ = [
    "generator_holders",
    "pcg64_bytes",
    "reset_start",
    "StartReader",
    "unpack_start",
    "env_state",
    "load_state",
    "begin",
]


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
    descriptor (a property: gymnasium's ``np_random``), which no instance attribute can
    stand behind.

    An instance attribute is read with ``getattr``, never through ``__dict__``: on CPython
    3.11 reading ``obj.__dict__`` turns the object's inline attribute values into a dict for
    good, and every attribute load in its methods then takes the slow path, a cost that shows
    on a CartPole step (benchmarks/README.md). Only a class that computes attributes
    (``__getattr__`` or its own ``__getattribute__``: PettingZoo's wrappers) is read through
    ``__dict__`` (``by_dict``), so that nothing of it runs."""
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
    instance attribute (:func:`_generator_slots`) of itself or of what it wraps
    (:data:`_LINKS`), each once, by its first path from the env (``"unwrapped._np_random"``).
    ``holders``: the env's :func:`generator_holders` found before (its wrappers stay the same
    objects for its life; a seeded reset replaces its generators), else found now."""
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
    """The ``bit_generator.state`` dict of :func:`pcg64_bytes`'s 40 bytes (``raw``'s first)."""
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
    (``_speedups.pcg64_raw``, given ``ctypes.state_address``) where it gives the twin's bytes
    (checked once per process, with half a 64-bit draw buffered), else the twin (given the
    bit generator)."""
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
    """An episode start as :class:`~envfleet._core.action_log.ActionLog` keeps it (a pickle, or
    :meth:`StartReader.packed`'s form) as :func:`reset_start` gives it.

    Raises:
        pickle.UnpicklingError, struct.error: ``blob`` is neither.
    """
    if not blob.startswith(_PACKED):
        return cast(tuple[Any, ...], pickle.loads(blob))
    (size,) = struct.unpack_from("<I", blob, len(_PACKED))
    at = len(_PACKED) + 4 + size
    paths = pickle.loads(blob[at - size : at])
    states = {path: _pcg64_state(blob[at + k * _PCG64_BYTES :]) for k, path in enumerate(paths)}
    return ("rng", states, None, None)


class StartReader:
    """:func:`reset_start` of one env, with what stays the same over the env's life found
    once: where its generators may be (:func:`_generator_slots`; read at every call, since a
    seeded reset replaces them) and its ``unwrapped`` env. An EnvGroup calls :meth:`packed`
    at every episode start of its env, so it is on the step path (a CartPole episode is
    about 20 steps).

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
        # packed()'s plan (_planned) for the generators it last found (_key: a seeded reset
        # replaces them, an autoreset does not).
        self._key: dict[str, np.random.Generator] | None = None
        self._plan: tuple[bytes, list[Any]] | None = None
        # Most envs have one place a generator may be (gymnasium's: the unwrapped env's
        # _np_random): there packed() checks the planned generator is still there without
        # building the dict of generators.
        slots = self._slots
        self._one = (slots[0][0], slots[0][2]) if len(slots) == 1 and not slots[0][3] else None
        self._one_generator: np.random.Generator | None = None

    def __call__(self, options: Any = None) -> tuple[Any, ...]:
        return _start(self._unwrapped, _read_generators(self._slots), options)

    def packed(self, options: Any = None) -> bytes:
        """The start as :class:`~envfleet._core.action_log.ActionLog` keeps it
        (:func:`unpack_start` reads it back).

        Where every generator is a PCG64 (gymnasium's), the env keeps no ALE state and there
        are no options (an autoreset's start): each generator's :func:`pcg64_bytes` behind
        the paths' pickle, planned once per set of generators (``benchmarks/README.md`` has
        its cost). Else the pickled start.
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
    """Pickles each layer and native object by reference: a checkpoint is loaded into
    another env of the same factory, in place."""

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
    try:
        native = _native_state(unwrapped)
        if native is None and any(vars(unwrapped).get(n) is not None for n in _NATIVE):
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


def begin(env: gymnasium.Env[Any, Any], start: tuple[Any, ...]) -> Any:
    """Reset ``env`` as the recorded episode began (or load its checkpoint: ``("state",
    blob)``); returns ``reset``'s result (``None`` for a checkpoint)."""
    if start[0] == "seed":
        return env.reset(seed=start[1], options=start[2])
    if start[0] == "state":
        load_state(env, start[1])
        return None
    states, native, options = start[1], start[2], start[3]
    for path, state in states.items():
        _set_generator(env, path, state)
    _set_native(env.unwrapped, native)  # an autoreset's start keeps ALE's state, or None
    return env.reset(options=options)
