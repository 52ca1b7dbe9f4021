"""Torch outputs: observations, rewards and done flags as ``torch`` tensors, and TensorDicts.

:class:`TorchVectorEnv` wraps a vector env (an :class:`envfleet.FleetVectorEnv`, or any
``gymnasium.vector.VectorEnv``) and returns tensors instead of numpy arrays. Build it with
``envfleet.make(..., output="torch")`` or directly::

    envs = envfleet.make("CartPole-v1", 16, copy=False)   # results: views of shared memory
    tenvs = TorchVectorEnv(envs)                           # tensors over those same bytes
    obs, info = tenvs.reset(seed=0)                        # obs: torch.float32[16, 4]
    obs, reward, terminated, truncated, info = tenvs.step(torch.zeros(16, dtype=torch.int64))
    td = tenvs.step_tensordict(actions)                    # TensorDict, batch_size [16]

Copy semantics and lifetimes (``copy`` is the vector env's, or :class:`TorchVectorEnv`'s own):

========================  ==================================================================
outputs                   what you get
========================  ==================================================================
CPU, ``copy=False``       ``torch.from_numpy`` views of envfleet's shared-memory buffers: no
                          copy at all, the same tensor objects every step, **valid until the
                          next call** (``step``, ``reset``, ...) overwrites them. ``clone()``
                          what you keep.
CPU, ``copy=True``        tensors over that step's own data, which no later call rewrites
                          while they live (a spare buffer or a copy, made once by the
                          vector env; see ``copy`` in :func:`envfleet.make`).
``pin_memory=True``       one copy into pinned (page-locked) buffers; with ``copy=False`` the
                          same preallocated buffers every step (valid until the next call),
                          with ``copy=True`` fresh ones (from torch's caching host allocator).
``device="cuda"``         fresh device tensors every step (yours to keep); with
                          ``pin_memory=True`` the transfer is ``non_blocking`` from the pinned
                          buffers, which are not rewritten before that transfer completed.
========================  ==================================================================

Infos stay numpy, in gymnasium's convention (``info[key]``, ``info["_key"]``).

torch and tensordict are optional: ``pip install 'envfleet[torch]'``. This module imports
them when first needed; without them it raises :class:`envfleet.ConfigError`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import numpy as np
from gymnasium.vector import VectorEnv, VectorWrapper

from envfleet._core.buffers import side_leaves
from envfleet._core.errors import ConfigError
from envfleet._front.options import TorchOutput

if TYPE_CHECKING:
    import torch
    from tensordict import TensorDict

__all__ = ["OUTPUTS", "TorchVectorEnv", "check_output", "import_torch", "make_with_output"]

OUTPUTS = ("numpy", "torch")

_INSTALL = "pip install 'envfleet[torch]'"

Path = tuple[str, ...]


def import_torch() -> Any:
    """Import and return the ``torch`` module.

    Raises:
        ConfigError: torch is not installed (``pip install 'envfleet[torch]'``).
    """
    try:
        import torch
    except ImportError as exc:
        raise ConfigError(f"torch outputs need torch: {_INSTALL}") from exc
    return torch


def _import_tensordict() -> Any:
    try:
        import tensordict
    except ImportError as exc:
        raise ConfigError(f"TensorDict outputs need the tensordict package: {_INSTALL}") from exc
    return tensordict


def _pinning_available(torch: Any) -> bool:
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None and accelerator.is_available():
        return True
    return bool(torch.cuda.is_available())


def _check_device(torch: Any, device: Any) -> torch.device:
    try:
        dev = torch.device(device)
        torch.empty(0, device=dev)  # raises when this torch build or machine lacks the device
    except (RuntimeError, AssertionError, TypeError, ValueError) as exc:
        raise ConfigError(f"device={device!r} is not available here: {exc}") from exc
    return cast("torch.device", dev)


def check_output(output: Any, copy: bool) -> bool:
    """Check :func:`envfleet.make`'s ``output``: ``"numpy"``, ``"torch"`` or an
    :class:`envfleet.TorchOutput`.

    Called before any worker starts. Returns the ``copy`` flag the underlying
    :class:`envfleet.FleetVectorEnv` should get: with pinning or a device transfer the staging
    copy is the only one needed, so the vector env hands out views (``copy=False``).

    Raises:
        ConfigError: another ``output``; torch missing; a device this machine lacks;
            ``pin_memory=True`` without an accelerator (CUDA) to pin memory for.
    """
    output = _torch_output(output)
    if output is None:
        return copy
    torch = import_torch()
    device = output.device
    dev = torch.device("cpu") if device is None else _check_device(torch, device)
    if output.pin_memory and not _pinning_available(torch):
        raise ConfigError(
            "pin_memory=True needs an accelerator (CUDA) to pin memory for, and this torch "
            "build or machine has none (torch.cuda.is_available() is False)"
        )
    return copy and not output.pin_memory and dev.type == "cpu"


def _torch_output(output: Any) -> TorchOutput | None:
    """make()'s ``output`` as a :class:`envfleet.TorchOutput`, ``None`` for numpy.

    Raises:
        ConfigError: neither ``"numpy"``, ``"torch"`` nor a TorchOutput.
    """
    if isinstance(output, TorchOutput):
        return output
    if isinstance(output, str) and output in OUTPUTS:
        return None if output == "numpy" else TorchOutput()
    raise ConfigError(f"output must be one of {OUTPUTS} or an envfleet.TorchOutput, got {output!r}")


def make_with_output(make: Callable[..., Any], arguments: dict[str, Any]) -> Any:
    """:func:`envfleet.make` with its ``output`` applied.

    ``arguments`` are every argument of ``make``: the vector env is made with
    ``output="numpy"`` (and ``copy=False`` where a staging copy or transfer follows, see
    :func:`check_output`), then wrapped in a :class:`TorchVectorEnv` for torch output.

    Raises:
        ConfigError: as :func:`check_output`, before any worker starts; else as ``make``.
    """
    arguments = dict(arguments)
    output, copy = arguments.pop("output"), bool(arguments["copy"])
    arguments["copy"] = check_output(output, copy)
    env = make(**arguments)
    torch_output = _torch_output(output)
    if torch_output is None:
        return env
    try:
        return TorchVectorEnv(
            env, device=torch_output.device, pin_memory=torch_output.pin_memory, copy=copy
        )
    except BaseException:
        env.close(terminate=True)
        raise


class TorchVectorEnv(VectorWrapper[Any, Any, Any, Any, Any]):
    """A vector env whose results are torch tensors (and, on request, TensorDicts).

    Results, for ``num_envs`` sub-environments:

    - observations: a tensor ``[num_envs, *shape]`` of the observation space's dtype (for
      example ``torch.float32[num_envs, 4]`` for CartPole), or a dict/tuple of them, structured
      as the wrapped env's numpy observations;
    - ``reward: torch.float64[num_envs]``;
    - ``terminated: torch.bool[num_envs]``, ``truncated: torch.bool[num_envs]``;
    - infos: unchanged (numpy, gymnasium's convention).

    Over a :class:`envfleet.MultiAgentVectorEnv` (``output="torch"`` with a PettingZoo
    factory), the same in its layout: observations ``[num_envs, A, *shape]`` (or a dict by
    agent), ``reward: torch.float64[num_envs, A]``, flags ``torch.bool[num_envs, A]``;
    ``infos["agent_mask"]`` stays numpy (the TensorDict entries hold it as a tensor).

    See the module docstring for the copy semantics and lifetimes: on the CPU with
    ``copy=False`` the tensors share memory with envfleet's buffers and are valid until the
    next call.

    Args:
        env: the vector env to wrap, usually an :class:`envfleet.FleetVectorEnv` made with
            ``copy=False``.
        device: where results go (``"cpu"``, ``"cuda"``, ``torch.device``); ``None``: the CPU.
        pin_memory: stage results in pinned host memory (for ``non_blocking`` transfers).
        copy: ``False``: on the CPU, results may be reused buffers, valid until the next call.
            ``True``: results stay valid. ``None``: the wrapped env's ``copy`` attribute
            (``True`` when it has none).

    Raises:
        ConfigError: torch missing, a device this machine lacks, ``pin_memory=True`` without
            an accelerator, an observation or action space with a leaf a tensor cannot hold
            (Text, Graph, Sequence, OneOf, a custom Space: ``envfleet._core.buffers.side_leaves``).
    """

    def __init__(
        self,
        env: VectorEnv[Any, Any, Any],
        *,
        device: Any = None,
        pin_memory: bool = False,
        copy: bool | None = None,
    ):
        th = import_torch()
        for what, space in (
            ("observation", env.single_observation_space),
            ("action", env.single_action_space),
        ):
            if side_leaves(space):
                raise ConfigError(
                    f"output='torch' cannot represent the {what} space {space}: its leaves "
                    f"{side_leaves(space)} have no tensor form; use output='numpy'"
                )
        super().__init__(env)
        self._torch = th
        self.device: torch.device = (
            th.device("cpu") if device is None else _check_device(th, device)
        )
        if pin_memory and not _pinning_available(th):
            raise ConfigError(
                "pin_memory=True needs an accelerator (CUDA) to pin memory for, and this torch "
                "build or machine has none (torch.cuda.is_available() is False)"
            )
        self.pin_memory = bool(pin_memory)
        env_copy = bool(getattr(env, "copy", True))
        self.copy = env_copy if copy is None else bool(copy)
        # The wrapped env hands out views of buffers it rewrites in place: a tensor of ours that
        # must stay valid (copy=True) is then cloned, unless a transfer copies it anyway.
        self._clone = self.copy and not env_copy
        self._to_device = self.device.type != "cpu"
        # path -> (numpy array last seen there, tensor over it): an env that returns the same
        # arrays every step (copy=False) gets the same tensors back, built once.
        self._views: dict[Path, tuple[np.ndarray, torch.Tensor]] = {}
        self._pinned: dict[Path, torch.Tensor] = {}  # path -> preallocated pinned buffer
        self._done: torch.Tensor | None = None  # reused done buffer (CPU, copy=False)
        self._event: Any = None  # CUDA event: the last transfer out of the pinned buffers
        # A multi-agent env (envfleet.MultiAgentVectorEnv): per-agent flags, and the agent mask
        agents = getattr(env, "possible_agents", None)
        self._num_agents: int | None = None if agents is None else len(agents)
        if agents is not None:
            self.possible_agents: tuple[str, ...] = tuple(agents)

    # -- conversion ----------------------------------------------------------------------------

    def _tensor(self, path: Path, array: np.ndarray) -> torch.Tensor:
        """One result leaf as a tensor, following the copy semantics of the module docstring."""
        hit = self._views.get(path)
        if hit is not None and hit[0] is array:
            view = hit[1]
        else:
            view = self._torch.from_numpy(np.asarray(array))
            self._views[path] = (array, view)
        if self.pin_memory:
            if self.copy and not self._to_device:
                return self._pinned_like(view).copy_(view)
            staging = self._pinned.get(path)
            if staging is None or staging.shape != view.shape or staging.dtype != view.dtype:
                staging = self._pinned_like(view)
                self._pinned[path] = staging
            staging.copy_(view)
            if not self._to_device:
                return staging
            return staging.to(self.device, non_blocking=True)
        if self._to_device:
            return view.to(self.device)
        return view.clone() if self._clone else view

    def _pinned_like(self, view: torch.Tensor) -> torch.Tensor:
        return cast(
            "torch.Tensor", self._torch.empty(view.shape, dtype=view.dtype, pin_memory=True)
        )

    def _convert(self, path: Path, value: Any) -> Any:
        if isinstance(value, dict):
            return {k: self._convert((*path, str(k)), v) for k, v in value.items()}
        if isinstance(value, tuple):
            return tuple(self._convert((*path, str(i)), v) for i, v in enumerate(value))
        return self._tensor(path, value)

    def _results(self, convert: Callable[[], Any]) -> Any:
        # Pinned buffers feed non_blocking transfers: before rewriting them, wait until the
        # previous transfer out of them completed.
        if self._event is not None:
            self._event.synchronize()
        out = convert()
        if self.pin_memory and self._to_device and self.device.type == "cuda":
            if self._event is None:
                self._event = self._torch.cuda.Event()
            self._event.record()
        return out

    def _numpy_actions(self, actions: Any) -> Any:
        """Actions as numpy: tensors are detached and moved to the CPU (zero-copy there)."""
        if isinstance(actions, self._torch.Tensor):
            return actions.detach().cpu().numpy()
        if isinstance(actions, dict):
            return {k: self._numpy_actions(v) for k, v in actions.items()}
        if isinstance(actions, tuple):
            return tuple(self._numpy_actions(v) for v in actions)
        return actions

    # -- the vector env API --------------------------------------------------------------------

    def reset(
        self, *, seed: Any = None, options: dict[str, Any] | None = None
    ) -> tuple[Any, dict[str, Any]]:
        """Reset as the wrapped env does; returns (observations as tensors, numpy infos)."""
        obs, info = self.env.reset(seed=seed, options=options)
        return self._results(lambda: self._convert(("observation",), obs)), info

    def step(self, actions: Any) -> tuple[Any, Any, Any, Any, dict[str, Any]]:
        """Step with ``actions`` (tensors on any device, numpy arrays, or dict/tuple of them).

        Returns:
            (observations, ``reward: torch.float64[num_envs]``, ``terminated:
            torch.bool[num_envs]``, ``truncated: torch.bool[num_envs]``, numpy infos), on
            :attr:`device`.

        Raises:
            Whatever the wrapped env's ``step`` raises (for envfleet: ``InvalidActionError``,
            ``EnvError``, ``EnvCrashedError``, ``StepTimeoutError``, ...).
        """
        return self._step_result(self.env.step(self._numpy_actions(actions)))

    def _step_result(self, result: Any) -> tuple[Any, Any, Any, Any, dict[str, Any]]:
        obs, reward, terminated, truncated, info = result

        def convert() -> tuple[Any, Any, Any, Any]:
            return (
                self._convert(("observation",), obs),
                self._tensor(("reward",), reward),
                self._tensor(("terminated",), terminated),
                self._tensor(("truncated",), truncated),
            )

        tensors = self._results(convert)
        return (*tensors, info)

    def step_async(self, actions: Any) -> None:
        """Start a step (the wrapped env's ``step_async``); collect it with :meth:`step_wait`."""
        cast(Any, self.env).step_async(self._numpy_actions(actions))

    def step_wait(self, timeout: float | None = None) -> tuple[Any, Any, Any, Any, dict[str, Any]]:
        """Wait for :meth:`step_async`; results as :meth:`step` returns them."""
        return self._step_result(cast(Any, self.env).step_wait(timeout=timeout))

    def call(self, name: str, *args: Any, **kwargs: Any) -> tuple[Any, ...]:
        """The wrapped env's ``call`` (results unchanged)."""
        return cast("tuple[Any, ...]", cast(Any, self.env).call(name, *args, **kwargs))

    def get_attr(self, name: str) -> tuple[Any, ...]:
        """The wrapped env's ``get_attr``."""
        return cast("tuple[Any, ...]", cast(Any, self.env).get_attr(name))

    def set_attr(self, name: str, values: Any) -> None:
        """The wrapped env's ``set_attr``."""
        cast(Any, self.env).set_attr(name, values)

    # -- TensorDict ----------------------------------------------------------------------------

    def reset_tensordict(
        self, *, seed: Any = None, options: dict[str, Any] | None = None
    ) -> TensorDict:
        """Reset and return a ``TensorDict`` (batch_size ``[num_envs]``, on :attr:`device`).

        Keys, named as TorchRL's envs name them: ``"observation"`` (a nested TensorDict for
        Dict/Tuple spaces, tuple entries keyed ``"0"``, ``"1"``, ...), and ``"terminated"``,
        ``"truncated"``, ``"done"`` (``torch.bool[num_envs, 1]``, all False), as TorchRL's
        ``reset`` returns them. Infos are left out (use :meth:`reset`). Over a
        :class:`envfleet.MultiAgentVectorEnv` (``A`` agents) the flags are
        ``torch.bool[num_envs, A, 1]`` and ``"agent_mask"`` (``torch.bool[num_envs, A]``) is
        added.

        Raises:
            ConfigError: tensordict is not installed. Else as :meth:`reset`.
        """
        tensordict = _import_tensordict()
        obs, info = self.reset(seed=seed, options=options)
        shape: tuple[int, ...] = (self.num_envs, 1)
        if self._num_agents is not None:
            shape = (self.num_envs, self._num_agents, 1)
        zeros = self._torch.zeros(shape, dtype=self._torch.bool, device=self.device)
        source = {"observation": obs, "terminated": zeros, "truncated": zeros.clone()}
        source["done"] = zeros.clone()
        return self._tensordict(tensordict, source, info)

    def step_tensordict(self, actions: Any) -> TensorDict:
        """Step and return a ``TensorDict`` (batch_size ``[num_envs]``, on :attr:`device`).

        Keys, named as TorchRL's envs name them (its ``"next"`` entries, flattened):
        ``"observation"`` (nested for Dict/Tuple spaces), ``"reward": torch.float64[num_envs,
        1]``, ``"terminated"``, ``"truncated"`` and ``"done"`` (``terminated | truncated``),
        ``torch.bool[num_envs, 1]``. The trailing dimension of 1 is TorchRL's convention for
        rewards and done flags; reward and flags are views of the tensors :meth:`step`
        returns, so they share their lifetime (with ``copy=False`` on the CPU: envfleet's
        shared memory, valid until the next call). Infos are left out (use :meth:`step`).
        Over a :class:`envfleet.MultiAgentVectorEnv` (``A`` agents) rewards and flags are per
        agent, ``[num_envs, A, 1]`` (TorchRL's ``PettingZooWrapper`` keeps them per agent
        too), and ``"agent_mask"`` (``torch.bool[num_envs, A]``) is added.

        Raises:
            ConfigError: tensordict is not installed. Else as :meth:`step`.
        """
        tensordict = _import_tensordict()
        obs, reward, terminated, truncated, info = self.step(actions)
        torch = self._torch
        if self.copy or self._to_device:
            done = torch.logical_or(terminated, truncated)
        else:
            if self._done is None or self._done.shape != terminated.shape:
                self._done = torch.empty_like(terminated)
            done = torch.logical_or(terminated, truncated, out=self._done)
        source = {
            "observation": obs,
            "reward": reward.unsqueeze(-1),
            "terminated": terminated.unsqueeze(-1),
            "truncated": truncated.unsqueeze(-1),
            "done": done.unsqueeze(-1),
        }
        return self._tensordict(tensordict, source, info)

    def _tensordict(
        self, tensordict: Any, source: dict[str, Any], info: dict[str, Any]
    ) -> TensorDict:
        source["observation"] = _nest(source["observation"])
        if self._num_agents is not None:
            source["agent_mask"] = self._tensor(("agent_mask",), info["agent_mask"])
        return cast(
            "TensorDict",
            tensordict.TensorDict(source, batch_size=[self.num_envs], device=self.device),
        )


def _nest(value: Any) -> Any:
    """Observation tree -> nested dicts with string keys (what a TensorDict holds)."""
    if isinstance(value, dict):
        return {str(k): _nest(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return {str(i): _nest(v) for i, v in enumerate(value)}
    return value
