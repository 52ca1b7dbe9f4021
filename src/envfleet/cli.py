"""The ``envfleet`` command line (layer 1 in docs/architecture.md), built on the public API only.

``envfleet bench [ENV_ID ...]`` measures env steps per second of envfleet's backends and of
their peers (gymnasium's vector envs, SB3's SubprocVecEnv, EnvPool, PufferLib: every one
installed; see :mod:`envfleet.bench`), swept over ``--num-envs 4,16,64``, beside the machine's
limit, and prints a table; ``--json [FILE]`` writes the raw figures (to stdout without FILE,
instead of the table) and ``--plot FILE.png`` draws them (matplotlib, the ``plot`` extra).
``envfleet bench --policy {mlp,cnn}`` measures the learner's loop instead
(observations -> a torch policy -> step; :func:`envfleet.bench.measure_policy_loop`): every
system's steps/s, its fraction of the overlap bound and its ratio to the faster gymnasium
loop. The time to score, which ``envfleet bench --train`` measured, is the repository's
script ``benchmarks/train.py`` (the same options): ``--train`` says so. This module is the
only place where envfleet prints.

``envfleet tune ENV`` measures which vector env or Sampler to use for an env and a policy on
this machine (:func:`envfleet.bench.tune`): every candidate's steps/s with the policy in the
loop, then the ``envfleet.make(...)`` or ``envfleet.Sampler(...)`` call to use.

``envfleet replay PATH`` reproduces a failure saved with ``err.replay.save(PATH)``
(:mod:`envfleet._core.replay_runner`): exit status 0 when it happened again, 1 when not, 2 for
a file that is not a replay.

Exit status: 0 on success, 1 when a system failed while being measured, 2 for bad arguments
(argparse's convention; also an unknown env id or a missing ale-py), 130 on Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import pickle
import sys
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import envfleet
from envfleet import ConfigError, ReplayFileError
from envfleet._core.replay_runner import ReplayOutcome, watch_replay
from envfleet.bench import (
    BASELINES,
    LIMIT,
    PEERS,
    POLICY_SYSTEMS,
    BenchError,
    BenchProgress,
    BenchReport,
    baseline_ratios,
    bench_rows,
    check_gymnasium_id,
    run_bench,
    unavailable,
)

_R = TypeVar("_R")  # a measurement's report

__all__ = ["main"]

DEFAULT_ENV_ID = "CartPole-v1"
#: --num-envs of the plain bench when not given (the --policy workloads have their own).
DEFAULT_NUM_ENVS = (4, 16)
#: --seconds when not given: the plain bench's default run (CartPole-v1 and ALE/Pong-v5, every
#: installed peer) then takes about two minutes on two cores.
DEFAULT_SECONDS = 2.0
#: envfleet tune's --num-envs when not given, by --policy ("cnn": an Atari workload's).
DEFAULT_TUNE_NUM_ENVS = {"mlp": 16, "cnn": 8}
#: envfleet tune's --seconds when not given (timed seconds per measurement).
DEFAULT_TUNE_SECONDS = 1.0


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``envfleet`` command line with ``argv`` (default: ``sys.argv[1:]``).

    Returns the exit status; argparse errors (bad arguments, ``--help``, ``--version``) exit
    through ``SystemExit`` as argparse does, with status 2 for errors.
    """
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command == "bench":
        return _bench(args)
    if args.command == "replay":
        return _replay(args)
    if args.command == "tune":
        return _tune(args)
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
        help="measure env steps/s of envfleet's backends and of other vector envs",
        description=(
            "Measure env steps per second (summed over all sub-environments) of envfleet's "
            "backends and of their peers (gymnasium's SyncVectorEnv/AsyncVectorEnv, SB3's "
            "SubprocVecEnv, EnvPool on its native tasks, PufferLib's multiprocessing vector "
            "env), one system after the other, with random actions drawn in advance, beside "
            "the machine's limit (one plain env loop per usable core, summed). Ratios compare "
            "each system with the limit and with each gymnasium vector env (higher is faster)."
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
        type=_int_list,
        default=None,
        metavar="N[,N...]",
        help=(
            "sub-environments per system; a comma-separated list sweeps, e.g. 4,16,64 "
            f"(default: {','.join(map(str, DEFAULT_NUM_ENVS))}; with --policy mlp: 16, "
            "cnn: 8)"
        ),
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
        "--peers",
        type=_names(PEERS, "peer"),
        default=None,
        metavar="LIST",
        help=(
            f"comma-separated peers ({', '.join(PEERS)}), or 'none' (default: every one "
            "installed; one that is missing is left out with a note saying how to install it)"
        ),
    )
    bench.add_argument(
        "--baselines",
        type=_names(PEERS, "peer"),
        dest="peers",
        metavar="LIST",
        help="the older name of --peers",
    )
    bench.add_argument(
        "--seconds",
        type=_positive_float,
        default=None,
        metavar="S",
        help=(
            f"timed seconds per system, on top of startup and warm-up (default: "
            f"{DEFAULT_SECONDS:g})"
        ),
    )
    bench.add_argument(
        "--json",
        nargs="?",
        const="-",
        default=None,
        type=_json_file,
        metavar="FILE",
        help=(
            "write the raw figures as one JSON document (a list of results with ratios, the "
            "limit and the machine) to FILE (a .json name), or, without FILE, print it "
            "instead of the table"
        ),
    )
    bench.add_argument(
        "--plot",
        default=None,
        metavar="FILE.png",
        help=(
            "draw steps/s against num_envs for every system, with the limit line, into "
            "FILE.png (needs matplotlib: pip install 'envfleet[plot]')"
        ),
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
        default=None,
        metavar="LIST",
        help=f"with --policy: comma-separated systems (default: {','.join(POLICY_SYSTEMS)})",
    )
    # The time to score moved out of the package (a library of vector envs ships no PPO):
    # --train, hidden, says where it went.
    bench.add_argument("--train", nargs="?", action=_MovedToScript, help=argparse.SUPPRESS)
    bench.add_argument(
        "--repeats",
        type=_positive_int,
        default=1,
        metavar="R",
        help="repetitions, systems interleaved; medians are reported (default: 1)",
    )
    replay = commands.add_parser(
        "replay",
        help="reproduce a failure saved with err.replay.save(PATH), in one process",
        description=(
            "Rebuild the envs of a replay file (err.replay.save(PATH) of an EnvError, "
            "EnvCrashedError or StepTimeoutError) in a child process, step them to the "
            "failure and say whether it happened again: the same exception, the same signal "
            "(a segfault's stack comes from the child's faulthandler) or the same hang "
            "(reported at the call that does not return). Exit status 0: reproduced; 1: not "
            "reproduced; 2: not a replay file. A replay file holds pickled factories: load "
            "only files you made, as torch.load warns."
        ),
    )
    replay.add_argument("path", metavar="PATH", help="a file written by Replay.save")
    replay.add_argument(
        "--timeout",
        type=_positive_float,
        default=None,
        metavar="S",
        help=(
            "seconds an env call may take before it counts as hung (default: the recorded "
            "step timeout for a hang, else none)"
        ),
    )
    replay.add_argument(
        "--pdb",
        action="store_true",
        help=(
            "then run it again in this process under pdb: post mortem at an exception, or "
            "stopped just before the call that crashes or hangs"
        ),
    )
    _tune_parser(commands)
    return parser


