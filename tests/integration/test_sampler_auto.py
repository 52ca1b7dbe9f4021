"""``Sampler(inference="auto")``, the default: it calibrates driver and worker inference on its
first steps, keeps the faster, and says why in ``Sampler.report()`` (issue 19).

Differential like the rest of the Sampler's tests: every step, calibration included, equals a
gymnasium SyncVectorEnv run with the same seeds and a deterministic policy. The choice itself
is tested with policies that are much slower on one side (a sleep of tens of milliseconds per
call where the other side takes microseconds), so the faster mode is never in doubt.
"""

from __future__ import annotations

import math
import os
import threading
import time
from typing import Any

import numpy as np
import pytest

from envfleet import EpisodeBatch, Sampler, SamplerReport
from tests.integration.test_sampler import SEED, PolePolicy, assert_matches_model, check_segments

# segment_length 4 with 6 envs: each calibration piece is 24 steps, the six of them 144.
AUTO = dict(num_workers=2, segment_length=4)
CALIBRATION_STEPS = 6 * 6 * 4


class SlowWhere(PolePolicy):
    """PolePolicy that sleeps ``delay_s`` per call in the driver's process (``where="driver"``)
    or in any other process (``where="worker"``)."""

    def __init__(self, where: str, delay_s: float = 0.03):
        super().__init__()
        self.where, self.delay_s, self.driver_pid = where, delay_s, os.getpid()

    def __call__(self, obs: np.ndarray) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        in_driver = os.getpid() == self.driver_pid
        if in_driver == (self.where == "driver"):
            time.sleep(self.delay_s)
        return super().__call__(obs)


def _sample_through_calibration(sampler: Sampler) -> list[EpisodeBatch]:
    """Sample past the calibration, and on until every env has steps (a first-ready pool
    hands back whichever envs are ready first)."""
    batches: list[EpisodeBatch] = []

    def envs_seen() -> int:
        return len(set(np.concatenate([b.env_index for b in batches]).tolist()))

    while sum(b.num_steps for b in batches) < CALIBRATION_STEPS + 60 or envs_seen() < 6:
        assert len(batches) < 200, "an env never came back"
        batches.append(sampler.sample(40))
    return batches


@pytest.mark.parametrize(
    "backend", ["processes", "threads", pytest.param("ray", marks=pytest.mark.ray)]
)
def test_auto_matches_sync_vector_env_through_its_calibration(backend: str) -> None:
    if backend == "ray":
        from tests.conftest import ensure_ray

        ensure_ray()
    with Sampler("CartPole-v1", PolePolicy(), 6, seed=SEED, backend=backend, **AUTO) as sampler:
        batches = _sample_through_calibration(sampler)
        report = sampler.report()
    for batch in batches:
        check_segments(batch)
        assert (batch.policy_version == 0).all()
    assert_matches_model(batches, 6)
    assert set(report.calibration) == {"driver", "worker"}
    faster = max(report.calibration, key=lambda mode: report.calibration[mode])
    if report.calibration["driver"] == report.calibration["worker"]:
        faster = "driver"
    assert report.inference == faster and "calibrated" in report.choice


@pytest.mark.parametrize("slow", ["driver", "worker"])
def test_auto_keeps_the_faster_mode_and_runs_it(slow: str) -> None:
    with Sampler("CartPole-v1", SlowWhere(slow), 6, seed=SEED, **AUTO) as sampler:
        batches = _sample_through_calibration(sampler)
        report = sampler.report()
        before = sampler.timers
        batches.append(sampler.sample(48))
        after = sampler.timers
    assert_matches_model(batches, 6)
    chosen = "worker" if slow == "driver" else "driver"
    assert report.inference == chosen, report
    assert report.calibration[chosen] > 2 * report.calibration[slow]
    # The chosen path really runs: its policy calls grow, the other's do not.
    driver_calls = [t.driver["policy"].count for t in (before, after)]
    worker_calls = [
        sum(w["policy"].count for w in t.workers if "policy" in w) for t in (before, after)
    ]
    if chosen == "worker":
        assert worker_calls[1] > worker_calls[0] and driver_calls[1] == driver_calls[0]
    else:
        assert driver_calls[1] > driver_calls[0]


class _Unpicklable(PolePolicy):
    def __init__(self) -> None:
        super().__init__()
        self.lock = threading.Lock()


