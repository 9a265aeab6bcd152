"""models.positions: the last decoder layer computed only where a pass reads it (issue 13).

Each pass must return what the full forward returns (values and gradients), compute less, and fall
back to the full forward wherever the shortcut would not be the model's own computation.
"""

from __future__ import annotations

import pytest
import torch
from helpers import assert_close
from torch.utils.flop_counter import FlopCounterMode

from posttrain.core import pack_shared_prefix
from posttrain.models import (
    ModelConfig,
    load_causal_lm,
    load_scalar_model,
    prompt_cached_logprobs,
    response_logprobs,
    sequence_scores,
    shared_prefix_logprobs,
    shared_prefix_scores,
    token_values,
)
from posttrain.models import positions as positions_module
from posttrain.models.positions import can_read_positions, positions_per_row, read_positions

PAD = 0


def _gqa_model(name: str, vocab: int = 100):
    """A small grouped-query Qwen3 (per-head q/k norms) or Mistral (sliding window off), built from a seed."""
    import transformers

    config_class, model_class, seed, extra = {
        "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", 5, {"head_dim": 16}),
        "mistral": ("MistralConfig", "MistralForCausalLM", 6, {"sliding_window": None}),
    }[name]
    torch.manual_seed(seed)
    config = getattr(transformers, config_class)(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        attention_dropout=0.0,
        **extra,
    )
    return getattr(transformers, model_class)(config).eval()


def _model(tiny_dir, name: str, attn: str = "sdpa"):
    if name in ("qwen3", "mistral"):
        return _gqa_model(name)
    return load_causal_lm(ModelConfig(path=str(tiny_dir / name), device="cpu", attn_implementation=attn))


def _padded_batch(vocab: int):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, vocab, (3, 11), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding
    mask[2, :1] = 0
    return ids, mask


def _full(monkeypatch):
    """Every read_positions block a no-op: the model's own full forward, for comparison."""
    monkeypatch.setattr(positions_module, "can_read_positions", lambda model: False)


def test_positions_per_row_by_hand():
    rows = torch.tensor([0, 0, 0, 1, 2, 2])
    positions = torch.tensor([4, 7, 9, 5, 0, 3])
    got = positions_per_row(rows, positions, 3)
    # row 1 has one read position: its first two other positions (0, 1) fill it up to three
    assert got.tolist() == [[4, 7, 9], [0, 1, 5], [0, 1, 3]]


