"""``posttrain eval`` of a reward model (new-user trial, fourth session: there was no way to measure a
trained reward model on held-out pairs): loss, pairwise accuracy, margin, score spread and length bias,
each checked against scores computed one response at a time."""

import json
import math
import statistics
import subprocess
import sys

import pytest
import torch

from posttrain.data import DataConfig
from posttrain.models import ModelConfig, is_reward_checkpoint, load_reward_model, load_tokenizer, sequence_scores
from posttrain.trainers import rm

# rankings of K = 3 and K = 2, responses of different lengths, best first
ROWS = [
    {"prompt": "rank:", "responses": ["aeiou", "ab", "bcdfgh"]},
    {"prompt": "vowels?", "responses": ["oo", "kaaaaa"]},
    {"prompt": "rank:", "responses": ["ieaxyz", "eb", "c"]},
    {"prompt": "x", "responses": ["u", "zzzz"]},
    {"prompt": "count", "responses": ["aaa", "bbbbbbb", "cc"]},
]


@pytest.fixture
def rankings(tmp_path):
    path = tmp_path / "rankings.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return path


def _by_hand(model_dir, config) -> tuple[dict, list[list[float]]]:
    """The metrics from each response scored alone ([1, L], no padding, no batch)."""
    tokenizer = load_tokenizer(str(model_dir))
    examples, _ = rm.load_ranking_data(config, tokenizer)
    model = load_reward_model(ModelConfig(path=str(model_dir), device="cpu"))
    scores, lengths = [], []
    with torch.no_grad():
        for e in examples:
            ids = [torch.tensor([e.prompt_ids + r]) for r in e.response_ids]
            scores.append([float(sequence_scores(model, x, torch.ones_like(x))) for x in ids])
            lengths.append([len(r) for r in e.response_ids])
    losses, diffs, by_length = [], [], {"longer": [], "shorter": []}
    for s, n in zip(scores, lengths, strict=True):
        pairs = [(i, j) for i in range(len(s)) for j in range(i + 1, len(s))]
        losses.append(statistics.fmean(math.log1p(math.exp(-(s[i] - s[j]))) for i, j in pairs))
        diffs += [s[i] - s[j] for i, j in pairs]
        for i, j in pairs:
            if n[i] != n[j]:
                by_length["longer" if n[i] > n[j] else "shorter"].append(s[i] > s[j])
    flat = [x for s in scores for x in s]
    # the length probe: each ranking's best response with its content (the characters before <eos>) said twice
    twice_once = []
    with torch.no_grad():
        for e in examples:
            best = e.response_ids[0]
            assert best[-1] == tokenizer.eos_token_id and tokenizer.eos_token_id not in best[:-1]
            ids = [torch.tensor([e.prompt_ids + best[:-1] * 2 + best[-1:]]), torch.tensor([e.prompt_ids + best])]
            twice_once.append([float(sequence_scores(model, x, torch.ones_like(x))) for x in ids] + [len(best) - 1])
    expected_probe = {
        "eval/length_probe/longer_preferred": sum(t > o for t, o, _ in twice_once) / len(twice_once),
        "eval/length_probe/score_per_token": statistics.fmean((t - o) / n for t, o, n in twice_once),
        "eval/length_probe/pairs": len(twice_once),
    }
    expected = {
        "eval/loss": statistics.fmean(losses),
        "eval/accuracy": sum(d > 0 for d in diffs) / len(diffs),
        "eval/margin": statistics.fmean(diffs),
        "eval/score_mean": statistics.fmean(flat),
        "eval/score_std": statistics.pstdev(flat),
        "eval/rankings": len(examples),
        "eval/pairs": len(diffs),
        "eval/rows_read": len(ROWS),
        "eval/rows_truncated": 0,
        "eval/rows_dropped": 0,
        "eval/pairs_tied": sum(d == 0 for d in diffs),
        "eval/length_corr": statistics.correlation(flat, [float(x) for n in lengths for x in n]),
    }
    for kind, correct in by_length.items():
        expected[f"eval/accuracy_better_{kind}"] = sum(correct) / len(correct)
        expected[f"eval/pairs_better_{kind}"] = len(correct)
    return expected | expected_probe, scores


