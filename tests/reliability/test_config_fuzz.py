"""Hypothesis fuzzing of configs (issue 10, Report): any YAML file and any ``key=value`` overrides either
give a config that validates with every float finite, or a ValueError naming a config field (and the
file and line for YAML syntax errors). Never another exception type, never a traceback from deep inside."""

import dataclasses
import importlib
import math
import re

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from posttrain.cli import TRAINERS
from posttrain.runtime.config import describe, load_config

CLASSES = {name: getattr(importlib.import_module(m), c) for name, (m, c, _) in TRAINERS.items()}
REQUIRED = {
    "sft": {"model": {"path": "m"}, "data": {"path": "d.jsonl"}},
    "rm": {"model": {"path": "m"}, "data": {"path": "d.jsonl"}},
    "dpo": {"model": {"path": "m"}, "data": {"path": "d.jsonl"}},
    "ppo": {"model": {"path": "m"}, "data": {"path": "d.jsonl"}, "critic": "policy", "rewards": [{"function": "a:b"}]},
    "grpo": {"model": {"path": "m"}, "data": {"path": "d.jsonl"}, "rewards": [{"function": "a:b"}]},
    "distill": {"model": {"path": "m"}, "data": {"path": "d.jsonl"}, "teacher": {"path": "t"}},
    "kto": {"model": {"path": "m"}, "data": {"path": "d.jsonl"}},
    "prm": {"model": {"path": "m"}, "data": {"path": "d.jsonl"}},
    "online-dpo": {"model": {"path": "m"}, "data": {"path": "d.jsonl"}, "rewards": [{"function": "a:b"}]},
}
FUZZ_EXAMPLES = 60


def _names(cls) -> set[str]:
    """Every dotted key and every part of one: what an error message may name."""
    keys = {key for key, _, _ in describe(cls)} | {f.name for f in dataclasses.fields(cls)}
    return keys | {part for key in keys for part in key.split(".")}


scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(10**6), max_value=10**6),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([math.nan, math.inf, -math.inf, 1e308, -0.0]),
    st.sampled_from(["", "auto", "none", "null", "linear", "1e-5", "nan", "inf", "a:b", "[1,", "{x: 1}"]),
    st.text(max_size=8),
)
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)


def _check_outcome(cls, build) -> None:
    try:
        config = build()
    except ValueError as err:
        message = str(err)
        named = {n for n in _names(cls) if re.search(rf"(?<![\w]){re.escape(n)}(?![\w])", message)}
        assert named or message.startswith("override "), message
        return
    config.validate()
    _assert_all_finite(config)


def _assert_all_finite(config) -> None:
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        for item in value if isinstance(value, list) else [value]:
            if dataclasses.is_dataclass(item):
                _assert_all_finite(item)
            elif isinstance(item, float):
                assert math.isfinite(item), f.name


@settings(max_examples=FUZZ_EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    command=st.sampled_from(sorted(CLASSES)),
    picks=st.lists(st.tuples(st.integers(min_value=0), values), min_size=1, max_size=4),
    unknown=st.booleans(),
)
def test_fuzzed_overrides_give_a_valid_config_or_an_error_naming_a_field(command, picks, unknown):
    cls = CLASSES[command]
    keys = [key for key, _, _ in describe(cls)]
    overrides = [f"{keys[i % len(keys)]}={yaml.safe_dump(v, default_flow_style=True).strip()}" for i, v in picks]
    if unknown:
        overrides.append("optim.no_such_key=1")
    required = [f"{k}={yaml.safe_dump(v, default_flow_style=True).strip()}" for k, v in REQUIRED[command].items()]
    _check_outcome(cls, lambda: load_config(cls, None, required + overrides))


@settings(max_examples=FUZZ_EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    command=st.sampled_from(sorted(CLASSES)),
    picks=st.lists(st.tuples(st.integers(min_value=0), values), min_size=1, max_size=2),
    junk=st.just({}) | st.dictionaries(st.text(max_size=8), values, max_size=2),
)
def test_fuzzed_yaml_files_give_a_valid_config_or_an_error_naming_a_field(tmp_path, command, picks, junk):
    cls = CLASSES[command]
    keys = [key for key, _, _ in describe(cls)]
    document = {k: dict(v) if isinstance(v, dict) else v for k, v in REQUIRED[command].items()}
    for i, value in picks:  # real keys at their nesting, fuzzed values
        *sections, leaf = keys[i % len(keys)].split(".")
        node = document
        for section in sections:
            node = node.setdefault(section, {}) if isinstance(node.get(section, {}), dict) else {}
        node[leaf] = value
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({**document, **junk}))
    _check_outcome(cls, lambda: load_config(cls, path))


@settings(max_examples=FUZZ_EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(alphabet=st.sampled_from(list("ab: -[]{}'\"\t\n#&*!|>%@`,.0123")), max_size=40))
def test_fuzzed_yaml_text_parses_or_names_file_and_line(tmp_path, text):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    try:
        load_config(CLASSES["sft"], path)
    except ValueError as err:
        message = str(err)
        if "invalid YAML" in message:
            assert re.match(rf"^{re.escape(str(path))}(:\d+)?: invalid YAML: ", message), message
        else:
            assert message.startswith(f"{path}: a config file must be a YAML mapping") or any(
                n in message for n in _names(CLASSES["sft"])
            ), message


FLOAT_KEYS = sorted(
    {(command, key) for command, cls in CLASSES.items() for key, default, _ in describe(cls) if "(float" in default}
)


@settings(max_examples=FUZZ_EXAMPLES, deadline=None)
@given(target=st.sampled_from(FLOAT_KEYS), value=st.floats(allow_nan=True, allow_infinity=True))
def test_fuzzed_float_fields_accept_finite_values_or_name_the_field(target, value):
    command, key = target
    cls = CLASSES[command]
    required = [f"{k}={yaml.safe_dump(v, default_flow_style=True).strip()}" for k, v in REQUIRED[command].items()]
    try:
        config = load_config(cls, None, required + [f"{key}={yaml.safe_dump(value).splitlines()[0]}"])
    except ValueError as err:
        assert str(err).startswith(key) or key.split(".")[-1] in str(err), str(err)
        assert math.isfinite(value) or str(err) == f"{key} must be a finite number, got {value}"
        return
    assert math.isfinite(value)
    _assert_all_finite(config)
