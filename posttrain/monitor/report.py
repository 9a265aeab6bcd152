"""``posttrain report RUN_DIR [RUN_DIR ...]``: one self-contained HTML file about one or more runs.

Plots are matplotlib figures written inline as SVG (nothing is fetched when the file is opened):
training reward and held-out evaluation, KL, response length, entropy, clip fraction, value loss and
explained variance, time per phase, and a timeline of the alerts in steps; then the alerts with their
causes and remedies, and sample completions at several steps with their scores; beside the automatic
evaluation, a "Human comparison" table of every blind A/B task found in a run's ``human/*/stats.json`` or
named with ``--human TASK`` (``posttrain label stats`` writes that file; read here as plain JSON, the
monitor layer never imports the labelling code). Several runs are
overlaid, one colour each; where runs of different algorithms plot on different scales (GRPO's 0–1
reward beside PPO's −5…10) each algorithm gets its own y-axis, one stacked subplot each, so that
neither curve is flattened. An alert is marked on the curves of the run that raised it only. A panel
appears only when some run logged its metric.

A small inline script checks on load that every plot rendered (a non-empty SVG with drawn marks) and
records it, and any script error, on ``<body data-plots="ok/total" data-errors="n">``: the headless
browser test reads those.
"""

from __future__ import annotations

import html
import io
import json
import math
from dataclasses import dataclass
from pathlib import Path

from posttrain.errors import UserError
from posttrain.monitor.alerts import read_alerts
from posttrain.monitor.records import read_records

# (title, metric keys, y label); a key is plotted for every run that logged it
PANELS = (
    ("Training reward", ["reward/mean", "score/mean"], "mean per step (PPO: reward = score − β·KL)"),
    ("Held-out evaluation", ["eval/greedy/accuracy", "eval/sampled/accuracy", "eval/greedy/score"], "held-out"),
    ("KL to the reference", ["kl/per_token"], "nats / token"),
    ("Response length", ["response_length/mean"], "tokens"),
    ("Entropy", ["entropy"], "nats / token"),
    ("Clip fraction", ["policy/clipfrac"], "share of tokens"),
    ("Value loss", ["value_loss"], "loss"),
    ("Explained variance", ["values/explained_variance"], "1 − Var(R−V)/Var(R)"),
    ("Loss", ["loss", "eval/loss"], "loss"),
)
# runs of different algorithms get one y-axis each when one algorithm's values would fill less than this
# share of the height of an axis they shared
FLATTENED = 0.25


@dataclass
class Run:
    name: str
    path: Path
    records: list[dict]
    alerts: list[dict]
    samples: list[dict]
    eval_samples: list[dict]
    config: dict


def _jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def load_run(path: str | Path, name: str) -> Run:
    import yaml

    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"no run folder {path}")
    if not (path / "metrics.jsonl").is_file():
        raise FileNotFoundError(f"{path}: no metrics.jsonl (is this a posttrain run folder?)")
    config_path = path / "config.yaml"
    config = yaml.safe_load(config_path.read_text()) if config_path.is_file() else {}
    return Run(
        name,
        path,
        read_records(path / "metrics.jsonl"),
        read_alerts(path),
        _jsonl(path / "samples.jsonl"),
        _jsonl(path / "eval_samples.jsonl"),
        config or {},
    )


def _names(paths: list[Path]) -> list[str]:
    """Short distinct labels: the folder name, with its parent when two runs share it."""
    names = [p.name for p in paths]
    if len(set(names)) < len(names):
        names = [f"{p.parent.name}/{p.name}" for p in paths]
    return names


# --------------------------------------------------------------------------------------------------
# figures
# --------------------------------------------------------------------------------------------------


def _svg(fig) -> str:
    import matplotlib.pyplot as plt

    buffer = io.StringIO()
    fig.savefig(buffer, format="svg", bbox_inches="tight")
    plt.close(fig)
    text = buffer.getvalue()
    return text[text.index("<svg") :]  # drop the XML prolog and doctype: the SVG is inline


