"""Bad data fails early and clearly (issue 10, items 9 and 10): empty or unusable data stops a run
before any model is loaded, and every unreadable line is an error naming ``file:line`` or a counted
skip. Hypothesis feeds the loaders arbitrary rows and bytes: the only failures allowed are
``DataError`` (naming file, line and field) and ``NoUsableRows``."""

import json
import re
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from posttrain.data import (
    DataConfig,
    DataError,
    NoUsableRows,
    load_preferences,
    load_prompts,
    load_rankings,
    load_sft,
)

LOADERS = {"sft": load_sft, "preference": load_preferences, "ranking": load_rankings, "prompt": load_prompts}


def _write(path, lines: list[bytes]):
    path.write_bytes(b"".join(line + b"\n" for line in lines))
    return str(path)


def _forbid_models(monkeypatch, module):
    def no_model(*args, **kwargs):
        raise AssertionError("a model was loaded before the data was checked")

    monkeypatch.setattr(module, "load_policy", no_model)


@pytest.mark.parametrize("content", [b"", b"\n\n"])
def test_empty_prompt_file_stops_grpo_before_any_model_loads(tiny_dir, tmp_path, monkeypatch, content):
    from posttrain.runtime.config import load_config
    from posttrain.trainers import grpo

    data = tmp_path / "prompts.jsonl"
    data.write_bytes(content)
    _forbid_models(monkeypatch, grpo)
    config = load_config(
        grpo.GRPOConfig,
        None,
        [f"model.path={tiny_dir / 'policy'}", f"data.path={data}", f"run.output_dir={tmp_path / 'run'}"]
        + ["rewards=[{function: 'posttrain.rewards.builtin:exact_answer'}]"],
    )
    with pytest.raises(NoUsableRows, match=r"no usable rows in data.path=.*prompts.jsonl \(0 rows read"):
        grpo.GRPOTrainer(config)


def test_sft_rows_all_dropped_are_named_not_blamed_on_the_batch_size(tiny_dir, tmp_path, monkeypatch):
    from posttrain.runtime.config import load_config
    from posttrain.trainers import sft

    rows = [json.dumps({"prompt": "p" * 50, "completion": "c"}).encode()] * 3 + [b"{not json"]
    data = _write(tmp_path / "sft.jsonl", rows)
    _forbid_models(monkeypatch, sft)
    overrides = [
        f"model.path={tiny_dir / 'policy'}",
        f"data.path={data}",
        "data.max_length=20",
        "data.overlong=drop",
        "data.on_malformed=skip",
        f"run.output_dir={tmp_path / 'run'}",
    ]
    with pytest.raises(NoUsableRows) as err:
        sft.train(load_config(sft.SFTConfig, None, overrides))
    message = str(err.value)
    assert "(4 read, 4 dropped because: 3 over-long; 1 malformed (first: " in message
    assert "sft.jsonl:4: field '<line>': not valid JSON" in message


