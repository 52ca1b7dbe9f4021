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
from collections.abc import Callable, Sequence
from typing import Any, cast

import gymnasium

from envfleet._backends.base import WorkerLayout
from envfleet._backends.inprocess import InProcessTransport
from envfleet._backends.rounds import RoundDriver
from envfleet._backends.supervisor import Ledger
from envfleet._backends.transport import NOTHING, Seen
from envfleet._core.buffers import Block
from envfleet._core.cores import usable_cores
from envfleet._core.envgroup import EnvFailure, EnvGroup
from envfleet._core.errors import StartTimeoutError
from envfleet._core.protocol import Command
from envfleet._core.stacks import first_at, format_frames

__all__ = ["DEFAULT_CLOSE_TIMEOUT", "ThreadsTransport", "serialize_gfxdraw"]

logger = logging.getLogger("envfleet")

DEFAULT_CLOSE_TIMEOUT = 5.0  # seconds for the threads to finish before close gives up on them

_IDLE_GRACE = 1.0  # seconds an idle thread gets to see the stop message, even when terminating
_Reply = tuple[int, Any, "EnvFailure | None"]
_PARALLEL = (Command.STEP, Command.RESET)  # the commands the threads run


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


class ThreadsTransport(InProcessTransport):
    """One thread per EnvGroup (the calling thread runs group 0 when ``inline_first``); a
    :class:`~envfleet._backends.transport.Transport`.

    Steps and resets run in the groups' threads; ``call``, ``set_attr``, ``render`` and
    restarts run one group at a time in the calling thread (renderers such as pygame keep
    global state that is not thread-safe). The round driver rebuilds envs that raise (restart
    policy); a thread past the timeout ends the vector env (it cannot be killed).

    Args:
        layout, block, first_env, ledger, pool: as :class:`InProcessTransport`.
        inline_first: run group 0 in the calling thread when sent its command (no timeout
            can then interrupt it).
        start_timeout: seconds the threads may take to build groups 1 and up (group 0 is
            built in the calling thread); ``None``: no bound. Past it
            :class:`StartTimeoutError` is raised and the late threads are left behind.
    """

    late_what = "threads"
    late_fate = "a thread cannot be killed: they were left behind"

    def __init__(
        self,
        layout: WorkerLayout,
        block: Block,
        first_env: gymnasium.Env[Any, Any] | None = None,
        ledger: Ledger | None = None,
        pool: bool = False,
        *,
        inline_first: bool = True,
        start_timeout: float | None = None,
    ):
        self._start_timeout = start_timeout
        super().__init__(layout, block, first_env, ledger, pool)
        serialize_gfxdraw()  # the factories have imported what the envs draw with
        first_thread = 1 if inline_first else 0
        self._inboxes: dict[int, queue.SimpleQueue[tuple[Command, Any] | None]] = {}
        self._from_threads: queue.SimpleQueue[_Reply] = queue.SimpleQueue()
        self._threads: dict[int, threading.Thread] = {}
        for w in range(first_thread, len(self.ranges)):
            self._inboxes[w] = queue.SimpleQueue()
            thread = threading.Thread(
                target=self._serve, args=(w,), name=f"envfleet-thread-{w}", daemon=True
            )
            self._threads[w] = thread
            thread.start()
        self._inline = frozenset(w for w in range(len(self.ranges)) if w not in self._inboxes)

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
            stacks = _thread_stacks({w: threads[w] for w in late})
            raise StartTimeoutError(
                f"sub-environments {envs} were not built within {timeout} s (start_timeout)"
                f"{first_at(stacks, late[:1], 'thread')}; "
                f"a thread cannot be killed: threads {late} were left behind",
                envs,
                cast(float, timeout),
                stacks,
            )
        if errors:
            raise errors[min(errors)]

    def _serve(self, w: int) -> None:
        inbox = self._inboxes[w]
        while True:
            item = inbox.get()
            if item is None:
                return
            command, payload = item
            try:
                self._from_threads.put((w, self.run_group(w, command, payload), None))
            except EnvFailure as failure:
                self._from_threads.put((w, None, failure))
            except BaseException as exc:
                # An env's SystemExit, KeyboardInterrupt or GeneratorExit (which EnvGroup lets
                # through), or a bug outside any env: report it against the group, never let
                # it end the thread silently (the caller would wait for good).
                wrapped = EnvFailure(self.ranges[w][0], command.name.lower())
                wrapped.__cause__ = exc
                self._from_threads.put((w, None, wrapped))

    # -- Transport ------------------------------------------------------------------------------

    def inline(self, command: Command) -> frozenset[int]:
        return self._inline if command in _PARALLEL else self._every_group

    def send(self, w: int, command: Command, payload: Any) -> bool:
        if command in _PARALLEL and w in self._inboxes:
            self._inboxes[w].put((command, payload))
            return True
        return super().send(w, command, payload)

    def wait(
        self, workers: list[int], deadline: float | None, first: bool, spun_s: float | None = None
    ) -> Seen:
        """Until a worker of ``workers`` has a reply (its thread's, or the calling thread's
        run), or ``deadline``; then every reply already there too."""
        replies = self._replies
        if not any(w in replies for w in workers):
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                self._take(self._from_threads.get(timeout=remaining))
            except queue.Empty:
                return NOTHING
        while True:  # what else has arrived
            try:
                self._take(self._from_threads.get_nowait())
            except queue.Empty:
                break
        return Seen([w for w in workers if w in replies])

    def stacks(self, workers: list[int]) -> dict[int, str]:
        """The stack of each worker's thread, now (worker -> faulthandler's format)."""
        return _thread_stacks({w: self._threads[w] for w in workers if w in self._threads})

    def _take(self, reply: _Reply) -> None:
        w, result, failure = reply
        self._replies[w] = (result, failure)

    def close(self, timeout: float | None, terminate: bool, busy: Sequence[int]) -> None:
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
        still = []  # threads still busy after their join
        for w, thread in self._threads.items():
            remaining = max(0.0, deadline - time.monotonic())
            if w not in busy:
                thread.join(max(remaining, _IDLE_GRACE))  # idle: it exits at once
            elif not terminate:
                thread.join(remaining)
            if thread.is_alive():
                still.append(w)
        if still:
            logger.warning("threads %s are still busy; leaving their envs open", still)
        # Each group closes in a thread of its own, so an env that hangs in close() cannot
        # hold the caller past the deadline (it is left behind with its thread).
        closers = [
            threading.Thread(target=group.close, name=f"envfleet-close-{w}", daemon=True)
            for w, group in enumerate(self.groups)
            if w not in still
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


def _thread_stacks(threads: dict[int, threading.Thread]) -> dict[int, str]:
    """Worker -> the stack of its thread, now, in faulthandler's format (innermost first)."""
    frames = sys._current_frames()
    return {
        w: format_frames(frames[thread.ident], thread.ident)
        for w, thread in threads.items()
        if thread.ident is not None and thread.ident in frames
    }


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


def _build(request: BuildRequest) -> RoundDriver:
    return RoundDriver(
        ThreadsTransport(
            request.layout,
            request.block(shared=False),
            first_env=request.first_env,
            ledger=request.ledger,
            pool=request.pool,
            inline_first=request.step_timeout is None and not request.pool,
            start_timeout=request.start_timeout,
        )
    )


register(BackendSpec("threads", build=_build, plan=_plan))
