"""Time to score (``envfleet bench --train``, ``benchmarks/train.py``): one PPO run over every
system of :data:`TRAIN_SYSTEMS` until the mean return of the last finished episodes reaches
the workload's target, or its budget of env steps is spent (see :mod:`envfleet.bench`, which
re-exports it).

One learner for every system: CleanRL's PPO (separate 64-64 tanh actor and critic, orthogonal
initialisation, Adam with ``eps=1e-5``, clipped surrogate, per-minibatch advantage
normalisation, gradient clipping), torch on the CPU with ``torch.set_num_threads(1)``, the same
model, hyperparameters (:class:`PPOConfig`) and seeds everywhere. Only the way the envs are
stepped differs:

- the vector envs (gymnasium's ``SyncVectorEnv``/``AsyncVectorEnv``, SB3's ``SubprocVecEnv``,
  PufferLib's ``Multiprocessing``, ``envfleet.make``): CleanRL's rollout, ``steps_per_update``
  steps of every env into ``[T, N]`` arrays, then one update. gymnasium's and envfleet's run
  with ``AutoresetMode.SAME_STEP``, SB3's autoresets in the same step by itself, so all four
  see the same observations for the same seeds and actions and learn bit-identically (the
  report says which did: :attr:`TrainReport.identical`). PufferLib resets an env in the step
  after its episode ended (its action ignored): that step is no transition, and is left out of
  the update and of the step count.
- ``envfleet.Sampler`` (its default, ``inference="auto"``): ``sampler.sample(steps_per_update
  * num_envs)``, advantages per segment, the same update, then ``sampler.update_policy()``;
  and ``sampler-prefetch``, the same with ``prefetch=True``: each batch after the first was
  collected during the update before it, one policy version behind (PPO's ratio to the
  log-probabilities recorded with it).

Workloads (:data:`TRAIN_WORKLOADS`): ``cartpole`` and ``lunarlander`` to a score; ``pong``
(CleanRL's Atari PPO, the Nature CNN) has none and measures the steps/s end to end, learning
included, over its first 200k frames.

Advantages: GAE(lambda) (:func:`gae`); an episode cut by its time limit (``truncated``) is
bootstrapped from the value of its final observation, as SB3 does; one that ``terminated`` is
not. The score (:attr:`TrainWorkload.target`) is the mean undiscounted return of the last
:data:`SCORE_EPISODES` finished training episodes (the stochastic policy, as sampled),
checked after each update.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import math
import multiprocessing
import statistics
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

import gymnasium
import numpy as np
from gymnasium.vector import AutoresetMode

import envfleet
from envfleet import ConfigError, check_env_id, usable_cores
from envfleet.bench._core import bench_error, json_ready
from envfleet.bench._peers import PEER_INSTALL, PUFFER_INSTALL, make_gym_env, puffer_workers
from envfleet.bench._plot import PLOT_DPI, machine_line, require_matplotlib
from envfleet.bench._policies import Workload, check_workload, make_env, require_torch
from envfleet.bench._sweep import Machine, describe_machine

#: A picklable zero-argument factory of one env.
EnvFactory = Callable[[], Any]

__all__ = [
    "SCORE_EPISODES",
    "SYNC_SYSTEMS",
    "TRAIN_PEERS",
    "TRAIN_SYSTEMS",
    "TRAIN_WORKLOADS",
    "PPOConfig",
    "PPOPolicy",
    "TrainEnvs",
    "TrainPoint",
    "TrainReport",
    "TrainResult",
    "TrainRun",
    "TrainSystem",
    "TrainWorkload",
    "gae",
    "measure_train",
    "segment_gae",
    "plot_train",
    "train_report_dict",
    "train_report_from_dict",
    "train_run",
    "train_table",
    "train_unavailable",
]

#: The score is the mean return of this many last finished training episodes.
SCORE_EPISODES = 20


# -- workloads -------------------------------------------------------------------------------


@dataclass(frozen=True)
class PPOConfig:
    """PPO's hyperparameters, the same for every system.

    Attributes:
        steps_per_update: steps of every env per update (CleanRL's ``num_steps``, SB3's
            ``n_steps``); an update learns from ``steps_per_update * num_envs`` transitions.
        minibatch_size: transitions per gradient step (SB3's ``batch_size``).
        epochs: passes over the update's transitions (``n_epochs``).
        learning_rate: Adam's step size at the start.
        anneal_lr: decay the step size linearly to 0 over the budget of env steps.
        gamma: discount.
        gae_lambda: GAE's lambda.
        clip: the surrogate's clip range.
        ent_coef: weight of the entropy bonus.
        vf_coef: weight of the value loss (``0.5 * mse``, CleanRL's).
        max_grad_norm: gradients clipped to this global norm.
        hidden: width of the two hidden layers of the actor and of the critic.
    """

    steps_per_update: int
    minibatch_size: int
    epochs: int
    learning_rate: float
    anneal_lr: bool
    gamma: float
    gae_lambda: float
    clip: float = 0.2
    ent_coef: float = 0.0
    vf_coef: float = 0.5
    max_grad_norm: float = 0.5
    hidden: int = 64


@dataclass(frozen=True)
class TrainWorkload:
    """One training task: the env, how many copies, the target and PPO's settings.

    Attributes:
        name: the short name (``"cartpole"``), a key of :data:`TRAIN_WORKLOADS`.
        env_id: the gymnasium id.
        num_envs: sub-environments of every system.
        target: the score to reach: mean return of the last :data:`SCORE_EPISODES` finished
            episodes, at least this.
        budget: env steps after which a run stops when it has not reached the target.
        ppo: the hyperparameters (:class:`PPOConfig`).
        source: where the hyperparameters come from.
        policy: ``"mlp"`` or ``"cnn"`` (:class:`PPOPolicy`).
        atari: build each env as ``envfleet.bench.make_env(env_id, atari=True)`` does
            (``frameskip=1``, ``AtariPreprocessing(frame_skip=4, screen_size=84,
            grayscale_obs=True)``, ``FrameStackObservation(4)``).

    A workload whose ``target`` is ``inf`` measures steps/s end to end over its budget only
    (``pong``): no run reaches it.
    """

    name: str
    env_id: str
    num_envs: int
    target: float
    budget: int
    ppo: PPOConfig
    source: str = ""
    policy: str = "mlp"
    atari: bool = False

    @property
    def batch_steps(self) -> int:
        """Transitions per update: ``steps_per_update * num_envs``."""
        return self.ppo.steps_per_update * self.num_envs

    @property
    def scored(self) -> bool:
        """Whether runs stop at a score (``target`` finite), or only at the budget."""
        return math.isfinite(self.target)

    def factory(self) -> EnvFactory:
        """A picklable zero-argument factory of one env of this workload."""
        if self.atari:
            return functools.partial(make_env, self.env_id, True)
        return functools.partial(make_gym_env, self.env_id)

    def check(self) -> None:
        """Check, without building anything, that its env can be built here.

        Raises:
            ConfigError: an unknown id, or ale-py or OpenCV missing for an Atari env (the
                message says what to install).
        """
        check_env_id(self.env_id)
        check_workload(Workload(self.env_id, self.num_envs, self.policy, self.atari))


#: The workloads of ``envfleet bench --train``: ``cartpole`` (``CartPole-v1`` x8 to 475),
#: ``lunarlander`` (``LunarLander-v3`` x16 to 200) and ``pong`` (``ALE/Pong-v5`` x8, steps/s
#: end to end over the first 50,000 env steps, 200,000 frames at frameskip 4; no score).
TRAIN_WORKLOADS: dict[str, TrainWorkload] = {
    "cartpole": TrainWorkload(
        "cartpole",
        "CartPole-v1",
        8,
        target=475.0,
        budget=500_000,
        ppo=PPOConfig(
            steps_per_update=128,
            minibatch_size=256,
            epochs=10,
            learning_rate=1e-3,
            anneal_lr=True,
            gamma=0.99,
            gae_lambda=0.95,
        ),
        source="examples/ppo_cartpole.py's defaults",
    ),
    "lunarlander": TrainWorkload(
        "lunarlander",
        "LunarLander-v3",
        16,
        target=200.0,
        budget=1_500_000,
        ppo=PPOConfig(
            steps_per_update=1024,
            minibatch_size=64,
            epochs=4,
            learning_rate=3e-4,
            anneal_lr=False,
            gamma=0.999,
            gae_lambda=0.98,
            ent_coef=0.01,
        ),
        source="rl-baselines3-zoo's tuned PPO for LunarLander (SB3's defaults elsewhere)",
    ),
    "pong": TrainWorkload(
        "pong",
        "ALE/Pong-v5",
        8,
        target=math.inf,
        budget=50_000,
        ppo=PPOConfig(
            steps_per_update=128,
            minibatch_size=256,
            epochs=4,
            learning_rate=2.5e-4,
            anneal_lr=True,
            gamma=0.99,
            gae_lambda=0.95,
            clip=0.1,
            ent_coef=0.01,
        ),
        source="CleanRL's ppo_atari.py",
        policy="cnn",
        atari=True,
    ),
}


# -- the policy and the learner --------------------------------------------------------------


class PPOPolicy:
    """CleanRL's PPO agent as a batched policy (the Sampler's kind of policy).

    ``"mlp"`` (CleanRL's ``ppo.py``): separate 64-64 tanh MLPs for the logits and the value.
    ``"cnn"`` (CleanRL's ``ppo_atari.py``): the Nature CNN on frame stacks (divided by 255),
    shared by a linear policy head and a linear value head. Orthogonal initialisation
    (gain sqrt(2), 0.01 for the logits, 1 for the value), biases 0.

    Calling it with observations ``[n, *obs_shape]`` (numpy, any numeric dtype) returns
    ``(actions, {"logp": ..., "value": ...})``: ``int64[n]`` actions drawn from the logits'
    Categorical with the policy's own seeded ``torch.Generator``, their ``float32[n]``
    log-probabilities and the ``float32[n]`` values, computed under ``torch.no_grad()`` with
    one torch thread. It pickles (a Sampler's worker gets its own copy, which :meth:`seed`
    reseeds).

    Args:
        obs_shape: one observation's shape (``(obs_dim,)`` for ``"mlp"``, ``(4, 84, 84)`` for
            ``"cnn"``).
        num_actions: actions of the ``Discrete`` action space.
        kind: ``"mlp"`` or ``"cnn"``.
        hidden: width of the MLPs' hidden layers.
        seed: ``torch.manual_seed(seed)`` before the layers are built (the same weights
            everywhere), and the seed of the sampling generator.

    Raises:
        ConfigError: torch is missing (the message says how to install it), or an unknown
            ``kind``.
    """

    def __init__(
        self,
        obs_shape: Sequence[int],
        num_actions: int,
        kind: str = "mlp",
        hidden: int = 64,
        seed: int = 0,
    ):
        torch = require_torch()
        nn = torch.nn
        torch.set_num_threads(1)
        torch.manual_seed(seed)

        def layer(module: Any, std: float) -> Any:
            nn.init.orthogonal_(module.weight, std)
            nn.init.zeros_(module.bias)
            return module

        root2 = math.sqrt(2.0)
        if kind == "mlp":
            size = int(np.prod(obs_shape))
            self.features: Any = nn.Flatten()
            self.actor = nn.Sequential(
                layer(nn.Linear(size, hidden), root2),
                nn.Tanh(),
                layer(nn.Linear(hidden, hidden), root2),
                nn.Tanh(),
                layer(nn.Linear(hidden, num_actions), 0.01),
            )
            self.critic = nn.Sequential(
                layer(nn.Linear(size, hidden), root2),
                nn.Tanh(),
                layer(nn.Linear(hidden, hidden), root2),
                nn.Tanh(),
                layer(nn.Linear(hidden, 1), 1.0),
            )
            self.scale = 1.0
        elif kind == "cnn":
            self.features = nn.Sequential(
                layer(nn.Conv2d(obs_shape[0], 32, 8, stride=4), root2),
                nn.ReLU(),
                layer(nn.Conv2d(32, 64, 4, stride=2), root2),
                nn.ReLU(),
                layer(nn.Conv2d(64, 64, 3, stride=1), root2),
                nn.ReLU(),
                nn.Flatten(),
                layer(nn.Linear(64 * 7 * 7, 512), root2),
                nn.ReLU(),
            )
            self.actor = layer(nn.Linear(512, num_actions), 0.01)
            self.critic = layer(nn.Linear(512, 1), 1.0)
            self.scale = 1.0 / 255.0
        else:
            raise ConfigError(f"unknown policy kind {kind!r}; choose from mlp, cnn")
        self.kind = kind
        self.generator = torch.Generator().manual_seed(seed)

    def parameters(self) -> list[Any]:
        """The parameters: the shared features' (``"cnn"``), the logits', the value's."""
        return [*self.features.parameters(), *self.actor.parameters(), *self.critic.parameters()]

    def seed(self, seed: int) -> None:
        """Reseed the sampling generator (the Sampler calls it in each worker)."""
        self.generator.manual_seed(int(seed))

    def prepare(self, obs: Any) -> Any:
        """Observations as the float32 tensor the layers take (divided by 255 for ``cnn``)."""
        import torch

        x = torch.as_tensor(np.asarray(obs), dtype=torch.float32)
        return x * self.scale if self.scale != 1.0 else x

    def forward(self, x: Any) -> tuple[Any, Any]:
        """``(logits [n, num_actions], values [n])`` of a prepared batch (with gradients)."""
        features = self.features(x)
        return self.actor(features), self.critic(features).squeeze(-1)

    def __call__(self, obs: Any) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        import torch

        if torch.get_num_threads() != 1:  # a fresh worker process
            torch.set_num_threads(1)
        with torch.no_grad():
            logits, value = self.forward(self.prepare(obs))
            log_probs = torch.log_softmax(logits, dim=-1)
            actions = torch.multinomial(log_probs.exp(), 1, generator=self.generator)
            logp = log_probs.gather(-1, actions).squeeze(-1)
        return actions.squeeze(-1).numpy(), {"logp": logp.numpy(), "value": value.numpy()}

    def values(self, obs: Any) -> np.ndarray:
        """The ``float32[n]`` values of observations ``[n, *obs_shape]``."""
        import torch

        with torch.no_grad():
            features = self.features(self.prepare(obs))
            return np.asarray(self.critic(features).squeeze(-1).numpy())


class _Learner:
    """The policy, its optimizer and the minibatch shuffler of one run (seeded with
    ``seed``; the shuffler with ``seed + 1``)."""

    def __init__(self, workload: TrainWorkload, seed: int):
        torch = require_torch()
        probe = workload.factory()()
        try:
            obs_space, act_space = probe.observation_space, probe.action_space
        finally:
            probe.close()
        if not isinstance(act_space, gymnasium.spaces.Discrete) or not isinstance(
            obs_space, gymnasium.spaces.Box
        ):
            raise ConfigError(
                f"{workload.env_id}: this PPO needs Box observations and Discrete actions"
            )
        self.config = workload.ppo
        self.policy = PPOPolicy(
            obs_space.shape, int(act_space.n), workload.policy, workload.ppo.hidden, seed
        )
        self.optimizer = torch.optim.Adam(
            self.policy.parameters(), lr=workload.ppo.learning_rate, eps=1e-5
        )
        self.shuffle = torch.Generator().manual_seed(seed + 1)

    def learn(
        self,
        obs: np.ndarray,
        actions: np.ndarray,
        logp: np.ndarray,
        advantages: np.ndarray,
        returns: np.ndarray,
        lr: float,
        stale: np.ndarray | None = None,
    ) -> None:
        """``epochs`` passes of clipped PPO over ``B`` transitions in shuffled minibatches
        (the last one smaller when ``minibatch_size`` does not divide ``B``; one of a single
        transition is skipped, its advantage cannot be normalised).

        Steps chosen by an older policy than the one about to be updated (``stale``, from a
        Sampler's ``prefetch``) take decoupled PPO's objective (Hilton et al. 2021, "Batch
        size-invariance for policy optimization", arXiv:2110.00641): the ratio is clipped
        around the policy as it is before this update (the *proximal* policy, whose
        log-probabilities are computed once here), and each step's term is weighted by
        ``min(1, pi_prox / pi_behaviour)``, the importance weight of the policy that chose it,
        truncated as IMPALA's V-trace truncates it (``benchmarks/README.md`` has what the
        truncation changed). On steps of the current policy that is plain PPO, which this
        runs unchanged (bit for bit) when no step is stale.

        Args:
            obs: ``[B, *obs_shape]``; actions: ``int64[B]``; logp: ``float32[B]``, the
                log-probabilities when sampled; advantages, returns: ``float32[B]``.
            lr: Adam's step size for this update.
            stale: ``bool[B]``, the steps of an older policy (``None``: none).
        """
        import torch
        from torch.distributions import Categorical

        c = self.config
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        x = self.policy.prepare(obs)
        act = torch.as_tensor(actions, dtype=torch.int64)
        old = torch.as_tensor(logp, dtype=torch.float32)
        adv = torch.as_tensor(advantages, dtype=torch.float32)
        ret = torch.as_tensor(returns, dtype=torch.float32)
        n = len(act)
        weight = None
        if stale is not None and stale.any():
            with torch.no_grad():
                logits, _ = self.policy.forward(x)
                prox = Categorical(logits=logits, validate_args=False).log_prob(act)
            # pi_prox / pi_behaviour, truncated at 1 as V-trace's rho (IMPALA): a policy one
            # update behind may be far from the proximal one, and the weight's variance with it
            weight = torch.exp(prox - old).clamp(max=1.0)
            old = prox
        params = self.policy.parameters()
        for _ in range(c.epochs):
            order = torch.randperm(n, generator=self.shuffle)
            for first in range(0, n, c.minibatch_size):
                idx = order[first : first + c.minibatch_size]
                if len(idx) < 2:
                    continue
                logits, value = self.policy.forward(x[idx])
                dist = Categorical(logits=logits, validate_args=False)
                ratio = torch.exp(dist.log_prob(act[idx]) - old[idx])
                a = adv[idx]
                a = (a - a.mean()) / (a.std() + 1e-8)
                clipped = torch.clamp(ratio, 1 - c.clip, 1 + c.clip)
                if weight is None:
                    policy_loss = torch.max(-a * ratio, -a * clipped).mean()
                else:
                    w = weight[idx]
                    policy_loss = (w * torch.max(-a * ratio, -a * clipped)).mean()
                value_loss = 0.5 * (value - ret[idx]).pow(2).mean()
                loss = policy_loss - c.ent_coef * dist.entropy().mean() + c.vf_coef * value_loss
                self.optimizer.zero_grad()
                loss.backward()
                torch.nn.utils.clip_grad_norm_(params, c.max_grad_norm)
                self.optimizer.step()

    def digest(self) -> str:
        """A SHA-1 of every parameter's bytes: equal digests, bit-identical weights."""
        h = hashlib.sha1()
        for p in self.policy.parameters():
            h.update(p.detach().numpy().tobytes())
        return h.hexdigest()


def gae(
    rewards: np.ndarray,
    values: np.ndarray,
    next_values: np.ndarray,
    carry: np.ndarray,
    gamma: float,
    lam: float,
) -> np.ndarray:
    """GAE(lambda) advantages of ``[L, C]`` arrays, recursing along ``L`` (time) in each of
    the ``C`` columns (an env's rollout, or a Sampler's segment).

    ``adv[l] = delta[l] + gamma * lam * carry[l] * adv[l + 1]`` with ``delta[l] = rewards[l] +
    gamma * next_values[l] - values[l]`` and ``adv[L] = 0``.

    Args:
        rewards: ``[L, C]``, the reward of each step.
        values: ``[L, C]``, ``V`` of the observation each step acted on.
        next_values: ``[L, C]``, ``V`` of the observation after each step: 0 where the episode
            terminated, its final observation's where it was truncated.
        carry: ``[L, C]``, 1 where step ``l + 1`` of the column continues step ``l``'s
            episode, 0 where the episode (or the column) ends at ``l``.
        gamma, lam: the discount and GAE's lambda.

    Returns:
        ``float64[L, C]`` advantages (the returns are ``advantages + values``).

    Example::

        gae(np.ones((2, 1)), np.zeros((2, 1)), np.zeros((2, 1)), np.array([[1.0], [0.0]]),
            0.5, 1.0)  # [[1.5], [1.0]]
    """
    deltas = np.asarray(rewards, np.float64) + gamma * np.asarray(next_values, np.float64)
    deltas -= np.asarray(values, np.float64)
    decay = (gamma * lam) * np.asarray(carry, np.float64)
    advantages = np.empty_like(deltas)
    running = np.zeros(deltas.shape[1:], dtype=np.float64)
    for step in range(deltas.shape[0] - 1, -1, -1):
        running = deltas[step] + decay[step] * running
        advantages[step] = running
    return advantages


def segment_gae(
    rewards: np.ndarray,
    values: np.ndarray,
    end_values: np.ndarray,
    lengths: np.ndarray,
    gamma: float,
    lam: float,
) -> np.ndarray:
    """GAE(lambda) advantages of steps laid out in segments (an :class:`envfleet.EpisodeBatch`):
    :func:`gae` with one column per segment, the columns padded to the longest.

    Args:
        rewards, values: ``[T]``, the segments' steps one after the other.
        end_values: ``[S]``, the value after each segment's last step (0 where its episode
            terminated there).
        lengths: ``int[S]``, steps per segment (each at least 1, summing to ``T``).
        gamma, lam: the discount and GAE's lambda.

    Returns:
        ``float64[T]`` advantages, in the steps' order.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    total = int(lengths.sum())
    starts = np.cumsum(lengths) - lengths
    last = starts + lengths - 1
    values = np.asarray(values, dtype=np.float64)
    next_values = np.empty(total, dtype=np.float64)
    next_values[:-1] = values[1:]
    next_values[last] = end_values
    carry = np.ones(total, dtype=np.float64)
    carry[last] = 0.0
    column = np.repeat(np.arange(len(lengths)), lengths)
    row = np.arange(total) - np.repeat(starts, lengths)
    shape = (int(lengths.max(initial=0)), len(lengths))

    def padded(flat: np.ndarray) -> np.ndarray:
        grid = np.zeros(shape, dtype=np.float64)
        grid[row, column] = flat
        return grid

    advantages = gae(
        padded(np.asarray(rewards)), padded(values), padded(next_values), padded(carry), gamma, lam
    )
    return advantages[row, column]


class _Returns:
    """Undiscounted returns of finished episodes, summed per env; the last
    :data:`SCORE_EPISODES` are kept."""

    def __init__(self, num_envs: int):
        self.running = np.zeros(num_envs, dtype=np.float64)
        self.recent: deque[float] = deque(maxlen=SCORE_EPISODES)
        self.episodes = 0

    def add(self, env: int, reward_sum: float, done: bool) -> None:
        self.running[env] += reward_sum
        if done:
            self.recent.append(float(self.running[env]))
            self.running[env] = 0.0
            self.episodes += 1

    def add_step(self, rewards: np.ndarray, done: np.ndarray, valid: np.ndarray) -> None:
        """One step of every env (``valid``: the envs whose result is a transition)."""
        self.running += np.where(valid, rewards, 0.0)
        for env in np.flatnonzero(done & valid).tolist():
            self.add(env, 0.0, True)

    def mean(self) -> float:
        """Mean of the kept returns (``nan`` before the first)."""
        return float(np.mean(self.recent)) if self.recent else math.nan

    def reached(self, target: float) -> bool:
        return len(self.recent) == SCORE_EPISODES and self.mean() >= target


# -- the systems -----------------------------------------------------------------------------


class TrainEnvs:
    """A vector env as the PPO loop steps it, whatever its library.

    Attributes:
        next_step_reset: ``True`` where an env whose episode ended is reset by the next step
            (its action ignored, its reward 0: no transition; PufferLib), ``False`` where it
            is reset in the step that ended it (``SAME_STEP``).

    Subclasses implement :meth:`reset`, :meth:`step` and :meth:`close`.
    """

    next_step_reset = False

    def reset(self) -> np.ndarray:
        """Reset every env (env ``i`` seeded ``seed + i``); the observations ``[N, ...]``."""
        raise NotImplementedError

    def step(
        self, actions: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, dict[int, np.ndarray]]:
        """Step every env with ``int64[N]`` actions.

        Returns:
            ``(observations [N, ...], rewards [N], terminated bool[N], truncated bool[N],
            final)``; ``final`` maps each env truncated and not terminated to its final
            observation, where ``observations`` already holds its reset's (``SAME_STEP``;
            empty with ``next_step_reset``, where ``observations`` holds the final one).
        """
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


class _GymEnvs(TrainEnvs):
    """A gymnasium vector env (gymnasium's own, or ``envfleet.make``'s) in ``SAME_STEP``."""

    def __init__(self, envs: Any, seed: int):
        self.envs, self.seed = envs, seed

    def reset(self) -> np.ndarray:
        return np.asarray(self.envs.reset(seed=self.seed)[0])

    def step(
        self, actions: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, dict[int, np.ndarray]]:
        obs, rewards, terminated, truncated, info = self.envs.step(actions)
        cut = truncated & ~terminated
        final = {}
        if cut.any():
            final = {i: info["final_obs"][i] for i in np.flatnonzero(cut).tolist()}
        return obs, rewards, terminated, truncated, final

    def close(self) -> None:
        self.envs.close()


class _SB3Envs(TrainEnvs):
    """SB3's ``SubprocVecEnv``: ``reset()`` returns the observations only, ``step`` returns
    ``(obs, rewards, dones, infos)``, an ended episode's final observation in its info's
    ``terminal_observation`` and ``TimeLimit.truncated`` set where it was cut by a time
    limit."""

    def __init__(self, venv: Any, seed: int):
        self.venv, self.seed = venv, seed

    def reset(self) -> np.ndarray:
        self.venv.seed(self.seed)
        return np.asarray(self.venv.reset())

    def step(
        self, actions: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, dict[int, np.ndarray]]:
        obs, rewards, dones, infos = self.venv.step(actions)
        truncated = np.zeros(len(dones), dtype=np.bool_)
        final = {}
        for i in np.flatnonzero(dones).tolist():
            if infos[i].get("TimeLimit.truncated", False):
                truncated[i] = True
                final[i] = infos[i]["terminal_observation"]
        return obs, rewards, dones & ~truncated, truncated, final

    def close(self) -> None:
        self.venv.close()


class _PufferEnvs(TrainEnvs):
    """PufferLib's vector env: ``reset(seed)``, and an env reset by the step after its
    episode ended (:attr:`TrainEnvs.next_step_reset`). Its arrays are its shared buffers,
    overwritten by the next step: the loop copies what it keeps before stepping again."""

    next_step_reset = True

    def __init__(self, venv: Any, seed: int):
        self.venv, self.seed = venv, seed

    def reset(self) -> np.ndarray:
        return np.array(self.venv.reset(self.seed)[0])

    def step(
        self, actions: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, dict[int, np.ndarray]]:
        obs, rewards, terminals, truncations, _ = self.venv.step(actions)
        return obs, rewards, terminals.copy(), truncations & ~terminals, {}

    def close(self) -> None:
        self.venv.close()


def _gym_sync(factory: EnvFactory, num_envs: int, seed: int) -> TrainEnvs:
    envs = gymnasium.vector.SyncVectorEnv(
        [factory] * num_envs, autoreset_mode=AutoresetMode.SAME_STEP
    )
    return _GymEnvs(envs, seed)


def _gym_async(factory: EnvFactory, num_envs: int, seed: int) -> TrainEnvs:
    envs = gymnasium.vector.AsyncVectorEnv(
        [factory] * num_envs, autoreset_mode=AutoresetMode.SAME_STEP
    )
    return _GymEnvs(envs, seed)


def _sb3_subproc(factory: EnvFactory, num_envs: int, seed: int) -> TrainEnvs:
    from stable_baselines3.common.vec_env import SubprocVecEnv

    method = multiprocessing.get_context().get_start_method()
    return _SB3Envs(SubprocVecEnv([factory] * num_envs, start_method=method), seed)


def _puffer_mp(factory: EnvFactory, num_envs: int, seed: int) -> TrainEnvs:
    import pufferlib.emulation
    import pufferlib.vector

    creator = functools.partial(pufferlib.emulation.GymnasiumPufferEnv, env_creator=factory)
    venv = pufferlib.vector.make(
        creator,
        num_envs=num_envs,
        num_workers=puffer_workers(num_envs),
        batch_size=num_envs,
        backend=pufferlib.vector.Multiprocessing,
        overwork=True,  # the workers are already capped at the usable cores
    )
    return _PufferEnvs(venv, seed)


def _envfleet_make(factory: EnvFactory, num_envs: int, seed: int) -> TrainEnvs:
    envs = envfleet.make(factory, num_envs, autoreset_mode=AutoresetMode.SAME_STEP)
    return _GymEnvs(envs, seed)


def _sampler(factory: EnvFactory, num_envs: int, policy: PPOPolicy, seed: int) -> envfleet.Sampler:
    return envfleet.Sampler(factory, policy, num_envs, seed=seed, progress=False)


def _sampler_prefetch(
    factory: EnvFactory, num_envs: int, policy: PPOPolicy, seed: int
) -> envfleet.Sampler:
    """The Sampler collecting during the update, leaving the learner a core: every env and
    the policy copies in the other cores' workers (worker inference, no envs in the
    learner's process), so the update's one torch thread and the collection run side by
    side."""
    workers = max(1, usable_cores() - 1)
    return envfleet.Sampler(
        factory, policy, num_envs, seed=seed, progress=False, prefetch=True,
        inference="worker", num_workers=workers, driver_envs=0,
    )  # fmt: skip


@dataclass(frozen=True)
class TrainSystem:
    """How one system of the benchmark is built.

    Attributes:
        kind: ``"vector"``: ``build(factory, num_envs, seed)`` returns a :class:`TrainEnvs`
            that the PPO loop steps (``factory``: the workload's picklable zero-argument env
            factory, :meth:`TrainWorkload.factory`); ``"sampler"``: ``build(factory,
            num_envs, policy, seed)`` returns an :class:`envfleet.Sampler` of that policy,
            sampled per update.
        build: the builder.
        what: what it is, for the table's notes.
        package: the module it imports ("" when always there); without it the system is left
            out with ``install``.
        install: the command that installs ``package``.
    """

    kind: str
    build: Callable[..., Any]
    what: str
    package: str = ""
    install: str = ""


#: The systems of the benchmark, in the order of its table: name -> how to build it.
TRAIN_SYSTEMS: dict[str, TrainSystem] = {
    "gym-sync": TrainSystem("vector", _gym_sync, "gymnasium's SyncVectorEnv (SAME_STEP)"),
    "gym-async": TrainSystem("vector", _gym_async, "gymnasium's AsyncVectorEnv (SAME_STEP)"),
    "sb3-subproc": TrainSystem(
        "vector",
        _sb3_subproc,
        "stable-baselines3's SubprocVecEnv",
        "stable_baselines3",
        PEER_INSTALL["sb3-subproc"],
    ),
    "puffer-mp": TrainSystem(
        "vector",
        _puffer_mp,
        "PufferLib's Multiprocessing vector env, every env per step",
        "pufferlib",
        PUFFER_INSTALL,
    ),
    "envfleet": TrainSystem(
        "vector", _envfleet_make, "envfleet.make (processes backend, SAME_STEP)"
    ),
    "sampler": TrainSystem("sampler", _sampler, "envfleet.Sampler, its default inference (auto)"),
    "sampler-prefetch": TrainSystem(
        "sampler",
        _sampler_prefetch,
        "envfleet.Sampler(prefetch=True, inference='worker', num_workers=cores - 1, "
        "driver_envs=0): each batch after the first collected during the update before, one "
        "policy version behind (decoupled PPO on those steps), the learner keeping a core",
    ),
}
#: The peers, to whose best median each system is compared.
TRAIN_PEERS: tuple[str, ...] = ("gym-sync", "gym-async", "sb3-subproc", "puffer-mp")
#: The systems that see the same observations for the same seeds and actions, so learn
#: bit-identically.
SYNC_SYSTEMS: tuple[str, ...] = ("gym-sync", "gym-async", "sb3-subproc", "envfleet")


def train_unavailable(system: str) -> str | None:
    """Why ``system`` cannot run here (``"<system> is not installed: <command>"``), or
    ``None`` when it can.

    Raises:
        ConfigError: an unknown system.
    """
    if system not in TRAIN_SYSTEMS:
        raise ConfigError(f"unknown system {system!r}; choose from {', '.join(TRAIN_SYSTEMS)}")
    spec = TRAIN_SYSTEMS[system]
    if spec.package and importlib.util.find_spec(spec.package) is None:
        return f"{system} ({spec.what}) is not installed: {spec.install}"
    return None


# -- one run ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class TrainPoint:
    """The state of a run after one update.

    Attributes:
        seconds: wall-clock seconds since the run's first reset (or first sample).
        steps: env steps (transitions) so far, summed over the envs.
        mean_return: mean return of the last (up to :data:`SCORE_EPISODES`) finished
            episodes; ``nan`` before the first.
    """

    seconds: float
    steps: int
    mean_return: float


@dataclass(frozen=True)
class TrainRun:
    """One system trained with one seed.

    Attributes:
        system, seed: what ran.
        reached: whether the score reached the target within the budget.
        seconds: wall-clock seconds from the first reset (or sample) to the end of the update
            that reached the target (or of the last update).
        steps: env steps (transitions) by then.
        updates: PPO updates by then.
        episodes: episodes finished by then.
        score: the mean return of the last :data:`SCORE_EPISODES` episodes then.
        startup_s: seconds to build the system (not in ``seconds``).
        learn_s: seconds of ``seconds`` spent computing advantages and updating the model
            (the rest: stepping the envs and the policy's inference).
        digest: SHA-1 of the final parameters (bit-identical learning: equal digests).
        trace: one :class:`TrainPoint` per update.
        note: what the system said of itself (the Sampler: the inference it chose, and why).
    """

    system: str
    seed: int
    reached: bool
    seconds: float
    steps: int
    updates: int
    episodes: int
    score: float
    startup_s: float
    learn_s: float
    digest: str
    trace: tuple[TrainPoint, ...]
    note: str = ""


def train_run(workload: TrainWorkload, system: str, seed: int) -> TrainRun:
    """Train PPO on ``workload`` over ``system`` with ``seed`` until the score reaches the
    target or ``workload.budget`` env steps are spent.

    Seeds: the model's weights (``torch.manual_seed(seed)``), the actions' generator
    (``seed``), the minibatch shuffler (``seed + 1``) and env ``i``'s first reset
    (``seed + i``).

    Raises:
        ConfigError: torch or the system's library missing, an unknown system.
        BenchError: the system failed while built, run or closed.
    """
    reason = train_unavailable(system)
    if reason is not None:
        raise ConfigError(reason)
    learner = _Learner(workload, seed)
    spec = TRAIN_SYSTEMS[system]
    t0 = time.perf_counter()
    try:
        if spec.kind == "sampler":
            built = spec.build(workload.factory(), workload.num_envs, learner.policy, seed)
        else:
            built = spec.build(workload.factory(), workload.num_envs, seed)
    except ConfigError:
        raise
    except Exception as exc:
        raise bench_error(exc, "building", system, workload.env_id) from exc
    startup_s = time.perf_counter() - t0
    finished = False
    try:
        try:
            if spec.kind == "sampler":
                run = _train_sampler(workload, built, learner, system, seed)
            else:
                run = _train_vector(workload, built, learner, system, seed)
        except Exception as exc:
            raise bench_error(exc, "training on", system, workload.env_id) from exc
        finished = True
    finally:
        try:
            built.close()
        except Exception as exc:
            if finished:
                raise bench_error(exc, "closing", system, workload.env_id) from exc
    return replace(run, startup_s=startup_s)


class _Progress:
    """A run's counters and trace; ``point()`` after each update says whether to stop."""

    def __init__(self, workload: TrainWorkload):
        self.workload = workload
        self.returns = _Returns(workload.num_envs)
        self.steps = 0
        self.learn_s = 0.0
        self.trace: list[TrainPoint] = []
        self.start = time.perf_counter()

    def lr(self) -> float:
        c = self.workload.ppo
        if not c.anneal_lr:
            return c.learning_rate
        return c.learning_rate * max(0.0, 1.0 - self.steps / self.workload.budget)

    def point(self) -> bool:
        self.trace.append(
            TrainPoint(time.perf_counter() - self.start, self.steps, self.returns.mean())
        )
        return self.returns.reached(self.workload.target) or self.steps >= self.workload.budget

    def run(self, system: str, seed: int, learner: _Learner, note: str = "") -> TrainRun:
        last = self.trace[-1]
        return TrainRun(
            system,
            seed,
            self.returns.reached(self.workload.target),
            last.seconds,
            last.steps,
            len(self.trace),
            self.returns.episodes,
            last.mean_return,
            math.nan,
            self.learn_s,
            learner.digest(),
            tuple(self.trace),
            note,
        )


def _train_vector(
    workload: TrainWorkload, envs: TrainEnvs, learner: _Learner, system: str, seed: int
) -> TrainRun:
    """CleanRL's loop over a :class:`TrainEnvs`: ``T`` steps of every env into ``[T, N]``
    arrays, GAE along ``T``, one update of the valid transitions (time-major), repeated."""
    c, n = workload.ppo, workload.num_envs
    t_steps = c.steps_per_update
    policy = learner.policy
    progress = _Progress(workload)
    obs = envs.reset()
    pending = np.zeros(n, dtype=np.bool_)  # next_step_reset: the next step only resets
    while True:
        lr = progress.lr()
        obs_buf = np.empty((t_steps, *obs.shape), dtype=obs.dtype)
        actions = np.empty((t_steps, n), dtype=np.int64)
        logp = np.empty((t_steps, n), dtype=np.float32)
        values = np.empty((t_steps, n), dtype=np.float32)
        rewards = np.empty((t_steps, n), dtype=np.float64)
        terminated = np.empty((t_steps, n), dtype=np.bool_)
        truncated = np.empty((t_steps, n), dtype=np.bool_)
        valid = np.empty((t_steps, n), dtype=np.bool_)
        final_values = np.zeros((t_steps, n), dtype=np.float64)
        for t in range(t_steps):
            obs_buf[t] = obs
            valid[t] = ~pending
            act, info = policy(obs)
            actions[t], logp[t], values[t] = act, info["logp"], info["value"]
            obs, rewards[t], terminated[t], truncated[t], final = envs.step(act)
            if final:
                rows = list(final)
                final_values[t, rows] = policy.values(np.stack([final[r] for r in rows]))
            done = terminated[t] | truncated[t]
            progress.returns.add_step(rewards[t], done, valid[t])
            if envs.next_step_reset:
                pending = done & valid[t]
        t0 = time.perf_counter()
        next_values = np.empty((t_steps, n), dtype=np.float64)
        next_values[:-1] = values[1:]
        next_values[-1] = policy.values(obs)
        if not envs.next_step_reset:  # else the next row's value is the final observation's
            next_values = np.where(truncated, final_values, next_values)
        next_values[terminated] = 0.0
        advantages = gae(
            rewards, values, next_values, ~(terminated | truncated), c.gamma, c.gae_lambda
        )
        keep = valid.reshape(-1)
        progress.steps += int(keep.sum())
        learner.learn(
            obs_buf.reshape(t_steps * n, *obs.shape[1:])[keep],
            actions.reshape(-1)[keep],
            logp.reshape(-1)[keep],
            advantages.reshape(-1)[keep].astype(np.float32),
            (advantages + values).reshape(-1)[keep].astype(np.float32),
            lr,
        )
        progress.learn_s += time.perf_counter() - t0
        if progress.point():
            return progress.run(system, seed, learner)


def _train_sampler(
    workload: TrainWorkload, sampler: Any, learner: _Learner, system: str, seed: int
) -> TrainRun:
    """The same PPO over an :class:`envfleet.Sampler`: ``sample(steps_per_update *
    num_envs)``, GAE per segment (segments as the columns of :func:`gae`), one update, then
    ``update_policy()`` (the model changed in place)."""
    c = workload.ppo
    policy = learner.policy
    progress = _Progress(workload)
    while True:
        lr = progress.lr()
        batch = sampler.sample(workload.batch_steps)
        t0 = time.perf_counter()
        total, starts, lengths = batch.num_steps, batch.starts, batch.lengths
        last = starts + lengths - 1
        values = batch.agent_infos["value"].astype(np.float64)
        # The value after a segment's last step: 0 where it terminated, else its value
        # (truncated: the final observation; cut by the sample's end: the next one).
        ends = np.zeros(len(lengths), dtype=np.float64)
        alive = ~batch.terminated[last]
        if alive.any():
            ends[alive] = policy.values(batch.last_observations[alive])
        advantages = segment_gae(batch.rewards, values, ends, lengths, c.gamma, c.gae_lambda)
        sums = np.add.reduceat(batch.rewards, starts)
        for env, total_reward, done in zip(
            batch.env_index.tolist(), sums.tolist(), batch.complete.tolist(), strict=True
        ):
            progress.returns.add(env, total_reward, done)
        progress.steps += total
        stale = np.repeat(batch.policy_version < sampler.policy_version, lengths)
        learner.learn(
            batch.observations,
            batch.actions,
            batch.agent_infos["logp"],
            advantages.astype(np.float32),
            (advantages + values).astype(np.float32),
            lr,
            stale,
        )
        progress.learn_s += time.perf_counter() - t0
        sampler.update_policy(None)
        if progress.point():
            report = sampler.report()
            return progress.run(
                system, seed, learner, note=f"{report.inference} inference, {report.choice}"
            )


# -- every system, several seeds -------------------------------------------------------------


@dataclass(frozen=True)
class TrainResult:
    """One system over the seeds.

    Attributes:
        system: a name from :data:`TRAIN_SYSTEMS`.
        runs: one :class:`TrainRun` per seed, in seed order.
        reached: how many runs reached the target.
        seconds: median over the runs of their seconds to the target (a run that did not
            reach it counts as ``inf``; ``nan`` when skipped).
        steps: median env steps to the target (the same way).
        vs_best_peer_seconds: ``seconds`` over the smallest of the peers' (:data:`TRAIN_PEERS`)
            ``seconds``: below 1, faster than every peer (``nan`` without a peer that reached).
        vs_best_peer_steps: the same of ``steps``.
        skipped: why it did not run (how to install it), else ``None``.
        steps_per_s: median over the runs of their env steps per wall-clock second, learning
            included (end to end; it leaves out how many steps a seed needed).
        vs_best_peer_rate: ``steps_per_s`` over the largest of the peers': above 1, faster
            than every peer.
    """

    system: str
    runs: tuple[TrainRun, ...]
    reached: int
    seconds: float
    steps: float
    vs_best_peer_seconds: float = math.nan
    vs_best_peer_steps: float = math.nan
    skipped: str | None = None
    steps_per_s: float = math.nan
    vs_best_peer_rate: float = math.nan


@dataclass(frozen=True)
class TrainReport:
    """Everything one time-to-score measurement found.

    Attributes:
        workload: the :class:`TrainWorkload`.
        seeds: the seeds that ran, in order (each ran every system).
        seeds_asked: how many seeds were asked for (more than ran when ``max_seconds`` left
            no time for the rest).
        results: one :class:`TrainResult` per system, in the order asked.
        identical: the systems whose every run learned bit-identically to the reference's
            run of the same seed (the same trace of steps and returns, the same final
            parameters); the reference, gym-sync when it ran (else the first system that
            ran), first.
        best_peer_seconds, best_peer_steps: the peers with the smallest median seconds and
            steps ("" when no peer reached).
        machine: what it ran on.
        wall_s: seconds the whole measurement took.
        best_peer_rate: the peer with the largest median steps/s end to end ("" without a
            peer).
    """

    workload: TrainWorkload
    seeds: tuple[int, ...]
    seeds_asked: int
    results: tuple[TrainResult, ...]
    identical: tuple[str, ...]
    best_peer_seconds: str
    best_peer_steps: str
    machine: Machine
    wall_s: float
    best_peer_rate: str = ""


def measure_train(
    workload: TrainWorkload,
    systems: Sequence[str] | None = None,
    seeds: Sequence[int] = (1, 2, 3),
    *,
    max_seconds: float | None = None,
    progress: Callable[[str, int, TrainRun | None], None] | None = None,
) -> TrainReport:
    """Train every system with every seed (:func:`train_run`) and compare their medians.

    Seeds run one after the other, each over every system, the systems' order rotated by one
    from one seed to the next (no system always follows the same one). A system whose
    library is missing is left out with the command that installs it.

    Args:
        workload: a :class:`TrainWorkload` (:data:`TRAIN_WORKLOADS`; ``dataclasses.replace``
            it for another budget).
        systems: names from :data:`TRAIN_SYSTEMS` (default: all of them).
        seeds: the seeds, each run on every system.
        max_seconds: start no further seed when the seeds so far took so long that one more,
            as long as the longest so far, would end after this many seconds from the start
            (``None``: run them all).
        progress: called with ``(system, seed, None)`` before a run and ``(system, seed,
            run)`` after it.

    Returns:
        A :class:`TrainReport`.

    Raises:
        ConfigError: torch missing, unknown systems, no seed, a budget below one update.
        BenchError: a system failed.
    """
    require_torch()
    workload.check()
    names = list(dict.fromkeys(systems if systems is not None else TRAIN_SYSTEMS))
    if not names:
        raise ConfigError("no system to train")
    if not seeds:
        raise ConfigError("no seed to train with")
    if workload.budget < 1:
        raise ConfigError(f"the budget must be >= 1 env step, got {workload.budget}")
    skipped = {s: r for s in names if (r := train_unavailable(s)) is not None}
    active = [s for s in names if s not in skipped]
    runs: dict[str, list[TrainRun]] = {s: [] for s in active}
    start = time.perf_counter()
    done: list[int] = []
    longest = 0.0
    for k, seed in enumerate(seeds):
        elapsed = time.perf_counter() - start
        if done and max_seconds is not None and elapsed + longest > max_seconds:
            break
        t0 = time.perf_counter()
        shift = k % len(active) if active else 0
        for system in active[shift:] + active[:shift]:
            if progress is not None:
                progress(system, seed, None)
            run = train_run(workload, system, seed)
            runs[system].append(run)
            if progress is not None:
                progress(system, seed, run)
        longest = max(longest, time.perf_counter() - t0)
        done.append(seed)

    machine = describe_machine([s for s in active if s in ("sb3-subproc", "puffer-mp")])
    machine.versions["torch"] = require_torch().__version__
    return _summary(
        workload, names, runs, skipped, tuple(done), len(seeds), machine,
        time.perf_counter() - start,
    )  # fmt: skip


def _summary(
    workload: TrainWorkload,
    names: Sequence[str],
    runs: dict[str, list[TrainRun]],
    skipped: dict[str, str],
    seeds: tuple[int, ...],
    seeds_asked: int,
    machine: Machine,
    wall_s: float,
) -> TrainReport:
    """The report of ``runs`` (system -> its runs; ``skipped``: system -> why it did not
    run): medians, the best peers, the ratios and the bit-identical systems."""
    medians = {
        s: (_median_to_score(runs[s], "seconds"), _median_to_score(runs[s], "steps"))
        for s in names
        if s not in skipped
    }
    peers = [s for s in TRAIN_PEERS if s in medians]
    best_s = min(peers, key=lambda s: medians[s][0], default="")
    best_n = min(peers, key=lambda s: medians[s][1], default="")
    best_s = best_s if best_s and math.isfinite(medians[best_s][0]) else ""
    best_n = best_n if best_n and math.isfinite(medians[best_n][1]) else ""
    rates = {s: float(statistics.median([r.steps / r.seconds for r in runs[s]])) for s in medians}
    best_r = max((s for s in peers if math.isfinite(rates[s])), key=rates.__getitem__, default="")
    results = []
    for system in names:
        if system in skipped:
            results.append(TrainResult(system, (), 0, math.nan, math.nan, skipped=skipped[system]))
            continue
        seconds, steps = medians[system]
        mine = sorted(runs[system], key=lambda r: r.seed)
        results.append(
            TrainResult(
                system,
                tuple(mine),
                sum(r.reached for r in mine),
                seconds,
                steps,
                seconds / medians[best_s][0] if best_s else math.nan,
                steps / medians[best_n][1] if best_n else math.nan,
                steps_per_s=rates[system],
                vs_best_peer_rate=rates[system] / rates[best_r] if best_r else math.nan,
            )
        )
    return TrainReport(
        workload,
        seeds,
        seeds_asked,
        tuple(results),
        _identical({s: runs[s] for s in names if s not in skipped}),
        best_s,
        best_n,
        machine,
        wall_s,
        best_r,
    )


def train_report_from_dict(doc: dict[str, Any]) -> TrainReport:
    """The :class:`TrainReport` of a dict from :func:`train_report_dict` (a JSON file read
    back): the runs as they were, the medians, ratios and notes computed again from them.

    Raises:
        ConfigError: a dict that is not such a report (a field missing or of another kind).
    """

    def number(value: Any) -> float:
        return math.nan if value is None else float(value)

    try:
        w = doc["workload"]
        target = math.inf if w["target"] is None else w["target"]  # JSON has no inf
        workload = TrainWorkload(**{**w, "target": target, "ppo": PPOConfig(**w["ppo"])})
        names, runs, skipped = [], {}, {}
        for r in doc["results"]:
            names.append(r["system"])
            if r.get("skipped") is not None:
                skipped[r["system"]] = r["skipped"]
                continue
            runs[r["system"]] = [
                TrainRun(
                    **{
                        **run,
                        "score": number(run["score"]),
                        "startup_s": number(run["startup_s"]),
                        "trace": tuple(
                            TrainPoint(p["seconds"], p["steps"], number(p["mean_return"]))
                            for p in run["trace"]
                        ),
                    }
                )
                for run in r["runs"]
            ]
        machine = Machine(**doc["machine"])
        return _summary(
            workload, names, runs, skipped, tuple(doc["seeds"]), int(doc["seeds_asked"]),
            machine, float(doc["wall_s"]),
        )  # fmt: skip
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(f"not a time-to-score report: {type(exc).__name__}: {exc}") from exc


def _median_to_score(runs: Sequence[TrainRun], what: str) -> float:
    """Median of the runs' seconds or steps, a run that did not reach the target as ``inf``."""
    if not runs:
        return math.nan
    values = [float(getattr(r, what)) if r.reached else math.inf for r in runs]
    return float(statistics.median(values))


def _identical(runs: dict[str, list[TrainRun]]) -> tuple[str, ...]:
    """The systems whose every run matches the reference's run of its seed (trace of steps
    and returns, final parameters), the reference first (gym-sync, else the first)."""
    ran = [s for s, r in runs.items() if r]
    if not ran:
        return ()
    reference = "gym-sync" if "gym-sync" in ran else ran[0]

    def key(run: TrainRun) -> tuple[Any, ...]:
        trace = tuple((p.steps, _nan_safe(p.mean_return)) for p in run.trace)
        return run.seed, run.digest, trace

    want = {r.seed: key(r) for r in runs[reference]}
    same = [s for s in ran if s != reference and all(want.get(r.seed) == key(r) for r in runs[s])]
    return (reference, *same) if same else (reference,)


def _nan_safe(value: float) -> float | None:
    return None if math.isnan(value) else value


# -- output ----------------------------------------------------------------------------------


def train_report_dict(report: TrainReport) -> dict[str, Any]:
    """A report as a JSON-ready dict: the fields of :class:`TrainReport`, nested as dicts
    (``nan`` and ``inf`` become ``None``: a median that is ``None`` with runs did not
    reach the target)."""

    doc = dict(json_ready(asdict(report)))
    doc["peers"] = list(TRAIN_PEERS)
    doc["score_episodes"] = SCORE_EPISODES
    return doc


def _fmt_steps(value: float) -> str:
    return f"{value:,.0f}" if math.isfinite(value) else "not reached"


def _fmt_ratio(value: float) -> str:
    return f"{value:.2f}" if math.isfinite(value) else "-"


def train_table(report: TrainReport) -> str:
    """A report as Markdown: a line on what ran, then ``system | reached | seconds to score |
    vs best peer | env steps to score | vs best peer | steps/s end to end | learning share |
    seconds per seed`` (a workload without a score, ``pong``: ``system | steps/s end to end |
    vs best peer | seconds | learning share | seconds per seed``; a system left out says
    why: how to install it), then notes: the best peers, which systems learned
    bit-identically, what each Sampler chose."""
    w, c = report.workload, report.workload.ppo
    seeds = ", ".join(map(str, report.seeds))
    ran = len(report.seeds)
    seed_note = f"seed {seeds}" if ran == 1 else f"seeds {seeds}"
    if ran < report.seeds_asked:
        seed_note += f" ({ran} of the {report.seeds_asked} asked: no time left for more)"
    if w.scored:
        what = (
            f"time to a mean return of {w.target:g} over the last {SCORE_EPISODES} finished "
            f"episodes (budget {w.budget:,} env steps)"
        )
        header = (
            "| system | reached | seconds to score | vs best peer | env steps to score "
            "| vs best peer | steps/s end to end | learning share | seconds per seed |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---|",
        )
    else:
        what = f"env steps/s end to end, PPO learning included, over the first {w.budget:,} steps"
        header = (
            "| system | steps/s end to end | vs best peer | seconds | learning share "
            "| seconds per seed |",
            "|---|---:|---:|---:|---:|---|",
        )
    model = (
        f"{c.hidden}-{c.hidden} tanh actor and critic"
        if w.policy == "mlp"
        else "Nature CNN shared by the policy and value heads"
    )
    lines = [
        f"{w.env_id} x{w.num_envs}: {what}; {seed_note}, medians; "
        f"{report.wall_s / 60:.1f} min in all",
        "",
        f"PPO ({w.source}): {c.steps_per_update} steps x {w.num_envs} envs per update, "
        f"minibatches of {c.minibatch_size}, {c.epochs} epochs, lr {c.learning_rate:g}"
        f"{' annealed' if c.anneal_lr else ''}, gamma {c.gamma:g}, lambda {c.gae_lambda:g}, "
        f"clip {c.clip:g}, ent {c.ent_coef:g}, vf {c.vf_coef:g}, max grad norm "
        f"{c.max_grad_norm:g}; {model}, torch on the CPU, 1 thread",
        "",
        machine_line(report.machine, 200),
        "",
        *header,
    ]
    for r in report.results:
        if r.skipped is not None:
            dashes = " - |" * (header[1].count("|") - 3)
            lines.append(f"| {r.system} | {r.skipped} |{dashes}")
            continue
        share = sum(run.learn_s for run in r.runs) / max(1e-9, sum(run.seconds for run in r.runs))
        if not w.scored:
            seconds = statistics.median(run.seconds for run in r.runs)
            per_seed = ", ".join(f"{run.seconds:.1f}" for run in r.runs)
            lines.append(
                f"| {r.system} | {r.steps_per_s:,.0f} | {_fmt_ratio(r.vs_best_peer_rate)} "
                f"| {seconds:.1f} | {share:.2f} | {per_seed} |"
            )
            continue
        per_seed = ", ".join(
            f"{run.seconds:.1f}" if run.reached else f">{run.seconds:.1f} (not reached)"
            for run in r.runs
        )
        seconds_text = f"{r.seconds:.1f}" if math.isfinite(r.seconds) else "not reached"
        lines.append(
            f"| {r.system} | {r.reached}/{len(r.runs)} | {seconds_text} "
            f"| {_fmt_ratio(r.vs_best_peer_seconds)} | {_fmt_steps(r.steps)} "
            f"| {_fmt_ratio(r.vs_best_peer_steps)} | {r.steps_per_s:,.0f} | {share:.2f} "
            f"| {per_seed} |"
        )
    peers = ", ".join(TRAIN_PEERS)
    if w.scored:
        lines += [
            "",
            f"vs best peer: the system's median over the best peer's (peers: {peers}; best by "
            f"seconds: {report.best_peer_seconds or 'none reached'}, by steps: "
            f"{report.best_peer_steps or 'none reached'}); below 1 is faster, or fewer steps",
            "seconds: wall-clock from the first reset (or sample) to the end of the update that "
            "reached the target, start-up excluded; a run that did not reach it counts as "
            "infinite in the median. steps/s end to end: env steps over those seconds (median "
            "of the seeds), learning included. learning share: the part of those seconds spent "
            "on GAE and the PPO update, the rest is stepping the envs and the policy's inference",
        ]
    else:
        lines += [
            "",
            f"vs best peer: the system's steps/s over the best peer's (peers: {peers}; best: "
            f"{report.best_peer_rate or 'none ran'}); above 1 is faster",
            "steps/s end to end: env steps over the wall-clock seconds from the first reset (or "
            "sample) to the end of the last update, start-up excluded (median of the seeds). "
            "learning share: the part of those seconds spent on GAE and the PPO update, the "
            "rest is stepping the envs and the policy's inference",
        ]
    if len(report.identical) > 1:
        lines.append(
            f"bit-identical learning (every seed: the same steps, returns and final "
            f"parameters as {report.identical[0]}): {', '.join(report.identical[1:])}"
        )
    by_name = {r.system: r for r in report.results}
    differ = [
        s for s in SYNC_SYSTEMS if s in by_name and by_name[s].runs and s not in report.identical
    ]
    if differ and report.identical:
        lines.append(f"not bit-identical to {report.identical[0]}: {', '.join(differ)}")
    for r in report.results:
        notes = list(dict.fromkeys(run.note for run in r.runs if run.note))
        for note in notes:
            lines.append(f"{r.system}: {note}")
    return "\n".join(lines) + "\n"


#: The colours and line styles of the plot: envfleet's systems solid, the peers dashed.
_TRAIN_STYLES: dict[str, dict[str, Any]] = {
    "gym-sync": {"color": "tab:blue", "linestyle": "--"},
    "gym-async": {"color": "tab:cyan", "linestyle": "--"},
    "sb3-subproc": {"color": "tab:green", "linestyle": "--"},
    "puffer-mp": {"color": "tab:gray", "linestyle": "--"},
    "envfleet": {"color": "tab:red", "linestyle": "-"},
    "sampler": {"color": "tab:orange", "linestyle": "-"},
    "sampler-prefetch": {"color": "tab:purple", "linestyle": "-"},
}


def plot_train(report: TrainReport, path: str) -> tuple[int, int]:
    """Draw a report into an image file (PNG, or any format matplotlib knows from the
    extension): mean return of the last :data:`SCORE_EPISODES` episodes against wall-clock
    seconds (left; env steps instead for a workload without a score, whose slope is the
    steps/s end to end) and against env steps (right), one line per system: its median seed
    bold (the median of seconds on the left, of steps on the right), its other seeds faint
    (the lines of systems that learn bit-identically coincide on the right); the target as a
    dotted line.

    Returns:
        The image's size in pixels, ``(width, height)``.

    Raises:
        ConfigError: matplotlib is missing (the message says what to install), or no system
            ran.
        OSError: the file cannot be written.
    """
    require_matplotlib()
    from matplotlib.figure import Figure
    from matplotlib.ticker import EngFormatter

    ran = [r for r in report.results if r.runs]
    if not ran:
        raise ConfigError("nothing to plot: no system ran")
    width_in, height_in = 12.0, 4.8
    fig = Figure(figsize=(width_in, height_in), dpi=PLOT_DPI, layout="constrained")
    by_time, by_steps = fig.subplots(1, 2)
    w = report.workload
    # Left: the return against seconds, or, without a score, the steps against seconds (the
    # slope is the steps/s end to end). Right: the return against steps.
    left_y = "mean_return" if w.scored else "steps"
    for r in ran:
        style = {"linewidth": 1.2, **_TRAIN_STYLES.get(r.system, {})}
        # Each panel's bold run is the median of its x axis: seconds left, steps right.
        panels = ((by_time, "seconds", left_y), (by_steps, "steps", "mean_return"))
        for ax, x, y in panels:
            middle = _median_run(r.runs, x)
            for run in r.runs:
                bold = run is middle
                (line,) = ax.plot(
                    [getattr(p, x) for p in run.trace],
                    [getattr(p, y) for p in run.trace],
                    label=r.system if bold and ax is by_time else None,
                    **{
                        **style,
                        "alpha": 1.0 if bold else 0.25,
                        "linewidth": 2.0 if bold else 0.8,
                    },
                )
                style.setdefault("color", line.get_color())
    by_steps.xaxis.set_major_formatter(EngFormatter(sep=""))
    for ax in (by_time, by_steps):
        if w.scored:
            ax.axhline(w.target, color="black", linestyle=":", linewidth=1.2, label="target")
        ax.grid(True, alpha=0.3)
        ax.set_ylabel(f"mean return, last {SCORE_EPISODES} episodes")
    if not w.scored:
        by_time.set_ylabel("env steps")
        by_time.yaxis.set_major_formatter(EngFormatter(sep=""))
    by_time.set_xlabel("wall-clock seconds")
    by_steps.set_xlabel("env steps")
    by_time.legend(fontsize=8, loc="lower right")
    seeds = len(report.seeds)
    same = (
        f"; right: {', '.join(report.identical)} learn bit-identically, their lines coincide"
        if len(report.identical) > 1
        else ""
    )
    goal = f"to {w.target:g}" if w.scored else f"over the first {w.budget:,} steps"
    fig.suptitle(
        f"{w.env_id} x{w.num_envs}, PPO {goal}: median seed bold, "
        f"{'the other seeds faint' if seeds > 1 else 'one seed'}{same}\n"
        + machine_line(report.machine, 160),
        fontsize=9,
    )
    fig.savefig(path, dpi=PLOT_DPI)
    return round(width_in * PLOT_DPI), round(height_in * PLOT_DPI)


def _median_run(runs: Sequence[TrainRun], what: str) -> TrainRun:
    """The run with the (lower) median ``what`` (``"seconds"`` or ``"steps"``) to the target,
    the runs that did not reach it last; ties go to the lower seed."""
    ordered = sorted(runs, key=lambda r: (not r.reached, getattr(r, what), r.seed))
    return ordered[(len(ordered) - 1) // 2]
