"""Reading rows from files and checking them against the dataset types (TRL's, told apart by columns).

One JSON object per row; text fields hold a string or a list of ``{"role", "content"}`` messages:

    type                   columns                      trainers
    language modelling     text                         sft: every token
    conversational         messages                     sft: every assistant turn
    prompt-completion      prompt, completion           sft
    prompt-only            prompt (+ reward columns)    grpo, ppo: other columns go to reward functions
    explicit preference    prompt, chosen, rejected     dpo, rm
    implicit preference    chosen, rejected             dpo, rm: their shared start is the prompt
    ranking                prompt, responses            rm: [best, ..., worst], K ≥ 2, all different
    unpaired preference    prompt, completion, label    kto: label true (desirable) or false (undesirable)
    stepwise supervision   prompt, completions, labels  prm: a solution's steps, each labelled true (correct) or false

A ``messages`` conversation must end with the assistant's turn; with one assistant turn it is the
prompt-completion pair (prompt = the messages before it), with several every one is trained
(``posttrain.data.formats``).

A malformed row raises ``DataError`` naming the file, the line and the field (docs/pitfalls.md #16); with
``on_malformed="skip"`` it is skipped and counted instead. Nothing malformed reaches a loss.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from posttrain.errors import UserError


class DataError(UserError):
    """A row that does not fit its schema: ``where`` is "file:line", ``field`` the offending column."""

    def __init__(self, where: str, field: str, message: str):
        self.where, self.field = where, field
        super().__init__(f"{where}: field {field!r}: {message}")


class NoUsableRows(UserError):
    """A dataset in which no row survives reading, checking and the length limits."""


@dataclass
class Row:
    where: str  # "path:line" (1-based line of a JSONL file, or row number of a JSON/Parquet table)
    data: dict[str, Any]
    # the kinds (``row_kind``) of the first rows of the row's file, when its reader looked ahead (``with_first_kinds``)
    first_kinds: tuple[str | None, ...] | None = None


FIRST_ROWS = 5  # the rows that tell what kind of file a file is


def read_rows(source, skipped: list[str] | None = None) -> Iterator[Row]:
    """Rows of a .jsonl / .jsonl.gz / .json / .parquet file, a ``datasets.Dataset``, or a list of dicts.

    A JSONL line that is not UTF-8, not JSON or not an object raises ``DataError`` naming ``file:line``;
    when ``skipped`` is a list the error is appended to it instead and the line skipped.
    """
    if isinstance(source, list | tuple):
        for i, data in enumerate(source, start=1):
            yield Row(f"<list>:{i}", data)
        return
    if not isinstance(source, str | Path):  # a datasets.Dataset (or any iterable of dicts)
        name = getattr(source, "info", None) and source.info.dataset_name or type(source).__name__
        for i, data in enumerate(source, start=1):
            yield Row(f"<{name}>:{i}", dict(data))
        return
    path = Path(source)
    if not path.is_file():
        raise FileNotFoundError(f"data file not found: {path}")
    suffixes = "".join(path.suffixes[-2:])
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        for i, data in enumerate(pq.read_table(path).to_pylist(), start=1):
            yield Row(f"{path}:{i}", data)
    elif path.suffix == ".jsonl" or suffixes == ".jsonl.gz":
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rb") as f:
            for i, line in enumerate(f, start=1):
                try:
                    row = _parse_line(line, f"{path}:{i}")
                except DataError as err:
                    if skipped is None:
                        raise
                    skipped.append(str(err))
                    continue
                if row is not None:
                    yield row
    elif path.suffix == ".json":
        try:
            table = json.loads(path.read_bytes().decode("utf-8"))
        except UnicodeDecodeError as err:
            raise DataError(str(path), "<file>", f"not UTF-8 (byte {err.start})") from err
        except json.JSONDecodeError as err:
            raise DataError(f"{path}:{err.lineno}", "<file>", f"not valid JSON ({err.msg})") from err
        if not isinstance(table, list):
            raise DataError(str(path), "<file>", "a .json data file must hold a list of objects")
        for i, data in enumerate(table, start=1):
            if not isinstance(data, dict):
                raise DataError(f"{path}:{i}", "<row>", f"expected a JSON object, got {type(data).__name__}")
            yield Row(f"{path}:{i}", data)
    else:
        raise ValueError(f"unknown data file type {path.name!r}: use .jsonl, .jsonl.gz, .json or .parquet")


def _parse_line(line: bytes, where: str) -> Row | None:
    """One JSONL line as a row; None for a blank line."""
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as err:
        raise DataError(where, "<line>", f"not UTF-8 (byte {err.start}: {line[err.start : err.start + 1]!r})") from err
    if not text.strip():
        return None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise DataError(where, "<line>", f"not valid JSON ({err.msg})") from err
    if not isinstance(data, dict):
        raise DataError(where, "<line>", f"expected a JSON object, got {type(data).__name__}")
    return Row(where, data)


# --------------------------------------------------------------------------------------------------
# Schemas
# --------------------------------------------------------------------------------------------------


def _unicode(row: Row, field: str, text: str) -> str:
    """``text``, which JSON's escapes may have left holding lone surrogates that no tokenizer accepts."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise DataError(row.where, field, f"not valid Unicode ({err.reason} at character {err.start})") from err
    return text


