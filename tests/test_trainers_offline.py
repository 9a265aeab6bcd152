"""SFT, reward models and DPO on tiny models: they learn, they are invariant to micro-batching, they resume."""

import json
import math
import subprocess
import sys

import pytest
import torch
from helpers import crash_at
from safetensors.torch import load_file

from posttrain.data.synthetic import arithmetic_sft, vowel_count, vowel_pairs, vowel_rankings
from posttrain.models import ModelConfig, load_reward_model, load_tokenizer, sequence_scores
from posttrain.runtime import checkpoint
from posttrain.runtime.config import load_config
from posttrain.runtime.metrics import read_metrics
from posttrain.trainers.dpo import DPOConfig
from posttrain.trainers.dpo import train as train_dpo
from posttrain.trainers.rm import RMConfig
from posttrain.trainers.rm import train as train_rm
from posttrain.trainers.sft import SFTConfig
from posttrain.trainers.sft import train as train_sft


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _sft_config(tiny_dir, tmp_path, *overrides, name="sft"):
    data = _jsonl(tmp_path / "sft.jsonl", arithmetic_sft(64, seed=0))
    base = [
        f"model.path={tiny_dir / 'policy'}",
        f"data.path={data}",
        f"run.output_dir={tmp_path / name}",
        "run.progress=false",
        "run.report_to=[jsonl]",
        "optim.lr=3e-3",
        "data.chat_template=never",
    ]
    return load_config(SFTConfig, None, base + list(overrides))


def _weights(output_dir, role="policy"):
    return load_file(f"{output_dir}/final/{role}/model.safetensors")


def test_sft_loss_falls(tiny_dir, tmp_path):
    config = _sft_config(
        tiny_dir,
        tmp_path,
        "run.max_steps=25",
        "run.batch_size=16",
        "run.micro_batch_size=8",
        "data.eval_fraction=0.25",
        "optim.scheduler=constant",
    )
    result = train_sft(config)
    records = [r for r in read_metrics(config.run.output_dir) if "loss" in r]
    assert records[0]["loss"] > 3.0  # a random model over 100 characters: about ln(100) = 4.6
    assert records[-1]["loss"] < 0.6 * records[0]["loss"]
    assert result["eval_metrics"]["eval/loss"] < 0.6 * records[0]["loss"]
    for key in ("loss", "lr", "grad_norm", "tokens_per_s", "samples_per_s"):
        assert key in records[-1] and math.isfinite(records[-1][key])
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(f"{config.run.output_dir}/final/policy")  # a plain HF checkpoint
    assert (tmp_path / "sft" / "config.yaml").is_file()


def test_logged_lr_is_the_rate_the_step_used(tiny_dir, tmp_path):
    """New-user finding 7: each step logs the learning rate its update used, so a linear schedule's
    last step logs a rate > 0 (it logged the next step's, 0.0, before). Warm-up factor (s+1)/(w+1),
    then 1 − (s − w)/(N − w): steps 0, 1, 2 of N = 3 with w = 1 use 0.5, 1.0, 0.5 × lr."""
    config = _sft_config(
        tiny_dir,
        tmp_path,
        "run.max_steps=3",
        "run.batch_size=4",
        "optim.lr=1e-3",
        "optim.scheduler=linear",
        "optim.warmup_steps=1",
    )
    train_sft(config)
    logged = [r["lr"] for r in read_metrics(config.run.output_dir) if "lr" in r]
    assert logged == pytest.approx([5e-4, 1e-3, 5e-4])


