"""Metrics: phase angles, difference grids and KL behave as defined."""
from __future__ import annotations

import math

import torch

import kvlab
from kvlab.metrics import (context_reference, kv_diff, layer_position_grid, next_token_kl, phase_by_position,
                           phase_error, phase_reference)
from kvlab.rope import layer_ropes

from conftest import tiny

TEXTS = ["Cached keys remember where they were.", " A second fragment of text,", " and a third that lands last."]


def test_naive_phase_error_is_the_landing_offset_times_frequency():
    m = tiny("tiny-llama")
    fs = [kvlab.prefill(m, t) for t in TEXTS]
    ref = phase_reference(m, fs)
    naive = kvlab.merge(fs, "naive", m)
    phases = phase_error(naive, ref, m)
    inv = layer_ropes(m.model)[0].inv_freq.double()
    land = kvlab.landing_positions(fs)
    # At layer 0 of fragment 2 the naive key is the reference rotated back by exactly its offset.
    p0 = phases[0]
    n1, n2 = land[1], land[2]
    expected = torch.remainder(n1 * inv + math.pi, 2 * math.pi) - math.pi
    got = p0.angle[:, n1:n2].double()
    assert torch.allclose(got, expected.abs().expand_as(got), atol=1e-4)
    assert float(p0.angle[:, :n1].max()) < 1e-3  # first fragment sits where it belongs
    _, by_pos = phase_by_position(phases)
    assert by_pos[:n1].max() < 1e-3 < by_pos[n1:].min()


def test_rerotate_phase_error_is_tiny_everywhere():
    m = tiny("tiny-gemma3")
    fs = [kvlab.prefill(m, t) for t in TEXTS]
    phases = phase_error(kvlab.merge(fs, "rerotate", m), phase_reference(m, fs), m)
    assert max(float(p.angle.max()) for p in phases) < 1e-4
    assert {p.layer_type for p in phases} == {"sliding_attention", "full_attention"}


def test_grid_marks_positions_a_sliding_layer_dropped():
    m = tiny("tiny-gemma3")
    fs = [kvlab.prefill(m, t) for t in TEXTS]
    grid = layer_position_grid(kv_diff(kvlab.merge(fs, "naive", m), phase_reference(m, fs)))
    total = sum(f.length for f in fs)
    assert grid.shape == (4, total)
    assert torch.isnan(grid[0, : total - 7]).all() and not torch.isnan(grid[3]).any()


def test_kl_is_zero_against_itself_and_positive_for_naive():
    m = tiny("tiny-llama")
    fs = [kvlab.prefill(m, t) for t in TEXTS]
    joined = context_reference(m, fs)
    same = next_token_kl(m, kvlab.merge(fs, "reprefill", m), joined, [" and"])
    assert same[0]["kl"] == 0.0 and same[0]["agree"]
    naive = next_token_kl(m, kvlab.merge(fs, "naive", m), joined, [" and"])
    assert naive[0]["kl"] > 1e-6
