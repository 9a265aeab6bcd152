"""``posttrain report RUN_DIR [RUN_DIR ...]``: one self-contained HTML file about one or more runs.

Plots are matplotlib figures written inline as SVG (nothing is fetched when the file is opened):
training reward and held-out evaluation, KL, response length, entropy, clip fraction, value loss and
explained variance, time per phase, with each run's alerts marked on the timeline; then the alerts
with their causes and remedies, and sample completions at several steps with their scores. Several
runs are overlaid, one colour each. A panel appears only when some run logged its metric.

A small inline script checks on load that every plot rendered (a non-empty SVG with drawn marks) and
records it, and any script error, on ``<body data-plots="ok/total" data-errors="n">``: the headless
browser test reads those.
"""

from __future__ import annotations

import html
import io
import json
from dataclasses import dataclass
from pathlib import Path

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


def _panel(title: str, keys: list[str], ylabel: str, runs: list[Run], colors) -> str | None:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.2))
    drawn = False
    styles = ["-", "--", ":", "-."]
    for color, run in zip(colors, runs, strict=True):
        for style, key in zip(styles, keys, strict=False):
            steps, values = _series(run, key)
            if not steps:
                continue
            marker = "o" if len(steps) < 30 else None
            ax.plot(steps, values, style, color=color, marker=marker, markersize=3, label=f"{run.name}: {key}")
            drawn = True
        for alert in run.alerts:  # alerts on the timeline of every panel
            ax.axvline(alert["step"], color=color, alpha=0.35, linewidth=1)
    if not drawn:
        plt.close(fig)
        return None
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return _svg(fig)


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


def _alert_panel(runs: list[Run], colors) -> str | None:
    import matplotlib.pyplot as plt

    if not any(run.alerts for run in runs):
        return None
    fig, ax = plt.subplots(figsize=(6.4, 1.2 + 0.4 * len(runs)))
    for row, (color, run) in enumerate(zip(colors, runs, strict=True)):
        for alert in run.alerts:
            ax.scatter(alert["step"], row, color=color, s=40)
            ax.annotate(str(alert["id"]), (alert["step"], row), textcoords="offset points", xytext=(0, 6), fontsize=7)
    ax.set_yticks(range(len(runs)), [run.name for run in runs], fontsize=8)
    ax.set_ylim(-0.6, len(runs) - 0.4)
    ax.set_xlabel("step")
    ax.set_title("Alerts (numbered as in the table below)")
    return _svg(fig)


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
                f"<td><pre>{html.escape(s['completion'])}</pre></td>"
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


def build_report(run_dirs: list[str | Path]) -> str:
    """The HTML text of the report of ``run_dirs``."""
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
    sections += [f'<div class="grid">{plots}</div>', "<h2>Alerts</h2>", _alert_table(runs)]
    for run in runs:
        sections.append(f"<h2>Samples: {html.escape(run.name)}</h2>")
        sections.append(_sample_table(run.samples))
        if run.eval_samples:
            sections.append(f"<h3>Held-out samples: {html.escape(run.name)}</h3>")
            sections.append(_sample_table(run.eval_samples, per_step=4, steps=3))
    return (
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>posttrain report</title>'
        f"<style>{STYLE}</style><script>{CHECK_SCRIPT}</script></head><body>{''.join(sections)}</body></html>"
    )


def write_report(run_dirs: list[str | Path], out: str | Path | None = None) -> Path:
    """Write the report of ``run_dirs`` to ``out`` (default: RUN_DIR/report.html for one run, else
    ./report.html); returns its path."""
    out = Path(out) if out else (Path(run_dirs[0]) / "report.html" if len(run_dirs) == 1 else Path("report.html"))
    html = build_report(run_dirs)  # first: a wrong run folder is said before anything is created
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(html, encoding="utf-8")
    return out
