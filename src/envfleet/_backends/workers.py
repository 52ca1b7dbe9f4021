"""The worker-process toolkit (layer 6 in docs/architecture.md): spawn, die with the parent,
report, watch.

Every worker process envfleet starts goes through these few functions:

- :func:`spawn` starts a daemonic process with a chosen ``multiprocessing`` start method; a
  process that cannot start because the main module it imports starts workers on import
  (multiprocessing's "bootstrapping phase" error under ``spawn`` and ``forkserver``) says so
  in the driver's file for it, which :func:`bootstrap_report` reads;
- :func:`die_with_parent`, called first thing in the worker, makes it exit when the driver
  dies, also when the driver is SIGKILLed (Linux's ``PR_SET_PDEATHSIG``); :func:`die_with`
  makes a process die with another one (a Ray env actor with its node's helper);
- :func:`remote_error` turns an exception raised in a worker into a picklable
  :class:`~envfleet._core.protocol.RemoteError` that carries its traceback; the driver
  rebuilds it (:func:`envfleet._core.failures.remote_cause`) and chains it as ``__cause__`` of
  the typed error it raises, as ``concurrent.futures.ProcessPoolExecutor`` does;
- :func:`watch` waits on many connections and process sentinels at once, with a deadline, and
  reports which processes died, with their exit codes (:func:`join_all` joins them all within
  one timeout);
- :class:`MemoryWatch` samples the workers' resident memory in the background, so that a
  worker SIGKILLed (the OOM killer's way) is reported with the last memory seen;
- :class:`DeathWatch` blocks on the worker processes in the background and calls back at
  once when one exits, so that the driver's waits block in one piece (the callback rings the
  wait) instead of polling ``is_alive`` between slices.
"""

from __future__ import annotations

import _thread
import collections
import contextlib
import ctypes
import ctypes.util
import faulthandler
import functools
import logging
import math
import multiprocessing
import multiprocessing.connection
import os
import pickle
import re
import select
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import psutil

from envfleet._core.envgroup import EnvFailure
from envfleet._core.protocol import Failure, RemoteError
from envfleet._core.stacks import format_frames, runs_env

logger = logging.getLogger("envfleet")

__all__ = [
    "STACKS_SIGNAL",
    "DeathWatch",
    "DriverFiles",
    "Exit",
    "MemoryWatch",
    "Watch",
    "die_with",
    "die_with_parent",
    "failure_reply",
    "join_all",
    "remote_error",
    "spawn",
    "BOOTSTRAP_FIX",
    "BootstrapReport",
    "ask_stacks",
    "fatal_stacks",
    "bootstrap_report",
    "read_bytes",
    "read_text",
    "steady_growth",
    "watch",
    "watch_stacks",
]

_PR_SET_PDEATHSIG = 1


def spawn(
    start_method: str | None | Any,
    target: Callable[..., Any],
    args: tuple[Any, ...],
    name: str,
    report_path: str | None = None,
) -> Any:
    """Start ``target(*args)`` in a new daemonic process and return it (started).

    Args:
        start_method: ``"fork"``, ``"spawn"``, ``"forkserver"``, ``None`` (the platform's),
            or a ``multiprocessing`` context already chosen.
        target, args: what the process runs; ``args`` must pickle under ``spawn`` and
            ``forkserver``.
        name: the process name (``ps`` and logs show it).
        report_path: a file the driver made and reads after the process died (its stack
            file): under ``spawn`` and ``forkserver``, a process that cannot start because
            the main module it imports starts worker processes on import writes its
            :class:`BootstrapReport` there (:func:`bootstrap_report` reads it). Until the
            process runs ``target``, its name carries this path: the name is all that
            ``multiprocessing`` hands a child before the child imports the main module.

    Raises:
        ValueError: ``start_method`` is not a start method of this platform.
        RuntimeError: called while this process is itself a ``spawn`` or ``forkserver``
            child importing its parent's main module (multiprocessing's "bootstrapping
            phase" error), with a note naming the fix.
        SystemExit: the same, in an envfleet worker that was given a ``report_path``: it has
            told its driver, and exits with code 1 as the error would have, quietly.
    """
    ctx: Any = (
        multiprocessing.get_context(start_method)
        if start_method is None or isinstance(start_method, str)
        else start_method
    )
    if report_path is not None and ctx.get_start_method() != "fork":
        proc = ctx.Process(
            target=_run_named,
            args=(name, target, args),
            name=f"{name}{_REPORT_TAG}{report_path}",
            daemon=True,
        )
    else:
        proc = ctx.Process(target=target, args=args, name=name, daemon=True)
    try:
        proc.start()
    except RuntimeError as exc:
        if getattr(multiprocessing.current_process(), "_inheriting", False) and (
            _report_bootstrap(exc)
        ):
            # An envfleet worker that could not start: the driver says why, with this stack;
            # exit as multiprocessing would (code 1), without a traceback per worker.
            raise SystemExit(1) from exc
        raise
    proc.name = name  # the child got the long name already
    return proc


