"""On-policy distillation: divergences between the student π_θ and a frozen teacher π_T at each response token.

The student samples its own responses; the teacher grades every position of them. Two forms:

- sampled-token reverse KL (Lu et al. 2025, Thinking Machines, "On-Policy Distillation"; the on-policy stage
  of Qwen3's strong-to-weak distillation, Yang et al. 2025, arXiv:2505.09388): the teacher's log-prob of each
  sampled token against the student's, used as a per-token advantage of the policy-gradient loss
  (``reverse_kl_advantages`` with ``losses.ppo_policy_loss``);
- the generalized Jensen–Shannon divergence over the whole vocabulary at each position (Agarwal et al. 2024,
  GKD, "On-Policy Distillation of Language Models: Learning from Self-Generated Mistakes", arXiv:2306.13649),
  whose ends are the forward and the reverse KL (``generalized_jsd``, ``vocab_kl``).
"""

from __future__ import annotations

import math

import torch

from posttrain.core.kl import kl_penalty
from posttrain.core.masks import zero_masked


def vocab_kl(logprobs_p: torch.Tensor, logprobs_q: torch.Tensor) -> torch.Tensor:
    """KL(P‖Q) = Σ_v p_v (log p_v − log q_v) at each position, over the vocabulary.

    logprobs_p, logprobs_q: [..., V] normalised log-probabilities (log_softmax). A token P gives no
    mass (log p_v = −inf) adds 0, as p log p → 0; one that Q gives none while P does makes the KL +inf.
    Returns [...].
    """
    if logprobs_p.shape != logprobs_q.shape:
        raise ValueError(
            f"P and Q must cover one vocabulary: shapes {tuple(logprobs_p.shape)}, {tuple(logprobs_q.shape)}"
        )
    has_mass = logprobs_p > -torch.inf
    # select before subtracting: −inf − (−inf) is NaN, and its gradient too
    difference = torch.where(has_mass, logprobs_p - torch.where(has_mass, logprobs_q, 0.0), 0.0)
    return (logprobs_p.exp() * difference).sum(-1)


def generalized_jsd(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    mask: torch.Tensor,
    beta: float = 0.5,
    temperature: float = 1.0,
) -> torch.Tensor:
    """GKD's generalized Jensen–Shannon divergence per response token (Agarwal et al. 2024, arXiv:2306.13649):

        JSD_β(P‖Q) = β·KL(P‖M) + (1 − β)·KL(Q‖M),      M = β·P + (1 − β)·Q

    with the paper's roles P = teacher π_T and Q = student π_θ, both softmax(logits / τ) over the vocabulary.
    As β → 0, JSD_β / β → KL(P‖Q), the forward KL; as β → 1, JSD_β / (1 − β) → KL(Q‖P), the reverse KL. The
    formula is 0 at β = 0 and at β = 1 themselves, so those two are defined as the limits: β = 0 returns
    KL(π_T‖π_θ) and β = 1 returns KL(π_θ‖π_T) (as TRL's GKD does). β = 0.5 is the Jensen–Shannon divergence.

    student_logits, teacher_logits: [B, T, V] at the positions that predict each response token (the same
    vocabulary: V must match); mask: [B, T], 1 = a response token that counts. Computed in float32 (float64
    kept); masked positions may hold garbage (NaN, inf) and return 0 with gradient 0. Returns [B, T].
    The whole [B, T, V] is held (with autograd's copies of it): call it on micro-batches.
    """
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must be in [0, 1], got {beta}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(
            f"student and teacher logits must cover one vocabulary: shapes {tuple(student_logits.shape)}, "
            f"{tuple(teacher_logits.shape)}"
        )
    valid = mask.bool()[..., None]
    dtype = torch.promote_types(student_logits.dtype, torch.float32)  # float64 stays float64
    student = torch.log_softmax(torch.where(valid, student_logits.to(dtype), 0.0) / temperature, dim=-1)
    teacher = torch.log_softmax(torch.where(valid, teacher_logits.to(dtype), 0.0) / temperature, dim=-1)
    if beta == 0.0:
        jsd = vocab_kl(teacher, student)
    elif beta == 1.0:
        jsd = vocab_kl(student, teacher)
    else:
        mixture = torch.logaddexp(teacher + math.log(beta), student + math.log1p(-beta))  # log M
        jsd = beta * vocab_kl(teacher, mixture) + (1.0 - beta) * vocab_kl(student, mixture)
    return zero_masked(jsd, mask)


def reverse_kl_advantages(logprobs: torch.Tensor, teacher_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-token advantages of on-policy distillation with the reverse KL (Lu et al. 2025, Thinking Machines):

        A_t = −(log π_θ(y_t) − log π_T(y_t))

    the negative of the sampled token's k1 estimate of KL(π_θ‖π_T) at that position, with discount 0: each
    token's own term, not a return summed over the tokens after it. Used as the advantage of the
    policy-gradient loss (``ppo_policy_loss``): at ratio 1 its gradient is (log π_θ − log π_T)(y_t)·∇log π_θ(y_t),
    whose expectation over y_t ~ π_θ is ∇KL(π_θ‖π_T) at that position, since E[∇log π_θ] = 0.

    logprobs: [B, T] of the sampled tokens under the student that sampled them (the old log-probs);
    teacher_logprobs: [B, T] under the teacher; mask: [B, T], 1 = response token. Returns [B, T], detached
    (the advantages are constants of the update), 0 at masked positions.
    """
    return zero_masked(-kl_penalty(logprobs, teacher_logprobs, "k1"), mask).detach()
