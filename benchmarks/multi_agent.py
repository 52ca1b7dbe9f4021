"""Multi-agent vector envs: envfleet against SuperSuit, PufferLib and a serial loop (issue 20).

Workloads, ``N = 8`` copies each, random actions (a seeded bank, cycled):

- ``pistonball``: ``pistonball_v6.parallel_env()`` with PettingZoo's defaults: 20 pistons,
  ``uint8[457, 120, 3]`` image observations per agent (3.3 MB per env step), a step of about
  ten milliseconds: the env's own work and the observation bytes dominate.
- ``kaz``: ``knights_archers_zombies_v11.parallel_env()`` (vector observations,
  ``float64[27, 5]`` per agent, 4 agents that die when a zombie reaches them), a step of well
  under a millisecond. Chosen as the vector-observation env because its step cost is in the
  range of most vector-observation PettingZoo envs (SISL's multiwalker costs about the same,
  pursuit a few times more), so what a vector env adds per step (pipes, pickling, copies,
  packing the agents) shows against it, and because its agents leave early, which exercises
  the agent mask (envfleet) and ``black_death_v3`` (SuperSuit, which refuses agent death
  without it).

Systems:

- ``loop``: a plain loop over the N raw ParallelEnvs (dict actions for the live agents, reset
  when ``env.agents`` is empty): the reference. ``loop x cores`` is the machine's limit.
- ``supersuit-mp``: ``concat_vec_envs_v1(pettingzoo_env_to_vec_env_v1(env), N,
  num_cpus=cores, base_class="gymnasium")``: SuperSuit's multiprocessing vector env;
  ``supersuit-serial``: the same with ``num_cpus=0`` (its serial concatenation).
- ``envfleet-processes``, ``envfleet-serial``: ``envfleet.make(factory, N, backend=...)``,
  an ``envfleet.MultiAgentVectorEnv``.
- ``puffer-mp``: PufferLib's ``PettingZooPufferEnv`` emulation on
  ``pufferlib.vector.Multiprocessing`` (``batch_size = N``); left
  out with the install command when pufferlib is missing. As ``envfleet bench``'s ``puffer-mp``,
  ``num_workers`` is the largest divisor of N that leaves one core to its driver, which spins
  while it waits.

Counting: an env step is one step of one ParallelEnv; agent steps are env steps times
``len(possible_agents)`` (SuperSuit's and PufferLib's rows), whether or not an agent is alive.
Each (workload, system) is measured ``--repeats`` times for ``--seconds`` after a warm-up, the
systems interleaved (their order rotates each repetition); the table gives medians, and the
median over repetitions of the ratio to ``supersuit-mp`` within the same repetition.

Run: ``python benchmarks/multi_agent.py [--workloads pistonball,kaz] [--systems ...]
[--repeats 3] [--seconds 3] [--json FILE]``; ``--quick`` is the smoke mode (small envs, N = 2,
short windows, one repetition). Needs ``pip install 'envfleet[pettingzoo]'`` (PettingZoo's
butterfly envs, SuperSuit).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import json
import platform
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import gymnasium
import numpy as np
import psutil

import envfleet
from envfleet.bench import puffer_workers, usable_cores

SYSTEMS = (
    "loop",
    "supersuit-mp",
    "supersuit-serial",
    "envfleet-processes",
    "envfleet-serial",
    "puffer-mp",
)
BASELINE = "supersuit-mp"
PUFFER_INSTALL = "pip install pufferlib-core --no-deps"
BANK = 16  # batched actions drawn once per workload, cycled through


@dataclass(frozen=True)
class Workload:
    """A PettingZoo env and how many copies; ``kwargs`` go to its ``parallel_env``."""

    name: str
    env: str  # "module:function" of a ParallelEnv factory
    num_envs: int
    kwargs: dict[str, Any] = field(default_factory=dict)
    black_death: bool = False  # SuperSuit needs black_death_v3 (agents die early)


WORKLOADS = {
    "pistonball": Workload("pistonball", "pettingzoo.butterfly.pistonball_v6:parallel_env", 8),
    "kaz": Workload(
        "kaz",
        "pettingzoo.butterfly.knights_archers_zombies_v11:parallel_env",
        8,
        black_death=True,
    ),
}
QUICK = {
    "pistonball": Workload(
        "pistonball",
        "pettingzoo.butterfly.pistonball_v6:parallel_env",
        2,
        {"n_pistons": 4, "max_cycles": 20},
    ),
    "kaz": Workload(
        "kaz",
        "pettingzoo.butterfly.knights_archers_zombies_v11:parallel_env",
        2,
        {"max_cycles": 20},
        black_death=True,
    ),
}


def parallel_env(target: str, **kwargs: Any) -> Any:
    """Build the ParallelEnv named ``module:function`` (a picklable factory with partial)."""
    import importlib

    module, name = target.split(":")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return getattr(importlib.import_module(module), name)(**kwargs)


def factory(workload: Workload) -> Callable[[], Any]:
    return functools.partial(parallel_env, workload.env, **workload.kwargs)


@dataclass
class Stepper:
    """One system, built: ``step(k)`` steps every env with bank entry ``k``."""

    step: Callable[[int], None]
    reset: Callable[[], None]
    close: Callable[[], None]


def action_bank(env: Any, num_envs: int, seed: int) -> np.ndarray:
    """``[BANK, N, A, *shape]`` actions drawn from the agents' (shared) action space."""
    agents = list(env.possible_agents)
    space = env.action_space(agents[0])
    space.seed(seed)
    draws = [[[space.sample() for _ in agents] for _ in range(num_envs)] for _ in range(BANK)]
    return np.asarray(draws, dtype=space.dtype)


