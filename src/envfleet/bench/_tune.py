"""``envfleet tune``: which vector env or :class:`envfleet.Sampler` to use for an env and a
policy, measured on this machine with the policy in the loop (see :func:`tune`;
:mod:`envfleet.bench` re-exports it).

PufferLib's ``autotune`` times its vector env's configurations with random actions and, at
most, a sleep standing for the model. Here every candidate runs the loop a learner runs: the
policy chooses every action, and what a learner keeps is stored as it goes, so that a
configuration whose env stepping is fast but leaves the policy no overlap, or that needs more
cores than the policy leaves, is judged by the rate a training run would see.
"""

from __future__ import annotations

import functools
import importlib
import json
import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

import cloudpickle
import gymnasium
import numpy as np
from gymnasium.vector.utils import concatenate, create_empty_array

import envfleet
from envfleet import ConfigError, check_gymnasium_id, usable_cores
from envfleet.bench._core import BenchError, bench_error, check_args, json_ready
from envfleet.bench._policies import POLICY_KINDS, TorchPolicy, Workload, check_workload, make_env
from envfleet.bench._policy_loop import (
    ROLLOUT_STEPS,
    Resets,
    StoringLoop,
    prefaulted_zeros,
    time_advance,
)
from envfleet.bench._sweep import Machine, describe_machine

__all__ = [
    "TuneCandidate",
    "TuneProgress",
    "TuneReport",
    "TuneResult",
    "tune",
    "tune_grid",
    "tune_report_dict",
    "tune_table",
    "tune_workers",
]

#: The loops a candidate runs: ``"make"``, the storing plain loop over ``envfleet.make``;
#: ``"pool"``, recv -> policy -> send over a first-ready pool, storing; ``"sampler"``,
#: ``Sampler.sample``.
Loop = Literal["make", "pool", "sampler"]
#: How many worker counts the grid tries at most.
_MAX_WORKER_COUNTS = 4
#: The threads backend is measured only when the serial rate times the threads it would run
#: could come within this fraction of the best rate so far.
_THREADS_WITHIN = 0.5
#: Env steps per env that a Sampler candidate asks for per ``sample`` call (one round of its
#: default ``segment_length``).
_SAMPLE_STEPS_PER_ENV = 64


@dataclass(frozen=True)
class TuneCandidate:
    """One configuration :func:`tune` measures: a loop and the arguments of its call.

    Attributes:
        loop: ``"make"``: ``envs = envfleet.make(env, num_envs, **kwargs)`` stepped by the
            storing plain loop (obs -> policy -> ``step``, each step's observations,
            actions, rewards and dones written into preallocated ``[T, num_envs, ...]``
            arrays, ``T =`` :data:`~envfleet.bench.ROLLOUT_STEPS`); ``"pool"``: the same
            over a first-ready pool (``batch_size``): ``recv`` -> policy -> ``send``, storing
            ``[T, batch_size, ...]`` rows and their env ids; ``"sampler"``:
            ``envfleet.Sampler(env, policy, num_envs, **kwargs).sample(64 * num_envs)``.
        backend: ``"serial"``, ``"threads"`` or ``"processes"``.
        num_workers: ``make``'s ``num_workers``; ``None``: its default.
        driver_envs: ``make``'s ``driver_envs`` (``processes``); ``None``: its default.
        batch_size: ``make``'s ``batch_size`` (``"pool"`` only).
        inference: the Sampler's ``"driver"`` or ``"worker"`` (``"sampler"`` only).

    Example::

        TuneCandidate("make", "processes", num_workers=2, driver_envs=0).name
        # 'processes num_workers=2 driver_envs=0'
    """

    loop: Loop
    backend: str
    num_workers: int | None = None
    driver_envs: int | None = None
    batch_size: int | None = None
    inference: str | None = None

    def __post_init__(self) -> None:
        if self.loop not in ("make", "pool", "sampler"):
            raise ConfigError(f"loop must be 'make', 'pool' or 'sampler', got {self.loop!r}")
        if (self.loop == "pool") != (self.batch_size is not None):
            raise ConfigError("a 'pool' candidate, and only it, has a batch_size")
        if (self.loop == "sampler") != (self.inference is not None):
            raise ConfigError("a 'sampler' candidate, and only it, has an inference")
        if self.inference not in (None, "driver", "worker"):
            raise ConfigError(f"inference must be 'driver' or 'worker', got {self.inference!r}")

    @property
    def kwargs(self) -> dict[str, Any]:
        """The keyword arguments of its call, in the order the call text gives them."""
        out: dict[str, Any] = {}
        if self.inference is not None:
            out["inference"] = self.inference
        out["backend"] = self.backend
        for name in ("num_workers", "driver_envs", "batch_size"):
            value = getattr(self, name)
            if value is not None:
                out[name] = value
        return out

    def arguments(self) -> dict[str, Any]:
        """The keyword arguments of its call: :attr:`kwargs` with ``driver_envs`` given as
        ``backend=envfleet.Processes(driver_envs=...)``."""
        out = dict(self.kwargs)
        driver_envs = out.pop("driver_envs", None)
        if driver_envs is not None:
            out["backend"] = envfleet.Processes(driver_envs=driver_envs)
        return out

    @property
    def name(self) -> str:
        """A short name: the loop (``pool``, ``sampler driver``...), the backend, then the
        arguments set, e.g. ``"pool processes num_workers=2 batch_size=8"``."""
        head = {"make": "", "pool": "pool ", "sampler": f"sampler {self.inference} "}[self.loop]
        args = {k: v for k, v in self.kwargs.items() if k not in ("inference", "backend")}
        text = head + self.backend + "".join(f" {k}={v}" for k, v in args.items())
        return text

    def call(self, env: str, num_envs: int) -> str:
        """The call's text, with ``env`` the text of the env argument; a Sampler's policy is
        the name ``policy``.

        Example::

            TuneCandidate("make", "processes", 2, 0).call('"CartPole-v1"', 16)
            # 'envfleet.make("CartPole-v1", 16, backend=envfleet.Processes(driver_envs=0),
            #  num_workers=2)'
        """
        args = ", ".join(f"{k}={_literal(v)}" for k, v in self.arguments().items())
        if self.loop == "sampler":
            return f"envfleet.Sampler({env}, policy, {num_envs}, {args})"
        return f"envfleet.make({env}, {num_envs}, {args})"


