"""Group Relative Policy Optimization (Shao et al. 2024, DeepSeekMath §4.1) and its modern variants.

Per step, for P prompts:
  1. sample G responses per prompt, keeping their sampling log-probs (the "old" policy);
  2. score every response with the weighted reward functions (None = not applicable, never 0);
     optionally DAPO's overlong soft penalty; optionally drop groups whose rewards are all equal and
     sample more prompts (DAPO dynamic sampling);
  3. reference log-probs (only when kl_coef > 0) and the per-token KL;
  4. advantages: GRPO (r − mean_g) / std (scale group | batch | none = Dr. GRPO), RLOO, or REINFORCE++
     (token rewards with KL, reward-to-go, batch-whitened); optionally entropy control (``entropy_control``):
     the tokens whose policy gradient trains, chosen once over the step's batch of every process;
  5. μ = ``num_iterations`` passes over ``minibatches`` minibatches: PPO-clipped surrogate with the
     advantage shared by every token of a response (clip-higher when clip_high > clip_low), or GSPO's
     sequence ratio, CISPO's clipped weight, GMPO's geometric mean or SAPO's soft gate (``policy_loss``),
     KL to the reference in the loss (k3, DeepSeekMath) or in the reward (k1), reduced by ``loss_agg``;
  6. log; checkpoint.

Departures from the paper: the loss reduction is a named choice (``loss_agg``) because the paper's
per-sequence length normalisation biases the objective (Liu et al. 2025); presets set the knobs of
GRPO, DAPO, Dr. GRPO, GSPO, CISPO, GMPO and SAPO at once and are printed at start. Equations, knobs and tests:
docs/algorithms/grpo.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch

from posttrain.core import (
    AGGREGATION_MODES,
    KL_ESTIMATORS,
    POLICY_LOSSES,
    TokenSelection,
    aggregate_loss,
    gae,
    group_advantages,
    kl_penalty,
    masked_mean,
    masked_sum,
    policy_loss_knobs,
    rloo_advantages,
    selected_policy_loss,
    shape_rewards,
)
from posttrain.data import DataConfig
from posttrain.envs import EnvConfig, with_environment_reward
from posttrain.models import ModelConfig, load_policy
from posttrain.monitor import AlertConfig, EvalConfig
from posttrain.rewards import RewardComposer, RewardSpec, overlong_penalty, score_rollout
from posttrain.rewards.process import ProcessReward, ProcessRewardConfig
from posttrain.rollout import Rollout, RolloutConfig, SamplingParams, concat_rollouts
from posttrain.runtime import engines
from posttrain.runtime.config import (
    PLACED_BY_ACCELERATE,
    OptimConfig,
    RunConfig,
    check_choice,
    check_policy_loss,
    check_sapo_knobs,
    python_sections,
    reject_ignored,
    validate_sections,
    with_presets,
)
from posttrain.runtime.entropy_control import EntropyControlConfig, select_tokens
from posttrain.runtime.loop import NonFiniteGuard, PhaseTimer, build_optimizer, global_sums
from posttrain.runtime.online import (
    OffPolicyTally,
    OnlineTrainer,
    advantage_metrics,
    check_episodes,
    first_minibatch_metrics,
    gather_whiten,
    global_min,
    kl_metrics,
    minibatches,
    old_logprobs_of,
    policy_logprobs,
    reference_logprobs,
)
from posttrain.runtime.prefix import check_shared_prefix, resolve_shared_prefix
from posttrain.runtime.runlock import holds_run_dir
from posttrain.runtime.update import MinibatchUpdate, Optimized, StepStats, ratio, std_of

ADVANTAGE_ESTIMATORS = ("grpo", "rloo", "reinforce++")
REWARD_SCALES = ("group", "batch", "none")
KL_PLACEMENTS = ("loss", "reward")


@python_sections  # sections and rewards given in Python resolve as YAML's do
@with_presets
@dataclass
class GRPOConfig:
    """posttrain grpo. ``run.batch_size`` counts completions per step (prompts × num_generations)."""

    PRESETS = {
        "grpo": {
            "policy_loss": "ppo",
            "loss_agg": "seq-mean-token-mean",
            "clip_low": 0.2,
            "clip_high": 0.2,
            "scale_rewards": "group",
            "advantage_estimator": "grpo",
            "kl_in": "loss",
            "kl_estimator": "k3",
        },
        "dapo": {
            "policy_loss": "ppo",
            "loss_agg": "token-mean",
            "clip_low": 0.2,
            "clip_high": 0.28,
            "scale_rewards": "group",
            "advantage_estimator": "grpo",
            "dynamic_sampling": True,
            "overlong_buffer_fraction": 0.2,
            "kl_coef": 0.0,
        },
        "dr_grpo": {
            "policy_loss": "ppo",
            "loss_agg": "seq-mean-token-sum-norm",
            "clip_low": 0.2,
            "clip_high": 0.2,
            "scale_rewards": "none",
            "advantage_estimator": "grpo",
        },
        "gspo": {  # Zheng et al. 2025, §5.1: these clip ranges, 4 minibatches per rollout batch; no KL term
            "policy_loss": "gspo",
            "loss_agg": "seq-mean-token-mean",
            "clip_low": 3e-4,
            "clip_high": 4e-4,
            "minibatches": 4,
            "scale_rewards": "group",
            "advantage_estimator": "grpo",
            "kl_coef": 0.0,
        },
        "cispo": {  # MiniMax 2025: no lower bound on the weight, a token-level mean, no KL term
            "policy_loss": "cispo",
            "loss_agg": "token-mean",
            "clip_low": 1.0,
            "clip_high": 0.28,  # ε_high is not published; DAPO's value
            "scale_rewards": "group",
            "advantage_estimator": "grpo",
            "kl_coef": 0.0,
        },
        "gmpo": {  # Zhao et al. 2025: log-space clip (e^-0.4, e^0.4) (§4), one term per response, no KL term
            "policy_loss": "gmpo",
            "loss_agg": "seq-mean-token-mean",
            "clip_low": 0.4,
            "clip_high": 0.4,
            "scale_rewards": "group",
            "advantage_estimator": "grpo",
            "kl_coef": 0.0,
        },
        "sapo": {  # Gao et al. 2025: τ_pos = 1.0, τ_neg = 1.05, (1/G) Σ_i (1/|y_i|) Σ_t, no KL term
            "policy_loss": "sapo",
            "loss_agg": "seq-mean-token-mean",
            "tau_pos": 1.0,
            "tau_neg": 1.05,
            "scale_rewards": "group",
            "advantage_estimator": "grpo",
            "kl_coef": 0.0,
        },
    }

    model: ModelConfig = field(default_factory=ModelConfig)
    """The policy, usually an SFT model (``model.lora`` for LoRA: the reference is then the adapter-off model)."""
    data: DataConfig = field(default_factory=lambda: DataConfig(max_length=None, max_prompt_length=512))
    """Prompt rows {"prompt", ...}; the other columns go to the reward functions."""
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-6, scheduler="constant"))
    """Optimizer and schedule."""
    run: RunConfig = field(default_factory=RunConfig)
    """Steps (rollout batches), completions per step (batch_size), micro_batch_size, logging, checkpoints."""
    sampling: SamplingParams = field(default_factory=lambda: SamplingParams(max_new_tokens=256, temperature=1.0))
    """How responses are sampled."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """The engine that samples (hf | lean | vllm, colocate | server) and the sampler/trainer mismatch correction."""
    rewards: list[RewardSpec] = field(default_factory=list)
    """Reward functions and weights: [{function: module:function, weight: 1.0, kwargs: {...}}]. With an ``env``
    they read the model's last turn as the completion, and the environment's own reward joins them."""
    env: EnvConfig = field(default_factory=EnvConfig)
    """Multi-turn episodes with a tool-giving environment (docs/algorithms/multi_turn.md); name=none: one turn."""
    process_reward_model: ProcessRewardConfig | None = None
    """A process reward model (posttrain prm): {path, aggregation: min|sum|last, weight}; weight · the aggregate of
    each response's step scores joins its reward (docs/algorithms/process_rewards.md); null = none."""
    num_generations: int = 8
    """G: responses sampled per prompt."""
    advantage_estimator: str = "grpo"
    """grpo (group-normalised), rloo (leave-one-out) or reinforce++ (batch-whitened reward-to-go)."""
    scale_rewards: str = "group"
    """GRPO's divisor: group std, batch std, or none (Dr. GRPO)."""
    kl_coef: float = 0.04
    """β of the KL to the reference; 0 loads no reference at all."""
    kl_estimator: str = "k3"
    """KL estimator in the loss: k1, k2 or k3 (with kl_in=reward k1 is used, per token)."""
    kl_in: str = "loss"
    """Where the KL goes: loss (DeepSeekMath) or reward (per-token k1, RLHF-style)."""
    policy_loss: str = "ppo"
    """The policy loss per token: ppo (clipped token ratio), gspo (one length-normalised ratio per response,
    clipped per response), gspo-token (GSPO's ratio, each token's own gradient and advantage), cispo
    (the clipped ratio as a detached weight on log π: no token loses its gradient), gmpo (the geometric mean
    of the token ratios, each clipped in log space first) or sapo (a smooth sigmoid gate of the token ratio
    in place of the clip)."""
    loss_agg: str = "seq-mean-token-mean"
    """Loss reduction: token-mean, seq-mean-token-mean, seq-mean-token-sum, seq-mean-token-sum-norm."""
    clip_low: float = 0.2
    """ε_low: the ratio (cispo: the weight) is clipped below at 1 − clip_low; cispo: ≥ 1 = no lower bound;
    gmpo: in log space, the ratio below at e^−clip_low (GMPO uses 0.4); not used by sapo."""
    clip_high: float | None = None
    """ε_high: clipped above at 1 + clip_high (null = clip_low; DAPO uses 0.28, GSPO 4e-4; gmpo: at
    e^clip_high, GMPO 0.4); not used by sapo."""
    tau_pos: float = 1.0
    """τ_pos of policy_loss=sapo: the temperature of the gate of tokens with a positive advantage."""
    tau_neg: float = 1.05
    """τ_neg of policy_loss=sapo: the temperature for the other tokens (larger: their gate closes sooner)."""
    num_iterations: int = 1
    """μ: updates per rollout (old log-probs are the sampling ones)."""
    minibatches: int = 1
    """Optimizer steps per iteration: the rollout batch is split into this many shuffled minibatches."""
    dynamic_sampling: bool = False
    """Drop groups whose rewards are all equal and sample more prompts to fill the batch (DAPO)."""
    max_sampling_tries: int = 4
    """Rollout rounds per step with dynamic sampling before training on what was kept."""
    mask_truncated: bool = False
    """Leave responses that hit max_new_tokens without EOS out of the loss."""
    overlong_buffer_fraction: float = 0.0
    """DAPO overlong soft penalty: buffer = this × max_new_tokens (0 = off)."""
    overlong_penalty_weight: float = 1.0
    """Weight of the overlong penalty in the reward."""
    reference: str = "auto"
    """auto (adapter-off for LoRA, else a frozen copy), copy or adapter."""
    preset: str = "none"
    """grpo, dapo, dr_grpo, gspo, cispo, gmpo or sapo: sets several knobs at once (printed at start); an explicit
    number or switch wins, a choice (policy_loss, loss_agg, ...) other than the preset's fails at start."""
    log_completions: int = 4
    """(prompt, completion, score) samples written to samples.jsonl per step (0 = none)."""
    max_unscored_steps: int = 3
    """Stop after this many steps in a row in which no reward function scored any sample (0 = never)."""
    shared_prefix: bool | str = "auto"
    """Training passes (policy, reference, old log-probs) with the samples of a prompt in one row: the
    prompt once, then its responses, each attending to the prompt and to itself only. auto: when the
    model takes such a 4-D attention mask exactly and a micro-batch's packed rows cost fewer FLOPs
    (rarely with short prompts and long responses: the G responses make one long row, and the
    dense mask computes attention over all of it); otherwise, on one process without DeepSpeed or
    gradient checkpointing, each prompt once with its samples run as continuations of its KV cache;
    true: always packed rows; false: never."""
    entropy_control: EntropyControlConfig = field(default_factory=EntropyControlConfig)
    """Which tokens get the policy gradient: all (none), the high-entropy minority, or all but those whose
    log-prob/advantage covariance drives the entropy down (clip_cov, kl_cov); docs/algorithms/grpo.md."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Held-out evaluation (eval.path or data.eval_fraction) at step 0, every run.eval_every steps and at the end."""
    alerts: AlertConfig = field(default_factory=AlertConfig)
    """Health alerts over the logged metrics: thresholds (console, progress bar, alerts.jsonl)."""

    def validate(self) -> None:
        validate_sections(self)
        self.rollout.check_sampling(self.sampling)
        reject_ignored(
            self,
            {
                "model.device": PLACED_BY_ACCELERATE,
            },
        )
        if not self.rewards and not self.env.enabled:
            raise ValueError("rewards: at least one reward function is needed ({function: module:function})")
        for i, spec in enumerate(self.rewards):
            spec.validate(f"rewards[{i}]")
        if self.max_unscored_steps < 0:
            raise ValueError(f"max_unscored_steps must be >= 0 (0 = never stop), got {self.max_unscored_steps}")
        check_choice("preset", self.preset, ["none", *self.PRESETS])
        check_choice("advantage_estimator", self.advantage_estimator, ADVANTAGE_ESTIMATORS)
        check_choice("scale_rewards", self.scale_rewards, REWARD_SCALES)
        check_choice("kl_estimator", self.kl_estimator, KL_ESTIMATORS)
        check_choice("kl_in", self.kl_in, KL_PLACEMENTS)
        check_choice("loss_agg", self.loss_agg, AGGREGATION_MODES)
        check_choice("reference", self.reference, ("auto", "copy", "adapter"))
        check_shared_prefix(self.shared_prefix)
        if self.num_generations < 2:
            raise ValueError(f"num_generations must be >= 2 (a group needs two responses), got {self.num_generations}")
        if self.run.batch_size % self.num_generations:
            raise ValueError(
                f"run.batch_size={self.run.batch_size} must be a multiple of num_generations={self.num_generations}"
            )
        for key in ("num_iterations", "minibatches", "max_sampling_tries"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key} must be >= 1, got {getattr(self, key)}")
        if self.kl_coef < 0:
            raise ValueError(f"kl_coef must be >= 0, got {self.kl_coef}")
        if self.kl_in == "loss" and self.kl_coef > 0 and self.kl_estimator == "k1":
            raise ValueError(
                "kl_estimator=k1 with kl_in=loss: the gradient of k1 = log π − log π_ref on on-policy samples is "
                "∇log π, whose expectation is 0, so the loss would not pull towards the reference; use k2 "
                "(its gradient is ∇KL(π‖π_ref)) or k3 (DeepSeekMath's choice), or kl_in=reward for k1"
            )
        if not 0 <= self.overlong_buffer_fraction <= 1:
            raise ValueError(f"overlong_buffer_fraction must be in [0, 1], got {self.overlong_buffer_fraction}")
        check_policy_loss(self.policy_loss, self.clip_low, self.clip_high, POLICY_LOSSES)
        check_sapo_knobs(self)
        if self.rollout.async_steps and self.dynamic_sampling:
            raise ValueError(
                "rollout.async_steps >= 1 with dynamic_sampling=true: dynamic sampling draws a varying number of "
                "batches per step, the producer a fixed schedule of one per step; turn one of them off"
            )
        check_episodes(self)
        updates = f"num_iterations={self.num_iterations}, minibatches={self.minibatches}"
        self.entropy_control.check_trainer(self.num_iterations * self.minibatches, updates, self.policy_loss)
        if self.policy_loss == "gspo" and self.advantage_estimator == "reinforce++":
            raise ValueError(
                "policy_loss=gspo clips one ratio per response by the response's one advantage; reinforce++ gives "
                "each token its own: use policy_loss=gspo-token (GSPO's ratio with per-token advantages)"
            )
        if self.policy_loss == "gmpo" and (
            self.advantage_estimator == "reinforce++" or self.rollout.importance_sampling in ("token", "token_mask")
        ):
            given = (
                "advantage_estimator=reinforce++"
                if self.advantage_estimator == "reinforce++"
                else f"rollout.importance_sampling={self.rollout.importance_sampling}"
            )
            raise ValueError(
                f"policy_loss=gmpo with {given}: GMPO takes one advantage per response (its sign picks the clip "
                "side of every token), and these weigh each token's own; use policy_loss=sapo or gspo-token, or "
                "advantage_estimator=grpo|rloo and rollout.importance_sampling=none|sequence|sequence_mask"
            )
        if self.policy_loss == "gspo" and self.rollout.importance_sampling in ("token", "token_mask"):
            by = " (preset=gspo sets it)" if self.preset == "gspo" else ""
            raise ValueError(
                f"policy_loss=gspo{by} with rollout.importance_sampling={self.rollout.importance_sampling}: GSPO gives "
                "every token of a response the gradient of its one ratio, so a token's weight is averaged over the "
                "response and a dropped token still trains; use policy_loss=gspo-token (each token its own gradient) "
                "or rollout.importance_sampling=sequence|sequence_mask"
            )

    @property
    def prompts_per_step(self) -> int:
        return self.run.batch_size // self.num_generations

    def preset_report(self) -> str:
        """The knobs the preset sets and the values in force (an explicit setting wins over the preset)."""
        if self.preset == "none":
            return "preset: none"
        parts = []
        for key, value in self.PRESETS[self.preset].items():
            actual = getattr(self, key)
            parts.append(f"{key}={actual}" + ("" if actual == value else f" (preset {value}, overridden)"))
        return f"preset {self.preset}: " + ", ".join(parts)


