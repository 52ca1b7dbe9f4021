"""The front (DESIGN §2, layer 1): :func:`make` and :class:`FleetVectorEnv`.

One vector env class for every backend. It validates input before anything reaches a worker,
owns the call state machine (idle / waiting-reset / waiting-step / waiting-call, with
gymnasium's AsyncVectorEnv errors) and assembles infos in gymnasium's convention by replaying
each env's info through ``gymnasium.vector.VectorEnv._add_info`` in env order.
"""

from __future__ import annotations

import collections
import contextlib
import importlib
import logging
import multiprocessing
import numbers
import os
import time
import weakref
from collections.abc import Callable, Iterable, Sequence
from copy import deepcopy
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, cast, overload

import cloudpickle
import gymnasium
import numpy as np
import psutil
from gymnasium.vector import AutoresetMode, VectorEnv
from gymnasium.vector.async_vector_env import AsyncState
from gymnasium.vector.utils import (
    batch_differing_spaces,
    batch_space,
    concatenate,
    create_empty_array,
)

from envfleet._backends.base import (
    Backend,
    DisownedBackend,
    WorkerLayout,
    accepts_env_index,
    bind_env_index,
    env_error,
    worker_ranges,
)
from envfleet._buffers import (
    Block,
    ObservationSlabs,
    batch_nbytes,
    fill_side,
    fixed_part,
    is_leaf,
    observation_nbytes,
    side_leaves,
    tree_copy,
    tree_scatter,
    tree_slice,
    tree_take,
    tree_write,
)
from envfleet._envgroup import not_an_env_error
from envfleet._errors import (
    AlreadyPendingCallError,
    ClosedEnvironmentError,
    ConfigError,
    EnvError,
    InvalidActionError,
    InvalidArgumentError,
    NoAsyncCallError,
    PoolStateError,
    ResetNeededError,
    SpaceMismatchError,
    StepTimeoutError,
)
from envfleet._protocol import (
    CallRequest,
    Command,
    InfoEvent,
    ResetRequest,
    SetAttrRequest,
    SideValues,
)
from envfleet._supervisor import FleetStats, Ledger, RestartPolicy

if TYPE_CHECKING:
    from envfleet.torch import TorchVectorEnv

__all__ = ["BACKENDS", "FleetVectorEnv", "make"]

logger = logging.getLogger("envfleet")

BACKENDS = ("serial", "threads", "processes", "ray", "envpool")
# copy=True without a copy (envfleet._buffers.ObservationSlabs): spare observation buffers per
# vector env, so a loop that keeps the last result while it steps never waits for a copy.
# Only for batched observations of at least SPARE_SLABS_MIN_BYTES (handing a slab out costs
# ~0.6 µs, copying 256 bytes ~0.3 µs, 3 MB ~80 µs), and none when the spares would take more
# than SPARE_SLABS_MAX_BYTES of shared memory together.
SPARE_SLABS = 2
SPARE_SLABS_MIN_BYTES = 4 << 10
DEFAULT_START_TIMEOUT = 60.0  # seconds for the workers to build their envs (make's start_timeout)
SPARE_SLABS_MAX_BYTES = 256 << 20
_LATER_BACKENDS: dict[str, str] = {}

EnvFactory = Callable[..., gymnasium.Env[Any, Any]]


class GymMake:
    """Picklable factory ``gymnasium.make(env_id, **env_kwargs)``.

    Ids in the ``ALE/`` namespace import ``ale_py`` first, which registers the Atari envs;
    ``"module:EnvId"`` ids import ``module`` first (in each worker too), as gymnasium does.
    """

    def __init__(self, env_id: str, env_kwargs: dict[str, Any] | None = None):
        self.env_id = env_id
        self.env_kwargs = dict(env_kwargs or {})

    def __call__(self) -> gymnasium.Env[Any, Any]:
        return gymnasium.make(register_namespace(self.env_id), **self.env_kwargs)

    def __repr__(self) -> str:
        return f"GymMake({self.env_id!r}, {self.env_kwargs!r})"


def register_namespace(env_id: str) -> str:
    """Import what registers ``env_id`` and return the id without its module: the module of
    a ``"module:EnvId"`` id (as ``gymnasium.make`` does), the package of a namespace where
    one is known (ALE).

    Raises:
        ConfigError: the module, or the namespace's package, cannot be imported.
    """
    if ":" in env_id:
        module, env_id = env_id.split(":", 1)
        try:
            importlib.import_module(module)
        except ImportError as exc:
            raise ConfigError(
                f"cannot import module {module!r} of environment id {module}:{env_id}: {exc}"
            ) from exc
    if env_id.startswith("ALE/"):
        try:
            import ale_py
        except ImportError as exc:
            raise ConfigError(f"{env_id!r} needs ale-py: pip install 'envfleet[atari]'") from exc
        gymnasium.register_envs(ale_py)
    return env_id


def check_env_id(env_id: str) -> None:
    """Check that ``env_id`` is a registered gymnasium id, importing its namespace (ALE) or
    its module (``"module:EnvId"``, gymnasium's form) first.

    Raises:
        ConfigError: the id is unknown, or it needs a package that is missing (``ALE/`` ids
            need ale-py: ``pip install 'envfleet[atari]'``).
    """
    try:
        gymnasium.spec(register_namespace(env_id))
    except gymnasium.error.Error as exc:
        raise ConfigError(f"unknown environment id {env_id!r}: {exc}") from exc


def usable_cores() -> int:
    """Cores this process may run on (its CPU affinity), at least 1."""
    try:
        return max(1, len(psutil.Process().cpu_affinity() or []))
    except (AttributeError, psutil.Error):
        return max(1, os.cpu_count() or 1)


# make()'s type by output=; **kwargs stands for make()'s other keyword arguments.
@overload
def make(
    env: str | EnvFactory | Sequence[EnvFactory],
    num_envs: int | None = None,
    *,
    output: Literal["numpy"] = "numpy",
    **kwargs: Any,
) -> FleetVectorEnv: ...
@overload
def make(
    env: str | EnvFactory | Sequence[EnvFactory],
    num_envs: int | None = None,
    *,
    output: Literal["torch"],
    **kwargs: Any,
) -> TorchVectorEnv: ...


