"""What both sides of the parity check share: the tiny model (``bench/common.py``, the TRL bench's weights), the
fixed GRPO batch and DPO pairs, the seeded weight perturbations, the gradient comparison, and the one patch
float64 needs on TRL's side (``exact_lm_head``).

Nothing here imports TRL at module level: ``run.py`` reports a missing TRL in one line.
"""

from __future__ import annotations

import contextlib
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # bench/, for common.py
import common

# -- the fixed GRPO batch: P = 3 prompts x G = 4 completions, T <= 8 tokens ------------------------------------------

G = 4
MAX_NEW_TOKENS = 8  # T: TRL's max_completion_length, posttrain's sampling.max_new_tokens (Dr. GRPO's constant L)
TEMPERATURE = 0.9  # the sampling temperature both sides divide the logits by
EOS_ID, PAD_ID = 2, 0  # the character tokenizer's <eos> and <pad> (posttrain.models.tiny, the TRL bench's tiny.py)

# completion lengths (tokens, EOS included when the row ends in EOS) and whether it ends in EOS (else: truncated)
LENGTHS = [(3, True), (8, False), (5, True), (1, True), (6, True), (8, False), (2, True), (7, True),
           (4, True), (8, False), (3, True), (5, True)]  # fmt: skip
# rewards exactly representable in float32 (TRL stores rewards in float32): the advantages of both sides start
# from the same numbers. Group 3 is constant: both sides must give it advantages of exactly 0.
REWARDS = [1.0, 0.0, 0.5, 0.25, 2.0, -1.0, 0.75, 0.5, 0.5, 0.5, 0.5, 0.5]


@dataclass
class GRPOBatch:
    """The fixed rollout: prompt texts (one per row, G consecutive rows per prompt), completion token lists."""

    prompts: list[str]
    completions: list[list[int]]
    rewards: list[float]


def grpo_batch(num_prompts: int = 3, seed: int = 0) -> GRPOBatch:
    """The prompts of ``common.arithmetic_prompts`` and completions drawn once from a seeded generator over the
    96 character ids (4..99), of the lengths in ``LENGTHS``: a fixed batch, not a sample of the model."""
    prompts = [row["prompt"] for row in common.arithmetic_prompts(num_prompts, seed=seed)]
    generator = torch.Generator().manual_seed(seed)
    completions = []
    for length, eos in LENGTHS[: num_prompts * G]:
        body = torch.randint(4, 100, (length - int(eos),), generator=generator).tolist()
        completions.append(body + ([EOS_ID] if eos else []))
    return GRPOBatch([p for p in prompts for _ in range(G)], completions, REWARDS[: num_prompts * G])


# -- DPO pairs of different prompt and completion lengths --------------------------------------------------------------


def dpo_pairs(n: int = 4, seed: int = 0) -> list[dict]:
    """``n`` rows {prompt, chosen, rejected} from ``common.preference_pairs``, cut to different lengths so that
    padding and the per-token mean of IPO are exercised."""
    rows = common.preference_pairs(n, seed=seed)
    cuts = [(32, 12, 5), (20, 3, 9), (27, 7, 7), (9, 10, 2)]
    return [
        {"prompt": r["prompt"][-p:], "chosen": r["chosen"][:c], "rejected": r["rejected"][:j]}
        for r, (p, c, j) in zip(rows, cuts * (n // len(cuts) + 1), strict=False)
    ]


# -- models ---------------------------------------------------------------------------------------------------------


def build_model_dir(root: Path) -> Path:
    """``root/policy``: the TRL bench's tiny Llama (hidden 128, 2 layers, seed 0) and its tokenizer."""
    common.build_models(root, "tiny", seed=0)
    return root / "policy"


def load(path: Path, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(dtype)


@torch.no_grad()
def perturb(model, seed: int, scale: float) -> None:
    """Add seeded Gaussian noise of ``scale`` times each parameter's RMS, parameter by parameter in name order:
    the same call on two copies of the same weights gives the same weights."""
    generator = torch.Generator().manual_seed(seed)
    for _, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
        noise = torch.randn(p.shape, generator=generator, dtype=torch.float64)
        rms = p.double().square().mean().sqrt().clamp(min=1e-3)
        p.add_((scale * rms * noise).to(p.dtype))


def weights_equal(a, b) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def grads(model) -> dict[str, torch.Tensor]:
    return {
        n: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)) for n, p in model.named_parameters()
    }


def difference(a: torch.Tensor | float, b: torch.Tensor | float) -> tuple[float, float]:
    """(max |a − b|, that / max |b|): the relative error of the largest entry, not of each entry (a gradient
    entry of 1e-12 carries no information about the agreement)."""
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    diff = (a - b).abs().max().item() if a.numel() else 0.0
    scale = b.abs().max().item() if b.numel() else 0.0
    return diff, (diff / scale if scale > 0 else (0.0 if diff == 0 else math.inf))


def grad_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> tuple[float, float, float]:
    """(max |Δg| over every parameter entry, that / max |g|, max |g|) of two gradient dicts with the same keys."""
    if a.keys() != b.keys():
        raise ValueError(f"parameter names differ: {sorted(a.keys() ^ b.keys())[:4]}")
    diff = max((a[k].double() - b[k].double()).abs().max().item() for k in a)
    scale = max(b[k].double().abs().max().item() for k in b)
    return diff, diff / scale if scale > 0 else math.inf, scale


# -- TRL's LM head in float64 -----------------------------------------------------------------------------------------


class _ExactLogProbs:
    """Stands in for ``trl.kernels.ChunkedLogProbFunction`` (TRL's fused LM head, which keeps its log-sum-exp in
    float32 whatever the model's dtype): the same five outputs, computed plainly in the input dtype, with
    autograd. Only for float64 runs; the float32 runs use TRL's kernel as shipped."""

    @staticmethod
    def apply(hidden, weight, bias, targets, temperature, chunk_size, softcap=None, logit_scale=1.0, outputs=()):
        z = hidden @ weight.t() + (0 if bias is None else bias)
        z = z * logit_scale
        if softcap is not None:
            z = softcap * torch.tanh(z / softcap)
        z = z / temperature
        logp = z.log_softmax(-1)
        picked = logp.gather(-1, targets[:, None]).squeeze(-1)
        entropy = -(logp.exp() * logp).sum(-1) if "entropy" in outputs else None
        sq = torch.logsumexp(2 * logp, -1).detach() if "log_sum_sq_probs" in outputs else None
        mean_logits = z.mean(-1).detach() if "mean_logits" in outputs else None
        is_top1 = (z.argmax(-1) == targets) if "is_top1" in outputs else None
        return picked, entropy, sq, mean_logits, is_top1


@contextlib.contextmanager
def exact_lm_head(enabled: bool):
    """Within: TRL's fused LM head computes in the model's dtype (``_ExactLogProbs``), when ``enabled``."""
    if not enabled:
        yield
        return
    import trl.trainer.utils as trl_utils

    shipped = trl_utils._ChunkedLogProbFunction
    trl_utils._ChunkedLogProbFunction = _ExactLogProbs
    try:
        yield
    finally:
        trl_utils._ChunkedLogProbFunction = shipped


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    """TRL allocates its reward table with the default dtype: float64 runs keep the rewards in float64."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)
