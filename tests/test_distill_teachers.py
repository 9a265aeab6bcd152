"""Distillation from several teachers (issue 38 item 5): each prompt row names its teacher, each teacher grades
its own rows in one no-grad pass, results back in row order, logged per teacher."""

import json
import re
from dataclasses import replace

import pytest
import torch
from helpers import distill_args, one_line
from safetensors.torch import load_file

from posttrain.cli import main
from posttrain.core import reverse_kl_advantages
from posttrain.data.synthetic import arithmetic_sft
from posttrain.errors import UserError
from posttrain.models import ModelConfig, load_tokenizer
from posttrain.models.loading import load_causal_lm
from posttrain.models.roles import Reference
from posttrain.rollout import SamplingParams
from posttrain.runtime.config import load_config
from posttrain.runtime.metrics import read_metrics
from posttrain.runtime.online import reference_logprobs
from posttrain.trainers.distill import DistillConfig, DistillTrainer, by_teacher
from posttrain.trainers.distill import train as train_distill


@pytest.fixture(scope="module")
def teachers(tmp_path_factory):
    """Two tiny teachers from other seeds than the student (seed 0), with the student's tokenizer."""
    from posttrain.models.tiny import build_tiny

    root = tmp_path_factory.mktemp("teachers")
    return {"sums": str(build_tiny(root / "sums", seed=3)), "other": str(build_tiny(root / "other", seed=4))}


@pytest.fixture
def mixed(tmp_path):
    """64 prompt rows: ``teacher`` sums, other, sums, none (the column absent: the default teacher), ..."""
    rows = []
    for i, r in enumerate(arithmetic_sft(64, seed=1, low=0, high=9)):
        row = {"prompt": r["prompt"], "answer": r["answer"]}
        if i % 4 != 3:
            row["teacher"] = ("sums", "other")[i % 4 % 2]
        rows.append(row)
    path = tmp_path / "mixed.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _teachers_arg(teachers: dict[str, str]) -> str:
    return "teachers={" + ", ".join(f"{k}: {{path: {v}}}" for k, v in teachers.items()) + "}"


def _config(student, teachers, prompts, out, *overrides) -> DistillConfig:
    base = [*distill_args(student, prompts, out), _teachers_arg(teachers), "default_teacher=other", "log_completions=0"]
    return load_config(DistillConfig, None, base + list(overrides))


def _rollout(trainer, T=5):
    """16 sampled responses of exactly T tokens to the run's first 8 prompts (2 each), with their columns."""
    torch.manual_seed(0)
    prompts = trainer.prompts[:8]
    rollout = trainer.engine.generate(
        [p.prompt_ids for p in prompts], SamplingParams(max_new_tokens=T, min_new_tokens=T), n=2
    )
    rollout.columns = {"teacher": [p.columns.get("teacher") for p in prompts for _ in range(2)]}
    return rollout


def _alone(path: str) -> Reference:
    return Reference(model=load_causal_lm(ModelConfig(path=path, device="cpu")))


def test_each_teacher_grades_its_rows_as_it_does_alone(tiny_dir, teachers, mixed, tmp_path):
    """The step's teacher log-probs of each row are exactly those of the row's teacher called alone on its rows
    (the same micro-batches), the rows without a teacher going to default_teacher; the two teachers differ, so a
    row graded by the wrong one would show; other micro-batch sizes give the same numbers."""
    trainer = DistillTrainer(_config(str(tiny_dir / "policy"), teachers, mixed, tmp_path / "run"))
    rollout = _rollout(trainer)
    rows_of = trainer.teacher_rows(rollout)
    names = rollout.columns["teacher"]
    assert rows_of["sums"] == [i for i, n in enumerate(names) if n == "sums"]
    assert rows_of["other"] == [i for i, n in enumerate(names) if n in ("other", None)]
    assert len(rows_of["sums"]) >= 4 and len(rows_of["other"]) >= 4 and None in names  # interleaved, with defaults
    got = trainer.teacher_logprobs(rollout, rows_of)
    assert got.shape == rollout.response_ids.shape
    for name, rows in rows_of.items():
        alone = reference_logprobs(_alone(teachers[name]), rollout.select(rows), 16, torch.device("cpu"))
        assert torch.equal(got[rows], alone), name
        other = teachers["other" if name == "sums" else "sums"]
        wrong = reference_logprobs(_alone(other), rollout.select(rows), 16, torch.device("cpu"))
        assert (got[rows] - wrong).abs().max() > 0.1, name
    for micro in (1, 5):
        trainer.config.run.micro_batch_size = micro
        torch.testing.assert_close(trainer.teacher_logprobs(rollout, rows_of), got, rtol=1e-5, atol=1e-6)