@pytest.mark.parametrize(
    "policy, options, why",
    [
        (_Unpicklable(), {"num_workers": 2}, "does not pickle"),
        (PolePolicy(), {"num_workers": 6, "batch_size": 3}, "first-ready pool"),
        (PolePolicy(), {"backend": "serial"}, "one group"),
    ],
    ids=["unpicklable", "pool", "serial"],
)
def test_auto_is_driver_inference_when_workers_cannot_run_the_policy(
    policy: Any, options: dict[str, Any], why: str
) -> None:
    with Sampler("CartPole-v1", policy, 6, seed=SEED, segment_length=4, **options) as sampler:
        batches = _sample_through_calibration(sampler)
        report = sampler.report()
        assert "policy" not in sampler.timers.merged  # no worker ever ran the policy
    assert report.inference == "driver" and why in report.choice and not report.calibration
    assert_matches_model(batches, 6)


def test_a_policy_update_during_the_calibration_tags_and_drops_stale_steps() -> None:
    with Sampler("CartPole-v1", PolePolicy(tag=0), 6, seed=SEED, **AUTO) as sampler:
        seen = []
        for version in range(1, 8):  # updates land in every piece of the calibration
            batch = sampler.sample(20)
            check_segments(batch)
            assert (batch.policy_version == version - 1).all()
            assert (batch.agent_infos["tag"] == version - 1).all()
            seen.append(sampler.report().inference)
            assert sampler.update_policy({"tag": version}) == version
        batch = sampler.sample(30)
        assert (batch.agent_infos["tag"] == 7).all() and (batch.policy_version == 7).all()
        assert {"driver", "worker"} <= set(seen)  # both modes ran, each honoured the updates


def test_the_report_gives_the_bound_and_a_verdict() -> None:
    with Sampler("CartPole-v1", PolePolicy(), 6, seed=SEED, **AUTO) as sampler:
        _sample_through_calibration(sampler)
        report = sampler.report()
    assert isinstance(report, SamplerReport)
    assert report.num_envs == 6 and report.cores >= 1
    assert report.steps_per_s > 0 and report.t_policy_s > 0 and report.t_env_s > 0
    overlapped = (report.t_policy_s + 6 * report.t_env_s) / report.cores
    assert report.bound_steps_per_s == pytest.approx(6 / max(report.t_policy_s, overlapped))
    assert report.of_bound == pytest.approx(report.steps_per_s / report.bound_steps_per_s)
    assert report.verdict == ("policy-bound" if report.t_policy_s >= overlapped else "env-bound")
    text = str(report)
    assert report.inference in text and report.verdict in text and "driver/policy" in text
    # No T_p(n) curve in a Sampler: the schedule bound waits for one (envfleet bench fills it).
    assert report.t_policy_by_n is None and report.schedule_structure is None
    assert math.isnan(report.schedule_bound_steps_per_s) and math.isnan(report.of_schedule_bound)
    assert "schedule bound" not in text


def test_the_report_takes_a_policy_curve_and_its_schedule_bound() -> None:
    report = SamplerReport(
        inference="driver",
        choice="as asked",
        steps_per_s=50_000.0,
        calibration={},
        num_envs=16,
        cores=2,
        t_policy_s=100e-6,
        t_env_s=1e-6,
        bound_steps_per_s=16 / 108e-6,
        of_bound=50_000.0 / (16 / 108e-6),
        verdict="env-bound",
    )
    before = str(report)
    # T_p = 100 us at every size, 2 cores: one call, 100 + 16 * 1 / 2 = 108 us a cycle.
    filled = report.with_schedule_bound({16: 100e-6, 8: 100e-6, 4: 100e-6}, 16 / 108e-6, "one call")
    assert filled.t_policy_by_n == {16: 100e-6, 8: 100e-6, 4: 100e-6}
    assert filled.schedule_bound_steps_per_s == pytest.approx(148_148.148)
    assert filled.schedule_structure == "one call"
    assert filled.of_schedule_bound == pytest.approx(50_000.0 / 148_148.148)
    assert (filled.steps_per_s, filled.of_bound) == (report.steps_per_s, report.of_bound)
    text = str(filled)
    assert text.startswith(before.split("\n")[0])  # the existing lines are kept
    assert "schedule bound: 148,148 steps/s, 0.34 of it (one call; T_p(16) 100 us" in text
    assert report.t_policy_by_n is None  # the original is unchanged (frozen)


