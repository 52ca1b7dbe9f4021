"""Time to score (``benchmarks/train.py``, once ``envfleet bench --train``): the systems'
learning on a tiny budget, the table, the JSON, the plot and the script's command line. No
timed assertion: a few updates on CartPole, about 15 s in all. The PPO it trains is
``examples/ppo.py``'s, tested with the examples (``test_examples.py``)."""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import json
import math
import sys
from pathlib import Path
from types import ModuleType

import pytest

torch = pytest.importorskip("torch")

from envfleet.bench import PUFFER_INSTALL  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def _load_script() -> ModuleType:
    path = ROOT / "benchmarks" / "train.py"
    spec = importlib.util.spec_from_file_location("envfleet_benchmarks_train", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


train = _load_script()
#: Three updates of CartPole-v1 x8 (128 steps per env each).
TINY = dataclasses.replace(train.TRAIN_WORKLOADS["cartpole"], budget=3 * 1024)
SYNC = ["gym-sync", "envfleet", "sb3-subproc"]
HAS_PUFFER = importlib.util.find_spec("pufferlib") is not None


@pytest.fixture(scope="module")
def report() -> train.TrainReport:
    pytest.importorskip("stable_baselines3")
    systems = [*SYNC, "puffer-mp", "sampler", "sampler-prefetch"]
    return train.measure_train(TINY, systems, seeds=(1,))


def _trace(report: train.TrainReport, system: str) -> list[tuple[int, float]]:
    (run,) = next(r for r in report.results if r.system == system).runs
    return [(p.steps, p.mean_return) for p in run.trace]


def test_synchronous_systems_learn_bit_identically(report):
    """gymnasium's SyncVectorEnv, envfleet.make and SB3's SubprocVecEnv see the same
    observations for the same seed and actions: the same steps, returns and weights."""
    reference = _trace(report, "gym-sync")
    assert [steps for steps, _ in reference] == [1024, 2048, 3072]
    assert all(not math.isnan(ret) and ret > 0 for _, ret in reference)
    digests = set()
    for system in SYNC:
        assert _trace(report, system) == reference, system
        (run,) = next(r for r in report.results if r.system == system).runs
        digests.add(run.digest)
        assert run.updates == 3 and run.steps == 3072 and run.episodes > 0
        assert 0 < run.learn_s < run.seconds and run.startup_s >= 0
    assert len(digests) == 1
    assert report.identical == tuple(SYNC)


def test_the_sampler_trains_and_says_which_inference_ran(report):
    result = next(r for r in report.results if r.system == "sampler")
    (run,) = result.runs
    steps = [p.steps for p in run.trace]
    assert steps[0] >= 1024 and steps == sorted(steps) and steps[-1] >= TINY.budget
    assert "inference" in run.note
    assert "sampler" not in report.identical  # its batches are laid out in segments


def test_the_prefetching_sampler_learns_from_batches_collected_during_updates(report):
    """``sampler-prefetch``: every batch after the first was collected during the update
    before it; the run still spends its budget, update after update."""
    (run,) = next(r for r in report.results if r.system == "sampler-prefetch").runs
    steps = [p.steps for p in run.trace]
    assert steps == sorted(steps) and steps[-1] >= TINY.budget and run.updates >= 3
    assert "sampler-prefetch" not in report.identical


def test_pufferlib_runs_or_says_how_to_install_it(report):
    result = next(r for r in report.results if r.system == "puffer-mp")
    if HAS_PUFFER:
        assert result.skipped is None and result.runs[0].steps > 0
    else:
        assert result.runs == () and PUFFER_INSTALL in (result.skipped or "")
        assert f"| puffer-mp | {result.skipped} |" in train.train_table(report)


def test_nothing_reached_on_a_tiny_budget(report):
    for r in report.results:
        if r.runs:
            assert r.reached == 0 and math.isinf(r.seconds) and math.isinf(r.steps)
            assert math.isnan(r.vs_best_peer_seconds) and math.isnan(r.vs_best_peer_steps)
    assert report.best_peer_seconds == "" and report.seeds == (1,) and report.seeds_asked == 1


def test_the_table_has_a_row_per_system_and_the_notes(report):
    table = train.train_table(report)
    assert (
        "| system | reached | seconds to score | vs best peer | env steps to score "
        "| vs best peer | steps/s end to end | learning share | seconds per seed |" in table
    )
    for system in [*SYNC, "sampler"]:
        assert f"| {system} | 0/1 | not reached | - | not reached | - |" in table
    assert "CartPole-v1 x8: time to a mean return of 475" in table
    assert "bit-identical learning" in table and "envfleet, sb3-subproc" in table
    assert "sampler: " in table and "inference" in table


def test_the_json_has_every_field(report):
    doc = train.train_report_dict(report)
    json.dumps(doc, allow_nan=False)  # nan and inf became None
    assert doc["workload"]["env_id"] == "CartPole-v1" and doc["workload"]["budget"] == 3072
    assert doc["workload"]["ppo"]["steps_per_update"] == 128
    assert doc["seeds"] == [1] and doc["identical"] == SYNC
    assert doc["score_episodes"] == train.SCORE_EPISODES == 20
    assert doc["peers"] == ["gym-sync", "gym-async", "sb3-subproc", "puffer-mp"]
    assert doc["machine"]["cores"] >= 1 and "torch" in doc["machine"]["versions"]
    by_system = {r["system"]: r for r in doc["results"]}
    assert list(by_system) == [*SYNC, "puffer-mp", "sampler", "sampler-prefetch"]
    gym = by_system["gym-sync"]
    assert gym["reached"] == 0 and gym["seconds"] is None and gym["steps"] is None
    (run,) = gym["runs"]
    assert set(run) >= {"seed", "reached", "seconds", "steps", "learn_s", "digest", "trace"}
    assert [p["steps"] for p in run["trace"]] == [1024, 2048, 3072]
    assert all(p["seconds"] > 0 and p["mean_return"] > 0 for p in run["trace"])


def test_the_report_comes_back_from_its_json(report):
    doc = json.loads(json.dumps(train.train_report_dict(report)))
    again = train.train_report_from_dict(doc)
    assert train.train_table(again) == train.train_table(report)
    assert again.identical == report.identical and again.results[0].runs == report.results[0].runs
    for r in again.results:
        assert r.skipped is not None or r.steps_per_s > 0


def test_the_plot_is_written(report, tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "train.png"
    width, height = train.plot_train(report, str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and width > height > 0


def test_no_further_seed_past_max_seconds():
    report = train.measure_train(
        dataclasses.replace(TINY, budget=1024), ["gym-sync"], seeds=(1, 2), max_seconds=0.0
    )
    assert report.seeds == (1,) and report.seeds_asked == 2
    assert "seed 1 (1 of the 2 asked: no time left for more)" in train.train_table(report)


@pytest.mark.atari
def test_pong_measures_steps_per_second_with_the_cnn():
    """The workload without a score, shrunk to one update of 2 envs x 16 steps (one epoch):
    the Nature CNN learns bit-identically over gymnasium and envfleet, and the table gives
    steps/s."""
    pytest.importorskip("ale_py")
    pytest.importorskip("cv2")
    pong = train.TRAIN_WORKLOADS["pong"]
    assert pong.policy == "cnn" and pong.atari and not pong.scored
    shrunk = dataclasses.replace(pong.ppo, steps_per_update=16, minibatch_size=16, epochs=1)
    tiny = dataclasses.replace(pong, num_envs=2, budget=32, ppo=shrunk)
    report = train.measure_train(tiny, ["gym-sync", "envfleet"], seeds=(1,))
    runs = [r.runs[0] for r in report.results]
    assert [run.steps for run in runs] == [32, 32] and not any(run.reached for run in runs)
    assert runs[0].digest == runs[1].digest and report.identical == ("gym-sync", "envfleet")
    assert report.best_peer_rate == "gym-sync" and report.results[0].vs_best_peer_rate == 1.0
    table = train.train_table(report)
    assert "ALE/Pong-v5 x2: env steps/s end to end, PPO learning included" in table
    assert "| system | steps/s end to end | vs best peer | seconds | learning share |" in table
    assert "Nature CNN" in table
    doc = json.loads(json.dumps(train.train_report_dict(report), allow_nan=False))
    assert doc["workload"]["target"] is None  # inf: no score
    assert train.train_table(train.train_report_from_dict(doc)) == table


# -- the script's command line ---------------------------------------------------------------


def test_the_script_writes_its_table_json_and_plot(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    md, js, png = tmp_path / "t.md", tmp_path / "t.json", tmp_path / "t.png"
    argv = ["--workload", "cartpole", "--seeds", "1", "--systems", "gym-sync", "--budget", "1024"]
    files = ["--md", str(md), "--json", str(js), "--plot", str(png)]
    assert train.main([*argv, *files, "--note", "A note."]) == 0
    text = md.read_text()
    assert text.startswith("`python benchmarks/train.py --workload cartpole")
    assert "\n\nA note.\n\n" in text and "--note" not in text
    assert "| gym-sync | 0/1 |" in text and text in capsys.readouterr().out
    assert json.loads(js.read_text())["workload"]["name"] == "cartpole"
    assert png.stat().st_size > 0
    md2, png2 = tmp_path / "again.md", tmp_path / "again.png"
    assert train.main(["--render", str(js), "--md", str(md2), "--plot", str(png2)]) == 0
    assert md2.read_text().split("\n")[1:] == text.split("\n")[1:]  # the same table
    assert png2.stat().st_size > 0


def test_the_script_takes_envfleet_bench_trains_options(tmp_path, capsys):
    """``envfleet bench --train cartpole --budget 1024 --seeds 1 --systems gym-sync --json``,
    as the script: the JSON on stdout instead of the table."""
    argv = ["--train", "cartpole", "--budget", "1024", "--seeds", "1", "--systems", "gym-sync"]
    assert train.main([*argv, "--json", "--md", str(tmp_path / "t.md")]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["workload"]["name"] == "cartpole" and doc["workload"]["budget"] == 1024
    assert [r["system"] for r in doc["results"]] == ["gym-sync"]
    assert [p["steps"] for p in doc["results"][0]["runs"][0]["trace"]] == [1024]


@pytest.mark.parametrize(
    "argv",
    [
        ["--train", "atlantis"],
        ["--workload", "cartpole", "--systems", "gym-sync-store"],
        ["--workload", "cartpole", "--seeds", "0"],
        ["--workload", "cartpole", "--budget", "-5"],
    ],
)
def test_bad_script_arguments_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        train.main(argv)
    assert exc.value.code == 2
    assert "error" in capsys.readouterr().err


def test_the_script_and_its_ppo_use_envfleets_public_names_only():
    """What runs outside the package measures envfleet as a user runs it: no ``envfleet._*``
    module and no underscore name of one (``envfleet.bench._core``, ``bench_error``)."""
    for path in (ROOT / "benchmarks" / "train.py", ROOT / "examples" / "ppo.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("envfleet"):
                assert not any(p.startswith("_") for p in node.module.split(".")), node.module
                assert not any(a.name.startswith("_") for a in node.names), node.module
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith("envfleet"):
                        assert not any(p.startswith("_") for p in alias.name.split("."))
