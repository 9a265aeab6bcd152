"""posttrain.monitor: pass@k, held-out evaluation during GRPO/PPO and in ``posttrain eval``, health alerts
(rules on synthetic metric streams, and short real runs that must raise them), and the HTML report."""

import itertools
import json
import math
from collections import deque
from dataclasses import replace

import pytest
from conftest import write_jsonl
from helpers import dead_copy

from posttrain.monitor.alerts import DEAD_RUN_RULES, RULES, WATCHED, AlertConfig, HealthMonitor, pearson, read_alerts
from posttrain.monitor.evaluate import pass_at_k, summarize
from posttrain.runtime.config import load_config
from posttrain.runtime.metrics import read_metrics
from posttrain.trainers.grpo import GRPOConfig
from posttrain.trainers.grpo import train as train_grpo
from posttrain.trainers.ppo import PPOConfig
from posttrain.trainers.ppo import train as train_ppo

EXACT = "rewards=[{function: 'posttrain.rewards.builtin:exact_answer'}]"
HELD_OUT = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(10) for b in range(10)]

# --------------------------------------------------------------------------------------------------
# pass@k
# --------------------------------------------------------------------------------------------------


def _brute_force_pass_at_k(n: int, c: int, k: int) -> float:
    """Share of the k-subsets of n samples (the first c correct) that hold at least one correct sample."""
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(i < c for i in s) for s in subsets) / len(subsets)


def test_pass_at_k_equals_brute_force_over_subsets():
    for n in range(1, 9):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert pass_at_k(n, c, k) == pytest.approx(_brute_force_pass_at_k(n, c, k), abs=1e-12), (n, c, k)


def test_pass_at_k_hand_values_and_range_checks():
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)  # pass@1 is the share correct
    assert pass_at_k(4, 1, 2) == pytest.approx(1 - 3 / 6)  # 1 − C(3,2)/C(4,2)
    assert pass_at_k(8, 0, 8) == 0.0 and pass_at_k(8, 1, 8) == 1.0
    with pytest.raises(ValueError, match="k <= n"):
        pass_at_k(4, 1, 5)


def test_summarize_greedy_accuracy_pass_at_k_length_and_truncation():
    def row(mode, prompt, correct, length=3, truncated=False):
        score = 1.0 if correct else 0.0
        return {
            "mode": mode,
            "prompt_index": prompt,
            "score": score,
            "rewards": {"exact": score},
            "correct": correct,
            "length": length,
            "truncated": truncated,
        }

    records = [row("greedy", 0, True, 2), row("greedy", 1, False, 4, True)]
    records += [row("sampled", 0, c) for c in (True, False, False, False)]  # c = 1 of n = 4
    records += [row("sampled", 1, c) for c in (True, True, False, False)]  # c = 2 of n = 4
    out = summarize(records, [1, 2, 4])
    assert out["eval/greedy/accuracy"] == 0.5 and out["eval/greedy/reward/exact"] == 0.5
    assert out["eval/greedy/length"] == 3.0 and out["eval/greedy/truncated_share"] == 0.5
    assert out["eval/sampled/pass@1"] == pytest.approx((1 / 4 + 2 / 4) / 2)
    assert out["eval/sampled/pass@2"] == pytest.approx(((1 - 3 / 6) + (1 - 1 / 6)) / 2)
    assert out["eval/sampled/pass@4"] == 1.0


# --------------------------------------------------------------------------------------------------
# alert rules on synthetic metric streams
# --------------------------------------------------------------------------------------------------


def _monitor(tmp_path=None, **thresholds):
    seen = []
    monitor = HealthMonitor(
        AlertConfig(window=4, **thresholds), tmp_path, "reward/mean", "reward/std", echo=seen.append
    )
    return monitor, seen


def _stream(records, tmp_path=None, **thresholds) -> list[int]:
    """Feed records (one per step) to a monitor; the alert ids raised, in order."""
    monitor, _ = _monitor(tmp_path, **thresholds)
    return [a["id"] for step, r in enumerate(records, 1) for a in monitor.check(step, r)]


BASE = {
    "reward/mean": 0.5,
    "reward/std": 0.5,
    "kl/per_token": 0.01,
    "policy/clipfrac": 0.02,
    "policy/ratio_mean": 1.0,
    "policy/first_minibatch_ratio_max": 1.0,
    "policy/first_minibatch_ratio_min": 1.0,
    "response_length/mean": 20.0,
    "entropy": 1.0,
    "groups/zero_variance_share": 0.1,
    "truncated_share": 0.0,
    "policy/loss": 0.1,
    "grad_norm": 1.0,
}


def _healthy(steps=12):
    return [{**BASE, "reward/mean": 0.5 + 0.01 * i, "kl/per_token": 0.01 + 0.001 * i} for i in range(steps)]


def test_healthy_stream_raises_nothing():
    assert _stream(_healthy()) == []


@pytest.mark.parametrize(
    "rule_id, change",
    [
        (1, lambda i, r: {"kl/per_token": 0.9 if i == 6 else r["kl/per_token"]}),  # too large
        (1, lambda i, r: {"kl/per_token": 0.01 + 0.05 * i}),  # rising fast: +0.15 within 4 steps
        (2, lambda i, r: {"kl/per_token": 1e-5, "reward/mean": 0.5}),  # tiny KL, flat reward
        (3, lambda i, r: {"policy/clipfrac": 0.5}),
        (3, lambda i, r: {"policy/ratio_mean": 1.5}),
        (4, lambda i, r: {"policy/first_minibatch_ratio_max": 1.3} if i == 0 else {}),
        (5, lambda i, r: {"values/explained_variance": -0.5, "value_loss": 1.0}),
        (5, lambda i, r: {"values/explained_variance": 0.5, "value_loss": 1.0 * 2**i}),
        (6, lambda i, r: {"response_length/mean": 20.0 + 5 * i}),  # reward rises with it
        (8, lambda i, r: {"entropy": 1.0 if i < 4 else 0.05}),
        (9, lambda i, r: {"groups/zero_variance_share": 0.8}),
        (10, lambda i, r: {"truncated_share": 0.5}),
        (11, lambda i, r: {"grad_norm": math.nan} if i == 5 else {}),
        (11, lambda i, r: {"reward/mean": math.inf} if i == 5 else {}),
    ],
)
def test_each_rule_fires_on_its_pattern_and_only_once_while_it_holds(rule_id, change):
    records = [{**r, **change(i, r)} for i, r in enumerate(_healthy())]
    raised = _stream(records)
    assert rule_id in raised, raised
    assert raised.count(rule_id) == 1  # raised at onset, not at every step it holds


