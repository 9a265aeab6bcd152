"""Direct Preference Optimization (Rafailov et al. 2023) with ``core.dpo_loss`` (sigmoid, IPO, hinge), and the
reference-free pairwise losses SimPO (``core.simpo_loss``) and ORPO (``core.orpo_loss``).

    h = (log π(y_w|x) − log π_ref(y_w|x)) − (log π(y_l|x) − log π_ref(y_l|x)),   loss = mean over pairs of ℓ(h)

log π(y|x) sums the log-probs of the completion tokens (the papers' sequence log-likelihood); for
IPO, ``ipo_logps=mean`` averages them over the completion's tokens instead, as TRL does. The
reference is a frozen copy of the starting policy, the same weights with the LoRA adapter off, a
separate checkpoint (``reference_path``), or its log-probs are computed once in a pass before
training (``reference=precompute``) and the reference model is freed. At step 0 the policy is its
own reference, so the loss starts at log 2. SimPO and ORPO read the mean of the completion's token
log-probs (their papers' length-normalised likelihood) and load no reference at all.

With ``shared_prefix`` (default auto) a pair is one row, prompt then chosen then rejected
(``core.packing``): the prompt is computed once in the policy and the reference passes instead of
twice; log π(y|x) is the same up to float rounding.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, replace
from functools import partial

import torch

from posttrain.core import (
    DPO_KINDS,
    SharedPrefixBatch,
    dpo_loss,
    masked_mean,
    masked_sum,
    orpo_loss,
    pack_shared_prefix,
    simpo_loss,
)
from posttrain.data import (
    DataConfig,
    PreferenceExample,
    SequenceBatch,
    collate_preferences,
    load_preferences,
)
from posttrain.models import (
    ModelConfig,
    Reference,
    load_policy,
    sequence_logprobs,
    shared_prefix_logprobs,
)
from posttrain.monitor.run import offline_alerts
from posttrain.runtime import signals
from posttrain.runtime.config import (
    PLACED_BY_ACCELERATE,
    OptimConfig,
    RunConfig,
    check_choice,
    reject_ignored,
    validate_sections,
)
from posttrain.runtime.loop import (
    PhaseTimer,
    Trainable,
    begin_offline,
    offline_reference,
    precompute_pass,
    run_offline,
)
from posttrain.runtime.prefix import SharedPrefix, check_shared_prefix, resolve_shared_prefix
from posttrain.runtime.runlock import holds_run_dir

REFERENCE_MODES = ("auto", "copy", "adapter", "precompute", "none")
IPO_LOGPS = ("sum", "mean")
REFERENCE_FREE = ("simpo", "orpo")  # losses of the policy alone: no reference is loaded or run
LOSS_TYPES = (*DPO_KINDS, *REFERENCE_FREE)
DPO_BETA = 0.1  # β of sigmoid, ipo and hinge when unset: the DPO paper's and TRL's usual value


@dataclass
class DPOConfig:
    """posttrain dpo."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """The policy to train, usually an SFT model (``model.lora`` for a LoRA adapter)."""
    data: DataConfig = field(default_factory=DataConfig)
    """Preference pairs {"prompt", "chosen", "rejected"}."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer and schedule."""
    run: RunConfig = field(default_factory=RunConfig)
    """Steps, batches, logging, checkpoints."""
    beta: float | None = None
    """β: the strength of the implicit KL anchor to the reference (null = 0.1, DPO's usual); for simpo, the
    scale of its reward (β/|y|)·log π(y|x), required: the SimPO paper uses 2.0–2.5 with simpo_gamma ≈ β/2;
    not used by orpo."""
    loss_type: str = "sigmoid"
    """sigmoid (DPO), ipo, hinge, or the reference-free simpo (SimPO) and orpo (ORPO)."""
    label_smoothing: float = 0.0
    """ε of conservative DPO: the share of labels assumed flipped (sigmoid only)."""
    ipo_logps: str = "sum"
    """IPO only: log π(y|x) as the sum of the completion's token log-probs (the IPO paper's sequence
    log-likelihood) or their mean over its tokens (TRL's IPO). The target margin 1/(2β) is then per
    sequence or per token, so β means something else in each."""
    simpo_gamma: float = 0.5
    """SimPO only: γ, the target margin between the chosen and the rejected reward (β/|y|)·log π(y|x), in
    reward units (the SimPO code's gamma_beta_ratio is γ/β)."""
    orpo_lambda: float = 0.1
    """ORPO only: λ, the weight of the odds-ratio term added to the chosen response's NLL (β is not used)."""
    reference: str = "auto"
    """auto (none for simpo and orpo; adapter-off for LoRA; else copy), copy, adapter, precompute (one
    pass, then freed), or none (simpo and orpo only)."""
    reference_path: str | None = None
    """A separate reference checkpoint; null = the starting policy."""
    shared_prefix: bool | str = "auto"
    """One row per pair: the prompt once, then the chosen and the rejected response, each attending to
    the prompt and to itself only (position ids continue from the prompt in both), so the policy and
    reference passes compute the prompt once instead of twice. auto: when the model takes such a 4-D
    attention mask exactly (sdpa or eager attention, no sliding window; otherwise the reason is
    printed) and the packed micro-batch costs fewer FLOPs; true: always (an error if the model
    cannot); false: never. The loss equals the unpacked one up to float rounding."""

    def validate(self) -> None:
        validate_sections(self)
        reject_ignored(self, {"model.device": PLACED_BY_ACCELERATE})
        check_choice("loss_type", self.loss_type, LOSS_TYPES)
        check_choice("reference", self.reference, REFERENCE_MODES)
        self._check_variant_knobs()
        check_shared_prefix(self.shared_prefix)
        if self.beta is not None and self.beta <= 0:
            raise ValueError(f"beta must be > 0, got {self.beta}")
        if not 0 <= self.label_smoothing < 0.5:
            raise ValueError(f"label_smoothing must be in [0, 0.5), got {self.label_smoothing}")
        if self.label_smoothing and self.loss_type != "sigmoid":
            raise ValueError("label_smoothing applies to loss_type=sigmoid only")
        check_choice("ipo_logps", self.ipo_logps, IPO_LOGPS)
        if self.ipo_logps != "sum" and self.loss_type != "ipo":
            raise ValueError("ipo_logps applies to loss_type=ipo only (DPO and hinge use summed log-probs)")
        if self.reference == "adapter" and (self.model.lora is None or self.reference_path):
            raise ValueError("reference=adapter needs model.lora and no reference_path")

    @property
    def reference_free(self) -> bool:
        return self.loss_type in REFERENCE_FREE

    @property
    def beta_in_force(self) -> float:
        """β of the loss: ``beta``, or DPO's 0.1 when unset (simpo refuses unset at start, orpo reads none)."""
        return DPO_BETA if self.beta is None else self.beta

    def _check_variant_knobs(self) -> None:
        """Each loss's own knobs are refused with the others; simpo and orpo take no reference."""
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        for name, loss in (("simpo_gamma", "simpo"), ("orpo_lambda", "orpo")):
            if getattr(self, name) != defaults[name] and self.loss_type != loss:
                raise ValueError(f"{name} applies to loss_type={loss} only")
        if self.simpo_gamma < 0 or self.orpo_lambda < 0:
            raise ValueError(f"simpo_gamma and orpo_lambda must be >= 0, got {self.simpo_gamma}, {self.orpo_lambda}")
        if self.loss_type == "orpo" and self.beta is not None:
            raise ValueError("beta is not used by loss_type=orpo: orpo_lambda weighs its odds-ratio term")
        if self.reference_free and (self.reference not in ("auto", "none") or self.reference_path):
            raise ValueError(
                f"loss_type={self.loss_type} is reference-free (no reference is loaded): leave reference=auto "
                f"(or none) and reference_path=null, got reference={self.reference}, "
                f"reference_path={self.reference_path}"
            )
        if not self.reference_free and self.reference == "none":
            raise ValueError(f"reference=none: loss_type={self.loss_type} needs a reference (simpo and orpo do not)")
        if self.loss_type == "simpo" and self.beta is None:
            raise ValueError(
                f"loss_type=simpo needs beta set: its reward is (β/|y|)·log π(y|x), and DPO's β = {DPO_BETA} is 20 to "
                "25 times below the SimPO paper's beta=2.0 to 2.5, used with simpo_gamma about beta/2 "
                "(e.g. beta=2.0 simpo_gamma=1.0)"
            )


