"""``posttrain label``: the labelling web app over one task folder (FastAPI, served by uvicorn).

Routes, all fixed (none takes a file path from the request; the page's three files are read once, at start,
from this package's static/ folder, and the server reads nothing else but the task folder through store.py):

    GET  /  /app.js  /app.css       the page (static/index.html, app.js, app.css)
    GET  /api/item?labeller=NAME    the labeller's current item, its answers in display order, progress n of N
    POST /api/judgement             {labeller, item, ranking | choice | scores}, by shown position
    POST /api/skip                  {labeller, item, reason: skip | flag, note}
    POST /api/undo                  {labeller}: takes back the labeller's last judgement or skip

The page knows answers by their shown position only; this module maps positions to candidate indices
(``TaskFolder.shown``) and, in compare mode, to the models, so the page never learns which model is which.
Every write goes through ``TaskFolder.append``, which flushes and fsyncs before the response is sent.

Security: loopback by default; any other address needs a token, which every /api request must carry (the
``X-Posttrain-Token`` header, or the cookie a first visit to ``/?token=...`` sets, named after the port:
browsers share a host's cookies across its ports, so two servers on one host keep their own tokens; the
token comes from ``--token`` or, out of ``ps``, from POSTTRAIN_LABEL_TOKEN). On loopback the Host
header must name the loopback (no DNS rebinding), and a POST must be JSON (no cross-site form post). Every
response carries a Content-Security-Policy without inline script, and nosniff.
"""

from __future__ import annotations

import hmac
import ipaddress
import re
import socket
import sys
import threading
import webbrowser
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Annotated

import uvicorn
from fastapi import Body, FastAPI, Query, Request
from fastapi.responses import JSONResponse, RedirectResponse, Response

from posttrain.errors import UserError
from posttrain.feedback.store import BadEvent, Conflict, NotAllowed, TaskFolder, load_task

STATIC = Path(__file__).parent / "static"
PAGE_FILES = {
    "/": ("index.html", "text/html"),
    "/app.js": ("app.js", "text/javascript"),
    "/app.css": ("app.css", "text/css"),
}
TOKEN_HEADER = "x-posttrain-token"
TOKEN_ENV = "POSTTRAIN_LABEL_TOKEN"  # the token where ps does not show it (a command line is public)
MAX_BODY = 64 * 1024  # a judgement is a few hundred bytes; a note at most 2000 characters
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
    "img-src 'self'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
    "Cache-Control": "no-store",
}
ERROR_STATUS = {NotAllowed: 403, BadEvent: 400, Conflict: 409}
JSONBody = Annotated[dict, Body()]
Labeller = Annotated[str, Query()]


@dataclass
class LabelSettings:
    """How the server runs: where it listens and the token it asks for (None: none, loopback only)."""

    host: str = "127.0.0.1"
    port: int = 8765
    token: str | None = None


def token_cookie(port: int) -> str:
    """The token cookie's name on ``port``: a browser sends a host's cookies to all its ports."""
    return f"posttrain_token_{port}"


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_settings(settings: LabelSettings) -> None:
    """A non-loopback address without a token is refused: the page would be open to the whole network."""
    if not is_loopback(settings.host) and not settings.token:
        raise UserError(
            f"--host {settings.host} serves the page beyond this machine: give --token SECRET (or set {TOKEN_ENV}) too "
            "(labellers then open the printed URL, which carries it)"
        )
    # the token travels in the printed URL's query and in a cookie: a '#', '+', '&' or space would not
    # arrive as typed, so only URL-safe characters
    if settings.token is not None and not re.fullmatch(r"[A-Za-z0-9._~-]{8,}", settings.token):
        raise UserError(
            f"--token / {TOKEN_ENV}: at least 8 characters among letters, digits and . _ ~ - "
            "(e.g. python -c 'import secrets; print(secrets.token_urlsafe())')"
        )


def create_app(task: TaskFolder | str | Path, settings: LabelSettings) -> FastAPI:
    """The app over ``task``: a task folder's path, or ``store.load_task``'s result (with the command line's
    overrides applied)."""
    task = task if isinstance(task, TaskFolder) else load_task(task)
    check_settings(settings)
    app = FastAPI(title="posttrain label", docs_url=None, redoc_url=None, openapi_url=None)
    pages = {route: ((STATIC / name).read_bytes(), kind) for route, (name, kind) in PAGE_FILES.items()}
    _add_guards(app, settings)
    _add_page_routes(app, pages, settings)
    _add_api_routes(app, task)
    return app


