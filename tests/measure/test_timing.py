"""merge_clocks and merge_times: warm timings of a merge, on the wall clock and the process's CPU clock."""

from __future__ import annotations

import time

import pytest

import kvlab
from conftest import tiny
from kvlab.errors import MergeError
from kvlab.measure.fidelity import merge_clocks, merge_times


def fragments():
    m = tiny("tiny-llama")
    return m, [kvlab.prefill(m, "One fragment here.", bos=True), kvlab.prefill(m, " And another one.")]


def test_both_clocks_time_every_repeat():
    m, frags = fragments()
    for clock in ("wall", "cpu"):
        times = merge_times(m, frags, "rerotate", repeats=3, clock=clock)
        assert len(times) == 3 and all(t > 0 for t in times)


def test_the_cpu_clock_does_not_count_waiting(monkeypatch):
    # A merge that waits (as one does while other work holds the cores) costs wall time, not CPU time.
    m, frags = fragments()
    import kvlab.measure.fidelity as fidelity

    real = fidelity.merge

    def waiting(*args, **kwargs):
        time.sleep(0.05)
        return real(*args, **kwargs)

    monkeypatch.setattr(fidelity, "merge", waiting)
    assert min(merge_times(m, frags, "naive", repeats=2, clock="wall")) >= 0.05
    assert max(merge_times(m, frags, "naive", repeats=2, clock="cpu")) < 0.04


def test_a_clock_it_does_not_know_is_refused():
    m, frags = fragments()
    with pytest.raises(MergeError, match="'wall' or 'cpu'"):
        merge_times(m, frags, "naive", clock="monotonic")


def test_both_clocks_read_the_same_merges(monkeypatch):
    # One set of runs, read on both clocks: every merge that waits shows on the wall clock and
    # not on the CPU clock, and the merge runs warmup + repeats times, not twice that.
    m, frags = fragments()
    import kvlab.measure.fidelity as fidelity

    real, calls = fidelity.merge, []

    def waiting(*args, **kwargs):
        calls.append(1)
        time.sleep(0.05)
        return real(*args, **kwargs)

    monkeypatch.setattr(fidelity, "merge", waiting)
    t = merge_clocks(m, frags, "naive", repeats=3, warmup=1)
    assert len(calls) == 4 and len(t.wall) == len(t.cpu) == 3
    assert min(t.wall) >= 0.05 and max(t.cpu) < 0.04
    assert all(c <= w + 0.01 for w, c in zip(t.wall, t.cpu)), "each pair is one merge read on both clocks"
