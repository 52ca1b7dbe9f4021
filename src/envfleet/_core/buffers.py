"""Batch buffers: one contiguous memory block holding every per-env array of a vector env.

The layout comes from gymnasium's own ``create_empty_array``: it walks the (nested) space and
asks an allocator for one array per leaf. Here the allocator carves aligned views out of a
single block, so the observation structure (ndarray, dict, tuple, nested) is exactly the one
``gymnasium.vector.SyncVectorEnv`` returns, and the driver and every worker rebuild the same
views over the same memory by replaying the same walk.

For process backends the block is a ``multiprocessing.RawArray``: on Linux it is backed by a
file in /dev/shm that is unlinked as soon as it is created, so it never outlives the processes
that map it, whatever way they die.

A block may also hold spare observation buffers ("slabs", see :class:`ObservationSlabs`): with
``copy=True`` each step's observations are written into a slab no earlier result still uses and
handed out as they are, so the results stay the caller's without being copied.
"""

from __future__ import annotations

import ctypes
import multiprocessing.sharedctypes
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from gymnasium import spaces
from gymnasium.vector.utils import create_empty_array

from envfleet._core.errors import ConfigError
from envfleet._core.trees import tree_slice

__all__ = [
    "ALIGN",
    "Batch",
    "Block",
    "Carver",
    "ObservationSlabs",
    "allocate_batch",
    "batch_nbytes",
    "check_fixed_size",
    "caller_leaves",
    "fill_side",
    "fixed_leaf_flags",
    "fixed_part",
    "is_leaf",
    "side_leaves",
    "side_values",
    "observation_nbytes",
]

ALIGN = 64  # bytes; one cache line, so workers never share a line at a block boundary
_FIXED_LEAVES = (spaces.Box, spaces.Discrete, spaces.MultiDiscrete, spaces.MultiBinary)


def check_fixed_size(space: spaces.Space[Any], what: str) -> None:
    """Raise :class:`ConfigError` unless ``space`` is made of fixed-size leaves.

    Fixed-size leaves: Box, Discrete, MultiDiscrete, MultiBinary, nested in Dict and Tuple.
    """
    if isinstance(space, spaces.Dict):
        for sub in space.spaces.values():
            check_fixed_size(sub, what)
    elif isinstance(space, spaces.Tuple):
        for sub in space.spaces:
            check_fixed_size(sub, what)
    elif not isinstance(space, _FIXED_LEAVES):
        raise ConfigError(
            f"the {what} space {space!r} has no fixed size and cannot live in a shared buffer; "
            "supported: Box, Discrete, MultiDiscrete, MultiBinary, nested in Dict and Tuple"
        )


def side_leaves(space: spaces.Space[Any]) -> list[spaces.Space[Any]]:
    """The leaves of ``space`` without a fixed size, in walk order (Dict keys in order).

    Such a leaf (Text, Graph, Sequence, OneOf, a custom Space subclass: every space
    gymnasium's ``batch_space`` batches as a Tuple of copies) has no shared-memory buffer:
    its per-env values travel through a side channel (``SideValues`` of envfleet._core.protocol)
    and the front batches them with gymnasium's ``concatenate``.
    """
    if isinstance(space, spaces.Dict):
        return [leaf for sub in space.spaces.values() for leaf in side_leaves(sub)]
    if isinstance(space, spaces.Tuple):
        return [leaf for sub in space.spaces for leaf in side_leaves(sub)]
    return [] if isinstance(space, _FIXED_LEAVES) else [space]


def fixed_leaf_flags(space: spaces.Space[Any]) -> list[bool]:
    """Per leaf of ``space`` in walk order (:func:`side_leaves`' order), whether it has a
    fixed size (a buffer of its own); ``False`` at each of :func:`side_leaves`."""
    if isinstance(space, spaces.Dict):
        return [flag for sub in space.spaces.values() for flag in fixed_leaf_flags(sub)]
    if isinstance(space, spaces.Tuple):
        return [flag for sub in space.spaces for flag in fixed_leaf_flags(sub)]
    return [isinstance(space, _FIXED_LEAVES)]