@dataclass(frozen=True)
class TuneResult:
    """One candidate's throughput in :func:`tune`.

    Attributes:
        candidate: the :class:`TuneCandidate`.
        steps_per_s: env steps per second (transitions, summed over the envs), the median of
            ``runs``; ``nan`` when not measured.
        runs: steps/s of each measurement (the finalists have two).
        of_best: ``steps_per_s`` over the winner's.
        call: the candidate's call text (:meth:`TuneCandidate.call`).
        skipped: why it was not measured (pruned, a policy that does not pickle for worker
            inference, or ``"failed: ..."`` with the error), else ``None``.
        env_kind: the kind of env its workers found (``envs.stats.env_kind``: ``"compute"``,
            ``"wait"``, ``"varied"``, ``"unknown"``) at the end of its last measurement;
            ``None`` when not measured.
    """

    candidate: TuneCandidate
    steps_per_s: float
    runs: tuple[float, ...]
    of_best: float
    call: str
    skipped: str | None = None
    env_kind: str | None = None


@dataclass(frozen=True)
class TuneReport:
    """What :func:`tune` measured and what it recommends.

    Attributes:
        env: the env as given (an id, ``module:factory``, or a callable's name).
        num_envs: sub-environments of every candidate.
        policy: the policy as given (``"mlp"``, ``"cnn"``, ``module:fn`` or a callable's
            name).
        seconds: timed seconds per measurement.
        cores: usable cores the grid was built for.
        machine: the :class:`~envfleet.bench.Machine` it ran on.
        results: one :class:`TuneResult` per candidate, in the order measured.
        winner: the fastest measured result.
        call: the winner's call text, e.g. ``envfleet.make("CartPole-v1", 16,
            backend="processes", num_workers=2, driver_envs=0)``.
        code: a runnable snippet: its imports, then ``envs = <call>`` (``sampler = <call>``
            for a Sampler, which needs the name ``policy`` bound to your policy; an env given
            as a callable that cannot be named by an import needs the name ``env``).
        env_kind: the kind of env the ``processes`` candidates' workers found: ``"compute"``
            (its steps keep the CPU busy: each worker steps its envs one after another),
            ``"wait"`` (its steps mostly wait, on a simulator or a server: each worker steps
            its envs all at once), ``"varied"`` or ``"unknown"`` (no such candidate measured).
    """

    env: str
    num_envs: int
    policy: str
    seconds: float
    cores: int
    machine: Machine
    results: tuple[TuneResult, ...]
    winner: TuneResult
    call: str
    code: str
    env_kind: str = "unknown"


@dataclass(frozen=True)
class TuneProgress:
    """Where :func:`tune` stands; passed to its ``progress`` callback.

    Attributes:
        candidate: the candidate's name (:attr:`TuneCandidate.name`).
        round: 1 (every candidate) or 2 (the finalists, measured again).
        phase: ``"start"``, ``"done"`` (``steps_per_s`` set), ``"skipped"`` or ``"failed"``
            (``detail`` says why).
        steps_per_s: the measurement's env steps per second; ``nan`` before ``"done"``.
        detail: why it was skipped or what failed; else ``""``.
    """

    candidate: str
    round: int
    phase: Literal["start", "done", "skipped", "failed"]
    steps_per_s: float = math.nan
    detail: str = ""


