"""The engine audit: a merge that drives llama.cpp, checked through logits, line by line.

``engine_merges`` (this folder) holds a right merge and one defect each; each defect fails on
the line that names it, and llama.cpp's own cache reuse passes on both real models.
"""

from __future__ import annotations

import json

import engine_merges as E
import pytest

from conftest import IN_CI
from kvlab.cli import main
from kvlab.measure.certificate import FAIL, PASS
from kvlab.peers import llama_cpp as glue
from kvlab.peers.audit import audit_engine, llama_cpp_cache_reuse
from kvlab.testing import assert_engine_merge_conforms

needs_llama = pytest.mark.skipif(
    not glue.available() and not IN_CI, reason="llama-cpp-python not installed: " + glue.INSTALL_HINT
)
pytestmark = needs_llama

#: One short set: enough for every line but the far landing, in seconds.
SHORT = ((40, 56, 24),)


def failing(cert) -> list[str]:
    return [x.check for x in cert.lines if x.status == FAIL]


def status(cert, check: str) -> list[str]:
    return [x.status for x in cert.lines if x.check == check]


def test_llama_cpp_cache_reuse_passes_every_line_on_smollm2(smollm2):
    cert = audit_engine(smollm2)
    assert cert.passed, failing(cert)
    assert cert.target == "engine merge kvlab.peers.audit:llama_cpp_cache_reuse"
    assert status(cert, "phase") == [PASS, PASS]
    phase = [x.value for x in cert.lines if x.check == "phase"]
    assert max(phase) < 1e-9  # float32 rounding of the rotation, far under the bound
    assert cert.lines[0].check == "versions" and "llama_cpp_python" in cert.lines[0].detail


def test_llama_cpp_cache_reuse_passes_on_gemma3_and_a_merge_that_never_asks_is_caught(gemma3):
    cert = audit_engine(gemma3)
    assert cert.passed, failing(cert)
    # The window-only layout llama-server runs cannot shift: the merge refused it.
    assert status(cert, "refusal") == [PASS]
    phase = [x for x in cert.lines if x.check == "phase"]
    # Gemma 3's bound is llama.cpp's own distance from exact arithmetic, over kvlab's 1e-6 floor.
    assert any(x.bound > 1e-6 for x in phase) and all(x.value <= x.bound for x in phase)
    unchecked = audit_engine(gemma3, E.unchecked_reuse, fragment_sets=SHORT)
    assert failing(unchecked) == ["refusal"]


@pytest.mark.parametrize(
    "merge, lines",
    [
        (E.store_reuse, []),
        (E.no_shift, ["phase", "length"]),
        (E.off_by_one, ["phase", "length"]),
        (E.keeps_fragments, ["by reference"]),
        (E.merges_nothing, ["empty list"]),
    ],
)
def test_each_defect_fails_on_the_line_that_names_it(smollm2, merge, lines):
    cert = audit_engine(smollm2, merge, fragment_sets=SHORT)
    assert failing(cert) == lines
    if merge is E.off_by_one:
        phase = next(x for x in cert.lines if x.check == "phase")
        assert phase.value > 100 * phase.bound  # one position off is far beyond rounding
        assert "holds 121 tokens, not 120" in phase.detail
    if merge is E.keeps_fragments:
        detail = next(x.detail for x in cert.lines if x.check == "by reference")
        assert "sequence 1 (fragment 1) now holds positions 40..95, not 0..55" in detail


def test_a_merge_that_raises_fails_every_line_and_kvlab_goes_on(smollm2):
    cert = audit_engine(smollm2, E.raises_inside, fragment_sets=SHORT)
    assert failing(cert) == ["phase", "length", "by reference", "one fragment"]
    assert all(
        "KeyError: 'fragment table' at" in x.detail and "engine_merges.py" in x.detail
        for x in cert.lines
        if x.status == FAIL
    )
    assert status(cert, "empty list") == [PASS]


def test_the_pytest_helper_and_the_command(smollm2, tmp_path, capsys):
    assert assert_engine_merge_conforms(llama_cpp_cache_reuse, smollm2, fragment_sets=SHORT).passed
    with pytest.raises(AssertionError, match=r"(?s)does not conform on smollm2-135m:.*by reference"):
        assert_engine_merge_conforms(E.keeps_fragments, smollm2, fragment_sets=SHORT)
    out = tmp_path / "engine.json"
    assert main(["certify", "smollm2-135m", "--engine-merge", "engine_merges:off_by_one", "--json", str(out)]) == 1
    assert (
        "NOT certified; failing: phase (40 + 56 + 24 tokens), phase (448 + 64 tokens), length"
        in capsys.readouterr().out
    )
    assert json.loads(out.read_text())["target"] == "engine merge engine_merges:off_by_one"
    both = ["certify", "smollm2-135m", "--engine-merge", "--merge", "kvlab.testing:rerotate_merge"]
    assert main(both) == 2
    assert "--engine-merge is audited on its own" in capsys.readouterr().err
    assert main(["certify", "smollm2-135m", "--engine-merge", "engine_merges:nothing_here"]) == 2
    assert "has no 'nothing_here'" in capsys.readouterr().err
