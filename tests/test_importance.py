"""Masked importance sampling (``core.masked_importance_weights``): IcePop's token band and MIS's sequence
band, against values worked by hand. Truncated IS (TIS) is in test_rollout_seam.py."""

import math

import pytest
import torch
from helpers import assert_close

from posttrain.core import masked_importance_weights

NAN = float("nan")


def test_token_band_keeps_the_ratio_inside_and_drops_the_token_outside():
    # log-ratios old − behaviour: 0.5, 0, −1, 1.0 → ρ = 1.649, 1, 0.368, 2.718; band [0.5, 2]
    old = torch.tensor([[0.0, -1.0, -2.0, 0.0]])
    behaviour = torch.tensor([[-0.5, -1.0, -1.0, -1.0]])
    weights, keep = masked_importance_weights(old, behaviour, torch.ones(1, 4), "token", 0.5, 2.0)
    assert keep.tolist() == [[True, True, False, False]]
    assert_close(weights, [[math.exp(0.5), 1.0, 0.0, 0.0]])


def test_sequence_band_keeps_or_drops_whole_rows():
    # row 0: Σ log-ratio = 0.5 − 0.3 = 0.2 → ρ = 1.221, kept; row 1: 0.9 → 2.46 > 2, dropped;
    # row 2: −0.8 → 0.449 < 0.5, dropped; padding (mask 0) holds NaN and changes nothing
    old = torch.tensor([[0.0, -1.3, NAN], [0.0, 0.0, 0.0], [-0.8, 0.0, 0.0]])
    behaviour = torch.tensor([[-0.5, -1.0, 0.0], [-0.4, -0.5, 0.0], [0.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 1, 1]])
    weights, keep = masked_importance_weights(old, behaviour, mask, "sequence", 0.5, 2.0)
    assert keep.tolist() == [[True, True, False], [False] * 3, [False] * 3]
    assert_close(weights, [[math.exp(0.2), math.exp(0.2), 1.0], [0.0] * 3, [0.0] * 3])


def test_a_zero_low_bound_keeps_every_small_ratio_and_long_rows_do_not_overflow():
    old, behaviour = torch.zeros(2, 4096), torch.full((2, 4096), 1.0)
    behaviour[1] = -1.0  # row 1: Σ = 4096, exp would overflow float32 were it taken
    weights, keep = masked_importance_weights(old, behaviour, torch.ones(2, 4096), "sequence", 0.0, 2.0)
    assert keep[0].all() and not keep[1].any()
    assert torch.isfinite(weights).all() and float(weights[0, 0]) == 0.0  # exp(−4096) underflows to 0


def test_the_weights_carry_no_gradient():
    old = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    weights, _ = masked_importance_weights(old, torch.tensor([[-1.1, -2.0]]), torch.ones(1, 2), "token")
    assert not weights.requires_grad


@pytest.mark.parametrize(("low", "high"), [(1.5, 2.0), (0.5, 0.9), (-0.1, 2.0)])
def test_a_band_without_one_is_refused(low, high):
    with pytest.raises(ValueError, match="band must hold 1"):
        masked_importance_weights(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2), "token", low, high)


# --------------------------------------------------------------------------------------------------
# truncated sampling (issue 34 item 5): the behaviour log-prob of the distribution top-k / top-p / min-p drew from
# --------------------------------------------------------------------------------------------------


def test_truncated_logprobs_by_hand():
    from posttrain.core import truncated_importance_weights, truncated_logprobs

    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    tokens = torch.tensor([0, 1, 2])
    # top-k 2 keeps {0, 1}: log μ(0) = 2 − log(e² + e¹) = −log(1 + e⁻¹); log μ(1) = −log(1 + e); token 2 is out
    got = truncated_logprobs(logits.expand(3, 4), tokens, top_k=2)
    assert_close(got[:2], [-math.log(1 + math.exp(-1)), -math.log(1 + math.e)])
    assert got[2] == -math.inf
    # τ = 2: z/τ = [1, 0.5, 0, −0.5], top-k 2: log μ(0) = −log(1 + e^−0.5)
    assert_close(truncated_logprobs(logits, torch.tensor(0), temperature=2.0, top_k=2), -math.log(1 + math.exp(-0.5)))
    # probabilities [0.5, 0.3, 0.15, 0.05]; top-p 0.7: the mass at or below 0.05 and 0.15 (0.05, 0.2) is ≤ 0.3,
    # so {0, 1} stay and μ(0) = 0.5/0.8; top-p 0.85 drops 0.05 only: μ(2) = 0.15/0.95
    p = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    assert_close(truncated_logprobs(p, torch.tensor(0), top_p=0.7).exp(), 0.625)
    assert truncated_logprobs(p, torch.tensor(2), top_p=0.7) == -math.inf
    assert_close(truncated_logprobs(p, torch.tensor(2), top_p=0.85).exp(), 0.15 / 0.95)
    # min-p 0.4 keeps p ≥ 0.4·0.5 = 0.2: {0, 1}; min-p 0.25 keeps p ≥ 0.125: {0, 1, 2}
    assert_close(truncated_logprobs(p, torch.tensor(0), min_p=0.4).exp(), 0.625)
    assert_close(truncated_logprobs(p, torch.tensor(2), min_p=0.25).exp(), 0.15 / 0.95)
    # nothing truncated: the full softmax
    assert_close(truncated_logprobs(p, torch.tensor(1)).exp(), 0.3)
    # the importance weight of token 0 drawn with top-p 0.7, at equal weights: π/μ = 0.5/0.625 = 0.8 (the
    # mass kept) against the truncated distribution; 1 against the full one (today's hf/lean convention)
    mask = torch.ones(1, 1)
    full = p[0].reshape(1, 1)
    truncated = truncated_logprobs(p, torch.tensor(0), top_p=0.7).reshape(1, 1)
    assert_close(truncated_importance_weights(full, truncated, mask, "token", 2.0), [[0.8]])
    assert_close(truncated_importance_weights(full, full, mask, "token", 2.0), [[1.0]])


