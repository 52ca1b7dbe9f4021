"""benchmarks/multi_agent.py --quick: every system runs on both workloads and the table, the
JSON and the counts agree. Structure only, never speed (no timed assertions)."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("pettingzoo.butterfly")
pytest.importorskip("supersuit")

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "multi_agent.py"
SYSTEMS = [
    "loop",
    "supersuit-mp",
    "supersuit-serial",
    "envfleet-processes",
    "envfleet-serial",
    "puffer-mp",
]
AGENTS = {"pistonball": 4, "kaz": 4}  # the --quick envs: 4 pistons; 2 archers, 2 knights


def test_quick_mode_measures_every_system(tmp_path: Path) -> None:
    out = tmp_path / "ma.json"
    env = {**os.environ, "PYTHONIOENCODING": "utf-8"}
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--quick", "--json", str(out)],
        capture_output=True,
        text=True,
        encoding="utf-8",
        env=env,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(out.read_text())
    info, rows, runs = doc["info"], doc["rows"], doc["runs"]
    assert info["quick"] is True and info["repeats"] == 1
    expected = list(SYSTEMS)
    if importlib.util.find_spec("pufferlib") is None:
        expected.remove("puffer-mp")
        assert "pip install" in info["skipped"]["puffer-mp"]
        assert "skipped: puffer-mp" in proc.stderr
    else:
        assert info["skipped"] == {}
    assert [(r["workload"], r["system"]) for r in rows] == [
        (w, s) for w in AGENTS for s in expected
    ]
    assert len(runs) == len(rows)
    for row in rows:
        assert row["num_envs"] == 2
        assert row["num_agents"] == AGENTS[row["workload"]]
        assert row["env_steps_per_s"] > 0
        assert math.isclose(row["agent_steps_per_s"], row["env_steps_per_s"] * row["num_agents"])
        assert row["runs"] == [row["env_steps_per_s"]]
        # the table's line for this row
        line = f"| {row['workload']} x2 ({row['num_agents']} agents) | {row['system']} |"
        assert line in proc.stdout
    for run in runs:
        assert run["batch_steps"] >= 2 and run["seconds"] > 0 and run["startup_s"] >= 0
    by = {(r["workload"], r["system"]): r for r in rows}
    for workload in AGENTS:
        assert by[workload, "supersuit-mp"]["x_baseline"] == 1.0
        assert math.isclose(by[workload, "loop"]["of_limit"], 1 / info["cores"])


def test_unknown_names_are_refused() -> None:
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--quick", "--systems", "loop,bogus"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode != 0
    assert "unknown system 'bogus'" in proc.stderr
