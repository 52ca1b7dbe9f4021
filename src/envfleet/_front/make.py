"""make(): the front's one way in (layer 5 in docs/architecture.md). It checks make()'s own
arguments, looks the backend up in the registry (:mod:`envfleet._backends.registry`; it knows no
backend by name), lets the backend check its options and plan its workers, learns the spaces from
env 0 (built here, or, when the plan puts every env in a worker, in the worker that holds it: no env
is built in this process then), and wraps the backend the registry built in a
:class:`FleetVectorEnv`.
"""

from __future__ import annotations

import multiprocessing
import numbers
import os
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
from envfleet._backends.supervisor import DEFAULT_RESTART_POLICY, Ledger, RestartPolicy
from envfleet._core.buffers import batch_nbytes
from envfleet._core.cores import pool_workers, usable_cores
from envfleet._core.errors import ConfigError, EnvError, SpaceMismatchError
from envfleet._core.hangs import DEFAULT_HANG_REPORT_DELAY, check_hang_report_delay
from envfleet._core.replay import REPLAY_STEPS, Snapshot
from envfleet._front.factories import (
    EnvFactory,
    build_env,
    env_factories,
    pickle_factories,
)
from envfleet._front.multi_agent import multi_agent_factories, multi_agent_of
from envfleet._front.multi_agent_vector_env import MultiAgentVectorEnv
from envfleet._front.results import spare_slab_count
from envfleet._front.vector_env import FleetVectorEnv

if TYPE_CHECKING:
    from envfleet.torch import TorchVectorEnv

__all__ = ["BACKENDS", "DEFAULT_START_TIMEOUT", "make"]

