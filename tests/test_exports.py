"""The public surface: ``envfleet.__all__`` pinned, every public name documented, ``py.typed``
shipped, the public modules importable and every other module underscore-private.

A change here is a change of the public API: additions only (issue 18), and on purpose.
"""

from __future__ import annotations

import ast
import importlib
import importlib.resources
import inspect
import pkgutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import envfleet

ALL = [
    "AgentError",
    "AlreadyPendingCallError",
    "BACKENDS",
    "ClosedEnvironmentError",
    "ConfigError",
    "EnvCrashedError",
    "EnvError",
    "EnvRestartedWarning",
    "EnvfleetError",
    "EpisodeBatch",
    "FleetStats",
    "FleetVectorEnv",
    "HangWarning",
    "InvalidActionError",
    "InvalidArgumentError",
    "MultiAgentVectorEnv",
    "NoAsyncCallError",
    "PoolStateError",
    "ProcessEnv",
    "Processes",
    "Ray",
    "Recycle",
    "RemoteTraceback",
    "Replay",
    "ReplayFileError",
    "ResetNeededError",
    "RestartPolicy",
    "Sampler",
    "SamplerReport",
    "SamplerSnapshot",
    "SamplerStats",
    "SamplerTimers",
    "Snapshot",
    "SpaceMismatchError",
    "StartTimeoutError",
    "StepTimeStats",
    "StepTimeoutError",
    "Supervision",
    "TimerStat",
    "TorchOutput",
    "UnsupportedError",
    "WorkerMemory",
    "WrongProcessError",
    "__version__",
    "check_gymnasium_id",
    "make",
    "replay",
    "usable_cores",
]

# Public modules besides envfleet itself, and the libraries each needs (extras).
PUBLIC_MODULES = {
    "envfleet.adapters": [],
    "envfleet.adapters.infos": [],
    "envfleet.adapters.sb3": ["stable_baselines3", "torch"],
    "envfleet.adapters.torchrl": ["torchrl", "tensordict", "torch"],
    "envfleet.bench": [],
    "envfleet.bounds": [],
    "envfleet.cli": [],
    "envfleet.torch": ["torch", "tensordict"],
}


def test_all_is_pinned() -> None:
    assert sorted(envfleet.__all__) == ALL
    assert len(set(envfleet.__all__)) == len(envfleet.__all__)


@pytest.mark.parametrize("name", ALL)
def test_each_public_name_is_importable_and_documented(name: str) -> None:
    namespace: dict[str, object] = {}
    exec(f"from envfleet import {name}", namespace)
    obj = namespace[name]
    assert obj is getattr(envfleet, name)
    if name == "__version__":
        assert isinstance(obj, str) and obj
    elif name == "BACKENDS":
        assert isinstance(obj, tuple) and all(isinstance(b, str) for b in obj)
    else:
        assert inspect.isclass(obj) or inspect.isfunction(obj), name
        assert inspect.getdoc(obj), f"envfleet.{name} has no docstring"


def test_py_typed_ships() -> None:
    """PEP 561: the marker sits in the package (and pyproject's package-data ships it)."""
    assert importlib.resources.files("envfleet").joinpath("py.typed").is_file()


def test_py_typed_is_package_data() -> None:
    tomllib = pytest.importorskip("tomllib")
    root = importlib.resources.files("envfleet")
    pyproject = root.joinpath("..", "..", "pyproject.toml")
    if not pyproject.is_file():
        pytest.skip("envfleet is installed, not run from its source tree")
    config = tomllib.loads(pyproject.read_text())
    assert "py.typed" in config["tool"]["setuptools"]["package-data"]["envfleet"]


@pytest.mark.parametrize("module", sorted(PUBLIC_MODULES))
def test_public_module_imports(module: str) -> None:
    for requirement in PUBLIC_MODULES[module]:
        pytest.importorskip(requirement)
    imported = importlib.import_module(module)
    assert inspect.getdoc(imported), f"{module} has no docstring"


def _all_modules() -> list[str]:
    names = ["envfleet"]
    for info in pkgutil.walk_packages(envfleet.__path__, "envfleet."):
        names.append(info.name)
    return names


def test_every_other_module_is_private() -> None:
    """A module that is neither public nor underscore-private (at some level of its dotted
    name) would be public by accident."""
    accidental = [
        name
        for name in _all_modules()
        if name != "envfleet"
        and name not in PUBLIC_MODULES
        and not any(part.startswith("_") for part in name.split(".")[1:])
    ]
    assert accidental == []


def test_public_modules_exist() -> None:
    assert set(PUBLIC_MODULES) <= set(_all_modules())


def test_importing_envfleet_imports_no_extra() -> None:
    """``import envfleet`` pulls in none of the optional libraries (they are extras)."""
    code = (
        "import sys, envfleet; "
        "print(sorted(m for m in ('torch', 'ray', 'stable_baselines3', 'torchrl', 'envpool') "
        "if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.strip() == "[]"


def _private_uses(source: str) -> list[str]:
    """Every ``envfleet`` name that ``source`` reaches with an underscore part: imported
    modules (``import envfleet._x``, ``from envfleet._x import y``), imported names
    (``from envfleet import _y``) and attributes (``envfleet._z``, ``envfleet.torch._w``)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names if alias.name.startswith("envfleet")]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("envfleet"):
            names = [f"{node.module}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Attribute):
            parts = []
            inner: ast.expr = node
            while isinstance(inner, ast.Attribute):
                parts.append(inner.attr)
                inner = inner.value
            if not (isinstance(inner, ast.Name) and inner.id == "envfleet"):
                continue
            names = [".".join(["envfleet", *reversed(parts)])]
        else:
            continue
        found += [n for n in names if any(p.startswith("_") for p in n.split("."))]
    return found


def test_examples_use_only_public_names():
    """A user copies from examples/: they import and reach only envfleet's public names."""
    examples = sorted((Path(__file__).resolve().parents[1] / "examples").glob("*.py"))
    assert examples
    for path in examples:
        assert _private_uses(path.read_text()) == [], path.name
    # The check itself sees each way in.
    for line in (
        "import envfleet._sampler.rollout",
        "from envfleet._sampler.rollout import EpisodeBatch",
        "from envfleet import _native",
        "import envfleet\nenvfleet._native.speedups",
    ):
        assert _private_uses(line), line


def test_the_all_extra_is_every_extra() -> None:
    """``pip install 'envfleet[all]'`` installs what every user-facing extra does (the docs'
    snippets need no more); ``test``, ``dev`` and ``docs`` are the project's own."""
    import re

    import tomllib

    root = Path(__file__).resolve().parents[1]
    extras = tomllib.loads((root / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    (spec,) = extras["all"]
    match = re.fullmatch(r"envfleet\[(.*)\]", spec)
    assert match is not None, spec
    named = set(match.group(1).split(","))
    assert named == set(extras) - {"all", "test", "dev", "docs"}


@pytest.mark.parametrize("call", [envfleet.make, envfleet.Sampler], ids=["make", "Sampler"])
def test_the_signature_holds_at_most_twelve_parameters(call: Any) -> None:
    """make() and the Sampler stay small: options that go together are one object each
    (``Supervision``, ``Processes``, ``Ray``, ``TorchOutput``), not more keywords."""
    parameters = inspect.signature(call).parameters
    assert len(parameters) <= 12, list(parameters)
