"""Masked reductions.

Every reduction selects valid positions with ``torch.where`` (never ``values * mask``) because
``NaN * 0 = NaN``: padding may hold NaN or inf and must change neither the result nor the gradient.
"""

from __future__ import annotations

import torch


def zero_masked(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``values`` where ``mask`` is 1, exactly 0 elsewhere (gradient 0 there, even if ``values`` is NaN).

    values: any shape; mask: broadcastable to it, 1 = keep.
    """
    return torch.where(mask.bool(), values, 0.0)


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Σ values·mask over ``dim`` (all dimensions when None), garbage-safe."""
    selected = zero_masked(values, mask)
    return selected.sum() if dim is None else selected.sum(dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """sum(values·mask) / max(sum(mask), 1) over ``dim`` (all dimensions when None).

    values: [B, T] (any shape); mask: same shape, 1 = this position counts.
    A row (or batch) without valid positions gives 0, never NaN.
    """
    mask = mask.bool()
    count = mask.sum() if dim is None else mask.sum(dim)
    return masked_sum(values, mask, dim) / count.clamp(min=1).to(values.dtype)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of the valid positions of ``values`` (a scalar over all dimensions).

    var = Σ m·(x − μ)² / n, times n / (n − 1) (Bessel's correction) when ``unbiased``; 0 when n ≤ 1.
    """
    mask = mask.bool()
    values = zero_masked(values, mask)  # before squaring: the gradient of (NaN − μ)² at padding is NaN
    mean = masked_mean(values, mask)
    var = masked_mean((values - mean) ** 2, mask)
    if unbiased:
        n = mask.sum().to(values.dtype)
        var = torch.where(n > 1, var * n / (n - 1).clamp(min=1), torch.zeros_like(var))
    return var


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """(x − μ) / sqrt(σ² + 1e-8) over the valid positions; with ``shift_mean=False`` μ is added back.

    μ and σ² are the masked mean and the masked variance with Bessel's correction, taken over the
    whole tensor (the batch), as in the PPO advantage normalisation (Huang et al., "The 37
    Implementation Details of PPO", detail 7). values, mask: [B, T]. Masked positions return 0.
    """
    mask = mask.bool()
    mean = masked_mean(values, mask)
    var = masked_var(values, mask, unbiased=True)
    whitened = (zero_masked(values, mask) - mean) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        whitened = whitened + mean
    return zero_masked(whitened, mask)


def last_valid_index(mask: torch.Tensor) -> torch.Tensor:
    """Index of the last position with mask 1 in each row, −1 for a row with none. mask: [B, T] → [B].

    Works for any padding side: it looks at the mask, never at token ids (so pad == eos is safe).
    """
    positions = torch.arange(mask.shape[-1], device=mask.device).expand_as(mask)
    return torch.where(mask.bool(), positions, -1).max(dim=-1).values


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids that count only attended tokens: [B, L] → [B, L], 0 at and before the first token.

    Left-padded rows then see the same positions as unpadded ones (docs/pitfalls.md #6).
    """
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
