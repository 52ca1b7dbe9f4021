"""Custom gymnasium environments for the envfleet tests.

Every environment here is deterministic given its seed (all randomness comes from
``self.np_random``), and importable as ``tests.envs`` from worker processes started with any
start method ("fork", "spawn", "forkserver"): factories are pickled by reference to this module.

Factories take a keyword ``env_index``; envfleet passes each sub-environment's global index, and
the tests build the matching ``gymnasium.vector.SyncVectorEnv`` with
``functools.partial(cls, env_index=i)``.
"""

from __future__ import annotations

import builtins
import ctypes
import faulthandler
import functools
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium import spaces

__all__ = [
    "ActionDtypeEnv",
    "CrashEnv",
    "FaultSeriesEnv",
    "FlakyEnv",
    "IndexedEnv",
    "MixedObsEnv",
    "NestedSpaceEnv",
    "RaisingEnv",
    "SimpleEnv",
    "SparseInfoEnv",
    "TextObsEnv",
    "ValuesEnv",
    "WaitingEnv",
    "make_indexed",
    "make_indexed_kwonly",
    "sync_factories",
]


def sync_factories(factory: Any, num_envs: int, **kwargs: Any) -> list[Any]:
    """The factories a SyncVectorEnv needs to mirror ``envfleet.make(factory, num_envs)``."""

    def bind(i: int) -> Any:
        return lambda: factory(env_index=i, **kwargs)

    return [bind(i) for i in range(num_envs)]


class NestedSpaceEnv(gym.Env):
    """Nested Dict/Tuple observations over every fixed-size leaf; a nested Dict action.

    The observation depends on the action (``move`` and ``force``) and on ``np_random``, so a
    wrongly routed action or a wrongly seeded env shows up in the observations. Episodes end
    after a length drawn at reset (terminated) or at random when ``move == 3`` (truncated).
    """

    metadata = {"render_modes": ["rgb_array"], "render_fps": 30}

    def __init__(self, env_index: int = 0, max_len: int = 30, render_mode: str | None = None):
        self.env_index = env_index
        self.max_len = max_len
        self.render_mode = render_mode
        self.observation_space = spaces.Dict(
            {
                "box": spaces.Box(-1.0, 1.0, (2, 3), np.float32),
                "disc": spaces.Discrete(5, start=-2),
                "multi_disc": spaces.MultiDiscrete([3, 4, 2]),
                "multi_bin": spaces.MultiBinary(4),
                "tup": spaces.Tuple((spaces.Box(0.0, 1.0, (2,), np.float64), spaces.Discrete(3))),
            }
        )
        self.action_space = spaces.Dict(
            {
                "move": spaces.Discrete(4),
                "force": spaces.Box(-1.0, 1.0, (2,), np.float32),
            }
        )
        self._box = np.zeros((2, 3), np.float32)
        self._t = 0
        self._len = max_len

    def _obs(self, move: int) -> dict[str, Any]:
        rng = self.np_random
        return {
            "box": self._box.copy(),
            "disc": np.int64(move + int(rng.integers(0, 2)) - 2),
            "multi_disc": rng.integers(0, [3, 4, 2]).astype(np.int64),
            "multi_bin": rng.integers(0, 2, size=4).astype(np.int8),
            "tup": (rng.random(2), np.int64(rng.integers(0, 3))),
        }

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        self._t = 0
        self._len = int(self.np_random.integers(3, self.max_len))
        self._box = self.np_random.uniform(-0.5, 0.5, (2, 3)).astype(np.float32)
        return self._obs(0), {"episode_len": self._len}

    def step(self, action: dict[str, Any]):
        move = int(action["move"])
        force = np.asarray(action["force"], dtype=np.float32)
        self._t += 1
        noise = self.np_random.normal(0.0, 0.05, (2, 3)).astype(np.float32)
        self._box = np.clip(self._box + 0.3 * force[:, None] + noise, -1.0, 1.0).astype(np.float32)
        reward = float(force.sum()) + move + 0.5 * self.env_index
        terminated = self._t >= self._len
        truncated = move == 3 and bool(self.np_random.random() < 0.05)
        info: dict[str, Any] = {"t": self._t} if terminated else {}
        return self._obs(move), reward, terminated, truncated, info

    def render(self):
        if self.render_mode == "rgb_array":
            return np.full((4, 6, 3), self.env_index * 10 + self._t % 10, dtype=np.uint8)
        return None


