"""make(): the front's one way in (layer 5 in docs/architecture.md). It checks make()'s own
arguments against the table of options that go together (:mod:`envfleet._front.options`), looks
the backend up in the registry (:mod:`envfleet._backends.registry`), lets the backend plan its
workers, learns the spaces from env 0 (built here, or, when the plan puts every env in a worker,
in the worker that holds it: no env is built in this process then), and wraps the backend the
registry built in a :class:`FleetVectorEnv`.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal, cast, overload

import gymnasium
from gymnasium.vector import AutoresetMode
from gymnasium.vector.utils import batch_differing_spaces

from envfleet._backends.base import (
    EnvProbe,
    WorkerLayout,
    accepts_env_index,
    bind_env_index,
)
from envfleet._backends.recycle import Recycle, default_recycle
from envfleet._backends.registry import (
    BACKENDS,
    BackendSpec,
    BuildRequest,
    NativeRequest,
    PlanRequest,
    Sizing,
    lookup,
)
from envfleet._backends.rounds import RoundDriver
from envfleet._backends.supervisor import Ledger
from envfleet._core.buffers import batch_nbytes
from envfleet._core.cores import pool_workers, usable_cores
from envfleet._core.errors import ConfigError, EnvError, SpaceMismatchError
from envfleet._core.replay import Snapshot
from envfleet._front.factories import (
    EnvFactory,
    build_env,
    env_factories,
    pickle_factories,
)
from envfleet._front.multi_agent import multi_agent_factories, multi_agent_of
from envfleet._front.multi_agent_vector_env import MultiAgentVectorEnv
from envfleet._front.options import (
    DEFAULT_START_TIMEOUT,
    DEFAULT_SUPERVISION,
    Processes,
    Ray,
    Settings,
    Supervision,
    TorchOutput,
    autoreset_mode_of,
    backend_of,
    check,
)
from envfleet._front.results import spare_slab_count
from envfleet._front.vector_env import FleetVectorEnv

if TYPE_CHECKING:
    from envfleet.torch import TorchVectorEnv

__all__ = ["BACKENDS", "DEFAULT_START_TIMEOUT", "make"]


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
    output: Literal["torch"] | TorchOutput,
    **kwargs: Any,
) -> TorchVectorEnv: ...


def make(  # type: ignore[misc]  # the overloads stand for its keyword arguments with **kwargs
    env: str | EnvFactory | Sequence[EnvFactory],
    num_envs: int | None = None,
    *,
    backend: str | Processes | Ray = "processes",
    num_workers: int | None = None,
    batch_size: int | None = None,
    autoreset_mode: AutoresetMode | str = AutoresetMode.NEXT_STEP,
    env_kwargs: dict[str, Any] | None = None,
    observation_mode: str | tuple[gymnasium.Space[Any], gymnasium.Space[Any]] = "same",
    copy: bool = True,
    supervision: Supervision = DEFAULT_SUPERVISION,
    output: str | TorchOutput = "numpy",
    resume: Snapshot | None = None,
) -> FleetVectorEnv | TorchVectorEnv:
    """Create a vector env of ``num_envs`` sub-environments on ``backend``.

    A ``gymnasium.vector.VectorEnv`` whose results are bit-identical to gymnasium's
    ``SyncVectorEnv`` for the same seeds and actions. Which options go together is one table
    (``envfleet._front.options.RULES``), checked before anything starts. The concept pages
    explain each option: docs/concepts/ (vector env, pool, copy, supervision), docs/backends/.

    ====================  ==========================================================================
    ``env``               a gymnasium id, an env factory, or a list of factories (one per env)
    ``num_envs``          sub-environments; default 1, or ``len(env)`` for a list
    ``backend``           ``"processes"`` (default), ``"threads"``, ``"serial"``, ``"ray"``...
    ``num_workers``       workers, each stepping a contiguous block of envs; default: one per core
    ``batch_size``        ``< num_envs``: EnvPool's first-ready pool (``send``/``recv``, ``env_id``)
    ``autoreset_mode``    gymnasium's ``AutoresetMode``, ``"NextStep"`` or ``"next_step"`` (default)
    ``env_kwargs``        keyword arguments for ``gymnasium.make`` (with a gymnasium id)
    ``observation_mode``  gymnasium's: ``"same"`` (default), ``"different"``, or a pair of spaces
    ``copy``              ``True`` (default): results are yours; ``False``: views, until next call
    ``supervision``       :class:`envfleet.Supervision`: timeouts, hang reports, restarts, recycling
    ``output``            ``"numpy"`` (default), ``"torch"``, or an :class:`envfleet.TorchOutput`
    ``resume``            an :class:`envfleet.Snapshot` to continue exactly (no ``reset`` first)
    ====================  ==========================================================================

    ``backend`` is also ``"envpool"`` (EnvPool's own tasks), or :class:`envfleet.Processes` or
    :class:`envfleet.Ray` with their own options. A factory may return a PettingZoo
    ``ParallelEnv``: make() then returns a :class:`envfleet.MultiAgentVectorEnv`. Every gymnasium
    space works; leaves without a fixed size (Text, Graph, Sequence) travel pickled, as
    SyncVectorEnv batches them.

    What happens by default: every env runs in a worker process, none in this one; a worker
    that dies (a segfault, ``os._exit``, SIGKILL, an OOM kill) is rebuilt and only the env it
    was stepping loses its episode (``truncated=True``, ``info["env_restarted"]``, an
    :class:`envfleet.EnvRestartedWarning`); an env's own exception raises, as in gymnasium; a
    call waiting 60 s warns :class:`envfleet.HangWarning` with the busy envs' stacks;
    Ctrl-C completes the call first, so ``snapshot()`` works in the ``except`` block.

    Returns:
        A :class:`FleetVectorEnv`; a :class:`envfleet.torch.TorchVectorEnv` over one for torch
        output; a :class:`envfleet.MultiAgentVectorEnv` over one for PettingZoo parallel envs.

    Raises:
        ConfigError: a bad argument or a pair of options the table refuses, an unknown backend
            or gymnasium id, an unpicklable factory (processes, ray), Ray not reachable.
        SpaceMismatchError: the sub-environments' spaces differ (see ``observation_mode``;
            also a ``RuntimeError``, as gymnasium raises).
        EnvError: a factory raised (``method == "make"``).
        EnvCrashedError: a worker died while building its envs (also a script without an
            ``if __name__ == "__main__":`` guard under spawn or forkserver; the message says).
        StartTimeoutError: the envs were not built within ``supervision.start_timeout``.

    Example::

        envs = envfleet.make("CartPole-v1", 16)  # float32[16, 4] observations, float64 rewards
        pool = envfleet.make("CartPole-v1", 16, batch_size=8)  # recv() gives the first 8
        strict = envfleet.make("CartPole-v1", 16, supervision=envfleet.Supervision(
            step_timeout=5.0, restart_policy=None))  # fail fast
    """
    arguments = dict(locals())  # make()'s arguments, every one
    if not isinstance(supervision, Supervision):
        raise ConfigError(f"supervision must be an envfleet.Supervision, got {supervision!r}")
    name, backend_options, processes = backend_of(backend)
    driver_envs = 0 if processes is None else processes.driver_envs
    mode = autoreset_mode_of(autoreset_mode)
    pool = batch_size is not None and batch_size != _given_num_envs(env, num_envs)
    explicit = _check_observation_mode(observation_mode)
    check(
        Settings(
            backend=name,
            pool=pool,
            num_workers=num_workers is not None,
            driver_envs=driver_envs,
            autoreset_mode=mode,
            observation_mode_given=observation_mode != "same",
            output="numpy" if output == "numpy" else "torch",
            supervision=supervision,
        )
    )
    if output != "numpy":
        from envfleet.torch import make_with_output

        return make_with_output(make, arguments)
    spec = lookup(name)
    if spec.native is not None:
        native = NativeRequest(env, num_envs, batch_size, mode, env_kwargs)
        return _native_vector_env(spec, native, copy)
    step_timeout = supervision.step_timeout
    restart_policy = supervision.restart_policy
    if not supervision.explicit_restarts and driver_envs:
        restart_policy = None  # envs the driver runs (an opt-in share): none rebuilt
    context = None if processes is None else processes.context
    env_fns, num_envs = _env_list(env, env_kwargs, num_envs)
    pool = _check_batching(num_envs, num_workers, batch_size)
    hosted = processes is not None and processes.pool_layout == "per_env"
    if pool and num_workers is None and batch_size is not None and not hosted:
        num_workers = pool_workers(num_envs, batch_size, usable_cores())
    if resume is not None:  # before any worker starts
        Snapshot.check(resume, num_envs, mode.value, pool)
    plan = spec.plan(
        PlanRequest(num_envs, num_workers, pool, step_timeout, restart_policy, backend_options)
    )
    replay_steps = supervision.replay_steps
    recycle = supervision.recycle if supervision.explicit_recycle else None
    auto_recycle = supervision.recycle == "auto"
    if auto_recycle and spec.recycles_by_default and not pool and replay_steps and not driver_envs:
        recycle = default_recycle(len(plan.ranges))
    accepts = [accepts_env_index(fn) for fn in env_fns]
    # A factory that returns a PettingZoo ParallelEnv gets it adapted, in whichever process
    # builds it (envfleet._front.multi_agent); any other env passes through unchanged.
    env_fns = multi_agent_factories(env_fns)
    blobs = pickle_factories(env_fns) if spec.pickles_factories else []
    same = observation_mode == "same"
    pair = cast(tuple, observation_mode) if explicit else None

    def size(probe: EnvProbe) -> Sizing:
        """The layout, block bytes and spare slabs that env 0's spaces fix."""
        obs_space = probe.observation_space if pair is None else pair[1]
        act_space = probe.action_space
        layout = WorkerLayout(
            env_fns, accepts, obs_space, act_space, mode, plan.ranges, same, int(replay_steps)
        )
        spare = spare_slab_count(obs_space, num_envs, copy, pool, spec.spare_slabs)
        return Sizing(layout, batch_nbytes(obs_space, act_space, num_envs, spare), spare)

    # As gymnasium's vector envs do, env 0 is built here first: it gives the spaces and
    # metadata. The backend keeps it as env 0 where it steps env 0 in this process, and
    # closes it once its workers are up otherwise. A driver-free plan (every env in a worker)
    # builds none here: the backend takes env 0's probe from the worker that holds it.
    first = None
    if not plan.driver_free:
        first = build_env(bind_env_index(env_fns[0], 0, accepts[0]), 0)
    ledger = Ledger(num_envs, restart_policy)
    start_timeout = supervision.start_timeout
    build = BuildRequest(
        plan, accepts, first, ledger, blobs, pool, context, step_timeout, start_timeout, size
    )
    if first is not None:
        build.learn(EnvProbe.of(first))
    assert spec.build is not None  # every backend but a native one has a constructor
    built = spec.build(build)
    built.factories = [bind_env_index(fn, i, accepts[i]) for i, fn in enumerate(env_fns)]
    report_hangs = getattr(built, "report_hangs", None)  # the round driver's
    if report_hangs is not None:
        report_hangs(supervision.hang_report_delay)
    if recycle is not None:
        cast(RoundDriver, built).recycle_with(cast(Recycle, recycle))
    probe = build.probe
    assert probe is not None, f"backend {spec.name!r} built its envs without learning env 0's"
    venv = FleetVectorEnv(
        built,
        backend_name=spec.name,
        single_observation_space=build.layout.single_observation_space,
        single_action_space=build.layout.single_action_space,
        metadata=probe.metadata,
        render_mode=probe.render_mode,
        autoreset_mode=mode,
        step_timeout=step_timeout,
        copy=copy,
        batch_size=num_envs if batch_size is None else int(batch_size),
    )
    if resume is not None:
        try:
            venv.resume(resume)
        except BaseException:
            venv.close(terminate=True)
            raise
    venv = _batch_observation_space(venv, observation_mode)
    agents = multi_agent_of(probe.metadata)
    if agents is None:
        return venv
    multi_agent: Any = MultiAgentVectorEnv(venv, agents)  # the overloads' types are single-agent
    return multi_agent


