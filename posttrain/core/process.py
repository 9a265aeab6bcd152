"""Process rewards: a reward for each step of a solution, not only for its end.

A process reward model (PRM) reads a solution step by step and scores, at the token that ends each step,
the probability that the step is correct (Lightman et al. 2023, "Let's verify step by step",
arXiv:2305.20050; Wang et al. 2024, "Math-Shepherd", arXiv:2312.08935). Here: its loss, where the step
scores go in PPO's token rewards, and how GRPO folds them into one score per response. PRIME's implicit
process reward (Cui et al. 2025, arXiv:2502.01456) needs no step labels: a log-ratio of two language
models trained from outcome labels alone, read at every token.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from posttrain.core.masks import last_valid_index

STEP_AGGREGATIONS = ("min", "sum", "last")


def prm_loss(logits: torch.Tensor, labels: torch.Tensor, label_mask: torch.Tensor) -> torch.Tensor:
    """The PRM's binary cross-entropy at the labelled positions (Lightman et al. 2023; Math-Shepherd's PRM
    loss, Wang et al. 2024):

        ℓ_i = −[ y_i · log σ(z_i) + (1 − y_i) · log(1 − σ(z_i)) ] = softplus(z_i) − y_i · z_i

    at each token i that ends a labelled step (``label_mask`` 1), 0 at every other position.
    logits z: [B, L] the head's one logit per token; labels y: [B, L], 1 = the step is correct, 0 = it
    is not (read at labelled positions only); label_mask: [B, L]. Returns [B, L]; sum it and divide by
    the number of labelled steps for the mean.
    """
    label_mask = label_mask.bool()
    z = torch.where(label_mask, logits.float(), 0.0)
    y = torch.where(label_mask, labels.float(), 0.0)
    return torch.where(label_mask, F.binary_cross_entropy_with_logits(z, y, reduction="none"), 0.0)


def step_end_mask(separator_ends: torch.Tensor, mask: torch.Tensor, closed: torch.Tensor | None = None) -> torch.Tensor:
    """The tokens that end a step of each response, [B, T] bool: every response token in which a step
    separator ends (``separator_ends``), and the last response token, which ends the last step (it is
    the token at which the outcome reward is read too) where the row is ``closed``.

    separator_ends: [B, T] bool, 1 = the step separator's last character is in this token; mask: [B, T],
    1 = a response token; closed: [B] bool or None (all True), False = the last token ends no step: a
    response cut by max_new_tokens (its last step unfinished; training rows keep whole steps only) or one
    with nothing but whitespace after its last separator. A row without response tokens has no step end.
    """
    mask = mask.bool()
    ends = separator_ends.bool() & mask
    last = last_valid_index(mask)
    has_last = last >= 0 if closed is None else (last >= 0) & closed.bool()
    at_last = torch.zeros_like(ends).scatter(1, last.clamp(min=0).unsqueeze(1), has_last.unsqueeze(1))
    return ends | at_last


def process_token_rewards(step_logits: torch.Tensor, step_ends: torch.Tensor, weight: float) -> torch.Tensor:
    """Token rewards from the PRM's step scores (Math-Shepherd's step-by-step PPO, Wang et al. 2024):

        r_t = weight · σ(z_t)   at each token t that ends a step,   0 at every other token

    σ(z_t): the PRM's probability that the step ending at t is correct. Added to PPO's token rewards
    (−β·KL_t, plus the outcome score at the last token).
    step_logits: [B, T] the PRM's logit at each response token; step_ends: [B, T] bool (``step_end_mask``).
    Returns [B, T].
    """
    step_ends = step_ends.bool()
    return torch.where(step_ends, weight * torch.sigmoid(torch.where(step_ends, step_logits.float(), 0.0)), 0.0)


def aggregate_step_scores(step_logits: torch.Tensor, step_ends: torch.Tensor, aggregation: str) -> torch.Tensor:
    """One process score per response from its step scores p_k = σ(z_k) (k over the steps, in order):

        min:  min_k p_k       (Math-Shepherd, Wang et al. 2024; the usual choice of PRM work: a
                               solution is as good as its worst step)
        sum:  Σ_k p_k         (grows with the number of steps: a policy can raise it by writing more)
        last: p_K             (the last step's score)

    Lightman et al. 2023 score a solution by Π_k p_k, the probability that every step is correct.
    step_logits: [B, T]; step_ends: [B, T] bool. Returns [B] float32; 0 for a row without a step.
    """
    if aggregation not in STEP_AGGREGATIONS:
        raise ValueError(f"aggregation must be one of {STEP_AGGREGATIONS}, got {aggregation!r}")
    step_ends = step_ends.bool()
    p = torch.sigmoid(torch.where(step_ends, step_logits.float(), 0.0))
    has_step = step_ends.any(1)
    if aggregation == "min":
        score = torch.where(step_ends, p, torch.inf).amin(1)
    elif aggregation == "sum":
        score = torch.where(step_ends, p, 0.0).sum(1)
    else:
        score = p.gather(1, last_valid_index(step_ends).clamp(min=0).unsqueeze(1)).squeeze(1)
    return torch.where(has_step, score, 0.0)


def implicit_process_rewards(
    logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor, beta: float
) -> torch.Tensor:
    """PRIME's implicit process reward (Cui et al. 2025, arXiv:2502.01456):

        r_φ(y_t) = β · log [ π_φ(y_t | y_<t) / π_ref(y_t | y_<t) ]

    a dense reward at every token from a language model π_φ (the implicit PRM) and its frozen start π_ref.
    logprobs, ref_logprobs: [B, T] log π_φ and log π_ref of the response tokens; mask: [B, T], 1 = a
    response token. Returns [B, T], 0 at masked positions.
    """
    mask = mask.bool()
    return torch.where(mask, beta * (torch.where(mask, logprobs, 0.0) - torch.where(mask, ref_logprobs, 0.0)), 0.0)


def implicit_prm_loss(
    logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor, labels: torch.Tensor, beta: float
) -> torch.Tensor:
    """PRIME's loss of the implicit PRM from outcome labels alone (Cui et al. 2025; the implicit PRM of
    Yuan et al. 2024, arXiv:2412.01981): the cross-entropy of the summed implicit reward

        R = Σ_t r_φ(y_t),    ℓ = −[ y · log σ(R) + (1 − y) · log(1 − σ(R)) ] = softplus(R) − y · R

    y = 1 for a response whose outcome is correct, 0 otherwise. Trained online on the policy's rollouts,
    it makes r_φ(y_t) (``implicit_process_rewards``) a credit for each token.
    logprobs, ref_logprobs, mask: [B, T]; labels: [B] in {0, 1}. Returns [B].
    """
    total = implicit_process_rewards(logprobs, ref_logprobs, mask, beta).sum(1)
    return F.binary_cross_entropy_with_logits(total, labels.to(total.dtype), reduction="none")