def _series(run: Run, key: str) -> tuple[list[int], list[float]]:
    points = [(r["step"], r[key]) for r in run.records if r.get(key) is not None]
    return [s for s, _ in points], [v for _, v in points]


def _algorithm(run: Run):
    """What tells runs of one algorithm from another's: the sections and knobs of the config (each
    trainer's config class has its own set; GRPO's presets and DPO's loss types only change values).
    A run without config.yaml counts as an algorithm of its own."""
    return frozenset(run.config) if run.config else str(run.path)


def _value_range(runs: list[Run], keys: list[str]) -> tuple[float, float]:
    """(lowest, highest) finite value of ``keys`` over ``runs``; (inf, -inf) when none is finite."""
    values = [v for run in runs for key in keys for v in _series(run, key)[1] if math.isfinite(v)]
    return (min(values), max(values)) if values else (math.inf, -math.inf)


def _axis_groups(runs: list[Run], keys: list[str]) -> list[list[Run]]:
    """The runs that logged ``keys``, one list per y-axis: one per algorithm where an algorithm's values
    would fill less than ``FLATTENED`` of a shared axis's height, else all on one axis."""
    plotted = [run for run in runs if any(_series(run, key)[0] for key in keys)]
    by_algorithm: dict = {}
    for run in plotted:
        by_algorithm.setdefault(_algorithm(run), []).append(run)
    groups = list(by_algorithm.values())
    ranges = [r for r in (_value_range(group, keys) for group in groups) if r[0] <= r[1]]
    if len(groups) < 2 or not ranges:
        return [plotted] if plotted else []
    low, high = min(r[0] for r in ranges), max(r[1] for r in ranges)
    flattened = high > low and any(top - bottom < FLATTENED * (high - low) for bottom, top in ranges)
    return groups if flattened else [plotted]


def _at_steps(steps: list[int], values: list[float], wanted: list[int]) -> list[float]:
    """The curve (``steps``, ``values``) read at the ``wanted`` steps, each inside its span (linear
    between logged steps: an alert's step need not be one the metric was logged at)."""
    import numpy as np

    return [float(v) for v in np.interp(wanted, steps, values)]


def _plot_run(ax, run: Run, keys: list[str], color) -> None:
    """``run``'s curves of ``keys`` on ``ax`` (one line style per key), and its alerts as markers on its
    first curve: on this run's curve only, so that an alert is never read as another run's."""
    styles = ["-", "--", ":", "-."]
    curves = [(style, key, *_series(run, key)) for style, key in zip(styles, keys, strict=False)]
    curves = [curve for curve in curves if curve[2]]
    for style, key, steps, values in curves:
        marker = "o" if len(steps) < 30 else None
        ax.plot(steps, values, style, color=color, marker=marker, markersize=3, label=f"{run.name}: {key}")
    if not run.alerts or not curves:
        return
    _, _, steps, values = curves[0]
    alerts = [a for a in run.alerts if steps[0] <= a["step"] <= steps[-1]]  # where this curve was drawn
    if not alerts:
        return
    xs = [a["step"] for a in alerts]
    ys = _at_steps(steps, values, xs)
    (markers,) = ax.plot(xs, ys, "X", color=color, markeredgecolor="black", markersize=8, label=f"{run.name}: alert")
    markers.set_gid(f"alerts-of-{run.name}")  # named in the SVG: the report test finds it
    for alert, x, y in zip(alerts, xs, ys, strict=True):
        ax.annotate(str(alert["id"]), (x, y), textcoords="offset points", xytext=(0, 7), fontsize=7, ha="center")


