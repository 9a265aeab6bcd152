"""``posttrain demo``: the whole post-training pipeline on a CPU, nothing downloaded (57-58 s on a 2-core AMD EPYC
at commit 8747f3a: docs/benchmarks.md#the-demo).

1. build a tiny Llama and a character tokenizer from a seed;
2. SFT it on single-digit sums shown by a noisy demonstrator (off by one half the time): the model
   copies the noise;
3. GRPO with a verifiable reward (the true sum) removes it;
4. DPO on (right sum, wrong sum) pairs from the same SFT model, for comparison;
5. train a reward model from 4-way rankings (more vowels is better) and report its held-out accuracy;
6. RLHF-PPO of the tiny model against that reward model: the score rises while the KL stays bounded.

Every number printed is measured in the run; the run directories hold metrics.jsonl, TensorBoard
events, the resolved configs and Hugging Face checkpoints of every model, and ``report.html`` plots
them all (``posttrain report``), with the health alerts the online runs raised. Each stage prints a
line every tenth of its steps with its live numbers, then its results; ``summary.json`` and
``report.html`` are rewritten as each stage finishes, so a demo stopped half-way leaves what it did.
"""

from __future__ import annotations

import json
import math
import os
import random
import time
from pathlib import Path

import torch

from posttrain.data.synthetic import arithmetic_sft, vowel_count, vowel_rankings
from posttrain.models import ModelConfig, load_causal_lm, load_tokenizer
from posttrain.models.tiny import build_tiny
from posttrain.monitor.alerts import read_alerts
from posttrain.monitor.report import write_report
from posttrain.rollout import RolloutConfig, SamplingParams, build_engine
from posttrain.runtime.config import load_config
from posttrain.runtime.metrics import read_metrics

GRPO_SETTINGS = [
    "run.batch_size=128",
    "run.micro_batch_size=64",
    "num_generations=8",
    "num_iterations=2",
    "kl_coef=0",
    "optim.lr=5e-4",
    "sampling.max_new_tokens=4",
    "rewards=[{function: 'posttrain.rewards.builtin:exact_answer'}]",
]
"""The demo's GRPO stage (16 prompts × 8 samples of ≤ 4 tokens, μ = 2, exact-answer reward, no
reference); ``bench/engine_curves.py`` runs the same stage with each rollout engine."""


STEPS = {"sft": 300, "grpo": 60, "dpo": 60, "rm": 60, "ppo": 30}
"""Each stage's steps (``quick``: a fifth, at least 2)."""

# The live numbers each stage's progress lines show (those of its metrics that a step has).
PROGRESS_KEYS = {
    "sft": ("loss",),
    "grpo": ("reward/mean", "kl/per_token", "eval/greedy/accuracy"),
    "dpo": ("loss", "rewards/accuracy", "rewards/margin", "eval/rewards/accuracy"),
    "rm": ("loss", "accuracy", "eval/accuracy"),
    "ppo": ("score/mean", "kl/per_sequence", "value_loss"),
}

PPO_SETTINGS = [  # the PPO stage's batch, learning rate, lengths and KL (bench/critic_curves.py runs it again)
    "run.batch_size=32",
    "run.micro_batch_size=16",
    "optim.lr=1e-3",
    "sampling.max_new_tokens=8",
    "sampling.min_new_tokens=8",
    "kl_coef=0.05",
]