def test_by_teacher_puts_each_result_back_in_its_row():
    seen = []

    def forward(teacher, rows):
        seen.append((teacher, rows))
        return torch.tensor([[10.0 * (teacher == "b") + r] for r in rows])

    out = by_teacher({"a": [0, 3], "b": [1, 2, 4], "c": []}, 5, forward)
    assert out.tolist() == [[0.0], [11.0], [12.0], [3.0], [14.0]]
    assert seen == [("a", [0, 3]), ("b", [1, 2, 4])]  # one call per teacher with rows, none for an idle one


@pytest.mark.parametrize("loss", ["reverse_kl", "jsd"])
def test_the_update_with_several_teachers_is_micro_batch_invariant(tiny_dir, teachers, mixed, tmp_path, loss):
    """One micro-batch of 16 rows, 16 of 1 and 5 + 5 + 5 + 1 (micro-batches holding one teacher's rows or
    both teachers') give one gradient; with loss=jsd the teachers' whole distributions are read inside the update,
    and the teacher log-probs it returns equal those of the teacher pass of loss=reverse_kl."""
    trainer = DistillTrainer(
        _config(str(tiny_dir / "policy"), teachers, mixed, tmp_path / "mb", f"loss={loss}", "optim.max_grad_norm=null")
    )
    rollout = _rollout(trainer)
    mask = rollout.response_mask
    old = torch.where(mask.bool(), rollout.logprobs, 0.0)
    teacher = trainer.teacher_logprobs(rollout, trainer.teacher_rows(rollout))
    advantages = reverse_kl_advantages(old, teacher, mask) if loss == "reverse_kl" else None

    def grads():
        model = trainer.actor.model
        saved = {k: v.clone() for k, v in model.state_dict().items()}
        out = {}
        hook = trainer.actor.optimizer.optimizer.register_step_pre_hook(
            lambda opt, args, kwargs: out.update({id(p): p.grad.clone() for g in opt.param_groups for p in g["params"]})
        )
        _, from_update = trainer.update(0, rollout, old, advantages, mask)
        hook.remove()
        model.load_state_dict(saved)
        return out, from_update

    whole, from_update = grads()
    assert max(float(g.abs().max()) for g in whole.values()) > 1e-4
    if loss == "jsd":
        valid = mask.bool()
        torch.testing.assert_close(from_update[valid], teacher[valid], rtol=1e-5, atol=1e-5)
    for micro in (1, 5):
        trainer.config.run.micro_batch_size = micro
        split, _ = grads()
        for key in whole:
            torch.testing.assert_close(split[key], whole[key], rtol=1e-4, atol=1e-7)


