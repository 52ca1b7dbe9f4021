"""Issue 32 item 4: workers recycled before they leak.

A worker past a limit of ``envfleet.Recycle`` is replaced between episodes, and the new
worker's envs continue the old ones exactly: differential tests against the same run
without recycling on CartPole-v1, LunarLander-v3 and ALE/Pong-v5, bit for bit. A leaking env
(one that keeps more memory each step) is reported by ``envs.stats.memory`` and a warning,
and ``max_rss_mb`` keeps its worker's memory bounded. Real workers, real memory.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import logging
from typing import Any

import numpy as np
import pytest
from gymnasium.vector import AutoresetMode

import envfleet
from envfleet._backends import workers
from envfleet._core.cores import usable_memory
from tests.envs import LeakyEnv


def _run(
    make_env: Any,
    env: Any,
    recycle: Any,
    steps: int,
    actions: Any,
    num_envs: int = 4,
    backend: str = "processes",
    **kwargs: Any,
) -> tuple[list[tuple[np.ndarray, ...]], Any]:
    """Every result of ``steps`` steps after ``reset(seed=3)`` (the observations as digests,
    so that a run of Atari frames holds little memory), and the stats at the end."""
    base = kwargs.pop("supervision", envfleet.Supervision())
    envs = make_env(
        env,
        num_envs,
        backend=backend,
        num_workers=2,
        supervision=dataclasses.replace(base, recycle=recycle),
        **kwargs,
    )
    obs, _ = envs.reset(seed=3)
    rng = np.random.default_rng(0)
    seen = [(_digest(obs),)]
    for _ in range(steps):
        obs, rewards, terminated, truncated, _ = envs.step(actions(rng, num_envs))
        seen.append((_digest(obs), rewards.copy(), terminated.copy(), truncated.copy()))
    stats = envs.stats
    envs.close()
    return seen, stats


def _digest(obs: np.ndarray) -> np.ndarray:
    """The observation rows' bytes hashed (BLAKE2b, 16 bytes a row)."""
    return np.array(
        [
            hashlib.blake2b(np.ascontiguousarray(row).tobytes(), digest_size=16).digest()
            for row in obs
        ]
    )


def _discrete(n: int) -> Any:
    return lambda rng, num_envs: rng.integers(0, n, num_envs)


def _assert_same(plain: list[tuple[np.ndarray, ...]], recycled: list[tuple[np.ndarray, ...]]):
    assert len(plain) == len(recycled)
    for t, (a, b) in enumerate(zip(plain, recycled, strict=True)):
        for x, y in zip(a, b, strict=True):
            assert np.array_equal(x, y), f"step {t} differs"


@pytest.mark.parametrize(
    "env, recycle, steps, actions, kwargs",
    [
        ("CartPole-v1", envfleet.Recycle(max_episodes=10), 1500, _discrete(2), {}),
        (
            "CartPole-v1",
            envfleet.Recycle(max_steps=300),
            1500,
            _discrete(2),
            {"autoreset_mode": AutoresetMode.SAME_STEP},
        ),
        ("LunarLander-v3", envfleet.Recycle(max_episodes=4), 600, _discrete(4), {}),
        pytest.param(
            "ALE/Pong-v5",
            envfleet.Recycle(max_steps=200),
            2400,  # Pong's episodes with random actions last about 900 steps
            _discrete(6),
            {"supervision": envfleet.Supervision(replay_steps=2000)},
            marks=pytest.mark.atari,
        ),
    ],
    ids=["CartPole-episodes", "CartPole-steps-same-step", "LunarLander", "Pong"],
)
def test_a_recycled_run_is_bit_identical_to_a_plain_one(
    make_env: Any, snapshot: Any, env: str, recycle: Any, steps: int, actions: Any, kwargs: Any
) -> None:
    """The same seeds and actions with and without recycling give the same observations,
    rewards and done flags at every step, and the workers were recycled."""
    if env.startswith("ALE/"):
        pytest.importorskip("ale_py")
    plain, _ = _run(make_env, env, None, steps, actions, **kwargs)
    recycled, stats = _run(make_env, env, recycle, steps, actions, **kwargs)
    assert stats.recycled >= 2, stats
    _assert_same(plain, recycled)
    snapshot.assert_nothing_left()  # the old workers, their stack and log files: gone


def test_ray_actors_are_recycled_with_the_run_unchanged(make_env: Any, ray_cluster: Any) -> None:
    """On Ray (actors on the driver's node, whose action logs the driver reads from their
    files): the recycled run equals the plain run on processes, bit for bit."""
    plain, _ = _run(make_env, "CartPole-v1", None, 800, _discrete(2))
    recycle = envfleet.Recycle(max_episodes=30)
    recycled, stats = _run(make_env, "CartPole-v1", recycle, 800, _discrete(2), backend="ray")
    assert stats.recycled >= 2, stats
    _assert_same(plain, recycled)


