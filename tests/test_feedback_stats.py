"""Agreement statistics and the compare summary (posttrain.feedback.stats): textbook and hand-worked values,
perfect agreement = 1, and a simulated blind A/B comparison written through the real store."""

import json
import math
import random

import pytest

from posttrain.errors import UserError
from posttrain.feedback import stats
from posttrain.feedback.store import load_task


def test_kendall_tau_b_by_hand():
    # x = 1 2 3 4, y = 1 3 2 4: of the 6 pairs only (2, 3) is discordant -> (5 - 1) / 6 = 2/3
    assert stats.kendall_tau_b([1, 2, 3, 4], [1, 3, 2, 4]) == pytest.approx(2 / 3)
    # ties: x = 1 2.5 2.5 4 (objects 1, 2 tied), y = 1 2 3 4. n0 = 6, n1 = 1, n2 = 0; the tied pair is in
    # neither count, the other 5 are concordant -> 5 / sqrt(5 * 6)
    assert stats.kendall_tau_b([1, 2.5, 2.5, 4], [1, 2, 3, 4]) == pytest.approx(5 / math.sqrt(30))
    assert stats.kendall_tau_b([1, 2, 3], [1, 2, 3]) == 1
    assert stats.kendall_tau_b([1, 2, 3], [3, 2, 1]) == -1
    assert math.isnan(stats.kendall_tau_b([2, 2, 2], [1, 2, 3]))


def test_midranks_share_the_mean_rank_of_a_tie():
    assert stats.midranks([[2], [0, 3], [1]]) == {2: 1, 0: 2.5, 3: 2.5, 1: 4}


def test_kendall_w_by_hand():
    # m = 3 labellers, n = 3 objects: (1 2 3), (1 3 2), (2 1 3). Rank sums 4, 6, 8 around m(n+1)/2 = 6:
    # S = 4 + 0 + 4 = 8; W = 12 * 8 / (9 * 24) = 4/9
    assert stats.kendall_w([[1, 2, 3], [1, 3, 2], [2, 1, 3]]) == pytest.approx(4 / 9)
    assert stats.kendall_w([[1, 2, 3]] * 4) == pytest.approx(1)
    # with a tie: (1 2 3), (1.5 1.5 3). Sums 2.5, 3.5, 6 around 4: S = 2.25 + 0.25 + 4 = 6.5; the tie
    # gives T = 2^3 - 2 = 6: W = 12 * 6.5 / (4 * 24 - 2 * 6) = 78 / 84
    assert stats.kendall_w([[1, 2, 3], [1.5, 1.5, 3]]) == pytest.approx(78 / 84)


def test_cohen_kappa_textbook_example():
    # 50 items, yes/yes 20, yes/no 5, no/yes 10, no/no 15: p_o = 0.7, p_e = 0.5 * 0.6 + 0.5 * 0.4 = 0.5
    a = ["yes"] * 25 + ["no"] * 25
    b = ["yes"] * 20 + ["no"] * 5 + ["yes"] * 10 + ["no"] * 15
    assert stats.cohen_kappa(a, b) == pytest.approx(0.4)
    assert stats.cohen_kappa(["x", "y", "x"], ["x", "y", "x"]) == 1
    assert math.isnan(stats.cohen_kappa(["x", "x"], ["x", "x"]))


def test_fleiss_kappa_textbook_example():
    # the 10 items x 14 raters x 5 categories example used for Fleiss' kappa (Wikipedia, "Fleiss' kappa"):
    # P_bar = 0.378, P_e = 0.213, kappa = 0.210
    table = [
        [0, 0, 0, 0, 14],
        [0, 2, 6, 4, 2],
        [0, 0, 3, 5, 6],
        [0, 3, 9, 2, 0],
        [2, 2, 8, 1, 1],
        [7, 7, 0, 0, 0],
        [3, 2, 6, 3, 0],
        [2, 5, 3, 2, 2],
        [6, 5, 2, 1, 0],
        [0, 2, 2, 3, 7],
    ]
    assert stats.fleiss_kappa(table) == pytest.approx(0.20993, abs=1e-5)
    assert stats.fleiss_kappa([[3, 0], [0, 3], [3, 0]]) == pytest.approx(1)
    # two items, two raters each: one agrees, one splits. P = (1, 0), P_bar = 1/2; p = (3/4, 1/4), P_e = 5/8
    # -> (1/2 - 5/8) / (3/8) = -1/3 ; a third item rated once is not pairable and drops out
    assert stats.fleiss_kappa([[2, 0], [1, 1], [1, 0]]) == pytest.approx(-1 / 3)


