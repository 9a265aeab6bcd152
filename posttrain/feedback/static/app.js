// The labelling page of `posttrain label`: one item at a time, judged by keys or by the mouse.
// Model text is hostile input: it only ever goes into the page through textContent, never as HTML.
// The page knows answers by their shown position only; the server maps positions to candidates (and, in
// compare mode, to models), so nothing here can tell which model wrote which answer.
"use strict";

const NAME_KEY = "posttrain-label-name";
const $ = (id) => document.getElementById(id);
const state = { labeller: "", view: null, groups: [], scores: [], active: 0, busy: false };

async function api(method, path, body) {
  const options = { method, credentials: "same-origin", headers: {} };
  if (body !== undefined) {
    options.headers["Content-Type"] = "application/json";
    options.body = JSON.stringify(body);
  }
  const response = await fetch(path, options);
  const data = await response.json().catch(() => ({}));
  if (!response.ok) {
    const error = new Error(data.detail || `${response.status} ${response.statusText}`);
    error.status = response.status;
    throw error;
  }
  return data;
}

function show(section) {
  for (const id of ["login", "work", "done"]) $(id).hidden = id !== section;
}

function setError(text) {
  $("error").textContent = text || "";
}

function el(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

// ---- the labeller's name -------------------------------------------------------------------------

function askName(message) {
  show("login");
  $("who").hidden = true;
  $("login-error").textContent = message || "";
  $("name").value = state.labeller || "";
  $("name").focus();
}

async function login(name) {
  state.labeller = name.trim();
  try {
    await load();
    localStorage.setItem(NAME_KEY, state.labeller);
    $("labeller").textContent = state.labeller;
    $("who").hidden = false;
  } catch (error) {
    if (error.status === 403 || error.status === 400) {
      localStorage.removeItem(NAME_KEY);
      askName(error.message);
    } else {
      askName(`The server answered: ${error.message}`);
    }
  }
}

// ---- loading and showing an item -----------------------------------------------------------------

async function load() {
  render(await api("GET", `api/item?labeller=${encodeURIComponent(state.labeller)}`));
}

function render(view) {
  state.view = view;
  state.groups = [];
  state.scores = [];
  state.active = 0;
  setError("");
  $("flag-form").hidden = true;
  // keys go to the page, not to a button or field that kept the focus (Enter would click it again)
  if (document.activeElement && document.activeElement !== document.body) document.activeElement.blur();
  $("mode").textContent = `${view.mode} mode`;
  $("item-id").textContent = view.item ? `item ${view.item.id}` : "";
  const { done, total } = view.progress;
  $("progress").textContent = view.item ? `${done + 1} of ${total}` : `${done} of ${total}`;
  if (!view.item) {
    $("done-text").textContent = `You have judged or skipped all ${total} items. Thank you.`;
    $("done-undo").hidden = !view.can_undo;
    show("done");
    return;
  }
  show("work");
  $("undo").disabled = !view.can_undo;
  renderPrompt(view.item.prompt);
  state.scores = view.item.answers.map(() => 0);
  $("instructions").textContent = INSTRUCTIONS[view.mode](view);
  $("tie").hidden = !(view.allow_ties && view.mode !== "score");
  $("submit").hidden = view.mode === "pair" || view.mode === "compare";
  $("ranking-box").hidden = view.mode !== "rank";
  $("pool-title").textContent = view.mode === "rank" ? "Answers to rank" : "Answers";
  drawCards();
}

function renderPrompt(prompt) {
  const box = $("prompt");
  box.replaceChildren();
  if (typeof prompt === "string") {
    box.append(el("div", "text", prompt));
    return;
  }
  for (const message of prompt) {
    const row = el("div", "message");
    row.append(el("span", "role", `${message.role}: `), el("span", "text", String(message.content)));
    box.append(row);
  }
}

const INSTRUCTIONS = {
  rank: (v) =>
    "Press the answers' numbers best first (or drag them into the ranking); Backspace takes back the last pick" +
    (v.allow_ties ? ", t ties the last pick with the one before" : "") +
    "; Enter submits. s skip, f flag, u undo the last judgement.",
  pair: (v) => `Press 1 or 2 for the better answer${v.allow_ties ? ", t for a tie" : ""}. s skip, f flag, u undo.`,
  compare: (v) =>
    `Press 1 (left) or 2 (right) for the better answer${v.allow_ties ? ", t for a tie" : ""}. s skip, f flag, u undo.`,
  score: () =>
    "Score each answer from 1 (bad) to 5 (excellent): a digit scores the highlighted answer and moves on; " +
    "arrows move; Enter submits. s skip, f flag, u undo.",
};

function answerLabel(pos) {
  if (state.view.mode === "compare") return pos === 0 ? "Left (1)" : "Right (2)";
  return `Answer ${pos + 1}`;
}

function card(pos, tag) {
  const node = el(tag, "card");
  node.dataset.pos = String(pos);
  const head = el("div", "card-head");
  head.append(el("span", "label", answerLabel(pos)), el("span", "badge"));
  node.append(head, el("div", "text", state.view.item.answers[pos]));
  return node;
}

function drawCards() {
  const mode = state.view.mode;
  const ranked = state.groups.flat();
  const pool = $("pool");
  pool.replaceChildren();
  pool.classList.toggle("side-by-side", mode === "pair" || mode === "compare");
  $("ranking").replaceChildren();
  state.view.item.answers.forEach((_, pos) => {
    if (mode === "rank" && ranked.includes(pos)) return;
    const node = card(pos, "div");
    if (mode === "rank") makeDraggable(node);
    if (mode === "pair" || mode === "compare") addChooseButton(node, pos);
    if (mode === "score") addScoreButtons(node, pos);
    pool.append(node);
  });
  if (mode === "rank") drawRanking();
}

function drawRanking() {
  const list = $("ranking");
  state.groups.forEach((group, rank) => {
    for (const pos of group) {
      const node = card(pos, "li");
      node.classList.add("ranked");
      node.querySelector(".badge").textContent = group.length > 1 ? `#${rank + 1} (tie)` : `#${rank + 1}`;
      makeDraggable(node);
      list.append(node);
    }
  });
}

function addChooseButton(node, pos) {
  const button = el("button", "choose", "This one is better");
  button.type = "button";
  button.addEventListener("click", () => choose(pos));
  node.append(button);
}

function addScoreButtons(node, pos) {
  node.classList.toggle("active", pos === state.active);
  node.querySelector(".badge").textContent = state.scores[pos] ? `score ${state.scores[pos]}` : "";
  const row = el("div", "scores");
  for (let s = 1; s <= 5; s++) {
    const button = el("button", state.scores[pos] === s ? "picked" : "", String(s));
    button.type = "button";
    button.addEventListener("click", () => setScore(pos, s));
    row.append(button);
  }
  node.append(row);
}

// ---- rank: picks, ties and drag and drop ---------------------------------------------------------

function pick(pos) {
  if (pos >= state.view.item.answers.length || state.groups.flat().includes(pos)) return;
  state.groups.push([pos]);
  drawCards();
}

function takeBack() {
  const last = state.groups[state.groups.length - 1];
  if (!last) return;
  last.pop();
  if (last.length === 0) state.groups.pop();
  drawCards();
}

function tieWithPrevious() {
  if (state.groups.length < 2 || state.groups[state.groups.length - 1].length !== 1) return;
  const last = state.groups.pop();
  state.groups[state.groups.length - 1].push(...last);
  drawCards();
}

function place(pos, beforePos) {
  // a dragged answer leaves its group and stands alone, before the answer it was dropped on (or last)
  state.groups = state.groups.map((g) => g.filter((p) => p !== pos)).filter((g) => g.length);
  if (beforePos !== null) {
    const at = state.groups.findIndex((g) => g.includes(beforePos));
    state.groups.splice(at < 0 ? state.groups.length : at, 0, [pos]);
  } else {
    state.groups.push([pos]);
  }
  drawCards();
}

function unrank(pos) {
  state.groups = state.groups.map((g) => g.filter((p) => p !== pos)).filter((g) => g.length);
  drawCards();
}

function makeDraggable(node) {
  node.draggable = true;
  node.addEventListener("dragstart", (event) => {
    event.dataTransfer.setData("text/plain", node.dataset.pos);
    event.dataTransfer.effectAllowed = "move";
  });
}

function draggedPos(event) {
  const pos = Number.parseInt(event.dataTransfer.getData("text/plain"), 10);
  return Number.isInteger(pos) && pos >= 0 && pos < state.view.item.answers.length ? pos : null;
}

function setUpDropTargets() {
  for (const id of ["ranking", "pool"]) {
    $(id).addEventListener("dragover", (event) => {
      if (state.view && state.view.mode === "rank") event.preventDefault();
    });
  }
  $("ranking").addEventListener("drop", (event) => {
    event.preventDefault();
    const pos = draggedPos(event);
    if (pos === null) return;
    const target = event.target.closest("li.card");
    const before = target && Number(target.dataset.pos) !== pos ? Number(target.dataset.pos) : null;
    place(pos, before);
  });
  $("pool").addEventListener("drop", (event) => {
    event.preventDefault();
    const pos = draggedPos(event);
    if (pos !== null) unrank(pos);
  });
}

// ---- sending a judgement, a skip or an undo ------------------------------------------------------

async function send(path, body) {
  if (state.busy) return;
  state.busy = true;
  try {
    render(await api("POST", path, { labeller: state.labeller, ...body }));
  } catch (error) {
    setError(error.message);
    if (error.status === 409) await load(); // the item changed under us (another tab): show the current one
  } finally {
    state.busy = false;
  }
}

function submitRanking() {
  const answers = state.view.item.answers.length;
  const unranked = [...Array(answers).keys()].filter((p) => !state.groups.flat().includes(p));
  if (unranked.length === 1) state.groups.push(unranked);
  else if (unranked.length > 1) {
    setError(`Rank every answer first: ${unranked.length} left.`);
    return;
  }
  send("api/judgement", { item: state.view.item.id, ranking: state.groups });
}

function choose(choice) {
  const mode = state.view.mode;
  if (choice === "tie" && !state.view.allow_ties) return;
  if (mode === "compare") choice = choice === "tie" ? "tie" : ["left", "right"][choice];
  send("api/judgement", { item: state.view.item.id, choice });
}

function setScore(pos, score) {
  state.scores[pos] = score;
  const next = state.scores.findIndex((s) => s === 0);
  state.active = next < 0 ? pos : next;
  drawCards();
}

function submitScores() {
  const missing = state.scores.filter((s) => s === 0).length;
  if (missing) {
    setError(`Score every answer first: ${missing} left.`);
    return;
  }
  send("api/judgement", { item: state.view.item.id, scores: state.scores });
}

function submit() {
  if (state.view.mode === "rank") submitRanking();
  else if (state.view.mode === "score") submitScores();
}

function tie() {
  if (state.view.mode === "rank") {
    if (state.view.allow_ties) tieWithPrevious();
  } else if (state.view.mode !== "score") choose("tie");
}

function openFlag() {
  $("flag-form").hidden = false;
  $("flag-note").value = "";
  $("flag-note").focus();
}

function undo() {
  if (state.view && state.view.can_undo) send("api/undo", {});
}

// ---- keys ----------------------------------------------------------------------------------------

function onKey(event) {
  if (event.target.closest && event.target.closest("input, textarea")) {
    if (event.key === "Escape") $("flag-form").hidden = true;
    return;
  }
  if (!state.view || state.busy || event.altKey || event.metaKey) return;
  const key = event.key;
  if ((key === "u" && !event.ctrlKey) || (key === "z" && event.ctrlKey)) {
    event.preventDefault();
    undo();
    return;
  }
  if (event.ctrlKey || !state.view.item) return;
  const handled = itemKey(key);
  if (handled) event.preventDefault();
}

function itemKey(key) {
  const mode = state.view.mode;
  const digit = /^[1-9]$/.test(key) ? Number(key) : 0;
  if (key === "s") send("api/skip", { item: state.view.item.id, reason: "skip", note: "" });
  else if (key === "f") openFlag();
  else if (key === "t") tie();
  else if (key === "Enter") submit();
  else if (mode === "rank" && key === "Backspace") takeBack();
  else if (mode === "rank" && digit) pick(digit - 1);
  else if ((mode === "pair" || mode === "compare") && (digit === 1 || digit === 2)) choose(digit - 1);
  else if (mode === "score" && digit >= 1 && digit <= 5) setScore(state.active, digit);
  else if (mode === "score" && (key === "ArrowDown" || key === "ArrowRight")) moveActive(1);
  else if (mode === "score" && (key === "ArrowUp" || key === "ArrowLeft")) moveActive(-1);
  else return false;
  return true;
}

function moveActive(step) {
  const n = state.view.item.answers.length;
  state.active = (state.active + step + n) % n;
  drawCards();
}

// ---- start ---------------------------------------------------------------------------------------

function start() {
  setUpDropTargets();
  document.addEventListener("keydown", onKey);
  $("login-form").addEventListener("submit", (event) => {
    event.preventDefault();
    login($("name").value);
  });
  $("change-name").addEventListener("click", () => {
    localStorage.removeItem(NAME_KEY);
    askName("");
  });
  $("submit").addEventListener("click", submit);
  $("tie").addEventListener("click", tie);
  $("skip").addEventListener("click", () =>
    send("api/skip", { item: state.view.item.id, reason: "skip", note: "" }),
  );
  $("flag").addEventListener("click", openFlag);
  $("flag-cancel").addEventListener("click", () => {
    $("flag-form").hidden = true;
  });
  $("flag-form").addEventListener("submit", (event) => {
    event.preventDefault();
    send("api/skip", { item: state.view.item.id, reason: "flag", note: $("flag-note").value });
  });
  $("undo").addEventListener("click", undo);
  $("done-undo").addEventListener("click", undo);
  const saved = localStorage.getItem(NAME_KEY);
  if (saved) login(saved);
  else askName("");
}

start();