def caller_leaves(space: spaces.Space[Any], buffer: Any, actions: Any) -> list[Any] | None:
    """What ``EnvGroup.step(leaf_actions)`` takes for ``actions`` that were written into the
    batched action ``buffer`` of ``space``: per leaf (walk order) the caller's array where its
    dtype differs from the buffer's (each env then gets the caller's dtype, as gymnasium
    hands it), the values of a leaf without a fixed size, else ``None``; ``None`` when every
    leaf is read from the buffer."""
    if type(actions) is np.ndarray and isinstance(buffer, np.ndarray):  # one leaf, the hot case
        return None if actions.dtype == buffer.dtype else [actions]
    out: list[Any] = []

    def walk(sub: spaces.Space[Any], buf: Any, act: Any) -> None:
        if isinstance(sub, spaces.Dict):
            for key, inner in sub.spaces.items():
                walk(inner, buf[key], act[key])
        elif isinstance(sub, spaces.Tuple):
            for k, inner in enumerate(sub.spaces):
                walk(inner, buf[k], act[k])
        elif isinstance(sub, _FIXED_LEAVES):
            value = np.asarray(act)
            out.append(None if value.dtype == buf.dtype else value)
        else:
            out.append(tuple(act))

    walk(space, buffer, actions)
    return out if any(value is not None for value in out) else None


def side_values(space: spaces.Space[Any], obs: Any, out: list[Any]) -> None:
    """Append to ``out`` the values of one env's ``obs`` at the side leaves of ``space``
    (:func:`side_leaves`' order), read as gymnasium's ``concatenate`` reads them."""
    if isinstance(space, spaces.Dict):
        for key, sub in space.spaces.items():
            side_values(sub, obs[key], out)
    elif isinstance(space, spaces.Tuple):
        for sub, value in zip(space.spaces, obs, strict=True):
            side_values(sub, value, out)
    elif not isinstance(space, _FIXED_LEAVES):
        out.append(obs)


def fill_side(space: spaces.Space[Any], tree: Any, batched: Any, every_leaf: bool = False) -> Any:
    """``tree`` (a batched tree with ``None`` at the side leaves, see :func:`fixed_part`) with
    the next item of the iterator ``batched`` at each side leaf; new dicts and tuples.

    With ``every_leaf``, ``batched`` holds an item for every leaf in walk order: a fixed leaf
    takes its item in place of the tree's array unless the item is ``None`` (a step's actions
    whose dtype differs from the space's, see ``FleetVectorEnv.step``)."""
    if isinstance(space, spaces.Dict):
        return {
            key: fill_side(sub, tree[key], batched, every_leaf) for key, sub in space.spaces.items()
        }
    if isinstance(space, spaces.Tuple):
        return tuple(
            fill_side(sub, t, batched, every_leaf)
            for sub, t in zip(space.spaces, tree, strict=True)
        )
    if not isinstance(space, _FIXED_LEAVES):
        return next(batched)
    if every_leaf:
        value = next(batched)
        return tree if value is None else value
    return tree


def fixed_part(space: spaces.Space[Any]) -> spaces.Space[Any]:
    """``space`` with every side leaf (:func:`side_leaves`) replaced by a bare ``Space()``,
    for which ``create_empty_array`` allocates nothing and returns ``None``: the layout of
    the shared buffers. ``space`` itself when it has no side leaf."""
    if not side_leaves(space):
        return space
    if isinstance(space, spaces.Dict):
        return spaces.Dict({key: fixed_part(sub) for key, sub in space.spaces.items()})
    if isinstance(space, spaces.Tuple):
        return spaces.Tuple([fixed_part(sub) for sub in space.spaces])
    return spaces.Space()


def is_leaf(space: spaces.Space[Any]) -> bool:
    """Whether ``space`` is a single array leaf (Box, Discrete, MultiDiscrete, MultiBinary)."""
    return isinstance(space, _FIXED_LEAVES)


