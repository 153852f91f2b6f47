"""A notebook run on an empty model cache still matches its stored outputs (its load cell converts the GGUF).

`make test` prepares the models first, which would hide anything a conversion prints inside a
kernel; here the cache is empty, as on a machine where a user opens a notebook before
`kvlab models --prepare`.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.real
@pytest.mark.slow
def test_nbval_passes_on_a_cold_model_cache(tmp_path):
    env = dict(os.environ, KVLAB_CACHE=str(tmp_path / "cache"), MPLBACKEND="Agg")
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--nbval",
         "notebooks/02_kv_heatmaps.ipynb", "--nbval-sanitize-with", "notebooks/sanitize.cfg"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert (tmp_path / "cache" / "models").is_dir()  # the conversion did happen, inside the kernel
    assert "Unexpected output" not in run.stdout
