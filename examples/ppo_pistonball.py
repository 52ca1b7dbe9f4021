"""PPO on PettingZoo's pistonball with stable-baselines3, every piston one SB3 env, on envfleet.

The PettingZoo/SuperSuit tutorial's recipe (one policy shared by every agent, parameter
sharing), written for envfleet: inside the factory, SuperSuit's ``color_reduction_v0`` (one
channel), ``resize_v1`` (84 x 84) and ``frame_stack_v1`` (3 frames) give each piston
``uint8[84, 84, 3]`` observations; :class:`envfleet.adapters.sb3.SB3VecEnv` runs the envs on
the processes backend and presents each piston as one row of an SB3 vector env (SuperSuit's
``concat_vec_envs_v1`` layout: ``num_envs * n_pistons`` rows, row ``i * A + j`` = env ``i``,
piston ``j``); SB3's PPO with ``CnnPolicy`` learns on the rows. The tutorial builds the same
vector env with ``concat_vec_envs_v1(pettingzoo_env_to_vec_env_v1(env), 8, num_cpus=4,
base_class="stable_baselines3")``.

Run it::

    python examples/ppo_pistonball.py --total-timesteps 200000
    python examples/ppo_pistonball.py --total-timesteps 2000 --n-pistons 4 --num-envs 2

It prints SB3's training log (``--verbose 1``) and, at the end, the steps, wall time and
steps/s. Needs ``pip install 'envfleet[sb3,pettingzoo]'``.
"""

from __future__ import annotations

import argparse
import functools
import time
from typing import Any

import supersuit as ss
from pettingzoo.butterfly import pistonball_v6
from stable_baselines3 import PPO

from envfleet.adapters.sb3 import SB3VecEnv


def make_env(n_pistons: int = 20, max_cycles: int = 125, size: int = 84) -> Any:
    """One pistonball ParallelEnv, preprocessed as the PettingZoo/SuperSuit tutorial does.

    Returns:
        a ``pettingzoo.ParallelEnv`` of ``n_pistons`` agents, each with ``uint8[size, size,
        3]`` observations (3 stacked grayscale frames) and ``Box(-1, 1, (1,), float32)``
        actions.
    """
    env = pistonball_v6.parallel_env(
        n_pistons=n_pistons,
        time_penalty=-0.1,
        continuous=True,
        random_drop=True,
        random_rotate=True,
        ball_mass=0.75,
        ball_friction=0.3,
        ball_elasticity=1.5,
        max_cycles=max_cycles,
    )
    env = ss.color_reduction_v0(env, mode="B")
    env = ss.resize_v1(env, x_size=size, y_size=size)
    return ss.frame_stack_v1(env, 3)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--total-timesteps", type=int, default=2_000_000, help="agent steps")
    parser.add_argument("--num-envs", type=int, default=8, help="pistonball envs")
    parser.add_argument("--n-pistons", type=int, default=20)
    parser.add_argument("--max-cycles", type=int, default=125)
    parser.add_argument("--size", type=int, default=84, help="observation height and width")
    parser.add_argument("--backend", default="processes")
    parser.add_argument("--n-steps", type=int, default=256, help="steps per row per update")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--n-epochs", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--verbose", type=int, default=1)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Train PPO for ``--total-timesteps`` agent steps (SB3 rounds up to whole rollouts).

    Returns:
        ``model`` (the trained PPO), ``steps`` (``model.num_timesteps``), ``seconds`` (wall
        time of ``learn``), ``losses`` (SB3's last ``train/*`` loss values), ``rows``
        (``num_envs * n_pistons``).
    """
    args = parse_args(argv)
    factory = functools.partial(make_env, args.n_pistons, args.max_cycles, args.size)
    venv = SB3VecEnv(factory, args.num_envs, backend=args.backend)
    try:
        model = PPO(
            "CnnPolicy",
            venv,
            n_steps=args.n_steps,
            batch_size=args.batch_size,
            n_epochs=args.n_epochs,
            gamma=0.95,
            gae_lambda=0.99,
            ent_coef=0.09,
            learning_rate=6e-4,
            vf_coef=0.04,
            max_grad_norm=0.9,
            clip_range=0.3,
            seed=args.seed,
            verbose=args.verbose,
        )
        began = time.perf_counter()
        # SB3 logs before each update: the last update's train/* values are still there after
        model.learn(total_timesteps=args.total_timesteps, log_interval=1)
        seconds = time.perf_counter() - began
    finally:
        venv.close()
    values = dict(model.logger.name_to_value)
    losses = {key: float(value) for key, value in values.items() if key.endswith("loss")}
    steps = int(model.num_timesteps)
    if args.verbose:
        print(f"{steps} agent steps in {seconds:.1f} s, {steps / seconds:.0f} steps/s; {losses}")
    return {
        "model": model,
        "steps": steps,
        "seconds": seconds,
        "losses": losses,
        "rows": venv.num_envs,
    }


if __name__ == "__main__":
    main()
