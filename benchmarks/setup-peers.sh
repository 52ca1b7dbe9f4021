#!/usr/bin/env bash
# Create the benchmark venv with envfleet and its peers (see benchmarks/README.md).
#
#   bash benchmarks/setup-peers.sh            # creates <repo>/.venv-bench
#   VENV=/some/where bash benchmarks/setup-peers.sh
#
# Order matters: torch first (stable-baselines3 needs it; the version below resolves to a CPU
# wheel here), then envfleet with the atari extra, then the peers, with torch pinned by a
# constraint so that no later install can swap in PyTorch's CUDA build.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/.." && pwd)"
venv="${VENV:-$repo/.venv-bench}"
python="${PYTHON:-python3}"

"$python" -m venv "$venv"
pip="$venv/bin/pip"
py="$venv/bin/python"

"$pip" install torch==2.13.0
constraints="$(mktemp)"
trap 'rm -f "$constraints"' EXIT
"$py" -c 'import importlib.metadata as m; print("torch==" + m.version("torch"))' >"$constraints"
echo "setup-peers: pinned $(cat "$constraints")"

"$pip" install -c "$constraints" -e "$repo[atari]"
"$pip" install -c "$constraints" stable-baselines3 matplotlib

# envpool: a normal install first; if its requirements conflict with ours, install it without
# dependencies and add only what its gymnasium API needs at import time.
if ! "$pip" install -c "$constraints" envpool; then
    echo "setup-peers: envpool did not install with its dependencies; trying --no-deps" >&2
    "$pip" install -c "$constraints" --no-deps envpool || true
    "$pip" install -c "$constraints" dm-env optree types-protobuf packaging typing-extensions || true
fi

# Checks: no CUDA torch, and envpool works (scaling.py skips it when it does not).
if "$pip" list 2>/dev/null | grep -i -E '^nvidia-|^triton ' ; then
    echo "setup-peers: CUDA packages were installed; this venv is not what was intended" >&2
    exit 1
fi
"$py" -c 'import torch; assert not torch.version.cuda, torch.version.cuda; print("torch", torch.__version__, "(CPU)")'
"$py" -c 'import stable_baselines3; print("stable-baselines3", stable_baselines3.__version__)'
if "$py" -c '
import envpool, numpy as np
e = envpool.make("CartPole-v1", env_type="gymnasium", num_envs=4)
e.reset()
e.step(np.zeros(4, dtype=np.int32))
e.close()
print("envpool", envpool.__version__, "works")
'; then :; else
    echo "setup-peers: envpool does not work here; scaling.py will skip it" >&2
fi
echo "setup-peers: done: $venv"
