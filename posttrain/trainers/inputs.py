"""Inputs checked before anything is built: every model, tokenizer and data path exists, the run folder
holds no other run, and the length limits fit the model's context.

A trainer calls ``check_inputs(config)`` right after ``config.validate()``, before the accelerator and
the models; the CLI calls it too, so a bad input ends with one line and exit status 2 instead of a
traceback minutes later. A path that does not exist locally may still be a Hugging Face Hub id
(``org/name``): it goes to the Hub loader, or, offline, must already be in the Hub cache.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from pathlib import Path

from posttrain.models import ModelConfig

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")
_FINAL = re.compile(r"^(?P<run>.*?)/?final/(?P<role>policy|reward|critic)/?$")
_PRODUCER = {"policy": "posttrain sft (or dpo, grpo, ppo)", "reward": "posttrain rm", "critic": "posttrain ppo"}


def check_inputs(config) -> None:
    """Raise FileNotFoundError/ValueError naming the first bad input of a trainer config; cap the
    length limits at the model's context (printed)."""
    for name, path, kind in _model_paths(config):
        _check_model_path(name, path, kind)
    _check_data_path("data.path", config.data.path)
    check_run_dir(config.run)
    cap_to_context(config)


def _model_paths(config):
    """(field, path, kind) of every model, tokenizer and reference path a trainer config names."""
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if isinstance(value, ModelConfig):
            yield f"{f.name}.path", value.path, "model"
            if value.tokenizer_path:
                yield f"{f.name}.tokenizer_path", value.tokenizer_path, "tokenizer"
        elif f.name in ("reference_path", "normalize_policy") and value:
            yield f.name, value, "model"


def _looks_like_hub_id(path: str) -> bool:
    return bool(_HUB_ID.match(path)) and not path.startswith(".")


def _check_model_path(name: str, path: str, kind: str) -> None:
    local = Path(path).expanduser()
    if local.is_dir():
        if kind == "model" and not any((local / f).is_file() for f in ("config.json", "adapter_config.json")):
            finals = sorted(p.name for p in (local / "final").glob("*") if p.is_dir())
            hint = f"; its final models: {', '.join(f'{path}/final/{r}' for r in finals)}" if finals else ""
            raise FileNotFoundError(f"{name}: {path} is a folder without config.json, not a model{hint}")
        return
    if _looks_like_hub_id(path):
        if not _offline() or _in_hub_cache(path):
            return
        raise FileNotFoundError(
            f"{name}: {path} is neither a local folder nor a Hub model in the local cache (offline mode)" + _hint(path)
        )
    raise FileNotFoundError(f"{name}: no {kind} folder at {path}{_hint(path)}")


def _hint(path: str) -> str:
    match = _FINAL.match(path)
    if match is None:
        return " (build tiny offline models with `posttrain tiny --out DIR`, or train one first)"
    run, role = match["run"] or ".", match["role"]
    return f" (`{_PRODUCER[role]}` with run.output_dir={run} writes it when it finishes: run that step first)"


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes")


def _in_hub_cache(repo_id: str) -> bool:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        snapshot_download(repo_id, local_files_only=True)
    except (LocalEntryNotFoundError, ValueError):
        return False
    return True


def _check_data_path(name: str, path: str) -> None:
    """A local file or folder, or something a Hub dataset id could be (no file suffix)."""
    if Path(path).expanduser().exists():
        return
    if _looks_like_hub_id(path) and not Path(path).suffix:
        return
    raise FileNotFoundError(f"{name}: no such file: {path}")


RUN_FILES = ("config.yaml", "metrics.jsonl", "final")  # what a run folder holds once a run started in it


def check_run_dir(run) -> None:
    """A fresh run needs an empty or missing ``output_dir``, or ``overwrite``. ``resume_from=latest``
    that finds no complete checkpoint is a fresh run: a folder holding a run (config.yaml,
    metrics.jsonl or final/) is then refused, never silently started over (``overwrite`` replaces it)."""
    from posttrain.trainers.checkpoint import list_checkpoints

    out = Path(run.output_dir)
    if run.overwrite or not out.is_dir():
        return
    if run.resume_from is not None and (run.resume_from != "latest" or list_checkpoints(out)):
        return
    held = sorted(p.name for p in out.iterdir())
    if run.resume_from == "latest" and (found := [name for name in RUN_FILES if (out / name).exists()]):
        raise ValueError(
            f"run.resume_from=latest: {out} holds a run ({', '.join(found)}) but no checkpoint: nothing to resume "
            "(a run saves checkpoints with run.save_every; final/ is not resumable). Set run.overwrite=true to "
            "replace it with a new run from step 0, or choose another run.output_dir"
        )
    if held:
        raise ValueError(
            f"run.output_dir: {out} already holds a run ({', '.join(held[:4])}{', ...' if len(held) > 4 else ''}); "
            "set run.resume_from=latest to continue it, run.overwrite=true to replace it, "
            "or choose another run.output_dir"
        )


def model_context(path: str) -> int | None:
    """``max_position_embeddings`` of the model at ``path`` (a peft adapter: of its base), None if unknown."""
    from transformers import AutoConfig

    adapter = Path(path) / "adapter_config.json"
    if adapter.is_file():
        path = json.loads(adapter.read_text())["base_model_name_or_path"]
    return getattr(AutoConfig.from_pretrained(path), "max_position_embeddings", None)


def cap_to_context(config) -> None:
    """Cap ``data.max_length`` / ``data.max_prompt_length`` at the context of the models that read the
    rows, saying so: a row longer than the positions a model was trained on is slow and meaningless.

    Offline trainers: prompt + completion <= context. Online trainers (with ``sampling``): prompt +
    ``sampling.max_new_tokens`` <= context, so the prompt limit is context − max_new_tokens."""
    paths = [config.model.path] + [
        section.path
        for f in dataclasses.fields(config)
        if f.name != "model" and isinstance(section := getattr(config, f.name), ModelConfig)
    ]
    contexts = [c for c in (model_context(p) for p in paths) if c is not None]
    if not contexts:
        return
    context, data, notes = min(contexts), config.data, []
    sampling = vars(config).get("sampling")  # online trainers: prompts, then sampled responses
    room = context
    if sampling is not None:
        room = context - sampling.max_new_tokens
        if room < 1:
            raise ValueError(
                f"sampling.max_new_tokens={sampling.max_new_tokens} leaves no room for a prompt in the "
                f"model's context of {context} positions"
            )
    changes = {}
    if sampling is None and (data.max_length is None or data.max_length > context):
        changes["max_length"] = context
    if sampling is not None and data.max_length is not None and data.max_length > room:
        changes["max_length"] = room
    if sampling is not None and (data.max_prompt_length is None or data.max_prompt_length > room):
        changes["max_prompt_length"] = room
    for key, value in changes.items():
        notes.append(f"data.{key}={getattr(data, key)} capped at {value}")
    if notes:
        config.data = dataclasses.replace(data, **changes)
        why = f"the model's context of {context} positions" + (
            f" minus sampling.max_new_tokens={sampling.max_new_tokens}" if sampling is not None else ""
        )
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"[posttrain] {'; '.join(notes)} ({why})", flush=True)
