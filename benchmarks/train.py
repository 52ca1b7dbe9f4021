"""Time to score: one PPO trained over every system until it reaches the workload's score.

Workloads (``envfleet.bench.TRAIN_WORKLOADS``), the score being the mean return of the last 20
finished training episodes:

- ``cartpole``: ``CartPole-v1`` x8 to 475, examples/ppo_cartpole.py's hyperparameters (128
  steps per env per update, minibatches of 256, 10 epochs, lr 1e-3 annealed over the budget of
  500,000 env steps);
- ``lunarlander``: ``LunarLander-v3`` x16 to 200, rl-baselines3-zoo's tuned PPO (1024 steps per
  env per update, minibatches of 64, 4 epochs, gamma 0.999, lambda 0.98, ent 0.01, lr 3e-4;
  budget 1,500,000 env steps, half again the zoo's 1,000,000, for the slower seeds);
- ``pong``: ``ALE/Pong-v5`` x8 (Atari-preprocessed: 84x84 grayscale, frameskip 4, 4 frames
  stacked), CleanRL's ppo_atari.py (Nature CNN, 128 steps per env per update, minibatches of
  256, 4 epochs, lr 2.5e-4 annealed, clip 0.1, ent 0.01): no score, the steps/s end to end
  over the first 50,000 env steps (200,000 frames). Needs ale-py and OpenCV.

Systems (``envfleet.bench.TRAIN_SYSTEMS``): gymnasium's ``SyncVectorEnv`` and ``AsyncVectorEnv``
(``AutoresetMode.SAME_STEP``), SB3's ``SubprocVecEnv``, PufferLib's ``Multiprocessing`` (a row
with its install command when pufferlib is missing), ``envfleet.make`` (the processes backend,
``SAME_STEP``) and ``envfleet.Sampler`` (its default inference, ``sample(steps_per_update *
num_envs)`` per update). The same CleanRL-style PPO (torch on the CPU, one thread), model and
seeds run over each; the synchronous systems see the same observations and learn
bit-identically, which the table checks. Each seed runs every system (the order rotated from
seed to seed); the table gives the medians over seeds of the seconds and env steps to the
score, their ratios to the best peer's (gymnasium's two, SB3, PufferLib) and the part of the
time spent learning. This is the code of ``envfleet bench --train`` with files and a time
limit.

Run: ``python benchmarks/train.py --workload cartpole [--seeds 3] [--systems LIST]
[--budget STEPS] [--max-minutes M] [--json FILE] [--plot FILE.png] [--md FILE]``. Needs torch
(and stable-baselines3 for its row; matplotlib for ``--plot``). The Markdown table goes to
stdout and to ``--md`` (default ``benchmarks/results/train-<workload>.md``). ``--render
FILE.json [--plot FILE.png] [--json FILE]`` trains nothing: it writes the table, the plot and
the JSON of a JSON file written before, as the current code writes them.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import sys
import time
from pathlib import Path

from envfleet.bench import (
    TRAIN_SYSTEMS,
    TRAIN_WORKLOADS,
    TrainReport,
    TrainRun,
    measure_train,
    plot_train,
    require_matplotlib,
    require_torch,
    train_report_dict,
    train_report_from_dict,
    train_table,
)

RESULTS = Path(__file__).resolve().parent / "results"


def _systems(text: str) -> list[str]:
    names = [part.strip() for part in text.split(",") if part.strip()]
    for name in names:
        if name not in TRAIN_SYSTEMS:
            raise SystemExit(f"unknown system {name!r}; choose from {', '.join(TRAIN_SYSTEMS)}")
    return list(dict.fromkeys(names))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--workload", choices=tuple(TRAIN_WORKLOADS), default="cartpole")
    parser.add_argument("--seeds", type=int, default=3, help="seeds 1..K (default 3)")
    parser.add_argument("--systems", default=",".join(TRAIN_SYSTEMS), help="comma-separated")
    parser.add_argument("--budget", type=int, default=None, help="env steps per run at most")
    parser.add_argument(
        "--max-minutes",
        type=float,
        default=None,
        help="start no further seed once one more would end past this many minutes",
    )
    parser.add_argument("--json", type=Path, default=None, metavar="FILE", help="write JSON")
    parser.add_argument("--plot", type=Path, default=None, metavar="FILE.png")
    parser.add_argument(
        "--md", type=Path, default=None, metavar="FILE", help="default results/train-<workload>.md"
    )
    parser.add_argument(
        "--note", default="", help="a line for the Markdown file, under the command"
    )
    parser.add_argument(
        "--render",
        type=Path,
        default=None,
        metavar="FILE.json",
        help=(
            "train nothing: write the table (--md), the plot (--plot) and the JSON (--json, in "
            "the current layout) of a --json file written before"
        ),
    )
    args = parser.parse_args(argv)
    if args.render is not None:
        if args.plot is not None:
            require_matplotlib()
        return _render(args.render, args.md, args.plot, args.json, args.note)
    if args.seeds < 1:
        raise SystemExit("--seeds must be >= 1")
    systems = _systems(args.systems)
    workload = TRAIN_WORKLOADS[args.workload]
    if args.budget is not None:
        workload = dataclasses.replace(workload, budget=args.budget)
    require_torch()
    if args.plot is not None:
        require_matplotlib()
    command = _command(argv if argv is not None else sys.argv[1:])

    def progress(system: str, seed: int, run: TrainRun | None) -> None:
        if run is None:
            print(f"  seed {seed}: {system} ...", file=sys.stderr, flush=True)
            return
        if workload.scored:
            reached = "reached" if run.reached else "did not reach"
            outcome = f"{reached} {workload.target:g} after"
        else:
            outcome = "ran"
        print(
            f"  seed {seed}: {system} {outcome} {run.steps:,} steps, "
            f"{run.seconds:.1f} s ({run.learn_s:.1f} s learning)",
            file=sys.stderr,
            flush=True,
        )

    started = time.perf_counter()
    report = measure_train(
        workload,
        systems,
        tuple(range(1, args.seeds + 1)),
        max_seconds=None if args.max_minutes is None else args.max_minutes * 60,
        progress=progress,
    )
    took = time.perf_counter() - started
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    md = args.md or RESULTS / f"train-{args.workload}.md"
    _write(report, command, date, took, md, args.note)
    if args.json is not None:
        doc = {"date": date, "argv": argv if argv is not None else sys.argv[1:]}
        doc.update(train_report_dict(report), note=args.note)
        args.json.write_text(json.dumps(doc, indent=2) + "\n")
    if args.plot is not None:
        plot_train(report, str(args.plot))
        print(f"plot written to {args.plot}", file=sys.stderr)
    return 0


def _command(argv: list[str]) -> str:
    """The command line that ran, less ``--note``'s text (the table shows it apart)."""
    shown, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--note":
            skip = True
        elif not arg.startswith("--note="):
            shown.append(arg)
    return " ".join(["python", "benchmarks/train.py", *shown])


