"""What the browser tests of ``posttrain label`` share: the system's Chromium through Playwright, the real server
started as ``posttrain label TASK --port 0 --no-browser`` in a subprocess, hand-written task folders, and a
scripted labeller that reads the answers off the page and judges them by a hidden rule (more letters 'a' is
better) with the page's own keys. The fixtures ``browser``, ``page`` and ``serve`` (tests/conftest.py) are
built from here.

Importing this module skips the importing test module in one line where fastapi, uvicorn, Playwright or a
``chromium`` executable is missing: nothing is downloaded at run time.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest

pytest.importorskip("fastapi", reason="posttrain label needs fastapi and uvicorn: pip install -e '.[dev]'")
pytest.importorskip("uvicorn", reason="posttrain label needs fastapi and uvicorn: pip install -e '.[dev]'")
sync_api = pytest.importorskip("playwright.sync_api", reason="no playwright: pip install -e '.[dev]'")
CHROMIUM = shutil.which("chromium") or ("/usr/bin/chromium" if os.path.exists("/usr/bin/chromium") else None)
if CHROMIUM is None:
    pytest.skip("browser tests skipped: no chromium on this machine (apt install chromium)", allow_module_level=True)

expect = sync_api.expect
ROOT = Path(__file__).resolve().parent.parent
URL = re.compile(r"(http://\S+)")
TIMEOUT_MS = 10_000


# ---- the browser ----------------------------------------------------------------------------------


@contextmanager
def chromium():
    """Headless system Chromium (no sandbox: tests may run as root in a container)."""
    with sync_api.sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        try:
            yield launched
        finally:
            launched.close()


@contextmanager
def new_page(browser):
    """A page in a fresh context (its own localStorage, hence its own labeller name)."""
    context = browser.new_context(viewport={"width": 1100, "height": 900})
    context.set_default_timeout(TIMEOUT_MS)
    try:
        yield context.new_page()
    finally:
        context.close()


# ---- task folders and the server ------------------------------------------------------------------


def a_texts(item: int, k: int) -> list[str]:
    """K answers whose hidden quality is their number of 'a's: distinct counts, in a scrambled stored order."""
    counts = [(item * 3 + j * 5) % (k + 3) for j in range(k)]
    while len(set(counts)) < k:
        counts = [c + j for j, c in enumerate(counts)]
    return [f"{'a' * c}{'x' * (6 - c % 6)} answer {item}.{j}\n  kept   spacing" for j, c in enumerate(counts)]


def make_task(folder: Path, mode: str, n_items: int, k: int, **settings) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(n_items):
        texts = a_texts(i, k)
        models = ["A", "B"] if mode == "compare" else ["policy"] * k
        if mode == "compare":  # model A always writes more 'a's: the labeller prefers A
            texts = [f"{'a' * (5 + i)} from one", f"{'a' * i}b from the other"]
        prompt = f"Question {i}: <b>write</b> many a's" if i % 2 else [{"role": "user", "content": f"Question {i}"}]
        rows.append(
            {
                "id": f"q{i:03d}",
                "prompt": prompt,
                "completions": [{"text": t, "model": m} for t, m in zip(texts, models, strict=True)],
            }
        )
    (folder / "candidates.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    models = {"A": "model-alpha-path", "B": "model-beta-path"} if mode == "compare" else {"policy": "tiny"}
    task = {"mode": mode, "models": models, "seed": 3, "k": k, "allow_ties": False, "labellers": [], "overlap": 0.2}
    (folder / "task.json").write_text(json.dumps({**task, **settings}), encoding="utf-8")
    return folder


def label_command(task: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "posttrain.cli", "label", str(task), "--port", "0", "--no-browser", *extra]


class Server:
    """``posttrain label`` in a subprocess; ``url`` is the line it prints at start."""

    def __init__(self, task: Path, *extra: str):
        self.process = subprocess.Popen(
            label_command(task, *extra), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        line = self.process.stdout.readline()  # the server prints its URL before it serves
        match = URL.search(line)
        assert match, (line, self.process.stderr.read() if self.process.poll() is not None else "")
        self.url = match.group(1)
        self.base = self.url.split("?")[0]

    def stop(self) -> tuple[int, str]:
        """SIGTERM, as a service manager stops it: a clean exit (0) with a last line."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        out, err = self.process.communicate(timeout=20)
        return self.process.returncode, out + err


@contextmanager
def servers():
    """``start(task, *extra)`` starts a Server; every one still running at the end is killed."""
    started: list[Server] = []

    def start(task: Path, *extra: str) -> Server:
        started.append(Server(task, *extra))
        return started[-1]

    try:
        yield start
    finally:
        for server in started:
            if server.process.poll() is None:
                server.process.kill()
            server.process.communicate(timeout=20)


def log_events(task: Path) -> list[dict]:
    path = task / "judgements.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


# ---- the scripted labeller ------------------------------------------------------------------------


def log_in(page, url: str, name: str) -> None:
    page.goto(url)
    page.fill("#name", name)
    page.press("#name", "Enter")
    expect(page.locator("#who")).to_be_visible()


def shown_answers(page) -> list[str]:
    """The answers' texts in the order the page shows them (position 0 first)."""
    cards = page.locator("#pool .card")
    expect(cards.first).to_be_visible()
    return [cards.nth(i).locator(".text").text_content() for i in range(cards.count())]


def best_first(answers: list[str]) -> list[int]:
    """The hidden rule: shown positions ordered by the number of 'a's, most first."""
    return sorted(range(len(answers)), key=lambda p: -answers[p].count("a"))


def current_item(page) -> str:
    return page.locator("#item-id").text_content().removeprefix("item ")


def after(page, item: str) -> None:
    """Wait until the page has moved on from ``item`` (the POST returned and the next view is drawn)."""
    expect(page.locator("#item-id")).not_to_have_text(f"item {item}")


def rank_by_keys(page, order: list[int]) -> None:
    item = current_item(page)
    for position in order:
        page.keyboard.press(str(position + 1))
    expect(page.locator("#ranking .card")).to_have_count(len(order))
    page.keyboard.press("Enter")
    after(page, item)


def choose_by_keys(page, tie: bool = False) -> None:
    """pair / compare: press 1 or 2 for the answer with more 'a's (t for a tie)."""
    item = current_item(page)
    answers = shown_answers(page)
    page.keyboard.press("t" if tie else str(best_first(answers)[0] + 1))
    after(page, item)