@pytest.mark.parametrize("micro", [1, 2, 3])
def test_micro_batching_gives_the_same_step(tiny_dir, tmp_path, micro):
    """Accumulation 1×4 and 4×1 (and 2×2, and 3+1) give the same gradient and parameters (docs/pitfalls.md
    #1). A micro_batch_size that does not divide the batch (3 of 4: newuser #1, #28) is not refused: the
    last micro-batch is smaller and ``backward_share`` weighs it by its tokens."""
    # varied completion lengths, so a mean of micro-batch means would weigh tokens differently
    rows = [{"prompt": f"{i}+{i}=", "completion": "x" * (1 + 5 * (i % 4))} for i in range(8)]
    data = _jsonl(tmp_path / "varied.jsonl", rows)
    runs = {}
    for m in (4, micro):
        config = _sft_config(
            tiny_dir,
            tmp_path,
            f"data.path={data}",
            "run.max_steps=2",
            "run.batch_size=4",
            f"run.micro_batch_size={m}",
            "optim.lr=1e-3",  # Adam divides by |g|: at 1e-2 float summation order shows on near-zero g
            "optim.weight_decay=0.1",
            name=f"mb{m}",
        )
        train_sft(config)
        runs[m] = (_weights(config.run.output_dir), [r["grad_norm"] for r in read_metrics(config.run.output_dir)])
    (w4, g4), (w1, g1) = runs[4], runs[micro]
    assert g4 == pytest.approx(g1, rel=1e-5)
    for name in w4:
        torch.testing.assert_close(w1[name], w4[name], rtol=0, atol=1e-5)


def test_resume_after_a_crash_reproduces_the_uninterrupted_run(tiny_dir, tmp_path):
    common = ["run.max_steps=6", "run.batch_size=8", "run.micro_batch_size=4", "run.save_every=3"]
    straight = _sft_config(tiny_dir, tmp_path, *common, name="straight")
    train_sft(straight)

    crashed = _sft_config(tiny_dir, tmp_path, *common, name="crashed")

    crash = crash_at(4)  # after the checkpoint of step 3, before the end

    with pytest.raises(KeyboardInterrupt):
        train_sft(crashed, callbacks=[crash])
    assert [p.name for p in checkpoint.list_checkpoints(crashed.run.output_dir)] == ["step-000003"]
    resumed = _sft_config(tiny_dir, tmp_path, *common, "run.resume_from=latest", name="crashed")
    train_sft(resumed)
    a, b = _weights(straight.run.output_dir), _weights(resumed.run.output_dir)
    assert all(torch.equal(a[k], b[k]) for k in a)
    steps = [r["step"] for r in read_metrics(resumed.run.output_dir)]
    assert steps == [1, 2, 3, 4, 5, 6]  # step 4, logged before the crash, was cut at the resume (issue 10 item 6)


def test_interrupted_save_leaves_previous_checkpoint_and_partial_is_refused(tiny_dir, tmp_path, monkeypatch):
    config = _sft_config(tiny_dir, tmp_path, "run.max_steps=4", "run.batch_size=8", "run.save_every=2", name="atomic")
    calls = []
    real = checkpoint._fsync_tree

    def dies_on_second_save(root):
        calls.append(root)
        if len(calls) == 2:
            raise OSError("killed while saving")
        real(root)

    monkeypatch.setattr(checkpoint, "_fsync_tree", dies_on_second_save)
    config.run.max_steps = 6
    with pytest.raises(OSError, match="killed while saving"):
        train_sft(config)
    out = config.run.output_dir
    assert [p.name for p in checkpoint.list_checkpoints(out)] == ["step-000002"]
    assert checkpoint.resolve_resume(out, "latest").name == "step-000002"
    partial = checkpoint.checkpoints_dir(out) / ".tmp-step-000004"
    assert partial.is_dir()
    (partial / checkpoint.STATE_FILE).unlink(missing_ok=True)
    with pytest.raises(checkpoint.IncompleteCheckpointError, match="partial checkpoint"):
        checkpoint.resolve_resume(out, str(partial))


def test_packing_keeps_examples_apart_and_trains(tiny_dir, tmp_path, tokenizer):
    from posttrain.data import SFTExample, collate_packed, collate_sft, pack_sft
    from posttrain.models import load_causal_lm, sequence_logprobs

    examples = [SFTExample(tokenizer(f"{i}+{i}=").input_ids, [20 + i, 30 + i, 2]) for i in range(5)]
    packs = pack_sft(examples, max_length=24)
    assert len(packs) < len(examples)
    model = load_causal_lm(ModelConfig(path=str(tiny_dir / "policy")))
    packed, alone = collate_packed(packs, 0), collate_sft(examples, 0)
    with torch.no_grad():
        lp_packed = sequence_logprobs(model, packed.input_ids, packed.attention_mask, position_ids=packed.position_ids)
        lp_alone = sequence_logprobs(model, alone.input_ids, alone.attention_mask)
    got = lp_packed[packed.completion_mask.bool()]
    want = lp_alone[alone.completion_mask.bool()]
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)  # no attention across examples

    config = _sft_config(
        tiny_dir, tmp_path, "packing=true", "data.max_length=64", "run.max_steps=10", "run.batch_size=4", name="packed"
    )
    train_sft(config)
    records = read_metrics(config.run.output_dir)
    assert records[-1]["loss"] < records[0]["loss"]


