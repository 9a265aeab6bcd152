"""Held-out evaluation scores what training scores, never loses a run, and starts at step 0 (issue 24,
items 1, 2 and 15)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import assert_close

from posttrain.data import PromptExample
from posttrain.monitor.alerts import read_alerts
from posttrain.monitor.evaluate import EvalConfig, Evaluator
from posttrain.rewards import RewardComposer, RewardSpec, unpad
from posttrain.rollout import SamplingParams
from posttrain.runtime.metrics import read_metrics


class _FixedEngine:
    """An engine that answers every generate call with one rollout (rows in prompt order)."""

    def __init__(self, rollout):
        self.rollout = rollout

    def generate(self, prompts, params, n=1):
        assert len(prompts) * n == len(self.rollout)
        return self.rollout


def _eos_rollout(tokenizer):
    """A rollout of the tiny policy in which most responses end with EOS (EOS boosted while sampling)."""
    from posttrain.models import ModelConfig, load_causal_lm
    from posttrain.rollout import HFEngine

    policy = load_causal_lm(ModelConfig(path=tokenizer.name_or_path))
    eos = torch.nn.functional.one_hot(torch.tensor(tokenizer.eos_token_id), policy.config.vocab_size)
    boost = policy.lm_head.register_forward_hook(lambda module, inputs, logits: logits + 4.0 * eos)
    prompts = [tokenizer(f"{a}+{a}=").input_ids for a in range(6)]
    torch.manual_seed(0)
    rollout = HFEngine(policy, tokenizer).generate(prompts, SamplingParams(max_new_tokens=10), n=1)
    boost.remove()
    assert (~rollout.truncated).sum() >= 3  # rows that end with EOS
    return prompts, rollout


def test_evaluation_scores_the_tokens_training_scores_with_a_reward_model(tiny_dir, tokenizer, tmp_path):
    """Item 1: the same completion ids score the same in evaluation as in training (GRPO's reward-function
    call and PPO's reward model), EOS-ended ones included; the decoded text alone scores otherwise."""
    from posttrain.models import ModelConfig, load_reward_model, sequence_scores
    from posttrain.rewards.model import reward_model

    path = str(tiny_dir / "reward")
    prompt_ids, rollout = _eos_rollout(tokenizer)
    spec = RewardSpec("posttrain.rewards.model:reward_model", kwargs={"path": path}, isolation="inline")
    training = RewardComposer.from_specs([spec], tokenizer)(  # as grpo._score and ppo.scores call it
        rollout.prompts,
        rollout.responses,
        {},
        unpad(rollout.prompt_ids, rollout.prompt_mask),
        unpad(rollout.response_ids, rollout.response_mask),
    )
    with torch.no_grad():
        ppo = sequence_scores(load_reward_model(ModelConfig(path=path)), rollout.input_ids, rollout.attention_mask)

    class Config:  # what Evaluator.for_training reads of a trainer's config
        eval = EvalConfig(max_new_tokens=10)
        rewards = [spec]
        sampling = SamplingParams(max_new_tokens=10)

        class run:
            output_dir = str(tmp_path)

    examples = [PromptExample(ids, tokenizer.decode(ids), {}) for ids in prompt_ids]
    evaluator = Evaluator.for_training(Config, examples, tokenizer, accelerator=None)
    metrics = evaluator.evaluate(_FixedEngine(rollout), step=0)
    rows = [json.loads(line) for line in (tmp_path / "eval_samples.jsonl").read_text().splitlines()]
    eval_scores = torch.tensor([r["score"] for r in rows])
    assert_close(eval_scores, training.total, atol=1e-6, rtol=0)
    assert_close(eval_scores, ppo, atol=1e-5, rtol=0)
    assert metrics["eval/greedy/score"] == pytest.approx(float(training.total.mean()), abs=1e-6)
    ended = ~rollout.truncated
    text_only = torch.tensor(reward_model(rollout.prompts, rollout.responses, path=path))
    assert (text_only[ended] - eval_scores[ended]).abs().max() > 1e-3  # what evaluation used to score


REWARDS = '''
from pathlib import Path


def length_ids(prompts, completions, completion_ids):
    return [float(len(ids)) for ids in completion_ids]


def broken(prompts, completions):
    raise ValueError("broken evaluation reward")


def rising(prompts, completions, counter):
    """The training reward: the number of steps so far (counted in a file), rising."""
    path = Path(counter)
    calls = int(path.read_text()) + 1 if path.is_file() else 1
    path.write_text(str(calls))
    return [float(calls) + 0.01 * len(c) for c in completions]


def falling(prompts, completions, counter):
    """The held-out score: 1 for the starting model, 0.5 once a step has been trained."""
    return [1.0 if not Path(counter).is_file() else 0.5 for _ in completions]
'''


def _grpo_config(tiny_dir, tmp_path: Path, *overrides: str):
    from posttrain.runtime.config import load_config
    from posttrain.trainers.grpo import GRPOConfig

    rows = [{"prompt": f"{a}+{b}="} for a in range(4) for b in range(4)]
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "held_out.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:3]))
    (tmp_path / "rewards_file.py").write_text(REWARDS)
    base = [
        f"model.path={tiny_dir / 'policy'}",
        f"data.path={tmp_path / 'prompts.jsonl'}",
        "data.chat_template=never",
        f"eval.path={tmp_path / 'held_out.jsonl'}",
        f"run.output_dir={tmp_path / 'run'}",
        "run.progress=false",
        "run.report_to=[jsonl]",
        "sampling.max_new_tokens=4",
        "num_generations=2",
        "run.batch_size=4",
        "run.max_steps=2",
        "kl_coef=0",
        "log_completions=0",
        f"rewards=[{{function: '{tmp_path / 'rewards_file.py'}:length_ids', isolation: inline}}]",
    ]
    return load_config(GRPOConfig, None, base + list(overrides))


def test_a_reward_function_taking_completion_ids_works_in_evaluation(tiny_dir, tmp_path):
    """Item 2: a reward function with the documented ``completion_ids`` parameter, which training calls
    fine, crashed the first evaluation (TypeError: missing 'completion_ids')."""
    from posttrain.trainers.grpo import train

    fn = f"{tmp_path / 'rewards_file.py'}:length_ids"
    train(_grpo_config(tiny_dir, tmp_path, f"eval.rewards=[{{function: '{fn}', isolation: inline}}]"))
    records = [r for r in read_metrics(tmp_path / "run") if "eval/greedy/score" in r]
    assert [r["step"] for r in records] == [0, 2]
    # the score is the number of completion tokens, EOS included: the mean length evaluation reports
    assert all(r["eval/greedy/score"] == pytest.approx(r["eval/greedy/length"]) for r in records)


def test_a_failing_evaluation_is_reported_and_loses_nothing(tiny_dir, tmp_path, capsys):
    """Item 2: an evaluation reward that raises at the last step used to end the run without final/;
    now each failed evaluation is one warning line (traceback in eval_errors.log), eval/failed in the
    step's record, and training goes on to save final/."""
    from posttrain.trainers.grpo import train

    fn = f"{tmp_path / 'rewards_file.py'}:broken"
    train(_grpo_config(tiny_dir, tmp_path, f"eval.rewards=[{{function: '{fn}', isolation: inline}}]"))
    run = tmp_path / "run"
    assert (run / "final" / "policy" / "model.safetensors").is_file()
    records = read_metrics(run)
    assert [r["step"] for r in records if r.get("eval/failed") == 1] == [0, 2]
    assert [r["step"] for r in records if "reward/mean" in r] == [1, 2]
    warnings = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[eval] warning")]
    assert len(warnings) == 2 and "held-out evaluation at step 2 failed" in warnings[1]
    assert "reward function 'broken' raised" in warnings[1]
    assert "ValueError: broken evaluation reward" in (run / "eval_errors.log").read_text()


def test_held_out_score_falling_from_the_start_raises_alert_7(tiny_dir, tmp_path):
    """Item 15: the starting model is evaluated at step 0, before any update; a held-out score that falls
    from there while the training reward rises raises alert 7 (its best was step 0), and the report
    shows step 0. Without the step-0 evaluation the run's held-out score looked flat (0.5, 0.5)."""
    from posttrain.monitor.report import load_run, write_report
    from posttrain.trainers.grpo import train

    counter = tmp_path / "steps.txt"
    functions = {name: f"{tmp_path / 'rewards_file.py'}:{name}" for name in ("rising", "falling")}
    config = _grpo_config(
        tiny_dir,
        tmp_path,
        f"rewards=[{{function: '{functions['rising']}', isolation: inline, kwargs: {{counter: '{counter}'}}}}]",
        f"eval.rewards=[{{function: '{functions['falling']}', isolation: inline, kwargs: {{counter: '{counter}'}}}}]",
        "eval.correct_threshold=0.75",
        "run.max_steps=4",
        "run.eval_every=2",
        "alerts.window=4",
    )
    train(config)
    run = tmp_path / "run"
    records = read_metrics(run)
    assert records[0]["step"] == 0 and "reward/mean" not in records[0]  # evaluated before any update
    scores = [(r["step"], r["eval/greedy/score"]) for r in records if "eval/greedy/score" in r]
    assert scores == [(0, 1.0), (2, 0.5), (4, 0.5)]
    alerts = [(a["id"], a["step"]) for a in read_alerts(run)]
    assert (7, 2) in alerts, alerts
    (alert,) = [a for a in read_alerts(run) if a["id"] == 7]
    assert "from 1 (step 0)" in alert["seen"]
    assert load_run(run, "run").records[0]["step"] == 0
    assert "eval/greedy/accuracy at step 0</b> 1" in write_report([run], tmp_path / "report.html").read_text()


def test_step_0_evaluation_can_be_turned_off(tiny_dir, tmp_path):
    from posttrain.trainers.grpo import train

    train(_grpo_config(tiny_dir, tmp_path, "eval.at_start=false"))
    assert [r["step"] for r in read_metrics(tmp_path / "run") if "eval/greedy/score" in r] == [2]
