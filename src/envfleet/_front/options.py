"""make()'s and the Sampler's option objects, and the one table of which options go together.

Options that go together are one object each, checked once, when it is built:

- :class:`Supervision`: timeouts, hang reports, restarts, recycling and the record's length;
- :class:`Processes` and :class:`Ray`: a backend with its own options (``backend=``);
- :class:`TorchOutput`: torch results with a device or pinned staging (``output=``).

Which options go together is decided here and nowhere else: :data:`RULES`, a table of the pairs
refused, each with its reason, which :func:`check` applies to a call's :class:`Settings` before
anything starts. tests/contract/test_option_pairs.py is generated from it: it tries every pair
of options and holds make() and the Sampler to the table (a refused pair raises
:class:`~envfleet.ConfigError` with the table's words before a worker starts; every other pair
builds and steps).
"""

from __future__ import annotations

import math
import multiprocessing
import numbers
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from gymnasium.vector import AutoresetMode

from envfleet._backends.recycle import Recycle
from envfleet._backends.supervisor import DEFAULT_RESTART_POLICY, RestartPolicy
from envfleet._core.action_log import REPLAY_STEPS
from envfleet._core.errors import ConfigError
from envfleet._core.hangs import DEFAULT_HANG_REPORT_DELAY, check_hang_report_delay

__all__ = [
    "DEFAULT_START_TIMEOUT",
    "DEFAULT_SUPERVISION",
    "RULES",
    "Processes",
    "Ray",
    "Rule",
    "Settings",
    "Supervision",
    "TorchOutput",
    "autoreset_mode_of",
    "backend_of",
    "check",
]

DEFAULT_START_TIMEOUT = 60.0  # seconds for the workers to build their envs
POOL_LAYOUTS = ("per_env", "blocks")


