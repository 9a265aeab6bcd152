"""Process rewards: the PRM loss, where step scores go, step-labelled rows, the PRM trainer, and a PRM in
PPO and GRPO; PRIME's implicit process reward."""

import json
import math
import shutil

import pytest
import torch
from conftest import write_jsonl

from posttrain.core import (
    aggregate_step_scores,
    implicit_prm_loss,
    implicit_process_rewards,
    prm_loss,
    process_token_rewards,
    step_end_mask,
)
from posttrain.data.steps import last_step_open, separator_ends, step_end_tokens

LN3 = math.log(3.0)  # σ(ln 3) = 3/4
LOGIT_02 = math.log(0.25)  # σ(ln 1/4) = 1/5

# --------------------------------------------------------------------------------------------------
# core: by hand
# --------------------------------------------------------------------------------------------------


def test_prm_loss_by_hand_and_blind_to_unlabelled_positions():
    # z = 0, y = 1: softplus(0) − 0 = ln 2;  z = ln 3, y = 0: softplus(ln 3) = ln(1 + 3) = ln 4
    logits = torch.tensor([[0.0, LN3, float("nan")]], requires_grad=True)
    labels = torch.tensor([[1.0, 0.0, float("nan")]])
    mask = torch.tensor([[1, 1, 0]])
    loss = prm_loss(logits, labels, mask)
    assert loss.tolist()[0][:2] == pytest.approx([math.log(2), math.log(4)], abs=1e-6)
    assert loss[0, 2].item() == 0.0
    loss.sum().backward()
    # d/dz (softplus(z) − y·z) = σ(z) − y: 1/2 − 1 and 3/4 − 0; nothing flows from the NaN position
    assert logits.grad.tolist()[0] == pytest.approx([-0.5, 0.75, 0.0], abs=1e-6)


def test_step_ends_are_separator_tokens_and_the_last_response_token():
    separator = torch.tensor([[0, 1, 0, 0, 1, 1], [0, 0, 1, 0, 0, 0], [1, 0, 0, 0, 0, 0]], dtype=torch.bool)
    mask = torch.tensor([[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 0, 0], [0, 0, 0, 0, 0, 0]])
    ends = step_end_mask(separator, mask)
    # row 0: separators at 1 and 4 (4 is also the last token; 5 is padding); row 1: separator 2, last token 3
    assert ends.int().tolist() == [[0, 1, 0, 0, 1, 0], [0, 0, 1, 1, 0, 0], [0, 0, 0, 0, 0, 0]]


def test_process_token_rewards_sit_at_step_ends_by_hand():
    logits = torch.tensor([[0.0, 9.0, LN3, float("nan")]])
    ends = torch.tensor([[1, 0, 1, 0]], dtype=torch.bool)
    # weight 2: 2·σ(0) = 1 at token 0, 2·σ(ln 3) = 1.5 at token 2, 0 elsewhere (the 9 and the NaN are not ends)
    assert process_token_rewards(logits, ends, 2.0).tolist() == [pytest.approx([1.0, 0.0, 1.5, 0.0])]


def test_step_scores_aggregate_by_min_sum_and_last_by_hand():
    # steps p = 1/5, 3/4, 1/2 (in order); a second row without a step
    logits = torch.tensor([[LOGIT_02, 5.0, LN3, 0.0, float("inf")], [1.0, 2.0, 3.0, 4.0, 5.0]])
    ends = torch.tensor([[1, 0, 1, 1, 0], [0, 0, 0, 0, 0]], dtype=torch.bool)
    assert aggregate_step_scores(logits, ends, "min").tolist() == pytest.approx([0.2, 0.0])
    assert aggregate_step_scores(logits, ends, "sum").tolist() == pytest.approx([0.2 + 0.75 + 0.5, 0.0])
    assert aggregate_step_scores(logits, ends, "last").tolist() == pytest.approx([0.5, 0.0])
    with pytest.raises(ValueError, match="aggregation must be one of"):
        aggregate_step_scores(logits, ends, "mean")