def _given_num_envs(env: Any, num_envs: Any) -> Any:
    """``num_envs`` as given, or what it defaults to (a list's length, else 1)."""
    if num_envs is not None:
        return num_envs
    return len(env) if isinstance(env, Sequence) and not isinstance(env, str) else 1


def _is_int(value: Any, low: int, high: int) -> bool:
    return (
        isinstance(value, numbers.Integral)
        and not isinstance(value, bool)
        and low <= int(value) <= high
    )


def _env_list(
    env: str | EnvFactory | Sequence[EnvFactory], env_kwargs: dict[str, Any] | None, num_envs: Any
) -> tuple[list[EnvFactory], int]:
    """One factory per env, and ``num_envs`` checked (default 1, or the list's length)."""
    env_fns, default_num_envs = env_factories(env, env_kwargs)
    if num_envs is None:
        num_envs = default_num_envs
    if isinstance(num_envs, bool) or not isinstance(num_envs, numbers.Integral) or num_envs < 1:
        raise ConfigError(f"num_envs must be an integer >= 1, got {num_envs!r}")
    num_envs = int(num_envs)
    if len(env_fns) == 1:
        env_fns = env_fns * num_envs
    elif len(env_fns) != num_envs:
        raise ConfigError(f"got {len(env_fns)} env factories for num_envs={num_envs}")
    return env_fns, num_envs


