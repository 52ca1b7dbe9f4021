"""PPO on CartPole-v1 with ``envfleet.Sampler`` (driver inference), torch on the CPU.

The torch policy runs in this process on the batch of all envs' observations; it returns the
actions with their log-probabilities and values as ``agent_infos``, which the Sampler keeps with
each step. Each update samples ``num_envs * steps_per_update`` steps, computes GAE per segment,
and runs a few epochs of clipped PPO on them; ``sampler.update_policy(None)`` then marks the new
parameters (the model is changed in place).

Stopping criterion (default ``--criterion train``): training stops when the mean return of the
last 20 complete training episodes (the stochastic policy, as sampled) reaches ``--target``
(475, CartPole-v1's reward threshold). With ``--criterion eval``, a more lenient test: once the
mean of the last 10 training episodes reaches ``--eval-gate`` (half the target by default), the
greedy policy (argmax of the logits) is evaluated after each update on ``--eval-episodes`` (10)
episodes with fixed seeds, and training stops when their mean return is ``>= --target``.

Run it::

    python examples/ppo_cartpole.py --seed 1
"""

from __future__ import annotations

import argparse
import time
from collections import deque
from typing import Any

import gymnasium
import numpy as np
import torch
from torch import nn

import envfleet
from envfleet import EpisodeBatch

ENV_ID = "CartPole-v1"


# -- the model -------------------------------------------------------------------------------


def _layer(inputs: int, outputs: int, std: float) -> nn.Linear:
    layer = nn.Linear(inputs, outputs)
    nn.init.orthogonal_(layer.weight, std)
    nn.init.zeros_(layer.bias)
    return layer


