"""The processes backend's round protocol is correct on every CPU the round bell runs on.

The driver publishes a command by writing its words and then its ``REQ`` count; a worker
publishes its reply by writing its status and reply words and then its ``ACK`` (a full
round's arrival on the bell's ``remaining`` word before it). The C side stores those
publishing words with release semantics and loads them with acquire semantics; the Python
side (the driver's request, a new worker's words, the worker's ACK) uses plain stores and
loads, which keep their order only on x86-64 (total store order). So the round bell runs
on x86-64 alone (round protocol R9, ``doorbell.ROUND_BELL_MACHINES``), and the plain stores
stay inside the few Python functions written for it: a new one elsewhere (a second place
that bumps ``REQ``, say) fails here, to be reviewed against that argument.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path
from typing import Any

import gymnasium
import numpy as np
import pytest

import envfleet
import envfleet._core.native
from envfleet._backends.processes import doorbell, lifecycle
from tests.envs import IndexedEnv, sync_factories
from tests.helpers import assert_same

# The control words whose store publishes data to the other side: a worker's REQ / GATHER /
# ACK words (_backends/processes/worker.py) and the round bell's words (doorbell.py).
PUBLISHING_WORDS = frozenset({"REQ", "ACK", "GATHER", "SLEEP", "_GEN", "_REMAINING", "_DWAIT"})

# (module path under src/envfleet, qualified function name) -> the words it may write, and why.
ALLOWED = {
    # The driver's command to one worker: its words, then REQ, then the ring.
    ("_backends/processes/lifecycle.py", "WorkerProcesses.request"): {"GATHER", "REQ"},
    # A new worker's words, before its process starts (nothing reads them yet), its READY due.
    ("_backends/processes/lifecycle.py", "WorkerProcesses._spec"): {
        "GATHER",
        "ACK",
        "REQ",
        "SLEEP",
    },
    # A second READY due, before the layout goes on the pipe (the worker reads it from there).
    ("_backends/processes/lifecycle.py", "WorkerProcesses.lay_out"): {"REQ"},
    # A worker's reply: its arrival, then its ACK (R6; the C twin: bell_arrive).
    ("_backends/processes/worker.py", "_Worker.ring_done"): {"ACK"},
}

PACKAGE = Path(envfleet.__file__).resolve().parent
SETTERS = frozenset({"__setitem__", "setitem", "itemset", "put", "pack_into", "fill"})


def _words_in(node: ast.AST) -> set[str]:
    """The publishing words named anywhere in ``node`` (``REQ``, ``worker.REQ``...)."""
    named = set()
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name):
            named.add(sub.id)
        elif isinstance(sub, ast.Attribute):
            named.add(sub.attr)
    return named & PUBLISHING_WORDS


class _Writes(ast.NodeVisitor):
    """Every store into a subscript indexed by a publishing word (``words[REQ] = ...``,
    ``words[REQ] += 1``, ``self._words[_REMAINING // 4] = n``), and every call of a setter
    given one (``operator.setitem(words, REQ, n)``), with the function it is in."""

    def __init__(self) -> None:
        self.scope: list[str] = []
        self.found: list[tuple[str, set[str], int]] = []

    def _scoped(self, node: Any) -> None:
        self.scope.append(node.name)
        self.generic_visit(node)
        self.scope.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = _scoped

    def _target(self, target: ast.AST, line: int) -> None:
        for sub in ast.walk(target):
            if isinstance(sub, ast.Subscript):
                words = _words_in(sub.slice)
                if words:
                    self.found.append((".".join(self.scope) or "<module>", words, line))

    def visit_Assign(self, node: ast.Assign) -> None:
        for target in node.targets:
            self._target(target, node.lineno)
        self.generic_visit(node)

    def visit_AugAssign(self, node: ast.AugAssign) -> None:
        self._target(node.target, node.lineno)
        self.generic_visit(node)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        self._target(node.target, node.lineno)
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        if name in SETTERS:
            words = set().union(*(_words_in(a) for a in node.args)) if node.args else set()
            if words:
                self.found.append((".".join(self.scope) or "<module>", words, node.lineno))
        self.generic_visit(node)


def _publishing_writes() -> dict[tuple[str, str], set[str]]:
    writes: dict[tuple[str, str], set[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        visitor = _Writes()
        visitor.visit(ast.parse(path.read_text(encoding="utf-8"), str(path)))
        module = path.relative_to(PACKAGE).as_posix()
        for function, words, _ in visitor.found:
            writes.setdefault((module, function), set()).update(words)
    return writes


def test_only_the_python_twins_write_the_publishing_control_words() -> None:
    """No module of the package writes REQ, ACK, GATHER or a bell word outside the
    functions of ALLOWED, and each of those writes only its own words: a plain store of
    one elsewhere would be a new unordered publication on a weakly ordered CPU."""
    writes = _publishing_writes()
    outside = {
        where: sorted(words - ALLOWED.get(where, set()))
        for where, words in writes.items()
        if words - ALLOWED.get(where, set())
    }
    assert not outside, (
        f"plain stores of the round protocol's publishing words outside its Python twins: "
        f"{outside}; publish through WorkerProcesses.request / _Worker.ring_done, or (a new "
        f"twin) add it to ALLOWED with the reason it is ordered (doorbell.ROUND_BELL_MACHINES)"
    )


def test_the_allowed_list_is_not_stale() -> None:
    """Every allowed function still writes its words: the scan sees the real stores (it
    would pass vacuously if it missed them), and a list entry nobody needs is removed."""
    writes = _publishing_writes()
    for where, words in ALLOWED.items():
        assert writes.get(where) == words, (where, writes.get(where))


def test_the_scan_catches_the_forms_of_a_store() -> None:
    """The forms a new publication could take are each reported."""
    source = (
        "def f(words, w, bell, np, operator):\n"
        "    words[REQ] = 1\n"
        "    words[worker.ACK] += 1\n"
        "    bell._words[_GEN // 4] = 2\n"
        "    w.control[3, GATHER] = 0\n"
        "    operator.setitem(words, REQ, 5)\n"
        "    x = words[REQ]\n"  # a load: not reported
    )
    visitor = _Writes()
    visitor.visit(ast.parse(source))
    assert [(f, sorted(w), line) for f, w, line in visitor.found] == [
        ("f", ["REQ"], 2),
        ("f", ["ACK"], 3),
        ("f", ["_GEN"], 4),
        ("f", ["GATHER"], 5),
        ("f", ["REQ"], 6),
    ]


@pytest.mark.parametrize("cpu", ["aarch64", "ppc64le", "riscv64", "s390x", "armv7l", ""])
def test_the_round_bell_is_off_on_weakly_ordered_cpus(cpu: str) -> None:
    """Reported as another CPU than x86-64, the machine has no round bell."""
    assert doorbell.round_bell_available(cpu) is False


def test_the_round_bell_is_on_on_x86_64_linux() -> None:
    """On x86-64 the bell runs wherever futexes are (Linux) and the C module's bell
    functions run (R9: they are its one implementation)."""
    has_c = envfleet._core.native.speedups is not None
    assert doorbell.round_bell_available("x86_64") is (sys.platform.startswith("linux") and has_c)
    assert frozenset({"x86_64"}) == doorbell.ROUND_BELL_MACHINES


def test_without_the_c_module_there_is_no_round_bell(make_env: Any, monkeypatch: Any) -> None:
    """Without the C module (not built, or ``ENVFLEET_NO_SPEEDUPS=1``) a processes vector env
    rings every worker on its own semaphore, has no full round, and steps as SyncVectorEnv
    does (the differential suite's Python step path runs this way throughout)."""
    monkeypatch.setattr(envfleet._core.native, "speedups", None)
    monkeypatch.setenv("ENVFLEET_NO_SPEEDUPS", "1")
    assert doorbell.round_bell_available() is False
    fleet = make_env(IndexedEnv, 3, backend="processes", num_workers=2)
    transport = fleet._backend.transport
    assert transport.workers.bell is None and transport.full_round is None
    sync = gymnasium.vector.SyncVectorEnv(sync_factories(IndexedEnv, 3))
    try:
        assert_same(fleet.reset(seed=1), sync.reset(seed=1), "reset")
        for t in range(20):
            actions = np.full(3, t % 2)
            assert_same(fleet.step(actions), sync.step(actions), f"step {t}")
    finally:
        sync.close()


@pytest.mark.timeout(120)
def test_a_vector_env_on_aarch64_rings_the_semaphores(make_env: Any, monkeypatch: Any) -> None:
    """A processes vector env made while the machine reports aarch64 has no round bell:
    its workers are rung on their own semaphores, and it steps."""
    monkeypatch.setattr(
        lifecycle, "round_bell_available", lambda: doorbell.round_bell_available("aarch64")
    )
    fleet = make_env(
        IndexedEnv,
        3,
        backend=envfleet.Processes(driver_envs=1),
        num_workers=2,
    )
    assert fleet._backend.transport.workers.bell is None
    fleet.reset(seed=0)
    for t in range(5):
        obs, *_ = fleet.step(np.full(3, t % 2))
        assert obs.shape[0] == 3
