"""The field audit's records (results/field/), their table in results/README.md, the repros and the reports.

The records are written inside each package's environment by studies/field_audit.py; here they are
read as committed: every cell of the grid has one, the README's table is the one they print, every
failing line of a real package has a reproduction and a report, and the adapters are shown in full.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from kvlab.findings.field import (
    BEGIN,
    END,
    ERROR,
    FAILED,
    LINES_CSV,
    PASSED,
    REFUSAL_ONLY,
    comparable,
    line_rows,
    load,
    markdown,
    row,
    splice,
    verdict_matrix,
)
from studies.field.grid import cells

ROOT = Path(__file__).resolve().parents[2]
FIELD = ROOT / "results" / "field"
REPRO = FIELD / "repro"


def _record(lines, error=None, passed=None):
    cell = {"id": "x", "package": "p", "version": "1", "operation": "op", "model": "m"}
    base = {"cell": cell, "versions": {"transformers": "5.0"}, "seconds": 1.0}
    if error:
        return {**base, "error": error}
    lines = [{"check": c, "scope": "s", "value": v, "bound": b, "unit": "u", "status": st, "detail": d}
             for c, v, b, st, d in lines]  # fmt: skip
    ok = all(x["status"] not in ("FAIL", "REFUSED") for x in lines) if passed is None else passed
    return {**base, "certificate": {"passed": ok, "lines": lines}}


def test_verdicts_read_from_the_lines():
    assert row(_record([("phase", 0.1, 1.0, "pass", "")])).verdict == PASSED
    only = row(_record([("phase", 0.1, 1.0, "pass", ""), ("refusal", "re-rotated", "raised", "FAIL", "d")]))
    assert only.verdict == REFUSAL_ONLY and only.checks == {"refusal"}
    both = row(_record([("phase", 5.0, 1.0, "FAIL", "angle wrong"), ("refusal", "merged", "raised", "FAIL", "")]))
    assert both.verdict == FAILED and both.checks == {"phase", "refusal"} and dict(both.measured)["phase"] == 5.0
    assert row(_record([], error="ModelError: no")).verdict == ERROR
    # A line whose value is within its bound but which failed says why, from its detail.
    r = row(_record([("length", 1e-7, 1e-6, "FAIL", "get_seq_length() is 24, not 48; more")]))
    assert "(get_seq_length() is 24, not 48)" in r.failing[0]
    # A raise is shown as what was raised, not as a missing value.
    r = row(_record([("phase", None, 1.0, "FAIL", "raised TypeError: boom at /x.py:1 in f")]))
    assert r.failing[0].endswith("raised TypeError: boom")


def test_comparable_ignores_timings_and_catches_a_changed_line():
    a = _record([("phase", 0.12345, 1.0, "pass", "")])
    b = json.loads(json.dumps(a))
    b["seconds"], b["certificate"]["lines"][0]["value"] = 99.0, 0.12346
    assert comparable(a) == comparable(b)  # timings aside, values to 3 digits
    b["certificate"]["lines"][0]["status"] = "FAIL"
    assert comparable(a) != comparable(b)


def test_splice_replaces_only_the_generated_block():
    text = f"head\n{BEGIN}\nold\n{END}\ntail\n"
    assert splice(text, "new") == f"head\n{BEGIN}\nnew\n{END}\ntail\n"
    assert splice("head\n", "new").endswith(f"{BEGIN}\nnew\n{END}\n")


def test_every_cell_of_the_grid_has_its_committed_record():
    want = {c["id"] for cs in cells().values() for c in cs}
    have = {p.stem for p in FIELD.glob("*.json")}
    assert want == have, (sorted(want - have)[:5], sorted(have - want)[:5])
    rows = load(FIELD)
    ops, models, grid = verdict_matrix(rows)
    assert sum(v is not None for g in grid for v in g) == len(rows)


def test_every_line_of_every_record_is_in_the_committed_rows():
    import csv

    with open(FIELD / LINES_CSV, newline="") as fh:
        committed = list(csv.DictReader(fh))
    assert committed == [{k: str(v) for k, v in r.items()} for r in line_rows(FIELD)]
    assert len({r["id"] for r in committed}) == len(list(FIELD.glob("*.json")))


def test_the_readme_prints_the_records_table():
    text = (ROOT / "results" / "README.md").read_text()
    assert f"{BEGIN}\n{markdown(load(FIELD))}\n{END}" in text, "re-run studies/field_audit.py to print the table"


#: Each failing (package, operation) of a real package: the reproductions that show it and its report.
REPROS = {
    ("MemoryOS", "merge (_concat_caches)"): ["memos_merge_phase.py", "memos_merge_sliding.py"],
    ("MemoryOS", "dump and load"): ["memos_files.py"],
    ("kvpress", "KeyRerotationPress(KnormPress)"): [
        "kvpress_dynamic_ntk.py", "kvpress_rerotation_partial.py", "kvpress_rerotation_interleaved.py",
        "kvpress_gemma3_text.py",
    ],
    ("kvpress", "KeyRerotationPress(SnapKVPress)"): [
        "kvpress_dynamic_ntk.py", "kvpress_rerotation_partial.py", "kvpress_rerotation_interleaved.py",
        "kvpress_gemma3_text.py",
    ],
    ("kvpress", "KnormPress, generate"): ["kvpress_generate_position.py", "kvpress_gemma3_text.py"],
    ("kvpress", "StreamingLLMPress, pipeline"): ["kvpress_gemma3_text.py"],
    # transformers refuses crop past a sliding window by name: a refusal, no defect (docs/field/transformers.md).
    ("transformers", "crop, then continue"): [],
}  # fmt: skip
REPORTS = {"MemoryOS": "MemoryOS.md", "kvpress": "kvpress.md", "transformers": "transformers.md"}


def test_every_failing_line_of_a_real_package_has_a_repro_and_a_report():
    failing = {(r.package, r.operation) for r in load(FIELD) if r.verdict in (FAILED, REFUSAL_ONLY)}
    assert failing == set(REPROS), sorted(failing ^ set(REPROS))
    for (package, _), scripts in REPROS.items():
        report = (ROOT / "docs" / "field" / REPORTS[package]).read_text()
        for script in scripts:
            assert (REPRO / script).is_file(), script
            assert f"results/field/repro/{script}" in report, f"{REPORTS[package]} does not name {script}"


@pytest.mark.parametrize("script", sorted(p.name for p in REPRO.glob("*.py") if not p.name.startswith("_")))
def test_each_repro_states_its_defect_and_exits_1_on_it(script):
    text = (REPRO / script).read_text()
    assert text.startswith('"""') and "Exit 1" in text and "verdict(" in text, script
    assert "import kvlab" not in text, f"{script} must run without kvlab (a maintainer's environment)"


def test_the_adapters_are_shown_in_full_in_the_docs():
    doc = (ROOT / "docs" / "field" / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", doc, flags=re.S)
    for path in sorted((ROOT / "studies" / "field" / "adapters").glob("*.py")):
        if path.name == "__init__.py":
            continue
        assert path.read_text() in blocks, f"docs/field/README.md does not show {path.name} as it is"
