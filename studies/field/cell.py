"""One environment's cells of the field audit, run inside that environment (``ENV/bin/python -m studies.field.cell``).

Reads a plan (JSON: a list of cells, see :mod:`studies.field.grid`), audits each cell in this process
with ``kvlab.audit`` (``kvlab.audit_engine`` for the engine merge) and writes one JSON record per cell
into ``--out``: the cell, the certificate (``Certificate.as_dict``) and the versions installed here.
A cell whose audit cannot start (the adapter does not import, kvlab refuses the target) is recorded
with its error instead: the package's code never takes the run down.
"""

from __future__ import annotations

import argparse
import json
import time
import traceback
from pathlib import Path

import kvlab
from kvlab.atomic import atomic_write_text
from kvlab.files.identity import package_versions


def run_cell(cell: dict) -> dict:
    """The record of one cell: its certificate, or the error that kept it from one."""
    t0 = time.perf_counter()
    record = {"cell": cell, "versions": package_versions("kvlab", "torch", "transformers", cell["package"])}
    try:
        model = kvlab.load_model(cell["model"])
        if cell["kind"] == "engine merge":
            from kvlab.measure.audit.target import ENGINE, resolve
            from kvlab.peers.audit import audit_engine, llama_cpp_cache_reuse

            cert = audit_engine(model, resolve(ENGINE, llama_cpp_cache_reuse))
        else:
            options = {k: cell[k] for k in ("positions", "reader") if cell.get(k)}
            cert = kvlab.audit(model, **{cell["kind"]: cell["target"]}, **options)
        record["certificate"] = cert.as_dict()
    except Exception as e:  # noqa: BLE001 - any failure of a foreign package is the cell's record
        record["error"] = f"{type(e).__name__}: {e}"[:2000]
        record["traceback"] = traceback.format_exc(limit=6)[-4000:]
    record["seconds"] = round(time.perf_counter() - t0, 2)
    return record


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--plan", required=True, help="a JSON list of cells")
    p.add_argument("--out", required=True, help="the folder the records go into, one <cell id>.json each")
    args = p.parse_args(argv)
    out = Path(args.out)
    for cell in json.loads(Path(args.plan).read_text()):
        record = run_cell(cell)
        atomic_write_text(out / f"{cell['id']}.json", json.dumps(record, indent=1) + "\n")
        cert = record.get("certificate")
        verdict = "error" if cert is None else ("pass" if cert["passed"] else "FAIL")
        print(f"field: {cell['id']}: {verdict} ({record['seconds']} s)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