@dataclass
class DPOExample:
    pair: PreferenceExample
    ref_chosen: float | None = None  # precomputed log π_ref(y_w|x)
    ref_rejected: float | None = None


@dataclass
class DPOBatch:
    sequences: SequenceBatch | SharedPrefixBatch  # 2B rows: chosen, then rejected; or B packed rows
    ref_logps: torch.Tensor | None  # [2B] when precomputed

    def to(self, device) -> DPOBatch:
        return DPOBatch(self.sequences.to(device), None if self.ref_logps is None else self.ref_logps.to(device))

    @property
    def num_tokens(self) -> int:
        return self.sequences.num_tokens


def completion_logps(model, sequences: SequenceBatch | SharedPrefixBatch, average: bool = False) -> torch.Tensor:
    """log π(y|x) = Σ over completion tokens, [2B]: the B chosen, then the B rejected responses;
    ``average``: that sum / the number of completion tokens."""
    reduce = masked_mean if average else masked_sum
    if isinstance(sequences, SharedPrefixBatch):
        logprobs, _, response_mask = shared_prefix_logprobs(model, sequences)  # [2B, T]: (chosen_b, rejected_b)
        return reduce(logprobs, response_mask, dim=1).view(-1, 2).t().reshape(-1)
    logprobs = sequence_logprobs(model, sequences.input_ids, sequences.attention_mask)
    return reduce(logprobs, sequences.completion_mask, dim=1)


