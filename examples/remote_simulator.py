"""One simulator server, many envs over TCP (x1,024 and more), under ``envfleet.make()``'s
defaults: a game server, a simulation service or a robot fleet's controller that serves every
env of a run, each env on a connection of its own.

The server is one process (this file run with ``--serve``): an ``asyncio`` TCP server on
127.0.0.1 only, on the port given or one the system picks, with one connection per env and a
deterministic world per connection (:class:`Simulation`, seeded by the env's reset). A step
waits the connection's ``latency_s`` (``asyncio.sleep``: the simulator computing, while it
serves the other connections) and answers. The env (:class:`RemoteSimulatorEnv`) is what a
user writes: a plain blocking ``socket``, a request, a blocking read of the reply. Its
process uses no CPU while it waits, so envfleet's workers find that their envs wait
(``envs.stats.env_kind`` is ``"wait"``) and each steps its block at once, the waits
overlapping: N envs of ``latency_s`` a step make at most ``N / latency_s`` steps a second,
the limit the script prints its rate against (asyncio's timers wake up to about a millisecond
late, which a short ``latency_s`` feels).

What fails, and what the defaults (``RestartPolicy()``) do about it:

- the server dies or restarts: each env's next read finds its connection closed and raises
  ``ConnectionError``, which is restarted (all the envs' failures of that step count one
  restart against the policy's budget): the env is rebuilt in its worker, its
  ``__init__`` connects again (it retries for ``connect_timeout_s``, so a server back on the
  same port serves it), its row says ``info["env_restarted"]``, and
  :class:`envfleet.EnvRestartedWarning` names the envs and the frame that read the socket
  (``raised at ... in _recv_exactly``; the whole traceback is in ``envs.stats.failures``);
- the server stops answering (stuck, paused): the envs block in their read, and after
  ``hang_report_delay`` seconds :class:`envfleet.HangWarning` names them and that read's
  frame in their stacks; ``step_timeout`` (none by default) is what gives up.

File descriptors: the server holds one per env and raises its soft ``RLIMIT_NOFILE`` for
``--max-envs`` of them (up to the hard limit), and listens with a backlog of as many; on the
envs' side each worker holds the sockets of its block (512 each for 1,024 envs on 2 cores),
so this script raises its own limit, which the workers inherit. ``ulimit -n`` says the soft
limit, ``ulimit -Hn`` the hard one.

Run it::

    python examples/remote_simulator.py                             # 64 envs, 2 ms a step
    python examples/remote_simulator.py --num-envs 1024 --latency 0.02 --seconds 10
    python examples/remote_simulator.py --serve --port 5555         # the server alone
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import resource
import signal
import socket
import struct
import subprocess
import sys
import threading
import time

# The wire, as examples/external_simulator.py's: a request is an opcode and an int64: b"H"
# (hello: the connection's microseconds per step), b"R" (reset with a seed) or b"S" (step with
# an action). A hello's reply is the server's pid (an int64); a reset's or a step's, 4 float64
# observations, a float64 reward and a terminated byte. (Formats, not struct.Struct objects:
# the env class pickles by value when this file runs as a script, and a Struct does not.)
REQUEST, HELLO_REPLY, REPLY = "<cq", "<q", "<4ddB"
REQUEST_BYTES, HELLO_BYTES, REPLY_BYTES = map(struct.calcsize, (REQUEST, HELLO_REPLY, REPLY))
MAX_ENVS = 4096  # the connections a server makes room for by default (--max-envs)


class Simulation:
    """One connection's world, deterministic given its seed: a point in 4 dimensions pushed to
    the action's side, with noise; the episode ends when its first coordinate leaves [-1, 1]."""

    def __init__(self, seed: int = 0):
        self.reset(seed)

    def reset(self, seed: int) -> list[float]:
        self.rng = random.Random(seed)
        self.position = [self.rng.uniform(-0.5, 0.5) for _ in range(4)]
        return list(self.position)

    def step(self, action: int) -> tuple[list[float], float, bool]:
        push = 0.1 if action else -0.1
        self.position = [0.9 * x + push + self.rng.gauss(0.0, 0.2) for x in self.position]
        return list(self.position), 1.0 - min(1.0, abs(self.position[0])), self.done

    @property
    def done(self) -> bool:
        return abs(self.position[0]) > 1.0

    def answer(self, op: bytes, value: int) -> tuple[list[float], float, bool]:
        """The reply to a reset (``op`` b"R", ``value`` the seed) or a step (b"S", the
        action): observations, reward, terminated."""
        if op == b"R":
            return self.reset(value), 0.0, False
        return self.step(value)