def test_implicit_process_reward_and_its_loss_by_hand():
    logprobs = torch.tensor([[-1.0, -2.0, float("nan")]])
    ref_logprobs = torch.tensor([[-1.5, -1.0, 0.0]])
    mask = torch.tensor([[1, 1, 0]])
    # β = 0.5: r = 0.5·(−1 + 1.5), 0.5·(−2 + 1) = 0.25, −0.5; R = −0.25
    rewards = implicit_process_rewards(logprobs, ref_logprobs, mask, beta=0.5)
    assert rewards.tolist() == [pytest.approx([0.25, -0.5, 0.0])]
    # y = 1: −log σ(−0.25) = log(1 + e^0.25) = 0.8259;  y = 0: −log(1 − σ(−0.25)) = log(1 + e^−0.25) = 0.5759
    loss = implicit_prm_loss(
        logprobs.expand(2, 3), ref_logprobs.expand(2, 3), mask.expand(2, 3), torch.tensor([1, 0]), 0.5
    )
    assert loss.tolist() == pytest.approx([math.log(1 + math.exp(0.25)), math.log(1 + math.exp(-0.25))], abs=1e-6)


def test_separator_found_whole_merged_or_split_over_tokens():
    assert separator_ends(["1+2=3", "\n", "3+4=7"], "\n") == [1]
    assert separator_ends(["3\n", "3+", "4=7\n"], "\n") == [0, 2]  # merged with neighbours
    assert separator_ends(["a", "\n", "\n", "b", "\n\n"], "\n\n") == [2, 4]  # split over two tokens, then whole
    # the last token ends the last step, once
    assert step_end_tokens(["1", "\n", "2", "<eos>"], "\n") == [1, 3]
    assert step_end_tokens(["1", "\n"], "\n") == [1]


def test_blank_lines_end_no_step_and_nor_does_an_eos_after_the_last_separator():
    # "a\n\n \nb\n": the blank lines between a and b are no steps (a policy would earn a step's reward for each)
    assert separator_ends(["a", "\n", "\n", " ", "\n", "b", "\n"], "\n") == [1, 6]
    assert separator_ends(["\n", "\n"], "\n") == []
    special = {"<eos>"}
    assert last_step_open(["a", "\n", "b", "<eos>"], "\n", special)
    assert not last_step_open(["a", "\n", "b", "\n", " ", "<eos>"], "\n", special)  # "a\nb\n<eos>": two steps
    assert not last_step_open(["<eos>"], "\n", special) and last_step_open(["a"], "\n", special)


def test_a_sentencepiece_token_keeps_its_leading_space():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from posttrain.data.steps import TokenText

    vocab = {"<unk>": 0, "</s>": 1, "▁a": 2, "▁b": 3, "▁ки": 4, "\n": 5}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    backend.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="</s>", unk_token="<unk>")
    # "a ки b ки</s>": decoded alone, "▁ки" is "ки" and Math-Shepherd's step tag " ки" is never found
    pieces = TokenText(tokenizer)([2, 4, 3, 4, 1])
    assert pieces == [" a", " ки", " b", " ки", "</s>"] and separator_ends(pieces, " ки") == [1, 3]


def test_a_truncated_or_blank_ended_response_has_no_step_end_at_its_last_token():
    separator = torch.tensor([[0, 1, 0, 0], [0, 1, 0, 0], [0, 1, 0, 0]], dtype=torch.bool)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 1, 0]])
    closed = torch.tensor([True, False, False])
    # row 0: separator 1 and its last token 3; rows 1 and 2 (cut, or blank after the separator): separator 1 only
    assert step_end_mask(separator, mask, closed).int().tolist() == [[0, 1, 0, 1], [0, 1, 0, 0], [0, 1, 0, 0]]


# --------------------------------------------------------------------------------------------------
# step-labelled rows
# --------------------------------------------------------------------------------------------------

STEP_ROW = {"prompt": "1+2+3=", "completions": ["1+2=3", "3+3=6"], "labels": [True, False]}


@pytest.mark.parametrize(
    ("change", "field", "says"),
    [
        ({"labels": [True]}, "labels", "one label per step"),
        ({"labels": [True, 1]}, "labels[1]", "true (a correct step) or false"),
        ({"completions": ["1+2=3\n", "3+3=6"]}, "completions[0]", "holds the step separator"),
        ({"completions": []}, "completions", "non-empty list of steps"),
        ({"completions": ["1+2=3", " "]}, "completions[1]", "non-empty text"),
    ],
)
def test_malformed_step_rows_name_the_field_in_one_line(tokenizer, tmp_path, change, field, says):
    from posttrain.data import DataConfig, DataError, load_stepwise

    path = write_jsonl(tmp_path / "steps.jsonl", [STEP_ROW, {**STEP_ROW, **change}])
    with pytest.raises(DataError) as err:
        load_stepwise(DataConfig(path=path, chat_template="never"), tokenizer)
    assert err.value.field == field and f"{path}:2" in str(err.value) and says in str(err.value)
    assert "\n" not in str(err.value).replace("'\\n'", "")


