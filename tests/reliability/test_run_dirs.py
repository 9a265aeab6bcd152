"""Run directories that never mix (issue 10 items 5, 6): a fresh run refuses a folder holding another run
unless run.overwrite clears it; a checkpoint resumes only the run that wrote it, below its max_steps;
the records of the steps after the checkpoint are cut before the resumed run writes them again."""

import json

import pytest
import torch
from helpers import crash_at
from safetensors.torch import load_file

from posttrain.cli import main
from posttrain.data.synthetic import arithmetic_sft
from posttrain.runtime import checkpoint
from posttrain.runtime.config import load_config
from posttrain.runtime.metrics import read_metrics
from posttrain.trainers.sft import SFTConfig
from posttrain.trainers.sft import train as train_sft

COMMON = ["run.batch_size=8", "run.micro_batch_size=8", "run.save_every=2", "run.keep_last=5"]


def _config(tiny_dir, tmp_path, *overrides):
    return load_config(SFTConfig, None, _overrides(tiny_dir, tmp_path, *overrides))


def _overrides(tiny_dir, tmp_path, *overrides) -> list[str]:
    data = tmp_path / "sft.jsonl"
    if not data.exists():
        data.write_text("".join(json.dumps(r) + "\n" for r in arithmetic_sft(32, seed=0)))
    base = [
        f"model.path={tiny_dir / 'policy'}",
        f"data.path={data}",
        f"run.output_dir={tmp_path / 'run'}",
        "run.progress=false",
        "run.report_to=[jsonl]",
        "data.chat_template=never",
        "optim.lr=1e-3",
    ]
    return base + COMMON + list(overrides)


def test_a_fresh_run_refuses_a_folder_holding_a_run_and_overwrite_clears_it(tiny_dir, tmp_path):
    """Item 5: a fresh run into a finished run's folder mixed the two (and resume then loaded the other's
    checkpoint)."""
    train_sft(_config(tiny_dir, tmp_path, "run.max_steps=4", "run.seed=1"))
    assert [p.name for p in checkpoint.list_checkpoints(tmp_path / "run")] == ["step-000002", "step-000004"]
    with pytest.raises(ValueError, match=r"run.output_dir: .* already holds a run .*run.overwrite=true"):
        train_sft(_config(tiny_dir, tmp_path, "run.max_steps=2"))
    train_sft(_config(tiny_dir, tmp_path, "run.max_steps=3", "run.overwrite=true"))
    assert [p.name for p in checkpoint.list_checkpoints(tmp_path / "run")] == ["step-000002", "step-000003"]
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == [1, 2, 3]  # nothing of the first run


def test_overwrite_never_clears_a_folder_posttrain_did_not_write(tiny_dir, tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "thesis.tex").write_text("years of work")
    with pytest.raises(ValueError, match="not a posttrain run folder"):
        train_sft(_config(tiny_dir, tmp_path, "run.max_steps=1", "run.overwrite=true"))
    assert (tmp_path / "run" / "thesis.tex").read_text() == "years of work"


def test_resume_refuses_a_changed_config_naming_the_fields_and_allows_a_longer_run(tiny_dir, tmp_path, capsys):
    with pytest.raises(KeyboardInterrupt):
        train_sft(_config(tiny_dir, tmp_path, "run.max_steps=6"), callbacks=[crash_at(3)])
    with pytest.raises(ValueError, match=r"different config \(optim.lr: 0.001 in the checkpoint, 0.002 now\)"):
        train_sft(_config(tiny_dir, tmp_path, "run.max_steps=6", "optim.lr=2e-3", "run.resume_from=latest"))
    # how long to train, how often to save and log may change on a resume
    train_sft(_config(tiny_dir, tmp_path, "run.max_steps=8", "run.save_every=4", "run.resume_from=latest"))
    assert f"resuming from {tmp_path / 'run' / 'checkpoints' / 'step-000002'} (step 2 of 8)" in capsys.readouterr().out


