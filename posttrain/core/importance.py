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
