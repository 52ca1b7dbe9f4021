"""benchmarks/thread_floor.py --quick: it runs and prints its table (structure only, never a
speed: no timed assertions)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "thread_floor.py"


def test_quick_mode_prints_a_row_per_measurement() -> None:
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--quick", "--threads", "4", "--wait-ms", "2"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "| threads | what | round ms | round / wait | CPU µs per env step |" in proc.stdout
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| 4 |")]
    assert [row.split("|")[2].strip() for row in rows] == ["free", "crew", "crew+numpy"]
    for row in rows[1:]:  # a crew round waits at least its members' sleep
        assert float(row.split("|")[4]) >= 1.0, row
