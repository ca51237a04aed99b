# Flint: the two commands a fresh machine needs.
#   make demo   run the main job end to end on a built-in example
#   make test   install everything into .venv and run every test (pytest + lit)
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed

.PHONY: install test test-fast demo bench clean

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)

# torch==2.13.0 resolves to the CPU wheel on this machine's disk; mlc-chakra is
# installed without its declared dependencies (they pull a notebook stack).
$(STAMP): $(VENV)/bin/python pyproject.toml
	$(PIP) install --quiet -e '.[test]'
	$(PIP) install --quiet --no-deps mlc-chakra==1.0.0
	touch $(STAMP)

install: $(STAMP)

# Two pytest workers (the machine's 2 cores), each file whole on one worker, longest files first
# (tests/conftest.py): about half the serial time.
PYTEST_XDIST := -n 2 --dist loadfile --no-loadscope-reorder

test: $(STAMP)
	$(PY) -m pytest -q $(PYTEST_XDIST)
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH $(VENV)/bin/lit -q lit_tests

# Unit tests and goldens without the slow end-to-end tests.
test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow" $(PYTEST_XDIST)
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH $(VENV)/bin/lit -q lit_tests

# The main job: capture Llama-3 8B under FSDP on 64 ranks, write per-rank Chakra
# traces, check them, and estimate the iteration on H100s (timeline in out/).
DEMO := out/llama3-8b.fsdp64
demo: $(STAMP)
	mkdir -p out
	$(VENV)/bin/flint capture --model llama3-8b --world-size 64 --plan fsdp -o $(DEMO).mlir
	$(VENV)/bin/flint emit $(DEMO).mlir -o $(DEMO) --prefix trace
	$(VENV)/bin/flint inspect $(DEMO)/trace
	$(VENV)/bin/flint estimate $(DEMO).mlir --device h100-sxm --network dgx-h100 --timeline $(DEMO).timeline.json

# Benchmarks (each prints a table; several minutes in all).
bench: $(STAMP)
	$(PY) bench/capture.py
	$(PY) bench/pipeline.py
	$(PY) bench/emit.py
	$(PY) bench/simulate.py
	$(PY) bench/explore.py
	$(PY) bench/expand.py

clean:
	rm -rf $(VENV) out
