"""What a thread per env that waits costs here: the floor under envfleet's concurrent stepping.

A worker whose envs wait steps each on a thread of its crew (``envfleet._core.stepping.Crew``);
every env step then costs the process at least a thread's wake-up and its turns on the GIL,
whatever envfleet does around it. This measures those costs on this machine, in one process,
without envfleet's round around them:

- ``free``: ``n`` threads that each sleep ``wait`` in a loop, never waiting for one another:
  CPU per wake-up (the sleep's own system call and the GIL taken back after it);
- ``crew``: the crew of ``n`` members, each member sleeping ``wait`` once per round (the
  round envfleet's worker runs): the round's wall time over ``wait``, CPU per member;
- ``crew+numpy``: the same with one small ``numpy.random.Generator.uniform`` call after the
  sleep, as ``benchmarks/waiting.py``'s env makes (numpy's generators release the GIL in the
  call, one more hand-off of the GIL among the ``n`` threads).

Run: ``python benchmarks/thread_floor.py`` (about 20 s); ``--threads 64 512`` to choose sizes,
``--quick`` for a look.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from typing import Any

import numpy as np

from envfleet._core.stepping import Crew


def free_running(n: int, wait: float, seconds: float) -> dict[str, float]:
    """``n`` threads each sleeping ``wait`` in a loop: CPU µs per wake-up."""
    counts = [0] * n
    stop = threading.Event()

    def run(t: int) -> None:
        while not stop.is_set():
            time.sleep(wait)
            counts[t] += 1

    threads = [threading.Thread(target=run, args=(t,), daemon=True) for t in range(n)]
    for thread in threads:
        thread.start()
    time.sleep(min(0.5, seconds))
    c0, p0 = sum(counts), time.process_time()
    time.sleep(seconds)
    wakes, cpu = sum(counts) - c0, time.process_time() - p0
    stop.set()
    for thread in threads:
        thread.join()
    return {"round_ms": float("nan"), "x_wait": float("nan"), "cpu_us": cpu / wakes * 1e6}


def crew_rounds(n: int, wait: float, rounds: int, numpy_call: bool) -> dict[str, float]:
    """The crew of ``n`` members, one sleep of ``wait`` each a round (and a numpy call)."""
    crew = Crew(n)
    rngs = [np.random.default_rng(t) for t in range(n)]

    def task(t: int) -> None:
        time.sleep(wait)
        if numpy_call:
            rngs[t].uniform(-1.0, 1.0, 4).astype(np.float32)

    try:
        for _ in range(3):
            crew.run(task)
        t0, p0 = time.perf_counter(), time.process_time()
        for _ in range(rounds):
            crew.run(task)
        elapsed, cpu = time.perf_counter() - t0, time.process_time() - p0
    finally:
        crew.close()
    return {
        "round_ms": elapsed / rounds * 1e3,
        "x_wait": elapsed / rounds / wait,
        "cpu_us": cpu / rounds / n * 1e6,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--threads", nargs="+", type=int, default=[64, 256, 512])
    parser.add_argument("--wait-ms", type=float, default=20.0)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--quick", action="store_true", help="a few rounds, 0.5 s each")
    args = parser.parse_args(argv)
    wait = args.wait_ms / 1e3
    rounds, seconds = (3, 0.3) if args.quick else (args.rounds, 2.0)
    given = argv if argv is not None else sys.argv[1:]
    lines = [
        " ".join(["`python benchmarks/thread_floor.py", *given]) + "`",
        f"on {os.cpu_count()} cores; wait {args.wait_ms:g} ms.",
        "",
        "| threads | what | round ms | round / wait | CPU µs per env step |",
        "|---:|---|---:|---:|---:|",
    ]
    for n in args.threads:
        found: dict[str, Any] = {
            "free": free_running(n, wait, seconds),
            "crew": crew_rounds(n, wait, rounds, False),
            "crew+numpy": crew_rounds(n, wait, rounds, True),
        }
        for what, row in found.items():
            lines.append(
                f"| {n} | {what} | {row['round_ms']:.1f} | {row['x_wait']:.2f} "
                f"| {row['cpu_us']:.1f} |".replace("| nan ", "| - ")
            )
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
