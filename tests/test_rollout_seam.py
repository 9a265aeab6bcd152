"""The rollout seam (issue 12): one engine protocol, the engine chosen in config, the old log-probs
decided once (``old_logprobs_of``), truncated importance sampling against the sampler's log-probs."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import assert_close

from posttrain.core import truncated_importance_weights
from posttrain.rollout import HFEngine, RolloutConfig, SamplingParams, build_engine


def test_token_importance_weights_by_hand():
    old = torch.tensor([[0.0, -1.0, -2.0]])
    sampler = torch.tensor([[-0.5, -1.0, -1.0]])
    mask = torch.ones(1, 3)
    assert_close(truncated_importance_weights(old, sampler, mask, "token", 2.0), [[math.exp(0.5), 1.0, math.exp(-1)]])
    assert_close(truncated_importance_weights(old, sampler, mask, "token", 1.5), [[1.5, 1.0, math.exp(-1)]])


def test_sequence_importance_weights_by_hand():
    old = torch.tensor([[0.0, -1.0, -2.0], [0.0, -1.0, float("nan")]])
    sampler = torch.tensor([[-0.5, -1.0, -1.0], [-0.5, -1.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    # row 0: Σ log-ratio = −0.5; row 1: 0.5 over its two valid tokens (NaN at padding ignored), weight 1 there
    expected = [[math.exp(-0.5)] * 3, [math.exp(0.5), math.exp(0.5), 1.0]]
    assert_close(truncated_importance_weights(old, sampler, mask, "sequence", 2.0), expected)
    assert_close(truncated_importance_weights(old, sampler, mask, "sequence", 1.2)[1, :2], [1.2, 1.2])


def test_sequence_weights_do_not_overflow_on_long_rows():
    old, sampler = torch.zeros(1, 4096), torch.full((1, 4096), -1.0)
    weights = truncated_importance_weights(old, sampler, torch.ones(1, 4096), "sequence", 3.0)
    assert torch.isfinite(weights).all() and float(weights.max()) == pytest.approx(3.0)


@pytest.mark.parametrize(
    "override, message",
    [
        ({"engine": "sglang"}, "rollout.engine must be one of"),
        ({"mode": "remote"}, "rollout.mode must be one of"),
        ({"mode": "server"}, "rollout.mode=server needs rollout.engine=vllm"),
        (
            {"importance_sampling": "token"},
            "rollout.importance_sampling applies to rollout.engine=vllm or rollout.async_steps >= 1 only",
        ),
        ({"engine": "vllm", "importance_sampling": "tokens"}, "rollout.importance_sampling must be one of"),
        ({"engine": "vllm", "importance_cap": 0.5}, "rollout.importance_cap must be >= 1"),
        ({"async_steps": -1}, "rollout.async_steps must be >= 0"),
        ({"async_steps": 1, "producer_threads": 0}, "rollout.producer_threads >= 1"),
        (
            {"async_steps": 1, "engine": "vllm"},
            "rollout.async_steps >= 1 with engine=vllm needs rollout.mode=server",
        ),
        ({"async_steps": 2, "max_staleness": 1}, r"rollout.max_staleness must be >= rollout.async_steps=2"),
        ({"async_steps": 1, "on_stale": "skip"}, "rollout.on_stale must be one of"),
        (
            {"async_steps": 1, "importance_sampling": "token_mask", "importance_floor": 1.5},
            "importance_floor must be in",
        ),
    ],
)
def test_rollout_config_rejects_bad_values_naming_the_field(override, message):
    with pytest.raises(ValueError, match=message):
        RolloutConfig(**override).validate("rollout")


def test_trainer_configs_validate_the_rollout_section():
    from posttrain.runtime.config import load_config
    from posttrain.trainers.grpo import GRPOConfig
    from posttrain.trainers.ppo import PPOConfig

    base = [
        "model.path=some/model",
        "data.path=prompts.jsonl",
        "rewards=[{function: posttrain.rewards.builtin:exact_answer}]",
    ]
    for cls, extra in ((GRPOConfig, []), (PPOConfig, ["critic=policy"])):
        config = load_config(cls, None, [*base, *extra, "rollout.engine=vllm", "rollout.mode=server"])
        assert (config.rollout.engine, config.rollout.mode) == ("vllm", "server")
        with pytest.raises(ValueError, match="rollout.engine must be one of"):
            load_config(cls, None, [*base, *extra, "rollout.engine=tgi"])


def test_hf_engine_gives_the_old_logprobs_itself(tiny_dir, tokenizer):
    from accelerate import Accelerator

    from posttrain.models import ModelConfig, load_policy
    from posttrain.runtime.online import old_logprobs_of

    policy = load_policy(ModelConfig(path=str(tiny_dir / "policy"), device="cpu"))
    engine = build_engine(RolloutConfig(), policy, tokenizer, str(tiny_dir / "policy"), seed=0)
    assert isinstance(engine, HFEngine) and engine.logprobs_exact
    engine.sync_weights(policy)  # a no-op that must not fail
    with engine.generating(policy):
        rollout = engine.generate([tokenizer("ab")["input_ids"]], SamplingParams(max_new_tokens=4), n=2)

    def forward(*_):
        raise AssertionError("an exact engine needs no recompute")

    old, weights, metrics = old_logprobs_of(Accelerator(cpu=True), engine, rollout, forward, 8, RolloutConfig())
    assert old is rollout.logprobs and weights is None and metrics == {}


class _ShiftedEngine(HFEngine):
    """An engine whose log-probs differ from the trainer's by a known amount (as an inference engine's do)."""

    logprobs_exact = False

    def generate(self, prompts, params, n=1):
        rollout = super().generate(prompts, params, n)
        rollout.logprobs = torch.where(rollout.response_mask.bool(), rollout.logprobs - 0.25, 0.0)
        return rollout


def test_inexact_engine_is_recomputed_compared_and_weighted(tiny_dir, tokenizer):
    from accelerate import Accelerator

    from posttrain.models import ModelConfig, load_policy
    from posttrain.runtime.online import old_logprobs_of, policy_logprobs

    policy = load_policy(ModelConfig(path=str(tiny_dir / "policy"), device="cpu"))
    engine = _ShiftedEngine(policy, tokenizer)
    rollout = engine.generate([tokenizer("ab")["input_ids"]], SamplingParams(max_new_tokens=5), n=3)
    config = RolloutConfig(engine="vllm", importance_sampling="token", importance_cap=1.2)

    def forward(r, rows):
        return policy_logprobs(policy, r, rows, "cpu")[0]

    old, weights, metrics = old_logprobs_of(Accelerator(cpu=True), engine, rollout, forward, 2, config)
    valid = rollout.response_mask.bool()
    assert_close(old[valid], rollout.logprobs[valid] + 0.25, atol=1e-4, rtol=0)
    assert metrics["rollout/logprob_diff_mean"] == pytest.approx(0.25, abs=1e-4)
    assert metrics["rollout/logprob_diff_max"] == pytest.approx(0.25, abs=1e-4)
    assert_close(weights[valid], torch.full_like(weights[valid], 1.2))  # exp(0.25) = 1.28, capped


def test_lora_weights_handed_to_vllm_are_the_merged_ones(tiny_dir):
    """Issue 9 item 2: the LoRA sync gathered tensors inside merge_adapter() and unmerged before vLLM
    loaded them (shared storage), so vLLM got the base weights. What is handed over is W + ΔW."""
    import copy

    from posttrain.models import ModelConfig, load_policy
    from posttrain.rollout.vllm_engine import policy_weights

    lora = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"], "lora_dropout": 0.0}
    policy = load_policy(ModelConfig(path=str(tiny_dir / "policy"), device="cpu", lora=lora))
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.2, generator=torch.Generator().manual_seed(0))
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    handed = dict(policy_weights(policy))
    merged = copy.deepcopy(policy).merge_and_unload().state_dict()
    base = load_policy(ModelConfig(path=str(tiny_dir / "policy"), device="cpu")).state_dict()
    assert handed.keys() == merged.keys() == base.keys()
    for key in merged:
        assert_close(handed[key], merged[key], atol=1e-6, rtol=0)
    changed = [k for k in merged if not torch.equal(merged[k], base[k])]
    assert changed and all("q_proj" in k or "v_proj" in k for k in changed)
    assert all(torch.equal(before[k], v) for k, v in policy.state_dict().items())  # never merged in place


def test_vllm_server_engine_fails_at_start_naming_the_server_when_none_is_there(tokenizer):
    """A server not running at start is one line (a ``UserError``) naming the address and the setting that
    points there: the rollout's, or the distillation teacher's."""
    import importlib.util
    import socket

    from posttrain.errors import UserError
    from posttrain.rollout import ScoringConfig, build_scorer
    from posttrain.rollout.vllm_server import VLLMServerEngine

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    with pytest.raises(
        UserError, match=rf"127.0.0.1:{port} did not answer /health .*posttrain vllm-serve.*rollout.server_url"
    ):
        VLLMServerEngine(url, tokenizer, timeout=5)
    teacher = ScoringConfig(engine="vllm", mode="server", server_url=url, server_timeout=5)
    with pytest.raises(
        UserError, match=r"did not answer /health .*\(teacher_scoring.server_url, teacher_scoring.server_timeout\)"
    ):
        build_scorer(teacher, "unused", tokenizer, seed=0)
    if importlib.util.find_spec("vllm") is None:  # a colocated vLLM teacher without vLLM: one line, its field named
        with pytest.raises(UserError, match="teacher_scoring.engine=vllm with mode=colocate needs vLLM"):
            build_scorer(ScoringConfig(engine="vllm"), "unused", tokenizer, seed=0)


def test_vllm_server_engine_times_out_on_a_server_that_never_answers(tokenizer):
    import socket

    from posttrain.errors import UserError
    from posttrain.rollout.vllm_server import VLLMServerEngine

    with socket.socket() as s:  # accepts connections (backlog) but never reads or answers
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
        with pytest.raises(UserError, match=r"did not answer /health within 0.5s"):
            VLLMServerEngine(url, tokenizer, timeout=0.5)
