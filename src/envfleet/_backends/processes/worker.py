"""The worker side of ``backend="processes"`` and the shared memory both sides read.

The layout of the control region (per group: control words, then the doorbell's semaphores),
the mailboxes and the step-time statistics, read by the driver
(:class:`envfleet._backends.processes.backend.ProcessesTransport`) and by each worker; what a worker
receives at start (:class:`WorkerSpec`); and the worker process itself (:func:`worker_main`,
spawned by reference: it stays importable at this path): build the group's envs, then wait
for the doorbell, run the command, reply, with plain steps looping in C where
``envfleet._core._speedups`` is built (``serve_steps``).
"""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import functools
import mmap
import os
import pickle
import signal
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing import reduction
from multiprocessing.connection import Connection
from typing import Any, cast

import cloudpickle
import gymnasium
import numpy as np
from gymnasium.vector import AutoresetMode

from envfleet._backends.base import (
    EnvProbe,
    Prebuilt,
    bind_env_index,
    build_group_envs,
    none_if_empty,
    run_command,
)
from envfleet._backends.processes.doorbell import (
    IDLE_SLICE_MAX_S,
    SEM_SLOT,
    TIGHT_SPIN_S,
    Doorbell,
    RoundBell,
    SharedSem,
    SpinBudget,
)
from envfleet._backends.workers import (
    die_with_parent,
    failure_reply,
    remote_error,
    watch_stacks,
)
from envfleet._core import native as _speedups
from envfleet._core.action_log import file_log
from envfleet._core.buffers import Block, allocate_batch
from envfleet._core.envgroup import EnvFailure, EnvGroup, PartialFailure
from envfleet._core.protocol import Command, Failure, Status
from envfleet._core.stats import (
    BUCKETS_PER_OCTAVE,
    KIND,
    NUM_BUCKETS,
    STATS_WORDS,
    StepTimer,
)
from envfleet._core.stepping import stepping_mode

__all__ = [
    "ACK",
    "CMD",
    "CMD_PAYLOAD",
    "ENV",
    "GATHER",
    "GROUP_BYTES",
    "GroupLayout",
    "IN_MAILBOX",
    "IN_REGION",
    "MAILBOX_BYTES",
    "NEW_REGION",
    "ON_PIPE",
    "REGION_MIN_BYTES",
    "REPLY_BYTES",
    "REPLY_PAYLOAD",
    "REQ",
    "SLEEP",
    "STATUS",
    "THREAD",
    "LOGN",
    "FAULT",
    "SERVED",
    "HOST_TURNS",
    "HOST_THREADS",
    "WORDS",
    "WorkerSpec",
    "attach_block",
    "check_control_row",
    "control_words",
    "mailbox",
    "mapped_block",
    "read_region",
    "send_block",
    "sleep_bit",
    "stats_rows",
    "word_view",
    "worker_main",
    "host_main",
]

MAILBOX_BYTES = 64 << 10  # per worker: a pickled reply up to this size skips the pipe
# A reply's arrays (contiguous buffers) of at least this size travel out of band, through the
# worker's reply region (ReplyRegion), not in the pickle (a round of worker inference hands
# back megabytes of observations).
REGION_MIN_BYTES = 256 << 10

