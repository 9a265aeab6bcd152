# The README's two commands. Both create and use .venv in the checkout root.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: demo test bench clean

# torch first, pinned to the CPU build these machines hold locally; posttrain's own torch
# requirement is a range that this version satisfies, so no other build is pulled over it.
$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev,math]'
	touch $@

demo: $(VENV)/.installed
	$(VENV)/bin/posttrain demo --out runs/demo

test: $(VENV)/.installed
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q

# posttrain against TRL on the same work (bench/README.md); its own environment, .venv-bench.
# TRL_BENCH: the TRL CPU bench folder (default ../shared/bench/trl); ROUNDS: interleaved rounds.
ROUNDS ?= 3
bench:
	bench/run.sh $(ROUNDS) $(TRL_BENCH)

clean:
	rm -rf $(VENV) runs
