"""A lean decode loop for CPUs and small models, a drop-in for ``HFEngine`` with the same outputs.

Where ``model.generate`` spends its time on small models is Python around the matmuls (logits
processors, stopping criteria, cache growth, input preparation). This loop does only what sampling
needs, and three things ``generate`` cannot:

- the prompt of a group is prefilled once and its KV cache copied to the G samples
  (``batch_repeat_interleave``), instead of G identical prefills;
- finished rows leave the batch with their cache rows, so late steps run on the rows still going;
- the log-prob of each drawn token is taken from the step's logits directly,
  log π = logits[y]/τ − logsumexp(logits/τ) (``core.token_logprobs``), without keeping a copy of a
  [B, V] row until the next step.

The distribution is ``generate``'s: EOS forbidden before ``min_new_tokens``, then temperature, then
top-k, then top-p (the same filters, in the same order), then one draw from what is left
(inverse CDF); τ = 0 is greedy.
A row ends at its first EOS / stop token or stop string; the steps after it hold the pad token, as in
``generate``. Log-probs are those of the full distribution at τ, as the training forward computes them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import FSDPModule

from posttrain.core import truncate_logits
from posttrain.models.loading import cache_keyword, checkpointing_on
from posttrain.rollout.base import Rollout, SamplingParams, build_rollout, left_pad
from posttrain.rollout.hf import HFEngine, eos_token_ids


def draw(
    logits: torch.Tensor, params: SamplingParams, forbid: torch.Tensor | None, truncated: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row from logits [B, V]; returns (tokens [B], log-prob of the token [B]).

    The log-prob is ``core.token_logprobs``'s logits[y]/τ − logsumexp(logits/τ), taken from the same
    log-softmax the draw uses when nothing is filtered. ``forbid``: token ids that may not be drawn at
    this step (EOS before min_new_tokens); they keep their probability in the recorded log-prob, which
    is the policy's, not the sampler's. ``truncated`` (rollout.behaviour_logprobs=truncated): the log-prob
    of the distribution drawn from instead, renormalised over what min-new-tokens, top-k and top-p kept
    (``core.truncated_logprobs``; 0 for a greedy pick).
    """
    scaled = logits / params.logprob_temperature if params.logprob_temperature != 1.0 else logits
    log_p = torch.log_softmax(scaled, dim=-1)  # one kernel, not scaled - logsumexp (bench/README.md)
    allowed = log_p.index_fill(1, forbid, -torch.inf) if forbid is not None else log_p
    kept = allowed
    if params.temperature == 0:
        tokens = allowed.argmax(dim=-1)
    elif params.top_k > 0 or params.top_p < 1.0:
        kept = truncate_logits(allowed, params.top_k, params.top_p)
        tokens = sample_categorical(kept.exp())
    elif forbid is not None:  # zero weight for the forbidden ids: the same draw as −inf before exp
        tokens = sample_categorical(log_p.exp().index_fill_(1, forbid, 0.0))
    else:
        tokens = sample_categorical(log_p.exp())
    if not truncated:
        return tokens, log_p.gather(1, tokens[:, None])[:, 0]
    if params.temperature == 0:
        return tokens, torch.zeros_like(tokens, dtype=log_p.dtype)
    return tokens, torch.log_softmax(kept, dim=-1).gather(1, tokens[:, None])[:, 0]


def sample_categorical(weights: torch.Tensor) -> torch.Tensor:
    """One index per row of non-negative ``weights`` [B, V] (unnormalised), by inverting the CDF: the
    first i with cumsum(w)[i] > u·Σw, u ~ U[0, 1). A token of weight 0 is never drawn. One uniform
    number per row instead of ``torch.multinomial``'s V exponentials."""
    cdf = weights.cumsum(dim=-1)
    u = torch.rand((weights.shape[0], 1), device=weights.device, dtype=cdf.dtype) * cdf[:, -1:]
    return torch.searchsorted(cdf, u, right=True)[:, 0].clamp(max=weights.shape[-1] - 1)


