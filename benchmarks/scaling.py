"""Throughput of envfleet against its peers and against the hardware limit (benchmarks/README.md).

One run measures, side by side, env steps per second (summed over all sub-environments) of:

- ``limit``: N processes (N = usable cores), each stepping one env in a plain Python loop;
  their rates summed. What the machine can do for that env with no vector env at all.
- ``serial-loop``: the same plain loop, one env, in one process (one core's worth).
- ``gym-sync``, ``gym-async``: gymnasium's SyncVectorEnv / AsyncVectorEnv(shared_memory=True).
- ``sb3-subproc``: stable-baselines3's SubprocVecEnv (start_method="fork").
- ``envpool``: EnvPool's native C++ env (num_envs = batch_size = num_envs of the row).
- ``envfleet-processes`` (defaults: every env in a worker, one worker per core),
  ``envfleet-processes-isolated`` (driver_envs=0 said explicitly: the defaults' layout, kept
  so that older results compare), ``envfleet-processes-share`` (the opt-in share:
  ``driver_envs=num_envs // cores``, the driver stepping the first block), ``envfleet-serial``.

gym-sync, gym-async, envfleet-processes and envfleet-serial are measured by
``envfleet.bench.measure_system`` (what ``envfleet bench`` runs); the others by
:func:`timed_loop`, the same method: reset(seed), the same pre-drawn bank of
``envfleet.bench.ACTION_BANK`` batched actions (``batch_space(single_action_space, n)`` seeded
with the seed, numpy arrays of the space's dtype), a warm-up, then stepping through the bank for
the time budget, reading the clock every ~2 ms, and closing the env whatever happens.

Every measurement runs in a fresh Python interpreter (a child of this script), so no system
inherits another's processes, imports (torch) or memory. Within a repetition the limit and the
systems are measured one after the other for each (env, num_envs), the order rotated from one
repetition to the next; ratios are taken within a repetition and their median reported.

``--extras`` measures instead: the no-op round trip (per-batch ``step()`` time of a 1-env no-op
env on envfleet processes vs serial) and start-up times (make + first reset) per start method.

Run ``python benchmarks/scaling.py --help``; results go to ``benchmarks/results/``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import hashlib
import importlib.metadata
import importlib.util
import json
import multiprocessing
import os
import platform
import re
import resource
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import gymnasium
import numpy as np
import psutil
from gymnasium.vector.utils import batch_space

import envfleet
from envfleet.bench import ACTION_BANK, BenchResult, check_gymnasium_id, measure_system, timed_loop

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"

LIMIT = "limit"
SYSTEMS: tuple[str, ...] = (
    "serial-loop",
    "gym-sync",
    "gym-async",
    "sb3-subproc",
    "envpool",
    "envfleet-processes",
    "envfleet-processes-isolated",
    "envfleet-processes-share",
    "envfleet-serial",
)
#: Systems that ``envfleet.bench.measure_system`` measures, and its name for each.
BENCH_SYSTEMS = {
    "gym-sync": "gym-sync",
    "gym-async": "gym-async",
    "envfleet-processes": "processes",
    "envfleet-serial": "serial",
}
#: The module each optional peer needs.
OPTIONAL = {"sb3-subproc": "stable_baselines3", "envpool": "envpool"}
#: EnvPool's name for each env id it has natively.
ENVPOOL_IDS = {"CartPole-v1": "CartPole-v1", "Pendulum-v1": "Pendulum-v1", "ALE/Pong-v5": "Pong-v5"}

DEFAULT_ENVS = ("CartPole-v1", "Pendulum-v1", "ALE/Pong-v5", "Synthetic-50us", "Synthetic-500us")
DEFAULT_NUM_ENVS = (4, 16, 64)
DEFAULT_NUM_ENVS_BY_ENV = {"ALE/Pong-v5": (8, 16)}

_CHILD_MARK = "SCALING-RESULT "


def usable_cores() -> int:
    """Cores this process may run on (its CPU affinity)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:
        return max(1, os.cpu_count() or 1)


# -- environments defined here ---------------------------------------------------------------


class SyntheticEnv(gymnasium.Env[np.ndarray, np.int64]):
    """An env whose step costs ``step_us`` microseconds of CPU: Box(8,) float32 observations,
    Discrete(2) actions, reward 1.0, episodes of ``episode_steps`` steps (terminated).

    The step busy-waits on this thread's CPU clock (not the wall clock), so a step costs the
    same CPU time whether or not the process is preempted in the middle of it, as a real
    CPU-bound env does. Reset costs nothing.
    """

    metadata: dict[str, Any] = {"render_modes": []}

    def __init__(self, step_us: float = 50.0, episode_steps: int = 1000):
        self.observation_space = gymnasium.spaces.Box(-np.inf, np.inf, (8,), np.float32)
        self.action_space = gymnasium.spaces.Discrete(2)
        self._step_ns = int(step_us * 1000)
        self._episode_steps = episode_steps
        self._t = 0

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        super().reset(seed=seed)
        self._t = 0
        return np.zeros(8, np.float32), {}

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        clock = time.thread_time_ns
        end = clock() + self._step_ns
        while clock() < end:
            pass
        self._t += 1
        return np.full(8, self._t, np.float32), 1.0, self._t >= self._episode_steps, False, {}


