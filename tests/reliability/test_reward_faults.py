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


def test_grpo_with_a_never_applicable_reward_logs_nan_and_stops(tiny_dir, tmp_path):
    """Item 14 (trainer): reward/mean was logged as 0.0 and the run ended with exit 0."""
    from posttrain.trainers.config import load_config
    from posttrain.trainers.grpo import GRPOConfig
    from posttrain.trainers.grpo import train as train_grpo
    from posttrain.trainers.metrics import read_metrics

    never = "def never(prompts, completions, **columns):\n    return [None] * len(completions)\n"
    (tmp_path / "never.py").write_text(never)
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"prompt": f"{i}+1="}) + "\n" for i in range(8)))
    config = load_config(
        GRPOConfig,
        None,
        [
            f"model.path={tiny_dir / 'policy'}",
            f"data.path={tmp_path / 'prompts.jsonl'}",
            "data.chat_template=never",
            f"run.output_dir={tmp_path / 'run'}",
            "run.progress=false",
            "run.report_to=[jsonl]",
            f"rewards=[{{function: '{tmp_path / 'never.py'}:never'}}]",
            "sampling.max_new_tokens=3",
            "num_generations=2",
            "run.batch_size=4",
            "run.max_steps=5",
            "kl_coef=0",
            "max_unscored_steps=2",
        ],
    )
    with pytest.warns(RuntimeWarning, match="scored any"), pytest.raises(RewardError, match="2 steps in a row"):
        train_grpo(config)
    first = read_metrics(config.run.output_dir)[0]
    assert math.isnan(first["reward/mean"]) and first["reward/applicable_share"] == 0.0