# Until it runs its target, a worker's process name is its name, this tag and the path of
# the file where it reports a bootstrapping failure (spawn's report_path).
_REPORT_TAG = " reports-to "
_BOOTSTRAP_MARK = "envfleet: the main module started worker processes on import\n"
BOOTSTRAP_FIX = (
    'put the code that makes and uses the vector env under `if __name__ == "__main__":`, '
    'or pass backend=envfleet.Processes(context="fork") (Linux only)'
)


def _run_named(name: str, target: Callable[..., Any], args: tuple[Any, ...]) -> Any:
    """A worker's entry under ``spawn``/``forkserver`` with a report path: take back its
    plain name (the long one carried the path through the bootstrap), then run ``target``."""
    multiprocessing.current_process().name = name
    return target(*args)


@dataclass(frozen=True)
class BootstrapReport:
    """What a worker that could not start wrote to its report file when the main module it
    imported (``spawn`` and ``forkserver`` children import it first) started worker
    processes on import: where in the main module (``"FILE, line N"``, ``""`` unknown)
    and its stack with multiprocessing's error (``traceback``)."""

    where: str
    traceback: str


def bootstrap_report(text: str) -> BootstrapReport | None:
    """The :class:`BootstrapReport` in ``text`` (what a worker wrote to its report file, see
    :func:`spawn`), ``None`` when it holds none (the worker started, or died for another
    reason)."""
    if not text.startswith(_BOOTSTRAP_MARK):
        return None
    where, _, trace = text[len(_BOOTSTRAP_MARK) :].partition("\n")
    return BootstrapReport(where, trace)


def _report_bootstrap(exc: RuntimeError) -> bool:
    """In a ``spawn``/``forkserver`` child importing its parent's main module, which starts
    worker processes on import (multiprocessing refused with ``exc``): name the fix in
    ``exc``'s notes, and tell the driver in the file its name carries (an envfleet worker's;
    another process's child has none). Returns whether the driver was told."""
    # The stack from the outermost frame to multiprocessing's raise (exc's traceback starts
    # at spawn(), which caught it).
    tb = exc.__traceback__
    outer = traceback.extract_stack(tb.tb_frame.f_back) if tb is not None else []
    stack = traceback.StackSummary.from_list([*outer, *traceback.extract_tb(tb)])
    trace = "".join(
        ["Traceback (most recent call last):\n", *stack.format()]
        + traceback.format_exception_only(type(exc), exc)
    )
    add_note = getattr(exc, "add_note", None)  # Python 3.11+
    if add_note is not None:
        add_note(f"envfleet: the main module starts worker processes on import; {BOOTSTRAP_FIX}")
    _, tag, path = multiprocessing.current_process().name.partition(_REPORT_TAG)
    if not tag:
        return False
    main = sys.modules.get("__mp_main__") or sys.modules.get("__main__")
    main_file = getattr(main, "__file__", None)
    calls = [f for f in outer if main_file is not None and f.filename == main_file]
    where = f"{calls[-1].filename}, line {calls[-1].lineno}" if calls else ""
    try:  # not created when missing: the driver is gone, or gave this worker up
        with open(os.open(path, os.O_WRONLY | os.O_APPEND), "a", encoding="utf-8") as out:
            out.write(f"{_BOOTSTRAP_MARK}{where}\n{trace}")
    except OSError:
        return False
    return True


