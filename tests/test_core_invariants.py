"""Invariants of posttrain.core: garbage at masked positions, gradients, micro-batching, identities."""

import math

import pytest
import torch
from helpers import assert_close

from posttrain.core import (
    AGGREGATION_MODES,
    DPO_KINDS,
    KL_ESTIMATORS,
    POLICY_LOSSES,
    aggregate_loss,
    cispo_policy_loss,
    dpo_loss,
    gae,
    gmpo_policy_loss,
    gspo_policy_loss,
    kl_penalty,
    masked_mean,
    masked_whiten,
    policy_loss_knobs,
    ppo_policy_loss,
    ranking_loss,
    sapo_policy_loss,
    shape_rewards,
    value_loss,
)

B, T = 4, 6


def _batch(seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([6, 3, 0, 1])  # a full row, a short one, an empty one, a single token
    mask = (torch.arange(T)[None, :] < lengths[:, None]).long()
    r = lambda: torch.randn(B, T, generator=g, dtype=dtype)  # noqa: E731
    return mask, r


def _poison(x, mask, value):
    return torch.where(mask.bool(), x, torch.full_like(x, value))


# Each case: name -> (function of the per-token inputs, number of per-token inputs)
def _cases():
    adv_b = torch.tensor([1.0, -0.5, 2.0, 0.3], dtype=torch.float64)
    cases = {
        "masked_mean": (lambda m, x: masked_mean(x, m), 1),
        "masked_whiten": (lambda m, x: masked_whiten(x, m).sum(), 1),
        "shape_rewards": (lambda m, kl: shape_rewards(torch.ones(B, dtype=kl.dtype), kl, m, 0.1).sum(), 1),
        "gae": (lambda m, r, v: sum(t.sum() for t in gae(r, v, m, gamma=0.9, lam=0.8)), 2),
        "value_loss": (lambda m, v, o, ret: aggregate_loss(value_loss(v, o, ret, m, clip_range=0.2)[0], m), 3),
        "ppo_token_adv": (lambda m, lp, old, a: aggregate_loss(ppo_policy_loss(lp, old, a, m)[0], m), 3),
        "ppo_kl_in_loss": (
            lambda m, lp, old, ref: aggregate_loss(
                ppo_policy_loss(lp, old, adv_b, m)[0] + 0.1 * kl_penalty(lp, ref, "k3", mask=m), m
            ),
            3,
        ),
        "gspo": (lambda m, lp, old: aggregate_loss(gspo_policy_loss(lp, old, adv_b, m, clip_low=0.2)[0], m), 2),
        "gspo_token_adv": (
            lambda m, lp, old, a: aggregate_loss(gspo_policy_loss(lp, old, a, m, clip_low=0.2, token_level=True)[0], m),
            3,
        ),
        "cispo_token_adv": (
            lambda m, lp, old, a: aggregate_loss(cispo_policy_loss(lp, old, a, m, clip_low=0.2)[0], m),
            3,
        ),
        "gmpo": (
            lambda m, lp, old: aggregate_loss(gmpo_policy_loss(lp, old, adv_b, m)[0], m, "seq-mean-token-mean"),
            2,
        ),
        "sapo_token_adv": (lambda m, lp, old, a: aggregate_loss(sapo_policy_loss(lp, old, a, m)[0], m), 3),
        "cispo_kl_in_loss": (
            lambda m, lp, old, ref: aggregate_loss(
                cispo_policy_loss(lp, old, adv_b, m, clip_low=0.2)[0] + 0.1 * kl_penalty(lp, ref, "k3", mask=m), m
            ),
            3,
        ),
    }
    for mode in AGGREGATION_MODES:
        cases[f"aggregate_{mode}"] = (lambda m, x, mode=mode: aggregate_loss(x, m, mode), 1)
    return cases


@pytest.mark.parametrize("name", list(_cases()))
@pytest.mark.parametrize("garbage", [float("nan"), float("inf"), -float("inf"), 1e30])
def test_garbage_at_masked_positions_changes_nothing(name, garbage):
    fn, n_inputs = _cases()[name]
    mask, rand = _batch()
    clean = [(0.3 * rand()).requires_grad_() for _ in range(n_inputs)]
    dirty = [_poison(x.detach(), mask, garbage).requires_grad_() for x in clean]
    out_clean, out_dirty = fn(mask, *clean), fn(mask, *dirty)
    assert torch.isfinite(out_dirty).all()
    assert_close(out_dirty, out_clean)
    out_clean.backward()
    out_dirty.backward()
    for c, d in zip(clean, dirty, strict=True):
        if c.grad is None:  # an input behind a stop-gradient (GSPO-token's, CISPO's old log-probs)
            assert d.grad is None
            continue
        assert torch.isfinite(d.grad).all(), f"{name}: non-finite gradient with {garbage} at padding"
        assert_close(d.grad, c.grad)
        assert (d.grad[mask == 0] == 0).all()


def test_reward_to_go_when_gamma_lambda_one_and_values_zero():
    mask, rand = _batch()
    rewards = rand()
    adv, ret = gae(rewards, torch.zeros(B, T, dtype=rewards.dtype), mask, gamma=1.0, lam=1.0)
    masked = torch.where(mask.bool(), rewards, 0.0)
    reward_to_go = masked.flip(1).cumsum(1).flip(1)  # Σ_{t' ≥ t} r_t'
    assert_close(adv, torch.where(mask.bool(), reward_to_go, 0.0))
    assert_close(ret, adv)


def test_kl_estimators_zero_when_policies_match_and_k3_nonnegative():
    g = torch.Generator().manual_seed(0)
    lp = -torch.rand(1000, generator=g) * 10
    for est in KL_ESTIMATORS:
        assert kl_penalty(lp, lp, est).abs().max().item() == 0.0
    other = -torch.rand(1000, generator=g) * 10
    assert (kl_penalty(lp, other, "k3") >= 0).all()
    assert (kl_penalty(lp, other, "k2") >= 0).all()


def test_kl_estimators_are_unbiased_on_samples_from_policy():
    # π = softmax(a), π_ref = softmax(b) over 5 actions; E_{x~π}[k1] = E[k3] = KL(π‖π_ref) exactly
    a, b = torch.tensor([0.1, 1.0, -0.3, 2.0, 0.0]), torch.tensor([0.5, 0.2, 0.0, 1.0, -1.0])
    lp, ref = torch.log_softmax(a.double(), 0), torch.log_softmax(b.double(), 0)
    p = lp.exp()
    kl = (p * (lp - ref)).sum()
    assert_close((p * kl_penalty(lp, ref, "k1")).sum(), kl)
    assert_close((p * kl_penalty(lp, ref, "k3")).sum(), kl)


def test_ppo_ratio_one_and_no_clipping_on_policy():
    mask, rand = _batch(dtype=torch.float32)
    lp = rand()
    loss, stats = ppo_policy_loss(lp, lp.clone(), rand(), mask)
    assert stats["clipfrac"].item() == 0.0
    assert stats["ratio_mean"].item() == 1.0
    assert stats["ratio_max"].item() == 1.0
    assert stats["approx_kl"].item() == 0.0


def test_ppo_empty_mask_is_finite_zero():
    mask = torch.zeros(2, 3)
    per_token, stats = ppo_policy_loss(torch.full((2, 3), float("nan")), torch.zeros(2, 3), torch.ones(2), mask)
    assert aggregate_loss(per_token, mask).item() == 0.0
    assert all(torch.isfinite(v) for v in stats.values())


def _knobs(name):
    """The keyword knobs of ``POLICY_LOSSES[name]``: PPO's clip range (GMPO's, in log space), SAPO's defaults."""
    return policy_loss_knobs(name, clip_low=0.2, clip_high=None, tau_pos=1.0, tau_neg=1.05)


@pytest.mark.parametrize("name", list(POLICY_LOSSES))
@pytest.mark.parametrize("mode", AGGREGATION_MODES)
def test_every_policy_loss_on_policy_has_ratio_one_and_the_ppo_gradient(name, mode):
    """π = π_old: every ratio is exactly 1 and nothing is clipped (docs/pitfalls.md #4), and the gradient is
    the plain policy gradient, the same for every policy loss in every aggregation (GSPO: s_i = 1 and
    ∂s_i/∂logπ_t = 1/|y_i| on each of the |y_i| tokens, GMPO's geometric mean g_i likewise; CISPO: weight 1 on
    ∇logπ; SAPO: gate slope 4·σ'(0) = 1). An empty mask gives 0."""
    mask, rand = _batch()
    old = 0.3 * rand()
    adv_b = torch.tensor([1.0, -0.5, 2.0, 0.3], dtype=torch.float64)
    for adv in (adv_b, rand()) if name not in ("gspo", "gmpo") else (adv_b,):  # one advantage per response
        lp = old.clone().requires_grad_()
        per_token, stats = POLICY_LOSSES[name](lp, old, adv, mask, **_knobs(name))
        loss = aggregate_loss(per_token, mask, mode, norm_length=T)
        assert stats["ratio_max"].item() == stats["ratio_min"].item() == 1.0 and stats["clipfrac"].item() == 0.0
        lp_ppo = old.clone().requires_grad_()
        ppo = aggregate_loss(ppo_policy_loss(lp_ppo, old, adv, mask, clip_low=0.2)[0], mask, mode, norm_length=T)
        assert_close(torch.autograd.grad(loss, lp)[0], torch.autograd.grad(ppo, lp_ppo)[0])
    empty = torch.zeros(2, 3)
    per_token, stats = POLICY_LOSSES[name](
        torch.full((2, 3), float("nan")), torch.zeros(2, 3), torch.ones(2), empty, **_knobs(name)
    )
    assert aggregate_loss(per_token, empty).item() == 0.0
    assert all(torch.isfinite(v) for v in stats.values())


@pytest.mark.parametrize("name", list(POLICY_LOSSES))
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum-norm"])
def test_micro_batches_recombined_with_counts_match_full_batch(mode, name):
    """Normalising each micro-batch by the global count makes the sum of their losses, and so the
    accumulated gradient, identical to one full-batch step (docs/pitfalls.md #1), for every policy loss."""
    mask, rand = _batch()
    lp, old, adv = rand().requires_grad_(), rand(), rand()
    policy_loss = POLICY_LOSSES[name]
    full = aggregate_loss(policy_loss(lp, old, adv, mask, **_knobs(name))[0], mask, mode)
    (full_grad,) = torch.autograd.grad(full, lp)
    assert full_grad.abs().sum() > 0

    total_tokens = mask.sum()
    accumulated = torch.zeros((), dtype=lp.dtype)
    for rows in ([0], [1, 2], [3]):
        per_token, _ = policy_loss(lp[rows], old[rows], adv[rows], mask[rows], **_knobs(name))
        mb_loss = aggregate_loss(per_token, mask[rows], mode)
        if mode == "token-mean":
            weight = mask[rows].sum().item() / total_tokens.item()
        else:  # Σ x / (B_mb·T) → Σ x / (B·T)
            weight = len(rows) / B
        accumulated = accumulated + mb_loss * weight
    (acc_grad,) = torch.autograd.grad(accumulated, lp)
    assert_close(accumulated, full)
    assert_close(acc_grad, full_grad)


def test_mean_of_micro_batch_means_differs_from_token_mean():
    """The bug docs/pitfalls.md #1 describes really does change the number: the test above is not vacuous."""
    mask, rand = _batch()
    x = rand()
    full = aggregate_loss(x, mask, "token-mean")
    naive = sum(aggregate_loss(x[r], mask[r], "token-mean") for r in ([0], [1, 2], [3])) / 3
    assert not torch.allclose(full, naive)


def _gradcheck_inputs(shape, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64, requires_grad=True)


@pytest.mark.parametrize("mode", AGGREGATION_MODES)
def test_gradcheck_aggregate_and_value_loss(mode):
    mask, _ = _batch()
    x = _gradcheck_inputs((B, T), 0)
    assert torch.autograd.gradcheck(lambda x: aggregate_loss(x, mask, mode), (x,))
    v, old, ret = (_gradcheck_inputs((B, T), s) for s in (1, 2, 3))
    assert torch.autograd.gradcheck(
        lambda v: aggregate_loss(value_loss(v, old.detach(), ret.detach(), mask, clip_range=0.2)[0], mask, mode), (v,)
    )


@pytest.mark.parametrize("kl_estimator", KL_ESTIMATORS)
def test_gradcheck_ppo_policy_loss(kl_estimator):
    mask, _ = _batch()
    lp = _gradcheck_inputs((B, T), 0)
    # old log-probs away from the clip edges, so the loss is differentiable where it is checked
    old = (lp + 0.05 * torch.randn(B, T, generator=torch.Generator().manual_seed(9), dtype=torch.float64)).detach()
    ref, adv = _gradcheck_inputs((B, T), 2).detach(), _gradcheck_inputs((B,), 3).detach()

    def f(lp):
        per_token = ppo_policy_loss(lp, old, adv, mask)[0] + 0.3 * kl_penalty(lp, ref, kl_estimator, mask=mask)
        return aggregate_loss(per_token, mask)

    assert torch.autograd.gradcheck(f, (lp,))


def test_gradcheck_gspo():
    """GSPO's gradient is its value's derivative; GSPO-token's and CISPO's are not, by design (stop-gradients
    in the value), and tests/test_core_values.py works theirs out by hand."""
    mask, _ = _batch()
    lp = _gradcheck_inputs((B, T), 0)
    # old log-probs away from the clip edges, so the loss is differentiable where it is checked
    old = (lp + 0.05 * torch.randn(B, T, generator=torch.Generator().manual_seed(9), dtype=torch.float64)).detach()
    ref, adv = _gradcheck_inputs((B, T), 2).detach(), _gradcheck_inputs((B,), 3).detach()

    def f(lp):
        per_token = gspo_policy_loss(lp, old, adv, mask, clip_low=0.02, clip_high=None)[0]
        return aggregate_loss(per_token + 0.3 * kl_penalty(lp, ref, "k3", mask=mask), mask, "seq-mean-token-mean")

    assert torch.autograd.gradcheck(f, (lp,))


@pytest.mark.parametrize("kind", DPO_KINDS)
def test_gradcheck_dpo_loss(kind):
    inputs = [_gradcheck_inputs((5,), s) for s in range(4)]
    assert torch.autograd.gradcheck(lambda *x: dpo_loss(*x, beta=0.2, kind=kind, label_smoothing=0.1)[0].sum(), inputs)


def test_gradcheck_ranking_loss_and_whiten():
    assert torch.autograd.gradcheck(ranking_loss, (_gradcheck_inputs((3, 4), 0),))
    mask, _ = _batch()
    assert torch.autograd.gradcheck(lambda x: masked_whiten(x, mask), (_gradcheck_inputs((B, T), 1),))


def test_ranking_loss_sign_prefers_correct_order():
    right = ranking_loss(torch.tensor([[2.0, 1.0, 0.0]]))
    wrong = ranking_loss(torch.tensor([[0.0, 1.0, 2.0]]))
    assert right < math.log(2) < wrong
