"""Checks of a vector env's call arguments, before anything is sent to a worker: actions
against the action space, seeds, reset masks, env ids and attribute names. Each raises the
front's typed error (:class:`~envfleet.InvalidActionError`,
:class:`~envfleet.InvalidArgumentError`) and changes nothing."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import gymnasium
import numpy as np

from envfleet._core.errors import InvalidActionError, InvalidArgumentError

__all__ = [
    "check_actions",
    "check_gymnasium_ids",
    "check_name",
    "check_reset_mask",
    "is_seed",
    "seeds_per_env",
]


def check_name(name: Any) -> None:
    """An attribute or method name for call/get_attr/set_attr: a ``str``, else
    :class:`InvalidArgumentError` before anything is sent."""
    if not isinstance(name, str):
        raise InvalidArgumentError(
            f"the attribute or method name must be a str, got {type(name).__name__}: {name!r}"
        )


def is_seed(seed: Any) -> bool:
    """An int >= 0 (numpy's too, not a bool): what gymnasium's ``np_random`` accepts."""
    return isinstance(seed, (int, np.integer)) and not isinstance(seed, bool) and bool(seed >= 0)


def seeds_per_env(seed: int | Sequence[int | None] | None, num_envs: int) -> list[int | None]:
    """One seed per env, checked as gymnasium's ``np_random`` checks each (an int >= 0, or
    ``None``) before anything is sent: a bad one raises :class:`InvalidArgumentError`."""
    if seed is None:
        return [None] * num_envs
    if is_seed(seed):
        return [int(cast(int, seed)) + i for i in range(num_envs)]
    if not isinstance(seed, Sequence) or isinstance(seed, str):
        raise InvalidArgumentError(
            f"seed must be None, an int >= 0 or a list of seeds, got {seed!r}"
        )
    if len(seed) != num_envs:
        raise InvalidArgumentError(
            f"If seeds are passed as a list the length must match num_envs={num_envs} "
            f"but got length={len(seed)}."
        )
    bad = [i for i, s in enumerate(seed) if s is not None and not is_seed(s)]
    if bad:
        raise InvalidArgumentError(
            f"seeds of sub-environments {bad} are not None or an int >= 0: "
            f"{[seed[i] for i in bad]!r}"
        )
    return [None if s is None else int(s) for s in seed]


def check_reset_mask(mask: Any, num_envs: int) -> np.ndarray:
    """A copy of ``options["reset_mask"]``: a ``bool[num_envs]`` ndarray with a True (gymnasium's
    checks and words)."""
    if not isinstance(mask, np.ndarray):
        raise InvalidArgumentError(
            f"`options['reset_mask']` must be a numpy array, got {type(mask)}"
        )
    if mask.shape != (num_envs,):
        raise InvalidArgumentError(
            f"`options['reset_mask']` must have shape `({num_envs},)`, got {mask.shape}"
        )
    if mask.dtype != np.bool_:
        raise InvalidArgumentError(
            f"`options['reset_mask']` must have `dtype=np.bool_`, got {mask.dtype}"
        )
    if not mask.any():
        raise InvalidArgumentError(
            "`options['reset_mask']` must contain a boolean array with at least one True "
            f"value, got reset_mask={mask}"
        )
    return mask.copy()


def check_gymnasium_ids(env_ids: Any, num_envs: int) -> np.ndarray:
    """``env_ids`` as an ``intp`` array of distinct env indices (``None``: every env)."""
    if env_ids is None:
        return np.arange(num_envs)
    ids = np.asarray(env_ids)
    if ids.ndim == 0:
        ids = ids.reshape(1)
    # dtype.kind "iu": np.issubdtype(dtype, np.integer), without its Python calls
    if ids.ndim != 1 or not (ids.size == 0 or ids.dtype.kind in "iu"):
        raise InvalidArgumentError(f"env_ids must be a 1-D sequence of integers, got {env_ids!r}")
    if ids.size == 0:
        raise InvalidArgumentError("env_ids is empty")
    # A negative id read as unsigned is huge: one comparison bounds both ends.
    unsigned = ids.view(f"u{ids.itemsize}") if ids.dtype.kind == "i" else ids
    if np.count_nonzero(unsigned >= num_envs):
        unknown = ids[(ids < 0) | (ids >= num_envs)]
        raise InvalidArgumentError(
            f"unknown env ids {unknown.tolist()}: env ids are 0..{num_envs - 1}"
        )
    listed = ids.tolist()
    if len(set(listed)) != len(listed):  # a set: a fraction of np.unique's cost on a batch
        values, counts = np.unique(ids, return_counts=True)
        raise InvalidArgumentError(f"repeated env ids {values[counts > 1].tolist()}")
    return ids.astype(np.intp)


def check_actions(
    space: gymnasium.Space[Any],
    out: Any,
    actions: Any,
    where: str,
    leaves: list[tuple[np.ndarray | None, Any]],
    count: int = 0,
) -> None:
    """Check ``actions`` against the batched buffer ``out``; append each leaf's
    ``(buffer, value)`` to ``leaves`` in walk order (Dict keys in the space's order).

    A fixed leaf's value is the caller's array (``np.asarray``, the caller's dtype, which
    must cast to the buffer's with same-kind casting). A leaf without a fixed size (``out``
    is ``None`` there, see buffers.side_leaves) takes any sequence of one value per env
    (what gymnasium's batched action space holds, a tuple) of length ``count``; its entry
    is ``(None, tuple(values))``.
    """
    if isinstance(space, gymnasium.spaces.Dict):
        if not isinstance(actions, dict) or set(actions) != set(space.spaces):
            got = sorted(actions) if isinstance(actions, dict) else type(actions).__name__
            raise InvalidActionError(
                f"{where}: expected a dict with keys {sorted(space.spaces)}, got {got}"
            )
        for key, sub in space.spaces.items():
            check_actions(sub, out[key], actions[key], f"{where}[{key!r}]", leaves, count)
        return
    if isinstance(space, gymnasium.spaces.Tuple):
        if not isinstance(actions, tuple) or len(actions) != len(space.spaces):
            raise InvalidActionError(
                f"{where}: expected a tuple of {len(space.spaces)} batched actions"
            )
        for k, sub in enumerate(space.spaces):
            check_actions(sub, out[k], actions[k], f"{where}[{k}]", leaves, count)
        return
    if out is None:  # a leaf without a fixed size: one value per env, any sequence
        if isinstance(actions, (str, bytes, dict)) or not hasattr(actions, "__len__"):
            raise InvalidActionError(
                f"{where}: expected a sequence of {count} actions (one per env), "
                f"got {type(actions).__name__}"
            )
        if len(actions) != count:
            raise InvalidActionError(
                f"{where}: expected {count} actions (one per env), got {len(actions)}"
            )
        leaves.append((None, tuple(actions)))
        return
    try:
        value = np.asarray(actions)
    except Exception as exc:
        raise InvalidActionError(f"{where}: cannot convert to an array ({exc})") from exc
    if value.shape != out.shape:
        raise InvalidActionError(f"{where}: expected shape {out.shape}, got {value.shape}")
    if not np.can_cast(value.dtype, out.dtype, casting="same_kind"):
        raise InvalidActionError(
            f"{where}: dtype {value.dtype} cannot be converted to the action space's {out.dtype}"
        )
    leaves.append((out, value))
