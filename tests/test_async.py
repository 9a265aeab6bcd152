"""Asynchronous rollouts (``rollout.async_steps``, runtime/producer.py): a producer process draws the next
steps' batches while the trainer updates. The version schedule (batch b drawn by version max(0, b − k)),
the staleness bound, the importance correction, resume, a dying producer, and async 0 left as it was."""

import json
import os
import signal
import threading

import pytest
import torch
from helpers import crash_at
from safetensors.torch import load_file
from test_trainers_online import REWARD_FILE
from test_trainers_online import _grpo as online_grpo

from posttrain.runtime.checkpoint import list_checkpoints
from posttrain.runtime.config import load_config
from posttrain.runtime.metrics import read_metrics
from posttrain.runtime.producer import ProducerError
from posttrain.trainers.grpo import GRPOTrainer
from posttrain.trainers.grpo import train as train_grpo
from posttrain.trainers.ppo import PPOConfig
from posttrain.trainers.ppo import train as train_ppo


def _grpo(noisy_sft, tmp_path, name, *overrides):
    """test_trainers_online's GRPO run, smaller (4 prompts × 4 samples), logging every sample."""
    small = ["num_generations=4", "run.batch_size=16", "run.micro_batch_size=16", "log_completions=16"]
    return online_grpo(noisy_sft, tmp_path, name, *small, "eval.at_start=false", *overrides)


def _samples(run_dir) -> dict[int, list[str]]:
    out: dict[int, list[str]] = {}
    for line in (run_dir / "samples.jsonl").read_text().splitlines():
        row = json.loads(line)
        out.setdefault(row["step"], []).append(row["completion"])
    return out


def test_async_batches_are_one_version_old_and_the_run_learns_the_same_way(noisy_sft, tmp_path):
    config = _grpo(
        noisy_sft, tmp_path, "async", "run.max_steps=4", "rollout.async_steps=1", "rollout.importance_sampling=token"
    )
    threads = torch.get_num_threads()
    result = train_grpo(config)
    assert torch.get_num_threads() == threads  # the producer's thread lent back: later work runs as before
    rows = read_metrics(config.run.output_dir)
    assert [r["rollout/staleness_max"] for r in rows] == [0.0, 1.0, 1.0, 1.0]  # batch b drawn by version b − 1
    assert all(r["rollout/stale_batches"] == 0.0 for r in rows)
    # step 1's batch was drawn by the starting weights, which are π_old: the gap is float noise only
    assert rows[0]["rollout/logprob_diff_max"] < 1e-5
    assert rows[0]["policy/first_minibatch_ratio_max"] == pytest.approx(1.0, abs=1e-5)
    # later batches come from one version back: a real gap, corrected by importance weights
    assert rows[-1]["rollout/logprob_diff_mean"] > 1e-4
    assert 0 < rows[-1]["rollout/importance_weight_mean"] < 2.0
    assert result["steps"] == 4


def test_the_same_seed_draws_the_same_samples_however_fast_either_side_runs(noisy_sft, tmp_path):
    common = ["run.max_steps=3", "rollout.async_steps=2"]
    train_grpo(_grpo(noisy_sft, tmp_path, "a", *common))
    train_grpo(_grpo(noisy_sft, tmp_path, "b", *common, "run.micro_batch_size=4"))  # a slower trainer
    assert _samples(tmp_path / "a") == _samples(tmp_path / "b")
    rows = read_metrics(tmp_path / "a")
    assert [r["rollout/staleness_max"] for r in rows] == [0.0, 1.0, 2.0]


