"""The order arm's layouts hold passage P at one offset and move order and nearness apart (kvlab.findings.order_arm)."""

from __future__ import annotations

import random

import pytest

from kvlab.errors import MergeError
from kvlab.findings import longctx, order_arm


@pytest.fixture(scope="module")
def arm(smollm2):
    s = longctx.make_set(smollm2, 2, 128, seed=0, people_per_passage=2)
    return s, order_arm.layouts(smollm2, s, random.Random("order arm test"))


def test_p_sits_second_at_one_offset_and_the_pairs_move_only_what_they_name(smollm2, arm):
    s, lays = arm
    assert tuple(lays) == order_arm.LAYOUTS
    lengths = {name: order_arm._lengths(smollm2, e) for name, e in lays.items()}
    offsets = {name: order_arm.landing_positions_of(smollm2, e)[1] for name, e in lays.items()}
    assert len(set(offsets.values())) == 1, offsets
    for e in lays.values():
        assert e.passages[1] == s.passages[0]
        assert all(q.passages == (1,) for q in e.questions) and e.questions

    def after_p(name: str) -> int:
        return sum(lengths[name][2:])

    # order: same offset, same distance to the question, a passage or filler after P
    assert after_p("first") == after_p("last+filler") > 0
    assert lays["first"].passages[2] == s.passages[1] and lays["last+filler"].passages[2] != s.passages[1]
    # nearness: the same layout with filler between P and the question, or not
    assert after_p("last") == 0 < after_p("last+filler")
    assert after_p("first+filler") > after_p("first")


def test_a_filler_a_token_short_is_refused(smollm2, arm, monkeypatch):
    s, _ = arm
    real = order_arm._matched

    def short(model, make, target, at, rng, tries=40):
        text = real(model, make, target, at, rng, tries)
        return " ".join(text.split()[:-1])

    monkeypatch.setattr(order_arm, "_matched", short)
    with pytest.raises(MergeError, match="different offsets"):
        order_arm.layouts(smollm2, s, random.Random("order arm test"))
