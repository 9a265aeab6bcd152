"""Datasets for each trainer: rows checked, rendered, tokenized and counted; batches collated.

examples, report = load_sft(DataConfig(path="data.jsonl", max_length=512), tokenizer)
print(report.summary())   # rows read, kept, truncated, dropped and skipped, by reason
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from posttrain.data.encode import CHAT_TEMPLATE_MODES, OVERLONG_POLICIES, Encoder
from posttrain.data.formats import encode_whole
from posttrain.data.hub import is_datasets_source, open_dataset, tokenize_with_cache
from posttrain.data.rows import (
    FIRST_ROWS,
    DataError,
    NoUsableRows,
    Row,
    check_completion,
    check_preference,
    check_prompt,
    check_ranking,
    check_sft,
    check_stepwise,
    check_unpaired,
    read_rows,
    with_first_kinds,
)
from posttrain.data.steps import TokenText, separator_ends, step_end_tokens
from posttrain.errors import UserError
from posttrain.sections import remembers_given

MALFORMED_POLICIES = ("error", "skip")


@remembers_given  # a trainer's data defaults hold for DataConfig(...) built in Python (posttrain.sections)
@dataclass
class DataConfig:
    """Where a dataset comes from and how its rows become tokens."""

    path: str = ""
    """A .jsonl, .jsonl.gz, .json or .parquet file (see posttrain.data.rows for the dataset types), a folder
    written by Dataset.save_to_disk, a folder of data files, or a Hub dataset id (loaded by datasets)."""
    name: str | None = None
    """The Hub dataset's configuration (load_dataset's name), e.g. "main" for openai/gsm8k."""
    split: str = "train"
    """The split of a Hub dataset or of a saved DatasetDict."""
    revision: str | None = None
    """The Hub dataset's revision (a branch, tag or commit); None = the default branch."""
    max_length: int | None = 1024
    """Most tokens of prompt + completion; None = no limit."""
    max_prompt_length: int | None = None
    """Most prompt tokens; None = only max_length limits it."""
    overlong: str = "truncate"
    """Rows over the limits: truncate (keeping the template), drop, or error."""
    on_malformed: str = "error"
    """Rows that break the schema: error (stop, naming file, line and field) or skip (count them)."""
    chat_template: str = "auto"
    """auto: use the tokenizer's chat template when it has one; always; never (plain concatenation)."""
    limit: int | None = None
    """Read at most this many rows (None = all)."""
    eval_fraction: float = 0.0
    """Share of the examples held out for evaluation (the last ones, after a seeded shuffle)."""
    columns: dict[str, str] = field(default_factory=dict)
    """Fields read from other columns, {field: column}: GSM8K's {question, answer} rows are SFT rows with
    data.columns='{prompt: question, completion: answer}'. Unnamed columns pass as they are."""

    def validate(self, name: str = "data") -> None:
        if not self.path:
            raise ValueError(f"{name}.path is required")
        if not self.split:
            raise ValueError(f"{name}.split must name a split, e.g. 'train'")
        if self.overlong not in OVERLONG_POLICIES:
            raise ValueError(f"{name}.overlong must be one of {OVERLONG_POLICIES}, got {self.overlong!r}")
        if self.on_malformed not in MALFORMED_POLICIES:
            raise ValueError(f"{name}.on_malformed must be one of {MALFORMED_POLICIES}, got {self.on_malformed!r}")
        if self.chat_template not in CHAT_TEMPLATE_MODES:
            raise ValueError(f"{name}.chat_template must be one of {CHAT_TEMPLATE_MODES}, got {self.chat_template!r}")
        for key in ("max_length", "max_prompt_length", "limit"):
            value = getattr(self, key)
            if value is not None and value < 1:
                raise ValueError(f"{name}.{key} must be >= 1 or null, got {value}")
        if not 0 <= self.eval_fraction < 1:
            raise ValueError(f"{name}.eval_fraction must be in [0, 1), got {self.eval_fraction}")
        if not isinstance(self.columns, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in self.columns.items()
        ):
            raise ValueError(f"{name}.columns must map field names to column names, e.g. {{prompt: question}}")

    def renamed(self, row: dict) -> dict:
        """``row`` with each field of ``columns`` taken from its column (the column then leaves the row)."""
        if not self.columns:
            return row
        out = {k: v for k, v in row.items() if k not in self.columns.values()}
        for target, source in self.columns.items():
            if source in row:
                out[target] = row[source]
        return out

    def encoder(self, tokenizer) -> Encoder:
        return Encoder(tokenizer, self.chat_template, self.max_length, self.max_prompt_length, self.overlong)


