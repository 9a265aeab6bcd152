"""Kahneman–Tversky Optimization (Ethayarajh et al. 2024, arXiv:2402.01306) with ``core.kto_loss``, on
unpaired preference rows {prompt, completion, label}:

    r = log π(y|x) − log π_ref(y|x)                               (summed over the completion tokens)
    z0 = max(0, mean over mismatched pairs (x_i, y'_i) of log π(y'_i|x_i) − log π_ref(y'_i|x_i))
    loss = mean over examples of λ_D·(1 − σ(β(r − z0))) (desirable) or λ_U·(1 − σ(β(z0 − r))) (undesirable)

The mismatched pair of an example is its prompt with the completion of another example: its partner in a
seeded cycle through the training set (the held-out set apart), fixed for the run, as TRL pairs each row
with its neighbour's completion once, before training. z0 is computed once per optimizer step, without
gradient, from the pairs of every micro-batch of every process (``KTOTask.begin_step``), so it does not
change with ``run.micro_batch_size`` or the number of processes; TRL computes it per micro-batch and
averages it over processes. The reference is chosen as in DPO: a frozen copy, the LoRA adapter off, a
separate checkpoint, or its log-probs computed in one pass before training (``reference=precompute``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from posttrain.core import kto_loss, kto_reference_point
from posttrain.data import DataConfig, SequenceBatch, UnpairedExample, collate, load_unpaired
from posttrain.models import ModelConfig, Reference, load_policy
from posttrain.monitor.run import offline_alerts
from posttrain.runtime.config import (
    PLACED_BY_ACCELERATE,
    OptimConfig,
    RunConfig,
    check_choice,
    reject_ignored,
    validate_sections,
)
from posttrain.runtime.loop import PhaseTimer, Trainable, begin_offline, global_sum, offline_reference, run_offline
from posttrain.runtime.runlock import holds_run_dir
from posttrain.trainers.dpo import completion_logps, precompute_reference

REFERENCE_MODES = ("auto", "copy", "adapter", "precompute")
ADVISED_WEIGHT_RATIO = (1.0, 4 / 3)  # λ_D·n_D / (λ_U·n_U), the KTO paper's advice (§4.2)


@dataclass
class KTOConfig:
    """posttrain kto."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """The policy to train, usually an SFT model (``model.lora`` for a LoRA adapter)."""
    data: DataConfig = field(default_factory=DataConfig)
    """Unpaired preference rows {"prompt", "completion", "label"}, label true (desirable) or false."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer and schedule."""
    run: RunConfig = field(default_factory=RunConfig)
    """Steps, batches, logging, checkpoints."""
    beta: float = 0.1
    """β: the scale of the implicit reward r = log π(y|x) − log π_ref(y|x) inside the sigmoid."""
    desirable_weight: float = 1.0
    """λ_D, the weight of a desirable example's loss. The paper advises λ_D·n_D / (λ_U·n_U) in [1, 4/3]
    (n_D, n_U: the numbers of desirable and undesirable examples); the run prints the ratio at start."""
    undesirable_weight: float = 1.0
    """λ_U, the weight of an undesirable example's loss."""
    reference: str = "auto"
    """auto (adapter-off for LoRA, else copy), copy, adapter, or precompute (one pass, then freed)."""
    reference_path: str | None = None
    """A separate reference checkpoint; null = the starting policy."""

    def validate(self) -> None:
        validate_sections(self)
        reject_ignored(self, {"model.device": PLACED_BY_ACCELERATE})
        check_choice("reference", self.reference, REFERENCE_MODES)
        for name in ("beta", "desirable_weight", "undesirable_weight"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.reference == "adapter" and (self.model.lora is None or self.reference_path):
            raise ValueError("reference=adapter needs model.lora and no reference_path")


@dataclass
class KTOExample:
    example: UnpairedExample
    kl_completion_ids: list[int]  # another example's completion, read after this prompt: a mismatched pair
    ref_logp: float | None = None  # precomputed log π_ref(y|x)
    ref_kl_logp: float | None = None  # precomputed log π_ref(y'|x) of the mismatched pair


@dataclass
class KTOBatch:
    sequences: SequenceBatch  # [B] prompt + completion
    kl_sequences: SequenceBatch  # [B] the same prompts + the mismatched completions
    desirable: torch.Tensor  # [B] bool
    ref_logps: torch.Tensor | None  # [B] when precomputed
    ref_kl_logps: torch.Tensor | None  # [B] when precomputed

    def to(self, device) -> KTOBatch:
        ref = [None if t is None else t.to(device) for t in (self.ref_logps, self.ref_kl_logps)]
        return KTOBatch(self.sequences.to(device), self.kl_sequences.to(device), self.desirable.to(device), *ref)

    @property
    def num_tokens(self) -> int:
        return self.sequences.num_tokens + self.kl_sequences.num_tokens


def mismatched_pairs(examples: list[UnpairedExample], seed: int, max_length: int | None) -> list[KTOExample]:
    """Each example with the completion of its successor in a seeded cycle through ``examples`` (every
    completion used once; with one example, its own), cut to fit ``max_length`` after this prompt."""
    order = torch.randperm(len(examples), generator=torch.Generator().manual_seed(seed)).tolist()
    partner = {a: b for a, b in zip(order, order[1:] + order[:1], strict=True)}
    out = []
    for i, e in enumerate(examples):
        completion = examples[partner[i]].completion_ids
        if max_length is not None:
            completion = completion[: max(1, max_length - len(e.prompt_ids))]
        out.append(KTOExample(e, completion))
    return out


def weight_report(examples: list[UnpairedExample], config: KTOConfig) -> str:
    """The counts of desirable and undesirable examples and λ_D·n_D / (λ_U·n_U) against the paper's advice."""
    n_d = sum(e.label for e in examples)
    n_u = len(examples) - n_d
    line = f"{n_d} desirable, {n_u} undesirable examples"
    if n_d == 0 or n_u == 0:
        return line + ": one kind only, the loss still trains against the reference point z0"
    ratio = config.desirable_weight * n_d / (config.undesirable_weight * n_u)
    low, high = ADVISED_WEIGHT_RATIO
    advice = "within" if low <= ratio <= high else "outside"
    return (
        f"{line}; desirable_weight·n_D / (undesirable_weight·n_U) = {ratio:.3g}, {advice} the paper's advised "
        f"[1, 4/3] (set desirable_weight / undesirable_weight to move it)"
    )


class KTOTask:
    def __init__(self, reference: Reference | None, pad_id: int, config: KTOConfig):
        self.reference, self.pad_id, self.config = reference, pad_id, config
        self.average = False  # r sums the completion's token log-probs (the paper's log π(y|x))
        self.kl: float | None = None  # the KL estimate of the current step (or evaluation), before the clamp
        self.z0: torch.Tensor | None = None  # kto_reference_point of it
        self.timer = PhaseTimer()  # the loop's, once training starts: the reference forwards are time/reference

    def collate(self, examples: list[KTOExample]) -> KTOBatch:
        sequences = collate([(e.example.prompt_ids, e.example.completion_ids) for e in examples], self.pad_id)
        kl_sequences = collate([(e.example.prompt_ids, e.kl_completion_ids) for e in examples], self.pad_id)
        desirable = torch.tensor([e.example.label for e in examples], dtype=torch.bool)
        if examples[0].ref_logp is None:
            return KTOBatch(sequences, kl_sequences, desirable, None, None)
        ref = torch.tensor([e.ref_logp for e in examples], dtype=torch.float32)
        ref_kl = torch.tensor([e.ref_kl_logp for e in examples], dtype=torch.float32)
        return KTOBatch(sequences, kl_sequences, desirable, ref, ref_kl)

    def count(self, batch: KTOBatch) -> int:
        return batch.sequences.input_ids.shape[0]

    def reference_logps(self, sequences: SequenceBatch) -> torch.Tensor:
        with self.timer("reference"), self.reference.model_for_forward() as ref_model:
            return completion_logps(ref_model, sequences)

    def store_reference(self, chunk: list[KTOExample], forward, device) -> None:
        """Keep in each example of ``chunk`` log π_ref of its completion and of its mismatched pair,
        ``forward(sequences) -> [B]`` (summed completion log-probs): ``dpo.precompute_reference``'s step."""
        batch = self.collate(chunk).to(device)
        ref, ref_kl = forward(batch.sequences).cpu(), forward(batch.kl_sequences).cpu()
        for e, r, k in zip(chunk, ref.tolist(), ref_kl.tolist(), strict=True):
            e.ref_logp, e.ref_kl_logp = r, k

    def begin_step(self, accelerator, model, batches: list[KTOBatch], counted: list[bool]) -> None:
        """z0 of the step: ``core.kto_reference_point`` over the mismatched pairs of every micro-batch of
        every process (those ``counted``), without gradient, before any loss (``loop.Task``)."""
        device = accelerator.device
        total, pairs = torch.zeros((), dtype=torch.float64, device=device), 0
        with torch.no_grad():
            for batch, counts in zip(batches, counted, strict=True):
                batch = batch.to(device)
                policy = completion_logps(model, batch.kl_sequences)
                ref = batch.ref_kl_logps if batch.ref_kl_logps is not None else self.reference_logps(batch.kl_sequences)
                if counts:
                    total = total + (policy - ref).double().sum()
                    pairs += policy.shape[0]
        total, pairs = global_sum(accelerator, total), global_sum(accelerator, pairs)
        self.kl = total / max(pairs, 1.0)
        self.z0 = kto_reference_point(torch.tensor(total, device=device), pairs)

    def loss(self, model, batch: KTOBatch):
        if self.z0 is None:
            raise RuntimeError("KTOTask.loss before begin_step: z0 is computed from the whole step first")
        c = self.config
        logps = completion_logps(model, batch.sequences)
        ref_logps = batch.ref_logps if batch.ref_logps is not None else self.reference_logps(batch.sequences)
        z0 = self.z0.to(logps)
        losses, rewards = kto_loss(
            logps, ref_logps, batch.desirable, z0, c.beta, c.desirable_weight, c.undesirable_weight
        )
        desirable, undesirable = batch.desirable, ~batch.desirable
        # the implicit reward on its label's side of the reference point: above β·z0 when desirable
        correct = torch.where(desirable, rewards > c.beta * z0, rewards < c.beta * z0)
        logps, rows = logps.detach(), float(batch.desirable.numel())
        sums = {
            "loss_sum": losses.detach().sum(),
            "desirable": desirable.float().sum(),
            "undesirable": undesirable.float().sum(),
            "rewards/chosen": torch.where(desirable, rewards, 0.0).sum(),
            "rewards/rejected": torch.where(undesirable, rewards, 0.0).sum(),
            "logps/chosen": torch.where(desirable, logps, 0.0).sum(),
            "logps/rejected": torch.where(undesirable, logps, 0.0).sum(),
            "rewards/correct": correct.float().sum(),
            "kl": torch.tensor(self.kl * rows, device=logps.device),
            "z0": z0 * rows,
        }
        return losses.sum(), sums

    def finalize(self, sums: dict, count: int) -> dict:
        """Means over the examples; rewards/chosen and logps/chosen over the desirable ones (absent when the
        step has none), rewards/rejected and logps/rejected over the undesirable ones."""
        n = max(count, 1)
        metrics = {
            "loss": sums["loss_sum"] / n,
            "rewards/accuracy": sums["rewards/correct"] / n,
            "kl": sums["kl"] / n,
            "z0": sums["z0"] / n,
            "desirable_share": sums["desirable"] / n,
        }
        for label, kind in (("chosen", "desirable"), ("rejected", "undesirable")):
            if sums[kind] > 0:
                metrics[f"rewards/{label}"] = sums[f"rewards/{label}"] / sums[kind]
                metrics[f"logps/{label}"] = sums[f"logps/{label}"] / sums[kind]
        if "rewards/chosen" in metrics and "rewards/rejected" in metrics:
            metrics["rewards/margin"] = metrics["rewards/chosen"] - metrics["rewards/rejected"]
        return metrics


@holds_run_dir  # the run folder stays locked until the run ends (runlock)
def train(config: KTOConfig, callbacks=()) -> dict:
    """Train the policy with KTO; writes ``<run.output_dir>/final/policy``."""
    first = "the first prompt and completion as the model reads them"
    start = begin_offline(config, "kto", load_unpaired, first)
    accelerator, train_rows, eval_rows = start.accelerator, start.train_examples, start.eval_examples
    accelerator.print(f"[kto] {weight_report(train_rows + eval_rows, config)}")
    max_length = config.data.max_length
    train_examples = mismatched_pairs(train_rows, config.run.seed, max_length)
    eval_examples = mismatched_pairs(eval_rows, config.run.seed + 1, max_length) if eval_rows else []
    start = replace(start, train_examples=train_examples, eval_examples=eval_examples)
    policy = load_policy(replace(config.model, device=str(accelerator.device)))
    task = KTOTask(None, start.tokenizer.pad_token_id, config)
    task.reference = offline_reference(config, policy, accelerator)
    if config.reference == "precompute":
        precompute_reference(task, policy, train_examples + eval_examples, config, accelerator, "kto")
    callbacks = (*callbacks, *offline_alerts(accelerator, config.run.output_dir))  # a dead run says so
    return run_offline(task, Trainable(policy, {"policy": policy}), start, config, callbacks, ("loss", "kl"))
