"""Losses: the loss aggregation modes, the policy losses (PPO/GRPO clipped, GSPO, CISPO, GMPO, SAPO), clipped
value loss, DPO and the other offline preference losses (SimPO, ORPO, KTO), ranking.

Every per-token loss is written separately from its reduction (``aggregate_loss``), because the
reduction is where GRPO variants differ (Dr. GRPO, Liu et al. 2025; DAPO, Yu et al. 2025) and where
micro-batching bugs live (docs/pitfalls.md #1, #2).
"""

from __future__ import annotations

import functools
import math

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
    *,
    clip_low: float = 0.2,
    clip_high: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate (Schulman et al. 2017, eq. 7), as a loss to minimise, per token:

        ratio_t = exp(logprobs_t − old_logprobs_t)
        ℓ_t = max(−A_t·ratio_t, −A_t·clip(ratio_t, 1 − clip_low, 1 + clip_high))

    ``clip_high`` defaults to ``clip_low``; a larger one is DAPO's clip-higher (Yu et al. 2025). The
    trainer adds its other terms per token (GRPO's β·KL, DeepSeekMath eq. 3) and reduces the sum with
    ``aggregate_loss``: the reduction is where the variants differ, so it stays in sight.

    logprobs: [B, T] under the policy being trained (with grad); old_logprobs: [B, T] under the
    policy that sampled; advantages: [B] (one per response, GRPO) or [B, T] (per token, PPO);
    mask: [B, T], 1 = response token that trains.
    Returns (ℓ [B, T], exactly 0 where the mask is 0; stats), stats detached scalars: clipfrac (share of
    valid tokens on the clipped branch), approx_kl (k3 estimate of KL(π_old‖π_θ) on the tokens π_old
    sampled), ratio_mean, ratio_max, ratio_min.
    """
    mask, logprobs, old_logprobs, advantages = _policy_inputs(logprobs, old_logprobs, advantages, mask)
    ratio = torch.exp(logprobs - old_logprobs)
    per_token, clipped = _clipped_surrogate(ratio, advantages, clip_low, clip_high)
    return per_token, _ratio_stats(ratio, clipped, logprobs, old_logprobs, mask)


def gspo_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float = 3e-4,
    clip_high: float | None = 4e-4,
    token_level: bool = False,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO, Group Sequence Policy Optimization (Zheng et al. 2025, arXiv:2507.18071), and its GSPO-token
    variant: one importance ratio per response, the geometric mean of its token ratios, clipped per response:

        s_i = exp( (1/|y_i|) Σ_t m_{i,t}·(logprobs_{i,t} − old_logprobs_{i,t}) )        |y_i| = Σ_t m_{i,t}
        GSPO:        ℓ_{i,t} = max(−A_i·s_i, −A_i·clip(s_i, 1 − clip_low, 1 + clip_high))
        GSPO-token:  s_{i,t} = sg[s_i]·π_θ(y_{i,t}) / sg[π_θ(y_{i,t})]  in place of s_i, A_{i,t} in place of A_i

    ``token_level=False`` is GSPO: every valid token of row i holds the row's term, so
    ``aggregate_loss(ℓ, mask, "seq-mean-token-mean")`` gives the paper's (1/G) Σ_i min(s_i·A_i, clip(s_i)·A_i)
    and its gradient −A_i·s_i/|y_i| on each token's log-prob; the other modes weigh row i by its |y_i| tokens.
    ``token_level=True`` is GSPO-token: the same value, the gradient through each token's own log-prob
    (∂s_{i,t}/∂logπ_θ(y_{i,t}) = s_i), so per-token advantages [B, T] may enter; with [B] advantages its
    gradient equals GSPO's. A row is clipped whole, so a token is on the clipped branch when its row is
    (for GSPO-token with [B, T] advantages, when the sign of its A_{i,t} puts it there).

    Shapes as in ``ppo_policy_loss``; ``clip_high`` None = ``clip_low``; the defaults 3e-4 / 4e-4 are the
    paper's (§5.1). Returns (ℓ [B, T], 0 where the mask is 0; stats): clipfrac is the share of valid tokens
    on the clipped branch (the paper's "fraction of clipped tokens"); ratio_mean/max/min are over valid
    tokens of the ratio the loss uses (s_i repeated on each of the row's tokens); approx_kl as in
    ``ppo_policy_loss``.
    """
    mask, logprobs, old_logprobs, advantages = _policy_inputs(logprobs, old_logprobs, advantages, mask)
    seq_log_ratio = masked_mean(logprobs - old_logprobs, mask, dim=-1)[:, None]  # [B, 1]; 0 for an empty row
    if token_level:  # value of s_i, gradient of each token's own log-prob
        log_ratio = seq_log_ratio.detach() + logprobs - logprobs.detach()
    else:
        log_ratio = seq_log_ratio.expand_as(logprobs)
    ratio = torch.exp(log_ratio)
    per_token, clipped = _clipped_surrogate(ratio, advantages, clip_low, clip_high)
    return per_token, _ratio_stats(ratio, clipped, logprobs, old_logprobs, mask)


def cispo_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float = 1.0,
    clip_high: float | None = 0.28,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """CISPO, Clipped IS-weight Policy Optimization (MiniMax 2025, "MiniMax-M1", arXiv:2506.13585): the
    importance weight is clipped and detached, the update never is:

        r_t = exp(logprobs_t − old_logprobs_t)
        ℓ_t = −sg(clip(r_t, 1 − clip_low, 1 + clip_high))·A_t·logprobs_t

    Every valid token keeps its gradient −sg(ŵ_t)·A_t on its log-prob, a clipped one included (PPO's
    clip sets the gradient of a token on the clipped branch to 0). ``clip_low`` ≥ 1 puts no lower bound on
    the weight (r_t > 0), as MiniMax did; ``clip_high`` None = ``clip_low``. The value of ℓ is REINFORCE's
    −A·log π scaled by the weight, not a ratio surrogate: it moves with log π, only its gradient matters.

    Shapes as in ``ppo_policy_loss``. Returns (ℓ [B, T], 0 where the mask is 0; stats): clipfrac is the
    share of valid tokens whose weight was clipped (they still train, with the clipped weight);
    ratio_mean/max/min are over valid tokens of the unclipped r_t; approx_kl as in ``ppo_policy_loss``.
    """
    mask, logprobs, old_logprobs, advantages = _policy_inputs(logprobs, old_logprobs, advantages, mask)
    ratio = torch.exp(logprobs - old_logprobs)
    weight = _clip_ratio(ratio, clip_low, clip_high).detach()
    per_token = -weight * advantages * logprobs
    return per_token, _ratio_stats(ratio, weight != ratio, logprobs, old_logprobs, mask)


def gmpo_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float = 0.4,
    clip_high: float | None = 0.4,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GMPO, Geometric-Mean Policy Optimization (Zhao et al. 2025, arXiv:2507.20673): GRPO's arithmetic
    mean of the token terms ρ_{i,t}·A_i replaced by their geometric mean, each token's ratio clipped first, in
    log space, on the side the sign of A_i picks (PPO's trust region, per token, before the mean):

        x_{i,t} = logprobs_{i,t} − old_logprobs_{i,t}                            (log ρ_{i,t})
        c_{i,t} = min(x_{i,t}, clip(x_{i,t}, −clip_low, clip_high))   if A_i ≥ 0   (capped above)
                  max(x_{i,t}, clip(x_{i,t}, −clip_low, clip_high))   if A_i < 0   (floored below)
        g_i = exp( (1/|y_i|) Σ_t m_{i,t}·c_{i,t} )        the geometric mean of the clipped token ratios
        ℓ_{i,t} = −A_i·g_i        on every valid token of row i;   |y_i| = Σ_t m_{i,t}

    As GSPO's, the row's term sits on each of its valid tokens, so ``aggregate_loss(ℓ, mask,
    "seq-mean-token-mean")`` is the paper's −(1/G) Σ_i g_i·A_i. Its gradient is the paper's weighted policy
    gradient: −A_i·g_i/|y_i| on the log-prob of each token of row i whose ratio is inside its bound, 0 on a
    clipped token alone (GSPO drops the whole response; GRPO weighs a token by its own ρ_{i,t}, GMPO by the
    response's g_i). The clip range is in log space: ratios in [e^−clip_low, e^clip_high]; the defaults 0.4 /
    0.4 are the paper's (e^−0.4, e^0.4) (§4); ``clip_high`` None = ``clip_low``.

    Shapes as in ``ppo_policy_loss``. The paper's advantage is one per response: [B] advantages are that;
    [B, T] ones are reduced to their mean over the row's valid tokens (equal to A_i when constant along the
    row; the trainers refuse per-token advantages for gmpo). Returns (ℓ [B, T], 0 where the mask is 0; stats):
    clipfrac is the share of valid tokens whose log-ratio was clipped (none in a row of A_i = 0); ratio_mean/
    max/min are over valid tokens of the unclipped token ratio ρ_{i,t} (the range the paper shows GMPO keeps
    narrow); approx_kl as in ``ppo_policy_loss``.
    """
    mask, logprobs, old_logprobs, advantages = _policy_inputs(logprobs, old_logprobs, advantages, mask)
    row_advantage = masked_mean(advantages, mask, dim=-1)  # [B]: A_i; 0 for an empty row
    log_ratio = logprobs - old_logprobs
    bounded = log_ratio.clamp(-clip_low, clip_low if clip_high is None else clip_high)
    positive = (row_advantage >= 0)[:, None]
    clipped_log_ratio = torch.where(positive, torch.minimum(log_ratio, bounded), torch.maximum(log_ratio, bounded))
    geometric_mean = torch.exp(masked_mean(clipped_log_ratio, mask, dim=-1))  # [B]: g_i
    per_token = torch.where(mask, -(row_advantage * geometric_mean)[:, None], 0.0)
    # a row of A_i = 0 has the term 0 whatever its ratios: unclipped, as in verl's sgn(A_i) form
    clipped = (clipped_log_ratio != log_ratio) & (row_advantage != 0)[:, None]
    return per_token, _ratio_stats(torch.exp(log_ratio), clipped, logprobs, old_logprobs, mask)


def sapo_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """SAPO, Soft Adaptive Policy Optimization (Gao et al. 2025, Qwen team, arXiv:2511.20347): PPO's hard
    clip replaced by a smooth gate of the token ratio, with one temperature for positive advantages and a
    larger one, closing faster, for the others:

        r_t = exp(logprobs_t − old_logprobs_t);   τ_t = τ_pos if A_t > 0 else τ_neg
        f(r_t) = (4/τ_t)·σ(τ_t·(r_t − 1))          σ the logistic sigmoid
        ℓ_t = −f(r_t)·A_t

    Its gradient on log π_θ(y_t) is −w_t·r_t·A_t with w_t = 4·p_t·(1 − p_t), p_t = σ(τ_t·(r_t − 1)) (the
    paper's gradient form): w = 1 at r = 1, so on-policy SAPO is the plain policy gradient −A_t (GRPO's too),
    and the weight falls smoothly, never to 0, as r_t leaves 1, where PPO's clip cuts a token's gradient to 0 at
    a hard edge. The 4/τ makes the gate's slope at r = 1 equal to 1 for any τ. Defaults τ_pos = 1.0, τ_neg = 1.05
    are the paper's (τ_neg > τ_pos: a negative advantage raises the logits of many unsampled tokens, so its
    off-policy updates are damped sooner). Every token has its own gate, so [B, T] advantages (PPO's GAE) fit.

    Shapes as in ``ppo_policy_loss``. Returns (ℓ [B, T], 0 where the mask is 0; stats): clipfrac is 0 (nothing
    is clipped); gate_weight_mean and gate_weight_min are the mean and least w_t over valid tokens (1 on-policy:
    how much the gate damped the update); ratio_mean/max/min of r_t and approx_kl as in ``ppo_policy_loss``.
    """
    mask, logprobs, old_logprobs, advantages = _policy_inputs(logprobs, old_logprobs, advantages, mask)
    ratio = torch.exp(logprobs - old_logprobs)
    tau = torch.where(advantages > 0, ratio.new_tensor(tau_pos), ratio.new_tensor(tau_neg))  # in ratio's dtype
    gate = torch.sigmoid(tau * (ratio - 1))  # p_t
    per_token = -(4 / tau) * gate * advantages
    stats = _ratio_stats(ratio, torch.zeros_like(mask), logprobs, old_logprobs, mask)
    weight = (4 * gate * (1 - gate)).detach()  # w_t
    stats["gate_weight_mean"] = masked_mean(weight, mask)
    stats["gate_weight_min"] = torch.where(mask.any(), torch.where(mask, weight, torch.inf).min(), 0.0)
    return per_token, stats


POLICY_LOSSES = {
    "ppo": ppo_policy_loss,
    "gspo": gspo_policy_loss,
    "gspo-token": functools.partial(gspo_policy_loss, token_level=True),
    "cispo": cispo_policy_loss,
    "gmpo": gmpo_policy_loss,
    "sapo": sapo_policy_loss,
}
"""The policy losses a trainer chooses from by name (``policy_loss``), all with ``ppo_policy_loss``'s
positional arguments and return: the per-token loss [B, T] and its statistics. Their keyword knobs are
``policy_loss_knobs``'s."""


def policy_loss_knobs(
    name: str, *, clip_low: float, clip_high: float | None, tau_pos: float, tau_neg: float
) -> dict[str, float | None]:
    """The keyword arguments of ``POLICY_LOSSES[name]``: SAPO's two temperatures (its gate has no clip range),
    every other loss's clip range (GMPO's in log space)."""
    if name == "sapo":
        return {"tau_pos": tau_pos, "tau_neg": tau_neg}
    return {"clip_low": clip_low, "clip_high": clip_high}


def _policy_inputs(logprobs, old_logprobs, advantages, mask):
    """(mask as bool, logprobs, old_logprobs, advantages [B, T]) with exact 0 where the mask is 0:
    selected before exp, because exp(garbage) at padding makes the gradient NaN even after masking."""
    mask = mask.bool()
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1).expand_as(logprobs)
    return mask, zero_masked(logprobs, mask), zero_masked(old_logprobs, mask), zero_masked(advantages, mask)


def _clipped_surrogate(ratio, advantages, clip_low: float, clip_high: float | None) -> tuple[torch.Tensor, ...]:
    """PPO's clipped surrogate of a ratio, per token, as a loss (Schulman et al. 2017, eq. 7):
    (ℓ_t = max(−A_t·r_t, −A_t·clip(r_t, 1 − clip_low, 1 + clip_high)) [B, T], on the clipped branch [B, T] bool).
    One function for PPO's token ratio and GSPO's sequence ratio."""
    unclipped = -advantages * ratio
    clipped = -advantages * _clip_ratio(ratio, clip_low, clip_high)
    return torch.maximum(unclipped, clipped), clipped > unclipped


def _clip_ratio(ratio: torch.Tensor, clip_low: float, clip_high: float | None) -> torch.Tensor:
    """clip(r, 1 − clip_low, 1 + clip_high), ``clip_high`` None = ``clip_low``: the trust region of PPO's and
    GSPO's ratio and of CISPO's weight."""
    return torch.clamp(ratio, 1.0 - clip_low, 1.0 + (clip_low if clip_high is None else clip_high))


def _ratio_stats(ratio, clipped, logprobs, old_logprobs, mask) -> dict[str, torch.Tensor]:
    """clipfrac (share of valid tokens where ``clipped``), approx_kl, the ratio's masked mean, max and min
    (0 without a valid token); detached scalars.

    approx_kl is k3 = r − 1 − log r (r = π_θ/π_old) with ``kl_penalty``'s arguments in its documented order,
    the sampling policy first: the tokens were drawn from π_old, so it estimates KL(π_old‖π_θ) without bias
    (Schulman 2020; CleanRL's ``approx_kl``)."""
    return {
        "clipfrac": masked_mean(clipped.to(ratio.dtype), mask).detach(),
        "approx_kl": masked_mean(kl_penalty(old_logprobs, logprobs, "k3"), mask).detach(),
        "ratio_mean": masked_mean(ratio, mask).detach(),
        "ratio_max": torch.where(mask.any(), torch.where(mask, ratio, -torch.inf).max(), 0.0).detach(),
        "ratio_min": torch.where(mask.any(), torch.where(mask, ratio, torch.inf).min(), 0.0).detach(),
    }


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_range: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped value loss (PPO2 baselines; Huang et al., "37 Implementation Details", detail 9), per token:

        ℓ_t = ½ · max((V_t − R_t)², (V_old,t + clip(V_t − V_old,t, −c, c) − R_t)²)

    and ½ · (V_t − R_t)² without ``clip_range``; the trainer reduces it with ``aggregate_loss``.
    values: [B, T] from the critic being trained; old_values: [B, T] at rollout time;
    returns: [B, T] (``gae``); mask: [B, T], 1 = response token.
    Returns (ℓ [B, T], 0 where the mask is 0; stats): value_clipfrac, the share of valid tokens whose value
    moved more than c from V_old (0 without ``clip_range``), a detached scalar.
    """
    mask = mask.bool()
    values, returns = zero_masked(values, mask), zero_masked(returns, mask)
    per_token = (values - returns).square()
    clipped = torch.zeros_like(mask)
    if clip_range is not None:
        old_values = zero_masked(old_values, mask)
        values_clipped = old_values + torch.clamp(values - old_values, -clip_range, clip_range)
        per_token = torch.maximum(per_token, (values_clipped - returns).square())
        clipped = (values - old_values).abs() > clip_range
    return 0.5 * per_token, {"value_clipfrac": masked_mean(clipped.float(), mask).detach()}


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


def simpo_loss(
    chosen_avg_logps: torch.Tensor,
    rejected_avg_logps: torch.Tensor,
    beta: float = 2.0,
    gamma: float = 0.5,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """SimPO (Meng, Xia and Chen 2024, "SimPO: Simple Preference Optimization with a Reference-Free
    Reward", arXiv:2405.14734, eqs. 4 and 6), per pair, with no reference model:

        r(x, y) = (β/|y|)·log π(y|x) = β·(1/|y|)·Σ_{t ∈ y} log π(y_t | x, y_<t)
        ℓ = −log σ(r(x, y_w) − r(x, y_l) − γ)

    chosen_avg_logps, rejected_avg_logps: [B], log π(y|x)/|y|, the mean of the response's token log-probs
    (response tokens only). γ (``gamma``) is the target margin in reward units, as in eq. 6; the SimPO
    code's ``gamma_beta_ratio`` is γ/β (γ = gamma_beta_ratio·β). With γ = 0 and equal average
    log-likelihoods the loss is log 2.
    Returns (losses [B], chosen_rewards [B], rejected_rewards [B]); rewards are r(x, y), detached.
    """
    chosen_rewards = beta * chosen_avg_logps
    rejected_rewards = beta * rejected_avg_logps
    losses = -F.logsigmoid(chosen_rewards - rejected_rewards - gamma)
    return losses, chosen_rewards.detach(), rejected_rewards.detach()


def log_odds(avg_logps: torch.Tensor) -> torch.Tensor:
    """log odds(y|x) = log P − log(1 − P) of a probability given as its log, log P ≤ 0; any shape.

    log(1 − P) = log1mexp(log P), computed as log(−expm1(log P)) for log P > −log 2 and as
    log1p(−exp(log P)) below (Mächler 2012, "Accurately Computing log(1 − exp(−|a|))"): each form is
    exact where the other loses digits. log P is capped at −ε (ε = the dtype's machine epsilon), where
    1 − P stops being resolved: P = 1 would make the log odds +inf and its gradient NaN; the cap bounds
    them by log(1/ε) (15.9 in float32) and leaves every P < 1 − ε unchanged.
    """
    log_p = avg_logps.clamp(max=-torch.finfo(avg_logps.dtype).eps)
    near_one = log_p > -math.log(2)
    # each branch evaluated only where it is the one selected: the other's inf would poison the gradient
    log_1mp = torch.where(
        near_one,
        torch.log(-torch.expm1(torch.where(near_one, log_p, -1.0))),
        torch.log1p(-torch.exp(torch.where(near_one, -1.0, log_p))),
    )
    return log_p - log_1mp


def orpo_loss(
    chosen_avg_logps: torch.Tensor, rejected_avg_logps: torch.Tensor, lam: float = 0.1
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ORPO (Hong, Lee and Thorne 2024, "ORPO: Monolithic Preference Optimization without Reference
    Model", arXiv:2403.07691, eqs. 2–7), per pair, with no reference model:

        log P(y|x) = (1/|y|)·Σ_{t ∈ y} log π(y_t | x, y_<t)         (the paper's length-normalised likelihood)
        odds(y|x) = P(y|x) / (1 − P(y|x))
        ℓ = −log P(y_w|x) + λ·(−log σ(log odds(y_w|x) − log odds(y_l|x)))

    The first term is the SFT loss L_SFT on the chosen response (its token NLL averaged over its tokens),
    the second λ·L_OR. chosen_avg_logps, rejected_avg_logps: [B], log P(y|x) (response tokens only).
    Log odds come from ``log_odds`` (stable near P = 0 and P = 1). ``lam`` is λ (0.1 in the paper).
    Returns (losses [B], chosen_log_odds [B], rejected_log_odds [B]); the log odds detached.
    """
    chosen_log_odds, rejected_log_odds = log_odds(chosen_avg_logps), log_odds(rejected_avg_logps)
    odds_ratio_loss = -F.logsigmoid(chosen_log_odds - rejected_log_odds)
    losses = -chosen_avg_logps + lam * odds_ratio_loss
    return losses, chosen_log_odds.detach(), rejected_log_odds.detach()


def kto_reference_point(kl_logratio_sum: torch.Tensor, count: float) -> torch.Tensor:
    """KTO's reference point z0 (Ethayarajh et al. 2024, "KTO: Model Alignment as Prospect Theoretic
    Optimization", arXiv:2402.01306, §4.1), estimated as the paper and TRL do:

        z0 = max(0, (1/m)·Σ_{i=1..m} [log π(y'_i|x_i) − log π_ref(y'_i|x_i)])

    over m mismatched pairs (x_i, y'_i), each prompt with the completion of another example, so that y'
    is drawn from the data independently of x_i: a biased estimate of KL(π(y'|x) ‖ π_ref(y'|x)),
    clamped at 0 and not back-propagated through (detached), as in the paper.
    kl_logratio_sum: a scalar tensor, the sum over the m pairs (the caller sums micro-batches and
    processes); count: m. Returns z0, a detached scalar (0 when m = 0).
    """
    return torch.clamp(kl_logratio_sum.detach() / max(float(count), 1.0), min=0.0)


def kto_loss(
    policy_logps: torch.Tensor,
    ref_logps: torch.Tensor,
    desirable: torch.Tensor,
    reference_point: torch.Tensor | float,
    beta: float = 0.1,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Kahneman–Tversky Optimization (Ethayarajh et al. 2024, arXiv:2402.01306, eq. 8), per example:

        r = log π(y|x) − log π_ref(y|x)
        desirable y:    ℓ = λ_D·(1 − σ(β·(r − z0)))
        undesirable y:  ℓ = λ_U·(1 − σ(β·(z0 − r)))

    i.e. λ_y − v(x, y) with the paper's value function v. policy_logps, ref_logps: [B], log π(y|x)
    summed over the completion tokens; desirable: [B] bool, True for a desirable completion;
    reference_point: z0 (``kto_reference_point``), a detached scalar. ``desirable_weight`` is λ_D,
    ``undesirable_weight`` λ_U. With π = π_ref and z0 = 0 every loss is λ_y/2.
    Returns (losses [B], rewards [B]); rewards are β·r, detached.
    """
    logratios = policy_logps - ref_logps
    z0 = torch.as_tensor(reference_point, dtype=logratios.dtype, device=logratios.device).detach()
    desirable = desirable.bool()
    losses = torch.where(
        desirable,
        desirable_weight * (1 - torch.sigmoid(beta * (logratios - z0))),
        undesirable_weight * (1 - torch.sigmoid(beta * (z0 - logratios))),
    )
    return losses, (beta * logratios).detach()


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
