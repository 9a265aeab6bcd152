"""Checkpoints: Hugging Face models plus everything needed to continue exactly, written atomically.

Layout of ``<output_dir>/checkpoints/step-000120/``:

    hf/<role>/           save_pretrained of each trained model (and the tokenizer): loads without posttrain;
                         the only copy of the weights, loaded from here on resume (runtime/weights.py)
    state/               accelerate ``save_state``: optimizer, scheduler, RNG states (every process)
    config.yaml          the resolved config of the run that wrote it
    trainer_state.json   step, epoch, the config's hash and the trainer's own state (e.g. the adaptive KL
                         controller); a folder without it is a partial checkpoint and is refused
    manifest.json        {file: size in bytes} of every other file, written last: ``resume_from=latest`` skips a
                         checkpoint whose files no longer match it (a 0-byte model.safetensors or optimizer.bin
                         from a full disk or a torn copy), saying so, for the newest one that matches

A checkpoint resumes only the run that wrote it: the config may differ in the fields of
``RESUMABLE_CHANGES`` alone (how long to train, how often to save and log, where to write), and the
checkpoint's step must be below the run's total. A changed ``run.max_steps`` (or ``run.epochs``)
recomputes the learning-rate schedule for the new length, from the first resumed step on, and the
resumed run says so. Nothing non-finite is ever written: a model with a NaN or inf weight raises
``NonFiniteError`` instead of being saved.

A checkpoint is written under ``.tmp-step-000120``, flushed to disk, then renamed: a process killed
while saving leaves the previous checkpoint as the latest one (docs/pitfalls.md #14). A full disk is said
as such (``DiskFullError``), an unwritable folder too (``UnwritableError``), in one line naming the folder
and what to do (resume only where an older checkpoint exists); the save's temporary folder is removed, the
older checkpoints are kept. At the run's last step the final model (``write_final_model``: no optimizer
state, so it may fit where the checkpoint did not) is written before the error is raised, and the message
says whether it was. Temporary folders a killed save left are removed by the next save.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
from pathlib import Path

import torch
import yaml

from posttrain.errors import UserError
from posttrain.runtime.weights import weights_from_hf, weights_left_to_hf

STATE_FILE = "trainer_state.json"
CONFIG_FILE = "config.yaml"
MANIFEST_FILE = "manifest.json"
_STEP_DIR = re.compile(r"^step-(\d+)$")
_TMP_DIR = re.compile(r"^\.tmp-step-(\d+)$")
_NEVER_EMPTY = (".safetensors", ".bin", ".pt", ".pth", ".pkl")  # weight and state files
RESUMABLE_CHANGES = frozenset(
    {
        "run.max_steps",
        "run.epochs",
        "run.save_every",
        "run.keep_last",
        "run.log_every",
        "run.eval_every",
        "run.resume_from",
        "run.overwrite",
        "run.output_dir",
        "run.progress",
        "run.report_to",
        "run.max_nonfinite_steps",
        "run.keep_freed_memory",
        "log_completions",
    }
)


class IncompleteCheckpointError(UserError, RuntimeError):
    """A checkpoint folder without its trainer_state.json: a save was interrupted."""


class CheckpointNotFoundError(UserError, FileNotFoundError):
    """``run.resume_from`` names no folder."""


class DiskFullError(UserError, OSError):
    """No space left on the device while a checkpoint was written; its partial folder is removed."""


class UnwritableError(UserError, OSError):
    """A checkpoint or the final model could not be written for want of permission (or a read-only file
    system); its partial folder is removed."""


class NonFiniteError(RuntimeError):
    """A non-finite loss, gradient norm or weight: the run stops rather than train on it or save it."""


def flat_config(config: dict, prefix: str = "") -> dict:
    """{dotted key: value} of a nested config dict."""
    out = {}
    for key, value in config.items():
        if isinstance(value, dict) and value:
            out.update(flat_config(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def config_hash(config: dict) -> str:
    """sha256 of the config without the fields a resume may change."""
    kept = {k: v for k, v in flat_config(config).items() if k not in RESUMABLE_CHANGES}
    return hashlib.sha256(json.dumps(kept, sort_keys=True, default=str).encode()).hexdigest()


def check_resumable(path: Path, config: dict, total_steps: int) -> list[str]:
    """Refuse to resume ``path`` with a config that differs outside RESUMABLE_CHANGES (naming the
    fields), or when its step is at or past the run's ``total_steps``. ``config``: the resolved config
    as written to config.yaml. Returns what the run should print about the changes it accepts: a new
    length under a decaying learning-rate schedule changes the rate of every step still to come."""
    state = json.loads((path / STATE_FILE).read_text())
    if state["step"] >= total_steps:
        raise UserError(
            f"run.resume_from: {path} is at step {state['step']}, at or past this run's {total_steps} steps; "
            "raise run.max_steps to train further"
        )
    saved = flat_config(yaml.safe_load((path / CONFIG_FILE).read_text()))
    now = flat_config(config)
    notes = []
    # the run's length: run.max_steps when set, else run.epochs (then data size, unchanged by the hash)
    length = [k for k in ("run.max_steps", "run.epochs") if k in saved and saved[k] != now.get(k)]
    if "run.max_steps" not in length and now.get("run.max_steps"):
        length = []  # only run.epochs changed, and run.max_steps decides the length
    if length and now.get("optim.scheduler", "constant") != "constant":
        changed = ", ".join(f"{k} {saved[k]!r} → {now.get(k)!r}" for k in length)
        notes.append(
            f"{changed}: the {now['optim.scheduler']} learning-rate schedule is recomputed for {total_steps} steps, "
            f"so from step {state['step']} on the rate differs from what the checkpoint's run would have used"
        )
    if state.get("config_hash", config_hash(config)) == config_hash(config):  # checkpoints before the hash: no check
        return notes
    keys = (saved.keys() | now.keys()) - RESUMABLE_CHANGES
    differing = sorted(k for k in keys if saved.get(k) != now.get(k))
    changes = "; ".join(f"{k}: {saved.get(k)!r} in the checkpoint, {now.get(k)!r} now" for k in differing)
    raise UserError(
        f"run.resume_from: {path} was written with a different config ({changes}). A resume may change only "
        f"{', '.join(sorted(RESUMABLE_CHANGES))}; start a new run (another run.output_dir) to change the rest"
    )


def check_finite_weights(accelerator, what: str, state_dicts: dict) -> None:
    """Raise NonFiniteError on every process when a tensor of ``state_dicts`` ({role: state dict}, as
    ``get_state_dict`` gives them: possibly only on the main process, None elsewhere under ZeRO-3) holds a
    NaN or inf. Collective."""
    bad = [
        f"{role}.{key}"
        for role, state_dict in state_dicts.items()
        for key, tensor in (state_dict or {}).items()
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all())
    ]
    flag = accelerator.reduce(torch.tensor(float(len(bad)), device=accelerator.device), reduction="sum")
    if float(flag) > 0:
        raise NonFiniteError(f"{what}: weight {bad[0] if bad else '(on another process)'} is not finite; not written")


def checkpoints_dir(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def list_checkpoints(output_dir: str | Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    root = checkpoints_dir(output_dir)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found) if (p / STATE_FILE).is_file()]


def checkpoint_damage(path: Path) -> str | None:
    """What is wrong with the files of checkpoint ``path`` (None: nothing found). A checkpoint with a
    manifest must hold every file it lists, at its size; one written before manifests existed is only
    checked for empty weight and state files (never valid: a full disk or a torn copy leaves them)."""
    manifest = path / MANIFEST_FILE
    if manifest.is_file():
        try:
            sizes = json.loads(manifest.read_text())["files"]
        except (ValueError, KeyError, TypeError, OSError) as err:
            return f"{MANIFEST_FILE} is unreadable ({err})"
        for name, size in sizes.items():
            file = path / name
            if not file.is_file():
                return f"{name} is missing"
            if file.stat().st_size != size:
                return f"{name} has {file.stat().st_size} bytes, {size} were written"
        return None
    for file in sorted(path.rglob("*")):
        if file.suffix in _NEVER_EMPTY and file.is_file() and not file.stat().st_size:
            return f"{file.relative_to(path)} is empty (0 bytes)"
    return None


def resolve_resume(output_dir: str | Path, resume_from: str | None, say=print) -> Path | None:
    """The checkpoint folder ``resume_from`` names (``latest`` = the newest complete one whose files match
    its manifest: a damaged one is skipped, and ``say`` tells which and why), None for a fresh run."""
    if resume_from is None:
        return None
    if resume_from == "latest":
        found = list_checkpoints(output_dir)
        skipped = []
        for path in reversed(found):
            damage = checkpoint_damage(path)
            if damage is None:
                return path
            skipped.append(f"{path.name} ({damage})")
            say(f"resume_from=latest: checkpoint {path} is damaged: {damage}; skipping it")
        if skipped:
            raise IncompleteCheckpointError(
                f"run.resume_from=latest: every checkpoint in {checkpoints_dir(output_dir)} is damaged: "
                f"{'; '.join(skipped)}. To start the run over, set run.overwrite=true without run.resume_from"
            )
        return None
    path = Path(resume_from)
    if not path.is_dir():
        raise CheckpointNotFoundError(f"run.resume_from: no checkpoint folder at {path}")
    if not (path / STATE_FILE).is_file():
        raise IncompleteCheckpointError(
            f"run.resume_from: {path} has no {STATE_FILE}: it is a partial checkpoint (a save was interrupted)"
        )
    damage = checkpoint_damage(path)
    if damage is not None:
        raise IncompleteCheckpointError(
            f"run.resume_from: {path} is damaged: {damage}; name an older checkpoint, or run.resume_from=latest "
            "takes the newest one that is complete"
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


def _write_manifest(folder: Path) -> None:
    """``manifest.json``: {relative path: size} of every file of ``folder``; the last file a save writes."""
    files = {
        str(p.relative_to(folder)): p.stat().st_size
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != MANIFEST_FILE
    }
    (folder / MANIFEST_FILE).write_text(json.dumps({"files": files}, indent=1))


def is_disk_full(err: BaseException) -> bool:
    """A write that failed for want of space: ENOSPC / EDQUOT, or the messages of torch's stream writer
    (``basic_ios::clear: iostream error``, ``PytorchStreamWriter failed writing file``) and of safetensors
    (``StorageFull``), which carry no errno."""
    for e in (err, err.__cause__, err.__context__):
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        text = str(e) if e is not None else ""
        if any(m in text for m in ("iostream error", "failed writing file", "StorageFull", "No space left on device")):
            return True
    return False


def write_failure(err: BaseException) -> str | None:
    """Why a write failed when the user can fix it: "no space left on device" (``is_disk_full``) or the
    permission error's own words (EACCES, EPERM, EROFS); None for anything else (a bug)."""
    if is_disk_full(err):
        return "no space left on device"
    for e in (err, err.__cause__, err.__context__):
        if isinstance(e, OSError) and e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            return os.strerror(e.errno).lower()
    return None


