"""examples/remote_simulator.py: x1,024 envs under make()'s defaults, each on a TCP connection
of its own to ONE simulator server process. Real server processes on 127.0.0.1, real sockets, a
real SIGKILL and SIGSTOP; the reference is gymnasium's SyncVectorEnv over :class:`LocalTwin`,
the same env with the server's :class:`~remote_simulator.Simulation` in this process instead
of the wire, so every env's observations (and so its routing to its own connection) are
checked bit for bit, autoresets included. Latencies are short (1-2 ms) so that the tests
stay short however many envs a worker steps at once; timeouts are hang guards."""

from __future__ import annotations

import functools
import inspect
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import gymnasium
import numpy as np
import psutil
import pytest
from gymnasium.vector import SyncVectorEnv

import envfleet
from envfleet._backends.supervisor import restart_seed
from tests.helpers import assert_same

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
sys.path.insert(0, str(EXAMPLES))  # workers are forked: they find the module in sys.modules
import remote_simulator  # noqa: E402

NUM_ENVS = 1024
LATENCY_S = 0.001
MAX_STEPS = 16  # short episodes: every env truncates (and some terminate) within the rounds
SEED = 100
STEP_TIMEOUT = 10.0  # the hang test's guard: a step that gets no report ends by then


class LocalTwin(remote_simulator.RemoteSimulatorEnv):
    """RemoteSimulatorEnv with its server's Simulation here instead of a connection: the
    reference (its seeding, truncation and replies are the env's; only the wire is gone)."""

    def __init__(self, max_steps: int = MAX_STEPS):  # no super().__init__: it would connect
        self.observation_space = gymnasium.spaces.Box(-np.inf, np.inf, (4,), np.float64)
        self.action_space = gymnasium.spaces.Discrete(2)
        self.max_steps = max_steps
        self.simulation = remote_simulator.Simulation()
        self._steps = 0

    def _ask(self, op: bytes, value: int) -> tuple[np.ndarray, float, bool]:
        obs, reward, terminated = self.simulation.answer(op, value)
        return np.array(obs, dtype=np.float64), float(reward), bool(terminated)

    def close(self) -> None:
        pass


def twins(num_envs: int) -> SyncVectorEnv:
    return SyncVectorEnv([functools.partial(LocalTwin, MAX_STEPS)] * num_envs)


def remote_env(port: int, **kwargs: Any) -> Any:
    """The factory of make(): every env connects to the server on ``port``."""
    return functools.partial(
        remote_simulator.RemoteSimulatorEnv, ("127.0.0.1", port), LATENCY_S, MAX_STEPS, **kwargs
    )


@pytest.fixture
def servers() -> Iterator[Callable[..., tuple[subprocess.Popen[str], int]]]:
    """``start(port=0)``: a server process, listening when it returns, and its port; every
    one started is killed (stopped or not) and reaped when the test ends."""
    started: list[subprocess.Popen[str]] = []

    def start(port: int = 0) -> tuple[subprocess.Popen[str], int]:
        proc, port = remote_simulator.start_server(port)
        started.append(proc)
        return proc, port

    yield start
    for proc in started:
        remote_simulator.stop_server(proc)


