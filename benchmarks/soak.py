"""Soak benchmark: does envfleet leak file descriptors, memory, processes or /dev/shm entries?

Two phases run one after the other in one driver process, sampling its resource use as they go:

1. ``cycles``: ``--cycles`` (1000) times ``envfleet.make`` -> ``reset(seed=i)`` ->
   ``--cycle-steps`` (10) steps -> ``close()``, sampled every ``--sample-every`` cycles (about 50
   samples). The driver-side figures and the child count are read right after ``close()``;
   the workers' RSS just before it, while that cycle's workers are alive.
2. ``steps``: one vector env of ``--num-envs`` (16) stepped for ``--steps`` (10,000,000) env
   steps (one ``step()`` call counts ``num_envs``), with actions taken in turn from a pool of
   64 pre-drawn batches, sampled every ~2% of the run.

Each sample records the driver's open file descriptors (``psutil`` ``num_fds``), its RSS and
its envfleet threads (the live Python threads named ``envfleet-*``, as envfleet names every
thread it starts: the OS thread of a thread joined at ``close()`` can outlive the join by a
moment, so the OS count taken right after ``close()`` is sometimes one high, and in a shared
process, as the test suite's, other libraries' threads come and go), the summed RSS and the
number of the live worker processes below it (the fork server and resource tracker that
``multiprocessing`` keeps under ``forkserver``/``spawn`` are left out and counted apart as
helpers; zombies are counted apart too), and the number of entries in /dev/shm.

Verdicts, per phase and metric, ignore the first 10% of the samples (warm-up: imports, caches,
the allocator settling) and compare the last sample with the first one after that warm-up:
open fds, /dev/shm entries, threads and zombies must be exactly equal, RSS may grow by at most
``max(5 MiB, 5%)``, and every post-warm-up child count must be the expected one (0 after each
``close()`` in the cycles phase, ``num_workers`` during the steps phase). /dev/shm is shared
by the whole machine: run the soak on a quiet machine.

Results go to ``benchmarks/results/soak.md`` (summary table, printed to stdout as well),
``soak.json`` (every sample, the summary, the command line, machine and versions) and
``soak.png`` (one plot per metric against time, if matplotlib is installed). The exit status
is 0 when every metric is flat, 1 otherwise.

Run::

    python benchmarks/soak.py                      # 1000 cycles + 10M steps, default context
    python benchmarks/soak.py --context forkserver --out soak-forkserver
    python benchmarks/soak.py --cycles 50 --steps 200000 --out /tmp/soak-quick
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import hashlib
import importlib.metadata
import json
import math
import multiprocessing
import os
import platform
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np
import psutil

import envfleet

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"

MIB = 1024 * 1024
WARMUP_FRACTION = 0.1  # the first 10% of a phase's samples are warm-up, not judged
RSS_TOLERANCE_MIB = 5.0  # RSS may grow by max(5 MiB, 5%) ...
RSS_TOLERANCE_FRACTION = 0.05
ACTION_POOL = 64  # pre-drawn batched actions, used in turn
TARGET_SAMPLES = 50  # per phase, by default
PHASES = ("cycles", "steps")


@dataclass
class Sample:
    """Resource use of the driver and its workers at one moment."""

    phase: str  # "cycles" or "steps"
    count: int  # cycles done, or env steps done
    elapsed_s: float  # since the soak started
    fds: int  # open file descriptors of the driver
    driver_rss_mib: float
    threads: int  # envfleet's threads in the driver
    shm: int  # entries in /dev/shm (machine-wide)
    children: int  # live worker processes below the driver (helpers, zombies left out)
    worker_rss_mib: float  # summed RSS of the live worker processes (cycles: before close)
    helpers: int  # multiprocessing's fork server and resource tracker
    zombies: int  # exited processes below the driver not yet reaped


@dataclass(frozen=True)
class Metric:
    """A sampled quantity and how it is judged: ``exact``, ``rss`` or ``expected``."""

    key: str
    label: str
    rule: str
    unit: str = ""


METRICS: tuple[Metric, ...] = (
    Metric("fds", "open fds (driver)", "exact"),
    Metric("shm", "/dev/shm entries", "exact"),
    Metric("children", "worker processes", "expected"),
    Metric("zombies", "zombie processes", "exact"),
    Metric("threads", "envfleet threads (driver)", "exact"),
    Metric("driver_rss_mib", "RSS driver", "rss", "MiB"),
    Metric("worker_rss_mib", "RSS workers", "rss", "MiB"),
)


# -- sampling -------------------------------------------------------------------------------


def _is_helper(proc: psutil.Process, driver_pid: int) -> bool:
    """multiprocessing's fork server or resource tracker: a direct child of the driver.

    Workers forked by the fork server inherit its command line, hence the parent check.
    """
    if proc.ppid() != driver_pid:
        return False
    cmdline = " ".join(proc.cmdline())
    return "forkserver" in cmdline or "resource_tracker" in cmdline


@dataclass
class Workers:
    """The processes below the driver at one moment."""

    live: int
    rss_mib: float
    helpers: int
    zombies: int


def scan_workers(driver: psutil.Process) -> Workers:
    """Count the driver's descendants: live workers (and their summed RSS), helpers, zombies."""
    live, rss, helpers, zombies = 0, 0, 0, 0
    for proc in driver.children(recursive=True):
        try:
            if proc.status() == psutil.STATUS_ZOMBIE:
                zombies += 1
            elif _is_helper(proc, driver.pid):
                helpers += 1
            else:
                rss += proc.memory_info().rss
                live += 1
        except psutil.NoSuchProcess:
            continue  # gone while we looked: not live
        except psutil.AccessDenied:
            live += 1
    return Workers(live, rss / MIB, helpers, zombies)


