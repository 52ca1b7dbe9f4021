"""CI's wheel check (README's test command runs it): envfleet's wheel installs and runs.

From a ``git clone`` of this checkout (so no ignored ``build/``, in-place ``.so`` or egg-info
of the checkout can leak in) it builds two wheels with ``python -m build --wheel``: one with
the C compiler, one with ``CC=/bin/false`` (no compiler; the same clone, so the first build's
``build/`` is there to leak a stale extension). It checks what each holds: the package and
``py.typed``, the compiled ``_speedups`` extension in the first and none in the second, no
tests and no C source.

Then it installs the first in a fresh venv (``pip install`` of the wheel alone: numpy,
gymnasium, cloudpickle, psutil, rich) and, from a folder outside the checkout, without
``PYTHONPATH`` or ``ENVFLEET_NO_SPEEDUPS``, checks that envfleet is imported from that venv
with its C extension loaded (``envfleet._core.native.speedups``), runs README's usage block
(the first Python block under ``## Usage``) and a short ``envfleet bench`` (CartPole-v1 x4,
half a second per system).
Last it installs the second wheel over it and checks the pure-Python path: no extension, and
the usage block runs.

Usage: ``python tools/wheel_check.py [--keep]`` (with ``build`` installed: the dev extra);
``--keep`` leaves the temporary folder. Exit status 0 when every check passes, 1 otherwise.
Only HEAD is built: uncommitted changes are not in the wheel (it says so).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXTENSION = re.compile(r"envfleet/_core/_speedups\.[^/]*\.so")
BENCH = ["bench", "CartPole-v1", "--num-envs", "4", "--seconds", "0.5"]
NATIVE = (
    "import envfleet, envfleet._core.native as native\n"
    "print(envfleet.__file__)\n"
    "print(native.speedups is not None)\n"
)


class CheckFailed(Exception):
    """One of the checks failed; the message says which and why."""


def readme_usage(readme: str) -> str:
    """The first ```python block under README's ``## Usage`` heading (before the next one)."""
    heading = re.search(r"^## Usage[ \t]*$", readme, re.M)
    if heading is None:
        raise CheckFailed("README.md has no '## Usage' heading")
    section = readme[heading.end() :]
    following = re.search(r"^## ", section, re.M)
    if following is not None:
        section = section[: following.start()]
    block = re.search(r"^```python\n(.*?)^```", section, re.S | re.M)
    if block is None:
        raise CheckFailed("README.md's '## Usage' section has no ```python block")
    return block.group(1)


def wheel_problems(names: Sequence[str], *, compiled: bool) -> list[str]:
    """What is wrong with a wheel holding the files ``names``: ``compiled`` says whether it
    should hold the C extension (built with a compiler) or not (built without)."""
    problems = []
    if "envfleet/__init__.py" not in names:
        problems.append("no envfleet/__init__.py")
    if "envfleet/py.typed" not in names:
        problems.append("no envfleet/py.typed")
    extensions = [n for n in names if EXTENSION.fullmatch(n)]
    if compiled and len(extensions) != 1:
        problems.append(f"not one compiled envfleet._core._speedups but {extensions}")
    if not compiled and extensions:
        problems.append(f"a C extension though built without a compiler: {extensions}")
    for name in names:
        top = name.split("/", 1)[0]
        if top != "envfleet" and not re.fullmatch(r"envfleet-[^/]*\.dist-info", top):
            problems.append(f"{name}: outside the package")
        elif "/tests/" in name or name.rsplit("/", 1)[-1].startswith(("test_", "conftest")):
            problems.append(f"{name}: a test")
        elif name.endswith((".c", ".h", ".o")):
            problems.append(f"{name}: a C source or object")
        elif name.endswith(".so") and not EXTENSION.fullmatch(name):
            problems.append(f"{name}: a stray shared library")
    return problems