class SparseInfoEnv(gym.Env):
    """Infos only on some steps; keys of many types on different envs at different steps.

    Python int, float and bool, numpy scalars (``np.int32``: a numeric array; ``np.bool_``: an
    object array), a numpy array, a nested dict, a string, and a key (``"mixed"``) that is an
    int on even envs and a float on odd envs, so the batched dtype depends on which env reports
    it first. Episodes terminate and truncate at steps drawn from ``np_random`` at reset.
    """

    def __init__(self, env_index: int = 0):
        self.env_index = env_index
        self.observation_space = spaces.Box(-10.0, 10.0, (3,), np.float32)
        self.action_space = spaces.Discrete(3)
        self._x = np.zeros(3, np.float32)
        self._t = 0
        self._term_at = self._trunc_at = 0
        self._resets = 0

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        self._t = 0
        self._resets += 1
        self._term_at = int(self.np_random.integers(2, 25))
        self._trunc_at = int(self.np_random.integers(2, 25))
        self._x = self.np_random.uniform(-1.0, 1.0, 3).astype(np.float32)
        info: dict[str, Any] = {}
        if self.env_index % 2 == 0:
            info["reset_count"] = self._resets
        if self.np_random.random() < 0.5:
            info["start"] = {"x0": self._x.copy(), "label": f"start-{self.env_index}"}
        return self._x.copy(), info

    def step(self, action: Any):
        i, t = self.env_index, self._t + 1
        self._t = t
        self._x = np.clip(
            self._x + (int(action) - 1) * 0.1 + self.np_random.normal(0.0, 0.01, 3),
            -10.0,
            10.0,
        ).astype(np.float32)
        u = float(self.np_random.random())
        info: dict[str, Any] = {}
        if (t + i) % 3 == 0:
            info["count"] = t
        if u < 0.3:
            info["ratio"] = u
        if (t * (i + 1)) % 5 == 1:
            info["flag"] = u < 0.5
        if i % 2 == 1 and t % 4 == 0:
            info["vec"] = self._x * 2
        if u > 0.8:
            info["nested"] = {"depth": i, "inner": {"val": np.float64(u), "tag": f"n{t}"}}
        if (t + 2 * i) % 7 == 0:
            info["name"] = f"env{i}-t{t}"
        if u > 0.5:
            info["mixed"] = t if i % 2 == 0 else t + 0.5
        if t % 6 == 0:
            info["np_int"] = np.int32(t * (i + 1))
        if t % 5 == 2:
            info["np_flag"] = np.bool_(u > 0.4)
        terminated = t >= self._term_at
        truncated = t >= self._trunc_at
        reward = float(self._x.sum()) + (1.0 if terminated else 0.0)
        return self._x.copy(), reward, terminated, truncated, info


class SimpleEnv(gym.Env):
    """A small Box-observation, Discrete-action env; its spaces are configurable."""

    def __init__(self, env_index: int = 0, obs_dim: int = 2, n_actions: int = 2):
        self.env_index = env_index
        self.observation_space = spaces.Box(-1.0, 1.0, (obs_dim,), np.float32)
        self.action_space = spaces.Discrete(n_actions)

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        return self._draw(), {}

    def _draw(self) -> np.ndarray:
        return self.np_random.uniform(-1.0, 1.0, self.observation_space.shape).astype(np.float32)

    def step(self, action: Any):
        return self._draw(), float(action), False, False, {}


class IndexedEnv(gym.Env):
    """Records its ``env_index`` and the pid of the process that built it.

    ``value`` is a free attribute for set_attr/get_attr; ``add`` is a method for ``call``; it
    renders a small ``rgb_array`` frame filled with ``env_index``.
    """

    metadata = {"render_modes": ["rgb_array"], "render_fps": 4}

    def __init__(self, env_index: int = -1, render_mode: str | None = None):
        self.env_index = env_index
        self.pid = os.getpid()
        self.value: Any = None
        self.render_mode = render_mode
        self.observation_space = spaces.Box(-1.0, 1.0, (2,), np.float32)
        self.action_space = spaces.Discrete(2)

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        return self.np_random.uniform(-1.0, 1.0, 2).astype(np.float32), {}

    def step(self, action: Any):
        obs = self.np_random.uniform(-1.0, 1.0, 2).astype(np.float32)
        return obs, float(self.env_index), False, False, {}

    def add(self, x: int, y: int = 0) -> int:
        return self.env_index + x + y

    def hang(self) -> None:
        time.sleep(3600)

    def render(self):
        if self.render_mode == "rgb_array":
            return np.full((5, 7, 3), self.env_index, dtype=np.uint8)
        return None


def make_indexed(env_index):
    """A plain function factory that accepts ``env_index`` positionally or by keyword."""
    return IndexedEnv(env_index=env_index)


def make_indexed_kwonly(*, env_index, render_mode=None):
    """A factory with a keyword-only ``env_index``."""
    return IndexedEnv(env_index=env_index, render_mode=render_mode)


class RaisingEnv(gym.Env):
    """Env ``fail_index`` raises ``ValueError("boom ...")``; every other env behaves.

    ``fail_in="step"``: raises in the step after ``fail_after`` steps since its last reset.
    ``fail_in="reset"``: raises in reset when ``options`` has ``"explode": True``.
    ``fail_in="init"``: raises in ``__init__``.
    Episodes never end, so the step count since reset is under the test's control.
    """

    def __init__(
        self, env_index: int = 0, fail_index: int = 0, fail_after: int = 3, fail_in: str = "step"
    ):
        self.env_index = env_index
        self.fail_index = fail_index
        self.fail_after = fail_after
        self.fail_in = fail_in
        if fail_in == "init" and env_index == fail_index:
            raise ValueError(f"boom in __init__ of env {env_index}")
        self.observation_space = spaces.Box(-1.0, 1.0, (3,), np.float32)
        self.action_space = spaces.Discrete(2)
        self._t = 0

    def _failing(self) -> bool:
        return self.env_index == self.fail_index

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        if self.fail_in == "reset" and self._failing() and (options or {}).get("explode"):
            raise ValueError(f"boom in reset of env {self.env_index}")
        self._t = 0
        return self.np_random.uniform(-1.0, 1.0, 3).astype(np.float32), {}

    def step(self, action: Any):
        self._t += 1
        if self.fail_in == "step" and self._failing() and self._t > self.fail_after:
            raise ValueError(f"boom in step {self._t} of env {self.env_index}")
        obs = self.np_random.uniform(-1.0, 1.0, 3).astype(np.float32)
        return obs, float(action) + self._t, False, False, {}


def crash_process(how: str) -> None:
    """Kill or hang this process: ``"segfault"`` (SIGSEGV to itself), ``"exit"``
    (``os._exit(3)``), ``"hang"`` (sleeps an hour) or ``"hang-ignore-term"`` (ignores SIGTERM,
    then sleeps an hour)."""
    if how == "segfault":
        faulthandler.disable()  # no "Fatal Python error" dump from a forked pytest
        os.kill(os.getpid(), signal.SIGSEGV)
        time.sleep(60)  # the signal is delivered before this returns
    elif how == "exit":
        os._exit(3)
    elif how == "hang":
        time.sleep(3600)
    elif how == "hang-ignore-term":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        time.sleep(3600)
    else:
        raise ValueError(f"unknown crash {how!r}")


