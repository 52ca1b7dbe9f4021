"""Batch buffers: one contiguous memory block holding every per-env array of a vector env.

The layout comes from gymnasium's own ``create_empty_array``: it walks the (nested) space and
asks an allocator for one array per leaf. Here the allocator carves aligned views out of a
single block, so the observation structure (ndarray, dict, tuple, nested) is exactly the one
``gymnasium.vector.SyncVectorEnv`` returns, and the driver and every worker rebuild the same
views over the same memory by replaying the same walk.

For process backends the block is a ``multiprocessing.RawArray``: on Linux it is backed by a
file in /dev/shm that is unlinked as soon as it is created, so it never outlives the processes
that map it, whatever way they die.
"""

from __future__ import annotations

import ctypes
import multiprocessing.sharedctypes
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from gymnasium import spaces
from gymnasium.vector.utils import create_empty_array

from envfleet.errors import ConfigError

__all__ = [
    "ALIGN",
    "Batch",
    "Block",
    "allocate_batch",
    "batch_nbytes",
    "check_fixed_size",
    "is_leaf",
    "tree_copy",
    "tree_scatter",
    "tree_slice",
    "tree_take",
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


def is_leaf(space: spaces.Space[Any]) -> bool:
    """Whether ``space`` is a single array leaf (Box, Discrete, MultiDiscrete, MultiBinary)."""
    return isinstance(space, _FIXED_LEAVES)


class _Carver:
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
    """

    observations: Any
    actions: Any
    rewards: np.ndarray
    terminations: np.ndarray
    truncations: np.ndarray

    def slice(self, start: int, stop: int) -> Batch:
        """Views of envs ``[start, stop)`` (no copy)."""
        return Batch(
            tree_slice(self.observations, start, stop),
            tree_slice(self.actions, start, stop),
            self.rewards[start:stop],
            self.terminations[start:stop],
            self.truncations[start:stop],
        )


def _layout(
    observation_space: spaces.Space[Any],
    action_space: spaces.Space[Any],
    num_envs: int,
    carve: Callable[..., np.ndarray],
) -> Batch:
    # The order of these calls is the memory layout: driver and workers must share it.
    return Batch(
        observations=create_empty_array(observation_space, n=num_envs, fn=carve),
        actions=create_empty_array(action_space, n=num_envs, fn=carve),
        rewards=carve((num_envs,), dtype=np.float64),
        terminations=carve((num_envs,), dtype=np.bool_),
        truncations=carve((num_envs,), dtype=np.bool_),
    )


def batch_nbytes(
    observation_space: spaces.Space[Any], action_space: spaces.Space[Any], num_envs: int
) -> int:
    """Bytes of the block that :func:`allocate_batch` needs."""
    carver = _Carver(None)
    _layout(observation_space, action_space, num_envs, carver)
    return max(carver.offset, 1)


class Block:
    """One contiguous memory block, zeroed at creation; shared between processes when ``shared``.

    A shared block pickles only while a process is being started (``multiprocessing``'s rule for
    shared ctypes), which is how the processes backend hands it to its workers.
    """

    def __init__(self, nbytes: int, shared: bool):
        self.nbytes = nbytes
        self.shared = shared
        self.raw: Any = (
            multiprocessing.sharedctypes.RawArray(ctypes.c_uint8, nbytes) if shared else None
        )
        self.array = self._view()

    def _view(self) -> np.ndarray:
        if self.raw is None:
            return np.zeros(self.nbytes, dtype=np.uint8)
        return np.frombuffer(self.raw, dtype=np.uint8, count=self.nbytes)

    def __getstate__(self) -> dict[str, Any]:
        if not self.shared:
            raise TypeError("a private (non-shared) Block cannot be sent to another process")
        return {"nbytes": self.nbytes, "shared": True, "raw": self.raw}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.nbytes = state["nbytes"]
        self.shared = True
        self.raw = state["raw"]
        self.array = self._view()


def allocate_batch(
    observation_space: spaces.Space[Any],
    action_space: spaces.Space[Any],
    num_envs: int,
    block: Block,
) -> Batch:
    """Build the :class:`Batch` views over ``block``; its bytes are left as they are."""
    return _layout(observation_space, action_space, num_envs, _Carver(block.array))


def tree_slice(tree: Any, start: int, stop: int) -> Any:
    """Views ``[start:stop]`` along the first axis of every array in a nested dict/tuple."""
    if isinstance(tree, np.ndarray):
        return tree[start:stop]
    if isinstance(tree, dict):
        return {key: tree_slice(value, start, stop) for key, value in tree.items()}
    if isinstance(tree, tuple):
        return tuple(tree_slice(value, start, stop) for value in tree)
    raise TypeError(f"cannot slice {type(tree).__name__}")


def tree_copy(tree: Any) -> Any:
    """Copy every array of a nested dict/tuple (what ``copy.deepcopy`` gives, faster)."""
    if isinstance(tree, np.ndarray):
        return tree.copy()
    if isinstance(tree, dict):
        return {key: tree_copy(value) for key, value in tree.items()}
    if isinstance(tree, tuple):
        return tuple(tree_copy(value) for value in tree)
    raise TypeError(f"cannot copy {type(tree).__name__}")


def tree_take(tree: Any, ids: np.ndarray) -> Any:
    """Rows ``ids`` of every leaf of a batched tree, gathered into new arrays (one copy)."""
    if isinstance(tree, dict):
        return {key: tree_take(value, ids) for key, value in tree.items()}
    if isinstance(tree, tuple):
        return tuple(tree_take(value, ids) for value in tree)
    return np.take(tree, ids, axis=0)


def tree_scatter(tree: Any, ids: np.ndarray, values: Any) -> None:
    """Write the rows of ``values`` (a tree shaped like ``tree``) into rows ``ids`` of ``tree``."""
    if isinstance(tree, dict):
        for key, value in tree.items():
            tree_scatter(value, ids, values[key])
    elif isinstance(tree, tuple):
        for value, rows in zip(tree, values, strict=True):
            tree_scatter(value, ids, rows)
    else:
        tree[ids] = values
