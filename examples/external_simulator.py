"""Envs whose step talks over a socket to a simulator in another process, as ML-Agents' Unity
envs, a game server or a robot do, run under ``envfleet.make()``'s defaults.

Each env starts its own simulator (this file run with ``--simulator``: a small server on
127.0.0.1 only, on a port the system picks, that serves one connection and stops by itself
when the env disconnects or after ``--lifetime`` seconds). A step sends the action and waits
for the simulator's answer (the simulator takes ``latency_s`` to compute it): the env's
process uses no CPU while it waits. envfleet's workers notice (``envs.stats.env_kind`` says
``"wait"``) and each steps its block of envs all at once, so the waits overlap; with envs
that compute instead, each worker steps its envs one after another.

If a simulator dies, the step of its env raises: envfleet reports it as that env's
:class:`envfleet.EnvError` (``err.env_index``; also a ``ConnectionError``, the env's own
exception), and with a :class:`envfleet.RestartPolicy` rebuilds that env (and so starts a new
simulator) while every other env's results stay exactly what they would have been.

Run it::

    python examples/external_simulator.py                     # 8 envs, 2 ms per step
    python examples/external_simulator.py --num-envs 16 --latency 0.005 --steps 400
"""

from __future__ import annotations

import random
import socket
import struct
import subprocess
import sys
import time

# The wire: a request is an opcode (b"R": reset with a seed, b"S": step with an action) and an
# int64; a reply is 4 float64 observations, a float64 reward and a terminated byte.
# (Formats, not struct.Struct objects: the env class pickles by value when this file runs as a
# script, and a Struct does not pickle.)
REQUEST, REPLY = "<cq", "<4ddB"
REQUEST_BYTES, REPLY_BYTES = struct.calcsize(REQUEST), struct.calcsize(REPLY)


class Simulation:
    """The simulator's world, deterministic given its seed: a point in 4 dimensions drifting
    towards the action's side; the episode ends when its first coordinate leaves [-1, 1]."""

    def __init__(self, seed: int):
        self.rng = random.Random(seed)
        self.position = [self.rng.uniform(-0.5, 0.5) for _ in range(4)]

    def step(self, action: int) -> tuple[list[float], float, bool]:
        push = 0.05 if action else -0.05
        self.position = [0.95 * x + push + self.rng.gauss(0.0, 0.05) for x in self.position]
        terminated = abs(self.position[0]) > 1.0
        reward = 1.0 - abs(self.position[0])
        return list(self.position), reward, terminated


def _read_exactly(conn: socket.socket, size: int) -> bytes | None:
    data = b""
    while len(data) < size:
        chunk = conn.recv(size - len(data))
        if not chunk:
            return None  # the other side closed
        data += chunk
    return data


def run_simulator(latency_s: float, lifetime_s: float) -> None:
    """Serve one env on 127.0.0.1 (the port goes to stdout, first line): answer its resets
    and steps, each step after ``latency_s`` seconds of "simulation"; stop when the env
    disconnects or after ``lifetime_s`` seconds in all."""
    deadline = time.monotonic() + lifetime_s
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        print(server.getsockname()[1], flush=True)
        server.settimeout(max(0.0, deadline - time.monotonic()))
        try:
            conn, _ = server.accept()
        except TimeoutError:
            return
    with conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        simulation = Simulation(0)
        while True:
            conn.settimeout(max(0.001, deadline - time.monotonic()))
            try:
                request = _read_exactly(conn, REQUEST_BYTES)
            except (TimeoutError, OSError):
                return
            if request is None:
                return
            op, value = struct.unpack(REQUEST, request)
            if op == b"R":
                simulation = Simulation(value)
                obs, reward, terminated = list(simulation.position), 0.0, False
            else:
                time.sleep(latency_s)  # the simulator computing the next state
                obs, reward, terminated = simulation.step(value)
            try:
                conn.sendall(struct.pack(REPLY, *obs, reward, terminated))
            except OSError:  # the env is gone
                return


if __name__ == "__main__" and sys.argv[1:2] == ["--simulator"]:
    # The simulator is another program: it starts without numpy, gymnasium or envfleet.
    run_simulator(float(sys.argv[2]), float(sys.argv[3]))
    raise SystemExit(0)