# Per group in the control region: 16 int64 control words (two whole cache lines, so workers
# never share a line), then the doorbell's two semaphores. The words' indexes mirror the C
# step path's control row (_speedups.c's control_t, in this order; check_control_row); REQ,
# GATHER, ACK and SLEEP are the round bell's (doorbell's round protocol, R1).
WORDS = 16
GROUP_BYTES = 8 * WORDS + 2 * SEM_SLOT
CMD, CMD_PAYLOAD, STATUS, REPLY_PAYLOAD, REPLY_BYTES, REQ, GATHER, ACK = 0, 1, 2, 3, 4, 5, 6, 7
SLEEP = 8
CONTROL_ROW = {
    "CMD": CMD,
    "CMD_PAYLOAD": CMD_PAYLOAD,
    "STATUS": STATUS,
    "REPLY_PAYLOAD": REPLY_PAYLOAD,
    "REPLY_BYTES": REPLY_BYTES,
    "REQ": REQ,
    "GATHER": GATHER,
    "ACK": ACK,
    "SLEEP": SLEEP,
}
# The env (global index) the worker is inside now: written before each call into env code
# (EnvGroup.note_crashes; crash_note.NOTE_CLEAR between, NOTE_SEVERAL while several envs step
# at once), read by the driver when the worker died or hung: the env that loses its episode.
ENV = 9
# A hosted group's (several one-env groups served by one process, a thread each: host_main):
# THREAD, the ident of the thread that serves it (its block in the host's stacks); LOGN, its
# action log's step count when it last replied (a later count: the step it was sent began,
# recorded); FAULT, in the row of a host's first group only, the group whose thread a fatal
# signal hit (-1: none, or not a serving thread).
THREAD, LOGN, FAULT = 10, 11, 12
# In the row of a host's first group: how the host serves its groups now. HOST_TURNS (0): its
# main thread steps each group's command in turn, rung once for all on the host's bell (envs
# that compute: a wake-up per host, as a block of envs has); HOST_THREADS: each group on its
# own thread, on its own doorbell (envs that wait: each env handed back when it finishes).
SERVED = 13
HOST_TURNS, HOST_THREADS = 0, 1
ON_PIPE, IN_MAILBOX = 1, 2  # where a reply's payload is (REPLY_PAYLOAD; 0: none)
# Added to REPLY_PAYLOAD: the payload is ``(pickle, buffer sizes)`` whose out-of-band buffers
# lie one after the other in the worker's reply region (IN_REGION), a new one whose file
# descriptor comes first on the pipe (NEW_REGION as well).
IN_REGION, NEW_REGION = 4, 8
_COMMANDS = {int(c): c for c in Command}  # control word -> Command, without Enum's lookup
# The hot path's Enum members as module globals: an Enum member lookup costs more than a
# global's (benchmarks/README.md).
_STEP, _CLOSE = Command.STEP, Command.CLOSE
_SPUN_OUT, _TAKEN, _STEPPED = 0, 1, 2  # why _speedups.serve_steps returned


def check_control_row() -> None:
    """Check that the C step path's control row (``_speedups.c``'s ``control_t``, which
    ``serve_steps``, ``full_round`` and the bell's functions read) is :data:`CONTROL_ROW`, its
    Python mirror, word for word, before a C function that reads it is bound.

    Raises:
        RuntimeError: the C module was built from other sources (rebuild it:
            ``python setup.py build_ext --inplace``, or reinstall envfleet).
    """
    control_row = _speedups.function("control_row")
    if control_row is None:
        return
    row = control_row()
    if row.pop("USED") > WORDS or row != CONTROL_ROW:
        raise RuntimeError(
            f"envfleet._core._speedups' control row {row} is not worker.py's {CONTROL_ROW}: "
            "the C module was built from other sources; rebuild it (pip install . again)"
        )


def sleep_bit(g: int) -> int:
    """Group ``g``'s bit on the round bell: what its worker sleeps with (a futex bitset) and
    holds in its ``SLEEP`` word meanwhile, so that a ring wakes only the workers it rang
    (groups 32 apart share a bit)."""
    return 1 << (g % 32)


def control_words(region: Any) -> np.ndarray:
    """int64 ``[groups, WORDS]`` view of the control words in the control region."""
    raw = np.frombuffer(region, dtype=np.uint8).reshape(-1, GROUP_BYTES)
    return raw[:, : 8 * WORDS].view(np.int64)


def word_view(row: np.ndarray) -> memoryview:
    """The int64 words of one group's control row as a memoryview (format ``q``)."""
    return row.data.cast("B").cast("q")


def mailbox(region: Any, g: int) -> memoryview:
    """The bytes of group ``g``'s mailbox in the mailboxes region."""
    return memoryview(region).cast("B")[g * MAILBOX_BYTES : (g + 1) * MAILBOX_BYTES]


def stats_rows(region: Any) -> np.ndarray:
    return np.frombuffer(region, dtype=np.float64).reshape(-1, STATS_WORDS)


@dataclass
class GroupLayout:
    """How a worker lays its envs over the batch's block: the spaces, the batch size, the
    autoreset mode and the block. ``block`` is ``None`` when the block's memory comes on the
    worker's pipe, as a file descriptor (:func:`attach_block`), with ``nbytes`` and
    ``spare_slabs``."""

    single_observation_space: gymnasium.Space[Any]
    single_action_space: gymnasium.Space[Any]
    num_envs: int
    autoreset_mode: AutoresetMode
    same_observation_space: bool
    block: Block | None
    nbytes: int = 0
    spare_slabs: int = 0
    replay_steps: int = 0


