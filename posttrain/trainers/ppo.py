"""RLHF with PPO (Ziegler et al. 2019; Stiennon et al. 2020; Ouyang et al. 2022) with four roles: the
trained policy, a frozen reference, a frozen reward model (or reward functions), and a trained critic.

Per step:
  1. sample responses to a batch of prompts, keeping the sampling log-probs (the "old" policy);
  2. reference log-probs; reward-model score of prompt + response (read at the last response token);
     optional penalty for responses without EOS; optional reward clipping;
  3. per-token KL (default k1) and token rewards r_t = −β·KL_t, plus the score at the last token;
  4. values V(s_t) from the critic; GAE advantages and returns (the returns' λ may be decoupled, VC-PPO's
     ``critic_lam``; the advantages' λ may be per response, VAPO's ``length_adaptive_alpha``); advantage
     whitening (optionally reward whitening); optionally entropy control (``entropy_control``): the tokens
     whose policy gradient trains, chosen once over the step's batch of every process;
  5. for ``ppo_epochs`` epochs over shuffled minibatches: clipped surrogate for the policy (or
     GSPO-token's, CISPO's or SAPO's, ``policy_loss``), clipped value loss for the critic, optional entropy
     bonus; gradient clipping; separate learning rates;
  6. log, and adapt β with the adaptive controller (target KL and horizon) when chosen.

The critic starts from the reward model (default) or the policy, as a separate model; or it is a
value head sharing the policy's backbone (``critic=shared``): ``critic.SeparateCritic`` and
``critic.SharedValueHead``, chosen once by ``critic.build_critic``. Before step 1 of a fresh run the critic
may be pretrained on the frozen starting policy's rollouts (VC-PPO's ``value_pretrain_steps``).

Departures from the papers: none in the algorithm. Choices the papers leave open are named knobs:
the loss reduction (``loss_agg``), the KL estimator (``kl_estimator``, k1 as in Ziegler et al.) and
the critic's initialisation. Equations, knobs and tests: docs/algorithms/ppo.md.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

import torch

from posttrain.core import (
    AGGREGATION_MODES,
    KL_ESTIMATORS,
    POLICY_LOSSES,
    TokenSelection,
    adaptive_kl_coef,
    aggregate_loss,
    decoupled_gae,
    gae,
    kl_penalty,
    length_adaptive_lam,
    masked_mean,
    masked_var,
    policy_loss_knobs,
    selected_policy_loss,
    shape_rewards,
)
from posttrain.data import DataConfig
from posttrain.envs import EnvConfig, with_environment_reward
from posttrain.models import ModelConfig, check_reward_critic, load_policy, load_reward_model, sequence_scores
from posttrain.monitor import AlertConfig, EvalConfig
from posttrain.rewards import RewardComposer, RewardSpec, score_rollout
from posttrain.rewards.process import ProcessReward, ProcessRewardConfig
from posttrain.rollout import Rollout, RolloutConfig, SamplingParams
from posttrain.runtime import engines, signals
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
)
from posttrain.runtime.entropy_control import EntropyControlConfig, select_tokens
from posttrain.runtime.loop import PhaseTimer
from posttrain.runtime.online import (
    OnlineTrainer,
    PromptSampler,
    advantage_metrics,
    check_episodes,
    first_minibatch_metrics,
    gather_whiten,
    kl_metrics,
    minibatches,
    old_logprobs_of,
    reference_logprobs,
)
from posttrain.runtime.runlock import holds_run_dir
from posttrain.runtime.update import MinibatchUpdate, StepStats, corr_of, micro_slices, std_of
from posttrain.trainers.critic import PPOBatch, build_critic

CRITIC_MODES = ("reward", "policy", "shared")
PPO_POLICY_LOSSES = ("ppo", "gspo-token", "cispo", "sapo")


@python_sections  # sections and rewards given in Python resolve as YAML's do
@dataclass
class PPOConfig:
    """posttrain ppo. ``run.batch_size`` counts responses per step (prompts × num_generations)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """The policy, usually an SFT model (``model.lora``: LoRA, the reference is the adapter-off model)."""
    reward_model: ModelConfig | None = None
    """A frozen reward model (*ForSequenceClassification, num_labels=1) sharing the policy's tokenizer."""
    rewards: list[RewardSpec] = field(default_factory=list)
    """Reward functions added to the reward model's score: [{function: module:function, weight: 1.0}]. With an
    ``env`` they read the model's last turn, and the environment's own reward joins them."""
    env: EnvConfig = field(default_factory=EnvConfig)
    """Multi-turn episodes with a tool-giving environment (docs/algorithms/multi_turn.md); name=none: one turn."""
    process_reward_model: ProcessRewardConfig | None = None
    """A process reward model (posttrain prm): {path, weight}; weight·σ(z_t) joins the token reward of each token
    t that ends a step (docs/algorithms/process_rewards.md); null = none."""
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
    """λ of GAE (the policy's advantages; the critic's returns too unless critic_lam is set)."""
    critic_lam: float | None = None
    """λ of the critic's returns, decoupled from the advantages' (VC-PPO's decoupled GAE: 1.0); null = lam."""
    length_adaptive_alpha: float | None = None
    """VAPO's α: each response's advantages use λ = 1 − 1/(α·l), l its length (clamped at 0; VAPO: 0.05), in
    place of lam; null = lam for every response."""
    value_pretrain_steps: int = 0
    """Steps of value pretraining before the first policy update (VC-PPO): the critic alone fitted to the
    Monte-Carlo returns (λ = 1) of the starting policy's rollouts, the policy frozen; 0 = none."""
    ppo_epochs: int = 4
    """Passes over each rollout batch."""
    minibatches: int = 1
    """Shuffled minibatches per epoch (one optimizer step each)."""
    policy_loss: str = "ppo"
    """The policy loss per token: ppo (clipped token ratio), gspo-token (GSPO's length-normalised sequence
    ratio, each token its own advantage), cispo (the clipped ratio as a detached weight on log π) or sapo (a
    smooth sigmoid gate of the token ratio in place of the clip)."""
    clip_low: float = 0.2
    """ε of the policy ratio clip (lower side); cispo: ≥ 1 = no lower bound on the weight; not used by sapo."""
    clip_high: float | None = None
    """Upper side of the ratio clip; null = clip_low; not used by sapo."""
    tau_pos: float = 1.0
    """τ_pos of policy_loss=sapo: the temperature of the gate of tokens with a positive advantage."""
    tau_neg: float = 1.05
    """τ_neg of policy_loss=sapo: the temperature for the other tokens (larger: their gate closes sooner)."""
    vf_clip: float | None = 0.2
    """Clip of the value update around the rollout's values; null = unclipped value loss."""
    vf_coef: float = 0.1
    """Weight of the value loss when critic=shared (one loss for both)."""
    entropy_coef: float = 0.0
    """Entropy bonus coefficient (0 = off)."""
    entropy_control: EntropyControlConfig = field(default_factory=EntropyControlConfig)
    """Which tokens get the policy gradient: all (none), the high-entropy minority, or all but those whose
    log-prob/advantage covariance drives the entropy down (clip_cov, kl_cov); docs/algorithms/grpo.md."""
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
                "reward_model.device": "use reward_device (the reward model is frozen, so it may live anywhere)",
            },
        )
        if self.reward_model is None and not self.rewards and not self.env.enabled:
            raise ValueError("a reward is needed: reward_model.path and/or rewards [{function: module:function}]")
        check_episodes(self)
        for i, spec in enumerate(self.rewards):
            spec.validate(f"rewards[{i}]")
        if self.max_unscored_steps < 0:
            raise ValueError(f"max_unscored_steps must be >= 0 (0 = never stop), got {self.max_unscored_steps}")
        check_choice("critic", self.critic, CRITIC_MODES)
        if self.policy_loss == "gspo":
            raise ValueError(
                "policy_loss=gspo clips one ratio per response by the response's one advantage; PPO's GAE gives "
                "each token its own: use policy_loss=gspo-token (GSPO's ratio with per-token advantages)"
            )
        if self.policy_loss == "gmpo":
            raise ValueError(
                "policy_loss=gmpo takes one advantage per response (its sign picks the clip side of every token); "
                "PPO's GAE gives each token its own: use policy_loss=sapo (a soft gate per token) or ppo"
            )
        check_policy_loss(self.policy_loss, self.clip_low, self.clip_high, PPO_POLICY_LOSSES)
        updates = f"ppo_epochs={self.ppo_epochs}, minibatches={self.minibatches}"
        self.entropy_control.check_trainer(self.ppo_epochs * self.minibatches, updates, self.policy_loss)
        check_sapo_knobs(self)
        check_choice("kl_estimator", self.kl_estimator, KL_ESTIMATORS)
        check_choice("loss_agg", self.loss_agg, AGGREGATION_MODES)
        check_choice("reference", self.reference, ("auto", "copy", "adapter"))
        if self.process_reward_model is not None and self.process_reward_model.aggregation != "min":
            raise ValueError(
                "process_reward_model.aggregation is not used by PPO, which rewards each step at the token that ends "
                "it; leave it unset (aggregation is GRPO's: one score per response)"
            )
        if self.critic == "reward" and self.reward_model is None:
            raise ValueError("critic=reward needs reward_model (or use critic=policy / critic=shared)")
        if self.critic == "reward":
            check_reward_critic(self.reward_model)
        if self.run.batch_size % self.num_generations:
            raise ValueError(f"run.batch_size must be a multiple of num_generations={self.num_generations}")
        for key in ("ppo_epochs", "minibatches", "num_generations"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key} must be >= 1, got {getattr(self, key)}")
        if self.kl_coef < 0 or self.kl_target <= 0 or self.kl_horizon <= 0:
            raise ValueError("kl_coef must be >= 0, kl_target and kl_horizon > 0")
        if not 0 <= self.gamma <= 1 or not 0 <= self.lam <= 1:
            raise ValueError("gamma and lam must be in [0, 1]")
        check_critic_calibration(self)

    @property
    def returns_lam(self) -> float:
        """λ of the critic's returns: critic_lam, or lam when it is null."""
        return self.lam if self.critic_lam is None else self.critic_lam


