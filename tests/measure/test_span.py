"""Answer-span scores: the true answer teacher-forced behind a merge and behind the joined prefill."""

from __future__ import annotations

import math

import pytest
import torch

import kvlab
from conftest import tiny
from kvlab.cache.fragments import clone_cache, tokenize
from kvlab.compat import forward
from kvlab.errors import MergeError
from kvlab.findings import longctx, qa
from kvlab.measure.case import FidelityReference
from kvlab.measure.metrics import kl_divergence
from kvlab.measure.references import context_reference
from kvlab.measure.span import span_scores

TEXTS = ["The first fragment of the case, with some more words.", " The second fragment follows it and goes on."]
PROBES = [" The keeper counted", " Maren was born in the year", " and"]
ANSWERS = ["forty-two ships", "1911", "Bergen"]


def case(name="tiny-llama"):
    m = tiny(name)
    frags = [kvlab.prefill(m, t, bos=(i == 0)) for i, t in enumerate(TEXTS)]
    return m, frags, FidelityReference(m, context_reference(m, frags))


@torch.inference_mode()
def forced(m, cache, probe, answer):
    """The old way: a clone of the cache, the probe, then the answer one token per forward pass."""
    work = clone_cache(cache, m.config)
    ids, at, rows = tokenize(m, probe)[None], cache.get_seq_length(), []
    feed = tokenize(m, " " + answer).tolist()
    for tok in feed:
        pos = torch.arange(at, at + ids.shape[-1])[None]
        logits = forward(m.model, work, input_ids=ids, position_ids=pos, use_cache=True).logits[0, -1]
        rows.append(torch.log_softmax(logits.double(), -1))
        at += ids.shape[-1]
        ids = torch.tensor([[tok]])
    return torch.stack(rows), torch.tensor(feed)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gemma3"])
def test_span_scores_are_the_token_by_token_teacher_forcing(name):
    m, frags, ref = case(name)
    merged = kvlab.merge(frags, "naive", m)
    for p, a, s in zip(PROBES, ANSWERS, span_scores(m, merged, ref, PROBES, ANSWERS)):
        got, feed = forced(m, merged, p, a)
        want, _ = forced(m, ref.cache, p, a)
        assert s["span_tokens"] == len(feed) > 1 and s["probe"] == p
        assert s["kl"] == pytest.approx(kl_divergence(want[0], got[0]), rel=1e-4, abs=1e-9)
        per_token = [kl_divergence(w, g) for w, g in zip(want, got)]
        assert s["span_kl"] == pytest.approx(sum(per_token) / len(feed), rel=1e-4, abs=1e-9)
        assert s["nll"] == pytest.approx(-float(got[torch.arange(len(feed)), feed].sum()), rel=1e-5)
        assert s["nll_ref"] == pytest.approx(-float(want[torch.arange(len(feed)), feed].sum()), rel=1e-5)
    # A naive merge moves the answer tokens, not only the first one.
    assert max(s["span_kl"] for s in span_scores(m, merged, ref, PROBES, ANSWERS)) > 1e-6  # rounding alone is ~1e-12


def test_a_merge_equal_to_the_joined_prefill_scores_exactly_zero():
    m, frags, ref = case("tiny-gemma3")
    for s in span_scores(m, kvlab.merge(frags, "reprefill", m), ref, PROBES, ANSWERS):
        assert s["span_kl"] == 0.0 and s["nll"] == s["nll_ref"] and math.isfinite(s["nll"])


def test_what_span_scores_refuses():
    m, frags, ref = case()
    with pytest.raises(MergeError, match="2 answers for 3 probes"):
        span_scores(m, ref.cache, ref, PROBES, ANSWERS[:2])
    with pytest.raises(MergeError, match="empty"):
        span_scores(m, ref.cache, ref, PROBES, ["a", " ", "b"])
    with pytest.raises(MergeError, match="2 answers for 3 probes"):
        kvlab.fidelity(m, frags, "naive", probes=PROBES, greedy_tokens=0, answers=ANSWERS[:2])


def test_fidelity_and_ask_carry_the_span_scores():
    m, frags, ref = case("tiny-gemma3")
    fid = kvlab.fidelity(m, frags, "rerotate", probes=PROBES, greedy_tokens=2, reference=ref, answers=ANSWERS)
    assert fid.span_kl_mean == pytest.approx(sum(r["span_kl"] for r in fid.probes) / len(PROBES))
    assert fid.row()["span_kl_mean"] == fid.span_kl_mean
    assert kvlab.fidelity(m, frags, "rerotate", probes=PROBES, greedy_tokens=0, reference=ref).span_kl_mean is None
    s = longctx.make_set(m, 2, 40, seed=3, max_questions=4)
    rows = qa.ask(m, s, {"naive": "naive", "reprefill": "reprefill"}, greedy_tokens=3)
    assert {"span_kl", "nll", "nll_ref", "span_tokens"} <= set(rows[0])
    assert all(r["span_kl"] == 0.0 for r in rows if r["strategy"] == "reprefill")
    for r in rows:
        r["n_fragments"] = 2
    summary = {r["strategy"]: r for r in longctx.summarize(rows)}
    assert summary["reprefill"]["span_kl"].mean == 0.0 and summary["naive"]["span_kl"].n == len(s.questions)
    assert summary["naive"]["ref_em"].mean == summary["reprefill"]["em"].mean
