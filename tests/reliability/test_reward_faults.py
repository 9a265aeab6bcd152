"""Reward functions that misbehave (issue 10 items 2, 13, 14, 15): non-finite or overflowing values,
values that are not numbers, calls that hang, and rewards that never apply."""

import json
import math
import warnings

import numpy as np
import pytest
import torch

from posttrain.rewards import RewardComposer, RewardError, RewardSpec


def _composer(*functions, **kwargs):
    return RewardComposer([(name, fn, weight) for name, fn, weight in functions], **kwargs)


def _constant(value):
    return lambda prompts, completions, **columns: [value] * len(completions)


@pytest.mark.parametrize("value", [math.inf, -math.inf, 1e39])
def test_infinite_or_float32_overflowing_rewards_are_rejected_naming_the_sample(value):
    """Item 2: ±inf (and a finite value no float32 can hold) used to pass and become NaN advantages."""
    with pytest.raises(RewardError) as err:
        _composer(("boom", _constant(value), 1.0))(["the prompt"], ["the completion"], {})
    message = str(err.value)
    assert "'boom'" in message or "boom" in message
    assert "'the prompt'" in message and "'the completion'" in message
    assert f"{value:g}" in message or str(value) in message


def test_a_large_total_is_summed_in_float64_and_checked():
    """Item 2: each component is finite in float32, their weighted sum is not."""
    composer = _composer(("a", _constant(3e38), 1.0), ("b", _constant(3e38), 1.0))
    with pytest.raises(RewardError, match=r"beyond float32.*'a': 3e\+38, 'b': 3e\+38"):
        composer(["p"], ["c"], {})
    # float64 sums exactly: in float32, 2^24 + 1 rounds to 2^24 and the − 1 then ends at 2^24 − 1
    out = _composer(("a", _constant(2.0**24), 1.0), ("b", _constant(1.0), 1.0), ("c", _constant(-1.0), 1.0))(
        ["p"], ["c"], {}
    )
    assert out.total.tolist() == [2.0**24]


@pytest.mark.parametrize(
    "value, what",
    [("1.0", "str"), ({"score": 1.0}, "dict"), (1 + 2j, "complex"), ([1.0], "list"), (None, None)],
)
def test_values_that_are_not_real_numbers_are_rejected_naming_function_and_sample(value, what):
    """Item 15: a string (even "1.0"), a dict or a complex used to be used silently or fail bare."""
    values = [0.5, value]
    fn = lambda prompts, completions, **columns: values  # noqa: E731
    composer = _composer(("typed", fn, 1.0))
    if what is None:  # None stays "not applicable"
        assert composer(["p1", "p2"], ["c1", "c2"], {}).components["typed"] == [0.5, None]
        return
    with pytest.raises(RewardError) as err:
        composer(["p1", "p2"], ["c1", "c2"], {})
    message = str(err.value)
    assert "'typed'" in message and what in message and "'p2'" in message and "'c2'" in message


def test_bools_and_numpy_numbers_are_real_numbers():
    fn = lambda prompts, completions, **columns: [True, np.float32(0.25), np.int64(2)]  # noqa: E731
    assert _composer(("ok", fn, 1.0))(["p"] * 3, ["c"] * 3, {}).total.tolist() == [1.0, 0.25, 2.0]
    array = lambda prompts, completions, **columns: np.array([0.5, 1.5])  # noqa: E731
    assert _composer(("array", array, 1.0))(["p"] * 2, ["c"] * 2, {}).total.tolist() == [0.5, 1.5]


@pytest.mark.parametrize("returned", ["{0.5: 'a', 1.0: 'b'}", "'1.0'", "None", "iter([1.0, 1.0])"])
def test_a_return_value_that_is_not_a_list_is_rejected_naming_the_function(returned, tmp_path):
    """Item 15: a dict returned used to give its keys as rewards (list(dict))."""
    path = tmp_path / "odd.py"
    path.write_text(f"def odd(prompts, completions, **columns):\n    return {returned}\n")
    composer = RewardComposer.from_specs([RewardSpec(f"{path}:odd")])
    with pytest.raises(RewardError, match=r"reward function 'odd' returned .*must return a list of 2"):
        composer(["p"] * 2, ["c"] * 2, {})


HANGS = """
import os, time


def hangs(prompts, completions, log, **columns):
    with open(log[0], "a") as f:
        f.write(f"{len(completions)}\\n")
    time.sleep(3600)
"""


