"""Judge rewards (posttrain.rewards.judge) on tiny models with the character tokenizer: verdicts parsed or
counted as failures (None, never 0), P(yes) equal to a hand computation from the logits, batches
equal to one-by-one, and the judge usable from GRPO, PPO and online DPO."""

import math

import numpy as np
import pytest
import torch
from helpers import assert_close

from posttrain.core import yes_probability
from posttrain.models import ModelConfig, load_causal_lm, load_tokenizer
from posttrain.rewards import RewardComposer, RewardSpec
from posttrain.rewards.judge import judge_score, judge_yes_probability, load_judge, parse_verdict, render
from posttrain.rollout import SamplingParams
from posttrain.runtime.config import load_config
from posttrain.runtime.metrics import read_metrics

SUMS = ["3+4=", "1+2=", "9+9=", "0+7=", "5+5=", "8+1=", "2+6=", "4+4="]


def test_parse_verdict_by_hand():
    assert parse_verdict("Score: 7/10") == 7.0
    assert parse_verdict("-2.5 points, then 3") == -2.5  # the first number
    assert parse_verdict("I cannot grade this") is None
    assert parse_verdict("grade=B", r"grade=(\w)", labels={"A": 1.0, "B": 0.5}) == 0.5
    assert parse_verdict("grade=F", r"grade=(\w)", labels={"A": 1.0, "B": 0.5}) is None  # not a label
    assert parse_verdict("verdict: yes", r"verdict: (\w+)") is None  # matched, but not a number
    assert parse_verdict("1e999", r"(\S+)") is None  # a float, but not a finite one
    assert parse_verdict("nan", r"(\w+)") is None


def test_render_fills_prompt_completion_and_columns():
    texts = render("Q: {prompt} A: {completion} ref {answer} {{x}}", ["1+1="], ["2"], {"answer": ["2"]})
    assert texts == ["Q: 1+1= A: 2 ref 2 {x}"]
    with pytest.raises(ValueError, match=r"names \{reference\}.*columns: answer"):
        render("{prompt} {reference}", ["p"], ["c"], {"answer": ["a"]})


def test_yes_probability_by_hand():
    logits = torch.tensor([[0.0, 2.0, -1.0, 0.5, 3.0], [1.0, -1.0, 0.0, 2.0, -2.0]])
    # one "yes" id (1), two "no" ids (0, 3): P(yes)/(P(yes)+P(no)) in float64 numpy, softmax written out
    p = np.exp(logits.double().numpy())
    p /= p.sum(1, keepdims=True)
    expected = p[:, 1] / (p[:, 1] + p[:, 0] + p[:, 3])
    actual = yes_probability(logits, [1], [0, 3])
    assert_close(actual, torch.tensor(expected, dtype=torch.float32))
    assert ((actual >= 0) & (actual <= 1)).all()
    assert_close(yes_probability(torch.tensor([[5.0, 5.0]]), [0], [1]), [0.5])  # equal logits: 1/2
    with pytest.raises(ValueError, match="disjoint"):
        yes_probability(logits, [1], [1, 2])


def test_yes_probability_equals_the_hand_computation_from_the_models_logits(tiny_dir):
    path = str(tiny_dir / "policy")
    template = "Is {completion} the sum of {prompt}? "
    completions = ["7", "12", "abc", "3"]
    prompts = SUMS[: len(completions)]
    values = judge_yes_probability(prompts, completions, path, template, yes=["y"], no=["n"], chat_template="never")
    tokenizer = load_tokenizer(path)
    model = load_causal_lm(ModelConfig(path=path, device="cpu"))
    y, n = tokenizer.convert_tokens_to_ids(["y", "n"])
    for value, prompt, completion in zip(values, prompts, completions, strict=True):
        ids = tokenizer(template.format(prompt=prompt, completion=completion)).input_ids  # <bos> + one id per char
        with torch.no_grad():
            last = model(torch.tensor([ids])).logits[0, -1].double()
        p = torch.softmax(last, -1)
        assert 0 <= value <= 1
        assert value == pytest.approx(float(p[y] / (p[y] + p[n])), rel=1e-5)
    with pytest.raises(ValueError, match=r"yes must each be one token .*, got 'yes': 3 tokens"):
        judge_yes_probability(prompts, completions, path, template, yes=["yes"], no=["n"])


