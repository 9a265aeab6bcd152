"""``posttrain demo``: the whole offline pipeline on a laptop CPU in about a minute, nothing downloaded.

1. build a tiny Llama and a character tokenizer from a seed;
2. SFT it on two-digit sums ("12+34=" -> "46") and measure greedy exact-match accuracy on held-out sums;
3. train a reward model from 4-way rankings and report its held-out pairwise accuracy;
4. DPO the SFT model on (correct sum, wrong sum) pairs and measure the held-out accuracy again.

Every number printed is measured in the run; the run directories hold metrics.jsonl, TensorBoard
events, the resolved configs and Hugging Face checkpoints of every model.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

from posttrain.data.synthetic import arithmetic_sft, vowel_rankings
from posttrain.models import ModelConfig, load_causal_lm, load_tokenizer
from posttrain.models.tiny import build_tiny
from posttrain.rollout import HFEngine, SamplingParams
from posttrain.trainers.config import load_config


def _write(path: Path, rows: list[dict]) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def exact_match(model_dir: str, rows: list[dict]) -> float:
    """Share of ``rows`` whose greedy completion is exactly the answer."""
    tokenizer = load_tokenizer(model_dir)
    engine = HFEngine(load_causal_lm(ModelConfig(path=model_dir, device="cpu")), tokenizer)
    prompts = [tokenizer(r["prompt"]).input_ids for r in rows]
    rollout = engine.generate(prompts, SamplingParams(max_new_tokens=4, temperature=0.0))
    return sum(r == row["answer"] for r, row in zip(rollout.responses, rows, strict=True)) / len(rows)


def _wrong_pairs(rows: list[dict], seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [
        {"prompt": r["prompt"], "chosen": r["answer"], "rejected": str(int(r["answer"]) + rng.choice([-10, -1, 1, 10]))}
        for r in rows
    ]


def run_demo(out: str = "runs/demo", seed: int = 0, quick: bool = False) -> dict:
    from posttrain.trainers import dpo, rm, sft

    out_path = Path(out)
    start = time.perf_counter()
    scale = 0.2 if quick else 1.0
    steps = {k: max(2, int(v * scale)) for k, v in {"sft": 1200, "rm": 60, "dpo": 100}.items()}
    common = ["run.progress=false", "data.chat_template=never", f"run.seed={seed}"]

    print("1. building a tiny Llama and a character tokenizer (offline, seed 0)")
    policy_dir = str(build_tiny(out_path / "tiny" / "policy", seed=seed))
    held_out = arithmetic_sft(200, seed=seed + 1000)
    results: dict = {"held_out_prompts": len(held_out)}
    results["accuracy_before_sft"] = exact_match(policy_dir, held_out)

    print(f"2. SFT on two-digit sums ({steps['sft']} steps)")
    sft_data = _write(out_path / "data" / "sft.jsonl", arithmetic_sft(3000, seed=seed))
    sft_config = load_config(
        sft.SFTConfig,
        None,
        common
        + [
            f"model.path={policy_dir}",
            f"data.path={sft_data}",
            f"run.output_dir={out_path / 'sft'}",
            f"run.max_steps={steps['sft']}",
            "run.batch_size=32",
            "optim.lr=3e-3",
            "optim.warmup_steps=10",
            "optim.scheduler=cosine",
            "data.max_length=32",
        ],
    )
    sft_result = sft.train(sft_config)
    sft_dir = str(out_path / "sft" / "final" / "policy")
    results["sft_final_loss"] = sft_result["final_metrics"]["loss"]
    results["accuracy_after_sft"] = exact_match(sft_dir, held_out)

    print(f"3. reward model from 4-way rankings ({steps['rm']} steps)")
    rm_data = _write(out_path / "data" / "rankings.jsonl", vowel_rankings(800, k=4, seed=seed))
    rm_config = load_config(
        rm.RMConfig,
        None,
        common
        + [
            f"model.path={policy_dir}",
            f"data.path={rm_data}",
            f"run.output_dir={out_path / 'rm'}",
            f"run.max_steps={steps['rm']}",
            "run.batch_size=16",
            "optim.lr=1e-3",
            "data.eval_fraction=0.1",
            "data_format=rankings",
        ],
    )
    rm_result = rm.train(rm_config)
    results["rm_eval_pairwise_accuracy"] = rm_result["eval_metrics"]["eval/accuracy"]

    print(f"4. DPO from the SFT model on (right sum, wrong sum) pairs ({steps['dpo']} steps)")
    dpo_data = _write(out_path / "data" / "pairs.jsonl", _wrong_pairs(arithmetic_sft(1000, seed=seed + 2), seed))
    dpo_config = load_config(
        dpo.DPOConfig,
        None,
        common
        + [
            f"model.path={sft_dir}",
            f"data.path={dpo_data}",
            f"run.output_dir={out_path / 'dpo'}",
            f"run.max_steps={steps['dpo']}",
            "run.batch_size=16",
            "optim.lr=5e-4",
            "beta=0.1",
            "reference=precompute",
            "data.eval_fraction=0.1",
        ],
    )
    dpo_result = dpo.train(dpo_config)
    results["dpo_eval_reward_accuracy"] = dpo_result["eval_metrics"]["eval/rewards/accuracy"]
    results["dpo_eval_margin"] = dpo_result["eval_metrics"]["eval/rewards/margin"]
    results["accuracy_after_dpo"] = exact_match(str(out_path / "dpo" / "final" / "policy"), held_out)
    results["seconds"] = round(time.perf_counter() - start, 1)
    (out_path / "summary.json").write_text(json.dumps(results, indent=2))
    _print_summary(results, out_path)
    return results


def _print_summary(results: dict, out_path: Path) -> None:
    n = results["held_out_prompts"]
    rows = [
        ("exact-match accuracy on held-out sums, before SFT", f"{results['accuracy_before_sft']:.1%} of {n}"),
        ("... after SFT", f"{results['accuracy_after_sft']:.1%}"),
        ("... after DPO on right/wrong pairs", f"{results['accuracy_after_dpo']:.1%}"),
        ("SFT final training loss (nats/token)", f"{results['sft_final_loss']:.3f}"),
        ("reward model: held-out pairwise accuracy", f"{results['rm_eval_pairwise_accuracy']:.1%}"),
        ("DPO: held-out implicit-reward accuracy", f"{results['dpo_eval_reward_accuracy']:.1%}"),
        ("DPO: held-out reward margin", f"{results['dpo_eval_margin']:.3f}"),
        ("wall time (s)", f"{results['seconds']}"),
    ]
    width = max(len(k) for k, _ in rows)
    print("\nposttrain demo: results")
    for key, value in rows:
        print(f"  {key.ljust(width)}  {value}")
    print(f"\nruns, metrics and checkpoints: {out_path}/  (summary.json, */metrics.jsonl, */final/)")


if __name__ == "__main__":
    run_demo()
