"""Write results/SUMMARY.md: the one page of findings, printed from the committed rows.

.venv/bin/python studies/summary.py

(:mod:`kvlab.findings.summary`; no model is run. ``--check`` exits 1 when the committed page is
not what the rows give.)
"""

from __future__ import annotations

import sys
from pathlib import Path

from kvlab.atomic import atomic_write_text
from kvlab.findings.summary import render

RESULTS = Path(__file__).resolve().parents[1] / "results"

if __name__ == "__main__":
    page = render(RESULTS)
    if "--check" in sys.argv[1:]:
        sys.exit(0 if (RESULTS / "SUMMARY.md").read_text() == page else 1)
    atomic_write_text(RESULTS / "SUMMARY.md", page)
    print(page)