def unavailable(system: str) -> str | None:
    """Why ``system`` cannot run here (with the install line), or None."""
    import importlib.util

    if system == "puffer-mp" and importlib.util.find_spec("pufferlib") is None:
        return f"puffer-mp (PufferLib's PettingZoo emulation) is not installed: {PUFFER_INSTALL}"
    if system.startswith("supersuit") and importlib.util.find_spec("supersuit") is None:
        return f"{system} needs SuperSuit: pip install 'envfleet[pettingzoo]'"
    return None


def _ignore(result: Any) -> None:
    """What a step or reset returned, dropped (every system hands back its own arrays)."""


def build(system: str, workload: Workload, bank: np.ndarray, seed: int) -> Stepper:
    n = workload.num_envs
    fn = factory(workload)
    flat = bank.reshape(BANK, -1, *bank.shape[3:])  # [BANK, N * A, *shape]
    if system == "loop":
        envs = [fn() for _ in range(n)]
        agents = list(envs[0].possible_agents)
        dicts = [
            [dict(zip(agents, bank[k, i], strict=True)) for i in range(n)] for k in range(BANK)
        ]

        def step_loop(k: int) -> None:
            for env, acts in zip(envs, dicts[k], strict=True):
                env.step({a: acts[a] for a in env.agents})
                if not env.agents:
                    env.reset()

        def reset_loop() -> None:
            for i, env in enumerate(envs):
                env.reset(seed=seed + i)

        def close_loop() -> None:
            for env in envs:
                env.close()

        return Stepper(step_loop, reset_loop, close_loop)
    if system.startswith("supersuit"):
        import supersuit

        env = fn()
        if workload.black_death:
            env = supersuit.black_death_v3(env)
        cpus = usable_cores() if system == "supersuit-mp" else 0
        venv = supersuit.concat_vec_envs_v1(
            supersuit.pettingzoo_env_to_vec_env_v1(env), n, num_cpus=cpus, base_class="gymnasium"
        )
        return Stepper(
            lambda k: _ignore(venv.step(flat[k])),
            lambda: _ignore(venv.reset(seed=seed)),
            venv.close,
        )
    if system.startswith("envfleet"):
        backend = system.removeprefix("envfleet-")
        fleet = envfleet.make(fn, n, backend=backend)
        return Stepper(
            lambda k: _ignore(fleet.step(bank[k])),
            lambda: _ignore(fleet.reset(seed=seed)),
            fleet.close,
        )
    if system == "puffer-mp":
        import pufferlib.emulation
        import pufferlib.vector

        creator = functools.partial(pufferlib.emulation.PettingZooPufferEnv, env_creator=fn)
        workers = puffer_workers(n)  # as envfleet bench's puffer-mp
        pvenv: Any = pufferlib.vector.make(
            creator,
            num_envs=n,
            num_workers=workers,
            batch_size=n,
            backend=pufferlib.vector.Multiprocessing,
            overwork=True,
        )
        return Stepper(
            lambda k: _ignore(pvenv.step(flat[k])),
            lambda: _ignore(pvenv.reset(seed)),
            pvenv.close,
        )
    raise ValueError(f"unknown system {system!r}")