@pytest.mark.parametrize(
    ("name", "attn"),
    [("policy", "sdpa"), ("policy", "eager"), ("qwen2", "sdpa"), ("qwen3", "sdpa"), ("mistral", "sdpa")],
)
def test_read_positions_equal_the_full_forward_values_and_gradients(tiny_dir, name, attn):
    model = _model(tiny_dir, name, attn)
    assert can_read_positions(model)
    ids, mask = _padded_batch(model.config.vocab_size)
    read = torch.tensor([[4, 10], [6, 9], [2, 8]])
    weights = torch.randn(3, 2, model.config.hidden_size, generator=torch.Generator().manual_seed(1))

    def run():
        model.zero_grad()
        hidden = model.model(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
        picked = hidden.gather(1, read[..., None].expand(-1, -1, hidden.shape[-1]))
        (picked * weights).sum().backward()
        return picked.detach(), {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}

    full, full_grads = run()
    with read_positions(model, read):
        part, part_grads = run()
    assert_close(part, full)
    for k, grad in full_grads.items():
        assert_close(part_grads[k], grad, atol=1e-6 * max(1.0, grad.abs().max().item()), msg=k)


def _last_layer_linear_flops(model, rows: int, skipped_positions: int) -> int:
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    q = c.num_attention_heads * head_dim
    per_token = 2 * (c.hidden_size * q + q * c.hidden_size + 3 * c.hidden_size * c.intermediate_size)
    return rows * skipped_positions * per_token


def test_reading_one_position_skips_the_last_layers_work_elsewhere(tiny_dir):
    """A reward model reading the last token: the last layer's q / o projections, attention and MLP
    run at one position per row, not at all 11 (counted by torch's FLOP counter)."""
    model = load_scalar_model(ModelConfig(path=str(tiny_dir / "reward"), device="cpu"), "reward")
    ids, mask = _padded_batch(model.config.vocab_size)
    assert can_read_positions(model)  # its probe forward runs now, not inside the count

    def flops(enabled: bool) -> int:
        with FlopCounterMode(display=False) as counter, torch.no_grad():
            if enabled:
                sequence_scores(model, ids, mask)
            else:
                with pytest.MonkeyPatch.context() as patch:
                    patch.setattr(positions_module, "can_read_positions", lambda m: False)
                    sequence_scores(model, ids, mask)
        return counter.get_total_flops()

    full, part = flops(False), flops(True)
    linear = _last_layer_linear_flops(model, 3, 10)
    attention_bound = 4 * 3 * 10 * 11 * model.config.hidden_size
    assert linear <= full - part <= linear + attention_bound, (full, part, linear)


def test_role_passes_equal_the_full_forward(tiny_dir, monkeypatch):
    """Every pass that reads a subset (log-probs, reward scores, critic values, packed rows, the prompt
    cache) equals the model's full forward, values and gradients."""
    policy = load_causal_lm(ModelConfig(path=str(tiny_dir / "policy"), device="cpu"))
    reward = load_scalar_model(ModelConfig(path=str(tiny_dir / "reward"), device="cpu"), "reward")
    value = load_scalar_model(ModelConfig(path=str(tiny_dir / "reward"), device="cpu"), "value")
    ids, mask = _padded_batch(policy.config.vocab_size)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(4, 100, (n,), generator=g).tolist() for n in (6, 3)]
    responses = [[torch.randint(4, 100, (n,), generator=g).tolist() for n in (4, 2)], [[7, 8, 9]]]
    packed = pack_shared_prefix(prompts, responses, PAD)
    prompt_ids = torch.tensor([[0, 0, 5, 6, 7], [0, 0, 5, 6, 7], [9, 10, 11, 12, 13]])
    prompt_mask = (torch.arange(5) >= torch.tensor([[2], [2], [0]])).long()

    passes = {
        "response_logprobs": (policy, lambda: response_logprobs(policy, ids, mask, 5)[0]),
        "shared_prefix_logprobs": (policy, lambda: shared_prefix_logprobs(policy, packed)[0]),
        "prompt_cached_logprobs": (
            policy,
            lambda: prompt_cached_logprobs(policy, prompt_ids, prompt_mask, ids[:, :4], torch.tensor([0, 0, 1]))[0],
        ),
        "sequence_scores": (reward, lambda: sequence_scores(reward, ids, mask)),
        "shared_prefix_scores": (reward, lambda: shared_prefix_scores(reward, packed)),
        "token_values": (value, lambda: token_values(value, ids, mask, 5)),
    }
    for name, (model, forward) in passes.items():
        assert can_read_positions(model), name

        def run(model=model, forward=forward):
            model.zero_grad()
            out = forward()
            weights = torch.linspace(-1.0, 1.5, out.numel()).view_as(out)
            (torch.where(torch.isfinite(out), out, 0.0) * weights).sum().backward()
            return out.detach(), {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}

        part, part_grads = run()
        with monkeypatch.context() as patch:
            _full(patch)
            full, full_grads = run()
        assert_close(part, full, msg=name)
        assert part_grads.keys() == full_grads.keys(), name
        for k, grad in full_grads.items():
            assert_close(part_grads[k], grad, atol=1e-6 * max(1.0, grad.abs().max().item()), msg=f"{name}: {k}")


def test_lora_policy_reads_positions_through_its_adapters(tiny_dir):
    from peft import LoraConfig, get_peft_model

    model = load_causal_lm(ModelConfig(path=str(tiny_dir / "policy"), device="cpu"))
    lora = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj", "o_proj", "down_proj"]))
    for name, p in lora.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.05)  # non-zero: the adapters change the output
    assert can_read_positions(lora)
    ids, mask = _padded_batch(100)
    full = response_logprobs(lora, ids, mask, 5)[0]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(positions_module, "can_read_positions", lambda m: False)
        expected = response_logprobs(lora, ids, mask, 5)[0]
    assert_close(full, expected)
    with lora.disable_adapter():  # the reference of a LoRA policy: the same weights, adapters off
        base = response_logprobs(lora, ids, mask, 5)[0]
    assert (base - full).abs().max() > 1e-3


