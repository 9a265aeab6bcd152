"""Configs: defaults that hold, finite floats, YAML errors that name the file and line (issue 10 items 3, 4, 8)."""

import dataclasses
import re
import subprocess
import sys

import pytest

from posttrain.cli import TRAINERS
from posttrain.runtime.config import describe, load_config

# the least each trainer needs to load a config (paths are not read by load_config)
REQUIRED = {
    "sft": ["model.path=m", "data.path=d.jsonl"],
    "rm": ["model.path=m", "data.path=d.jsonl"],
    "dpo": ["model.path=m", "data.path=d.jsonl"],
    "ppo": ["model.path=m", "data.path=d.jsonl", "critic=policy", "rewards=[{function: a:b}]"],
    "grpo": ["model.path=m", "data.path=d.jsonl", "rewards=[{function: a:b}]"],
    "distill": ["model.path=m", "data.path=d.jsonl", "teacher.path=t"],
    "kto": ["model.path=m", "data.path=d.jsonl"],
    "prm": ["model.path=m", "data.path=d.jsonl"],
    "online-dpo": ["model.path=m", "data.path=d.jsonl", "rewards=[{function: a:b}]"],
}


def _config_class(command):
    import importlib

    module, name, _ = TRAINERS[command]
    return getattr(importlib.import_module(module), name)


def _leaves(config) -> dict:
    return {key: default for key, default, _ in describe(type(config), instance=config)}


@pytest.mark.parametrize("command", sorted(TRAINERS))
def test_setting_one_key_keeps_every_other_default_of_its_section(command):
    """Item 4: ``optim.lr=...`` kept GRPO/PPO's scheduler only until a key of the section was set."""
    cls = _config_class(command)
    base = load_config(cls, None, REQUIRED[command])
    changed = {
        "optim.lr": "optim.lr=3e-7",
        "data.limit": "data.limit=7",
        "run.seed": "run.seed=5",
        "model.dtype": "model.dtype=bfloat16",
    }
    if "sampling" in {f.name for f in dataclasses.fields(cls)}:
        changed["sampling.top_p"] = "sampling.top_p=0.5"
    for key, assignment in changed.items():
        config = load_config(cls, None, REQUIRED[command] + [assignment])
        before, after = _leaves(base), _leaves(config)
        differing = sorted(k for k in before if before[k] != after[k])
        assert differing == [key], (command, assignment, differing)


@pytest.mark.parametrize("command", ["grpo", "ppo"])
def test_online_trainers_keep_their_constant_schedule_and_prompt_limits(command, tmp_path):
    """Item 4, as the issue met it: a YAML file setting optim.lr and data.path (examples/grpo_digits.yaml)."""
    cls = _config_class(command)
    path = tmp_path / "c.yaml"
    path.write_text("optim:\n  lr: 2.0e-6\ndata:\n  path: prompts.jsonl\n")
    config = load_config(cls, path, REQUIRED[command][:1] + REQUIRED[command][2:])
    assert config.optim.scheduler == "constant" and config.optim.lr == 2e-6
    assert config.data.max_length is None and config.data.max_prompt_length == 512
    assert config.sampling.max_new_tokens == cls().sampling.max_new_tokens


@pytest.mark.parametrize(
    "assignment, field",
    [
        ("optim.lr=.nan", "optim.lr"),
        ("optim.lr=.inf", "optim.lr"),
        ("optim.adam_eps=-.inf", "optim.adam_eps"),
        ("optim.max_grad_norm=.nan", "optim.max_grad_norm"),
        ("data.eval_fraction=.nan", "data.eval_fraction"),
        ("run.epochs=.inf", "run.epochs"),
        ("kl_coef=nan", "kl_coef"),
        ("sampling.temperature=.nan", "sampling.temperature"),
        ("rewards=[{function: a:b, weight: .inf}]", "rewards[0].weight"),
    ],
)
def test_non_finite_floats_are_refused_naming_the_field(assignment, field):
    """Item 3: NaN passed every range check (``nan <= 0`` is false) and failed later inside torch."""
    with pytest.raises(ValueError, match="^" + re.escape(field) + " must be a finite number"):
        load_config(_config_class("grpo"), None, REQUIRED["grpo"] + [assignment])