@dataclass
class DataReport:
    """What happened to the rows of one dataset."""

    rows: int = 0
    kept: int = 0
    truncated: int = 0
    dropped: Counter = field(default_factory=Counter)  # reason -> count
    skipped: list[str] = field(default_factory=list)  # "file:line: field 'x': why" of skipped malformed rows
    cached: bool = False  # the tokenized rows came from the datasets cache (nothing was tokenized)

    def why_empty(self) -> str:
        """ "N read, M dropped because ..." for a dataset left without rows."""
        if self.rows == 0:
            return "0 rows read: the data is empty"
        why = [f"{n} {why}" for why, n in sorted(self.dropped.items())]
        if self.skipped:
            why.append(f"{len(self.skipped)} malformed (first: {self.skipped[0]})")
        return f"{self.rows} read, {self.rows - self.kept} dropped because: " + "; ".join(why)

    def summary(self) -> str:
        parts = [f"{self.rows} rows read", f"{self.kept} kept", f"{self.truncated} truncated"]
        parts += [f"{n} dropped ({why})" for why, n in sorted(self.dropped.items())]
        if self.skipped:
            parts.append(f"{len(self.skipped)} malformed skipped (first: {self.skipped[0]})")
        if self.cached:
            parts.append("tokens from the datasets cache")
        return ", ".join(parts)


@dataclass
class SFTExample:
    prompt_ids: list[int]
    completion_ids: list[int]
    loss_mask: list[int] | None = None  # over completion_ids, 1 = trained; None = all (multi-turn rows set it)


@dataclass
class PreferenceExample:
    prompt_ids: list[int]
    chosen_ids: list[int]
    rejected_ids: list[int]


@dataclass
class UnpairedExample:
    prompt_ids: list[int]
    completion_ids: list[int]
    label: bool  # True: a desirable completion, False: an undesirable one (KTO)


@dataclass
class RankingExample:
    prompt_ids: list[int]
    response_ids: list[list[int]]  # best first


@dataclass
class StepwiseExample:
    prompt_ids: list[int]
    completion_ids: list[int]  # the steps joined by the step separator, then EOS (or the template's end of turn)
    step_ends: list[int]  # index in completion_ids of the token that ends each labelled step
    labels: list[bool]  # one per step end: True = a correct step


@dataclass
class PromptExample:
    prompt_ids: list[int]
    prompt: str | list[dict]
    columns: dict[str, Any]  # passed to reward functions (e.g. "answer")

    @property
    def row(self) -> dict[str, Any]:
        """The data row it came from: ``prompt`` (text or messages) and the other columns (an episode's start)."""
        return {"prompt": self.prompt, **self.columns}


def rendered(tokenizer, example) -> str:
    """The first tokens of a run as the model reads them, special tokens kept: an example's prompt and
    (SFT, KTO) completion, (DPO, RM) chosen or best response, printed once at start so that a template's
    default system prompt or a missing end-of-turn token is seen, not guessed."""
    ids = list(example.prompt_ids)
    if isinstance(example, SFTExample | UnpairedExample | StepwiseExample):
        ids += example.completion_ids
    elif isinstance(example, PreferenceExample):
        ids += example.chosen_ids
    elif isinstance(example, RankingExample):
        ids += example.response_ids[0]
    return repr(tokenizer.decode(ids, skip_special_tokens=False))


