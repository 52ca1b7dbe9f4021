"""mkdocs hook: the benchmark plots come from ``benchmarks/results/`` (where the benchmark
scripts write them), served as ``results/NAME.png``, so the site never keeps a second copy."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

RESULTS = Path(__file__).resolve().parent.parent / "benchmarks" / "results"


def on_files(files: Files, config: Any) -> Files:
    for png in sorted(RESULTS.glob("*.png")):
        files.append(File.generated(config, f"results/{png.name}", abs_src_path=str(png)))
    return files
