"""docs/quickstart.md's "Coming from another library": one block per library that README.md's
table of swaps names, each with the line it replaces in a comment.

Each block is the one line a user changes to move to envfleet (stable-baselines3, gymnasium,
CleanRL, TorchRL); tests/integration/test_snippets.py runs them, as every block of the docs, in
a fresh interpreter.
"""

from __future__ import annotations

import re
from pathlib import Path

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


def test_the_readme_names_each_swap_and_links_the_section():
    readme = (QUICKSTART.parents[1] / "README.md").read_text()
    assert "docs/quickstart.md#coming-from-another-library" in readme
    for name in ("AsyncVectorEnv", "SubprocVecEnv", "SB3VecEnv", "CleanRL", "make_torchrl_env"):
        assert name in readme