def _progress(stage: str, total: int):
    """A trainer callback printing one line every tenth of the stage's steps (and at its last), with the
    step's numbers, the time so far and an estimate of the time left."""
    every, start, keys = max(1, total // 10), time.perf_counter(), PROGRESS_KEYS[stage]

    def callback(done: int, record: dict) -> None:
        if done % every and done != total:
            return
        elapsed = time.perf_counter() - start
        shown = [
            f"{key} {record[key]:.4g}"
            for key in keys
            if isinstance(record.get(key), int | float) and math.isfinite(record[key])
        ]
        left = f", ~{elapsed / done * (total - done):.0f} s left" if 0 < done < total else ""
        print(f"   [{stage}] step {done}/{total}  {'  '.join(shown)}  ({elapsed:.0f} s{left})", flush=True)

    return callback


def _finish_stage(out_path: Path, results: dict, start: float, stage: str, line: str) -> None:
    """Say the stage's results, and write summary.json and report.html of the stages done so far."""
    results["stages_done"] = [*results.get("stages_done", []), stage]
    results["seconds"] = round(time.perf_counter() - start, 1)
    runs = [out_path / name for name in results["stages_done"]]
    results["report"] = str(write_report(runs, out_path / "report.html"))
    partial = out_path / "summary.json.partial"
    partial.write_text(json.dumps(results, indent=2))
    os.replace(partial, out_path / "summary.json")  # never a half-written summary
    print(f"   {line}  ({results['seconds']} s; {out_path / 'summary.json'} and report.html updated)", flush=True)


def _write(path: Path, rows: list[dict]) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def accuracy(model_dir: str, rows: list[dict], temperature: float, samples: int = 4, seed: int = 0) -> float:
    """Share of sampled completions (``samples`` per prompt) that are exactly the answer, sampled by the
    engine ``rollout.engine=auto`` picks (as ``posttrain eval`` does)."""
    tokenizer = load_tokenizer(model_dir)
    model = load_causal_lm(ModelConfig(path=model_dir, device="cpu"))
    engine = build_engine(RolloutConfig(), model, tokenizer, model_dir, seed)
    torch.manual_seed(seed)
    n = 1 if temperature == 0 else samples
    rollout = engine.generate(
        [tokenizer(r["prompt"]).input_ids for r in rows], SamplingParams(max_new_tokens=4, temperature=temperature), n=n
    )
    answers = [r["answer"] for r in rows for _ in range(n)]
    return sum(c == a for c, a in zip(rollout.responses, answers, strict=True)) / len(answers)


def _right_wrong_pairs(rows: list[dict], seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [
        {"prompt": r["prompt"], "chosen": r["answer"], "rejected": str(int(r["answer"]) + rng.choice([-1, 1]))}
        for r in rows
    ]


def run_demo(out: str = "runs/demo", seed: int = 0, quick: bool = False) -> dict:
    from posttrain.trainers import sft

    out_path = Path(out)
    start = time.perf_counter()
    scale = 0.2 if quick else 1.0
    steps = {k: max(2, int(v * scale)) for k, v in STEPS.items()}
    # the trainers' progress bars and lines off: each stage prints a line every tenth of its steps instead
    common = ["run.progress=null", "data.chat_template=never", f"run.seed={seed}", "run.overwrite=true"]
    results: dict = {"steps": steps, "stages_done": [], "alerts": {}}

    print("1. building a tiny Llama and a character tokenizer (offline)")
    policy_dir = str(build_tiny(out_path / "tiny" / "policy", seed=seed))
    held_out = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(10) for b in range(10)]  # all 100 sums
    held_out_path = _write(out_path / "data" / "held_out.jsonl", held_out)

    print(f"2. SFT on single-digit sums from a demonstrator that is off by one half the time ({steps['sft']} steps)")
    sft_data = _write(out_path / "data" / "sft.jsonl", arithmetic_sft(2000, seed=seed, low=0, high=9, noise=0.5))
    sft.train(
        load_config(
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
                "optim.scheduler=cosine",
            ],
        ),
        callbacks=(_progress("sft", steps["sft"]),),
    )
    sft_dir = str(out_path / "sft" / "final" / "policy")
    results["sft"] = {"sampled": accuracy(sft_dir, held_out, 1.0, seed=seed), "greedy": accuracy(sft_dir, held_out, 0)}
    _finish_stage(out_path, results, start, "sft", f"SFT: accuracy {_accuracies(results['sft'])}")

    ctx = {
        "out": out_path,
        "seed": seed,
        "steps": steps,
        "common": common,
        "results": results,
        "start": start,
        "sft_dir": sft_dir,
        "held_out": held_out,
        "held_out_path": held_out_path,
        "policy_dir": policy_dir,
    }
    for stage in (_grpo_stage, _dpo_stage, _rm_stage, _ppo_stage):
        stage(ctx)
    _print_summary(results, out_path)
    return results


def _grpo_stage(ctx: dict) -> None:
    """3. GRPO from the SFT model with the exact-answer reward, evaluated on the held-out sums as it trains."""
    from posttrain.trainers import grpo

    out_path, seed, steps, common, results, start = (
        ctx[k] for k in ("out", "seed", "steps", "common", "results", "start")
    )
    sft_dir, held_out, held_out_path = ctx["sft_dir"], ctx["held_out"], ctx["held_out_path"]
    print(f"3. GRPO from the SFT model, reward = the sum is right ({steps['grpo']} steps)")
    prompts = _write(
        out_path / "data" / "prompts.jsonl",
        [{"prompt": r["prompt"], "answer": r["answer"]} for r in arithmetic_sft(300, seed=seed + 1, low=0, high=9)],
    )
    grpo.train(
        load_config(
            grpo.GRPOConfig,
            None,
            common
            + [
                f"model.path={sft_dir}",
                f"data.path={prompts}",
                f"run.output_dir={out_path / 'grpo'}",
                f"run.max_steps={steps['grpo']}",
                *GRPO_SETTINGS,
                f"eval.path={held_out_path}",
                f"run.eval_every={max(1, steps['grpo'] // 3)}",
            ],
        ),
        callbacks=(_progress("grpo", steps["grpo"]),),
    )
    grpo_dir = str(out_path / "grpo" / "final" / "policy")
    rewards = [r["reward/mean"] for r in read_metrics(out_path / "grpo") if "reward/mean" in r]  # not step 0's eval
    results["grpo"] = {
        "sampled": accuracy(grpo_dir, held_out, 1.0, seed=seed),
        "greedy": accuracy(grpo_dir, held_out, 0),
        "reward_first5": sum(rewards[:5]) / 5,
        "reward_last5": sum(rewards[-5:]) / 5,
    }
    results["alerts"]["grpo"] = len(read_alerts(out_path / "grpo"))
    grpo_line = f"mean reward {results['grpo']['reward_first5']:.3f} -> {results['grpo']['reward_last5']:.3f}"
    _finish_stage(out_path, results, start, "grpo", f"GRPO: accuracy {_accuracies(results['grpo'])}; {grpo_line}")


