"""Shared-prefix packing (core.packing, models.shared_prefix_*): the layout and mask by hand, and packed
forwards equal to each sequence alone on the tiny models."""

import math

import pytest
import torch
from helpers import assert_close

from posttrain.core import (
    forward_cost,
    gather_at_predictors,
    pack_groups,
    pack_shared_prefix,
    packed_group_shape,
    predictor_positions,
    response_index,
    response_last_positions,
    shared_prefix_attention_mask,
    shared_prefix_token_logprobs,
)
from posttrain.models import (
    ModelConfig,
    load_causal_lm,
    load_scalar_model,
    response_logprobs,
    sequence_scores,
    shared_prefix_logprobs,
    shared_prefix_scores,
    shared_prefix_unsupported,
)

PAD = 0
# Row 0: a 3-token prompt, then responses of 2 and 1 tokens. Row 1: a 2-token prompt and one response of 1.
PROMPTS = [[10, 11, 12], [40, 41]]
RESPONSES = [[[20, 21], [30]], [[50]]]


def test_layout_positions_and_segments_by_hand():
    batch = pack_shared_prefix(PROMPTS, RESPONSES, PAD)
    assert batch.input_ids.tolist() == [[10, 11, 12, 20, 21, 30], [40, 41, 50, PAD, PAD, PAD]]
    # every response continues from its prompt's length: 3, 4 then 3 again; row 1: 2; padding 0
    assert batch.position_ids.tolist() == [[0, 1, 2, 3, 4, 3], [0, 1, 2, 0, 0, 0]]
    assert batch.segment_ids.tolist() == [[0, 0, 0, 1, 1, 2], [0, 0, 1, -1, -1, -1]]
    assert batch.prompt_lengths.tolist() == [3, 2]
    assert batch.response_rows.tolist() == [0, 0, 1]
    assert batch.response_starts.tolist() == [3, 5, 2]
    assert batch.response_lengths.tolist() == [2, 1, 1]
    assert batch.first_logit_position == 1 and batch.longest_response == 2
    assert batch.num_tokens == 6 + 3  # against 5 + 4 + 3 = 12 in the padded layout's real tokens


def test_attention_mask_by_hand():
    allowed = shared_prefix_attention_mask(pack_shared_prefix(PROMPTS, RESPONSES, PAD).segment_ids)
    assert allowed.shape == (2, 1, 6, 6) and allowed.dtype == torch.bool
    # row 0: the prompt causally; response 1 (positions 3, 4) sees the prompt and itself; response 2
    # (position 5) sees the prompt and itself, never positions 3 and 4 of response 1
    assert allowed[0, 0].int().tolist() == [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0],
        [1, 1, 1, 1, 0, 0],
        [1, 1, 1, 1, 1, 0],
        [1, 1, 1, 0, 0, 1],
    ]
    # row 1: nobody attends to padding; a padding position attends to itself only (no empty softmax row)
    assert allowed[1, 0].int().tolist() == [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0],
        [0, 0, 0, 1, 0, 0],
        [0, 0, 0, 0, 1, 0],
        [0, 0, 0, 0, 0, 1],
    ]


def test_response_index_and_last_positions_by_hand():
    batch = pack_shared_prefix(PROMPTS, RESPONSES, PAD)
    rows, positions, mask = response_index(batch)
    assert rows.tolist() == [[0], [0], [1]]
    assert positions.tolist() == [[3, 4], [5, 5], [2, 3]]  # past a response's end: clamped, masked
    assert mask.tolist() == [[True, True], [True, False], [True, False]]
    rows, last = response_last_positions(batch)
    assert rows.tolist() == [0, 0, 1] and last.tolist() == [4, 5, 2]


def test_predictor_positions_and_gather_by_hand():
    batch = pack_shared_prefix(PROMPTS, RESPONSES, PAD)
    # token 0 of each response is predicted at its prompt's end (2, 2, 1), the others just before them
    assert predictor_positions(batch)[response_index(batch)[2]].tolist() == [2, 3, 2, 1]
    values = torch.arange(12.0).view(2, 6)  # values[r, i] = 6r + i
    gathered = gather_at_predictors(values, batch)
    assert gathered[response_index(batch)[2]].tolist() == [2.0, 3.0, 2.0, 7.0]
    # from the last 5 positions only (position 1 on): the same numbers
    assert torch.equal(gather_at_predictors(values[:, 1:], batch), gathered)