def test_a_run_logs_each_teacher_and_one_teacher_under_teachers_is_the_single_teacher(
    tiny_dir, teachers, mixed, tmp_path
):
    """Two steps with both teachers: distill/<teacher>/* for each, their rows adding up to the batch and their
    tokens' reverse KL to the overall one. ``teachers`` with one teacher that grades every row takes the same
    steps, bit for bit, as ``teacher`` (the single-teacher path)."""
    student = str(tiny_dir / "policy")
    config = _config(student, teachers, mixed, tmp_path / "two", "run.max_steps=2")
    train_distill(config)
    for record in read_metrics(config.run.output_dir):
        rows = [record[f"distill/{t}/rows"] for t in teachers]
        tokens = [record[f"distill/{t}/tokens"] for t in teachers]
        assert sum(rows) == 16 and min(rows) > 0
        kl = [record[f"distill/{t}/reverse_kl"] for t in teachers]
        mixed_kl = sum(k * n for k, n in zip(kl, tokens, strict=True)) / sum(tokens)
        assert mixed_kl == pytest.approx(record["distill/reverse_kl"], rel=1e-6)
        assert all(record[f"distill/{t}/teacher_logprob"] < 0 for t in teachers)
        assert record["passes/teacher"] >= 1

    one = {"sums": teachers["sums"]}
    plain = tmp_path / "plain.jsonl"  # the rows without their teacher column: default_teacher grades them
    plain.write_text("".join(json.dumps({"prompt": json.loads(r)["prompt"]}) + "\n" for r in open(mixed)))
    common = ["run.max_steps=2", "loss=jsd", "default_teacher=sums"]
    train_distill(_config(student, one, plain, tmp_path / "one", *common))
    single = _config(student, one, plain, tmp_path / "single", *common)
    train_distill(replace(single, teachers={}, default_teacher=None, teacher=ModelConfig(path=teachers["sums"])))
    a = load_file(tmp_path / "one" / "final" / "policy" / "model.safetensors")
    b = load_file(tmp_path / "single" / "final" / "policy" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    one_kl = [r["distill/reverse_kl"] for r in read_metrics(tmp_path / "one")]
    assert one_kl == [r["distill/reverse_kl"] for r in read_metrics(tmp_path / "single")]
    assert [r["distill/sums/reverse_kl"] for r in read_metrics(tmp_path / "one")] == pytest.approx(one_kl, rel=1e-9)


def test_a_row_naming_no_known_teacher_stops_the_run_at_start_in_one_line(tiny_dir, teachers, mixed, tmp_path, capsys):
    lines = open(mixed).read().splitlines()
    lines[5] = json.dumps({"prompt": "7+1=", "answer": "8", "teacher": "physics"})
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join(lines) + "\n")
    args = ["distill", f"model.path={tiny_dir / 'policy'}", _teachers_arg(teachers), f"data.path={bad}"]
    args += ["data.chat_template=never", f"run.output_dir={tmp_path / 'x'}", "run.batch_size=8"]
    with pytest.raises(SystemExit) as stop:
        main([*args, "default_teacher=other"])
    one_line(
        stop.value.code,
        capsys.readouterr().err,
        "distill",
        "the row whose prompt is '7+1=' (teacher_column=teacher) names the teacher 'physics', which is not one of "
        "sums, other",
    )
    with pytest.raises(SystemExit) as stop:  # the rows without a teacher, and no default_teacher
        main([*args[:3], f"data.path={mixed}", *args[4:5], f"run.output_dir={tmp_path / 'y'}", *args[6:]])
    assert "names no teacher: give it one of sums, other" in capsys.readouterr().err and stop.value.code == 2


def test_a_data_path_with_braces_is_named_as_it_is(tiny_dir, teachers, mixed, tmp_path):
    from types import SimpleNamespace

    from posttrain.trainers.distill import _shown

    folder = tmp_path / "runs{0}{x}"  # str.format read these as fields: an IndexError, not the row's message
    folder.mkdir()
    lines = open(mixed).read().splitlines()
    lines[5] = json.dumps({"prompt": "7+1={}", "answer": "8", "teacher": "physics"})
    bad = folder / "bad.jsonl"
    bad.write_text("\n".join(lines) + "\n")
    config = _config(str(tiny_dir / "policy"), teachers, str(bad), tmp_path / "out")
    with pytest.raises(UserError, match=re.escape(f"data.path={bad}: the row whose prompt is '7+1={{}}'")):
        DistillTrainer(config)
    # a multimodal message: its content a list of parts, shown as text
    parts = [{"type": "text", "text": "what is 7+1?"}]
    assert _shown(SimpleNamespace(prompt=[{"role": "user", "content": parts}])) == str(parts)[:60]


