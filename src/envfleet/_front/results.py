"""Result buffers of the front: what a step or reset hands the caller, copied or not.

``copy=True`` results are the caller's. Where the envs write into the block the front reads
(serial, threads, processes, outside a first-ready pool) they are handed out without a copy:
each command writes its observations into a spare slab that no earlier result uses, and the
arrays returned are built over it (:class:`envfleet._core.buffers.ObservationSlabs`, which stays
in ``buffers`` because the slabs are regions of the block that module lays out). Observation
leaves without a fixed size (Text, Graph, ...) have no buffer: their latest values per env
arrive as :class:`~envfleet._core.protocol.SideValues` events and are batched here.
"""

from __future__ import annotations

from collections.abc import Iterable
from copy import deepcopy
from typing import Any, cast

import gymnasium
import numpy as np
from gymnasium.vector.utils import concatenate, create_empty_array

from envfleet._core.buffers import (
    Batch,
    ObservationSlabs,
    fill_side,
    observation_nbytes,
    side_leaves,
)
from envfleet._core.protocol import SideValues
from envfleet._core.trees import tree_copy, tree_write

__all__ = ["SPARE_SLABS", "ResultBuffers", "spare_slab_count"]

# Spare observation slabs per vector env, for batched observations of at least
# SPARE_SLABS_MIN_BYTES (below it a copy costs less than handing a slab out) and none when
# the spares would take more than SPARE_SLABS_MAX_BYTES of memory together.
SPARE_SLABS = 2
SPARE_SLABS_MIN_BYTES = 4 << 10
SPARE_SLABS_MAX_BYTES = 256 << 20


def spare_slab_count(
    observation_space: gymnasium.Space[Any], num_envs: int, copy: bool, pool: bool, able: bool
) -> int:
    """How many spare observation slabs a vector env's block gets: :data:`SPARE_SLABS` for
    ``copy=True`` outside a first-ready pool on a backend ``able`` to write into them, with
    observations of fixed size between the bounds above; else 0."""
    nbytes = observation_nbytes(observation_space, num_envs)
    if not (copy and not pool and able and nbytes >= SPARE_SLABS_MIN_BYTES):
        return 0
    if side_leaves(observation_space):  # results with side leaves are built anew each step
        return 0
    return SPARE_SLABS if nbytes * SPARE_SLABS <= SPARE_SLABS_MAX_BYTES else 0


class ResultBuffers:
    """The observations of a vector env's calls as the caller gets them.

    Args:
        batch: the backend's batch (observations ``[num_envs, *shape]`` per leaf).
        single_observation_space: one env's observation space.
        slabs: hand ``copy=True`` results out without a copy (the batch has spare slabs).
    """

    def __init__(self, batch: Batch, single_observation_space: gymnasium.Space[Any], slabs: bool):
        self.batch = batch
        self.single_observation_space = single_observation_space
        self.num_envs = batch.rewards.shape[0]
        # The slab holding every env's latest observation, and the one the pending command
        # writes (0: the batch's own buffer).
        self.slabs: ObservationSlabs | None = None
        if slabs and batch.slab is not None:
            self.slabs = ObservationSlabs(batch)
        self.latest = 0
        self.next = 0
        # Observation leaves without a fixed size (buffers.side_leaves): per env, its latest
        # values there.
        self.side_spaces = side_leaves(single_observation_space)
        self.side_rows: list[list[Any] | None] = [None] * self.num_envs

    def observations(self, copy: bool) -> Any:
        """The observations of the step or reset that just finished, as the caller gets them."""
        if self.slabs is not None:
            k = self.latest = self.next
            if k:
                return self.slabs.hand_out(k)  # the caller's without a copy
        obs = self.batch.observations
        if self.side_spaces:
            return self.fill_side(tree_copy(obs) if copy else obs, range(self.num_envs), copy)
        return tree_copy(obs) if copy else obs

    def take_side(self, results: dict[int, Any]) -> dict[int, Any]:
        """``results`` without their :class:`~envfleet._core.protocol.SideValues` events, whose
        values become the envs' latest side-leaf values."""
        rows = self.side_rows
        kept: dict[int, Any] = {}
        for w, events in results.items():
            if not isinstance(events, list):
                kept[w] = events
                continue
            infos = []
            for index, info in events:
                if type(info) is SideValues:
                    rows[index] = info["values"]
                else:
                    infos.append((index, info))
            kept[w] = infos or None
        return kept

    def fill_side(self, obs: Any, envs: Iterable[int], copy: bool) -> Any:
        """``obs`` (a batched tree, ``None`` at the side leaves) with the side leaves of the
        envs ``envs`` batched by gymnasium's ``concatenate``, as SyncVectorEnv batches them;
        with ``copy=True`` deep copies, as SyncVectorEnv's (an env in this process may
        rewrite the objects it returned)."""
        rows = [cast(list[Any], self.side_rows[e]) for e in envs]
        if copy:
            rows = deepcopy(rows)
        batched = (
            concatenate(
                space, [row[k] for row in rows], cast(Any, create_empty_array(space, len(rows)))
            )
            for k, space in enumerate(self.side_spaces)
        )
        return fill_side(self.single_observation_space, obs, batched)

    def pick_slab(self, every_env: bool, copy: bool) -> None:
        """Choose the slab the next step or reset writes its observations to.

        A command that writes every env's row (a step, a full reset) goes to any slab no
        result uses. One that writes only some rows (a masked reset) must find every other
        env's latest row there too: it goes to the latest slab when no result uses it, else
        to a free one that gets the latest rows copied first.
        """
        slabs = self.slabs
        if slabs is None:
            return
        if not copy:  # switched off since make(): views of the batch's own buffer
            self.drop_slabs()
            return
        latest = self.latest
        if every_env:
            k = slabs.pick()
        elif slabs.free(latest):
            k = latest
        else:
            k = slabs.pick()
            tree_write(slabs.slabs[k], slabs.slabs[latest])
        self.batch.slab[0] = k  # type: ignore[index]  # a slab word wherever slabs are
        self.next = k

    def drop_slabs(self) -> None:
        """Go back to the batch's own observation buffer for good (the pool API and
        ``copy=False`` read it directly): move the latest observations there."""
        slabs = self.slabs
        if slabs is None:
            return
        if self.latest:
            tree_write(slabs.slabs[0], slabs.slabs[self.latest])
        cast(np.ndarray, self.batch.slab)[0] = 0
        self.slabs = None
        self.latest = self.next = 0
