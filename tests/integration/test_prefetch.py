"""Issue 33 item 4: collection during the update (``Sampler(..., prefetch=True)``).

Once ``sample`` returns, the sampler collects the next batch in a thread with a copy of the
policy, while the learner updates; each step keeps the version that chose it. Tests: the
steps collected ahead carry the version (and the agent infos) of the policy that chose them;
collection runs during the update (the policy is called off the main thread before the next
``sample``); the transitions equal those of a sampler without prefetch; a snapshot keeps the
batch collected ahead; what it cannot do is a ``ConfigError``.
"""

from __future__ import annotations

import pickle
import threading
from typing import Any

import numpy as np
import pytest

import envfleet
from envfleet import Sampler


class VersionedPolicy:
    """A CartPole policy that pushes the way the pole leans (but for a fifth of its pushes,
    drawn from its own generator) and reports, per row, the
    version the learner gave it (``agent_infos["version"]``), and the threads it ran on
    (a class attribute: ``copy.deepcopy`` keeps it shared)."""

    threads: list[str] = []  # noqa: RUF012  (shared by every copy, on purpose)
    called_ahead = threading.Event()

    def __init__(self, flips: float = 0.2) -> None:
        self.version = 0
        self.flips = flips
        self.rng = np.random.default_rng(7)  # its own generator: flips some of the pushes

    def seed(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)

    def __call__(self, obs: np.ndarray) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        name = threading.current_thread().name
        VersionedPolicy.threads.append(name)
        if name.startswith("envfleet-prefetch"):
            VersionedPolicy.called_ahead.set()
        lean = (obs[:, 2] + 0.1 * obs[:, 3] > 0).astype(np.int64)
        actions = np.where(self.rng.random(len(obs)) < self.flips, 1 - lean, lean)
        return actions, {"version": np.full(len(obs), self.version, dtype=np.int64)}


KWARGS: dict[str, Any] = {"backend": "processes", "num_workers": 2, "seed": 4}


def _learn(sampler: Sampler, policy: VersionedPolicy, updates: int) -> list[Any]:
    """``updates`` rounds of a learner: sample 200 steps, update the policy."""
    batches = []
    for _ in range(updates):
        batches.append(sampler.sample(200))
        policy.version += 1
        sampler.update_policy()
    return batches


@pytest.mark.parametrize("inference", ["driver", "worker"])
def test_steps_collected_ahead_carry_the_version_that_chose_them(inference: str) -> None:
    policy = VersionedPolicy()
    with Sampler(
        "CartPole-v1", policy, 4, inference=inference, prefetch=True, segment_length=10, **KWARGS
    ) as sampler:
        batches = _learn(sampler, policy, 4)
        stats = sampler.stats
    for k, batch in enumerate(batches):
        # Each step's tag is the version of the copy that chose it.
        rows = np.repeat(batch.policy_version, batch.lengths)
        assert np.array_equal(rows, batch.agent_infos["version"])
        if k:  # collected during the update before: one version behind
            assert (batch.policy_version == k - 1).all(), k
    assert stats.stale_steps_kept == sum(b.num_steps for b in batches[1:])
    assert stats.stale_steps_dropped == 0


def test_collection_runs_during_the_update() -> None:
    """After ``sample`` returns, the policy is called on the prefetch thread before the
    learner asks again: the envs step while the learner updates."""
    policy = VersionedPolicy()
    VersionedPolicy.called_ahead.clear()
    with Sampler("CartPole-v1", policy, 4, inference="driver", prefetch=True, **KWARGS) as sampler:
        sampler.sample(100)
        # The learner's update: no sampler call until the next batch is being collected.
        assert VersionedPolicy.called_ahead.wait(timeout=30)
        policy.version += 1
        sampler.update_policy()
        batch = sampler.sample(100)
    assert (batch.policy_version == 0).all()


@pytest.mark.parametrize("inference", ["driver", "worker"])
def test_prefetch_changes_no_transition(inference: str) -> None:
    """The same seeds and a policy that does not depend on its version: with and without
    prefetch the learner gets the same transitions, batch for batch (only the tags differ);
    the copy that collects ahead draws from the policy's own generator, whose stream goes on
    from batch to batch. (Worker inference's copies of a new policy object are seeded per
    version, so that its runs differ once collection lags a version: a policy without
    randomness there.)"""
    runs = []
    for prefetch in (False, True):
        policy = VersionedPolicy(flips=0.2 if inference == "driver" else 0.0)
        with Sampler(
            "CartPole-v1", policy, 4, inference=inference, prefetch=prefetch, segment_length=10,
            **KWARGS,
        ) as sampler:  # fmt: skip
            runs.append(_learn(sampler, policy, 4))
    fields = ["observations", "actions", "rewards", "terminated", "truncated"]
    fields += ["last_observations", "env_index", "lengths", "complete"]
    for plain, ahead in zip(*runs, strict=True):
        for name in fields:
            assert np.array_equal(getattr(plain, name), getattr(ahead, name)), name


def test_a_snapshot_keeps_the_batch_collected_ahead() -> None:
    policy = VersionedPolicy()
    first = Sampler("CartPole-v1", policy, 4, inference="driver", prefetch=True, **KWARGS)
    try:
        first.sample(200)
        state = pickle.loads(pickle.dumps(first.snapshot()))
        assert state.ahead is not None and state.ahead.num_steps >= 200
        expected = first.sample(200)
    finally:
        first.close()
    with Sampler(
        "CartPole-v1", VersionedPolicy(), 4, inference="driver", prefetch=True,
        backend="serial", resume=state,
    ) as again:  # fmt: skip
        got = again.sample(200)
    for name in ["observations", "actions", "rewards", "env_index", "policy_version", "lengths"]:
        assert np.array_equal(getattr(got, name), getattr(expected, name)), name


class _Locked:
    def __init__(self) -> None:
        self.lock = threading.Lock()

    def __call__(self, obs: np.ndarray) -> np.ndarray:
        return np.zeros(len(obs), dtype=np.int64)


@pytest.mark.parametrize(
    "policy, kwargs, match",
    [
        (VersionedPolicy(), {"inference": "worker", "background": True}, "background"),
        (VersionedPolicy(), {"inference": "driver", "batch_size": 2}, "first-ready pool"),
        (_Locked(), {"inference": "driver"}, "copy.deepcopy"),
    ],
    ids=["background", "pool", "no-deepcopy"],
)
def test_what_prefetch_cannot_do_is_a_config_error(policy: Any, kwargs: Any, match: str) -> None:
    with pytest.raises(envfleet.ConfigError, match=match):
        Sampler("CartPole-v1", policy, 4, backend="serial", prefetch=True, **kwargs)
