"""Metrics: phase angles, difference grids and KL behave as defined."""

from __future__ import annotations

import math

import torch

import kvlab
from conftest import tiny
from kvlab.cache.fragments import clone_cache
from kvlab.measure.metrics import (
    kv_diff,
    layer_position_grid,
    max_phase_error,
    next_token_kl,
    phase_beyond_rounding,
    phase_by_position,
    phase_error,
    weighted_phase_error,
)
from kvlab.measure.references import context_reference, phase_reference
from kvlab.models.layout import layer_ropes

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
    assert max_phase_error(phases) < 1e-4 and phase_beyond_rounding(phases) <= 1.0
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
    # Bit-identical caches: KL is exactly 0 (no clamp in kvlab hides a negative rounding error).
    assert same[0]["kl"] == 0.0 and same[0]["agree"]
    naive = next_token_kl(m, kvlab.merge(fs, "naive", m), joined, [" and"])
    assert naive[0]["kl"] > 1e-6


def _pair_rotated(keys: torch.Tensor, pair: int, theta: float) -> torch.Tensor:
    """``keys`` ``[1, H, T, D]`` with rotary pair ``pair`` (dims ``pair``, ``pair + D/2``) turned by ``theta``."""
    out = keys.clone()
    h = keys.shape[-1] // 2
    x1, x2 = keys[..., pair], keys[..., pair + h]
    c, s = math.cos(theta), math.sin(theta)
    out[..., pair], out[..., pair + h] = x1 * c - x2 * s, x1 * s + x2 * c
    return out


def test_zero_norm_pairs_are_masked_and_do_not_hide_a_real_error():
    m = tiny("tiny-llama")
    frag = kvlab.prefill(m, TEXTS[0])
    ref = clone_cache(frag.cache, m.config)
    cache = clone_cache(frag.cache, m.config)
    h = ref.layers[0].keys.shape[-1] // 2
    for layer_ref, layer in zip(ref.layers, cache.layers):
        # Pair 3 is empty in both caches, with zeros of opposite signs: atan2 of them is pi.
        layer_ref.keys[..., 3] = 0.0
        layer_ref.keys[..., 3 + h] = 0.0
        layer.keys[..., 3] = -0.0
        layer.keys[..., 3 + h] = 0.0
        layer.keys[..., 3 + h].neg_()
        # Pair 5 carries a real error of 0.25 rad.
        layer.keys.copy_(_pair_rotated(layer.keys, 5, 0.25))
    unmasked = phase_error(cache, ref, m, min_norm=None)  # nothing masked: the old definition
    assert float(unmasked[0].angle[..., 3].max()) > 3.0  # the artefact this metric must not report
    phases = phase_error(cache, ref, m)
    for p in phases:
        assert p.masked[..., 3].all() and not p.masked[..., 5].any()
        assert torch.allclose(p.angle[..., 5].double(), torch.full_like(p.angle[..., 5].double(), 0.25), atol=1e-5)
        others = [i for i in range(h) if i not in (3, 5)]
        assert float(p.angle[..., others].max()) == 0.0
    assert abs(max_phase_error(phases) - 0.25) < 1e-5
    _, by_pos = phase_by_position(phases)
    # Mean over the h - 1 unmasked pairs: one of them is off by 0.25, the rest by nothing.
    assert torch.allclose(by_pos.double(), torch.full_like(by_pos.double(), 0.25 / (h - 1)), atol=1e-6)
    w = weighted_phase_error(phases)
    assert 0.0 < w < 0.25 and math.isclose(
        w, weighted_phase_error(unmasked), rel_tol=1e-12
    )  # no mask needed: empty pairs weigh 0
    assert phase_beyond_rounding(phases) > 100  # the real error is far beyond rounding
    clean = phase_error(clone_cache(ref, m.config), ref, m)
    assert phase_beyond_rounding(clean) == 0.0 and all(p.masked[..., 3].all() for p in clean)


def test_masked_pairs_are_gaps_in_the_head_plot():
    import numpy as np

    from kvlab.lab.plots import phase_vs_position_head

    m = tiny("tiny-llama")
    frag = kvlab.prefill(m, TEXTS[0])
    ref = clone_cache(frag.cache, m.config)
    ref.layers[0].keys[:, 0, 2] = 0.0  # every pair of head 0 at position 2 is empty
    phases = phase_error(kvlab.merge([frag], "naive", m), ref, m)
    fig = phase_vs_position_head(phases[0], 0, "gap", [0])
    for line in fig.axes[0].get_lines():
        y = np.asarray(line.get_ydata(), dtype=float)
        if y.size == frag.length:
            assert np.isnan(y[2]) and not np.isnan(np.delete(y, 2)).any()
