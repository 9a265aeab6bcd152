"""posttrain's side of the TRL comparison: the same work per step as ``grpo_bench.py``, ``dpo_bench.py`` and
``rm_bench.py`` of the TRL CPU bench, through posttrain's own trainers, timed by the same rule.

    python bench/posttrain_bench.py grpo --model-dir DIR [--batch-size 64 --max-completion-length 64]
    python bench/posttrain_bench.py dpo --model-dir DIR
    python bench/posttrain_bench.py rm --model-dir DIR

Per step, as in the TRL bench: GRPO samples 16 completions (2 prompts × 8) of exactly 32 tokens (EOS
forbidden until then), scores them, runs the reference (β = 0.04, k3 in the loss, token-mean = TRL's
"dapo" loss) and one policy forward + backward + AdamW step, no old-policy pass; DPO runs 8 pairs
(16 sequences of 66 tokens) with a reference forward every step; RM 8 pairs. fp32, lr 1e-5 with a
linear schedule, gradient clipping at 1.0, no top-k / top-p, no evaluation, no checkpoints. The reward
function runs inline (TRL calls it in-process too). Prints one JSON line (the last line of stdout).
"""

from __future__ import annotations

import time

_T0 = time.perf_counter()

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

for _key in ("HF_HUB_OFFLINE", "HF_HUB_DISABLE_TELEMETRY", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
    os.environ.setdefault(_key, "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402


def run_config(args, out: Path, batch_size: int):
    from posttrain.runtime.config import OptimConfig, RunConfig

    run = RunConfig(
        output_dir=str(out / "run"),  # beside the data files: a run refuses a folder that holds anything
        seed=args.seed,
        max_steps=args.steps,
        batch_size=batch_size,
        micro_batch_size=batch_size,
        report_to=["jsonl"],
        progress=False,
    )
    return run, OptimConfig(lr=1e-5, scheduler="linear", max_grad_norm=1.0)


def shared_prefix(args) -> dict:
    """``shared_prefix`` of the trainer config when --shared-prefix is given (else posttrain's default, auto)."""
    if args.shared_prefix is None:
        return {}
    return {"shared_prefix": {"true": True, "false": False}.get(args.shared_prefix, args.shared_prefix)}


def grpo(args, out: Path, clock: common.StepClock) -> dict:
    from posttrain.data import DataConfig
    from posttrain.models import ModelConfig
    from posttrain.rewards import RewardSpec
    from posttrain.rollout import RolloutConfig, SamplingParams
    from posttrain.trainers.grpo import GRPOConfig, GRPOTrainer

    prompts = common.write_jsonl(common.arithmetic_prompts(args.num_prompts, args.seed), out / "prompts.jsonl")
    run, optim = run_config(args, out, args.batch_size)
    length = args.max_completion_length
    config = GRPOConfig(
        model=ModelConfig(path=str(Path(args.model_dir) / "policy")),
        data=DataConfig(path=str(prompts), max_length=None, max_prompt_length=512, chat_template="never"),
        optim=optim,
        run=run,
        sampling=SamplingParams(max_new_tokens=length, min_new_tokens=length, temperature=1.0, top_k=0, top_p=1.0),
        rewards=[RewardSpec(function="posttrain.rewards.builtin:starts_with_answer", isolation="inline")],
        num_generations=args.num_generations,
        kl_coef=0.04,
        kl_estimator="k3",
        loss_agg="token-mean",
        log_completions=0,
        rollout=RolloutConfig(
            engine=args.engine or "auto",
            async_steps=args.async_steps,
            producer_threads=args.producer_threads,
            importance_sampling="token" if args.async_steps else "none",
        ),
        **shared_prefix(args),
    )
    t = time.perf_counter()
    trainer = GRPOTrainer(config)
    init_s = time.perf_counter() - t
    clock.start()
    trainer.train(callbacks=[clock])
    prompt_tokens = len(trainer.tokenizer("10+10=").input_ids)  # every prompt has this many (7 with <bos>, 6 BPE)
    tokens = {
        "completion_tokens_per_step": args.batch_size * length,
        "prompt_tokens_per_step": args.batch_size * prompt_tokens,
    }
    return {"trainer_init_s": init_s, **tokens, "engine": type(trainer.engine).__name__}


def offline(args, out: Path, clock: common.StepClock) -> dict:
    from posttrain.data import DataConfig
    from posttrain.models import ModelConfig

    pairs = common.write_jsonl(common.preference_pairs(args.num_pairs, seed=args.seed), out / "pairs.jsonl")
    run, optim = run_config(args, out, args.batch_size)
    data = DataConfig(path=str(pairs), max_length=66, chat_template="never")
    if args.bench == "dpo":
        from posttrain.trainers.dpo import DPOConfig, train

        config = DPOConfig(
            model=ModelConfig(path=str(Path(args.model_dir) / "policy")),
            data=data,
            optim=optim,
            run=run,
            beta=0.1,
            loss_type="sigmoid",
            reference="copy",
            **shared_prefix(args),
        )
    else:
        from posttrain.trainers.rm import RMConfig, train

        config = RMConfig(
            model=ModelConfig(path=str(Path(args.model_dir) / "reward")),
            data=data,
            optim=optim,
            run=run,
            **shared_prefix(args),
        )
    clock.start()  # loading and tokenising fall into step 1, a warm-up step
    train(config, callbacks=[clock])
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(config.model.path)
    row = common.preference_pairs(1, seed=args.seed)[0]
    # every sequence has the same length: 66 with the character tokenizer (<bos>, <eos>), 65 with BPE (<eos>)
    length = len(tokenizer(row["prompt"] + row["chosen"]).input_ids) + 1
    return {"tokens_per_step": 2 * args.batch_size * length}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bench", choices=["grpo", "dpo", "rm"])
    ap.add_argument("--model-dir", required=True, help="holds policy/ and reward/ (bench/common.py build)")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch-size", type=int, default=None, help="completions (grpo) or pairs per step")
    ap.add_argument("--num-generations", type=int, default=8)
    ap.add_argument("--max-completion-length", type=int, default=32)
    ap.add_argument("--num-prompts", type=int, default=1024)
    ap.add_argument("--num-pairs", type=int, default=1024)
    ap.add_argument("--engine", choices=["hf", "lean"], default=None, help="GRPO rollout engine (default: posttrain's)")
    ap.add_argument("--async-steps", type=int, default=0, help="GRPO rollout.async_steps (token TIS when >= 1)")
    ap.add_argument("--producer-threads", type=int, default=1, help="GRPO rollout.producer_threads")
    ap.add_argument(
        "--shared-prefix", choices=["auto", "true", "false"], default=None, help="default: posttrain's (auto)"
    )
    ap.add_argument("--json-out", default=None)
    ap.add_argument("--output-dir", default=None)
    args = ap.parse_args()
    args.batch_size = args.batch_size or (16 if args.bench == "grpo" else 8)

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    import_s = time.perf_counter() - _T0
    out = Path(args.output_dir or tempfile.mkdtemp(prefix=f"posttrain-bench-{args.bench}-"))
    clock = common.StepClock()
    extra = grpo(args, out, clock) if args.bench == "grpo" else offline(args, out, clock)
    result = {
        "bench": args.bench,
        "library": "posttrain",
        "config": {k: v for k, v in vars(args).items() if k not in ("json_out", "output_dir")},
        **common.summary(clock, args.warmup),
        **extra,
        "import_s": round(import_s, 3),
        "torch_threads": torch.get_num_threads(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }
    line = json.dumps(result)
    if args.json_out:
        Path(args.json_out).write_text(line + "\n")
    print(line, flush=True)


if __name__ == "__main__":
    main()
