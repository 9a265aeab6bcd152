"""``posttrain label`` in a real browser: Playwright drives the system's Chromium (Debian's package; nothing is
downloaded) against the real server, started as ``posttrain label TASK --port 0 --no-browser`` in a subprocess,
over small hand-written task folders (no model needed). The labellers here are scripted: they read the
answers off the page and judge by a hidden rule (more letters 'a' is better), by keys and by drag and drop.
"""

from __future__ import annotations

import http.client as http_client
import json
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

from browser_helpers import (
    ROOT,
    URL,
    after,
    best_first,
    choose_by_keys,
    current_item,
    expect,
    label_command,
    log_events,
    log_in,
    make_task,
    rank_by_keys,
    shown_answers,
)

# ---- the scripted labeller (the shared part, the server and the fixtures: tests/browser_helpers.py, conftest.py)


def rank_by_drag(page, order: list[int]) -> None:
    """Drag the second best in first, then the best onto it (inserted before it), the rest to the list's end."""
    item = current_item(page)
    ranking = page.locator("#ranking")

    def card(position):
        return page.locator(f'.card[data-pos="{position}"]')

    def to_end(position):
        box = ranking.bounding_box()
        card(position).drag_to(ranking, target_position={"x": box["width"] / 2, "y": box["height"] - 4})

    to_end(order[1])
    card(order[0]).drag_to(card(order[1]))
    for position in order[2:]:
        to_end(position)
    ranked = page.locator("#ranking .card")
    expect(ranked).to_have_count(len(order))
    assert [int(ranked.nth(i).get_attribute("data-pos")) for i in range(len(order))] == order
    page.click("#submit")
    after(page, item)


def expected_ranking_row(task: Path, item_id: str) -> dict:
    row = next(json.loads(line) for line in (task / "candidates.jsonl").read_text().splitlines() if item_id in line)
    texts = sorted((c["text"] for c in row["completions"]), key=lambda t: -t.count("a"))
    return {"prompt": row["prompt"], "responses": texts}


# ---- the cases ------------------------------------------------------------------------------------


