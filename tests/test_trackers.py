"""Experiment trackers named from config (issue 15): run.project and run.name reach W&B and MLflow
(local stand-ins: neither is installed here and nothing may reach a server) and trackio (real, local)."""

import json
import sqlite3
import sys
import types

import pytest

from posttrain.cli import main


def _stand_in(name, calls):
    module = types.ModuleType(name)

    def record(call):
        return lambda *args, **kwargs: calls.append((name, call, args, kwargs))

    for call in ("init", "set_experiment", "start_run", "log_params", "log_metrics", "end_run", "finish"):
        setattr(module, call, record(call))
    run = types.SimpleNamespace(log=record("run.log"), finish=record("run.finish"))
    module.init = lambda *args, **kwargs: calls.append((name, "init", args, kwargs)) or run
    return module


def test_project_and_run_name_reach_wandb_mlflow_and_trackio(tiny_dir, tmp_path, monkeypatch):
    storage = pytest.importorskip("trackio.sqlite_storage")
    from posttrain.runtime.config import load_config
    from posttrain.trainers import sft

    calls = []
    monkeypatch.setitem(sys.modules, "wandb", _stand_in("wandb", calls))
    monkeypatch.setitem(sys.modules, "mlflow", _stand_in("mlflow", calls))
    monkeypatch.setattr(storage, "TRACKIO_DIR", tmp_path / "trackio")  # read from the environment at import
    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+1=", "completion": str(i + 1)}) + "\n" for i in range(8)))
    overrides = [f"model.path={tiny_dir / 'policy'}", f"data.path={data}", f"run.output_dir={tmp_path / 'run'}"]
    overrides += ["run.max_steps=2", "run.batch_size=4", "run.progress=false", "run.report_to=[wandb,mlflow,trackio]"]
    sft.train(load_config(sft.SFTConfig, None, overrides + ["run.project=digits", "run.name=lr-sweep-1"]))

    inits = {(name, call): kwargs or args for name, call, args, kwargs in calls if call in ("init", "start_run")}
    assert inits[("wandb", "init")]["project"] == "digits" and inits[("wandb", "init")]["name"] == "lr-sweep-1"
    assert ("mlflow", "set_experiment", ("digits",), {}) in calls
    assert inits[("mlflow", "start_run")] == {"run_name": "lr-sweep-1"}
    assert [c[2][0]["loss"] > 0 for c in calls if c[1] == "run.log"] == [True, True]  # 2 steps to W&B
    with sqlite3.connect(tmp_path / "trackio" / "digits.db") as db:
        rows = db.execute("SELECT run_name, step FROM metrics ORDER BY step").fetchall()
    assert rows == [("lr-sweep-1", 1), ("lr-sweep-1", 2)]


def test_demo_help_names_every_stage(capsys):
    with pytest.raises(SystemExit) as done:
        main(["demo", "--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert all(stage in out for stage in ("SFT", "GRPO", "DPO", "reward model", "PPO"))
