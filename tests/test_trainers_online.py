"""GRPO and PPO on tiny models: rewards rise, ratios start at 1, KL has the right sign, resume is exact."""

import json
import math
from pathlib import Path

import pytest
import torch
from helpers import crash_at
from safetensors.torch import load_file

from posttrain.core import aggregate_loss, group_advantages, kl_penalty, ppo_policy_loss
from posttrain.data.synthetic import vowel_pairs
from posttrain.models import response_logprobs
from posttrain.rewards import RewardComposer, RewardError
from posttrain.runtime.checkpoint import list_checkpoints
from posttrain.runtime.config import load_config
from posttrain.runtime.metrics import read_metrics
from posttrain.runtime.online import PhaseTimer
from posttrain.trainers.grpo import GRPOConfig, GRPOTrainer, _scores_with_missing
from posttrain.trainers.grpo import train as train_grpo
from posttrain.trainers.ppo import PPOConfig, PPOTrainer
from posttrain.trainers.ppo import train as train_ppo

EXACT = "rewards=[{function: 'posttrain.rewards.builtin:exact_answer'}]"


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _grpo(noisy_sft, tmp_path, name, *overrides):
    base = [
        f"model.path={noisy_sft['policy']}",
        f"data.path={noisy_sft['prompts']}",
        "data.chat_template=never",
        f"run.output_dir={tmp_path / name}",
        "run.progress=false",
        "run.report_to=[jsonl]",
        EXACT,
        "sampling.max_new_tokens=4",
        "num_generations=8",
        "run.batch_size=64",
        "run.micro_batch_size=32",
        "optim.lr=5e-4",
        "kl_coef=0",
    ]
    return load_config(GRPOConfig, None, base + list(overrides))


def test_grpo_raises_reward_and_first_minibatch_ratio_is_one(noisy_sft, tmp_path):
    config = _grpo(
        noisy_sft,
        tmp_path,
        "grpo",
        "run.max_steps=40",
        "run.batch_size=128",
        "run.micro_batch_size=64",
        "num_iterations=2",
    )
    train_grpo(config)
    records = read_metrics(config.run.output_dir)
    rewards = [r["reward/mean"] for r in records]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert last > first + 0.1, (first, last)
    for r in records:
        # every update starts on-policy: sampling and training log-probs agree (docs/pitfalls.md #4)
        assert abs(r["policy/first_minibatch_ratio_max"] - 1) < 1e-5
        assert abs(r["policy/first_minibatch_ratio_min"] - 1) < 1e-5
        assert r["policy/first_minibatch_clipfrac"] == 0
        assert r["passes/old_logprobs"] == 0  # the sampling log-probs are the old ones: no extra forward
    assert max(r["policy/clipfrac"] for r in records) > 0  # μ = 2: the second pass is off-policy and clips
    for key in (
        "entropy",
        "kl_coef",
        "advantages/mean",
        "advantages/std",
        "response_length/mean",
        "truncated_share",
        "groups/zero_variance_share",
        "time/generate",
        "time/reward",
        "time/train",
        "tokens_per_s",
        "reward/exact_answer/mean",
        "policy/approx_kl",
        "policy/ratio_max",
    ):
        assert key in records[-1], key


