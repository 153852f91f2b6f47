"""The field audit's records (results/field/*.json): one per package x version x transformers x operation x model.

A record is what ``studies/field/cell.py`` wrote inside the package's environment: ``cell`` (the
grid's fields), ``versions`` (kvlab, torch, transformers and the package, as installed there) and
either ``certificate`` (``Certificate.as_dict``) or ``error`` (the audit could not start).
This module reads them into rows and prints the results table and the verdict matrix.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

#: Verdicts, in the order the matrix shows them. ``REFUSAL_ONLY``: not certified, but only the refusal
#: line failed, which reads the operation on kvlab's dynamic-NTK model, not on the cell's own.
PASSED, REFUSAL_ONLY, FAILED, ERROR = "certified", "not certified: refusal only", "not certified", "no audit"
VERDICTS = (PASSED, REFUSAL_ONLY, FAILED, ERROR)

#: Marks of results/README.md's generated table.
BEGIN = "<!-- generated: studies/field_audit.py (results/field/*.json) -->"
END = "<!-- end generated: field audit -->"


@dataclass(frozen=True)
class FieldRow:
    """One cell's verdict, and its failing lines as ``check (scope): value vs bound unit``."""

    id: str
    package: str
    version: str
    transformers: str
    operation: str
    model: str
    verdict: str
    failing: tuple[str, ...]
    details: tuple[str, ...]
    seconds: float
    measured: tuple[tuple[str, float | int | str | None], ...] = ()

    @property
    def checks(self) -> set[str]:
        """The names of the failing lines (``phase``, ``refusal`` ...)."""
        return {f.split(" (")[0] for f in self.failing}


def _num(x) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.3g}"
    return str(x)


def _failing(line: dict) -> str:
    """``check (scope): value vs bound unit``, or where the package raised, what it raised."""
    head = f"{line['check']} ({line['scope'][:48]})"
    if line["value"] is None and line["detail"].startswith("raised "):
        return f"{head}: raised {line['detail'][7:].split(' at /')[0][:100]}"
    got = f"{head}: {_num(line['value'])} vs {_num(line['bound'])} {line['unit']}".rstrip()
    within = isinstance(line["value"], (int, float)) and isinstance(line["bound"], (int, float))
    if within and line["value"] <= line["bound"]:
        # The value is within its bound; what failed is what the detail names first.
        got += f" ({line['detail'].split(';')[0][:90]})"
    return got + ("" if line["status"] == "FAIL" else " [refused]")


def row(record: dict) -> FieldRow:
    """A :class:`FieldRow` from one record."""
    cell = record["cell"]
    cert = record.get("certificate")
    if cert is None:
        verdict, failing, details, bad = ERROR, (), (record["error"],), []
    else:
        # A line with nothing of its own to read points at the phase line, which says why: not repeated.
        bad = [
            x for x in cert["lines"]
            if x["status"] in ("FAIL", "REFUSED") and not x["detail"].startswith("nothing to read")
        ]  # fmt: skip
        verdict = PASSED if cert["passed"] else FAILED
        if {x["check"] for x in bad} == {"refusal"}:
            verdict = REFUSAL_ONLY
        failing = tuple(_failing(x) for x in bad)
        details = tuple(x["detail"] for x in bad)
    return FieldRow(
        cell["id"], cell["package"], cell["version"], record["versions"]["transformers"], cell["operation"],
        cell["model"], verdict, failing, details, record["seconds"],
        tuple((x["check"], x["value"]) for x in bad),
    )  # fmt: skip


def load(folder) -> list[FieldRow]:
    """Every record under ``folder`` (``*.json``, not the repro folder), sorted by package, operation, release, model."""
    rows = [row(json.loads(p.read_text())) for p in sorted(Path(folder).glob("*.json"))]
    return sorted(rows, key=lambda r: (r.package, r.operation, r.transformers, r.model))


def markdown(rows: list[FieldRow]) -> str:
    """The results table: one line per cell, failing lines with each measured value beside its bound."""
    out = [
        "| package | version | transformers | operation | model | verdict | failing lines (value vs bound) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines = "; ".join(r.failing) if r.verdict != ERROR else r.details[0][:120]
        out.append(
            f"| {r.package} | {r.version} | {r.transformers} | {r.operation} | {r.model} | {r.verdict} | "
            f"{lines.replace('|', '/') or '-'} |"
        )
    return "\n".join(out)


def verdict_matrix(rows: list[FieldRow]) -> tuple[list[str], list[str], list[list[str | None]]]:
    """Operations (``package: operation @ transformers``) x models, each entry a verdict or None (not run)."""
    ops = sorted({f"{r.package}: {r.operation} @ {r.transformers}" for r in rows})
    models = sorted({r.model for r in rows}, key=lambda m: (not m.startswith("tiny"), m))
    grid: list[list[str | None]] = [[None] * len(models) for _ in ops]
    for r in rows:
        grid[ops.index(f"{r.package}: {r.operation} @ {r.transformers}")][models.index(r.model)] = r.verdict
    return ops, models, grid


#: The flat file of every line of every record: one row per cell and line (results/field/lines.csv).
LINES_CSV = "lines.csv"


def line_rows(folder) -> list[dict]:
    """Every line of every record under ``folder``, one row each, the cell's fields beside it (sorted by cell id).

    The field audit claims no interval: each cell is one deterministic audit of one model (its
    lines read seeded token ids on one cache), so these rows are what the table is recomputed from.
    A cell with no audit gives one row whose ``check`` is ``no audit``.
    """
    out = []
    for path in sorted(Path(folder).glob("*.json")):
        record = json.loads(path.read_text())
        cell = record["cell"]
        head = {k: cell[k] for k in ("id", "package", "version", "operation", "model")}
        head["transformers"] = record["versions"]["transformers"]
        cert = record.get("certificate")
        if cert is None:
            out.append({**head, "check": "no audit", "scope": "", "status": ERROR, "value": "", "bound": "",
                        "unit": "", "detail": record["error"][:300]})  # fmt: skip
            continue
        for x in cert["lines"]:
            out.append({**head, **{k: ("" if x[k] is None else x[k]) for k in ("check", "scope", "status", "value",
                        "bound", "unit")}, "detail": x["detail"][:300]})  # fmt: skip
    return out


def comparable(record: dict) -> dict:
    """What a re-run must reproduce of a record: the verdict and every line's check, scope, status and value
    (3 significant digits; timings, dates and the versions line aside), or the error's type."""
    cert = record.get("certificate")
    if cert is None:
        return {"error": record["error"].split(":")[0]}

    def value(v):
        return float(f"{v:.3g}") if isinstance(v, float) else v

    lines = [
        (x["check"], x["scope"], x["status"], value(x["value"])) for x in cert["lines"] if x["check"] != "versions"
    ]
    return {"passed": cert["passed"], "lines": lines}


def splice(text: str, table: str) -> str:
    """``text`` with the generated block between :data:`BEGIN` and :data:`END` replaced by ``table`` (or appended)."""
    block = f"{BEGIN}\n{table}\n{END}"
    if BEGIN in text and END in text:
        head, rest = text.split(BEGIN, 1)
        return head + block + rest.split(END, 1)[1]
    return text.rstrip("\n") + "\n\n" + block + "\n"