def die_with_parent(parent_pid: int, start_method: str) -> None:
    """Ask Linux to SIGKILL this process when the driver dies; exit if it already has.

    Call it first in the worker. Under forkserver the worker's parent is the fork server, not
    the driver; there the worker relies on its pipe: the driver's death closes it.
    """
    if start_method == "forkserver" or not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:  # the driver died before prctl took effect
        os._exit(0)


def die_with(pid: int) -> None:
    """Kill this process (SIGKILL) when process ``pid`` exits, or at once if it is gone. A
    Ray env actor dies with the envfleet helper of its node
    (:mod:`envfleet._backends.ray.helper`), which holds its stack file and action log: the
    driver then reports the actor's death, rather than the actor running on with nothing
    left to read its files after a crash.

    On Linux a thread with no Python frame but one waits on a pidfd of ``pid`` (so the
    actor's stack dumps show one line of it); elsewhere a daemon thread waits with
    psutil."""
    try:
        proc = psutil.Process(pid)
        fd = os.pidfd_open(pid) if hasattr(os, "pidfd_open") else None
        if not proc.is_running():  # gone, and the pid taken again, before the pidfd
            raise psutil.NoSuchProcess(pid)
    except psutil.Error:
        os.kill(os.getpid(), signal.SIGKILL)
        return
    except OSError:
        fd = None
    if fd is not None:
        _thread.start_new_thread(_die_when_readable, (fd,))
    else:
        threading.Thread(
            target=_die_after, args=(proc,), name="envfleet-die-with", daemon=True
        ).start()


def _die_when_readable(fd: int) -> None:
    select.select([fd], [], [])  # a pidfd is readable once its process has exited
    os.kill(os.getpid(), signal.SIGKILL)


def _die_after(proc: Any) -> None:
    with contextlib.suppress(psutil.Error):
        proc.wait()
    os.kill(os.getpid(), signal.SIGKILL)


def remote_error(failure: BaseException, env_index: int, method: str) -> RemoteError:
    """What a worker sends back for an exception: type, message, formatted traceback and the
    exception itself pickled (``None`` when it does not pickle and unpickle).

    ``failure``: the exception, or an :class:`~envfleet._core.envgroup.EnvFailure` whose
    ``__cause__`` is the env's exception (then that one is reported).
    """
    cause = failure.__cause__ if isinstance(failure, EnvFailure) else failure
    assert cause is not None
    tb = "".join(traceback.format_exception(type(cause), cause, cause.__traceback__))
    blob: bytes | None
    try:
        blob = pickle.dumps(cause, pickle.HIGHEST_PROTOCOL)
        pickle.loads(blob)  # some exceptions pickle but do not unpickle
    except Exception:
        blob = None
    recording = getattr(failure, "recording", None)
    return RemoteError(env_index, method, type(cause).__qualname__, str(cause), tb, blob, recording)


def failure_reply(error: RemoteError) -> Failure:
    """The reply of a worker whose command failed with one error."""
    return Failure([error])


@dataclass(frozen=True)
class Exit:
    """A process found dead: its position in the list watched and its exit code (negative:
    killed by signal ``-exitcode``)."""

    index: int
    exitcode: int | None


@dataclass
class Watch:
    """What one :func:`watch` found: ``readable`` connections (positions in the list given)
    and ``dead`` processes, each in list order."""

    readable: list[int] = field(default_factory=list)
    dead: list[Exit] = field(default_factory=list)