def test_async_zero_builds_no_producer_and_is_the_synchronous_run(noisy_sft, tmp_path):
    train_grpo(_grpo(noisy_sft, tmp_path, "default", "run.max_steps=2"))
    config = _grpo(noisy_sft, tmp_path, "zero", "run.max_steps=2", "rollout.async_steps=0")
    trainer = GRPOTrainer(config)
    trainer.train()
    assert trainer.producer is None
    a = load_file(tmp_path / "default" / "final" / "policy" / "model.safetensors")
    b = load_file(tmp_path / "zero" / "final" / "policy" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert "rollout/staleness_max" not in read_metrics(tmp_path / "zero")[0]


@pytest.mark.parametrize("on_stale", ["drop", "regenerate"])
def test_a_batch_staler_than_the_bound_is_never_trained_on(noisy_sft, tmp_path, on_stale, capsys):
    config = _grpo(
        noisy_sft, tmp_path, on_stale, "run.max_steps=3", "rollout.async_steps=1", f"rollout.on_stale={on_stale}"
    )
    trainer = GRPOTrainer(config)
    config.rollout.max_staleness = 0  # past validation: every batch after the first is one version too old
    trainer.train()
    rows = read_metrics(config.run.output_dir)
    assert [r["rollout/stale_batches"] for r in rows] == [0.0, 1.0, 1.0]
    if on_stale == "drop":
        assert all("policy/clipfrac" not in r for r in rows[1:])  # no update on a dropped batch
        assert "more than rollout.max_staleness=0: dropped" in capsys.readouterr().out
    else:  # drawn again by the current policy: the old log-probs are the sampler's own
        assert all(r["policy/first_minibatch_ratio_max"] == pytest.approx(1.0, abs=1e-5) for r in rows)


def test_a_resumed_async_run_trains_on_the_samples_the_killed_one_would_have(noisy_sft, tmp_path):
    common = ["run.max_steps=4", "run.save_every=2", "rollout.async_steps=2", "rollout.importance_sampling=sequence"]
    train_grpo(_grpo(noisy_sft, tmp_path, "straight", *common))
    with pytest.raises(KeyboardInterrupt):
        train_grpo(_grpo(noisy_sft, tmp_path, "crashed", *common), callbacks=[crash_at(3)])
    (checkpoint,) = [p for p in list_checkpoints(tmp_path / "crashed") if p.name == "step-000002"]
    assert (checkpoint / "rollout_queue_0.pt").is_file()  # batches 3 and 4, drawn by versions 0 and 1
    train_grpo(_grpo(noisy_sft, tmp_path, "crashed", *common, "run.resume_from=latest"))
    assert _samples(tmp_path / "crashed") == _samples(tmp_path / "straight")
    a = load_file(tmp_path / "straight" / "final" / "policy" / "model.safetensors")
    b = load_file(tmp_path / "crashed" / "final" / "policy" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_dying_producer_stops_the_run_with_its_name_and_the_last_checkpoint(noisy_sft, tmp_path):
    config = _grpo(noisy_sft, tmp_path, "dies", "run.max_steps=6", "run.save_every=2", "rollout.async_steps=1")
    trainer = GRPOTrainer(config)

    def kill_after_step_two(done, metrics):
        if done == 2:
            os.kill(trainer.producer.process.pid, signal.SIGKILL)

    timer = threading.Timer(300, lambda: os._exit(3))  # a hang fails the test run instead of blocking it
    timer.start()
    try:
        with pytest.raises(ProducerError, match=r"posttrain-producer-0 .* died \(killed by signal 9\).*step-000002"):
            trainer.train(callbacks=[kill_after_step_two])
    finally:
        timer.cancel()
    assert [p.name for p in list_checkpoints(config.run.output_dir)] == ["step-000002"]
    assert not trainer.producer.process.is_alive()


def test_ppo_runs_asynchronously(noisy_sft, tiny_dir, tmp_path):
    overrides = [
        f"model.path={noisy_sft['policy']}",
        f"reward_model.path={tiny_dir / 'reward'}",
        f"data.path={noisy_sft['prompts']}",
        "data.chat_template=never",
        f"run.output_dir={tmp_path / 'ppo'}",
        "run.progress=false",
        "run.report_to=[jsonl]",
        "sampling.max_new_tokens=4",
        "run.batch_size=8",
        "run.max_steps=3",
        "rollout.async_steps=1",
        "rollout.importance_sampling=token_mask",
        "eval.at_start=false",
    ]
    train_ppo(load_config(PPOConfig, None, overrides))
    rows = read_metrics(tmp_path / "ppo")
    assert [r["rollout/staleness_max"] for r in rows] == [0.0, 1.0, 1.0]
    assert all(0 <= r["rollout/importance_clipped_share"] <= 1 for r in rows)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (["rollout.async_steps=1", "dynamic_sampling=true"], "dynamic_sampling=true"),
        (["rollout.async_steps=1", "rollout.max_staleness=0"], "max_staleness must be >= rollout.async_steps=1"),
    ],
)
def test_async_settings_that_cannot_hold_fail_at_start(noisy_sft, tmp_path, override, message):
    with pytest.raises(ValueError, match=message):
        _grpo(noisy_sft, tmp_path, "bad", *override).validate()


