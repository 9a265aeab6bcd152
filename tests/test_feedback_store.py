"""The task folder and its append-only judgement log (posttrain.feedback.store): checking task.json and
candidates.jsonl, assignment, display order, the events refused, concurrent writers (threads and processes),
a torn last line, undo and resume, and export to the rows ``posttrain rm`` reads (read back by rm's loader)."""

import json
import subprocess
import sys
import threading
from collections import Counter
from pathlib import Path

import pytest

from posttrain.errors import UserError
from posttrain.feedback import store
from posttrain.feedback.store import BadEvent, Conflict, NotAllowed, load_task


def make_task(path: Path, items: int = 6, k: int = 4, texts=None, **settings) -> store.TaskFolder:
    settings = {"mode": "rank", "seed": 0, **settings}
    path.mkdir(parents=True, exist_ok=True)
    (path / "task.json").write_text(json.dumps(settings))
    rows = []
    for i in range(items):
        models = ["A", "B"] if settings["mode"] == "compare" else ["policy"] * k
        completions = [{"text": (texts or {}).get((i, j), f"answer {i}.{j}"), "model": m} for j, m in enumerate(models)]
        rows.append({"id": f"{i:04d}", "prompt": f"question {i}?", "completions": completions, "meta": {"n": i}})
    (path / "candidates.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return load_task(path)


def rank(task, labeller: str, item: str, order=None, **extra) -> dict:
    """A strict ranking of ``item`` as the page would send it: best first in ``order`` (default: as shown)."""
    shown = task.shown(item, labeller)
    ranking = [[c] for c in (order or shown)]
    return {"event": "judgement", "labeller": labeller, "item": item, "mode": task.mode, "shown": shown,
            "ranking": ranking, **extra}  # fmt: skip


# --------------------------------------------------------------------------------------------------
# the folder
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "settings, field",
    [
        ({"mode": "vote"}, "mode"),
        ({"seed": "one"}, "seed"),
        ({"allow_ties": "yes"}, "allow_ties"),
        ({"labellers": "ann"}, "labellers"),
        ({"labellers": ["ann", "ann"]}, "labellers"),
        ({"labellers": ["a b"]}, "labellers"),
        ({"overlap": 1.5}, "overlap"),
    ],
)
def test_a_bad_setting_is_one_line_naming_the_field(tmp_path, settings, field):
    make_task(tmp_path)
    (tmp_path / "task.json").write_text(json.dumps({"mode": "rank", **settings}))
    with pytest.raises(UserError, match=f"task.json: field '{field}'") as err:
        load_task(tmp_path)
    assert "\n" not in str(err.value)


def test_command_line_overrides_are_checked_like_task_json(tmp_path):
    task = make_task(tmp_path)
    assert task.with_overrides(mode="score", overlap=0.5).mode == "score"
    with pytest.raises(UserError, match="the command line: field 'overlap'"):
        task.with_overrides(overlap=-1)
    with pytest.raises(UserError, match="field 'models'"):  # compare names its models A and B
        task.with_overrides(mode="compare")


@pytest.mark.parametrize(
    "line, field",
    [
        ('{"prompt": "q", "completions": []}', "id"),
        ('{"id": "1", "prompt": 3, "completions": []}', "prompt"),
        ('{"id": "1", "prompt": "q", "completions": [{"text": "a", "model": "m"}]}', "completions"),
        ('{"id": "1", "prompt": "q", "completions": [{"text": 1, "model": "m"}, {"text": "b", "model": "m"}]}',
         "completions\\[0\\]"),
        ('{"id": "0000", "prompt": "q", "completions": [{"text": "a", "model": "m"}, {"text": "b", "model": "m"}]}',
         "id"),  # repeats item 0000
    ],
)  # fmt: skip
def test_a_bad_candidate_line_names_file_line_and_field(tmp_path, line, field):
    make_task(tmp_path, items=1)
    with open(tmp_path / "candidates.jsonl", "a") as f:
        f.write(line + "\n")
    with pytest.raises(UserError, match=f"candidates.jsonl:2: field '{field}'"):
        load_task(tmp_path)


