"""PPO and GRPO updates on a fixed rollout: loss normalisation in every mode, every row trained, fp16
gradient unscaling per optimizer, group statistics over scored rows only (issue 9 items 7, 9–12)."""

import json
import sys
from dataclasses import replace

import pytest
import torch

from posttrain.core import AGGREGATION_MODES
from posttrain.data.synthetic import arithmetic_sft
from posttrain.rollout import SamplingParams
from posttrain.runtime import online
from posttrain.runtime.config import load_config
from posttrain.runtime.online import PhaseTimer
from posttrain.trainers.grpo import GRPOConfig, GRPOTrainer
from posttrain.trainers.ppo import PPOConfig, PPOTrainer

REWARDS = '''
def digit_sum(prompts, completions, **columns):
    return [float(sum(ch.isdigit() for ch in c)) + 0.1 * len(c) for c in completions]


def half_scored(prompts, completions, **columns):
    """Per group of 4: 1, 0, None, None."""
    return [[1.0, 0.0, None, None][i % 4] for i in range(len(completions))]
'''


@pytest.fixture
def files(tiny_dir, tmp_path):
    (tmp_path / "my_rewards.py").write_text(REWARDS)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": r["prompt"]}) + "\n" for r in arithmetic_sft(32, seed=1)))
    return {
        "policy": str(tiny_dir / "policy"),
        "reward": str(tiny_dir / "reward"),
        "prompts": str(prompts),
        "rewards": str(tmp_path / "my_rewards.py"),
        "out": tmp_path,
    }


def _ppo(files, *overrides) -> PPOConfig:
    base = [
        f"model.path={files['policy']}",
        f"reward_model.path={files['reward']}",
        f"data.path={files['prompts']}",
        "data.chat_template=never",
        f"run.output_dir={files['out'] / 'ppo'}",
        "run.progress=false",
        "run.report_to=[jsonl]",
        "run.batch_size=8",
        "run.micro_batch_size=8",
        "sampling.max_new_tokens=16",
        "ppo_epochs=1",
        "optim.max_grad_norm=null",  # the gradient as computed, not clipped
    ]
    return load_config(PPOConfig, None, base + list(overrides))


class StepGrads:
    """The gradients each optimizer applies, captured when it steps (after unscaling and clipping)."""

    def __init__(self, **optimizers):
        self.grads = {}
        for name, optimizer in optimizers.items():
            optimizer.optimizer.register_step_pre_hook(self._hook(name))

    def _hook(self, name):
        def hook(optimizer, args, kwargs):
            self.grads[name] = [
                p.grad.clone() for g in optimizer.param_groups for p in g["params"] if p.grad is not None
            ]

        return hook


def _update_inputs(trainer, rollout, seed=0):
    """(old_logprobs, old_values, advantages, returns, mask) for ``PPOTrainer.update``: arbitrary but fixed."""
    g = torch.Generator().manual_seed(seed)
    B, T = rollout.response_ids.shape
    mask = rollout.response_mask
    old_values, advantages, returns = (torch.randn(B, T, generator=g) for _ in range(3))
    return rollout.logprobs - 0.1, old_values, advantages, returns, mask


def _varied_rollout(trainer, T=6):
    """8 responses of exactly T tokens, then response masks of lengths 1..T so the modes differ."""
    prompts = [p.prompt_ids for p in trainer.prompts[:8]]
    torch.manual_seed(0)
    rollout = trainer.engine.generate(prompts, SamplingParams(max_new_tokens=T, min_new_tokens=T))
    lengths = torch.tensor([1 + i % T for i in range(8)])
    mask = (torch.arange(T)[None, :] < lengths[:, None]).long()
    return replace(rollout, response_mask=mask, truncated=torch.zeros(8, dtype=torch.bool))


def _pad(rollout, T: int, pad_id: int):
    extra = T - rollout.response_ids.shape[1]
    return replace(
        rollout,
        response_ids=torch.nn.functional.pad(rollout.response_ids, (0, extra), value=pad_id),
        response_mask=torch.nn.functional.pad(rollout.response_mask, (0, extra)),
        logprobs=torch.nn.functional.pad(rollout.logprobs, (0, extra)),
    )