@dataclass
class Run:
    """One measurement: ``batch_steps`` calls of ``step`` in ``seconds``."""

    workload: str
    system: str
    repeat: int
    num_envs: int
    num_agents: int
    batch_steps: int
    seconds: float
    startup_s: float
    foreign_cores: float | None = None  # other processes' CPU during the window, in cores
    tries: int = 1

    @property
    def env_steps_per_s(self) -> float:
        return self.batch_steps * self.num_envs / self.seconds

    @property
    def agent_steps_per_s(self) -> float:
        return self.env_steps_per_s * self.num_agents


def _busy_cpu_s() -> float | None:
    """CPU seconds the whole machine spent busy since boot, all cores together (psutil; Linux
    counts guest time in user time, so it is left out once)."""
    t = psutil.cpu_times()
    idle = t.idle + sum(getattr(t, f, 0.0) for f in ("iowait", "guest", "guest_nice"))
    return float(sum(t) - idle)


def _own_cpu_s() -> dict[int, float]:
    """CPU seconds of this process and of each live descendant (the systems' workers), by pid.

    Zombies are left out: one reaped during a window would otherwise take its whole CPU time
    out of the window's own share."""
    me = psutil.Process()
    times: dict[int, float] = {}
    for proc in [me, *me.children(recursive=True)]:
        with contextlib.suppress(psutil.Error):
            if proc.status() != psutil.STATUS_ZOMBIE:
                cpu = proc.cpu_times()
                times[proc.pid] = cpu.user + cpu.system
    return times


def _own_cpu_delta(before: dict[int, float], after: dict[int, float]) -> float:
    """CPU seconds this process tree used between two :func:`_own_cpu_s` snapshots (a process
    started in between counts whole)."""
    return sum(cpu - before.get(pid, 0.0) for pid, cpu in after.items())


def wait_for_quiet(max_cores: float, max_wait_s: float) -> None:
    """Wait (at most ``max_wait_s``) until the machine's load is under ``max_cores``."""
    deadline = time.monotonic() + max_wait_s
    while time.monotonic() < deadline:
        b0, t0 = _busy_cpu_s(), time.monotonic()
        time.sleep(0.3)
        b1, t1 = _busy_cpu_s(), time.monotonic()
        if b0 is None or b1 is None or (b1 - b0) / (t1 - t0) <= max_cores:
            return
        time.sleep(0.7)