def test_resume_past_max_steps_is_refused_and_latest_without_checkpoint_says_so(tiny_dir, tmp_path, capsys):
    with pytest.raises(KeyboardInterrupt):
        train_sft(_config(tiny_dir, tmp_path, "run.max_steps=6"), callbacks=[crash_at(5)])
    with pytest.raises(ValueError, match="is at step 4, at or past this run's 3 steps"):
        train_sft(_config(tiny_dir, tmp_path, "run.max_steps=3", "run.resume_from=latest"))
    fresh = _config(tiny_dir, tmp_path, "run.max_steps=1", "run.resume_from=latest")
    fresh.run.output_dir = str(tmp_path / "empty")
    train_sft(fresh)
    assert f"resume_from=latest: no checkpoint in {tmp_path / 'empty'}; starting at step 0" in capsys.readouterr().out


def test_latest_without_a_checkpoint_refuses_a_folder_holding_a_run_unless_overwrite(tiny_dir, tmp_path):
    """New-user finding 18: ``resume_from=latest`` on a finished run that saved no checkpoint (the default
    ``save_every=null``) started a new run at step 0 with any config and replaced the old one's
    config.yaml, metrics and final model."""
    train_sft(_config(tiny_dir, tmp_path, "run.max_steps=2", "run.save_every=null"))
    held = {name: (tmp_path / "run" / name).read_bytes() for name in ("config.yaml", "metrics.jsonl")}
    weights = (tmp_path / "run" / "final" / "policy" / "model.safetensors").read_bytes()
    changed = ("run.max_steps=2", "run.save_every=null", "run.resume_from=latest", "optim.lr=1e-4")
    with pytest.raises(ValueError, match=r"holds a run .* but no checkpoint: nothing to resume.*run.overwrite=true"):
        train_sft(_config(tiny_dir, tmp_path, *changed))
    with pytest.raises(SystemExit) as exit_:  # the CLI: one line, exit 2, before anything loads
        main(["sft", *_overrides(tiny_dir, tmp_path, *changed)])
    assert exit_.value.code == 2
    assert {name: (tmp_path / "run" / name).read_bytes() for name in held} == held
    assert (tmp_path / "run" / "final" / "policy" / "model.safetensors").read_bytes() == weights
    # a folder with only a metrics file or only a final model holds a run too
    (tmp_path / "run" / "config.yaml").unlink()
    with pytest.raises(ValueError, match="nothing to resume"):
        train_sft(_config(tiny_dir, tmp_path, *changed))
    # run.overwrite=true: the old run goes, the new one starts at step 0
    (tmp_path / "run" / "config.yaml").write_bytes(held["config.yaml"])
    train_sft(_config(tiny_dir, tmp_path, *changed[1:], "run.max_steps=3", "run.overwrite=true"))
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == [1, 2, 3]
    assert "lr: 0.0001" in (tmp_path / "run" / "config.yaml").read_text()


def test_latest_without_a_checkpoint_refuses_a_folder_of_other_files(tiny_dir, tmp_path):
    """With no checkpoint, ``latest`` starts a fresh run, under a fresh run's rule: an empty or new folder."""
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match=r"run.output_dir: .* already holds"):
        train_sft(_config(tiny_dir, tmp_path, "run.max_steps=1", "run.resume_from=latest"))
    assert (tmp_path / "run" / "notes.txt").read_text() == "mine"


