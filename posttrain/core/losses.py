"""Losses: the loss aggregation modes, PPO/GRPO clipped policy loss, clipped value loss, DPO, ranking.

Every per-token loss is written separately from its reduction (``aggregate_loss``), because the
reduction is where GRPO variants differ (Dr. GRPO, Liu et al. 2025; DAPO, Yu et al. 2025) and where
micro-batching bugs live (docs/pitfalls.md #1, #2).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from posttrain.core.kl import kl_penalty
from posttrain.core.masks import masked_mean, masked_sum, zero_masked

AGGREGATION_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
DPO_KINDS = ("sigmoid", "ipo", "hinge")


def aggregate_loss(
    per_token: torch.Tensor, mask: torch.Tensor, mode: str = "token-mean", norm_length: int | None = None
) -> torch.Tensor:
    """Reduce a per-token loss [B, T] to a scalar.

        token-mean:               Σ_{b,t} m·x / max(Σ m, 1)                 (DAPO: every token weighs the same)
        seq-mean-token-mean:      mean over rows with ≥1 valid token of Σ_t m·x / Σ_t m   (original GRPO)
        seq-mean-token-sum:       mean over rows with ≥1 valid token of Σ_t m·x
        seq-mean-token-sum-norm:  Σ_{b,t} m·x / (B · L), L = ``norm_length`` or T   (Dr. GRPO: a constant)

    per_token: [B, T]; mask: [B, T], 1 = this token counts. No valid token at all gives 0.
    """
    mask = mask.bool()
    if mode == "token-mean":
        return masked_mean(per_token, mask)
    if mode in ("seq-mean-token-mean", "seq-mean-token-sum"):
        per_row = (
            masked_mean(per_token, mask, dim=-1)
            if mode == "seq-mean-token-mean"
            else masked_sum(per_token, mask, dim=-1)
        )
        return masked_mean(per_row, mask.any(dim=-1))
    if mode == "seq-mean-token-sum-norm":
        length = per_token.shape[-1] if norm_length is None else norm_length
        return masked_sum(per_token, mask) / (per_token.shape[0] * length)
    raise ValueError(f"loss aggregation mode must be one of {AGGREGATION_MODES}, got {mode!r}")


def aggregation_units(mask: torch.Tensor, mode: str = "token-mean") -> torch.Tensor:
    """What ``aggregate_loss(·, mask, mode)`` divides by, counted so that micro-batches add up:

        token-mean: valid tokens;   seq-mean-*: rows with a valid token;   seq-mean-token-sum-norm: rows

    A micro-batch's aggregate times its units, divided by the units of the whole batch, summed over the
    micro-batches, equals the aggregate of the whole batch (for seq-mean-token-sum-norm when every
    micro-batch uses the same ``norm_length``). mask: [B, T]. Returns a scalar (float).
    """
    mask = mask.bool()
    if mode == "token-mean":
        return mask.sum().float()
    if mode in ("seq-mean-token-mean", "seq-mean-token-sum"):
        return mask.any(dim=-1).sum().float()
    if mode == "seq-mean-token-sum-norm":
        return torch.tensor(float(mask.shape[0]), device=mask.device)
    raise ValueError(f"loss aggregation mode must be one of {AGGREGATION_MODES}, got {mode!r}")


def ppo_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float | None = None,
    agg: str = "token-mean",
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    norm_length: int | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate (Schulman et al. 2017, eq. 7), as a loss to minimise, per token:

        ratio_t = exp(logprobs_t − old_logprobs_t)
        ℓ_t = max(−A_t·ratio_t, −A_t·clip(ratio_t, 1 − clip_low, 1 + clip_high))  [+ kl_coef·KL_t]

    ``clip_high`` defaults to ``clip_low``; a larger one is DAPO's clip-higher (Yu et al. 2025).
    With ``ref_logprobs`` the KL term kl_coef·kl_penalty(logprobs, ref_logprobs, kl_estimator) is
    added per token before aggregation, GRPO's KL-in-loss (Shao et al. 2024, eq. 3).

    logprobs: [B, T] under the policy being trained (with grad); old_logprobs: [B, T] under the
    policy that sampled; advantages: [B] (one per response, GRPO) or [B, T] (per token, PPO);
    mask: [B, T], 1 = response token that trains; norm_length: L of ``seq-mean-token-sum-norm``.
    Returns (loss, stats); stats are detached scalars: clipfrac (share of valid tokens on the clipped
    branch), approx_kl (masked mean of k3 between old and new), ratio_mean, ratio_max, ratio_min, pg_loss, and
    kl (masked mean of the KL term) when ``ref_logprobs`` is given.
    """
    mask = mask.bool()
    clip_high = clip_low if clip_high is None else clip_high
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1).expand_as(logprobs)
    # select before exp: exp(garbage) at padding would make the gradient NaN even after masking
    logprobs = zero_masked(logprobs, mask)
    old_logprobs = zero_masked(old_logprobs, mask)
    advantages = zero_masked(advantages, mask)

    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    per_token = torch.maximum(unclipped, clipped)
    pg_loss = aggregate_loss(per_token, mask, agg, norm_length)

    stats = {
        "pg_loss": pg_loss.detach(),
        "clipfrac": masked_mean((clipped > unclipped).to(ratio.dtype), mask).detach(),
        "approx_kl": masked_mean(kl_penalty(logprobs, old_logprobs, "k3"), mask).detach(),
        "ratio_mean": masked_mean(ratio, mask).detach(),
        "ratio_max": torch.where(mask.any(), torch.where(mask, ratio, -torch.inf).max(), 0.0).detach(),
        "ratio_min": torch.where(mask.any(), torch.where(mask, ratio, torch.inf).min(), 0.0).detach(),
    }
    if ref_logprobs is not None:
        kl = kl_penalty(logprobs, zero_masked(ref_logprobs, mask), kl_estimator)
        per_token = per_token + kl_coef * kl
        stats["kl"] = masked_mean(kl, mask).detach()
        return aggregate_loss(per_token, mask, agg, norm_length), stats
    return pg_loss, stats


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    clip_range: float | None = None,
    agg: str = "token-mean",
    norm_length: int | None = None,
) -> torch.Tensor:
    """Clipped value loss (PPO2 baselines; Huang et al., "37 Implementation Details", detail 9):

        ½ · aggregate(max((V − R)², (V_old + clip(V − V_old, −c, c) − R)²))

    and ½ · aggregate((V − R)²) without ``clip_range``.
    values: [B, T] from the critic being trained; old_values: [B, T] at rollout time;
    returns: [B, T] (``gae``); mask: [B, T], 1 = response token; norm_length: L of
    ``seq-mean-token-sum-norm``. Returns a scalar.
    """
    mask = mask.bool()
    values, returns = zero_masked(values, mask), zero_masked(returns, mask)
    per_token = (values - returns).square()
    if clip_range is not None:
        old_values = zero_masked(old_values, mask)
        values_clipped = old_values + torch.clamp(values - old_values, -clip_range, clip_range)
        per_token = torch.maximum(per_token, (values_clipped - returns).square())
    return 0.5 * aggregate_loss(per_token, mask, agg, norm_length)


