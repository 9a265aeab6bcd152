"""On-policy distillation: the divergences by hand in float64, their ends and zeros, masks, micro-batch
invariance, a teacher equal to the student at step 1, the vocabulary check, and the reverse KL falling."""

import json
import math
from dataclasses import replace

import numpy as np
import pytest
import torch
from helpers import assert_close, crash_at, distill_args
from safetensors.torch import load_file

from posttrain.cli import main
from posttrain.core import aggregate_loss, generalized_jsd, ppo_policy_loss, reverse_kl_advantages, vocab_kl
from posttrain.data.synthetic import arithmetic_sft
from posttrain.errors import UserError
from posttrain.models import load_tokenizer
from posttrain.rollout import SamplingParams
from posttrain.runtime.config import load_config
from posttrain.runtime.metrics import read_metrics
from posttrain.trainers.distill import (
    DistillConfig,
    DistillTrainer,
    check_same_vocabulary,
    completions_rollout,
    gkd_on_policy_steps,
)
from posttrain.trainers.distill import train as train_distill

# P = the teacher, Q = the student, as the paper names them; logits = log-probs
P, Q = [0.5, 0.5], [0.9, 0.1]


def _logits(*rows) -> torch.Tensor:
    """[1, T, V] float64 logits whose softmax is each row."""
    return torch.tensor([[[math.log(p) for p in row] for row in rows]], dtype=torch.float64)


def _np_kl(p, q) -> float:
    p, q = np.asarray(p, dtype=np.float64), np.asarray(q, dtype=np.float64)
    return float(np.sum(p * (np.log(p) - np.log(q))))


def _np_softmax(z, tau=1.0):
    z = np.asarray(z, dtype=np.float64) / tau
    e = np.exp(z - z.max())
    return e / e.sum()


# -- the divergences by hand ----------------------------------------------------------------------------


def test_vocab_kl_and_generalized_jsd_by_hand():
    teacher, student, mask = _logits(P), _logits(Q), torch.ones(1, 1)
    forward = 0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(0.5 / 0.1)  # KL(P‖Q) = 0.5108
    reverse = 0.9 * math.log(0.9 / 0.5) + 0.1 * math.log(0.1 / 0.5)  # KL(Q‖P) = 0.3681
    assert_close(vocab_kl(torch.log_softmax(teacher, -1), torch.log_softmax(student, -1)), [[forward]])
    assert_close(vocab_kl(torch.log_softmax(student, -1), torch.log_softmax(teacher, -1)), [[reverse]])
    # β = 0.5: M = (0.7, 0.3)
    half = 0.5 * (0.5 * math.log(0.5 / 0.7) + 0.5 * math.log(0.5 / 0.3)) + 0.5 * (
        0.9 * math.log(0.9 / 0.7) + 0.1 * math.log(0.1 / 0.3)
    )
    assert_close(generalized_jsd(student, teacher, mask, beta=0.5), [[half]])
    # β = 0.25: M = 0.25·P + 0.75·Q = (0.8, 0.2)
    quarter = 0.25 * (0.5 * math.log(0.5 / 0.8) + 0.5 * math.log(0.5 / 0.2)) + 0.75 * (
        0.9 * math.log(0.9 / 0.8) + 0.1 * math.log(0.1 / 0.2)
    )
    assert_close(generalized_jsd(student, teacher, mask, beta=0.25), [[quarter]])
    # τ = 2: softmax(log q / 2) ∝ √q, so Q becomes (3/4, 1/4) and P stays (1/2, 1/2)
    assert_close(generalized_jsd(student, teacher, mask, beta=1.0, temperature=2.0), [[_np_kl([0.75, 0.25], P)]])
    assert_close(
        generalized_jsd(student, teacher, mask, beta=1.0, temperature=2.0),
        [[0.75 * math.log(1.5) + 0.25 * math.log(0.5)]],
    )


