"""Process reward models from step-labelled solutions (Lightman et al. 2023, "Let's verify step by step",
arXiv:2305.20050; Wang et al. 2024, "Math-Shepherd", arXiv:2312.08935) with ``core.prm_loss``:

    loss = mean over the labelled steps k of   softplus(z_k) − y_k · z_k      (binary cross-entropy)

z_k: a one-logit token head read at the token that ends step k; y_k = 1 for a correct step. The rows are
TRL's stepwise supervision type {prompt, completions: [step, ...], labels: [bool, ...]}; the steps are
joined by ``step_separator`` into one response, encoded as a policy's response is (its EOS or end-of-turn
token last), and the step ends are found in its tokens by the rule PPO and GRPO apply to sampled responses
(``posttrain.data.steps``): the model is trained at the tokens it is read at in RL.

Departures from TRL's PRMTrainer: one logit and a binary cross-entropy where TRL has two classes and a
softmax (the same model: only the difference of two logits matters); the steps encoded as one response
where TRL tokenises each step with its separator apart, so the last step is read at the response's last
token here, at a separator after it there.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from posttrain.core import prm_loss
from posttrain.data import DataConfig, SequenceBatch, StepwiseExample, collate, load_stepwise
from posttrain.models import PROCESS_REWARD_KEY, ModelConfig, ProcessScorer, load_scalar_model
from posttrain.monitor.run import offline_alerts
from posttrain.runtime.config import PLACED_BY_ACCELERATE, OptimConfig, RunConfig, reject_ignored, validate_sections
from posttrain.runtime.loop import Trainable, begin_offline, run_offline
from posttrain.runtime.runlock import holds_run_dir


@dataclass
class PRMConfig:
    """posttrain prm."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """Backbone to train: a causal LM (a new one-output token head is added) or a process reward model."""
    data: DataConfig = field(default_factory=DataConfig)
    """Step-labelled rows {"prompt", "completions": [step, ...], "labels": [true/false, ...]}."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer and schedule."""
    run: RunConfig = field(default_factory=RunConfig)
    """Steps, batches, logging, checkpoints."""
    step_separator: str = "\n"
    """Joins the steps into one response, as the policy writes them (TRL's step_separator); saved in the
    checkpoint, where PPO and GRPO read it to find the steps of a sampled response."""

    def validate(self) -> None:
        validate_sections(self)
        reject_ignored(
            self,
            {
                "model.device": PLACED_BY_ACCELERATE,
                "model.lora": "posttrain prm trains the whole model (a LoRA process reward model is not built)",
            },
        )
        if not self.step_separator:
            raise ValueError("step_separator must be a non-empty string, e.g. '\\n' (the default)")


@dataclass
class PRMBatch:
    sequences: SequenceBatch  # [N, L] prompt + the steps joined, right-padded
    labels: torch.Tensor  # [N, L] 1 = the step ending at this token is correct (read where label_mask is 1)
    label_mask: torch.Tensor  # [N, L] bool, 1 = a token that ends a labelled step

    def to(self, device) -> PRMBatch:
        return PRMBatch(self.sequences.to(device), self.labels.to(device), self.label_mask.to(device))

    @property
    def num_tokens(self) -> int:
        return self.sequences.num_tokens


class PRMTask:
    """Loss units: labelled steps (one optimizer step is the mean over every labelled step of its batch)."""

    def __init__(self, pad_id: int):
        self.pad_id = pad_id

    def collate(self, examples: list[StepwiseExample]) -> PRMBatch:
        sequences = collate([(e.prompt_ids, e.completion_ids) for e in examples], self.pad_id)
        labels = torch.zeros(sequences.input_ids.shape)
        label_mask = torch.zeros(sequences.input_ids.shape, dtype=torch.bool)
        for i, e in enumerate(examples):
            at = [len(e.prompt_ids) + end for end in e.step_ends]
            labels[i, at] = torch.tensor(e.labels, dtype=torch.float32)
            label_mask[i, at] = True
        return PRMBatch(sequences, labels, label_mask)

    def count(self, batch: PRMBatch) -> int:
        return int(batch.label_mask.sum())

    def loss(self, model, batch: PRMBatch):
        """(Σ of ``prm_loss`` over the labelled steps, the sums ``finalize`` reads). ``model``: a ``ProcessScorer``."""
        logits = model(batch.sequences.input_ids, batch.sequences.attention_mask)  # [N, L]
        losses = prm_loss(logits, batch.labels, batch.label_mask)
        mask = batch.label_mask
        wrong = mask & ((logits.detach() > 0) != batch.labels.bool())  # σ(z) > 1/2 says "correct"
        sums = {
            "loss_sum": losses.detach().sum(),
            "correct_steps": (mask & ~wrong).sum(),
            "steps": mask.sum(),
            "positive_steps": (mask & batch.labels.bool()).sum(),
            "correct_solutions": (~wrong.any(1)).sum(),
            "solutions": torch.tensor(mask.shape[0], device=mask.device),
        }
        return losses.sum(), sums

    def finalize(self, sums: dict, count: int) -> dict:
        """loss (mean over labelled steps), step_accuracy (steps whose σ(z) > 1/2 matches the label),
        solution_accuracy (solutions with every labelled step right) and the share of correct-labelled steps."""
        steps, solutions = max(sums["steps"], 1), max(sums["solutions"], 1)
        return {
            "loss": sums["loss_sum"] / max(count, 1),
            "step_accuracy": sums["correct_steps"] / steps,
            "solution_accuracy": sums["correct_solutions"] / solutions,
            "positive_share": sums["positive_steps"] / steps,
        }


@holds_run_dir  # the run folder stays locked until the run ends (runlock)
def train(config: PRMConfig, callbacks=()) -> dict:
    """Train a process reward model; writes ``<run.output_dir>/final/process_reward``: a
    *ForTokenClassification (num_labels=1) whose config.json holds ``process_reward: {step_separator}``, which
    ``process_reward_model.path`` of ``posttrain grpo`` and ``posttrain ppo`` loads."""
    separator = config.step_separator

    def load(data, tokenizer):
        return load_stepwise(data, tokenizer, separator)

    start = begin_offline(config, "prm", load, "the first prompt and its steps as the model reads them")
    model = load_scalar_model(replace(config.model, device="cpu"), "value")
    setattr(model.config, PROCESS_REWARD_KEY, {"step_separator": separator})  # saved in config.json
    scorer = ProcessScorer(model)  # trained through its forward: DDP synchronises its gradients
    task = PRMTask(start.tokenizer.pad_token_id)
    callbacks = (*callbacks, *offline_alerts(start.accelerator, config.run.output_dir))  # a dead run says so
    trainable = Trainable(scorer, {"process_reward": scorer})
    return run_offline(task, trainable, start, config, callbacks, ("loss", "step_accuracy"))
