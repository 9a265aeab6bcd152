"""Held-out evaluation of a policy: generate for prompts the optimiser never sees and score the
completions with reward functions it never optimises against (by default the training rewards).

Two passes, each optional:
  - greedy: one completion per prompt at temperature 0 → ``accuracy`` (share of prompts whose
    completion scores ≥ ``correct_threshold``), mean score, mean score per function, mean length,
    truncation share;
  - sampled: ``n`` completions per prompt at ``temperature`` → the same means, and pass@k for each k,
    with the unbiased estimator of Chen et al. 2021 (``pass_at_k``).

PPO and GRPO call ``Evaluator.evaluate`` at step 0 (the starting model, ``eval.at_start``), every
``run.eval_every`` steps and at the end (metrics ``eval/greedy/*``, ``eval/sampled/*``; rows in
``eval_samples.jsonl``); ``posttrain eval`` runs it on any checkpoint (``evaluate_checkpoint``). With an
``env`` each completion is an episode (``posttrain.envs.run_episodes``): the rewards read the model's last
turn, and the tool calls and turns per episode are reported beside the accuracy.
"""

from __future__ import annotations

import json
import math
import traceback
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from posttrain.data import DataConfig, PromptExample, check_columns, load_prompts
from posttrain.envs import EnvConfig, Environment, data_specs, environment_for, run_episodes, with_environment_reward
from posttrain.errors import UserError
from posttrain.models import ModelConfig, load_policy, load_tokenizer
from posttrain.monitor.records import strict_json
from posttrain.rewards import RewardComposer, RewardSpec, reward_columns, score_rollout
from posttrain.rollout import RolloutConfig, SamplingParams, build_engine, choose_engine


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from ``n`` samples of which ``c`` are correct (Chen et al. 2021, eq. 1):

        pass@k = 1 − C(n − c, k) / C(n, k)

    the probability that at least one of k samples drawn without replacement from the n is correct.
    Exact integer binomials (n is small in evaluation), so no product-form rounding.
    """
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


@dataclass
class EvalConfig:
    """Held-out evaluation during PPO/GRPO (every ``run.eval_every`` steps and at the end) and in ``posttrain eval``."""

    path: str | None = None
    """Held-out prompt rows (same schema and template settings as ``data``); null = ``data.eval_fraction``
    of the prompts, and no evaluation when that is 0."""
    rewards: list[RewardSpec] = field(default_factory=list)
    """Reward functions for evaluation only (e.g. an exact-match check, another reward model); empty =
    the training rewards (in PPO: its reward functions and its reward model)."""
    greedy: bool = True
    """One greedy completion per prompt: accuracy and mean scores at temperature 0."""
    n: int = 0
    """Completions sampled per prompt at ``temperature`` for pass@k (0 = no sampled pass)."""
    k: list[int] = field(default_factory=list)
    """pass@k for each k (each ≤ n); empty = k ∈ {1, n}."""
    temperature: float = 1.0
    """Temperature of the sampled pass."""
    max_new_tokens: int | None = None
    """Most tokens per completion; null = the training ``sampling.max_new_tokens``."""
    correct_threshold: float = 1.0
    """A completion is correct (accuracy, pass@k) when its total evaluation score is ≥ this."""
    max_prompts: int | None = None
    """Evaluate on at most this many held-out prompts (the first ones); null = all."""
    batch_size: int = 64
    """Prompts per generate call."""
    seed: int = 0
    """Seed of the sampled pass: the same samples for the same weights, and the training RNG untouched."""
    at_start: bool = True
    """Evaluate the starting model too, at step 0 before any update (the baseline the report plots and
    alert 7 compares with)."""

    def validate(self, name: str = "eval") -> None:
        if self.n < 0:
            raise ValueError(f"{name}.n must be >= 0, got {self.n}")
        if not self.greedy and self.n == 0:
            raise ValueError(f"{name}: greedy=false and n=0 leave nothing to evaluate")
        for k in self.k:
            if not 1 <= k <= self.n:
                raise ValueError(f"{name}.k: every k must be in [1, n={self.n}], got {k}")
        if self.temperature <= 0 and self.n > 0:
            raise ValueError(f"{name}.temperature must be > 0 for the sampled pass (greedy is separate)")
        for key in ("max_new_tokens", "max_prompts"):
            value = getattr(self, key)
            if value is not None and value < 1:
                raise ValueError(f"{name}.{key} must be >= 1 or null, got {value}")
        if self.batch_size < 1:
            raise ValueError(f"{name}.batch_size must be >= 1, got {self.batch_size}")
        for i, spec in enumerate(self.rewards):
            spec.validate(f"{name}.rewards[{i}]")

    @property
    def ks(self) -> list[int]:
        return sorted(set(self.k or ([1, self.n] if self.n else [])))


class EvaluationError(RuntimeError):
    """Held-out evaluation failed (a reward function raised or returned something unusable); ``details``
    holds the traceback. A trainer reports it and keeps training: evaluation must never lose a run."""

    def __init__(self, message: str, details: str = ""):
        super().__init__(message)
        self.details = details


class Evaluator:
    """Evaluates a policy (through a rollout engine) on fixed held-out prompts."""

    def __init__(
        self,
        config: EvalConfig,
        prompts: list[PromptExample],
        rewards: RewardComposer,
        sampling: SamplingParams,
        output_dir: str | Path | None = None,
        accelerator=None,
        tokenizer=None,
        progress: bool = False,
        env: tuple[Environment, EnvConfig] | None = None,
    ):
        """``tokenizer``: writes each sample's texts with their special tokens too (``prompt_text``,
        ``completion_text``); ``progress``: a progress bar over the generate calls (the main process's);
        ``env``: (environment, its config) to evaluate episodes in (needs ``tokenizer``)."""
        self.config = config
        self.env = env
        self.tokenizer = tokenizer
        self.progress = progress
        self.prompts = prompts[: config.max_prompts] if config.max_prompts else prompts
        self.rewards = rewards
        self.sampling = replace(sampling, max_new_tokens=config.max_new_tokens or sampling.max_new_tokens)
        self.output_dir = None if output_dir is None else Path(output_dir)
        self.accelerator = accelerator
        self.failure: Exception | None = None
        self.failure_details = ""

    @classmethod
    def for_training(cls, config, eval_prompts: list[PromptExample], tokenizer, accelerator) -> Evaluator | None:
        """The evaluator of a PPO/GRPO run: ``config.eval.path`` when set, else ``eval_prompts`` (the
        ``data.eval_fraction`` split); None when there is nothing to evaluate on. Without ``eval.rewards``
        it scores with the training rewards: the reward functions and, in PPO, the reward model."""
        env_config = getattr(config, "env", None)
        specs = list(config.eval.rewards or config.rewards)
        reward_model = getattr(config, "reward_model", None)
        if not config.eval.rewards and reward_model is not None and reward_model.path:
            device = str(reward_model.resolved_device())
            specs.append(
                RewardSpec("posttrain.rewards.model:reward_model", kwargs={"path": reward_model.path, "device": device})
            )
        if config.eval.path:
            eval_prompts, report = load_prompts(replace(config.data, path=config.eval.path), tokenizer)
            accelerator.print(f"[eval] held-out prompts: {report.summary()}")
            check_columns(eval_prompts, reward_columns(data_specs(specs)), config.eval.path)
        if not eval_prompts:
            return None
        # the policy tokenizer, as in training; no unscored-steps stop (an evaluation reports NaN scores); the
        # environment's reward reads a column the episodes write
        specs = with_environment_reward(specs, env_config)
        rewards = RewardComposer.from_specs(specs, tokenizer, max_unscored_steps=None)
        return cls(
            config.eval,
            eval_prompts,
            rewards,
            config.sampling,
            config.run.output_dir,
            accelerator,
            tokenizer,
            progress=getattr(config.run, "progress", False),
            env=_with_config(environment_for(env_config, tokenizer), env_config),
        )

    def due(self, step: int, total_steps: int, every: int | None) -> bool:
        """At step 0 (before any update) when ``at_start``, every ``every`` steps and at the last one."""
        if step == 0:
            return self.config.at_start
        return step == total_steps or bool(every and step % every == 0)

    def evaluate(self, engine, step: int) -> dict[str, float]:
        """``eval/...`` metrics of the policy behind ``engine``; every process returns the same numbers.

        A reward function that fails (raises, or returns what the composer refuses) raises
        ``EvaluationError`` on every process, after every process has made all its generate calls (with
        a sharded policy they are collective): a trainer reports it and goes on training."""
        cfg, records, self.failure = self.config, [], None
        devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
        with torch.random.fork_rng(devices=devices):  # the training RNG continues as if no evaluation ran
            if cfg.greedy:
                records += self._generate(engine, replace(self.sampling, temperature=0.0), 1, "greedy", step)
            if cfg.n:
                torch.manual_seed(cfg.seed)
                params = replace(self.sampling, temperature=cfg.temperature)
                records += self._generate(engine, params, cfg.n, "sampled", step)
        self._raise_failure(step)
        records = self._gather(records)
        self._write(records)
        return summarize(records, cfg.ks)

    def _raise_failure(self, step: int) -> None:
        """``EvaluationError`` on every process when scoring failed on any (a collective under
        data parallelism: no process is left waiting in the gather)."""
        failed = self.failure is not None
        if self.accelerator is not None and self.accelerator.num_processes > 1:
            flag = torch.tensor([float(failed)], device=self.accelerator.device)
            failed = bool(self.accelerator.reduce(flag, reduction="sum").item() > 0)
        if not failed:
            return
        error = self.failure
        what = "a reward function failed on another process"
        if error is not None:
            what = f"{type(error).__name__}: {error}"
        raise EvaluationError(f"held-out evaluation at step {step} failed: {what}", details=self.failure_details)

    def _generate(self, engine, params: SamplingParams, n: int, mode: str, step: int) -> list[dict]:
        rank, world = (
            (0, 1) if self.accelerator is None else (self.accelerator.process_index, self.accelerator.num_processes)
        )
        indices = list(range(len(self.prompts)))[rank::world]
        records = []
        # every process makes the same number of generate calls: with a sharded policy (FSDP2, ZeRO-3) each
        # call is collective (transformers' synced_gpus); a process short of prompts repeats the first one
        # and keeps nothing from it
        calls = math.ceil(math.ceil(len(self.prompts) / world) / self.config.batch_size)
        from tqdm import tqdm

        bar = tqdm(
            total=len(indices) * n,
            desc=f"[eval] step {step} {mode}",
            unit="completion",
            disable=not self.progress or rank != 0,
            leave=False,
        )
        for start in range(0, calls * self.config.batch_size, self.config.batch_size):
            chunk = indices[start : start + self.config.batch_size]
            if not chunk:
                engine.generate([self.prompts[0].prompt_ids], params, n=n)
                continue
            prompts = [self.prompts[i] for i in chunk]
            rollout, columns = self._sample(engine, prompts, params, n)
            bar.update(len(rollout))
            if self.failure is not None:  # generate on, in step with the other processes; score no more
                continue
            try:  # the arguments training gives (grpo._score, ppo.scores)
                out = score_rollout(self.rewards, rollout, columns)
            except Exception as err:  # the composer's RewardError, a bad value, a function's own bug
                self.failure, self.failure_details = err, traceback.format_exc()
                continue
            for row in range(len(rollout)):
                score = float(out.total[row])
                records.append(
                    {
                        "step": step,
                        "mode": mode,
                        "prompt_index": chunk[row // n],
                        "prompt": rollout.prompts[row],
                        "completion": rollout.responses[row],
                        "score": None if math.isnan(score) else score,
                        "rewards": {name: values[row] for name, values in out.components.items()},
                        "correct": not math.isnan(score) and score >= self.config.correct_threshold,
                        "length": int(rollout.response_lengths[row]),
                        "truncated": bool(rollout.truncated[row]),
                    }
                )
                if self.tokenizer is not None:
                    records[-1]["prompt_text"], records[-1]["completion_text"] = rollout.texts(self.tokenizer, row)
                for key, values in columns.items():
                    records[-1].setdefault(key, values[row])
        bar.close()
        return records

    def _sample(self, engine, prompts: list[PromptExample], params: SamplingParams, n: int):
        """(rollout, its columns) of ``n`` completions, or episodes with an ``env``, per prompt."""
        if self.env is not None:
            env, env_config = self.env
            rows = [p.row for p in prompts]
            rollout = run_episodes(engine, env, env_config, self.tokenizer, rows, params, n)
            return rollout, rollout.columns
        rollout = engine.generate([p.prompt_ids for p in prompts], params, n=n)
        keys = sorted({k for p in prompts for k in p.columns})
        return rollout, {k: [p.columns.get(k) for p in prompts for _ in range(n)] for k in keys}

    def _gather(self, records: list[dict]) -> list[dict]:
        if self.accelerator is None or self.accelerator.num_processes == 1:
            return records
        from accelerate.utils import gather_object

        return sorted(gather_object(records), key=lambda r: (r["mode"], r["prompt_index"]))

    def _write(self, records: list[dict]) -> None:
        if self.output_dir is None or (self.accelerator is not None and not self.accelerator.is_main_process):
            return
        self.output_dir.mkdir(parents=True, exist_ok=True)
        with open(self.output_dir / "eval_samples.jsonl", "a", encoding="utf-8") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)


def summarize(records: list[dict], ks: list[int]) -> dict[str, float]:
    """``eval/{greedy,sampled}/...`` metrics from the per-completion records of one evaluation."""
    out: dict[str, float] = {}
    for mode in ("greedy", "sampled"):
        rows = [r for r in records if r["mode"] == mode]
        if not rows:
            continue
        prefix = f"eval/{mode}/"
        scores = [r["score"] for r in rows if r["score"] is not None]
        out[prefix + "score"] = sum(scores) / len(scores) if scores else math.nan
        for name in rows[0]["rewards"]:
            values = [r["rewards"][name] for r in rows if r["rewards"][name] is not None]
            out[prefix + f"reward/{name}"] = sum(values) / len(values) if values else math.nan
        out[prefix + "accuracy"] = sum(r["correct"] for r in rows) / len(rows)
        out[prefix + "length"] = sum(r["length"] for r in rows) / len(rows)
        out[prefix + "truncated_share"] = sum(r["truncated"] for r in rows) / len(rows)
        if "tool_calls" in rows[0]:  # episodes
            out[prefix + "tool_call_share"] = sum(r["tool_calls"] > 0 for r in rows) / len(rows)
            out[prefix + "turns"] = sum(r["turns"] for r in rows) / len(rows)
        if mode == "sampled":
            per_prompt: dict[int, list[bool]] = {}
            for r in rows:
                per_prompt.setdefault(r["prompt_index"], []).append(r["correct"])
            for k in ks:
                values = [pass_at_k(len(c), sum(c), k) for c in per_prompt.values()]
                out[prefix + f"pass@{k}"] = sum(values) / len(values)
    return out


def _with_config(env: Environment | None, config: EnvConfig | None) -> tuple[Environment, EnvConfig] | None:
    return None if env is None else (env, config)


# --------------------------------------------------------------------------------------------------
# posttrain eval
# --------------------------------------------------------------------------------------------------


@dataclass
class EvalRunConfig:
    """posttrain eval: a checkpoint (full model or LoRA adapter) on a prompt file."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """The policy to evaluate: a model folder, a hub id, or a peft adapter folder."""
    data: DataConfig = field(default_factory=lambda: DataConfig(max_length=None, max_prompt_length=512))
    """Prompt rows {"prompt", ...}; the other columns go to the reward functions."""
    rewards: list[RewardSpec] = field(default_factory=list)
    """Reward functions that score the completions (a reward model: posttrain.rewards.model:reward_model)."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Greedy and/or sampled passes, k, temperature, threshold."""
    sampling: SamplingParams = field(default_factory=lambda: SamplingParams(max_new_tokens=256))
    """Sampling settings besides the temperature (max_new_tokens, top_p, top_k, stops)."""
    env: EnvConfig = field(default_factory=EnvConfig)
    """Evaluate episodes in this environment (the training run's ``env``); name=none: one completion."""
    output_dir: str | None = None
    """Folder for eval_summary.json and eval_samples.jsonl; null = print only."""

    def validate(self) -> None:
        self.model.validate("model")
        self.data.validate("data")
        self.eval.validate("eval")
        self.sampling.validate("sampling")
        self.env.validate("env")
        if not self.rewards and not self.env.enabled:
            raise ValueError("rewards: at least one reward function is needed (--rewards or --reward-model)")
        for i, spec in enumerate(self.rewards):
            spec.validate(f"rewards[{i}]")


RUN_RECORDS = ("config.yaml", "metrics.jsonl")
"""Files a training run writes into its folder: a folder holding one is a run's, not an evaluation's."""


def check_output_dir(output_dir: str) -> None:
    """Refuse (before any model loads) an ``output_dir`` that holds a training run's records: its
    eval_samples.jsonl is the run's own held-out evaluations, by step, and this evaluation's samples would
    join them as step 0, mixed with the starting model's."""
    out = Path(output_dir)
    held = [name for name in RUN_RECORDS if (out / name).is_file()]
    if held:
        raise UserError(
            f"--output-dir: {out} holds a training run's records ({', '.join(held)}), whose eval_samples.jsonl is "
            f"the run's own evaluations by step; an evaluation writes into a folder of its own: e.g. --output-dir "
            f"{out / 'eval'}"
        )


def evaluate_checkpoint(config: EvalRunConfig) -> dict[str, float]:
    """Evaluate ``config.model`` on ``config.data``; returns the ``eval/...`` metrics (and writes them
    to ``output_dir`` when set: one evaluation per folder, an earlier one's files are replaced)."""
    config.validate()
    if config.output_dir:
        check_output_dir(config.output_dir)
    tokenizer = load_tokenizer(config.model.tokenizer_path or config.model.path)
    from posttrain.models.template_mode import warn_template_mismatch

    warn_template_mismatch(
        config.model.path, config.data.chat_template, tokenizer, lambda m: print(f"[eval] warning: {m}")
    )
    prompts, _ = load_prompts(config.data, tokenizer)
    check_columns(prompts, reward_columns(data_specs(config.rewards)), config.data.path)  # before the model loads
    model = load_policy(config.model)
    specs = with_environment_reward(config.rewards, config.env)
    rewards = RewardComposer.from_specs(specs, tokenizer, max_unscored_steps=None)
    env = _with_config(environment_for(config.env, tokenizer), config.env)
    evaluator = Evaluator(config.eval, prompts, rewards, config.sampling, config.output_dir, None, tokenizer, True, env)
    chosen, why = choose_engine(model)
    print(f"[eval] {len(evaluator.prompts)} prompts; rollout.engine=auto: {chosen} ({why})")
    engine = build_engine(RolloutConfig(engine="auto"), model, tokenizer, config.model.path, config.eval.seed)
    for name in ("eval_samples.jsonl", "eval_summary.json"):  # an earlier evaluation's: the samples append
        if config.output_dir:
            (Path(config.output_dir) / name).unlink(missing_ok=True)
    try:
        metrics = evaluator.evaluate(engine, step=0)
    except EvaluationError:
        raise evaluator.failure from None  # no training to keep here: the reward function's own error
    metrics["eval/prompts"] = len(evaluator.prompts)
    if config.output_dir:
        (Path(config.output_dir) / "eval_summary.json").write_text(json.dumps(strict_json(metrics), indent=2))
    return metrics


def format_table(metrics: dict[str, float], correct_threshold: float | None = None) -> str:
    """The metrics as a two-column text table; with ``correct_threshold``, a line saying what
    ``accuracy`` and ``pass@k`` count (they read like 0/1 accuracies, also over a reward model's
    unbounded scores)."""
    width = max(len(k) for k in metrics)
    lines = [
        f"{k.ljust(width)}  {v:.4f}" if isinstance(v, float) else f"{k.ljust(width)}  {v}" for k, v in metrics.items()
    ]
    if correct_threshold is not None and any(k.endswith("/accuracy") or "/pass@" in k for k in metrics):
        lines.append(
            f"(accuracy, pass@k: the share of completions whose total score is >= eval.correct_threshold = "
            f"{correct_threshold:g}; for a reward model's scores, set it to the score that counts as correct)"
        )
    return "\n".join(lines)
