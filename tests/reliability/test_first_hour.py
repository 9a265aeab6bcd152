"""What a new user sees in the first hour (issue 34, section 8): a trainer ends with a few lines, not ~50
lines of JSON; `posttrain eval` prints its metrics once; `run.progress=false` prints one plain line per
logged step; `posttrain report` of several runs writes beside them and says where; the report says why
an offline run has no samples."""

from __future__ import annotations

import json

import pytest
import yaml

from posttrain.cli import main
from posttrain.data.synthetic import arithmetic_sft


def _jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_a_trainer_ends_with_a_short_summary_and_keeps_every_number_in_the_run_folder(tiny_dir, tmp_path, capsys):
    """The CLI printed the result as indented JSON (~50 lines for GRPO); and with run.progress=false nothing
    showed while the run went. Now one plain line per logged step, then a summary of a few lines naming the
    run folder, with every number in its summary.json."""
    data = _jsonl(tmp_path / "sft.jsonl", arithmetic_sft(40, seed=0))
    out = tmp_path / "run"
    argv = ["sft", f"model.path={tiny_dir / 'policy'}", f"data.path={data}", f"run.output_dir={out}"]
    argv += ["run.max_steps=3", "run.batch_size=8", "data.chat_template=never", "data.eval_fraction=0.2"]
    assert main([*argv, "run.progress=false", "run.eval_every=2", "run.report_to=[jsonl]"]) == 0
    printed = capsys.readouterr().out
    assert "{" not in printed, printed
    for step in (1, 2, 3):
        assert f"[run] step {step}/3  loss " in printed, printed
    summary = printed[printed.index("posttrain sft: 3 steps done") :].splitlines()
    assert len(summary) <= 8, summary
    assert f"run folder {out}" in summary[0] and summary[1].startswith("  last step: loss ")
    assert any(line.startswith("  held-out loss: ") and "(step 2) -> " in line for line in summary), summary
    kept = json.loads((out / "summary.json").read_text())
    assert kept["steps"] == 3 and kept["output_dir"] == str(out) and "loss" in kept["final_metrics"]
    assert "eval/loss" in kept["eval_metrics"]


def test_posttrain_eval_prints_its_metrics_once(tiny_dir, tmp_path, capsys):
    """The table, then the same metrics again as JSON: printed twice. Now the table, and where the JSON is."""
    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(3) for b in range(3)]
    data = _jsonl(tmp_path / "prompts.jsonl", rows)
    argv = ["eval", "--model", str(tiny_dir / "policy"), "--data", data]
    argv += ["--rewards", "posttrain.rewards.builtin:exact_answer", "--max-new-tokens", "3"]
    assert main([*argv, "data.chat_template=never", "model.device=cpu"]) == 0
    printed = capsys.readouterr().out
    assert printed.count("eval/greedy/accuracy") == 1, printed
    assert "--output-dir DIR keeps them as JSON" in printed
    assert main([*argv, "--output-dir", str(tmp_path / "ev"), "data.chat_template=never", "model.device=cpu"]) == 0
    printed = capsys.readouterr().out
    assert printed.count("eval/greedy/accuracy") == 1 and f"(as JSON: {tmp_path / 'ev' / 'eval_summary.json'})" in (
        printed
    )
    assert "eval/greedy/accuracy" in json.loads((tmp_path / "ev" / "eval_summary.json").read_text())


def _fake_run(folder, config: dict, steps: int = 3) -> None:
    """A run folder as a trainer leaves it, without training: config.yaml and metrics.jsonl."""
    folder.mkdir(parents=True)
    (folder / "config.yaml").write_text(yaml.safe_dump(config))
    _jsonl(folder / "metrics.jsonl", [{"step": s, "time": float(s), "loss": 1.0 / s} for s in range(1, steps + 1)])


def test_the_report_of_several_runs_goes_beside_them_and_says_where(tmp_path, monkeypatch, capsys):
    """`posttrain report runs/a runs/b` wrote ./report.html into the working folder. Now into the folder the
    runs share (runs/report.html), else ./; the absolute path is printed. An offline run's missing samples
    are explained, not "No samples were logged"."""
    runs = tmp_path / "runs"
    _fake_run(runs / "sft", {"model": {}, "data": {}, "optim": {}, "run": {}, "packing": False})
    _fake_run(runs / "grpo", {"model": {}, "data": {}, "run": {}, "sampling": {}, "log_completions": 0})
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    assert main(["report", "../runs/sft", "../runs/grpo"]) == 0
    assert f"wrote {runs / 'report.html'} (open it in a browser)" in capsys.readouterr().out
    assert not (work / "report.html").exists()
    page = (runs / "report.html").read_text()
    sft, grpo = page.split("<h2>Samples: sft</h2>")[1].split("<h2>Samples: grpo</h2>")
    assert "trains on the rows of its data set and generates nothing" in sft and "No samples" not in sft
    assert "No samples were logged (log_completions: 0" in grpo
    # runs in different folders: ./report.html, named in full
    _fake_run(tmp_path / "elsewhere" / "dpo", {"model": {}, "data": {}, "run": {}, "beta": 0.1})
    assert main(["report", "../runs/sft", "../elsewhere/dpo"]) == 0
    assert f"wrote {work / 'report.html'}" in capsys.readouterr().out


@pytest.mark.parametrize("progress, lines", [(None, False), (True, False)])
def test_no_plain_lines_with_a_bar_or_with_progress_null(tmp_path, capsys, progress, lines):
    """run.progress=null (what `posttrain demo` sets: it prints its own lines) shows nothing per step."""
    from posttrain.runtime.metrics import MetricsLogger

    logger = MetricsLogger(tmp_path, ["jsonl"], {}, progress_total=2, progress=progress, run_name="x")
    logger.log(1, {"loss": 0.5}, ("loss",))
    logger.close()
    assert ("[x] step 1/2" in capsys.readouterr().out) is lines
