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

Preemption (a scheduler's SIGTERM): with ``--checkpoint PATH`` a SIGTERM ends the run at the
end of the update in progress, after writing the envs (``sampler.snapshot()``), the agent, its
optimizer, both generators and the score to PATH; ``--resume PATH`` continues from it, every
later update bit-identical to the uninterrupted run's (``tests/integration/test_examples.py``
sends a real SIGTERM and compares the weights' digests).

Run it::

    python examples/ppo_cartpole.py --seed 1
    python examples/ppo_cartpole.py --seed 1 --checkpoint run.ckpt   # kill -TERM it, then:
    python examples/ppo_cartpole.py --seed 1 --checkpoint run.ckpt --resume run.ckpt
"""

from __future__ import annotations

import argparse
import json
import os
import signal
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
    parser.add_argument("--checkpoint", default=None, help="on SIGTERM: save here, then exit")
    parser.add_argument("--resume", default=None, help="continue from this checkpoint")
    parser.add_argument("--trace", default=None, help="append each update's digest (JSON)")
    return parser.parse_args(argv)


def save(path: str, sampler: Any, agent: Any, learner: Any, policy: Any, state: dict) -> None:
    """Everything a resumed run needs, written whole (a temporary file renamed over ``path``):
    the sampler's envs and counters, the weights, Adam's moments, both generators, the score
    and the loop's counters."""
    blob = {
        "sampler": sampler.snapshot(),
        "agent": agent.state_dict(),
        "optimizer": learner.optimizer.state_dict(),
        "policy_rng": policy.generator.get_state(),
        "shuffle_rng": learner.shuffle.get_state(),
        **state,
    }
    torch.save(blob, path + ".tmp")
    os.replace(path + ".tmp", path)


def load(path: str, agent: Any, learner: Any, policy: Any) -> dict:
    """A checkpoint of :func:`save` put back into ``agent``, ``learner`` and ``policy``;
    returns the rest (the sampler's snapshot, the score, the counters)."""
    blob = torch.load(path, weights_only=False)  # a file this script wrote
    agent.load_state_dict(blob.pop("agent"))
    learner.optimizer.load_state_dict(blob.pop("optimizer"))
    policy.generator.set_state(blob.pop("policy_rng"))
    learner.shuffle.set_state(blob.pop("shuffle_rng"))
    return blob


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

    first, steps, resumed = 1, 0, None
    if args.resume:
        resumed = load(args.resume, agent, learner, policy)
        first, steps, returns = resumed["update"] + 1, resumed["steps"], resumed["returns"]
    preempted: list[int] = []  # a SIGTERM: the run stops after the update in progress
    if args.checkpoint:
        signal.signal(signal.SIGTERM, lambda signum, frame: preempted.append(signum))
    sampler = envfleet.Sampler(
        ENV_ID,
        policy,
        args.num_envs,
        inference=args.inference,
        seed=args.seed,
        backend=args.backend,
        progress=False,
        prefetch=args.prefetch,
        resume=None if resumed is None else resumed["sampler"],
    )
    start = time.perf_counter()
    update = first - 1
    try:
        for update in range(first, num_updates + 1):
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
            if args.trace:
                with open(args.trace, "a") as f:
                    record = {"update": update, "digest": learner.digest(), "steps": steps}
                    f.write(json.dumps({**record, "train_return": train_return}) + "\n")
            if reached:
                result["reached"] = True
                break
            if preempted:
                state = {"update": update, "steps": steps, "returns": returns}
                save(args.checkpoint, sampler, agent, learner, policy, state)
                log(f"preempted: saved to {args.checkpoint} after update {update}")
                result["preempted"] = update
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
