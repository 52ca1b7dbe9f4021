"""Run gymnasium's vector tests with its own AsyncVectorEnv, then with envfleet in its place.

Usage: python tools/gymnasium_tests/run.py [--gymnasium-src DIR] [--envfleet-src DIR]
       [pytest args...]

Copies ``DIR/tests`` (a Gymnasium checkout matching the installed gymnasium; default
``$GYMNASIUM_SRC`` or ``/work/gymnasium-src``) to a temporary folder, so that the installed
gymnasium is the one imported, runs ``tests/vector`` and ``tests/wrappers/vector`` twice
through the ``envfleet_shim`` plugin, and prints how many of the tests that pass with
gymnasium's AsyncVectorEnv and create one pass with envfleet, listing the others.
Not part of envfleet's CI. Exit status 0 when every such test passes.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
SRC = HERE.parents[1] / "src"
SUITES = ["tests/vector", "tests/wrappers/vector"]


def run(workdir: Path, shim: bool, extra: list[str], src: Path = SRC) -> dict[str, Any]:
    report = workdir / ("envfleet.json" if shim else "gymnasium.json")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), str(src), str(workdir)])
    env["ENVFLEET_SHIM"] = "1" if shim else "0"
    env["ENVFLEET_SHIM_REPORT"] = str(report)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "envfleet_shim", "-p", "no:cacheprovider"]
    cmd += ["--rootdir", str(workdir), *SUITES, *extra]
    print(("envfleet" if shim else "gymnasium") + ": " + " ".join(cmd), flush=True)
    done = subprocess.run(cmd, cwd=workdir, env=env, capture_output=True, text=True)
    tail = done.stdout.strip().splitlines()[-1:] if done.stdout.strip() else []
    print("  " + (tail[0] if tail else done.stderr[-2000:]), flush=True)
    return json.loads(report.read_text())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--gymnasium-src", default=os.environ.get("GYMNASIUM_SRC", "/work/gymnasium-src")
    )
    parser.add_argument(
        "--envfleet-src", default=str(SRC), help="envfleet package folder (default ../../src)"
    )
    args, extra = parser.parse_known_args()
    src = Path(args.gymnasium_src)
    if not (src / "tests" / "vector").is_dir():
        print(f"no Gymnasium tests at {src}/tests", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="envfleet-gym-tests-") as tmp:
        workdir = Path(tmp)
        shutil.copytree(src / "tests", workdir / "tests")
        base = run(workdir, False, extra)
        fleet = run(workdir, True, extra, Path(args.envfleet_src))
    involved = set(base["involved"])
    passed = {t for t, o in base["outcomes"].items() if o == "passed"}
    considered = sorted(involved & passed)
    outcomes: dict[str, str] = fleet["outcomes"]
    failing = [t for t in considered if outcomes.get(t) != "passed"]
    print(
        f"{len(considered) - len(failing)} of the {len(considered)} tests that pass with "
        "gymnasium's AsyncVectorEnv and involve it pass with envfleet"
    )
    for t in failing:
        print(f"  {outcomes.get(t, 'not run')}: {t}")
    return 0 if not failing else 1


if __name__ == "__main__":
    sys.exit(main())