def check_critic_calibration(config: PPOConfig) -> None:
    """The knobs of a critic that keeps up (VC-PPO, VAPO): decoupled λ, length-adaptive λ, value pretraining."""
    if config.critic_lam is not None and not 0 <= config.critic_lam <= 1:
        raise ValueError(f"critic_lam must be in [0, 1] (null = lam; VC-PPO: 1.0), got {config.critic_lam}")
    if config.length_adaptive_alpha is not None and not config.length_adaptive_alpha > 0:
        raise ValueError(
            f"length_adaptive_alpha must be > 0 (VAPO: 0.05; null = off), got {config.length_adaptive_alpha}"
        )
    if config.value_pretrain_steps < 0:
        raise ValueError(f"value_pretrain_steps must be >= 0 (0 = none), got {config.value_pretrain_steps}")
    if config.value_pretrain_steps and config.critic == "shared" and config.run.mixed_precision == "fp16":
        raise ValueError(
            "value_pretrain_steps with critic=shared steps the value head alone, outside fp16 loss scaling: "
            "use run.mixed_precision=bf16 or no, or critic=reward / critic=policy"
        )


@dataclass
class Experience:
    """What steps 1-3 of a PPO step compute from a rollout: all [B, T] over its response tokens but ``scores`` [B];
    ``is_weights``: the sampler/trainer mismatch correction, None without one."""

    old_logprobs: torch.Tensor
    is_weights: torch.Tensor | None
    scores: torch.Tensor
    kl: torch.Tensor
    token_rewards: torch.Tensor