def _text_or_messages(row: Row, field: str, *, assistant_last: bool = False) -> str | list[dict]:
    if field not in row.data:
        raise DataError(row.where, field, "missing")
    value = row.data[field]
    if isinstance(value, str):
        if not value.strip():
            raise DataError(row.where, field, "empty text")
        return _unicode(row, field, value)
    if isinstance(value, list) and value:
        for j, message in enumerate(value):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                raise DataError(row.where, f"{field}[{j}]", "a message must be an object with a string 'role'")
            if not isinstance(message.get("content"), str):
                raise DataError(row.where, f"{field}[{j}].content", "missing or not a string")
            _unicode(row, f"{field}[{j}].role", message["role"])
            _unicode(row, f"{field}[{j}].content", message["content"])
        if assistant_last and value[-1]["role"] != "assistant":
            raise DataError(row.where, f"{field}[-1].role", "the last message must be the assistant's")
        if not value[-1]["content"].strip():
            raise DataError(row.where, f"{field}[-1].content", "empty text")
        return value
    raise DataError(row.where, field, f"expected a non-empty string or list of messages, got {type(value).__name__}")


UNPAIRED_COLUMNS = {"prompt", "completion", "label"}
STEPWISE_COLUMNS = {"completions", "labels"}


def reject_unpaired(data: dict, where: str) -> None:
    """Unpaired preference rows would otherwise pass as SFT or RL prompts with a column ignored."""
    if UNPAIRED_COLUMNS <= data.keys():
        raise DataError(
            where,
            "label",
            "an unpaired preference row (prompt, completion, label) is the format of KTO, read by posttrain "
            "kto; sft, dpo and rm need prompt/completion or prompt/chosen/rejected rows",
        )


def shared_prompt(chosen, rejected, where: str) -> tuple[str | list[dict], str | list[dict], str | list[dict]]:
    """(prompt, chosen, rejected) of an implicit preference pair: the prompt is the longest shared start,
    as TRL's ``extract_prompt`` takes it.

    Messages: the shared leading messages. Text: the shared leading characters up to the first that
    differs; when the one before it is a space, the space goes with the replies ("The sky is" + " blue."
    / " green."). Otherwise the replies start where the texts differ, mid-word if need be ("3+4=" + "7" /
    "8"). Unlike TRL, a pair in which one text is the start of the other is an error (TRL cuts the
    shared text one character short there).
    """
    if isinstance(chosen, str) != isinstance(rejected, str):
        raise DataError(where, "rejected", "chosen and rejected must both be text or both be messages")
    n = 0
    while n < min(len(chosen), len(rejected)) and chosen[n] == rejected[n]:
        n += 1
    if isinstance(chosen, str) and 0 < n < min(len(chosen), len(rejected)) and chosen[n - 1] == " ":
        n -= 1
    if n == 0:
        raise DataError(where, "chosen", "implicit preference: chosen and rejected share no prompt at their start")
    for field, value in (("chosen", chosen), ("rejected", rejected)):
        rest = value[n:]
        if not rest or (isinstance(rest, str) and not rest.strip()):
            raise DataError(where, field, "implicit preference: nothing follows the prompt shared with the other")
    return chosen[:n], chosen[n:], rejected[n:]


