"""The human-feedback loop end to end, through the real command lines and the real labelling page: a tiny SFT
model -> ``posttrain sample`` (K = 4) -> a scripted labeller ranks in Chromium by a hidden rule -> ``posttrain
label export`` -> ``posttrain rm`` -> held-out pair accuracy -> ``posttrain ppo`` against that reward model
-> a blind A/B of the result against its start, judged in the page -> ``posttrain label stats`` and
``posttrain report --human``. And the compare mode's statistics through the page.

The hidden rule: more letters 'a' is better. The SFT model writes 8-letter strings of a, b and c whose
number of a's varies from sample to sample, so four samples of one prompt differ in the rule's score;
a tiny reward model learns to count them, and PPO can raise the count.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
from browser_helpers import (
    after,
    best_first,
    choose_by_keys,
    current_item,
    expect,
    log_in,
    make_task,
    new_page,
    shown_answers,
)
from conftest import write_jsonl

from posttrain.data.synthetic import a_strings

ROOT = Path(__file__).resolve().parent.parent
# One thread per subprocess: on a machine shared with other jobs two OpenMP threads spin against each
# other (an SFT step of the tiny model took 5 s with two, 0.16 s with one, on a loaded 2-core host).
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def posttrain(*args) -> str:
    """``posttrain ARGS`` in a subprocess; its stdout (a failure shows the end of its stderr)."""
    done = subprocess.run(
        [sys.executable, "-m", "posttrain.cli", *map(str, args)],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, f"posttrain {args[0]}: {done.stderr[-3000:]}"
    return done.stdout


def rule(text: str) -> int:
    """The hidden rule's score: the number of letters 'a'."""
    return text.count("a")


# ---- the compare mode through the page (fast: no model) --------------------------------------------


def judge_all(page, choose) -> None:
    """Press ``choose(answers shown)``'s key on every item until the page says done."""
    while page.locator("#work").is_visible():
        item = current_item(page)
        page.keyboard.press(choose(shown_answers(page)))
        after(page, item)
    expect(page.locator("#done")).to_be_visible()


def test_compare_win_rate_interval_covers_the_labellers_preference_and_always_left_is_position_bias(
    browser, serve, tmp_path
):
    """Blind A/B in the page, 40 items whose model A writes more a's. A labeller who prefers A with
    probability 0.7 (seeded draws) gets a win rate whose 95 % interval covers 0.7, with every judgement
    credited to the model whatever side it was on; a labeller who always presses the left key gets a left
    share of 1, POSITION BIAS in the stats, and a win rate near one half (the sides are shuffled)."""
    from posttrain.feedback.stats import label_stats

    task = make_task(tmp_path / "ab", "compare", n_items=40, k=2)
    server = serve(task)
    rng = random.Random(0)
    draws = iter([rng.random() < 0.7 for _ in range(40)])
    prefers_a = []

    def seventy(answers):
        prefers_a.append(next(draws))
        a_side = best_first(answers)[0]  # the labeller recognises A by its answer, not by its side
        return str((a_side if prefers_a[-1] else 1 - a_side) + 1)

    for name, choose in (("seventy", seventy), ("lefty", lambda answers: "1")):
        with new_page(browser) as page:
            log_in(page, server.url, name)
            judge_all(page, choose)
    text = label_stats(task)
    stats = json.loads((task / "stats.json").read_text())
    by = stats["compare_by_labeller"]
    assert len(prefers_a) == 40 and by["seventy"]["n"] == by["lefty"]["n"] == 40
    assert by["seventy"]["wins_A"] == sum(prefers_a)
    low, high = by["seventy"]["win_rate_ci"]
    assert low <= 0.7 <= high and high - low < 0.35
    assert not by["seventy"]["position_bias"]
    assert by["lefty"]["left_share"] == 1.0 and by["lefty"]["position_bias"]
    assert by["lefty"]["left_share_ci"][0] > 0.9
    low, high = by["lefty"]["win_rate_ci"]
    assert low < 0.5 < high  # the side decided, so the models look alike
    lefty_lines, seventy_lines = text.split("  lefty:")[1].split("  seventy:")  # the labellers sorted by name
    assert "POSITION BIAS" in lefty_lines and "POSITION BIAS" not in seventy_lines


# ---- the loop (slow: SFT, reward model and PPO on the tiny model, two samplings, two labelling sessions) ---


