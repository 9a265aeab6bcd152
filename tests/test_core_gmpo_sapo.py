"""GMPO and SAPO (issue 38, item 2): values and gradients worked out by hand, the papers' gradient forms,
micro-batch invariance of GMPO's per-response geometric mean, and their config checks."""

import math

import pytest
import torch
from helpers import assert_close

from posttrain.core import (
    AGGREGATION_MODES,
    aggregate_loss,
    aggregation_units,
    gmpo_policy_loss,
    ppo_policy_loss,
    sapo_policy_loss,
)
from posttrain.runtime.config import load_config
from posttrain.trainers.grpo import GRPOConfig
from posttrain.trainers.ppo import PPOConfig

F64 = torch.float64


def _sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def _rows(log_ratios, lengths, advantages):
    """(mask, logprobs with grad, old log-probs, advantages [B]) for rows whose valid log-ratios are given;
    the padding holds a log-ratio of 9.0, which must change nothing."""
    T = max(lengths)
    mask = (torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]).long()
    x = torch.tensor([r + [9.0] * (T - len(r)) for r in log_ratios], dtype=F64)
    old = -torch.arange(1, T + 1, dtype=F64).repeat(len(lengths), 1) / 2
    return mask, (old + x).requires_grad_(), old, torch.tensor(advantages, dtype=F64)


def test_gmpo_policy_loss_by_hand():
    # three responses, clip range e^±0.4 (the paper's), log-ratios x:
    #   row 0, A = +1:   x = 0.1, 0.5    → 0.5 capped at 0.4 (A > 0: the upper side), c = 0.1, 0.4
    #   row 1, A = −2:   x = −0.2, 0.1, −0.6 → −0.6 floored at −0.4 (A < 0: the lower side), c = −0.2, 0.1, −0.4
    #   row 2, A = +0.5: x = −0.7, 0.2   → nothing clipped (A > 0 leaves the lower side open), c = −0.7, 0.2
    mask, logprobs, old, adv = _rows([[0.1, 0.5], [-0.2, 0.1, -0.6], [-0.7, 0.2]], [2, 3, 2], [1.0, -2.0, 0.5])
    g0, g1, g2 = math.exp((0.1 + 0.4) / 2), math.exp((-0.2 + 0.1 - 0.4) / 3), math.exp((-0.7 + 0.2) / 2)
    per_token, stats = gmpo_policy_loss(logprobs, old, adv, mask, clip_low=0.4, clip_high=0.4)
    # ℓ_{i,t} = −A_i·g_i on each valid token of row i, 0 at padding
    expected = torch.tensor([[-g0, -g0, 0.0], [2 * g1] * 3, [-0.5 * g2, -0.5 * g2, 0.0]], dtype=F64)
    assert_close(per_token, expected)
    loss = aggregate_loss(per_token, mask, "seq-mean-token-mean")
    assert_close(loss, (-g0 + 2 * g1 - 0.5 * g2) / 3)  # the paper's −(1/G) Σ_i g_i·A_i
    (grad,) = torch.autograd.grad(loss, logprobs)
    # ∂/∂logπ_{i,t} = −A_i·g_i/|y_i|·(1/3) on a token inside its bound, 0 on the clipped ones (row 0 t1, row 1 t2)
    by_hand = [[-g0 / 2 / 3, 0.0, 0.0], [2 * g1 / 3 / 3, 2 * g1 / 3 / 3, 0.0], [-0.5 * g2 / 2 / 3] * 2 + [0.0]]
    assert_close(grad, torch.tensor(by_hand, dtype=F64))
    ratios = [math.exp(x) for x in (0.1, 0.5, -0.2, 0.1, -0.6, -0.7, 0.2)]
    assert_close(stats["clipfrac"], 2 / 7)
    assert_close(stats["ratio_max"], math.exp(0.5))  # the unclipped token ratios
    assert_close(stats["ratio_min"], math.exp(-0.7))
    assert_close(stats["ratio_mean"], sum(ratios) / 7)
    # token-mean weighs row i by its |y_i| tokens: (2·(−g0) + 3·2·g1 + 2·(−0.5·g2)) / 7
    assert_close(aggregate_loss(per_token, mask, "token-mean"), (-2 * g0 + 6 * g1 - g2) / 7)
    # an asymmetric range: clip_high = 0.3 caps row 0's 0.5 at 0.3; clip_low = 0.5 leaves row 1's −0.6 below
    # −0.5 floored at −0.5
    per_token_asym, _ = gmpo_policy_loss(logprobs, old, adv, mask, clip_low=0.5, clip_high=0.3)
    assert_close(per_token_asym[0, 0], -math.exp((0.1 + 0.3) / 2))
    assert_close(per_token_asym[1, 0], 2 * math.exp((-0.2 + 0.1 - 0.5) / 3))


