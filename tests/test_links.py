"""Every relative link and every file named in README.md, docs/, the docstrings and setup.py
exists in the repository.

A reader follows a link or opens a file the text names; a page that points at a file that moved
or never was here (a page kept in another repository, a test that moved to a subfolder) sends
them nowhere. Three checks:

- links: every relative Markdown link or image of README.md, CHANGELOG.md, docs/ and
  benchmarks/results/ resolves to a file of the repository, and an anchor into a Markdown page
  names one of its headings;
- named files: every path-like name (``a/b.py``, ``docs/x.md``) and every top-level file name
  (``README.md``, ``setup.py``...) written in README.md, docs/, benchmarks/README.md, the
  Python sources (docstrings and comments: src, tests, benchmarks, examples, tools), setup.py,
  pyproject.toml and mkdocs.yml exists, read from the repository's root, the text's own folder,
  ``src/`` or ``src/envfleet/``;
- code names: every module, class, function or attribute docs/architecture.md and the pages
  under docs/architecture/ cite exists in src/envfleet (the rule:
  :func:`test_every_code_name_of_the_architecture_page_exists`).
"""

from __future__ import annotations

import ast
import functools
import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [
    ROOT / "README.md",
    ROOT / "CHANGELOG.md",
    *sorted((ROOT / "docs").rglob("*.md")),
    *sorted((ROOT / "benchmarks" / "results").glob("*.md")),  # the index and the older runs
]
TEXTS = [
    *PAGES,
    ROOT / "benchmarks" / "README.md",
    ROOT / "setup.py",
    ROOT / "pyproject.toml",
    ROOT / "mkdocs.yml",
    *sorted(
        p
        for d in ("src", "tests", "benchmarks", "examples", "tools")
        for p in (ROOT / d).rglob("*.py")
        if p != Path(__file__).resolve()
    ),
]

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
URL = re.compile(r"[a-z][a-z0-9+.-]*://\S+")
EXTENSIONS = "py|md|png|json|toml|yml|yaml|sh|c|txt|cfg|ini|whl"
PATH = re.compile(rf"(?<![\w./@:-])((?:[\w.-]+/)+[\w.-]*\w\.(?:{EXTENSIONS}))(?![\w/-])")
TOP_LEVEL = re.compile(
    r"(?<![\w./-])([A-Z][A-Z_]*\.md|LICENSE|setup\.py|pyproject\.toml|mkdocs\.yml)(?![\w/-])"
)
# Files of other projects, named as theirs where they are named.
EXTERNAL = {
    "tests/test_vec_envs.py",  # stable-baselines3's vec-env tests (tools/sb3_tests/)
    "tests/vector/test_async_vector_env.py",  # gymnasium's
    "tests/vector/test_sync_vector_env.py",  # gymnasium's
    "envpool/entry.py",  # EnvPool's
    "cleanrl/ppo_atari_envpool.py",  # CleanRL's
    "concurrent/futures/process.py",  # CPython's
}
# Files a page tells the reader to write.
TO_WRITE = {"envfleet/_backends/inline.py"}  # architecture.md's new backend
# Names a text makes up: a user's files, outputs, placeholders.
PLACEHOLDER = re.compile(r"[*{}<>$]|\bNAME\b|\bFILE\b|\bPATH\b|\.\.\.|^my_|/my_")


def repository_files() -> list[str]:
    skip = {".git", ".venv", ".venv-bench", "site", "build", "dist", "__pycache__"}
    return [
        "/" + str(p.relative_to(ROOT))
        for p in ROOT.rglob("*")
        if p.is_file() and not skip & set(p.relative_to(ROOT).parts)
    ]


FILES = repository_files()


def exists(text: Path, name: str) -> bool:
    """``name`` from the root, from the text's folder or docs/ (mkdocs.yml's pages), or as
    the tail of a repository path (``processes/worker.py`` for the module under _backends/)."""
    if any((base / name).exists() for base in (ROOT, text.parent, ROOT / "docs")):
        return True
    tail = "/" + name.removeprefix("./")
    return any(f.endswith(tail) for f in FILES)


