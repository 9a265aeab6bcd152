"""The four RLHF roles on Hugging Face models: policy, reference, reward model and value model (critic).

Forward passes take one layout everywhere: ``input_ids`` [B, L] = prompt (left-padded, length P)
followed by the response (right-padded, length T), with an ``attention_mask`` that is 1 on real
tokens. Position ids always come from the attention mask (``position_ids_from_mask``), so a sequence
gets the same numbers alone, left-padded or right-padded (docs/pitfalls.md #6).
"""

from __future__ import annotations

import contextlib
import copy
import json
import sys
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from posttrain.core import entropy_from_logits, last_valid_index, position_ids_from_mask, token_logprobs
from posttrain.core.packing import (
    SharedPrefixBatch,
    gather_at_predictors,
    pack_shared_prefix,
    response_last_positions,
    shared_prefix_attention_mask,
    shared_prefix_token_logprobs,
)
from posttrain.errors import UserError
from posttrain.models.loading import (
    ModelConfig,
    cache_keyword,
    disable_dropout,
    is_peft_adapter,
    load_causal_lm,
    load_scalar_model,
    peft_wrapping,
    unwrap_model,
)
from posttrain.models.positions import last_positions, positions_per_row, read_positions

REFERENCE_ADAPTER = "reference"


# --------------------------------------------------------------------------------------------------
# Forward passes
# --------------------------------------------------------------------------------------------------