def test_full_forward_where_the_shortcut_is_not_the_models_computation(tiny_dir):
    model = load_causal_lm(ModelConfig(path=str(tiny_dir / "policy"), device="cpu"))
    assert can_read_positions(model)
    # gradient checkpointing: the recomputation in backward calls the layer again, after the block
    checkpointed = load_causal_lm(ModelConfig(path=str(tiny_dir / "policy"), device="cpu", gradient_checkpointing=True))
    assert not can_read_positions(checkpointed)
    handle = model.model.layers[-1].mlp.register_forward_hook(lambda *a: None)  # an engine's hook inside
    assert not can_read_positions(model)
    handle.remove()
    model.train()
    model.model.layers[-1].self_attn.attention_dropout = 0.1
    assert not can_read_positions(model)
    model.model.layers[-1].self_attn.attention_dropout = 0.0
    assert can_read_positions(model)


def test_a_model_outside_the_llama_family_runs_its_full_forward():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=50, n_embd=32, n_layer=2, n_head=2, n_positions=32)).eval()
    assert not can_read_positions(model)
    ids = torch.randint(0, 50, (2, 9))
    with read_positions(model, torch.tensor([[8], [8]])):
        out = model(input_ids=ids).logits
    assert_close(out, model(input_ids=ids).logits)


def test_probe_refuses_a_layer_that_does_not_compute_what_it_looks_like(tiny_dir):
    """A Llama-named layer whose forward does something else (here: no MLP) fails the probe and
    runs in full, instead of returning different numbers."""
    model = load_causal_lm(ModelConfig(path=str(tiny_dir / "qwen2"), device="cpu"))
    layer = model.model.layers[-1]
    original = type(layer).forward

    def without_mlp(self, hidden_states, **kwargs):
        residual = hidden_states
        out, _ = self.self_attn(hidden_states=self.input_layernorm(hidden_states), **kwargs)
        return residual + out

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(type(layer), "forward", without_mlp)
        assert not can_read_positions(model)
    assert type(layer).forward is original


def test_blocks_nest_and_belong_to_their_thread(tiny_dir):
    """Review finding: the layer's forward was patched per block and deleted on exit, so a nested block
    crashed on exit and a block open in one thread (an inline reward model past its timeout) changed
    the forwards of another."""
    import copy
    import threading

    model = _model(tiny_dir, "policy")
    ids, mask = _padded_batch(model.config.vocab_size)

    def hidden():
        with torch.no_grad():
            return model.model(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state

    full = hidden()
    outer, inner = torch.tensor([[10], [9], [8]]), torch.tensor([[4, 6], [5, 7], [3, 9]])

    def picked(h, read):
        return h.gather(1, read[..., None].expand(-1, -1, h.shape[-1]))

    def unread_differs(h, read):  # the shortcut ran: elsewhere the layer passed its input through
        keep = torch.zeros_like(h[..., 0], dtype=torch.bool).scatter(1, read, True)
        return (h - full)[~keep].abs().max() > 1e-3

    with read_positions(model, outer):
        h_outer = hidden()
        with read_positions(model, inner):
            h_inner = hidden()
            other = {}
            thread = threading.Thread(target=lambda: other.setdefault("h", hidden()))
            thread.start()
            thread.join()
        h_after = hidden()
    assert_close(picked(h_outer, outer), picked(full, outer))
    assert unread_differs(h_outer, outer)
    assert_close(picked(h_inner, inner), picked(full, inner))
    assert unread_differs(h_inner, inner)
    assert_close(h_after, h_outer)  # the outer block again after the inner one closed
    assert_close(other["h"], full)  # another thread: the full forward
    assert_close(hidden(), full)  # after the blocks
    twin = copy.deepcopy(model)  # a copy made after the first block runs its own forward
    with torch.no_grad():
        assert_close(twin.model(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state, full)


def test_degenerate_reads_run_the_full_forward(tiny_dir):
    """Review finding: logits_to_keep longer than the rows, and a read of no position, crashed."""
    model = _model(tiny_dir, "policy")
    ids, mask = _padded_batch(model.config.vocab_size)
    with torch.no_grad():
        full = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        with read_positions(model, torch.zeros((3, 0), dtype=torch.long)):
            assert_close(model(input_ids=ids, attention_mask=mask, use_cache=False).logits, full)
        read = positions_module.last_positions(3, 11, 14, "cpu")  # logits_to_keep=14 of 11 positions: all of them
        assert read.tolist() == [list(range(11))] * 3
        with read_positions(model, read):
            assert_close(model(input_ids=ids, attention_mask=mask, use_cache=False, logits_to_keep=14).logits, full)
