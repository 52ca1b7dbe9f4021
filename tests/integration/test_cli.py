"""The ``envfleet`` command line: real benchmark runs in a subprocess, no mocks.

Only structure and consistency are checked, never speed (DESIGN §6: no timed assertions).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

import envfleet
from envfleet.cli import main

SYSTEMS = ["serial", "threads", "processes", "gym-sync", "gym-async"]
BASELINES = ["gym-sync", "gym-async"]


def envfleet_cmd() -> list[str]:
    """The installed console script next to this interpreter, else ``python -m envfleet``."""
    script = Path(sys.executable).with_name("envfleet")
    return [str(script)] if script.exists() else [sys.executable, "-m", "envfleet"]


def run(*args: str, cmd: list[str] | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": "120", "PYTHONIOENCODING": "utf-8"}
    return subprocess.run(
        [*(cmd or envfleet_cmd()), *args],
        capture_output=True,
        text=True,
        encoding="utf-8",
        env=env,
        timeout=90,
    )


def check_results(doc: list[dict], env_id: str, num_envs: int, systems, baselines) -> None:
    assert isinstance(doc, list)
    assert [r["system"] for r in doc] == systems
    by_system = {r["system"]: r for r in doc}
    for r in doc:
        assert r["env_id"] == env_id
        assert r["num_envs"] == num_envs
        assert r["steps_per_s"] > 0
        assert r["batch_steps"] > 0
        assert r["seconds"] > 0
        assert r["startup_s"] >= 0
        assert math.isclose(
            r["steps_per_s"], num_envs * r["batch_steps"] / r["seconds"], rel_tol=1e-9
        )
        assert sorted(r["ratios"]) == sorted(baselines)
        for b, ratio in r["ratios"].items():
            expected = r["steps_per_s"] / by_system[b]["steps_per_s"]
            assert math.isclose(ratio, expected, rel_tol=1e-9), (r["system"], b)
    for b in baselines:
        assert by_system[b]["ratios"][b] == pytest.approx(1.0)


def test_bench_json_all_systems():
    proc = run("bench", "CartPole-v1", "--num-envs", "4", "--seconds", "0.3", "--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)  # the whole of stdout is one JSON document
    check_results(doc, "CartPole-v1", 4, SYSTEMS, BASELINES)


def test_bench_table_names_every_system():
    proc = run(
        "bench", "--num-envs", "2", "--seconds", "0.2", "--backends", "serial,threads,processes"
    )
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "CartPole-v1" in out  # the default env id
    for system in SYSTEMS:
        assert system in out
    for column in ("steps/s", "× gym-sync", "× gym-async"):
        assert column in out
    assert "━" not in proc.stderr  # no progress display when stderr is not a terminal


def test_bench_json_without_baselines():
    proc = run(
        "bench", "--num-envs", "2", "--seconds", "0.1", "--baselines", "none",
        "--backends", "serial", "--json",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    check_results(json.loads(proc.stdout), "CartPole-v1", 2, ["serial"], [])


def test_bad_backend_is_an_error():
    proc = run("bench", "--backends", "serial,bogus", "--seconds", "0.1")
    assert proc.returncode != 0
    assert "bogus" in proc.stderr
    assert proc.stdout == ""


def test_unknown_env_id_is_an_error():
    proc = run("bench", "NoSuchEnv-v0", "--seconds", "0.1")
    assert proc.returncode == 2
    assert "NoSuchEnv-v0" in proc.stderr
    assert proc.stdout == ""


def test_missing_ale_py_says_what_to_install():
    # ale-py made unimportable in the child, whether or not it is installed here.
    code = (
        "import sys; sys.modules['ale_py'] = None\n"
        "from envfleet.cli import main\n"
        "sys.exit(main(['bench', 'ALE/Pong-v5']))\n"
    )
    proc = run(cmd=[sys.executable, "-c", code])
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1
    assert "pip install 'envfleet[atari]'" in lines[0]


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["frobnicate"],
        ["bench", "--num-envs", "0"],
        ["bench", "--seconds", "-1"],
        ["bench", "--baselines", "gym-magic"],
    ],
)
def test_bad_arguments_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert "error" in capsys.readouterr().err


def test_version():
    proc = run("--version")
    assert proc.returncode == 0
    assert proc.stdout.strip() == f"envfleet {envfleet.__version__}"


def test_python_dash_m():
    proc = run("--version", cmd=[sys.executable, "-m", "envfleet"])
    assert proc.returncode == 0
    assert envfleet.__version__ in proc.stdout


@pytest.mark.atari
def test_bench_atari():
    pytest.importorskip("ale_py")
    proc = run(
        "bench", "ALE/Pong-v5", "--num-envs", "2", "--seconds", "0.3",
        "--backends", "processes", "--baselines", "gym-sync", "--json",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    check_results(
        json.loads(proc.stdout), "ALE/Pong-v5", 2, ["processes", "gym-sync"], ["gym-sync"]
    )


# -- envfleet bench --policy (the learner's loop) ------------------------------------------

POLICY_SYSTEMS = [
    "gym-sync", "gym-async", "puffer-sync", "puffer-async", "envfleet", "envfleet-pool",
    "sampler", "sampler-driver", "sampler-worker",
]  # fmt: skip


def check_policy_report(report: dict, env_id: str, num_envs: int, policy: str) -> None:
    assert (report["env_id"], report["num_envs"], report["policy"]) == (env_id, num_envs, policy)
    bound = report["bound"]
    assert bound["t_policy_s"] > 0 and bound["t_env_s"] > 0 and bound["cores"] >= 1
    expected = num_envs / max(
        bound["t_policy_s"], (bound["t_policy_s"] + num_envs * bound["t_env_s"]) / bound["cores"]
    )
    assert math.isclose(bound["steps_per_s"], expected, rel_tol=1e-9)
    assert [r["system"] for r in report["results"]] == POLICY_SYSTEMS
    for r in report["results"]:
        if r["skipped"] is not None:  # PufferLib not installed
            assert r["system"].startswith("puffer")
            assert "pip install pufferlib-core" in r["skipped"]
            assert r["steps_per_s"] is None and r["runs"] == []
            continue
        assert r["steps_per_s"] > 0
        assert math.isclose(r["of_bound"], r["steps_per_s"] / bound["steps_per_s"], rel_tol=1e-9)
        assert r["vs_best_gym"] > 0


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch")
def test_bench_policy_mlp_prints_every_system():
    proc = run("bench", "--policy", "mlp", "--num-envs", "2", "--seconds", "0.1")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "CartPole-v1 x2, mlp policy: bound" in out
    for column in ("steps/s", "of bound", "vs best gym"):
        assert column in out
    rows = [line for line in out.splitlines() if line.startswith("| ") and "---" not in line]
    assert [row.split("|")[1].strip() for row in rows[1:]] == POLICY_SYSTEMS


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch")
def test_bench_policy_json():
    proc = run(
        "bench", "--policy", "mlp", "LunarLander-v3", "--num-envs", "2", "--seconds", "0.1",
        "--repeats", "2", "--json",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert len(doc) == 1
    check_policy_report(doc[0], "LunarLander-v3", 2, "mlp")
    assert doc[0]["repeats"] == 2


@pytest.mark.atari
def test_bench_policy_cnn_prints_every_system():
    pytest.importorskip("torch")
    pytest.importorskip("ale_py")
    pytest.importorskip("cv2")  # AtariPreprocessing resizes with OpenCV
    proc = run("bench", "--policy", "cnn", "--num-envs", "2", "--seconds", "0.1", "--json")
    assert proc.returncode == 0, proc.stderr
    check_policy_report(json.loads(proc.stdout)[0], "ALE/Pong-v5", 2, "cnn")


def test_bench_policy_without_torch_says_how_to_install_it():
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "from envfleet.cli import main\n"
        "sys.exit(main(['bench', '--policy', 'mlp']))\n"
    )
    proc = run(cmd=[sys.executable, "-c", code])
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1
    assert "pip install 'envfleet[torch]'" in lines[0]
    assert proc.stdout == ""


@pytest.mark.parametrize(
    "argv",
    [
        ["bench", "--policy", "rnn"],
        ["bench", "--policy", "mlp", "--systems", "gym-sync,bogus"],
        ["bench", "--policy", "mlp", "--repeats", "0"],
    ],
)
def test_bad_policy_arguments_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert "error" in capsys.readouterr().err