def _dpo_stage(ctx: dict) -> None:
    """4. DPO from the SFT model on (right sum, wrong sum) pairs, then its accuracies."""
    from posttrain.trainers import dpo

    out_path, seed, steps, common, results, start = (
        ctx[k] for k in ("out", "seed", "steps", "common", "results", "start")
    )
    sft_dir, held_out = ctx["sft_dir"], ctx["held_out"]
    print(f"4. DPO from the SFT model on (right sum, wrong sum) pairs ({steps['dpo']} steps)")
    pairs = _write(
        out_path / "data" / "pairs.jsonl", _right_wrong_pairs(arithmetic_sft(1000, seed=seed + 2, low=0, high=9), seed)
    )
    dpo_result = dpo.train(
        load_config(
            dpo.DPOConfig,
            None,
            common
            + [
                f"model.path={sft_dir}",
                f"data.path={pairs}",
                f"run.output_dir={out_path / 'dpo'}",
                f"run.max_steps={steps['dpo']}",
                "run.batch_size=32",
                "optim.lr=5e-4",
                "beta=0.1",
                "reference=precompute",
                "data.eval_fraction=0.1",
            ],
        ),
        callbacks=(_progress("dpo", steps["dpo"]),),
    )
    dpo_dir = str(out_path / "dpo" / "final" / "policy")
    results["dpo"] = {
        "sampled": accuracy(dpo_dir, held_out, 1.0, seed=seed),
        "greedy": accuracy(dpo_dir, held_out, 0),
        "eval_reward_accuracy": dpo_result["eval_metrics"]["eval/rewards/accuracy"],
    }
    dpo_line = f"held-out implicit-reward accuracy {results['dpo']['eval_reward_accuracy']:.1%}"
    _finish_stage(out_path, results, start, "dpo", f"DPO: accuracy {_accuracies(results['dpo'])}; {dpo_line}")


def _rm_stage(ctx: dict) -> None:
    """5. A reward model from 4-way vowel rankings, then its held-out pairwise accuracy."""
    from posttrain.trainers import rm

    out_path, seed, steps, common, results, start = (
        ctx[k] for k in ("out", "seed", "steps", "common", "results", "start")
    )
    policy_dir = ctx["policy_dir"]
    print(f"5. reward model from 4-way rankings, more vowels is better ({steps['rm']} steps)")
    rm_data = _write(out_path / "data" / "rankings.jsonl", vowel_rankings(800, k=4, seed=seed))
    rm_result = rm.train(
        load_config(
            rm.RMConfig,
            None,
            common
            + [
                f"model.path={policy_dir}",
                f"data.path={rm_data}",
                f"run.output_dir={out_path / 'rm'}",
                f"run.max_steps={steps['rm']}",
                "run.batch_size=16",
                "optim.lr=2e-3",
                "optim.scheduler=constant",
                "data.eval_fraction=0.1",
                "data_format=rankings",
            ],
        ),
        callbacks=(_progress("rm", steps["rm"]),),
    )
    results["rm"] = {"eval_pairwise_accuracy": rm_result["eval_metrics"]["eval/accuracy"]}
    rm_line = f"held-out pairwise accuracy {results['rm']['eval_pairwise_accuracy']:.1%}"
    _finish_stage(out_path, results, start, "rm", f"reward model: {rm_line}")


