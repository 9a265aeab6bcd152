"""``posttrain export`` (issue 15): plain Hugging Face folders with a model card, LoRA merged or kept
with an absolute base path, from a run or a checkpoint, pushed through a local stand-in for the Hub."""

import json
import shutil

import pytest
import torch

from posttrain.cli import main
from posttrain.trainers.metrics import read_metrics

LORA = "model.lora={r: 4, lora_alpha: 8, target_modules: [q_proj, v_proj], lora_dropout: 0.0, init_lora_weights: false}"


def _sft(tiny_dir, tmp_path, monkeypatch, *extra):
    """2 SFT steps from a *relative* model path (the working directory is tmp_path)."""
    from posttrain.trainers import sft
    from posttrain.trainers.config import load_config

    shutil.copytree(tiny_dir / "policy", tmp_path / "base")
    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+1=", "completion": str(i + 1)}) + "\n" for i in range(8)))
    monkeypatch.chdir(tmp_path)
    overrides = ["model.path=base", "data.path=sft.jsonl", "run.output_dir=run", "run.max_steps=2"]
    overrides += ["run.batch_size=4", "run.progress=false", "run.report_to=[jsonl]", "run.save_every=1", *extra]
    sft.train(load_config(sft.SFTConfig, None, overrides))
    return tmp_path / "run"


def _logits(model, ids=((1, 10, 11, 12),)):
    with torch.no_grad():
        return model(torch.tensor(ids)).logits


def test_merged_lora_export_loads_as_a_plain_model_with_a_model_card(tiny_dir, tmp_path, monkeypatch):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    run = _sft(tiny_dir, tmp_path, monkeypatch, LORA)
    adapter = json.loads((run / "final" / "policy" / "adapter_config.json").read_text())
    assert adapter["base_model_name_or_path"] == str(tmp_path / "base")  # resolved, not "base"

    assert main(["export", str(run), "--out", str(tmp_path / "merged"), "--merge-lora"]) == 0
    out = tmp_path / "merged"
    assert not (out / "adapter_config.json").exists() and (out / "model.safetensors").is_file()
    monkeypatch.chdir("/")  # nothing relative to the run's working directory is needed any more
    merged = AutoModelForCausalLM.from_pretrained(out)
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    with_adapter = PeftModel.from_pretrained(base, str(run / "final" / "policy"))
    torch.testing.assert_close(_logits(merged), _logits(with_adapter), rtol=1e-4, atol=1e-5)
    assert not torch.allclose(_logits(merged), _logits(AutoModelForCausalLM.from_pretrained(tmp_path / "base")))

    card = (out / "README.md").read_text()
    final = [r for r in read_metrics(run) if "loss" in r][-1]
    assert "library_name: transformers" in card and f"base_model: {tmp_path / 'base'}" in card
    assert "- method: sft" in card and "- data: `data.path=sft.jsonl data.split=train`" in card
    assert "| run.batch_size | 4 |" in card and "| model.lora | {'r': 4," in card
    assert f"| loss | {final['loss']:.6g} |" in card and f"(step {final['step']})" in card


def test_export_of_a_checkpoint_and_of_an_unmerged_adapter(tiny_dir, tmp_path, monkeypatch):
    run = _sft(tiny_dir, tmp_path, monkeypatch, LORA)
    assert main(["export", str(run / "checkpoints" / "step-000001"), "--out", str(tmp_path / "adapter")]) == 0
    out = tmp_path / "adapter"
    assert json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"] == str(tmp_path / "base")
    card = (out / "README.md").read_text()
    assert "library_name: peft" in card and "as a LoRA adapter" in card and "- method: sft" in card
    with pytest.raises(SystemExit) as exit_code:  # never over an existing export
        main(["export", str(run), "--out", str(out)])
    assert exit_code.value.code == 2


def test_push_to_hub_uploads_the_exported_folder(tiny_dir, tmp_path, monkeypatch):
    import huggingface_hub

    run = _sft(tiny_dir, tmp_path, monkeypatch)
    hub = tmp_path / "hub"
    calls = []

    def create_repo(self, repo_id, exist_ok=False, **kwargs):
        calls.append(("create", repo_id, exist_ok))

    def upload_folder(self, folder_path, repo_id, commit_message=None, **kwargs):
        shutil.copytree(folder_path, hub / repo_id)
        calls.append(("upload", repo_id, commit_message))
        return f"hub://{repo_id}"

    monkeypatch.setattr(huggingface_hub.HfApi, "create_repo", create_repo)
    monkeypatch.setattr(huggingface_hub.HfApi, "upload_folder", upload_folder)
    assert main(["export", str(run), "--out", str(tmp_path / "full"), "--push-to-hub", "me/tiny-sft"]) == 0
    assert calls == [("create", "me/tiny-sft", True), ("upload", "me/tiny-sft", "posttrain export")]
    uploaded = hub / "me" / "tiny-sft"
    assert {"README.md", "config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in uploaded.iterdir()}
    assert "- method: sft" in (uploaded / "README.md").read_text()