def test_non_finite_floats_set_in_python_are_refused_too():
    from posttrain.trainers.sft import SFTConfig, train

    config = load_config(SFTConfig, None, REQUIRED["sft"])
    config.optim.lr = float("inf")
    with pytest.raises(ValueError, match="optim.lr must be a finite number"):
        train(config)


@pytest.mark.parametrize(
    "text, line",
    [
        ("model:\n  path: x\noptim: {lr: 1e-5\nrun:\n  seed: 1\n", 4),
        ("model:\n  path: x\n\tdata: 2\n", 3),
        ("run: [1, 2\n", 2),
        ("model: {path: 'x}\n", 2),
    ],
)
def test_yaml_syntax_errors_name_file_and_line(tmp_path, text, line):
    """Item 8: a YAML syntax error escaped as a raw traceback without the file name."""
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=rf"^{path}:{line}: invalid YAML: "):
        load_config(_config_class("sft"), path)


def test_cli_reports_yaml_errors_in_one_line_and_exits_2(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("model:\n  path: x\noptim: {lr: 1e-5\n")
    out = subprocess.run(
        [sys.executable, "-m", "posttrain.cli", "sft", "--config", str(path)], capture_output=True, text=True
    )
    assert out.returncode == 2
    assert f"{path}:4: invalid YAML: " in out.stderr and "Traceback" not in out.stderr
    bad = subprocess.run([sys.executable, "-m", "posttrain.cli", "sft", "optim.lr=[1,"], capture_output=True, text=True)
    assert bad.returncode == 2 and "optim.lr=[1," in bad.stderr and "Traceback" not in bad.stderr


def test_an_unknown_key_in_a_file_names_file_line_and_the_key_it_resembles(tmp_path):
    """Newuser #26: a typo inside a YAML file gave "unknown config key optim.'warmup_step'" (the quote in
    the middle), without the file, the line or the key meant."""
    path = tmp_path / "c.yaml"
    path.write_text("model:\n  path: m\noptim:\n  lr: 1.0e-4\n  warmup_step: 3\n")
    with pytest.raises(ValueError) as caught:
        load_config(_config_class("sft"), path, ["data.path=d.jsonl"])
    assert str(caught.value).startswith(
        f"{path}:5: unknown config key 'optim.warmup_step' (did you mean warmup_steps?); allowed here: lr, "
    )
    grpo = tmp_path / "g.yaml"
    grpo.write_text("rewards:\n  - function: a:b\n    wieght: 2\n")
    with pytest.raises(
        ValueError, match=rf"^{grpo}:3: unknown config key 'rewards\[0\].wieght' \(did you mean weight\?\)"
    ):
        load_config(_config_class("grpo"), grpo, REQUIRED["grpo"][:2])


def test_a_sub_key_of_a_mapping_says_how_to_set_the_mapping():
    """Newuser #5: model.lora.r=8 said only "config key 'model.lora' has no sub-keys"."""
    with pytest.raises(ValueError) as caught:
        load_config(_config_class("sft"), None, [*REQUIRED["sft"], "model.lora.r=8"])
    assert str(caught.value) == (
        "config key model.lora is a mapping, set as a whole: 'model.lora={r: 8}' (quoted for the shell), "
        "or lora: {r: 8} under model: in the YAML file"
    )
    config = load_config(_config_class("sft"), None, [*REQUIRED["sft"], "model.lora={r: 8}"])
    assert config.model.lora == {"r": 8}  # what the message says works
    with pytest.raises(ValueError, match="^config key run.seed is a single value, not a section: set run.seed=VALUE$"):
        load_config(_config_class("sft"), None, [*REQUIRED["sft"], "run.seed.x=1"])