class DPOTask:
    def __init__(self, reference: Reference | None, pad_id: int, config: DPOConfig, shared: SharedPrefix | None = None):
        self.reference, self.pad_id, self.config = reference, pad_id, config
        # SimPO's and ORPO's likelihoods are length-normalised: the mean over the completion's tokens
        self.average = config.ipo_logps == "mean" or config.reference_free
        self.shared = shared or SharedPrefix(enabled=False)
        self.timer = PhaseTimer()  # the loop's, once training starts: the reference forward is time/reference

    def sequences(self, pairs: list[PreferenceExample]) -> SequenceBatch | SharedPrefixBatch:
        """B packed rows (prompt, chosen, rejected) when ``shared_prefix`` says so, else 2B padded rows."""
        padded = max(len(e.prompt_ids) + max(len(e.chosen_ids), len(e.rejected_ids)) for e in pairs)
        packed = max(len(e.prompt_ids) + len(e.chosen_ids) + len(e.rejected_ids) for e in pairs)
        if all(e.prompt_ids for e in pairs) and self.shared.pays(2 * len(pairs), padded, len(pairs), packed):
            return pack_shared_prefix(
                [e.prompt_ids for e in pairs], [[e.chosen_ids, e.rejected_ids] for e in pairs], self.pad_id
            )
        return collate_preferences(pairs, self.pad_id)

    def collate(self, examples: list[DPOExample]) -> DPOBatch:
        sequences = self.sequences([e.pair for e in examples])
        if examples[0].ref_chosen is None:
            return DPOBatch(sequences, None)
        ref = [e.ref_chosen for e in examples] + [e.ref_rejected for e in examples]
        return DPOBatch(sequences, torch.tensor(ref, dtype=torch.float32))

    def count(self, batch: DPOBatch) -> int:
        rows = batch.sequences.input_ids.shape[0]
        return rows if isinstance(batch.sequences, SharedPrefixBatch) else rows // 2

    def reference_logps(self, sequences: SequenceBatch | SharedPrefixBatch) -> torch.Tensor:
        with self.timer("reference"), self.reference.model_for_forward() as ref_model:
            return completion_logps(ref_model, sequences, self.average)

    def store_reference(self, chunk: list[DPOExample], forward, device) -> None:
        """Keep in each pair of ``chunk`` log π_ref of both responses, ``forward(sequences) -> [2B]`` (chosen,
        then rejected): ``precompute_reference``'s step."""
        ref_chosen, ref_rejected = forward(self.sequences([e.pair for e in chunk]).to(device)).cpu().chunk(2)
        for e, c, r in zip(chunk, ref_chosen.tolist(), ref_rejected.tolist(), strict=True):
            e.ref_chosen, e.ref_rejected = c, r

    def objective(self, chosen: torch.Tensor, rejected: torch.Tensor, batch: DPOBatch):
        """(losses [B], chosen_rewards [B], rejected_rewards [B]) of ``loss_type`` from the policy's log π(y|x)
        of the B chosen and B rejected responses (SimPO's rewards; ORPO's log odds)."""
        c = self.config
        if c.loss_type == "simpo":
            return simpo_loss(chosen, rejected, c.beta_in_force, c.simpo_gamma)
        if c.loss_type == "orpo":
            return orpo_loss(chosen, rejected, c.orpo_lambda)
        ref_logps = batch.ref_logps if batch.ref_logps is not None else self.reference_logps(batch.sequences)
        ref_chosen, ref_rejected = ref_logps.chunk(2)
        return dpo_loss(chosen, rejected, ref_chosen, ref_rejected, c.beta_in_force, c.loss_type, c.label_smoothing)

    def loss(self, model, batch: DPOBatch):
        logps = completion_logps(model, batch.sequences, self.average)
        chosen, rejected = logps.chunk(2)
        losses, chosen_rewards, rejected_rewards = self.objective(chosen, rejected, batch)
        sums = {
            "loss_sum": losses.detach().sum(),
            "rewards/chosen": chosen_rewards.sum(),
            "rewards/rejected": rejected_rewards.sum(),
            "rewards/correct": (chosen_rewards > rejected_rewards).float().sum(),
            "logps/chosen": chosen.detach().sum(),
            "logps/rejected": rejected.detach().sum(),
        }
        if self.config.loss_type == "orpo":  # its SFT term, −log P(y_w|x)
            sums["nll"] = -chosen.detach().sum()
        return losses.sum(), sums

    def finalize(self, sums: dict, count: int) -> dict:
        n = max(count, 1)
        per_pair = ("rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected", "nll")
        metrics = {k: sums[k] / n for k in per_pair if k in sums}
        metrics.update(
            {
                "loss": sums["loss_sum"] / n,
                "rewards/accuracy": sums["rewards/correct"] / n,
                "rewards/margin": metrics["rewards/chosen"] - metrics["rewards/rejected"],
            }
        )
        return metrics