def _rm_config(tiny_dir, tmp_path, data_path, name, *overrides):
    base = [
        f"model.path={tiny_dir / 'policy'}",
        f"data.path={data_path}",
        f"run.output_dir={tmp_path / name}",
        "run.progress=false",
        "run.report_to=[jsonl]",
        "optim.lr=2e-3",
        "optim.scheduler=constant",
        "data.chat_template=never",
        "run.batch_size=16",
        "data.eval_fraction=0.2",
    ]
    return load_config(RMConfig, None, base + list(overrides))


def test_reward_model_learns_pairs(tiny_dir, tmp_path):
    data = _jsonl(tmp_path / "pairs.jsonl", vowel_pairs(400, seed=0))
    config = _rm_config(tiny_dir, tmp_path, data, "rm_pairs", "run.max_steps=60")
    result = train_rm(config)
    assert result["eval_metrics"]["eval/accuracy"] > 0.9
    first = read_metrics(config.run.output_dir)[0]
    assert first["loss"] == pytest.approx(math.log(2), abs=0.05)  # an untrained head scores both alike
    for key in ("accuracy", "margin", "score_mean", "score_std"):
        assert key in first
    _assert_phases_add_up(read_metrics(config.run.output_dir), ["train"])


def _ranking_agreement(model_dir, tokenizer, rows):
    """Share of all C(K,2) pairs of held-out rankings that the model orders like the true vowel count."""
    model = load_reward_model(ModelConfig(path=model_dir))
    agree = total = 0
    for row in rows:
        ids = [
            tokenizer(row["prompt"]).input_ids + tokenizer(r, add_special_tokens=False).input_ids + [2]
            for r in row["responses"]
        ]
        batch = torch.tensor(ids)
        with torch.no_grad():
            scores = sequence_scores(model, batch, torch.ones_like(batch)).tolist()
        truth = [vowel_count(r) for r in row["responses"]]
        for i in range(len(ids)):
            for j in range(i + 1, len(ids)):
                agree += (scores[i] - scores[j]) * (truth[i] - truth[j]) > 0
                total += 1
    return agree / total


def test_k_way_rankings_beat_top_vs_bottom_pairs(tiny_dir, tmp_path, tokenizer):
    rankings = vowel_rankings(240, k=4, seed=1)
    held_out = vowel_rankings(60, k=4, seed=99)
    top_bottom = [
        {"prompt": r["prompt"], "chosen": r["responses"][0], "rejected": r["responses"][-1]} for r in rankings
    ]
    scores = {}
    for name, rows in (("kway", rankings), ("topbottom", top_bottom)):
        data = _jsonl(tmp_path / f"{name}.jsonl", rows)
        config = _rm_config(tiny_dir, tmp_path, data, name, "run.max_steps=30", "data.eval_fraction=0", "optim.lr=1e-3")
        train_rm(config)
        scores[name] = _ranking_agreement(f"{config.run.output_dir}/final/reward", tokenizer, held_out)
    assert scores["kway"] > scores["topbottom"] + 0.02, scores


def test_reward_normalisation_on_policy_samples(tiny_dir, tmp_path):
    data = _jsonl(tmp_path / "pairs.jsonl", vowel_pairs(64, seed=0))
    config = _rm_config(
        tiny_dir,
        tmp_path,
        data,
        "rm_norm",
        "run.max_steps=5",
        f"normalize_policy={tiny_dir / 'policy'}",
        "normalize_samples=16",
        "normalize_max_new_tokens=8",
        "data.eval_fraction=0",
    )
    result = train_rm(config)
    stats = result["normalization"]
    assert stats["samples"] == 16 and stats["std"] > 0
    saved = json.loads((tmp_path / "rm_norm" / "final" / "reward" / "config.json").read_text())
    assert saved["reward_normalization"] == stats


