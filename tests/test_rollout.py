"""Rollout with Hugging Face generate on a tiny model: masks, EOS, stop strings and log-probs."""

import pytest
import torch
from helpers import assert_close

from posttrain.models import ModelConfig, load_causal_lm, load_policy, response_logprobs
from posttrain.rollout import HFEngine, SamplingParams, eos_token_ids, response_mask_from_ends


@pytest.fixture
def policy(policy_config):
    return load_causal_lm(policy_config)


def _prompts(tokenizer):
    return [tokenizer("12+34=").input_ids, tokenizer("hello there, how are").input_ids]


def _boost(model, token_id, rows=None, amount=60.0):
    """Make ``token_id`` (almost) certain at every step for ``rows`` (all when None), via a logits hook."""

    def hook(module, inputs, logits):
        bias = torch.zeros_like(logits)
        if rows is None:
            bias[..., token_id] = amount
        else:
            bias[rows, ..., token_id] = amount
        return logits + bias

    return model.lm_head.register_forward_hook(hook)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampling_logprobs_match_training_forward(policy, tokenizer, temperature):
    torch.manual_seed(0)
    rollout = HFEngine(policy, tokenizer).generate(
        _prompts(tokenizer), SamplingParams(max_new_tokens=24, temperature=temperature), n=3
    )
    mask = rollout.response_mask.bool()
    with torch.no_grad():
        recomputed, _ = response_logprobs(
            policy, rollout.input_ids, rollout.attention_mask, rollout.response_length, temperature=temperature
        )
    assert (recomputed - rollout.logprobs)[mask].abs().max() < 1e-4  # PPO ratio is 1 at the first minibatch
    if temperature != 1.0:
        with torch.no_grad():
            forgot_tau, _ = response_logprobs(
                policy, rollout.input_ids, rollout.attention_mask, rollout.response_length
            )
        assert (forgot_tau - rollout.logprobs)[mask].abs().max() > 1e-2  # forgetting τ would fail the check above


def test_top_k_top_p_and_min_tokens_do_not_change_logprobs(policy, tokenizer):
    torch.manual_seed(1)
    params = SamplingParams(max_new_tokens=16, temperature=0.9, top_k=5, top_p=0.8, min_new_tokens=4)
    rollout = HFEngine(policy, tokenizer).generate(_prompts(tokenizer), params, n=2)
    with torch.no_grad():
        recomputed, _ = response_logprobs(
            policy, rollout.input_ids, rollout.attention_mask, rollout.response_length, 0.9
        )
    mask = rollout.response_mask.bool()
    assert (recomputed - rollout.logprobs)[mask].abs().max() < 1e-4
    assert (rollout.logprobs[~mask] == 0).all()


def test_groups_are_consecutive_rows(policy, tokenizer):
    torch.manual_seed(0)
    prompts = _prompts(tokenizer)
    rollout = HFEngine(policy, tokenizer).generate(prompts, SamplingParams(max_new_tokens=8), n=3)
    assert len(rollout) == 6 and rollout.group_size == 3
    assert rollout.prompt_index.tolist() == [0, 0, 0, 1, 1, 1]
    assert rollout.prompts[:3] == ["12+34="] * 3 and rollout.prompts[3] == "hello there, how are"
    # prompts are left-padded: the last prompt column is always a real token
    assert (rollout.prompt_mask[:, -1] == 1).all() and rollout.prompt_mask[0, 0] == 0


@pytest.mark.parametrize("which", ["tokenizer_eos", "config_eos", "extra_stop_id"])
def test_every_eos_id_stops_and_tokens_after_it_are_masked(policy, tokenizer, which):
    eos = tokenizer.eos_token_id
    config_extra, stop_id = 50, 51
    policy.generation_config.eos_token_id = [eos, config_extra]  # a checkpoint with two EOS ids
    token = {"tokenizer_eos": eos, "config_eos": config_extra, "extra_stop_id": stop_id}[which]
    handle = _boost(policy, token, rows=[0])  # only row 0 wants to stop
    try:
        torch.manual_seed(0)
        params = SamplingParams(max_new_tokens=12, min_new_tokens=3, stop_token_ids=[stop_id])
        rollout = HFEngine(policy, tokenizer).generate(_prompts(tokenizer)[:1] * 2, params)
    finally:
        handle.remove()
    assert eos_token_ids(tokenizer, policy, [stop_id]) == sorted({eos, config_extra, stop_id})
    # row 0 stops at the first allowed step (index 3) on the boosted id; the id itself is kept
    assert rollout.response_ids[0, 3] == token
    assert rollout.response_mask[0].tolist() == [1, 1, 1, 1] + [0] * (rollout.response_length - 4)
    assert not rollout.truncated[0]
    assert rollout.response_length == 12 and rollout.truncated[1] == (rollout.response_mask[1].sum() == 12)


def test_response_without_eos_is_truncated(policy, tokenizer):
    handle = _boost(policy, tokenizer.convert_tokens_to_ids("x"))
    try:
        rollout = HFEngine(policy, tokenizer).generate(_prompts(tokenizer), SamplingParams(max_new_tokens=6))
    finally:
        handle.remove()
    assert rollout.truncated.all()
    assert rollout.response_mask.sum(1).tolist() == [6, 6]
    assert rollout.responses == ["xxxxxx", "xxxxxx"]


