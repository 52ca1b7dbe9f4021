"""Policies and workloads of the learner's-loop benchmark (``envfleet bench --policy``).

Its public names are re-exported by :mod:`envfleet.bench`.

CleanRL's PPO actors, run on the CPU with ``torch.set_num_threads(1)`` and Categorical
sampling, as a callable that :func:`envfleet.bench.measure_policy_loop`,
``benchmarks/policy_loop.py`` and :class:`envfleet.Sampler` all use:

- ``"mlp"``: two hidden layers of 64 with tanh (CleanRL's ``ppo.py``), on flat observations;
  with a ``Box`` action space a Gaussian head (CleanRL's ``ppo_continuous_action.py``);
- ``"cnn"``: the Nature CNN (CleanRL's ``ppo_atari.py``) on ``uint8[4, 84, 84]`` frame
  stacks, observations divided by 255.

torch is imported only when a policy is built: without it, :func:`require_torch` raises
:class:`~envfleet.ConfigError` saying how to install it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import gymnasium
import numpy as np

from envfleet import ConfigError

__all__ = [
    "POLICY_KINDS",
    "TORCH_INSTALL",
    "TorchPolicy",
    "Workload",
    "check_workload",
    "make_env",
    "require_torch",
    "workloads",
]

#: The policy kinds of ``envfleet bench --policy``.
POLICY_KINDS: tuple[str, ...] = ("mlp", "cnn")
#: What to install for ``--policy`` when torch is missing.
TORCH_INSTALL = "pip install 'envfleet[torch]' (or: pip install torch)"


def require_torch() -> Any:
    """Import and return torch.

    Raises:
        ConfigError: torch is not installed; the message says how to install it.
    """
    try:
        import torch
    except ImportError as exc:
        raise ConfigError(
            f"the learner's-loop benchmark (--policy) needs torch: {TORCH_INSTALL}"
        ) from exc
    return torch


@dataclass(frozen=True)
class Workload:
    """One row set of the benchmark: an env, how many copies, and the policy that drives them.

    Attributes:
        env_id: the gymnasium id, e.g. ``"CartPole-v1"``.
        num_envs: number of sub-environments.
        policy: ``"mlp"`` or ``"cnn"``.
        atari: build the env as ``gymnasium.make(env_id, frameskip=1)`` wrapped in
            ``AtariPreprocessing(frame_skip=4, screen_size=84, grayscale_obs=True)`` and
            ``FrameStackObservation(4)``.
    """

    env_id: str
    num_envs: int
    policy: str
    atari: bool = False

    @property
    def name(self) -> str:
        """``"CartPole-v1 x16"``: the id and the number of envs."""
        return f"{self.env_id} x{self.num_envs}"

    def factory(self) -> Callable[[], gymnasium.Env[Any, Any]]:
        """A picklable zero-argument factory of one env of this workload."""
        return functools.partial(make_env, self.env_id, self.atari)


def workloads(
    policy: str, env_ids: list[str] | None = None, num_envs: int | None = None
) -> list[Workload]:
    """The workloads of ``--policy policy``: its default env ids, or ``env_ids``.

    ``"mlp"``: ``CartPole-v1`` x16; ``"cnn"``: ``ALE/Pong-v5`` x8 with Atari preprocessing
    (every ``ALE/`` id given is preprocessed the same way). ``num_envs`` replaces the default
    count.

    Raises:
        ConfigError: unknown policy kind, or ``num_envs < 1``.
    """
    if policy not in POLICY_KINDS:
        raise ConfigError(f"unknown policy {policy!r}; choose from {', '.join(POLICY_KINDS)}")
    if num_envs is not None and num_envs < 1:
        raise ConfigError(f"num_envs must be >= 1, got {num_envs}")
    default_ids, default_n = (["CartPole-v1"], 16) if policy == "mlp" else (["ALE/Pong-v5"], 8)
    n = default_n if num_envs is None else num_envs
    return [
        Workload(env_id, n, policy, atari=env_id.startswith("ALE/"))
        for env_id in (env_ids or default_ids)
    ]


def check_workload(workload: Workload) -> None:
    """Check that a workload's env can be built here, without building it.

    Raises:
        ConfigError: a MuJoCo id without mujoco, an ``ALE/`` id without ale-py, or Atari
            preprocessing without OpenCV (gymnasium's ``AtariPreprocessing`` resizes with it);
            the message says what to install.
    """
    import importlib.util

    if workload.env_id.startswith(_MUJOCO) and importlib.util.find_spec("mujoco") is None:
        raise ConfigError(f"{workload.env_id} needs MuJoCo: pip install 'envfleet[mujoco]'")
    if workload.env_id.startswith("ALE/") and importlib.util.find_spec("ale_py") is None:
        raise ConfigError(f"{workload.env_id} needs ale-py: pip install 'envfleet[atari]'")
    if workload.atari and importlib.util.find_spec("cv2") is None:
        raise ConfigError(
            f"the Atari preprocessing of {workload.env_id} needs OpenCV: "
            "pip install 'envfleet[atari]' (or: pip install opencv-python-headless)"
        )


# The MuJoCo envs of gymnasium whose ids a workload may name.
_MUJOCO = ("HalfCheetah", "Hopper", "Walker2d", "Ant", "Humanoid", "Swimmer", "Reacher")


def make_env(env_id: str, atari: bool = False) -> gymnasium.Env[Any, Any]:
    """One env of a workload (see :class:`Workload`); importable in a spawned worker.

    Raises:
        gymnasium.error.Error: unknown id; ImportError: ``ALE/`` without ale-py.
    """
    if env_id.startswith("ALE/"):
        import ale_py

        gymnasium.register_envs(ale_py)
    if not atari:
        return gymnasium.make(env_id)
    from gymnasium.wrappers import AtariPreprocessing, FrameStackObservation

    env = gymnasium.make(env_id, frameskip=1)
    env = AtariPreprocessing(env, frame_skip=4, screen_size=84, grayscale_obs=True)
    return FrameStackObservation(env, 4)


class TorchPolicy:
    """CleanRL's PPO actor as a batched policy: ``policy(obs)`` returns sampled actions.

    Args:
        kind: ``"mlp"`` (64-64 tanh) or ``"cnn"`` (Nature CNN; inputs divided by 255).
        observation_space: one env's observation space (a ``Box``).
        action_space: one env's action space: ``Discrete`` (Categorical sampling), or for
            ``"mlp"`` a ``Box`` (a Gaussian: the actor's means, a state-independent log
            standard deviation of 0, samples clipped to the bounds, as CleanRL's
            ``ppo_continuous_action.py`` with its ``ClipAction``).
        seed: seeds the weights (``torch.manual_seed``) and the sampling generator.
        device: the torch device of the weights and the computation (``"cpu"``, or
            ``"cuda"`` where a GPU is: observations are copied to it and the actions back).

    Calling it with ``obs`` (``[n, *obs_shape]``, any numeric dtype) returns
    ``int64[n]`` actions (a numpy array on the CPU) drawn from
    ``Categorical(logits=actor(obs))`` (a Box: ``float32[n, *act_shape]`` from the
    Gaussian), computed in ``torch.no_grad()`` with
    ``torch.set_num_threads(1)``. It pickles (a worker gets its own copy); :meth:`seed`
    reseeds the sampling.

    Raises:
        ConfigError: torch is missing, unknown ``kind``, or spaces it does not handle.

    Example::

        policy = TorchPolicy("mlp", env.observation_space, env.action_space, seed=0)
        actions = policy(np.zeros((16, 4), np.float32))  # int64[16]
    """

    def __init__(
        self,
        kind: str,
        observation_space: gymnasium.Space[Any],
        action_space: gymnasium.Space[Any],
        seed: int = 0,
        device: str = "cpu",
    ):
        torch = require_torch()
        if kind not in POLICY_KINDS:
            raise ConfigError(f"unknown policy {kind!r}; choose from {', '.join(POLICY_KINDS)}")
        gaussian = kind == "mlp" and isinstance(action_space, gymnasium.spaces.Box)
        if not (isinstance(action_space, gymnasium.spaces.Discrete) or gaussian):
            raise ConfigError(
                f"the {kind} policy needs a Discrete action space"
                f"{' or a Box' if kind == 'mlp' else ''}, got {action_space}"
            )
        if not isinstance(observation_space, gymnasium.spaces.Box):
            raise ConfigError(f"the {kind} policy needs a Box observation space")
        nn = torch.nn
        torch.set_num_threads(1)
        torch.manual_seed(seed)
        # Categorical logits, or a Gaussian's means (CleanRL's ppo_continuous_action.py: a
        # state-independent log standard deviation, 0 at the start).
        self.gaussian = gaussian
        # A Box's bounds (flat) and shape, and the Gaussian's log standard deviation.
        self.low = self.high = np.zeros(0, np.float32)
        self.action_shape: tuple[int, ...] = ()
        if isinstance(action_space, gymnasium.spaces.Box):
            self.low = np.asarray(action_space.low, np.float32).reshape(-1)
            self.high = np.asarray(action_space.high, np.float32).reshape(-1)
            self.action_shape = tuple(int(d) for d in action_space.shape)
            n_actions = len(self.low)
            self.log_std = torch.zeros(n_actions)
        else:
            n_actions = int(cast(gymnasium.spaces.Discrete, action_space).n)
        if kind == "mlp":
            size = int(np.prod(observation_space.shape))
            self.actor = nn.Sequential(
                nn.Flatten(),
                nn.Linear(size, 64),
                nn.Tanh(),
                nn.Linear(64, 64),
                nn.Tanh(),
                nn.Linear(64, n_actions),
            )
            self.scale = 1.0
        else:
            channels = observation_space.shape[0]
            self.actor = nn.Sequential(
                nn.Conv2d(channels, 32, 8, stride=4),
                nn.ReLU(),
                nn.Conv2d(32, 64, 4, stride=2),
                nn.ReLU(),
                nn.Conv2d(64, 64, 3, stride=1),
                nn.ReLU(),
                nn.Flatten(),
                nn.Linear(64 * 7 * 7, 512),
                nn.ReLU(),
                nn.Linear(512, n_actions),
            )
            self.scale = 1.0 / 255.0
        self.kind = kind
        self.device = torch.device(device)
        self.actor.to(self.device)
        if gaussian:
            self.log_std = self.log_std.to(self.device)
        self.generator = torch.Generator(device=self.device).manual_seed(seed)

    def seed(self, seed: int | None) -> None:
        """Reseed the sampling generator (the Sampler calls it per worker); ``None`` (a
        Sampler without a seed): from a fresh random seed."""
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(int(seed))

    def __call__(self, obs: Any) -> np.ndarray:
        import torch

        if torch.get_num_threads() != 1:  # a fresh worker process
            torch.set_num_threads(1)
        with torch.no_grad():
            x = torch.as_tensor(np.asarray(obs)).to(self.device, torch.float32)
            if self.scale != 1.0:
                x = x * self.scale
            out = self.actor(x)
            if self.gaussian:
                noise = torch.randn(out.shape, generator=self.generator, device=self.device)
                drawn = (out + noise * self.log_std.exp()).cpu().numpy()
                flat = np.clip(drawn, self.low, self.high)
                return flat.reshape(len(flat), *self.action_shape).astype(np.float32)
            probs = torch.softmax(out, dim=-1)
            actions = torch.multinomial(probs, 1, generator=self.generator).squeeze(-1)
        return actions.cpu().numpy()