class PPOTrainer(OnlineTrainer):
    """Holds the four roles and the state of a PPO run; ``train_step`` is the module docstring's box."""

    name = "ppo"
    BAR_KEYS = ("score/mean", "kl/per_sequence", "policy/clipfrac")
    SCORE_KEYS = ("score/mean", "score/std")

    def __init__(self, config: PPOConfig):
        super().__init__(config)
        acc, self.kl_coef = self.accelerator, config.kl_coef
        # the four roles: policy (and critic), reference, reward model and/or reward functions
        policy = load_policy(replace(config.model, device="cpu"))
        self.reference = engines.build_reference(
            acc, policy, config.model, config.reference, device=config.reference_device
        )
        self.reward_model = None
        if config.reward_model is not None:  # ZeRO-3: loaded on the CPU, then sharded by prepare_frozen
            device = "cpu" if engines.zero_stage(acc) == 3 else config.reward_device or str(acc.device)
            reward_model = load_reward_model(replace(config.reward_model, device=device))
            self.reward_model = engines.prepare_frozen(acc, reward_model, config.reward_device)
        self.process_reward = None
        if config.process_reward_model is not None:
            self.process_reward = ProcessReward(config.process_reward_model, self.tokenizer, str(acc.device))
            self.process_reward.model = engines.prepare_frozen(acc, self.process_reward.model)
        self.reward_functions = None
        specs = with_environment_reward(config.rewards, config.env)
        if specs:  # with a reward model every sample is scored: no unscored-steps stop
            unscored = None if config.reward_model else config.max_unscored_steps
            self.reward_functions = RewardComposer.from_specs(specs, self.tokenizer, unscored)
        updates = self.total_steps * config.ppo_epochs * config.minibatches
        self.actor, self.critic = build_critic(acc, config, policy, updates)
        self.start_engine(policy)

    def train_step(self, step: int, timer: PhaseTimer) -> tuple[dict, Rollout | None, torch.Tensor | None]:
        cfg, acc = self.config, self.accelerator
        # 1. rollout, keeping the old log-probs
        with timer("generate"):
            rollout, columns, produced = self.next_rollout(step, self.local_prompts, cfg.num_generations)
        if rollout is None:  # a stale batch, dropped (rollout.on_stale=drop)
            return produced, None, None
        mask = rollout.action_mask  # the tokens the policy sampled: an episode's environment tokens are not actions
        # 1-3. old log-probs; reference log-probs and scores; per-token KL and token rewards
        exp, metrics = self.experience(rollout, columns, timer)
        metrics.update(produced)
        # 4. values; GAE: the advantages with λ (per response: length_adaptive_alpha), the returns with critic_lam
        #    (VC-PPO's decoupled GAE); advantage whitening
        with timer("values"):
            old_values = self.values_of(rollout)
        lam = self.actor_lam(mask)
        advantages, returns = decoupled_gae(exp.token_rewards, old_values, mask, cfg.gamma, lam, cfg.returns_lam)
        if cfg.whiten_advantages:
            advantages = gather_whiten(acc, advantages, mask)
        advantage_metrics(self.step_metrics, advantages, mask)
        # 4b. entropy control: the tokens whose policy gradient trains, chosen once over the whole step's batch
        selection = self.select_tokens(step, rollout, exp.old_logprobs, advantages, mask, metrics)
        if exp.is_weights is not None:  # w·min(r·A, clip(r)·A) = min(r·wA, clip(r)·wA) for w ≥ 0
            advantages = advantages * exp.is_weights
        # 5. PPO epochs over minibatches: clipped surrogate (policy), clipped value loss (critic)
        with timer("train"):
            metrics.update(
                self.update(step, rollout, exp.old_logprobs, old_values, advantages, returns, mask, selection)
            )
        # 6. log; adapt β
        metrics.update(critic_metrics(old_values, returns, mask))
        self.reward_metrics(exp.scores, exp.token_rewards, mask)
        metrics.update(self.adapt_kl_coef(exp.kl, mask))
        return metrics, rollout, exp.scores

    def experience(self, rollout: Rollout, columns: dict, timer: PhaseTimer) -> tuple[Experience, dict]:
        """Steps 1-3 on a drawn rollout (PPO's steps and value pretraining's): the old log-probs, reference
        log-probs and scores, per-token KL and token rewards −β·KL_t plus the score at the last response token."""
        cfg, acc, device = self.config, self.accelerator, self.accelerator.device
        micro, mask = cfg.run.micro_batch_size, rollout.action_mask
        with timer("old_logprobs"):
            old_logprobs, is_weights, metrics = old_logprobs_of(
                acc, self.engine, rollout, self.logprobs_of, micro, cfg.rollout, self.step_metrics
            )
        # 2. reference log-probs and scores
        with timer("reference"):
            ref_logprobs = reference_logprobs(self.reference, rollout, micro, device)
        with timer("reward"):
            scores, reward_metrics = self.scores(rollout, columns)
        metrics.update(reward_metrics)
        # 3. per-token KL and token rewards: −β·KL_t, plus the score at the last response token
        kl = kl_penalty(old_logprobs, ref_logprobs, cfg.kl_estimator)
        token_rewards = shape_rewards(scores, kl, mask, self.kl_coef)
        if self.process_reward is not None:  # + weight·σ(z_t) at the token t that ends each step
            with timer("reward"):
                token_rewards = token_rewards + self.process_rewards(rollout)
        if cfg.whiten_rewards:
            token_rewards = gather_whiten(acc, token_rewards, mask, shift_mean=False)
        return Experience(old_logprobs, is_weights, scores, kl, token_rewards), metrics

    def values_of(self, rollout: Rollout) -> torch.Tensor:
        """The critic's V(s_t) [B, T] of the rollout's response tokens, in micro-batches, without gradients."""
        with torch.no_grad():
            slices = micro_slices(len(rollout), self.config.run.micro_batch_size)
            return torch.cat([self.critic.values(rollout, s) for s in slices])

    def actor_lam(self, mask: torch.Tensor) -> float | torch.Tensor:
        """λ of the advantages: ``lam``, or VAPO's λ = 1 − 1/(α·l) per response of l sampled tokens [B] (its
        mean added to the step's metrics as ``advantages/lam_mean``)."""
        cfg = self.config
        if cfg.length_adaptive_alpha is None:
            return cfg.lam
        lam = length_adaptive_lam(mask.sum(1), cfg.length_adaptive_alpha).to(mask.device)
        self.step_metrics.add(
            "lam", lambda t: {"advantages/lam_mean": t["sum"] / t["rows"]}, sum=lam.sum(), rows=len(lam)
        )
        return lam

    # -- value pretraining (VC-PPO) -----------------------------------------------------------------

    def before_first_step(self) -> None:
        """``value_pretrain_steps`` = N steps of VC-PPO's value pretraining (``pretrain_critic``), each logged at step 0
        under ``critic_pretrain/`` (in TensorBoard and MLflow at −N … −1). A resumed run did them before its
        checkpoint; a run stopped during them saved nothing and starts over (``signals.stop_before_first_step``)."""
        cfg = self.config
        if not cfg.value_pretrain_steps:
            return
        sampler = PromptSampler(len(self.prompts), cfg.run.seed)  # the prompts PPO's first steps read, in order
        self.accelerator.print(f"[{self.name}] value pretraining: {cfg.value_pretrain_steps} steps, the policy frozen")
        for k in range(cfg.value_pretrain_steps):
            self.logger.log(0, self.pretrain_critic(k, sampler), series_step=k - cfg.value_pretrain_steps)
            signals.stop_before_first_step(self.accelerator, self.name, "value pretraining")

    def pretrain_critic(self, k: int, sampler: PromptSampler) -> dict[str, float]:
        """Step ``k`` of value pretraining (VC-PPO, Yuan et al. 2025, arXiv 2503.01491): responses of the frozen
        starting policy, their token rewards as a PPO step computes them, and ``ppo_epochs`` × ``minibatches``
        critic steps on the clipped value loss towards GAE's returns with λ = 1 (the Monte-Carlo return for
        γ = 1); no policy update, no β adaptation. Returns ``critic_pretrain/*``: the value loss, and the
        explained variance of the values before the step on its fresh rollout."""
        cfg, acc, timer, start = self.config, self.accelerator, PhaseTimer(), time.perf_counter()
        with timer("generate"):
            prompts = sampler.take_for_process(self.local_prompts, self.prompts, acc)
            rollout, columns = self.generate(prompts, cfg.num_generations)
        mask = rollout.action_mask
        exp, _ = self.experience(rollout, columns, timer)
        with timer("values"):
            old_values = self.values_of(rollout)
        advantages, returns = gae(exp.token_rewards, old_values, mask, cfg.gamma, 1.0)
        stats = StepStats()
        with timer("train"):
            for _, rows in minibatches(len(rollout), cfg.ppo_epochs, cfg.minibatches, cfg.run.seed, k):
                batch = PPOBatch(
                    rollout.select(rows),
                    mask[rows],
                    advantages[rows],
                    returns[rows],
                    exp.old_logprobs[rows],
                    old_values[rows],
                )
                updates, numbers = self.critic.pretrain_step(k, batch)
                stats.add(*updates, **numbers)
        out = stats.result(acc)
        self.reward_metrics(exp.scores, exp.token_rewards, mask)
        values = {**self.step_metrics.flush(acc), **critic_metrics(old_values, returns, mask)}
        return {
            "critic_pretrain/step": k + 1,
            "critic_pretrain/value_loss": out["value_loss"],
            "critic_pretrain/value_clipfrac": out["value_clipfrac"],
            "critic_pretrain/grad_norm": out["critic_grad_norm"],
            "critic_pretrain/explained_variance": values["values/explained_variance"],
            "critic_pretrain/values_mean": values["values/mean"],
            "critic_pretrain/returns_mean": values["returns/mean"],
            "critic_pretrain/score_mean": values["score/mean"],
            **{f"critic_pretrain/{key}": v for key, v in timer.read(time.perf_counter() - start).items()},
        }

    def logprobs_of(self, rollout: Rollout, rows: slice) -> torch.Tensor:
        return self.critic.policy_forward(rollout, rows)[0]

    def adapt_kl_coef(self, kl: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
        """The step's β; its KL metrics added to ``step_metrics``, from which β is adapted towards kl_target
        when the step ends (Ziegler et al. 2019, adaptive_kl): the next step is the first to use it."""
        cfg = self.config
        kl_metrics(self.step_metrics, kl, mask)
        if cfg.adaptive_kl:
            self.step_metrics.then(self._adapt)
        return {"kl_coef": self.kl_coef}

    def _adapt(self, metrics: dict[str, float]) -> None:
        cfg = self.config
        self.kl_coef = adaptive_kl_coef(
            self.kl_coef, metrics["kl/per_sequence"], cfg.kl_target, cfg.kl_horizon, cfg.run.batch_size
        )

    # -- 2. scores ------------------------------------------------------------------------------------

    def scores(self, rollout: Rollout, columns: dict) -> tuple[torch.Tensor, dict]:
        """(sequence scores [B]: reward model + reward functions, − missing_eos_penalty, clipped to
        ±reward_clip; their metrics ``score/reward_model``, ``reward/<function>/…``)."""
        cfg, device = self.config, self.accelerator.device
        metrics = {}
        scores = torch.zeros(len(rollout), device=device)
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
            self.step_metrics.add(
                "reward_model", lambda t: {"score/reward_model": t["sum"] / t["rows"]}, sum=rm.sum(), rows=len(rm)
            )
        if self.reward_functions is not None:
            out = score_rollout(self.reward_functions, rollout, columns)
            metrics.update(out.metrics())
            scores += torch.nan_to_num(out.total, nan=0.0).to(device)  # PPO has no group: unscored rows add 0
        if cfg.missing_eos_penalty is not None:  # looks at the response only: truncated = no EOS in it
            scores = scores - cfg.missing_eos_penalty * rollout.truncated.to(device).float()
        if cfg.reward_clip is not None:
            scores = scores.clamp(-cfg.reward_clip, cfg.reward_clip)
        return scores, metrics

    def process_rewards(self, rollout: Rollout) -> torch.Tensor:
        """The process reward model's token rewards [B, T] (``ProcessReward.token_rewards``); the mean step score
        ``reward/process/mean`` and steps per response ``reward/process/steps`` added to ``step_metrics``."""
        rewards, ends = self.process_reward.token_rewards(rollout, self.config.run.micro_batch_size)
        rewards = rewards.to(self.accelerator.device)
        self.step_metrics.add(
            "process",
            lambda t: {
                "reward/process/mean": t["sum"] / max(t["steps"], 1.0),
                "reward/process/steps": t["steps"] / t["rows"],
            },
            sum=rewards.double().sum() / self.config.process_reward_model.weight,
            steps=ends.sum(),
            rows=len(rollout),
        )
        return rewards

    def reward_metrics(self, scores, token_rewards, mask) -> None:
        """Mean and std of the sequence scores, their correlation with the response lengths across the batch
        (``score/length_corr``, NaN when every response is as long: health alert 15 reads it) and mean of the
        summed token rewards, over all processes, added to ``step_metrics``."""
        values, lengths = scores.double(), mask.sum(1).double()  # lengths: the tokens each response sampled
        self.step_metrics.add(
            "score",
            lambda t: {
                "score/mean": t["sum"] / t["rows"],
                "score/std": std_of(t["sum"], t["sum_sq"], t["rows"]),
                "score/length_corr": corr_of(t["sum"], t["len"], t["sum_sq"], t["len_sq"], t["sum_len"], t["rows"]),
                "reward/mean": t["rewards"] / t["rows"],
            },
            rows=len(values),
            sum=values.sum(),
            sum_sq=values.square().sum(),
            len=lengths.sum(),
            len_sq=lengths.square().sum(),
            sum_len=(values * lengths).sum(),
            rewards=torch.where(mask.bool(), token_rewards, 0.0).sum(),
        )

    def select_tokens(self, step: int, rollout: Rollout, old_logprobs, advantages, mask, metrics: dict):
        """``entropy_control``'s selection of this process's rows [B, T] (``select_tokens``; None: every token
        trains); its metrics into ``metrics``. high_entropy runs one no-grad forward for π_old's entropy."""
        cfg, acc = self.config, self.accelerator
        entropy_of = lambda rows: self.critic.policy_forward(rollout, rows, with_entropy=True)[2]  # noqa: E731
        control = cfg.entropy_control
        selection, chosen = select_tokens(acc, control, cfg.run, step, mask, entropy_of, old_logprobs, advantages)
        metrics.update(chosen)
        return selection

    # -- 5. PPO epochs ---------------------------------------------------------------------------------

    def update(self, step, rollout, old_logprobs, old_values, advantages, returns, mask, selection=None) -> dict:
        """``ppo_epochs`` passes over shuffled minibatches; per minibatch one policy step (per micro-batch
        forward, per-token loss, ``loss_agg``, backward of its share), then one critic step (a separate
        critic). Returns the policy/critic metrics of the step, reduced over the processes at once."""
        cfg, acc = self.config, self.accelerator
        stats = StepStats()  # on the device until one reduction at the end of the step
        for _, rows in minibatches(len(rollout), cfg.ppo_epochs, cfg.minibatches, cfg.run.seed, step):
            batch = PPOBatch(
                rollout.select(rows), mask[rows], advantages[rows], returns[rows], old_logprobs[rows], old_values[rows]
            )
            chosen = None if selection is None else selection.rows(rows)  # entropy control's tokens
            update = MinibatchUpdate(acc, self.actor, batch.mask, cfg.loss_agg, cfg.run.micro_batch_size)
            for micro in update:  # gradients synchronised on the last micro-batch only
                loss, loss_stats = self.policy_loss(batch, micro.rows, chosen)
                update.backward(micro, loss, loss_stats)  # ∇(loss · share): its part of the minibatch's mean
            grad_norm = update.step(step)
            critic_updates, critic_numbers = self.critic.step(step, batch)  # a separate critic's own step
            stats.add(update, *critic_updates, **critic_numbers, grad_norm=grad_norm)
        out = {("policy/" + k if k not in UNPREFIXED else k): v for k, v in stats.result(acc).items()}
        return {**out, **first_minibatch_metrics(stats.first)}

    def policy_loss(self, batch: PPOBatch, s: slice, selection: TokenSelection | None = None):
        """The loss of rows ``s``: the ``policy_loss`` surrogate (PPO-clipped, GSPO-token, CISPO or SAPO) minus
        entropy_coef · entropy per token, reduced by ``loss_agg`` with the constant ``max_new_tokens`` of
        seq-mean-token-sum-norm (Schulman et al. 2017, eq. 9), + vf_coef · value loss with a shared value
        head; and its stats."""
        cfg, mask = self.config, batch.mask[s]
        agg, norm_length = cfg.loss_agg, cfg.sampling.max_new_tokens
        logprobs, values, entropy = self.critic.policy_forward(
            batch.rollout, s, with_entropy=True, entropy_grad=cfg.entropy_coef > 0
        )
        knobs = policy_loss_knobs(
            cfg.policy_loss, clip_low=cfg.clip_low, clip_high=cfg.clip_high, tau_pos=cfg.tau_pos, tau_neg=cfg.tau_neg
        )
        pg, stats = POLICY_LOSSES[cfg.policy_loss](
            logprobs, batch.old_logprobs[s], batch.advantages[s], mask, **knobs
        )  # [b, T]
        if selection is not None:  # entropy control: an unselected token's term 0; KL-Cov's penalty
            old, beta = batch.old_logprobs[s], cfg.entropy_control.kl_cov_coef
            pg = selected_policy_loss(pg, logprobs, old, selection.rows(s), beta)
        pg_loss = aggregate_loss(pg, mask, agg, norm_length)
        value_term, value_stats = self.critic.joint_loss(values, batch, s)
        loss = pg_loss - cfg.entropy_coef * aggregate_loss(entropy, mask, agg, norm_length) + value_term
        stats.update(pg_loss=pg_loss.detach(), entropy=masked_mean(entropy, mask).detach())
        return loss, {**stats, **value_stats}

    # -- state ----------------------------------------------------------------------------------------

    def models_to_save(self) -> dict:
        return {"policy": self.actor.model, **self.critic.models_to_save()}

    def nonfinite_skips(self) -> int:
        return self.actor.guard.skips + self.critic.nonfinite_skips()

    def state(self) -> dict:
        return {**super().state(), "kl_coef": self.kl_coef}

    def load_state(self, state: dict) -> int:
        self.kl_coef = state["kl_coef"]
        return super().load_state(state)


UNPREFIXED = ("grad_norm", "critic_grad_norm", "value_loss", "value_clipfrac", "entropy")


def critic_metrics(values, returns, mask) -> dict:
    """Explained variance 1 − Var(R − V) / Var(R) of the rollout's values, mean value and mean return
    (valid tokens of this process)."""
    var_returns = masked_var(returns, mask)
    explained = 1.0 - masked_var(returns - values, mask) / var_returns.clamp(min=1e-8)
    return {
        "values/explained_variance": float(explained),
        "values/mean": float(masked_mean(values, mask)),
        "returns/mean": float(masked_mean(returns, mask)),
    }


@holds_run_dir  # the run folder stays locked until the run ends (runlock)
def train(config: PPOConfig, callbacks=()) -> dict:
    """Run RLHF-PPO; writes ``<run.output_dir>/final/policy`` (and ``final/critic``)."""
    return PPOTrainer(config).train(callbacks)
