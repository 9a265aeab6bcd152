"""Online DPO (Guo et al. 2024, "Direct Language Model Alignment from Online AI Feedback", arXiv:2402.04792):
DPO on pairs the current policy samples and a reward ranks, fresh every step.

Per step, for P prompts:
  1. sample K = ``num_generations`` responses per prompt from the current policy (the rollout engine:
     hf, lean or vLLM);
  2. score every response with the weighted reward functions: a verifiable reward, a reward model
     (``posttrain.rewards.model``) or a judge (``posttrain.rewards.judge``); None = not scored;
  3. pairs within each prompt: the best-scored response chosen against the worst (``pairs=best_worst``),
     or every two responses with different scores, the better one chosen (``pairs=all``). A prompt whose
     scored responses all score the same (a tie), or with fewer than two scored responses, gives no pair;
  4. log π_ref of the paired responses (no grad);
  5. for each of ``minibatches`` shuffled minibatches of the pairs, one optimizer step on the mean of
     ``core.dpo_loss`` (sigmoid, ipo or hinge) over its pairs;
  6. log; checkpoint.

log π(y|x) is the sum of the response's token log-probs at τ = 1, the model's own distribution as in
offline DPO, whatever the sampling temperature. At the first step the policy is its reference, h = 0,
and the sigmoid loss is log 2. Departures from the paper: the paper asks an LLM annotator which of two
responses is better; here any reward ranks K ≥ 2 of them (the judge is one such reward), ties give no
pair instead of a coin flip, and ``pairs=all`` uses every ordered pair of K > 2. Equations, knobs and
tests: docs/algorithms/dpo.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch

from posttrain.core import DPO_KINDS, dpo_loss, masked_mean, masked_sum
from posttrain.data import DataConfig
from posttrain.models import ModelConfig, load_policy
from posttrain.monitor import AlertConfig, EvalConfig
from posttrain.rewards import RewardComposer, RewardOutput, RewardSpec, score_rollout
from posttrain.rollout import Rollout, RolloutConfig, SamplingParams
from posttrain.runtime import engines
from posttrain.runtime.config import (
    PLACED_BY_ACCELERATE,
    OptimConfig,
    RunConfig,
    check_choice,
    python_sections,
    reject_ignored,
    validate_sections,
)
from posttrain.runtime.loop import NonFiniteGuard, PhaseTimer, build_optimizer, global_sum
from posttrain.runtime.online import (
    OnlineTrainer,
    global_min,
    minibatches,
    policy_logprobs,
    reference_logprobs,
)
from posttrain.runtime.prefix import check_shared_prefix, resolve_shared_prefix
from posttrain.runtime.runlock import holds_run_dir
from posttrain.runtime.update import MinibatchUpdate, Optimized, StepStats, Tally, ratio, std_of

PAIRINGS = ("best_worst", "all")
REFERENCE_MODES = ("auto", "copy", "adapter")


@python_sections  # sections and rewards given in Python resolve as YAML's do
@dataclass
class OnlineDPOConfig:
    """posttrain online-dpo. ``run.batch_size`` counts responses per step (prompts × num_generations);
    ``run.micro_batch_size`` counts pairs per forward/backward (two responses each)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """The policy, usually an SFT model (``model.lora`` for LoRA: the reference is then the adapter-off model)."""
    data: DataConfig = field(default_factory=lambda: DataConfig(max_length=None, max_prompt_length=512))
    """Prompt rows {"prompt", ...}; the other columns go to the reward functions."""
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-6, scheduler="constant"))
    """Optimizer and schedule."""
    run: RunConfig = field(default_factory=RunConfig)
    """Steps (rollout batches), responses per step (batch_size), pairs per micro-batch, logging, checkpoints."""
    sampling: SamplingParams = field(default_factory=lambda: SamplingParams(max_new_tokens=256, temperature=1.0))
    """How responses are sampled (a temperature > 0: greedy responses to a prompt are all the same)."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """The engine that samples (hf | lean | vllm, colocate | server)."""
    rewards: list[RewardSpec] = field(default_factory=list)
    """What ranks the responses: reward functions, reward models or judges, weighted and summed."""
    num_generations: int = 2
    """K: responses sampled per prompt (the paper's 2; more gives a pair more often)."""
    pairs: str = "best_worst"
    """best_worst: one pair per prompt, its best-scored response against its worst; all: every two of its
    responses with different scores."""
    beta: float = 0.1
    """β: the strength of the implicit KL anchor to the reference."""
    loss_type: str = "sigmoid"
    """sigmoid (DPO), ipo or hinge."""
    label_smoothing: float = 0.0
    """ε of conservative DPO: the share of labels assumed flipped (sigmoid only)."""
    reference: str = "auto"
    """auto (adapter-off for LoRA, else a frozen copy), copy or adapter."""
    reference_path: str | None = None
    """A separate reference checkpoint; null = the starting policy."""
    minibatches: int = 1
    """Optimizer steps per rollout: the step's pairs are split into this many shuffled minibatches."""
    log_completions: int = 4
    """(prompt, completion, score) samples written to samples.jsonl per step (0 = none)."""
    max_unscored_steps: int = 3
    """Stop after this many steps in a row in which no reward function scored any sample (0 = never)."""
    shared_prefix: bool | str = "auto"
    """Policy and reference passes with the two responses of a pair after one copy of their prompt (as
    GRPO's ``shared_prefix``): auto, true or false."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Held-out evaluation (eval.path or data.eval_fraction) at step 0, every run.eval_every steps and at the end."""
    alerts: AlertConfig = field(default_factory=AlertConfig)
    """Health alerts over the logged metrics: thresholds (console, progress bar, alerts.jsonl)."""

    def validate(self) -> None:
        validate_sections(self)
        self.rollout.check_sampling(self.sampling)
        if self.rollout.async_steps:
            raise ValueError(
                "rollout.async_steps applies to grpo and ppo; online DPO samples each step's batch with the current "
                "policy (rollout.async_steps=0)"
            )
        reject_ignored(self, {"model.device": PLACED_BY_ACCELERATE})
        if not self.rewards:
            raise ValueError("rewards: at least one reward function is needed ({function: module:function})")
        for i, spec in enumerate(self.rewards):
            spec.validate(f"rewards[{i}]")
        check_choice("pairs", self.pairs, PAIRINGS)
        check_choice("loss_type", self.loss_type, DPO_KINDS)
        check_choice("reference", self.reference, REFERENCE_MODES)
        check_shared_prefix(self.shared_prefix)
        if self.num_generations < 2:
            raise ValueError(f"num_generations must be >= 2 (a pair needs two responses), got {self.num_generations}")
        if self.run.batch_size % self.num_generations:
            raise ValueError(
                f"run.batch_size={self.run.batch_size} must be a multiple of num_generations={self.num_generations}"
            )
        if self.sampling.temperature == 0:
            raise ValueError(
                "sampling.temperature=0 is greedy decoding: the responses to a prompt are identical, every prompt "
                "ties and no pair is ever formed; use a temperature > 0"
            )
        if self.beta <= 0:
            raise ValueError(f"beta must be > 0, got {self.beta}")
        if self.rollout.importance_sampling != "none":
            raise ValueError(
                f"rollout.importance_sampling={self.rollout.importance_sampling}: online DPO's loss has no importance "
                "ratio to correct (it compares the policy with the reference on the fresh pairs); leave it none"
            )
        if not 0 <= self.label_smoothing < 0.5:
            raise ValueError(f"label_smoothing must be in [0, 0.5), got {self.label_smoothing}")
        if self.label_smoothing and self.loss_type != "sigmoid":
            raise ValueError("label_smoothing applies to loss_type=sigmoid only")
        if self.reference == "adapter" and (self.model.lora is None or self.reference_path):
            raise ValueError("reference=adapter needs model.lora and no reference_path")
        if self.minibatches < 1 or self.max_unscored_steps < 0:
            raise ValueError("minibatches must be >= 1 and max_unscored_steps >= 0 (0 = never stop)")


# --------------------------------------------------------------------------------------------------


def preference_pairs(scores: torch.Tensor, group_size: int, pairs: str = "best_worst"):
    """The preference pairs of a rollout's groups: (chosen rows, rejected rows, counts).

    scores: [B] (B = P·G, the G responses of a prompt in consecutive rows), NaN = not scored.
    best_worst: per prompt, its highest-scored response (the first of equal ones) against its lowest;
    all: every two of its responses i < j with different scores, the higher one chosen. Unscored rows
    take no part. counts: {"prompts", "with_pair", "tied" (two or more scored, all equal), "unscored"
    (fewer than two scored)}.
    """
    chosen, rejected = [], []
    counts = {"prompts": 0, "with_pair": 0, "tied": 0, "unscored": 0}
    for p, group in enumerate(scores.view(-1, group_size).tolist()):
        counts["prompts"] += 1
        scored = [(s, p * group_size + j) for j, s in enumerate(group) if not math.isnan(s)]
        if len(scored) < 2:
            counts["unscored"] += 1
            continue
        if pairs == "best_worst":
            best, worst = max(scored, key=lambda x: x[0]), min(scored, key=lambda x: x[0])
            found = [(best[1], worst[1])] if best[0] > worst[0] else []
        else:
            found = [
                (a[1], b[1]) if a[0] > b[0] else (b[1], a[1])
                for i, a in enumerate(scored)
                for b in scored[i + 1 :]
                if a[0] != b[0]
            ]
        counts["with_pair" if found else "tied"] += 1
        chosen += [c for c, _ in found]
        rejected += [r for _, r in found]
    return torch.tensor(chosen, dtype=torch.long), torch.tensor(rejected, dtype=torch.long), counts


@dataclass
class PairBatch:
    """Pairs as rollout rows: pair i is rows 2i (chosen) and 2i + 1 (rejected) of ``rollout``, whose
    temperature is 1 (log π of the model itself); ``valid`` [N] False = a padding pair (another process
    holds more pairs: every process runs the same number of forwards); ``ref_logprobs`` [2N, T]."""

    rollout: Rollout
    valid: torch.Tensor
    ref_logprobs: torch.Tensor | None = None

    def select(self, pairs: list[int]) -> PairBatch:
        rows = [r for i in pairs for r in (2 * i, 2 * i + 1)]
        ref = None if self.ref_logprobs is None else self.ref_logprobs[rows]
        return PairBatch(self.rollout.select(rows), self.valid[pairs], ref)


class OnlineDPOTrainer(OnlineTrainer):
    """Holds the policy, the reference and the rewards of an online DPO run; ``train_step`` is the
    module docstring's box."""

    name = "online_dpo"
    BAR_KEYS = ("reward/mean", "loss", "pairs/usable_share")
    SCORE_KEYS = ("reward/mean", "reward/std")

    def __init__(self, config: OnlineDPOConfig):
        super().__init__(config)
        acc = self.accelerator
        self.rewards = RewardComposer.from_specs(
            config.rewards, self.tokenizer, config.max_unscored_steps, warn=self.console_warning
        )
        policy = load_policy(replace(config.model, device="cpu"))
        self.reference = engines.build_reference(acc, policy, config.model, config.reference, config.reference_path)
        separate = [self.reference.model] if self.reference.model is not None else []
        self.shared = resolve_shared_prefix(
            config.shared_prefix, [policy, *separate], lambda x: acc.print(f"[{self.name}] {x}")
        )
        if config.shared_prefix == "auto" and self.shared.enabled and acc.num_processes == 1:
            self.shared.prompt_cache = not engines.is_deepspeed(acc)  # as GRPO: the prompt once, through its cache
        optimizer, scheduler = build_optimizer(
            [p for p in policy.parameters() if p.requires_grad], config.optim, self.total_steps * config.minibatches
        )
        model, optimizer = engines.prepare(acc, policy, optimizer)
        acc.register_for_checkpointing(scheduler)
        self.actor = Optimized(model, optimizer, scheduler, NonFiniteGuard(acc, config.run), config.optim.max_grad_norm)
        self.start_engine(acc.unwrap_model(model))

    def train_step(self, step: int, timer: PhaseTimer) -> tuple[dict, Rollout | None, torch.Tensor | None]:
        cfg, acc = self.config, self.accelerator
        # 1. sample K responses per prompt from the current policy
        with timer("generate"):
            prompts = self.sampler.take_for_process(self.local_prompts, self.prompts, acc)
            rollout, columns = self.generate(prompts, cfg.num_generations)
        # 2. score them (None = not scored: NaN in the total)
        with timer("reward"):
            out = score_rollout(self.rewards, rollout, columns)
        scores = out.total.to(acc.device)
        metrics = self.reward_metrics(out)
        # 3. pairs: best vs worst, or every two with different scores; ties and unscored prompts give none
        batch, pair_metrics = self.pairs_of(rollout, scores)
        metrics.update(pair_metrics)
        if batch is None:
            tied, unscored = pair_metrics["pairs/tied_prompts"], pair_metrics["pairs/unscored_prompts"]
            self.console_warning(
                f"step {step + 1}: no prompt has two responses with different scores ({tied:g} tied, {unscored:g} "
                "with fewer than two scored); no update"
            )
            return metrics, rollout, scores
        # 4. reference log-probs of the paired responses
        with timer("reference"):
            micro = 2 * cfg.run.micro_batch_size  # rows: two per pair
            batch.ref_logprobs = reference_logprobs(self.reference, batch.rollout, micro, acc.device, self.shared)
        # 5. one optimizer step per minibatch of pairs: the mean DPO loss over its pairs
        with timer("train"):
            metrics.update(self.update(step, batch))
        return metrics, rollout, scores

    # -- 2-3. scores and pairs ------------------------------------------------------------------------

    def reward_metrics(self, out: RewardOutput) -> dict[str, float]:
        """Each function's mean and its failure counts; added to ``step_metrics``: the mean and std of the
        scored responses (NaN, not 0, when none was) and the scored share, over all processes."""
        total = out.total.to(self.accelerator.device).double()
        scored = ~torch.isnan(total)
        values = torch.where(scored, total, 0.0)
        self.step_metrics.add(
            "reward",
            lambda t: {
                "reward/mean": ratio(t["sum"], t["scored"]),
                "reward/std": std_of(t["sum"], t["sum_sq"], t["scored"]),
                "reward/applicable_share": t["scored"] / t["rows"],
            },
            scored=scored.sum(),
            sum=values.sum(),
            sum_sq=values.square().sum(),
            rows=len(total),
        )
        metrics = {}
        for name, values in out.components.items():
            valid = [v for v in values if v is not None]
            metrics[f"reward/{name}/mean"] = sum(valid) / len(valid) if valid else math.nan
        return {**metrics, **self.rewards.fault_counts()}

    def pairs_of(self, rollout: Rollout, scores: torch.Tensor) -> tuple[PairBatch | None, dict[str, float]]:
        """The step's pairs on this process (``preference_pairs``), padded with invalid ones to the most
        any process holds, and their metrics; None when no process has a pair."""
        acc = self.accelerator
        chosen, rejected, counts = preference_pairs(scores.cpu(), self.config.num_generations, self.config.pairs)
        real = len(chosen)
        most = -global_min(acc, -real)
        prompts = global_sum(acc, counts["prompts"])
        metrics = {
            "pairs/count": global_sum(acc, real),
            "pairs/usable_share": global_sum(acc, counts["with_pair"]) / max(prompts, 1.0),
            "pairs/tied_prompts": global_sum(acc, counts["tied"]),
            "pairs/unscored_prompts": global_sum(acc, counts["unscored"]),
        }
        if most == 0:
            return None, metrics
        count = metrics["pairs/count"]
        score_chosen = global_sum(acc, scores[chosen.to(scores.device)].sum()) / count
        score_rejected = global_sum(acc, scores[rejected.to(scores.device)].sum()) / count
        metrics.update(
            {
                "pairs/score_chosen": score_chosen,
                "pairs/score_rejected": score_rejected,
                "pairs/score_margin": score_chosen - score_rejected,
            }
        )
        padding = [0] * (most - real)  # row 0 against itself, weight 0
        pairs = zip([*chosen.tolist(), *padding], [*rejected.tolist(), *padding], strict=True)
        rows = [r for pair in pairs for r in pair]
        valid = torch.arange(most) < real
        return PairBatch(replace(rollout.select(rows), temperature=1.0), valid), metrics

    # -- 5. policy update -------------------------------------------------------------------------------

    def update(self, step: int, batch: PairBatch) -> dict[str, float]:
        """One optimizer step per minibatch of pairs (shuffled when more than one), each the gradient of
        the mean DPO loss over its pairs (``online.MinibatchUpdate``: micro-batches of pairs, normalised
        over every process). Returns the loss, implicit-reward and KL metrics of the step, reduced over the
        processes at once."""
        cfg, acc = self.config, self.accelerator
        stats = StepStats()  # on the device until one reduction at the end of the step
        shuffle = cfg.minibatches > 1
        for _, pairs in minibatches(len(batch.valid), 1, cfg.minibatches, cfg.run.seed, step, shuffle):
            part = batch.select(pairs)
            # one loss unit per valid pair; a minibatch of padding pairs only is no update
            update = MinibatchUpdate(acc, self.actor, part.valid[:, None], "token-mean", cfg.run.micro_batch_size)
            for micro in update:  # gradients synchronised on the last micro-batch only
                loss, loss_stats = self.pair_loss(part, micro.rows, stats.sums)
                update.backward(micro, loss, loss_stats)  # ∇(loss · share): its part of the minibatch's mean
            if not update.empty:
                stats.add(update, grad_norm=update.step(step))
        out = stats.result(acc)
        kl = stats.sums.reduced
        out["kl/per_token"] = kl.get("k1", 0.0) / max(kl.get("tokens", 0.0), 1.0)
        out["kl/per_sequence"] = kl.get("k1", 0.0) / max(kl.get("responses", 0.0), 1.0)
        out["tokens_trained"] = kl.get("tokens", 0.0)
        return out

    def pair_loss(self, part: PairBatch, s: slice, kl: Tally):
        """(the mean DPO loss over the valid pairs of ``s``, its stats) of pairs ``s`` of a minibatch.

        log π(y|x) = Σ_t log π(y_t|x, y_<t) over the response tokens (τ = 1); the loss and the implicit
        rewards β·(log π − log π_ref) are ``core.dpo_loss``'s. Adds Σ k1 = Σ (log π − log π_ref) over the
        valid pairs' response tokens (``k1``), their token count (``tokens``) and their response count
        (``responses``) to ``kl``."""
        cfg, device = self.config, self.accelerator.device
        rows = slice(2 * s.start, 2 * s.stop)
        logprobs, _ = policy_logprobs(self.actor.model, part.rollout, rows, device, shared=self.shared)  # [2b, T]
        mask = part.rollout.response_mask[rows].to(device).bool()
        ref_logprobs = part.ref_logprobs[rows].to(device)
        logps, ref_logps = masked_sum(logprobs, mask, dim=1), masked_sum(ref_logprobs, mask, dim=1)  # [2b]
        losses, chosen_rewards, rejected_rewards = dpo_loss(
            logps[0::2], logps[1::2], ref_logps[0::2], ref_logps[1::2], cfg.beta, cfg.loss_type, cfg.label_smoothing
        )
        valid = part.valid[s].to(device)
        counted = mask & valid.repeat_interleave(2)[:, None]
        k1 = torch.where(counted, logprobs.detach() - ref_logprobs, 0.0)
        kl.add("k1", k1.sum())
        kl.add("tokens", counted.sum())
        kl.add("responses", 2 * valid.sum())
        stats = {
            "loss": masked_mean(losses.detach(), valid),
            "rewards/chosen": masked_mean(chosen_rewards, valid),
            "rewards/rejected": masked_mean(rejected_rewards, valid),
            "rewards/accuracy": masked_mean((chosen_rewards > rejected_rewards).float(), valid),
            "rewards/margin": masked_mean(chosen_rewards - rejected_rewards, valid),
            "logps/chosen": masked_mean(logps[0::2].detach(), valid),
            "logps/rejected": masked_mean(logps[1::2].detach(), valid),
        }
        return masked_mean(losses, valid), stats


@holds_run_dir  # the run folder stays locked until the run ends (runlock)
def train(config: OnlineDPOConfig, callbacks=()) -> dict:
    """Run online DPO; writes ``<run.output_dir>/final/policy``."""
    return OnlineDPOTrainer(config).train(callbacks)
