"""What every rollout engine takes (``SamplingParams``) and returns (``Rollout``)."""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import nn

from posttrain.sections import remembers_given


@remembers_given  # a trainer's sampling defaults hold for SamplingParams(...) built in Python
@dataclass
class SamplingParams:
    """How responses are sampled."""

    max_new_tokens: int = 64
    """Most tokens generated per response; a response that reaches it without EOS is truncated."""
    min_new_tokens: int = 0
    """EOS is forbidden before this many tokens (the sampler's choice only: log-probs stay those of
    the full distribution, as the training forward computes them)."""
    temperature: float = 1.0
    """Softmax temperature τ; 0 means greedy. Training log-probs are computed with the same τ."""
    top_p: float = 1.0
    """Nucleus sampling mass; 1.0 = off."""
    top_k: int = 0
    """Keep the k most likely tokens; 0 = off."""
    stop_strings: list[str] = field(default_factory=list)
    """Strings that end a response (the response keeps them)."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Token ids that end a response, besides every EOS id of the tokenizer and generation config."""

    def validate(self, name: str = "sampling") -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"{name}.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise ValueError(f"{name}.min_new_tokens must be in [0, max_new_tokens], got {self.min_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"{name}.temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"{name}.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"{name}.top_k must be >= 0 (0 = off), got {self.top_k}")

    @property
    def logprob_temperature(self) -> float:
        """τ to divide logits by when computing log-probs: the sampling τ, or 1 for greedy decoding."""
        return self.temperature if self.temperature > 0 else 1.0


@dataclass
class Rollout:
    """Sampled responses, B = P·G rows (the G samples of one prompt are consecutive rows).

    Layout of one row: ``prompt_ids`` left-padded to P_len, then ``response_ids`` right-padded to T.
    """

    prompt_ids: torch.Tensor  # [B, P_len] long, left-padded
    prompt_mask: torch.Tensor  # [B, P_len] long, 1 = prompt token
    response_ids: torch.Tensor  # [B, T] long, right-padded
    response_mask: torch.Tensor  # [B, T] long, 1 up to and including the first EOS / stop, 0 after
    logprobs: torch.Tensor | None  # [B, T] float32 sampling log-probs log_softmax(logits/τ); None = recompute
    truncated: torch.Tensor  # [B] bool, True = stopped by max_new_tokens without EOS or stop string
    prompt_index: torch.Tensor  # [B] long, which prompt of the batch each row answers
    prompts: list[str]  # [B] decoded prompt texts
    responses: list[str]  # [B] decoded response texts (special tokens removed)
    group_size: int = 1  # G
    temperature: float = 1.0  # τ the log-probs were taken at
    columns: dict[str, list] = field(default_factory=dict)  # the prompt rows' other columns ("answer"), [B] each
    version: torch.Tensor | None = None  # [B] long, the policy version (trainer steps done) that drew each row
    sampled_mask: torch.Tensor | None = None  # [B, T] long, 1 on the tokens the policy sampled; None = all of
    # response_mask. Episodes (posttrain.envs) hold the environment's tokens too: in response_mask, not in this

    @property
    def input_ids(self) -> torch.Tensor:
        """[B, P_len + T] prompt then response."""
        return torch.cat([self.prompt_ids, self.response_ids], dim=1)

    @property
    def attention_mask(self) -> torch.Tensor:
        """[B, P_len + T] 1 on prompt tokens and on response tokens up to the end of the response."""
        return torch.cat([self.prompt_mask, self.response_mask], dim=1)

    @property
    def action_mask(self) -> torch.Tensor:
        """[B, T] the tokens every loss and statistic counts: those the policy sampled (``sampled_mask``), or
        the whole response when every response token was sampled (one turn)."""
        return self.response_mask if self.sampled_mask is None else self.sampled_mask

    @property
    def response_length(self) -> int:
        return self.response_ids.shape[1]

    @property
    def response_lengths(self) -> torch.Tensor:
        """[B] number of tokens the policy sampled (an episode's environment tokens are not counted)."""
        return self.action_mask.sum(dim=1)

    def __len__(self) -> int:
        return self.response_ids.shape[0]

    def select(self, rows: list[int]) -> Rollout:
        """The rows ``rows`` (in that order), every field sliced alike."""
        index = torch.tensor(rows, dtype=torch.long, device=self.response_ids.device)
        return Rollout(
            prompt_ids=self.prompt_ids[index],
            prompt_mask=self.prompt_mask[index],
            response_ids=self.response_ids[index],
            response_mask=self.response_mask[index],
            logprobs=None if self.logprobs is None else self.logprobs[index],
            truncated=self.truncated[index],
            prompt_index=self.prompt_index[index],
            prompts=[self.prompts[i] for i in rows],
            responses=[self.responses[i] for i in rows],
            group_size=self.group_size,
            temperature=self.temperature,
            columns={k: [v[i] for i in rows] for k, v in self.columns.items()},
            version=None if self.version is None else self.version[index.to(self.version.device)],
            sampled_mask=None if self.sampled_mask is None else self.sampled_mask[index],
        )

    def texts(self, tokenizer, row: int) -> tuple[str, str]:
        """(prompt, response) of ``row`` as the model read and wrote them: special tokens kept (the chat
        template, ``<|im_end|>``), padding left out."""
        prompt = self.prompt_ids[row][self.prompt_mask[row].bool()]
        response = self.response_ids[row][self.response_mask[row].bool()]
        return tokenizer.decode(prompt), tokenizer.decode(response)