def test_gmpo_clipfrac_counts_the_tokens_of_a_zero_advantage_row_as_unclipped():
    # row 0, A = 0:  x = 0.6, −0.1 → 0.6 lies past e^0.4, but the row's term −0·g_0 is 0 whatever its ratios
    #                (verl's sgn(A) form clips nothing there): unclipped
    # row 1, A = +1: x = 0.6, 0.2  → 0.6 capped at 0.4: clipfrac = 1 of the 4 valid tokens
    mask, logprobs, old, adv = _rows([[0.6, -0.1], [0.6, 0.2]], [2, 2], [0.0, 1.0])
    per_token, stats = gmpo_policy_loss(logprobs, old, adv, mask, clip_low=0.4, clip_high=0.4)
    assert_close(stats["clipfrac"], 1 / 4)
    assert_close(per_token, torch.tensor([[0.0, 0.0], [-math.exp(0.3)] * 2], dtype=F64))  # g_1 = e^((0.4+0.2)/2)


def test_gmpo_two_tokens_gradient_is_the_papers_weighted_policy_gradient():
    """GMPO (Zhao et al. 2025) and GRPO are both weighted policy gradients: for one response with tokens
    inside the clip range, ∇J_GRPO = A/|y|·Σ_t ρ_t·∇logπ_t and ∇J_GMPO = A/|y|·Σ_t (Π_k ρ_k)^(1/|y|)·∇logπ_t:
    every token weighted by the response's geometric mean, not by its own ratio."""
    for a, (x0, x1) in ((1.5, (0.3, -0.1)), (-0.7, (-0.25, 0.35))):
        mask, logprobs, old, adv = _rows([[x0, x1]], [2], [a])
        loss = aggregate_loss(gmpo_policy_loss(logprobs, old, adv, mask)[0], mask, "seq-mean-token-mean")
        (grad,) = torch.autograd.grad(loss, logprobs)
        geometric = math.sqrt(math.exp(x0) * math.exp(x1))
        assert_close(grad, torch.tensor([[-a * geometric / 2, -a * geometric / 2]], dtype=F64))  # a loss: −∇J
        ppo = aggregate_loss(ppo_policy_loss(logprobs, old, adv, mask, clip_low=0.5)[0], mask, "seq-mean-token-mean")
        (ppo_grad,) = torch.autograd.grad(ppo, logprobs)
        assert_close(ppo_grad, torch.tensor([[-a * math.exp(x0) / 2, -a * math.exp(x1) / 2]], dtype=F64))


def test_sapo_policy_loss_by_hand():
    # four tokens of one response: r = 1.5 (A = +1), 0.5 (A = −1), 1.0 (A = +2), 1.2 (A = −0.5); τ_pos = 1,
    # τ_neg = 1.05 (the paper's). f(r) = (4/τ)·σ(τ(r − 1)), ℓ = −f(r)·A, gradient on logπ: −w·r·A with
    # w = 4·p·(1 − p), p = σ(τ(r − 1))
    ratios, advs = [1.5, 0.5, 1.0, 1.2], [1.0, -1.0, 2.0, -0.5]
    taus = [1.0, 1.05, 1.0, 1.05]
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    logprobs = torch.tensor([[-1.0, -2.0, -0.5, -0.3, float("nan")]], dtype=F64).requires_grad_()
    old = logprobs.detach() - torch.tensor(ratios + [1.0], dtype=F64).log()
    adv = torch.tensor([advs + [3.0]], dtype=F64)
    per_token, stats = sapo_policy_loss(logprobs, old, adv, mask, tau_pos=1.0, tau_neg=1.05)
    p = [_sigmoid(tau * (r - 1)) for r, tau in zip(ratios, taus, strict=True)]
    # p = σ(0.5) = 0.62246, σ(−0.525) = 0.37169, σ(0) = 0.5, σ(0.21) = 0.55231
    assert_close(torch.tensor(p, dtype=F64), torch.tensor([0.62246, 0.37169, 0.5, 0.55231], dtype=F64), atol=1e-5)
    values = [-(4 / tau) * pt * a for pt, tau, a in zip(p, taus, advs, strict=True)]
    # at r = 1 the value is −(2/τ)·A = −4: SAPO's value is not GRPO's ρ·A there, only its gradient is
    assert values[2] == -4.0
    assert_close(per_token, torch.tensor([values + [0.0]], dtype=F64))
    loss = aggregate_loss(per_token, mask, "token-mean")
    (grad,) = torch.autograd.grad(loss, logprobs)
    w = [4 * pt * (1 - pt) for pt in p]  # 0.94001, 0.93475, 1 (on-policy), 0.98910
    by_hand = [-wt * r * a / 4 for wt, r, a in zip(w, ratios, advs, strict=True)]
    assert_close(grad, torch.tensor([by_hand + [0.0]], dtype=F64))
    assert by_hand[2] == -2.0 / 4  # on-policy: the plain policy gradient −A
    # PPO's clip (ε = 0.2) cuts the gradient of the first two tokens to 0; SAPO keeps 94 % of theirs
    ppo = aggregate_loss(ppo_policy_loss(logprobs, old, adv, mask, clip_low=0.2)[0], mask, "token-mean")
    (ppo_grad,) = torch.autograd.grad(ppo, logprobs)
    assert ppo_grad[0, 0] == 0 and ppo_grad[0, 1] == 0 and grad[0, 0] != 0 and grad[0, 1] != 0
    assert stats["clipfrac"] == 0  # nothing is clipped
    assert_close(stats["gate_weight_mean"], sum(w) / 4)
    assert_close(stats["gate_weight_min"], min(w))
    assert_close(stats["ratio_max"], 1.5)
    assert_close(stats["ratio_min"], 0.5)


