"""Ctrl-C keeps the run: a ``KeyboardInterrupt`` during a step, a reset or a pool's ``recv``
leaves the vector env usable (the interrupted round completed, or a pool's wait undone), and
the next calls go on exactly as without the interrupt.

Each test runs :data:`SCRIPT` in a fresh interpreter that takes SIGINT as a terminal does
(also where the suite runs with SIGINT ignored). Env 1 of :class:`NapEnv` naps in one step
(or reset) after writing a marker file; a thread of the script waits for that file, then
sends SIGINT to its own process, so the interrupt comes while the driver waits on the napping
env, never before. The script checks what it can in place (snapshot, bit-identical results
against an uninterrupted run with the same seeds and actions) and prints a JSON line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import pytest
from gymnasium import spaces

ROOT = Path(__file__).resolve().parents[2]
NUM_ENVS = 4


class NapEnv(gym.Env):
    """Random observations, rewards and episode ends from its seed (none before step 7);
    env ``napper`` naps
    ``nap_s`` seconds (``-1``: every env) in its step number ``nap_at`` (counted over its
    life) or, with ``in_reset``, in its reset number ``nap_at``, after creating the file
    ``f"{marker}-{env_index}"``."""

    def __init__(
        self,
        env_index: int = 0,
        marker: str = "",
        nap_at: int = -1,
        nap_s: float = 0.0,
        in_reset: bool = False,
        napper: int = 1,
    ):
        self.env_index = env_index
        self.naps = napper in (-1, env_index) and bool(marker)
        self.marker, self.nap_at, self.nap_s, self.in_reset = marker, nap_at, nap_s, in_reset
        self.steps = self.resets = self.t = 0
        self.observation_space = spaces.Box(0.0, 1.0, (3,), np.float64)
        self.action_space = spaces.Discrete(3)

    def _nap(self, count: int) -> None:
        if self.naps and count == self.nap_at:
            Path(f"{self.marker}-{self.env_index}").touch()
            time.sleep(self.nap_s)

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        self.resets += 1
        if self.in_reset:
            self._nap(self.resets)
        self.t = 0
        return self.np_random.random(3), {"env": self.env_index}

    def step(self, action: Any):
        self.steps += 1
        if not self.in_reset:
            self._nap(self.steps)
        self.t += 1
        obs = self.np_random.random(3) + int(action)
        reward = float(self.np_random.random())
        # No episode ends before step 7: the steps up to the nap are all env steps.
        terminated = bool(self.np_random.random() < 0.3) and self.t >= 7
        info = {"t": self.t} if self.t % 3 == 0 else {}
        return np.clip(obs, 0.0, 1.0), reward, terminated, self.t >= 12, info


SCRIPT = textwrap.dedent(
    """
    import functools, json, os, signal, sys, threading, time
    from pathlib import Path
    import numpy as np
    import envfleet
    import envfleet._backends.rounds as rounds
    from tests.contract.test_interrupt import NUM_ENVS, NapEnv

    MAIN = threading.get_ident()
    # The driver's waits on its envs, and (serial) the napping env's own frame.
    WAITS = {"wait_replies", "_fast_round", "_collect_ready", "_nap"}

    ENV_CODE = {NapEnv.step.__code__, NapEnv.reset.__code__}

    def waiting():
        # Innermost frame first: an env stepping in this thread (the driver's block, under
        # _fast_round) is not a wait, unless it is the napping env (serial).
        frame = sys._current_frames().get(MAIN)
        while frame is not None:
            if frame.f_code.co_name == "_nap":
                return True
            if frame.f_code in ENV_CODE:
                return False
            if frame.f_code.co_name in WAITS:
                return True
            frame = frame.f_back
        return False

    def interrupt_when(ready, then=None):
        # SIGINT once ``ready()`` (envs napping, the driver in a wait on them); ``then``: a
        # second one once it returns True.
        def run():
            while not (ready() and waiting()):
                time.sleep(0.005)
            os.kill(os.getpid(), signal.SIGINT)
            if then is not None:
                while not then():
                    time.sleep(0.005)
                os.kill(os.getpid(), signal.SIGINT)
        threading.Thread(target=run, daemon=True).start()

    def napping(marker, count):
        # ``count`` envs napping for 50 ms: the driver's block (env 0, stepped in this thread
        # just after the workers were rung) has stepped by then; the wait is what is left.
        def started(path):
            return os.path.exists(path) and os.path.getmtime(path) < time.time() - 0.05

        return lambda: sum(started(f"{marker}-{e}") for e in range(NUM_ENVS)) >= count

    def out(result):
        return [np.asarray(x).tolist() for x in result[:4]] + [sorted(result[4])]

    if __name__ == "__main__":
        # Ctrl-C raises KeyboardInterrupt as in a terminal, also where the tests run with
        # SIGINT ignored (Python leaves an inherited SIG_IGN as it is).
        signal.signal(signal.SIGINT, signal.default_int_handler)
        mode, backend, marker = sys.argv[1], sys.argv[2], sys.argv[3]
        rng = np.random.default_rng(7)
        actions = [rng.integers(0, 3, NUM_ENVS) for _ in range(40)]
        K = 5  # the interrupted step is step K + 1
        in_reset = mode == "reset"
        nap_s = 30.0 if mode in ("second", "grace", "timeout", "timeout-restart") else 1.0
        if mode.startswith("pool"):
            nap_s = 1.5
        if mode == "grace":
            rounds.INTERRUPT_GRACE_S = 0.5
        factory = functools.partial(
            NapEnv, marker=marker, nap_at=2 if in_reset else K + 1, nap_s=nap_s,
            in_reset=in_reset, napper=-1 if mode.startswith("pool") else 1,
        )
        kw = dict(backend=backend, num_workers=NUM_ENVS)
        if backend == "processes-driver":  # env 0 stepped by the driver itself
            kw.update(backend=envfleet.Processes(driver_envs=1), num_workers=NUM_ENVS - 1)
        if mode.startswith("timeout"):
            # fail fast with "timeout": the timeout closes the vector env
            kw["supervision"] = envfleet.Supervision(
                step_timeout=1.0, **({"restart_policy": None} if mode == "timeout" else {})
            )
        if mode.startswith("pool"):
            kw["batch_size"] = 2 if mode == "pool" else NUM_ENVS
        got = {"interrupted": False, "notes": None, "closed": None}
        if mode.startswith("sampler"):
            # The Sampler over the vector env: driver inference (a step per 4 env steps) or
            # worker inference (a task round per sample).
            inference = mode.split("-")[1]
            policy = lambda obs: np.zeros(len(obs), np.int64)
            def sampler(f):
                return envfleet.Sampler(
                    f, policy, NUM_ENVS, inference=inference, num_workers=NUM_ENVS, seed=1
                )
            def fields(batch):
                return [np.asarray(getattr(batch, k)).tolist() for k in (
                    "observations", "actions", "rewards", "terminated", "truncated",
                    "last_observations", "env_index", "lengths")]
            s = sampler(factory)
            interrupt_when(napping(marker, 1))
            try:
                for _ in range(60):
                    s.sample(4)
            except KeyboardInterrupt as exc:
                got["interrupted"], got["notes"] = True, getattr(exc, "__notes__", None)
            venv = s.vector_env
            got["closed"] = venv.closed
            steps = venv._steps
            after = fields(s.sample(8))
            s.close()
            ref = sampler(NapEnv)
            while ref.vector_env._steps < steps:
                ref.sample(4)
            got["same"] = fields(ref.sample(8)) == after
            got["after"], got["expected"] = None, None
            ref.close()
            got["close_s"] = 0.0
            print(json.dumps(got))
            sys.exit(0)
        envs = envfleet.make(factory, NUM_ENVS, **kw)

        if mode.startswith("pool"):
            envs.async_reset(seed=3)
            routed = []
            # Three envs napping: a recv of two (or all) waits until one wakes.
            interrupt_when(napping(marker, 3))
            for r in range(30):
                try:
                    obs, rew, term, trunc, info = envs.recv()
                except KeyboardInterrupt as exc:
                    got["interrupted"], got["notes"] = True, getattr(exc, "__notes__", None)
                    got["closed"] = envs.closed
                    got["interrupted_at"] = len(routed)
                    continue
                ids = info["env_id"].tolist()
                routed.append(ids)
                envs.send(np.ones(len(ids), np.int64), np.asarray(ids))
            got["snapshot_steps"] = envs.snapshot().steps
            got["routed"] = routed
        else:
            if not in_reset:
                envs.reset(seed=11)
            second = None
            if mode == "second":
                backend_ = envs._backend
                second = lambda: backend_._interrupt is not None
            interrupt_when(napping(marker, 1), second)
            started = time.monotonic()
            try:
                if in_reset:
                    envs.reset(seed=11)
                    envs.reset(seed=11)  # env 1 naps in this one
                else:
                    for k in range(K + 1):  # env 1 naps in the last one
                        if mode == "step_async":
                            envs.step_async(actions[k])
                            envs.step_wait()
                        else:
                            envs.step(actions[k])
            except KeyboardInterrupt as exc:
                got["interrupted"], got["notes"] = True, getattr(exc, "__notes__", None)
            got["elapsed"] = time.monotonic() - started
            got["closed"] = envs.closed
            if not envs.closed:
                got["snapshot_steps"] = envs.snapshot().steps
                first = 0 if in_reset else K + 1
                after = [out(envs.step(a)) for a in actions[first : first + 8]]
                reference = envfleet.make(NapEnv, NUM_ENVS, **kw)
                for _ in range(2 if in_reset else 1):
                    reference.reset(seed=11)
                for a in actions[:first]:
                    reference.step(a)
                expected = [out(reference.step(a)) for a in actions[first : first + 8]]
                reference.close()
                got["same"] = after == expected
                got["after"], got["expected"] = after[:2], expected[:2]
        closing = time.monotonic()
        envs.close()
        got["close_s"] = time.monotonic() - closing
        print(json.dumps(got))
    """
)


def run_script(tmp_path: Path, mode: str, backend: str = "processes") -> dict[str, Any]:
    script = tmp_path / "interrupted.py"
    script.write_text(SCRIPT)
    done = subprocess.run(
        [sys.executable, str(script), mode, backend, str(tmp_path / "napping")],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *sys.path])},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


@pytest.mark.parametrize(
    ("mode", "backend_name"),
    [
        ("step", "processes"),
        ("step_async", "processes"),
        ("reset", "processes"),
        ("step", "threads"),
        ("step", "processes-driver"),
        ("step_async", "processes-driver"),
    ],
)
def test_ctrl_c_completes_the_call_and_the_run_goes_on(
    tmp_path: Path, mode: str, backend_name: str
) -> None:
    """The interrupted step (or reset) completes, then the interrupt is raised with its
    note; snapshot() works, the next steps are bit-identical to an uninterrupted run's, and
    close() is prompt."""
    got = run_script(tmp_path, mode, backend_name)
    assert got["interrupted"], got
    note = "\n".join(got["notes"] or [])
    assert "envfleet: Ctrl-C interrupted" in note and "completed" in note, note
    assert got["closed"] is False, got
    assert got["snapshot_steps"] == (0 if mode == "reset" else 6), got
    assert got["same"], (got["after"], got["expected"])
    assert got["close_s"] < 10.0, got


@pytest.mark.parametrize("mode", ["pool", "pool-sync"])
def test_ctrl_c_in_a_pool_recv_routes_every_env_once(tmp_path: Path, mode: str) -> None:
    """A pool's recv interrupted while it waits is undone (``batch_size=2``; with
    ``batch_size == num_envs`` the round is completed and its results kept for the next
    recv): the next recvs return every env sent an action exactly once per send (none lost,
    none twice), and a snapshot works."""
    got = run_script(tmp_path, mode)
    assert got["interrupted"], got
    assert got["closed"] is False, got
    note = "\n".join(got["notes"] or [])
    kept = "undone" if mode == "pool" else "completed"
    assert "envfleet: Ctrl-C interrupted" in note and kept in note, note
    routed = got["routed"]
    size = 2 if mode == "pool" else NUM_ENVS
    assert len(routed) == 29, routed  # 30 recvs, one interrupted
    # Each recv'd env is sent its next action at once, so every env is always in flight:
    # a recv returns distinct envs, and an env lost at the interrupt would never come back.
    for ids in routed:
        assert len(ids) == len(set(ids)) == size, (ids, routed)
    # the envs napping when the recv was interrupted come back after it
    later = {e for ids in routed[got["interrupted_at"] :] for e in ids}
    assert later == set(range(NUM_ENVS)), routed
    assert got["close_s"] < 10.0, got


def test_ctrl_c_in_a_sampler_driver_collection(tmp_path: Path) -> None:
    """A Sampler (driver inference) interrupted in its vector env's step: the step completes,
    the sample raises, and the next sample is bit-identical to an uninterrupted Sampler's
    after as many steps (it acts on the completed step's observations)."""
    got = run_script(tmp_path, "sampler-driver")
    assert got["interrupted"], got
    assert got["closed"] is False, got
    assert got["same"], got


def test_ctrl_c_inside_an_env_run_here_closes(tmp_path: Path) -> None:
    """backend="serial": the interrupt comes inside env 1's own step, in the driver's
    thread; its group stopped half way, which cannot be completed: the vector env closes
    (as before), its note naming the env, and close() is prompt."""
    got = run_script(tmp_path, "step", "serial")
    assert got["interrupted"], got
    assert got["closed"] is True, got
    note = "\n".join(got["notes"] or [])
    assert "sub-environment 1 " in note and "_nap" in note, note
    assert got["close_s"] < 10.0, got


def test_a_second_ctrl_c_during_the_completion_closes(tmp_path: Path) -> None:
    """A second Ctrl-C while the interrupted step completes (its env naps 30 s) closes the
    vector env at once, as an interrupt did before, and leaves nothing running."""
    got = run_script(tmp_path, "second")
    assert got["interrupted"], got
    assert got["closed"] is True, got
    note = "\n".join(got["notes"] or [])
    assert "second Ctrl-C" in note, note
    assert got["elapsed"] < 20.0, got
    assert got["close_s"] < 10.0, got


def test_the_completion_wait_under_the_defaults_restarts_a_worker_past_step_timeout(
    tmp_path: Path,
) -> None:
    """With step_timeout (1 s; env 1 naps 30 s) and the default restart policy, the
    completion wait restarts the hung worker at the timeout, as any step past it: the step
    completes, the KeyboardInterrupt is raised and the vector env stays usable."""
    got = run_script(tmp_path, "timeout-restart")
    assert got["interrupted"], got
    assert got["closed"] is False, got
    assert got["elapsed"] < 15.0, got
    assert got["close_s"] < 10.0, got


def test_the_completion_wait_is_bounded_by_step_timeout(tmp_path: Path) -> None:
    """With step_timeout (1 s; the env naps 30 s) and ``restart_policy=None``, the completion
    wait ends at it: the vector env closes as a timeout closes it, and the KeyboardInterrupt
    is raised (so an ``except KeyboardInterrupt`` runs), the StepTimeoutError as its cause,
    named in a note."""
    got = run_script(tmp_path, "timeout")
    assert got["interrupted"], got
    assert got["closed"] is True, got
    note = "\n".join(got["notes"] or [])
    assert "did not complete (StepTimeoutError" in note, note
    assert got["elapsed"] < 15.0, got
    assert got["close_s"] < 10.0, got


def test_the_completion_wait_is_bounded(tmp_path: Path) -> None:
    """Without a step_timeout, a step that does not complete within INTERRUPT_GRACE_S (0.5 s
    here; its env naps 30 s) closes the vector env and raises the interrupt."""
    got = run_script(tmp_path, "grace")
    assert got["interrupted"], got
    assert got["closed"] is True, got
    note = "\n".join(got["notes"] or [])
    assert "did not complete within 0.5 s" in note, note
    assert got["elapsed"] < 20.0, got
    assert got["close_s"] < 10.0, got
