"""PPO on Atari (``ALE/Pong-v5`` by default) with ``envfleet.Sampler``, torch on the CPU.

CleanRL's ``ppo_atari.py`` design, written for envfleet: the Nature CNN with a shared trunk and
two heads (policy logits, value), 8 envs x 128 steps per update, GAE(0.95), clipped PPO (clip
0.1, clipped value loss, entropy bonus 0.01), Adam 2.5e-4 annealed to 0, 4 epochs of 4
minibatches, rewards clipped to their sign for learning. The envs are
``gymnasium.make(env_id, frameskip=1)`` + ``AtariPreprocessing(frame_skip=4, screen_size=84,
grayscale_obs=True, noop_max=30)`` + ``FrameStackObservation(4)``: ``uint8[4, 84, 84]``
observations, scaled by 1/255 inside the model. The agent, GAE and the update are
``examples/ppo.py``'s, the PPO that the examples and ``benchmarks/train.py`` share; this file is
the envs and the loop.

Two ways to collect the same rollouts (same model, same update, same seeds):

- ``--vector envfleet`` (default): ``envfleet.Sampler`` with its default inference mode; the
  policy returns the actions and, as ``agent_infos``, their log-probabilities and values.
- ``--vector gym-async``: ``gymnasium.vector.AsyncVectorEnv`` stepped in CleanRL's plain loop
  (policy, then ``step``, ``num_steps`` times), its rollout turned into the same
  :class:`envfleet.EpisodeBatch`, so the update code is literally the same.
- ``--vector envpool``: EnvPool's own Atari (``envpool.make_gymnasium``, CleanRL's
  ``ppo_atari_envpool.py`` way) with the same preprocessing done in C++ (84x84 gray, 4 stacked,
  at most 30 no-ops, sticky actions 0.25 as ALE v5's), in the same plain loop. Its envs are
  not gymnasium's, so it learns alike but not bit for bit; EnvPool resets an env in the step
  after its episode ended (the action ignored), and that step is left out of the rollout.

Both use same-step autoreset: an episode's final observation is kept, and GAE bootstraps per
segment (from ``V(final observation)`` when an episode is truncated or a segment is cut by the
end of the rollout; not at all when it terminated).

Run it::

    python examples/ppo_atari.py --total-steps 200000                    # the Sampler
    python examples/ppo_atari.py --total-steps 200000 --vector gym-async  # the plain loop
    python examples/ppo_atari.py --total-steps 200000 --vector envpool    # EnvPool's Atari

Each update prints the env steps so far, steps/s (overall, and of the sampling phase alone),
and the mean return of the last 20 finished episodes; the end, the total wall time and steps/s.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gymnasium
import numpy as np
import torch
from gymnasium.vector import AutoresetMode

import envfleet

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ppo  # noqa: E402  (examples/ppo.py: the agent, GAE and the update the examples share)

VECTORS = ("envfleet", "gym-async", "envpool")


# -- the envs --------------------------------------------------------------------------------


def make_env(env_id: str) -> gymnasium.Env[Any, Any]:
    """One Atari env with CleanRL's preprocessing done by gymnasium's wrappers.

    Returns:
        an env with ``uint8[4, 84, 84]`` observations (4 stacked grayscale frames, each the
        max of the last two of 4 skipped frames) and ``Discrete`` actions.

    Raises:
        ImportError: ale-py or OpenCV is missing (``pip install 'envfleet[atari]'``).
    """
    import ale_py

    gymnasium.register_envs(ale_py)
    env = gymnasium.make(env_id, frameskip=1)
    env = gymnasium.wrappers.AtariPreprocessing(
        env, noop_max=30, frame_skip=4, screen_size=84, grayscale_obs=True
    )
    return gymnasium.wrappers.FrameStackObservation(env, 4)


def env_factory(env_id: str) -> Callable[[], gymnasium.Env[Any, Any]]:
    """A picklable zero-argument factory of :func:`make_env` (for worker processes)."""
    return functools.partial(make_env, env_id)


# -- the two ways to collect rollouts --------------------------------------------------------


class SamplerRollouts:
    """Rollouts from ``envfleet.Sampler`` (its default inference mode unless ``inference``)."""

    def __init__(self, args: argparse.Namespace, policy: ppo.Policy):
        kwargs: dict[str, Any] = {}
        if args.inference is not None:
            kwargs["inference"] = args.inference
        if args.backend is not None:
            kwargs["backend"] = args.backend
        if args.prefetch:  # collect the next batch during the update (one version behind)
            kwargs["prefetch"] = True
        self.sampler = envfleet.Sampler(
            env_factory(args.env_id),
            policy,
            args.num_envs,
            seed=args.seed,
            progress=False,
            **kwargs,
        )

    def sample(self, num_steps: int) -> envfleet.EpisodeBatch:
        return self.sampler.sample(num_steps)

    @property
    def policy_version(self) -> int | None:
        """The version being updated: a prefetched batch's older steps are stale."""
        return self.sampler.policy_version

    def policy_changed(self) -> None:
        self.sampler.update_policy(None)  # the model was changed in place

    def close(self) -> None:
        self.sampler.close()