def test_pack_groups_by_hand():
    """Rows 0 and 2 answer the same left-padded prompt [10, 11]; row 1 another one."""
    prompt_ids = torch.tensor([[0, 10, 11], [40, 41, 42], [0, 10, 11]])
    prompt_mask = torch.tensor([[0, 1, 1], [1, 1, 1], [0, 1, 1]])
    response_ids = torch.tensor([[20, 21, 0], [50, 51, 52], [30, 0, 0]])
    response_mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0]])
    batch, response_of_row = pack_groups(prompt_ids, prompt_mask, response_ids, response_mask, torch.tensor([0, 1, 0]))
    assert batch.input_ids.tolist() == [[10, 11, 20, 21, 30, PAD], [40, 41, 42, 50, 51, 52]]
    assert batch.position_ids.tolist() == [[0, 1, 2, 3, 2, 0], [0, 1, 2, 3, 4, 5]]
    assert response_of_row.tolist() == [0, 2, 1]  # packed responses: (row 0, row 2) of prompt 0, then row 1
    empty = torch.tensor([[1, 1, 0], [1, 1, 1], [0, 0, 0]])
    assert pack_groups(prompt_ids, prompt_mask, response_ids, empty, torch.tensor([0, 1, 0])) is None


def test_packed_group_shape_by_hand_and_equal_to_pack_groups():
    """The (rows, length) the auto decision compares, from the masks alone: the batch of
    test_pack_groups_by_hand is 2 rows of max(2 + 2 + 1, 3 + 3) = 6; a row without a response token
    gives None, as pack_groups does. Then ragged random batches: always the shape pack_groups builds."""
    prompt_mask = torch.tensor([[0, 1, 1], [1, 1, 1], [0, 1, 1]])
    response_mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0]])
    assert packed_group_shape(prompt_mask, response_mask, torch.tensor([0, 1, 0])) == (2, 6)
    # every row its own prompt: max(2 + 2, 3 + 3, 2 + 1)
    assert packed_group_shape(prompt_mask, response_mask, torch.tensor([0, 1, 2])) == (3, 6)
    empty = torch.tensor([[1, 1, 0], [1, 1, 1], [0, 0, 0]])
    assert packed_group_shape(prompt_mask, empty, torch.tensor([0, 1, 0])) is None
    generator = torch.Generator().manual_seed(0)
    for _ in range(50):
        rows, width, length = 9, 5, 6
        prompt_of_row = torch.randint(0, 4, (rows,), generator=generator)
        prompt_lengths = torch.randint(1, width + 1, (4,), generator=generator)[prompt_of_row]
        prompt_mask = (torch.arange(width) >= width - prompt_lengths[:, None]).long()
        response_mask = (torch.arange(length) < torch.randint(1, length + 1, (rows, 1), generator=generator)).long()
        ids = torch.randint(3, 50, (rows, width), generator=generator)
        responses = torch.randint(3, 50, (rows, length), generator=generator)
        batch, _ = pack_groups(ids, prompt_mask, responses, response_mask, prompt_of_row)
        assert packed_group_shape(prompt_mask, response_mask, prompt_of_row) == tuple(batch.input_ids.shape)