@pytest.mark.parametrize("engine", ["hf", "lean"])
def test_batched_verdicts_equal_one_by_one(noisy_sft, engine):
    """A judge reading sums (the noisy SFT model, which answers them): the same verdicts, parsed
    values and yes-probabilities whether the prompts go in one batch or one at a time."""
    path, template = noisy_sft["policy"], "{prompt}"
    prompts, completions = [*SUMS, "12+5=", "7+13="], [""] * 10  # two longer prompts: left padding in a batch
    judge = load_judge(path, "cpu", "never")
    params = SamplingParams(max_new_tokens=4, temperature=0.0)
    texts = render(template, prompts, completions, {})
    assert judge.verdicts(texts, params, 10, engine) == judge.verdicts(texts, params, 1, engine)
    kwargs = dict(path=path, template=template, chat_template="never", engine=engine, max_new_tokens=4)
    batched = judge_score(prompts, completions, batch_size=10, **kwargs)
    assert batched == judge_score(prompts, completions, batch_size=1, **kwargs)
    assert all(isinstance(v, float) for v in batched)  # the SFT model answers sums with a number
    kwargs = dict(path=path, template=template + "{completion}", yes=["1"], no=["2"], chat_template="never")
    one_by_one = judge_yes_probability(prompts, completions, batch_size=1, **kwargs)
    assert_close(torch.tensor(judge_yes_probability(prompts, completions, batch_size=10, **kwargs)), one_by_one)


def test_unparsed_verdicts_are_none_and_counted(noisy_sft):
    """A pattern no verdict matches: every value None (NaN in the total, not 0) and every verdict
    counted in reward/judge_score/parse_failures, cumulative over calls; a pattern that parses counts 0."""
    kwargs = {"path": noisy_sft["policy"], "template": "{prompt}", "chat_template": "never", "max_new_tokens": 4}
    never = RewardSpec("posttrain.rewards.judge:judge_score", kwargs={**kwargs, "pattern": "NEVER"})
    composer = RewardComposer.from_specs([never], max_unscored_steps=None)
    out = composer(SUMS, [""] * len(SUMS), {})
    assert out.components["judge_score"] == [None] * len(SUMS)
    assert torch.isnan(out.total).all()
    assert out.metrics()["reward/judge_score/parse_failures"] == len(SUMS)
    composer(SUMS[:3], [""] * 3, {})
    assert composer.fault_counts()["reward/judge_score/parse_failures"] == len(SUMS) + 3
    digits = {**kwargs, "pattern": r"(\d+)"}
    parsing = RewardComposer.from_specs([RewardSpec("posttrain.rewards.judge:judge_score", kwargs=digits)])
    out = parsing(SUMS, [""] * len(SUMS), {})
    assert not torch.isnan(out.total).any()
    assert parsing.fault_counts()["reward/judge_score/parse_failures"] == 0


def test_parse_failures_are_counted_per_composer(tiny_dir):
    """Two composers of the same spec (a run's training and evaluation rewards), and two specs that
    differ only in a sampling setting, each count their own verdicts: one's calls leave the others'
    counts as they were."""
    kwargs = {"path": str(tiny_dir / "policy"), "template": "{prompt}", "pattern": "NEVER", "max_new_tokens": 2}
    spec = RewardSpec("posttrain.rewards.judge:judge_score", kwargs=kwargs)
    train, evaluation = (RewardComposer.from_specs([spec], max_unscored_steps=None) for _ in range(2))
    longer = RewardSpec("posttrain.rewards.judge:judge_score", kwargs={**kwargs, "max_new_tokens": 3})
    other = RewardComposer.from_specs([longer], max_unscored_steps=None)
    train(SUMS, [""] * 8, {})
    evaluation(SUMS[:5], [""] * 5, {})
    other(SUMS[:2], [""] * 2, {})
    train(SUMS[:3], [""] * 3, {})
    assert train.fault_counts()["reward/judge_score/parse_failures"] == 8 + 3
    assert evaluation.fault_counts()["reward/judge_score/parse_failures"] == 5
    assert other.fault_counts()["reward/judge_score/parse_failures"] == 2


JUDGE_SCORE, JUDGE_YES = "posttrain.rewards.judge:judge_score", "posttrain.rewards.judge:judge_yes_probability"


