"""``envfleet tune`` and :func:`envfleet.bench.tune`: the grid from the cores, a real (tiny)
run whose recommended call builds what it names, the command line's table and errors, and
user policies given as ``module:fn``. No timed assertions.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import gymnasium
import numpy as np
import pytest

import envfleet
from envfleet import ConfigError
from envfleet.bench import (
    TorchPolicy,
    TuneCandidate,
    tune,
    tune_grid,
    tune_report_dict,
    tune_table,
    tune_workers,
    usable_cores,
)
from envfleet.cli import main

torch = pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[2]
SERIAL = TuneCandidate("make", "serial")
SAMPLER_DRIVER = TuneCandidate("sampler", "processes", inference="driver")
SAMPLER_WORKER = TuneCandidate("sampler", "processes", num_workers=2, inference="worker")
#: Short enough that a whole grid runs in seconds.
QUICK = {"seconds": 0.05, "warmup_s": 0.01}


# -- policies and envs given as module:fn ---------------------------------------------------


class ZerosPolicy:
    """Action 0 for every observation (picklable: worker inference can copy it)."""

    def __call__(self, obs: Any) -> np.ndarray:
        return np.zeros(len(obs), dtype=np.int64)


def zeros_policy(observation_space: gymnasium.Space, action_space: gymnasium.Space) -> Any:
    """A ``--policy module:fn`` factory."""
    assert isinstance(action_space, gymnasium.spaces.Discrete)
    return ZerosPolicy()


def torch_tuple_policy(observation_space: gymnasium.Space, action_space: gymnasium.Space) -> Any:
    """A policy returning ``(torch actions, infos)``, as the Sampler takes it."""

    def policy(obs: Any) -> tuple[Any, dict[str, np.ndarray]]:
        n = len(obs)
        return torch.ones(n, dtype=torch.int64), {"value": np.zeros(n, np.float32)}

    return policy


def unpicklable_policy(observation_space: gymnasium.Space, action_space: gymnasium.Space) -> Any:
    lock = threading.Lock()  # no pickle for a lock, cloudpickle's neither

    def policy(obs: Any) -> np.ndarray:
        with lock:
            return np.zeros(len(obs), dtype=np.int64)

    return policy


def wrong_batch_policy(observation_space: gymnasium.Space, action_space: gymnasium.Space) -> Any:
    return lambda obs: np.zeros(1, dtype=np.int64)


#: The environment variable naming the process whose main thread SlowInTheMainThread slows.
SLOW_PID = "ENVFLEET_TEST_SLOW_PID"


class SlowInTheMainThread(gymnasium.Wrapper):
    """CartPole whose steps sleep in the main thread of the process ``SLOW_PID`` names (the
    test's): slow under the serial backend, fast in worker processes and threads."""

    def __init__(self) -> None:
        super().__init__(gymnasium.make("CartPole-v1"))

    def step(self, action: Any) -> Any:
        if os.environ.get(SLOW_PID) == str(os.getpid()) and (
            threading.current_thread() is threading.main_thread()
        ):
            time.sleep(0.02)  # serial: 50 rounds a second at most
        return self.env.step(action)


def make_cartpole() -> gymnasium.Env:
    """A ``module:factory`` env."""
    return gymnasium.make("CartPole-v1")


# -- the grid --------------------------------------------------------------------------------


def test_worker_counts_follow_the_cores():
    assert tune_workers(16, 1) == (1,)
    assert tune_workers(16, 2) == (1, 2)
    assert tune_workers(16, 6) == (1, 2, 4, 6)
    assert tune_workers(16, 16) == (2, 4, 8, 16)  # the largest four
    assert tune_workers(3, 16) == (1, 2, 3)  # no more workers than envs
    with pytest.raises(ConfigError):
        tune_workers(0, 2)


def test_grid_on_two_cores():
    assert [c.name for c in tune_grid(16, 2)] == [
        "processes",
        "processes num_workers=1 driver_envs=0",
        "processes driver_envs=8",
        "serial",
        "threads",
        "pool processes num_workers=2 batch_size=8",
        "sampler driver processes",
        "sampler worker processes",
    ]


def test_grid_grows_with_the_cores():
    names = [c.name for c in tune_grid(16, 16)]
    workers = [c.num_workers for c in tune_grid(16, 16) if c.loop == "make" and c.num_workers]
    assert workers == [2, 4, 8]  # 16, one per core, is the defaults' "processes"
    assert "processes driver_envs=1" in names  # the opt-in share
    assert "pool processes num_workers=16 batch_size=8" in names  # one env per worker
    assert "sampler worker processes num_workers=8 driver_envs=0" in names
    # Every candidate is distinct and within make()'s bounds.
    for cores in (1, 2, 3, 8, 64):
        for n in (1, 2, 5, 8, 16):
            grid = tune_grid(n, cores)
            assert len(set(grid)) == len(grid)
            for c in grid:
                # A pool may put one env in each worker (its default) on fewer cores.
                most = n if c.loop == "pool" else min(n, cores)
                assert c.num_workers is None or 1 <= c.num_workers <= most
                assert c.batch_size is None or (c.batch_size == n // 2 and n % c.num_workers == 0)


def test_grid_defaults_to_the_usable_cores():
    assert tune_grid(16) == tune_grid(16, usable_cores())


def test_grid_on_one_core_has_no_parallel_duplicates():
    # On one core processes' defaults are one worker and no driver share: nothing to vary.
    assert [c.name for c in tune_grid(16, 1)] == [
        "processes",
        "serial",
        "sampler driver processes",
        "sampler worker processes",
    ]
    grid = tune_grid(16, 2, worker_inference=False)
    assert all(c.inference != "worker" for c in grid)


def test_candidate_call_text():
    c = TuneCandidate("make", "processes", num_workers=2, driver_envs=0)
    assert c.call('"CartPole-v1"', 16) == (
        'envfleet.make("CartPole-v1", 16, backend=envfleet.Processes(driver_envs=0), num_workers=2)'
    )
    assert SAMPLER_WORKER.call('"CartPole-v1"', 8) == (
        'envfleet.Sampler("CartPole-v1", policy, 8, inference="worker", backend="processes", '
        "num_workers=2)"
    )
    with pytest.raises(ConfigError):
        TuneCandidate("pool", "processes")  # a pool needs its batch_size
    with pytest.raises(ConfigError):
        TuneCandidate("sampler", "processes", inference="elsewhere")


# -- a real run ------------------------------------------------------------------------------


def _build(call: str, policy: Any) -> Any:
    namespace: dict[str, Any] = {"envfleet": envfleet, "policy": policy}
    return eval(call, namespace)


def test_tune_cartpole_recommends_a_call_that_builds():
    report = tune("CartPole-v1", 4, "mlp", **QUICK)
    grid = tune_grid(4)
    assert [r.candidate for r in report.results] == list(grid)
    assert report.winner.candidate in grid and report.winner.skipped is None
    measured = [r for r in report.results if r.skipped is None]
    assert len(measured) >= len(grid) - 1  # threads may be pruned
    for r in measured:
        assert r.steps_per_s > 0 and r.runs
        assert r.steps_per_s <= report.winner.steps_per_s
        assert math.isclose(r.of_best, r.steps_per_s / report.winner.steps_per_s)
    finalists = [r for r in measured if len(r.runs) == 2]
    assert len(finalists) == 3 and report.winner in finalists
    assert report.call == report.winner.call
    assert report.call.startswith(("envfleet.make(", "envfleet.Sampler("))
    # The snippet runs as printed (a Sampler's needs `policy`), and every candidate's call
    # builds a working vector env or Sampler.
    space = gymnasium.spaces.Box(-np.inf, np.inf, (4,), np.float32)
    policy = TorchPolicy("mlp", space, gymnasium.spaces.Discrete(2))
    namespace: dict[str, Any] = {"policy": policy}
    exec(report.code, namespace)
    built = namespace.get("envs", namespace.get("sampler"))
    assert built is not None
    built.close()
    for r in report.results:
        made = _build(r.call, policy)
        try:
            if r.candidate.loop == "sampler":
                assert made.sample(8).num_steps >= 8
            elif r.candidate.loop == "pool":
                made.async_reset(seed=0)
                obs, *_, info = made.recv()
                made.send(policy(obs), info["env_id"])
            else:
                obs, _ = made.reset(seed=0)
                assert made.step(policy(obs))[0].shape == (4, 4)
        finally:
            made.close()
    assert report.env_kind == "compute"  # the processes candidates' workers found so
    table = tune_table(report)
    assert "| candidate | loop | steps/s | × best | runs |" in table
    assert "Env kind: compute (" in table
    assert f"{report.winner.candidate.name} (best)" in table
    assert report.call in table
    doc = json.loads(json.dumps(tune_report_dict(report)))
    assert doc["winner"]["call"] == report.call and len(doc["results"]) == len(grid)


def test_threads_are_pruned_when_far_behind(monkeypatch):
    # Serial is slow (its envs sleep in the test's main thread); worker processes are not:
    # even two threads at serial's rate could not reach half of processes'.
    monkeypatch.setenv(SLOW_PID, str(os.getpid()))
    processes = TuneCandidate("make", "processes", num_workers=1, driver_envs=0)
    threads = TuneCandidate("make", "threads", num_workers=2)
    report = tune(
        SlowInTheMainThread, 2, zeros_policy, candidates=[processes, SERIAL, threads], **QUICK
    )
    by = {r.candidate: r for r in report.results}
    assert by[SERIAL].steps_per_s < 0.25 * by[processes].steps_per_s
    assert by[threads].skipped.startswith("pruned: serial")
    assert report.winner.candidate == processes
    assert "tests.integration.test_tune.SlowInTheMainThread, 2" in report.call


def test_policy_callable_and_module_factory_env():
    report = tune(
        "tests.integration.test_tune:make_cartpole",
        2,
        torch_tuple_policy,
        candidates=[SERIAL, SAMPLER_DRIVER],
        **QUICK,
    )
    assert all(r.skipped is None for r in report.results), report.results
    assert report.env == "tests.integration.test_tune:make_cartpole"
    assert "import tests.integration.test_tune" in report.code
    assert "tests.integration.test_tune.make_cartpole, 2" in report.call
    namespace: dict[str, Any] = {"policy": ZerosPolicy()}
    exec(report.code, namespace)
    namespace.get("envs", namespace.get("sampler")).close()


def test_env_callable_without_a_name_is_the_name_env():
    report = tune(lambda: gymnasium.make("CartPole-v1"), 2, "mlp", candidates=[SERIAL], **QUICK)
    assert report.call == 'envfleet.make(env, 2, backend="serial")'
    assert "# env: your env factory (a zero-argument callable)" in report.code
    namespace: dict[str, Any] = {"env": make_cartpole}
    exec(report.code, namespace)
    namespace["envs"].close()


def test_a_refused_candidate_is_reported_and_the_others_go_on():
    refused = TuneCandidate("make", "processes", num_workers=9)  # more workers than envs
    report = tune("CartPole-v1", 2, "mlp", candidates=[refused, SERIAL], **QUICK)
    by = {r.candidate: r for r in report.results}
    assert by[refused].skipped.startswith("failed: num_workers must be")
    assert report.winner.candidate == SERIAL
    with pytest.raises(ConfigError, match="num_workers must be"):
        tune("CartPole-v1", 2, "mlp", candidates=[refused], **QUICK)


def test_unpicklable_policy_skips_worker_inference():
    report = tune(
        "CartPole-v1", 2, unpicklable_policy, candidates=[SERIAL, SAMPLER_WORKER], **QUICK
    )
    by = {r.candidate: r for r in report.results}
    assert by[SAMPLER_WORKER].skipped.startswith("worker inference needs a policy that pickles")
    assert math.isnan(by[SAMPLER_WORKER].steps_per_s)
    assert report.winner.candidate == SERIAL
    assert "pickles" in tune_table(report)


@pytest.mark.parametrize(
    ("env", "policy", "message"),
    [
        ("NoSuchEnv-v0", "mlp", "unknown environment id"),
        ("nosuchmodule:make", "mlp", "cannot import module 'nosuchmodule'"),
        ("os:getcwd", "mlp", "not a gymnasium.Env"),
        ("CartPole-v1", "rnn", "policy must be"),
        ("CartPole-v1", "nosuchmodule:fn", "cannot import module 'nosuchmodule'"),
        ("CartPole-v1", "tests.integration.test_tune:nothing", "has no function"),
        ("CartPole-v1", "json:dumps", "the policy factory json:dumps failed"),
        ("CartPole-v1", "tests.integration.test_tune:wrong_batch_policy", r"shape \(1,\)"),
    ],
)
def test_bad_env_or_policy_is_a_config_error(env, policy, message):
    with pytest.raises(ConfigError, match=message):
        tune(env, 4, policy, **QUICK)


@pytest.mark.atari
def test_atari_ids_are_preprocessed_and_the_call_says_so():
    pytest.importorskip("ale_py")
    pytest.importorskip("cv2")
    report = tune("ALE/Pong-v5", 2, "cnn", candidates=[SERIAL], **QUICK)
    assert 'functools.partial(envfleet.bench.make_env, "ALE/Pong-v5", True)' in report.call
    namespace: dict[str, Any] = {}
    exec(report.code, namespace)
    envs = namespace["envs"]
    try:
        assert envs.single_observation_space.shape == (4, 84, 84)
    finally:
        envs.close()


# -- the command line ------------------------------------------------------------------------


def run(*args: str) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "PYTHONIOENCODING": "utf-8",
        "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)]),
    }
    return subprocess.run(
        [sys.executable, "-m", "envfleet", "tune", *args],
        capture_output=True,
        text=True,
        encoding="utf-8",
        env=env,
        cwd=ROOT,
        timeout=120,
    )


def test_cli_prints_the_table_and_the_call():
    proc = run("CartPole-v1", "--num-envs", "2", "--seconds", "0.05")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert out.startswith("CartPole-v1 x2, mlp policy, ")
    assert "| candidate | loop | steps/s | × best | runs |" in out
    assert "(best)" in out
    use = out[out.index("Use:") :]
    assert "import envfleet" in use
    assert "envs = envfleet.make(" in use or "sampler = envfleet.Sampler(" in use


def test_cli_module_policy_and_json(tmp_path):
    target = tmp_path / "tune.json"
    proc = run(
        "CartPole-v1", "--num-envs", "2", "--seconds", "0.05",
        "--policy", "tests.integration.test_tune:zeros_policy", "--json", str(target),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(target.read_text())
    assert doc["policy"] == "tests.integration.test_tune:zeros_policy"
    measured = [r for r in doc["results"] if r["skipped"] is None]
    assert any(r["candidate"]["inference"] == "worker" for r in measured)  # it pickled
    assert doc["winner"]["call"] in proc.stdout


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["NoSuchEnv-v0"], "unknown environment id 'NoSuchEnv-v0'"),
        (["CartPole-v1", "--policy", "nosuchmodule:fn"], "cannot import module"),
        (["CartPole-v1", "--policy", "json:dumps"], "failed on the spaces"),
    ],
)
def test_cli_bad_input_exits_2(argv, message, capsys):
    assert main(["tune", *argv, "--seconds", "0.05"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("envfleet tune: error: ") and message in err


@pytest.mark.parametrize(
    "argv",
    [
        ["tune"],
        ["tune", "CartPole-v1", "--policy", "rnn"],
        ["tune", "CartPole-v1", "--num-envs", "0"],
        ["tune", "CartPole-v1", "--seconds", "0"],
        ["tune", "CartPole-v1", "--json", "out.txt"],
    ],
)
def test_cli_bad_arguments_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert "error" in capsys.readouterr().err


def test_the_report_says_which_kind_of_env_the_workers_saw():
    """Issue 50: envs that sleep 1 ms a step (tests.envs.WaitingEnv): the processes
    candidate's workers found them waiting and the table says so; serial times nothing."""
    processes = TuneCandidate("make", "processes", num_workers=1, driver_envs=0)
    report = tune("tests.envs:WaitingEnv", 2, zeros_policy, candidates=[processes, SERIAL], **QUICK)
    by = {r.candidate: r for r in report.results}
    assert (by[processes].env_kind, by[SERIAL].env_kind) == ("wait", "unknown")
    assert report.env_kind == "wait"
    assert "Env kind: wait (" in tune_table(report)
    assert tune_report_dict(report)["env_kind"] == "wait"
