"""Rollout with Hugging Face ``generate``: KV cache, left-padded prompts, log-probs kept while sampling.

The sampling log-probs are log_softmax(raw logits / τ) at the sampled token, the same quantity the
training forward recomputes with ``core.token_logprobs`` (docs/pitfalls.md #4). They are taken before
top-k/top-p and before min-new-tokens forbids EOS: those change which token is drawn, not the
policy's probability of it. The recorder keeps one [B, V] row of logits at a time (the token drawn
at step t is only known at step t + 1), never the [B, T, V] of ``output_logits=True``.

What is sampled is softmax(logits / τ), then the user's top-k / top-p, and nothing else: every other
generation setting is neutral whatever the checkpoint's generation_config.json says (an instruct
checkpoint's top_k=20 or repetition penalty would change the distribution, and a repetition penalty
runs before the recorder, so it would also change the recorded log-probs).
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from posttrain.core import token_logprobs, truncated_logprobs
from posttrain.rollout.base import Rollout, SamplingParams, build_rollout, left_pad


class _SamplingLogprobs:
    """A logits processor that records log π(token) of every drawn token, at temperature τ.

    Placed first among the custom processors. transformers runs them after its own processors
    (repetition penalty, bad words, ...: all neutral here, see ``NEUTRAL_GENERATION``) and before its
    temperature, top-k and top-p warpers, so it sees the model's raw logits.
    """

    def __init__(self, temperature: float, prompt_length: int, truncation: tuple[int, float] | None = None):
        self.temperature = temperature
        self.prompt_length = prompt_length
        self.truncation = truncation  # (top_k, top_p): the log-prob of the truncated distribution drawn from
        self.pending: torch.Tensor | None = None  # logits [B, V] of the step whose token is not drawn yet
        self.logprobs: list[torch.Tensor] = []

    def _record(self, drawn: torch.Tensor) -> None:
        if self.truncation is None:
            self.logprobs.append(token_logprobs(self.pending[:, None, :], drawn[:, None], self.temperature)[:, 0])
        else:
            self.logprobs.append(truncated_logprobs(self.pending, drawn, self.temperature, *self.truncation))

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


# Every GenerationConfig field that changes which token is drawn or where a row ends, at its neutral
# value; ``sampling_generation_config`` sets the user's temperature, top_k, top_p and lengths on top.
# transformers fills each field left None from the checkpoint's generation_config.json and then from
# its global defaults (top_k=50), so "off" is written out wherever it has a value, and the
# checkpoint's config is kept out of ``generate`` (``_checkpoint_defaults_off``) for the fields whose
# only "off" is None (bad words, suppressed or forced tokens, sequence bias, watermarking, ...).
NEUTRAL_GENERATION = dict(
    num_beams=1,
    num_return_sequences=1,
    top_k=0,
    top_p=1.0,
    min_p=None,
    top_h=None,
    typical_p=1.0,
    epsilon_cutoff=0.0,
    eta_cutoff=0.0,
    repetition_penalty=1.0,
    encoder_repetition_penalty=1.0,
    no_repeat_ngram_size=0,
    encoder_no_repeat_ngram_size=0,
    bad_words_ids=None,
    sequence_bias=None,
    suppress_tokens=None,
    begin_suppress_tokens=None,
    forced_bos_token_id=None,
    forced_eos_token_id=None,
    min_length=0,  # min_new_tokens is our own processor, placed after the log-prob recorder
    length_penalty=1.0,
    exponential_decay_length_penalty=None,
    guidance_scale=None,
    watermarking_config=None,
    renormalize_logits=False,
    remove_invalid_values=False,
    stop_strings=None,
    max_time=None,
    constraints=None,
    force_words_ids=None,
    penalty_alpha=None,
    dola_layers=None,
)


def sampling_generation_config(params: SamplingParams, stop_ids: list[int], pad_token_id: int):
    """The GenerationConfig that samples exactly softmax(logits / τ) (then the user's top-k / top-p)."""
    from transformers import GenerationConfig

    greedy = params.temperature == 0
    return GenerationConfig(
        **{
            **NEUTRAL_GENERATION,
            "do_sample": not greedy,
            "temperature": 1.0 if greedy else params.temperature,
            "top_k": None if greedy else params.top_k,  # warpers never run when greedy; 0 would be warned about
            "top_p": 1.0 if greedy else params.top_p,
            "max_new_tokens": params.max_new_tokens,
            "eos_token_id": stop_ids,
            "pad_token_id": pad_token_id,
            "use_cache": True,
        }
    )


def ignored_checkpoint_sampling(model: nn.Module) -> dict:
    """The sampling settings of the checkpoint's generation_config.json (an instruct model's temperature,
    top_k, repetition penalty, ...) that differ from an empty GenerationConfig: posttrain does not apply
    them (the module docstring), and a run says so once at start."""
    from transformers import GenerationConfig

    configured = getattr(model, "generation_config", None)
    if configured is None:
        return {}
    default = GenerationConfig()
    keys = sorted({*NEUTRAL_GENERATION, "do_sample", "temperature"} - {"num_return_sequences"})
    return {k: getattr(configured, k, None) for k in keys if getattr(configured, k, None) != getattr(default, k, None)}


@contextlib.contextmanager
def _checkpoint_defaults_off(model: nn.Module):
    """Inside: the transformers model under ``model`` (itself, or the one a peft wrapper holds) has an
    empty generation config, so ``generate`` fills nothing from the checkpoint's."""
    from transformers import GenerationConfig, GenerationMixin

    generator = next(m for m in model.modules() if isinstance(m, GenerationMixin))
    saved = generator.generation_config
    generator.generation_config = GenerationConfig()
    try:
        yield
    finally:
        generator.generation_config = saved


class HFEngine:
    """Rollout engine on ``model.generate`` (CPU or GPU, any transformers causal LM, peft models too)."""

    logprobs_exact = True  # recorded from the very logits the training forward computes

    def __init__(self, model: nn.Module, tokenizer, truncated: bool = False):
        self.model = model
        self.tokenizer = tokenizer
        # rollout.behaviour_logprobs=truncated: the log-probs of the truncated distribution drawn from, which
        # the training forward does not compute (it recomputes π_old and weighs π_old/μ when asked)
        self.truncated = truncated
        if truncated:
            self.logprobs_exact = False

    def sync_weights(self, policy: nn.Module) -> None:
        """Nothing to do: the engine samples from the trained module itself."""

    def generating(self, policy: nn.Module):
        return contextlib.nullcontext()

    def generate(self, prompts: list[list[int]], params: SamplingParams, n: int = 1) -> Rollout:
        """Sample ``n`` responses to each prompt (token-id lists); rows of one prompt are consecutive."""
        from transformers import LogitsProcessorList, StoppingCriteriaList
        from transformers.generation.logits_process import MinNewTokensLengthLogitsProcessor

        params.validate()
        stop_ids = eos_token_ids(self.tokenizer, self.model, params.stop_token_ids)
        rows = [list(p) for p in prompts for _ in range(n)]
        device = next(self.model.parameters()).device
        prompt_ids, prompt_mask = left_pad(rows, self.tokenizer.pad_token_id)
        prompt_ids, prompt_mask = prompt_ids.to(device), prompt_mask.to(device)
        P = prompt_ids.shape[1]

        generation_config = sampling_generation_config(params, stop_ids, self.tokenizer.pad_token_id)
        truncation = None
        if self.truncated:  # greedy: a point mass, top-k 1
            truncation = (1, 1.0) if params.temperature == 0 else (params.top_k, params.top_p)
        recorder = _SamplingLogprobs(params.logprob_temperature, P, truncation)
        processors = [recorder]
        if params.min_new_tokens > 0:  # before the recorder when its log-probs are of what is drawn from
            forbid = MinNewTokensLengthLogitsProcessor(P, params.min_new_tokens, stop_ids, device=device)
            processors.insert(1 if truncation is None else 0, forbid)
        criteria = []
        if params.stop_strings:
            stops = _StopStringPositions(self.tokenizer, params.stop_strings, len(rows), P, device)
            criteria.append(stops)

        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad(), _checkpoint_defaults_off(self.model):
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
