"""Data: schemas and their errors, chat templates, completion-only masks, truncation, real data loaders."""

import json

import pytest

from posttrain.data import (
    DataConfig,
    DataError,
    NoUsableRows,
    collate_preferences,
    collate_rankings,
    collate_sft,
    gsm8k_final_answer,
    load_gsm8k,
    load_hh_rlhf,
    load_preferences,
    load_prompts,
    load_rankings,
    load_sft,
)


def _jsonl(tmp_path, rows, name="data.jsonl"):
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_sft_plain_concatenation_appends_eos_and_masks_prompt(tmp_path, tokenizer):
    path = _jsonl(tmp_path, [{"prompt": "1+1=", "completion": "2"}])
    examples, report = load_sft(DataConfig(path=path, chat_template="never"), tokenizer)
    (ex,) = examples
    assert tokenizer.decode(ex.prompt_ids) == "<bos>1+1="
    assert ex.completion_ids == [tokenizer.convert_tokens_to_ids("2"), tokenizer.eos_token_id]  # EOS is trained
    batch = collate_sft(examples, tokenizer.pad_token_id)
    assert batch.completion_mask.tolist() == [[0] * 5 + [1, 1]]
    assert report.summary() == "1 rows read, 1 kept, 0 truncated"


def test_sft_chat_template_and_messages_format(tmp_path, tokenizer):
    rows = [
        {"prompt": "hi", "completion": "yo"},
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]},
    ]
    examples, _ = load_sft(DataConfig(path=_jsonl(tmp_path, rows)), tokenizer)
    for ex in examples:
        assert tokenizer.decode(ex.prompt_ids) == "<bos>user: hi\nassistant: "
        assert tokenizer.decode(ex.completion_ids) == "yo<eos>"  # the template's end of turn is trained
    assert examples[0] == examples[1]


@pytest.mark.parametrize(
    "row, field, why",
    [
        ({"completion": "2"}, "prompt", "missing"),
        ({"prompt": 3, "completion": "2"}, "prompt", "got int"),
        ({"prompt": "1+1=", "completion": "  "}, "completion", "empty text"),
        ({"messages": [{"role": "user", "content": "hi"}]}, "messages[-1].role", "assistant"),
        ({"messages": [{"role": "user"}, {"role": "assistant", "content": "x"}]}, "messages[0].content", "missing"),
    ],
)
def test_malformed_sft_rows_name_file_line_and_field(tmp_path, tokenizer, row, field, why):
    path = _jsonl(tmp_path, [{"prompt": "ok", "completion": "fine"}, row])
    with pytest.raises(DataError, match=why) as err:
        load_sft(DataConfig(path=path), tokenizer)
    assert err.value.where == f"{path}:2" and err.value.field == field
    assert f"{path}:2" in str(err.value) and repr(field) in str(err.value)


def test_malformed_rows_skipped_and_counted_when_configured(tmp_path, tokenizer):
    rows = [
        {"prompt": "a", "chosen": "x", "rejected": "y"},
        {"prompt": "a", "chosen": "same", "rejected": "same"},
        {"prompt": "a", "chosen": "x"},
    ]
    path = _jsonl(tmp_path, rows)
    with pytest.raises(DataError, match="identical to 'chosen'"):
        load_preferences(DataConfig(path=path), tokenizer)
    examples, report = load_preferences(DataConfig(path=path, on_malformed="skip"), tokenizer)
    assert len(examples) == 1 and report.kept == 1 and len(report.skipped) == 2
    assert (
        f"{path}:2: field 'rejected'" in report.skipped[0]
        and f"{path}:3: field 'rejected': missing" in report.skipped[1]
    )


def test_invalid_json_line_is_reported(tmp_path, tokenizer):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "a", "completion": "b"}\n{not json}\n')
    with pytest.raises(DataError, match=r"bad.jsonl:2: field '<line>': not valid JSON"):
        load_sft(DataConfig(path=str(path)), tokenizer)


def test_truncate_keeps_template_and_prompt_end(tmp_path, tokenizer):
    long_prompt = "".join(str(i % 10) for i in range(200)) + " END"
    path = _jsonl(tmp_path, [{"prompt": long_prompt, "completion": "abc"}])
    examples, report = load_sft(DataConfig(path=path, max_length=40), tokenizer)
    (ex,) = examples
    prompt_text = tokenizer.decode(ex.prompt_ids)
    assert prompt_text.startswith("<bos>user: ") and prompt_text.endswith(" END\nassistant: ")  # template intact
    assert tokenizer.decode(ex.completion_ids) == "abc<eos>"  # the completion kept whole
    assert len(ex.prompt_ids) + len(ex.completion_ids) <= 40
    assert report.truncated == 1 and report.kept == 1


def test_completion_cut_and_rows_without_completion_tokens_dropped(tmp_path, tokenizer):
    rows = [{"prompt": "p", "completion": "x" * 100}, {"prompt": "q" * 100, "completion": "y"}]
    path = _jsonl(tmp_path, rows)
    # prompts may take at most 30 tokens; the prompt of row 2 cannot shrink below its template
    examples, report = load_sft(DataConfig(path=path, max_length=30, chat_template="never"), tokenizer)
    assert len(examples[0].prompt_ids) + len(examples[0].completion_ids) == 30
    assert examples[0].completion_ids[-1] != tokenizer.eos_token_id  # cut: no EOS to learn from
    assert report.kept == 2 and report.truncated == 2
    # "<bos>user: " alone exceeds 2 tokens: nothing is left, which stops the run before any model loads
    with pytest.raises(NoUsableRows, match=r"no usable rows in data.path=.*data.jsonl \(2 read, 2 dropped because: 2 "):
        load_sft(DataConfig(path=path, max_length=30, max_prompt_length=2, chat_template="always"), tokenizer)