@pytest.mark.parametrize("retry", [False, True])
def test_a_hanging_batch_costs_one_deadline_and_is_counted(tmp_path, retry):
    """Item 13: a timed-out call was retried once per sample with the full timeout each ((B+1)·timeout
    per step) and counted no timeout. Now: one call, counted in batch_timeouts and timeouts; with
    retry_after_timeout the retries share one more deadline (each call still logged)."""
    (tmp_path / "hangs.py").write_text(HANGS)
    log = tmp_path / "calls.txt"
    spec = RewardSpec(f"{tmp_path / 'hangs.py'}:hangs", timeout=1.0, max_failure_rate=1.0, retry_after_timeout=retry)
    composer = RewardComposer.from_specs([spec])
    B = 6
    out = composer(["p"] * B, ["c"] * B, {"log": [str(log)] * B})
    calls = log.read_text().split()
    assert calls[0] == str(B)
    # without retry: the batch call only; with it: the retries stop when the shared second second is spent
    assert len(calls) == 1 if not retry else 1 < len(calls) < 1 + B
    assert out.components["hangs"] == [None] * B and torch.isnan(out.total).all()
    faults = out.metrics()
    assert faults["reward/hangs/batch_timeouts"] == 1 and faults["reward/hangs/timeouts"] == B


def test_a_hanging_reward_stops_the_run_through_max_failure_rate(tmp_path):
    (tmp_path / "hangs.py").write_text(HANGS)
    spec = RewardSpec(f"{tmp_path / 'hangs.py'}:hangs", timeout=0.5, max_failure_rate=0.1)
    with pytest.raises(RewardError, match=r"20 timeouts \(1 timed-out calls\)"):
        RewardComposer.from_specs([spec])(["p"] * 20, ["c"] * 20, {"log": [str(tmp_path / "log")] * 20})


def test_a_reward_that_never_applies_warns_then_stops():
    """Item 14 (composer): every value None used to train nothing silently."""
    never = lambda prompts, completions, **columns: [None] * len(completions)  # noqa: E731
    composer = _composer(("never", never, 1.0), max_unscored_steps=3)
    for _ in range(2):
        with pytest.warns(RuntimeWarning, match="no reward function .never. scored any of the 2 samples"):
            out = composer(["p"] * 2, ["c"] * 2, {})
        assert out.metrics()["reward/applicable_share"] == 0.0 and math.isnan(out.metrics()["reward/never/mean"])
    with pytest.raises(RewardError, match="in 3 steps in a row"):
        composer(["p"] * 2, ["c"] * 2, {})
    sometimes = iter([[None, None], [None, 1.0], [None, None], [None, None], [None, None]])
    composer = _composer(("sometimes", lambda p, c, **k: next(sometimes), 1.0), max_unscored_steps=3)
    with pytest.warns(RuntimeWarning):
        composer(["p"] * 2, ["c"] * 2, {})
    assert composer(["p"] * 2, ["c"] * 2, {}).metrics()["reward/applicable_share"] == 0.5  # resets the count
    with pytest.warns(RuntimeWarning):
        composer(["p"] * 2, ["c"] * 2, {})
        composer(["p"] * 2, ["c"] * 2, {})
    with pytest.raises(RewardError):
        composer(["p"] * 2, ["c"] * 2, {})
    unchecked = _composer(("never", never, 1.0), max_unscored_steps=None)  # PPO with a reward model
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(5):
            unchecked(["p"] * 2, ["c"] * 2, {})


SOMETIMES = """
def never(prompts, completions, **columns):
    return [None] * len(completions)

def where_answered(prompts, completions, answer, **columns):
    return [None if a is None else float(c == a) for c, a in zip(completions, answer, strict=True)]
"""


def _grpo_config(tiny_dir, tmp_path, reward: str, prompts: list[dict], *overrides):
    from posttrain.runtime.config import load_config
    from posttrain.trainers.grpo import GRPOConfig

    (tmp_path / "rewards.py").write_text(SOMETIMES)
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in prompts))
    base = [
        f"model.path={tiny_dir / 'policy'}",
        f"data.path={tmp_path / 'prompts.jsonl'}",
        "data.chat_template=never",
        f"run.output_dir={tmp_path / 'run'}",
        "run.progress=false",
        "run.report_to=[jsonl]",
        f"rewards=[{{function: '{tmp_path / 'rewards.py'}:{reward}'}}]",
        "sampling.max_new_tokens=3",
        "kl_coef=0",
    ]
    return load_config(GRPOConfig, None, base + list(overrides))