class LeanEngine(HFEngine):
    """Rollout engine with the hand decode loop of the module docstring: an ``HFEngine`` (the same
    model, tokenizer and contract) whose ``generate`` does not call transformers' ``generate``."""

    def generate(self, prompts: list[list[int]], params: SamplingParams, n: int = 1) -> Rollout:
        """Sample ``n`` responses to each prompt (token-id lists); rows of one prompt are consecutive."""
        params.validate()
        stop_ids = eos_token_ids(self.tokenizer, self.model, params.stop_token_ids)
        rows = [list(p) for p in prompts for _ in range(n)]
        device = next(self.model.parameters()).device
        prompt_ids, prompt_mask = left_pad([list(p) for p in prompts], self.tokenizer.pad_token_id)
        written_out = _written_out(self.model)
        # eval mode for the prefill (the model's forward); where that changes nothing, the two walks over
        # every module (transformers' train(): bench/README.md) are skipped
        toggle = self.model.training and not (written_out and _mode_free(self.model))
        if toggle:
            self.model.eval()
        try:
            with torch.inference_mode():
                sequences, logprobs, stop_positions = self._decode(
                    prompt_ids.to(device), prompt_mask.to(device), params, n, stop_ids, written_out
                )
        finally:
            if toggle:
                self.model.train()
        P = prompt_ids.shape[1]
        padded = (prompt_ids.repeat_interleave(n, 0).to(device), prompt_mask.repeat_interleave(n, 0).to(device))
        return build_rollout(
            self.tokenizer,
            rows,
            sequences[:, P:].clone(),
            stop_ids,
            stop_positions,
            logprobs.clone(),
            n,
            params.logprob_temperature,
            padded,
        )

    def _decode(self, prompt_ids, prompt_mask, params: SamplingParams, n: int, stop_ids: list[int], written_out: bool):
        """(sequences [B, P + T], logprobs [B, T], stop-string positions [B] or None), B = U·n."""
        U, P = prompt_ids.shape
        B, T, device = U * n, params.max_new_tokens, prompt_ids.device
        sequences = torch.full((B, P + T), self.tokenizer.pad_token_id, dtype=torch.long, device=device)
        sequences[:, :P] = prompt_ids.repeat_interleave(n, 0)
        logprobs = torch.zeros((B, T), device=device)
        stop_tensor = torch.tensor(stop_ids, device=device)
        stops = _StopStrings(self.tokenizer, params.stop_strings, B, device) if params.stop_strings else None
        mask = torch.ones((B, P + T), dtype=torch.long, device=device)
        mask[:, :P] = prompt_mask.repeat_interleave(n, 0)
        positions = (prompt_mask.cumsum(-1) - 1).clamp(min=0)
        padded = not bool(prompt_mask.all())  # without padding, decode steps need no attention mask
        decoder = _LlamaDecoder(self.model, P + T) if written_out else _ModelDecoder(self.model)
        logits = decoder.prefill(prompt_ids, prompt_mask, positions, n)
        next_position = positions[:, -1:].repeat_interleave(n, 0) + 1  # [B, 1]
        active = torch.arange(B, device=device)  # the global row of each row still decoding
        steps = 0
        for t in range(T):
            tokens, token_lp = draw(logits, params, stop_tensor if t < params.min_new_tokens else None, self.truncated)
            everyone = len(active) == B
            sequences[slice(None) if everyone else active, P + t] = tokens
            logprobs[slice(None) if everyone else active, t] = token_lp
            steps = t + 1
            if t == T - 1:
                break
            # EOS cannot end a row before min_new_tokens; a stop string can
            if stops is not None or t >= params.min_new_tokens:
                finished = torch.isin(tokens, stop_tensor)
                if stops is not None:
                    finished |= stops.update(sequences[active, : P + t + 1], active, t)
                if bool(finished.any()):  # the one host sync of a step: which rows leave the batch
                    keep = (~finished).nonzero().squeeze(1)
                    if len(keep) == 0:
                        break
                    decoder.select(keep)
                    active, tokens, next_position = active[keep], tokens[keep], next_position[keep]
            attention = mask[active, : P + t + 1] if padded else None
            logits = decoder.step(tokens, attention, next_position)
            next_position = next_position + 1
        return sequences[:, : P + steps], logprobs[:, :steps], None if stops is None else stops.positions