def _build(config: DataConfig, tokenizer, source, make, example_type) -> tuple[list, DataReport]:
    """Apply ``make(row, encoder) -> (example | None, truncated, reason)`` to every row, counting what happens.

    Raises ``NoUsableRows`` (before any model is loaded) when no row is left.
    """
    config.validate()
    encoder = config.encoder(tokenizer)
    if source is None and is_datasets_source(config.path):
        examples, report = _build_with_datasets(config, encoder, make, example_type)
    else:
        examples, report = _build_from_rows(config, encoder, source, make)
    if not examples:
        raise NoUsableRows(f"no usable rows in data.path={config.path} ({report.why_empty()})")
    return examples, report


def _build_from_rows(config: DataConfig, encoder: Encoder, source, make) -> tuple[list, DataReport]:
    report, examples = DataReport(), []
    unreadable: list[str] | None = None if config.on_malformed == "error" else []
    rows = read_rows(config.path if source is None else source, unreadable)
    if config.columns:
        rows = (replace(row, data=config.renamed(row.data)) for row in rows)
    # the first rows (never more than limit: read ahead, they would count as read) tell the file's kind
    for row in with_first_kinds(rows, FIRST_ROWS if config.limit is None else min(FIRST_ROWS, config.limit)):
        if config.limit is not None and report.rows >= config.limit:
            break
        report.rows += 1
        try:
            example, truncated, reason = make(row, encoder)
        except DataError as err:
            if config.on_malformed == "error":
                raise
            report.skipped.append(str(err))
            continue
        if example is None:
            report.dropped[reason] += 1
            continue
        report.kept += 1
        report.truncated += int(truncated)
        examples.append(example)
    if unreadable:
        report.rows += len(unreadable)
        report.skipped = unreadable + report.skipped
    return examples, report


def _build_with_datasets(config: DataConfig, encoder: Encoder, make, example_type) -> tuple[list, DataReport]:
    """A Hub id or a dataset folder, tokenized by a cached ``Dataset.map``."""
    dataset = open_dataset(config.path, config.name, config.split, config.revision)
    if config.limit is not None:
        dataset = dataset.select(range(min(config.limit, len(dataset))))
    if config.columns:
        missing = sorted(set(config.columns.values()) - set(dataset.column_names))
        if missing:
            raise UserError(
                f"data.columns: {config.path} has no column {', '.join(missing)} (its columns: "
                f"{', '.join(dataset.column_names)})"
            )
        dataset = dataset.map(config.renamed, remove_columns=list(config.columns.values()))
    label = f"{config.path}[{config.split}]"
    examples, outcomes, cached = tokenize_with_cache(dataset, label, make, encoder, config.on_malformed, example_type)
    report = DataReport(rows=len(outcomes), cached=cached)
    for status, detail, truncated in outcomes:
        if status == "kept":
            report.kept += 1
            report.truncated += int(truncated)
        elif status == "dropped":
            report.dropped[detail] += 1
        else:
            report.skipped.append(detail)
    return examples, report


def first_row(config: DataConfig) -> dict | None:
    """The first readable row of ``config.path`` (None when there is none), to tell data types apart."""
    if is_datasets_source(config.path):
        dataset = open_dataset(config.path, config.name, config.split, config.revision)
        return config.renamed(dataset[0]) if len(dataset) else None
    row = next(iter(read_rows(config.path, skipped=[])), None)
    return None if row is None else config.renamed(row.data)


def _dropped_reason(encoder: Encoder) -> str:
    return "over-long" if encoder.overlong == "drop" else "no completion tokens left after truncation"