def test_generalized_jsd_matches_numpy_on_a_larger_vocabulary():
    rng = np.random.default_rng(0)
    zs, zt = rng.normal(size=(2, 3, 7)), rng.normal(size=(2, 3, 7)) * 2
    for beta in (0.1, 0.5, 0.9):
        for tau in (1.0, 0.7):
            expected = np.zeros((2, 3))
            for b in range(2):
                for t in range(3):
                    p, q = _np_softmax(zt[b, t], tau), _np_softmax(zs[b, t], tau)
                    m = beta * p + (1 - beta) * q
                    expected[b, t] = beta * _np_kl(p, m) + (1 - beta) * _np_kl(q, m)
            got = generalized_jsd(torch.tensor(zs), torch.tensor(zt), torch.ones(2, 3), beta, tau)
            assert_close(got, expected)


def test_jsd_at_its_ends_is_the_kl_and_tends_to_it():
    """β = 0 is KL(teacher‖student) and β = 1 KL(student‖teacher), exactly; near the ends the formula,
    divided by β (resp. 1 − β), tends to the same numbers (as GKD states); β = 0.5 of disjoint supports is ln 2."""
    rng = np.random.default_rng(1)
    student, teacher = torch.tensor(rng.normal(size=(2, 3, 5))), torch.tensor(rng.normal(size=(2, 3, 5)))
    mask = torch.ones(2, 3)
    ls, lt = torch.log_softmax(student, -1), torch.log_softmax(teacher, -1)
    forward, reverse = vocab_kl(lt, ls), vocab_kl(ls, lt)
    assert_close(generalized_jsd(student, teacher, mask, beta=0.0), forward)
    assert_close(generalized_jsd(student, teacher, mask, beta=1.0), reverse)
    eps = 1e-7
    assert_close(generalized_jsd(student, teacher, mask, beta=eps) / eps, forward, rtol=1e-5, atol=0)
    assert_close(generalized_jsd(student, teacher, mask, beta=1 - eps) / eps, reverse, rtol=1e-5, atol=0)
    apart = torch.tensor([[[60.0, 0.0]]], dtype=torch.float64), torch.tensor([[[0.0, 60.0]]], dtype=torch.float64)
    assert_close(generalized_jsd(*apart, torch.ones(1, 1), beta=0.5), [[math.log(2)]], rtol=1e-10, atol=1e-12)


def test_identical_student_and_teacher_give_zero_loss_and_zero_gradient():
    logits = torch.tensor(np.random.default_rng(2).normal(size=(2, 4, 6)))
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    for beta in (0.0, 0.3, 0.5, 1.0):
        student = logits.clone().requires_grad_(True)
        loss = generalized_jsd(student, logits, mask, beta, temperature=0.8).sum()
        loss.backward()
        assert abs(float(loss.detach())) < 1e-14
        assert_close(student.grad, torch.zeros_like(logits), atol=1e-14)
    logprobs = torch.log_softmax(logits, -1)[..., 0].clone().requires_grad_(True)
    advantages = reverse_kl_advantages(logprobs.detach(), logprobs.detach(), mask)
    loss = aggregate_loss(ppo_policy_loss(logprobs, logprobs.detach(), advantages, mask)[0], mask)
    loss.backward()
    assert float(loss.detach()) == 0.0 and float(logprobs.grad.abs().max()) == 0.0


def test_the_reverse_kl_gradient_by_hand():
    """β = 1 over the vocabulary: ∂KL(q‖p)/∂z_q = q ⊙ (log q − log p − KL(q‖p)), written out for Q, P above.
    The sampled-token form: A_t = log π_T − log π_θ, and at ratio 1 with token-mean over n tokens the
    gradient on log π_θ(y_t) is −A_t / n = (log π_θ − log π_T)(y_t) / n."""
    student = _logits(Q).requires_grad_(True)
    generalized_jsd(student, _logits(P), torch.ones(1, 1), beta=1.0).sum().backward()
    kl = 0.9 * math.log(0.9 / 0.5) + 0.1 * math.log(0.1 / 0.5)
    expected = [0.9 * (math.log(0.9 / 0.5) - kl), 0.1 * (math.log(0.1 / 0.5) - kl)]
    assert_close(student.grad[0, 0], expected)

    logprobs = torch.tensor([[-0.1, -2.0, -0.5]], dtype=torch.float64)
    teacher = torch.tensor([[-0.3, -0.2, 9.9]], dtype=torch.float64)  # the third token is padding
    mask = torch.tensor([[1, 1, 0]])
    advantages = reverse_kl_advantages(logprobs, teacher, mask)
    assert_close(advantages, [[-0.3 + 0.1, -0.2 + 2.0, 0.0]])
    trained = logprobs.clone().requires_grad_(True)
    loss = aggregate_loss(ppo_policy_loss(trained, logprobs, advantages, mask)[0], mask, "token-mean")
    loss.backward()
    assert_close(trained.grad, [[(-0.1 + 0.3) / 2, (-2.0 + 0.2) / 2, 0.0]])