def test_a_finished_run_extended_continues_exactly_from_its_last_step(tiny_dir, tmp_path, capsys):
    """New-user finding 19: the last step wrote no checkpoint even when save_every divided max_steps, so
    extending a finished run (a larger run.max_steps) resumed from an earlier checkpoint and trained its
    last steps again. As Hugging Face Trainer with save_strategy="steps", the last step saves too."""
    constant = ("optim.scheduler=constant", "optim.warmup_steps=0")  # the same lr whatever max_steps is
    straight = _config(tiny_dir, tmp_path, *constant, "run.max_steps=6", f"run.output_dir={tmp_path / 'straight'}")
    train_sft(straight)
    train_sft(_config(tiny_dir, tmp_path, *constant, "run.max_steps=5"))
    assert [p.name for p in checkpoint.list_checkpoints(tmp_path / "run")] == [
        "step-000002",
        "step-000004",
        "step-000005",
    ]
    capsys.readouterr()
    train_sft(_config(tiny_dir, tmp_path, *constant, "run.max_steps=6", "run.resume_from=latest"))
    assert f"resuming from {tmp_path / 'run' / 'checkpoints' / 'step-000005'} (step 5 of 6)" in capsys.readouterr().out
    records = read_metrics(tmp_path / "run")
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert [r["loss"] for r in records] == [r["loss"] for r in read_metrics(tmp_path / "straight")]
    assert records[-1]["time"] >= records[-2]["time"]  # the run's clock continues from the checkpoint's step
    a = load_file(tmp_path / "straight" / "final" / "policy" / "model.safetensors")
    b = load_file(tmp_path / "run" / "final" / "policy" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_resume_cuts_the_records_written_after_the_checkpoint(tiny_dir, tmp_path):
    """Item 6: the steps between the checkpoint and the crash appeared twice in metrics.jsonl."""
    with pytest.raises(KeyboardInterrupt):
        train_sft(_config(tiny_dir, tmp_path, "run.max_steps=6"), callbacks=[crash_at(5)])
    with open(tmp_path / "run" / "metrics.jsonl", "a") as f:
        f.write('{"step": 6, "loss": 1.')  # a line torn by the kill
    for name in ("alerts.jsonl", "eval_samples.jsonl"):  # written by the online trainers' monitor
        (tmp_path / "run" / name).write_text("".join(json.dumps({"step": s, "id": 1}) + "\n" for s in (3, 4, 5)))
    train_sft(_config(tiny_dir, tmp_path, "run.max_steps=6", "run.resume_from=latest"))
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == [1, 2, 3, 4, 5, 6]
    for name in ("alerts.jsonl", "eval_samples.jsonl"):  # records after the checkpoint (step 4) are cut too
        lines = (tmp_path / "run" / name).read_text().splitlines()
        assert [json.loads(line)["step"] for line in lines] == [3, 4], name


def test_a_checkpoint_records_the_config_that_wrote_it(tiny_dir, tmp_path):
    train_sft(_config(tiny_dir, tmp_path, "run.max_steps=2"))
    (ckpt,) = checkpoint.list_checkpoints(tmp_path / "run")
    state = json.loads((ckpt / checkpoint.STATE_FILE).read_text())
    assert (ckpt / checkpoint.CONFIG_FILE).read_text() == (tmp_path / "run" / "config.yaml").read_text()
    assert len(state["config_hash"]) == 64


@pytest.mark.parametrize("scheduler", ["linear", "constant"])
def test_a_resume_that_changes_the_length_says_the_schedule_changes(tiny_dir, tmp_path, capsys, scheduler):
    """New-user finding (third session): raising run.max_steps on resume recomputed a decaying
    learning-rate schedule without a word. Checking it found worse: the first resumed step still took
    the old schedule's rate (restored with the optimizer's state), 0 after a finished linear decay.
    Now the resumed steps follow the new schedule from the first, and the run says so (a constant
    schedule does not change, and nothing is said)."""
    train_sft(_config(tiny_dir, tmp_path, f"optim.scheduler={scheduler}", "run.max_steps=4", "run.save_every=2"))
    capsys.readouterr()
    train_sft(_config(tiny_dir, tmp_path, f"optim.scheduler={scheduler}", "run.max_steps=6", "run.resume_from=latest"))
    out = capsys.readouterr().out
    note = "run.max_steps 4 → 6: the linear learning-rate schedule is recomputed for 6 steps, so from step 4 on"
    assert (note in out) == (scheduler == "linear"), out
    # the rate the resumed run logged at step 5 is the 6-step schedule's: lr · (1 − 4/6)
    records = read_metrics(tmp_path / "run")
    lr = load_config(SFTConfig, None, _overrides(tiny_dir, tmp_path)).optim.lr
    expected = lr * (1 - 4 / 6) if scheduler == "linear" else lr
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert records[4]["lr"] == pytest.approx(expected)


def test_a_run_that_failed_before_its_first_step_leaves_a_folder_the_fixed_rerun_takes(tiny_dir, tmp_path, capsys):
    """Issue 34 (a new user's first hour): a GRPO run whose reward function raised at step 1 left config.yaml,
    step 0's held-out evaluation, TensorBoard events and eval_errors.log, and the rerun with the function
    fixed was refused ("already holds a run"). A folder where no step finished counts as empty: the rerun
    clears it and starts at step 0, without run.overwrite. A folder where a step finished is still refused."""
    (tmp_path / "rw.py").write_text(
        "def broken(prompts, completions, **columns):\n    raise RuntimeError('a bug in my reward')\n\n"
        "def fixed(prompts, completions, **columns):\n    return [float(len(c)) for c in completions]\n"
    )
    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(5) for b in range(5)]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "run"

    def grpo(function, *more):
        argv = ["grpo", f"model.path={tiny_dir / 'policy'}", f"data.path={tmp_path / 'p.jsonl'}"]
        argv += [f"rewards=[{{function: '{tmp_path / 'rw.py'}:{function}', isolation: inline}}]"]
        argv += ["num_generations=2", "run.batch_size=4", "sampling.max_new_tokens=3", "data.chat_template=never"]
        return main([*argv, "data.eval_fraction=0.2", "run.progress=false", f"run.output_dir={out}", *more])

    with pytest.raises((RuntimeError, SystemExit)):  # the reward's error ends the run at step 1
        grpo("broken", "run.max_steps=2")
    capsys.readouterr()
    left = sorted(p.name for p in out.iterdir())
    assert "config.yaml" in left and "metrics.jsonl" in left, left  # what made the rerun refuse it
    assert [r["step"] for r in read_metrics(out)] == [0]
    assert grpo("fixed", "run.max_steps=2") == 0
    assert [r["step"] for r in read_metrics(out)] == [0, 1, 2]  # step 0 once: the failed run's records went
    assert not (out / "eval_errors.log").exists()
    assert "fixed" in (out / "config.yaml").read_text()
    # a folder where a step finished holds a run: still refused without run.overwrite or resume_from
    with pytest.raises(SystemExit) as refused:
        grpo("fixed", "run.max_steps=3")
    assert refused.value.code == 2 and "already holds a run" in capsys.readouterr().err