def test_token_logprobs_read_the_right_positions():
    """Token 0 of every response is scored by the logits at its prompt's last position, the others by
    the position before them: response 2 of row 0 (token 30 at position 5) by position 2, not 4."""
    batch = pack_shared_prefix(PROMPTS, RESPONSES, PAD)
    logits = torch.randn(2, 6, 64, generator=torch.Generator().manual_seed(0))
    lp = lambda r, i, token: torch.log_softmax(logits[r, i] / 0.7, -1)[token]  # noqa: E731
    expected = [[lp(0, 2, 20), lp(0, 3, 21)], [lp(0, 2, 30), 0.0], [lp(1, 1, 50), 0.0]]
    logprobs, mask = shared_prefix_token_logprobs(logits, batch, temperature=0.7)
    assert_close(torch.where(mask, logprobs, 0.0), expected)
    # only the logits from the earliest prompt end (position 1) on: the same numbers
    kept, _ = shared_prefix_token_logprobs(logits[:, 1:], batch, temperature=0.7)
    assert_close(torch.where(mask, kept, 0.0), expected)
    with pytest.raises(ValueError, match="after a prompt's last position"):
        shared_prefix_token_logprobs(logits[:, 2:], batch)


def test_pack_rejects_empty_prompts_and_responses():
    with pytest.raises(ValueError, match="row 0"):
        pack_shared_prefix([[1, 2]], [[[3], []]], PAD)
    with pytest.raises(ValueError, match="row 0"):
        pack_shared_prefix([[]], [[[3]]], PAD)


def test_forward_cost_by_hand():
    # 2·N·rows·L + 4·w·rows·L²: N = 1000, w = 10, 2 rows of 5 → 2·1000·10 + 4·10·2·25 = 20000 + 2000
    assert forward_cost(2, 5, params=1000, attention_width=10) == 22000
    # a DPO pair of P = n = 33: padded 2 × 66 against packed 1 × 99, for the bench's tiny Llama
    params, width = 2 * 128 * 128 * 4 + 2 * 3 * 128 * 512 + 128 * 100, 2 * 128
    assert forward_cost(1, 99, params, width) < forward_cost(2, 66, params, width)
    # one 10-token prompt and 8 responses of 256 (GRPO): the dense packed row costs more
    assert forward_cost(1, 10 + 8 * 256, params, width) > forward_cost(8, 266, params, width)


# --------------------------------------------------------------------------------------------------
# Models: packed rows against each sequence alone
# --------------------------------------------------------------------------------------------------


