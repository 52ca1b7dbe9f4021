"""Run gymnasium's vector tests with its own AsyncVectorEnv, then with envfleet in its place.

Usage: python tools/gymnasium_tests/run.py [--gymnasium-src DIR] [--envfleet-src DIR]
       [--suite PATH]... [pytest args...]

Copies ``DIR/tests`` (a Gymnasium checkout matching the installed gymnasium; default
``$GYMNASIUM_SRC`` or ``gymnasium-src`` beside this checkout) to a temporary folder, so that
the installed gymnasium is the one imported, runs ``tests/vector`` and
``tests/wrappers/vector`` twice through the ``envfleet_shim`` plugin, and prints how many of
the tests that pass with gymnasium's AsyncVectorEnv and create one pass with envfleet, listing
the others. Not part of envfleet's CI. Exit status 0 when every such test passes.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parents[2]  # the default source tree lies beside it
sys.path.insert(0, str(CHECKOUT / "tools"))

from dropin import main  # noqa: E402  (tools/ on the path first)

if __name__ == "__main__":
    sys.exit(
        main(
            "gymnasium_tests",
            "gymnasium's AsyncVectorEnv",
            ["tests/vector", "tests/wrappers/vector"],
            "--gymnasium-src",
            os.environ.get("GYMNASIUM_SRC", str(CHECKOUT.parent / "gymnasium-src")),
            __doc__ or "",
        )
    )
