"""The lean decode loop: the rollouts of HFEngine (greedy, EOS, stop ids and strings, dropped rows), the
sampling distribution of transformers' warpers, and log-probs equal to the training forward's."""

import functools
from unittest.mock import patch

import pytest
import torch
from helpers import assert_close

from posttrain.models import ModelConfig, load_causal_lm, load_policy, response_logprobs
from posttrain.rollout import HFEngine, LeanEngine, SamplingParams
from posttrain.rollout.lean import _written_out, draw


@pytest.fixture(params=["policy", "qwen2"])
def model(tiny_dir, request):
    """A Llama with grouped-query attention (4 heads, 2 KV heads) and a Qwen2 (q/k/v biases)."""
    return load_causal_lm(ModelConfig(path=str(tiny_dir / request.param), device="cpu"))


def _prompts(tokenizer):
    # different lengths: the shorter prompt is left-padded, so the attention mask matters
    return [tokenizer("12+34=").input_ids, tokenizer("hello there, how are").input_ids]


def _same_rollout(a, b):
    assert torch.equal(a.response_ids, b.response_ids)
    assert torch.equal(a.response_mask, b.response_mask)
    assert torch.equal(a.truncated, b.truncated)
    assert torch.equal(a.prompt_ids, b.prompt_ids) and torch.equal(a.prompt_mask, b.prompt_mask)
    assert a.responses == b.responses and a.prompts == b.prompts
    assert torch.equal(a.prompt_index, b.prompt_index)
    assert_close(a.logprobs, b.logprobs, atol=1e-5, rtol=0)


def test_plain_llama_and_qwen2_take_the_written_out_step(model, policy_config, tiny_dir):
    assert _written_out(model)
    assert _written_out(load_policy(ModelConfig(path=str(tiny_dir / "qwen2"))))
    lora = load_policy(ModelConfig(path=policy_config.path, lora={"r": 2, "target_modules": ["q_proj"]}))
    assert not _written_out(lora)  # peft-wrapped: the model's own forward


def test_the_prefill_runs_in_eval_mode_and_the_mode_is_restored(model, tokenizer):
    """The written-out steps have no dropout; the prefill is the model's forward, in eval mode. A
    train-mode model without dropout is not switched (nothing would change); with dropout it is."""
    prompts, params = _prompts(tokenizer), SamplingParams(max_new_tokens=6, temperature=0)
    model.eval()
    expected = LeanEngine(model, tokenizer).generate(prompts, params, n=2)
    model.train()
    switched = []
    forward = type(model).forward

    @functools.wraps(forward)  # its signature: the KV cache keyword is read from it
    def recording(self, *args, **kwargs):  # on the class: a hook would itself rule the written-out step out
        switched.append(self.training)
        return forward(self, *args, **kwargs)

    with patch.object(type(model), "forward", recording):
        _same_rollout(LeanEngine(model, tokenizer).generate(prompts, params, n=2), expected)
        assert model.training and switched == [True]  # the prefill ran without a switch: no dropout anywhere
        attention = model.model.layers[0].self_attn
        attention.attention_dropout = 0.5  # dropout in train mode: the prefill must not sample it
        try:
            switched.clear()
            _same_rollout(LeanEngine(model, tokenizer).generate(prompts, params, n=2), expected)
            assert model.training and switched == [False]
        finally:
            attention.attention_dropout = 0.0


def test_greedy_rollouts_equal_hf_generate(model, tokenizer):
    prompts = _prompts(tokenizer)
    params = SamplingParams(max_new_tokens=10, temperature=0)
    reference = HFEngine(model, tokenizer).generate(prompts, params, n=2)
    _same_rollout(LeanEngine(model, tokenizer).generate(prompts, params, n=2), reference)
    # a stop id drawn by prompt 0 but not by prompt 1 ends some rows early: they leave the lean batch
    first, second = reference.response_ids[0].tolist(), set(reference.response_ids[2].tolist())
    stop = next(token for token in first[1:] if token not in second)
    params = SamplingParams(max_new_tokens=10, temperature=0, stop_token_ids=[stop])
    reference = HFEngine(model, tokenizer).generate(prompts, params, n=2)
    assert reference.truncated.tolist() == [False, False, True, True]
    _same_rollout(LeanEngine(model, tokenizer).generate(prompts, params, n=2), reference)
    # a stop string made of the first two characters of prompt 0's greedy answer
    text = reference.responses[0][:2] if len(reference.responses[0]) >= 2 else reference.responses[2][:2]
    for min_new_tokens in (0, 3):
        params = SamplingParams(max_new_tokens=8, temperature=0, stop_strings=[text], min_new_tokens=min_new_tokens)
        _same_rollout(
            LeanEngine(model, tokenizer).generate(prompts, params, n=1),
            HFEngine(model, tokenizer).generate(prompts, params, n=1),
        )