class NoopEnv(gymnasium.Env[np.ndarray, np.int64]):
    """A step that does nothing: Box(1,) float32 observations, Discrete(2), never ends."""

    metadata: dict[str, Any] = {"render_modes": []}

    def __init__(self) -> None:
        self.observation_space = gymnasium.spaces.Box(-1.0, 1.0, (1,), np.float32)
        self.action_space = gymnasium.spaces.Discrete(2)
        self._obs = np.zeros(1, np.float32)

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        super().reset(seed=seed)
        return self._obs, {}

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        return self._obs, 0.0, False, False, {}


_SYNTHETIC = re.compile(r"Synthetic-(\d+(?:\.\d+)?)us")


def gym_id(env: str) -> str:
    """The gymnasium id of a benchmark env name; ``Synthetic-<N>us`` is registered here."""
    match = _SYNTHETIC.fullmatch(env)
    if match is None:
        check_gymnasium_id(env)  # imports ale_py for ALE/ ids
        return env
    gid = f"bench/{env}-v0"
    if gid not in gymnasium.registry:
        entry: Any = SyntheticEnv
        gymnasium.register(gid, entry_point=entry, kwargs={"step_us": float(match[1])})
    return gid


class MakeEnv:
    """Picklable ``gymnasium.make(gym_id)`` for the peers' worker processes."""

    def __init__(self, gid: str):
        self.gid = gid

    def __call__(self) -> gymnasium.Env[Any, Any]:
        if self.gid.startswith("ALE/"):
            check_gymnasium_id(self.gid)
        return gymnasium.make(self.gid)


# -- the timed loop --------------------------------------------------------------------------


def action_bank(single_space: gymnasium.Space[Any], n: int, seed: int) -> list[Any]:
    """``ACTION_BANK`` batched actions, drawn as ``envfleet.bench.measure_system`` draws them."""
    space = batch_space(single_space, n)
    space.seed(seed)
    return [space.sample() for _ in range(ACTION_BANK)]


def _plain_loop(
    env_fn: Callable[[], gymnasium.Env[Any, Any]],
    index: int,
    spec: dict[str, Any],
    before_timing: Callable[[], None] | None = None,
) -> tuple[int, float, float]:
    """One env stepped in a plain loop, reset when done; returns (steps, seconds, startup_s).

    Its actions are column ``index`` of a batched bank, numpy values as a vector env passes.
    """
    start = time.perf_counter()
    env = env_fn()
    try:
        env.reset(seed=spec["seed"] + index)
        startup_s = time.perf_counter() - start
        batched = action_bank(env.action_space, index + 1, spec["seed"])
        bank = [a[index] for a in batched]
        env_step, env_reset = env.step, env.reset

        def step(action: Any) -> None:
            _, _, terminated, truncated, _ = env_step(action)
            if terminated or truncated:
                env_reset()

        steps, elapsed = timed_loop(
            step, bank, spec["seconds"], spec["warmup_s"], before_timing=before_timing
        )
    finally:
        env.close()
    return steps, elapsed, startup_s