def load_sft(config: DataConfig, tokenizer, source=None) -> tuple[list[SFTExample], DataReport]:
    """SFT examples; ``source`` (a list of dicts or a datasets.Dataset) replaces ``config.path``."""

    def make(row, encoder):
        prompt, completion = check_sft(row)
        if prompt is None:
            whole = encode_whole(encoder, completion, row.where)
            if whole is None:
                return None, False, _dropped_reason(encoder)
            encoded, mask = whole
            return SFTExample(encoded.prompt_ids, encoded.completion_ids, mask), encoded.truncated, ""
        encoded = encoder.pair(prompt, completion, row.where)
        if encoded is None:
            return None, False, _dropped_reason(encoder)
        return SFTExample(encoded.prompt_ids, encoded.completion_ids), encoded.truncated, ""

    return _build(config, tokenizer, source, make, SFTExample)


def load_preferences(config: DataConfig, tokenizer, source=None) -> tuple[list[PreferenceExample], DataReport]:
    """Preference pairs; both responses share the (possibly shortened) prompt."""

    def make(row, encoder):
        prompt, chosen, rejected = check_preference(row)
        c = encoder.pair(prompt, chosen, row.where, "chosen")
        r = encoder.pair(prompt, rejected, row.where, "rejected")
        if c is None or r is None:
            return None, False, _dropped_reason(encoder)
        if c.completion_ids == r.completion_ids:
            return None, False, "chosen and rejected identical after truncation"
        return PreferenceExample(c.prompt_ids, c.completion_ids, r.completion_ids), c.truncated or r.truncated, ""

    return _build(config, tokenizer, source, make, PreferenceExample)


def load_unpaired(config: DataConfig, tokenizer, source=None) -> tuple[list[UnpairedExample], DataReport]:
    """Unpaired preference rows (KTO's): one completion per row, labelled desirable (true) or not (false)."""

    def make(row, encoder):
        prompt, completion, label = check_unpaired(row)
        encoded = encoder.pair(prompt, completion, row.where)
        if encoded is None:
            return None, False, _dropped_reason(encoder)
        return UnpairedExample(encoded.prompt_ids, encoded.completion_ids, label), encoded.truncated, ""

    return _build(config, tokenizer, source, make, UnpairedExample)


def load_rankings(config: DataConfig, tokenizer, source=None) -> tuple[list[RankingExample], DataReport]:
    """K-way rankings, responses best first."""

    def make(row, encoder):
        prompt, responses = check_ranking(row)
        encoded = [encoder.pair(prompt, r, row.where, f"responses[{j}]") for j, r in enumerate(responses)]
        if any(e is None for e in encoded):
            return None, False, _dropped_reason(encoder)
        ids = [e.completion_ids for e in encoded]
        if len({tuple(i) for i in ids}) < len(ids):
            return None, False, "responses identical after truncation"
        return RankingExample(encoded[0].prompt_ids, ids), any(e.truncated for e in encoded), ""

    return _build(config, tokenizer, source, make, RankingExample)


def load_stepwise(
    config: DataConfig, tokenizer, separator: str = "\n", source=None
) -> tuple[list[StepwiseExample], DataReport]:
    """Step-labelled rows {prompt, completions, labels}: the steps joined by ``separator`` into one completion,
    encoded as any completion; each label sits on the token that ends its step (``steps.step_end_tokens``).
    When truncation cuts the completion, the steps it cut are left out with their labels."""
    text = TokenText(tokenizer)

    def make(row, encoder):
        prompt, steps, labels = check_stepwise(row, separator)
        joined = separator.join(steps)
        encoded = encoder.pair(prompt, joined, row.where, "completions")
        if encoded is None:
            return None, False, _dropped_reason(encoder)
        pieces = text(encoded.completion_ids)
        whole = encoder.completion(prompt, joined, row.where, "completions") if encoded.truncated else None
        if whole is not None and len(whole) > len(encoded.completion_ids):  # cut: its complete steps only
            ends = separator_ends(pieces, separator)[: len(steps) - 1]
            if not ends:
                return None, False, "no complete step left after truncation"
            return StepwiseExample(encoded.prompt_ids, encoded.completion_ids, ends, labels[: len(ends)]), True, ""
        ends = step_end_tokens(pieces, separator)
        if len(ends) != len(steps):
            raise DataError(
                row.where,
                "completions",
                f"the encoded response holds {len(ends)} step ends for {len(steps)} steps: the chat template writes "
                f"the step separator {separator!r} into the reply; use data.chat_template=never or another separator",
            )
        return StepwiseExample(encoded.prompt_ids, encoded.completion_ids, ends, labels), encoded.truncated, ""

    return _build(config, tokenizer, source, make, StepwiseExample)


