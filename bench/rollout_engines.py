"""GRPO step time with rollout.engine=hf against rollout.engine=vllm (colocated) on the tiny model.

Run in the environment that has vLLM (``make .venv-vllm/.installed``):

    VLLM_CPU_KVCACHE_SPACE=1 .venv-vllm/bin/python bench/rollout_engines.py --steps 6

Prints, per engine, the median over steps 2.. (step 1 holds vLLM's first-call warm-up) of the step
time and of its generate phase, the final reward, and the largest vLLM/trainer log-prob gap.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    from posttrain.data.synthetic import arithmetic_sft
    from posttrain.models.tiny import build_tiny
    from posttrain.runtime.config import load_config
    from posttrain.runtime.metrics import read_metrics
    from posttrain.trainers.grpo import GRPOConfig, train

    root = Path(tempfile.mkdtemp())
    build_tiny(root / "policy", kind="causal", seed=0)
    rows = [{"prompt": r["prompt"], "answer": r["answer"]} for r in arithmetic_sft(256, seed=0, low=0, high=9)]
    (root / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    vllm = ["rollout.engine=vllm", "rollout.dtype=float32", "rollout.enforce_eager=true"]
    for engine in ("hf", "vllm"):
        extra = vllm if engine == "vllm" else []
        config = load_config(
            GRPOConfig,
            None,
            [
                f"model.path={root / 'policy'}",
                f"data.path={root / 'prompts.jsonl'}",
                "data.chat_template=never",
                f"run.output_dir={root / engine}",
                "run.progress=false",
                "run.report_to=[jsonl]",
                "rewards=[{function: 'posttrain.rewards.length:per_token_length', kwargs: {per_token: 0.1}}]",
                "sampling.max_new_tokens=16",
                "num_generations=8",
                "run.batch_size=64",
                "run.micro_batch_size=64",
                f"run.max_steps={args.steps}",
                "optim.lr=1e-3",
                "kl_coef=0",
                *extra,
            ],
        )
        start = time.perf_counter()
        train(config)
        total = time.perf_counter() - start
        metrics = read_metrics(config.run.output_dir)[1:]
        print(
            json.dumps(
                {
                    "engine": engine,
                    "steps": args.steps,
                    "total_s_with_startup": round(total, 2),
                    "step_s_median": round(statistics.median(m["time/step"] for m in metrics), 3),
                    "generate_s_median": round(statistics.median(m["time/generate"] for m in metrics), 3),
                    "final_reward": metrics[-1]["reward/mean"],
                    "logprob_diff_max": max((m.get("rollout/logprob_diff_max", 0.0) for m in metrics), default=0.0),
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
