"""Rollout with Hugging Face ``generate``: KV cache, left-padded prompts, log-probs kept while sampling.

The sampling log-probs are log_softmax(raw logits / τ) at the sampled token, the same quantity the
training forward recomputes with ``core.token_logprobs`` (PITFALLS #4). They are taken before
top-k/top-p and before min-new-tokens forbids EOS: those change which token is drawn, not the
policy's probability of it. The recorder keeps one [B, V] row of logits at a time (the token drawn
at step t is only known at step t + 1), never the [B, T, V] of ``output_logits=True``.
"""

from __future__ import annotations

import torch
from torch import nn

from posttrain.core import token_logprobs
from posttrain.rollout.base import Rollout, SamplingParams, build_rollout, left_pad


class _SamplingLogprobs:
    """A logits processor that records log π(token) of every drawn token, at temperature τ.

    Placed first among the custom processors, which transformers applies before its own temperature,
    top-k and top-p warpers, so it sees the model's raw logits.
    """

    def __init__(self, temperature: float, prompt_length: int):
        self.temperature = temperature
        self.prompt_length = prompt_length
        self.pending: torch.Tensor | None = None  # logits [B, V] of the step whose token is not drawn yet
        self.logprobs: list[torch.Tensor] = []

    def _record(self, drawn: torch.Tensor) -> None:
        self.logprobs.append(token_logprobs(self.pending[:, None, :], drawn[:, None], self.temperature)[:, 0])

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if input_ids.shape[1] > self.prompt_length:
            self._record(input_ids[:, -1])
        self.pending = scores.detach().clone()
        return scores

    def finish(self, sequences: torch.Tensor) -> torch.Tensor:
        """Record the last drawn token; returns [B, T] log-probs."""
        if len(self.logprobs) < sequences.shape[1] - self.prompt_length:
            self._record(sequences[:, -1])
        return torch.stack(self.logprobs, dim=1)


class _StopStringPositions:
    """Stopping criterion that stops a row at a stop string and remembers the step it did."""

    def __init__(self, tokenizer, stop_strings: list[str], batch_size: int, prompt_length: int, device):
        from transformers.generation.stopping_criteria import StopStringCriteria

        self.inner = StopStringCriteria(tokenizer=tokenizer, stop_strings=stop_strings)
        self.prompt_length = prompt_length
        self.positions = torch.full((batch_size,), -1, dtype=torch.long, device=device)

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        done = self.inner(input_ids, scores, **kwargs)
        step = input_ids.shape[1] - self.prompt_length - 1
        self.positions = torch.where(done & (self.positions < 0), step, self.positions)
        return done


def eos_token_ids(tokenizer, model: nn.Module | None = None, extra: list[int] | None = None) -> list[int]:
    """Every EOS id: the tokenizer's, the model's generation config's (an int or a list), and ``extra``."""
    ids = set(extra or [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    generation_config = getattr(model, "generation_config", None)
    config_eos = getattr(generation_config, "eos_token_id", None)
    if isinstance(config_eos, int):
        ids.add(config_eos)
    elif config_eos is not None:
        ids.update(config_eos)
    if not ids:
        raise ValueError("no EOS token id: the tokenizer and the generation config define none")
    return sorted(ids)


class HFEngine:
    """Rollout engine on ``model.generate`` (CPU or GPU, any transformers causal LM, peft models too)."""

    def __init__(self, model: nn.Module, tokenizer):
        self.model = model
        self.tokenizer = tokenizer

    def generate(self, prompts: list[list[int]], params: SamplingParams, n: int = 1) -> Rollout:
        """Sample ``n`` responses to each prompt (token-id lists); rows of one prompt are consecutive."""
        from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList
        from transformers.generation.logits_process import MinNewTokensLengthLogitsProcessor

        params.validate()
        stop_ids = eos_token_ids(self.tokenizer, self.model, params.stop_token_ids)
        rows = [list(p) for p in prompts for _ in range(n)]
        device = next(self.model.parameters()).device
        prompt_ids, prompt_mask = left_pad(rows, self.tokenizer.pad_token_id)
        prompt_ids, prompt_mask = prompt_ids.to(device), prompt_mask.to(device)
        P = prompt_ids.shape[1]

        # A fresh config: sampling defaults saved with a checkpoint (top_k=20, repetition_penalty...)
        # must not change the distribution behind the user's back.
        greedy = params.temperature == 0
        generation_config = GenerationConfig(
            do_sample=not greedy,
            temperature=None if greedy else params.temperature,
            top_k=params.top_k or None,
            top_p=None if greedy else params.top_p,
            max_new_tokens=params.max_new_tokens,
            eos_token_id=stop_ids,
            pad_token_id=self.tokenizer.pad_token_id,
            use_cache=True,
        )
        recorder = _SamplingLogprobs(params.logprob_temperature, P)
        processors = [recorder]
        if params.min_new_tokens > 0:
            processors.append(MinNewTokensLengthLogitsProcessor(P, params.min_new_tokens, stop_ids, device=device))
        criteria = []
        if params.stop_strings:
            stops = _StopStringPositions(self.tokenizer, params.stop_strings, len(rows), P, device)
            criteria.append(stops)

        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                sequences = self.model.generate(
                    input_ids=prompt_ids,
                    attention_mask=prompt_mask,
                    generation_config=generation_config,
                    logits_processor=LogitsProcessorList(processors),
                    stopping_criteria=StoppingCriteriaList(criteria),
                )
        finally:
            self.model.train(was_training)

        stop_positions = stops.positions if params.stop_strings else None
        return build_rollout(
            self.tokenizer,
            rows,
            sequences[:, P:],
            stop_ids,
            stop_positions,
            recorder.finish(sequences),
            n,
            params.logprob_temperature,
            (prompt_ids, prompt_mask),
        )
