"""EnvGroup: K sub-environments over their slice of the batch buffers (layer 7 in
docs/architecture.md).

This is the one step loop and the one autoreset implementation of envfleet. Every backend
runs it: in-process for ``serial``, inside each worker for ``processes``. It mirrors
``gymnasium.vector.SyncVectorEnv.step``/``reset`` env by env, so that the same seeds and actions
give bit-identical observations, rewards, terminations, truncations and infos.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Any, cast

import cloudpickle
import gymnasium
import numpy as np
from gymnasium.spaces.utils import is_space_dtype_shape_equiv
from gymnasium.vector import AutoresetMode
from gymnasium.vector.utils import batch_space, concatenate, create_empty_array, iterate

from envfleet._core import native as _speedups
from envfleet._core.action_log import SLOT_BYTES, ActionLog
from envfleet._core.buffers import Batch, fill_side, is_leaf, side_leaves, side_values
from envfleet._core.crash_note import NOTE_CLEAR, NOTE_SEVERAL
from envfleet._core.env_state import StartReader, env_state
from envfleet._core.errors import ConfigError
from envfleet._core.protocol import (
    CallRequest,
    Command,
    InfoEvent,
    ResetRequest,
    RestartRequest,
    SetAttrRequest,
    SideValues,
)
from envfleet._core.rows import RowWriter
from envfleet._core.stepping import AdaptiveStepping, stepping_mode

__all__ = ["EnvFailure", "EnvGroup", "PartialFailure", "spaces_mismatch"]

# A group step no run reaches (EnvGroup._quiet without an AdaptiveStepping: never asks it).
_NEVER = 1 << 62

logger = logging.getLogger("envfleet")


class EnvFailure(Exception):
    """Raised by an EnvGroup when one of its envs raised; the env's exception is ``__cause__``."""

    def __init__(self, env_index: int, method: str):
        super().__init__(f"sub-environment {env_index} raised in {method}")
        self.env_index = env_index
        self.method = method
        self.recording: Any = None  # the env's episode so far (replay.EnvRecording)


class PartialFailure(EnvFailure):
    """Some envs raised in ``step`` or ``reset``; every other env of the group completed.

    ``env_index``, ``method`` and ``__cause__`` are the first failure's; ``failures`` lists
    them all (each an :class:`EnvFailure` with its exception as ``__cause__``), ``events`` the
    infos of the envs that completed. The failed envs' rows hold no new data: the supervisor
    either rebuilds those envs (``Command.RESTART``) or reports the first failure.
    """

    def __init__(self, failures: list[EnvFailure], events: list[InfoEvent]):
        first = failures[0]
        super().__init__(first.env_index, first.method)
        self.__cause__ = first.__cause__
        self.failures = failures
        self.events = events


def info_as_now(info: dict[str, Any]) -> dict[str, Any]:
    """``info`` as gymnasium's ``VectorEnv._add_info`` would batch it now: nested dicts and
    array values copied (``_add_info`` builds new ones of each), other values shared."""
    now = dict(info)
    for key, value in info.items():
        if isinstance(value, dict):
            now[key] = info_as_now(value)
        elif isinstance(value, np.ndarray):
            now[key] = value.copy()
    return now


def not_an_env_error(returned: Any, env_index: int) -> ConfigError:
    """The error for a factory that returned ``returned``, which is not a ``gymnasium.Env``."""
    shown = repr(returned)
    shown = shown if len(shown) <= 80 else shown[:77] + "..."
    return ConfigError(
        f"the factory of sub-environment {env_index} returned {shown} "
        f"({type(returned).__qualname__}), not a gymnasium.Env"
    )


