"""What the online trainers call once per step (``RunMonitor``: held-out evaluation when due, then the
health alerts), and the offline trainers' health alerts (``offline_alerts``)."""

from __future__ import annotations

import time
from pathlib import Path

from posttrain.data import PromptExample
from posttrain.monitor.alerts import DEAD_RUN_RULES, RULES, AlertConfig, HealthMonitor, Rule, read_alerts
from posttrain.monitor.evaluate import EvaluationError, Evaluator
from posttrain.monitor.records import read_records


class RunMonitor:
    """Held-out evaluation (``config.eval``, every ``run.eval_every`` steps and at the end) and health
    alerts (``config.alerts``) of one online run.

    reward / reward_std name the training reward's metrics (see ``HealthMonitor``). On resume
    (``resume``) the alert history is rebuilt from the run's logged records.
    """

    def __init__(self, config, eval_prompts: list[PromptExample], tokenizer, accelerator, reward: str, reward_std: str):
        if config.eval.path and config.data.eval_fraction > 0:
            raise ValueError("set eval.path or data.eval_fraction, not both (both name the held-out prompts)")
        self.every = config.run.eval_every
        self.accelerator, self.output_dir = accelerator, config.run.output_dir
        self.evaluator = Evaluator.for_training(config, eval_prompts, tokenizer, accelerator)
        self.health = None
        if accelerator.is_main_process:
            from tqdm.auto import tqdm

            sampling = config.sampling
            self.health = HealthMonitor(
                config.alerts,
                config.run.output_dir,
                reward,
                reward_std,
                forced_length=sampling.min_new_tokens >= sampling.max_new_tokens,
                echo=tqdm.write,  # above the progress bar, not through it
                rules=(*RULES, *DEAD_RUN_RULES),
            )

    def resume(self, output_dir) -> None:
        """Continue the alert history of the run in ``output_dir`` (its records already cut back to the
        checkpoint's step)."""
        if self.health is None or not self.health.config.enabled:
            return
        path = Path(output_dir) / "metrics.jsonl"
        records = read_records(path) if path.is_file() else []
        self.health.restore([r for r in records if "step" in r], len(read_alerts(output_dir)))

    def report_failure(self, err: EvaluationError) -> None:
        """One line on the console (the traceback appended to ``eval_errors.log`` in the run folder)."""
        if not self.accelerator.is_main_process:
            return
        from tqdm.auto import tqdm

        where = ""
        if self.output_dir is not None:
            path = Path(self.output_dir) / "eval_errors.log"
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "a", encoding="utf-8") as f:
                f.write(f"{err}\n{err.details}\n")
            where = f" (traceback in {path})"
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        tqdm.write(f"[eval] warning: {first}; training goes on, eval/failed=1 in this step's record{where}")

    @property
    def bar_keys(self) -> tuple[str, ...]:
        """Metrics for the progress bar: the held-out accuracy when evaluating, and the alert count."""
        keys = ("alerts",)
        if self.evaluator is not None:
            mode = "greedy" if self.evaluator.config.greedy else "sampled"
            keys = (f"eval/{mode}/accuracy", *keys)
        return keys

    def evaluating(self, step: int, total_steps: int) -> bool:
        """Whether ``after_step`` generates from the policy at this step (a held-out evaluation is due)."""
        return self.evaluator is not None and self.evaluator.due(step, total_steps, self.every)

    def after_step(self, engine, step: int, total_steps: int, metrics: dict) -> dict[str, float]:
        """The metrics to add to this step's record: ``eval/*`` and ``time/eval`` when an evaluation
        was due, and ``alerts`` (alerts raised so far) on the main process."""
        out: dict[str, float] = {}
        if self.evaluating(step, total_steps):
            start = time.perf_counter()
            try:
                out.update(self.evaluator.evaluate(engine, step))
            except EvaluationError as err:  # never lose a run to its evaluation: report it, train on, save
                self.report_failure(err)
                out["eval/failed"] = 1.0
            out["time/eval"] = time.perf_counter() - start
        if self.health is not None:
            self.health.check(step, {**metrics, **out})
            out["alerts"] = self.health.raised
        return out


def offline_alerts(accelerator, output_dir, rules: tuple[Rule, ...] = DEAD_RUN_RULES, context: dict | None = None):
    """The callbacks (``run_offline``'s) raising ``rules`` over an offline run's records (SFT, RM, the DPO
    family, KTO) after every step, on the main process: printed above the progress bar and written to
    ``alerts.jsonl``; the run goes on. ``context``: what the rules read beside the records (SFT: log_vocab).
    A resumed run's history is rebuilt at its first step, as ``RunMonitor.resume`` does: by then the records
    are cut back to the checkpoint's step, and an alert active there is not raised again."""
    if not accelerator.is_main_process:
        return []
    from tqdm.auto import tqdm

    monitor = HealthMonitor(AlertConfig(), output_dir, "loss", "loss", echo=tqdm.write, rules=rules, context=context)
    started: list[int] = []

    def check(step: int, metrics: dict) -> list[dict]:
        if not started:  # the records before this step: none in a new run, a resumed run's up to its checkpoint
            started.append(step)
            path = Path(output_dir) / "metrics.jsonl"
            records = [r for r in (read_records(path) if path.is_file() else []) if r.get("step", step) < step]
            monitor.restore(records, len(read_alerts(output_dir)))
        return monitor.check(step, metrics)

    return [check]
