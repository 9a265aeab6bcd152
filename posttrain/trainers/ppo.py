"""RLHF with PPO (Ziegler et al. 2019; Stiennon et al. 2020; Ouyang et al. 2022) with four roles: the
trained policy, a frozen reference, a frozen reward model (or reward functions), and a trained critic.

Per step:
  1. sample responses to a batch of prompts, keeping the sampling log-probs (the "old" policy);
  2. reference log-probs; reward-model score of prompt + response (read at the last response token);
     optional penalty for responses without EOS; optional reward clipping;
  3. per-token KL (default k1) and token rewards r_t = −β·KL_t, plus the score at the last token;
  4. values V(s_t) from the critic; GAE advantages and returns; advantage whitening (optionally
     reward whitening);
  5. for ``ppo_epochs`` epochs over shuffled minibatches: clipped surrogate for the policy, clipped
     value loss for the critic, optional entropy bonus; gradient clipping; separate learning rates;
  6. log, and adapt β with the adaptive controller (target KL and horizon) when chosen.

The critic starts from the reward model (default) or the policy, as a separate model; or it is a
value head sharing the policy's backbone (``critic=shared``).
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, field, replace

import torch

from posttrain.core import (
    AGGREGATION_MODES,
    KL_ESTIMATORS,
    adaptive_kl_coef,
    aggregate_loss,
    aggregation_units,
    gae,
    kl_penalty,
    masked_mean,
    masked_var,
    ppo_policy_loss,
    shape_rewards,
    value_loss,
)
from posttrain.data import DataConfig, load_prompts
from posttrain.models import (
    ModelConfig,
    PolicyWithValueHead,
    Reference,
    ValueModel,
    load_critic,
    load_policy,
    load_reward_model,
    load_tokenizer,
    sequence_scores,
)
from posttrain.monitor import AlertConfig, EvalConfig, RunMonitor
from posttrain.rewards import RewardComposer, RewardSpec, unpad
from posttrain.rollout import RolloutConfig, SamplingParams, build_engine
from posttrain.trainers.checkpoint import save_checkpoint
from posttrain.trainers.config import (
    PLACED_BY_ACCELERATE,
    OptimConfig,
    RunConfig,
    check_choice,
    reject_ignored,
    validate_sections,
)
from posttrain.trainers.inputs import check_inputs
from posttrain.trainers.loop import (
    NonFiniteGuard,
    build_accelerator,
    build_optimizer,
    optimizer_step,
    save_final,
    split_train_eval,
    start_run,
)
from posttrain.trainers.online import (
    PhaseTimer,
    PromptSampler,
    StatsAccumulator,
    advantage_metrics,
    gather_whiten,
    global_sum,
    kl_metrics,
    micro_slices,
    old_logprobs_of,
    policy_logprobs,
    reference_logprobs,
    response_metrics,
    sample,
    split_minibatches,
    write_samples,
)

CRITIC_MODES = ("reward", "policy", "shared")


@dataclass
class PPOConfig:
    """posttrain ppo. ``run.batch_size`` counts responses per step (prompts × num_generations)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """The policy, usually an SFT model (``model.lora``: LoRA, the reference is the adapter-off model)."""
    reward_model: ModelConfig | None = None
    """A frozen reward model (*ForSequenceClassification, num_labels=1) sharing the policy's tokenizer."""
    rewards: list[RewardSpec] = field(default_factory=list)
    """Reward functions added to the reward model's score: [{function: module:function, weight: 1.0}]."""
    data: DataConfig = field(default_factory=lambda: DataConfig(max_length=None, max_prompt_length=512))
    """Prompt rows {"prompt", ...}."""
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-6, scheduler="constant"))
    """Policy optimizer and schedule."""
    critic_lr: float | None = None
    """Critic learning rate (separate critic); null = 10 × optim.lr."""
    run: RunConfig = field(default_factory=RunConfig)
    """Steps (rollout batches), responses per step (batch_size), micro_batch_size, logging, checkpoints."""
    sampling: SamplingParams = field(default_factory=lambda: SamplingParams(max_new_tokens=128, temperature=1.0))
    """How responses are sampled."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """The engine that samples (hf | lean | vllm, colocate | server) and the sampler/trainer mismatch correction."""
    num_generations: int = 1
    """Responses sampled per prompt."""
    critic: str = "reward"
    """reward (a separate critic initialised from the reward model), policy (from the policy), or shared
    (a value head on the policy's backbone)."""
    kl_coef: float = 0.05
    """β of the per-token KL penalty in the reward (the initial value with the adaptive controller)."""
    kl_estimator: str = "k1"
    """Per-token KL estimator in the reward: k1, k2 or k3."""
    adaptive_kl: bool = False
    """Adapt β towards kl_target (Ziegler et al. 2019); false keeps it fixed."""
    kl_target: float = 6.0
    """Target KL per sequence of the adaptive controller."""
    kl_horizon: float = 10000.0
    """Horizon (in sequences) of the adaptive controller."""
    gamma: float = 1.0
    """Discount γ of GAE."""
    lam: float = 0.95
    """λ of GAE."""
    ppo_epochs: int = 4
    """Passes over each rollout batch."""
    minibatches: int = 1
    """Shuffled minibatches per epoch (one optimizer step each)."""
    clip_low: float = 0.2
    """ε of the policy ratio clip (lower side)."""
    clip_high: float | None = None
    """Upper side of the ratio clip; null = clip_low."""
    vf_clip: float | None = 0.2
    """Clip of the value update around the rollout's values; null = unclipped value loss."""
    vf_coef: float = 0.1
    """Weight of the value loss when critic=shared (one loss for both)."""
    entropy_coef: float = 0.0
    """Entropy bonus coefficient (0 = off)."""
    loss_agg: str = "token-mean"
    """Reduction of the policy and value losses."""
    whiten_advantages: bool = True
    """Whiten advantages over the batch (all processes)."""
    whiten_rewards: bool = False
    """Whiten token rewards (scale only, mean kept) before GAE."""
    missing_eos_penalty: float | None = None
    """Subtracted from the score of responses that end without EOS (null = none)."""
    reward_clip: float | None = None
    """Clip scores to [−reward_clip, reward_clip] (null = none)."""
    reference: str = "auto"
    """auto (adapter-off for LoRA, else a frozen copy), copy or adapter."""
    reference_device: str | None = None
    """Device of the frozen reference copy (e.g. cpu to offload); null = the training device."""
    reward_device: str | None = None
    """Device of the reward model (e.g. cpu to offload); null = the training device."""
    log_completions: int = 4
    """(prompt, completion, score) samples written to samples.jsonl per step (0 = none)."""
    max_unscored_steps: int = 3
    """Stop after this many steps in a row in which no reward function scored any sample (0 = never;
    not checked with a reward_model, which scores every sample)."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Held-out evaluation (eval.path or data.eval_fraction) every run.eval_every steps and at the end."""
    alerts: AlertConfig = field(default_factory=AlertConfig)
    """Health alerts over the logged metrics: thresholds (console, progress bar, alerts.jsonl)."""

    def validate(self) -> None:
        validate_sections(self)
        reject_ignored(
            self,
            {
                "model.device": PLACED_BY_ACCELERATE,
                "reward_model.device": "use reward_device (the reward model is frozen, so it may live anywhere)",
            },
        )
        if self.reward_model is None and not self.rewards:
            raise ValueError("a reward is needed: reward_model.path and/or rewards [{function: module:function}]")
        for i, spec in enumerate(self.rewards):
            spec.validate(f"rewards[{i}]")
        if self.max_unscored_steps < 0:
            raise ValueError(f"max_unscored_steps must be >= 0 (0 = never stop), got {self.max_unscored_steps}")
        check_choice("critic", self.critic, CRITIC_MODES)
        check_choice("kl_estimator", self.kl_estimator, KL_ESTIMATORS)
        check_choice("loss_agg", self.loss_agg, AGGREGATION_MODES)
        check_choice("reference", self.reference, ("auto", "copy", "adapter"))
        if self.critic == "reward" and self.reward_model is None:
            raise ValueError("critic=reward needs reward_model (or use critic=policy / critic=shared)")
        if self.run.batch_size % self.num_generations:
            raise ValueError(f"run.batch_size must be a multiple of num_generations={self.num_generations}")
        for key in ("ppo_epochs", "minibatches", "num_generations"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key} must be >= 1, got {getattr(self, key)}")
        if self.kl_coef < 0 or self.kl_target <= 0 or self.kl_horizon <= 0:
            raise ValueError("kl_coef must be >= 0, kl_target and kl_horizon > 0")
        if not 0 <= self.gamma <= 1 or not 0 <= self.lam <= 1:
            raise ValueError("gamma and lam must be in [0, 1]")


class PPOTrainer:
    """Holds the four roles and the state of a PPO run; ``train()`` runs the loop of the module docstring."""

    def __init__(self, config: PPOConfig):
        config.validate()
        check_inputs(config)
        self.config = config
        acc = self.accelerator = build_accelerator(config.run)
        torch.manual_seed(config.run.seed)
        self.tokenizer = load_tokenizer(config.model.tokenizer_path or config.model.path)
        self.prompts, report = load_prompts(config.data, self.tokenizer)
        self.prompts, eval_prompts = split_train_eval(self.prompts, config.data.eval_fraction, config.run.seed)
        acc.print(f"[ppo] prompts: {report.summary()}")
        world = acc.num_processes
        prompts_per_step = config.run.batch_size // config.num_generations
        if prompts_per_step % world:
            raise ValueError(f"prompts per step ({prompts_per_step}) must split evenly over {world} processes")
        self.local_prompts = prompts_per_step // world
        if config.minibatches > self.local_prompts * config.num_generations:
            raise ValueError(
                f"minibatches={config.minibatches} is more than the {self.local_prompts * config.num_generations} "
                f"responses each of the {world} process(es) holds per step (run.batch_size={config.run.batch_size})"
            )
        self.kl_coef = config.kl_coef

        # the four roles
        policy = load_policy(replace(config.model, device="cpu"))
        self.reference = Reference.from_policy(policy, share=config.reference)
        if self.reference.model is not None:
            self.reference.model.to(config.reference_device or acc.device)
        self.reward_model = None
        if config.reward_model is not None:
            self.reward_model = load_reward_model(
                replace(config.reward_model, device=config.reward_device or str(acc.device))
            )
        self.reward_functions = (
            RewardComposer.from_specs(
                config.rewards,
                self.tokenizer,
                None if config.reward_model else config.max_unscored_steps,  # the RM scores every sample
            )
            if config.rewards
            else None
        )
        self.shared = config.critic == "shared"
        self.total_steps = config.run.max_steps or max(
            1, math.ceil(config.run.epochs * len(self.prompts) / prompts_per_step)
        )
        updates = self.total_steps * config.ppo_epochs * config.minibatches
        if self.shared:
            model = PolicyWithValueHead(policy)
            optimizer, self.scheduler = build_optimizer(
                [p for p in model.parameters() if p.requires_grad], config.optim, updates
            )
            self.model, self.optimizer = acc.prepare(model, optimizer)
            self.critic = self.critic_optimizer = self.critic_scheduler = None
            acc.register_for_checkpointing(self.scheduler)
            self.policy = acc.unwrap_model(self.model).policy
        else:
            # the critic is trained: model.gradient_checkpointing applies to it whichever weights it starts from
            checkpointing = config.model.gradient_checkpointing
            critic = ValueModel(  # trained through its forward: DDP synchronises its gradients
                load_critic(
                    config.critic,
                    replace(config.model, device="cpu", lora=None),
                    None
                    if config.reward_model is None
                    else replace(config.reward_model, device="cpu", gradient_checkpointing=checkpointing),
                )
            )
            optimizer, self.scheduler = build_optimizer(
                [p for p in policy.parameters() if p.requires_grad], config.optim, updates
            )
            critic_optim = replace(config.optim, lr=config.critic_lr or 10 * config.optim.lr)
            critic_optimizer, self.critic_scheduler = build_optimizer(critic.parameters(), critic_optim, updates)
            self.model, self.critic, self.optimizer, self.critic_optimizer = acc.prepare(
                policy, critic, optimizer, critic_optimizer
            )
            acc.register_for_checkpointing(self.scheduler)
            acc.register_for_checkpointing(self.critic_scheduler)
            self.policy = acc.unwrap_model(self.model)
        acc.print(f"[ppo] rollout: {config.rollout.describe()}")
        self.engine = build_engine(config.rollout, self.policy, self.tokenizer, config.model.path, config.run.seed)
        self.sampler = PromptSampler(len(self.prompts), config.run.seed)
        self.guard = NonFiniteGuard(acc, config.run)
        self.critic_guard = NonFiniteGuard(acc, config.run, model="critic")
        self.monitor = RunMonitor(config, eval_prompts, self.tokenizer, self.accelerator, "score/mean", "score/std")

    # -- forward passes -----------------------------------------------------------------------------

    def _policy_forward(self, rollout, rows, with_entropy=False, entropy_grad=False):
        """(logprobs, values or None, entropy or None) of ``rows``; the shared model gives values too."""
        device = self.accelerator.device
        if self.shared:
            return self.model(
                rollout.input_ids[rows].to(device),
                rollout.attention_mask[rows].to(device),
                rollout.response_length,
                rollout.temperature,
                with_entropy,
                entropy_grad,
            )
        logprobs, entropy = policy_logprobs(self.model, rollout, rows, device, with_entropy, entropy_grad)
        return logprobs, None, entropy

    def _values(self, rollout, rows) -> torch.Tensor:
        device = self.accelerator.device
        if self.shared:
            return self._policy_forward(rollout, rows)[1]
        return self.critic(
            rollout.input_ids[rows].to(device),
            rollout.attention_mask[rows].to(device),
            rollout.response_length,
        )

    # -- 2. scores ------------------------------------------------------------------------------------

    def scores(self, rollout, columns) -> tuple[torch.Tensor, dict]:
        cfg, device = self.config, self.accelerator.device
        scores = torch.zeros(len(rollout), device=device)
        metrics = {}
        if self.reward_model is not None:
            rm_device = next(self.reward_model.parameters()).device
            with torch.no_grad():
                rm = torch.cat(
                    [
                        sequence_scores(
                            self.reward_model,
                            rollout.input_ids[s].to(rm_device),
                            rollout.attention_mask[s].to(rm_device),
                        )
                        for s in micro_slices(len(rollout), cfg.run.micro_batch_size)
                    ]
                ).to(device)
            scores += rm
            metrics["score/reward_model"] = global_sum(self.accelerator, rm.sum()) / global_sum(
                self.accelerator, len(rm)
            )
        if self.reward_functions is not None:
            out = self.reward_functions(
                rollout.prompts,
                rollout.responses,
                columns,
                unpad(rollout.prompt_ids, rollout.prompt_mask),
                unpad(rollout.response_ids, rollout.response_mask),
            )
            metrics.update(out.metrics())
            scores += torch.nan_to_num(out.total, nan=0.0).to(device)  # PPO has no group: unscored rows add 0
        if cfg.missing_eos_penalty is not None:  # looks at the response only: truncated = no EOS in it
            scores = scores - cfg.missing_eos_penalty * rollout.truncated.to(device).float()
        if cfg.reward_clip is not None:
            scores = scores.clamp(-cfg.reward_clip, cfg.reward_clip)
        return scores, metrics

    # -- 5. PPO epochs ---------------------------------------------------------------------------------

    def update(self, step, rollout, old_logprobs, old_values, advantages, returns, mask) -> dict:
        cfg, acc = self.config, self.accelerator
        stats, first = StatsAccumulator(), None
        for epoch in range(cfg.ppo_epochs):
            generator = torch.Generator().manual_seed(cfg.run.seed * 1_000_003 + step * 1_009 + epoch)
            for rows in split_minibatches(torch.randperm(len(rollout), generator=generator), cfg.minibatches):
                sub = rollout.select(rows)
                batch = (mask[rows], advantages[rows], returns[rows], old_logprobs[rows], old_values[rows])
                minibatch = StatsAccumulator()
                grad_norm = self._policy_minibatch(step, sub, *batch, minibatch)
                stats.add({"grad_norm": torch.tensor(grad_norm)}, 1.0)
                if not self.shared:
                    # after the policy's step: under fp16 each optimizer's gradients are scaled, unscaled and
                    # stepped within one cycle of accelerate's shared GradScaler (scale updated per step)
                    critic_norm = self._critic_minibatch(step, sub, *batch, minibatch)
                    stats.add({"critic_grad_norm": torch.tensor(critic_norm)}, 1.0)
                result = minibatch.result(acc)
                if first is None:
                    first = result
                stats.add(result, 1.0)
        out = {
            ("policy/" + k if k not in ("grad_norm", "critic_grad_norm") else k): v
            for k, v in stats.result(acc).items()
        }
        for key in ("value_loss", "value_clipfrac", "entropy"):
            out[key] = out.pop(f"policy/{key}")
        out["policy/first_minibatch_ratio_max"] = first["ratio_max"]
        out["policy/first_minibatch_ratio_min"] = first["ratio_min"]
        out["policy/first_minibatch_clipfrac"] = first["clipfrac"]
        return out

    def _policy_minibatch(self, step, sub, mask, advantages, returns, old_logprobs, old_values, stats) -> float:
        """Clipped surrogate − entropy bonus (+ value loss with a shared critic), each reduced by
        ``loss_agg`` with the constant ``max_new_tokens`` of seq-mean-token-sum-norm, accumulated over
        micro-batches in the minibatch's global units; one optimizer step. Returns the gradient norm."""
        cfg, acc = self.config, self.accelerator
        agg, norm_length = cfg.loss_agg, cfg.sampling.max_new_tokens
        units = global_sum(acc, aggregation_units(mask, agg))
        slices = micro_slices(len(sub), cfg.run.micro_batch_size)
        total = 0.0  # the minibatch's loss, for the non-finite guard
        for k, s in enumerate(slices):
            weight = float(aggregation_units(mask[s], agg)) * acc.num_processes / max(units, 1.0)
            with contextlib.nullcontext() if k == len(slices) - 1 else acc.no_sync(self.model):
                logprobs, values, entropy = self._policy_forward(
                    sub, s, with_entropy=True, entropy_grad=cfg.entropy_coef > 0
                )
                pg_loss, pg_stats = ppo_policy_loss(
                    logprobs,
                    old_logprobs[s],
                    advantages[s],
                    mask[s],
                    cfg.clip_low,
                    cfg.clip_high,
                    agg,
                    norm_length=norm_length,
                )
                loss = pg_loss - cfg.entropy_coef * aggregate_loss(entropy, mask[s], agg, norm_length)
                if self.shared:
                    vf_loss = value_loss(values, old_values[s], returns[s], mask[s], cfg.vf_clip, agg, norm_length)
                    loss = loss + cfg.vf_coef * vf_loss
                    stats.add(self._value_stats(values, vf_loss, old_values[s], mask[s]), weight)
                acc.backward(loss * weight)
            total = total + (loss * weight).detach()
            stats.add({**pg_stats, "entropy": masked_mean(entropy, mask[s]).detach()}, weight)
        return optimizer_step(
            acc,
            self.model,
            self.optimizer,
            self.scheduler,
            cfg.optim.max_grad_norm,
            self.guard,
            step + 1,
            global_sum(acc, total) / acc.num_processes,
        )

    def _critic_minibatch(self, step, sub, mask, advantages, returns, old_logprobs, old_values, stats) -> float:
        """Clipped value loss of the separate critic, as ``_policy_minibatch``; one optimizer step."""
        cfg, acc = self.config, self.accelerator
        units = global_sum(acc, aggregation_units(mask, cfg.loss_agg))
        slices = micro_slices(len(sub), cfg.run.micro_batch_size)
        total = 0.0  # the minibatch's loss, for the non-finite guard
        for k, s in enumerate(slices):
            weight = float(aggregation_units(mask[s], cfg.loss_agg)) * acc.num_processes / max(units, 1.0)
            with contextlib.nullcontext() if k == len(slices) - 1 else acc.no_sync(self.critic):
                values = self._values(sub, s)
                vf_loss = value_loss(
                    values, old_values[s], returns[s], mask[s], cfg.vf_clip, cfg.loss_agg, cfg.sampling.max_new_tokens
                )
                acc.backward(vf_loss * weight)
            total = total + (vf_loss * weight).detach()
            stats.add(self._value_stats(values, vf_loss, old_values[s], mask[s]), weight)
        return optimizer_step(
            acc,
            self.critic,
            self.critic_optimizer,
            self.critic_scheduler,
            cfg.optim.max_grad_norm,
            self.critic_guard,
            step + 1,
            global_sum(acc, total) / acc.num_processes,
        )

    def _value_stats(self, values, vf_loss, old_values, mask) -> dict:
        clipped = (values.detach() - old_values).abs() > (self.config.vf_clip or math.inf)
        return {"value_loss": vf_loss.detach(), "value_clipfrac": masked_mean(clipped.float(), mask)}

    def _saved_models(self) -> dict:
        return {"policy": self.model} if self.shared else {"policy": self.model, "critic": self.critic}

    def train(self, callbacks=()) -> dict:
        cfg, acc, device = self.config, self.accelerator, self.accelerator.device
        state, logger = start_run(acc, cfg, self.total_steps, "ppo")
        start_step = 0
        if state is not None:
            start_step, self.sampler.cursor, self.kl_coef = state["step"], state["prompt_cursor"], state["kl_coef"]
        self.engine.sync_weights(self.policy)  # a resumed policy is not the checkpoint the engine loaded
        metrics: dict = {}
        for step in range(start_step, self.total_steps):
            t0, timer = time.perf_counter(), PhaseTimer()
            # 1. rollout
            with timer("generate"):
                rollout, columns = sample(
                    self.engine,
                    self.policy,
                    self.sampler.take_for_process(self.local_prompts, self.prompts, acc),
                    cfg.sampling,
                    cfg.num_generations,
                )
            mask = rollout.response_mask
            with timer("old_logprobs"):
                old_logprobs, is_weights, mismatch = old_logprobs_of(
                    acc,
                    self.engine,
                    rollout,
                    lambda r, s: self._policy_forward(r, s)[0],
                    cfg.run.micro_batch_size,
                    cfg.rollout,
                )
            # 2. reference log-probs and scores
            with timer("reference"):
                ref_logprobs = reference_logprobs(self.reference, rollout, cfg.run.micro_batch_size, device)
            with timer("reward"):
                scores, metrics = self.scores(rollout, columns)
            metrics.update(mismatch)
            # 3. per-token KL and token rewards: −β·KL_t, plus the score at the last response token
            kl = kl_penalty(old_logprobs, ref_logprobs, cfg.kl_estimator)
            token_rewards = shape_rewards(scores, kl, mask, self.kl_coef)
            if cfg.whiten_rewards:
                token_rewards = gather_whiten(acc, token_rewards, mask, shift_mean=False)
            # 4. values, GAE, advantage whitening
            with timer("values"), torch.no_grad():
                old_values = torch.cat(
                    [self._values(rollout, s) for s in micro_slices(len(rollout), cfg.run.micro_batch_size)]
                )
            advantages, returns = gae(token_rewards, old_values, mask, cfg.gamma, cfg.lam)
            if cfg.whiten_advantages:
                advantages = gather_whiten(acc, advantages, mask)
            metrics.update(advantage_metrics(acc, advantages, mask))
            if is_weights is not None:  # w·min(r·A, clip(r)·A) = min(r·wA, clip(r)·wA) for w ≥ 0
                advantages = advantages * is_weights
            # 5. PPO epochs over minibatches
            with timer("train"):
                metrics.update(self.update(step, rollout, old_logprobs, old_values, advantages, returns, mask))
            with timer("sync_weights"):
                self.engine.sync_weights(self.policy)
            # 6. log; adapt β
            kl_stats = kl_metrics(acc, kl, mask)
            metrics.update(kl_stats)
            metrics.update(self._critic_metrics(old_values, returns, mask))
            done = step + 1
            seconds = time.perf_counter() - t0
            metrics.update(response_metrics(acc, rollout))
            metrics.update(timer.read(seconds))
            metrics.update(
                {
                    "score/mean": global_sum(acc, scores.sum()) / global_sum(acc, len(scores)),
                    "score/std": float(acc.gather(scores).std()) if acc.num_processes * len(scores) > 1 else 0.0,
                    "reward/mean": global_sum(acc, torch.where(mask.bool(), token_rewards, 0.0).sum())
                    / global_sum(acc, len(scores)),
                    "kl_coef": self.kl_coef,
                    "lr": self.scheduler.get_last_lr()[0],
                    "train/nonfinite_skips": self.guard.skips + self.critic_guard.skips,
                    "tokens_per_s": metrics["tokens_generated"] / seconds,
                }
            )
            if cfg.adaptive_kl:
                self.kl_coef = adaptive_kl_coef(
                    self.kl_coef, kl_stats["kl/per_sequence"], cfg.kl_target, cfg.kl_horizon, cfg.run.batch_size
                )
            write_samples(acc, cfg.run.output_dir, done, rollout, scores, cfg.log_completions)
            metrics.update(self.monitor.after_step(self.engine, done, self.total_steps, metrics))
            if done % cfg.run.log_every == 0 or done == self.total_steps or "time/eval" in metrics:
                logger.log(done, metrics, ("score/mean", "kl/per_sequence", "policy/clipfrac", *self.monitor.bar_keys))
            logger.advance()
            if cfg.run.save_every and done % cfg.run.save_every == 0 and done < self.total_steps:
                save_checkpoint(
                    acc,
                    cfg.run.output_dir,
                    done,
                    self._saved_models(),
                    self.tokenizer,
                    {"prompt_cursor": self.sampler.cursor, "kl_coef": self.kl_coef},
                    cfg.run.keep_last,
                )
            for callback in callbacks:
                callback(done, metrics)
        logger.close()
        save_final(acc, cfg.run.output_dir, self._saved_models(), self.tokenizer)
        return {
            "final_metrics": metrics,
            "steps": self.total_steps,
            "output_dir": cfg.run.output_dir,
            "processes": acc.num_processes,
            "kl_coef": self.kl_coef,
        }

    def _critic_metrics(self, values, returns, mask) -> dict:
        """Explained variance 1 − Var(R − V) / Var(R) of the rollout's values (valid tokens)."""
        var_returns = masked_var(returns, mask)
        explained = 1.0 - masked_var(returns - values, mask) / var_returns.clamp(min=1e-8)
        return {
            "values/explained_variance": float(explained),
            "values/mean": float(masked_mean(values, mask)),
            "returns/mean": float(masked_mean(returns, mask)),
        }


def train(config: PPOConfig, callbacks=()) -> dict:
    """Run RLHF-PPO; writes ``<run.output_dir>/final/policy`` (and ``final/critic``)."""
    return PPOTrainer(config).train(callbacks)
