"""Per-token log-probabilities and entropies from logits, in float32, chunked over positions; and a
judge's P(yes) from the logits of one position (``yes_probability``).

A naive ``log_softmax(logits.float(), -1).gather(-1, tokens)`` materialises a second full
[B, T, V] float32 tensor (500 MiB for B=4, T=1024, V=32000). Here each chunk of positions is
reduced to one number per position before the next chunk is touched, so the extra memory outside
autograd is a few chunks of ``_CHUNK_ELEMENTS`` floats whatever B·T is.
"""

from __future__ import annotations

import torch

# About 8 MiB of float32 per chunk: small next to any real [B, T, V], large enough that the Python
# loop costs nothing measurable (V=32000 gives 65 positions per chunk).
_CHUNK_ELEMENTS = 1 << 21


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for half/bfloat16/float32 logits; float64 stays float64 (gradcheck)."""
    return torch.promote_types(dtype, torch.float32)


def _chunks(logits: torch.Tensor):
    """Yield (start, [n, V] chunk in the compute dtype) over the flattened positions of ``logits``."""
    flat = logits.reshape(-1, logits.shape[-1])
    rows = max(1, _CHUNK_ELEMENTS // logits.shape[-1])
    dtype = _compute_dtype(logits.dtype)
    for start in range(0, flat.shape[0], rows):
        yield start, flat[start : start + rows].to(dtype)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log π(token) = log_softmax(logits / τ)[token] = logits[token]/τ − logsumexp(logits/τ).

    Equal to ``torch.log_softmax(logits.float() / τ, -1).gather(-1, tokens[..., None])[..., 0]``
    without holding its [B, T, V] float32 result. τ must be the sampling temperature: the PPO ratio
    compares these with the sampler's log-probs (docs/pitfalls.md #4).

    logits: [B, T, V], any float dtype (computed in float32, float64 kept as is).
    tokens: [B, T] integer ids in [0, V); the token at position t is scored by logits[:, t].
    Returns [B, T] in the compute dtype.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    flat_tokens = tokens.reshape(-1, 1)
    pieces = []
    for start, chunk in _chunks(logits):
        if temperature != 1.0:
            chunk = chunk / temperature
        picked = chunk.gather(-1, flat_tokens[start : start + chunk.shape[0]]).squeeze(-1)
        pieces.append(picked - torch.logsumexp(chunk, dim=-1))
    return torch.cat(pieces).view(tokens.shape)


def entropy_from_logits(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """H = −Σ_v p_v log p_v with p = softmax(logits / τ).

    logits: [B, T, V] (any float dtype, computed in float32); −inf logits (filtered tokens) count as
    p = 0 and add nothing. Returns [B, T].
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    pieces = []
    for _, chunk in _chunks(logits):
        if temperature != 1.0:
            chunk = chunk / temperature
        log_p = torch.log_softmax(chunk, dim=-1)
        # p·log p with 0·(−inf) := 0; select before multiplying so the gradient stays finite too
        finite_log_p = torch.where(log_p > -torch.inf, log_p, 0.0)
        pieces.append(-(log_p.exp() * finite_log_p).sum(-1))
    return torch.cat(pieces).view(logits.shape[:-1])


def yes_probability(logits: torch.Tensor, yes_ids: list[int], no_ids: list[int]) -> torch.Tensor:
    """A judge's verdict as a number: the next token's probability of "yes" against "no",

        P(yes) / (P(yes) + P(no)) = σ(logsumexp(logits[yes_ids]) − logsumexp(logits[no_ids]))

    with P(yes) = Σ_{v ∈ yes_ids} softmax(logits)_v (likewise no); the softmax's normaliser cancels,
    so only the 2 logsumexps are computed. The verifier's P("Yes") of Zhang et al. 2024 ("Generative
    Verifiers: Reward Modeling as Next-Token Prediction", arXiv 2408.15240), renormalised over the two
    answers so that mass on any other token does not lower the score.

    logits: [B, V], the logits of the position that predicts the verdict token (any float dtype,
    computed in float32, float64 kept). yes_ids, no_ids: disjoint, non-empty lists of token ids.
    Returns [B] in [0, 1].
    """
    if not yes_ids or not no_ids or set(yes_ids) & set(no_ids):
        raise ValueError(f"yes_ids and no_ids must be non-empty and disjoint, got {yes_ids} and {no_ids}")
    logits = logits.to(_compute_dtype(logits.dtype))
    yes = torch.logsumexp(logits[:, yes_ids], dim=-1)
    no = torch.logsumexp(logits[:, no_ids], dim=-1)
    return torch.sigmoid(yes - no)
