"""The backend contract: every test in tests/contract/ that takes a ``backend`` argument runs
once per entry of :data:`BACKENDS`, the one list of ways to run envs. A new backend passes the
contract by adding one :class:`Backend` there.

A test narrows the list with ``@pytest.mark.backends(...)``: names of entries, and/or
capabilities (``workers=True``: envs run apart from the caller, in threads, processes or
actors; ``isolated=True``: in other processes, so that a worker can die alone;
``processes=True``: in worker processes this process starts; ``pool=True``: the first-ready
pool; ``cheap=True``: workers start fast). A test whose other parameters depend on the backend
(cheaper cases on a backend whose workers are slow to start) gives them with
``@pytest.mark.per_backend("argnames", rows)``, ``rows(backend)`` returning their values.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

import envfleet
from tests.contract import toy_transport  # noqa: F401  (registers backend="toy")


@dataclass(frozen=True)
class Backend:
    """One way to run envs, as the contract tests see it.

    ``options`` are the keyword arguments of ``envfleet.make`` that select it
    (``make_env(env, n, **backend.options, num_workers=2)``). ``workers``: where the envs run
    apart from the caller (``"threads"``, ``"processes"``, ``"actors"``), ``None`` when they
    run in the calling thread. ``cheap``: a worker starts in well under a second, so the
    tests may run their whole matrix on it (a spawned interpreter or a Ray actor does not).
    """

    id: str
    options: dict[str, Any]
    workers: str | None
    pool: bool = True
    cheap: bool = True
    marks: tuple[Any, ...] = field(default=())

    @property
    def name(self) -> str:
        """The backend's name (``options["backend"]`` or its options object's)."""
        backend = self.options["backend"]
        return backend if isinstance(backend, str) else backend.name

    def with_layout(self, layout: dict[str, Any]) -> dict[str, Any]:
        """``options`` and ``layout`` (``num_workers``, ``batch_size``... and the processes
        backend's ``driver_envs``, folded into its :class:`envfleet.Processes`)."""
        layout = dict(layout)
        out = dict(self.options)
        driver_envs = layout.pop("driver_envs", None)
        if driver_envs is not None:
            backend = out["backend"]
            base = backend if isinstance(backend, envfleet.Processes) else envfleet.Processes()
            out["backend"] = dataclasses.replace(base, driver_envs=driver_envs)
        return {**out, **layout}

    @property
    def owns_processes(self) -> bool:
        """Every process it starts is this process's child, and gone after close: the leak
        checks (``snapshot.assert_nothing_left()``) apply (Ray's processes belong to Ray)."""
        return self.name != "ray"

    def __str__(self) -> str:
        return self.id


BACKENDS = [
    Backend("serial", {"backend": "serial"}, workers=None),
    # The round driver over a transport of primitives only (tests/contract/toy_transport.py).
    Backend("toy", {"backend": "toy"}, workers=None),
    Backend("threads", {"backend": "threads"}, workers="threads"),
    Backend("processes", {"backend": "processes"}, workers="processes"),
    Backend(
        "processes-spawn",
        {"backend": envfleet.Processes(context="spawn")},
        workers="processes",
        cheap=False,
        marks=(pytest.mark.slow,),  # each worker a fresh interpreter
    ),
    Backend("ray", {"backend": "ray"}, workers="actors", cheap=False, marks=(pytest.mark.ray,)),
]


def backends(*ids: str, **needs: bool) -> list[Backend]:
    """The entries of :data:`BACKENDS` named ``ids`` (all when none) that have ``needs``."""
    unknown = set(ids) - {b.id for b in BACKENDS}
    if unknown:
        raise ValueError(f"unknown backends {sorted(unknown)}")
    chosen = [b for b in BACKENDS if not ids or b.id in ids]
    for need, wanted in needs.items():
        if need == "workers":
            chosen = [b for b in chosen if (b.workers is not None) is wanted]
        elif need == "isolated":
            chosen = [b for b in chosen if (b.workers in ("processes", "actors")) is wanted]
        elif need == "processes":
            chosen = [b for b in chosen if (b.workers == "processes") is wanted]
        elif need in ("pool", "cheap"):
            chosen = [b for b in chosen if getattr(b, need) is wanted]
        else:
            raise ValueError(f"unknown backend capability {need!r}")
    return chosen


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "backends(*ids, **needs): run a contract test on these backends only"
    )
    config.addinivalue_line(
        "markers",
        "per_backend(argnames, rows): parameters of a contract test that depend on the backend",
    )


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "backend" not in metafunc.fixturenames:
        return
    marker = metafunc.definition.get_closest_marker("backends")
    chosen = backends(*marker.args, **marker.kwargs) if marker else list(BACKENDS)
    per_backend = metafunc.definition.get_closest_marker("per_backend")
    if per_backend is None:
        metafunc.parametrize(
            "backend", [pytest.param(b, id=b.id, marks=b.marks) for b in chosen], scope="function"
        )
        return
    argnames, rows = per_backend.args
    names = [n.strip() for n in argnames.split(",")]
    params = []
    for b in chosen:
        for row in _rows(rows, b):
            values = row if len(names) > 1 else (row,)
            ident = "-".join([b.id, *(_ident(v) for v in values)])
            params.append(pytest.param(b, *values, id=ident, marks=b.marks))
    metafunc.parametrize(["backend", *names], params, scope="function")


def _rows(rows: Callable[[Backend], list[Any]] | list[Any], backend: Backend) -> list[Any]:
    return rows(backend) if callable(rows) else rows


def _ident(value: Any) -> str:
    if isinstance(value, dict):
        return str(sorted(value.items()))
    return str(getattr(value, "value", value))
