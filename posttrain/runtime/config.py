"""Configs: dataclasses composed of small shared ones, loaded from YAML, overridden by ``key=value``.

A field is documented once, by the string literal right under it; ``field_docs`` reads those for
``--help``. YAML maps one-to-one onto the dataclass: an unknown key is an error naming the key and the
keys allowed there; values are converted to the field's type, and ``validate()`` checks the rest at
start, naming the field and what is allowed.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import functools
import inspect
import math
import re
import textwrap
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from posttrain.sections import given_fields, remembers_given

SCHEDULERS = ("constant", "linear", "cosine")
REPORTERS = ("jsonl", "tensorboard", "wandb", "mlflow", "trackio")
MIXED_PRECISION = ("no", "bf16", "fp16")


@remembers_given  # GRPO's optim default (lr 1e-6, constant) holds for OptimConfig(lr=...) built in Python
@dataclass
class OptimConfig:
    """AdamW and its learning-rate schedule."""

    lr: float = 1e-5
    """Peak learning rate."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay."""
    adam_beta1: float = 0.9
    """AdamW β1."""
    adam_beta2: float = 0.999
    """AdamW β2."""
    adam_eps: float = 1e-8
    """AdamW ε."""
    scheduler: str = "linear"
    """Learning-rate schedule after warm-up: constant, linear (to 0) or cosine (to 0)."""
    warmup_steps: int = 0
    """Optimizer steps of linear warm-up: step k < W runs at lr·(k+1)/(W+1) (W=2: lr/3, 2lr/3, then lr), so the
    first step already learns; transformers' get_linear_schedule_with_warmup starts at 0 (0, lr/2, lr)."""
    max_grad_norm: float | None = 1.0
    """Clip the global gradient norm to this; null = no clipping."""

    def validate(self, name: str = "optim") -> None:
        check_choice(f"{name}.scheduler", self.scheduler, SCHEDULERS)
        if self.lr <= 0:
            raise ValueError(f"{name}.lr must be > 0, got {self.lr}")
        if self.warmup_steps < 0:
            raise ValueError(f"{name}.warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.max_grad_norm is not None and self.max_grad_norm <= 0:
            raise ValueError(f"{name}.max_grad_norm must be > 0 or null, got {self.max_grad_norm}")


@dataclass
class RunConfig:
    """Steps, batches, logging and checkpoints of one run."""

    output_dir: str = "runs/default"
    """Run directory: resolved config, metrics.jsonl, TensorBoard events, checkpoints, final model."""
    seed: int = 0
    """Seed of the data order, the sampler and every random number generator."""
    max_steps: int | None = None
    """Optimizer steps; null = ``epochs`` passes over the training data."""
    epochs: float = 1.0
    """Passes over the training data when max_steps is null."""
    batch_size: int = 8
    """Examples per optimizer step, all processes together; it splits evenly over the processes."""
    micro_batch_size: int = 8
    """Most examples per forward/backward on one process (gradient accumulation fills the rest; any value:
    the last micro-batch is smaller when it does not divide, and the update is the same for any split)."""
    log_every: int = 1
    """Log metrics every this many steps."""
    eval_every: int | None = None
    """Evaluate on the held-out split every this many steps (and at the end); null = only at the end."""
    save_every: int | None = None
    """Save a resumable checkpoint every this many steps and at the last; null = none (final/ only)."""
    keep_last: int = 2
    """Periodic checkpoints to keep (the oldest are deleted)."""
    resume_from: str | None = None
    """``latest`` (the newest complete checkpoint in output_dir) or a checkpoint folder; null = fresh."""
    overwrite: bool = False
    """Clear a non-empty output_dir before a fresh run (without it such a run is refused)."""
    max_nonfinite_steps: int = 3
    """Stop the run after this many optimizer updates in a row skipped for a non-finite loss or gradient norm."""
    report_to: list[str] = field(default_factory=lambda: ["jsonl", "tensorboard"])
    """Metric sinks: jsonl, tensorboard, wandb, mlflow, trackio (each needs its package; checked at start)."""
    project: str = "posttrain"
    """The W&B / trackio project and the MLflow experiment the run is logged under."""
    name: str | None = None
    """The run's name in W&B, MLflow and trackio; null = output_dir's name (sft, rm, dpo) or the trainer's."""
    progress: bool | None = True
    """true: a progress bar with step, ETA and the key metrics; false: one plain line per logged step instead
    (for log files); null: nothing per step (a caller that prints its own lines, as ``posttrain demo``)."""
    mixed_precision: str = "no"
    """accelerate mixed precision: no, bf16 or fp16."""
    keep_freed_memory: bool = True
    """Keep the CPU memory a step frees in the process's heap for the next step (glibc's ``mallopt``; Linux)
    instead of handing it back to the OS, which gives it again as fresh pages, one page fault each: time
    saved on the tiny bench models, peak RSS unchanged (bench/README.md has the figures). It applies to
    the whole process for the rest of its life, and not when the environment sets glibc's malloc options
    or preloads another allocator (``engines.keep_freed_memory``); what it holds goes back to the OS when
    the run ends. false leaves the allocator as it is."""

    def validate(self, name: str = "run") -> None:
        for key in ("batch_size", "micro_batch_size", "log_every", "keep_last", "max_nonfinite_steps"):
            if getattr(self, key) < 1:
                raise ValueError(f"{name}.{key} must be >= 1, got {getattr(self, key)}")
        for key in ("max_steps", "eval_every", "save_every"):
            value = getattr(self, key)
            if value is not None and value < 1:
                raise ValueError(f"{name}.{key} must be >= 1 or null, got {value}")
        if self.epochs <= 0:
            raise ValueError(f"{name}.epochs must be > 0, got {self.epochs}")
        for sink in self.report_to:
            check_choice(f"{name}.report_to", sink, REPORTERS)
        check_choice(f"{name}.mixed_precision", self.mixed_precision, MIXED_PRECISION)


def validate_sections(config) -> None:
    """``validate(name)`` every section of a trainer config (model, data, optim, run, sampling, ...):
    each field whose value is a dataclass with its own ``validate``, null sections skipped. Every
    float field, at any depth, must be finite first (NaN passes every range check)."""
    check_finite(config)
    for f in dataclasses.fields(config):
        section = getattr(config, f.name)
        if dataclasses.is_dataclass(section) and hasattr(section, "validate"):
            section.validate(f.name)


PLACED_BY_ACCELERATE = (
    "the trainers place models with accelerate (one process per device: CUDA_VISIBLE_DEVICES, accelerate "
    "launch / torchrun); leave it at auto"
)


def reject_ignored(config, ignored: dict[str, str]) -> None:
    """Fail at start when a field the trainer does not use is set to anything but its default, instead
    of accepting it silently. ignored: {"section.field": what to do instead}; null sections skipped."""
    for dotted, instead in ignored.items():
        section_name, name = dotted.split(".")
        section = getattr(config, section_name)
        if section is None:
            continue
        (default,) = [f.default for f in dataclasses.fields(section) if f.name == name]
        if getattr(section, name) != default:
            raise ValueError(f"{dotted}={getattr(section, name)!r} is not used by this trainer: {instead}")


def check_finite(config, where: str = "") -> None:
    """Raise naming the first float field of ``config`` (nested dataclasses and lists of them) that is
    NaN or ±inf."""
    for f in dataclasses.fields(config):
        key = f"{where}{f.name}"
        values = getattr(config, f.name)
        for i, value in enumerate(values if isinstance(values, list) else [values]):
            name = f"{key}[{i}]" if isinstance(values, list) else key
            if dataclasses.is_dataclass(value):
                check_finite(value, f"{name}.")
            elif isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value}")


