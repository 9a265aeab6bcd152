"""Every trainer and every PPO critic under data parallelism: torchrun with 2 CPU processes (gloo DDP
through accelerate) takes the same steps as one process with the same global batch (issue 9 item 5)."""

import json
import subprocess
import sys
from pathlib import Path

import ddp_driver
import pytest
from helpers import assert_adam_trained_alike
from safetensors.torch import load_file

from posttrain.data.synthetic import arithmetic_sft, vowel_pairs
from posttrain.trainers.metrics import read_metrics

DRIVER = Path(__file__).parent / "ddp_driver.py"


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _runs(tiny_dir, tmp_path, setting: str) -> dict[str, tuple[str, list[str], list[str]]]:
    """{name: (kind, overrides, saved files)}: 2 steps each, global batch 8, greedy sampling for PPO/GRPO
    (each process samples its own prompts: only a deterministic sampler gives both settings the same
    responses), prompts of one length (no padding differences between the two splits)."""
    policy, reward = str(tiny_dir / "policy"), str(tiny_dir / "reward")
    sft_data = _jsonl(
        tmp_path / "sft.jsonl", [{"prompt": f"{i}+{i}=", "completion": "x" * (1 + i % 5)} for i in range(32)]
    )
    pairs = _jsonl(tmp_path / "pairs.jsonl", vowel_pairs(32, seed=0))
    prompts = _jsonl(tmp_path / "prompts.jsonl", [{"prompt": r["prompt"]} for r in arithmetic_sft(32, seed=1)])
    common = [
        "run.max_steps=2",
        "run.batch_size=8",
        "run.micro_batch_size=2" if setting == "two" else "run.micro_batch_size=8",
        "run.progress=false",
        "run.report_to=[jsonl]",
        "data.chat_template=never",
        f"optim.lr={LR}",  # Adam turns float noise in tiny gradients into steps of up to lr
    ]
    online = [f"data.path={prompts}", "sampling.max_new_tokens=4", "sampling.temperature=0", "log_completions=0"]
    runs = {
        "sft": ("sft", [f"model.path={policy}", f"data.path={sft_data}"], ["policy/model.safetensors"]),
        "rm": ("rm", [f"model.path={policy}", f"data.path={pairs}"], ["reward/model.safetensors"]),
        "dpo": ("dpo", [f"model.path={policy}", f"data.path={pairs}"], ["policy/model.safetensors"]),
        "grpo": (
            "grpo",
            [
                f"model.path={policy}",
                *online,
                f"rewards=[{{function: '{DRIVER}:character_sum'}}]",
                "num_generations=2",
                # greedy responses of a group are equal, so group-centred advantages cancel in the gradient:
                # REINFORCE++ whitens over the batch (every process's rows), with the KL in the reward
                "advantage_estimator=reinforce++",
                "kl_in=reward",
                "kl_coef=0.1",
            ],
            ["policy/model.safetensors"],
        ),
    }
    # a LoRA policy whose reference is the same weights with the adapter off (the cheap path)
    lora = "model.lora={r: 4, lora_alpha: 8, target_modules: [q_proj, v_proj]}"
    runs["grpo_lora"] = ("grpo", [*runs["grpo"][1], lora], ["policy/adapter_model.safetensors"])
    for critic in ("reward", "policy", "shared"):
        saved = ["policy/model.safetensors"]
        saved.append("policy/value_head.safetensors" if critic == "shared" else "critic/model.safetensors")
        overrides = [f"model.path={policy}", f"reward_model.path={reward}", *online, f"critic={critic}"]
        runs[f"ppo_{critic}"] = ("ppo", overrides + ["ppo_epochs=2"], saved)
    return {
        name: (kind, common + overrides + [f"run.output_dir={tmp_path / setting / name}"], saved)
        for name, (kind, overrides, saved) in runs.items()
    }


def test_every_trainer_and_critic_on_two_processes_matches_one_process(tiny_dir, tmp_path):
    two = _runs(tiny_dir, tmp_path, "two")
    spec = tmp_path / "two.json"
    spec.write_text(json.dumps([(kind, overrides) for kind, overrides, _ in two.values()]))
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(DRIVER)]
    done = subprocess.run(torchrun + [str(spec)], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == [2] * len(two)  # really two ranks, not two runs

    one = _runs(tiny_dir, tmp_path, "one")
    assert ddp_driver.run([(kind, overrides) for kind, overrides, _ in one.values()]) == [1] * len(one)
    for name, (_, _, saved) in one.items():
        for file in saved:
            a = load_file(tmp_path / "one" / name / "final" / file)
            b = load_file(tmp_path / "two" / name / "final" / file)
            assert a.keys() == b.keys(), name
            for k in a:  # Adam-trained weights: within what the arithmetic guarantees (helpers says what)
                lr = 10 * LR if file.startswith("critic/") else LR  # PPO's critic_lr: null = 10 × optim.lr
                assert_adam_trained_alike(b[k], a[k], lr, updates(name), msg=f"{name} {file} {k}")
        # the exact check: the gradient norm of every update, after the all-reduce and before Adam (a missing
        # all-reduce gives rank 0's own norm, a wrong share a scaled one); the critic's own too
        keys = ("grad_norm", "critic_grad_norm") if name in ("ppo_reward", "ppo_policy") else ("grad_norm",)
        for key in keys:
            norms = [[r[key] for r in read_metrics(tmp_path / d / name) if key in r] for d in ("one", "two")]
            assert len(norms[1]) == 2, (name, key)  # only the main process logs
            assert norms[0] == pytest.approx(norms[1], rel=1e-5), (name, key)
            assert all(n > 0 for n in norms[0]), (name, key)  # a real gradient to synchronise


LR = 1e-4  # the runs' optim.lr


def updates(name: str) -> int:
    """Optimizer steps of a run of ``_runs``: 2 steps, PPO with 2 epochs of one minibatch each."""
    return 2 * (2 if name.startswith("ppo") else 1)