def _random_rows(vocab: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    tokens = lambda n: torch.randint(4, vocab, (n,), generator=g).tolist()  # noqa: E731
    prompts = [tokens(7), tokens(4), tokens(9)]
    responses = [[tokens(5), tokens(3)], [tokens(6), tokens(2), tokens(4)], [tokens(1), tokens(8)]]
    return prompts, responses


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_logprobs_equal_each_sequence_alone(tiny_dir, attn):
    model = load_causal_lm(ModelConfig(path=str(tiny_dir / "policy"), device="cpu", attn_implementation=attn))
    assert shared_prefix_unsupported(model) is None
    prompts, responses = _random_rows(model.config.vocab_size)
    batch = pack_shared_prefix(prompts, responses, PAD)
    with torch.no_grad():
        logprobs, entropy, mask = shared_prefix_logprobs(model, batch, temperature=0.8, with_entropy=True)
        n = 0
        for prompt, rs in zip(prompts, responses, strict=True):
            for response in rs:
                ids = torch.tensor([prompt + response])
                alone, alone_entropy = response_logprobs(
                    model, ids, torch.ones_like(ids), len(response), temperature=0.8, with_entropy=True
                )
                assert_close(logprobs[n, : len(response)], alone[0])
                assert_close(entropy[n, : len(response)], alone_entropy[0])
                assert mask[n].sum() == len(response)
                n += 1


def test_a_boolean_mask_under_eager_attention_would_be_wrong(tiny_dir):
    """Why the mask is converted for eager: eager adds the mask to the scores (True adds 1)."""
    model = load_causal_lm(ModelConfig(path=str(tiny_dir / "policy"), device="cpu", attn_implementation="eager"))
    batch = pack_shared_prefix(*_random_rows(model.config.vocab_size), PAD)
    allowed = shared_prefix_attention_mask(batch.segment_ids)
    with torch.no_grad():
        right = model(input_ids=batch.input_ids, attention_mask=torch.where(allowed, 0.0, -math.inf)).logits
        wrong = model(input_ids=batch.input_ids, attention_mask=allowed).logits
    assert (right - wrong).abs().max() > 1e-2


def test_packed_reward_scores_equal_each_sequence_alone(tiny_dir):
    model = load_scalar_model(ModelConfig(path=str(tiny_dir / "reward"), device="cpu"), "reward")
    assert shared_prefix_unsupported(model) is None
    prompts, responses = _random_rows(model.config.vocab_size, seed=1)
    batch = pack_shared_prefix(prompts, responses, PAD)
    with torch.no_grad():
        packed = shared_prefix_scores(model, batch)
        alone = [
            sequence_scores(model, torch.tensor([p + r]), torch.ones(1, len(p + r), dtype=torch.long))
            for p, rs in zip(prompts, responses, strict=True)
            for r in rs
        ]
    assert_close(packed, torch.cat(alone))


def test_packed_gradients_equal_padded_gradients(tiny_dir):
    """d(Σ response log-probs)/dθ from one packed forward equals that of the padded forward."""
    from posttrain.data import collate
    from posttrain.models import sequence_logprobs

    model = load_causal_lm(ModelConfig(path=str(tiny_dir / "policy"), device="cpu"))
    prompts, responses = _random_rows(model.config.vocab_size, seed=2)
    weights = torch.linspace(-1.0, 2.0, 7)  # a different weight per response: not just the sum
    logprobs, _, mask = shared_prefix_logprobs(model, pack_shared_prefix(prompts, responses, PAD))
    (torch.where(mask, logprobs, 0.0).sum(1) * weights).sum().backward()
    packed = {k: p.grad.clone() for k, p in model.named_parameters()}
    model.zero_grad()
    padded = collate([(p, r) for p, rs in zip(prompts, responses, strict=True) for r in rs], PAD)
    per_token = sequence_logprobs(model, padded.input_ids, padded.attention_mask)
    (torch.where(padded.completion_mask.bool(), per_token, 0.0).sum(1) * weights).sum().backward()
    for k, p in model.named_parameters():
        assert_close(packed[k], p.grad, atol=1e-5, msg=k)


def test_support_is_refused_with_a_reason(tiny_dir):
    model = load_causal_lm(ModelConfig(path=str(tiny_dir / "policy"), device="cpu"))
    model.config._attn_implementation = "flash_attention_2"  # not loadable on CPU; the check reads the config
    assert "flash_attention_2" in shared_prefix_unsupported(model)
    qwen = load_causal_lm(ModelConfig(path=str(tiny_dir / "qwen2"), device="cpu"))
    assert shared_prefix_unsupported(qwen) is None
    qwen.config.sliding_window = 4  # a window shorter than the rows: the 4-D mask would drop it
    assert "sliding_window" in shared_prefix_unsupported(qwen)


def test_probe_catches_a_model_that_ignores_the_mask(tiny_dir, monkeypatch):
    """A model that drops the 4-D mask (as a custom attention kernel might) fails the probe."""
    import posttrain.models.roles as roles

    model = load_causal_lm(ModelConfig(path=str(tiny_dir / "policy"), device="cpu"))
    forward = model.model.forward
    monkeypatch.setattr(model.model, "forward", lambda attention_mask, **kw: forward(attention_mask=None, **kw))
    reason = roles.shared_prefix_unsupported(model)
    assert reason is not None and "probe" in reason


# --------------------------------------------------------------------------------------------------
# Trainers: DPO and reward-model losses and gradients, packed against padded; whole runs
# --------------------------------------------------------------------------------------------------


def _pairs(vocab: int, n: int = 6, seed: int = 3):
    from posttrain.data import PreferenceExample

    g = torch.Generator().manual_seed(seed)
    tokens = lambda lo, hi: torch.randint(4, vocab, (int(torch.randint(lo, hi, (1,), generator=g)),), generator=g)  # noqa: E731
    return [PreferenceExample(tokens(2, 9).tolist(), tokens(1, 7).tolist(), tokens(1, 7).tolist()) for _ in range(n)]


def _grads(model) -> dict[str, torch.Tensor]:
    grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    return grads


def _assert_grads_close(actual: dict, expected: dict) -> None:
    """Within 1e-6 of each gradient's largest entry. The models run in float64, but Llama's RMSNorm
    computes in float32 whatever the dtype, and a packed backward adds the gradients of all responses
    into the prompt's positions before that cast (the padded one after it): float32 rounding of the
    sum, ~1e-7 of the scale. A response that saw another's tokens would be off by ~1e-2."""
    assert actual.keys() == expected.keys()
    for k, grad in expected.items():
        scale = float(grad.abs().max())
        torch.testing.assert_close(actual[k], grad, rtol=0, atol=1e-6 * max(scale, 1e-3), msg=k)


ALWAYS = dict(enabled=True, always=True)


@pytest.mark.parametrize(
    "loss", [{}, {"loss_type": "ipo"}, {"loss_type": "ipo", "ipo_logps": "mean"}, {"loss_type": "hinge"}]
)
def test_dpo_packed_loss_and_gradients_equal_padded(tiny_dir, loss):
    import copy

    from posttrain.models import Reference
    from posttrain.runtime.prefix import SharedPrefix
    from posttrain.trainers.dpo import DPOConfig, DPOExample, DPOTask

    # float64: fp32 rounding, which IPO's squared loss amplifies, would hide small differences
    policy = load_causal_lm(ModelConfig(path=str(tiny_dir / "policy"), device="cpu")).double()
    reference = Reference(model=copy.deepcopy(policy))
    with torch.no_grad():  # the policy moved away from the reference: a loss that is not log 2
        for p in policy.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel()), dtype=p.dtype))
    config = DPOConfig(beta=0.3, **loss)
    examples = [DPOExample(p) for p in _pairs(policy.config.vocab_size)]
    results = {}
    for name, shared in (("padded", SharedPrefix(enabled=False)), ("packed", SharedPrefix(**ALWAYS))):
        task = DPOTask(reference, PAD, config, shared)
        batch = task.collate(examples)
        assert task.count(batch) == len(examples)
        loss_sum, sums = task.loss(policy, batch)
        loss_sum.backward()
        results[name] = (loss_sum.detach(), sums, _grads(policy), batch.num_tokens)
    (loss_a, sums_a, grads_a, tokens_a), (loss_b, sums_b, grads_b, tokens_b) = results["padded"], results["packed"]
    assert tokens_b < tokens_a  # the prompts once instead of twice
    assert_close(loss_b, loss_a)
    for k in sums_a:
        assert_close(sums_b[k], sums_a[k], dtype=torch.float64), k
    assert loss_a > 0.01
    _assert_grads_close(grads_b, grads_a)