def _dpo_config(tiny_dir, tmp_path, name, *overrides):
    rows = [
        {"prompt": r["prompt"], "chosen": r["answer"], "rejected": r["answer"][::-1] + "x"}
        for r in arithmetic_sft(64, seed=3)
    ]
    data = _jsonl(tmp_path / "dpo.jsonl", rows)
    base = [
        f"model.path={tiny_dir / 'policy'}",
        f"data.path={data}",
        f"run.output_dir={tmp_path / name}",
        "run.progress=false",
        "run.report_to=[jsonl]",
        "optim.lr=2e-3",
        "optim.scheduler=constant",
        "data.chat_template=never",
        "run.batch_size=8",
        "run.max_steps=12",
        "data.eval_fraction=0.25",
    ]
    return load_config(DPOConfig, None, base + list(overrides))


def test_dpo_starts_at_log2_and_learns(tiny_dir, tmp_path):
    config = _dpo_config(tiny_dir, tmp_path, "dpo")
    result = train_dpo(config)
    records = read_metrics(config.run.output_dir)
    assert records[0]["loss"] == pytest.approx(math.log(2), abs=1e-5)
    assert records[0]["rewards/margin"] == pytest.approx(0.0, abs=1e-6)
    assert sum(r["rewards/accuracy"] for r in records[-4:-1]) / 3 > 0.5
    assert result["eval_metrics"]["eval/rewards/accuracy"] > 0.5
    for key in ("rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected", "rewards/margin"):
        assert key in records[0]
    _assert_phases_add_up(records, ["reference", "train"])
    assert "time/eval" in records[-1]  # the final evaluation, after the step


def _assert_phases_add_up(records, phases):
    """Issue 13: every trainer logs time/<phase> and time/other, adding up to time/step."""
    for r in records:
        assert {k for k in r if k.startswith("time/")} - {"time/eval"} == {f"time/{p}" for p in phases} | {
            "time/other",
            "time/step",
        }, r
        assert all(r[f"time/{p}"] > 0 for p in phases) and r["time/other"] >= 0, r
        assert abs(sum(r[f"time/{p}"] for p in phases) + r["time/other"] - r["time/step"]) < 1e-9


def test_phase_timer_counts_a_nested_phase_once(monkeypatch):
    """DPO's reference forward runs inside the training phase: its seconds count for it alone."""
    from posttrain.runtime import loop

    clock = iter([0.0, 1.0, 3.0, 7.0, 8.0, 20.0])
    monkeypatch.setattr(loop.time, "perf_counter", lambda: next(clock))
    timer = loop.PhaseTimer()
    with timer("train"):  # enters at 0
        with timer("reference"):  # 1 → 3
            pass
        with timer("reference"):  # 7 → 8
            pass
    # leaves at 20
    assert timer.read(25.0) == {"time/train": 1 + 4 + 12, "time/reference": 2 + 1, "time/other": 5, "time/step": 25}


@pytest.mark.parametrize("loss", [[], ["loss_type=ipo", "ipo_logps=mean"]])
def test_dpo_precomputed_reference_matches_frozen_copy(tiny_dir, tmp_path, loss):
    copy = _dpo_config(tiny_dir, tmp_path, "copy", "reference=copy", "run.max_steps=3", *loss)
    pre = _dpo_config(tiny_dir, tmp_path, "pre", "reference=precompute", "run.max_steps=3", *loss)
    train_dpo(copy)
    train_dpo(pre)
    _assert_phases_add_up(read_metrics(pre.run.output_dir), ["train"])  # no reference forward in the steps
    a, b = _weights(copy.run.output_dir), _weights(pre.run.output_dir)
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-6)


