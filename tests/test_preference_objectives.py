"""SimPO, ORPO and KTO (issue 27 items 3 and 4): the losses against values worked out by hand, their start
values and invariants, the unpaired data KTO reads, and the trainers on a tiny model."""

import json
import math

import pytest
import torch
from helpers import assert_close
from safetensors.torch import load_file

from posttrain.core import kto_loss, kto_reference_point, orpo_loss, simpo_loss
from posttrain.core.losses import log_odds
from posttrain.data import DataConfig, DataError, load_preferences, load_sft, load_unpaired
from posttrain.data.synthetic import arithmetic_pairs, arithmetic_sft, unpaired
from posttrain.models import ModelConfig
from posttrain.runtime.config import load_config
from posttrain.runtime.metrics import read_metrics
from posttrain.trainers.dpo import DPOConfig
from posttrain.trainers.dpo import train as train_dpo
from posttrain.trainers.kto import KTOConfig, KTOTask, mismatched_pairs
from posttrain.trainers.kto import train as train_kto

LOG_SIGMOID = lambda x: -math.log1p(math.exp(-x))  # noqa: E731


# --------------------------------------------------------------------------------------------------
# The losses, by hand
# --------------------------------------------------------------------------------------------------


def test_simpo_loss_by_hand():
    chosen, rejected = torch.tensor([-1.0, -0.5], dtype=torch.float64), torch.tensor([-2.0, -0.25], dtype=torch.float64)
    losses, r_w, r_l = simpo_loss(chosen, rejected, beta=2.0, gamma=0.5)
    # rewards β·mean log π: (−2, −1) and (−4, −0.5); margins −2 + 4 − 0.5 = 1.5 and −1 + 0.5 − 0.5 = −1
    assert_close(r_w, [-2.0, -1.0])
    assert_close(r_l, [-4.0, -0.5])
    assert_close(losses, [-LOG_SIGMOID(1.5), -LOG_SIGMOID(-1.0)])
    assert not r_w.requires_grad


def test_simpo_starts_at_log2_with_equal_likelihoods_and_no_margin():
    lp = torch.tensor([-3.0, -0.7, -0.01], dtype=torch.float64)
    losses, _, _ = simpo_loss(lp, lp.clone(), beta=2.5, gamma=0.0)
    assert_close(losses, torch.full((3,), math.log(2), dtype=torch.float64))
    # with a margin γ the start is −log σ(−γ) = log(1 + e^γ): the margin is still to be won
    losses, _, _ = simpo_loss(lp, lp.clone(), beta=2.5, gamma=1.0)
    assert_close(losses, torch.full((3,), math.log1p(math.e), dtype=torch.float64))


def test_orpo_loss_by_hand():
    # P_w = 0.5: odds 1, log odds 0; P_l = 0.2: odds 0.25; log odds ratio = log 4
    chosen = torch.tensor([math.log(0.5)], dtype=torch.float64)
    rejected = torch.tensor([math.log(0.2)], dtype=torch.float64)
    losses, odds_w, odds_l = orpo_loss(chosen, rejected, lam=0.1)
    assert_close(odds_w, [0.0], atol=1e-15)
    assert_close(odds_l, [math.log(0.25)])
    # NLL −log 0.5 = log 2, plus λ·(−log σ(log 4)) = 0.1·log(5/4)
    assert_close(losses, [math.log(2) + 0.1 * math.log(1.25)])
    # equal likelihoods: the odds-ratio term is log 2 whatever λ, on top of the NLL
    same, _, _ = orpo_loss(chosen, chosen.clone(), lam=1.0)
    assert_close(same, [2 * math.log(2)])


