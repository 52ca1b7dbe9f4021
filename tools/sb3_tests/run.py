"""Run stable-baselines3's vec-env tests with its own SubprocVecEnv, then with envfleet's.

Usage: python tools/sb3_tests/run.py [--sb3-src DIR] [--envfleet-src DIR] [--suite PATH]...
       [pytest args...]

Copies ``DIR/tests`` (a stable-baselines3 source tree matching the installed SB3; default
``$SB3_SRC`` or ``sb3-src`` beside this checkout) to a temporary folder, so that the installed
SB3 is the one imported, runs ``tests/test_vec_envs.py`` (or each ``--suite``) twice through
the ``envfleet_shim`` plugin, once with SB3's ``SubprocVecEnv`` and once with
``envfleet.adapters.sb3.SB3VecEnv`` in its place (``ENVFLEET_SB3_REPLACE=DummyVecEnv`` replaces
``DummyVecEnv`` instead, by ``SB3VecEnv(..., backend="serial")``), and prints how many of the
tests that pass with SB3's class and create one pass with envfleet, listing the others. Not
part of envfleet's CI. Exit status 0 when every such test passes.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parents[2]  # the default source tree lies beside it
sys.path.insert(0, str(CHECKOUT / "tools"))

from dropin import main  # noqa: E402  (tools/ on the path first)

if __name__ == "__main__":
    replaced = os.environ.get("ENVFLEET_SB3_REPLACE", "SubprocVecEnv")
    sys.exit(
        main(
            "sb3_tests",
            f"stable-baselines3's {replaced}",
            ["tests/test_vec_envs.py"],
            "--sb3-src",
            os.environ.get("SB3_SRC", str(CHECKOUT.parent / "sb3-src")),
            __doc__ or "",
        )
    )