def test_krippendorff_alpha_worked_example():
    # Krippendorff (2011), "Computing Krippendorff's alpha-reliability": 4 observers, 12 units, values 1-5,
    # missing data; the paper gives alpha_interval = 0.849
    n = None
    observers = [
        [1, 2, 3, 3, 2, 1, 4, 1, 2, n, n, n],
        [1, 2, 3, 3, 2, 2, 4, 1, 2, 5, n, 3],
        [n, 3, 3, 3, 2, 3, 4, 2, 2, 5, 1, n],
        [1, 2, 3, 3, 2, 4, 4, 1, 2, 5, 1, n],
    ]
    units = [[v for v in unit if v is not None] for unit in zip(*observers, strict=True)]
    assert stats.krippendorff_alpha_interval(units) == pytest.approx(0.849, abs=5e-4)
    assert stats.krippendorff_alpha_interval([[1, 1], [3, 3, 3], [5, 5]]) == 1


def test_krippendorff_alpha_by_hand():
    # units (1, 2) and (3, 3): n = 4 values. Within: unit 1 gives 2 * 1 / 1 = 2, unit 2 gives 0 -> D_o = 2/4.
    # Ordered pairs over 1 2 3 3: 2 * (4 * 23 - 81) = 22 -> D_e = 22 / 12. alpha = 1 - (1/2) / (11/6) = 8/11
    assert stats.krippendorff_alpha_interval([[1, 2], [3, 3]]) == pytest.approx(8 / 11)


def test_wilson_interval():
    # 7 of 10: p = 0.7, z^2 = 3.8415; centre = (0.7 + 0.19207) / 1.38415 = 0.64449; half = z / 1.38415 *
    # sqrt(0.021 + 0.0096037) = 0.24771 -> (0.3968, 0.8922)
    low, high = stats.wilson_interval(7, 10)
    assert low == pytest.approx(0.3968, abs=1e-4) and high == pytest.approx(0.8922, abs=1e-4)
    low, high = stats.wilson_interval(0, 20)
    assert low == 0 and 0 < high < 0.2  # not empty at p = 0, unlike the normal approximation
    assert all(math.isnan(v) for v in stats.wilson_interval(0, 0))


def test_compare_summary_by_hand():
    # A left: A wins twice, B once; B left: A wins once, one tie. wins A 3, B 1, ties 1, n = 5.
    judgements = [
        {"winner": "A", "left": "A"},
        {"winner": "A", "left": "A"},
        {"winner": "B", "left": "A"},
        {"winner": "A", "left": "B"},
        {"winner": "tie", "left": "B"},
    ]
    c = stats.compare_summary(judgements)
    assert (c["n"], c["wins_A"], c["wins_B"], c["ties"]) == (5, 3, 1, 1)
    assert c["win_rate"] == pytest.approx(3.5 / 5)
    assert c["win_rate_decisive"] == pytest.approx(3 / 4)
    assert c["tie_share"] == pytest.approx(1 / 5)
    assert c["left_share"] == pytest.approx(2 / 4)  # the two A-left wins by A; the right side won the others
    assert c["win_rate_ci"] == pytest.approx(stats.wilson_interval(3.5, 5))
    assert not c["position_bias"]


