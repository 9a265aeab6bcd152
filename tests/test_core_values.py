"""posttrain.core against values worked out by hand (the arithmetic is in each test)."""

import math

import pytest
import torch
from helpers import assert_close

from posttrain.core import (
    aggregate_loss,
    cispo_policy_loss,
    dpo_loss,
    entropy_from_logits,
    gae,
    group_advantages,
    gspo_policy_loss,
    kl_penalty,
    masked_mean,
    masked_whiten,
    ppo_policy_loss,
    ranking_loss,
    rloo_advantages,
    shape_rewards,
    token_logprobs,
    value_loss,
)

X = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
M = torch.tensor([[1, 1, 0], [1, 0, 0]])


def test_masked_mean():
    assert_close(masked_mean(X, M), (1 + 2 + 4) / 3)
    assert_close(masked_mean(X, M, dim=1), [(1 + 2) / 2, 4 / 1])
    assert_close(masked_mean(X, M, dim=0), [(1 + 4) / 2, 2 / 1, 0.0])  # empty column → 0
    assert_close(masked_mean(X, torch.zeros_like(M)), 0.0)


def test_masked_whiten():
    x = torch.tensor([[1.0, 2.0, 3.0, 4.0, 99.0]])
    m = torch.tensor([[1, 1, 1, 1, 0]])
    mean = 2.5
    var = (1.5**2 + 0.5**2 + 0.5**2 + 1.5**2) / 3  # Bessel: n − 1 = 3
    expected = [(v - mean) / math.sqrt(var + 1e-8) for v in (1.0, 2.0, 3.0, 4.0)] + [0.0]
    assert_close(masked_whiten(x, m), [expected])
    kept = [e + mean for e in expected[:4]] + [0.0]
    assert_close(masked_whiten(x, m, shift_mean=False), [kept])


def test_token_logprobs_and_temperature():
    logits = torch.tensor([[[0.0, math.log(3.0)], [0.0, 0.0]]])
    tokens = torch.tensor([[1, 0]])
    # softmax([0, ln 3]) = [1/4, 3/4]; softmax([0, 0]) = [1/2, 1/2]
    assert_close(token_logprobs(logits, tokens), [[math.log(3 / 4), math.log(1 / 2)]])
    # τ = 2: softmax([0, ln 3 / 2]) = [1, √3] / (1 + √3)
    assert_close(token_logprobs(logits, tokens, temperature=2.0), [[math.log(3**0.5 / (1 + 3**0.5)), math.log(0.5)]])


def test_token_logprobs_bf16_computed_in_float32():
    logits = torch.randn(2, 5, 11, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    tokens = torch.randint(0, 11, (2, 5), generator=torch.Generator().manual_seed(1))
    out = token_logprobs(logits, tokens)
    assert out.dtype == torch.float32
    naive = torch.log_softmax(logits.float(), -1).gather(-1, tokens[..., None])[..., 0]
    assert_close(out, naive)


def test_token_logprobs_matches_naive_across_chunks(monkeypatch):
    import posttrain.core.logprobs as lp

    monkeypatch.setattr(lp, "_CHUNK_ELEMENTS", 7 * 13)  # several chunks, the last one short
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 10, 13, generator=g)
    tokens = torch.randint(0, 13, (3, 10), generator=g)
    naive = torch.log_softmax(logits / 0.7, -1).gather(-1, tokens[..., None])[..., 0]
    assert_close(lp.token_logprobs(logits, tokens, temperature=0.7), naive)
    naive_h = -(torch.softmax(logits, -1) * torch.log_softmax(logits, -1)).sum(-1)
    assert_close(lp.entropy_from_logits(logits), naive_h)


def test_entropy_from_logits():
    uniform = torch.zeros(1, 1, 4)
    assert_close(entropy_from_logits(uniform), [[math.log(4)]])
    two = torch.tensor([[[0.0, math.log(3.0)]]])
    assert_close(entropy_from_logits(two), [[-(0.25 * math.log(0.25) + 0.75 * math.log(0.75))]])
    # a filtered token (logit −inf) has p = 0 and adds nothing: entropy of [1/2, 1/2, 0] is ln 2
    filtered = torch.tensor([[[0.0, 0.0, -math.inf]]], requires_grad=True)
    h = entropy_from_logits(filtered)
    assert_close(h, [[math.log(2)]])
    h.sum().backward()
    assert torch.isfinite(filtered.grad).all()


