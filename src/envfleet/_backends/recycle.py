"""Workers recycled before they leak: :class:`Recycle`, the policy, and
:class:`Recycler`, which the round driver asks after its step rounds.

A worker past a limit (episodes its envs began, env steps, resident memory) is replaced once
each of its envs has begun a new episode since: the new worker builds its envs from their
factories and brings each to where the old one's was by running its episode from its start
(the action log of :mod:`envfleet._core.action_log`: the ``np_random`` state at its autoreset, or
its seed, and its actions since), so no episode is cut and no step is lost or repeated.
"""

from __future__ import annotations

import logging
import numbers
from dataclasses import dataclass
from typing import Any, Protocol, cast

from envfleet._core.cores import usable_memory
from envfleet._core.errors import ConfigError
from envfleet._core.replay import EnvRecording

logger = logging.getLogger("envfleet")

__all__ = ["CHECK_EVERY", "MEMORY_SHARE", "Recycle", "Recycler", "default_recycle"]

CHECK_EVERY = 32  # step rounds between two looks at the workers' counters
# make()'s default bound: a worker is recycled past this fraction of the usable memory,
# divided among the workers (default_recycle).
MEMORY_SHARE = 0.8


@dataclass(frozen=True)
class Recycle:
    """Replace a worker process before it leaks: ``Supervision(recycle=Recycle(...))``.

    Per worker, as gunicorn's ``max_requests`` and Celery's ``max_tasks_per_child``: a worker
    past any limit is replaced once each of its envs has finished the episode it was in (the
    limits are looked at every 32 steps). The new worker's envs continue the old ones exactly:
    each is rebuilt from its factory and run through its current episode from how it began
    (its ``np_random`` state at its autoreset, or its seed) with its recorded actions, so a
    recycled run is bit-identical to one without recycling for envs whose randomness lives in
    their seed and ``np_random``. Nothing the caller sees changes: no result, no info, no
    truncation.

    Args:
        max_episodes: episodes the worker's envs begin, together.
        max_steps: env steps the worker's envs take, together.
        max_rss_mb: the worker process's resident memory, in MiB (sampled about once a
            second).

    Raises:
        ConfigError: no limit, or a limit that is not a positive number.

    Example::

        bounds = envfleet.Supervision(recycle=envfleet.Recycle(max_rss_mb=2048))
        envs = envfleet.make("LunarLander-v3", 16, supervision=bounds)

    Only ``backend="processes"`` or ``"ray"`` (on every node: each node's envfleet helper
    reads its actors' records and memory), synchronous (no ``batch_size``), with every env in a
    worker (``driver_envs=0``, which it implies) and ``replay_steps > 0`` (the record it
    restores from): threads and serial envs live in the caller's process, which replacing a
    thread does not shrink.
    """

    max_episodes: int | None = None
    max_steps: int | None = None
    max_rss_mb: float | None = None

    def __post_init__(self) -> None:
        limits = {
            "max_episodes": self.max_episodes,
            "max_steps": self.max_steps,
            "max_rss_mb": self.max_rss_mb,
        }
        if all(v is None for v in limits.values()):
            raise ConfigError("Recycle needs a limit: max_episodes, max_steps or max_rss_mb")
        for name, value in limits.items():
            integral = name != "max_rss_mb"
            kind = numbers.Integral if integral else numbers.Real
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, kind) or value <= 0
            ):
                what = "an integer" if integral else "a number of MiB"
                raise ConfigError(f"{name} must be None or {what} > 0, got {value!r}")


class Recycling(Protocol):
    """What the :class:`Recycler` needs of the round driver."""

    ranges: Any

    def counters(self) -> list[tuple[tuple[int, int, Any] | None, int | None]]:
        """Per worker: its action log's counters (group steps, episodes, each env's episode
        start; ``None`` before it opened its log) and its resident memory in bytes
        (``None`` if unknown)."""
        ...

    def memory(self) -> list[int | None] | None:
        """Per worker its resident memory in bytes as last sampled (``None`` if unknown),
        without a look at the logs; ``None`` where only :meth:`counters` tells."""
        ...


@dataclass
class _Life:
    """A worker's counters since it started: its log's group steps and episodes then."""

    steps0: int = 0
    episodes0: int = 0
    drain_from: int | None = None  # the group step at which it passed a limit