def test_log_odds_are_exact_at_both_ends():
    a = torch.tensor([-1e-10, -0.3, -3.0, -800.0], dtype=torch.float64)
    expected = [x - math.log(-math.expm1(x)) for x in (-1e-10, -0.3)] + [-3.0 - math.log1p(-math.exp(-3.0)), -800.0]
    assert_close(log_odds(a), expected)
    naive = a - torch.log(1 - torch.exp(a))  # 1 − P loses half its digits near P = 1
    assert abs(float(naive[0]) - expected[0]) > 1e-9
    # P = 1 (a response the model is certain of): finite, with a finite gradient, in float32
    certain = torch.tensor([0.0, -1e-9], requires_grad=True)
    losses, odds, _ = orpo_loss(certain, torch.tensor([-1.0, -1.0]))
    losses.sum().backward()
    assert torch.isfinite(odds).all() and torch.isfinite(certain.grad).all()
    assert float(odds[0]) == pytest.approx(math.log(1 / torch.finfo(torch.float32).eps), rel=1e-4)


def test_kto_loss_by_hand():
    policy = torch.tensor([-2.0, -4.0], dtype=torch.float64)
    ref = torch.tensor([-3.0, -3.0], dtype=torch.float64)
    desirable = torch.tensor([True, False])
    # r = 1 (desirable) and −1 (undesirable); z0 = 0.5, β = 0.1, λ_D = 1, λ_U = 2
    losses, rewards = kto_loss(policy, ref, desirable, torch.tensor(0.5), 0.1, 1.0, 2.0)
    sigmoid = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    assert_close(losses, [1.0 * (1 - sigmoid(0.1 * (1 - 0.5))), 2.0 * (1 - sigmoid(0.1 * (0.5 + 1)))])
    assert_close(rewards, [0.1, -0.1])


def test_kto_starts_at_half_its_weights_when_the_policy_is_the_reference():
    lp = torch.tensor([-5.0, -1.5, -7.25, -0.5], dtype=torch.float64)
    kl = lp - lp  # the mismatched pairs' log-ratios at step 0
    z0 = kto_reference_point(kl.sum(), kl.numel())
    assert float(z0) == 0.0
    desirable = torch.tensor([True, False, True, False])
    losses, rewards = kto_loss(lp, lp.clone(), desirable, z0, 0.3, 1.0, 4 / 3)
    assert_close(losses, [0.5, 0.5 * 4 / 3, 0.5, 0.5 * 4 / 3])
    assert_close(rewards, torch.zeros(4, dtype=torch.float64))


def test_kto_reference_point_is_the_clamped_detached_mean():
    logratios = torch.tensor([0.3, -0.1, 0.4], dtype=torch.float64, requires_grad=True)
    z0 = kto_reference_point(logratios.sum(), 3)
    assert_close(z0, 0.2)
    assert not z0.requires_grad
    assert float(kto_reference_point(torch.tensor(-0.6), 3)) == 0.0  # a negative estimate: z0 = 0
    assert float(kto_reference_point(torch.tensor(0.0), 0)) == 0.0  # no pairs
    # z0 carries no gradient into the loss: only r = log π − log π_ref does
    policy = torch.tensor([-1.0], dtype=torch.float64, requires_grad=True)
    z0 = logratios.sum() / 3  # not detached by the caller: kto_loss detaches it
    kto_loss(policy, torch.tensor([-1.0], dtype=torch.float64), torch.tensor([True]), z0)[0].sum().backward()
    assert logratios.grad is None and policy.grad is not None


@pytest.mark.parametrize("name", ["simpo", "orpo", "kto"])
def test_gradcheck_preference_losses(name):
    g = torch.Generator().manual_seed(0)
    chosen = (-torch.rand(4, generator=g, dtype=torch.float64) * 3 - 0.05).requires_grad_()
    rejected = (-torch.rand(4, generator=g, dtype=torch.float64) * 3 - 0.05).requires_grad_()
    fn = {
        "simpo": lambda c, r: simpo_loss(c, r, 2.0, 0.5)[0],
        "orpo": lambda c, r: orpo_loss(c, r, 0.3)[0],
        "kto": lambda c, r: kto_loss(c, r, torch.tensor([True, False, True, False]), 0.2, 0.5, 1.0, 1.5)[0],
    }[name]
    assert torch.autograd.gradcheck(fn, (chosen, rejected))


