"""RowWriter: a group's observations written into its rows of one observation slab.

An :class:`~envfleet._core.envgroup.EnvGroup` builds one writer per observation slab
(``Batch.observation_slabs``) over its list of latest observations (only ever changed in
place). The writer picks its strategy from the slab's layout and the observation space; its
``write()`` writes the rows as gymnasium's ``concatenate`` would (``SyncVectorEnv.step``),
falling back within itself to a more general strategy for observations that do not fit.
Strategies (``RowWriter.strategy``), fastest first:

- ``"c"``: the C ``write_rows`` (``envfleet._core.native``) memcpy's each observation into its
  row, for a C-contiguous slab of an array space; observations that are not exact
  C-contiguous ndarrays of the slab's shape and dtype go to ``"concatenate"``, which it calls
  itself: the common case runs no Python frame;
- ``"joined"`` (without the C module): the observations' bytes joined and written through a
  byte view of the rows; the join copies every byte twice, so only up to
  :data:`JOIN_MAX_BYTES` of rows (numpy copies larger ones faster), else ``"concatenate"``;
- ``"concatenate"``: one ``np.concatenate`` of exact ndarrays of the slab's shape along the
  rows' flattened first axis (``np.stack`` costs more for the same values, cast alike with
  ``same_kind``); other observations go to ``"stack"``;
- ``"stack"``: ``np.stack(observations, out=rows)``, what gymnasium's ``concatenate`` does for an
  array space; ``"tree"``: gymnasium's ``concatenate`` itself (Dict and Tuple spaces), which
  leaves without a fixed size pass through (their values reach the front as
  :class:`~envfleet._core.protocol.SideValues`).

Each write raises what numpy or gymnasium raise for observations that do not fit the space
(another shape or structure, a dtype numpy does not cast with ``same_kind``);
:meth:`RowWriter.misfit` names the first such observation.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import gymnasium
import numpy as np
from gymnasium.vector.utils import concatenate, create_empty_array

from envfleet._core.buffers import is_leaf

__all__ = ["JOIN_MAX_BYTES", "RowWriter"]

# A slab's rows up to this size are written as joined bytes ("joined"), larger ones by numpy.
JOIN_MAX_BYTES = 16 << 10


class RowWriter:
    """The writer of a group's rows ``out`` of one observation slab.

    Args:
        observations: the group's latest observation of each env, a list the group changes
            only in place; ``write()`` reads it.
        out: the group's rows of the slab, as ``create_empty_array`` lays them out.
        space: the observation space of one env.
        write_rows: the C ``write_rows`` (``envfleet._core.native.function("write_rows")``),
            or ``None`` where the Python strategies run.

    Attributes:
        write: ``write()`` writes ``observations`` into ``out``, or raises as gymnasium's
            ``concatenate`` would; a bound C call where the strategy is ``"c"``.
        strategy: ``"c"``, ``"joined"``, ``"concatenate"``, ``"stack"`` or ``"tree"`` (the
            module docstring): the first one ``write()`` tries.
    """

    __slots__ = (
        "write",
        "strategy",
        "_observations",
        "_out",
        "_space",
        "_rows",
        "_raw",
        "_shape",
        "_dtype",
    )

    def __init__(
        self,
        observations: list[Any],
        out: Any,
        space: gymnasium.Space[Any],
        write_rows: Callable[..., Any] | None = None,
    ):
        self._observations, self._out, self._space = observations, out, space
        self._rows: np.ndarray | None = None  # out with its first two axes as one
        self._raw: memoryview | None = None  # out's bytes ("joined")
        self._shape: tuple[int, ...] = ()
        self._dtype: np.dtype[Any] | None = None
        leaf = is_leaf(space)
        self.strategy = "stack" if leaf else "tree"
        self.write: Callable[[], object] = self._stack if leaf else self._tree
        if not (leaf and isinstance(out, np.ndarray) and out.ndim >= 2 and out.size):
            return
        rows = out.reshape((-1, *out.shape[2:]))
        if not np.shares_memory(rows, out):  # not a view: the group's rows are not contiguous
            return
        # Compared by identity when writing: numpy's own object for the type, as envs' arrays
        # carry it (a space unpickled in a spawned worker gives an equal dtype that is
        # another object).
        canonical = np.dtype(out.dtype.type)
        self._dtype = canonical if canonical == out.dtype else out.dtype
        self._rows, self._shape = rows, tuple(out.shape[1:])
        self.strategy, self.write = "concatenate", self._concatenate
        if not out.flags.c_contiguous:
            return
        if write_rows is not None:
            # Each byte copied once, with fewer checks than numpy's, whatever the rows' size.
            self.strategy = "c"
            self.write = functools.partial(
                write_rows,
                observations,
                np.ndarray,
                self._dtype,
                self._shape,
                out.ctypes.data,
                out[0].nbytes,
                self._concatenate,
            )
        elif out.nbytes <= JOIN_MAX_BYTES:
            self.strategy, self._raw = "joined", out.data.cast("B")

    def _concatenate(self) -> None:
        """``"joined"`` or ``"concatenate"``: where every observation is an exact ndarray of the
        slab's shape; else :meth:`_stack`."""
        observations, shape, dtype, raw = self._observations, self._shape, self._dtype, self._raw
        ndarray = np.ndarray
        for obs in observations:
            if type(obs) is not ndarray or obs.shape != shape:
                self._stack()
                return
            if obs.dtype is not dtype:
                raw = None
        if raw is not None:
            try:
                raw[:] = b"".join(observations)
                return
            except (BufferError, ValueError, TypeError):
                pass  # not C-contiguous: numpy copies it below
        np.concatenate(observations, axis=0, out=self._rows)

    def _stack(self) -> None:
        np.stack(self._observations, axis=0, out=self._out)

    def _tree(self) -> None:
        concatenate(self._space, self._observations, self._out)

    def misfit(self) -> int:
        """The index of the first observation that gymnasium's ``concatenate`` refuses for the
        space (0 if it refuses none: they fit one by one, not together)."""
        probe: Any = create_empty_array(self._space, 1)
        for j, obs in enumerate(self._observations):
            try:
                concatenate(self._space, [obs], probe)
            except Exception:
                return j
        return 0
