"""The README's and the supervision page's promises about crashes, tried as a new user would:
a fresh interpreter, ``envfleet.make()`` with no option set, real CartPole envs, and one of
them segfaulting for real (``ctypes.string_at(0)``).

A segfault in the first, a middle or the last env, with the envs given as a list
(``make([f0, ..., f3])``) or as one factory (``make(fn, N)``), gives an
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

import pytest

REPO = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent(
    """
    import ctypes, json, sys
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


    def crash(form, n, bad_index):
        if form == "list":
            envs = envfleet.make([bad if i == bad_index else good for i in range(n)])
        else:
            envs = envfleet.make(OneBad(bad_index), n)
        out = {"bad": bad_index, "workers": envs.num_workers}
        envs.reset(seed=0)
        actions = np.zeros(n, dtype=np.int64)
        try:
            for _ in range(2 * CRASH_AT):
                envs.step(actions)
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
        form, n = sys.argv[1], int(sys.argv[2])
        for bad_index in (0, n // 2, n - 1):
            print(json.dumps(crash(form, n, bad_index)), flush=True)
        with envfleet.make("CartPole-v1", n) as envs:  # the learner goes on
            envs.reset(seed=0)
            obs, *_ = envs.step(np.zeros(n, dtype=np.int64))
        print(json.dumps({"alive": obs.shape[0] == n}), flush=True)
    """
)


@pytest.mark.parametrize(("form", "num_envs"), [("list", 4), ("factory", 8), ("factory", 16)])
def test_a_segfault_under_defaults_is_a_typed_error_and_the_learner_goes_on(
    tmp_path: Path, form: str, num_envs: int
) -> None:
    script = tmp_path / "one_bad_env.py"
    script.write_text(SCRIPT)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), *filter(None, [env.get("PYTHONPATH")])])
    out = subprocess.run(
        [sys.executable, str(script), form, str(num_envs)],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=tmp_path,
        env=env,
    )
    assert out.returncode == 0, f"the learner died ({out.returncode}): {out.stderr[-3000:]}"
    lines = [json.loads(line) for line in out.stdout.splitlines()]
    *crashes, last = lines
    assert last == {"alive": True}
    assert [c["bad"] for c in crashes] == [0, num_envs // 2, num_envs - 1]
    for c in crashes:
        assert c["error"] is not None, f"env {c['bad']}'s segfault raised nothing"
        assert "SIGSEGV" in c["error"], c["error"]
        assert c["bad"] in c["env_indices"], c
        assert "string_at" in c["stacks"] or "in step" in c["stacks"], c["stacks"]
        assert c["replay"], f"no replay of env {c['bad']}"
        assert c["closed"]
