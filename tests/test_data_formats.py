"""TRL's dataset types (issue 15): language modelling, multi-turn conversations, implicit and unpaired
preferences, read with the tiny model's real tokenizer and chat template."""

import gzip
import json

import pytest

from posttrain.data import (
    DataConfig,
    DataError,
    collate_packed,
    collate_sft,
    load_preferences,
    load_prompts,
    load_rankings,
    load_sft,
    pack_sft,
)
from posttrain.data.real import SAMPLES, split_hh_dialogue

CONVERSATION = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "hi"},
    {"role": "assistant", "content": "yo"},
    {"role": "user", "content": "2+2"},
    {"role": "assistant", "content": "4"},
]


def _trained(tokenizer, batch, i=0) -> str:
    ids, mask = batch.input_ids[i].tolist(), batch.completion_mask[i].tolist()
    return tokenizer.decode([t for t, m in zip(ids, mask, strict=True) if m])


def test_text_rows_train_every_token_and_end_with_eos(tokenizer):
    examples, _ = load_sft(DataConfig(path="lm"), tokenizer, [{"text": "hello world"}])
    batch = collate_sft(examples, tokenizer.pad_token_id)
    assert tokenizer.decode(batch.input_ids[0]) == "<bos>hello world<eos>"  # no chat template on plain text
    assert _trained(tokenizer, batch) == "hello world<eos>"  # all but <bos>, which nothing predicts
    (cut,), report = load_sft(DataConfig(path="lm", max_length=6), tokenizer, [{"text": "hello world"}])
    assert tokenizer.decode(cut.prompt_ids + cut.completion_ids) == "<bos>hello" and report.truncated == 1
    with pytest.raises(DataError, match="field 'text': a language-modelling row holds text"):
        load_sft(DataConfig(path="lm"), tokenizer, [{"text": CONVERSATION}])


def test_every_assistant_turn_of_a_conversation_is_trained(tokenizer):
    examples, _ = load_sft(DataConfig(path="chat"), tokenizer, [{"messages": CONVERSATION}])
    batch = collate_sft(examples, tokenizer.pad_token_id)
    rendered = tokenizer.apply_chat_template(CONVERSATION, tokenize=False)
    assert tokenizer.decode(batch.input_ids[0]) == rendered
    assert _trained(tokenizer, batch) == "yo<eos>4<eos>"  # both replies and their end-of-turn, nothing else
    packed = collate_packed(pack_sft(examples * 2, 200), tokenizer.pad_token_id)
    assert _trained(tokenizer, packed) == "yo<eos>4<eos>" * 2
    # a one-turn conversation is still the prompt-completion pair (its prompt may be shortened from the left)
    (one,), _ = load_sft(DataConfig(path="chat"), tokenizer, [{"messages": CONVERSATION[:3]}])
    assert one.loss_mask is None and tokenizer.decode(one.completion_ids) == "yo<eos>"


def test_a_conversation_cut_by_max_length_keeps_only_whole_tokens_of_its_turns(tokenizer):
    rendered = tokenizer(tokenizer.apply_chat_template(CONVERSATION, tokenize=False), add_special_tokens=False)
    n = len(rendered["input_ids"])
    (cut,), report = load_sft(DataConfig(path="chat", max_length=n - 2), tokenizer, [{"messages": CONVERSATION}])
    assert report.truncated == 1 and len(cut.prompt_ids) + len(cut.completion_ids) == n - 2
    assert _trained(tokenizer, collate_sft([cut], 0)) == "yo<eos>"  # the last turn lost "4<eos>"
    with pytest.raises(DataError, match=r":1: field 'messages': \d+ tokens, more than the 10 allowed"):
        load_sft(DataConfig(path="chat", max_length=10, overlong="error"), tokenizer, [{"messages": CONVERSATION}])


def test_implicit_preference_prompt_is_the_shared_start(tokenizer):
    reply = [{"role": "assistant", "content": "5"}]
    rows = [
        {"chosen": CONVERSATION, "rejected": CONVERSATION[:-1] + reply},
        {"chosen": "Q: is it? A: yes it is", "rejected": "Q: is it? A: yeah no"},
    ]
    (conv, text), _ = load_preferences(DataConfig(path="pairs"), tokenizer, rows)
    prompt = tokenizer.apply_chat_template(CONVERSATION[:-1], add_generation_prompt=True, tokenize=False)
    assert tokenizer.decode(conv.prompt_ids) == prompt
    assert tokenizer.decode(conv.chosen_ids) == "4<eos>" and tokenizer.decode(conv.rejected_ids) == "5<eos>"
    # text: cut back to the last whitespace, so neither reply starts mid-word
    assert tokenizer.decode(text.prompt_ids) == "<bos>user: Q: is it? A:\nassistant: "
    assert tokenizer.decode(text.chosen_ids) == " yes it is<eos>"
    for bad, field, why in (
        ({"chosen": "yes", "rejected": "no"}, "chosen", "share no prompt"),
        ({"chosen": "Q: a ", "rejected": "Q: a b"}, "chosen", "nothing follows the prompt"),
        ({"chosen": CONVERSATION, "rejected": "no"}, "rejected", "both be text or both be messages"),
    ):
        with pytest.raises(DataError, match=f"field '{field}': .*{why}"):
            load_preferences(DataConfig(path="pairs"), tokenizer, [bad])


def test_raw_hh_rlhf_dialogues_load_as_implicit_preferences(tokenizer):
    with gzip.open(SAMPLES / "hh-rlhf" / "harmless-base-test.jsonl.gz", "rt") as f:
        raw = [json.loads(line) for line in f]
    config = DataConfig(path="hh", chat_template="never", max_length=None, on_malformed="skip")
    examples, report = load_preferences(config, tokenizer, raw)
    assert report.kept == len(examples) >= 290 and report.rows == len(raw)
    for example, row in zip(examples[:50], raw, strict=False):  # the first 50 are all well formed
        whole = tokenizer(row["chosen"])["input_ids"] + [tokenizer.eos_token_id]
        assert example.prompt_ids + example.chosen_ids == whole  # prompt + reply is the whole dialogue
        dialogue = tokenizer(split_hh_dialogue(row["chosen"])[0])["input_ids"]  # up to the last "Assistant:"
        assert example.prompt_ids[: len(dialogue)] == dialogue  # (plus the replies' shared first words)


def test_unpaired_preference_rows_are_rejected_naming_kto(tokenizer):
    row = {"prompt": "1+1=", "completion": "2", "label": True}
    for loader in (load_sft, load_preferences, load_rankings, load_prompts):
        with pytest.raises(DataError, match="field 'label': an unpaired preference row .* KTO"):
            loader(DataConfig(path="kto"), tokenizer, [row])
