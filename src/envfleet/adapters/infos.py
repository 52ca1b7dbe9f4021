"""Per-env info dicts from gymnasium's vector infos (the inverse of ``VectorEnv._add_info``).

Libraries with a per-env info convention (stable-baselines3's ``list[dict]``) need each
sub-environment's own info back from the batched ``info[key]`` / ``info["_key"]`` form:
:func:`split_infos` (envfleet's one implementation, shared with the front and the Sampler).
"""

from __future__ import annotations

from envfleet._core.infos import split_infos

__all__ = ["split_infos"]