def test_a_step_nothing_scored_is_no_sampler_mismatch_and_no_non_finite_reward():
    """New-user finding 15: a GRPO step no reward function scored (reward/mean NaN by design, with
    reward/applicable_share 0, and no policy metrics: nothing trained) raised alerts 4 and 11."""
    nothing = {k: v for k, v in BASE.items() if not k.startswith("policy/") and k not in ("entropy", "grad_norm")}
    nothing |= {"reward/mean": math.nan, "reward/applicable_share": 0.0}
    records = _healthy()
    records[5] = nothing
    assert _stream(records) == []
    records[5] = {**BASE, "reward/mean": math.nan, "reward/applicable_share": 0.5}  # scored, and still NaN
    assert _stream(records) == [11]


def test_length_rule_needs_the_correlation_with_reward():
    longer_but_worse = [
        {**r, "response_length/mean": 20.0 + 5 * i, "reward/mean": 1.0 - 0.05 * i} for i, r in enumerate(_healthy())
    ]
    assert 6 not in _stream(longer_but_worse)
    assert pearson([1, 2, 3], [2, 4, 6]) == pytest.approx(1.0) and pearson([1, 2, 3], [1, 1, 1]) == 0.0


def test_rise_then_collapse_needs_eval_down_and_training_reward_up(tmp_path):
    def with_eval(eval_scores, reward_slope):
        records = []
        for i, r in enumerate(_healthy()):
            r = {**r, "reward/mean": 0.5 + reward_slope * i}
            if i % 3 == 2:
                r["eval/greedy/score"] = eval_scores[i // 3]
            records.append(r)
        return records

    assert 7 in _stream(with_eval([0.78, 0.80, 0.74, 0.69], 0.02))  # the 78% → 69% with reward up
    assert 7 not in _stream(with_eval([0.78, 0.80, 0.74, 0.69], -0.02))  # both down: no hacking signal
    assert 7 not in _stream(with_eval([0.70, 0.74, 0.78, 0.80], 0.02))


def test_resumed_monitor_continues_the_history_instead_of_starting_over(tmp_path):
    """A resumed run replays its logged records: a trend rule whose window straddles the checkpoint fires
    at the same step as in the uninterrupted run, and an alert active at the checkpoint is not raised
    again (before, the history restarted empty: the KL rise was missed and the clip alert came twice)."""
    records = [
        {**r, "kl/per_token": 0.01 + 0.05 * i, "policy/clipfrac": 0.5 if i < 2 else r["policy/clipfrac"]}
        for i, r in enumerate(_healthy(8))
    ]
    straight, _ = _monitor()
    expected = [(step, a["id"]) for step, r in enumerate(records, 1) for a in straight.check(step, r)]
    assert (2, 1) not in expected and any(i == 1 and s > 2 for s, i in expected)  # the KL trend crosses step 2

    def resumed(with_restore):
        first, _ = _monitor(tmp_path / str(with_restore))
        raised = [(step, a["id"]) for step, r in enumerate(records[:2], 1) for a in first.check(step, r)]
        second, _ = _monitor(tmp_path / str(with_restore))
        if with_restore:
            second.restore([{"step": i, "time": 0.0, **r} for i, r in enumerate(records[:2], 1)], len(raised))
        raised += [(step, a["id"]) for step, r in enumerate(records[2:], 3) for a in second.check(step, r)]
        return raised, second.raised, read_alerts(tmp_path / str(with_restore))

    raised, count, written = resumed(True)
    assert raised == expected and count == len(expected) == len(written)
    assert [(a["step"], a["id"]) for a in written] == expected
    assert resumed(False)[0] != expected  # what the restore fixes


def test_truncation_rule_is_silent_when_length_is_forced():
    records = [{**r, "truncated_share": 1.0} for r in _healthy()]
    monitor = HealthMonitor(AlertConfig(window=4), None, "reward/mean", "reward/std", True, echo=lambda s: None)
    assert all(monitor.check(i, r) == [] for i, r in enumerate(records, 1))


def test_metrics_jsonl_is_strict_json_and_every_reader_reads_nan_back(tmp_path):
    """New-user finding 17: metrics.jsonl held bare NaN, which jq and strict JSON parsers refuse."""
    from posttrain.monitor.records import strict_json
    from posttrain.monitor.report import write_report
    from posttrain.runtime.metrics import MetricsLogger

    logger = MetricsLogger(tmp_path / "run", ["jsonl"], {}, progress=False)
    logger.log(1, {"reward/mean": math.nan, "grad_norm": math.inf, "loss": 0.5})
    logger.close()
    (line,) = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()

    def refuse(constant):
        raise ValueError(f"not JSON: {constant}")

    record = json.loads(line, parse_constant=refuse)  # what a strict parser accepts
    assert record["reward/mean"] is None and record["grad_norm"] is None and record["loss"] == 0.5
    (read,) = read_metrics(tmp_path / "run")
    assert math.isnan(read["reward/mean"]) and math.isnan(read["grad_norm"]) and read["loss"] == 0.5
    assert "<b>reward/mean</b> nan" in write_report([tmp_path / "run"], tmp_path / "report.html").read_text()
    (tmp_path / "old").mkdir()  # a run written before: bare NaN still reads
    (tmp_path / "old" / "metrics.jsonl").write_text('{"step": 1, "reward/mean": NaN}\n')
    assert math.isnan(read_metrics(tmp_path / "old")[0]["reward/mean"])
    assert strict_json({"final_metrics": {"a": math.nan, "b": [math.inf, 1.0]}}) == {
        "final_metrics": {"a": None, "b": [None, 1.0]}
    }


def test_alerts_go_to_console_and_jsonl_with_what_was_seen_causes_and_remedy(tmp_path):
    monitor, seen = _monitor(tmp_path)
    monitor.check(1, {**BASE, "policy/first_minibatch_ratio_max": 1.5})
    (alert,) = read_alerts(tmp_path)
    assert alert["id"] == 4 and alert["step"] == 1 and "1.5" in alert["seen"]
    assert alert["causes"] and alert["remedy"] and "[alert 4" in seen[0] and alert["remedy"] in seen[0]
    assert len({r.id for r in RULES}) == 13 and all(r.causes.endswith(".") and r.remedy.endswith(".") for r in RULES)


# --------------------------------------------------------------------------------------------------
# real runs: evaluation wiring, `posttrain eval`, and the alerts the issue asks for
# --------------------------------------------------------------------------------------------------


def _grpo(noisy_sft, out, *overrides):
    base = [
        f"model.path={noisy_sft['policy']}",
        f"data.path={noisy_sft['prompts']}",
        "data.chat_template=never",
        f"run.output_dir={out}",
        "run.progress=false",
        "run.report_to=[jsonl]",
        EXACT,
        "sampling.max_new_tokens=4",
        "num_generations=8",
        "run.batch_size=64",
        "run.micro_batch_size=64",
        "optim.lr=5e-4",
        "kl_coef=0",
        "num_iterations=2",
    ]
    return load_config(GRPOConfig, None, base + list(overrides))


@pytest.fixture(scope="module")
def healthy_grpo(noisy_sft, tmp_path_factory):
    """The demo's GRPO settings for 10 steps at a lower learning rate, with 20% of the prompts held out and
    evaluated every 4 steps (greedy, and 4 samples for pass@k). At the demo's 5e-4 the held-out greedy
    accuracy peaks at step 4 and falls after it (0.93 → 0.80 sampled by the lean engine, 0.82 → 0.75 by
    hf's generate), which alert 7 rightly reports; at 2e-4 it rises at every evaluation (0.38, 0.92, 0.98,
    1.0 with the lean engine that rollout.engine=auto picks)."""
    out = tmp_path_factory.mktemp("healthy_grpo")
    config = _grpo(
        noisy_sft,
        out,
        "optim.lr=2e-4",
        "run.max_steps=10",
        "run.eval_every=4",
        "data.eval_fraction=0.2",
        "eval.n=4",
        "eval.k=[1,4]",
        "alerts.window=4",
    )
    train_grpo(config)
    return out


def test_grpo_evaluates_held_out_prompts_every_eval_every_steps_and_at_the_end(healthy_grpo, noisy_sft):
    records = read_metrics(healthy_grpo)
    evaluated = [r["step"] for r in records if "eval/greedy/accuracy" in r]
    assert evaluated == [0, 4, 8, 10]  # step 0: the starting model, before any update (issue 24 item 15)
    rows = [json.loads(line) for line in (healthy_grpo / "eval_samples.jsonl").read_text().splitlines()]
    held_out = round(0.2 * 300)
    assert len(rows) == 4 * (held_out + 4 * held_out)  # 4 evaluations × (greedy + 4 samples) per prompt
    last = [r for r in rows if r["step"] == 10]
    greedy = [r for r in last if r["mode"] == "greedy"]
    assert records[-1]["eval/greedy/accuracy"] == pytest.approx(sum(r["correct"] for r in greedy) / len(greedy))
    assert 0 <= records[-1]["eval/sampled/pass@1"] <= records[-1]["eval/sampled/pass@4"] <= 1
    assert all("time/eval" in r for r in records if r["step"] in evaluated)


def test_held_out_prompts_are_split_off_the_training_prompts(noisy_sft, tmp_path):
    from posttrain.trainers.grpo import GRPOTrainer

    trainer = GRPOTrainer(_grpo(noisy_sft, tmp_path, "data.eval_fraction=0.2", "run.max_steps=1"))
    held_out = trainer.monitor.evaluator.prompts
    assert len(trainer.prompts) == 240 and len(held_out) == 60
    assert not {id(p) for p in trainer.prompts} & {id(p) for p in held_out}  # the sampler never sees them
    with pytest.raises(ValueError, match="eval.path or data.eval_fraction"):
        GRPOTrainer(_grpo(noisy_sft, tmp_path, "data.eval_fraction=0.2", f"eval.path={noisy_sft['prompts']}"))


def test_healthy_demo_like_grpo_raises_no_alert(healthy_grpo):
    assert read_alerts(healthy_grpo) == []
    assert read_metrics(healthy_grpo)[-1]["alerts"] == 0


def test_posttrain_eval_reproduces_the_demo_accuracies(healthy_grpo, noisy_sft, tmp_path, capsys):
    """`posttrain eval` on the SFT model and on the GRPO model gives the accuracies the demo computes
    (posttrain.demo.accuracy: greedy, and 4 samples per prompt at T = 1 after seeding)."""
    from posttrain.cli import main
    from posttrain.demo import accuracy

    data = write_jsonl(tmp_path / "held_out.jsonl", HELD_OUT)
    for i, model in enumerate((noisy_sft["policy"], str(healthy_grpo / "final" / "policy"))):
        argv = ["eval", "--model", model, "--data", data, "--rewards", "posttrain.rewards.builtin:exact_answer"]
        argv += ["--temperature", "1", "--n", "4", "--k", "1,2,4", "--greedy", "--max-new-tokens", "4"]
        out = tmp_path / f"eval{i}"
        argv += ["--output-dir", str(out)]
        assert main([*argv, "data.chat_template=never", "eval.batch_size=100", "model.device=cpu"]) == 0
        printed = capsys.readouterr().out
        summary = json.loads((out / "eval_summary.json").read_text())
        assert printed.count("eval/greedy/accuracy") == 1  # the table, once; the JSON in the file it names
        assert summary["eval/greedy/accuracy"] == pytest.approx(accuracy(model, HELD_OUT, 0))
        assert summary["eval/sampled/accuracy"] == pytest.approx(accuracy(model, HELD_OUT, 1.0, samples=4, seed=0))
        assert summary["eval/sampled/pass@1"] == pytest.approx(summary["eval/sampled/accuracy"])
        assert summary["eval/prompts"] == 100


def test_posttrain_eval_flags_fail_clearly(noisy_sft, tmp_path, capsys):
    from posttrain.cli import main

    data = write_jsonl(tmp_path / "held_out.jsonl", HELD_OUT[:2])
    with pytest.raises(SystemExit):
        main(
            ["eval", "--model", noisy_sft["policy"], "--data", data, "--rewards", "x:y"]
            + ["--temperature", "1"]
            + ["--n", "4", "--k", "8"]
        )
    assert "eval.k" in capsys.readouterr().err


def test_length_reward_raises_length_alert_and_length_penalty_does_not(noisy_sft, tmp_path):
    """Alert 6: a reward that pays per character makes responses grow with the reward; the same run
    with a length penalty does not."""

    def run(per_token: float, name: str):
        config = _grpo(
            noisy_sft,
            tmp_path / name,
            f"rewards=[{{function: 'posttrain.rewards.length:per_token_length', kwargs: {{per_token: {per_token}}}}}]",
            "sampling.max_new_tokens=12",
            "run.batch_size=32",
            "run.max_steps=8",
            "optim.lr=2e-3",
            "alerts.window=6",
        )
        train_grpo(config)
        return read_alerts(tmp_path / name), read_metrics(tmp_path / name)

    rewarded, metrics = run(-0.1, "longer")  # −penalty = +0.1 per character
    assert 6 in [a["id"] for a in rewarded], (rewarded, [r["response_length/mean"] for r in metrics])
    length_alert = next(a for a in rewarded if a["id"] == 6)
    assert "correlation with the reward" in length_alert["seen"]
    penalised, _ = run(0.1, "shorter")
    assert 6 not in [a["id"] for a in penalised]


@pytest.fixture(scope="module")
def kl_ppo(noisy_sft, tmp_path_factory):
    """PPO with kl_coef = 0 and lr = 1e-2 for 5 steps, evaluated on eval.path at the end."""
    out = tmp_path_factory.mktemp("kl_ppo")
    eval_path = write_jsonl(out / "held_out.jsonl", HELD_OUT[:16])
    config = load_config(
        PPOConfig,
        None,
        [
            f"model.path={noisy_sft['policy']}",
            f"data.path={noisy_sft['prompts']}",
            "data.chat_template=never",
            f"run.output_dir={out / 'run'}",
            "run.progress=false",
            "run.report_to=[jsonl]",
            EXACT,
            "critic=policy",
            "kl_coef=0",
            "optim.lr=1e-2",
            "sampling.max_new_tokens=4",
            "run.batch_size=16",
            "run.max_steps=5",
            "alerts.window=4",
            f"eval.path={eval_path}",
            "run.eval_every=5",
        ],
    )
    train_ppo(config)
    return out / "run"


def test_kl_coef_zero_with_high_lr_raises_kl_alert_in_ppo_with_held_out_eval(kl_ppo):
    """Alert 1 in PPO (kl_coef = 0, lr = 1e-2), and PPO's held-out evaluation from eval.path."""
    alerts, records = read_alerts(kl_ppo), read_metrics(kl_ppo)
    assert 1 in [a["id"] for a in alerts], [r["kl/per_token"] for r in records]
    assert "eval/greedy/accuracy" in records[-1] and "eval/greedy/accuracy" in records[0]  # step 5 and step 0
    assert records[0]["step"] == 0 and all("eval/greedy/accuracy" not in r for r in records[1:-1])


def test_sampling_and_training_temperature_mismatch_raises_alert_4_at_step_1(noisy_sft, tmp_path, monkeypatch):
    """Alert 4: the training forward takes log-probs at τ = 1 while the sampler drew at τ = 0.7."""
    import posttrain.trainers.grpo as grpo

    original = grpo.policy_logprobs

    def at_temperature_one(model, rollout, rows, device, **kwargs):
        return original(model, replace(rollout, temperature=1.0), rows, device, **kwargs)

    monkeypatch.setattr(grpo, "policy_logprobs", at_temperature_one)
    config = _grpo(noisy_sft, tmp_path / "mismatch", "run.max_steps=1", "sampling.temperature=0.7", "run.batch_size=32")
    train_grpo(config)
    alerts = read_alerts(tmp_path / "mismatch")
    assert [(a["id"], a["step"]) for a in alerts] == [(4, 1)]


# --------------------------------------------------------------------------------------------------
# the report, opened in headless Chromium
# --------------------------------------------------------------------------------------------------


def _chromium() -> str:
    """The chromium binary; installed with apt-get (Debian's package) when missing and possible."""
    import os
    import shutil
    import subprocess

    found = shutil.which("chromium")
    if found is None and shutil.which("apt-get") and os.geteuid() == 0:
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        subprocess.run(["apt-get", "update", "-qq"], env=env, capture_output=True, timeout=600)
        subprocess.run(["apt-get", "install", "-y", "-qq", "chromium"], env=env, capture_output=True, timeout=900)
        found = shutil.which("chromium")
    if found is None:
        pytest.skip("chromium is not installed and apt-get could not install it (not root, or no package source)")
    return found


def test_report_renders_every_plot_in_headless_chromium(healthy_grpo, kl_ppo, tmp_path):
    import re
    import subprocess

    from posttrain.monitor.report import write_report

    path = write_report([healthy_grpo, kl_ppo], tmp_path / "report.html")
    text = path.read_text()
    assert not re.search(r"""(src|href)=["']https?:""", text)  # nothing to fetch: plots are inline SVG
    assert "Alerts" in text and "kl_large" in text and "Held-out samples" in text
    browser = [_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars"]
    dom = subprocess.run([*browser, "--dump-dom", path.as_uri()], capture_output=True, text=True, timeout=180)
    body = re.search(r'<body data-plots="(\d+)/(\d+)" data-errors="(\d+)"', dom.stdout)
    assert body, dom.stderr[-2000:]
    rendered, plots, errors = map(int, body.groups())
    # reward, held-out, KL, length, entropy, clipfrac, value loss, explained variance, phases, alerts
    assert plots == 10 and rendered == plots and errors == 0
    assert "Uncaught" not in dom.stderr
    shot = tmp_path / "report.png"
    subprocess.run(
        [*browser, "--window-size=1280,1600", f"--screenshot={shot}", path.as_uri()], capture_output=True, timeout=180
    )
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000


# --------------------------------------------------------------------------------------------------
# the report's figures, from synthetic run folders
# --------------------------------------------------------------------------------------------------


def _run_folder(folder, config: dict, rewards: list[float], alerts: tuple[dict, ...] = ()):
    """A run folder as the trainers leave it: config.yaml, metrics.jsonl (steps 1, 2, ...), alerts.jsonl."""
    import yaml

    folder.mkdir(parents=True)
    (folder / "config.yaml").write_text(yaml.safe_dump(config))
    write_jsonl(folder / "metrics.jsonl", [{"step": i, "reward/mean": r} for i, r in enumerate(rewards, 1)])
    alerts = [{"name": "kl_large", "seen": "KL 0.6", "causes": "c.", "remedy": "r.", **a} for a in alerts]
    write_jsonl(folder / "alerts.jsonl", alerts)
    return folder


@pytest.fixture
def grpo_and_ppo_runs(tmp_path):
    """Two GRPO runs with rewards in [0, 1] and a PPO run from −5 to 10 (−5 + 1.5 per step after the
    first) with alert 1 at step 4, as the report reads them."""
    from posttrain.monitor.report import load_run

    grpo = {"num_generations": 8, "kl_coef": 0.0, "run": {"seed": 0}}
    ppo = {"critic": "policy", "vf_coef": 0.1, "kl_coef": 0.05, "run": {"seed": 0}}
    folders = [
        _run_folder(tmp_path / "grpo", grpo, [0.1 * i for i in range(11)]),
        _run_folder(tmp_path / "grpo_seed1", {**grpo, "run": {"seed": 1}}, [0.2 + 0.05 * i for i in range(11)]),
        _run_folder(tmp_path / "ppo", ppo, [-5 + 1.5 * i for i in range(11)], ({"step": 4, "id": 1},)),
    ]
    return [load_run(folder, folder.name) for folder in folders]


def _reward_figure(runs):
    import matplotlib

    matplotlib.use("Agg")
    from posttrain.monitor.report import _panel_figure

    return _panel_figure("Training reward", ["reward/mean"], "mean", runs, ["C0", "C1", "C2"][: len(runs)])


def test_report_gives_each_algorithm_its_own_y_axis_where_scales_differ(grpo_and_ppo_runs):
    """GRPO's 0–1 reward beside PPO's −5…10: one y-axis each (on one PPO would flatten GRPO to a
    fifteenth of the height); the two GRPO runs, one algorithm, share theirs."""
    fig = _reward_figure(grpo_and_ppo_runs)
    grpo_axis, ppo_axis = fig.axes
    assert [line.get_label() for line in grpo_axis.lines] == ["grpo: reward/mean", "grpo_seed1: reward/mean"]
    assert [line.get_label() for line in ppo_axis.lines] == ["ppo: reward/mean", "ppo: alert"]
    low, high = grpo_axis.get_ylim()
    assert -0.2 < low <= 0.0 and 1.0 <= high < 1.2  # the GRPO curves fill their axis
    low, high = ppo_axis.get_ylim()
    assert low <= -5 and high >= 10 and high - low < 20
    assert ppo_axis.get_shared_x_axes().joined(grpo_axis, ppo_axis)  # one step axis under both
    assert ppo_axis.get_xlabel() == "step" and grpo_axis.get_ylabel() == "grpo, grpo_seed1"

    same_scale = [grpo_and_ppo_runs[0], replace(grpo_and_ppo_runs[2], records=grpo_and_ppo_runs[0].records)]
    (shared,) = _reward_figure(same_scale).axes  # the same scale: one axis, as before
    assert [line.get_label() for line in shared.lines] == ["grpo: reward/mean", "ppo: reward/mean", "ppo: alert"]


def test_report_marks_an_alert_on_the_curves_of_its_run_only(grpo_and_ppo_runs, tmp_path):
    import matplotlib.colors

    fig = _reward_figure(grpo_and_ppo_runs)
    markers = [(ax, line) for ax in fig.axes for line in ax.lines if line.get_gid()]
    ((ax, marker),) = markers
    assert ax is fig.axes[1] and marker.get_gid() == "alerts-of-ppo"
    assert list(marker.get_xdata()) == [4] and list(marker.get_ydata()) == pytest.approx([-5 + 1.5 * 3])
    assert matplotlib.colors.same_color(marker.get_color(), ax.lines[0].get_color())  # the run's colour
    assert not fig.axes[0].texts and [t.get_text() for t in ax.texts] == ["1"]  # the alert's number

    from posttrain.monitor.report import write_report

    text = write_report([run.path for run in grpo_and_ppo_runs], tmp_path / "report.html").read_text()
    assert text.count('id="alerts-of-ppo"') == 1 and "alerts-of-grpo" not in text  # one panel, ppo's axis


def test_report_alert_timeline_is_in_steps_over_the_runs_span(grpo_and_ppo_runs):
    """One alert at step 4 of runs logged at steps 1–11: the timeline's x-axis spans the runs' steps, in
    whole steps (autoscaled to the lone alert, it spanned fractions of a step around it)."""
    import matplotlib

    matplotlib.use("Agg")
    from posttrain.monitor.report import _alert_figure

    fig = _alert_figure(grpo_and_ppo_runs, ["C0", "C1", "C2"])
    (ax,) = fig.axes
    low, high = ax.get_xlim()
    assert ax.get_xlabel() == "step" and low <= 1 and high >= 11 and high - low < 14
    ticks = [t for t in ax.get_xticks() if low <= t <= high]
    assert len(ticks) >= 2 and all(float(t).is_integer() for t in ticks)
    assert [label.get_text() for label in ax.get_yticklabels()] == ["grpo", "grpo_seed1", "ppo"]
    ((x, row),) = [tuple(offsets) for c in ax.collections for offsets in c.get_offsets()]
    assert (x, row) == (4, 2)  # on ppo's row


def test_evaluation_leaves_training_unchanged(noisy_sft, tmp_path):
    """Evaluating (with sampling) every step trains exactly as not evaluating: the RNG is forked."""
    from safetensors.torch import load_file

    common = ("run.max_steps=3", "run.batch_size=16", "optim.lr=2e-3")
    train_grpo(_grpo(noisy_sft, tmp_path / "plain", *common))
    held_out = write_jsonl(tmp_path / "held_out.jsonl", HELD_OUT[:8])
    evaluation = (f"eval.path={held_out}", "run.eval_every=1", "eval.n=2")
    train_grpo(_grpo(noisy_sft, tmp_path / "evaluated", *common, *evaluation))
    plain, evaluated = read_metrics(tmp_path / "plain"), read_metrics(tmp_path / "evaluated")
    assert [r["reward/mean"] for r in plain] == [r["reward/mean"] for r in evaluated if r["step"] > 0]
    assert all("eval/sampled/pass@2" in r for r in evaluated) and evaluated[0]["step"] == 0
    weights = [load_file(tmp_path / run / "final" / "policy" / "model.safetensors") for run in ("plain", "evaluated")]
    assert all(weights[0][k].equal(weights[1][k]) for k in weights[0])


def test_posttrain_eval_of_a_lora_adapter_scored_by_a_reward_model(tiny_dir, tmp_path, capsys):
    """`posttrain eval --model ADAPTER --reward-model RM`: the adapter loads on its base (a fresh adapter
    generates as the base does) and the reward model's mean score is that of the written completions."""
    from posttrain.cli import main
    from posttrain.models import ModelConfig, load_policy, load_tokenizer
    from posttrain.rewards.model import score_texts

    lora = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"], "lora_dropout": 0.0}
    adapter = tmp_path / "adapter"
    load_policy(ModelConfig(path=str(tiny_dir / "policy"), device="cpu", lora=lora)).save_pretrained(adapter)
    load_tokenizer(str(tiny_dir / "policy")).save_pretrained(adapter)
    data = write_jsonl(tmp_path / "prompts.jsonl", HELD_OUT[:6])
    completions = {}
    for name, model in (("adapter", adapter), ("base", tiny_dir / "policy")):
        argv = ["eval", "--model", str(model), "--data", data, "--reward-model", str(tiny_dir / "reward")]
        argv += ["--max-new-tokens", "6", "--output-dir", str(tmp_path / name), "data.chat_template=never"]
        assert main([*argv, "model.device=cpu"]) == 0
        # the printed accuracy of unbounded reward-model scores says what it counts (new-user finding 24)
        assert "accuracy, pass@k: the share of completions whose total score is >= eval.correct_threshold = 1" in (
            capsys.readouterr().out
        )
        rows = [json.loads(line) for line in (tmp_path / name / "eval_samples.jsonl").read_text().splitlines()]
        completions[name] = [r["completion"] for r in rows]
        summary = json.loads((tmp_path / name / "eval_summary.json").read_text())
        direct = score_texts(str(tiny_dir / "reward"), [r["prompt"] + r["completion"] for r in rows])
        assert summary["eval/greedy/reward/reward_model"] == pytest.approx(float(direct.mean()), rel=1e-5)
    assert completions["adapter"] == completions["base"]


def test_reward_hacking_raises_rise_then_collapse_alert(noisy_sft, tmp_path):
    """Alert 7: trained on exact answer + 0.3 per character, the policy learns to ramble: the training
    reward rises while the held-out exact-match accuracy (eval.rewards, never optimised) falls."""
    held_out = write_jsonl(tmp_path / "held_out.jsonl", HELD_OUT[::3])
    length_bonus = "{function: 'posttrain.rewards.length:per_token_length', kwargs: {per_token: -0.3}}"
    config = _grpo(
        noisy_sft,
        tmp_path / "hacked",
        f"rewards=[{{function: 'posttrain.rewards.builtin:exact_answer'}}, {length_bonus}]",
        "eval.rewards=[{function: 'posttrain.rewards.builtin:exact_answer'}]",
        f"eval.path={held_out}",
        "run.eval_every=1",
        "sampling.max_new_tokens=12",
        "run.batch_size=32",
        "run.max_steps=8",
        "optim.lr=2e-3",
        "alerts.window=6",
    )
    train_grpo(config)
    records, alerts = read_metrics(tmp_path / "hacked"), read_alerts(tmp_path / "hacked")
    accuracy = [r["eval/greedy/accuracy"] for r in records]  # step 0's too
    rewards = [r["reward/mean"] for r in records if r["step"] > 0]
    assert accuracy[-1] < max(accuracy) - 0.1 and rewards[-1] > rewards[0]  # the run did what the alert says
    assert 7 in [a["id"] for a in alerts], (accuracy, rewards)


def test_a_long_run_keeps_the_monitor_bounded_and_its_long_memory():
    """The monitor held every record and each rule rescanned them at every step: a check cost 13 ms
    after 10,000 steps and a resume's replay was quadratic. What it keeps is now bounded by the window,
    and what the rules need from long ago survives: the first window's entropy (rule 8) and the best
    held-out score with the training reward then (rule 7)."""
    monitor, _ = _monitor()
    steps, raised = 3000, {}
    for step in range(1, steps + 1):
        record = {**BASE, "reward/mean": 0.5 + step / steps}  # the training reward keeps rising
        if step == 3:
            record["eval/greedy/score"] = 0.80  # the best held-out score, long ago
        elif step % 1000 == 0:
            record["eval/greedy/score"] = 0.70
        record["entropy"] = 1.0 if step <= steps - 10 else 0.05  # collapses at the end
        raised |= {a["id"]: (step, a["seen"]) for a in monitor.check(step, record)}

    assert raised.keys() == {7, 8}
    assert raised[7][0] == 1000 and "fell from 0.8 (step 3) to 0.7 " in raised[7][1]
    assert raised[8][0] == steps - 10 + 4 and "fell from 1 to 0.05 nats" in raised[8][1]
    window, state = monitor.config.window, vars(monitor.history)
    kept = [v for v in state.values() if isinstance(v, list | deque)]
    kept += [v for d in state.values() if isinstance(d, dict) for v in d.values() if isinstance(v, list | deque)]
    kept += [t.then for t in monitor.history.evals.values()] + [t.recent for t in monitor.history.evals.values()]
    assert kept and max(len(v) for v in kept) <= window
    # one entry per watched metric (and the reward and its std); the latest record itself for the level rules
    assert all(len(d) <= len(WATCHED) + 2 for k, d in state.items() if isinstance(d, dict) and k != "last")


# --------------------------------------------------------------------------------------------------
# round four: alert 7's baseline and a large held-out drop; alert 15, the score rising with length at the limit
# --------------------------------------------------------------------------------------------------


def _eval_run(rewards: list[float], evals: dict[int, float], window: int = 10) -> list[tuple[int, int, str]]:
    """(step, id, seen) of the alerts raised on a run logging step 0's held-out score (no training reward
    yet), then ``rewards[k]`` at step k + 1 and the held-out score ``evals[step]`` at those steps."""
    monitor = HealthMonitor(AlertConfig(window=window), None, "reward/mean", "reward/std", echo=lambda _: None)
    raised = [(0, a["id"], a["seen"]) for a in monitor.check(0, {"eval/greedy/score": evals[0]})]
    for step, reward in enumerate(rewards, 1):
        record = {**BASE, "reward/mean": reward} | ({"eval/greedy/score": evals[step]} if step in evals else {})
        raised += [(step, a["id"], a["seen"]) for a in monitor.check(step, record)]
    return raised


def test_alert_7_compares_with_several_rewards_after_step_0_not_one_outlying_batch():
    """Issue 34, 2b: held-out accuracy 78.7 % at step 0 fell while the training reward rose 0.68 → 0.77, and
    alert 7 stayed silent: it compared with the reward of the single step-1 batch, 0.835 in that seed."""
    rewards = [0.835] + [0.68 + 0.0035 * k for k in range(29)]  # 0.68 → 0.778 after an outlying first batch
    raised = _eval_run(rewards, {0: 0.787, 10: 0.72, 20: 0.70, 30: 0.70})  # 0.087 below: above eval_drop only
    assert [(step, i) for step, i, _ in raised] == [(20, 7)], raised  # at step 10 it had risen 0.01: noise
    assert "fell from 0.787 (step 0) to 0.7 while the training reward rose from 0.689 to 0.734" in raised[0][2]


def test_alert_7_raises_a_large_held_out_drop_whatever_the_training_reward_does():
    """Issue 34, 2b: a large held-out drop alerts on its own (here the training reward falls too)."""
    rewards = [0.70 - 0.004 * k for k in range(30)]
    raised = _eval_run(rewards, {0: 0.787, 10: 0.70, 20: 0.617, 30: 0.467})
    assert [(step, i) for step, i, _ in raised] == [(20, 7)], raised  # 0.087 below: no; 0.17 below: yes
    assert "fell from 0.787 (step 0) to 0.617, 0.17 below its best (alerts.eval_collapse=0.15)" in raised[0][2]
    assert "the training reward went from 0.69 to 0.634" in raised[0][2]
    assert _eval_run(rewards, {0: 0.787, 10: 0.70, 20: 0.66, 30: 0.65}) == []  # drops under 0.15: the reward says


def test_a_noisy_held_out_score_that_does_not_fall_raises_nothing():
    """Held-out scores swinging up to 0.09 about a level that does not fall, beside a flat training reward whose
    first batch was low: the old single-batch baseline (0.45) made the flat reward look like a rise."""
    rewards = [0.45] + [(0.68 if k % 2 else 0.62) - 0.001 * k for k in range(39)]
    evals = {0: 0.75, 5: 0.69, 10: 0.77, 15: 0.70, 20: 0.76, 25: 0.68, 30: 0.74, 35: 0.71}
    assert _eval_run(rewards, evals) == []


def test_eval_collapse_and_limit_length_corr_are_validated():
    with pytest.raises(ValueError, match="alerts.eval_collapse must be > 0"):
        AlertConfig(eval_collapse=0.0).validate()
    with pytest.raises(ValueError, match=r"alerts.limit_length_corr must be in \[-1, 1\]"):
        AlertConfig(limit_length_corr=1.5).validate()


def _at_the_limit(truncated, score, corr) -> list[dict]:
    """A PPO-like stream (its training reward is ``score/mean``) of 12 steps at 64 tokens max."""
    return [
        {**BASE, "score/mean": score(i), "score/std": 1.0, "truncated_share": truncated(i)}
        | ({} if corr(i) is None else {"score/length_corr": corr(i)})
        for i in range(12)
    ]


def _ppo_stream(records, forced_length=False) -> list[int]:
    monitor = HealthMonitor(AlertConfig(window=4), None, "score/mean", "score/std", forced_length, echo=lambda _: None)
    return [a["id"] for step, r in enumerate(records, 1) for a in monitor.check(step, r)]


def test_alert_15_the_score_rising_with_length_at_the_limit():
    """Issue 34, 2b: PPO against a length-biased reward model ran every response to the length limit (85 % →
    100 % truncated) while the score rose: rule 6 needs the length to grow, rule 10 says only that they are cut."""
    biased = _at_the_limit(
        lambda i: min(0.85 + 0.015 * i, 1.0),
        lambda i: 1.0 + 0.1 * i,
        lambda i: None if i >= 10 else 0.5,  # the longer responses of a batch score higher; none when all are cut
    )
    assert _ppo_stream(biased) == [10, 15]
    assert 6 not in _ppo_stream(biased)  # the length is pinned at the limit: no growth to see
    assert _ppo_stream(biased, forced_length=True) == []  # every response cut by design: no signal
    # a healthy run with a tight budget: the score rises while the cut responses score lower (no answer)
    healthy = _at_the_limit(lambda i: 0.6, lambda i: 1.0 + 0.1 * i, lambda i: -0.3)
    assert _ppo_stream(healthy) == [10]
    flat = _at_the_limit(lambda i: 0.9, lambda i: 1.0 + 0.01 * (i % 2), lambda i: 0.5)  # biased, nothing gained
    assert _ppo_stream(flat) == [10]


# --------------------------------------------------------------------------------------------------
# round four: alert 12, a dead run, in every trainer
# --------------------------------------------------------------------------------------------------


def _dead_stream(records) -> list[tuple[int, int]]:
    """(step, id) of the alerts 12 raised on ``records`` by the online trainers' rules."""
    monitor = HealthMonitor(
        AlertConfig(window=4), None, "reward/mean", "reward/std", echo=lambda _: None, rules=(*RULES, *DEAD_RUN_RULES)
    )
    return [(step, a["id"]) for step, r in enumerate(records, 1) for a in monitor.check(step, r) if a["id"] == 12]


def test_alert_12_fires_on_three_updates_with_no_gradient_or_an_unmoving_loss():
    """Issue 34, 2: ``posttrain dpo ... optim.lr=1e6`` logged a gradient norm of exactly 0 from step 2 on and
    exited 0 without a word; only SFT watched its gradient, at one step. Three updates in a row, any trainer."""
    dpo = [{"loss": 0.6931, "grad_norm": 3.9}] + [{"loss": 0.69 + 0.01 * (i % 3), "grad_norm": 0.0} for i in range(9)]
    assert _dead_stream(dpo) == [(4, 12)]  # steps 2, 3, 4; raised once while it holds
    recovered = dpo[:4] + [{"loss": 0.6, "grad_norm": 0.5}] + dpo[4:8]
    assert _dead_stream(recovered) == [(4, 12), (8, 12)]  # again after a live update
    grpo = [{**r, "grad_norm": 0.0, "policy/loss": 0.0} for r in _healthy(5)]  # a loss ~0 by construction
    assert _dead_stream(grpo) == [(3, 12)]
    ppo_critic = [{**r, "critic_grad_norm": 0.0} for r in _healthy(5)]  # a live policy, a dead critic
    assert _dead_stream(ppo_critic) == [(3, 12)]
    flat = [{"loss": 0.9, "grad_norm": 0.5}] + [{"loss": 0.6931472, "grad_norm": 0.2}] * 3  # it moved, then stopped
    assert _dead_stream(flat) == [(4, 12)]  # a gradient, and weights that no longer change
    distill = [{**r, "grad_norm": 0.0, "distill/reverse_kl": 0.4} for r in _healthy(3)]
    assert _dead_stream(distill) == [(3, 12)]
    skipped = [{"loss": 0.7, "grad_norm": 0.0}, {"reward/mean": 0.5}, {"loss": 0.71, "grad_norm": 0.0}]
    assert _dead_stream([*skipped, {"loss": 0.72, "grad_norm": 0.0}]) == [(4, 12)]  # a step with no update: not one
    monitor = HealthMonitor(AlertConfig(), None, "loss", "loss", echo=lambda _: None, rules=DEAD_RUN_RULES)
    assert [monitor.check(k, r) for k, r in enumerate(dpo[:3], 1)][-1] == []
    (alert,) = monitor.check(4, dpo[3])
    assert alert["seen"] == (
        "the gradient norm has been 0 for 3 updates in a row while the loss is 0.71: the updates move nothing"
    )
    assert alert["causes"].endswith(".") and alert["remedy"].endswith(".")


def test_alert_12_is_silent_where_a_zero_gradient_or_a_flat_loss_is_right():
    """No false alarm: GRPO steps whose groups are all constant (every advantage 0: a zero gradient by
    construction), steps with nothing to train (no update, no gradient norm logged), GRPO's ~0 surrogate
    loss, a fitted model (loss 0), a student equal to its teacher, one zero step among live ones, and
    non-finite values (alert 11's)."""
    assert _dead_stream(_healthy()) == []
    constant_groups = [{**r, "grad_norm": 0.0, "groups/zero_variance_share": 1.0} for r in _healthy()]
    assert _dead_stream(constant_groups) == []
    nothing = [{"reward/mean": 0.5, "groups/zero_variance_share": 1.0, "groups/sampled": 8.0}] * 6
    assert _dead_stream(nothing) == []
    surrogate = [{**r, "policy/loss": 0.0, "policy/pg_loss": 0.0} for r in _healthy()]
    assert _dead_stream(surrogate) == []
    assert _dead_stream([{"loss": 0.0, "grad_norm": 0.0}] * 5) == []
    assert _dead_stream([{"loss": 2e-4, "grad_norm": 1e-9}] * 5) == []
    same_teacher = [{**r, "grad_norm": 0.0, "distill/reverse_kl": 0.0} for r in _healthy()]
    assert _dead_stream(same_teacher) == []
    one_zero = [{"loss": 1.0 - 0.01 * i, "grad_norm": 0.0 if i == 3 else 0.8} for i in range(10)]
    assert _dead_stream(one_zero) == []
    moving = [{"loss": 0.6931 + 1e-4 * i, "grad_norm": 0.3} for i in range(6)]  # slowly, but it moves
    assert _dead_stream(moving) == []
    # DPO at a small learning rate: the loss stays at ln 2 (policy = reference) to 1e-7 for several steps while
    # the gradient is there; the loss has not left its start, so it is slow, not dead (review of issue 34)
    dpo_start = [{"loss": math.log(2) + 1e-8 * i, "grad_norm": 0.2} for i in range(10)]
    assert _dead_stream(dpo_start) == []
    assert _dead_stream([{"loss": math.nan, "grad_norm": math.nan}] * 5) == []


def _offline(tiny_dir, tmp_path, name, policy, trainer="dpo", *overrides):
    """A 6-step run of the offline ``trainer`` (dpo or kto) of ``policy`` on vowel pairs (``overrides`` after)."""
    import importlib

    from posttrain.data.synthetic import unpaired, vowel_pairs
    from posttrain.trainers import TRAINERS

    module_name, class_name, _ = TRAINERS[trainer]
    module = importlib.import_module(module_name)
    rows = vowel_pairs(64, seed=0)
    data = write_jsonl(tmp_path / f"{trainer}.jsonl", unpaired(rows) if trainer == "kto" else rows)
    config = load_config(
        getattr(module, class_name),
        None,
        [
            f"model.path={policy}",
            f"data.path={data}",
            "data.chat_template=never",
            f"run.output_dir={tmp_path / name}",
            "run.max_steps=6",
            "run.batch_size=8",
            "run.progress=false",
            "run.report_to=[jsonl]",
            *overrides,
        ],
    )
    module.train(config)
    return tmp_path / name


def test_a_dead_dpo_run_raises_alert_12_on_the_console_in_alerts_jsonl_and_in_the_report(tiny_dir, tmp_path, capsys):
    from posttrain.monitor.report import build_report

    run = _offline(tiny_dir, tmp_path, "dead", dead_copy(tiny_dir, tmp_path / "dead_policy"))
    assert [r["grad_norm"] for r in read_metrics(run)] == [0.0] * 6
    (alert,) = read_alerts(run)
    assert (alert["step"], alert["id"], alert["name"]) == (3, 12, "zero_gradient")
    assert alert["seen"].startswith("the gradient norm has been 0 for 3 updates in a row while the loss is 0.6931")
    assert "[alert 12 zero_gradient] step 3: the gradient norm has been 0" in capsys.readouterr().out
    assert (run / "final" / "policy").is_dir()  # a warning, not a stop
    report = build_report([run])
    assert "<td>3</td><td>12 zero_gradient</td>" in report and 'id="alerts-of-dead"' in report
    healthy = _offline(tiny_dir, tmp_path, "healthy", tiny_dir / "policy")
    assert read_alerts(healthy) == [] and min(r["grad_norm"] for r in read_metrics(healthy)) > 1e-3


def test_a_resumed_dead_dpo_run_raises_alert_12_once(tiny_dir, tmp_path):
    """The offline monitor continues the history of the run it resumes, as the online trainers' does: alert 12,
    raised at step 3 and still active at the checkpoint (step 4), is not raised again at step 7."""
    policy = dead_copy(tiny_dir, tmp_path / "dead_policy")
    run = _offline(tiny_dir, tmp_path, "dead", policy, "dpo", "run.max_steps=4", "run.save_every=4")
    assert [(a["step"], a["id"]) for a in read_alerts(run)] == [(3, 12)]
    _offline(tiny_dir, tmp_path, "dead", policy, "dpo", "run.max_steps=8", "run.save_every=4", "run.resume_from=latest")
    assert [r["step"] for r in read_metrics(run)] == list(range(1, 9))
    assert [(a["step"], a["id"]) for a in read_alerts(run)] == [(3, 12)]


def test_a_dead_kto_run_raises_alert_12(tiny_dir, tmp_path):
    run = _offline(tiny_dir, tmp_path, "dead", dead_copy(tiny_dir, tmp_path / "dead_policy"), "kto")
    assert [r["grad_norm"] for r in read_metrics(run)] == [0.0] * 6
    assert [(a["step"], a["id"]) for a in read_alerts(run)] == [(3, 12)]


def test_a_dead_grpo_run_raises_alert_12(tiny_dir, tmp_path):
    """The online trainers' monitor runs rule 12 too: GRPO on the dead model, paid by length (groups differ)."""
    (tmp_path / "length.py").write_text(
        "def length(prompts, completions, **kw):\n    return [len(c) for c in completions]\n"
    )
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": f"{k}+1="} for k in range(16)])
    config = load_config(
        GRPOConfig,
        None,
        [
            f"model.path={dead_copy(tiny_dir, tmp_path / 'dead_policy')}",
            f"data.path={prompts}",
            f"rewards=[{{function: '{tmp_path / 'length.py'}:length'}}]",
            "data.chat_template=never",
            f"run.output_dir={tmp_path / 'grpo'}",
            "run.max_steps=4",
            "run.batch_size=16",
            "num_generations=4",
            "sampling.max_new_tokens=6",
            "run.progress=false",
            "run.report_to=[jsonl]",
        ],
    )
    train_grpo(config)
    records = read_metrics(tmp_path / "grpo")
    assert all(r["grad_norm"] == 0.0 and r["groups/zero_variance_share"] < 1 for r in records), records
    assert [(a["step"], a["id"]) for a in read_alerts(tmp_path / "grpo")] == [(3, 12)]


def test_corr_of_equals_pearson_of_the_pairs_and_is_nan_without_spread():
    from posttrain.runtime.update import corr_of

    x, y = [3.0, 5.0, 5.0, 9.0], [1.0, -2.0, 0.5, 4.0]
    xy = sum(a * b for a, b in zip(x, y, strict=True))
    sums = (sum(x), sum(y), sum(a * a for a in x), sum(b * b for b in y), xy, len(x))
    assert corr_of(*sums) == pytest.approx(pearson(x, y), abs=1e-12)
    assert math.isnan(corr_of(12.0, 1.5, 36.0, 1.25, 4.5, 4))  # every x = 3: undefined, not 0
    assert math.isnan(corr_of(3.0, 1.0, 9.0, 1.0, 3.0, 1))


def test_ppo_logs_the_batch_correlation_of_score_and_length(noisy_sft, tmp_path):
    """Alert 15 reads ``score/length_corr``: Pearson's r of each response's score and length in its batch."""
    from posttrain.models import load_tokenizer

    length_bonus = "{function: 'posttrain.rewards.length:per_token_length', kwargs: {per_token: -0.3}}"
    overrides = [f"model.path={noisy_sft['policy']}", f"data.path={noisy_sft['prompts']}", "data.chat_template=never"]
    overrides += [f"run.output_dir={tmp_path / 'run'}", "run.progress=false", "run.report_to=[jsonl]"]
    overrides += [f"rewards=[{{function: 'posttrain.rewards.builtin:exact_answer'}}, {length_bonus}]", "critic=policy"]
    overrides += ["sampling.max_new_tokens=6", "run.batch_size=16", "run.max_steps=2", "log_completions=16"]
    train_ppo(load_config(PPOConfig, None, overrides))
    tokenizer = load_tokenizer(str(noisy_sft["policy"]))
    samples = [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    for record in read_metrics(tmp_path / "run"):
        batch = [s for s in samples if s["step"] == record["step"]]
        lengths = [len(tokenizer(s["completion_text"], add_special_tokens=False).input_ids) for s in batch]
        assert len(batch) == 16 and len(set(lengths)) > 1, lengths
        assert record["score/length_corr"] == pytest.approx(pearson([s["score"] for s in batch], lengths), abs=1e-6)