def test_explicit_modes_are_kept_and_reported_as_asked() -> None:
    for inference in ("driver", "worker"):
        with Sampler(
            "CartPole-v1", PolePolicy(), 4, inference=inference, num_workers=2, segment_length=4
        ) as sampler:
            sampler.sample(64)
            report = sampler.report()
        assert report.inference == inference and report.choice == "as asked"


class ThreadCountPolicy(PolePolicy):
    """PolePolicy that reports torch's intra-op thread count with each action."""

    def __call__(self, obs: np.ndarray) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        import torch

        actions, _ = super().__call__(obs)
        return actions, {"threads": np.full(len(obs), torch.get_num_threads())}


@pytest.mark.parametrize("backend", ["processes", "threads"])
def test_worker_policies_run_torch_on_one_thread_each(backend: str) -> None:
    torch = pytest.importorskip("torch")
    before = torch.get_num_threads()
    torch.set_num_threads(2)  # the user's setting in the driver: two threads
    try:
        with Sampler(
            "CartPole-v1", ThreadCountPolicy(), 4, inference="worker", backend=backend,
            num_workers=2, segment_length=4,
        ) as sampler:  # fmt: skip
            batch = sampler.sample(64)
            assert torch.get_num_threads() == 2  # restored in the driver's process
        assert (batch.agent_infos["threads"] == 1).all()
    finally:
        torch.set_num_threads(before)


def test_the_calibration_alternates_the_modes_it_times() -> None:
    # Each sample of one piece (24 steps) runs in one mode: warm-ups of driver then worker,
    # then the timed pieces alternate, so that outside load weighs on both modes.
    with Sampler("CartPole-v1", PolePolicy(), 6, seed=SEED, **AUTO) as sampler:
        modes = []
        for _ in range(6):
            assert sampler.report().choice == "calibrating"
            assert sampler.sample(24).num_steps == 24
            modes.append(sampler.report().inference)
        report = sampler.report()
    assert modes[:5] == ["driver", "worker", "driver", "worker", "driver"]
    assert report.choice.startswith("calibrated") and set(report.calibration) == {
        "driver",
        "worker",
    }


class _ProportionalPolicy:
    """A CartPole policy whose time grows with its batch (0.2 ms a row) and whose actions
    are drawn from its own generator."""

    def __init__(self) -> None:
        self.rng = np.random.default_rng(3)

    def seed(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)

    def __call__(self, obs: np.ndarray) -> np.ndarray:
        time.sleep(2e-4 * len(obs))
        return self.rng.integers(0, 2, len(obs))


@pytest.mark.parametrize("inference", ["driver", "worker"])
def test_report_schedule_times_a_copy_and_leaves_the_run_untouched(inference: str) -> None:
    """``report(schedule=True)``: ``T_p(n)`` at the schedule's sizes, from a copy of the
    policy, and the schedule bound from them; the sampler's next batches are those of a
    sampler whose report was never asked for (the policy's and the global generators
    untouched)."""
    from envfleet.bounds import schedule_bound, schedule_sizes

    batches = []
    reports = []
    for ask in (False, True):
        with Sampler(
            "CartPole-v1", _ProportionalPolicy(), 8, inference=inference, seed=2,
            backend="processes", num_workers=2, segment_length=8,
        ) as sampler:  # fmt: skip
            first = sampler.sample(64)
            np.random.seed(5)
            if ask:
                reports.append(sampler.report(schedule=True))
            after = np.random.random()  # the global generator goes on where it was
            batches.append((first, sampler.sample(64), after))
    (a1, a2, a_after), (b1, b2, b_after) = batches
    assert a_after == b_after
    for x, y in ((a1, b1), (a2, b2)):
        assert np.array_equal(x.actions, y.actions) and np.array_equal(
            x.observations, y.observations
        )
    report = reports[0]
    assert report.t_policy_by_n is not None
    assert list(report.t_policy_by_n) == list(schedule_sizes(8, report.cores))
    assert report.t_policy_by_n[8] > report.t_policy_by_n[min(report.t_policy_by_n)]
    best, structure = schedule_bound(8, report.t_policy_by_n, report.t_env_s, report.cores)
    assert (report.schedule_bound_steps_per_s, report.schedule_structure) == (best, structure)
    assert report.of_schedule_bound == pytest.approx(report.steps_per_s / best)
    assert "schedule bound" in str(report)