class CrashEnv(gym.Env):
    """Env ``crash_index`` kills or hangs its process; every other env behaves.

    ``how``: ``"segfault"`` (SIGSEGV to itself), ``"exit"`` (``os._exit(3)``), ``"hang"``
    (sleeps an hour) or ``"hang-ignore-term"`` (ignores SIGTERM, then sleeps an hour).
    ``crash_in="step"``: in the step after ``crash_after`` steps since its last reset;
    ``crash_in="init"``: in ``__init__``; ``crash_in="close"``: in ``close``. Never use env
    index 0 with "init" or "close": the processes backend builds and closes env 0 in the driver
    to learn the spaces. Only for the processes backend.
    """

    def __init__(
        self,
        env_index: int = 0,
        crash_index: int = 1,
        crash_after: int = 3,
        how: str = "segfault",
        crash_in: str = "step",
    ):
        self.env_index = env_index
        self.crash_index = crash_index
        self.crash_after = crash_after
        self.how = how
        self.pid = os.getpid()
        self.observation_space = spaces.Box(-1.0, 1.0, (2,), np.float32)
        self.action_space = spaces.Discrete(2)
        self._t = 0
        if crash_in == "init" and env_index == crash_index:
            self._crash()
        self.crash_in = crash_in

    def _crash(self) -> None:
        crash_process(self.how)

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        self._t = 0
        return self.np_random.uniform(-1.0, 1.0, 2).astype(np.float32), {}

    def step(self, action: Any):
        self._t += 1
        crashing = self.crash_in == "step" and self.env_index == self.crash_index
        if crashing and self._t > self.crash_after:
            self._crash()
        obs = self.np_random.uniform(-1.0, 1.0, 2).astype(np.float32)
        return obs, 1.0, False, False, {}

    def close(self) -> None:
        if self.crash_in == "close" and self.env_index == self.crash_index:
            self._crash()


class TextObsEnv(gym.Env):
    """An observation space without a fixed size (Text): no shared buffer, a side channel."""

    def __init__(self):
        self.observation_space = spaces.Text(8)
        self.action_space = spaces.Discrete(2)

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        return "abc", {}

    def step(self, action: Any):
        return "abc", 0.0, False, False, {}


class FlakyEnv(gym.Env):
    """Short episodes with infos of many kinds; the envs named in ``faults`` fail on cue.

    Every env not in ``faults`` behaves exactly as ``FlakyEnv(env_index=i)`` (no faults), the
    fault-free reference of the supervisor tests. Episodes terminate and truncate at steps drawn
    at reset; step infos report an int, a float, an array, a nested dict and a string on
    different steps, each key with one type on every env (so a batched info's dtype does not
    depend on which env reports it first); reset infos report the episode count and, on some
    episodes, the first observation.

    ``faults``: ``{env_index: how}``, ``how`` one of ``"raise"`` (``ValueError("boom ...")``),
    ``"segfault"`` (SIGSEGV to itself), ``"exit"`` (``os._exit(3)``) or ``"hang"`` (sleeps an
    hour). ``fault_in``: ``"step"``: in every step() call after the first ``fault_after`` since
    the env was built (``calls`` counts them); ``"reset"``: in a reset whose ``options`` have
    ``"explode": True``; ``"render"``: in every ``render()`` (raise only).
    ``marker``: ``None``: fail every time the cue comes (a rebuilt env fails again
    ``fault_after`` steps after it was rebuilt); a path prefix: fail only once, only if the file
    ``f"{marker}-{env_index}"`` does not exist, created just before failing.
    """

    def __init__(
        self,
        env_index: int = 0,
        faults: dict[int, str] | None = None,
        fault_in: str = "step",
        fault_after: int = 3,
        marker: str | None = None,
    ):
        self.env_index = env_index
        self.how = (faults or {}).get(env_index)
        self.fault_in = fault_in
        self.fault_after = fault_after
        self.marker = marker
        self.pid = os.getpid()
        self.calls = 0
        self.observation_space = spaces.Box(-10.0, 10.0, (3,), np.float32)
        self.action_space = spaces.Discrete(3)
        self._x = np.zeros(3, np.float32)
        self._t = 0
        self._episodes = 0
        self._term_at = self._trunc_at = 0

    @property
    def readonly(self) -> int:
        """An attribute ``set_attr`` cannot set (it raises AttributeError)."""
        return self.env_index

    def explode(self) -> None:
        raise ValueError(f"boom in explode of env {self.env_index}")

    def _fault(self, where: str) -> None:
        if self.how is None or self.fault_in != where:
            return
        if self.marker is not None:
            marker = Path(f"{self.marker}-{self.env_index}")
            if marker.exists():
                return
            marker.touch()
        if self.how == "raise":
            raise ValueError(f"boom in {where} of env {self.env_index}")
        crash_process(self.how)

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        if (options or {}).get("explode"):
            self._fault("reset")
        self._t = 0
        self._episodes += 1
        self._term_at = int(self.np_random.integers(3, 12))
        self._trunc_at = int(self.np_random.integers(3, 12))
        self._x = self.np_random.uniform(-1.0, 1.0, 3).astype(np.float32)
        info: dict[str, Any] = {"episode": self._episodes}
        if self.np_random.random() < 0.5:
            info["x0"] = self._x.copy()
        return self._x.copy(), info

    def step(self, action: Any):
        self.calls += 1
        if self.calls > self.fault_after:
            self._fault("step")
        i, t = self.env_index, self._t + 1
        self._t = t
        noise = self.np_random.normal(0.0, 0.1, 3)
        self._x = np.clip(self._x + (int(action) - 1) * 0.2 + noise, -10.0, 10.0).astype(np.float32)
        u = float(self.np_random.random())
        info: dict[str, Any] = {}
        if (t + i) % 3 == 0:
            info["t"] = t
        if u < 0.3:
            info["u"] = u
        if (t + i) % 4 == 1:
            info["vec"] = self._x.astype(np.float64) * 2
        if u > 0.7:
            info["nested"] = {"depth": i, "tag": f"n{t}"}
        if (t + 2 * i) % 5 == 0:
            info["name"] = f"env{i}-t{t}"
        terminated = t >= self._term_at
        truncated = t >= self._trunc_at
        return self._x.copy(), float(self._x.sum()) + int(action), terminated, truncated, info

    def render(self):
        self._fault("render")
        return None


