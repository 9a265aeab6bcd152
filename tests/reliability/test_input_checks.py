"""Inputs that fail early and clearly (issue 10 items 7, 11, 12; issue 15 "check inputs before building
anything"): every path is checked before a model loads, limits fit the model's context, greedy GRPO is
refused."""

import json
import subprocess
import sys

import pytest

from posttrain.data.synthetic import arithmetic_sft
from posttrain.trainers.config import load_config
from posttrain.trainers.dpo import DPOConfig
from posttrain.trainers.grpo import GRPOConfig
from posttrain.trainers.inputs import check_inputs
from posttrain.trainers.ppo import PPOConfig
from posttrain.trainers.sft import SFTConfig
from posttrain.trainers.sft import train as train_sft


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "posttrain.cli", *args], capture_output=True, text=True, cwd=cwd)


def test_readme_grpo_before_its_sft_step_exits_2_naming_the_field_and_the_step(tmp_path):
    """Item 7: a missing model folder gave transformers' "Repo id must be in the form ..." traceback."""
    data = _jsonl(tmp_path / "p.jsonl", [{"prompt": "1+1=", "answer": "2"}])
    out = _cli(
        "grpo",
        "model.path=runs/sft/final/policy",
        f"data.path={data}",
        "rewards=[{function: posttrain.rewards.builtin:exact_answer}]",
        f"run.output_dir={tmp_path / 'grpo'}",
        cwd=tmp_path,
    )
    assert out.returncode == 2, out.stderr
    assert "model.path: no model folder at runs/sft/final/policy" in out.stderr
    assert "posttrain sft" in out.stderr and "run.output_dir=runs/sft" in out.stderr
    assert "Traceback" not in out.stderr and not (tmp_path / "grpo").exists()


@pytest.mark.parametrize(
    "cls, field, assignment",
    [
        (PPOConfig, "reward_model.path", "reward_model.path=runs/rm/final/reward"),
        (DPOConfig, "reference_path", "reference_path=nowhere/at/all"),
        (SFTConfig, "model.tokenizer_path", "model.tokenizer_path=./no-tokenizer"),
    ],
)
def test_every_model_path_is_checked_naming_its_field(tiny_dir, tmp_path, cls, field, assignment):
    data = _jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "completion": "b"}])
    base = [f"model.path={tiny_dir / 'policy'}", f"data.path={data}", f"run.output_dir={tmp_path / 'run'}"]
    if cls is PPOConfig:
        base.append("critic=reward")
    config = load_config(cls, None, base + [assignment])
    with pytest.raises(FileNotFoundError, match=rf"^{field}: no "):
        check_inputs(config)


def test_a_run_folder_instead_of_its_final_model_is_named(tiny_dir, tmp_path):
    run = tmp_path / "sft"
    (run / "final" / "policy").mkdir(parents=True)
    config = load_config(SFTConfig, None, [f"model.path={run}", "data.path=d.jsonl"])
    with pytest.raises(FileNotFoundError, match=r"model.path: .* without config.json.*final/policy"):
        check_inputs(config)


def test_hub_ids_go_to_the_hub_loader_online_and_must_be_cached_offline(tiny_dir, tmp_path, monkeypatch):
    data = _jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "completion": "b"}])
    config = load_config(SFTConfig, None, ["model.path=some-org/some-model", f"data.path={data}"])
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FileNotFoundError, match="model.path: some-org/some-model is neither a local folder nor"):
        check_inputs(config)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    from posttrain.trainers import inputs

    monkeypatch.setattr(inputs, "cap_to_context", lambda config: None)  # would ask the Hub for the config
    check_inputs(config)  # online: the Hub loader decides


def test_missing_data_file_exits_2_before_anything_is_built(tiny_dir, tmp_path):
    """Issue 15: a missing data file ended in a traceback after the accelerator was built."""
    out = _cli("sft", f"model.path={tiny_dir / 'policy'}", "data.path=data/missing.jsonl", cwd=tmp_path)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1] == "posttrain sft: error: data.path: no such file: data/missing.jsonl"


def test_limits_are_capped_at_the_model_context_and_said(tiny_dir, tmp_path, capsys):
    """Item 11: rows longer than max_position_embeddings ran without a word (data.max_length=null or the
    default 1024 on a 512-position model)."""
    from posttrain.models.tiny import build_tiny

    short = build_tiny(tmp_path / "short", kind="causal", seed=0, max_position_embeddings=48)
    rows = arithmetic_sft(16, seed=0)
    rows[0] = {"prompt": "1+1=" * 20, "completion": "2" * 30}  # 110 characters
    data = _jsonl(tmp_path / "d.jsonl", rows)
    config = load_config(
        SFTConfig,
        None,
        [
            f"model.path={short}",
            f"data.path={data}",
            "data.max_length=null",
            "data.chat_template=never",
            f"run.output_dir={tmp_path / 'run'}",
            "run.max_steps=1",
            "run.progress=false",
            "run.report_to=[jsonl]",
        ],
    )
    result = train_sft(config)
    assert "data.max_length=None capped at 48 (the model's context of 48 positions)" in capsys.readouterr().out
    assert config.data.max_length == 48 and "1 truncated" in result["data_report"]

    online = load_config(
        GRPOConfig,
        None,
        [f"model.path={short}", f"data.path={data}", "rewards=[{function: a:b}]", "sampling.max_new_tokens=16"],
    )
    check_inputs(online)
    assert online.data.max_prompt_length == 48 - 16
    too_long = load_config(
        GRPOConfig,
        None,
        [f"model.path={short}", f"data.path={data}", "rewards=[{function: a:b}]", "sampling.max_new_tokens=48"],
    )
    with pytest.raises(ValueError, match="sampling.max_new_tokens=48 leaves no room"):
        check_inputs(too_long)


def test_greedy_grpo_warns_at_start_with_the_reason(tiny_dir, tmp_path, capsys):
    """Item 12: temperature 0 made every group identical (zero advantages, no learning) without a word.
    A warning, not an error: greedy GRPO is still what a determinism test (DDP vs one process) needs."""
    from posttrain.trainers.grpo import GRPOTrainer

    data = _jsonl(tmp_path / "p.jsonl", [{"prompt": "1+1=", "answer": "2"}] * 4)
    config = load_config(
        GRPOConfig,
        None,
        [
            f"model.path={tiny_dir / 'policy'}",
            f"data.path={data}",
            "rewards=[{function: 'posttrain.rewards.builtin:exact_answer'}]",
            f"run.output_dir={tmp_path / 'grpo'}",
            "sampling.temperature=0",
            "kl_coef=0",
        ],
    )
    GRPOTrainer(config)
    out = capsys.readouterr().out
    assert "warning: sampling.temperature=0 is greedy decoding" in out and "does not learn" in out
