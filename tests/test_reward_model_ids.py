"""Issue 9 item 3: a reward model used as a reward function reads the tokens the rollout holds (chat
template and EOS), as PPO's reward model does, also when its tokenizer is not the policy's."""

import torch
from helpers import assert_close

from posttrain.rewards import RewardComposer, RewardSpec
from posttrain.rewards.model import reward_model


def _templated_rollout(tokenizer):
    """A real rollout of the tiny policy on chat-templated prompts, EOS made likely so that most rows end
    with it (the tokens a reward model is trained to read at)."""
    from posttrain.models import ModelConfig, load_causal_lm
    from posttrain.rollout import HFEngine, SamplingParams

    policy = load_causal_lm(ModelConfig(path=tokenizer.name_or_path))
    boost = policy.lm_head.register_forward_hook(
        lambda module, inputs, logits: (
            logits + 4.0 * torch.nn.functional.one_hot(torch.tensor(tokenizer.eos_token_id), logits.shape[-1])
        )
    )
    prompts = [
        tokenizer(
            tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False),
            add_special_tokens=False,
        ).input_ids
        for q in ("1+1=", "name a colour")
    ]
    torch.manual_seed(0)
    rollout = HFEngine(policy, tokenizer).generate(prompts, SamplingParams(max_new_tokens=12), n=3)
    boost.remove()
    assert (~rollout.truncated).sum() >= 3  # rows that end with EOS
    return rollout


def _ppo_scores(path, rollout):
    """How PPO scores a rollout with its reward model: the rollout's ids as they are."""
    from posttrain.models import ModelConfig, load_reward_model, sequence_scores

    with torch.no_grad():
        return sequence_scores(load_reward_model(ModelConfig(path=path)), rollout.input_ids, rollout.attention_mask)


def test_reward_model_function_reads_the_rollout_tokens_like_ppo(tiny_dir, tokenizer):
    """Issue 9 item 3: the reward-function path scores the template and EOS tokens the rollout holds, as
    PPO's reward model does (it used to score decoded text without them, −0.19 vs 0.0048)."""
    from posttrain.rewards import unpad

    path = str(tiny_dir / "reward")
    rollout = _templated_rollout(tokenizer)
    expected = _ppo_scores(path, rollout)
    spec = RewardSpec("posttrain.rewards.model:reward_model", kwargs={"path": path}, isolation="inline")
    composer = RewardComposer.from_specs([spec], tokenizer=tokenizer)
    out = composer(
        rollout.prompts,
        rollout.responses,
        {},
        unpad(rollout.prompt_ids, rollout.prompt_mask),
        unpad(rollout.response_ids, rollout.response_mask),
    )
    assert_close(out.total, expected, atol=1e-5, rtol=0)
    text_only = torch.tensor(reward_model(rollout.prompts, rollout.responses, path=path))
    assert (text_only - expected).abs().max() > 1e-3  # what the decoded texts alone would give
    spec = RewardSpec("posttrain.rewards.model:reward_ensemble", kwargs={"paths": [path, path]}, isolation="inline")
    both = RewardComposer.from_specs([spec], tokenizer=tokenizer)(
        rollout.prompts,
        rollout.responses,
        {},
        unpad(rollout.prompt_ids, rollout.prompt_mask),
        unpad(rollout.response_ids, rollout.response_mask),
    )
    assert_close(both.total, expected, atol=1e-5, rtol=0)


def test_reward_model_with_another_tokenizer_rerenders_template_and_eos(tiny_dir, tokenizer, tmp_path):
    """Issue 9 item 3, fallback: a reward model whose tokenizer is not the policy's (here one extra
    token) re-tokenises the rollout decoded with its template and EOS kept: the same tokens, the same
    score as PPO's path."""
    import shutil

    from posttrain.models import load_tokenizer
    from posttrain.rewards import unpad
    from posttrain.rewards.model import rerender

    path = tmp_path / "reward_other_tokenizer"
    shutil.copytree(tiny_dir / "reward", path)
    other = load_tokenizer(str(path))
    other.add_tokens(["<extra>"])
    other.save_pretrained(path)
    other = load_tokenizer(str(path))
    assert other.get_vocab() != tokenizer.get_vocab()
    rollout = _templated_rollout(tokenizer)
    prompt_ids = unpad(rollout.prompt_ids, rollout.prompt_mask)
    completion_ids = unpad(rollout.response_ids, rollout.response_mask)
    for p, c in zip(prompt_ids, completion_ids, strict=True):
        assert rerender(p, c, tokenizer, other) == p + c
    got = reward_model(
        rollout.prompts,
        rollout.responses,
        path=str(path),
        prompt_ids=prompt_ids,
        completion_ids=completion_ids,
        policy_tokenizer=tokenizer,
    )
    assert_close(torch.tensor(got), _ppo_scores(str(tiny_dir / "reward"), rollout), atol=1e-5, rtol=0)