def test_dpo_precomputed_reference_pass_shows_its_progress(tiny_dir, tmp_path, capsys):
    """On SmolLM2-135M the pass over 296 HH-RLHF pairs ran for half an hour with no output at all."""
    train_dpo(_dpo_config(tiny_dir, tmp_path, "bar", "reference=precompute", "run.max_steps=1", "run.progress=true"))
    err = capsys.readouterr().err
    assert "[dpo] reference log-probs" in err and "0/64 [" in err  # the 64 pairs, counted as they go
    train_dpo(_dpo_config(tiny_dir, tmp_path, "quiet", "reference=precompute", "run.max_steps=1"))
    assert "reference log-probs" not in capsys.readouterr().err


def test_dpo_lora_reference_is_adapter_off(tiny_dir, tmp_path):
    config = _dpo_config(
        tiny_dir,
        tmp_path,
        "lora",
        "reference=adapter",
        "run.max_steps=4",
        "optim.lr=5e-3",
        'model.lora={"r": 4, "target_modules": ["q_proj", "v_proj"], "lora_dropout": 0.0}',
    )
    train_dpo(config)
    records = read_metrics(config.run.output_dir)
    assert records[0]["loss"] == pytest.approx(math.log(2), abs=1e-5)
    assert records[-2]["loss"] < records[0]["loss"]
    assert (tmp_path / "lora" / "final" / "policy" / "adapter_config.json").is_file()


