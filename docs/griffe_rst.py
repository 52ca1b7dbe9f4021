"""A griffe extension for the API reference: envfleet's docstrings use a few reStructuredText
forms (``:class:`x``` roles, ``::`` literal blocks) that Markdown would show verbatim.

This rewrites them in the docstrings griffe hands to mkdocstrings (the sources are not
touched): a role becomes a code span that links to the object when the reference has it
(an optional autoref, so a private or external target is plain code, not a warning); a
paragraph ending in ``::`` becomes one ending in ``:`` followed by a fenced Python block; a
reST simple table becomes a Markdown table. Two Google-style slips are mended too: one
``Args:`` entry for several names (``a, b: ...``) becomes one entry per name, and a
``Raises:`` entry written as a sentence becomes ``Exception: <the sentence>``.
"""

from __future__ import annotations

import re
from typing import Any

from griffe import Extension, Object

_ROLE = re.compile(r":(?:class|func|meth|mod|attr|data|exc|obj):`(~?)([^`]+)`")


def _identifier(obj: Object, target: str) -> str:
    """``target``'s full path, resolved in ``obj``'s scope as Python would (else as given)."""
    if target.startswith("envfleet."):
        return target
    first, _, rest = target.partition(".")
    try:
        path = obj.resolve(first)
    except Exception:  # a name griffe cannot place (external, or a typo): plain code
        return target
    return f"{path}.{rest}" if rest else path


def _roles(obj: Object, text: str) -> str:
    def role(match: re.Match[str]) -> str:
        short, target = match.group(1), re.sub(r"\s+", "", match.group(2))
        shown = target.rsplit(".", 1)[-1] if short else target
        identifier = _identifier(obj, target)
        return f'<autoref identifier="{identifier}" optional><code>{shown}</code></autoref>'

    return _ROLE.sub(role, text)


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _literal_blocks(text: str) -> str:
    lines = text.split("\n")
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if not line.rstrip().endswith("::"):
            out.append(line)
            i += 1
            continue
        head = line.rstrip()[:-2].rstrip()
        if head.strip():
            out.append(head + ":")
        base = _indent(line)
        j = i + 1
        while j < len(lines) and not lines[j].strip():
            j += 1
        k = j
        while k < len(lines) and (not lines[k].strip() or _indent(lines[k]) > base):
            k += 1
        while k > j and not lines[k - 1].strip():
            k -= 1
        if k == j:  # no indented block follows: only the marker goes
            i += 1
            continue
        block = lines[j:k]
        inner = min(_indent(b) for b in block if b.strip())
        # A section title ("Example::") keeps its block inside the section (indented); a
        # paragraph's block becomes a fence at the paragraph's own indentation.
        pad = " " * (inner if _is_title(head) else base)
        out.append("")
        out.append(pad + "```python")
        out.extend(pad + b[inner:] if b.strip() else "" for b in block)
        out.append(pad + "```")
        i = k
    return "\n".join(out)


def _is_title(head: str) -> bool:
    return bool(re.fullmatch(r"\s*(Example|Examples|Usage)", head))


_SECTION = re.compile(r"(\s*)(Args|Arguments|Parameters|Attributes|Keyword Args):\s*$")
_GROUPED = re.compile(r"(\s+)(\*{0,2}\w+(?:,\s*\*{0,2}\w+)+):(.*)$")


def _grouped_items(text: str) -> str:
    """Split ``a, b: description`` (one entry for several parameters, which Google style
    lacks) into one entry per parameter, each with the whole description."""
    lines = text.split("\n")
    out: list[str] = []
    section: int | None = None  # the indentation of the Args-like header we are in
    i = 0
    while i < len(lines):
        line = lines[i]
        header = _SECTION.fullmatch(line)
        if header:
            section = len(header.group(1))
        elif line.strip() and section is not None and _indent(line) <= section:
            section = None
        grouped = _GROUPED.fullmatch(line) if section is not None else None
        if grouped is None:
            out.append(line)
            i += 1
            continue
        pad, names, first = grouped.groups()
        j = i + 1
        while j < len(lines) and lines[j].strip() and _indent(lines[j]) > len(pad):
            j += 1
        for name in (n.strip().lstrip("*") for n in names.split(",")):
            out.append(f"{pad}{name}:{first}")
            out.extend(lines[i + 1 : j])
        i = j
    return "\n".join(out)


