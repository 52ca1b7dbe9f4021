"""The ``envfleet`` command line: real benchmark runs in a subprocess, no mocks.

Only structure and consistency are checked, never speed (no timed assertions).
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
# The optional peers, in the table's order, with the module each needs.
OPTIONAL_PEERS = {
    "sb3-subproc": "stable_baselines3",
    "envpool-native": "envpool",
    "puffer-mp": "pufferlib",
}
INSTALLED_PEERS = [p for p, m in OPTIONAL_PEERS.items() if importlib.util.find_spec(m)]


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
    # Every installed peer by default (CartPole-v1 is one of EnvPool's native tasks).
    proc = run("bench", "CartPole-v1", "--num-envs", "4", "--seconds", "0.3", "--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)  # the whole of stdout is one JSON document
    check_results(doc, "CartPole-v1", 4, SYSTEMS + INSTALLED_PEERS, BASELINES)
    for peer in OPTIONAL_PEERS:  # a missing peer is named on stderr with its install command
        assert (peer in proc.stderr) == (peer not in INSTALLED_PEERS)


def check_limit_and_machine(doc: list[dict]) -> None:
    limits = {r["env_id"]: r["limit_steps_per_s"] for r in doc}
    for r in doc:
        assert r["limit_steps_per_s"] == limits[r["env_id"]] > 0
        assert math.isclose(r["of_limit"], r["steps_per_s"] / r["limit_steps_per_s"])
        assert r["runs"] and r["steps_per_s"] in r["runs"]
        machine = r["machine"]
        assert machine["cores"] >= 1 and machine["cpu_model"] and machine["python"]
        assert machine["versions"]["envfleet"] == envfleet.__version__


def test_bench_sweep_has_one_row_per_system_and_num_envs(tmp_path):
    out = tmp_path / "raw.json"
    proc = run(
        "bench", "--num-envs", "2,3", "--seconds", "0.05", "--backends", "serial",
        "--peers", "gym-sync", "--repeats", "2", "--json", str(out),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "× limit" in proc.stdout  # the table still goes to stdout with --json FILE
    assert str(out) in proc.stderr
    doc = json.loads(out.read_text())
    assert [(r["num_envs"], r["system"]) for r in doc] == [
        (2, "serial"), (2, "gym-sync"), (3, "serial"), (3, "gym-sync"),
    ]  # fmt: skip
    for n in (2, 3):
        check_results(
            [r for r in doc if r["num_envs"] == n], "CartPole-v1", n,
            ["serial", "gym-sync"], ["gym-sync"],
        )  # fmt: skip
    check_limit_and_machine(doc)
    assert all(len(r["runs"]) == 2 for r in doc)


def test_bench_plot_writes_a_png_of_the_documented_size(tmp_path):
    pytest.importorskip("matplotlib")
    import matplotlib.image

    from envfleet.bench import PLOT_DPI, PLOT_LEGEND_INCHES, PLOT_PANEL_INCHES

    png = tmp_path / "out.png"
    proc = run(
        "bench", "CartPole-v1", "Acrobot-v1", "--num-envs", "2,4", "--seconds", "0.05",
        "--backends", "serial", "--peers", "gym-sync", "--plot", str(png),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    image = matplotlib.image.imread(png)
    width = round((2 * PLOT_PANEL_INCHES[0] + PLOT_LEGEND_INCHES) * PLOT_DPI)
    height = round(PLOT_PANEL_INCHES[1] * PLOT_DPI)
    assert image.shape[:2] == (height, width)
    assert image[..., :3].std() > 0  # something is drawn


def test_plot_without_matplotlib_says_how_to_install_it(tmp_path):
    code = (
        "import sys; sys.modules['matplotlib'] = None\n"
        "from envfleet.cli import main\n"
        f"sys.exit(main(['bench', '--plot', {str(tmp_path / 'x.png')!r}]))\n"
    )
    proc = run(cmd=[sys.executable, "-c", code])
    assert proc.returncode == 2
    assert "pip install 'envfleet[plot]'" in proc.stderr
    assert not (tmp_path / "x.png").exists()


# Every optional peer made unimportable in the child, whether or not it is installed here.
HIDE_PEERS = "".join(f"sys.modules[{m!r}] = None; " for m in OPTIONAL_PEERS.values())


def test_missing_peers_are_left_out_with_how_to_install_them():
    code = (
        f"import sys; {HIDE_PEERS}\n"
        "from envfleet.cli import main\n"
        "sys.exit(main(['bench', '--num-envs', '2', '--seconds', '0.05', '--backends', "
        "'serial', '--peers', 'gym-sync,sb3-subproc,envpool-native,puffer-mp', '--json']))\n"
    )
    proc = run(cmd=[sys.executable, "-c", code])
    assert proc.returncode == 0, proc.stderr
    assert [r["system"] for r in json.loads(proc.stdout)] == ["serial", "gym-sync"]
    table = run(cmd=[sys.executable, "-c", code.replace(", '--json'", "")])
    assert table.returncode == 0, table.stderr
    assert "envfleet[sb3]" in " ".join(table.stdout.split())  # the table's notes, as typed
    assert "Traceback" not in proc.stderr
    for install in (
        "pip install 'envfleet[sb3]'",
        "pip install 'envfleet[envpool]'",
        "pip install pufferlib-core --no-deps",
    ):
        assert install in proc.stderr


def test_only_missing_peers_is_an_error_not_a_crash():
    code = (
        f"import sys; {HIDE_PEERS}\n"
        "from envfleet.cli import main\n"
        "sys.exit(main(['bench', '--backends', 'none', '--peers', 'puffer-mp']))\n"
    )
    proc = run(cmd=[sys.executable, "-c", code])
    assert proc.returncode == 2
    assert "pip install pufferlib-core --no-deps" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stdout == ""


def test_envpool_native_only_on_envpool_tasks():
    pytest.importorskip("envpool")
    proc = run(
        "bench", "FrozenLake-v1", "--num-envs", "2", "--seconds", "0.05",
        "--backends", "serial", "--peers", "envpool-native", "--json",
    )  # fmt: skip
    from envfleet.bench import envpool_task

    native = envpool_task("FrozenLake-v1") is not None
    assert proc.returncode == 0, proc.stderr
    systems = [r["system"] for r in json.loads(proc.stdout)]
    assert systems == (["serial", "envpool-native"] if native else ["serial"])
    assert ("not one of EnvPool's native tasks" in proc.stderr) == (not native)


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
        ["bench", "--peers", "gym-sync,bogus"],
        ["bench", "--num-envs", "4,0"],
        ["bench", "--num-envs", "4,x"],
        ["bench", "--json", "CartPole-v1"],  # an env id after a bare --json: not a file name
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
    "gym-sync", "gym-sync-store", "gym-async", "gym-async-store", "puffer-sync",
    "puffer-sync-store", "puffer-async", "envpool", "envpool-store", "envfleet",
    "envfleet-store", "envfleet-pool",
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
    # T_p(n) at N, N / 2, N / 4 (JSON's keys are strings), the schedule bound and its structure.
    sizes = [num_envs] + [num_envs // k for k in (2, 4) if k <= num_envs]
    assert list(bound["t_policy_by_n"]) == [str(n) for n in dict.fromkeys(sizes)]
    assert bound["t_policy_by_n"][str(num_envs)] == bound["t_policy_s"]
    structures = bound["structures"]
    assert structures["one call"] > 0
    assert bound["schedule_structure"] in structures
    assert bound["schedule_steps_per_s"] == max(structures.values())
    # The loop bound: the same structures with the costs measured in a loop, at each size.
    assert list(bound["t_policy_loop_by_n"]) == list(bound["t_policy_by_n"])
    assert all(t > 0 for t in bound["t_policy_loop_by_n"].values())
    assert bound["t_env_loop_s"] > 0 and bound["loop_steps_per_s"] > 0
    assert bound["loop_structure"] in structures
    assert [r["system"] for r in report["results"]] == POLICY_SYSTEMS
    for r in report["results"]:
        if r["skipped"] is not None:  # PufferLib (or EnvPool) not installed
            assert r["system"].startswith(("puffer", "envpool"))
            assert "pip install" in r["skipped"] or "EnvPool has no task" in r["skipped"]
            assert r["steps_per_s"] is None and r["runs"] == []
            continue
        assert r["steps_per_s"] > 0
        assert math.isclose(r["of_bound"], r["steps_per_s"] / bound["steps_per_s"], rel_tol=1e-9)
        assert math.isclose(
            r["of_schedule_bound"], r["steps_per_s"] / bound["schedule_steps_per_s"], rel_tol=1e-9
        )
        assert math.isclose(
            r["of_loop_bound"], r["steps_per_s"] / bound["loop_steps_per_s"], rel_tol=1e-9
        )
        assert r["vs_best_gym"] > 0 and r["vs_best_peer"] > 0 and r["vs_envfleet_loop"] > 0
        assert r["vs_envfleet_store"] > 0


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch")
def test_bench_policy_mlp_prints_every_system():
    proc = run("bench", "--policy", "mlp", "--num-envs", "2", "--seconds", "0.1")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "CartPole-v1 x2, mlp policy: overlap bound" in out
    assert "schedule bound" in out and "T_p(2) = " in out and "T_p(1) = " in out
    columns = ("steps/s", "of overlap bound", "of schedule bound", "of loop bound", "vs best gym")
    assert "loop bound" in out and "in a loop T_p = " in out
    columns = (*columns, "vs best peer")
    for column in (*columns, "vs envfleet loop", "vs envfleet store"):
        assert column in out
    rows = [line for line in out.splitlines() if line.startswith("| ") and "---" not in line]
    cells = [row.split("|")[1].strip() for row in rows[1:]]
    assert [cell.split(" ")[0] for cell in cells] == POLICY_SYSTEMS
    # The storing plain loops are marked as the loop a learner writes.
    marked = [cell.split(" ")[0] for cell in cells if "(the loop a learner writes)" in cell]
    assert marked == [s for s in POLICY_SYSTEMS if s.endswith("-store")]


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
        ["bench", "--policy", "mlp", "--systems", "sb3-subproc"],  # a --train system, once
    ],
)
def test_bad_policy_arguments_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert "error" in capsys.readouterr().err


# -- envfleet bench --train: moved to benchmarks/train.py ------------------------------------


@pytest.mark.parametrize(
    "argv",
    [
        ["bench", "--train", "lunarlander", "--seeds", "3"],  # its old options after it
        ["bench", "--budget", "1024", "--train", "lunarlander"],  # and before it
        ["bench", "--train"],
    ],
)
def test_train_says_it_moved_to_the_script(argv, capsys):
    """The time to score is no longer the package's: ``--train``, hidden, exits 2 naming the
    script and its command, whatever else is on the line."""
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--train moved out of envfleet" in err and "python benchmarks/train.py" in err
    workload = "cartpole" if argv == ["bench", "--train"] else "lunarlander"
    assert f"--workload {workload}" in err
    assert (Path(__file__).resolve().parents[2] / "benchmarks" / "train.py").is_file()


def test_train_is_not_in_the_help(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    out = capsys.readouterr().out
    assert "--train" not in out and "--seeds" not in out and "--budget" not in out
