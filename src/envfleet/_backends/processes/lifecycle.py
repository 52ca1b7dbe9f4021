"""Starting, restarting and stopping the worker processes of ``backend="processes"``.

:class:`WorkerProcesses` is the base of
:class:`envfleet._backends.processes.backend.ProcessesTransport`: it spawns a group's worker
(:func:`envfleet._backends.processes.worker.worker_main`) over the backend's shared memory, respawns
a dead or hung one, checks that started workers built their envs, tells how a worker died, and
closes them all in three bounded phases (ask, terminate, kill). The state it reads is the backend's,
set up by the backend's ``__init__``.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import multiprocessing
import os
from collections.abc import Sequence
from multiprocessing.connection import Connection
from typing import Any, cast

from envfleet._backends.base import (
    EnvProbe,
    WorkerLayout,
)
from envfleet._backends.processes.doorbell import Doorbell
from envfleet._backends.processes.worker import (
    CMD,
    CMD_PAYLOAD,
    GROUP_BYTES,
    WORDS,
    GroupLayout,
    WorkerSpec,
    mapped_block,
    send_block,
    worker_main,
)
from envfleet._backends.registry import BuildRequest
from envfleet._backends.workers import join_all, spawn
from envfleet._core.buffers import Batch, Block, allocate_batch
from envfleet._core.envgroup import EnvGroup
from envfleet._core.errors import (
    EnvCrashedError,
    describe_exitcode,
)
from envfleet._core.protocol import Command

__all__ = ["DEFAULT_CLOSE_TIMEOUT", "WorkerProcesses"]

logger = logging.getLogger("envfleet")

DEFAULT_CLOSE_TIMEOUT = 5.0  # seconds for workers to close their envs before being terminated
_KILL_GRACE = 1.0  # seconds between SIGTERM and SIGKILL


class WorkerProcesses:
    """The worker processes of a :class:`~envfleet._backends.processes.backend.ProcessesTransport`:
    start, respawn, check, diagnose and close them (the backend's base class)."""

    # Set by the backend's __init__ (the layout, block and batch by _lay_out).
    ranges: list[tuple[int, int]]
    block: Block
    batch: Batch
    _layout: WorkerLayout
    _layout_later: bool
    _block_fd: int | None
    _blobs: list[bytes]
    _accepts: list[bool]
    _worker_spin_s: float
    _ctx: Any
    _control_raw: Any
    _control: Any
    _mail_raw: Any
    _stats_raw: Any
    _any_done: Any
    _procs: list[Any]
    _conns: list[Connection | None]
    _regions: list[mmap.mmap | None]
    _doorbells: list[Doorbell | None]
    _remote: list[int]
    _request: BuildRequest
    _local: EnvGroup | None
    _closed: bool

    def _lay_out(self, layout: WorkerLayout, block: Block) -> None:
        """Set the spaces' layout and the shared block the workers and the driver read."""
        self._layout, self.block = layout, block
        self.batch = allocate_batch(
            layout.single_observation_space, layout.single_action_space, layout.num_envs, block
        )

    def _group_layout(self) -> GroupLayout:
        """What a worker needs to lay its envs over the block (the block itself travels in the
        spawn when known by then, else as a file descriptor on the worker's pipe)."""
        layout, block = self._layout, self.block
        return GroupLayout(
            layout.single_observation_space,
            layout.single_action_space,
            layout.num_envs,
            layout.autoreset_mode,
            layout.same_observation_space,
            None if self._layout_later else block,
            block.nbytes,
            block.spare_slabs,
        )

    def start_worker(self, g: int) -> None:
        """Spawn the worker process of group ``g`` (its envs, doorbell and pipe)."""
        start, stop = self.ranges[g]
        doorbell = Doorbell(self._ctx, self._control_raw, g * GROUP_BYTES + 8 * WORDS)
        spec = WorkerSpec(
            group_index=g,
            start=start,
            stop=stop,
            env_fns=self._blobs[start:stop],
            accepts_index=list(self._accepts[start:stop]),
            layout=None if self._layout_later else self._group_layout(),
            control=self._control_raw,
            mailboxes=self._mail_raw,
            stats=self._stats_raw,
            doorbell=doorbell,
            any_done=self._any_done,
            spin_s=self._worker_spin_s,
            parent_pid=os.getpid(),
            start_method=self._ctx.get_start_method(),
        )
        parent_conn, child_conn = self._ctx.Pipe(duplex=True)
        proc = spawn(
            self._ctx, worker_main, (spec, child_conn, parent_conn), f"envfleet-worker-{g}"
        )
        child_conn.close()
        self._procs[g], self._conns[g], self._doorbells[g] = proc, parent_conn, doorbell

    def lay_out(self, workers: list[int], probe: Any) -> bool:
        """After the ``READY`` replies of ``workers``, just spawned: a worker spawned without
        its layout (every env in a worker) gets it and the block on its pipe now, and replies
        ``READY`` again; at the start (``probe``: env 0's, from its worker) the probe goes to
        make()'s request first, and the shared block is allocated. Returns whether a second
        ``READY`` is to be waited for."""
        if not self._layout_later:
            return False
        if probe is not None and self._block_fd is None:
            sizing = self._request.learn(cast(EnvProbe, probe))
            block, self._block_fd = mapped_block(sizing.nbytes, sizing.spare_slabs)
            self._lay_out(sizing.layout, block)
        layout = self._group_layout()
        for g in workers:
            with contextlib.suppress(OSError):  # a dead worker: the wait says so
                conn = cast(Connection, self._conns[g])
                send_block(conn, layout, cast(int, self._block_fd), self._procs[g].pid)
        return True

    def respawn(self, g: int, reason: str) -> None:
        """Kill worker ``g`` (dead or hung: ``reason`` is ``"late"``) and start a new one for
        the same envs."""
        why = "did not answer in time" if reason == "late" else "died"
        logger.warning("worker %d %s; restarting it and its envs", g, why)
        proc = self._procs[g]
        if proc.is_alive():
            proc.kill()
        proc.join()
        cast(Connection, self._conns[g]).close()
        self._drop_region(g)  # the new worker sends its own
        with contextlib.suppress(ValueError):
            proc.close()
        self.start_worker(g)

    def _drop_region(self, g: int) -> None:
        """Unmap worker ``g``'s reply region (its memory goes with the last mapping)."""
        region, self._regions[g] = self._regions[g], None
        if region is not None:
            region.close()

    def crash_error(
        self, w: int, step: int, note: str, reason: str, starting: bool
    ) -> EnvCrashedError:
        proc = self._procs[w]
        proc.join(_KILL_GRACE)
        exitcode = proc.exitcode
        start, stop = self.ranges[w]
        return EnvCrashedError(
            f"worker {w} (sub-environments {start}..{stop - 1}) died with "
            f"{describe_exitcode(exitcode)} after {step} steps; "
            f"{note + '; ' if note else ''}the vector env was closed",
            env_indices=range(start, stop),
            worker_index=w,
            exitcode=exitcode,
            step=step,
        )

    def disown(self) -> None:
        # multiprocessing's exit handler terminates the daemonic processes it counts as this
        # process's children; a child forked by os.fork() inherits the maker's list.
        children = getattr(multiprocessing.process, "_children", None)
        if children is not None:
            for proc in self._procs:
                children.discard(proc)
        self._closed = True

    def close(self, timeout: float | None, terminate: bool, busy: Sequence[int]) -> None:
        """Close in three bounded phases: ask, terminate, kill.

        Without ``terminate`` and with no call pending, each worker is asked to close its envs
        and gets ``timeout`` seconds (default :data:`DEFAULT_CLOSE_TIMEOUT`) to exit. Workers
        still alive then (or at once with ``terminate``) get SIGTERM and :data:`_KILL_GRACE`
        seconds, then SIGKILL. Some envs catch SIGTERM (SDL does), hence the last phase. The
        driver's own envs, if any, are closed in the driver.
        """
        if self._closed:
            return
        self._closed = True
        procs = [p for p in self._procs if p is not None]
        graceful = not terminate and not busy
        if busy and not terminate:
            logger.warning("closing while workers %s are busy; terminating them", list(busy))
        if graceful:
            for g in self._remote:
                if self._procs[g].is_alive():
                    self._control[g, CMD] = Command.CLOSE
                    self._control[g, CMD_PAYLOAD] = 0
                    cast(Doorbell, self._doorbells[g]).ring_request()
        if self._local is not None:
            self._local.close()
        if graceful:
            join_all(procs, DEFAULT_CLOSE_TIMEOUT if timeout is None else timeout)
        for proc in procs:
            if proc.is_alive():
                proc.terminate()
        join_all(procs, _KILL_GRACE)
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in self._conns:
            if conn is not None:
                conn.close()
        for g in range(len(self._regions)):
            self._drop_region(g)
        for proc in procs:
            with contextlib.suppress(ValueError):
                proc.close()
        if self._block_fd is not None:  # the block stays mapped while the driver uses it
            os.close(self._block_fd)
            self._block_fd = None
        # Where the doorbells fall back to multiprocessing semaphores (no process-shared
        # sem_init), each is a named /dev/shm entry under spawn and forkserver, unlinked when
        # its last reference goes: drop ours now that no worker is left.
        self._doorbells = [None] * len(self._doorbells)
