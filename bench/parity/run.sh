#!/usr/bin/env bash
# Parity with TRL on a fixed batch (bench/parity/run.py), in the bench environment that has TRL.
#
#   bench/parity/run.sh TRL_BENCH_DIR [run.py arguments]    # e.g. --dtype float64, --only dpo
#
# TRL_BENCH_DIR: the TRL CPU bench folder (its requirements.txt pins TRL and transformers); used only to build
# the environment, as bench/run.sh does. VENV: the environment (default .venv-bench, shared with bench/run.sh).
# OUT: results folder (default bench/results/parity-<UTC stamp>): table.md and results.json.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
TRL=${1:-${TRL_BENCH:-}}
[ $# -gt 0 ] && shift
VENV=${VENV:-$ROOT/.venv-bench}
OUT=${OUT:-$ROOT/bench/results/parity-$(date -u +%Y%m%d-%H%M%S)}
PY=$VENV/bin/python

if [ ! -x "$PY" ] || ! "$PY" -c "import trl, posttrain" 2>/dev/null; then
  if [ ! -f "$TRL/requirements.txt" ]; then
    echo "TRL bench folder not found at '$TRL' (it needs requirements.txt). Pass it as the first argument:" >&2
    echo "bench/parity/run.sh /path/to/bench/trl" >&2
    exit 2
  fi
  echo "[parity] creating $VENV (torch 2.13.0, then $TRL/requirements.txt, then posttrain)" >&2
  python3 -m venv "$VENV"
  "$PY" -m pip install --quiet torch==2.13.0
  "$PY" -m pip install --quiet -r "$TRL/requirements.txt"
  "$PY" -m pip install --quiet -e "$ROOT"
fi
mkdir -p "$OUT"
"$PY" "$ROOT/bench/parity/run.py" --json-out "$OUT/results.json" "$@" | tee "$OUT/table.md"