def check_choice(name: str, value, allowed) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {tuple(allowed)}, got {value!r}")


def check_policy_loss(policy_loss: str, clip_low: float, clip_high: float | None, allowed) -> None:
    """``policy_loss`` is one of ``allowed`` and its clip range holds: clip_low in (0, 1), clip_high > 0 or
    null; cispo clips a weight, which may have no lower bound (any clip_low ≥ 1, since a ratio is > 0); gmpo
    clips the log-ratio, so any clip_low > 0 keeps the ratio above e^−clip_low > 0. sapo has no clip range
    (``check_sapo_knobs``)."""
    check_choice("policy_loss", policy_loss, allowed)
    unbounded = {"cispo": " (≥ 1: no lower bound on the weight)", "gmpo": " (log space: the ratio ≥ e^-clip_low)"}
    if policy_loss == "sapo":
        return
    if not 0 < clip_low < (math.inf if policy_loss in unbounded else 1) or (clip_high is not None and clip_high <= 0):
        low = "> 0" + unbounded[policy_loss] if policy_loss in unbounded else "in (0, 1)"
        raise ValueError(
            f"clip_low must be {low} and clip_high > 0 or null with policy_loss={policy_loss}, "
            f"got clip_low={clip_low}, clip_high={clip_high}"
        )