def test_flipping_the_preference_raises_the_losses():
    """A sign error in any of them would fail here: the preferred response more likely gives the lower loss."""
    good, bad = torch.tensor([-0.5]), torch.tensor([-2.0])
    assert simpo_loss(good, bad, 2.0, 0.5)[0] < simpo_loss(bad, good, 2.0, 0.5)[0]
    assert orpo_loss(good, bad)[0] < orpo_loss(bad, good)[0]
    up, down, ref = torch.tensor([-1.0]), torch.tensor([-3.0]), torch.tensor([-2.0])
    for label, better, worse in ((True, up, down), (False, down, up)):
        desirable = torch.tensor([label])
        assert kto_loss(better, ref, desirable, 0.0)[0] < kto_loss(worse, ref, desirable, 0.0)[0]


# --------------------------------------------------------------------------------------------------
# Length normalisation and masks through the trainer's collation, with a fixed next-token distribution
# --------------------------------------------------------------------------------------------------


class _FixedLM(torch.nn.Module):
    """π(next token) = (1/2, 1/6, 1/6, 1/6) over V = 4 at every position, whatever came before."""

    def forward(self, input_ids, **kwargs):
        from types import SimpleNamespace

        logits = torch.log(torch.tensor([0.5, 1 / 6, 1 / 6, 1 / 6])).expand(*input_ids.shape, 4)
        return SimpleNamespace(logits=logits)


@pytest.mark.parametrize("loss_type", ["simpo", "orpo"])
def test_simpo_and_orpo_average_over_response_tokens_only(loss_type):
    from posttrain.data import PreferenceExample
    from posttrain.trainers.dpo import DPOExample, DPOTask

    # prompt [1, 2] (never scored), chosen [0, 0, 1], rejected [2]; pad id 3 fills the rejected row. Were the
    # prompt or the padding scored, or the sum taken, the means below would change
    example = DPOExample(PreferenceExample([1, 2], [0, 0, 1], [2]))
    config = DPOConfig(loss_type=loss_type, beta=2.0) if loss_type == "simpo" else DPOConfig(loss_type=loss_type)
    task = DPOTask(None, 3, config)
    loss_sum, sums = task.loss(_FixedLM(), task.collate([example]))
    mean_w = (2 * math.log(1 / 2) + math.log(1 / 6)) / 3
    mean_l = math.log(1 / 6)
    if loss_type == "simpo":  # γ = 0.5 (the default)
        expected = -LOG_SIGMOID(2.0 * mean_w - 2.0 * mean_l - 0.5)
    else:
        odds = lambda m: m - math.log1p(-math.exp(m))  # noqa: E731
        expected = -mean_w - 0.1 * LOG_SIGMOID(odds(mean_w) - odds(mean_l))
        assert float(sums["nll"]) == pytest.approx(-mean_w, abs=1e-6)
    assert float(loss_sum) == pytest.approx(expected, abs=1e-6)
    assert float(sums["logps/chosen"]) == pytest.approx(mean_w, abs=1e-6)


def test_kto_collation_scores_only_completions_and_pairs_each_prompt_with_another_completion(tokenizer):
    rows = [
        {"prompt": "1+1=", "completion": "2", "label": True},
        {"prompt": "12+30=", "completion": "41", "label": False},
        {"prompt": "3+3=", "completion": "6", "label": True},
    ]
    examples, report = load_unpaired(DataConfig(path="kto", chat_template="never"), tokenizer, rows)
    assert report.kept == 3 and [e.label for e in examples] == [True, False, True]
    kto = mismatched_pairs(examples, seed=0, max_length=None)
    partners = [next(j for j, o in enumerate(examples) if o.completion_ids == k.kl_completion_ids) for k in kto]
    assert sorted(partners) == [0, 1, 2] and all(p != i for i, p in enumerate(partners))  # a cycle: none its own
    batch = KTOTask(None, tokenizer.pad_token_id, KTOConfig()).collate(kto)

    def scored(sequences):
        ids, mask = sequences.input_ids, sequences.completion_mask.bool()
        return [tokenizer.decode(i[m]) for i, m in zip(ids, mask, strict=True)]

    assert scored(batch.sequences) == ["2<eos>", "41<eos>", "6<eos>"]  # no prompt, no padding
    assert scored(batch.kl_sequences) == [["2<eos>", "41<eos>", "6<eos>"][p] for p in partners]
    prompts = [tokenizer.decode(i[a.bool() & ~m.bool()]) for i, a, m in zip(*_fields(batch.kl_sequences), strict=True)]
    assert prompts == ["<bos>1+1=", "<bos>12+30=", "<bos>3+3="]  # each row's own prompt, then another's completion
    assert batch.desirable.tolist() == [True, False, True]


