"""Tokens and model FLOPs per step with and without shared-prefix packing, on the bench's data.

    python bench/prefix_tokens.py [--model-dir DIR]     # DIR from ``common.py build`` (default: built in a temp dir)

DPO and RM: the bench's preference pairs, 8 per step, through posttrain's own data path and
collation (``DPOTask.sequences``): the positions a forward computes (rows × padded length, padding
included), the real tokens among them, and ``core.forward_cost`` of both layouts for the tiny and
the small model (the number ``shared_prefix=auto`` compares). GRPO: the bench's shape, 2 prompts of
7 tokens × 8 completions of 32 tokens. Prints a Markdown table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", default=None)
    ap.add_argument("--pairs", type=int, default=1024)
    args = ap.parse_args()

    from posttrain.core import forward_cost
    from posttrain.data import DataConfig, load_preferences
    from posttrain.models import ModelConfig, load_causal_lm, load_tokenizer
    from posttrain.runtime.prefix import SharedPrefix, model_size
    from posttrain.trainers.dpo import DPOConfig, DPOTask

    root = Path(tempfile.mkdtemp(prefix="prefix-tokens-"))
    data = common.write_jsonl(common.preference_pairs(args.pairs), root / "pairs.jsonl")
    sizes = {}
    for size in ("tiny", "small"):
        model_dir = Path(args.model_dir or common.build_models(root / size, size))
        sizes[size] = model_size(load_causal_lm(ModelConfig(path=str(model_dir / "policy"), device="cpu")))
    tokenizer = load_tokenizer(str(model_dir / "policy"))
    pairs, _ = load_preferences(DataConfig(path=str(data), max_length=66, chat_template="never"), tokenizer)

    result = {}
    for name, shared in (("padded", SharedPrefix(enabled=False)), ("packed", SharedPrefix(enabled=True, always=True))):
        task = DPOTask(None, tokenizer.pad_token_id, DPOConfig(), shared)
        computed = real = 0
        costs = dict.fromkeys(sizes, 0)
        for i in range(0, len(pairs) - 7, 8):
            batch = task.sequences(pairs[i : i + 8])
            rows, length = batch.input_ids.shape
            computed += rows * length
            real += batch.num_tokens
            for size, (params, width) in sizes.items():
                costs[size] += forward_cost(rows, length, params, width)
        steps = len(pairs) // 8
        result[name] = {
            "positions_per_step": computed / steps,
            "real_tokens_per_step": real / steps,
            **{f"forward_gflop_{s}": c / steps / 1e9 for s, c in costs.items()},
        }
    grpo = {}
    for size, (params, width) in sizes.items():
        padded, packed = forward_cost(16, 7 + 32, params, width), forward_cost(2, 7 + 8 * 32, params, width)
        grpo[size] = {"padded_gflop": padded / 1e9, "packed_gflop": packed / 1e9}
    result["grpo_16x32"] = {"padded_positions": 16 * 39, "packed_positions": 2 * (7 + 8 * 32), **grpo}

    a, b = result["padded"], result["packed"]
    print("| per step (8 pairs) | padded | packed | packed / padded |")
    print("|---|---|---|---|")
    for key in ("positions_per_step", "real_tokens_per_step", "forward_gflop_tiny", "forward_gflop_small"):
        print(f"| {key} | {a[key]:.4g} | {b[key]:.4g} | {b[key] / a[key]:.3f} |")
    for size, g in grpo.items():
        print(
            f"| grpo 16×32 forward GFLOP, {size} | {g['padded_gflop']:.4g} | {g['packed_gflop']:.4g} "
            f"| {g['packed_gflop'] / g['padded_gflop']:.3f} |"
        )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
