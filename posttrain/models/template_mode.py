"""The chat-template mode a model was trained with, kept beside its weights, and the warning when a
later stage renders prompts otherwise.

Every model folder a trainer saves (``final/<role>``, ``checkpoints/step-N/hf/<role>``) gets
``posttrain.json``: the run's ``data.chat_template`` and whether prompts were rendered through the
tokenizer's chat template. A stage that starts from such a folder (GRPO, PPO, DPO, a reward model, SFT
again, ``posttrain eval``) compares it with its own rendering and prints one warning naming both: a
model trained on plain ``1+2=`` and sampled on ``<|user|>1+2=<|assistant|>`` (or the reverse) reads
prompts it never saw, and nothing said so (``posttrain tiny`` writes a template, ``data.chat_template``
defaults to ``auto``, and every example passes ``never``).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import yaml

INFO_FILE = "posttrain.json"


def renders_with_template(mode: str, tokenizer) -> bool:
    """Whether ``data.chat_template=mode`` renders prompts through ``tokenizer``'s chat template
    (``data.encode.Encoder.use_template``)."""
    return bool(getattr(tokenizer, "chat_template", None)) and mode != "never"


def record_template_mode(output_dir, folder, tokenizer) -> None:
    """Write ``posttrain.json`` into the saved model ``folder``: the chat-template mode of the run in
    ``output_dir`` (its ``config.yaml``) and whether it rendered prompts through the template. Nothing
    when the run has no ``data.chat_template`` (a config without data)."""
    config_path = Path(output_dir) / "config.yaml"
    if not config_path.is_file():
        return
    mode = ((yaml.safe_load(config_path.read_text()) or {}).get("data") or {}).get("chat_template")
    if mode is None:
        return
    info = {"data.chat_template": mode, "rendered_with_template": renders_with_template(mode, tokenizer)}
    (Path(folder) / INFO_FILE).write_text(json.dumps(info, indent=2) + "\n")


def recorded_template_mode(model_path) -> dict | None:
    """The ``posttrain.json`` of a model folder, or None (not a local folder posttrain saved)."""
    path = Path(str(model_path)) / INFO_FILE
    try:
        return json.loads(path.read_text()) if path.is_file() else None
    except (OSError, ValueError):
        return None


def template_mismatch(model_path, mode: str, tokenizer) -> str | None:
    """The warning when the model at ``model_path`` was trained rendering prompts otherwise than
    ``data.chat_template=mode`` does with ``tokenizer``; None when they agree or nothing is recorded."""
    recorded = recorded_template_mode(model_path)
    if recorded is None or "rendered_with_template" not in recorded:
        return None
    now = renders_with_template(mode, tokenizer)
    if bool(recorded["rendered_with_template"]) == now:
        return None

    def how(rendered: bool) -> str:
        return "through the tokenizer's chat template" if rendered else "as plain text, without the chat template"

    was = recorded.get("data.chat_template")
    return (
        f"{model_path} was trained with data.chat_template={was} (prompts {how(not now)}), this run uses "
        f"data.chat_template={mode} (prompts {how(now)}): the model reads prompts rendered as it never saw them; "
        f"set data.chat_template={was} to match"
    )


def warn_template_mismatch(model_path, mode: str, tokenizer, warn: Callable[[str], None]) -> str | None:
    """``warn`` the ``template_mismatch`` line, if any; returns it."""
    message = template_mismatch(model_path, mode, tokenizer)
    if message is not None:
        warn(message)
    return message


def check_stage(accelerator, config, tokenizer, name: str) -> list[str]:
    """The start of a trainer: warn (one line each, main process) when ``model.path`` (and PPO's
    ``reward_model.path``) was trained rendering prompts otherwise than this run's ``data.chat_template``."""
    data, model = getattr(config, "data", None), getattr(config, "model", None)
    if data is None or model is None or not getattr(data, "chat_template", None):
        return []
    paths = [model.path, getattr(getattr(config, "reward_model", None), "path", None)]
    said = []
    for path in (p for p in paths if p):
        message = template_mismatch(path, data.chat_template, tokenizer)
        if message is not None:
            accelerator.print(f"[{name}] warning: {message}")
            said.append(message)
    return said
