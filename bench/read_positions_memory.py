"""The last layer only where it is read (``posttrain.models.positions``) on long sequences: peak
accelerator memory (CUDA) or CPU time of a response log-prob pass, forward + backward, with and
without the shortcut, on a grouped-query Qwen2-style model (hidden 512, 4 layers, 8 heads, 2 KV heads)
built from a seed. On CUDA the shortcut's masked attention must not fall back to sdpa's quadratic
math kernel (keys and values are repeated for GQA, as transformers does). Prints one JSON line.

    python bench/read_positions_memory.py [--length 4096] [--response 1024] [--rows 2] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--response", type=int, default=1024)
    ap.add_argument("--rows", type=int, default=2)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()

    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from posttrain.models import positions, response_logprobs

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=1000, hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=2, max_position_embeddings=args.length, attention_dropout=0.0,
    )  # fmt: skip
    model = Qwen2ForCausalLM(config).to(device=device, dtype=getattr(torch, args.dtype))
    ids = torch.randint(0, 1000, (args.rows, args.length), device=device)
    mask = torch.ones_like(ids)
    assert positions.can_read_positions(model)

    def run() -> tuple[float, float]:
        model.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        start, cpu = time.perf_counter(), time.process_time()
        logprobs, _ = response_logprobs(model, ids, mask, args.response)
        logprobs.float().sum().backward()
        if cuda:
            torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() / 2**20 if cuda else 0.0
        return peak, (time.perf_counter() - start) if cuda else (time.process_time() - cpu)

    original = positions.can_read_positions
    results = {}
    for name, enabled in (("full", False), ("read", True), ("full", False), ("read", True)) * args.reps:
        positions.can_read_positions = original if enabled else (lambda m: False)
        results.setdefault(name, []).append(run())
    positions.can_read_positions = original
    out = {
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "shape": [args.rows, args.length, args.response],
        "dtype": args.dtype,
        **({f"{k}_peak_mib": max(p for p, _ in v[2:]) for k, v in results.items()} if cuda else {}),
        **{f"{k}_median_s": statistics.median(t for _, t in v[2:]) for k, v in results.items()},
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