def test_a_leaking_worker_is_named_and_recycled_under_max_rss(
    make_env: Any, monkeypatch: Any, caplog: Any
) -> None:
    """An env that keeps 256 KiB more each step: its worker's memory growth per 1,000
    episodes shows in ``envs.stats.memory`` with a warning naming its envs; with
    ``max_rss_mb`` the worker is recycled and its memory stays under the limit plus what
    grows between two looks. The workers come from a forkserver: a worker forked from this
    process would start with its heap, whose free pages a leak fills before it grows."""
    monkeypatch.setattr(workers, "RSS_PERIOD_S", 0.02)
    leaky = functools.partial(LeakyEnv, leak_kb=256, episode_steps=5, step_s=0.001)
    with caplog.at_level(logging.WARNING, logger="envfleet"):
        envs = make_env(
            leaky,
            2,
            backend=envfleet.Processes(context="forkserver"),
            num_workers=2,
        )
        envs.reset(seed=0)
        for _ in range(800):
            envs.step(np.zeros(2, np.int64))
        memory = envs.stats.memory
    assert len(memory) == 2 and all(m.episodes >= 100 for m in memory)
    growth = [m.growth_per_1000_episodes for m in memory]
    # 5 steps an episode, 256 KiB a step: about 1.25 GiB per 1,000 episodes.
    assert all(g is not None and g > 500 * 2**20 for g in growth), growth
    warned = [r.getMessage() for r in caplog.records if "grows steadily" in r.getMessage()]
    assert any("sub-environments 0..0" in m for m in warned), warned
    # Where the workers started, before they leaked: the limit is 64 MiB above.
    base = min(m.rss_bytes - m.growth_per_1000_episodes * m.episodes / 1000 for m in memory)
    limit_mb = (base + 64 * 2**20) / 2**20
    recycle = envfleet.Recycle(max_rss_mb=limit_mb)
    envs = make_env(
        leaky,
        2,
        backend=envfleet.Processes(context="forkserver"),
        num_workers=2,
        supervision=envfleet.Supervision(recycle=recycle),
    )
    envs.reset(seed=0)
    peak = 0
    for _ in range(800):
        envs.step(np.zeros(2, np.int64))
        peak = max([peak, *(m.rss_bytes or 0 for m in envs.stats.memory)])
    assert envs.stats.recycled >= 2
    # Between two looks (32 steps, 8 MiB) and the end of an episode the worker grows on.
    assert peak < (limit_mb + 64) * 2**20


def _uneven_episodes(env_index: int) -> LeakyEnv:
    """Env 0's episodes last 80 steps, env 1's 33; every step sleeps 40 ms; no leak."""
    return LeakyEnv(leak_kb=0, episode_steps=(80, 33)[env_index], step_s=0.04)


def test_bringing_a_recycled_workers_envs_up_to_date_is_bounded_by_start_timeout(
    make_env: Any,
) -> None:
    """Both envs in one worker, past ``max_episodes`` at the first look (step 32). The worker
    is replaced at the first look after each env began an episode (step 96), when env 0 is
    15 steps into its episode and env 1 29 into its own: running those 44 steps again (about
    2 s) is part of building the replacement,
    bounded by ``start_timeout``, not by the 1 s ``step_timeout`` of one step (0.08 s
    here), past which the run was lost to a ``StepTimeoutError``."""
    envs = make_env(
        _uneven_episodes,
        2,
        backend="processes",
        num_workers=1,
        supervision=envfleet.Supervision(
            step_timeout=1.0, recycle=envfleet.Recycle(max_episodes=2)
        ),
    )
    envs.reset(seed=0)
    for _ in range(100):
        envs.step(np.zeros(2, np.int64))
    assert envs.stats.recycled == 1 and envs.stats.timeouts == 0


def test_a_recycled_worker_late_bringing_its_envs_up_to_date_is_a_start_timeout(
    make_env: Any, snapshot: Any
) -> None:
    """As above, with the driver's ``start_timeout`` made 1 s once the workers have started
    (the start itself is not what is tested): the replacement's 2 s of catching up run past
    it, and the ``StartTimeoutError`` says so and closes the vector env."""
    envs = make_env(
        _uneven_episodes,
        2,
        backend="processes",
        num_workers=1,
        supervision=envfleet.Supervision(recycle=envfleet.Recycle(max_episodes=2)),
    )
    envs._backend._start_timeout = 1.0
    envs.reset(seed=0)
    with pytest.raises(envfleet.StartTimeoutError) as info:
        for _ in range(100):
            envs.step(np.zeros(2, np.int64))
    assert info.value.env_indices == [0, 1] and info.value.timeout == 1.0
    assert "not brought up to date within 1.0 s (start_timeout)" in str(info.value)
    assert envs.closed and envs.stats.recycled == 0
    snapshot.assert_nothing_left()


