"""Generation alone: completion tokens/s of posttrain's lean engine against ``HFEngine`` (transformers
``generate``) on the GRPO bench's shape (2 prompts × 8 samples × 32 tokens, EOS forbidden until then),
alternating the two engines in one process, rep after rep. Prints one JSON line.

    python bench/generate_bench.py --model-dir DIR [--shape 16x32] [--reps 20] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--shape", default="16x32", help="completions x tokens (8 samples per prompt)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from posttrain.rollout import HFEngine, LeanEngine, SamplingParams

    if args.threads:
        torch.set_num_threads(args.threads)
    rows, length = (int(x) for x in args.shape.split("x"))
    path = str(Path(args.model_dir) / "policy")
    model, tokenizer = AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)
    prompts = [tokenizer(f"{10 + i}+{20 + i}=").input_ids for i in range(rows // 8)]
    params = SamplingParams(max_new_tokens=length, min_new_tokens=length)
    engines = {"hf": HFEngine(model, tokenizer), "lean": LeanEngine(model, tokenizer)}
    wall = {k: [] for k in engines}
    cpu = {k: [] for k in engines}
    for _ in range(args.reps):
        for name, engine in engines.items():
            start, start_cpu = time.perf_counter(), time.process_time()
            engine.generate(prompts, params, n=8)
            wall[name].append(time.perf_counter() - start)
            cpu[name].append(time.process_time() - start_cpu)
    skip = 2  # warm-up reps
    median = {k: statistics.median(v[skip:]) for k, v in wall.items()}
    median_cpu = {k: statistics.median(v[skip:]) for k, v in cpu.items()}
    result = {
        "shape": args.shape,
        "tokens_per_s": {k: rows * length / v for k, v in median.items()},
        "median_s": median,
        "median_cpu_s": median_cpu,
        "speedup_wall": median["hf"] / median["lean"],
        "speedup_cpu": median_cpu["hf"] / median_cpu["lean"],
        "per_rep_speedup_median": statistics.median(
            h / w for h, w in zip(wall["hf"][skip:], wall["lean"][skip:], strict=True)
        ),
        "torch_threads": torch.get_num_threads(),
        "loadavg_1m": os.getloadavg()[0],
    }
    line = json.dumps(result)
    if args.json_out:
        Path(args.json_out).write_text(line + "\n")
    print(line)


if __name__ == "__main__":
    main()