def raise_fd_limit(needed: int) -> int:
    """Raise this process's soft limit of open files to ``needed`` (at most the hard limit;
    never lower it); child processes inherit it. Returns the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
    if want > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        soft = want
    if soft < needed:
        print(f"open files limited to {soft} (ulimit -Hn), {needed} asked", file=sys.stderr)
    return soft


# -- the server -------------------------------------------------------------------------------


async def _serve_connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """One env's connection: its hello, then its resets and steps, until it closes."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    simulation, latency_s = Simulation(), 0.0
    try:
        while True:
            op, value = struct.unpack(REQUEST, await reader.readexactly(REQUEST_BYTES))
            if op == b"H":
                latency_s = value / 1e6
                writer.write(struct.pack(HELLO_REPLY, os.getpid()))
                continue
            if op not in (b"R", b"S"):
                return  # not an env of ours: drop it
            if op == b"S":
                await asyncio.sleep(latency_s)  # the simulator computing the next state
            obs, reward, terminated = simulation.answer(op, value)
            # No drain(): the env reads each reply before its next request, so the buffer
            # holds one reply at most.
            writer.write(struct.pack(REPLY, *obs, reward, terminated))
    except (asyncio.IncompleteReadError, ConnectionError):
        return  # the env closed its connection, or its worker died
    finally:
        writer.close()


async def serve(port: int = 0, max_envs: int = MAX_ENVS, until_stdin_eof: bool = False) -> None:
    """Serve envs on 127.0.0.1:``port`` (0: one the system picks), printing the port, first
    line of stdout, once it listens; stop on SIGTERM or SIGINT, or (``until_stdin_eof``) when
    stdin reaches its end: the process that started the server and holds the pipe's other end
    exited, however it died."""
    raise_fd_limit(max_envs + 64)
    loop = asyncio.get_running_loop()
    stop = loop.create_future()

    def stop_once() -> None:
        if not stop.done():
            stop.set_result(None)

    def stop_at_stdin_eof() -> None:
        sys.stdin.buffer.read()
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
            loop.call_soon_threadsafe(stop_once)

    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop_once)
    if until_stdin_eof:
        threading.Thread(target=stop_at_stdin_eof, daemon=True).start()
    server = await asyncio.start_server(
        _serve_connection, "127.0.0.1", port, backlog=max_envs, reuse_address=True
    )
    print(server.sockets[0].getsockname()[1], flush=True)
    await stop
    server.close()  # the connections' tasks are cancelled as asyncio.run() returns


