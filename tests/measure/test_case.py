"""kvlab.Case: one object for fragments, both references and probes; the same numbers as building them by hand."""

from __future__ import annotations

import torch

import kvlab
from conftest import tiny
from kvlab.measure import references
from kvlab.measure.case import DEFAULT_PROBES, Case
from kvlab.measure.probes import read_probes

TEXTS = ["The first fragment of the case.", " The second fragment follows it."]
PROBES = [" and", " The"]


def same_cache(a, b) -> bool:
    return all(torch.equal(x.keys, y.keys) and torch.equal(x.values, y.values) for x, y in zip(a.layers, b.layers))


def test_case_builds_what_the_functions_build():
    m = tiny("tiny-gemma3")
    case = Case.from_texts(m, TEXTS, PROBES)
    frags = [kvlab.prefill(m, t, bos=(i == 0)) for i, t in enumerate(TEXTS)]
    assert [f.token_ids.tolist() for f in case.fragments] == [f.token_ids.tolist() for f in frags]
    assert case.landings == kvlab.landing_positions(frags)
    assert same_cache(case.phase, references.phase_reference(m, frags))
    assert same_cache(case.context, references.context_reference(m, frags))
    # The probes are read in one batched call: bit for bit that call, and each probe read alone to fp32 rounding.
    by_hand = read_probes(m, case.context, PROBES)
    for lp, r, probe in zip(case.context_dists, by_hand, PROBES, strict=True):
        assert torch.equal(lp, r.log_probs)
        torch.testing.assert_close(lp, references.next_token_dist(m, case.context, probe), rtol=0, atol=1e-5)
    assert case.describe()["lengths"] == [f.length for f in frags] and case.texts == TEXTS


def test_references_are_built_once_and_only_when_read():
    case = Case.from_texts(tiny("tiny-llama"), TEXTS, PROBES)
    assert "phase" not in case.__dict__ and "context" not in case.__dict__
    assert case.phase is case.phase and case.context is case.context
    first = case.context_dists
    assert all(a is b for a, b in zip(first, case.context_dists))  # read once per probe, then kept


def test_given_references_are_kept_as_they_are():
    m = tiny("tiny-llama")
    built = Case.from_texts(m, TEXTS, PROBES)
    given = Case(m, built.fragments, PROBES, phase=built.phase, context=built.context)
    assert given.phase is built.phase and given.context is built.context


def test_case_defaults_to_the_default_probes():
    assert Case.from_texts(tiny("tiny-llama")).probes == DEFAULT_PROBES


def test_fidelity_takes_a_case_as_its_reference():
    m = tiny("tiny-llama")
    case = Case.from_texts(m, TEXTS, PROBES)
    by_case = kvlab.fidelity(m, case.fragments, "naive", probes=PROBES, greedy_tokens=3, reference=case)
    by_cache = kvlab.fidelity(m, case.fragments, "naive", probes=PROBES, greedy_tokens=3)
    assert by_case.probes == by_cache.probes and by_case.kl_mean == by_cache.kl_mean
    assert (PROBES[0], 3) in case.reference._reads  # the case's reference kept the reading


def test_check_rows_reads_the_context_reference_once_per_probe(monkeypatch):
    from kvlab.measure import case as case_mod
    from kvlab.measure.check import check_rows

    calls = []
    real = case_mod.read_probes
    monkeypatch.setattr(case_mod, "read_probes", lambda *a, **k: calls.extend(a[2]) or real(*a, **k))
    rows = check_rows(tiny("tiny-llama"), TEXTS, PROBES)
    assert sorted(calls) == sorted(PROBES)  # once each, however many strategies are compared
    assert len([r for r in rows if "refused" not in r]) >= 4
