"""Replay: the record of a failure, and its file.

An :class:`~envfleet.EnvError`, an :class:`~envfleet.EnvCrashedError` and a
:class:`~envfleet.StepTimeoutError` carry a :class:`Replay`: each env's factory, its episode's
start and its actions up to the failing one (:class:`EnvRecording`, from the action log of
:mod:`envfleet._core.action_log`). A replay is saved to one file (:data:`MAGIC`, the format
:data:`VERSION`, checked before unpickling: :func:`load_replay`), as is a :class:`Snapshot`
(every env's record, for a resumed vector env). :mod:`envfleet._core.replay_runner` runs it.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import cloudpickle
import gymnasium

from envfleet._core.errors import ConfigError, EnvfleetError

__all__ = [
    "MAGIC",
    "VERSION",
    "EnvRecording",
    "Replay",
    "ReplayFileError",
    "Snapshot",
    "load_replay",
    "recording_of",
    "replays_of",
]

MAGIC = b"envfleet-replay\n"  # the first bytes of a replay file
VERSION = 1  # the replay file format's version, after MAGIC


class ReplayFileError(EnvfleetError, ValueError):
    """A file that is not a replay this envfleet can read: another file, or another version."""


@dataclass
class EnvRecording:
    """One env's episode up to a failure.

    Attributes:
        env_index: the env's index in its vector env.
        start: how the episode began: ``("seed", seed, options)`` (a ``reset``) or
            ``("rng", generator_states, native, options)`` (an autoreset, or a reset
            without a seed: see :func:`~envfleet._core.env_state.reset_start`); ``None``
            when not ``complete``.
        actions: every action of the episode, in order, the failing one last.
        complete: whether the record holds the whole episode (``why`` says what is missing).
        steps: the episode's actions up to the failure.
    """

    env_index: int
    start: tuple[Any, ...] | None
    actions: list[Any]
    complete: bool
    why: str
    steps: int


@dataclass
class Replay:
    """What reproduces a failure in one process: ``envfleet.replay(err.replay)``.

    An :class:`~envfleet.EnvError` (raised in ``step`` or ``reset``) carries the failed env's;
    an :class:`~envfleet.EnvCrashedError` and a :class:`~envfleet.StepTimeoutError` carry every
    env of the dead or hung worker (which one did it is not known to the driver), replayed in
    their worker's order. ``err.replay`` is ``None`` where the record died with its worker
    (a Ray actor lost with its node) or ``replay_steps=0``.

    Attributes:
        kind: ``"error"`` (an env raised), ``"crash"`` (its worker died) or ``"hang"``.
        failure: the error's message.
        envs: each env's :class:`EnvRecording`.
        factories: env index -> its zero-argument factory.
        timeout_s: for a hang, the step timeout (seconds) the worker ran past.

    Example::

        try:
            envs.step(actions)
        except envfleet.EnvError as err:
            err.replay.save("failure.replay")  # then: envfleet replay failure.replay

    A replay file holds pickled factories: load only files you made, as ``torch.load`` warns.
    """

    kind: str
    failure: str
    envs: list[EnvRecording]
    factories: dict[int, Callable[[], gymnasium.Env[Any, Any]]] = field(repr=False)
    timeout_s: float | None = None

    @property
    def complete(self) -> bool:
        """Whether every env's episode is recorded whole (a replay can run)."""
        return all(r.complete for r in self.envs)

    def save(self, path: str) -> None:
        """Write one file: :data:`MAGIC`, the format version, then the replay (cloudpickle)."""
        _save(self, path, MAGIC)


def _save(obj: Any, path: str, magic: bytes) -> None:
    data = magic + VERSION.to_bytes(2, "little") + cloudpickle.dumps(obj)
    with open(path, "wb") as f:
        f.write(data)


def _load(path: str, magic: bytes, cls: type[Any], what: str) -> Any:
    """The ``cls`` saved at ``path`` by :func:`_save`, its header checked first."""
    with open(path, "rb") as f:
        head = f.read(len(magic) + 2)
        if head[: len(magic)] != magic:
            raise ReplayFileError(f"{path} is not an envfleet {what} file (no {what} header)")
        version = int.from_bytes(head[len(magic) :], "little")
        if version != VERSION:
            raise ReplayFileError(
                f"{path} is a {what} file of format version {version}; this envfleet reads "
                f"version {VERSION}"
            )
        obj = pickle.load(f)
    if not isinstance(obj, cls):
        raise ReplayFileError(f"{path} holds a {type(obj).__name__}, not a {cls.__name__}")
    return obj