def test_every_teacher_must_share_the_students_tokenizer(tiny_dir, teachers, mixed, tmp_path):
    from posttrain.models.tiny import build_tiny

    other = build_tiny(tmp_path / "other_tokens", seed=5)
    extended = load_tokenizer(str(other))
    extended.add_tokens(["<extra>"])  # one token more: the student's ids no longer mean the same to it
    extended.save_pretrained(other)
    config = _config(str(tiny_dir / "policy"), {**teachers, "odd": str(other)}, mixed, tmp_path / "tok")
    with pytest.raises(UserError, match=re.escape(f"teachers.odd.path={other}: its tokenizer is not the student's")):
        DistillTrainer(config)


def test_the_teachers_settings_are_checked_at_start(tiny_dir, teachers, mixed, tmp_path):
    student, out = str(tiny_dir / "policy"), tmp_path / "cfg"
    for overrides, message in (
        ([f"teacher.path={teachers['sums']}"], "teacher.path=.* and teachers=\\['other', 'sums'\\] are both set"),
        (["default_teacher=physics"], "default_teacher='physics' is not one of the teachers \\(sums, other\\)"),
        (["teacher_column=prompt"], "teacher_column='prompt' must name a column"),
        (["teacher_scoring.engine=vllm"], "teacher_scoring.engine=vllm grades with one teacher's engine"),
        (["teachers={'a b': {path: x}}"], "teachers: the name 'a b' must be letters"),
        (["teachers={a: {path: x, lora: {r: 4}}}"], "teachers.a.lora=.* is not used: the teacher is frozen"),
        (["teachers={a: {dtype: float32}}"], "teachers.a.path is required"),
        (["teachers={a: {pth: x}}"], "unknown config key 'teachers.a.pth'"),
    ):
        with pytest.raises(ValueError, match=message):
            _config(student, teachers, mixed, out, *overrides)
    with pytest.raises(ValueError, match="teacher_column='topic' is read with teachers only"):
        load_config(
            DistillConfig, None, [f"model.path={student}", "teacher.path=t", "data.path=d", "teacher_column=topic"]
        )
    with pytest.raises(ValueError, match="teacher.path is required: .* \\(or teachers:"):
        load_config(DistillConfig, None, [f"model.path={student}", "data.path=d"])
    # from Python, a teacher's section may be a mapping of its fields, as YAML gives it
    config = DistillConfig(
        model=ModelConfig(path=student), teachers={"a": {"path": teachers["sums"]}}, default_teacher="a"
    )
    config.data.path = mixed
    config.validate()
    assert config.teachers["a"] == ModelConfig(path=teachers["sums"])


@pytest.mark.parametrize(
    "launch",
    [{"ACCELERATE_USE_FSDP": "true"}, {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3"}],
)
def test_several_teachers_under_a_sharded_engine_are_refused_at_start(
    tiny_dir, teachers, mixed, tmp_path, monkeypatch, launch
):
    """A sharded teacher needs the same forwards on every process, and the processes' rows name other teachers."""
    from posttrain.runtime import inputs

    config = _config(str(tiny_dir / "policy"), teachers, mixed, tmp_path / "sharded")
    inputs.check_engines(config)  # plain launch: fine
    for key, value in launch.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(inputs, "_installed", lambda package: True)
    with pytest.raises(UserError, match="teachers \\(2\\) under FSDP2 or DeepSpeed ZeRO-3"):
        inputs.check_engines(config)
    inputs.check_engines(
        replace(config, teachers={"sums": config.teachers["sums"]})
    )  # one teacher: every process alike