def test_every_row_stopping_early_shortens_the_rollout_as_generate_does(model, tokenizer):
    prompts = _prompts(tokenizer)
    greedy = HFEngine(model, tokenizer).generate(prompts, SamplingParams(max_new_tokens=6, temperature=0))
    stops = [greedy.response_ids[0, 2].item(), greedy.response_ids[1, 1].item()]
    params = SamplingParams(max_new_tokens=20, temperature=0, stop_token_ids=stops)
    reference = HFEngine(model, tokenizer).generate(prompts, params)
    lean = LeanEngine(model, tokenizer).generate(prompts, params)
    assert reference.response_length < 20 and not reference.truncated.any()
    _same_rollout(lean, reference)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_new_tokens=24, temperature=1.0),
        SamplingParams(max_new_tokens=24, temperature=0.7),
        SamplingParams(max_new_tokens=16, temperature=0.9, top_k=5, top_p=0.8, min_new_tokens=4),
        SamplingParams(max_new_tokens=12, temperature=0),
    ],
    ids=["t1", "t0.7", "topk-topp-min", "greedy"],
)
def test_logprobs_equal_the_training_forward(model, tokenizer, params):
    torch.manual_seed(0)
    mode = model.training
    rollout = LeanEngine(model, tokenizer).generate(_prompts(tokenizer), params, n=3)
    assert model.training is mode  # generate restores the mode it found
    with torch.no_grad():
        recomputed, _ = response_logprobs(
            model, rollout.input_ids, rollout.attention_mask, rollout.response_length, params.logprob_temperature
        )
    mask = rollout.response_mask.bool()
    assert (recomputed - rollout.logprobs)[mask].abs().max() < 1e-5
    assert (rollout.logprobs[~mask] == 0).all()


def test_lora_policy_falls_back_to_the_model_forward_and_stays_exact(policy_config, tokenizer):
    config = ModelConfig(path=policy_config.path, lora={"r": 2, "target_modules": ["q_proj"], "lora_dropout": 0.0})
    policy = load_policy(config)
    torch.manual_seed(0)
    rollout = LeanEngine(policy, tokenizer).generate(_prompts(tokenizer), SamplingParams(max_new_tokens=6), n=2)
    with torch.no_grad():
        lp, _ = response_logprobs(policy, rollout.input_ids, rollout.attention_mask, rollout.response_length)
    mask = rollout.response_mask.bool()
    assert_close(lp[mask], rollout.logprobs[mask], atol=1e-5, rtol=0)
    assert policy.training


def _warped_probs(logits, temperature, top_k, top_p, forbid=None):
    """The distribution transformers' own processors give: EOS forbidden, temperature, top-k, top-p."""
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    scores = logits.clone()
    if forbid is not None:
        scores[:, forbid] = -torch.inf
    scores = TemperatureLogitsWarper(temperature)(None, scores)
    if top_k:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1:
        scores = TopPLogitsWarper(top_p)(None, scores)
    return scores.softmax(-1)[0]


@pytest.mark.parametrize(
    "temperature,top_k,top_p,forbid",
    [(1.0, 0, 1.0, None), (0.7, 0, 1.0, None), (1.0, 5, 1.0, None), (0.8, 0, 0.6, None), (1.3, 8, 0.9, [3, 4])],
)
def test_draw_has_the_distribution_of_transformers_warpers(temperature, top_k, top_p, forbid):
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(1, 40, generator=generator) * 2
    expected = _warped_probs(logits, temperature, top_k, top_p, forbid)
    torch.manual_seed(1)
    n = 40_000
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    tokens, logprobs = draw(logits.expand(n, -1), params, None if forbid is None else torch.tensor(forbid))
    frequencies = torch.bincount(tokens, minlength=40).double() / n
    assert (frequencies[expected == 0] == 0).all()  # filtered and forbidden tokens are never drawn
    sigma = (expected * (1 - expected) / n).sqrt()
    assert ((frequencies - expected).abs() <= 5 * sigma + 1e-4).all()
    # recorded log-probs: the full distribution at τ, whatever was filtered or forbidden
    assert_close(logprobs, torch.log_softmax(logits / temperature, -1)[0, tokens], atol=1e-6, rtol=0)


def test_first_token_distribution_of_the_engine_is_the_models(model, tokenizer):
    prompt = tokenizer("12+34=").input_ids
    params = SamplingParams(max_new_tokens=1, temperature=0.8, top_k=10)
    torch.manual_seed(0)
    n = 20_000
    rollout = LeanEngine(model, tokenizer).generate([prompt], params, n=n)
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[:, -1]
    expected = _warped_probs(logits, 0.8, 10, 1.0)
    frequencies = torch.bincount(rollout.response_ids[:, 0], minlength=logits.shape[-1]).double() / n
    sigma = (expected * (1 - expected) / n).sqrt()
    assert ((frequencies - expected).abs() <= 5 * sigma + 1e-4).all()