def test_a_compare_task_needs_models_a_then_b(tmp_path):
    task = make_task(tmp_path, mode="compare", models={"A": "x", "B": "y"})
    assert [c["model"] for c in task.items[0].completions] == ["A", "B"]
    rows = (tmp_path / "candidates.jsonl").read_text().replace('"model": "A"', '"model": "C"')
    (tmp_path / "candidates.jsonl").write_text(rows)
    with pytest.raises(UserError, match="models 'A' then 'B'"):
        load_task(tmp_path)


# --------------------------------------------------------------------------------------------------
# who sees what
# --------------------------------------------------------------------------------------------------


def test_assignment_shares_the_overlap_and_balances_the_rest():
    items = [f"{i:05d}" for i in range(1000)]
    names = ["ann", "bob", "cy"]
    given = store.assign(items, names, overlap=0.2, seed=1)
    assert given == store.assign(items, names, overlap=0.2, seed=1)  # deterministic
    assert given != store.assign(items, names, overlap=0.2, seed=2)
    counts = Counter(i for name in names for i in given[name])
    shared = [i for i in items if counts[i] == 3]
    assert set(counts.values()) == {1, 3} and len(counts) == 1000  # every item: one labeller or all of them
    assert 150 < len(shared) < 250  # about 20 % (binomial sd ~ 13)
    alone = [len(given[name]) - len(shared) for name in names]
    assert max(alone) - min(alone) <= 1
    for name in names:  # each list keeps the candidates' order
        assert given[name] == sorted(given[name])
    assert store.assign(items, [], 0.2, 1) == {}
    assert all(len(v) == 1000 for v in store.assign(items, names, 1.0, 1).values())
    assert sum(len(v) for v in store.assign(items, names, 0.0, 1).values()) == 1000


def test_labellers_and_assigned_items_are_enforced(tmp_path):
    task = make_task(tmp_path, items=10, labellers=["ann", "bob"], overlap=0)
    assert sorted(task.assigned("ann") + task.assigned("bob")) == [f"{i:04d}" for i in range(10)]
    with pytest.raises(NotAllowed, match="'eve' is not one of this task's labellers"):
        task.assigned("eve")
    bobs = task.assigned("bob")[0]
    with pytest.raises(NotAllowed, match="not assigned to labeller 'ann'"):
        task.append(rank(task, "ann", bobs))  # bob's item
    anyone = make_task(tmp_path / "open", items=3)
    assert anyone.assigned("eve") == ["0000", "0001", "0002"]


def test_a_name_with_a_trailing_newline_is_not_a_name(tmp_path):
    """A name "ann\\n" would be a second labeller beside "ann" (a regex's $ matches before a final newline)."""
    task = make_task(tmp_path, items=2)
    with pytest.raises(BadEvent, match="field 'labeller'"):
        task.check_labeller("ann\n")
    with pytest.raises(UserError, match="field 'labellers'"):
        make_task(tmp_path / "listed", items=2, labellers=["ann\n"])


def test_display_order_is_a_fixed_permutation_per_item_and_labeller():
    order = store.display_order(3, "0007", "ann", 4)
    assert sorted(order) == [0, 1, 2, 3]
    assert order == store.display_order(3, "0007", "ann", 4)  # after a reload
    orders = {tuple(store.display_order(3, item, name, 4)) for item in "abcdef" for name in ("ann", "bob")}
    assert len(orders) > 6  # it does shuffle


