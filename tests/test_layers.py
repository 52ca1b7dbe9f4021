"""Layering of envfleet's modules, read from the sources with ``ast``: every module
imports, no module imports another (directly or through others) that imports it back, and no
module uses another module's underscore names."""

from __future__ import annotations

import ast
import importlib
import pkgutil
from pathlib import Path

import pytest

import envfleet

ROOT = Path(envfleet.__file__).parent

# Third-party packages whose absence leaves a module of an optional extra unimportable.
OPTIONAL = {"ray", "torch", "tensordict", "torchrl", "stable_baselines3", "envpool", "ale_py"}


def _modules() -> dict[str, Path]:
    """Every module of envfleet: dotted name -> source file (C extensions left out)."""
    out = {"envfleet": ROOT / "__init__.py"}
    for info in pkgutil.walk_packages([str(ROOT)], prefix="envfleet."):
        spec = info.module_finder.find_spec(info.name, None)  # type: ignore[call-arg]
        origin = getattr(spec, "origin", None) if spec is not None else None
        if origin is not None and origin.endswith(".py"):
            out[info.name] = Path(origin)
    return out


MODULES = _modules()


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _runtime_nodes(tree: ast.AST) -> list[ast.AST]:
    """Every node of ``tree`` outside ``if TYPE_CHECKING:`` blocks (imports there never run)."""
    nodes: list[ast.AST] = []
    stack = [tree]
    while stack:
        node = stack.pop()
        nodes.append(node)
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                stack.extend(child.orelse)
                continue
            stack.append(child)
    return nodes


def _package(name: str) -> str:
    return name if MODULES[name].name == "__init__.py" else name.rpartition(".")[0]


class _Imports:
    """What one module imports from envfleet: edges to modules, names taken from modules, and
    the local names bound to modules (for attribute uses)."""

    def __init__(self, name: str):
        self.name = name
        self.edges: set[str] = set()
        self.names: list[tuple[str, str, int]] = []  # (module, name, line)
        self.aliases: dict[str, str] = {}  # local name -> module
        tree = ast.parse(MODULES[name].read_text(), str(MODULES[name]))
        self.nodes = _runtime_nodes(tree)
        for node in self.nodes:
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] == "envfleet":
                        self.edges.add(self._module(alias.name))
                        if alias.asname is not None:
                            self.aliases[alias.asname] = alias.name
            elif isinstance(node, ast.ImportFrom):
                self._import_from(node)

    def _module(self, dotted: str) -> str:
        while dotted not in MODULES:
            dotted = dotted.rpartition(".")[0]
        return dotted

    def _import_from(self, node: ast.ImportFrom) -> None:
        base = node.module or ""
        if node.level:
            parts = _package(self.name).split(".")
            parts = parts[: len(parts) - node.level + 1]
            base = ".".join(parts + ([base] if base else []))
        if base.split(".")[0] != "envfleet":
            return
        for alias in node.names:
            full = f"{base}.{alias.name}"
            if full in MODULES:  # a submodule
                self.edges.add(full)
                self.aliases[alias.asname or alias.name] = full
            else:
                self.edges.add(self._module(base))
                self.names.append((self._module(base), alias.name, node.lineno))

    def underscore_uses(self) -> set[tuple[str, str, str, int]]:
        """``(importer, module, name, line)`` for each underscore name of another module."""
        uses = {
            (self.name, module, name, line)
            for module, name, line in self.names
            if module != self.name and _private(name)
        }
        for node in self.nodes:
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in self.aliases
                and _private(node.attr)
            ):
                module = self.aliases[node.value.id]
                if f"{module}.{node.attr}" not in MODULES and module != self.name:
                    uses.add((self.name, module, node.attr, node.lineno))
        return uses


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


IMPORTS = {name: _Imports(name) for name in MODULES}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), or of one module
    importing itself."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in graph.get(v, ()):
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


@pytest.mark.parametrize("name", sorted(set(MODULES) - {"envfleet.__main__"}))  # runs the CLI
def test_every_module_imports(name):
    try:
        importlib.import_module(name)
    except ImportError as exc:
        if exc.name is not None and exc.name.split(".")[0] in OPTIONAL:
            pytest.skip(f"{name} needs {exc.name}")
        raise


