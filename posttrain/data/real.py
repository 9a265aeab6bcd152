"""Loaders for GSM8K and HH-RLHF: the samples shipped in ``posttrain/data/samples`` or the full files.

Nothing is downloaded: the tests, examples and demo read the small MIT-licensed samples inside the
package (see ``samples/README.md``); pass ``path=`` to read a full copy of the same file.
"""

from __future__ import annotations

from pathlib import Path

from posttrain.data.rows import read_rows

HH_ASSISTANT = "\n\nAssistant:"
SAMPLES = Path(__file__).parent / "samples"


def gsm8k_final_answer(solution: str) -> str:
    """The number after '#### ' on the last line of a GSM8K solution, commas removed."""
    marker = solution.rfind("####")
    if marker < 0:
        raise ValueError("a GSM8K solution must end with '#### <answer>'")
    return solution[marker + 4 :].strip().replace(",", "")


def load_gsm8k(split: str = "train", limit: int | None = None, path: str | Path | None = None) -> list[dict]:
    """RL prompt rows ``{"prompt": question, "answer": final answer, "solution": worked solution}``.

    From the shipped 300-row sample of ``split``, or from ``path`` (a GSM8K ``{"question", "answer"}`` file).
    """
    if split not in ("train", "test"):
        raise ValueError(f"GSM8K split must be 'train' or 'test', got {split!r}")
    rows = []
    for row in read_rows(path or SAMPLES / "gsm8k" / f"{split}.jsonl.gz"):
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


def load_hh_rlhf(limit: int | None = None, path: str | Path | None = None) -> list[dict]:
    """Preference rows ``{"prompt", "chosen", "rejected"}`` from the harmless-base test split.

    From the shipped 300-row sample, or from ``path`` (the full ``harmless-base-test.jsonl.gz``).
    The 5 rows whose two dialogues differ before the last assistant turn have no shared prompt and
    are left out. The rest pass as they are: the 4 with an empty last turn are reported by
    ``load_preferences`` as malformed (or skipped and counted with ``on_malformed="skip"``).
    """
    rows = []
    for row in read_rows(path or SAMPLES / "hh-rlhf" / "harmless-base-test.jsonl.gz"):
        if limit is not None and len(rows) >= limit:
            break
        prompt, chosen = split_hh_dialogue(row.data["chosen"])
        rejected_prompt, rejected = split_hh_dialogue(row.data["rejected"])
        if rejected_prompt == prompt:
            rows.append({"prompt": prompt, "chosen": chosen, "rejected": rejected})
    return rows
