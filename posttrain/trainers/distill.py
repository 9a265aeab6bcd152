"""On-policy distillation: the student samples, a frozen teacher grades every sampled token.

Agarwal et al. 2024, GKD, "On-Policy Distillation of Language Models: Learning from Self-Generated
Mistakes", arXiv:2306.13649 (the divergence over the vocabulary, generalized JSD); Lu et al. 2025, Thinking
Machines, "On-Policy Distillation" and Yang et al. 2025, Qwen3 Technical Report, arXiv:2505.09388 (the
per-token reverse KL of the sampled tokens, as an advantage).

Per step, for P prompts:
  1. GKD's draw (``lmbda`` = λ): with probability λ the student samples G responses per prompt, keeping the
     sampling log-probs (the "old" policy), and reward functions, when given, score them for the log only
     (never in the loss); otherwise the batch is the data set's own completions of P·G prompts;
  2. the teacher scores every sampled token: log π_T(y_t), one no-grad pass in micro-batches, or one request
     to a vLLM engine of the teacher's weights, colocated or served (``teacher_scoring``)
     (loss=jsd: in the update instead, from the teacher's whole distribution at each position); with
     ``teachers``, each row by the teacher it names: one pass per teacher over its rows, back in row order;
  3. loss=reverse_kl: per-token advantages A_t = −(log π_old(y_t) − log π_T(y_t)), discount 0;
  4. ``minibatches`` shuffled minibatches, one optimizer step each: reverse_kl = the clipped surrogate with
     A_t (on the first minibatch the ratio is 1: the plain policy gradient); jsd = GKD's generalized JSD_β
     per response token over the vocabulary, its [b, T, V] logits computed micro-batch by micro-batch;
     both reduced by ``loss_agg`` over the response tokens (prompt and padding never count);
  5. log (the per-token reverse KL, the teacher's log-prob of the sampled tokens); checkpoint.

Departures from the papers: GKD's third source of responses, the teacher's own samples, is not built;
λ < 1 takes loss=jsd only. The teacher (every teacher) must share the student's tokenizer. Equations, knobs and tests:
docs/algorithms/distill.md.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from dataclasses import dataclass, field, replace

import torch

from posttrain.core import (
    AGGREGATION_MODES,
    aggregate_loss,
    generalized_jsd,
    masked_mean,
    ppo_policy_loss,
    reverse_kl_advantages,
    token_logprobs,
    vocab_kl,
)
from posttrain.data import DataConfig, prompt_completions
from posttrain.errors import UserError
from posttrain.models import ModelConfig, load_policy, load_tokenizer, response_logits
from posttrain.models.loading import check_device
from posttrain.monitor import AlertConfig, EvalConfig
from posttrain.rewards import RewardComposer, RewardSpec, score_rollout
from posttrain.rollout import Rollout, RolloutConfig, SamplingParams, ScoringConfig, build_scorer, scored_logprobs
from posttrain.rollout.base import build_rollout
from posttrain.runtime import engines
from posttrain.runtime.config import (
    PLACED_BY_ACCELERATE,
    OptimConfig,
    RunConfig,
    check_choice,
    check_policy_loss,
    from_dict,
    python_sections,
    reject_ignored,
    validate_sections,
)
from posttrain.runtime.loop import NonFiniteGuard, PhaseTimer, build_optimizer
from posttrain.runtime.online import (
    OnlineTrainer,
    first_minibatch_metrics,
    minibatches,
    old_logprobs_of,
    reference_logprobs,
)
from posttrain.runtime.runlock import holds_run_dir
from posttrain.runtime.update import MinibatchUpdate, Optimized, StepMetrics, StepStats, micro_slices, ratio, std_of

DISTILL_LOSSES = ("reverse_kl", "jsd")
TEACHER_IGNORED = {
    "device": "use teacher_device (the teacher is frozen, so it may live anywhere)",
    "lora": "the teacher is frozen: point its path at a merged checkpoint",
    "gradient_checkpointing": "the teacher runs without gradients: nothing to recompute",
}
"""The fields of a teacher's model section that a frozen teacher does not use, and what to do instead."""


