"""benchmarks/waiting.py --quick (issue 50): it runs, measures each system asked for and prints
its table. Structure only, never speed (no timed assertions)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "waiting.py"


def test_quick_mode_prints_its_table(tmp_path: Path) -> None:
    out = tmp_path / "waiting"
    systems = ["gym-async", "envfleet"]
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--quick", "--envs", "wait", "--num-envs", "4"]
        + ["--systems", *systems, "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr
    header = "| env | n | system | steps/s | × bound | × lone-env | × gym-async | × per-env |"
    assert header in proc.stdout
    rows = json.loads(out.with_suffix(".json").read_text())["rows"]
    assert [(r["env"], r["num_envs"], r["system"]) for r in rows] == [
        ("wait", 4, "gym-async"),
        ("wait", 4, "envfleet"),
    ]
    assert all(r["steps_per_s"] > 0 and len(r["runs"]) == 1 for r in rows)
    assert all(r["x_bound"] > 0 and r["tree_gib"] > 0 for r in rows)
    assert rows[0]["x_gym_async"] == 1.0
    assert rows[1]["found"].startswith("wait, ")  # the workers' finding, not a speed
    for r in rows:
        assert f"| wait | 4 | {r['system']} | " in proc.stdout
    assert out.with_suffix(".md").read_text() in proc.stdout
