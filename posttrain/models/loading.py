"""Loading Hugging Face models and tokenizers for the four RLHF roles, with dropout off.

Every role used for RL (policy, reference, reward, value) runs without dropout: two forward passes
on the same input must be bit-identical, or the PPO ratio is not 1 at the first minibatch
(docs/pitfalls.md #5). ``disable_dropout`` zeroes every dropout module, every dropout rate a module copied
from the config when it was built, and the config's rates, so the model is deterministic in
``train()`` mode too. Models are returned in train mode, which transformers needs to checkpoint
gradients (``gradient_checkpointing``); the frozen roles (reference, reward model) switch
themselves to eval mode.
"""

from __future__ import annotations

import contextlib
import json
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "auto": "auto"}
ATTN_IMPLEMENTATIONS = ("eager", "sdpa", "flash_attention_2", "flash_attention_3", "flex_attention")


def check_device(device, field: str) -> None:
    """A ValueError naming ``field`` unless ``device`` is auto, cpu, or a CUDA (or MPS) device this machine has:
    checked at start, before any model loads (a missing one failed deep inside the first load)."""
    if device == "auto":
        return
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        parsed = None
    if parsed is None or parsed.type not in ("cpu", "cuda", "mps"):
        raise ValueError(f"{field}={device!r} is not a device: use auto, cpu, cuda or cuda:N (mps on a Mac)")
    if parsed.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"{field}={device}: MPS is not available on this machine; use cpu (or auto)")
    if parsed.type != "cuda":
        return
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if not count:
        raise ValueError(f"{field}={device}: this machine has no CUDA device (torch sees none); use cpu (or auto)")
    if parsed.index is not None and parsed.index >= count:
        raise ValueError(f"{field}={device}: this machine has {count} CUDA device(s), cuda:0 to cuda:{count - 1}")


@dataclass
class ModelConfig:
    """Where a model comes from and how it is loaded."""

    path: str = ""
    """Local folder or Hugging Face hub id of the checkpoint."""
    dtype: str = "float32"
    """Weights dtype: float32, bfloat16, float16 or auto (as saved)."""
    device: str = "auto"
    """Device for the weights: auto (cuda when available, else cpu), cpu, cuda, cuda:N."""
    attn_implementation: str | None = None
    """Attention kernel (eager, sdpa, flash_attention_2, ...); None lets transformers choose."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass to save memory (trained roles only)."""
    trust_remote_code: bool = False
    """Allow model code from the checkpoint's repository."""
    revision: str | None = None
    """Hub revision (branch, tag or commit) when ``path`` is a hub id."""
    tokenizer_path: str | None = None
    """Tokenizer location when it differs from ``path``."""
    lora: dict | None = field(default=None)
    """peft LoraConfig fields (r, lora_alpha, target_modules, ...) to train a new LoRA adapter; None = full."""

    def validate(self, name: str = "model") -> None:
        if not self.path:
            raise ValueError(f"{name}.path is required: a local checkpoint folder or a hub id")
        if self.dtype not in DTYPES:
            raise ValueError(f"{name}.dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if isinstance(self.lora, dict):
            from dataclasses import fields

            from peft import LoraConfig

            known = {f.name for f in fields(LoraConfig)}
            unknown = sorted(k for k in self.lora if k not in known)
            if unknown:
                raise ValueError(
                    f"{name}.lora has keys peft's LoraConfig does not take: {unknown} (YAML needs a space after "
                    f"the colon: '{name}.lora={{r: 8}}', not '{{r:8}}'); LoraConfig fields include r, lora_alpha, "
                    "lora_dropout, target_modules"
                )
        if self.attn_implementation is not None and self.attn_implementation not in ATTN_IMPLEMENTATIONS:
            raise ValueError(
                f"{name}.attn_implementation must be one of {ATTN_IMPLEMENTATIONS} or null, "
                f"got {self.attn_implementation!r}"
            )

    def resolved_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)


def _is_dropout_name(name: str) -> bool:
    return "dropout" in name or "pdrop" in name  # attention_dropout, hidden_dropout_prob, attn_pdrop, ...


def _zero_config_dropout(config) -> None:
    from transformers import PretrainedConfig

    for key in list(config.to_dict()):
        value = getattr(config, key, None)
        if isinstance(value, PretrainedConfig):  # text_config, vision_config, ...
            _zero_config_dropout(value)
        elif _is_dropout_name(key) and isinstance(value, float):
            setattr(config, key, 0.0)


def disable_dropout(model: nn.Module) -> nn.Module:
    """Set every dropout probability in ``model`` to 0: each dropout module's ``p``, each float
    attribute named like a dropout rate that a module holds (attention modules copy
    ``config.attention_dropout`` into ``self.attention_dropout`` when they are built and pass it to
    the attention kernel in train mode), and the config's rates (for what is saved). Returns the model.
    """
    for module in model.modules():
        if isinstance(module, nn.modules.dropout._DropoutNd):
            module.p = 0.0
        for name, value in vars(module).items():
            if _is_dropout_name(name) and isinstance(value, float):
                setattr(module, name, 0.0)
    config = getattr(model, "config", None)
    if config is not None:
        _zero_config_dropout(config)
    return model


def load_tokenizer(path: str, revision: str | None = None, trust_remote_code: bool = False):
    """AutoTokenizer with a pad token: when the checkpoint has none, the EOS token doubles as pad.

    That is safe in posttrain because every mask comes from lengths and attention masks, never from
    comparing ids with ``pad_token_id`` (docs/pitfalls.md #7, #8).
    """
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path, revision=revision, trust_remote_code=trust_remote_code)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