def test_a_folder_of_the_users_own_files_is_never_taken_for_a_run_that_never_stepped(tmp_path):
    """Review of issue 34's mend above: a folder counts as a run that never stepped only when it holds nothing
    but what a run writes at start, with the config.yaml that run wrote for this folder. A user's own
    config.yaml (naming this folder as run.output_dir), their data beside it, or a config written for another
    folder keep the fresh run's refusal: clearing them would delete the user's files."""
    from posttrain.runtime.inputs import never_stepped

    out = tmp_path / "exp"
    out.mkdir()
    (out / "config.yaml").write_text(f"model: {{path: m}}\nrun: {{output_dir: {out}}}\n")
    assert not never_stepped(out)  # a hand-written config alone: no run opened its records here
    (out / "metrics.jsonl").write_text('{"step": 0, "eval/greedy/score": 0.5}\n')
    (out / "tensorboard").mkdir()
    assert never_stepped(out)  # what a run that failed at step 1 leaves
    (out / "train.jsonl").write_text('{"prompt": "1+1=", "completion": "2"}\n')
    assert not never_stepped(out)  # a file of the user's beside it
    (out / "train.jsonl").unlink()
    (out / "config.yaml").write_text(f"run: {{output_dir: {tmp_path / 'elsewhere'}}}\n")
    assert not never_stepped(out)  # a config written for another folder
    (out / "config.yaml").write_text("- not: a config\n")
    assert not never_stepped(out)
    (out / "config.yaml").write_text(f"run: {{output_dir: {out}}}\n")
    (out / "metrics.jsonl").write_text('{"step": 0}\n{"step": 1}\n')
    assert not never_stepped(out)  # a step finished