def _add_page_routes(app: FastAPI, pages: dict[str, tuple[bytes, str]], settings: LabelSettings) -> None:
    token = settings.token

    def page(route: str):
        body, kind = pages[route]
        return Response(body, media_type=kind)

    @app.get("/")
    def index(token_given: Annotated[str | None, Query(alias="token")] = None):
        if token and token_given is not None:  # the first visit: the token moves from the URL to a cookie
            if not hmac.compare_digest(token_given.encode(), token.encode()):
                return JSONResponse({"detail": "wrong token"}, status_code=401)
            response = RedirectResponse("/", status_code=303)
            response.set_cookie(token_cookie(settings.port), token, httponly=True, samesite="strict")
            return response
        return page("/")

    @app.get("/app.js")
    def script():
        return page("/app.js")

    @app.get("/app.css")
    def style():
        return page("/app.css")


def _add_guards(app: FastAPI, settings: LabelSettings) -> None:
    loopback = is_loopback(settings.host)

    @app.middleware("http")
    async def guard(request: Request, call_next):
        refusal = _refusal(request, settings, loopback)
        response = refusal if refusal is not None else await call_next(request)
        response.headers.update(SECURITY_HEADERS)
        return response

    @app.exception_handler(Exception)  # a bug's 500 is answered outside ``guard``: it gets the headers here
    async def server_error(request: Request, err: Exception):
        return JSONResponse({"detail": "internal error (see the server's output)"}, 500, SECURITY_HEADERS)

    @app.exception_handler(UserError)
    async def user_error(request: Request, err: UserError):
        status = next((code for kind, code in ERROR_STATUS.items() if isinstance(err, kind)), 400)
        return JSONResponse({"detail": str(err)}, status_code=status)


def _refusal(request: Request, settings: LabelSettings, loopback: bool) -> Response | None:
    """The response that refuses ``request`` before any route sees it, or None to let it through."""
    token = settings.token
    host = request.headers.get("host", "")
    name = host[: host.find("]") + 1] if host.startswith("[") else host.rsplit(":", 1)[0]
    if loopback and not is_loopback(name):
        return JSONResponse({"detail": f"Host {host!r} is not this machine's loopback"}, status_code=400)
    # the path the router routes, not request.url.path: Starlette < 1.0.1 rebuilds that from the Host
    # header, and a Host of "x#" would empty it and skip the token check (CVE-2026-48710)
    if not request.scope["path"].startswith("/api/"):
        return None
    if token is not None:
        given = request.headers.get(TOKEN_HEADER) or request.cookies.get(token_cookie(settings.port)) or ""
        if not hmac.compare_digest(given.encode(), token.encode()):
            detail = "this server needs its token: open the URL it printed at start (it ends in ?token=...)"
            return JSONResponse({"detail": detail}, status_code=401)
    if request.method == "POST":
        if request.headers.get("content-type", "").split(";")[0].strip() != "application/json":
            return JSONResponse({"detail": "POST a JSON body (Content-Type: application/json)"}, status_code=415)
        length = request.headers.get("content-length", "")
        if not length.isdigit() or int(length) > MAX_BODY:
            return JSONResponse({"detail": f"a request body is at most {MAX_BODY} bytes"}, status_code=413)
    return None


def _add_api_routes(app: FastAPI, task: TaskFolder) -> None:
    @app.get("/api/item")
    def item(labeller: Labeller):
        return view(task, labeller)

    @app.post("/api/judgement")
    def judgement(body: JSONBody):
        labeller, item_id = _field(body, "labeller", str), _field(body, "item", str)
        task.append(judgement_event(task, labeller, item_id, body))
        return view(task, labeller)

    @app.post("/api/skip")
    def skip(body: JSONBody):
        labeller, item_id = _field(body, "labeller", str), _field(body, "item", str)
        event = {"event": "skip", "labeller": labeller, "item": item_id, "reason": body.get("reason", "skip")}
        task.append({**event, "note": body.get("note", "")})
        return view(task, labeller)

    @app.post("/api/undo")
    def undo(body: JSONBody):
        labeller = task.check_labeller(_field(body, "labeller", str))
        task.undo(labeller)
        return view(task, labeller)


def _field(body: dict, name: str, kind: type):
    value = body.get(name) if isinstance(body, dict) else None
    if not isinstance(value, kind) or isinstance(value, bool):
        raise BadEvent(f"field {name!r}: expected a {kind.__name__}")
    return value


