"""PPO on CartPole-v1 with ``envfleet.Sampler`` (driver inference), torch on the CPU.

The torch policy runs in this process on the batch of all envs' observations; it returns the
actions with their log-probabilities and values as ``agent_infos``, which the Sampler keeps with
each step. Each update samples ``num_envs * steps_per_update`` steps, computes GAE per segment,
and runs a few epochs of clipped PPO on them; ``sampler.update_policy(None)`` then marks the new
parameters (the model is changed in place). The agent, GAE and the update are
``examples/ppo.py``'s, the PPO that the examples and ``benchmarks/train.py`` share; this file is
the loop.

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
import sys
import time
from pathlib import Path
from typing import Any

import gymnasium
import numpy as np
import torch

import envfleet

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ppo  # noqa: E402  (examples/ppo.py: the agent, GAE and the update the examples share)

ENV_ID = "CartPole-v1"


# -- evaluation ------------------------------------------------------------------------------


@torch.no_grad()
def evaluate(agent: ppo.Agent, episodes: int, seed: int) -> float:
    """Mean return of the greedy policy over ``episodes`` episodes (env ``i`` seeded
    ``seed + i``), all stepped together in one batch."""
    envs = [gymnasium.make(ENV_ID) for _ in range(episodes)]
    try:
        obs = np.stack([env.reset(seed=seed + i)[0] for i, env in enumerate(envs)])
        returns = np.zeros(episodes)
        live = np.ones(episodes, dtype=bool)
        while live.any():
            rows = np.flatnonzero(live)
            logits, _ = agent(agent.prepare(obs[rows]))
            actions = logits.argmax(-1).tolist()
            for i, action in zip(rows.tolist(), actions, strict=True):
                obs[i], reward, terminated, truncated, _ = envs[i].step(action)
                returns[i] += reward
                live[i] = not (terminated or truncated)
        return float(returns.mean())
    finally:
        for env in envs:
            env.close()


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
        "learns from steps one policy version behind (decoupled PPO on those steps)",
    )
    parser.add_argument("--target", type=float, default=475.0)
    parser.add_argument("--criterion", default="train", choices=["train", "eval"])
    parser.add_argument("--eval-episodes", type=int, default=10)
    parser.add_argument("--eval-gate", type=float, default=None, help="default target / 2")
    ppo.add_arguments(parser, lr=1e-3, epochs=10)  # --lr, --epochs, --clip...
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
    gate = args.target / 2 if args.eval_gate is None else args.eval_gate
    log = (lambda *a: None) if args.quiet else print

    probe = gymnasium.make(ENV_ID)
    obs_shape = probe.observation_space.shape
    num_actions = int(probe.action_space.n)
    probe.close()
    batch_steps = args.num_envs * args.steps_per_update
    config = ppo.PPOConfig.from_args(args, args.steps_per_update, args.num_envs)
    agent = ppo.Agent(obs_shape, num_actions, "mlp", config.hidden, seed=args.seed)
    learner = ppo.PPO(agent, config, seed=args.seed)
    policy = ppo.Policy(agent, seed=args.seed, threads=args.threads)
    num_updates = max(1, args.total_steps // batch_steps)
    returns = ppo.EpisodeReturns(args.num_envs, window=20)
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
            lr = config.lr((update - 1) / num_updates)
            batch = sampler.sample(batch_steps)
            steps += batch.num_steps
            returns.add_batch(batch)
            learner.learn(batch, lr, sampler.policy_version)
            sampler.update_policy(None)  # the model changed in place

            train_return = returns.mean()
            line = (
                f"update {update:4d}  steps {steps:7d}  episodes {returns.count:5d}  "
                f"train return {train_return:6.1f}"
            )
            if args.criterion == "train":
                reached = returns.full() and train_return >= args.target
            else:
                reached = False
                if returns.mean(last=10) >= gate:
                    result["eval_return"] = evaluate(
                        agent, args.eval_episodes, seed=10_000 + args.seed
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


if __name__ == "__main__":
    main()