@pytest.mark.parametrize(
    ("function", "kwargs", "match"),
    [
        (JUDGE_SCORE, {"template": "{prompt}"}, r"kwargs\.path must be .*, got nothing"),
        (JUDGE_SCORE, {"path": "j"}, r"kwargs\.template must be .*, got nothing"),
        (JUDGE_SCORE, {"path": "j", "template": "{prompt} {"}, r"kwargs\.template must be a format string"),
        (JUDGE_SCORE, {"path": "j", "template": "{} {prompt}"}, r"kwargs\.template must name .*, got \{\}"),
        (JUDGE_SCORE, {"path": "j", "template": "t", "pattern": "(\\d+"}, r"kwargs\.pattern must be a regular"),
        (JUDGE_SCORE, {"path": "j", "template": "t", "labels": {"A": "high"}}, r"kwargs\.labels\.A must be a"),
        (JUDGE_SCORE, {"path": "j", "template": "t", "labels": ["A"]}, r"kwargs\.labels must be a mapping"),
        (JUDGE_SCORE, {"path": "j", "template": "t", "engine": "vlm"}, r"kwargs\.engine must be one of .*'vlm'"),
        (JUDGE_SCORE, {"path": "j", "template": "t", "max_new_tokens": 0}, r"kwargs\.max_new_tokens must be"),
        (JUDGE_SCORE, {"path": "j", "template": "t", "temperature": -1}, r"kwargs\.temperature must be"),
        (JUDGE_SCORE, {"path": "j", "template": "t", "batch_size": "8"}, r"kwargs\.batch_size must be an integer"),
        (JUDGE_SCORE, {"path": "j", "template": "t", "chat_template": "no"}, r"kwargs\.chat_template must be one"),
        (JUDGE_SCORE, {"path": "j", "template": "t", "max_tokens": 4}, r"kwargs\.max_tokens is not a keyword of"),
        (JUDGE_SCORE, {"path": "j", "template": "t", "yes": ["Y"]}, r"kwargs\.yes is not a keyword of judge_score"),
        (JUDGE_YES, {"path": "j", "template": "t", "pattern": "x"}, r"kwargs\.pattern is not a keyword of judge_yes"),
        (JUDGE_YES, {"path": "j", "template": "t", "yes": []}, r"kwargs\.yes must be a non-empty list"),
        (JUDGE_YES, {"path": "j", "template": "t", "no": "No"}, r"kwargs\.no must be a non-empty list"),
        (JUDGE_YES, {"path": "j", "template": "t", "yes": ["Y"], "no": ["Y"]}, r"kwargs\.no must not repeat"),
    ],
)
def test_bad_judge_kwargs_fail_at_config_validation(function, kwargs, match):
    """Each bad setting stops at ``RewardSpec.validate`` (before any model loads), naming the kwarg."""
    with pytest.raises(ValueError, match=r"^rewards\[1\]\." + match):
        RewardSpec(function, kwargs=kwargs).validate("rewards[1]")


def test_a_bad_judge_kwarg_stops_load_config(noisy_sft):
    rewards = f"rewards=[{{function: '{JUDGE_SCORE}', kwargs: {{path: x, template: '{{prompt}}', pattern: '('}}}}]"
    overrides = [f"model.path={noisy_sft['policy']}", f"data.path={noisy_sft['prompts']}", rewards]
    from posttrain.trainers import grpo

    with pytest.raises(ValueError, match=r"rewards\[0\]\.kwargs\.pattern must be a regular expression"):
        load_config(grpo.GRPOConfig, None, overrides)
    good = rewards.replace("pattern: '('", "pattern: '(\\d)'")
    assert load_config(grpo.GRPOConfig, None, [*overrides[:2], good]).rewards[0].kwargs["pattern"] == "(\\d)"


def test_yes_and_no_of_several_tokens_fail_at_validation_when_the_judge_is_there(tiny_dir, tmp_path):
    """The character tokenizer spells "yes" in 3 tokens: refused at validation when the judge's folder
    exists; a judge that does not exist yet (a run's output) is checked at its first use."""
    kwargs = {"path": str(tiny_dir / "policy"), "template": "{prompt}", "yes": ["y"], "no": ["n", "no"]}
    with pytest.raises(ValueError, match=r"^rewards\[0\]\.kwargs\.no must each be one token .*'no': 2 tokens"):
        RewardSpec(JUDGE_YES, kwargs=kwargs).validate("rewards[0]")
    RewardSpec(JUDGE_YES, kwargs={**kwargs, "no": ["n"]}).validate("rewards[0]")
    RewardSpec(JUDGE_YES, kwargs={**kwargs, "path": str(tmp_path / "later")}).validate("rewards[0]")


def test_template_placeholders_are_data_columns(tiny_dir):
    """A template's placeholders (but prompt and completion) are columns the rows must have, checked with
    the data's columns before any model loads, as a function's own parameters are."""
    from posttrain.data import DataError
    from posttrain.data.datasets import PromptExample, check_columns
    from posttrain.rewards import reward_columns

    kwargs = {"path": "j", "template": "{prompt} {completion} ref {reference} {{x}} {reference} {answer}"}
    specs = [RewardSpec(JUDGE_SCORE, kwargs=kwargs)]
    assert reward_columns(specs) == {"judge_score": ["reference", "answer"]}
    rows = [PromptExample([1], "1+1=", {"answer": "2"})]
    with pytest.raises(DataError, match="reference"):
        check_columns(rows, reward_columns(specs), "rows.jsonl")


