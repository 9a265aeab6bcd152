"""Faults of issue 24, round three (items 9-12, 14): rewards whose group statistics overflowed float32, a disk
that fills during a checkpoint save, a truncated checkpoint, SIGTERM / SIGINT during training, and two runs
on one run folder."""

import errno
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from helpers import sft_args, signal_when

from posttrain.core import group_advantages, rloo_advantages
from posttrain.core.advantages import NonFiniteGroupError
from posttrain.errors import UserError
from posttrain.rewards import RewardError
from posttrain.runtime import checkpoint
from posttrain.runtime.config import load_config
from posttrain.runtime.metrics import read_metrics
from posttrain.runtime.runlock import LOCK_FILE
from posttrain.trainers.sft import SFTConfig
from posttrain.trainers.sft import train as train_sft


def _sft(tiny_dir, tmp_path, *overrides):
    return load_config(SFTConfig, None, sft_args(tiny_dir, tmp_path, *overrides))


def _posttrain() -> list[str]:
    """The installed ``posttrain`` command of this environment (``python -m posttrain.cli`` without it)."""
    script = Path(sys.executable).parent / "posttrain"
    return [str(script)] if script.exists() else [sys.executable, "-m", "posttrain.cli"]


def _steps(run: Path) -> list[int]:
    return [int(p.name.split("-")[1]) for p in checkpoint.list_checkpoints(run)]


# -- item 9: group statistics in float64 --------------------------------------------------------------------


def test_group_statistics_are_float64_and_an_overflow_names_the_row():
    """Rewards 0 and 1e30 in one group: in float32 the squared deviations overflowed (std = inf) and every
    advantage was silently 0; in float64 they are ±1/√2 as for any two different rewards."""
    rewards = torch.tensor([0.0, 1e30, 1.0, 1.0])
    half = 1 / math.sqrt(2)
    for scale in ("group", "batch"):
        advantages = group_advantages(rewards, 2, scale=scale)
        assert advantages.dtype == torch.float32 and bool(advantages.isfinite().all()), scale
        assert advantages[1] > 0.7 and advantages[0] < -0.7 and advantages[2:].tolist() == [0.0, 0.0]
    torch.testing.assert_close(group_advantages(rewards, 2), torch.tensor([-half, half, 0.0, 0.0]))
    # leave-one-out: 3e38 + 3e38 overflowed float32 into inf baselines
    assert rloo_advantages(torch.tensor([3e38, 3e38, 3e38, 0.0]), 4).isfinite().all()
    # beyond what float64 can square, the row is named instead of training on advantages of 0
    with pytest.raises(NonFiniteGroupError, match=r"reward 1e\+200 \(row 3\) makes the std of its group \(rows 2-3\)"):
        group_advantages(torch.tensor([1.0, 2.0, 0.0, 1e200], dtype=torch.float64), 2)
    with pytest.raises(NonFiniteGroupError, match=r"row 3.*the batch"):
        group_advantages(torch.tensor([1.0, 2.0, 0.0, 1e200], dtype=torch.float64), 2, scale="batch")


def _grpo_config(tiny_dir, tmp_path, reward_source: str, *overrides):
    from posttrain.trainers.grpo import GRPOConfig

    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "rewards.py").write_text(textwrap.dedent(reward_source))
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"prompt": f"{i}+1="}) + "\n" for i in range(8)))
    base = [
        f"model.path={tiny_dir / 'policy'}",
        f"data.path={tmp_path / 'prompts.jsonl'}",
        "data.chat_template=never",
        f"run.output_dir={tmp_path / 'grpo'}",
        "run.progress=false",
        "run.report_to=[jsonl]",
        f"rewards=[{{function: '{tmp_path / 'rewards.py'}:reward'}}]",
        "sampling.max_new_tokens=3",
        "kl_coef=0",
        "num_generations=2",
        "run.batch_size=4",
    ]
    return load_config(GRPOConfig, None, base + list(overrides))


