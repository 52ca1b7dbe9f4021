"""The peers of ``envfleet bench``: the vector envs of other libraries, built and stepped the
way :mod:`envfleet.bench._core` measures every system (see :mod:`envfleet.bench`).

Each peer's library is imported only when that peer is built; :func:`peer_unavailable` says,
without building anything, why a peer cannot run here (not installed, with the command that
installs it, or not one of EnvPool's native tasks).
"""

from __future__ import annotations

import functools
import importlib.util
import multiprocessing
import warnings
from collections.abc import Callable
from typing import Any

import gymnasium
import numpy as np
from gymnasium.vector.utils import batch_space

from envfleet import check_gymnasium_id, usable_cores

__all__ = [
    "EnvPoolVector",
    "PEERS",
    "PEER_INSTALL",
    "PEER_PACKAGES",
    "Stepper",
    "action_bank",
    "build_peer",
    "envpool_task",
    "puffer_workers",
    "make_gym_env",
    "peer_unavailable",
]

#: The other libraries' vector envs that ``envfleet bench`` measures, in the order of its table.
PEERS: tuple[str, ...] = ("gym-sync", "gym-async", "sb3-subproc", "envpool-native", "puffer-mp")
#: The module each optional peer imports (gymnasium's own are always there).
PEER_PACKAGES: dict[str, str] = {
    "sb3-subproc": "stable_baselines3",
    "envpool-native": "envpool",
    "puffer-mp": "pufferlib",
}
#: What to install for PufferLib (its core, beside the torch already installed).
PUFFER_INSTALL = "pip install pufferlib-core --no-deps"
#: What to install for each optional peer.
PEER_INSTALL: dict[str, str] = {
    "sb3-subproc": "pip install 'envfleet[sb3]'",
    "envpool-native": "pip install 'envfleet[envpool]'",
    "puffer-mp": PUFFER_INSTALL,
}
_LIBRARY = {
    "sb3-subproc": "stable-baselines3's SubprocVecEnv",
    "envpool-native": "EnvPool",
    "puffer-mp": "PufferLib's Multiprocessing vector env",
}
# EnvPool's Atari tasks preprocess by default (84x84 grayscale, 4 stacked frames, no-op
# starts, fire reset, no sticky actions); these settings make them do the work of gymnasium's
# ALE/...-v5 instead: raw 210x160 RGB frames, frameskip 4, sticky actions 0.25. EnvPool still
# max-pools the last two frames and returns them channel-first.
_ALE_V5 = {
    "img_height": 210,
    "img_width": 160,
    "gray_scale": False,
    "stack_num": 1,
    "frame_skip": 4,
    "noop_max": 1,
    "use_fire_reset": False,
    "episodic_life": False,
    "reward_clip": False,
    "repeat_action_probability": 0.25,
}


class Stepper:
    """A vector env reduced to what the timed loop needs, whatever its library.

    Attributes:
        single_action_space: one env's action space (the action bank is drawn from its
            batched space).
        step: steps every env with a batch of actions (the library's own bound method, so
            that the timed loop pays no extra call).
        reset: resets every env, env i seeded with the build's ``seed + i``.
        close: ``close(terminate)``; ``terminate`` asks for a forced shutdown where the
            library has one.
        action_dtype: the dtype the library wants its actions in, or ``None`` (as drawn).
    """

    def __init__(
        self,
        single_action_space: gymnasium.Space[Any],
        step: Callable[[Any], Any],
        reset: Callable[[], Any],
        close: Callable[[bool], Any],
        action_dtype: Any = None,
    ):
        self.single_action_space = single_action_space
        self.step = step
        self.reset = reset
        self.close = close
        self.action_dtype = action_dtype


def make_gym_env(env_id: str) -> gymnasium.Env[Any, Any]:
    """``gymnasium.make(env_id)`` after registering the id's namespace (ALE) in this process,
    which may be a freshly started worker; picklable through :func:`functools.partial`."""
    check_gymnasium_id(env_id)  # imports what registers it (ALE, "module:EnvId")
    return gymnasium.make(env_id)


def action_bank(
    single_space: gymnasium.Space[Any], num_envs: int, seed: int, size: int, dtype: Any = None
) -> list[Any]:
    """``size`` batched actions drawn from ``batch_space(single_space, num_envs)`` seeded with
    ``seed`` (the same bank as a gymnasium vector env's ``action_space`` gives), as ``dtype``
    arrays when given."""
    space = batch_space(single_space, num_envs)
    space.seed(seed)
    bank = [space.sample() for _ in range(size)]
    if dtype is not None:
        bank = [np.asarray(a, dtype=dtype) for a in bank]
    return bank


def puffer_workers(num_envs: int) -> int:
    """Workers for PufferLib's ``Multiprocessing`` over ``num_envs`` envs, as ``puffer-mp``
    runs it: the most that divide ``num_envs`` (PufferLib requires it) and leave one usable
    core to its driver, which spins while it waits for them (at least 1).

    Example::

        puffer_workers(8)  # 1 on 2 usable cores, 2 on 3, 4 on 5
    """
    cores = max(1, usable_cores() - 1)
    return max(w for w in range(1, min(num_envs, cores) + 1) if num_envs % w == 0)


def envpool_task(env_id: str) -> tuple[str, dict[str, Any]] | None:
    """EnvPool's native task for a gymnasium id, with the settings that make it do the same
    work (``ALE/Pong-v5`` -> ``("Pong-v5", {...raw RGB frames, sticky actions...})``), or
    ``None`` when EnvPool has no such task or is not installed."""
    if importlib.util.find_spec("envpool") is None:
        return None
    import envpool

    tasks = set(envpool.list_all_envs())
    if env_id.startswith("ALE/"):
        name = env_id[4:]
        if name.endswith("-v5") and name in tasks:
            return name, dict(_ALE_V5)
        return None
    return (env_id, {}) if env_id in tasks else None


