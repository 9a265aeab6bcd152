"""The labelling app's guards, called as an ASGI app in this process (no browser, no socket, no HTTP client
library): what a hostile or malformed request gets. The browser cases are in test_feedback_browser.py."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

pytest.importorskip("fastapi")

from posttrain.errors import UserError
from posttrain.feedback.app import LabelSettings, check_settings, create_app, page_url

TOKEN = "s3cret-token-for-the-test"


def compare_task(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "task.json").write_text(json.dumps({"mode": "compare", "models": {"A": "a", "B": "b"}}))
    row = {"id": "q0", "prompt": "p", "completions": [{"text": "x", "model": "A"}, {"text": "y", "model": "B"}]}
    (path / "candidates.jsonl").write_text(json.dumps(row) + "\n")
    return path


def call(app, method: str, path: str, host: str, query: str = "", body: dict | None = None, headers=()):
    """(status, headers, JSON body) of one request to ``app``, sent as an ASGI server would."""
    data = b"" if body is None else json.dumps(body).encode()
    raw = [("host", host), *headers]
    if body is not None:
        raw += [("content-type", "application/json"), ("content-length", str(len(data)))]
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "scheme": "http",
        "path": path, "raw_path": path.encode(), "query_string": query.encode(), "root_path": "",
        "headers": [(k.encode(), v.encode()) for k, v in raw], "client": ("127.0.0.1", 50000),
        "server": ("127.0.0.1", 8765),
    }  # fmt: skip
    messages, delivered = [], asyncio.Event()

    async def receive():
        if not delivered.is_set():
            delivered.set()
            return {"type": "http.request", "body": data, "more_body": False}
        await asyncio.Event().wait()  # no disconnect: the app ends the exchange

    async def send(message):
        messages.append(message)

    async def run():
        try:
            await app(scope, receive, send)
        except Exception:  # a 500 is sent, then re-raised for the server's log
            pass

    asyncio.run(run())
    start = next(m for m in messages if m["type"] == "http.response.start")
    content = b"".join(m.get("body", b"") for m in messages if m["type"] == "http.response.body")
    return start["status"], {k.decode(): v.decode() for k, v in start["headers"]}, json.loads(content or b"null")


def test_the_token_check_reads_the_routed_path_not_one_rebuilt_from_the_host_header(tmp_path, monkeypatch):
    """Starlette before 1.0.1 built ``request.url`` from the raw Host header, so that ``Host: x#`` turned its
    path into "" while the router still routed /api/item (CVE-2026-48710): a check on ``request.url.path``
    let that request through without the token. Rebuilt here the old way, it must still be refused."""
    from starlette.datastructures import URL
    from starlette.requests import HTTPConnection

    def old_url(self):
        host = dict(self.scope["headers"]).get(b"host", b"").decode("latin-1")
        return URL(f"{self.scope['scheme']}://{host}{self.scope['path']}")

    monkeypatch.setattr(HTTPConnection, "url", property(old_url))
    app = create_app(compare_task(tmp_path / "task"), LabelSettings("0.0.0.0", 8765, TOKEN))
    for host in ("x#", "x?", "x/y"):
        status, _, body = call(app, "GET", "/api/item", host, "labeller=ann")
        assert status == 401 and "token" in body["detail"], host
    status, _, body = call(app, "GET", "/api/item", "x#", "labeller=ann", headers=[("x-posttrain-token", TOKEN)])
    assert status == 200 and body["item"]["answers"] in (["x", "y"], ["y", "x"])


def test_malformed_requests_get_400_and_every_answer_the_security_headers(tmp_path):
    """An unhashable compare choice and a Host with an unclosed '[' were 500s; both are the client's mistake.
    The security headers are on every answer, an error's included."""
    app = create_app(compare_task(tmp_path / "task"), LabelSettings())
    judgement = {"labeller": "ann", "item": "q0", "choice": ["left"]}
    answers = [
        (400, call(app, "POST", "/api/judgement", "127.0.0.1:8765", body=judgement)),
        (400, call(app, "GET", "/api/item", "[::1", "labeller=ann")),
        (400, call(app, "GET", "/api/item", "evil.example:8765", "labeller=ann")),  # DNS rebinding
        (404, call(app, "GET", "/task.json", "127.0.0.1:8765")),
        (200, call(app, "GET", "/api/item", "localhost:8765", "labeller=ann")),
    ]
    for expected, (status, headers, _) in answers:
        assert status == expected
        assert "script-src 'self'" in headers["content-security-policy"]
        assert headers["x-content-type-options"] == "nosniff"
    assert "choice" in answers[0][1][2]["detail"]
    log = tmp_path / "task" / "judgements.jsonl"
    assert not log.exists() or log.read_bytes() == b""  # nothing written