class MixedObsEnv(gym.Env):
    """Box((2, 3), float32) observations handed back in a different form each step.

    Exercises every way an EnvGroup may write observations: float32 arrays, float64 arrays
    (cast), nested lists, non-contiguous views, and (``bad_shape_at``) an array of the wrong
    shape, which gymnasium's SyncVectorEnv refuses. Rewards and done flags vary in type too.
    """

    FORMS = ("float32", "float64", "list", "transposed")

    def __init__(self, env_index: int = 0, bad_shape_at: int | None = None):
        self.env_index = env_index
        self.bad_shape_at = bad_shape_at
        self.observation_space = spaces.Box(-1.0, 1.0, (2, 3), np.float32)
        self.action_space = spaces.Discrete(2)
        self._t = 0

    def _obs(self) -> Any:
        value = self.np_random.uniform(-1.0, 1.0, (2, 3))
        form = self.FORMS[(self._t + self.env_index) % len(self.FORMS)]
        if self.bad_shape_at is not None and self._t == self.bad_shape_at:
            return value.reshape(3, 2).astype(np.float32)
        if form == "float32":
            return value.astype(np.float32)
        if form == "float64":
            return value
        if form == "list":
            return value.tolist()
        return np.ascontiguousarray(value.T).T  # same values, Fortran-ordered view

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        self._t = 0
        return self._obs(), {}

    def step(self, action: Any):
        self._t += 1
        reward = (np.float32(0.5), 1, 0.25)[self._t % 3]
        terminated = np.bool_(self.np_random.random() < 0.05)
        truncated = self._t >= 30
        return self._obs(), reward, terminated, truncated, {}


class _SubArray(np.ndarray):
    pass


class FormObsEnv(MixedObsEnv):
    """Box((2, 3), float32) observations, each env always in the same form:
    ``forms[env_index % len(forms)]`` among ``"float32"`` (C-contiguous), ``"float32-strided"``
    (the right dtype, not contiguous), ``"float32-fortran"``, ``"float32-subclass"`` (an
    ndarray subclass), ``"float32-swapped"`` (big-endian: float32 too, another dtype), and
    ``"float64"`` and ``"int32"`` (cast on write; int32 has float32's item size, so only its
    dtype tells it apart).

    A group whose observations are all C-contiguous float32 arrays writes them as joined
    bytes; any other form in the group sends it to numpy's copy.
    """

    def __init__(self, env_index: int = 0, forms: tuple[str, ...] = ("float32",)):
        super().__init__(env_index)
        self.form = forms[env_index % len(forms)]

    def _obs(self) -> np.ndarray:
        value = self.np_random.uniform(-1.0, 1.0, (2, 3))
        if self.form == "float64":
            return value
        if self.form == "int32":
            return (value * 4).astype(np.int32)
        if self.form == "float32-strided":
            wide = np.repeat(value.astype(np.float32), 2, axis=1)
            return wide[:, ::2]  # the same values, every other column of a wider array
        if self.form == "float32-fortran":
            return np.asfortranarray(value.astype(np.float32))
        if self.form == "float32-subclass":
            return value.astype(np.float32).view(_SubArray)
        if self.form == "float32-swapped":
            return value.astype(">f4")
        return value.astype(np.float32)

    def step(self, action: Any):
        self._t += 1
        return self._obs(), float(action), self._t % 7 == 0, False, {}


class ValuesEnv(gym.Env):
    """Steps return the reward, terminated and truncated values it was given, in the form
    ``result`` names, so the tests can check how each is written into the result buffers.

    ``result``: ``"tuple"`` (the usual 5-tuple), ``"list"``, ``"namedtuple"``, ``"generator"``
    (all five values, and reset's two, in other containers), ``"short"`` (4 values),
    ``"long"`` (6 values). Odd envs return an info from reset.
    ``info``: what step returns as its info (``{"t": step}`` by default, every other step).
    """

    class _Result(tuple):  # a tuple subclass, as a namedtuple is
        pass

    def __init__(
        self,
        env_index: int = 0,
        reward: Any = 1.0,
        terminated: Any = False,
        truncated: Any = False,
        result: str = "tuple",
        info: Any = None,
    ):
        self.env_index = env_index
        self.values = (reward, terminated, truncated)
        self.result, self.info = result, info
        self.observation_space = spaces.Box(-1.0, 1.0, (3,), np.float32)
        self.action_space = spaces.Discrete(2)
        self._t = 0

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        self._t = 0
        obs = self.np_random.uniform(-1.0, 1.0, 3).astype(np.float32)
        info = {"reset": True} if self.env_index % 2 else {}
        if self.result in ("list", "namedtuple", "generator"):  # the reset result too
            return self._container([obs, info])
        return obs, info

    def _container(self, values: list[Any]) -> Any:
        if self.result == "list":
            return values
        if self.result == "namedtuple":
            return self._Result(values)
        return (v for v in values)

    def step(self, action: Any):
        self._t += 1
        obs = self.np_random.uniform(-1.0, 1.0, 3).astype(np.float32)
        info = ({"t": self._t} if self._t % 2 else {}) if self.info is None else self.info
        values = (obs, *self.values, info)
        if self.result in ("list", "namedtuple", "generator"):
            return self._container(list(values))
        if self.result == "short":
            return values[:4]
        if self.result == "long":
            return (*values, None)
        return values