def test_kl_estimators():
    lp, ref = torch.tensor([-1.0]), torch.tensor([-2.0])  # d = 1
    assert_close(kl_penalty(lp, ref, "k1"), [1.0])
    assert_close(kl_penalty(lp, ref, "k2"), [0.5])  # 1² / 2
    assert_close(kl_penalty(lp, ref, "k3"), [math.exp(-1) + 1 - 1])
    # d = −1: k1 negative, k3 = e + (−1) − 1 = e − 2 > 0
    assert_close(kl_penalty(ref, lp, "k1"), [-1.0])
    assert_close(kl_penalty(ref, lp, "k3"), [math.e - 2])
    with pytest.raises(ValueError, match="k1"):
        kl_penalty(lp, ref, "k4")


def test_shape_rewards():
    scores = torch.tensor([2.0, 5.0])
    kl = torch.tensor([[0.1, 0.2, float("nan")], [0.5, 0.5, 0.5]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    # row 0: −0.5·0.1, −0.5·0.2 + 2 (last valid), 0 (padding);  row 1: −0.25, −0.25, −0.25 + 5
    assert_close(shape_rewards(scores, kl, mask, kl_coef=0.5), [[-0.05, -0.1 + 2.0, 0.0], [-0.25, -0.25, 4.75]])
    empty = shape_rewards(torch.tensor([3.0]), torch.zeros(1, 2), torch.zeros(1, 2), 0.1)
    assert_close(empty, [[0.0, 0.0]])  # no response token: nowhere to put the score


def test_gae_by_hand():
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 1.0, 7.0]])
    values = torch.tensor([[0.5, 0.6, 0.7], [0.5, 0.6, float("nan")]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    adv, ret = gae(rewards, values, mask, gamma=1.0, lam=0.5)
    # row 0: δ2 = 1 + 0 − 0.7 = 0.3 → A2 = 0.3;  δ1 = 0 + 0.7 − 0.6 = 0.1 → A1 = 0.1 + 0.5·0.3 = 0.25;
    #        δ0 = 0 + 0.6 − 0.5 = 0.1 → A0 = 0.1 + 0.5·0.25 = 0.225
    # row 1: t = 1 is the last token, no bootstrap: δ1 = 1 + 0 − 0.6 = 0.4; δ0 = 0 + 0.6 − 0.5 = 0.1 → A0 = 0.3
    assert_close(adv, [[0.225, 0.25, 0.3], [0.3, 0.4, 0.0]])
    assert_close(ret, [[0.725, 0.85, 1.0], [0.8, 1.0, 0.0]])


def test_group_advantages_by_hand():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0])
    std_g = math.sqrt((4 * 0.5**2) / 3)  # group 1: mean 0.5, Bessel n − 1 = 3
    a = 0.5 / (std_g + 1e-4)
    assert_close(group_advantages(rewards, 4), [a, -a, -a, a, 0, 0, 0, 0])
    # batch: mean 1.25, Σ(r − 1.25)² = 2·0.0625 + 2·1.5625 + 4·0.5625 = 5.5, std = sqrt(5.5 / 7)
    b = 0.5 / (math.sqrt(5.5 / 7) + 1e-4)
    assert_close(group_advantages(rewards, 4, scale="batch"), [b, -b, -b, b, 0, 0, 0, 0])
    assert_close(group_advantages(rewards, 4, scale="none"), [0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0])
    with pytest.raises(ValueError, match="group_size"):
        group_advantages(rewards, 1)
    with pytest.raises(ValueError, match="divisible"):
        group_advantages(rewards, 3)
    with pytest.raises(ValueError, match="scale"):
        group_advantages(rewards, 4, scale="median")