def test_drop_and_error_policies(tmp_path, tokenizer):
    path = _jsonl(tmp_path, [{"prompt": "p", "completion": "x" * 100}, {"prompt": "p", "completion": "ok"}])
    examples, report = load_sft(DataConfig(path=path, max_length=30, overlong="drop"), tokenizer)
    assert len(examples) == 1 and report.dropped["over-long"] == 1
    with pytest.raises(DataError, match=r"data.jsonl:1: field 'completion': \d+ tokens, more than the 30"):
        load_sft(DataConfig(path=path, max_length=30, overlong="error"), tokenizer)


def test_rankings_and_collation(tmp_path, tokenizer):
    rows = [{"prompt": "2+2=", "responses": ["4", "5", "22"]}, {"prompt": "1+1=", "responses": ["2", "3", "11"]}]
    examples, _ = load_rankings(DataConfig(path=_jsonl(tmp_path, rows)), tokenizer)
    batch = collate_rankings(examples, tokenizer.pad_token_id)
    assert batch.input_ids.shape[0] == 6
    texts = [tokenizer.decode(ids[m.bool()]) for ids, m in zip(batch.input_ids, batch.completion_mask, strict=True)]
    assert texts == ["4<eos>", "5<eos>", "22<eos>", "2<eos>", "3<eos>", "11<eos>"]
    bad = _jsonl(tmp_path, [{"prompt": "x", "responses": ["a", "b", "a"]}], "bad.jsonl")
    with pytest.raises(DataError, match=r"responses\[2\]"):
        load_rankings(DataConfig(path=bad), tokenizer)


def test_preference_collation_puts_chosen_then_rejected(tmp_path, tokenizer):
    rows = [{"prompt": "a", "chosen": "good", "rejected": "bad"}, {"prompt": "bb", "chosen": "yes", "rejected": "no"}]
    examples, _ = load_preferences(DataConfig(path=_jsonl(tmp_path, rows), chat_template="never"), tokenizer)
    batch = collate_preferences(examples, tokenizer.pad_token_id)
    texts = [tokenizer.decode(ids[m.bool()]) for ids, m in zip(batch.input_ids, batch.completion_mask, strict=True)]
    assert texts == ["good<eos>", "yes<eos>", "bad<eos>", "no<eos>"]
    assert batch.attention_mask.sum(1).tolist() == [2 + 5, 3 + 4, 2 + 4, 3 + 3]


def test_prompt_rows_keep_their_columns_and_parquet_works(tmp_path, tokenizer):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "prompts.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+2=", "answer": "4"}]), path)
    examples, report = load_prompts(DataConfig(path=str(path)), tokenizer)
    assert [e.columns for e in examples] == [{"answer": "2"}, {"answer": "4"}]
    assert tokenizer.decode(examples[0].prompt_ids) == "<bos>user: 1+1=\nassistant: "


def test_data_config_validation_names_the_field():
    for bad, field in (
        (dict(overlong="cut"), "overlong"),
        (dict(on_malformed="ignore"), "on_malformed"),
        (dict(max_length=0), "max_length"),
        (dict(chat_template="yes"), "chat_template"),
    ):
        with pytest.raises(ValueError, match=f"data.{field}"):
            DataConfig(path="x", **bad).validate()


def test_gsm8k_loader_reads_real_answers():
    rows = load_gsm8k("test")
    assert len(rows) == 300  # the shipped sample
    assert all(r["solution"].rstrip().replace(",", "").endswith("#### " + r["answer"]) for r in rows)
    assert gsm8k_final_answer("so 3 + 4 = 7\n#### 1,234") == "1234"
    assert all(r["answer"].lstrip("-").replace(".", "").isdigit() for r in rows)


def test_hh_rlhf_pairs_share_their_prompt(tokenizer):
    rows = load_hh_rlhf()
    assert len(rows) == 300 - 5  # the 5 pairs whose dialogues differ before the last turn are left out
    assert all(r["prompt"].endswith("\n\nAssistant:") for r in rows)
    examples, report = load_preferences(
        DataConfig(path="hh", max_length=512, on_malformed="skip", chat_template="never"), tokenizer, rows
    )
    assert len(report.skipped) == 4 and all("empty text" in s for s in report.skipped)
    assert report.kept == len(examples) == 295 - 4


def test_a_datasets_dataset_is_a_source_too(tokenizer):
    from datasets import Dataset

    rows = Dataset.from_list([{"prompt": "1+1=", "completion": "2"}, {"prompt": "2+2=", "completion": " "}])
    with pytest.raises(DataError, match=r"<.*>:2: field 'completion': empty text"):
        load_sft(DataConfig(path="in-memory", chat_template="never"), tokenizer, rows)
    examples, report = load_sft(
        DataConfig(path="in-memory", chat_template="never", on_malformed="skip"), tokenizer, rows
    )
    assert len(examples) == 1 and len(report.skipped) == 1