def _compare_task(tmp_path, items: int, labellers: list[str], models=("runs/ppo", "runs/sft")):
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "task.json").write_text(
        json.dumps({"mode": "compare", "models": dict(zip("AB", models, strict=True)), "seed": 0, "allow_ties": True,
                    "labellers": labellers, "overlap": 1.0})
    )  # fmt: skip
    pair = [{"text": "a{}", "model": "A"}, {"text": "b{}", "model": "B"}]
    rows = [
        {"id": f"{i:04d}", "prompt": f"q{i}", "completions": [{**c, "text": c["text"].format(i)} for c in pair]}
        for i in range(items)
    ]
    (tmp_path / "candidates.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return load_task(tmp_path)


def _label(task, labeller: str, choose) -> None:
    """Judge every assigned item through the store, as the page would: ``choose(left) -> "left"|"right"``."""
    while (item := task.next_item(labeller)) is not None:
        left = task.left(item, labeller)
        choice = choose(left)
        winner = left if choice == "left" else ("B" if left == "A" else "A")
        task.append(
            {"event": "judgement", "labeller": labeller, "item": item, "mode": "compare",
             "shown": task.shown(item, labeller), "winner": winner, "left": left, "choice": choice}
        )  # fmt: skip


def test_simulated_comparison_covers_the_preference_and_flags_a_left_clicker(tmp_path):
    """A labeller who prefers A with p = 0.7 over 300 items gets an interval covering 0.7 and no position
    bias; one who always clicks left gets a left share of 1 and is flagged."""
    task = _compare_task(tmp_path, 300, ["fair", "lefty"])
    rng = random.Random(7)
    _label(task, "fair", lambda left: "left" if (rng.random() < 0.7) == (left == "A") else "right")
    _label(task, "lefty", lambda left: "left")
    result = stats.write_stats(task)
    fair, lefty = result["compare_by_labeller"]["fair"], result["compare_by_labeller"]["lefty"]
    assert fair["n"] == 300
    low, high = fair["win_rate_ci"]
    assert low < 0.7 < high and high - low < 0.11  # an interval of about +-0.05 at n = 300
    assert not fair["position_bias"]
    assert lefty["left_share"] == 1 and lefty["position_bias"]
    assert 0.35 < lefty["win_rate"] < 0.65  # its "wins" follow the random sides: about half
    assert json.loads((tmp_path / "stats.json").read_text()) == result
    text = stats.format_stats(result)
    assert "POSITION BIAS" in text and "runs/ppo" in text
    # both judged all 300 items: their kappa on the winner is about chance, far from 1
    assert abs(result["agreement"]["fleiss_kappa"]) < 0.3


def test_agreement_is_one_when_labellers_agree(tmp_path):
    """Two labellers ranking alike: tau-b = W = 1; scoring alike: alpha = 1; choosing alike: kappa = 1."""
    rows = [
        {"id": str(i), "prompt": f"q{i}", "completions": [{"text": f"r{i}-{j}", "model": "policy"} for j in range(4)]}
        for i in range(6)
    ]
    (tmp_path / "candidates.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    judged = {
        "rank": lambda shown, i: {"ranking": [[c] for c in sorted(shown)]},
        "score": lambda shown, i: {"scores": {str(c): 1 + (c + i) % 5 for c in shown}},
        "pair": lambda shown, i: {"chosen": min(shown) if i % 2 else max(shown), "rejected": 0},
    }
    for mode, judge in judged.items():
        (tmp_path / "judgements.jsonl").unlink(missing_ok=True)
        (tmp_path / "task.json").write_text(json.dumps({"mode": mode, "labellers": ["ann", "bob"], "overlap": 1}))
        task = load_task(tmp_path)
        for name in ("ann", "bob"):
            for i, item in enumerate(task.assigned(name)):
                shown = task.shown(item, name)
                event = {"event": "judgement", "labeller": name, "item": item, "mode": mode, "shown": shown}
                event |= judge(shown, i)
                if mode == "pair":
                    event["rejected"] = next(c for c in shown if c != event["chosen"])
                task.append(event)
        agreement = stats.summarize(task)["agreement"]
        assert agreement["items"] == 6
        for key in ("kendall_tau_b", "kendall_w", "krippendorff_alpha", "kendall_tau_b_of_scores", "fleiss_kappa"):
            if key in agreement:
                assert agreement[key] == pytest.approx(1), (mode, key)
        if mode == "pair":
            assert agreement["cohen_kappa"] == {"ann~bob": pytest.approx(1)}


def test_stats_count_a_labeller_the_command_line_let_in(tmp_path):
    """posttrain label TASK --labellers carl lets carl in although task.json lists ann and bob: label stats
    counts carl's judgements (assigned unknown) instead of refusing him."""
    task = _compare_task(tmp_path, items=3, labellers=["ann", "bob"])
    _label(task.with_overrides(labellers=["carl"]), "carl", lambda left: "left")
    text = stats.label_stats(tmp_path)
    result = json.loads((tmp_path / "stats.json").read_text())
    assert result["labellers"]["carl"] == {"judgements": 3, "skips": 0, "flags": 0, "assigned": None}
    assert result["labellers"]["ann"]["assigned"] == 3 and result["judgements"] == 3
    assert "carl" in text


def test_report_shows_the_human_comparison_beside_the_evaluation(tmp_path):
    """posttrain report RUN --human TASK: a table of the run's own human/*/ task and of the named one, their
    stats.json refreshed first."""
    from posttrain.cli import main

    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1, "eval/greedy/accuracy": 0.5}\n')
    own = _compare_task(run / "human" / "ab", 40, ["fair"])
    _label(own, "fair", lambda left: "left" if left == "A" else "right")  # A every time
    named = _compare_task(tmp_path / "other", 20, ["lefty"], models=("<b>ckpt-2</b>", "ckpt-1"))
    _label(named, "lefty", lambda left: "left")
    assert main(["report", str(run), "--human", str(tmp_path / "other"), "--out", str(tmp_path / "r.html")]) == 0
    text = (tmp_path / "r.html").read_text()
    assert '<h2 id="human">Human comparison</h2>' in text
    assert text.index("Human comparison") < text.index('<div class="grid">')  # with the summaries, above the plots
    # 40 wins of 40: Wilson's lower bound n / (n + z^2) = 40 / 43.8415 = 0.912
    assert "<td>40</td><td>1.000 [0.912, 1.000]</td>" in text and "A = runs/ppo" in text
    assert text.count("<b>position bias</b>") == 1  # the left clicker's task only
    assert "&lt;b&gt;ckpt-2&lt;/b&gt;" in text  # model names are text
    assert json.loads((run / "human" / "ab" / "stats.json").read_text())["compare"]["n"] == 40
    rank_task = tmp_path / "ranked"
    rank_task.mkdir()
    (rank_task / "stats.json").write_text(json.dumps({"mode": "rank"}))
    from posttrain.monitor.report import build_report

    with pytest.raises(UserError, match="a rank task; the report shows compare tasks"):
        build_report([run], [rank_task])


