"""Rollout data for the Sampler (layer 4 in docs/architecture.md): :class:`EpisodeBatch` and the
recorder that cuts steps into segments.

A *segment* is a run of consecutive steps of one sub-environment, chosen by one policy
version. It ends where its episode ends (``terminated`` or ``truncated`` at its last step), where
the policy version changes, or where a sample stops. The layout follows garage's
``EpisodeBatch``: step data concatenated over segments, plus per-segment fields and lengths.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np

from envfleet._core.infos import split_infos
from envfleet._core.trees import tree_concat, tree_map, tree_rows, tree_scatter

__all__ = [
    "EpisodeBatch",
    "Recorder",
    "StepLog",
    "as_batched",
    "final_observations",
    "step_infos",
]


# -- infos -----------------------------------------------------------------------------------

_SKIP_INFO = ("final_obs", "final_info", "env_id")


def step_infos(info: dict[str, Any], rows: np.ndarray, done: np.ndarray) -> list[dict[str, Any]]:
    """Per row ``k`` of a vector info (env ``rows[k]``), the info of the step itself
    (:func:`envfleet._core.infos.split_infos`).

    With ``AutoresetMode.SAME_STEP``, an env whose episode ended reports its step's info under
    ``final_info`` (the rest is its reset info): that is what is returned for it.
    """
    n = len(rows)
    own = any(key not in _SKIP_INFO and not key.startswith("_") for key in info)
    final = info.get("final_info")
    if not own and not final:
        return [{} for _ in range(n)]
    # An ended episode's step info is in final_info even when no env has another key (every
    # env ended, and their resets returned empty infos).
    out = split_infos(info, n, _SKIP_INFO) if own else [{} for _ in range(n)]
    if final is not None and done.any():
        finals = split_infos(final, n)
        for k in np.flatnonzero(done).tolist():
            out[k] = finals[k]
    return out


# gymnasium's VectorEnv._add_info batches a Python int, float or bool into an array of that
# type: split back into rows, each is the numpy scalar of that array.
_BATCHED_SCALARS: dict[type, Callable[[Any], Any]] = {
    int: np.dtype(int).type,
    float: np.float64,
    bool: np.bool_,
}


def as_batched(info: dict[str, Any], skip: tuple[str, ...] = ()) -> dict[str, Any]:
    """One env's ``info`` as :func:`step_infos` hands it back after gymnasium batched it into
    a vector info (``VectorEnv._add_info``) with the infos of the other envs of the step: a
    Python ``int``, ``float`` or ``bool`` becomes the numpy scalar of the array it went into,
    an array a copy, a dict the same recursively; other values (numpy scalars, objects) are
    kept. Keys in ``skip`` are left out. Where the envs of a step return values of different
    types under one key, gymnasium casts them all to the first env's type; this keeps each
    env's own."""
    out: dict[str, Any] = {}
    for key, value in info.items():
        if key in skip:
            continue
        convert = _BATCHED_SCALARS.get(type(value))
        if convert is not None:
            out[key] = convert(value)
        elif isinstance(value, dict):
            out[key] = as_batched(value)
        elif isinstance(value, np.ndarray):
            out[key] = value.copy()
        else:
            out[key] = value
    return out


def final_observations(
    next_obs: Any, info: dict[str, Any], done: np.ndarray, owned: bool = False
) -> Any:
    """The observations after a step: ``next_obs``, with ``info["final_obs"]`` (SAME_STEP
    autoreset) in the rows whose episode ended. Returns new arrays, or ``next_obs`` itself
    when it is ``owned`` (the caller's, never written to again) and no episode ended."""
    if owned and not done.any():
        return next_obs
    out = tree_map(np.array, next_obs)
    if not done.any():
        return out
    final = info["final_obs"]
    rows = np.flatnonzero(done).tolist()
    if isinstance(final, dict) or (isinstance(final, np.ndarray) and final.dtype != object):

        def put(target: np.ndarray, source: np.ndarray) -> None:
            target[rows] = source[rows]

        tree_map(put, out, final)
    else:  # e.g. Tuple spaces: an object array of per-env observations
        for r in rows:
            tree_scatter(out, r, final[r])
    return out


# -- the batch -------------------------------------------------------------------------------


