"""The first-ready pool loop against the plain loop, with a torch policy choosing every action.

Two workloads (issue 19's): ``CartPole-v1`` x16 with an MLP 64-64 tanh policy, and
``ALE/Pong-v5`` x8 (``frameskip=1`` + ``AtariPreprocessing(frame_skip=4, screen_size=84,
grayscale_obs=True)`` + ``FrameStackObservation(4)``, observations / 255; without OpenCV, ALE's
own ``frameskip=4`` grayscale frames resized by nearest rows and columns) with the Nature CNN.
torch runs with one thread; actions are sampled from a Categorical over the policy's logits.

Systems, on ``backend="processes"`` with make()'s defaults otherwise:

- ``plain``: ``envfleet.make(env, N)``; loop: policy on the N observations -> ``step``;
- ``pool``: ``envfleet.make(env, N, batch_size=N/2)``, ``async_reset``; loop: ``recv`` ->
  policy on the batch -> ``send(actions, info["env_id"])`` (EnvPool's asynchronous loop);
- ``pool-wK`` (``--pool-workers K ...``): the pool with ``num_workers=K``.

Each (workload, system) is measured ``--repeats`` times for ``--seconds`` after a warm-up, the
systems interleaved (the order rotates every repetition); the table gives medians of steps/s
and the median, over repetitions, of each system's ratio to ``plain`` in the same repetition.

Run: ``python benchmarks/pool_loop.py`` (about 2 minutes on 2 cores); results go to
``benchmarks/results/pool_loop.{md,json}``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gymnasium
import numpy as np
import torch
from torch import nn

import envfleet

RESULTS = Path(__file__).resolve().parent / "results"


def cartpole() -> gymnasium.Env[Any, Any]:
    return gymnasium.make("CartPole-v1")


class Resize84(gymnasium.ObservationWrapper[Any, Any, Any]):
    """Grayscale 210x160 frames to 84x84 by nearest rows and columns (numpy; no OpenCV)."""

    ROWS = np.linspace(0, 209, 84).round().astype(np.intp)
    COLS = np.linspace(0, 159, 84).round().astype(np.intp)

    def __init__(self, env: gymnasium.Env[Any, Any]):
        super().__init__(env)
        self.observation_space = gymnasium.spaces.Box(0, 255, (84, 84), np.uint8)

    def observation(self, observation: np.ndarray) -> np.ndarray:
        return observation[self.ROWS[:, None], self.COLS]


def pong() -> gymnasium.Env[Any, Any]:
    import ale_py

    gymnasium.register_envs(ale_py)
    try:
        import cv2  # noqa: F401  (AtariPreprocessing needs OpenCV)
    except ImportError:
        env = Resize84(gymnasium.make("ALE/Pong-v5", frameskip=4, obs_type="grayscale"))
    else:
        env = gymnasium.make("ALE/Pong-v5", frameskip=1)
        env = gymnasium.wrappers.AtariPreprocessing(
            env, frame_skip=4, screen_size=84, grayscale_obs=True
        )
    return gymnasium.wrappers.FrameStackObservation(env, 4)


def mlp_policy(obs_dim: int, n_actions: int) -> nn.Module:
    return nn.Sequential(
        nn.Linear(obs_dim, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, n_actions)
    )


class NatureCNN(nn.Module):
    """CleanRL's Atari actor: the Nature CNN, then a linear layer to the logits."""

    def __init__(self, n_actions: int):
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(4, 32, 8, stride=4),
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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x / 255.0)


WORKLOADS: dict[str, tuple[Callable[[], gymnasium.Env[Any, Any]], int, str]] = {
    "CartPole-v1": (cartpole, 16, "mlp"),
    "ALE/Pong-v5": (pong, 8, "cnn"),
}


def make_act(kind: str, env: gymnasium.Env[Any, Any]) -> Callable[[np.ndarray], np.ndarray]:
    """obs batch (numpy) -> sampled actions (int64 numpy)."""
    n_actions = int(env.action_space.n)  # type: ignore[attr-defined]
    torch.manual_seed(0)
    if kind == "mlp":
        model: nn.Module = mlp_policy(int(np.prod(env.observation_space.shape)), n_actions)
    else:
        model = NatureCNN(n_actions)
    model.eval()

    def act(obs: np.ndarray) -> np.ndarray:
        with torch.inference_mode():
            x = torch.as_tensor(obs, dtype=torch.float32)
            logits = model(x)
            actions = torch.distributions.Categorical(logits=logits).sample()
        return actions.numpy()

    return act


