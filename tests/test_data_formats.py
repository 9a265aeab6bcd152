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
    # text: the longest shared start, as TRL's extract_prompt takes it, even mid-word
    assert tokenizer.decode(text.prompt_ids) == "<bos>user: Q: is it? A: ye\nassistant: "
    assert tokenizer.decode(text.chosen_ids) == "s it is<eos>"
    for bad, field, why in (
        ({"chosen": "yes", "rejected": "no"}, "chosen", "share no prompt"),
        ({"chosen": "Q: a ", "rejected": "Q: a b"}, "chosen", "nothing follows the prompt"),
        ({"chosen": CONVERSATION, "rejected": "no"}, "rejected", "both be text or both be messages"),
    ):
        with pytest.raises(DataError, match=f"field '{field}': .*{why}"):
            load_preferences(DataConfig(path="pairs"), tokenizer, [bad])


def test_implicit_preference_text_is_split_as_trl_extract_prompt_splits_it(tokenizer):
    """Newuser #12: {"chosen": "3+4=7", "rejected": "3+4=8"} was refused ("share no prompt at their
    start"): the shared start was cut back to a whitespace and found none. TRL's extract_prompt takes
    the shared start up to the first difference and gives a space just before it to the replies."""
    rows = [
        {"chosen": "3+4=7", "rejected": "3+4=8"},
        {"chosen": "The sky is blue.", "rejected": "The sky is green."},
        {"chosen": "Q:\nA", "rejected": "Q:\nB"},
    ]
    config = DataConfig(path="pairs", chat_template="never")
    examples, _ = load_preferences(config, tokenizer, rows)
    split = [[tokenizer.decode(ids) for ids in (e.prompt_ids, e.chosen_ids, e.rejected_ids)] for e in examples]
    assert split == [
        ["<bos>3+4=", "7<eos>", "8<eos>"],
        ["<bos>The sky is", " blue.<eos>", " green.<eos>"],  # the space goes with the replies
        ["<bos>Q:\n", "A<eos>", "B<eos>"],  # only a space does (TRL's rule)
    ]


def test_a_file_of_another_kind_is_named_with_the_command_that_reads_it(tokenizer):
    """Newuser #13, #27: SFT fed a preference file said only "field 'completion': missing"; RM fed an SFT
    file asked for 'responses' (the ranking format) without saying the file was an SFT one."""
    config = DataConfig(path="f", chat_template="never")
    preference = {"prompt": "1+1=", "chosen": "2", "rejected": "3"}
    sft = {"prompt": "1+1=", "completion": "2"}
    cases = [
        (
            load_sft,
            preference,
            "completion",
            "preference rows .*, read by posttrain dpo and posttrain rm; this command reads SFT rows",
        ),
        (
            load_rankings,
            sft,
            "responses",
            r"SFT rows .*, read by posttrain sft; this command reads preference rows \(prompt/chosen/rejected\) or "
            "ranking rows",
        ),
        (load_preferences, sft, "chosen", "SFT rows .*, read by posttrain sft; this command reads preference rows"),
        (
            load_prompts,
            {"chosen": "a b", "rejected": "a c"},
            "prompt",
            "preference rows .*; this command reads prompt rows",
        ),
    ]
    for loader, row, field, why in cases:
        with pytest.raises(DataError, match=rf":1: field '{field}': missing: this looks like a file of {why}"):
            loader(config, tokenizer, [row])
    with pytest.raises(
        DataError, match="this looks like a file of prompt rows .* read by posttrain grpo and posttrain ppo"
    ):
        load_sft(config, tokenizer, [{"prompt": "1+1=", "answer": "2"}])
    with pytest.raises(DataError, match=r":1: field 'prompt': missing$"):  # like no kind: just what is missing
        load_sft(config, tokenizer, [{"completion": "2"}])


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


def test_data_columns_read_the_shipped_gsm8k_sample_as_sft_rows(tokenizer):
    """New-user trial (issue 23): GSM8K's {question, answer} rows could not be read by `posttrain sft` without
    converting them in Python; data.columns names the columns the fields come from."""
    from pathlib import Path

    import posttrain
    from posttrain.data import DataConfig, DataError, load_sft

    sample = Path(posttrain.__file__).parent / "data" / "samples" / "gsm8k" / "train.jsonl.gz"
    with pytest.raises(DataError):
        load_sft(DataConfig(path=str(sample), limit=2, chat_template="never", max_length=None), tokenizer)
    config = DataConfig(
        path=str(sample),
        limit=2,
        chat_template="never",
        max_length=None,
        columns={"prompt": "question", "completion": "answer"},
    )
    examples, report = load_sft(config, tokenizer)
    assert report.kept == 2
    text = tokenizer.decode(examples[0].prompt_ids + examples[0].completion_ids)
    assert "Natalia sold clips" in text and text.endswith("#### 72<eos>")
    with pytest.raises(ValueError, match="data.columns must map"):
        DataConfig(path="x", columns={"prompt": 3}).validate()