def _grads_of_update(trainer, rollout, inputs):
    """The gradients of one update (PPO: policy and critic; GRPO: policy), parameters restored afterwards."""
    models = list(trainer.models_to_save().values())
    saved = [{k: v.clone() for k, v in m.state_dict().items()} for m in models]
    trainer.update(0, rollout, *inputs)
    for model, state in zip(models, saved, strict=True):
        model.load_state_dict(state)
    return dict(trainer._grads.grads)


def _trainer_with_grads(config):
    trainer = PPOTrainer(config)
    optimizers = {"policy": trainer.actor.optimizer}
    if hasattr(trainer.critic, "trained"):  # a separate critic has an optimizer of its own
        optimizers["critic"] = trainer.critic.trained.optimizer
    trainer._grads = StepGrads(**optimizers)
    return trainer


def _assert_same_grads(a, b, **tol):
    assert a.keys() == b.keys()
    for name in a:
        for x, y in zip(a[name], b[name], strict=True):
            torch.testing.assert_close(x, y, **tol)


@pytest.mark.parametrize("mode", AGGREGATION_MODES)
def test_ppo_micro_batching_with_entropy_bonus_in_every_mode(files, mode):
    """Item 10: the entropy bonus is reduced like the policy loss, so 1 micro-batch of 8 and 4 of 2 give
    the same gradient in every mode (before, outside token-mean they differed by ~1e-2); so do 3, 3 and 2
    (a micro_batch_size that does not divide: the batch rule of every trainer, newuser #28)."""
    trainer = _trainer_with_grads(_ppo(files, f"loss_agg={mode}", "entropy_coef=0.5", "critic=policy"))
    rollout = _varied_rollout(trainer)
    inputs = _update_inputs(trainer, rollout)
    whole = _grads_of_update(trainer, rollout, inputs)
    for micro in (2, 3):
        trainer.config.run.micro_batch_size = micro
        split = _grads_of_update(trainer, rollout, inputs)
        _assert_same_grads(whole, split, rtol=1e-4, atol=1e-6)


def _off_policy(rollout, seed=0):
    """Old log-probs 0.1·N(0, 1) away from the rollout's, so ratios spread around 1 and some clip."""
    g = torch.Generator().manual_seed(seed)
    return rollout.logprobs + 0.1 * torch.randn(rollout.logprobs.shape, generator=g)