def _unwritable_error(what: str, failure: str, path: Path, err: BaseException, rest: str) -> OSError:
    """The one-line error of a write of ``what`` to ``path`` that failed for ``failure`` (``write_failure``):
    what the error said, then ``rest`` (what was kept and what to do)."""
    said = str(err).strip().splitlines()[0][:200] if str(err).strip() else type(err).__name__
    full = failure == "no space left on device"
    error = (DiskFullError if full else UnwritableError)(f"{what}: {failure} writing {path} ({said}); {rest}")
    error.errno = errno.ENOSPC if full else errno.EACCES
    return error


def _remove_stale_tmp(root: Path) -> None:
    """Remove the temporary folders of saves that never finished (a killed run's): they hold disk space."""
    if root.is_dir():
        for path in root.iterdir():
            if _TMP_DIR.match(path.name) and path.is_dir():
                shutil.rmtree(path, ignore_errors=True)


def save_checkpoint(
    accelerator,
    output_dir,
    step: int,
    models: dict,
    tokenizer,
    trainer_state: dict,
    keep_last: int,
    per_process=None,
    last: bool = False,
):
    """Write checkpoint ``step`` atomically and keep the newest ``keep_last``. Collective: call on every process.
    ``per_process(folder)``, when given, writes this process's own files into the checkpoint's folder (the
    asynchronous producer's queue) before the manifest lists them. ``last``: the run's last step.

    A full disk (or an unwritable folder) raises ``DiskFullError`` (``UnwritableError``) saying so, with the
    folder, after removing the temporary folder (the older checkpoints stay); at the ``last`` step, after
    writing the final model when it fits (``_unsaved``)."""
    root = checkpoints_dir(output_dir)
    final = root / f"step-{step:06d}"
    tmp = root / f".tmp-step-{step:06d}"
    state_dicts = {role: accelerator.get_state_dict(model) for role, model in models.items()}
    check_finite_weights(accelerator, f"checkpoint step {step}", state_dicts)
    try:
        if accelerator.is_main_process:
            _remove_stale_tmp(root)
            tmp.mkdir(parents=True)
        accelerator.wait_for_everyone()
        with weights_left_to_hf(accelerator, models):
            accelerator.save_state(str(tmp / "state"))
        if per_process is not None:
            per_process(tmp)
        accelerator.wait_for_everyone()  # every process's files are in tmp before the manifest lists them
        failure = None
        if accelerator.is_main_process:
            try:
                _write_main_files(output_dir, tmp, step, models, state_dicts, accelerator, tokenizer, trainer_state)
            except Exception as err:
                failure = err
        # the other processes learn of the main one's failure, or they would wait at the next barrier for ever
        code = _largest(accelerator, 0 if failure is None else 2 if is_disk_full(failure) else 1)
        if failure is not None:
            raise failure
        if code:
            raise OSError(errno.ENOSPC if code == 2 else errno.EIO, f"the main process could not write {tmp}")
    except Exception as err:
        failure = write_failure(err)
        if failure is None:  # left as a killed save leaves it: refused as partial, removed by the next save
            raise
        if accelerator.is_main_process:  # it holds space the user needs back
            shutil.rmtree(tmp, ignore_errors=True)
        final_model = (models, state_dicts, tokenizer) if last else None
        raise _unsaved(accelerator, output_dir, step, tmp, failure, err, final_model) from err
    if accelerator.is_main_process:
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        for old in list_checkpoints(output_dir)[:-keep_last]:
            shutil.rmtree(old)
    accelerator.wait_for_everyone()
    return final