def test_step_rows_are_their_own_kind_and_refused_elsewhere(tokenizer, tmp_path):
    from posttrain.data import DataConfig, DataError, load_preferences
    from posttrain.data.rows import row_kind

    assert row_kind(STEP_ROW) == "stepwise"
    path = write_jsonl(tmp_path / "steps.jsonl", [STEP_ROW])
    with pytest.raises(DataError, match="step-labelled rows .* read by posttrain prm"):
        load_preferences(DataConfig(path=path, chat_template="never"), tokenizer)


def test_labels_sit_on_the_token_that_ends_each_step(tokenizer, tmp_path):
    from posttrain.data import DataConfig, load_stepwise

    path = write_jsonl(tmp_path / "steps.jsonl", [STEP_ROW])
    (example,), _ = load_stepwise(DataConfig(path=path, chat_template="never"), tokenizer)
    # one token per character: "1+2=3" "\n" "3+3=6" <eos>: step 1 ends at the "\n" (5), step 2 at <eos> (11)
    assert tokenizer.decode(example.completion_ids) == "1+2=3\n3+3=6<eos>"
    assert example.step_ends == [5, 11] and example.labels == [True, False]
    # cut inside the second step: only the first step and its label are kept
    (cut,), report = load_stepwise(DataConfig(path=path, chat_template="never", max_length=14), tokenizer)
    assert cut.step_ends == [5] and cut.labels == [True] and report.truncated == 1


# --------------------------------------------------------------------------------------------------
# the PRM trainer, and the PRM in GRPO and PPO
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trained_prm(tiny_dir, tmp_path_factory):
    """A PRM trained on sums whose wrong step is off by 10 (two digits where every right sum has one): a wrong
    step a tiny model can see in a few dozen steps, and every step after it labelled false as well."""
    from posttrain.data.synthetic import stepwise_sums
    from posttrain.runtime.config import load_config
    from posttrain.trainers import prm

    root = tmp_path_factory.mktemp("prm")
    rows = stepwise_sums(640, seed=0, terms=3, low=0, high=3, error_size=10)
    config = load_config(
        prm.PRMConfig,
        None,
        [
            f"model.path={tiny_dir / 'policy'}",
            f"data.path={write_jsonl(root / 'steps.jsonl', rows)}",
            "data.chat_template=never",
            "data.eval_fraction=0.2",
            f"run.output_dir={root / 'prm'}",
            "run.max_steps=40",
            "run.batch_size=32",
            "optim.lr=3e-3",
            "optim.scheduler=constant",
            "run.progress=false",
            "run.report_to=[jsonl]",
        ],
    )
    result = prm.train(config)
    prompts = [{"prompt": r["prompt"], "answer": r["answer"]} for r in stepwise_sums(16, seed=1, low=0, high=3)]
    return {"result": result, "path": str(root / "prm" / "final" / "process_reward"), "root": root, "prompts": prompts}


def test_prm_learns_which_steps_are_wrong_on_held_out_rows(trained_prm):
    from posttrain.runtime.metrics import read_metrics

    held_out = trained_prm["result"]["eval_metrics"]
    # a label's share: 5/8 of the steps are correct, so always saying "correct" scores 0.625
    assert held_out["eval/positive_share"] == pytest.approx(0.625, abs=0.1)
    assert held_out["eval/step_accuracy"] > 0.9
    assert held_out["eval/solution_accuracy"] > 0.85
    first = read_metrics(str(trained_prm["root"] / "prm"))[0]
    assert first["loss"] == pytest.approx(math.log(2), abs=0.15)  # a new head: σ(z) near 1/2 at every step
    config = json.loads((trained_prm["root"] / "prm" / "final" / "process_reward" / "config.json").read_text())
    assert config["process_reward"] == {"step_separator": "\n"}
    assert config["architectures"] == ["LlamaForTokenClassification"] and len(config["id2label"]) == 1


