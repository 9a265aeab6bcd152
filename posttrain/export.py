"""``posttrain export``: a run's final model (or a checkpoint's) as a plain Hugging Face folder with a
model card, optionally LoRA-merged and pushed to the Hub.

    posttrain export runs/sft_tiny --out exported/sft_tiny [--merge-lora] [--push-to-hub user/name]

The folder loads with ``AutoModelForCausalLM.from_pretrained`` (or the reward model's class) and no
posttrain. Without ``--merge-lora`` an adapter stays an adapter (its base path as stored: absolute,
or a Hub id). ``README.md`` names the base model (in the Hub metadata only when it is a Hub id), the method, the
data, the key hyper-parameters and the metrics of the exported weights (a checkpoint: the last
training record at or before its step and that step's evaluation), read from the run's
``config.yaml`` and ``metrics.jsonl``.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import shutil
from pathlib import Path

import yaml

from posttrain.data.hub import FILE_SUFFIXES
from posttrain.runtime.checkpoint import STATE_FILE
from posttrain.runtime.metrics import read_metrics

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
    from posttrain.trainers import TRAINERS

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
    """The adapter merged into its base: a causal LM (task CAUSAL_LM, or none), or for a reward model
    (task SEQ_CLS, what ``posttrain rm`` with ``model.lora`` writes) a one-label
    *ForSequenceClassification whose ``score`` head is the trained one the adapter keeps in
    ``modules_to_save`` (a causal LM would drop it)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    from posttrain.errors import UserError
    from posttrain.models import peft_wrapping

    adapter = json.loads((adapter_dir / "adapter_config.json").read_text())
    base_path, task = adapter["base_model_name_or_path"], adapter.get("task_type") or "CAUSAL_LM"
    if task == "SEQ_CLS":
        base = AutoModelForSequenceClassification.from_pretrained(base_path, dtype="auto", num_labels=1)
        if base.config.pad_token_id is None:  # as posttrain's reward models read it (models.load_scalar_model)
            base.config.pad_token_id = base.config.eos_token_id
    elif task == "CAUSAL_LM":
        base = AutoModelForCausalLM.from_pretrained(base_path, dtype="auto")
    else:
        raise UserError(
            f"--merge-lora: {adapter_dir} is a {task} adapter; posttrain merges CAUSAL_LM (policies) and SEQ_CLS "
            "(reward models) adapters only; export it without --merge-lora"
        )
    with peft_wrapping():
        merged = PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload()
    merged.save_pretrained(out)
    AutoTokenizer.from_pretrained(adapter_dir).save_pretrained(out)


def model_card(model_dir: Path, run_dir: Path, adapter: bool, merged: bool) -> str:
    """README.md: YAML metadata for the Hub, then base model, method, data, settings and the metrics of
    the exported weights (a checkpoint's step, or the final step)."""
    config_path = run_dir / "config.yaml"
    config = yaml.safe_load(config_path.read_text()) if config_path.is_file() else {}
    flat = _flatten(config)
    method = method_of(config) if config else "unknown"
    if adapter:
        base = json.loads((model_dir / "adapter_config.json").read_text())["base_model_name_or_path"]
    else:  # as the run was given it: resolved when it is a folder here, else a Hub id
        base = flat.get("model.path", "unknown")
        base = str(Path(base).resolve()) if Path(base).exists() else base
    hub_base = hub_model_id(base)
    is_adapter = adapter and not merged
    data_keys = ("data.path",) if str(flat.get("data.path", "")).endswith(FILE_SUFFIXES) else _DATA_KEYS
    data = " ".join(f"{k}={flat[k]}" for k in data_keys if flat.get(k))
    step = checkpoint_step(model_dir)
    trained, evaluated = metrics_at(run_dir, step)
    if step is None:
        weights = "the final model" + (f" (step {trained['step']})" if trained else "")
    else:
        weights = f"the checkpoint of step {step}"
        weights += f" (last metrics logged at step {trained['step']})" if trained and trained["step"] != step else ""
    metadata = {"base_model": hub_base} if hub_base else {}  # the Hub's base_model is a model id, never a path
    metadata["library_name"] = "peft" if is_adapter else "transformers"
    lines = [
        "---",
        yaml.safe_dump(metadata, sort_keys=False).strip(),
        f"tags: [posttrain, {method}]",
        "---",
        "",
        f"# {run_dir.name}",
        "",
        f"Trained with posttrain ({method})"
        + (" as a LoRA adapter." if is_adapter else " with LoRA, merged into the base." if merged else "."),
        "",
        f"- base model: {_named_base(base, hub_base)}",
        f"- method: {method}",
        f"- data: `{data or 'unknown'}`",
        f"- weights: {weights}",
        "",
        "| setting | value |",
        "| --- | --- |",
        *[f"| {k} | {flat[k]} |" for k in KEY_SETTINGS if flat.get(k) is not None],
    ]
    final = "Final " if step is None else ""
    for title, metrics in ((f"{final}training metrics", trained), (f"{final}evaluation metrics", evaluated)):
        if metrics:
            title = f"{title[0].upper()}{title[1:]} (step {metrics.pop('step')}):"
            lines += ["", title, "", "| metric | value |", "| --- | --- |"]
            lines += [f"| {k} | {v:.6g} |" for k, v in sorted(metrics.items())]
    return "\n".join(lines) + "\n"


_DATA_KEYS = ("data.path", "data.name", "data.split")  # name and split mean something for Hub datasets only