def test_kto_z0_comes_from_the_whole_step_not_each_micro_batch(tiny_dir, tokenizer):
    """The KL estimate is summed over every micro-batch before the clamp: micro-batches whose mismatched
    pairs have KL +1.0 and −0.5 per row give z0 = max(0, (2·1 − 2·0.5)/4) = 0.25, where a clamp per
    micro-batch would give (1 + 0)/2 = 0.5 and the first micro-batch alone 1.0."""
    from types import SimpleNamespace

    from transformers import AutoModelForCausalLM

    from posttrain.trainers.kto import completion_logps

    rows = [{"prompt": f"{i}+{i}=", "completion": str(2 * i), "label": bool(i % 2)} for i in range(1, 5)]
    examples, _ = load_unpaired(DataConfig(path="kto", chat_template="never"), tokenizer, rows)
    model = AutoModelForCausalLM.from_pretrained(tiny_dir / "policy")
    task = KTOTask(None, tokenizer.pad_token_id, KTOConfig())
    batches = []
    for chunk, kl in ((mismatched_pairs(examples, 0, None)[:2], 1.0), (mismatched_pairs(examples, 0, None)[2:], -0.5)):
        with torch.no_grad():
            policy = completion_logps(model, task.collate(chunk).kl_sequences)
        for e, logp in zip(chunk, policy.tolist(), strict=True):
            e.ref_logp, e.ref_kl_logp = 0.0, logp - kl  # log π − log π_ref = kl on every mismatched pair
        batches.append(task.collate(chunk))
    accelerator = SimpleNamespace(device=torch.device("cpu"), num_processes=1)
    task.begin_step(accelerator, model, batches, [True, True])
    assert task.kl == pytest.approx(0.25, abs=1e-5) and float(task.z0) == pytest.approx(0.25, abs=1e-5)
    task.begin_step(accelerator, model, batches[1:], [True])  # a step of negative KL only: clamped to 0
    assert task.kl == pytest.approx(-0.5, abs=1e-5) and float(task.z0) == 0.0


def _fields(sequences):
    return sequences.input_ids, sequences.attention_mask, sequences.completion_mask


# --------------------------------------------------------------------------------------------------
# Unpaired data: read by kto, refused elsewhere and the other way round, naming the command
# --------------------------------------------------------------------------------------------------


def test_unpaired_rows_of_the_wrong_kind_are_refused_naming_what_reads_them(tokenizer):
    config = DataConfig(path="kto", chat_template="never")
    with pytest.raises(DataError, match=r"field 'label': must be true \(desirable\) or false .* got 1"):
        load_unpaired(config, tokenizer, [{"prompt": "1+1=", "completion": "2", "label": 1}])
    with pytest.raises(DataError, match=r"field 'completion': missing: .*preference rows.*posttrain dpo.*unpaired"):
        load_unpaired(config, tokenizer, arithmetic_pairs(3, seed=0))
    with pytest.raises(DataError, match=r"field 'label': missing: .*SFT rows.*posttrain sft.*unpaired preference"):
        load_unpaired(config, tokenizer, arithmetic_sft(3, seed=0))
    kto_rows = unpaired(arithmetic_pairs(2, seed=0))
    for loader in (load_sft, load_preferences):
        with pytest.raises(DataError, match="field 'label': an unpaired preference row .* read by posttrain kto"):
            loader(config, tokenizer, kto_rows)