class PointSpace(spaces.Space):
    """A custom Space subclass (no fixed size): values are ``(label: str, weight: float)``."""

    def __init__(self, seed: int | None = None):
        super().__init__(None, None, seed)

    def sample(self, mask: Any = None, probability: Any = None) -> tuple[str, float]:
        return ("p" * int(self.np_random.integers(1, 4)), float(self.np_random.random()))

    def contains(self, x: Any) -> bool:
        return isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], str)

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, PointSpace)


def side_space(kind: str) -> spaces.Space:
    """The observation space of :class:`SideObsEnv` of ``kind``."""
    box = spaces.Box(-1.0, 1.0, (2,), np.float32)
    if kind == "text":
        return spaces.Text(max_length=6, min_length=1)
    if kind == "graph":
        return spaces.Graph(node_space=box, edge_space=spaces.Discrete(3))
    if kind == "sequence":
        return spaces.Sequence(box)
    if kind == "sequence_stack":
        return spaces.Sequence(box, stack=True)
    if kind == "oneof":
        return spaces.OneOf((spaces.Discrete(4), box))
    if kind == "dict_text_box":
        return spaces.Dict({"name": spaces.Text(5), "pos": box, "n": spaces.Discrete(3)})
    if kind == "custom":
        return PointSpace()
    raise ValueError(kind)


class SideObsEnv(gym.Env):
    """Observations from a space without a fixed size (``side_space(kind)``), drawn from the
    env's seeded generator; episodes end at random (terminated or truncated), infos carry
    the step count every other step. ``last_obs``: the latest observation returned.

    Faults: env ``fail_index`` fails in its ``fail_step``-th step of every episode, by
    raising (``fail="raise"``) or ending its process (``fail="exit"``)."""

    def __init__(
        self,
        kind: str = "text",
        env_index: int = 0,
        fail: str | None = None,
        fail_index: int = 0,
        fail_step: int = 5,
    ):
        self.kind = kind
        self.env_index = env_index
        self.fail = fail if env_index == fail_index else None
        self.fail_step = fail_step
        self.observation_space = side_space(kind)
        self.action_space = spaces.Discrete(2)
        self._t = 0
        self.last_obs: Any = None

    def _obs(self) -> Any:
        if self.fail is not None and self._t == self.fail_step:
            if self.fail == "exit":
                os._exit(3)
            raise RuntimeError(f"boom in step {self._t} of env {self.env_index}")
        self.observation_space.seed(int(self.np_random.integers(1 << 30)))
        self.last_obs = self.observation_space.sample()
        return self.last_obs

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        self._t = 0
        return self._obs(), {"start": self.env_index}

    def step(self, action: Any):
        self._t += 1
        u = self.np_random.random()
        terminated, truncated = bool(u < 0.1), bool(0.1 <= u < 0.15)
        info = {"t": self._t} if self._t % 2 else {}
        return self._obs(), float(u) + int(action), terminated, truncated, info


class BoundsEnv(gym.Env):
    """A Box observation whose bounds depend on ``env_index`` (same shape and dtype), or
    whose shape does too with ``grow=True``. Env 1 raises in its ``fail_step``-th step."""

    def __init__(self, env_index: int = 0, grow: bool = False, fail_step: int | None = None):
        self.env_index = env_index
        self.fail_step = fail_step if env_index == 1 else None  # env 1 raises there
        self._t = 0
        high = 1.0 + env_index
        shape = (2 + (env_index if grow else 0),)
        self.observation_space = spaces.Box(-high, high, shape, np.float32)
        self.action_space = spaces.Discrete(2)

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        return self.observation_space.sample() * 0 + self.np_random.random(), {}

    def step(self, action: Any):
        self._t += 1
        if self._t == self.fail_step:
            raise RuntimeError(f"boom in step {self._t} of env {self.env_index}")
        u = self.np_random.random()
        obs = (self.np_random.random(self.observation_space.shape) * 0.5).astype(np.float32)
        return obs, float(u), bool(u < 0.1), False, {}


class SideActionEnv(gym.Env):
    """An action space without a fixed size: ``Text`` (``kind="text"``) or a ``Dict`` of a
    Text and a Box (``"dict"``); observations and rewards depend on the actions received."""

    def __init__(self, kind: str = "text", env_index: int = 0):
        self.env_index = env_index
        text = spaces.Text(4, min_length=1)
        box = spaces.Box(-1.0, 1.0, (2,), np.float32)
        self.action_space = text if kind == "text" else spaces.Dict({"word": text, "move": box})
        self.observation_space = spaces.Box(-100.0, 100.0, (3,), np.float32)

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        return self.np_random.random(3).astype(np.float32), {}

    def step(self, action: Any):
        word = action if isinstance(action, str) else action["word"]
        move = np.zeros(2) if isinstance(action, str) else action["move"]
        u = self.np_random.random()
        obs = np.array([len(word), sum(map(ord, word)) % 97, move[0] + u], dtype=np.float32)
        return obs, float(move[1]) + len(word), bool(u < 0.1), bool(0.1 <= u < 0.13), {}


