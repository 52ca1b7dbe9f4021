"""benchmarks/scale.py: a short run of the round's anatomy gives every figure for every worker
count, with the machine and the commit. Structure only, never speed (no timed assertions)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "scale.py"


def test_a_short_run_reports_each_worker_count(tmp_path: Path) -> None:
    out_file = tmp_path / "scale.json"
    done = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--env",
            "noop",
            "--num-envs",
            "4",
            "--workers",
            "1,2",
            "--seconds",
            "0.2",
            "--json",
            str(out_file),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "driver CPU per round ~" in done.stdout
    doc = json.loads(out_file.read_text())
    assert doc["machine"]["cores"] >= 1 and doc["machine"]["cpu_model"] and doc["machine"]["commit"]
    assert [r["workers"] for r in doc["rows"]] == [1, 2]
    for name in ("driver_cpu_fit_us", "driver_user_fit_us"):
        assert all(math.isfinite(doc[name][k]) for k in ("a", "b_per_worker")), doc[name]
    for row in doc["rows"]:
        for key in (
            "steps_per_s",
            "round_us",
            "driver_cpu_us",
            "worker_stepping_us",
            "env_step_in_worker_us",
            "env_step_alone_us",
            "slowdown_in_worker",
        ):
            assert math.isfinite(row[key]) and row[key] >= 0, (key, row)
        assert row["steps_per_s"] > 0 and row["env_step_alone_us"] > 0
