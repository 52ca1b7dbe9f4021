"""The backend registry: each backend module registers its name, its plan and its constructor;
:func:`envfleet.make` looks a backend up here.

A backend module ends with one :func:`register` call. The registry imports a backend's module
the first time that backend is asked for (:func:`lookup`), so ``import envfleet`` imports
neither ray nor envpool. Which of make()'s options a backend takes is decided in one table,
:data:`envfleet._front.options.RULES`, before the backend is asked anything; a backend with
options of its own has an options object there (:class:`envfleet.Processes`,
:class:`envfleet.Ray`) whose fields reach its plan as ``request.options``.

Adding a backend is one new module, ``envfleet/_backends/inline.py``, plus its line in
:data:`BUILTIN`: a transport (the primitives of :class:`envfleet._backends.transport.Transport`)
under the one round driver::

    from envfleet._backends.inprocess import InProcessTransport
    from envfleet._backends.registry import BackendSpec, BuildRequest, register
    from envfleet._backends.rounds import RoundDriver


    class InlineTransport(InProcessTransport):
        ...  # send / wait / read (see envfleet._backends.transport.Transport)


    def _build(request: BuildRequest) -> RoundDriver:
        return RoundDriver(
            InlineTransport(
                request.layout, request.block(shared=False), first_env=request.first_env,
                ledger=request.ledger, pool=request.pool,
            )
        )


    register(BackendSpec("inline", build=_build))

``make(env, 8, backend="inline")`` then plans its workers with the default plan (one worker
unless ``num_workers`` says otherwise), builds env 0 to learn the spaces, and calls ``_build``.
A backend's plan raises :class:`~envfleet.ConfigError` for values it cannot lay out.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import gymnasium

from envfleet._backends.base import Backend, EnvProbe, WorkerLayout, worker_ranges
from envfleet._backends.supervisor import Ledger, RestartPolicy
from envfleet._core.buffers import Block
from envfleet._core.errors import ConfigError

__all__ = [
    "BACKENDS",
    "BUILTIN",
    "BackendSpec",
    "BuildRequest",
    "NativeRequest",
    "Plan",
    "PlanRequest",
    "Sizing",
    "lookup",
    "register",
]

# Built-in backends, in the order envfleet.BACKENDS lists them: name -> (module, what installs
# its missing packages).
BUILTIN: dict[str, tuple[str, str]] = {
    "serial": ("envfleet._backends.serial", ""),
    "threads": ("envfleet._backends.threads", ""),
    "processes": ("envfleet._backends.processes.backend", ""),
    "ray": ("envfleet._backends.ray.backend", "pip install 'envfleet[ray]'"),
    "envpool": ("envfleet._backends.envpool", "pip install 'envfleet[envpool]'"),
}
BACKENDS = tuple(BUILTIN)

_REGISTRY: dict[str, BackendSpec] = {}


@dataclass(frozen=True)
class PlanRequest:
    """What a backend's plan gets from :func:`envfleet.make`, checked there.

    Attributes:
        num_envs: sub-environments (>= 1).
        num_workers: ``None`` (the backend's default) or ``1 <= num_workers <= num_envs``.
        pool: a first-ready pool (``batch_size < num_envs``).
        step_timeout: seconds (> 0) or ``None``.
        restart_policy: ``None`` or an :class:`envfleet.RestartPolicy`.
        options: the backend's own options (:attr:`BackendSpec.options`) as given, ``None``
            where not given.
    """

    num_envs: int
    num_workers: int | None
    pool: bool
    step_timeout: float | None
    restart_policy: RestartPolicy | None
    options: Mapping[str, Any]


@dataclass(frozen=True)
class Plan:
    """How a backend lays out its envs: ``ranges``, per group of envs (a worker), the
    ``[start, stop)`` env indices it holds, contiguous and in order; ``details``: whatever
    else the backend's constructor needs (e.g. the processes backend's driver share).

    ``driver_free``: every env lives in a worker process (or actor), none in the driver's.
    :func:`envfleet.make` then builds no env in the driver: the backend's constructor starts
    its workers, takes env 0's :class:`~envfleet._backends.base.EnvProbe` from the worker that
    holds env 0 and hands it to :meth:`BuildRequest.learn` before it lays out its buffers.
    A backend whose plan says so must do exactly that.
    """

    ranges: list[tuple[int, int]]
    details: Any = None
    driver_free: bool = False

    @property
    def num_workers(self) -> int:
        return len(self.ranges)


@dataclass(frozen=True)
class Sizing:
    """What env 0's spaces fix (:meth:`BuildRequest.learn`): the layout with the spaces
    make() settled on, the bytes of the batch's block
    (:func:`envfleet._core.buffers.batch_nbytes`) and its spare observation slabs."""

    layout: WorkerLayout
    nbytes: int
    spare_slabs: int


@dataclass
class BuildRequest:
    """What a backend's constructor gets from :func:`envfleet.make`.

    Attributes:
        plan: the backend's own :class:`Plan`.
        accepts_index: per env, whether its factory takes ``env_index``.
        first_env: env 0, built by make() to learn the spaces; the backend keeps it or closes
            it once its workers are up. ``None`` when ``plan.driver_free``: no env is built in
            the driver, and the backend calls :meth:`learn` with env 0's probe from its worker.
        ledger: the supervisor's ledger for this vector env.
        blobs: the factories cloudpickled, one per env (:attr:`BackendSpec.pickles_factories`),
            else empty.
        pool: a first-ready pool.
        context: a ``multiprocessing`` start method or ``None``.
        step_timeout, start_timeout: seconds or ``None``.
        size: make()'s checks and sizes for env 0's probe (see :meth:`learn`).
        probe: env 0's probe, once learned.

    ``layout`` (the factories, spaces, autoreset mode and ``plan.ranges``), ``nbytes`` and
    ``spare_slabs`` (see :class:`Sizing`) are known once env 0's probe is: at once when
    ``first_env`` is given, after :meth:`learn` otherwise.
    """

    plan: Plan
    accepts_index: list[bool]
    first_env: gymnasium.Env[Any, Any] | None
    ledger: Ledger
    blobs: list[bytes]
    pool: bool
    context: str | None
    step_timeout: float | None
    start_timeout: float | None
    size: Callable[[EnvProbe], Sizing]
    probe: EnvProbe | None = None
    sizing: Sizing | None = None

    def learn(self, probe: EnvProbe) -> Sizing:
        """Take env 0's spaces, metadata and render mode from ``probe``; returns the sizes
        they fix (also :attr:`layout`, :attr:`nbytes`, :attr:`spare_slabs` from now on)."""
        self.sizing = self.size(probe)
        self.probe = probe
        return self.sizing

    def _sized(self) -> Sizing:
        if self.sizing is None:
            raise RuntimeError("env 0's spaces are not known yet: call BuildRequest.learn first")
        return self.sizing

    @property
    def layout(self) -> WorkerLayout:
        return self._sized().layout

    @property
    def nbytes(self) -> int:
        return self._sized().nbytes

    @property
    def spare_slabs(self) -> int:
        return self._sized().spare_slabs

    def block(self, shared: bool) -> Block:
        """The batch's memory: shared between processes or not, with the spare slabs."""
        return Block(self.nbytes, shared=shared, spare_slabs=self.spare_slabs)


