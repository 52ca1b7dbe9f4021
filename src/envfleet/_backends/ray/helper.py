"""The per-node helper of ``backend="ray"``: what a node can still read of its dead or hung
env actors, handed to the driver through Ray.

An env actor (:class:`envfleet._backends.ray.actor.EnvfleetWorker`) writes its stacks
(``faulthandler``, at a hang when asked and at a fatal signal) and its action log (the replay
ring, the recycler's counters) into nameless files of its node. Something on that node must
hold them open, or they vanish with the actor: :class:`NodeHelper`, one small actor per node
that holds env actors of a vector env, placed there with Ray's node affinity and asking for no
CPU. The driver starts a node's helper when the first of its env actors is placed there
(:meth:`RayTransport.lay_out <envfleet._backends.ray.backend.RayTransport.lay_out>`), hands it
each env actor's process id and descriptors (:meth:`NodeHelper.adopt`: it opens them through
``/proc/PID/fd``, Linux), and asks it, through Ray, for what it reads: the stacks of hung
actors (:meth:`NodeHelper.stacks`, a signal each), what a dead one's faulthandler wrote and
its memory when last seen (:meth:`NodeHelper.report`), an action log (:meth:`NodeHelper.log`),
the recycler's counters (:meth:`NodeHelper.counters`) and the memory figures of
``envs.stats.memory`` (:meth:`NodeHelper.memory`, from a :class:`MemoryWatch` sampling its
actors' resident memory once a second). So the driver never opens a file or a ``/proc`` entry
of an actor: every node is like its own.

A helper lives and dies with its env actors: each actor watches its helper's process and
dies with it (:func:`envfleet._backends.workers.die_with`), which the driver reports as the
death of those actors (``EnvCrashedError`` with Ray's reason) and, under a restart policy,
replaces with a new helper; the driver kills a helper once no env actor of its node is left,
and every helper at ``close()``. A helper is an actor of the driver, so it also dies with it.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import psutil
import ray

from envfleet._backends.workers import (
    MemoryWatch,
    ask_stacks,
    fatal_stacks,
    read_bytes,
    read_text,
)
from envfleet._core.action_log import ActionLog, read_head

__all__ = ["GONE", "Adopted", "NodeHelper", "NodeHelpers", "RemoteHelper", "cause", "reason"]


@dataclass
class Adopted:
    """An env actor a helper watches: its process, the helper's descriptors of its stack
    file and its action log (``None`` where ``/proc`` did not open them) and its env count."""

    pid: int
    stacks: int | None
    log: int | None
    size: int


class NodeHelper:
    """The envfleet helper of one node (see the module): reads its env actors' files and
    memory for the driver.

    Args:
        ranges: ``[start, stop)`` of envs per worker of the vector env (worker indices are
            the driver's; the leak warning names a worker's envs).

    Every method answers at once but :meth:`stacks` (up to ``wait_s`` seconds).
    """

    def __init__(self, ranges: Sequence[tuple[int, int]]):
        self._ranges = list(ranges)
        self._adopted: dict[int, Adopted] = {}
        self._memory = MemoryWatch(self._episodes, self._ranges)

    def adopt(self, w: int, pid: int, stacks_fd: int, log_fd: int) -> int:
        """Watch worker ``w``'s env actor, process ``pid`` of this node: open its stack file
        and its action log through ``/proc/PID/fd`` (descriptors ``stacks_fd``, ``log_fd``
        in that process) and sample its memory. Returns this helper's process id (the actor
        dies with it). Where ``/proc`` does not open them (not Linux), the actor is watched
        for its memory only."""
        self.drop([w])
        start, stop = self._ranges[w]
        adopted = Adopted(pid, None, None, stop - start)
        with contextlib.suppress(OSError):
            adopted.stacks = os.open(f"/proc/{pid}/fd/{stacks_fd}", os.O_RDWR)
            adopted.log = os.open(f"/proc/{pid}/fd/{log_fd}", os.O_RDONLY)
        self._adopted[w] = adopted
        self._memory.watch(w, pid)
        self._memory.start()
        return os.getpid()

    def drop(self, workers: Sequence[int]) -> None:
        """Forget ``workers`` (replaced, or closed): close their files."""
        for w in workers:
            adopted = self._adopted.pop(w, None)
            self._memory.forget(w)
            if adopted is None:
                continue
            for fd in (adopted.stacks, adopted.log):
                if fd is not None:
                    os.close(fd)

    def stacks(self, workers: Sequence[int], wait_s: float) -> dict[int, str]:
        """Each live actor of ``workers``'s stacks, asked for now by a signal that its
        faulthandler answers in its file (:func:`~envfleet._backends.workers.ask_stacks`):
        worker -> text, for those that wrote within ``wait_s`` seconds."""
        targets: dict[int, tuple[int, int]] = {}
        for w in workers:
            adopted = self._adopted.get(w)
            if adopted is not None and adopted.stacks is not None:
                targets[w] = (adopted.pid, adopted.stacks)
        return ask_stacks(targets, lambda w: psutil.pid_exists(targets[w][0]), wait_s)

    def report(self, w: int) -> tuple[str, tuple[int, float] | None]:
        """What worker ``w``'s actor, found dead, left: what its faulthandler wrote (``""``
        for a death that leaves none: SIGKILL, ``os._exit``) and its resident memory when
        last seen, ``(bytes, seconds before now)`` (``None`` before the first sample)."""
        adopted = self._adopted.get(w)
        stacks = fatal_stacks(read_text(adopted.stacks)) if adopted is not None else ""
        seen = self._memory.last(w)
        ago = None if seen is None else (seen[0], max(0.0, time.monotonic() - seen[1]))
        return stacks, ago

    def log(self, w: int) -> bytes:
        """All of worker ``w``'s action log (``b""`` when there is none): its envs' episodes
        so far, readable after the actor died or while it hangs."""
        adopted = self._adopted.get(w)
        return read_bytes(adopted.log if adopted is not None else None)

    def counters(self, workers: Sequence[int]) -> dict[int, tuple[bytes, int | None]]:
        """Per worker of ``workers``: its action log's head (the bytes
        :func:`envfleet._core.action_log.read_head` reads: group steps, episodes, each env's
        episode start) and its actor's resident memory now in bytes (``None``: gone)."""
        found = {}
        for w in workers:
            adopted = self._adopted.get(w)
            if adopted is None:
                continue
            head = read_bytes(adopted.log, ActionLog.head_nbytes(adopted.size))
            rss: int | None = None
            with contextlib.suppress(psutil.Error):
                rss = int(psutil.Process(adopted.pid).memory_info().rss) or None
            found[w] = (head, rss)
        return found

    def memory(self, workers: Sequence[int]) -> dict[int, tuple[int | None, int, float | None]]:
        """Per worker of ``workers``: its actor's resident memory last sampled (bytes), the
        episodes its envs began then, and its growth in bytes per 1,000 episodes (``None``
        until known): ``envs.stats.memory``."""
        found = {}
        for w in workers:
            seen = self._memory.last(w)
            found[w] = (
                None if seen is None else seen[0],
                self._memory.episodes(w),
                self._memory.growth(w),
            )
        return found

    def close(self) -> None:
        """Stop sampling and close every file (the driver kills the helper next)."""
        self._memory.stop()
        self.drop(list(self._adopted))

    def _episodes(self, w: int) -> int | None:
        """The episodes worker ``w``'s envs began, from its log's head (the memory watch's
        count)."""
        adopted = self._adopted.get(w)
        if adopted is None or adopted.log is None:
            return None
        head = read_head(read_bytes(adopted.log, ActionLog.head_nbytes(adopted.size)), adopted.size)
        return None if head is None else head[1]


