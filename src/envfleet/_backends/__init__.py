"""Transports: move "run envs [a, b)" to where the EnvGroups live and bring completion back."""

from envfleet._backends.base import Backend, WorkerLayout, worker_ranges

__all__ = ["Backend", "WorkerLayout", "worker_ranges"]
