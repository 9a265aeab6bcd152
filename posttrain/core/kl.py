"""Per-token KL estimators between the policy π and the reference π_ref on tokens sampled from π.

J. Schulman, "Approximating KL Divergence" (2020), with d = log π(a) − log π_ref(a) and a ~ π:

    k1 = d                     unbiased for KL(π‖π_ref), high variance, can be negative per token
    k2 = d² / 2                biased, low variance, ≥ 0 (its gradient is that of KL in expectation)
    k3 = exp(−d) + d − 1       unbiased for KL(π‖π_ref), low variance, ≥ 0 (DeepSeekMath's choice)

The sign convention is fixed here and nowhere else: a policy that moves away from the reference
makes every estimator's expectation grow, so a positive ``kl_coef`` always pulls it back.
"""

from __future__ import annotations

import torch

from posttrain.core.masks import zero_masked

KL_ESTIMATORS = ("k1", "k2", "k3")


def kl_penalty(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    estimator: str = "k1",
    *,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token estimate of KL(π‖π_ref) (Schulman 2020): k1 = d, k2 = d²/2, k3 = exp(−d) + d − 1.

    logprobs, ref_logprobs: [B, T] log-probabilities of the sampled tokens under π (the policy that
    sampled them) and π_ref. mask: [B, T], 1 = the token counts; where it is 0 the estimate is exactly 0
    whatever the log-probs hold there (garbage at padding must not reach exp: its inf would make the
    gradient NaN). Returns [B, T]. An unknown ``estimator`` raises ``ValueError`` (no silent fall-through).
    """
    if mask is not None:
        logprobs, ref_logprobs = zero_masked(logprobs, mask), zero_masked(ref_logprobs, mask)
    d = logprobs - ref_logprobs
    if estimator == "k1":
        return d
    if estimator == "k2":
        return 0.5 * d.square()
    if estimator == "k3":
        # expm1 keeps exp(−d) − 1 exact near d = 0, where the policies almost agree
        return torch.expm1(-d) + d
    raise ValueError(f"kl estimator must be one of {KL_ESTIMATORS}, got {estimator!r}")


def adaptive_kl_coef(kl_coef: float, kl: float, target: float, horizon: float, n_steps: int) -> float:
    """Adaptive KL controller (Ziegler et al. 2019, §2.2):

        e = clip(KL / KL_target − 1, −0.2, 0.2),      β ← β · (1 + e · n_steps / horizon)

    kl: the observed KL per sequence (mean over the batch); n_steps: sequences in the batch. β grows
    when the policy strays past the target and shrinks when it stays closer.
    """
    error = min(max(kl / target - 1.0, -0.2), 0.2)
    return kl_coef * (1.0 + error * n_steps / horizon)