def take_sample(
    phase: str,
    count: int,
    t0: float,
    driver: psutil.Process,
    workers_rss_mib: float | None = None,
) -> Sample:
    """Sample now; ``workers_rss_mib``, when given, replaces the workers' RSS read now."""
    workers = scan_workers(driver)
    with driver.oneshot():
        fds = driver.num_fds()
        rss = driver.memory_info().rss / MIB
    return Sample(
        phase=phase,
        count=count,
        elapsed_s=time.perf_counter() - t0,
        fds=fds,
        driver_rss_mib=rss,
        threads=sum(t.name.startswith("envfleet") for t in threading.enumerate()),
        shm=len(os.listdir("/dev/shm")),
        children=workers.live,
        worker_rss_mib=workers.rss_mib if workers_rss_mib is None else workers_rss_mib,
        helpers=workers.helpers,
        zombies=workers.zombies,
    )


def default_every(total: int, samples: int = TARGET_SAMPLES) -> int:
    """Sampling period that gives about ``samples`` samples over ``total`` units."""
    return max(1, round(total / samples))


@dataclass
class SoakConfig:
    """What to run; see ``--help``."""

    env_id: str = "CartPole-v1"
    num_envs: int = 16
    backend: str = "processes"
    context: str | None = None
    cycles: int = 1000
    cycle_steps: int = 10
    sample_every: int | None = None  # cycles; default: about TARGET_SAMPLES samples
    steps: int = 10_000_000
    seed: int = 0

    def make(self) -> envfleet.FleetVectorEnv:
        if self.backend == "processes":
            return envfleet.make(
                self.env_id, self.num_envs, backend=envfleet.Processes(context=self.context)
            )
        return envfleet.make(self.env_id, self.num_envs, backend=self.backend)


def action_pool(envs: envfleet.FleetVectorEnv, seed: int, size: int = ACTION_POOL) -> list[Any]:
    """``size`` batched actions from ``envs.action_space`` seeded with ``seed``."""
    envs.action_space.seed(seed)
    return [envs.action_space.sample() for _ in range(size)]


Progress = Callable[[Sample], None]


