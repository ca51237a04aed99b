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
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet -e '.[test]'
	$(PIP) install --quiet --no-deps mlc-chakra==1.0.0
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q -m "slow or not slow"
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH $(VENV)/bin/lit -q lit_tests

# Unit tests and goldens without the slow end-to-end tests.
test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow"
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH $(VENV)/bin/lit -q lit_tests

demo: $(STAMP)
	$(VENV)/bin/flint-opt examples/step.mlir -p 'canonicalize-dist,verify-dist'

bench: $(STAMP)
	$(PY) bench/run_all.py

clean:
	rm -rf $(VENV) out