def test_reward_model_packed_loss_and_gradients_equal_padded(tiny_dir):
    from posttrain.data import RankingExample
    from posttrain.models import RewardScorer
    from posttrain.runtime.prefix import SharedPrefix
    from posttrain.trainers.rm import RMTask

    model = load_scalar_model(ModelConfig(path=str(tiny_dir / "reward"), device="cpu"), "reward").double()
    prompts, responses = _random_rows(model.config.vocab_size, seed=4)  # rankings of K = 2, 3, 2
    examples = [RankingExample(p, rs) for p, rs in zip(prompts, responses, strict=True)]
    results = {}
    for name, shared in (("padded", SharedPrefix(enabled=False)), ("packed", SharedPrefix(**ALWAYS))):
        task = RMTask(PAD, margin=0.5, center_coef=0.1, shared=shared)
        loss_sum, sums = task.loss(RewardScorer(model), task.collate(examples))
        loss_sum.backward()
        results[name] = (loss_sum.detach(), sums, _grads(model))
    (loss_a, sums_a, grads_a), (loss_b, sums_b, grads_b) = results["padded"], results["packed"]
    assert_close(loss_b, loss_a)
    for k in sums_a:
        assert_close(sums_b[k], sums_a[k], dtype=torch.float64), k
    _assert_grads_close(grads_b, grads_a)


