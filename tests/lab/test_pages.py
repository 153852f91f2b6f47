"""The report index and the sweep summary are rendered from templates that escape every field."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvlab.lab.pages import render
from kvlab.lab.report import NotebookRun, index_page
from kvlab.sweep.study import Study
from kvlab.sweep.summary import write_index

EVIL = "<script>alert('x')</script> & \"q\""


def test_report_index_escapes_every_field():
    runs = [
        NotebookRun(name="01_<b>", seconds=3.2, question=EVIL, finding=EVIL, thumbnail="t<.png"),
        NotebookRun(name="02_fail", seconds=1.0, question="q", finding="f", error=EVIL),
    ]
    page = index_page({"models": {"m<1>": "abc&"}, "commit": EVIL}, runs, no_input=True)
    assert "<script>" not in page and "<b>" not in page
    assert page.count("&lt;script&gt;") == 4  # question, finding, error, commit
    assert "m&lt;1&gt; <span class='time'>weights sha256 abc&amp;…</span>" in page
    assert "1 of 2 notebooks passed, 1 failed · code hidden (--no-input)" in page
    assert "src='t&lt;.png'" in page and "✓ passed" in page and "✗ failed" in page
    assert "<tr><td>models</td>" not in page  # the models row is written once, as "model"


def test_sweep_index_escapes_every_field(tmp_path):
    study = Study(
        path=Path("s<1>.toml"), notebook=Path("nb&.ipynb"), output=tmp_path, timeout=None, points=[], axes=["offset"]
    )
    records = [
        {
            "status": "ok",
            "point": "p<0>",
            "parameters": {"offset": EVIL},
            "repeat": 0,
            "wall_s": 1.25,
            "records": [{"name": "kl", "value": 0.5, "unit": "nats", "ci_low": None, "ci_high": None}],
            "error": None,
        },
        {
            "status": "failed",
            "point": "p1",
            "parameters": {"offset": 4},
            "repeat": 0,
            "wall_s": None,
            "records": [],
            "error": EVIL,
        },
    ]
    page = write_index(tmp_path, study, records).read_text()
    assert "<script>" not in page and "s&lt;1&gt;.toml" in page and "nb&amp;.ipynb" in page
    assert "2 points, 1 ok,\n1 failed" in page and "<h2>Failures</h2>" in page
    assert "kl = 0.5 nats" in page and "<td>1.2</td>" in page
    assert (tmp_path / "plots" / "kl__offset.png").read_bytes()[:4] == b"\x89PNG"


def test_a_misspelt_template_field_fails_the_render():
    with pytest.raises(Exception, match="undefined"):
        render("sweep_index.html", study_stem="x")