@pytest.mark.parametrize("token", ["pass+word#1234", "with space 123", "short", "äöü-token-123"])
def test_a_token_is_url_safe_because_it_travels_in_the_printed_url(token):
    """'#' ends the URL's query and '+' reads as a space: the page would never send the token as typed."""
    with pytest.raises(UserError, match="--token"):
        check_settings(LabelSettings("0.0.0.0", 8765, token))
    check_settings(LabelSettings("0.0.0.0", 8765, "Ab3_-.~xyz"))
    assert page_url("0.0.0.0", 8765, "Ab3_-.~xyz").endswith("?token=Ab3_-.~xyz")


def test_each_server_names_its_token_cookie_after_its_port(tmp_path):
    """Browsers share cookies across the ports of one host: with one cookie name, the second server's URL
    replaced the first one's token and its page answered 401. Each port's cookie is its own."""
    task = compare_task(tmp_path / "task")
    servers = [(8765, TOKEN), (8766, "another-token-8766")]
    apps = [create_app(task, LabelSettings("127.0.0.1", port, token)) for port, token in servers]
    cookies = []
    for app, (port, token) in zip(apps, servers, strict=True):
        status, headers, _ = call(app, "GET", "/", f"127.0.0.1:{port}", f"token={token}")
        assert status == 303
        name, _, rest = headers["set-cookie"].partition("=")
        assert name == f"posttrain_token_{port}" and rest.startswith(f"{token};")
        assert "httponly" in rest.lower() and "samesite=strict" in rest.lower()
        cookies.append(f"{name}={token}")
    jar = [("cookie", "; ".join(cookies))]  # what the browser sends to either port once both were opened
    for app, (port, _) in zip(apps, servers, strict=True):
        assert call(app, "GET", "/api/item", f"127.0.0.1:{port}", "labeller=ann", headers=jar)[0] == 200


def test_an_error_names_the_task_file_not_the_folder_s_absolute_path(tmp_path):
    """An HTTP answer tells the page which file, not where the task lives on the server's disk."""
    app = create_app(compare_task(tmp_path / "task"), LabelSettings())
    judgement = {"labeller": "ann", "item": "nope", "choice": "left"}
    status, _, body = call(app, "POST", "/api/judgement", "127.0.0.1:8765", body=judgement)
    assert status == 400 and "candidates.jsonl" in body["detail"]
    assert str(tmp_path) not in body["detail"]


def test_the_token_may_come_from_the_environment_which_ps_does_not_show(tmp_path, monkeypatch, capsys):
    """POSTTRAIN_LABEL_TOKEN stands for --token (a command line is public in ps); it is checked the same way,
    so a short one stops the server before it listens, in one line about the token."""
    from posttrain.cli import main

    task = compare_task(tmp_path / "task")
    argv = ["label", str(task), "--host", "0.0.0.0", "--port", "0", "--no-browser"]
    monkeypatch.setenv("POSTTRAIN_LABEL_TOKEN", "short")
    with pytest.raises(SystemExit) as stop:
        main(argv)
    err = capsys.readouterr().err
    assert stop.value.code == 2 and len(err.strip().splitlines()) == 1
    assert "POSTTRAIN_LABEL_TOKEN" in err and "at least 8 characters" in err
    with pytest.raises(SystemExit):
        main(["label", "--help"])
    assert "POSTTRAIN_LABEL_TOKEN" in " ".join(capsys.readouterr().out.split())
