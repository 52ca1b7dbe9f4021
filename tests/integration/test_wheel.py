"""CI's wheel check (``tools/wheel_check.py``) catches what it is there to catch.

The check itself builds and installs wheels (README's test command runs it, about half a
minute); these tests hold its two judgements to the cases it exists for, without building:
which README block it runs, and which wheels it rejects.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load_wheel_check():
    spec = importlib.util.spec_from_file_location("wheel_check", ROOT / "tools" / "wheel_check.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


wheel_check = _load_wheel_check()

SO = "envfleet/_core/_speedups.cpython-311-x86_64-linux-gnu.so"
GOOD = [
    "envfleet/__init__.py",
    "envfleet/py.typed",
    "envfleet/_core/native.py",
    "envfleet-0.1.0.dist-info/METADATA",
    "envfleet-0.1.0.dist-info/RECORD",
]


def test_it_runs_the_readme_usage_block_the_snippet_test_runs():
    from tests.integration.test_snippets import README_USAGE

    assert wheel_check.readme_usage((ROOT / "README.md").read_text()) == README_USAGE.code


def test_the_usage_block_is_the_first_python_block_of_its_section():
    readme = (
        "# x\n\n```python\nnot this\n```\n\n## Usage\n\n```bash\nnor this\n```\n\n"
        "```python\nthis\n```\n\n```python\nnot this one\n```\n"
    )
    assert wheel_check.readme_usage(readme) == "this\n"
    with pytest.raises(wheel_check.CheckFailed, match="no ```python block"):
        wheel_check.readme_usage("## Usage\n\ntext\n\n## Next\n\n```python\nx\n```\n")
    with pytest.raises(wheel_check.CheckFailed, match="no '## Usage'"):
        wheel_check.readme_usage("# x\n")


def test_good_wheels_pass():
    assert wheel_check.wheel_problems([*GOOD, SO], compiled=True) == []
    assert wheel_check.wheel_problems(GOOD, compiled=False) == []


@pytest.mark.parametrize(
    ("names", "compiled", "problem"),
    [
        (GOOD, True, "not one compiled"),  # the extension silently not built
        ([*GOOD, SO], False, "though built without a compiler"),  # a stale .so shipped
        ([n for n in GOOD if n != "envfleet/py.typed"] + [SO], True, "no envfleet/py.typed"),
        ([*GOOD, SO, "tests/test_links.py"], True, "outside the package"),
        ([*GOOD, SO, "envfleet/tests/my_test.py"], True, "a test"),
        ([*GOOD, SO, "envfleet/_core/_speedups.c"], True, "a C source"),
        ([*GOOD, SO, "envfleet/_core/other.cpython-311-x86_64-linux-gnu.so"], True, "stray"),
    ],
)
def test_bad_wheels_fail(names, compiled, problem):
    problems = wheel_check.wheel_problems(names, compiled=compiled)
    assert any(problem in p for p in problems), problems