def check_sapo_knobs(config) -> None:
    """SAPO's gate has two temperatures (``tau_pos``, ``tau_neg`` > 0) and no clip range; every other policy
    loss has a clip range and no temperatures. A knob the chosen loss does not read, set to anything but its
    default, fails at start instead of being ignored. ``config``: a trainer config with those four fields."""
    defaults = {f.name: f.default for f in dataclasses.fields(config)}
    sapo = config.policy_loss == "sapo"
    if sapo and not (config.tau_pos > 0 and config.tau_neg > 0):
        raise ValueError(
            f"tau_pos and tau_neg must be > 0 with policy_loss=sapo, got tau_pos={config.tau_pos}, "
            f"tau_neg={config.tau_neg}"
        )
    for name in ("clip_low", "clip_high") if sapo else ("tau_pos", "tau_neg"):
        if getattr(config, name) != defaults[name]:
            why = (
                "SAPO's soft gate has no clip range (tau_pos and tau_neg set how fast it closes)"
                if sapo
                else f"{name} is a temperature of policy_loss=sapo's gate"
            )
            raise ValueError(
                f"{name}={getattr(config, name)} is not used by policy_loss={config.policy_loss}: {why}; leave it unset"
            )


# --------------------------------------------------------------------------------------------------
# YAML and key=value
# --------------------------------------------------------------------------------------------------


class _YAMLLoader(yaml.SafeLoader):
    """YAML 1.2 booleans: only true/false. YAML 1.1 also reads yes/no/on/off as booleans, which turned
    ``run.mixed_precision=no`` into False; bool fields still accept those words (``_convert``)."""


_YAMLLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:bool"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_YAMLLoader.add_implicit_resolver(
    "tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF")
)


def parse_yaml(text: str):
    """``yaml.safe_load`` with YAML 1.2 booleans (see ``_YAMLLoader``)."""
    return yaml.load(text, Loader=_YAMLLoader)