def _check_batching(num_envs: int, num_workers: Any, batch_size: Any) -> bool:
    """Check ``num_workers`` and ``batch_size``; returns whether make() builds a first-ready
    pool (``batch_size < num_envs``)."""
    if num_workers is not None and not _is_int(num_workers, 1, num_envs):
        raise ConfigError(f"num_workers must be an integer in [1, {num_envs}], got {num_workers!r}")
    if batch_size is not None and not _is_int(batch_size, 1, num_envs):
        raise ConfigError(f"batch_size must be None or an integer in [1, {num_envs}]")
    return batch_size is not None and batch_size < num_envs


def _check_observation_mode(observation_mode: Any) -> bool:
    """Check ``observation_mode``; returns whether it is a pair of spaces."""
    if isinstance(observation_mode, tuple) and len(observation_mode) == 2:
        if not all(isinstance(s_, gymnasium.Space) for s_ in observation_mode):
            raise ConfigError(
                "observation_mode: expected both elements of the pair to be Spaces, got "
                f"{[type(s_).__name__ for s_ in observation_mode]}"
            )
        return True
    if not (isinstance(observation_mode, str) and observation_mode in ("same", "different")):
        raise ConfigError(
            # gymnasium's text (its pair is (observation_space, single_observation_space))
            "Invalid `observation_mode`, expected: 'same' or 'different' or tuple of single "
            f"and batch observation space, actual got {observation_mode}"
        )
    return False


def _batch_observation_space(venv: FleetVectorEnv, observation_mode: Any) -> FleetVectorEnv:
    """Set ``venv``'s observation mode and, for a pair or ``"different"``, its batched
    observation space (closing it if the spaces cannot be batched)."""
    venv.observation_mode = observation_mode
    if isinstance(observation_mode, tuple):
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


def _native_vector_env(spec: BackendSpec, request: NativeRequest, copy: bool) -> FleetVectorEnv:
    """The vector env over a backend that builds its own envs (:attr:`BackendSpec.native`)."""
    assert spec.native is not None
    backend = spec.native(request)
    return FleetVectorEnv(
        backend,
        backend_name=spec.name,
        single_observation_space=backend.single_observation_space,
        single_action_space=backend.single_action_space,
        metadata=backend.metadata,
        render_mode=backend.render_mode,
        autoreset_mode=backend.autoreset_mode,
        step_timeout=None,
        copy=copy,
        batch_size=backend.batch_size,
    )