def test_no_import_cycles():
    graph = {name: imports.edges - {name} for name, imports in IMPORTS.items()}
    assert _cycles(graph) == []


def test_no_module_uses_another_modules_underscore_names():
    uses = {use for imports in IMPORTS.values() for use in imports.underscore_uses()}
    assert sorted(uses) == [], "\n".join(
        f"{importer} line {line}: {module}.{name}" for importer, module, name, line in sorted(uses)
    )


def test_the_checks_see_a_cycle_and_an_underscore_use():
    """The checks above can fail: a cycle of three modules is found, one without is not."""
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []
    assert _private("_remote_error") and not _private("__version__")


def _private_module(name: str) -> bool:
    """``envfleet._*``: a private module of the library (``envfleet.bench._core`` is one of
    the bench package's own)."""
    parts = name.split(".")
    return len(parts) > 1 and parts[1].startswith("_")


def test_bench_uses_only_public_names():
    """``envfleet.bench`` measures envfleet as a user runs it: its modules import ``envfleet``
    and each other, never a private module of the library (``envfleet._*``)."""
    bench = [
        name for name in IMPORTS if name == "envfleet.bench" or name.startswith("envfleet.bench.")
    ]
    assert len(bench) > 1
    private = {
        (name, edge) for name in bench for edge in IMPORTS[name].edges if _private_module(edge)
    }
    assert sorted(private) == []
    assert _private_module("envfleet._front.make") and not _private_module("envfleet.bench._core")


ARCHITECTURE = ROOT.parents[1] / "docs" / "architecture.md"


def _layer_table() -> list[tuple[str, list[str]]]:
    """docs/architecture.md's layer table, top to bottom: (layer, the paths it names)."""
    text = ARCHITECTURE.read_text()
    table = text[text.index("<!-- layers -->") : text.index("<!-- /layers -->")]
    layers = []
    for line in table.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0][:1].isdigit():
            layers.append((cells[0], [p.strip("` ") for p in cells[1].split(",")]))
    return layers


def _path_of(name: str) -> str:
    """A module's path inside the package, ``_front/make.py`` or ``bench/`` style."""
    return MODULES[name].relative_to(ROOT).as_posix()


def _layer_of(name: str, layers: list[tuple[str, list[str]]]) -> int | None:
    path = _path_of(name)
    for k, (_, places) in enumerate(layers):
        if any(path == p or (p.endswith("/") and path.startswith(p)) for p in places):
            return k
    return None


def test_the_folders_are_the_layers_and_imports_go_down():
    """Every module sits in one layer of the table, every place the table names exists, and
    each import goes to the importer's own layer or one below it."""
    layers = _layer_table()
    assert len(layers) >= 5
    for _, places in layers:
        for place in places:
            assert (ROOT / place).exists(), f"the layer table names {place}, which is not there"
    unplaced = sorted(name for name in MODULES if _layer_of(name, layers) is None)
    assert unplaced == [], f"modules in no layer of docs/architecture.md: {unplaced}"
    upward = sorted(
        f"{name} ({layers[a][0]}) imports {edge} ({layers[b][0]})"
        for name, imports in IMPORTS.items()
        for edge in imports.edges
        if (a := _layer_of(name, layers)) is not None
        and (b := _layer_of(edge, layers)) is not None
        and b < a
    )
    assert upward == [], "imports that run up the layers:\n" + "\n".join(upward)


def test_the_layer_check_sees_an_import_that_runs_up():
    layers = [("1. top", ["cli.py"]), ("2. front", ["_front/"]), ("3. core", ["_core/"])]
    assert _layer_of("envfleet._front.make", layers) == 1
    assert _layer_of("envfleet._core.errors", layers) == 2
    assert _layer_of("envfleet._sampler.sampler", layers) is None
    real = _layer_table()  # an import from the core up to the front would be flagged
    core, front = _layer_of("envfleet._core.errors", real), _layer_of("envfleet._front.make", real)
    assert core is not None and front is not None and core > front
