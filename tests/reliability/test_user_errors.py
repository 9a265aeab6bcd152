"""Every error a user can cause is one line with exit status 2, wherever in the run it is raised (issue 24
items 6, 7, 8, 22): the checks that run after the config is loaded (the data against the batch, resume,
overwrite, the launcher's settings) raise ``posttrain.errors.UserError``, which the CLI prints as one line;
the inputs that can be checked at start are; a bug keeps its traceback."""

import json
import os
import subprocess
import sys

import pytest
from helpers import crash_at, one_line, sft_args

from posttrain.cli import main
from posttrain.data import DataError, load_sft
from posttrain.data.datasets import DataConfig
from posttrain.errors import UserError
from posttrain.rewards import RewardComposer, RewardError, RewardSpec
from posttrain.runtime import checkpoint
from posttrain.runtime.config import load_config
from posttrain.trainers.sft import SFTConfig
from posttrain.trainers.sft import train as train_sft


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _cli(*args):
    """The command line in a process of its own, as a user runs it."""
    return subprocess.run([sys.executable, "-m", "posttrain.cli", *args], capture_output=True, text=True)


def _main(capsys, *args) -> tuple[int, str]:
    """(exit status, stderr) of the command line run in this process (no interpreter start: fast); an
    exception the CLI does not turn into an exit escapes, as it would print its traceback."""
    with pytest.raises(SystemExit) as exited:
        main(list(args))
    return exited.value.code, capsys.readouterr().err


def _sft_args(tiny_dir, tmp_path, *overrides, rows=32):
    return sft_args(tiny_dir, tmp_path, "run.save_every=2", *overrides, rows=rows)


# -- item 6: late user errors are one line ---------------------------------------------------------------


def test_fewer_rows_than_the_batch_is_one_line(tiny_dir, tmp_path):
    """Found after the data is read (the models loaded): in a process of its own, as a user sees it."""
    out = _cli("sft", *_sft_args(tiny_dir, tmp_path, rows=4))
    one_line(out.returncode, out.stderr, "sft", "run.batch_size=8 is larger than the 4 training examples")


def test_resume_from_a_missing_folder_or_a_partial_checkpoint_is_one_line(tiny_dir, tmp_path, capsys):
    missing = tmp_path / "nowhere" / "step-000002"
    status, err = _main(capsys, "sft", *_sft_args(tiny_dir, tmp_path, f"run.resume_from={missing}"))
    one_line(status, err, "sft", f"run.resume_from: no checkpoint folder at {missing}")
    partial = tmp_path / "partial"
    (partial / "hf").mkdir(parents=True)
    status, err = _main(capsys, "sft", *_sft_args(tiny_dir, tmp_path, f"run.resume_from={partial}"))
    one_line(status, err, "sft", "it is a partial checkpoint")
    # still the types code catches
    assert issubclass(checkpoint.IncompleteCheckpointError, UserError)
    assert issubclass(checkpoint.IncompleteCheckpointError, RuntimeError)
    assert issubclass(checkpoint.CheckpointNotFoundError, UserError)
    assert issubclass(checkpoint.CheckpointNotFoundError, FileNotFoundError)
    assert issubclass(DataError, UserError)


def test_resume_with_a_changed_config_or_past_max_steps_is_one_line(tiny_dir, tmp_path, capsys):
    config = load_config(SFTConfig, None, _sft_args(tiny_dir, tmp_path, "run.max_steps=6"))
    with pytest.raises(KeyboardInterrupt):
        train_sft(config, callbacks=[crash_at(3)])  # leaves step-000002
    changed = _sft_args(tiny_dir, tmp_path, "run.max_steps=6", "run.resume_from=latest", "optim.lr=2e-3")
    status, err = _main(capsys, "sft", *changed)
    one_line(status, err, "sft", "different config (optim.lr: 0.001 in the checkpoint, 0.002 now)")
    status, err = _main(capsys, "sft", *_sft_args(tiny_dir, tmp_path, "run.max_steps=2", "run.resume_from=latest"))
    one_line(status, err, "sft", "is at step 2, at or past this run's 2 steps")


def test_overwrite_of_a_folder_posttrain_did_not_write_is_one_line(tiny_dir, tmp_path, capsys):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "thesis.tex").write_text("years of work")
    status, err = _main(capsys, "sft", *_sft_args(tiny_dir, tmp_path, "run.max_steps=1", "run.overwrite=true"))
    one_line(status, err, "sft", "not a posttrain run folder; not clearing it")
    assert (tmp_path / "run" / "thesis.tex").read_text() == "years of work"