@python_sections  # sections and rewards given in Python resolve as YAML's do
@dataclass
class DistillConfig:
    """posttrain distill. ``run.batch_size`` counts responses per step (prompts × num_generations)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """The student: the policy that samples and is trained (``model.lora`` for LoRA)."""
    teacher: ModelConfig | None = None
    """The frozen teacher: another checkpoint (any size) with the student's tokenizer; loaded once. Required
    unless ``teachers`` names several."""
    teachers: dict[str, ModelConfig] = field(default_factory=dict)
    """Several frozen teachers, a mixture of specialists: {name: a model section}; each prompt row is graded by
    the one its ``teacher_column`` names (one no-grad pass per teacher over its rows), each logged as
    distill/<name>/*. Every teacher is loaded once and kept (their weights add up); in place of ``teacher``."""
    teacher_column: str = "teacher"
    """With ``teachers``: the prompt rows' column naming each row's teacher."""
    default_teacher: str | None = None
    """With ``teachers``: the teacher of a row without a ``teacher_column`` value; null = such a row stops the
    run at start."""
    data: DataConfig = field(default_factory=lambda: DataConfig(max_length=None, max_prompt_length=512))
    """Prompt rows {"prompt", ...}; the other columns go to the reward functions, if any. With lmbda < 1 every
    row needs a "completion" too: {"prompt", "completion"} rows, the data set's own responses."""
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-6, scheduler="constant"))
    """Optimizer and schedule of the student."""
    run: RunConfig = field(default_factory=RunConfig)
    """Steps (rollout batches), responses per step (batch_size), micro_batch_size, logging, checkpoints."""
    sampling: SamplingParams = field(default_factory=lambda: SamplingParams(max_new_tokens=256, temperature=1.0))
    """How the student samples."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """The engine that samples (hf | lean | vllm, colocate | server) and the sampler/trainer mismatch correction."""
    loss: str = "reverse_kl"
    """reverse_kl: −(log π_θ − log π_T) of each sampled token as its advantage in the policy-gradient loss
    (Thinking Machines, Qwen3); jsd: GKD's generalized JSD_β over the vocabulary at each response token."""
    beta: float = 0.5
    """β of loss=jsd: M = β·π_T + (1 − β)·π_θ; 0 = forward KL(π_T‖π_θ), 1 = reverse KL(π_θ‖π_T) over the vocabulary."""
    lmbda: float = 1.0
    """GKD's λ, the student data fraction: each step trains, with probability λ, on the student's own samples
    and otherwise on the data set's fixed completions (supervised KD). 1 = on-policy only; below 1 needs
    loss=jsd. Each step's draw comes from run.seed alone (the same on every process and on resume)."""
    temperature: float | None = None
    """τ of the divergence: both models' logits / τ; null = sampling.temperature. loss=reverse_kl reads the
    sampled tokens' log-probs at the sampling temperature, so it takes null or sampling.temperature only."""
    num_generations: int = 1
    """G: responses sampled per prompt."""
    minibatches: int = 1
    """Optimizer steps per rollout: the batch in this many shuffled minibatches (after the first, off-policy)."""
    clip_low: float = 0.2
    """loss=reverse_kl: the ratio π_θ/π_old is clipped below at 1 − clip_low (acts after the first minibatch)."""
    clip_high: float | None = None
    """loss=reverse_kl: clipped above at 1 + clip_high (null = clip_low)."""
    loss_agg: str = "token-mean"
    """Loss reduction: token-mean, seq-mean-token-mean, seq-mean-token-sum, seq-mean-token-sum-norm."""
    teacher_device: str | None = None
    """Device of the teacher (e.g. cpu to offload it); null = the training device (teacher_scoring.engine=hf)."""
    teacher_scoring: ScoringConfig = field(default_factory=ScoringConfig)
    """Where the teacher grades the sampled tokens: engine=hf, its forward in the training process; engine=vllm,
    a vLLM engine of its weights (loss=reverse_kl at temperature 1), colocated or, with mode=server, in another
    process (`posttrain vllm-serve --model TEACHER --port 8001`)."""
    rewards: list[RewardSpec] = field(default_factory=list)
    """Reward functions logged as reward/* (e.g. an exact-answer check), never in the loss; the default
    rewards of the held-out evaluation."""
    log_completions: int = 4
    """(prompt, completion, score) samples written to samples.jsonl per step (0 = none); the score is the
    response's −Σ_t (log π_θ − log π_T)(y_t)."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Held-out evaluation (eval.path or data.eval_fraction) at step 0, every run.eval_every steps and at the end."""
    alerts: AlertConfig = field(default_factory=AlertConfig)
    """Health alerts over the logged metrics: thresholds (console, progress bar, alerts.jsonl)."""

    def validate(self) -> None:
        validate_sections(self)
        self.rollout.check_sampling(self.sampling)
        if self.rollout.async_steps:
            raise ValueError(
                "rollout.async_steps applies to grpo and ppo; distillation samples each step's batch with the current "
                "policy (rollout.async_steps=0)"
            )
        reject_ignored(
            self,
            {"model.device": PLACED_BY_ACCELERATE, **{f"teacher.{k}": v for k, v in TEACHER_IGNORED.items()}},
        )
        self._check_teachers()
        for i, spec in enumerate(self.rewards):
            spec.validate(f"rewards[{i}]")
        if self.teacher_device is not None:  # before any model loads: a missing device failed after loading
            check_device(self.teacher_device, "teacher_device")
        check_choice("loss", self.loss, DISTILL_LOSSES)
        check_choice("loss_agg", self.loss_agg, AGGREGATION_MODES)
        if not 0 <= self.beta <= 1:
            raise ValueError(f"beta must be in [0, 1] (0 = forward KL, 1 = reverse KL), got {self.beta}")
        if not 0 <= self.lmbda <= 1:
            raise ValueError(f"lmbda must be in [0, 1] (the share of steps on the student's samples), got {self.lmbda}")
        if self.lmbda < 1 and self.loss == "reverse_kl":
            raise ValueError(
                f"lmbda={self.lmbda} trains some steps on the data set's completions, which the student did not "
                "sample: loss=reverse_kl's per-token estimate of the KL holds on the student's own samples only; use "
                "loss=jsd (GKD's divergence over the vocabulary holds at any prefix), or lmbda=1"
            )
        if self.temperature is not None and self.temperature <= 0:
            raise ValueError(f"temperature must be > 0 or null (= sampling.temperature), got {self.temperature}")
        if self.loss == "reverse_kl" and self.temperature not in (None, self.sampling.temperature):
            raise ValueError(
                f"temperature={self.temperature} with loss=reverse_kl: its advantage compares the sampled tokens' "
                f"log-probs at the sampling temperature ({self.sampling.temperature}); leave it null, or use loss=jsd"
            )
        if self.sampling.temperature == 0:
            raise ValueError("sampling.temperature must be > 0: the student's samples are its distribution")
        for key in ("num_generations", "minibatches"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key} must be >= 1, got {getattr(self, key)}")
        if self.run.batch_size % self.num_generations:
            raise ValueError(
                f"run.batch_size={self.run.batch_size} must be a multiple of num_generations={self.num_generations}"
            )
        check_policy_loss("ppo", self.clip_low, self.clip_high, ("ppo",))
        self._reject_other_loss_knobs()
        self._check_teacher_scoring()
        if (self.eval.path or self.data.eval_fraction > 0) and not (self.eval.rewards or self.rewards):
            asked = f"eval.path={self.eval.path}" if self.eval.path else f"data.eval_fraction={self.data.eval_fraction}"
            raise ValueError(
                f"{asked} asks for a held-out evaluation, which needs reward functions to score it: set eval.rewards "
                "(or rewards, logged in training too)"
            )

    def _reject_other_loss_knobs(self) -> None:
        """A knob the chosen ``loss`` never reads fails at start instead of being ignored."""
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        if self.loss == "reverse_kl" and self.beta != defaults["beta"]:
            raise ValueError(f"beta={self.beta} is the generalized JSD's mixture weight: it needs loss=jsd")
        if self.loss == "jsd":
            for name in ("clip_low", "clip_high"):
                if getattr(self, name) != defaults[name]:
                    raise ValueError(f"{name} clips reverse_kl's importance ratio: loss=jsd has none to clip")
            if self.rollout.importance_sampling != "none":
                raise ValueError(
                    f"rollout.importance_sampling={self.rollout.importance_sampling}: loss=jsd compares whole "
                    "distributions at the sampled positions, with no importance weight to correct; leave it none"
                )

    def _check_teachers(self) -> None:
        """One ``teacher``, or ``teachers`` by name (names fit a metric key); each section as ``teacher``'s."""
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        if not self.teachers:
            if self.teacher is None:
                raise ValueError(
                    "teacher.path is required: the teacher's checkpoint (or teachers: {NAME: {path: ...}, ...} for "
                    "several, each prompt row naming its own in teacher_column)"
                )
            for name in ("teacher_column", "default_teacher"):
                if getattr(self, name) != defaults[name]:
                    raise ValueError(f"{name}={getattr(self, name)!r} is read with teachers only (several teachers)")
            return
        if self.teacher is not None:
            raise ValueError(
                f"teacher.path={self.teacher.path} and teachers={sorted(self.teachers)} are both set: give one "
                "teacher, or several under teachers (one of them may be the same checkpoint)"
            )
        for name in list(self.teachers):
            if not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
                raise ValueError(f"teachers: the name {name!r} must be letters, digits, _ . - (it names metrics)")
            section = self.teachers[name]
            if isinstance(section, dict):  # given in Python as a mapping of a model section's fields
                section = self.teachers[name] = from_dict(ModelConfig, section, f"teachers.{name}")
            section.validate(f"teachers.{name}")
            for key, instead in TEACHER_IGNORED.items():
                if getattr(section, key) != getattr(ModelConfig(), key):
                    raise ValueError(f"teachers.{name}.{key}={getattr(section, key)!r} is not used: {instead}")
        if self.default_teacher is not None and self.default_teacher not in self.teachers:
            raise ValueError(
                f"default_teacher={self.default_teacher!r} is not one of the teachers ({', '.join(self.teachers)})"
            )
        if not self.teacher_column or self.teacher_column == "prompt":
            raise ValueError(f"teacher_column={self.teacher_column!r} must name a column of the prompt rows")
        if self.teacher_scoring.engine == "vllm":
            raise ValueError(
                "teacher_scoring.engine=vllm grades with one teacher's engine; teachers (several teachers) runs "
                "each teacher's forward in the training process: use teacher_scoring.engine=hf"
            )

    @property
    def teacher_sections(self) -> dict[str, ModelConfig]:
        """{name: model section} of every teacher: ``teachers``, or the one ``teacher`` named "teacher"."""
        return self.teachers or {"teacher": self.teacher}

    def _check_teacher_scoring(self) -> None:
        """A vLLM teacher returns log-probs of the sampled tokens at temperature 1, and nothing else."""
        if self.teacher_scoring.engine != "vllm":
            return
        if self.loss == "jsd":
            raise ValueError(
                "teacher_scoring.engine=vllm with loss=jsd: the generalized JSD reads the teacher's whole distribution "
                "at every response position, and vLLM returns the log-probs of the given tokens only; use loss="
                "reverse_kl (the teacher's log-prob of each sampled token), or teacher_scoring.engine=hf"
            )
        if self.sampling.temperature != 1:
            raise ValueError(
                f"teacher_scoring.engine=vllm with sampling.temperature={self.sampling.temperature}: vLLM's log-probs "
                "of given tokens are of the raw logits (temperature 1), while reverse_kl compares them with the "
                "student's at the sampling temperature; sample at temperature 1, or use teacher_scoring.engine=hf"
            )
        if self.teacher_device is not None:
            raise ValueError(
                f"teacher_device={self.teacher_device} places the teacher of teacher_scoring.engine=hf; a vLLM teacher "
                "lives in its engine (teacher_scoring.gpu_memory_utilization, or mode=server for another process)"
            )

    @property
    def divergence_temperature(self) -> float:
        return self.sampling.temperature if self.temperature is None else self.temperature


# --------------------------------------------------------------------------------------------------


def check_same_vocabulary(
    student, teacher, student_width: int, teacher_width: int, loss: str, teacher_path, key: str = "teacher"
) -> None:
    """Raise ``UserError`` unless the teacher can grade the student's token ids: the two tokenizers map the
    same strings to the same ids, and for loss=jsd the two models' logits have as many entries (the
    divergence compares them entry by entry). student, teacher: tokenizers; *_width: the models' vocab_size;
    ``key``: the teacher's section in the config (teacher, teachers.NAME)."""
    student_vocab, teacher_vocab = student.get_vocab(), teacher.get_vocab()
    if student_vocab != teacher_vocab:
        differ = sorted(set(student_vocab.items()) ^ set(teacher_vocab.items()), key=lambda kv: kv[1])[:3]
        raise UserError(
            f"{key}.path={teacher_path}: its tokenizer is not the student's ({len(teacher_vocab)} tokens against "
            f"{len(student_vocab)}; differing entries such as {differ}): the teacher scores the student's token ids, "
            "so both must use one tokenizer (the same tokens with the same ids)"
        )
    if loss == "jsd" and student_width != teacher_width:
        raise UserError(
            f"{key}.path={teacher_path}: loss=jsd compares the student's and the teacher's distributions entry by "
            f"entry, but their logits have {student_width} and {teacher_width} entries (one tokenizer, embeddings "
            "padded to other sizes); use loss=reverse_kl, which reads the teacher's log-prob of each sampled token only"
        )


def gkd_on_policy_steps(lmbda: float, steps: int, seed: int) -> torch.Tensor:
    """GKD's per-step choice of data (Agarwal et al. 2024, Algorithm 1): step k draws u_k ~ U(0, 1) and trains on
    the student's own samples when u_k < λ, otherwise on the data set's (input, output) pairs. Returns [steps]
    bool, True = on-policy. The draws come from a generator seeded by ``seed`` alone: every process and a
    resumed run make the same choices. λ = 1 is every step on-policy, λ = 0 none."""
    draws = torch.rand(steps, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return draws < lmbda


def completions_rollout(
    tokenizer, prompts: list[list[int]], completions: list[list[int]], sampling: SamplingParams
) -> Rollout:
    """A ``Rollout`` of given responses, one per prompt (token lists), in place of sampled ones: each cut at
    ``sampling.max_new_tokens`` (and then ``truncated``, as a sample stopped there is), without sampling
    log-probs, its log-probs to be taken at the sampling temperature."""
    limit = sampling.max_new_tokens
    kept = [c[:limit] for c in completions]
    response_ids = torch.full((len(kept), max(map(len, kept))), tokenizer.pad_token_id, dtype=torch.long)
    for i, ids in enumerate(kept):
        response_ids[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
    ends = torch.tensor([len(ids) - 1 for ids in kept])  # each response ends at its last token
    rollout = build_rollout(tokenizer, prompts, response_ids, [], ends, None, 1, sampling.logprob_temperature)
    rollout.truncated = torch.tensor([len(c) > limit for c in completions])
    return rollout


def _vocab_size(config: ModelConfig) -> int:
    from transformers import AutoConfig

    loaded = AutoConfig.from_pretrained(
        config.path, revision=config.revision, trust_remote_code=config.trust_remote_code
    )
    return loaded.get_text_config().vocab_size


def _weights_size(model: torch.nn.Module) -> str:
    """What a frozen model's weights hold on this process: its parameters and their bytes."""
    params = list(model.parameters())
    count = sum(getattr(p, "ds_numel", p.numel()) for p in params)  # ZeRO-3 keeps the full size in ds_numel
    size = sum(getattr(p, "ds_numel", p.numel()) * p.element_size() for p in params)
    return f"{count:,} parameters, {size / 2**20:.1f} MiB of weights ({params[0].dtype}, {params[0].device})"


def teacher_of_rows(values: list, teachers: list[str], default: str | None, where) -> list[str]:
    """The teacher of each row: its ``teacher_column`` value (``values``; None or "" where the row has none:
    then ``default``). A row left without a teacher, or naming one not in ``teachers``, raises ``UserError``
    naming the row (``where(i)``) and the teachers."""
    out = []
    for i, value in enumerate(values):
        name = default if value is None or value == "" else str(value)
        if name is None:
            raise UserError(
                f"{where(i)} names no teacher: give it one of {', '.join(teachers)} in its teacher column, or set "
                "default_teacher"
            )
        if name not in teachers:
            raise UserError(f"{where(i)} names the teacher {name!r}, which is not one of {', '.join(teachers)}")
        out.append(name)
    return out


def by_teacher(rows_of: dict[str, list[int]], n: int, forward) -> torch.Tensor:
    """The teachers' results in row order: ``forward(teacher, rows)`` ([len(rows), ...]) once for each teacher
    with rows (``rows_of``: {teacher: its rows, ascending}), scattered back to their rows: [n, ...]. One teacher
    with every row returns its own result as it is."""
    out = None
    for teacher, rows in rows_of.items():
        if not rows:
            continue
        part = forward(teacher, rows)
        if len(rows) == n:  # ascending and distinct: every row, in order
            return part
        if out is None:
            out = part.new_zeros((n, *part.shape[1:]))
        out[torch.tensor(rows, device=part.device)] = part
    return out


def _rows(values: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """``values[rows]``, or ``values`` itself when ``rows`` is every row in order."""
    return values if len(rows) == len(values) else values[torch.tensor(rows, device=values.device)]


@dataclass
class DistillBatch:
    """The rows of a rollout one minibatch trains on: the response ``mask``, the old log-probs and, for
    loss=reverse_kl, the advantages (all [b, T]); ``teacher_logprobs`` [b, T] is filled by loss=jsd's passes;
    ``teachers``: {teacher: its rows of the minibatch}."""

    rollout: Rollout
    mask: torch.Tensor
    old_logprobs: torch.Tensor
    advantages: torch.Tensor | None
    teacher_logprobs: torch.Tensor
    teachers: dict[str, list[int]]


class DistillTrainer(OnlineTrainer):
    """Holds the student, the teacher (or teachers, by name) and the state of a distillation run;
    ``train_step`` is the module docstring's box."""

    name = "distill"
    BAR_KEYS = ("distill/reverse_kl", "distill/teacher_logprob")
    SCORE_KEYS = ("score/mean", "score/std")

    def __init__(self, config: DistillConfig):
        super().__init__(config)
        acc = self.accelerator
        self.on_policy_steps = gkd_on_policy_steps(config.lmbda, self.total_steps, config.run.seed)
        # GKD's supervised steps read each prompt row's completion: every row is checked before a model loads
        self.completions = prompt_completions(self.prompts, config.data, self.tokenizer) if config.lmbda < 1 else None
        if config.teachers:  # every training row names a known teacher, before any model loads
            column, prompts = config.teacher_column, self.prompts
            teacher_of_rows(
                [p.columns.get(column) for p in prompts],
                list(config.teachers),
                config.default_teacher,
                # built in one f-string: a data path or prompt holding "{" must not be formatted a second time
                lambda i: (
                    f"data.path={config.data.path}: the row whose prompt is {_shown(prompts[i])!r} "
                    f"(teacher_column={column})"
                ),
            )
        for key, section in config.teacher_sections.items():
            check_same_vocabulary(
                self.tokenizer,
                load_tokenizer(section.tokenizer_path or section.path),
                _vocab_size(config.model),
                _vocab_size(section),
                config.loss,
                section.path,
                f"teachers.{key}" if config.teachers else "teacher",
            )
        self.rewards = None
        if config.rewards:  # logged only: no unscored-steps stop
            self.rewards = RewardComposer.from_specs(config.rewards, self.tokenizer, None, warn=self.console_warning)
        policy = load_policy(replace(config.model, device="cpu"))
        self.teachers, self.teacher_scorer = {}, None
        if config.teacher_scoring.engine == "hf":
            for key, section in config.teacher_sections.items():
                self.teachers[key] = engines.build_reference(
                    acc, policy, section, "copy", path=section.path, device=config.teacher_device
                )
                shown = f"{key} {section.path}" if config.teachers else section.path
                size = _weights_size(self.teachers[key].model)
                acc.print(f"[{self.name}] teacher {shown}: {config.teacher_scoring.describe()}, {size}")
        else:  # a vLLM engine of the teacher's weights, here or in its own process
            scoring, seed = config.teacher_scoring, config.run.seed
            self.teacher_scorer = build_scorer(scoring, config.teacher.path, self.tokenizer, seed)
            served = getattr(self.teacher_scorer, "model", config.teacher.path)  # a server reports what it holds
            if os.path.realpath(served) != os.path.realpath(config.teacher.path):
                self.console_warning(
                    f"the teacher server at {scoring.server_url} holds {served}, teacher.path is "
                    f"{config.teacher.path}: the server's model grades the samples (teacher.path gives the "
                    "tokenizer checked against the student's)"
                )
            acc.print(f"[{self.name}] teacher {config.teacher.path}: {config.teacher_scoring.describe()}")
        updates = self.total_steps * config.minibatches
        optimizer, scheduler = build_optimizer(
            [p for p in policy.parameters() if p.requires_grad], config.optim, updates
        )
        model, optimizer = engines.prepare(acc, policy, optimizer)
        acc.register_for_checkpointing(scheduler)
        self.actor = Optimized(model, optimizer, scheduler, NonFiniteGuard(acc, config.run), config.optim.max_grad_norm)
        self.passes = {"teacher": 0}
        self.start_engine(acc.unwrap_model(model))

    def teacher_rows(self, rollout: Rollout) -> dict[str, list[int]]:
        """{teacher: the rows of ``rollout`` it grades, ascending}, every teacher (none may be empty-handed
        on one process and not another: the logged sums keep one key set)."""
        cfg = self.config
        if not cfg.teachers:
            return {"teacher": list(range(len(rollout)))}
        values = rollout.columns.get(cfg.teacher_column, [None] * len(rollout))
        names = teacher_of_rows(values, list(cfg.teachers), cfg.default_teacher, lambda i: f"row {i}")
        return {t: [i for i, name in enumerate(names) if name == t] for t in cfg.teachers}

    def teacher_logprobs(self, rollout: Rollout, rows_of: dict[str, list[int]]) -> torch.Tensor:
        """log π_T(y_t) of every sampled token, [B, T]: each teacher's no-grad pass over its rows, in
        micro-batches (or the vLLM teacher's request), back in row order."""
        micro, device = self.config.run.micro_batch_size, self.accelerator.device
        if self.teacher_scorer is not None:
            return scored_logprobs(self.teacher_scorer, rollout).to(device)

        def forward(teacher: str, rows: list[int]) -> torch.Tensor:
            graded = rollout if len(rows) == len(rollout) else rollout.select(rows)
            return reference_logprobs(self.teachers[teacher], graded, micro, device)

        return by_teacher(rows_of, len(rollout), forward)

    def train_step(self, step: int, timer: PhaseTimer) -> tuple[dict, Rollout | None, torch.Tensor | None]:
        cfg, acc, device = self.config, self.accelerator, self.accelerator.device
        micro = cfg.run.micro_batch_size
        # 1. GKD's draw: the student samples G responses per prompt (rewards, if any, for the log), or the
        #    batch is the data set's completions
        on_policy = bool(self.on_policy_steps[step])
        with timer("generate"):
            rollout, columns = self.batch_of_step(on_policy)
        metrics = {"distill/on_policy": float(on_policy)}
        if self.rewards is not None and on_policy:
            with timer("reward"):
                metrics.update(self.reward_metrics(rollout, columns))
        mask = rollout.response_mask.to(device)
        with timer("old_logprobs"):
            if on_policy:
                old_logprobs, is_weights, mismatch = old_logprobs_of(
                    acc, self.engine, rollout, self.logprobs_of, micro, cfg.rollout, self.step_metrics
                )
                metrics.update(mismatch)
            else:  # no sampler drew these tokens: the student's log-probs of them, by the training forward
                with torch.no_grad():
                    old_logprobs = torch.cat([self.logprobs_of(rollout, s) for s in micro_slices(len(rollout), micro)])
                is_weights = None
        # 2-3. the teacher scores every sampled token; reverse_kl: per-token advantages (jsd: in the update)
        teacher_logprobs = advantages = None
        rows_of = self.teacher_rows(rollout)  # {teacher: its rows}: one teacher, or each row's own
        if cfg.loss == "reverse_kl":
            with timer("teacher"):
                teacher_logprobs = self.teacher_logprobs(rollout, rows_of)
            advantages = reverse_kl_advantages(old_logprobs, teacher_logprobs, mask)
            if is_weights is not None:  # w·min(r·A, clip(r)·A) = min(r·wA, clip(r)·wA) for w ≥ 0
                advantages = advantages * is_weights
        # 4. minibatches of the loss, one optimizer step each
        with timer("train"):
            update_metrics, from_update = self.update(step, rollout, old_logprobs, advantages, mask)
        metrics.update(update_metrics)
        self.passes["teacher"] += 1  # over every response of the step, once: in step 2 or in the update
        # 5. log
        teacher_logprobs = from_update if teacher_logprobs is None else teacher_logprobs
        distill_metrics(self.step_metrics, old_logprobs, teacher_logprobs, mask)
        if cfg.teachers:
            teacher_metrics(self.step_metrics, old_logprobs, teacher_logprobs, mask, rows_of)
        metrics.update({f"passes/{k}": v for k, v in self.passes.items()})
        scores = reverse_kl_advantages(old_logprobs, teacher_logprobs, mask).sum(-1)  # −Σ_t k1: the sequence's "reward"
        values = scores.double()  # one response per process still has a spread over the processes
        self.step_metrics.add(
            "score",
            lambda t: {"score/mean": t["sum"] / t["rows"], "score/std": std_of(t["sum"], t["sum_sq"], t["rows"])},
            rows=len(values),
            sum=values.sum(),
            sum_sq=values.square().sum(),
        )
        return metrics, rollout, scores

    def batch_of_step(self, on_policy: bool) -> tuple[Rollout, dict]:
        """Step 1's batch and its columns: G samples of each of this process's next P prompts, or the data
        set's completions of its next P·G prompts (one row each: the same number of rows)."""
        cfg, acc = self.config, self.accelerator
        if on_policy:
            prompts = self.sampler.take_for_process(self.local_prompts, self.prompts, acc)
            return self.generate(prompts, cfg.num_generations)
        rows = self.sampler.take_for_process(self.local_prompts * cfg.num_generations, range(len(self.prompts)), acc)
        prompts = [self.prompts[i] for i in rows]
        rollout = completions_rollout(
            self.tokenizer, [p.prompt_ids for p in prompts], [self.completions[i] for i in rows], cfg.sampling
        )
        keys = sorted({k for p in prompts for k in p.columns})
        rollout.columns = {k: [p.columns.get(k) for p in prompts] for k in keys}
        return rollout, rollout.columns

    def reward_metrics(self, rollout: Rollout, columns: dict) -> dict[str, float]:
        """Each function's mean; added to ``step_metrics``: reward/mean over the scored rows of every process
        (NaN when none was)."""
        out = score_rollout(self.rewards, rollout, columns)
        scored = ~torch.isnan(out.total)
        self.step_metrics.add(
            "reward",
            lambda t: {"reward/mean": ratio(t["sum"], t["scored"])},
            scored=scored.sum(),
            sum=out.total[scored].double().sum(),
        )
        metrics = {}
        for name, values in out.components.items():
            kept = [v for v in values if v is not None]
            metrics[f"reward/{name}/mean"] = sum(kept) / len(kept) if kept else math.nan
        return {**metrics, **self.rewards.fault_counts()}

    # -- 4. the update ---------------------------------------------------------------------------------

    def update(self, step: int, rollout: Rollout, old_logprobs, advantages, mask) -> tuple[dict, torch.Tensor]:
        """``minibatches`` shuffled minibatches, one optimizer step each. Returns (the policy metrics of the
        step, the teacher's log-probs [B, T] of the sampled tokens that loss=jsd's passes read; else 0s)."""
        cfg, acc = self.config, self.accelerator
        stats = StepStats()  # on the device until one reduction at the end of the step
        teacher_logprobs = torch.zeros_like(old_logprobs)
        shuffle = cfg.minibatches > 1
        for _, rows in minibatches(len(rollout), 1, cfg.minibatches, cfg.run.seed, step, shuffle):
            selected = rollout.select(rows)
            batch = DistillBatch(
                selected,
                mask[rows],
                old_logprobs[rows],
                None if advantages is None else advantages[rows],
                torch.zeros_like(old_logprobs[rows]),
                self.teacher_rows(selected),
            )
            update = MinibatchUpdate(acc, self.actor, batch.mask, cfg.loss_agg, cfg.run.micro_batch_size)
            for micro in update:  # none when no response token of the minibatch trains: no step either
                loss, loss_stats = self.loss(batch, micro.rows)
                update.backward(micro, loss, loss_stats)  # ∇(loss · share): its part of the minibatch's mean
            teacher_logprobs[rows] = batch.teacher_logprobs
            if not update.empty:
                stats.add(update, grad_norm=update.step(step))
        out = {("policy/" + k if k != "grad_norm" else k): v for k, v in stats.result(acc).items()}
        if stats.first is not None and cfg.loss == "reverse_kl":
            out.update(first_minibatch_metrics(stats.first))
        return out, teacher_logprobs

    def loss(self, batch: DistillBatch, s: slice) -> tuple[torch.Tensor, dict]:
        """(the loss of rows ``s``, reduced by ``loss_agg``; its stats with ``loss``)."""
        cfg, device = self.config, self.accelerator.device
        rollout, mask, length = batch.rollout, batch.mask[s], batch.rollout.response_length
        if cfg.loss == "reverse_kl":
            logprobs = self.logprobs_of(rollout, s)
            pg, stats = ppo_policy_loss(
                logprobs,
                batch.old_logprobs[s],
                batch.advantages[s],
                mask,
                clip_low=cfg.clip_low,
                clip_high=cfg.clip_high,
            )  # [b, T]
            loss = aggregate_loss(pg, mask, cfg.loss_agg, cfg.sampling.max_new_tokens)
            return loss, {**stats, "pg_loss": loss.detach(), "loss": loss.detach()}
        ids, attention = rollout.input_ids[s].to(device), rollout.attention_mask[s].to(device)
        in_micro = {t: [i - s.start for i in rows if s.start <= i < s.stop] for t, rows in batch.teachers.items()}

        def forward(teacher: str, rows: list[int]) -> torch.Tensor:  # each teacher over its rows of the micro-batch
            return self.teachers[teacher].response_logits(_rows(ids, rows), _rows(attention, rows), length)

        teacher_logits = by_teacher(in_micro, len(ids), forward).to(device)  # [b, T, V], no grad
        student_logits = response_logits(self.actor.model, ids, attention, length)  # [b, T, V]
        tau = cfg.divergence_temperature
        per_token = generalized_jsd(student_logits, teacher_logits, mask, cfg.beta, tau)
        loss = aggregate_loss(per_token, mask, cfg.loss_agg, cfg.sampling.max_new_tokens)
        with torch.no_grad():
            sampled = token_logprobs(teacher_logits, ids[:, -length:], rollout.temperature)
            batch.teacher_logprobs[s] = sampled.to(batch.teacher_logprobs.device)
            reverse = vocab_kl(
                torch.log_softmax(student_logits.float() / tau, -1), torch.log_softmax(teacher_logits.float() / tau, -1)
            )
        stats = {"jsd": masked_mean(per_token, mask), "reverse_kl_vocab": masked_mean(reverse, mask)}
        return loss, {**{k: v.detach() for k, v in stats.items()}, "loss": loss.detach()}


def distill_metrics(step: StepMetrics, logprobs: torch.Tensor, teacher_logprobs: torch.Tensor, mask) -> None:
    """Over the response tokens of every process, added to ``step``: the per-token reverse KL estimate
    mean(log π_old − log π_T) (k1 of the sampled tokens), its mean sum per response, and the mean
    log-probs of the sampled tokens under the student that sampled them and under the teacher."""
    valid = mask.bool()

    def masked_total(values: torch.Tensor) -> torch.Tensor:
        return torch.where(valid, values, 0.0).sum()

    def finish(t: dict[str, float]) -> dict[str, float]:
        tokens = max(t["tokens"], 1.0)
        return {
            "distill/reverse_kl": t["reverse_kl"] / tokens,
            "distill/reverse_kl_per_sequence": t["sequences"] / max(t["rows"], 1.0),
            "distill/teacher_logprob": t["teacher"] / tokens,
            "distill/student_logprob": t["student"] / tokens,
        }

    per_sequence = torch.where(valid, logprobs - teacher_logprobs, 0.0).sum(-1)
    step.add(
        "distill",
        finish,
        tokens=valid.sum(),
        reverse_kl=masked_total(logprobs - teacher_logprobs),
        sequences=per_sequence.sum(),
        rows=len(per_sequence),
        teacher=masked_total(teacher_logprobs),
        student=masked_total(logprobs),
    )


def teacher_metrics(step: StepMetrics, logprobs, teacher_logprobs, mask, rows_of: dict[str, list[int]]) -> None:
    """Per teacher, over its rows of every process, added to ``step``: ``distill/<teacher>/reverse_kl`` and
    ``/teacher_logprob`` (the per-token means of ``distill_metrics``), ``/rows`` and ``/tokens``. Every process
    adds every teacher, with zeros where it holds none of its rows (one collective, one key set); a teacher
    with no rows on any process logs NaN means and 0 rows."""
    valid = mask.bool()
    for teacher, rows in rows_of.items():
        index = torch.tensor(rows, dtype=torch.long, device=valid.device)
        kept = valid[index]

        def finish(t: dict[str, float], teacher=teacher) -> dict[str, float]:
            return {
                f"distill/{teacher}/reverse_kl": ratio(t["reverse_kl"], t["tokens"]),
                f"distill/{teacher}/teacher_logprob": ratio(t["teacher"], t["tokens"]),
                f"distill/{teacher}/rows": t["rows"],
                f"distill/{teacher}/tokens": t["tokens"],
            }

        step.add(
            f"distill/{teacher}",
            finish,
            rows=len(rows),
            tokens=kept.sum(),
            reverse_kl=torch.where(kept, logprobs[index] - teacher_logprobs[index], 0.0).sum(),
            teacher=torch.where(kept, teacher_logprobs[index], 0.0).sum(),
        )


def _shown(prompt) -> str:
    """A prompt row's text as an error names it: the prompt, or a conversation's last message, cut at 60."""
    text = prompt.prompt if isinstance(prompt.prompt, str) else prompt.prompt[-1]["content"]
    return str(text)[:60]  # a multimodal message's content is a list of parts


@holds_run_dir  # the run folder stays locked until the run ends (runlock)
def train(config: DistillConfig, callbacks=()) -> dict:
    """Run on-policy distillation; writes ``<run.output_dir>/final/policy`` (the student)."""
    return DistillTrainer(config).train(callbacks)
