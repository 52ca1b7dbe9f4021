"""The Sampler's default, ``inference="auto"``: run the policy where it is fastest on this
machine, measured, and say why (issue 19; layer 4 in docs/architecture.md).

Both kinds of inference run over one vector env, so the Sampler can move between them at a
``sample`` boundary without losing a step: driver inference (the policy here on all
``num_envs`` observations, the envs stepping in the workers meanwhile idle) and worker
inference (each worker steps its envs with its own policy copy, so one worker's policy runs
while another's envs step: Sample Factory's double-buffered sampling with a group per worker,
without a round trip to the driver per step). :class:`AutoInference` *calibrates* on the
first steps it samples: a warm-up and a timed stretch of each, every step of them returned as
usual; then it keeps the faster. Worker inference is a candidate only when the policy
pickles and has no parameters on a GPU (a GPU policy belongs in the driver).

:func:`sampler_report` turns what the Sampler measured (its timers, the calibration) into a
:class:`SamplerReport`: steps/s, the overlap bound and the verdict *policy-bound* or
*env-bound*.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from envfleet._core import cores as _cores
from envfleet._core.envgroup import EnvGroup
from envfleet._core.trees import tree_concat, tree_copy
from envfleet._front.vector_env import FleetVectorEnv
from envfleet._sampler.driver_inference import DriverInference
from envfleet._sampler.inference import (
    Inference,
    Policy,
    SamplerStats,
    SamplerTimers,
    Timers,
    TimerStat,
)
from envfleet._sampler.rollout import EpisodeBatch
from envfleet._sampler.worker_inference import WorkerInference

__all__ = [
    "AutoInference",
    "SamplerReport",
    "per_env_step_time",
    "policy_on_gpu",
    "sampler_report",
]

# The calibration, in order: (mode, timed). Each piece is ``num_envs * segment_length`` steps
# (one round of worker inference); the untimed pieces take the start-up costs (the policy's
# first calls, the workers' policy copies) out of the timed ones. The timed pieces alternate,
# two of each mode, so that a stretch of load from outside (a noisy machine) weighs on both
# modes rather than on the one it happened to hit; each mode is judged by its faster piece,
# since load from outside only ever slows a piece down.
_CALIBRATION = (
    ("driver", False),
    ("worker", False),
    ("driver", True),
    ("worker", True),
    ("driver", True),
    ("worker", True),
)


def policy_on_gpu(policy: Any) -> bool:
    """Whether ``policy`` (or a torch module among its attributes) has a parameter on a GPU."""
    modules = [policy] + [v for v in getattr(policy, "__dict__", {}).values()]
    for module in modules:
        parameters = getattr(module, "parameters", None)
        if not callable(parameters):
            continue
        try:
            if any(getattr(p, "is_cuda", False) for p in parameters()):
                return True
        except Exception:  # not a torch module's parameters()
            continue
    return False


def _group_observations(group: EnvGroup, _: Any) -> Any:
    """The task that hands the driver a worker's current observations (its buffers' rows)."""
    return tree_copy(group.buffers.observations)


class AutoInference(Inference):
    """Calibrate driver and worker inference on the first steps, then keep the faster.

    Args:
        worker: the worker-inference candidate (``None``: driver inference only, with
            ``reason`` saying why).
        reason: why worker inference is not a candidate, when it is not.
    """

    def __init__(
        self,
        venv: FleetVectorEnv,
        stats: SamplerStats,
        timers: Timers,
        keep_stale: bool,
        seed: int | None,
        segment_length: int,
        worker: WorkerInference | None,
        reason: str,
    ):
        super().__init__(venv, stats, timers, keep_stale, seed)
        self.driver = DriverInference(venv, stats, timers, keep_stale, seed)
        self.worker = worker
        self.active: Inference = self.driver
        piece = venv.num_envs * segment_length  # steps: one round of worker inference
        # The calibration still to run: (mode, timed, steps left), in order.
        self.pieces = [(m, t, piece) for m, t in _CALIBRATION] if worker is not None else []
        self.timed: dict[str, list[float]] = {}  # mode -> steps/s of each timed piece
        self.piece = (0, 0.0)  # the running piece's steps and seconds so far
        self.chosen: str | None = None if worker is not None else "driver"
        self.reason = reason

    @property
    def mode(self) -> str:
        """The inference running now: ``"driver"`` or ``"worker"``."""
        return "worker" if self.active is self.worker else "driver"

    # -- handing the envs over -------------------------------------------------------------

    def reset(self, seed: int | None) -> None:
        self.driver.reset(seed)
        self.driver.started = True
        if self.worker is not None:
            self.worker.started = True
            self.worker.restart_of = [True] * len(self.worker.restart_of)

    def switch(self, mode: str) -> None:
        """Make ``mode`` the running inference, handing it the envs' current observations."""
        if mode == self.mode:
            return
        if mode == "worker":
            assert self.worker is not None
            # Each worker starts its next round from its buffers' rows, which hold the
            # observations of the driver's last step (SAME_STEP: after any reset).
            self.worker.restart_of = [True] * len(self.worker.restart_of)
            self.active = self.worker
            return
        # The driver needs every env's current observation: each worker sends its rows.
        ranges = self.venv.worker_ranges
        self.venv.run_in_workers_async(_group_observations, dict.fromkeys(range(len(ranges))))
        rows = self.venv.run_in_workers_wait()
        self.driver.obs = tree_concat([rows[w] for w in range(len(ranges))])
        self.active = self.driver

    # -- sampling --------------------------------------------------------------------------

    def sample(
        self, policy: Policy, num_steps: int, advance: Callable[[int], None]
    ) -> EpisodeBatch:
        if not self.started:
            self.restart_envs()
        out: list[EpisodeBatch] = []
        current = 0
        while self.pieces and current < num_steps:
            mode, timed, left = self.pieces[0]
            self.switch(mode)
            t0 = time.perf_counter()
            # A piece may span sample() calls; worker inference samples whole rounds.
            batch = self.active.sample(policy, min(left, num_steps - current), advance)
            elapsed = time.perf_counter() - t0
            kept = batch.policy_version == self.stats.policy_version
            n = int(batch.lengths[kept].sum())
            out.append(batch)
            current += n
            steps, seconds = self.piece[0] + n, self.piece[1] + elapsed
            self.piece = (steps, seconds)
            if n >= left:
                self.pieces.pop(0)
                self.piece = (0, 0.0)
                if timed:
                    rate = steps / seconds if seconds > 0 else math.inf
                    self.timed.setdefault(mode, []).append(rate)
            else:
                self.pieces[0] = (mode, timed, left - n)
            if not self.pieces:
                self.choose()
        if current < num_steps:
            out.append(self.active.sample(policy, num_steps - current, advance))
        return EpisodeBatch.concatenate(*out)

    @property
    def measured(self) -> dict[str, float]:
        """Each calibrated mode's steps/s in its faster timed piece."""
        return {mode: max(rates) for mode, rates in self.timed.items()}

    def choose(self) -> None:
        """Keep the faster of the calibrated modes (driver on a tie)."""
        measured = self.measured
        driver, worker = measured.get("driver", 0.0), measured.get("worker", 0.0)
        self.chosen = "worker" if worker > driver else "driver"
        self.reason = (
            f"calibrated on this machine: worker inference {worker:,.0f} steps/s, "
            f"driver inference {driver:,.0f} steps/s"
        )
        self.switch(self.chosen)

    def episodes(self, policy: Policy, n: int) -> EpisodeBatch:
        if not self.started:
            self.restart_envs()
        return self.active.episodes(policy, n)

    def update_policy(self, update: Any) -> None:
        if self.worker is not None:
            self.worker.update_policy(update)

    @property
    def wants_policy_updates(self) -> bool:
        """Whether the workers may need the policy: worker inference runs or may run."""
        return self.worker is not None and self.chosen != "driver"

    def settle(self) -> None:
        self.active.settle()

    def worker_timers(self) -> list[dict[str, TimerStat]]:
        return self.active.worker_timers()

    def close(self, timeout: float | None) -> None:
        self.active.close(timeout)


