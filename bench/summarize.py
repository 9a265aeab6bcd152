"""The table of a ``run.sh`` results folder: per bench and model size, the median over rounds of each
library's median step time (wall) and process CPU time per step, their ratios (the median of the
per-round ratios), peak RSS, the calibrated matmul rate and the achieved FLOP/s. On a machine other
processes load, a process waits for a core much of the time: the CPU-time ratio is then the steadier
measure of the work each library does per step, the wall ratio the one a user sees.

    python bench/summarize.py bench/results/<stamp>

Model FLOPs per step count 2·N per token of a forward pass and 6·N per trained token (forward +
backward), N = the matmul parameters (attention/MLP projections and the output head; attention
scores and embeddings are left out, a few percent at these lengths). GRPO: B·(P+T) tokens through
generation, the reference forward and the policy forward + backward (10·N per token); DPO: policy
forward + backward and reference forward (8·N); RM: forward + backward (6·N).
"""

from __future__ import annotations

import json
import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path


def matmul_params(config: dict, head: bool = True) -> int:
    h, i, layers = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    kv = h * config["num_key_value_heads"] // config["num_attention_heads"]
    per_layer = 2 * h * h + 2 * h * kv + 3 * h * i
    return layers * per_layer + (h * config["vocab_size"] if head else h)


def flops_per_step(bench: str, config: dict, posttrain_run: dict) -> float:
    """The tokens come from posttrain's run (the same rows on both sides): 7 prompt tokens with the
    character tokenizer, 6 with SmolLM2's; 66 tokens a preference sequence, 65."""
    if bench.startswith("grpo"):
        batch, length = (64, 64) if bench == "grpo_large" else (16, 32)
        tokens = posttrain_run.get("prompt_tokens_per_step", 7 * batch) + posttrain_run.get(
            "completion_tokens_per_step", length * batch
        )
        return 10 * matmul_params(config) * tokens
    tokens = posttrain_run.get("tokens_per_step", 16 * 66)
    return 8 * matmul_params(config) * tokens if bench == "dpo" else 6 * matmul_params(config, head=False) * tokens


def main() -> None:
    out = Path(sys.argv[1])
    runs = defaultdict(lambda: defaultdict(list))
    calib = defaultdict(list)
    for path in sorted(out.glob("*.json")):
        m = re.fullmatch(r"(grpo_large|grpo|dpo|rm)-(\w+)-(trl|posttrain)-(\d+)\.json", path.name)
        if not m:
            continue
        bench, size, lib, i = m.groups()
        runs[(bench, size)][lib].append((int(i), json.loads(path.read_text())))
        calib_path = path.with_suffix(".calib")
        if calib_path.exists() and calib_path.read_text().strip():
            calib[(bench, size)].append(json.loads(calib_path.read_text()))
    print(f"results: {out}\n")
    print(
        "| bench | model | TRL s/step | posttrain s/step | posttrain / TRL | CPU s/step TRL → posttrain | CPU ratio"
        " | rounds | peak RSS TRL → posttrain (MiB) | RSS ratio | matmul GFLOP/s | GFLOP per wall s | GFLOP per CPU s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for (bench, size), libs in sorted(
        runs.items(), key=lambda kv: (["grpo", "grpo_large", "dpo", "rm"].index(kv[0][0]), kv[0][1])
    ):
        config = json.loads((out / "models" / f"posttrain-{size}" / "policy" / "config.json").read_text())
        trl, pt = dict(libs.get("trl", [])), dict(libs.get("posttrain", []))
        rounds = sorted(set(trl) & set(pt))
        if not rounds:
            continue
        t = statistics.median(trl[i]["median_step_s"] for i in rounds)
        p = statistics.median(pt[i]["median_step_s"] for i in rounds)
        ratio = statistics.median(pt[i]["median_step_s"] / trl[i]["median_step_s"] for i in rounds)
        cpu_key = "median_process_cpu_s_per_step"
        cpu_t = statistics.median(trl[i][cpu_key] for i in rounds)
        cpu_p = statistics.median(pt[i][cpu_key] for i in rounds)
        cpu_ratio = statistics.median(pt[i][cpu_key] / trl[i][cpu_key] for i in rounds)
        rss_t = statistics.median(trl[i]["peak_rss_mib"] for i in rounds)
        rss_p = statistics.median(pt[i]["peak_rss_mib"] for i in rounds)
        mm = (
            statistics.median(c["matmul256_gflops"] for c in calib[(bench, size)])
            if calib[(bench, size)]
            else float("nan")
        )
        flops = flops_per_step(bench, config, pt[rounds[-1]]) / 1e9
        print(
            f"| {bench} | {size} | {t:.3f} | {p:.3f} | **{ratio:.2f}** | {cpu_t:.3f} → {cpu_p:.3f} | {cpu_ratio:.2f}"
            f" | {len(rounds)} | {rss_t:.0f} → {rss_p:.0f} |"
            f" {rss_p / rss_t:.2f} | {mm:.0f} | {flops / t:.1f} → {flops / p:.1f}"
            f" | {flops / cpu_t:.1f} → {flops / cpu_p:.1f} |"
        )
    print()
    print("Per-round median s/step (TRL / posttrain) and posttrain's mean phase split (s):")
    for (bench, size), libs in sorted(runs.items()):
        trl, pt = dict(libs.get("trl", [])), dict(libs.get("posttrain", []))
        rounds = ", ".join(
            f"{trl[i]['median_step_s']:.3f}/{pt[i]['median_step_s']:.3f}" for i in sorted(set(trl) & set(pt))
        )
        phases = {}
        if pt:
            last = pt[max(pt)]
            phases = {k: round(v, 4) for k, v in last.get("phase_mean_s", {}).items()}
        print(f"- {bench} {size}: {rounds}; posttrain phases {phases}")
    for path in sorted(out.glob("generate-*.out")):
        g = json.loads(path.read_text())
        print(
            f"\nGeneration alone ({path.stem[9:]} model, {g['shape']} tokens): lean"
            f" {g['tokens_per_s']['lean']:,.0f} tok/s, HF generate {g['tokens_per_s']['hf']:,.0f} tok/s:"
            f" {g['speedup_wall']:.2f}× wall, {g['speedup_cpu']:.2f}× CPU time"
        )
    loads = [c.get("loadavg_1m") for cs in calib.values() for c in cs if c.get("loadavg_1m") is not None]
    if loads:
        print(
            f"\nLoad average (1 min) before the runs: median {statistics.median(loads):.1f},"
            f" range {min(loads):.1f}–{max(loads):.1f}"
        )


if __name__ == "__main__":
    main()
