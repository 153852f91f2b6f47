"""Auditing a store's own merge, shift and store: kvlab's own pass, and each one-defect version fails the line naming it.

The wrong implementations live in ``audit_targets.py`` (this folder), written from each defect's
description; the CLI imports them as ``audit_targets:NAME``.
"""

from __future__ import annotations

import functools
import inspect
import json
import subprocess
import sys
from pathlib import Path

import audit_targets as T
import pytest

import kvlab
from conftest import TINY_HERE, tiny
from kvlab.cli import main
from kvlab.compat import ASSIGNED_LAYERS_READ_EMPTY
from kvlab.errors import AuditTargetError
from kvlab.measure.audit.run import audit
from kvlab.measure.audit.target import SIGNATURES, Target, TargetRaised, load_object
from kvlab.measure.certificate import FAIL, NA, PASS, REFUSED
from kvlab.testing import assert_merge_conforms, assert_shift_conforms, assert_store_conforms

HERE = Path(__file__).resolve().parent

#: Tiny models whose rotations compose (all but dynamic NTK): kvlab's own pass every line on each.
COMPOSING = sorted(set(TINY_HERE) - {"tiny-dynamic"})

#: Every check a merge audit reports, in order (the first line is the versions it ran under).
MERGE_CHECKS = [
    "versions", "phase", "values", "length", "by reference", "sliding window", "dtype and device", "one fragment",
    "empty list", "refusal", "context error",
]  # fmt: skip
SHIFT_CHECKS = ["versions", "phase", "values", "length", "by reference", "zero shift", "dtype and device", "refusal"]
STORE_CHECKS = ["versions", "round trip", "foreign reader", "truncated file", "corrupted file", "pickle payload"]


@functools.cache
def certificate(model: str, kind: str, name: str):
    """The audit of ``audit_targets.<name>`` (a ``kind``) on a tiny model, run once per session."""
    return audit(tiny(model), **{kind: getattr(T, name)})


def failing(cert) -> set[str]:
    return {line.check for line in cert.lines if line.failed}


def line(cert, check: str):
    """The one line of ``check`` (a check measured per layer kind has several: not for those)."""
    (found,) = [x for x in cert.lines if x.check == check]
    return found


# -- what passes ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "model, name",
    [
        ("tiny-llama", "rerotate_merge"),
        ("tiny-llama", "store_merge"),  # a merge written by hand the way stores do, right: the audit rewards the maths
        ("tiny-gemma3", "rerotate_merge"),  # sliding and full layers, two bases
        ("tiny-gemma3", "store_merge"),
        ("tiny-yarn", "store_merge"),
        ("tiny-phi", "store_merge"),  # partial rotary
        ("tiny-smollm3", "rerotate_merge"),  # NoPE layers
        ("tiny-cohere", "rerotate_merge"),  # interleaved pairs
        # Latent attention, its rotary key where the release caches it (kvlab.compat.mla_cache_layout);
        # 4.x's DeepSeek-V3 cannot run in float64 (kvlab.compat.family_problem), V2 can.
        (next(n for n in ("tiny-deepseek-v3", "tiny-deepseek-v2") if n in TINY_HERE), "rerotate_merge"),
    ],
)
def test_right_merges_pass_every_line(model, name):
    cert = certificate(model, "merge", name)
    assert cert.passed, cert.table(verbose=True)
    assert list(dict.fromkeys(x.check for x in cert.lines)) == MERGE_CHECKS
    kinds = {r.kind for r in kvlab.layer_ropes(tiny(model).model)}
    assert {x.scope.split(" layers")[0] for x in cert.lines if x.check == "phase"} == kinds
    sliding = line(cert, "sliding window").status
    assert sliding == (PASS if model == "tiny-gemma3" else NA)
    for x in cert.lines:
        if x.status == PASS and isinstance(x.value, float) and isinstance(x.bound, float):
            assert x.value <= x.bound, x
    # The phase line has teeth on this very model: a naive concatenation is far past rounding (NoPE layers excepted).
    for x in cert.lines:
        if x.check == "phase" and "(NoPE)" not in x.scope:
            assert float(x.detail.split("a naive concatenation ")[1].split(" x")[0]) > 1e3, x