@pytest.mark.parametrize("trainer", ["grpo", "ppo"])
def test_online_trainers_with_the_lean_engine_start_on_policy_and_time_every_phase(tiny_dir, tmp_path, trainer):
    import json

    from posttrain.runtime.config import load_config
    from posttrain.runtime.metrics import read_metrics

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"{a}+{a}=", "answer": str(2 * a)}) + "\n" for a in range(8)))
    common = [
        f"model.path={tiny_dir / 'policy'}",
        f"data.path={prompts}",
        "data.chat_template=never",
        f"run.output_dir={tmp_path / trainer}",
        "run.progress=false",
        "run.report_to=[jsonl]",
        "run.max_steps=2",
        "run.batch_size=8",
        "run.micro_batch_size=4",
        "rewards=[{function: 'posttrain.rewards.builtin:starts_with_answer'}]",
        "sampling.max_new_tokens=6",
        "sampling.temperature=0.7",
        "rollout.engine=lean",
    ]
    if trainer == "grpo":
        from posttrain.trainers.grpo import GRPOConfig as Config
        from posttrain.trainers.grpo import train

        overrides = ["num_generations=4", "num_iterations=2", "kl_coef=0.04"]
    else:
        from posttrain.trainers.ppo import PPOConfig as Config
        from posttrain.trainers.ppo import train

        overrides = ["critic=policy", "ppo_epochs=2"]
    config = load_config(Config, None, common + overrides)
    train(config)
    for record in read_metrics(config.run.output_dir):
        assert abs(record["policy/first_minibatch_ratio_max"] - 1) < 1e-5
        assert abs(record["policy/first_minibatch_ratio_min"] - 1) < 1e-5
        phases = ["generate", "old_logprobs", "reward", "reference", "train", "sync_weights"]
        phases += ["values"] if trainer == "ppo" else []
        parts = sum(record[f"time/{p}"] for p in phases)
        assert record["time/other"] >= 0 and abs(parts + record["time/other"] - record["time/step"]) < 1e-9


def test_kv_cache_passes_raise_no_deprecation_warning(policy_config, tokenizer):
    """New-user trial (fourth session): every lean run printed transformers' FutureWarning for
    `past_key_values` (renamed `cache` in 5.24, removal announced for 5.40): the model's-own-forward
    decoder (here a LoRA policy) and the prompt cache now pass the keyword the model takes."""
    import warnings

    from posttrain.models import prompt_cached_logprobs

    lora = load_policy(ModelConfig(path=policy_config.path, lora={"r": 2, "target_modules": ["q_proj"]}))
    prompts = _prompts(tokenizer)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        rollout = LeanEngine(lora, tokenizer).generate(prompts, SamplingParams(max_new_tokens=4), n=2)
        with torch.no_grad():
            prompt_cached_logprobs(
                lora, rollout.prompt_ids, rollout.prompt_mask, rollout.response_ids, rollout.prompt_index
            )


def _exact_logprobs(model, tokenizer) -> float:
    """max |sampler − training forward| over the response tokens of a sampled lean rollout."""
    torch.manual_seed(0)
    rollout = LeanEngine(model, tokenizer).generate(_prompts(tokenizer), SamplingParams(max_new_tokens=12), n=3)
    with torch.no_grad():
        lp, _ = response_logprobs(model, rollout.input_ids, rollout.attention_mask, rollout.response_length)
    mask = rollout.response_mask.bool()
    return float((lp - rollout.logprobs)[mask].abs().max())


def test_a_llama_with_mlp_biases_samples_its_own_distribution(tmp_path, tokenizer):
    """Issue 24 #3: the written-out step dropped the gate/up biases of ``mlp_bias=True`` (sampler and training
    log-probs 0.04 apart, a first-minibatch ratio of 1.095). Biases of random size make the gap visible."""
    from posttrain.models.tiny import build_tiny

    model = load_causal_lm(ModelConfig(path=str(build_tiny(tmp_path / "biased", mlp_bias=True)), device="cpu"))
    with torch.no_grad():
        for layer in model.model.layers:
            for proj in (layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj):
                proj.bias.normal_(0, 0.5)
    assert _written_out(model)  # the biases are covered, not a reason to fall back
    assert _exact_logprobs(model, tokenizer) < 1e-5


def test_a_hook_anywhere_on_the_model_falls_back_to_its_own_forward(model, tokenizer):
    """A forward hook on lm_head (or the model) changes the logits; the written-out step would skip it."""
    hook = model.lm_head.register_forward_hook(lambda m, args, out: out * 0.5)
    try:
        assert not _written_out(model)
        assert _exact_logprobs(model, tokenizer) < 1e-5
    finally:
        hook.remove()
    assert _written_out(model)


def test_engine_auto_picks_lean_where_the_written_out_step_covers_the_checkpoint(model, policy_config):
    from posttrain.rollout import RolloutConfig, build_engine, choose_engine

    config = RolloutConfig()
    assert config.engine == "auto"
    chosen, why = choose_engine(model)
    assert chosen == "lean" and "covers" in why
    assert type(build_engine(config, model, None, "", 0)) is LeanEngine
    lora = load_policy(ModelConfig(path=policy_config.path, lora={"r": 2, "target_modules": ["q_proj"]}))
    chosen, why = choose_engine(lora)
    assert chosen == "hf" and "PeftModel" in why
    assert type(build_engine(config, lora, None, "", 0)) is HFEngine