@pytest.mark.parametrize("batch_size", [1, 2, 16])
def test_reward_model_eval_equals_each_response_scored_alone(tiny_dir, tmp_path, rankings, batch_size):
    config = rm.RMEvalConfig(
        model=ModelConfig(path=str(tiny_dir / "reward")),
        data=DataConfig(path=str(rankings), chat_template="never"),
        batch_size=batch_size,
        output_dir=str(tmp_path / "out"),
    )
    metrics = rm.evaluate(config)
    expected, scores = _by_hand(tiny_dir / "reward", config)
    assert metrics.keys() == expected.keys()
    for key, value in expected.items():
        assert metrics[key] == pytest.approx(value, abs=1e-5), key
    assert (
        expected["eval/pairs_better_longer"] + expected["eval/pairs_better_shorter"] == 11
    )  # no two responses of a ranking are as long
    assert json.loads((tmp_path / "out" / "eval_summary.json").read_text()) == metrics
    rows = [json.loads(line) for line in (tmp_path / "out" / "eval_scores.jsonl").read_text().splitlines()]
    assert [r["responses"] for r in rows] == [r["responses"] for r in ROWS]
    assert [r["prompt"] for r in rows] == [r["prompt"] for r in ROWS]
    for row, alone in zip(rows, scores, strict=True):
        assert row["scores"] == pytest.approx(alone, abs=1e-5)