def view(task: TaskFolder, labeller: str) -> dict:
    """What the page shows ``labeller`` now: the next item (answers in display order, no model names) or
    None when every assigned item is done, progress, and whether there is a judgement to undo."""
    task.check_labeller(labeller)
    assigned = task.assigned(labeller)
    state = task.state()
    live = state.live(labeller)
    next_id = state.next_item(labeller, assigned)
    shown_item = None
    if next_id is not None:
        item = task.item(next_id)
        answers = [item.completions[i]["text"] for i in task.shown(next_id, labeller)]
        shown_item = {"id": item.id, "prompt": item.prompt, "answers": answers}
    return {
        "mode": task.mode,
        "allow_ties": task.allow_ties,
        "progress": {"done": sum(i in live for i in assigned), "total": len(assigned)},
        "can_undo": bool(live),
        "item": shown_item,
    }


def judgement_event(task: TaskFolder, labeller: str, item_id: str, body: dict) -> dict:
    """The log event of a judgement the page sent by shown position (0 = first shown / left)."""
    task.check_labeller(labeller)
    task.item(item_id)
    shown = task.shown(item_id, labeller)
    event = {"event": "judgement", "labeller": labeller, "item": item_id, "mode": task.mode, "shown": shown}

    def index(position) -> int:
        if isinstance(position, bool) or not isinstance(position, int) or not 0 <= position < len(shown):
            raise BadEvent(f"a shown position is an integer from 0 to {len(shown) - 1}, got {position!r}")
        return shown[position]

    if task.mode == "rank":
        groups = body.get("ranking")
        if not isinstance(groups, list) or not all(isinstance(g, list) for g in groups):
            raise BadEvent("field 'ranking': a list of groups of shown positions, best first")
        return {**event, "ranking": [[index(p) for p in group] for group in groups]}
    if task.mode == "score":
        scores = body.get("scores")
        if not isinstance(scores, list) or len(scores) != len(shown):
            raise BadEvent(f"field 'scores': one score per shown answer ({len(shown)})")
        return {**event, "scores": {str(index(p)): s for p, s in enumerate(scores)}}
    choice = body.get("choice")
    if task.mode == "compare":
        left = task.left(item_id, labeller)
        sides = {"left": left, "right": "B" if left == "A" else "A", "tie": "tie"}
        winner = sides.get(choice) if isinstance(choice, str) else None  # a list or dict: 400 below, not 500
        return {**event, "winner": winner, "left": left, "choice": choice}
    if choice == "tie":
        return {**event, "tie": True, "ranking": [list(shown)]}
    return {**event, "chosen": index(choice), "rejected": index(1 - choice if isinstance(choice, int) else choice)}


def page_url(host: str, port: int, token: str | None) -> str:
    name = f"[{host}]" if ":" in host else host
    return f"http://{name}:{port}/" + (f"?token={token}" if token else "")


def serve(task: TaskFolder, settings: LabelSettings, open_browser: bool = True) -> None:
    """Serve ``task`` until Ctrl+C or SIGTERM; prints the page's URL on one line first (port 0: a free one)."""
    import signal

    check_settings(settings)  # before listening
    family = socket.AF_INET6 if ":" in settings.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((settings.host, settings.port))
        sock.listen(128)  # connections wait in the queue from now on: the printed URL answers at once
    except OSError as err:
        sock.close()
        raise UserError(f"cannot listen on {settings.host}:{settings.port} ({err.strerror}); try --port 0") from err
    settings = replace(settings, port=sock.getsockname()[1])  # --port 0: the one bound, which names the cookie
    app = create_app(task, settings)
    url = page_url(settings.host, settings.port, settings.token)
    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off")
    server = uvicorn.Server(config)
    print(f"posttrain label: {task.mode} mode, {len(task.items)} items of {task.path}; open {url} (Ctrl+C stops)")
    sys.stdout.flush()
    if open_browser:
        threading.Thread(target=_open_when_started, args=(server, url), daemon=True).start()
    signal.signal(signal.SIGTERM, _interrupt)  # uvicorn shuts down, then re-raises it here: a clean stop
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:
        pass
    print(f"posttrain label: stopped; every judgement is in {task.log_path}")


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def _open_when_started(server, url: str) -> None:
    for _ in range(100):
        if server.started:
            webbrowser.open(url)
            return
        threading.Event().wait(0.05)