def make(  # type: ignore[misc]  # the overloads stand for its keyword arguments with **kwargs
    env: str | EnvFactory | Sequence[EnvFactory],
    num_envs: int | None = None,
    *,
    backend: str = "processes",
    num_workers: int | None = None,
    batch_size: int | None = None,
    autoreset_mode: AutoresetMode | str = AutoresetMode.NEXT_STEP,
    env_kwargs: dict[str, Any] | None = None,
    step_timeout: float | None = None,
    start_timeout: float | None = DEFAULT_START_TIMEOUT,
    restart_policy: RestartPolicy | None = None,
    context: str | None = None,
    copy: bool = True,
    driver_envs: int | None = None,
    spin_s: float | None = None,
    ray_address: str | None = None,
    ray_options: dict[str, Any] | None = None,
    output: str = "numpy",
    device: Any = None,
    pin_memory: bool = False,
    observation_mode: str | tuple[gymnasium.Space[Any], gymnasium.Space[Any]] = "same",
) -> FleetVectorEnv | TorchVectorEnv:
    """Create a vector env of ``num_envs`` sub-environments on ``backend``.

    Every gymnasium space works, as with ``gymnasium.vector.SyncVectorEnv``. Array leaves
    (Box, Discrete, MultiDiscrete, MultiBinary, in Dict and Tuple) live in shared buffers;
    leaves without a fixed size (Text, Graph, Sequence, OneOf, custom ``Space`` subclasses)
    travel pickled with each reply (observations) or command (actions) and are batched with
    gymnasium's own ``concatenate``/``iterate``, as SyncVectorEnv batches them (tuples).
    ``output="torch"`` and :class:`envfleet.Sampler` refuse those (``ConfigError``).

    Args:
        env: a gymnasium id (``"CartPole-v1"``, ``"ALE/Pong-v5"``), a zero-argument callable
            returning a ``gymnasium.Env``, or a list of such callables (one per env). A factory
            that accepts a keyword ``env_index`` is called with the env's global index.
        num_envs: number of sub-environments; default 1, or ``len(env)`` for a list.
        backend: ``"serial"`` (in this process), ``"threads"`` (one thread per block of envs
            in this process; for envs that release the GIL), ``"processes"`` (worker
            processes over shared memory) or ``"ray"`` (Ray actors, on this machine or across
            a Ray cluster's nodes; ``pip install 'envfleet[ray]'``).
            ``"envpool"``: ``env`` is an EnvPool task id (``"CartPole-v1"``, ``"Pong-v5"``;
            ``envpool.list_all_envs()``) run by EnvPool's native threads, ``env_kwargs`` go
            to ``envpool.make``; only ``num_envs``, ``batch_size``, ``autoreset_mode``,
            ``env_kwargs`` and ``copy`` apply (see :mod:`envfleet._backends.envpool` for what
            maps and what is refused; ``pip install 'envfleet[envpool]'``).
        num_workers: worker count, ``1 <= num_workers <= num_envs``; envs go to workers in
            contiguous blocks whose sizes differ by at most one. ``processes``: worker
            processes, default usable cores - 1 with the driver stepping a share (see
            ``driver_envs``); ``threads``: threads, default ``min(num_envs, usable
            cores)``; ``serial``: blocks stepped in turn, default 1; ``ray``: actors,
            default ``min(num_envs, the Ray cluster's CPUs)``.
        batch_size: ``None`` or ``num_envs``: synchronous. ``1 <= batch_size < num_envs``: a
            first-ready pool, EnvPool's asynchronous interface: :meth:`~FleetVectorEnv.
            async_reset`, :meth:`~FleetVectorEnv.send` and :meth:`~FleetVectorEnv.recv`, which
            returns the first ``batch_size`` envs to finish, with ``info["env_id"]``. A worker
            hands its envs back together, so by default a pool puts one env in each worker
            (``processes``) or thread (``threads``): a slow env then holds up no other.
            Fewer workers (``num_workers``) cost fewer processes, but each env waits for the
            others of its block.
        autoreset_mode: a ``gymnasium.vector.AutoresetMode`` (or its string value).
        env_kwargs: keyword arguments for ``gymnasium.make``; only with a gymnasium id.
        step_timeout: seconds any step, reset or call may take before the workers still busy
            are killed and :class:`envfleet.StepTimeoutError` is raised; ``None``: no bound.
            With a timeout every env runs in a worker (``driver_envs=0``).
            Building the envs at start is bounded by ``start_timeout`` instead.
        start_timeout: seconds the workers (processes, threads, Ray actors) may take to build
            their envs (default 60); past it the workers are killed (threads are left
            behind, as daemons) and :class:`envfleet.StartTimeoutError` names the envs not
            built. ``None``: wait for good. Envs built in the calling thread are not bounded:
            env 0 (built first, to learn the spaces), the ``processes`` driver's own block and
            every ``serial`` env. A worker that dies while starting is reported at once.
        restart_policy: ``None``: fail fast (a typed error names what failed). A
            :class:`envfleet.RestartPolicy`: rebuild envs that raise in step or reset, and
            workers that die or run past the timeout, within its budget; the rebuilt envs
            return ``truncated=True`` and ``info["env_restarted"]``. With ``processes``, every
            env then runs in a worker (``driver_envs=0``).
        context: ``multiprocessing`` start method (``"fork"``, ``"spawn"``, ``"forkserver"``);
            default: the platform's.
        copy: ``True``: step/reset return observations, rewards and done flags that are the
            caller's, like gymnasium's copies; no later call changes them. With the
            ``serial``, ``threads`` and ``processes`` backends (outside a first-ready pool)
            the observations are not copied: the envs write each step's into a spare buffer
            that no earlier result uses, and the arrays returned are built over it (see
            :class:`envfleet._buffers.ObservationSlabs`). ``False``: views of the shared
            buffers, valid until the next call.
        driver_envs: ``processes`` only: how many envs (the first block) the driver steps
            itself while the workers step theirs. Default: an equal share when neither
            ``num_workers``, ``step_timeout`` nor ``restart_policy`` is given (see
            :func:`plan_processes`), else 0.
            Those envs live in the driver process: their exceptions are reported as usual,
            but a native crash in them (a segfault) takes the driver down, and no timeout can
            stop them; set 0 to isolate every env in a worker.
        spin_s: ``processes`` only: the most seconds a wait polls before it blocks
            (default 0.002); the budget adapts to the waits seen, and is 0 wherever spinners
            would outnumber the cores.
        ray_address: ``ray`` only: the cluster to join when this process is not connected to
            Ray yet (``ray.init(address=...)``): ``None`` starts a local one, ``"auto"`` joins
            the one started on this machine with ``ray start``. envfleet never shuts a
            cluster down; a local one it started lives until the interpreter exits.
        ray_options: ``ray`` only: options of each actor (Ray's ``.options(...)``):
            ``num_cpus`` (default 1, or an even share of the cluster's CPUs when there are
            more workers than CPUs), ``num_gpus``, ``resources={"simulator": 1}`` (place
            actors only on nodes that have that custom resource), ``scheduling_strategy``
            (default ``"SPREAD"``: across the nodes), ``runtime_env``, ...
        output: ``"numpy"`` (gymnasium's types) or ``"torch"``: observations, rewards and
            done flags as torch tensors, and TensorDicts on request, from an
            :class:`envfleet.torch.TorchVectorEnv` (``pip install 'envfleet[torch]'``). With
            ``copy=False`` on the CPU they are zero-copy views of the shared buffers, valid
            until the next call; see :mod:`envfleet.torch` for every copy semantics.
        device: ``output="torch"`` only: where results go (``"cuda"``); default the CPU.
        pin_memory: ``output="torch"`` only: stage results in pinned memory (needs CUDA).
        observation_mode: as gymnasium 1.4's SyncVectorEnv/AsyncVectorEnv argument.
            ``"same"``: every env's observation space must equal env 0's, and
            ``observation_space`` is ``batch_space`` of it. ``"different"``: the spaces may
            differ in their parameters (bounds) but must share shape and dtype
            (``is_space_dtype_shape_equiv``); ``single_observation_space`` is env 0's and
            ``observation_space`` gymnasium's ``batch_differing_spaces`` of every env's. A
            pair ``(observation_space, single_observation_space)``: used as given, every
            env's space sharing the single one's shape and dtype.

    Returns:
        A :class:`FleetVectorEnv`, a ``gymnasium.vector.VectorEnv``; a
        :class:`envfleet.torch.TorchVectorEnv` over one for ``output="torch"``.

    Raises:
        ConfigError: any bad argument above, an unknown gymnasium id, an unpicklable factory
            for ``processes`` or ``ray``, a bad ``observation_mode``;
            ``ray`` not installed, Ray not reachable, or actors asking for more resources
            than the Ray cluster has.
        SpaceMismatchError: the sub-environments' spaces differ (see ``observation_mode``;
            also a ``RuntimeError``, as gymnasium raises).
        EnvError: a factory raised (``method == "make"``).
        EnvCrashedError: a worker died while building its envs.
    """
    if output != "numpy" or device is not None or pin_memory:
        arguments = dict(locals())  # make()'s arguments, every one
        from envfleet.torch import make_with_output

        return make_with_output(make, arguments)
    backend = _check_backend(backend)
    if backend == "envpool":
        from envfleet._backends.envpool import make_envpool

        others: dict[str, Any] = {"num_workers": num_workers, "step_timeout": step_timeout}
        others |= {"restart_policy": restart_policy, "context": context}
        others |= {"driver_envs": driver_envs, "spin_s": spin_s}
        others |= {"ray_address": ray_address, "ray_options": ray_options}
        others |= {"observation_mode": None if observation_mode == "same" else observation_mode}
        return make_envpool(
            env,
            num_envs,
            batch_size=batch_size,
            autoreset_mode=autoreset_mode,
            env_kwargs=env_kwargs,
            copy=copy,
            refused=others,
        )
    env_fns, default_num_envs = _factories(env, env_kwargs)
    if num_envs is None:
        num_envs = default_num_envs
    if isinstance(num_envs, bool) or not isinstance(num_envs, numbers.Integral) or num_envs < 1:
        raise ConfigError(f"num_envs must be an integer >= 1, got {num_envs!r}")
    num_envs = int(num_envs)
    if len(env_fns) == 1:
        env_fns = env_fns * num_envs
    elif len(env_fns) != num_envs:
        raise ConfigError(f"got {len(env_fns)} env factories for num_envs={num_envs}")
    if num_workers is not None and not _is_int(num_workers, 1, num_envs):
        raise ConfigError(f"num_workers must be an integer in [1, {num_envs}], got {num_workers!r}")
    if batch_size is not None and not _is_int(batch_size, 1, num_envs):
        raise ConfigError(f"batch_size must be None or an integer in [1, {num_envs}]")
    pool = batch_size is not None and batch_size < num_envs
    if pool and num_workers is None:
        num_workers = num_envs  # one env per worker: each env is handed back when it finishes
    try:
        mode = (
            autoreset_mode
            if isinstance(autoreset_mode, AutoresetMode)
            else AutoresetMode(autoreset_mode)
        )
    except ValueError as exc:
        raise ConfigError(f"unknown autoreset_mode {autoreset_mode!r}") from exc
    if pool and mode is AutoresetMode.DISABLED:
        raise ConfigError(
            "a first-ready pool autoresets its envs, as EnvPool does: use "
            "AutoresetMode.NEXT_STEP or SAME_STEP"
        )
    if start_timeout is not None and not (
        isinstance(start_timeout, numbers.Real) and start_timeout > 0
    ):
        raise ConfigError(f"start_timeout must be None or seconds > 0, got {start_timeout!r}")
    if step_timeout is not None and not (
        isinstance(step_timeout, numbers.Real) and step_timeout > 0
    ):
        raise ConfigError(f"step_timeout must be None or seconds > 0, got {step_timeout!r}")
    if restart_policy is not None and not isinstance(restart_policy, RestartPolicy):
        raise ConfigError(
            f"restart_policy must be None or an envfleet.RestartPolicy, got {restart_policy!r}"
        )
    if context is not None and context not in multiprocessing.get_all_start_methods():
        raise ConfigError(
            f"context={context!r} is not a start method here; "
            f"choose from {multiprocessing.get_all_start_methods()}"
        )
    explicit_spaces = isinstance(observation_mode, tuple) and len(observation_mode) == 2
    if explicit_spaces:
        if not all(isinstance(s_, gymnasium.Space) for s_ in observation_mode):
            raise ConfigError(
                "observation_mode: expected both elements of the pair to be Spaces, got "
                f"{[type(s_).__name__ for s_ in observation_mode]}"
            )
    elif not (isinstance(observation_mode, str) and observation_mode in ("same", "different")):
        raise ConfigError(
            # gymnasium's text (its pair is (observation_space, single_observation_space))
            "Invalid `observation_mode`, expected: 'same' or 'different' or tuple of single "
            f"and batch observation space, actual got {observation_mode}"
        )
    if backend == "ray":
        ray_plan = _plan_ray(num_envs, num_workers, ray_address, ray_options)
        num_workers = ray_plan.num_workers
    elif ray_address is not None or ray_options is not None:
        raise ConfigError("ray_address and ray_options are options of backend='ray'")

    accepts = [accepts_env_index(fn) for fn in env_fns]
    blobs = _pickle_factories(env_fns) if backend in ("processes", "ray") else []
    # As gymnasium's vector envs do, env 0 is built here first: it gives the spaces and
    # metadata. The serial backend, and the processes backend when the driver steps a block
    # itself, keep it as env 0; otherwise it is closed once the workers are up.
    first = _build(bind_env_index(env_fns[0], 0, accepts[0]), 0)
    obs_space, act_space = first.observation_space, first.action_space
    if explicit_spaces:
        obs_space = observation_mode[1]
    metadata, render_mode = dict(first.metadata), first.render_mode
    try:
        if backend == "processes":
            if pool and driver_envs:
                raise ConfigError("a first-ready pool steps every env in a worker (driver_envs=0)")
            if step_timeout is not None or restart_policy is not None:
                # Only a worker can be stopped, or rebuilt after a crash: every env goes in one.
                if driver_envs:
                    raise ConfigError(
                        "step_timeout and restart_policy cannot cover envs the driver steps "
                        "itself; use driver_envs=0 (the default when either is set)"
                    )
                driver_envs = 0
            plan = plan_processes(num_envs, num_workers, driver_envs, spin_s, usable_cores())
            ranges = plan.ranges
        else:
            if driver_envs is not None or spin_s is not None:
                raise ConfigError("driver_envs and spin_s are options of backend='processes'")
            if num_workers is None:
                num_workers = min(num_envs, usable_cores()) if backend == "threads" else 1
            ranges = worker_ranges(num_envs, num_workers)
    except ConfigError:
        first.close()
        raise
    layout = WorkerLayout(
        env_fns, accepts, obs_space, act_space, mode, ranges, observation_mode == "same"
    )
    ledger = Ledger(num_envs, restart_policy)
    # copy=True results without a copy (buffers.ObservationSlabs), where the envs write into
    # the block the front reads: serial, threads and processes, outside a first-ready pool.
    spare = 0
    obs_nbytes = observation_nbytes(obs_space, num_envs)
    if (
        copy
        and not pool
        and backend != "ray"
        and obs_nbytes >= SPARE_SLABS_MIN_BYTES
        and not side_leaves(obs_space)  # results with side leaves are built anew each step
    ):
        spare = SPARE_SLABS if obs_nbytes * SPARE_SLABS <= SPARE_SLABS_MAX_BYTES else 0
    nbytes = batch_nbytes(obs_space, act_space, num_envs, spare)
    backend_obj: Backend
    if backend == "processes":
        from envfleet._backends.processes import ProcessesBackend

        backend_obj = ProcessesBackend(
            layout,
            Block(nbytes, shared=True, spare_slabs=spare),
            blobs,
            context,
            driver_group=plan.driver_envs > 0,
            first_env=first,
            driver_spin_s=plan.driver_spin_s,
            worker_spin_s=plan.worker_spin_s,
            ledger=ledger,
            pool=pool,
            start_timeout=start_timeout,
        )
    elif backend == "ray":
        from envfleet._backends.ray import RayBackend

        backend_obj = RayBackend(
            layout,
            Block(nbytes, shared=False),
            blobs,
            actor_options=ray_plan.actor_options,
            ledger=ledger,
            pool=pool,
            first_env=first,
            start_timeout=start_timeout,
        )
    elif backend == "threads":
        from envfleet._backends.threads import ThreadsBackend

        backend_obj = ThreadsBackend(
            layout,
            Block(nbytes, shared=False, spare_slabs=spare),
            first_env=first,
            ledger=ledger,
            inline_first=step_timeout is None and not pool,
            start_timeout=start_timeout,
        )
    else:
        from envfleet._backends.serial import SerialBackend

        backend_obj = SerialBackend(
            layout, Block(nbytes, shared=False, spare_slabs=spare), first_env=first, ledger=ledger
        )
    venv = FleetVectorEnv(
        backend_obj,
        backend_name=backend,
        single_observation_space=obs_space,
        single_action_space=act_space,
        metadata=metadata,
        render_mode=render_mode,
        autoreset_mode=mode,
        step_timeout=None if step_timeout is None else float(step_timeout),
        copy=copy,
        batch_size=num_envs if batch_size is None else int(batch_size),
    )
    venv.observation_mode = observation_mode
    if explicit_spaces:
        venv.observation_space = observation_mode[0]
    elif observation_mode == "different":
        try:
            venv.observation_space = batch_differing_spaces(
                list(venv.get_attr("observation_space"))
            )
        except BaseException as exc:
            venv.close(terminate=True)
            if isinstance(exc, Exception) and not isinstance(exc, EnvError):
                raise SpaceMismatchError(
                    f"observation_mode='different': the observation spaces cannot be batched: {exc}"
                ) from exc
            raise
    return venv