def _jsonl(path, rows):
    import json

    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _offline_config(cls, tiny_dir, tmp_path, name, role, rows, *overrides):
    from posttrain.runtime.config import load_config

    base = [
        f"model.path={tiny_dir / role}",
        f"data.path={_jsonl(tmp_path / f'{name}.jsonl', rows)}",
        f"run.output_dir={tmp_path / name}",
        "run.progress=false",
        "run.report_to=[jsonl]",
        "optim.lr=1e-3",
        "data.chat_template=never",
        "data.eval_fraction=0",
        "run.batch_size=8",
        "run.micro_batch_size=4",
        "run.max_steps=2",
    ]
    return load_config(cls, None, base + list(overrides))


def _preference_rows(n=16):
    from posttrain.data.synthetic import arithmetic_sft

    return [
        {"prompt": "q: " + r["prompt"], "chosen": r["answer"] + " ok", "rejected": r["answer"][::-1] + "x"}
        for r in arithmetic_sft(n, seed=5)
    ]


@pytest.mark.parametrize("trainer", ["dpo", "rm"])
def test_a_packed_run_equals_an_unpacked_run(tiny_dir, tmp_path, trainer, capsys):
    from safetensors.torch import load_file

    from posttrain.runtime.metrics import read_metrics
    from posttrain.trainers import dpo, rm

    cls, train, role = (dpo.DPOConfig, dpo.train, "policy") if trainer == "dpo" else (rm.RMConfig, rm.train, "reward")
    rows = _preference_rows()
    runs = {}
    for setting in ("true", "false"):
        config = _offline_config(
            cls, tiny_dir, tmp_path, f"{trainer}-{setting}", role, rows, f"shared_prefix={setting}"
        )
        assert config.shared_prefix is (setting == "true")
        train(config)
        runs[setting] = (
            read_metrics(config.run.output_dir),
            load_file(f"{config.run.output_dir}/final/{role}/model.safetensors"),
        )
    assert "shared-prefix packing on" in capsys.readouterr().out
    (metrics_a, weights_a), (metrics_b, weights_b) = runs["true"], runs["false"]
    for a, b in zip(metrics_a, metrics_b, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-5)
    # Adam's first updates are ±lr (1e-3) wherever the gradient is not ~0; where it is ~0, float rounding
    # of the two layouts decides: a few elements move by up to ~1e-5 (measured: DPO 3.6e-6 with 7 of
    # 321,152 above 1e-6, RM 1.3e-5 with 15 of 308,480). A response that saw another's tokens would
    # move many elements by ~lr.
    diff = torch.cat([(weights_a[k] - weights_b[k]).abs().flatten() for k in weights_a])
    assert diff.max() < 5e-5 and (diff > 1e-6).float().mean() < 1e-4, (diff.max(), (diff > 1e-6).sum())


def test_shared_prefix_setting_is_checked_and_honoured(tiny_dir, tmp_path, capsys):
    from posttrain.models.tiny import build_tiny
    from posttrain.runtime.config import load_config
    from posttrain.trainers import dpo, rm

    for cls in (dpo.DPOConfig, rm.RMConfig):
        with pytest.raises(ValueError, match="shared_prefix must be auto, true or false, got 'sometimes'"):
            load_config(cls, None, ["model.path=m", "data.path=d", "shared_prefix=sometimes"])
        assert load_config(cls, None, ["model.path=m", "data.path=d"]).shared_prefix == "auto"
    # a model with a short sliding window: auto says why and stays padded, true stops at start
    windowed = build_tiny(
        tmp_path / "windowed", arch="qwen2", use_sliding_window=True, sliding_window=4, max_window_layers=0
    )
    rows = _preference_rows(8)
    config = _offline_config(dpo.DPOConfig, tmp_path, tmp_path, "auto", "windowed", rows, "run.max_steps=1")
    dpo.train(config)
    assert "shared-prefix packing off (shared_prefix=auto): layers ['sliding_attention']" in capsys.readouterr().out
    config = _offline_config(dpo.DPOConfig, tmp_path, tmp_path, "true", "windowed", rows, "shared_prefix=true")
    with pytest.raises(ValueError, match="shared_prefix=true, but Qwen2ForCausalLM cannot run packed rows"):
        dpo.train(config)
    assert windowed.exists()