def test_sapo_two_tokens_gradient_is_the_papers_form_and_tau_neg_damps_sooner():
    """SAPO's gradient (Gao et al. 2025): ∇J = Σ_t w_t·r_t·A_t·∇logπ_t, w_t = 4·p_t·(1 − p_t) — here checked by
    autograd for two tokens; the same |r − 1| is damped more with a negative advantage (τ_neg > τ_pos)."""
    for r0, r1 in ((1.3, 0.6), (0.9, 2.0)):
        ratios, advs = torch.tensor([[r0, r1]], dtype=F64), torch.tensor([[0.8, -1.3]], dtype=F64)
        logprobs = torch.tensor([[-0.4, -1.1]], dtype=F64).requires_grad_()
        mask = torch.ones(1, 2)
        old = logprobs.detach() - ratios.log()
        loss = aggregate_loss(sapo_policy_loss(logprobs, old, advs, mask, tau_pos=1.0, tau_neg=2.0)[0], mask)
        (grad,) = torch.autograd.grad(loss, logprobs)
        p0, p1 = _sigmoid(1.0 * (r0 - 1)), _sigmoid(2.0 * (r1 - 1))
        w0, w1 = 4 * p0 * (1 - p0), 4 * p1 * (1 - p1)
        assert_close(grad, torch.tensor([[-w0 * r0 * 0.8 / 2, w1 * r1 * 1.3 / 2]], dtype=F64))
    # r = 1.3 with A > 0 (τ_pos = 1) vs A < 0 (τ_neg = 1.05): w = 4σ(0.3)(1 − σ(0.3)) > 4σ(0.315)(1 − σ(0.315))
    ratio = torch.tensor([[1.3, 1.3]], dtype=F64)
    _, stats_pos = sapo_policy_loss(ratio.log(), torch.zeros(1, 2, dtype=F64), torch.ones(1), torch.ones(1, 2))
    _, stats_neg = sapo_policy_loss(ratio.log(), torch.zeros(1, 2, dtype=F64), -torch.ones(1), torch.ones(1, 2))
    assert_close(stats_pos["gate_weight_mean"], 4 * _sigmoid(0.3) * (1 - _sigmoid(0.3)))
    assert_close(stats_neg["gate_weight_mean"], 4 * _sigmoid(0.315) * (1 - _sigmoid(0.315)))
    assert stats_neg["gate_weight_mean"] < stats_pos["gate_weight_mean"] < 1