def test_compare_sides_and_pair_choice(tmp_path):
    task = make_task(tmp_path / "c", items=200, mode="compare", models={"A": "x", "B": "y"})
    lefts = Counter(task.left(item.id, "ann") for item in task.items)
    assert 70 < lefts["A"] < 130  # about half A-left
    pair = make_task(tmp_path / "p", items=30, k=5, mode="pair")
    for item in pair.items:
        ann, bob = pair.shown(item.id, "ann"), pair.shown(item.id, "bob")
        assert len(ann) == 2 and len(set(ann)) == 2 and sorted(ann) == sorted(bob)  # one pair for everyone
    assert len({tuple(sorted(pair.shown(i.id, "ann"))) for i in pair.items}) > 3
    assert any(pair.shown(i.id, "ann") != pair.shown(i.id, "bob") for i in pair.items)  # sides shuffled


# --------------------------------------------------------------------------------------------------
# events refused
# --------------------------------------------------------------------------------------------------


def _refused(task, event, error, match):
    with pytest.raises(error, match=match) as err:
        task.append(event)
    assert "\n" not in str(err.value)


def test_rank_events_are_checked(tmp_path):
    task = make_task(tmp_path, allow_ties=False)
    good = rank(task, "ann", "0000")
    shown = good["shown"]
    _refused(task, {**good, "event": "vote"}, BadEvent, "field 'event'")
    _refused(task, {**good, "labeller": "a b"}, BadEvent, "field 'labeller'")
    _refused(task, {**good, "item": "nope"}, BadEvent, "no item 'nope'")
    _refused(task, {**good, "mode": "pair"}, BadEvent, "field 'mode'")
    _refused(task, {**good, "shown": sorted(shown)[::-1] if shown != sorted(shown)[::-1] else sorted(shown)},
             BadEvent, "field 'shown'")  # fmt: skip
    _refused(task, {**good, "ranking": [[shown[0]], [shown[1]], [shown[2]]]}, BadEvent, "exactly once")
    _refused(task, {**good, "ranking": [[shown[0]], [shown[0]], [shown[1]], [shown[2]]]}, BadEvent, "exactly once")
    _refused(task, {**good, "ranking": [[shown[0]], [shown[1]], [shown[2]], [7]]}, BadEvent, "exactly once")
    _refused(task, {**good, "ranking": [[shown[0], shown[1]], [shown[2]], [shown[3]]]}, BadEvent, "ties are not")
    _refused(task, {**good, "ranking": [[shown[0]], [], [shown[1], shown[2], shown[3]]]}, BadEvent, "empty group")
    _refused(task, {**good, "ranking": [["0"], [1], [2], [3]]}, BadEvent, "field 'ranking'")
    _refused(task, {**good, "chosen": 1}, BadEvent, "field 'chosen': not a field")
    _refused(task, {**good, "id": "x"}, BadEvent, "field 'id'")
    assert not task.log_path.exists() or task.log_path.read_text() == ""
    written = task.append(good)
    _refused(task, rank(task, "ann", "0000"), Conflict, "already has a live judgement")
    _refused(task, rank(task, "ann", "0001", id=written["id"]), Conflict, "already in the log")
    ties = task.with_overrides(allow_ties=True)
    ties.append(rank(ties, "ann", "0001") | {"ranking": [[shown[0], shown[1]], [shown[2], shown[3]]]})
    scored = task.with_overrides(mode="score")  # the same log in another mode: refused, not mixed
    event = {"event": "judgement", "labeller": "bob", "item": "0002", "mode": "score", "shown": [0, 1, 2, 3]}
    _refused(scored, event | {"shown": scored.shown("0002", "bob"), "scores": {str(c): 3 for c in range(4)}},
             BadEvent, "this log holds rank judgements")  # fmt: skip


