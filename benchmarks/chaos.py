"""Chaos soak: faults injected for minutes into a vector env under a restart policy and
recycling, with a snapshot and resume every minute; nothing is lost that did not have to be.

One run of ``--num-envs`` (16) CartPole-v1 envs on ``--num-workers`` (4) worker processes,
``restart_policy=RestartPolicy(...)``, ``recycle=Recycle(max_episodes=...)`` and a
``step_timeout``, stepped with seeded random actions for ``--minutes`` (10) while:

- each env raises, segfaults (a write at address 0) or hangs (past the step timeout) at rare
  steps chosen by its own state and action (a hash of CartPole's state and the action under
  ``--p-raise`` / ``--p-segfault`` / ``--p-hang``): a bug its seed and actions reach, which a
  replay can reproduce;
- a fault injector SIGKILLs a random worker process every ``--kill-every`` seconds (an OOM
  kill's way; not the env's doing, so no replay is expected to reproduce it);
- every ``--snapshot-every`` seconds the vector env is snapshotted, closed, and made anew with
  ``resume=`` (another worker count each time).

Then a fault-free run (the same envs without faults, recycling or snapshots; the same seeds
and actions) gives the reference. Per env, a running hash of everything it returned
(observation, reward, terminated, truncated) is compared with the reference's up to the step
where the chaos run restarted it (``info["env_restarted"]``; a restarted env starts a new
episode from a new seed, so its data is its own from there): any difference is a lost step.
Each failure the restart policy survived (``envs.stats.failures``) is checked for its stack
(a segfault's and a hang's; a SIGKILL leaves none) and its replay is run by ``envfleet
replay``'s watcher (up to ``--replays-per-kind`` of each kind). At the end: no worker
process, no file descriptor, no /dev/shm entry left, and the driver's resident memory.

Run::

    python benchmarks/chaos.py                    # 10 minutes
    python benchmarks/chaos.py --minutes 1        # a quick look
    python benchmarks/chaos.py --defaults 1       # make()'s defaults, no option set

The exit status is 0 when no step was lost, every env fault's replay reproduced it, and
nothing was left; 1 otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import gc
import hashlib
import json
import os
import random
import signal
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import cloudpickle
import gymnasium
import numpy as np
import psutil

import envfleet
from envfleet._core.replay_runner import watch_replay

if __name__ != "__main__" and __name__ in sys.modules:
    # Loaded from a file by a test: the factories must travel by value to a replay's child.
    cloudpickle.register_pickle_by_value(sys.modules[__name__])

FAULTS = ("raise", "segfault", "hang")


class ChaosEnv(gymnasium.Wrapper):
    """CartPole-v1 with bugs its state reaches: before each step, a hash of the pole's state
    and the action below ``p["raise"]`` raises, below ``+ p["segfault"]`` writes at address 0,
    below ``+ p["hang"]`` sleeps ``hang_s`` seconds. With every ``p`` 0 it is CartPole-v1."""

    def __init__(self, p: dict[str, float], hang_s: float):
        super().__init__(gymnasium.make("CartPole-v1"))
        self.p, self.hang_s = p, hang_s

    def step(self, action: Any) -> Any:
        if any(self.p.values()):
            state = np.asarray(self.env.unwrapped.state, dtype=np.float64).tobytes()
            digest = hashlib.blake2b(state + bytes([int(action)]), digest_size=8).digest()
            draw, edge = int.from_bytes(digest, "little") / 2**64, 0.0
            for how in FAULTS:
                edge += self.p.get(how, 0.0)
                if draw < edge:
                    _fault(how, self.hang_s)
                    break
        return self.env.step(action)


def _fault(how: str, hang_s: float) -> None:
    if how == "raise":
        raise RuntimeError("chaos: an env bug")
    if how == "segfault":
        ctypes.memset(0, 0, 1)
    if how == "hang":
        time.sleep(hang_s)


REPLAY_TIMEOUT_S = 60.0  # the bound on a raise's, segfault's or kill's replay between calls


@dataclass
class ChaosConfig:
    minutes: float = 10.0
    num_envs: int = 16
    num_workers: int = 4
    p_raise: float = 2e-6
    p_segfault: float = 1e-6
    p_hang: float = 3e-7
    step_timeout: float = 2.0
    kill_every: float = 30.0
    snapshot_every: float = 60.0
    recycle_episodes: int = 400
    replays_per_kind: int = 5
    seed: int = 0
    # make()'s defaults, no option set (its default restart policy, no recycling, no
    # step_timeout): segfaults and SIGKILLs only, since an env's own exception raises and a
    # hang without step_timeout is reported, not ended, by design.
    defaults: bool = False


@dataclass
class ChaosResult:
    steps: int = 0
    env_steps: int = 0
    seconds: float = 0.0
    injected: dict[str, int] = field(default_factory=dict)  # by kind, as the failures say
    survived: int = 0
    recycled: int = 0
    snapshots: int = 0
    restarted_envs: int = 0
    steps_lost: int = 0
    lost_envs: list[int] = field(default_factory=list)
    stacks: dict[str, str] = field(default_factory=dict)  # kind -> "k of n"
    reproduced: dict[str, str] = field(default_factory=dict)  # kind -> "k of n"
    not_reproduced: list[str] = field(default_factory=list)  # what those replays did instead
    left: dict[str, Any] = field(default_factory=dict)
    rss_mb: tuple[float, float] = (0.0, 0.0)

    @property
    def ok(self) -> bool:
        env_faults_ok = all(
            v.split(" of ")[0] == v.split(" of ")[1]
            for k, v in self.reproduced.items()
            if k != "kill"
        )
        return self.steps_lost == 0 and env_faults_ok and not any(self.left.values())


class _Hashes:
    """Per env, a running hash of what it returned (uint64 arithmetic: wraps the same way
    on every run), frozen at the step before its first restart."""

    def __init__(self, num_envs: int, row_bytes: int, seed: int):
        weights = np.random.default_rng(seed).integers(1, 2**63, row_bytes, dtype=np.uint64)
        self.weights = weights
        self.value = np.zeros(num_envs, dtype=np.uint64)
        self.until = np.full(num_envs, -1, dtype=np.int64)  # -1: never restarted

    def add(self, step: int, obs: Any, rewards: Any, term: Any, trunc: Any, restarted: Any):
        rows = np.concatenate(
            [
                np.ascontiguousarray(obs).reshape(len(rewards), -1).view(np.uint8),
                rewards.astype(np.float64).reshape(-1, 1).view(np.uint8),
                term.reshape(-1, 1).view(np.uint8),
                trunc.reshape(-1, 1).view(np.uint8),
            ],
            axis=1,
        ).astype(np.uint64)
        with np.errstate(over="ignore"):
            row_hash = rows @ self.weights
            live = self.until < 0
            if restarted is not None:
                first = live & restarted
                self.until[first] = step
                live &= ~restarted
            self.value[live] = self.value[live] * np.uint64(1_000_003) + row_hash[live]


def _actions(step: int, num_envs: int) -> np.ndarray:
    return np.random.default_rng(step).integers(0, 2, num_envs)


def _restarted(infos: dict[str, Any], num_envs: int) -> np.ndarray | None:
    mask = infos.get("_env_restarted")
    if mask is None:
        return None
    return np.asarray(mask, dtype=bool) & np.asarray(infos["env_restarted"], dtype=bool)


def _factory(config: ChaosConfig, faults: bool) -> Any:
    p = (
        {"raise": config.p_raise, "segfault": config.p_segfault, "hang": config.p_hang}
        if faults
        else {}
    )
    hang_s = config.step_timeout * 30
    return lambda: ChaosEnv(p, hang_s)


def _pid(env: Any) -> int:
    """The process an env lives in."""
    return os.getpid()


def _plain() -> dict[str, Any]:
    return {"backend": "processes", "supervision": envfleet.Supervision(step_timeout=1.0)}


def _open_files() -> set[str]:
    """This process's open file descriptors (``fd -> target``), without multiprocessing's
    heap arenas (``/dev/shm/pym-*``: its RawArrays' memory, which it keeps for reuse;
    ``benchmarks/soak.py`` shows them flat over 1,000 make/close cycles)."""
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/self/fd/{fd}")
            if "/pym-" not in target:
                out.add(f"{fd} -> {target}")
    return out


def _running(process: psutil.Process) -> bool:
    with contextlib.suppress(psutil.Error):
        return bool(process.status() != psutil.STATUS_ZOMBIE)
    return False


def _leftovers() -> dict[str, Any]:
    me = psutil.Process()
    return {
        # This process's own children (a Ray cluster started here has its own below them).
        "children": {c.pid for c in me.children() if _running(c)},
        "fds": _open_files(),
        "shm": sorted(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else [],
    }


def _kind(error: Any) -> str:
    if isinstance(error, envfleet.StepTimeoutError):
        return "hang"
    if isinstance(error, envfleet.EnvCrashedError):
        return "kill" if error.signal == signal.SIGKILL else "segfault"
    return "raise"


def chaos(config: ChaosConfig, log: Any = print) -> ChaosResult:
    result = ChaosResult()
    # multiprocessing keeps the shared-memory arenas of its RawArrays for reuse, and the
    # first vector env imports what it needs: one make/close first, then count.
    for workers in (config.num_workers, 5):
        warm = envfleet.make("CartPole-v1", config.num_envs, num_workers=workers, **_plain())
        warm.close()
    del warm
    gc.collect()
    before = _leftovers()
    rss0 = psutil.Process().memory_info().rss
    random_ = random.Random(config.seed)
    policy = envfleet.RestartPolicy(max_restarts=10**6, window_s=1.0, restart_on=(Exception,))
    common: dict[str, Any] = {
        "backend": "processes",
        "supervision": envfleet.Supervision(
            restart_policy=policy,
            recycle=envfleet.Recycle(max_episodes=config.recycle_episodes),
            step_timeout=config.step_timeout,
        ),
    }
    if config.defaults:
        common = {}
        config = dataclasses.replace(config, p_raise=0.0, p_hang=0.0)
    make = _factory(config, faults=True)
    envs = envfleet.make(make, config.num_envs, num_workers=config.num_workers, **common)
    obs, _ = envs.reset(seed=config.seed)
    row_bytes = obs[0].nbytes + 8 + 2
    hashes = _Hashes(config.num_envs, row_bytes, config.seed)
    failures: list[Any] = []
    start = time.monotonic()
    next_kill = start + config.kill_every / 2  # never at a snapshot's time
    next_snapshot = start + config.snapshot_every
    step = 0
    workers = config.num_workers
    try:
        while time.monotonic() - start < config.minutes * 60:
            obs, rewards, term, trunc, infos = envs.step(_actions(step, config.num_envs))
            hashes.add(step, obs, rewards, term, trunc, _restarted(infos, config.num_envs))
            step += 1
            now = time.monotonic()
            if now >= next_kill:
                next_kill = now + config.kill_every
                # The worker processes, as their envs tell (nothing else of this process's
                # children: a Ray cluster started here is not to be killed).
                pids = sorted(set(envs.apply(_pid)))
                with contextlib.suppress(ProcessLookupError):
                    os.kill(random_.choice(pids), signal.SIGKILL)
            elif now >= next_snapshot:  # not right after a kill: the next step sees it
                next_snapshot = now + config.snapshot_every
                state = envs.snapshot()
                stats = envs.stats
                failures.extend(stats.failures)
                result.recycled += stats.recycled
                envs.close()
                workers = 2 + (workers - 1) % 4  # 2, 3, 4, 5, 2, ...
                envs = envfleet.make(
                    make, config.num_envs, num_workers=workers, resume=state, **common
                )
                result.snapshots += 1
                log(f"  {now - start:6.0f} s: {step} steps, snapshot {result.snapshots}, "
                    f"{len(failures)} failures survived so far")  # fmt: skip
    finally:
        stats = envs.stats
        failures.extend(stats.failures)
        result.recycled += stats.recycled
        envs.close()
    result.seconds = time.monotonic() - start
    result.steps, result.env_steps = step, step * config.num_envs
    result.survived = len(failures)
    result.restarted_envs = int((hashes.until >= 0).sum())
    log(f"chaos run: {step} steps in {result.seconds:.0f} s; now the fault-free run")
    reference = envfleet.make(_factory(config, faults=False), config.num_envs, backend="processes")
    obs, _ = reference.reset(seed=config.seed)
    clean = _Hashes(config.num_envs, row_bytes, config.seed)
    values = np.zeros(config.num_envs, dtype=np.uint64)
    for t in range(step):
        obs, rewards, term, trunc, _ = reference.step(_actions(t, config.num_envs))
        clean.add(t, obs, rewards, term, trunc, None)
        frozen = hashes.until == t + 1
        values[frozen] = clean.value[frozen]  # the reference up to each env's restart
    reference.close()
    never = hashes.until < 0
    values[never] = clean.value[never]
    frozen_at_0 = hashes.until == 0
    values[frozen_at_0] = 0
    lost = np.flatnonzero(values != hashes.value)
    result.lost_envs = lost.tolist()
    result.steps_lost = int(sum((step if hashes.until[j] < 0 else hashes.until[j]) for j in lost))
    kinds: dict[str, list[Any]] = {}
    for error in failures:
        kinds.setdefault(_kind(error), []).append(error)
    result.injected = {k: len(v) for k, v in sorted(kinds.items())}
    with tempfile.TemporaryDirectory() as tmp:
        for kind, errors in sorted(kinds.items()):
            with_stacks = sum(bool(getattr(e, "stacks", "")) for e in errors)
            if kind in ("segfault", "hang"):
                result.stacks[kind] = f"{with_stacks} of {len(errors)}"
            tried = errors[: config.replays_per_kind]
            reproduced = 0
            for i, error in enumerate(tried):
                if error.replay is None or not error.replay.complete:
                    continue
                path = os.path.join(tmp, f"{kind}-{i}.replay")
                error.replay.save(path)
                # A hang is "no next call within the step timeout"; the other kinds are not
                # bounded so tightly (a replay's first call waits for its process to import
                # envfleet, which takes more than a second on a loaded machine).
                timeout_s = config.step_timeout if kind == "hang" else REPLAY_TIMEOUT_S
                with open(os.devnull, "w") as quiet:
                    outcome = watch_replay(path, timeout_s=timeout_s, stderr=quiet)
                reproduced += outcome.reproduced
                if not outcome.reproduced and kind != "kill":
                    result.not_reproduced.append(
                        f"{kind}: {error} -> {outcome.how} at env {outcome.env_index} "
                        f"step {outcome.step}: {outcome.detail}"
                    )
            result.reproduced[kind] = f"{reproduced} of {len(tried)}"
    # The closed vector envs, and arrays over the last one's shared block.
    del obs, rewards, term, trunc, envs, reference
    gc.collect()
    after = _leftovers()
    result.left = {
        "children": sorted(after["children"] - before["children"]),
        "fds": sorted(after["fds"] - before["fds"]),
        "shm": sorted(set(after["shm"]) - set(before["shm"])),
    }
    result.rss_mb = (rss0 / 2**20, psutil.Process().memory_info().rss / 2**20)
    return result


def table(result: ChaosResult, config: ChaosConfig) -> str:
    faults = ", ".join(f"{k} {v}" for k, v in result.injected.items()) or "none"
    lost = result.lost_envs
    rows = [
        ("run", f"{result.steps:,} steps ({result.env_steps:,} env steps) in "
                f"{result.seconds / 60:.1f} min, {config.num_envs} envs"),
        ("faults survived", f"{result.survived} ({faults})"),
        ("workers recycled", str(result.recycled)),
        ("snapshot/resume cycles", str(result.snapshots)),
        ("envs restarted at least once", f"{result.restarted_envs} of {config.num_envs}"),
        ("steps lost", f"{result.steps_lost}" + (f" (envs {lost})" if lost else "")),
        ("stacks (segfault, hang)", ", ".join(f"{k} {v}" for k, v in result.stacks.items()) or "-"),
        ("replays reproduced", ", ".join(f"{k} {v}" for k, v in result.reproduced.items()) or "-"),
        ("left behind", "nothing" if not any(result.left.values()) else json.dumps(result.left)),
        ("driver RSS (MiB)", f"{result.rss_mb[0]:.0f} -> {result.rss_mb[1]:.0f}"),
    ]  # fmt: skip
    out = ["| | |", "|---|---|", *(f"| {a} | {b} |" for a, b in rows)]
    return "\n".join(out)


def _flag(text: str) -> bool:
    return text.lower() not in ("0", "false", "no", "")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    defaults = ChaosConfig()
    for name, value in asdict(defaults).items():
        kind: Any = _flag if isinstance(value, bool) else type(value)
        parser.add_argument(f"--{name.replace('_', '-')}", type=kind, default=value)
    parser.add_argument("--json", default=None, help="also write the result as JSON here")
    args = parser.parse_args(argv)
    config = ChaosConfig(**{k: getattr(args, k) for k in asdict(defaults)})
    result = chaos(config)
    print(table(result, config))
    for line in result.not_reproduced:
        print(f"not reproduced: {line}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": asdict(config), "result": asdict(result)}, f, indent=2)
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
