"""Judge rewards: a generative model (a chat model) grades each completion.

    rewards:
      - function: posttrain.rewards.judge:judge_score            # (a) a graded verdict, parsed
        kwargs:
          path: runs/judge                                        # a causal LM checkpoint
          template: "Question: {prompt}\\nAnswer: {completion}\\nReference: {answer}\\nScore (0-10):"
          pattern: "(-?\\\\d+(?:\\\\.\\\\d+)?)"                    # first match (its first group)
      - function: posttrain.rewards.judge:judge_yes_probability  # (b) P(yes) / (P(yes) + P(no))
        kwargs: {path: runs/judge, template: "...Is the answer right?", yes: ["Yes"], no: ["No"]}

``template`` is a Python format string: ``{prompt}``, ``{completion}`` and any column of the prompt rows
(``{answer}``) are filled per sample; a literal brace is written twice. ``{prompt}`` and ``{completion}`` are
the sample's even when the rows have a column of that name (distillation's reference ``completion``). The
rendered text is the judge's user message, in the judge tokenizer's chat template when it has one
(``chat_template``: auto | always | never, as ``data.chat_template``).

(a) ``judge_score`` generates the judge's verdict (greedy by default) through a rollout engine of its
own (``engine``: auto | hf | lean | vllm, the policy's engines) and parses it: the first match of
``pattern`` (its first group when it has one) as a number, or through ``labels`` ({matched text:
number}). A verdict that does not parse scores None (not applicable, never 0) and is counted in
``reward/judge_score/parse_failures`` (cumulative): a count the reward composer keeps for this spec alone
(``reward_counts``, ``posttrain.rewards.base``), so a run's training and evaluation rewards count apart.
(b) ``judge_yes_probability`` runs one forward pass over the rendered prompts and reads the next token's
P(yes) / (P(yes) + P(no)) (``core.yes_probability``); each entry of ``yes`` / ``no`` must be one token of
the judge's vocabulary.

Settings are checked at config validation (``validate_kwargs``, called by ``RewardSpec.validate``): the
keywords each function takes, ``path`` and ``template`` given, ``pattern`` a regular expression, ``labels``
numbers, ``engine`` and ``chat_template`` known names, and, when the judge's folder already exists, ``yes``
and ``no`` single tokens of its vocabulary (else at the first call). The template's placeholders are
columns checked with the data's (``required_columns``), before any model loads.

The judge is loaded once per process (cached by path, device, engine and template mode), frozen, and
scores in batches of ``batch_size``. Both functions run inline, in the trainer process, like the reward
models of ``posttrain.rewards.model`` (``base.MODEL_FUNCTIONS``). Usable from GRPO, PPO, online DPO and
``posttrain eval`` alike, as any reward function.
"""

from __future__ import annotations

import collections
import functools
import inspect
import math
import numbers
import re
import string
from pathlib import Path

import torch

DEFAULT_PATTERN = r"(-?\d+(?:\.\d+)?)"
"""The first number in the verdict (an optional sign, digits, an optional decimal part)."""


def template_fields(template: str) -> list[str]:
    """The placeholder names of a format string (``{prompt}``, ``{answer}``), in order."""
    return [name for _, name, _, _ in string.Formatter().parse(template) if name]


def render(template: str, prompts: list[str], completions: list[str], columns: dict[str, list]) -> list[str]:
    """The judge's prompt text of each sample: ``template`` with ``{prompt}``, ``{completion}`` and the
    rows' columns filled in. A placeholder naming no column is an error naming the columns there are.

    ``{prompt}`` and ``{completion}`` are always the sample's: a column of that name in the prompt rows (the
    reference ``completion`` that ``posttrain distill`` with λ < 1 needs) does not replace them."""
    known = {"prompt", "completion", *columns}
    missing = [name for name in template_fields(template) if name not in known]
    if missing:
        raise ValueError(
            f"judge template names {{{missing[0]}}}, which is neither prompt, completion nor a column of the "
            f"prompt rows (columns: {', '.join(sorted(columns)) or 'none'}); write a literal brace twice"
        )
    return [
        template.format(**{**{k: v[b] for k, v in columns.items()}, "prompt": p, "completion": c})
        for b, (p, c) in enumerate(zip(prompts, completions, strict=True))
    ]


