"""Entropy control (GRPO and PPO): the token selections of ``core.token_selection`` by hand, and the trainers'
selection made once over the whole step's batch, so that the update is the same for any micro-batch size."""

import json
import math

import pytest
import torch
from test_online_losses import REWARDS, StepGrads, _assert_same_grads, _grads_of_update, _varied_rollout

from posttrain.core import (
    TokenSelection,
    aggregate_loss,
    clip_cov_mask,
    high_entropy_mask,
    kl_cov_mask,
    selected_policy_loss,
    token_covariance,
)
from posttrain.data.synthetic import arithmetic_sft
from posttrain.runtime.config import load_config
from posttrain.runtime.entropy_control import EntropyControlConfig
from posttrain.trainers.grpo import GRPOConfig, GRPOTrainer
from posttrain.trainers.ppo import PPOConfig, PPOTrainer

NAN = math.nan

# -- core, by hand ------------------------------------------------------------------------------------


def test_high_entropy_mask_by_hand_keeps_every_tie_at_the_threshold():
    # valid entropies 0.9 0.1 0.5 | 0.5 0.3 0.8 0.2 (N = 7); the masked slot holds NaN
    entropy = torch.tensor([[0.9, 0.1, 0.5, NAN], [0.5, 0.3, 0.8, 0.2]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    # ρ = 0.2: k = ⌈1.4⌉ = 2, sorted 0.9 0.8 | 0.5 ...: τ = 0.8, the tokens 0.9 and 0.8
    assert high_entropy_mask(entropy, mask, 0.2).tolist() == [[True, False, False, False], [False, False, True, False]]
    # ρ = 0.4: k = ⌈2.8⌉ = 3, τ = 0.5, tied by the second 0.5: both kept, 4 of 7 tokens
    assert high_entropy_mask(entropy, mask, 0.4).tolist() == [[True, False, True, False], [True, False, True, False]]
    # ρ = 1: every valid token, never the masked one
    assert high_entropy_mask(entropy, mask, 1.0).tolist() == mask.bool().tolist()
    # no valid token: nothing (the threshold of no token is −inf, and no token is valid)
    assert not high_entropy_mask(entropy, torch.zeros_like(mask), 0.2).any()


def test_counts_are_the_shares_without_float_residue():
    """ρ = 0.07 of 100 tokens is 7 (0.07·100 = 7.000000000000001 in floating point, whose ceiling is 8); KL-Cov's
    k = 0.7 of 90 is 63 (0.7·90 = 62.99999999999999, whose floor is 62)."""
    entropy = torch.arange(100.0).view(4, 25)
    assert entropy[high_entropy_mask(entropy, torch.ones(4, 25), 0.07)].tolist() == [
        93.0,
        94.0,
        95.0,
        96.0,
        97.0,
        98.0,
        99.0,
    ]
    assert kl_cov_mask(torch.arange(90.0).view(3, 30), torch.ones(3, 30), 0.7).sum() == 63


def test_token_covariance_by_hand():
    # valid log-probs −0.5 −2.0 | −3.5: mean −2.0; advantages (one per row) 2 2 | −1: mean 1
    logprobs = torch.tensor([[-0.5, -2.0], [-3.5, NAN]])
    mask = torch.tensor([[1, 1], [1, 0]])
    cov = token_covariance(logprobs, torch.tensor([2.0, -1.0]), mask)
    # (−0.5 + 2)(2 − 1) = 1.5;  (−2 + 2)(2 − 1) = 0;  (−3.5 + 2)(−1 − 1) = 3.0;  masked: 0
    assert cov.tolist() == [[1.5, 0.0], [3.0, 0.0]]
    per_token = token_covariance(logprobs, torch.tensor([[2.0, 2.0], [-1.0, 7.0]]), mask)  # [B, T] alike
    assert per_token.tolist() == cov.tolist()


def test_clip_cov_detaches_tokens_drawn_from_the_band_only():
    # band [1, 5] (both ends in): 1.0, 5.0 | 3.0, 2.0 are candidates (flat positions 1, 2, 4, 6), 0.5, 6.0, −2 not
    cov = torch.tensor([[0.5, 1.0, 5.0, 6.0], [3.0, -2.0, 2.0, NAN]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])
    candidates = torch.tensor([1, 2, 4, 6])
    for seed in range(20):
        # r = 0.3: n = ⌊0.3·7⌋ = 2 tokens, the first two of a seeded permutation of the candidates
        selected = clip_cov_mask(cov, mask, 0.3, 1.0, 5.0, torch.Generator().manual_seed(seed))
        drawn = candidates[torch.randperm(4, generator=torch.Generator().manual_seed(seed))[:2]]
        expected = mask.bool().flatten().clone()
        expected[drawn] = False
        assert selected.flatten().tolist() == expected.tolist()
    # r·N < 1 still detaches one token (the authors' max(1, ·)); a band without candidates detaches none
    assert (mask.bool() & ~clip_cov_mask(cov, mask, 1e-4, 1.0, 5.0, torch.Generator())).sum() == 1
    assert clip_cov_mask(cov, mask, 0.3, 10.0, 20.0, torch.Generator()).tolist() == mask.bool().tolist()


def test_kl_cov_penalises_the_top_k_covariance_ties_by_position():
    # valid covariances 3, 1, 3 | 5, 0 (N = 5); the masked slot holds NaN
    cov = torch.tensor([[3.0, 1.0, 3.0], [5.0, NAN, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 1]])
    # k = ⌊0.4·5⌋ = 2: 5, then the first of the tied 3s (row 0, position 0)
    assert kl_cov_mask(cov, mask, 0.4).tolist() == [[True, False, False], [True, False, False]]
    # k·N < 1: at least one token, the largest
    assert kl_cov_mask(cov, mask, 1e-3).tolist() == [[False, False, False], [True, False, False]]


def test_selected_policy_loss_value_and_gradient_by_hand():
    logprobs = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    old = torch.tensor([[-1.2, -2.0, -0.1]])
    per_token = torch.where(torch.tensor([[True, False, True]]), 2.0 * logprobs, NAN)  # NaN at the dropped token
    selection = TokenSelection(torch.tensor([[True, False, True]]), torch.tensor([[False, False, True]]))
    loss = selected_policy_loss(per_token, logprobs, old, selection, kl_cov_coef=0.5)
    # 2·(−1) = −2;  dropped: 0;  2·(−0.5) + 0.5·|−0.5 + 0.1| = −1 + 0.2 = −0.8
    torch.testing.assert_close(loss, torch.tensor([[-2.0, 0.0, -0.8]]))
    # over all 3 tokens (J_HighEnt's normaliser is every token): (−2 + 0 − 0.8) / 3
    torch.testing.assert_close(aggregate_loss(loss, torch.ones(1, 3), "token-mean"), torch.tensor(-2.8 / 3))
    loss.sum().backward()
    # d/dlogπ: 2;  0 (not NaN);  2 + 0.5·sign(−0.4) = 1.5
    torch.testing.assert_close(logprobs.grad, torch.tensor([[2.0, 0.0, 1.5]]))


def test_config_is_checked_at_start_naming_the_field():
    """A bad knob names the field; KL-Cov with one update per rollout (a penalty that is 0) and a selection
    with GSPO's one ratio per response (a token left out still trains) are refused with the way out."""
    with pytest.raises(ValueError, match=r"entropy_control.method must be one of .*got 'high'"):
        EntropyControlConfig(method="high").validate()
    with pytest.raises(ValueError, match=r"entropy_control.high_entropy_ratio must be in \(0, 1\], got 0"):
        EntropyControlConfig(high_entropy_ratio=0).validate()
    with pytest.raises(ValueError, match="entropy_control.clip_cov_low must be <= clip_cov_high"):
        EntropyControlConfig(clip_cov_low=6.0).validate()
    base = ["model.path=m", "data.path=d", "rewards=[{function: 'posttrain.rewards.builtin:exact_answer'}]"]
    kl_cov, high = "entropy_control.method=kl_cov", "entropy_control.method=high_entropy"
    with pytest.raises(ValueError, match=r"method=kl_cov with one update per rollout \(num_iterations=1, minib"):
        load_config(GRPOConfig, None, [*base, kl_cov])
    assert load_config(GRPOConfig, None, [*base, kl_cov, "num_iterations=2"])
    with pytest.raises(ValueError, match=r"method=kl_cov with one update per rollout \(ppo_epochs=1, minibatches"):
        load_config(PPOConfig, None, [*base, "critic=policy", "ppo_epochs=1", kl_cov])
    with pytest.raises(ValueError, match="method=high_entropy with policy_loss=gspo: .* use policy_loss=gspo-token"):
        load_config(GRPOConfig, None, [*base, high, "policy_loss=gspo"])


def test_a_knob_the_method_does_not_read_is_refused_at_start():
    """Another method's knob (KL-Cov with Clip-Cov's ratio: a mix-up that would run with the default k), or any
    knob with method=none, fails at start naming it and the method that reads it, as ``reject_ignored`` does."""
    base = ["model.path=m", "data.path=d", "rewards=[{function: 'posttrain.rewards.builtin:exact_answer'}]"]
    kl_cov = ["entropy_control.method=kl_cov", "num_iterations=2"]
    with pytest.raises(ValueError, match=r"entropy_control.clip_cov_ratio=0.002 is not used by .*=kl_cov: only clip"):
        load_config(GRPOConfig, None, [*base, *kl_cov, "entropy_control.clip_cov_ratio=2e-3"])
    with pytest.raises(ValueError, match=r"entropy_control.high_entropy_ratio=0.1 is not used by .*method=none"):
        load_config(PPOConfig, None, [*base, "critic=policy", "entropy_control.high_entropy_ratio=0.1"])
    own = load_config(
        GRPOConfig, None, [*base, *kl_cov, "entropy_control.kl_cov_ratio=0.02", "entropy_control.kl_cov_coef=2"]
    )
    assert (own.entropy_control.kl_cov_ratio, own.entropy_control.kl_cov_coef) == (0.02, 2)


# -- trainers: one selection per step, whatever the micro-batches ---------------------------------------


@pytest.fixture
def files(tiny_dir, tmp_path):
    (tmp_path / "my_rewards.py").write_text(REWARDS)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": r["prompt"]}) + "\n" for r in arithmetic_sft(32, seed=1)))
    return {"policy": str(tiny_dir / "policy"), "prompts": str(prompts), "rewards": str(tmp_path / "my_rewards.py")}


def _common(files, tmp_path, name) -> list[str]:
    return [
        f"model.path={files['policy']}",
        f"data.path={files['prompts']}",
        "data.chat_template=never",
        f"run.output_dir={tmp_path / name}",
        "run.progress=false",
        "run.report_to=[jsonl]",
        "run.batch_size=8",
        "run.micro_batch_size=8",
        "sampling.max_new_tokens=6",
        "optim.max_grad_norm=null",
    ]


# each method with ratios large enough that 8 rows of up to 6 tokens select a handful; KL-Cov's penalty acts
# here from the first update, the old log-probs being off-policy
METHODS = {
    "high_entropy": EntropyControlConfig("high_entropy", high_entropy_ratio=0.3),
    "clip_cov": EntropyControlConfig("clip_cov", clip_cov_ratio=0.2, clip_cov_low=-100.0),
    "kl_cov": EntropyControlConfig("kl_cov", kl_cov_ratio=0.2, kl_cov_coef=5.0),
}


def _selection_and_grads(trainer, rollout, inputs, micro: int):
    """The step's selection (made with micro-batches of ``micro`` rows) and the gradients of the update with it."""
    trainer.config.run.micro_batch_size = micro
    old, advantages, mask = inputs
    metrics = {}
    selection = trainer.select_tokens(0, rollout, old, advantages[:, None].expand_as(mask), mask, metrics)
    grads = _grads_of_update(trainer, rollout, (old, None, advantages, mask, selection))
    return selection, grads, metrics


def test_grpo_selection_and_update_do_not_depend_on_micro_batches(files, tmp_path):
    """The selection is made once over the step's batch (the entropy threshold, the covariance's means, the
    top-k, the seeded draw): for each method micro-batches of 8, 2 and 3 rows give the same tokens and the
    same gradient, and the gradient is not the unselected one (the method is on)."""
    overrides = [
        *_common(files, tmp_path, "grpo"),
        f"rewards=[{{function: '{files['rewards']}:digit_sum'}}]",
        "num_generations=2",
        "kl_coef=0",
        "clip_low=0.05",
    ]
    trainer = GRPOTrainer(load_config(GRPOConfig, None, overrides))
    trainer._grads = StepGrads(policy=trainer.actor.optimizer)
    rollout = _varied_rollout(trainer)
    g = torch.Generator().manual_seed(1)
    inputs = (rollout.logprobs + 0.1 * torch.randn(rollout.logprobs.shape, generator=g), torch.randn(8, generator=g))
    inputs = (*inputs, rollout.response_mask)
    unselected = _grads_of_update(trainer, rollout, (inputs[0], None, inputs[1], inputs[2]))
    for method, control in METHODS.items():
        trainer.config.entropy_control = control
        selection, whole, metrics = _selection_and_grads(trainer, rollout, inputs, 8)
        share = selection.selected.sum() / rollout.response_mask.sum()
        assert metrics["policy/selected_share"] == pytest.approx(float(share)), method
        assert selection.penalised.any() if method == "kl_cov" else share < 1, method
        for micro in (2, 3):
            again, split, _ = _selection_and_grads(trainer, rollout, inputs, micro)
            assert torch.equal(again.selected, selection.selected), method
            assert torch.equal(again.penalised, selection.penalised), method
            _assert_same_grads(whole, split, rtol=1e-4, atol=1e-6)
        assert any(not torch.allclose(a, b) for a, b in zip(whole["policy"], unselected["policy"], strict=True))


def test_ppo_high_entropy_selection_and_update_do_not_depend_on_micro_batches(files, tmp_path, tiny_dir):
    overrides = [
        *_common(files, tmp_path, "ppo"),
        f"reward_model.path={tiny_dir / 'reward'}",
        "critic=policy",
        "ppo_epochs=1",
        "entropy_control.method=high_entropy",
    ]
    trainer = PPOTrainer(load_config(PPOConfig, None, overrides))
    trainer._grads = StepGrads(policy=trainer.actor.optimizer, critic=trainer.critic.trained.optimizer)
    rollout = _varied_rollout(trainer)
    g = torch.Generator().manual_seed(0)
    B, T = rollout.response_ids.shape
    old_values, advantages, returns = (torch.randn(B, T, generator=g) for _ in range(3))
    mask = rollout.response_mask
    results = []
    for micro in (8, 2, 3):
        trainer.config.run.micro_batch_size = micro
        selection = trainer.select_tokens(0, rollout, rollout.logprobs, advantages, mask, {})
        inputs = (rollout.logprobs, old_values, advantages, returns, mask, selection)
        results.append((selection, _grads_of_update(trainer, rollout, inputs)))
    (first, whole), *others = results
    assert 0 < first.selected.sum() < mask.sum()
    for selection, grads in others:
        assert torch.equal(selection.selected, first.selected)
        _assert_same_grads(whole, grads, rtol=1e-4, atol=1e-6)