@dataclass
class WorkerSpec:
    """What a worker process receives at start (pickled once, when spawning).

    ``layout`` ``None``: the worker builds its envs, replies ``READY`` with env 0's
    :class:`EnvProbe` (the worker that holds env 0; the others ``None``), then reads its
    :class:`GroupLayout` and the block's file descriptor from its pipe (a driver-free start:
    the driver learns the spaces from its workers, and the block is allocated after).
    """

    group_index: int
    start: int
    stop: int
    env_fns: list[bytes]  # cloudpickled factories, one per env of the worker
    accepts_index: list[bool]
    layout: GroupLayout | None
    control: Any  # the control region: RawArray of GROUP_BYTES bytes per group
    mailboxes: Any  # RawArray of MAILBOX_BYTES bytes per group
    stats: Any  # step-time statistics: RawArray of STATS_WORDS doubles per group
    doorbell: Doorbell
    any_done: Any  # first-ready pool: posted after every reply, whichever worker's; else None
    spin_s: float
    parent_pid: int
    start_method: str
    stacks_path: str | None = None  # where faulthandler writes this worker's stacks
    replay_path: str | None = None  # the file of its action log (envfleet._core.action_log)
    bell: RoundBell | None = None  # the vector env's round bell (Linux; not in a pool)
    hosted: bool = False  # served by a thread of a host process (host_main), with others


def _anonymous_file(name: str, nbytes: int) -> tuple[int, mmap.mmap]:
    """A new anonymous shared-memory file of ``nbytes`` bytes (memfd; elsewhere an unlinked
    temporary file) and its mapping here: nothing to unlink, its memory goes with its last
    descriptor or mapping."""
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create(name)
    else:  # no memfd (macOS)
        fd, path = tempfile.mkstemp(prefix=f"{name}-")
        os.unlink(path)
    try:
        os.ftruncate(fd, nbytes)
        return fd, mmap.mmap(fd, nbytes)
    except BaseException:
        os.close(fd)
        raise


def mapped_block(nbytes: int, spare_slabs: int) -> tuple[Block, int]:
    """A shared :class:`Block` over a new anonymous shared-memory file, and the file's
    descriptor, for workers started before the block's size was known: each gets the
    descriptor on its pipe (:func:`send_block`) and maps the same memory (:func:`attach_block`).
    The caller closes the descriptor when no worker can need it any more."""
    fd, memory = _anonymous_file("envfleet-block", nbytes)
    try:
        return _block_over(memory, nbytes, spare_slabs), fd
    except BaseException:
        os.close(fd)
        raise


def _block_over(memory: mmap.mmap, nbytes: int, spare_slabs: int) -> Block:
    """A shared Block over the first ``nbytes`` of ``memory``, a file's mapping here."""
    block = Block.__new__(Block)
    # A Block's own unpickling: the same block, over memory mapped here rather than a RawArray.
    block.__setstate__(
        {
            "nbytes": nbytes,
            "spare_slabs": spare_slabs,
            "raw": (ctypes.c_uint8 * nbytes).from_buffer(memory),
        }
    )
    return block


def send_block(conn: Connection, layout: GroupLayout, fd: int, pid: int) -> None:
    """Send a worker started without its layout (``WorkerSpec.layout is None``) its
    :class:`GroupLayout` and the block's file descriptor, on its pipe."""
    conn.send_bytes(pickle.dumps(layout, pickle.HIGHEST_PROTOCOL))
    reduction.send_handle(conn, fd, pid)


def attach_block(conn: Connection) -> GroupLayout:
    """The worker's side of :func:`send_block`: its layout, with the block mapped here."""
    layout: GroupLayout = pickle.loads(conn.recv_bytes())
    fd = reduction.recv_handle(conn)
    try:
        layout.block = _block_over(mmap.mmap(fd, layout.nbytes), layout.nbytes, layout.spare_slabs)
    finally:
        os.close(fd)  # the mapping keeps the memory
    return layout


