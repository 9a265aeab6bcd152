"""A critic that keeps up (issue 38 item 3): VC-PPO's decoupled λ and value pretraining, VAPO's length-adaptive λ.
Core values worked out by hand; the trainer's pretraining on the tiny models (the policy bit-for-bit frozen,
the critic trained, the metrics logged, resume and stop signals)."""

import json
import math
import signal
from dataclasses import replace

import pytest
import torch
from helpers import assert_close, crash_at
from safetensors.torch import load_file
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from posttrain.core import decoupled_gae, gae, length_adaptive_lam
from posttrain.data.synthetic import arithmetic_sft
from posttrain.rollout import SamplingParams
from posttrain.runtime import signals
from posttrain.runtime.config import load_config
from posttrain.runtime.metrics import read_metrics
from posttrain.trainers.ppo import PPOConfig, PPOTrainer
from posttrain.trainers.ppo import train as train_ppo

# -- core ------------------------------------------------------------------------------------------------------

REWARDS = torch.tensor([[0.0, 0.0, 1.0], [1.0, 0.0, 2.0]])
VALUES = torch.tensor([[0.5, 0.6, 0.7], [0.2, 0.4, float("nan")]])
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])


def test_gae_with_one_lambda_per_row_by_hand():
    # γ = 0.5. row 0, λ = 1:  δ2 = 1 − 0.7 = 0.3 → A2 = 0.3;  δ1 = 0.5·0.7 − 0.6 = −0.25 → A1 = −0.25 + 0.5·0.3 = −0.1;
    #                         δ0 = 0.5·0.6 − 0.5 = −0.2 → A0 = −0.2 + 0.5·(−0.1) = −0.25;
    #                         returns A + V = 0.25, 0.5, 1: the discounted reward-to-go (λ = 1)
    # row 1, λ = 0.5 (t = 1 its last token, no bootstrap from the NaN):  δ1 = 0 − 0.4 → A1 = −0.4;
    #                         δ0 = 1 + 0.5·0.4 − 0.2 = 1.0 → A0 = 1.0 + 0.5·0.5·(−0.4) = 0.9;  returns 1.1, 0
    adv, ret = gae(REWARDS, VALUES, MASK, gamma=0.5, lam=torch.tensor([1.0, 0.5]))
    assert_close(adv, [[-0.25, -0.1, 0.3], [0.9, -0.4, 0.0]])
    assert_close(ret, [[0.25, 0.5, 1.0], [1.1, 0.0, 0.0]])
    # each row as if it were alone with its λ as a number: rows never mix (any micro-batch split gives the same)
    for row, lam in ((0, 1.0), (1, 0.5)):
        alone = gae(REWARDS[row : row + 1], VALUES[row : row + 1], MASK[row : row + 1], gamma=0.5, lam=lam)
        assert_close(alone[0], adv[row : row + 1])
        assert_close(alone[1], ret[row : row + 1])
    with pytest.raises(ValueError, match="one λ per row"):
        gae(REWARDS, VALUES, MASK, lam=torch.tensor([0.5, 0.5, 0.5]))


def test_decoupled_gae_returns_with_the_critics_lambda_advantages_with_the_actors():
    rewards, values, mask = REWARDS[:1], torch.tensor([[0.5, 0.6, 0.7]]), MASK[:1]
    adv, ret = decoupled_gae(rewards, values, mask, gamma=1.0, lam_actor=0.5, lam_critic=1.0)
    # advantages: GAE(1, 0.5) of row 0, by hand in test_core_values.py::test_gae_by_hand: 0.225, 0.25, 0.3
    assert_close(adv, [[0.225, 0.25, 0.3]])
    # returns: γ = λ = 1 gives the reward-to-go whatever V is: 1, 1, 1 (the coupled λ = 0.5: 0.725, 0.85, 1)
    assert_close(ret, [[1.0, 1.0, 1.0]])
    assert_close(decoupled_gae(rewards, values * 7, mask, 1.0, 0.5, 1.0)[1], [[1.0, 1.0, 1.0]])
    assert_close(gae(rewards, values, mask, gamma=1.0, lam=0.5)[1], [[0.725, 0.85, 1.0]])
    # one λ for both is plain GAE; a per-row λ_actor too
    assert_close(decoupled_gae(rewards, values, mask, 1.0, 0.5, 0.5)[1], [[0.725, 0.85, 1.0]])
    adv_rows, ret_rows = decoupled_gae(rewards, values, mask, 1.0, torch.tensor([0.5]), 1.0)
    assert_close(adv_rows, adv)
    assert_close(ret_rows, ret)