def test_unpaired_splits_each_pair_into_a_desirable_and_an_undesirable_row():
    pairs = arithmetic_pairs(3, seed=5, low=0, high=9)
    rows = unpaired(pairs)
    assert [r["label"] for r in rows] == [True, False] * 3
    for pair, good, bad in zip(pairs, rows[::2], rows[1::2], strict=True):
        a, b = map(int, pair["prompt"][:-1].split("+"))
        assert good == {"prompt": pair["prompt"], "completion": str(a + b), "label": True}
        assert bad["prompt"] == pair["prompt"] and abs(int(bad["completion"]) - (a + b)) == 1


# --------------------------------------------------------------------------------------------------
# Trainers on the tiny model
# --------------------------------------------------------------------------------------------------


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _common(tiny_dir, tmp_path, name):
    return [
        f"model.path={tiny_dir / 'policy'}",
        f"run.output_dir={tmp_path / name}",
        "run.progress=false",
        "run.report_to=[jsonl]",
        "optim.scheduler=constant",
        "data.chat_template=never",
    ]


def _pairs_config(tiny_dir, tmp_path, name, *overrides):
    rows = [
        {"prompt": r["prompt"], "chosen": r["answer"], "rejected": r["answer"][::-1] + "x"}
        for r in arithmetic_sft(64, seed=3)
    ]
    data = _jsonl(tmp_path / "pairs.jsonl", rows)
    base = _common(tiny_dir, tmp_path, name) + [f"data.path={data}", "optim.lr=2e-3", "run.batch_size=8"]
    return load_config(DPOConfig, None, base + ["run.max_steps=12", "data.eval_fraction=0.25", *overrides])


def _kto_config(tiny_dir, tmp_path, name, *overrides):
    rows = [
        {"prompt": r["prompt"], "completion": r["answer"] if i % 2 else r["answer"][::-1] + "x", "label": bool(i % 2)}
        for i, r in enumerate(arithmetic_sft(96, seed=3))
    ]
    data = _jsonl(tmp_path / "unpaired.jsonl", rows)
    base = _common(tiny_dir, tmp_path, name) + [f"data.path={data}", "optim.lr=2e-3", "run.batch_size=8"]
    return load_config(KTOConfig, None, base + ["run.max_steps=12", "data.eval_fraction=0.25", *overrides])


@pytest.mark.parametrize("loss_type", ["simpo", "orpo"])
def test_simpo_and_orpo_load_no_reference_and_learn(tiny_dir, tmp_path, loss_type):
    knobs = ["beta=2.0", "simpo_gamma=1.0"] if loss_type == "simpo" else ["orpo_lambda=0.5"]
    config = _pairs_config(tiny_dir, tmp_path, loss_type, f"loss_type={loss_type}", *knobs)
    result = train_dpo(config)
    records = read_metrics(config.run.output_dir)
    assert all("time/reference" not in r for r in records)  # no reference forward, ever
    assert sum(r["loss"] for r in records[-3:]) < sum(r["loss"] for r in records[:3])
    assert records[-1]["rewards/margin"] > records[0]["rewards/margin"]
    assert result["eval_metrics"]["eval/rewards/accuracy"] > 0.5
    if loss_type == "orpo":
        assert records[-1]["nll"] < records[0]["nll"]  # the SFT term trains the chosen responses


