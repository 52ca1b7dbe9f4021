"""Every measured figure quoted in the prose of README.md and docs/ links to the row of a
benchmark page (docs/benchmarks.md, or a page under docs/benchmarks/) that measured it, and
that row has the same number.

The benchmark pages are the one source of the project's measured figures: each section gives
the command, the machine, the date and the commit of its table. Another page that mentions
such a figure either describes it without a number and links the section, or quotes the
number inside the text of a link to that section whose title names the row it is read from
(here from a page at the top of docs/; from docs/concepts/ the target starts with ``../``, from
README.md with ``docs/``)::

    the default Sampler ran [0.93x](benchmarks/learning.md#the-learners-loop "Sampler (default")

This test reads README.md and every page of docs/ (the benchmark pages excepted: they are the
source; the generated API reference, docs/reference/api*, too: it is the docstrings), finds the
figures in its prose and fails when one

- is not inside the text of a Markdown link to a benchmark page with an anchor that names one
  of its sections: the reader cannot check it, and whoever measures again cannot find the
  pages that quote it;
- has a link without a title: a section's table holds dozens of numbers, so the number alone
  would match by chance (``0.97`` is in the learner's-loop table, though not in the default
  Sampler's row);
- or names a number that no row of the linked section both contains and matches the title
  (a row: a table row, or a paragraph of the section's prose; the title is compared without
  Markdown's ``*`` and backticks, case-insensitively). A number matches at the precision it is
  quoted with: ``18.8`` matches the row's ``18.80``, ``20 µs`` its ``20.4 µs``, ``152k`` its
  ``152,345`` or ``152k``; each end of a range (``0.96-0.99``, ``17.0k-24.9k``) is a figure.

A figure, in a page's prose (fenced code, Markdown tables and HTML comments are left out: a
page's own table is its own measurement, with its own command beside it), is

- a ratio: a decimal followed by ``x`` or ``×`` (``0.97x``, ``1.65 ×``). Integers next to ``×``
  are sizes, not ratios (``Pong ×8``, ``84×84``), and are not read;
- a fraction of the limit: every decimal or percentage in a sentence that speaks of "the
  limit" or of "what the cores can do";
- a time in microseconds (``46.2 µs``, ``12 µs``, ``38 against 42 µs``: every number of such a
  list), or an approximate time in milliseconds (``about 2 ms``). Other times in ms or s are
  the settings of an env or a call (``a 5 ms sleep``, ``default 60 s``) and are not read;
- a rate: a number followed by ``steps/s`` or ``/s``, or with a ``k`` suffix (``10.2k``).

This reads figures by their form, not by a marker a writer must remember: a figure pasted
without its link is caught as well as a stale one. What it cannot see is a figure written
otherwise (in words, or a percentage outside a sentence about the limit); those are left to
review.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
SOURCE = "benchmarks.md"
GENERATED = ("reference/api.md", "reference/api/")  # tools/api_reference.py's pages

NUMBER = r"\d[\d,]*(?:\.\d+)?"
RATIO = re.compile(r"(?<![\w.,])(\d+\.\d+)\s?[x×](?![\w])")
DECIMAL_OR_PERCENT = re.compile(r"(?<![\w.,])(\d+\.\d+|\d+(?:\.\d+)?%)(?![\w])")
LIMIT_WORDS = re.compile(r"\bthe limit\b|\bwhat the cores can do\b", re.I)
# µs: the last number before the unit and those listed before it ("38 against 42 µs",
# "8.4 and 20.4 µs", "16-22 µs"); ms only after "about".
MICROSECONDS = re.compile(
    rf"((?:{NUMBER}(?:\s*(?:-|–|,|and|or|against|to)\s*))*{NUMBER})\s?(?:µs|us)\b"
)
ABOUT_MS = re.compile(rf"\babout ({NUMBER})\s?ms\b")
RATE = re.compile(rf"(?<![\w.,])({NUMBER}k?)\s?(?:steps/s|/s)\b")
THOUSANDS = re.compile(r"(?<![\w.,])(\d+(?:\.\d+)?k)(?![\w])")
ANY_NUMBER = re.compile(rf"(?<![\w.]){NUMBER}k?(?![\d])")
LINK = re.compile(r'(?<!!)\[((?:[^\[\]]|\[[^\]]*\])*)\]\(([^)\s]+)(?:\s+"([^"]*)")?\)')
SENTENCE_END = re.compile(r"(?<=[.;!?])\s+(?=[A-Z(`*\[])")
HEADING = re.compile(r"^(#{1,6})\s+(.*)$")


def slugs(heading: str) -> set[str]:
    """The anchors GitHub and the site's table of contents give a heading (as test_links)."""
    # Markdown's marks go (a link's text stays); an underscore only where it marks emphasis,
    # not inside a name (`split_infos`).
    text = re.sub(r"[`*]|(?<!\w)_|_(?!\w)|\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = text.strip().lower()
    github = re.sub(r"[^\w\- ]", "", text).replace(" ", "-")
    mkdocs = re.sub(r"[-\s]+", "-", re.sub(r"[^\w\s-]", "", text)).strip("-")
    return {github, mkdocs}


def plain(text: str) -> str:
    return re.sub(r"[`*]", "", text).lower()


def sections(source: Path) -> dict[str, list[str]]:
    """Each heading's anchors mapped to its section's rows (table rows and prose paragraphs),
    down to the next heading of the same or a higher level."""
    lines = source.read_text().splitlines()
    headings = []
    in_code = False
    for i, line in enumerate(lines):
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and (m := HEADING.match(line)):
            headings.append((i, len(m.group(1)), m.group(2)))
    found: dict[str, list[str]] = {}
    for k, (start, level, title) in enumerate(headings):
        end = next((i for i, lv, _ in headings[k + 1 :] if lv <= level), len(lines))
        body = lines[start + 1 : end]
        rows = [line for line in body if line.strip().startswith("|")]
        rows += paragraphs("\n".join(body))
        for slug in slugs(title):
            found[slug] = rows
    return found


def paragraphs(text: str) -> list[str]:
    """The prose of ``text``, one paragraph a string: no fenced code, tables, HTML comments or
    headings."""
    text = re.sub(r"<!--.*?-->", "", text, flags=re.S)
    kept: list[str] = []
    current: list[str] = []
    in_code = False
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("```"):
            in_code = not in_code
            stripped = ""
        if in_code or stripped.startswith("|") or stripped.startswith("#"):
            stripped = ""
        if stripped:
            current.append(stripped)
        elif current:
            kept.append(" ".join(current))
            current = []
    if current:
        kept.append(" ".join(current))
    return kept


def figures_in(paragraph: str) -> list[tuple[int, str]]:
    """(offset, number) of each figure of one paragraph."""
    found = {m.start(1): m.group(1) for m in RATIO.finditer(paragraph)}
    for m in MICROSECONDS.finditer(paragraph):
        for n in re.finditer(NUMBER, m.group(1)):
            found.setdefault(m.start(1) + n.start(), n.group(0))
    for pattern in (ABOUT_MS, RATE, THOUSANDS):
        for m in pattern.finditer(paragraph):
            found.setdefault(m.start(1), m.group(1))
    offset = 0
    for sentence in SENTENCE_END.split(paragraph):
        start = paragraph.index(sentence, offset)
        offset = start + len(sentence)
        if LIMIT_WORDS.search(sentence):
            for m in DECIMAL_OR_PERCENT.finditer(sentence):
                found.setdefault(start + m.start(1), m.group(1))
    return sorted(found.items())


def value(number: str) -> tuple[float, int]:
    """A figure's value and the decimals it is written with (``"11.8k"``: 11800.0, 1; the
    decimals count in the unit written, so ``11.8k`` is precise to a hundred)."""
    text = number.replace(",", "").rstrip("%")
    scale = 1000.0 if text.endswith("k") else 1.0
    text = text.rstrip("k")
    decimals = len(text.partition(".")[2])
    return float(text) * scale, decimals - (3 if scale > 1 else 0)


def number_in(number: str, text: str) -> bool:
    """Whether ``text`` holds ``number`` at the precision it is written with."""
    wanted, decimals = value(number)
    for m in ANY_NUMBER.finditer(text):
        found, _ = value(m.group(0))
        if round(found, decimals) == round(wanted, decimals):
            return True
    return False


def sources(docs: Path = DOCS) -> list[Path]:
    """The benchmark pages: docs/benchmarks.md and the pages under docs/benchmarks/."""
    return [docs / SOURCE, *sorted((docs / SOURCE.removesuffix(".md")).glob("*.md"))]


def quoting_pages(docs: Path = DOCS) -> list[Path]:
    """README.md (beside docs/) and every page of docs/ but the sources and the generated
    reference."""
    readme = docs.parent / "README.md"
    own = {p.resolve() for p in sources(docs)}
    pages = [
        page
        for page in sorted(docs.rglob("*.md"))
        if page.resolve() not in own and not str(page.relative_to(docs)).startswith(GENERATED)
    ]
    return ([readme] if readme.exists() else []) + pages


def problems(docs: Path = DOCS) -> list[str]:
    """What is wrong with the figures quoted in README.md and docs/, one line each; empty when
    nothing is."""
    pages = {page.resolve(): sections(page) for page in sources(docs)}
    found = []
    for page in quoting_pages(docs):
        name = str(page.relative_to(docs.parent))
        for paragraph in paragraphs(page.read_text()):
            links = [m for m in LINK.finditer(paragraph)]
            for offset, number in figures_in(paragraph):
                if any(m.end(1) <= offset < m.end() for m in links):
                    continue  # in a link's target or title: the row it names, not a quote
                where = f"{name}: {number!r} in {paragraph[max(0, offset - 60) : offset + 40]!r}"
                link = next((m for m in links if m.start(1) <= offset < m.end(1)), None)
                path, _, anchor = (link.group(2) if link else "").partition("#")
                target = (page.parent / path).resolve() if link else None
                known = pages.get(target) if target else None
                if link is None or known is None:
                    found.append(f"{where}: not in the text of a link to a benchmark page")
                elif anchor not in known:
                    found.append(f"{where}: the link names no section of {path}")
                elif not link.group(3):
                    found.append(f'{where}: the link has no "title" naming the row it quotes')
                elif not any(
                    plain(link.group(3)) in plain(row) and number_in(number, row)
                    for row in known[anchor]
                ):
                    found.append(
                        f"{where}: no row of {path}#{anchor} has {link.group(3)!r} and {number}"
                    )
    return found


def test_figures_in_the_docs_link_to_their_row_of_a_benchmark_page():
    assert len(quoting_pages()) > 20 and quoting_pages()[0].name == "README.md"
    assert problems() == []


def test_a_figure_that_disagrees_with_its_row_or_has_no_link_is_caught(tmp_path):
    docs = tmp_path / "docs"
    (docs / "benchmarks").mkdir(parents=True)
    (docs / SOURCE).write_text(
        "# Benchmarks\n\n## The main job\n\n| env | system | x gym-async |\n|---|---|---:|\n"
        "| CartPole-v1, 16 | processes | 18.80 |\n\n"
        "A round trip read 8.4 µs spinning and 20.4 µs sleeping.\n"
    )
    (docs / "benchmarks" / "learning.md").write_text(
        "# Learning\n\n## The learner's loop\n\n| system | CartPole |\n|---|---:|\n"
        "| **envfleet `Sampler` (default)** | 1,000 (0.93) |\n"
        "| envfleet `Sampler(inference=driver)` | 900 (0.97) |\n\n"
        "The Sampler ran 1.17x on Pong; a pool ran 17.0k-24.9k steps/s.\n"
    )
    (tmp_path / "README.md").write_text(
        "It steps [16 CartPoles 18.8x as fast]"
        '(docs/benchmarks.md#the-main-job "CartPole-v1, 16").\n'
    )
    page = docs / "concepts" / "page.md"
    page.parent.mkdir()
    top = "../"  # the page is in a folder of docs/
    up = top + "benchmarks/" + "learning.md"
    row = '"Sampler (default"'
    page.write_text(
        f"Right: [0.93x the loop]({up}#the-learners-loop {row}), and\n"
        f'[1.17x on Pong]({up}#the-learners-loop "1.17x on Pong"), and a pool at\n'
        f'[17.0k-24.9k]({up}#the-learners-loop "a pool ran"), and [about 20\n'
        f'µs]({top}benchmarks.md#the-main-job "A round trip").\n\n'
        "Sizes and settings are not figures: Pong ×8, 84×84, a 5 ms sleep, default 60 s.\n\n"
        "```python\nx = 0.5  # 2.0x in code is not prose\n```\n\n"
        f"Wrong row: [0.97x the loop]({up}#the-learners-loop {row}).\n\n"
        "Unlinked: it runs at 0.89 of the limit.\n\n"
        f"No section: [1.17x]({up}#nowhere {row}).\n\n"
        f"No title: [0.93x]({up}#the-learners-loop).\n\n"
        "Unlinked times and rates: 37 µs alone, about 2 ms a round trip, 10.2k steps/s.\n"
    )
    found = problems(docs)
    assert len(found) == 7, found
    assert "'0.97'" in found[0] and "has 'Sampler (default' and 0.97" in found[0]
    assert "'0.89'" in found[1] and "not in the text of a link" in found[1]
    assert "names no section" in found[2]
    assert 'no "title"' in found[3]
    assert ["'37'" in found[4], "'2'" in found[5], "'10.2k'" in found[6]] == [True] * 3


def test_a_number_matches_at_the_precision_it_is_written_with():
    assert number_in("18.8", "| 18.80 |") and number_in("20", "20.4 µs")
    assert number_in("152k", "152,345 steps/s") and number_in("11.8k", "11,812")
    assert number_in("0.93", "(0.93 / 0.97)") and not number_in("0.93", "0.97")
    assert not number_in("18.8", "18.88") and number_in("87%", "**87%**")