# dataset kind: (its rows, the commands that read them)
KINDS = {
    "sft": ("SFT rows (prompt/completion, messages or text)", "posttrain sft"),
    "preference": ("preference rows (prompt/chosen/rejected or chosen/rejected)", "posttrain dpo and posttrain rm"),
    "ranking": ("ranking rows (prompt/responses)", "posttrain rm"),
    "prompt": ("prompt rows (prompt and reward columns)", "posttrain grpo and posttrain ppo"),
    "unpaired": ("unpaired preference rows (prompt/completion/label)", "posttrain kto"),
    "stepwise": ("step-labelled rows (prompt/completions/labels)", "posttrain prm"),
}
_READ_BY_RM = "preference rows (prompt/chosen/rejected) or ranking rows (prompt/responses)"


def row_kind(data: dict) -> str | None:
    """The dataset kind (a key of ``KINDS``) that a row's columns point to, None when they point to none."""
    keys = data.keys()
    if STEPWISE_COLUMNS <= keys:
        return "stepwise"
    if UNPAIRED_COLUMNS <= keys:
        return "unpaired"
    if {"chosen", "rejected"} <= keys:
        return "preference"
    if "responses" in keys:
        return "ranking"
    if "messages" in keys or "text" in keys or {"prompt", "completion"} <= keys:
        return "sft"
    return "prompt" if "prompt" in keys else None


def with_first_kinds(rows, n: int = FIRST_ROWS) -> Iterator[Row]:
    """``rows`` (an iterable of ``Row``) in order, each with ``first_kinds``: the kinds of the first ``n``,
    read ahead. An error reading one of them is raised where that row would have come."""
    rows = iter(rows)
    head, error = [], None
    while len(head) < n:
        try:
            head.append(next(rows))
        except StopIteration:
            break
        except DataError as err:  # the reader is done: raise it after the rows before it
            error = err
            break
    kinds = tuple(row_kind(row.data) for row in head)
    for row in head:
        row.first_kinds = kinds
        yield row
    if error is not None:
        raise error
    for row in rows:
        row.first_kinds = kinds
        yield row


def _refuse_other_kind(row: Row, field: str, wanted: str) -> None:
    """When column ``field`` of ``wanted`` rows is missing and the row looks like another kind of
    dataset, and so do the first rows of its file (none of them is of the ``wanted`` kind): a DataError
    saying which, what reads it, and what this command reads. One bad row of a good file is just
    missing ``field``."""
    found = row_kind(row.data)
    if field in row.data or found in (None, wanted):
        return
    if row.first_kinds is not None and wanted in row.first_kinds:
        return
    rows, readers = KINDS[found]
    reads = _READ_BY_RM if wanted == "ranking" else KINDS[wanted][0]  # only rm reads rankings, and pairs too
    raise DataError(
        row.where, field, f"missing: this looks like a file of {rows}, read by {readers}; this command reads {reads}"
    )


def _required(row: Row, field: str, wanted: str, **kwargs) -> str | list[dict]:
    """``_text_or_messages`` of a column that ``wanted`` rows need (``_refuse_other_kind`` first)."""
    _refuse_other_kind(row, field, wanted)
    return _text_or_messages(row, field, **kwargs)


def check_sft(row: Row) -> tuple[str | list[dict] | None, str | list[dict]]:
    """(prompt, completion) of an SFT row; prompt None for a row trained throughout (a text or a
    conversation with several assistant turns)."""
    reject_unpaired(row.data, row.where)
    if "text" in row.data and not {"prompt", "messages"} & row.data.keys():
        text = _text_or_messages(row, "text")
        if not isinstance(text, str):
            raise DataError(row.where, "text", "a language-modelling row holds text; use 'messages' for a conversation")
        return None, text
    if "messages" in row.data:
        messages = _text_or_messages(row, "messages", assistant_last=True)
        if isinstance(messages, str) or len(messages) < 2:
            raise DataError(row.where, "messages", "needs at least one prompt message and the assistant's reply")
        if sum(m["role"] == "assistant" for m in messages) > 1:
            return None, messages
        return messages[:-1], messages[-1:]
    return _required(row, "prompt", "sft"), _required(row, "completion", "sft")