def watch(
    procs: Sequence[Any],
    conns: Sequence[Connection] = (),
    timeout: float | None = 0.0,
) -> Watch:
    """Wait until a connection of ``conns`` is readable or a process of ``procs`` has exited,
    at most ``timeout`` seconds (``None``: for good; ``0``: look now); report both.

    One ``multiprocessing.connection.wait`` covers every connection and every process
    sentinel. Deaths are confirmed with ``waitpid`` (``is_alive``) for every process, so one
    whose sentinel is still held open by a child it forked is reported too (at the latest
    when the wait ends).
    """
    objects: list[Any] = [*conns, *(p.sentinel for p in procs)]
    if objects and timeout != 0.0:
        multiprocessing.connection.wait(objects, timeout)
    found = Watch()
    for i, conn in enumerate(conns):
        with contextlib.suppress(OSError, ValueError):  # a closed connection: not readable
            if conn.poll():
                found.readable.append(i)
    for i, proc in enumerate(procs):
        if not proc.is_alive():
            found.dead.append(Exit(i, proc.exitcode))
    return found


def join_all(procs: Sequence[Any], timeout: float) -> None:
    """Wait until every process has exited, all within one ``timeout`` in seconds (one wait
    on their sentinels at a time, whichever exits first)."""
    deadline = time.monotonic() + timeout
    waiting = list(procs)
    while waiting:
        remaining = deadline - time.monotonic()
        found = watch(waiting, timeout=max(0.0, remaining))
        gone = {exit_.index for exit_ in found.dead}
        waiting = [p for i, p in enumerate(waiting) if i not in gone]
        if remaining <= 0:
            break
    for proc in procs:  # reap what exited (sets exitcode)
        if not proc.is_alive():
            proc.join(0)


RSS_PERIOD_S = 1.0  # seconds between two samples of the workers' resident memory


STACKS_SIGNAL = signal.SIGUSR1  # asks a worker for its stacks (watch_stacks)
STACKS_WAIT_S = 2.0  # the most seconds a hung worker gets to write its stacks
STACKS_POLL_S = 0.01  # seconds between looks at a stack file being written


def watch_stacks(path: str | None) -> Any:
    """Have :mod:`faulthandler` write every thread's stack to ``path`` (appending) when this
    process gets :data:`STACKS_SIGNAL` (the driver asks before it kills a hung worker) and
    when it dies of a fatal signal (SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT: it then dies of
    that signal still). The dump runs in the signal handler, in C: a worker stuck in C code
    (``time.sleep``, a socket read, a simulator) still shows the Python frame that called it.
    The worker removes the file's name once it has it open (the driver holds a descriptor;
    on Ray, the helper of the actor's node opens it through ``/proc/PID/fd``). Returns the
    open file (kept for the process's life), ``None`` without a path."""
    if path is None:
        return None
    out = open(path, "a", encoding="utf-8")  # noqa: SIM115  (open until the process exits)
    with contextlib.suppress(OSError):
        os.unlink(path)  # the driver keeps its own descriptor: nothing is left on disk
    # Enabled already (inherited from a driver that enabled it), enable() keeps the signal
    # handlers it finds, which another library may have replaced since (pygame's parachute
    # takes SIGSEGV): disable first, so that faulthandler's own handlers are installed.
    faulthandler.disable()
    faulthandler.enable(out, all_threads=True)
    # faulthandler dumps the first FAULTHANDLER_THREADS threads only (newest first): in a
    # worker stepping hundreds of envs at once, the one that hangs may be past them. Its
    # Python handler, chained after the dump, adds the stacks of the threads inside an env
    # (it runs in the main thread, which waits for the crew in a lock that a signal
    # interrupts; a main thread stuck in C runs it never, and is in the dump itself).
    try:
        signal.signal(STACKS_SIGNAL, functools.partial(_env_stacks, out))
        chain = True
    except ValueError:  # not the main thread (a Ray actor's): the dump alone
        chain = False
    faulthandler.register(STACKS_SIGNAL, out, all_threads=True, chain=chain)
    return out