def _panel_figure(title: str, keys: list[str], ylabel: str, runs: list[Run], colors):
    """The matplotlib figure of one panel, or None when no run logged ``keys``: one subplot per y-axis
    (``_axis_groups``), stacked over one step axis."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    groups = _axis_groups(runs, keys)
    if not groups:
        return None
    color_of = {id(run): color for run, color in zip(runs, colors, strict=True)}
    height = 3.2 if len(groups) == 1 else 0.8 + 2.2 * len(groups)
    layout = None if len(groups) == 1 else "constrained"  # keeps the shared label clear of the axes' own
    fig, axes = plt.subplots(len(groups), 1, figsize=(6.4, height), sharex=True, squeeze=False, layout=layout)
    for ax, group in zip(axes[:, 0], groups, strict=True):
        for run in group:
            _plot_run(ax, run, keys, color_of[id(run)])
        # one axis: the quantity; stacked axes: each says whose it is, the quantity is said once beside them
        ax.set_ylabel(ylabel if len(groups) == 1 else ", ".join(run.name for run in group))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if len(groups) > 1:
        fig.align_ylabels(axes[:, 0])
        fig.supylabel(ylabel, fontsize=10)
    axes[0, 0].set_title(title)
    axes[-1, 0].set_xlabel("step")
    return fig


def _panel(title: str, keys: list[str], ylabel: str, runs: list[Run], colors) -> str | None:
    fig = _panel_figure(title, keys, ylabel, runs, colors)
    return None if fig is None else _svg(fig)


def _phase_panel(runs: list[Run]) -> str | None:
    """Mean seconds per step of each phase (time/generate, time/train, ...), one bar group per run."""
    import matplotlib.pyplot as plt

    phases = sorted({k for run in runs for r in run.records for k in r if k.startswith("time/") and k != "time/step"})
    if not phases:
        return None
    fig, ax = plt.subplots(figsize=(6.4, 3.2))
    width = 0.8 / len(runs)
    for i, run in enumerate(runs):
        means = []
        for phase in phases:
            values = [r[phase] for r in run.records if r.get(phase) is not None]
            means.append(sum(values) / len(values) if values else 0.0)
        ax.bar([p + i * width for p in range(len(phases))], means, width, label=run.name)
    ax.set_xticks([p + 0.4 - width / 2 for p in range(len(phases))], [p[5:] for p in phases], fontsize=8)
    ax.set_title("Time per phase")
    ax.set_ylabel("seconds per step (mean)")
    ax.legend(fontsize=7)
    return _svg(fig)


def _alert_figure(runs: list[Run], colors):
    """The alerts of each run on one row, over the steps the runs logged (whole steps on the x-axis), or
    None when no run raised one."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    if not any(run.alerts for run in runs):
        return None
    fig, ax = plt.subplots(figsize=(6.4, 1.2 + 0.4 * len(runs)))
    for row, (color, run) in enumerate(zip(colors, runs, strict=True)):
        for alert in run.alerts:
            ax.scatter(alert["step"], row, color=color, s=40)
            ax.annotate(str(alert["id"]), (alert["step"], row), textcoords="offset points", xytext=(0, 6), fontsize=7)
    steps = [r["step"] for run in runs for r in run.records if "step" in r]
    steps += [a["step"] for run in runs for a in run.alerts]
    margin = max(1.0, 0.02 * (max(steps) - min(steps)))
    ax.set_xlim(min(steps) - margin, max(steps) + margin)  # the runs' span, not only the alerts'
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_yticks(range(len(runs)), [run.name for run in runs], fontsize=8)
    ax.set_ylim(-0.6, len(runs) - 0.4)
    ax.set_xlabel("step")
    ax.set_title("Alerts (numbered as in the table below)")
    return fig


def _alert_panel(runs: list[Run], colors) -> str | None:
    fig = _alert_figure(runs, colors)
    return None if fig is None else _svg(fig)


# --------------------------------------------------------------------------------------------------
# tables
# --------------------------------------------------------------------------------------------------


