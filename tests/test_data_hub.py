"""``data.path`` through the ``datasets`` library (issue 15): a folder written by ``save_to_disk``, a
folder of JSON files read by ``datasets``' JSON builder, a DatasetDict's splits, and tokenization by
``Dataset.map`` served from its cache on a second run. Offline: nothing here reaches the Hub."""

import json

import pytest
from datasets import Dataset, DatasetDict

from posttrain.data import DataConfig, DataError, load_preferences, load_sft

ROWS = [{"prompt": f"{i}+{i}=", "completion": str(2 * i)} for i in range(20)]


@pytest.fixture(autouse=True)
def datasets_cache(tmp_path, monkeypatch):
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_cache")


def _jsonl(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_save_to_disk_folder_reads_like_the_jsonl_file_and_a_second_run_hits_the_cache(tmp_path, tokenizer):
    Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "saved"))
    from_file, _ = load_sft(DataConfig(path=str(_jsonl(tmp_path / "rows.jsonl", ROWS))), tokenizer)
    first, report = load_sft(DataConfig(path=str(tmp_path / "saved")), tokenizer)
    assert first == from_file and report.kept == 20 and not report.cached
    second, report = load_sft(DataConfig(path=str(tmp_path / "saved")), tokenizer)
    assert second == first and report.cached  # the map ran nothing: every row came from its cache file
    assert "tokens from the datasets cache" in report.summary()
    shorter, report = load_sft(DataConfig(path=str(tmp_path / "saved"), max_length=26), tokenizer)
    assert not report.cached and report.truncated > 0  # other limits, other tokens: tokenized again


def test_a_dataset_dict_split_and_its_errors_name_the_split_and_row(tmp_path, tokenizer):
    bad = ROWS[:3] + [{"prompt": "x", "completion": " "}]
    DatasetDict({"train": Dataset.from_list(ROWS), "test": Dataset.from_list(bad)}).save_to_disk(str(tmp_path / "dd"))
    examples, _ = load_sft(DataConfig(path=str(tmp_path / "dd"), split="test", on_malformed="skip"), tokenizer)
    assert len(examples) == 3
    with pytest.raises(DataError, match=r"dd\[test\]:4: field 'completion': empty text"):
        load_sft(DataConfig(path=str(tmp_path / "dd"), split="test"), tokenizer)
    with pytest.raises(ValueError, match=r"data.split='validation' is not in .* \['test', 'train'\]"):
        load_sft(DataConfig(path=str(tmp_path / "dd"), split="validation"), tokenizer)


def test_a_folder_of_json_files_loads_through_the_datasets_json_builder(tmp_path, tokenizer):
    pairs = [{"prompt": f"q{i}", "chosen": "good", "rejected": "bad"} for i in range(6)]
    _jsonl(tmp_path / "prefs" / "train.jsonl", pairs)
    _jsonl(tmp_path / "prefs" / "test.jsonl", pairs[:2])
    examples, report = load_preferences(DataConfig(path=str(tmp_path / "prefs"), split="test"), tokenizer)
    assert len(examples) == 2 and not report.cached
    _, again = load_preferences(DataConfig(path=str(tmp_path / "prefs"), split="test"), tokenizer)
    assert again.cached


def test_sft_trains_from_a_saved_dataset(tiny_dir, tmp_path):
    from posttrain.runtime.config import load_config
    from posttrain.trainers import sft

    Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "saved"))
    overrides = [
        f"model.path={tiny_dir / 'policy'}",
        f"data.path={tmp_path / 'saved'}",
        "run.max_steps=1",
        "run.batch_size=4",
        "run.progress=false",
        "run.report_to=[jsonl]",
        f"run.output_dir={tmp_path / 'run'}",
    ]
    result = sft.train(load_config(sft.SFTConfig, None, overrides))
    assert result["steps"] == 1 and "20 kept" in result["data_report"]