# --------------------------------------------------------------------------------------------------


def _scores_with_missing(total: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(scores, applicable [B] bool). Rows no reward function scored are not applicable: their group
    statistics leave them out, their advantage is 0 and the loss masks them. Their score is filled with
    the group's mean, so a group is constant (dynamic sampling) exactly when its scored rows are."""
    applicable = ~torch.isnan(total)
    grouped = total.view(-1, group_size)
    valid = applicable.view(-1, group_size)
    means = torch.where(valid, grouped, 0.0).sum(1, keepdim=True) / valid.sum(1, keepdim=True).clamp(min=1)
    return torch.where(valid, grouped, means).reshape(-1), applicable


def _constant_groups(scores: torch.Tensor, group_size: int) -> torch.Tensor:
    grouped = scores.view(-1, group_size)
    return grouped.amax(1) == grouped.amin(1)  # [P]


@dataclass
class GRPOBatch:
    """The rows of a rollout a GRPO minibatch trains on: the response ``mask`` (without unscored and,
    with mask_truncated, truncated rows), advantages ([b] or [b, T] for reinforce++), the old log-probs
    and, with the KL in the loss, the reference's (all [b, T])."""

    rollout: Rollout
    mask: torch.Tensor
    advantages: torch.Tensor
    old_logprobs: torch.Tensor | None  # None: the update's own forward, detached (one pass, one minibatch)
    ref_logprobs: torch.Tensor | None
    selection: TokenSelection | None = None  # entropy control's tokens of these rows (None: every token)


class GRPOTrainer(OnlineTrainer):
    """Holds the models and state of a GRPO run; ``train_step`` is the module docstring's box."""

    name = "grpo"
    BAR_KEYS = ("reward/mean", "kl/per_token", "policy/clipfrac")
    SCORE_KEYS = ("reward/mean", "reward/std")

    def __init__(self, config: GRPOConfig):
        super().__init__(config)
        acc = self.accelerator
        acc.print(f"[grpo] {config.preset_report()}")
        if config.sampling.temperature == 0:
            acc.print(
                "[grpo] warning: sampling.temperature=0 is greedy decoding: the num_generations responses to a "
                "prompt are identical, every group advantage is 0 and the policy does not learn; use a temperature > 0"
            )
        self.rewards = RewardComposer.from_specs(
            with_environment_reward(config.rewards, config.env),
            self.tokenizer,
            config.max_unscored_steps,
            warn=self.console_warning,
        )
        self.process_reward = None
        if config.process_reward_model is not None:
            self.process_reward = ProcessReward(config.process_reward_model, self.tokenizer, str(acc.device))
            self.process_reward.model = engines.prepare_frozen(acc, self.process_reward.model)
        policy = load_policy(replace(config.model, device="cpu"))
        self.reference = None
        if config.kl_coef > 0:  # kl_coef = 0 loads no reference at all
            self.reference = engines.build_reference(acc, policy, config.model, config.reference)
        separate = [self.reference.model] if self.reference is not None and self.reference.model is not None else []
        self.shared = resolve_shared_prefix(
            config.shared_prefix, [policy, *separate], lambda x: acc.print(f"[grpo] {x}")
        )
        # auto, where packing does not pay: each prompt once, its samples continuing its KV cache. One
        # process only: under DDP the pass's two forwards would meet its one-forward-per-backward hooks
        if config.shared_prefix == "auto" and self.shared.enabled and acc.num_processes == 1:
            self.shared.prompt_cache = not engines.is_deepspeed(acc)
        updates = self.total_steps * config.num_iterations * config.minibatches
        optimizer, scheduler = build_optimizer(
            [p for p in policy.parameters() if p.requires_grad], config.optim, updates
        )
        model, optimizer = engines.prepare(acc, policy, optimizer)
        acc.register_for_checkpointing(scheduler)
        self.actor = Optimized(model, optimizer, scheduler, NonFiniteGuard(acc, config.run), config.optim.max_grad_norm)
        self.passes = {"old_logprobs": 0, "reference": 0, "policy_train": 0, "entropy": 0}
        self.start_engine(acc.unwrap_model(model))

    def train_step(self, step: int, timer: PhaseTimer) -> tuple[dict, Rollout | None, torch.Tensor | None]:
        cfg, acc, device = self.config, self.accelerator, self.accelerator.device
        micro = cfg.run.micro_batch_size
        # 1-2. sample G responses per prompt and score them (dynamic sampling: keep groups with a signal)
        rollout, scores, applicable, metrics = self.rollout_and_score(timer, step)
        if rollout is None:
            if not metrics.get("rollout/stale_batches"):
                acc.print(f"[grpo] step {step + 1}: every sampled group had equal rewards; no update")
            return metrics, None, None
        mask = self.loss_mask(rollout, applicable)
        trainable, scored = global_sums(acc, mask.sum(), applicable.sum())
        if trainable == 0:  # nothing to train on: no update, no policy metrics (not 0s)
            if scored > 0:  # unscored rows were announced by the reward composer
                self.console_warning(
                    f"step {step + 1}: every scored response hit max_new_tokens and mask_truncated leaves it out; "
                    "no update"
                )
            metrics.update(self.reward_metrics(scores, applicable))
            return metrics, rollout, scores
        single_pass = self.single_pass(rollout)
        old_logprobs = is_weights = None
        if not single_pass:
            with timer("old_logprobs"):
                old_logprobs, is_weights, mismatch = old_logprobs_of(
                    acc, self.engine, rollout, self.logprobs_of, micro, cfg.rollout, self.step_metrics
                )
            self.passes["old_logprobs"] += rollout.version is not None or not self.engine.logprobs_exact
            metrics.update(mismatch)
        # 3. reference log-probs and the per-token KL
        ref_logprobs = kl = None
        if self.reference is not None:
            with timer("reference"):
                ref_logprobs = reference_logprobs(self.reference, rollout, micro, device, self.shared)
            self.passes["reference"] += 1
            if not single_pass:  # else the update's forward tallies it (OffPolicyTally)
                kl = kl_penalty(old_logprobs, ref_logprobs, "k1" if cfg.kl_in == "reward" else cfg.kl_estimator)
                kl_metrics(self.step_metrics, kl, mask)
        # 4. advantages, shared by every token of a response (but reinforce++'s)
        advantages = self.advantages(scores, applicable, kl, mask)
        adv_tokens = advantages if advantages.dim() == 2 else advantages[:, None].expand_as(mask)
        advantage_metrics(self.step_metrics, adv_tokens, mask)
        # 4b. entropy control: the tokens whose policy gradient trains, chosen once over the whole step's batch
        selection = self.select_tokens(step, rollout, old_logprobs, adv_tokens, mask, metrics)
        if is_weights is not None:  # w·min(r·A, clip(r)·A) = min(r·wA, clip(r)·wA) for w ≥ 0
            advantages = adv_tokens * is_weights
        # 5. μ iterations over minibatches of the clipped surrogate
        with timer("train"):
            metrics.update(self.update(step, rollout, old_logprobs, ref_logprobs, advantages, mask, selection))
        # 6. log
        metrics.update(self.reward_metrics(scores, applicable))
        return metrics, rollout, scores

    # -- 1-2. rollout and rewards ---------------------------------------------------------------

    def _score(self, rollout: Rollout, columns: dict) -> tuple[torch.Tensor, dict]:
        out = score_rollout(self.rewards, rollout, columns)
        cfg = self.config
        scores = out.total
        if cfg.overlong_buffer_fraction > 0:
            buffer = max(1, round(cfg.overlong_buffer_fraction * cfg.sampling.max_new_tokens))
            penalty = torch.tensor(
                [overlong_penalty(int(n), cfg.sampling.max_new_tokens, buffer) for n in rollout.response_lengths]
            )
            scores = scores + cfg.overlong_penalty_weight * penalty
            out.components["overlong_penalty"] = penalty.tolist()
        if self.process_reward is not None:  # + weight · min|sum|last of the step scores σ(z_k)
            process, steps = self.process_reward.response_scores(rollout, cfg.run.micro_batch_size)
            scores = scores + cfg.process_reward_model.weight * process.to(scores.device)
            out.components["process"], out.components["process_steps"] = process.tolist(), steps.tolist()
        return scores, out.components

    def rollout_and_score(self, timer: PhaseTimer, step: int = 0):
        """Steps 1–2 of step ``step``, with dynamic sampling when configured. Returns (rollout, scores,
        applicable, metrics); rollout None: nothing to train on (every group constant, or a stale batch
        dropped)."""
        cfg, G = self.config, self.config.num_generations
        kept, kept_scores, components = [], [], {}
        sampled_groups = constant_groups = 0
        produced: dict = {}
        target, tries = self.local_prompts, 0
        while True:
            needed = target - sum(len(r) for r in kept) // G
            need_all = -global_min(self.accelerator, -needed)  # the largest need of any process
            if need_all <= 0 or tries >= (cfg.max_sampling_tries if cfg.dynamic_sampling else 1):
                break
            tries += 1
            with timer("generate"):
                rollout, columns, produced = self.next_rollout(step, need_all, G)
            if rollout is None:  # a stale batch, dropped (rollout.on_stale=drop)
                return None, None, None, produced
            with timer("reward"):
                scores, parts = self._score(rollout, columns)
            filled, _ = _scores_with_missing(scores, G)
            constant = _constant_groups(filled, G)
            sampled_groups += len(constant)
            constant_groups += int(constant.sum())
            keep_groups = (
                (~constant).nonzero().flatten().tolist() if cfg.dynamic_sampling else list(range(len(constant)))
            )
            rows = [g * G + j for g in keep_groups for j in range(G)]
            kept.append(rollout.select(rows))
            kept_scores.append(scores[rows])
            for name, values in parts.items():
                components.setdefault(name, []).extend(values[i] for i in rows)
        # every process trains on the same number of groups (equal micro-batch counts under DDP)
        groups = global_min(self.accelerator, min(sum(len(r) for r in kept) // G, target))
        trained = groups * self.accelerator.num_processes
        self.step_metrics.add(  # reduced at the end of the step
            "groups",
            lambda t: {
                "groups/zero_variance_share": t["constant"] / max(t["sampled"], 1.0),
                "groups/sampled": t["sampled"],
                "groups/dropped": t["sampled"] - trained,
            },
            constant=constant_groups,
            sampled=sampled_groups,
        )
        metrics = {"groups/trained": trained, "sampling_tries": tries, **produced}
        if groups == 0:
            return None, None, None, metrics
        rollout = concat_rollouts(kept, self.tokenizer.pad_token_id).select(list(range(groups * G)))
        scores = torch.cat(kept_scores)[: groups * G]
        for name, values in components.items():
            scored = [v for v in values[: groups * G] if v is not None]
            metrics[f"reward/{name}/mean"] = sum(scored) / len(scored) if scored else math.nan
        metrics.update(self.rewards.fault_counts())
        scores, applicable = _scores_with_missing(scores, G)
        return rollout, scores.to(self.accelerator.device), applicable.to(self.accelerator.device), metrics

    # -- 4. advantages ----------------------------------------------------------------------------

    def advantages(
        self, scores: torch.Tensor, applicable: torch.Tensor, kl: torch.Tensor | None, mask: torch.Tensor
    ) -> torch.Tensor:
        """[B] (grpo, rloo) or [B, T] (reinforce++) advantages from the sequence scores; group statistics
        over the applicable (scored) rows only."""
        cfg, acc, G = self.config, self.accelerator, self.config.num_generations
        kl_reward = cfg.kl_in == "reward" and kl is not None
        if cfg.advantage_estimator == "reinforce++":
            token_rewards = shape_rewards(
                scores,
                kl if kl_reward else torch.zeros_like(mask, dtype=scores.dtype),
                mask,
                cfg.kl_coef if kl_reward else 0.0,
            )
            returns, _ = gae(token_rewards, torch.zeros_like(token_rewards), mask, gamma=1.0, lam=1.0)
            return gather_whiten(acc, returns, mask)
        if kl_reward:
            scores = scores - cfg.kl_coef * torch.where(mask.bool(), kl, 0.0).sum(-1)
        if cfg.advantage_estimator == "rloo":
            return rloo_advantages(scores, G, mask=applicable)
        # group statistics need the whole batch only for scale=batch; gather keeps groups whole
        if acc.num_processes == 1:
            return group_advantages(scores, G, cfg.scale_rewards, mask=applicable)
        start, local = acc.process_index * len(scores), len(scores)
        everyone = group_advantages(acc.gather(scores), G, cfg.scale_rewards, mask=acc.gather(applicable.long()))
        return everyone[start : start + local]

    def loss_mask(self, rollout: Rollout, applicable: torch.Tensor) -> torch.Tensor:
        """The mask of the sampled tokens [B, T] without the rows no reward function scored and, with
        ``mask_truncated``, without the responses cut at max_new_tokens."""
        mask = rollout.action_mask.clone()
        if self.config.mask_truncated:
            mask[rollout.truncated] = 0
        mask[~applicable] = 0
        return mask

    def reward_metrics(self, scores: torch.Tensor, applicable: torch.Tensor) -> dict[str, float]:
        """β and the forward passes run so far; added to ``step_metrics``: the mean and std of the scored rows
        (mean NaN, not 0, when none was; the group-mean fillers of unscored rows count in neither) and the
        applicable share, over all processes."""
        valid_scores = scores[applicable].double()
        self.step_metrics.add(
            "reward",
            lambda t: {
                "reward/mean": ratio(t["scored_sum"], t["scored"]),
                "reward/applicable_share": t["scored"] / t["rows"],
                "reward/std": std_of(t["scored_sum"], t["scored_sum_sq"], t["scored"]),
            },
            scored=len(valid_scores),
            scored_sum=valid_scores.sum(),
            scored_sum_sq=valid_scores.square().sum(),
            rows=len(scores),
        )
        return {"kl_coef": self.config.kl_coef, **{f"passes/{k}": v for k, v in self.passes.items()}}

    def select_tokens(self, step: int, rollout: Rollout, old_logprobs, advantages, mask, metrics: dict):
        """``entropy_control``'s selection of this process's rows [B, T] (``select_tokens``; None: every token
        trains); its metrics into ``metrics``. high_entropy's no-grad forward for π_old's entropy counts in
        ``passes/entropy``."""
        cfg, acc = self.config, self.accelerator
        model, shared = self.actor.model, self.shared

        def entropy_of(rows: slice) -> torch.Tensor:  # π_old's entropy [b, T]
            return policy_logprobs(model, rollout, rows, acc.device, with_entropy=True, shared=shared)[1]

        control = cfg.entropy_control
        selection, chosen = select_tokens(acc, control, cfg.run, step, mask, entropy_of, old_logprobs, advantages)
        self.passes["entropy"] += control.needs_entropy
        metrics.update(chosen)
        return selection

    # -- 5. policy update ---------------------------------------------------------------------------

    def update(self, step: int, rollout: Rollout, old_logprobs, ref_logprobs, advantages, mask, selection=None) -> dict:
        """μ = ``num_iterations`` passes over ``minibatches`` minibatches (shuffled when more than one), one
        optimizer step each: per micro-batch forward, per-token loss, ``loss_agg``, backward of its share; then
        the step. Returns the policy metrics of the step, reduced over the processes at once; ``entropy`` is
        the token mean over the first pass (the sampling policy's)."""
        cfg, acc = self.config, self.accelerator
        stats = StepStats()  # on the device until one reduction at the end of the step
        self.tally = OffPolicyTally() if old_logprobs is None else None
        shuffle = cfg.minibatches > 1
        for iteration, rows in minibatches(
            len(rollout), cfg.num_iterations, cfg.minibatches, cfg.run.seed, step, shuffle
        ):
            ref = None if ref_logprobs is None or cfg.kl_in != "loss" else ref_logprobs[rows]
            old = None if old_logprobs is None else old_logprobs[rows]
            chosen = None if selection is None else selection.rows(rows)
            batch = GRPOBatch(rollout.select(rows), mask[rows], advantages[rows], old, ref, chosen)
            update = MinibatchUpdate(acc, self.actor, batch.mask, cfg.loss_agg, cfg.run.micro_batch_size)
            if update.empty:  # no token of this minibatch trains (unscored or masked rows): no forward, no step
                continue
            for micro in update:  # gradients synchronised on the last micro-batch only
                loss, loss_stats, entropy = self.policy_loss(batch, micro.rows, with_entropy=iteration == 0)
                update.backward(micro, loss, loss_stats)  # ∇(loss · share): its part of the minibatch's mean
                if entropy is not None:  # the sampling policy's entropy, over the first pass's tokens
                    stats.sums.add("entropy", masked_sum(entropy, batch.mask[micro.rows]))
                    stats.sums.add("tokens", batch.mask[micro.rows].bool().sum())
            stats.add(update, grad_norm=update.step(step))
        off_policy = () if self.tally is None else (self.tally.tally,)
        out = {("policy/" + k if k != "grad_norm" else k): v for k, v in stats.result(acc, *off_policy).items()}
        sums = stats.sums.reduced
        out["entropy"] = sums.get("entropy", 0.0) / max(sums.get("tokens", 0.0), 1.0)
        if self.tally is not None:
            out.update(self.tally.metrics(cfg.rollout.importance_sampling != "none"))
        return {**out, **first_minibatch_metrics(stats.first)}

    def policy_loss(self, batch: GRPOBatch, s: slice, with_entropy: bool):
        """(the loss of rows ``s``: the ``policy_loss`` surrogate per token (PPO-clipped, GSPO, CISPO, GMPO or
        SAPO) plus β·KL to the reference when kl_in=loss, reduced by ``loss_agg`` (DeepSeekMath eq. 3); its stats;
        the token entropy [b, T] or None)."""
        cfg, mask = self.config, batch.mask[s]
        logprobs, entropy = policy_logprobs(
            self.actor.model, batch.rollout, s, self.accelerator.device, with_entropy=with_entropy, shared=self.shared
        )
        self.passes["policy_train"] += 1
        old, advantages = batch.old_logprobs, batch.advantages[s]
        if old is None:  # one pass over one minibatch of an asynchronous batch: π_old is this forward
            old = logprobs.detach()
            advantages = self.corrected_advantages(batch, s, old, advantages)
        else:
            old = old[s]
        knobs = policy_loss_knobs(
            cfg.policy_loss, clip_low=cfg.clip_low, clip_high=cfg.clip_high, tau_pos=cfg.tau_pos, tau_neg=cfg.tau_neg
        )
        pg, stats = POLICY_LOSSES[cfg.policy_loss](logprobs, old, advantages, mask, **knobs)  # [b, T]
        if batch.selection is not None:  # entropy control: an unselected token's term 0; KL-Cov's penalty
            pg = selected_policy_loss(pg, logprobs, old, batch.selection.rows(s), cfg.entropy_control.kl_cov_coef)
        ref = batch.ref_logprobs  # None: no KL in the loss (kl_coef = 0, or kl_in=reward)
        kl = torch.zeros_like(pg) if ref is None else kl_penalty(logprobs, ref[s], cfg.kl_estimator, mask=mask)
        norm_length = cfg.sampling.max_new_tokens  # L of seq-mean-token-sum-norm
        loss = aggregate_loss(pg + cfg.kl_coef * kl, mask, cfg.loss_agg, norm_length)  # DeepSeekMath eq. 3
        stats.update(loss=loss.detach(), pg_loss=aggregate_loss(pg.detach(), mask, cfg.loss_agg, norm_length))
        if ref is not None:
            stats["kl"] = masked_mean(kl, mask).detach()
        return loss, stats, entropy

    def single_pass(self, rollout: Rollout) -> bool:
        """An asynchronous batch trained in one pass over one minibatch: π_old is that pass's forward,
        detached, so the no-grad old log-prob forward is not run (nothing needs π_old before the update
        when the KL, if any, is in the loss)."""
        cfg = self.config
        one_pass = cfg.num_iterations == 1 and cfg.minibatches == 1
        kl_after = self.reference is None or cfg.kl_in == "loss"
        covariance = cfg.entropy_control.method in ("clip_cov", "kl_cov")  # needs π_old before the update
        return rollout.version is not None and rollout.logprobs is not None and one_pass and kl_after and not covariance

    def corrected_advantages(self, batch: GRPOBatch, s: slice, old: torch.Tensor, advantages: torch.Tensor):
        """The advantages of rows ``s`` times the importance weights π_old/π_behaviour, with π_old the
        update's own forward (``OffPolicyTally``); the KL to the reference tallied for the metrics. As the
        separate pass: the gap and the weights over every sampled token, the KL over the tokens that train."""
        cfg = self.config
        valid = batch.rollout.action_mask[s].bool().to(old.device)
        behaviour = batch.rollout.logprobs[s].to(old.device)
        weights = self.tally.weights(old, behaviour, valid, cfg.rollout)
        if batch.ref_logprobs is not None:
            kl = kl_penalty(old, batch.ref_logprobs[s].to(old.device), cfg.kl_estimator)
            self.tally.kl(kl, batch.mask[s].to(old.device))
        if weights is None:
            return advantages
        tokens = advantages if advantages.dim() == 2 else advantages[:, None].expand_as(weights)
        return tokens * weights  # w·min(r·A, clip(r)·A) = min(r·wA, clip(r)·wA) for w ≥ 0


@holds_run_dir  # the run folder stays locked until the run ends (runlock)
def train(config: GRPOConfig, callbacks=()) -> dict:
    """Run GRPO; writes ``<run.output_dir>/final/policy``."""
    return GRPOTrainer(config).train(callbacks)