def _row_logits(policy, rollout, row: int) -> torch.Tensor:
    """The training forward's logits [T_row, V] that score row ``row``'s response tokens."""
    prompt = rollout.prompt_ids[row][rollout.prompt_mask[row].bool()]
    response = rollout.response_ids[row][rollout.response_mask[row].bool()]
    ids = torch.cat([prompt, response])[None]
    with torch.no_grad():
        logits = policy(input_ids=ids).logits[0]
    return logits[len(prompt) - 1 : -1]


@pytest.mark.parametrize("engine_name", ["lean", "hf"])
def test_lean_and_hf_behaviour_logprobs_in_each_mode_and_their_importance_weights(tiny_dir, engine_name):
    from posttrain.core import token_logprobs, truncated_importance_weights, truncated_logprobs
    from posttrain.models import ModelConfig, load_policy, load_tokenizer
    from posttrain.rollout import HFEngine, LeanEngine, SamplingParams

    path = str(tiny_dir / "policy")
    policy, tokenizer = load_policy(ModelConfig(path=path, device="cpu")), load_tokenizer(path)
    params = SamplingParams(max_new_tokens=6, temperature=0.8, top_k=2)
    prompts = [tokenizer(text)["input_ids"] for text in ("ab", "3+4=")]
    for truncated in (False, True):
        engine = {"lean": LeanEngine, "hf": HFEngine}[engine_name](policy, tokenizer, truncated=truncated)
        assert engine.logprobs_exact is not truncated  # truncated: π_old is recomputed by the training forward
        torch.manual_seed(0)
        rollout = engine.generate(prompts, params, n=4)
        for row in range(len(rollout)):
            logits, y = _row_logits(policy, rollout, row), rollout.response_ids[row][rollout.response_mask[row].bool()]
            full = token_logprobs(logits[None], y[None], 0.8)[0]
            kept = truncated_logprobs(logits, y, 0.8, top_k=2)
            sampled = rollout.logprobs[row, : len(y)]
            assert_close(sampled, kept if truncated else full, atol=1e-4)
            weights = truncated_importance_weights(full[None], sampled[None], torch.ones(1, len(y)), "token", 1e9)
            if truncated:  # π/μ = the mass top-2 kept: below 1 (the vocabulary has more than 2 tokens)
                assert float(weights.max()) <= 1 + 1e-5 and float(weights.min()) < 0.999
                assert_close(weights[0], (full - kept).exp(), atol=1e-4)
            else:
                assert_close(weights, torch.ones_like(weights), atol=1e-4)


def test_behaviour_logprobs_settings():
    from posttrain.rollout import RolloutConfig, SamplingParams
    from posttrain.rollout.vllm_engine import check_vllm_logprobs

    with pytest.raises(ValueError, match="behaviour_logprobs must be one of"):
        RolloutConfig(behaviour_logprobs="raw").validate()
    RolloutConfig(engine="lean", importance_sampling="token", behaviour_logprobs="truncated").validate()
    with pytest.raises(ValueError, match="importance_sampling applies to"):
        RolloutConfig(engine="lean", importance_sampling="token").validate()
    with pytest.raises(ValueError, match="behaviour_logprobs=full with engine=vllm needs sampling.top_k=0"):
        check_vllm_logprobs(SamplingParams(top_p=0.9), full=True)
    check_vllm_logprobs(SamplingParams(top_p=0.9), full=False)
    check_vllm_logprobs(SamplingParams(), full=True)


@pytest.mark.parametrize("trainer", ["grpo", "ppo", "online_dpo", "distill"])
def test_full_behaviour_logprobs_with_vllm_and_top_p_are_refused_with_the_config(trainer):
    """Refused when the config is read, before vLLM or any model loads (it was at the first rollout)."""
    from posttrain.runtime.config import load_config
    from posttrain.trainers import distill, grpo, online_dpo, ppo

    configs = {
        "grpo": grpo.GRPOConfig,
        "ppo": ppo.PPOConfig,
        "online_dpo": online_dpo.OnlineDPOConfig,
        "distill": distill.DistillConfig,
    }
    cls = configs[trainer]
    reward = ["rewards=[{function: 'posttrain.rewards.builtin:exact_answer'}]"]
    extra = {"grpo": reward, "ppo": [*reward, "critic=policy"], "online_dpo": reward, "distill": ["teacher.path=t"]}
    overrides = ["model.path=m", "data.path=d.jsonl", "rollout.engine=vllm", *extra[trainer]]
    refused = r"^rollout.behaviour_logprobs=full with engine=vllm needs sampling.top_k=0"
    for sampling in ("sampling.top_p=0.9", "sampling.top_k=5"):
        with pytest.raises(ValueError, match=refused):
            load_config(cls, None, [*overrides, "rollout.behaviour_logprobs=full", sampling])
        load_config(cls, None, [*overrides, "rollout.behaviour_logprobs=truncated", sampling])
    load_config(cls, None, [*overrides, "rollout.behaviour_logprobs=full"])
