"""The action log: what each env keeps to be rebuilt at a failure, and its memory's format.

An :class:`EnvGroup <envfleet._core.envgroup.EnvGroup>` writes every step's actions into an
:class:`ActionLog` (a ring of its last ``replay_steps`` steps) and, at each reset of an env,
how that reset began (:func:`~envfleet._core.env_state.reset_start`). A processes worker's log
is a file the driver holds, readable after a segfault or a SIGKILL; its recordings
(:class:`~envfleet._core.replay.EnvRecording`) make a failure's
:class:`~envfleet._core.replay.Replay`, and bring envs back in a new worker (a recycled
worker's: :func:`restore_envs`; a resumed vector env's: :class:`~envfleet._core.replay.Snapshot`).

The record costs one copy of the group's action rows per step; its memory is
``replay_steps`` times one step's action rows per worker (plus ``SLOT_BYTES`` per env).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import mmap
import os
import pickle
from collections.abc import Callable, Sequence
from typing import Any, cast

import gymnasium
import numpy as np
from gymnasium.vector.utils import batch_space, concatenate, create_empty_array, iterate

from envfleet._core import native as _native
from envfleet._core.buffers import Carver, side_leaves
from envfleet._core.env_state import begin, unpack_start
from envfleet._core.replay import EnvRecording
from envfleet._core.trees import tree_row, tree_rows, tree_scatter

__all__ = [
    "REPLAY_STEPS",
    "SLOT_BYTES",
    "ActionLog",
    "file_log",
    "fd_log",
    "new_log",
    "read_head",
    "read_log",
    "log_recordings",
    "restore_envs",
    "catch_up_envs",
    "log_before_step",
    "group_recordings",
]

REPLAY_STEPS = 1000  # make()'s default replay_steps: the steps per env kept for a replay
SLOT_BYTES = 16 << 10  # per env, the most bytes of its pickled episode start (ALE's: 14 KB)

_HEADER_WORDS = 5  # actions written (n), capacity, envs (K), slot bytes, episodes begun
_N = 0
_EPISODES = 4


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
        # Each env's episode before its last (start index, start bytes, slot), for before_step:
        # a worker that died in the very step an env began a new episode.
        self.prev_starts, self.prev_start_bytes, self.prev_slots = parts[5:]
        # The same words as memoryviews: a step's and an episode start's writes go through
        # these (an item write of a memoryview costs a fraction of a numpy one's).
        # ``words[0]`` is the group steps recorded (a group reads it to see whether a
        # checkpoint is due).
        self.words = self.header.data
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
        if log_row is not None and type(actions) is np.ndarray and self._row_is(actions):
            return functools.partial(
                log_row,
                self.header.ctypes.data,
                self.ring.ctypes.data,
                actions.ctypes.data,
                actions.nbytes,
                self.capacity,
            )
        return functools.partial(self.record, actions)

    def record(self, actions: Any) -> None:
        """Keep one step's action rows (the group's batched action)."""
        n = self.words[_N]
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
            if self._row_is(actions):
                self._source, self._source_bytes = actions, actions.data.cast("B")
                self._ring_bytes, self._row_bytes = self.ring.data.cast("B"), actions.nbytes
        else:
            tree_scatter(self.ring, n % self.capacity, actions)
        self.words[_N] = n + 1

    def _row_is(self, actions: np.ndarray) -> bool:
        """Whether a row of the ring is ``actions``' bytes (the same dtype and shape, both
        C-contiguous)."""
        ring = self.ring
        return (
            isinstance(ring, np.ndarray)
            and actions.dtype == ring.dtype
            and actions.shape == ring.shape[1:]
            and actions.flags.c_contiguous
            and ring.flags.c_contiguous
        )

    def began(self, j: int, start: tuple[Any, ...] | bytes) -> None:
        """Env ``j`` (local) begins an episode at the next action, as ``start`` says (or as
        its bytes, :meth:`~envfleet._core.env_state.StartReader.packed`, say)."""
        if type(start) is bytes:
            blob = start
        else:
            try:
                blob = pickle.dumps(start, pickle.HIGHEST_PROTOCOL)
            except Exception:
                blob = b""
        self.words[_EPISODES] += 1
        kept = self._start_bytes[j]  # the episode before this one, kept (before_step)
        self._prev_starts[j] = self._starts[j]
        self._prev_start_bytes[j] = kept
        at = j * SLOT_BYTES
        if kept > 0:
            self._prev_slots[at : at + kept] = self._slots[at : at + kept]
        self._starts[j] = self.words[_N]
        size = len(blob)
        if 0 < size <= SLOT_BYTES:
            self._slots[at : at + size] = blob
            self._start_bytes[j] = size
        else:
            self._start_bytes[j] = -1

    def rebase(self, j: int, start: tuple[Any, ...]) -> bool:
        """Env ``j`` (local) checkpointed (``start``: ``("state", blob)``,
        :func:`~envfleet._core.env_state.env_state`): its record starts anew at the next
        action, no episode begun, so that it never needs more than ``capacity`` actions.
        ``False`` (nothing changed) when the checkpoint does not fit its slot."""
        blob = pickle.dumps(start, pickle.HIGHEST_PROTOCOL)
        if len(blob) > SLOT_BYTES:
            return False
        episodes = int(self.header[_EPISODES])
        self.began(j, blob)
        self.words[_EPISODES] = episodes  # a checkpoint begins no episode (the recycler's count)
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
        return tree_row(tree_rows(self.ring, i), j)


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
    _n, capacity, envs, slot, _episodes = memory[: 8 * _HEADER_WORDS].view(np.int64).tolist()
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
    died or hung inside a step: bring every env but the ``lost`` ones (local indices,
    restarted after this) to where it was before that step (``recordings``:
    :meth:`ActionLog.before_step`; ``done``: its autoreset flag), then take the step again with
    the same ``actions`` (one per env). Returns the step's info events
    (:meth:`~envfleet._core.envgroup.EnvGroup.step_only`)."""
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
    env's): bring each env to where it was by running its episode (``recordings``, one per
    env) from its start, and continue its record; ``done``: per env, whether its last step
    ended its episode. Nothing is written to the batch's rows."""
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
            begin(env, cast(tuple, r.start))
            for action in r.actions:
                env.step(action)
    if group.action_log is not None:
        group.action_log.restore(recordings)
    group.resume_autoreset(done)


def group_recordings(group: Any, argument: Any = None) -> list[EnvRecording]:
    """A task: each env of ``group``'s episode so far (none without an action log)."""
    log = group.action_log
    return [] if log is None else log.recordings(group.start)