def load_replay(path: str) -> Replay:
    """The :class:`Replay` saved at ``path``; its header and version are checked before
    anything is unpickled.

    Raises:
        ReplayFileError: ``path`` is not an envfleet replay file, or of another version.
    """
    return cast(Replay, _load(path, MAGIC, Replay, "replay"))


SNAPSHOT_MAGIC = b"envfleet-snapshot\n"  # the first bytes of a snapshot file


@dataclass
class Snapshot:
    """A vector env's state between two steps, from which ``envfleet.make(..., resume=state)``
    continues exactly: ``state = envs.snapshot()``.

    Per env, its episode so far, as a replay holds it (how it began: its seed, or its
    ``np_random`` state at its autoreset and, for an Atari env, ALE's own state; its actions
    since), and whether its last step ended it; the vector env's step count and autoreset
    mode. A resumed vector env (any backend, any worker count) rebuilds each env from the
    factory given to ``make`` and runs its episode again, so that its next ``step`` returns
    what the uninterrupted run would have, bit for bit, for envs whose randomness lives in
    their seed and ``np_random``. It holds no factory: ``make`` is given the env again.

    Attributes:
        num_envs: sub-environments.
        autoreset_mode: the ``AutoresetMode``'s value.
        recordings: per env, its :class:`EnvRecording`.
        done: per env, whether its last step ended its episode.
        steps: the vector env's ``step`` calls so far.
        seeds: per env, its last reset seed (for a restart policy's seeds).
        pool: a first-ready pool's state (``envfleet._front.pool.PoolState``: the results
            waiting for ``recv``, the actions sent to envs not yet stepped); ``None`` for a
            synchronous vector env.

    ``save(path)`` writes it with a header; :meth:`load` checks the header before it
    unpickles. Load only files you made.
    """

    num_envs: int
    autoreset_mode: str
    recordings: list[EnvRecording]
    done: list[bool]
    steps: int
    seeds: list[int | None]
    pool: Any = None

    def save(self, path: str) -> None:
        """Write one file: a header, the format version, then the snapshot (pickled)."""
        _save(self, path, SNAPSHOT_MAGIC)

    @staticmethod
    def check(state: Any, num_envs: int, autoreset_mode: str, pool: bool) -> Snapshot:
        """``state`` when a vector env of ``num_envs`` envs in ``autoreset_mode`` (its value)
        can resume from it.

        Raises:
            ConfigError: not a :class:`Snapshot`; of another number of envs or autoreset
                mode; a pool's snapshot with results waiting for ``recv`` or actions not yet
                stepped, into a synchronous vector env (``pool`` false).
        """
        if not isinstance(state, Snapshot):
            raise ConfigError(f"resume must be an envfleet.Snapshot, got {state!r}")
        if state.num_envs != num_envs or state.autoreset_mode != autoreset_mode:
            raise ConfigError(
                f"this snapshot is of {state.num_envs} envs in autoreset mode "
                f"{state.autoreset_mode!r}; this vector env has {num_envs} in "
                f"{autoreset_mode!r}"
            )
        taken = state.pool
        if not pool and taken is not None and (taken.ready or taken.sent):
            raise ConfigError(
                "this snapshot of a first-ready pool has results waiting for recv() or "
                "actions not yet stepped: resume it into a pool (batch_size)"
            )
        return state

    @staticmethod
    def load(path: str) -> Snapshot:
        """The snapshot saved at ``path``.

        Raises:
            ReplayFileError: not an envfleet snapshot file, or of another format version.
        """
        return cast(Snapshot, _load(path, SNAPSHOT_MAGIC, Snapshot, "snapshot"))


def recording_of(failure: Any, env_index: int) -> EnvRecording | None:
    """The recording of env ``env_index`` in a failure as a transport reports it: an
    :class:`~envfleet._core.envgroup.EnvFailure` (its ``failures`` for a partial one) or a
    :class:`~envfleet._core.protocol.Failure` of remote errors; ``None`` when it has none."""
    for item in [failure, *getattr(failure, "failures", ()), *getattr(failure, "errors", ())]:
        recording = getattr(item, "recording", None)
        if recording is not None and getattr(item, "env_index", None) == env_index:
            return cast(EnvRecording, recording)
    return None


def replays_of(
    kind: str,
    failure: str,
    recordings: Sequence[EnvRecording],
    factories: Sequence[Callable[[], gymnasium.Env[Any, Any]]] | None,
    timeout_s: float | None = None,
) -> Replay | None:
    """A :class:`Replay` of ``recordings`` with their factories (``factories[env_index]``),
    or ``None`` when there is nothing to replay."""
    if not recordings or factories is None:
        return None
    factories_of = {r.env_index: factories[r.env_index] for r in recordings}
    return Replay(kind, failure, list(recordings), factories_of, timeout_s)
