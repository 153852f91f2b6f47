"""kvlab's audits on MemOS's own installed code (MemoryOS on PyPI, ``memos/memories/activation/kv.py``).

MemOS joins activation memories with ``KVCacheMemory._concat_caches``: one ``torch.cat`` per layer,
keys left at the phase of the positions each was prefilled at, the tensors assigned onto fresh cache
layers. It stores them with ``KVCacheMemory.dump`` and ``load``: ``pickle`` both ways, and any error
on load swallowed into an empty memory. The adapters are the field audit's
(studies/field/adapters/memos.py); the last test is that study's CI cell.
"""

from __future__ import annotations

import json
from pathlib import Path

from installed import store_module

import kvlab
from kvlab.compat import ASSIGNED_LAYERS_READ_EMPTY
from kvlab.findings.field import comparable
from kvlab.measure.certificate import FAIL, PASS

store_module("MemoryOS", "memos.memories.activation.kv")

from studies.field.adapters.memos import STORE, concat  # noqa: E402
from studies.field.cell import run_cell  # noqa: E402
from studies.field.grid import cells  # noqa: E402

FIELD = Path(__file__).resolve().parents[2] / "results" / "field"


def _failing(cert) -> set[str]:
    return {x.check for x in cert.lines if x.status == FAIL}


def test_memos_concat_fails_on_phase_and_where_the_release_reads_assigned_layers_empty_on_length():
    cert = kvlab.audit(kvlab.load_model("tiny-llama"), merge=concat)
    # One memory is handed back as it is (no layers assigned), so the one-fragment line passes.
    expected = {"phase", "refusal"} | ({"length"} if ASSIGNED_LAYERS_READ_EMPTY else set())
    assert _failing(cert) == expected, cert.table(verbose=True)
    phase = next(x for x in cert.lines if x.check == "phase")
    assert "angle wrong" in phase.detail
    if ASSIGNED_LAYERS_READ_EMPTY:
        length = next(x for x in cert.lines if x.check == "length")
        assert "get_seq_length() is 0" in length.detail and "never initialized" in length.detail
    assert next(x for x in cert.lines if x.check == "values").status == PASS


def test_memos_files_run_a_pickle_and_load_damage_as_an_empty_memory():
    cert = kvlab.audit(kvlab.load_model("tiny-llama"), store=STORE)
    assert _failing(cert) == {"foreign reader", "truncated file", "corrupted file", "pickle payload"}, cert.table(
        verbose=True
    )
    payload = next(x for x in cert.lines if x.check == "pickle payload")
    assert payload.value == "ran" and "canary was created" in payload.detail
    assert next(x for x in cert.lines if x.check == "round trip").status == PASS


def test_the_field_audits_memos_merge_cell_reproduces_its_committed_record():
    """studies/field_audit.py's cell run here, on this cell's release: the committed record, timings aside."""
    import transformers

    want = [
        c for cs in cells().values() for c in cs
        if c["package"] == "MemoryOS" and c["kind"] == "merge" and c["model"] == "tiny-llama"
        and c["transformers"] == transformers.__version__
    ]  # fmt: skip
    assert len(want) == 1, f"the grid has no MemOS merge cell on transformers {transformers.__version__}"
    committed = json.loads((FIELD / f"{want[0]['id']}.json").read_text())
    assert comparable(run_cell(want[0])) == comparable(committed)