RemoteHelper: Any = ray.remote(NodeHelper)


# -- the driver's side ------------------------------------------------------------------------

HELPER_START_S = 60.0  # seconds a new helper gets to start (a hang guard: no CPU is asked)
HELPER_CALL_S = 10.0  # seconds the driver waits for a helper's answer (a hang guard)
GONE = "its node's envfleet helper is gone"  # how an error names a lost helper


@dataclass
class _Node:
    """A node's helper, as the driver holds it: the actor, its process id (once it has
    answered) and the workers whose actors it watches."""

    handle: Any
    pid: int | None = None
    workers: set[int] = field(default_factory=set)


class NodeHelpers:
    """The driver's side of the helpers: one :class:`NodeHelper` per node that holds env
    actors of one transport, started on that node (Ray's ``NodeAffinitySchedulingStrategy``,
    ``soft=False``; no CPU; the actors' ``runtime_env``), and every question to them.

    Args:
        ranges: ``[start, stop)`` of envs per worker.
        actor_options: the env actors' Ray options (a helper takes their ``runtime_env``, so
            that it imports envfleet as they do).

    Every call is bounded: a helper that does not answer within :data:`HELPER_CALL_S`
    seconds (or is dead) is taken as having nothing to say, never waited for.
    """

    def __init__(self, ranges: Sequence[tuple[int, int]], actor_options: Mapping[str, Any]):
        self._ranges = list(ranges)
        self._options: dict[str, Any] = {"num_cpus": 0, "max_restarts": 0}
        if actor_options.get("runtime_env") is not None:
            self._options["runtime_env"] = actor_options["runtime_env"]
        self._nodes: dict[str, _Node] = {}
        self._home: dict[int, str] = {}  # worker -> the node of its actor
        # worker -> why its actor has no helper (it could not start); its actor was killed.
        self.lost: dict[int, str] = {}

    @property
    def nodes(self) -> dict[str, Any]:
        """Node id -> its helper's actor handle."""
        return {node: held.handle for node, held in self._nodes.items()}

    @property
    def pids(self) -> dict[str, int | None]:
        """Node id -> its helper's process id (``None`` until it has answered)."""
        return {node: held.pid for node, held in self._nodes.items()}

    def prestart(self) -> None:
        """Start the helper of the driver's node now, while the env actors start: actors
        land there on one machine, where the helper would otherwise start after them. Stopped
        at the first :meth:`adopt` when none did."""
        with contextlib.suppress(Exception):  # Ray Client: no node of its own here
            node = ray.get_runtime_context().get_node_id()
            if node and node not in self._nodes:
                self._nodes[node] = _Node(self._start(node))

    def adopt(self, actors: Mapping[int, Any]) -> dict[int, int]:
        """Hand each of ``actors`` (worker -> its env actor, started) to the helper of its
        node, starting one where there is none (or where the one there died), and stop the
        helpers left with no actor. Returns worker -> its helper's process id, for each actor
        adopted. An actor that does not say where it is (it died: the wait on it says so) is
        left out; one whose node's helper cannot start is killed, with the reason in
        :attr:`lost` (its death is then reported with it)."""
        for w in actors:
            self.forget(w)
        places = _answers({w: actor.place.remote() for w, actor in actors.items()}, HELPER_CALL_S)
        pids: dict[int, int] = {}
        waiting = {w: place for w, place in places.items() if not isinstance(place, str)}
        fresh: set[str] = set()
        for _ in range(2):  # a helper found dead is replaced once
            asks = {}
            for w, (node, pid, stacks_fd, log_fd) in waiting.items():
                if node not in self._nodes:
                    self._nodes[node] = _Node(self._start(node))
                    fresh.add(node)
                asks[w] = self._nodes[node].handle.adopt.remote(w, pid, stacks_fd, log_fd)
            answers = _answers(asks, HELPER_START_S)
            retry = {}
            for w, answer in answers.items():
                node = waiting[w][0]
                if not isinstance(answer, str):
                    pids[w] = answer
                    self._home[w] = node
                    self._nodes[node].pid = answer
                    self._nodes[node].workers.add(w)
                    continue
                held = self._nodes.pop(node, None)
                if held is not None:
                    _kill(held.handle)
                if node in fresh:  # a new helper that could not start
                    self.lost[w] = f"the envfleet helper of its node could not start ({answer})"
                    _kill(actors[w])
                else:
                    retry[w] = waiting[w]
            waiting = retry
            if not waiting:
                break
        for node in [n for n, held in self._nodes.items() if not held.workers]:
            _kill(self._nodes.pop(node).handle)
        return pids

    def forget(self, w: int) -> None:
        """Worker ``w``'s actor is being replaced or closed: its helper drops its files."""
        self.lost.pop(w, None)
        node = self._home.pop(w, None)
        held = self._nodes.get(node) if node is not None else None
        if held is not None:
            held.workers.discard(w)
            held.handle.drop.remote([w])  # in order before any later call to that helper

    def stacks(self, workers: Sequence[int], wait_s: float) -> dict[int, str]:
        """Each of ``workers``' actors' stacks, taken now by its node's helper (all nodes at
        once): worker -> text, for those that wrote within ``wait_s`` seconds."""
        asks = {
            node: self._nodes[node].handle.stacks.remote(ws, wait_s)
            for node, ws in self._by_node(workers).items()
        }
        found: dict[int, str] = {}
        for answer in _answers(asks, wait_s + HELPER_CALL_S).values():
            if not isinstance(answer, str):
                found.update(answer)
        return found

    def report(self, w: int) -> tuple[str, tuple[int, float] | None] | str:
        """What worker ``w``'s dead actor left (:meth:`NodeHelper.report`; nothing for an
        actor no helper watched: it died before it was laid out), or why nothing can be
        read (its helper is gone: Ray's reason, a ``str``)."""
        answer = self._ask(w, "report", w)
        return ("", None) if answer is None else answer

    def log(self, w: int) -> bytes:
        """Worker ``w``'s action log (``b""`` when it cannot be read)."""
        answer = self._ask(w, "log", w)
        return answer if isinstance(answer, bytes) else b""

    def counters(self, workers: Sequence[int]) -> dict[int, tuple[bytes, int | None]]:
        """Per worker of ``workers`` whose helper answered: its log's head and its actor's
        resident memory now (:meth:`NodeHelper.counters`), all nodes at once."""
        return self._ask_each(workers, "counters")

    def memory(self, workers: Sequence[int]) -> dict[int, tuple[int | None, int, float | None]]:
        """Per worker of ``workers`` whose helper answered: :meth:`NodeHelper.memory`."""
        return self._ask_each(workers, "memory")

    def close(self) -> list[Any]:
        """Forget every helper; their handles, to kill (after the env actors)."""
        handles = [held.handle for held in self._nodes.values()]
        self._nodes, self._home = {}, {}
        return handles

    # -- the mechanics ----------------------------------------------------------------------

    def _start(self, node: str) -> Any:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        strategy = NodeAffinitySchedulingStrategy(node_id=node, soft=False)
        return RemoteHelper.options(**self._options, scheduling_strategy=strategy).remote(
            self._ranges
        )

    def _by_node(self, workers: Sequence[int]) -> dict[str, list[int]]:
        nodes: dict[str, list[int]] = {}
        for w in workers:
            node = self._home.get(w)
            if node is not None and node in self._nodes:
                nodes.setdefault(node, []).append(w)
        return nodes

    def _ask(self, w: int, method: str, *args: Any) -> Any:
        """``method(*args)`` of worker ``w``'s helper: its answer, Ray's reason (a ``str``)
        when the helper is gone or does not answer, ``None`` when no helper watches ``w``."""
        node = self._home.get(w)
        if node is None:
            return None
        held = self._nodes.get(node)
        if held is None:  # found dead since (its actors died with it)
            return "it was found dead earlier"
        return _answers({w: getattr(held.handle, method).remote(*args)}, HELPER_CALL_S)[w]

    def _ask_each(self, workers: Sequence[int], method: str) -> dict[int, Any]:
        asks = {
            node: getattr(self._nodes[node].handle, method).remote(ws)
            for node, ws in self._by_node(workers).items()
        }
        found: dict[int, Any] = {}
        for answer in _answers(asks, HELPER_CALL_S).values():
            if not isinstance(answer, str):
                found.update(answer)
        return found