def _is_int(value: Any, low: int, high: int) -> bool:
    return (
        isinstance(value, numbers.Integral)
        and not isinstance(value, bool)
        and low <= int(value) <= high
    )


@dataclass
class ProcessesPlan:
    """How the processes backend lays out its envs (see :func:`plan_processes`)."""

    ranges: list[tuple[int, int]]  # one block per group; the driver's first when driver_envs
    num_workers: int
    driver_envs: int
    driver_spin_s: float
    worker_spin_s: float


def plan_processes(
    num_envs: int,
    num_workers: int | None,
    driver_envs: int | None,
    spin_s: float | None,
    cores: int,
) -> ProcessesPlan:
    """Choose worker count, the driver's share and spin budgets for the processes backend.

    Defaults (DESIGN §3): with ``c`` usable cores, ``c - 1`` workers (at least 1, at most
    ``num_envs - 1``) and the driver steps an equal share of the envs itself, so that every
    core steps envs and nobody idles on a round trip. Given ``num_workers`` alone, the driver
    steps none. Waiters spin at most ``spin_s`` seconds (default
    :data:`envfleet._backends.processes.DEFAULT_SPIN_S`) and only while spinners do not
    outnumber the cores: the driver spins only if ``num_workers + 1 <= cores``, the workers
    only if ``num_workers <= cores``.

    Raises:
        ConfigError: ``driver_envs`` outside ``[0, num_envs - num_workers]`` (every worker
            needs one env), or ``spin_s`` negative.
    """
    from envfleet._backends.processes import DEFAULT_SPIN_S

    if spin_s is None:
        spin_s = DEFAULT_SPIN_S
    if not (isinstance(spin_s, numbers.Real) and spin_s >= 0):
        raise ConfigError(f"spin_s must be None or seconds >= 0, got {spin_s!r}")
    if driver_envs is not None and not _is_int(driver_envs, 0, num_envs - 1):
        raise ConfigError(
            f"driver_envs must be an integer in [0, {num_envs - 1}] (at least one env must go "
            f"to a worker; use backend='serial' to step every env in the driver), got "
            f"{driver_envs!r}"
        )
    if num_workers is None:
        if driver_envs is None:
            num_workers = max(1, min(num_envs - 1, cores - 1))
            driver_envs = num_envs // (num_workers + 1) if num_envs > 1 and cores > 1 else 0
            if driver_envs == 0:
                num_workers = max(1, min(num_envs, cores))
        else:
            num_workers = max(1, min(num_envs - driver_envs, cores - 1 if driver_envs else cores))
    elif driver_envs is None:
        driver_envs = 0
    if num_workers > num_envs - driver_envs:
        raise ConfigError(
            f"{num_workers} workers cannot share the {num_envs - driver_envs} envs the driver "
            f"does not step (driver_envs={driver_envs})"
        )
    ranges = [(0, driver_envs)] if driver_envs else []
    ranges += [
        (driver_envs + a, driver_envs + b)
        for a, b in worker_ranges(num_envs - driver_envs, num_workers)
    ]
    return ProcessesPlan(
        ranges=ranges,
        num_workers=num_workers,
        driver_envs=driver_envs,
        driver_spin_s=float(spin_s) if num_workers + 1 <= cores else 0.0,
        worker_spin_s=float(spin_s) if num_workers <= cores else 0.0,
    )


def _plan_ray(
    num_envs: int,
    num_workers: int | None,
    ray_address: str | None,
    ray_options: dict[str, Any] | None,
) -> Any:
    """Connect to Ray and plan the actors (:func:`envfleet._backends.ray.plan_ray`).

    Raises:
        ConfigError: ray is not installed, or :func:`~envfleet._backends.ray.plan_ray`'s.
    """
    if ray_address is not None and not isinstance(ray_address, str):
        raise ConfigError(f"ray_address must be None or a string, got {ray_address!r}")
    try:
        from envfleet._backends.ray import plan_ray
    except ImportError as exc:
        raise ConfigError(f"backend='ray' needs ray ({exc}): pip install 'envfleet[ray]'") from exc
    return plan_ray(num_envs, num_workers, ray_address, ray_options)


def _check_backend(backend: str) -> str:
    if backend in BACKENDS:
        return backend
    if backend in _LATER_BACKENDS:
        raise ConfigError(
            f"backend={backend!r}: {_LATER_BACKENDS[backend]} is not available yet; "
            f"available backends: {', '.join(BACKENDS)}"
        )
    raise ConfigError(f"unknown backend {backend!r}; available backends: {', '.join(BACKENDS)}")


def _factories(
    env: str | EnvFactory | Sequence[EnvFactory], env_kwargs: dict[str, Any] | None
) -> tuple[list[EnvFactory], int]:
    if isinstance(env, str):
        check_env_id(env)
        return [GymMake(env, env_kwargs)], 1
    if env_kwargs is not None:
        raise ConfigError("env_kwargs is only for a gymnasium id; bind arguments in your factory")
    if callable(env):
        return [env], 1
    if isinstance(env, Sequence) and len(env) > 0 and all(callable(fn) for fn in env):
        fns: list[EnvFactory] = [fn for fn in env if callable(fn)]
        return fns, len(fns)
    raise ConfigError(
        "env must be a gymnasium id, a callable returning a gymnasium.Env, or a non-empty list "
        f"of such callables; got {type(env).__name__}"
    )