FAULTHANDLER_THREADS = 100  # the threads faulthandler dumps at most (CPython's MAX_NTHREADS)


def _env_stacks(out: Any, signum: int, frame: Any) -> None:
    """After faulthandler's dump: where it could not hold every thread, the stacks of the
    threads that are inside an env (:func:`envfleet._core.stacks.runs_env`), in its format."""
    frames = sys._current_frames()
    if len(frames) <= FAULTHANDLER_THREADS:
        return
    blocks = [format_frames(f, ident, current=False) for ident, f in frames.items() if runs_env(f)]
    if blocks:
        out.write("\n" + "\n".join(blocks))
        out.flush()


def ask_stacks(
    targets: dict[int, tuple[int, int]],
    alive: Callable[[int], bool],
    wait_s: float = STACKS_WAIT_S,
) -> dict[int, str]:
    """Ask each worker of ``targets`` (worker -> (pid, the driver's descriptor of its stack
    file)) for its stacks (:data:`STACKS_SIGNAL`, which its faulthandler answers in its
    file) and read them: worker -> text, for those that wrote within ``wait_s`` seconds (a
    dump still growing is read again until it stops). ``alive(w)``: whether it still runs.
    A worker not yet watching the signal (one still starting) dies of it: it was about to be
    killed. The file keeps what it held: each answer is read from where the file ended when
    asked, so that a fatal signal's dump, written as the worker was asked, is still there for
    :func:`fatal_stacks`."""
    asked: dict[int, tuple[int, int]] = {}  # worker -> (fd, where its answer starts)
    for w, (pid, fd) in targets.items():
        with contextlib.suppress(OSError):
            start = os.fstat(fd).st_size  # the worker appends
            os.kill(pid, STACKS_SIGNAL)
            asked[w] = (fd, start)
    found: dict[int, str] = {}
    sizes: dict[int, int] = {}
    deadline = time.monotonic() + wait_s
    while asked and time.monotonic() < deadline:
        for w, (fd, start) in list(asked.items()):
            with contextlib.suppress(OSError):
                size = os.fstat(fd).st_size
                if size > start and sizes.get(w) == size:  # written, and no longer growing
                    found[w] = read_text(fd, start)
                    del asked[w]
                sizes[w] = size
            if not alive(w):
                asked.pop(w, None)
        time.sleep(STACKS_POLL_S)
    return found


# The line faulthandler starts its dump with at a fatal signal (SIGSEGV, SIGBUS, SIGFPE,
# SIGILL, SIGABRT), and not when asked for stacks by STACKS_SIGNAL.
_FATAL_LINE = re.compile(r"^Fatal Python error: ", re.MULTILINE)


def fatal_stacks(text: str) -> str:
    """Of a stack file's ``text``, what faulthandler wrote when its worker died of a fatal
    signal: every thread's stack, from the last ``Fatal Python error:`` line on; ``""`` when
    it died of none (SIGKILL, ``os._exit``). The answers to :func:`ask_stacks` before it are
    left out: they are not where it died."""
    starts = [found.start() for found in _FATAL_LINE.finditer(text)]
    return text[starts[-1] :] if starts else ""


def read_bytes(fd: int | None, nbytes: int | None = None, start: int = 0) -> bytes:
    """The file ``fd`` from byte ``start``: to its end, or ``nbytes`` bytes (``b""`` when
    none or unreadable): what a worker wrote for the driver, even after it died."""
    if fd is None:
        return b""
    try:
        size = os.fstat(fd).st_size - start if nbytes is None else nbytes
        return os.pread(fd, max(0, size), start)
    except OSError:
        return b""


def read_text(fd: int | None, start: int = 0) -> str:
    """The file ``fd`` from byte ``start`` to its end, as text (``""`` when none or
    unreadable)."""
    return read_bytes(fd, start=start).decode("utf-8", errors="replace")