def _answers(refs: Mapping[Any, Any], timeout: float) -> dict[Any, Any]:
    """Each of ``refs``' values (key -> ObjectRef) within ``timeout`` seconds in all: key ->
    its value, or Ray's reason (a ``str``) where it raised or did not come in time."""
    if not refs:
        return {}
    ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout)
    done = set(ready)
    found: dict[Any, Any] = {}
    for key, ref in refs.items():
        if ref not in done:
            found[key] = f"no answer within {timeout:g} s"
            continue
        try:
            found[key] = ray.get(ref)
        except ray.exceptions.RayError as exc:
            found[key] = cause(exc)
    return found


def reason(exc: BaseException) -> str:
    """The first lines of Ray's account of an actor's death, on one line."""
    text = " ".join(str(exc).split())
    return text[:300] + ("..." if len(text) > 300 else "")


def cause(exc: BaseException) -> str:
    """Why Ray says an actor is gone, in a sentence or two: its account without the
    generic first line and the actor's details (class, ids, pid, address), on one line."""
    lines = [line for line in str(exc).splitlines() if line and not line[0].isspace()]
    text = " ".join(" ".join(lines[1:] or lines).split())
    return text[:200] + ("..." if len(text) > 200 else "")


def _kill(handle: Any) -> None:
    with contextlib.suppress(Exception):
        ray.kill(handle, no_restart=True)