def run_cycles(
    config: SoakConfig, t0: float, progress: Progress | None = None
) -> tuple[list[Sample], int]:
    """The cycles phase; returns its samples and the worker count of its vector envs.

    Sample 0 is taken before the first cycle; sample k after ``close()`` of cycle
    ``k * every`` (and after the last cycle).
    """
    driver = psutil.Process()
    every = config.sample_every or default_every(config.cycles)
    samples = [take_sample("cycles", 0, t0, driver)]
    num_workers = 0
    actions: list[Any] = []
    for i in range(1, config.cycles + 1):
        envs = config.make()
        try:
            num_workers = envs.num_workers if config.backend == "processes" else 0
            if not actions:
                actions = action_pool(envs, config.seed)
            envs.reset(seed=i)
            for k in range(config.cycle_steps):
                envs.step(actions[k % len(actions)])
            sampled = i % every == 0 or i == config.cycles
            worker_rss = scan_workers(driver).rss_mib if sampled else 0.0
        finally:
            envs.close()
        if sampled:
            samples.append(take_sample("cycles", i, t0, driver, worker_rss))
            if progress is not None:
                progress(samples[-1])
    return samples, num_workers


def run_steps(
    config: SoakConfig, t0: float, progress: Progress | None = None
) -> tuple[list[Sample], int]:
    """The steps phase; returns its samples and the vector env's worker count.

    Sample 0 is taken right after the reset, then one every ~2% of the step calls and one at
    the end, before ``close()``.
    """
    driver = psutil.Process()
    calls = max(1, math.ceil(config.steps / config.num_envs))
    every = default_every(calls)
    envs = config.make()
    try:
        num_workers = envs.num_workers if config.backend == "processes" else 0
        actions = action_pool(envs, config.seed)
        envs.reset(seed=config.seed)
        samples = [take_sample("steps", 0, t0, driver)]
        step, pool = envs.step, len(actions)
        done = 0
        while done < calls:
            stop = min(calls, done + every)
            for c in range(done, stop):
                step(actions[c % pool])
            done = stop
            samples.append(take_sample("steps", done * config.num_envs, t0, driver))
            if progress is not None:
                progress(samples[-1])
    finally:
        envs.close()
    return samples, num_workers


# -- verdicts -------------------------------------------------------------------------------


def warmup_count(n: int, fraction: float = WARMUP_FRACTION) -> int:
    """Samples left out as warm-up: the first ``fraction`` of ``n``, leaving at least one."""
    return min(int(n * fraction), max(0, n - 1))


def judge(metric: Metric, samples: Sequence[Sample], expected: int | None = None) -> dict[str, Any]:
    """Summary of one metric over one phase's samples (see the module docstring for rules)."""
    values = [getattr(s, metric.key) for s in samples]
    skip = warmup_count(len(values))
    judged = values[skip:]
    first, last = judged[0], judged[-1]
    out: dict[str, Any] = {
        "metric": metric.key,
        "label": metric.label,
        "unit": metric.unit,
        "rule": metric.rule,
        "start": values[0],
        "first": first,
        "last": last,
        "max": max(values),
        "min": min(values),
        "warmup_samples": skip,
        "samples": len(values),
    }
    if metric.rule == "exact":
        flat = last == first
        detail = "" if flat else f"{last - first:+d}"
    elif metric.rule == "rss":
        tolerance = max(RSS_TOLERANCE_MIB, RSS_TOLERANCE_FRACTION * first)
        out["tolerance"] = tolerance
        flat = last - first <= tolerance
        detail = f"{last - first:+.1f} MiB" + ("" if flat else f" > {tolerance:.1f}")
    elif metric.rule == "expected":
        assert expected is not None
        out["expected"] = expected
        wrong = [v for v in judged if v != expected]
        flat = not wrong
        detail = "" if flat else f"{len(wrong)} samples != {expected} (max {max(judged)})"
    else:
        raise ValueError(f"unknown rule {metric.rule!r}")
    out["flat"] = flat
    out["verdict"] = ("flat" if flat else "NOT flat") + (f" ({detail})" if detail else "")
    return out


def summarize(samples: Sequence[Sample], expected_children: dict[str, int]) -> list[dict[str, Any]]:
    """One :func:`judge` row per (metric, phase), for the phases present in ``samples``."""
    rows = []
    for metric in METRICS:
        for phase in PHASES:
            those = [s for s in samples if s.phase == phase]
            if those:
                row = judge(metric, those, expected_children.get(phase))
                rows.append({"phase": phase, **row})
    return rows