class ActionDtypeEnv(gym.Env):
    """Reports the action it was handed: its observation is computed in float64 from the
    action's own value (a float32-rounded action gives other bits), and its info names each
    leaf's type and dtype. ``kind="box"``: a float32 Box action; ``"dict"``: a Dict of a
    float32 Box and a Discrete; ``"tuple"``: the same as a Tuple; ``"side"``: a Dict of a
    Text and a float32 Box."""

    def __init__(self, kind: str = "box", env_index: int = 0):
        self.env_index = env_index
        box = spaces.Box(-1.0, 1.0, (2,), np.float32)
        if kind == "box":
            self.action_space: spaces.Space[Any] = box
        elif kind == "dict":
            self.action_space = spaces.Dict({"move": box, "pick": spaces.Discrete(3)})
        elif kind == "tuple":
            self.action_space = spaces.Tuple((box, spaces.Discrete(3)))
        else:
            self.action_space = spaces.Dict({"word": spaces.Text(4, min_length=1), "move": box})
        self.observation_space = spaces.Box(-np.inf, np.inf, (3,), np.float64)

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        return self.np_random.random(3), {}

    def step(self, action: Any):
        if isinstance(action, tuple):
            leaves = {"move": action[0], "pick": action[1]}
        else:
            leaves = action if isinstance(action, dict) else {"move": action}
        move = leaves["move"]
        u = self.np_random.random()
        # float64 arithmetic on the action as handed over: float32 rows show in the bits.
        obs = np.array([move[0] * 1.000000001 + u, move[1] / 3.0, u], dtype=np.float64)
        info = {
            key: f"{type(value).__name__}:{np.asarray(value).dtype}"
            for key, value in leaves.items()
        }
        return obs, float(move[0]) / 7.0, bool(u < 0.05), False, info


class ReusedGraphEnv(gym.Env):
    """A Graph observation whose node array is one buffer the env rewrites in place on every
    step (what copy=True must protect results from)."""

    def __init__(self, env_index: int = 0):
        self.env_index = env_index
        self.observation_space = spaces.Graph(spaces.Box(-10.0, 10.0, (2,), np.float32), None)
        self.action_space = spaces.Discrete(2)
        self._nodes = np.zeros((3, 2), dtype=np.float32)

    def _obs(self) -> Any:
        self._nodes[...] = self.np_random.random((3, 2))
        return spaces.GraphInstance(self._nodes, None, None)

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        return self._obs(), {}

    def step(self, action: Any):
        return self._obs(), 0.0, False, False, {}


class SlowEnv(IndexedEnv):
    """An :class:`IndexedEnv` whose ``step`` and ``slow`` (a method for ``call``) sleep
    ``delays.get(env_index, 0.0)`` seconds and whose ``reset`` sleeps
    ``reset_delays.get(env_index, 0.0)``; ``3600`` stands for a hang."""

    def __init__(
        self,
        env_index: int = -1,
        delays: dict[int, float] | None = None,
        reset_delays: dict[int, float] | None = None,
    ):
        super().__init__(env_index)
        self.delay = (delays or {}).get(env_index, 0.0)
        self.reset_delay = (reset_delays or {}).get(env_index, 0.0)

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        time.sleep(self.reset_delay)
        return super().reset(seed=seed, options=options)

    def step(self, action: Any):
        time.sleep(self.delay)
        return super().step(action)

    def slow(self) -> int:
        time.sleep(self.delay)
        return self.env_index


class CustomEnvException(Exception):
    """An exception whose ``__init__`` takes two required arguments."""

    def __init__(self, text: str, code: int):
        super().__init__(text, code)
        self.code = code


class NewArgsException(Exception):
    """An exception whose ``__new__`` takes exactly one argument."""

    def __new__(cls, text: str):
        return super().__new__(cls, text)


def raise_in_env(kind: str) -> None:
    """Raise an exception of ``kind``: "value" (ValueError), "key" (KeyError), "os"
    (OSError with an errno), "custom" (:class:`CustomEnvException`), "new"
    (:class:`NewArgsException`)."""
    if kind == "value":
        raise ValueError("bad value in env")
    if kind == "key":
        raise KeyError("missing")
    if kind == "os":
        raise FileNotFoundError(2, "no such thing")
    if kind == "new":
        raise NewArgsException("new args")
    raise CustomEnvException("custom", 7)


class TypedRaisingEnv(IndexedEnv):
    """An :class:`IndexedEnv` whose env ``fail_index`` raises ``raise_in_env(kind)`` in
    ``step`` (and, with ``options={"explode": True}``, in ``reset``)."""

    def __init__(self, env_index: int = -1, kind: str = "value", fail_index: int = 1):
        super().__init__(env_index)
        self.kind = kind
        self.fail_index = fail_index

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        if self.env_index == self.fail_index and (options or {}).get("explode"):
            raise_in_env(self.kind)
        return super().reset(seed=seed, options=options)

    def step(self, action: Any):
        if self.env_index == self.fail_index:
            raise_in_env(self.kind)
        return super().step(action)