class ReplyRegion:
    """A worker's shared memory for the large arrays of its replies: pickled with their
    buffers out of band (pickle protocol 5), those of :data:`REGION_MIN_BYTES` or more are
    written here, once, instead of into the pickle, down the pipe and out of it again.

    The region is an anonymous file (no name, so nothing to leak) that grows as needed: a
    grown region is a new file whose descriptor goes to the driver on the pipe
    (:data:`NEW_REGION`). The driver copies the buffers out before it sends the next command,
    and the worker writes the region only while replying, so one region serves every reply.
    """

    def __init__(self) -> None:
        self.memory: mmap.mmap | None = None

    def dumps(self, payload: Any) -> tuple[bytes, int, int | None]:
        """``(pickle, flags, fd)``: the payload pickled with its large buffers in the region
        (``flags`` :data:`IN_REGION`, plus :data:`NEW_REGION` with the new region's ``fd``,
        which the caller sends and closes), or pickled whole (``flags`` 0)."""
        buffers: list[memoryview] = []

        def out_of_band(buffer: pickle.PickleBuffer) -> bool:
            view = buffer.raw()
            if view.nbytes < REGION_MIN_BYTES:
                return True  # in band
            buffers.append(view)
            return False

        blob = pickle.dumps(payload, 5, buffer_callback=out_of_band)
        if not buffers:
            return blob, 0, None
        sizes = [view.nbytes for view in buffers]
        need, flags, fd = sum(sizes), IN_REGION, None
        if self.memory is None or len(self.memory) < need:
            size = max(need, 2 * len(self.memory) if self.memory is not None else 0)
            fd, memory = _anonymous_file("envfleet-reply", size)
            if self.memory is not None:
                self.memory.close()
            self.memory = memory
            flags |= NEW_REGION
        offset = 0
        for view, size in zip(buffers, sizes, strict=True):
            self.memory[offset : offset + size] = view
            offset += size
        return pickle.dumps((blob, sizes), pickle.HIGHEST_PROTOCOL), flags, fd


def read_region(memory: Any, blob: bytes | memoryview) -> Any:
    """The driver's side of :class:`ReplyRegion`: the payload of ``blob`` (``(pickle, buffer
    sizes)``), its large buffers copied out of the region ``memory`` (a new ``bytearray``
    each: the arrays are the caller's, writable, whatever the worker writes next)."""
    inner, sizes = pickle.loads(blob)
    buffers, offset = [], 0
    # Copied once, through a view: slicing the mmap itself would make a bytes copy first.
    # The views are released before returning, so that the region can be closed.
    with memoryview(memory) as region:
        for size in sizes:
            with region[offset : offset + size] as part:
                buffers.append(bytearray(part))
            offset += size
    return pickle.loads(inner, buffers=buffers)


