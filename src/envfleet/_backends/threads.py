"""``backend="threads"``: each EnvGroup runs in its own thread of the driver process.

Threads share the driver's memory, so the batch needs no shared-memory segment and nothing is
pickled. They pay off for envs that release the GIL while they step (MuJoCo, most native
simulators, I/O-bound envs) and on free-threaded Python; for pure-Python envs on a standard
interpreter the GIL lets one thread run at a time and ``serial`` is faster.

Without a ``step_timeout`` the calling thread steps the first group itself while the others
run. Only steps and resets run in parallel; ``call``, ``set_attr`` and ``render`` run group by
group in the calling thread, as renderers such as pygame are not thread-safe.

What is not thread-safe is serialized: pygame's ``gfxdraw`` polygon fills (SDL2_gfx keeps
their scanline buffer in static memory, and pygame releases the GIL around them), which
``CarRacing-v3`` calls in every step and reset (see :func:`serialize_gfxdraw`).

A thread cannot be killed: after a timeout the vector env is closed and a hung thread is left
behind (a daemon thread, it does not keep the interpreter alive), and restart policies rebuild
only envs that raised, never hung ones.
"""

from __future__ import annotations

import functools
import logging
import queue
import sys
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, NoReturn, cast

import gymnasium

from envfleet._backends.base import WorkerLayout
from envfleet._backends.inprocess import InProcessBackend
from envfleet._backends.supervisor import Ledger
from envfleet._core.buffers import Block
from envfleet._core.cores import usable_cores
from envfleet._core.envgroup import EnvFailure, EnvGroup
from envfleet._core.errors import StartTimeoutError
from envfleet._core.protocol import Command

__all__ = ["DEFAULT_CLOSE_TIMEOUT", "ThreadsBackend", "serialize_gfxdraw"]

logger = logging.getLogger("envfleet")

DEFAULT_CLOSE_TIMEOUT = 5.0  # seconds for the threads to finish before close gives up on them

_IDLE_GRACE = 1.0  # seconds an idle thread gets to see the stop message, even when terminating
_Reply = tuple[int, Any, "EnvFailure | None"]


_GFXDRAW_LOCK = threading.Lock()


def serialize_gfxdraw() -> None:
    """Make the functions of ``pygame.gfxdraw``, once imported, run one at a time.

    SDL2_gfx's filled polygons (``filled_polygon``, ``textured_polygon``, ``filled_trigon``,
    ``pie``...) keep their scanline buffer in static memory and pygame releases the GIL while
    they draw, so two threads drawing at once corrupt each other's pixels: ``CarRacing-v3``,
    which draws its road so in every step and reset, gave other observations than
    SyncVectorEnv from the first reset. Every ``gfxdraw`` function is wrapped in one lock (an
    uncontended lock costs well under a microsecond beside a draw); done once per process.
    """
    gfxdraw = sys.modules.get("pygame.gfxdraw")
    if gfxdraw is None or getattr(gfxdraw, "_envfleet_serialized", False):
        return
    for name in dir(gfxdraw):
        draw = getattr(gfxdraw, name)
        if name.startswith("_") or not callable(draw):
            continue

        @functools.wraps(draw)
        def serialized(*args: Any, _draw: Callable[..., Any] = draw, **kwargs: Any) -> Any:
            with _GFXDRAW_LOCK:
                return _draw(*args, **kwargs)

        setattr(gfxdraw, name, serialized)
    setattr(gfxdraw, "_envfleet_serialized", True)  # noqa: B010  (a module: mypy)