def _limit_worker(
    spec: dict[str, Any], index: int, barrier: Any, queue: Any, env_fn: Callable[[], Any]
) -> None:
    try:

        def wait() -> None:
            barrier.wait(timeout=120)

        queue.put(("ok", index, _plain_loop(env_fn, index, spec, wait)))
    except BaseException as exc:  # reported to the parent, which fails the measurement
        with contextlib.suppress(Exception):
            barrier.abort()
        queue.put(("error", index, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


def _measure_limit(spec: dict[str, Any], env_fn: Callable[[], Any]) -> BenchResult:
    procs_n = usable_cores()
    ctx = multiprocessing.get_context("fork")
    barrier = ctx.Barrier(procs_n)
    queue = ctx.SimpleQueue()
    procs = [
        ctx.Process(target=_limit_worker, args=(spec, j, barrier, queue, env_fn), daemon=True)
        for j in range(procs_n)
    ]
    for p in procs:
        p.start()
    results = [queue.get() for _ in procs]
    for p in procs:
        p.join(timeout=30)
    errors = [r[2] for r in results if r[0] == "error"]
    if errors:
        raise RuntimeError(f"a limit process failed: {errors[0]}")
    per_proc = [r[2] for r in results]
    return BenchResult(
        system=LIMIT,
        env_id=spec["env"],
        num_envs=procs_n,
        steps_per_s=sum(steps / secs for steps, secs, _ in per_proc),
        batch_steps=sum(steps for steps, _, _ in per_proc),
        seconds=max(secs for _, secs, _ in per_proc),
        startup_s=max(s for _, _, s in per_proc),
    )


def _measure_vector(
    system: str, spec: dict[str, Any], build: Callable[[], Any], single_action_space: Any
) -> BenchResult:
    """Time any vector env with ``reset``/``step``/``close`` (``build()`` returns it)."""
    n, seed = spec["num_envs"], spec["seed"]
    start = time.perf_counter()
    envs = build()
    finished = False
    try:
        reset = envs.reset
        if system == "sb3-subproc":
            envs.seed(seed)
            reset()
        else:
            reset(seed=seed)
        startup_s = time.perf_counter() - start
        bank = action_bank(single_action_space, n, seed)
        if system == "envpool":  # its own action dtype (e.g. int32 for Discrete)
            dtype = envs.action_space.dtype
            bank = [np.asarray(a, dtype=dtype) for a in bank]
        steps, elapsed = timed_loop(envs.step, bank, spec["seconds"], spec["warmup_s"])
        finished = True
    finally:
        if system in ("envfleet-processes-isolated", "envfleet-processes-share"):
            envs.close(terminate=not finished)
        else:
            envs.close()
    return BenchResult(system, spec["env"], n, n * steps / elapsed, steps, elapsed, startup_s)


def measure_one(spec: dict[str, Any]) -> dict[str, Any]:
    """Measure one system on one (env, num_envs); runs in a fresh child interpreter."""
    system, n, seed = spec["system"], spec["num_envs"], spec["seed"]
    if sys.platform.startswith("linux"):
        # Every system forks its workers, whatever this Python's default start method is.
        multiprocessing.set_start_method("fork", force=True)
    gid = gym_id(spec["env"])
    env_fn = MakeEnv(gid)
    if system in OPTIONAL:
        try:
            __import__(OPTIONAL[system])
        except Exception as exc:
            why = f"{type(exc).__name__}: {exc}"
            return {"skipped": f"{OPTIONAL[system]} is not importable ({why})"}
    if system == "envpool" and spec["env"] not in ENVPOOL_IDS:
        return {"skipped": f"EnvPool has no native {spec['env']}"}

    if system in BENCH_SYSTEMS:
        result = measure_system(
            gid, n, BENCH_SYSTEMS[system], spec["seconds"], seed=seed, warmup_s=spec["warmup_s"]
        )
        result = BenchResult(**{**asdict(result), "system": system, "env_id": spec["env"]})
    elif system == LIMIT:
        result = _measure_limit(spec, env_fn)
    elif system == "serial-loop":
        steps, elapsed, startup_s = _plain_loop(env_fn, 0, spec)
        result = BenchResult(system, spec["env"], 1, steps / elapsed, steps, elapsed, startup_s)
    else:
        probe = env_fn()
        single_action_space = probe.action_space
        probe.close()
        build: Callable[[], Any]
        if system == "envfleet-processes-isolated":

            def build() -> Any:
                return envfleet.make(gid, n, backend=envfleet.Processes(driver_envs=0))

        elif system == "envfleet-processes-share":
            share = n // usable_cores() if usable_cores() > 1 else 0

            def build() -> Any:
                return envfleet.make(gid, n, backend=envfleet.Processes(driver_envs=share))

        elif system == "sb3-subproc":
            from stable_baselines3.common.vec_env import SubprocVecEnv

            def build() -> Any:
                return SubprocVecEnv([env_fn] * n, start_method="fork")

        elif system == "envpool":
            import envpool

            def build() -> Any:
                eid = ENVPOOL_IDS[spec["env"]]
                return envpool.make(eid, env_type="gymnasium", num_envs=n, batch_size=n, seed=seed)

        else:
            raise ValueError(f"unknown system {system!r}")
        result = _measure_vector(system, spec, build, single_action_space)
    return {"result": asdict(result)}


# -- extras ----------------------------------------------------------------------------------


def measure_noop(spec: dict[str, Any]) -> dict[str, Any]:
    """Per-batch ``step()`` time (µs) of a 1-env no-op env on one system."""
    system = spec["system"]
    if system == "envfleet-processes":
        envs: Any = envfleet.make(
            NoopEnv, 1, num_workers=1, backend=envfleet.Processes(driver_envs=0)
        )
    elif system == "envfleet-processes-spin0":
        envs = envfleet.make(
            NoopEnv,
            1,
            num_workers=1,
            backend=envfleet.Processes(driver_envs=0, spin_s=0.0),
        )
    elif system == "envfleet-serial":
        envs = envfleet.make(NoopEnv, 1, backend="serial")
    elif system == "gym-sync":
        envs = gymnasium.vector.SyncVectorEnv([NoopEnv])
    elif system == "gym-async":
        envs = gymnasium.vector.AsyncVectorEnv([NoopEnv], context="fork")
    else:
        raise ValueError(f"unknown no-op system {system!r}")
    try:
        envs.reset(seed=spec["seed"])
        bank = action_bank(envs.single_action_space, 1, spec["seed"])
        steps, elapsed = timed_loop(envs.step, bank, spec["seconds"], spec["warmup_s"])
    finally:
        envs.close()
    return {"result": {"system": system, "us_per_step": elapsed / steps * 1e6, "steps": steps}}


def measure_startup(spec: dict[str, Any]) -> dict[str, Any]:
    """Seconds from building 16 CartPole envs to the first reset returning, and to close."""
    system, context, n = spec["system"], spec["context"], spec["num_envs"]
    t0 = time.perf_counter()
    if system == "envfleet-processes":
        envs: Any = envfleet.make(
            "CartPole-v1",
            n,
            num_workers=n,
            backend=envfleet.Processes(driver_envs=0, context=context),
        )
    elif system == "gym-async":
        envs = gymnasium.vector.AsyncVectorEnv(
            [MakeEnv("CartPole-v1")] * n, shared_memory=True, context=context
        )
    else:
        raise ValueError(f"unknown start-up system {system!r}")
    try:
        envs.reset(seed=0)
        startup_s = time.perf_counter() - t0
    finally:
        t1 = time.perf_counter()
        envs.close()
        close_s = time.perf_counter() - t1
    return {
        "result": {
            "system": system,
            "backend": envfleet.Processes(context=context),
            "startup_s": startup_s,
            "close_s": close_s,
        }
    }


# -- the parent: run children, aggregate, report ---------------------------------------------


def _busy_cpu_s() -> float | None:
    """CPU seconds the whole machine spent busy since boot, all cores together (psutil; Linux
    counts guest time in user time, so it is left out once)."""
    t = psutil.cpu_times()
    idle = t.idle + sum(getattr(t, f, 0.0) for f in ("iowait", "guest", "guest_nice"))
    return float(sum(t) - idle)


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def wait_for_quiet(max_cores: float, max_wait_s: float) -> float | None:
    """Wait (at most ``max_wait_s``) until the machine's other load is under ``max_cores``.

    Returns the load last seen, in cores busy (``None`` where ``/proc/stat`` is missing).
    """
    deadline = time.monotonic() + max_wait_s
    while True:
        b0, t0 = _busy_cpu_s(), time.monotonic()
        time.sleep(0.3)
        b1, t1 = _busy_cpu_s(), time.monotonic()
        if b0 is None or b1 is None:
            return None
        load = (b1 - b0) / (t1 - t0)
        if load <= max_cores or time.monotonic() > deadline:
            return load
        time.sleep(1.0)


def run_child(spec: dict[str, Any], timeout: float) -> dict[str, Any]:
    """Run one measurement in a fresh interpreter; returns its result, skip or error dict.

    The result gets ``foreign_cores``: the CPU the rest of the machine used meanwhile (busy CPU
    from ``/proc/stat`` less the CPU of the child and its waited-for descendants), in cores.
    """
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(spec)]
    busy0, own0, t0 = _busy_cpu_s(), _children_cpu_s(), time.monotonic()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    busy1, own1, t1 = _busy_cpu_s(), _children_cpu_s(), time.monotonic()
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(_CHILD_MARK):
            out = dict(json.loads(line[len(_CHILD_MARK) :]))
            if busy0 is not None and busy1 is not None:
                foreign = (busy1 - busy0) - (own1 - own0)
                out["foreign_cores"] = max(0.0, foreign) / max(t1 - t0, 1e-9)
            return out
    tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-6:])
    return {"error": f"exit status {proc.returncode}: {tail}"}