class _Worker:
    """The worker side of one group: wait for the doorbell, run the command, reply."""

    def __init__(self, spec: WorkerSpec, conn: Connection):
        self.spec = spec
        self.conn = conn
        self.g = spec.group_index
        self.control = word_view(control_words(spec.control)[self.g])
        self.mailbox = mailbox(spec.mailboxes, self.g)
        self.stats = stats_rows(spec.stats)[self.g]  # its step-time row
        self.doorbell = spec.doorbell
        self.done, self.any_done = spec.doorbell.done, spec.any_done
        # A hosted group on its thread never spins (its host's other threads need the
        # cores); its host, serving in turns, spins on its bell instead (_Host).
        self.budget = SpinBudget(0.0 if spec.hosted else spec.spin_s)
        self.watch_ppid = spec.start_method != "forkserver"
        self.region = ReplyRegion()
        self.bell = spec.bell
        self.address = control_words(spec.control)[self.g].ctypes.data  # of self.control
        self.bit = sleep_bit(self.g)
        self.hosted = spec.hosted
        # A hosted group's action-log header words (LOGN is written from it on every reply).
        self.log_words: Any = None
        if self.bell is not None:
            check_control_row()  # the bell's C functions read REQ and ACK

    def acquire(self, block: bool = True, timeout: float | None = None) -> bool:
        """With a round bell, the request "semaphore" Doorbell.wait takes: poll, or sleep on
        the bell for at most ``timeout`` seconds (rings for other workers are slept through)."""
        control = self.control
        if control[REQ] != control[ACK]:
            return True
        if not block:
            return False
        bell, address, left = cast(RoundBell, self.bell), self.address, cast(float, timeout)
        end = time.monotonic() + left
        while not bell.sleep(address, self.bit, left):
            left = end - time.monotonic()
            if left <= 0:
                return bool(control[REQ] != control[ACK])
        return True

    def driver_alive(self) -> bool:
        if self.watch_ppid and os.getppid() != self.spec.parent_pid:
            return False
        # Between commands nothing is due on the pipe: readable means end-of-file. A hosted
        # group's pipe may hold the payload of a command rung but not taken yet (its request
        # count, posted before the payload was sent, then says so).
        if not self.conn.poll():
            return True
        value = getattr(self.doorbell.request, "value", None) if self.hosted else None
        return value is not None and value() > 0

    def watch(self, group: EnvGroup) -> None:
        """Have ``group`` note the env it is inside (``ENV``) and adapt its stepping, which
        it tells in the last words of the step-time row (_core/stepping.py)."""
        group.note_crashes(self.control[ENV : ENV + 1], self.spec.start)
        group.adapt_stepping(self.stats[KIND:])

    def ring_done(self) -> None:
        if self.log_words is not None:
            self.control[LOGN] = self.log_words[0]
        # Round protocol R6: the REQ read first, the arrival before the ACK (the C twin:
        # _speedups.c's bell_arrive). On the semaphores too, the ACK tells who replied: the
        # driver's account after a Ctrl-C (ProcessesTransport.recover).
        control = self.control
        req = control[REQ]
        if control[GATHER]:  # a full round's command, on the round bell only
            cast(RoundBell, self.bell).arrive()
            control[ACK] = req
            return
        control[ACK] = req
        self.done.release()
        if self.any_done is not None:
            self.any_done.release()

    def reply(self, status: Status, payload: Any) -> None:
        self.control[STATUS] = status
        if payload is None:
            self.control[REPLY_PAYLOAD] = 0
            self.ring_done()
            return
        flags, fd = 0, None
        try:
            blob, flags, fd = self.region.dumps(payload)
        except Exception as exc:
            self.control[STATUS] = Status.ERROR
            blob = pickle.dumps(
                failure_reply(remote_error(exc, self.spec.start, "pickling the result")),
                pickle.HIGHEST_PROTOCOL,
            )
        size = len(blob)
        if size <= MAILBOX_BYTES and fd is None:
            # The driver reads it once the ring is seen: the semaphore orders the writes.
            self.mailbox[:size] = blob
            self.control[REPLY_BYTES] = size
            self.control[REPLY_PAYLOAD] = IN_MAILBOX | flags
            self.ring_done()
            return
        self.control[REPLY_PAYLOAD] = ON_PIPE | flags
        self.ring_done()  # before sending: a large payload must not block the ring
        if fd is not None:  # a new reply region: its descriptor first
            try:
                reduction.send_handle(self.conn, fd, self.spec.parent_pid)
            finally:
                os.close(fd)
        self.conn.send_bytes(blob)

    def serve_one(self, group: EnvGroup, timer: StepTimer) -> bool:
        """Run the command just taken (its doorbell's request) and reply; ``False`` for
        ``CLOSE`` (no reply: the group is done)."""
        control = self.control
        command = _COMMANDS[control[CMD]]
        if command is _CLOSE:
            return False
        payload = pickle.loads(self.conn.recv_bytes()) if control[CMD_PAYLOAD] else None
        try:
            result = run_command(group, command, payload, timer)
        except BaseException as exc:  # an env's SystemExit too: report it
            self.reply_failure(exc, group, command)
            return True
        self.reply(Status.OK, none_if_empty(result))
        return True

    def serve(self, group: EnvGroup, timer: StepTimer | None = None) -> None:
        request: Any = self if self.bell is not None else self.doorbell.request
        if timer is None:
            timer = StepTimer(self.stats)
        serve_steps = self._serve_steps(group, timer)
        while True:
            spun_s: float | None = None
            taken = False
            if serve_steps is not None:
                # Plain steps loop in C until something else is due (the loop below, for
                # Command.STEP without payload; see _speedups.serve_steps).
                try:
                    reason, spun_s, events = serve_steps()
                except BaseException as exc:  # an env's SystemExit too: report it
                    self.reply_failure(exc, group, _STEP)
                    continue
                if reason == _STEPPED:
                    self.reply(Status.OK, events)
                    continue
                taken = reason == _TAKEN  # else it spun out: block below
            if not taken and not Doorbell.wait(
                request, self.budget, None, self.driver_alive, spun_s, IDLE_SLICE_MAX_S
            ):
                return  # the driver is gone
            if not self.serve_one(group, timer):
                return

    def reply_failure(self, exc: BaseException, group: EnvGroup, command: Command) -> None:
        """Reply with what ``command`` raised: an env's failure, or a bug outside any env
        (reported against the group)."""
        if isinstance(exc, PartialFailure):
            errors = [remote_error(f, f.env_index, f.method) for f in exc.failures]
            self.reply(Status.ERROR, Failure(errors, exc.events or None, partial=True))
        else:
            self.reply(Status.ERROR, _error_reply(exc, group.start, command.name.lower()))

    def _serve_steps(
        self, group: EnvGroup, timer: StepTimer
    ) -> Callable[[], tuple[int, float, Any]] | None:
        """The C loop of plain steps (envfleet._core.native), bound to this worker; ``None`` where
        it is not built or the semaphores are not the shared POSIX ones it drives."""
        serve_steps = _speedups.function("serve_steps")
        sems = (self.doorbell.request, self.done, self.any_done)
        # A hosted group blocks at once on its command (no spin: its host's other threads
        # need the cores) and replies from Python, which notes its log's count (LOGN).
        if (
            self.hosted
            or serve_steps is None
            or not all(s is None or type(s) is SharedSem for s in sems)
        ):
            return None
        check_control_row()
        any_done = None if self.any_done is None else self.any_done.address
        bell = None if self.bell is None else self.bell.address
        return functools.partial(
            serve_steps,
            self.doorbell.request.address,
            self.done.address,
            any_done,
            self.address,
            group.step,
            timer.row.ctypes.data,
            self.budget.address,  # its numbers, adapted in place (self keeps it alive)
            TIGHT_SPIN_S,
            int(Command.STEP),
            int(Status.OK),
            BUCKETS_PER_OCTAVE,
            NUM_BUCKETS,
            bell,
        )