def test_cli_exits_2_with_one_line_on_empty_data(tiny_dir, tmp_path):
    data = tmp_path / "empty.jsonl"
    data.write_text("")
    out = subprocess.run(
        [sys.executable, "-m", "posttrain.cli", "sft", f"model.path={tiny_dir / 'policy'}", f"data.path={data}"]
        + [f"run.output_dir={tmp_path / 'run'}", "run.report_to=[jsonl]"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 2, out.stderr[-2000:]
    assert "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines()[-1].startswith("posttrain sft: error: no usable rows in data.path=")


def test_unparsable_and_non_utf8_lines_are_skipped_and_counted(tmp_path, tokenizer):
    good = json.dumps({"prompt": "1+1=", "completion": "2"}).encode()
    lines = [good, b'{"prompt": "2+2=", "completion": ', b'{"prompt": "caf\xe9", "completion": "x"}', good]
    path = _write(tmp_path / "mixed.jsonl", lines)
    examples, report = load_sft(DataConfig(path=path, chat_template="never", on_malformed="skip"), tokenizer)
    assert len(examples) == 2 and report.rows == 4 and len(report.skipped) == 2
    assert report.skipped[0].endswith("mixed.jsonl:2: field '<line>': not valid JSON (Expecting value)")
    assert "mixed.jsonl:3: field '<line>': not UTF-8 (byte 15: b'\\xe9')" in report.skipped[1]


def test_non_utf8_line_is_an_error_naming_file_and_line(tmp_path, tokenizer):
    good = json.dumps({"prompt": "1+1=", "completion": "2"}).encode()
    path = _write(tmp_path / "latin1.jsonl", [good, b'{"prompt": "caf\xe9", "completion": "x"}'])
    with pytest.raises(DataError, match=r"latin1.jsonl:2: field '<line>': not UTF-8"):
        load_sft(DataConfig(path=path, chat_template="never"), tokenizer)


def test_lone_surrogate_escapes_are_data_errors_not_tokenizer_crashes(tmp_path, tokenizer):
    path = _write(tmp_path / "s.jsonl", [b'{"prompt": "a\\ud800b", "completion": "x"}'])
    with pytest.raises(DataError, match=r"s.jsonl:1: field 'prompt': not valid Unicode"):
        load_sft(DataConfig(path=path, chat_template="never"), tokenizer)


# -- fuzzing --------------------------------------------------------------------------------------

KEYS = ["prompt", "completion", "chosen", "rejected", "responses", "messages", "text", "label", "role", "content"]
texts = st.one_of(st.text(max_size=12), st.sampled_from(["", " ", "\n", "a\u0000b", "\u00e9\u4e2d", "{{ x }}"]))
messages = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "assistant", "system", 3]), "content": st.one_of(texts, st.none())}
    ),
    max_size=4,
)
values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), texts, messages),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(KEYS), inner, max_size=3),
    max_leaves=8,
)
field = st.one_of(texts, messages, st.sampled_from(["2", "4 + 4", "yes"]))
near_valid = st.fixed_dictionaries(
    {},
    optional={
        **{key: field for key in ("prompt", "completion", "chosen", "rejected", "text")},
        "messages": messages,
        "responses": st.lists(field, max_size=3),
        "label": st.booleans(),
    },
)
json_rows = st.one_of(st.dictionaries(st.sampled_from(KEYS), values, max_size=5), near_valid).map(
    lambda d: json.dumps(d).encode()
)
raw_lines = st.one_of(
    st.binary(max_size=20).filter(lambda b: b"\n" not in b),
    st.sampled_from([b"[1, 2]", b'"text"', b'{"prompt": "\\udc80", "completion": "x"}', b"{", b"\xff\xfe"]),
)
files = st.lists(st.one_of(json_rows, json_rows, raw_lines), min_size=0, max_size=6)
WHERE = re.compile(r".*/rows\.jsonl:\d+: field '[^']+': ")


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lines=files, kind=st.sampled_from(sorted(LOADERS)), template=st.sampled_from(["never", "always"]))
def test_fuzzed_rows_fail_only_with_the_documented_errors(tmp_path, tokenizer, lines, kind, template):
    path = _write(tmp_path / "rows.jsonl", lines)
    loader = LOADERS[kind]
    config = DataConfig(path=path, chat_template=template, max_length=64)
    try:
        loader(config, tokenizer)
    except DataError as err:
        assert WHERE.match(str(err)), str(err)
    except NoUsableRows as err:
        assert str(err).startswith(f"no usable rows in data.path={path} (")
    try:
        examples, report = loader(DataConfig(path=path, chat_template=template, on_malformed="skip"), tokenizer)
    except NoUsableRows:
        return
    assert report.rows == report.kept + sum(report.dropped.values()) + len(report.skipped)
    assert len(examples) == report.kept > 0
    assert all(WHERE.match(s) for s in report.skipped)