def _pickle_factories(env_fns: Sequence[EnvFactory]) -> list[bytes]:
    blobs: dict[int, bytes] = {}
    out = []
    for i, fn in enumerate(env_fns):
        if id(fn) not in blobs:
            try:
                blobs[id(fn)] = cloudpickle.dumps(fn)
            except Exception as exc:
                raise ConfigError(
                    f"the factory of sub-environment {i} cannot be pickled for the worker "
                    f"processes ({type(exc).__name__}: {exc}); use backend='serial' or make it "
                    "picklable"
                ) from exc
        out.append(blobs[id(fn)])
    return out


def _build(fn: Callable[[], gymnasium.Env[Any, Any]], env_index: int) -> gymnasium.Env[Any, Any]:
    try:
        env = fn()
    except ConfigError:
        raise
    except Exception as exc:
        raise env_error(env_index, None, "make", f"{type(exc).__name__}: {exc}", exc) from exc
    if not isinstance(env, gymnasium.Env):
        raise not_an_env_error(env, env_index)
    return env


_IDLE, _RUNNING, _READY = 0, 1, 2  # the first-ready pool's env states

# Every vector env of this process, so that a forked child disowns them (below).
_LIVE: weakref.WeakSet[FleetVectorEnv] = weakref.WeakSet()


def _disown_after_fork() -> None:
    """In a child forked from this process: its vector envs are the parent's. Each now
    refuses every call (WrongProcessError) and closes nothing, and multiprocessing's exit
    handler no longer counts their workers as this process's children to terminate."""
    for venv in list(_LIVE):
        venv._disown()


os.register_at_fork(after_in_child=_disown_after_fork)


_SCALAR_TYPES = (int, float, bool)


def _flat_infos(events: list[InfoEvent], num_envs: int) -> dict[str, Any] | None:
    """gymnasium's ``VectorEnv._add_info`` over every event at once, in the common case.

    That case: env indices increasing, every info with the same keys in the same order, none
    starting with ``_`` or named ``final_obs``, and each key's values all of one type that
    gymnasium batches into an array of that dtype (``int``, ``float``, ``bool`` or a numpy
    scalar type). The result is then the same dict, arrays and masks (dtype, values and key
    order) that adding the events one by one gives, built column by column: ~5 µs instead of
    ~20 µs for 8 Atari infos. Anything else returns ``None``, and the caller adds the events
    one by one.
    """
    first = events[0][1]
    keys = tuple(first)
    if "final_obs" in first or any(key.startswith("_") for key in keys):
        return None
    indices: list[int] = []
    last = -1
    for index, info in events:
        if index <= last or tuple(info) != keys:
            return None
        indices.append(index)
        last = index
    every = len(indices) == num_envs  # then indices are 0..num_envs-1
    rows = None if every else np.array(indices, dtype=np.intp)
    mask = np.zeros(num_envs, dtype=np.bool_)
    mask[slice(None) if rows is None else rows] = True
    infos: dict[str, Any] = {}
    for key in keys:
        values = [info[key] for _, info in events]
        kind = type(values[0])
        if not (kind in _SCALAR_TYPES or issubclass(kind, np.number)):
            return None
        for value in values:
            if type(value) is not kind:
                return None
        if rows is None:
            array = np.array(values, dtype=kind)
        else:
            array = np.zeros(num_envs, dtype=kind)
            array[rows] = values
        infos[key], infos[f"_{key}"] = array, mask.copy()
    return infos


class _BatchInfos:
    """Runs gymnasium's ``VectorEnv._add_info`` for a batch of ``num_envs`` rows (a pool's
    ``batch_size``), so a pool's infos follow gymnasium's convention exactly."""

    def __init__(self, num_envs: int):
        self.num_envs = num_envs

    def _add_info(
        self, vector_infos: dict[str, Any], env_info: dict[str, Any], env_num: int
    ) -> dict[str, Any]:
        return VectorEnv._add_info(self, vector_infos, env_info, env_num)  # type: ignore[arg-type]


# Enum members of the step's hot path as globals (an Enum member lookup costs ~70 ns).
_NO_CALL, _DISABLED, _STEP = AsyncState.DEFAULT, AutoresetMode.DISABLED, Command.STEP


