"""The learner's loop of ``envfleet bench --policy``: every system of :data:`POLICY_SYSTEMS`
stepped with a torch policy choosing the actions, against two bounds (see
:mod:`envfleet.bench`, which re-exports it): the overlap bound (:func:`overlap_bound`: one
policy call on the whole batch overlapping the envs, which no loop reaches) and the schedule
bound (:func:`schedule_bound`: the best of the structures a loop can take, from the policy's
time on whole and split batches).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import gymnasium
import numpy as np

import envfleet
from envfleet import ConfigError, check_gymnasium_id, usable_cores
from envfleet.bench._core import ACTION_BANK, bench_error, check_args, json_ready
from envfleet.bench._peers import PEER_INSTALL, PUFFER_INSTALL, EnvPoolVector, envpool_task
from envfleet.bench._policies import (
    TorchPolicy,
    check_workload,
    require_torch,
)
from envfleet.bounds import (
    groups_bound,
    one_call_bound,
    overlap_bound,
    schedule_bound,
    schedule_sizes,
    schedule_splits,
    schedule_structures,
    time_policy,
    workers_bound,
)

__all__ = [
    "POLICY_SYSTEMS",
    "PUFFER_INSTALL",
    "ROLLOUT_STEPS",
    "STORE_SYSTEMS",
    "PolicyBound",
    "PolicyLoopReport",
    "PolicyLoopResult",
    "groups_bound",
    "measure_bound",
    "measure_policy_loop",
    "one_call_bound",
    "overlap_bound",
    "policy_report_dict",
    "policy_table",
    "schedule_bound",
    "schedule_sizes",
    "schedule_splits",
    "schedule_structures",
    "time_in_loop",
    "workers_bound",
]

#: The systems of the learner's-loop benchmark, in the order of its table. A ``*-store`` system
#: is the plain loop of the system before it storing what a learner keeps
#: (:data:`STORE_SYSTEMS`).
POLICY_SYSTEMS: tuple[str, ...] = (
    "gym-sync",
    "gym-sync-store",
    "gym-async",
    "gym-async-store",
    "puffer-sync",
    "puffer-sync-store",
    "puffer-async",
    "envpool",
    "envpool-store",
    "envfleet",
    "envfleet-store",
    "envfleet-pool",
    "sampler",
    "sampler-driver",
    "sampler-worker",
)
#: The storing plain loops, the loop a learner writes (CleanRL's rollout): each step, the
#: observations the policy saw, its actions, the rewards and the dones (``terminated |
#: truncated``) written into preallocated arrays of shape ``[T, N, ...]``
#: (``T =`` :data:`ROLLOUT_STEPS`, wrapping around).
STORE_SYSTEMS: tuple[str, ...] = tuple(s for s in POLICY_SYSTEMS if s.endswith("-store"))
#: ``T``, the steps a storing loop's arrays hold before it wraps around (CleanRL's PPO default).
ROLLOUT_STEPS = 128
_GYM_LOOPS = ("gym-sync", "gym-async")
_PEER_LOOPS = (*_GYM_LOOPS, "puffer-sync", "puffer-async", "envpool")
# An Atari workload's frames as EnvPool makes them (its defaults: 4 frames skipped and
# max-pooled, no fire reset, no life loss as an end, no reward clipping), as the workload's
# gymnasium wrappers make them: 84x84 gray, 4 stacked, at most 30 no-ops at a reset.
_ENVPOOL_AS_TRAINED = {
    "img_height": 84,
    "img_width": 84,
    "gray_scale": True,
    "stack_num": 4,
    "noop_max": 30,
}


@dataclass(frozen=True)
class PolicyBound:
    """The measured bounds of one workload: the overlap bound (:func:`overlap_bound`) and the
    schedule bound (:func:`schedule_bound`).

    Attributes:
        t_policy_s: median seconds of the policy on one batch of ``num_envs`` observations.
        t_env_s: seconds per step of one env in a plain loop (autoresetting, random actions).
        cores: cores this process may use.
        steps_per_s: the overlap bound, env steps per second.
        t_policy_by_n: median seconds of the policy on a batch of ``n`` observations, for each
            ``n`` of :func:`schedule_sizes` (``N``, ``N // 2``, ``N // 4``...); ``n = N`` is
            ``t_policy_s``.
        schedule_steps_per_s: the schedule bound, env steps per second.
        schedule_structure: the structure that attains it (a key of ``structures``).
        structures: each structure's bound, env steps per second
            (:func:`schedule_structures`).
        t_policy_loop_by_n: the policy's mean seconds per call on ``n`` observations *in a
            loop*: ``n`` envs of the workload stepped in this process, each call followed by
            their ``n`` steps (:func:`time_in_loop`), for each ``n`` of ``t_policy_by_n``.
        t_env_loop_s: one env's mean seconds per step in those loops.
        loop_steps_per_s: the schedule bound of those times (:func:`schedule_bound`): what
            the structures can do with the policy and the envs as they cost when they take
            turns on a core (each evicts the other's caches), not each alone.
        loop_structure: the structure that attains it.
    """

    t_policy_s: float
    t_env_s: float
    cores: int
    steps_per_s: float
    t_policy_by_n: dict[int, float] = field(default_factory=dict)
    schedule_steps_per_s: float = math.nan
    schedule_structure: str = ""
    structures: dict[str, float] = field(default_factory=dict)
    t_policy_loop_by_n: dict[int, float] = field(default_factory=dict)
    t_env_loop_s: float = math.nan
    loop_steps_per_s: float = math.nan
    loop_structure: str = ""


@dataclass(frozen=True)
class PolicyLoopResult:
    """One system's throughput in the learner's loop on one workload.

    Attributes:
        system: a name from :data:`POLICY_SYSTEMS`.
        steps_per_s: median over repetitions of env steps per second (``nan`` when skipped).
        of_bound: ``steps_per_s`` over the workload's overlap bound.
        vs_best_gym: median over repetitions of this system's steps/s over the faster of
            gymnasium's two loops in the same repetition (``nan`` without a gymnasium loop).
        vs_best_peer: the same over the fastest peer loop of the repetition: gymnasium's
            two and PufferLib's two (``nan`` without any).
        vs_envfleet_loop: the same over envfleet's plain loop (``envfleet``) of the
            repetition (``nan`` without it).
        of_schedule_bound: ``steps_per_s`` over the workload's schedule bound.
        vs_envfleet_store: the same as ``vs_best_gym`` over envfleet's storing plain loop
            (``envfleet-store``, the loop a learner writes) of the repetition (``nan``
            without it).
        of_loop_bound: ``steps_per_s`` over the workload's loop bound
            (:attr:`PolicyBound.loop_steps_per_s`).
        runs: steps/s of each repetition.
        skipped: why the system was not measured (e.g. how to install it), else ``None``.
        notes: per repetition, what the system said of itself (``sampler``: the inference
            its calibration chose and why, from :meth:`envfleet.Sampler.report`).
    """

    system: str
    steps_per_s: float
    of_bound: float
    vs_best_gym: float
    runs: tuple[float, ...]
    skipped: str | None = None
    notes: tuple[str, ...] = ()
    vs_best_peer: float = math.nan
    vs_envfleet_loop: float = math.nan
    of_schedule_bound: float = math.nan
    vs_envfleet_store: float = math.nan
    of_loop_bound: float = math.nan


@dataclass(frozen=True)
class PolicyLoopReport:
    """The learner's-loop measurement of one workload: its bound and one row per system.

    Attributes:
        env_id, num_envs, policy: the workload (``policy`` is ``"mlp"`` or ``"cnn"``).
        seconds: timed seconds per system and repetition.
        repeats: repetitions (systems interleaved within each).
        bound: the measured :class:`PolicyBound` (overlap and schedule bounds).
        results: one :class:`PolicyLoopResult` per system, in the order asked.
        auto_kept: where ``sampler``, ``sampler-driver`` and ``sampler-worker`` all ran:
            (repetitions in which the default Sampler's ``"auto"`` chose the mode that ran
            faster in that repetition, repetitions); else ``None``.
    """

    env_id: str
    num_envs: int
    policy: str
    seconds: float
    repeats: int
    bound: PolicyBound
    results: tuple[PolicyLoopResult, ...]
    auto_kept: tuple[int, int] | None = None


def measure_policy_loop(
    workload: Any,
    systems: Sequence[str] = POLICY_SYSTEMS,
    seconds: float = 2.0,
    *,
    repeats: int = 1,
    seed: int = 0,
    warmup_s: float = 0.25,
    progress: Callable[[str, str, int], None] | None = None,
    device: str = "cpu",
) -> PolicyLoopReport:
    """Measure the learner's loop (observations -> torch policy -> step) of every system.

    Each system is built, warmed up, timed for ``seconds`` and closed; within a repetition
    the systems run one after the other, and each repetition starts one system later (so no
    system always follows the same one). The bounds are measured first (:func:`measure_bound`).
    A PufferLib system is skipped, with :data:`PUFFER_INSTALL` as its reason, when pufferlib is
    missing; an EnvPool system (``envpool``, ``envpool-store``: EnvPool's own gymnasium API,
    :class:`EnvPoolVector`, in the plain and the storing loop, CleanRL's
    ``ppo_atari_envpool.py`` rollout) when EnvPool is missing or has no task for the workload
    (:func:`envpool_workload_task`).

    Loops: ``gym-*``, ``puffer-sync``, ``envpool``, ``envfleet``: ``actions = policy(obs)``,
    ``obs = envs.step(actions)[0]``; their ``*-store`` twins (:data:`STORE_SYSTEMS`, the loop
    a learner writes) also write ``obs``, ``actions``, the rewards and the dones into
    ``[T, N, ...]`` arrays (``T =`` :data:`ROLLOUT_STEPS`); ``envfleet-pool``
    (``batch_size = num_envs // 2``) and
    ``puffer-async``: ``recv`` -> policy -> ``send``; ``sampler``, ``sampler-*``:
    ``Sampler.sample(64 * num_envs)`` (``sampler`` is the default, ``inference="auto"``, its
    calibration done before the warm-up; ``sampler-driver`` and ``sampler-worker`` ask for
    one mode). Every loop counts transitions: the plain and first-ready loops autoreset in
    the step after an episode's end (gymnasium's ``NEXT_STEP``, PufferLib's), which returns
    the reset observation and ignores the action, and that step is not counted (about one
    step in 20 of CartPole's under an untrained policy); the Sampler returns transitions
    only (``SAME_STEP``).

    Args:
        workload: a :class:`Workload` (see :func:`workloads`).
        systems: names from :data:`POLICY_SYSTEMS`.
        seconds: timed seconds per system and repetition (> 0).
        repeats: repetitions (>= 1); steps/s and ratios are medians over them.
        seed: seed of the envs' reset and of the policy.
        warmup_s: untimed seconds before each timed window (capped at ``seconds / 2``).
        progress: called with ``(workload name, system, repetition)`` before each system.
        device: the torch device of the policy (``"cpu"``; ``"cuda"`` where a GPU is: the
            Sampler's default then runs driver inference, and ``sampler-worker`` fails).

    Returns:
        A :class:`PolicyLoopReport`.

    Raises:
        ConfigError: torch, ale-py or OpenCV missing (the message says how to install it),
            an unknown env id or system, bad numbers.
        BenchError: a system failed while being built or run.
    """
    require_torch()
    check_gymnasium_id(workload.env_id)
    check_workload(workload)
    check_args(workload.num_envs, seconds, warmup_s)
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ConfigError(f"repeats must be an integer >= 1, got {repeats!r}")
    for system in systems:
        if system not in POLICY_SYSTEMS:
            raise ConfigError(
                f"unknown system {system!r}; available systems: {', '.join(POLICY_SYSTEMS)}"
            )
    systems = list(dict.fromkeys(systems))
    if not systems:
        raise ConfigError("no system to measure")
    bound = measure_bound(workload, seed=seed, device=device)
    skipped = {s: PUFFER_INSTALL for s in systems if s.startswith("puffer") and not _has_puffer()}
    if envpool_workload_task(workload) is None:
        why = _envpool_missing(workload)
        skipped.update({s: why for s in systems if s.startswith("envpool")})
    active = [s for s in systems if s not in skipped]
    runs: dict[str, list[float]] = {s: [] for s in active}
    notes: dict[str, list[str]] = {s: [] for s in active}
    # Per system, per repetition: its steps/s over the best gymnasium loop, the best peer
    # loop and envfleet's plain loop of that repetition (machines drift between repetitions).
    ratios: dict[str, list[float]] = {s: [] for s in active}
    peer_ratios: dict[str, list[float]] = {s: [] for s in active}
    loop_ratios: dict[str, list[float]] = {s: [] for s in active}
    store_ratios: dict[str, list[float]] = {s: [] for s in active}
    judged = all(s in active for s in ("sampler", "sampler-driver", "sampler-worker"))
    kept = 0  # repetitions where "auto" chose the mode that ran faster
    chosen = ""  # the mode "auto" ran in this repetition
    for rep in range(repeats):
        shift = rep % len(active) if active else 0
        for system in active[shift:] + active[:shift]:
            if progress is not None:
                progress(workload.name, system, rep)
            rate, note = _measure_loop(
                workload,
                system,
                seconds,
                min(warmup_s, seconds / 2),
                seed,
                device,
                bound.t_policy_by_n,
            )
            runs[system].append(rate)
            if note:
                notes[system].append(note)
            if system == "sampler":
                chosen = note.split(" ", 1)[0]  # "driver" or "worker" (inference, ...)
        if judged:
            worker_won = runs["sampler-worker"][-1] > runs["sampler-driver"][-1]
            kept += int(chosen == ("worker" if worker_won else "driver"))
        best_gym = max((runs[s][-1] for s in _GYM_LOOPS if s in runs), default=math.nan)
        best_peer = max((runs[s][-1] for s in _PEER_LOOPS if s in runs), default=math.nan)
        plain = runs["envfleet"][-1] if "envfleet" in runs else math.nan
        store = runs["envfleet-store"][-1] if "envfleet-store" in runs else math.nan
        for system in active:
            ratios[system].append(runs[system][-1] / best_gym)
            peer_ratios[system].append(runs[system][-1] / best_peer)
            loop_ratios[system].append(runs[system][-1] / plain)
            store_ratios[system].append(runs[system][-1] / store)
    results = []
    for system in systems:
        if system in skipped:
            nan = math.nan
            results.append(PolicyLoopResult(system, nan, nan, nan, (), skipped[system]))
            continue
        rate = _median(runs[system])
        results.append(
            PolicyLoopResult(
                system,
                rate,
                rate / bound.steps_per_s,
                _median(ratios[system]),
                tuple(runs[system]),
                notes=tuple(notes[system]),
                vs_best_peer=_median(peer_ratios[system]),
                vs_envfleet_loop=_median(loop_ratios[system]),
                of_schedule_bound=rate / bound.schedule_steps_per_s,
                vs_envfleet_store=_median(store_ratios[system]),
                of_loop_bound=rate / bound.loop_steps_per_s,
            )
        )
    return PolicyLoopReport(
        workload.env_id,
        workload.num_envs,
        workload.policy,
        float(seconds),
        repeats,
        bound,
        tuple(results),
        (kept, repeats) if judged else None,
    )


def policy_report_dict(report: PolicyLoopReport) -> dict[str, Any]:
    """A learner's-loop report as a JSON-ready dict (``nan`` becomes ``None``): the fields of
    :class:`PolicyLoopReport`, ``bound`` and ``results`` nested as dicts."""

    return dict(json_ready(asdict(report)))


def policy_table(report: PolicyLoopReport) -> str:
    """A learner's-loop report as Markdown: a line on the workload and its two bounds (the
    schedule bound with the structure that attains it, and ``T_p(n)`` at each size), then a
    table of ``system | steps/s | of overlap bound | of schedule bound | vs best gym | vs best
    peer | vs envfleet loop | vs envfleet store`` (a skipped system says why; the ratios are
    medians of each repetition's). The storing loops (:data:`STORE_SYSTEMS`) are marked
    ``(the loop a learner writes)``."""
    b = report.bound
    t_policy = ", ".join(f"T_p({n}) = {t * 1e6:,.0f} us" for n, t in b.t_policy_by_n.items())
    in_loop = ", ".join(f"{t * 1e6:,.0f} us" for t in b.t_policy_loop_by_n.values())
    lines = [
        f"{report.env_id} x{report.num_envs}, {report.policy} policy: overlap bound "
        f"{b.steps_per_s:,.0f} steps/s, schedule bound {b.schedule_steps_per_s:,.0f} steps/s "
        f"({b.schedule_structure}); {t_policy}, t_env = {b.t_env_s * 1e6:,.1f} us, "
        f"{b.cores} cores; loop bound {b.loop_steps_per_s:,.0f} steps/s ({b.loop_structure}; "
        f"in a loop T_p = {in_loop}, t_env = {b.t_env_loop_s * 1e6:,.1f} us); "
        f"{report.seconds:g} s per system, {report.repeats} repetition(s), medians",
        "",
        "| system | steps/s | of overlap bound | of schedule bound | of loop bound | vs best gym "
        "| vs best peer | vs envfleet loop | vs envfleet store |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in report.results:
        name = r.system + (f" {_LEARNER_MARK}" if r.system in STORE_SYSTEMS else "")
        if r.skipped is not None:
            lines.append(f"| {name} | not installed: {r.skipped} | - | - | - | - | - | - | - |")
        else:
            lines.append(
                f"| {name} | {r.steps_per_s:,.0f} | {r.of_bound:.2f} "
                f"| {r.of_schedule_bound:.2f} | {r.of_loop_bound:.2f} | {r.vs_best_gym:.2f} "
                f"| {r.vs_best_peer:.2f} | {r.vs_envfleet_loop:.2f} "
                f"| {r.vs_envfleet_store:.2f} |"
            )
    if any(r.system in STORE_SYSTEMS for r in report.results):
        lines += [
            "",
            "The loop a learner writes (*-store): the system's plain loop, also writing each "
            "step's observations, actions, rewards and dones into preallocated [T, N, ...] "
            f"arrays (T = {ROLLOUT_STEPS}, CleanRL's rollout); vs envfleet store: steps/s over "
            "envfleet-store's in the same repetition",
        ]
    chosen = [(r.system, note) for r in report.results for note in dict.fromkeys(r.notes)]
    if chosen:
        lines.append("")
        lines += [f"{system}: {note}" for system, note in chosen]
    if report.auto_kept is not None:
        kept, repeats = report.auto_kept
        lines += [
            "",
            f'sampler ("auto"): chose the mode that ran faster in the same repetition '
            f"(sampler-driver against sampler-worker) in {kept} of {repeats} repetitions",
        ]
    return "\n".join(lines) + "\n"


#: How the table marks a storing loop.
_LEARNER_MARK = "(the loop a learner writes)"


def measure_bound(
    workload: Any, *, seed: int = 0, seconds: float = 0.5, device: str = "cpu"
) -> PolicyBound:
    """Measure ``T_p(n)`` and ``t_env`` of a workload, and its overlap and schedule bounds.

    ``T_p(n)``, for each ``n`` of :func:`schedule_sizes` (``N``, ``N // 2``, ``N // 4``): the
    median time of the policy on a batch of ``n`` observations (one env's reset observation
    repeated), over about ``seconds`` each, after a few untimed calls. ``t_env``: one env
    stepped in a plain loop with random actions drawn in advance (reset at each episode's end)
    for about ``seconds``, its seconds per step. The loop bound: the same structures with the
    costs of :func:`time_in_loop` at each ``n``.

    Raises:
        ConfigError: torch missing. BenchError: the env failed.
    """
    try:
        env = workload.factory()()
    except Exception as exc:
        raise bench_error(exc, "building", "bound", workload.env_id) from exc
    try:
        obs, _ = env.reset(seed=seed)
        policy = TorchPolicy(workload.policy, env.observation_space, env.action_space, seed, device)
        batch = np.repeat(np.asarray(obs)[None], workload.num_envs, axis=0)
        sizes = schedule_sizes(workload.num_envs, usable_cores())
        t_policy_by_n = {n: time_policy(policy, batch[:n], seconds) for n in sizes}
        env.action_space.seed(seed)
        bank = [env.action_space.sample() for _ in range(ACTION_BANK)]
        steps = 0
        t0 = time.perf_counter()
        while True:
            for _ in range(16):
                _, _, terminated, truncated, _ = env.step(bank[steps % ACTION_BANK])
                steps += 1
                if terminated or truncated:
                    env.reset()
            elapsed = time.perf_counter() - t0
            if elapsed >= seconds:
                break
        t_env = elapsed / steps
    except ConfigError:
        raise
    except Exception as exc:
        raise bench_error(exc, "measuring the bound of", "bound", workload.env_id) from exc
    finally:
        env.close()
    cores = usable_cores()
    n = workload.num_envs
    t_policy = t_policy_by_n[n]
    structures = schedule_structures(n, t_policy_by_n, t_env, cores)
    best, structure = schedule_bound(n, t_policy_by_n, t_env, cores)
    in_loop = {k: time_in_loop(workload, k, policy, seed, seconds) for k in sizes}
    t_policy_loop = {k: t_p for k, (t_p, _, _) in in_loop.items()}
    env_steps = sum(steps for _, _, steps in in_loop.values())
    t_env_loop = sum(t_e * steps for _, t_e, steps in in_loop.values()) / env_steps
    loop_best, loop_structure = schedule_bound(n, t_policy_loop, t_env_loop, cores)
    return PolicyBound(
        t_policy,
        t_env,
        cores,
        overlap_bound(n, t_policy, t_env, cores),
        t_policy_by_n,
        best,
        structure,
        structures,
        t_policy_loop,
        t_env_loop,
        loop_best,
        loop_structure,
    )


def time_in_loop(
    workload: Any, n: int, policy: Callable[[Any], Any], seed: int, seconds: float
) -> tuple[float, float, int]:
    """The policy and ``n`` envs of ``workload`` taking turns in this process for about
    ``seconds``: the policy on the ``n`` observations, then each env's step with its action
    (reset at its episode's end), the least any loop that runs the policy on ``n`` rows and
    steps those envs on one core does. Returns (the policy's mean seconds per call, one env's
    mean seconds per step, env steps taken).

    Raises:
        BenchError: an env failed.
    """
    envs: list[Any] = []
    try:
        for _ in range(n):
            envs.append(workload.factory()())
        obs = np.stack([np.asarray(env.reset(seed=seed + j)[0]) for j, env in enumerate(envs)])
        for _ in range(3):  # the policy's first calls, untimed
            policy(obs)
        t_policy = t_env = 0.0
        calls = 0
        start = time.perf_counter()
        while time.perf_counter() - start < seconds:
            t0 = time.perf_counter()
            actions = policy(obs)
            t1 = time.perf_counter()
            for j, env in enumerate(envs):
                o, _, terminated, truncated, _ = env.step(actions[j])
                if terminated or truncated:
                    o, _ = env.reset()
                obs[j] = o
            t_env += time.perf_counter() - t1
            t_policy += t1 - t0
            calls += 1
    except Exception as exc:
        raise bench_error(exc, "measuring the loop bound of", "bound", workload.env_id) from exc
    finally:
        for env in envs:
            env.close()
    return t_policy / calls, t_env / (calls * n), calls * n


def _median(values: Sequence[float]) -> float:
    import statistics

    return float(statistics.median(values)) if values else math.nan


def envpool_workload_task(workload: Any) -> tuple[str, dict[str, Any]] | None:
    """EnvPool's task doing ``workload``'s work, for the ``envpool`` systems: its native task
    (:func:`envfleet.bench.envpool_task`), an Atari workload's frames as its wrappers make
    them (84x84 gray, 4 stacked, at most 30 no-ops; sticky actions 0.25 as ALE v5's); or
    ``None`` where EnvPool is missing or has no such task."""
    task = envpool_task(workload.env_id)
    if task is None:
        return None
    name, kwargs = task
    if workload.atari:
        kwargs.update(_ENVPOOL_AS_TRAINED)
    return name, kwargs


def _envpool_missing(workload: Any) -> str:
    import importlib.util

    if importlib.util.find_spec("envpool") is None:
        return f"EnvPool is not installed: {PEER_INSTALL['envpool-native']}"
    return f"EnvPool has no task for {workload.env_id}"


def _has_puffer() -> bool:
    import importlib.util

    return importlib.util.find_spec("pufferlib") is not None


def _measure_loop(
    workload: Any,
    system: str,
    seconds: float,
    warmup_s: float,
    seed: int,
    device: str = "cpu",
    t_policy_by_n: Mapping[int, float] | None = None,
) -> tuple[float, str]:
    """Env steps per second of one system's learner loop on ``workload``, and what the
    system said of itself ("" when nothing; ``t_policy_by_n``, the bound's ``T_p(n)``, goes
    into the default Sampler's report)."""
    n = workload.num_envs
    factory = workload.factory()
    probe = factory()
    try:
        obs_space, act_space = probe.observation_space, probe.action_space
    finally:
        probe.close()
    policy = TorchPolicy(workload.policy, obs_space, act_space, seed, device)
    closers: list[Callable[[], None]] = []
    notes: list[str] = []
    finished = False
    try:
        try:
            if system.startswith("envpool"):
                task = envpool_workload_task(workload)
                if task is None:
                    raise ConfigError(_envpool_missing(workload))
                envs = EnvPoolVector(task, n, seed)
                if system == "envpool-store":
                    advance: Callable[[], int] = StoringLoop(envs, n, policy, seed, closers)
                else:
                    advance = _plain_loop(envs, n, policy, seed, closers)
            else:
                advance = _loop(system, factory, n, policy, seed, closers, notes, t_policy_by_n)
        except ConfigError:
            raise
        except Exception as exc:
            raise bench_error(exc, "building", system, workload.env_id) from exc
        try:
            steps, elapsed = time_advance(advance, seconds, warmup_s)
        except Exception as exc:
            raise bench_error(exc, "running", system, workload.env_id) from exc
        finished = True
    finally:
        for close in closers:
            try:
                close()
            except Exception as exc:
                if finished:
                    raise bench_error(exc, "closing", system, workload.env_id) from exc
    return steps / elapsed, "; ".join(notes)


def time_advance(advance: Callable[[], int], seconds: float, warmup_s: float) -> tuple[int, float]:
    """Call ``advance`` (which returns env steps taken) through a warm-up (at least one call),
    then for ``seconds``; returns (env steps in the timed window, its length in seconds)."""
    t0 = time.perf_counter()
    while True:
        advance()
        if time.perf_counter() - t0 >= warmup_s:
            break
    steps = 0
    t0 = time.perf_counter()
    while True:
        steps += advance()
        elapsed = time.perf_counter() - t0
        if elapsed >= seconds:
            return steps, elapsed


def _loop(
    system: str,
    factory: Callable[[], Any],
    n: int,
    policy: Callable[[Any], Any],
    seed: int,
    closers: list[Callable[[], None]],
    notes: list[str],
    t_policy_by_n: Mapping[int, float] | None = None,
) -> Callable[[], int]:
    """Build ``system`` and return its loop's one iteration (returning env steps taken);
    what must be closed goes into ``closers``, what it says of itself into ``notes`` (when
    it is closed: the default Sampler's report, its schedule bound from ``t_policy_by_n``,
    see :func:`_sampler_note`)."""
    plain = system.removesuffix("-store")
    if plain in ("gym-sync", "gym-async", "envfleet"):
        envs: Any
        if plain == "envfleet":
            envs = envfleet.make(factory, n)
        elif plain == "gym-sync":
            envs = gymnasium.vector.SyncVectorEnv([factory] * n)
        else:
            envs = gymnasium.vector.AsyncVectorEnv([factory] * n)
        if system in STORE_SYSTEMS:
            return StoringLoop(envs, n, policy, seed, closers)
        return _plain_loop(envs, n, policy, seed, closers)
    if system == "envfleet-pool":
        batch = max(1, n // 2)
        pool = envfleet.make(factory, n, batch_size=batch)
        closers.append(pool.close)
        pool.async_reset(seed=seed)
        resets = Resets(n)

        def pool_step() -> int:
            obs, _, terminated, truncated, info = pool.recv()
            pool.send(policy(obs), info["env_id"])
            return resets.taken(info["env_id"], terminated, truncated)

        return pool_step
    if system in ("sampler", "sampler-driver", "sampler-worker"):
        inference = system.removeprefix("sampler").removeprefix("-") or "auto"
        sampler = envfleet.Sampler(
            factory, policy, n, inference=inference, seed=seed, progress=False
        )
        chunk = n * 64
        while sampler.report().choice == "calibrating":  # the default's calibration: untimed
            sampler.sample(chunk)
        if inference == "auto":  # its report at the end, before it closes
            closers.append(lambda: notes.append(_sampler_note(sampler.report(), t_policy_by_n)))
        closers.append(sampler.close)

        def sample() -> int:
            return int(sampler.sample(chunk).num_steps)

        return sample
    return _puffer_loop(system, factory, n, policy, seed, closers)


def _sampler_note(report: envfleet.SamplerReport, t_policy_by_n: Mapping[int, float] | None) -> str:
    """What the default Sampler says of itself: the inference its calibration chose and why,
    and, given ``T_p(n)`` (``t_policy_by_n``), its report with the schedule bound filled in
    (:meth:`envfleet.SamplerReport.with_schedule_bound`; the bound from those times and the
    report's own ``t_env`` and cores): its steps/s over the whole run and their fraction of it."""
    note = f"{report.inference} inference, {report.choice}"
    if not t_policy_by_n or not report.t_env_s > 0:  # no curve, or no t_env measured (nan)
        return note
    best, structure = schedule_bound(report.num_envs, t_policy_by_n, report.t_env_s, report.cores)
    report = report.with_schedule_bound(dict(t_policy_by_n), best, structure)
    return (
        f"{note}; its report: {report.steps_per_s:,.0f} steps/s, "
        f"{report.of_schedule_bound:.2f} of the schedule bound {best:,.0f} ({structure}) "
        f"by its own t_env {report.t_env_s * 1e6:,.1f} us"
    )


def _plain_loop(
    envs: Any,
    n: int,
    policy: Callable[[Any], Any],
    seed: int,
    closers: list[Callable[[], None]],
) -> Callable[[], int]:
    """The plain loop's iteration over a vector env ``envs`` of ``n`` envs (reset with
    ``seed`` here; its ``close`` goes into ``closers``): obs -> policy -> step. It returns
    the transitions taken: an env whose episode ended in the last step is reset by this
    one (gymnasium's ``NEXT_STEP`` autoreset, PufferLib's), its action ignored."""
    closers.append(envs.close)
    obs = envs.reset(seed=seed)[0]
    every, resets = np.arange(n), Resets(n)

    def plain() -> int:
        nonlocal obs
        obs, _, terminated, truncated = envs.step(policy(obs))[:4]
        return resets.taken(every, terminated, truncated)

    return plain


class StoringLoop:
    """The storing plain loop's iteration (the loop a learner writes, CleanRL's rollout) over a
    vector env ``envs`` of ``n`` envs (reset with ``seed`` here; its ``close`` goes into
    ``closers``): each step writes the observations the policy saw, its actions, the rewards
    and the dones (``terminated | truncated``) into row ``t`` of preallocated arrays, then
    ``t`` moves on, wrapping around after ``steps`` rows. Calling it returns the transitions
    taken, counted as :func:`_plain_loop` counts them.

    Attributes:
        obs: ``[steps, n, *obs_shape]``, the observations' dtype.
        actions: ``[steps, n, *action_shape]``, the policy's dtype.
        rewards: ``[steps, n]`` float32.
        dones: ``[steps, n]`` bool.
        t: the row the next step writes.
    """

    def __init__(
        self,
        envs: Any,
        n: int,
        policy: Callable[[Any], Any],
        seed: int,
        closers: list[Callable[[], None]],
        steps: int = ROLLOUT_STEPS,
    ):
        closers.append(envs.close)
        self.envs, self.policy = envs, policy
        self.next_obs = envs.reset(seed=seed)[0]
        first = np.asarray(self.next_obs)
        actions = np.asarray(policy(first))  # its shape and dtype, before any timed step
        self.obs = prefaulted_zeros((steps, *first.shape), first.dtype)
        self.actions = prefaulted_zeros((steps, *actions.shape), actions.dtype)
        self.rewards = prefaulted_zeros((steps, n), np.float32)
        self.dones = prefaulted_zeros((steps, n), np.bool_)
        self.t = 0
        self.every, self.resets = np.arange(n), Resets(n)

    def __call__(self) -> int:
        t = self.t
        self.obs[t] = self.next_obs
        actions = self.policy(self.next_obs)
        self.actions[t] = actions
        self.next_obs, rewards, terminated, truncated = self.envs.step(actions)[:4]
        self.rewards[t] = rewards
        np.logical_or(terminated, truncated, out=self.dones[t])
        self.t = t + 1 if t + 1 < len(self.obs) else 0
        return self.resets.taken(self.every, terminated, truncated)


def prefaulted_zeros(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """A zeroed array whose pages are written now (as ``torch.zeros`` writes them), so that no
    step of a timed window is the first to touch one."""
    out = np.empty(shape, dtype)
    out.fill(0)
    return out


class Resets:
    """The envs of a loop whose episode ended when they were last received: their next result
    is a reset's (``NEXT_STEP`` autoreset), not a transition."""

    def __init__(self, n: int):
        self.pending = np.zeros(n, dtype=np.bool_)

    def taken(self, env_ids: Any, terminated: Any, truncated: Any) -> int:
        """Transitions among the results of ``env_ids`` just received."""
        ids = np.asarray(env_ids, dtype=np.intp)
        taken = len(ids) - int(np.count_nonzero(self.pending[ids]))
        self.pending[ids] = np.logical_or(terminated, truncated)
        return taken


def _puffer_loop(
    system: str,
    factory: Callable[[], Any],
    n: int,
    policy: Callable[[Any], Any],
    seed: int,
    closers: list[Callable[[], None]],
) -> Callable[[], int]:
    """PufferLib 3's ``Multiprocessing`` vector env: ``puffer-sync``, one worker stepped in a
    plain loop (``puffer-sync-store``: the storing one, :class:`StoringLoop`);
    ``puffer-async``, two workers (when ``n`` is even), ``recv``/``send`` of half the envs."""
    import functools

    import pufferlib.emulation
    import pufferlib.vector

    creator = functools.partial(pufferlib.emulation.GymnasiumPufferEnv, env_creator=factory)
    if system in ("puffer-sync", "puffer-sync-store"):
        venv = pufferlib.vector.make(
            creator, num_envs=n, num_workers=1, batch_size=n,
            backend=pufferlib.vector.Multiprocessing,
        )  # fmt: skip
        if system == "puffer-sync-store":
            return StoringLoop(venv, n, policy, seed, closers)
        return _plain_loop(venv, n, policy, seed, closers)
    workers = 2 if n % 2 == 0 else 1
    batch = n // workers
    venv = pufferlib.vector.make(
        creator, num_envs=n, num_workers=workers, batch_size=batch,
        backend=pufferlib.vector.Multiprocessing,
    )  # fmt: skip
    closers.append(venv.close)
    venv.async_reset(seed)
    resets = Resets(n)

    def recv_send() -> int:
        obs, _, terminated, truncated, _, _, env_ids, _ = venv.recv()
        venv.send(policy(obs))
        return resets.taken(env_ids, terminated, truncated)

    return recv_send