def test_grpo_learns_from_a_reward_of_1e30_and_a_float32_overflow_names_function_and_sample(tiny_dir, tmp_path):
    """Item 9 through the trainer: 0 and 1e30 in one group gave advantages/std 0 (nothing learned, exit 0).
    A weighted sum beyond float32 (whose group statistics float64 could still hold, but the float32 scores
    cannot) is refused where rewards are combined, naming the function, the sample and the value."""
    from posttrain.trainers.grpo import train as train_grpo

    huge = """
        def reward(prompts, completions, **columns):
            return [1e30 * (i % 2) for i in range(len(completions))]
    """
    train_grpo(_grpo_config(tiny_dir, tmp_path, huge, "run.max_steps=1"))
    (record,) = read_metrics(tmp_path / "grpo")
    assert record["advantages/std"] > 0.5, record  # ±0.707 in every group: the policy learns from it
    beyond = """
        def reward(prompts, completions, **columns):
            return [1e39 * (i % 2) for i in range(len(completions))]
    """
    with pytest.raises(RewardError, match=r"completion 1 is 1e\+39, beyond float32 .*'reward': 1e\+39.*prompt '"):
        train_grpo(_grpo_config(tiny_dir, tmp_path / "beyond", beyond, "run.max_steps=1"))


# -- item 10: a full disk during a checkpoint save ------------------------------------------------------------


def _fill_disk_with(kind: str):
    """A stand-in for a full disk. A real one cannot be made here without root (a small tmpfs or loop
    device needs mount rights) and would fill up for every other test: the functions that write a
    checkpoint's files fail the way they do on a full disk, after writing part of their file."""
    if kind == "torch":  # torch.save (accelerate's optimizer, scheduler and RNG files)

        def failing(obj, f, *args, **kwargs):
            Path(f).write_bytes(b"\0" * 100)
            raise RuntimeError(
                "[enforce fail at inline_container.cc:603] . unexpected pos 64 vs 0: basic_ios::clear: iostream error"
            )

        return "torch.save", failing

    def failing_write(tensors, filename, *args, **kwargs):  # safetensors (the model's weights)
        Path(filename).write_bytes(b"\0" * 100)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    return "transformers.modeling_utils.safe_save_file", failing_write


@pytest.mark.parametrize("kind", ["torch", "safetensors"])
def test_a_full_disk_during_a_save_says_so_removes_the_partial_folder_and_keeps_older_checkpoints(
    tiny_dir, tmp_path, monkeypatch, kind
):
    """Item 10: a full disk raised ``RuntimeError: basic_ios::clear: iostream error``, left the
    .tmp-step-* folder holding the space, and the next resume failed for want of it."""
    run = tmp_path / "run"
    target, failing = _fill_disk_with(kind)

    def disk_fills_after_step_2(done, record):
        if done == 1:  # what a save killed earlier left behind: removed by the next save
            (run / "checkpoints" / ".tmp-step-000001" / "state").mkdir(parents=True)
        if done == 2:
            monkeypatch.setattr(target, failing)

    config = _sft(tiny_dir, tmp_path, "run.max_steps=6", "run.save_every=2", "run.keep_last=5")
    with pytest.raises(checkpoint.DiskFullError) as err:
        train_sft(config, callbacks=[disk_fills_after_step_2])
    tmp = run / "checkpoints" / ".tmp-step-000004"
    message = str(err.value)
    assert f"checkpoint step 4: no space left on device writing {tmp}" in message, message
    assert f"older checkpoints are kept (latest: {run / 'checkpoints' / 'step-000002'})" in message
    assert "\n" not in message and isinstance(err.value, UserError)  # one line (the CLI prints it so, exit 2)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-000002"]  # no .tmp-step-* left
    monkeypatch.undo()
    train_sft(
        _sft(tiny_dir, tmp_path, "run.max_steps=6", "run.save_every=2", "run.keep_last=5", "run.resume_from=latest")
    )
    assert _steps(run) == [2, 4, 6]
    assert [r["step"] for r in read_metrics(run)] == [1, 2, 3, 4, 5, 6]


# -- item 11: a checkpoint with an empty file ---------------------------------------------------------------


