"""A sweep's outputs for people and programs: tidy ``results.csv`` and ``index.html`` with plots.

``results.csv`` has one row per point and metric (a failed point without records gets one
row with an empty metric), with the swept parameters as columns. ``index.html`` plots
every metric against every swept parameter (one line per combination of the other swept
parameters, CI error bars where the record has one) and links every point's report.
"""

from __future__ import annotations

import csv
import io
import json
import math
from pathlib import Path

from kvlab.atomic import atomic_path, atomic_write_text
from kvlab.lab.pages import render

COLUMNS_TAIL = [
    "metric",
    "value",
    "unit",
    "ci_low",
    "ci_high",
    "n",
    "status",
    "error",
    "wall_s",
    "model_weights_sha256",
    "git_commit",
    "notebook_sha256",
    "report",
]


def _cell(v):
    if v is None:
        return ""
    if isinstance(v, (list, dict)):
        return json.dumps(v)
    return v


def rows(study, records: list[dict]) -> list[dict]:
    """The tidy table as dicts (one per point and metric)."""
    params = list(dict.fromkeys(study.axes + ["model_name"]))
    out = []
    for r in records:
        base = {
            "point": r["point"],
            **{k: r["parameters"].get(k, r.get(k) if k in ("model_name", "repeat") else None) for k in params},
        }
        common = {
            "status": r["status"],
            "error": r["error"],
            "wall_s": r["wall_s"],
            "model_weights_sha256": r["model_weights_sha256"],
            "git_commit": r["code"].get("git_commit"),
            "notebook_sha256": r["code"].get("notebook_sha256"),
            "report": f"points/{r['point']}/notebook.html",
        }
        metrics = r["records"] or [None]
        for m in metrics:
            row = dict(base)
            if m is None:
                row.update(metric=None, value=None, unit=None, ci_low=None, ci_high=None, n=None)
            else:
                row.update(
                    metric=m["name"],
                    value=m["value"],
                    unit=m["unit"],
                    ci_low=m["ci_low"],
                    ci_high=m["ci_high"],
                    n=m["n"],
                )
            row.update(common)
            out.append(row)
    return out


def write_csv(path: Path, study, records: list[dict]) -> Path:
    table = rows(study, records)
    head = ["point"] + list(dict.fromkeys(study.axes + ["model_name"])) + COLUMNS_TAIL
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=head, lineterminator="\n")
    w.writeheader()
    for row in table:
        w.writerow({k: _cell(row.get(k)) for k in head})
    return atomic_write_text(path, buf.getvalue())


def _num(v) -> float:
    if isinstance(v, str):
        return {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}.get(v, math.nan)
    return math.nan if v is None else float(v)


def _plot(path: Path, metric: str, unit: str, axis: str, others: list[str], points: list[tuple[dict, dict]]) -> None:
    """metric vs one swept parameter; one series per combination of the other swept parameters."""
    # matplotlib (the lab extra) is slow to import and picks its backend when pyplot is imported: on first use, with
    # the file backend, so that importing this module changes no notebook's backend.
    import matplotlib  # noqa: PLC0415 - see above

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415 - see above

    xs_all = [p[axis] if axis in p else rep for p, rep in ((pp, None) for pp, _ in points)]
    numeric = all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in xs_all)
    labels = list(dict.fromkeys(json.dumps(x) if not isinstance(x, str) else x for x in xs_all))
    series: dict[str, list] = {}
    for params, m in points:
        name = ", ".join(f"{o}={params.get(o)}" for o in others) or metric
        series.setdefault(name, []).append((params.get(axis), m))
    fig, ax = plt.subplots(figsize=(6, 3.6))
    for name, pts in series.items():
        if numeric:
            pts.sort(key=lambda t: t[0])
            x = [t[0] for t in pts]
        else:
            x = [labels.index(json.dumps(t[0]) if not isinstance(t[0], str) else t[0]) for t in pts]
        y = [_num(m["value"]) for _, m in pts]
        lo = [_num(m["value"]) - _num(m["ci_low"]) if m["ci_low"] is not None else 0.0 for _, m in pts]
        hi = [_num(m["ci_high"]) - _num(m["value"]) if m["ci_high"] is not None else 0.0 for _, m in pts]
        has_ci = any(m["ci_low"] is not None for _, m in pts)
        ax.errorbar(
            x, y, yerr=[lo, hi] if has_ci else None, marker="o", capsize=3, label=name if len(series) > 1 else None
        )
    if not numeric:
        ax.set_xticks(range(len(labels)), [l[:18] for l in labels], rotation=20, ha="right")
    ax.set_xlabel(axis)
    ax.set_ylabel(f"{metric} ({unit})" if unit else f"{metric} (no unit)")
    ax.set_title(f"{metric} vs {axis}" + (" (bars: CI)" if any(m["ci_low"] is not None for _, m in points) else ""))
    if 1 < len(series) <= 8:
        ax.legend(fontsize=7)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=90, format="png")
    plt.close(fig)


def write_index(out: Path, study, records: list[dict]) -> Path:
    ok = [r for r in records if r["status"] == "ok"]
    metrics: dict[str, str] = {}
    for r in ok:
        for m in r["records"]:
            metrics.setdefault(m["name"], m["unit"])
    plots_dir = out / "plots"
    plots_dir.mkdir(exist_ok=True)
    figs = []
    axes = [a for a in study.axes]
    for metric, unit in metrics.items():
        for axis in axes:
            pts = []
            for r in ok:
                params = dict(r["parameters"], repeat=r["repeat"])
                pts += [(params, m) for m in r["records"] if m["name"] == metric]
            if not pts:
                continue
            name = f"{metric}__{axis}.png".replace("/", "-")
            _plot(plots_dir / name, metric, unit, axis, [a for a in axes if a != axis], pts)
            figs.append({"file": name, "metric": metric, "axis": axis})
    failed = [r for r in records if r["status"] != "ok"]
    rows = []
    for r in records:
        shown = ", ".join(
            f"{k}={json.dumps(r['parameters'].get(k, r['repeat'] if k == 'repeat' else None))[:40]}" for k in axes
        )
        found = "; ".join(f"{m['name']} = {m['value']}{(' ' + m['unit']) if m['unit'] else ''}" for m in r["records"])
        rows.append(
            {
                "status": r["status"],
                "point": r["point"],
                "link": f"points/{r['point']}/notebook.html",
                "shown": shown,
                "wall": "" if r["wall_s"] is None else f"{r['wall_s']:.1f}",
                "found": found or (r["error"] or ""),
            }
        )
    body = render(
        "sweep_index.html",
        study_stem=study.path.stem,
        study_name=study.path.name,
        notebook=str(study.notebook),
        n_points=len(records),
        n_ok=len(ok),
        failed=[{"point": r["point"], "error": str(r["error"])} for r in failed],
        axes=axes,
        figures=figs,
        rows=rows,
    )
    return atomic_write_text(out / "index.html", body)


def write_summary(study, out: Path, records: list[dict]) -> None:
    write_csv(out / "results.csv", study, records)
    write_index(out, study, records)