class FaultEnv(gym.Env):
    """Env ``env_index`` does ``faults[env_index] = (how, at_step)`` at its ``at_step``-th
    step since make (``how``: as :func:`tests.envs.crash_process`, ``"sigkill"``,
    ``"sleep:S"`` to sleep S seconds, ``"spin:S"`` to loop in Python for S seconds,
    ``"null-write"`` to write at address 0 in C (a real SIGSEGV), or ``"raise"`` to raise
    ``ValueError`` once); every
    other env behaves. Every step first sleeps ``wait_s`` seconds (an env that waits on a
    simulator). Episodes never end."""

    def __init__(
        self,
        env_index: int = 0,
        faults: dict[int, tuple[str, int]] | None = None,
        wait_s: float = 0.0,
    ):
        self.env_index = env_index
        self.wait_s = wait_s
        self.fault = (faults or {}).get(env_index)
        self.observation_space = spaces.Box(-1.0, 1.0, (2,), np.float32)
        self.action_space = spaces.Discrete(2)
        self._steps = 0

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        return self.np_random.uniform(-1.0, 1.0, 2).astype(np.float32), {}

    def step(self, action: Any):
        self._steps += 1
        if self.wait_s:
            time.sleep(self.wait_s)
        if self.fault is not None and self._steps == self.fault[1]:
            how = self.fault[0]
            if how.startswith("sleep:"):
                time.sleep(float(how.split(":")[1]))
            elif how.startswith("spin:"):  # busy in Python, not in a C call
                end = time.monotonic() + float(how.split(":")[1])
                while time.monotonic() < end:
                    pass
            elif how == "null-write":  # a real SIGSEGV in C, faulthandler left as it is
                ctypes.memset(0, 0, 1)
            elif how == "sigkill":
                os.kill(os.getpid(), signal.SIGKILL)
                time.sleep(60)  # the signal is delivered before this returns
            elif how == "raise":
                raise ValueError(f"boom in step {self._steps} of env {self.env_index}")
            else:
                crash_process(how)
        obs = self.np_random.uniform(-1.0, 1.0, 2).astype(np.float32)
        return obs, 1.0, False, False, {}


class FaultSeriesEnv(gym.Env):
    """Env ``env_index`` does a series of faults, each once per env index: fault ``k`` of
    ``series`` (``(how, at_step)``; ``how``: ``"raise"``, ``"sleep:S"``, ``"null-write"`` or
    ``"sigkill"``, as :class:`FaultEnv`'s) comes in the env's ``at_step``-th step since it
    was built, unless the file ``f"{marker}-{env_index}-{k}"`` exists (made just before). So an env
    rebuilt after a fault (in its worker, or in a new one) goes on to the next faults of the
    series, and a test can spare an env a fault by making its file. Faults due in the same
    step come one after the other. Episodes never end."""

    def __init__(
        self, env_index: int = 0, series: tuple[tuple[str, int], ...] = (), marker: str = ""
    ):
        self.env_index, self.series, self.marker = env_index, series, marker
        self.observation_space = spaces.Box(-1.0, 1.0, (2,), np.float32)
        self.action_space = spaces.Discrete(2)
        self._steps = 0

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        return self.np_random.uniform(-1.0, 1.0, 2).astype(np.float32), {}

    def step(self, action: Any):
        self._steps += 1
        for k, (how, at) in enumerate(self.series):
            mark = Path(f"{self.marker}-{self.env_index}-{k}")
            if at != self._steps or mark.exists():
                continue
            mark.touch()
            if how == "raise":
                raise ValueError(f"boom in step {self._steps} of env {self.env_index}")
            if how.startswith("sleep:"):
                time.sleep(float(how.split(":")[1]))
            elif how == "null-write":  # a real SIGSEGV in C
                ctypes.memset(0, 0, 1)
            elif how == "sigkill":
                os.kill(os.getpid(), signal.SIGKILL)
                time.sleep(60)  # the signal is delivered before this returns
        obs = self.np_random.uniform(-1.0, 1.0, 2).astype(np.float32)
        return obs, 1.0, False, False, {}


def fault_factory(faults: dict[int, tuple[str, int]], wait_s: float = 0.0) -> Any:
    def factory(env_index: int) -> FaultEnv:
        return FaultEnv(env_index, faults, wait_s)

    return factory


class MemoryHogEnv(gym.Env):
    """Env ``hog_index`` takes ``mb`` MiB of resident memory in its first step, then SIGKILLs
    its own process in step ``kill_at`` (as the OOM killer would); every step sleeps
    ``step_s`` seconds. Only for the processes backend."""

    def __init__(
        self,
        env_index: int = 0,
        hog_index: int = 1,
        mb: int = 256,
        kill_at: int = 20,
        step_s: float = 0.02,
    ):
        self.env_index, self.hog, self.mb = env_index, env_index == hog_index, mb
        self.kill_at, self.step_s = kill_at, step_s
        self.observation_space = spaces.Box(-1.0, 1.0, (2,), np.float32)
        self.action_space = spaces.Discrete(2)
        self._steps = 0
        self._held: np.ndarray | None = None

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        return np.zeros(2, np.float32), {}

    def step(self, action: Any):
        self._steps += 1
        time.sleep(self.step_s)
        if self.hog and self._steps == 1:
            self._held = np.ones(self.mb * 2**20, dtype=np.uint8)  # every page touched
        if self.hog and self._steps == self.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(60)  # the signal is delivered before this returns
        return np.zeros(2, np.float32), 0.0, False, False, {}


class BuggyEnv(gym.Env):
    """An env with a bug its seed reaches: each step draws from ``np_random``; after action 1
    a draw below ``p`` does ``how`` (as :class:`FaultEnv`: ``"raise"``, ``"null-write"``,
    ``"sleep:S"``, ``"sigkill"``, ...) in env ``bug_index`` only. Episodes end when another
    draw falls below ``end_p`` (autoresets then continue the same random stream), so which
    step fails depends only on the seed and the actions, as a real env's bug would.
    ``checkpoint=False``: it holds a lock, so that its state cannot be checkpointed."""

    def __init__(
        self,
        env_index: int = 0,
        how: str = "raise",
        bug_index: int = 1,
        p: float = 0.02,
        end_p: float = 0.1,
        checkpoint: bool = True,
    ):
        self.env_index, self.how, self.bug = env_index, how, env_index == bug_index
        self.p, self.end_p = p, end_p
        if not checkpoint:  # a state that does not pickle: no checkpoint (env_state.env_state)
            self.lock = threading.Lock()
        self.observation_space = spaces.Box(0.0, 1.0, (2,), np.float64)
        self.action_space = spaces.Discrete(2)
        self.episode_steps = 0

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        self.episode_steps = 0
        return self.np_random.random(2), {}

    def step(self, action: Any):
        self.episode_steps += 1
        draw, end = self.np_random.random(), self.np_random.random()
        if self.bug and int(action) == 1 and draw < self.p:
            how = self.how
            if how == "raise":
                raise ValueError(
                    f"bug hit at step {self.episode_steps} of an episode (draw {draw:.6f})"
                )
            if how.startswith("sleep:"):
                time.sleep(float(how.split(":")[1]))
            elif how == "null-write":
                ctypes.memset(0, 0, 1)
            elif how == "sigkill":
                os.kill(os.getpid(), signal.SIGKILL)
                time.sleep(60)
            else:
                crash_process(how)
        return np.array([draw, end]), 1.0, bool(end < self.end_p), False, {}