def tune_workers(num_envs: int, cores: int) -> tuple[int, ...]:
    """The worker counts the grid tries: the powers of two up to ``m = min(cores,
    num_envs)``, and ``m`` itself, the largest few (at most four) of them.

    Example::

        tune_workers(16, 2), tune_workers(16, 16), tune_workers(16, 6)
        # ((1, 2), (2, 4, 8, 16), (1, 2, 4, 6))
    """
    if num_envs < 1 or cores < 1:
        raise ConfigError(f"num_envs and cores must be >= 1, got {num_envs} and {cores}")
    top = min(cores, num_envs)
    counts, k = {top}, 1
    while k < top:
        counts.add(k)
        k *= 2
    return tuple(sorted(counts)[-_MAX_WORKER_COUNTS:])


def _pool_workers(num_envs: int, cores: int) -> tuple[int, ...]:
    """Worker counts of the first-ready pool (``batch_size = num_envs // 2``): the largest
    count up to the cores whose blocks fill a batch exactly (a worker hands its envs back
    together; the pool's default, when it is at least 2), and one env per worker when
    ``num_envs <= 2 * cores``."""
    half = num_envs // 2
    fits = [w for w in range(2, num_envs + 1) if num_envs % w == 0 and half % (num_envs // w) == 0]
    out = [w for w in fits if w <= cores][-1:]
    if num_envs <= 2 * cores and num_envs in fits:
        out.append(num_envs)
    return tuple(dict.fromkeys(out))


def tune_grid(
    num_envs: int, cores: int | None = None, *, worker_inference: bool = True
) -> tuple[TuneCandidate, ...]:
    """The candidates :func:`tune` measures for ``num_envs`` envs on ``cores`` cores
    (default :func:`~envfleet.bench.usable_cores`), in the order it measures them.

    With ``w`` in :func:`tune_workers` and ``m = min(cores, num_envs)``:

    - ``processes`` at its defaults (``m`` workers, every env in one), then
      ``num_workers=w, driver_envs=0`` for each other ``w``, then on more than one core the
      opt-in share ``driver_envs=num_envs // cores`` (the driver stepping the first block:
      faster for tiny envs on few cores, but those envs live in the learner's process);
    - ``serial``; ``threads`` (its default, ``m`` threads) on more than one core;
    - on more than one core and at least two envs, the first-ready pool, ``processes`` with
      ``batch_size = num_envs // 2`` and the largest ``num_workers`` up to the cores whose
      blocks fill a batch exactly, and one env per worker when ``num_envs <= 2 * cores``;
    - the Sampler: ``inference="driver"`` at ``processes``' defaults; with
      ``worker_inference``, ``inference="worker"`` at those defaults and with
      ``num_workers=m // 2, driver_envs=0`` (at least 2).

    Raises:
        ConfigError: ``num_envs`` or ``cores`` below 1.

    Example::

        [c.name for c in tune_grid(16, 2)]
        # ['processes', 'processes num_workers=1 driver_envs=0', 'processes driver_envs=8',
        #  'serial', 'threads', 'pool processes num_workers=2 batch_size=8',
        #  'sampler driver processes', 'sampler worker processes']
    """
    cores = usable_cores() if cores is None else cores
    workers = tune_workers(num_envs, cores)
    top = min(cores, num_envs)
    # make()'s default: every env in a worker, ``top`` of them; the share is an opt-in.
    share = num_envs // cores if cores > 1 else 0
    grid = [TuneCandidate("make", "processes")]
    grid += [
        TuneCandidate("make", "processes", num_workers=w, driver_envs=0)
        for w in workers
        if w != top
    ]
    if share >= 1 and num_envs - share >= 1:
        grid.append(TuneCandidate("make", "processes", driver_envs=share))
    grid.append(TuneCandidate("make", "serial"))
    if cores > 1:
        grid.append(TuneCandidate("make", "threads"))
    if cores > 1 and num_envs > 1:
        grid += [
            TuneCandidate("pool", "processes", num_workers=w, batch_size=num_envs // 2)
            for w in _pool_workers(num_envs, cores)
        ]
    grid.append(TuneCandidate("sampler", "processes", inference="driver"))
    if worker_inference:
        grid.append(TuneCandidate("sampler", "processes", inference="worker"))
        if top // 2 >= 2:
            grid.append(TuneCandidate("sampler", "processes", top // 2, 0, inference="worker"))
    return tuple(grid)


def tune(
    env: str | Callable[[], gymnasium.Env[Any, Any]],
    num_envs: int,
    policy: str | Callable[[gymnasium.Space[Any], gymnasium.Space[Any]], Any],
    *,
    seconds: float = 1.0,
    finalists: int = 3,
    seed: int = 0,
    warmup_s: float = 0.25,
    cores: int | None = None,
    candidates: Sequence[TuneCandidate] | None = None,
    atari: bool | None = None,
    progress: Callable[[TuneProgress], None] | None = None,
) -> TuneReport:
    """Measure which vector env or Sampler runs ``env`` fastest with ``policy`` in the loop,
    on this machine, and say how to build it.

    Each candidate of :func:`tune_grid` (backends ``serial``, ``threads``, ``processes``;
    worker counts up to the usable cores; ``driver_envs`` 0 and the default; a first-ready
    pool of ``batch_size = num_envs // 2``; the Sampler's driver and worker inference) is
    built, warmed up, timed for ``seconds`` and closed, one after the other, with the policy
    choosing every action in the loop a learner runs (see :class:`TuneCandidate`): storing
    ``[T, N, ...]`` observations, actions, rewards and dones for ``make()`` and the pool,
    ``Sampler.sample`` for the Sampler. Then the ``finalists`` fastest are measured again and
    their rate is the median of their two runs. Pruning: ``threads`` is left out when the
    serial rate times its threads is under half the best rate so far; worker inference when
    the policy does not pickle (cloudpickle). A candidate that fails is reported with its
    error (make() or the Sampler refusing it, or an error while it ran) and the others go on.
    Rates count transitions (env steps summed over the envs; an autoreset step is not one),
    per second. Run time: each measurement takes its warm-up and ``seconds``, plus the
    candidate's start (worker processes) and close; one per candidate, and one more per
    finalist.

    Args:
        env: a gymnasium id (``"CartPole-v1"``; gymnasium's ``"module:EnvId"``; an ``ALE/``
            id is Atari-preprocessed as ``envfleet bench --policy`` does it: 84x84 grey
            frames, frame skip 4, 4 stacked, ``uint8[4, 84, 84]``, unless ``atari=False``),
            ``"module:factory"`` (a zero-argument function returning a ``gymnasium.Env``,
            imported; ``"module:name"`` is a factory when ``name`` is not a registered id), or
            a zero-argument callable. Factories must pickle for the ``processes`` backend.
        num_envs: sub-environments of every candidate (``N``, >= 1).
        policy: ``"mlp"`` or ``"cnn"`` (CleanRL's PPO actor, :class:`~envfleet.bench.
            TorchPolicy`, on the CPU; needs torch), ``"module:fn"`` or a callable ``fn``:
            ``fn(observation_space, action_space)`` (one env's spaces) returns the policy, a
            callable on a batch of observations (``[n, *obs_shape]``, numpy) returning ``n``
            actions (``[n, *act_shape]``, numpy or CPU torch), or ``(actions, infos)`` as the
            Sampler takes it. It must pickle (cloudpickle) for worker inference, where each
            worker gets a copy (a ``seed(seed)`` method is called per worker).
        seconds: timed seconds per measurement (> 0).
        finalists: how many of the fastest are measured a second time (>= 1).
        seed: seed of the envs' resets and of ``"mlp"``/``"cnn"``'s weights and sampling.
        warmup_s: untimed seconds before each timed window (capped at ``seconds / 2``).
        cores: the cores to build the grid for; default :func:`~envfleet.bench.usable_cores`.
        candidates: measure these instead of :func:`tune_grid`'s.
        atari: Atari-preprocess the env (default: for ``ALE/`` ids).
        progress: called with a :class:`TuneProgress` before and after each measurement.

    Returns:
        A :class:`TuneReport`: every candidate's steps/s, the winner, its call and a
        runnable snippet (:func:`tune_table` renders it).

    Raises:
        ConfigError: an unknown env id or a ``module:factory`` that does not import; a
            policy spec that is none of the above, a policy factory or policy that fails on
            a batch of ``num_envs`` reset observations, or actions the env refuses; torch,
            ale-py or OpenCV missing where needed (the message says what to install); bad
            numbers.
        BenchError or ConfigError: no candidate could be measured: the first failure's
            error (``BenchError``: it failed while being built or run; ``ConfigError``:
            make() or the Sampler refused its arguments).

    Example::

        report = tune("CartPole-v1", 16, "mlp", seconds=1.0)
        print(tune_table(report))
        report.call  # 'envfleet.make("CartPole-v1", 16, backend="processes", num_workers=2, ...)'
    """
    check_args(num_envs, seconds, warmup_s)
    if isinstance(finalists, bool) or not isinstance(finalists, int) or finalists < 1:
        raise ConfigError(f"finalists must be an integer >= 1, got {finalists!r}")
    if cores is None:
        cores = usable_cores()
    elif isinstance(cores, bool) or not isinstance(cores, int) or cores < 1:
        raise ConfigError(f"cores must be an integer >= 1, got {cores!r}")
    target = _resolve_env(env, atari)
    agent, policy_label, reduce = _build_policy(policy, target, num_envs, seed)
    loop_policy = _ActionsOnly(agent) if reduce else agent
    pickle_problem = _pickle_problem(agent)
    grid = tuple(candidates) if candidates is not None else tune_grid(num_envs, cores)
    if not grid or not all(isinstance(c, TuneCandidate) for c in grid):
        raise ConfigError("candidates must be a non-empty sequence of TuneCandidate")
    grid = tuple(dict.fromkeys(grid))
    warmup_s = min(warmup_s, seconds / 2)

    def report(
        c: TuneCandidate, rnd: int, phase: Any, rate: float = math.nan, why: str = ""
    ) -> None:
        if progress is not None:
            progress(TuneProgress(c.name, rnd, phase, rate, why))

    runs: dict[TuneCandidate, list[float]] = {}
    kinds: dict[TuneCandidate, str] = {}  # what its workers found (envs.stats.env_kind)
    skipped: dict[TuneCandidate, str] = {}
    errors: list[BenchError | ConfigError] = []

    def measure(c: TuneCandidate, rnd: int) -> None:
        report(c, rnd, "start")
        try:
            rate, kind = _measure(
                c, target, num_envs, (agent, loop_policy), seconds, warmup_s, seed
            )
        except (BenchError, ConfigError) as exc:
            errors.append(exc)
            skipped[c] = f"failed: {exc}"
            runs.pop(c, None)
            report(c, rnd, "failed", why=str(exc))
            return
        runs.setdefault(c, []).append(rate)
        kinds[c] = kind
        report(c, rnd, "done", rate)

    for c in grid:
        why = _why_skip(c, runs, num_envs, cores, pickle_problem)
        if why is not None:
            skipped[c] = why
            report(c, 1, "skipped", why=why)
            continue
        measure(c, 1)
    if not runs:
        if errors:
            raise errors[0]
        raise ConfigError("no candidate could be measured: " + "; ".join(skipped.values()))
    best = sorted(runs, key=lambda c: runs[c][0], reverse=True)[:finalists]
    if len(runs) > 1:
        for c in best:
            measure(c, 2)
    rates = {c: statistics.median(r) for c, r in runs.items()}
    top = max(rates, key=lambda c: rates[c])
    env_text, imports = target.text, ["import envfleet", *target.imports]
    results = tuple(
        TuneResult(
            c,
            rates.get(c, math.nan),
            tuple(runs.get(c, ())),
            rates.get(c, math.nan) / rates[top],
            c.call(env_text, num_envs),
            skipped.get(c),
            kinds.get(c) if c in runs else None,
        )
        for c in grid
    )
    winner = next(r for r in results if r.candidate == top)
    lines = list(dict.fromkeys(imports))
    if target.text == "env":
        lines.append("# env: your env factory (a zero-argument callable)")
    if top.loop == "sampler":
        lines.append(f"# policy: your policy ({policy_label} was measured)")
        lines.append(f"sampler = {winner.call}")
    else:
        lines.append(f"envs = {winner.call}")
    if top.loop == "pool":
        lines.append(
            "# a first-ready pool: envs.async_reset(seed=0); then, in the loop, "
            "obs, rewards, terminated, truncated, info = envs.recv(); envs.send(actions, "
            'info["env_id"])'
        )
    return TuneReport(
        env=target.label,
        num_envs=num_envs,
        policy=policy_label,
        seconds=float(seconds),
        cores=cores,
        machine=describe_machine(env_ids=[target.label] if isinstance(env, str) else []),
        results=results,
        winner=winner,
        call=winner.call,
        code="\n".join(lines) + "\n",
        env_kind=_env_kind(kinds[c] for c in runs if c.backend == "processes"),
    )


def _env_kind(kinds: Any) -> str:
    """One kind for the kinds some candidates' workers found: the one they agree on,
    ``"varied"`` when they differ, ``"unknown"`` when none knows."""
    known = set(kinds) - {"unknown"}
    if not known:
        return "unknown"
    return known.pop() if len(known) == 1 else "varied"


_KIND_LINES = {
    "compute": "compute (its steps keep the CPU busy; each processes worker steps its envs one "
    "after another)",
    "wait": "wait (its steps mostly wait, on a simulator, a server or a sleep; each processes "
    "worker steps its envs all at once)",
    "varied": "varied (some workers found envs that compute, others envs that wait)",
    "unknown": "unknown (no processes candidate timed it)",
}


def tune_table(report: TuneReport) -> str:
    """A :class:`TuneReport` as Markdown: a line on the env, the policy and the machine, a
    line on the kind of env the workers found (:attr:`TuneReport.env_kind`), a table of
    ``candidate | loop | steps/s | × best | runs`` from the fastest down (the candidates not
    measured last, with why), the loops' legend, then the snippet to use."""
    measured = sorted(
        (r for r in report.results if r.skipped is None),
        key=lambda r: r.steps_per_s,
        reverse=True,
    )
    lines = [
        f"{report.env} x{report.num_envs}, {report.policy} policy, {report.cores} cores "
        f"({report.machine.cpu_model}): {report.seconds:g} s per measurement, the "
        "fastest measured again (median of their runs)",
        "",
        f"Env kind: {_KIND_LINES.get(report.env_kind, report.env_kind)}",
        "",
        "| candidate | loop | steps/s | × best | runs |",
        "|---|---|---:|---:|---:|",
    ]
    for r in measured:
        mark = " (best)" if r is report.winner else ""
        lines.append(
            f"| {r.candidate.name}{mark} | {r.candidate.loop} | {r.steps_per_s:,.0f} "
            f"| {r.of_best:.2f} | {len(r.runs)} |"
        )
    for r in report.results:
        if r.skipped is not None:
            lines.append(f"| {r.candidate.name} | {r.candidate.loop} | - | - | {r.skipped} |")
    lines += [
        "",
        "steps/s: transitions per second, summed over the envs, with the policy choosing every "
        f"action. Loops: make: obs -> policy -> step, storing obs, actions, rewards and dones "
        f"in [T, N, ...] arrays (T = {ROLLOUT_STEPS}); pool: first-ready pool, recv -> policy "
        f"-> send, storing the same per batch; sampler: Sampler.sample"
        f"({_SAMPLE_STEPS_PER_ENV} * N).",
        "",
        "Use:",
        "",
        *("    " + line for line in report.code.splitlines()),
    ]
    return "\n".join(lines) + "\n"


def tune_report_dict(report: TuneReport) -> dict[str, Any]:
    """A :class:`TuneReport` as a JSON-ready dict (``nan`` becomes ``None``): its fields,
    each candidate with its ``name`` and ``kwargs`` added."""

    def result(r: TuneResult) -> dict[str, Any]:
        out = asdict(r)
        out["candidate"].update(name=r.candidate.name, kwargs=r.candidate.kwargs)
        return dict(json_ready(out))

    out = dict(json_ready(asdict(report)))
    out["results"] = [result(r) for r in report.results]
    out["winner"] = result(report.winner)
    return out


# -- the env and the policy ------------------------------------------------------------------


@dataclass(frozen=True)
class _Target:
    """The env to measure: what make() and the Sampler get (``value``), its text in the
    recommended call (``text``, with the ``imports`` it needs), and its name."""

    value: str | Callable[[], gymnasium.Env[Any, Any]]
    text: str
    imports: tuple[str, ...]
    label: str

    def build(self) -> gymnasium.Env[Any, Any]:
        """One env, as make() builds each."""
        if isinstance(self.value, str):
            return make_env(self.value)
        return self.value()


def _resolve_env(env: Any, atari: bool | None) -> _Target:
    """``env`` as a :class:`_Target` (see :func:`tune`'s ``env``)."""
    if callable(env):
        text, imports = _expression(env) or ("env", ())
        return _Target(env, text, imports, getattr(env, "__qualname__", repr(env)))
    if not isinstance(env, str) or not env:
        raise ConfigError(
            f"env must be a gymnasium id, 'module:factory' or a zero-argument callable, got {env!r}"
        )
    try:
        check_gymnasium_id(env)
    except ConfigError as not_an_id:
        factory = _factory(env) if ":" in env else None
        if factory is None:
            raise
        if not callable(factory):
            raise ConfigError(
                f"{not_an_id}; nor is it a module:factory ({env!r} is not callable)"
            ) from None
        module, _, name = env.partition(":")
        return _Target(factory, f"{module}.{name}", (f"import {module}",), env)
    if atari if atari is not None else env.startswith("ALE/"):
        check_workload(Workload(env, 1, "mlp", atari=True))
        factory = functools.partial(make_env, env, True)
        text = f"functools.partial(envfleet.bench.make_env, {_literal(env)}, True)"
        return _Target(factory, text, ("import functools",), env)
    check_workload(Workload(env, 1, "mlp"))
    return _Target(env, _literal(env), (), env)


def _factory(spec: str) -> Any:
    """The object ``module:name`` names, ``None`` when the module has no such name; the
    module must import (else :class:`ConfigError`)."""
    module_name, _, name = spec.partition(":")
    if not all(part.isidentifier() for part in name.split(".")):
        return None
    obj: Any = _import(module_name, spec)
    for part in name.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def _import(module_name: str, spec: str) -> Any:
    try:
        return importlib.import_module(module_name)
    except Exception as exc:  # ImportError, or the module's own error while importing
        raise ConfigError(
            f"cannot import module {module_name!r} of {spec!r}: {type(exc).__name__}: {exc}"
        ) from exc


def _expression(obj: Any) -> tuple[str, tuple[str, ...]] | None:
    """Python text naming ``obj`` and the imports it needs, for a module-level function or
    class (or a ``functools.partial`` of one with literal arguments); ``None`` otherwise."""
    if isinstance(obj, functools.partial):
        inner = _expression(obj.func)
        values = [*obj.args, *obj.keywords.values()]
        if inner is None or not all(isinstance(v, (str, int, float, type(None))) for v in values):
            return None
        args = [_literal(a) for a in obj.args]
        args += [f"{k}={_literal(v)}" for k, v in obj.keywords.items()]
        return f"functools.partial({', '.join([inner[0], *args])})", (
            "import functools",
            *inner[1],
        )
    module, name = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    if not module or not name or "<" in name or module == "__main__":
        return None
    try:
        found: Any = importlib.import_module(module)
        for part in name.split("."):
            found = getattr(found, part)
    except Exception:
        return None
    return (f"{module}.{name}", (f"import {module}",)) if found is obj else None


def _literal(value: Any) -> str:
    """Python text of a literal, strings in double quotes, a Processes with the fields set."""
    if isinstance(value, envfleet.Processes):
        return f"envfleet.Processes(driver_envs={value.driver_envs})"
    return json.dumps(value) if isinstance(value, str) else repr(value)


def _build_policy(
    policy: Any, target: _Target, num_envs: int, seed: int
) -> tuple[Callable[[Any], Any], str, bool]:
    """The policy ``policy`` stands for, on ``target``'s spaces, checked on a batch of
    ``num_envs`` reset observations and with one of its actions stepped; its name; and
    whether the plain loops need its output reduced to an array (:class:`_ActionsOnly`)."""
    if isinstance(policy, str) and policy in POLICY_KINDS:
        label, make_policy = policy, functools.partial(TorchPolicy, policy, seed=seed)
    elif isinstance(policy, str) and ":" in policy:
        label, make_policy = policy, _factory(policy)
        if make_policy is None or not callable(make_policy):
            raise ConfigError(f"policy {policy!r}: module {policy.split(':')[0]!r} has no "
                              f"function {policy.split(':', 1)[1]!r}")  # fmt: skip
    elif callable(policy) and not isinstance(policy, str):
        label, make_policy = getattr(policy, "__qualname__", repr(policy)), policy
    else:
        raise ConfigError(
            f"policy must be {', '.join(map(repr, POLICY_KINDS))}, 'module:fn' or a callable "
            f"fn(observation_space, action_space), got {policy!r}"
        )
    try:
        env = target.build()
    except Exception as exc:
        raise ConfigError(
            f"cannot build the env {target.label!r}: {type(exc).__name__}: {exc}"
        ) from exc
    if not isinstance(env, gymnasium.Env):
        raise ConfigError(
            f"the env factory {target.label!r} returned {type(env).__name__}, not a gymnasium.Env"
        )
    try:
        obs_space, act_space = env.observation_space, env.action_space
        try:
            agent = make_policy(obs_space, act_space)
        except ConfigError:
            raise
        except Exception as exc:
            raise ConfigError(
                f"the policy factory {label} failed on the spaces {obs_space} and {act_space}: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        if not callable(agent):
            raise ConfigError(
                f"the policy factory {label} returned {agent!r}: not a callable policy"
            )
        obs, _ = env.reset(seed=seed)
        empty: Any = create_empty_array(obs_space, num_envs)
        batch = concatenate(obs_space, [obs] * num_envs, empty)
        try:
            out = agent(batch)
        except Exception as exc:
            raise ConfigError(
                f"the policy ({label}) failed on a batch of {num_envs} observations: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        as_tuple = isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], dict)
        actions = np.asarray(out[0] if as_tuple else out)
        if actions.shape[:1] != (num_envs,):
            raise ConfigError(
                f"the policy ({label}) returned actions of shape {actions.shape} for "
                f"{num_envs} observations; expected [{num_envs}, *action_shape]"
            )
        try:
            env.step(actions[0])
        except Exception as exc:
            raise ConfigError(
                f"the env refused the policy's ({label}) action {actions[0]!r}: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
    finally:
        env.close()
    return agent, label, as_tuple or not isinstance(out, np.ndarray)


class _ActionsOnly:
    """A policy whose output is reduced to a numpy array of actions, for the plain loops
    (the Sampler takes ``(actions, infos)`` and torch tensors itself)."""

    def __init__(self, policy: Callable[[Any], Any]):
        self.policy = policy

    def seed(self, seed: int | None) -> None:
        if hasattr(self.policy, "seed"):
            self.policy.seed(seed)

    def __call__(self, obs: Any) -> np.ndarray:
        out = self.policy(obs)
        if isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], dict):
            out = out[0]
        return np.asarray(out)


def _pickle_problem(policy: Any) -> str | None:
    """Why worker inference cannot run ``policy`` (it does not pickle), else ``None``."""
    try:
        cloudpickle.dumps(policy)
    except Exception as exc:
        return f"worker inference needs a policy that pickles: {type(exc).__name__}: {exc}"
    return None


def _why_skip(
    c: TuneCandidate,
    runs: dict[TuneCandidate, list[float]],
    num_envs: int,
    cores: int,
    pickle_problem: str | None,
) -> str | None:
    """Why candidate ``c`` is not measured, given the rates so far; ``None``: measure it."""
    if c.inference == "worker" and pickle_problem is not None:
        return pickle_problem
    if c.loop == "make" and c.backend == "threads":
        serial = [r[0] for k, r in runs.items() if k.backend == "serial" and k.loop == "make"]
        best = max((r[0] for r in runs.values()), default=math.nan)
        threads = c.num_workers or min(cores, num_envs)
        if serial and serial[0] * threads < _THREADS_WITHIN * best:
            return (
                f"pruned: serial {serial[0]:,.0f} steps/s x {threads} threads is under half "
                f"the best so far ({best:,.0f})"
            )
    return None


# -- the loops -------------------------------------------------------------------------------


def _measure(
    c: TuneCandidate,
    target: _Target,
    num_envs: int,
    policies: tuple[Callable[[Any], Any], Callable[[Any], Any]],
    seconds: float,
    warmup_s: float,
    seed: int,
) -> tuple[float, str]:
    """Env steps per second of candidate ``c``'s loop, and the kind of env its workers found
    then (``envs.stats.env_kind``); ``policies``: the policy as given (the Sampler's) and as
    the plain loops call it.

    Raises:
        ConfigError: ``c``'s arguments are refused by make() or the Sampler.
        BenchError: it failed while being built, run or closed.
    """
    closers: list[Callable[[], Any]] = []
    stats: list[Callable[[], Any]] = []  # the vector env's stats, read after the run
    finished = False
    kind = "unknown"
    try:
        try:
            advance = _loop(c, target.value, num_envs, policies, seed, closers, stats)
        except ConfigError:
            raise
        except Exception as exc:
            raise bench_error(exc, "building", c.name, target.label) from exc
        try:
            steps, elapsed = time_advance(advance, seconds, warmup_s)
            kind = stats[0]().env_kind if stats else "unknown"
        except Exception as exc:
            raise bench_error(exc, "running", c.name, target.label) from exc
        finished = True
    finally:
        for close in reversed(closers):
            try:
                close()
            except Exception as exc:
                if finished:
                    raise bench_error(exc, "closing", c.name, target.label) from exc
    return steps / elapsed, kind


def _loop(
    c: TuneCandidate,
    env: Any,
    num_envs: int,
    policies: tuple[Callable[[Any], Any], Callable[[Any], Any]],
    seed: int,
    closers: list[Callable[[], Any]],
    stats: list[Callable[[], Any]] | None = None,
) -> Callable[[], int]:
    """Build candidate ``c`` and return one iteration of its loop (returning the transitions
    it took); what must be closed goes into ``closers``, what reads its vector env's
    ``stats`` into ``stats``."""
    if stats is None:
        stats = []
    given, policy = policies
    if c.loop == "sampler":
        sampler = envfleet.Sampler(env, given, num_envs, seed=seed, progress=False, **c.arguments())
        closers.append(sampler.close)
        stats.append(lambda: sampler.vector_env.stats)
        chunk = _SAMPLE_STEPS_PER_ENV * num_envs
        return lambda: int(sampler.sample(chunk).num_steps)
    envs = envfleet.make(env, num_envs, **c.arguments())
    stats.append(lambda: envs.stats)
    if c.loop == "pool":
        return _PoolStoringLoop(envs, num_envs, policy, seed, closers)
    return StoringLoop(envs, num_envs, policy, seed, closers)


class _PoolStoringLoop:
    """The storing loop over a first-ready pool ``pool`` of ``n`` envs (reset with ``seed``
    here; its ``close`` goes into ``closers``): each call receives the first ready batch,
    writes its observations, the policy's actions, its rewards, dones and env ids into row
    ``t`` of ``[steps, batch_size, ...]`` arrays, sends the actions to those envs, and
    returns the transitions received (an autoreset's result is not one)."""

    def __init__(
        self,
        pool: Any,
        n: int,
        policy: Callable[[Any], Any],
        seed: int,
        closers: list[Callable[[], Any]],
        steps: int = ROLLOUT_STEPS,
    ):
        closers.append(pool.close)
        self.pool, self.policy = pool, policy
        pool.async_reset(seed=seed)
        obs, _, terminated, truncated, info = pool.recv()
        first = np.asarray(obs)
        actions = np.asarray(policy(first))  # shapes and dtypes, before any timed step
        size = len(first)
        self.obs = prefaulted_zeros((steps, *first.shape), first.dtype)
        self.actions = prefaulted_zeros((steps, *actions.shape), actions.dtype)
        self.rewards = prefaulted_zeros((steps, size), np.float32)
        self.dones = prefaulted_zeros((steps, size), np.bool_)
        self.env_ids = prefaulted_zeros((steps, size), np.intp)
        self.t = 0
        self.resets = Resets(n)
        self.resets.taken(info["env_id"], terminated, truncated)
        pool.send(actions, info["env_id"])

    def __call__(self) -> int:
        obs, rewards, terminated, truncated, info = self.pool.recv()
        ids = info["env_id"]
        t = self.t
        self.obs[t] = obs
        actions = self.policy(obs)
        self.actions[t] = actions
        self.rewards[t] = rewards
        np.logical_or(terminated, truncated, out=self.dones[t])
        self.env_ids[t] = ids
        self.pool.send(actions, ids)
        self.t = t + 1 if t + 1 < len(self.obs) else 0
        return self.resets.taken(ids, terminated, truncated)