def _logits(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    keep: int,
    position_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Logits of the last ``keep`` positions (0 = all), [B, keep, V]; the last decoder layer runs
    at those positions only (``models.positions``).

    Packed rows pass their own ``position_ids`` and no attention mask: transformers then builds a
    block-diagonal causal mask from the restarts of the position ids.
    """
    if position_ids is not None:
        return model(input_ids=input_ids, position_ids=position_ids, use_cache=False, logits_to_keep=keep).logits
    read = last_positions(*input_ids.shape, keep, input_ids.device) if keep else None
    with read_positions(model, read):
        return model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids_from_mask(attention_mask),
            use_cache=False,
            logits_to_keep=keep,
        ).logits


def response_logits(
    model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, response_length: int
) -> torch.Tensor:
    """The logits that predict each of the last ``response_length`` tokens of each row, [B, T, V]: the
    token at position P + t is predicted by the logits at position P + t − 1 (a full-vocabulary
    divergence reads them whole; ``response_logprobs`` reads one entry each)."""
    return _logits(model, input_ids, attention_mask, response_length + 1)[:, :-1]


def response_logprobs(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_length: int,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log π(y_t | x, y_<t) of the last ``response_length`` tokens of each row, with logits / τ.

    input_ids, attention_mask: [B, L] (prompt then response); returns (logprobs [B, T], entropy [B, T]
    or None), T = response_length. Only the logits of the response positions are computed; the token
    at position P + t is scored by the logits at position P + t − 1. The entropy is a detached metric
    unless ``entropy_grad`` (an entropy bonus in the loss).
    """
    logits = response_logits(model, input_ids, attention_mask, response_length)  # [B, T, V]
    logprobs = token_logprobs(logits, input_ids[:, -response_length:], temperature=temperature)
    entropy = None
    if with_entropy:
        entropy = entropy_from_logits(logits if entropy_grad else logits.detach(), temperature=temperature)
    return logprobs, entropy


def sequence_logprobs(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    temperature: float = 1.0,
    position_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """log π(token_i | tokens_<i) at every position i ≥ 1 of each row, any padding side.

    input_ids, attention_mask: [B, L]; position_ids: [B, L] for packed rows (see ``_logits``).
    Returns [B, L] with 0 at position 0 (nothing predicts it); select with a completion mask (SFT,
    DPO) to sum or average. In a packed row the first token of each example is scored from the end
    of the one before: completion masks never cover it.
    """
    logits = _logits(model, input_ids, attention_mask, 0, position_ids)[:, :-1]  # keep=0: every position
    logprobs = token_logprobs(logits, input_ids[:, 1:], temperature=temperature)
    return torch.cat([torch.zeros_like(logprobs[:, :1]), logprobs], dim=1)


def _score_head(model: nn.Module) -> nn.Module:
    head = getattr(model, "score", None)
    if not isinstance(head, nn.Module):
        raise TypeError(
            f"{type(model).__name__} has no `score` head: reward and value models must be transformers "
            "*ForSequenceClassification / *ForTokenClassification models with num_labels=1"
        )
    return head


def _backbone(model: nn.Module) -> nn.Module:
    """The transformer without its task head (LlamaModel, Qwen2Model, ...); a LoRA model's has the adapter in it."""
    return (model.get_base_model() if is_peft_model(model) else model).base_model


def _hidden_states(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor | None = None,
    read: torch.Tensor | None = None,
) -> torch.Tensor:
    """Last hidden states [B, L, H]; position ids from the 2-D mask unless given (a 4-D mask, packed
    rows). ``read`` [B, k]: the only positions the caller reads (``models.positions``: elsewhere the
    last layer may be skipped, and the states there are not the model's)."""
    with read_positions(model, read):
        out = _backbone(model)(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids_from_mask(attention_mask) if position_ids is None else position_ids,
            use_cache=False,
        )
    return out.last_hidden_state  # [B, L, H]


def _read_scores(model: nn.Module, last_hidden: torch.Tensor) -> torch.Tensor:
    """The score head on the hidden states read for each sequence, [B, H] → [B], normalised when the
    checkpoint says so (``reward_normalization``)."""
    scores = _score_head(model)(last_hidden).squeeze(-1).float()
    normalization = getattr(model.config, "reward_normalization", None)
    if normalization:
        scores = (scores - normalization["mean"]) / normalization["std"]
    return scores


def sequence_scores(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Reward-model score of each sequence, read at its last attended token.

    input_ids, attention_mask: [B, L], any padding side. Returns [B]. The index comes from the
    attention mask, never from ``pad_token_id``, so it is right when pad == eos, when the response
    has no EOS, and when EOS appears inside the prompt (docs/pitfalls.md #8). A checkpoint whose config holds
    ``reward_normalization = {"mean": m, "std": s}`` (``posttrain rm`` with ``normalize_policy``)
    returns (score − m) / s.
    """
    last = last_valid_index(attention_mask).clamp(min=0)
    hidden = _hidden_states(model, input_ids, attention_mask, read=last[:, None])
    last_hidden = hidden[torch.arange(hidden.shape[0], device=hidden.device), last]  # [B, H]
    return _read_scores(model, last_hidden)


def token_values(
    model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, response_length: int
) -> torch.Tensor:
    """Critic values V(x, y_<t) for each response token t: the head read at the position just before it.

    The value of the state in which token t is chosen is computed from the hidden state that also
    predicts token t (position P + t − 1), aligned with ``response_logprobs``.
    input_ids, attention_mask: [B, L]; returns [B, T] in float32.
    """
    read = last_positions(*input_ids.shape, response_length + 1, input_ids.device)
    hidden = _hidden_states(model, input_ids, attention_mask, read=read)[:, -response_length - 1 : -1]  # [B, T, H]
    return _score_head(model)(hidden).squeeze(-1).float()


def token_scores(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """A token classifier's one logit at every position, [B, L] float32: a process reward model's score of
    the text up to and including token i (its head reads the hidden state at i, which has seen the step
    that token i ends). input_ids, attention_mask: [B, L], any padding side."""
    hidden = _hidden_states(model, input_ids, attention_mask)  # [B, L, H]
    return _score_head(model)(hidden).squeeze(-1).float()


# --------------------------------------------------------------------------------------------------
# Shared-prefix packing: a prompt once, then all of its responses, in one row (core.packing)
# --------------------------------------------------------------------------------------------------

SHARED_PREFIX_ATTENTION = ("sdpa", "eager")


def _attention_implementation(model: nn.Module) -> str:
    return unwrap_model(model).config._attn_implementation


def _packed_attention_mask(model: nn.Module, batch: SharedPrefixBatch) -> torch.Tensor:
    """The [R, 1, L, L] mask of ``core.packing.shared_prefix_attention_mask`` as the model's attention
    takes it. transformers passes a 4-D mask through unchanged (``masking_utils``): sdpa selects with
    a boolean one (True = attend), eager *adds* its mask to the scores, so it gets 0 / float32's
    minimum (a boolean mask there would add 1 to the allowed scores and mask nothing)."""
    allowed = shared_prefix_attention_mask(batch.segment_ids)
    if _attention_implementation(model) == "eager":
        return torch.where(allowed, 0.0, torch.finfo(torch.float32).min)
    return allowed


def shared_prefix_logprobs(
    model: nn.Module,
    batch: SharedPrefixBatch,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """log π of every response token of packed rows: (logprobs [N, T], entropy [N, T] or None,
    response_mask [N, T]).

    One forward over the R rows of ``batch`` (``core.packing``: prompt once, then its responses, each
    attending to the prompt and to itself); the logits are computed from the earliest prompt end on
    only. Equal to ``response_logprobs`` of each (prompt, response) alone up to float rounding, for
    the models ``shared_prefix_unsupported`` accepts; the entropy likewise (a detached metric unless
    ``entropy_grad``).
    """
    keep = batch.input_ids.shape[1] - batch.first_logit_position
    with read_positions(model, last_positions(*batch.input_ids.shape, keep, batch.input_ids.device)):
        logits = model(
            input_ids=batch.input_ids,
            attention_mask=_packed_attention_mask(model, batch),
            position_ids=batch.position_ids,
            use_cache=False,
            logits_to_keep=keep,
        ).logits  # [R, keep, V]
    logprobs, response_mask = shared_prefix_token_logprobs(logits, batch, temperature)
    entropy = None
    if with_entropy:
        per_position = entropy_from_logits(logits if entropy_grad else logits.detach(), temperature=temperature)
        entropy = gather_at_predictors(per_position, batch)  # [N, T]
    return logprobs, entropy, response_mask


def prompt_cached_logprobs(
    model: nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    response_ids: torch.Tensor,
    prompt_index: torch.Tensor,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``response_logprobs`` of rows whose prompts repeat (a GRPO group's samples), each distinct prompt
    run once: (logprobs [b, T], entropy [b, T] or None).

    prompt_ids, prompt_mask: [b, P] (left-padded); response_ids: [b, T]; prompt_index: [b], rows with
    equal values share a prompt. One forward over the U distinct prompts fills a KV cache (and gives
    the logits that score each response's first token); its rows are then selected for the b
    responses, which run as a continuation of that cache, with gradients through both forwards. The
    same attention pattern as the padded layout (each response sees its prompt and itself causally),
    without the G − 1 repeated prompt computations, and without the dense-mask cost of packed rows.
    """
    from transformers import DynamicCache

    order = torch.arange(len(prompt_index), device=prompt_index.device)
    groups, group_of_row = torch.unique(prompt_index, return_inverse=True)
    first = torch.full((len(groups),), len(order), device=order.device).scatter_reduce_(0, group_of_row, order, "amin")
    ids, mask = prompt_ids[first], prompt_mask[first]  # [U, P]
    cache = DynamicCache(config=model.config)
    with read_positions(model, last_positions(*ids.shape, 1, ids.device)):  # the cache still gets every key
        prompt_out = model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=position_ids_from_mask(mask),
            **{cache_keyword(model): cache},
            use_cache=True,
            logits_to_keep=1,
        )
    logits = prompt_out.logits[:, -1][group_of_row][:, None]  # [b, 1, V]: scores each response's token 0
    if response_ids.shape[1] > 1:
        cache.batch_select_indices(group_of_row)
        rest = response_ids[:, :-1]
        attention = torch.cat([mask[group_of_row], torch.ones_like(rest, dtype=mask.dtype)], dim=1)
        start = mask.sum(1)[group_of_row][:, None]  # the prompt's own length: positions continue from it
        positions = start + torch.arange(rest.shape[1], device=rest.device)
        out = model(
            input_ids=rest,
            attention_mask=attention,
            position_ids=positions,
            use_cache=True,
            **{cache_keyword(model): cache},
        )
        logits = torch.cat([logits, out.logits], dim=1)  # [b, T, V]
    logprobs = token_logprobs(logits, response_ids, temperature=temperature)
    entropy = None
    if with_entropy:
        entropy = entropy_from_logits(logits if entropy_grad else logits.detach(), temperature=temperature)
    return logprobs, entropy


def shared_prefix_scores(model: nn.Module, batch: SharedPrefixBatch) -> torch.Tensor:
    """Reward-model score of every response of packed rows, read at its last token, [N].

    The *ForSequenceClassification head pools at a last non-pad token of its own choosing, which
    in a packed row is the last response's; the backbone's hidden states are read at each
    response's last position instead (``core.packing.response_last_positions``).
    """
    rows, positions = response_last_positions(batch)
    read = positions_per_row(rows, positions, batch.input_ids.shape[0])
    hidden = _hidden_states(model, batch.input_ids, _packed_attention_mask(model, batch), batch.position_ids, read)
    return _read_scores(model, hidden[rows, positions])


def shared_prefix_unsupported(model: nn.Module) -> str | None:
    """Why ``model`` cannot run shared-prefix rows exactly, or None when it can.

    A packed row needs the model to take a 4-D attention mask as given and to place tokens by
    ``position_ids``. Known not to: attention kernels other than sdpa and eager (flash-attention
    takes no mask, flex attention a BlockMask), and sliding-window or linear-attention layers (their
    own masks would be replaced). For the rest a probe decides: two small packed rows (prompts of 5
    and 3 tokens, responses of 3 + 2 and 1 tokens, padding) against each sequence alone; the last
    hidden states must agree within 1e-4 (float32) or 3e-2 (half precision) of their scale.
    """
    implementation = _attention_implementation(model)
    if implementation not in SHARED_PREFIX_ATTENTION:
        return f"attention implementation {implementation!r} takes no 4-D attention mask (sdpa and eager do)"
    text = model.config.get_text_config()
    layer_types = set(getattr(text, "layer_types", None) or ["full_attention"])
    if getattr(text, "sliding_window", None) is not None or layer_types != {"full_attention"}:
        return f"layers {sorted(layer_types)} / sliding_window: a 4-D mask would replace their own attention masks"
    return _probe_shared_prefix(model)


def _probe_shared_prefix(model: nn.Module) -> str | None:
    vocab = model.get_input_embeddings().num_embeddings
    parameter = next(model.parameters())
    tokens = lambda n, seed: [(seed + 7 * i) % vocab for i in range(n)]  # noqa: E731
    prompts = [tokens(5, 3), tokens(3, 41)]
    responses = [[tokens(3, 11), tokens(2, 29)], [tokens(1, 17)]]
    batch = pack_shared_prefix(prompts, responses, pad_id=0).to(parameter.device)
    tolerance = 1e-4 if parameter.dtype in (torch.float32, torch.float64) else 3e-2
    with torch.no_grad():
        packed = _hidden_states(model, batch.input_ids, _packed_attention_mask(model, batch), batch.position_ids)
        n = 0
        for r, prompt in enumerate(prompts):
            for response in responses[r]:
                ids = torch.tensor([prompt + response], device=parameter.device)
                alone = _hidden_states(model, ids, torch.ones_like(ids))[0, len(prompt) :]
                start = int(batch.response_starts[n])
                got = packed[r, start : start + len(response)]
                error = (got - alone).abs().max().item() / max(1.0, alone.abs().max().item())
                if not error <= tolerance:  # `not <=`: a NaN fails too
                    return f"a probe of packed rows differs from the sequences alone (relative error {error:.2g})"
                n += 1
    return None


class _ScalarRole(nn.Module):
    """A reward or value model behind a ``forward`` that returns what a trainer needs from it.

    accelerate wraps a trained model (DDP, FSDP) and synchronises gradients only through the
    wrapper's ``forward``; ``sequence_scores`` and ``token_values`` read the backbone and the head
    separately, so the trained reward model or critic is prepared as this module and called as
    ``model(input_ids, attention_mask, ...)``. Saves as the inner Hugging Face model.
    """

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def save_pretrained(self, path, state_dict: dict | None = None, **kwargs) -> None:
        state_dict = self.state_dict() if state_dict is None else state_dict
        inner = {k.removeprefix("model."): v for k, v in state_dict.items()}
        self.model.save_pretrained(path, state_dict=inner, **kwargs)


class RewardScorer(_ScalarRole):
    """``forward(input_ids, attention_mask)`` = ``sequence_scores`` of the reward model, [B];
    ``forward(packed=batch)`` = ``shared_prefix_scores`` of a ``SharedPrefixBatch``, [N]."""

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        packed: SharedPrefixBatch | None = None,
    ) -> torch.Tensor:
        if packed is not None:
            return shared_prefix_scores(self.model, packed)
        return sequence_scores(self.model, input_ids, attention_mask)


class ValueModel(_ScalarRole):
    """``forward(input_ids, attention_mask, response_length)`` = ``token_values`` of the critic, [B, T]."""

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, response_length: int) -> torch.Tensor:
        return token_values(self.model, input_ids, attention_mask, response_length)


class ProcessScorer(_ScalarRole):
    """``forward(input_ids, attention_mask)`` = ``token_scores`` of a process reward model, [B, L]."""

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return token_scores(self.model, input_ids, attention_mask)


# --------------------------------------------------------------------------------------------------
# Policy and reference
# --------------------------------------------------------------------------------------------------


def load_policy(config: ModelConfig) -> nn.Module:
    """The trained policy: a causal LM, a new LoRA adapter on one (``config.lora``), or an adapter
    trained before (``config.path`` holds adapter_config.json).

    A policy that starts from a trained adapter also loads that adapter a second time, frozen, as
    ``"reference"``: the reference is the adapter's starting state, not the bare base model, so KL
    is 0 at step 0 (docs/pitfalls.md #11).
    """
    config.validate("policy")
    if is_peft_adapter(config.path):
        from peft import PeftModel

        adapter_config = json.loads((Path(config.path) / "adapter_config.json").read_text())
        base_config = copy.copy(config)
        base_config.path = adapter_config["base_model_name_or_path"]
        base = load_causal_lm(base_config)
        with peft_wrapping():
            model = PeftModel.from_pretrained(base, config.path, is_trainable=True)
            model.load_adapter(config.path, adapter_name=REFERENCE_ADAPTER, is_trainable=False)
        model.set_adapter("default")
        model.train()  # loading the frozen adapter put the whole model in eval mode: no checkpointing there
        return disable_dropout(model)
    model = load_causal_lm(config)
    if config.lora is not None:
        from peft import LoraConfig, get_peft_model

        lora = {"task_type": "CAUSAL_LM", **config.lora}
        with peft_wrapping():
            model = disable_dropout(get_peft_model(model, LoraConfig(**lora)))
        model.peft_config["default"].base_model_name_or_path = adapter_base(config.path)
    return model


def adapter_base(path: str) -> str:
    """The base model path a new adapter stores: absolute for a local folder (a relative one breaks
    from any other working directory), as given for a Hub id."""
    return str(Path(path).resolve()) if Path(path).exists() else path


def is_peft_model(model: nn.Module) -> bool:
    """Whether ``model`` is a peft ``PeftModel``. Without importing peft: a PeftModel exists only once
    peft has been imported, and importing it only to answer no costs peak memory (bench/README.md)."""
    peft_model = getattr(sys.modules.get("peft"), "PeftModel", None)
    return peft_model is not None and isinstance(model, peft_model)


class Reference:
    """The frozen reference policy π_ref.

    Either a separate frozen model (``Reference(model=...)``) or the policy itself with its adapter
    switched (``Reference.from_policy``): LoRA without a second copy of the weights, the adapter off
    for a new adapter, the frozen ``"reference"`` adapter for a policy that started from one.
    Use ``with reference.model_for_forward() as m:`` to run it; gradients are off inside.
    """

    def __init__(self, model: nn.Module | None = None, policy: nn.Module | None = None):
        if (model is None) == (policy is None):
            raise ValueError("Reference needs exactly one of model= (a frozen copy) or policy= (shared weights)")
        self.model = model
        self.policy = policy
        if model is not None:
            disable_dropout(model)
            model.eval()
            model.requires_grad_(False)

    @classmethod
    def from_policy(cls, policy: nn.Module, share: str = "auto") -> Reference:
        """share="auto": the adapter-off (or reference-adapter) policy when it is a peft model, else a
        frozen deep copy; "copy" forces the copy; "adapter" requires a peft policy."""
        if share not in ("auto", "copy", "adapter"):
            raise ValueError(f"reference share must be 'auto', 'copy' or 'adapter', got {share!r}")
        peft = is_peft_model(policy)
        if share == "adapter" and not peft:
            raise ValueError("reference share='adapter' needs a LoRA (peft) policy")
        if peft and share != "copy":
            return cls(policy=policy)
        return cls(model=copy.deepcopy(policy))

    @property
    def shares_policy_weights(self) -> bool:
        return self.policy is not None

    @contextlib.contextmanager
    def model_for_forward(self) -> Iterator[nn.Module]:
        with torch.no_grad():
            if self.model is not None:
                yield self.model
            elif REFERENCE_ADAPTER in self.policy.peft_config:
                active = self.policy.active_adapter
                self.policy.set_adapter(REFERENCE_ADAPTER, inference_mode=True)
                try:
                    yield self.policy
                finally:
                    self.policy.set_adapter(active)
            else:
                with self.policy.disable_adapter():
                    yield self.policy

    def logprobs(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, response_length: int, temperature: float = 1.0
    ) -> torch.Tensor:
        """log π_ref of the response tokens, [B, T] (see ``response_logprobs``)."""
        with self.model_for_forward() as model:
            device = next(model.parameters()).device
            logprobs, _ = response_logprobs(
                model, input_ids.to(device), attention_mask.to(device), response_length, temperature
            )
        return logprobs.to(input_ids.device)

    def response_logits(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, response_length: int):
        """The logits [B, T, V] that predict the response tokens (``response_logits``), on the inputs' device."""
        with self.model_for_forward() as model:
            device = next(model.parameters()).device
            logits = response_logits(model, input_ids.to(device), attention_mask.to(device), response_length)
        return logits.to(input_ids.device)

    def prompt_cached_logprobs(self, prompt_ids, prompt_mask, response_ids, prompt_index, temperature=1.0):
        """log π_ref of the response tokens, [b, T], each distinct prompt run once (``prompt_cached_logprobs``)."""
        with self.model_for_forward() as model:
            device = next(model.parameters()).device
            args = (t.to(device) for t in (prompt_ids, prompt_mask, response_ids, prompt_index))
            logprobs, _ = prompt_cached_logprobs(model, *args, temperature=temperature)
        return logprobs.to(response_ids.device)

    def shared_prefix_logprobs(self, batch: SharedPrefixBatch, temperature: float = 1.0) -> torch.Tensor:
        """log π_ref of the responses of packed rows, [N, T] (see ``shared_prefix_logprobs``)."""
        with self.model_for_forward() as model:
            device = next(model.parameters()).device
            logprobs, _, _ = shared_prefix_logprobs(model, batch.to(device), temperature)
        return logprobs.to(batch.input_ids.device)


# --------------------------------------------------------------------------------------------------
# Reward model and critic
# --------------------------------------------------------------------------------------------------

CRITIC_INITS = ("reward", "policy")


def load_reward_model(config: ModelConfig) -> nn.Module:
    """Frozen reward model (sequence classifier, num_labels=1, dropout off); score with ``sequence_scores``."""
    model = load_scalar_model(config, "reward", new_head=False, what="reward_model.path")
    model.eval()
    model.requires_grad_(False)
    return model


PROCESS_REWARD_KEY = "process_reward"  # a PRM's config.json entry: {"step_separator": ...}, written by posttrain prm


def load_process_reward_model(path: str, device: str, dtype: str = "auto") -> nn.Module:
    """A frozen process reward model as ``posttrain prm`` writes it: a *ForTokenClassification (num_labels=1,
    dropout off) whose config.json names its step separator (``process_reward``); score with ``token_scores``."""
    what = "process_reward_model.path"
    try:
        model = load_scalar_model(ModelConfig(path, device=device, dtype=dtype), "value", new_head=False, what=what)
    except ValueError as err:  # a checkpoint of another kind (a reward model, a policy): the user's to fix
        raise UserError(str(err)) from err
    if not isinstance(getattr(model.config, PROCESS_REWARD_KEY, None), dict):
        raise UserError(
            f"{what}={path}: not a process reward model (its config.json has no {PROCESS_REWARD_KEY!r} entry); "
            "posttrain prm writes one, to RUN/final/process_reward"
        )
    model.eval()
    model.requires_grad_(False)
    return model


def check_reward_critic(reward: ModelConfig) -> None:
    """Refuse a critic started from a LoRA reward model (an adapter folder): transformers loads the
    adapter frozen, so the critic would train its score head alone, and saving it needed a newer peft
    (a new-user trial's run crashed at its first checkpoint)."""
    if is_peft_adapter(reward.path):
        raise ValueError(
            f"critic=reward with a LoRA reward model ({reward.path} holds an adapter): a critic started from it "
            "would train its score head only; use critic=policy or critic=shared, or merge the adapter into "
            "the reward model (peft's merge_and_unload) and point reward_model.path at the merged model"
        )


def load_critic(init_from: str, policy: ModelConfig, reward: ModelConfig | None = None) -> nn.Module:
    """The value model: a token classifier (num_labels=1) whose backbone starts from the reward model
    (default in RLHF-PPO: it already reads the reward's features; Huang et al. 2022, detail "critic
    initialised from the reward model") or from the policy. From a reward checkpoint the head keeps
    the reward's ``score`` weights (bias 0); from a policy the head is newly initialised (normal,
    std = initializer_range; bias 0). It saves with ``save_pretrained`` and reloads with
    ``load_scalar_model(ModelConfig(path=...), "value")``.
    """
    if init_from not in CRITIC_INITS:
        raise ValueError(f"critic init_from must be one of {CRITIC_INITS}, got {init_from!r}")
    if init_from == "reward" and reward is None:
        raise ValueError("critic init_from='reward' needs a reward model config")
    if init_from == "reward":
        check_reward_critic(reward)
    source = reward if init_from == "reward" else policy
    config = copy.copy(source)
    config.lora = None
    return load_scalar_model(config, "value")


class PolicyWithValueHead(nn.Module):
    """A causal LM and a one-output value head on its last hidden state: policy and critic share the
    backbone (one forward pass gives both). The head starts at zero output (weight and bias 0), so
    the first values are 0 and GAE starts from the plain reward-to-go. Saved as the policy's own
    Hugging Face checkpoint plus ``value_head.safetensors`` beside it.
    """

    def __init__(self, policy: nn.Module):
        super().__init__()
        self.policy = policy
        hidden = policy.config.get_text_config().hidden_size
        self.v_head = nn.Linear(hidden, 1)
        nn.init.zeros_(self.v_head.weight)
        nn.init.zeros_(self.v_head.bias)

    def forward(
        self,
        input_ids,
        attention_mask,
        response_length: int,
        temperature: float = 1.0,
        with_entropy: bool = False,
        entropy_grad: bool = False,
    ):
        """(logprobs [B, T], values [B, T], entropy [B, T] or None) of the response tokens."""
        out = self.backbone(input_ids, attention_mask)
        logits = out.logits[:, -response_length - 1 : -1]
        logprobs = token_logprobs(logits, input_ids[:, -response_length:], temperature=temperature)
        values = self.head_values(out.hidden_states[-1][:, -response_length - 1 : -1])
        entropy = None
        if with_entropy:
            entropy = entropy_from_logits(logits if entropy_grad else logits.detach(), temperature=temperature)
        return logprobs, values, entropy

    def backbone(self, input_ids, attention_mask):
        """The policy's forward with its hidden states: the logits and the value head's input in one pass."""
        return self.policy(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids_from_mask(attention_mask),
            use_cache=False,
            output_hidden_states=True,
        )

    def head_values(self, hidden):
        """V(s_t) [B, T] from the last hidden states [B, T, H] of the positions that predict the response tokens."""
        return self.v_head(hidden.to(self.v_head.weight.dtype)).squeeze(-1).float()

    def save_pretrained(self, path, state_dict: dict | None = None, **kwargs) -> None:
        from safetensors.torch import save_file

        state_dict = self.state_dict() if state_dict is None else state_dict
        policy_state = {k.removeprefix("policy."): v for k, v in state_dict.items() if k.startswith("policy.")}
        self.policy.save_pretrained(path, state_dict=policy_state, **kwargs)
        head = {k.removeprefix("v_head."): v.contiguous() for k, v in state_dict.items() if k.startswith("v_head.")}
        save_file(head, str(Path(path) / "value_head.safetensors"))