def load_prompts(config: DataConfig, tokenizer, source=None) -> tuple[list[PromptExample], DataReport]:
    """RL prompts with their other columns."""

    def make(row, encoder):
        prompt, columns = check_prompt(row)
        encoded = encoder.prompt(prompt, row.where)
        if encoded is None:
            return None, False, "over-long prompt"
        return PromptExample(encoded.prompt_ids, prompt, columns), encoded.truncated, ""

    examples, report = _build(config, tokenizer, source, make, PromptExample)
    names = {name for example in examples for name in example.columns}
    for example in examples:  # a column some rows lack is None there, never absent from a batch
        for name in names:
            example.columns.setdefault(name, None)
    return examples, report


def check_columns(examples: list[PromptExample], needs: dict[str, list[str]], source: str) -> None:
    """Every column a reward function cannot run without (``needs``: {function: columns}, from
    ``posttrain.rewards.reward_columns``) is in the prompt rows; else a ``DataError`` naming the
    function, the column and the columns the rows have, before anything is generated."""
    have = {"prompt"} | {name for example in examples for name in example.columns}
    for function, columns in needs.items():
        for column in columns:
            if column not in have:
                raise DataError(
                    source,
                    column,
                    f"missing: reward function {function!r} needs this column, which no row has "
                    f"(the rows' columns: {', '.join(sorted(have))}), or a value in that reward's kwargs",
                )


def prompt_completions(examples: list[PromptExample], config: DataConfig, tokenizer) -> list[list[int]]:
    """Token ids of each prompt row's ``completion`` column as it follows the row's prompt (the template's end
    of turn, or EOS without a template; not cut), in the order of ``examples``: for a trainer that trains on
    the data set's own responses besides its samples. A row without one raises ``DataError`` before any
    model loads."""
    encoder = config.encoder(tokenizer)
    out = []
    for example in examples:
        shown = example.prompt if isinstance(example.prompt, str) else example.prompt[-1]["content"]
        where = f"{config.path} (the row whose prompt is {shown[:60]!r})"
        completion = check_completion(Row(where, {"completion": example.columns.get("completion")}))
        out.append(encoder.completion(example.prompt, completion, where))
    return out


# --------------------------------------------------------------------------------------------------
# Collation
# --------------------------------------------------------------------------------------------------


