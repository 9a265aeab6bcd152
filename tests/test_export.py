"""``posttrain export`` (issue 15): plain Hugging Face folders with a model card, LoRA merged or kept
with an absolute base path, from a run or a checkpoint, pushed through a local stand-in for the Hub."""

import json
import shutil

import pytest
import torch

from posttrain.cli import main
from posttrain.runtime.metrics import read_metrics

LORA = "model.lora={r: 4, lora_alpha: 8, target_modules: [q_proj, v_proj], lora_dropout: 0.0, init_lora_weights: false}"


def _sft(tiny_dir, tmp_path, monkeypatch, *extra):
    """2 SFT steps from a *relative* model path (the working directory is tmp_path)."""
    from posttrain.runtime.config import load_config
    from posttrain.trainers import sft

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
    # finding 9: the Hub's base_model is a model id; a local base is named in the text only
    assert "library_name: transformers" in card and "base_model" not in card.split("---")[1]
    assert f"- base model: `{tmp_path / 'base'}` (a local folder, not a Hub model)" in card
    assert "- method: sft" in card and "- data: `data.path=sft.jsonl`" in card
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
    # the token and the Hub's answer are checked before any upload (issue 24 item 5): a stand-in for both
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub, "get_token", lambda: "hf_dummy")
    monkeypatch.setattr(huggingface_hub.HfApi, "whoami", lambda self, token=None: {"name": "me"})
    assert main(["export", str(run), "--out", str(tmp_path / "full"), "--push-to-hub", "me/tiny-sft"]) == 0
    assert calls == [("create", "me/tiny-sft", True), ("upload", "me/tiny-sft", "posttrain export")]
    uploaded = hub / "me" / "tiny-sft"
    assert {"README.md", "config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in uploaded.iterdir()}
    assert "- method: sft" in (uploaded / "README.md").read_text()


def _card_metrics(card: str, title: str) -> dict[str, float]:
    """{metric: value} of the table under the line starting with ``title`` in a model card."""
    lines = card.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(title))
    rows = [line for line in lines[start + 4 :] if line.startswith("| ")]
    rows = rows[: next((i for i, r in enumerate(rows) if r.startswith("| metric")), len(rows))]
    return {r.split(" | ")[0][2:]: float(r.split(" | ")[1].rstrip(" |")) for r in rows}


def test_model_card_metrics_are_those_of_the_exported_step(tiny_dir, tmp_path, monkeypatch):
    """New-user findings 8 and 25: a run ending with an evaluation got a "Final training metrics" table
    holding only ``time`` (the end-of-run evaluation record taken for the last training record), and a
    checkpoint's card showed the whole run's final metrics."""
    run = _sft(tiny_dir, tmp_path, monkeypatch, "run.max_steps=4", "run.save_every=2", "data.eval_fraction=0.25")
    records = {r["step"]: r for r in read_metrics(run)}
    assert sorted(records) == [1, 2, 3, 4]  # the end-of-run evaluation is in step 4's record, not its own

    assert main(["export", str(run), "--out", str(tmp_path / "final")]) == 0
    card = (tmp_path / "final" / "README.md").read_text()
    assert "- weights: the final model (step 4)" in card
    trained = _card_metrics(card, "Final training metrics (step 4):")
    assert "time" not in trained and trained["loss"] == pytest.approx(records[4]["loss"], rel=1e-5)
    evaluated = _card_metrics(card, "Final evaluation metrics (step 4):")
    assert evaluated["eval/loss"] == pytest.approx(records[4]["eval/loss"], rel=1e-5)

    assert main(["export", str(run / "checkpoints" / "step-000002"), "--out", str(tmp_path / "ckpt")]) == 0
    card = (tmp_path / "ckpt" / "README.md").read_text()
    assert "- weights: the checkpoint of step 2" in card and "step 4" not in card
    assert _card_metrics(card, "Training metrics (step 2):")["loss"] == pytest.approx(records[2]["loss"], rel=1e-5)
    assert "valuation metrics" not in card  # no evaluation at step 2 (run.eval_every is null): none shown


def test_model_card_reads_runs_written_with_a_separate_end_of_run_evaluation_record(tmp_path):
    """Runs written before the fix logged the end-of-run evaluation as its own record {step, time, eval/*}."""
    from posttrain.export import metrics_at

    lines = [
        {"step": 1, "time": 0.5, "loss": 2.0, "eval/loss": 2.5},
        {"step": 2, "time": 1.0, "loss": 1.5},
        {"step": 3, "time": 1.5, "loss": 1.25},
        {"step": 3, "time": 1.7, "eval/loss": 1.75},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    assert metrics_at(tmp_path, None) == ({"step": 3, "loss": 1.25}, {"step": 3, "eval/loss": 1.75})
    assert metrics_at(tmp_path, 2) == ({"step": 2, "loss": 1.5}, {})
    assert metrics_at(tmp_path, 1) == ({"step": 1, "loss": 2.0}, {"step": 1, "eval/loss": 2.5})


def test_base_model_metadata_is_a_hub_id_or_nothing(tmp_path):
    from posttrain.export import hub_model_id

    assert hub_model_id("Qwen/Qwen2.5-0.5B") == "Qwen/Qwen2.5-0.5B"
    (tmp_path / "org" / "name").mkdir(parents=True)
    assert hub_model_id(str(tmp_path / "org" / "name")) is None  # a local folder, however it looks
    assert hub_model_id("runs/tiny/policy") is None  # no Hub id has two slashes