# -- the report ------------------------------------------------------------------------------


@dataclass(frozen=True)
class SamplerReport:
    """How fast a :class:`envfleet.Sampler` ran and what bounds it (``Sampler.report()``).

    Attributes:
        inference: the inference running: ``"driver"`` or ``"worker"``.
        choice: why (``inference="auto"``: the calibration's figures; else "as asked").
        steps_per_s: env steps returned per second of :meth:`Sampler.sample` calls.
        calibration: ``inference="auto"``: each mode's steps/s in its faster timed
            calibration piece (empty otherwise).
        num_envs: ``N``.
        cores: the cores this process may use (CPU affinity and cgroup quota).
        t_policy_s: the policy's seconds on one batch of ``N`` observations (``T_p``),
            measured where the driver ran the policy on whole batches; else the time per
            call on the smaller batches it ran on (which makes the bound an upper estimate).
        t_env_s: seconds one env takes for one step, in the workers (``t_env``).
        bound_steps_per_s: the overlap bound ``N / max(T_p, (T_p + N t_env) / cores)``
            (:func:`envfleet.bounds.overlap_bound`): policy and envs perfectly overlapped.
        of_bound: ``steps_per_s / bound_steps_per_s``.
        verdict: ``"policy-bound"`` when ``T_p >= (T_p + N t_env) / cores`` (the policy's
            time alone is the limit), else ``"env-bound"``.
        phases: mean seconds per call of each timed phase: ``driver/<name>`` and
            ``worker/<name>`` (``policy``, ``env_step``, ``waiting``).
        t_policy_by_n: the policy's seconds on a batch of ``n`` observations at ``n = N``,
            ``N // 2``, ``N // 4``... (``T_p(n)``, :func:`envfleet.bounds.schedule_sizes`),
            the figures the schedule bound needs; ``None`` unless asked for:
            :meth:`envfleet.Sampler.report` with ``schedule=True`` times a copy of the policy,
            and ``envfleet bench --policy`` gives its own measurement
            (:func:`envfleet.bench.measure_bound`) through :meth:`with_schedule_bound`.
        schedule_bound_steps_per_s: the schedule bound
            (:func:`envfleet.bounds.schedule_bound` of ``t_policy_by_n``, ``t_env_s`` and
            ``cores``): the best steps/s of the structures a loop can take (one policy call,
            groups alternating, the policy in each worker); ``nan`` without
            ``t_policy_by_n``.
        schedule_structure: the structure that attains it (``None`` without it).
        of_schedule_bound: ``steps_per_s / schedule_bound_steps_per_s`` (``nan`` without it).
        env_kind: the kind of env the workers found (``envs.stats.env_kind``): ``"compute"``
            (their steps keep the CPU busy: each worker steps its envs one after another),
            ``"wait"`` (they mostly wait, on a simulator or a server: each worker steps its
            envs all at once), ``"varied"`` (workers differ) or ``"unknown"`` (not timed:
            a backend other than ``processes``, or too few steps yet).
    """

    inference: str
    choice: str
    steps_per_s: float
    calibration: dict[str, float]
    num_envs: int
    cores: int
    t_policy_s: float
    t_env_s: float
    bound_steps_per_s: float
    of_bound: float
    verdict: str
    phases: dict[str, float] = field(default_factory=dict)
    t_policy_by_n: dict[int, float] | None = None
    schedule_bound_steps_per_s: float = math.nan
    schedule_structure: str | None = None
    of_schedule_bound: float = math.nan
    env_kind: str = "unknown"

    def with_schedule_bound(
        self, t_policy_by_n: dict[int, float], steps_per_s: float, structure: str
    ) -> SamplerReport:
        """This report with the schedule bound: ``t_policy_by_n`` (seconds by batch size),
        the bound ``steps_per_s`` computed from it with this report's ``t_env_s`` and ``cores``
        (:func:`envfleet.bounds.schedule_bound`), the ``structure`` that attains it, and
        ``of_schedule_bound``."""
        from dataclasses import replace

        return replace(
            self,
            t_policy_by_n=dict(t_policy_by_n),
            schedule_bound_steps_per_s=steps_per_s,
            schedule_structure=structure,
            of_schedule_bound=self.steps_per_s / steps_per_s if steps_per_s > 0 else math.nan,
        )

    def __str__(self) -> str:
        lines = [
            f"inference: {self.inference} ({self.choice})",
            f"steps/s: {self.steps_per_s:,.0f} = {self.of_bound:.2f} of the overlap bound "
            f"{self.bound_steps_per_s:,.0f} ({self.verdict}: T_p {self.t_policy_s * 1e6:,.0f} us "
            f"for {self.num_envs} envs, t_env {self.t_env_s * 1e6:,.1f} us, {self.cores} cores)",
        ]
        if self.env_kind != "unknown":
            lines.append(f"envs: {_KIND_TEXT.get(self.env_kind, self.env_kind)}")
        if self.t_policy_by_n is not None and self.schedule_structure is not None:
            sizes = ", ".join(f"T_p({n}) {t * 1e6:,.0f} us" for n, t in self.t_policy_by_n.items())
            lines.append(
                f"schedule bound: {self.schedule_bound_steps_per_s:,.0f} steps/s, "
                f"{self.of_schedule_bound:.2f} of it ({self.schedule_structure}; {sizes})"
            )
        lines += [
            f"  {name}: {seconds * 1e6:,.1f} us/call" for name, seconds in self.phases.items()
        ]
        return "\n".join(lines)