@dataclass
class SequenceBatch:
    """Prompt + completion sequences, right-padded.

    input_ids [N, L]; attention_mask [N, L] 1 on real tokens; completion_mask [N, L] 1 on completion
    tokens, the only ones that get a loss (the token at position i is predicted by logits at i − 1).
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    completion_mask: torch.Tensor
    position_ids: torch.Tensor | None = None  # [N, L] set for packed rows: restarts at 0 for each example

    def to(self, device) -> SequenceBatch:
        moved = (t.to(device) for t in (self.input_ids, self.attention_mask, self.completion_mask))
        return SequenceBatch(*moved, None if self.position_ids is None else self.position_ids.to(device))

    @property
    def num_tokens(self) -> int:
        return int(self.attention_mask.sum())


def collate(pairs: list[tuple[list[int], list[int]]], pad_id: int) -> SequenceBatch:
    """(prompt_ids, completion_ids) pairs → one right-padded ``SequenceBatch``."""
    length = max(len(p) + len(c) for p, c in pairs)
    input_ids = torch.full((len(pairs), length), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(pairs), length), dtype=torch.long)
    completion_mask = torch.zeros((len(pairs), length), dtype=torch.long)
    for i, (p, c) in enumerate(pairs):
        input_ids[i, : len(p) + len(c)] = torch.tensor(p + c, dtype=torch.long)
        attention_mask[i, : len(p) + len(c)] = 1
        completion_mask[i, len(p) : len(p) + len(c)] = 1
    return SequenceBatch(input_ids, attention_mask, completion_mask)


def collate_sft(examples: list[SFTExample], pad_id: int) -> SequenceBatch:
    batch = collate([(e.prompt_ids, e.completion_ids) for e in examples], pad_id)
    for i, e in enumerate(examples):
        if e.loss_mask is not None:  # several assistant turns: only theirs are trained
            start = len(e.prompt_ids)
            batch.completion_mask[i, start : start + len(e.loss_mask)] = torch.tensor(e.loss_mask)
    return batch


def collate_preferences(examples: list[PreferenceExample], pad_id: int) -> SequenceBatch:
    """2B rows: the B chosen sequences, then the B rejected ones (one forward pass for both)."""
    pairs = [(e.prompt_ids, e.chosen_ids) for e in examples] + [(e.prompt_ids, e.rejected_ids) for e in examples]
    return collate(pairs, pad_id)


def collate_rankings(examples: list[RankingExample], pad_id: int) -> SequenceBatch:
    """B·K rows, row b·K + k is response k (best first) of ranking b; all rankings must have the same K."""
    ks = {len(e.response_ids) for e in examples}
    if len(ks) != 1:
        raise ValueError(f"rankings in one batch must have the same K, got {sorted(ks)}")
    return collate([(e.prompt_ids, r) for e in examples for r in e.response_ids], pad_id)


@dataclass
class PackedExample:
    """Several SFT examples in one row; ``position_ids`` restart at 0 for each of them."""

    input_ids: list[int]
    completion_mask: list[int]
    position_ids: list[int]


def pack_sft(examples: list[SFTExample], max_length: int) -> list[PackedExample]:
    """Greedy packing in order: examples are appended to the current row while they fit in ``max_length``.

    Attention must not cross examples: the model is run with these position ids and no 2-D attention
    mask, from which transformers builds a block-diagonal causal mask (``find_packed_sequence_indices``).
    """
    packs: list[PackedExample] = []
    current = PackedExample([], [], [])
    for e in examples:
        ids = e.prompt_ids + e.completion_ids
        if len(ids) > max_length:
            raise ValueError(f"an example of {len(ids)} tokens does not fit in a pack of {max_length}")
        if len(current.input_ids) + len(ids) > max_length:
            packs.append(current)
            current = PackedExample([], [], [])
        current.input_ids += ids
        current.completion_mask += [0] * len(e.prompt_ids) + (e.loss_mask or [1] * len(e.completion_ids))
        current.position_ids += list(range(len(ids)))
    if current.input_ids:
        packs.append(current)
    return packs


def collate_packed(packs: list[PackedExample], pad_id: int) -> SequenceBatch:
    """Right-padded packed rows; padding continues the position count so it forms no example of its own."""
    length = max(len(p.input_ids) for p in packs)
    batch = collate([([], p.input_ids) for p in packs], pad_id)
    completion_mask = torch.zeros_like(batch.input_ids)
    position_ids = torch.zeros_like(batch.input_ids)
    for i, p in enumerate(packs):
        n = len(p.input_ids)
        completion_mask[i, :n] = torch.tensor(p.completion_mask)
        last = p.position_ids[-1]
        position_ids[i] = torch.tensor(p.position_ids + list(range(last + 1, last + 1 + length - n)))
    return SequenceBatch(batch.input_ids, batch.attention_mask, completion_mask, position_ids)
