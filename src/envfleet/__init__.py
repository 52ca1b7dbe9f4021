"""envfleet: run many copies of a reinforcement-learning environment in parallel.

``envfleet.make(env, num_envs, backend=...)`` returns a ``gymnasium.vector.VectorEnv`` whose
results are bit-identical to ``gymnasium.vector.SyncVectorEnv`` for the same seeds and actions.
docs/architecture.md states the goals and the public contract, and describes the code as built.
"""

from envfleet._backends.recycle import Recycle
from envfleet._backends.supervisor import RestartPolicy
from envfleet._core.cores import usable_cores
from envfleet._core.errors import (
    AlreadyPendingCallError,
    ClosedEnvironmentError,
    ConfigError,
    EnvCrashedError,
    EnvError,
    EnvfleetError,
    EnvRestartedWarning,
    HangWarning,
    InvalidActionError,
    InvalidArgumentError,
    NoAsyncCallError,
    PoolStateError,
    RemoteTraceback,
    ResetNeededError,
    SpaceMismatchError,
    StartTimeoutError,
    StepTimeoutError,
    UnsupportedError,
    WrongProcessError,
)
from envfleet._core.replay import Replay, ReplayFileError, Snapshot
from envfleet._core.replay_runner import run_replay as replay
from envfleet._core.stats import FleetStats, StepTimeStats, WorkerMemory
from envfleet._front.factories import check_gymnasium_id
from envfleet._front.make import BACKENDS, make
from envfleet._front.multi_agent import AgentError
from envfleet._front.multi_agent_vector_env import MultiAgentVectorEnv
from envfleet._front.options import Processes, Ray, Supervision, TorchOutput
from envfleet._front.process_env import ProcessEnv
from envfleet._front.vector_env import FleetVectorEnv
from envfleet._sampler.auto_inference import SamplerReport
from envfleet._sampler.inference import SamplerStats, SamplerTimers, TimerStat
from envfleet._sampler.rollout import EpisodeBatch
from envfleet._sampler.sampler import Sampler, SamplerSnapshot

__version__ = "0.1.0"

__all__ = [
    "BACKENDS",
    "AgentError",
    "AlreadyPendingCallError",
    "ClosedEnvironmentError",
    "ConfigError",
    "EnvCrashedError",
    "EnvError",
    "EnvRestartedWarning",
    "EnvfleetError",
    "EpisodeBatch",
    "FleetStats",
    "FleetVectorEnv",
    "HangWarning",
    "InvalidActionError",
    "InvalidArgumentError",
    "MultiAgentVectorEnv",
    "NoAsyncCallError",
    "PoolStateError",
    "ProcessEnv",
    "Processes",
    "Ray",
    "Recycle",
    "RemoteTraceback",
    "Replay",
    "ReplayFileError",
    "ResetNeededError",
    "RestartPolicy",
    "Sampler",
    "SamplerStats",
    "SamplerReport",
    "SamplerSnapshot",
    "SamplerTimers",
    "Snapshot",
    "SpaceMismatchError",
    "StepTimeStats",
    "StartTimeoutError",
    "StepTimeoutError",
    "Supervision",
    "TimerStat",
    "TorchOutput",
    "UnsupportedError",
    "WorkerMemory",
    "WrongProcessError",
    "__version__",
    "check_gymnasium_id",
    "make",
    "replay",
    "usable_cores",
]
