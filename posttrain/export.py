"""``posttrain export``: a run's final model (or a checkpoint's) as a plain Hugging Face folder with a
model card, optionally LoRA-merged and pushed to the Hub.

    posttrain export runs/sft_tiny --out exported/sft_tiny [--merge-lora] [--push-to-hub user/name]

The folder loads with ``AutoModelForCausalLM.from_pretrained`` (or the reward model's class) and no
posttrain. Without ``--merge-lora`` an adapter stays an adapter (its base path as stored: absolute,
or a Hub id). ``README.md`` names the base model, the method, the data, the key hyper-parameters
and the final metrics, read from the run's ``config.yaml`` and ``metrics.jsonl``.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import shutil
from pathlib import Path

import yaml

KEY_SETTINGS = (
    "optim.lr",
    "optim.scheduler",
    "optim.warmup_steps",
    "run.batch_size",
    "run.max_steps",
    "run.epochs",
    "data.max_length",
    "model.dtype",
    "model.lora",
    "beta",
    "loss_type",
    "kl_coef",
    "clip_eps",
    "num_generations",
    "preset",
    "critic",
    "margin",
)


def find_model(source: str | Path) -> tuple[Path, Path]:
    """(the model folder to export, the run folder) for a run, a checkpoint, or a model folder in either."""
    source = Path(source)
    for models in (source / "final", source / "hf"):
        if models.is_dir():
            roles = sorted(p.name for p in models.iterdir() if p.is_dir())
            role = "policy" if "policy" in roles else roles[0]
            run = source if models.name == "final" else source.parent.parent
            return models / role, run
    if (source / "config.json").is_file() or (source / "adapter_config.json").is_file():
        if source.parent.name == "final":  # <run>/final/<role>
            return source, source.parent.parent
        if source.parent.name == "hf":  # <run>/checkpoints/step-N/hf/<role>
            return source, source.parents[3]
        return source, source
    raise FileNotFoundError(f"{source}: not a run folder (final/), a checkpoint (hf/) or a model folder")


def method_of(config: dict) -> str:
    """The trainer whose config has exactly these sections (config.yaml does not name it)."""
    from posttrain.cli import TRAINERS

    for name, (module, class_name, _) in TRAINERS.items():
        fields = {f.name for f in dataclasses.fields(getattr(importlib.import_module(module), class_name))}
        if fields == set(config):
            return name
    return "unknown"


def export(source: str | Path, out: str | Path, merge_lora: bool = False) -> Path:
    """Write the model of ``source`` to ``out`` with its tokenizer and a model card; returns ``out``."""
    model_dir, run_dir = find_model(source)
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"--out {out} is not empty")
    adapter = (model_dir / "adapter_config.json").is_file()
    if adapter and merge_lora:
        _merge(model_dir, out)
    else:
        shutil.copytree(model_dir, out, dirs_exist_ok=True, ignore=shutil.ignore_patterns("reference"))
    (out / "README.md").write_text(model_card(model_dir, run_dir, adapter, merged=adapter and merge_lora))
    return out


def _merge(adapter_dir: Path, out: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base_path = json.loads((adapter_dir / "adapter_config.json").read_text())["base_model_name_or_path"]
    base = AutoModelForCausalLM.from_pretrained(base_path, dtype="auto")
    merged = PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload()
    merged.save_pretrained(out)
    AutoTokenizer.from_pretrained(adapter_dir).save_pretrained(out)


def model_card(model_dir: Path, run_dir: Path, adapter: bool, merged: bool) -> str:
    """README.md: YAML metadata for the Hub, then base model, method, data, settings and final metrics."""
    config_path = run_dir / "config.yaml"
    config = yaml.safe_load(config_path.read_text()) if config_path.is_file() else {}
    flat = _flatten(config)
    method = method_of(config) if config else "unknown"
    if adapter:
        base = json.loads((model_dir / "adapter_config.json").read_text())["base_model_name_or_path"]
    else:  # as the run was given it: resolved when it is a folder here, else a Hub id
        base = flat.get("model.path", "unknown")
        base = str(Path(base).resolve()) if Path(base).exists() else base
    is_adapter = adapter and not merged
    data = " ".join(f"{k}={flat[k]}" for k in ("data.path", "data.name", "data.split") if flat.get(k))
    lines = [
        "---",
        yaml.safe_dump({"base_model": base, "library_name": "peft" if is_adapter else "transformers"}).strip(),
        f"tags: [posttrain, {method}]",
        "---",
        "",
        f"# {run_dir.name}",
        "",
        f"Trained with posttrain ({method})"
        + (" as a LoRA adapter." if is_adapter else " with LoRA, merged into the base." if merged else "."),
        "",
        f"- base model: `{base}`",
        f"- method: {method}",
        f"- data: `{data or 'unknown'}`",
        "",
        "| setting | value |",
        "| --- | --- |",
        *[f"| {k} | {flat[k]} |" for k in KEY_SETTINGS if flat.get(k) is not None],
    ]
    final, evaluated = _final_metrics(run_dir)
    for title, metrics in (("Final training metrics", final), ("Final evaluation metrics", evaluated)):
        if metrics:
            lines += ["", f"{title} (step {metrics.pop('step')}):", "", "| metric | value |", "| --- | --- |"]
            lines += [f"| {k} | {v:.6g} |" for k, v in sorted(metrics.items())]
    return "\n".join(lines) + "\n"


def _final_metrics(run_dir: Path) -> tuple[dict, dict]:
    """The last record with training metrics and the last with evaluation metrics of metrics.jsonl."""
    path = run_dir / "metrics.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []
    final, evaluated = {}, {}
    for record in records:
        numbers = {k: v for k, v in record.items() if isinstance(v, int | float) and not isinstance(v, bool)}
        if any(k.startswith("eval") for k in numbers):
            evaluated = {k: v for k, v in numbers.items() if k.startswith("eval") or k == "step"}
        if any(not k.startswith("eval") and k != "step" for k in numbers):
            final = {k: v for k, v in numbers.items() if not k.startswith("eval")}
    return final, evaluated


def _flatten(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict) and key != "lora":
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def push_to_hub(folder: Path, repo_id: str) -> str:
    """Upload ``folder`` to the Hub model repository ``repo_id`` (created when missing); returns its URL."""
    from huggingface_hub import HfApi

    api = HfApi()
    api.create_repo(repo_id, exist_ok=True)
    return str(api.upload_folder(folder_path=str(folder), repo_id=repo_id, commit_message="posttrain export"))