def run(
    args: Sequence[str | Path], *, cwd: Path, env: dict[str, str] | None = None, what: str
) -> str:
    """Run ``args``; its output (stdout and stderr) on success, CheckFailed with it if not."""
    start = time.monotonic()
    done = subprocess.run(
        [str(a) for a in args],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    if done.returncode != 0:
        raise CheckFailed(f"{what}: exit status {done.returncode}\n{done.stdout[-6000:]}")
    say(f"{what}: ok ({time.monotonic() - start:.0f} s)")
    return done.stdout


def say(line: str) -> None:
    print(f"wheel check: {line}", flush=True)


def build_wheel(source: Path, outdir: Path, *, compiler: bool) -> Path:
    env = dict(os.environ)
    if not compiler:
        env["CC"] = "/bin/false"
    what = "build the wheel" + ("" if compiler else " with CC=/bin/false")
    run(
        [sys.executable, "-m", "build", "--wheel", "--outdir", outdir, source],
        cwd=source,
        env=env,
        what=what,
    )
    wheels = sorted(outdir.glob("envfleet-*.whl"))
    if len(wheels) != 1:
        raise CheckFailed(f"{what}: not one wheel in {outdir}: {wheels}")
    with zipfile.ZipFile(wheels[0]) as wheel:
        problems = wheel_problems(wheel.namelist(), compiled=compiler)
    if problems:
        raise CheckFailed(f"{wheels[0].name} ({what}):\n  " + "\n  ".join(problems))
    say(f"{wheels[0].name} holds py.typed, " + ("its C extension" if compiler else "no .so"))
    return wheels[0]


def check_installed(
    python: Path, venv: Path, outside: Path, env: dict[str, str], *, native: bool
) -> None:
    out = run([python, "-c", NATIVE], cwd=outside, env=env, what="import envfleet")
    where, loaded = out.strip().splitlines()[-2:]
    if not Path(where).resolve().is_relative_to(venv.resolve()):
        raise CheckFailed(f"envfleet was imported from {where}, not from the wheel's venv")
    if (loaded == "True") != native:
        state = "did not load" if native else "loaded"
        raise CheckFailed(f"the C extension {state} (envfleet._core.native.speedups)")
    say(f"envfleet imported from the venv, C extension {'loaded' if native else 'absent'}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep", action="store_true", help="leave the temporary folder")
    args = parser.parse_args(argv)
    started = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="envfleet-wheel-check-"))
    try:
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        if dirty:
            say("uncommitted changes are not in the wheel (it is built from HEAD)")
        source = work / "clone"
        run(["git", "clone", "--quiet", ROOT, source], cwd=work, what="git clone")
        compiled = build_wheel(source, work / "dist", compiler=True)
        pure = build_wheel(source, work / "dist-pure", compiler=False)

        venv = work / "venv"
        run([sys.executable, "-m", "venv", venv], cwd=work, what="a fresh venv")
        python = venv / "bin" / "python"
        run([python, "-m", "pip", "install", "-q", compiled], cwd=work, what="pip install")
        outside = work / "outside"
        outside.mkdir()
        # Nothing of the checkout's importable, nor the extension turned off (native.py)
        dropped = ("PYTHONPATH", "VIRTUAL_ENV", "ENVFLEET_NO_SPEEDUPS")
        env = {k: v for k, v in os.environ.items() if k not in dropped}
        env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
        usage = outside / "readme_usage.py"
        usage.write_text(readme_usage((source / "README.md").read_text()))

        check_installed(python, venv, outside, env, native=True)
        run([python, usage], cwd=outside, env=env, what="README's usage block")
        table = run([venv / "bin" / "envfleet", *BENCH], cwd=outside, env=env, what="bench")
        print(table, end="")

        run(
            [python, "-m", "pip", "install", "-q", "--force-reinstall", "--no-deps", pure],
            cwd=work,
            what="pip install the CC=/bin/false wheel",
        )
        check_installed(python, venv, outside, env, native=False)
        run([python, usage], cwd=outside, env=env, what="README's usage block, pure Python")
    except CheckFailed as failure:
        print(f"wheel check: FAILED: {failure}", file=sys.stderr)
        return 1
    finally:
        if args.keep:
            say(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    say(f"passed in {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