def spaces_mismatch(
    env: gymnasium.Env[Any, Any],
    observation_space: gymnasium.Space[Any],
    action_space: gymnasium.Space[Any],
    same_observation_space: bool = True,
) -> str | None:
    """Describe how ``env``'s spaces differ from the expected ones, or ``None`` when they fit.

    As gymnasium's SyncVectorEnv checks them: the action space must be equal; the observation
    space equal with ``same_observation_space`` (``observation_mode="same"``), else of the
    same shape and dtype (``is_space_dtype_shape_equiv``; other modes).
    """
    if same_observation_space:
        if env.observation_space != observation_space:
            # gymnasium's words, so that code matching its message still does
            return (
                "observation_mode='same' however the sub-environments observation spaces are "
                f"not equivalent. single_observation_space={observation_space}, "
                f"sub-environment observation_space={env.observation_space}. If this is "
                "intentional, use `observation_mode='different'` instead."
            )
    elif not is_space_dtype_shape_equiv(env.observation_space, observation_space):
        return (
            f"observation space {env.observation_space} has another shape or dtype than "
            f"{observation_space}"
        )
    if env.action_space != action_space:
        return f"action space {env.action_space} != {action_space}"
    return None


class EnvGroup:
    """Sub-environments ``[start, start + K)`` of a vector env and their buffer slices.

    Args:
        env_fns: K zero-argument factories, already bound to their ``env_index``.
        start: global index of the first env.
        batch: the whole vector env's :class:`Batch`; the group uses rows ``[start, start+K)``.
        single_observation_space, single_action_space: the spaces of one sub-environment.
        autoreset_mode: as ``gymnasium.vector.AutoresetMode``.
        first_env: an env already built by ``env_fns[0]`` (:func:`envfleet.make`'s, to learn
            the spaces), used instead of building it again.
        batch_offset: the env index of ``batch``'s row 0: 0 for the whole vector env's batch;
            ``start`` for a batch of just this group's K rows (a Ray actor's).
        same_observation_space: ``observation_mode == "same"``: every env's observation space
            must equal ``single_observation_space``; else only share its shape and dtype (see
            :func:`spaces_mismatch`).
        action_log: where the group records its actions and each env's episode start for a
            replay (:class:`~envfleet._core.action_log.ActionLog`, opened here), or ``None``.
    """

    def __init__(
        self,
        env_fns: Sequence[Callable[[], gymnasium.Env[Any, Any]]],
        start: int,
        batch: Batch,
        single_observation_space: gymnasium.Space[Any],
        single_action_space: gymnasium.Space[Any],
        autoreset_mode: AutoresetMode,
        first_env: gymnasium.Env[Any, Any] | None = None,
        batch_offset: int = 0,
        same_observation_space: bool = True,
        action_log: ActionLog | None = None,
    ):
        self.start = start
        self.action_log = action_log
        # The group step at which an env's record may need a checkpoint (_checkpoint), and
        # the envs that cannot be checkpointed.
        self._checkpoint_at = _NEVER
        self._checkpoint_off: set[int] = set()
        if action_log is not None:
            action_log.open()
            self._checkpoint_at = max(1, action_log.capacity // 2)
        # Per env, how its episode starts are read (_reset_start).
        self._start_readers: dict[int, StartReader] = {}
        self.same_observation_space = same_observation_space
        self.size = len(env_fns)
        self.stop = start + self.size
        self.autoreset_mode = autoreset_mode
        # Asked once per step: a bool attribute is cheaper than an Enum member lookup
        # (benchmarks/README.md).
        self._next_step = autoreset_mode is AutoresetMode.NEXT_STEP
        self._same_step = autoreset_mode is AutoresetMode.SAME_STEP
        self.single_observation_space = single_observation_space
        self.single_action_space = single_action_space
        self._action_space = batch_space(single_action_space, self.size)
        self.buffers = batch.slice(self.start - batch_offset, self.stop - batch_offset)
        # The record of each step's action rows (ActionLog.recorder: in C where it applies).
        self._record_actions: Callable[[], Any] | None = (
            None if action_log is None else action_log.recorder(self.buffers.actions)
        )
        self._env_fns = list(env_fns)
        # The crash note (crash_note.py; note_crashes) and the env index of its j = 0.
        self._crash_note: memoryview | None = None
        self._crash_base = 0
        # How a processes worker steps the envs, one after another or all at once
        # (adapt_stepping); None: one after another, in the calling thread.
        self._stepping: AdaptiveStepping | None = None
        # Rounds step() runs one env after another without asking _stepping.
        self._quiet = _NEVER
        # What tasks (Command.TASK) keep here between commands, by their own keys; gone when
        # the group is rebuilt (a restarted worker).
        self.task_state: dict[str, Any] = {}
        self.envs: list[gymnasium.Env[Any, Any]] = []
        for j, fn in enumerate(env_fns):
            if j == 0 and first_env is not None:
                self.envs.append(first_env)
                continue
            try:
                env = fn()
            except Exception as exc:
                self.close()
                raise EnvFailure(start + j, "make") from exc
            if not isinstance(env, gymnasium.Env):
                self.close()
                raise not_an_env_error(env, start + j)
            self.envs.append(env)
        self._env_obs: list[Any] = [None] * self.size
        self._rewards: list[Any] = [0.0] * self.size
        self._terminations: list[Any] = [False] * self.size
        self._truncations: list[Any] = [False] * self.size
        self._autoreset: list[bool] = [False] * self.size  # envs to reset on their next step
        # For a single-array space, gymnasium's iterate is iter(items): called directly,
        # without the dispatch, on the hot path.
        self._action_leaf = is_leaf(single_action_space)
        # Leaves without a fixed size have no buffer: their values go with the reply.
        self._side = bool(side_leaves(single_observation_space))
        # One writer per observation slab (rows.RowWriter); the front picks the slab of each
        # command in the shared word ``buffers.slab``.
        write_rows = _speedups.function("write_rows")
        self._writers = [
            RowWriter(self._env_obs, out, single_observation_space, write_rows)
            for out in self.buffers.observation_slabs or [self.buffers.observations]
        ]
        self._slab = self.buffers.slab
        # The C write of a step's results (envfleet._core.native) straight into the reward
        # and done-flag rows, bound once to the group's lists (only ever changed in place) and
        # called with no Python frame around it; None where it does not apply.
        write_results = _speedups.function("write_results")
        results = (self.buffers.rewards, self.buffers.terminations, self.buffers.truncations)
        dtypes = (np.dtype(np.float64), np.dtype(np.bool_), np.dtype(np.bool_))
        self._c_results: Callable[[], bool] | None = None
        if (
            write_results is not None
            and all(
                isinstance(a, np.ndarray) and a.flags.c_contiguous and a.flags.writeable
                for a in results
            )
            and tuple(a.dtype for a in results) == dtypes
        ):
            self._c_results = functools.partial(
                write_results,
                self._rewards,
                self._terminations,
                self._truncations,
                *(a.ctypes.data for a in results),
                self._autoreset,
            )

    def resume_autoreset(self, done: Sequence[bool]) -> None:
        """Set each env's autoreset flag (``done``: its last step ended its episode): a group
        that takes over envs mid-run (a recycled worker's, a resumed vector env's) resets on
        its next step those whose episode just ended, as the old group would have."""
        self._autoreset[:] = [bool(d) for d in done]

    def note_crashes(self, note: memoryview | None, base: int) -> None:
        """Write ``base + j`` into ``note[0]`` before stepping or resetting env ``j``, and
        :data:`~envfleet._core.crash_note.NOTE_CLEAR` once done;
        :data:`~envfleet._core.crash_note.NOTE_SEVERAL` while several envs step at once
        (:meth:`adapt_stepping`). For the learner's own block (its fatal signal names the env:
        :func:`envfleet._core.crash_note.driver_crash_note`) and every processes worker (the
        driver reads the note when the worker died or hung)."""
        self._crash_note, self._crash_base = note, base
        if note is not None:
            note[0] = NOTE_CLEAR
        if self._stepping is not None:
            self._stepping.note = note

    def stepping_kind(self) -> str:
        """What :meth:`adapt_stepping` found its envs to be: ``"wait"``, ``"compute"`` or
        ``"unknown"`` (not timed enough yet, or not adapting)."""
        return "unknown" if self._stepping is None else self._stepping.kind

    def adapt_stepping(self, words: np.ndarray | None = None, mode: str | None = None) -> None:
        """Let the group choose, from its envs' own steps, between stepping them one after
        another and all at once (envs that wait: a simulator, a server), as a processes
        worker does (:class:`~envfleet._core.stepping.AdaptiveStepping`). ``words``: the last
        :data:`~envfleet._core.stats.STEPPING_WORDS` float64 words of the worker's step-time
        row, where it says what it found; ``mode``: ``"auto"``, ``"sequential"`` or
        ``"concurrent"``, default ``ENVFLEET_STEPPING`` (``auto`` when unset). Not for the
        learner's own block, whose envs must run in the learner's thread.

        Raises:
            ConfigError: ``mode`` (or ``ENVFLEET_STEPPING``) is none of the three.

        Example::

            group.adapt_stepping(stats_rows(spec.stats)[g][KIND:])  # a worker's row
            group.step()  # one after another, or at once once its envs are seen to wait
        """
        if self._stepping is not None:
            self._stepping.close()
        stepping = AdaptiveStepping(self.size, words, stepping_mode() if mode is None else mode)
        stepping.note = self._crash_note
        self._stepping = stepping
        self._quiet = 0

    def check_spaces(self) -> tuple[int, str] | None:
        """(env_index, description) of the first env whose spaces differ, or ``None``."""
        for j, env in enumerate(self.envs):
            problem = self._spaces_mismatch(env)
            if problem is not None:
                return self.start + j, problem
        return None

    def _spaces_mismatch(self, env: gymnasium.Env[Any, Any]) -> str | None:
        space, same = self.single_observation_space, self.same_observation_space
        return spaces_mismatch(env, space, self.single_action_space, same)

    # -- commands -------------------------------------------------------------------------

    def run(self, command: Command, payload: Any) -> Any:
        """Execute one command; the result travels back to the front."""
        if command is Command.STEP:
            return self.step(payload)
        if command is Command.RESET:
            return self.reset(payload)
        if command is Command.CALL:
            return self.call(payload)
        if command is Command.SET_ATTR:
            return self.set_attr(payload)
        if command is Command.RENDER:
            return self.render()
        if command is Command.RESTART:
            return self.restart(payload)
        if command is Command.TASK:
            return payload.function(self, payload.argument)
        raise ValueError(f"unknown command {command!r}")

    def step(self, leaf_actions: list[Any] | None = None) -> list[InfoEvent]:
        """Step every env with its action from the action buffer, autoresetting per mode.

        Writes observations, rewards, terminations and truncations into the group's buffer
        slices and returns the non-empty infos in order (gymnasium's SyncVectorEnv.step).

        Args:
            leaf_actions: per leaf of the action space (walk order), the group's batched
                values that do not come from the buffer, or ``None`` for a leaf read from
                the buffer: the values of a leaf without a fixed size (a tuple, one per env,
                as gymnasium's batched action holds them; ``envfleet._core.buffers.side_leaves``)
                and the caller's array where its dtype differs from the space's.
        """
        # Like SyncVectorEnv, each env gets a view of its row of the batched actions; the
        # row is only rewritten by the next step, once this one has completed.
        log = self.action_log
        batched = self.buffers.actions
        if leaf_actions is not None:
            batched = fill_side(self.single_action_space, batched, iter(leaf_actions), True)
            if log is not None:
                log.record(batched)
        else:
            record = self._record_actions
            if record is not None:
                record()  # before any env runs: a hang's action is kept
        actions = iter(batched if self._action_leaf else iterate(self._action_space, batched))
        # Whether any env resets this step, asked once: most steps reset none.
        resets = self._next_step and True in self._autoreset
        events: list[InfoEvent] = []
        quiet = self._quiet
        if quiet:  # one env after another, untimed: every round but those a worker times
            self._quiet = quiet - 1
            failures = self._step_envs(enumerate(actions), resets, events, log)
        else:  # a processes worker times this round, or steps its envs all at once
            stepping = cast(AdaptiveStepping, self._stepping)
            failures, self._quiet = stepping.step(self._step_envs, actions, resets, events, log)
        keep = [self._autoreset[f.env_index - self.start] for f in failures] if failures else []
        write = self._c_results
        if write is None or not write():  # else plain floats and bools, written in C
            self._write_results()
        if failures is not None:
            for f, flag in zip(failures, keep, strict=True):
                self._autoreset[f.env_index - self.start] = flag  # its state is unknown
            raise PartialFailure(failures, events)
        # _write_observations inline, so that no Python frame runs around the C copy; its
        # write read as a slot's load (a method call's lookup is not specialized for a slot).
        writer = self._writers[0 if self._slab is None else self._slab.item(0)]
        write_obs = writer.write
        try:
            write_obs()
        except Exception as exc:
            raise self._misfit(writer, "step") from exc
        if self._side:
            self._side_values(events)
        if log is not None and log.words[0] >= self._checkpoint_at:
            self._checkpoint(log)
        return events

    def _checkpoint(self, log: ActionLog) -> None:
        """Checkpoint each env whose record holds half its capacity since its start
        (:func:`~envfleet._core.env_state.env_state`, :meth:`ActionLog.rebase`), so that no
        record needs more than ``replay_steps`` actions (a snapshot, a recycled worker and a
        restart's catch-up work at any step). An env whose state cannot be taken (or does not
        fit its slot) is not asked again; its record past ``replay_steps`` is incomplete."""
        n, half = int(log.words[0]), max(1, log.capacity // 2)
        off = self._checkpoint_off
        for j, env in enumerate(self.envs):
            if j not in off and n - int(log.starts[j]) >= half:
                blob = env_state(env)
                if blob is None or not log.rebase(j, ("state", blob)):
                    off.add(j)
                    logger.info(
                        "sub-environment %d cannot be checkpointed (its state does not pickle "
                        "or is over %d bytes): a record of it holds %d steps at most",
                        self.start + j,
                        SLOT_BYTES,
                        log.capacity,
                    )
        due = [int(log.starts[j]) + half for j in range(self.size) if j not in off]
        self._checkpoint_at = min(due) if due else _NEVER

    def step_only(self, actions: list[Any], indices: list[int]) -> list[InfoEvent]:
        """Step the envs ``indices`` (local, in order) with ``actions`` (one per env of the
        group), recording the step: a worker's catch-up after its predecessor died inside that
        step (:func:`envfleet._core.action_log.catch_up_envs`). The other envs' slots are left
        as they are; the observations are written only with every env stepped (else the
        others' ``Command.RESTART`` writes them).

        Raises:
            PartialFailure: an env raised (the supervisor gives up then).
        """
        log = self.action_log
        if log is not None:
            space = self.single_action_space
            log.record(concatenate(space, actions, cast(Any, create_empty_array(space, self.size))))
        resets = self._next_step and True in self._autoreset
        events: list[InfoEvent] = []
        failures = self._step_envs(((j, actions[j]) for j in indices), resets, events, log)
        if failures is not None:
            raise PartialFailure(failures, events)
        self._write_results()
        if len(indices) == self.size:
            self._write_observations("step", events)
        return events

    def _step_envs(
        self,
        pairs: Iterable[tuple[int, Any]],
        resets: bool,
        events: list[InfoEvent],
        log: Any,
    ) -> list[EnvFailure] | None:
        """Step env ``j`` (local) with ``action`` for each ``(j, action)`` of ``pairs``, in
        order, autoresetting per mode: results into the env's slots of the group's lists, infos
        appended to ``events``, episode starts recorded in ``log`` (or ``None``). The one body
        of an env's step, also run one env per call from several threads (``stepping.py``).

        Returns the failures of the envs that raised (each with its env's recording), in
        order, or ``None``; their slots read reward 0, not terminated, not truncated.

        Raises:
            BaseException: what is not an ``Exception`` (``KeyboardInterrupt``,
                ``SystemExit``) leaves at once: no env is stepped after it.
        """
        # Per-env results collect in Python lists and reach the buffers in one assignment
        # each: numpy converts every element exactly as SyncVectorEnv's scalar writes do.
        rewards, terms, truncs = self._rewards, self._terminations, self._truncations
        env_obs, envs, autoreset = self._env_obs, self.envs, self._autoreset
        same_step = self._same_step
        failures: list[EnvFailure] | None = None
        note, base = self._crash_note, self._crash_base
        if note is not None and note[0] == NOTE_SEVERAL:
            note = None  # several envs in flight at once (stepping.py): the note says so
        for j, action in pairs:
            env = envs[j]
            if note is not None:  # the crash note names the env this worker is inside
                note[0] = base + j
            try:
                if resets and autoreset[j]:
                    if log is not None:
                        log.began(j, self._reset_start(j, env))
                    env_obs[j], env_info = env.reset()
                    rewards[j], terms[j], truncs[j] = 0.0, False, False
                else:
                    # Unpacked straight into the per-env slots: the hot line of the library.
                    env_obs[j], rewards[j], terms[j], truncs[j], env_info = env.step(action)
                    if same_step and (terms[j] or truncs[j]):
                        # The reset below may reuse and change the info dict: keep it as it
                        # is now, as SyncVectorEnv's _add_info batches it before reset.
                        final = {"final_obs": env_obs[j], "final_info": info_as_now(env_info)}
                        events.append((self.start + j, final))
                        if log is not None:
                            log.began(j, self._reset_start(j, env))
                        env_obs[j], env_info = env.reset()
            except Exception as exc:
                # The other envs still step: their data must not depend on this one's fault.
                failures = failures or []
                failures.append(self._recorded(self.start + j, "step", exc))
                rewards[j], terms[j], truncs[j] = 0.0, False, False
                continue
            except BaseException:  # KeyboardInterrupt, SystemExit: no env is stepped now
                if note is not None:
                    note[0] = NOTE_CLEAR
                raise
            if env_info:
                events.append((self.start + j, env_info))
        if note is not None:
            note[0] = NOTE_CLEAR
        return failures

    def _reset_start(
        self, j: int, env: Any, options: Any = None, seed: int | None = None
    ) -> tuple[Any, ...] | bytes:
        """How env ``j``'s (local) reset begins, as the record keeps it: ``("seed", seed,
        options)`` with a seed, else its :class:`~envfleet._core.env_state.StartReader`'s
        ``packed`` start (a reader made once per env object)."""
        if seed is not None:
            return ("seed", seed, options)
        read = self._start_readers.get(j)
        if read is None or read.env is not env:
            read = self._start_readers[j] = StartReader(env)
        return read.packed(options)

    def _recorded(self, env_index: int, method: str, cause: Exception | None = None) -> EnvFailure:
        """The :class:`EnvFailure` of env ``env_index`` in ``method`` (``cause`` its
        ``__cause__``), with the env's episode so far (``recording``) if recorded."""
        failure = EnvFailure(env_index, method)
        failure.__cause__ = cause
        if self.action_log is not None:
            failure.recording = self.action_log.recording(env_index - self.start, env_index)
        return failure

    def _write_results(self) -> None:
        """The step's results written by numpy, where the C write (``_c_results``) does not
        apply or declined them (values it does not convert as numpy does)."""
        buf = self.buffers
        try:
            buf.rewards[:] = self._rewards
            buf.terminations[:] = self._terminations
            buf.truncations[:] = self._truncations
        except Exception:
            # Find the env whose result does not convert, to name it in the error.
            for j in range(self.size):
                try:
                    buf.rewards[j] = self._rewards[j]
                    buf.terminations[j] = self._terminations[j]
                    buf.truncations[j] = self._truncations[j]
                except Exception as exc:
                    raise self._recorded(self.start + j, "step (result)") from exc
            raise
        self._autoreset[:] = np.logical_or(buf.terminations, buf.truncations).tolist()

    def _write_observations(self, method: str, events: list[InfoEvent]) -> None:
        """Write every env's latest observation into the group's rows of the slab the front
        picked; with leaves without a fixed size, append each env's values there to ``events``.

        Raises:
            EnvFailure: an observation does not fit the observation space's buffer (shape,
                structure, or a dtype numpy will not cast with ``same_kind``), as
                SyncVectorEnv's ``concatenate`` refuses it; names the first such env.
        """
        writer = self._writers[0 if self._slab is None else self._slab.item(0)]
        try:
            writer.write()
        except Exception as exc:
            raise self._misfit(writer, method) from exc
        if self._side:
            self._side_values(events)

    def _misfit(self, writer: RowWriter, method: str) -> EnvFailure:
        """The failure of the first env whose observation ``writer`` could not write."""
        return self._recorded(self.start + writer.misfit(), f"{method} (observation)")

    def _side_values(self, events: list[InfoEvent]) -> None:
        """Each env's values of the leaves without a fixed size, appended to ``events`` (as
        :class:`~envfleet._core.protocol.SideValues` events)."""
        space = self.single_observation_space
        for j, obs in enumerate(self._env_obs):
            values: list[Any] = []
            side_values(space, obs, values)
            events.append((self.start + j, SideValues(values=values)))

    def reset(self, request: ResetRequest) -> list[InfoEvent]:
        """Reset the envs (all, or those in ``request.mask``) with their seeds and options."""
        mask = request.mask
        todo = [j for j in range(self.size) if mask is None or mask[j]]
        for j in todo:
            self._autoreset[j] = False
        per_env: list[list[InfoEvent]] = [[] for _ in range(self.size)]
        failed: list[EnvFailure | None] = [None] * self.size

        def reset_env(j: int, log: Any) -> None:
            env = self.envs[j]
            if log is not None:
                log.began(j, self._reset_start(j, env, request.options, request.seeds[j]))
            note = self._crash_note
            if note is not None and note[0] == NOTE_SEVERAL:
                note = None  # several envs in flight at once (stepping.py): the note says so
            if note is not None:  # the crash note names the env this worker is inside
                note[0] = self._crash_base + j
            try:
                self._env_obs[j], env_info = env.reset(
                    seed=request.seeds[j], options=request.options
                )
            except Exception as exc:
                failed[j] = self._recorded(self.start + j, "reset", exc)
                return
            finally:
                if note is not None:
                    note[0] = NOTE_CLEAR
            if env_info:
                per_env[j].append((self.start + j, env_info))

        stepping = self._stepping
        if stepping is None or len(todo) < 2:
            for j in todo:
                reset_env(j, self.action_log)
        else:  # envs that wait reset at once, as they step (stepping.py)
            stepping.run_each(reset_env, todo, self.action_log)
        events = [event for env_events in per_env for event in env_events]
        failures = [f for f in failed if f is not None]
        if failures:
            raise PartialFailure(failures, events)
        self._write_observations("reset", events)
        # A reset's rows read reward 0, not terminated, not truncated, as an autoreset step's
        # (EnvPool's recv reports them for reset envs; gymnasium's reset does not return them).
        buf = self.buffers
        for j in todo:
            self._rewards[j], self._terminations[j], self._truncations[j] = 0.0, False, False
            buf.rewards[j], buf.terminations[j], buf.truncations[j] = 0.0, False, False
        return events

    def restart(self, request: RestartRequest) -> list[InfoEvent]:
        """Rebuild the envs ``request.indices`` (local) and reset them with ``request.seeds``.

        After a step, their rows read ``reward 0.0, terminated False, truncated True`` and the
        new episode's first observation (with NEXT_STEP, the next step resets them, as after
        any truncation); after a reset, just that observation. Each one's info is its reset
        info plus ``env_restarted: True``.

        Raises:
            EnvFailure: a rebuilt env raised in its factory or its reset, or its spaces differ
                (``method`` starts with ``"restart"``); the supervisor gives up then.
        """
        events: list[InfoEvent] = []
        buf = self.buffers
        for j, seed in zip(request.indices, request.seeds, strict=True):
            index = self.start + j
            if request.rebuild:
                try:
                    self.envs[j].close()
                except Exception:  # a failed env may not close cleanly; it is dropped anyway
                    logger.warning("sub-environment %d raised in close()", index, exc_info=True)
                try:
                    self.envs[j] = self._env_fns[j]()
                except Exception as exc:
                    raise EnvFailure(index, "restart (make)") from exc
                problem = self._spaces_mismatch(self.envs[j])
                if problem is not None:
                    raise EnvFailure(index, "restart (spaces)") from ValueError(problem)
            if self.action_log is not None:
                self.action_log.began(j, self._reset_start(j, self.envs[j], None, seed))
            try:
                self._env_obs[j], env_info = self.envs[j].reset(seed=seed)
            except Exception as exc:
                raise EnvFailure(index, "restart (reset)") from exc
            events.append((index, {**env_info, "env_restarted": True}))
            if request.after is Command.STEP:
                self._rewards[j], self._terminations[j], self._truncations[j] = 0.0, False, True
                buf.rewards[j], buf.terminations[j], buf.truncations[j] = 0.0, False, True
                self._autoreset[j] = True  # as after any truncation
            else:
                self._autoreset[j] = False
        self._write_observations("restart", events)
        return events

    def call(self, request: CallRequest) -> list[Any]:
        """gymnasium's ``SyncVectorEnv.call`` on each env: call the attribute if callable.

        With ``request.function``, call that function with the env as first argument instead.
        """
        results = []
        function = None if request.function is None else cloudpickle.loads(request.function)
        for j, env in enumerate(self.envs):
            try:
                if function is not None:
                    results.append(function(env, *request.args, **request.kwargs))
                    continue
                attr = env.get_wrapper_attr(request.name)
                results.append(attr(*request.args, **request.kwargs) if callable(attr) else attr)
            except Exception as exc:
                raise EnvFailure(self.start + j, f"call({request.name!r})") from exc
        return results

    def set_attr(self, request: SetAttrRequest) -> None:
        """``env.set_wrapper_attr(name, value)`` on each env with its own value."""
        for j, (env, value) in enumerate(zip(self.envs, request.values, strict=True)):
            try:
                env.set_wrapper_attr(request.name, value)
            except Exception as exc:
                raise EnvFailure(self.start + j, f"set_attr({request.name!r})") from exc

    def render(self) -> list[Any]:
        """``env.render()`` of each env."""
        frames = []
        for j, env in enumerate(self.envs):
            try:
                frames.append(env.render())
            except Exception as exc:
                raise EnvFailure(self.start + j, "render") from exc
        return frames

    def close(self) -> None:
        """Close every env; an env that raises while closing does not stop the others."""
        if self._stepping is not None:
            self._stepping.close()
            self._stepping = None
            self._quiet = _NEVER
        for env in self.envs:
            try:
                env.close()
            except Exception:  # closing must reach every env
                logger.warning("a sub-environment raised in close()", exc_info=True)
        self.envs = []