@pytest.mark.slow  # `make test-slow`: outside `make test`, which holds to 15 minutes
def test_posttrain_eval_of_a_reward_model_on_the_command_line(tiny_dir, tmp_path, rankings):
    """A reward model given to `posttrain eval` is evaluated on pairs; generation flags are refused."""
    assert is_reward_checkpoint(str(tiny_dir / "reward")) and not is_reward_checkpoint(str(tiny_dir / "policy"))
    command = [sys.executable, "-m", "posttrain.cli", "eval", "--model", str(tiny_dir / "reward")]
    command += ["--data", str(rankings), "--output-dir", str(tmp_path / "out"), "data.chat_template=never"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((tmp_path / "out" / "eval_summary.json").read_text())
    assert summary["eval/rankings"] == 5 and summary["eval/pairs"] == 11
    assert done.stdout.count("eval/accuracy_better_longer") == 1  # the table, once; the JSON in its file
    assert f"(as JSON: {tmp_path / 'out' / 'eval_summary.json'})" in done.stdout
    refused = subprocess.run(command + ["--temperature", "1", "--n", "4"], capture_output=True, text=True, timeout=300)
    assert refused.returncode == 2
    assert "is a reward model, evaluated on the ranked pairs of --data without generating: --temperature, --n" in (
        refused.stderr
    )


def test_reward_model_eval_reads_raw_scores_and_reports_what_the_data_limits_did(tiny_dir, tmp_path, rankings):
    """Review findings: a checkpoint's reward_normalization changed loss and margin (the trainer's
    held-out metrics are on raw scores); rows cut or dropped by data.max_length went unmentioned."""
    import shutil

    normalized = tmp_path / "normalized"
    shutil.copytree(tiny_dir / "reward", normalized)
    config_file = normalized / "config.json"
    config_json = json.loads(config_file.read_text())
    config_json["reward_normalization"] = {"mean": 0.5, "std": 0.05, "samples": 64}
    config_file.write_text(json.dumps(config_json))
    data = DataConfig(path=str(rankings), chat_template="never")
    raw = rm.evaluate(rm.RMEvalConfig(model=ModelConfig(path=str(tiny_dir / "reward")), data=data, length_probe=0))
    lines = []  # without the length probe, whose warning on this random model would join them
    got = rm.evaluate(
        rm.RMEvalConfig(model=ModelConfig(path=str(normalized)), data=data, length_probe=0), log=lines.append
    )
    for key, value in raw.items():
        assert got[key] == pytest.approx(value, abs=1e-6), key
    assert got["eval/normalized_score_mean"] == pytest.approx((raw["eval/score_mean"] - 0.5) / 0.05, abs=1e-4)
    assert got["eval/normalized_score_std"] == pytest.approx(raw["eval/score_std"] / 0.05, abs=1e-4)
    assert lines == ["[eval] data: 5 rows read, 5 kept, 0 truncated"]
    short = DataConfig(path=str(rankings), chat_template="never", max_length=8)
    lines.clear()
    cut = rm.evaluate(rm.RMEvalConfig(model=ModelConfig(path=str(tiny_dir / "reward")), data=short), log=lines.append)
    assert cut["eval/rows_read"] == 5 and cut["eval/rows_truncated"] + cut["eval/rows_dropped"] > 0, cut
    assert "truncated" in lines[0] and "[eval] data: 5 rows read" in lines[0]


def test_only_a_one_label_classifier_or_a_seq_cls_adapter_is_a_reward_checkpoint(tiny_dir, tmp_path):
    """Review findings: a 2-label classifier counted as a reward model; a Hub id went to the network;
    a broken adapter_config.json raised."""
    import shutil

    two = tmp_path / "two_labels"
    shutil.copytree(tiny_dir / "reward", two)
    config_json = json.loads((two / "config.json").read_text())
    config_json["id2label"] = {"0": "a", "1": "b"}
    config_json["label2id"] = {"a": 0, "b": 1}
    (two / "config.json").write_text(json.dumps(config_json))
    assert is_reward_checkpoint(str(tiny_dir / "reward")) and not is_reward_checkpoint(str(two))
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text('{"task_type": "SEQ_CLS"}')
    assert is_reward_checkpoint(str(adapter))
    (adapter / "adapter_config.json").write_text('{"task_type": "CAUSAL_LM"}')
    assert not is_reward_checkpoint(str(adapter))
    (adapter / "adapter_config.json").write_text("{not json")
    assert not is_reward_checkpoint(str(adapter))
    assert not is_reward_checkpoint("nobody-has/this-model-in-the-cache")  # local cache only: no network


def test_the_centering_term_ties_and_the_training_runs_settings(tiny_dir, tmp_path, rankings):
    """New-user trial (fifth session): the trainer's held-out loss holds the centering term, which the
    eval could not take; a half-precision model ties close scores, and a tie counts as wrong without a
    word; a run trained with margin=0.5 gave another loss than the eval's default, unexplained."""
    data = DataConfig(path=str(rankings), chat_template="never")
    reward = ModelConfig(path=str(tiny_dir / "reward"))
    plain = rm.evaluate(rm.RMEvalConfig(model=reward, data=data))
    centered = rm.evaluate(rm.RMEvalConfig(model=reward, data=data, center_coef=0.5))
    expected, scores = _by_hand(tiny_dir / "reward", rm.RMEvalConfig(model=reward, data=data))
    per_ranking = [
        statistics.fmean((s[i] + s[j]) ** 2 for i in range(len(s)) for j in range(i + 1, len(s))) for s in scores
    ]
    assert centered["eval/loss"] == pytest.approx(plain["eval/loss"] + 0.5 * statistics.fmean(per_ranking), abs=1e-5)
    # a zero score head: every pair tied, none in order
    flat = load_reward_model(reward)
    torch.nn.init.zeros_(flat.score.weight)
    flat.save_pretrained(tmp_path / "flat")
    load_tokenizer(str(tiny_dir / "reward")).save_pretrained(tmp_path / "flat")
    tied = rm.evaluate(rm.RMEvalConfig(model=ModelConfig(path=str(tmp_path / "flat")), data=data))
    assert tied["eval/pairs_tied"] == tied["eval/pairs"] == 11 and tied["eval/accuracy"] == 0.0
    # a model in RUN/final/reward: the run's settings that differ are named
    trained = rm.RMConfig(model=ModelConfig(path=str(tiny_dir / "policy")), data=data, margin=0.5)
    trained.run.output_dir, trained.run.max_steps, trained.run.batch_size = str(tmp_path / "run"), 1, 2
    trained.run.progress, trained.run.report_to = False, ["jsonl"]
    rm.train(trained)
    lines = []
    rm.evaluate(
        rm.RMEvalConfig(model=ModelConfig(path=str(tmp_path / "run" / "final" / "reward")), data=data), lines.append
    )
    assert any("used margin=0.5 (here 0.0)" in line for line in lines), lines
    lines.clear()
    final = ModelConfig(path=str(tmp_path / "run" / "final" / "reward"))
    rm.evaluate(rm.RMEvalConfig(model=final, data=data, margin=0.5), lines.append)
    assert not any("used" in line for line in lines), lines


@pytest.mark.slow  # `make test-slow`: outside `make test`, which holds to 15 minutes
def test_posttrain_eval_names_a_wrong_path_first(tiny_dir, tmp_path, rankings):
    """New-user trial (fifth session): a mistyped --model said "at least one reward function is needed",
    and a missing --reward-model ended in three tracebacks."""
    base = [sys.executable, "-m", "posttrain.cli", "eval", "--data", str(rankings)]
    for extra, message in (
        (["--model", str(tmp_path / "nope")], "--model: no model folder at"),
        (["--model", str(tiny_dir / "policy"), "--reward-model", str(tmp_path / "gone")], "--reward-model: no model"),
        (["--model", str(tiny_dir / "policy")], "is a policy, whose completions need them"),
    ):
        done = subprocess.run(base + extra, capture_output=True, text=True, timeout=300)
        assert done.returncode == 2 and message in done.stderr and "Traceback" not in done.stderr, done.stderr


# --------------------------------------------------------------------------------------------------
# the length probe (issue 34, 2b): the same answer said once and twice
# --------------------------------------------------------------------------------------------------


def _paying_for_length(tiny_dir, out, sign: float):
    """The tiny reward model rewired by hand so that its score is a strictly monotone function of the number of
    tokens n it reads: every attention score 0 (uniform attention), a value only at <bos>, so the last token
    holds <bos>'s value / n; the score reads it with ``sign`` − 1 pays for length (longer: higher), + 1 for
    brevity. Scores of 3 and 43 tokens: −10.9 and −2.8, far apart on any CPU."""
    model = load_reward_model(ModelConfig(path=str(tiny_dir / "reward")))
    tokenizer = load_tokenizer(str(tiny_dir / "reward"))
    with torch.no_grad():
        embeddings = model.model.embed_tokens.weight
        embeddings[:, 0], embeddings[:, 1] = 0.0, 1.0
        embeddings[tokenizer.bos_token_id] = 0.0
        embeddings[tokenizer.bos_token_id, 0] = 1.0
        for layer in model.model.layers:
            attention = layer.self_attn
            for linear in (attention.q_proj, attention.k_proj, attention.v_proj, attention.o_proj, layer.mlp.down_proj):
                linear.weight.zero_()
        model.model.layers[0].self_attn.v_proj.weight[0, 0] = 1.0
        model.model.layers[0].self_attn.o_proj.weight[0, 0] = 1.0
        model.score.weight.zero_()
        model.score.weight[0, 0] = sign
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def test_reward_model_eval_probes_length_with_the_same_answer_said_twice(tiny_dir, tmp_path, rankings):
    data = DataConfig(path=str(rankings), chat_template="never")
    warnings = {}
    for sign, share in ((-1.0, 1.0), (1.0, 0.0)):
        path = _paying_for_length(tiny_dir, tmp_path / str(sign), sign)
        lines = []
        metrics = rm.evaluate(rm.RMEvalConfig(model=ModelConfig(path=str(path)), data=data), log=lines.append)
        assert metrics["eval/length_probe/pairs"] == 5 and metrics["eval/length_probe/longer_preferred"] == share
        assert (metrics["eval/length_probe/score_per_token"] > 0) == (sign < 0)
        warnings[sign] = [line for line in lines if "warning" in line]
    assert warnings[1.0] == [] and len(warnings[-1.0]) == 1
    assert warnings[-1.0][0].startswith(
        "[eval] warning (alert 16): the reward model pays for length: the same answer said twice scored above it "
        "said once in 100% of 5 pairs (+"
    )
    expected, _ = _by_hand(path, rm.RMEvalConfig(model=ModelConfig(path=str(path)), data=data))
    assert metrics["eval/length_probe/score_per_token"] == pytest.approx(expected["eval/length_probe/score_per_token"])
    off = rm.evaluate(rm.RMEvalConfig(model=ModelConfig(path=str(path)), data=data, length_probe=0))
    assert not any("length_probe" in k for k in off)


def test_the_length_probe_leaves_out_answers_said_twice_that_pass_the_models_context(tiny_dir, tmp_path, rankings):
    """With data.max_length null, the answer said twice could pass the model's positions; such pairs are left out.
    Prompt + response said twice, in tokens: 17, 13, 19, 5, 13; a context of 16 keeps three (every row fits once)."""
    short = tmp_path / "short"
    model = load_reward_model(ModelConfig(path=str(tiny_dir / "reward"), device="cpu"))
    model.config.max_position_embeddings = 16
    model.save_pretrained(short)
    load_tokenizer(str(tiny_dir / "reward")).save_pretrained(short)
    data = DataConfig(path=str(rankings), chat_template="never")
    metrics = rm.evaluate(rm.RMEvalConfig(model=ModelConfig(path=str(short)), data=data), log=lambda _: None)
    assert metrics["eval/rankings"] == 5 and metrics["eval/length_probe/pairs"] == 3


def test_posttrain_rm_ends_with_a_length_probe_that_warns_when_the_model_pays_for_length(
    tiny_dir, tmp_path, rankings, capsys
):
    """Issue 34, 2b: a reward model whose score rose with length let PPO run to the length limit, and nothing at the
    end of `posttrain rm` said so. Now a length probe ends it: one line, a warning when the model prefers the
    same answer said twice, in the final metrics and as alert 16 in alerts.jsonl (which the report shows)."""
    from posttrain.monitor.alerts import read_alerts

    for sign in (-1.0, 1.0):
        config = rm.RMConfig(
            model=ModelConfig(path=str(_paying_for_length(tiny_dir, tmp_path / f"model{sign}", sign))),
            data=DataConfig(path=str(rankings), chat_template="never", eval_fraction=0.4),
        )
        config.optim.lr = 1e-9  # one step that leaves the hand-built preference as it is
        config.run.output_dir, config.run.max_steps, config.run.batch_size = str(tmp_path / f"run{sign}"), 1, 2
        config.run.progress, config.run.report_to = False, ["jsonl"]
        result = rm.train(config)
        out = capsys.readouterr().out
        probe = {k: v for k, v in result["final_metrics"].items() if k.startswith("length_probe/")}
        assert probe["length_probe/pairs"] == 2 and probe["length_probe/longer_preferred"] == (sign < 0), probe
        alerts = [a for a in read_alerts(config.run.output_dir) if a["id"] == 16]
        if sign < 0:
            assert "[rm] warning (held-out answers, alert 16): the reward model pays for length" in out, out
            assert len(alerts) == 1 and "in 100% of 2 pairs" in alerts[0]["seen"] and alerts[0]["step"] == 1
        else:
            assert "[rm] length probe (held-out answers): the same answer said twice scored above it" in out, out
            assert "in 0% of 2 pairs" in out and alerts == []