def all_flat(summary: Sequence[dict[str, Any]]) -> bool:
    return all(row["flat"] for row in summary)


# -- the run --------------------------------------------------------------------------------


@dataclass
class SoakResult:
    """Everything one soak produced."""

    config: SoakConfig
    samples: list[Sample]
    summary: list[dict[str, Any]]
    num_workers: dict[str, int]  # per phase
    seconds: dict[str, float]  # wall time per phase

    @property
    def flat(self) -> bool:
        return all_flat(self.summary)


def soak(
    config: SoakConfig, progress: Progress | None = None, phases: Sequence[str] = PHASES
) -> SoakResult:
    """Run the phases of ``config`` (both by default) and judge them."""
    # What earlier work left in reference cycles (a closed vector env's arrays over its
    # shared memory) goes now, not in the middle of the samples.
    gc.collect()
    t0 = time.perf_counter()
    samples: list[Sample] = []
    workers: dict[str, int] = {}
    seconds: dict[str, float] = {}
    runners = {"cycles": run_cycles, "steps": run_steps}
    for phase in phases:
        start = time.perf_counter()
        got, workers[phase] = runners[phase](config, t0, progress)
        seconds[phase] = time.perf_counter() - start
        samples += got
    expected = {"cycles": 0, "steps": workers.get("steps", 0)}
    return SoakResult(config, samples, summarize(samples, expected), workers, seconds)


# -- reporting ------------------------------------------------------------------------------


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _git() -> dict[str, Any]:
    """The commit of the checkout envfleet was imported from, and whether its src/ had
    uncommitted changes (then a hash of them); empty outside a git checkout."""
    repo = Path(envfleet.__file__).resolve().parent
    with contextlib.suppress(Exception):

        def git(*args: str) -> str:
            return subprocess.run(
                ["git", "-C", str(repo), *args], capture_output=True, text=True, check=True
            ).stdout

        head = git("rev-parse", "--short", "HEAD").strip()
        dirty = git("status", "--porcelain", "--", ":/src")
        info: dict[str, Any] = {"head": head, "src_dirty": bool(dirty)}
        if dirty:
            info["src_status_sha1"] = hashlib.sha1(
                (dirty + git("diff", "HEAD", "--", ":/src")).encode()
            ).hexdigest()[:12]
        return info
    return {}


def machine_info(config: SoakConfig, argv: Sequence[str]) -> dict[str, Any]:
    """Date, command line, CPU, versions and the start method used."""
    cpu = platform.processor()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count() or 1
    return {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": " ".join(["soak.py", *argv]),
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "usable_cores": usable,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "start_method": (
            (config.context or multiprocessing.get_start_method())
            if config.backend == "processes"
            else None
        ),
        "envfleet_path": str(Path(envfleet.__file__).resolve().parent),
        "git": _git(),
        "versions": {
            "envfleet": envfleet.__version__,
            **{d: _version(d) for d in ("gymnasium", "numpy", "psutil")},
        },
    }


def _fmt(value: Any, unit: str) -> str:
    if isinstance(value, float):
        return f"{value:,.1f}" + (f" {unit}" if unit else "")
    return f"{value:,}"


def _workers(n: int) -> str:
    return f"{n} worker process{'es' if n != 1 else ''}"