GROWTH_SAMPLES = 120  # the samples a worker's memory growth is fitted over
GROWTH_MIN_EPISODES = 20  # the episodes they must span for a growth figure
# A steady growth: samples over at least this many episodes, that grow together with them
# (correlation), by at least this many bytes over the samples.
STEADY_MIN_SAMPLES = 10
STEADY_MIN_EPISODES = 100
STEADY_MIN_CORRELATION = 0.9
STEADY_MIN_BYTES = 16 * 2**20


def _fit(history: list[tuple[int, int]]) -> tuple[float, float] | None:
    """(slope in bytes per episode, correlation) of resident memory against episodes."""
    if len(history) < 3 or history[-1][0] - history[0][0] < GROWTH_MIN_EPISODES:
        return None
    x = np.array([h[0] for h in history], dtype=np.float64)
    y = np.array([h[1] for h in history], dtype=np.float64)
    x -= x.mean()
    y -= y.mean()
    sxx, syy = float(x @ x), float(y @ y)
    if sxx == 0.0:
        return None
    slope = float(x @ y) / sxx
    correlation = float(x @ y) / math.sqrt(sxx * syy) if syy > 0 else 0.0
    return slope, correlation


def steady_growth(history: list[tuple[int, int]]) -> float | None:
    """The growth in bytes per 1,000 episodes of ``history`` ((episodes, resident bytes)
    samples) when it is steady: enough samples over enough episodes, rising with them
    (correlation >= 0.9) by at least 16 MiB; else ``None``."""
    fit = _fit(history)
    if fit is None or len(history) < STEADY_MIN_SAMPLES:
        return None
    slope, correlation = fit
    span = history[-1][0] - history[0][0]
    if (
        span >= STEADY_MIN_EPISODES
        and correlation >= STEADY_MIN_CORRELATION
        and slope * span >= STEADY_MIN_BYTES
    ):
        return slope * 1000.0
    return None


class DriverFiles:
    """Per worker, a file the worker writes and the driver reads, even after the worker died
    (its stacks, its action log). The driver makes it and keeps a descriptor; the worker
    opens it by name, then removes the name, so the file goes with the last of the two
    descriptors and nothing is left on disk when the driver dies."""

    def __init__(self, workers: int, prefix: str, suffix: str):
        self.prefix, self.suffix = prefix, suffix
        self.paths: list[str | None] = [None] * workers
        self.fds: list[int | None] = [None] * workers

    def new(self, g: int) -> str:
        """A new, empty file for worker ``g`` (its old one dropped): its path."""
        self.remove(g)
        fd, path = tempfile.mkstemp(prefix=f"{self.prefix}-{g}-", suffix=self.suffix)
        self.paths[g], self.fds[g] = path, fd
        return path

    def remove(self, g: int) -> None:
        """Close the driver's descriptor of worker ``g``'s file, and remove its name if the
        worker never did (it died before it opened it)."""
        path, self.paths[g] = self.paths[g], None
        fd, self.fds[g] = self.fds[g], None
        if fd is not None:
            os.close(fd)
        if path is not None:
            with contextlib.suppress(OSError):
                os.unlink(path)

    def remove_all(self) -> None:
        for g in range(len(self.paths)):
            self.remove(g)

    def read(self, g: int, nbytes: int | None = None) -> bytes:
        """All worker ``g`` has written to its file so far, or its first ``nbytes`` bytes
        (``b""`` when none)."""
        return read_bytes(self.fds[g], nbytes)