def test_garbage_at_masked_positions_changes_nothing():
    rng = np.random.default_rng(3)
    student, teacher = torch.tensor(rng.normal(size=(2, 3, 5))), torch.tensor(rng.normal(size=(2, 3, 5)))
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    dirty_s, dirty_t = student.clone(), teacher.clone()
    dirty_s[0, 2], dirty_t[1, 1], dirty_t[1, 2] = torch.nan, torch.inf, -torch.inf
    for beta in (0.0, 0.5, 1.0):
        grads = []
        for s, t in ((student, teacher), (dirty_s, dirty_t)):
            s = s.clone().requires_grad_(True)
            out = generalized_jsd(s, t, mask, beta)
            out.sum().backward()
            assert float(out.detach()[0, 2]) == 0.0 and float(out.detach()[1, 1]) == 0.0
            grads.append((out.detach(), s.grad))
        assert_close(grads[0][0], grads[1][0])
        assert torch.equal(grads[0][1][~mask.bool()], torch.zeros(3, 5, dtype=torch.float64))
        assert_close(grads[0][1], grads[1][1])
    with pytest.raises(ValueError, match="one vocabulary"):
        generalized_jsd(student, teacher[..., :4], mask)
    with pytest.raises(ValueError, match="beta must be in"):
        generalized_jsd(student, teacher, mask, beta=1.5)


# -- the trainer on tiny models ---------------------------------------------------------------------------


@pytest.fixture
def prompts(tmp_path):
    rows = [{"prompt": r["prompt"], "answer": r["answer"]} for r in arithmetic_sft(64, seed=1, low=0, high=9)]
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _distill(student, teacher, prompts, out, *overrides) -> DistillConfig:
    base = [*distill_args(student, prompts, out), f"teacher.path={teacher}"]
    return load_config(DistillConfig, None, base + list(overrides))


@pytest.mark.parametrize("loss", ["reverse_kl", "jsd"])
def test_a_teacher_equal_to_the_student_gives_zero_loss_at_step_one(tiny_dir, prompts, tmp_path, loss):
    policy = str(tiny_dir / "policy")
    config = _distill(
        policy, policy, prompts, tmp_path / loss, f"loss={loss}", "run.max_steps=1", "optim.max_grad_norm=null"
    )
    train_distill(config)
    (record,) = read_metrics(config.run.output_dir)
    assert abs(record["distill/reverse_kl"]) < 1e-6
    assert record["distill/teacher_logprob"] == pytest.approx(record["distill/student_logprob"], abs=1e-6)
    assert abs(record["policy/loss"]) < 1e-6 and record["grad_norm"] < 1e-5
    if loss == "jsd":
        assert abs(record["policy/jsd"]) < 1e-7 and abs(record["policy/reverse_kl_vocab"]) < 1e-7
    else:
        assert record["policy/first_minibatch_ratio_max"] == pytest.approx(1.0, abs=1e-5)
    assert record["passes/teacher"] == 1


def _varied_rollout(trainer, T=5):
    """16 responses of exactly T tokens, then response masks of lengths 1..T so the reductions differ."""
    prompts = [p.prompt_ids for p in trainer.prompts[:16]]
    torch.manual_seed(0)
    rollout = trainer.engine.generate(prompts, SamplingParams(max_new_tokens=T, min_new_tokens=T))
    lengths = torch.tensor([1 + i % T for i in range(16)])
    mask = (torch.arange(T)[None, :] < lengths[:, None]).long()
    return replace(rollout, response_mask=mask, truncated=torch.zeros(16, dtype=torch.bool))