def test_pair_compare_score_and_skip_events_are_checked(tmp_path):
    pair = make_task(tmp_path / "p", mode="pair")
    a, b = pair.shown("0000", "ann")
    base = {"event": "judgement", "labeller": "ann", "item": "0000", "mode": "pair", "shown": [a, b]}
    other = next(c for c in range(4) if c not in (a, b))
    _refused(pair, {**base, "chosen": a, "rejected": other}, BadEvent, "the two shown candidates")
    _refused(pair, {**base, "chosen": a, "rejected": a}, BadEvent, "the two shown candidates")
    _refused(pair, {**base, "tie": True, "ranking": [[a, b]]}, BadEvent, "ties are not allowed")
    pair.append({**base, "chosen": b, "rejected": a})

    cmp = make_task(tmp_path / "c", mode="compare", models={"A": "x", "B": "y"})
    left = cmp.left("0000", "ann")
    right = "B" if left == "A" else "A"
    base = {
        "event": "judgement",
        "labeller": "ann",
        "item": "0000",
        "mode": "compare",
        "shown": cmp.shown("0000", "ann"),
    }
    _refused(cmp, {**base, "left": right, "choice": "left", "winner": right}, BadEvent, "field 'left'")
    _refused(cmp, {**base, "left": left, "choice": "left", "winner": right}, BadEvent, "field 'winner'")
    _refused(cmp, {**base, "left": left, "choice": "tie", "winner": "tie"}, BadEvent, "ties are not allowed")
    _refused(cmp, {**base, "left": left, "choice": "up", "winner": left}, BadEvent, "field 'choice'")
    cmp.append({**base, "left": left, "choice": "right", "winner": right})

    score = make_task(tmp_path / "s", mode="score", k=3)
    base = {
        "event": "judgement",
        "labeller": "ann",
        "item": "0000",
        "mode": "score",
        "shown": score.shown("0000", "ann"),
    }
    _refused(score, {**base, "scores": {"0": 3, "1": 4}}, BadEvent, "one score per shown candidate")
    _refused(score, {**base, "scores": {"0": 3, "1": 4, "2": 6}}, BadEvent, "field 'scores.2'")
    _refused(score, {**base, "scores": {"0": 3, "1": 4.0, "2": 1}}, BadEvent, "field 'scores.1'")
    _refused(score, {**base, "scores": {"0": 3, "1": True, "2": 1}}, BadEvent, "field 'scores.1'")
    score.append({**base, "scores": {"0": 3, "1": 4, "2": 1}})

    skip = {"event": "skip", "labeller": "ann", "item": "0001"}
    _refused(score, {**skip, "reason": "bored"}, BadEvent, "field 'reason'")
    _refused(score, {**skip, "reason": "flag", "note": "x" * 5000}, BadEvent, "field 'note'")
    assert score.append({**skip, "reason": "flag"})["note"] == ""


# --------------------------------------------------------------------------------------------------
# the log
# --------------------------------------------------------------------------------------------------


def test_undo_and_resume(tmp_path):
    task = make_task(tmp_path, items=4)
    assert task.next_item("ann") == "0000" and task.progress("ann") == (0, 4)
    with pytest.raises(Conflict, match="'ann' has nothing to undo"):
        task.undo("ann")
    first = task.append(rank(task, "ann", "0000"))
    task.append({"event": "skip", "labeller": "ann", "item": "0001", "reason": "skip"})
    task.append(rank(task, "bob", "0000"))
    assert task.next_item("ann") == "0002" and task.progress("ann") == (2, 4)
    undo = task.undo("ann")  # takes back ann's skip, not bob's later judgement
    assert undo["item"] == "0001" and task.next_item("ann") == "0001" and task.progress("bob") == (1, 4)
    with pytest.raises(Conflict, match="only the labeller's last live event"):
        task.append({"event": "undo", "labeller": "bob", "target": first["id"]})
    task.undo("ann")
    assert task.next_item("ann") == "0000" and task.state().judgements("ann") == []
    again = task.append(rank(task, "ann", "0000", order=task.shown("0000", "ann")[::-1]))  # judged anew
    assert task.state().live("ann") == {"0000": again}
    events = [json.loads(line) for line in task.log_path.read_text().splitlines()]
    assert [e["event"] for e in events] == ["judgement", "skip", "judgement", "undo", "undo", "judgement"]
    # a fresh process (another server) sees the same state
    assert load_task(tmp_path).state().live("ann") == {"0000": again}


