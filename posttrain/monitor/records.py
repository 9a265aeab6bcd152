"""The JSONL records a run writes (``metrics.jsonl``), as strict JSON.

A value that is not a finite number (NaN, ±inf: ``reward/mean`` of a GRPO step nothing scored, a
ratio with no token to measure) is written as ``null``, and read back as NaN. Python's ``json``
writes bare ``NaN`` / ``Infinity`` by default (so does Hugging Face ``Trainer``'s
``trainer_state.json``), which is not JSON (RFC 8259): ``jq``, JavaScript and other strict parsers
refuse the line. ``null`` is what every parser reads, what ``eval_samples.jsonl`` already writes for
a score no function gave, and what pandas reads as NaN. Files written before, with bare NaN, still
read.
"""

from __future__ import annotations

import json
import math
from pathlib import Path


def strict_json(value):
    """``value`` (numbers, strings, lists and dicts of them) with every non-finite float as None."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: strict_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [strict_json(v) for v in value]
    return value


def dumps_record(record: dict) -> str:
    """One line of strict JSON (no bare NaN or Infinity)."""
    return json.dumps(strict_json(record), allow_nan=False)


def read_records(path: str | Path) -> list[dict]:
    """The records of a metrics JSONL file, each null read back as NaN (every logged value is a number)."""
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    return [{k: math.nan if v is None else v for k, v in json.loads(line).items()} for line in lines if line.strip()]
