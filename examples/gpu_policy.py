"""A torch policy on a GPU choosing the actions of envs that envfleet steps on the CPU cores.

The envs step in envfleet's workers (``backend="processes"``, the default); the policy runs
in this process on the whole batch of observations, on CUDA when there is a GPU and on the CPU
otherwise, so the script runs anywhere. Only a GPU brings a speed-up: on the CPU the policy
and the envs share the cores, and a small MLP is as fast there (the GPU pays off for a large
network, a CNN on image observations, or many envs per call). Each step moves the observations
to the device and the actions back
(``envfleet.make(..., output=envfleet.TorchOutput(device=...))`` hands out torch tensors
instead: ``docs/integrations/torch.md``). Episode statistics come
from gymnasium's vector ``RecordEpisodeStatistics`` over the vector env.

Run it::

    python examples/gpu_policy.py                   # cuda if available, else cpu
    python examples/gpu_policy.py --device cpu --num-envs 8 --steps 500
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import gymnasium
import numpy as np
import torch
from gymnasium.wrappers.vector import RecordEpisodeStatistics
from torch import nn

import envfleet


def pick_device(name: str = "auto") -> torch.device:
    """``"auto"``: CUDA when a GPU is there, else the CPU; any other name as torch reads it."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


class Policy(nn.Module):
    """A 64-64 tanh MLP over flat observations, sampling discrete actions from its logits."""

    def __init__(self, obs_dim: int, num_actions: int):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(obs_dim, 64),
            nn.Tanh(),
            nn.Linear(64, 64),
            nn.Tanh(),
            nn.Linear(64, num_actions),
        )

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return torch.distributions.Categorical(logits=self.net(obs)).sample()


def run(
    env_id: str = "CartPole-v1",
    num_envs: int = 16,
    steps: int = 2_000,
    device: str = "auto",
    seed: int = 0,
    **make_kwargs: Any,
) -> dict[str, Any]:
    """Step ``num_envs`` copies of ``env_id`` ``steps`` times with the policy on ``device``;
    returns the device, steps/s and the finished episodes' count and mean return."""
    dev = pick_device(device)
    torch.manual_seed(seed)
    envs = RecordEpisodeStatistics(envfleet.make(env_id, num_envs, **make_kwargs))
    try:
        obs_dim = int(np.prod(envs.single_observation_space.shape or ()))
        action_space = envs.single_action_space
        assert isinstance(action_space, gymnasium.spaces.Discrete), "a discrete action space"
        policy = Policy(obs_dim, int(action_space.n)).to(dev)
        obs, _ = envs.reset(seed=seed)
        start = time.perf_counter()
        with torch.inference_mode():
            for _ in range(steps):
                batch = torch.as_tensor(obs, dtype=torch.float32, device=dev).reshape(num_envs, -1)
                actions = policy(batch).cpu().numpy()
                obs, _, _, _, _ = envs.step(actions)
        seconds = time.perf_counter() - start
        returns = list(envs.return_queue)
    finally:
        envs.close()
    return {
        "device": str(dev),
        "steps_per_s": steps * num_envs / seconds,
        "episodes": len(returns),
        "mean_return": float(np.mean(returns)) if returns else float("nan"),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--env-id", default="CartPole-v1")
    parser.add_argument("--num-envs", type=int, default=16)
    parser.add_argument("--steps", type=int, default=2_000)
    parser.add_argument("--device", default="auto", help="auto (cuda if available), cuda, cpu")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if pick_device(args.device).type == "cpu":
        torch.set_num_threads(1)  # leave the other cores to the envs' workers
    result = run(args.env_id, args.num_envs, args.steps, args.device, args.seed)
    if result["device"] == "cpu":
        print("no GPU: the policy runs on the CPU, beside the envs (no speed-up from a GPU)")
    print(
        f"{result['device']}: {result['steps_per_s']:,.0f} env steps/s, "
        f"{result['episodes']} episodes, mean return {result['mean_return']:.1f} "
        "(random policy weights: no learning here)"
    )
    return result


if __name__ == "__main__":  # spawn and forkserver import this script in every worker
    main()
