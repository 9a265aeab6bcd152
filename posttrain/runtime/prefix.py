"""``shared_prefix``: whether a trainer lays each prompt out once before all of its responses.

A DPO pair, a reward-model ranking or a GRPO group shares its prompt; packed (``core.packing``) the
prompt is computed once instead of once per response, and every response still sees exactly its own
context, so losses and gradients equal the padded layout's up to float rounding. ``auto`` (the
default) packs when the model takes the 4-D mask exactly (``models.shared_prefix_unsupported``;
otherwise the padded layout, with the reason printed once) and, micro-batch by micro-batch, when the
packed rows cost fewer FLOPs than the padded ones (``core.forward_cost``: a long shared row costs
more attention, so short prompts before many long responses stay padded). ``true`` always packs and
stops at start when the model cannot; ``false`` never packs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from posttrain.core import SharedPrefixBatch, forward_cost, pack_groups, packed_group_shape
from posttrain.models import checkpointing_on, shared_prefix_unsupported
from posttrain.rollout import Rollout


def check_shared_prefix(value, name: str = "shared_prefix") -> None:
    if not (value == "auto" or isinstance(value, bool)):
        raise ValueError(f"{name} must be auto, true or false, got {value!r}")


@dataclass
class SharedPrefix:
    """The run's decision: ``enabled`` (the models can), ``always`` (``true``), and under ``auto`` the
    model sizes the cost comparison needs."""

    enabled: bool
    always: bool = False
    params: int = 0
    attention_width: int = 0
    prompt_cache: bool = False
    """GRPO under auto: where packing does not pay, run each distinct prompt of a micro-batch once and
    its samples as a continuation of its KV cache (``models.prompt_cached_logprobs``)."""

    def pays(self, padded_rows: int, padded_length: int, packed_rows: int, packed_length: int) -> bool:
        """Pack this micro-batch? ``padded_*``: one row per response; ``packed_*``: one row per prompt."""
        if not self.enabled or self.always:
            return self.enabled
        packed = forward_cost(packed_rows, packed_length, self.params, self.attention_width)
        return packed < forward_cost(padded_rows, padded_length, self.params, self.attention_width)


def model_size(model: nn.Module) -> tuple[int, int]:
    """(N, w) of ``core.forward_cost``: matmul parameters (the 2-D weights but the input embedding)
    and the attention width summed over layers (layers × heads × head dim)."""
    embedding = model.get_input_embeddings().weight
    params = sum(p.numel() for p in model.parameters() if p.dim() >= 2 and p is not embedding)
    text = model.config.get_text_config()
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    return params, text.num_hidden_layers * text.num_attention_heads * head_dim


def resolve_shared_prefix(setting, models: list[nn.Module], log: Callable[[str], None]) -> SharedPrefix:
    """``setting`` (auto | True | False) against the models every packed pass runs through (policy and
    reference, or the reward model). Logs the outcome once; raises when ``true`` cannot be honoured."""
    check_shared_prefix(setting)
    if setting is False:
        return SharedPrefix(enabled=False)
    for model in models:
        # a DeepSpeed ZeRO-3 shard (zero.Init at load, or a frozen role already prepared): the probe
        # forward below and model_size need whole weights
        sharded = any(hasattr(p, "ds_id") for p in model.parameters())
        reason = "the model is sharded by DeepSpeed ZeRO-3" if sharded else shared_prefix_unsupported(model)
        if reason is not None:
            if setting is True:
                raise ValueError(f"shared_prefix=true, but {type(model).__name__} cannot run packed rows: {reason}")
            log(f"shared-prefix packing off (shared_prefix=auto): {reason}; prompts are repeated per response")
            return SharedPrefix(enabled=False)
    params, width = model_size(models[0])
    log(
        "shared-prefix packing on: each prompt once, followed by its responses"
        + ("" if setting is True else " (per micro-batch, when it costs fewer FLOPs)")
    )
    return SharedPrefix(enabled=True, always=setting is True, params=params, attention_width=width)


def packed_rollout_rows(
    rollout: Rollout, rows: slice, shared: SharedPrefix | None
) -> tuple[SharedPrefixBatch, torch.Tensor] | None:
    """``rows`` of a rollout with the samples of each prompt packed behind it (``core.pack_groups``),
    and the packed response of each row; None when ``shared`` is off or does not pay for these rows."""
    if shared is None or not shared.enabled:
        return None
    if not shared.always:  # decide from the shapes alone; build the packed batch only when it pays
        shape = packed_group_shape(rollout.prompt_mask[rows], rollout.response_mask[rows], rollout.prompt_index[rows])
        if shape is None or not shared.pays(*rollout.input_ids[rows].shape, *shape):
            return None
    return pack_groups(
        rollout.prompt_ids[rows],
        rollout.prompt_mask[rows],
        rollout.response_ids[rows],
        rollout.response_mask[rows],
        rollout.prompt_index[rows],
    )


def prompt_cache_applies(model: nn.Module, shared: SharedPrefix | None) -> bool:
    """Run these rows with each prompt once through the KV cache? Only with ``shared.prompt_cache`` and
    without gradient checkpointing (which turns the cache off in a training forward)."""
    return shared is not None and shared.prompt_cache and not checkpointing_on(model)


def unpack_rows(values: torch.Tensor | None, response_of_row: torch.Tensor, response_length: int):
    """[N, T'] per packed response → [b, T] per rollout row (0 past T': positions no mask selects)."""
    if values is None:
        return None
    rows = values[response_of_row.to(values.device)]
    return torch.nn.functional.pad(rows, (0, response_length - rows.shape[1]))