def _alert_table(runs: list[Run]) -> str:
    rows = [
        f"<tr><td>{html.escape(run.name)}</td><td>{a['step']}</td><td>{a['id']} {html.escape(a['name'])}</td>"
        f"<td>{html.escape(a['seen'])}</td><td>{html.escape(a['causes'])}</td><td>{html.escape(a['remedy'])}</td></tr>"
        for run in runs
        for a in run.alerts
    ]
    if not rows:
        return "<p>No alert was raised.</p>"
    head = "<tr><th>run</th><th>step</th><th>alert</th><th>seen</th><th>likely causes</th><th>try</th></tr>"
    return f"<table>{head}{''.join(rows)}</table>"


def _pick_steps(steps: list[int], count: int) -> list[int]:
    """Up to ``count`` steps spread evenly over ``steps`` (first and last included)."""
    steps = sorted(set(steps))
    if len(steps) <= count:
        return steps
    return sorted({steps[round(i * (len(steps) - 1) / (count - 1))] for i in range(count)})


def _completion(sample: dict) -> str:
    """The completion, or an episode's turns after its prompt: the model's in bold, the environment's as they
    came back (``role: text``), and how it ended."""
    episode = sample.get("episode")
    if not episode:
        return f"<pre>{html.escape(sample['completion'])}</pre>"
    first = next((i for i, m in enumerate(episode) if m["role"] == "assistant"), len(episode))
    turns = [
        f"<b>{html.escape(m['content'])}</b>"
        if m["role"] == "assistant"
        else f"{m['role']}: {html.escape(m['content'])}"
        for m in episode[first:]
    ]
    return f"<pre>{chr(10).join(turns)}</pre><small>end: {html.escape(str(sample.get('end', '')))}</small>"


def _no_samples(run: Run) -> str:
    """What stands where a run's samples would: an offline run (SFT, DPO, KTO, a reward model: its config has
    no ``sampling``) trains on its data set's rows and generates nothing."""
    if run.config and "sampling" not in run.config:
        return (
            "<p>None to show: this run trains on the rows of its data set and generates nothing (SFT, DPO, KTO "
            "and reward models do); its losses, accuracies and held-out metrics are in the plots above.</p>"
        )
    return "<p>No samples were logged (log_completions: 0, or the run ended before its first step).</p>"


def _sample_table(samples: list[dict], per_step: int = 4, steps: int = 4) -> str:
    if not samples:
        return "<p>No samples were logged.</p>"
    rows = []
    for step in _pick_steps([s["step"] for s in samples], steps):
        chosen = [s for s in samples if s["step"] == step][:per_step]
        for s in chosen:
            score = s.get("score")
            mode = f" ({s['mode']})" if "mode" in s else ""
            rows.append(
                f"<tr><td>{step}{mode}</td><td><pre>{html.escape(s['prompt'])}</pre></td>"
                f"<td>{_completion(s)}</td>"
                f"<td>{'—' if score is None else f'{score:.3g}'}</td></tr>"
            )
    head = "<tr><th>step</th><th>prompt</th><th>completion</th><th>score</th></tr>"
    return f"<table>{head}{''.join(rows)}</table>"


def _summary(run: Run) -> str:
    cfg, last = run.config, (run.records[-1] if run.records else {})
    parts = [
        ("folder", str(run.path)),
        ("model", cfg.get("model", {}).get("path", "?")),
        ("steps logged", str(sum(r.get("step", 0) > 0 for r in run.records))),  # step 0: the starting model's eval
        ("lr", str(cfg.get("optim", {}).get("lr", "?"))),
    ]
    if "kl_coef" in cfg:
        parts.append(("kl_coef", str(cfg["kl_coef"])))
    start = run.records[0] if run.records and run.records[0].get("step") == 0 else {}
    if start.get("eval/greedy/accuracy") is not None:  # the held-out baseline, before any update
        parts.append(("eval/greedy/accuracy at step 0", f"{start['eval/greedy/accuracy']:.4g}"))
    parts += [(k, f"{last[k]:.4g}") for k in ("reward/mean", "score/mean", "eval/greedy/accuracy") if k in last]
    parts.append(("alerts", str(len(run.alerts))))
    return " · ".join(f"<b>{html.escape(k)}</b> {html.escape(v)}" for k, v in parts)