@pytest.mark.parametrize("damaged", ["hf/policy/model.safetensors", "state/optimizer.bin"])
def test_resume_skips_a_checkpoint_with_an_empty_file_for_the_newest_complete_one(tiny_dir, tmp_path, capsys, damaged):
    """Item 11: a 0-byte model.safetensors or optimizer.bin in the latest checkpoint stopped the resume with
    a raw SafetensorError / EOFError. Each checkpoint now ends with a manifest of its files' sizes."""
    run = tmp_path / "run"
    keep = ("run.save_every=2", "run.keep_last=5")
    train_sft(_sft(tiny_dir, tmp_path, "run.max_steps=4", *keep))
    manifest = json.loads((run / "checkpoints" / "step-000004" / checkpoint.MANIFEST_FILE).read_text())["files"]
    assert manifest[damaged] > 0 and checkpoint.STATE_FILE in manifest
    (run / "checkpoints" / "step-000004" / damaged).write_bytes(b"")
    latest = _sft(tiny_dir, tmp_path, "run.max_steps=5", *keep, "run.resume_from=latest")
    # named explicitly, a damaged checkpoint is refused in one line, pointing at latest
    named = _sft(tiny_dir, tmp_path, "run.max_steps=5", *keep, f"run.resume_from={run / 'checkpoints' / 'step-000004'}")
    with pytest.raises(checkpoint.IncompleteCheckpointError, match=f"is damaged: {damaged} has 0 bytes"):
        train_sft(named)
    capsys.readouterr()
    train_sft(latest)
    out = capsys.readouterr().out
    assert f"checkpoint {run / 'checkpoints' / 'step-000004'} is damaged: {damaged} has 0 bytes" in out
    assert f"resuming from {run / 'checkpoints' / 'step-000002'} (step 2 of 5)" in out
    assert [r["step"] for r in read_metrics(run)] == [1, 2, 3, 4, 5]


def test_a_checkpoint_without_a_manifest_still_resumes_and_every_damaged_one_is_refused(tiny_dir, tmp_path, capsys):
    """A checkpoint written before manifests existed loads as before; one with an empty weight file is
    skipped all the same; when no checkpoint is complete the run says so instead of starting over."""
    run = tmp_path / "run"
    keep = ("run.save_every=2", "run.keep_last=5")
    train_sft(_sft(tiny_dir, tmp_path, "run.max_steps=4", *keep))
    for step in ("step-000002", "step-000004"):
        (run / "checkpoints" / step / checkpoint.MANIFEST_FILE).unlink()
    shutil.copytree(run, tmp_path / "copy")
    capsys.readouterr()
    train_sft(_sft(tiny_dir, tmp_path, "run.max_steps=5", *keep, "run.resume_from=latest"))
    assert f"resuming from {run / 'checkpoints' / 'step-000004'} (step 4 of 5)" in capsys.readouterr().out
    for step in ("step-000002", "step-000004"):  # old checkpoints: an empty weight file is still seen
        (tmp_path / "copy" / "checkpoints" / step / "hf" / "policy" / "model.safetensors").write_bytes(b"")
    copy = _sft(
        tiny_dir, tmp_path, "run.max_steps=5", *keep, "run.resume_from=latest", f"run.output_dir={tmp_path / 'copy'}"
    )
    with pytest.raises(checkpoint.IncompleteCheckpointError, match=r"every checkpoint in .* is damaged: step-000004"):
        train_sft(copy)
    assert [r["step"] for r in read_metrics(tmp_path / "copy")] == [1, 2, 3, 4]  # nothing started over


# -- item 12: SIGTERM / SIGINT ------------------------------------------------------------------------------


