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
