"""results/README.md's Gemma 3 paragraph beside llama.cpp quotes only what its committed run holds.

No model or llama.cpp is run: every ``mean [lo, hi]`` in the subsection is matched, at the digits
it prints, with an interval of ``results/llama_cpp_gemma3-270m.json`` (``studies/llama_cpp_swa.py``).
"""

from __future__ import annotations

import json
from pathlib import Path

from conftest import INTERVAL

ROOT = Path(__file__).resolve().parents[2]


def subsection() -> str:
    page = (ROOT / "results" / "README.md").read_text()
    start = page.index("### Gemma 3", page.index("## Beside llama.cpp"))
    return " ".join(page[start : page.index("\n##", start + 1)].split())  # intervals may wrap


def recorded() -> list[tuple[float, float, float]]:
    """Every (mean, low, high) the run recorded, wherever it sits in the JSON."""
    out = []

    def walk(x):
        if isinstance(x, dict):
            for key, value in x.items():
                if key.endswith("mean"):
                    stem = key[: -len("mean")]
                    if f"{stem}lo" in x:
                        out.append((value, x[f"{stem}lo"], x[f"{stem}hi"]))
                    elif f"{stem}ci" in x:
                        out.append((value, *x[f"{stem}ci"]))
                walk(value)
        elif isinstance(x, list):
            for v in x:
                walk(v)

    walk(json.loads((ROOT / "results" / "llama_cpp_gemma3-270m.json").read_text()))
    return out


def printed_as(text: str, value: float) -> bool:
    """Whether ``value`` prints as ``text`` at ``text``'s own precision (fixed or e-notation)."""
    if "e" in text:
        digits = len(text.split("e")[0].split(".")[1]) if "." in text else 0
        return f"{value:.{digits}e}".replace("e-0", "e-").replace("e+0", "e") == text
    digits = len(text.split(".")[1]) if "." in text else 0
    return f"{value:.{digits}f}" == text


def unmatched(text: str, triples) -> list[str]:
    return [
        m.group(0)
        for m in INTERVAL.finditer(text)
        if not any(all(printed_as(s, v) for s, v in zip(m.groups(), t, strict=True)) for t in triples)
    ]


def test_every_interval_of_the_paragraph_is_the_runs():
    text = subsection()
    assert len(INTERVAL.findall(text)) >= 6, "the paragraph quotes the run's intervals"
    assert unmatched(text, recorded()) == [], "quote results/llama_cpp_gemma3-270m.json (studies/llama_cpp_swa.py)"


def test_an_altered_digit_fails():
    text = subsection()
    first = INTERVAL.search(text).group(0)
    altered = text.replace(first, first.replace("[", "[9", 1), 1)
    assert unmatched(altered, recorded()) != []