class EnvPoolVector:
    """EnvPool's own gymnasium API (``envpool.make_gymnasium``, ``num_threads`` capped at the
    usable cores, seeded at ``make``) as a loop calls a vector env: ``reset(seed=...)`` (the
    seed was EnvPool's at ``make``), ``step``, ``close``; gymnasium's warnings about EnvPool's
    float64 Box bounds (its spaces are built lazily) silenced. EnvPool autoresets an env in
    the step after its episode ended, as gymnasium's ``NEXT_STEP``.

    Args:
        task: ``(task id, envpool.make options)``, e.g. :func:`envpool_task`'s.
        num_envs: envs in the pool.
        seed: EnvPool's seed.

    Example::

        pool = EnvPoolVector(("CartPole-v1", {}), 4, seed=0)
        obs, info = pool.reset()  # obs: float32[4, 4]
    """

    def __init__(self, task: tuple[str, dict[str, Any]], num_envs: int, seed: int):
        import envpool

        name, kwargs = task
        threads = min(num_envs, usable_cores())
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            self.pool = envpool.make_gymnasium(
                name, num_envs=num_envs, num_threads=threads, seed=seed, **kwargs
            )
            self.single_action_space = self.pool.action_space  # one env's
        self.step = self.pool.step
        self.close = self.pool.close

    def reset(self, seed: int | None = None) -> Any:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            return self.pool.reset()


def peer_unavailable(system: str, env_id: str) -> str | None:
    """Why ``system`` cannot be measured on ``env_id`` here, or ``None`` when it can.

    Example: ``peer_unavailable("puffer-mp", "CartPole-v1")`` without pufferlib returns
    ``"puffer-mp (PufferLib's Multiprocessing vector env) is not installed: pip install
    pufferlib-core --no-deps"``.
    """
    package = PEER_PACKAGES.get(system)
    if package is not None and importlib.util.find_spec(package) is None:
        return f"{system} ({_LIBRARY[system]}) is not installed: {PEER_INSTALL[system]}"
    if system == "envpool-native" and envpool_task(env_id) is None:
        return f"envpool-native: {env_id} is not one of EnvPool's native tasks"
    return None


def build_peer(system: str, env_id: str, num_envs: int, seed: int) -> Stepper:
    """Build one peer of :data:`PEERS` with ``num_envs`` copies of ``env_id``, its envs to be
    seeded with ``seed + i`` when reset.

    - ``gym-sync``, ``gym-async``: ``gymnasium.vector.SyncVectorEnv`` /
      ``AsyncVectorEnv`` (its defaults: shared memory, the platform's start method).
    - ``sb3-subproc``: ``SubprocVecEnv`` with the start method ``gym-async`` uses.
    - ``envpool-native``: ``envpool.make_gymnasium`` on the native task
      (:func:`envpool_task`), ``num_threads`` capped at the usable cores.
    - ``puffer-mp``: ``pufferlib.vector.make(..., backend=Multiprocessing)``, stepping all
      envs at once, on the largest number of workers that divides ``num_envs`` and leaves one
      of the usable cores to its driver (which spins while it waits).

    Raises:
        ImportError: the peer's library is missing (check :func:`peer_unavailable` first).
        ValueError: an unknown peer, or ``envpool-native`` on an env EnvPool does not have.
    """
    factory = functools.partial(make_gym_env, env_id)
    if system in ("gym-sync", "gym-async"):
        envs: Any
        if system == "gym-sync":
            envs = gymnasium.vector.SyncVectorEnv([factory] * num_envs)
        else:
            envs = gymnasium.vector.AsyncVectorEnv([factory] * num_envs)
        return Stepper(
            envs.single_action_space,
            envs.step,
            lambda: envs.reset(seed=seed),
            lambda terminate: envs.close(terminate=terminate),
        )
    if system == "sb3-subproc":
        from stable_baselines3.common.vec_env import SubprocVecEnv

        method = multiprocessing.get_context().get_start_method()
        venv: Any = SubprocVecEnv([factory] * num_envs, start_method=method)

        def reset_sb3() -> None:
            venv.seed(seed)
            venv.reset()

        return Stepper(venv.action_space, venv.step, reset_sb3, lambda terminate: venv.close())
    if system == "envpool-native":
        task = envpool_task(env_id)
        if task is None:
            raise ValueError(f"{env_id} is not one of EnvPool's native tasks")
        pool = EnvPoolVector(task, num_envs, seed)
        space = pool.single_action_space
        return Stepper(
            space,
            pool.step,
            pool.reset,
            lambda terminate: pool.close(),
            action_dtype=space.dtype,
        )
    if system == "puffer-mp":
        import pufferlib.emulation
        import pufferlib.vector

        workers = puffer_workers(num_envs)
        creator = functools.partial(pufferlib.emulation.GymnasiumPufferEnv, env_creator=factory)
        pvenv: Any = pufferlib.vector.make(
            creator,
            num_envs=num_envs,
            num_workers=workers,
            batch_size=num_envs,
            backend=pufferlib.vector.Multiprocessing,
            overwork=True,  # the workers are already capped at the usable cores
        )
        return Stepper(
            pvenv.single_action_space,
            pvenv.step,
            lambda: pvenv.reset(seed),
            lambda terminate: pvenv.close(),
            action_dtype=getattr(pvenv.action_space, "dtype", None),
        )
    raise ValueError(f"unknown peer {system!r}")
