"""mkdocs hook: the benchmark plots stay in ``benchmarks/results/`` (where the benchmark scripts
write them), so the site never keeps a second copy.

The pages link them as ``../benchmarks/results/NAME.png``, a path that resolves in the
repository (on GitHub, in an editor); the site cannot serve files from above ``docs/``, so this
hook adds each plot to the site as ``results/NAME.png`` and points the pages' links there.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

RESULTS = Path(__file__).resolve().parent.parent / "benchmarks" / "results"
LINKED = "../benchmarks/results/"


def on_files(files: Files, config: Any) -> Files:
    for png in sorted(RESULTS.glob("*.png")):
        files.append(File.generated(config, f"results/{png.name}", abs_src_path=str(png)))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    # A page at docs/a/b.md links ../../benchmarks/...; the site's path is relative to it too.
    up = "../" * page.file.src_uri.count("/")
    return markdown.replace(up + LINKED, up + "results/")