def test_the_helpers_pass_kvlabs_own_and_return_the_certificate():
    cert = assert_merge_conforms(T.rerotate_merge)  # tiny-llama unless told
    assert cert.passed and cert.model == "tiny-llama" and cert.target == "merge kvlab.testing:rerotate_merge"
    assert assert_shift_conforms(T.kvlab_shift, model="tiny-gemma3").passed
    assert assert_store_conforms(T.kvlab_store, model=tiny("tiny-gemma3")).passed  # a loaded model does too


@functools.cache
def own(model: str):
    """kvlab's own merge, shift and files audited together on ``model``."""
    return audit(tiny(model), merge=T.rerotate_merge, shift=T.kvlab_shift, store=T.kvlab_store)


@pytest.mark.parametrize("model", COMPOSING)
def test_kvlabs_own_merge_shift_and_files_pass_on_every_model_that_composes(model):
    cert = own(model)
    assert cert.passed, cert.table(verbose=True)
    checks = list(dict.fromkeys(x.check for x in cert.lines))
    assert checks == list(dict.fromkeys(MERGE_CHECKS + SHIFT_CHECKS + STORE_CHECKS))
    # Three targets in one certificate: each line says which it belongs to.
    assert {x.scope.split(":")[0] for x in cert.lines if x.check != "versions"} == {"merge", "shift", "store"}


def test_on_a_model_that_does_not_compose_kvlabs_own_are_refused_not_failed():
    cert = own("tiny-dynamic")
    assert not cert.passed
    statuses = {(x.scope.split(":")[0], x.check): x.status for x in cert.lines}
    refused = {k for k, v in statuses.items() if v == REFUSED}
    assert {c for _, c in refused} == {
        "phase", "values", "length", "by reference", "dtype and device", "one fragment", "zero shift",
    }  # fmt: skip
    assert FAIL not in statuses.values()
    assert all(statuses[("store", c)] == PASS for c in STORE_CHECKS[1:])
    # A merge that goes ahead where kvlab refuses fails, naming why.
    bare = certificate("tiny-dynamic", "merge", "bare_concat")
    phase = line(bare, "phase")
    assert phase.status == FAIL and "whose rotations do not compose: rope_type 'dynamic'" in phase.detail


def test_longrope_shifts_past_the_switch_are_refused_and_the_rest_measured():
    (phase,) = [x for x in own("tiny-longrope").lines if x.check == "phase" and x.scope.startswith("shift")]
    assert phase.status == PASS and "refused, as kvlab refuses them, at shifts [37, 976]" in phase.detail


# -- one defect, one line ------------------------------------------------------------------------------------------

#: name in audit_targets, model, the line that names the defect, the other lines it fails, words the named line says.
DEFECTS = [
    ("bare_concat", "tiny-llama", "phase", {"refusal"}, "angle wrong"),
    ("wrong_sign", "tiny-llama", "phase", set(), "angle wrong"),
    ("off_by_one", "tiny-llama", "phase", set(), "angle wrong"),
    ("rotated_values", "tiny-llama", "values", set(), "max relative difference"),
    ("interleaved_pairs", "tiny-llama", "phase", set(), "angle wrong"),
    ("half_precision_angles", "tiny-llama", "phase", set(), "angle wrong"),
    ("first_by_reference", "tiny-llama", "by reference", set(), "by the merge: fragment 0 layer 0: length 16 -> 44"),
    ("yarn_scale_twice", "tiny-yarn", "phase", set(), "pair norm wrong"),
    ("full_rotary", "tiny-phi", "phase", set(), "non-rotary dims wrong"),
    ("untruncated_sliding", "tiny-gemma3", "sliding window", {"length", "one fragment"}, "wrong at layers [0, 1, 2]"),
]


@pytest.mark.parametrize("name, model, named, others, words", DEFECTS, ids=[d[0] for d in DEFECTS])
def test_each_wrong_merge_fails_on_the_line_that_names_it(name, model, named, others, words):
    cert = certificate(model, "merge", name)
    assert failing(cert) == {named} | others, cert.table(verbose=True)
    assert words in " ".join(x.detail for x in cert.lines if x.check == named), cert.table(verbose=True)
    # The same model with kvlab's merge passes: the line failed for the defect, not for the model.
    assert certificate(model, "merge", "rerotate_merge").passed