def _tune_parser(commands: Any) -> None:
    tune = commands.add_parser(
        "tune",
        help="measure which envfleet.make()/Sampler call runs your env and policy fastest here",
        description=(
            "Measure, on this machine, each candidate way to run NUM_ENVS copies of ENV with "
            "a policy choosing every action: backends serial, threads and processes, worker "
            "counts up to the usable cores, driver_envs 0 and its default, a first-ready pool "
            "(batch_size NUM_ENVS/2: recv -> policy -> send), and the Sampler's driver and "
            "worker inference. make() candidates run the loop a learner writes (storing "
            "observations, actions, rewards and dones into preallocated arrays), Sampler "
            "candidates Sampler.sample. Each is timed for --seconds, the fastest three again; "
            "threads is skipped when even perfect scaling of serial could not come within "
            "half the best. Prints a table (candidate, steps/s, ratio to the best) and the "
            "call to use. Exit status: 0; 1 when every candidate failed; 2 for bad arguments "
            "(an unknown env id, a policy spec that does not import or fails on the env's "
            "observations)."
        ),
        epilog=(
            "--policy module:fn: fn(observation_space, action_space), given one env's "
            "spaces, returns the policy: a callable on a batch of observations ([n, "
            "*obs_shape], numpy) returning n actions ([n, *act_shape], numpy or CPU torch), "
            "or (actions, infos) as envfleet.Sampler takes it. It must pickle (cloudpickle) "
            "for worker inference, else those candidates are skipped. Example: envfleet tune "
            "CartPole-v1 --policy mypolicies:make_policy (mypolicies.py in the current "
            "directory or on PYTHONPATH)."
        ),
    )
    tune.add_argument(
        "env",
        metavar="ENV",
        help=(
            "a gymnasium id (CartPole-v1; gymnasium's module:EnvId; ALE/ ids are "
            "Atari-preprocessed to uint8[4, 84, 84] as envfleet bench --policy does) or "
            "module:factory, a zero-argument function returning a gymnasium.Env"
        ),
    )
    tune.add_argument(
        "--num-envs",
        type=_positive_int,
        default=None,
        metavar="N",
        help=(
            "sub-environments (default: "
            + ", ".join(f"{n} with --policy {p}" for p, n in DEFAULT_TUNE_NUM_ENVS.items())
            + f", else {DEFAULT_TUNE_NUM_ENVS['mlp']})"
        ),
    )
    tune.add_argument(
        "--policy",
        type=_policy_spec,
        default="mlp",
        metavar="mlp|cnn|module:fn",
        help=(
            "the policy in the loop: mlp (CleanRL's PPO actor, 64-64 tanh), cnn (the Nature "
            "CNN, for Atari frames), both on the CPU with torch, or module:fn (see below) "
            "(default: mlp)"
        ),
    )
    tune.add_argument(
        "--seconds",
        type=_positive_float,
        default=DEFAULT_TUNE_SECONDS,
        metavar="S",
        help=f"timed seconds per measurement (default: {DEFAULT_TUNE_SECONDS:g})",
    )
    tune.add_argument(
        "--json",
        nargs="?",
        const="-",
        default=None,
        type=_json_file,
        metavar="FILE",
        help=(
            "write the report (every candidate, the winner, its call) as JSON to FILE (a "
            ".json name), or, without FILE, print it instead of the table"
        ),
    )