def parse_verdict(text: str, pattern: str = DEFAULT_PATTERN, labels: dict | None = None) -> float | None:
    """The number a verdict says: the first match of ``pattern`` in ``text`` (its first group when it has
    one), looked up in ``labels`` when given, else read as a float. None when nothing matches, the
    match is not a number (or not a label), or it is not finite."""
    match = re.search(pattern, text)
    if match is None:
        return None
    said = match.group(1) if match.groups() else match.group(0)
    if labels is not None:
        value = labels.get(said.strip())
        return None if value is None else float(value)
    try:
        number = float(said)
    except ValueError:
        return None
    return number if math.isfinite(number) else None


class Judge:
    """A frozen causal LM that reads rendered judge prompts: greedy verdicts through a rollout engine,
    or the next token's logits."""

    def __init__(self, path: str, device: str = "cpu", chat_template: str = "auto"):
        from posttrain.data.encode import Encoder
        from posttrain.models import ModelConfig, load_causal_lm, load_tokenizer

        self.path = path
        self.tokenizer = load_tokenizer(path)
        self.model = load_causal_lm(ModelConfig(path=path, device=device)).requires_grad_(False)
        self.encoder = Encoder(self.tokenizer, chat_template)
        self.engines = {}  # rollout.engine name -> engine, built on the first verdict it gives

    def encode(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each judge prompt: the user message in the chat template (with the generation
        prompt) when the judge uses one, else the text with the tokenizer's special tokens."""
        return [self.encoder.prompt(text, where="judge prompt").prompt_ids for text in texts]

    def verdicts(self, texts: list[str], params, batch_size: int, engine: str = "auto") -> list[str]:
        """The judge's reply to each prompt (special tokens removed) sampled with ``params``
        (``SamplingParams``) by ``engine``, ``batch_size`` prompts per generate."""
        from posttrain.rollout import RolloutConfig, build_engine

        if engine not in self.engines:
            config = RolloutConfig(engine=engine)
            config.validate("judge engine")
            self.engines[engine] = build_engine(config, self.model, self.tokenizer, self.path, 0)
        ids, out = self.encode(texts), []
        for i in range(0, len(ids), batch_size):
            with self.engines[engine].generating(self.model):
                out += self.engines[engine].generate(ids[i : i + batch_size], params, n=1).responses
        return out

    def token_id(self, word: str, kwarg: str) -> int:
        """The one token ``word`` is in the judge's vocabulary; an error naming ``kwarg`` otherwise."""
        return token_id(self.tokenizer, word, f"judge {kwarg}", self.path)

    def next_token_logits(self, texts: list[str], batch_size: int) -> torch.Tensor:
        """[N, V] logits of the token after each rendered prompt (left-padded batches, position ids from
        the attention mask, so a prompt reads the same alone or in a batch)."""
        from posttrain.core import position_ids_from_mask
        from posttrain.rollout import left_pad

        device = next(self.model.parameters()).device
        ids, out = self.encode(texts), []
        for i in range(0, len(ids), batch_size):
            input_ids, mask = (t.to(device) for t in left_pad(ids[i : i + batch_size], self.tokenizer.pad_token_id))
            with torch.no_grad():
                logits = self.model(
                    input_ids=input_ids,
                    attention_mask=mask,
                    position_ids=position_ids_from_mask(mask),
                    use_cache=False,
                    logits_to_keep=1,
                ).logits
            out.append(logits[:, -1].float().cpu())
        return torch.cat(out)


def token_id(tokenizer, word: str, field: str, path: str) -> int:
    """The one token ``word`` is in ``tokenizer``'s vocabulary; an error naming ``field`` otherwise."""
    ids = tokenizer(word, add_special_tokens=False).input_ids
    if len(ids) != 1:
        raise ValueError(
            f"{field} must each be one token of {path}'s vocabulary (give the single-token forms of the answer, "
            f"e.g. 'Yes' and ' Yes'), got {word!r}: {len(ids)} tokens {ids}"
        )
    return ids[0]


@functools.lru_cache(maxsize=4)
def load_judge(path: str, device: str = "cpu", chat_template: str = "auto") -> Judge:
    """The judge at ``path``, loaded once per process for these settings."""
    return Judge(path, device, chat_template)


def judge_score(
    prompts,
    completions,
    path: str,
    template: str,
    pattern: str = DEFAULT_PATTERN,
    labels: dict | None = None,
    max_new_tokens: int = 16,
    temperature: float = 0.0,
    batch_size: int = 16,
    device: str = "cpu",
    engine: str = "auto",
    chat_template: str = "auto",
    reward_counts: collections.Counter | None = None,
    **columns,
) -> list[float | None]:
    """The judge's parsed verdict on each sample; None when it does not parse, counted in
    ``reward_counts["parse_failures"]`` (the composer's count for this spec, ``posttrain.rewards.base``)."""
    from posttrain.rollout import SamplingParams

    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature)
    params.validate("judge sampling")
    judge = load_judge(path, device, chat_template)
    verdicts = judge.verdicts(render(template, prompts, completions, columns), params, batch_size, engine)
    values = [parse_verdict(v, pattern, labels) for v in verdicts]
    if reward_counts is not None:
        reward_counts["parse_failures"] += sum(v is None for v in values)
    return values