def rank_by_rule(page) -> None:
    """Rank the shown answers by the rule with the keys, tying (t) an answer with the one picked before it
    when their counts are equal (the task allows ties)."""
    item = current_item(page)
    answers = shown_answers(page)
    order = best_first(answers)
    for i, position in enumerate(order):
        page.keyboard.press(str(position + 1))
        if i and rule(answers[position]) == rule(answers[order[i - 1]]):
            page.keyboard.press("t")
    expect(page.locator("#ranking .card")).to_have_count(len(order))
    page.keyboard.press("Enter")
    after(page, item)


def rule_rows(item: dict) -> set[tuple]:
    """The rows the export must write for ``item``: one ranking best first when the counts differ, else
    the strictly ordered pairs (K = 2 rankings)."""
    texts = [c["text"] for c in item["completions"]]
    if len({rule(t) for t in texts}) == len(texts):
        return {tuple(sorted(texts, key=rule, reverse=True))}
    return {(a, b) for a in texts for b in texts if rule(a) > rule(b)}


def held_out_pairs(items: list[dict]) -> list[dict]:
    """Every two answers of an item with different counts, as {"prompt", "chosen", "rejected"}."""
    pairs = []
    for item in items:
        texts = [c["text"] for c in item["completions"]]
        for a in texts:
            pairs += [{"prompt": item["prompt"], "chosen": a, "rejected": b} for b in texts if rule(a) > rule(b)]
    return pairs


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def label_ranks(browser, serve, task: Path, n: int) -> None:
    """The first ``n`` items of ``task`` ranked by the rule in the page; the server stops cleanly."""
    server = serve(task, "--allow-ties")
    with new_page(browser) as page:
        log_in(page, server.url, "ann")
        for _ in range(n):
            rank_by_rule(page)
        expect(page.locator("#progress")).to_have_text(f"{n + 1} of {len(read_jsonl(task / 'candidates.jsonl'))}")
    assert server.stop()[0] == 0


def label_compare(browser, serve, task: Path) -> None:
    """Every item of a compare task judged by the rule in the page: the answer with more a's, t when equal."""
    server = serve(task, "--allow-ties")
    with new_page(browser) as page:
        log_in(page, server.url, "ann")
        while page.locator("#work").is_visible():
            answers = shown_answers(page)
            choose_by_keys(page, tie=rule(answers[0]) == rule(answers[1]))
    assert server.stop()[0] == 0


def rule_by_step(run: Path) -> list[float]:
    """The rule's mean score of each PPO step's samples (samples.jsonl; log_completions = the batch)."""
    by_step: dict[int, list[int]] = {}
    for record in read_jsonl(run / "samples.jsonl"):
        by_step.setdefault(record["step"], []).append(rule(record["completion"]))
    return [sum(v) / len(v) for _, v in sorted(by_step.items())]


LABELLED, ITEMS = 50, 80  # the first 50 items are ranked in the page; the other 30 are held out


def train_on_labels(tiny_dir, browser, serve, root: Path) -> dict:
    """SFT -> sample K = 4 -> rank in the page -> export -> reward model -> its held-out pair accuracy."""
    sft_data = write_jsonl(root / "sft.jsonl", a_strings(2000, seed=0))
    prompts = write_jsonl(root / "prompts.jsonl", [{"prompt": f"{1000 + i}:"} for i in range(ITEMS)])
    common = ["data.chat_template=never", "run.progress=null", "run.seed=0"]
    posttrain(
        "sft",
        f"model.path={tiny_dir / 'policy'}",
        f"data.path={sft_data}",
        f"run.output_dir={root / 'sft'}",
        "run.max_steps=120",
        "run.batch_size=32",
        "optim.lr=3e-3",
        "optim.scheduler=cosine",
        *common,
    )
    task = root / "task"
    posttrain(
        "sample", "--model", root / "sft", "--data", prompts, "--out", task, "--k", 4, "sampling.max_new_tokens=12"
    )
    label_ranks(browser, serve, task, LABELLED)
    posttrain("label", "export", task, "--out", root / "rows.jsonl")

    items = read_jsonl(task / "candidates.jsonl")
    exported = [tuple(row["responses"]) for row in read_jsonl(root / "rows.jsonl")]
    expected = [rule_rows(item) for item in items[:LABELLED]]
    assert set(exported) == set().union(*expected) and len(exported) == sum(map(len, expected))  # its judgements
    posttrain(
        "rm",
        f"model.path={root / 'sft' / 'final' / 'policy'}",
        f"data.path={root / 'rows.jsonl'}",
        f"run.output_dir={root / 'rm'}",
        "run.max_steps=30",
        "run.batch_size=16",
        "optim.lr=2e-3",
        "optim.scheduler=constant",
        *common,
    )
    held_out = write_jsonl(root / "held_out_pairs.jsonl", held_out_pairs(items[LABELLED:]))
    posttrain(
        "eval",
        "--model",
        root / "rm" / "final" / "reward",
        "--data",
        held_out,
        "--output-dir",
        root / "rm_eval",
        "data.chat_template=never",
    )
    summary = json.loads((root / "rm_eval" / "eval_summary.json").read_text())
    tied = sum(any(len(group) > 1 for group in e["ranking"]) for e in read_jsonl(task / "judgements.jsonl"))
    return {
        "rm_pairs": summary["eval/pairs"],
        "rm_accuracy": summary["eval/accuracy"],
        "common": common,
        "labelled": {"judgements_with_ties": tied, "rows": len(exported)},
    }