def test_fsdp_without_an_accelerate_config_is_one_line_and_asks_for_no_fsdp_version(
    tiny_dir, tmp_path, capsys, monkeypatch
):
    for key in [k for k in os.environ if k.startswith("FSDP_")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    status, err = _main(capsys, "sft", *_sft_args(tiny_dir, tmp_path, "run.max_steps=1"))
    one_line(status, err, "sft", "ACCELERATE_USE_FSDP=true without an accelerate FSDP config")
    assert "examples/accelerate/fsdp2.yaml" in err
    assert "fsdp_version" not in err.lower() and "version 1" not in err


def test_a_bug_keeps_its_traceback(tiny_dir, tmp_path):
    """A reward function that raises is no mistake in the config: the CLI lets it out, traceback and all."""
    (tmp_path / "buggy.py").write_text("def buggy(prompts, completions, **columns):\n    return 1 / 0\n")
    data = _jsonl(tmp_path / "prompts.jsonl", [{"prompt": f"{i}+{i}="} for i in range(4)])
    with pytest.raises(RewardError, match="ZeroDivisionError"):
        main(
            [
                "grpo",
                f"model.path={tiny_dir / 'policy'}",
                f"data.path={data}",
                f"rewards=[{{function: '{tmp_path / 'buggy.py'}:buggy'}}]",
                f"run.output_dir={tmp_path / 'run'}",
                "run.progress=false",
                "run.report_to=[jsonl]",
                "data.chat_template=never",
                "run.batch_size=4",
                "num_generations=2",
                "sampling.max_new_tokens=2",
                "run.max_steps=1",
            ]
        )


# -- item 7: checked at start -------------------------------------------------------------------------


def test_an_empty_data_folder_is_refused_at_start(tiny_dir, tmp_path, capsys):
    (tmp_path / "data" / ".cache").mkdir(parents=True)  # hidden: datasets reads no file from it
    (tmp_path / "data" / ".cache" / "x.lock").write_text("")
    status, err = _main(capsys, "sft", *_sft_args(tiny_dir, tmp_path, f"data.path={tmp_path / 'data'}"))
    one_line(status, err, "sft", f"data.path: {tmp_path / 'data'} is an empty folder")
    assert not (tmp_path / "run").exists()


def test_an_output_dir_that_cannot_be_written_is_refused_at_start(tiny_dir, tmp_path, capsys):
    (tmp_path / "a-file").write_text("")
    out = tmp_path / "a-file" / "run"
    status, err = _main(capsys, "sft", *_sft_args(tiny_dir, tmp_path, f"run.output_dir={out}"))
    one_line(status, err, "sft", f"run.output_dir: {out} cannot be created: {tmp_path / 'a-file'} is a file")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only folder")
def test_a_read_only_output_parent_is_refused_at_start(tiny_dir, tmp_path, capsys):
    (tmp_path / "ro").mkdir()
    os.chmod(tmp_path / "ro", 0o555)
    try:
        status, err = _main(capsys, "sft", *_sft_args(tiny_dir, tmp_path, f"run.output_dir={tmp_path / 'ro' / 'run'}"))
    finally:
        os.chmod(tmp_path / "ro", 0o755)
    one_line(status, err, "sft", "is not writable")


def test_vllm_rollouts_without_vllm_are_refused_at_start(tiny_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # not importable, installed or not
    data = _jsonl(tmp_path / "prompts.jsonl", [{"prompt": "1+1=", "answer": "2"}])
    status, err = _main(
        capsys,
        "grpo",
        f"model.path={tiny_dir / 'policy'}",
        f"data.path={data}",
        "rewards=[{function: posttrain.rewards.builtin:exact_answer}]",
        f"run.output_dir={tmp_path / 'run'}",
        "rollout.engine=vllm",
    )
    one_line(status, err, "grpo", "rollout.engine=vllm needs vLLM, which is not installed")
    assert not (tmp_path / "run").exists()


def test_a_deepspeed_launch_without_deepspeed_is_refused_at_start(tiny_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "deepspeed", None)
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    status, err = _main(capsys, "sft", *_sft_args(tiny_dir, tmp_path))
    one_line(status, err, "sft", "DeepSpeed (ACCELERATE_USE_DEEPSPEED=true), which is not installed")
    assert not (tmp_path / "run").exists()


# -- item 8: which None is allowed --------------------------------------------------------------------


def test_a_reward_function_returning_none_is_told_none_is_per_sample(tmp_path):
    (tmp_path / "nothing.py").write_text("def nothing(prompts, completions, **columns):\n    return None\n")
    composer = RewardComposer.from_specs([RewardSpec(f"{tmp_path / 'nothing.py'}:nothing")])
    with pytest.raises(RewardError) as caught:
        composer(["p"] * 2, ["c"] * 2, {})
    message = str(caught.value)
    assert "'nothing' returned None instead of a list" in message
    assert "must return a list of 2 values" in message
    assert "None is allowed per sample, inside the list, not in place of the list" in message


# -- item 22: the other-kind hint only for a file of the other kind -----------------------------------


def test_one_sft_row_without_completion_is_just_missing(tokenizer, tmp_path):
    rows = [{"prompt": f"{i}+1=", "completion": str(i + 1)} for i in range(39)] + [{"prompt": "9+9="}]
    config = DataConfig(path=_jsonl(tmp_path / "sft.jsonl", rows), chat_template="never")
    with pytest.raises(DataError, match=r"sft.jsonl:40: field 'completion': missing$"):
        load_sft(config, tokenizer)
    config.path = _jsonl(tmp_path / "first.jsonl", rows[-1:] + rows[:-1])  # the bad row first, SFT rows after
    with pytest.raises(DataError, match=r"first.jsonl:1: field 'completion': missing$"):
        load_sft(config, tokenizer)
    config.path = _jsonl(tmp_path / "prompts.jsonl", [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(40)])
    with pytest.raises(DataError, match=r"prompts.jsonl:1: field 'completion': missing: this looks like a file of"):
        load_sft(config, tokenizer)