def _seconds(value: Any, name: str, *, allow_none: bool = True, zero: bool = False) -> Any:
    """``value`` as float seconds (> 0, or >= 0 with ``zero``), or ``None`` where allowed."""
    if value is None and allow_none:
        return None
    ok = (
        isinstance(value, numbers.Real)
        and not isinstance(value, bool)
        and math.isfinite(float(value))
        and (float(value) >= 0 if zero else float(value) > 0)
    )
    if not ok:
        bound = ">= 0" if zero else "> 0"
        none = "None or " if allow_none else ""
        raise ConfigError(f"{name} must be {none}seconds {bound}, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class Supervision:
    """How make() watches its envs: timeouts, hang reports, restarts, recycling, the record.

    ``make(env, n)`` supervises with ``Supervision()``: no step timeout, a hang reported after
    60 s, a worker that dies rebuilt (10 restarts a minute), workers recycled before they leak,
    the last 1,000 steps of each env recorded for replays and snapshots. docs/concepts/
    supervision.md explains each field.

    Attributes:
        step_timeout: seconds a step, reset or call may take before the workers still busy are
            killed and :class:`envfleet.StepTimeoutError` is raised (or, with a
            ``restart_policy``, those workers rebuilt); ``None`` (default): no bound.
        start_timeout: seconds the workers may take to build their envs, at start and when one
            is replaced (default 60); past it :class:`envfleet.StartTimeoutError`. ``None``:
            wait for good.
        hang_report_delay: seconds a call may wait on busy envs before an
            :class:`envfleet.HangWarning` names them with their stacks (again after twice that,
            four times, ...; default 60). Not a timeout: nothing is killed. ``None``: no reports.
        restart_policy: the :class:`envfleet.RestartPolicy` for workers that die or time out and
            envs that lose their simulator (default ``RestartPolicy()``); ``None``: fail fast.
        recycle: ``"auto"`` (default: a worker past its share of memory is replaced between
            episodes), an :class:`envfleet.Recycle` (your bounds) or ``None`` (never).
        replay_steps: steps per env kept for replays, snapshots and catching up a rebuilt worker
            (default 1000; 0 keeps none, which refuses ``recycle``).

    Raises:
        ConfigError: a value of the wrong type or out of range.

    Example::

        strict = envfleet.Supervision(step_timeout=5.0, restart_policy=None)
        envs = envfleet.make("CartPole-v1", 8, supervision=strict)
    """

    step_timeout: float | None = None
    start_timeout: float | None = DEFAULT_START_TIMEOUT
    hang_report_delay: float | None = DEFAULT_HANG_REPORT_DELAY
    restart_policy: RestartPolicy | None = DEFAULT_RESTART_POLICY
    recycle: Recycle | str | None = "auto"
    replay_steps: int = REPLAY_STEPS

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        set_(self, "step_timeout", _seconds(self.step_timeout, "step_timeout"))
        set_(self, "start_timeout", _seconds(self.start_timeout, "start_timeout"))
        set_(self, "hang_report_delay", check_hang_report_delay(self.hang_report_delay))
        if self.restart_policy is not None and not isinstance(self.restart_policy, RestartPolicy):
            raise ConfigError(
                "restart_policy must be None or an envfleet.RestartPolicy, got "
                f"{self.restart_policy!r}"
            )
        recycle = self.recycle
        if not (recycle is None or recycle == "auto" or isinstance(recycle, Recycle)):
            raise ConfigError(
                f"recycle must be 'auto', None or an envfleet.Recycle, got {self.recycle!r}"
            )
        steps = self.replay_steps
        if isinstance(steps, bool) or not isinstance(steps, numbers.Integral) or steps < 0:
            raise ConfigError(f"replay_steps must be an integer >= 0, got {steps!r}")
        if steps >= 2**31:
            raise ConfigError(f"replay_steps must be below 2**31, got {steps!r}")
        set_(self, "replay_steps", int(steps))

    @property
    def explicit_restarts(self) -> bool:
        """A restart policy given by the caller (not the default one)."""
        return self.restart_policy is not None and self.restart_policy is not DEFAULT_RESTART_POLICY

    @property
    def explicit_recycle(self) -> bool:
        """Recycling bounds given by the caller (an :class:`envfleet.Recycle`)."""
        return isinstance(self.recycle, Recycle)


DEFAULT_SUPERVISION = Supervision()


@dataclass(frozen=True)
class Processes:
    """``backend="processes"`` with options: worker processes over shared memory.

    Attributes:
        context: the ``multiprocessing`` start method (``"fork"``, ``"spawn"``,
            ``"forkserver"``); ``None``: the platform's.
        driver_envs: envs (the first block) the driver steps itself while the workers step the
            rest (default 0: every env in a worker). An opt-in for envs of a few µs a step on
            few cores; those envs live in the learner's process (no timeout, restart or
            recycling covers them). docs/backends/local.md says what it buys.
        spin_s: the most seconds a wait polls before it blocks (default 0.002; it adapts).
        pool_layout: a first-ready pool's layout when ``num_workers`` is not given:
            ``"per_env"`` (default: each env a group of its own, handed back when it finishes)
            or ``"blocks"`` (a worker's block handed back together).

    Raises:
        ConfigError: a start method this platform lacks, a negative ``driver_envs`` or
            ``spin_s``, an unknown ``pool_layout``.

    Example::

        envs = envfleet.make("CartPole-v1", 16, backend=envfleet.Processes(context="spawn"))
    """

    name: ClassVar[str] = "processes"
    context: str | None = None
    driver_envs: int = 0
    spin_s: float | None = None
    pool_layout: str = "per_env"

    def __post_init__(self) -> None:
        methods = multiprocessing.get_all_start_methods()
        if self.context is not None and self.context not in methods:
            # multiprocessing's own words first: the message its users (and SB3's tests) match.
            raise ConfigError(
                f"cannot find context for {self.context!r}: context={self.context!r} is not a "
                f"start method here; choose from {methods}"
            )
        envs = self.driver_envs
        if isinstance(envs, bool) or not isinstance(envs, numbers.Integral) or envs < 0:
            raise ConfigError(f"driver_envs must be an integer >= 0, got {envs!r}")
        object.__setattr__(self, "driver_envs", int(envs))
        object.__setattr__(self, "spin_s", _seconds(self.spin_s, "spin_s", zero=True))
        if self.pool_layout not in POOL_LAYOUTS:
            raise ConfigError(
                f"pool_layout must be one of {POOL_LAYOUTS}, got {self.pool_layout!r}"
            )

    def backend_options(self) -> dict[str, Any]:
        return {"driver_envs": self.driver_envs, "spin_s": self.spin_s}


@dataclass(frozen=True)
class Ray:
    """``backend="ray"`` with options: Ray actors, on this machine or a cluster's nodes.

    Attributes:
        address: the cluster to join when this process is not connected to Ray yet
            (``ray.init(address=...)``): ``None`` starts a local one, ``"auto"`` joins the one
            ``ray start`` started on this machine. envfleet never shuts a cluster down.
        actor_options: each actor's options (Ray's ``.options(...)``): ``num_cpus`` (default
            1, or an even share when there are more workers than CPUs), ``num_gpus``,
            ``resources``, ``scheduling_strategy`` (default ``"SPREAD"``), ``runtime_env``...

    Raises:
        ConfigError: ``address`` not a string, ``actor_options`` not a mapping (Ray checks
            the rest when make() asks it).

    Example::

        envs = envfleet.make(factory, 64, backend=envfleet.Ray(address="auto"))
    """

    name: ClassVar[str] = "ray"
    address: str | None = None
    actor_options: Mapping[str, Any] | None = field(default=None, hash=False)

    def __post_init__(self) -> None:
        if self.address is not None and not isinstance(self.address, str):
            raise ConfigError(f"address must be None or a string, got {self.address!r}")
        if self.actor_options is not None and not isinstance(self.actor_options, Mapping):
            raise ConfigError(
                f"actor_options must be None or a dict, got {type(self.actor_options).__name__}"
            )

    def backend_options(self) -> dict[str, Any]:
        options = None if self.actor_options is None else dict(self.actor_options)
        return {"ray_address": self.address, "ray_options": options}


@dataclass(frozen=True)
class TorchOutput:
    """``output="torch"`` with options: results as torch tensors on ``device``.

    Attributes:
        device: where results go (``"cuda"``, a ``torch.device``); ``None``: the CPU.
        pin_memory: stage results in pinned memory for ``non_blocking`` transfers (needs CUDA).

    Example::

        envs = envfleet.make("CartPole-v1", 8, output=envfleet.TorchOutput(device="cuda"))
    """

    device: Any = None
    pin_memory: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.pin_memory, bool):
            raise ConfigError(f"pin_memory must be a bool, got {self.pin_memory!r}")


