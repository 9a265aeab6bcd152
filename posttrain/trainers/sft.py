"""Supervised fine-tuning: next-token loss on completion tokens only.

    L = − Σ_{completion tokens t} log π(y_t | x, y_<t)  /  (completion tokens of the optimizer step)

The mean is over every completion token of the optimizer step, not a mean of micro-batch means
(``loop.run_offline``). With ``packing`` several examples share a row; position ids restart for each
example and attention stays inside it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from posttrain.core import masked_sum
from posttrain.data import DataConfig, SequenceBatch, collate_packed, collate_sft, load_sft, pack_sft
from posttrain.models import ModelConfig, load_policy, sequence_logprobs
from posttrain.runtime.config import PLACED_BY_ACCELERATE, OptimConfig, RunConfig, reject_ignored, validate_sections
from posttrain.runtime.loop import Trainable, begin_offline, run_offline
from posttrain.runtime.runlock import holds_run_dir


@dataclass
class SFTConfig:
    """posttrain sft."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """The model to fine-tune (``model.lora`` for a LoRA adapter)."""
    data: DataConfig = field(default_factory=DataConfig)
    """SFT rows: {"prompt", "completion"} or {"messages"}."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer and schedule."""
    run: RunConfig = field(default_factory=RunConfig)
    """Steps, batches, logging, checkpoints."""
    packing: bool = False
    """Pack several examples into each row of data.max_length tokens (position ids reset per example)."""

    def validate(self) -> None:
        validate_sections(self)
        reject_ignored(self, {"model.device": PLACED_BY_ACCELERATE})
        if self.packing and self.data.max_length is None:
            raise ValueError("packing needs data.max_length (the length of a packed row)")


class SFTTask:
    def __init__(self, pad_id: int, packed: bool):
        self.pad_id, self.packed = pad_id, packed

    def collate(self, examples) -> SequenceBatch:
        return collate_packed(examples, self.pad_id) if self.packed else collate_sft(examples, self.pad_id)

    def count(self, batch: SequenceBatch) -> int:
        return int(batch.completion_mask.sum())

    def loss(self, model, batch: SequenceBatch):
        logprobs = sequence_logprobs(model, batch.input_ids, batch.attention_mask, position_ids=batch.position_ids)
        nll_sum = -masked_sum(logprobs, batch.completion_mask)
        return nll_sum, {"nll_sum": nll_sum}

    def finalize(self, sums: dict, count: int) -> dict:
        loss = sums["nll_sum"] / max(count, 1)
        return {"loss": loss, "perplexity": math.exp(min(loss, 50.0)), "completion_tokens": count}


@holds_run_dir  # the run folder stays locked until the run ends (runlock)
def train(config: SFTConfig, callbacks=()) -> dict:
    """Fine-tune ``config.model`` on ``config.data``; writes ``<run.output_dir>/final/policy``."""
    start = begin_offline(config, "sft", load_sft, "the first example as the model reads it")
    if config.packing:
        examples, length = len(start.train_examples) + len(start.eval_examples), config.data.max_length
        packed = pack_sft(start.train_examples, length)
        start = replace(start, train_examples=packed, eval_examples=pack_sft(start.eval_examples, length))
        start.accelerator.print(f"[sft] packing: {examples} examples into {len(packed)} training rows")
    policy = load_policy(_on_cpu(config.model))
    task = SFTTask(start.tokenizer.pad_token_id, config.packing)
    callbacks = (*callbacks, *collapse_alerts(start.accelerator, config, policy))
    return run_offline(task, Trainable(policy, {"policy": policy}), start, config, callbacks)


def collapse_alerts(accelerator, config: SFTConfig, policy) -> list:
    """On the main process, a callback raising the SFT alerts (``monitor.alerts.SFT_RULES``) after every
    step: a zero gradient norm or a loss that does not move (every trainer's), and a loss stuck at ln V (the
    model collapsed to the uniform distribution, as at optim.lr=1e6). Printed above the progress bar and
    written to ``alerts.jsonl``; the run goes on."""
    from posttrain.monitor.alerts import SFT_RULES
    from posttrain.monitor.run import offline_alerts

    vocab = getattr(policy.config, "vocab_size", None)
    context = {"log_vocab": math.log(vocab)} if vocab else {}
    return offline_alerts(accelerator, config.run.output_dir, SFT_RULES, context)


def _on_cpu(model_config: ModelConfig) -> ModelConfig:
    """Trained models load on the CPU; ``accelerator.prepare`` puts them on this process's device."""
    return replace(model_config, device="cpu")
