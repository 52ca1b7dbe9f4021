"""The ``envfleet`` command line (DESIGN §2, layer 7), built on the public API only.

``envfleet bench [ENV_ID ...]`` measures env steps per second of envfleet's backends and of
gymnasium's vector envs (see :mod:`envfleet.bench`) and prints a table, or one JSON document
with ``--json``. ``envfleet bench --policy {mlp,cnn}`` measures the learner's loop instead
(observations -> a torch policy -> step; :func:`envfleet.bench.measure_policy_loop`): every
system's steps/s, its fraction of the overlap bound and its ratio to the faster gymnasium
loop. This module is the only place where envfleet prints.

Exit status: 0 on success, 1 when a system failed while being measured, 2 for bad arguments
(argparse's convention; also an unknown env id or a missing ale-py), 130 on Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

import envfleet
from envfleet import ConfigError
from envfleet.bench import (
    BASELINES,
    POLICY_SYSTEMS,
    BenchError,
    BenchProgress,
    BenchResult,
    PolicyLoopReport,
    baseline_ratios,
    check_env_id,
    measure,
)

__all__ = ["main"]

DEFAULT_ENV_ID = "CartPole-v1"


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``envfleet`` command line with ``argv`` (default: ``sys.argv[1:]``).

    Returns the exit status; argparse errors (bad arguments, ``--help``, ``--version``) exit
    through ``SystemExit`` as argparse does, with status 2 for errors.
    """
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command == "bench":
        return _bench(args)
    parser.error(f"unknown command {args.command!r}")  # unreachable: argparse checks choices
    return 2


# -- arguments -----------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="envfleet",
        description="Run many copies of a reinforcement-learning environment in parallel.",
    )
    parser.add_argument("--version", action="version", version=f"envfleet {envfleet.__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    bench = commands.add_parser(
        "bench",
        help="measure env steps/s of envfleet's backends and of gymnasium's vector envs",
        description=(
            "Measure env steps per second (summed over all sub-environments) of envfleet's "
            "backends and of gymnasium's SyncVectorEnv/AsyncVectorEnv, one system after the "
            "other, with random actions drawn in advance. Ratios compare each system with "
            "each baseline (higher is faster)."
        ),
    )
    bench.add_argument(
        "env_ids",
        nargs="*",
        metavar="ENV_ID",
        help=f"gymnasium ids, e.g. CartPole-v1 or ALE/Pong-v5 (default: {DEFAULT_ENV_ID})",
    )
    bench.add_argument(
        "--num-envs",
        type=_positive_int,
        default=None,
        metavar="N",
        help="sub-environments per system (default: 16; with --policy cnn: 8)",
    )
    bench.add_argument(
        "--backends",
        type=_names(envfleet.BACKENDS, "backend"),
        # envpool runs EnvPool's own tasks, not the gymnasium env of the same id, and ray
        # starts a Ray cluster (benchmarks/ray_vs_processes.py compares it): asked only.
        default=[b for b in envfleet.BACKENDS if b not in ("envpool", "ray")],
        metavar="LIST",
        help=(
            "comma-separated envfleet backends, or 'none' (default: "
            f"{','.join(b for b in envfleet.BACKENDS if b not in ('envpool', 'ray'))})"
        ),
    )
    bench.add_argument(
        "--baselines",
        type=_names(BASELINES, "baseline"),
        default=list(BASELINES),
        metavar="LIST",
        help=f"comma-separated gymnasium baselines, or 'none' (default: {','.join(BASELINES)})",
    )
    bench.add_argument(
        "--seconds",
        type=_positive_float,
        default=2.0,
        metavar="S",
        help="timed seconds per system, on top of startup and warm-up (default: 2.0)",
    )
    bench.add_argument(
        "--json",
        action="store_true",
        help="print one JSON document (a list of results with ratios) instead of the table",
    )
    bench.add_argument(
        "--policy",
        choices=("mlp", "cnn"),
        default=None,
        help=(
            "measure the learner's loop with CleanRL's PPO actor (needs torch): mlp (64-64 "
            "tanh; default env CartPole-v1 x16) or cnn (Nature CNN; default env ALE/Pong-v5 "
            "x8, Atari-preprocessed); --backends and --baselines do not apply"
        ),
    )
    bench.add_argument(
        "--systems",
        type=_names(POLICY_SYSTEMS, "system"),
        default=list(POLICY_SYSTEMS),
        metavar="LIST",
        help=f"with --policy: comma-separated systems (default: {','.join(POLICY_SYSTEMS)})",
    )
    bench.add_argument(
        "--repeats",
        type=_positive_int,
        default=1,
        metavar="R",
        help="with --policy: repetitions, systems interleaved; medians are reported (default: 1)",
    )
    return parser


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def _names(available: Sequence[str], kind: str) -> Any:
    def parse(text: str) -> list[str]:
        if text.strip() == "none":
            return []
        names: list[str] = []
        for name in (part.strip() for part in text.split(",")):
            if name not in available:
                raise argparse.ArgumentTypeError(
                    f"unknown {kind} {name!r}; choose from {', '.join(available)} or 'none'"
                )
            if name not in names:
                names.append(name)
        return names

    parse.__name__ = f"{kind} list"  # argparse names the type in some messages
    return parse


# -- bench ---------------------------------------------------------------------------------


