"""Shared-prefix packing: a prompt laid out once, followed by all of its responses, in one row.

A DPO pair (chosen, rejected), a reward-model ranking (K responses) and a GRPO group (G samples) run
the same prompt through the model once per response in the padded layout. Packed, row r holds the
prompt x (length P) and the responses y_1 … y_K (lengths n_1 … n_K):

    input_ids     x_0 … x_{P−1} | y_1,0 … y_1,n_1−1 | y_2,0 … y_2,n_2−1 | pad …
    position_ids  0   … P−1     | P     … P+n_1−1   | P     … P+n_2−1   | 0 …
    segment_ids   0   … 0       | 1     … 1         | 2     … 2         | −1 …

and the attention mask lets a response token attend to the prompt and causally to the earlier tokens
of its own response only (never to another response, never to padding). Every response then sees
exactly the context and the positions it has alone, so its log-probs and its reward-model score equal
the padded forward's up to float rounding, while the prompt's tokens are computed once instead of K
times. The tokens of response k ≥ 2 are not preceded by the prompt in the row: the first token of
every response is scored by the logits at the prompt's last position P − 1, the others by the
logits just before them.

Shapes: R packed rows (one prompt each), L packed length, N responses in all (row-major: the
responses of row 0 in order, then those of row 1, …), T the longest response, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from posttrain.core.logprobs import token_logprobs

PROMPT_SEGMENT = 0
PAD_SEGMENT = -1


@dataclass
class SharedPrefixBatch:
    """Prompts each followed by their responses, right-padded to one length.

    input_ids, position_ids, segment_ids: [R, L] (segment 0 = prompt, k ≥ 1 = response k, −1 = padding).
    prompt_lengths: [R]. response_rows, response_starts, response_lengths: [N], the row of response n,
    its first position in that row and its token count (≥ 1). The two numbers are known when packing,
    so that a forward never waits for the device to read them: ``first_logit_position`` = min over rows
    of P − 1 (the logits before it are never needed), ``longest_response`` = T.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    segment_ids: torch.Tensor
    prompt_lengths: torch.Tensor
    response_rows: torch.Tensor
    response_starts: torch.Tensor
    response_lengths: torch.Tensor
    first_logit_position: int
    longest_response: int

    def to(self, device) -> SharedPrefixBatch:
        moved = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in vars(self).items()}
        return SharedPrefixBatch(**moved)

    @property
    def num_tokens(self) -> int:
        """Real (non-padding) tokens: what the model computes besides padding."""
        return int((self.segment_ids != PAD_SEGMENT).sum())


def pack_shared_prefix(prompts: list[list[int]], responses: list[list[list[int]]], pad_id: int) -> SharedPrefixBatch:
    """One row per prompt: ``prompts[r]``, then each of ``responses[r]`` (at least one, none empty).

    Padding gets position 0 and segment −1. Returns a ``SharedPrefixBatch`` of R = len(prompts) rows.
    """
    if len(prompts) != len(responses):
        raise ValueError(f"{len(prompts)} prompts but {len(responses)} lists of responses")
    rows = [p + [t for r in rs for t in r] for p, rs in zip(prompts, responses, strict=True)]
    length = max(len(row) for row in rows)
    shape = (len(rows), length)
    input_ids = torch.full(shape, pad_id, dtype=torch.long)
    position_ids = torch.zeros(shape, dtype=torch.long)
    segment_ids = torch.full(shape, PAD_SEGMENT, dtype=torch.long)
    starts, lengths, owners = [], [], []
    for r, (prompt, row) in enumerate(zip(prompts, rows, strict=True)):
        if not prompt or not responses[r] or min(len(y) for y in responses[r]) == 0:
            raise ValueError(f"row {r}: shared-prefix packing needs a prompt and non-empty responses")
        input_ids[r, : len(row)] = torch.tensor(row, dtype=torch.long)
        position_ids[r, : len(prompt)] = torch.arange(len(prompt))
        segment_ids[r, : len(prompt)] = PROMPT_SEGMENT
        start = len(prompt)
        for k, response in enumerate(responses[r], start=1):
            end = start + len(response)
            position_ids[r, start:end] = torch.arange(len(prompt), len(prompt) + len(response))
            segment_ids[r, start:end] = k
            starts.append(start)
            lengths.append(len(response))
            owners.append(r)
            start = end
    return SharedPrefixBatch(
        input_ids,
        position_ids,
        segment_ids,
        torch.tensor([len(p) for p in prompts]),
        torch.tensor(owners),
        torch.tensor(starts),
        torch.tensor(lengths),
        first_logit_position=min(len(p) for p in prompts) - 1,
        longest_response=max(lengths),
    )