def test_rank_by_keys_and_drag_reload_resume_undo_export(page, serve, tmp_path):
    """(a) A labeller ranks by the hidden rule through the page: keys, a taken-back pick, drag and drop, a
    reload that resumes at the right item, an undo that brings the item back and a second judgement of it,
    a flag with a note. The export holds exactly its live judgements, best first."""
    task = make_task(tmp_path / "task", "rank", n_items=6, k=4)
    server = serve(task)
    log_in(page, server.url, "ann")
    expect(page.locator("#progress")).to_have_text("1 of 6")
    judged = [current_item(page)]
    answers = shown_answers(page)
    page.keyboard.press(str(best_first(answers)[-1] + 1))  # a wrong first pick, taken back
    page.keyboard.press("Backspace")
    rank_by_keys(page, best_first(answers))
    judged.append(current_item(page))
    rank_by_drag(page, best_first(shown_answers(page)))
    judged.append(current_item(page))
    rank_by_keys(page, best_first(shown_answers(page))[:-1])  # Enter ranks the one left last
    page.keyboard.press("1")
    page.screenshot(path=str(tmp_path / "label_rank.png"))
    page.keyboard.press("Backspace")

    page.reload()  # the name is remembered, the page resumes at the fourth item
    expect(page.locator("#progress")).to_have_text("4 of 6")
    fourth = current_item(page)
    assert fourth not in judged and page.locator("#login").is_hidden()
    rank_by_keys(page, best_first(shown_answers(page))[::-1])  # worst first: a mistake ...
    page.keyboard.press("u")  # ... undone: the same item comes back
    expect(page.locator("#item-id")).to_have_text(f"item {fourth}")
    expect(page.locator("#progress")).to_have_text("4 of 6")
    judged.append(fourth)
    rank_by_keys(page, best_first(shown_answers(page)))
    flagged = current_item(page)
    page.keyboard.press("f")  # flagged, with a note
    page.keyboard.type("the prompt is cut off")
    page.keyboard.press("Enter")
    after(page, flagged)
    judged.append(current_item(page))
    rank_by_keys(page, best_first(shown_answers(page)))
    expect(page.locator("#done")).to_be_visible()
    expect(page.locator("#progress")).to_have_text("6 of 6")

    out = tmp_path / "ranked.jsonl"
    done = subprocess.run(
        [sys.executable, "-m", "posttrain.cli", "label", "export", str(task), "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows == [expected_ranking_row(task, item) for item in judged]
    events = log_events(task)
    flags = [(e["item"], e["note"]) for e in events if e["event"] == "skip" and e["reason"] == "flag"]
    assert flags == [(flagged, "the prompt is cut off")] and sum(e["event"] == "undo" for e in events) == 1
    assert server.stop()[0] == 0


def texts_of(task: Path) -> dict[str, list[str]]:
    rows = [json.loads(line) for line in (task / "candidates.jsonl").read_text().splitlines()]
    return {row["id"]: [c["text"] for c in row["completions"]] for row in rows}


def test_pair_compare_and_score_modes_by_keys(page, serve, tmp_path):
    """(b) pair: two of three answers, s skips, 1 / 2 picks the better; compare: blind A/B with the sides shuffled per
    item, the stored winner is the model, not the side; score: 1-5 per answer. (g) a screenshot of each."""
    pair = make_task(tmp_path / "pair", "pair", n_items=4, k=3)
    log_in(page, serve(pair).url, "ann")
    page.screenshot(path=str(tmp_path / "label_pair.png"))
    skipped = current_item(page)
    page.keyboard.press("s")
    after(page, skipped)
    for _ in range(3):
        choose_by_keys(page)
    expect(page.locator("#done")).to_be_visible()
    texts = texts_of(pair)
    events = log_events(pair)
    assert [(e["event"], e["item"], e["reason"]) for e in events[:1]] == [("skip", skipped, "skip")]
    for event in events[1:]:
        chosen, rejected = texts[event["item"]][event["chosen"]], texts[event["item"]][event["rejected"]]
        assert chosen.count("a") > rejected.count("a") and len(event["shown"]) == 2

    compare = make_task(tmp_path / "compare", "compare", n_items=8, k=2, allow_ties=True)
    server = serve(compare)
    log_in(page, server.url, "cat")
    page.screenshot(path=str(tmp_path / "label_compare.png"))
    view = json.loads(urllib.request.urlopen(f"{server.base}api/item?labeller=cat", timeout=10).read())
    assert set(view["item"]) == {"id", "prompt", "answers"}  # no model names, no candidate indices
    for i in range(8):
        assert "model-alpha" not in page.content() and ">A<" not in page.content()
        choose_by_keys(page, tie=i == 7)
    events = log_events(compare)
    assert [e["winner"] for e in events] == ["A"] * 7 + ["tie"]
    assert {e["left"] for e in events} == {"A", "B"}  # both sides seen: the side is not the model
    assert all((e["choice"] == "left") == (e["left"] == "A") for e in events[:7])

    score = make_task(tmp_path / "score", "score", n_items=2, k=3)
    log_in(page, serve(score).url, "dee")
    for n in range(2):
        item = current_item(page)
        answers = shown_answers(page)
        for position in range(3):  # the one with most 'a's 3, the next 2, the last 1
            page.keyboard.press(str(3 - best_first(answers).index(position)))
        if n == 0:
            page.screenshot(path=str(tmp_path / "label_score.png"))
        page.keyboard.press("Enter")
        after(page, item)
    texts = texts_of(score)
    for event in log_events(score):
        by_score = sorted(event["scores"], key=lambda i: -event["scores"][i])
        assert [texts[event["item"]][int(i)].count("a") for i in by_score] == sorted(
            (t.count("a") for t in texts[event["item"]]), reverse=True
        )
    assert all((tmp_path / f"label_{mode}.png").stat().st_size > 10_000 for mode in ("pair", "compare", "score"))


HOSTILE = ["<script>window.pwned=1</script>", '<img src=x onerror="window.pwned=1">']


def test_model_text_is_shown_as_text_and_never_run(page, serve, tmp_path):
    """(c) A completion holding a script tag or an <img onerror> is displayed as its literal text; nothing runs,
    neither when the item is drawn nor when its cards are redrawn during ranking (with a tie, t)."""
    task = make_task(tmp_path / "task", "rank", n_items=1, k=3, allow_ties=True)
    row = json.loads((task / "candidates.jsonl").read_text())
    row["completions"][0]["text"], row["completions"][1]["text"] = HOSTILE
    row["prompt"] = [{"role": "<b>user</b>", "content": HOSTILE[1] + "\n  and a <u>question</u>"}]
    (task / "candidates.jsonl").write_text(json.dumps(row) + "\n")
    log_in(page, serve(task).url, "ann")
    answers = shown_answers(page)
    assert set(HOSTILE) <= set(answers)
    assert page.locator("#prompt").text_content() == f"<b>user</b>: {HOSTILE[1]}\n  and a <u>question</u>"
    for key in ("1", "2", "Backspace", "3", "t"):  # redraws the cards; t ties the third with the first
        page.keyboard.press(key)
    expect(page.locator("#ranking .badge")).to_have_text(["#1 (tie)", "#1 (tie)"])
    page.wait_for_timeout(200)  # an onerror would fire as soon as the image failed
    assert page.evaluate("typeof window.pwned") == "undefined"
    assert page.locator("img").count() == 0 and page.locator("main script, main b, main u").count() == 0
    page.keyboard.press("Enter")
    expect(page.locator("#done")).to_be_visible()
    (event,) = log_events(task)
    assert event["ranking"] == [[event["shown"][0], event["shown"][2]], [event["shown"][1]]]


def http(url: str, data: dict | None = None, headers: dict | None = None) -> tuple[int, dict, bytes]:
    """(status, headers, body) of a GET, or of a JSON POST when ``data`` is given."""
    body = None if data is None else json.dumps(data).encode()
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers), err.read()


def raw_get(base: str, path: str) -> int:
    """The status of GET ``path`` sent as written (urllib would normalise a ``..``)."""
    host, port = base.removeprefix("http://").rstrip("/").rsplit(":", 1)
    connection = http_client.HTTPConnection(host, int(port), timeout=10)
    connection.request("GET", path)
    return connection.getresponse().status


def test_beyond_loopback_needs_a_token_and_every_api_call_carries_it(browser, serve, tmp_path, monkeypatch):
    """(d) Another address than the loopback without --token: refused at start in one line, before listening.
    With a token, the API answers 401 without it (header or the cookie the printed URL sets) and writes
    nothing; the page works once opened through the printed URL. Every response has the CSP and nosniff, and
    no path reaches a file (the task's own included). A second server on the host, its token from
    POSTTRAIN_LABEL_TOKEN, opened in the same browser, leaves the first one's cookie alone (one per port)."""
    task = make_task(tmp_path / "task", "pair", n_items=2, k=2)
    refused = subprocess.run(
        label_command(task, "--host", "0.0.0.0"), cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert refused.returncode == 2 and not URL.search(refused.stdout)
    assert len(refused.stderr.strip().splitlines()) == 1 and "--token" in refused.stderr

    token = "s3cret-token-for-the-test"
    server = serve(task, "--token", token)
    assert server.url.endswith(f"?token={token}")
    item_url = f"{server.base}api/item?labeller=ann"
    assert http(item_url)[0] == 401
    assert http(item_url, headers={"X-Posttrain-Token": "wrong-token-xyz"})[0] == 401
    status, headers, _ = http(item_url, headers={"X-Posttrain-Token": token})
    assert status == 200
    judgement = {"labeller": "ann", "item": "q000", "choice": 0}
    assert http(f"{server.base}api/judgement", judgement)[0] == 401
    assert not (task / "judgements.jsonl").exists()
    for response_headers in (headers, http(server.base)[1]):
        policy = response_headers["content-security-policy"]
        assert "script-src 'self'" in policy and "unsafe-inline" not in policy
        assert response_headers["x-content-type-options"] == "nosniff"
    for path in ("/../task.json", "/%2e%2e/task.json", "/task.json", "/app.js/../candidates.jsonl", "/static/app.js"):
        assert raw_get(server.base, path) == 404, path

    with_token, without = browser.new_context(), browser.new_context()
    try:
        page = with_token.new_page()
        log_in(page, server.url, "ann")  # the token moves from the URL to a cookie
        assert page.url == server.base
        expect(page.locator("#progress")).to_have_text("1 of 2")
        monkeypatch.setenv("POSTTRAIN_LABEL_TOKEN", "second-server-token")
        second = serve(make_task(tmp_path / "second", "pair", n_items=2, k=2))
        assert second.url.endswith("?token=second-server-token")
        log_in(with_token.new_page(), second.url, "bob")
        ports = sorted(int(s.base.rstrip("/").rsplit(":", 1)[1]) for s in (server, second))
        assert sorted(c["name"] for c in with_token.cookies()) == [f"posttrain_token_{p}" for p in ports]
        page.keyboard.press("1")  # the first server's page still has its token
        expect(page.locator("#progress")).to_have_text("2 of 2")
        assert len(log_events(task)) == 1
        stranger = without.new_page()
        stranger.goto(server.base)
        stranger.fill("#name", "ann")
        stranger.press("#name", "Enter")
        expect(stranger.locator("#login-error")).to_contain_text("token")
    finally:
        with_token.close()
        without.close()


def test_kill_9_keeps_every_returned_judgement_and_resumes(page, serve, tmp_path):
    """(e) Judgements made in the page, then the server is killed with SIGKILL while one more is in flight:
    every judgement whose POST returned is in judgements.jsonl; a new server resumes after them."""
    task = make_task(tmp_path / "task", "pair", n_items=8, k=2)
    server = serve(task)
    returned = []
    page.on("response", lambda r: returned.append(r) if r.url.endswith("api/judgement") and r.ok else None)
    log_in(page, server.url, "ann")
    for _ in range(4):
        choose_by_keys(page)
    page.keyboard.press("1")  # one more, in flight or just written as the server dies
    server.process.send_signal(signal.SIGKILL)
    server.process.wait(timeout=20)
    logged = [e["item"] for e in log_events(task)]
    assert len(returned) >= 4
    assert {json.loads(r.request.post_data)["item"] for r in returned} <= set(logged)
    assert len(logged) in (len(returned), len(returned) + 1) and len(set(logged)) == len(logged)

    log_in(page, serve(task).url, "ann")
    expect(page.locator("#progress")).to_have_text(f"{len(logged) + 1} of 8")
    assert current_item(page) == f"q{len(logged):03d}"  # the first item without a judgement
    choose_by_keys(page)
    assert len(log_events(task)) == len(logged) + 1


def test_two_labellers_at_once_lose_nothing(browser, serve, tmp_path):
    """(f) Two labellers in two browser contexts judge at the same moment (both Enters pressed before either
    answer comes back): each one's judgements are all in the log, none lost or mixed up. A name not in the
    task's list is refused."""
    from posttrain.feedback.store import label_export, load_task

    task = make_task(tmp_path / "task", "rank", n_items=8, k=3, labellers=["ann", "bob"], overlap=0.5)
    server = serve(task)
    contexts = [browser.new_context() for _ in range(2)]
    try:
        pages = [context.new_page() for context in contexts]
        pages[0].goto(server.url)
        pages[0].fill("#name", "eve")
        pages[0].press("#name", "Enter")
        expect(pages[0].locator("#login-error")).to_contain_text("not one of this task's labellers")
        for page, name in zip(pages, ("ann", "bob"), strict=True):
            log_in(page, server.url, name)
        while any(page.locator("#work").is_visible() for page in pages):
            busy = [page for page in pages if page.locator("#work").is_visible()]
            items = [current_item(page) for page in busy]
            for page in busy:
                for position in best_first(shown_answers(page))[:-1]:
                    page.keyboard.press(str(position + 1))
            for page in busy:
                page.keyboard.press("Enter")
            for page, item in zip(busy, items, strict=True):
                after(page, item)
    finally:
        for context in contexts:
            context.close()
    loaded = load_task(task)
    events = log_events(task)
    for name in ("ann", "bob"):
        assert sorted(e["item"] for e in events if e["labeller"] == name) == sorted(loaded.assigned(name))
        out = tmp_path / f"{name}.jsonl"
        label_export(task, out, name)
        rows = [json.loads(line) for line in out.read_text().splitlines()]
        assert rows == [expected_ranking_row(task, e["item"]) for e in events if e["labeller"] == name]
    assert set(loaded.assigned("ann")) & set(loaded.assigned("bob"))  # the overlap was labelled twice
