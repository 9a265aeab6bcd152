"""``posttrain sample``: the candidates people judge, written into a task folder that ``posttrain label`` serves.

    posttrain sample --model runs/sft --data prompts.jsonl --out runs/task --k 4        # rank K answers
    posttrain sample --model runs/sft --model runs/ppo --data held_out.jsonl --out runs/ab   # blind A/B

One model gives K completions per prompt (mode rank, pair or score); two models give one completion each
(mode compare: ``"model": "A"`` then ``"B"``). Prompts are rendered and sampled as training and ``posttrain
eval`` do it: ``load_prompts`` with the model's tokenizer and chat template (the mode the model was trained
with, read from its ``posttrain.json``, unless ``data.chat_template`` is set), ``load_policy`` (a checkpoint,
a run folder's final policy, a LoRA adapter, a GGUF file or ``smollm2``) and the rollout engine seam
(``rollout.engine``: auto picks lean or hf; vllm where it is installed). ``sampling`` comes from ``--config``
(a run folder's config.yaml, a trainer's YAML or a YAML of these settings), then key=value.

Seeded: the same seed, models, prompts and settings write the same candidates.jsonl (model A draws with
``seed``, model B with ``seed + 1``: independent draws, so one checkpoint named twice is an A/A test).

Distinct answers. A ranking row needs distinct, non-empty responses (``data.rows.check_ranking`` refuses a
repeat, ``posttrain rm`` an empty one), so in rank, pair and score mode a completion that is empty or repeats
an earlier one of its prompt is drawn again, for up to ``resample`` more rounds; what still repeats is
dropped, and so is a row left with fewer than two completions. Both counts go to
task.json and the summary. Compare mode keeps what each model wrote, empty or equal.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path

import torch
import yaml

from posttrain.data import DataConfig, PromptExample, load_prompts
from posttrain.errors import UserError
from posttrain.feedback.store import CANDIDATES, LOG, MODES, SETTINGS, write_atomically
from posttrain.models import ModelConfig, is_peft_adapter, load_policy, load_tokenizer
from posttrain.rollout import RolloutConfig, SamplingParams, build_engine, choose_engine

# labelling settings a person may edit in task.json: --force keeps them when it writes the task anew
EDITED_SETTINGS = ("allow_ties", "labellers", "overlap")
# what a training run's config (a run folder's config.yaml, a trainer's YAML) lends a sampling job: its
# sampling section whole, and of the others the fields that decide what a model reads and how it is run
FROM_TRAINING = {
    "sampling": None,
    "data": ("chat_template", "max_prompt_length", "columns"),
    "rollout": ("engine", "dtype", "gpu_memory_utilization", "enforce_eager"),
    "model": ("dtype", "attn_implementation", "trust_remote_code"),
}


@dataclass
class SampleConfig:
    """posttrain sample: candidates for people to judge, from one model (K per prompt) or two (one each)."""

    models: list[str] = field(default_factory=list)
    """One model (K completions per prompt) or two (compare: one completion each, A then B): a checkpoint
    folder, a run folder (its final/policy), a LoRA adapter, a Hub id, a .gguf file or smollm2."""
    mode: str = "rank"
    """What people will do with the candidates: rank, pair or score (one model), compare (two models)."""
    k: int = 4
    """Completions per prompt from one model (>= 2); compare takes one per model."""
    n_prompts: int | None = None
    """Sample for the first N prompts of data.path; null = all."""
    seed: int = 0
    """Seed of the draws: the same seed writes the same candidates (model B draws with seed + 1)."""
    batch_size: int = 16
    """Prompts per generate call."""
    resample: int = 3
    """Rounds of drawing again the completions of a prompt that are empty or repeat an earlier one (rank,
    pair and score need distinct answers); what still repeats after them is dropped."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """How each model is loaded (dtype, device, revision, ...); its path stays empty: ``models`` names them."""
    data: DataConfig = field(default_factory=lambda: DataConfig(max_length=None, max_prompt_length=512))
    """The prompt rows {"prompt", ...}: their other columns go to each row's "meta"."""
    sampling: SamplingParams = field(default_factory=lambda: SamplingParams(max_new_tokens=256))
    """How completions are sampled (temperature 1 by default: K different answers to rank)."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """The engine that samples: auto (lean or hf), hf, lean or vllm (colocated)."""

    def validate(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if not 1 <= len(self.models) <= 2:
            raise ValueError(
                f"--model: one model (K completions per prompt) or two (compare: one each), got {len(self.models)}"
            )
        if (self.mode == "compare") != (len(self.models) == 2):
            raise ValueError(
                "--mode compare needs two --model (A and B)"
                if self.mode == "compare"
                else f"two --model make a compare task (one completion each), not mode {self.mode}"
            )
        if self.mode != "compare" and self.k < 2:
            raise ValueError(f"--k must be >= 2 in {self.mode} mode (people judge several answers), got {self.k}")
        if self.mode == "compare" and self.k != 1:
            raise ValueError(f"--k must be 1 in compare mode (one completion from each model), got {self.k}")
        if self.sampling.temperature == 0 and self.k > 1:
            raise ValueError(
                f"sampling.temperature=0 (greedy) gives the same completion {self.k} times: set a temperature > 0"
            )
        if self.model.path:
            raise ValueError("model.path: name the models with --model (SampleConfig.models); model.* loads them")
        for key in ("n_prompts", "batch_size"):
            if getattr(self, key) is not None and getattr(self, key) < 1:
                raise ValueError(f"{key} must be >= 1, got {getattr(self, key)}")
        if self.resample < 0:
            raise ValueError(f"resample must be >= 0, got {self.resample}")
        if self.rollout.mode != "colocate":
            raise ValueError(
                "rollout.mode=server samples whatever `posttrain vllm-serve` holds, not --model: use rollout.mode="
                "colocate (posttrain sample loads each model itself)"
            )
        self.data.validate("data")
        self.sampling.validate("sampling")
        self.rollout.validate("rollout")

    @property
    def labels(self) -> list[str]:
        """The models' names in the candidates: "policy" for one model, "A" and "B" for two."""
        return ["A", "B"] if self.mode == "compare" else ["policy"]