def _unsaved(accelerator, output_dir, step: int, tmp: Path, failure: str, err: BaseException, final) -> OSError:
    """The one-line error of checkpoint ``step``, which could not be written (``failure``), its partial folder
    ``tmp`` removed. ``final``: (models, state dicts, tokenizer) at the run's last step: the final model is
    written first (it needs less space: no optimizer state) and the message says whether it was. What it
    says to do is what can be done: resume only where an older checkpoint exists."""
    kept = [p for p in list_checkpoints(output_dir) if p.name != f"step-{step:06d}"]
    full = failure.startswith("no space")
    fix = "free space there (or lower run.keep_last)" if full else f"make {tmp.parent} writable"
    what = f"checkpoint step {step}{' (the last)' if final else ''}"
    rest, again = "the partial folder was removed", None
    if final is not None:
        try:
            written = write_final_model(accelerator, output_dir, *final)
            rest += f"; the final model was written to {written} (it holds no optimizer state): the training is done"
            again = f"{fix} to keep a resumable checkpoint of the last step"
        except (DiskFullError, UnwritableError) as final_err:
            rest += f", and the final model could not be written either ({final_err})"
    if again is None:
        older = f"the older checkpoints are kept (latest: {kept[-1]})" if kept else "no older checkpoint exists"
        rest += f" and {older}"
        how = "resume with run.resume_from=latest" if kept else "start the run again with run.overwrite=true"
        again = f"{fix} and {how}"
    return _unwritable_error(what, failure, tmp, err, f"{rest}. {again[0].upper()}{again[1:]}")


