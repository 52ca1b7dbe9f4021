"""What a transport implements for the round driver: :class:`Transport`'s few primitives
(send a command, wait for replies and deaths, read a reply, respawn a worker, ...), what one
wait found (:class:`Seen`) and the step round a transport may run in one call
(:data:`FullRound`). A transport (``serial``, ``threads``, ``processes``, ``ray``) holds no
loop over pending workers: :class:`~envfleet._backends.rounds.RoundDriver` runs every round
over these primitives.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

from envfleet._backends.supervisor import Ledger, Round
from envfleet._core.buffers import Batch
from envfleet._core.errors import EnvCrashedError, EnvError
from envfleet._core.failures import CLOSED
from envfleet._core.protocol import Command, RoundOutcome
from envfleet._core.stats import StepTimeStats

__all__ = ["NOTHING", "FullRound", "Seen", "Transport"]

# Transport.full_round: called with ``ring`` (send every worker its command; false: step_async
# did) and ``wait_s`` (the most seconds its wait may block: the step timeout or the next hang
# report, whichever comes first; below 0, no bound), it answers ``None`` when the round is
# complete, else what it took.
FullRound = Callable[[bool, float], RoundOutcome | None]


class Seen:
    """What one :meth:`Transport.wait` found: workers with a reply to :meth:`Transport.read`
    (``ready``, in the order of the workers waited on) and workers found dead (``dead``:
    worker -> why, ``""`` where the exit code says it). Both empty: the deadline passed (or,
    in a first-ready wait, a wake-up with nothing new)."""

    __slots__ = ("dead", "ready")

    def __init__(self, ready: list[int], dead: dict[int, str] | None = None):
        self.ready = ready
        self.dead: dict[int, str] = dead if dead is not None else {}


NOTHING = Seen([])


class Transport(Protocol):
    """The primitives a transport implements for the round driver.

    Attributes:
        ranges: ``[start, stop)`` of envs per worker.
        batch: the front's buffers (observations, actions, rewards, ...).
        ledger: failures, restarts and seeds, shared with the front.
        pool: workers may be sent commands while others run (a first-ready pool).
        replaceable: a hung or dead worker can be killed and started anew (``threads``: a
            thread cannot be killed, so a late one fails fast whatever the restart policy).
        late_what, late_fate: how a timeout names the late workers and what became of them.
        full_round: the step round where every worker is pending, in one call (see the
            module), or ``None``.
        remote: the workers :attr:`full_round` rings, in order (the others run in the driver),
            and whose ``READY`` the driver waits for at the start.

    A transport may also offer ``stacks(workers)``: each worker's threads' stacks, taken
    now, before a hung worker is killed (worker -> text in faulthandler's format; processes
    and threads do). A transport whose groups run here may offer
    ``run_inline(command, payloads)``:
    :meth:`send` then :meth:`read` of each group in one call, returning ``(results,
    failures)`` (the in-process transports do: one call a group instead of two).
    """

    ranges: list[tuple[int, int]]
    ledger: Ledger
    pool: bool
    replaceable: bool
    late_what: str
    late_fate: str
    full_round: FullRound | None
    remote: list[int]

    @property
    def batch(self) -> Batch: ...

    @property
    def num_workers(self) -> int: ...

    @property
    def closed(self) -> bool: ...

    def inline(self, command: Command) -> frozenset[int]:
        """The workers whose :meth:`send` of ``command`` runs it here, to the end."""

    def send(self, w: int, command: Command, payload: Any) -> bool:
        """Start ``command`` on worker ``w``; ``False`` when ``w`` was found dead."""

    def wait(
        self, workers: list[int], deadline: float | None, first: bool, spun_s: float | None = None
    ) -> Seen:
        """Wait until a worker of ``workers`` has a reply, dies, or ``deadline``
        (``time.monotonic()`` seconds, ``None``: none) passes. ``first``: a first-ready
        pool's wait, which reports every worker ready by then; else the transport may report
        just the first to reply. ``spun_s``: seconds :attr:`full_round` already spun on the
        first of ``workers`` (a transport that spins before it blocks counts them)."""

    def read(self, w: int, done: Round) -> None:
        """Take worker ``w``'s reply (reported ready) into ``done``: its result, its
        failure, or its death (a reply cut short)."""

    def respawn(self, w: int, reason: str) -> None:
        """Kill worker ``w`` (dead or hung) and start a new one for the same envs; its
        ``READY`` reply comes through :meth:`wait` like any other."""

    def lay_out(self, workers: list[int], probe: Any) -> bool:
        """After the workers' first ``READY`` replies (``probe``: env 0's, at the start; else
        ``None``): hand each worker its layout when it was started without one, and return
        whether a second ``READY`` reply is to be waited for."""

    def env_error(self, w: int, failure: Any, note: str) -> EnvError:
        """The typed error of worker ``w``'s first failed env."""

    def crash_error(
        self, w: int, step: int, note: str, reason: str, starting: bool, fate: str = CLOSED
    ) -> EnvCrashedError:
        """The typed error of worker ``w``, found dead after ``step`` steps."""

    def step_times(self) -> tuple[StepTimeStats, ...]: ...

    def close(self, timeout: float | None, terminate: bool, busy: Sequence[int]) -> None:
        """Shut every worker down (``busy``: those with a command still running)."""

    def disown(self) -> None: ...
