"""docs/reference/api.md and docs/reference/api/*.md, the plain-Markdown API reference, are
what tools/api_reference.py writes from the public docstrings now.

The test renders the pages again in memory and compares them with the files: a public
signature or docstring that changed without ``python tools/api_reference.py`` fails here, as
does a part left behind by a page that shrank. It also checks that every public name, every
error and warning among them, has its entry.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
from pathlib import Path
from types import ModuleType

import pytest

import envfleet

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def generator() -> ModuleType:
    path = ROOT / "tools" / "api_reference.py"
    spec = importlib.util.spec_from_file_location("envfleet_tools_api_reference", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def pages(generator: ModuleType) -> dict[Path, str]:
    return generator.render()


def test_the_files_are_what_the_docstrings_give(generator: ModuleType, pages) -> None:
    for module, _ in generator.MODULES:  # the pages are written with every public module
        try:
            importlib.import_module(module)
        except ImportError as exc:
            pytest.skip(f"{module} does not import here ({exc}): its page would differ")
    stale = [str(p.relative_to(ROOT)) for p in generator.stale(pages)]
    assert stale == [], "run `python tools/api_reference.py`: these are stale"


def test_rendering_twice_gives_the_same_pages(generator: ModuleType, pages) -> None:
    assert generator.render() == pages


def test_every_public_name_has_an_entry(pages) -> None:
    text = "\n".join(pages.values())
    names = [n for n in envfleet.__all__ if not n.startswith("__")]
    missing = [n for n in names if f"### `envfleet.{n}`" not in text]
    assert missing == []
    errors = [  # every error and warning (a Warning is an Exception)
        n
        for n in names
        if inspect.isclass(getattr(envfleet, n)) and issubclass(getattr(envfleet, n), Exception)
    ]
    assert {"HangWarning", "EnvRestartedWarning", "StepTimeoutError"} <= set(errors)
    errors_page = "\n".join(t for p, t in pages.items() if p.name.startswith("errors"))
    assert [n for n in errors if f"### `envfleet.{n}`" not in errors_page] == []


def test_the_index_links_every_entry_and_each_page_is_short(pages) -> None:
    index = next(t for p, t in pages.items() if p.name == "api.md")
    for name in envfleet.__all__:
        if not name.startswith("__"):
            assert f"[`envfleet.{name}`](api/" in index
    assert max(t.count("\n") for t in pages.values()) <= 300


def test_docstring_forms_become_markdown(generator: ModuleType) -> None:
    doc = generator.parse(
        """Summary with ``code`` and :class:`~envfleet.Sampler`.

        More text.

        Args:
            a, b: the first
                sentence. And a second one that is kept out of the table.
            c: short. Next.

        Returns:
            What it gives.

        Raises:
            ConfigError: when wrong.
        """
    )
    assert generator.markdown(doc.paragraphs[0]) == "Summary with `code` and `Sampler`."
    assert set(doc.entries["Args"]) == {"a", "b", "c"}
    assert generator.first_sentence(doc.entries["Args"]["a"]).startswith("the first sentence.")
    assert list(doc.entries["Raises"]) == ["ConfigError"]
    assert generator.signature("f", lambda x, *, y=0x10: x) == "f(x, *, y=16)"