_COVERED = {
    "LlamaForCausalLM": ("LlamaDecoderLayer", "LlamaAttention", "LlamaMLP", "LlamaRMSNorm"),
    "Qwen2ForCausalLM": ("Qwen2DecoderLayer", "Qwen2Attention", "Qwen2MLP", "Qwen2RMSNorm"),
}
"""The models the written-out step covers, with the module classes it reads (their subclasses may compute
something else, so the names must match exactly)."""


def written_out_gaps(model: nn.Module) -> list[str]:
    """Why the hand-written Llama/Qwen2 step (``_LlamaDecoder``) would not compute the model's own forward;
    empty when it does. It covers a plain float32 Llama or Qwen2 (not peft-wrapped) built of the stock
    layer classes, with or without attention and MLP biases, no sliding window, no hooks anywhere on the
    model (the step skips every module's forward), whose forward runs in its weights' dtype: not under an
    autocast (accelerate's mixed precision wraps the forward and keeps the original as ``_original_forward``;
    the prefill's half-precision cache then met the step's float32 queries)."""
    name = type(model).__name__
    if isinstance(model, FSDPModule):
        return ["the model is sharded by FSDP2, whose forward hooks gather its shards (the step skips them)"]
    if name not in _COVERED:
        return [f"{name} is not a Llama or Qwen2 causal LM"]
    layer_class, attention_class, mlp_class, norm_class = _COVERED[name]
    config, gaps = model.config, []
    if "_original_forward" in vars(model) or torch.is_autocast_enabled(model.lm_head.weight.device.type):
        gaps.append("the forward runs under an autocast (mixed precision)")
    if model.lm_head.weight.dtype != torch.float32:
        gaps.append(f"the weights are {model.lm_head.weight.dtype}, not float32")
    if getattr(config, "use_sliding_window", False) or any(
        t != "full_attention" for t in getattr(config, "layer_types", None) or []
    ):
        gaps.append("some layers use sliding-window attention")
    if any(m._forward_hooks or m._forward_pre_hooks for m in model.modules()) or (
        nn.modules.module._global_forward_hooks or nn.modules.module._global_forward_pre_hooks
    ):
        gaps.append("forward hooks are registered on the model")
    backbone = model.model
    for layer in backbone.layers:
        found = (type(layer), type(layer.self_attn), type(layer.mlp), type(layer.input_layernorm))
        if tuple(c.__name__ for c in found) != (layer_class, attention_class, mlp_class, norm_class) or not isinstance(
            layer.post_attention_layernorm, found[3]
        ):
            gaps.append(f"a layer is built of other modules ({', '.join(c.__name__ for c in found)})")
            break
    if type(backbone.norm).__name__ != norm_class:
        gaps.append(f"the final norm is a {type(backbone.norm).__name__}")
    return gaps


def _written_out(model: nn.Module) -> bool:
    """Decode with the hand-written step (``_LlamaDecoder``)? Where ``written_out_gaps`` finds none; any
    other model decodes through its own forward on a DynamicCache."""
    return not written_out_gaps(model)


def _mode_free(model: nn.Module) -> bool:
    """Whether a Llama/Qwen2 forward is the same in train and eval mode: no dropout anywhere (posttrain
    loads models with it off) and no gradient checkpointing (which runs only in train mode)."""
    return not checkpointing_on(model) and not any(
        (isinstance(m, nn.Dropout) and m.p > 0) or float(getattr(m, "attention_dropout", 0.0) or 0.0) > 0
        for m in model.modules()
    )


