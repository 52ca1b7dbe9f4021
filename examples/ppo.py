"""The one PPO of the examples and of ``benchmarks/train.py``: CleanRL's agent, GAE and the
clipped update, written once.

The examples are single files in CleanRL's manner but for this module: ``ppo_cartpole.py``,
``ppo_atari.py`` and ``benchmarks/train.py`` import it by path (they put ``examples/`` on
``sys.path``). It holds the learning, not the collection: each of them steps its envs its own
way (``envfleet.Sampler``, a plain loop over a vector env) and hands the steps here.

- :class:`Agent`: CleanRL's actor-critic, ``"mlp"`` (``ppo.py``: separate 64-64 tanh MLPs for
  the logits and the value) or ``"cnn"`` (``ppo_atari.py``: the Nature CNN on frame stacks
  divided by 255, shared by a linear policy head and a linear value head). Orthogonal
  initialisation (gain sqrt(2); 0.01 for the logits, 1 for the value), biases 0.
- :class:`Policy`: the agent as the Sampler's policy: observations in, ``(actions, {"logp",
  "value"})`` out, the actions drawn with its own seeded ``torch.Generator``.
- :func:`gae` over ``[T, N]`` rollouts, :func:`segment_gae` over an
  :class:`envfleet.EpisodeBatch`'s segments: an episode cut by its time limit (or a segment
  cut by the end of the sample) bootstraps from the value of the observation after it
  (:func:`end_values`), one that terminated does not.
- :class:`PPO`: Adam (``eps=1e-5``), the clipped surrogate over shuffled minibatches with
  per-minibatch advantage normalisation, an entropy bonus, the value loss (clipped as
  CleanRL's ``clip_vloss`` when :attr:`PPOConfig.clip_value`), gradients clipped to a global
  norm. Steps chosen by an older policy than the one updated (a Sampler's ``prefetch``) take
  decoupled PPO's objective (:meth:`PPO.update`).
- :class:`EpisodeReturns`: the returns of finished episodes, for the score.
"""

from __future__ import annotations

import argparse
import hashlib
import math
import sys
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import cloudpickle
import numpy as np
import torch
from torch import nn
from torch.distributions import Categorical

import envfleet

# A worker process (the Sampler's worker inference) cannot import this file, which is not
# installed: the policy's classes travel to it by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