_KIND_TEXT = {
    "compute": "compute (their steps keep the CPU busy; each worker steps its envs one after "
    "another)",
    "wait": "wait (their steps mostly wait, on a simulator or a server; each worker steps its "
    "envs all at once)",
    "varied": "varied (some workers' envs compute, others' wait)",
}


def per_env_step_time(totals: Iterable[tuple[float, int]], ranges: Any) -> float:
    """Seconds one env takes for one step: per worker, ``(seconds, steps)`` of stepping all
    its envs (``ranges[w]``), summed over the workers; ``nan`` before any step."""
    seconds, steps = 0.0, 0
    for (total, count), (start, stop) in zip(totals, ranges, strict=False):
        if count:
            seconds += total
            steps += count * (stop - start)
    return seconds / steps if steps else math.nan


def _env_step_time(workers: list[dict[str, TimerStat]], ranges: Any) -> float:
    """Seconds per env step in the workers: each worker's ``env_step`` time over its steps."""
    stats = (timers.get("env_step", TimerStat()) for timers in workers)
    return per_env_step_time(((stat.total_s, stat.count) for stat in stats), ranges)


def sampler_report(
    inference: str,
    choice: str,
    steps: int,
    seconds: float,
    timers: SamplerTimers,
    ranges: Any,
    num_envs: int,
    t_policy_full: float,
    calibration: dict[str, float],
    t_env_steps: float = math.nan,
    env_kind: str = "unknown",
) -> SamplerReport:
    """A :class:`SamplerReport` from a Sampler's measurements (see its attributes);
    ``t_env_steps``: an env's step time from the vector env's own step times, for when no
    worker timed its env steps (driver inference); ``env_kind``: the workers' finding
    (``envs.stats.env_kind``)."""
    cores = _cores.usable_cores()
    t_policy = t_policy_full
    if math.isnan(t_policy):
        stat = timers.driver.get("policy") or timers.merged.get("policy")
        t_policy = stat.mean_s if stat is not None else math.nan
    t_env = _env_step_time(timers.workers, ranges)
    if math.isnan(t_env):
        t_env = t_env_steps
    steps_per_s = steps / seconds if seconds > 0 else math.nan
    bound = math.nan
    verdict = "unknown"
    if not (math.isnan(t_policy) or math.isnan(t_env)) and t_policy + t_env > 0:
        overlapped = (t_policy + num_envs * t_env) / cores
        bound = num_envs / max(t_policy, overlapped)
        verdict = "policy-bound" if t_policy >= overlapped else "env-bound"
    phases = {f"driver/{k}": v.mean_s for k, v in timers.driver.items()}
    phases.update({f"worker/{k}": v.mean_s for k, v in timers.merged.items()})
    return SamplerReport(
        inference=inference,
        choice=choice,
        steps_per_s=steps_per_s,
        calibration=dict(calibration),
        num_envs=num_envs,
        cores=cores,
        t_policy_s=t_policy,
        t_env_s=t_env,
        bound_steps_per_s=bound,
        of_bound=steps_per_s / bound if bound > 0 else math.nan,
        verdict=verdict,
        phases=phases,
        env_kind=env_kind,
    )
