"""Asynchronous rollouts on a CPU: GRPO steps per second at rollout.async_steps 0 / 1 / 2, and where the
time goes. The synchronous run uses every thread for both phases; an asynchronous one gives the producer
``--producer-threads`` and the trainer the rest (``rollout.producer_threads``).

    .venv/bin/python bench/async_steps.py --size tiny --rounds 3        # the TRL bench's 0.55 M model
    .venv/bin/python bench/async_steps.py --size small --rounds 3       # the 20.6 M model

Each round runs every setting once, in turn (so drift in the machine's load hits them alike); the result
is the median over rounds of each run's median step time, and the ratio async / sync per round. The work
per step is the TRL GRPO bench's (bench/posttrain_bench.py) at 64 completions × 64 tokens, with the old
log-prob forward an asynchronous run adds (its batches are one version old) and token-level TIS.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="tiny", choices=["tiny", "small"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2, help="the synchronous run's threads; async splits them")
    ap.add_argument("--producer-threads", type=int, default=1)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--length", type=int, default=64)
    ap.add_argument("--async-steps", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    root = Path(args.out or tempfile.mkdtemp(prefix="posttrain-async-bench-"))
    models = root / "models"
    if not (models / "policy").is_dir():
        subprocess.run(
            [sys.executable, str(HERE / "common.py"), "build", "--out", str(models), "--size", args.size], check=True
        )
    runs: list[dict] = []
    for r in range(args.rounds):
        for k in args.async_steps:
            command = [
                sys.executable,
                str(HERE / "posttrain_bench.py"),
                "grpo",
                "--model-dir",
                str(models),
                "--steps",
                str(args.steps),
                "--warmup",
                str(args.warmup),
                "--threads",
                str(args.threads),
                "--batch-size",
                str(args.batch_size),
                "--max-completion-length",
                str(args.length),
                "--async-steps",
                str(k),
                "--producer-threads",
                str(args.producer_threads),
                "--output-dir",
                str(root / f"round{r}-async{k}"),
            ]
            done = subprocess.run(command, capture_output=True, text=True, check=True)
            result = json.loads(done.stdout.strip().splitlines()[-1])
            run = {
                "round": r,
                "async_steps": k,
                "median_step_s": result["median_step_s"],
                "phase_mean_s": {n: round(v, 4) for n, v in result["phase_mean_s"].items()},
                "torch_threads": result["torch_threads"],
            }
            runs.append(run)
            print(json.dumps(run), flush=True)
    summary = {}
    for k in args.async_steps:
        mine = [x for x in runs if x["async_steps"] == k]
        ratios = [
            next(y["median_step_s"] for y in runs if y["round"] == x["round"] and y["async_steps"] == 0)
            / x["median_step_s"]
            for x in mine
        ]
        phases = sorted({n for x in mine for n in x["phase_mean_s"]})
        summary[f"async_{k}"] = {
            "median_step_s": round(statistics.median(x["median_step_s"] for x in mine), 4),
            "steps_per_s_vs_sync": [round(v, 3) for v in ratios],
            "steps_per_s_vs_sync_median": round(statistics.median(ratios), 3),
            "phase_mean_s": {
                n: round(statistics.median(x["phase_mean_s"].get(n, 0.0) for x in mine), 4) for n in phases
            },
        }
    (root / "results.json").write_text(json.dumps({"config": vars(args), "runs": runs, "summary": summary}, indent=1))
    print(json.dumps(summary, indent=1))
    print(f"runs and results.json: {root}")


if __name__ == "__main__":
    main()
