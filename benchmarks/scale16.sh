#!/usr/bin/env bash
# Issue 42's prepared run for a lent 16-core GPU machine: one script, under 8 minutes, whose
# tables land in benchmarks/results/scale16-* with the machine and the commit (each script
# writes them into its own header and JSON). Run from the repository root:
#
#     bash benchmarks/scale16.sh [RESULTS_DIR]
#
# RESULTS_DIR (default benchmarks/results) lets a device run write under $OUT. Each step has
# its own time limit, so one that hangs or fails leaves the others' tables; a step whose peer
# is missing (EnvPool, CUDA) is skipped with a note. One repetition each: read the ratios.
#
#   item 2  raw stepping against the limit (16 plain env loops side by side)
#   item 3  backend="envpool" against EnvPool itself, sync and pool
#   item 4  the first-ready pool against the synchronous loop, make() defaults
#   item 5  the learner's loop with the policy on CUDA (CartPole x64 MLP, Atari as trained x32
#           CNN: policy_loop.py's cartpole64 and atari32, beside EnvPool's own storing loop)
#   item 6  PPO end to end on CUDA (examples/ppo_atari.py, Pong x32, 4 updates): gymnasium's
#           AsyncVectorEnv, EnvPool, the Sampler without and with prefetch
#   item 7  the 2-core proxy: the driver's CPU and system calls per round against W (no-op)
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-benchmarks/results}"
mkdir -p "$out"
py="${PYTHON:-python}"
step() {  # step SECONDS NAME COMMAND...: run COMMAND within SECONDS, log its output
    local limit="$1" name="$2"
    shift 2
    echo "== $name (at most ${limit} s): $*"
    local start=$SECONDS
    timeout "$limit" "$@" >"$out/scale16-$name.log" 2>&1
    echo "   rc=$? in $((SECONDS - start)) s; log: $out/scale16-$name.log"
    tail -n 12 "$out/scale16-$name.log"
}
git rev-parse --short HEAD >"$out/scale16-commit.txt" 2>/dev/null || true
"$py" -c "import dataclasses, json; from envfleet.bench import describe_machine; \
print(json.dumps(dataclasses.asdict(describe_machine()), indent=1))" >"$out/scale16-machine.json"

step 80 proxy "$py" benchmarks/scale.py --env noop --num-envs 64 --workers 1,2,4,8,16 \
    --seconds 1 --json "$out/scale16-proxy-noop.json"
step 110 raw "$py" benchmarks/scaling.py --envs CartPole-v1:64,256 ALE/Pong-v5:64 \
    --systems envfleet-processes --seconds 2 --repeats 1 --max-foreign inf \
    --out "$out/scale16-raw"
if "$py" -c "import envpool" 2>/dev/null; then
    step 75 envpool "$py" benchmarks/envpool_overhead.py --repeats 1 --seconds 1.5 \
        --cases CartPole-v1:64 Pong-v5:64:repeat_action_probability=0.25 \
        --out "$out/scale16-envpool"
else
    echo "== envpool: skipped (envpool is not installed here)"
fi
step 60 pool "$py" benchmarks/pool_vs_sync.py --repeats 1 --seconds 2 \
    --cases CartPole-v1:64 ALE/Pong-v5:64 --out "$out/scale16-pool"
if "$py" -c "import torch, sys; sys.exit(not torch.cuda.is_available())" 2>/dev/null; then
    step 65 policy "$py" benchmarks/policy_loop.py --device cuda --repeats 1 --seconds 2 \
        --workloads cartpole64,atari32 --systems envpool-store,envfleet-store,sampler,sampler-driver \
        --json "$out/scale16-policy-cuda.json"
else
    echo "== policy: skipped (no CUDA device)"
fi
if "$py" -c "import torch, sys; sys.exit(not torch.cuda.is_available())" 2>/dev/null; then
    step 20 ppo-gym-async "$py" examples/ppo_atari.py --vector gym-async --num-envs 32 \
        --device cuda --threads 1 --total-steps 16384 --seed 1 --log-every 0
    step 20 ppo-envpool "$py" examples/ppo_atari.py --vector envpool --num-envs 32 \
        --device cuda --threads 1 --total-steps 16384 --seed 1 --log-every 0
    step 20 ppo-sampler "$py" examples/ppo_atari.py --vector envfleet --num-envs 32 \
        --device cuda --threads 1 --total-steps 16384 --seed 1 --log-every 0
    step 20 ppo-prefetch "$py" examples/ppo_atari.py --vector envfleet --prefetch \
        --num-envs 32 --device cuda --threads 1 --total-steps 16384 --seed 1 --log-every 0
else
    echo "== ppo: skipped (no CUDA device)"
fi
echo "== done in $SECONDS s"