def test_kto_starts_at_half_its_weights_and_learns(tiny_dir, tmp_path):
    config = _kto_config(tiny_dir, tmp_path, "kto")
    result = train_kto(config)
    records = read_metrics(config.run.output_dir)
    first = records[0]
    # step 0: π = π_ref, so r = 0, the KL estimate 0, z0 = 0 and every loss λ/2 = 0.5
    assert first["loss"] == pytest.approx(0.5, abs=1e-6)
    assert first["kl"] == pytest.approx(0.0, abs=1e-6) and first["z0"] == 0.0
    assert first["rewards/margin"] == pytest.approx(0.0, abs=1e-6)
    for key in ("rewards/chosen", "rewards/rejected", "rewards/accuracy", "logps/chosen", "logps/rejected"):
        assert key in first
    assert records[-1]["rewards/margin"] > 0 and records[-2]["loss"] < 0.5
    assert any(r["kl"] != 0 for r in records[1:])  # the reference point moves once the policy does
    assert result["eval_metrics"]["eval/rewards/accuracy"] > 0.5
    assert {"time/reference", "time/train"} <= records[0].keys()


@pytest.mark.parametrize("trainer", ["kto", "simpo", "orpo"])
def test_micro_batching_gives_the_same_steps(tiny_dir, tmp_path, trainer):
    """micro_batch_size 1 and 3 (3 + 1) against the whole batch of 4: the same gradient norm at every step,
    the same KL estimate (KTO's z0 comes from the whole batch, not from each micro-batch: from step 2 on,
    when the policy has moved, a per-micro-batch z0 would change the loss and its gradient)."""
    runs = {}
    for micro in (4, 1, 3):
        name = f"{trainer}_mb{micro}"
        common = [
            "run.max_steps=3",
            "run.batch_size=4",
            f"run.micro_batch_size={micro}",
            "optim.lr=1e-3",
            "data.eval_fraction=0",
        ]
        if trainer == "kto":
            config = _kto_config(tiny_dir, tmp_path, name, *common)
            train_kto(config)
        else:
            beta = ["beta=0.1"] if trainer == "simpo" else []  # simpo asks for beta: the value the test had
            config = _pairs_config(tiny_dir, tmp_path, name, f"loss_type={trainer}", *beta, *common)
            train_dpo(config)
        records = read_metrics(config.run.output_dir)
        runs[micro] = (records, load_file(f"{config.run.output_dir}/final/policy/model.safetensors"))
    (full, w_full) = runs[4]
    assert full[-1].get("kl", 1.0) != 0.0  # KTO: a reference point away from 0 by the last step
    for micro in (1, 3):
        records, weights = runs[micro]
        for key in ("grad_norm", "loss") + (("kl",) if trainer == "kto" else ()):
            assert [r[key] for r in records] == pytest.approx([r[key] for r in full], rel=1e-5, abs=1e-7), key
        for k in w_full:
            torch.testing.assert_close(weights[k], w_full[k], rtol=0, atol=1e-5)


def test_simpo_asks_for_beta_and_dpo_keeps_its_default():
    """SimPO's β is 2.0–2.5 in its paper, DPO's usual one 0.1: loss_type=simpo without beta stops at start naming
    the field and the paper's values; set, it is used as given (0.1 too); the DPO losses still read 0.1 unset."""
    base = ["model.path=m", "data.path=d"]
    with pytest.raises(ValueError, match=r"simpo needs beta set: .*beta=2.0 to 2.5.*simpo_gamma about beta/2"):
        load_config(DPOConfig, None, base + ["loss_type=simpo"])
    with pytest.raises(ValueError, match="loss_type=simpo needs beta set"):
        DPOConfig(model=ModelConfig(path="m"), data=DataConfig(path="d"), loss_type="simpo").validate()
    for given in ("2.5", "0.1"):
        config = load_config(DPOConfig, None, base + ["loss_type=simpo", f"beta={given}"])
        assert config.beta_in_force == float(given)
    for loss_type in ("sigmoid", "ipo", "hinge"):
        config = load_config(DPOConfig, None, base + [f"loss_type={loss_type}"])
        assert config.beta is None and config.beta_in_force == 0.1
    assert load_config(DPOConfig, None, base + ["beta=0.3"]).beta_in_force == 0.3


