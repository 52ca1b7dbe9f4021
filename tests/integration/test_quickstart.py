"""docs/quickstart.md's "Coming from another library": every block runs as it is written.

Each block is the one line a user changes to move to envfleet (stable-baselines3, gymnasium,
CleanRL, TorchRL), with the line it replaces in a comment. Each runs in a fresh interpreter,
as a user's script would (importing torchrl changes multiprocessing's start method).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

QUICKSTART = Path(__file__).resolve().parents[2] / "docs" / "quickstart.md"
SECTION = "## Coming from another library"


def migration_blocks() -> list[str]:
    text = QUICKSTART.read_text()
    start = text.index(SECTION)
    end = text.find("\n## ", start + len(SECTION))
    section = text[start : end if end != -1 else len(text)]
    return re.findall(r"```python\n(.*?)```", section, flags=re.S)


def test_the_section_has_one_block_per_library():
    blocks = migration_blocks()
    assert len(blocks) == 4
    for block, needle in zip(
        blocks, ["SB3VecEnv", "envfleet.make", "envfleet.make", "make_torchrl_env"], strict=True
    ):
        assert needle in block and "# was " in block


@pytest.mark.parametrize("index", range(4), ids=["sb3", "gymnasium", "cleanrl", "torchrl"])
def test_migration_block_runs(index, tmp_path):
    pytest.importorskip({0: "stable_baselines3", 3: "torchrl"}.get(index, "gymnasium"))
    script = tmp_path / "block.py"
    script.write_text(migration_blocks()[index])
    done = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-4000:]