def precompute_reference(task, policy, examples: list, config, accelerator, name: str) -> None:
    """reference=precompute (DPO, KTO): one pass over ``examples`` (training and held-out) in which
    ``task.store_reference(chunk, forward, device)`` keeps the reference's log-probs in each example, computed
    by the separate reference model when one was built (``loop.offline_reference``), else by the starting
    policy, which is the reference before any step; the reference is dropped after the pass."""
    if task.reference is not None:
        forward = task.reference_logps
    else:
        forward = partial(completion_logps, policy, average=task.average)
    store = partial(task.store_reference, forward=forward, device=accelerator.device)
    show = config.run.progress and accelerator.is_main_process
    with signals.stops_at_once(name, "the reference log-probs pass (reference=precompute)"):  # nothing to save
        precompute_pass(examples, config.run.micro_batch_size, store, f"[{name}] reference log-probs", show)
    task.reference = None


@holds_run_dir  # the run folder stays locked until the run ends (runlock)
def train(config: DPOConfig, callbacks=()) -> dict:
    """Train the policy with DPO; writes ``<run.output_dir>/final/policy``."""
    first = "the first prompt and chosen response as the model reads them"
    start = begin_offline(config, "dpo", load_preferences, first)
    train_examples = [DPOExample(p) for p in start.train_examples]
    eval_examples = [DPOExample(p) for p in start.eval_examples]
    start = replace(start, train_examples=train_examples, eval_examples=eval_examples)
    accelerator = start.accelerator
    policy = load_policy(replace(config.model, device=str(accelerator.device)))
    task = DPOTask(None, start.tokenizer.pad_token_id, config)
    if config.reference_free:
        accelerator.print(f"[dpo] loss_type={config.loss_type} is reference-free: no reference model is loaded")
    else:
        task.reference = offline_reference(config, policy, accelerator)
    # packed rows run through the policy and a separate reference model alike: both must take them
    models = [policy] + ([task.reference.model] if task.reference and task.reference.model is not None else [])
    task.shared = resolve_shared_prefix(config.shared_prefix, models, lambda line: accelerator.print(f"[dpo] {line}"))
    if config.reference == "precompute":
        precompute_reference(task, policy, train_examples + eval_examples, config, accelerator, "dpo")
    bar_keys = ("loss", "rewards/accuracy")
    callbacks = (*callbacks, *offline_alerts(accelerator, config.run.output_dir))  # a dead run says so
    return run_offline(task, Trainable(policy, {"policy": policy}), start, config, callbacks, bar_keys)
