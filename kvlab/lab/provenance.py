"""Who and what produced a run: the model's weights digest, the library versions and the CPU, for reports, sweeps and studies."""

import os
import platform
import sys
import time
from pathlib import Path

from kvlab.files.identity import fingerprint, package_versions
from kvlab.models.sources import load_model

_DIGESTS: dict[str, tuple[str | None, str | None]] = {}


def model_digest(model_name) -> tuple[str | None, str | None]:
    """(weights_sha256, error) of ``model_name`` as this process loads it; memoised."""
    if not isinstance(model_name, str):
        return None, "no model_name parameter"
    if model_name not in _DIGESTS:
        try:
            model = load_model(model_name)  # catalogue names and paths alike
            _DIGESTS[model_name] = (fingerprint(model, weights=True)["weights_sha256"], None)
            del model
        except Exception as e:  # noqa: BLE001  a point's record still gets written; the error says why
            _DIGESTS[model_name] = (None, f"{type(e).__name__}: {e}")
    return _DIGESTS[model_name]


def versions() -> dict:
    return dict(package_versions("kvlab", "torch", "transformers", "papermill", "distributed"))


def cpu_name() -> str:
    """The CPU's model name and this machine's logical core count, as a run's record states them."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
        else:
            name = platform.processor() or platform.machine()
    except OSError:
        name = platform.processor() or platform.machine()
    return f"{name}, {os.cpu_count()} logical cores"


def study_run(script: str, started: float) -> dict:
    """What a study's JSON states about its run: the command (``script`` and this process's arguments), the CPU, and
    the wall seconds since ``started`` (a :func:`time.perf_counter` reading)."""
    return {
        "command": " ".join([script, *sys.argv[1:]]),
        "cpu": cpu_name(),
        "wall_s": round(time.perf_counter() - started, 1),
    }
