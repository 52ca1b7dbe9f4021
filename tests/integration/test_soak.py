"""A small soak (benchmarks/soak.py): repeated make/close and a run of steps leak nothing.

Open fds, /dev/shm entries, zombies, driver threads and worker processes must be flat after
the warm-up. RSS is not asserted (too noisy for a run this short), nor is any timing.
"""

from __future__ import annotations

import importlib.util
import multiprocessing
import sys
from pathlib import Path
from types import ModuleType

import pytest

SOAK_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "soak.py"
CHECKED = ("fds", "shm", "children", "zombies", "threads")


def _load_soak() -> ModuleType:
    spec = importlib.util.spec_from_file_location("envfleet_soak", SOAK_PATH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


soak = _load_soak()


@pytest.mark.parametrize(
    "context",
    [
        None,
        pytest.param(
            "forkserver",
            marks=pytest.mark.skipif(
                "forkserver" not in multiprocessing.get_all_start_methods(),
                reason="no forkserver start method here",
            ),
        ),
    ],
)
@pytest.mark.slow
def test_soak_is_flat(context: str | None) -> None:
    config = soak.SoakConfig(
        env_id="CartPole-v1",
        num_envs=2,
        context=context,
        cycles=30,
        cycle_steps=5,
        sample_every=1,
        steps=20_000,
    )
    result = soak.soak(config)

    cycles = [s for s in result.samples if s.phase == "cycles"]
    steps = [s for s in result.samples if s.phase == "steps"]
    assert [s.count for s in cycles] == list(range(31))
    assert steps[-1].count == 20_000
    assert result.num_workers["steps"] >= 1
    rows = {(row["metric"], row["phase"]): row for row in result.summary}
    assert set(rows) == {(m.key, p) for m in soak.METRICS for p in soak.PHASES}
    assert rows["children", "steps"]["expected"] == result.num_workers["steps"]
    assert rows["children", "cycles"]["expected"] == 0
    bad = {
        key: (row["first"], row["last"], row["max"], row["verdict"])
        for key, row in rows.items()
        if key[0] in CHECKED and not row["flat"]
    }
    assert not bad, f"not flat: {bad}"


@pytest.mark.parametrize("backend", ["processes", "threads"])
def test_every_thread_envfleet_starts_is_named_so(backend: str) -> None:
    """The soak counts the driver's threads by their ``envfleet-`` name: a thread envfleet
    started under another name would leak unseen. A vector env with hang reports on (the
    reporter thread) starts, steps and closes; every thread that appeared is envfleet's."""
    import threading

    import numpy as np

    import envfleet

    before = set(threading.enumerate())
    envs = envfleet.make(
        "CartPole-v1",
        2,
        backend=backend,
        supervision=envfleet.Supervision(hang_report_delay=30.0),
    )
    try:
        envs.reset(seed=0)
        envs.step(np.zeros(2, dtype=np.int64))
        started = [t.name for t in threading.enumerate() if t not in before]
    finally:
        envs.close()
    assert started, "no thread started: the check saw nothing"
    assert all(name.startswith("envfleet-") for name in started), started


def test_judge_rules() -> None:
    def samples(key: str, values: list[float]) -> list[object]:
        base = dict.fromkeys(
            ("fds", "driver_rss_mib", "threads", "shm", "children", "worker_rss_mib"), 0
        )
        out = []
        for i, value in enumerate(values):
            fields = {**base, "helpers": 0, "zombies": 0, key: value}
            out.append(soak.Sample(phase="cycles", count=i, elapsed_s=float(i), **fields))
        return out

    by_key = {m.key: m for m in soak.METRICS}
    # The warm-up (first 10%) may differ; after it, exact metrics must not move.
    assert soak.judge(by_key["fds"], samples("fds", [5] + [9] * 9 + [9]))["flat"]
    grew = soak.judge(by_key["fds"], samples("fds", [9] * 10 + [10]))
    assert not grew["flat"] and grew["verdict"] == "NOT flat (+1)"
    # RSS: max(5 MiB, 5%) of growth allowed.
    rss = by_key["driver_rss_mib"]
    assert soak.judge(rss, samples("driver_rss_mib", [100.0] * 10 + [104.9]))["flat"]
    assert not soak.judge(rss, samples("driver_rss_mib", [100.0] * 10 + [105.1]))["flat"]
    assert soak.judge(rss, samples("driver_rss_mib", [200.0] * 10 + [209.9]))["flat"]
    # Children: every sample after the warm-up equals the expected count.
    kids = by_key["children"]
    assert soak.judge(kids, samples("children", [1] + [0] * 10), expected=0)["flat"]
    assert not soak.judge(kids, samples("children", [0] * 5 + [1] + [0] * 5), expected=0)["flat"]