_RULE = re.compile(r"\s*=+(\s+=+)+\s*")


def _simple_tables(text: str) -> str:
    """reST simple tables (``====  ====`` rules, a header row, rows whose first cell is empty
    continuing the row above) as Markdown tables."""
    lines = text.split("\n")
    out: list[str] = []
    i = 0
    while i < len(lines):
        if not _RULE.fullmatch(lines[i]):
            out.append(lines[i])
            i += 1
            continue
        rule = lines[i]
        spans = [m.span() for m in re.finditer(r"=+", rule)]
        rules = [i]
        j = i + 1
        while j < len(lines) and len(rules) < 3:
            if lines[j] == rule:
                rules.append(j)
            j += 1
        if len(rules) < 3:  # not a whole table: leave it as it is
            out.append(lines[i])
            i += 1
            continue
        pad = rule[: _indent(rule)]

        starts = [start for start, _ in spans]

        def cells(line: str, starts: list[int] = starts) -> list[str]:
            bounds = [*starts[1:], len(line) + 1]
            return [line[a:b].strip() for a, b in zip(starts, bounds, strict=True)]

        rows: list[list[str]] = []
        for line in lines[rules[1] + 1 : rules[2]]:
            if not line.strip():
                continue
            row = cells(line)
            if row[0] or not rows:
                rows.append(row)
            else:
                rows[-1] = [f"{a} {b}".strip() for a, b in zip(rows[-1], row, strict=True)]
        header = cells(lines[rules[0] + 1])
        out.append(pad + "| " + " | ".join(header) + " |")
        out.append(pad + "|" + "---|" * len(header))
        out.extend(pad + "| " + " | ".join(row) + " |" for row in rows)
        i = rules[2] + 1
    return "\n".join(out)


_RAISES = re.compile(r"(\s*)Raises:\s*$")
_EXCEPTION_ITEM = re.compile(r"\s*[\w.]+(?:,\s*[\w.]+)*(?:\s*\([^)]*\))?:(\s|$).*")


def _prose_raises(text: str) -> str:
    """A ``Raises:`` entry written as a sentence (``Whatever the wrapped env raises ...``)
    becomes ``Exception: <the sentence>``, its other lines its continuation."""
    lines = text.split("\n")
    out: list[str] = []
    section: int | None = None
    item: int | None = None  # the indentation of the section's entries
    prose = False
    for line in lines:
        header = _RAISES.fullmatch(line)
        if header:
            section, item, prose = len(header.group(1)), None, False
            out.append(line)
            continue
        if line.strip() and section is not None and _indent(line) <= section:
            section = None
        if section is None or not line.strip():
            out.append(line)
            continue
        if item is None:
            item = _indent(line)
        if _indent(line) == item:
            if _EXCEPTION_ITEM.fullmatch(line):
                prose = False
            elif prose:
                line = " " * 4 + line
            else:
                line, prose = " " * item + "Exception: " + line.strip(), True
        out.append(line)
    return "\n".join(out)


def rewrite(obj: Object, text: str) -> str:
    """``text`` (``obj``'s docstring) with roles, literal blocks and grouped parameters in
    Google-style Markdown."""
    return _prose_raises(_grouped_items(_simple_tables(_literal_blocks(_roles(obj, text)))))


def _walk(obj: Object) -> Any:
    yield obj
    for member in obj.members.values():
        if not member.is_alias:
            yield from _walk(member)  # type: ignore[arg-type]


class RstToMarkdown(Extension):
    """Rewrite every docstring of the package once it is loaded (names resolve then)."""

    def on_package(self, *, pkg: Any, **kwargs: Any) -> None:
        for obj in _walk(pkg):
            if obj.docstring is not None:
                obj.docstring.value = rewrite(obj, obj.docstring.value)
