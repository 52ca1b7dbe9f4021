"""Issue 42's benchmarks, briefly: benchmarks/pool_vs_sync.py and envpool_overhead.py give
every row with the machine and the commit, and benchmarks/scale16.sh (the prepared 16-core
run) parses and names only scripts and options that exist. Structure only, never speed."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks"


def run(script: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(BENCH / script), *args],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=ROOT,
    )


def test_pool_vs_sync_short_run(tmp_path: Path) -> None:
    out = tmp_path / "pool_vs_sync"
    done = run(
        "pool_vs_sync.py", "--cases", "CartPole-v1:4", "--seconds", "0.2", "--warmup", "0.05",
        "--repeats", "1", "--out", str(out),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    doc = json.loads(out.with_suffix(".json").read_text())
    assert doc["commit"] and doc["machine"]["cores"] >= 1
    (row,) = doc["rows"]
    assert row["num_envs"] == 4 and row["batch_size"] == 2
    assert row["sync"] > 0 and row["pool"] > 0 and row["ratio"] > 0
    assert row["pool_workers"] >= 1 and "pool / sync" in out.with_suffix(".md").read_text()


@pytest.mark.skipif(importlib.util.find_spec("envpool") is None, reason="needs envpool")
def test_envpool_overhead_short_run(tmp_path: Path) -> None:
    out = tmp_path / "envpool"
    done = run(
        "envpool_overhead.py", "--cases", "CartPole-v1:4:max_episode_steps=50",
        "--seconds", "0.2", "--warmup", "0.05", "--repeats", "1", "--front-calls", "50",
        "--out", str(out),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    doc = json.loads(out.with_suffix(".json").read_text())
    assert doc["commit"] and doc["machine"]["cores"] >= 1
    assert [(r["mode"], r["num_envs"]) for r in doc["rows"]] == [("sync", 4), ("pool", 4)]
    for row in doc["rows"]:
        assert row["task"] == "CartPole-v1 (max_episode_steps=50)"
        assert row["raw"] > 0 and row["envfleet"] > 0 and row["envfleet-view"] > 0
        assert row["raw_front_us"] > 0 and row["envfleet_front_us"] > 0
    assert "stubbed out" in out.with_suffix(".md").read_text()


def test_scale16_script_names_what_exists() -> None:
    script = BENCH / "scale16.sh"
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    text = script.read_text().replace("\\\n", " ")
    calls = re.findall(r'"\$py" ((?:benchmarks|examples)/\w+\.py)([^\n]*)', text)
    assert len(calls) >= 9
    helps: dict[str, str] = {}  # each script's --help once (examples/ppo_atari.py runs 4 times)
    for path, args in calls:
        assert (ROOT / path).is_file(), path
        if path not in helps:
            helped = subprocess.run(
                [sys.executable, str(ROOT / path), "--help"],
                capture_output=True,
                text=True,
                cwd=ROOT,
            )
            assert helped.returncode == 0, helped.stderr[-1000:]
            helps[path] = helped.stdout
        for option in re.findall(r"(--[a-z][a-z-]*)", args):
            assert option in helps[path], f"{path} has no {option}"