def run_measured(
    spec: dict[str, Any],
    args: argparse.Namespace,
    timeout: float,
    label: str,
    check_foreign: bool = True,
) -> dict[str, Any]:
    """:func:`run_child` after waiting for a quiet machine; measured again (up to
    ``args.retries`` times) when other processes used more than ``args.max_foreign`` cores
    meanwhile. The result gets ``tries`` and ``load_before`` (cores busy before it started).

    ``check_foreign=False`` where the measurement's own processes escape the accounting: a
    forkserver and its workers are never waited for by the child, so their CPU would count as
    other load. Such results get ``foreign_cores`` None; the quiet wait before still applies.
    """
    out: dict[str, Any] = {}
    for attempt in range(args.retries + 1):
        load = wait_for_quiet(args.max_foreign, args.quiet_wait)
        out = run_child(spec, timeout)
        out["tries"] = attempt + 1
        out["load_before"] = load
        if not check_foreign:
            out["foreign_cores"] = None
        foreign = out.get("foreign_cores")
        if "result" not in out or foreign is None or foreign <= args.max_foreign:
            break
        if attempt < args.retries:
            print(
                f"{label}: other processes used {foreign:.2f} cores meanwhile; measuring again",
                file=sys.stderr,
                flush=True,
            )
    return out