def _bench(args: argparse.Namespace) -> int:
    if args.policy is not None:
        return _bench_policy(args)
    if args.num_envs is None:
        args.num_envs = 16
    env_ids: list[str] = list(dict.fromkeys(args.env_ids)) or [DEFAULT_ENV_ID]
    systems: list[str] = [*args.backends, *args.baselines]
    if not systems:
        return _error("nothing to measure: --backends and --baselines are both 'none'")
    try:
        for env_id in env_ids:  # before anything runs: unknown ids, missing ale-py
            check_env_id(env_id)
    except ConfigError as exc:
        return _error(str(exc))

    results: list[BenchResult] = []
    try:
        with _ProgressDisplay(env_ids, systems, args) as on_progress:
            for env_id in env_ids:
                results += measure(
                    env_id, args.num_envs, systems, args.seconds, progress=on_progress
                )
    except ConfigError as exc:
        return _error(str(exc))
    except BenchError as exc:
        return _error(str(exc), status=1)
    except KeyboardInterrupt:
        print("envfleet bench: interrupted", file=sys.stderr)
        return 130

    ratios = baseline_ratios(results)
    if args.json:
        doc = [{**asdict(r), "ratios": ratio} for r, ratio in zip(results, ratios, strict=True)]
        sys.stdout.write(json.dumps(doc, indent=2) + "\n")
    else:
        _print_table(results, ratios, args)
    return 0


def _bench_policy(args: argparse.Namespace) -> int:
    from envfleet.bench import (
        check_workload,
        measure_policy_loop,
        policy_report_dict,
        policy_table,
        require_torch,
        workloads,
    )

    if not args.systems:
        return _error("nothing to measure: --systems is 'none'")
    try:
        require_torch()
        chosen = workloads(args.policy, list(dict.fromkeys(args.env_ids)), args.num_envs)
        for w in chosen:
            check_env_id(w.env_id)
            check_workload(w)
    except ConfigError as exc:
        return _error(str(exc))
    reports: list[PolicyLoopReport] = []
    show = not args.json and sys.stderr.isatty()

    def on_progress(name: str, system: str, rep: int) -> None:
        if show:
            print(f"  {name}: {system} (repetition {rep + 1})", file=sys.stderr)

    try:
        for w in chosen:
            reports.append(
                measure_policy_loop(
                    w, args.systems, args.seconds, repeats=args.repeats, progress=on_progress
                )
            )
    except ConfigError as exc:
        return _error(str(exc))
    except BenchError as exc:
        return _error(str(exc), status=1)
    except KeyboardInterrupt:
        print("envfleet bench: interrupted", file=sys.stderr)
        return 130
    if args.json:
        doc = [policy_report_dict(r) for r in reports]
        sys.stdout.write(json.dumps(doc, indent=2) + "\n")
    else:
        for r in reports:
            print(policy_table(r))
    return 0


def _error(message: str, status: int = 2) -> int:
    print(f"envfleet bench: error: {message}", file=sys.stderr)
    return status


class _ProgressDisplay:
    """A rich progress display on stderr, one bar per (env id, system); a no-op when disabled.

    Enabled only when stderr is a terminal and ``--json`` is not given. Entering it gives the
    callback for :func:`envfleet.bench.measure`.
    """

    def __init__(self, env_ids: list[str], systems: list[str], args: argparse.Namespace):
        self.enabled = not args.json and sys.stderr.isatty()
        self.env_ids, self.systems, self.seconds = env_ids, systems, args.seconds
        self.progress: Any = None
        self.tasks: dict[tuple[str, str], Any] = {}

    def __enter__(self) -> Any:
        if not self.enabled:
            return None
        from rich.console import Console
        from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn

        self.progress = Progress(
            SpinnerColumn(),
            TextColumn("{task.description}"),
            BarColumn(),
            TextColumn("{task.fields[status]}"),
            console=Console(stderr=True),
            transient=True,
            refresh_per_second=5,  # the display thread competes with the systems measured
        )
        for env_id in self.env_ids:
            for system in self.systems:
                self.tasks[env_id, system] = self.progress.add_task(
                    f"{env_id} {system}", total=self.seconds, status="waiting"
                )
        self.progress.start()
        return self.update

    def update(self, event: BenchProgress) -> None:
        task = self.tasks[event.env_id, event.system]
        if event.phase == "start":
            status = "starting"
        elif event.phase == "warmup":
            status = "warming up"
        elif event.phase == "measure":
            status = f"{event.steps_per_s:,.0f} steps/s" if event.batch_steps else "measuring"
        else:
            status = f"{event.steps_per_s:,.0f} steps/s"
        completed = event.budget_s if event.phase == "done" else event.elapsed_s
        self.progress.update(task, completed=completed, status=status)

    def __exit__(self, *exc: object) -> None:
        if self.progress is not None:
            self.progress.stop()


def _print_table(
    results: list[BenchResult], ratios: list[dict[str, float]], args: argparse.Namespace
) -> None:
    from rich.console import Console
    from rich.table import Table

    baselines = [b for b in BASELINES if any(b in r for r in ratios)]
    table = Table(
        caption=f"steps/s: env steps summed over sub-envs; {args.seconds:g} s per system",
    )
    table.add_column("env id")
    table.add_column("num_envs", justify="right")
    table.add_column("system")
    table.add_column("steps/s", justify="right")
    for b in baselines:
        table.add_column(f"× {b}", justify="right")
    previous = None
    for r, ratio in zip(results, ratios, strict=True):
        if previous is not None and r.env_id != previous:
            table.add_section()
        previous = r.env_id
        cells = [r.env_id, str(r.num_envs), r.system, f"{r.steps_per_s:,.0f}"]
        cells += [f"{ratio[b]:.2f}" if b in ratio else "-" for b in baselines]
        table.add_row(*cells)
    Console().print(table)
