"""Parity with TRL on a fixed batch: every case of ``grpo_parity.CASES`` and ``dpo_parity.CASES`` through both
libraries, in float64 and float32; a Markdown table of the differences, and a JSON file with every number.

    python bench/parity/run.py [--dtype float64 float32] [--only grpo|dpo] [--json-out FILE]

Needs TRL (the bench environment, ``bench/parity/run.sh`` builds it). Exit status 1 when a case meant to be
equal differs by more than the tolerance (float64: 1e-6, float32: 1e-5, relative to the largest entry), or a
difference by design documented in docs/parity.md has vanished (then the page is out of date).

Differences are max |posttrain − TRL| and that divided by the largest |TRL| entry: of the loss (relative to
max(|loss|, 1): GRPO's loss is ~0 by construction at μ = 1), of the gradient over every parameter entry, of
the advantages and the old and reference log-probs (over response tokens).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE", "HF_HUB_DISABLE_TELEMETRY"):
    os.environ.setdefault(name, "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

TOLERANCE = {"float64": 1e-6, "float32": 1e-5}


def passes(result: dict) -> bool:
    """Whether the case came out as documented: within the tolerance when equal, outside it when not."""
    tol = TOLERANCE[result["dtype"]]
    loss_abs, _ = result["loss"]
    within = loss_abs <= tol * max(abs(result["loss_values"][1]), 1.0) and result["grad"][1] <= tol
    return within == result["equal_expected"]


def row(library: str, r: dict) -> str:
    def num(key: str, i: int) -> str:
        return f"{r[key][i]:.1e}" if key in r else ""

    clip = f"{r['clipfrac']:.3f}" if "clipfrac" in r else ""
    verdict = ("equal" if r["equal_expected"] else "differs (by design)") + ("" if passes(r) else " **FAILED**")
    return (
        f"| {library} | {r['case']} | {r['dtype']} | {clip} | {num('advantages', 0)} | {num('old_logprobs', 0)} "
        f"| {num('ref_logprobs', 0)} | {r['loss_values'][1]:.6g} | {num('loss', 0)} | {num('grad', 0)} "
        f"| {num('grad', 1)} | {verdict} |"
    )


HEADER = (
    "| loss | case | dtype | clipfrac | max \\|ΔA\\| | max \\|Δ old logp\\| | max \\|Δ ref logp\\| | TRL loss "
    "| \\|Δ loss\\| | max \\|Δ grad\\| | max \\|Δ grad\\| / max \\|grad\\| | |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|---|"
)


def environment() -> dict:
    import torch
    import transformers
    import trl

    root = Path(__file__).resolve().parents[2]
    commit = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain"], capture_output=True, text=True)
    cpuinfo = Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []
    cpu = next((line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")), "")
    return {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "commit": commit.stdout.strip() + (" (with uncommitted changes)" if dirty.stdout.strip() else ""),
        "cpu": cpu, "cores": os.cpu_count(), "torch": torch.__version__, "transformers": transformers.__version__,
        "trl": trl.__version__,
    }  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", nargs="+", default=["float64", "float32"], choices=["float64", "float32"])
    ap.add_argument("--only", choices=["grpo", "dpo"])
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1: a shared machine)")
    ap.add_argument("--json-out", help="write the environment and every case's numbers here")
    args = ap.parse_args()
    try:
        import trl  # noqa: F401
    except ImportError:
        print("parity: TRL is not installed here; run bench/parity/run.sh TRL_BENCH_DIR (it builds .venv-bench)")
        return 2
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import dpo_parity
    import fixtures
    import grpo_parity

    torch.set_num_threads(args.threads)
    suites = [("GRPO", grpo_parity), ("DPO", dpo_parity)]
    suites = [(n, m) for n, m in suites if args.only in (None, n.lower())]
    results, started = [], time.time()
    with tempfile.TemporaryDirectory() as root:
        model_dir = fixtures.build_model_dir(Path(root))
        for dtype in args.dtype:
            for library, module in suites:
                for case in module.CASES:
                    r = module.run_case(model_dir, case, getattr(torch, dtype))
                    results.append((library, r))
                    print(row(library, r), file=sys.stderr, flush=True)
    env = {**environment(), "seconds": round(time.time() - started)}
    print(f"\n{json.dumps(env)}\n\n{HEADER}")
    for library, r in results:
        print(row(library, r))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"environment": env, "results": [r for _, r in results]}, indent=1))
    failed = [r["case"] + " " + r["dtype"] for _, r in results if not passes(r)]
    if failed:
        print(f"\nparity: {len(failed)} case(s) not as documented: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
