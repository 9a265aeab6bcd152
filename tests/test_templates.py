"""Chat templates that render text after the end-of-turn token: what is trained is what RL reads."""

import json

import torch

from posttrain.data import DataConfig, load_prompts
from posttrain.models import ModelConfig, load_reward_model, load_tokenizer, sequence_scores
from posttrain.models.tiny import CHAT_TEMPLATE
from posttrain.rollout.base import build_rollout
from posttrain.trainers.rm import RMConfig, RMTask, load_ranking_data


def test_reward_model_trains_and_scores_at_the_end_of_turn_token(tiny_dir, tmp_path):
    # issue 9 item 4: with a template ending "<eos>\n" (Qwen's "<|im_end|>\n") the reward model was
    # trained reading the score at "\n", while PPO reads it at <eos>, where rollouts stop
    tokenizer = load_tokenizer(str(tiny_dir / "policy"))
    tokenizer.chat_template = CHAT_TEMPLATE.replace("{{ eos_token }}", "{{ eos_token }}\n")
    assert tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}], tokenize=False
    ).endswith("yo<eos>\n")
    path = tmp_path / "pairs.jsonl"
    path.write_text(json.dumps({"prompt": "vowels please", "chosen": "aeiou", "rejected": "xyz"}) + "\n")
    data = DataConfig(path=str(path), chat_template="always")
    reward = load_reward_model(ModelConfig(path=str(tiny_dir / "reward"), device="cpu"))

    # what the reward model trains on: RMTask's batch, read at its last attended token
    rankings, _ = load_ranking_data(RMConfig(data=data), tokenizer)
    batch = RMTask(tokenizer.pad_token_id, 0.0, 0.0).collate(rankings).sequences
    last = batch.attention_mask.sum(1) - 1
    assert batch.input_ids[torch.arange(2), last].tolist() == [tokenizer.eos_token_id] * 2
    with torch.no_grad():
        trained = sequence_scores(reward, batch.input_ids, batch.attention_mask)

    # what PPO scores: the prompt as RL renders it, then a response that stops at EOS (padded after it)
    prompts, _ = load_prompts(data, tokenizer)
    assert prompts[0].prompt_ids == rankings[0].prompt_ids
    responses = [
        tokenizer(text, add_special_tokens=False).input_ids + [tokenizer.eos_token_id] for text in ("aeiou", "xyz")
    ]
    padded = torch.tensor([r + [tokenizer.pad_token_id] * (7 - len(r)) for r in responses])
    rollout = build_rollout(
        tokenizer, [prompts[0].prompt_ids] * 2, padded, [tokenizer.eos_token_id], None, None, 1, 1.0
    )
    with torch.no_grad():
        scored = sequence_scores(reward, rollout.input_ids, rollout.attention_mask)
    torch.testing.assert_close(trained, scored, rtol=0, atol=1e-5)