DEFAULT_START_TIMEOUT = 60.0  # seconds for the workers to build their envs (make's start_timeout)


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
    hang_report_delay: float | None = DEFAULT_HANG_REPORT_DELAY,
    start_timeout: float | None = DEFAULT_START_TIMEOUT,
    restart_policy: RestartPolicy | None = DEFAULT_RESTART_POLICY,
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
    replay_steps: int = REPLAY_STEPS,
    recycle: Recycle | str | None = "auto",
    resume: Snapshot | None = None,
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
            A factory may return a ``pettingzoo.ParallelEnv`` instead: make() then returns an
            :class:`envfleet.MultiAgentVectorEnv` (agents batched with masks; see its layout),
            synchronous or a first-ready pool (``batch_size``); with ``output="torch"`` a
            torch vector env over it, in the same layout (``infos["agent_mask"]`` stays
            numpy). TorchRL's adapter refuses a multi-agent env.
        num_envs: number of sub-environments; default 1, or ``len(env)`` for a list.
        backend: ``"processes"`` (the default: worker processes over shared memory, every
            env isolated in a worker, none in this process), ``"ray"`` (Ray actors, on this
            machine or across a Ray cluster's nodes, with one envfleet helper per node that
            holds actors, which reads their stacks, replays and memory there: every node
            gives what this one does, on Linux; ``pip install 'envfleet[ray]'``),
            ``"serial"`` (every env in this process, stepped in turn) or ``"threads"`` (one
            thread per block of envs in this process; for envs that release the GIL).
            ``serial`` and ``threads`` are in-process by definition: an env's segfault or
            ``os._exit`` ends this process, and a hung env can be reported
            (``hang_report_delay``) but not stopped.
            ``"envpool"``: ``env`` is an EnvPool task id (``"CartPole-v1"``, ``"Pong-v5"``;
            ``envpool.list_all_envs()``) run by EnvPool's native threads, ``env_kwargs`` go
            to ``envpool.make``; only ``num_envs``, ``batch_size``, ``autoreset_mode``,
            ``env_kwargs`` and ``copy`` apply (the EnvPool backend's page,
            ``docs/backends/envpool.md``, says what maps and what is refused;
            ``pip install 'envfleet[envpool]'``).
        num_workers: worker count, ``1 <= num_workers <= num_envs``; envs go to workers in
            contiguous blocks whose sizes differ by at most one. ``processes``: worker
            processes, default ``min(num_envs, usable cores)`` (usable cores - 1 with an
            opt-in ``driver_envs`` share); ``threads``: threads, default ``min(num_envs, usable
            cores)``; ``serial``: blocks stepped in turn, default 1; ``ray``: actors,
            default ``min(num_envs, the Ray cluster's CPUs)`` (a local cluster envfleet
            starts has the usable cores). Usable cores: those this process may run on, the
            smaller of its CPU affinity (``taskset``, ``os.sched_setaffinity``) and its
            cgroup v2 ``cpu.max`` quota rounded up (a container's CPU limit), at least 1;
            never the host's ``os.cpu_count()``.
            Envs that compute (their step keeps a core busy: CartPole, Atari) and envs that
            wait (on a simulator, a game server, a robot, a browser: no CPU used meanwhile)
            need no setting: each ``processes`` worker (and Ray actor) learns which from its
            envs' first steps, and steps and resets its block one env after another while
            they compute, all at once (a thread per env in the worker, up to 1,024, results
            still in env order) while they wait; see ``envs.stats.env_kind`` and
            ``docs/backends/local.md``.
        batch_size: ``None`` or ``num_envs``: synchronous. ``1 <= batch_size < num_envs``: a
            first-ready pool, EnvPool's asynchronous interface: :meth:`~FleetVectorEnv.
            async_reset`, :meth:`~FleetVectorEnv.send` and :meth:`~FleetVectorEnv.recv`, which
            returns the first ``batch_size`` envs to finish, with ``info["env_id"]``. On
            ``processes`` with no ``num_workers``, each env is a group of its own, handed
            back when it finishes, and the groups are hosted by a worker process per usable
            core (as EnvPool runs a thread per core): each process steps its envs in turns
            while they compute, and on a thread each once one is seen to wait (or a step
            runs 5 ms), so that a straggler holds up no other env; supervision stays per env
            (``ENVFLEET_POOL_LAYOUT=blocks``: blocks as below). Given ``num_workers``, or on
            ``threads``, a worker hands its block of envs back together, and a pool has by
            default the most threads, up to the usable cores, whose equal blocks fill a
            batch exactly (one env per worker where no such count exists).
            ``num_workers=num_envs`` puts one env in each worker process, at the cost of a
            process wake-up on each side of every env step and more processes than cores
            taking turns.
        autoreset_mode: a ``gymnasium.vector.AutoresetMode`` (or its string value).
        env_kwargs: keyword arguments for ``gymnasium.make``; only with a gymnasium id.
        step_timeout: seconds any step, reset or call may take before the workers still busy
            are killed and :class:`envfleet.StepTimeoutError` is raised; ``None``: no bound.
            With a timeout every env must run in a worker (``driver_envs=0``).
            Building the envs at start is bounded by ``start_timeout`` instead.
        hang_report_delay: seconds a step, reset, call (``get_attr``, ``set_attr``...),
            ``recv`` or Sampler round may wait on busy envs before an
            :class:`envfleet.HangWarning` names each busy env (its index), its worker and its
            stacks; it warns again after twice the delay, four times, ... while the call
            keeps waiting (default 60). Nothing is killed: ``step_timeout`` does that, and
            the two are independent. Envs run in the calling thread (``serial``, the
            ``processes`` driver's own block) are watched by one daemon thread of this
            process. ``None``: no reports. To silence them everywhere::

                warnings.simplefilter("ignore", envfleet.HangWarning)

            A ``KeyboardInterrupt`` (Ctrl-C) while a call waits on envs carries a note
            (``exc.__notes__``) naming the busy envs and their stacks, whatever this is, and
            is raised once the interrupted call has completed (a pool's ``recv``: undone),
            within ``step_timeout`` or 5 s: the vector env stays usable, ``snapshot()``
            works in the ``except`` block (a second Ctrl-C closes it at once).
        start_timeout: seconds the workers (processes, threads, Ray actors) may take to build
            their envs (default 60); past it the workers are killed (threads are left
            behind, as daemons) and :class:`envfleet.StartTimeoutError` names the envs not
            built. A worker replaced later (``restart_policy``, ``recycle``) builds its envs
            within it too (not ``step_timeout``); past it the vector env closes with
            :class:`envfleet.StartTimeoutError`. ``None``: wait for good. Envs built in the
            calling thread are not bounded:
            env 0 where it is built here first, to learn the spaces (see ``driver_envs``),
            the ``processes`` driver's own block and every ``serial`` env. A worker that dies
            while starting is reported at once.
        restart_policy: default ``RestartPolicy()``: a worker that dies (a signal,
            ``os._exit``, SIGKILL, an OOM kill, a lost Ray actor) or runs past
            ``step_timeout`` is rebuilt, and an env that loses its connection to a simulator
            (``ConnectionError``, ``BrokenPipeError``, ``TimeoutError``) too, within a budget
            of 10 restarts a minute; each restart warns :class:`envfleet.EnvRestartedWarning`,
            only the env that was running loses its episode (``truncated=True``,
            ``info["env_restarted"]``) and every other env continues exactly. Any other
            exception an env raises raises, as in gymnasium. ``None``: fail fast (a typed
            error names what failed). See :class:`envfleet.RestartPolicy`. An explicit policy
            needs every env in a worker on ``processes`` (``driver_envs=0``); the default
            restarts nothing where envs run in the driver (an opt-in ``driver_envs`` share,
            ``envpool``).
        context: ``multiprocessing`` start method (``"fork"``, ``"spawn"``, ``"forkserver"``);
            default: the platform's.
        copy: ``True``: step/reset return observations, rewards and done flags that are the
            caller's, like gymnasium's copies; no later call changes them. With the
            ``serial``, ``threads`` and ``processes`` backends (outside a first-ready pool)
            the observations are not copied: the envs write each step's into a spare buffer
            that no earlier result uses, and the arrays returned are built over it (spare
            copies of the observation buffer, reused in turn). ``False``: views of the shared
            buffers, valid until the next call.
        driver_envs: ``processes`` only: how many envs (the first block) the driver steps
            itself while the workers step theirs. Default 0: every env in a worker. An
            opt-in for envs of a few µs a step on few cores (CartPole), where it saves the
            driver's idle wait on each round (``num_envs // usable cores`` is an equal share;
            see ``docs/benchmarks.md`` for what it buys), and none for real envs (Atari). What
            it trades: those envs live in the learner's process, so their exceptions are
            reported as usual, but a native crash in them (a segfault) takes the learner down,
            no ``step_timeout`` can stop them, and no restart policy or recycling can replace
            them (both refuse a share). Such a fatal signal (SIGSEGV,
            SIGBUS, SIGFPE, SIGILL, SIGABRT) first writes to stderr the env's index (with the
            C extension built) and the faulting Python frame (:mod:`faulthandler`, enabled
            unless you enabled it yourself, then chained to), and the process dies of it.
            Which envs are built in the driver's process: with every env in a worker
            (``driver_envs=0``, the default; ``ray`` always) none: the worker that holds env 0 sends
            its spaces, ``metadata`` and ``render_mode``, so a simulator that cannot be built
            twice, or not in the learner's process, is built once, in its worker. Otherwise
            env 0 is built here first, as gymnasium's vector envs build it, to learn them
            (and kept as the driver's env 0 when the driver steps a share). ``serial`` and
            ``threads`` run every env in this process: out of scope. Example::

                envs = envfleet.make(make_simulator, 8)  # no env built or stepped here
                assert envs.single_observation_space  # from env 0, built in worker 0
                tiny = envfleet.make("CartPole-v1", 16, driver_envs=8)  # opt-in share
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
        replay_steps: the steps each env's record keeps (default 1000), from which an
            :class:`envfleet.EnvError` (in ``step`` or ``reset``), an
            :class:`envfleet.EnvCrashedError` and a :class:`envfleet.StepTimeoutError` carry a
            :class:`envfleet.Replay` of the failing episode (``err.replay``; see
            :func:`envfleet.replay`). The record costs one copy of each worker's action rows
            per step and ``replay_steps`` of them in memory per worker (1000 steps of 8
            CartPole actions: 64 KB), plus 32 KiB per env. An env is checkpointed every
            ``replay_steps // 2`` steps of an episode (its whole state, where it pickles;
            ``docs/concepts/supervision.md``), so its record never needs more; an env whose
            state does not pickle (Box2D's) is not replayable past ``replay_steps`` in an
            episode. ``0``: no record, ``err.replay`` is ``None``.
            Not for ``envpool``.
        recycle: ``"auto"`` (the default): on ``processes``, synchronous, every env in a
            worker, a worker past its share of the memory (0.8 of the machine's, or a
            container's limit, over the workers) is replaced between episodes, before the
            OOM killer comes (:func:`~envfleet._backends.recycle.default_recycle` says why);
            nothing elsewhere. An :class:`envfleet.Recycle` (``processes`` or ``ray``, on
            every node, synchronous) replaces each worker past its limits (episodes, steps,
            resident memory) between episodes, its envs continuing exactly where they were;
            every env must run in a worker (``driver_envs=0``, the default). Needs
            ``replay_steps > 0`` (the record the new worker's envs are brought up to date
            from). ``None``: never.
        resume: an :class:`envfleet.Snapshot` (``envs.snapshot()``, from any backend and
            worker count, of the same ``num_envs`` and ``autoreset_mode``): the new vector
            env's envs are brought to where the snapshot's were, and its next ``step``
            continues that run exactly (no ``reset`` first); a first-ready pool's
            (``batch_size``) returns the snapshot's results waiting for ``recv`` first.

    Returns:
        A :class:`FleetVectorEnv`, a ``gymnasium.vector.VectorEnv``; a
        :class:`envfleet.torch.TorchVectorEnv` over one for ``output="torch"``; a
        :class:`envfleet.MultiAgentVectorEnv` over one for PettingZoo parallel envs.

    Raises:
        ConfigError: any bad argument above (an unknown backend, an option of another
            backend or one the backend refuses), an unknown gymnasium id, an unpicklable factory
            for ``processes`` or ``ray``, a bad ``observation_mode``;
            ``ray`` not installed, Ray not reachable, or actors asking for more resources
            than the Ray cluster has.
        SpaceMismatchError: the sub-environments' spaces differ (see ``observation_mode``;
            also a ``RuntimeError``, as gymnasium raises).
        EnvError: a factory raised (``method == "make"``).
        EnvCrashedError: a worker died while building its envs; under ``context="spawn"``
            or ``"forkserver"``, also one that could not start because the main module starts
            workers when imported (no ``if __name__ == "__main__":`` guard), which its message
            says, naming the fix.
    """
    if output != "numpy" or device is not None or pin_memory:
        arguments = dict(locals())  # make()'s arguments, every one
        from envfleet.torch import make_with_output

        return make_with_output(make, arguments)
    if not _is_int(replay_steps, 0, 2**31):
        raise ConfigError(f"replay_steps must be an integer >= 0, got {replay_steps!r}")
    hang_report_delay = check_hang_report_delay(hang_report_delay)
    auto_recycle = isinstance(recycle, str) and recycle == "auto"
    if auto_recycle:
        recycle = None  # the default bound, once the plan gives the workers (below)
    elif recycle is not None:
        _check_recycle(recycle, backend, batch_size, num_envs, replay_steps, driver_envs)
    spec = lookup(backend)
    if restart_policy is DEFAULT_RESTART_POLICY and (spec.native is not None or driver_envs):
        restart_policy = None  # envs the driver runs (a share, EnvPool's threads): none rebuilt
    options = spec.own_options(
        {"driver_envs": driver_envs, "spin_s": spin_s}
        | {"ray_address": ray_address, "ray_options": ray_options},
        {"num_workers": num_workers, "step_timeout": step_timeout, "context": context}
        | {"restart_policy": restart_policy}
        | {"observation_mode": None if observation_mode == "same" else observation_mode},
    )
    if spec.native is not None:
        native = NativeRequest(env, num_envs, batch_size, autoreset_mode, env_kwargs)
        return _native_vector_env(spec, native, copy)
    env_fns, num_envs = _env_list(env, env_kwargs, num_envs)
    pool = _check_batching(num_envs, num_workers, batch_size)
    if pool and num_workers is None and batch_size is not None and not _hosts_pool(spec.name):
        num_workers = pool_workers(num_envs, batch_size, usable_cores())
    mode = _check_mode(autoreset_mode, pool)
    if resume is not None:  # before any worker starts
        Snapshot.check(resume, num_envs, mode.value, pool)
    _check_limits(start_timeout, step_timeout, restart_policy, context)
    explicit = _check_observation_mode(observation_mode)
    plan = spec.plan(
        PlanRequest(num_envs, num_workers, pool, step_timeout, restart_policy, options)
    )
    if auto_recycle and spec.name == "processes" and not pool and replay_steps and not driver_envs:
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
        report_hangs(hang_report_delay)
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
        step_timeout=None if step_timeout is None else float(step_timeout),
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


def _check_recycle(
    recycle: Any,
    backend: str,
    batch_size: Any,
    num_envs: Any,
    replay_steps: int,
    driver_envs: int | None,
) -> None:
    """Check ``recycle=`` against the other arguments (on processes every env must be in a
    worker: the default)."""
    if not isinstance(recycle, Recycle):
        raise ConfigError(f"recycle must be None or an envfleet.Recycle, got {recycle!r}")
    if backend not in ("processes", "ray"):
        raise ConfigError(
            f"recycle= is for backend='processes' or 'ray' (got {backend!r}): serial and "
            "threads envs live in this process, which replacing a worker does not shrink"
        )
    if batch_size is not None and batch_size != num_envs:
        raise ConfigError("recycle= is for the synchronous vector env, not a first-ready pool")
    if replay_steps == 0:
        raise ConfigError(
            "recycle= brings a new worker's envs up to date from their record: it needs "
            "replay_steps > 0"
        )
    if driver_envs not in (None, 0):
        raise ConfigError(
            "recycle= replaces worker processes: the driver's own envs (driver_envs) could "
            "not be; leave driver_envs unset or 0"
        )


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


def _hosts_pool(backend: str) -> bool:
    """Whether ``backend`` lays a first-ready pool out itself when no ``num_workers`` is
    given: ``processes`` puts each env in a group of its own, the groups hosted a core's
    worth to a worker process, so that each env is handed back when it finishes
    (``ENVFLEET_POOL_LAYOUT=blocks``: a block per worker, handed back whole, as before)."""
    return backend == "processes" and os.environ.get("ENVFLEET_POOL_LAYOUT", "") != "blocks"


def _check_batching(num_envs: int, num_workers: Any, batch_size: Any) -> bool:
    """Check ``num_workers`` and ``batch_size``; returns whether make() builds a first-ready
    pool (``batch_size < num_envs``)."""
    if num_workers is not None and not _is_int(num_workers, 1, num_envs):
        raise ConfigError(f"num_workers must be an integer in [1, {num_envs}], got {num_workers!r}")
    if batch_size is not None and not _is_int(batch_size, 1, num_envs):
        raise ConfigError(f"batch_size must be None or an integer in [1, {num_envs}]")
    return batch_size is not None and batch_size < num_envs


def _check_mode(autoreset_mode: AutoresetMode | str, pool: bool) -> AutoresetMode:
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
    return mode


def _check_limits(
    start_timeout: float | None,
    step_timeout: float | None,
    restart_policy: RestartPolicy | None,
    context: str | None,
) -> None:
    """Check the timeouts, the restart policy and the start method."""
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
        # multiprocessing's own words first: the message its users (and SB3's tests) match.
        raise ConfigError(
            f"cannot find context for {context!r}: context={context!r} is not a start method "
            f"here; choose from {multiprocessing.get_all_start_methods()}"
        )


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