def test_sigterm_saves_a_checkpoint_says_where_and_exits_143_and_latest_resumes_it(tiny_dir, tmp_path, capsys):
    """Item 12: SIGTERM (what schedulers and ``kill`` send first) ended the run at once with exit 143, no
    checkpoint and no message, and ``resume_from=latest`` then found nothing. A real ``posttrain sft``
    process, signalled by the test once it has logged two steps."""
    run = tmp_path / "run"
    args = sft_args(tiny_dir, tmp_path, "run.max_steps=100000", "optim.scheduler=constant")
    proc = subprocess.Popen([*_posttrain(), "sft", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def two_steps():
        return (run / "metrics.jsonl").is_file() and len((run / "metrics.jsonl").read_text().splitlines()) >= 2

    out, err = signal_when(proc, two_steps, "the run logged no two steps", signal.SIGTERM, poll=0.2)
    assert proc.returncode == 143, (out, err)
    (step,) = _steps(run)  # run.save_every is null: the signal's checkpoint is the only one
    where = run / "checkpoints" / f"step-{step:06d}"
    line = f"[run] stopped by SIGTERM after step {step} of 100000: checkpoint saved at {where}; continue the run"
    assert line in err and "Traceback" not in err, err
    assert [r["step"] for r in read_metrics(run)] == list(range(1, step + 1))
    train_sft(
        _sft(tiny_dir, tmp_path, f"run.max_steps={step + 2}", "optim.scheduler=constant", "run.resume_from=latest")
    )
    assert f"resuming from {where} (step {step} of {step + 2})" in capsys.readouterr().out
    assert [r["step"] for r in read_metrics(run)] == list(range(1, step + 3))


@pytest.fixture
def sigint_as_in_a_terminal():
    """Python's own SIGINT handler, as in a terminal: a test run started in the background (by a script, a CI
    runner) ignores SIGINT, and a run leaves an ignored signal ignored."""
    original = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, original)


def test_sigint_in_an_online_run_saves_and_exits_130(tiny_dir, tmp_path, sigint_as_in_a_terminal):
    """The online loop (PPO, GRPO) the same way; SIGINT (Ctrl-C) exits 130 instead of a KeyboardInterrupt
    traceback that lost the run. After the run the previous handlers are back."""
    from posttrain.runtime.signals import TrainingInterrupted
    from posttrain.trainers.grpo import train as train_grpo

    reward = """
        def reward(prompts, completions, **columns):
            return [float(len(c)) for c in completions]
    """
    previous = signal.getsignal(signal.SIGINT)

    def interrupt(done, record):
        if done == 1:
            os.kill(os.getpid(), signal.SIGINT)

    with pytest.raises(TrainingInterrupted) as stopped:
        train_grpo(_grpo_config(tiny_dir, tmp_path, reward, "run.max_steps=4"), callbacks=[interrupt])
    assert stopped.value.code == 130
    assert stopped.value.checkpoint == tmp_path / "grpo" / "checkpoints" / "step-000001"
    assert _steps(tmp_path / "grpo") == [1]
    assert signal.getsignal(signal.SIGINT) is previous
    assert not (tmp_path / "grpo" / LOCK_FILE).exists()  # the run's lock went with it (item 14)
    train_grpo(_grpo_config(tiny_dir, tmp_path, reward, "run.max_steps=2", "run.resume_from=latest"))
    assert [r["step"] for r in read_metrics(tmp_path / "grpo")] == [1, 2]


def test_a_second_signal_exits_at_once_without_saving(tiny_dir, tmp_path):
    """The first signal asks for a checkpoint after the step; a second one ends the process by the signal
    itself, now (a process must remain killable when its save hangs)."""
    script = textwrap.dedent(
        f"""
        import os, signal, time
        signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal (see sigint_as_in_a_terminal)
        from posttrain.runtime.config import load_config
        from posttrain.trainers.sft import SFTConfig, train

        def twice(done, record):
            if done == 2:
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.2)
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(30)  # never reached

        train(load_config(SFTConfig, None, {sft_args(tiny_dir, tmp_path, "run.max_steps=10")!r}), [twice])
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == -signal.SIGINT, (done.stdout, done.stderr)
    assert "SIGINT again: exiting now, without a checkpoint" in done.stderr
    assert _steps(tmp_path / "run") == []


# -- item 14: one run per run folder ------------------------------------------------------------------------


def test_a_second_run_on_a_folder_in_use_stops_at_start_naming_the_first(tiny_dir, tmp_path, monkeypatch):
    """Item 14: two runs on one output_dir both ran to the end, every step twice in metrics.jsonl. The first
    run's lock is held here by a process that took it as a run does (``runlock.lock_run_dir``)."""
    run = tmp_path / "run"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"import time; from posttrain.runtime.runlock import lock_run_dir; lock_run_dir({str(run)!r}); "
            "print('locked', flush=True); time.sleep(120)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(
            UserError, match=rf"run.output_dir: {run} is in use by another posttrain run \(PID {holder.pid}, since"
        ):
            train_sft(_sft(tiny_dir, tmp_path, "run.max_steps=1"))
        cli = subprocess.run(
            [*_posttrain(), "sft", *sft_args(tiny_dir, tmp_path, "run.max_steps=1")],
            capture_output=True,
            text=True,
        )
        assert cli.returncode == 2, cli.stderr
        assert f"is in use by another posttrain run (PID {holder.pid}, since" in cli.stderr
        assert len(cli.stderr.strip().splitlines()) == 1, cli.stderr
        assert sorted(p.name for p in run.iterdir()) == [LOCK_FILE]  # the second run wrote nothing
        with monkeypatch.context() as m:  # under torchrun only rank 0 takes the lock
            m.setenv("RANK", "1")
            from posttrain.runtime.runlock import lock_run_dir

            assert lock_run_dir(run) is False
    finally:
        holder.kill()
        holder.wait()
    # killed without releasing: the kernel dropped the lock, the file left behind blocks nothing
    train_sft(_sft(tiny_dir, tmp_path, "run.max_steps=1"))
    assert [r["step"] for r in read_metrics(run)] == [1]
    assert not (run / LOCK_FILE).exists()