def test_grpo_mu_one_never_clips_and_kl_zero_loads_no_reference(noisy_sft, tmp_path):
    config = _grpo(noisy_sft, tmp_path, "mu1", "run.max_steps=3", "sampling.temperature=0.7")
    trainer = GRPOTrainer(config)
    assert trainer.reference is None  # kl_coef = 0: no reference model at all
    trainer.train()
    records = read_metrics(config.run.output_dir)
    assert all(r["policy/clipfrac"] == 0 for r in records)
    # sampled at τ = 0.7, recomputed at τ = 0.7: still on-policy (docs/pitfalls.md #4)
    assert all(abs(r["policy/ratio_max"] - 1) < 1e-5 and abs(r["policy/ratio_min"] - 1) < 1e-5 for r in records)
    assert all(r["passes/reference"] == 0 and r["passes/old_logprobs"] == 0 for r in records)
    assert "kl/per_token" not in records[-1]
    samples = [json.loads(line) for line in (tmp_path / "mu1" / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 3 * 4 and {"step", "prompt", "completion", "score", "truncated"} <= set(samples[0])


def test_grpo_kl_in_loss_and_in_reward(noisy_sft, tmp_path):
    for kl_in in ("loss", "reward"):
        config = _grpo(
            noisy_sft, tmp_path, f"kl_{kl_in}", "run.max_steps=3", "kl_coef=0.1", f"kl_in={kl_in}", "optim.lr=2e-3"
        )
        trainer = GRPOTrainer(config)
        assert trainer.reference is not None
        trainer.train()
        records = read_metrics(config.run.output_dir)
        assert records[0]["kl/per_token"] == pytest.approx(0.0, abs=1e-4)  # the policy is its reference at step 1
        assert records[-1]["kl/per_token"] != 0
        assert records[-1]["passes/reference"] == 3


@pytest.mark.parametrize("preset", ["grpo", "dapo", "dr_grpo"])
def test_presets_print_their_knobs_and_match_core_by_hand(noisy_sft, tmp_path, preset, capsys):
    config = _grpo(
        noisy_sft,
        tmp_path,
        preset,
        f"preset={preset}",
        "run.max_steps=1",
        "run.micro_batch_size=16",
        "kl_coef=0.05",
        "kl_in=loss",
        "max_sampling_tries=2",
    )
    expected = GRPOConfig.PRESETS[preset]
    for key, value in expected.items():
        if key != "kl_coef":  # set explicitly above: the explicit setting wins
            assert getattr(config, key) == value, key
    assert config.kl_coef == 0.05
    trainer = GRPOTrainer(config)
    printed = capsys.readouterr().out
    assert f"preset {preset}: " in printed and f"loss_agg={expected['loss_agg']}" in printed
    if preset == "dapo":
        assert "kl_coef=0.05 (preset 0.0, overridden)" in printed

    torch.manual_seed(0)
    rollout, scores, applicable, _ = trainer.rollout_and_score(PhaseTimer())
    mask = rollout.response_mask * applicable[:, None]
    ref = torch.cat(
        [
            trainer.reference.logprobs(
                rollout.input_ids[s], rollout.attention_mask[s], rollout.response_length, rollout.temperature
            )
            for s in (slice(0, 32), slice(32, 64))
        ]
    )
    advantages = trainer.advantages(scores, applicable, kl_penalty(rollout.logprobs, ref, config.kl_estimator), mask)
    assert torch.equal(advantages, group_advantages(scores, 8, scale=expected["scale_rewards"]))
    with torch.no_grad():
        logprobs, _ = response_logprobs(
            trainer.actor.model, rollout.input_ids, rollout.attention_mask, rollout.response_length, rollout.temperature
        )
    per_token, _ = ppo_policy_loss(
        logprobs, rollout.logprobs, advantages, mask, clip_low=expected["clip_low"], clip_high=expected["clip_high"]
    )
    kl = kl_penalty(logprobs, ref, config.kl_estimator, mask=mask)
    by_hand = aggregate_loss(per_token + 0.05 * kl, mask, expected["loss_agg"], config.sampling.max_new_tokens)
    stats = trainer.update(0, rollout, rollout.logprobs, ref, advantages, mask)  # 4 micro-batches of 16
    assert stats["policy/loss"] == pytest.approx(float(by_hand), abs=1e-5)
    if preset == "dr_grpo":  # Dr. GRPO's constant normaliser: Σ / (B · max_new_tokens)
        per_token = -advantages[:, None] * torch.exp(logprobs - rollout.logprobs)
        assert float(aggregate_loss(per_token, mask, "seq-mean-token-sum-norm", 4)) == pytest.approx(
            stats["policy/pg_loss"], abs=1e-5
        )


@pytest.mark.parametrize(
    "overrides",
    [
        ["preset=gspo"],  # 4 minibatches: the first on-policy, the next three off-policy
        ["policy_loss=gspo-token", "clip_low=3e-4", "clip_high=4e-4", "minibatches=4"],
        ["preset=cispo", "clip_high=0.02", "num_iterations=2"],
        ["preset=gmpo", "clip_low=0.02", "clip_high=0.02", "num_iterations=2"],
    ],
    ids=["gspo", "gspo-token", "cispo", "gmpo"],
)
def test_gspo_and_cispo_start_on_policy_and_clip_off_policy(noisy_sft, tmp_path, overrides):
    """The first minibatch of every step is on-policy for GSPO's sequence ratio, CISPO's weight and GMPO's
    geometric mean too (ratio 1, clipfrac 0: docs/pitfalls.md #4); the later, off-policy ones clip (GSPO's
    3e-4 / 4e-4 range clips whole responses; CISPO caps weights above 1.02; GMPO token log-ratios beyond
    ±0.02)."""
    config = _grpo(noisy_sft, tmp_path, "off_policy", "run.max_steps=2", *overrides)
    train_grpo(config)
    records = read_metrics(config.run.output_dir)
    for r in records:
        assert abs(r["policy/first_minibatch_ratio_max"] - 1) < 1e-5
        assert abs(r["policy/first_minibatch_ratio_min"] - 1) < 1e-5
        assert r["policy/first_minibatch_clipfrac"] == 0
    assert max(r["policy/clipfrac"] for r in records) > 0


def test_sapo_starts_on_policy_and_its_gate_damps_off_policy(noisy_sft, tmp_path):
    """SAPO (``preset=sapo``, μ = 2): the first minibatch of every step has ratio 1 and gate weight 1 (the
    plain policy gradient); the second pass is off-policy and the soft gate damps it (weight < 1) where
    nothing is ever clipped (clipfrac 0)."""
    config = _grpo(noisy_sft, tmp_path, "sapo", "run.max_steps=2", "preset=sapo", "num_iterations=2")
    train_grpo(config)
    records = [r for r in read_metrics(config.run.output_dir) if "policy/gate_weight_mean" in r]
    assert len(records) == 2
    for r in records:
        assert abs(r["policy/first_minibatch_ratio_max"] - 1) < 1e-5
        assert abs(r["policy/first_minibatch_ratio_min"] - 1) < 1e-5
        assert r["policy/clipfrac"] == 0
    assert min(r["policy/gate_weight_min"] for r in records) < 0.999


REWARD_FILE = '''
def even_first_digit(prompts, completions, answer, **columns):
    """Reward only prompts whose first digit is even: the other groups are all 0, with no signal."""
    return [float(p[0] in "02468" and c.strip() == a) for p, c, a in zip(prompts, completions, answer)]


def half_applicable(prompts, completions, answer, **columns):
    return [None if i % 2 else 1.0 for i in range(len(completions))]


def quarter_unscored(prompts, completions, **columns):
    """By position alone, whatever was sampled: 0, 1, 0, None, 0, 1, 0, None, ..."""
    return [None if i % 4 == 3 else float(i % 4 == 1) for i in range(len(completions))]
'''


def test_dynamic_sampling_drops_flat_groups_and_fills_the_batch(noisy_sft, tmp_path):
    (tmp_path / "my_rewards.py").write_text(REWARD_FILE)
    config = _grpo(
        noisy_sft,
        tmp_path,
        "dyn",
        "run.max_steps=2",
        "dynamic_sampling=true",
        "max_sampling_tries=6",
        f"rewards=[{{function: '{tmp_path / 'my_rewards.py'}:even_first_digit'}}]",
    )
    trainer = GRPOTrainer(config)
    torch.manual_seed(0)
    rollout, scores, _, metrics = trainer.rollout_and_score(PhaseTimer())
    metrics.update(trainer.step_metrics.flush(trainer.accelerator))  # the group counts, reduced when the step ends
    assert metrics["groups/dropped"] > 0 and metrics["groups/zero_variance_share"] > 0
    assert metrics["groups/trained"] == 8 and len(rollout) == 64  # refilled to 8 prompts × 8
    grouped = scores.view(-1, 8)
    assert (grouped.amax(1) > grouped.amin(1)).all()  # every trained group carries a signal
    assert all(p[0] in "02468" for p in rollout.prompts)


def test_none_rewards_are_excluded_not_zero(tmp_path):
    (tmp_path / "my_rewards.py").write_text(REWARD_FILE)
    from posttrain.rewards import RewardSpec

    composer = RewardComposer.from_specs(
        [
            RewardSpec(f"{tmp_path / 'my_rewards.py'}:half_applicable", weight=2.0),
            RewardSpec("posttrain.rewards.builtin:exact_answer", weight=1.0),
        ]
    )
    out = composer(["1+1="] * 4, ["2", "3", "2", "3"], {"answer": ["2", "2", None, None]})
    # row 0: both apply (2·1 + 1·1); row 1: only exact_answer (wrong: 0); row 2: only half_applicable (2·1);
    # row 3: neither applies → NaN, not 0
    assert out.total[:3].tolist() == [2.0 + 1.0, 0.0, 2.0]
    assert math.isnan(out.total[3])
    filled, applicable = _scores_with_missing(torch.tensor([1.0, float("nan"), 0.0, 0.0]), 2)
    assert filled.tolist() == [1.0, 1.0, 0.0, 0.0] and applicable.tolist() == [True, False, True, True]
    with pytest.raises(RewardError, match="returned NaN"):
        RewardComposer([("bad", lambda p, c, **k: [float("nan")] * len(c), 1.0)])(["x"], ["y"], {})


def test_reward_std_is_over_the_scored_rows_only(noisy_sft, tmp_path):
    """Unscored rows hold their group's mean as a filler (``_scores_with_missing``); ``reward/std`` must not count
    them. 8 rows scored 0, 1, 0, None, 0, 1, 0, None: the 6 scored are four 0s and two 1s, mean 1/3, unbiased
    std sqrt((2 − 2²/6) / 5) = sqrt(4/15) = 0.5164 (the 8 rows with the fillers 1/3 would give 0.4364)."""
    (tmp_path / "my_rewards.py").write_text(REWARD_FILE)
    config = _grpo(
        noisy_sft,
        tmp_path,
        "std",
        "run.max_steps=1",
        "num_generations=4",
        "run.batch_size=8",
        "eval.at_start=false",
        f"rewards=[{{function: '{tmp_path / 'my_rewards.py'}:quarter_unscored'}}]",
    )
    train_grpo(config)
    (record,) = read_metrics(config.run.output_dir)
    assert record["reward/applicable_share"] == 0.75
    assert record["reward/mean"] == pytest.approx(1 / 3)
    assert record["reward/std"] == pytest.approx(math.sqrt(4 / 15), rel=1e-6)


@pytest.mark.parametrize("mode", ["token", "token_mask"])
def test_gspo_with_token_importance_weights_is_refused_at_start(noisy_sft, tmp_path, mode):
    """GSPO's one ratio per response passes the response's gradient to each of its tokens: a token that IcePop
    drops (weight 0) would still train, and token TIS weights would be averaged over the response. Refused at
    start naming both fields and the alternatives; GSPO-token, which gives each token its own gradient, keeps
    the dropped token's at exactly 0."""
    async_run = ["rollout.async_steps=1", "eval.at_start=false"]
    with pytest.raises(ValueError, match=rf"^policy_loss=gspo with rollout.importance_sampling={mode}: .*gspo-token"):
        _grpo(noisy_sft, tmp_path, "gspo", *async_run, "policy_loss=gspo", f"rollout.importance_sampling={mode}")
    with pytest.raises(ValueError, match=r"\(preset=gspo sets it\)"):
        _grpo(noisy_sft, tmp_path, "gspo", *async_run, "preset=gspo", f"rollout.importance_sampling={mode}")
    _grpo(noisy_sft, tmp_path, "gspo", *async_run, "policy_loss=gspo-token", f"rollout.importance_sampling={mode}")
    _grpo(noisy_sft, tmp_path, "gspo", *async_run, "policy_loss=gspo", "rollout.importance_sampling=sequence_mask")
    # the alternative named: token 1's ratio π_old/μ = e^2 is outside IcePop's band [0.5, 2], so it is dropped
    from posttrain.core import POLICY_LOSSES, masked_importance_weights

    old, behaviour, mask = torch.tensor([[-1.0, -1.0, -1.0]]), torch.tensor([[-1.0, -3.0, -1.0]]), torch.ones(1, 3)
    weights, keep = masked_importance_weights(old, behaviour, mask, "token", 0.5, 2.0)
    assert keep.tolist() == [[True, False, True]]
    gradients = {}
    for name in ("gspo", "gspo-token"):
        logprobs = old.clone().requires_grad_(True)
        pg, _ = POLICY_LOSSES[name](logprobs, old, torch.ones(1, 3) * weights, mask, clip_low=0.2, clip_high=0.2)
        aggregate_loss(pg, mask, "seq-mean-token-mean").backward()
        gradients[name] = logprobs.grad[0].tolist()
    assert gradients["gspo-token"][1] == 0.0  # the dropped token does not train
    assert gradients["gspo"][1] != 0.0  # why gspo is refused: −(1/3)·(2/3) on every token, the dropped one too


def test_grpo_resume_reproduces_the_uninterrupted_run(noisy_sft, tmp_path):
    common = ["run.max_steps=4", "run.save_every=2", "kl_coef=0.05", "minibatches=2", "num_iterations=2"]
    straight = _grpo(noisy_sft, tmp_path, "straight", *common)
    train_grpo(straight)
    # the last step saves too (new-user finding 19): a finished run extends from where it ended
    assert [p.name for p in list_checkpoints(tmp_path / "straight")] == ["step-000002", "step-000004"]
    crashed = _grpo(noisy_sft, tmp_path, "crashed", *common)

    crash = crash_at(3)  # after the checkpoint of step 2, before the end

    with pytest.raises(KeyboardInterrupt):
        train_grpo(crashed, callbacks=[crash])
    train_grpo(_grpo(noisy_sft, tmp_path, "crashed", *common, "run.resume_from=latest"))
    a = load_file(tmp_path / "straight" / "final" / "policy" / "model.safetensors")
    b = load_file(tmp_path / "crashed" / "final" / "policy" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    rewards = {name: [r["reward/mean"] for r in read_metrics(tmp_path / name)] for name in ("straight", "crashed")}
    assert rewards["crashed"][-2:] == rewards["straight"][-2:]  # the same samples after the resume


def test_mask_truncated_leaves_truncated_responses_out(noisy_sft, tmp_path, capsys):
    config = _grpo(
        noisy_sft,
        tmp_path,
        "trunc",
        "run.max_steps=1",
        "mask_truncated=true",
        "sampling.max_new_tokens=1",
        "sampling.min_new_tokens=1",
    )
    train_grpo(config)
    (record,) = read_metrics(config.run.output_dir)
    # every response is truncated and left out: no update (the weights are the SFT model's), no
    # policy metrics that would read as a zero gradient, and the console says why
    assert record["truncated_share"] == 1.0 and "grad_norm" not in record
    assert "mask_truncated leaves it out; no update" in capsys.readouterr().out
    before = load_file(Path(noisy_sft["policy"]) / "model.safetensors")
    after = load_file(tmp_path / "trunc" / "final" / "policy" / "model.safetensors")
    assert all(torch.equal(before[k], after[k]) for k in before)


# --------------------------------------------------------------------------------------------------
# PPO
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def vowel_rm(tiny_dir, tmp_path_factory):
    """A reward model that prefers responses with more vowels, and a prompt file."""
    from posttrain.trainers import rm

    root = tmp_path_factory.mktemp("vowel_rm")
    data = _jsonl(root / "pairs.jsonl", vowel_pairs(1000, seed=0))
    config = load_config(
        rm.RMConfig,
        None,
        [
            f"model.path={tiny_dir / 'policy'}",
            f"data.path={data}",
            "data.chat_template=never",
            f"run.output_dir={root / 'rm'}",
            "run.max_steps=60",
            "run.batch_size=16",
            "optim.lr=2e-3",
            "optim.scheduler=constant",
            "run.progress=false",
            "run.report_to=[jsonl]",
        ],
    )
    rm.train(config)
    return {
        "reward": str(root / "rm" / "final" / "reward"),
        "prompts": _jsonl(root / "p.jsonl", [{"prompt": "rank:"}] * 64),
    }


def _ppo(tiny_dir, vowel_rm, tmp_path, name, *overrides):
    base = [
        f"model.path={tiny_dir / 'policy'}",
        f"reward_model.path={vowel_rm['reward']}",
        f"data.path={vowel_rm['prompts']}",
        "data.chat_template=never",
        f"run.output_dir={tmp_path / name}",
        "run.progress=false",
        "run.report_to=[jsonl]",
        "run.batch_size=32",
        "run.micro_batch_size=16",
        "optim.lr=1e-3",
        "sampling.max_new_tokens=8",
        "sampling.min_new_tokens=8",
    ]
    return load_config(PPOConfig, None, base + list(overrides))


def test_ppo_held_out_evaluation_scores_with_the_reward_model_by_default(tiny_dir, vowel_rm, tmp_path):
    """Without eval.rewards a PPO run evaluates with its training reward, the reward model (it raised
    "at least one reward function is needed" after loading the models: a new user's finding)."""
    config = _ppo(
        tiny_dir,
        vowel_rm,
        tmp_path,
        "ppo_eval",
        "run.max_steps=1",
        "run.batch_size=16",
        "critic=policy",
        f"eval.path={vowel_rm['prompts']}",
        "eval.max_prompts=4",
    )
    train_ppo(config)
    records = [r for r in read_metrics(config.run.output_dir) if "eval/greedy/score" in r]
    assert [r["step"] for r in records] == [0, 1]  # the starting model, and the end
    for record in records:
        assert math.isfinite(record["eval/greedy/reward/reward_model"])
        assert record["eval/greedy/score"] == record["eval/greedy/reward/reward_model"]


def _tail(records, key, n=5):
    return sum(r[key] for r in records[-n:]) / n


@pytest.mark.slow  # `make test-slow`: outside `make test`, which holds to 15 minutes
def test_ppo_raises_reward_model_score_and_larger_kl_coef_gives_smaller_kl(tiny_dir, vowel_rm, tmp_path):
    finals = {}
    for kl_coef in (0.0, 0.3):
        config = _ppo(tiny_dir, vowel_rm, tmp_path, f"kl{kl_coef}", "run.max_steps=30", f"kl_coef={kl_coef}")
        train_ppo(config)
        records = read_metrics(config.run.output_dir)
        assert _tail(records, "score/mean") > records[0]["score/mean"] + 3.0
        assert records[0]["kl/per_sequence"] == pytest.approx(0.0, abs=1e-3)  # policy = reference at step 1
        for r in records:
            assert abs(r["policy/first_minibatch_ratio_max"] - 1) < 1e-5 and r["policy/first_minibatch_clipfrac"] == 0
        finals[kl_coef] = _tail(records, "kl/per_sequence")
    assert finals[0.3] < 0.75 * finals[0.0], finals  # the KL penalty pulls towards the reference
    for key in (
        "value_loss",
        "value_clipfrac",
        "values/explained_variance",
        "policy/clipfrac",
        "policy/approx_kl",
        "entropy",
        "kl/per_token",
        "kl_coef",
        "advantages/mean",
        "score/reward_model",
        "time/reference",
        "time/values",
        "critic_grad_norm",
    ):
        assert key in records[-1], key
    assert (tmp_path / "kl0.3" / "final" / "critic" / "model.safetensors").is_file()


def test_ppo_resume_is_exact_with_adaptive_kl_state(tiny_dir, vowel_rm, tmp_path):
    common = [
        "run.max_steps=4",
        "run.save_every=2",
        "adaptive_kl=true",
        "kl_target=0.5",
        "kl_horizon=100",
        "minibatches=2",
        "ppo_epochs=2",
    ]
    straight = train_ppo(_ppo(tiny_dir, vowel_rm, tmp_path, "straight", *common))

    crash = crash_at(3)  # after the checkpoint of step 2, before the end

    with pytest.raises(KeyboardInterrupt):
        train_ppo(_ppo(tiny_dir, vowel_rm, tmp_path, "crashed", *common), callbacks=[crash])
    resumed = train_ppo(_ppo(tiny_dir, vowel_rm, tmp_path, "crashed", *common, "run.resume_from=latest"))
    assert resumed["kl_coef"] == straight["kl_coef"] != 0.05  # the controller moved, and its state resumed
    for role in ("policy", "critic"):
        a = load_file(tmp_path / "straight" / "final" / role / "model.safetensors")
        b = load_file(tmp_path / "crashed" / "final" / role / "model.safetensors")
        assert all(torch.equal(a[k], b[k]) for k in a), role


def test_ppo_shared_value_head_and_lora_policy(tiny_dir, vowel_rm, tmp_path):
    shared = _ppo(tiny_dir, vowel_rm, tmp_path, "shared", "run.max_steps=3", "critic=shared")
    train_ppo(shared)
    assert (tmp_path / "shared" / "final" / "policy" / "value_head.safetensors").is_file()
    records = read_metrics(shared.run.output_dir)
    assert records[0]["values/mean"] == 0.0  # the value head starts at zero output
    lora = _ppo(
        tiny_dir,
        vowel_rm,
        tmp_path,
        "lora",
        "run.max_steps=3",
        "critic=policy",
        'model.lora={"r": 4, "target_modules": ["q_proj", "v_proj"], "lora_dropout": 0.0}',
        "reference=adapter",
    )
    train_ppo(lora)
    records = read_metrics(lora.run.output_dir)
    assert records[0]["kl/per_sequence"] == pytest.approx(0.0, abs=1e-3)  # adapter-off reference = policy at start
    assert (tmp_path / "lora" / "final" / "policy" / "adapter_config.json").is_file()


def test_ppo_config_errors_name_the_field(tiny_dir, vowel_rm, tmp_path):
    with pytest.raises(ValueError, match="a reward is needed"):
        load_config(PPOConfig, None, ["model.path=x", "data.path=y"])
    with pytest.raises(ValueError, match="critic=reward needs reward_model"):
        load_config(PPOConfig, None, ["model.path=x", "data.path=y", EXACT])
    with pytest.raises(ValueError, match="kl_estimator must be one of"):
        _ppo(tiny_dir, vowel_rm, tmp_path, "bad", "kl_estimator=k4")


def test_missing_eos_penalty_looks_at_the_response_only(tiny_dir, vowel_rm, tmp_path):
    """docs/pitfalls.md #7: an EOS inside the prompt does not count; a response that ends in EOS is not penalised."""
    from posttrain.trainers.ppo import PPOTrainer

    # hf: the hook below boosts EOS in batch row 0, and the lean engine drops finished rows from its batch,
    # so the other row would move up into row 0 and be boosted too
    trainer = PPOTrainer(
        _ppo(tiny_dir, vowel_rm, tmp_path, "eos", "missing_eos_penalty=2.0", "critic=policy", "rollout.engine=hf")
    )
    eos = trainer.tokenizer.eos_token_id
    prompt = trainer.tokenizer("rank:").input_ids + [eos] + trainer.tokenizer("go").input_ids  # EOS in the prompt
    policy = trainer.engine.model

    def boost_eos_in_row_0(module, inputs, logits):
        bias = torch.zeros_like(logits)
        bias[0, ..., eos] = 60.0
        return logits + bias

    handle = policy.lm_head.register_forward_hook(boost_eos_in_row_0)
    try:
        from posttrain.rollout import SamplingParams

        rollout = trainer.engine.generate([prompt, prompt], SamplingParams(max_new_tokens=6, min_new_tokens=2))
    finally:
        handle.remove()
    assert rollout.truncated.tolist() == [False, True]
    penalised, _ = trainer.scores(rollout, {})
    trainer.config.missing_eos_penalty = None
    plain, _ = trainer.scores(rollout, {})
    assert (plain - penalised).tolist() == pytest.approx([0.0, 2.0])


# --------------------------------------------------------------------------------------------------


def _attention_calls_with_grad(model) -> list[int]:
    """A counter of forward calls of the first decoder layer's attention under autograd: one per
    training forward, and one more when gradient checkpointing recomputes it in the backward."""
    calls = [0]

    def hook(module, inputs, output):
        calls[0] += torch.is_grad_enabled()

    attention = next(m for name, m in model.named_modules() if name.endswith("layers.0.self_attn"))
    attention.register_forward_hook(hook)
    return calls


@pytest.mark.parametrize("algorithm", ["ppo", "ppo_shared", "grpo"])
def test_gradient_checkpointing_recomputes_in_the_trained_models(tiny_dir, tmp_path, algorithm):
    # issue 9 item 6: the models stayed in eval mode, where transformers never checkpoints
    prompts = _jsonl(tmp_path / "prompts.jsonl", [{"prompt": "1+2=", "answer": "3"}] * 8)
    common = [
        f"model.path={tiny_dir / 'policy'}",
        f"data.path={prompts}",
        "data.chat_template=never",
        "run.progress=false",
        "run.report_to=[jsonl]",
        "run.max_steps=1",
        "run.batch_size=4",
        "run.micro_batch_size=2",  # 2 training micro-batches per model
        "sampling.max_new_tokens=4",
    ]
    counts = {}
    for checkpointing in (False, True):
        overrides = [*common, f"run.output_dir={tmp_path / str(checkpointing)}"]
        overrides.append(f"model.gradient_checkpointing={str(checkpointing).lower()}")
        if algorithm == "grpo":
            trainer = GRPOTrainer(load_config(GRPOConfig, None, [*overrides, EXACT, "num_generations=2"]))
            models = {"policy": trainer.actor.model}
        else:
            critic = "shared" if algorithm == "ppo_shared" else "reward"
            overrides += [f"reward_model.path={tiny_dir / 'reward'}", f"critic={critic}", "ppo_epochs=1"]
            trainer = PPOTrainer(load_config(PPOConfig, None, overrides))
            models = {"policy": trainer.engine.model}
            if critic == "reward":
                models["critic"] = trainer.critic.model
        calls = {role: _attention_calls_with_grad(trainer.accelerator.unwrap_model(m)) for role, m in models.items()}
        trainer.train()
        counts[checkpointing] = {role: c[0] for role, c in calls.items()}
    assert counts == {False: {role: 2 for role in models}, True: {role: 4 for role in models}}


@pytest.mark.parametrize("engine", ["hf", "lean"])
def test_bf16_first_minibatch_ratio_is_one_and_lean_runs(noisy_sft, tmp_path, engine):
    """New-user trial (fourth session): under run.mixed_precision=bf16 the lean engine crashed (its
    written-out float32 step met the autocast prefill's bf16 cache), and with either engine the
    sampler's log-probs, taken as the old ones, gave a first-minibatch ratio of 1.002: the sampler's
    forward and the packed training forward round differently in bf16. The old log-probs are now
    recomputed by the training forward in half precision. A subprocess: accelerate keeps one mixed
    precision per process."""
    import subprocess
    import sys

    overrides = [
        f"model.path={noisy_sft['policy']}",
        f"data.path={noisy_sft['prompts']}",
        "data.chat_template=never",
        f"run.output_dir={tmp_path / 'run'}",
        "run.progress=false",
        "run.report_to=[jsonl]",
        EXACT,
        "sampling.max_new_tokens=4",
        "num_generations=8",
        "run.batch_size=32",
        "run.max_steps=2",
        "run.mixed_precision=bf16",
        f"rollout.engine={engine}",
    ]
    done = subprocess.run(
        [sys.executable, "-m", "posttrain.cli", "grpo", *overrides], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "half precision: the old log-probs are recomputed by the training forward" in done.stdout
    records = read_metrics(tmp_path / "run")
    assert len(records) == 2
    for r in records:
        assert (
            abs(r["policy/first_minibatch_ratio_max"] - 1) < 1e-6
            and abs(r["policy/first_minibatch_ratio_min"] - 1) < 1e-6
        )
        assert r["rollout/logprob_diff_max"] > 0  # the sampler's bf16 rounding, now measured instead of trained on


def test_a_run_says_the_checkpoints_generation_config_is_not_used(noisy_sft, tmp_path, capsys):
    """New-user trial (fourth session): a checkpoint's own sampling settings (here top_k=5, temperature
    0.7, repetition penalty 1.3) were ignored, as the rollout docs say, but the run said nothing; a
    user relying on them would not find out. A checkpoint without such settings prints nothing."""
    from helpers import copy_with_generation_defaults

    styled = copy_with_generation_defaults(
        noisy_sft["policy"],
        tmp_path / "styled_policy",
        do_sample=True,
        top_k=5,
        temperature=0.7,
        repetition_penalty=1.3,
    )
    for policy, name in ((styled, "styled"), (noisy_sft["policy"], "plain")):
        train_grpo(_grpo(noisy_sft, tmp_path, name, f"model.path={policy}", "run.max_steps=1", "run.batch_size=16"))
        out = capsys.readouterr().out
        line = (
            "[grpo] the checkpoint's generation_config (do_sample=True, repetition_penalty=1.3, temperature=0.7, "
            "top_k=5) is not used: rollouts sample softmax(logits / sampling.temperature)"
        )
        assert (line in out) == (name == "styled"), out
        assert ("generation_config" in out) == (name == "styled"), out
