"""The worker processes of ``backend="processes"`` and the shared memory they read:
:class:`WorkerProcesses`, held by :class:`~envfleet._backends.processes.backend.ProcessesTransport`,
spawns (:func:`~envfleet._backends.processes.worker.worker_main`), respawns, lays out and
closes the workers, reads their replies' payloads and tells how one died.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import mmap
import multiprocessing
import multiprocessing.sharedctypes
import os
import pickle
import signal
import sys
import threading
import time
import weakref
from collections.abc import Sequence
from multiprocessing import reduction
from multiprocessing.connection import Connection
from typing import Any, cast

from envfleet._backends.base import (
    EnvProbe,
    WorkerLayout,
)
from envfleet._backends.processes.doorbell import (
    BELL_BYTES,
    SEM_SLOT,
    Doorbell,
    RoundBell,
    round_bell_available,
    shared_semaphore,
)
from envfleet._backends.processes.worker import (
    ACK,
    CMD,
    CMD_PAYLOAD,
    ENV,
    FAULT,
    GATHER,
    GROUP_BYTES,
    IN_MAILBOX,
    IN_REGION,
    LOGN,
    MAILBOX_BYTES,
    NEW_REGION,
    REQ,
    SERVED,
    SLEEP,
    THREAD,
    WORDS,
    GroupLayout,
    WorkerSpec,
    control_words,
    host_main,
    mailbox,
    mapped_block,
    read_region,
    send_block,
    stats_rows,
    word_view,
    worker_main,
)
from envfleet._backends.registry import BuildRequest
from envfleet._backends.workers import (
    BOOTSTRAP_FIX,
    STACKS_WAIT_S,
    DeathWatch,
    DriverFiles,
    MemoryWatch,
    ask_stacks,
    bootstrap_report,
    fatal_stacks,
    join_all,
    read_text,
    spawn,
)
from envfleet._core.action_log import ActionLog, log_before_step, log_recordings, read_head
from envfleet._core.buffers import Batch, Block, allocate_batch
from envfleet._core.crash_note import NOTE_CLEAR
from envfleet._core.errors import (
    EnvCrashedError,
    RemoteTraceback,
    describe_exitcode,
)
from envfleet._core.failures import CLOSED
from envfleet._core.protocol import Command
from envfleet._core.replay import EnvRecording
from envfleet._core.stacks import at
from envfleet._core.stats import STATS_WORDS, WorkerMemory

__all__ = ["DEFAULT_CLOSE_TIMEOUT", "WorkerProcesses"]

logger = logging.getLogger("envfleet")

DEFAULT_CLOSE_TIMEOUT = 5.0  # seconds for workers to close their envs before being terminated
_KILL_GRACE = 1.0  # seconds between SIGTERM and SIGKILL


class WorkerProcesses:
    """The worker processes of the processes transport and the shared memory they read; it
    starts, respawns, diagnoses and closes them for the transport
    (:class:`~envfleet._backends.processes.backend.ProcessesTransport`), which moves
    commands and replies through what it exposes.

    Args:
        request: make()'s :class:`BuildRequest` (without env 0 built in the driver, the
            block is laid out once env 0's worker tells its spaces: :meth:`lay_out`).
        worker_spin_s: the most seconds a worker polls for a command before blocking.
        hosts: the groups each worker process serves (a first-ready pool's one-env groups,
            a thread each: host_main); ``None``: a process per group.

    Attributes:
        control, words: per group, its control words (numpy rows; int64 memoryviews, cheaper
            to write); mailboxes, stats: per group, its reply mailbox and step-time row;
            any_done: a first-ready pool's shared doorbell (``None`` otherwise);
        procs, conns, doorbells, regions: per group, its process, pipe, doorbell and the
            driver's mapping of its reply region (``None`` for the driver's own group, and
            before a worker sent one); batch: the shared block's arrays, once laid out.
    """

    def __init__(
        self,
        request: BuildRequest,
        worker_spin_s: float,
        hosts: list[list[int]] | None = None,
    ):
        self.ranges = list(request.plan.ranges)
        self._request = request
        self._blobs, self._accepts = request.blobs, request.accepts_index
        self._worker_spin_s = worker_spin_s
        # Every env in a worker: env 0's spaces come from its worker, the block after them.
        self._block_fd: int | None = None
        self._layout_later = request.first_env is None
        self.batch: Batch | None = None
        if not self._layout_later:
            self._lay_out(request.layout, request.block(shared=True))
        self._ctx: Any = cast(Any, multiprocessing.get_context(request.context))
        groups = len(self.ranges)
        # Per group: two cache lines of control words, then the doorbell's two semaphores.
        self._control_raw: Any = multiprocessing.sharedctypes.RawArray(
            ctypes.c_uint8, groups * GROUP_BYTES
        )
        self.control = control_words(self._control_raw)
        # The same words as one int64 memoryview per group: cheaper to write than numpy
        # (benchmarks/README.md).
        self.words = [word_view(row) for row in self.control]
        # Per group, its control row's address alone: what a ring of that worker reads.
        self._controls = [(int(row.ctypes.data),) for row in self.control]
        self._mail_raw: Any = multiprocessing.sharedctypes.RawArray(
            ctypes.c_uint8, groups * MAILBOX_BYTES
        )
        self.mailboxes = [mailbox(self._mail_raw, g) for g in range(groups)]
        self._stats_raw: Any = multiprocessing.sharedctypes.RawArray(
            ctypes.c_double, groups * STATS_WORDS
        )
        self.stats = stats_rows(self._stats_raw)
        self._any_raw: Any = None
        self.any_done: Any = None
        if request.pool:
            self._any_raw = multiprocessing.sharedctypes.RawArray(ctypes.c_uint8, SEM_SLOT)
            self.any_done = shared_semaphore(self._ctx, self._any_raw, 0)
        # Linux, not a pool: every command is rung on the one round bell (a full step round
        # wakes every worker with one system call at most); else on each worker's doorbell.
        self._bell_raw: Any = None
        self.bell: RoundBell | None = None
        if round_bell_available() and not request.pool:
            self._bell_raw = multiprocessing.sharedctypes.RawArray(ctypes.c_uint8, BELL_BYTES)
            self.bell = RoundBell(self._bell_raw, (REQ, ACK, SLEEP))
        # Per host process, its groups (the first one's stacks file is the host's); per group,
        # its host.
        self.hosts: list[list[int]] = hosts if hosts is not None else [[g] for g in range(groups)]
        self.host_of = {g: h for h, members in enumerate(self.hosts) for g in members}
        # Per host, its bell (rung while it serves its groups in turns: worker.SERVED); per
        # group, its host's ring and SERVED words (None: a process of its own).
        self._host_raw: Any = multiprocessing.sharedctypes.RawArray(
            ctypes.c_uint8, max(1, len(self.hosts)) * SEM_SLOT
        )
        self._host_ring: list[tuple[Any, Any, memoryview] | None] = [None] * groups
        self._to_ring: list[tuple[Any, Any, memoryview]] = []  # until ring_hosts
        self.procs: list[Any] = [None] * groups
        self.conns: list[Connection | None] = [None] * groups
        self.regions: list[mmap.mmap | None] = [None] * groups
        self.doorbells: list[Doorbell | None] = [None] * groups
        # Per worker, the file its faulthandler writes its stacks to and the file of its
        # action log (envfleet._core.action_log), each held by the driver's descriptor.
        self._stack_files = DriverFiles(groups, f"envfleet-stacks-{os.getpid()}", ".txt")
        self._log_files = DriverFiles(groups, f"envfleet-replay-{os.getpid()}", ".log")
        # Each worker's resident memory, for a SIGKILL's report, and its growth per episode
        # (read from the log files, not through self: no reference cycle keeps this object,
        # and its shared memory, past close until the garbage collector runs).
        episodes = functools.partial(_log_episodes, self._log_files, list(self.ranges))
        self.memory = MemoryWatch(episodes, self.ranges)
        # The groups whose process the death watch saw exit, until replaced (start): the
        # driver's waits ask it (alive) before they block and whenever they wake.
        self.dead: set[int] = set()
        self._dead_lock = threading.Lock()  # died() against start(): a group's proc and mark
        self._deaths = DeathWatch(functools.partial(_ring_death, weakref.ref(self)))
        self.closed = False

    def _lay_out(self, layout: WorkerLayout, block: Block) -> None:
        """Set the spaces' layout and the shared block the workers and the driver read."""
        self.layout, self.block = layout, block
        self.batch = allocate_batch(
            layout.single_observation_space, layout.single_action_space, layout.num_envs, block
        )

    def _group_layout(self) -> GroupLayout:
        """What a worker needs to lay its envs over the block (the block itself travels in the
        spawn when known by then, else as a file descriptor on the worker's pipe)."""
        layout, block = self.layout, self.block
        return GroupLayout(
            layout.single_observation_space,
            layout.single_action_space,
            layout.num_envs,
            layout.autoreset_mode,
            layout.same_observation_space,
            None if self._layout_later else block,
            block.nbytes,
            block.spare_slabs,
            layout.replay_steps,
        )

    def lead(self, g: int) -> int:
        """The first group of ``g``'s host process (whose stacks file and memory are the
        host's); ``g`` itself without hosts."""
        return self.hosts[self.host_of[g]][0] if g in self.host_of else g

    def mates(self, g: int) -> list[int]:
        """The groups served by ``g``'s process (``[g]`` without hosts)."""
        return list(self.hosts[self.host_of[g]]) if g in self.host_of else [g]

    def start(self, g: int) -> None:
        """Spawn the worker process of group ``g`` (its envs, doorbell and pipe): with hosts,
        the host process of ``g`` and every group it serves."""
        members = self.mates(g)
        with self._dead_lock:  # the death watch rings none of their new doorbells for the old
            for m in members:
                self.procs[m] = None
        lead = members[0]
        made = [self._spec(m, len(members) > 1, m == lead) for m in members]
        specs, parents, children = map(list, zip(*made, strict=True))
        if len(members) == 1:
            target: Any = worker_main
            args: tuple[Any, ...] = (specs[0], children[0], parents[0])
        else:
            h = self.host_of[lead]
            bell = shared_semaphore(self._ctx, self._host_raw, h * SEM_SLOT)
            self.words[lead][SERVED] = 0  # in turns, until the host says otherwise
            ring = (bell.release, getattr(bell, "value", None), self.words[lead])
            for m in members:
                self._host_ring[m] = ring
            target, args = host_main, (specs, children, parents, bell)
        # report_path: where it says it could not start (bootstrapping).
        proc = spawn(
            self._ctx, target, args, f"envfleet-worker-{lead}", report_path=specs[0].stacks_path
        )
        with self._dead_lock:
            for m, parent_conn, child_conn in zip(members, parents, children, strict=True):
                child_conn.close()
                self.procs[m], self.conns[m] = proc, parent_conn
            if self.dead:
                self.dead.difference_update(members)  # replaced: their deaths are answered
                if not self.dead and self.bell is not None:
                    self.bell.alarm(False)
        self.memory.watch(lead, proc.pid)
        self._deaths.add(proc)

    def died(self, proc: Any) -> None:
        """The death watch's call (its thread) when ``proc`` exited: its groups are dead
        (:attr:`dead`), and every wait that may wait on them is rung (round protocol R8):
        each group with a command due gets a done token (the driver, taking it, finds ``ACK``
        behind ``REQ``: no reply), the pool's shared doorbell one, and the round bell its
        alarm. ``dead`` is written before ``REQ`` is read: a wait whose command was sent
        after this read finds the group in ``dead`` before it blocks. ``proc`` ``None``: every
        process, gone at close. A group being replaced is not rung (its new doorbell is not
        the old one's)."""
        with self._dead_lock:
            groups = [g for g, p in enumerate(self.procs) if p is not None and proc in (None, p)]
            if not groups:
                return
            self.dead.update(groups)
            if self.bell is not None:
                self.bell.alarm(True)
            for g in groups:
                words, doorbell = self.words[g], self.doorbells[g]
                if doorbell is not None and words[REQ] != words[ACK]:
                    doorbell.done.release()
            if self.any_done is not None:
                self.any_done.release()

    def _spec(self, g: int, hosted: bool, lead: bool) -> tuple[WorkerSpec, Connection, Connection]:
        """Group ``g``'s :class:`WorkerSpec` (its doorbell made, its words reset) and its
        pipe's two ends; ``hosted``: served by a thread of a host process, whose stacks file
        is its ``lead`` group's."""
        start, stop = self.ranges[g]
        doorbell = Doorbell(self._ctx, self._control_raw, g * GROUP_BYTES + 8 * WORDS)
        # A new worker (a restarted one too) has no command due: the commands sent to the
        # one before it are answered or lost with it.
        words = self.words[g]
        words[GATHER] = 0
        words[ACK] = words[REQ]
        words[REQ] += 1  # its READY reply is due (R8): a death before it leaves ACK behind
        words[SLEEP] = 0  # round protocol R8: one killed asleep held its bit there
        words[ENV] = NOTE_CLEAR  # inside no env until its group says so
        words[THREAD] = 0
        words[LOGN] = 0
        words[FAULT] = -1
        # A spawn or forkserver child still importing the main module cannot start a worker
        # (spawn() reports multiprocessing's bootstrapping error to its own driver and exits):
        # no files for it, which nothing would remove if that driver killed it first.
        bootstrapping = getattr(multiprocessing.current_process(), "_inheriting", False)
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
            any_done=self.any_done,
            spin_s=self._worker_spin_s,
            parent_pid=os.getpid(),
            start_method=self._ctx.get_start_method(),
            stacks_path=None if bootstrapping or not lead else self._stack_files.new(g),
            replay_path=None if bootstrapping else self._log_files.new(g),
            bell=self.bell,
            hosted=hosted,
        )
        parent_conn, child_conn = self._ctx.Pipe(duplex=True)
        self.doorbells[g] = doorbell
        return spec, parent_conn, child_conn

    def request(self, g: int, command: Command, has_payload: bool) -> None:
        """Write ``command`` into worker ``g``'s control words and ring it: on the round bell
        (its words, its ``REQ`` count, then a ring: round protocol R2, R3), else on its
        doorbell."""
        words = self.words[g]
        words[CMD] = int(command)
        words[CMD_PAYLOAD] = has_payload
        bell = self.bell
        if bell is None:
            words[REQ] += 1  # the count of commands sent, for the ACK (recover), then the post
            cast(Doorbell, self.doorbells[g]).request.release()
            ring = self._host_ring[g]
            if ring is not None and not ring[2][SERVED] and ring not in self._to_ring:
                # A host serving in turns: its bell, once this round's commands are all
                # written (ring_hosts), so that it takes them in one turn.
                self._to_ring.append(ring)
            return
        words[GATHER] = 0
        words[REQ] += 1
        bell.ring(self._controls[g])

    def ring_hosts(self) -> None:
        """Ring the bell of each host serving in turns that :meth:`request` wrote a command
        for, unless a ring it has not taken yet is there (it then looks at every group's
        request count again)."""
        rings, self._to_ring = self._to_ring, []
        for release, value, _ in rings:
            if value is None or value() == 0:
                release()

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
            self.words[g][REQ] += 1  # the second READY is due (R8); it reads no command
            with contextlib.suppress(OSError):  # a dead worker: the wait says so
                conn = cast(Connection, self.conns[g])
                send_block(conn, layout, cast(int, self._block_fd), self.procs[g].pid)
        return True

    def payload(self, g: int, where: int, size: int) -> Any:
        """Worker ``g``'s reply payload: from its mailbox or its pipe (``where``, its
        ``REPLY_PAYLOAD`` word), with its large buffers from its reply region
        (worker.ReplyRegion).

        Raises:
            EOFError, OSError: the pipe closed (the worker died while sending).
        """
        conn = cast(Connection, self.conns[g])
        if where & NEW_REGION:  # the worker's new reply region: its descriptor comes first
            try:
                fd = reduction.recv_handle(conn)
            except RuntimeError as exc:  # recvfds: no descriptor came
                raise EOFError(str(exc)) from exc
            try:
                region = mmap.mmap(fd, os.fstat(fd).st_size, prot=mmap.PROT_READ)
            finally:
                os.close(fd)
            self._drop_region(g)
            self.regions[g] = region
        blob = self.mailboxes[g][:size] if where & IN_MAILBOX else conn.recv_bytes()
        if where & IN_REGION:
            return read_region(self.regions[g], blob)
        return pickle.loads(blob)

    def group_stacks(self, g: int, text: str) -> str:
        """Of ``text``, what its host process's faulthandler wrote, group ``g``'s part: the
        stack of the thread serving it (as the ``Current thread``: the one that ran its env),
        where ``g`` is hosted and that thread is found; else ``text``."""
        ident = int(self.words[g][THREAD])
        if len(self.mates(g)) == 1 or not ident or not text:
            return text
        mark = f"0x{ident:016x} (most recent call first):"
        for block in text.split("\n\n"):
            head, _, rest = block.lstrip("\n").partition("\n")
            if head.endswith(mark) and head.split(" 0x")[0] in ("Thread", "Current thread"):
                return f"Current thread {mark}\n{rest.rstrip()}\n"
        return text

    def fault_group(self, g: int) -> int | None:
        """After ``g``'s host process died of a fatal signal: the group whose thread the
        signal hit (its fault handler's note), ``None`` when not known (not hosted, no C
        module, a signal sent to the process rather than raised by a thread, SIGKILL)."""
        if len(self.mates(g)) == 1:
            return None
        fault = int(self.words[self.lead(g)][FAULT])
        return fault if fault in self.mates(g) else None

    def log_count(self, g: int) -> tuple[int, int] | None:
        """Hosted group ``g``'s action-log step count now and when it last replied (LOGN):
        the first ahead of the second means the step it was sent began (its actions are
        recorded); ``None`` without a log."""
        head = self.log_head(g)
        return None if head is None else (head[0], int(self.words[g][LOGN]))

    def replied(self, g: int) -> bool:
        """Whether group ``g`` posted a reply not yet taken (its done token, taken now: read
        the reply next); the waits ask it, and a replacement of a dead or killed group."""
        doorbell, words = self.doorbells[g], self.words[g]
        # A token with ACK behind REQ is the death watch's, not a reply (R8).
        return (
            doorbell is not None and bool(doorbell.done.acquire(False)) and words[REQ] == words[ACK]
        )

    def kill(self, groups: Sequence[int]) -> None:
        """Kill the processes of ``groups`` (their hosts: every group of each) and wait for
        them to go; their pipes and regions stay until :meth:`respawn`."""
        seen = set()
        for g in groups:
            proc = self.procs[g]
            if proc is None or id(proc) in seen:
                continue
            seen.add(id(proc))
            with contextlib.suppress(ValueError):
                if proc.is_alive():
                    proc.kill()
                proc.join()

    def log_head(self, g: int) -> tuple[int, int, Any] | None:
        """Worker ``g``'s action-log counters: its group steps, the episodes its envs began and
        each env's episode start (:func:`envfleet._core.action_log.read_head`); ``None`` before it
        opened its log."""
        return _log_head(self._log_files, self.ranges, g)

    def rss(self, g: int) -> int | None:
        """Worker ``g``'s resident memory when last sampled (bytes), ``None`` before."""
        seen = self.memory.last(self.lead(g))
        return None if seen is None else seen[0]

    def worker_memory(self) -> tuple[WorkerMemory, ...]:
        """Per worker process: its memory last sampled and its growth per 1,000 episodes."""
        return tuple(
            WorkerMemory(self.rss(g), self.memory.episodes(g), self.memory.growth(g))
            for g in range(len(self.ranges))
        )

    def recordings(self, g: int) -> list[EnvRecording]:
        """Each of worker ``g``'s envs' episode so far, from the action log it writes to its
        file (readable after it died or while it hangs); none without a log."""
        layout = getattr(self, "layout", None)  # known once the workers are laid out
        if layout is None:
            return []
        start, stop = self.ranges[g]
        return log_recordings(self._log_files.read(g), layout.single_action_space, start, stop)

    def running_env(self, g: int) -> int | None:
        """The env (global index) worker ``g`` was inside when last seen: before it is
        replaced, the one of its envs a death or a hang is put on; ``None`` when it ran no env
        code (killed while idle); :data:`~envfleet._core.crash_note.NOTE_SEVERAL` while it
        stepped several at once."""
        env = int(self.words[g][ENV])
        return None if env == NOTE_CLEAR else env

    def before_step(self, g: int) -> tuple[list[EnvRecording], list[Any]]:
        """Worker ``g``'s envs' episodes before its last step began and their actions of that
        step (:meth:`~envfleet._core.action_log.ActionLog.before_step`), from its log's file;
        nothing without a log."""
        layout = getattr(self, "layout", None)
        if layout is None:
            return [], []
        start, stop = self.ranges[g]
        return log_before_step(self._log_files.read(g), layout.single_action_space, start, stop)

    def stacks(self, workers: list[int], wait_s: float = STACKS_WAIT_S) -> dict[int, str]:
        """Each live worker of ``workers``'s stacks, asked for now
        (:func:`~envfleet._backends.workers.ask_stacks`): worker -> text."""
        targets = {}
        for g in workers:
            lead = self.lead(g)  # a host's groups: one ask of the process
            proc, fd = self.procs[lead], self._stack_files.fds[lead]
            if proc is not None and fd is not None and proc.is_alive():
                targets[lead] = (proc.pid, fd)
        found = ask_stacks(targets, lambda g: bool(self.procs[g].is_alive()), wait_s)
        return {
            g: self.group_stacks(g, found[self.lead(g)]) for g in workers if self.lead(g) in found
        }

    def respawn(self, g: int, reason: str) -> None:
        """Kill worker ``g`` (dead or hung: ``reason`` is ``"late"``) and start a new one for
        the same envs (with hosts, for every group of its host: :meth:`respawn_all`)."""
        self.respawn_all({g: reason})

    def respawn_all(self, reasons: dict[int, str]) -> None:
        """:meth:`respawn` each group of ``reasons`` (group -> reason), one new process per
        host: the groups a host serves must all be there (they all go down with it)."""
        done: set[int] = set()
        for g, reason in reasons.items():
            h = self.host_of.get(g)
            if h in done:
                continue
            if h is not None:
                done.add(h)
            members = self.mates(g)
            lead = members[0]
            start, stop = self.ranges[members[0]][0], self.ranges[members[-1]][1]
            if reason == "recycle":
                logger.info("recycling worker %d (sub-environments %d..%d)", g, start, stop - 1)
            else:
                # A host killed because a group of it was late, else one that died.
                late = any(reasons.get(m) == "late" for m in members)
                why = "did not answer in time" if late else "died"
                stacks = self.crash_stacks(lead) if why == "died" else ""
                what = f"worker {g}"
                if len(members) > 1:
                    what = f"worker process of groups {members[0]}..{members[-1]}"
                logger.warning(
                    "%s %s%s; restarting it and its envs%s",
                    what,
                    why,
                    at(stacks),
                    f"; its stacks when it died:\n{stacks}" if stacks else "",
                )
            proc = self.procs[g]
            self.kill([g])
            for m in members:
                cast(Connection, self.conns[m]).close()
                self._drop_region(m)  # the new worker sends its own
            with contextlib.suppress(ValueError):
                proc.close()
            self.start(g)

    def _drop_region(self, g: int) -> None:
        """Unmap worker ``g``'s reply region (its memory goes with the last mapping)."""
        region, self.regions[g] = self.regions[g], None
        if region is not None:
            region.close()

    def crash_error(
        self, w: int, step: int, note: str, reason: str, starting: bool, fate: str = CLOSED
    ) -> EnvCrashedError:
        proc = self.procs[w]
        proc.join(_KILL_GRACE)
        exitcode = proc.exitcode
        start, stop = self.ranges[w]
        written = read_text(self._stack_files.fds[self.lead(w)])
        boot = bootstrap_report(written)
        stacks, rss, cause = "", None, None
        if boot is not None:
            # It could not start: the main module, which every spawn and forkserver worker
            # imports first, starts worker processes on import (no ``if __name__ ==
            # "__main__":`` guard), which multiprocessing refuses in a process still starting.
            # Its stack there is chained as ``__cause__``.
            where = f" ({boot.where})" if boot.where else ""
            how = (
                "while starting, because the main module starts worker processes when it is "
                f"imported{where}: under the {self._ctx.get_start_method()!r} start method "
                "each worker imports the main module first, and multiprocessing refuses to "
                "start a process from one still starting (its 'bootstrapping phase' error). "
                f"To fix it, {BOOTSTRAP_FIX}"
            )
            if boot.traceback:
                cause = RemoteTraceback(boot.traceback)
        else:
            stacks = self.group_stacks(w, fatal_stacks(written))
            where = at(stacks)
            seen = self.memory.last(self.lead(w))
            rss = seen[0] if seen is not None else None
            if exitcode == -signal.SIGKILL and seen is not None:
                # The OOM killer's way: say how much memory the worker held when last seen.
                where = (
                    f" (its resident memory last seen: {seen[0] / 2**20:.1f} MiB, "
                    f"{max(0.0, time.monotonic() - seen[1]):.1f} s before)"
                )
            how = f"after {step} steps{where}"
        error = EnvCrashedError(
            f"worker {w} (sub-environments {start}..{stop - 1}) died with "
            f"{describe_exitcode(exitcode)} {how}; {note + '; ' if note else ''}{fate}",
            env_indices=range(start, stop),
            worker_index=w,
            exitcode=exitcode,
            step=step,
            stacks=stacks,
            rss_bytes=rss,
        )
        if cause is not None:
            error.__cause__ = cause
        return error

    def crash_stacks(self, g: int) -> str:
        """What worker ``g``'s faulthandler wrote when it died of a fatal signal: every
        thread's stack, innermost first; ``""`` for a death that leaves none (SIGKILL,
        ``os._exit``) and for a worker that could not start (its report is in that file)."""
        text = read_text(self._stack_files.fds[self.lead(g)])
        if bootstrap_report(text) is not None:
            return ""
        return self.group_stacks(g, fatal_stacks(text))

    def disown(self) -> None:
        # multiprocessing's exit handler terminates the daemonic processes it counts as this
        # process's children; a child forked by os.fork() inherits the maker's list.
        children = getattr(multiprocessing.process, "_children", None)
        if children is not None:
            for proc in self.procs:
                children.discard(proc)
        self.closed = True  # (the maker's memory thread did not survive the fork)

    def close(self, timeout: float | None, terminate: bool, busy: Sequence[int]) -> None:
        """Close in three bounded phases: ask, terminate, kill.

        Without ``terminate`` and with no call pending (``busy``), each worker is asked to
        close its envs and gets ``timeout`` seconds (default :data:`DEFAULT_CLOSE_TIMEOUT`)
        to exit. Workers still alive then (or at once with ``terminate``) get SIGTERM and
        :data:`_KILL_GRACE` seconds, then SIGKILL (some envs catch SIGTERM: SDL does)."""
        if self.closed:
            return
        self.closed = True
        self.memory.stop()
        procs = list({id(p): p for p in self.procs if p is not None}.values())  # a host once
        graceful = not terminate and not busy
        if busy and not terminate:
            logger.warning("closing while workers %s are busy; terminating them", list(busy))
        if graceful:
            for g, proc in enumerate(self.procs):
                if proc is not None and proc.is_alive():
                    self.request(g, Command.CLOSE, False)
            self.ring_hosts()
            limit = DEFAULT_CLOSE_TIMEOUT if timeout is None else timeout
            join_all(procs, limit)
            hung = [
                g
                for g, p in enumerate(self.procs)
                if p is not None and p.is_alive() and self.lead(g) == g
            ]
            for g, text in self.stacks(hung).items():
                logger.warning(
                    "worker %d did not close its envs within %g s%s; terminating it. Its "
                    "stacks:\n%s",
                    g,
                    limit,
                    at(text),
                    text,
                )
        for proc in procs:
            if proc.is_alive():
                proc.terminate()
        join_all(procs, _KILL_GRACE)
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join()
        # A wait still running in another thread (a ProcessEnv future's) ends now: its
        # workers are dead, whether or not the death watch saw them go. (Not at interpreter
        # finalization: no other thread runs, and a frozen one may hold the lock.)
        if not sys.is_finalizing():
            self.died(None)
            self._deaths.stop()
        for conn in self.conns:
            if conn is not None:
                conn.close()
        for g in range(len(self.regions)):
            self._drop_region(g)
        for proc in procs:
            with contextlib.suppress(ValueError):
                proc.close()
        self._stack_files.remove_all()
        self._log_files.remove_all()
        if self._block_fd is not None:  # the block stays mapped while the driver uses it
            os.close(self._block_fd)
            self._block_fd = None
        # Where the doorbells fall back to multiprocessing semaphores (no process-shared
        # sem_init), each is a named /dev/shm entry under spawn and forkserver, unlinked when
        # its last reference goes: drop ours now that no worker is left.
        self.doorbells = [None] * len(self.doorbells)


def _ring_death(owner: weakref.ref[WorkerProcesses], proc: Any) -> None:
    """The death watch's callback, holding its :class:`WorkerProcesses` weakly (the thread
    must not keep the shared memory past the vector env's life)."""
    workers = owner()
    if workers is not None:
        workers.died(proc)


def _log_head(
    files: DriverFiles, ranges: Sequence[tuple[int, int]], g: int
) -> tuple[int, int, Any] | None:
    start, stop = ranges[g]
    size = stop - start
    return read_head(files.read(g, ActionLog.head_nbytes(size)), size)


def _log_episodes(files: DriverFiles, ranges: Sequence[tuple[int, int]], g: int) -> int | None:
    """The episodes worker ``g``'s envs began, from its log (the memory thread's count)."""
    head = _log_head(files, ranges, g)
    return None if head is None else head[1]