def slugs(heading: str) -> set[str]:
    """The anchors GitHub and the site's table of contents give a heading."""
    # Markdown's marks go (a link's text stays); an underscore only where it marks emphasis,
    # not inside a name (`split_infos`).
    text = re.sub(r"[`*]|(?<!\w)_|_(?!\w)|\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = text.strip().lower()
    github = re.sub(r"[^\w\- ]", "", text).replace(" ", "-")
    mkdocs = re.sub(r"[-\s]+", "-", re.sub(r"[^\w\s-]", "", text)).strip("-")
    return {github, mkdocs}


@functools.cache
def anchors(page: Path) -> set[str]:
    found: set[str] = set()
    in_code = False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and line.startswith("#"):
            found |= slugs(line.lstrip("#"))
    return found


def public_name(dotted: str) -> bool:
    parts = dotted.split(".")
    for split in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        try:
            for attr in parts[split:]:
                obj = getattr(obj, attr)
        except AttributeError:
            return False
        return True
    return False


@functools.cache
def links() -> list[tuple[Path, str]]:
    found = []
    for page in PAGES:
        text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
        found += [(page, m.group(1)) for m in LINK.finditer(text)]
    return found


def broken_link(page: Path, target: str) -> str | None:
    if URL.match(target) or target.startswith("mailto:"):
        return None
    path, _, anchor = target.partition("#")
    file = (page.parent / path).resolve() if path else page
    if not file.is_relative_to(ROOT):
        return "leaves the repository"
    if not file.exists():
        return "no such file"
    if anchor.startswith("envfleet.") and file.parent.name == "reference":
        # mkdocstrings' anchor of a public name (mkdocs build --strict checks the page has it)
        return None if public_name(anchor) else f"no public name {anchor}"
    if anchor and file.suffix == ".md" and anchor not in anchors(file):
        return f"no heading #{anchor} in {file.relative_to(ROOT)}"
    return None


def named_files(text: Path) -> list[tuple[int, str]]:
    found = []
    for number, line in enumerate(text.read_text().splitlines(), start=1):
        line = URL.sub("", line)
        for pattern in (PATH, TOP_LEVEL):
            found += [(number, m.group(1)) for m in pattern.finditer(line)]
    return found


def missing(text: Path, name: str) -> bool:
    if name in EXTERNAL or name in TO_WRITE or PLACEHOLDER.search(name):
        return False
    return not exists(text, name)


def test_the_scan_sees_the_pages_and_their_names():
    assert len(links()) > 50
    names = {name for text in TEXTS for _, name in named_files(text)}
    assert {"README.md", "docs/architecture.md", "setup.py"} <= names


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_every_relative_link_resolves(page):
    bad = [(t, why) for p, t in links() if p == page and (why := broken_link(p, t))]
    assert bad == []


def test_every_named_file_exists():
    bad = [
        f"{text.relative_to(ROOT)}:{number}: {name}"
        for text in TEXTS
        for number, name in named_files(text)
        if missing(text, name)
    ]
    assert bad == []


def test_a_missing_file_and_a_missing_anchor_are_caught(tmp_path):
    """The checks can fail: a made-up file, a made-up heading."""
    assert broken_link(ROOT / "README.md", "docs/no-such-page.md") == "no such file"
    assert "no heading" in (broken_link(ROOT / "README.md", "docs/quickstart.md#no-such") or "")
    assert broken_link(ROOT / "README.md", "../outside.md") == "leaves the repository"
    assert broken_link(ROOT / "docs" / "index.md", "reference/envfleet.md#envfleet.make") is None
    assert broken_link(ROOT / "docs" / "index.md", "reference/envfleet.md#envfleet.nope")
    page = tmp_path / "page.md"
    page.write_text("See `src/envfleet/_native.py` and NO_SUCH_PAGE.md.\n")
    assert [name for _, name in named_files(page) if missing(page, name)] == [
        "src/envfleet/_native.py",
        "NO_SUCH_PAGE.md",
    ]


# -- The code names docs/architecture.md cites ---------------------------------------------------

ARCHITECTURE = ROOT / "docs" / "architecture.md"
# The architecture's pages: docs/architecture.md and its continuations under docs/architecture/.
ARCHITECTURE_PAGES = [ARCHITECTURE, *sorted((ROOT / "docs" / "architecture").glob("*.md"))]
PACKAGE = ROOT / "src" / "envfleet"
SPAN = re.compile(r"`([^`\n]+)`")
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
DOTTED = re.compile(r"^([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)(?:\(\))?$")
BARE = re.compile(r"^(_[a-z]\w*|[A-Z][a-z]\w*|[A-Z][A-Z0-9]*(?:_[A-Z0-9]+)*)(?:\(\))?$")
CODE_PATH = re.compile(r"^[\w.]+(?:/[\w.]+)*/?$")
# In a fence without a language (the step diagram): dotted names and paths in the text.
FENCE_NAME = re.compile(
    r"(?<![\w./])((?:[\w.]+/)+[\w.]*\w\.(?:py|c)|[\w.]+\.(?:py|c)"
    r"|[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)(?![\w/])"
)
# What the page cites that is not envfleet's: other projects' modules and names.
FOREIGN_ROOTS = {
    "gymnasium",
    "ray",
    "os",
    "copy",
    "functools",
    "bit_generator",  # numpy's
    "np",  # numpy, as imported
    "cpu",  # cgroup v2's cpu.max
}
FOREIGN_NAMES = {
    "AsyncVectorEnv",  # gymnasium's
    "SAME_STEP",  # gymnasium's AutoresetMode
    "ParallelEnv",  # PettingZoo's
    "EnvBase",  # TorchRL's
    "VecEnv",  # SB3's
    "SubprocVecEnv",  # SB3's
    "Multiprocessing",  # PufferLib's
    "RawArray",  # multiprocessing's
    "ThreadPoolExecutor",  # concurrent.futures'
    "NodeAffinitySchedulingStrategy",  # Ray's
    "KeyboardInterrupt",
    "None",  # Python's
    "FUTEX_WAKE",  # Linux's
    "FUTEX_WAKE_BITSET",  # Linux's
    "METH_FASTCALL",  # CPython's
    "_add_info",  # gymnasium's
    "_send",  # EnvPool's
    "_recv",  # EnvPool's
    "ALE/",  # gymnasium's namespace of Atari ids
}
# The page's example variables, and the class each one is.
VARIABLES = {"envs": "FleetVectorEnv", "err": "EnvCrashedError"}


class Definitions:
    """What src/envfleet defines, read with ``ast`` (and the C module's method table): each
    module's top-level names by stem, each class's members, every name defined anywhere."""

    def __init__(self) -> None:
        self.modules: dict[str, list[set[str]]] = {}
        self.classes: dict[str, list[tuple[set[str], list[str]]]] = {}
        self.names: set[str] = set()
        for path in sorted(PACKAGE.rglob("*.py")):
            tree = ast.parse(path.read_text())
            top = {name for node in tree.body for name in self._defined(node)}
            if path.name == "__init__.py":
                top |= {p.stem for p in path.parent.glob("*.py")} | {
                    p.name for p in path.parent.iterdir() if (p / "__init__.py").exists()
                }
            stem = path.parent.name if path.name == "__init__.py" else path.stem
            self.modules.setdefault(stem, []).append(top)
            self.names |= {stem} | top
            for node in ast.walk(tree):
                if isinstance(node, ast.ClassDef):
                    self._add_class(node)
                elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    self.names.add(node.name)
        for path in PACKAGE.rglob("*.c"):
            methods = set(re.findall(r'^\s*\{"(\w+)",', path.read_text(), re.M))
            self.modules.setdefault(path.stem, []).append(methods)
            self.names.add(path.stem)

    @staticmethod
    def _defined(node: ast.stmt) -> list[str]:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            return [node.name]
        if isinstance(node, ast.Assign):  # a = ..., a, b = ...
            targets = [
                e for t in node.targets for e in (t.elts if isinstance(t, ast.Tuple) else [t])
            ]
            return [t.id for t in targets if isinstance(t, ast.Name)]
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            return [node.target.id]
        return []

    def _add_class(self, node: ast.ClassDef) -> None:
        body = {name for stmt in node.body for name in self._defined(stmt)}
        members = set(body)
        for inner in ast.walk(node):  # self.x = ... in its methods
            targets = (
                inner.targets
                if isinstance(inner, ast.Assign)
                else [inner.target]
                if isinstance(inner, (ast.AnnAssign, ast.AugAssign))
                else []
            )
            members |= {
                t.attr
                for t in targets
                if isinstance(t, ast.Attribute)
                and isinstance(t.value, ast.Name)
                and t.value.id == "self"
            }
        bases = [ast.unparse(b).rpartition(".")[2] for b in node.bases]
        self.classes.setdefault(node.name, []).append((members, bases))
        self.names |= {node.name} | body

    def has_member(self, cls: str, attr: str, seen: frozenset[str] = frozenset()) -> bool:
        """A class of that name has ``attr``, itself or through a base defined here."""
        return any(
            attr in members
            or any(self.has_member(b, attr, seen | {cls}) for b in bases if b not in seen)
            for members, bases in self.classes.get(cls, [])
        )

    def resolves(self, dotted: str) -> bool:
        root, *parts = dotted.split(".")
        if root == "envfleet":
            return public_name(dotted)
        if root in FOREIGN_ROOTS:
            return True
        if root in VARIABLES:
            return self.has_member(VARIABLES[root], parts[0])
        owner = root
        if root.lstrip("_")[0].islower():  # module.name (_speedups.x too), else Class.attr
            owner, *parts = parts
            if not any(owner in top for top in self.modules.get(root, [])):
                return False
        for attr in parts:  # Class.attr, and an attribute's attribute where it is a class
            if not self.has_member(owner, attr):
                return False
            owner = attr
        return True


@functools.cache
def definitions() -> Definitions:
    return Definitions()


def code_path_exists(name: str) -> bool:
    """From the root (tests/, benchmarks/...), from src/envfleet, or as the tail of a path under
    src/envfleet (``processes/worker.py``, ``inprocess.py``)."""
    if (ROOT / name).exists() or (PACKAGE / name).exists():
        return True
    tail = "/" + name.rstrip("/")
    return any(str(p).endswith(tail) for p in PACKAGE.rglob("*"))


def code_names(page: Path) -> list[tuple[int, str]]:
    """The code names ``page`` cites, each with its line (see
    :func:`test_every_code_name_of_the_architecture_page_exists` for the rule)."""
    text = page.read_text()
    found: list[tuple[int, str]] = []
    prose = text
    for fence in FENCE.finditer(text):
        prose = prose.replace(fence.group(0), "\n" * fence.group(0).count("\n"))
        if fence.group(1) == "":
            first = text.count("\n", 0, fence.start(2)) + 1
            for number, line in enumerate(fence.group(2).splitlines(), start=first):
                found += [(number, m.group(1)) for m in FENCE_NAME.finditer(line)]
    for number, line in enumerate(prose.splitlines(), start=1):
        found += [(number, span) for span in SPAN.findall(line)]
    return found


def unresolved(page: Path) -> list[str]:
    made_here = {
        node.name
        for fence in FENCE.finditer(page.read_text())
        if fence.group(1) == "python"
        for node in ast.walk(ast.parse(fence.group(2)))
        if isinstance(node, (ast.FunctionDef, ast.ClassDef))
    }
    index = definitions()
    label = page.relative_to(ROOT) if page.is_relative_to(ROOT) else page.name
    bad = []
    for number, name in code_names(page):
        if name in FOREIGN_NAMES or name in made_here:
            continue
        if "/" in name or name.endswith((".py", ".c")):
            ok = (
                not CODE_PATH.match(name) or name.startswith("/") or code_path_exists(name)
            )  # a glob (bench/_*) or an absolute path (/proc/PID/fd) is not a file of ours
        elif m := DOTTED.match(name):
            ok = index.resolves(m.group(1))
        elif m := BARE.match(name):
            ok = m.group(1) in index.names or (
                m.group(1).startswith("ENVFLEET_")
                and any(f'"{m.group(1)}"' in p.read_text() for p in PACKAGE.rglob("*.py"))
            )
        else:
            continue  # prose in backticks: a call with arguments, a value, a command line
        if not ok:
            bad.append(f"{label}:{number}: {name}")
    return bad


def test_every_code_name_of_the_architecture_page_exists():
    """Every code name docs/architecture.md (and each page under docs/architecture/) cites names
    something in the code.

    A code name is a backticked span of the page's prose, or a name in its diagram (a fence
    without a language), of one of these forms:

    - a path: it has a ``/`` or ends in ``.py`` or ``.c`` (``_core/stepping.py``, ``ray/``,
      ``_speedups.c``): it exists from the repository's root, from src/envfleet, or as the
      tail of a path under src/envfleet (``processes/worker.py``). Globs (``bench/_*``) and
      absolute paths (``/proc/PID/fd``) are not checked;
    - a dotted name, ``a.b`` or ``a.b.c``, a trailing ``()`` allowed:
      - ``envfleet.x``: a public name, imported;
      - ``module.name`` (``a`` lowercase): ``a`` is the stem of a module under src/envfleet
        (a file, or a package's folder; ``_speedups`` for the C module) that defines ``name``
        at top level (a def, a class, an assignment; a package: also a submodule; the C module:
        a method of its table); any further part is a member of the class so named;
      - ``Class.attr`` (``a`` capitalised): a class of that name defines ``attr`` (a def or
        assignment in its body, ``self.attr = ...`` in a method, an enum member), itself or
        through a base class defined in the package;
      - ``envs.x``, ``err.x``: the page's example variables, a member of the class they are;
    - a bare name that is private (``_group_observations``), a class (``RoundDriver``) or a
      constant (``TIGHT_SPIN_S``): something of that name is defined in src/envfleet (a module
      stem, a def or class at any depth, a top-level or class-level assignment), or in one of
      the page's Python examples; an ``ENVFLEET_*`` constant is an environment variable the
      package reads.

    Other projects' names (``FOREIGN_ROOTS``, ``FOREIGN_NAMES``) are not envfleet's and pass;
    anything else in backticks (lowercase bare words, calls with arguments, values, command
    lines) is prose, not checked.
    """
    assert len(ARCHITECTURE_PAGES) > 1  # the page and its continuations
    assert sum(len(code_names(page)) for page in ARCHITECTURE_PAGES) > 300  # the scan sees them
    assert [name for page in ARCHITECTURE_PAGES for name in unresolved(page)] == []


def test_a_stale_code_name_is_caught(tmp_path):
    """The check can fail: a module that moved, a name that went, a file that is not there."""
    page = tmp_path / "page.md"
    page.write_text(
        "The block (`_buffers.Block`, `buffers.Block`, `rounds.RoundDriver.stacks`), "
        "`_workers.watch`, `workers.nope`, `RoundDriver.nope`, `Command.TASK`, `_cores`, "
        "`_core/nope.py`, `_core/stepping.py`, `processes/worker.py`, `Nope`, `SpinBudget`, "
        "`envs.snapshot()`, `envs.nope`, `envfleet.make`, `make(env, 8)`, `_Worker.serve`, "
        "`_Worker.nope`.\n"
        "```\n diagram (_protocol.Status), (_core/infos.py), EnvGroup.step\n```\n"
    )
    assert unresolved(page) == [
        f"page.md:{n}: {name}"
        for n, name in [
            (3, "_protocol.Status"),
            (1, "_buffers.Block"),
            (1, "_workers.watch"),
            (1, "workers.nope"),
            (1, "RoundDriver.nope"),
            (1, "_cores"),
            (1, "_core/nope.py"),
            (1, "Nope"),
            (1, "envs.nope"),
            (1, "_Worker.nope"),
        ]
    ]
