"""``posttrain sample``: candidates for people to judge, from the tiny models, through the real command line."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import write_jsonl
from helpers import one_line

from posttrain.cli import main
from posttrain.data.rows import Row, check_ranking

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def prompts(tmp_path):
    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b), "source": "sums"} for a in range(3) for b in range(2)]
    return write_jsonl(tmp_path / "prompts.jsonl", rows)


def _rows(task) -> list[dict]:
    return [json.loads(line) for line in (Path(task) / "candidates.jsonl").read_text().splitlines()]


def _task(task) -> dict:
    return json.loads((Path(task) / "task.json").read_text())


def _sample(*args) -> int:
    return main(["sample", *map(str, args)])


def test_the_command_writes_k_distinct_candidates_per_prompt_in_the_ranking_schema(tiny_dir, prompts, tmp_path):
    """Through a real subprocess: one row per prompt, K distinct non-empty completions that the reward model's
    ranking schema takes as they are, the prompt row's other columns in meta, task.json for the labelling app."""
    task = tmp_path / "task"
    command = [sys.executable, "-m", "posttrain.cli", "sample", "--model", str(tiny_dir / "policy"), "--data", prompts]
    command += ["--out", str(task), "--k", "3", "sampling.max_new_tokens=6"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"next: posttrain label {task}" in done.stdout and "6 rank rows from 6 prompts" in done.stdout
    rows = _rows(task)
    assert [r["id"] for r in rows] == [f"{i:06d}" for i in range(6)]
    assert rows[4]["prompt"] == "2+0=" and rows[4]["meta"] == {"answer": "2", "source": "sums"}
    for row in rows:
        texts = [c["text"] for c in row["completions"]]
        assert len(texts) == 3 and {c["model"] for c in row["completions"]} == {"policy"}
        check_ranking(Row("candidates", {"prompt": row["prompt"], "responses": texts}))  # distinct, non-empty
    task_json = _task(task)
    assert task_json["mode"] == "rank" and task_json["k"] == 3 and task_json["seed"] == 0
    assert task_json["models"] == {"policy": str(tiny_dir / "policy")}
    assert task_json["sampling"]["temperature"] == 1.0 and task_json["sampling"]["max_new_tokens"] == 6
    assert task_json["allow_ties"] is False and task_json["labellers"] == [] and task_json["overlap"] == 0.2


def test_the_same_seed_writes_the_same_candidates_and_another_seed_others(tiny_dir, prompts, tmp_path):
    model = tiny_dir / "policy"
    for name, seed in (("a", 0), ("b", 0), ("c", 1)):
        _sample(
            "--model", model, "--data", prompts, "--out", tmp_path / name, "--seed", seed, "sampling.max_new_tokens=6"
        )
    first, again, other = ((tmp_path / n / "candidates.jsonl").read_bytes() for n in "abc")
    assert first == again
    assert first != other


def test_compare_takes_one_completion_from_each_of_two_checkpoints(tiny_dir, prompts, tmp_path, capsys):
    """A then B, each in its own order; A is the first model with the task's seed (its texts are those of an
    A/A task of the same model), B the second, here another checkpoint; with its chat-template mode recorded
    (posttrain.json), B's prompts are rendered the way it was trained."""
    policy, qwen2 = tiny_dir / "policy", tiny_dir / "qwen2"
    plain = tmp_path / "plain"
    shutil.copytree(policy, plain)
    (plain / "posttrain.json").write_text(json.dumps({"data.chat_template": "never", "rendered_with_template": False}))
    limits = ["--n-prompts", 4, "sampling.max_new_tokens=6"]
    _sample("--model", policy, "--model", qwen2, "--data", prompts, "--out", tmp_path / "ab", *limits)
    assert "next: posttrain label" in capsys.readouterr().out
    _sample("--model", policy, "--model", plain, "--data", prompts, "--out", tmp_path / "aa", *limits)
    ab, aa = _rows(tmp_path / "ab"), _rows(tmp_path / "aa")
    assert len(ab) == 4 and all([c["model"] for c in r["completions"]] == ["A", "B"] for r in ab)
    task = _task(tmp_path / "ab")
    assert task["mode"] == "compare" and task["k"] == 1
    assert task["models"] == {"A": str(policy), "B": str(qwen2)}
    assert [r["completions"][0] for r in ab] == [r["completions"][0] for r in aa]  # A: the same model, same seed
    assert [r["completions"][1] for r in ab] != [r["completions"][1] for r in aa]
    assert _task(tmp_path / "aa")["sample"]["chat_template"] == {"A": "auto", "B": "never"}


def test_repeated_and_empty_completions_are_drawn_again_then_dropped(tiny_dir, prompts, tmp_path, capsys):
    """Top-k 2 and one token: at most two distinct answers exist, so of K = 4 at most two stay, every one
    distinct and non-empty (EOS alone decodes to an empty text); a prompt left with fewer is dropped and counted."""
    args = ["--model", tiny_dir / "policy", "--data", prompts, "--out", tmp_path / "t", "--mode", "pair"]
    _sample(*args, "sampling.max_new_tokens=1", "sampling.top_k=2", "resample=2")
    rows, task = _rows(tmp_path / "t"), _task(tmp_path / "t")
    for row in rows:
        texts = [c["text"] for c in row["completions"]]
        assert len(texts) == 2 and len(set(texts)) == 2 and all(t.strip() for t in texts)
    assert task["mode"] == "pair" and task["sample"]["resampled"]["policy"] > 0
    assert len(rows) + task["sample"]["dropped_rows"] == 6
    assert "drawn again (empty or repeated)" in capsys.readouterr().out


def test_a_run_folder_lends_its_sampling_settings_and_key_value_wins(tiny_dir, prompts, tmp_path):
    """--model RUN samples RUN/final/policy with the run's sampling section and chat-template mode; a key=value
    given on the command line overrides them; the run's other sections (optim, run) are not read."""
    run = tmp_path / "run"
    shutil.copytree(tiny_dir / "policy", run / "final" / "policy")
    config = {
        "model": {"path": "elsewhere"},
        "data": {"path": "train.jsonl", "chat_template": "never"},
        "sampling": {"max_new_tokens": 3, "temperature": 0.7},
        "optim": {"lr": 1.0},
        "run": {"output_dir": str(run)},
    }
    (run / "config.yaml").write_text(json.dumps(config))
    _sample("--model", run, "--data", prompts, "--out", tmp_path / "t", "--k", 2, "sampling.temperature=0.9")
    task = _task(tmp_path / "t")
    assert task["models"] == {"policy": str(run / "final" / "policy")}
    assert task["sampling"]["max_new_tokens"] == 3 and task["sampling"]["temperature"] == 0.9
    assert task["sample"]["chat_template"] == {"policy": "never"}
    assert all(len(c["text"]) <= 3 for r in _rows(tmp_path / "t") for c in r["completions"])  # one char a token


def _refused(capsys, message: str, *args) -> None:
    with pytest.raises(SystemExit) as exit_info:
        _sample(*args)
    one_line(exit_info.value.code, capsys.readouterr().err, "sample", message)


def test_mistakes_end_in_one_line_before_any_model_loads(tiny_dir, prompts, tmp_path, capsys):
    model = str(tiny_dir / "policy")
    base = ["--model", model, "--data", prompts]
    _refused(
        capsys, "--data: no such file", "--model", model, "--data", tmp_path / "nope.jsonl", "--out", tmp_path / "x"
    )
    _refused(capsys, "--k must be >= 2 in rank mode", *base, "--out", tmp_path / "x", "--k", 1)
    _refused(
        capsys,
        "one model (K completions per prompt) or two",
        *base,
        "--model",
        model,
        "--model",
        model,
        "--out",
        tmp_path / "x",
    )
    _refused(capsys, "--mode compare needs two --model", *base, "--out", tmp_path / "x", "--mode", "compare")
    _refused(capsys, "--k must be 1 in compare mode", *base, "--model", model, "--out", tmp_path / "x", "--k", 4)
    _refused(capsys, "greedy", *base, "--out", tmp_path / "x", "sampling.temperature=0")
    _refused(
        capsys, "--model: no model folder", "--model", tmp_path / "none", "--data", prompts, "--out", tmp_path / "x"
    )
    _refused(capsys, "--config: no YAML file or run folder", *base, "--out", tmp_path / "x", "--config", tmp_path / "c")
    assert not (tmp_path / "x").exists()
    task = tmp_path / "task"
    task.mkdir()
    (task / "candidates.jsonl").write_text('{"id": "000000"}\n')
    _refused(capsys, "already holds candidates.jsonl; choose a new folder, or --force", *base, "--out", task)
    (task / "judgements.jsonl").write_text('{"event": "judgement"}\n')
    _refused(capsys, "holds judgements", *base, "--out", task, "--force")
    assert (task / "candidates.jsonl").read_text() == '{"id": "000000"}\n'


def test_force_replaces_the_candidates_of_a_task_not_yet_judged(tiny_dir, prompts, tmp_path):
    """--force writes new candidates and a new task.json, which keeps the labelling settings a person edited
    in the old one (labellers, overlap, allow_ties); the rest is the new sampling's."""
    task = tmp_path / "task"
    task.mkdir()
    (task / "candidates.jsonl").write_text('{"id": "old"}\n')
    edited = {"labellers": ["ann", "bob"], "overlap": 0.5, "allow_ties": True}
    (task / "task.json").write_text(json.dumps({"mode": "pair", "seed": 9, "k": 7, **edited}))
    _sample(
        "--model",
        tiny_dir / "policy",
        "--data",
        prompts,
        "--out",
        task,
        "--force",
        "--n-prompts",
        2,
        "sampling.max_new_tokens=4",
    )
    assert [r["id"] for r in _rows(task)] == ["000000", "000001"]
    assert not [p for p in os.listdir(task) if p.startswith(".")]  # no temporary file left
    written = _task(task)
    assert {key: written[key] for key in edited} == edited
    assert (written["mode"], written["seed"], written["k"]) == ("rank", 0, 4)


def test_the_docs_table_lists_every_sample_option_with_its_default():
    from test_docs import _rows as table_rows
    from test_docs import _shown

    from posttrain.feedback.sample import SampleConfig

    rows = table_rows(ROOT / "docs" / "human_feedback.md", "Sampling candidates")
    config = SampleConfig()
    for f in SampleConfig.__dataclass_fields__.values():
        value = getattr(config, f.name)
        if hasattr(value, "__dataclass_fields__"):
            continue  # the sections are tabled in docs/config.md
        assert rows[f.name][0] == f"`{_shown(value)}`", f.name
