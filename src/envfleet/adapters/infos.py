"""Per-env info dicts from gymnasium's vector infos (the inverse of ``VectorEnv._add_info``).

Libraries with a per-env info convention (stable-baselines3's ``list[dict]``) need each
sub-environment's own info back from the batched ``info[key]`` / ``info["_key"]`` form.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["split_infos"]


def split_infos(infos: dict[str, Any], num_envs: int) -> list[dict[str, Any]]:
    """Split gymnasium vector infos into one info dict per sub-environment.

    ``info[key]`` with its mask ``info["_key"]`` gives env ``i`` the entry ``info[key][i]``
    where ``info["_key"][i]`` is True; a nested dict (gymnasium batches dict values, as
    ``final_info``, recursively) gives env ``i`` a nested dict. A key without a mask (a
    wrapper's own entry) is given to every env: row ``i`` of an array of length
    ``num_envs``, else the value itself.

    Values come back as gymnasium stored them: a Python ``int`` or ``float`` an env returned
    is then a numpy scalar (``np.int64``, ``np.float64``) of equal value.

    Args:
        infos: the infos of a ``gymnasium.vector.VectorEnv`` step or reset.
        num_envs: the number of sub-environments (rows of the batched entries).

    Returns:
        ``num_envs`` dicts, keys in the order the vector infos hold them.
    """
    out: list[dict[str, Any]] = [{} for _ in range(num_envs)]
    for key, value in infos.items():
        if key.startswith("_") and key[1:] in infos:
            continue  # the mask of infos[key[1:]]
        mask = infos.get(f"_{key}")
        if mask is None:
            for i in range(num_envs):
                row = isinstance(value, np.ndarray) and value.ndim > 0 and len(value) == num_envs
                out[i][key] = value[i] if row else value
            continue
        rows = np.flatnonzero(mask).tolist()
        if isinstance(value, dict):
            nested = split_infos(value, num_envs)
            for i in rows:
                out[i][key] = nested[i]
        else:
            for i in rows:
                out[i][key] = value[i]
    return out
