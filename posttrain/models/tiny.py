"""Tiny models for tests and the demo: built offline, deterministically from a seed, saved as ordinary
Hugging Face checkpoints and loaded back through the same code path as any hub model.

    from posttrain.models.tiny import build_tiny
    build_tiny("runs/tiny/policy", kind="causal")          # LlamaForCausalLM + char tokenizer
    build_tiny("runs/tiny/reward", kind="reward")          # LlamaForSequenceClassification, num_labels=1

The tokenizer has one token per character (digits, letters, punctuation, space, newline) plus
``<pad>``=0, ``<bos>``=1, ``<eos>``=2, ``<unk>``=3; ``<bos>`` is prepended to plain text, ``<eos>``
never appended (the data layer appends it to completions), and a small chat template renders
``user: ...\\nassistant: ...<eos>``.
"""

from __future__ import annotations

import string
from pathlib import Path

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS = [PAD, BOS, EOS, UNK]
CHARACTERS = list(string.digits + string.ascii_letters + string.punctuation + " \n")

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}assistant: {{ message['content'] }}{{ eos_token }}"
    "{% else %}{{ message['role'] }}: {{ message['content'] }}\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)

ARCHITECTURES = ("llama", "qwen2")
KINDS = ("causal", "reward", "value")

TINY_DEFAULTS = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)


def build_tiny_tokenizer():
    """Character-level ``PreTrainedTokenizerFast`` built with the ``tokenizers`` library (100 tokens)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + CHARACTERS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    # [\s\S] is any character, newline included (the Oniguruma engine rejects "(?s).")
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, vocab[BOS])]
    )
    tok.add_special_tokens(SPECIAL_TOKENS)  # "<eos>" in a rendered chat template is one token
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        padding_side="left",
        model_max_length=TINY_DEFAULTS["max_position_embeddings"],
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def tiny_config(tokenizer, arch: str = "llama", kind: str = "causal", **overrides):
    """A transformers config for a tiny ``arch`` model over ``tokenizer``'s vocabulary, dropout 0."""
    from transformers import LlamaConfig, Qwen2Config

    if arch not in ARCHITECTURES:
        raise ValueError(f"arch must be one of {ARCHITECTURES}, got {arch!r}")
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    config_class = {"llama": LlamaConfig, "qwen2": Qwen2Config}[arch]
    extra = {} if kind == "causal" else {"num_labels": 1}
    return config_class(
        vocab_size=len(tokenizer),
        rms_norm_eps=1e-6,
        initializer_range=0.02,
        tie_word_embeddings=False,
        attention_dropout=0.0,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **{**TINY_DEFAULTS, **overrides},
        **extra,
    )


def build_tiny(out: str | Path, kind: str = "causal", arch: str = "llama", seed: int = 0, **overrides) -> Path:
    """Build a tiny model of ``kind`` (causal | reward | value) and the char tokenizer; save both to ``out``.

    The same seed gives bit-identical weights, and the causal, reward and value models of one seed
    share their backbone weights. Returns ``out``.
    """
    import torch
    from transformers import (
        AutoModelForCausalLM,
        AutoModelForSequenceClassification,
        AutoModelForTokenClassification,
        GenerationConfig,
    )

    out = Path(out)
    tokenizer = build_tiny_tokenizer()
    config = tiny_config(tokenizer, arch=arch, kind=kind, **overrides)
    auto_class = {
        "causal": AutoModelForCausalLM,
        "reward": AutoModelForSequenceClassification,
        "value": AutoModelForTokenClassification,
    }[kind]
    torch.manual_seed(seed)
    model = auto_class.from_config(config, dtype=torch.float32)
    out.mkdir(parents=True, exist_ok=True)
    if kind == "causal":
        model.generation_config = GenerationConfig(
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