LORA = "model.lora={r: 4, lora_alpha: 8, target_modules: [q_proj, v_proj], lora_dropout: 0.0}"
TRAINERS = {
    "kto": lambda tiny_dir, tmp_path, name, *o: (_kto_config(tiny_dir, tmp_path, name, *o), train_kto),
    "simpo": lambda tiny_dir, tmp_path, name, *o: (
        _pairs_config(tiny_dir, tmp_path, name, "loss_type=simpo", "beta=2.0", "simpo_gamma=1.0", *o),
        train_dpo,
    ),
    "orpo": lambda tiny_dir, tmp_path, name, *o: (
        _pairs_config(tiny_dir, tmp_path, name, "loss_type=orpo", "orpo_lambda=0.5", *o),
        train_dpo,
    ),
}


@pytest.mark.parametrize("trainer", ["kto", "simpo", "orpo"])
def test_lora_trains_the_adapter_only_and_kto_reads_the_adapter_off_reference(tiny_dir, tmp_path, monkeypatch, trainer):
    """With ``model.lora`` the optimizer gets the adapter's matrices and nothing else (the trainable parameters
    of the same peft model built here), the run learns and saves an adapter. KTO's reference is the policy
    with its adapter off: step 1 is at the start values (policy = reference: loss 0.5, KL 0), later steps move
    away from it, and the run equals one whose reference is a frozen copy of the base model."""
    from posttrain.models import ModelConfig, load_policy
    from posttrain.runtime import loop

    given, build_optimizer = [], loop.build_optimizer

    def recording(params, *args):  # the real function, the parameters it was given kept
        params = list(params)
        given.extend(params)
        return build_optimizer(params, *args)

    monkeypatch.setattr(loop, "build_optimizer", recording)
    common = (LORA, "optim.lr=5e-3", "run.max_steps=6")
    config, train = TRAINERS[trainer](tiny_dir, tmp_path, "lora", *common)
    train(config)
    lora = load_config(type(config), None, ["model.path=m", "data.path=d", LORA]).model.lora
    peft = load_policy(ModelConfig(path=str(tiny_dir / "policy"), lora=lora))
    trainable = [(n, p) for n, p in peft.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n, _ in trainable)
    assert sorted(tuple(p.shape) for p in given) == sorted(tuple(p.shape) for _, p in trainable)
    assert (tmp_path / "lora" / "final" / "policy" / "adapter_config.json").is_file()
    records = read_metrics(config.run.output_dir)
    assert sum(r["loss"] for r in records[-2:]) < sum(r["loss"] for r in records[:2])
    if trainer == "kto":
        assert records[0]["loss"] == pytest.approx(0.5, abs=1e-6) and records[0]["kl"] == pytest.approx(0, abs=1e-6)
        assert any(abs(r["kl"]) > 1e-4 for r in records[1:])  # the adapter-on policy left its reference
        copy, _ = TRAINERS[trainer](tiny_dir, tmp_path, "copy", *common, "reference=copy")
        train(copy)
        kl = [r["kl"] for r in read_metrics(copy.run.output_dir)]
        assert kl == pytest.approx([r["kl"] for r in records], abs=1e-6)


@pytest.mark.parametrize("trainer", ["kto", "simpo", "orpo"])
def test_bf16_mixed_precision_runs_with_finite_losses(tiny_dir, tmp_path, trainer):
    """run.mixed_precision=bf16 (autocast on this CPU too), in a subprocess (accelerate keeps one mixed precision
    per process): two steps with finite loss and gradient norm, and a first loss near the float32 run's but not
    equal to it (the matmuls did run in bfloat16)."""
    import subprocess
    import sys

    import yaml

    from posttrain.runtime.config import to_dict

    losses = {}
    for precision in ("bf16", "no"):
        config, train = TRAINERS[trainer](tiny_dir, tmp_path, precision, f"run.mixed_precision={precision}")
        config.run.max_steps = 2
        if precision == "no":
            train(config)
        else:
            path = tmp_path / "bf16.yaml"
            path.write_text(yaml.safe_dump(to_dict(config)))
            verb = "kto" if trainer == "kto" else "dpo"
            command = [sys.executable, "-m", "posttrain.cli", verb, "--config", str(path)]
            done = subprocess.run(command, capture_output=True, text=True, timeout=300)
            assert done.returncode == 0, done.stderr[-3000:]
            assert "bf16 mixed precision" in done.stdout, done.stdout
        records = read_metrics(config.run.output_dir)
        assert len(records) == 2 and all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in records)
        losses[precision] = records[0]["loss"]
    assert losses["bf16"] != losses["no"] and losses["bf16"] == pytest.approx(losses["no"], rel=0.05)