def _actions(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.integers(0, 2, n)


def _lockstep(
    envs: Any, reference: SyncVectorEnv, rng: Any, rounds: int, what: str
) -> tuple[int, int]:
    """Step both ``rounds`` times with the same actions, asserting the same batches; the
    terminations and truncations seen."""
    terminations = truncations = 0
    for t in range(rounds):
        actions = _actions(rng, envs.num_envs)
        got = envs.step(actions.copy())
        assert_same(got, reference.step(actions.copy()), f"{what}, step {t}")
        terminations += int(np.sum(got[2]))
        truncations += int(np.sum(got[3]))
    return terminations, truncations


def _all_workers_step_at_once(envs: Any) -> None:
    stats = envs.stats
    assert stats.env_kind == "wait", stats.workers
    assert all(w.concurrent for w in stats.workers), stats.workers


def _established(server: subprocess.Popen[str], port: int) -> set[int]:
    """The peer ports of the server's established connections on ``port``."""
    proc = psutil.Process(server.pid)
    connections = getattr(proc, "net_connections", None) or proc.connections  # psutil < 6
    return {
        c.raddr.port
        for c in connections(kind="tcp")
        if c.status == psutil.CONN_ESTABLISHED and c.laddr.port == port
    }


def test_1024_envs_on_one_server_each_get_their_own_simulation(
    make_env: Any, servers: Any, snapshot: Any
) -> None:
    """x1,024 envs on make()'s defaults, one server: 1,024 connections to it, and every env's
    resets and steps (short episodes: autoresets too) are bit for bit what its own seeded
    Simulation gives in this process, so no env's reply went to another env; the workers found
    that their envs wait and stepped them at once."""
    server, port = servers()
    envs = make_env(remote_env(port), NUM_ENVS)
    reference = twins(NUM_ENVS)
    try:
        assert_same(envs.reset(seed=SEED), reference.reset(seed=SEED), "reset")
        ended = _lockstep(envs, reference, np.random.default_rng(0), 2 * MAX_STEPS + 4, "run")
    finally:
        reference.close()
    assert sum(ended) >= 2 * NUM_ENVS and min(ended) > 0, ended  # both kinds of episode end
    _all_workers_step_at_once(envs)
    assert envs.get_attr("server_pid") == (server.pid,) * NUM_ENVS
    assert len(_established(server, port)) == NUM_ENVS
    envs.close()
    remote_simulator.stop_server(server)
    snapshot.assert_nothing_left()


def _named_envs(messages: list[str]) -> set[int]:
    """The envs the EnvRestartedWarnings say start a new episode."""
    named: set[int] = set()
    for text in messages:
        for many in re.findall(r"sub-environments \[([\d, ]+)\] start a new episode", text):
            named.update(int(e) for e in many.split(","))
        named.update(int(e) for e in re.findall(r"sub-environment (\d+) starts a new", text))
    return named


def _traceback_text(error: BaseException) -> str:
    """The worker-side traceback chained under an EnvError (a RemoteTraceback's text)."""
    texts = []
    cause: BaseException | None = error
    while cause is not None:
        texts.append(str(cause))
        cause = cause.__cause__
    return "\n".join(texts)


def test_a_server_killed_and_restarted_on_its_port_is_each_envs_restart(
    make_env: Any, servers: Any, snapshot: Any
) -> None:
    """x1,024 envs; their server is SIGKILLed between two steps and a new one started on the
    same port. Under the default restart policy (its budget counts one restart per failed
    round: the 1,024 lost connections are one) the next step's failure is every env's lost
    connection: EnvRestartedWarning names all 1,024 envs, the failure kept in
    ``envs.stats.failures`` is an env's ConnectionError raised in the env's socket read
    (``_recv_exactly``), and every env is rebuilt, connected to the new server
    (``server_pid``), its row truncated with ``info["env_restarted"]`` and the first
    observation of a new episode seeded as documented (``restart_seed``); the run goes on bit
    for bit against the reference."""
    old, port = servers()
    envs = make_env(remote_env(port), NUM_ENVS)  # RestartPolicy(): 10 restarts a minute
    reference = twins(NUM_ENVS)
    rng = np.random.default_rng(1)
    try:
        assert_same(envs.reset(seed=SEED), reference.reset(seed=SEED), "reset")
        _lockstep(envs, reference, rng, 8, "before")
        _all_workers_step_at_once(envs)
        os.kill(old.pid, signal.SIGKILL)
        old.wait()
        new, new_port = servers(port)
        assert new_port == port and new.pid != old.pid
        with pytest.warns(envfleet.EnvRestartedWarning) as record:
            obs, rewards, terminated, truncated, infos = envs.step(_actions(rng, NUM_ENVS))
        messages = [str(w.message) for w in record if w.category is envfleet.EnvRestartedWarning]
        assert _named_envs(messages) == set(range(NUM_ENVS)), messages
        for text in messages:  # each names the env's frame that raised: its socket read
            assert f"(raised at {remote_simulator.__file__}:" in text, text
            assert " in _recv_exactly). " in text, text
        assert infos["env_restarted"].all() and infos["_env_restarted"].all(), infos
        assert truncated.all() and not terminated.any() and not rewards.any()
        seeds = [restart_seed(SEED + e, 1) for e in range(NUM_ENVS)]
        want, _ = reference.reset(seed=seeds)
        assert_same(obs, want, "the rebuilt envs' first observations")
        # NEXT_STEP: the truncated rows reset at the next step, as the reference's reset.
        got = envs.step(_actions(rng, NUM_ENVS))
        assert_same(got[0], reference.reset()[0], "the autoreset after the restart")
        assert not got[1].any() and not (got[2] | got[3]).any()
        _lockstep(envs, reference, rng, 8, "after")
    finally:
        reference.close()
    failure = envs.stats.failures[-1]
    assert isinstance(failure, envfleet.EnvError) and isinstance(failure, ConnectionError)
    assert failure.method == "step" and 0 <= failure.env_index < NUM_ENVS, repr(failure)
    text = _traceback_text(failure)
    frames = [line.strip() for line in text.splitlines() if line.strip().startswith("File ")]
    assert frames and frames[-1].startswith(f'File "{remote_simulator.__file__}"'), text
    assert frames[-1].endswith(", in _recv_exactly"), text  # the innermost: the env's read
    assert envs.stats.env_restarts == {e: 1 for e in range(NUM_ENVS)}
    assert envs.get_attr("server_pid") == (new.pid,) * NUM_ENVS
    assert len(_established(new, port)) == NUM_ENVS
    envs.close()
    remote_simulator.stop_server(new)
    snapshot.assert_nothing_left()


def _recv_line() -> tuple[str, int]:
    """The file and line of ``_recv_exactly``'s ``sock.recv``: where a waiting env is."""
    read = remote_simulator._recv_exactly
    lines, first = inspect.getsourcelines(read)
    offset = next(i for i, line in enumerate(lines) if "sock.recv(" in line)
    return str(inspect.getsourcefile(read)), first + offset


def test_a_server_that_stops_answering_is_a_hang_report_naming_the_envs_read(
    make_env: Any, servers: Any
) -> None:
    """64 envs; their server is SIGSTOPped between two steps. The step waits, and after
    ``hang_report_delay`` a HangWarning names the busy envs and their frame, the socket read
    in ``_recv_exactly``; the server is let go on (SIGCONT) when the report comes, and the
    step returns the batch it would have returned without the stall: nothing was killed or
    restarted (``step_timeout`` is only the guard that ends the test if no report came)."""
    num_envs = 64
    server, port = servers()
    envs = make_env(
        remote_env(port),
        num_envs,
        supervision=envfleet.Supervision(hang_report_delay=1.0, step_timeout=STEP_TIMEOUT),
    )
    reference = twins(num_envs)
    rng = np.random.default_rng(2)
    reports: list[tuple[float, str]] = []
    shown = warnings.showwarning

    def on_warning(message: Any, category: Any, *args: Any, **kwargs: Any) -> None:
        if issubclass(category, envfleet.HangWarning):
            reports.append((time.monotonic(), str(message)))
            os.kill(server.pid, signal.SIGCONT)  # the server answers again
        else:
            shown(message, category, *args, **kwargs)

    try:
        assert_same(envs.reset(seed=SEED), reference.reset(seed=SEED), "reset")
        _lockstep(envs, reference, rng, 8, "before")
        _all_workers_step_at_once(envs)
        actions = _actions(rng, num_envs)
        os.kill(server.pid, signal.SIGSTOP)
        with warnings.catch_warnings():
            warnings.simplefilter("always", envfleet.HangWarning)
            warnings.showwarning = on_warning
            started = time.monotonic()
            got = envs.step(actions.copy())
        assert_same(got, reference.step(actions.copy()), "the stalled step")
        _lockstep(envs, reference, rng, 4, "after")
    finally:
        os.kill(server.pid, signal.SIGCONT)
        reference.close()
    assert len(reports) == 1, reports
    when, text = reports[0]
    assert 1.0 <= when - started < STEP_TIMEOUT, when - started
    assert text.startswith("envfleet: step has waited"), text
    busy = re.search(r"\(sub-environments \[([\d, ]+)\]\)", text)
    assert busy and {int(e) for e in busy[1].split(",")} <= set(range(num_envs)), text
    path, line = _recv_line()
    assert f"at {path}:{line} in _recv_exactly)" in text, text  # the first busy env's frame
    assert f'File "{path}", line {line} in _recv_exactly' in text, text  # in its stacks
    stats = envs.stats
    assert stats.restarts == 0 and stats.timeouts == 0, stats


def test_an_env_connects_again_until_its_server_is_back() -> None:
    """The env's retry loop: a first server that accepts the env's connection and closes it
    (a server going down), then a real server started on that port while the env retries;
    the env is served by the real one. With no server at all, ConnectionError within
    ``connect_timeout_s``."""
    dying = socket.create_server(("127.0.0.1", 0))
    port = dying.getsockname()[1]
    built: list[Any] = []
    errors: list[BaseException] = []

    def build() -> None:
        try:
            built.append(remote_simulator.RemoteSimulatorEnv(("127.0.0.1", port), LATENCY_S))
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=build)
    thread.start()
    conn, _ = dying.accept()  # the env's first try: accepted, then dropped
    conn.close()
    dying.close()
    server, server_port = remote_simulator.start_server(port)
    try:
        assert server_port == port
        thread.join(30.0)
        assert not thread.is_alive() and not errors, errors
        env = built[0]
        assert env.server_pid == server.pid
        obs, _ = env.reset(seed=3)
        assert obs.tolist() == remote_simulator.Simulation(3).position
        env.close()
    finally:
        remote_simulator.stop_server(server)
    started = time.monotonic()
    with pytest.raises(ConnectionError, match=f"no simulator server at 127.0.0.1:{port} within"):
        remote_simulator.RemoteSimulatorEnv(("127.0.0.1", port), connect_timeout_s=0.3)
    assert time.monotonic() - started < 5.0


def test_the_example_runs_and_prints_its_rate_against_the_limit() -> None:
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / "remote_simulator.py"), "--num-envs", "64"]
        + ["--seconds", "2"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    line = proc.stdout.strip()
    match = re.fullmatch(
        r"64 envs on one server \(pid (\d+)\), 2 ms a step: ([\d,]+) env steps/s, \d+% of the "
        r"limit N/latency = 32,000; envs.stats.env_kind: wait, (\d+) of (\d+) workers step "
        r"theirs at once",
        line,
    )
    assert match and match[3] == match[4], line
    assert 0 < int(match[2].replace(",", "")) <= 32_000, line
    assert not psutil.pid_exists(int(match[1])), line  # the script stopped its server
