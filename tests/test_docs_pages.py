"""Every page under docs/ is at most 300 lines.

A newcomer reads a page to the end and holds it in their head; a page past 300 lines holds
several topics, which go to pages of their own (mkdocs.yml's nav and the links follow).
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 300


def too_long(docs: Path = ROOT / "docs") -> list[str]:
    return [
        f"{page.relative_to(docs)}: {count} lines"
        for page in sorted(docs.rglob("*.md"))
        if (count := len(page.read_text(encoding="utf-8").splitlines())) > MAX_LINES
    ]


def test_every_page_of_the_docs_is_at_most_300_lines() -> None:
    assert len(list((ROOT / "docs").rglob("*.md"))) > 20  # the scan sees the pages
    assert too_long() == []


def test_a_long_page_is_caught(tmp_path: Path) -> None:
    (tmp_path / "short.md").write_text("# Short\n" * MAX_LINES)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "long.md").write_text("# Long\n" * (MAX_LINES + 1))
    assert too_long(tmp_path) == [f"{Path('sub', 'long.md')}: {MAX_LINES + 1} lines"]
