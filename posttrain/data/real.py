"""Loaders for the real data sets kept beside the project (``../shared/data``): GSM8K and HH-RLHF.

Nothing is downloaded: the files are found through ``POSTTRAIN_SHARED_DATA`` or by looking for a
``shared/data`` folder above the working directory and above this package.
"""

from __future__ import annotations

import os
from pathlib import Path

from posttrain.data.rows import read_rows

HH_ASSISTANT = "\n\nAssistant:"


def shared_data_dir() -> Path:
    """The folder holding ``gsm8k/`` and ``hh-rlhf/``."""
    env = os.environ.get("POSTTRAIN_SHARED_DATA")
    if env:
        return Path(env)
    for start in (Path.cwd(), Path(__file__).resolve()):
        for folder in (start, *start.parents):
            candidate = folder / "shared" / "data"
            if (candidate / "gsm8k").is_dir():
                return candidate
    raise FileNotFoundError("no shared/data folder found; set POSTTRAIN_SHARED_DATA to the folder holding gsm8k/")


def gsm8k_final_answer(solution: str) -> str:
    """The number after '#### ' on the last line of a GSM8K solution, commas removed."""
    marker = solution.rfind("####")
    if marker < 0:
        raise ValueError("a GSM8K solution must end with '#### <answer>'")
    return solution[marker + 4 :].strip().replace(",", "")


def load_gsm8k(split: str = "train", limit: int | None = None) -> list[dict]:
    """RL prompt rows ``{"prompt": question, "answer": final answer, "solution": worked solution}``."""
    if split not in ("train", "test"):
        raise ValueError(f"GSM8K split must be 'train' or 'test', got {split!r}")
    rows = []
    for row in read_rows(shared_data_dir() / "gsm8k" / f"{split}.jsonl"):
        if limit is not None and len(rows) >= limit:
            break
        solution = row.data["answer"]
        rows.append({"prompt": row.data["question"], "answer": gsm8k_final_answer(solution), "solution": solution})
    return rows


def split_hh_dialogue(text: str) -> tuple[str, str]:
    """(prompt up to and including the last '\\n\\nAssistant:', the last assistant turn)."""
    cut = text.rfind(HH_ASSISTANT)
    if cut < 0:
        raise ValueError("an HH-RLHF dialogue must contain '\\n\\nAssistant:'")
    cut += len(HH_ASSISTANT)
    return text[:cut], text[cut:]


def load_hh_rlhf(limit: int | None = None) -> list[dict]:
    """Preference rows ``{"prompt", "chosen", "rejected"}`` from the harmless-base test split.

    The 5 rows whose two dialogues differ before the last assistant turn have no shared prompt and
    are left out. The rest pass as they are: the 4 with an empty last turn are reported by
    ``load_preferences`` as malformed (or skipped and counted with ``on_malformed="skip"``).
    """
    rows = []
    for row in read_rows(shared_data_dir() / "hh-rlhf" / "harmless-base-test.jsonl.gz"):
        if limit is not None and len(rows) >= limit:
            break
        prompt, chosen = split_hh_dialogue(row.data["chosen"])
        rejected_prompt, rejected = split_hh_dialogue(row.data["rejected"])
        if rejected_prompt == prompt:
            rows.append({"prompt": prompt, "chosen": chosen, "rejected": rejected})
    return rows