def _grads_of_update(trainer, rollout, padding_ids=None):
    """The student's gradient after one update of ``rollout`` (parameters restored afterwards)."""
    if padding_ids is not None:  # other tokens where the response mask is 0
        rollout = replace(
            rollout, response_ids=torch.where(rollout.response_mask.bool(), rollout.response_ids, padding_ids)
        )
    model = trainer.actor.model
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    grads = {}
    hook = trainer.actor.optimizer.optimizer.register_step_pre_hook(
        lambda opt, args, kwargs: grads.update({id(p): p.grad.clone() for g in opt.param_groups for p in g["params"]})
    )
    mask = rollout.response_mask
    old = torch.where(mask.bool(), rollout.logprobs, 0.0)
    advantages = None
    if trainer.config.loss == "reverse_kl":
        teacher = torch.where(mask.bool(), rollout.logprobs - 0.3 * torch.arange(mask.shape[1]), 0.0)
        advantages = reverse_kl_advantages(old, teacher, mask)
    trainer.update(0, rollout, old, advantages, mask)
    hook.remove()
    model.load_state_dict(saved)
    return grads


@pytest.mark.parametrize(
    ("loss", "agg"), [("reverse_kl", "token-mean"), ("jsd", "token-mean"), ("jsd", "seq-mean-token-mean")]
)
def test_micro_batches_and_padding_change_nothing(noisy_sft, tiny_dir, prompts, tmp_path, loss, agg):
    """One micro-batch of 16 rows, 16 of 1 and 5 + 5 + 5 + 1 give one gradient; tokens where the response
    mask is 0 change nothing (they never count)."""
    config = _distill(
        str(tiny_dir / "policy"),
        noisy_sft["policy"],
        prompts,
        tmp_path / "mb",
        f"loss={loss}",
        f"loss_agg={agg}",
        "optim.max_grad_norm=null",
    )
    trainer = DistillTrainer(config)
    rollout = _varied_rollout(trainer)
    whole = _grads_of_update(trainer, rollout)
    assert max(float(g.abs().max()) for g in whole.values()) > 1e-4  # a gradient that could differ
    for micro in (1, 5):
        trainer.config.run.micro_batch_size = micro
        split = _grads_of_update(trainer, rollout)
        for key in whole:
            torch.testing.assert_close(split[key], whole[key], rtol=1e-4, atol=1e-7)
    other = _grads_of_update(trainer, rollout, padding_ids=torch.full_like(rollout.response_ids, 7))
    for key in whole:
        torch.testing.assert_close(other[key], whole[key], rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("loss", ["reverse_kl", "jsd"])
def test_the_reverse_kl_to_the_teacher_falls(noisy_sft, tiny_dir, prompts, tmp_path, loss):
    """The noisy SFT model (sharp answers) distilled towards the untrained tiny model (its next-token
    distributions near uniform): the reverse KL per token falls from ~4.2 nats as the student spreads out.
    (From the untrained student towards the SFT model the sampled-token form learns too, but slowly and
    noisily: every advantage starts near −7, with no baseline.)"""
    config = _distill(
        noisy_sft["policy"],
        str(tiny_dir / "policy"),
        prompts,
        tmp_path / loss,
        f"loss={loss}",
        *(["beta=1.0"] if loss == "jsd" else []),  # jsd at β = 1: the reverse KL over the vocabulary
        "run.max_steps=20",
        "optim.lr=1e-2",
    )
    train_distill(config)
    records = read_metrics(config.run.output_dir)
    kl = [r["distill/reverse_kl"] for r in records]
    assert kl[0] > 3 and sum(kl[-3:]) / 3 < 0.3 * kl[0], kl
    for key in ("score/mean", "response_length/mean", "time/train", "distill/reverse_kl_per_sequence", "grad_norm"):
        assert key in records[-1], key


def test_resume_reproduces_the_uninterrupted_run(noisy_sft, tiny_dir, prompts, tmp_path):
    """2 steps, a checkpoint, a crash in step 3, a resume: the weights and the last steps' numbers of 4
    straight steps (the prompt cursor and the sampler's RNG come back; docs/pitfalls.md #13)."""
    common = ["run.max_steps=4", "run.save_every=2", "loss=jsd", "minibatches=2"]
    student, teacher = str(tiny_dir / "policy"), noisy_sft["policy"]
    train_distill(_distill(student, teacher, prompts, tmp_path / "straight", *common))
    crashed = _distill(student, teacher, prompts, tmp_path / "crashed", *common)
    with pytest.raises(KeyboardInterrupt):
        train_distill(crashed, callbacks=[crash_at(3)])
    train_distill(_distill(student, teacher, prompts, tmp_path / "crashed", *common, "run.resume_from=latest"))
    a = load_file(tmp_path / "straight" / "final" / "policy" / "model.safetensors")
    b = load_file(tmp_path / "crashed" / "final" / "policy" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    kl = {name: [r["distill/reverse_kl"] for r in read_metrics(tmp_path / name)] for name in ("straight", "crashed")}
    assert kl["crashed"][-2:] == kl["straight"][-2:]


def test_the_teacher_must_share_the_tokenizer(tiny_dir, tmp_path):
    tokenizer = load_tokenizer(str(tiny_dir / "policy"))
    check_same_vocabulary(tokenizer, tokenizer, 100, 128, "reverse_kl", "t")  # the sampled tokens only: fine
    with pytest.raises(UserError, match="loss=jsd compares .* 100 and 128 entries"):
        check_same_vocabulary(tokenizer, tokenizer, 100, 128, "jsd", "t")
    other = load_tokenizer(str(tiny_dir / "policy"))
    other.add_tokens(["<extra>"])
    with pytest.raises(UserError, match="its tokenizer is not the student's \\(101 tokens against 100"):
        check_same_vocabulary(tokenizer, other, 100, 100, "reverse_kl", "t")


def test_cli_yaml_overrides_a_larger_teacher_and_errors_that_name_the_field(tiny_dir, prompts, tmp_path, capsys):
    """``posttrain distill`` from a YAML file with key=value overrides, from a teacher twice the student's
    width and depth (the same tokenizer); a teacher with another tokenizer stops at start, exit 2."""
    from posttrain.models.tiny import build_tiny

    teacher = build_tiny(tmp_path / "big", hidden_size=256, intermediate_size=512, num_hidden_layers=4, seed=3)
    config = tmp_path / "distill.yaml"
    config.write_text(
        f"model: {{path: {tiny_dir / 'policy'}}}\nteacher: {{path: {teacher}}}\n"
        f"data: {{path: {prompts}, chat_template: never}}\nsampling: {{max_new_tokens: 4}}\n"
        "run: {batch_size: 8, micro_batch_size: 4, progress: false, report_to: [jsonl]}\n"
    )
    out = tmp_path / "cli"
    assert main(["distill", "--config", str(config), f"run.output_dir={out}", "run.max_steps=2", "loss=jsd"]) == 0
    records = read_metrics(out)
    assert [r["step"] for r in records] == [1, 2] and records[-1]["passes/teacher"] == 2
    assert (out / "final" / "policy" / "config.json").is_file()

    other = build_tiny(tmp_path / "other", seed=4)
    extended = load_tokenizer(str(other))
    extended.add_tokens(["<extra>"])  # one token more: the student's ids no longer mean the same to it
    extended.save_pretrained(other)
    with pytest.raises(SystemExit) as stop:
        main(["distill", "--config", str(config), f"teacher.path={other}", f"run.output_dir={tmp_path / 'x'}"])
    assert stop.value.code == 2 and "its tokenizer is not the student's" in capsys.readouterr().err
    for override, message in (
        ("loss=kl", "loss must be one of"),
        ("beta=1.5", "beta must be in"),
        ("temperature=0.5", "temperature=0.5 with loss=reverse_kl"),
        ("teacher.device=cpu", "use teacher_device"),
        ("data.eval_fraction=0.1", "data.eval_fraction=0.1 asks for a held-out evaluation"),
        ("beta=0.2", "beta=0.2 is the generalized JSD's mixture weight: it needs loss=jsd"),
        ("loss=jsd clip_high=0.3", "clip_high clips reverse_kl's importance ratio"),
        ("loss=jsd rollout.engine=vllm rollout.importance_sampling=token", "importance_sampling=token: loss=jsd"),
    ):
        with pytest.raises(ValueError, match=message):
            load_config(DistillConfig, str(config), override.split())


# -- GKD's λ: steps on the data set's completions ---------------------------------------------------------


@pytest.fixture
def pairs(tmp_path):
    """16 {prompt, completion, answer} rows: prompts with the data set's own responses (GKD's (X, Y))."""
    rows = arithmetic_sft(16, seed=2, low=0, high=9)
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path), rows


def _counting_generate(trainer) -> list:
    """Each call of the trainer's rollout engine, recorded: a step on the data set must sample nothing."""
    calls, generate = [], trainer.engine.generate
    trainer.engine.generate = lambda *args, **kwargs: calls.append(1) or generate(*args, **kwargs)
    return calls


def _jsd_by_hand(student: str, teacher: str, rows: list[dict]) -> tuple[float, float]:
    """GKD's JSD at β = 0.5 and the student's log-prob of each completion token, both averaged over every
    completion token of ``rows``, in float64 numpy from the two checkpoints' logits: prompt ids with the
    tokenizer's special tokens, the completion's ids then EOS (no chat template)."""
    from transformers import AutoModelForCausalLM

    tokenizer = load_tokenizer(student)
    load = AutoModelForCausalLM.from_pretrained
    models = [load(path, torch_dtype=torch.float64).eval() for path in (student, teacher)]
    jsd, logprob, tokens = 0.0, 0.0, 0
    for row in rows:
        prompt = tokenizer(row["prompt"])["input_ids"]
        completion = tokenizer(row["completion"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        ids = torch.tensor([prompt + completion])
        with torch.no_grad():  # the logits at position i predict token i + 1
            z_q, z_p = (m(ids).logits[0, len(prompt) - 1 : -1].numpy() for m in models)
        for t, token in enumerate(completion):
            p, q = _np_softmax(z_p[t]), _np_softmax(z_q[t])
            m = 0.5 * p + 0.5 * q
            jsd += 0.5 * _np_kl(p, m) + 0.5 * _np_kl(q, m)
            logprob += float(np.log(q[token]))
            tokens += 1
    return jsd / tokens, logprob / tokens


def test_gkd_lmbda_0_trains_on_the_data_set_completions_and_samples_nothing(tiny_dir, pairs, tmp_path):
    """λ = 0: every step is GKD's supervised step. The engine never samples; the batch is the data set's own
    completions (samples.jsonl shows them); step 1's loss is the token mean of JSD_0.5(π_T‖π_θ) over those
    completions' tokens, worked out in float64 numpy from the two untrained checkpoints' logits."""
    from posttrain.models.tiny import build_tiny

    path, rows = pairs
    student, teacher = str(tiny_dir / "policy"), str(build_tiny(tmp_path / "teacher", seed=5))
    config = _distill(
        student, teacher, path, tmp_path / "gkd0", "loss=jsd", "lmbda=0", "run.max_steps=3", "log_completions=16"
    )
    trainer = DistillTrainer(config)
    calls = _counting_generate(trainer)
    trainer.train()
    assert calls == []
    records = read_metrics(config.run.output_dir)
    assert [r["distill/on_policy"] for r in records] == [0.0, 0.0, 0.0]
    assert all("reward/mean" not in r for r in records)
    samples = [json.loads(line) for line in (tmp_path / "gkd0" / "samples.jsonl").read_text().splitlines()]
    first = [(s["prompt"], s["completion"]) for s in samples if s["step"] == 1]
    assert sorted(first) == sorted((r["prompt"], r["completion"]) for r in rows)  # batch 16: every row once
    jsd, logprob = _jsd_by_hand(student, teacher, rows)
    assert jsd > 1e-3  # two different models: a loss that could be wrong
    assert records[0]["policy/loss"] == pytest.approx(jsd, rel=1e-5)
    assert records[0]["policy/jsd"] == pytest.approx(jsd, rel=1e-5)
    assert records[0]["distill/student_logprob"] == pytest.approx(logprob, rel=1e-5)
    assert records[-1]["policy/jsd"] < records[0]["policy/jsd"]  # and it trains towards the teacher


def test_gkd_lmbda_1_is_the_on_policy_path(noisy_sft, tiny_dir, prompts, pairs, tmp_path):
    """λ = 1 (the default): the data set's completions are ignored and the run equals one on prompt rows
    alone, sampling once per step: the same weights and the same numbers."""
    student, teacher = str(tiny_dir / "policy"), noisy_sft["policy"]
    path, rows = pairs
    prompt_rows = tmp_path / "prompts_only.jsonl"
    prompt_rows.write_text("".join(json.dumps({"prompt": r["prompt"], "answer": r["answer"]}) + "\n" for r in rows))
    runs = {}
    for name, data, extra in (("today", str(prompt_rows), []), ("lmbda1", path, ["lmbda=1.0"])):
        config = _distill(student, teacher, data, tmp_path / name, "run.max_steps=3", *extra)
        trainer = DistillTrainer(config)
        calls = _counting_generate(trainer)
        trainer.train()
        assert len(calls) == 3, name
        records = read_metrics(config.run.output_dir)
        assert [r["distill/on_policy"] for r in records] == [1.0, 1.0, 1.0]
        runs[name] = (records, load_file(tmp_path / name / "final" / "policy" / "model.safetensors"))
    (today, a), (lmbda1, b) = runs["today"], runs["lmbda1"]
    assert all(torch.equal(a[k], b[k]) for k in a)
    for key in ("distill/reverse_kl", "policy/loss", "grad_norm"):
        assert [r[key] for r in today] == [r[key] for r in lmbda1], key


def test_gkd_lmbda_draws_each_step_from_the_seed(tiny_dir, pairs, tmp_path):
    """0 < λ < 1: GKD's u_k < λ per step, from run.seed alone (no process index, no global RNG: the same on
    every process and on resume); the run trains on-policy exactly at those steps, sampling only there."""
    assert torch.equal(gkd_on_policy_steps(0.3, 50, 7), gkd_on_policy_steps(0.3, 50, 7))
    assert not torch.equal(gkd_on_policy_steps(0.5, 50, 7), gkd_on_policy_steps(0.5, 50, 8))
    assert 0.4 < gkd_on_policy_steps(0.5, 1000, 0).double().mean() < 0.6
    assert not gkd_on_policy_steps(0.0, 100, 0).any() and gkd_on_policy_steps(1.0, 100, 0).all()
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    gkd_on_policy_steps(0.5, 10, 0)
    assert torch.equal(torch.rand(1), before)  # the sampler's stream is left alone

    path, _ = pairs
    config = _distill(str(tiny_dir / "policy"), str(tiny_dir / "policy"), path, tmp_path / "mix", "loss=jsd")
    config = replace(config, lmbda=0.5, run=replace(config.run, max_steps=6, seed=3))
    schedule = gkd_on_policy_steps(0.5, 6, 3)
    assert 0 < int(schedule.sum()) < 6  # both kinds of step in this run
    trainer = DistillTrainer(config)
    calls = _counting_generate(trainer)
    trainer.train()
    records = read_metrics(config.run.output_dir)
    assert [r["distill/on_policy"] for r in records] == schedule.double().tolist()
    assert len(calls) == int(schedule.sum())


def test_completions_rollout_cuts_at_max_new_tokens(tiny_dir):
    tokenizer = load_tokenizer(str(tiny_dir / "policy"))
    pad = tokenizer.pad_token_id
    rollout = completions_rollout(tokenizer, [[5, 6], [7]], [[11, 12, 13, 14], [15]], SamplingParams(max_new_tokens=3))
    assert rollout.response_ids.tolist() == [[11, 12, 13], [15, pad, pad]]
    assert rollout.response_mask.tolist() == [[1, 1, 1], [1, 0, 0]]
    assert rollout.truncated.tolist() == [True, False] and rollout.logprobs is None
    assert rollout.prompt_ids.tolist() == [[5, 6], [pad, 7]] and rollout.prompt_mask.tolist() == [[1, 1], [0, 1]]
    assert rollout.group_size == 1 and rollout.prompt_index.tolist() == [0, 1]


def test_gkd_lmbda_is_checked_at_start(tiny_dir, prompts, tmp_path):
    """λ outside [0, 1], λ < 1 with the sampled-token loss, and λ < 1 on rows without a completion stop at
    start naming the field (the last before any model loads)."""
    policy = str(tiny_dir / "policy")
    with pytest.raises(ValueError, match=r"lmbda must be in \[0, 1\]"):
        _distill(policy, policy, prompts, tmp_path / "x", "loss=jsd", "lmbda=1.5")
    with pytest.raises(ValueError, match="lmbda=0.5 trains some steps on the data set's completions.*use loss=jsd"):
        _distill(policy, policy, prompts, tmp_path / "x", "lmbda=0.5")
    config = _distill(policy, policy, prompts, tmp_path / "x", "loss=jsd", "lmbda=0.5")
    with pytest.raises(UserError, match="field 'completion': missing: this run trains on the data set's completions"):
        DistillTrainer(config)


def test_a_vllm_teacher_is_refused_where_it_cannot_grade(tiny_dir, prompts, tmp_path):
    """teacher_scoring.engine=vllm returns the given tokens' log-probs at temperature 1: loss=jsd (the whole
    distribution), another sampling temperature and teacher_device are refused at start with the way out;
    so are a server or vLLM knobs without engine=vllm and a misspelled engine. (The vLLM teacher itself runs
    in tests/test_vllm.py.)"""
    policy = str(tiny_dir / "policy")
    vllm = "teacher_scoring.engine=vllm"
    refused = {
        "vLLM returns the log-probs of the given tokens only; use loss=reverse_kl": (vllm, "loss=jsd"),
        r"sampling.temperature=0.7: vLLM's log-probs .* raw logits \(temperature 1\)": (
            vllm,
            "sampling.temperature=0.7",
        ),
        "teacher_device=cpu places the teacher of teacher_scoring.engine=hf": (vllm, "teacher_device=cpu"),
        "teacher_scoring.mode=server needs teacher_scoring.engine=vllm": ("teacher_scoring.mode=server",),
        "teacher_scoring.enforce_eager applies to teacher_scoring.engine=vllm only": (
            "teacher_scoring.enforce_eager=true",
        ),
        r"teacher_scoring.engine must be one of \('hf', 'vllm'\), got 'vlm'": ("teacher_scoring.engine=vlm",),
        r"teacher_scoring.dtype must be one of \('auto', .*got 'fp32'": (vllm, "teacher_scoring.dtype=fp32"),
    }
    for message, overrides in refused.items():
        with pytest.raises(ValueError, match=message):
            _distill(policy, policy, prompts, tmp_path / "x", *overrides)
    config = _distill(policy, policy, prompts, tmp_path / "x", vllm, "teacher_scoring.mode=server")
    assert config.teacher_scoring.describe() == "engine=vllm mode=server url=http://127.0.0.1:8001 timeout=300s"


def test_a_lora_student_with_gradient_checkpointing_starts_as_its_base_and_trains_the_adapter(
    tiny_dir, prompts, tmp_path
):
    """model.lora with gradient checkpointing: at step 1 the student is its base model (ΔW = 0), so the step's
    samples and the teacher's grades equal a full-model run's, the first ratio is 1; the adapter is what trains
    (its B matrices, 0 at the start, moved) and what is saved."""
    lora = "model.lora={r: 4, lora_alpha: 8, target_modules: [q_proj, v_proj], lora_dropout: 0.0}"
    policy, teacher = str(tiny_dir / "policy"), str(tiny_dir / "qwen2")
    hf = "rollout.engine=hf"  # auto would sample the base model with the lean loop, the peft model with generate
    adapter = _distill(policy, teacher, prompts, tmp_path / "lora", lora, "model.gradient_checkpointing=true", hf)
    adapter.run.max_steps, adapter.optim.lr = 2, 1e-2
    train_distill(adapter)
    full = _distill(policy, teacher, prompts, tmp_path / "full", "run.max_steps=1", hf)
    train_distill(full)
    assert (tmp_path / "lora" / "final" / "policy" / "adapter_config.json").is_file()
    first, second = read_metrics(tmp_path / "lora")
    (plain,) = read_metrics(tmp_path / "full")
    for key in ("distill/reverse_kl", "distill/teacher_logprob", "distill/student_logprob"):
        assert first[key] == pytest.approx(plain[key], abs=1e-6), key
    assert first["policy/first_minibatch_ratio_max"] == pytest.approx(1.0, abs=1e-5) and first["grad_norm"] > 0
    saved = load_file(tmp_path / "lora" / "final" / "policy" / "adapter_model.safetensors")
    assert saved and all("lora_" in k for k in saved)  # the adapter alone is saved
    assert all(saved[k].abs().max() > 0 for k in saved if "lora_B" in k)  # B starts at 0: it trained
    assert math.isfinite(second["policy/loss"])