@dataclass
class EpisodeBatch:
    """Segments of experience, concatenated (garage's ``EpisodeBatch`` layout).

    With ``T`` steps in ``S`` segments, the segments one after the other:

    Attributes:
        observations: ``[T, *obs_shape]`` per leaf of the observation space: the observation
            each action was chosen on.
        actions: ``[T, *act_shape]`` per leaf of the action space.
        rewards: ``float64[T]``.
        terminated: ``bool[T]``; ``truncated``: ``bool[T]``. Only a segment's last step can be
            True in either.
        last_observations: ``[S, *obs_shape]``: the observation after each segment's last step
            (the episode's final observation when it ended there).
        env_index: ``int64[S]``, the sub-environment of each segment.
        policy_version: ``int64[S]``, the version of the policy that chose its actions.
        lengths: ``int64[S]``, steps per segment (each >= 1).
        agent_infos: what the policy returned besides the actions, ``[T, ...]`` per key.
        env_infos: ``T`` dicts, each step's own info from its env.
        agent_index: ``int64[S]``, the agent of each segment (its index in
            ``possible_agents``) when the env is multi-agent (a PettingZoo env: each segment is
            one agent's, see :class:`envfleet.Sampler`); ``None`` for a single-agent env.
    """

    observations: Any
    actions: Any
    rewards: np.ndarray
    terminated: np.ndarray
    truncated: np.ndarray
    last_observations: Any
    env_index: np.ndarray
    policy_version: np.ndarray
    lengths: np.ndarray
    agent_infos: dict[str, np.ndarray] = field(default_factory=dict)
    env_infos: list[dict[str, Any]] = field(default_factory=list)
    agent_index: np.ndarray | None = None

    @property
    def num_steps(self) -> int:
        """``T``, the number of steps (transitions)."""
        return int(self.rewards.shape[0])

    @property
    def num_segments(self) -> int:
        """``S``, the number of segments."""
        return int(self.lengths.shape[0])

    def __len__(self) -> int:
        return self.num_steps

    @property
    def starts(self) -> np.ndarray:
        """``int64[S]``: index of each segment's first step."""
        return np.concatenate(([0], np.cumsum(self.lengths)[:-1])).astype(np.int64)

    @property
    def complete(self) -> np.ndarray:
        """``bool[S]``: whether each segment ends its episode (terminated or truncated)."""
        if self.num_segments == 0:
            return np.zeros(0, dtype=np.bool_)
        last = self.starts + self.lengths - 1
        return self.terminated[last] | self.truncated[last]

    @property
    def next_observations(self) -> Any:
        """``[T, *obs_shape]``: the observation after each step (a new array)."""
        last = self.starts + self.lengths - 1
        following = np.arange(1, self.num_steps + 1)
        following[last] = -1

        def shift(obs: np.ndarray, last_obs: np.ndarray) -> np.ndarray:
            out = np.empty_like(obs)
            inner = following >= 0
            out[inner] = obs[following[inner]]
            out[last] = last_obs
            return out

        return tree_map(shift, self.observations, self.last_observations)

    def select(self, segments: Any) -> EpisodeBatch:
        """A batch of the segments ``segments`` (a bool mask or indices over ``S``), in order."""
        index = np.arange(self.num_segments)[segments]
        starts, lengths = self.starts[index], self.lengths[index]
        rows = (
            np.concatenate([np.arange(s, s + n) for s, n in zip(starts, lengths, strict=True)])
            if len(index)
            else np.zeros(0, dtype=np.int64)
        )
        return EpisodeBatch(
            observations=tree_rows(self.observations, rows),
            actions=tree_rows(self.actions, rows),
            rewards=self.rewards[rows],
            terminated=self.terminated[rows],
            truncated=self.truncated[rows],
            last_observations=tree_rows(self.last_observations, index),
            env_index=self.env_index[index],
            policy_version=self.policy_version[index],
            lengths=lengths.copy(),
            agent_infos={key: value[rows] for key, value in self.agent_infos.items()},
            env_infos=[self.env_infos[r] for r in rows.tolist()],
            agent_index=None if self.agent_index is None else self.agent_index[index],
        )

    def split(self) -> list[EpisodeBatch]:
        """One batch per segment: per episode, where segments hold whole episodes (as
        :meth:`Sampler.sample_episodes` returns them), else per piece of an episode."""
        return [self.select([s]) for s in range(self.num_segments)]

    @staticmethod
    def concatenate(*batches: EpisodeBatch) -> EpisodeBatch:
        """The segments of ``batches``, one batch after the other (garage's
        ``EpisodeBatch.concatenate``).

        Raises:
            ValueError: no batch given, agent_infos with different keys, or multi-agent
                batches mixed with single-agent ones.
        """
        if not batches:
            raise ValueError("concatenate() needs at least one EpisodeBatch")
        keys = set(batches[0].agent_infos)
        if any(set(b.agent_infos) != keys for b in batches):
            raise ValueError("the batches' agent_infos have different keys")
        multi_agent = {b.agent_index is not None for b in batches}
        if len(multi_agent) > 1:
            raise ValueError("multi-agent batches (agent_index) mixed with single-agent ones")
        return EpisodeBatch(
            observations=tree_concat([b.observations for b in batches]),
            actions=tree_concat([b.actions for b in batches]),
            rewards=np.concatenate([b.rewards for b in batches]),
            terminated=np.concatenate([b.terminated for b in batches]),
            truncated=np.concatenate([b.truncated for b in batches]),
            last_observations=tree_concat([b.last_observations for b in batches]),
            env_index=np.concatenate([b.env_index for b in batches]),
            policy_version=np.concatenate([b.policy_version for b in batches]),
            lengths=np.concatenate([b.lengths for b in batches]),
            agent_infos={
                key: np.concatenate([b.agent_infos[key] for b in batches]) for key in keys
            },
            env_infos=[info for b in batches for info in b.env_infos],
            agent_index=(
                np.concatenate([cast(np.ndarray, b.agent_index) for b in batches])
                if multi_agent == {True}
                else None
            ),
        )

    def __repr__(self) -> str:
        return (
            f"EpisodeBatch(num_steps={self.num_steps}, num_segments={self.num_segments}, "
            f"complete={int(self.complete.sum())}, "
            f"policy_versions={sorted(set(self.policy_version.tolist()))})"
        )