def check_preference(row: Row) -> tuple[str | list[dict], str | list[dict], str | list[dict]]:
    """(prompt, chosen, rejected) of an explicit or implicit preference row; chosen == rejected is an error."""
    reject_unpaired(row.data, row.where)
    chosen, rejected = _required(row, "chosen", "preference"), _required(row, "rejected", "preference")
    if chosen == rejected:
        raise DataError(row.where, "rejected", "identical to 'chosen': the pair carries no preference")
    if "prompt" not in row.data:
        return shared_prompt(chosen, rejected, row.where)
    return _text_or_messages(row, "prompt"), chosen, rejected


def check_ranking(row: Row) -> tuple[str | list[dict], list[str | list[dict]]]:
    """(prompt, responses best first) of a ranking row."""
    reject_unpaired(row.data, row.where)
    prompt = _required(row, "prompt", "ranking")
    _refuse_other_kind(row, "responses", "ranking")
    responses = row.data.get("responses")
    if not isinstance(responses, list) or len(responses) < 2:
        raise DataError(row.where, "responses", "needs a list of at least 2 responses, best first")
    checked = [
        _text_or_messages(Row(row.where, {f"responses[{j}]": r}), f"responses[{j}]") for j, r in enumerate(responses)
    ]
    for j, response in enumerate(checked):
        if response in checked[:j]:
            raise DataError(row.where, f"responses[{j}]", "repeats an earlier response: a ranking needs distinct ones")
    return prompt, checked


def check_prompt(row: Row) -> tuple[str | list[dict], dict[str, Any]]:
    """(prompt, other columns) of an RL prompt row."""
    reject_unpaired(row.data, row.where)
    prompt = _required(row, "prompt", "prompt")
    return prompt, {k: v for k, v in row.data.items() if k != "prompt"}


def check_completion(row: Row) -> str | list[dict]:
    """The ``completion`` of a prompt row that must have one (a trainer that also trains on the data set's
    own responses, such as GKD's supervised batches in ``posttrain distill``)."""
    if row.data.get("completion") is None:
        raise DataError(row.where, "completion", "missing: this run trains on the data set's completions too")
    return _text_or_messages(row, "completion")


def check_unpaired(row: Row) -> tuple[str | list[dict], str | list[dict], bool]:
    """(prompt, completion, label) of an unpaired preference row (KTO's, TRL's unpaired preference type):
    label is a JSON boolean, true for a desirable completion and false for an undesirable one."""
    prompt = _required(row, "prompt", "unpaired")
    completion = _required(row, "completion", "unpaired")
    _refuse_other_kind(row, "label", "unpaired")
    if "label" not in row.data:
        raise DataError(row.where, "label", "missing: true (a desirable completion) or false (an undesirable one)")
    label = row.data["label"]
    if not isinstance(label, bool):
        raise DataError(row.where, "label", f"must be true (desirable) or false (undesirable), got {label!r}")
    return prompt, completion, label


def check_stepwise(row: Row, separator: str) -> tuple[str | list[dict], list[str], list[bool]]:
    """(prompt, steps, labels) of a step-labelled row (TRL's stepwise supervision type, Math-Shepherd's and
    PRM800K's form): ``completions`` the solution's steps in order, ``labels`` one JSON boolean per step, true
    for a correct step. A step may not hold ``separator``, which joins the steps into one response."""
    prompt = _required(row, "prompt", "stepwise")
    _refuse_other_kind(row, "completions", "stepwise")
    steps, labels = row.data.get("completions"), row.data.get("labels")
    if not isinstance(steps, list) or not steps:
        raise DataError(row.where, "completions", "needs a non-empty list of steps (strings), in order")
    for j, step in enumerate(steps):
        if not isinstance(step, str) or not step.strip():
            raise DataError(row.where, f"completions[{j}]", f"a step must be non-empty text, got {step!r}")
        _unicode(row, f"completions[{j}]", step)
        if separator in step:
            raise DataError(
                row.where, f"completions[{j}]", f"holds the step separator {separator!r}, which joins the steps"
            )
    if not isinstance(labels, list) or len(labels) != len(steps):
        got = f"{len(labels)} labels" if isinstance(labels, list) else repr(labels)
        raise DataError(row.where, "labels", f"needs one label per step (true/false): {len(steps)} steps, got {got}")
    for j, label in enumerate(labels):
        if not isinstance(label, bool):
            raise DataError(row.where, f"labels[{j}]", f"must be true (a correct step) or false, got {label!r}")
    return prompt, steps, labels
