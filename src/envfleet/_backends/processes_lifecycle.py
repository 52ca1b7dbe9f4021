"""Starting, restarting and stopping the worker processes of ``backend="processes"``.

:class:`WorkerProcesses` is :class:`envfleet._backends.processes.ProcessesBackend`'s base: it
spawns a group's worker (:func:`envfleet._backends.processes_worker.worker_main`) over the
backend's shared memory, respawns a dead or hung one, checks that started workers built their
envs, tells how a worker died, and closes them all in three bounded phases (ask, terminate,
kill). The state it reads is the backend's, set up by the backend's ``__init__``.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
from multiprocessing.connection import Connection
from typing import Any, cast

from envfleet._backends.base import Backend, WorkerLayout, mismatch_error, start_error
from envfleet._backends.doorbell import Doorbell
from envfleet._backends.processes_worker import (
    CMD,
    CMD_PAYLOAD,
    GROUP_BYTES,
    WORDS,
    WorkerSpec,
    worker_main,
)
from envfleet._buffers import Block
from envfleet._envgroup import EnvGroup
from envfleet._errors import EnvCrashedError, describe_exitcode
from envfleet._protocol import Command
from envfleet._supervisor import Round
from envfleet._workers import join_all, spawn

__all__ = ["DEFAULT_CLOSE_TIMEOUT", "WorkerProcesses"]

logger = logging.getLogger("envfleet")

DEFAULT_CLOSE_TIMEOUT = 5.0  # seconds for workers to close their envs before being terminated
_KILL_GRACE = 1.0  # seconds between SIGTERM and SIGKILL


class WorkerProcesses(Backend):
    """The worker processes of a :class:`~envfleet._backends.processes.ProcessesBackend`:
    start, respawn, check, diagnose and close them (the backend's base class)."""

    # Set by the backend's __init__.
    ranges: list[tuple[int, int]]
    block: Block
    _layout: WorkerLayout
    _blobs: list[bytes]
    _worker_spin_s: float
    _ctx: Any
    _control_raw: Any
    _control: Any
    _mail_raw: Any
    _stats_raw: Any
    _any_done: Any
    _procs: list[Any]
    _conns: list[Connection | None]
    _doorbells: list[Doorbell | None]
    _remote: list[int]
    _pending: list[int]
    _local: EnvGroup | None
    _closed: bool

    def start_worker(self, g: int) -> None:
        """Spawn the worker process of group ``g`` (its envs, doorbell and pipe)."""
        layout, blobs = self._layout, self._blobs
        start, stop = self.ranges[g]
        doorbell = Doorbell(self._ctx, self._control_raw, g * GROUP_BYTES + 8 * WORDS)
        spec = WorkerSpec(
            group_index=g,
            start=start,
            stop=stop,
            env_fns=blobs[start:stop],
            accepts_index=list(layout.accepts_index[start:stop]),
            single_observation_space=layout.single_observation_space,
            single_action_space=layout.single_action_space,
            num_envs=layout.num_envs,
            autoreset_mode=layout.autoreset_mode,
            block=self.block,
            control=self._control_raw,
            mailboxes=self._mail_raw,
            stats=self._stats_raw,
            doorbell=doorbell,
            any_done=self._any_done,
            spin_s=self._worker_spin_s,
            parent_pid=os.getpid(),
            start_method=self._ctx.get_start_method(),
            same_observation_space=layout.same_observation_space,
        )
        parent_conn, child_conn = self._ctx.Pipe(duplex=True)
        proc = spawn(
            self._ctx, worker_main, (spec, child_conn, parent_conn), f"envfleet-worker-{g}"
        )
        child_conn.close()
        self._procs[g], self._conns[g], self._doorbells[g] = proc, parent_conn, doorbell

    def check_ready(self, done: Round) -> None:
        """Raise for the first worker that could not start (an env error or a space mismatch)."""
        if done.failures:
            g = min(done.failures)
            raise start_error(done.failures[g].errors[0], g)
        for g in sorted(done.results):
            if done.results[g] is not None:
                raise mismatch_error(done.results[g])

    def respawn(self, g: int) -> None:
        """Kill worker ``g`` (dead or hung) and start a new one for the same envs."""
        proc = self._procs[g]
        if proc.is_alive():
            proc.kill()
        proc.join()
        cast(Connection, self._conns[g]).close()
        with contextlib.suppress(ValueError):
            proc.close()
        self.start_worker(g)

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

    def close(self, timeout: float | None, terminate: bool) -> None:
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
        graceful = not terminate and not self._pending
        if self._pending and not terminate:
            logger.warning("closing while workers %s are busy; terminating them", self._pending)
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
        for proc in procs:
            with contextlib.suppress(ValueError):
                proc.close()
        self._pending = []
        # Where the doorbells fall back to multiprocessing semaphores (no process-shared
        # sem_init), each is a named /dev/shm entry under spawn and forkserver, unlinked when
        # its last reference goes: drop ours now that no worker is left.
        self._doorbells = [None] * len(self._doorbells)
