"""make() compares no backend name: what differs between backends is their registered
``BackendSpec`` (docs/architecture/backends.md, "Registering a backend"), and which options
go with which backend is ``_front/options.py``'s one table."""

from __future__ import annotations

import ast
from pathlib import Path

from envfleet._backends.registry import BUILTIN

MAKE = Path(__file__).resolve().parents[2] / "src" / "envfleet" / "_front" / "make.py"


def test_make_compares_no_backend_name():
    names = set(BUILTIN)
    tree = ast.parse(MAKE.read_text())
    compared = [
        (node.lineno, operand.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Compare)
        for operand in [node.left, *node.comparators]
        if isinstance(operand, ast.Constant) and operand.value in names
    ]
    assert names >= {"processes", "threads", "serial", "ray", "envpool"}
    assert not compared, f"make.py compares backend names (line, name): {compared}"