class _MovedToScript(argparse.Action):
    """``--train``: an argparse error (exit status 2) naming the script it moved to."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        workload = values if isinstance(values, str) else "cartpole"
        parser.error(
            "--train moved out of envfleet (a library of vector envs ships no PPO): the time "
            "to score is the script benchmarks/train.py of envfleet's repository, with the "
            f"same options: python benchmarks/train.py --workload {workload} [--seeds K] "
            "[--systems LIST] [--budget STEPS] [--json [FILE]] [--plot FILE.png]"
        )


def _policy_spec(text: str) -> str:
    if text in ("mlp", "cnn"):
        return text
    module, _, name = text.partition(":")
    if not module or not name:
        raise argparse.ArgumentTypeError(
            f"expected mlp, cnn or module:fn, got {text!r} (module:fn returns your policy)"
        )
    return text


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _int_list(text: str) -> list[int]:
    values = [_positive_int(part.strip()) for part in text.split(",") if part.strip()]
    if not values:
        raise argparse.ArgumentTypeError(f"expected N or N,N,..., got {text!r}")
    return list(dict.fromkeys(values))


def _json_file(text: str) -> str:
    # A FILE that is not a .json name is most likely an env id after a bare --json.
    if text != "-" and not text.lower().endswith(".json"):
        raise argparse.ArgumentTypeError(
            f"expected a .json file name or '-', got {text!r} (put env ids before --json)"
        )
    return text


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


def _replay(args: argparse.Namespace) -> int:
    try:
        outcome = watch_replay(args.path, args.timeout)
    except (ReplayFileError, OSError, pickle.UnpicklingError) as exc:
        print(f"envfleet replay: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    if outcome.how == "completed":
        print(f"not reproduced: {outcome.calls} env calls ran and none failed")
        return 1
    where = (
        f"sub-environment {outcome.env_index} {outcome.how} in "
        + ("the reset that began its episode" if outcome.step == 0 else f"step {outcome.step}")
        + f" of its episode: {outcome.detail} ({outcome.calls} env calls)"
    )
    print(f"{'reproduced' if outcome.reproduced else 'not reproduced, another failure'}: {where}")
    if args.pdb:
        _replay_under_pdb(args.path, outcome)
    return 0 if outcome.reproduced else 1


def _replay_under_pdb(path: str, outcome: ReplayOutcome) -> None:
    """Run the replay again here: post mortem at its exception, or stopped before the call
    that crashed or hung."""
    import pdb  # noqa: T100  (asked for: --pdb)

    if outcome.how == "raised":
        try:
            envfleet.replay(path)
        except Exception as exc:
            pdb.post_mortem(exc.__traceback__)
        return
    print(f"stopping before that call; continuing {outcome.how} here as in the child")
    assert outcome.env_index is not None and outcome.step is not None
    envfleet.replay(path, stop_at=(outcome.env_index, outcome.step))


def _bench(args: argparse.Namespace) -> int:
    if args.policy is not None:
        return _bench_policy(args)
    sizes: list[int] = args.num_envs or list(DEFAULT_NUM_ENVS)
    seconds: float = args.seconds or DEFAULT_SECONDS
    env_ids: list[str] = list(dict.fromkeys(args.env_ids)) or [DEFAULT_ENV_ID]
    peers: list[str] = list(PEERS) if args.peers is None else args.peers
    systems: list[str] = [*args.backends, *peers]
    if not systems:
        return _error("nothing to measure: --backends and --peers are both 'none'")
    try:
        for env_id in env_ids:  # before anything runs: unknown ids, missing ale-py
            check_gymnasium_id(env_id)
        if args.plot is not None:
            from envfleet.bench import require_matplotlib

            require_matplotlib()
    except ConfigError as exc:
        return _error(str(exc))
    skipped = unavailable(env_ids, systems)
    for note in dict.fromkeys(s.reason for s in skipped):
        print(f"envfleet bench: left out: {note}", file=sys.stderr)
    left_out = {(s.env_id, s.system) for s in skipped}
    active = {e: [s for s in systems if (e, s) not in left_out] for e in env_ids}
    if not any(active.values()):
        return _error("nothing to measure: every system asked for is left out (see above)")
    total = sum(args.repeats * (1 + len(sizes) * len(active[e])) for e in env_ids)

    def measure() -> Any:
        with _ProgressDisplay(total, seconds, enabled=args.json != "-") as on_progress:
            return run_bench(
                env_ids, sizes, systems, seconds, repeats=args.repeats, progress=on_progress
            )

    report = _measured(measure)
    if isinstance(report, int):
        return report

    if args.json is not None:
        _write_json(bench_rows(report), args.json)
    if args.json != "-":
        _print_table(report)
    if args.plot is not None:
        from envfleet.bench import plot_report

        return _write_plot(plot_report, report, args.plot)
    return 0


def _write_plot(plot: Callable[[Any, str], Any], report: Any, path: str) -> int:
    """Draw ``report`` with ``plot`` into ``path``: exit status 0, or 1 with the reason on
    stderr when the file cannot be written."""
    try:
        plot(report, path)
    except OSError as exc:
        return _error(f"cannot write the plot {path}: {exc}", status=1)
    print(f"envfleet bench: plot written to {path}", file=sys.stderr)
    return 0


def _write_json(doc: Any, target: str, command: str = "bench") -> None:
    text = json.dumps(doc, indent=2) + "\n"
    if target == "-":
        sys.stdout.write(text)
        return
    with open(target, "w", encoding="utf-8") as f:
        f.write(text)
    print(f"envfleet {command}: raw figures written to {target}", file=sys.stderr)


def _bench_policy(args: argparse.Namespace) -> int:
    from envfleet.bench import (
        check_workload,
        measure_policy_loop,
        policy_report_dict,
        policy_table,
        require_torch,
        workloads,
    )

    systems = list(POLICY_SYSTEMS) if args.systems is None else args.systems
    if not systems:
        return _error("nothing to measure: --systems is 'none'")
    if args.plot is not None:
        return _error("--plot draws the env-stepping bench; it does not apply with --policy")
    seconds: float = args.seconds or DEFAULT_SECONDS
    try:
        require_torch()
        env_ids = list(dict.fromkeys(args.env_ids))
        chosen = [w for n in (args.num_envs or [None]) for w in workloads(args.policy, env_ids, n)]
        for w in chosen:
            check_gymnasium_id(w.env_id)
            check_workload(w)
    except ConfigError as exc:
        return _error(str(exc))
    show = args.json != "-" and sys.stderr.isatty()

    def on_progress(name: str, system: str, rep: int) -> None:
        if show:
            print(f"  {name}: {system} (repetition {rep + 1})", file=sys.stderr)

    reports = _measured(
        lambda: [
            measure_policy_loop(w, systems, seconds, repeats=args.repeats, progress=on_progress)
            for w in chosen
        ]
    )
    if isinstance(reports, int):
        return reports
    if args.json is not None:
        _write_json([policy_report_dict(r) for r in reports], args.json)
    if args.json != "-":
        for r in reports:
            print(policy_table(r))
    return 0


def _measured(measure: Callable[[], _R], command: str = "bench") -> _R | int:
    """``measure()``'s report, or the exit status its failure gives, said on stderr: 2 for a
    ``ConfigError`` (bad arguments), 1 for a ``BenchError`` (a system failed), 130 for
    Ctrl-C."""
    try:
        return measure()
    except ConfigError as exc:
        return _error(str(exc), command=command)
    except BenchError as exc:
        return _error(str(exc), status=1, command=command)
    except KeyboardInterrupt:
        print(f"envfleet {command}: interrupted", file=sys.stderr)
        return 130


def _error(message: str, status: int = 2, command: str = "bench") -> int:
    print(f"envfleet {command}: error: {message}", file=sys.stderr)
    return status


# -- tune ----------------------------------------------------------------------------------


def _tune(args: argparse.Namespace) -> int:
    from envfleet.bench import TuneProgress, tune, tune_report_dict, tune_table

    num_envs: int = args.num_envs or DEFAULT_TUNE_NUM_ENVS.get(
        args.policy, DEFAULT_TUNE_NUM_ENVS["mlp"]
    )
    show = args.json != "-" and sys.stderr.isatty()

    def on_progress(event: TuneProgress) -> None:
        if not show or event.phase == "start":
            return
        again = " (again)" if event.round > 1 else ""
        if event.phase == "done":
            print(f"  {event.candidate}{again}: {event.steps_per_s:,.0f} steps/s", file=sys.stderr)
        else:
            print(f"  {event.candidate}: {event.detail}", file=sys.stderr)

    report = _measured(
        lambda: tune(args.env, num_envs, args.policy, seconds=args.seconds, progress=on_progress),
        command="tune",
    )
    if isinstance(report, int):
        return report
    if args.json is not None:
        try:
            _write_json(tune_report_dict(report), args.json, command="tune")
        except OSError as exc:
            return _error(f"cannot write {args.json}: {exc}", status=1, command="tune")
    if args.json != "-":
        print(tune_table(report), end="")
    return 0


class _ProgressDisplay:
    """A rich progress bar on stderr over the whole run (every measurement, the limits
    included), naming the one running; a no-op when disabled.

    Enabled only when stderr is a terminal and the JSON document does not go to stdout.
    Entering it gives the callback for :func:`envfleet.bench.run_bench`.
    """

    def __init__(self, total: int, seconds: float, *, enabled: bool):
        self.enabled = enabled and sys.stderr.isatty()
        self.total, self.seconds = total, seconds
        self.done = 0
        self.progress: Any = None
        self.task: Any = None

    def __enter__(self) -> Any:
        if not self.enabled:
            return None
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            Progress,
            SpinnerColumn,
            TextColumn,
            TimeElapsedColumn,
        )

        self.progress = Progress(
            SpinnerColumn(),
            TextColumn("[{task.fields[count]}/{task.total:.0f}]"),
            TextColumn("{task.description}"),
            BarColumn(),
            TextColumn("{task.fields[status]}"),
            TimeElapsedColumn(),
            console=Console(stderr=True),
            transient=True,
            refresh_per_second=5,  # the display thread competes with the systems measured
        )
        self.task = self.progress.add_task(
            "starting", total=self.total, count=0, status="", start=True
        )
        self.progress.start()
        return self.update

    def update(self, event: BenchProgress) -> None:
        if event.system == LIMIT:
            what = f"{event.env_id} limit (one plain env loop)"
        else:
            what = f"{event.env_id} x{event.num_envs} {event.system}"
        if event.phase == "start":
            status = "starting"
        elif event.phase == "warmup":
            status = "warming up"
        elif event.phase == "measure":
            status = f"{event.steps_per_s:,.0f} steps/s" if event.batch_steps else "measuring"
        else:
            status = f"{event.steps_per_s:,.0f} steps/s"
            self.done += 1
        part = 0.0
        if event.phase == "measure" and event.budget_s > 0:
            part = min(1.0, event.elapsed_s / event.budget_s)
        self.progress.update(
            self.task,
            completed=self.done + part,
            description=what,
            status=status,
            count=min(self.done + (event.phase != "done"), self.total),
        )

    def __exit__(self, *exc: object) -> None:
        if self.progress is not None:
            self.progress.stop()


def _print_table(report: BenchReport) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    results = list(report.results)
    ratios = baseline_ratios(results)
    limits = {lim.env_id: lim for lim in report.limits}
    baselines = [b for b in BASELINES if any(b in r for r in ratios)]
    caption = [
        f"steps/s: env steps summed over sub-envs; {report.seconds:g} s per system"
        + (f", median of {report.repeats} repetitions" if report.repeats > 1 else ""),
        f"limit: {report.machine.cores} cores × one plain env loop: "
        + ", ".join(f"{e} {lim.steps_per_s:,.0f}" for e, lim in limits.items()),
    ]
    for note in dict.fromkeys(s.reason for s in report.skipped):
        caption.append(f"left out: {note}")
    table = Table(caption=escape("\n".join(caption)))  # "[sb3]" is not rich markup
    table.add_column("env id")
    table.add_column("num_envs", justify="right")
    table.add_column("system")
    table.add_column("steps/s", justify="right")
    table.add_column("× limit", justify="right")
    for b in baselines:
        table.add_column(f"× {b}", justify="right")
    previous = None
    for r, ratio in zip(results, ratios, strict=True):
        if previous is not None and (r.env_id, r.num_envs) != previous:
            table.add_section()
        previous = (r.env_id, r.num_envs)
        limit = limits.get(r.env_id)
        cells = [r.env_id, str(r.num_envs), r.system, f"{r.steps_per_s:,.0f}"]
        cells.append(f"{r.steps_per_s / limit.steps_per_s:.2f}" if limit else "-")
        cells += [f"{ratio[b]:.2f}" if b in ratio else "-" for b in baselines]
        table.add_row(*cells)
    Console().print(table)