def test_stop_string_ends_response_and_keeps_it(policy, tokenizer):
    handle = _boost(policy, tokenizer.convert_tokens_to_ids("!"), rows=[0])
    try:
        torch.manual_seed(0)
        params = SamplingParams(max_new_tokens=10, min_new_tokens=0, stop_strings=["!"])
        rollout = HFEngine(policy, tokenizer).generate(_prompts(tokenizer), params)
    finally:
        handle.remove()
    assert rollout.responses[0] == "!"
    assert rollout.response_mask[0, 0] == 1 and rollout.response_mask[0, 1:].sum() == 0
    assert not rollout.truncated[0]


def test_response_mask_from_ends_by_hand():
    ids = torch.tensor([[5, 2, 7, 2], [5, 6, 7, 8], [2, 0, 0, 0], [5, 6, 9, 9]])
    stop_positions = torch.tensor([-1, -1, -1, 1])  # row 3: a stop string completed at index 1
    mask, truncated = response_mask_from_ends(ids, [2], stop_positions)
    assert mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 0, 0]]
    assert truncated.tolist() == [False, True, False, False]


def test_lora_policy_generates(policy_config, tokenizer):
    config = ModelConfig(path=policy_config.path, lora={"r": 2, "target_modules": ["q_proj"], "lora_dropout": 0.0})
    policy = load_policy(config)
    torch.manual_seed(0)
    rollout = HFEngine(policy, tokenizer).generate(_prompts(tokenizer), SamplingParams(max_new_tokens=5))
    with torch.no_grad():
        lp, _ = response_logprobs(policy, rollout.input_ids, rollout.attention_mask, rollout.response_length)
    assert_close(lp[rollout.response_mask.bool()], rollout.logprobs[rollout.response_mask.bool()], atol=1e-4, rtol=0)
    assert policy.training  # generation restores the mode it found


def test_sampling_params_validation_names_the_field():
    for bad, field in (
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(temperature=-1), "temperature"),
        (dict(top_p=0), "top_p"),
        (dict(min_new_tokens=99), "min_new_tokens"),
    ):
        with pytest.raises(ValueError, match=f"sampling.{field}"):
            SamplingParams(**bad).validate()


def _first_tokens(model, tokenizer, prompt, n, temperature):
    """(distinct first tokens among ``n`` samples, their expected number under the full softmax)."""
    torch.manual_seed(0)
    rollout = HFEngine(model, tokenizer).generate(
        [prompt], SamplingParams(max_new_tokens=1, temperature=temperature), n
    )
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt])).logits[0, -1].double()
    p = torch.softmax(logits / temperature, dim=-1)
    expected = float((1 - (1 - p) ** n).sum())  # E[#distinct] = Σ_v 1 − (1 − p_v)^n
    return len(set(rollout.response_ids[:, 0].tolist())), expected


@pytest.mark.parametrize("temperature", [1.0, 5.0])
def test_top_k_zero_samples_the_full_softmax(policy, tokenizer, temperature):
    # issue 9 item 1: top_k=0 was passed as None and transformers filled in its default top_k=50
    distinct, expected = _first_tokens(policy, tokenizer, tokenizer("12+34=").input_ids, 1000, temperature)
    assert expected > 90  # the tiny model's softmax is near-uniform over its 100 tokens
    assert abs(distinct - expected) <= 0.1 * expected, (distinct, expected)


def test_checkpoint_generation_config_does_not_change_sampling(tiny_dir, tokenizer, tmp_path):
    # issue 9 item 1: a checkpoint's top_k=20, repetition_penalty=1.5 (and more) changed the distribution
    from helpers import copy_with_generation_defaults

    plain = load_causal_lm(ModelConfig(path=str(tiny_dir / "policy"), device="cpu"))
    styled_path = copy_with_generation_defaults(tiny_dir / "policy", tmp_path / "styled")
    styled = load_causal_lm(ModelConfig(path=styled_path, device="cpu"))
    assert styled.generation_config.top_k == 20 and styled.generation_config.repetition_penalty == 1.5
    params = SamplingParams(max_new_tokens=12, temperature=1.0)
    rollouts = []
    for model in (plain, styled):
        torch.manual_seed(3)
        rollouts.append(HFEngine(model, tokenizer).generate(_prompts(tokenizer), params, n=4))
    assert torch.equal(rollouts[0].response_ids, rollouts[1].response_ids)  # the same draws: same distribution
    rollout = rollouts[1]
    with torch.no_grad():
        recomputed, _ = response_logprobs(styled, rollout.input_ids, rollout.attention_mask, rollout.response_length)
    mask = rollout.response_mask.bool()
    assert (recomputed - rollout.logprobs)[mask].abs().max() < 1e-5
    distinct, expected = _first_tokens(styled, tokenizer, tokenizer("12+34=").input_ids, 1000, 1.0)
    assert abs(distinct - expected) <= 0.1 * expected, (distinct, expected)
    assert styled.generation_config.top_k == 20  # the model's own config is left as it was