def shared_prefix_attention_mask(segment_ids: torch.Tensor) -> torch.Tensor:
    """allowed[r, 0, i, j]: may position i attend to position j? [R, L] → [R, 1, L, L] bool.

    allowed = j ≤ i and (segment j is the prompt, or segment j = segment i), for real tokens i and j.
    A padding position attends to itself only: a query with nothing to attend to would give NaN in
    softmax attention, and NaN values times a zero weight are NaN in every other row of the layer.
    """
    length = segment_ids.shape[-1]
    positions = torch.arange(length, device=segment_ids.device)
    causal = positions[None, :] <= positions[:, None]  # [L, L]: key j ≤ query i
    query, key = segment_ids[:, :, None], segment_ids[:, None, :]  # [R, L, 1], [R, 1, L]
    same_context = (key == PROMPT_SEGMENT) | (key == query)
    real = (query != PAD_SEGMENT) & (key != PAD_SEGMENT)
    allowed = causal & same_context & real
    allowed = allowed | torch.eye(length, dtype=torch.bool, device=segment_ids.device)
    return allowed[:, None]


def response_index(batch: SharedPrefixBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(rows [N, 1], token positions [N, T], response_mask [N, T]) of each response's tokens.

    Position ``response_starts[n] + t`` of row ``response_rows[n]`` holds token t of response n;
    response_mask is 1 for t < its length. Positions past the length are clamped into the row (they
    hold other tokens: select with the mask).
    """
    t = torch.arange(batch.longest_response, device=batch.input_ids.device)
    positions = (batch.response_starts[:, None] + t).clamp(max=batch.input_ids.shape[1] - 1)
    return batch.response_rows[:, None], positions, t < batch.response_lengths[:, None]


def shared_prefix_token_logprobs(
    logits: torch.Tensor, batch: SharedPrefixBatch, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """log π(y_n,t | x, y_n,<t) of every response token, from the packed rows' logits.

    logits: [R, W, V], the logits of the last W positions of the rows (W = L for all of them; W ≥ L −
    ``first_logit_position``: every prompt's last position must be among them). Token t ≥ 1 of a response
    is scored by the logits at the position before it; token 0 by those at the prompt's last
    position P − 1 (``token_logprobs``, with the sampling temperature τ).
    Returns (logprobs [N, T], response_mask [N, T]); masked positions hold garbage.
    """
    offset = batch.input_ids.shape[1] - logits.shape[1]  # position of logits[:, 0]
    if batch.first_logit_position < offset:
        raise ValueError(f"logits start at position {offset}, after a prompt's last position")
    # log π of the token at position i + 1 given everything up to i, for i = offset … L − 2: [R, W − 1]
    following = token_logprobs(logits[:, :-1], batch.input_ids[:, offset + 1 :], temperature=temperature)
    rows, positions, response_mask = response_index(batch)
    later = following[rows, (positions - 1 - offset).clamp(min=0)]  # [N, T]; column 0 replaced below
    first_rows = batch.response_rows
    prompt_end = logits[first_rows, batch.prompt_lengths[first_rows] - 1 - offset]  # [N, V]
    first_tokens = batch.input_ids[first_rows, batch.response_starts]  # [N]
    first = token_logprobs(prompt_end[:, None], first_tokens[:, None], temperature=temperature)  # [N, 1]
    is_first = torch.arange(later.shape[1], device=later.device) == 0
    return torch.where(is_first, first, later), response_mask


def predictor_positions(batch: SharedPrefixBatch) -> torch.Tensor:
    """[N, T]: the position whose logits (or hidden state) predict each response token: the prompt's
    last position P − 1 for token 0, the position before it for the others (garbage past a
    response's length: select with ``response_index``'s mask)."""
    _, positions, _ = response_index(batch)
    prompt_end = (batch.prompt_lengths[batch.response_rows] - 1)[:, None]  # [N, 1]
    is_first = torch.arange(positions.shape[1], device=positions.device) == 0
    return torch.where(is_first, prompt_end, positions - 1)


def gather_at_predictors(values: torch.Tensor, batch: SharedPrefixBatch) -> torch.Tensor:
    """A per-position quantity of the packed rows read where each response token is predicted.

    values: [R, W, ...] for the last W positions (W ≥ L − ``first_logit_position``), e.g. the entropy
    of the next-token distribution [R, W] or hidden states [R, W, H]. Returns [N, T, ...].
    """
    offset = batch.input_ids.shape[1] - values.shape[1]
    return values[batch.response_rows[:, None], (predictor_positions(batch) - offset).clamp(min=0)]


def pack_groups(
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    response_ids: torch.Tensor,
    response_mask: torch.Tensor,
    prompt_index: torch.Tensor,
    pad_id: int = 0,
) -> tuple[SharedPrefixBatch, torch.Tensor] | None:
    """Sampled rows that answer the same prompt, packed: one row per prompt, then its responses.

    prompt_ids, prompt_mask: [B, P_len] (left-padded, 1 = prompt token); response_ids, response_mask:
    [B, T] (right-padded, 1 = response token); prompt_index: [B], rows with equal values share a
    prompt (a rollout's G samples). Returns (the packed batch, [B] the packed response of each row, in
    ``response_rows`` order), or None when a row has no response token (nothing to score there).
    """
    lengths = response_mask.sum(1).tolist()
    if min(lengths) == 0:
        return None
    groups: dict[int, list[int]] = {}
    for b, key in enumerate(prompt_index.tolist()):
        groups.setdefault(key, []).append(b)
    prompts, responses, order = [], [], []
    for rows in groups.values():
        prompts.append(prompt_ids[rows[0]][prompt_mask[rows[0]].bool()].tolist())
        responses.append([response_ids[b, : lengths[b]].tolist() for b in rows])
        order += rows
    response_of_row = torch.empty(len(order), dtype=torch.long)
    response_of_row[torch.tensor(order)] = torch.arange(len(order))
    return pack_shared_prefix(prompts, responses, pad_id), response_of_row


def packed_group_shape(
    prompt_mask: torch.Tensor, response_mask: torch.Tensor, prompt_index: torch.Tensor
) -> tuple[int, int] | None:
    """(rows, length) of ``pack_groups``' batch for these rows, without building it: one row per
    distinct ``prompt_index``, as long as the longest prompt + Σ responses of a group; None where
    ``pack_groups`` returns None (a row without a response token). What ``forward_cost`` needs to
    decide whether packing pays, at the cost of two sums: the decision runs on every micro-batch, and
    building the packed tensors only to compare their shape would cost a packing each time.

    prompt_mask [B, P_len], response_mask [B, T], prompt_index [B] as in ``pack_groups``.
    """
    lengths = response_mask.sum(1)
    if len(lengths) == 0 or int(lengths.min()) == 0:
        return None
    groups, inverse = torch.unique(prompt_index, return_inverse=True)
    totals = torch.zeros(len(groups), dtype=lengths.dtype).index_add_(0, inverse, lengths)
    first = torch.full((len(groups),), len(lengths), dtype=torch.long).scatter_reduce_(
        0, inverse, torch.arange(len(lengths)), "amin"
    )
    return len(groups), int((prompt_mask.sum(1)[first] + totals).max())


def response_last_positions(batch: SharedPrefixBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows [N], positions [N]) of each response's last token: where a reward model reads its score."""
    return batch.response_rows, batch.response_starts + batch.response_lengths - 1


def forward_cost(rows: int, length: int, params: int, attention_width: int) -> int:
    """Approximate FLOPs of a forward over ``rows`` × ``length`` tokens (padding included: it is computed).

        2·N·rows·L  +  4·w·rows·L²

    N = matmul parameters, w = Σ over layers of the attention width (heads × head dim): QKᵀ and the
    weighted sum of V cost 2·w each per (query, key) pair, and a dense mask computes every pair. Packing
    trades fewer tokens for longer rows; it pays when this cost falls (Kaplan et al. 2020, sec. 2.1).
    """
    return 2 * params * rows * length + 4 * attention_width * rows * length * length