@dataclass(frozen=True)
class PPOConfig:
    """PPO's hyperparameters.

    Attributes:
        steps_per_update: steps of every env per update (CleanRL's ``num_steps``, SB3's
            ``n_steps``); an update learns from ``steps_per_update * num_envs`` transitions.
        minibatch_size: transitions per gradient step (SB3's ``batch_size``).
        epochs: passes over the update's transitions (``n_epochs``).
        learning_rate: Adam's step size at the start.
        anneal_lr: decay the step size linearly to 0 over the run (:meth:`lr`).
        gamma: discount.
        gae_lambda: GAE's lambda.
        clip: the surrogate's clip range (and the value's, with ``clip_value``).
        ent_coef: weight of the entropy bonus.
        vf_coef: weight of the value loss (``0.5 * mse``, CleanRL's).
        max_grad_norm: gradients clipped to this global norm.
        hidden: width of the two hidden layers of the ``"mlp"`` actor and critic.
        clip_value: clip the value's change around its value when sampled, the loss the
            larger of the clipped and unclipped errors (CleanRL's ``clip_vloss``).
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
    clip_value: bool = False

    def lr(self, done: float) -> float:
        """The step size once the fraction ``done`` of the run is done (annealed or not)."""
        if not self.anneal_lr:
            return self.learning_rate
        return self.learning_rate * max(0.0, 1.0 - done)

    @classmethod
    def from_args(
        cls, args: argparse.Namespace, steps_per_update: int, num_envs: int, **more: Any
    ) -> PPOConfig:
        """The config of an example's command line (the options of :func:`add_arguments`):
        ``--minibatches`` minibatches of each update's ``steps_per_update * num_envs``
        steps; ``more``: the other fields."""
        return cls(
            steps_per_update=steps_per_update,
            minibatch_size=max(1, steps_per_update * num_envs // args.minibatches),
            epochs=args.epochs,
            learning_rate=args.lr,
            anneal_lr=args.anneal_lr,
            gamma=args.gamma,
            gae_lambda=args.lam,
            clip=args.clip,
            ent_coef=args.ent_coef,
            vf_coef=args.vf_coef,
            max_grad_norm=args.max_grad_norm,
            **more,
        )


def add_arguments(
    parser: argparse.ArgumentParser,
    *,
    lr: float,
    epochs: int,
    clip: float = 0.2,
    ent_coef: float = 0.0,
) -> None:
    """PPO's options on an example's command line, CleanRL's names and defaults but for those
    given (:meth:`PPOConfig.from_args` reads them)."""
    parser.add_argument("--lr", type=float, default=lr)
    parser.add_argument("--anneal-lr", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--epochs", type=int, default=epochs)
    parser.add_argument("--minibatches", type=int, default=4)
    parser.add_argument("--gamma", type=float, default=0.99)
    parser.add_argument("--lam", type=float, default=0.95)
    parser.add_argument("--clip", type=float, default=clip)
    parser.add_argument("--ent-coef", type=float, default=ent_coef)
    parser.add_argument("--vf-coef", type=float, default=0.5)
    parser.add_argument("--max-grad-norm", type=float, default=0.5)


# -- the agent and the policy ----------------------------------------------------------------


def _layer(module: Any, std: float) -> Any:
    """Orthogonal weights with gain ``std``, zero biases (CleanRL's ``layer_init``)."""
    nn.init.orthogonal_(module.weight, std)
    nn.init.zeros_(module.bias)
    return module


class Agent(nn.Module):
    """CleanRL's actor-critic for ``Discrete`` actions.

    Args:
        obs_shape: one observation's shape (``(obs_dim,)`` for ``"mlp"``, ``(4, 84, 84)`` for
            ``"cnn"``).
        num_actions: actions of the ``Discrete`` action space.
        kind: ``"mlp"`` or ``"cnn"``.
        hidden: width of the MLPs' hidden layers.
        seed: ``torch.manual_seed(seed)`` before the layers are built (``None``: not seeded).

    Raises:
        ValueError: an unknown ``kind``.
    """

    def __init__(
        self,
        obs_shape: Sequence[int],
        num_actions: int,
        kind: str = "mlp",
        hidden: int = 64,
        seed: int | None = None,
    ):
        super().__init__()
        if seed is not None:
            torch.manual_seed(seed)
        root2 = math.sqrt(2.0)
        self.features: nn.Module
        self.actor: nn.Module
        self.critic: nn.Module
        if kind == "mlp":
            size = int(np.prod(obs_shape))
            self.features = nn.Flatten()
            self.actor, self.critic = (
                nn.Sequential(
                    _layer(nn.Linear(size, hidden), root2),
                    nn.Tanh(),
                    _layer(nn.Linear(hidden, hidden), root2),
                    nn.Tanh(),
                    _layer(nn.Linear(hidden, outputs), std),
                )
                for outputs, std in ((num_actions, 0.01), (1, 1.0))
            )
            self.scale = 1.0
        elif kind == "cnn":
            self.features = nn.Sequential(
                _layer(nn.Conv2d(obs_shape[0], 32, 8, stride=4), root2),
                nn.ReLU(),
                _layer(nn.Conv2d(32, 64, 4, stride=2), root2),
                nn.ReLU(),
                _layer(nn.Conv2d(64, 64, 3, stride=1), root2),
                nn.ReLU(),
                nn.Flatten(),
                _layer(nn.Linear(64 * 7 * 7, 512), root2),
                nn.ReLU(),
            )
            self.actor = _layer(nn.Linear(512, num_actions), 0.01)
            self.critic = _layer(nn.Linear(512, 1), 1.0)
            self.scale = 1.0 / 255.0
        else:
            raise ValueError(f"unknown agent kind {kind!r}; choose from mlp, cnn")
        self.kind = kind

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    def prepare(self, obs: Any) -> torch.Tensor:
        """Observations ``[n, *obs_shape]`` (numpy, any numeric dtype) as the float32 tensor
        the layers take, on the agent's device (divided by 255 for ``"cnn"``)."""
        x = torch.as_tensor(np.asarray(obs), device=self.device).to(torch.float32)
        return x * self.scale if self.scale != 1.0 else x

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(logits [n, num_actions], values [n])`` of a prepared batch."""
        features = self.features(x)
        return self.actor(features), self.critic(features).squeeze(-1)

    def values(self, obs: Any) -> np.ndarray:
        """The ``float32[n]`` values of observations ``[n, *obs_shape]`` (no gradients)."""
        with torch.no_grad():
            features = self.features(self.prepare(obs))
            return np.asarray(self.critic(features).squeeze(-1).cpu().numpy())


class Policy:
    """The agent as a batched policy (the Sampler's kind of policy).

    Calling it with observations ``[n, *obs_shape]`` returns ``(actions, {"logp": ...,
    "value": ...})``: ``int64[n]`` actions drawn from the logits' Categorical with the policy's
    own generator (on the CPU, wherever the agent runs), their ``float32[n]``
    log-probabilities and the ``float32[n]`` values, under ``torch.no_grad()`` with
    ``threads`` torch threads. It pickles (a Sampler's worker gets its own copy, which
    :meth:`seed` reseeds).
    """

    def __init__(self, agent: Agent, seed: int = 0, threads: int = 1):
        self.agent = agent
        self.threads = threads
        self.generator = torch.Generator().manual_seed(seed)

    def seed(self, seed: int | None) -> None:
        """Reseed the sampling generator (the Sampler calls it in each worker); ``None``:
        from a fresh random seed."""
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(int(seed))

    def __call__(self, obs: Any) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        if torch.get_num_threads() != self.threads:  # a fresh worker process
            torch.set_num_threads(self.threads)
        with torch.no_grad():
            logits, value = self.agent(self.agent.prepare(obs))
            log_probs = torch.log_softmax(logits, dim=-1).cpu()
            actions = torch.multinomial(log_probs.exp(), 1, generator=self.generator)
            logp = log_probs.gather(-1, actions).squeeze(-1)
        return actions.squeeze(-1).numpy(), {"logp": logp.numpy(), "value": value.cpu().numpy()}


# -- advantages ------------------------------------------------------------------------------


def gae(
    rewards: np.ndarray,
    values: np.ndarray,
    next_values: np.ndarray,
    carry: np.ndarray,
    gamma: float,
    lam: float,
) -> np.ndarray:
    """GAE(lambda) advantages of ``[L, C]`` arrays, recursing along ``L`` (time) in each of
    the ``C`` columns (an env's rollout, or a segment).

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


def end_values(batch: envfleet.EpisodeBatch, agent: Agent) -> np.ndarray:
    """``float64[S]``, the value after each segment's last step: 0 where its episode
    terminated, else the value of ``batch.last_observations`` (truncated: the episode's final
    observation; cut by the end of the sample: the next one)."""
    last = batch.starts + batch.lengths - 1
    ends = np.zeros(len(batch.lengths), dtype=np.float64)
    alive = ~batch.terminated[last]
    if alive.any():
        ends[alive] = agent.values(batch.last_observations[alive])
    return ends


def segment_gae(
    batch: envfleet.EpisodeBatch,
    end_values: np.ndarray,
    gamma: float,
    lam: float,
    rewards: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """GAE(lambda) of a batch's steps, segment by segment: :func:`gae` with one column per
    segment, the columns padded to the longest.

    Within a segment, step ``t`` bootstraps from the value of step ``t + 1``; a segment's last
    step from 0 if it ``terminated``, else from ``end_values[s]``. The recursion never crosses
    from one segment into the next (another env, or the next episode).

    Args:
        batch: the steps; ``batch.agent_infos["value"]`` holds ``V(observations)``.
        end_values: ``float[S]``, the value after each segment's last step (:func:`end_values`;
            ignored where the segment terminated).
        rewards: ``float[T]``, the rewards to learn from (default ``batch.rewards``; e.g.
            clipped to their sign).

    Returns:
        ``(advantages, returns)``, ``float32[T]`` each; ``returns = advantages + values``.
    """
    lengths, starts, total = batch.lengths, batch.starts, batch.num_steps
    last = starts + lengths - 1
    values = batch.agent_infos["value"].astype(np.float64)
    next_values = np.empty(total, dtype=np.float64)
    next_values[:-1] = values[1:]
    next_values[last] = np.where(batch.terminated[last], 0.0, end_values)
    carry = np.ones(total, dtype=np.float64)
    carry[last] = 0.0
    column = np.repeat(np.arange(len(lengths)), lengths)
    row = np.arange(total) - np.repeat(starts, lengths)
    shape = (int(lengths.max(initial=0)), len(lengths))

    def padded(flat: np.ndarray) -> np.ndarray:
        grid = np.zeros(shape, dtype=np.float64)
        grid[row, column] = flat
        return grid

    steps = batch.rewards if rewards is None else rewards
    grid = gae(padded(steps), padded(values), padded(next_values), padded(carry), gamma, lam)
    advantages = grid[row, column]
    return advantages.astype(np.float32), (advantages + values).astype(np.float32)


# -- the update ------------------------------------------------------------------------------


class PPO:
    """The agent's optimizer (Adam, ``eps=1e-5``) and its minibatch shuffler (a
    ``torch.Generator`` seeded ``seed + 1``), and the clipped update."""

    def __init__(self, agent: Agent, config: PPOConfig, seed: int):
        self.agent, self.config = agent, config
        self.optimizer = torch.optim.Adam(agent.parameters(), lr=config.learning_rate, eps=1e-5)
        self.shuffle = torch.Generator().manual_seed(seed + 1)

    def update(
        self,
        obs: np.ndarray,
        actions: np.ndarray,
        logp: np.ndarray,
        advantages: np.ndarray,
        returns: np.ndarray,
        lr: float,
        stale: np.ndarray | None = None,
        values: np.ndarray | None = None,
    ) -> float:
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
            values: ``float32[B]``, the values when sampled (needed with ``clip_value``).

        Returns:
            The last minibatch's loss (``nan`` when no minibatch ran).
        """
        c, device = self.config, self.agent.device
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        x = self.agent.prepare(obs)
        act = torch.as_tensor(actions, dtype=torch.int64, device=device)
        old = torch.as_tensor(logp, dtype=torch.float32, device=device)
        adv = torch.as_tensor(advantages, dtype=torch.float32, device=device)
        ret = torch.as_tensor(returns, dtype=torch.float32, device=device)
        old_values = None
        if c.clip_value:
            assert values is not None, "clip_value needs the values when sampled"
            old_values = torch.as_tensor(values, dtype=torch.float32, device=device)
        n = len(act)
        weight = None
        if stale is not None and stale.any():
            with torch.no_grad():
                logits, _ = self.agent(x)
                prox = Categorical(logits=logits, validate_args=False).log_prob(act)
            # pi_prox / pi_behaviour, truncated at 1 as V-trace's rho (IMPALA): a policy one
            # update behind may be far from the proximal one, and the weight's variance with it
            weight = torch.exp(prox - old).clamp(max=1.0)
            old = prox
        params = list(self.agent.parameters())
        loss = torch.tensor(math.nan)
        for _ in range(c.epochs):
            order = torch.randperm(n, generator=self.shuffle).to(device)
            for first in range(0, n, c.minibatch_size):
                idx = order[first : first + c.minibatch_size]
                if len(idx) < 2:
                    continue
                logits, value = self.agent(x[idx])
                dist = Categorical(logits=logits, validate_args=False)
                ratio = torch.exp(dist.log_prob(act[idx]) - old[idx])
                a = adv[idx]
                a = (a - a.mean()) / (a.std() + 1e-8)
                clipped = torch.clamp(ratio, 1 - c.clip, 1 + c.clip)
                if weight is None:
                    policy_loss = torch.max(-a * ratio, -a * clipped).mean()
                else:
                    policy_loss = (weight[idx] * torch.max(-a * ratio, -a * clipped)).mean()
                if old_values is None:
                    value_loss = 0.5 * (value - ret[idx]).pow(2).mean()
                else:
                    before = old_values[idx]
                    moved = before + (value - before).clamp(-c.clip, c.clip)
                    worst = torch.max((value - ret[idx]) ** 2, (moved - ret[idx]) ** 2)
                    value_loss = 0.5 * worst.mean()
                loss = policy_loss - c.ent_coef * dist.entropy().mean() + c.vf_coef * value_loss
                self.optimizer.zero_grad()
                loss.backward()
                torch.nn.utils.clip_grad_norm_(params, c.max_grad_norm)
                self.optimizer.step()
        return float(loss.item())

    def learn(
        self,
        batch: envfleet.EpisodeBatch,
        lr: float,
        policy_version: int | None = None,
        rewards: np.ndarray | None = None,
    ) -> float:
        """:meth:`update` on a batch: advantages per segment (:func:`segment_gae`), the steps
        of a policy older than ``policy_version`` (the Sampler's, now) stale.

        Args:
            batch: the steps, with ``agent_infos`` ``"logp"`` and ``"value"``.
            lr: Adam's step size for this update.
            policy_version: the policy version being updated (``None``: no step is stale).
            rewards: the rewards to learn from (default ``batch.rewards``).

        Returns:
            The last minibatch's loss.
        """
        c = self.config
        ends = end_values(batch, self.agent)
        advantages, returns = segment_gae(batch, ends, c.gamma, c.gae_lambda, rewards)
        stale = None
        if policy_version is not None:
            stale = np.repeat(batch.policy_version < policy_version, batch.lengths)
        infos = batch.agent_infos
        return self.update(
            batch.observations, batch.actions, infos["logp"], advantages, returns, lr, stale,
            infos["value"],
        )  # fmt: skip

    def digest(self) -> str:
        """A SHA-1 of every parameter's bytes: equal digests, bit-identical weights."""
        h = hashlib.sha1()
        for p in self.agent.parameters():
            h.update(p.detach().cpu().numpy().tobytes())
        return h.hexdigest()


# -- the score -------------------------------------------------------------------------------


class EpisodeReturns:
    """Undiscounted returns of finished episodes, summed per env across rollouts (a segment
    continues its env's episode from one sample to the next); the last ``window`` are kept."""

    def __init__(self, num_envs: int, window: int = 20):
        self.running = np.zeros(num_envs, dtype=np.float64)
        self.recent: deque[float] = deque(maxlen=window)
        self.count = 0

    def add(self, env: int, reward_sum: float, done: bool) -> None:
        """``reward_sum`` more for env ``env``, whose episode ended if ``done``."""
        self.running[env] += reward_sum
        if done:
            self.recent.append(float(self.running[env]))
            self.running[env] = 0.0
            self.count += 1

    def add_batch(self, batch: envfleet.EpisodeBatch) -> None:
        """Every segment of a batch."""
        if not batch.num_steps:
            return
        sums = np.add.reduceat(batch.rewards, batch.starts)
        for env, total, done in zip(
            batch.env_index.tolist(), sums.tolist(), batch.complete.tolist(), strict=True
        ):
            self.add(env, total, done)

    def add_step(self, rewards: np.ndarray, done: np.ndarray, valid: np.ndarray) -> None:
        """One step of every env (``valid``: the envs whose result is a transition)."""
        self.running += np.where(valid, rewards, 0.0)
        for env in np.flatnonzero(done & valid).tolist():
            self.add(env, 0.0, True)

    def full(self) -> bool:
        """Whether ``window`` episodes have finished."""
        return len(self.recent) == self.recent.maxlen

    def mean(self, last: int | None = None) -> float:
        """Mean of the kept returns, or of the ``last`` of them (``nan`` before the first)."""
        values = list(self.recent)[-last:] if last else list(self.recent)
        return float(np.mean(values)) if values else math.nan
