"""posttrain.monitor: what a run is doing — held-out evaluation and pass@k (evaluate), health alerts
over the logged metrics (alerts), and the HTML report of one or more runs (report)."""

from posttrain.monitor.alerts import AlertConfig, HealthMonitor, read_alerts
from posttrain.monitor.evaluate import EvalConfig, Evaluator, pass_at_k
from posttrain.monitor.run import RunMonitor

__all__ = ["AlertConfig", "EvalConfig", "Evaluator", "HealthMonitor", "RunMonitor", "pass_at_k", "read_alerts"]
