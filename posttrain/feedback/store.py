"""A labelling task on disk: its folder, who labels what, the append-only judgement log, resume, undo, export.

    TASK/task.json          the settings (mode, models, seed, allow_ties, labellers, overlap, ...)
    TASK/candidates.jsonl   one item per line: {"id", "prompt", "completions": [{"text", "model"}], "meta"}
    TASK/judgements.jsonl   the log: one event per line, appended and fsync'd here and nowhere else

People's judgements are data that must not be lost, so the log is never rewritten: an undo is one more
line naming the event it takes back, and the state of a labeller is the replay of the log. Each append
takes an exclusive ``fcntl.flock`` on the log, re-reads it (to refuse a second judgement of an item, an
undo of something else than the last live event), writes one line with ``O_APPEND`` and fsyncs before it
returns; two threads or two servers on one folder therefore never interleave or overwrite. A process killed
mid-write leaves a torn last line: reading skips and counts it, and the next append starts on a new line.

What the labelling server (``posttrain label``) and the command line call:

    task = load_task(path, mode=None, allow_ties=None, labellers=None, overlap=None)   # TaskFolder
    task.check_labeller(name); task.assigned(name); task.shown(item_id, name); task.left(item_id, name)
    task.append(event) -> event (with id and time)   task.undo(name) -> the undo event
    task.state() -> LogState: .live(name), .next_item(...), ...   task.next_item(name)   task.progress(name)
    export(task, out, labeller=None) -> ExportSummary          label_export(task_dir, out, labeller) -> message

Errors: ``NotAllowed`` (a labeller not in the task's list, or an item not given to them: HTTP 403),
``BadEvent`` (a malformed or inconsistent event: 400), ``Conflict`` (the item is already judged, nothing to
undo: 409). All are ``UserError``s with a one-line message naming the field.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import random
import re
import threading
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from posttrain.errors import UserError

MODES = ("rank", "pair", "compare", "score")
SCORES = range(1, 6)  # the Likert scale of score mode
LOG = "judgements.jsonl"
CANDIDATES = "candidates.jsonl"
SETTINGS = "task.json"
NOTE_CHARS = 2000  # a skip's note is free text from a browser: bounded
NAME = re.compile(r"^[\w.@+-]{1,64}\Z")  # a labeller's name: letters, digits and a few marks ($ would let "ann\n" in)


class NotAllowed(UserError):
    """A labeller not listed in the task, or an item not assigned to them (the server answers 403)."""


class BadEvent(UserError):
    """An event that does not fit its mode, the item or the page that was shown (the server answers 400)."""


class Conflict(UserError):
    """An event that contradicts the log: an item judged twice, an undo with nothing to undo (409)."""


# --------------------------------------------------------------------------------------------------
# the task folder
# --------------------------------------------------------------------------------------------------


@dataclass
class Item:
    id: str
    prompt: str | list[dict]
    completions: list[dict]  # {"text": str, "model": str}, in the stored order (compare: A then B)
    meta: dict


@dataclass
class TaskFolder:
    """A labelling task: its folder, settings (task.json, with the command line's overrides) and items."""

    path: Path
    mode: str
    items: list[Item]
    settings: dict  # task.json as read (models, seed, k, sampling, created, ...)
    seed: int = 0
    allow_ties: bool = False
    labellers: list[str] = field(default_factory=list)  # empty: anyone, every item
    overlap: float = 0.2
    _assignment: dict[str, list[str]] | None = field(default=None, repr=False)
    _reader: LogReader = field(init=False, repr=False)
    _index: dict[str, Item] = field(init=False, repr=False)

    def __post_init__(self):
        self._reader = LogReader(self.path / LOG)
        self._index = {item.id: item for item in self.items}

    @property
    def log_path(self) -> Path:
        return self.path / LOG

    @property
    def models(self) -> dict:
        return self.settings.get("models", {})

    def item(self, item_id: str) -> Item:
        found = self._index.get(item_id)
        if found is None:
            # the file's name only: this reaches the page, which has no business with the server's folders
            raise BadEvent(f"field 'item': no item {item_id!r} in the task's {CANDIDATES}")
        return found

    def with_overrides(self, mode=None, allow_ties=None, labellers=None, overlap=None) -> TaskFolder:
        """The task with the command line's settings (None keeps task.json's), validated like task.json."""
        changed = {"mode": mode, "allow_ties": allow_ties, "labellers": labellers, "overlap": overlap}
        settings = {**self.settings, **{k: v for k, v in changed.items() if v is not None}}
        return _task(self.path, settings, self.items, "the command line")

    def check_labeller(self, name: str) -> str:
        """``name`` if it may label this task, else NotAllowed (a malformed name: BadEvent)."""
        if not isinstance(name, str) or not NAME.match(name):
            raise BadEvent(f"field 'labeller': {name!r} is not a name (1-64 letters, digits, . _ - @ +)")
        if self.labellers and name not in self.labellers:
            raise NotAllowed(f"labeller {name!r} is not one of this task's labellers ({', '.join(self.labellers)})")
        return name

    def assigned(self, labeller: str) -> list[str]:
        """The ids of the items ``labeller`` labels, in the candidates file's order."""
        self.check_labeller(labeller)
        if not self.labellers:
            return [item.id for item in self.items]
        if self._assignment is None:
            self._assignment = assign([i.id for i in self.items], self.labellers, self.overlap, self.seed)
        return self._assignment[labeller]

    def shown(self, item_id: str, labeller: str) -> list[int]:
        """The candidate indices the page shows ``labeller`` for ``item_id``, left to right / top to bottom.

        rank, score, compare: every candidate, shuffled by (seed, item, labeller). pair: two of them,
        the same two for every labeller (so that their choices can be compared: Cohen's / Fleiss' kappa),
        picked by (seed, item); their sides are shuffled per labeller."""
        k = len(self.item(item_id).completions)
        if self.mode != "pair":
            return display_order(self.seed, item_id, labeller, k)
        two = display_order(self.seed, item_id, "", k)[:2]
        return two if display_order(self.seed, item_id, labeller, 2) == [0, 1] else two[::-1]

    def left(self, item_id: str, labeller: str) -> str:
        """compare mode: the model ("A" or "B") shown on the left to ``labeller``."""
        return self.item(item_id).completions[self.shown(item_id, labeller)[0]]["model"]

    def state(self) -> LogState:
        """The replay of the log as it is now (read under a shared lock: never half an append)."""
        if not self.log_path.exists():
            return replay(Log([]))
        fd = os.open(self.log_path, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
            return replay(self._reader.read(fd)[0])
        finally:
            os.close(fd)

    def next_item(self, labeller: str) -> str | None:
        """Where ``labeller`` resumes: the first assigned item without a live judgement or skip; None when done."""
        return self.state().next_item(labeller, self.assigned(labeller))

    def progress(self, labeller: str) -> tuple[int, int]:
        """(items done, items assigned) of ``labeller``; a skipped item counts as done."""
        assigned = self.assigned(labeller)
        live = self.state().live(labeller)
        return sum(item in live for item in assigned), len(assigned)

    def append(self, event: dict) -> dict:
        """Validate ``event``, give it an ``id`` and ``time`` when it has none, and append it to the log
        (flushed and fsync'd when this returns). Returns the event as written."""
        return append_event(self, event)

    def undo(self, labeller: str) -> dict:
        """Take back ``labeller``'s last live judgement or skip; Conflict when there is none."""
        return append_event(self, {"event": "undo", "labeller": labeller})


def _read_json(path: Path) -> dict:
    if not path.is_file():
        raise UserError(f"{path}: missing; a task folder holds task.json and candidates.jsonl (posttrain sample)")
    try:
        settings = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise UserError(f"{path}: not valid JSON ({err})") from err
    if not isinstance(settings, dict):
        raise UserError(f"{path}: expected a JSON object of settings")
    return settings


def load_task(path: str | Path, mode=None, allow_ties=None, labellers=None, overlap=None) -> TaskFolder:
    """Read and check the task folder ``path``; the other arguments override task.json (None keeps it)."""
    path = Path(path)
    if not path.is_dir():
        raise UserError(f"no task folder {path} (make one with posttrain sample)")
    settings = _read_json(path / SETTINGS)
    task = _task(path, settings, read_items(path / CANDIDATES), str(path / SETTINGS))
    return task.with_overrides(mode, allow_ties, labellers, overlap)


def _task(path: Path, settings: dict, items: list[Item], where: str) -> TaskFolder:
    """The TaskFolder of ``settings``, each one checked with an error naming the field and ``where``."""

    def bad(name: str, allowed: str):
        return UserError(f"{where}: field {name!r}: {settings.get(name)!r} is not allowed; use {allowed}")

    mode = settings.get("mode")
    if mode not in MODES:
        raise bad("mode", " | ".join(MODES))
    seed = settings.get("seed", 0)
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise bad("seed", "an integer")
    allow_ties = settings.get("allow_ties", False)
    if not isinstance(allow_ties, bool):
        raise bad("allow_ties", "true or false")
    labellers = settings.get("labellers", [])
    if not isinstance(labellers, list) or not all(isinstance(n, str) and NAME.match(n) for n in labellers):
        raise bad("labellers", "a list of names (1-64 letters, digits, . _ - @ +), [] for anyone")
    if len(set(labellers)) < len(labellers):
        raise bad("labellers", "each name once")
    overlap = settings.get("overlap", 0.2)
    if isinstance(overlap, bool) or not isinstance(overlap, int | float) or not 0 <= overlap <= 1:
        raise bad("overlap", "a share between 0 and 1")
    _check_items_fit(items, mode, settings, where)
    return TaskFolder(path, mode, items, settings, seed, allow_ties, list(labellers), float(overlap))


def _check_items_fit(items: list[Item], mode: str, settings: dict, where: str) -> None:
    """compare needs exactly the two completions A and B, named in ``models``; the rest K >= 2."""
    if mode == "compare":
        models = settings.get("models")
        if not isinstance(models, dict) or set(models) != {"A", "B"}:
            raise UserError(f"{where}: field 'models': a compare task names its two models as {{'A': ..., 'B': ...}}")
        for item in items:
            if [c["model"] for c in item.completions] != ["A", "B"]:
                raise UserError(
                    f"{where}: field 'mode': compare needs two completions per item, models 'A' then 'B'; "
                    f"item {item.id!r} has {[c['model'] for c in item.completions]}"
                )


def read_items(path: Path) -> list[Item]:
    """The items of candidates.jsonl; a bad line raises a UserError naming ``file:line`` and the field."""
    if not path.is_file():
        raise UserError(f"{path}: missing; write it with posttrain sample")
    items, seen = [], set()
    for n, line in enumerate(path.read_bytes().splitlines(), start=1):
        if line.strip():
            item = _item(line, f"{path}:{n}")
            if item.id in seen:
                raise UserError(f"{path}:{n}: field 'id': {item.id!r} repeats an earlier item's id")
            seen.add(item.id)
            items.append(item)
    if not items:
        raise UserError(f"{path}: no items")
    return items


def _item(line: bytes, where: str) -> Item:
    try:
        data = json.loads(line.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise UserError(f"{where}: not a JSON line ({err})") from err
    if not isinstance(data, dict):
        raise UserError(f"{where}: expected a JSON object")
    item_id = data.get("id")
    if not isinstance(item_id, str) or not item_id or len(item_id) > 200:
        raise UserError(f"{where}: field 'id': a non-empty string (at most 200 characters)")
    prompt = data.get("prompt")
    chat = isinstance(prompt, list) and all(isinstance(m, dict) and isinstance(m.get("content"), str) for m in prompt)
    if not (isinstance(prompt, str) or (chat and prompt)):
        raise UserError(f"{where}: field 'prompt': a string or a list of chat messages {{role, content}}")
    completions = data.get("completions")
    if not isinstance(completions, list) or len(completions) < 2:
        raise UserError(f"{where}: field 'completions': a list of at least 2 {{text, model}} objects")
    for j, c in enumerate(completions):
        if not isinstance(c, dict) or not isinstance(c.get("text"), str) or not isinstance(c.get("model"), str):
            raise UserError(f"{where}: field 'completions[{j}]': an object with a string 'text' and 'model'")
    meta = data.get("meta", {})
    if not isinstance(meta, dict):
        raise UserError(f"{where}: field 'meta': an object")
    return Item(item_id, prompt, completions, meta)


# --------------------------------------------------------------------------------------------------
# who sees what
# --------------------------------------------------------------------------------------------------


def _unit(*parts) -> float:
    """A number in [0, 1) from ``parts``, the same in every process and Python (unlike ``hash``)."""
    digest = hashlib.sha256("\0".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def display_order(task_seed: int, item_id: str, labeller: str, k: int) -> list[int]:
    """A permutation of range(k) fixed by (task seed, item, labeller): a reload shows the same order."""
    order = list(range(k))
    random.Random(_unit("order", task_seed, item_id, labeller)).shuffle(order)
    return order


def assign(item_ids: list[str], labellers: list[str], overlap: float, seed: int) -> dict[str, list[str]]:
    """Which items each labeller labels, each list in ``item_ids``' order; {} when ``labellers`` is empty
    (everyone labels every item).

    An item is in the overlap set, labelled by everyone, when its seeded hash falls below ``overlap``; the
    others go to one labeller each, dealt in turn (from a seeded first labeller), so that the labellers'
    shares differ by at most one item."""
    if not labellers:
        return {}
    given: dict[str, list[str]] = {name: [] for name in labellers}
    turn = int(_unit("first", seed) * len(labellers))
    for item_id in item_ids:
        if _unit("overlap", seed, item_id) < overlap:
            for name in labellers:
                given[name].append(item_id)
        else:
            given[labellers[turn % len(labellers)]].append(item_id)
            turn += 1
    return given


# --------------------------------------------------------------------------------------------------
# the log
# --------------------------------------------------------------------------------------------------


@dataclass
class Log:
    events: list[dict]
    torn: int = 0  # lines that are not a JSON object: a write cut short by a crash


class LogReader:
    """The log's events, read incrementally: the log only grows, so the complete lines parsed once are
    kept and each read parses only what was appended since (a server re-reads the log on every request).
    A last line without its newline (torn by a crash) is parsed again on each read, never kept."""

    def __init__(self, path: Path):
        self.path = path
        self._lock = threading.Lock()  # one server's threads share this cache
        self._file: tuple[int, int] | None = None  # (device, inode) of the file the cache is of
        self._offset, self._events, self._torn = 0, [], 0

    def read(self, fd: int) -> tuple[Log, bool]:
        """(the log, whether its last line lacks the newline) from ``fd``, which the caller holds locked."""
        st = os.fstat(fd)
        with self._lock:
            if (st.st_dev, st.st_ino) != self._file or st.st_size < self._offset:  # another file: start over
                self._file, self._offset, self._events, self._torn = (st.st_dev, st.st_ino), 0, [], 0
            data = _read_from(fd, self._offset)
            end = data.rfind(b"\n") + 1
            whole = _parse_log(data[:end])
            self._events += whole.events
            self._torn += whole.torn
            self._offset += end
            tail = _parse_log(data[end:])
            return Log(self._events + tail.events, self._torn + tail.torn), end < len(data)


def _parse_log(data: bytes) -> Log:
    events, torn = [], 0
    for line in data.split(b"\n"):
        if not line.strip():
            continue
        try:
            event = json.loads(line.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            event = None
        if isinstance(event, dict) and isinstance(event.get("labeller"), str):
            events.append(event)
        else:
            torn += 1
    return Log(events, torn)


@dataclass
class LogState:
    """The log replayed: each labeller's live judgements and skips, in the order they were made."""

    by_labeller: dict[str, list[dict]]
    torn: int = 0

    def live(self, labeller: str) -> dict[str, dict]:
        """item id -> ``labeller``'s live event (judgement or skip) on it."""
        return {event["item"]: event for event in self.by_labeller.get(labeller, [])}

    def judgements(self, labeller: str | None = None) -> list[dict]:
        """The live judgements (skips left out) of ``labeller``, or of everyone, in log order per labeller."""
        names = [labeller] if labeller is not None else sorted(self.by_labeller)
        return [e for name in names for e in self.by_labeller.get(name, []) if e["event"] == "judgement"]

    def next_item(self, labeller: str, assigned: list[str]) -> str | None:
        live = self.live(labeller)
        return next((item for item in assigned if item not in live), None)


def replay(log: Log) -> LogState:
    """Each labeller's live events: judgements and skips, less those an undo took back."""
    by_labeller: dict[str, list[dict]] = {}
    for event in log.events:
        events = by_labeller.setdefault(event["labeller"], [])
        if event.get("event") == "undo":
            events[:] = [e for e in events if e.get("id") != event.get("target")]
        elif event.get("event") in ("judgement", "skip"):
            events.append(event)
    return LogState(by_labeller, log.torn)


def append_event(task: TaskFolder, event: dict) -> dict:
    """``TaskFolder.append``: validate against the log under an exclusive lock, then write one line."""
    if not isinstance(event, dict):
        raise BadEvent(f"an event is a JSON object, got {type(event).__name__}")
    event, chosen_id = {**event}, "id" in event
    event.setdefault("id", uuid.uuid4().hex)
    event.setdefault("time", datetime.now(UTC).isoformat(timespec="milliseconds"))
    task.path.mkdir(parents=True, exist_ok=True)
    created = not task.log_path.exists()
    fd = os.open(task.log_path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # held until close: one writer at a time, threads and processes alike
        log, open_line = task._reader.read(fd)
        if chosen_id and any(e.get("id") == event["id"] for e in log.events):
            raise Conflict(f"field 'id': event {event['id']} is already in the log")
        check_event(task, event, replay(log))
        line = json.dumps(event, ensure_ascii=False).encode("utf-8") + b"\n"
        if open_line:  # a torn last line stays alone on its line
            line = b"\n" + line
        _write_all(fd, line)
        os.fsync(fd)
    finally:
        os.close(fd)
    if created:  # the new file's name must survive a crash too
        _fsync_dir(task.path)
    return event


def _read_from(fd: int, offset: int) -> bytes:
    os.lseek(fd, offset, os.SEEK_SET)
    chunks = []
    while chunk := os.read(fd, 1 << 20):
        chunks.append(chunk)
    return b"".join(chunks)


def _write_all(fd: int, data: bytes) -> None:
    while data:
        data = data[os.write(fd, data) :]


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# --------------------------------------------------------------------------------------------------
# checking an event
# --------------------------------------------------------------------------------------------------

COMMON = {"event", "id", "labeller", "time"}
FIELDS = {
    "skip": COMMON | {"item", "reason", "note"},
    "undo": COMMON | {"target", "item"},
    ("judgement", "rank"): COMMON | {"item", "mode", "shown", "ranking"},
    ("judgement", "pair"): COMMON | {"item", "mode", "shown", "chosen", "rejected", "tie", "ranking"},
    ("judgement", "compare"): COMMON | {"item", "mode", "shown", "winner", "left", "choice"},
    ("judgement", "score"): COMMON | {"item", "mode", "shown", "scores"},
}


def check_event(task: TaskFolder, event: dict, state: LogState) -> None:
    """Raise BadEvent / NotAllowed / Conflict unless ``event`` may be appended to a log replayed as ``state``.
    An undo without ``target`` gets the labeller's last live event as its target (and its item)."""
    kind = event.get("event")
    if kind not in ("judgement", "skip", "undo"):
        raise BadEvent(f"field 'event': {kind!r}; use judgement, skip or undo")
    labeller = task.check_labeller(event.get("labeller"))
    if not isinstance(event["id"], str) or not re.fullmatch(r"[0-9a-f]{32}", event["id"]):
        raise BadEvent(f"field 'id': {event['id']!r} is not a uuid4 hex string")
    if not isinstance(event["time"], str):
        raise BadEvent("field 'time': an ISO time string")
    allowed = FIELDS[kind if kind != "judgement" else (kind, task.mode)]
    if extra := sorted(set(event) - allowed):
        raise BadEvent(f"field {extra[0]!r}: not a field of a {kind} event in {task.mode} mode")
    if kind == "undo":
        _check_undo(event, state.by_labeller.get(labeller, []))
        return
    item_id = event.get("item")
    if not isinstance(item_id, str):
        raise BadEvent("field 'item': the item's id (a string)")
    task.item(item_id)
    if item_id not in task.assigned(labeller):
        raise NotAllowed(f"item {item_id!r} is not assigned to labeller {labeller!r}")
    if item_id in state.live(labeller):
        raise Conflict(f"item {item_id!r} already has a live judgement or skip by {labeller!r}; undo it first")
    if kind == "skip":
        _check_skip(event)
        return
    other = {e["mode"] for events in state.by_labeller.values() for e in events if e["event"] == "judgement"}
    if other - {task.mode}:
        raise BadEvent(
            f"field 'mode': this log holds {'/'.join(sorted(other))} judgements; label the items in {task.mode} "
            "mode in a copy of the task folder without judgements.jsonl (one mode per task)"
        )
    _check_judgement(task, event, task.shown(item_id, labeller))


def _check_undo(event: dict, live: list[dict]) -> None:
    if not live:
        raise Conflict(f"labeller {event['labeller']!r} has nothing to undo")
    last = live[-1]
    if event.setdefault("target", last["id"]) != last["id"]:
        raise Conflict(f"field 'target': only the labeller's last live event ({last['id']}) can be undone")
    if event.setdefault("item", last["item"]) != last["item"]:
        raise BadEvent(f"field 'item': the undone event is on item {last['item']!r}")


def _check_skip(event: dict) -> None:
    if event.get("reason") not in ("skip", "flag"):
        raise BadEvent(f"field 'reason': {event.get('reason')!r}; use skip or flag")
    note = event.setdefault("note", "")
    if not isinstance(note, str) or len(note) > NOTE_CHARS:
        raise BadEvent(f"field 'note': a string of at most {NOTE_CHARS} characters")


def _check_judgement(task: TaskFolder, event: dict, shown: list[int]) -> None:
    if event.get("mode") != task.mode:
        raise BadEvent(f"field 'mode': {event.get('mode')!r}, but this task is labelled in {task.mode} mode")
    if event.get("shown") != shown:
        raise BadEvent(f"field 'shown': {event.get('shown')!r} is not the order this labeller was shown ({shown})")
    check = {"rank": _check_rank, "pair": _check_pair, "compare": _check_compare, "score": _check_score}
    check[task.mode](event, shown, task.allow_ties)


def _index_list(value, name: str) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in value):
        raise BadEvent(f"field {name!r}: a list of candidate indices")
    return value


def _check_ranking(ranking, shown: list[int], allow_ties: bool) -> None:
    """``ranking``: groups of candidate indices, best first, together exactly the shown candidates, once each."""
    if not isinstance(ranking, list) or not ranking:
        raise BadEvent("field 'ranking': a list of groups of candidate indices, best first")
    groups = [_index_list(group, "ranking") for group in ranking]
    if any(not group for group in groups):
        raise BadEvent("field 'ranking': an empty group")
    flat = [i for group in groups for i in group]
    if sorted(flat) != sorted(shown):
        raise BadEvent(f"field 'ranking': must hold each shown candidate {sorted(shown)} exactly once, got {flat}")
    if not allow_ties and any(len(group) > 1 for group in groups):
        raise BadEvent("field 'ranking': ties are not allowed in this task (allow_ties: false)")


def _check_rank(event: dict, shown: list[int], allow_ties: bool) -> None:
    _check_ranking(event.get("ranking"), shown, allow_ties)


def _check_pair(event: dict, shown: list[int], allow_ties: bool) -> None:
    if event.get("tie") is not None:
        if event["tie"] is not True or "chosen" in event or "rejected" in event:
            raise BadEvent("field 'tie': true, with both candidates in 'ranking' and no chosen/rejected")
        _check_ranking(event.get("ranking"), shown, allow_ties)
        if len(event["ranking"]) != 1:
            raise BadEvent("field 'ranking': a tie is one group of both candidates")
        return
    if "ranking" in event:
        raise BadEvent("field 'ranking': only a tie lists 'ranking' in pair mode")
    chosen, rejected = event.get("chosen"), event.get("rejected")
    if sorted(_index_list([chosen, rejected], "chosen")) != sorted(shown):
        raise BadEvent(f"fields 'chosen', 'rejected': the two shown candidates {shown}, got {chosen}, {rejected}")


def _check_compare(event: dict, shown: list[int], allow_ties: bool) -> None:
    winner, left, choice = event.get("winner"), event.get("left"), event.get("choice")
    shown_left = "AB"[shown[0]]  # compare items store A then B
    if left != shown_left:
        raise BadEvent(f"field 'left': model {shown_left!r} was shown on the left, got {left!r}")
    if choice not in ("left", "right", "tie"):
        raise BadEvent(f"field 'choice': {choice!r}; use left, right or tie")
    if choice == "tie" and not allow_ties:
        raise BadEvent("field 'choice': ties are not allowed in this task (allow_ties: false)")
    right = "B" if left == "A" else "A"
    expected = {"left": left, "right": right, "tie": "tie"}[choice]
    if winner != expected:
        raise BadEvent(
            f"field 'winner': choice {choice!r} with {left!r} on the left means {expected!r}, got {winner!r}"
        )


def _check_score(event: dict, shown: list[int], allow_ties: bool) -> None:
    scores = event.get("scores")
    if not isinstance(scores, dict) or set(scores) != {str(i) for i in shown}:
        raise BadEvent(f"field 'scores': an object with one score per shown candidate {sorted(map(str, shown))}")
    for key, value in scores.items():
        if isinstance(value, bool) or not isinstance(value, int) or value not in SCORES:
            raise BadEvent(f"field 'scores.{key}': {value!r}; use an integer from 1 to 5")


# --------------------------------------------------------------------------------------------------
# export: rows that posttrain rm reads
# --------------------------------------------------------------------------------------------------


@dataclass
class ExportSummary:
    path: Path
    rows: int = 0
    judgements: int = 0
    kind: str = "ranking"  # ranking rows {"prompt", "responses"} or preference rows {"prompt", "chosen", "rejected"}
    tied_judgements: int = 0  # rank: judgements with ties, written as their strictly ordered pairs
    ties_dropped: int = 0  # pair: ties carry no preference
    identical_dropped: int = 0  # rows whose compared texts were the same (rm refuses them)

    def message(self) -> str:
        parts = [f"wrote {self.rows} {self.kind} rows from {self.judgements} judgements to {self.path}"]
        if self.tied_judgements:
            parts.append(f"{self.tied_judgements} judgements with ties as their ordered pairs (K = 2 rankings)")
        if self.ties_dropped:
            parts.append(f"{self.ties_dropped} ties dropped")
        if self.identical_dropped:
            parts.append(f"{self.identical_dropped} rows of identical texts dropped")
        return "; ".join(parts) + f" (train: posttrain rm data.path={self.path})"


def export(task: TaskFolder, out: str | Path, labeller: str | None = None) -> ExportSummary:
    """Write the live judgements (of ``labeller``, or of everyone) as rows that ``posttrain rm`` reads, one
    row per (labeller, item) judgement, in log order.

    rank: a ranking row {"prompt", "responses": [best, ..., worst]}; a judgement with ties gives instead
    its strictly ordered pairs, each a ranking row of K = 2 (rm reads one kind of row per file, and a pair
    is a ranking of two). pair: {"prompt", "chosen", "rejected"}, ties dropped. score: a preference row
    for every two candidates of different scores. compare: refused (it judges models, not answers).
    A response that repeats a better one's text is left out (rm refuses repeated responses)."""
    if task.mode == "compare":
        raise UserError(
            f"{task.path}: a compare task judges two models, not answers to train on; "
            f"see its win rate with posttrain label stats {task.path}"
        )
    state = task.state()
    if labeller is not None:
        task.check_labeller(labeller)
    judgements = state.judgements(labeller)
    summary = ExportSummary(Path(out), kind="ranking" if task.mode == "rank" else "preference")
    rows = [row for event in judgements for row in _rows(task, event, summary)]
    who = f" by {labeller!r}" if labeller else ""
    if not rows:
        raise UserError(f"{task.path}: no judgements{who} to export ({len(judgements)} judgements, no usable row)")
    summary.judgements, summary.rows = len(judgements), len(rows)
    write_atomically(Path(out), "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))
    return summary


def _rows(task: TaskFolder, event: dict, summary: ExportSummary) -> list[dict]:
    """The rows of one judgement (counting in ``summary`` what it leaves out)."""
    item = task.item(event["item"])
    texts = [c["text"] for c in item.completions]
    if task.mode == "rank":
        groups = event["ranking"]
        if all(len(group) == 1 for group in groups):
            responses = list(dict.fromkeys(texts[group[0]] for group in groups))  # a repeated text keeps its best
            if len(responses) < 2:
                summary.identical_dropped += 1
                return []
            return [{"prompt": item.prompt, "responses": responses}]
        summary.tied_judgements += 1
        pairs = _ordered_pairs(groups)
    elif task.mode == "pair":
        if event.get("tie"):
            summary.ties_dropped += 1
            return []
        pairs = [(event["chosen"], event["rejected"])]
    else:
        scores = {int(i): s for i, s in event["scores"].items()}
        pairs = [(i, j) for i in scores for j in scores if scores[i] > scores[j]]
    rows = []
    for better, worse in pairs:
        if texts[better] == texts[worse]:
            summary.identical_dropped += 1
        elif task.mode == "rank":
            rows.append({"prompt": item.prompt, "responses": [texts[better], texts[worse]]})
        else:
            rows.append({"prompt": item.prompt, "chosen": texts[better], "rejected": texts[worse]})
    return rows


def _ordered_pairs(groups: list[list[int]]) -> list[tuple[int, int]]:
    """(better, worse) for every two candidates in different groups of a ranking with ties."""
    return [(a, b) for i, high in enumerate(groups) for low in groups[i + 1 :] for a in high for b in low]


def write_atomically(path: Path, text: str) -> None:
    """Write ``text`` through a temporary file, flushed to disk, and a rename: a crash leaves the old file or
    the whole new one, never half of it. (The task folder's other files: candidates, task.json, stats.json,
    exports; the log is only ever appended to.)"""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def label_export(task_dir: str | Path, out: str | Path, labeller: str | None = None) -> str:
    """``posttrain label export TASK --out FILE [--labeller NAME]``: the line to print."""
    return export(load_task(task_dir), out, labeller).message()