# -- the recorder ----------------------------------------------------------------------------


@dataclass
class _Chunk:
    env_ids: np.ndarray
    observations: Any
    actions: Any
    rewards: np.ndarray
    terminated: np.ndarray
    truncated: np.ndarray
    next_observations: Any
    versions: np.ndarray | int  # an int: every row's
    agent_infos: dict[str, np.ndarray]
    env_infos: list[dict[str, Any]]


class Recorder:
    """Collects steps of many envs, in any order of envs, and cuts them into segments.

    Each :meth:`add` takes one step of some envs (rows). :meth:`build` groups the rows by env,
    in the order they were added, and cuts a segment after a step that ended an episode, where
    the policy version changes, and at the end; the segments come ordered by env index.
    """

    def __init__(self) -> None:
        self._chunks: list[_Chunk] = []
        self.num_rows = 0

    def add(
        self,
        env_ids: np.ndarray,
        observations: Any,
        actions: Any,
        rewards: np.ndarray,
        terminated: np.ndarray,
        truncated: np.ndarray,
        next_observations: Any,
        versions: np.ndarray | int,
        agent_infos: dict[str, np.ndarray],
        env_infos: list[dict[str, Any]],
        owned: bool = False,
    ) -> None:
        """Record one step of envs ``env_ids`` (``versions``: per row, or one int for every
        row). Arrays are copied, except ``env_ids`` (never written to again by the callers),
        and the observations and next observations when they are ``owned`` (the caller's,
        never written to again: large image observations are then not copied once more per
        step)."""
        keep = np.asarray if owned else np.array
        self._chunks.append(
            _Chunk(
                np.asarray(env_ids, dtype=np.int64),
                tree_map(keep, observations),
                tree_map(np.array, actions),
                np.array(rewards, dtype=np.float64),
                np.array(terminated, dtype=np.bool_),
                np.array(truncated, dtype=np.bool_),
                tree_map(keep, next_observations),
                versions if isinstance(versions, int) else np.array(versions, dtype=np.int64),
                {key: np.array(value) for key, value in agent_infos.items()},
                list(env_infos),
            )
        )
        self.num_rows += len(env_ids)

    def build(self) -> EpisodeBatch | None:
        """The recorded steps as an :class:`EpisodeBatch` (``None`` if there are none); the
        recorder is empty afterwards."""
        chunks, self._chunks, self.num_rows = self._chunks, [], 0
        if not chunks:
            return None
        env_ids = np.concatenate([c.env_ids for c in chunks])
        order = np.argsort(env_ids, kind="stable")  # by env, each env's rows in time order
        env_ids = env_ids[order]
        versions = np.concatenate(
            [
                np.full(len(c.env_ids), c.versions, np.int64)
                if isinstance(c.versions, int)
                else c.versions
                for c in chunks
            ]
        )[order]
        terminated = np.concatenate([c.terminated for c in chunks])[order]
        truncated = np.concatenate([c.truncated for c in chunks])[order]
        n = len(env_ids)
        ends = terminated | truncated
        ends[-1] = True
        ends[:-1] |= (env_ids[1:] != env_ids[:-1]) | (versions[1:] != versions[:-1])
        last = np.flatnonzero(ends)
        lengths = np.diff(np.concatenate(([-1], last)))
        keys = set(chunks[0].agent_infos)
        env_infos = [info for c in chunks for info in c.env_infos]
        return EpisodeBatch(
            observations=tree_rows(tree_concat([c.observations for c in chunks]), order),
            actions=tree_rows(tree_concat([c.actions for c in chunks]), order),
            rewards=np.concatenate([c.rewards for c in chunks])[order],
            terminated=terminated,
            truncated=truncated,
            last_observations=tree_rows(
                tree_rows(tree_concat([c.next_observations for c in chunks]), order), last
            ),
            env_index=env_ids[last],
            policy_version=versions[last],
            lengths=lengths.astype(np.int64),
            agent_infos={
                key: np.concatenate([c.agent_infos[key] for c in chunks])[order] for key in keys
            },
            env_infos=[env_infos[r] for r in order.tolist()] if n else [],
        )


