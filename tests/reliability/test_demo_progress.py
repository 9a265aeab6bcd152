"""`posttrain demo` shows its progress and keeps what it finished (issue 24 item 16)."""

import json

import pytest


def test_a_demo_stopped_after_its_first_stage_leaves_that_stage_and_showed_its_steps(tmp_path, monkeypatch, capsys):
    """Item 16: the demo printed stage headers only and wrote summary.json and report.html at the very end,
    so a killed demo left nothing to look at. Each stage now prints a line every tenth of its steps with its
    live numbers, then its results, and rewrites summary.json and report.html. Stopped in GRPO (the second
    training stage), the SFT stage's results are on disk."""
    from posttrain import demo
    from posttrain.trainers import grpo

    # quick: a fifth of 20, 4 SFT steps (before item 16 the demo had no STEPS: 60 steps, no progress lines)
    monkeypatch.setattr(demo, "STEPS", {**getattr(demo, "STEPS", {}), "sft": 20}, raising=False)

    def killed(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(grpo, "train", killed)
    with pytest.raises(KeyboardInterrupt):
        demo.run_demo(str(tmp_path / "demo"), quick=True)
    out = capsys.readouterr().out
    for step in range(1, 5):
        assert f"[sft] step {step}/4  loss " in out, out
    assert "SFT: accuracy " in out and "summary.json and report.html updated" in out
    summary = json.loads((tmp_path / "demo" / "summary.json").read_text())
    assert summary["stages_done"] == ["sft"]
    assert 0.0 <= summary["sft"]["sampled"] <= 1.0 and 0.0 <= summary["sft"]["greedy"] <= 1.0
    assert "grpo" not in summary and summary["seconds"] > 0
    assert (tmp_path / "demo" / "report.html").is_file() and summary["report"] == str(tmp_path / "demo" / "report.html")
    assert not (tmp_path / "demo" / "summary.json.partial").exists()


def test_the_demo_summary_is_one_line_per_row_whatever_the_samples_hold(tmp_path, capsys):
    """Issue 34: a PPO sample holding a newline broke the summary table (the rest of the row on a line of its
    own). Samples are shown quoted and escaped."""
    from posttrain.demo import _print_summary

    accuracies = {"sampled": 0.5, "greedy": 0.5}
    results = {
        "sft": accuracies,
        "grpo": {**accuracies, "reward_first5": 0.1, "reward_last5": 0.9},
        "dpo": {**accuracies, "eval_reward_accuracy": 0.7},
        "rm": {"eval_pairwise_accuracy": 0.8},
        "ppo": {
            "score_first5": -1.0,
            "score_last5": 2.0,
            "kl_per_sequence_last5": 0.5,
            "vowel_share_after": 0.6,
            "samples_after": ["aei\nou", "tab\there", "plain", 'a "quote"'],
        },
        "alerts": {"grpo": 0, "ppo": 1},
        "seconds": 12.3,
        "report": str(tmp_path / "report.html"),
    }
    _print_summary(results, tmp_path)
    table = capsys.readouterr().out.split("posttrain demo: results\n")[1].split("\n\n")[0].splitlines()
    assert len(table) == 12 and all(line.startswith("  ") for line in table), table
    assert r'"aei\nou", "tab\there", "plain", "a \"quote\"" (60%)' in table[-3]