# --------------------------------------------------------------------------------------------------
# GRPO: the G samples of a prompt share it in the policy, reference and old-log-prob passes
# --------------------------------------------------------------------------------------------------


# packing never pays here (attention priced out), so auto takes the prompt-cache path
PROMPT_CACHE = dict(enabled=True, prompt_cache=True, params=1, attention_width=10**9)


@pytest.mark.parametrize("layout", ["packed", "prompt_cache"])
def test_grpo_passes_packed_equal_padded(tiny_dir, layout):
    """On a real rollout (2 prompts of different lengths × 4 samples, some ending early at EOS), the
    policy's log-probs, entropies and gradient and the reference's log-probs equal the padded passes':
    with the samples packed behind their prompt, and with each prompt run once and its samples
    continuing its KV cache (``prompt_cache``, GRPO's auto where packing does not pay)."""
    from posttrain.models import Reference, load_tokenizer
    from posttrain.rollout import HFEngine, SamplingParams
    from posttrain.runtime.online import policy_logprobs, reference_logprobs
    from posttrain.runtime.prefix import SharedPrefix, packed_rollout_rows, prompt_cache_applies

    model = load_causal_lm(ModelConfig(path=str(tiny_dir / "policy"), device="cpu"))
    tokenizer = load_tokenizer(str(tiny_dir / "policy"))
    torch.manual_seed(0)
    prompts = [tokenizer("12+34=").input_ids, tokenizer("5+6=").input_ids]
    rollout = HFEngine(model, tokenizer).generate(prompts, SamplingParams(max_new_tokens=12, temperature=1.3), n=4)
    assert len(set(rollout.response_lengths.tolist())) > 1  # ragged responses
    shared = SharedPrefix(**(ALWAYS if layout == "packed" else PROMPT_CACHE))
    reference = Reference(model=load_causal_lm(ModelConfig(path=str(tiny_dir / "policy"), device="cpu")))
    assert (packed_rollout_rows(rollout, slice(0, 8), shared) is None) == (layout == "prompt_cache")
    assert prompt_cache_applies(model, shared) == (layout == "prompt_cache")
    valid = rollout.response_mask.bool()
    results = {}
    for name, setting in (("padded", None), ("packed", shared)):
        logprobs, entropy = policy_logprobs(model, rollout, slice(0, 8), "cpu", with_entropy=True, shared=setting)
        torch.where(valid, logprobs * torch.linspace(-1, 1, 8)[:, None], 0.0).sum().backward()
        ref = reference_logprobs(reference, rollout, 3, "cpu", shared=setting)  # micro-batches cut a group
        results[name] = (logprobs.detach(), entropy, _grads(model), ref)
    (lp_a, h_a, g_a, ref_a), (lp_b, h_b, g_b, ref_b) = results["padded"], results["packed"]
    assert_close(torch.where(valid, lp_b, 0.0), torch.where(valid, lp_a, 0.0))
    assert_close(torch.where(valid, h_b, 0.0), torch.where(valid, h_a, 0.0))
    assert_close(torch.where(valid, ref_b, 0.0), torch.where(valid, ref_a, 0.0))
    assert_close(torch.where(valid, lp_b, 0.0), torch.where(valid, rollout.logprobs, 0.0))  # the sampler's
    for k in g_a:
        assert_close(g_b[k], g_a[k], atol=1e-5), k
    # float64 (rounding out of the way, see _assert_grads_close): the gradients agree to 1e-6 of scale
    model, grads = model.double(), {}
    for name, setting in (("padded", None), ("packed", shared)):
        logprobs, _ = policy_logprobs(model, rollout, slice(0, 8), "cpu", shared=setting)
        torch.where(valid, logprobs * torch.linspace(-1, 1, 8, dtype=torch.float64)[:, None], 0.0).sum().backward()
        grads[name] = _grads(model)
    _assert_grads_close(grads["packed"], grads["padded"])