def child_main(spec_json: str) -> int:
    spec = json.loads(spec_json)
    kind = spec.get("kind", "throughput")
    try:
        if kind == "noop":
            out = measure_noop(spec)
        elif kind == "startup":
            out = measure_startup(spec)
        else:
            out = measure_one(spec)
    except Exception as exc:
        traceback.print_exc()
        out = {"error": f"{type(exc).__name__}: {exc}"}
    print(_CHILD_MARK + json.dumps(out), flush=True)
    return 0


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def run_info(args: argparse.Namespace) -> dict[str, Any]:
    cpu = platform.processor()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    repo = HERE.parent
    git: dict[str, Any] = {}
    with contextlib.suppress(Exception):
        head = subprocess.run(
            ["git", "-C", str(repo), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        diff = subprocess.run(
            ["git", "-C", str(repo), "diff", "HEAD", "--", "src"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        git = {"head": head, "src_dirty": bool(diff)}
        if diff:
            git["src_diff_sha1"] = hashlib.sha1(diff.encode()).hexdigest()[:12]
    return {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "cpu": cpu,
        "usable_cores": usable_cores(),
        "python": platform.python_version(),
        "git": git,
        "versions": {
            d: _version(d)
            for d in (
                "envfleet",
                "gymnasium",
                "numpy",
                "ale-py",
                "stable-baselines3",
                "envpool",
                "torch",
            )
        },
        "seconds": args.seconds,
        "warmup_s": args.warmup,
        "repeats": args.repeats,
    }


def parse_envs(items: Sequence[str], num_envs: Sequence[int] | None) -> list[tuple[str, list[int]]]:
    """``ID`` or ``ID:N,N,...``; without counts: ``--num-envs`` or the env's defaults."""
    out = []
    for item in items:
        env, counts = item, ""
        if re.fullmatch(r".+:[0-9,]+", item):
            env, _, counts = item.rpartition(":")
        if counts:
            ns = [int(c) for c in counts.split(",") if c]
        elif num_envs:
            ns = list(num_envs)
        else:
            ns = list(DEFAULT_NUM_ENVS_BY_ENV.get(env, DEFAULT_NUM_ENVS))
        if not ns or min(ns) < 1:
            raise SystemExit(f"bad num_envs for {env!r}: {ns}")
        out.append((env, sorted(set(ns))))
    return out


def _median(xs: Sequence[float]) -> float | None:
    return statistics.median(xs) if xs else None


def aggregate(records: list[dict[str, Any]], systems: Sequence[str]) -> list[dict[str, Any]]:
    """Per (env, num_envs, system): median steps/s and medians of same-repetition ratios."""
    by_key: dict[tuple[str, int, int], dict[str, float]] = {}
    for r in records:
        key = (r["env"], r["num_envs"], r["repeat"])
        by_key.setdefault(key, {})[r["system"]] = r["steps_per_s"]
    rows = []
    envs_n = list(dict.fromkeys((r["env"], r["num_envs"]) for r in records))
    env_order = list(dict.fromkeys(r["env"] for r in records))
    envs_n.sort(key=lambda k: (env_order.index(k[0]), k[1]))
    for env, n in envs_n:
        reps = sorted(rep for (e, m, rep) in by_key if (e, m) == (env, n))
        for system in (LIMIT, *systems):
            seen = [by_key[(env, n, rep)] for rep in reps]
            rates = [got[system] for got in seen if system in got]
            if not rates:
                continue
            row: dict[str, Any] = {
                "env": env,
                "num_envs": n,
                "system": system,
                "steps_per_s": _median(rates),
                "min": min(rates),
                "max": max(rates),
                "repeats": len(rates),
            }
            for ref in (LIMIT, "gym-sync", "gym-async"):
                ratios = [
                    by_key[(env, n, rep)][system] / by_key[(env, n, rep)][ref]
                    for rep in reps
                    if system in by_key[(env, n, rep)] and by_key[(env, n, rep)].get(ref)
                ]
                row[f"x_{ref}"] = _median(ratios)
            rows.append(row)
    return rows


def _fmt_ratio(x: float | None) -> str:
    return "" if x is None else f"{x:.2f}"


def markdown(rows: list[dict[str, Any]], info: dict[str, Any], notes: list[str]) -> str:
    reps = info["repeats"]
    warmup = min(info["warmup_s"], info["seconds"] / 2)
    lines = [
        f"Run {info['date']} — `{info['command']}`",
        "",
        f"{info['cpu']}, {info['usable_cores']} usable cores, Python {info['python']}, "
        + ", ".join(f"{k} {v}" for k, v in info["versions"].items() if v)
        + (f"; envfleet at {info['git'].get('head')}" if info["git"] else "")
        + (" with uncommitted changes in src/" if info["git"].get("src_dirty") else "")
        + f". {info['seconds']} s per measurement after {warmup} s of warm-up; "
        f"median of {reps} repetition{'s' if reps > 1 else ''}.",
        "",
    ]
    spread = reps > 1
    head = "| env | num_envs | system | steps/s | × limit | × gym-sync | × gym-async |"
    rule = "|-----|---------:|--------|--------:|--------:|-----------:|------------:|"
    if spread:
        head += " min–max steps/s |"
        rule += "----------------:|"
    lines += [head, rule]
    for r in rows:
        line = (
            f"| {r['env']} | {r['num_envs']} | {r['system']} | {r['steps_per_s']:,.0f} | "
            f"{_fmt_ratio(r['x_limit'])} | {_fmt_ratio(r['x_gym-sync'])} | "
            f"{_fmt_ratio(r['x_gym-async'])} |"
        )
        if spread:
            line += f" {r['min']:,.0f}–{r['max']:,.0f} |"
        lines.append(line)
    if notes:
        lines += ["", "Notes:", ""] + [f"- {n}" for n in notes]
    return "\n".join(lines) + "\n"


def _si(value: float, _pos: Any = None) -> str:
    """Tick label: 2k, 50k, 1.2M."""
    for scale, suffix in ((1e6, "M"), (1e3, "k")):
        if value >= scale:
            return f"{value / scale:g}{suffix}"
    return f"{value:g}"


def plot(
    rows: list[dict[str, Any]], systems: Sequence[str], out_prefix: Path, repeats: int = 1
) -> list[Path]:
    """One PNG per env: steps/s against num_envs, one line per system, log-x and log-y.

    With a single num_envs, the systems' points are spread a little sideways so that equal
    values stay visible.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter
    except ImportError:
        print("matplotlib is not installed: no plots", file=sys.stderr)
        return []
    paths = []
    styles: dict[str, dict[str, Any]] = {
        LIMIT: {"color": "black", "linestyle": "--", "marker": "", "linewidth": 2},
        "serial-loop": {"color": "0.55", "linestyle": ":", "marker": "."},
        "gym-sync": {"color": "tab:blue", "marker": "o"},
        "gym-async": {"color": "tab:cyan", "marker": "o"},
        "sb3-subproc": {"color": "tab:olive", "marker": "s"},
        "envpool": {"color": "tab:purple", "marker": "D"},
        "envfleet-processes": {"color": "tab:red", "marker": "^", "linewidth": 2.5},
        "envfleet-processes-isolated": {"color": "tab:orange", "marker": "v"},
        "envfleet-processes-share": {"color": "tab:pink", "marker": "<"},
        "envfleet-serial": {"color": "tab:green", "marker": "^"},
    }
    for env in dict.fromkeys(r["env"] for r in rows):
        fig, ax = plt.subplots(figsize=(8, 5.5), dpi=110)
        ns = sorted({r["num_envs"] for r in rows if r["env"] == env})
        present = [s for s in (LIMIT, *systems) if any(r["system"] == s for r in rows)]
        for k, system in enumerate(present):
            pts = sorted(
                (r["num_envs"], r["steps_per_s"])
                for r in rows
                if r["env"] == env and r["system"] == system
            )
            if not pts:
                continue
            style = dict(styles.get(system, {}))
            if len(pts) == 1 and not style.get("marker"):
                style["marker"] = "_"
                style["markersize"] = 20
            dodge = 1.04 ** (k - (len(present) - 1) / 2) if len(ns) == 1 and k else 1.0
            xs = [p[0] * dodge for p in pts]
            ax.plot(xs, [p[1] for p in pts], label=system, **style)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_minor_locator(LogLocator(base=10, subs=tuple(range(1, 10))))
        ax.yaxis.set_major_formatter(FuncFormatter(_si))
        ax.yaxis.set_minor_formatter(NullFormatter())
        ax.set_xticks(ns)
        ax.set_xticklabels([str(n) for n in ns])
        if len(ns) == 1:
            ax.set_xlim(ns[0] / 1.5, ns[0] * 1.5)
        ax.set_xlabel("num_envs")
        ax.set_ylabel("env steps/s (summed over sub-environments)")
        of = f"median of {repeats} repetitions" if repeats > 1 else "1 repetition"
        ax.set_title(f"{env}: env steps/s by num_envs ({of})")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
        fig.tight_layout()
        slug = re.sub(r"[^A-Za-z0-9.-]+", "-", env).strip("-")
        path = out_prefix.with_name(f"{out_prefix.name}-{slug}.png")
        fig.savefig(path)
        plt.close(fig)
        paths.append(path)
    return paths


def out_prefix(name: str) -> Path:
    path = Path(name)
    if path.parent == Path("."):
        path = RESULTS / name
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def main_scaling(args: argparse.Namespace) -> int:
    envs = parse_envs(args.envs, args.num_envs)
    systems = [s for s in SYSTEMS if s in args.systems] if args.systems else list(SYSTEMS)
    notes: list[str] = []
    skip: dict[str, str] = {}
    for system, module in OPTIONAL.items():
        if system in systems and importlib.util.find_spec(module) is None:
            skip[system] = f"{module} is not installed"
    info = run_info(args)
    records: list[dict[str, Any]] = []
    failures: dict[tuple[str, str], str] = {}
    timeout = 180 + 3 * (args.seconds + args.warmup)
    order = [LIMIT, *systems]
    total = args.repeats * sum(len(ns) for _, ns in envs) * len(order)
    done = 0
    for rep in range(args.repeats):
        rotated = order[rep % len(order) :] + order[: rep % len(order)]
        for env, ns in envs:
            for n in ns:
                for system in rotated:
                    done += 1
                    label = f"[{done}/{total}] rep {rep + 1} {env} n={n} {system}"
                    if system in skip:
                        continue
                    if (env, system) in failures:
                        continue
                    spec = {
                        "kind": "throughput",
                        "env": env,
                        "num_envs": n,
                        "system": system,
                        "seconds": args.seconds,
                        "warmup_s": args.warmup,
                        "seed": args.seed,
                    }
                    out = run_measured(spec, args, timeout, label)
                    if "skipped" in out:
                        why = out["skipped"]
                        if "not importable" in why:
                            skip[system] = why
                        else:
                            failures[(env, system)] = why
                        print(f"{label}: skipped ({why})", file=sys.stderr, flush=True)
                        continue
                    if "error" in out:
                        failures[(env, system)] = f"failed: {out['error']}"
                        print(f"{label}: FAILED {out['error']}", file=sys.stderr, flush=True)
                        continue
                    res = out["result"]
                    foreign = out.get("foreign_cores")
                    records.append(
                        {
                            **res,
                            "env": env,
                            "num_envs": n,
                            "repeat": rep,
                            "foreign_cores": foreign,
                            "load_before": out.get("load_before"),
                            "tries": out["tries"],
                        }
                    )
                    print(
                        f"{label}: {res['steps_per_s']:,.0f} steps/s "
                        f"(start-up {res['startup_s']:.2f} s, other load "
                        f"{'?' if foreign is None else f'{foreign:.2f}'} cores)",
                        file=sys.stderr,
                        flush=True,
                    )
    for system, why in skip.items():
        notes.append(f"{system}: skipped, {why}.")
    for (env, system), why in failures.items():
        notes.append(f"{system} on {env}: {why}")
    retried = sum(1 for r in records if r["tries"] > 1)
    disturbed = [r for r in records if (r["foreign_cores"] or 0.0) > args.max_foreign]
    if retried:
        notes.append(
            f"{retried} of {len(records)} measurements were taken again because other "
            f"processes used more than {args.max_foreign} cores meanwhile."
        )
    if disturbed:
        notes.append(
            f"{len(disturbed)} measurements still ran beside other load (> {args.max_foreign} "
            "cores) after the retries: "
            + ", ".join(
                f"{r['env']} n={r['num_envs']} {r['system']} rep {r['repeat'] + 1} "
                f"({r['foreign_cores']:.2f})"
                for r in disturbed
            )
            + "."
        )
    rows = aggregate(records, systems)
    text = markdown(rows, info, notes)
    print(text)
    prefix = out_prefix(args.out)
    prefix.with_suffix(".md").write_text(text)
    prefix.with_suffix(".json").write_text(
        json.dumps({"info": info, "rows": rows, "records": records, "notes": notes}, indent=1)
        + "\n"
    )
    pngs = plot(rows, systems, prefix, args.repeats)
    print(f"wrote {prefix.with_suffix('.md')}, {prefix.with_suffix('.json')}", file=sys.stderr)
    for p in pngs:
        print(f"wrote {p}", file=sys.stderr)
    return 0


def main_extras(args: argparse.Namespace) -> int:
    info = run_info(args)
    timeout = 180 + 3 * (args.seconds + args.warmup)
    noop_systems = (
        "envfleet-processes",
        "envfleet-processes-spin0",
        "envfleet-serial",
        "gym-sync",
        "gym-async",
    )
    noop: dict[str, list[float]] = {s: [] for s in noop_systems}
    lines_err: list[str] = []
    foreign_seen: list[float] = []
    for rep in range(args.repeats):
        k = rep % len(noop_systems)
        for system in noop_systems[k:] + noop_systems[:k]:
            spec = {
                "kind": "noop",
                "system": system,
                "seconds": args.seconds,
                "warmup_s": args.warmup,
                "seed": args.seed,
            }
            out = run_measured(spec, args, timeout, f"no-op {system}")
            foreign_seen.append(out.get("foreign_cores") or 0.0)
            if "result" in out:
                noop[system].append(out["result"]["us_per_step"])
                print(
                    f"no-op {system}: {out['result']['us_per_step']:.2f} µs/step",
                    file=sys.stderr,
                    flush=True,
                )
            else:
                lines_err.append(f"no-op {system}: {out}")
                print(lines_err[-1], file=sys.stderr, flush=True)

    contexts = [
        c for c in ("fork", "spawn", "forkserver") if c in multiprocessing.get_all_start_methods()
    ]
    startup: dict[tuple[str, str], list[float]] = {}
    close: dict[tuple[str, str], list[float]] = {}
    for _trial in range(args.startup_trials):
        for context in contexts:
            for system in ("envfleet-processes", "gym-async"):
                spec = {
                    "kind": "startup",
                    "system": system,
                    "backend": envfleet.Processes(context=context),
                    "num_envs": 16,
                }
                label = f"start-up {system} {context}"
                out = run_measured(spec, args, timeout, label, context != "forkserver")
                foreign_seen.append(out.get("foreign_cores") or 0.0)
                if "result" in out:
                    startup.setdefault((system, context), []).append(out["result"]["startup_s"])
                    close.setdefault((system, context), []).append(out["result"]["close_s"])
                    print(
                        f"start-up {system} {context}: {out['result']['startup_s']:.2f} s",
                        file=sys.stderr,
                        flush=True,
                    )
                else:
                    lines_err.append(f"start-up {system} {context}: {out}")
                    print(lines_err[-1], file=sys.stderr, flush=True)

    med = {s: _median(v) for s, v in noop.items()}
    disturbed_n = sum(1 for f in foreign_seen if f > args.max_foreign)
    serial = med.get("envfleet-serial")
    text = [
        f"Run {info['date']} — `{info['command']}`",
        "",
        f"{info['cpu']}, {info['usable_cores']} usable cores, Python {info['python']}, "
        f"envfleet at {info['git'].get('head')}"
        + (" with uncommitted changes in src/" if info["git"].get("src_dirty") else "")
        + f". No-op: {args.seconds} s per measurement, median of {args.repeats}; "
        f"start-up: median of {args.startup_trials}, each in a fresh interpreter.",
        "",
        "### No-op env round trip (1 env, per-batch `step()` time)",
        "",
        "| system | µs per step() | − envfleet-serial (transport) |",
        "|--------|--------------:|------------------------------:|",
    ]
    labels = {
        "envfleet-processes": "envfleet processes (num_workers=1, driver_envs=0)",
        "envfleet-processes-spin0": "envfleet processes, spin_s=0 (always block)",
        "envfleet-serial": "envfleet serial",
        "gym-sync": "gymnasium SyncVectorEnv",
        "gym-async": "gymnasium AsyncVectorEnv (fork)",
    }
    for system in noop_systems:
        m = med[system]
        if m is None:
            continue
        diff = "" if serial is None else f"{m - serial:+.2f}"
        text.append(f"| {labels[system]} | {m:.2f} | {diff} |")
    text += [
        "",
        "### Start-up: 16 × CartPole-v1, build until the first reset returns (seconds)",
        "",
        "| system | " + " | ".join(contexts) + " |",
        "|--------|" + "|".join("-" * (len(c) + 1) + ":" for c in contexts) + "|",
    ]
    startup_labels = {
        "envfleet-processes": "envfleet processes (num_workers=16, driver_envs=0)",
        "gym-async": "gymnasium AsyncVectorEnv(16)",
    }
    for system in ("envfleet-processes", "gym-async"):
        cells = []
        for c in contexts:
            m = _median(startup.get((system, c), []))
            cells.append("" if m is None else f"{m:.2f}")
        text.append(f"| {startup_labels[system]} | " + " | ".join(cells) + " |")
    text += ["", "Close time (seconds, median):", ""]
    for (system, ctx), v in sorted(close.items()):
        text.append(f"- {system} {ctx}: {statistics.median(v):.2f}")
    if disturbed_n:
        text += [
            "",
            f"{disturbed_n} measurements ran beside other load (> {args.max_foreign} "
            "cores) even after the retries.",
        ]
    if lines_err:
        text += ["", "Errors:", ""] + [f"- {e}" for e in lines_err]
    doc = "\n".join(text) + "\n"
    print(doc)
    prefix = out_prefix(args.out)
    prefix.with_suffix(".md").write_text(doc)
    raw = {
        "info": info,
        "noop_us_per_step": noop,
        "startup_s": {f"{s}/{c}": v for (s, c), v in startup.items()},
        "close_s": {f"{s}/{c}": v for (s, c), v in close.items()},
        "errors": lines_err,
    }
    prefix.with_suffix(".json").write_text(json.dumps(raw, indent=1) + "\n")
    print(f"wrote {prefix.with_suffix('.md')}, {prefix.with_suffix('.json')}", file=sys.stderr)
    return 0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=(
            "Env steps/s of envfleet and its peers against the hardware limit "
            "(see benchmarks/README.md)."
        )
    )
    p.add_argument(
        "--envs",
        nargs="+",
        default=list(DEFAULT_ENVS),
        metavar="ENV[:N,N]",
        help="gymnasium ids or Synthetic-<N>us (a step costing N µs of CPU), each optionally "
        "with its own num_envs list, e.g. ALE/Pong-v5:8,16 (default: %(default)s)",
    )
    p.add_argument(
        "--num-envs",
        nargs="+",
        type=int,
        default=None,
        help="num_envs for the envs given without their own list (default: 4 16 64; "
        "8 16 for ALE/Pong-v5)",
    )
    p.add_argument(
        "--systems",
        nargs="+",
        choices=SYSTEMS,
        default=None,
        help="systems to measure besides the limit, which is always measured (default: all)",
    )
    p.add_argument("--seconds", type=float, default=2.0, help="timed window per measurement")
    p.add_argument("--warmup", type=float, default=0.25, help="warm-up seconds (≤ seconds/2)")
    p.add_argument("--repeats", type=int, default=1, help="repetitions of the whole set")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--max-foreign",
        type=float,
        default=0.25,
        metavar="CORES",
        help="a measurement during which other processes used more CPU than this (in cores) "
        "is taken again, and each waits for the machine to be this quiet first (default: "
        "%(default)s; inf: never)",
    )
    p.add_argument("--retries", type=int, default=2, help="re-measurements at most (default 2)")
    p.add_argument(
        "--quiet-wait",
        type=float,
        default=60.0,
        metavar="S",
        help="seconds at most to wait for a quiet machine before a measurement (default 60)",
    )
    p.add_argument(
        "--out",
        default=None,
        help="result name (files benchmarks/results/NAME.md, .json, NAME-<env>.png) or a path "
        "prefix (default: scaling, or extras with --extras)",
    )
    p.add_argument(
        "--extras",
        action="store_true",
        help="measure the no-op round trip and the start-up times instead of the throughput",
    )
    p.add_argument("--startup-trials", type=int, default=3, help="with --extras (median of)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.child is not None:
        return child_main(args.child)
    if args.seconds <= 0 or args.repeats < 1 or args.warmup < 0:
        raise SystemExit("--seconds must be > 0, --repeats >= 1, --warmup >= 0")
    if args.out is None:
        args.out = "extras" if args.extras else "scaling"
    return main_extras(args) if args.extras else main_scaling(args)


if __name__ == "__main__":
    sys.exit(main())
