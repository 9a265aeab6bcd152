"""Sampler/trainer mismatch: truncated importance sampling between the rollout engine and the trainer.

An inference engine (vLLM) samples with its own kernels, so its π_sampler differs slightly from the
π_old the training forward computes for the same weights. The PPO ratio π/π_old corrects for the
policy update, not for that gap; truncated importance sampling (TIS, Yao et al. 2025, "Your efficient
RL framework secretly brings you off-policy RL training"; sequence-level as in Liu et al. 2025,
"When speed kills stability") reweights each token's policy-gradient term by π_old/π_sampler, capped.
"""

from __future__ import annotations

import math

import torch

from posttrain.core.masks import masked_sum, zero_masked

IMPORTANCE_LEVELS = ("token", "sequence")


def truncated_importance_weights(
    old_logprobs: torch.Tensor,
    sampler_logprobs: torch.Tensor,
    mask: torch.Tensor,
    level: str = "token",
    cap: float = 2.0,
) -> torch.Tensor:
    """Detached weights w that multiply the policy-gradient term of each token:

        token:     w_t = min(exp(old_logprobs_t − sampler_logprobs_t), cap)
        sequence:  w_t = min(exp(Σ_s m_s·(old_logprobs_s − sampler_logprobs_s)), cap)  for every t of the row

    old_logprobs: [B, T] training forward at the sampling weights; sampler_logprobs: [B, T] the engine's;
    mask: [B, T], 1 = response token. Returns [B, T]; 1 where the mask is 0.
    """
    if level not in IMPORTANCE_LEVELS:
        raise ValueError(f"importance level must be one of {IMPORTANCE_LEVELS}, got {level!r}")
    mask = mask.bool()
    log_ratio = zero_masked(old_logprobs - sampler_logprobs, mask).detach()
    if level == "sequence":
        log_ratio = masked_sum(log_ratio, mask, dim=-1)[:, None].expand_as(log_ratio)
    # clamp in log space: exp of a long sequence's summed log-ratio can overflow before the cap applies
    weights = torch.exp(log_ratio.clamp(max=math.log(cap)))
    return torch.where(mask, weights, 1.0)


def masked_importance_weights(
    old_logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    mask: torch.Tensor,
    level: str = "sequence",
    low: float = 0.5,
    high: float = 2.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked importance sampling: the weight is the ratio itself inside the band [low, high], and the
    token (or the whole sequence) is dropped from the loss outside it, instead of capped:

        token     (IcePop, Ling Team 2025, "Every step evolves: scaling RL for trillion-scale thinking
                   model", Ring-1T):  ρ_t = exp(old_t − behaviour_t), keep_t = low ≤ ρ_t ≤ high
        sequence  (MIS, Liu et al. 2025, "When speed kills stability"):  ρ = exp(Σ_s m_s·(old_s − behaviour_s)),
                   every token of the row kept when low ≤ ρ ≤ high

        w_t = ρ_t (token) or ρ (sequence) where kept, 0 where not.

    old_logprobs: [B, T] the trainer's π_old; behaviour_logprobs: [B, T] the policy that drew the sample (an
    inference engine, or older weights in an asynchronous run); mask: [B, T], 1 = response token.
    Returns (weights [B, T] detached, 1 where the mask is 0; keep [B, T] bool, the mask with dropped tokens
    removed). A ratio far outside the band is where the sample tells the trainer's policy nothing it can use:
    capping it (TIS) still trains on it, masking does not.
    """
    if level not in IMPORTANCE_LEVELS:
        raise ValueError(f"importance level must be one of {IMPORTANCE_LEVELS}, got {level!r}")
    if not 0 <= low <= 1 <= high:
        raise ValueError(f"the importance band must hold 1: 0 <= low <= 1 <= high, got [{low}, {high}]")
    mask = mask.bool()
    log_ratio = zero_masked(old_logprobs - behaviour_logprobs, mask).detach()
    if level == "sequence":
        log_ratio = masked_sum(log_ratio, mask, dim=-1)[:, None].expand_as(log_ratio)
    inside = (log_ratio >= math.log(low) if low > 0 else torch.ones_like(mask)) & (log_ratio <= math.log(high))
    keep = mask & inside
    # exp only inside the band, where it is at most `high`: a long row's summed log-ratio cannot overflow
    weights = torch.where(keep, torch.exp(torch.where(keep, log_ratio, 0.0)), 0.0)
    return torch.where(mask, weights, 1.0), keep


def truncate_logits(scaled: torch.Tensor, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0) -> torch.Tensor:
    """The sampler's truncation of temperature-scaled logits [..., V]: removed tokens get −inf.

    In vLLM's order (min-p, then top-k, then top-p; with min_p = 0 it is transformers' top-k then top-p):
        min-p  keeps v with p_v ≥ min_p · max_u p_u                    (p = softmax(scaled))
        top-k  keeps v with z_v ≥ the k-th largest z (ties kept)       (k = 0: off)
        top-p  keeps the most likely tokens, in order, until the kept mass reaches top_p: v is removed when
               the mass of the tokens less likely than or as likely as v, v included, is ≤ 1 − top_p
               (at least one token always stays; Holtzman et al. 2020, "The curious case of neural text
               degeneration"), measured on the distribution renormalised over what top-k kept.
    """
    if min_p > 0:
        log_p = torch.log_softmax(scaled, dim=-1)
        scaled = scaled.masked_fill(log_p < log_p.amax(dim=-1, keepdim=True) + math.log(min_p), -torch.inf)
    if top_k and top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, top_k, dim=-1).values[..., -1:]
        scaled = scaled.masked_fill(scaled < kth, -torch.inf)
    if top_p < 1.0:
        ascending, order = torch.sort(scaled, dim=-1)
        remove = ascending.softmax(dim=-1).cumsum(dim=-1) <= 1 - top_p
        remove[..., -1] = False
        scaled = scaled.masked_fill(remove.scatter(-1, order, remove), -torch.inf)
    return scaled


def truncated_logprobs(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
) -> torch.Tensor:
    """log μ(y) of the distribution a sampler with top-k / top-p / min-p draws from, renormalised over the
    tokens it keeps (K, ``truncate_logits``):

        μ(y) = softmax(z/τ)_y / Σ_{v ∈ K} softmax(z/τ)_v  for y ∈ K, 0 otherwise
        log μ(y) = z_y/τ − logsumexp_{v ∈ K}(z_v/τ)

    The importance weight of a token against the sampled distribution is then π(y)/μ(y) = Σ_{v∈K} π(v) at
    equal weights: the mass the truncation kept (TRL's correction with vLLM's processed log-probs).

    logits: [..., V] raw logits; tokens: [...] integer ids. Returns [...] float32 (−inf for a token outside K).
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    kept = truncate_logits(logits.float() / temperature, top_k, top_p, min_p)
    return torch.log_softmax(kept, dim=-1).gather(-1, tokens[..., None])[..., 0]
