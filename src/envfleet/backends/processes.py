"""``backend="processes"``: one EnvGroup per worker process, data in shared memory.

Control travels over one pipe per worker as a one-byte :class:`Command` (plus a pickled request
off the hot path); observations, actions, rewards, terminations and truncations live in one
shared :class:`envfleet.buffers.Block`. Infos travel only when an env returned a non-empty one.

Every wait watches the workers' process sentinels too, so a worker that dies (segfault,
``os._exit``, SIGKILL) raises :class:`envfleet.EnvCrashedError` at once instead of hanging.
Workers exit when the driver dies: they ask Linux for SIGKILL on their parent's death
(``PR_SET_PDEATHSIG``) and see end-of-file on their pipe.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import sys
import time
import traceback
from collections.abc import Mapping
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, cast

import cloudpickle
import gymnasium
from gymnasium.vector import AutoresetMode

from envfleet.backends.base import Backend, WorkerLayout, bind_env_index, env_error
from envfleet.buffers import Block, allocate_batch
from envfleet.envgroup import EnvFailure, EnvGroup
from envfleet.errors import (
    EnvCrashedError,
    EnvError,
    RemoteTraceback,
    SpaceMismatchError,
    StepTimeoutError,
    describe_exitcode,
)
from envfleet.protocol import Command, RemoteError, Status

__all__ = ["DEFAULT_CLOSE_TIMEOUT", "ProcessesBackend"]

logger = logging.getLogger("envfleet")

DEFAULT_CLOSE_TIMEOUT = 5.0  # seconds for workers to close their envs before being terminated
_KILL_GRACE = 1.0  # seconds between SIGTERM and SIGKILL
_STEP = bytes([Command.STEP])
_OK = bytes([Status.OK])


@dataclass
class _WorkerSpec:
    """What a worker process receives at start (pickled once, when spawning)."""

    worker_index: int
    start: int
    stop: int
    env_fns: list[bytes]  # cloudpickled factories, one per env of the worker
    accepts_index: list[bool]
    single_observation_space: gymnasium.Space[Any]
    single_action_space: gymnasium.Space[Any]
    num_envs: int
    autoreset_mode: AutoresetMode
    block: Block
    parent_pid: int
    start_method: str


class ProcessesBackend(Backend):
    """Worker processes holding contiguous blocks of envs over one shared block.

    Args:
        layout: envs, spaces and worker ranges.
        block: a shared :class:`Block` sized by :func:`envfleet.buffers.batch_nbytes`.
        env_fn_blobs: per env, its factory cloudpickled (equal factories share one bytes object).
        context: a ``multiprocessing`` start method name or ``None`` for the platform default.
        start_timeout: seconds to wait for the workers to build their envs (``None``: no
            bound; a worker that dies while starting is still seen at once).

    Raises:
        EnvError: a factory raised while building an env (``method == "make"``).
        SpaceMismatchError: an env's spaces differ from ``layout``'s.
        EnvCrashedError: a worker died while starting.
    """

    def __init__(
        self,
        layout: WorkerLayout,
        block: Block,
        env_fn_blobs: list[bytes],
        context: str | None,
        start_timeout: float | None = None,
    ):
        self.ranges = list(layout.ranges)
        self.block = block
        self.batch = allocate_batch(
            layout.single_observation_space, layout.single_action_space, layout.num_envs, block
        )
        self._ctx: Any = cast(Any, multiprocessing.get_context(context))
        self._conns: list[Connection] = []
        self._procs: list[Any] = []
        self._pending: list[int] = []
        self._closed = False
        # A forked worker flushes the stdio buffers it inherits when it exits: flush them
        # here so nothing the driver printed is printed again.
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        try:
            for w, (start, stop) in enumerate(self.ranges):
                spec = _WorkerSpec(
                    worker_index=w,
                    start=start,
                    stop=stop,
                    env_fns=env_fn_blobs[start:stop],
                    accepts_index=list(layout.accepts_index[start:stop]),
                    single_observation_space=layout.single_observation_space,
                    single_action_space=layout.single_action_space,
                    num_envs=layout.num_envs,
                    autoreset_mode=layout.autoreset_mode,
                    block=block,
                    parent_pid=os.getpid(),
                    start_method=self._ctx.get_start_method(),
                )
                parent_conn, child_conn = self._ctx.Pipe(duplex=True)
                proc = self._ctx.Process(
                    target=_worker_main,
                    args=(spec, child_conn, parent_conn),
                    name=f"envfleet-worker-{w}",
                    daemon=True,
                )
                proc.start()
                child_conn.close()
                self._conns.append(parent_conn)
                self._procs.append(proc)
            self._pending = list(range(len(self.ranges)))
            ready = self.collect(start_timeout, step=0)
            for w in sorted(ready):
                if ready[w] is not None:
                    env_index, problem = ready[w]
                    raise SpaceMismatchError(
                        f"sub-environment {env_index} has another space than env 0: {problem}"
                    )
        except BaseException:
            self.close(timeout=None, terminate=True)
            raise

    # -- Backend --------------------------------------------------------------------------

    def submit(self, command: Command, payloads: Mapping[int, Any], step: int) -> None:
        if command is Command.STEP:
            messages = dict.fromkeys(payloads, _STEP)
        else:
            header = bytes([command])
            messages = {
                w: header + pickle.dumps(payload, pickle.HIGHEST_PROTOCOL)
                for w, payload in payloads.items()
            }
        for w, message in messages.items():
            try:
                self._conns[w].send_bytes(message)
            except OSError:  # the worker died since its last reply
                self._raise_crashed(w, step)
        self._pending = sorted(payloads)

    def collect(self, timeout: float | None, step: int) -> dict[int, Any]:
        pending = self._pending
        self._pending = []
        results: dict[int, Any] = {}
        errors: dict[int, RemoteError] = {}
        deadline = None if timeout is None else time.monotonic() + timeout
        waiting = set(pending)
        while waiting:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            handles: list[Any] = [self._conns[w] for w in waiting]
            handles += [self._procs[w].sentinel for w in waiting]
            ready = multiprocessing.connection.wait(handles, remaining)
            if not ready:
                assert timeout is not None
                late = sorted(waiting)
                envs = [i for w in late for i in range(*self.ranges[w])]
                self.close(timeout=0, terminate=True)
                raise StepTimeoutError(
                    f"workers {late} (sub-environments {envs}) did not answer within "
                    f"{timeout} s; they were killed and the vector env closed",
                    envs,
                    timeout,
                )
            for w in sorted(waiting):
                conn = self._conns[w]
                if conn in ready or conn.poll():
                    try:
                        message = conn.recv_bytes()
                    except (EOFError, OSError):
                        self._raise_crashed(w, step)
                    waiting.discard(w)
                    if message[0] == Status.ERROR:
                        errors[w] = pickle.loads(message[1:])
                    else:
                        results[w] = pickle.loads(message[1:]) if len(message) > 1 else None
                elif self._procs[w].sentinel in ready:
                    self._raise_crashed(w, step)
        if errors:
            raise _as_env_error(errors[min(errors)], min(errors))
        return results

    def close(self, timeout: float | None, terminate: bool) -> None:
        """Close in three bounded phases: ask, terminate, kill.

        Without ``terminate`` and with no call pending, each worker is asked to close its envs
        and gets ``timeout`` seconds (default :data:`DEFAULT_CLOSE_TIMEOUT`) to exit. Workers
        still alive then (or at once with ``terminate``) get SIGTERM and :data:`_KILL_GRACE`
        seconds, then SIGKILL. Some envs catch SIGTERM (SDL does), hence the last phase.
        """
        if self._closed:
            return
        self._closed = True
        graceful = not terminate and not self._pending
        if self._pending and not terminate:
            logger.warning("closing while workers %s are busy; terminating them", self._pending)
        if graceful:
            for proc, conn in zip(self._procs, self._conns, strict=True):
                if proc.is_alive():
                    with contextlib.suppress(OSError):
                        conn.send_bytes(bytes([Command.CLOSE]))
            _join_all(self._procs, DEFAULT_CLOSE_TIMEOUT if timeout is None else timeout)
        for proc in self._procs:
            if proc.is_alive():
                proc.terminate()
        _join_all(self._procs, _KILL_GRACE)
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in self._conns:
            conn.close()
        for proc in self._procs:
            with contextlib.suppress(ValueError):
                proc.close()
        self._pending = []

    # -- helpers --------------------------------------------------------------------------

    def _raise_crashed(self, w: int, step: int) -> None:
        proc = self._procs[w]
        proc.join(_KILL_GRACE)
        exitcode = proc.exitcode
        start, stop = self.ranges[w]
        self.close(timeout=0, terminate=True)
        raise EnvCrashedError(
            f"worker {w} (sub-environments {start}..{stop - 1}) died with "
            f"{describe_exitcode(exitcode)} after {step} steps; the vector env was closed",
            env_indices=range(start, stop),
            worker_index=w,
            exitcode=exitcode,
            step=step,
        )


def _join_all(procs: list[Any], timeout: float) -> None:
    """Join every process, all within one ``timeout`` in seconds."""
    deadline = time.monotonic() + timeout
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))


def _as_env_error(error: RemoteError, worker_index: int) -> EnvError:
    cause: BaseException | None = None
    if error.exception is not None:
        with contextlib.suppress(Exception):
            cause = pickle.loads(error.exception)
    if not isinstance(cause, BaseException):
        cause = RuntimeError(f"{error.type_name}: {error.message}")
    cause.__cause__ = RemoteTraceback(error.traceback)
    exc = env_error(
        error.env_index, worker_index, error.method, f"{error.type_name}: {error.message}"
    )
    exc.__cause__ = cause
    return exc


# -- worker side ----------------------------------------------------------------------------

_PR_SET_PDEATHSIG = 1


def _die_with_parent(parent_pid: int, start_method: str) -> None:
    """Ask Linux to SIGKILL this process when the driver dies; exit if it already has.

    Under forkserver the worker's parent is the fork server, not the driver; there the
    worker relies on end-of-file on its pipe instead.
    """
    if start_method == "forkserver" or not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:  # the driver died before prctl took effect
        os._exit(0)


def _remote_error(failure: BaseException, env_index: int, method: str) -> bytes:
    cause = failure.__cause__ if isinstance(failure, EnvFailure) else failure
    assert cause is not None
    tb = "".join(traceback.format_exception(type(cause), cause, cause.__traceback__))
    blob: bytes | None
    try:
        blob = pickle.dumps(cause, pickle.HIGHEST_PROTOCOL)
        pickle.loads(blob)  # some exceptions pickle but do not unpickle
    except Exception:
        blob = None
    error = RemoteError(env_index, method, type(cause).__qualname__, str(cause), tb, blob)
    return bytes([Status.ERROR]) + pickle.dumps(error, pickle.HIGHEST_PROTOCOL)


def _worker_main(spec: _WorkerSpec, conn: Connection, parent_conn: Connection) -> None:
    parent_conn.close()  # inherited under fork; only the driver may hold it
    _die_with_parent(spec.parent_pid, spec.start_method)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the driver's to handle
    group: EnvGroup | None = None
    try:
        try:
            fns = [
                bind_env_index(cloudpickle.loads(blob), spec.start + j, spec.accepts_index[j])
                for j, blob in enumerate(spec.env_fns)
            ]
            batch = allocate_batch(
                spec.single_observation_space, spec.single_action_space, spec.num_envs, spec.block
            )
            group = EnvGroup(
                fns,
                spec.start,
                batch,
                spec.single_observation_space,
                spec.single_action_space,
                spec.autoreset_mode,
            )
            mismatch = group.check_spaces()
        except EnvFailure as failure:
            conn.send_bytes(_remote_error(failure, failure.env_index, failure.method))
            return
        except Exception as exc:
            conn.send_bytes(_remote_error(exc, spec.start, "make"))
            return
        conn.send_bytes(bytes([Status.READY]) + pickle.dumps(mismatch))
        _serve(group, conn)
    except (EOFError, BrokenPipeError, ConnectionResetError):
        pass  # the driver is gone
    finally:
        if group is not None:
            group.close()
        conn.close()


def _serve(group: EnvGroup, conn: Connection) -> None:
    while True:
        message = conn.recv_bytes()
        command = Command(message[0])
        if command is Command.CLOSE:
            return
        payload = pickle.loads(message[1:]) if len(message) > 1 else None
        try:
            result = group.run(command, payload)
        except EnvFailure as failure:
            conn.send_bytes(_remote_error(failure, failure.env_index, failure.method))
            continue
        except Exception as exc:  # a bug outside any env: report it against the group
            conn.send_bytes(_remote_error(exc, group.start, command.name.lower()))
            continue
        if result:
            try:
                conn.send_bytes(_OK + pickle.dumps(result, pickle.HIGHEST_PROTOCOL))
            except Exception as exc:
                conn.send_bytes(_remote_error(exc, group.start, f"{command.name.lower()} (result)"))
        else:
            conn.send_bytes(_OK)
