"""The stores' own code, audited where it is installed: the .ci/matrix cells that put a store beside kvlab.

``KVLAB_STORES`` (set by .ci/matrix) names the stores a cell installed: there a missing import fails.
Elsewhere (the main suite, which installs no store) these tests skip, saying where they run.
"""

from __future__ import annotations

import importlib
import os

import pytest


def store_module(package: str, module: str):
    """``module`` from the store ``package`` (its PyPI name), or a skip where the cell did not install it."""
    installed = {p for p in os.environ.get("KVLAB_STORES", "").split(",") if p}
    try:
        return importlib.import_module(module)
    except ImportError as e:
        if package in installed:
            pytest.fail(f"{package} is this cell's store, but {module} does not import: {e}")
        pytest.skip(
            f"{package} is installed only in its .ci/matrix cell (kvlab/data/tested.txt)", allow_module_level=True
        )