def judge_yes_probability(
    prompts,
    completions,
    path: str,
    template: str,
    yes: list[str] | tuple[str, ...] = ("Yes",),
    no: list[str] | tuple[str, ...] = ("No",),
    batch_size: int = 16,
    device: str = "cpu",
    chat_template: str = "auto",
    **columns,
) -> list[float]:
    """P(yes) / (P(yes) + P(no)) of the judge's next token after each rendered prompt, in [0, 1]."""
    from posttrain.core import yes_probability

    judge = load_judge(path, device, chat_template)
    yes_ids = [judge.token_id(word, "yes") for word in yes]
    no_ids = [judge.token_id(word, "no") for word in no]
    logits = judge.next_token_logits(render(template, prompts, completions, columns), batch_size)
    return yes_probability(logits, yes_ids, no_ids).tolist()


# -- checked before any model loads: the kwargs at config validation (``RewardSpec.validate``), the template's
# placeholders with the data's columns (``base.required_columns``)

_HANDED = ("prompts", "completions", "reward_counts")  # given by the composer, never by a spec's kwargs


def _given(fn, kwargs: dict, key: str):
    """``kwargs[key]``, or ``fn``'s default for it."""
    return kwargs.get(key, inspect.signature(fn).parameters[key].default)


def _check_common(fn, kwargs: dict, where: str) -> None:
    """What both judges take: only their own keywords, a ``path``, a ``template`` with named placeholders
    that parses, a ``batch_size`` >= 1 and a known ``chat_template``."""
    from posttrain.data.encode import CHAT_TEMPLATE_MODES

    params = inspect.signature(fn).parameters.values()
    allowed = [p.name for p in params if p.name not in _HANDED and p.kind is not p.VAR_KEYWORD]
    for key, value in kwargs.items():
        if key not in allowed:
            raise ValueError(
                f"{where}.{key} is not a keyword of {fn.__name__} (its keywords: {', '.join(allowed)}), "
                f"got {key}: {value!r}"
            )
    for key, what in (("path", "the judge model's folder or hub id"), ("template", "the judge's prompt")):
        if not isinstance(kwargs.get(key), str) or not kwargs[key]:
            given = repr(kwargs[key]) if key in kwargs else "nothing"
            raise ValueError(f"{where}.{key} must be a non-empty string ({what}), got {given}")
    _check_template(kwargs["template"], f"{where}.template")
    _check_count(_given(fn, kwargs, "batch_size"), f"{where}.batch_size")
    if _given(fn, kwargs, "chat_template") not in CHAT_TEMPLATE_MODES:
        raise ValueError(f"{where}.chat_template must be one of {CHAT_TEMPLATE_MODES}, got {kwargs['chat_template']!r}")
    from posttrain.models.loading import check_device

    check_device(_given(fn, kwargs, "device"), f"{where}.device")  # at start: a missing one failed after loading


def _check_template(template: str, field: str) -> None:
    """A format string whose placeholders are names (``render`` fills them by name)."""
    try:
        names = [name for _, name, _, _ in string.Formatter().parse(template) if name is not None]
    except ValueError as err:
        raise ValueError(
            f"{field} must be a format string ({{prompt}}, {{completion}}, {{<column>}}; a literal brace written "
            f"twice), got {template!r}: {err}"
        ) from None
    for name in names:
        if not name.isidentifier():
            raise ValueError(
                f"{field} must name each placeholder ({{prompt}}, {{completion}}, {{<column>}}), got {{{name}}} in "
                f"{template!r}"
            )


