"""SFT that collapses to a uniform model (loss = ln V, zero gradient) says so (issue 24, item 18): at
optim.lr=1e6 it exited 0 and saved final/ without a word. The collapsed model is made deterministically (a copy
whose final norm and output weights are 0: every logit 0, loss ln V, every gradient exactly 0), since lr=1e6
collapses the tiny model on some CPUs only (issue 34)."""

from __future__ import annotations

import json
import math

from helpers import dead_copy

from posttrain.monitor.alerts import SFT_RULES, AlertConfig, HealthMonitor, read_alerts
from posttrain.runtime.metrics import read_metrics


def _sft(tiny_dir, tmp_path, name: str, lr: str, policy=None):
    from posttrain.runtime.config import load_config
    from posttrain.trainers import sft

    rows = [{"prompt": f"{a}+{b}=", "completion": str(a + b)} for a in range(8) for b in range(8)]
    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = load_config(
        sft.SFTConfig,
        None,
        [
            f"model.path={policy or tiny_dir / 'policy'}",
            f"data.path={data}",
            "data.chat_template=never",
            f"run.output_dir={tmp_path / name}",
            "run.max_steps=6",
            "run.batch_size=16",
            f"optim.lr={lr}",
            "run.progress=false",
            "run.report_to=[jsonl]",
        ],
    )
    sft.train(config)
    return tmp_path / name


def test_sft_of_a_collapsed_model_raises_alerts(tiny_dir, tmp_path, capsys):
    run = _sft(tiny_dir, tmp_path, "collapsed", "3e-3", dead_copy(tiny_dir, tmp_path / "dead_policy"))
    records = read_metrics(run)
    alerts = read_alerts(run)
    names = {a["name"] for a in alerts}
    assert names == {"zero_gradient", "uniform_output"}, (alerts, [(r["loss"], r["grad_norm"]) for r in records])
    out = capsys.readouterr().out
    assert any(line.startswith("[alert 1") for line in out.splitlines())
    assert (run / "final" / "policy").is_dir()  # a warning, not a stop


def test_healthy_sft_raises_no_collapse_alert(tiny_dir, tmp_path):
    run = _sft(tiny_dir, tmp_path, "healthy", "3e-3")
    assert read_alerts(run) == []


def test_collapse_rules_on_their_patterns():
    """12: a zero gradient with a loss above 0, three updates in a row (issue 34: one zero step is no dead
    run); 13: three losses in a row at ln V, not moving. A loss near ln V that still falls (a freshly
    initialised model) and a zero gradient at loss 0 raise nothing."""
    log_vocab = math.log(1000)

    def ids(records):
        monitor = HealthMonitor(
            AlertConfig(), None, "loss", "loss", echo=lambda _: None, rules=SFT_RULES, context={"log_vocab": log_vocab}
        )
        return [[a["id"] for a in monitor.check(step, r)] for step, r in enumerate(records, 1)]

    assert ids([{"loss": 2.0 + d, "grad_norm": 0.0} for d in (0.0, 0.1, 0.2)]) == [[], [], [12]]
    assert ids([{"loss": 0.0, "grad_norm": 0.0}] * 3) == [[], [], []]
    stuck = [{"loss": log_vocab + d, "grad_norm": 0.5} for d in (3e-4, 1e-4, 2e-4)]
    assert ids(stuck) == [[], [], [13]]
    falling = [{"loss": log_vocab - d, "grad_norm": 0.5} for d in (0.0, 0.01, 0.03)]
    assert ids(falling) == [[], [], []]
    assert SFT_RULES[0].causes.endswith(".") and SFT_RULES[1].remedy.endswith(".")
