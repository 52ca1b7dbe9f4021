"""``envfleet.ProcessEnv``: one environment in its own process, as ALF's ProcessEnvironment.

It is a one-env ``backend="processes"`` vector env underneath (the same worker, shared-memory
buffers and doorbells, the same supervision), shown as a single ``gymnasium.Env``-like
object: unbatched observations and infos, no autoreset, and non-blocking calls that return
``concurrent.futures.Future`` objects.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
from collections.abc import Callable
from typing import Any

import gymnasium
import numpy as np
from gymnasium.vector import AutoresetMode

from envfleet._core.buffers import is_leaf
from envfleet._core.errors import (
    AlreadyPendingCallError,
    ClosedEnvironmentError,
    ConfigError,
    EnvError,
    EnvfleetError,
    ResetNeededError,
)
from envfleet._front.make import make
from envfleet._front.options import DEFAULT_SUPERVISION, Processes, Supervision
from envfleet._front.vector_env import FleetVectorEnv

__all__ = ["ProcessEnv"]

logger = logging.getLogger("envfleet")

EnvFactory = Callable[..., gymnasium.Env[Any, Any]]


class ProcessEnv:
    """One sub-environment in a worker process, used like the env itself (ALF's
    ``ProcessEnvironment``).

    It is not a ``gymnasium.Env``: it has the env's ``step``, ``reset``, spaces and attributes,
    but it does not subclass ``gymnasium.Env``, so gymnasium's wrappers refuse it
    (``gymnasium.wrappers.RecordEpisodeStatistics(penv)`` raises ``TypeError``). Wrap the env
    inside the factory instead, where the wrapper runs in the env's process and its infos come
    back with each step::

        def make_env():
            return gymnasium.wrappers.RecordEpisodeStatistics(gymnasium.make("CartPole-v1"))

        penv = envfleet.ProcessEnv(make_env)  # info["episode"] at the end of each episode

    ``penv.step(action)`` and ``penv.reset(seed=...)`` work as the env's own methods; with
    ``blocking=False`` they return a :class:`concurrent.futures.Future` at once and the env
    steps in its process while the caller goes on. Any other attribute is read from the
    remote env (``penv.some_attr``, through ``get_wrapper_attr``); ``penv.call("method", *a)``
    calls a method there. Spaces, ``metadata``, ``render_mode`` and ``spec`` are cached at
    start. An exception in the env is re-raised here as :class:`envfleet.EnvError` with the
    remote exception and its traceback chained as ``__cause__``; a crash of the process is
    :class:`envfleet.EnvCrashedError`. The worker ignores Ctrl-C (SIGINT), which is the
    calling process's to handle, and exits when the calling process dies.

    The env is not autoreset: after ``terminated`` or ``truncated``, call :meth:`reset`, as
    with a plain ``gymnasium.Env``. One call may be in flight at a time: wait for a future
    before the next call (another call raises gymnasium's ``AlreadyPendingCallError``).

    Args:
        env: a gymnasium id, or a zero-argument picklable factory returning a
            ``gymnasium.Env`` (cloudpickle: lambdas work).
        env_kwargs: keyword arguments for ``gymnasium.make``, with an id.
        supervision: an :class:`envfleet.Supervision`, as :func:`envfleet.make`'s (default
            ``Supervision()``): no step timeout, a :class:`envfleet.HangWarning` after 60 s
            (from the future's thread with ``blocking=False``), the env's process rebuilt after
            a crash or a lost connection (the step then returns ``truncated=True`` and
            ``info["env_restarted"]`` and warns :class:`envfleet.EnvRestartedWarning`).
        context: ``multiprocessing`` start method.
        start: start the process now (default); else call :meth:`start`.

    Raises:
        ConfigError: bad arguments (see :func:`envfleet.make`).
        EnvError: the factory raised while building the env.
    """

    def __init__(
        self,
        env: str | EnvFactory,
        *,
        env_kwargs: dict[str, Any] | None = None,
        supervision: Supervision = DEFAULT_SUPERVISION,
        context: str | None = None,
        start: bool = True,
    ):
        if not (isinstance(env, str) or callable(env)):
            raise ConfigError(f"ProcessEnv needs a gymnasium id or an env factory, got {env!r}")
        if not isinstance(supervision, Supervision):
            raise ConfigError(f"supervision must be an envfleet.Supervision, got {supervision!r}")
        self._make_args: dict[str, Any] = {
            "env_kwargs": env_kwargs,
            "supervision": supervision,
            "backend": Processes(context=context),
        }
        self._env = env
        self._venv: FleetVectorEnv | None = None
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._pending: concurrent.futures.Future[Any] | None = None
        self._closing = False
        if start:
            self.start()

    # -- life cycle ------------------------------------------------------------------------

    def start(self) -> None:
        """Start the worker process and build the env in it (once).

        Raises:
            EnvError: the factory raised. EnvCrashedError: the process died while starting
                (also because the main module starts processes when imported, under
                ``spawn``/``forkserver``: its message says so, as :func:`envfleet.make`'s).
        """
        if self._venv is not None:
            return
        venv = make(
            self._env,
            1,
            num_workers=1,
            autoreset_mode=AutoresetMode.DISABLED,
            **self._make_args,
        )
        venv.unbatched_infos = True
        self.observation_space: gymnasium.Space[Any] = venv.single_observation_space
        self.action_space: gymnasium.Space[Any] = venv.single_action_space
        self.metadata: dict[str, Any] = dict(venv.metadata)
        self.metadata.pop("autoreset_mode", None)
        self.render_mode: str | None = venv.render_mode
        self._venv = venv
        self.spec = self.call("spec")
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="envfleet-process-env"
        )

    def close(self, timeout: float | None = None, terminate: bool = False) -> None:
        """Close the env and its process (bounded: see :meth:`envfleet.FleetVectorEnv.close`).

        A call still in flight is waited for (up to ``timeout``); its future then holds its
        result, or the error that closing caused.
        """
        venv, self._venv = self._venv, None
        if venv is None:
            return
        self._closing = True
        pending, self._pending = self._pending, None
        if pending is not None and not terminate:
            # Let the call in flight finish; past the timeout, killing the worker ends it
            # (its wait sees the process gone and the future gets the error).
            done, _ = concurrent.futures.wait(
                [pending], timeout=5.0 if timeout is None else timeout
            )
            terminate = not done
        venv.close(timeout=timeout, terminate=terminate)
        executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True)

    @property
    def closed(self) -> bool:
        """Whether the env is closed (by :meth:`close`, a crash or a timeout)."""
        return self._venv is None or self._venv.closed

    @property
    def stats(self) -> Any:
        """The worker's :class:`envfleet.FleetStats` (step times, restarts, crashes)."""
        venv = self._venv
        if venv is None:
            raise ClosedEnvironmentError("Trying to operate on a ProcessEnv after close().")
        return venv.stats

    def __enter__(self) -> ProcessEnv:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close(terminate=exc_info[0] is not None)

    def __del__(self) -> None:
        venv = self.__dict__.get("_venv")
        if venv is not None and not venv.closed:
            with contextlib.suppress(Exception):  # interpreter shutdown: nothing to report to
                self.close(terminate=True)

    def __repr__(self) -> str:
        state = "closed" if self.closed else "running"
        return f"ProcessEnv({self._env!r}, {state})"

    # -- the env's API ---------------------------------------------------------------------

    def reset(
        self,
        *,
        seed: int | None = None,
        options: dict[str, Any] | None = None,
        blocking: bool = True,
    ) -> Any:
        """``env.reset(seed=seed, options=options)`` in the worker.

        Returns:
            ``(observation, info)`` as the env returns them (observation: the caller's own,
            never rewritten by a later call, shaped as ``observation_space``); with
            ``blocking=False``, a ``Future`` of that.

        Raises:
            InvalidArgumentError: a bad seed (nothing is sent).
            EnvError, EnvCrashedError, StepTimeoutError: as :meth:`FleetVectorEnv.reset_wait`;
                with ``blocking=False`` the future raises them.
        """
        venv = self._vector()
        venv.reset_async(seed=None if seed is None else [seed], options=options)
        return self._finish(venv.reset_wait, self._one_reset, blocking)

    def step(self, action: Any, blocking: bool = True) -> Any:
        """``env.step(action)`` in the worker.

        Args:
            action: an element of ``action_space`` (checked before it is sent).

        Returns:
            ``(observation, reward: float, terminated: bool, truncated: bool, info)``; with
            ``blocking=False``, a ``Future`` of that.

        Raises:
            InvalidActionError: an action that does not fit ``action_space`` (nothing sent).
            ResetNeededError: the episode ended; call :meth:`reset` first.
            EnvError, EnvCrashedError, StepTimeoutError: as :meth:`FleetVectorEnv.step_wait`;
                with ``blocking=False`` the future raises them.
        """
        venv = self._vector()
        try:
            venv.step_async(_batch_of_one(self.action_space, action))
        except ResetNeededError as exc:
            raise ResetNeededError("the episode ended: call reset() first", [0]) from exc
        return self._finish(venv.step_wait, self._one_step, blocking)

    def call(self, name: str, *args: Any, blocking: bool = True, **kwargs: Any) -> Any:
        """Call method ``name`` of the remote env with the arguments (its value if not
        callable), as gymnasium's ``get_wrapper_attr``; with ``blocking=False``, a ``Future``.

        Raises:
            EnvError: the env raised (e.g. ``AttributeError``), traceback chained.
        """
        venv = self._vector()
        venv.call_async(name, *args, **kwargs)
        return self._finish(venv.call_wait, lambda values: values[0], blocking)

    def render(self) -> Any:
        """``env.render()`` in the worker (a frame for ``render_mode="rgb_array"``)."""
        return self._vector().render()[0]

    def get_attr(self, name: str) -> Any:
        """The remote env's attribute ``name`` (``get_wrapper_attr``)."""
        return self.call(name)

    def set_attr(self, name: str, value: Any) -> None:
        """Set attribute ``name`` of the remote env (``set_wrapper_attr``)."""
        self._vector().set_attr(name, [value])

    def __getattr__(self, name: str) -> Any:
        # Only reached for names this object does not have: forward them to the remote env.
        if name.startswith("__") or name in ("_venv", "_executor", "_env", "_make_args"):
            raise AttributeError(name)
        try:
            return self.call(name)
        except EnvError as exc:
            if isinstance(exc.__cause__, AttributeError):  # hasattr() and getattr(d) work
                raise AttributeError(f"the remote env has no attribute {name!r}") from exc
            raise

    # -- helpers ---------------------------------------------------------------------------

    def _vector(self) -> FleetVectorEnv:
        venv = self._venv
        if venv is None or venv.closed:
            raise ClosedEnvironmentError("Trying to operate on a ProcessEnv after close().")
        pending = self._pending
        if pending is not None and not pending.done():
            # The vector env may look idle already while the future's thread still copies the
            # result out of the shared buffer: the future decides.
            raise AlreadyPendingCallError(
                "Calling the ProcessEnv while a non-blocking call is pending: wait for its "
                "future first",
                "step",
            )
        return venv

    def _finish(
        self, wait: Callable[[], Any], convert: Callable[[Any], Any], blocking: bool
    ) -> Any:
        if blocking:
            return convert(wait())
        executor = self._executor
        assert executor is not None  # set by start() with the vector env

        def run() -> Any:
            try:
                return convert(wait())
            except EnvfleetError:
                raise
            except Exception as exc:
                if self._closing:  # close() ended the call under the waiting thread
                    raise ClosedEnvironmentError(
                        "the ProcessEnv was closed during the call"
                    ) from exc
                raise

        self._pending = executor.submit(run)
        return self._pending

    def _one_reset(self, result: tuple[Any, dict[str, Any]]) -> tuple[Any, dict[str, Any]]:
        obs, info = result
        return _first(self.observation_space, obs), info

    def _one_step(self, result: tuple[Any, ...]) -> tuple[Any, float, bool, bool, dict[str, Any]]:
        obs, rewards, terminations, truncations, info = result
        return (
            _first(self.observation_space, obs),
            float(rewards[0]),
            bool(terminations[0]),
            bool(truncations[0]),
            info,
        )


def _batch_of_one(space: gymnasium.Space[Any] | None, action: Any) -> Any:
    """The action as a batch of one, walked by ``space``: ``(action,)`` for a leaf without a
    fixed size (Text, Graph, ...: gymnasium batches those as tuples), ``[1, *shape]`` per
    other leaf of its dicts and tuples. Where the structure does not fit ``space`` it is kept
    (``space`` ``None`` below), for the vector env to refuse."""
    containers = (gymnasium.spaces.Dict, gymnasium.spaces.Tuple)
    if space is not None and not is_leaf(space) and not isinstance(space, containers):
        return (action,)
    if isinstance(action, dict):
        subs = space.spaces if isinstance(space, gymnasium.spaces.Dict) else {}
        return {key: _batch_of_one(subs.get(key), value) for key, value in action.items()}
    if isinstance(action, tuple):
        fits = isinstance(space, gymnasium.spaces.Tuple) and len(space.spaces) == len(action)
        subs_ = space.spaces if fits else (None,) * len(action)  # type: ignore[union-attr]
        return tuple(_batch_of_one(sub, value) for sub, value in zip(subs_, action, strict=True))
    return np.expand_dims(np.asarray(action), 0)


def _first(space: gymnasium.Space[Any], obs: Any) -> Any:
    """Row 0 of a batched observation, walked by ``space`` (leaf by leaf; a leaf without a
    fixed size is a tuple of per-env values); the vector env returned the caller's own
    (``copy=True``), so the row is too."""
    if isinstance(space, gymnasium.spaces.Dict):
        return {key: _first(space[key], value) for key, value in obs.items()}
    if isinstance(space, gymnasium.spaces.Tuple):
        return tuple(_first(sub, value) for sub, value in zip(space, obs, strict=True))
    return obs[0]