def _named_base(base: str, hub_base: str | None) -> str:
    """The base model as the user named it. A folder converted from a GGUF file (its posttrain_import.json;
    ``model.path=smollm2`` trains from such a folder in posttrain's cache) is named by that file, or by the
    package name it was given as (``smollm2``), never by the cache folder."""
    from posttrain.models.gguf import PACKAGED

    record = Path(base) / "posttrain_import.json"
    if hub_base or not record.is_file():
        return f"`{base}`" + ("" if hub_base else " (a local folder, not a Hub model)")
    source = Path(json.loads(record.read_text())["source"])
    model = source.name.removesuffix(".gguf").rsplit(".", 1)[0]  # SmolLM2-135M-Instruct.Q4_1.gguf: the model
    for name, (package, filename, install) in PACKAGED.items():
        if (source.parent.name, source.name) == (package, filename):
            return f"`{name}` ({model}, the GGUF file of the {install} package, dequantised to float32)"
    return f"`{source}` ({model}, a GGUF file dequantised to float32)"


def hub_model_id(base: str) -> str | None:
    """``base`` when it names a Hugging Face Hub model (what the model card's ``base_model`` holds),
    None for a local folder: one that exists here, or a name the Hub cannot hold (``runs/tiny/policy``,
    an absolute path) or that is neither ``org/name`` nor in the local Hub cache."""
    from huggingface_hub import try_to_load_from_cache
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if Path(base).expanduser().exists():
        return None
    try:
        validate_repo_id(base)
    except HFValidationError:
        return None
    return base if "/" in base or isinstance(try_to_load_from_cache(base, "config.json"), str) else None


def checkpoint_step(model_dir: Path) -> int | None:
    """The step of the checkpoint ``model_dir`` (``<run>/checkpoints/step-N/hf/<role>``) belongs to; None
    for a final model or a bare model folder."""
    state = model_dir.parent.parent / STATE_FILE
    if model_dir.parent.name != "hf" or not state.is_file():
        return None
    return int(json.loads(state.read_text())["step"])


def metrics_at(run_dir: Path, step: int | None) -> tuple[dict, dict]:
    """({step, training metric: value} of the last record at or before ``step`` with training metrics,
    {step, eval/...: value} logged at that step, if any), from the run's metrics.jsonl; ``step`` None:
    the run's last step. ``time`` (seconds since the start) is no training metric."""
    records = read_metrics(run_dir) if (run_dir / "metrics.jsonl").is_file() else []
    records = [r for r in records if step is None or r["step"] <= step]
    trained, evaluated = {}, {}
    for record in records:
        numbers = {k: v for k, v in record.items() if isinstance(v, int | float) and not isinstance(v, bool)}
        if any(not k.startswith("eval/") and k not in ("step", "time") for k in numbers):
            trained = {k: v for k, v in numbers.items() if not k.startswith("eval/") and k != "time"}
    last = step if step is not None else max((r["step"] for r in records), default=None)
    for record in records:
        if record["step"] == last and any(k.startswith("eval/") for k in record):
            evaluated.update({k: v for k, v in record.items() if k.startswith("eval/") and isinstance(v, int | float)})
    return trained, ({"step": last, **evaluated} if evaluated else {})


def _flatten(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict) and key != "lora":
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


HUB_CHECK_SECONDS = 10.0
"""How long ``check_hub_access`` waits for the Hub to say who the token belongs to."""


def check_hub_access(folder: Path, timeout: float = HUB_CHECK_SECONDS) -> str:
    """The Hub user the token belongs to; else ``UserError`` in one line (offline mode, no token, a token
    the Hub refuses, or no answer within ``timeout`` seconds), naming ``folder``, which stays written.
    Before any upload: without a token or a network, huggingface_hub's own upload retries for most of a
    minute and ends in a traceback."""
    import threading

    import huggingface_hub
    from huggingface_hub import constants

    from posttrain.errors import UserError

    kept = f"the exported folder {folder} is written; upload it later with `hf upload REPO {folder}`"
    offline = os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE") or constants.HF_HUB_OFFLINE
    if offline:
        raise UserError(f"--push-to-hub: HF_HUB_OFFLINE is set, so nothing can be uploaded; {kept}")
    token = huggingface_hub.get_token()
    if not token:
        raise UserError(f"--push-to-hub: no Hugging Face token (run `hf auth login` or set HF_TOKEN); {kept}")
    answer: dict = {}

    def ask() -> None:
        try:
            answer["user"] = huggingface_hub.HfApi().whoami(token=token)
        except Exception as err:  # HTTP 401, no connection, DNS: said in one line below
            answer["error"] = err

    worker = threading.Thread(target=ask, daemon=True)
    worker.start()
    worker.join(timeout)
    if worker.is_alive():
        raise UserError(f"--push-to-hub: the Hub did not answer within {timeout:g} s (no network?); {kept}")
    if "error" in answer:
        err = answer["error"]
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise UserError(f"--push-to-hub: the Hub refused the token or could not be reached ({first}); {kept}")
    return str(answer["user"].get("name", "?"))


def push_to_hub(folder: Path, repo_id: str) -> str:
    """Upload ``folder`` to the Hub model repository ``repo_id`` (created when missing); returns its URL.
    The token and the Hub's reachability are checked first (``check_hub_access``)."""
    from huggingface_hub import HfApi

    check_hub_access(folder)
    api = HfApi()
    api.create_repo(repo_id, exist_ok=True)
    return str(api.upload_folder(folder_path=str(folder), repo_id=repo_id, commit_message="posttrain export"))