class Recycler:
    """Which workers are due to be recycled (:meth:`due`), looked at every
    :data:`CHECK_EVERY` step rounds from their action logs' counters and resident memory
    (the round driver's ``counters``, one look at all of them)."""

    def __init__(self, policy: Recycle, driver: Recycling):
        self.policy = policy
        self.driver = driver
        self.lives = [_Life() for _ in driver.ranges]
        # Step rounds to go before the next look (the plain step counts it down in place,
        # RoundDriver.step_round: no call a round).
        self.countdown = CHECK_EVERY
        self._warned: set[int] = set()

    def due(self) -> list[int]:
        """After a step round: the workers to recycle now (each past a limit, and each of its
        envs in an episode begun since), looked at once every :data:`CHECK_EVERY` rounds."""
        self.countdown -= 1
        if self.countdown > 0:
            return []
        self.countdown = CHECK_EVERY
        if self._memory_only():
            return []
        ready = []
        looks = self.driver.counters()
        for w, life in enumerate(self.lives):
            head, rss = looks[w]
            if head is None:
                continue
            steps, episodes, starts = head
            if steps < life.steps0:  # a new log: the supervisor replaced the worker
                life = self.lives[w] = _Life()
            if life.drain_from is None:
                reason = self._past(w, life, steps, episodes, rss)
                if reason is None:
                    continue
                life.drain_from = steps
                logger.info("worker %d is past %s: recycling it between episodes", w, reason)
            if bool((starts >= life.drain_from).all()) and steps > life.drain_from:
                ready.append(w)
        return ready

    def _memory_only(self) -> bool:
        """Whether a look at the workers' memory alone says none is due: a policy of
        ``max_rss_mb`` only (the default's), no worker draining and every one under the
        limit; then the logs are not read (the default's look costs a list of samples)."""
        policy = self.policy
        if policy.max_episodes is not None or policy.max_steps is not None:
            return False
        if any(life.drain_from is not None for life in self.lives):
            return False
        memory = self.driver.memory()
        limit = cast(float, policy.max_rss_mb) * 2**20
        return memory is not None and all(rss is None or rss < limit for rss in memory)

    def _past(self, w: int, life: _Life, steps: int, episodes: int, rss: int | None) -> str | None:
        policy = self.policy
        start, stop = self.driver.ranges[w]
        if policy.max_steps is not None and (steps - life.steps0) * (stop - start) >= (
            policy.max_steps
        ):
            return f"max_steps={policy.max_steps}"
        if policy.max_episodes is not None and episodes - life.episodes0 >= policy.max_episodes:
            return f"max_episodes={policy.max_episodes}"
        if policy.max_rss_mb is not None and rss is not None and rss >= policy.max_rss_mb * 2**20:
            return f"max_rss_mb={policy.max_rss_mb:g} ({rss / 2**20:.1f} MiB)"
        return None

    def replayable(self, w: int, recordings: list[EnvRecording]) -> bool:
        """Whether each env's episode is whole in the record; warn once when not (its
        episodes are longer than ``replay_steps``: the worker cannot be recycled)."""
        missing = [r for r in recordings if not r.complete]
        if missing and w not in self._warned:
            self._warned.add(w)
            logger.warning(
                "worker %d is past its recycle limit but cannot be recycled: sub-environment "
                "%d %s; raise replay_steps",
                w,
                missing[0].env_index,
                missing[0].why,
            )
        return not missing and bool(recordings)

    def recycled(self, w: int, head: tuple[int, int, Any] | None) -> None:
        """Worker ``w`` was replaced; ``head``: its new log's counters (after the restore)."""
        steps, episodes = (head[0], head[1]) if head is not None else (0, 0)
        self.lives[w] = _Life(steps, episodes)


def default_recycle(num_workers: int) -> Recycle:
    """``make()``'s default recycling (``recycle="auto"``): a worker past its share of the
    memory, :data:`MEMORY_SHARE` of :func:`~envfleet._core.cores.usable_memory` (the
    machine's, or a container's ``memory.max``) divided among ``num_workers``, is replaced
    between episodes.

    Why a share and not a worker's growth: the OOM killer strikes when the whole tree runs out
    of memory, whichever worker grew; a worker under its share leaves room for every other to
    reach theirs, and one past it (a leak) is the first to push the machine to the point where
    the kernel kills a process. An env that needs more than its share on purpose gets its
    worker replaced at most once an episode, never mid-episode; ``recycle=None`` turns it off,
    ``recycle=Recycle(max_rss_mb=...)`` sets the bound.

    Example::

        default_recycle(16).max_rss_mb  # 0.8 of 24 GiB over 16 workers: about 1,228 MiB
    """
    return Recycle(max_rss_mb=MEMORY_SHARE * usable_memory() / max(1, num_workers) / 2**20)