def write_final_model(accelerator, output_dir, models: dict, state_dicts: dict, tokenizer) -> Path:
    """``<output_dir>/final/<role>``: each role's Hugging Face folder with the tokenizer, from ``state_dicts``
    (``get_state_dict``'s, checked finite); the main process writes, the others wait. A full disk or an
    unwritable folder raises ``DiskFullError`` / ``UnwritableError`` in one line, the partial folders removed."""
    from posttrain.models.template_mode import record_template_mode

    final = Path(output_dir) / "final"
    if accelerator.is_main_process:
        try:
            for role, model in models.items():
                accelerator.unwrap_model(model).save_pretrained(final / role, state_dict=state_dicts[role])
                tokenizer.save_pretrained(final / role)
                record_template_mode(output_dir, final / role, tokenizer)  # data.chat_template, for later stages
        except Exception as err:
            failure = write_failure(err)
            if failure is None:
                raise
            for written in list(models)[: list(models).index(role) + 1]:  # the roles this call wrote to
                shutil.rmtree(final / written, ignore_errors=True)
            removed = "the partial folder was removed"
            raise _unwritable_error("final model", failure, final / role, err, removed) from err
    accelerator.wait_for_everyone()
    return final


def _write_main_files(output_dir, tmp: Path, step: int, models, state_dicts, accelerator, tokenizer, trainer_state):
    """The main process's part of a checkpoint: each role's Hugging Face folder, the config, the trainer
    state and, last, the manifest."""
    from posttrain.models.template_mode import record_template_mode

    for role, model in models.items():
        accelerator.unwrap_model(model).save_pretrained(tmp / "hf" / role, state_dict=state_dicts[role])
        tokenizer.save_pretrained(tmp / "hf" / role)
        record_template_mode(output_dir, tmp / "hf" / role, tokenizer)  # data.chat_template, for later stages
    config = yaml.safe_load((Path(output_dir) / CONFIG_FILE).read_text())
    shutil.copyfile(Path(output_dir) / CONFIG_FILE, tmp / CONFIG_FILE)
    state = {"step": step, "config_hash": config_hash(config), **trainer_state}
    (tmp / STATE_FILE).write_text(json.dumps(state, indent=2))
    _write_manifest(tmp)
    _fsync_tree(tmp)