def dpo_loss(
    policy_chosen_logps: torch.Tensor,
    policy_rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    beta: float = 0.1,
    kind: str = "sigmoid",
    label_smoothing: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Direct Preference Optimization (Rafailov et al. 2023, eq. 7) and two variants, per pair:

        h = (log π(y_w) − log π_ref(y_w)) − (log π(y_l) − log π_ref(y_l))
        sigmoid: −(1 − ε)·log σ(β·h) − ε·log σ(−β·h)     (ε = label_smoothing, cDPO)
        ipo:     (h − 1/(2β))²                            (Azar et al. 2023, eq. 17)
        hinge:   relu(1 − β·h)                            (SLiC, Zhao et al. 2023)

    All inputs [B]: log π(y|x) of the chosen (w) and rejected (l) responses. Both papers use the
    sequence log-likelihood, the sum of the response's token log-probs; TRL's IPO passes their mean
    over the response's tokens instead, which puts the IPO target h = 1/(2β) per token rather than per
    sequence (``posttrain dpo`` takes either: ``ipo_logps``).
    Returns (losses [B], chosen_rewards [B], rejected_rewards [B]); rewards are β·(log π − log π_ref),
    detached.
    """
    h = (policy_chosen_logps - ref_chosen_logps) - (policy_rejected_logps - ref_rejected_logps)
    if kind == "sigmoid":
        losses = -(1 - label_smoothing) * F.logsigmoid(beta * h) - label_smoothing * F.logsigmoid(-beta * h)
    elif kind == "ipo":
        losses = (h - 1 / (2 * beta)).square()
    elif kind == "hinge":
        losses = torch.relu(1 - beta * h)
    else:
        raise ValueError(f"dpo loss kind must be one of {DPO_KINDS}, got {kind!r}")
    chosen_rewards = (beta * (policy_chosen_logps - ref_chosen_logps)).detach()
    rejected_rewards = (beta * (policy_rejected_logps - ref_rejected_logps)).detach()
    return losses, chosen_rewards, rejected_rewards


def ranking_loss(scores: torch.Tensor, margin: float = 0.0) -> torch.Tensor:
    """K-way ranking loss of a reward model (Ouyang et al. 2022, InstructGPT eq. 1):

        loss = mean_b  mean_{i<j}  −log σ(s_i − s_j − margin)

    scores: [B, K], each row's responses ordered best first. K = 2 is the pairwise Bradley–Terry
    loss. Every one of the C(K, 2) pairs of a ranking enters once, so one ranking is one example.
    ``margin`` (Llama 2, Touvron et al. 2023, eq. 2) asks the better response to win by that much.
    """
    if scores.dim() != 2 or scores.shape[1] < 2:
        raise ValueError(f"scores must be [B, K] with K >= 2, got {tuple(scores.shape)}")
    better, worse = ranking_pairs(scores.shape[1], scores.device)
    return -F.logsigmoid(scores[:, better] - scores[:, worse] - margin).mean()


def ranking_pairs(k: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(better, worse) indices of the C(K, 2) ordered pairs i < j of a best-first ranking of K."""
    better, worse = torch.triu_indices(k, k, offset=1, device=device)
    return better, worse