def test_a_completion_column_in_the_rows_leaves_the_judges_reading_the_sampled_completion(tiny_dir):
    """``posttrain distill`` with λ < 1 needs a ``completion`` column in the prompt rows, and the composer hands
    every column to every function: ``{completion}`` in a template is still the sampled completion (the one
    being judged), with or without that column, never a TypeError for two values of it."""
    judge = {"path": str(tiny_dir / "policy"), "chat_template": "never"}
    specs = [
        RewardSpec(JUDGE_YES, kwargs={**judge, "template": "Is {completion} {prompt}? ", "yes": ["y"], "no": ["n"]}),
        RewardSpec(JUDGE_SCORE, kwargs={**judge, "template": "{prompt}{completion}", "max_new_tokens": 3}),
    ]
    prompts, completions = SUMS[:4], ["7", "12", "abc", "3"]
    reference = {"completion": ["18"] * 4, "answer": ["7", "3", "18", "7"]}
    with_column = RewardComposer.from_specs(specs, max_unscored_steps=None)(prompts, completions, reference)
    without = RewardComposer.from_specs(specs, max_unscored_steps=None)(prompts, completions, {})
    assert with_column.components == without.components
    template = specs[0].kwargs["template"]
    assert with_column.components["judge_yes_probability"] == judge_yes_probability(
        prompts, completions, judge["path"], template, yes=["y"], no=["n"], chat_template="never"
    )
    assert with_column.components["judge_yes_probability"] != judge_yes_probability(  # not the column's "18"
        prompts, reference["completion"], judge["path"], template, yes=["y"], no=["n"], chat_template="never"
    )


def test_judge_functions_run_inline_only():
    spec = RewardSpec("posttrain.rewards.judge:judge_score", kwargs={"path": "j", "template": "{prompt}"})
    assert spec.effective_isolation == "inline"
    with pytest.raises(ValueError, match="cannot run posttrain.rewards.judge:judge_score"):
        RewardSpec("posttrain.rewards.judge:judge_score", isolation="process").validate()


@pytest.mark.parametrize("trainer", ["grpo", "ppo", "online_dpo"])
def test_a_judge_rewards_grpo_ppo_and_online_dpo(noisy_sft, tmp_path, trainer):
    """One step of each online trainer scored by judges: the yes-probability's mean in [0, 1], and a
    verdict that never parses scores None (a NaN mean, not 0), each of the step's 16 counted once:
    not the verdicts of the held-out evaluation at step 0, which scores with the same specs."""
    from posttrain.trainers import grpo, online_dpo, ppo

    judge = {"path": noisy_sft["policy"], "chat_template": "never"}
    yes = {**judge, "template": "{prompt}{completion} ok? ", "yes": ["1"], "no": ["2"]}
    score = {**judge, "template": "{prompt}", "max_new_tokens": 3, "pattern": "NEVER"}
    rewards = (
        f"rewards=[{{function: 'posttrain.rewards.judge:judge_yes_probability', kwargs: {yes}}}, "
        f"{{function: 'posttrain.rewards.judge:judge_score', weight: 0.1, kwargs: {score}}}]"
    )
    module, config_class, extra = {
        "grpo": (grpo, grpo.GRPOConfig, ["kl_coef=0", "num_generations=4"]),
        "ppo": (ppo, ppo.PPOConfig, ["critic=policy", "ppo_epochs=1"]),
        "online_dpo": (online_dpo, online_dpo.OnlineDPOConfig, ["num_generations=4"]),
    }[trainer]
    config = load_config(
        config_class,
        None,
        [
            f"model.path={noisy_sft['policy']}",
            f"data.path={noisy_sft['prompts']}",
            "data.chat_template=never",
            f"run.output_dir={tmp_path / trainer}",
            "run.progress=false",
            "run.report_to=[jsonl]",
            "run.max_steps=1",
            "run.batch_size=16",
            "sampling.max_new_tokens=3",
            "data.eval_fraction=0.05",
            rewards,
            *extra,
        ],
    )
    module.train(config)
    start, record = read_metrics(config.run.output_dir)  # step 0: the evaluation of the starting policy
    assert (start["step"], record["step"]) == (0, 1)
    assert math.isnan(start["eval/greedy/reward/judge_score"])  # the evaluation's judge ran, and did not parse
    assert 0 <= record["reward/judge_yes_probability/mean"] <= 1
    assert record["reward/judge_score/parse_failures"] == 16
    assert math.isnan(record["reward/judge_score/mean"])
