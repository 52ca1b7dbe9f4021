"""A short chaos soak (benchmarks/chaos.py): envs that raise, segfault and hang, workers
SIGKILLed, recycling and snapshot/resume cycles, all at once, for a few seconds: no step lost
against the fault-free run, every env fault's replay reproduces it, every segfault and hang
has its stack, and nothing is left behind. Fault rates are far above the benchmark's, so that
each kind happens in a short run; no timing is asserted.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

CHAOS_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "chaos.py"


def _load_chaos() -> ModuleType:
    spec = importlib.util.spec_from_file_location("envfleet_chaos", CHAOS_PATH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up; cloudpickle by value
    spec.loader.exec_module(module)
    return module


chaos = _load_chaos()


def test_a_short_chaos_soak_loses_nothing() -> None:
    config = chaos.ChaosConfig(
        minutes=0.2,
        p_raise=1e-4,
        p_segfault=5e-5,
        p_hang=5e-6,
        step_timeout=1.0,
        kill_every=4.0,
        snapshot_every=5.0,
        recycle_episodes=100,
        replays_per_kind=2,
    )
    result = chaos.chaos(config, log=lambda *args: None)
    shown = chaos.table(result, config)
    assert result.steps_lost == 0, shown
    assert {"raise", "segfault", "kill"} <= set(result.injected), shown
    assert result.snapshots >= 2 and result.recycled >= 1, shown
    for kind in ("segfault", "hang"):
        if kind in result.stacks:
            got, of = result.stacks[kind].split(" of ")
            assert got == of, shown
    for kind, text in result.reproduced.items():
        got, of = text.split(" of ")
        assert got == (of if kind != "kill" else "0"), shown  # a SIGKILL is not the env's
    assert not any(result.left.values()), shown
    assert result.ok, shown


def test_a_short_chaos_soak_under_the_defaults_loses_nothing() -> None:
    """``--defaults``: make()'s defaults, no option set (no policy, recycling or timeout
    given): segfaults and SIGKILLs are restarted by the default policy, snapshots resume,
    and no step is lost."""
    config = chaos.ChaosConfig(
        minutes=0.15,
        p_segfault=2e-5,
        kill_every=3.0,
        snapshot_every=4.0,
        replays_per_kind=1,
        defaults=True,
    )
    result = chaos.chaos(config, log=lambda *args: None)
    shown = chaos.table(result, config)
    assert result.steps_lost == 0, shown
    assert "kill" in result.injected and result.snapshots >= 1, shown
    assert set(result.injected) <= {"kill", "segfault"}, shown  # nothing raises or hangs
    assert not any(result.left.values()), shown
    assert result.ok, shown