def test_config_yaml_overrides_and_errors(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model: {path: m}\ndata: {path: d, max_length: 64}\noptim: {lr: 1e-4}\nbeta: 0.2\n")
    config = load_config(DPOConfig, path, ["optim.lr=5e-5", "run.report_to=jsonl,tensorboard", "data.max_length=null"])
    assert (config.optim.lr, config.beta, config.data.max_length) == (5e-5, 0.2, None)
    assert config.run.report_to == ["jsonl", "tensorboard"]
    with pytest.raises(ValueError, match="unknown config key 'optim.lrr'"):
        load_config(DPOConfig, path, ["optim.lrr=1"])
    with pytest.raises(ValueError, match=r"loss_type must be one of \('sigmoid', 'ipo', 'hinge', 'simpo', 'orpo'\)"):
        load_config(DPOConfig, path, ["loss_type=kto"])
    with pytest.raises(ValueError, match="run.batch_size must be an integer"):
        load_config(DPOConfig, path, ["run.batch_size=eight"])
    with pytest.raises(ValueError, match="beta must be > 0"):
        load_config(DPOConfig, path, ["beta=0"])


@pytest.mark.slow  # `make test-slow`: outside `make test`, which holds to 15 minutes
def test_cli_runs_a_trainer_in_a_subprocess(tiny_dir, tmp_path):
    data = _jsonl(tmp_path / "sft.jsonl", arithmetic_sft(32, seed=0))
    config = tmp_path / "sft.yaml"
    config.write_text(
        f"model: {{path: {tiny_dir / 'policy'}}}\ndata: {{path: {data}}}\n"
        f"run: {{output_dir: {tmp_path / 'cli'}, max_steps: 3, batch_size: 8, progress: false}}\n"
    )
    out = subprocess.run(
        [sys.executable, "-m", "posttrain.cli", "sft", "--config", str(config), "optim.lr=1e-3"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    summary = json.loads((tmp_path / "cli" / "summary.json").read_text())  # the console has a few lines
    assert f"posttrain sft: 3 steps done; run folder {tmp_path / 'cli'}" in out.stdout
    assert summary["steps"] == 3 and (tmp_path / "cli" / "final" / "policy" / "model.safetensors").is_file()
    assert (tmp_path / "cli" / "tensorboard").is_dir()
    bad = subprocess.run(
        [sys.executable, "-m", "posttrain.cli", "sft", "--config", str(config), "run.epochs=-1"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert bad.returncode == 2 and "run.epochs must be > 0" in bad.stderr
    helped = subprocess.run([sys.executable, "-m", "posttrain.cli", "rm", "--help"], capture_output=True, text=True)
    assert "center_coef = 0.0 (float)" in helped.stdout and "Reward-centering coefficient" in helped.stdout
    assert load_tokenizer(str(tmp_path / "cli" / "final" / "policy")).eos_token == "<eos>"


EXAMPLES = [
    "sft_tiny",
    "rm_rankings_tiny",
    "dpo_tiny",
    "rm_hh_rlhf",
    "dpo_hh_rlhf",
    "sft_digits_noisy",
    "rm_vowels",
    "ppo_vowels",
    "grpo_digits",
    "dpo_simpo_digits",
    "dpo_orpo_digits",
    "kto_digits",
    "online_dpo_digits",
    "distill_digits",
    "sft_digits_teacher",
    "sft_vowels_teacher",
    "sft_mixed_noisy",
    "distill_teachers",
]


@pytest.mark.parametrize("name", EXAMPLES)
def test_example_configs_are_valid(name):
    from pathlib import Path

    from posttrain.trainers.distill import DistillConfig
    from posttrain.trainers.grpo import GRPOConfig
    from posttrain.trainers.kto import KTOConfig
    from posttrain.trainers.online_dpo import OnlineDPOConfig
    from posttrain.trainers.ppo import PPOConfig

    classes = {"sft": SFTConfig, "rm": RMConfig, "dpo": DPOConfig, "ppo": PPOConfig, "grpo": GRPOConfig}
    classes |= {"kto": KTOConfig, "online_dpo": OnlineDPOConfig, "distill": DistillConfig}
    path = Path(__file__).parent.parent / "examples" / f"{name}.yaml"
    command = "online_dpo" if name.startswith("online_dpo") else name.split("_")[0]
    config = load_config(classes[command], path)
    assert config.model.path.startswith("runs/") and config.data.path.startswith("runs/data/")


@pytest.mark.slow  # `make test-slow`: outside `make test`, which holds to 15 minutes
def test_demo_runs_end_to_end(tmp_path):
    from posttrain.demo import run_demo

    results = run_demo(str(tmp_path / "demo"), quick=True)
    for stage in ("sft", "grpo", "dpo"):
        assert 0.0 <= results[stage]["sampled"] <= 1.0 and 0.0 <= results[stage]["greedy"] <= 1.0
    assert 0.5 <= results["rm"]["eval_pairwise_accuracy"] <= 1.0
    assert results["ppo"]["score_last5"] > results["ppo"]["score_first5"]
    assert json.loads((tmp_path / "demo" / "summary.json").read_text()) == results
    for stage in ("sft", "grpo", "dpo", "rm", "ppo"):
        assert (tmp_path / "demo" / stage / "metrics.jsonl").is_file()


def test_real_model_example_config_is_valid():
    from pathlib import Path

    from posttrain.trainers.grpo import GRPOConfig

    config = load_config(GRPOConfig, Path(__file__).parent.parent / "examples" / "grpo_gsm8k.yaml")
    assert config.loss_agg == "token-mean" and config.clip_high == 0.28 and config.dynamic_sampling  # dapo
    assert [r.name for r in config.rewards] == ["math_answer", "think_answer_format"]


def test_examples_run_as_written(tmp_path, monkeypatch):
    """prepare_data.py, then every example config (2 steps each, in dependency order) from the repo root layout."""
    import importlib.util
    from pathlib import Path

    from posttrain.trainers import distill, dpo, grpo, kto, online_dpo, ppo, rm, sft

    root = Path(__file__).parent.parent
    monkeypatch.chdir(tmp_path)
    spec = importlib.util.spec_from_file_location("prepare_data", root / "examples" / "prepare_data.py")
    prepare = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(prepare)
    prepare.main("runs")
    modules = {"sft": sft, "rm": rm, "dpo": dpo, "ppo": ppo, "grpo": grpo, "kto": kto}
    modules |= {"online_dpo": online_dpo, "distill": distill}
    classes = {"sft": SFTConfig, "rm": RMConfig, "dpo": DPOConfig, "ppo": ppo.PPOConfig, "grpo": grpo.GRPOConfig}
    classes |= {"kto": kto.KTOConfig, "online_dpo": online_dpo.OnlineDPOConfig, "distill": distill.DistillConfig}
    order = [
        "sft_tiny",
        "rm_rankings_tiny",
        "dpo_tiny",
        "rm_hh_rlhf",
        "dpo_hh_rlhf",
        "sft_digits_noisy",
        "grpo_digits",
        "dpo_simpo_digits",
        "dpo_orpo_digits",
        "kto_digits",
        "online_dpo_digits",
        "sft_digits_teacher",
        "distill_digits",
        "sft_vowels_teacher",
        "sft_mixed_noisy",
        "distill_teachers",
        "rm_vowels",
        "ppo_vowels",
    ]
    assert sorted(order) == sorted(EXAMPLES)
    for name in order:
        kind = "online_dpo" if name.startswith("online_dpo") else name.split("_")[0]
        config = load_config(
            classes[kind],
            root / "examples" / f"{name}.yaml",
            ["run.max_steps=2", "run.progress=false", "run.eval_every=null", "run.save_every=null"],
        )
        result = modules[kind].train(config)
        assert result["steps"] == 2, name
        assert (tmp_path / config.run.output_dir / "final").is_dir(), name


def test_reward_normalisation_samples_through_the_exact_sampling_path(tiny_dir, tmp_path, tokenizer):
    # issue 9 item 1: normalize_policy samples with HFEngine, so a checkpoint's own generation_config
    # (top_k=20, repetition_penalty=1.5, ...) must not change the samples the statistics come from
    from helpers import copy_with_generation_defaults

    from posttrain.models import load_scalar_model
    from posttrain.trainers.rm import normalize_reward

    data = _jsonl(tmp_path / "pairs.jsonl", vowel_pairs(16, seed=0))
    styled = copy_with_generation_defaults(tiny_dir / "policy", tmp_path / "styled")
    stats = []
    for policy in (str(tiny_dir / "policy"), styled):
        config = _rm_config(
            tiny_dir,
            tmp_path,
            data,
            "norm",
            f"normalize_policy={policy}",
            "normalize_samples=16",
            "normalize_max_new_tokens=12",
        )
        reward = load_scalar_model(ModelConfig(path=str(tiny_dir / "reward"), device="cpu"), "reward")
        stats.append(normalize_reward(reward, tokenizer, config, torch.device("cpu")))
    assert stats[0] == stats[1]


class _UniformLM(torch.nn.Module):
    """Every next token equally likely among V = 4: log π(token) = −log 4 at every position."""

    def forward(self, input_ids, **kwargs):
        from types import SimpleNamespace

        return SimpleNamespace(logits=torch.zeros(*input_ids.shape, 4))


@pytest.mark.parametrize("ipo_logps", ["sum", "mean"])
def test_ipo_convention_summed_or_token_averaged_logps_by_hand(ipo_logps):
    # Done-means of issue 9: IPO's convention is stated and selectable
    from posttrain.data import PreferenceExample
    from posttrain.trainers.dpo import DPOExample, DPOTask

    config = DPOConfig(loss_type="ipo", beta=0.5, ipo_logps=ipo_logps)  # target h = 1/(2β) = 1
    # chosen: 3 tokens, rejected: 1 token; precomputed reference log-probs −3 and −1
    example = DPOExample(PreferenceExample([1, 2], [3, 0, 1], [2]), ref_chosen=-3.0, ref_rejected=-1.0)
    task = DPOTask(None, 0, config)
    _, sums = task.loss(_UniformLM(), task.collate([example]))
    log4 = math.log(4)
    if ipo_logps == "sum":  # h = (−3·log 4 + 3) − (−log 4 + 1) = 2 − 2·log 4
        expected = (2 - 2 * log4 - 1) ** 2
    else:  # h = (−log 4 + 3) − (−log 4 + 1) = 2
        expected = (2 - 1) ** 2
    assert float(sums["loss_sum"]) == pytest.approx(expected, abs=1e-6)


def test_ipo_logps_is_checked(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model: {path: m}\ndata: {path: d}\n")
    assert load_config(DPOConfig, path, ["loss_type=ipo", "ipo_logps=mean"]).ipo_logps == "mean"
    with pytest.raises(ValueError, match=r"ipo_logps must be one of \('sum', 'mean'\)"):
        load_config(DPOConfig, path, ["loss_type=ipo", "ipo_logps=median"])
    with pytest.raises(ValueError, match="ipo_logps applies to loss_type=ipo only"):
        load_config(DPOConfig, path, ["ipo_logps=mean"])
