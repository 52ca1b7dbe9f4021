"""Transports: move "run envs [a, b)" to where the EnvGroups live and bring completion back.

Each backend is one module that registers itself in :mod:`envfleet._backends.registry`.
"""

from envfleet._backends.base import Backend, WorkerLayout, worker_ranges
from envfleet._backends.registry import BACKENDS, BackendSpec, lookup, register

__all__ = [
    "BACKENDS",
    "Backend",
    "BackendSpec",
    "WorkerLayout",
    "lookup",
    "register",
    "worker_ranges",
]
