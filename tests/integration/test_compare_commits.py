"""benchmarks/compare_commits.py: each workload's child measurement runs on this tree and gives
a positive figure. Structure only, never speed (no timed assertions)."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "compare_commits.py"


def _workloads() -> tuple[str, ...]:
    spec = importlib.util.spec_from_file_location("envfleet_compare_commits", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return tuple(module.WORKLOADS)


@pytest.mark.parametrize("workload", _workloads())
def test_every_workload_measures_on_this_tree(workload: str) -> None:
    if workload == "pong8":
        pytest.importorskip("ale_py")
    src = ROOT / "src"
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--child", workload, "--seconds", "0.1", "--src", str(src)],
        env={**os.environ, "PYTHONPATH": str(src)},
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    for key in ("value", "quiet"):
        assert math.isfinite(figures[key]) and figures[key] > 0, figures