def test_constant_group_is_exactly_zero():
    # 0.1 is not representable: mean(0.1, 0.1, 0.1) − 0.1 is a float residue unless guarded (docs/pitfalls.md #9)
    rewards = torch.full((3,), 0.1)
    assert group_advantages(rewards, 3).abs().max().item() == 0.0
    assert rloo_advantages(rewards, 3).abs().max().item() == 0.0


def test_rloo_by_hand():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0])
    # A_0 = 1 − (0 + 0 + 1)/3 = 2/3;  A_1 = 0 − (1 + 0 + 1)/3 = −2/3
    assert_close(rloo_advantages(rewards, 4), [2 / 3, -2 / 3, -2 / 3, 2 / 3])


def test_aggregate_loss_modes():
    x = torch.cat([X, torch.full((1, 3), float("nan"))])
    m = torch.cat([M, torch.zeros(1, 3, dtype=M.dtype)])  # third row: no valid token
    assert_close(aggregate_loss(x, m, "token-mean"), 7 / 3)  # (1 + 2 + 4) / 3
    assert_close(aggregate_loss(x, m, "seq-mean-token-mean"), (1.5 + 4) / 2)  # rows with a token only
    assert_close(aggregate_loss(x, m, "seq-mean-token-sum"), (3 + 4) / 2)
    assert_close(aggregate_loss(x, m, "seq-mean-token-sum-norm"), 7 / (3 * 3))  # B = 3, L = T = 3
    assert_close(aggregate_loss(x, m, "seq-mean-token-sum-norm", norm_length=4), 7 / (3 * 4))
    with pytest.raises(ValueError, match="token-mean"):
        aggregate_loss(x, m, "sum")


def test_ppo_policy_loss_by_hand():
    ratios = torch.tensor([[1.5, 1.5, 0.5, 0.5]])
    logprobs, old = ratios.log(), torch.zeros(1, 4)
    adv = torch.tensor([[1.0, -1.0, 1.0, -1.0]])
    mask = torch.ones(1, 4)
    per_token, stats = ppo_policy_loss(logprobs, old, adv, mask, clip_low=0.2)
    # per token max(−A·r, −A·clip(r, 0.8, 1.2)):
    #   r=1.5, A=+1: max(−1.5, −1.2) = −1.2 (clipped)    r=1.5, A=−1: max(1.5, 1.2) = 1.5
    #   r=0.5, A=+1: max(−0.5, −0.8) = −0.5              r=0.5, A=−1: max(0.5, 0.8) = 0.8 (clipped)
    assert_close(per_token, [[-1.2, 1.5, -0.5, 0.8]])
    assert_close(aggregate_loss(per_token, mask), (-1.2 + 1.5 - 0.5 + 0.8) / 4)
    assert_close(stats["clipfrac"], 0.5)
    assert_close(stats["ratio_mean"], 1.0)
    assert_close(stats["ratio_max"], 1.5)
    # k3 of the sampling policy against the new one, d = log π_old − log π_θ = −log r: r − 1 − ln r;
    # r = 1.5 → 0.5 − ln 1.5; r = 0.5 → −0.5 − ln 0.5
    k3 = (2 * (1.5 - 1 - math.log(1.5)) + 2 * (0.5 - 1 - math.log(0.5))) / 4
    assert_close(stats["approx_kl"], k3)
    # clip-higher (DAPO): the upper bound becomes 1.28
    per_token_hi, _ = ppo_policy_loss(logprobs, old, adv, mask, clip_low=0.2, clip_high=0.28)
    assert_close(aggregate_loss(per_token_hi, mask), (-1.28 + 1.5 - 0.5 + 0.8) / 4)
    # [B] advantages are shared by every token of the response
    per_token_b, _ = ppo_policy_loss(logprobs, old, torch.tensor([1.0]), mask)
    assert_close(aggregate_loss(per_token_b, mask), (-1.2 - 1.2 - 0.5 - 0.5) / 4)