# --------------------------------------------------------------------------------------------------
# settings
# --------------------------------------------------------------------------------------------------


def settings_from(source: str) -> tuple[dict, list[str]]:
    """(settings dict, the keys taken) of ``--config``: a YAML of ``SampleConfig``'s fields as it is; a training
    run's config (a run folder or a checkpoint folder holding config.yaml, or a trainer's YAML: one with a
    ``run`` section) lends the fields of ``FROM_TRAINING`` only."""
    from posttrain.runtime.config import parse_yaml

    path = Path(source).expanduser()
    if path.is_dir():
        path = path / "config.yaml"
    if not path.is_file():
        raise UserError(f"--config: no YAML file or run folder (with config.yaml) at {source}")
    try:
        loaded = parse_yaml(path.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as err:
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise UserError(f"--config: {path} is not valid YAML: {first}") from None
    if not isinstance(loaded, dict):
        raise UserError(f"--config: {path} must be a YAML mapping")
    if "run" not in loaded:
        return loaded, sorted(loaded)
    taken: dict = {}
    for section, keys in FROM_TRAINING.items():
        values = loaded.get(section)
        if isinstance(values, dict):
            kept = {k: v for k, v in values.items() if keys is None or k in keys}
            if kept:
                taken[section] = kept
    return taken, [f"{s}.{k}" for s, values in taken.items() for k in values]


def run_settings_source(models: list[str]) -> str | None:
    """The run folder whose config.yaml lends its settings when no ``--config`` is given: the one model's, when
    it names a run folder (config.yaml beside final/policy); None otherwise (two models: name it with --config)."""
    if len(models) != 1:
        return None
    folder = Path(models[0]).expanduser()
    run = (folder / "config.yaml").is_file() and (folder / "final" / "policy").is_dir()
    return str(folder) if run else None


def load_sample_config(source: str | None, overrides: list[str]) -> tuple[SampleConfig, list[str], bool]:
    """(validated config, the keys ``source`` lent, whether ``data.chat_template`` was set) from ``--config``
    and key=value ``overrides`` (the CLI's flags come first among them, the user's own last)."""
    from posttrain.runtime.config import apply_override, from_dict

    data, taken = settings_from(source) if source else ({}, [])
    for assignment in overrides:
        apply_override(data, SampleConfig, assignment)
    config = from_dict(SampleConfig, data)
    config.validate()
    return config, taken, "chat_template" in (data.get("data") or {})


def checkpoint_of(path: str) -> str:
    """The model folder ``path`` names: itself, a run folder's final/policy, or a checkpoint's hf/policy."""
    folder = Path(path).expanduser()
    if folder.is_dir() and not any((folder / f).is_file() for f in ("config.json", "adapter_config.json")):
        for inner in (folder / "final" / "policy", folder / "hf" / "policy"):
            if inner.is_dir():
                return str(inner)
    return path


def template_mode(config: SampleConfig, path: str, explicit: bool) -> str:
    """``data.chat_template`` for the model at ``path``: the one set, else the mode the model was trained with
    (its ``posttrain.json``), else ``config``'s default (auto)."""
    from posttrain.models.template_mode import recorded_template_mode

    recorded = None if explicit else (recorded_template_mode(path) or {}).get("data.chat_template")
    return recorded or config.data.chat_template


# --------------------------------------------------------------------------------------------------
# the task folder
# --------------------------------------------------------------------------------------------------


def check_task_folder(out: str, force: bool) -> None:
    """Refuse a folder that already holds candidates (unless ``force``) or any judgement (always: people's
    judgements of the old candidates would be read against new ones)."""
    folder = Path(out).expanduser()
    if folder.exists() and not folder.is_dir():
        raise UserError(f"--out: {out} is a file; a task is a folder")
    judgements = folder / LOG
    if judgements.is_file() and judgements.stat().st_size > 0:
        raise UserError(f"--out: {out} holds judgements ({LOG}) of its candidates; sample into a new folder")
    candidates = folder / CANDIDATES
    if candidates.is_file() and candidates.stat().st_size > 0 and not force:
        raise UserError(f"--out: {out} already holds {CANDIDATES}; choose a new folder, or --force to replace it")


def edited_settings(out: str, log=print) -> dict:
    """The labelling settings (``EDITED_SETTINGS``) of the task.json already in ``out``, which a person may
    have edited: a task written anew (--force) keeps them. {} without one; an unreadable one is said."""
    path = Path(out).expanduser() / SETTINGS
    if not path.is_file():
        return {}
    try:
        old = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        old = None
    if not isinstance(old, dict):
        log(f"[sample] warning: {path} is not a JSON object; its labelling settings are not kept")
        return {}
    return {key: old[key] for key in EDITED_SETTINGS if key in old}


def write_task(out: str, rows: list[dict], task: dict) -> Path:
    """candidates.jsonl and task.json in the folder ``out`` (created); returns the candidates' path."""
    folder = Path(out).expanduser()
    write_atomically(folder / CANDIDATES, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    write_atomically(folder / SETTINGS, json.dumps(task, indent=2, ensure_ascii=False) + "\n")
    return folder / CANDIDATES


# --------------------------------------------------------------------------------------------------
# sampling
# --------------------------------------------------------------------------------------------------


@dataclass
class Draw:
    """One model's completions: ``texts[i]`` those of prompt i, in the order drawn."""

    texts: list[list[str]]
    tokens: int = 0  # tokens generated, resampled ones included
    seconds: float = 0.0  # generation time, model loading excluded
    resampled: int = 0  # completions drawn again (empty, or a repeat of an earlier one of their prompt)
    engine: str = ""
    chat_template: str = ""


def prepare(config: SampleConfig, explicit_template: bool) -> list[SampleConfig]:
    """One config per model, its ``model.path`` the checkpoint (GGUF converted, run folders resolved) and its
    ``data.chat_template`` the model's, every path checked and the lengths capped at the model's context
    (``runtime.inputs.check_inputs``, the trainers' checks) before any model loads."""
    from posttrain.runtime.inputs import check_inputs

    out = []
    for path in config.models:
        one = replace(config, model=replace(config.model, path=checkpoint_of(path)))
        try:
            check_inputs(one)  # a GGUF path becomes the converted checkpoint here
        except (FileNotFoundError, ValueError) as err:
            message = str(err)
            for key, flag in (("model.path:", "--model:"), ("data.path:", "--data:")):
                message = flag + message.removeprefix(key) if message.startswith(key) else message
            raise UserError(message) from None
        if one.rollout.engine == "vllm" and is_peft_adapter(one.model.path):
            raise UserError(
                f"--model {path} is a LoRA adapter, which rollout.engine=vllm does not load: merge it first "
                "(posttrain export RUN --merge-lora --out DIR) or use rollout.engine=auto"
            )
        one.data = replace(one.data, chat_template=template_mode(config, one.model.path, explicit_template))
        out.append(one)
    return out


def draw(config: SampleConfig, label: str, seed: int, prompts_limit: int | None, log=print):
    """(prompts, ``Draw``) of the model ``config.model.path`` (one of ``prepare``'s configs): its prompts
    rendered by its own tokenizer, then ``config.k`` completions each."""
    from posttrain.models.template_mode import warn_template_mismatch

    path = config.model.path
    tokenizer = load_tokenizer(
        config.model.tokenizer_path or path, config.model.revision, config.model.trust_remote_code
    )
    warn_template_mismatch(path, config.data.chat_template, tokenizer, lambda m: log(f"[sample] warning: {m}"))
    prompts, report = load_prompts(config.data, tokenizer)
    prompts = prompts[:prompts_limit]
    log(f"[sample] {label}: {path}; prompts: {report.summary()}; data.chat_template={config.data.chat_template}")
    engine_name = config.rollout.engine
    model = None if engine_name == "vllm" else load_policy(config.model)  # vLLM loads the weights itself
    if engine_name == "auto":
        engine_name, why = choose_engine(model)
        log(f"[sample] rollout.engine=auto: {engine_name} ({why})")
    engine = build_engine(replace(config.rollout, engine=engine_name), model, tokenizer, path, seed)
    distinct = config.mode != "compare"
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):  # the caller's random stream goes on as if nothing was drawn
        torch.manual_seed(seed)
        result = _draw_all(engine, prompts, config, label, distinct)
    result.engine, result.chat_template = engine_name, config.data.chat_template
    return prompts, result


def _draw_all(engine, prompts: list[PromptExample], config: SampleConfig, label: str, distinct: bool) -> Draw:
    """``config.k`` completions per prompt, in batches of ``config.batch_size`` prompts, with a progress bar;
    with ``distinct``, the empty and repeated ones drawn again for up to ``config.resample`` rounds."""
    from tqdm import tqdm

    result = Draw(texts=[[] for _ in prompts])
    bar = tqdm(total=len(prompts) * config.k, desc=f"[sample] {label}", unit="completion")
    start = time.perf_counter()
    _extend(engine, prompts, list(range(len(prompts))), config, config.k, result, distinct, bar)
    for _ in range(config.resample if distinct else 0):
        short = [i for i, texts in enumerate(result.texts) if len(texts) < config.k]
        if not short:
            break
        missing = max(config.k - len(result.texts[i]) for i in short)
        result.resampled += sum(config.k - len(result.texts[i]) for i in short)
        bar.set_postfix_str(f"drawing again for {len(short)} prompts")
        _extend(engine, prompts, short, config, missing, result, distinct, None)
    result.seconds = time.perf_counter() - start
    bar.close()
    return result


def _extend(engine, prompts, which: list[int], config: SampleConfig, n: int, result: Draw, distinct: bool, bar):
    """Draw ``n`` completions for each prompt of ``which`` and append them to ``result.texts`` (with
    ``distinct``, only non-empty ones not seen before for that prompt, up to ``config.k``)."""
    for start in range(0, len(which), config.batch_size):
        chunk = which[start : start + config.batch_size]
        rollout = engine.generate([prompts[i].prompt_ids for i in chunk], config.sampling, n=n)
        result.tokens += int(rollout.response_lengths.sum())
        for row, text in enumerate(rollout.responses):
            texts = result.texts[chunk[row // n]]
            if not distinct:
                texts.append(text)
            elif text.strip() and text not in texts and len(texts) < config.k:
                texts.append(text)
        if bar is not None:
            bar.update(len(rollout))


def candidate_rows(config: SampleConfig, prompts: list[PromptExample], draws: list[Draw]) -> tuple[list[dict], int]:
    """(rows of candidates.jsonl, rows dropped for want of two distinct completions) from each model's draw."""
    rows, dropped = [], 0
    for i, prompt in enumerate(prompts):
        completions = [
            {"text": text, "model": label}
            for label, result in zip(config.labels, draws, strict=True)
            for text in result.texts[i]
        ]
        if len(completions) < 2:  # compare: always two
            dropped += 1
            continue
        rows.append({"id": f"{i:06d}", "prompt": prompt.prompt, "completions": completions, "meta": prompt.columns})
    return rows, dropped


def task_record(config: SampleConfig, names: list[str], draws: list[Draw], prompts: int, rows: int, dropped: int):
    """task.json: what ``posttrain label`` reads (mode, models, seed, k, sampling, allow_ties, labellers,
    overlap, created) and, under "sample", how the candidates were drawn."""
    return {
        "mode": config.mode,
        "models": dict(zip(config.labels, names, strict=True)),
        "seed": config.seed,
        "k": config.k,
        "sampling": dataclasses.asdict(config.sampling),
        "allow_ties": False,
        "labellers": [],
        "overlap": 0.2,
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "sample": {
            "data": config.data.path,
            "prompts": prompts,
            "rows": rows,
            "dropped_rows": dropped,
            "resampled": {label: d.resampled for label, d in zip(config.labels, draws, strict=True)},
            "engine": {label: d.engine for label, d in zip(config.labels, draws, strict=True)},
            "chat_template": {label: d.chat_template for label, d in zip(config.labels, draws, strict=True)},
        },
    }


def sample_candidates(config: SampleConfig, out: str, force: bool = False, explicit_template: bool = False, log=print):
    """Draw the candidates of ``config`` into the task folder ``out`` (candidates.jsonl, task.json); returns a
    summary: rows, path, and per model completions, tokens, seconds. ``explicit_template``: keep
    ``data.chat_template`` as set instead of each model's recorded mode."""
    config.validate()
    check_task_folder(out, force)
    configs = prepare(config, explicit_template)
    prompts, draws = None, []
    for index, (one, label) in enumerate(zip(configs, config.labels, strict=True)):
        mine, result = draw(one, label, config.seed + index, config.n_prompts, log)
        if prompts is not None and [p.prompt for p in mine] != [p.prompt for p in prompts]:
            raise UserError(
                "data: models A and B keep different prompts of the file (one tokenizer drops a row as over-long): "
                "set data.overlong=truncate or a larger data.max_prompt_length"
            )
        prompts = mine
        draws.append(result)
    rows, dropped = candidate_rows(config, prompts, draws)
    if not rows:
        raise UserError(
            f"no prompt kept two distinct non-empty completions after {config.resample} rounds of drawing again: "
            "raise sampling.temperature, sampling.top_k or sampling.max_new_tokens"
        )
    names = [checkpoint_of(m) for m in config.models]
    record = task_record(config, names, draws, len(prompts), len(rows), dropped) | edited_settings(out, log)
    path = write_task(out, rows, record)
    return {
        "mode": config.mode,
        "rows": len(rows),
        "prompts": len(prompts),
        "dropped_rows": dropped,
        "path": str(path),
        "models": {
            label: {
                "completions": sum(map(len, d.texts)),
                "tokens": d.tokens,
                "seconds": d.seconds,
                "resampled": d.resampled,
            }
            for label, d in zip(config.labels, draws, strict=True)
        },
    }


def summary_lines(summary: dict, out: str) -> list[str]:
    """What ``posttrain sample`` prints at the end: rows written and where, each model's speed, what was
    dropped, and the next command."""
    rows, mode, prompts = summary["rows"], summary["mode"], summary["prompts"]
    lines = [f"posttrain sample: {rows} {mode} rows from {prompts} prompts in {summary['path']}"]
    for label, m in summary["models"].items():
        rate = m["tokens"] / m["seconds"] if m["seconds"] > 0 else float("nan")
        again = f"; {m['resampled']} drawn again (empty or repeated)" if m["resampled"] else ""
        lines.append(
            f"  {label}: {m['completions']} completions, {m['tokens']} tokens in {m['seconds']:.1f} s "
            f"({rate:.0f} tokens/s){again}"
        )
    if summary["dropped_rows"]:
        lines.append(f"  {summary['dropped_rows']} prompts dropped: fewer than two distinct non-empty completions")
    lines.append(f"  next: posttrain label {out}")
    return lines
