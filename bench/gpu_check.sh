#!/usr/bin/env bash
# One short run per (trainer, engine) on the GPUs of this machine: bf16 GRPO and PPO steps under
# accelerate's DeepSpeed ZeRO-2, ZeRO-3 and FSDP2 configs (examples/accelerate/), plus GRPO with a colocated
# vLLM when vLLM is installed; GRPO and PPO with asynchronous rollouts (a producer per process, and with two
# GPUs or more a vLLM server on the last one). On GPUs FSDP2 takes accelerate's own path (on CPU, tests/test_fsdp.py runs
# it); PPO's default critic=reward is a second FSDP2/DeepSpeed model; on GPUs also
# bench/read_positions_memory.py (peak memory of a long bf16 log-prob pass, last layer read or full). Writes
# bench/results/gpu_check-<UTC date>.jsonl: one line per case with its exit status, wall time and last
# metrics line. Record the outcome with the date in bench/README.md.
#
#   bash bench/gpu_check.sh            # every visible GPU
#   NPROC=2 bash bench/gpu_check.sh    # two of them
#   PY=.venv-ds/bin/python bash bench/gpu_check.sh   # without a GPU: the same cases on 2 CPU processes
#                                                    # (a dry run of this script; bf16 on CPU, gloo)
set -u
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
GPUS=$($PY -c "import torch; print(torch.cuda.device_count())")
NPROC=${NPROC:-$((GPUS > 0 ? GPUS : 2))}
SLEEP=$([ "$GPUS" -gt 0 ] && echo true || echo false)  # vLLM's CPU backend has no sleep mode
STAMP=$(date -u +%Y-%m-%dT%H%M%SZ)
WORK=$(mktemp -d)
OUT=bench/results/gpu_check-$STAMP.jsonl
mkdir -p bench/results
export HF_HUB_OFFLINE=1

$PY -m posttrain.cli tiny --out "$WORK/tiny" >/dev/null
$PY - "$WORK" <<'EOF'
import json, sys
from posttrain.data.synthetic import arithmetic_sft
rows = [{"prompt": r["prompt"], "answer": r["answer"]} for r in arithmetic_sft(256, seed=0, low=0, high=9)]
open(f"{sys.argv[1]}/prompts.jsonl", "w").write("".join(json.dumps(r) + "\n" for r in rows))
EOF

COMMON=(
  "model.path=$WORK/tiny/policy" "data.path=$WORK/prompts.jsonl" data.chat_template=never
  run.mixed_precision=bf16 run.max_steps=2 "run.batch_size=$((8 * NPROC))" run.micro_batch_size=4
  run.progress=false "run.report_to=[jsonl]" sampling.max_new_tokens=8
)
# a reward that differs within a group from the first step (a tiny random model never gets a sum right,
# and equal rewards give zero advantages: no gradient to check)
GRPO=(num_generations=4 "rewards=[{function: 'posttrain.rewards.length:per_token_length', kwargs: {per_token: 0.1}}]")
PPO=("reward_model.path=$WORK/tiny/reward" ppo_epochs=1)

run_case() {  # name, accelerate config (or "none"), trainer, extra args...
  local name=$1 config=$2 trainer=$3; shift 3
  local dir=$WORK/$name start=$SECONDS
  local launch=($PY -m accelerate.commands.launch --num_processes "$NPROC")
  [ "$config" != none ] && launch+=(--config_file "examples/accelerate/$config.yaml")
  # plain DDP: without --multi_gpu, accelerate on a machine without a GPU starts one process
  [ "$config" = none ] && [ "$NPROC" -gt 1 ] && launch+=(--multi_gpu)
  "${launch[@]}" -m posttrain.cli "$trainer" "${COMMON[@]}" "$@" "run.output_dir=$dir" >"$dir.log" 2>&1
  local rc=$?
  local last
  last=$(tail -n 1 "$dir/metrics.jsonl" 2>/dev/null || echo null)
  echo "{\"case\": \"$name\", \"gpus\": $GPUS, \"processes\": $NPROC, \"rc\": $rc, \"seconds\": $((SECONDS - start)), \"last\": $last}" >>"$OUT"
  echo "$name: rc=$rc ($((SECONDS - start)) s)  log: $dir.log"
}

run_case grpo-ddp none grpo "${GRPO[@]}"
run_case grpo-zero2 zero2 grpo "${GRPO[@]}"
run_case grpo-zero3 zero3 grpo "${GRPO[@]}"
run_case grpo-fsdp2 fsdp2 grpo "${GRPO[@]}"
run_case ppo-ddp none ppo "${PPO[@]}"
run_case ppo-zero2 zero2 ppo "${PPO[@]}"
run_case ppo-zero3 zero3 ppo "${PPO[@]}"
run_case ppo-fsdp2 fsdp2 ppo "${PPO[@]}"
if $PY -c "import vllm" 2>/dev/null; then
  run_case grpo-vllm-colocate none grpo "${GRPO[@]}" rollout.engine=vllm "rollout.sleep=$SLEEP"
  run_case grpo-vllm-zero3 zero3 grpo "${GRPO[@]}" rollout.engine=vllm "rollout.sleep=$SLEEP"
fi
# asynchronous rollouts (docs/algorithms/async.md): a producer process per training process, one step ahead
run_case grpo-async-ddp none grpo "${GRPO[@]}" rollout.async_steps=1 rollout.importance_sampling=token
run_case ppo-async-ddp none ppo "${PPO[@]}" rollout.async_steps=1 rollout.importance_sampling=token_mask
if $PY -c "import vllm" 2>/dev/null && [ "$GPUS" -gt 1 ]; then
  # a vLLM server on the last GPU, one training process on the first; the producer feeds the server
  CUDA_VISIBLE_DEVICES=$((GPUS - 1)) $PY -m posttrain.cli vllm-serve --model "$WORK/tiny/policy" --port 0 \
    >"$WORK/server.log" 2>&1 &
  SERVER=$!
  URL=""
  for _ in $(seq 600); do
    URL=$(grep -m1 '^posttrain vllm-serve:' "$WORK/server.log" 2>/dev/null | sed 's/.* on //')
    [ -n "$URL" ] && break
    sleep 1
  done
  SAVED_NPROC=$NPROC
  NPROC=1
  CUDA_VISIBLE_DEVICES=0 run_case grpo-async-vllm-server none grpo "${GRPO[@]}" rollout.engine=vllm \
    rollout.mode=server "rollout.server_url=$URL" rollout.async_steps=1 rollout.importance_sampling=token
  NPROC=$SAVED_NPROC
  kill "$SERVER"
fi
if [ "$GPUS" -gt 0 ]; then  # the last layer only where it is read, on long bf16 sequences: memory and time
  start=$SECONDS
  $PY bench/read_positions_memory.py >"$WORK/read_positions.out" 2>"$WORK/read_positions.log"
  rc=$?
  line=$(tail -n 1 "$WORK/read_positions.out")
  echo "{\"case\": \"read-positions-memory\", \"gpus\": $GPUS, \"rc\": $rc, \"seconds\": $((SECONDS - start)), \"last\": ${line:-null}}" >>"$OUT"
  echo "read-positions-memory: rc=$rc  $line"
fi
echo "results: $OUT"
