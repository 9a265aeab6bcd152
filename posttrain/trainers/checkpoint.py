"""Checkpoints: Hugging Face models plus everything needed to continue exactly, written atomically.

Layout of ``<output_dir>/checkpoints/step-000120/``:

    hf/<role>/           save_pretrained of each trained model (and the tokenizer): loads without posttrain;
                         the only copy of the weights, loaded from here on resume (trainers/weights.py)
    state/               accelerate ``save_state``: optimizer, scheduler, RNG states (every process)
    trainer_state.json   step, epoch and the trainer's own state (e.g. the adaptive KL controller); written
                         last, so a folder without it is a partial checkpoint and is refused

A checkpoint is written under ``.tmp-step-000120``, flushed to disk, then renamed: a process killed
while saving leaves the previous checkpoint as the latest one (PITFALLS #14).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

from posttrain.trainers.weights import weights_from_hf, weights_left_to_hf

STATE_FILE = "trainer_state.json"
_STEP_DIR = re.compile(r"^step-(\d+)$")


class IncompleteCheckpointError(RuntimeError):
    pass


def checkpoints_dir(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def list_checkpoints(output_dir: str | Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    root = checkpoints_dir(output_dir)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found) if (p / STATE_FILE).is_file()]


def resolve_resume(output_dir: str | Path, resume_from: str | None) -> Path | None:
    """The checkpoint folder ``resume_from`` names (``latest`` = newest complete), None for a fresh run."""
    if resume_from is None:
        return None
    if resume_from == "latest":
        found = list_checkpoints(output_dir)
        return found[-1] if found else None
    path = Path(resume_from)
    if not path.is_dir():
        raise FileNotFoundError(f"run.resume_from: no checkpoint folder at {path}")
    if not (path / STATE_FILE).is_file():
        raise IncompleteCheckpointError(
            f"run.resume_from: {path} has no {STATE_FILE}: it is a partial checkpoint (a save was interrupted)"
        )
    return path


def _fsync_tree(root: Path) -> None:
    for path in sorted(root.rglob("*")):
        if path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())
    fd = os.open(root, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(accelerator, output_dir, step: int, models: dict, tokenizer, trainer_state: dict, keep_last: int):
    """Write checkpoint ``step`` atomically and keep the newest ``keep_last``. Collective: call on every process."""
    root = checkpoints_dir(output_dir)
    final = root / f"step-{step:06d}"
    tmp = root / f".tmp-step-{step:06d}"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    with weights_left_to_hf(accelerator, models):
        accelerator.save_state(str(tmp / "state"))
    for role, model in models.items():
        state_dict = accelerator.get_state_dict(model)
        if accelerator.is_main_process:
            accelerator.unwrap_model(model).save_pretrained(tmp / "hf" / role, state_dict=state_dict)
            tokenizer.save_pretrained(tmp / "hf" / role)
    if accelerator.is_main_process:
        (tmp / STATE_FILE).write_text(json.dumps({"step": step, **trainer_state}, indent=2))
        _fsync_tree(tmp)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        for old in list_checkpoints(output_dir)[:-keep_last]:
            shutil.rmtree(old)
    accelerator.wait_for_everyone()
    return final


def load_checkpoint(accelerator, path: Path) -> dict:
    """Restore models, optimizer, scheduler and RNG states from ``path``; returns its trainer state."""
    if not (path / STATE_FILE).is_file():
        raise IncompleteCheckpointError(f"{path} has no {STATE_FILE}: it is a partial checkpoint")
    with weights_from_hf(accelerator, path):
        accelerator.load_state(str(path / "state"))
    return json.loads((path / STATE_FILE).read_text())
