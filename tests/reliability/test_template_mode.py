"""The chat-template mode travels with a checkpoint, and a later stage rendering prompts otherwise says
so (issue 24, item 17): `posttrain tiny` writes a template, data.chat_template defaults to auto, every
example passes never, and nothing warned when the SFT run and the GRPO / eval run of its checkpoint
rendered prompts differently."""

from __future__ import annotations

import json

import pytest

from posttrain.models.template_mode import INFO_FILE, template_mismatch


@pytest.fixture(scope="module")
def sft_never(tiny_dir, tmp_path_factory):
    """2 SFT steps with data.chat_template=never on the tiny policy (whose tokenizer has a template),
    a checkpoint after each."""
    from posttrain.runtime.config import load_config
    from posttrain.trainers import sft

    root = tmp_path_factory.mktemp("sft_never")
    data = root / "sft.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+1=", "completion": str(i + 1)}) + "\n" for i in range(8)))
    overrides = [f"model.path={tiny_dir / 'policy'}", f"data.path={data}", "data.chat_template=never"]
    overrides += [f"run.output_dir={root / 'run'}", "run.max_steps=2", "run.batch_size=4", "run.save_every=1"]
    overrides += ["run.progress=false", "run.report_to=[jsonl]"]
    sft.train(load_config(sft.SFTConfig, None, overrides))
    return root


def test_every_saved_model_records_the_template_mode(sft_never, tokenizer):
    assert tokenizer.chat_template  # the tiny tokenizer has one: auto would render through it
    run = sft_never / "run"
    for folder in (run / "final" / "policy", run / "checkpoints" / "step-000002" / "hf" / "policy"):
        info = json.loads((folder / INFO_FILE).read_text())
        assert info == {"data.chat_template": "never", "rendered_with_template": False}, folder


def _grpo(model, out, mode):
    from posttrain.runtime.config import load_config
    from posttrain.trainers.grpo import GRPOConfig, GRPOTrainer

    prompts = out / "prompts.jsonl"
    out.mkdir(parents=True, exist_ok=True)
    prompts.write_text("".join(json.dumps({"prompt": f"{i}+2="}) + "\n" for i in range(8)))
    overrides = [f"model.path={model}", f"data.path={prompts}", f"data.chat_template={mode}", "kl_coef=0"]
    overrides += [f"run.output_dir={out / 'run'}", "run.batch_size=4", "num_generations=2", "run.progress=false"]
    overrides += ["rewards=[{function: 'posttrain.rewards.length:per_token_length', kwargs: {per_token: 0.1}}]"]
    return GRPOTrainer(load_config(GRPOConfig, None, overrides))


def test_a_later_stage_with_another_mode_warns_naming_both(sft_never, tmp_path, capsys):
    model = sft_never / "run" / "final" / "policy"
    _grpo(model, tmp_path / "auto", "auto")
    warnings = [line for line in capsys.readouterr().out.splitlines() if "data.chat_template" in line]
    assert len(warnings) == 1, warnings
    (line,) = warnings
    assert line.startswith("[grpo] warning:") and str(model) in line
    assert "data.chat_template=never" in line and "data.chat_template=auto" in line
    _grpo(model, tmp_path / "never", "never")
    assert "data.chat_template" not in capsys.readouterr().out


def test_posttrain_eval_warns_too(sft_never, tiny_dir, tokenizer, tmp_path, capsys):
    from posttrain.cli import main

    model = sft_never / "run" / "checkpoints" / "step-000001" / "hf" / "policy"
    assert "trained with data.chat_template=never" in template_mismatch(model, "always", tokenizer)
    assert template_mismatch(model, "never", tokenizer) is None
    assert template_mismatch(tiny_dir / "policy", "auto", tokenizer) is None  # nothing recorded: nothing said
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+2=", "answer": str(i + 2)}) + "\n" for i in range(2)))
    argv = ["eval", "--model", str(model), "--data", str(data), "--rewards", "posttrain.rewards.builtin:exact_answer"]
    assert main([*argv, "--max-new-tokens", "2", "model.device=cpu"]) == 0
    out = capsys.readouterr().out
    assert "[eval] warning:" in out and "data.chat_template=auto" in out and "data.chat_template=never" in out