def test_ppo_policy_loss_kl_in_loss():
    logprobs = torch.tensor([[-1.0, -2.0]])
    ref = torch.tensor([[-2.0, -2.0]])  # d = 1, 0
    mask = torch.ones(1, 2)
    pg, _ = ppo_policy_loss(logprobs, logprobs, torch.tensor([1.0]), mask)
    kl = kl_penalty(logprobs, ref, "k3", mask=mask)
    # GRPO's aggregate(ℓ + β·KL) (DeepSeekMath eq. 3): ratio 1 so the surrogate is −A = −1 per token;
    # k3 = e^{−1} + 1 − 1 at t=0 and 0 at t=1
    assert_close(aggregate_loss(pg + 0.1 * kl, mask), (-1 + 0.1 * math.exp(-1) + -1 + 0) / 2)
    assert_close(masked_mean(kl, mask), math.exp(-1) / 2)
    assert_close(aggregate_loss(pg, mask), -1.0)
    kl_k1 = kl_penalty(logprobs, ref, "k1", mask=mask)
    assert_close(aggregate_loss(pg + 0.1 * kl_k1, mask), (-1 + 0.1 * 1 - 1 + 0) / 2)


def _gspo_case():
    """Two responses, T = 3, in float64: row 0 has 2 tokens with log-ratios 0.1, 0.3 (and 9.0 at its
    padding), row 1 has 3 with −0.2, 0.1, −0.2; A = (+1, −2)."""
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    old = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, -1.5, -1.0]], dtype=torch.float64)
    log_ratio = torch.tensor([[0.1, 0.3, 9.0], [-0.2, 0.1, -0.2]], dtype=torch.float64)
    return mask, (old + log_ratio).requires_grad_(), old, torch.tensor([1.0, -2.0], dtype=torch.float64)


def test_gspo_policy_loss_by_hand():
    mask, logprobs, old, adv = _gspo_case()
    # s_0 = exp((0.1 + 0.3) / 2) = e^0.2 = 1.2214 > 1.2 with A_0 = +1: max(−1.2214, −1.2) = −1.2, clipped (no gradient)
    # s_1 = exp((−0.2 + 0.1 − 0.2) / 3) = e^−0.1 = 0.9048, inside [0.8, 1.2], A_1 = −2: ℓ_1 = 2·s_1
    s0, s1 = math.exp(0.2), math.exp(-0.1)
    per_token, stats = gspo_policy_loss(logprobs, old, adv, mask, clip_low=0.2, clip_high=0.2)
    # every valid token of a response carries the response's term (padding: 0), so seq-mean-token-mean is the paper's
    assert_close(per_token, torch.tensor([[-1.2, -1.2, 0.0], [2 * s1] * 3], dtype=torch.float64))
    loss = aggregate_loss(per_token, mask, "seq-mean-token-mean")
    assert_close(loss, (-1.2 + 2 * s1) / 2)  # the paper's (1/G) Σ_i
    (grad,) = torch.autograd.grad(loss, logprobs)
    # ∂(2·s_1)/∂logπ_t = 2·s_1/3 on each of row 1's tokens, times 1/2 (two rows)
    assert_close(grad, torch.tensor([[0.0, 0.0, 0.0], [s1 / 3] * 3], dtype=torch.float64))
    assert_close(stats["clipfrac"], 2 / 5)  # row 0's 2 tokens of the 5
    assert_close(stats["ratio_max"], s0)
    assert_close(stats["ratio_min"], s1)
    assert_close(stats["ratio_mean"], (2 * s0 + 3 * s1) / 5)
    # token-mean weighs row i by its |y_i| tokens: (2·(−1.2) + 3·2·s_1) / 5, and row 1's tokens get 3·(2·s_1/3)/5
    per_token_tm, _ = gspo_policy_loss(logprobs, old, adv, mask, clip_low=0.2, clip_high=0.2)
    loss_tm = aggregate_loss(per_token_tm, mask, "token-mean")
    assert_close(loss_tm, (2 * -1.2 + 3 * 2 * s1) / 5)
    (grad_tm,) = torch.autograd.grad(loss_tm, logprobs)
    assert_close(grad_tm[1], torch.full((3,), 2 * s1 / 5, dtype=torch.float64))


