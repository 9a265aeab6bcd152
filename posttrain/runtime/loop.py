"""The plumbing every trainer shares, written once: accelerate, data order, the optimizer step with
globally normalised gradient accumulation, evaluation, logging and checkpoints.

Loss normalisation (docs/pitfalls.md #1): a task returns the *sum* of its per-unit losses over a
micro-batch (units are completion tokens for SFT, pairs for DPO, rankings for reward models) and the
number of units. Before the first micro-batch the loop knows the step's global unit count N (all
micro-batches, all processes); ``backward_share`` back-propagates each micro-batch's loss as its share
of the mean over those N units. One optimizer step is then the gradient of the mean over all units of
the step, whatever the split into micro-batches, accumulation steps or processes. The online trainers
(``online.MinibatchUpdate``) normalise through the same function.

Data order: step k of epoch e reads positions [k·B, (k+1)·B) of a permutation drawn from
``seed + e``. The position in the data is therefore a function of the step alone, and a resumed run
reads exactly the batches an uninterrupted one would (docs/pitfalls.md #13).
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import shutil
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
import yaml

from posttrain.data import rendered
from posttrain.errors import UserError
from posttrain.models import load_tokenizer
from posttrain.runtime import engines
from posttrain.runtime.checkpoint import (
    CONFIG_FILE,
    NonFiniteError,
    check_finite_weights,
    check_resumable,
    list_checkpoints,
    load_checkpoint,
    resolve_resume,
    save_checkpoint,
    write_final_model,
)
from posttrain.runtime.config import OptimConfig, RunConfig, to_dict
from posttrain.runtime.inputs import RECORD_FILES, check_batch_split, check_inputs, never_stepped
from posttrain.runtime.metrics import MetricsLogger, read_metrics
from posttrain.runtime.runlock import LOCK_FILE
from posttrain.runtime.signals import handles_stop_signals, stop_if_signalled


class Task(Protocol):
    """What a trainer plugs into the loop. A task with a ``timer`` attribute gets the loop's
    ``PhaseTimer`` there and times its own phases inside ``loss`` (DPO: ``reference``); the loop times
    ``train`` around them. A task with a ``begin_step(accelerator, model, batches, counted)`` method gets
    every micro-batch of the step (of an evaluation) before any ``loss``: a quantity of the whole batch
    of every process, computed once, whatever the micro-batches (KTO's reference point z0); ``counted``
    says which batches hold examples (an evaluation repeats one where a collective forward needs it)."""

    def collate(self, examples: list) -> Any: ...

    def count(self, batch) -> int:
        """Loss units in ``batch`` (tokens, pairs, rankings): the denominator of the step's mean."""

    def loss(self, model, batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(Σ of the per-unit losses over the batch, {metric: sum}) — sums, so micro-batches add up.

        ``model`` is the trained model as accelerate prepared it (DDP/FSDP-wrapped): the forward must go
        through the wrapper, or data-parallel gradients are never synchronised."""

    def finalize(self, sums: dict[str, float], count: int) -> dict[str, float]:
        """Metrics of a step or an evaluation from the summed values."""


class PhaseTimer:
    """Wall time per phase of a step (generate, old_logprobs, reference, reward, values, train), summed
    until read. Phases nest: an inner phase's time counts for it alone (DPO's reference forward inside
    the training phase), so the phases and ``time/other`` add up to the step."""

    def __init__(self):
        self.seconds: dict[str, float] = defaultdict(float)
        self._open: list[list] = []  # [phase, when it last resumed] of the phases entered, innermost last

    @contextlib.contextmanager
    def __call__(self, phase: str):
        now = time.perf_counter()
        if self._open:  # the enclosing phase pauses
            outer = self._open[-1]
            self.seconds[outer[0]] += now - outer[1]
        self._open.append([phase, now])
        try:
            yield
        finally:
            end = time.perf_counter()
            inner = self._open.pop()
            self.seconds[inner[0]] += end - inner[1]
            if self._open:
                self._open[-1][1] = end

    def read(self, step_seconds: float) -> dict[str, float]:
        """time/<phase> of the phases that ran, time/other = the rest of the step (advantages, metrics,
        host transfers), and time/step: the parts add up to the step."""
        out = {f"time/{k}": v for k, v in self.seconds.items()}
        out["time/other"] = step_seconds - sum(self.seconds.values())
        out["time/step"] = step_seconds
        self.seconds.clear()
        return out


@dataclass
class StepSchedule:
    """Which examples each step reads."""

    num_examples: int
    batch_size: int
    seed: int

    @property
    def steps_per_epoch(self) -> int:
        return self.num_examples // self.batch_size

    def indices(self, step: int) -> list[int]:
        epoch, k = divmod(step, self.steps_per_epoch)
        order = torch.randperm(self.num_examples, generator=torch.Generator().manual_seed(self.seed + epoch))
        return order[k * self.batch_size : (k + 1) * self.batch_size].tolist()


def offline_reference(config, policy, accelerator):
    """DPO's and KTO's frozen reference (``config.reference``, ``reference_path``), or None where
    ``reference=precompute`` lets the starting policy compute the one pass itself: a separate model is built
    for that pass only when ``reference_path`` names one, or under ZeRO-3 (the policy may be sharded already,
    and only a prepared engine runs a sharded forward); it is dropped after the pass."""
    if not (config.reference_path or config.reference != "precompute" or engines.zero_stage(accelerator) == 3):
        return None
    share = "copy" if config.reference == "precompute" else config.reference  # precompute: a copy, for one pass
    return engines.build_reference(accelerator, policy, config.model, share, config.reference_path)


def precompute_pass(
    examples: list, micro_batch_size: int, store: Callable[[list], None], desc: str, show: bool
) -> None:
    """``store(chunk)`` over ``examples``, ``micro_batch_size`` at a time and without gradients, with a
    progress bar: one pass of a real model over a data set (DPO's and KTO's precomputed reference)
    takes minutes on a CPU, and said nothing while it ran."""
    from tqdm.auto import tqdm

    with tqdm(total=len(examples), desc=desc, unit="example", disable=not show, leave=False) as bar:
        for i in range(0, len(examples), micro_batch_size):
            chunk = examples[i : i + micro_batch_size]
            with torch.no_grad():
                store(chunk)
            bar.update(len(chunk))


def split_train_eval(examples: list, eval_fraction: float, seed: int) -> tuple[list, list]:
    """A seeded shuffle, then the last ``eval_fraction`` of it held out."""
    if eval_fraction <= 0:
        return examples, []
    order = torch.randperm(len(examples), generator=torch.Generator().manual_seed(seed)).tolist()
    n_eval = max(1, int(round(len(examples) * eval_fraction)))
    return [examples[i] for i in order[:-n_eval]], [examples[i] for i in order[-n_eval:]]


def build_accelerator(run: RunConfig):
    """The accelerator of a run: plain, DDP, or DeepSpeed / FSDP2 when launched with their config (``engines``)."""
    return engines.build_accelerator(run)


def build_optimizer(params, optim: OptimConfig, total_steps: int):
    """AdamW and a warm-up + (constant | linear | cosine) schedule as a LambdaLR.

    The fused AdamW kernel (one pass over all tensors: several times faster than foreach on the tiny
    bench model's CPU step, bench/README.md) whenever every parameter is a float tensor on a CPU or CUDA
    device.
    """
    params = list(params)
    fused = all(p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in params)
    optimizer = torch.optim.AdamW(
        params,
        lr=optim.lr,
        betas=(optim.adam_beta1, optim.adam_beta2),
        eps=optim.adam_eps,
        weight_decay=optim.weight_decay,
        fused=fused or None,
    )

    def factor(step: int) -> float:
        if step < optim.warmup_steps:
            return (step + 1) / (optim.warmup_steps + 1)
        progress = (step - optim.warmup_steps) / max(1, total_steps - optim.warmup_steps)
        if optim.scheduler == "linear":
            return max(0.0, 1.0 - progress)
        if optim.scheduler == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
        return 1.0

    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def write_resolved_config(output_dir: str | Path, config) -> None:
    Path(output_dir).mkdir(parents=True, exist_ok=True)
    (Path(output_dir) / "config.yaml").write_text(yaml.safe_dump(to_dict(config), sort_keys=False))


@dataclass
class Trainable:
    """The model the optimizer updates, and the roles saved in checkpoints ({role: model})."""

    model: torch.nn.Module
    saved: dict[str, torch.nn.Module]


def backward_share(accelerator, model, loss: torch.Tensor, local_units: float, global_units: float) -> float:
    """Back-propagate a micro-batch's ``loss`` — its mean over its ``local_units`` loss units — as its share
    of the mean over all ``global_units`` units of the step (``loss_share``). Returns the share (the
    micro-batch's weight in the step's means)."""
    weight = loss_share(accelerator, local_units, global_units)
    engines.backward(accelerator, model, loss * weight)  # ``model``: the prepared one (a DeepSpeed engine steps itself)
    return weight


def loss_share(accelerator, local_units: float, global_units: float) -> float:
    """The factor that makes a micro-batch's loss — its mean over its ``local_units`` loss units — its share
    of the mean over all ``global_units`` units of the step (every micro-batch of every process):

        ∇ (loss · local_units · world / global_units)

    × world because DDP (and ZeRO) average the gradients of the processes. Summed over micro-batches and
    processes, the gradient is that of the global mean, whatever the split into micro-batches,
    accumulation steps or processes (docs/pitfalls.md #1). The one loss normalisation of every trainer:
    ``run_offline`` (SFT, RM, DPO) through ``backward_share``, the online trainers (PPO, GRPO, online DPO,
    distillation) through ``online.MinibatchUpdate``.
    """
    return float(local_units) * accelerator.num_processes / max(float(global_units), 1.0)


@dataclass
class OfflineRun:
    """An offline trainer's start (``begin_offline``): the accelerator, the tokenizer, the examples split
    (seeded) into the training and the held-out ones, and the data set's report (returned with the results)."""

    accelerator: Any
    tokenizer: Any
    train_examples: list
    eval_examples: list
    report: Any


def begin_offline(config, name: str, load: Callable[[Any, Any], tuple[list, Any]], first: str) -> OfflineRun:
    """What every offline trainer (SFT, RM, DPO, KTO) does first, in this order: the config checked
    (``validate``, ``check_inputs``: before anything loads; it may cap ``config.data``'s lengths), the
    accelerator, the seed, the tokenizer, the data (``load(config.data, tokenizer)`` -> (examples, report))
    with its report and its first example as the model reads it printed (``first``: the words before it),
    then the training / held-out split."""
    config.validate()
    check_inputs(config)
    accelerator = build_accelerator(config.run)
    torch.manual_seed(config.run.seed)
    tokenizer = load_tokenizer(config.model.tokenizer_path or config.model.path)
    examples, report = load(config.data, tokenizer)
    accelerator.print(f"[{name}] data: {report.summary()}")
    if examples:
        accelerator.print(f"[{name}] {first}: {rendered(tokenizer, examples[0])}")
    train_examples, eval_examples = split_train_eval(examples, config.data.eval_fraction, config.run.seed)
    return OfflineRun(accelerator, tokenizer, train_examples, eval_examples, report)


@handles_stop_signals  # SIGTERM / SIGINT: the step finishes, a checkpoint is saved, exit 143 / 130
def run_offline(
    task: Task,
    trainable: Trainable,
    start: OfflineRun,
    config,
    callbacks: list[Callable[[int, dict], None]] = (),
    bar_keys: tuple[str, ...] = ("loss",),
) -> dict:
    """Train ``trainable.model`` on ``task``; returns {"final_metrics", "eval_metrics", "data_report", ...}."""
    run: RunConfig = config.run
    accelerator, tokenizer = start.accelerator, start.tokenizer
    train_examples, eval_examples = start.train_examples, start.eval_examples
    per_process, micro = _per_process_batch(config, accelerator.num_processes)
    schedule = StepSchedule(len(train_examples), run.batch_size, run.seed)
    if schedule.steps_per_epoch < 1:
        raise UserError(f"run.batch_size={run.batch_size} is larger than the {len(train_examples)} training examples")
    total_steps = run.max_steps or max(1, math.ceil(run.epochs * schedule.steps_per_epoch))

    model, optimizer, scheduler, saved, state, logger = _start_offline(
        accelerator, trainable, config, tokenizer, total_steps, per_process, micro
    )
    guard = NonFiniteGuard(accelerator, run, model=next(iter(trainable.saved)))
    metrics: dict[str, float] = {}
    eval_metrics: dict[str, float] = {}
    timer = PhaseTimer()
    if hasattr(task, "timer"):
        task.timer = timer
    model.train()
    for step in range(0 if state is None else state["step"], total_steps):
        t0 = time.perf_counter()
        indices = schedule.indices(step)[accelerator.process_index * per_process :][:per_process]
        batches = [
            task.collate([train_examples[i] for i in indices[j : j + micro]]) for j in range(0, per_process, micro)
        ]
        with timer("train"):  # forward, backward, clipping, the optimizer (a task's own phases apart)
            totals, step_loss = accumulate_gradients(accelerator, task, model, batches)
            lr = scheduler.get_last_lr()[0]  # the rate this update uses (after the step it is the next one's)
            grad_norm = optimizer_step(
                accelerator, model, optimizer, scheduler, config.optim.max_grad_norm, guard, step + 1, step_loss
            )
        done, seconds = step + 1, time.perf_counter() - t0
        metrics = {
            **task.finalize(*totals),
            "lr": lr,
            "grad_norm": grad_norm,
            "tokens_per_s": totals[0]["tokens"] / seconds,
            "samples_per_s": run.batch_size / seconds,
            **timer.read(seconds),
            "epoch": done / schedule.steps_per_epoch,
            "train/nonfinite_skips": guard.skips,
        }
        record = dict(metrics)
        evaluated = bool(eval_examples) and (done == total_steps or bool(run.eval_every) and done % run.eval_every == 0)
        if evaluated:  # into the step's record, the last step's too: one record per step
            eval_metrics = _evaluate_into(record, accelerator, task, model, eval_examples, micro, timer)
        if done % run.log_every == 0 or done == total_steps or evaluated:
            logger.log(done, record, bar_keys)
        logger.advance()
        save = functools.partial(
            save_checkpoint, accelerator, run.output_dir, done, saved, tokenizer, {"epoch": metrics["epoch"]},
            run.keep_last, last=done == total_steps,  # at the last step a full disk still writes final/
        )
        due = checkpoint_due(run, done, total_steps)
        if due:
            save()
        for callback in callbacks:
            callback(done, record)
        stop_if_signalled(accelerator, Path(run.output_dir).name, run.output_dir, done, total_steps, due, save, logger)

    logger.close()
    save_final(accelerator, run.output_dir, saved, tokenizer)
    engines.release_freed_memory()
    return {
        "final_metrics": metrics,
        "eval_metrics": eval_metrics,
        "output_dir": run.output_dir,
        "steps": total_steps,
        "processes": accelerator.num_processes,
        "data_report": start.report.summary(),
    }


def _start_offline(
    accelerator, trainable: Trainable, config, tokenizer, total_steps: int, per_process: int, micro: int
):
    """(model, optimizer, scheduler, saved roles, resumed state or None, logger) of an offline run: AdamW and
    its schedule, the training engine, the run folder (fresh or resumed) and the start-of-run checks."""
    run: RunConfig = config.run
    optimizer, scheduler = build_optimizer(
        [p for p in trainable.model.parameters() if p.requires_grad], config.optim, total_steps
    )
    engines.configure(accelerator, micro, per_process // micro, config.optim.max_grad_norm)
    model, optimizer = engines.prepare(accelerator, trainable.model, optimizer)
    accelerator.register_for_checkpointing(scheduler)
    saved = {role: (model if m is trainable.model else m) for role, m in trainable.saved.items()}
    state, logger = start_run(accelerator, config, total_steps, Path(run.output_dir).name)
    from posttrain.models.template_mode import check_stage

    check_stage(accelerator, config, tokenizer, Path(run.output_dir).name)  # a checkpoint of another template mode
    accelerator.print(f"[{Path(run.output_dir).name}] training engine: {engines.describe(accelerator)}")
    return model, optimizer, scheduler, saved, state, logger


def _evaluate_into(record: dict, accelerator, task, model, eval_examples: list, micro: int, timer) -> dict:
    """The held-out metrics, added to the step's ``record`` with ``time/eval`` (after the step: not part of
    ``time/step``); returns them."""
    t_eval = time.perf_counter()
    eval_metrics = evaluate_offline(accelerator, task, model, eval_examples, micro)
    timer.seconds.clear()  # the task's phases inside the evaluation belong to time/eval
    record.update(eval_metrics)
    record["time/eval"] = time.perf_counter() - t_eval
    return eval_metrics


def checkpoint_due(run: RunConfig, done: int, total_steps: int) -> bool:
    """A checkpoint every ``run.save_every`` steps and at the last step (as Hugging Face ``Trainer`` with
    ``save_strategy="steps"``): a finished run is resumable, so extending it (a larger ``run.max_steps``)
    continues from its last step instead of training the steps after the last multiple again."""
    return bool(run.save_every) and (done % run.save_every == 0 or done == total_steps)


def _per_process_batch(config, world: int) -> tuple[int, int]:
    """(examples per process per step, micro-batch size): the batch rule is ``inputs.check_batch_split``;
    the last micro-batch of a process is smaller when micro_batch_size does not divide its share."""
    check_batch_split(config, world)
    per_process = config.run.batch_size // world
    return per_process, min(config.run.micro_batch_size, per_process)


def accumulate_gradients(accelerator, task: Task, model, batches: list) -> tuple[tuple[dict[str, float], int], float]:
    """Forward and backward of this process's micro-batches of one step, each loss weighted by
    ``backward_share`` (gradients synchronised on the last micro-batch only).

    Returns ((the step's summed metrics over all processes, its unit count), the step's mean loss over
    all processes, for the non-finite guard)."""
    device = accelerator.device
    counts = [task.count(b) for b in batches]
    global_count = global_sum(accelerator, sum(counts))
    if hasattr(task, "begin_step"):
        task.begin_step(accelerator, model, batches, [True] * len(batches))
    sums: dict[str, torch.Tensor] = {}
    tokens, step_loss = 0, torch.zeros((), device=device)
    for k, (batch, count) in enumerate(zip(batches, counts, strict=True)):
        with engines.micro_batch(accelerator, model, last=k == len(batches) - 1):
            loss_sum, batch_sums = task.loss(model, batch.to(device))
            weight = backward_share(accelerator, model, loss_sum / max(count, 1), count, global_count)
        tokens += batch.num_tokens
        step_loss = step_loss + loss_sum.detach() * weight / max(count, 1)
        for name, value in batch_sums.items():
            sums[name] = sums.get(name, 0.0) + value.detach()
    step_loss = float(accelerator.reduce(step_loss, reduction="sum")) / accelerator.num_processes
    totals = _reduce(accelerator, {**sums, "tokens": torch.tensor(float(tokens), device=device)}, sum(counts))
    return totals, step_loss


def evaluate_offline(accelerator, task: Task, model, examples: list, micro: int) -> dict[str, float]:
    """``eval/<metric>`` of ``task`` on ``examples``, each process scoring every world-th example.

    Under ZeRO-3 and FSDP2 every forward gathers shards from every process, so a process with fewer micro-batches
    than the others runs its missing forwards on a repeated example and counts nothing from them."""
    model.eval()
    sums, count = {}, 0
    mine = examples[accelerator.process_index :: accelerator.num_processes]
    forwards = math.ceil(len(mine) / micro)
    if engines.collective_forwards(accelerator):
        forwards = math.ceil(math.ceil(len(examples) / accelerator.num_processes) / micro)
    with torch.no_grad():
        chunks = [mine[i * micro : (i + 1) * micro] for i in range(forwards)]
        batches = (task.collate(chunk or examples[:1]) for chunk in chunks)  # one at a time, as training's
        if hasattr(task, "begin_step"):  # it reads every micro-batch before the first loss (KTO's z0)
            batches = [*batches]
            task.begin_step(accelerator, model, batches, [bool(chunk) for chunk in chunks])
        for chunk, batch in zip(chunks, batches, strict=True):
            _, batch_sums = task.loss(model, batch.to(accelerator.device))
            if not chunk:
                continue
            count += task.count(batch)
            for k, v in batch_sums.items():
                sums[k] = sums.get(k, 0.0) + v.detach()
    model.train()
    return {f"eval/{k}": v for k, v in task.finalize(*_reduce(accelerator, sums, count)).items()}


def global_sum(accelerator, value) -> float:
    """Σ of ``value`` over every process, in float64."""
    if accelerator.num_processes == 1:  # nothing to reduce: no float64 tensor and collective dispatch
        return float(value)
    tensor = torch.as_tensor(value, dtype=torch.float64, device=accelerator.device)
    return float(accelerator.reduce(tensor, reduction="sum"))


def global_sums(accelerator, *values) -> list[float]:
    """Σ of each of ``values`` (numbers or 0-d tensors) over every process, in float64: one collective and
    one host sync for all of them, where a ``global_sum`` each would take one apiece."""
    device = accelerator.device
    stacked = torch.stack([torch.as_tensor(v, dtype=torch.float64).to(device).reshape(()) for v in values])
    return accelerator.reduce(stacked, reduction="sum").tolist()


def save_final(accelerator, output_dir, models: dict, tokenizer) -> None:
    """``<output_dir>/final/<role>``: ordinary Hugging Face checkpoints with the tokenizer (never a
    non-finite one: NonFiniteError instead)."""
    state_dicts = {role: accelerator.get_state_dict(model) for role, model in models.items()}
    check_finite_weights(accelerator, "final model", state_dicts)
    write_final_model(accelerator, output_dir, models, state_dicts, tokenizer)  # a full disk: one line


def optimizer_step(
    accelerator, model, optimizer, scheduler, max_norm: float | None, guard: NonFiniteGuard, step: int, loss: float
) -> float:
    """Clip the gradient norm (when ``max_norm``), step the optimizer and the schedule, clear the
    gradients. Returns the norm before clipping.

    ``loss``: the update's loss over all processes. When it or the gradient norm (the same on every
    process: gradients are synchronised) is not finite, ``guard`` skips the update: parameters,
    optimizer state and schedule stay as they were, as if the batch had not been there. Under fp16
    loss scaling the scaler sees every step: it skips non-finite gradients itself (and lowers its
    scale); the schedule then waits too, and only a non-finite loss is counted. Under DeepSpeed the
    engine clips and steps (``engines.deepspeed_step``).
    """
    if engines.is_deepspeed(accelerator):
        return engines.deepspeed_step(accelerator, model, scheduler, guard, step, loss)
    norm = engines.grad_norm(accelerator, [p for p in model.parameters() if p.requires_grad], max_norm)
    scaled = accelerator.scaler is not None
    if guard.allows(step, loss=loss, grad_norm=0.0 if scaled else norm) or scaled:
        optimizer.step()
        if not optimizer.step_was_skipped:
            scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return norm


class NonFiniteGuard:
    """Counts the updates skipped for a non-finite loss or gradient norm; after ``run.max_nonfinite_steps``
    in a row it stops the run (NonFiniteError) naming the step, the quantity and the last good checkpoint."""

    def __init__(self, accelerator, run: RunConfig, model: str = "policy"):
        self.accelerator, self.run, self.model = accelerator, run, model
        self.skips = 0
        self.in_a_row = 0

    def allows(self, step: int, **values: float) -> bool:
        bad = {k: v for k, v in values.items() if not math.isfinite(v)}
        if not bad:
            self.in_a_row = 0
            return True
        self.skips += 1
        self.in_a_row += 1
        what = ", ".join(f"{k}={v}" for k, v in bad.items())
        if self.in_a_row >= self.run.max_nonfinite_steps:
            found = list_checkpoints(self.run.output_dir)
            last = f"the last good checkpoint is {found[-1]}" if found else "no checkpoint was saved"
            raise NonFiniteError(
                f"step {step}: {self.model} {what}: {self.in_a_row} updates in a row skipped "
                f"(run.max_nonfinite_steps={self.run.max_nonfinite_steps}); the run stops, nothing non-finite "
                f"was saved; {last}"
            )
        self.accelerator.print(
            f"[guard] step {step}: {self.model} {what}: update skipped ({self.in_a_row} in a row, {self.skips} in all)"
        )
        return False


def start_run(accelerator, config, total_steps: int, run_name: str) -> tuple[dict | None, MetricsLogger]:
    """Clear the run folder (``run.overwrite`` of a fresh run, or of ``latest`` finding no checkpoint) or
    resume from ``run.resume_from`` (only the run that wrote the checkpoint, see
    ``checkpoint.check_resumable``; the run's metrics and samples cut back to its step), write the
    resolved config, open the metric sinks.

    Returns (the checkpoint's trainer state or None, the logger, already advanced to the step resumed).
    """
    run = config.run
    # every process has checked the run folder (inputs.check_run_dir) before the first write to it
    accelerator.wait_for_everyone()
    state = None
    resume = resolve_resume(run.output_dir, run.resume_from, say=lambda line: accelerator.print(f"[{run_name}] {line}"))
    # a fresh run (latest found none) clears the folder with run.overwrite, or one whose run never stepped
    clear = resume is None and (run.overwrite or never_stepped(Path(run.output_dir)))
    if clear:  # every process refuses a foreign folder
        check_clearable(run.output_dir)
    accelerator.wait_for_everyone()  # every process looked for the checkpoint before one is cleared
    if clear and accelerator.is_main_process:
        clear_run_dir(run.output_dir)
    if run.resume_from == "latest" and resume is None:
        accelerator.print(f"[{run_name}] resume_from=latest: no checkpoint in {run.output_dir}; starting at step 0")
    if resume is not None:
        notes = check_resumable(resume, yaml.safe_load(yaml.safe_dump(to_dict(config))), total_steps)
        state = load_checkpoint(accelerator, resume)
        accelerator.print(f"[{run_name}] resuming from {resume} (step {state['step']} of {total_steps})")
        for note in notes:
            accelerator.print(f"[{run_name}] {note}")
    elapsed = 0.0
    if accelerator.is_main_process and run.resume_from is not None:
        for name in RECORD_FILES:
            # no checkpoint: nothing is kept, not even step 0's held-out evaluation (it runs again)
            truncate_records(Path(run.output_dir) / name, -1 if state is None else state["step"])
        if state is not None and (Path(run.output_dir) / "metrics.jsonl").is_file():
            elapsed = max((r["time"] for r in read_metrics(run.output_dir) if "time" in r), default=0.0)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        write_resolved_config(run.output_dir, config)
    logger = MetricsLogger(
        run.output_dir,
        run.report_to,
        to_dict(config),
        enabled=accelerator.is_main_process,
        progress_total=total_steps,
        progress=run.progress,
        run_name=run.name or run_name,
        project=run.project,
        purge_after=None if run.resume_from is None else (0 if state is None else state["step"]),
        elapsed=elapsed,
    )
    logger.advance(0 if state is None else state["step"])
    return state, logger


def check_clearable(output_dir) -> None:
    """Refuse ``run.overwrite`` of a folder posttrain did not write: it holds files but no config.yaml
    (this run's lock file aside: an empty folder has nothing to lose)."""
    out = Path(output_dir)
    if not out.is_dir() or (out / CONFIG_FILE).is_file():
        return
    if any(path.name != LOCK_FILE for path in out.iterdir()):
        raise UserError(f"run.overwrite: {out} has no {CONFIG_FILE}: not a posttrain run folder; not clearing it")


def clear_run_dir(output_dir) -> None:
    """Empty ``output_dir`` for ``run.overwrite``: only a folder a posttrain run wrote (it has config.yaml)."""
    out = Path(output_dir)
    if not out.is_dir():
        return
    check_clearable(out)
    for path in out.iterdir():
        if path.name == LOCK_FILE:  # this run's own lock (runlock): removing it would let another run in
            continue
        shutil.rmtree(path) if path.is_dir() else path.unlink()


def truncate_records(path: Path, step: int) -> None:
    """Keep the records of the JSONL file ``path`` up to ``step`` (a resumed run writes the rest again);
    a torn last line of a killed run goes too."""
    if not path.is_file():
        return
    kept = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if record["step"] <= step:
            kept.append(line + "\n")
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(kept), encoding="utf-8")
    os.replace(tmp, path)


def _reduce(accelerator, sums: dict, count) -> tuple[dict[str, float], int]:
    """Sum ``sums`` and ``count`` over processes."""
    names = sorted(sums)
    device = accelerator.device
    packed = torch.stack(
        [torch.as_tensor(sums[n], dtype=torch.float64, device=device) for n in names]
        + [torch.tensor(float(count), dtype=torch.float64, device=device)]
    )
    packed = accelerator.reduce(packed, reduction="sum")
    values = packed.tolist()
    return dict(zip(names, values[:-1], strict=True)), int(values[-1])
