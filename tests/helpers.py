"""Shared test helpers: exact comparison of nested results, and leak checks."""

from __future__ import annotations

import glob
import os
import tempfile
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import psutil


def assert_same(got: Any, want: Any, path: str = "result") -> None:
    """Assert ``got`` is bit-identical to ``want``, walking dicts, tuples and object arrays.

    Arrays must have the same type, dtype, shape and bytes; object arrays are compared element
    by element; dicts must have the same keys in the same order; scalars the same type and
    value (NaN equal to NaN).
    """
    assert type(got) is type(want), f"{path}: type {type(got).__name__} != {type(want).__name__}"
    if isinstance(want, dict):
        assert list(got) == list(want), f"{path}: keys {list(got)} != {list(want)}"
        for key in want:
            assert_same(got[key], want[key], f"{path}[{key!r}]")
    elif isinstance(want, (tuple, list)):
        assert len(got) == len(want), f"{path}: length {len(got)} != {len(want)}"
        for k, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_same(g, w, f"{path}[{k}]")
    elif isinstance(want, np.ndarray):
        assert got.dtype == want.dtype, f"{path}: dtype {got.dtype} != {want.dtype}"
        assert got.shape == want.shape, f"{path}: shape {got.shape} != {want.shape}"
        if want.dtype == object:
            for idx in np.ndindex(want.shape):
                assert_same(got[idx], want[idx], f"{path}[{idx}]")
        else:
            assert got.tobytes() == want.tobytes(), f"{path}: values differ\n{got}\n!=\n{want}"
    elif isinstance(want, np.generic):
        assert got.tobytes() == want.tobytes(), f"{path}: {got!r} != {want!r}"
    elif isinstance(want, float):
        assert got == want or (got != got and want != want), f"{path}: {got!r} != {want!r}"
    else:
        assert got == want, f"{path}: {got!r} != {want!r}"


def _is_mp_helper(proc: psutil.Process) -> bool:
    """multiprocessing's long-lived helpers (fork server, resource tracker) of this process."""
    try:
        if proc.ppid() != os.getpid():
            return False
        cmdline = " ".join(proc.cmdline())
    except psutil.Error:
        return False
    return "forkserver" in cmdline or "resource_tracker" in cmdline


def descendants() -> list[psutil.Process]:
    """Every process below this one (children, grandchildren under the fork server, ...)."""
    return psutil.Process().children(recursive=True)


@dataclass
class Snapshot:
    """Child processes, /dev/shm entries and workers' stack files at one moment, to find
    what a test left behind."""

    pids: set[int]
    shm: set[str]
    stack_files: set[str]

    @classmethod
    def take(cls) -> Snapshot:
        return cls({p.pid for p in descendants()}, set(os.listdir("/dev/shm")), set(_stack_files()))

    def new_processes(self) -> list[psutil.Process]:
        """Processes started since the snapshot that still exist (zombies included)."""
        return [p for p in descendants() if p.pid not in self.pids and not _is_mp_helper(p)]

    def new_workers(self) -> list[int]:
        """Pids of the processes started since the snapshot, helpers left out."""
        return sorted(p.pid for p in self.new_processes())

    def assert_nothing_left(self) -> None:
        left = []
        for proc in self.new_processes():
            try:
                left.append(f"{proc.pid} ({proc.status()}): {' '.join(proc.cmdline())[:120]}")
            except psutil.Error:
                continue  # it went away while we looked
        assert not left, f"processes left behind: {left}"
        new_shm = set(os.listdir("/dev/shm")) - self.shm
        assert not new_shm, f"/dev/shm entries left behind: {sorted(new_shm)}"
        stacks = set(_stack_files()) - self.stack_files
        assert not stacks, f"workers' stack or action-log files left behind: {sorted(stacks)}"


def _stack_files() -> list[str]:
    """The stack and action-log files of this process's worker processes (envfleet's
    processes backend)."""
    return [
        path
        for kind in ("stacks", "replay")
        for path in glob.glob(
            os.path.join(tempfile.gettempdir(), f"envfleet-{kind}-{os.getpid()}-*")
        )
    ]


def wait_gone(pids: list[int], timeout: float) -> list[int]:
    """Poll until every pid has exited (a zombie counts as exited); return those still running.

    ``timeout`` (seconds) is only a hang guard.
    """
    deadline = time.monotonic() + timeout
    while True:
        alive = []
        for pid in pids:
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    alive.append(pid)
            except psutil.NoSuchProcess:
                pass
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.05)


def start_pending_call(envs: Any, method: str) -> Any:
    """Start ``method`` (``"step"``, ``"reset"`` or ``"call"`` of ``slow``, a method of
    :class:`tests.envs.SlowEnv`) asynchronously on a vector env; return its wait."""
    if method == "step":
        envs.reset(seed=0)
        envs.step_async(np.zeros(envs.num_envs, dtype=np.int64))
        return envs.step_wait
    if method == "reset":
        envs.reset_async(seed=0)
        return envs.reset_wait
    envs.reset(seed=0)
    envs.call_async("slow")
    return envs.call_wait