@contextlib.contextmanager
def peft_wrapping() -> Iterator[None]:
    """Around peft's model wrapping: peft reads transformers' deprecated ``is_gradient_checkpointing``
    when it wraps a model, a FutureWarning about peft's code that no posttrain user can act on."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        yield


def _from_pretrained(auto_class, config: ModelConfig, new_head: bool = False, what: str = "model.path", **extra):
    """``auto_class.from_pretrained`` with posttrain's settings. Weights the checkpoint lacks start random;
    that is expected only of a new head (``new_head``: a reward model or critic started from a causal
    LM). Otherwise a checkpoint of the wrong kind (a reward model as a policy, a causal LM as the
    reward model) is refused, naming the missing weights; transformers' own report of them is hidden
    at the CLI's log level."""
    kwargs = dict(
        dtype=DTYPES[config.dtype],
        revision=config.revision,
        trust_remote_code=config.trust_remote_code,
        output_loading_info=True,
        **extra,
    )
    if config.attn_implementation is not None:
        kwargs["attn_implementation"] = config.attn_implementation
    model, info = auto_class.from_pretrained(config.path, **kwargs)
    missing = sorted(info.get("missing_keys") or [])
    if missing and not new_head:
        shown = ", ".join(missing[:4]) + (f" and {len(missing) - 4} more" if len(missing) > 4 else "")
        raise ValueError(
            f"{what}={config.path}: the checkpoint has no weights for {shown}; as {auto_class.__name__} they "
            f"would start random. Is it the right kind of model (a causal LM for a policy or an evaluated "
            f"model, a reward model with a score head for a reward model)?"
        )
    disable_dropout(model)
    model.to(config.resolved_device())
    if config.gradient_checkpointing:
        # newer transformers (5.24) renamed it; .venv-vllm's 5.19 has only the old name
        enable = getattr(model, "activation_checkpointing_enable", None)
        if enable is not None:
            enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    model.train()  # from_pretrained returns eval mode, where transformers never checkpoints
    return model


def unwrap_model(model: nn.Module) -> nn.Module:
    """The Hugging Face model under accelerate's DDP/FSDP wrappers and DeepSpeed's engine (``.module``)
    and a peft wrapper (``get_base_model``: the model with its adapter layers in it)."""
    while isinstance(getattr(model, "module", None), nn.Module):
        model = model.module
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def cache_keyword(model: nn.Module) -> str:
    """The keyword a model's forward takes its KV cache by: ``cache`` from transformers 5.24 on
    (``past_key_values`` warns there, removal announced for 5.40), ``past_key_values`` before (.venv-vllm's
    5.19)."""
    import inspect

    parameters = inspect.signature(type(unwrap_model(model)).forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


def checkpointing_on(model: nn.Module) -> bool:
    """Whether gradient (activation) checkpointing is on: a training forward then recomputes its layers in
    backward and turns the KV cache off. transformers 5.24 renamed the flag; .venv-vllm's 5.19 has only
    the old name."""
    model = unwrap_model(model)
    checkpointing = getattr(model, "is_activation_checkpointing", None)
    return bool(getattr(model, "is_gradient_checkpointing", False) if checkpointing is None else checkpointing)


def load_causal_lm(config: ModelConfig) -> nn.Module:
    """A causal LM (AutoModelForCausalLM) for the policy or the reference, dropout off.

    When ``config.lora`` is set, a new trainable LoRA adapter is added (peft); when ``config.path``
    holds a peft adapter, see ``load_policy``.
    """
    from transformers import AutoModelForCausalLM

    config.validate()
    return _from_pretrained(AutoModelForCausalLM, config)


def load_scalar_model(config: ModelConfig, kind: str, new_head: bool = True, what: str = "model.path") -> nn.Module:
    """A backbone with a one-output linear head ``score``, dropout off.

    kind="reward": AutoModelForSequenceClassification(num_labels=1), one score per sequence.
    kind="value": AutoModelForTokenClassification(num_labels=1), one value per token (the critic).
    Either loads from a reward-model checkpoint or from a causal LM (the head is then new: normal
    init with the model's ``initializer_range``, zero bias) unless ``new_head`` is False (a frozen
    reward model must bring its head: ``_from_pretrained``). Both are ordinary transformers classes,
    so their checkpoints load without posttrain.
    """
    from transformers import AutoModelForSequenceClassification, AutoModelForTokenClassification

    config.validate()
    if kind not in ("reward", "value"):
        raise ValueError(f"kind must be 'reward' or 'value', got {kind!r}")
    auto_class = AutoModelForSequenceClassification if kind == "reward" else AutoModelForTokenClassification
    model = _from_pretrained(auto_class, config, new_head=new_head, what=what, num_labels=1)
    if model.config.pad_token_id is None:
        model.config.pad_token_id = model.config.eos_token_id
    return model


def is_peft_adapter(path: str) -> bool:
    """Whether ``path`` is a local folder holding a peft adapter (adapter_config.json)."""
    return (Path(path) / "adapter_config.json").is_file()


def is_reward_checkpoint(path: str) -> bool:
    """Whether ``path`` holds a reward model: a *ForSequenceClassification checkpoint with one label,
    or a peft adapter of task SEQ_CLS (what ``posttrain rm`` writes). Read from local files only (a
    Hub id from the local cache, never the network); a path that cannot be read that way is not one,
    and the loading code then says what is wrong with it."""
    try:
        if is_peft_adapter(path):
            return json.loads((Path(path) / "adapter_config.json").read_text()).get("task_type") == "SEQ_CLS"
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError):  # JSONDecodeError is a ValueError
        return False
    classifier = any(a.endswith("ForSequenceClassification") for a in config.architectures or [])
    return classifier and getattr(config, "num_labels", 1) == 1