def worker_main(spec: WorkerSpec, conn: Connection, parent_conn: Connection) -> None:
    parent_conn.close()  # inherited under fork; only the driver may hold it
    die_with_parent(spec.parent_pid, spec.start_method)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the driver's to handle
    stacks = watch_stacks(spec.stacks_path)  # noqa: F841  (its file stays open)
    _run_group(spec, conn)


def host_main(
    specs: list[WorkerSpec],
    conns: list[Connection],
    parent_conns: list[Connection],
    bell: SharedSem,
) -> None:
    """A host process: several groups (one env each, in a first-ready pool), each with its
    own doorbell, pipe, mailbox and reply. What is the process's is done once: the pipes'
    other ends closed, death with the driver, Ctrl-C ignored, the fatal-signal note
    (``FAULT``: which group's env a segfault hit), the stacks' file (the first group's).
    Its groups' envs are built here, one after another, then served (:class:`_Host`)."""
    for parent_conn in parent_conns:
        parent_conn.close()  # inherited under fork; only the driver may hold them
    lead = specs[0]
    die_with_parent(lead.parent_pid, lead.start_method)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the driver's to handle
    watch_faults = _speedups.function("watch_faults")
    words = control_words(lead.control)[lead.group_index]
    words[SERVED] = HOST_TURNS
    if watch_faults is not None:
        # Before faulthandler, which chains to it (and faulthandler.disable() puts it back).
        faulthandler.disable()
        words[FAULT] = -1
        watch_faults(words.ctypes.data + 8 * FAULT)
    stacks = watch_stacks(lead.stacks_path)  # noqa: F841  (its file stays open)
    workers = [_Worker(spec, conn) for spec, conn in zip(specs, conns, strict=True)]
    groups: list[EnvGroup] = []
    try:
        built = _build_hosted(workers)
        if built is None:  # a group could not build its envs (replied): the driver gives up
            while workers[0].driver_alive():
                time.sleep(IDLE_SLICE_MAX_S / 4)
            return
        groups = built
        _Host(workers, groups, bell).serve()
    except (EOFError, BrokenPipeError, ConnectionResetError):
        pass  # the driver is gone
    finally:
        for group in groups:
            with contextlib.suppress(Exception):
                group.close()
        for conn in conns:
            conn.close()


def _build_hosted(workers: list[_Worker]) -> list[EnvGroup] | None:
    """Build each hosted group's envs in turn (this thread: env constructors need not be
    thread-safe), replying ``READY`` for each as :func:`_run_group` does (driver-free: the
    probe first, every group's, then each one's layout from its pipe); ``None`` when one
    could not (its error replied)."""
    fns_of, built_of = [], []
    for worker in workers:
        spec = worker.spec
        try:
            fns = _factories(spec)
            built: list[gymnasium.Env[Any, Any]] = []
            if spec.layout is None:
                built = build_group_envs(fns, spec.start)
                worker.reply(Status.READY, EnvProbe.of(built[0]) if spec.start == 0 else None)
        except Exception as exc:
            worker.reply(Status.ERROR, _error_reply(exc, spec.start, "make"))
            return None
        fns_of.append(fns)
        built_of.append(built)
    groups: list[EnvGroup] = []
    for worker, fns, built in zip(workers, fns_of, built_of, strict=True):
        spec = worker.spec
        try:
            layout = spec.layout
            if layout is None:
                layout = attach_block(worker.conn)
                fns = [Prebuilt(env, fn) for env, fn in zip(built, fns, strict=True)]
            group = _new_group(spec, fns, layout)
            groups.append(group)
            if group.action_log is not None:
                worker.log_words = group.action_log.words
            mismatch = group.check_spaces()
        except (EOFError, BrokenPipeError, ConnectionResetError):
            raise
        except Exception as exc:
            worker.reply(Status.ERROR, _error_reply(exc, spec.start, "make"))
            return None
        worker.reply(Status.READY, mismatch)
    return groups


