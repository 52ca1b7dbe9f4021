"""mkdocs hook: files that live outside ``docs/`` and that the pages link as they lie in the
repository, so that the links resolve on GitHub and in an editor too.

- The benchmark plots stay in ``benchmarks/results/`` (where the benchmark scripts write them),
  so the site never keeps a second copy. The pages link them as
  ``../benchmarks/results/NAME.png``; the site cannot serve files from above ``docs/``, so this
  hook adds each plot to the site as ``results/NAME.png`` and points the pages' links there.
- ``CHANGELOG.md`` stays at the repository's root, where a reader of the repository looks for
  it. The pages link it as ``../CHANGELOG.md``; this hook adds it to the site as the page
  ``changelog.md`` (its own links, written from the root as ``docs/NAME.md``, made relative
  to ``docs/``) and points the pages' links there.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
LINKED = "../benchmarks/results/"
CHANGELOG = ROOT / "CHANGELOG.md"
CHANGELOG_PAGE = "changelog.md"


def on_files(files: Files, config: Any) -> Files:
    for png in sorted(RESULTS.glob("*.png")):
        files.append(File.generated(config, f"results/{png.name}", abs_src_path=str(png)))
    files.append(File.generated(config, CHANGELOG_PAGE, abs_src_path=str(CHANGELOG)))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    if page.file.src_uri == CHANGELOG_PAGE:
        return markdown.replace("](docs/", "](")
    # A page at docs/a/b.md links ../../benchmarks/...; the site's path is relative to it too.
    depth = page.file.src_uri.count("/")
    up = "../" * depth
    markdown = markdown.replace(up + LINKED, up + "results/")
    return markdown.replace(f"]({up}../CHANGELOG.md)", f"]({up}{CHANGELOG_PAGE})")