class LeakyEnv(gym.Env):
    """An env that leaks: every step keeps ``leak_kb`` KiB more (a list that only grows,
    every page written), over episodes of ``episode_steps`` steps that sleep ``step_s``
    seconds each. Its observations and rewards come from its ``np_random``."""

    def __init__(self, leak_kb: int = 64, episode_steps: int = 10, step_s: float = 0.001):
        self.leak, self.episode_steps, self.step_s = leak_kb * 1024, episode_steps, step_s
        self.observation_space = spaces.Box(0.0, 1.0, (2,), np.float64)
        self.action_space = spaces.Discrete(2)
        self.kept: list[bytes] = []
        self.t = 0

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        self.t = 0
        return self.np_random.random(2), {}

    def step(self, action: Any):
        self.t += 1
        self.kept.append(b"x" * self.leak)
        if self.step_s:
            time.sleep(self.step_s)
        obs = self.np_random.random(2)
        return obs, float(obs[0]) + int(action), False, self.t >= self.episode_steps, {}


class WaitingEnv(gym.Env):
    """An env that waits, as one whose simulator runs elsewhere: every step sleeps ``wait_s``
    seconds (using no CPU, the GIL released), then draws its observation, reward, episode end
    and sparse infos (keys that differ between envs) from ``np_random``. Episodes end after a
    length drawn at reset, terminated or truncated at random. Each reset sleeps
    ``reset_wait_s`` and keeps the name of the thread it ran on (``reset_thread``)."""

    def __init__(self, env_index: int = 0, wait_s: float = 0.001, reset_wait_s: float = 0.0):
        self.env_index = env_index
        self.wait_s, self.reset_wait_s = wait_s, reset_wait_s
        self.observation_space = spaces.Box(-1.0, 1.0, (3,), np.float32)
        self.action_space = spaces.Discrete(3)
        self._left = 0
        self.reset_thread = ""

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        self.reset_thread = threading.current_thread().name
        if self.reset_wait_s:
            time.sleep(self.reset_wait_s)
        super().reset(seed=seed)
        self._left = int(self.np_random.integers(3, 12))
        obs = self.np_random.uniform(-1.0, 1.0, 3).astype(np.float32)
        return obs, ({"start": self.env_index} if self.env_index % 2 else {})

    def step(self, action: Any):
        time.sleep(self.wait_s)
        self._left -= 1
        obs = self.np_random.uniform(-1.0, 1.0, 3).astype(np.float32)
        obs[0] = float(action) / 3
        reward = float(self.np_random.normal())
        ended = self._left <= 0
        terminated = ended and bool(self.np_random.random() < 0.6)
        info: dict[str, Any] = {}
        if self.np_random.random() < 0.3:
            info[f"env{self.env_index}"] = np.int64(self._left)
        return obs, reward, terminated, ended and not terminated, info


class FaultAt(gym.Wrapper):
    """``gymnasium.make(env_id)`` whose env ``fault_index`` does ``how`` (as
    :func:`tests.envs.crash_process`, ``"sigkill"``, ``"null-write"`` or ``"raise:NAME"`` to
    raise the builtin exception ``NAME``) in its ``at_step``-th step since it was built;
    every other env is the plain env; with ``marker``, once per run. Built as
    ``FaultAt(env_index=i, ...)`` by :func:`fault_at`."""

    def __init__(
        self,
        env_id: str,
        env_index: int,
        fault_index: int,
        how: str,
        at_step: int,
        marker: str = "",
    ):
        super().__init__(gym.make(env_id))
        self.faulty = env_index == fault_index
        self.how, self.at_step, self._steps, self.marker = how, at_step, 0, marker

    def step(self, action: Any):
        self._steps += 1
        if self.faulty and self._steps == self.at_step and not self._done_before():
            if self.how == "null-write":
                ctypes.memset(0, 0, 1)
            elif self.how == "sigkill":
                os.kill(os.getpid(), signal.SIGKILL)
                time.sleep(60)
            elif self.how.startswith("raise:"):
                raise getattr(builtins, self.how.split(":")[1])(f"lost at step {self._steps}")
            else:
                crash_process(self.how)
        return self.env.step(action)

    def _done_before(self) -> bool:
        """With a ``marker`` file: whether an env (this one before a restart) did the fault
        already; the file is made just before the fault."""
        if not self.marker:
            return False
        if Path(self.marker).exists():
            return True
        Path(self.marker).touch()
        return False


def fault_at(
    env_id: str, fault_index: int = -1, how: str = "", at_step: int = 0, marker: str = ""
) -> Any:
    """A factory (it takes ``env_index``) of :class:`FaultAt` envs; ``fault_index=-1``: none
    faults (the fault-free run to compare with); ``marker``: a file path, so that the fault
    comes once per run (not again in the env rebuilt after it)."""
    return functools.partial(
        _fault_at, env_id=env_id, fault_index=fault_index, how=how, at_step=at_step, marker=marker
    )


def _fault_at(env_index: int, **kwargs: Any) -> FaultAt:
    return FaultAt(env_index=env_index, **kwargs)