def test_gspo_token_equals_gspo_with_sequence_advantages_and_takes_token_advantages():
    mask, logprobs, old, adv = _gspo_case()
    s1 = math.exp(-0.1)
    for agg in ("seq-mean-token-mean", "token-mean"):
        seq, seq_stats = gspo_policy_loss(logprobs, old, adv, mask, clip_low=0.2, clip_high=0.2)
        tok, tok_stats = gspo_policy_loss(logprobs, old, adv, mask, clip_low=0.2, clip_high=0.2, token_level=True)
        seq, tok = aggregate_loss(seq, mask, agg), aggregate_loss(tok, mask, agg)
        assert_close(tok, seq)
        assert_close(torch.autograd.grad(tok, logprobs)[0], torch.autograd.grad(seq, logprobs)[0])
        assert_close(tok_stats["clipfrac"], seq_stats["clipfrac"])
    # per-token advantages, row 1: A = (−2, +1, −2): ℓ_{1,t} = −A_t·s_1 (s_1 inside the clip range) → mean s_1;
    # row 0 stays clipped at −1.2; each token's gradient is −A_t·s_1 / 3 / 2, its own advantage's
    token_adv = torch.tensor([[1.0, 1.0, 7.0], [-2.0, 1.0, -2.0]], dtype=torch.float64)
    per_token, _ = gspo_policy_loss(logprobs, old, token_adv, mask, clip_low=0.2, clip_high=0.2, token_level=True)
    loss = aggregate_loss(per_token, mask, "seq-mean-token-mean")
    assert_close(loss, (-1.2 + s1) / 2)
    (grad,) = torch.autograd.grad(loss, logprobs)
    assert_close(grad[1], torch.tensor([2 * s1, -s1, 2 * s1], dtype=torch.float64) / 6)
    assert_close(grad[0], torch.zeros(3, dtype=torch.float64))


def test_cispo_policy_loss_by_hand_clipped_tokens_keep_their_gradient():
    ratios = torch.tensor([[1.5, 0.5, 1.1, 1.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0]])
    logprobs = torch.tensor([[-1.0, -2.0, -0.5, float("nan")]], dtype=torch.float64).requires_grad_()
    old = logprobs.detach() - ratios.log()
    adv = torch.tensor([[1.0, -1.0, 2.0, 5.0]], dtype=torch.float64)
    per_token, stats = cispo_policy_loss(logprobs, old, adv, mask, clip_low=0.2, clip_high=0.2)
    loss = aggregate_loss(per_token, mask, "token-mean")
    # ŵ = clip(r, 0.8, 1.2) = 1.2, 0.8, 1.1; ℓ_t = −ŵ·A·logπ = −1.2·1·(−1) = 1.2, −0.8·(−1)·(−2) = −1.6,
    # −1.1·2·(−0.5) = 1.1; token-mean over 3 tokens
    assert_close(loss, (1.2 - 1.6 + 1.1) / 3)
    (grad,) = torch.autograd.grad(loss, logprobs)
    # every token trains, the two clipped ones included: ∂ℓ_t/∂logπ_t = −ŵ_t·A_t, over 3 tokens
    assert_close(grad, torch.tensor([[-1.2 * 1, -0.8 * -1, -1.1 * 2, 0.0]], dtype=torch.float64) / 3)
    assert_close(stats["clipfrac"], 2 / 3)  # weights clipped at t = 0 and 1; those tokens still train
    assert_close(stats["ratio_max"], 1.5)
    assert_close(stats["ratio_min"], 0.5)
    # PPO on the same tokens drops the clipped ones (r = 1.5 with A > 0, r = 0.5 with A < 0: gradient 0)
    # and gives the unclipped one −A·r/3, CISPO's −ŵ·A/3
    ppo = aggregate_loss(ppo_policy_loss(logprobs, old, adv, mask, clip_low=0.2, clip_high=0.2)[0], mask, "token-mean")
    (ppo_grad,) = torch.autograd.grad(ppo, logprobs)
    assert_close(ppo_grad, torch.tensor([[0.0, 0.0, -2 * 1.1 / 3, 0.0]], dtype=torch.float64))
    # clip_low ≥ 1: no lower bound (MiniMax's setting), so the weight at t = 1 is r = 0.5: ℓ_1 = −0.5·(−1)·(−2) = −1
    per_token_nl, stats_nl = cispo_policy_loss(logprobs, old, adv, mask, clip_low=1.0, clip_high=0.2)
    assert_close(aggregate_loss(per_token_nl, mask, "token-mean"), (1.2 - 1.0 + 1.1) / 3)
    assert_close(stats_nl["clipfrac"], 1 / 3)