def test_prompt_cache_stays_off_under_gradient_checkpointing(tiny_dir):
    """A checkpointed training forward turns the KV cache off, so the prompt-cache passes fall back to
    the padded layout there."""
    from posttrain.runtime.prefix import SharedPrefix, prompt_cache_applies

    config = ModelConfig(path=str(tiny_dir / "policy"), device="cpu")
    shared = SharedPrefix(**PROMPT_CACHE)
    assert prompt_cache_applies(load_causal_lm(config), shared)
    checkpointed = load_causal_lm(ModelConfig(path=config.path, device="cpu", gradient_checkpointing=True))
    assert not prompt_cache_applies(checkpointed, shared)
    assert not prompt_cache_applies(load_causal_lm(config), SharedPrefix(**ALWAYS))


def test_grpo_packed_run_equals_unpacked_run(tiny_dir, tmp_path, monkeypatch):
    """2 GRPO steps packed (true), padded (false) and with the prompt cache (auto where packing does
    not pay; here the cost rule is told it never does): the same samples and rewards, first-minibatch
    ratio 1, KL, loss and entropy within 1e-5, final weights within float rounding."""
    from safetensors.torch import load_file

    from posttrain.runtime import online
    from posttrain.runtime.prefix import SharedPrefix

    cached_passes = []
    real = online.prompt_cached_logprobs
    monkeypatch.setattr(online, "prompt_cached_logprobs", lambda *a, **k: cached_passes.append(1) or real(*a, **k))

    from posttrain.data.synthetic import arithmetic_sft
    from posttrain.runtime.config import load_config
    from posttrain.runtime.metrics import read_metrics
    from posttrain.trainers import grpo

    prompts = _jsonl(
        tmp_path / "prompts.jsonl", [{"prompt": r["prompt"], "answer": r["answer"]} for r in arithmetic_sft(32, seed=1)]
    )
    runs = {}
    for setting in ("true", "false", "auto"):
        config = load_config(
            grpo.GRPOConfig,
            None,
            [
                f"model.path={tiny_dir / 'policy'}",
                f"data.path={prompts}",
                "data.chat_template=never",
                f"run.output_dir={tmp_path / setting}",
                "run.progress=false",
                "run.report_to=[jsonl]",
                # a reward that differs within groups of a random model: the completion holds a digit
                "rewards=[{function: 'posttrain.rewards.format:regex_format', kwargs: {pattern: '.*[0-9].*'}}]",
                "sampling.max_new_tokens=6",
                "num_generations=4",
                "run.batch_size=16",
                "run.micro_batch_size=8",
                "run.max_steps=2",
                "kl_coef=0.05",
                "optim.lr=1e-3",
                f"shared_prefix={setting}",
            ],
        )
        before = len(cached_passes)
        if setting == "auto":
            monkeypatch.setattr(SharedPrefix, "pays", lambda self, *shapes: False)
        grpo.train(config)
        assert (len(cached_passes) > before) == (setting == "auto")  # 2 steps × (policy + reference)
        out = config.run.output_dir
        runs[setting] = (read_metrics(out), load_file(f"{out}/final/policy/model.safetensors"))
    for layout in ("true", "auto"):
        _assert_grpo_runs_agree(runs[layout], runs["false"])


def _assert_grpo_runs_agree(run_a, run_b) -> None:
    (metrics_a, weights_a), (metrics_b, weights_b) = run_a, run_b
    for a, b in zip(metrics_a, metrics_b, strict=True):
        assert a["reward/mean"] == b["reward/mean"]  # the same samples: generation is not packed
        assert (
            abs(a["policy/first_minibatch_ratio_max"] - 1) < 1e-5
            and abs(a["policy/first_minibatch_ratio_min"] - 1) < 1e-5
        )
        for key in ("kl/per_token", "policy/loss", "entropy"):
            assert a[key] == pytest.approx(b[key], abs=1e-5), key
    # as in the DPO and RM runs (float64 gradients agree above): measured max 2.1e-5, 27 of 321,152
    # elements above 1e-6 (the same padded run with micro-batches of 4 instead of 8: 1.9e-6, 4)
    diff = torch.cat([(weights_a[k] - weights_b[k]).abs().flatten() for k in weights_a])
    assert diff.max() < 5e-5 and (diff > 1e-6).float().mean() < 3e-4, (diff.max(), (diff > 1e-6).sum())