def test_the_length_line_isolates_bookkeeping_from_phase():
    # The length line reads the result against its own tensors in a cache kvlab built, so a phase defect
    # passes it (the phase line names that one); its detail still gives the distance from kvlab's rerotate.
    def behind_rerotate(name):
        detail = line(certificate("tiny-llama", "merge", name), "length").detail
        return float(detail.split("behind kvlab's rerotate ")[1].split(" nats")[0])

    assert line(certificate("tiny-llama", "merge", "wrong_sign"), "length").status == PASS
    assert behind_rerotate("wrong_sign") > 100 * behind_rerotate("store_merge")


def test_assigned_layers_fail_the_length_line_on_the_releases_that_read_them_empty():
    # The same code is right on 4.56 and wrong from 4.57 (kvlab.compat.ASSIGNED_LAYERS_READ_EMPTY): the
    # audit judges what the store's release does with it, so it must run on that release.
    cert = certificate("tiny-llama", "merge", "assigned_layers")
    if not ASSIGNED_LAYERS_READ_EMPTY:
        assert cert.passed, cert.table(verbose=True)
        return
    assert failing(cert) == {"length", "one fragment"}, cert.table(verbose=True)
    assigned = line(cert, "length")
    assert assigned.value > 1e-3 and "get_seq_length() is 0, not 44" in assigned.detail
    assert "never initialized" in assigned.detail


@pytest.mark.parametrize(
    "kind, name, lines",
    [
        ("shift", "shift_wrong_sign", {"phase"}),
        ("shift", "shift_sharing_values", {"by reference"}),
        ("store", "pickle_store", {"pickle payload"}),
        ("store", "plain_store", {"foreign reader", "corrupted file"}),
        ("store", "forgiving_store", {"foreign reader", "truncated file", "corrupted file"}),
    ],
)
def test_each_wrong_shift_and_store_fails_on_its_line(kind, name, lines):
    cert = certificate("tiny-llama", kind, name)
    assert failing(cert) == lines, cert.table(verbose=True)


def test_the_pickle_line_watches_a_canary_the_payload_creates():
    payload = line(certificate("tiny-llama", "store", "pickle_store"), "pickle payload")
    assert payload.value == "ran" and "canary was created" in payload.detail
    # kvlab's own loader refuses the same bytes unopened.
    ok = line(certificate("tiny-llama", "store", "kvlab_store"), "pickle payload")
    assert ok.status == PASS and "is a Python pickle" in ok.detail


def test_damaged_files_that_load_as_empty_caches_are_named():
    cert = certificate("tiny-llama", "store", "forgiving_store")
    assert line(cert, "truncated file").value == "empty cache"
    assert line(cert, "foreign reader").value == "empty cache"
    assert "takes no model" in line(certificate("tiny-llama", "store", "plain_store"), "foreign reader").detail


# -- foreign code never takes kvlab down; bad input is named --------------------------------------------------------


def test_an_exception_in_the_target_is_a_failing_line_naming_its_frame():
    cert = certificate("tiny-llama", "merge", "raises_inside")
    assert [x.check for x in cert.lines if x.check != "phase"] == MERGE_CHECKS[:1] + MERGE_CHECKS[2:]
    lineno = inspect.getsourcelines(T.raises_inside)[1] + 2
    phase = line(cert, "phase")
    assert phase.status == FAIL and f"audit_targets.py:{lineno} in raises_inside" in phase.detail
    assert phase.detail.startswith("raised KeyError")
    # Where the last frame is a library's, the target's own line is named beside it.
    with pytest.raises(TargetRaised) as info:
        Target.of(T.raises_in_a_library, "merge raises_in_a_library", "merge").call([], None)
    lineno = inspect.getsourcelines(T.raises_in_a_library)[1] + 2
    assert "JSONDecodeError" in info.value.failure and "json/decoder.py" in info.value.failure
    assert f"(called from tests/measure/audit_targets.py:{lineno} in raises_in_a_library)" in info.value.failure