def start_server(port: int = 0, max_envs: int = MAX_ENVS) -> tuple[subprocess.Popen[str], int]:
    """Start a server process (:func:`serve`) and wait until it listens: the process (it
    stops when this process exits, or ``terminate()``) and its port."""
    proc = subprocess.Popen(
        [sys.executable, __file__, "--serve", "--port", str(port), "--max-envs", str(max_envs)]
        + ["--until-stdin-eof"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,  # a Ctrl-C in the terminal is for this process, not the server
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()  # "" if it died first (a port in use...)
    if not line.strip().isdigit():
        proc.kill()
        proc.wait()
        raise RuntimeError(f"the simulator server did not start (exit code {proc.returncode})")
    return proc, int(line)


def stop_server(proc: subprocess.Popen[str]) -> None:
    """Stop a server :func:`start_server` started (SIGKILL; it may be stopped by SIGSTOP)
    and close its pipes."""
    proc.kill()
    proc.wait()
    for pipe in (proc.stdin, proc.stdout):
        if pipe is not None:
            pipe.close()


if __name__ == "__main__" and sys.argv[1:2] == ["--serve"]:
    # The server is another program: it starts without numpy, gymnasium or envfleet.
    import argparse

    server_args = argparse.ArgumentParser(description="the simulator server alone")
    server_args.add_argument("--serve", action="store_true")
    server_args.add_argument("--port", type=int, default=0)
    server_args.add_argument("--max-envs", type=int, default=MAX_ENVS)
    server_args.add_argument("--until-stdin-eof", action="store_true")
    parsed = server_args.parse_args()
    asyncio.run(serve(parsed.port, parsed.max_envs, parsed.until_stdin_eof))
    raise SystemExit(0)

import argparse  # noqa: E402
import functools  # noqa: E402
from typing import Any  # noqa: E402

import gymnasium  # noqa: E402
import numpy as np  # noqa: E402

import envfleet  # noqa: E402

# -- the env ----------------------------------------------------------------------------------


def _recv_exactly(sock: socket.socket, size: int) -> bytes:
    """``size`` bytes from ``sock``, blocking until they came: the frame where an env waits
    for its server (what a hang report names).

    Raises:
        ConnectionError: the server closed the connection (or reset it: the subclass
            ``ConnectionResetError``).
    """
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise ConnectionError(
                f"the simulator server closed the connection ({len(data)} of {size} bytes read)"
            )
        data += chunk
    return data


def connect(
    address: tuple[str, int], latency_s: float, timeout_s: float
) -> tuple[socket.socket, int]:
    """A connection to the server at ``address`` that will take ``latency_s`` a step, and the
    server's pid; retried until ``timeout_s`` seconds passed (no server there yet: one that
    restarts). The socket blocks (no timeout): a step waits as long as the server takes.

    Raises:
        ConnectionError: no server answered within ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        sock = None
        try:
            sock = socket.create_connection(address, timeout=max(0.05, deadline - time.monotonic()))
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.sendall(struct.pack(REQUEST, b"H", round(latency_s * 1e6)))
            (server_pid,) = struct.unpack(HELLO_REPLY, _recv_exactly(sock, HELLO_BYTES))
            sock.settimeout(None)
            return sock, server_pid
        except OSError as exc:  # refused, reset, timed out (all OSErrors)
            if sock is not None:
                sock.close()
            if time.monotonic() >= deadline:
                raise ConnectionError(
                    f"no simulator server at {address[0]}:{address[1]} within {timeout_s:g} s"
                ) from exc
            time.sleep(0.05)


class RemoteSimulatorEnv(gymnasium.Env[np.ndarray, np.int64]):
    """A gymnasium env whose every reset and step is a request to the simulator server at
    ``address`` (:func:`serve`), over a connection of its own opened here.

    Args:
        address: the server's ``(host, port)``.
        latency_s: the seconds the server takes per step of this env.
        max_steps: steps after which an episode is truncated.
        connect_timeout_s: how long ``__init__`` retries to connect (a server restarting).

    Attributes:
        server_pid: the pid of the server this env is connected to.

    Raises:
        ConnectionError: in ``__init__``, no server within ``connect_timeout_s``; in
            ``reset`` or ``step``, the server closed (or reset) the connection.

    Example::

        server, port = start_server()
        envs = envfleet.make(functools.partial(RemoteSimulatorEnv, ("127.0.0.1", port)), 1024)
        envs.reset(seed=0)
        envs.step(np.zeros(1024, dtype=np.int64))
        envs.stats.env_kind  # "wait" after a few steps: each worker steps its envs at once
    """

    metadata: dict[str, Any] = {"render_modes": []}

    def __init__(
        self,
        address: tuple[str, int],
        latency_s: float = 0.002,
        max_steps: int = 200,
        connect_timeout_s: float = 10.0,
    ):
        self.observation_space = gymnasium.spaces.Box(-np.inf, np.inf, (4,), np.float64)
        self.action_space = gymnasium.spaces.Discrete(2)
        self.address = (str(address[0]), int(address[1]))
        self.max_steps = max_steps
        self._sock, self.server_pid = connect(self.address, latency_s, connect_timeout_s)
        self._steps = 0

    def _ask(self, op: bytes, value: int) -> tuple[np.ndarray, float, bool]:
        self._sock.sendall(struct.pack(REQUEST, op, value))
        *obs, reward, terminated = struct.unpack(REPLY, _recv_exactly(self._sock, REPLY_BYTES))
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--num-envs", type=int, default=64)
    parser.add_argument("--latency", type=float, default=0.002, help="server s per step")
    parser.add_argument("--seconds", type=float, default=5.0, help="time the steps this long")
    parser.add_argument("--port", type=int, default=0, help="the server's (0: any free one)")
    args = parser.parse_args(argv)
    n = args.num_envs

    raise_fd_limit(n + 256)  # the workers inherit it: each holds its envs' sockets
    server, port = start_server(args.port, max_envs=max(n, MAX_ENVS))
    try:
        env_fn = functools.partial(RemoteSimulatorEnv, ("127.0.0.1", port), args.latency)
        with envfleet.make(env_fn, n) as envs:  # the defaults: a worker per core
            envs.reset(seed=0)
            rng = np.random.default_rng(0)
            for _ in range(8):  # the workers learn that their envs wait
                envs.step(rng.integers(0, 2, n))
            rounds, start = 0, time.perf_counter()
            while (seconds := time.perf_counter() - start) < args.seconds:
                envs.step(rng.integers(0, 2, n))
                rounds += 1
            stats = envs.stats
    finally:
        stop_server(server)
    rate, limit = rounds * n / seconds, n / args.latency
    at_once = sum(w.concurrent for w in stats.workers)
    print(
        f"{n} envs on one server (pid {server.pid}), {args.latency * 1e3:g} ms a step: "
        f"{rate:,.0f} env steps/s, {rate / limit:.0%} of the limit N/latency = {limit:,.0f}; "
        f"envs.stats.env_kind: {stats.env_kind}, {at_once} of {len(stats.workers)} workers "
        "step theirs at once"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
