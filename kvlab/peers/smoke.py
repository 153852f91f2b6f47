"""``python -m kvlab.peers.smoke``: prove the llama.cpp build runs on this CPU (``make peers`` calls it).

A llama.cpp built for another CPU dies with SIGILL in its first matrix product, which would
otherwise surface as a crashed test far from its cause. A child process decodes four tokens of
SmolLM2's GGUF; a signal or error there fails this command with the reason and the fix.
"""

from __future__ import annotations

import subprocess
import sys

CHILD = """
from kvlab.models.gguf import GGUF_MODELS
from kvlab.peers.engine import LlamaEngine
spec = GGUF_MODELS["smollm2-135m"]
with LlamaEngine(spec.locate(spec), n_ctx=64, n_seq_max=1, n_threads=2) as engine:
    logp = engine.read(engine.tokenize("The keeper logged every ship"))
assert logp.isfinite().all(), "non-finite log-probabilities"
"""


def main() -> int:
    run = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True)
    if run.returncode == 0:
        print("llama.cpp runs on this CPU: decoded SmolLM2 and read finite log-probabilities")
        return 0
    why = f"killed by signal {-run.returncode}" if run.returncode < 0 else f"exit {run.returncode}"
    print(
        f"llama.cpp does not run on this CPU ({why}): {run.stderr.strip()[-1500:]}\n"
        "Rebuild it with this Makefile's flags and without pip's wheel cache:\n"
        "  .venv/bin/pip uninstall -y llama-cpp-python && rm -f .venv/.kvlab-peers && "
        "PIP_NO_CACHE_DIR=1 make peers",
        file=sys.stderr,
    )
    return 1


if __name__ == "__main__":
    sys.exit(main())