class StepLog:
    """Steps of one fixed set of envs stepped together, as the Sampler's synchronous loops
    step them (a worker's round of worker inference, driver inference on a vector env that is
    not a pool): the cheap recorder of those loops.

    :meth:`add` keeps each step's arrays as they come (a list append per field, no per-step
    layout); :meth:`build` lays them out once, env by env, with one concatenation per leaf, and
    cuts the same segments as :class:`Recorder` (after a step that ended an episode, where the
    policy version changes, and at the end), ordered as ``env_ids``.

    Args:
        env_ids: ``int64[K]``, the envs of every step's rows, increasing.
    """

    def __init__(self, env_ids: np.ndarray):
        self.env_ids = np.asarray(env_ids, dtype=np.int64)
        self._clear()

    def _clear(self) -> None:
        self._obs: list[Any] = []
        self._actions: list[Any] = []
        self._rewards: list[np.ndarray] = []
        self._terminated: list[np.ndarray] = []
        self._truncated: list[np.ndarray] = []
        self._versions: list[int] = []
        self._agent_infos: list[dict[str, np.ndarray]] = []
        # Per step that ended an episode: the observations after it, the final observation
        # in the rows whose episode ended (final_observations).
        self._finals: dict[int, Any] = {}
        self._infos: dict[int, list[dict[str, Any]]] = {}  # per step with infos: one per row
        self._after: Any = None  # the observations after the last step

    @property
    def num_steps(self) -> int:
        """Steps recorded (each of every env)."""
        return len(self._rewards)

    def add(
        self,
        observations: Any,
        actions: Any,
        rewards: np.ndarray,
        terminated: np.ndarray,
        truncated: np.ndarray,
        after: Any,
        version: int,
        agent_infos: dict[str, np.ndarray],
        info: dict[str, Any],
        done: np.ndarray,
    ) -> None:
        """Record one step of every env: ``observations`` the actions were chosen on and
        ``after`` the step (``AutoresetMode.SAME_STEP``: a reset's where an episode ended),
        both the caller's and never written to again; ``info`` the step's vector info
        (gymnasium's convention, ``final_obs``/``final_info`` where ``done``). The actions,
        agent infos, rewards and flags are copied."""
        t = self._append(
            observations, actions, rewards, terminated, truncated, after, version, agent_infos
        )
        if info:  # empty on most steps: no episode ended and the envs returned no info
            if "final_obs" in info:
                self._finals[t] = final_observations(after, info, done)
            infos = step_infos(info, self.env_ids, done)
            if any(infos):
                self._infos[t] = infos

    def add_events(
        self,
        observations: Any,
        actions: Any,
        rewards: np.ndarray,
        terminated: np.ndarray,
        truncated: np.ndarray,
        after: Any,
        version: int,
        agent_infos: dict[str, np.ndarray],
        events: list[tuple[int, dict[str, Any]]],
        done: np.ndarray,
    ) -> None:
        """:meth:`add` for a step whose infos come as the envs returned them, not batched:
        ``events``, ``(row, info)`` in row order, as an ``EnvGroup`` step with
        ``AutoresetMode.SAME_STEP`` returns them (rows counted from 0), where a row whose
        episode ended has first ``{"final_obs", "final_info"}`` and then its reset's info.
        The record is the one :meth:`add` makes of the same step's vector info (each info
        :func:`as_batched`), without building that info and splitting it again."""
        t = self._append(
            observations, actions, rewards, terminated, truncated, after, version, agent_infos
        )
        if not events:
            return
        finals: Any = None
        infos: list[dict[str, Any]] | None = None
        last = -1  # the row of the event before: a row's later events are its reset's infos
        for row, info in events:
            if row == last:
                continue
            last = row
            if done[row]:  # its first event: the episode's end
                if finals is None:
                    finals = tree_map(np.array, after)
                tree_scatter(finals, row, info["final_obs"])
                own = as_batched(info["final_info"])
            else:
                own = as_batched(info, _SKIP_INFO)
            if own:
                if infos is None:
                    infos = [{} for _ in range(len(self.env_ids))]
                infos[row] = own
        if finals is not None:
            self._finals[t] = finals
        if infos is not None:
            self._infos[t] = infos

    def _append(
        self,
        observations: Any,
        actions: Any,
        rewards: np.ndarray,
        terminated: np.ndarray,
        truncated: np.ndarray,
        after: Any,
        version: int,
        agent_infos: dict[str, np.ndarray],
    ) -> int:
        """Keep a step's observations (as they are), actions, rewards, flags and agent infos
        (copied) and version; returns its index."""
        t = len(self._rewards)
        self._obs.append(observations)
        self._actions.append(
            actions.copy() if type(actions) is np.ndarray else tree_map(np.array, actions)
        )
        self._rewards.append(np.array(rewards, dtype=np.float64))
        self._terminated.append(np.array(terminated, dtype=np.bool_))
        self._truncated.append(np.array(truncated, dtype=np.bool_))
        self._versions.append(version)
        self._agent_infos.append({key: np.array(value) for key, value in agent_infos.items()})
        self._after = after
        return t

    def build(self) -> EpisodeBatch | None:
        """The recorded steps as an :class:`EpisodeBatch` (``None`` if there are none); the
        log is empty afterwards."""
        steps, k = len(self._rewards), len(self.env_ids)
        if not steps:
            return None

        def by_env(*leaves: np.ndarray) -> np.ndarray:
            # [K, steps, ...]: each env's rows in time order, the envs one after the other
            # (one concatenate and one transposing copy: faster than np.stack(axis=1), see
            # benchmarks/README.md)
            joined = np.concatenate(leaves)
            inner = joined.shape[1:]
            return joined.reshape(steps, k, *inner).swapaxes(0, 1).reshape(k * steps, *inner)

        terminated, truncated = by_env(*self._terminated), by_env(*self._truncated)
        done = terminated | truncated
        versions = np.array(self._versions, dtype=np.int64)
        ends = done.reshape(k, steps).copy()
        ends[:, -1] = True
        ends[:, :-1] |= (versions[1:] != versions[:-1])[None, :]
        last = np.flatnonzero(ends)
        env_of, step_of = np.divmod(last, steps)
        last_obs = tree_map(
            lambda leaf: np.empty((len(last), *leaf.shape[1:]), leaf.dtype), self._obs[0]
        )
        for s, (j, t) in enumerate(zip(env_of.tolist(), step_of.tolist(), strict=True)):
            source = self._finals.get(t) if done[last[s]] else None
            if source is None:
                source = self._obs[t + 1] if t + 1 < steps else self._after

            def put(out: np.ndarray, leaf: np.ndarray, s: int = s, j: int = j) -> None:
                out[s] = leaf[j]

            tree_map(put, last_obs, source)
        if self._infos:
            env_infos = [
                self._infos[t][j] if t in self._infos else {}
                for j in range(k)
                for t in range(steps)
            ]
        else:
            env_infos = [{} for _ in range(k * steps)]
        keys = list(self._agent_infos[0])
        batch = EpisodeBatch(
            observations=tree_map(by_env, *self._obs),
            actions=tree_map(by_env, *self._actions),
            rewards=by_env(*self._rewards),
            terminated=terminated,
            truncated=truncated,
            last_observations=last_obs,
            env_index=self.env_ids[env_of],
            policy_version=versions[step_of],
            lengths=np.diff(np.concatenate(([-1], last))).astype(np.int64),
            agent_infos={key: by_env(*(a[key] for a in self._agent_infos)) for key in keys},
            env_infos=env_infos,
        )
        self._clear()
        return batch