def measure(
    system: str,
    workload: Workload,
    bank: np.ndarray,
    seconds: float,
    warmup: float,
    repeat: int,
    seed: int = 0,
) -> Run:
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        stepper = build(system, workload, bank, seed)
    try:
        stepper.reset()
        startup = time.perf_counter() - start
        k = 0
        end = time.perf_counter() + warmup
        while k < 2 or time.perf_counter() < end:
            stepper.step(k % BANK)
            k += 1
        busy0, own0 = _busy_cpu_s(), _own_cpu_s()
        steps, start = 0, time.perf_counter()
        while steps < 2 or time.perf_counter() - start < seconds:
            stepper.step(k % BANK)
            k += 1
            steps += 1
        elapsed = time.perf_counter() - start
        busy1, own1 = _busy_cpu_s(), _own_cpu_s()
    finally:
        stepper.close()
    foreign = None
    if busy0 is not None and busy1 is not None:
        foreign = max(0.0, (busy1 - busy0) - _own_cpu_delta(own0, own1)) / elapsed
    return Run(
        workload.name,
        system,
        repeat,
        workload.num_envs,
        bank.shape[2],
        steps,
        elapsed,
        startup,
        foreign,
    )


def measure_quietly(
    system: str,
    workload: Workload,
    bank: np.ndarray,
    args: argparse.Namespace,
    repeat: int,
) -> Run:
    """:func:`measure` after waiting for a quiet machine, measured again (up to
    ``args.retries`` times) while other processes used more than ``args.max_foreign`` cores
    during the window."""
    run = None
    for attempt in range(args.retries + 1):
        wait_for_quiet(args.max_foreign, args.quiet_wait)
        run = measure(system, workload, bank, args.seconds, args.warmup, repeat)
        run.tries = attempt + 1
        if run.foreign_cores is None or run.foreign_cores <= args.max_foreign:
            break
        if attempt == args.retries:
            break
        print(
            f"{workload.name} {system}: other processes used {run.foreign_cores:.2f} cores "
            "meanwhile; measuring again",
            file=sys.stderr,
            flush=True,
        )
    assert run is not None
    return run


def summarise(runs: list[Run], cores: int) -> list[dict[str, Any]]:
    """One row per (workload, system): medians, the ratio to the baseline within each
    repetition (median), and the fraction of the limit (the loop's rate times ``cores``)."""
    rows = []
    for name in dict.fromkeys(r.workload for r in runs):
        mine = [r for r in runs if r.workload == name]
        by = {s: [r for r in mine if r.system == s] for s in dict.fromkeys(r.system for r in mine)}
        base = {r.repeat: r.env_steps_per_s for r in by.get(BASELINE, [])}
        loop = by.get("loop")
        limit = statistics.median(r.env_steps_per_s for r in loop) * cores if loop else None
        for system, sruns in by.items():
            rates = [r.env_steps_per_s for r in sruns]
            ratios = [r.env_steps_per_s / base[r.repeat] for r in sruns if r.repeat in base]
            median = statistics.median(rates)
            rows.append(
                {
                    "workload": name,
                    "system": system,
                    "num_envs": sruns[0].num_envs,
                    "num_agents": sruns[0].num_agents,
                    "env_steps_per_s": median,
                    "agent_steps_per_s": median * sruns[0].num_agents,
                    "runs": rates,
                    "x_baseline": statistics.median(ratios) if ratios else None,
                    "of_limit": median / limit if limit else None,
                    "startup_s": statistics.median(r.startup_s for r in sruns),
                }
            )
    return rows


def table(rows: list[dict[str, Any]], info: dict[str, Any]) -> str:
    lines = [
        f"`{info['command']}` on {info['cores']} cores; medians of {info['repeats']} "
        f"interleaved runs of {info['seconds']:g} s; random actions.",
        "",
        "| workload | system | env steps/s | agent steps/s | x supersuit-mp | of limit |",
        "|---|---|---:|---:|---:|---:|",
    ]

    def num(value: float | None, fmt: str) -> str:
        return "n/a" if value is None else format(value, fmt)

    for row in rows:
        lines.append(
            f"| {row['workload']} x{row['num_envs']} ({row['num_agents']} agents) "
            f"| {row['system']} | {row['env_steps_per_s']:,.1f} | "
            f"{row['agent_steps_per_s']:,.0f} | {num(row['x_baseline'], '.2f')} | "
            f"{num(row['of_limit'], '.0%')} |"
        )
    lines += ["", f"limit: the `loop` row's env steps/s x {info['cores']} cores."]
    return "\n".join(lines)


