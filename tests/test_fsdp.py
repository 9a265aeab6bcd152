"""FSDP2 really running (issue 12): two CPU processes launched with the shipped accelerate config
(examples/accelerate/fsdp2.yaml) take the same steps as one plain process, in every trainer.

accelerate 1.15 enables FSDP only on accelerator devices; on CPU ``engines.build_accelerator`` switches
its state to FSDP (torch's ``fully_shard`` runs over gloo). A silent fall-back to DDP would pass the
equality checks, so tests/fsdp_checks.py, run in the same launch, checks the engine and that the
trained and frozen models really are sharded (half of each on each process).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import ddp_driver
import pytest
import torch
from helpers import assert_adam_trained_alike
from safetensors.torch import load_file
from test_ddp_roles import LR, _jsonl, updates
from test_ddp_roles import _runs as ddp_runs

from posttrain.data.synthetic import vowel_pairs
from posttrain.runtime.metrics import read_metrics

ROOT = Path(__file__).parent.parent
CHECKS = Path(__file__).parent / "fsdp_checks.py"


def _resume_runs(tiny_dir, root: Path) -> dict[str, list]:
    """{name: runs}: 3 steps with a checkpoint after each, and the same run resumed from step 1: DPO (one
    sharded model and a sharded reference) and PPO with a separate critic (two prepared models)."""
    pairs = _jsonl(root / "pairs3.jsonl", vowel_pairs(32, seed=0))
    policy, reward = tiny_dir / "policy", tiny_dir / "reward"
    common = ["run.max_steps=3", "run.batch_size=8", "run.micro_batch_size=2", "run.progress=false"]
    common += ["run.report_to=[jsonl]", "data.chat_template=never", "optim.lr=1e-4"]
    prompts = _jsonl(root / "prompts3.jsonl", [{"prompt": f"{i}+{i}="} for i in range(16)])
    kinds = {
        "dpo": ("dpo", [f"model.path={policy}", f"data.path={pairs}", "reference=copy"]),
        "ppo": (
            "ppo",
            [f"model.path={policy}", f"reward_model.path={reward}", f"data.path={prompts}", "critic=policy"]
            + ["sampling.max_new_tokens=4", "sampling.temperature=0", "log_completions=0"],
        ),
    }
    runs = {}
    for name, (kind, overrides) in kinds.items():
        full, resumed = root / "resume" / name / "full", root / "resume" / name / "resumed"
        start = full / "checkpoints" / "step-000001"
        runs[name] = [
            (kind, [*common, *overrides, "run.save_every=1", "run.keep_last=3", f"run.output_dir={full}"]),
            (kind, [*common, *overrides, f"run.resume_from={start}", f"run.output_dir={resumed}"]),
        ]
    return runs


def _variants(runs: dict) -> dict:
    """test_ddp_roles' runs plus GRPO sampling with the lean loop (no transformers ``generate``, which
    keeps sharded processes in step by itself: only ``full_parameters`` does it for the lean loop) and
    SFT with an evaluation whose 5 examples split 3/2 (2 and 1 micro-batches of 2: the processes must
    still run the same number of forwards), and GRPO with a held-out evaluation split the same way
    (generate calls)."""

    def variant(name: str, like: str, extra: list[str]) -> tuple:
        kind, overrides, saved = runs[like]
        out = str(Path([o for o in overrides if o.startswith("run.output_dir=")][0].split("=", 1)[1]).parent)
        kept = [o for o in overrides if not o.startswith("run.output_dir=")]
        return kind, kept + extra + [f"run.output_dir={out}/{name}"], saved

    # online DPO and distillation sample at τ = 1 (ddp_driver's prompt-keyed sampling): rollout.engine=auto picks
    # lean for one plain process and hf for the FSDP2-wrapped policy, which draw other tokens from one seed, so
    # both settings name the engine
    for name in ("online_dpo", "distill", "distill_jsd"):
        runs[name] = variant(name, name, ["rollout.engine=hf"])
    runs.pop("online_dpo_padded")  # its padding pairs are the update's, checked under DDP: kept out for time
    runs.pop("grpo_async")  # refused under FSDP2 (test_async.py): the producer's whole copy is not built
    runs.pop("distill_teachers")  # refused under FSDP2 (test_distill_teachers.py): sharded teachers are not built
    runs.pop("ppo_shared_calibrated")  # refused under FSDP2 (critic.SharedValueHead): its head trains unwrapped
    lean = variant("grpo_lean", "grpo", ["rollout.engine=lean"])
    # held-out generation (RunMonitor) from the sharded policy: 5 prompts in batches of 2 split 3/2 = 2 and 1
    # generate calls per process
    grpo_eval = variant("grpo_eval", "grpo", ["data.eval_fraction=0.16", "eval.batch_size=2"])
    sft_eval = variant("sft_eval", "sft", ["data.eval_fraction=0.16"])
    return {**runs, "grpo_lean": lean, "grpo_eval": grpo_eval, "sft_eval": sft_eval}


@pytest.fixture(scope="module")
def fsdp_run(tiny_dir, tmp_path_factory):
    """One launch on 2 processes: the engine checks, every trainer and critic (2 steps, global batch 8 =
    2 processes × 2 micro-batches of 2) and the resume runs. Returns (root, runs, checks, stdout)."""
    root = tmp_path_factory.mktemp("fsdp")
    two = _variants(ddp_runs(tiny_dir, root, "two"))
    resume = _resume_runs(tiny_dir, root)
    spec = root / "two.json"
    spec.write_text(json.dumps([(k, o) for k, o, _ in two.values()] + [r for rs in resume.values() for r in rs]))
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file"]
    command += [str(ROOT / "examples" / "accelerate" / "fsdp2.yaml"), "--num_processes", "2", "--mixed_precision"]
    command += ["no", str(CHECKS), str(tiny_dir), str(spec)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)  # a collective mismatch hangs
    assert done.returncode == 0, done.stderr[-5000:]
    checks = json.loads(done.stdout.strip().splitlines()[-1])
    assert checks["processes"] == [2] * (len(two) + 2 * len(resume))  # really two ranks
    return root, two, resume, checks, done.stdout


def test_fsdp2_is_really_on_and_shards_every_role(fsdp_run):
    """Not DDP in disguise: the engine is FSDP2 in every run, the trained policy and the frozen reference
    and reward model hold half their parameters per process with the unsharded forwards; generation
    unshards once (one all-gather per FSDP unit, none per token, though the processes generate 2 and 9
    tokens) and leaves the policy sharded; the gradient norm is a number the guard reads."""
    root, two, resume, checks, stdout = fsdp_run
    runs = len(two) + 2 * len(resume) + 1  # + the checks' own accelerator (their LoRA + vLLM trainer stops at start)
    assert stdout.count("[engine] FSDP2 on CPU over gloo") == runs
    assert checks["engine"] == "FSDP2, 2 process(es) on cpu"
    assert stdout.count("training engine: FSDP2, 2 process(es) on cpu") >= 5  # the online trainers print it
    # rollout.engine=auto says why a sharded policy samples with transformers' generate
    assert "rollout.engine=auto: hf (" in stdout and "checkpoint: the model is sharded by FSDP2" in stdout
    assert checks["trained_local_share"] == 0.5 and checks["frozen_local_share"] == 0.5
    assert checks["reward_local_share"] == pytest.approx(0.5, abs=0.01)  # its 1-row score head sits on one process
    assert checks["frozen_forward_diff"] == 0.0 and checks["reward_score_diff"] == 0.0
    # a frozen role of another architecture (qwen2 beside the llama policy) is sharded by its own blocks
    assert checks["other_arch_local_share"] == 0.5 and checks["other_arch_forward_diff"] == 0.0
    assert checks["generated_lengths"] == [6, 13] and checks["generation_equal"]
    assert checks["whole_during_generation"] and checks["sharded_after_generation"] == 0.5
    assert checks["gathers_during_generation"] == [checks["fsdp_param_groups"]] * 2
    assert checks["forward_after_generation_diff"] == 0.0
    assert checks["grad_norm"] > 0 and checks["grad_norm_same_on_processes"]
    assert checks["nan_grad_norm"] != checks["nan_grad_norm"]  # NaN
    assert checks["skipped_unchanged"] and checks["skips"] == 2
    assert "fsdp_version: 2" in checks["fsdp1_refused"]
    assert "cpu_ram_efficient_loading" in checks["ram_refused"]
    assert "LoRA" in checks["lora_vllm_refused"] and "FSDP2" in checks["lora_vllm_refused"]


def test_every_trainer_under_fsdp2_matches_one_plain_process(fsdp_run, tiny_dir):
    """SFT (with an evaluation), RM, DPO, KTO, GRPO (transformers generate and the lean loop), online DPO,
    distillation (reverse KL and JSD) and PPO with each critic — the reward model's copy, the policy's copy (a
    second sharded model), a value head on the policy — under FSDP2 on 2 processes: parameters as close to one
    plain process after 2 steps as Adam's arithmetic guarantees (helpers.assert_adam_trained_alike), one
    grad_norm per optimizer step, equal norms (the critic's too), the same evaluation loss."""
    root, two, _, _, _ = fsdp_run
    one = _variants(ddp_runs(tiny_dir, root, "one"))
    assert ddp_driver.run([(kind, overrides) for kind, overrides, _ in one.values()]) == [1] * len(one)
    for name, (_, _, saved) in one.items():
        for file in saved:
            a = load_file(root / "one" / name / "final" / file)
            b = load_file(root / "two" / name / "final" / file)
            assert a.keys() == b.keys(), name
            for k in a:  # Adam-trained weights (tests/helpers.py); PPO's critic at critic_lr = 10 × optim.lr
                lr = 10 * LR if file.startswith("critic/") else LR
                assert_adam_trained_alike(b[k], a[k], lr, updates(name), msg=f"FSDP2 {name} {file} {k}")
        keys = ("grad_norm", "critic_grad_norm") if name in ("ppo_reward", "ppo_policy") else ("grad_norm",)
        for key in keys:
            norms = [[r[key] for r in read_metrics(root / d / name) if key in r] for d in ("one", "two")]
            assert len(norms[1]) == 2 and norms[1] == pytest.approx(norms[0], rel=1e-5), (name, key)
            assert all(n > 0 for n in norms[0]), (name, key)
    evals = [[r["eval/loss"] for r in read_metrics(root / d / "sft_eval") if "eval/loss" in r] for d in ("one", "two")]
    assert len(evals[1]) == 1 and evals[1] == pytest.approx(evals[0], rel=1e-5)
    evals = [[r for r in read_metrics(root / d / "grpo_eval") if "time/eval" in r] for d in ("one", "two")]
    assert [r["step"] for r in evals[1]] == [0, 2], evals  # the starting model's and the last step's
    keys = [k for k in evals[0][0] if k.startswith("eval/")]
    pairs = list(zip(*evals, strict=True))
    assert keys and all(two[k] == pytest.approx(one[k], rel=1e-5) for one, two in pairs for k in keys), evals


@pytest.mark.parametrize("name", ["dpo", "ppo"])
def test_fsdp2_resume_is_exact(name, fsdp_run):
    """3 steps with a checkpoint after each vs resumed from step 1 (accelerate's save_state of the sharded
    models and optimizers): the same final weights, bit for bit — PPO's critic too."""
    root, _, resume, _, _ = fsdp_run
    full, resumed = root / "resume" / name / "full", root / "resume" / name / "resumed"
    assert (full / "checkpoints" / "step-000001" / "hf" / "policy" / "model.safetensors").is_file()
    files = ["policy/model.safetensors"] + (["critic/model.safetensors"] if name == "ppo" else [])
    for file in files:
        a, b = load_file(full / "final" / file), load_file(resumed / "final" / file)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), file