def rollout_arrays(steps: int, obs: np.ndarray) -> tuple[np.ndarray, ...]:
    """A plain loop's empty ``[steps, n]`` rollout for observations like ``obs`` (``[n,
    *obs_shape]``): observations, actions (int64), rewards (float64), terminated, truncated
    (bool), log-probabilities and values (float32)."""
    n = len(obs)
    return (
        np.empty((steps, *obs.shape), dtype=obs.dtype),
        np.empty((steps, n), dtype=np.int64),
        np.empty((steps, n)),
        np.empty((steps, n), dtype=bool),
        np.empty((steps, n), dtype=bool),
        np.empty((steps, n), dtype=np.float32),
        np.empty((steps, n), dtype=np.float32),
    )


class GymAsyncRollouts:
    """Rollouts from ``gymnasium.vector.AsyncVectorEnv`` in CleanRL's plain loop, returned
    as an :class:`envfleet.EpisodeBatch` (per env, segments split where episodes end)."""

    policy_version = None  # every step is of the policy being updated

    def __init__(self, args: argparse.Namespace, policy: ppo.Policy):
        self.policy = policy
        self.num_envs = args.num_envs
        self.envs = gymnasium.vector.AsyncVectorEnv(
            [env_factory(args.env_id)] * args.num_envs, autoreset_mode=AutoresetMode.SAME_STEP
        )
        self.obs, _ = self.envs.reset(seed=args.seed)  # env i: seed + i, as the Sampler

    def sample(self, num_steps: int) -> envfleet.EpisodeBatch:
        steps = -(-num_steps // self.num_envs)
        obs, actions, rewards, terminated, truncated, logp, value = rollout_arrays(steps, self.obs)
        final_obs: dict[tuple[int, int], np.ndarray] = {}
        for t in range(steps):
            obs[t] = self.obs
            actions[t], infos = self.policy(self.obs)
            logp[t], value[t] = infos["logp"], infos["value"]
            self.obs, rewards[t], terminated[t], truncated[t], info = self.envs.step(actions[t])
            for env in np.flatnonzero(info.get("_final_obs", ())).tolist():
                final_obs[t, env] = info["final_obs"][env]
        columns = {
            "actions": actions,
            "rewards": rewards,
            "terminated": terminated,
            "truncated": truncated,
            "logp": logp,
            "value": value,
        }
        return plain_rollout_batch(obs, columns, final_obs, self.obs)

    def policy_changed(self) -> None:
        pass  # the policy runs here, on the model itself

    def close(self) -> None:
        self.envs.close()


class EnvPoolRollouts:
    """Rollouts from EnvPool's own Atari in CleanRL's plain loop (``ppo_atari_envpool.py``'s
    way), returned as an :class:`envfleet.EpisodeBatch`. EnvPool resets an env in the step
    after its episode ended, ignoring that step's action: that step is not a transition and
    is left out; the episode's final observation is the one its last step returned."""

    policy_version = None  # every step is of the policy being updated

    def __init__(self, args: argparse.Namespace, policy: ppo.Policy):
        import envpool

        self.policy = policy
        self.num_envs = args.num_envs
        self.envs = envpool.make_gymnasium(
            args.env_id.removeprefix("ALE/"),
            num_envs=args.num_envs,
            seed=args.seed,
            img_height=84,
            img_width=84,
            gray_scale=True,
            stack_num=4,
            frame_skip=4,
            noop_max=30,
            use_fire_reset=False,
            episodic_life=False,
            reward_clip=False,
            repeat_action_probability=0.25,
        )
        self.obs, _ = self.envs.reset()
        self.resetting = np.zeros(args.num_envs, dtype=bool)  # its last step ended an episode

    def sample(self, num_steps: int) -> envfleet.EpisodeBatch:
        steps = -(-num_steps // self.num_envs)
        obs, actions, rewards, terminated, truncated, logp, value = rollout_arrays(steps, self.obs)
        valid = np.empty((steps, self.num_envs), dtype=bool)
        final_obs: dict[tuple[int, int], np.ndarray] = {}
        for t in range(steps):
            obs[t] = self.obs
            valid[t] = ~self.resetting
            actions[t], infos = self.policy(self.obs)
            logp[t], value[t] = infos["logp"], infos["value"]
            self.obs, rewards[t], terminated[t], truncated[t], _ = self.envs.step(actions[t])
            self.resetting = (terminated[t] | truncated[t]) & valid[t]
            for env in np.flatnonzero(self.resetting).tolist():
                final_obs[t, env] = self.obs[env].copy()
        columns = {
            "actions": actions,
            "rewards": rewards,
            "terminated": terminated & valid,
            "truncated": truncated & valid,
            "logp": logp,
            "value": value,
        }
        return plain_rollout_batch(obs, columns, final_obs, self.obs, valid)

    def policy_changed(self) -> None:
        pass  # the policy runs here, on the model itself

    def close(self) -> None:
        self.envs.close()


def plain_rollout_batch(
    obs: np.ndarray,
    columns: dict[str, np.ndarray],
    final_obs: dict[tuple[int, int], np.ndarray],
    next_obs: np.ndarray,
    valid: np.ndarray | None = None,
) -> envfleet.EpisodeBatch:
    """A plain loop's ``[steps, n]`` rollout as an :class:`envfleet.EpisodeBatch`.

    Each env's steps are cut into segments after every step that ended an episode; segments
    come env by env, in time order within an env.

    Args:
        obs: ``[steps, n, *obs_shape]``, the observation each action was chosen on.
        columns: ``[steps, n]`` arrays ``actions``, ``rewards``, ``terminated``,
            ``truncated``, ``logp``, ``value`` (the last two become ``agent_infos``).
        final_obs: ``{(t, env): observation}``, the final observation of the episode that
            env ``env`` ended at step ``t`` (same-step autoreset).
        next_obs: ``[n, *obs_shape]``, the observation after the last step.
        valid: ``[steps, n]`` bool, the steps that are transitions (``None``: all): the
            others (EnvPool's reset steps) are left out.
    """
    steps, n = columns["rewards"].shape
    done = columns["terminated"] | columns["truncated"]
    rows, lengths, env_index, last_obs = [], [], [], []
    for env in range(n):
        start = 0
        for end in [*(np.flatnonzero(done[:, env]) + 1).tolist(), steps]:
            kept = np.arange(start, end)
            if valid is not None:
                kept = kept[valid[start:end, env]]
            if kept.size == 0:
                start = end
                continue  # the rollout ended with this env's episode (or its reset step)
            rows.append(kept * n + env)  # rows of the [steps * n] arrays
            lengths.append(int(kept.size))
            env_index.append(env)
            last_obs.append(final_obs.get((end - 1, env), next_obs[env]))
            start = end
    index = np.concatenate(rows)

    def flat(array: np.ndarray) -> np.ndarray:
        return array.reshape(steps * n, *array.shape[2:])[index]

    return envfleet.EpisodeBatch(
        observations=flat(obs),
        actions=flat(columns["actions"]),
        rewards=flat(columns["rewards"]),
        terminated=flat(columns["terminated"]),
        truncated=flat(columns["truncated"]),
        last_observations=np.stack(last_obs),
        env_index=np.array(env_index, dtype=np.int64),
        policy_version=np.zeros(len(lengths), dtype=np.int64),
        lengths=np.array(lengths, dtype=np.int64),
        agent_infos={"logp": flat(columns["logp"]), "value": flat(columns["value"])},
    )


# -- training --------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--env-id", default="ALE/Pong-v5", help="e.g. ALE/Breakout-v5")
    parser.add_argument("--vector", default="envfleet", choices=VECTORS)
    parser.add_argument("--num-envs", type=int, default=8)
    parser.add_argument("--num-steps", type=int, default=128, help="steps per env per update")
    parser.add_argument("--total-steps", type=int, default=10_000_000, help="env steps")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--log-every", type=int, default=1, help="print every N updates (0: off)")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    parser.add_argument(
        "--inference", default=None, help="Sampler inference mode (default: the Sampler's own)"
    )
    parser.add_argument("--backend", default=None, help="envfleet backend (default: make's)")
    parser.add_argument(
        "--device", default="cpu", help="torch device of the model and the update (cpu, cuda)"
    )
    parser.add_argument(
        "--prefetch",
        action="store_true",
        help="envfleet: collect the next batch during the update (Sampler(prefetch=True))",
    )
    ppo.add_arguments(parser, lr=2.5e-4, epochs=4, clip=0.1, ent_coef=0.01)  # CleanRL's Atari
    parser.add_argument("--clip-rewards", action=argparse.BooleanOptionalAction, default=True)
    args = parser.parse_args(argv)
    if args.inference is not None and args.vector != "envfleet":
        parser.error("--inference is an option of --vector envfleet")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Train for ``--total-steps`` env steps (rounded down to whole updates, at least one).

    Returns:
        ``steps`` (env steps sampled), ``updates``, ``episodes`` (finished), ``mean_return``
        (of the last 20, ``nan`` if none), ``seconds`` (wall time from the first rollout),
        ``sample_seconds`` (of it, collecting rollouts), ``steps_per_second``, ``losses``
        (the last minibatch's loss of each update), ``model`` (the trained ``ppo.Agent``),
        ``vector``.
    """
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    log = print if args.log_every > 0 else (lambda *a: None)

    probe = make_env(args.env_id)
    obs_shape = probe.observation_space.shape
    num_actions = int(probe.action_space.n)  # type: ignore[attr-defined]
    probe.close()
    batch_steps = args.num_envs * args.num_steps
    config = ppo.PPOConfig.from_args(args, args.num_steps, args.num_envs, clip_value=True)
    model = ppo.Agent(obs_shape, num_actions, "cnn", seed=args.seed).to(args.device)
    learner = ppo.PPO(model, config, seed=args.seed)
    policy = ppo.Policy(model, seed=args.seed, threads=args.threads)
    num_updates = max(1, args.total_steps // batch_steps)
    returns = ppo.EpisodeReturns(args.num_envs)
    losses: list[float] = []

    rollouts: SamplerRollouts | GymAsyncRollouts | EnvPoolRollouts
    if args.vector == "envfleet":
        rollouts = SamplerRollouts(args, policy)
    elif args.vector == "envpool":
        rollouts = EnvPoolRollouts(args, policy)
    else:
        rollouts = GymAsyncRollouts(args, policy)
    steps, sample_seconds, update = 0, 0.0, 0
    start = time.perf_counter()
    try:
        for update in range(1, num_updates + 1):
            lr = config.lr((update - 1) / num_updates)
            began = time.perf_counter()
            batch = rollouts.sample(batch_steps)
            sample_seconds += time.perf_counter() - began
            steps += batch.num_steps
            returns.add_batch(batch)
            rewards = np.sign(batch.rewards) if args.clip_rewards else batch.rewards
            losses.append(learner.learn(batch, lr, rollouts.policy_version, rewards))
            rollouts.policy_changed()
            if args.log_every > 0 and (update % args.log_every == 0 or update == num_updates):
                elapsed = time.perf_counter() - start
                log(
                    f"update {update:5d}  steps {steps:9d}  {steps / elapsed:6.0f} steps/s "
                    f"(sampling {steps / sample_seconds:6.0f})  episodes {returns.count:5d}  "
                    f"return {returns.mean():6.1f}  loss {losses[-1]:7.4f}  {elapsed:7.1f} s"
                )
    finally:
        rollouts.close()
    seconds = time.perf_counter() - start
    log(
        f"{args.vector}: {steps} steps in {seconds:.1f} s, {steps / seconds:.0f} steps/s "
        f"(sampling {sample_seconds:.1f} s, {steps / sample_seconds:.0f} steps/s)"
    )
    return {
        "vector": args.vector,
        "steps": steps,
        "updates": update,
        "episodes": returns.count,
        "mean_return": returns.mean(),
        "seconds": seconds,
        "sample_seconds": sample_seconds,
        "steps_per_second": steps / seconds,
        "losses": losses,
        "model": model,
    }


if __name__ == "__main__":
    main()