def test_alert_14_watches_the_off_policy_gap():
    from posttrain.monitor.alerts import AlertConfig, HealthMonitor

    def raised(records):
        monitor = HealthMonitor(AlertConfig(window=4), None, "reward/mean", "reward/std", echo=lambda s: None)
        return [a["id"] for step, r in enumerate(records, 1) for a in monitor.check(step, r)]

    base = {"reward/mean": 0.5, "reward/std": 0.3, "kl/per_token": 0.01}
    steady = [{**base, "rollout/logprob_diff_mean": 0.02, "rollout/importance_clipped_share": 0.01}] * 8
    assert 14 not in raised(steady)
    clipped = [{**r, "rollout/importance_clipped_share": 0.4} for r in steady]
    assert 14 in raised(clipped)
    growing = [{**base, "rollout/logprob_diff_mean": 0.01 * 2**i} for i in range(8)]
    assert 14 in raised(growing)
    noise = [{**base, "rollout/logprob_diff_mean": 1e-6 * 2**i} for i in range(8)]  # grows, but float rounding
    assert 14 not in raised(noise)


@pytest.mark.parametrize(
    "launch",
    [
        {"ACCELERATE_USE_FSDP": "true"},
        {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3"},
    ],
)
def test_async_under_a_sharded_engine_is_refused_at_start(noisy_sft, tmp_path, monkeypatch, launch):
    from posttrain.errors import UserError
    from posttrain.runtime import inputs

    for key, value in launch.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(inputs, "_installed", lambda package: True)
    with pytest.raises(UserError, match="rollout.async_steps under FSDP2 or DeepSpeed ZeRO-3"):
        inputs.check_engines(_grpo(noisy_sft, tmp_path, "sharded", "rollout.async_steps=1"))


def test_one_pass_takes_pi_old_from_its_own_forward_and_updates_as_the_separate_pass_would(
    noisy_sft, tmp_path, monkeypatch
):
    """num_iterations = minibatches = 1: the update's forward, detached, is π_old; no old log-prob pass."""
    common = ["run.max_steps=3", "rollout.async_steps=1", "rollout.importance_sampling=token", "kl_coef=0.05"]
    train_grpo(_grpo(noisy_sft, tmp_path, "one_pass", *common, "kl_estimator=k3"))
    with monkeypatch.context() as patch:
        patch.setattr(GRPOTrainer, "single_pass", lambda self, rollout: False)
        train_grpo(_grpo(noisy_sft, tmp_path, "separate", *common, "kl_estimator=k3"))
    one, separate = read_metrics(tmp_path / "one_pass"), read_metrics(tmp_path / "separate")
    assert [r["passes/old_logprobs"] for r in one] == [0, 0, 0]
    assert [r["passes/old_logprobs"] for r in separate] == [1, 2, 3]
    for a, b in zip(one, separate, strict=True):
        for key in ("rollout/logprob_diff_mean", "rollout/importance_weight_mean", "kl/per_token", "kl/per_sequence"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-7), key
        assert a["policy/first_minibatch_ratio_max"] == pytest.approx(1.0, abs=1e-6)
    x = load_file(tmp_path / "one_pass" / "final" / "policy" / "model.safetensors")
    y = load_file(tmp_path / "separate" / "final" / "policy" / "model.safetensors")
    assert all(torch.allclose(x[k], y[k], atol=1e-6) for k in x)


def test_one_pass_tallies_the_kl_over_the_trained_tokens_as_the_separate_pass_does(noisy_sft, tmp_path, monkeypatch):
    """With unscored rows (a reward of None) and truncated ones left out (mask_truncated), the one-pass update's
    KL metrics count the tokens that train, as the separate pass's do: not every sampled token, and
    ``kl/per_sequence`` over the rows that train, not over rows whose KL was never summed."""
    (tmp_path / "my_rewards.py").write_text(REWARD_FILE)
    common = [
        "run.max_steps=3",
        "run.batch_size=32",  # 8 prompts a step, each step with one-digit and two-digit sums
        "rollout.async_steps=1",
        "rollout.importance_sampling=token",
        "kl_coef=0.05",
        "mask_truncated=true",
        "sampling.max_new_tokens=2",  # one-digit sums end in time, two-digit ones are cut
        f"rewards=[{{function: '{tmp_path / 'my_rewards.py'}:quarter_unscored'}}]",
    ]
    train_grpo(_grpo(noisy_sft, tmp_path, "one_pass", *common))
    with monkeypatch.context() as patch:
        patch.setattr(GRPOTrainer, "single_pass", lambda self, rollout: False)
        train_grpo(_grpo(noisy_sft, tmp_path, "separate", *common))
    one, separate = read_metrics(tmp_path / "one_pass"), read_metrics(tmp_path / "separate")
    assert [r["passes/old_logprobs"] for r in one] == [0, 0, 0]
    assert all(r["reward/applicable_share"] == 0.75 for r in one)
    assert all(0 < r["truncated_share"] < 1 for r in one)  # some rows cut at max_new_tokens, left out
    for a, b in zip(one, separate, strict=True):
        assert a["truncated_share"] == b["truncated_share"]  # the same samples
        for key in ("kl/per_token", "kl/per_sequence"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-7), key


def test_the_producer_ignores_a_sigterm_sent_to_every_process_of_the_job(noisy_sft, tmp_path):
    """A scheduler's SIGTERM goes to the whole job: the trainer checkpoints with the producer's queue, so the
    producer must outlive it (and it still ends with the run)."""
    config = _grpo(noisy_sft, tmp_path, "term", "run.max_steps=3", "rollout.async_steps=1")
    trainer = GRPOTrainer(config)

    def terminate_the_producer(done, metrics):
        if done == 1:
            os.kill(trainer.producer.process.pid, signal.SIGTERM)

    trainer.train(callbacks=[terminate_the_producer])
    assert [r["step"] for r in read_metrics(config.run.output_dir)] == [1, 2, 3]
    assert not trainer.producer.process.is_alive()


def test_a_checkpoint_resumes_only_with_the_number_of_processes_that_wrote_it(tmp_path):
    from types import SimpleNamespace

    from posttrain.runtime.producer import Producer

    (tmp_path / "rollout_queue_0.pt").write_bytes(b"")
    (tmp_path / "rollout_queue_1.pt").write_bytes(b"")
    handle = SimpleNamespace(requested={}, ready={}, last_checkpoint="none yet")
    with pytest.raises(ProducerError, match="queues of 2 process"):
        Producer.load_queue(handle, tmp_path, 0, 1)


def test_a_policy_trained_with_gradient_checkpointing_samples_asynchronously(noisy_sft, tmp_path):
    """transformers' input-grad hook (a local function) cannot cross to the spawned producer: the producer's
    copy leaves gradient checkpointing out (found by a new user's run)."""
    config = _grpo(
        noisy_sft, tmp_path, "ckpt", "run.max_steps=2", "rollout.async_steps=1", "model.gradient_checkpointing=true"
    )
    train_grpo(config)
    assert [r["rollout/staleness_max"] for r in read_metrics(config.run.output_dir)] == [0.0, 1.0]