def _check_count(value, field: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{field} must be an integer >= 1, got {value!r}")


def _check_labels(labels, field: str) -> None:
    """None, or {matched text: finite number}."""
    if labels is None:
        return
    if not isinstance(labels, dict) or not labels:
        raise ValueError(
            f"{field} must be a mapping {{matched text: number}} (e.g. {{correct: 1, wrong: 0}}), got {labels!r}"
        )
    for text, value in labels.items():
        if not isinstance(text, str):
            raise ValueError(f"{field} keys must be text (what the pattern matches), got {text!r}")
        if not isinstance(value, numbers.Real) or not math.isfinite(value):
            raise ValueError(f"{field}.{text} must be a finite number (that verdict's reward), got {value!r}")


def validate_score_kwargs(kwargs: dict, where: str) -> None:
    """``judge_score``'s ``kwargs`` (``where``: ``rewards[i].kwargs``): a ValueError naming the first bad one."""
    from posttrain.rollout import RolloutConfig

    _check_common(judge_score, kwargs, where)
    pattern = _given(judge_score, kwargs, "pattern")
    try:
        re.compile(pattern)
    except (re.error, TypeError) as err:
        raise ValueError(
            f"{where}.pattern must be a regular expression (its first match, or that match's first group, is the "
            f"verdict), got {pattern!r}: {err}"
        ) from None
    _check_labels(kwargs.get("labels"), f"{where}.labels")
    _check_count(_given(judge_score, kwargs, "max_new_tokens"), f"{where}.max_new_tokens")
    temperature = _given(judge_score, kwargs, "temperature")
    if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real) or not 0 <= temperature < math.inf:
        raise ValueError(f"{where}.temperature must be a finite number >= 0 (0 = greedy), got {temperature!r}")
    RolloutConfig(engine=_given(judge_score, kwargs, "engine")).validate(where)


def validate_yes_kwargs(kwargs: dict, where: str) -> None:
    """``judge_yes_probability``'s ``kwargs``: a ValueError naming the first bad one. ``yes`` and ``no`` are
    checked against the judge's vocabulary when its folder exists now (else at the first call)."""
    _check_common(judge_yes_probability, kwargs, where)
    words = {key: _given(judge_yes_probability, kwargs, key) for key in ("yes", "no")}
    for key, value in words.items():
        if not isinstance(value, list | tuple) or not value or not all(isinstance(w, str) and w for w in value):
            raise ValueError(
                f"{where}.{key} must be a non-empty list of non-empty strings (tokens of the judge's vocabulary), "
                f"got {value!r}"
            )
    both = sorted(set(words["yes"]) & set(words["no"]))
    if both:
        raise ValueError(f"{where}.no must not repeat a word of {where}.yes, got {both} in both")
    path = kwargs["path"]
    if Path(path).is_dir():
        tokenizer = _tokenizer(path, f"{where}.path")
        for key, value in words.items():
            for word in value:
                token_id(tokenizer, word, f"{where}.{key}", path)


@functools.lru_cache(maxsize=4)
def _tokenizer(path: str, field: str):
    """The judge's tokenizer, read at validation (validated twice or more per run: read once)."""
    from posttrain.models import load_tokenizer

    try:
        return load_tokenizer(path)
    except (OSError, ValueError) as err:
        raise ValueError(f"{field} must be a judge checkpoint with its tokenizer, got {path!r}: {err}") from None


def template_columns(kwargs: dict) -> list[str]:
    """The data columns a judge's ``template`` names: its placeholders but prompt and completion, in order."""
    fields = dict.fromkeys(template_fields(kwargs.get("template", "")))
    return [name for name in fields if name not in ("prompt", "completion")]


judge_score.validate_kwargs = validate_score_kwargs  # read by RewardSpec.validate
judge_yes_probability.validate_kwargs = validate_yes_kwargs
judge_score.required_columns = template_columns  # read by rewards.required_columns
judge_yes_probability.required_columns = template_columns