def test_grpo_with_a_never_applicable_reward_logs_nan_and_stops(tiny_dir, tmp_path, capsys):
    """Item 14 (trainer): reward/mean was logged as 0.0 and the run ended with exit 0. The warning is a
    console line (new-user finding 15: as a Python warning it went to stderr, into the progress bar)."""
    from posttrain.runtime.metrics import read_metrics
    from posttrain.trainers.grpo import train as train_grpo

    prompts = [{"prompt": f"{i}+1="} for i in range(8)]
    overrides = ("num_generations=2", "run.batch_size=4", "run.max_steps=5", "max_unscored_steps=2")
    config = _grpo_config(tiny_dir, tmp_path, "never", prompts, *overrides)
    with pytest.raises(RewardError, match="2 steps in a row"):
        train_grpo(config)
    warned = "[grpo] warning: no reward function (never) scored any of the 4 samples (every value None): nothing"
    assert warned in capsys.readouterr().out
    first = read_metrics(config.run.output_dir)[0]
    assert math.isnan(first["reward/mean"]) and first["reward/applicable_share"] == 0.0


def test_a_grpo_step_nothing_scored_trains_nothing_and_raises_no_false_alert(tiny_dir, tmp_path, capsys):
    """New-user finding 15: a step no reward function scored raised alert 4 (first-minibatch ratio [0, 0],
    "a bug") and alert 11 (non-finite reward), and logged the ratio, loss and entropy as 0.0. Nothing
    trains on such a step: no update, no policy metrics, reward/mean NaN with reward/applicable_share 0."""
    from safetensors.torch import load_file

    from posttrain.monitor.alerts import read_alerts
    from posttrain.runtime.metrics import read_metrics
    from posttrain.trainers.grpo import train as train_grpo

    prompts = [{"prompt": f"{i}+1="} for i in range(8)]
    overrides = ("num_generations=2", "run.batch_size=4", "run.max_steps=2", "max_unscored_steps=0")
    config = _grpo_config(tiny_dir, tmp_path, "never", prompts, *overrides, "optim.weight_decay=0.1")
    train_grpo(config)
    assert capsys.readouterr().out.count("[grpo] warning: no reward function (never) scored any") == 2
    assert read_alerts(config.run.output_dir) == []
    for record in read_metrics(config.run.output_dir):
        assert math.isnan(record["reward/mean"]) and record["reward/applicable_share"] == 0
        assert not [k for k in record if k.startswith("policy/") or k in ("entropy", "grad_norm")], record
    before = load_file(tiny_dir / "policy" / "model.safetensors")
    after = load_file(tmp_path / "run" / "final" / "policy" / "model.safetensors")
    assert all(torch.equal(before[k], after[k]) for k in before)  # no update (weight decay would move them)


def test_a_micro_batch_of_unscored_rows_leaves_the_first_minibatch_ratio_at_one(tiny_dir, tmp_path):
    """New-user finding 15, partial: a group no function scored, alone in its micro-batch (the default
    micro_batch_size = num_generations = 8 puts one group in each), set the step's ratio_min to 0 and
    raised alert 4 on a mixed data set where a reward applies to some prompts only."""
    from posttrain.monitor.alerts import read_alerts
    from posttrain.runtime.metrics import read_metrics
    from posttrain.trainers.grpo import train as train_grpo

    prompts = [{"prompt": "1+1=", "answer": "2"}, {"prompt": "hello"}]
    overrides = ("num_generations=4", "run.batch_size=8", "run.micro_batch_size=4", "run.max_steps=1")
    config = _grpo_config(tiny_dir, tmp_path, "where_answered", prompts, *overrides)
    train_grpo(config)
    (record,) = read_metrics(config.run.output_dir)
    assert record["reward/applicable_share"] == 0.5
    for key in ("policy/first_minibatch_ratio_min", "policy/first_minibatch_ratio_max", "policy/ratio_min"):
        assert abs(record[key] - 1) < 1e-5, (key, record[key])
    assert not [a for a in read_alerts(config.run.output_dir) if a["id"] in (4, 11)]


def test_on_error_skip_stops_early_when_failures_are_overwhelming(tmp_path):
    """Issue 34: ``max_failure_rate`` was judged only from 20 samples on, so a first step of 16 samples with
    14 failing went on. Before 20 samples the failures are measured against 20: more than 0.1 × 20 = 2 stop
    the run; 2 of 16 do not (a lone early failure is no verdict)."""
    (tmp_path / "flaky.py").write_text(
        "def flaky(prompts, completions, **columns):\n"
        "    if any(c == 'x' for c in completions):\n        raise ValueError('cannot parse')\n"
        "    return [1.0] * len(completions)\n"
    )
    spec = RewardSpec(f"{tmp_path / 'flaky.py'}:flaky", on_error="skip", max_failure_rate=0.1, isolation="inline")
    with pytest.raises(RewardError, match=r"14 failures and 0 timeouts .* in 16 samples, over max_failure_rate=0.1"):
        RewardComposer.from_specs([spec])(["p"] * 16, ["x"] * 14 + ["a"] * 2, {})
    out = RewardComposer.from_specs([spec])(["p"] * 16, ["x"] * 2 + ["a"] * 14, {})
    assert out.components["flaky"] == [None] * 2 + [1.0] * 14