def _largest(accelerator, code: int) -> int:
    """The largest ``code`` over the processes (collective; the code itself with one process)."""
    if accelerator.num_processes == 1:
        return code
    import torch.distributed as dist

    value = torch.tensor([code], device=accelerator.device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return int(value.item())


def load_checkpoint(accelerator, path: Path) -> dict:
    """Restore models, optimizer, scheduler and RNG states from ``path``; returns its trainer state."""
    if not (path / STATE_FILE).is_file():
        raise IncompleteCheckpointError(f"{path} has no {STATE_FILE}: it is a partial checkpoint")
    with weights_from_hf(accelerator, path):
        accelerator.load_state(str(path / "state"))
    _rates_from_schedules(accelerator)
    return {**json.loads((path / STATE_FILE).read_text()), "checkpoint": str(path)}


def _rates_from_schedules(accelerator) -> None:
    """Set each optimizer's learning rate from its schedule at the restored step.

    ``load_state`` restores the rate the checkpoint's run had set for its next step, from that run's
    schedule; a run resumed with another length (``run.max_steps``, ``run.epochs``) has another
    schedule, and its first step took the old rate (0 when the old run had ended on a linear decay).
    With an unchanged length this writes the same numbers back.
    """
    # the trainers register their schedulers with accelerate for checkpointing (accelerate's own lists)
    for wrapped in [*accelerator._schedulers, *accelerator._custom_objects]:
        scheduler = getattr(wrapped, "scheduler", wrapped)  # a prepared one is an AcceleratedScheduler
        if not isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR):
            continue
        step = scheduler.last_epoch
        rates = [base * f(step) for base, f in zip(scheduler.base_lrs, scheduler.lr_lambdas, strict=True)]
        for group, rate in zip(scheduler.optimizer.param_groups, rates, strict=True):
            group["lr"] = rate
        scheduler._last_lr = rates