def _rl_args(tiny_dir, trained_prm, tmp_path, name):
    prompts = write_jsonl(tmp_path / "prompts.jsonl", trained_prm["prompts"])
    return [
        f"model.path={tiny_dir / 'policy'}",
        f"data.path={prompts}",
        "data.chat_template=never",
        "rewards=[{function: 'posttrain.rewards.math:math_answer'}]",
        f"process_reward_model.path={trained_prm['path']}",
        f"run.output_dir={tmp_path / name}",
        "run.max_steps=1",
        "run.batch_size=8",
        "sampling.max_new_tokens=8",
        "run.progress=false",
        "run.report_to=[jsonl]",
    ]


def test_grpo_and_ppo_run_with_a_prm_and_log_its_scores(tiny_dir, trained_prm, tmp_path):
    from posttrain.runtime.config import load_config
    from posttrain.runtime.metrics import read_metrics
    from posttrain.trainers import grpo, ppo

    args = _rl_args(tiny_dir, trained_prm, tmp_path, "grpo")
    grpo.train(load_config(grpo.GRPOConfig, None, [*args, "num_generations=4", "kl_coef=0"]))
    (record,) = read_metrics(str(tmp_path / "grpo"))
    # > 0, not >= 1: a response cut by max_new_tokens=8 before any separator has no finished step
    assert 0 < record["reward/process/mean"] < 1 and record["reward/process_steps/mean"] > 0
    # each response's reward: its outcome + weight 1 · the min of its step scores
    assert record["reward/mean"] == pytest.approx(record["reward/math_answer/mean"] + record["reward/process/mean"])
    args = _rl_args(tiny_dir, trained_prm, tmp_path, "ppo")
    ppo.train(load_config(ppo.PPOConfig, None, [*args, "critic=policy"]))
    (record,) = read_metrics(str(tmp_path / "ppo"))
    assert 0 < record["reward/process/mean"] < 1 and record["reward/process/steps"] > 0
    # a response's summed token rewards: its score + σ(z) at each of its steps (the KL is 0 at the first step)
    per_response = record["score/mean"] + record["reward/process/mean"] * record["reward/process/steps"]
    assert record["reward/mean"] == pytest.approx(per_response, abs=1e-3)


def test_process_reward_config_is_checked_at_start(tiny_dir, trained_prm, tokenizer, tmp_path):
    from posttrain.rewards.process import ProcessReward, ProcessRewardConfig
    from posttrain.runtime.config import load_config
    from posttrain.trainers import grpo, ppo

    args = _rl_args(tiny_dir, trained_prm, tmp_path, "bad")
    with pytest.raises(ValueError, match="process_reward_model.aggregation must be one of"):
        load_config(grpo.GRPOConfig, None, [*args, "process_reward_model.aggregation=mean"]).validate()
    with pytest.raises(ValueError, match="process_reward_model.weight must be > 0"):
        load_config(grpo.GRPOConfig, None, [*args, "process_reward_model.weight=0"]).validate()
    with pytest.raises(ValueError, match="process_reward_model.dtype must be one of"):
        load_config(grpo.GRPOConfig, None, [*args, "process_reward_model.dtype=int8"]).validate()
    half = ProcessReward(ProcessRewardConfig(path=trained_prm["path"], dtype="bfloat16"), tokenizer, "cpu")
    assert next(half.model.parameters()).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="aggregation is not used by PPO"):
        load_config(ppo.PPOConfig, None, [*args, "critic=policy", "process_reward_model.aggregation=sum"]).validate()
    with pytest.raises(ValueError, match="process_reward_model.path=.*no weights for score.bias"):
        ProcessReward(ProcessRewardConfig(path=str(tiny_dir / "reward")), None, "cpu")  # a sequence-level RM
    plain = tmp_path / "token_classifier"  # the PRM's weights without the step separator PPO and GRPO read
    shutil.copytree(trained_prm["path"], plain)
    config = json.loads((plain / "config.json").read_text())
    del config["process_reward"]
    (plain / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="not a process reward model"):
        ProcessReward(ProcessRewardConfig(path=str(plain)), None, "cpu")