def test_value_loss_by_hand():
    v, old, ret, m = torch.tensor([[1.0]]), torch.tensor([[0.0]]), torch.tensor([[2.0]]), torch.ones(1, 1)
    assert_close(aggregate_loss(value_loss(v, old, ret, m)[0], m), 0.5 * (1 - 2) ** 2)
    # clipped: V_old + clip(1 − 0, ±0.2) = 0.2 → (0.2 − 2)² = 3.24 > 1 → ½·3.24
    per_token, stats = value_loss(v, old, ret, m, clip_range=0.2)
    assert_close(aggregate_loss(per_token, m), 0.5 * 3.24)
    assert_close(stats["value_clipfrac"], 1.0)  # |1 − 0| > 0.2


def test_dpo_loss_by_hand():
    pc, pr, rc, rr = (torch.tensor([v]) for v in (-1.0, -2.0, -1.5, -1.5))
    # h = (−1 + 1.5) − (−2 + 1.5) = 1; β = 0.1
    losses, chosen, rejected = dpo_loss(pc, pr, rc, rr, beta=0.1)
    assert_close(losses, [math.log1p(math.exp(-0.1))])  # −log σ(0.1)
    assert_close(chosen, [0.05])
    assert_close(rejected, [-0.05])
    smoothed, _, _ = dpo_loss(pc, pr, rc, rr, beta=0.1, label_smoothing=0.1)
    assert_close(smoothed, [0.9 * math.log1p(math.exp(-0.1)) + 0.1 * math.log1p(math.exp(0.1))])
    ipo, _, _ = dpo_loss(pc, pr, rc, rr, beta=0.1, kind="ipo")
    assert_close(ipo, [(1 - 1 / 0.2) ** 2])
    hinge, _, _ = dpo_loss(pc, pr, rc, rr, beta=0.1, kind="hinge")
    assert_close(hinge, [1 - 0.1])
    with pytest.raises(ValueError, match="sigmoid"):
        dpo_loss(pc, pr, rc, rr, kind="kto")


def test_dpo_loss_is_log2_when_policy_equals_reference():
    lp = torch.tensor([-3.0, -7.5, -0.2])
    losses, chosen, rejected = dpo_loss(lp, lp - 1, lp, lp - 1, beta=0.3)
    assert_close(losses, torch.full((3,), math.log(2)))
    assert_close(chosen, torch.zeros(3))
    assert_close(rejected, torch.zeros(3))


def test_ranking_loss_by_hand():
    scores = torch.tensor([[3.0, 2.0, 0.0]])
    sp = lambda x: math.log1p(math.exp(-x))  # −log σ(x)  # noqa: E731
    # pairs (best first): 3−2 = 1, 3−0 = 3, 2−0 = 2
    assert_close(ranking_loss(scores), (sp(1) + sp(3) + sp(2)) / 3)
    # K = 2 is Bradley–Terry
    assert_close(ranking_loss(torch.tensor([[1.0, 0.0], [0.0, 1.0]])), (sp(1) + sp(-1)) / 2)
    # margin 1: the pair must win by 1, so s_i − s_j − 1 enters the sigmoid
    assert_close(ranking_loss(torch.tensor([[3.0, 2.0]]), margin=1.0), sp(0.0))
    with pytest.raises(ValueError, match="K >= 2"):
        ranking_loss(torch.tensor([[1.0]]))