class FleetVectorEnv(VectorEnv[Any, Any, np.ndarray]):
    """A ``gymnasium.vector.VectorEnv`` over an envfleet backend; build it with :func:`make`.

    Results follow ``gymnasium.vector.SyncVectorEnv`` exactly: observations batched as
    ``create_empty_array`` lays them out (``[num_envs, *shape]`` of the space's dtype, or
    dict/tuple of those), ``reward: float64[num_envs]``, ``terminated: bool[num_envs]``,
    ``truncated: bool[num_envs]``, infos as ``info[key]`` arrays with ``info["_key"]`` masks.
    The asynchronous calls and their errors follow ``gymnasium.vector.AsyncVectorEnv``.
    """

    # As gymnasium's vector envs: "same", "different" or (observation_space, single one);
    # set by make().
    observation_mode: str | tuple[gymnasium.Space[Any], gymnasium.Space[Any]] = "same"

    def __init__(
        self,
        backend: Backend,
        *,
        backend_name: str,
        single_observation_space: gymnasium.Space[Any],
        single_action_space: gymnasium.Space[Any],
        metadata: dict[str, Any],
        render_mode: str | None,
        autoreset_mode: AutoresetMode,
        step_timeout: float | None,
        copy: bool,
        batch_size: int | None = None,
    ):
        self._backend = backend
        self._owner_pid = os.getpid()
        _LIVE.add(self)
        self.backend = backend_name
        self.num_envs = backend.batch.rewards.shape[0]
        self.num_workers = backend.num_workers
        self._every_group: dict[int, Any] = dict.fromkeys(range(len(backend.ranges)))
        self._action_leaf = is_leaf(single_action_space)
        self.single_observation_space = single_observation_space
        self.single_action_space = single_action_space
        self.observation_space = batch_space(single_observation_space, self.num_envs)
        self.action_space = batch_space(single_action_space, self.num_envs)
        self.autoreset_mode = autoreset_mode
        self.metadata = metadata
        self.metadata["autoreset_mode"] = autoreset_mode
        self.render_mode = render_mode
        self.step_timeout = step_timeout
        self.copy = copy
        self._state = AsyncState.DEFAULT
        # What an asynchronous call left for its wait to run in this thread (inline_groups).
        self._deferred: tuple[Command, dict[int, Any]] | None = None
        self._single_env_infos = False  # set by envfleet.ProcessEnv (one env, infos unbatched)
        self._needs_reset = np.zeros(self.num_envs, dtype=np.bool_)
        self._steps = 0
        self.closed = False
        # The first-ready pool: per env, idle (awaiting an action), running or ready (its
        # result waits for recv); ready envs queue in the order they finished.
        self.batch_size = self.num_envs if batch_size is None else batch_size
        self.is_pool = self.batch_size < self.num_envs
        self._env_state = np.zeros(self.num_envs, dtype=np.int8)
        self._has_action = np.zeros(self.num_envs, dtype=np.bool_)
        self._ready: collections.deque[int] = collections.deque()
        self._ready_infos: dict[int, list[dict[str, Any]]] = {}
        self._pool_started = False
        self._in_flight: dict[int, np.ndarray] = {}  # worker -> its envs in its pending command
        self._group_of = np.repeat(
            np.arange(len(backend.ranges)), [stop - start for start, stop in backend.ranges]
        )
        # copy=True results handed out without a copy: the slab holding every env's latest
        # observation, and the one the pending command writes (0: the batch's own buffer).
        batch = backend.batch
        self._slabs: ObservationSlabs | None = None
        if copy and not self.is_pool and batch.slab is not None:
            self._slabs = ObservationSlabs(batch)
        self._slab_latest = 0
        self._slab_next = 0
        # Observation leaves without a fixed size (Text, Graph, ...: buffers.side_leaves) have
        # no buffer; per env, its latest values there (SideValues events of the replies).
        self._side_spaces = side_leaves(single_observation_space)
        self._side_rows: list[list[Any] | None] = [None] * self.num_envs
        # Action leaves without a fixed size: their values go to each worker with the step
        # command (EnvGroup.step's side_actions); the step's payloads, or every group's None.
        self._side_actions = bool(side_leaves(single_action_space))
        self._step_payloads: dict[int, Any] = self._every_group
        self._pool_side_actions: list[list[Any]] = [[] for _ in range(self.num_envs)]

    # -- first-ready pool (EnvPool's asynchronous interface) ---------------------------------

    def async_reset(
        self, seed: int | Sequence[int | None] | None = None, env_ids: Any = None
    ) -> None:
        """Reset envs without waiting; :meth:`recv` returns them as they finish (EnvPool's
        ``async_reset``; ``env_ids`` adds partial resets, as EnvPool's ``reset(env_id)``).

        Args:
            seed: ``None``, an int (env i gets ``seed + i``) or one seed per env reset.
            env_ids: ``None``: every env; results of envs that finished but were not received
                are dropped. Else the envs to reset (distinct ints), each awaiting an action
                and held by a worker with none of its envs running.

        Raises:
            PoolStateError: envs are still running (recv them first), an env of ``env_ids``
                is not awaiting an action, or a synchronous call is pending.
            InvalidArgumentError: bad seeds or env ids. Nothing is sent on any error.
        """
        self._assert_pool_idle("async_reset")
        ids = self._env_ids(env_ids)
        self._drop_slabs()
        mask = np.zeros(self.num_envs, dtype=np.bool_)
        mask[ids] = True
        groups = [w for w, (a, b) in enumerate(self._backend.ranges) if mask[a:b].any()]
        in_groups = np.isin(self._group_of, groups)
        running = np.flatnonzero(in_groups & (self._env_state == _RUNNING)).tolist()
        if running:
            raise PoolStateError(
                f"sub-environments {running} are still running; recv() their results before "
                "async_reset()",
                running,
            )
        if env_ids is not None:
            busy = np.flatnonzero(mask & ((self._env_state != _IDLE) | self._has_action))
            if busy.size:
                raise PoolStateError(
                    f"sub-environments {busy.tolist()} are not awaiting an action (a result "
                    "not received yet, or an action already sent); only those can be reset",
                    busy.tolist(),
                )
        if env_ids is not None and isinstance(seed, Sequence) and not isinstance(seed, str):
            if len(seed) != len(ids):
                raise InvalidArgumentError(
                    f"got {len(seed)} seeds for {len(ids)} env ids; give one seed per env id"
                )
            seeds: list[int | None] = [None] * self.num_envs
            for e, s_ in zip(ids.tolist(), seed, strict=True):
                seeds[e] = s_
        else:
            seeds = self._seeds(seed)
        payloads = {}
        for w in groups:
            start, stop = self._backend.ranges[w]
            local = None if env_ids is None else mask[start:stop]
            payloads[w] = ResetRequest(seeds[start:stop], None, local)
            self._backend.ledger.note_seeds(start, seeds[start:stop], local)
            self._in_flight[w] = np.flatnonzero(mask[start:stop]) + start
        if env_ids is None:
            self._ready.clear()
            self._ready_infos.clear()
            self._has_action[:] = False
        self._submit(Command.RESET, payloads)
        self._env_state[mask] = _RUNNING
        self._pool_started = True

    def send(self, actions: Any, env_ids: Any = None) -> None:
        """Send actions to some envs without waiting (EnvPool's ``send``).

        Args:
            actions: batched actions for ``env_ids``: ``[len(env_ids), *shape]`` per leaf of the
                action space, converted to its dtype (same-kind casting).
            env_ids: distinct env indices (int array-like); ``None``: every env, as EnvPool.
                Each must be awaiting an action: returned by :meth:`recv` and not yet sent one.
                A worker steps once every env it holds has its action.

        Raises:
            InvalidArgumentError: an unknown or repeated env id, or no env id.
            InvalidActionError: actions of the wrong structure, shape or dtype.
            PoolStateError: an env not awaiting an action, no :meth:`async_reset` yet, or a
                synchronous call pending. Nothing is sent when anything is wrong.
        """
        self._assert_pool_idle("send")
        if not self._pool_started:
            raise PoolStateError("call async_reset() before send()")
        ids = self._env_ids(env_ids)
        state = self._env_state[ids]
        if state.any() or self._has_action[ids].any():
            bad = [int(e) for e in ids[(state != 0) | self._has_action[ids]]]
            e = bad[0]
            why = (
                "is still running"
                if self._env_state[e] == _RUNNING
                else "has a result not received yet (recv() it first)"
                if self._env_state[e] == _READY
                else "was already sent an action"
            )
            raise PoolStateError(
                f"sub-environments {bad} are not awaiting an action: sub-environment {e} {why}",
                bad,
            )
        n = len(ids)
        if (
            self._action_leaf
            and type(actions) is np.ndarray
            and actions.shape == (n, *self._backend.batch.actions.shape[1:])
            and actions.dtype == self._backend.batch.actions.dtype
        ):
            self._backend.batch.actions[ids] = actions
        else:
            staged = create_empty_array(fixed_part(self.single_action_space), n)
            writes: list[tuple[np.ndarray, np.ndarray]] = []
            side: list[tuple[Any, ...]] = []
            _check_actions(self.single_action_space, staged, actions, "actions", writes, side, n)
            for target, value in writes:
                target[...] = value
            tree_scatter(self._backend.batch.actions, ids, staged)
            for k, e in enumerate(ids.tolist()):  # leaves without a fixed size: per env
                self._pool_side_actions[e] = [values[k] for values in side]
        self._has_action[ids] = True
        self._drop_slabs()
        payloads: dict[int, Any] = {}
        for w in np.unique(self._group_of[ids]).tolist():
            start, stop = self._backend.ranges[w]
            if self._has_action[start:stop].all():
                payloads[w] = None
                if self._side_actions:  # as EnvGroup.step's side_actions
                    rows = self._pool_side_actions[start:stop]
                    payloads[w] = [tuple(values) for values in zip(*rows, strict=True)]
        if payloads:
            self._submit(Command.STEP, payloads)
            for w in payloads:
                start, stop = self._backend.ranges[w]
                self._env_state[start:stop] = _RUNNING
                self._has_action[start:stop] = False
                self._in_flight[w] = np.arange(start, stop)

    def recv(
        self, timeout: float | None = None
    ) -> tuple[Any, np.ndarray, np.ndarray, np.ndarray, dict[str, Any]]:
        """The results of the first ``batch_size`` envs to finish (EnvPool's ``recv``).

        Envs come in the order they finished (a worker's envs in index order). Each returned
        env then awaits its next action.

        Args:
            timeout: seconds each env may take from the :meth:`send` (or
                :meth:`async_reset`) that started it (default ``step_timeout``; ``None``: no
                bound). An env past it raises :class:`StepTimeoutError` even while others
                keep finishing.

        Returns:
            (observations ``[batch_size, *shape]``, rewards ``float64[batch_size]``,
            terminations ``bool[batch_size]``, truncations ``bool[batch_size]``, infos): infos
            in gymnasium's convention over the batch, plus ``info["env_id"]``
            (``int32[batch_size]``), as EnvPool. Observations are one gather copy; with
            ``copy=False`` and envs that form one ascending run they are views of the shared
            buffer, valid until the next call.

        Raises:
            PoolStateError: fewer than ``batch_size`` envs running or ready, or no
                :meth:`async_reset` yet.
            EnvError: an env raised; its block of envs awaits actions again, results of other
                envs that finished are kept for the next :meth:`recv`.
            EnvCrashedError, StepTimeoutError: a worker died, or nothing finished in time;
                the vector env is closed.
        """
        self._assert_pool_idle("recv")
        if not self._pool_started:
            raise PoolStateError("call async_reset() before recv()")
        need = self.batch_size
        in_flight = len(self._ready) + int(np.count_nonzero(self._env_state == _RUNNING))
        if in_flight < need:
            raise PoolStateError(
                f"recv() returns {need} envs but only {in_flight} are running or ready; "
                "send() actions to more envs first"
            )
        if timeout is None:
            timeout = self.step_timeout
        ranges = self._backend.ranges
        while len(self._ready) < need:
            try:
                # The backend bounds each worker's time from its own send by ``timeout``.
                results = self._backend.collect_ready(timeout, self._steps)
            except EnvError as exc:
                if not self.is_pool:
                    # batch_size == num_envs: as for step(), the whole batch is lost and every
                    # env awaits an action again.
                    self._backend.drop_kept()
                    self._in_flight.clear()
                    self._ready.clear()
                    self._ready_infos.clear()
                    self._env_state[:] = _IDLE
                    raise
                w = int(self._group_of[exc.env_index])
                self._env_state[self._in_flight.pop(w, np.arange(*ranges[w]))] = _IDLE
                raise
            except BaseException:
                self.closed = self._backend.closed
                raise
            if self._side_spaces:
                results = self._take_side(results)
            for w in sorted(results):
                envs = self._in_flight.pop(w)
                self._env_state[envs] = _READY
                self._ready.extend(envs.tolist())
                for index, info in results[w] or ():
                    self._ready_infos.setdefault(index, []).append(info)
        ids = np.array([self._ready.popleft() for _ in range(need)], dtype=np.int32)
        self._env_state[ids] = _IDLE
        self._steps += 1
        batch = self._backend.batch
        run = ids[0] + need - 1 == ids[-1] and bool(np.all(np.diff(ids) == 1))
        if run and not self.copy:
            rows = slice(int(ids[0]), int(ids[0]) + need)
            obs = tree_slice(batch.observations, rows.start, rows.stop)
        else:
            obs = tree_take(batch.observations, ids)
        if self._side_spaces:
            obs = self._fill_side(obs, ids.tolist())
        # Row k of the batch is env ids[k]; an env may have several infos (a reset's, then a
        # step's), added in order.
        events = [
            (k, info) for k, e in enumerate(ids.tolist()) for info in self._ready_infos.pop(e, ())
        ]
        flat = _flat_infos(events, need) if events else None
        if flat is not None:
            infos = flat
        else:
            infos = {}
            adder = _BatchInfos(need)
            for k, info in events:
                infos = adder._add_info(infos, info, k)
        infos["env_id"] = ids
        return obs, batch.rewards[ids], batch.terminations[ids], batch.truncations[ids], infos

    def _assert_pool_idle(self, name: str) -> None:
        self._assert_running()
        if self._state is not AsyncState.DEFAULT:
            raise PoolStateError(
                f"calling `{name}` while a call to `{self._state.value}` is pending"
            )

    def _assert_no_pool(self, name: str) -> None:
        """Refuse a synchronous call that does not fit the pool's state (see PoolStateError)."""
        stepping = name in ("reset_async", "step_async")
        if stepping and self.is_pool:
            raise PoolStateError(
                f"`{name}` is not available on a first-ready pool (batch_size="
                f"{self.batch_size} < num_envs={self.num_envs}); use async_reset(), send() "
                "and recv()"
            )
        # Envs running after send() would answer this call's wait; a step or reset would
        # also overwrite the results of envs not yet received.
        busy = self._env_state == _RUNNING
        if stepping:
            busy |= self._env_state == _READY
        if busy.any():
            envs = np.flatnonzero(busy).tolist()
            raise PoolStateError(
                f"calling `{name}` while sub-environments {envs} are running or have results "
                "not received yet; recv() them first",
                envs,
            )

    def _env_ids(self, env_ids: Any) -> np.ndarray:
        if env_ids is None:
            return np.arange(self.num_envs)
        ids = np.asarray(env_ids)
        if ids.ndim == 0:
            ids = ids.reshape(1)
        if ids.ndim != 1 or not (ids.size == 0 or np.issubdtype(ids.dtype, np.integer)):
            raise InvalidArgumentError(
                f"env_ids must be a 1-D sequence of integers, got {env_ids!r}"
            )
        if ids.size == 0:
            raise InvalidArgumentError("env_ids is empty")
        unknown = ids[(ids < 0) | (ids >= self.num_envs)]
        if unknown.size:
            raise InvalidArgumentError(
                f"unknown env ids {unknown.tolist()}: env ids are 0..{self.num_envs - 1}"
            )
        values, counts = np.unique(ids, return_counts=True)
        if (counts > 1).any():
            raise InvalidArgumentError(f"repeated env ids {values[counts > 1].tolist()}")
        return ids.astype(np.intp)

    # -- reset -----------------------------------------------------------------------------

    def reset(
        self,
        *,
        seed: int | Sequence[int | None] | None = None,
        options: dict[str, Any] | None = None,
    ) -> tuple[Any, dict[str, Any]]:
        """Reset the sub-environments (all, or those in ``options["reset_mask"]``).

        Args:
            seed: ``None`` (random), an int (env i gets ``seed + i``) or one seed per env.
            options: passed to each env's ``reset``; the key ``"reset_mask"`` (``bool[num_envs]``
                ndarray with at least one True) resets only those envs, as in gymnasium.

        Returns:
            (observations, infos) as gymnasium's SyncVectorEnv.reset.

        Raises:
            InvalidArgumentError: bad seeds or reset mask (nothing is sent).
            EnvError, EnvCrashedError, StepTimeoutError: see :meth:`reset_wait`.
        """
        self.reset_async(seed=seed, options=options)
        return self.reset_wait()

    def reset_async(
        self, seed: int | Sequence[int | None] | None = None, options: dict[str, Any] | None = None
    ) -> None:
        """Start a reset; collect it with :meth:`reset_wait` (gymnasium's AsyncVectorEnv API)."""
        self._assert_idle("reset_async")
        seeds = self._seeds(seed)
        if options is not None and not isinstance(options, dict):
            raise InvalidArgumentError(f"options must be None or a dict, got {options!r}")
        mask = None
        if options is not None and "reset_mask" in options:
            options = dict(options)
            mask = self._reset_mask(options.pop("reset_mask"))
        payloads = {}
        for w, (start, stop) in enumerate(self._backend.ranges):
            local_mask = None if mask is None else mask[start:stop]
            if local_mask is not None and not local_mask.any():
                continue
            payloads[w] = ResetRequest(seeds[start:stop], options, local_mask)
            self._backend.ledger.note_seeds(start, seeds[start:stop], local_mask)
        self._pick_slab(every_env=mask is None)
        self._submit_async(Command.RESET, payloads)  # a backend may refuse it: nothing changes
        if mask is None:
            self._needs_reset[:] = False
        else:
            self._needs_reset[mask] = False
        self._state = AsyncState.WAITING_RESET

    def reset_wait(self, timeout: float | None = None) -> tuple[Any, dict[str, Any]]:
        """Wait for :meth:`reset_async`; ``timeout`` in seconds (default ``step_timeout``).

        Raises:
            NoAsyncCallError: no reset is pending.
            EnvError: an env raised in reset (its exception chained as ``__cause__``).
            EnvCrashedError: a worker died; the vector env is closed.
            StepTimeoutError: the timeout expired; the vector env is closed. Also a
                ``multiprocessing.TimeoutError``, as gymnasium's. Envs stepped in this thread
                (the driver's block, serial) cannot be interrupted: a timeout they overran is
                raised once they are done.
        """
        results = self._wait(AsyncState.WAITING_RESET, "reset_wait", timeout)
        infos = self._infos(results)
        return self._observations(), infos

    # -- step ------------------------------------------------------------------------------

    def step(self, actions: Any) -> tuple[Any, np.ndarray, np.ndarray, np.ndarray, dict[str, Any]]:
        """Step every sub-environment with its action; autoreset per ``autoreset_mode``.

        Args:
            actions: batched actions fitting ``action_space`` (``[num_envs, *shape]`` per leaf);
                converted to the action space's dtype (same-kind casting).

        Returns:
            (observations, rewards ``float64[num_envs]``, terminations ``bool[num_envs]``,
            truncations ``bool[num_envs]``, infos), as gymnasium's SyncVectorEnv.step.

        Raises:
            InvalidActionError: actions of the wrong structure, shape or dtype (nothing is sent).
            ResetNeededError: ``AutoresetMode.DISABLED`` and some env needs a reset first.
            EnvError, EnvCrashedError, StepTimeoutError: see :meth:`step_wait`.
        """
        # step_async then step_wait, with the submit and the wait in one backend call.
        self._prepare_step(actions, "step_async")
        try:
            if self._side_actions:  # a payload per worker: no shortcut round
                self._backend.submit(_STEP, self._step_payloads, self._steps)
                results = self._backend.collect(self.step_timeout, self._steps)
            else:
                results = self._backend.round(
                    _STEP, self._every_group, self.step_timeout, self._steps
                )
        except BaseException:
            # A crash, a timeout or an interrupt may have shut the backend down.
            self.closed = self._backend.closed
            raise
        return self._step_outputs(results)

    def step_async(self, actions: Any) -> None:
        """Start a step; collect it with :meth:`step_wait` (gymnasium's AsyncVectorEnv API)."""
        self._prepare_step(actions, "step_async")
        self._submit_async(Command.STEP, self._step_payloads)
        self._state = AsyncState.WAITING_STEP

    def _prepare_step(self, actions: Any, name: str) -> None:
        """Check that a step may start and write ``actions`` into the action buffer."""
        if self.closed or self._pool_started or self.is_pool or self._state is not _NO_CALL:
            self._assert_idle(name)  # raises, except for a started pool with no env pending
        if self.autoreset_mode is _DISABLED and self._needs_reset.any():
            pending = np.flatnonzero(self._needs_reset).tolist()
            raise ResetNeededError(
                f"autoreset_mode=DISABLED and sub-environments {pending} ended their episodes; "
                "reset them first, e.g. reset(options={'reset_mask': mask})",
                pending,
            )
        out = self._backend.batch.actions
        if (
            self._action_leaf
            and type(actions) is np.ndarray
            and actions.dtype == out.dtype
            and actions.shape == out.shape
        ):
            # The common case, checked without the general walk; the same dtype, so the
            # assignment casts nothing (and costs ~0.1 µs against np.copyto's ~0.25).
            out[...] = actions
        else:
            writes: list[tuple[np.ndarray, np.ndarray]] = []
            side: list[tuple[Any, ...]] = []
            _check_actions(
                self.single_action_space, out, actions, "actions", writes, side, self.num_envs
            )
            for target, value in writes:
                target[...] = value
            if self._side_actions:
                self._step_payloads = {
                    w: [values[start:stop] for values in side]
                    for w, (start, stop) in enumerate(self._backend.ranges)
                }
        if self._slabs is not None:
            self._pick_slab(every_env=True)

    def step_wait(
        self, timeout: float | None = None
    ) -> tuple[Any, np.ndarray, np.ndarray, np.ndarray, dict[str, Any]]:
        """Wait for :meth:`step_async`; ``timeout`` in seconds (default ``step_timeout``).

        Raises:
            NoAsyncCallError: no step is pending.
            EnvError: an env raised in step or its autoreset; this batch is lost, the other
                envs did step, and the vector env stays usable.
            EnvCrashedError: a worker died; the vector env is closed.
            StepTimeoutError: the timeout expired; the vector env is closed (as
                :meth:`reset_wait`).

        With a ``restart_policy``, those failures rebuild what failed instead, within the
        policy's budget, and the step returns every env's result (see
        :class:`envfleet.RestartPolicy`); past the budget they raise as above.
        """
        return self._step_outputs(self._wait(AsyncState.WAITING_STEP, "step_wait", timeout))

    def _step_outputs(
        self, results: dict[int, Any]
    ) -> tuple[Any, np.ndarray, np.ndarray, np.ndarray, dict[str, Any]]:
        """A finished step's results, as step_wait returns them."""
        self._steps += 1
        infos = self._infos(results)
        batch = self._backend.batch
        if self.autoreset_mode is _DISABLED:
            np.logical_or(batch.terminations, batch.truncations, out=self._needs_reset)
        if self.copy:
            return (
                self._observations(),
                batch.rewards.copy(),
                batch.terminations.copy(),
                batch.truncations.copy(),
                infos,
            )
        obs = self._observations() if self._side_spaces else batch.observations
        return obs, batch.rewards, batch.terminations, batch.truncations, infos

    # -- call, attributes, render ----------------------------------------------------------

    def call(self, name: str, *args: Any, **kwargs: Any) -> tuple[Any, ...]:
        """Call ``name`` on every sub-environment (its value when not callable).

        Follows gymnasium's ``SyncVectorEnv.call``: ``env.get_wrapper_attr(name)``, called
        with ``args``/``kwargs`` when callable. Returns a tuple with one result per env.

        Raises:
            EnvError: an env raised (e.g. ``AttributeError`` for a missing attribute).
        """
        self.call_async(name, *args, **kwargs)
        return self.call_wait()

    def call_async(self, name: str, *args: Any, **kwargs: Any) -> None:
        """Start :meth:`call`; collect it with :meth:`call_wait`."""
        self._assert_idle("call_async")
        _check_name(name)
        request = CallRequest(name, args, kwargs)
        self._submit_async(Command.CALL, dict.fromkeys(self._every_group, request))
        self._state = AsyncState.WAITING_CALL

    def call_wait(self, timeout: float | None = None) -> tuple[Any, ...]:
        """Wait for :meth:`call_async`; returns one result per env, in env order.

        Raises:
            EnvError: an env raised. StepTimeoutError: as :meth:`reset_wait`.
        """
        results = self._wait(AsyncState.WAITING_CALL, "call_wait", timeout)
        return tuple(value for w in sorted(results) for value in results[w])

    def apply(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[Any, ...]:
        """Call ``function(env, *args, **kwargs)`` on every sub-environment, where it lives.

        An envfleet addition to gymnasium's API (:meth:`call` takes only a method name): the
        function is cloudpickled, so a lambda or closure works with every backend, and runs
        in the worker that holds the env (each env sees its own copy of the function). It is
        how :meth:`envfleet.Sampler.update_envs` changes a task parameter inside the workers.

        Returns:
            One result per env, in env order (results are pickled back from workers).

        Raises:
            InvalidArgumentError: ``function`` is not callable or cannot be pickled.
            EnvError: the function raised for an env (its exception chained as ``__cause__``).
        """
        if not callable(function):
            raise InvalidArgumentError(f"apply() needs a callable, got {function!r}")
        try:
            blob = cloudpickle.dumps(function)
        except Exception as exc:
            raise InvalidArgumentError(f"apply() could not pickle {function!r}: {exc}") from exc
        name = getattr(function, "__qualname__", type(function).__name__)
        self._assert_idle("apply")
        request = CallRequest(f"apply({name})", args, kwargs, function=blob)
        self._submit(Command.CALL, dict.fromkeys(self._every_group, request))
        self._state = AsyncState.WAITING_CALL
        return self.call_wait()

    @property
    def worker_ranges(self) -> tuple[tuple[int, int], ...]:
        """Per worker, the ``[start, stop)`` env indices it holds, in worker order."""
        return tuple((int(start), int(stop)) for start, stop in self._backend.ranges)

    def get_attr(self, name: str) -> tuple[Any, ...]:
        """The attribute ``name`` of every sub-environment (gymnasium's ``get_attr``)."""
        return self.call(name)

    def set_attr(self, name: str, values: Any) -> None:
        """Set attribute ``name`` on every sub-environment.

        Args:
            values: a list or tuple with one value per env, or one value for all envs.

        Raises:
            InvalidArgumentError: a list or tuple whose length is not ``num_envs``.
            EnvError: an env raised while setting it.
        """
        self._assert_idle("set_attr")
        _check_name(name)
        if not isinstance(values, (list, tuple)):
            values = [values] * self.num_envs
        if len(values) != self.num_envs:
            raise InvalidArgumentError(
                "values must be a list or tuple with length equal to the number of environments. "
                f"Got `{len(values)}` values for {self.num_envs} environments."
            )
        payloads = {
            w: SetAttrRequest(name, list(values[start:stop]))
            for w, (start, stop) in enumerate(self._backend.ranges)
        }
        self._submit(Command.SET_ATTR, payloads)
        self._state = AsyncState.WAITING_CALL
        self._wait(AsyncState.WAITING_CALL, "set_attr", None)

    def render(self) -> tuple[Any, ...]:
        """``env.render()`` of every sub-environment, in env order (gymnasium's SyncVectorEnv)."""
        self._assert_idle("render")
        self._submit(Command.RENDER, self._every_group)
        self._state = AsyncState.WAITING_CALL
        results = self._wait(AsyncState.WAITING_CALL, "render", None)
        return tuple(frame for w in sorted(results) for frame in results[w])

    @property
    def stats(self) -> FleetStats:
        """What the supervisor has seen: restarts, timeouts, crashes, env errors, and per
        worker its step-time statistics (mean, p50, p99 in seconds). A snapshot, read without
        a round trip to the workers, at any time (also while a step is pending)."""
        return self._backend.ledger.snapshot(self._backend.step_times())

    @property
    def np_random_seed(self) -> tuple[int, ...]:  # type: ignore[override]
        """The ``np_random_seed`` of every sub-environment (as gymnasium's SyncVectorEnv)."""
        return self.get_attr("np_random_seed")

    @property  # type: ignore[misc]
    def np_random(self) -> tuple[np.random.Generator, ...]:  # type: ignore[override]
        """The ``np_random`` generator of every sub-environment (as gymnasium's SyncVectorEnv)."""
        return self.get_attr("np_random")

    # -- close -----------------------------------------------------------------------------

    def close_extras(self, timeout: float | None = None, terminate: bool = False) -> None:
        """Close the sub-environments and release workers and shared memory.

        Args:
            timeout: seconds the envs get to close before their workers are terminated, then
                killed; ``None``: a default of a few seconds. Always bounded.
            terminate: ``True``: terminate the workers at once without closing the envs.

        Warns:
            UserWarning: a call is pending (gymnasium's AsyncVectorEnv text); without
                ``terminate`` it is waited for (within ``timeout``) and its result dropped.
        """
        if self._state is not AsyncState.DEFAULT:
            # gymnasium's AsyncVectorEnv.close_extras: the same text, through its logger (a
            # UserWarning), terminating or not.
            gymnasium.logger.warn(
                f"Calling `close` while waiting for a pending call to `{self._state.value}` "
                "to complete."
            )
        if self._state is not AsyncState.DEFAULT and not terminate:
            try:
                self._wait(self._state, "close", timeout if timeout is not None else 5.0)
            except Exception:  # the vector env is going away; the pending result is dropped
                terminate = True
        self._state = AsyncState.DEFAULT
        self._deferred = None
        if (self._env_state == _RUNNING).any() and not terminate:
            # Envs sent actions in a pool and not received: let them finish, then close.
            try:
                self._backend.collect(timeout if timeout is not None else 5.0, self._steps)
            except Exception:  # the vector env is going away; their results are dropped
                terminate = True
        self._env_state[:] = _IDLE
        self._backend.close(timeout, terminate)

    def _disown(self) -> None:
        """See :func:`_disown_after_fork`: in a forked child only."""
        backend = self._backend
        if isinstance(backend, DisownedBackend):
            return
        with contextlib.suppress(Exception):
            backend.disown()
        self._backend = cast(Backend, DisownedBackend(self._owner_pid))

    def __enter__(self) -> FleetVectorEnv:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        """Close on leaving a ``with`` block (terminating the workers if it raised)."""
        self.close(terminate=exc_info[0] is not None)

    def __del__(self) -> None:
        if not getattr(self, "closed", True) and hasattr(self, "_backend"):
            with contextlib.suppress(Exception):
                self.close(terminate=True)

    def __repr__(self) -> str:
        return (
            f"FleetVectorEnv(backend={self.backend!r}, num_envs={self.num_envs}, "
            f"num_workers={self.num_workers})"
        )

    # -- helpers ---------------------------------------------------------------------------

    def _assert_running(self) -> None:
        if self.closed:
            raise ClosedEnvironmentError(
                f"Trying to operate on `{type(self).__name__}`, after a call to `close()`."
            )

    def _assert_idle(self, name: str) -> None:
        self._assert_running()
        if self.is_pool or (self._pool_started and self._env_state.any()):
            self._assert_no_pool(name)
        if self._state is not AsyncState.DEFAULT:
            raise AlreadyPendingCallError(
                f"Calling `{name}` while waiting for a pending call to "
                f"`{self._state.value}` to complete",
                str(self._state.value),
            )

    def _submit(self, command: Command, payloads: dict[int, Any]) -> None:
        try:
            self._backend.submit(command, payloads, self._steps)
        except BaseException:
            # A crashed worker or an interrupt may have shut the backend down.
            self.closed = self._backend.closed
            raise

    def _submit_async(self, command: Command, payloads: dict[int, Any]) -> None:
        """Submit what runs elsewhere now; what the backend would run here, in the calling
        thread (its ``inline_groups``), waits for :meth:`_wait`, so ``*_async`` returns at once
        and the wait's timeout counts it (as gymnasium's AsyncVectorEnv, whose ``*_async``
        only sends)."""
        inline = self._backend.inline_groups(command)
        later = {w: p for w, p in payloads.items() if w in inline}
        now = {w: p for w, p in payloads.items() if w not in inline}
        if now or not later:
            self._submit(command, now)
        self._deferred = (command, later) if later else None

    def _wait(self, expected: AsyncState, name: str, timeout: float | None) -> dict[int, Any]:
        self._assert_running()
        if self._state is not expected:
            raise NoAsyncCallError(
                f"Calling `{name}` without any prior call to `{expected.value}_async`.",
                expected.value,
            )
        explicit = timeout
        if timeout is None:
            timeout = self.step_timeout
        started = time.monotonic()
        deferred, self._deferred = self._deferred, None
        try:
            if deferred is not None:
                self._submit(*deferred)  # runs here, to the end: no timeout can stop it
                if timeout is not None:
                    timeout = max(0.0, timeout - (time.monotonic() - started))
            results = self._backend.collect(timeout, self._steps)
            if deferred is not None and explicit is not None:
                self._raise_late(deferred[1], explicit, time.monotonic() - started)
            return results
        except BaseException:
            # A crash, a timeout or an interrupt may have shut the backend down.
            self.closed = self._backend.closed
            raise
        finally:
            self._state = AsyncState.DEFAULT

    def _raise_late(self, groups: dict[int, Any], timeout: float, elapsed: float) -> None:
        """A ``*_wait(timeout=)`` whose envs stepped in this thread ran past ``timeout``: they
        could not be interrupted, so it is reported once they are done, as a timeout (the
        results are dropped and the vector env closed, as after any timeout)."""
        if elapsed <= timeout:
            return
        envs = [e for w in sorted(groups) for e in range(*self._backend.ranges[w])]
        self._backend.ledger.timeouts += 1
        self._backend.close(0, True)
        raise StepTimeoutError(
            f"the call did not finish within {timeout} s (it took {elapsed:.3f} s); "
            f"sub-environments {envs} run in the calling thread and cannot be interrupted, "
            "so it is reported once they are done; the vector env is closed",
            envs,
            float(timeout),
        )

    def _infos(self, results: dict[int, Any]) -> dict[str, Any]:
        if self._side_spaces:
            results = self._take_side(results)
        if self._single_env_infos:
            # envfleet.ProcessEnv: the one env's own info dict, not batched.
            return next((dict(info) for events in results.values() for _, info in events or ()), {})
        infos: dict[str, Any] = {}
        if not any(results.values()):
            return infos  # no env had an info this step (the common case)
        if not any(isinstance(events, dict) for events in results.values()):
            flat = _flat_infos(
                [event for w in sorted(results) for event in results[w] or ()], self.num_envs
            )
            if flat is not None:
                return flat  # every env had the same flat info (Atari's lives, frame numbers)
        for w in sorted(results):
            events: list[InfoEvent] | dict[str, Any] | None = results[w]
            if isinstance(events, dict):
                # A one-worker backend (envpool) hands its infos already in gymnasium's vector
                # convention over every env.
                infos.update(events)
                continue
            for index, info in events or ():
                infos = self._add_info(infos, info, index)
        return infos

    def _observations(self) -> Any:
        """The observations of the step or reset that just finished, as the caller gets them."""
        if self._slabs is not None:
            k = self._slab_latest = self._slab_next
            if k:
                return self._slabs.hand_out(k)  # the caller's without a copy
        obs = self._backend.batch.observations
        if self._side_spaces:
            return self._fill_side(tree_copy(obs) if self.copy else obs, range(self.num_envs))
        return tree_copy(obs) if self.copy else obs

    def _take_side(self, results: dict[int, Any]) -> dict[int, Any]:
        """``results`` without their :class:`~envfleet._protocol.SideValues` events, whose
        values become the envs' latest side-leaf values."""
        rows = self._side_rows
        kept: dict[int, Any] = {}
        for w, events in results.items():
            if not isinstance(events, list):
                kept[w] = events
                continue
            infos = []
            for index, info in events:
                if type(info) is SideValues:
                    rows[index] = info["values"]
                else:
                    infos.append((index, info))
            kept[w] = infos or None
        return kept

    def _fill_side(self, obs: Any, envs: Iterable[int]) -> Any:
        """``obs`` (a batched tree, ``None`` at the side leaves) with the side leaves of the
        envs ``envs`` batched by gymnasium's ``concatenate``, as SyncVectorEnv batches them;
        with ``copy=True`` deep copies, as SyncVectorEnv's (an env in this process may
        rewrite the objects it returned)."""
        rows = [cast(list[Any], self._side_rows[e]) for e in envs]
        if self.copy:
            rows = deepcopy(rows)
        batched = (
            concatenate(
                space, [row[k] for row in rows], cast(Any, create_empty_array(space, len(rows)))
            )
            for k, space in enumerate(self._side_spaces)
        )
        return fill_side(self.single_observation_space, obs, batched)

    def _pick_slab(self, every_env: bool) -> None:
        """Choose the slab the next step or reset writes its observations to.

        A command that writes every env's row (a step, a full reset) goes to any slab no
        result uses. One that writes only some rows (a masked reset) must find every other
        env's latest row there too: it goes to the latest slab when no result uses it, else
        to a free one that gets the latest rows copied first.
        """
        slabs = self._slabs
        if slabs is None:
            return
        if not self.copy:  # switched off since make(): views of the batch's own buffer
            self._drop_slabs()
            return
        latest = self._slab_latest
        if every_env:
            k = slabs.pick()
        elif slabs.free(latest):
            k = latest
        else:
            k = slabs.pick()
            tree_write(slabs.slabs[k], slabs.slabs[latest])
        cast(np.ndarray, self._backend.batch.slab)[0] = k
        self._slab_next = k

    def _drop_slabs(self) -> None:
        """Go back to the batch's own observation buffer for good (the pool API and
        ``copy=False`` read it directly): move the latest observations there."""
        slabs = self._slabs
        if slabs is None:
            return
        if self._slab_latest:
            tree_write(slabs.slabs[0], slabs.slabs[self._slab_latest])
        cast(np.ndarray, self._backend.batch.slab)[0] = 0
        self._slabs = None
        self._slab_latest = self._slab_next = 0

    def _seeds(self, seed: int | Sequence[int | None] | None) -> list[int | None]:
        """One seed per env, checked as gymnasium's ``np_random`` checks each (an int >= 0, or
        ``None``) before anything is sent: a bad one raises :class:`InvalidArgumentError`."""
        if seed is None:
            return [None] * self.num_envs
        if _is_seed(seed):
            return [int(cast(int, seed)) + i for i in range(self.num_envs)]
        if not isinstance(seed, Sequence) or isinstance(seed, str):
            raise InvalidArgumentError(
                f"seed must be None, an int >= 0 or a list of seeds, got {seed!r}"
            )
        if len(seed) != self.num_envs:
            raise InvalidArgumentError(
                f"If seeds are passed as a list the length must match num_envs={self.num_envs} "
                f"but got length={len(seed)}."
            )
        bad = [i for i, s in enumerate(seed) if s is not None and not _is_seed(s)]
        if bad:
            raise InvalidArgumentError(
                f"seeds of sub-environments {bad} are not None or an int >= 0: "
                f"{[seed[i] for i in bad]!r}"
            )
        return [None if s is None else int(s) for s in seed]

    def _reset_mask(self, mask: Any) -> np.ndarray:
        if not isinstance(mask, np.ndarray):
            raise InvalidArgumentError(
                f"`options['reset_mask']` must be a numpy array, got {type(mask)}"
            )
        if mask.shape != (self.num_envs,):
            raise InvalidArgumentError(
                f"`options['reset_mask']` must have shape `({self.num_envs},)`, got {mask.shape}"
            )
        if mask.dtype != np.bool_:
            raise InvalidArgumentError(
                f"`options['reset_mask']` must have `dtype=np.bool_`, got {mask.dtype}"
            )
        if not mask.any():
            raise InvalidArgumentError(
                "`options['reset_mask']` must contain a boolean array with at least one True "
                f"value, got reset_mask={mask}"
            )
        return mask.copy()


def _check_name(name: Any) -> None:
    """An attribute or method name for call/get_attr/set_attr: a ``str``, else
    :class:`InvalidArgumentError` before anything is sent."""
    if not isinstance(name, str):
        raise InvalidArgumentError(
            f"the attribute or method name must be a str, got {type(name).__name__}: {name!r}"
        )


def _is_seed(seed: Any) -> bool:
    """An int >= 0 (numpy's too, not a bool): what gymnasium's ``np_random`` accepts."""
    return isinstance(seed, (int, np.integer)) and not isinstance(seed, bool) and bool(seed >= 0)


def _check_actions(
    space: gymnasium.Space[Any],
    out: Any,
    actions: Any,
    where: str,
    writes: list[tuple[np.ndarray, np.ndarray]],
    side: list[tuple[Any, ...]] | None = None,
    count: int = 0,
) -> None:
    """Check ``actions`` against the batched buffer ``out``; queue (out, value) writes.

    A leaf without a fixed size (``out`` is ``None`` there, see buffers.side_leaves) takes
    any sequence of one value per env (what gymnasium's batched action space holds, a
    tuple) of length ``count``; it is appended to ``side`` as a tuple.
    """
    if isinstance(space, gymnasium.spaces.Dict):
        if not isinstance(actions, dict) or set(actions) != set(space.spaces):
            got = sorted(actions) if isinstance(actions, dict) else type(actions).__name__
            raise InvalidActionError(
                f"{where}: expected a dict with keys {sorted(space.spaces)}, got {got}"
            )
        for key, sub in space.spaces.items():
            _check_actions(sub, out[key], actions[key], f"{where}[{key!r}]", writes, side, count)
        return
    if isinstance(space, gymnasium.spaces.Tuple):
        if not isinstance(actions, tuple) or len(actions) != len(space.spaces):
            raise InvalidActionError(
                f"{where}: expected a tuple of {len(space.spaces)} batched actions"
            )
        for k, sub in enumerate(space.spaces):
            _check_actions(sub, out[k], actions[k], f"{where}[{k}]", writes, side, count)
        return
    if out is None:  # a leaf without a fixed size: one value per env, any sequence
        if isinstance(actions, (str, bytes, dict)) or not hasattr(actions, "__len__"):
            raise InvalidActionError(
                f"{where}: expected a sequence of {count} actions (one per env), "
                f"got {type(actions).__name__}"
            )
        if len(actions) != count:
            raise InvalidActionError(
                f"{where}: expected {count} actions (one per env), got {len(actions)}"
            )
        cast(list[tuple[Any, ...]], side).append(tuple(actions))
        return
    try:
        value = np.asarray(actions)
    except Exception as exc:
        raise InvalidActionError(f"{where}: cannot convert to an array ({exc})") from exc
    if value.shape != out.shape:
        raise InvalidActionError(f"{where}: expected shape {out.shape}, got {value.shape}")
    if not np.can_cast(value.dtype, out.dtype, casting="same_kind"):
        raise InvalidActionError(
            f"{where}: dtype {value.dtype} cannot be converted to the action space's {out.dtype}"
        )
    writes.append((out, value))