def test_kto_precomputed_reference_matches_frozen_copy(tiny_dir, tmp_path):
    copy = _kto_config(tiny_dir, tmp_path, "copy", "reference=copy", "run.max_steps=3")
    pre = _kto_config(tiny_dir, tmp_path, "pre", "reference=precompute", "run.max_steps=3")
    train_kto(copy)
    train_kto(pre)
    assert all("time/reference" not in r for r in read_metrics(pre.run.output_dir))
    a = load_file(f"{copy.run.output_dir}/final/policy/model.safetensors")
    b = load_file(f"{pre.run.output_dir}/final/policy/model.safetensors")
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-6)
    kl = [[r["kl"] for r in read_metrics(c.run.output_dir)] for c in (copy, pre)]
    assert kl[0] == pytest.approx(kl[1], abs=1e-6)


def test_configs_refuse_knobs_their_loss_does_not_use(tmp_path):
    base = ["model.path=m", "data.path=d"]
    assert load_config(DPOConfig, None, base + ["loss_type=simpo", "beta=2", "simpo_gamma=1"]).reference_free
    assert load_config(DPOConfig, None, base + ["loss_type=orpo", "reference=none"]).reference == "none"
    refused = {
        "simpo_gamma applies to loss_type=simpo only": ["simpo_gamma=1"],
        "orpo_lambda applies to loss_type=orpo only": ["loss_type=simpo", "orpo_lambda=1"],
        "beta is not used by loss_type=orpo": ["loss_type=orpo", "beta=0.5"],
        "loss_type=simpo is reference-free": ["loss_type=simpo", "reference=precompute"],
        "loss_type=orpo is reference-free": ["loss_type=orpo", "reference_path=r"],
        "reference=none: loss_type=sigmoid needs a reference": ["reference=none"],
        r"loss_type must be one of \('sigmoid', 'ipo', 'hinge', 'simpo', 'orpo'\)": ["loss_type=kto"],
        "simpo_gamma and orpo_lambda must be >= 0": ["loss_type=simpo", "simpo_gamma=-1"],
    }
    for message, overrides in refused.items():
        with pytest.raises(ValueError, match=message):
            load_config(DPOConfig, None, base + overrides)
    for overrides, message in (
        (["desirable_weight=0"], "desirable_weight must be > 0"),
        (["reference=none"], r"reference must be one of \('auto', 'copy', 'adapter', 'precompute'\)"),
        (["reference=adapter"], "reference=adapter needs model.lora"),
    ):
        with pytest.raises(ValueError, match=message):
            load_config(KTOConfig, None, base + overrides)


def test_kto_reports_the_weight_ratio_against_the_papers_advice(tiny_dir, tmp_path, capsys):
    from posttrain.cli import main

    config = _kto_config(tiny_dir, tmp_path, "cli")  # 48 desirable, 48 undesirable rows
    overrides = [f"data.path={config.data.path}", f"model.path={config.model.path}", "data.chat_template=never"]
    overrides += [f"run.output_dir={tmp_path / 'cli'}", "run.max_steps=1", "run.progress=false", "run.batch_size=4"]
    assert main(["kto", *overrides, "desirable_weight=2.0"]) == 0
    out = capsys.readouterr().out
    assert "48 desirable, 48 undesirable examples" in out and "= 2, outside the paper's advised [1, 4/3]" in out
    assert json.loads((tmp_path / "cli" / "summary.json").read_text())["steps"] == 1
