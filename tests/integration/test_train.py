"""Time to score (``envfleet bench --train``, ``benchmarks/train.py``): the systems' learning on
a tiny budget, the advantages, the table, the JSON and the plot. No timed assertion:
a few updates on CartPole, about 10 s in all."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from envfleet.bench import (  # noqa: E402
    PUFFER_INSTALL,
    SCORE_EPISODES,
    TRAIN_WORKLOADS,
    TrainReport,
    gae,
    measure_train,
    plot_train,
    segment_gae,
    train_report_dict,
    train_report_from_dict,
    train_table,
)
from envfleet.cli import main as cli_main  # noqa: E402

#: Three updates of CartPole-v1 x8 (128 steps per env each).
TINY = dataclasses.replace(TRAIN_WORKLOADS["cartpole"], budget=3 * 1024)
SYNC = ["gym-sync", "envfleet", "sb3-subproc"]
HAS_PUFFER = importlib.util.find_spec("pufferlib") is not None


@pytest.fixture(scope="module")
def report() -> TrainReport:
    pytest.importorskip("stable_baselines3")
    return measure_train(TINY, [*SYNC, "puffer-mp", "sampler", "sampler-prefetch"], seeds=(1,))


def _trace(report: TrainReport, system: str) -> list[tuple[int, float]]:
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


def test_stale_steps_take_decoupled_ppo_and_current_ones_plain_ppo():
    """A prefetched batch's steps were chosen by the policy before the last update: they take
    decoupled PPO's objective (clipped around the policy before this update, weighted by its
    ratio to the one that chose them, truncated at 1). With no stale step, or stale steps whose
    weights are 1, it is plain PPO, bit for bit; weights below 1 change the update."""
    from torch.distributions import Categorical

    from envfleet.bench._train import _Learner

    workload = TRAIN_WORKLOADS["cartpole"]
    rng = np.random.default_rng(0)
    n = 256
    obs = rng.normal(size=(n, 4)).astype(np.float32)
    actions = rng.integers(0, 2, n)
    advantages = rng.normal(size=n).astype(np.float32)
    returns = rng.normal(size=n).astype(np.float32)

    def update(stale: np.ndarray | None, behaviour_shift: float = 0.0) -> str:
        learner = _Learner(workload, 3)
        with torch.no_grad():
            logits, _ = learner.policy.forward(learner.policy.prepare(obs))
            logp = Categorical(logits=logits, validate_args=False).log_prob(
                torch.as_tensor(actions)
            )
        behaviour = logp.numpy() - behaviour_shift
        learner.learn(obs, actions, behaviour, advantages, returns, 3e-4, stale)
        return learner.digest()

    plain = update(None)
    assert update(np.zeros(n, dtype=np.bool_)) == plain
    assert update(np.ones(n, dtype=np.bool_)) == plain
    stale = np.ones(n, dtype=np.bool_)
    # A behaviour policy likelier than the proximal one: weights below 1, another update.
    assert update(stale, -0.3) not in (plain, update(None, -0.3))
    # One less likely: weights above 1, truncated to 1 (V-trace's rho), as if current.
    assert update(stale, 0.3) == plain


def test_pufferlib_runs_or_says_how_to_install_it(report):
    result = next(r for r in report.results if r.system == "puffer-mp")
    if HAS_PUFFER:
        assert result.skipped is None and result.runs[0].steps > 0
    else:
        assert result.runs == () and PUFFER_INSTALL in (result.skipped or "")
        assert f"| puffer-mp | {result.skipped} |" in train_table(report)


def test_nothing_reached_on_a_tiny_budget(report):
    for r in report.results:
        if r.runs:
            assert r.reached == 0 and math.isinf(r.seconds) and math.isinf(r.steps)
            assert math.isnan(r.vs_best_peer_seconds) and math.isnan(r.vs_best_peer_steps)
    assert report.best_peer_seconds == "" and report.seeds == (1,) and report.seeds_asked == 1


def test_the_table_has_a_row_per_system_and_the_notes(report):
    table = train_table(report)
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
    doc = train_report_dict(report)
    json.dumps(doc, allow_nan=False)  # nan and inf became None
    assert doc["workload"]["env_id"] == "CartPole-v1" and doc["workload"]["budget"] == 3072
    assert doc["workload"]["ppo"]["steps_per_update"] == 128
    assert doc["seeds"] == [1] and doc["identical"] == SYNC
    assert doc["score_episodes"] == SCORE_EPISODES
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
    doc = json.loads(json.dumps(train_report_dict(report)))
    again = train_report_from_dict(doc)
    assert train_table(again) == train_table(report)
    assert again.identical == report.identical and again.results[0].runs == report.results[0].runs
    for r in again.results:
        assert r.skipped is not None or r.steps_per_s > 0


def test_the_plot_is_written(report, tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "train.png"
    width, height = plot_train(report, str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and width > height > 0


def test_no_further_seed_past_max_seconds():
    report = measure_train(
        dataclasses.replace(TINY, budget=1024), ["gym-sync"], seeds=(1, 2), max_seconds=0.0
    )
    assert report.seeds == (1,) and report.seeds_asked == 2
    assert "seed 1 (1 of the 2 asked: no time left for more)" in train_table(report)


def test_pong_measures_steps_per_second_with_the_cnn():
    """The workload without a score: one update of the Nature CNN (one epoch, to be quick)
    over gymnasium and envfleet, bit-identical, and its table of steps/s."""
    pytest.importorskip("ale_py")
    pytest.importorskip("cv2")
    pong = TRAIN_WORKLOADS["pong"]
    assert pong.policy == "cnn" and pong.atari and not pong.scored
    tiny = dataclasses.replace(pong, budget=1024, ppo=dataclasses.replace(pong.ppo, epochs=1))
    report = measure_train(tiny, ["gym-sync", "envfleet"], seeds=(1,))
    runs = [r.runs[0] for r in report.results]
    assert [run.steps for run in runs] == [1024, 1024] and not any(run.reached for run in runs)
    assert runs[0].digest == runs[1].digest and report.identical == ("gym-sync", "envfleet")
    assert report.best_peer_rate == "gym-sync" and report.results[0].vs_best_peer_rate == 1.0
    table = train_table(report)
    assert "ALE/Pong-v5 x8: env steps/s end to end, PPO learning included" in table
    assert "| system | steps/s end to end | vs best peer | seconds | learning share |" in table
    assert "Nature CNN" in table
    doc = json.loads(json.dumps(train_report_dict(report), allow_nan=False))
    assert doc["workload"]["target"] is None  # inf: no score
    assert train_table(train_report_from_dict(doc)) == table


# -- advantages ------------------------------------------------------------------------------


def test_gae_by_hand():
    # Two steps of one column, the episode ending at the second: 1 + 0.5 * 1 and 1.
    out = gae(np.ones((2, 1)), np.zeros((2, 1)), np.zeros((2, 1)), np.array([[1.0], [0.0]]),
              0.5, 1.0)  # fmt: skip
    np.testing.assert_array_equal(out, [[1.5], [1.0]])


def test_segments_and_the_rollout_layout_give_the_same_advantages():
    """A [T, N] rollout with episode ends, cut into segments (as the Sampler returns it):
    segment_gae gives the same advantages as gae over the rollout."""
    rng = np.random.default_rng(0)
    t_steps, n = 12, 3
    rewards = rng.normal(size=(t_steps, n))
    values = rng.normal(size=(t_steps, n))
    last_values = rng.normal(size=n)
    terminated = rng.random((t_steps, n)) < 0.15
    truncated = ~terminated & (rng.random((t_steps, n)) < 0.1)
    final_values = rng.normal(size=(t_steps, n))
    next_values = np.concatenate([values[1:], last_values[None]])
    next_values = np.where(truncated, final_values, next_values)
    next_values[terminated] = 0.0
    expected = gae(rewards, values, next_values, ~(terminated | truncated), 0.99, 0.95)

    flat_r, flat_v, ends, lengths, order = [], [], [], [], []
    for env in range(n):
        begin = 0
        for t in range(t_steps):
            if terminated[t, env] or truncated[t, env] or t == t_steps - 1:
                rows = list(range(begin, t + 1))
                flat_r += [rewards[r, env] for r in rows]
                flat_v += [values[r, env] for r in rows]
                order += [(r, env) for r in rows]
                ends.append(next_values[t, env])
                lengths.append(len(rows))
                begin = t + 1
    got = segment_gae(np.array(flat_r), np.array(flat_v), np.array(ends), np.array(lengths),
                      0.99, 0.95)  # fmt: skip
    np.testing.assert_allclose(got, [expected[r, env] for r, env in order], rtol=1e-12)


# -- the command line and the script ---------------------------------------------------------


def test_cli_train_json(capsys):
    argv = ["bench", "--train", "cartpole", "--budget", "1024", "--seeds", "1"]
    assert cli_main([*argv, "--systems", "gym-sync", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["workload"]["name"] == "cartpole" and doc["workload"]["budget"] == 1024
    assert [r["system"] for r in doc["results"]] == ["gym-sync"]
    assert [p["steps"] for p in doc["results"][0]["runs"][0]["trace"]] == [1024]


@pytest.mark.parametrize(
    "argv",
    [
        ["bench", "--train", "atlantis"],
        ["bench", "--train", "cartpole", "--systems", "gym-sync-store"],
        ["bench", "--train", "cartpole", "--seeds", "0"],
        ["bench", "--policy", "mlp", "--systems", "sb3-subproc"],
    ],
)
def test_bad_train_arguments_exit_2(argv, capsys):
    try:
        status = cli_main(argv)
    except SystemExit as exc:  # argparse's own errors
        status = int(exc.code or 0)
    assert status == 2
    assert "error" in capsys.readouterr().err


def _load_script() -> ModuleType:
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "train.py"
    spec = importlib.util.spec_from_file_location("envfleet_benchmarks_train", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_the_script_writes_its_table_json_and_plot(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    script = _load_script()
    md, js, png = tmp_path / "t.md", tmp_path / "t.json", tmp_path / "t.png"
    argv = ["--workload", "cartpole", "--seeds", "1", "--systems", "gym-sync", "--budget", "1024"]
    files = ["--md", str(md), "--json", str(js), "--plot", str(png)]
    assert script.main([*argv, *files, "--note", "A note."]) == 0
    text = md.read_text()
    assert text.startswith("`python benchmarks/train.py --workload cartpole")
    assert "\n\nA note.\n\n" in text and "--note" not in text
    assert "| gym-sync | 0/1 |" in text and text in capsys.readouterr().out
    assert json.loads(js.read_text())["workload"]["name"] == "cartpole"
    assert png.stat().st_size > 0
    md2, png2 = tmp_path / "again.md", tmp_path / "again.png"
    assert script.main(["--render", str(js), "--md", str(md2), "--plot", str(png2)]) == 0
    assert md2.read_text().split("\n")[1:] == text.split("\n")[1:]  # the same table
    assert png2.stat().st_size > 0