@pytest.mark.slow  # `make test-slow`: about 3 minutes of subprocesses (SFT, sample, rm, eval, ppo, report)
def test_rankings_made_in_the_page_train_a_reward_model_that_ppo_follows_and_people_prefer(
    tiny_dir, browser, serve, tmp_path
):
    """The issue's loop. The reward model, trained only on the page's rankings of 50 prompts, orders >= 90 %
    of the held-out pairs (30 other prompts) by the hidden rule; PPO against it raises the rule's score of its
    samples (first 2 steps -> last 5, by more than 1 letter of 8); in a blind A/B on 40 new prompts the rule
    prefers the PPO model (A) over its start (B), with the win rate's interval above one half, and the report
    shows it beside the run."""
    result = train_on_labels(tiny_dir, browser, serve, tmp_path)
    assert result["rm_pairs"] >= 60 and result["rm_accuracy"] >= 0.9

    ppo = tmp_path / "ppo"
    posttrain(
        "ppo",
        f"model.path={tmp_path / 'sft' / 'final' / 'policy'}",
        f"data.path={tmp_path / 'prompts.jsonl'}",
        f"reward_model.path={tmp_path / 'rm' / 'final' / 'reward'}",
        f"run.output_dir={ppo}",
        "run.max_steps=20",
        "run.batch_size=32",
        "run.micro_batch_size=16",
        "optim.lr=3e-4",
        "sampling.max_new_tokens=10",
        "kl_coef=0.05",
        "log_completions=32",
        *result["common"],
    )
    scores = rule_by_step(ppo)
    before, after_ppo = sum(scores[:2]) / 2, sum(scores[-5:]) / 5
    assert len(scores) == 20 and after_ppo > before + 1.0

    ab = tmp_path / "ab"
    ab_prompts = write_jsonl(tmp_path / "ab_prompts.jsonl", [{"prompt": f"{2000 + i}:"} for i in range(40)])
    posttrain(
        "sample",
        "--model",
        ppo,
        "--model",
        tmp_path / "sft",
        "--data",
        ab_prompts,
        "--out",
        ab,
        "sampling.max_new_tokens=10",
    )
    label_compare(browser, serve, ab)
    stats = json.loads(posttrain("label", "stats", ab, "--json"))["compare"]
    assert stats["n"] == 40 and stats["win_rate"] > 0.5 and stats["win_rate_ci"][0] > 0.5
    posttrain("report", ppo, "--human", ab, "--out", tmp_path / "report.html")
    html = (tmp_path / "report.html").read_text(encoding="utf-8")
    assert "Human comparison" in html and f"{stats['win_rate']:.3f} [{stats['win_rate_ci'][0]:.3f}" in html

    ab_items = read_jsonl(ab / "candidates.jsonl")
    print(
        json.dumps(
            {  # the docs' measured run reads these (pytest -s)
                "labelled": result["labelled"],
                "rm_held_out_pairs": result["rm_pairs"],
                "rm_held_out_accuracy": result["rm_accuracy"],
                "ppo_rule_first2": before,
                "ppo_rule_last5": after_ppo,
                "ppo_rule_by_step": scores,
                "ab_rule_A": sum(rule(i["completions"][0]["text"]) for i in ab_items) / len(ab_items),
                "ab_rule_B": sum(rule(i["completions"][1]["text"]) for i in ab_items) / len(ab_items),
                "ab": {k: stats[k] for k in ("n", "wins_A", "wins_B", "ties", "win_rate", "win_rate_ci", "left_share")},
            }
        )
    )