@pytest.mark.parametrize(
    "kwargs, fields, match",
    [
        ({"backend": "threads"}, {}, "backend 'processes' or 'ray'"),
        ({"backend": "processes", "batch_size": 2}, {}, "first-ready pool"),
        ({"backend": "processes"}, {"replay_steps": 0}, "replay_steps > 0"),
        ({"backend": envfleet.Processes(driver_envs=1)}, {}, "driver_envs"),
    ],
)
def test_recycle_where_it_cannot_apply_is_a_config_error(
    kwargs: Any, fields: Any, match: str
) -> None:
    recycle = envfleet.Recycle(max_steps=10)
    with pytest.raises(envfleet.ConfigError, match=match):
        envfleet.make(
            "CartPole-v1",
            4,
            supervision=envfleet.Supervision(recycle=recycle, **fields),
            **kwargs,
        )


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({}, "needs a limit"),
        ({"max_steps": 0}, "max_steps must be"),
        ({"max_episodes": 2.5}, "max_episodes must be"),
        ({"max_rss_mb": -1}, "max_rss_mb must be"),
        ({"max_episodes": True}, "max_episodes must be"),
    ],
)
def test_a_bad_recycle_is_a_config_error(kwargs: Any, match: str) -> None:
    with pytest.raises(envfleet.ConfigError, match=match):
        envfleet.Recycle(**kwargs)


def test_a_samplers_worker_inference_refuses_recycle() -> None:
    with pytest.raises(envfleet.ConfigError, match="inference='driver'"):
        envfleet.Sampler(
            "CartPole-v1",
            lambda obs: np.zeros(len(obs), np.int64),
            2,
            inference="worker",
            backend="processes",
            supervision=envfleet.Supervision(recycle=envfleet.Recycle(max_steps=10)),
        )


def test_the_default_recycles_a_worker_past_its_share_of_the_memory(
    make_env: Any, monkeypatch: Any
) -> None:
    """Under make()'s defaults (``recycle="auto"``) a worker past its share of the usable
    memory (0.8 of it over the workers) is replaced between episodes, its envs continuing
    exactly: the leaking run gives what the same run with ``recycle=None`` gives. The machine's
    memory is made small here (``usable_memory``), so that a test-sized leak passes the share."""
    from envfleet._backends import recycle as recycle_module

    monkeypatch.setattr(workers, "RSS_PERIOD_S", 0.02)
    leaky = functools.partial(LeakyEnv, leak_kb=512, episode_steps=5, step_s=0.001)
    probe = make_env(
        leaky,
        2,
        backend=envfleet.Processes(context="forkserver"),
        num_workers=2,
    )
    probe.reset(seed=0)
    probe.step(np.zeros(2, np.int64))
    base = max(m.rss_bytes or 0 for m in probe.stats.memory)
    assert probe._backend._recycler is not None  # the default is on
    probe.close()
    # A share of 48 MiB above where a worker starts: passed within about 96 steps.
    memory = (base + 48 * 2**20) * 2 / recycle_module.MEMORY_SHARE
    monkeypatch.setattr(recycle_module, "usable_memory", lambda: memory)
    zeros = _zeros_actions
    got, stats = _run(
        make_env, leaky, "auto", 600, zeros, 2, backend=envfleet.Processes(context="forkserver")
    )
    want, _ = _run(
        make_env, leaky, None, 600, zeros, 2, backend=envfleet.Processes(context="forkserver")
    )
    assert stats.recycled >= 2
    _assert_same_runs(got, want)


def test_the_default_recycling_is_off_where_it_cannot_apply(make_env: Any) -> None:
    """``recycle="auto"`` recycles nothing in a first-ready pool, with ``replay_steps=0``, with
    the driver's own share, and on serial and threads; ``recycle=None`` turns it off."""
    for options in (
        {"batch_size": 2},
        {"supervision": envfleet.Supervision(replay_steps=0)},
        {
            "supervision": envfleet.Supervision(restart_policy=None),
            "backend": envfleet.Processes(driver_envs=1),
        },
        {"backend": "serial"},
        {"backend": "threads"},
        {"supervision": envfleet.Supervision(recycle=None)},
    ):
        envs = make_env("CartPole-v1", 4, **{"backend": "processes", **options})
        assert envs._backend._recycler is None, options
    envs = make_env("CartPole-v1", 4)
    assert envs._backend._recycler.policy.max_rss_mb == pytest.approx(
        0.8 * usable_memory() / envs.num_workers / 2**20
    )


def _zeros_actions(rng: Any, n: int) -> np.ndarray:
    return np.zeros(n, np.int64)


def _assert_same_runs(got: list[Any], want: list[Any]) -> None:
    assert len(got) == len(want)
    for k, (a, b) in enumerate(zip(got, want, strict=True)):
        for x, y in zip(a, b, strict=True):
            assert np.array_equal(x, y), f"step {k} differs"