class ActorCritic(nn.Module):
    """Separate tanh MLPs (64x64) for the policy logits and the value (CleanRL's layout)."""

    def __init__(self, obs_dim: int, num_actions: int, hidden: int = 64):
        super().__init__()
        self.actor = nn.Sequential(
            _layer(obs_dim, hidden, 2**0.5),
            nn.Tanh(),
            _layer(hidden, hidden, 2**0.5),
            nn.Tanh(),
            _layer(hidden, num_actions, 0.01),
        )
        self.critic = nn.Sequential(
            _layer(obs_dim, hidden, 2**0.5),
            nn.Tanh(),
            _layer(hidden, hidden, 2**0.5),
            nn.Tanh(),
            _layer(hidden, 1, 1.0),
        )

    def value(self, obs: torch.Tensor) -> torch.Tensor:
        return self.critic(obs).squeeze(-1)

    def forward(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.actor(obs), self.value(obs)


class TorchPolicy:
    """The Sampler's policy: numpy observations in, ``(actions, {"logp", "value"})`` out.

    Actions are drawn with its own seeded ``torch.Generator``, so a run is reproducible.
    """

    def __init__(self, model: ActorCritic, seed: int):
        self.model = model
        self.generator = torch.Generator().manual_seed(seed)

    @torch.no_grad()
    def __call__(self, obs: np.ndarray) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        logits, value = self.model(torch.as_tensor(obs, dtype=torch.float32))
        log_probs = torch.log_softmax(logits, dim=-1)
        actions = torch.multinomial(log_probs.exp(), 1, generator=self.generator).squeeze(-1)
        logp = log_probs.gather(-1, actions.unsqueeze(-1)).squeeze(-1)
        return actions.numpy(), {"logp": logp.numpy(), "value": value.numpy()}


# -- advantages ------------------------------------------------------------------------------


def segment_gae(
    batch: EpisodeBatch,
    last_values: np.ndarray,
    gamma: float,
    lam: float,
) -> tuple[np.ndarray, np.ndarray]:
    """GAE(lambda) advantages and returns of every step, segment by segment.

    Within a segment, step ``t`` bootstraps from the value of step ``t + 1``. At a segment's
    last step: ``terminated`` -> 0 (no future); ``truncated`` (time limit) or a segment cut by
    the end of the sample (``complete == False``) -> ``last_values[s]``, the value of the
    observation after that step (``batch.last_observations[s]``). The recursion never crosses
    from one segment into the next (another env, or the next episode).

    Args:
        batch: the sampled steps; ``batch.agent_infos["value"]`` holds ``V(observations)``.
        last_values: ``float[S]``, the value of each segment's ``last_observations``.

    Returns:
        ``(advantages, returns)``, ``float32[T]`` each; ``returns = advantages + values``.
    """
    values = batch.agent_infos["value"].astype(np.float64)
    num_steps = batch.num_steps
    last = batch.starts + batch.lengths - 1  # each segment's last step
    next_values = np.empty(num_steps, dtype=np.float64)
    next_values[:-1] = values[1:]  # inside a segment; the segment ends are overwritten below
    ended = batch.terminated[last]
    next_values[last] = np.where(ended, 0.0, last_values.astype(np.float64))
    carry = np.ones(num_steps, dtype=np.float64)  # whether step t's GAE takes step t + 1's
    carry[last] = 0.0
    deltas = batch.rewards + gamma * next_values - values
    advantages = np.empty(num_steps, dtype=np.float64)
    running = 0.0
    discount = gamma * lam
    for t in range(num_steps - 1, -1, -1):
        running = deltas[t] + discount * carry[t] * running
        advantages[t] = running
    return advantages.astype(np.float32), (advantages + values).astype(np.float32)


# -- evaluation ------------------------------------------------------------------------------


@torch.no_grad()
def evaluate(model: ActorCritic, episodes: int, seed: int) -> float:
    """Mean return of the greedy policy over ``episodes`` episodes (env ``i`` seeded
    ``seed + i``), all stepped together in one batch."""
    envs = [gymnasium.make(ENV_ID) for _ in range(episodes)]
    try:
        obs = np.stack([env.reset(seed=seed + i)[0] for i, env in enumerate(envs)])
        returns = np.zeros(episodes)
        live = np.ones(episodes, dtype=bool)
        while live.any():
            rows = np.flatnonzero(live)
            logits = model.actor(torch.as_tensor(obs[rows], dtype=torch.float32))
            actions = logits.argmax(-1).tolist()
            for i, action in zip(rows.tolist(), actions, strict=True):
                obs[i], reward, terminated, truncated, _ = envs[i].step(action)
                returns[i] += reward
                live[i] = not (terminated or truncated)
        return float(returns.mean())
    finally:
        for env in envs:
            env.close()


class EpisodeReturns:
    """Returns of complete episodes, summed per env across samples (segments continue their
    env's episode from one sample to the next)."""

    def __init__(self, num_envs: int, window: int):
        self.running = np.zeros(num_envs)
        self.recent: deque[float] = deque(maxlen=window)
        self.count = 0

    def add(self, batch: EpisodeBatch) -> None:
        sums = np.add.reduceat(batch.rewards, batch.starts) if batch.num_steps else []
        for env, total, complete in zip(
            batch.env_index.tolist(), sums, batch.complete.tolist(), strict=True
        ):
            self.running[env] += total
            if complete:
                self.recent.append(float(self.running[env]))
                self.running[env] = 0.0
                self.count += 1

    def mean(self, last: int | None = None) -> float:
        values = list(self.recent)[-last:] if last else list(self.recent)
        return float(np.mean(values)) if values else float("nan")


# -- training --------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-envs", type=int, default=8)
    parser.add_argument("--steps-per-update", type=int, default=128, help="steps per env")
    parser.add_argument("--total-steps", type=int, default=500_000, help="budget of env steps")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--backend", default="serial", help="envfleet backend of the envs")
    parser.add_argument("--inference", default="driver", choices=["driver"])
    parser.add_argument(
        "--prefetch",
        action="store_true",
        help="collect the next batch during the update (Sampler(prefetch=True)): PPO then "
        "learns from steps one policy version behind, their log-probabilities recorded",
    )
    parser.add_argument("--target", type=float, default=475.0)
    parser.add_argument("--criterion", default="train", choices=["train", "eval"])
    parser.add_argument("--eval-episodes", type=int, default=10)
    parser.add_argument("--eval-gate", type=float, default=None, help="default target / 2")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--anneal-lr", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--minibatches", type=int, default=4)
    parser.add_argument("--gamma", type=float, default=0.99)
    parser.add_argument("--lam", type=float, default=0.95)
    parser.add_argument("--clip", type=float, default=0.2)
    parser.add_argument("--ent-coef", type=float, default=0.0)
    parser.add_argument("--vf-coef", type=float, default=0.5)
    parser.add_argument("--max-grad-norm", type=float, default=0.5)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--quiet", action="store_true", help="no progress lines")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Train until the target is reached or ``--total-steps`` are spent.

    Returns:
        ``reached`` (bool), ``eval_return`` (the last greedy evaluation, ``nan`` if none),
        ``train_return`` (mean of the last 20 complete training episodes), ``steps`` (env
        steps sampled), ``updates``, ``episodes``, ``seconds`` (wall time from the first
        sample), ``seed``.
    """
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    gate = args.target / 2 if args.eval_gate is None else args.eval_gate
    log = (lambda *a: None) if args.quiet else print

    probe = gymnasium.make(ENV_ID)
    obs_dim = int(np.prod(probe.observation_space.shape))
    num_actions = int(probe.action_space.n)
    probe.close()
    model = ActorCritic(obs_dim, num_actions)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, eps=1e-5)
    policy = TorchPolicy(model, seed=args.seed)
    batch_steps = args.num_envs * args.steps_per_update
    num_updates = max(1, args.total_steps // batch_steps)
    shuffle = torch.Generator().manual_seed(args.seed + 1)
    returns = EpisodeReturns(args.num_envs, window=20)
    result: dict[str, Any] = {"reached": False, "eval_return": float("nan"), "seed": args.seed}

    sampler = envfleet.Sampler(
        ENV_ID,
        policy,
        args.num_envs,
        inference=args.inference,
        seed=args.seed,
        backend=args.backend,
        progress=False,
        prefetch=args.prefetch,
    )
    steps = 0
    start = time.perf_counter()
    try:
        for update in range(1, num_updates + 1):
            if args.anneal_lr:
                optimizer.param_groups[0]["lr"] = args.lr * (1 - (update - 1) / num_updates)
            batch = sampler.sample(batch_steps)
            steps += batch.num_steps
            returns.add(batch)
            train(model, optimizer, batch, args, shuffle)
            sampler.update_policy(None)  # the model changed in place

            train_return = returns.mean()
            line = (
                f"update {update:4d}  steps {steps:7d}  episodes {returns.count:5d}  "
                f"train return {train_return:6.1f}"
            )
            if args.criterion == "train":
                reached = len(returns.recent) >= 20 and train_return >= args.target
            else:
                reached = False
                if returns.mean(last=10) >= gate:
                    result["eval_return"] = evaluate(
                        model, args.eval_episodes, seed=10_000 + args.seed
                    )
                    reached = result["eval_return"] >= args.target
                    line += f"  eval return {result['eval_return']:6.1f}"
            log(f"{line}  {time.perf_counter() - start:6.1f} s")
            if reached:
                result["reached"] = True
                break
    finally:
        sampler.close()
    result.update(
        train_return=returns.mean(),
        steps=steps,
        updates=update,
        episodes=returns.count,
        seconds=time.perf_counter() - start,
    )
    log(
        f"{'reached' if result['reached'] else 'did not reach'} {args.target:g} "
        f"({args.criterion}) after {steps} steps, {result['seconds']:.1f} s"
    )
    return result


def train(
    model: ActorCritic,
    optimizer: torch.optim.Optimizer,
    batch: EpisodeBatch,
    args: argparse.Namespace,
    shuffle: torch.Generator,
) -> None:
    """GAE per segment, then ``args.epochs`` epochs of clipped PPO in minibatches."""
    obs = torch.as_tensor(batch.observations, dtype=torch.float32)
    with torch.no_grad():
        last_values = model.value(torch.as_tensor(batch.last_observations, dtype=torch.float32))
    advantages, value_targets = segment_gae(batch, last_values.numpy(), args.gamma, args.lam)
    actions = torch.as_tensor(batch.actions, dtype=torch.int64)
    old_logp = torch.as_tensor(batch.agent_infos["logp"], dtype=torch.float32)
    adv = torch.as_tensor(advantages)
    targets = torch.as_tensor(value_targets)
    n = batch.num_steps
    size = max(1, n // args.minibatches)
    for _ in range(args.epochs):
        order = torch.randperm(n, generator=shuffle)
        for first in range(0, n - size + 1, size):
            idx = order[first : first + size]
            logits, values = model(obs[idx])
            log_probs = torch.log_softmax(logits, dim=-1)
            logp = log_probs.gather(-1, actions[idx].unsqueeze(-1)).squeeze(-1)
            ratio = torch.exp(logp - old_logp[idx])
            a = adv[idx]
            a = (a - a.mean()) / (a.std() + 1e-8)
            policy_loss = -torch.min(
                ratio * a, torch.clamp(ratio, 1 - args.clip, 1 + args.clip) * a
            ).mean()
            value_loss = 0.5 * (values - targets[idx]).pow(2).mean()
            entropy = -(log_probs.exp() * log_probs).sum(-1).mean()
            loss = policy_loss + args.vf_coef * value_loss - args.ent_coef * entropy
            optimizer.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
            optimizer.step()


if __name__ == "__main__":
    main()