def _ppo_stage(ctx: dict) -> None:
    """6. RLHF-PPO of the tiny model against the stage-5 reward model, then its scores and samples."""
    from posttrain.trainers import ppo

    out_path, seed, steps, common, results, start = (
        ctx[k] for k in ("out", "seed", "steps", "common", "results", "start")
    )
    policy_dir = ctx["policy_dir"]
    print(f"6. RLHF-PPO of the tiny model against that reward model ({steps['ppo']} steps)")
    ppo_prompts = _write(out_path / "data" / "ppo_prompts.jsonl", [{"prompt": "rank:"}] * 64)
    ppo.train(
        load_config(
            ppo.PPOConfig,
            None,
            common
            + [
                f"model.path={policy_dir}",
                f"reward_model.path={out_path / 'rm' / 'final' / 'reward'}",
                f"data.path={ppo_prompts}",
                f"run.output_dir={out_path / 'ppo'}",
                f"run.max_steps={steps['ppo']}",
                *PPO_SETTINGS,
            ],
        ),
        callbacks=(_progress("ppo", steps["ppo"]),),
    )
    records = read_metrics(out_path / "ppo")
    tokenizer = load_tokenizer(policy_dir)
    ppo_dir = str(out_path / "ppo" / "final" / "policy")
    engine = build_engine(RolloutConfig(), load_causal_lm(ModelConfig(path=ppo_dir)), tokenizer, ppo_dir, seed)
    torch.manual_seed(seed)
    texts = engine.generate(
        [tokenizer("rank:").input_ids], SamplingParams(max_new_tokens=8, min_new_tokens=8), n=64
    ).responses
    results["ppo"] = {
        "score_first5": sum(r["score/mean"] for r in records[:5]) / 5,
        "score_last5": sum(r["score/mean"] for r in records[-5:]) / 5,
        "kl_per_sequence_last5": sum(r["kl/per_sequence"] for r in records[-5:]) / 5,
        "vowel_share_after": sum(vowel_count(t) for t in texts) / max(1, sum(len(t) for t in texts)),
        "samples_after": texts[:4],
    }
    results["alerts"]["ppo"] = len(read_alerts(out_path / "ppo"))
    ppo_line = f"reward-model score {results['ppo']['score_first5']:.2f} -> {results['ppo']['score_last5']:.2f}"
    _finish_stage(out_path, results, start, "ppo", f"PPO: {ppo_line}")


def _accuracies(r: dict) -> str:
    return f"{r['sampled']:.1%} sampled at T=1 / {r['greedy']:.1%} greedy"


def _print_summary(r: dict, out_path: Path) -> None:
    rows = [
        ("accuracy on all 100 single-digit sums, sampled at T=1 / greedy", ""),
        ("  after SFT on the noisy demonstrator", f"{r['sft']['sampled']:.1%} / {r['sft']['greedy']:.1%}"),
        ("  after GRPO (reward: the sum is right)", f"{r['grpo']['sampled']:.1%} / {r['grpo']['greedy']:.1%}"),
        ("  after DPO (right vs wrong pairs)", f"{r['dpo']['sampled']:.1%} / {r['dpo']['greedy']:.1%}"),
        (
            "GRPO mean reward, first 5 steps -> last 5",
            f"{r['grpo']['reward_first5']:.3f} -> {r['grpo']['reward_last5']:.3f}",
        ),
        ("DPO held-out implicit-reward accuracy", f"{r['dpo']['eval_reward_accuracy']:.1%}"),
        ("reward model held-out pairwise accuracy", f"{r['rm']['eval_pairwise_accuracy']:.1%}"),
        (
            "PPO reward-model score, first 5 steps -> last 5",
            f"{r['ppo']['score_first5']:.2f} -> {r['ppo']['score_last5']:.2f}",
        ),
        ("PPO KL per sequence (last 5 steps)", f"{r['ppo']['kl_per_sequence_last5']:.2f}"),
        (
            "PPO samples after training (vowel share)",
            # quoted and escaped: a sample holding a newline or a tab would break the table
            f"{', '.join(json.dumps(t, ensure_ascii=False) for t in r['ppo']['samples_after'])} "
            f"({r['ppo']['vowel_share_after']:.0%})",
        ),
        ("health alerts raised (GRPO / PPO)", f"{r['alerts']['grpo']} / {r['alerts']['ppo']}"),
        ("wall time (s)", f"{r['seconds']}"),
    ]
    width = max(len(k) for k, _ in rows)
    print("\nposttrain demo: results")
    for key, value in rows:
        print(f"  {key.ljust(width)}  {value}")
    # float rounding differs between CPUs' kernels, and a sampled token that flips changes the rest of a run
    print(
        "\nthese numbers repeat on this machine with the same seed and thread count "
        f"(torch threads: {torch.get_num_threads()}); another CPU or thread count rounds differently, "
        "samples other tokens and prints other digits"
    )
    print(f"runs, metrics and checkpoints: {out_path}/  (summary.json, */metrics.jsonl, */final/)")
    print(f"report (plots, alerts, samples): {r['report']}")


if __name__ == "__main__":
    run_demo()
