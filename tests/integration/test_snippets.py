"""Every Python block of README.md and docs/ runs as it is written, in a fresh interpreter.

A reader copies a block into a script and runs it. So each block here is written to a file and
run by a new interpreter with multiprocessing's start method set to ``spawn`` (the strictest:
each worker imports the script again, so a block that starts workers at import fails, as it
would on macOS or under Python 3.14's default). README.md's usage block runs under ``fork``,
``forkserver`` and ``spawn``.

A block that needs what CI may lack says so in an HTML comment on the line before its fence,
which neither GitHub nor the site shows::

    <!-- snippet: needs ray-cluster -->

``needs`` takes module names (skipped when one does not import), ``gpu`` (skipped without
CUDA) and ``ray-cluster`` (a cluster started with ``ray start``; skipped when none runs).
"""

from __future__ import annotations

import functools
import importlib.util
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
FENCE = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
MARK = re.compile(r"<!--\s*snippet:\s*needs\s+([^>]*?)\s*-->\s*\n$")

# Sets the start method, then runs the block as a script's main module, as `python block.py`.
RUNNER = (
    "import multiprocessing, runpy, sys; multiprocessing.set_start_method(sys.argv[1]); "
    "runpy.run_path(sys.argv[2], run_name='__main__')"
)


@dataclass(frozen=True)
class Block:
    page: Path
    line: int
    code: str
    needs: tuple[str, ...]

    @property
    def name(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks() -> list[Block]:
    found = []
    for page in PAGES:
        text = page.read_text()
        for match in FENCE.finditer(text):
            before = text[: match.start()]
            mark = MARK.search(before[-200:])
            needs = tuple(mark.group(1).split()) if mark else ()
            found.append(Block(page, before.count("\n") + 1, match.group(1), needs))
    return found


def _ray_cluster_running() -> bool:
    if importlib.util.find_spec("ray") is None:
        return False
    done = subprocess.run(
        [sys.executable, "-m", "ray.scripts.scripts", "status"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    return done.returncode == 0


@functools.cache
def skip_reason(block: Block) -> str | None:
    for need in block.needs:
        if need == "gpu":
            torch_spec = importlib.util.find_spec("torch")
            if torch_spec is None:
                return "needs a GPU (torch is not installed)"
            import torch

            if not torch.cuda.is_available():
                return "needs a CUDA GPU"
        elif need == "ray-cluster":
            if not _ray_cluster_running():
                return "needs a Ray cluster started with `ray start`"
        elif importlib.util.find_spec(need) is None:
            return f"needs {need} (an optional extra)"
    return None


def run_script(block: Block, start_method: str, tmp_path: Path) -> subprocess.CompletedProcess:
    script = tmp_path / "block.py"
    script.write_text(block.code)
    return subprocess.run(
        [sys.executable, "-c", RUNNER, start_method, str(script)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )


def check(block: Block, start_method: str, done: subprocess.CompletedProcess) -> None:
    assert done.returncode == 0, (
        f"{block.name} failed under {start_method}:\n{block.code}\n{done.stderr[-4000:]}"
    )


def run_block(block: Block, start_method: str, tmp_path: Path) -> None:
    check(block, start_method, run_script(block, start_method, tmp_path))


ALL = blocks()
README_USAGE = next(
    b for b in ALL if b.page.name == "README.md" and "envfleet.make(" in b.code and not b.needs
)


def test_the_pages_have_blocks_and_marks_name_known_needs():
    assert len(ALL) >= 20 and README_USAGE.line < 60
    for block in ALL:
        for need in block.needs:
            assert need in ("gpu", "ray-cluster") or re.fullmatch(r"[a-z_][a-z0-9_]*", need), (
                f"{block.name}: unknown need {need!r}"
            )


def test_the_readme_usage_block_is_short_and_guarded():
    lines = README_USAGE.code.strip().splitlines()
    assert len(lines) <= 12
    assert 'if __name__ == "__main__":' in README_USAGE.code


@pytest.mark.parametrize("start_method", ["fork", "forkserver", "spawn"])
def test_the_readme_usage_block_runs_under(start_method, tmp_path):
    run_block(README_USAGE, start_method, tmp_path)


OTHERS = [b for b in ALL if b is not README_USAGE]  # that one runs under each start method


@pytest.fixture(scope="module")
def spawn_runs(tmp_path_factory):
    """Every block but the README's usage block, run under spawn two at a time (most of a
    block's time is interpreters starting and importing, not the two cores): the first test
    that asks starts them all, each test waits for its own."""
    with ThreadPoolExecutor(max_workers=2) as pool:
        runs = {
            block.name: pool.submit(
                run_script, block, "spawn", tmp_path_factory.mktemp("block", numbered=True)
            )
            for block in OTHERS
            if skip_reason(block) is None
        }
        yield runs
        for run in runs.values():
            run.cancel()


@pytest.mark.parametrize("block", OTHERS, ids=[b.name for b in OTHERS])
def test_block_runs_under_spawn(block, spawn_runs):
    reason = skip_reason(block)
    if reason is not None:
        pytest.skip(reason)
    check(block, "spawn", spawn_runs[block.name].result(timeout=600))


def test_an_unguarded_block_fails_under_spawn(tmp_path):
    """The harness is strict: the README's old usage block, without its guard, fails."""
    unguarded = Block(
        ROOT / "README.md",
        0,
        "import envfleet\n"
        'envs = envfleet.make("CartPole-v1", num_envs=4, num_workers=2)\n'
        "envs.reset(seed=0)\n"
        "envs.close()\n",
        (),
    )
    with pytest.raises(AssertionError, match="failed under spawn"):
        run_block(unguarded, "spawn", tmp_path)
