"""Build what the example configs read: tiny models and data files under runs/ (run from the repo root).

    .venv/bin/python examples/prepare_data.py

writes runs/tiny/{policy,reward} (offline, from seed 0) and runs/tiny/teacher (wider, deeper, seed 1);
synthetic data under runs/data/ (sums for SFT and RL, a noisy-demonstrator variant, all 100 single-digit
sums, right / wrong single-digit sums as pairs and as KTO's unpaired rows, vowel pairs and rankings,
calculator episodes and prompts, letter strings and prompts for the human-feedback loop);
runs/data/hh_rlhf.jsonl (the HH-RLHF harmless-base pairs shipped in posttrain/data/samples, split into
prompt / chosen / rejected) and the GSM8K prompts (the shipped 300-row samples of each split).
"""

import json
import sys
from pathlib import Path

from posttrain.data import load_gsm8k, load_hh_rlhf
from posttrain.data.synthetic import (
    a_strings,
    arithmetic_pairs,
    arithmetic_sft,
    calculator_products,
    stepwise_as_sft,
    stepwise_sums,
    unpaired,
    vowel_counts,
    vowel_pairs,
    vowel_rankings,
)
from posttrain.models.tiny import build_tiny


def write(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"wrote {path} ({len(rows)} rows)")


def main(root: str = "runs") -> None:
    root = Path(root)
    for kind, name in (("causal", "policy"), ("reward", "reward")):
        print(f"wrote {build_tiny(root / 'tiny' / name, kind=kind, seed=0)}")
    # a wider and deeper tiny Llama (same tokenizer): the teacher of distill_digits.yaml
    teacher = build_tiny(root / "tiny" / "teacher", hidden_size=256, intermediate_size=512, num_hidden_layers=4, seed=1)
    print(f"wrote {teacher}")
    write(root / "data" / "arith_sft.jsonl", arithmetic_sft(2000, seed=0))
    write(
        root / "data" / "arith_prompts.jsonl",
        [{"prompt": r["prompt"], "answer": r["answer"]} for r in arithmetic_sft(500, seed=1)],
    )
    write(root / "data" / "digit_sft_noisy.jsonl", arithmetic_sft(2000, seed=0, low=0, high=9, noise=0.5))
    write(root / "data" / "digit_sft.jsonl", arithmetic_sft(2000, seed=0, low=0, high=9))
    write(
        root / "data" / "digit_all_sums.jsonl",
        [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(10) for b in range(10)],
    )
    write(
        root / "data" / "digit_prompts.jsonl",
        [{"prompt": r["prompt"], "answer": r["answer"]} for r in arithmetic_sft(300, seed=1, low=0, high=9)],
    )
    # a second task for distillation from several teachers (distill_teachers.yaml): vowel counts, and the
    # prompts of both tasks, each row naming its teacher
    write(root / "data" / "vowel_sft.jsonl", vowel_counts(2000, seed=0))
    write(
        root / "data" / "vowel_heldout.jsonl",
        [{"prompt": r["prompt"], "answer": r["answer"]} for r in vowel_counts(200, seed=3)],
    )
    noisy = arithmetic_sft(2000, seed=0, low=0, high=9, noise=0.5) + vowel_counts(2000, seed=0, noise=0.5)
    write(root / "data" / "mixed_sft_noisy.jsonl", [noisy[i // 2 + (i % 2) * 2000] for i in range(4000)])
    sums = arithmetic_sft(300, seed=1, low=0, high=9)
    vowels = vowel_counts(300, seed=1)
    write(
        root / "data" / "mixed_prompts.jsonl",
        [
            {"prompt": r["prompt"], "answer": r["answer"], "teacher": name}
            for pair in zip(sums, vowels, strict=True)
            for name, r in zip(("sums", "vowels"), pair, strict=True)
        ],
    )
    digit_pairs = arithmetic_pairs(1000, seed=2, low=0, high=9)  # the right sum chosen, one off by one rejected
    write(root / "data" / "digit_pairs.jsonl", digit_pairs)
    write(root / "data" / "digit_unpaired.jsonl", unpaired(digit_pairs))  # the same, as KTO's labelled rows
    write(root / "data" / "rank_prompts.jsonl", [{"prompt": "rank:"}] * 64)
    write(root / "data" / "vowel_pairs.jsonl", vowel_pairs(2000, seed=0))
    write(root / "data" / "vowel_rankings.jsonl", vowel_rankings(1000, k=4, seed=0))
    # products only the calculator gives: demonstrated episodes (half answer with a guess), prompts, held-out
    write(root / "data" / "calc_sft.jsonl", [{"messages": r["messages"]} for r in calculator_products(400, 0, 0.5)])
    write(
        root / "data" / "calc_prompts.jsonl",
        [{"prompt": r["prompt"], "answer": r["answer"]} for r in calculator_products(400, 1)],
    )
    write(
        root / "data" / "calc_heldout.jsonl",
        [{"prompt": r["prompt"], "answer": r["answer"]} for r in calculator_products(200, 2)],
    )
    # sums of three digits 0-3 solved step by step, half the solutions with one step off by 10: a process reward
    # model's step-labelled rows, the noisy demonstrations SFT copies, GRPO's prompts and held-out prompts
    steps = {"terms": 3, "low": 0, "high": 3, "error_size": 10}
    write(root / "data" / "step_labels.jsonl", stepwise_sums(3000, seed=0, **steps))
    write(root / "data" / "step_sft_noisy.jsonl", stepwise_as_sft(stepwise_sums(2000, seed=1, **steps)))
    for name, seed in (("step_prompts", 2), ("step_heldout", 3)):
        rows = stepwise_sums(300, seed=seed, **steps)
        write(root / "data" / f"{name}.jsonl", [{"prompt": r["prompt"], "answer": r["answer"]} for r in rows])
    # the human-feedback loop on the tiny model (examples/human_feedback.sh): letter strings whose count of a's
    # varies, prompts to sample and rank, other prompts for the blind A/B
    write(root / "data" / "a_strings_sft.jsonl", a_strings(2000, seed=0))
    write(root / "data" / "a_strings_prompts.jsonl", [{"prompt": f"{1000 + i}:"} for i in range(80)])
    write(root / "data" / "a_strings_ab_prompts.jsonl", [{"prompt": f"{2000 + i}:"} for i in range(40)])
    write(root / "data" / "hh_rlhf.jsonl", load_hh_rlhf())
    write(root / "data" / "gsm8k_test_prompts.jsonl", load_gsm8k("test"))
    write(root / "data" / "gsm8k_train_prompts.jsonl", load_gsm8k("train"))


if __name__ == "__main__":
    main(*sys.argv[1:])