def test_length_adaptive_lambda_by_hand():
    # α = 0.05: α·l = 0, 0.5, 1, 2, 50 → 1 − 1/(α·l) = −inf, −1, 0, 0.5, 0.98 → clamped at 0
    lam = length_adaptive_lam(torch.tensor([0, 10, 20, 40, 1000]), alpha=0.05)
    assert_close(lam, [0.0, 0.0, 0.0, 0.5, 0.98])
    assert lam.dtype == torch.get_default_dtype()
    # a micro-batch's lengths give its rows' λ: nothing depends on the other rows
    assert_close(length_adaptive_lam(torch.tensor([40, 1000]), alpha=0.05), lam[3:])


# -- the trainer ---------------------------------------------------------------------------------------------


@pytest.fixture
def prompts(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": r["prompt"]}) + "\n" for r in arithmetic_sft(32, seed=1)))
    return str(path)


def _config(tiny_dir, prompts, tmp_path, name, *overrides) -> PPOConfig:
    base = [
        f"model.path={tiny_dir / 'policy'}",
        f"reward_model.path={tiny_dir / 'reward'}",
        f"data.path={prompts}",
        "data.chat_template=never",
        f"run.output_dir={tmp_path / name}",
        "run.progress=false",
        "run.report_to=[jsonl]",
        "run.batch_size=8",
        "run.micro_batch_size=4",
        "sampling.max_new_tokens=6",
        "optim.lr=1e-3",
        "ppo_epochs=1",
        "log_completions=0",
    ]
    return load_config(PPOConfig, None, base + list(overrides))


def _snapshot(module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _frozen_during_pretraining(trainer, head: str | None) -> tuple[bool, bool]:
    """Train ``trainer``; (every policy weight bit-for-bit as before pretraining, some critic weight moved by it).
    ``head``: the prefix of a shared value head's weights, which are the critic's, not the policy's."""
    policy_model = trainer.actor.model
    critic_model = policy_model if head else trainer.critic.model
    before = {"policy": _snapshot(policy_model), "critic": _snapshot(critic_model)}
    after, pretrain = {}, trainer.before_first_step

    def pretrain_and_look():
        pretrain()
        after.update(policy=_snapshot(policy_model), critic=_snapshot(critic_model))

    trainer.before_first_step = pretrain_and_look
    trainer.train()
    policy = [k for k in before["policy"] if head is None or not k.startswith(head)]
    critic = [k for k in before["critic"] if head is None or k.startswith(head)]
    frozen = all(torch.equal(before["policy"][k], after["policy"][k]) for k in policy)
    return frozen, any(not torch.equal(before["critic"][k], after["critic"][k]) for k in critic)


def _pretraining_records(output_dir) -> list[dict]:
    records = read_metrics(output_dir)
    pretraining = [r for r in records if "critic_pretrain/step" in r]
    for r in pretraining:
        for key in ("value_loss", "explained_variance", "grad_norm", "returns_mean", "score_mean"):
            assert r[f"critic_pretrain/{key}"] is not None and math.isfinite(r[f"critic_pretrain/{key}"]), key
        assert r["step"] == 0 and r["critic_pretrain/grad_norm"] > 0
    first = next(r for r in records if r["step"] == 1)
    assert abs(first["policy/first_minibatch_ratio_max"] - 1) < 1e-5  # PPO starts on-policy: the policy unchanged
    return pretraining


def test_value_pretraining_trains_a_shared_value_head_alone(tiny_dir, prompts, tmp_path):
    """critic=shared: two pretraining steps move the value head and no other weight of the policy, each logged;
    in TensorBoard each at its own x, −2 and −1, before PPO's steps (not both at step 0)."""
    overrides = ("critic=shared", "value_pretrain_steps=2", "run.max_steps=1", "run.report_to=[jsonl,tensorboard]")
    config = _config(tiny_dir, prompts, tmp_path, "shared", *overrides)
    frozen, moved = _frozen_during_pretraining(PPOTrainer(config), head="v_head.")
    assert frozen and moved
    records = _pretraining_records(config.run.output_dir)
    assert [r["critic_pretrain/step"] for r in records] == [1, 2]
    events = EventAccumulator(str(tmp_path / "shared" / "tensorboard"))
    events.Reload()
    curve = events.Scalars("critic_pretrain/value_loss")
    assert [e.step for e in curve] == [-2, -1]
    assert [e.value for e in curve] == pytest.approx([r["critic_pretrain/value_loss"] for r in records], rel=1e-6)
    assert [e.step for e in events.Scalars("value_loss")] == [1]


def test_value_pretraining_freezes_the_policy_and_is_not_repeated_on_resume(tiny_dir, prompts, tmp_path):
    """A separate critic (from the reward model): pretraining moves it and not the policy; a run resumed after
    its checkpoint does not pretrain again and ends bit-for-bit as the straight run (decoupled and length-adaptive
    λ on)."""
    common = ["value_pretrain_steps=1", "critic_lam=1.0", "length_adaptive_alpha=0.5", "run.max_steps=2"]
    common += ["run.save_every=1"]
    straight = _config(tiny_dir, prompts, tmp_path, "straight", *common)
    assert _frozen_during_pretraining(PPOTrainer(straight), head=None) == (True, True)
    assert [r["critic_pretrain/step"] for r in _pretraining_records(straight.run.output_dir)] == [1]
    with pytest.raises(KeyboardInterrupt):  # after step 1 and its checkpoint
        train_ppo(_config(tiny_dir, prompts, tmp_path, "crashed", *common), callbacks=[crash_at(1)])
    resumed = PPOTrainer(_config(tiny_dir, prompts, tmp_path, "crashed", *common, "run.resume_from=latest"))
    resumed.pretrain_critic = None  # a resumed run that pretrained again would call it
    resumed.train()
    for role in ("policy", "critic"):
        a = load_file(tmp_path / "straight" / "final" / role / "model.safetensors")
        b = load_file(tmp_path / "crashed" / "final" / role / "model.safetensors")
        assert all(torch.equal(a[k], b[k]) for k in a), role
    records = read_metrics(tmp_path / "crashed")
    assert [r["critic_pretrain/step"] for r in records if "critic_pretrain/step" in r] == [1]  # the first run's
    assert all(0 <= r["advantages/lam_mean"] < 1 for r in records if r["step"] > 0)


def test_the_lambda_path_gives_the_same_targets_for_any_micro_batches(tiny_dir, prompts, tmp_path):
    """PPO's step 4 with decoupled and length-adaptive λ (the critic's values in micro-batches, λ per response from
    its length): 1 micro-batch of 8, 4 of 2 and 3 + 3 + 2 give the same advantages and returns."""
    overrides = ("critic_lam=1.0", "length_adaptive_alpha=0.5", "run.micro_batch_size=8")
    trainer = PPOTrainer(_config(tiny_dir, prompts, tmp_path, "micro", *overrides))
    torch.manual_seed(0)
    rollout = trainer.engine.generate(
        [p.prompt_ids for p in trainer.prompts[:8]], SamplingParams(max_new_tokens=6, min_new_tokens=6)
    )
    lengths = torch.tensor([1 + i % 6 for i in range(8)])  # λ = 1 − 2/l: 0, 0, 1/3, 1/2, 3/5, 2/3, 0, 0
    rollout = replace(rollout, response_mask=(torch.arange(6)[None, :] < lengths[:, None]).long())
    rewards = torch.randn(8, 6, generator=torch.Generator().manual_seed(1))

    def targets():
        mask, cfg = rollout.action_mask, trainer.config
        return decoupled_gae(rewards, trainer.values_of(rollout), mask, 1.0, trainer.actor_lam(mask), cfg.returns_lam)

    assert_close(trainer.actor_lam(rollout.action_mask), [0, 0, 1 / 3, 1 / 2, 3 / 5, 2 / 3, 0, 0])
    whole = targets()
    for micro in (2, 3):
        trainer.config.run.micro_batch_size = micro
        for a, b in zip(whole, targets(), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_a_stop_signal_during_value_pretraining_ends_the_run_unsaved(monkeypatch):
    class OneProcess:
        num_processes, is_main_process = 1, True

    monkeypatch.setattr(signals, "_received", [signal.SIGTERM])
    with pytest.raises(signals.TrainingInterrupted) as stopped:
        signals.stop_before_first_step(OneProcess(), "ppo", "value pretraining")
    assert stopped.value.checkpoint is None and stopped.value.code == 143
    assert "during value pretraining, before step 1: nothing was saved" in str(stopped.value)
    monkeypatch.setattr(signals, "_received", [])
    signals.stop_before_first_step(OneProcess(), "ppo", "value pretraining")  # no signal: nothing happens


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("critic_lam=1.5", "critic_lam must be in"),
        ("length_adaptive_alpha=0", "length_adaptive_alpha must be > 0"),
        ("value_pretrain_steps=-1", "value_pretrain_steps must be >= 0"),
    ],
)
def test_critic_knobs_are_checked_at_start(tiny_dir, prompts, tmp_path, override, message):
    with pytest.raises(ValueError, match=message):
        _config(tiny_dir, prompts, tmp_path, "bad", override)


BF16_PRETRAINING = """
import json, sys, torch
from posttrain.rollout import SamplingParams
from posttrain.runtime.config import load_config
from posttrain.runtime.online import PromptSampler
from posttrain.trainers import critic
from posttrain.trainers.ppo import PPOConfig, PPOTrainer

trainer = PPOTrainer(load_config(PPOConfig, sys.argv[1], []))
head = trainer.accelerator.unwrap_model(trainer.actor.model).v_head
with torch.no_grad():  # values far from the scores, so that the lambda of the targets matters
    head.weight.copy_(torch.randn(head.weight.shape, generator=torch.Generator().manual_seed(0)))
fitted, objective = [], critic.value_objective
critic.value_objective = lambda c, v, b, s: fitted.append(v.detach()) or objective(c, v, b, s)
torch.manual_seed(0)
prompts = [p.prompt_ids for p in trainer.prompts[:8]]
rollout = trainer.engine.generate(prompts, SamplingParams(max_new_tokens=6, min_new_tokens=6))
values = trainer.values_of(rollout)  # PPO's forward, in the same micro-batches
zeros = torch.zeros_like(values)
trainer.critic.pretrain_step(0, critic.PPOBatch(rollout, rollout.action_mask, zeros, values + 1, zeros, values))
gap = ((torch.cat(fitted) - values).abs().max() / values.abs().max()).item()
out = trainer.pretrain_critic(1, PromptSampler(len(trainer.prompts), trainer.config.run.seed))
print(json.dumps({"gap": gap, **out}))
"""


def test_shared_head_pretraining_fits_the_values_ppo_reads_towards_monte_carlo_returns(tiny_dir, prompts, tmp_path):
    """critic=shared under bf16 mixed precision (a subprocess: accelerate keeps one mixed precision per process):
    the values the head's pretraining fits are those PPO's forward (accelerate's autocast) gives for the same
    rows, not a full-precision forward PPO never runs (1-2 % off); and its targets are the Monte-Carlo returns
    (λ = 1): with no KL and responses of one length, each token's return is its response's score, whatever the
    values."""
    import subprocess
    import sys

    import yaml

    from posttrain.runtime.config import to_dict

    overrides = ("critic=shared", "value_pretrain_steps=1", "run.mixed_precision=bf16", "kl_coef=0")
    config = _config(tiny_dir, prompts, tmp_path, "bf16", *overrides, "sampling.min_new_tokens=6")
    path = tmp_path / "bf16.yaml"
    path.write_text(yaml.safe_dump(to_dict(config)))
    done = subprocess.run([sys.executable, "-c", BF16_PRETRAINING, str(path)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["gap"] < 1e-4
    assert abs(out["critic_pretrain/values_mean"] - out["critic_pretrain/score_mean"]) > 0.1
    assert out["critic_pretrain/returns_mean"] == pytest.approx(out["critic_pretrain/score_mean"], abs=1e-4)


def test_shared_value_head_pretraining_refuses_fp16(tiny_dir, prompts, tmp_path):
    with pytest.raises(ValueError, match="outside fp16 loss scaling"):
        _config(
            tiny_dir, prompts, tmp_path, "bad", "critic=shared", "value_pretrain_steps=1", "run.mixed_precision=fp16"
        )