import argparse  # noqa: E402
from typing import Any  # noqa: E402

import gymnasium  # noqa: E402
import numpy as np  # noqa: E402

import envfleet  # noqa: E402


class ExternalSimulatorEnv(gymnasium.Env[np.ndarray, np.int64]):
    """A gymnasium env whose every reset and step is a request to its own simulator process
    (:func:`run_simulator`, started here and stopped by :meth:`close`).

    Args:
        latency_s: the simulator's seconds per step.
        lifetime_s: the most seconds the simulator lives (it also stops when this env closes
            its connection, or its process dies).
        max_steps: steps after which an episode is truncated.

    Attributes:
        simulator_pid: the simulator's process id.

    Raises:
        ConnectionError: in ``reset`` or ``step``, when the simulator is gone.

    Example::

        envs = envfleet.make(ExternalSimulatorEnv, 8)  # each env starts its own simulator
        envs.reset(seed=0)
        envs.step(np.zeros(8, dtype=np.int64))
        envs.stats.env_kind  # "wait" after a few steps: each worker steps its envs at once
    """

    metadata: dict[str, Any] = {"render_modes": []}

    def __init__(self, latency_s: float = 0.002, lifetime_s: float = 600.0, max_steps: int = 200):
        self.observation_space = gymnasium.spaces.Box(-np.inf, np.inf, (4,), np.float64)
        self.action_space = gymnasium.spaces.Discrete(2)
        self.max_steps = max_steps
        self._proc = subprocess.Popen(
            [sys.executable, __file__, "--simulator", str(latency_s), str(lifetime_s)],
            stdout=subprocess.PIPE,
            text=True,
        )
        self.simulator_pid = self._proc.pid
        try:
            assert self._proc.stdout is not None
            port = int(self._proc.stdout.readline())
            self._sock = socket.create_connection(("127.0.0.1", port), timeout=lifetime_s)
            self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except BaseException:
            self._proc.kill()
            self._proc.wait()
            raise
        self._steps = 0

    def _ask(self, op: bytes, value: int) -> tuple[np.ndarray, float, bool]:
        self._sock.sendall(struct.pack(REQUEST, op, value))
        reply = _read_exactly(self._sock, REPLY_BYTES)
        if reply is None:
            raise ConnectionError(f"the simulator (pid {self.simulator_pid}) is gone")
        *obs, reward, terminated = struct.unpack(REPLY, reply)
        return np.array(obs, dtype=np.float64), float(reward), bool(terminated)

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        super().reset(seed=seed)
        simulator_seed = seed if seed is not None else int(self.np_random.integers(2**31))
        obs, _, _ = self._ask(b"R", simulator_seed)
        self._steps = 0
        return obs, {}

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        obs, reward, terminated = self._ask(b"S", int(action))
        self._steps += 1
        return obs, reward, terminated, self._steps >= self.max_steps, {}

    def close(self) -> None:
        self._sock.close()
        if self._proc.poll() is None:
            self._proc.terminate()
        self._proc.wait(5)
        if self._proc.stdout is not None:
            self._proc.stdout.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--num-envs", type=int, default=8)
    parser.add_argument("--latency", type=float, default=0.002, help="simulator s per step")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--lifetime", type=float, default=600.0)
    args = parser.parse_args(argv)

    def make_env() -> ExternalSimulatorEnv:
        return ExternalSimulatorEnv(args.latency, args.lifetime)

    with envfleet.make(make_env, args.num_envs) as envs:  # the defaults: a worker per core
        envs.reset(seed=0)
        rng = np.random.default_rng(0)
        start = time.perf_counter()
        for _ in range(args.steps):
            envs.step(rng.integers(0, 2, args.num_envs))
        seconds = time.perf_counter() - start
        stats = envs.stats
        at_once = sum(w.concurrent for w in stats.workers)
    rate = args.steps * args.num_envs / seconds
    print(
        f"{args.num_envs} envs, simulator {args.latency * 1e3:g} ms a step: {rate:,.0f} env "
        f"steps/s (one env alone at most {1 / args.latency:,.0f}); the envs "
        f"{stats.env_kind}, {at_once} of {len(stats.workers)} workers step theirs all at once"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
