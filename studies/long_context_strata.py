"""Markdown tables of naive - rerotate by stratum, from the long-context study's committed rows.

.venv/bin/python studies/long_context_strata.py

Per model (results/long_context_<model>.csv) and fragment count: pooled, by the passage holding
the answer, and where the joined prefill answers right or wrong, in answer-span KL, the truth's
NLL and exact match; count 1 excluded, Holm within each metric's family
(:mod:`kvlab.findings.strata`). No model is run.
"""

from __future__ import annotations

from pathlib import Path

from kvlab.findings import strata

MODELS = ("smollm2-135m", "gemma3-270m")
RESULTS = Path(__file__).resolve().parents[1] / "results"

if __name__ == "__main__":
    print("\n".join(strata.markdown(m, strata.read_rows(RESULTS / f"long_context_{m}.csv")) for m in MODELS))
