"""Data from the ``datasets`` library: a Hub dataset id, a folder written by ``Dataset.save_to_disk``,
or a folder of data files (loaded by ``datasets``' JSON / Parquet / CSV builders); tokenized with
``Dataset.map``, whose cache makes a second run on the same data and settings skip tokenization.

    data.path=openai/gsm8k data.name=main data.split=train     # a Hub id (its cache is used offline)
    data.path=runs/my_dataset                                  # save_to_disk() output or a data folder

The map's fingerprint covers the rows, the tokenizer (its files and chat template), the length limits
and the malformed-row policy; change any of them and the rows are tokenized again.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from posttrain.data.rows import DataError, Row

FILE_SUFFIXES = (".jsonl", ".json", ".parquet", ".gz")


def is_datasets_source(path: str) -> bool:
    """True unless ``path`` names a data file (read by ``posttrain.data.rows`` with file:line errors)."""
    return not path.endswith(FILE_SUFFIXES) and not Path(path).is_file()


def open_dataset(path: str, name: str | None, split: str, revision: str | None):
    """The ``datasets.Dataset`` of one split."""
    import datasets

    folder = Path(path)
    if (folder / "state.json").is_file() or (folder / "dataset_dict.json").is_file():  # save_to_disk output
        loaded = datasets.load_from_disk(str(folder))
        if isinstance(loaded, datasets.DatasetDict):
            if split not in loaded:
                raise ValueError(f"data.split={split!r} is not in {path} (it holds {sorted(loaded)})")
            loaded = loaded[split]
        return loaded
    return datasets.load_dataset(path, name, split=split, revision=revision)


def tokenize_with_cache(dataset, label: str, make, encoder, on_malformed: str, example_type):
    """Run ``make(row, encoder)`` over ``dataset`` with ``Dataset.map``, cached beside the dataset's files.

    Returns (examples, outcomes, cached): outcomes is one (status, detail, truncated) per row, status
    "kept", "dropped" (detail = reason) or "skipped" (detail = the DataError's message); cached is
    True when the map was served from its cache, i.e. nothing was tokenized.
    """
    ran = []

    def encode(row: dict, index: int) -> dict:
        ran.append(index)
        try:
            example, truncated, reason = make(Row(f"{label}:{index + 1}", row), encoder)
        except DataError as err:
            if on_malformed == "error":
                raise
            return {"status": "skipped", "detail": str(err), "truncated": False, "example": ""}
        if example is None:
            return {"status": "dropped", "detail": reason, "truncated": False, "example": ""}
        return {"status": "kept", "detail": "", "truncated": truncated, "example": json.dumps(asdict(example))}

    mapped = dataset.map(
        encode,
        with_indices=True,
        remove_columns=dataset.column_names,
        new_fingerprint=_fingerprint(dataset, label, make, encoder, on_malformed),
        desc=f"tokenizing {label}",
    )
    examples, outcomes = [], []
    for out in mapped:
        outcomes.append((out["status"], out["detail"], out["truncated"]))
        if out["status"] == "kept":
            examples.append(example_type(**json.loads(out["example"])))
    return examples, outcomes, not ran


def _fingerprint(dataset, label: str, make, encoder, on_malformed: str) -> str:
    """What the tokenized rows depend on: the rows, the tokenizer, the settings and this package's data code
    (hashed explicitly: datasets would hash ``make``'s helpers by name, missing edits to them)."""
    from datasets.fingerprint import Hasher

    code = b"".join(p.read_bytes() for p in sorted(Path(__file__).parent.glob("*.py")))
    settings = (encoder.use_template, encoder.max_length, encoder.prompt_budget, encoder.overlong, on_malformed)
    return Hasher.hash([dataset._fingerprint, label, make.__qualname__, settings, encoder.tokenizer, code])