def _convert(value: Any, annotation, where: str, default: Any = None):
    """``value`` as the type ``annotation`` names (dataclasses recursively, Optionals, lists, scalars).

    ``default`` is the field's own default: a dataclass section is that default with the given keys
    replaced, so a trainer's section defaults (GRPO's ``OptimConfig(lr=1e-6, scheduler="constant")``)
    hold when a file or ``key=value`` sets one of its keys."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        options = [a for a in typing.get_args(annotation) if a is not type(None)]
        if value is None or (isinstance(value, str) and value.lower() in ("null", "none")):
            if len(options) < len(typing.get_args(annotation)):
                return None
            raise ValueError(f"{where} cannot be null")
        errors = []
        for option in options:
            try:
                return _convert(value, option, where, default)
            except (TypeError, ValueError) as err:
                errors.append(str(err))
        raise ValueError(errors[0])
    if dataclasses.is_dataclass(annotation):
        if isinstance(value, annotation):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"{where} must be a mapping of {annotation.__name__} fields")
        return from_dict(annotation, value, where, default if isinstance(default, annotation) else None)
    if origin is list:
        (item,) = typing.get_args(annotation)
        if isinstance(value, str):
            value = _parse_value(value, where) if value.startswith("[") else [v for v in value.split(",") if v]
        if not isinstance(value, list | tuple):
            raise ValueError(f"{where} must be a list")
        return [_convert(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict or annotation is dict:
        if isinstance(value, str):
            value = _parse_value(value, where)
        if not isinstance(value, dict):
            raise ValueError(f"{where} must be a mapping")
        item = (typing.get_args(annotation) or (None, None))[-1]
        if dataclasses.is_dataclass(item):  # {name: section}, e.g. distillation's teachers
            return {str(k): _convert(v, item, f"{where}.{k}") for k, v in value.items()}
        return dict(value)
    if annotation is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no", "on", "off", "1", "0"):
            return value.lower() in ("true", "yes", "on", "1")
        raise ValueError(f"{where} must be true or false, got {value!r}")
    if annotation in (int, float):
        if isinstance(value, bool):
            raise ValueError(f"{where} must be a number, got {value!r}")
        try:
            number = annotation(value) if annotation is float else int(str(value), 10)
        except (TypeError, ValueError):
            if annotation is int and isinstance(value, float) and value.is_integer():
                return int(value)
            kind = "an integer" if annotation is int else "a number"
            raise ValueError(f"{where} must be {kind}, got {value!r}") from None
        return number
    if annotation is str:
        if isinstance(value, dict | list):
            raise ValueError(f"{where} must be a string, got {type(value).__name__}")
        return str(value)
    if annotation is Any:
        return value
    raise TypeError(f"{where}: unsupported config type {annotation!r}")


def _parse_value(text: str, where: str):
    try:
        return parse_yaml(text)
    except yaml.YAMLError as err:
        raise ValueError(f"{where}: invalid YAML value {text!r}: {err}") from None


class UnknownKey(ValueError):
    """A config key that is not a field: ``where`` is the section ("optim", "rewards[0]"; "" at the top)."""

    def __init__(self, where: str, key: str, allowed: list[str], cls=None):
        self.where, self.key = where, key
        dotted = f"{where}.{key}" if where else key
        hint = _did_you_mean(key, allowed, cls, where)
        super().__init__(f"unknown config key {dotted!r}{hint}; allowed here: {', '.join(allowed)}")


# TRL's (and transformers.TrainingArguments') names, and a few short ones, for what posttrain calls otherwise:
# {name: the posttrain keys it may be, from the config's root}; a hint names the first one the config has there.
TRL_NAMES = {
    "learning_rate": ("optim.lr",),
    "lr_scheduler_type": ("optim.scheduler",),
    "warmup_steps": ("optim.warmup_steps",),
    "weight_decay": ("optim.weight_decay",),
    "max_grad_norm": ("optim.max_grad_norm",),
    "adam_beta1": ("optim.adam_beta1",),
    "adam_beta2": ("optim.adam_beta2",),
    "adam_epsilon": ("optim.adam_eps",),
    "model_name_or_path": ("model.path",),
    "model": ("model.path",),
    "gradient_checkpointing": ("model.gradient_checkpointing",),
    "per_device_train_batch_size": ("run.micro_batch_size",),
    "gradient_accumulation_steps": ("run.batch_size",),
    "num_train_epochs": ("run.epochs",),
    "max_steps": ("run.max_steps",),
    "output_dir": ("run.output_dir",),
    "overwrite_output_dir": ("run.overwrite",),
    "resume_from_checkpoint": ("run.resume_from",),
    "seed": ("run.seed",),
    "logging_steps": ("run.log_every",),
    "eval_steps": ("run.eval_every",),
    "eval_strategy": ("run.eval_every",),
    "save_steps": ("run.save_every",),
    "save_total_limit": ("run.keep_last",),
    "report_to": ("run.report_to",),
    "run_name": ("run.name",),
    "bf16": ("run.mixed_precision",),
    "fp16": ("run.mixed_precision",),
    "disable_tqdm": ("run.progress",),
    "dataset_name": ("data.path",),
    "train_dataset": ("data.path",),
    "max_length": ("data.max_length",),
    "max_seq_length": ("data.max_length",),
    "max_prompt_length": ("data.max_prompt_length",),
    "max_completion_length": ("sampling.max_new_tokens", "eval.max_new_tokens"),
    "max_new_tokens": ("sampling.max_new_tokens", "eval.max_new_tokens"),
    "temperature": ("sampling.temperature",),
    "top_p": ("sampling.top_p",),
    "top_k": ("sampling.top_k",),
    "use_vllm": ("rollout.engine",),
    "vllm_mode": ("rollout.mode",),
    "reward_funcs": ("rewards",),
    "reward_weights": ("rewards",),
    "beta": ("kl_coef", "beta"),
    "epsilon": ("clip_low",),
    "epsilon_high": ("clip_high",),
    "num_ppo_epochs": ("ppo_epochs",),
    "num_mini_batches": ("minibatches",),
    "mask_truncated_completions": ("mask_truncated",),
    "per_device_eval_batch_size": ("eval.batch_size",),
    "eval_dataset": ("eval.path",),
    "lora_r": ("model.lora",),
    "peft_config": ("model.lora",),
    "lr": ("optim.lr",),  # and a few short names users guess
    "batch_size": ("run.batch_size",),
    "epochs": ("run.epochs",),
}
# what to know where TRL's name and posttrain's differ in meaning, not just in name
TRL_NOTES = {
    "per_device_train_batch_size": "run.batch_size is a step's examples, all processes together",
    "gradient_accumulation_steps": "a step's examples; accumulation is run.batch_size / run.micro_batch_size",
    "eval_strategy": "held-out evaluation every this many steps",
    "bf16": "run.mixed_precision=bf16",
    "fp16": "run.mixed_precision=fp16",
    "disable_tqdm": "run.progress=false",
    "use_vllm": "rollout.engine=vllm",
    "reward_weights": "each reward's weight: rewards=[{function: ..., weight: 0.5}]",
    "reward_funcs": "rewards=[{function: module:function}]",
    "lora_r": "model.lora={r: 16, lora_alpha: 32, target_modules: all-linear}",
    "peft_config": "model.lora={r: 16, lora_alpha: 32, target_modules: all-linear}",
}


def _has_key(cls, dotted: str) -> bool:
    """Whether the dataclass ``cls`` has the (dotted) key ``dotted``."""
    for part in dotted.split("."):
        hints = typing.get_type_hints(cls) if dataclasses.is_dataclass(cls) else {}
        if part not in hints:
            return False
        options = [a for a in (typing.get_args(hints[part]) or (hints[part],)) if dataclasses.is_dataclass(a)]
        cls = options[0] if options else None
    return True


def _did_you_mean(key: str, allowed, cls=None, where: str = "") -> str:
    """A hint for the unknown ``key`` of section ``where`` (dataclass ``cls``, "" at the root): posttrain's
    name for a TRL one (``learning_rate``: optim.lr), else the closest of ``allowed``."""
    prefix = f"{where}." if where else ""
    for dotted in TRL_NAMES.get(key, ()) if cls is not None else ():
        if dotted.startswith(prefix) and _has_key(cls, dotted.removeprefix(prefix)):
            note = f": {TRL_NOTES[key]}" if key in TRL_NOTES else ""
            return f" (did you mean {dotted}? posttrain's name for TRL's {key}{note})"
    close = difflib.get_close_matches(key, list(allowed), n=1)
    return f" (did you mean {close[0]}?)" if close else ""


def from_dict(cls, data: dict, where: str = "", base=None):
    """Build dataclass ``cls`` from a nested dict: ``base`` (default: ``cls``'s own defaults) with the
    keys of ``data`` replaced. Unknown keys are errors (``UnknownKey``)."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields), key=str)
    if unknown:
        raise UnknownKey(where, str(unknown[0]), list(fields), cls)
    kwargs = {
        k: _convert(
            v,
            hints[k],
            f"{where}.{k}" if where else k,
            getattr(base, k) if base is not None else _field_default(fields[k]),
        )
        for k, v in data.items()
    }
    return cls(**kwargs) if base is None else dataclasses.replace(base, **kwargs)


def _field_default(f: dataclasses.Field):
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None if f.default is dataclasses.MISSING else f.default


def to_dict(config) -> dict:
    return dataclasses.asdict(config)


def apply_override(data: dict, cls, assignment: str) -> None:
    """Set ``a.b.c=value`` in the nested dict ``data`` (value parsed as YAML, converted later by type)."""
    if "=" not in assignment:
        raise ValueError(f"override {assignment!r} must look like key=value (e.g. optim.lr=1e-5)")
    key, raw = assignment.split("=", 1)
    parts = key.strip().split(".")
    node, node_cls = data, cls
    for depth, part in enumerate(parts):
        names = {f.name: f for f in dataclasses.fields(node_cls)}
        if part not in names:
            prefix = ".".join(parts[:depth])
            raise ValueError(
                f"unknown config key {key.strip()!r}: {prefix + '.' if prefix else ''}{part} is not one of "
                f"{', '.join(names)}{_did_you_mean(part, names, node_cls, prefix)}"
            )
        if depth == len(parts) - 1:
            try:
                node[part] = parse_yaml(raw) if raw.strip() else ""
            except yaml.YAMLError as err:
                raise ValueError(f"override {assignment!r}: invalid YAML value: {err}") from None
            return
        annotation = typing.get_type_hints(node_cls)[part]
        options = [a for a in typing.get_args(annotation) if dataclasses.is_dataclass(a)] or [annotation]
        if not dataclasses.is_dataclass(options[0]):
            raise ValueError(_no_sub_keys(".".join(parts[: depth + 1]), annotation, parts[depth + 1 :], raw))
        node = node.setdefault(part, {})
        node_cls = options[0]


def _no_sub_keys(section: str, annotation, rest: list[str], raw: str) -> str:
    """What to write instead of ``section.a.b=raw`` when ``section`` is a mapping or a plain value."""
    kinds = typing.get_args(annotation) or (annotation,)
    if not any(k is dict or typing.get_origin(k) is dict for k in kinds):
        return f"config key {section} is a single value, not a section: set {section}=VALUE"
    value = raw.strip()
    for key in reversed(rest):
        value = f"{{{key}: {value}}}"
    leaf = section.rsplit(".", 1)[-1]
    where = f" under {section.rsplit('.', 1)[0]}:" if "." in section else ""
    return (
        f"config key {section} is a mapping, set as a whole: '{section}={value}' (quoted for the shell), "
        f"or {leaf}: {value}{where} in the YAML file"
    )


def load_config(cls, path: str | Path | None = None, overrides: list[str] = ()):
    """``cls`` from a YAML file (optional) and ``key=value`` overrides, validated."""
    data: dict = {}
    if path is not None:
        try:
            loaded = parse_yaml(Path(path).read_text()) or {}
        except yaml.YAMLError as err:
            raise ValueError(_yaml_error(path, err)) from None
        if not isinstance(loaded, dict):
            raise ValueError(f"{path}: a config file must be a YAML mapping")
        data = loaded
    for assignment in overrides:
        apply_override(data, cls, assignment)
    try:
        config = from_dict(cls, data)
    except UnknownKey as err:  # only a file (or a mapping given whole) can hold one: name the file and line
        line = None if path is None else _key_line(Path(path).read_text(), err.where, err.key)
        raise ValueError(f"{path}:{line}: {err}" if line else str(err)) from None
    config.validate()
    return config


def _key_line(text: str, where: str, key: str) -> int | None:
    """The 1-based line of ``key`` in section ``where`` ("optim", "rewards[0]") of the YAML ``text``;
    None when the file does not hold it there (it came from an override)."""
    node = yaml.compose(text, Loader=_YAMLLoader)
    path = [int(p) if p.isdigit() else p for p in re.findall(r"[^.\[\]]+", where)] + [key]
    for part in path:
        if isinstance(node, yaml.MappingNode):
            match = [(k, v) for k, v in node.value if k.value == part]
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(node.value):
            match = [(node.value[part], node.value[part])]
        else:
            return None
        if not match:
            return None
        key_node, node = match[0]
    return key_node.start_mark.line + 1


def _yaml_error(path, err: yaml.YAMLError) -> str:
    """``FILE:LINE: invalid YAML: problem`` (the line where the parser found the problem, 1-based)."""
    if not isinstance(err, yaml.MarkedYAMLError):  # e.g. bytes that are not text
        return f"{path}: invalid YAML: {err}"
    mark = err.problem_mark or err.context_mark
    where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
    return f"{where}: invalid YAML: {err.problem or err}" + (f" ({err.context})" if err.context else "")


def with_presets(cls):
    """Class decorator for a config with ``PRESETS`` ({name: {field: value}}) and a ``preset`` field:
    ``cls(preset=name, ...)`` takes the preset's value for every field of the preset that the
    constructor was not given; a number or switch given wins (the run prints it as overridden). A choice
    given (a string: ``policy_loss``, ``loss_agg``, ...) must be the preset's own: another one would be
    another method under the preset's name and numbers (``preset=gspo policy_loss=cispo``: CISPO with GSPO's
    3e-4 clip range), so it fails here, naming both fields (``preset_conflict``). YAML files, ``key=value``
    overrides (``from_dict`` passes only the keys set) and Python construct the config alike, so all three
    resolve a preset the same way and ``dataclasses.replace`` (every field given) keeps the values resolved."""
    init = cls.__init__
    names = [f.name for f in dataclasses.fields(cls)]

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        if self.preset != "none":
            check_choice("preset", self.preset, ["none", *cls.PRESETS])
            given = set(names[: len(args)]) | set(kwargs)
            for key, value in cls.PRESETS[self.preset].items():
                if key not in given:
                    setattr(self, key, value)
                elif isinstance(value, str) and getattr(self, key) != value:
                    raise ValueError(preset_conflict(cls.PRESETS, self.preset, key, getattr(self, key)))

    cls.__init__ = __init__
    return cls


def python_sections(cls):
    """Class decorator for a trainer config: what Python gives its constructor is resolved as a YAML file
    and ``key=value`` are (``from_dict``). A section built with some of its fields,
    ``GRPOConfig(data=DataConfig(path=...))``, is the trainer's own default section (GRPO's: no max_length,
    512 prompt tokens) with those fields replaced (``sections.remembers_given`` records them); a list of
    specs (``rewards``, here or in a section) may hold mappings of a spec's fields or the reward functions
    themselves, as TRL takes them."""
    init = cls.__init__
    fields = dataclasses.fields(cls)

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        for f in fields:
            value = getattr(self, f.name)
            given = given_fields(value) if dataclasses.is_dataclass(value) else None
            if given is not None and f.default_factory is not dataclasses.MISSING:
                default = f.default_factory()
                if type(default) is type(value) and default != value:
                    value = dataclasses.replace(default, **{k: getattr(value, k) for k in given})
            setattr(self, f.name, _python_lists(value, f.name) if dataclasses.is_dataclass(value) else value)
        _python_lists(self, "")

    cls.__init__ = __init__
    return cls


def _python_lists(section, where: str):
    """``section`` with each item of its lists of specs made a spec: a mapping of the spec's fields, or a
    function (the spec's first field: ``RewardSpec(function)``). Returns ``section``, changed in place."""
    hints = typing.get_type_hints(type(section))
    for f in dataclasses.fields(section):
        items, (item_cls, *_) = getattr(section, f.name), typing.get_args(hints[f.name]) or (None,)
        if typing.get_origin(hints[f.name]) is not list or not dataclasses.is_dataclass(item_cls):
            continue
        key = f"{where}.{f.name}" if where else f.name
        setattr(section, f.name, [_python_item(item_cls, item, f"{key}[{i}]") for i, item in enumerate(items)])
    return section


def _python_item(cls, item, where: str):
    if isinstance(item, cls):
        return item
    if isinstance(item, dict):
        functions = {k: v for k, v in item.items() if callable(v)}
        spec = from_dict(cls, {k: v for k, v in item.items() if k not in functions}, where)
        return dataclasses.replace(spec, **functions) if functions else spec
    if callable(item):
        return cls(item)
    raise ValueError(f"{where} must be a {cls.__name__}, a mapping of its fields or a function, got {item!r}")


def preset_conflict(presets: dict[str, dict], preset: str, key: str, value) -> str:
    """The message for a choice ``key=value`` given with a ``preset`` that sets ``key`` to another: both
    fields, and what is allowed (the preset's value or nothing, the presets whose choice it is, preset=none)."""
    others = [name for name, knobs in presets.items() if knobs.get(key) == value]
    instead = f"preset={' or preset='.join(others)} (which choose {key}={value}), " if others else ""
    return (
        f"preset={preset} sets {key}={presets[preset][key]}, but {key}={value} was given too: a preset's choices "
        f"are its method, only its numbers may be changed. Allowed: {key}={presets[preset][key]} or leave {key} "
        f"unset; {instead}or preset=none and each knob set by hand"
    )


def field_docs(cls) -> dict[str, str]:
    """{field name: the string literal under it} of dataclass ``cls`` (and of its dataclass bases)."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError):
            continue
        body = tree.body[0].body
        for node, nxt in zip(body, body[1:], strict=False):
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)
            ):
                docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def describe(cls, prefix: str = "", instance=None) -> list[tuple[str, str, str]]:
    """(dotted key, default, doc) for every leaf option of ``cls``, nested dataclasses flattened."""
    instance = instance if instance is not None else cls()
    docs, hints, rows = field_docs(cls), typing.get_type_hints(cls), []
    for f in dataclasses.fields(cls):
        value = getattr(instance, f.name)
        key = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value):
            rows += describe(type(value), f"{key}.", value)
        else:
            type_name = getattr(hints[f.name], "__name__", None) or str(hints[f.name]).replace("typing.", "")
            rows.append((key, f"{value!r} ({type_name})", docs.get(f.name, "")))
    return rows
