"""Peak extra memory of ``posttrain.core.token_logprobs`` against the naive log_softmax + gather.

    .venv/bin/python bench/token_logprobs_memory.py [--shape 4 512 32000] [--repeats 3]

Each method runs in a fresh subprocess, so one cannot inherit the other's freed pages. On CPU the
extra is the growth of the peak resident set (``ru_maxrss``) while the method runs, over a baseline
taken after the logits exist; on a GPU it is ``torch.cuda.max_memory_allocated`` over the same
baseline. Target (issue #2): posttrain's extra under 10% of the naive extra. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

WORKER = r"""
import json, resource, sys, time
import torch
from posttrain.core import token_logprobs

method, B, T, V = sys.argv[1], *map(int, sys.argv[2:5])
device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)
logits = torch.randn(B, T, V, device=device)
tokens = torch.randint(0, V, (B, T), device=device)

def naive():
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)

def chunked():
    return token_logprobs(logits, tokens)

fn = {"naive": naive, "posttrain": chunked}[method]
with torch.no_grad():
    if device == "cuda":
        torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        t0 = time.perf_counter(); out = fn(); torch.cuda.synchronize(); dt = time.perf_counter() - t0
        extra = torch.cuda.max_memory_allocated() - base
    else:
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        t0 = time.perf_counter(); out = fn(); dt = time.perf_counter() - t0
        extra = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
print(json.dumps({"method": method, "device": device, "extra_bytes": extra, "seconds": dt,
                  "checksum": float(out.double().sum())}))
"""


def run(method: str, shape: list[int]) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", WORKER, method, *map(str, shape)], capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", type=int, nargs=3, default=[4, 512, 32000], metavar=("B", "T", "V"))
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    runs = {"naive": [], "posttrain": []}
    for _ in range(args.repeats):  # interleaved, so drift on a shared machine hits both alike
        for method in runs:
            runs[method].append(run(method, args.shape))
    mib = 1024**2
    naive = statistics.median(r["extra_bytes"] for r in runs["naive"])
    ours = statistics.median(r["extra_bytes"] for r in runs["posttrain"])
    checks = {r["checksum"] for rs in runs.values() for r in rs}
    result = {
        "shape": args.shape,
        "device": runs["naive"][0]["device"],
        "naive_extra_mib": round(naive / mib, 1),
        "posttrain_extra_mib": round(ours / mib, 1),
        "ratio": round(ours / naive, 4),
        "target_ratio": 0.10,
        "meets_target": ours / naive < 0.10,
        "naive_s": round(statistics.median(r["seconds"] for r in runs["naive"]), 4),
        "posttrain_s": round(statistics.median(r["seconds"] for r in runs["posttrain"]), 4),
        "same_result": max(checks) - min(checks) < 1e-3 * abs(max(checks)),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