def plain_rate(envs: Any, act: Callable[[np.ndarray], np.ndarray], seconds: float) -> float:
    obs, _ = envs.reset(seed=0)
    n = envs.num_envs
    warm_end = time.perf_counter() + min(0.5, seconds / 4)
    while time.perf_counter() < warm_end:
        obs, *_ = envs.step(act(obs))
    steps, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        obs, *_ = envs.step(act(obs))
        steps += n
    return steps / (time.perf_counter() - start)


def pool_rate(envs: Any, act: Callable[[np.ndarray], np.ndarray], seconds: float) -> float:
    envs.async_reset(seed=0)
    b = envs.batch_size
    warm_end = time.perf_counter() + min(0.5, seconds / 4)
    while time.perf_counter() < warm_end:
        obs, *_, info = envs.recv()
        envs.send(act(obs), info["env_id"])
    steps, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        obs, *_, info = envs.recv()
        envs.send(act(obs), info["env_id"])
        steps += b
    return steps / (time.perf_counter() - start)


def systems(name: str, pool_workers: list[int]) -> dict[str, Callable[[float], float]]:
    env_fn, n, kind = WORKLOADS[name]
    probe = env_fn()
    act = make_act(kind, probe)
    probe.close()

    def plain(seconds: float) -> float:
        with envfleet.make(env_fn, n) as envs:
            return plain_rate(envs, act, seconds)

    def pool(workers: int | None) -> Callable[[float], float]:
        def run(seconds: float) -> float:
            with envfleet.make(env_fn, n, batch_size=n // 2, num_workers=workers) as envs:
                return pool_rate(envs, act, seconds)

        return run

    table = {"plain": plain, "pool": pool(None)}
    for k in pool_workers:
        table[f"pool-w{k}"] = pool(k)
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--envs", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--pool-workers", type=int, nargs="*", default=[])
    parser.add_argument("--out", default="pool_loop")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    for name in args.envs:
        table = systems(name, args.pool_workers)
        rates: dict[str, list[float]] = {}
        ratios: dict[str, list[float]] = {}
        for r in range(args.repeats):
            names = list(table)
            names = names[r % len(names) :] + names[: r % len(names)]  # rotate the order
            got = {system: table[system](args.seconds) for system in names}
            for system, rate in got.items():
                rates.setdefault(system, []).append(rate)
                ratios.setdefault(system, []).append(rate / got["plain"])
            print(name, r, {k: round(v) for k, v in got.items()}, file=sys.stderr)
        for system in table:
            rows.append(
                {
                    "env": name,
                    "num_envs": WORKLOADS[name][1],
                    "system": system,
                    "steps_per_s": statistics.median(rates[system]),
                    "x_plain": statistics.median(ratios[system]),
                    "runs": rates[system],
                }
            )
    command = "python benchmarks/pool_loop.py " + " ".join(
        argv if argv is not None else sys.argv[1:]
    )
    lines = [
        "# Pool loop (batch_size = num_envs / 2) against the plain loop, torch policy",
        "",
        f"`{command.strip()}` on {os.cpu_count()} cores, Python {platform.python_version()}, "
        f"torch {torch.__version__} (1 thread), envfleet {envfleet.__version__}; medians of "
        f"{args.repeats} runs of {args.seconds:g} s, interleaved.",
        "",
        "| env | N | system | steps/s | x plain |",
        "|---|---:|---|---:|---:|",
    ]
    for row in rows:
        lines.append(
            f"| {row['env']} | {row['num_envs']} | {row['system']} | "
            f"{row['steps_per_s']:,.0f} | {row['x_plain']:.2f} |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.out}.md").write_text(text)
    (RESULTS / f"{args.out}.json").write_text(
        json.dumps({"rows": rows, "command": command}, indent=2)
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
