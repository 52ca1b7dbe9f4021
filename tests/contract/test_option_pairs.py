"""Every pair of make()'s and the Sampler's options, held to the one table of what goes together
(``envfleet._front.options.RULES``).

Each option below has a value other than its default. For every pair of them (options that set
the same argument, e.g. two backends, are not a pair), the test works out from the table alone
whether the pair is refused, and then calls make() (or the Sampler) for real:

- a refused pair raises :class:`envfleet.ConfigError` with the table's reason, before any worker
  process starts;
- any other pair builds, resets, steps (a pool: ``send``/``recv``; a Sampler: ``sample``) and
  closes.

The table says which rule covers a pair; the test translates the pair into the table's
:class:`~envfleet._front.options.Settings` itself, so a make() that reads an option wrongly, or
a combination the table calls supported that fails, shows here.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import psutil
import pytest
from gymnasium.vector import AutoresetMode

import envfleet
from envfleet._front.options import RULES, Settings, autoreset_mode_of

NUM_ENVS = 4


@dataclass(frozen=True)
class Option:
    """One option set to a value other than its default: ``name`` (the table's word for it),
    ``make`` (make()'s keyword arguments; a ``"supervision"`` or ``"backend"`` entry holds the
    fields of its option object), ``sampler`` (the Sampler's own keyword arguments)."""

    name: str
    make: dict[str, Any] = field(default_factory=dict)
    sampler: dict[str, Any] = field(default_factory=dict)
    needs: str = ""  # a package it needs

    @property
    def id(self) -> str:
        values = {**self.make, **self.sampler}
        text = ",".join(f"{k}={v!r}" for k, v in values.items())
        return re.sub(r"[^A-Za-z0-9_=,.()'-]", "", text)

    def sets(self) -> set[str]:
        """The arguments it sets (two options that set one are not a pair)."""
        keys = set(self.sampler)
        for key, value in self.make.items():
            keys |= {f"{key}.{k}" for k in value} if key == "supervision" else {key}
        return keys


OPTIONS = [
    Option("backend", {"backend": "serial"}),
    Option("backend", {"backend": "threads"}),
    Option("backend", {"backend": "envpool"}, needs="envpool"),
    Option("backend", {"backend": "envpool", "batch_size": 2}, needs="envpool"),
    Option("driver_envs", {"backend": {"driver_envs": 1}}),
    Option("num_workers", {"num_workers": 2}),
    Option("batch_size", {"batch_size": 2}),
    Option("autoreset_mode", {"autoreset_mode": "same_step"}),
    Option("autoreset_mode", {"autoreset_mode": "Disabled"}),
    Option("observation_mode", {"observation_mode": "different"}),
    Option("copy", {"copy": False}),
    Option("output", {"output": "torch"}, needs="torch"),
    Option("step_timeout", {"supervision": {"step_timeout": 30.0}}),
    Option("restart_policy", {"supervision": {"restart_policy": envfleet.RestartPolicy()}}),
    Option("restart_policy", {"supervision": {"restart_policy": None}}),
    Option("recycle", {"supervision": {"recycle": envfleet.Recycle(max_steps=10_000)}}),
    Option("recycle", {"supervision": {"recycle": None}}),
    Option("replay_steps", {"supervision": {"replay_steps": 0}}),
    Option("inference", sampler={"inference": "worker"}),
    Option("inference", sampler={"inference": "driver"}),
    Option("background", sampler={"inference": "worker", "background": True}),
    Option("background", sampler={"background": True}),
    Option("prefetch", sampler={"prefetch": True}),
]

# Every option the table names has an example above (a rule without one would go untried).
NAMED = {name for rule in RULES for name in rule.options}
assert NAMED - {"sampler"} <= {o.name for o in OPTIONS}, NAMED - {o.name for o in OPTIONS}

PAIRS = [
    pytest.param(a, b, id=f"{a.id}+{b.id}")
    for a, b in itertools.combinations(OPTIONS, 2)
    if not a.sets() & b.sets()
]


def _merge(a: Option, b: Option) -> tuple[dict[str, Any], dict[str, Any]]:
    """The pair's make() and Sampler keyword arguments, option objects built."""
    make: dict[str, Any] = {}
    supervision: dict[str, Any] = {}
    processes: dict[str, Any] = {}
    for option in (a, b):
        for key, value in option.make.items():
            if key == "supervision":
                supervision.update(value)
            elif key == "backend" and isinstance(value, dict):
                processes.update(value)
            else:
                make[key] = value
    if supervision:
        make["supervision"] = envfleet.Supervision(**supervision)
    if processes:
        make["backend"] = envfleet.Processes(**processes)
    return make, {**a.sampler, **b.sampler}


def _settings(make: dict[str, Any], sampler: dict[str, Any]) -> Settings:
    """The table's reading of a call, worked out here from the arguments."""
    backend = make.get("backend", "processes")
    batch_size = make.get("batch_size")
    mode = make.get("autoreset_mode")
    return Settings(
        backend=backend if isinstance(backend, str) else backend.name,
        pool=batch_size is not None and batch_size < NUM_ENVS,
        num_workers="num_workers" in make,
        driver_envs=getattr(backend, "driver_envs", 0),
        autoreset_mode=(
            AutoresetMode.SAME_STEP  # the Sampler's own
            if sampler
            else AutoresetMode.NEXT_STEP
            if mode is None
            else autoreset_mode_of(mode)
        ),
        autoreset_mode_given=mode is not None,
        observation_mode_given="observation_mode" in make,
        output=make.get("output", "numpy"),
        supervision=make.get("supervision", envfleet.Supervision()),
        sampler=bool(sampler),
        inference=sampler.get("inference", "auto"),
        prefetch=sampler.get("prefetch", False),
        background=sampler.get("background", False),
    )


def _refusal(settings: Settings) -> str | None:
    for rule in RULES:
        if rule.refused(settings):
            return rule.reason
    return None


def _policy(observations: Any) -> np.ndarray:
    return np.zeros(len(observations), dtype=np.int64)


def _exercise(make: dict[str, Any], sampler: dict[str, Any]) -> None:
    """Build, step and close the call the pair makes."""
    if sampler:
        s = envfleet.Sampler("CartPole-v1", _policy, NUM_ENVS, seed=0, **sampler, **make)
        try:
            batch = s.sample(2 * NUM_ENVS * 64)
            assert len(batch.rewards) >= 2 * NUM_ENVS * 64
        finally:
            s.close()
        return
    envs = envfleet.make("CartPole-v1", NUM_ENVS, **make)
    try:
        actions = np.zeros(NUM_ENVS, dtype=np.int64)
        if make.get("batch_size") not in (None, NUM_ENVS):
            envs.async_reset()
            for _ in range(3):
                obs, reward, terminated, truncated, info = envs.recv()
                assert len(info["env_id"]) == envs.batch_size
                envs.send(actions[: envs.batch_size], info["env_id"])
        else:
            envs.reset(seed=0)
            for _ in range(3):
                obs, reward, terminated, truncated, info = envs.step(actions)
                assert len(obs) == NUM_ENVS
    finally:
        envs.close()


@pytest.mark.parametrize(("a", "b"), PAIRS)
def test_every_pair_of_options_is_what_the_table_says(a: Option, b: Option) -> None:
    for option in (a, b):
        if option.needs:
            pytest.importorskip(option.needs)
    make, sampler = _merge(a, b)
    reason = _refusal(_settings(make, sampler))
    if reason is None:
        _exercise(make, sampler)
        return
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with pytest.raises(envfleet.ConfigError, match=re.escape(reason)):
        _exercise(make, sampler)
    started = {p.pid for p in psutil.Process().children(recursive=True)} - before
    assert not started, f"a refused pair started processes {started}"


def test_the_table_refuses_something_of_every_rule() -> None:
    """Each rule of the table is met by at least one pair above (none is dead)."""
    met = set()
    for param in PAIRS:
        a, b = param.values
        reason = _refusal(_settings(*_merge(a, b)))
        met.add(reason)
    assert {rule.reason for rule in RULES} <= met, {r.reason for r in RULES} - met