def backend_of(backend: Any) -> tuple[str, dict[str, Any], Processes | None]:
    """make()'s ``backend=`` as a name, the backend's own options and the processes options.

    Raises:
        ConfigError: neither a name nor a :class:`Processes` or :class:`Ray`.
    """
    if isinstance(backend, str):
        processes = Processes() if backend == "processes" else None
        return backend, ({} if processes is None else processes.backend_options()), processes
    if isinstance(backend, Processes):
        return "processes", backend.backend_options(), backend
    if isinstance(backend, Ray):
        return "ray", backend.backend_options(), None
    raise ConfigError(
        "backend must be a name ('processes', 'threads', 'serial', 'ray', 'envpool'), "
        f"envfleet.Processes(...) or envfleet.Ray(...), got {backend!r}"
    )


_AUTORESET_SPELLINGS = {
    spelling: mode
    for mode in AutoresetMode
    for spelling in (mode.value.lower(), mode.name.lower(), mode.name.lower().replace("_", ""))
}


def autoreset_mode_of(value: Any) -> AutoresetMode:
    """``value`` as a gymnasium ``AutoresetMode``: the enum, its value (``"NextStep"``, as
    gymnasium's vector envs take it) or its name in any case (``"next_step"``, ``"NEXT_STEP"``).

    Raises:
        ConfigError: none of these.
    """
    if isinstance(value, AutoresetMode):
        return value
    mode = _AUTORESET_SPELLINGS.get(value.lower()) if isinstance(value, str) else None
    if mode is None:
        names = ", ".join(repr(m.value) for m in AutoresetMode)
        raise ConfigError(
            f"unknown autoreset_mode {value!r}: use gymnasium.vector.AutoresetMode or one of "
            f"{names} (or 'next_step', 'same_step', 'disabled')"
        )
    return mode


@dataclass(frozen=True)
class Settings:
    """One call's options as the table reads them (make()'s, and the Sampler's where it is
    the Sampler's call)."""

    backend: str
    pool: bool = False
    num_workers: bool = False  # given
    driver_envs: int = 0
    autoreset_mode: AutoresetMode = AutoresetMode.NEXT_STEP
    autoreset_mode_given: bool = False
    observation_mode_given: bool = False
    output: str = "numpy"  # "numpy" or "torch"
    supervision: Supervision = DEFAULT_SUPERVISION
    sampler: bool = False
    inference: str = "auto"
    prefetch: bool = False
    background: bool = False


@dataclass(frozen=True)
class Rule:
    """One refused pair of options: ``options`` names the two, ``refused`` says whether a
    call's settings hold it, ``reason`` is the error's text."""

    options: tuple[str, str]
    refused: Callable[[Settings], bool]
    reason: str


_IN_DRIVER = "envs the driver steps itself (Processes(driver_envs=...))"