@pytest.mark.parametrize(
    ("policy_loss", "mode"),
    [
        ("gspo", "seq-mean-token-mean"),
        ("gspo-token", "token-mean"),
        ("cispo", "seq-mean-token-sum-norm"),
        ("gmpo", "seq-mean-token-mean"),
        ("sapo", "token-mean"),
    ],
)
def test_grpo_micro_batching_with_gspo_and_cispo(files, policy_loss, mode):
    """GSPO, GSPO-token, CISPO, GMPO and SAPO off-policy (ratios ≠ 1, some clipped or damped): 1 micro-batch
    of 8, 4 of 2 and 3 + 3 + 2 give the same gradient (a response's sequence ratio, GMPO's geometric mean,
    never spans micro-batches)."""
    clip = [] if policy_loss == "sapo" else ["clip_low=0.05"]  # SAPO's gate has no clip range
    config = _grpo_config(files, f"policy_loss={policy_loss}", f"loss_agg={mode}", *clip)
    trainer = GRPOTrainer(config)
    trainer._grads = StepGrads(policy=trainer.actor.optimizer)
    rollout = _varied_rollout(trainer)
    advantages = torch.randn(8, generator=torch.Generator().manual_seed(1))
    inputs = (_off_policy(rollout), None, advantages, rollout.response_mask)
    whole = _grads_of_update(trainer, rollout, inputs)
    assert any(g.abs().sum() > 0 for g in whole["policy"])
    for micro in (2, 3):
        trainer.config.run.micro_batch_size = micro
        _assert_same_grads(whole, _grads_of_update(trainer, rollout, inputs), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("policy_loss", ["gspo-token", "cispo", "sapo"])
def test_ppo_micro_batching_with_gspo_token_and_cispo(files, policy_loss):
    """PPO's per-token GAE advantages through GSPO-token, CISPO and SAPO: the same gradient for any
    micro-batches."""
    clip = [] if policy_loss == "sapo" else ["clip_low=0.05"]  # SAPO's gate has no clip range
    trainer = _trainer_with_grads(_ppo(files, f"policy_loss={policy_loss}", *clip, "critic=policy"))
    rollout = _varied_rollout(trainer)
    _, old_values, advantages, returns, mask = _update_inputs(trainer, rollout)
    inputs = (_off_policy(rollout), old_values, advantages, returns, mask)
    whole = _grads_of_update(trainer, rollout, inputs)
    for micro in (2, 3):
        trainer.config.run.micro_batch_size = micro
        _assert_same_grads(whole, _grads_of_update(trainer, rollout, inputs), rtol=1e-4, atol=1e-6)


def test_ppo_seq_mean_token_sum_norm_divides_by_a_constant(files):
    """Item 9: the same rows padded from T = 6 to T = 12 give the same policy and critic gradients
    (before, the divisor was the padded length of the step: the gradient halved)."""
    trainer = _trainer_with_grads(_ppo(files, "loss_agg=seq-mean-token-sum-norm", "critic=policy"))
    rollout = _varied_rollout(trainer, T=6)
    padded = _pad(rollout, 12, trainer.tokenizer.pad_token_id)
    short = _grads_of_update(trainer, rollout, _update_inputs(trainer, rollout))
    long_inputs = [torch.nn.functional.pad(x, (0, 6)) for x in _update_inputs(trainer, rollout)]
    long = _grads_of_update(trainer, padded, long_inputs)
    _assert_same_grads(short, long, rtol=1e-4, atol=1e-7)


def test_fp16_scaler_unscales_each_optimizer_once(files, monkeypatch):
    """Item 7: with a separate critic under fp16, the critic's applied gradient equals the true one.

    CPU has no fp16 GradScaler in accelerate, so it is emulated exactly: accelerate's own code paths
    (backward scales the loss, clip_grad_norm_ unscales, the optimizer steps through the scaler and
    updates it) with a real torch GradScaler on fp32 weights, so the only difference from the fp32 run
    is the scaling itself. Before the fix the critic's gradient was divided by the scale a second time."""
    plain = _trainer_with_grads(_ppo(files, "critic=policy", "optim.max_grad_norm=1e6"))
    build = online.build_accelerator

    def with_scaler(run):
        accelerator = build(run)  # one AcceleratorState per process: fp16 is declared on this instance only
        accelerator.__class__ = type("FP16OnCPU", (type(accelerator),), {"mixed_precision": "fp16"})
        accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
        return accelerator

    monkeypatch.setattr(online, "build_accelerator", with_scaler)
    scaled = _trainer_with_grads(_ppo(files, "critic=policy", "optim.max_grad_norm=1e6"))
    scaled.accelerator.native_amp = True  # after prepare: the scaler's code paths, but no fp16 autocast on CPU
    assert scaled.critic.trained.optimizer.scaler is scaled.accelerator.scaler
    rollout = _varied_rollout(plain)
    inputs = _update_inputs(plain, rollout)
    expected = _grads_of_update(plain, rollout, inputs)
    got = _grads_of_update(scaled, rollout, inputs)
    assert scaled.accelerator.scaler.get_scale() == 2.0**12  # no overflow: every step was taken
    _assert_same_grads(expected, got, rtol=1e-5, atol=1e-8)


def _grpo_config(files, *overrides) -> GRPOConfig:
    base = [
        f"model.path={files['policy']}",
        f"data.path={files['prompts']}",
        "data.chat_template=never",
        f"run.output_dir={files['out'] / 'grpo'}",
        "run.progress=false",
        "run.report_to=[jsonl]",
        f"rewards=[{{function: '{files['rewards']}:digit_sum'}}]",
        "sampling.max_new_tokens=6",
        "num_generations=2",
        "run.batch_size=8",
        "run.micro_batch_size=8",
        "kl_coef=0",
        "optim.max_grad_norm=null",
    ]
    return load_config(GRPOConfig, None, base + list(overrides))


def _count_trained_rows(model):
    rows = []
    handle = model.register_forward_hook(
        lambda module, args, kwargs, out: rows.append(kwargs["input_ids"].shape[0]), with_kwargs=True
    )
    return rows, handle


def test_every_row_trains_when_minibatches_do_not_divide_the_batch(files):
    """Item 11: 16 rows in 3 minibatches train all 16 (6 + 5 + 5), not 15; more minibatches than rows is
    refused at start."""
    grpo = GRPOTrainer(
        load_config(
            GRPOConfig,
            None,
            [
                f"model.path={files['policy']}",
                f"data.path={files['prompts']}",
                "data.chat_template=never",
                f"run.output_dir={files['out'] / 'grpo'}",
                "run.progress=false",
                "run.report_to=[jsonl]",
                f"rewards=[{{function: '{files['rewards']}:digit_sum'}}]",
                "sampling.max_new_tokens=4",
                "num_generations=2",
                "run.batch_size=16",
                "minibatches=3",
                "kl_coef=0",
                "shared_prefix=false",  # the hook counts forward rows; packing puts a prompt's samples in one
            ],
        )
    )
    rollout, scores, applicable, _ = grpo.rollout_and_score(PhaseTimer())
    mask = rollout.response_mask
    rows, handle = _count_trained_rows(grpo.accelerator.unwrap_model(grpo.actor.model))
    grpo.update(0, rollout, rollout.logprobs, None, grpo.advantages(scores, applicable, None, mask), mask)
    handle.remove()
    assert sorted(rows) == [5, 5, 6]

    trainer = PPOTrainer(_ppo(files, "run.batch_size=16", "minibatches=3", "critic=policy"))
    prompts = [p.prompt_ids for p in trainer.prompts[:16]]
    rollout = trainer.engine.generate(prompts, SamplingParams(max_new_tokens=4))
    rows, handle = _count_trained_rows(trainer.accelerator.unwrap_model(trainer.actor.model))
    trainer.update(0, rollout, *_update_inputs(trainer, rollout))
    handle.remove()
    assert sorted(rows) == [5, 5, 6]
    with pytest.raises(ValueError, match="minibatches=17 is more than the 16 responses"):
        PPOTrainer(_ppo(files, "run.batch_size=16", "minibatches=17", "critic=policy"))


@pytest.mark.parametrize("estimator", ["grpo", "rloo"])
def test_groups_with_unscored_rows_use_the_scored_rows_only(files, estimator):
    """Item 12: rewards 1, 0, None, None in every group of 4. Scored rows only: mean 0.5, std 0.7071
    (Bessel, n = 2), so A = ±0.5 / (0.7071 + 1e-4); RLOO: 1 − 0 = 1 and 0 − 1 = −1; unscored rows 0.
    Filling None with the group mean gave ±1.22 (std over 4 rows shrunk) and a baseline with the row's
    own reward in it."""
    config = load_config(
        GRPOConfig,
        None,
        [
            f"model.path={files['policy']}",
            f"data.path={files['prompts']}",
            "data.chat_template=never",
            f"run.output_dir={files['out'] / 'grpo'}",
            "run.progress=false",
            f"rewards=[{{function: '{files['rewards']}:half_scored'}}]",
            "sampling.max_new_tokens=4",
            "num_generations=4",
            "run.batch_size=8",
            "kl_coef=0",
            f"advantage_estimator={estimator}",
        ],
    )
    trainer = GRPOTrainer(config)
    rollout, scores, applicable, _ = trainer.rollout_and_score(PhaseTimer())
    assert applicable.tolist() == [True, True, False, False] * 2
    advantages = trainer.advantages(scores, applicable, None, rollout.response_mask)
    a = 0.5 / (0.5**0.5 + 1e-4) if estimator == "grpo" else 1.0
    torch.testing.assert_close(advantages, torch.tensor([a, -a, 0.0, 0.0] * 2))


class Reductions:
    """What a GRPO update reduces and reads back, counted on one process: calls that are collectives on several
    (accelerate's ``reduce`` and ``gather``; ``global_sum`` and ``global_min``, which skip their collective on one
    process and are counted as the one they would make) and host syncs (``item``, ``tolist``, ``float``, ``int``,
    ``bool`` of a tensor) made by the update's own code (``runtime/update.py``, ``runtime/online.py``,
    ``runtime/loop.py``, ``trainers/grpo.py``; the model's forward is not counted)."""

    FILES = (
        "posttrain/runtime/update.py",
        "posttrain/runtime/online.py",
        "posttrain/runtime/loop.py",
        "posttrain/trainers/grpo.py",
    )

    def __init__(self, monkeypatch, trainer):
        from posttrain.trainers import grpo

        self.collectives = self.syncs = 0
        for name in ("reduce", "gather"):
            monkeypatch.setattr(trainer.accelerator, name, self._collective(getattr(trainer.accelerator, name)))
        for module in (online, grpo):
            for name in ("global_sum", "global_min"):
                if hasattr(module, name):
                    monkeypatch.setattr(module, name, self._collective(getattr(module, name)))
        for name in ("item", "tolist", "__float__", "__int__", "__bool__"):
            monkeypatch.setattr(torch.Tensor, name, self._sync(getattr(torch.Tensor, name)))

    def _collective(self, function):
        def counted(*args, **kwargs):
            self.collectives += 1
            return function(*args, **kwargs)

        return counted

    def _sync(self, method):
        def counted(tensor, *args, **kwargs):
            caller = sys._getframe(1).f_code.co_filename.replace("\\", "/")
            self.syncs += any(caller.endswith(f) for f in self.FILES)
            return method(tensor, *args, **kwargs)

        return counted


def test_a_grpo_update_reduces_its_statistics_once_whatever_its_micro_batches(files):
    """Two minibatches of 4 rows, in micro-batches of 1 and of 4: the same collectives, 2 per minibatch (its loss
    units before the first backward, its loss for the non-finite guard before the step) and 1 for every statistic
    of the step (one gather of the stacked local sums); and the same host syncs, none per micro-batch."""
    trainer = GRPOTrainer(_grpo_config(files, "minibatches=2", "policy_loss=gspo", "clip_low=0.05"))
    rollout = _varied_rollout(trainer)
    advantages = torch.randn(8, generator=torch.Generator().manual_seed(1))
    inputs = (_off_policy(rollout), None, advantages, rollout.response_mask)
    counts, metrics = {}, {}
    for micro in (1, 4):
        trainer.config.run.micro_batch_size = micro
        with pytest.MonkeyPatch.context() as monkeypatch:
            counted = Reductions(monkeypatch, trainer)
            metrics[micro] = trainer.update(0, rollout, *inputs)
        counts[micro] = (counted.collectives, counted.syncs)
    assert counts[1] == counts[4]
    assert counts[4][0] == 2 * 2 + 1
    assert metrics[1].keys() == metrics[4].keys() and "policy/clipfrac" in metrics[4]


@pytest.mark.parametrize("kl_coef", [0.0, 0.05])
def test_a_grpo_step_reduces_its_logged_metrics_once(files, kl_coef):
    """A whole GRPO step (``train_step`` and ``end_step``: rollout, rewards, advantages, two minibatches, the
    response metrics), without and with the reference's KL metrics: only the collectives that steer the step
    (3 global_min: the prompts to draw, then none left, the groups to train; 1 whether any token trains; 2 per
    minibatch) and 2 for what is only logged (the update's statistics; every other metric, ``step_metrics``),
    however many metrics the step logs. The logged values are those of their definitions."""
    config = _grpo_config(files, "minibatches=2", f"kl_coef={kl_coef}", "run.max_steps=1", "run.save_every=null")
    trainer, logged, counted, returned = GRPOTrainer(config), {}, [], []

    def counting(method):
        def wrapped(*args, **kwargs):
            with pytest.MonkeyPatch.context() as monkeypatch:
                reductions = Reductions(monkeypatch, trainer)
                out = method(*args, **kwargs)
            counted.append(reductions.collectives)
            returned.append(out)
            return out

        return wrapped

    trainer.train_step, trainer.end_step = counting(trainer.train_step), counting(trainer.end_step)
    trainer.train(callbacks=(lambda step, metrics: logged.update(metrics),))
    assert sum(counted) == 3 + 1 + 2 * 2 + 2
    _, rollout, scores = returned[0]
    assert logged["reward/std"] == pytest.approx(float(scores.double().std()), rel=1e-12)
    assert logged["reward/mean"] == pytest.approx(float(scores.double().mean()), rel=1e-12)
    assert logged["response_length/max"] == float(rollout.response_lengths.max())
    assert ("kl/per_token" in logged) == (kl_coef > 0)
    assert {"reward/std", "advantages/std", "groups/zero_variance_share", "response_length/max"} <= logged.keys()
    assert logged["groups/sampled"] == 4 and logged["groups/dropped"] == 0 and logged["tokens_generated"] > 0
    assert logged["response_length/mean"] == logged["tokens_generated"] / 8
    assert 0.0 <= logged["reward/applicable_share"] <= 1.0