def _write(
    report: TrainReport, command: str, date: str, took: float, md: Path, note: str = ""
) -> None:
    """Print the table, headed by the command that measured it (and ``note``), and write it
    to ``md``."""
    text = f"`{command}` ({date}, {took / 60:.1f} min)\n\n"
    if note:
        text += f"{note}\n\n"
    text += train_table(report)
    print(text, flush=True)
    md.parent.mkdir(parents=True, exist_ok=True)
    md.write_text(text)
    print(f"table written to {md}", file=sys.stderr)


def _render(
    path: Path, md: Path | None, plot: Path | None, out: Path | None, note: str = ""
) -> int:
    """The table (and plot, and JSON ``out`` in the current layout) of a JSON file this script
    wrote, without training again; ``note`` replaces the file's own note when given."""
    doc = json.loads(path.read_text())
    report = train_report_from_dict(doc)
    command = _command(doc.get("argv", []))
    md = md or RESULTS / f"train-{report.workload.name}.md"
    note = note or str(doc.get("note", ""))
    _write(report, command, str(doc.get("date", "")), report.wall_s, md, note)
    if out is not None:
        again = {"date": doc.get("date", ""), "argv": doc.get("argv", [])}
        again.update(train_report_dict(report), note=note)
        out.write_text(json.dumps(again, indent=2) + "\n")
    if plot is not None:
        plot_train(report, str(plot))
        print(f"plot written to {plot}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
