"""Each checkpoint stores the weights once, in its Hugging Face folders (issue 15); resume loads them
from there exactly (the resume tests in test_trainers_offline/online check whole runs bit for bit)."""

import json

import pytest
import torch
from peft import LoraConfig, get_peft_model

from posttrain.models import ModelConfig, load_policy, load_scalar_model
from posttrain.models.roles import PolicyWithValueHead, RewardScorer, ValueModel
from posttrain.runtime.weights import restore_weights

LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"], "lora_dropout": 0.0}


def test_a_checkpoint_holds_the_weights_once(tiny_dir, tmp_path):
    from posttrain.runtime.config import load_config
    from posttrain.trainers import sft

    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+1=", "completion": str(i + 1)}) + "\n" for i in range(8)))
    overrides = [f"model.path={tiny_dir / 'policy'}", f"data.path={data}", f"run.output_dir={tmp_path / 'run'}"]
    overrides += ["run.max_steps=2", "run.batch_size=4", "run.save_every=1", "run.progress=false"]
    sft.train(load_config(sft.SFTConfig, None, overrides + ["run.report_to=[jsonl]"]))
    step = tmp_path / "run" / "checkpoints" / "step-000001"
    state_files = sorted(p.name for p in (step / "state").iterdir())
    assert not [name for name in state_files if name.startswith(("model", "pytorch_model"))], state_files
    assert json.loads((step / "state" / "weights_in_hf.json").read_text()) == {"0": "policy"}
    assert (step / "hf" / "policy" / "model.safetensors").is_file()


def _perturbed(model, seed=1):
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=generator) * 0.1)
    return model


@pytest.mark.parametrize("kind", ["causal", "lora", "reward", "reward_lora", "scorer", "critic", "value_head"])
def test_restore_weights_gives_back_exactly_what_save_pretrained_wrote(tiny_dir, tmp_path, kind):
    policy = ModelConfig(path=str(tiny_dir / "policy"), device="cpu")
    build = {
        "causal": lambda: load_policy(policy),
        "lora": lambda: load_policy(ModelConfig(path=policy.path, device="cpu", lora=LORA)),
        "reward": lambda: load_scalar_model(ModelConfig(path=str(tiny_dir / "reward"), device="cpu"), "reward"),
        "reward_lora": lambda: get_peft_model(
            load_scalar_model(ModelConfig(path=str(tiny_dir / "reward"), device="cpu"), "reward"),
            LoraConfig(task_type="SEQ_CLS", modules_to_save=["score"], **LORA),
        ),
        "scorer": lambda: RewardScorer(load_scalar_model(ModelConfig(path=str(tiny_dir / "reward")), "reward")),
        "critic": lambda: ValueModel(load_scalar_model(policy, "value")),
        "value_head": lambda: PolicyWithValueHead(load_policy(policy)),
    }[kind]
    trained = _perturbed(build())
    trained.save_pretrained(tmp_path / "hf")
    fresh = build()
    before = fresh.state_dict()
    assert any(not torch.equal(v, before[k]) for k, v in trained.state_dict().items())
    restore_weights(fresh, tmp_path / "hf")
    expected = trained.state_dict()
    assert all(torch.equal(expected[k], v) for k, v in fresh.state_dict().items())
