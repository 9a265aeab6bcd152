"""Metric sinks: a JSONL file and TensorBoard in the run directory, W&B, MLflow and trackio when chosen
(under ``run.project`` / ``run.name``), and a progress bar. Metrics are plain dicts of numbers;
nothing here is global state."""

from __future__ import annotations

import math
import time
from pathlib import Path

from posttrain.monitor.records import dumps_record, read_records


class MetricsLogger:
    """Writes one record per logged step to every chosen sink. Only the main process writes."""

    def __init__(
        self,
        output_dir: str | Path,
        report_to: list[str],
        config: dict,
        enabled: bool = True,
        progress_total: int | None = None,
        progress: bool | None = True,
        run_name: str | None = None,
        purge_after: int | None = None,
        project: str = "posttrain",
        elapsed: float = 0.0,
    ):
        self.enabled = enabled
        self.path = Path(output_dir) / "metrics.jsonl"
        self._file = None
        self._tb = self._wandb = self._mlflow = self._trackio = None
        self._bar = None
        self._shown: dict[str, str] = {}  # the bar keeps a key's last value (eval runs only some steps)
        # progress=False: one plain line per logged step instead of the bar (None: neither)
        self._lines = progress is False and progress_total is not None
        self._total, self._name = progress_total, run_name or "train"
        self._start = time.perf_counter() - elapsed  # a resumed run's ``time`` continues from its checkpoint's
        if not enabled:
            return
        Path(output_dir).mkdir(parents=True, exist_ok=True)
        if "jsonl" in report_to:
            self._file = open(self.path, "a", encoding="utf-8")
        if "tensorboard" in report_to:
            from torch.utils.tensorboard import SummaryWriter

            # a resumed run writes the steps after its checkpoint again: TensorBoard hides the old ones
            purge_step = None if purge_after is None else purge_after + 1
            self._tb = SummaryWriter(log_dir=str(Path(output_dir) / "tensorboard"), purge_step=purge_step)
        if "wandb" in report_to:
            try:
                import wandb
            except ImportError as err:
                raise ImportError("run.report_to includes 'wandb' but wandb is not installed") from err
            self._wandb = wandb.init(project=project, name=run_name, config=config, dir=str(output_dir))
        if "mlflow" in report_to:
            try:
                import mlflow
            except ImportError as err:
                raise ImportError("run.report_to includes 'mlflow' but mlflow is not installed") from err
            self._mlflow = mlflow
            mlflow.set_experiment(project)
            mlflow.start_run(run_name=run_name)
            mlflow.log_params({k: str(v) for k, v in _flatten(config).items()})
        if "trackio" in report_to:
            try:
                import trackio
            except ImportError as err:
                raise ImportError("run.report_to includes 'trackio' but trackio is not installed") from err
            self._trackio = trackio
            trackio.init(project=project, name=run_name, config=config, auto_log_cpu=False, auto_log_gpu=False)
        if progress and progress_total is not None:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=progress_total, desc=run_name or "train", dynamic_ncols=True)

    def log(
        self, step: int, metrics: dict[str, float], keys_for_bar: tuple[str, ...] = (), series_step: int | None = None
    ) -> None:
        """One record at ``step``. ``series_step``: the metrics' x in TensorBoard and MLflow instead, whose series
        are per metric (PPO's value pretraining: −N … −1, before its steps); W&B and trackio keep one row per
        step, which must increase: they take ``step``, as the JSONL record does."""
        if not self.enabled:
            return
        x = step if series_step is None else series_step
        record = {"step": step, "time": round(time.perf_counter() - self._start, 3)}
        record.update({k: (float(v) if v is not None else None) for k, v in metrics.items()})
        if self._file is not None:
            self._file.write(dumps_record(record) + "\n")  # NaN and inf as null: strict JSON
            self._file.flush()
        for key, value in metrics.items():
            if value is None or not math.isfinite(float(value)):
                continue
            if self._tb is not None:
                self._tb.add_scalar(key, float(value), x)
        if self._wandb is not None:
            self._wandb.log(metrics, step=step)
        if self._mlflow is not None:
            self._mlflow.log_metrics({k: float(v) for k, v in metrics.items() if v is not None}, step=x)
        if self._trackio is not None:
            self._trackio.log({k: float(v) for k, v in metrics.items() if v is not None}, step=step)
        step_values = {k: f"{metrics[k]:.4g}" for k in keys_for_bar if metrics.get(k) is not None}
        if self._bar is not None:
            self._shown.update(step_values)
            self._bar.set_postfix(self._shown, refresh=False)
        if self._lines:
            shown = "".join(f"  {k} {v}" for k, v in step_values.items())
            print(f"[{self._name}] step {step}/{self._total}{shown}  ({record['time']:.0f} s)", flush=True)

    def advance(self, steps: int = 1) -> None:
        if self._bar is not None:
            self._bar.update(steps)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
        if self._mlflow is not None:
            self._mlflow.end_run()
        if self._trackio is not None:
            self._trackio.finish()
        if self._bar is not None:
            self._bar.close()


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def read_metrics(output_dir: str | Path) -> list[dict]:
    """The records of a run's metrics.jsonl (a null, written for NaN or inf, read as NaN)."""
    return read_records(Path(output_dir) / "metrics.jsonl")
