"""Entropy control by token selection: which response tokens get the policy gradient, and which a penalty.

Two papers, three methods, one shape: a statistic of every valid token of a step's batch, computed once,
picks tokens; the per-token policy loss is then kept, dropped or penalised there (``selected_policy_loss``)
and reduced by ``aggregate_loss`` over the unchanged response mask, so the loss keeps its normaliser.

- high_entropy (Wang et al. 2025, "Beyond the 80/20 Rule: High-Entropy Minority Tokens Drive Effective
  Reinforcement Learning for LLM Reasoning", arXiv:2506.01939, the objective J_HighEnt): only the top ρ
  of the batch's tokens by the sampling policy's entropy keep their policy gradient.
- Clip-Cov and KL-Cov (Cui et al. 2025, "The Entropy Mechanism of Reinforcement Learning for Reasoning
  Language Models", arXiv:2505.22617, the losses L_Clip-Cov and L_KL-Cov): the centred covariance of each
  token's log-prob and advantage drives the entropy change; Clip-Cov detaches the gradient of a few random
  tokens whose covariance lies in a band, KL-Cov adds β·|log π_θ − log π_old| on the tokens of largest
  covariance.

Where this departs from the papers' code: the statistics (the entropy threshold, the covariance's means,
the top-k) are over the whole step's batch, on every process, not per micro-batch; the covariance uses
π_old's log-probs (those of the first update), because the selection is made once per step, before any
update. Shapes: B rows, T response tokens; a mask's 1 means the token counts.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from posttrain.core.masks import masked_mean, zero_masked

ENTROPY_CONTROLS = ("none", "high_entropy", "clip_cov", "kl_cov")


class TokenSelection(NamedTuple):
    """The tokens an entropy control picked, [B, T] bool each."""

    selected: torch.Tensor
    """1 = the token's policy-gradient term trains (high_entropy: the top ρ; clip_cov: all but the drawn)."""
    penalised: torch.Tensor
    """1 = KL-Cov's penalty β·|log π_θ − log π_old| applies to the token."""

    def rows(self, index) -> TokenSelection:
        """The selection of rows ``index`` (a slice, a list of rows or a [B] mask)."""
        return TokenSelection(self.selected[index], self.penalised[index])


def _count(fraction: float, n: torch.Tensor, round_up: bool) -> torch.Tensor:
    """⌈fraction·n⌉ (``round_up``) or ⌊fraction·n⌋, at least 1, as a tensor; a product within 1e-6 of an
    integer counts as that integer (0.1·30 is 3.0000000000000004 in floating point)."""
    product = fraction * n.double()
    rounded = torch.ceil(product - 1e-6) if round_up else torch.floor(product + 1e-6)
    return rounded.clamp(min=1)


def high_entropy_mask(entropy: torch.Tensor, mask: torch.Tensor, ratio: float = 0.2) -> torch.Tensor:
    """The high-entropy minority of Wang et al. 2025 (arXiv:2506.01939, objective J_HighEnt):

        selected_t = 𝕀[H_t ≥ τ_ρ],   τ_ρ = the k-th largest H over the N valid tokens,  k = ⌈ρ·N⌉

    H_t is the entropy of the sampling policy at token t. Every token tied with τ_ρ is selected (the paper's
    indicator is ≥), so ties are kept alike whatever the order of the rows, and the selected share can
    exceed ρ by the ties. ρ = 1 selects every valid token.

    entropy: [B, T]; mask: [B, T], 1 = a valid response token; ratio: ρ in (0, 1] (0.2 in the paper).
    Returns selected [B, T] bool, False where the mask is 0.
    """
    valid = mask.bool()
    values = torch.where(valid, entropy, -torch.inf).flatten()
    k = _count(ratio, valid.sum(), round_up=True).long()
    threshold = torch.sort(values, descending=True).values[k - 1]  # −inf when no token is valid
    return valid & (torch.where(valid, entropy, -torch.inf) >= threshold)