@dataclass(frozen=True)
class NativeRequest:
    """What a backend that builds its own envs (:attr:`BackendSpec.native`) gets: make()'s
    ``env``, ``num_envs``, ``batch_size``, ``autoreset_mode`` and ``env_kwargs`` as given."""

    env: Any
    num_envs: Any
    batch_size: Any
    autoreset_mode: Any
    env_kwargs: dict[str, Any] | None


def default_plan(request: PlanRequest) -> Plan:
    """``num_workers`` (default 1) workers over contiguous blocks of envs."""
    return Plan(worker_ranges(request.num_envs, request.num_workers or 1))


@dataclass(frozen=True)
class BackendSpec:
    """A backend as :func:`envfleet.make` sees it.

    Attributes:
        name: the ``backend=`` name.
        build: the constructor: a :class:`BuildRequest` to a started
            :class:`~envfleet._backends.base.Backend`.
        plan: make()'s checked arguments (:class:`PlanRequest`) to a :class:`Plan`; raises
            :class:`~envfleet.ConfigError` for bad options. Default :func:`default_plan`.
        pickles_factories: the envs are built in other processes from cloudpickled factories.
        recycles_by_default: ``Supervision(recycle="auto")``, the default, recycles its
            workers (a synchronous vector env with the replay record and every env in a
            worker): :func:`envfleet._backends.recycle.default_recycle`.
        spare_slabs: the envs write into the block the front reads, so ``copy=True`` results
            can be handed out without a copy (:class:`envfleet._core.buffers.ObservationSlabs`).
        native: for a backend that builds its own envs from ``env`` (EnvPool's task ids): a
            :class:`NativeRequest` to a started backend that also has ``batch_size``,
            ``autoreset_mode``, ``single_observation_space``, ``single_action_space``,
            ``metadata`` and ``render_mode``; ``build`` and ``plan`` are then unused.
    """

    name: str
    build: Callable[[BuildRequest], Backend] | None = None
    plan: Callable[[PlanRequest], Plan] = default_plan
    pickles_factories: bool = False
    recycles_by_default: bool = False
    spare_slabs: bool = True
    native: Callable[[NativeRequest], Any] | None = field(default=None)


def register(spec: BackendSpec) -> BackendSpec:
    """Make ``spec`` available to ``make(backend=spec.name)`` (a backend module's last line)."""
    _REGISTRY[spec.name] = spec
    return spec


def _load(name: str) -> BackendSpec | None:
    """Import a built-in backend's module (it registers itself); ``None`` if it cannot be."""
    try:
        return lookup(name)
    except ConfigError:
        return None


def lookup(name: str) -> BackendSpec:
    """The backend registered as ``name``, importing its module first if it is a built-in.

    Raises:
        ConfigError: an unknown name (listing the backends), or a package the backend needs
            is missing (what installs it).
    """
    spec = _REGISTRY.get(name) if isinstance(name, str) else None
    if spec is not None:
        return spec
    if not isinstance(name, str) or name not in BUILTIN:
        names = list(dict.fromkeys([*BUILTIN, *_REGISTRY]))
        raise ConfigError(f"unknown backend {name!r}; available backends: {', '.join(names)}")
    module, install = BUILTIN[name]
    try:
        importlib.import_module(module)
    except ImportError as exc:
        raise ConfigError(
            f"backend={name!r} needs {exc.name or 'a missing package'} ({exc}): {install}"
        ) from exc
    return _REGISTRY[name]
