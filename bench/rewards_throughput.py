"""Throughput of the verifiable rewards: 1,000 GSM8K completions with the math reward, and 200 code
completions in the sandbox. Prints one JSON line.

    .venv/bin/python bench/rewards_throughput.py [--math 1000] [--code 200] [--workers 4] [--timeout 2]

Math: the worked solutions of N GSM8K training problems (the 300 shipped, repeated), scored against their own answers
(half of them) and against another problem's answer (the other half), through the same
``RewardComposer`` path training uses (a forked worker per call, under a timeout). Code: a mix of
correct, wrong, crashing and never-ending programs (5 % loop forever, to show what timeouts cost),
each against three asserts.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from posttrain.data import load_gsm8k
from posttrain.rewards import RewardComposer, RewardSpec
from posttrain.rewards.code import check_code
from posttrain.rewards.sandbox import isolation_level

PROGRAMS = {
    "correct": "def solve(a, b):\n    return a * b + 1",
    "wrong": "def solve(a, b):\n    return a * b",
    "crash": "def solve(a, b):\n    return undefined_name",
    "loop": "def solve(a, b):\n    while True:\n        pass",
}
TESTS = ["assert solve(2, 3) == 7", "assert solve(0, 5) == 1", "assert solve(4, 4) == 17"]


def bench_math(n: int) -> dict:
    sample = load_gsm8k("train")
    rows = [sample[i % len(sample)] for i in range(n)]
    rng = random.Random(0)
    other = [sample[(i + rng.randint(1, len(sample) - 1)) % len(sample)] for i in range(n)]  # never itself
    answers = [r["answer"] if i % 2 == 0 else other[i]["answer"] for i, r in enumerate(rows)]
    composer = RewardComposer.from_specs([RewardSpec("posttrain.rewards.math:math_answer", timeout=120)])
    start = time.perf_counter()
    out = composer([r["prompt"] for r in rows], [r["solution"] for r in rows], {"answer": answers})
    seconds = time.perf_counter() - start
    scores = out.components["math_answer"]
    return {
        "completions": n,
        "seconds": round(seconds, 2),
        "per_s": round(n / seconds, 1),
        "correct_half_mean": statistics.mean(scores[0::2]),
        "shuffled_half_mean": statistics.mean(scores[1::2]),
    }


def bench_code(n: int, workers: int, timeout: float) -> dict:
    rng = random.Random(0)
    kinds = [rng.choices(list(PROGRAMS), weights=[45, 35, 15, 5])[0] for _ in range(n)]
    completions = [f"```python\n{PROGRAMS[k]}\n```" for k in kinds]
    start = time.perf_counter()
    results = check_code(completions, [TESTS] * n, timeout=timeout, max_workers=workers)
    seconds = time.perf_counter() - start
    by_kind = {
        k: statistics.mean(r.score for r, kk in zip(results, kinds, strict=True) if kk == k)
        for k in PROGRAMS
        if k in kinds
    }
    return {
        "completions": n,
        "seconds": round(seconds, 2),
        "per_s": round(n / seconds, 1),
        "workers": workers,
        "timeout_s": timeout,
        "kinds": {k: kinds.count(k) for k in PROGRAMS},
        "mean_score_by_kind": by_kind,
        "statuses": {s: sum(r.status == s for r in results) for s in ("ok", "error", "crashed", "timeout")},
        "isolation": isolation_level(),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--math", type=int, default=1000)
    ap.add_argument("--code", type=int, default=200)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--timeout", type=float, default=2.0)
    args = ap.parse_args()
    print(json.dumps({"math": bench_math(args.math), "code": bench_code(args.code, args.workers, args.timeout)}))


if __name__ == "__main__":
    main()