def token_covariance(logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Cui et al. 2025 (arXiv:2505.22617), the per-token centred covariance of log-prob and advantage:

        Cov_t = (log π(y_t) − (1/N) Σ_j log π(y_j)) · (A_t − (1/N) Σ_j A_j)

    over the N valid tokens j of the batch. Its mean over the tokens is the batch covariance that drives
    the entropy change; a token with large Cov_t is a likely action with a large advantage (or an unlikely
    one with a negative advantage), whose update lowers the entropy most.

    logprobs: [B, T] (detached: the selection takes no gradient); advantages: [B] (one per response) or
    [B, T]; mask: [B, T], 1 = valid. Returns Cov [B, T], 0 where the mask is 0.
    """
    if advantages.dim() == 1:
        advantages = advantages[:, None].expand_as(logprobs)
    valid = mask.bool()
    logprobs, advantages = zero_masked(logprobs, valid), zero_masked(advantages, valid)
    centred = (logprobs - masked_mean(logprobs, valid)) * (advantages - masked_mean(advantages, valid))
    return zero_masked(centred, valid)


def clip_cov_mask(
    covariance: torch.Tensor,
    mask: torch.Tensor,
    ratio: float = 2e-4,
    low: float = 1.0,
    high: float = 5.0,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Clip-Cov (Cui et al. 2025, arXiv:2505.22617, L_Clip-Cov): detach the gradient of n tokens drawn
    uniformly without replacement from those whose covariance lies in the band [ω_low, ω_high]:

        I_clip ~ Uniform{t : ω_low ≤ Cov_t ≤ ω_high},  |I_clip| = min(n, candidates),  n = max(1, ⌊r·N⌋)
        selected_t = valid_t ∧ t ∉ I_clip

    n is at least 1, as in the authors' code (the paper's ⌊r·N⌋ is 0 for batches under 1/r tokens, which
    would make Clip-Cov a no-op there). The draw enumerates the candidates in row-major order and permutes
    them with ``generator`` (a CPU generator): the same generator state and batch give the same tokens.

    covariance: [B, T] (``token_covariance``); mask: [B, T], 1 = valid; ratio r (2e-4 in the paper);
    low, high: ω_low, ω_high (1 and 5). Returns selected [B, T] bool (False where detached or invalid).
    """
    valid = mask.bool()
    band = valid & (covariance >= low) & (covariance <= high)
    candidates = band.flatten().nonzero().flatten()
    count = int(_count(ratio, valid.sum(), round_up=False))
    order = torch.randperm(len(candidates), generator=generator)[:count].to(candidates.device)
    detached = torch.zeros(band.numel(), dtype=torch.bool, device=band.device)
    detached[candidates[order]] = True
    return valid & ~detached.view_as(band)


def kl_cov_mask(covariance: torch.Tensor, mask: torch.Tensor, ratio: float = 2e-3) -> torch.Tensor:
    """KL-Cov (Cui et al. 2025, arXiv:2505.22617, L_KL-Cov): the k tokens of largest covariance get a KL
    penalty,

        I_KL = {t : rank(Cov_t) ≤ k},   k = max(1, ⌊ratio·N⌋)

    ranked in descending order over the N valid tokens; ties are ranked by position (row-major: the
    earlier token first), so the choice is the same on every run. ratio: the paper's k, 2e-3 for
    Qwen2.5-7B and 2e-4 for Qwen2.5-32B.

    covariance, mask: [B, T]. Returns penalised [B, T] bool, False where the mask is 0.
    """
    valid = mask.bool().flatten()
    values = torch.where(valid, covariance.flatten(), -torch.inf)
    order = torch.sort(values, descending=True, stable=True).indices
    rank = torch.empty_like(order)
    rank[order] = torch.arange(len(order), device=order.device)
    k = _count(ratio, valid.sum(), round_up=False)
    return (valid & (rank < k)).view_as(covariance)


def selected_policy_loss(
    per_token: torch.Tensor,
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    selection: TokenSelection,
    kl_cov_coef: float = 1.0,
) -> torch.Tensor:
    """The per-token policy loss ℓ_t (PPO-clipped, CISPO, ...) under a token selection:

        ℓ'_t = 𝕀[t selected] · ℓ_t + β · 𝕀[t penalised] · |log π_θ(y_t) − log π_old(y_t)|

    An unselected token's term is 0, value and gradient (high_entropy's 𝕀[H ≥ τ]; Clip-Cov's detach); the
    caller still reduces ℓ' over the whole response mask, so the normaliser is that of the unselected loss
    (J_HighEnt divides by all Σ|o_i| tokens). β = ``kl_cov_coef`` (1 in the authors' code). The penalty is 0,
    with a 0 gradient, while π_θ = π_old: KL-Cov acts from a rollout's second update on.

    per_token, logprobs (with grad), old_logprobs: [B, T]; selection: masks [B, T]. Returns ℓ' [B, T].
    """
    penalty = torch.where(selection.penalised, (logprobs - old_logprobs).abs(), 0.0)
    return torch.where(selection.selected, per_token, 0.0) + kl_cov_coef * penalty
