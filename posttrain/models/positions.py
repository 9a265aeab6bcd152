"""The last decoder layer computed only at the positions a pass reads.

A pass that reads a few positions of a sequence (a reward model its last token, a log-prob pass the
response positions, a critic the states before each response token) still runs every layer at
every position. Only the last layer can skip positions: the layers below feed the last layer's keys
and values at every position, but the last layer's outputs are read only where the head reads
them. There the last layer needs, at every position, its keys and values (input norm and the k / v
projections: 2·H·H_kv of its ≈ 2·H·(2·H + 2·H_kv) + 6·H·I weights per token), and at the read
positions alone the queries, attention, output projection and MLP. The result at the read
positions is the full forward's up to float rounding; elsewhere the layer passes its input through
(never read).

What that saves is about (share of the last layer) × (share of positions not read): much for a model
of few layers, little for a deep one (docs/benchmarks.md gives the times measured on a reward model's
pass). The saving is work removed, not an approximation.

Used for Llama-family decoder layers (Llama, Mistral, Qwen2, Qwen3: pre-norm attention with
q/k/v/o projections and rotary embeddings, then a pre-norm MLP), verified once per model by a probe
against the model's own forward; any other model, a layer with hooks on or inside it (DeepSpeed
ZeRO-3, FSDP1 and FSDP2), gradient checkpointing (the recomputation would run the full layer), sliding-window layers
and attention dropout in training run the full forward unchanged.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from posttrain.models.loading import checkpointing_on, unwrap_model

LLAMA_FAMILY = ("LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer", "Qwen3DecoderLayer")


def _last_layer(model: nn.Module) -> nn.Module | None:
    """The last decoder layer, when this module can compute it at a subset of positions; else None."""
    model = unwrap_model(model)
    backbone = getattr(model, "base_model", None)
    layers = getattr(backbone, "layers", None)
    if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
        return None
    config = model.config.get_text_config()
    layer = layers[config.num_hidden_layers - 1]
    if type(layer).__name__ not in LLAMA_FAMILY:
        return None
    if getattr(config, "sliding_window", None) is not None and getattr(config, "use_sliding_window", True):
        return None
    if set(getattr(config, "layer_types", None) or ["full_attention"]) != {"full_attention"}:
        return None
    if config._attn_implementation not in ("sdpa", "eager"):
        return None
    if any(m._forward_hooks or m._forward_pre_hooks for m in layer.modules()):
        return None  # an engine's hooks (ZeRO-3 gathers, FSDP unshards) must see the layer's own calls
    patched = vars(layer).get("forward")
    if patched is not None and getattr(patched, "func", None) is not _dispatch:
        return None  # someone else replaced this layer's forward: leave it alone
    return layer


def _rotary(layer: nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE (Su et al. 2021) as the layer's own modeling module writes it: x·cos + rotate_half(x)·sin
    with that module's ``rotate_half``; x [B, heads, n, d], cos / sin [B, n, d]."""
    rotate_half = sys.modules[type(layer).__module__].rotate_half
    return x * cos[:, None] + rotate_half(x) * sin[:, None]


def _at_positions(
    layer: nn.Module,
    read: torch.Tensor,
    hidden_states: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
    cache=None,
    past_key_values=None,
    **_,
) -> torch.Tensor:
    """A Llama-family decoder layer's forward at the positions ``read`` [B, k] only (the rest of the
    module docstring). hidden_states: [B, L, H]; attention_mask: the mask transformers hands its
    layers (None = causal, a 4-D boolean one = True where attended, a 4-D float one = added to the
    scores); returns [B, L, H], the layer's output at ``read`` and its input elsewhere."""
    cache = cache if cache is not None else past_key_values
    attn = layer.self_attn
    B, L, H = hidden_states.shape
    d = attn.head_dim
    k = read.shape[1]
    cos, sin = position_embeddings  # [B or 1, L, d]
    cos, sin = cos.expand(B, -1, -1), sin.expand(B, -1, -1)
    normed = layer.input_layernorm(hidden_states)
    at = read[..., None]
    normed_read = normed.gather(1, at.expand(-1, -1, H))  # [B, k, H]
    query = attn.q_proj(normed_read).view(B, k, -1, d)
    key = attn.k_proj(normed).view(B, L, -1, d)
    value = attn.v_proj(normed).view(B, L, -1, d).transpose(1, 2)
    if hasattr(attn, "q_norm"):  # Qwen3: a per-head RMSNorm before the rotation
        query, key = attn.q_norm(query), attn.k_norm(key)
    query = _rotary(
        layer, query.transpose(1, 2), cos.gather(1, at.expand(-1, -1, d)), sin.gather(1, at.expand(-1, -1, d))
    )
    key = _rotary(layer, key.transpose(1, 2), cos, sin)
    if cache is not None:
        key, value = cache.update(key, value, attn.layer_idx)
    keys = torch.arange(key.shape[2], device=read.device)
    offset = key.shape[2] - L  # keys already in the cache come first
    if attention_mask is None:
        mask = keys[None, None, None, :] <= (read + offset)[:, None, :, None]  # causal, [B, 1, k, L']
    else:
        rows = read[:, None, :, None].expand(-1, attention_mask.shape[1], -1, attention_mask.shape[-1])
        mask = attention_mask.expand(B, -1, -1, -1).gather(2, rows)  # the rows of the read queries
        if mask.dtype != torch.bool:
            mask = mask.to(query.dtype)
    if key.shape[1] != query.shape[1]:
        # grouped-query attention: repeated keys and values, as transformers' sdpa path does with a mask
        # (with a mask, enable_gqa would leave CUDA only sdpa's quadratic-memory math kernel)
        groups = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=attn.scaling)  # [B, heads, k, d]
    residual = hidden_states.gather(1, at.expand(-1, -1, H))
    x = residual + attn.o_proj(out.transpose(1, 2).reshape(B, k, -1))
    x = x + layer.mlp(layer.post_attention_layernorm(x))
    return hidden_states.scatter(1, at.expand(-1, -1, H), x)