class MemoryWatch:
    """Each worker process's resident memory, sampled every :data:`RSS_PERIOD_S` seconds by
    a daemon thread (psutil; a sample costs a few microseconds a worker), so that the last
    value seen before a worker died is known (:meth:`last`), and how it grows with the
    episodes its envs began (:meth:`growth`; ``episodes(w)`` reads the worker's count). A
    steady growth (:func:`steady_growth`) logs one warning per worker naming its envs.

    Call :meth:`watch` with each worker's pid as it starts, :meth:`start` once the first
    workers are spawned, and :meth:`stop` at close.
    """

    def __init__(
        self,
        episodes: Callable[[int], int | None] | None = None,
        ranges: Sequence[tuple[int, int]] = (),
    ) -> None:
        self._pids: dict[int, int] = {}  # worker -> pid
        self._last: dict[int, tuple[int, float]] = {}  # worker -> (bytes, monotonic time)
        self._episodes = episodes
        self._ranges = list(ranges)
        # worker -> its last samples: (episodes begun, resident bytes)
        self._history: dict[int, collections.deque[tuple[int, int]]] = {}
        self._warned: set[int] = set()
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None

    def watch(self, w: int, pid: int) -> None:
        """Sample worker ``w`` (process ``pid``) from now on (a new pid forgets the old)."""
        self._pids[w] = pid
        self._last.pop(w, None)
        self._history[w] = collections.deque(maxlen=GROWTH_SAMPLES)
        self._warned.discard(w)

    def forget(self, w: int) -> None:
        """Stop sampling worker ``w`` (closed, or replaced by another transport's worker)."""
        self._pids.pop(w, None)
        self._last.pop(w, None)
        self._history.pop(w, None)
        self._warned.discard(w)

    def episodes(self, w: int) -> int:
        """The episodes worker ``w``'s envs began, at its last sample."""
        history = self._history.get(w)
        return history[-1][0] if history else 0

    def growth(self, w: int) -> float | None:
        """Worker ``w``'s resident bytes per 1,000 episodes over its last samples (least
        squares), ``None`` until they span :data:`GROWTH_MIN_EPISODES` episodes."""
        fit = _fit(list(self._history.get(w, ())))
        return None if fit is None else fit[0] * 1000.0

    def start(self) -> None:
        """Start sampling, once the first workers are spawned (fork is simplest from a
        process with one thread)."""
        if self._thread is None and not self._stopped.is_set():
            self._thread = threading.Thread(target=self._run, name="envfleet-memory", daemon=True)
            self._thread.start()

    def last(self, w: int) -> tuple[int, float] | None:
        """Worker ``w``'s last sample: (resident bytes, ``time.monotonic()`` when taken)."""
        return self._last.get(w)

    def sample(self) -> None:
        """Sample every watched worker now."""
        for w, pid in list(self._pids.items()):
            with contextlib.suppress(psutil.Error):
                rss = psutil.Process(pid).memory_info().rss
                # A zombie (dead, not yet reaped) reads 0: the last live sample stands.
                if rss and self._pids.get(w) == pid:
                    self._last[w] = (int(rss), time.monotonic())
                    self._note(w, int(rss))

    def _note(self, w: int, rss: int) -> None:
        """Keep ``(episodes, rss)`` for the growth of worker ``w``; warn once at a steady one."""
        episodes = self._episodes(w) if self._episodes is not None else None
        history = self._history.get(w)
        if episodes is None or history is None:
            return
        history.append((episodes, rss))
        if w in self._warned:
            return
        growth = steady_growth(list(history))
        if growth is not None:
            self._warned.add(w)
            start, stop = self._ranges[w] if w < len(self._ranges) else (0, 0)
            logger.warning(
                "worker %d's resident memory grows steadily: %+.1f MiB per 1,000 episodes "
                "over its last %d episodes (now %.1f MiB); a leak suspect among its "
                "sub-environments %d..%d. envfleet.Recycle(max_rss_mb=...) replaces a worker "
                "before it runs out of memory",
                w,
                growth / 2**20,
                history[-1][0] - history[0][0],
                rss / 2**20,
                start,
                stop - 1,
            )

    def stop(self) -> None:
        """End the sampling thread (bounded: it wakes within one period)."""
        if sys.is_finalizing():
            # A close from a __del__ at interpreter finalization: the daemon thread is frozen
            # for good, maybe holding the Event's lock, which set() would wait for forever.
            self._thread = None
            return
        self._stopped.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(RSS_PERIOD_S + 1.0)

    def _run(self) -> None:
        while not self._stopped.wait(RSS_PERIOD_S):
            self.sample()