def test_sys_exit_in_the_target_is_caught():
    def exits(caches):
        sys.exit(3)

    with pytest.raises(TargetRaised) as info:
        Target.of(exits, "merge exits", "merge").call([], None)
    assert info.value.failure.startswith("SystemExit: 3 at ")


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"merge": "no_such_module_anywhere:f"}, "cannot import module 'no_such_module_anywhere'"),
        ({"merge": "audit_targets:no_such_name"}, "has no 'no_such_name'"),
        ({"merge": "audit_targets.bare_concat"}, "is not MODULE:NAME"),
        ({"merge": T.three_arguments}, "the merge contract calls it as (caches) or (caches, model)"),
        ({"shift": T.bare_concat}, "the shift contract calls it as (cache, delta) or (cache, delta, model)"),
        ({"merge": T.returns_a_list}, "returned a builtins.list"),
        ({"store": T.PlainStore}, "is a class; point at an instance"),
        ({"store": T.bare_concat}, "has no callable save or load"),
        ({}, "nothing to audit"),
    ],
)
def test_bad_targets_are_refused_by_name(kwargs, words):
    with pytest.raises(AuditTargetError) as info:
        audit(tiny("tiny-llama"), **kwargs)
    assert words in str(info.value)
    assert isinstance(info.value, kvlab.KvlabError)


def test_signatures_with_an_optional_model_get_it():
    assert Target.of(lambda caches, model=None: None, "m", "merge").takes_model
    assert not Target.of(lambda caches: None, "m", "merge").takes_model
    assert Target.of(lambda *a: None, "m", "merge").takes_model
    assert [len(a) for a in SIGNATURES["load"]] == [1, 2]
    assert load_object("audit_targets:kvlab_store.load").__self__ is T.kvlab_store


# -- where users run it ------------------------------------------------------------------------------------------


def test_the_pytest_helper_fails_with_the_failing_lines():
    with pytest.raises(AssertionError) as info:
        assert_merge_conforms(T.bare_concat, model="tiny-llama")
    message = str(info.value)
    assert message.startswith("merge audit_targets:bare_concat does not conform on tiny-llama:")
    assert "  phase (default layers" in message and "  refusal (2 fragments of tiny-dynamic" in message
    assert "angle wrong" in message and "values" not in message.split("\n", 1)[0]
    with pytest.raises(AssertionError, match="pickle payload"):
        assert_store_conforms(T.pickle_store)


def test_cli_audits_a_merge_with_the_certificates_exit_codes_and_json(tmp_path, capsys):
    out = tmp_path / "audit.json"
    assert main(["certify", "tiny-llama", "--merge", "audit_targets:off_by_one", "--json", str(out)]) == 1
    printed = capsys.readouterr().out
    assert "merge audit_targets:off_by_one on tiny-llama: NOT certified; failing: phase" in printed
    record = json.loads(out.read_text())
    assert record["target"] == "merge audit_targets:off_by_one" and record["passed"] is False
    assert record["versions"]["transformers"] and record["lines"][0]["check"] == "versions"
    assert [x["check"] for x in record["lines"] if x["status"] == FAIL] == ["phase"]
    both = ["certify", "tiny-llama", "--merge", "kvlab.testing:rerotate_merge", "--store", "audit_targets:kvlab_store"]
    assert main(both) == 0
    printed = capsys.readouterr().out
    assert "merge: default layers" in printed and "store: " in printed and "certified" in printed


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--merge", "audit_targets:three_arguments"], "AuditTargetError: merge audit_targets:three_arguments has"),
        (["--merge", "nope_nothing:f"], "cannot import module 'nope_nothing'"),
        (["--store", "audit_targets:returns_a_list"], "has no callable save or load"),
    ],
)
def test_cli_refuses_bad_targets_with_exit_2(argv, words, capsys):
    assert main(["certify", "tiny-llama", *argv]) == 2
    assert words in capsys.readouterr().err


def test_the_command_imports_a_store_from_the_current_folder():
    # What a store's CI runs: the console script from its checkout, no PYTHONPATH.
    kvlab_cmd = Path(sys.executable).with_name("kvlab")
    run = subprocess.run(
        [str(kvlab_cmd), "certify", "tiny-llama", "--shift", "audit_targets:shift_wrong_sign"],
        cwd=HERE,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 1, run.stdout[-2000:] + run.stderr[-2000:]
    assert "shift audit_targets:shift_wrong_sign on tiny-llama: NOT certified; failing: phase" in run.stdout