def test_a_torn_last_line_is_skipped_and_the_next_append_starts_a_new_line(tmp_path):
    task = make_task(tmp_path, items=3)
    task.append(rank(task, "ann", "0000"))
    with open(task.log_path, "ab") as f:  # a write cut short by kill -9
        f.write(b'{"event": "judgement", "labeller": "ann", "item": "00')
    state = task.state()
    assert state.torn == 1 and list(state.live("ann")) == ["0000"]
    task.append(rank(task, "ann", "0001"))
    lines = task.log_path.read_bytes().split(b"\n")
    assert json.loads(lines[2])["item"] == "0001"  # whole, on its own line after the torn one
    fresh = load_task(tmp_path).state()
    assert fresh.torn == 1 and list(fresh.live("ann")) == ["0000", "0001"]


WRITER = """
import sys
from posttrain.feedback.store import load_task
task, name = load_task(sys.argv[1]), sys.argv[2]
for item in task.assigned(name):
    shown = task.shown(item, name)
    task.append({"event": "judgement", "labeller": name, "item": item, "mode": "rank", "shown": shown,
                 "ranking": [[c] for c in shown]})
"""


def _check_log(task, names, per_name):
    raw = task.log_path.read_bytes()
    lines = raw.split(b"\n")
    assert lines[-1] == b"" and len(lines) - 1 == len(names) * per_name
    events = [json.loads(line) for line in lines[:-1]]  # every line is whole JSON
    assert len({e["id"] for e in events}) == len(events)
    for name in names:
        assert sorted(e["item"] for e in events if e["labeller"] == name) == [f"{i:04d}" for i in range(per_name)]


def test_two_processes_append_at_once(tmp_path):
    """Two servers on one folder, 200 judgements each at the same time: 400 whole lines, none lost."""
    task = make_task(tmp_path, items=200, k=3)
    procs = [
        subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path), name], stderr=subprocess.PIPE)
        for name in ("p1", "p2")
    ]
    for proc in procs:
        assert proc.wait(timeout=120) == 0, proc.stderr.read().decode()
    _check_log(task, ["p1", "p2"], 200)