# Seconds between the death watch's waitpid polls where a process has no pidfd (not Linux 5.3+).
DEATH_POLL_S = 0.02


class DeathWatch:
    """A daemon thread that blocks on every watched process and calls ``on_death(proc)`` (in
    that thread) once per process, as soon as it exits, as CPython's
    ``concurrent.futures.ProcessPoolExecutor`` wakes its manager on a process sentinel.

    It blocks on each process's pidfd (Linux 5.3+: readable once the process exits, whoever
    else holds its pipes: a worker that forked keeps its sentinel open in the child), else on
    its sentinel with a ``waitpid`` poll every :data:`DEATH_POLL_S` seconds. Call :meth:`add`
    with each process as it starts (the thread starts with the first) and :meth:`stop` at
    close.

    Args:
        on_death: called with each process that exited (from the watch's thread; it must not
            block).
    """

    def __init__(self, on_death: Callable[[Any], None]) -> None:
        self._on_death = on_death
        self._lock = threading.Lock()
        self._watched: dict[int, tuple[Any, int | None]] = {}  # id(proc) -> (proc, pidfd)
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)  # a full pipe has a wake-up in it already
        self._stopped = False
        self._thread: threading.Thread | None = None

    def add(self, proc: Any) -> None:
        """Watch ``proc`` (started) from now on; one that exited already is reported at once."""
        pidfd = None
        with contextlib.suppress(AttributeError, OSError):  # no pidfds here, or reaped already
            pidfd = os.pidfd_open(proc.pid)
        with self._lock:
            if self._stopped:
                if pidfd is not None:
                    os.close(pidfd)
                return
            self._watched[id(proc)] = (proc, pidfd)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="envfleet-deaths", daemon=True
                )
                self._thread.start()
            self._wake()  # under the lock: the thread closes the pipe under it, once stopped

    def stop(self) -> None:
        """End the watch: nothing is reported after this, and its thread has closed its
        descriptors when this returns (bounded: it wakes at once)."""
        if sys.is_finalizing():
            # A close from a __del__ at interpreter finalization: the daemon thread is frozen
            # for good, maybe holding the lock.
            return
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
            thread = self._thread
            if thread is not None:
                self._wake()  # the thread closes the pipe and the pidfds
            else:
                self._close_fds()
        if thread is not None and thread is not threading.current_thread():
            thread.join(5.0)

    def _wake(self) -> None:
        with contextlib.suppress(BlockingIOError):
            os.write(self._wake_w, b"x")

    def _close_fds(self) -> None:
        for _, pidfd in self._watched.values():
            if pidfd is not None:
                with contextlib.suppress(OSError):
                    os.close(pidfd)
        self._watched.clear()
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)

    def _run(self) -> None:
        while True:
            with self._lock:
                if self._stopped:
                    self._close_fds()
                    return
                watched = list(self._watched.items())
            polled = any(pidfd is None for _, (_, pidfd) in watched)
            objects: list[Any] = [self._wake_r]
            for _, (proc, pidfd) in watched:
                objects.append(proc.sentinel if pidfd is None else pidfd)
            ready: set[Any] = set()
            with contextlib.suppress(OSError, ValueError):  # a process closed meanwhile
                ready = set(
                    multiprocessing.connection.wait(objects, DEATH_POLL_S if polled else None)
                )
                if self._wake_r in ready:
                    os.read(self._wake_r, 4096)
            for key, (proc, pidfd) in watched:
                if pidfd is not None:
                    gone = pidfd in ready
                else:
                    try:
                        gone = not proc.is_alive()
                    except ValueError:  # closed: dropped by its owner
                        gone = True
                if not gone:
                    continue
                with self._lock:
                    if self._stopped or self._watched.pop(key, None) is None:
                        continue
                if pidfd is not None:
                    os.close(pidfd)
                self._on_death(proc)