RULES: tuple[Rule, ...] = (
    Rule(
        ("driver_envs", "batch_size"),
        lambda s: s.pool and s.driver_envs > 0,
        "a first-ready pool steps every env in a worker: leave Processes(driver_envs=0)",
    ),
    Rule(
        ("driver_envs", "step_timeout"),
        lambda s: s.driver_envs > 0 and s.supervision.step_timeout is not None,
        f"step_timeout cannot stop {_IN_DRIVER}: leave driver_envs=0 (the default)",
    ),
    Rule(
        ("driver_envs", "restart_policy"),
        lambda s: s.driver_envs > 0 and s.supervision.explicit_restarts,
        f"a restart policy cannot rebuild {_IN_DRIVER}: leave driver_envs=0 (the default)",
    ),
    Rule(
        ("driver_envs", "recycle"),
        lambda s: s.driver_envs > 0 and s.supervision.explicit_recycle,
        f"recycle replaces worker processes, not {_IN_DRIVER}: leave driver_envs=0",
    ),
    Rule(
        ("recycle", "backend"),
        lambda s: s.supervision.explicit_recycle and s.backend not in ("processes", "ray"),
        "recycle replaces worker processes: it is for backend 'processes' or 'ray' (serial, "
        "threads and envpool envs live in this process, which replacing a worker does not "
        "shrink)",
    ),
    Rule(
        ("recycle", "batch_size"),
        lambda s: s.supervision.explicit_recycle and s.pool,
        "recycle is for the synchronous vector env, not a first-ready pool",
    ),
    Rule(
        ("recycle", "replay_steps"),
        lambda s: s.supervision.explicit_recycle and s.supervision.replay_steps == 0,
        "recycle brings a new worker's envs up to date from their record: it needs "
        "replay_steps > 0",
    ),
    Rule(
        ("autoreset_mode", "batch_size"),
        lambda s: s.pool and s.autoreset_mode is AutoresetMode.DISABLED,
        "a first-ready pool autoresets its envs, as EnvPool does: use autoreset_mode "
        "'next_step' or 'same_step'",
    ),
    Rule(
        ("backend", "num_workers"),
        lambda s: s.backend == "envpool" and s.num_workers,
        "num_workers: not an option of backend='envpool' (EnvPool runs its envs on its own "
        "native threads: set env_kwargs={'num_threads': ...})",
    ),
    Rule(
        ("backend", "step_timeout"),
        lambda s: s.backend == "envpool" and s.supervision.step_timeout is not None,
        "step_timeout: EnvPool's native threads cannot be stopped (backend='envpool')",
    ),
    Rule(
        ("backend", "restart_policy"),
        lambda s: s.backend == "envpool" and s.supervision.explicit_restarts,
        "restart_policy: EnvPool's native envs cannot be rebuilt one by one (backend='envpool')",
    ),
    Rule(
        ("backend", "autoreset_mode"),
        lambda s: (
            s.backend == "envpool" and s.pool and s.autoreset_mode is not AutoresetMode.NEXT_STEP
        ),
        "a first-ready pool on backend='envpool' takes only autoreset_mode 'next_step', "
        "EnvPool's own autoreset (its fixed-size native batch cannot wait for the extra step "
        "SAME_STEP needs, and a pool always autoresets)",
    ),
    Rule(
        ("backend", "observation_mode"),
        lambda s: s.backend == "envpool" and s.observation_mode_given,
        "observation_mode: EnvPool's envs share one space (backend='envpool')",
    ),
    Rule(
        ("output", "batch_size"),
        lambda s: s.pool and s.output != "numpy",
        "torch output wraps step and reset, not a first-ready pool's send/recv: use "
        "output='numpy' (torch.from_numpy shares the arrays' memory)",
    ),
    Rule(
        ("inference", "backend"),
        lambda s: s.sampler and s.inference == "worker" and s.backend == "envpool",
        "worker inference runs a policy copy beside each worker's envs: backend='envpool' has "
        "no Python workers; use inference='driver'",
    ),
    Rule(
        ("sampler", "autoreset_mode"),
        lambda s: s.sampler and s.autoreset_mode_given,
        "the Sampler sets autoreset_mode itself (SAME_STEP)",
    ),
    Rule(
        ("sampler", "output"),
        lambda s: s.sampler and s.output != "numpy",
        "the Sampler hands the policy numpy observations: leave output='numpy' (convert in "
        "the policy)",
    ),
    Rule(
        ("inference", "recycle"),
        lambda s: s.sampler and s.inference == "worker" and s.supervision.explicit_recycle,
        "recycle replaces workers between the vector env's steps: it needs inference='driver' "
        "(worker inference steps the envs in the workers)",
    ),
    Rule(
        ("inference", "batch_size"),
        lambda s: s.sampler and s.inference == "worker" and s.pool,
        "batch_size (a first-ready pool) is for inference='driver'",
    ),
    Rule(
        ("inference", "background"),
        lambda s: s.sampler and s.background and s.inference != "worker",
        "background is an option of inference='worker'",
    ),
    Rule(
        ("prefetch", "background"),
        lambda s: s.sampler and s.prefetch and s.background,
        "prefetch collects ahead itself: leave background False",
    ),
    Rule(
        ("prefetch", "batch_size"),
        lambda s: s.sampler and s.prefetch and s.pool,
        "prefetch is for a synchronous vector env, not a first-ready pool",
    ),
)


def check(settings: Settings) -> None:
    """Refuse the first pair of :data:`RULES` that ``settings`` hold.

    Raises:
        ConfigError: that rule's reason.
    """
    for rule in RULES:
        if rule.refused(settings):
            raise ConfigError(rule.reason)
