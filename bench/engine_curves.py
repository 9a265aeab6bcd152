"""GRPO on the demo's digit task with rollout.engine=hf against rollout.engine=vllm (colocated): the
same reward curve within seed noise, and each engine's step time.

Run in the environment that has vLLM (``make .venv-vllm/.installed``):

    VLLM_CPU_KVCACHE_SPACE=1 .venv-vllm/bin/python bench/engine_curves.py --seeds 0 1 2 --steps 60

``--compare`` picks other settings of the same run (``SETTINGS``), e.g. asynchronous rollouts at
staleness 0, 1 and 2 with and without the importance correction (docs/algorithms/async.md):

    .venv/bin/python bench/engine_curves.py --compare async0 async1 async1-none async2 async2-none

The SFT model is the demo's (tiny Llama, 300 steps on single-digit sums from a demonstrator that is
off by one half the time); GRPO uses the demo's settings (16 prompts × 8 samples of ≤ 4 tokens,
μ = 2, lr 5e-4, exact-answer reward, no reference). Both engines sample from the same policy
distribution but not the same tokens (vLLM has its own sampler), so only statistics over seeds can
agree. Prints one JSON line per run and a summary: the mean training reward per window of steps,
mean and spread (min–max) over seeds, per engine; the median step and generate times (step 1, with
vLLM's warm-up, left out).
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

VLLM = ["rollout.engine=vllm", "rollout.dtype=float32", "rollout.enforce_eager=true"]
SETTINGS = {
    "hf": ["rollout.engine=hf"],
    "vllm": VLLM,
    "async0": [],
    "async1": ["rollout.async_steps=1", "rollout.importance_sampling=token"],
    "async1-none": ["rollout.async_steps=1"],
    "async2": ["rollout.async_steps=2", "rollout.importance_sampling=token"],
    "async2-none": ["rollout.async_steps=2"],
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--window", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=None, help="folder for the runs and results.json (default: a temp folder)")
    parser.add_argument("--compare", nargs="+", default=["hf", "vllm"], choices=sorted(SETTINGS))
    args = parser.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    from posttrain.data.synthetic import arithmetic_sft
    from posttrain.demo import GRPO_SETTINGS
    from posttrain.models.tiny import build_tiny
    from posttrain.runtime.config import load_config
    from posttrain.runtime.metrics import read_metrics
    from posttrain.trainers import grpo, sft

    root = Path(args.out or tempfile.mkdtemp())
    common = ["run.progress=false", "data.chat_template=never", "run.report_to=[jsonl]", "run.overwrite=true"]
    policy = build_tiny(root / "tiny" / "policy", seed=0)
    sft_data = root / "sft.jsonl"
    sft_data.write_text("".join(json.dumps(r) + "\n" for r in arithmetic_sft(2000, seed=0, low=0, high=9, noise=0.5)))
    sft_options = ["run.max_steps=300", "run.batch_size=32", "optim.lr=3e-3", "optim.scheduler=cosine"]
    sft.train(
        load_config(
            sft.SFTConfig,
            None,
            [*common, f"model.path={policy}", f"data.path={sft_data}", f"run.output_dir={root / 'sft'}", *sft_options],
        )
    )
    prompts = root / "prompts.jsonl"
    rows = [{"prompt": r["prompt"], "answer": r["answer"]} for r in arithmetic_sft(300, seed=1, low=0, high=9)]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))

    runs = []
    for seed in args.seeds:
        for engine in args.compare:
            out = root / f"grpo-{engine}-{seed}"
            config = load_config(
                grpo.GRPOConfig,
                None,
                [
                    *common,
                    f"model.path={root / 'sft' / 'final' / 'policy'}",
                    f"data.path={prompts}",
                    f"run.output_dir={out}",
                    f"run.seed={seed}",
                    f"run.max_steps={args.steps}",
                    *GRPO_SETTINGS,
                    *SETTINGS[engine],
                ],
            )
            start = time.perf_counter()
            grpo.train(config)
            metrics = read_metrics(out)
            run = {
                "engine": engine,
                "seed": seed,
                "total_s": round(time.perf_counter() - start, 1),
                "rewards": [m["reward/mean"] for m in metrics],
                "step_s_median": statistics.median(m["time/step"] for m in metrics[1:]),
                "generate_s_median": statistics.median(m["time/generate"] for m in metrics[1:]),
                "logprob_diff_max": max((m.get("rollout/logprob_diff_max", 0.0) for m in metrics), default=0.0),
            }
            runs.append(run)
            print(json.dumps({k: v for k, v in run.items() if k != "rewards"}), flush=True)

    summary = {}
    for engine in args.compare:
        mine = [r for r in runs if r["engine"] == engine]
        windows = []
        for start in range(0, args.steps, args.window):
            per_seed = [statistics.fmean(r["rewards"][start : start + args.window]) for r in mine]
            windows.append(
                {
                    "steps": f"{start + 1}-{min(start + args.window, args.steps)}",
                    "mean": round(statistics.fmean(per_seed), 3),
                    "min": round(min(per_seed), 3),
                    "max": round(max(per_seed), 3),
                }
            )
        summary[engine] = {
            "windows": windows,
            "step_s_median": round(statistics.median(r["step_s_median"] for r in mine), 3),
            "generate_s_median": round(statistics.median(r["generate_s_median"] for r in mine), 3),
            "logprob_diff_max": max(r["logprob_diff_max"] for r in mine),
        }
    (root / "results.json").write_text(json.dumps({"runs": runs, "summary": summary}, indent=1))
    print(json.dumps(summary, indent=1))
    print(f"runs and results.json: {root}")


if __name__ == "__main__":
    main()