def _names(text: str, available: list[str] | tuple[str, ...], kind: str) -> list[str]:
    names = [part.strip() for part in text.split(",") if part.strip()]
    for name in names:
        if name not in available:
            raise SystemExit(f"unknown {kind} {name!r}; choose from {', '.join(available)}")
    return names


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--warmup", type=float, default=0.5)
    parser.add_argument("--quick", action="store_true", help="smoke mode: small envs, N=2")
    parser.add_argument("--json", type=Path, help="write every run and the summary here")
    parser.add_argument(
        "--max-foreign",
        type=float,
        default=0.25,
        help="cores other processes may use during a measurement before it is taken again",
    )
    parser.add_argument("--retries", type=int, default=2, help="measurements taken again, at most")
    parser.add_argument(
        "--quiet-wait", type=float, default=20.0, help="seconds to wait for a quiet machine"
    )
    args = parser.parse_args(argv)
    catalogue = QUICK if args.quick else WORKLOADS
    workloads = [catalogue[w] for w in _names(args.workloads, list(catalogue), "workload")]
    systems = _names(args.systems, SYSTEMS, "system")
    if args.quick:
        args.repeats, args.seconds, args.warmup = 1, 0.2, 0.05
        args.retries, args.quiet_wait = 0, 0.0
    if args.repeats < 1 or args.seconds <= 0:
        raise SystemExit("--repeats must be at least 1 and --seconds positive")
    skipped = {s: why for s in systems if (why := unavailable(s)) is not None}
    for why in skipped.values():
        print(f"skipped: {why}", file=sys.stderr)
    systems = [s for s in systems if s not in skipped]
    cores = usable_cores()

    runs: list[Run] = []
    for workload in workloads:
        bank = action_bank(parallel_env(workload.env, **workload.kwargs), workload.num_envs, 0)
        for repeat in range(args.repeats):
            shift = repeat % len(systems)
            for system in systems[shift:] + systems[:shift]:
                run = measure_quietly(system, workload, bank, args, repeat)
                runs.append(run)
                foreign = "?" if run.foreign_cores is None else f"{run.foreign_cores:.2f}"
                print(
                    f"{workload.name:10s} {system:20s} rep {repeat}: "
                    f"{run.env_steps_per_s:10,.1f} env steps/s "
                    f"({run.agent_steps_per_s:,.0f} agent steps/s; other load {foreign} cores)",
                    file=sys.stderr,
                    flush=True,
                )
    import pettingzoo

    versions = {"envfleet": envfleet.__version__, "pettingzoo": pettingzoo.__version__}
    versions["gymnasium"] = gymnasium.__version__
    for name in ("supersuit", "pufferlib"):
        with contextlib.suppress(ImportError, AttributeError):
            versions[name] = __import__(name).__version__
    info = {
        "command": " ".join(["python", "benchmarks/multi_agent.py", *(argv or sys.argv[1:])]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "cores": cores,
        "python": platform.python_version(),
        "versions": versions,
        "repeats": args.repeats,
        "seconds": args.seconds,
        "quick": args.quick,
        "skipped": skipped,
    }
    rows = summarise(runs, cores)
    disturbed = [r for r in runs if (r.foreign_cores or 0.0) > args.max_foreign]
    info["disturbed"] = len(disturbed)
    print(table(rows, info))
    if disturbed:
        print(
            f"\n{len(disturbed)} of {len(runs)} measurements ran beside other load "
            f"(> {args.max_foreign} cores): "
            + ", ".join(f"{r.workload}/{r.system} rep {r.repeat}" for r in disturbed)
        )
    if args.json:
        doc = {"info": info, "rows": rows, "runs": [asdict(r) for r in runs]}
        args.json.write_text(json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