def test_a_reward_model_as_the_process_reward_model_stops_grpo_in_one_line(tiny_dir, tmp_path, capsys):
    from helpers import one_line

    from posttrain.cli import main
    from posttrain.data.synthetic import stepwise_sums

    prompts = [{"prompt": r["prompt"], "answer": r["answer"]} for r in stepwise_sums(8, seed=1, low=0, high=3)]
    args = [f"model.path={tiny_dir / 'policy'}", f"data.path={write_jsonl(tmp_path / 'p.jsonl', prompts)}"]
    args += ["data.chat_template=never", "rewards=[{function: 'posttrain.rewards.math:math_answer'}]"]
    args += [f"run.output_dir={tmp_path / 'run'}", "run.max_steps=1", "run.batch_size=8", "num_generations=4"]
    with pytest.raises(SystemExit) as stop:  # a sequence-level reward model: no score.bias as a token classifier
        main(["grpo", *args, f"process_reward_model.path={tiny_dir / 'reward'}", "kl_coef=0"])
    one_line(stop.value.code, capsys.readouterr().err, "grpo", "no weights for score.bias")


def test_rollout_step_ends_are_the_training_rows_step_ends(tiny_dir, trained_prm, tokenizer, tmp_path):
    """A training row's response, laid out as a rollout (prompt left-padded, response right-padded, in a
    batch with a longer one): ProcessReward finds its steps at the tokens its labels sat on."""
    from posttrain.data import DataConfig, load_stepwise
    from posttrain.rewards.process import ProcessReward, ProcessRewardConfig
    from posttrain.rollout import Rollout

    rows = [STEP_ROW, {"prompt": "1+1=", "completions": ["1+1=2"], "labels": [True]}]
    examples, _ = load_stepwise(
        DataConfig(path=write_jsonl(tmp_path / "s.jsonl", rows), chat_template="never"), tokenizer
    )
    P, T = max(len(e.prompt_ids) for e in examples), max(len(e.completion_ids) for e in examples)
    prompt_ids, prompt_mask = torch.zeros(2, P, dtype=torch.long), torch.zeros(2, P, dtype=torch.long)
    response_ids, response_mask = torch.zeros(2, T, dtype=torch.long), torch.zeros(2, T, dtype=torch.long)
    for i, e in enumerate(examples):
        p, n = len(e.prompt_ids), len(e.completion_ids)
        prompt_ids[i, P - p :], prompt_mask[i, P - p :] = torch.tensor(e.prompt_ids), 1
        response_ids[i, :n], response_mask[i, :n] = torch.tensor(e.completion_ids), 1
    rollout = Rollout(
        prompt_ids, prompt_mask, response_ids, response_mask, None, torch.zeros(2, dtype=torch.bool),
        torch.arange(2), ["", ""], ["", ""],
    )  # fmt: skip
    process = ProcessReward(ProcessRewardConfig(path=trained_prm["path"]), tokenizer, "cpu")
    ends = process.step_ends(rollout)
    assert [row.nonzero().flatten().tolist() for row in ends] == [e.step_ends for e in examples]


def test_rollout_blank_lines_a_trailing_separator_and_a_cut_add_no_step(trained_prm, tokenizer):
    from posttrain.rewards.process import ProcessReward, ProcessRewardConfig
    from posttrain.rollout import Rollout

    texts, eos = ["1\n\n2", "1\n2\n", "1\n23"], tokenizer.eos_token_id
    rows = [tokenizer.encode(t, add_special_tokens=False) + [eos] for t in texts[:2]]
    rows.append(tokenizer.encode(texts[2], add_special_tokens=False))  # cut by max_new_tokens: no EOS
    assert [len(r) for r in rows] == [5, 5, 4]  # one token per character
    response_ids = torch.tensor([r + [eos] * (5 - len(r)) for r in rows])
    response_mask = torch.tensor([[1] * len(r) + [0] * (5 - len(r)) for r in rows])
    ones = torch.ones(3, 1, dtype=torch.long)
    rollout = Rollout(
        ones, ones, response_ids, response_mask, None, torch.tensor([False, False, True]), torch.arange(3),
        [""] * 3, [""] * 3,
    )  # fmt: skip
    ends = ProcessReward(ProcessRewardConfig(path=trained_prm["path"]), tokenizer, "cpu").step_ends(rollout)
    # "1\n\n2<eos>": the blank line ends nothing, the EOS the last step; "1\n2\n<eos>": two steps, none at the
    # EOS; "1\n23" cut: its unfinished last step has no end
    assert [row.nonzero().flatten().tolist() for row in ends] == [[1, 4], [1, 3], [1]]
