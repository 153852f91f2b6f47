"""kvlab.record / kvlab.read_records: findings stored as data in an executed notebook."""

from __future__ import annotations

import json
import math

import nbformat
import numpy as np
import pytest
import torch
from nbclient import NotebookClient

import kvlab
from kvlab.findings.records import MIME_TYPE, make_record, record_text


def test_record_payload_is_rounded_plain_and_sorted():
    rec = make_record(
        "phase_error_low",
        np.float32(0.123456789),
        unit="rad",
        ci=(torch.tensor(0.1), 0.2),
        n=np.int64(30),
        model="tiny-llama",
        offsets=[np.int64(1), 2.0000001],
    )
    assert rec == {
        "name": "phase_error_low",
        "value": 0.123457,
        "unit": "rad",
        "ci_low": 0.1,
        "ci_high": 0.2,
        "n": 30,
        "extra": {"model": "tiny-llama", "offsets": [1, 2.0]},
    }
    assert type(rec["value"]) is float and type(rec["n"]) is int and type(rec["extra"]["offsets"][0]) is int
    assert record_text(rec) == "record: phase_error_low = 0.1235 rad [0.1, 0.2] (n=30)"
    # Strict JSON (no bare NaN) and the same bytes for the same finding.
    nan = make_record("undefined", float("nan"))
    assert nan["value"] == "NaN" and json.loads(json.dumps(nan, allow_nan=False))["value"] == "NaN"
    assert json.dumps(make_record("x", 1 / 3)) == json.dumps(make_record("x", 0.3333333333333))


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"value": "0.5"}, "value must be a number, got str"),
        ({"value": True}, "value must be a number, got a bool"),
        ({"value": torch.ones(3)}, "value must be a single number"),
        ({"value": None}, "value must be a number, got NoneType"),
        ({"value": 1.0, "ci": (0.3, 0.1)}, "ci low 0.3 is above ci high 0.1"),
        ({"value": 1.0, "ci": 0.3}, "ci must be a (low, high) pair"),
        ({"value": 1.0, "n": 2.5}, "n must be a non-negative integer"),
        ({"value": 1.0, "where": object()}, "extra 'where' must be a string"),
    ],
)
def test_bad_records_are_refused_naming_the_record(kwargs, words):
    with pytest.raises(kvlab.RecordError, match="record 'kl_mean'") as e:
        kvlab.record("kl_mean", **kwargs)
    assert words in str(e.value)
    assert isinstance(e.value, kvlab.KvlabError)


def test_records_round_trip_through_an_executed_notebook(tmp_path):
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_code_cell(
            "import kvlab, numpy as np\nkvlab.record('phase_error', np.float64(0.25), unit='rad', ci=(0.2, 0.3), n=12)"
        ),
        nbformat.v4.new_code_cell(
            "print('record: fake = 1.0')\n"  # text alone is not a record
            "kvlab.record('undefined', float('nan'), note='empty sample')"
        ),
    ]
    NotebookClient(nb, kernel_name="kvlab", timeout=120, resources={"metadata": {"path": str(tmp_path)}}).execute()
    path = tmp_path / "run.ipynb"
    nbformat.write(nb, path)

    recs = kvlab.read_records(path)
    assert [r["name"] for r in recs] == ["phase_error", "undefined"]
    assert recs[0] == {
        "name": "phase_error",
        "value": 0.25,
        "unit": "rad",
        "ci_low": 0.2,
        "ci_high": 0.3,
        "n": 12,
        "extra": {},
    }
    assert math.isnan(recs[1]["value"]) and recs[1]["extra"] == {"note": "empty sample"}
    # One output per record, carrying both the data and the human line.
    out = nb.cells[0].outputs
    assert len(out) == 1 and set(out[0]["data"]) == {MIME_TYPE, "text/plain"}
    assert out[0]["data"]["text/plain"] == "record: phase_error = 0.25 rad [0.2, 0.3] (n=12)"


def test_read_records_refuses_what_is_not_a_notebook(tmp_path):
    with pytest.raises(kvlab.RecordError, match="no notebook at"):
        kvlab.read_records(tmp_path / "missing.ipynb")
    (tmp_path / "bad.ipynb").write_text("not json")
    with pytest.raises(kvlab.RecordError, match="not a readable notebook"):
        kvlab.read_records(tmp_path / "bad.ipynb")


def test_a_ci_is_recorded_with_its_interval_n_and_caches():
    from kvlab.errors import RecordError
    from kvlab.measure.stats import mean_ci

    c = mean_ci([0.1, 0.2, 0.4, 0.3, 0.5, 0.6], clusters=[0, 0, 1, 1, 2, 2])
    rec = make_record("span_kl", c, unit="nats/token")
    by_hand = make_record("span_kl", c.mean, unit="nats/token", ci=(c.lo, c.hi), n=c.n, caches=c.n_clusters)
    assert rec == by_hand and rec["n"] == 6 and rec["extra"] == {"caches": 3}
    with pytest.raises(RecordError, match="a CI carries its own interval"):
        make_record("span_kl", c, ci=(0.0, 1.0))