class _ModelDecoder:
    """Decode steps through ``model.forward`` with a ``DynamicCache`` (any causal LM, peft models too)."""

    def __init__(self, model: nn.Module):
        from transformers import DynamicCache

        self.model = model
        self.cache = DynamicCache(config=model.config)

    def _logits(self, input_ids, attention_mask, position_ids) -> torch.Tensor:
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            **{cache_keyword(self.model): self.cache},
            use_cache=True,
            logits_to_keep=1,
        )
        return out.logits[:, -1].float()

    def prefill(self, prompt_ids, prompt_mask, positions, n: int) -> torch.Tensor:
        """Each prompt once, its cache then repeated for its n samples; returns logits [U·n, V]."""
        logits = self._logits(prompt_ids, prompt_mask, positions).repeat_interleave(n, 0)
        self.cache.batch_repeat_interleave(n)
        return logits

    def select(self, rows: torch.Tensor) -> None:
        self.cache.batch_select_indices(rows)

    def step(self, tokens, attention_mask, position_ids) -> torch.Tensor:
        return self._logits(tokens[:, None], attention_mask, position_ids)


class _LlamaDecoder(_ModelDecoder):
    """One decode step of a Llama/Qwen2 decoder written out on 2-D [b, H] activations: fused q/k/v and
    gate/up matmuls, one rotation for q and k together, cos/sin looked up in a table made once by the
    model's own rotary module, a preallocated KV cache written in place, no attention mask when no
    prompt is padded. The prefill is the model's forward (exact for any padding); its cache is copied
    into the buffers. The weights are the model's own tensors (concatenated copies for the fused
    matmuls), gathered with every other number a step needs once per ``generate``: a step then reads
    no module attribute (reading them, a decode step of the 2-layer bench model spent a share of its time
    in Python: bench/README.md)."""

    def __init__(self, model: nn.Module, max_length: int):
        super().__init__(model)
        config, backbone = model.config, model.model
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = backbone.layers[0].self_attn.head_dim
        self.layers = []
        for layer in backbone.layers:
            attn, mlp, norm1, norm2 = layer.self_attn, layer.mlp, layer.input_layernorm, layer.post_attention_layernorm
            qkv = [attn.q_proj, attn.k_proj, attn.v_proj]
            self.layers.append(
                (
                    (norm1.weight, norm1.variance_epsilon),
                    torch.cat([p.weight for p in qkv]),
                    None if attn.q_proj.bias is None else torch.cat([p.bias for p in qkv]),
                    attn.scaling,
                    (attn.o_proj.weight, attn.o_proj.bias),
                    (norm2.weight, norm2.variance_epsilon),
                    torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]),
                    None if mlp.gate_proj.bias is None else torch.cat([mlp.gate_proj.bias, mlp.up_proj.bias])[:, None],
                    F.silu if config.hidden_act == "silu" else mlp.act_fn,
                    (mlp.down_proj.weight, mlp.down_proj.bias),
                )
            )
        self.embedding = backbone.embed_tokens.weight
        self.final_norm = (backbone.norm.weight, backbone.norm.variance_epsilon)
        self.head = (model.lm_head.weight, model.lm_head.bias)
        positions = torch.arange(max_length, device=self.embedding.device)[None]
        cos, sin = backbone.rotary_emb(self.embedding[:1][None], positions)
        half = self.head_dim // 2
        # rotate_half(x)·sin = roll(x, half)·[−sin_1, sin_2]: the sign folded into the table once
        self.rotary = torch.stack([cos[0], torch.cat([-sin[0, :, :half], sin[0, :, half:]], dim=-1)], dim=1)
        self.max_length = max_length
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []

    def prefill(self, prompt_ids, prompt_mask, positions, n: int) -> torch.Tensor:
        logits = super().prefill(prompt_ids, prompt_mask, positions, n)
        P = prompt_ids.shape[1]
        for layer in self.cache.layers:
            for source, buffers in ((layer.keys, self.keys), (layer.values, self.values)):
                buffer = source.new_empty(source.shape[0], source.shape[1], self.max_length, source.shape[3])
                buffer[:, :, :P] = source
                buffers.append(buffer)
        self.length, self.cache = P, None
        return logits

    def select(self, rows: torch.Tensor) -> None:
        self.keys = [k[rows] for k in self.keys]
        self.values = [v[rows] for v in self.values]

    def step(self, tokens, attention_mask, position_ids) -> torch.Tensor:
        """tokens [b], attention_mask [b, L] (L = cache length + 1) or None, position_ids [b, 1] -> logits [b, V]."""
        b, d, h, kv = tokens.shape[0], self.head_dim, self.heads, self.kv_heads
        x = F.embedding(tokens, self.embedding)  # [b, H]
        width = (x.shape[-1],)
        rotary = self.rotary[position_ids[:, 0]]  # [b, 2, d]
        cos, sin = rotary[:, None, 0], rotary[:, None, 1]  # [b, 1, d]
        allowed = None if attention_mask is None else attention_mask.bool()[:, None, None, :]
        at, gqa = self.length, kv != h
        for layer, keys, values in zip(self.layers, self.keys, self.values, strict=True):
            norm1, w_qkv, b_qkv, scaling, o_proj, norm2, w_gate_up, b_gate_up, act, down_proj = layer
            qkv = F.linear(F.rms_norm(x, width, *norm1), w_qkv, b_qkv)
            qk = _rotate(qkv[:, : (h + kv) * d].view(b, h + kv, d), cos, sin)
            keys[:, :, at] = qk[:, h:]
            values[:, :, at] = qkv[:, (h + kv) * d :].view(b, kv, d)
            out = F.scaled_dot_product_attention(
                qk[:, :h, None],
                keys[:, :, : at + 1],
                values[:, :, : at + 1],
                attn_mask=allowed,
                scale=scaling,
                enable_gqa=gqa,
            )
            x = _add_linear(x, out.view(b, h * d), *o_proj)
            # the MLP feature-major ([2I, b] = W·xᵀ): with b ~ 16 rows, MKL splits W's rows over its
            # threads, faster than x·Wᵀ at 2 threads and level at 1 (bench/README.md)
            normed = F.rms_norm(x, width, *norm2).t()
            gate_up = w_gate_up @ normed if b_gate_up is None else torch.addmm(b_gate_up, w_gate_up, normed)
            gate, up = gate_up.chunk(2, 0)  # [I, b] each
            x = _add_linear(x, (act(gate) * up).t(), *down_proj)
        self.length += 1
        return F.linear(F.rms_norm(x, width, *self.final_norm), *self.head).float()


def _rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding (Su et al. 2021) in the half-split layout of Llama checkpoints:
    x·cos + rotate_half(x)·sin, with rotate_half(x)·sin = roll(x, d/2)·signed_sin."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), signed_sin)


def _add_linear(x: torch.Tensor, inputs: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x + inputs·Wᵀ (+ bias), as one addmm when the layer has no bias (the residual connection)."""
    if bias is None:
        return torch.addmm(x, inputs, weight.t())
    return x + F.linear(inputs, weight, bias)


class _StopStrings:
    """transformers' StopStringCriteria on the decoded rows, remembering the step each row stopped at."""

    def __init__(self, tokenizer, stop_strings: list[str], batch_size: int, device):
        from transformers.generation.stopping_criteria import StopStringCriteria

        self.inner = StopStringCriteria(tokenizer=tokenizer, stop_strings=stop_strings)
        self.positions = torch.full((batch_size,), -1, dtype=torch.long, device=device)

    def update(self, sequences: torch.Tensor, rows: torch.Tensor, step: int) -> torch.Tensor:
        """sequences: [b, L] of the batch rows ``rows``; returns which of them end at ``step``."""
        done = self.inner(sequences, None)
        self.positions[rows[done]] = step
        return done