def test_two_threads_append_at_once_and_a_double_submit_counts_once(tmp_path):
    """Two threads of one server, each appending 200 judgements, while a third submits the first
    thread's judgements a second time (a double click): each item is judged once, the copies refused."""
    task = make_task(tmp_path, items=200, k=3)
    refused = []

    def write(name):
        for item in task.assigned(name):
            try:
                task.append(rank(task, name, item))
            except Conflict:  # the other copy of t1's judgement got there first
                refused.append((name, item))

    threads = [threading.Thread(target=write, args=(name,)) for name in ("t1", "t2", "t1")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    _check_log(task, ["t1", "t2"], 200)
    assert len(refused) == 200 and {name for name, _ in refused} == {"t1"}


# --------------------------------------------------------------------------------------------------
# export
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer():
    """The tiny models' character tokenizer, built in process (no model needed to read rows)."""
    from posttrain.models.tiny import build_tiny_tokenizer

    return build_tiny_tokenizer()


def _read_by_rm(path, tokenizer):
    """The rows as posttrain rm reads them (its own loader, data_format auto)."""
    from posttrain.data import DataConfig
    from posttrain.trainers.rm import RMConfig, load_ranking_data

    return load_ranking_data(RMConfig(data=DataConfig(path=str(path))), tokenizer)


def test_rank_export_is_read_by_rm(tmp_path, tokenizer):
    # item 2's candidates 1 and 3 say the same: the worse copy is left out of its ranking
    task = make_task(tmp_path, items=3, texts={(2, 1): "same", (2, 3): "same"}, allow_ties=True)
    task.append(rank(task, "ann", "0000", order=[2, 0, 3, 1]))
    task.append(rank(task, "ann", "0001") | {"ranking": [[1], [0, 3], [2]]})  # a tie: 5 ordered pairs
    task.append(rank(task, "bob", "0002", order=[3, 0, 1, 2]))
    summary = store.export(task, tmp_path / "out" / "rows.jsonl")
    rows = [json.loads(line) for line in (tmp_path / "out" / "rows.jsonl").read_text().splitlines()]
    assert rows[0] == {"prompt": "question 0?", "responses": ["answer 0.2", "answer 0.0", "answer 0.3", "answer 0.1"]}
    assert [r["responses"] for r in rows[1:6]] == [
        ["answer 1.1", "answer 1.0"],
        ["answer 1.1", "answer 1.3"],
        ["answer 1.1", "answer 1.2"],
        ["answer 1.0", "answer 1.2"],
        ["answer 1.3", "answer 1.2"],
    ]
    assert rows[6]["responses"] == ["same", "answer 2.0", "answer 2.2"]
    assert (summary.rows, summary.judgements, summary.tied_judgements) == (7, 3, 1)
    examples, report = _read_by_rm(tmp_path / "out" / "rows.jsonl", tokenizer)
    assert report.kept == 7 and [len(e.response_ids) for e in examples] == [4, 2, 2, 2, 2, 2, 3]

    store.export(task, tmp_path / "bob.jsonl", labeller="bob")
    assert len((tmp_path / "bob.jsonl").read_text().splitlines()) == 1
    with pytest.raises(UserError, match="no judgements by 'cy'"):
        store.export(task, tmp_path / "cy.jsonl", labeller="cy")
    assert not (tmp_path / "cy.jsonl").exists()


def test_pair_and_score_export_are_read_by_rm_and_compare_is_refused(tmp_path, tokenizer):
    pair = make_task(tmp_path / "p", items=2, mode="pair", allow_ties=True)
    a, b = pair.shown("0000", "ann")
    pair.append({"event": "judgement", "labeller": "ann", "item": "0000", "mode": "pair", "shown": [a, b],
                 "chosen": b, "rejected": a})  # fmt: skip
    c, d = pair.shown("0001", "ann")
    pair.append({"event": "judgement", "labeller": "ann", "item": "0001", "mode": "pair", "shown": [c, d],
                 "tie": True, "ranking": [[c, d]]})  # fmt: skip
    summary = pair.with_overrides() and store.export(pair, tmp_path / "pairs.jsonl")
    assert [json.loads(x) for x in (tmp_path / "pairs.jsonl").read_text().splitlines()] == [
        {"prompt": "question 0?", "chosen": f"answer 0.{b}", "rejected": f"answer 0.{a}"}
    ]
    assert summary.ties_dropped == 1 and "1 ties dropped" in summary.message()
    assert _read_by_rm(tmp_path / "pairs.jsonl", tokenizer)[1].kept == 1

    score = make_task(tmp_path / "s", items=1, mode="score", k=3)
    score.append({"event": "judgement", "labeller": "ann", "item": "0000", "mode": "score",
                  "shown": score.shown("0000", "ann"), "scores": {"0": 2, "1": 5, "2": 2}})  # fmt: skip
    store.export(score, tmp_path / "scores.jsonl")
    rows = [json.loads(x) for x in (tmp_path / "scores.jsonl").read_text().splitlines()]
    assert sorted((r["chosen"], r["rejected"]) for r in rows) == [
        ("answer 0.1", "answer 0.0"),
        ("answer 0.1", "answer 0.2"),
    ]
    assert _read_by_rm(tmp_path / "scores.jsonl", tokenizer)[1].kept == 2

    cmp = make_task(tmp_path / "c", items=1, mode="compare", models={"A": "x", "B": "y"})
    with pytest.raises(UserError, match="compare task judges two models"):
        store.export(cmp, tmp_path / "cmp.jsonl")


def test_label_export_prints_one_line(tmp_path):
    task = make_task(tmp_path / "t", items=2)
    task.append(rank(task, "ann", "0000"))
    message = store.label_export(tmp_path / "t", tmp_path / "rows.jsonl")
    assert message.startswith("wrote 1 ranking rows from 1 judgements") and "posttrain rm data.path=" in message