class ThreadsBackend(InProcessBackend):
    """One thread per EnvGroup (the calling thread runs group 0 when ``inline_first``).

    Its supervisor rebuilds envs that raise (restart policy), in a synchronous round and in a
    first-ready pool; a thread past the timeout ends the vector env (it cannot be killed).

    Args:
        layout, block, first_env, ledger: as :class:`InProcessBackend`.
        inline_first: run group 0 in the calling thread during :meth:`submit` (no timeout
            can then interrupt it).
        start_timeout: seconds the threads may take to build groups 1 and up (group 0 is
            built in the calling thread); ``None``: no bound. Past it
            :class:`StartTimeoutError` is raised and the late threads are left behind.
    """

    def __init__(
        self,
        layout: WorkerLayout,
        block: Block,
        first_env: gymnasium.Env[Any, Any] | None = None,
        ledger: Ledger | None = None,
        *,
        inline_first: bool = True,
        start_timeout: float | None = None,
    ):
        self._start_timeout = start_timeout
        super().__init__(layout, block, first_env, ledger)
        serialize_gfxdraw()  # the factories have imported what the envs draw with
        first_thread = 1 if inline_first else 0
        self._inboxes: dict[int, queue.SimpleQueue[tuple[Command, Any] | None]] = {}
        self._replies: queue.SimpleQueue[_Reply] = queue.SimpleQueue()
        self._threads: dict[int, threading.Thread] = {}
        for w in range(first_thread, len(self.ranges)):
            self._inboxes[w] = queue.SimpleQueue()
            thread = threading.Thread(
                target=self._serve, args=(w,), name=f"envfleet-thread-{w}", daemon=True
            )
            self._threads[w] = thread
            thread.start()
        self._pending: list[int] = []
        self._local: dict[int, Any] = {}
        self._local_failures: dict[int, EnvFailure] = {}

    def _build_groups(
        self, layout: WorkerLayout, first_env: gymnasium.Env[Any, Any] | None
    ) -> None:
        """Group 0 here, every other group in a thread of its own, at the same time; bounded
        by ``start_timeout``."""
        n = len(self.ranges)
        built: list[EnvGroup | None] = [None] * n
        errors: dict[int, BaseException] = {}
        building = [start for start, _ in self.ranges]  # per group: the env being built

        def track(w: int, e: int, fn: Callable[[], Any]) -> Callable[[], Any]:
            def call() -> Any:
                building[w] = e
                return fn()

            return call

        def build(w: int) -> None:
            start, stop = self.ranges[w]
            fns = [track(w, start + j, fn) for j, fn in enumerate(layout.bound_fns(start, stop))]
            try:
                built[w] = self._new_group(layout, w, None, fns)
            except BaseException as exc:  # reported by the calling thread
                errors[w] = exc

        threads = {
            w: threading.Thread(target=build, args=(w,), name=f"envfleet-build-{w}", daemon=True)
            for w in range(1, n)
        }
        for thread in threads.values():
            thread.start()
        try:
            built[0] = self._new_group(layout, 0, first_env)
        except BaseException as exc:
            errors[0] = exc
        timeout = self._start_timeout
        deadline = None if timeout is None else time.monotonic() + timeout
        for thread in threads.values():
            thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        late = [w for w, thread in threads.items() if thread.is_alive()]
        # What was built is closed by the caller if anything failed (a late thread's group,
        # built after this gave up, is left with the thread).
        self.groups = [g for g in built if g is not None]
        if late:
            envs = [e for w in late for e in range(building[w], self.ranges[w][1])]
            raise StartTimeoutError(
                f"sub-environments {envs} were not built within {timeout} s (start_timeout); "
                f"a thread cannot be killed: threads {late} were left behind",
                envs,
                cast(float, timeout),
            )
        if errors:
            raise errors[min(errors)]

    late_what = "threads"
    late_fate = "a thread cannot be killed: they were left behind"

    @property
    def num_workers(self) -> int:
        """Groups, each in its own thread (the calling thread's included)."""
        return len(self.ranges)

    def _serve(self, w: int) -> None:
        inbox = self._inboxes[w]
        while True:
            item = inbox.get()
            if item is None:
                return
            command, payload = item
            try:
                self._replies.put((w, self.run_group(w, command, payload), None))
            except EnvFailure as failure:
                self._replies.put((w, None, failure))
            except BaseException as exc:
                # An env's SystemExit, KeyboardInterrupt or GeneratorExit (which EnvGroup lets
                # through), or a bug outside any env: report it against the group, never let
                # it end the thread silently (the caller would wait for good).
                wrapped = EnvFailure(self.ranges[w][0], command.name.lower())
                wrapped.__cause__ = exc
                self._replies.put((w, None, wrapped))

    def submit(self, command: Command, payloads: Mapping[int, Any], step: int) -> None:
        self._command = command
        # Only steps and resets run in parallel: call, set_attr and render run one group at
        # a time in the calling thread, since renderers (pygame) and other env libraries keep
        # global state that is not thread-safe.
        parallel = command in (Command.STEP, Command.RESET)
        threaded = [w for w in payloads if w in self._inboxes and parallel]
        self._pending += threaded  # a first-ready pool submits while others run
        self.supervisor.sent(payloads, command)
        for w in threaded:
            self._inboxes[w].put((command, payloads[w]))
        for w in payloads:
            if w not in threaded:
                try:
                    self._local[w] = self.run_group(w, command, payloads[w])
                except EnvFailure as failure:
                    self._local_failures[w] = failure
                except BaseException:
                    self.close(0, True)  # the threads' replies would be read by the next call
                    raise

    def inline_groups(self, command: Command) -> frozenset[int]:
        if command in (Command.STEP, Command.RESET):
            return frozenset(w for w in range(len(self.ranges)) if w not in self._inboxes)
        return frozenset(range(len(self.ranges)))

    def collect(self, timeout: float | None, step: int) -> dict[int, Any]:
        results, failures = self.supervisor.guarded(self._collect, timeout)
        return self.settle(results, failures, step)

    def collect_ready(self, timeout: float | None, step: int) -> dict[int, Any]:
        if self.supervisor.has_kept():
            return self.supervisor.take_kept()
        results, failures = self.supervisor.guarded(self._collect, timeout, True)
        return self.ready_results(results, failures, step)

    def _collect(
        self, timeout: float | None, ready_only: bool = False
    ) -> tuple[dict[int, Any], dict[int, EnvFailure]]:
        """Replies of every pending thread, or with ``ready_only`` of those done once at least
        one is (or the calling thread ran one).

        ``timeout``: seconds for the whole wait; with ``ready_only``, seconds each thread may
        take from its own submit (a first-ready pool's), checked even while others reply.
        """
        results, failures = self._local, self._local_failures
        self._local, self._local_failures = {}, {}
        waiting = set(self._pending)
        supervisor = self.supervisor
        if timeout is None or not waiting:
            deadline = None
        elif ready_only:
            deadline = supervisor.deadline(waiting, timeout)
        else:
            deadline = time.monotonic() + timeout
        while waiting:
            if ready_only and (results or failures):
                remaining: float | None = 0.0
            else:
                remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                w, result, failure = self._replies.get(timeout=remaining)
            except queue.Empty:
                if ready_only and (results or failures):
                    break
                if not ready_only:
                    self._raise_late(sorted(waiting), timeout)
                late = supervisor.late(waiting, timeout)
                if late:
                    self._raise_late(late, timeout)
                deadline = supervisor.deadline(waiting, timeout)
                continue
            waiting.discard(w)
            self._pending.remove(w)
            if failure is None:
                results[w] = result
            else:
                failures[w] = failure
        if ready_only and timeout is not None and waiting:
            late = supervisor.late(waiting, timeout)
            if late:
                self._raise_late(late, timeout)
        return dict(sorted(results.items())), failures

    def _raise_late(self, late: list[int], timeout: float | None) -> NoReturn:
        # A thread cannot be killed: under a restart policy too, a hung one ends the vector env.
        self.supervisor.timed_out(late, timeout)

    def close(self, timeout: float | None, terminate: bool) -> None:
        """Stop the threads, then close the envs of every group whose thread has stopped.

        A thread still busy after ``timeout`` seconds (default
        :data:`DEFAULT_CLOSE_TIMEOUT`; at once with ``terminate`` for a thread with a pending
        call) is left running, with its envs.
        """
        if self._closed:
            return
        self._closed = True
        for inbox in self._inboxes.values():
            inbox.put(None)
        deadline = time.monotonic() + (DEFAULT_CLOSE_TIMEOUT if timeout is None else timeout)
        busy = []
        for w, thread in self._threads.items():
            remaining = max(0.0, deadline - time.monotonic())
            if w not in self._pending:
                thread.join(max(remaining, _IDLE_GRACE))  # idle: it exits at once
            elif not terminate:
                thread.join(remaining)
            if thread.is_alive():
                busy.append(w)
        if busy:
            logger.warning("threads %s are still busy; leaving their envs open", busy)
        # Each group closes in a thread of its own, so an env that hangs in close() cannot
        # hold the caller past the deadline (it is left behind with its thread).
        closers = [
            threading.Thread(target=group.close, name=f"envfleet-close-{w}", daemon=True)
            for w, group in enumerate(self.groups)
            if w not in busy
        ]
        for closer in closers:
            closer.start()
        end = max(deadline, time.monotonic() + _IDLE_GRACE)
        for closer in closers:
            closer.join(max(0.0, end - time.monotonic()))
        hung = [closer.name for closer in closers if closer.is_alive()]
        if hung:
            logger.warning("%s still running after the close timeout; left behind", hung)
        self.groups = []


# -- registration (envfleet._backends.registry) ----------------------------------------------

from envfleet._backends.base import worker_ranges  # noqa: E402
from envfleet._backends.registry import (  # noqa: E402
    BackendSpec,
    BuildRequest,
    Plan,
    PlanRequest,
    register,
)


def _plan(request: PlanRequest) -> Plan:
    """``num_workers`` threads, default one per usable core (at most one per env)."""
    num_workers = request.num_workers or min(request.num_envs, usable_cores())
    return Plan(worker_ranges(request.num_envs, num_workers))


def _build(request: BuildRequest) -> ThreadsBackend:
    return ThreadsBackend(
        request.layout,
        request.block(shared=False),
        first_env=request.first_env,
        ledger=request.ledger,
        inline_first=request.step_timeout is None and not request.pool,
        start_timeout=request.start_timeout,
    )


register(BackendSpec("threads", build=_build, plan=_plan))