def can_read_positions(model: nn.Module) -> bool:
    """Whether ``read_positions`` computes less for this model right now (see the module docstring)."""
    layer = _last_layer(model)
    if layer is None or checkpointing_on(model):
        return False
    if layer.training and float(getattr(layer.self_attn, "attention_dropout", 0.0) or 0.0) > 0:
        return False
    verdict = getattr(layer, "_posttrain_read_positions_ok", None)
    if verdict is None:
        verdict = _probe(model, layer)
        layer._posttrain_read_positions_ok = verdict
    return verdict


_reads = threading.local()  # per thread: {id(layer): [read positions of each open block, innermost last]}


def _dispatch(layer: nn.Module, *args, **kwargs) -> torch.Tensor:
    """The last layer's forward once ``read_positions`` has been used on it: the innermost open block of
    this thread decides; outside any block (another thread, a later call) the layer's own forward."""
    stack = getattr(_reads, "stacks", {}).get(id(layer))
    if not stack:
        return type(layer).forward(layer, *args, **kwargs)
    return _at_positions(layer, stack[-1], *args, **kwargs)


@contextlib.contextmanager
def _reading(layer: nn.Module, read: torch.Tensor) -> Iterator[None]:
    if "forward" not in vars(layer):
        layer.forward = functools.partial(_dispatch, layer)  # installed once; the instance attribute shadows the method
    if not hasattr(_reads, "stacks"):
        _reads.stacks = {}
    stack = _reads.stacks.setdefault(id(layer), [])
    stack.append(read)
    try:
        yield
    finally:
        stack.pop()


@contextlib.contextmanager
def read_positions(model: nn.Module, read: torch.Tensor | None) -> Iterator[None]:
    """Within this block, forwards of ``model`` compute its last decoder layer only at ``read``
    ([B, k] positions of each row, distinct within a row: a repeated position would get its gradient
    twice; None or k = 0: every position), where ``can_read_positions``; otherwise the block changes
    nothing. Blocks nest, and a block applies to the forwards of its own thread only."""
    if read is None or read.shape[-1] == 0 or not can_read_positions(model):
        yield
        return
    with _reading(_last_layer(model), read):
        yield


def last_positions(batch_size: int, length: int, count: int, device) -> torch.Tensor:
    """[B, count]: the last ``count`` positions of every row (``logits_to_keep = count``; at most all
    ``length`` of them, as transformers reads a larger ``logits_to_keep``)."""
    return torch.arange(max(0, length - count), length, device=device).expand(batch_size, -1)


def positions_per_row(rows: torch.Tensor, positions: torch.Tensor, num_rows: int) -> torch.Tensor:
    """[R, k] read positions from (rows [N], positions [N]) pairs, distinct within a row: each row gets
    its own positions and, to reach the most any row has (k), its first other positions (computed,
    never read; a packed row's padding attends to itself, so no query there is empty)."""
    length = int(positions.max()) + 1 if len(positions) else 1
    marked = torch.zeros((num_rows, length), dtype=torch.bool, device=positions.device)
    marked[rows, positions] = True
    count = marked.sum(1)
    k = int(count.max())
    length = max(length, k)
    marked = torch.nn.functional.pad(marked, (0, length - marked.shape[1]))
    free = ~marked
    marked |= free & (free.cumsum(1) <= (k - count)[:, None])
    return marked.nonzero()[:, 1].view(num_rows, k)


def _probe(model: nn.Module, layer: nn.Module) -> bool:
    """The layer at two positions of a short padded batch against the model's full forward: the read
    positions' last hidden states must agree within 1e-4 (float32) or 3e-2 (half precision) of their scale."""
    parameter = next(model.parameters())
    vocab = unwrap_model(model).get_input_embeddings().num_embeddings
    ids = (torch.arange(14, device=parameter.device).view(2, 7) * 7 + 3) % vocab
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    backbone = unwrap_model(model).base_model
    read = torch.tensor([[3, 6], [2, 5]], device=parameter.device)
    tolerance = 1e-4 if parameter.dtype in (torch.float32, torch.float64) else 3e-2
    # outside any autocast of the caller: the verdict is about the layer, in the weights' own dtype
    with torch.no_grad(), torch.autocast(parameter.device.type, enabled=False):
        full = backbone(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False).last_hidden_state
        try:
            with _reading(layer, read):
                part = backbone(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False)
        except Exception:
            return False
    index = read[..., None].expand(-1, -1, full.shape[-1])
    got, want = part.last_hidden_state.gather(1, index), full.gather(1, index)
    error = (got - want).abs().max().item() / max(1.0, want.abs().max().item())
    return error <= tolerance