def _factories(spec: WorkerSpec) -> list[Any]:
    """``spec``'s env factories, unpickled, each bound to its env's global index."""
    return [
        bind_env_index(cloudpickle.loads(blob), spec.start + j, spec.accepts_index[j])
        for j, blob in enumerate(spec.env_fns)
    ]


def _error_reply(exc: BaseException, start: int, method: str) -> Failure:
    """The reply to ``exc``: an env's failure, else a bug outside any env, put on env
    ``start`` and ``method``."""
    if isinstance(exc, EnvFailure):
        return failure_reply(remote_error(exc, exc.env_index, exc.method))
    return failure_reply(remote_error(exc, start, method))


class _Host:
    """How a host process serves its groups. At first in turns (``HOST_TURNS``): the driver
    rings the host's ``bell`` too, and this thread runs each group's command taken in turn,
    each replied as it ends, the pool's shared doorbell rung once after them: a wake-up per
    host, not per env (envs that compute). Once a group's env is seen to wait
    (:class:`~envfleet._core.stepping.AdaptiveStepping`), or with
    ``ENVFLEET_STEPPING=concurrent``, for good on threads (``HOST_THREADS``): one per group,
    on its own doorbell, each env handed back when it finishes. ``sequential`` keeps turns."""

    CHECK_EVERY = 8  # turns between looks at the groups' kinds
    # A command run in turns for this long (an env that waits, a hang) hands every other
    # group to its own thread at once: none waits behind it.
    STUCK_S = 0.005

    def __init__(self, workers: list[_Worker], groups: list[EnvGroup], bell: SharedSem):
        self.workers, self.groups, self.bell = workers, groups, bell
        lead = workers[0]
        self.served = lead.control  # the SERVED word is the first group's
        self.any_done = lead.any_done
        self.timers = [StepTimer(w.stats) for w in workers]
        self.fault_group = _speedups.function("fault_group")
        ident = threading.get_ident()
        for w, group in zip(workers, groups, strict=True):
            w.control[THREAD] = ident
            w.watch(group)
        # Taking a command in turns and going on threads exclude each other: after the
        # switch only each group's own thread takes its commands.
        self._lock = threading.Lock()
        self._switched = False
        self._current: int | None = None  # the group whose command runs in turns now
        self._since = 0.0  # when it began
        self._open = set(range(len(workers)))  # groups not closed
        self._unrung = False  # a reply of this turn not yet announced on the pool's doorbell
        self._threads: list[threading.Thread] = []

    def serve(self) -> None:
        mode = stepping_mode()
        if mode == "concurrent":
            with self._lock:
                self._switch(None)
        else:
            if mode == "auto":
                threading.Thread(
                    target=self._watch, name="envfleet-host-watch", daemon=True
                ).start()
            i = self._turns(mode == "auto")
            if i is not None:  # this thread goes on serving the group it was running
                _host_thread(self.workers[i], self.groups[i], self.timers[i], self.fault_group)
        for thread in self._threads:
            thread.join()

    def _turns(self, may_leave: bool) -> int | None:
        """Serve in turns until the host goes on threads (returns the group whose command
        this thread ran then, to go on serving it; ``None``: none), every group closed or
        the driver gone (``None``)."""
        workers, groups, timers, lock = self.workers, self.groups, self.timers, self._lock
        for w in workers:
            w.any_done = None  # rung once per turn, below
        any_done, bell, fault_group = self.any_done, self.bell, self.fault_group
        lead = workers[0]
        budget = SpinBudget(lead.spec.spin_s)  # one thread waits here: it may spin
        clock = time.perf_counter
        turns = 0
        while self._open:
            if not Doorbell.wait(bell, budget, None, lead.driver_alive, None, IDLE_SLICE_MAX_S):
                return None  # the driver is gone
            for i in sorted(self._open):
                w = workers[i]
                with lock:
                    if not w.doorbell.request.acquire(False):
                        continue
                    self._current, self._since = i, clock()
                if fault_group is not None:
                    fault_group(w.g)
                served = w.serve_one(groups[i], timers[i])
                with lock:
                    self._current = None
                    if served and not self._switched:
                        self._unrung = True  # replied, the pool's doorbell not rung yet
                    switched = self._switched
                if not served:
                    self._open.discard(i)
                if switched:  # went on threads meanwhile (_watch rang for earlier replies)
                    return i if served else None
            with lock:
                unrung, self._unrung = self._unrung, False
            if unrung and any_done is not None:
                any_done.release()
            turns += 1
            due = may_leave and turns % self.CHECK_EVERY == 0
            if due and any(g.stepping_kind() == "wait" for g in groups):
                with lock:
                    self._switch(None)
                return None
        return None

    def _watch(self) -> None:
        """While in turns: a command that has run :data:`STUCK_S` hands the others to their
        threads."""
        while True:
            time.sleep(self.STUCK_S / 2)
            with self._lock:
                if self._switched or not self._open:
                    return
                current = self._current
                if current is not None and time.perf_counter() - self._since > self.STUCK_S:
                    self._switch(current)
                    return

    def _switch(self, current: int | None) -> None:
        """Go on threads, for good (the lock held): every open group but ``current`` (whose
        command this thread runs now, and goes on serving) on a thread of its own, on its own
        doorbell (``SERVED``: the driver rings it alone); its request count holds what was
        rung before."""
        self._switched = True
        if self._unrung and self.any_done is not None:
            self.any_done.release()  # the replies of the turn cut short: found now
        self._unrung = False
        for w in self.workers:
            w.any_done = self.any_done
        self.served[SERVED] = HOST_THREADS
        for i in sorted(self._open - {current}):
            w = self.workers[i]
            thread = threading.Thread(
                target=_host_thread,
                args=(w, self.groups[i], self.timers[i], self.fault_group),
                name=f"envfleet-group-{w.g}",
                daemon=True,
            )
            thread.start()
            self._threads.append(thread)


