# The README's two commands. Both create and use .venv in the checkout root.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: demo test clean

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

clean:
	rm -rf $(VENV) runs
