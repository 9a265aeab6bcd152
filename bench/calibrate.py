"""The machine's speed right now: a fixed fp32 matmul (GFLOP/s) and a fixed pure-Python loop (ms).

On a shared VM the same run drifts by tens of percent between minutes; ``run.sh`` runs this before
every bench run so that a slow machine shows up as such. Prints one JSON line.

    python bench/calibrate.py [--threads 1] [--reps 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    a = torch.randn(256, 256)
    for _ in range(50):
        a @ a
    matmul, loop = [], []
    for _ in range(args.reps):
        start = time.perf_counter()
        for _ in range(500):
            a @ a
        matmul.append(500 * 2 * 256**3 / (time.perf_counter() - start) / 1e9)
        start = time.perf_counter()
        total = 0
        for i in range(1_000_000):
            total += i
        loop.append((time.perf_counter() - start) * 1e3)
    print(
        json.dumps(
            {
                "matmul256_gflops": round(statistics.median(matmul), 1),
                "pyloop_1M_ms": round(statistics.median(loop), 1),
                "torch_threads": torch.get_num_threads(),
                "loadavg_1m": round(__import__("os").getloadavg()[0], 2),
            }
        )
    )


if __name__ == "__main__":
    main()
