"""Time to score: one PPO trained over every system until it reaches the workload's score.

Run: ``python benchmarks/train.py --workload cartpole [--seeds 3] [--systems LIST] [--budget
STEPS] [--max-minutes M] [--json [FILE]] [--plot FILE.png] [--md FILE] [--note TEXT]``. It
takes the options ``envfleet bench --train`` had, which ran this code until it moved out of
the package (issue 51: a library of vector envs ships no PPO): ``--train NAME`` is
``--workload NAME``, ``--json`` without FILE prints the JSON instead of the table. Needs torch
(stable-baselines3 for its row, PufferLib for its, matplotlib for ``--plot``). The Markdown
table goes to stdout and to ``--md`` (default ``benchmarks/results/train-<workload>.md``).
``--render FILE.json [--plot FILE.png] [--json FILE]`` trains nothing: it writes the table,
the plot and the JSON of a JSON file written before, as the current code writes them.

Workloads (:data:`TRAIN_WORKLOADS`), the score being the mean undiscounted return of the last
:data:`SCORE_EPISODES` finished training episodes (the stochastic policy, as sampled), checked
after each update:

- ``cartpole``: ``CartPole-v1`` x8 to 475, examples/ppo_cartpole.py's hyperparameters (128
  steps per env per update, minibatches of 256, 10 epochs, lr 1e-3 annealed over the budget of
  500,000 env steps);
- ``lunarlander``: ``LunarLander-v3`` x16 to 200, rl-baselines3-zoo's tuned PPO (1024 steps per
  env per update, minibatches of 64, 4 epochs, gamma 0.999, lambda 0.98, ent 0.01, lr 3e-4;
  budget 1,500,000 env steps, half again the zoo's 1,000,000, for the slower seeds);
- ``pong``: ``ALE/Pong-v5`` x8 (Atari-preprocessed: 84x84 grayscale, frameskip 4, 4 frames
  stacked), CleanRL's ppo_atari.py (Nature CNN, 128 steps per env per update, minibatches of
  256, 4 epochs, lr 2.5e-4 annealed, clip 0.1, ent 0.01): no score, the steps/s end to end
  over the first 50,000 env steps (200,000 frames), learning included. Needs ale-py and OpenCV.

One learner for every system: the PPO of ``examples/ppo.py``, the one the examples share
(CleanRL's: separate 64-64 tanh actor and critic or the Nature CNN, orthogonal
initialisation, Adam with ``eps=1e-5``, clipped surrogate, per-minibatch advantage
normalisation, gradient clipping), imported by path: the examples are single files in
CleanRL's manner but for that module, and this script uses nothing else outside envfleet's
public API. torch on the CPU with ``torch.set_num_threads(1)``, the same model,
hyperparameters and seeds everywhere. Only the way the envs are stepped differs
(:data:`TRAIN_SYSTEMS`):

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
  collected during the update before it, one policy version behind (decoupled PPO on those
  steps, ``examples/ppo.py``'s ``PPO.update``).

Advantages: GAE(lambda); an episode cut by its time limit (``truncated``) is bootstrapped from
the value of its final observation, as SB3 does; one that ``terminated`` is not. Each seed
runs every system (the order rotated from seed to seed); the table gives the medians over
seeds of the seconds and env steps to the score, their ratios to the best peer's
(:data:`TRAIN_PEERS`) and the part of the time spent learning.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import importlib.util
import json
import math
import multiprocessing
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import gymnasium
import numpy as np
from gymnasium.vector import AutoresetMode

import envfleet
from envfleet import ConfigError, check_gymnasium_id, usable_cores
from envfleet.bench import (
    PEER_INSTALL,
    PLOT_DPI,
    PUFFER_INSTALL,
    TORCH_INSTALL,
    BenchError,
    Machine,
    Workload,
    check_workload,
    describe_machine,
    machine_line,
    make_env,
    puffer_workers,
    require_matplotlib,
    require_torch,
)

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
if str(ROOT / "examples") not in sys.path:
    sys.path.insert(0, str(ROOT / "examples"))
try:  # examples/ppo.py: the PPO of the examples
    from ppo import PPO, Agent, EpisodeReturns, Policy, PPOConfig, gae
except ImportError as exc:
    raise SystemExit(f"train.py needs examples/ppo.py and torch ({TORCH_INSTALL}): {exc}") from exc

#: A picklable zero-argument factory of one env.
EnvFactory = Callable[[], Any]

#: The score is the mean return of this many last finished training episodes.
SCORE_EPISODES = 20


# -- workloads -------------------------------------------------------------------------------


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
        ppo: the hyperparameters (``examples/ppo.py``'s ``PPOConfig``).
        source: where the hyperparameters come from.
        policy: ``"mlp"`` or ``"cnn"`` (the kind of ``examples/ppo.py``'s ``Agent``).
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
        return functools.partial(make_env, self.env_id, self.atari)

    def check(self) -> None:
        """Check, without building anything, that its env can be built here.

        Raises:
            ConfigError: an unknown id, or ale-py or OpenCV missing for an Atari env (the
                message says what to install).
        """
        check_gymnasium_id(self.env_id)
        check_workload(Workload(self.env_id, self.num_envs, self.policy, self.atari))


#: The workloads: ``cartpole`` (``CartPole-v1`` x8 to 475),
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


def _learner(workload: TrainWorkload, seed: int) -> tuple[Policy, PPO]:
    """The policy and the learner of one run (``examples/ppo.py``'s), on one torch thread.

    Seeds: the weights (``torch.manual_seed(seed)``), the actions' generator (``seed``) and the
    minibatch shuffler (``seed + 1``).

    Raises:
        ConfigError: an env whose observations are not a ``Box`` or actions not ``Discrete``.
    """
    require_torch().set_num_threads(1)
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
    c = workload.ppo
    agent = Agent(obs_space.shape, int(act_space.n), workload.policy, c.hidden, seed)
    return Policy(agent, seed), PPO(agent, c, seed)


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


def _sampler(factory: EnvFactory, num_envs: int, policy: Policy, seed: int) -> envfleet.Sampler:
    return envfleet.Sampler(factory, policy, num_envs, seed=seed, progress=False)


def _sampler_prefetch(
    factory: EnvFactory, num_envs: int, policy: Policy, seed: int
) -> envfleet.Sampler:
    """The Sampler collecting during the update, leaving the learner a core: every env and
    the policy copies in the other cores' workers (worker inference, no envs in the
    learner's process), so the update's one torch thread and the collection run side by
    side."""
    workers = max(1, usable_cores() - 1)
    return envfleet.Sampler(
        factory, policy, num_envs, seed=seed, progress=False, prefetch=True,
        inference="worker", num_workers=workers, backend=envfleet.Processes(driver_envs=0),
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
    policy, learner = _learner(workload, seed)
    spec = TRAIN_SYSTEMS[system]
    t0 = time.perf_counter()
    try:
        if spec.kind == "sampler":
            built = spec.build(workload.factory(), workload.num_envs, policy, seed)
        else:
            built = spec.build(workload.factory(), workload.num_envs, seed)
    except ConfigError:
        raise
    except Exception as exc:
        raise _failed(exc, "building", system, workload.env_id) from exc
    startup_s = time.perf_counter() - t0
    finished = False
    progress = _Progress(workload, system, seed)
    try:
        try:
            if spec.kind == "sampler":
                run = _train_sampler(progress, built, learner)
            else:
                run = _train_vector(progress, built, policy, learner)
        except Exception as exc:
            raise _failed(exc, "training on", system, workload.env_id) from exc
        finished = True
    finally:
        try:
            built.close()
        except Exception as exc:
            if finished:
                raise _failed(exc, "closing", system, workload.env_id) from exc
    return replace(run, startup_s=startup_s)


def _failed(exc: Exception, doing: str, system: str, env_id: str) -> BenchError:
    return BenchError(
        f"{system} failed while {doing} {env_id!r}: {type(exc).__name__}: {exc}", system, env_id
    )


class _Progress:
    """A run's counters and trace; ``point()`` after each update says whether to stop."""

    def __init__(self, workload: TrainWorkload, system: str, seed: int):
        self.workload, self.system, self.seed = workload, system, seed
        self.returns = EpisodeReturns(workload.num_envs, SCORE_EPISODES)
        self.steps = 0
        self.learn_s = 0.0
        self.trace: list[TrainPoint] = []
        self.start = time.perf_counter()

    def lr(self) -> float:
        return self.workload.ppo.lr(self.steps / self.workload.budget)

    def reached(self) -> bool:
        return self.returns.full() and self.returns.mean() >= self.workload.target

    def point(self) -> bool:
        self.trace.append(
            TrainPoint(time.perf_counter() - self.start, self.steps, self.returns.mean())
        )
        return self.reached() or self.steps >= self.workload.budget

    def run(self, learner: PPO, note: str = "") -> TrainRun:
        last = self.trace[-1]
        return TrainRun(
            self.system,
            self.seed,
            self.reached(),
            last.seconds,
            last.steps,
            len(self.trace),
            self.returns.count,
            last.mean_return,
            math.nan,
            self.learn_s,
            learner.digest(),
            tuple(self.trace),
            note,
        )


def _train_vector(progress: _Progress, envs: TrainEnvs, policy: Policy, learner: PPO) -> TrainRun:
    """CleanRL's loop over a :class:`TrainEnvs`: ``T`` steps of every env into ``[T, N]``
    arrays, GAE along ``T``, one update of the valid transitions (time-major), repeated."""
    c, n = progress.workload.ppo, progress.workload.num_envs
    t_steps = c.steps_per_update
    agent = learner.agent
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
                final_values[t, rows] = agent.values(np.stack([final[r] for r in rows]))
            done = terminated[t] | truncated[t]
            progress.returns.add_step(rewards[t], done, valid[t])
            if envs.next_step_reset:
                pending = done & valid[t]
        t0 = time.perf_counter()
        next_values = np.empty((t_steps, n), dtype=np.float64)
        next_values[:-1] = values[1:]
        next_values[-1] = agent.values(obs)
        if not envs.next_step_reset:  # else the next row's value is the final observation's
            next_values = np.where(truncated, final_values, next_values)
        next_values[terminated] = 0.0
        advantages = gae(
            rewards, values, next_values, ~(terminated | truncated), c.gamma, c.gae_lambda
        )
        keep = valid.reshape(-1)
        progress.steps += int(keep.sum())
        learner.update(
            obs_buf.reshape(t_steps * n, *obs.shape[1:])[keep],
            actions.reshape(-1)[keep],
            logp.reshape(-1)[keep],
            advantages.reshape(-1)[keep].astype(np.float32),
            (advantages + values).reshape(-1)[keep].astype(np.float32),
            lr,
        )
        progress.learn_s += time.perf_counter() - t0
        if progress.point():
            return progress.run(learner)


def _train_sampler(progress: _Progress, sampler: envfleet.Sampler, learner: PPO) -> TrainRun:
    """The same PPO over an :class:`envfleet.Sampler`: ``sample(steps_per_update *
    num_envs)``, GAE per segment (``PPO.learn``: the steps of an older policy version stale),
    one update, then ``update_policy()`` (the model changed in place)."""
    while True:
        lr = progress.lr()
        batch = sampler.sample(progress.workload.batch_steps)
        t0 = time.perf_counter()
        progress.returns.add_batch(batch)
        progress.steps += batch.num_steps
        learner.learn(batch, lr, sampler.policy_version)
        progress.learn_s += time.perf_counter() - t0
        sampler.update_policy(None)
        if progress.point():
            report = sampler.report()
            return progress.run(learner, note=f"{report.inference} inference, {report.choice}")


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

    # JSON has no nan or inf: they become None (json writes them as NaN and Infinity tokens,
    # which parse_constant reads back as None).
    doc = json.loads(json.dumps(asdict(report)), parse_constant=lambda _: None)
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


# -- the command line ------------------------------------------------------------------------


def _systems(text: str) -> list[str]:
    names = [part.strip() for part in text.split(",") if part.strip()]
    for name in names:
        if name not in TRAIN_SYSTEMS:
            raise argparse.ArgumentTypeError(
                f"unknown system {name!r}; choose from {', '.join(TRAIN_SYSTEMS)}"
            )
    return list(dict.fromkeys(names))


def _positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return int(text)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark with ``argv`` (default ``sys.argv[1:]``): exit status 0; argparse's
    2 for bad arguments (an unknown system, a missing library); 1, with the reason, when a
    system failed."""
    parser = argparse.ArgumentParser(
        prog="benchmarks/train.py", description=(__doc__ or "").split("\n")[0]
    )
    parser.add_argument(
        "--workload",
        "--train",
        choices=tuple(TRAIN_WORKLOADS),
        default="cartpole",
        help="what to train (--train: its name in envfleet bench --train; default cartpole)",
    )
    parser.add_argument(
        "--seeds", type=_positive_int, default=3, metavar="K", help="seeds 1..K (default 3)"
    )
    parser.add_argument(
        "--systems",
        type=_systems,
        default=list(TRAIN_SYSTEMS),
        metavar="LIST",
        help=f"comma-separated, of {','.join(TRAIN_SYSTEMS)} (default: all)",
    )
    parser.add_argument(
        "--budget",
        type=_positive_int,
        default=None,
        metavar="STEPS",
        help="env steps after which a run that has not reached the target stops (default: "
        "the workload's, 500,000 for cartpole, 1,500,000 for lunarlander, 50,000 for pong)",
    )
    parser.add_argument(
        "--max-minutes",
        type=float,
        default=None,
        help="start no further seed once one more would end past this many minutes",
    )
    parser.add_argument(
        "--json",
        nargs="?",
        const="-",
        default=None,
        metavar="FILE",
        help="write the report as JSON to FILE, or, without FILE, print it instead of the table",
    )
    parser.add_argument("--plot", type=Path, default=None, metavar="FILE.png")
    parser.add_argument(
        "--md", type=Path, default=None, metavar="FILE", help="default results/train-<workload>.md"
    )
    parser.add_argument(
        "--note", default="", help="a line for the Markdown file, under the command"
    )
    parser.add_argument(
        "--render",
        type=Path,
        default=None,
        metavar="FILE.json",
        help=(
            "train nothing: write the table (--md), the plot (--plot) and the JSON (--json, in "
            "the current layout) of a --json file written before"
        ),
    )
    args = parser.parse_args(argv)
    try:
        if args.plot is not None:
            require_matplotlib()
    except ConfigError as exc:
        parser.error(str(exc))
    if args.render is not None:
        return _render(args.render, args.md, args.plot, args.json, args.note)
    workload = TRAIN_WORKLOADS[args.workload]
    if args.budget is not None:
        workload = replace(workload, budget=args.budget)
    argv = list(argv if argv is not None else sys.argv[1:])

    def progress(system: str, seed: int, run: TrainRun | None) -> None:
        if run is None:
            print(f"  seed {seed}: {system} ...", file=sys.stderr, flush=True)
            return
        if workload.scored:
            reached = "reached" if run.reached else "did not reach"
            outcome = f"{reached} {workload.target:g} after"
        else:
            outcome = "ran"
        print(
            f"  seed {seed}: {system} {outcome} {run.steps:,} steps, "
            f"{run.seconds:.1f} s ({run.learn_s:.1f} s learning)",
            file=sys.stderr,
            flush=True,
        )

    started = time.perf_counter()
    try:
        report = measure_train(
            workload,
            args.systems,
            tuple(range(1, args.seeds + 1)),
            max_seconds=None if args.max_minutes is None else args.max_minutes * 60,
            progress=progress,
        )
    except ConfigError as exc:
        parser.error(str(exc))
    except BenchError as exc:
        raise SystemExit(f"benchmarks/train.py: {exc}") from exc
    took = time.perf_counter() - started
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    md = args.md or RESULTS / f"train-{args.workload}.md"
    _write(report, _command(argv), date, took, md, args.note, show=args.json != "-")
    if args.json is not None:
        doc = {"date": date, "argv": argv, **train_report_dict(report), "note": args.note}
        _write_json(doc, args.json)
    if args.plot is not None:
        plot_train(report, str(args.plot))
        print(f"plot written to {args.plot}", file=sys.stderr)
    return 0


def _command(argv: list[str]) -> str:
    """The command line that ran, less ``--note``'s text (the table shows it apart)."""
    shown, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--note":
            skip = True
        elif not arg.startswith("--note="):
            shown.append(arg)
    return " ".join(["python", "benchmarks/train.py", *shown])


def _write(
    report: TrainReport,
    command: str,
    date: str,
    took: float,
    md: Path,
    note: str = "",
    show: bool = True,
) -> None:
    """Write the table, headed by the command that measured it (and ``note``), to ``md``,
    and print it when ``show``."""
    text = f"`{command}` ({date}, {took / 60:.1f} min)\n\n"
    if note:
        text += f"{note}\n\n"
    text += train_table(report)
    if show:
        print(text, flush=True)
    md.parent.mkdir(parents=True, exist_ok=True)
    md.write_text(text)
    print(f"table written to {md}", file=sys.stderr)


def _write_json(doc: dict[str, Any], target: str) -> None:
    """``doc`` as JSON to the file ``target``, or to stdout for ``"-"``."""
    text = json.dumps(doc, indent=2) + "\n"
    if target == "-":
        sys.stdout.write(text)
    else:
        Path(target).write_text(text)


def _render(path: Path, md: Path | None, plot: Path | None, out: str | None, note: str = "") -> int:
    """The table (and plot, and JSON ``out`` in the current layout) of a JSON file this script
    wrote, without training again; ``note`` replaces the file's own note when given."""
    doc = json.loads(path.read_text())
    report = train_report_from_dict(doc)
    command = _command(doc.get("argv", []))
    md = md or RESULTS / f"train-{report.workload.name}.md"
    note = note or str(doc.get("note", ""))
    _write(report, command, str(doc.get("date", "")), report.wall_s, md, note, out != "-")
    if out is not None:
        again = {"date": doc.get("date", ""), "argv": doc.get("argv", [])}
        _write_json({**again, **train_report_dict(report), "note": note}, out)
    if plot is not None:
        plot_train(report, str(plot))
        print(f"plot written to {plot}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
