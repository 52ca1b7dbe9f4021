"""Every relative link and every file named in README.md, docs/, the docstrings and setup.py
exists in the repository.

A reader follows a link or opens a file the text names; a page that points at a file that moved
or never was here (a design note kept elsewhere, a test that moved to a subfolder) sends them
nowhere. Two checks:

- links: every relative Markdown link or image of README.md and docs/ resolves to a file of
  the repository, and an anchor into a Markdown page names one of its headings;
- named files: every path-like name (``a/b.py``, ``docs/x.md``) and every top-level file name
  (``README.md``, ``setup.py``...) written in README.md, docs/, benchmarks/README.md, the
  Python sources (docstrings and comments: src, tests, benchmarks, examples, tools), setup.py,
  pyproject.toml and mkdocs.yml exists, read from the repository's root, the text's own folder,
  ``src/`` or ``src/envfleet/``.
"""

from __future__ import annotations

import functools
import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
TEXTS = [
    *PAGES,
    ROOT / "benchmarks" / "README.md",
    ROOT / "setup.py",
    ROOT / "pyproject.toml",
    ROOT / "mkdocs.yml",
    *sorted(
        p
        for d in ("src", "tests", "benchmarks", "examples", "tools")
        for p in (ROOT / d).rglob("*.py")
        if p != Path(__file__).resolve()
    ),
]

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
URL = re.compile(r"[a-z][a-z0-9+.-]*://\S+")
EXTENSIONS = "py|md|png|json|toml|yml|yaml|sh|c|txt|cfg|ini|whl"
PATH = re.compile(rf"(?<![\w./@:-])((?:[\w.-]+/)+[\w.-]*\w\.(?:{EXTENSIONS}))(?![\w/-])")
TOP_LEVEL = re.compile(
    r"(?<![\w./-])([A-Z][A-Z_]*\.md|LICENSE|setup\.py|pyproject\.toml|mkdocs\.yml)(?![\w/-])"
)
# Files of other projects, named as theirs where they are named.
EXTERNAL = {
    "tests/test_vec_envs.py",  # stable-baselines3's vec-env tests (tools/sb3_tests/)
    "tests/vector/test_async_vector_env.py",  # gymnasium's
    "tests/vector/test_sync_vector_env.py",  # gymnasium's
    "envpool/entry.py",  # EnvPool's
    "cleanrl/ppo_atari_envpool.py",  # CleanRL's
    "concurrent/futures/process.py",  # CPython's
}
# Files a page tells the reader to write.
TO_WRITE = {"envfleet/_backends/inline.py"}  # architecture.md's new backend
# Names a text makes up: a user's files, outputs, placeholders.
PLACEHOLDER = re.compile(r"[*{}<>$]|\bNAME\b|\bFILE\b|\bPATH\b|\.\.\.|^my_|/my_")


def repository_files() -> list[str]:
    skip = {".git", ".venv", ".venv-bench", "site", "build", "dist", "__pycache__"}
    return [
        "/" + str(p.relative_to(ROOT))
        for p in ROOT.rglob("*")
        if p.is_file() and not skip & set(p.relative_to(ROOT).parts)
    ]


FILES = repository_files()


def exists(text: Path, name: str) -> bool:
    """``name`` from the root, from the text's folder or docs/ (mkdocs.yml's pages), or as
    the tail of a repository path (``processes/worker.py`` for the module under _backends/)."""
    if any((base / name).exists() for base in (ROOT, text.parent, ROOT / "docs")):
        return True
    tail = "/" + name.removeprefix("./")
    return any(f.endswith(tail) for f in FILES)


def slugs(heading: str) -> set[str]:
    """The anchors GitHub and the site's table of contents give a heading."""
    text = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    github = re.sub(r"[^\w\- ]", "", text).replace(" ", "-")
    mkdocs = re.sub(r"[-\s]+", "-", re.sub(r"[^\w\s-]", "", text)).strip("-")
    return {github, mkdocs}


@functools.cache
def anchors(page: Path) -> set[str]:
    found: set[str] = set()
    in_code = False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and line.startswith("#"):
            found |= slugs(line.lstrip("#"))
    return found


def public_name(dotted: str) -> bool:
    parts = dotted.split(".")
    for split in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        try:
            for attr in parts[split:]:
                obj = getattr(obj, attr)
        except AttributeError:
            return False
        return True
    return False


@functools.cache
def links() -> list[tuple[Path, str]]:
    found = []
    for page in PAGES:
        text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
        found += [(page, m.group(1)) for m in LINK.finditer(text)]
    return found


def broken_link(page: Path, target: str) -> str | None:
    if URL.match(target) or target.startswith("mailto:"):
        return None
    path, _, anchor = target.partition("#")
    file = (page.parent / path).resolve() if path else page
    if not file.is_relative_to(ROOT):
        return "leaves the repository"
    if not file.exists():
        return "no such file"
    if anchor.startswith("envfleet.") and file.parent.name == "reference":
        # mkdocstrings' anchor of a public name (mkdocs build --strict checks the page has it)
        return None if public_name(anchor) else f"no public name {anchor}"
    if anchor and file.suffix == ".md" and anchor not in anchors(file):
        return f"no heading #{anchor} in {file.relative_to(ROOT)}"
    return None


def named_files(text: Path) -> list[tuple[int, str]]:
    found = []
    for number, line in enumerate(text.read_text().splitlines(), start=1):
        line = URL.sub("", line)
        for pattern in (PATH, TOP_LEVEL):
            found += [(number, m.group(1)) for m in pattern.finditer(line)]
    return found


def missing(text: Path, name: str) -> bool:
    if name in EXTERNAL or name in TO_WRITE or PLACEHOLDER.search(name):
        return False
    return not exists(text, name)


def test_the_scan_sees_the_pages_and_their_names():
    assert len(links()) > 50
    names = {name for text in TEXTS for _, name in named_files(text)}
    assert {"README.md", "docs/architecture.md", "setup.py"} <= names


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_every_relative_link_resolves(page):
    bad = [(t, why) for p, t in links() if p == page and (why := broken_link(p, t))]
    assert bad == []


def test_every_named_file_exists():
    bad = [
        f"{text.relative_to(ROOT)}:{number}: {name}"
        for text in TEXTS
        for number, name in named_files(text)
        if missing(text, name)
    ]
    assert bad == []


def test_a_missing_file_and_a_missing_anchor_are_caught(tmp_path):
    """The checks can fail: a made-up file, a made-up heading."""
    assert broken_link(ROOT / "README.md", "docs/no-such-page.md") == "no such file"
    assert "no heading" in (broken_link(ROOT / "README.md", "docs/quickstart.md#no-such") or "")
    assert broken_link(ROOT / "README.md", "../outside.md") == "leaves the repository"
    assert broken_link(ROOT / "docs" / "index.md", "reference/envfleet.md#envfleet.make") is None
    assert broken_link(ROOT / "docs" / "index.md", "reference/envfleet.md#envfleet.nope")
    page = tmp_path / "page.md"
    page.write_text("See `src/envfleet/_native.py` and DESIGN.md.\n")
    assert [name for _, name in named_files(page) if missing(page, name)] == [
        "src/envfleet/_native.py",
        "DESIGN.md",
    ]