class Carver:
    """Allocator for ``create_empty_array``: hands out aligned views of a byte array in order."""

    def __init__(self, memory: np.ndarray | None):
        self.memory = memory  # None: only count bytes
        self.offset = 0

    def __call__(self, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
        dtype = np.dtype(dtype)
        start = -(-self.offset // ALIGN) * ALIGN
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        self.offset = start + nbytes
        if self.memory is None:
            return np.empty(0, dtype=dtype)
        return self.memory[start : start + nbytes].view(dtype).reshape(shape)


@dataclass
class Batch:
    """Views of every batched array of a vector env, all over one memory block.

    Attributes:
        observations: the batched observation, structured as ``create_empty_array`` returns it
            (ndarray ``[num_envs, *shape]``, or dict/tuple of them).
        actions: the batched action, same structure rules.
        rewards: ``float64[num_envs]``.
        terminations: ``bool[num_envs]``.
        truncations: ``bool[num_envs]``.
        observation_slabs: ``[observations, *spares]``: every buffer observations may be
            written to; slab 0 is ``observations`` itself.
        slab: ``int64[1]``, the slab the envs write their next observations to (set by the
            front before each command), or ``None`` when the block has no spare slab.
        block: the :class:`Block` these views are carved from (``None`` for a slice).
    """

    observations: Any
    actions: Any
    rewards: np.ndarray
    terminations: np.ndarray
    truncations: np.ndarray
    observation_slabs: list[Any] = field(default_factory=list)
    slab: np.ndarray | None = None
    block: Block | None = None

    def slice(self, start: int, stop: int) -> Batch:
        """Views of envs ``[start, stop)`` (no copy); ``slab`` is shared, not sliced."""
        return Batch(
            tree_slice(self.observations, start, stop),
            tree_slice(self.actions, start, stop),
            self.rewards[start:stop],
            self.terminations[start:stop],
            self.truncations[start:stop],
            [tree_slice(obs, start, stop) for obs in self.observation_slabs],
            self.slab,
        )


def _layout(
    observation_space: spaces.Space[Any],
    action_space: spaces.Space[Any],
    num_envs: int,
    carve: Callable[..., np.ndarray],
    spare_slabs: int,
) -> Batch:
    # The order of these calls is the memory layout: driver and workers must share it.
    # Leaves without a fixed size get no memory (None in the tree): see side_leaves.
    observation_space, action_space = fixed_part(observation_space), fixed_part(action_space)
    observations = create_empty_array(observation_space, n=num_envs, fn=carve)
    batch = Batch(
        observations=observations,
        actions=create_empty_array(action_space, n=num_envs, fn=carve),
        rewards=carve((num_envs,), dtype=np.float64),
        terminations=carve((num_envs,), dtype=np.bool_),
        truncations=carve((num_envs,), dtype=np.bool_),
    )
    batch.observation_slabs = [observations] + [
        create_empty_array(observation_space, n=num_envs, fn=carve) for _ in range(spare_slabs)
    ]
    if spare_slabs:
        batch.slab = carve((1,), dtype=np.int64)
    return batch


def batch_nbytes(
    observation_space: spaces.Space[Any],
    action_space: spaces.Space[Any],
    num_envs: int,
    spare_slabs: int = 0,
) -> int:
    """Bytes of the block that :func:`allocate_batch` needs, with ``spare_slabs`` spare
    observation buffers (see :class:`ObservationSlabs`)."""
    carver = Carver(None)
    _layout(observation_space, action_space, num_envs, carver, spare_slabs)
    return max(carver.offset, 1)


def observation_nbytes(observation_space: spaces.Space[Any], num_envs: int) -> int:
    """Bytes of one batched observation (one slab), alignment included."""
    carver = Carver(None)
    create_empty_array(fixed_part(observation_space), n=num_envs, fn=carver)
    return carver.offset


class Block:
    """One contiguous memory block, zeroed at creation; shared between processes when ``shared``.

    ``raw`` is a ctypes byte array (``multiprocessing.RawArray`` when shared), never an
    ndarray: arrays built directly over it are the base of every view taken from them, which
    is how :class:`ObservationSlabs` knows when a result is no longer used. ``spare_slabs`` is
    the number of spare observation buffers in the layout (see :func:`batch_nbytes`).

    A shared block pickles only while a process is being started (``multiprocessing``'s rule for
    shared ctypes), which is how the processes backend hands it to its workers.
    """

    def __init__(self, nbytes: int, shared: bool, spare_slabs: int = 0):
        self.nbytes = nbytes
        self.shared = shared
        self.spare_slabs = spare_slabs
        self.raw: Any = (
            multiprocessing.sharedctypes.RawArray(ctypes.c_uint8, nbytes)
            if shared
            else (ctypes.c_uint8 * nbytes)()
        )
        self.array = self._view()

    def _view(self) -> np.ndarray:
        return np.frombuffer(self.raw, dtype=np.uint8, count=self.nbytes)

    def __getstate__(self) -> dict[str, Any]:
        if not self.shared:
            raise TypeError("a private (non-shared) Block cannot be sent to another process")
        return {
            "nbytes": self.nbytes,
            "shared": True,
            "spare_slabs": self.spare_slabs,
            "raw": self.raw,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.nbytes = state["nbytes"]
        self.shared = True
        self.spare_slabs = state["spare_slabs"]
        self.raw = state["raw"]
        self.array = self._view()


def allocate_batch(
    observation_space: spaces.Space[Any],
    action_space: spaces.Space[Any],
    num_envs: int,
    block: Block,
) -> Batch:
    """Build the :class:`Batch` views over ``block``; its bytes are left as they are."""
    batch = _layout(
        observation_space, action_space, num_envs, Carver(block.array), block.spare_slabs
    )
    batch.block = block
    return batch


class ObservationSlabs:
    """Results without a copy: each step's observations go to a slab no result still uses.

    ``copy=True`` promises gymnasium's semantics: the observations a call returns are the
    caller's, and no later call changes them. Copying the shared buffer each step keeps that
    promise at the price of a copy each step (large for Atari's frames, and the cache it
    evicts). Instead, the front picks a slab that no earlier result still uses, has the envs
    write that step's observations there, and returns arrays built directly over it.

    Those arrays are built over the block's ctypes buffer, not over an ndarray, so numpy makes
    each of them the ``base`` of every view, slice or reshape taken from them (and
    ``torch.from_numpy`` keeps them alive too): a slab is in use exactly while one of the
    arrays handed out over it is alive, which a weak reference tells. When every spare slab is
    in use (a caller that keeps many results), slab 0, the batch's own observations, is
    written and copied, as without slabs.

    Args:
        batch: a batch whose block has spare slabs (``len(batch.observation_slabs) > 1``).
    """

    def __init__(self, batch: Batch):
        assert batch.block is not None and len(batch.observation_slabs) > 1
        raw, base = batch.block.raw, batch.block.array.ctypes.data
        self.slabs = batch.observation_slabs
        self._spares = tuple(range(1, len(self.slabs)))
        self._templates = [_template(obs, raw, base) for obs in self.slabs]
        # Per slab, weak references to the arrays last handed out over it.
        self._handed: list[list[weakref.ref[np.ndarray]]] = [[] for _ in self.slabs]

    def free(self, k: int) -> bool:
        """Whether no array handed out over slab ``k`` is alive (slab 0 is never handed out)."""
        return all(ref() is None for ref in self._handed[k])

    def pick(self) -> int:
        """A spare slab no result uses, or 0 (the batch's own buffer) when all are in use."""
        # free() inlined: once per step, where the call's own cost shows
        # (benchmarks/README.md).
        handed = self._handed
        for k in self._spares:
            for ref in handed[k]:
                if ref() is not None:
                    break
            else:
                return k
        return 0

    def hand_out(self, k: int) -> Any:
        """New arrays over spare slab ``k`` (same structure as the observations); the slab is
        in use until every one of them, and every view of them, is gone."""
        template = self._templates[k]
        if type(template) is memoryview:  # a single array: the common case, the short path
            leaf = np.asarray(template)
            self._handed[k] = [weakref.ref(leaf)]
            return leaf
        refs: list[weakref.ref[np.ndarray]] = []
        obs = _build(template, refs)
        self._handed[k] = refs
        return obs


def _template(tree: Any, raw: Any, base: int) -> Any:
    """Per leaf, a memoryview of its bytes in ``raw`` (the block's ctypes buffer) with the
    leaf's shape and format, in the tree's structure (a tuple's as a list).

    ``np.asarray`` of such a memoryview is an array whose base is the memoryview, not an
    ndarray, so every view taken from it keeps that array alive. Where memoryview has no
    format for the dtype, the leaf's (shape, dtype, offset) for ``np.ndarray(buffer=raw)``
    (slower, same effect).
    """
    if isinstance(tree, dict):
        return {key: _template(value, raw, base) for key, value in tree.items()}
    if isinstance(tree, tuple):
        return [_template(value, raw, base) for value in tree]
    offset = tree.ctypes.data - base
    whole = memoryview(raw).cast("B")[offset : offset + tree.nbytes]
    try:
        view = whole.cast(tree.dtype.char, tree.shape)
        if np.asarray(view).dtype == tree.dtype:
            return view
    except (TypeError, ValueError):
        pass
    return (raw, tree.shape, tree.dtype, offset)


def _build(template: Any, refs: list[weakref.ref[np.ndarray]]) -> Any:
    if isinstance(template, dict):
        return {key: _build(value, refs) for key, value in template.items()}
    if isinstance(template, list):
        return tuple(_build(value, refs) for value in template)
    if isinstance(template, memoryview):
        leaf = np.asarray(template)
    else:
        raw, shape, dtype, offset = template
        leaf = np.ndarray(shape, dtype, buffer=raw, offset=offset)
    refs.append(weakref.ref(leaf))
    return leaf
