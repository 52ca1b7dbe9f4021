"""What the drop-in runners (``gymnasium_tests/``, ``sb3_tests/``) share.

A client's own test suite is run twice through a pytest plugin (its shim): once with the
client's class (recorded: which tests create one), once with envfleet's in its place. This
module holds both halves of that:

- the plugin half: :func:`note` (the shim's constructor calls it) and the pytest hooks that
  record, per test, whether it created the replaced class and its outcome, into the JSON file
  named by ``ENVFLEET_SHIM_REPORT``. A shim re-exports the hooks so pytest finds them.
- the runner half: :func:`main`, which copies the client's ``tests/`` to a temporary folder
  (so the installed package, not the checkout's, is imported), runs the suites once per mode
  and prints how many of the tests that pass with the client's class and involve it pass with
  envfleet, listing the others.

Not part of envfleet's CI: the runners need a client checkout and take minutes.
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

import pytest

HERE = Path(__file__).resolve().parent
SRC = HERE.parent / "src"

_current: dict[str, Any] = {"test": None}
_involved: set[str] = set()
_outcomes: dict[str, str] = {}


def shim_on() -> bool:
    """Whether this run replaces the client's class by envfleet's (``ENVFLEET_SHIM=1``)."""
    return os.environ.get("ENVFLEET_SHIM") == "1"


def note() -> None:
    """Record that the running test created the replaced class (the client's or envfleet's)."""
    if _current["test"] is not None:
        _involved.add(_current["test"])


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: Any) -> Any:
    _current["test"] = item.nodeid
    yield
    _current["test"] = None


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.failed:
        _outcomes[report.nodeid] = "failed"
    elif report.when == "call" or report.skipped:
        _outcomes.setdefault(report.nodeid, report.outcome)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    path = os.environ.get("ENVFLEET_SHIM_REPORT")
    if path:
        with open(path, "w") as f:
            json.dump({"outcomes": _outcomes, "involved": sorted(_involved)}, f, indent=1)


def _run(
    workdir: Path, shim: str, suites: list[str], replaced: bool, extra: list[str], src: Path
) -> dict[str, Any]:
    report = workdir / ("envfleet.json" if replaced else "client.json")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(HERE / shim), str(HERE), str(src), str(workdir)])
    env["ENVFLEET_SHIM"] = "1" if replaced else "0"
    env["ENVFLEET_SHIM_REPORT"] = str(report)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "envfleet_shim", "-p", "no:cacheprovider"]
    cmd += ["--rootdir", str(workdir), *suites, *extra]
    print(("envfleet" if replaced else "client") + ": " + " ".join(cmd), flush=True)
    done = subprocess.run(cmd, cwd=workdir, env=env, capture_output=True, text=True)
    tail = done.stdout.strip().splitlines()[-1:] if done.stdout.strip() else []
    print("  " + (tail[0] if tail else done.stderr[-2000:]), flush=True)
    if not report.exists():
        raise SystemExit(f"pytest wrote no report (exit {done.returncode}):\n{done.stdout[-4000:]}")
    return dict(json.loads(report.read_text()))


def main(
    shim: str, client: str, suites: list[str], src_flag: str, default_src: str, doc: str
) -> int:
    """Run ``suites`` of the client checkout twice and compare (see the module docstring).

    Args:
        shim: the runner's folder under ``tools/``; its ``envfleet_shim.py`` is the plugin.
        client: the client's name, for the messages (``"gymnasium's AsyncVectorEnv"``).
        suites: test paths inside the checkout (``tests/vector``, ``tests/test_vec_envs.py``).
        src_flag: the runner's own name for ``--src`` (``--gymnasium-src``, ``--sb3-src``).
        default_src: the checkout's default location.
        doc: the runner's docstring (its first line is ``--help``'s description).

    Returns:
        0 when every test that passes with the client's class and involves it passes with
        envfleet, 1 otherwise, 2 without a checkout.
    """
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument(
        "--src", src_flag, dest="src", default=default_src, help="the client's source checkout"
    )
    parser.add_argument(
        "--envfleet-src", default=str(SRC), help="envfleet package folder (default ../../src)"
    )
    parser.add_argument(
        "--suite", action="append", help=f"a test path in the checkout (default {suites})"
    )
    args, extra = parser.parse_known_args()
    src = Path(args.src)
    chosen: list[str] = args.suite or suites
    missing = [s for s in chosen if not (src / s).exists()]
    if missing:
        print(f"no {', '.join(missing)} in {src}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix=f"envfleet-{shim}-") as tmp:
        workdir = Path(tmp)
        shutil.copytree(src / "tests", workdir / "tests")
        base = _run(workdir, shim, chosen, False, extra, SRC)
        fleet = _run(workdir, shim, chosen, True, extra, Path(args.envfleet_src))
    involved = set(base["involved"])
    passed = {t for t, o in base["outcomes"].items() if o == "passed"}
    considered = sorted(involved & passed)
    outcomes: dict[str, str] = fleet["outcomes"]
    failing = [t for t in considered if outcomes.get(t) != "passed"]
    print(
        f"{len(considered) - len(failing)} of the {len(considered)} tests that pass with "
        f"{client} and involve it pass with envfleet"
    )
    for t in failing:
        print(f"  {outcomes.get(t, 'not run')}: {t}")
    return 0 if not failing else 1