def markdown(result: SoakResult, info: dict[str, Any]) -> str:
    """The summary: run description and the table metric | phase | first | last | max | verdict."""
    c = result.config
    git = info["git"]
    where = (
        f"envfleet {info['versions']['envfleet']}"
        + (f" at {git['head']}" if git else "")
        + (" with uncommitted changes in src/" if git.get("src_dirty") else "")
    )
    others = ", ".join(f"{k} {v}" for k, v in info["versions"].items() if k != "envfleet" and v)
    method = f"start method {info['start_method']}" if info["start_method"] else "no workers"
    lines = [
        "# Soak",
        "",
        f"Run {info['date']}: `{info['command']}`",
        "",
        f"{info['cpu']}, {info['usable_cores']} usable cores ({info['cpu_count']} CPUs), "
        f"Python {info['python']}, {where}, {others}. {c.env_id}, backend {c.backend}, "
        f"{method}.",
        "",
    ]
    if "cycles" in result.seconds:
        s = result.seconds["cycles"]
        n = sum(1 for x in result.samples if x.phase == "cycles")
        lines.append(
            f"- cycles: {c.cycles:,} × (make {c.num_envs} envs → reset(seed=i) → "
            f"{c.cycle_steps} steps → close), {_workers(result.num_workers['cycles'])} "
            f"each, in {s:,.1f} s ({c.cycles / s:,.1f} cycles/s); {n} samples."
        )
    if "steps" in result.seconds:
        s = result.seconds["steps"]
        n = sum(1 for x in result.samples if x.phase == "steps")
        last = max(x.count for x in result.samples if x.phase == "steps")
        lines.append(
            f"- steps: {last:,} env steps ({c.num_envs} envs, "
            f"{_workers(result.num_workers['steps'])}) in {s:,.1f} s "
            f"({last / s:,.0f} env steps/s, sampling included); {n} samples."
        )
    lines += [
        "",
        "`first` is the first sample after the warm-up (the first 10% of a phase's samples); "
        "`max` covers all samples. Flat: fds, /dev/shm entries, zombies and threads exactly "
        "equal to `first` at the end; RSS within max(5 MiB, 5%) of `first`; worker processes "
        "equal to the expected count in every sample after the warm-up (0 right after each "
        "close() in the cycles phase, num_workers in the steps phase). In the cycles phase "
        "the workers' RSS is read just before close().",
        "",
        "| metric | phase | first | last | max | verdict |",
        "|--------|-------|------:|-----:|----:|---------|",
    ]
    for row in result.summary:
        unit = row["unit"]
        lines.append(
            f"| {row['label']} | {row['phase']} | {_fmt(row['first'], unit)} | "
            f"{_fmt(row['last'], unit)} | {_fmt(row['max'], unit)} | {row['verdict']} |"
        )
    bad = [f"{r['label']} ({r['phase']})" for r in result.summary if not r["flat"]]
    lines += ["", "Everything flat." if not bad else "NOT flat: " + ", ".join(bad) + "."]
    return "\n".join(lines) + "\n"


