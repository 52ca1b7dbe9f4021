"""The README's and the supervision page's promises about crashes, tried as a new user would:
a fresh interpreter, ``envfleet.make()`` with no option set, real CartPole envs, and one of
them segfaulting for real (``ctypes.string_at(0)``).

A segfault in the first, a middle or the last env, with the envs given as a list
(``make([f0, ..., f3])``) or as one factory (``make(fn, N)``), costs that env its episode and
nothing more: the run goes on, the env reads ``truncated`` with ``info["env_restarted"]``, one
:class:`envfleet.EnvRestartedWarning` names it, the cause, its frame and the replay file, and
the same vector env keeps stepping; with ``restart_policy=None`` the same segfault is an
:class:`envfleet.EnvCrashedError` naming that env, with the worker's stacks and a replay, and
the learner goes on (it makes and steps another vector env). Before the default kept every
env out of the learner's process, env 0's segfault killed the learner with exit 139 and
nothing printed. The hang and Ctrl-C promises are tried in ``test_hang_reports.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent(
    """
    import ctypes, json, sys, warnings
    import gymnasium as gym
    import numpy as np
    import envfleet

    CRASH_AT = 5  # the bad env segfaults in its 5th step


    class SegfaultAt(gym.Wrapper):
        def __init__(self, env):
            super().__init__(env)
            self.t = 0

        def step(self, action):
            self.t += 1
            if self.t == CRASH_AT:
                ctypes.string_at(0)  # a real SIGSEGV in native code
            return self.env.step(action)


    def good():
        return gym.make("CartPole-v1")


    def bad():
        return SegfaultAt(gym.make("CartPole-v1"))


    class OneBad:
        # make(fn, N): one factory, called with each env's index
        def __init__(self, bad_index):
            self.bad_index = bad_index

        def __call__(self, env_index):
            return bad() if env_index == self.bad_index else good()


    def crash(form, n, bad_index, **options):
        if form == "list":
            envs = envfleet.make([bad if i == bad_index else good for i in range(n)], **options)
        else:
            envs = envfleet.make(OneBad(bad_index), n, **options)
        out = {"bad": bad_index, "workers": envs.num_workers, "restarted": []}
        envs.reset(seed=0)
        actions = np.zeros(n, dtype=np.int64)
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always", envfleet.EnvRestartedWarning)
                for _ in range(2 * CRASH_AT):
                    *_, truncated, info = envs.step(actions)
                    if "env_restarted" in info:
                        out["restarted"].append(
                            [np.flatnonzero(info["_env_restarted"]).tolist(), truncated.tolist()]
                        )
            out["warnings"] = [str(w.message) for w in caught]
        except envfleet.EnvCrashedError as err:
            out.update(
                error=str(err),
                env_indices=list(err.env_indices),
                stacks=err.stacks,
                replay=err.replay is not None
                and err.replay.kind == "crash"
                and bad_index in [r.env_index for r in err.replay.envs],
                closed=envs.closed,
            )
        else:
            out["error"] = None
        envs.close()
        return out


    if __name__ == "__main__":
        form, n, options = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
        if options:  # the Supervision's fields
            options = {"supervision": envfleet.Supervision(**options)}
        for bad_index in (0, n // 2, n - 1):
            print(json.dumps(crash(form, n, bad_index, **options)), flush=True)
        with envfleet.make("CartPole-v1", n) as envs:  # the learner goes on
            envs.reset(seed=0)
            obs, *_ = envs.step(np.zeros(n, dtype=np.int64))
        print(json.dumps({"alive": obs.shape[0] == n}), flush=True)
    """
)


def _learner(tmp_path: Path, form: str, num_envs: int, options: str) -> list[dict[str, Any]]:
    """The script's lines: one per bad env, then whether the learner is alive."""
    script = tmp_path / "one_bad_env.py"
    script.write_text(SCRIPT)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), *filter(None, [env.get("PYTHONPATH")])])
    out = subprocess.run(
        [sys.executable, str(script), form, str(num_envs), options],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=tmp_path,
        env=env,
    )
    assert out.returncode == 0, f"the learner died ({out.returncode}): {out.stderr[-3000:]}"
    *crashes, last = [json.loads(line) for line in out.stdout.splitlines()]
    assert last == {"alive": True}
    assert [c["bad"] for c in crashes] == [0, num_envs // 2, num_envs - 1]
    return crashes


@pytest.mark.parametrize(("form", "num_envs"), [("list", 4), ("factory", 8), ("factory", 16)])
def test_a_segfault_under_defaults_costs_that_env_its_episode(
    tmp_path: Path, form: str, num_envs: int
) -> None:
    for c in _learner(tmp_path, form, num_envs, "{}"):
        bad = c["bad"]
        assert c["error"] is None, c["error"]
        truncated = [i == bad for i in range(num_envs)]
        assert c["restarted"] == [[[bad], truncated]], c
        [message] = c["warnings"]
        assert "SIGSEGV" in message and f"sub-environment {bad} starts a new episode" in message
        assert "string_at" in message or "in step" in message, message
        assert "its replay: " in message, message


@pytest.mark.parametrize(("form", "num_envs"), [("list", 4), ("factory", 8)])
def test_a_segfault_without_restarts_is_a_typed_error_and_the_learner_goes_on(
    tmp_path: Path, form: str, num_envs: int
) -> None:
    for c in _learner(tmp_path, form, num_envs, '{"restart_policy": null}'):
        assert c["error"] is not None, f"env {c['bad']}'s segfault raised nothing"
        assert "SIGSEGV" in c["error"], c["error"]
        assert c["bad"] in c["env_indices"], c
        assert "string_at" in c["stacks"] or "in step" in c["stacks"], c["stacks"]
        assert c["replay"], f"no replay of env {c['bad']}"
        assert c["closed"]