@pytest.mark.parametrize("mode", AGGREGATION_MODES)
@pytest.mark.parametrize("name", ["gmpo", "sapo"])
def test_micro_batches_give_the_full_batch_loss_and_gradient(name, mode):
    """A response's geometric mean (GMPO) lives in its row, and rows never span micro-batches: each
    micro-batch's loss times its ``aggregation_units`` share adds up to the full batch's loss and gradient,
    in every aggregation, with some tokens clipped (GMPO) or damped (SAPO)."""
    g = torch.Generator().manual_seed(3)
    mask = (torch.arange(6)[None, :] < torch.tensor([6, 3, 0, 1, 5])[:, None]).long()
    old = torch.randn(5, 6, generator=g, dtype=F64)
    logprobs = (old + 0.3 * torch.randn(5, 6, generator=g, dtype=F64)).requires_grad_()
    adv = torch.tensor([1.0, -0.5, 2.0, 0.3, -1.2], dtype=F64)
    loss_fn = gmpo_policy_loss if name == "gmpo" else sapo_policy_loss
    knobs = {"clip_low": 0.2, "clip_high": 0.2} if name == "gmpo" else {}
    per_token, stats = loss_fn(logprobs, old, adv, mask, **knobs)
    full = aggregate_loss(per_token, mask, mode, norm_length=6)
    (full_grad,) = torch.autograd.grad(full, logprobs)
    assert (stats["clipfrac"] > 0) if name == "gmpo" else (stats["gate_weight_min"] < 0.99)
    units = aggregation_units(mask, mode).double()
    accumulated = torch.zeros((), dtype=F64)
    for rows in ([0, 1], [2], [3, 4]):
        micro, _ = loss_fn(logprobs[rows], old[rows], adv[rows], mask[rows], **knobs)
        share = aggregation_units(mask[rows], mode).double() / units
        accumulated = accumulated + aggregate_loss(micro, mask[rows], mode, norm_length=6) * share
    assert_close(accumulated, full)
    assert_close(torch.autograd.grad(accumulated, logprobs)[0], full_grad)


EXACT = "rewards=[{function: 'posttrain.rewards.builtin:exact_answer'}]"
GRPO_BASE = ["model.path=m", "data.path=d", EXACT]
PPO_BASE = ["model.path=m", "data.path=d", EXACT, "critic=policy"]


def test_gmpo_and_sapo_configs_are_checked_at_start():
    """Where each applies, its presets, and the knobs it does not read refused in one line naming the field."""
    gmpo = load_config(GRPOConfig, None, GRPO_BASE + ["preset=gmpo"])
    assert (gmpo.policy_loss, gmpo.loss_agg, gmpo.clip_low, gmpo.clip_high, gmpo.kl_coef) == (
        "gmpo",
        "seq-mean-token-mean",
        0.4,
        0.4,
        0.0,
    )
    sapo = load_config(GRPOConfig, None, GRPO_BASE + ["preset=sapo", "tau_neg=1.2"])
    assert (sapo.policy_loss, sapo.tau_pos, sapo.tau_neg, sapo.kl_coef) == ("sapo", 1.0, 1.2, 0.0)
    assert "tau_neg=1.2 (preset 1.05, overridden)" in sapo.preset_report()
    assert load_config(GRPOConfig, None, GRPO_BASE + ["policy_loss=gmpo", "clip_low=1.5"]).clip_low == 1.5  # e^−1.5
    assert load_config(PPOConfig, None, PPO_BASE + ["policy_loss=sapo", "tau_pos=0.5"]).tau_pos == 0.5
    refused = [
        (GRPOConfig, ["policy_loss=gmpo", "clip_low=0"], r"^clip_low must be > 0 \(log space"),
        (GRPOConfig, ["policy_loss=gmpo", "advantage_estimator=reinforce++"], r"^policy_loss=gmpo with advantage"),
        (
            GRPOConfig,
            ["policy_loss=gmpo", "rollout.importance_sampling=token_mask", "rollout.async_steps=1"],
            r"^policy_loss=gmpo with rollout.importance_sampling=token_mask: .*use policy_loss=sapo",
        ),
        (GRPOConfig, ["policy_loss=sapo", "clip_low=0.1"], r"^clip_low=0.1 is not used by policy_loss=sapo: SAPO"),
        (GRPOConfig, ["preset=sapo", "clip_high=0.28"], r"^clip_high=0.28 is not used by policy_loss=sapo"),
        (GRPOConfig, ["policy_loss=sapo", "tau_neg=0"], r"^tau_pos and tau_neg must be > 0"),
        (GRPOConfig, ["policy_loss=ppo", "tau_pos=2"], r"^tau_pos=2.0 is not used by policy_loss=ppo: .*sapo"),
        (GRPOConfig, ["preset=gmpo", "policy_loss=sapo"], r"^preset=gmpo sets policy_loss=gmpo, .*preset=sapo"),
        (PPOConfig, ["policy_loss=gmpo"], r"^policy_loss=gmpo takes one advantage per response.*GAE.*sapo"),
        (PPOConfig, ["policy_loss=cispo", "tau_neg=2"], r"^tau_neg=2.0 is not used by policy_loss=cispo"),
    ]
    for config_cls, overrides, message in refused:
        base = GRPO_BASE if config_cls is GRPOConfig else PPO_BASE
        with pytest.raises(ValueError, match=message):
            load_config(config_cls, None, base + overrides)