def plot(result: SoakResult, path: Path) -> Path | None:
    """One subplot per metric against elapsed time; ``None`` (no file) without matplotlib.

    The y range of each subplot covers the samples after the warm-up (shaded), padded by 1
    for counts and by the tolerance for RSS, so that a drift shows; warm-up samples may lie
    outside it.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    cols = 2
    rows = math.ceil(len(METRICS) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(11, 2.6 * rows), dpi=100, sharex=True)
    flat_axes = list(np.ravel(axes))
    colors = {"cycles": "tab:blue", "steps": "tab:orange"}
    by_phase = {p: [s for s in result.samples if s.phase == p] for p in PHASES}
    by_phase = {p: those for p, those in by_phase.items() if those}
    for ax, metric in zip(flat_axes, METRICS, strict=False):
        judged: list[float] = []
        for phase, those in by_phase.items():
            values = [getattr(s, metric.key) for s in those]
            skip = warmup_count(len(those))
            judged += values[skip:]
            ax.axvspan(those[0].elapsed_s, those[skip].elapsed_s, color="0.9", linewidth=0)
            ax.plot(
                [s.elapsed_s for s in those],
                values,
                marker=".",
                linewidth=1,
                color=colors[phase],
                label=phase,
            )
        low, high = min(judged), max(judged)
        pad = max(RSS_TOLERANCE_MIB, RSS_TOLERANCE_FRACTION * high) if metric.rule == "rss" else 1.0
        ax.set_ylim(low - pad, high + pad)
        ax.set_title(metric.label + (f" ({metric.unit})" if metric.unit else ""), fontsize=10)
        ax.grid(True, alpha=0.3)
    for ax in flat_axes[len(METRICS) :]:
        ax.axis("off")
    for ax in flat_axes[max(0, len(METRICS) - cols) : len(METRICS)]:
        ax.set_xlabel("elapsed (s)")
        ax.tick_params(labelbottom=True)
    flat_axes[0].legend(fontsize=8, loc="upper left")
    c = result.config
    fig.suptitle(
        f"envfleet soak: {c.env_id}, {c.num_envs} envs, backend {c.backend} "
        "(warm-up shaded, not judged)",
        fontsize=11,
    )
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def out_prefix(name: str) -> Path:
    """``--out``: a bare name goes to benchmarks/results/NAME; a path is used as it is."""
    path = Path(name)
    if path.parent == Path("."):
        path = RESULTS / name
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Soak envfleet: make/close cycles, then a long run; sample open fds, RSS, "
        "worker processes and /dev/shm entries over time (see benchmarks/README.md)."
    )
    p.add_argument("--env", default="CartPole-v1", help="gymnasium id (default %(default)s)")
    p.add_argument("--num-envs", type=int, default=16, help="sub-environments (default 16)")
    p.add_argument("--backend", choices=("processes", "serial"), default="processes")
    p.add_argument(
        "--context",
        choices=multiprocessing.get_all_start_methods(),
        default=None,
        help="start method of the workers (default: the platform's)",
    )
    p.add_argument("--cycles", type=int, default=1000, help="make/close cycles (default 1000)")
    p.add_argument("--cycle-steps", type=int, default=10, help="steps per cycle (default 10)")
    p.add_argument(
        "--sample-every",
        type=int,
        default=None,
        metavar="CYCLES",
        help=f"sample every this many cycles (default: about {TARGET_SAMPLES} samples)",
    )
    p.add_argument(
        "--steps",
        type=int,
        default=10_000_000,
        help="env steps of the steps phase, num_envs per step() call (default 10,000,000)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--out",
        default="soak",
        help="result prefix: a name (benchmarks/results/NAME.md, .json, .png) or a path "
        "(default: soak)",
    )
    return p


def _progress(sample: Sample) -> None:
    print(
        f"[{sample.elapsed_s:8.1f} s] {sample.phase} {sample.count:>11,}: fds {sample.fds} "
        f"shm {sample.shm} workers {sample.children} threads {sample.threads} "
        f"rss {sample.driver_rss_mib:.1f} + {sample.worker_rss_mib:.1f} MiB",
        file=sys.stderr,
        flush=True,
    )


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    if args.num_envs < 1 or args.cycles < 1 or args.cycle_steps < 0 or args.steps < 1:
        raise SystemExit("--num-envs, --cycles and --steps must be >= 1, --cycle-steps >= 0")
    if args.sample_every is not None and args.sample_every < 1:
        raise SystemExit("--sample-every must be >= 1")
    config = SoakConfig(
        env_id=args.env,
        num_envs=args.num_envs,
        backend=args.backend,
        context=args.context,
        cycles=args.cycles,
        cycle_steps=args.cycle_steps,
        sample_every=args.sample_every,
        steps=args.steps,
        seed=args.seed,
    )
    info = machine_info(config, argv)
    result = soak(config, progress=_progress)
    prefix = out_prefix(args.out)
    text = markdown(result, info)
    prefix.with_suffix(".md").write_text(text)
    raw = {
        "info": info,
        "config": asdict(config),
        "seconds": result.seconds,
        "num_workers": result.num_workers,
        "flat": result.flat,
        "summary": result.summary,
        "fields": [f.name for f in fields(Sample)],
        "samples": [asdict(s) for s in result.samples],
    }
    prefix.with_suffix(".json").write_text(json.dumps(raw, indent=1) + "\n")
    png = plot(result, prefix.with_suffix(".png"))
    written = [prefix.with_suffix(".md"), prefix.with_suffix(".json")] + ([png] if png else [])
    print("wrote " + ", ".join(str(p) for p in written), file=sys.stderr)
    print(text, end="")
    return 0 if result.flat else 1


if __name__ == "__main__":
    sys.exit(main())
