"""Trees of arrays: nested dicts and tuples of ndarrays, as gymnasium batches a space
(``create_empty_array``), one set of helpers for every layer. A ``None`` leaf is a leaf
without a fixed size that has no buffer (``envfleet._core.buffers.side_leaves``); the helpers that
meet buffers pass it through.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

__all__ = [
    "tree_concat",
    "tree_copy",
    "tree_map",
    "tree_row",
    "tree_rows",
    "tree_scatter",
    "tree_slice",
    "tree_take",
    "tree_write",
]


def tree_map(fn: Callable[..., Any], tree: Any, *rest: Any) -> Any:
    """``fn`` applied leaf by leaf to trees of the same structure."""
    if isinstance(tree, dict):
        return {key: tree_map(fn, value, *(r[key] for r in rest)) for key, value in tree.items()}
    if isinstance(tree, tuple):
        return tuple(tree_map(fn, value, *(r[i] for r in rest)) for i, value in enumerate(tree))
    return fn(tree, *rest)


def tree_concat(trees: Sequence[Any]) -> Any:
    """Leaves of ``trees`` concatenated along axis 0."""
    first = trees[0]
    if isinstance(first, dict):
        return {key: tree_concat([t[key] for t in trees]) for key in first}
    if isinstance(first, tuple):
        return tuple(tree_concat([t[i] for t in trees]) for i in range(len(first)))
    return np.concatenate([np.asarray(t) for t in trees], axis=0)


def tree_rows(tree: Any, rows: Any) -> Any:
    """Rows ``rows`` (an index array or slice) of every leaf."""
    return tree_map(lambda leaf: leaf[rows], tree)


def tree_row(tree: Any, k: int) -> Any:
    """A copy of row ``k`` of every leaf: one env's value in a batch (a leaf that is not an
    array, an object array's element, comes as it is)."""

    def row(leaf: Any) -> Any:
        value = leaf[k]
        return value.copy() if isinstance(value, np.ndarray) else value

    return tree_map(row, tree)


def tree_slice(tree: Any, start: int, stop: int) -> Any:
    """Views ``[start:stop]`` along the first axis of every array in a nested dict/tuple
    (``None``, a side leaf without a buffer, stays ``None``)."""
    if isinstance(tree, np.ndarray):
        return tree[start:stop]
    if tree is None:
        return None
    if isinstance(tree, dict):
        return {key: tree_slice(value, start, stop) for key, value in tree.items()}
    if isinstance(tree, tuple):
        return tuple(tree_slice(value, start, stop) for value in tree)
    raise TypeError(f"cannot slice {type(tree).__name__}")


def tree_copy(tree: Any) -> Any:
    """Copy every array of a nested dict/tuple (what ``copy.deepcopy`` gives, faster)."""
    if tree is None:
        return None  # a side leaf without a buffer
    if isinstance(tree, np.ndarray):
        return tree.copy()
    if isinstance(tree, dict):
        return {key: tree_copy(value) for key, value in tree.items()}
    if isinstance(tree, tuple):
        return tuple(tree_copy(value) for value in tree)
    raise TypeError(f"cannot copy {type(tree).__name__}")


def tree_write(dst: Any, src: Any) -> None:
    """Copy ``src`` into the arrays of ``dst`` (same nested dict/tuple structure)."""
    if isinstance(dst, dict):
        for key, value in dst.items():
            tree_write(value, src[key])
    elif isinstance(dst, tuple):
        for value, rows in zip(dst, src, strict=True):
            tree_write(value, rows)
    elif dst is not None:  # None: a side leaf without a buffer
        dst[...] = src


def tree_take(tree: Any, ids: np.ndarray) -> Any:
    """Rows ``ids`` of every leaf of a batched tree, taken into new arrays (one copy)."""
    if isinstance(tree, dict):
        return {key: tree_take(value, ids) for key, value in tree.items()}
    if isinstance(tree, tuple):
        return tuple(tree_take(value, ids) for value in tree)
    return None if tree is None else np.take(tree, ids, axis=0)


def tree_scatter(tree: Any, ids: np.ndarray | int, values: Any) -> None:
    """Write the rows of ``values`` (a tree shaped like ``tree``) into rows ``ids`` of ``tree``
    (one row, ``values`` one row's tree, where ``ids`` is an int)."""
    if isinstance(tree, dict):
        for key, value in tree.items():
            tree_scatter(value, ids, values[key])
    elif isinstance(tree, tuple):
        for value, rows in zip(tree, values, strict=True):
            tree_scatter(value, ids, rows)
    elif tree is not None:  # None: a side leaf without a buffer
        tree[ids] = values