def _host_thread(worker: _Worker, group: EnvGroup, timer: StepTimer, fault_group: Any) -> None:
    """One hosted group's thread: its words noted (THREAD, and the C note of the group a
    fatal signal hits), then :meth:`_Worker.serve`. A failure outside any env (a bug here)
    ends the whole host, which the driver sees as its groups' death."""
    try:
        worker.control[THREAD] = threading.get_ident()
        if fault_group is not None:
            fault_group(worker.g)
        worker.serve(group, timer)
    except (EOFError, BrokenPipeError, ConnectionResetError):
        pass  # the driver is gone
    except BaseException:
        with contextlib.suppress(Exception):
            traceback.print_exc()
        os._exit(1)


def _new_group(spec: WorkerSpec, fns: list[Any], layout: GroupLayout) -> EnvGroup:
    """The EnvGroup of ``spec``'s envs over its layout's block, with its action log."""
    batch = allocate_batch(
        layout.single_observation_space,
        layout.single_action_space,
        layout.num_envs,
        cast(Block, layout.block),
    )
    return EnvGroup(
        fns,
        spec.start,
        batch,
        layout.single_observation_space,
        layout.single_action_space,
        layout.autoreset_mode,
        same_observation_space=layout.same_observation_space,
        action_log=file_log(
            spec.replay_path,
            layout.single_action_space,
            spec.stop - spec.start,
            layout.replay_steps,
        ),
    )


def _run_group(spec: WorkerSpec, conn: Connection) -> None:
    """Build one group's envs, reply ``READY``, then serve its commands until the driver
    closes it or is gone."""
    worker = _Worker(spec, conn)
    group: EnvGroup | None = None
    built: list[gymnasium.Env[Any, Any]] = []
    try:
        try:
            fns = _factories(spec)
            layout = spec.layout
            if layout is None:
                # Driver-free: build the envs, tell env 0's spaces, then get the block.
                built = build_group_envs(fns, spec.start)
                worker.reply(Status.READY, EnvProbe.of(built[0]) if spec.start == 0 else None)
                layout = attach_block(conn)
                fns = [Prebuilt(env, fn) for env, fn in zip(built, fns, strict=True)]
            group = _new_group(spec, fns, layout)
            built = []  # the group's now
            worker.watch(group)
            mismatch = group.check_spaces()
        except (EOFError, BrokenPipeError, ConnectionResetError):
            raise
        except Exception as exc:
            worker.reply(Status.ERROR, _error_reply(exc, spec.start, "make"))
            return
        worker.reply(Status.READY, mismatch)
        worker.serve(group)
    except (EOFError, BrokenPipeError, ConnectionResetError):
        pass  # the driver is gone
    finally:
        for env in built:  # built, but never handed to a group
            with contextlib.suppress(Exception):
                env.close()
        if group is not None:
            group.close()
        conn.close()