def build_rollout(
    tokenizer,
    rows: list[list[int]],
    response_ids: torch.Tensor,
    stop_ids: list[int],
    stop_positions: torch.Tensor | None,
    logprobs: torch.Tensor | None,
    group_size: int,
    temperature: float,
    padded_prompts: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> Rollout:
    """A ``Rollout`` from the prompt rows (token lists, G consecutive copies of each prompt) and the
    right-padded response ids an engine produced: masks, truncation flags and decoded texts.
    ``padded_prompts`` = (ids, mask) when the engine already left-padded the rows."""
    device = response_ids.device
    prompt_ids, prompt_mask = padded_prompts or left_pad(rows, tokenizer.pad_token_id)
    response_mask, truncated = response_mask_from_ends(response_ids, stop_ids, stop_positions)
    return Rollout(
        prompt_ids=prompt_ids.to(device),
        prompt_mask=prompt_mask.to(device),
        response_ids=response_ids,
        response_mask=response_mask,
        logprobs=None if logprobs is None else torch.where(response_mask.bool(), logprobs, 0.0),
        truncated=truncated,
        prompt_index=torch.arange(len(rows) // group_size, device=device).repeat_interleave(group_size),
        prompts=[tokenizer.decode(r, skip_special_tokens=True) for r in rows],
        responses=[
            tokenizer.decode(ids[mask.bool()], skip_special_tokens=True)
            for ids, mask in zip(response_ids, response_mask, strict=True)
        ],
        group_size=group_size,
        temperature=temperature,
    )


def concat_rollouts(rollouts: list[Rollout], pad_id: int) -> Rollout:
    """One rollout from several: prompts re-padded on the left, responses on the right."""
    if len({r.group_size for r in rollouts}) != 1 or len({r.temperature for r in rollouts}) != 1:
        raise ValueError("only rollouts with the same group size and temperature can be joined")
    P = max(r.prompt_ids.shape[1] for r in rollouts)
    T = max(r.response_ids.shape[1] for r in rollouts)

    def pad(t: torch.Tensor, length: int, value, left: bool) -> torch.Tensor:
        extra = length - t.shape[1]
        fill = torch.full((t.shape[0], extra), value, dtype=t.dtype, device=t.device)
        return torch.cat([fill, t] if left else [t, fill], dim=1)

    offsets, total = [], 0
    for r in rollouts:
        offsets.append(total)
        total += int(r.prompt_index.max()) + 1 if len(r) else 0
    has_logprobs = all(r.logprobs is not None for r in rollouts)
    keys = sorted({k for r in rollouts for k in r.columns})
    return Rollout(
        prompt_ids=torch.cat([pad(r.prompt_ids, P, pad_id, True) for r in rollouts]),
        prompt_mask=torch.cat([pad(r.prompt_mask, P, 0, True) for r in rollouts]),
        response_ids=torch.cat([pad(r.response_ids, T, pad_id, False) for r in rollouts]),
        response_mask=torch.cat([pad(r.response_mask, T, 0, False) for r in rollouts]),
        logprobs=torch.cat([pad(r.logprobs, T, 0.0, False) for r in rollouts]) if has_logprobs else None,
        truncated=torch.cat([r.truncated for r in rollouts]),
        prompt_index=torch.cat([r.prompt_index + o for r, o in zip(rollouts, offsets, strict=True)]),
        prompts=[p for r in rollouts for p in r.prompts],
        responses=[x for r in rollouts for x in r.responses],
        group_size=rollouts[0].group_size,
        temperature=rollouts[0].temperature,
        columns={k: [x for r in rollouts for x in r.columns.get(k, [None] * len(r))] for k in keys},
        version=torch.cat([r.version for r in rollouts]) if all(r.version is not None for r in rollouts) else None,
        sampled_mask=None
        if all(r.sampled_mask is None for r in rollouts)
        else torch.cat([pad(r.action_mask, T, 0, False) for r in rollouts]),
    )


class RolloutEngine(Protocol):
    """What the trainers use to sample, and nothing else. Prompts are token-id lists (already templated).

    A trainer wraps each ``generate`` in ``generating(policy)`` (gather sharded parameters, wake a
    sleeping engine; release after) and calls ``sync_weights(policy)`` once the optimizer has changed
    the policy, before the next rollout.
    """

    logprobs_exact: bool
    """True when ``Rollout.logprobs`` are the training forward's log-probs (same weights, same kernels):
    the trainer then uses them as the old log-probs; otherwise it recomputes them and compares."""

    def generate(self, prompts: list[list[int]], params: SamplingParams, n: int = 1) -> Rollout: ...

    def sync_weights(self, policy: nn.Module) -> None: ...

    def generating(self, policy: nn.Module) -> AbstractContextManager: ...


class TokenScorer(Protocol):
    """A frozen model's log-probs of given token ids, without sampling (a vLLM engine's prompt log-probs, in
    this process or served): how a teacher in another engine or process grades the sampled tokens."""

    def score(self, sequences: list[list[int]], starts: list[int]) -> list[list[float]]:
        """log π(x_t | x_<t) of ``sequences[i][t]`` for t ≥ ``starts[i]`` (≥ 1), at temperature 1."""
        ...


def scored_logprobs(scorer: TokenScorer, rollout: Rollout) -> torch.Tensor:
    """log π(y_t | x, y_<t) [B, T] of every response token of ``rollout`` by ``scorer``: each row sent as its
    prompt then its response, padding left out (0 past the response, as the training forward's masks read it)."""
    sequences, starts = [], []
    for row in range(len(rollout)):
        prompt = rollout.prompt_ids[row][rollout.prompt_mask[row].bool()].tolist()
        response = rollout.response_ids[row][rollout.response_mask[row].bool()].tolist()
        sequences.append(prompt + response)
        starts.append(len(prompt))
    out = torch.zeros(rollout.response_ids.shape, dtype=torch.float32)
    for row, logprobs in enumerate(scorer.score(sequences, starts)):
        out[row, : len(logprobs)] = torch.tensor(logprobs, dtype=torch.float32)
    return out


def left_pad(sequences: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token lists → (ids [B, L] left-padded with ``pad_id``, mask [B, L] 1 on real tokens)."""
    length = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), length), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), length), dtype=torch.long)
    for i, s in enumerate(sequences):
        if s:
            ids[i, length - len(s) :] = torch.tensor(s, dtype=torch.long)
            mask[i, length - len(s) :] = 1
    return ids, mask


def response_mask_from_ends(
    response_ids: torch.Tensor, stop_ids: list[int], stop_positions: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mask up to and including the first stop token (any of ``stop_ids``) or stop-string end.

    response_ids: [B, T]; stop_positions: [B] index of the token that completed a stop string, −1 for
    none. Returns (response_mask [B, T] long, truncated [B] bool): truncated rows have neither.
    """
    B, T = response_ids.shape
    positions = torch.arange(T, device=response_ids.device).expand(B, T)
    is_stop = torch.isin(response_ids, torch.tensor(stop_ids, device=response_ids.device))
    first_stop = torch.where(is_stop, positions, T).min(dim=1).values  # T = no stop token
    if stop_positions is not None:
        first_stop = torch.minimum(first_stop, torch.where(stop_positions >= 0, stop_positions, T))
    truncated = first_stop >= T
    end = torch.where(truncated, T - 1, first_stop)
    return (positions <= end.unsqueeze(1)).long(), truncated