def test_stats_read_the_mode_the_log_was_labelled_in(tmp_path):
    """posttrain label TASK --mode pair on a rank task: label stats (which loads task.json, mode rank)
    counts and compares the pair judgements in the log; filtering by task.json's mode it showed 0."""
    rows = [
        {"id": str(i), "prompt": f"q{i}", "completions": [{"text": f"r{i}-{j}", "model": "policy"} for j in range(3)]}
        for i in range(4)
    ]
    (tmp_path / "candidates.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "task.json").write_text(json.dumps({"mode": "rank"}))
    task = load_task(tmp_path, mode="pair")
    for name in ("ann", "bob"):
        for i, item in enumerate(task.assigned(name)):
            shown = task.shown(item, name)
            better, worse = sorted(shown)[:: 1 if i % 2 else -1]  # both alike: the lower index on odd items
            task.append({"event": "judgement", "labeller": name, "item": item, "mode": "pair", "shown": shown,
                         "chosen": better, "rejected": worse})  # fmt: skip
    result = json.loads(stats.label_stats(tmp_path, as_json=True))
    assert result["mode"] == "pair" and result["judgements"] == 8
    assert result["labellers"]["ann"]["judgements"] == 4
    assert result["agreement"]["items"] == 4 and result["agreement"]["fleiss_kappa"] == pytest.approx(1)
    assert "pair mode" in stats.label_stats(tmp_path)


def test_a_broken_human_task_of_a_run_leaves_the_report_written(tmp_path, capsys):
    """One unreadable RUN/human/* folder stopped posttrain report: the report of the training run is written,
    the folder gets one warning line and the human section says it could not be read; the good task is shown."""
    from posttrain.cli import main

    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1, "eval/greedy/accuracy": 0.5}\n')
    _label(_compare_task(run / "human" / "ab", 10, ["fair"]), "fair", lambda left: "left")
    broken = run / "human" / "broken"
    broken.mkdir()
    (broken / "task.json").write_text("{not json")
    (broken / "stats.json").write_text(json.dumps({"mode": "compare"}))  # stale, from before it broke
    assert main(["report", str(run), "--out", str(tmp_path / "r.html")]) == 0
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "warning" in err and "broken" in err
    text = (tmp_path / "r.html").read_text()
    assert "<td>10</td>" in text  # the readable task
    assert "could not be read" in text and "broken" in text