CHECK_SCRIPT = """
window.__errors = [];
window.addEventListener('error', e => window.__errors.push(String(e.message)));
window.addEventListener('load', () => {
  const plots = document.querySelectorAll('figure.plot svg');
  let ok = 0;
  plots.forEach(svg => {
    const box = svg.getBoundingClientRect();
    if (box.width > 0 && box.height > 0 && svg.querySelectorAll('path, line, rect, use').length > 0) ok += 1;
  });
  document.body.dataset.plots = ok + '/' + plots.length;
  document.body.dataset.errors = String(window.__errors.length);
});
"""

STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em; color: #222; }
.grid { display: grid; grid-template-columns: repeat(auto-fill, minmax(520px, 1fr)); gap: 1em; }
figure.plot { margin: 0; } figure.plot svg { width: 100%; height: auto; }
table { border-collapse: collapse; font-size: 0.85em; margin-bottom: 1.5em; }
td, th { border: 1px solid #ccc; padding: 0.3em 0.5em; vertical-align: top; text-align: left; }
pre { margin: 0; white-space: pre-wrap; max-width: 40em; }
"""


def human_stats(
    run_dirs: list[str | Path], human: list[str | Path] = (), unreadable: dict[Path, str] | None = None
) -> list[tuple[Path, dict]]:
    """(task folder, its stats.json) of each compare task in ``<run>/human/*/`` and in ``human``; a task
    named in ``human`` must have a stats.json of a compare task, those found in runs are skipped otherwise.
    ``unreadable``: run folders' tasks that could not be read (folder -> why), left out; a run's task whose
    stats.json is not JSON is added to it."""
    named = [Path(h) for h in human]
    unreadable = {} if unreadable is None else unreadable
    found: dict[Path, tuple[Path, dict]] = {}
    for folder in [p for run in run_dirs for p in sorted((Path(run) / "human").glob("*")) if p.is_dir()] + named:
        path = folder / "stats.json"
        if folder in unreadable and folder not in named:
            continue
        if not path.is_file():
            if folder in named:
                raise FileNotFoundError(f"{folder}: no stats.json (write it with posttrain label stats {folder})")
            continue
        try:
            stats = json.loads(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            if folder in named:
                raise UserError(f"{path}: not valid JSON ({err})") from err
            unreadable[folder] = f"{path}: not valid JSON ({err})"
            continue
        if stats.get("mode") != "compare":
            if folder in named:
                raise UserError(f"{folder}: a {stats.get('mode')} task; the report shows compare tasks (A/B) only")
            continue
        found.setdefault(folder.resolve(), (folder, stats))  # a run's task also named with --human: once
    return list(found.values())


def _share(value, ci=None) -> str:
    if value is None:
        return "—"
    text = f"{value:.3f}"
    return text if ci is None or ci[0] is None else f"{text} [{ci[0]:.3f}, {ci[1]:.3f}]"


def _human_table(tasks: list[tuple[Path, dict]], unreadable: dict[Path, str]) -> str:
    """One row per compare task: models, n, A's win rate with and without ties, ties, position bias; then a
    line per task that could not be read."""
    rows = []
    for folder, stats in tasks:
        c, models = stats["compare"], stats.get("models", {})
        bias = " <b>position bias</b>" if c["position_bias"] else ""
        rows.append(
            f"<tr><td>{html.escape(str(folder))}</td><td>A = {html.escape(str(models.get('A')))}<br>"
            f"B = {html.escape(str(models.get('B')))}</td><td>{c['n']}</td>"
            f"<td>{_share(c['win_rate'], c['win_rate_ci'])}</td>"
            f"<td>{_share(c['win_rate_decisive'], c['win_rate_decisive_ci'])}</td>"
            f"<td>{c['ties']} ({_share(c['tie_share'])})</td>"
            f"<td>{_share(c['left_share'], c['left_share_ci'])}{bias}</td>"
            f"<td>{len(stats.get('labellers', {}))}</td></tr>"
        )
    head = (
        "<tr><th>task</th><th>models</th><th>n</th><th>win rate of A, ties as half [95 % CI]</th>"
        "<th>without ties [95 % CI]</th><th>ties</th><th>left side's share of wins [95 % CI]</th>"
        "<th>labellers</th></tr>"
    )
    return (
        '<h2 id="human">Human comparison</h2><p>Blind A/B judgements by people (posttrain label, compare mode); '
        "Wilson intervals. A left share whose interval leaves out 0.5 means the side shown, not the answer, "
        f"decided.</p><table>{head}{''.join(rows)}</table>"
        + "".join(f"<p>A task could not be read: {html.escape(why)}</p>" for why in unreadable.values())
    )


def build_report(
    run_dirs: list[str | Path], human: list[str | Path] = (), unreadable: dict[Path, str] | None = None
) -> str:
    """The HTML text of the report of ``run_dirs`` and of the compare tasks in ``human`` (task folders);
    ``unreadable``: the runs' tasks that could not be read (folder -> why), said in the human section."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams["svg.fonttype"] = "none"  # text stays text: smaller files, readable offline
    paths = [Path(p) for p in run_dirs]
    runs = [load_run(p, name) for p, name in zip(paths, _names(paths), strict=True)]
    colors = [plt.get_cmap("tab10")(i % 10) for i in range(len(runs))]
    figures = [_panel(title, keys, ylabel, runs, colors) for title, keys, ylabel in PANELS]
    figures += [_phase_panel(runs), _alert_panel(runs, colors)]
    plots = "".join(f'<figure class="plot">{svg}</figure>' for svg in figures if svg is not None)
    sections = [f"<h1>posttrain report: {html.escape(', '.join(r.name for r in runs))}</h1>"]
    sections += [f"<p>{_summary(run)}</p>" for run in runs]
    unreadable = dict(unreadable or {})
    tasks = human_stats(paths, human, unreadable)
    if tasks or unreadable:
        sections.append(_human_table(tasks, unreadable))
    sections += [f'<div class="grid">{plots}</div>', "<h2>Alerts</h2>", _alert_table(runs)]
    for run in runs:
        sections.append(f"<h2>Samples: {html.escape(run.name)}</h2>")
        sections.append(_sample_table(run.samples) if run.samples else _no_samples(run))
        if run.eval_samples:
            sections.append(f"<h3>Held-out samples: {html.escape(run.name)}</h3>")
            sections.append(_sample_table(run.eval_samples, per_step=4, steps=3))
    return (
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>posttrain report</title>'
        f"<style>{STYLE}</style><script>{CHECK_SCRIPT}</script></head><body>{''.join(sections)}</body></html>"
    )


def write_report(
    run_dirs: list[str | Path],
    out: str | Path | None = None,
    human: list[str | Path] = (),
    unreadable: dict[Path, str] | None = None,
) -> Path:
    """Write the report of ``run_dirs`` to ``out`` (default: report.html in the run folder, or in the folder
    holding all the runs, runs/demo for runs/demo/sft and runs/demo/grpo; else ./report.html); returns its
    absolute path."""
    out = Path(out) if out else default_report_path(run_dirs)
    html = build_report(run_dirs, human, unreadable)  # first: a wrong run folder is said before anything is created
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(html, encoding="utf-8")
    return out.resolve()


def default_report_path(run_dirs: list[str | Path]) -> Path:
    """report.html in the one run's folder, or in the parent folder all the runs share, else in ./."""
    if len(run_dirs) == 1:
        return Path(run_dirs[0]) / "report.html"
    parents = {Path(p).resolve().parent for p in run_dirs}
    return parents.pop() / "report.html" if len(parents) == 1 else Path("report.html")
