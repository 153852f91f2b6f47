"""rerotate against the phase reference on every rope variant, and the rotation algebra."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvlab
from conftest import tiny
from kvlab.measure.metrics import kv_diff
from kvlab.measure.references import phase_reference
from kvlab.models.layout import layer_ropes
from kvlab.models.rope import rotate_keys

COMPOSING = ["tiny-llama", "tiny-qwen2", "tiny-gemma3", "tiny-gptneox", "tiny-phi", "tiny-llama3", "tiny-yarn"]
# Three fragments of different lengths, each longer than tiny-gemma3's window of 8, so
# sliding layers drop tokens both inside fragments and across the merge.
TEXTS = ["Cached keys remember where they were.", " A second fragment of text,", " and a third that lands last."]


def rel_max_layer_error(cache, ref) -> float:
    """max over layers of max|K - K_ref| / max|K_ref|."""
    worst = 0.0
    for li, d in enumerate(kv_diff(cache, ref)):
        scale = ref.layers[li].keys.abs().max().item()
        worst = max(worst, d.k.max().item() / scale)
    return worst


@pytest.mark.parametrize("name", COMPOSING)
def test_rerotate_matches_phase_reference_tiny(name):
    m = tiny(name)
    frags = [kvlab.prefill(m, t) for t in TEXTS]
    ref = phase_reference(m, frags)
    merged = kvlab.merge(frags, "rerotate", m)
    naive = kvlab.merge(frags, "naive", m)
    # fp32, measured max relative error 2.3e-7 .. 8.1e-7 across these models: a few ulps of
    # the reference's own fp32 angle (pos * inv_freq) rounding. Naive is off by O(1).
    assert rel_max_layer_error(merged, ref) < 5e-6
    assert rel_max_layer_error(naive, ref) > 1e-2
    assert merged.get_seq_length() == sum(f.length for f in frags)


@pytest.mark.parametrize("name", COMPOSING)
def test_rerotate_layer0_matches_joined_prefill(name):
    # Layer 0 keys see no context, so here the full-context reference must match too.
    m = tiny(name)
    frags = [kvlab.prefill(m, t) for t in TEXTS]
    merged = kvlab.merge(frags, "rerotate", m)
    joined = kvlab.joined_prefill(m, frags).cache
    k, kr = merged.layers[0].keys, joined.layers[0].keys
    assert (k - kr).abs().max().item() < 5e-6 * kr.abs().max().item()


def test_gemma3_sliding_layers_keep_what_a_prefill_keeps():
    m = tiny("tiny-gemma3")
    frags = [kvlab.prefill(m, t) for t in TEXTS]
    merged = kvlab.merge(frags, "rerotate", m)
    joined = kvlab.joined_prefill(m, frags).cache
    total = sum(f.length for f in frags)
    for li, (a, b) in enumerate(zip(merged.layers, joined.layers)):
        assert type(a) is type(b)
        assert a.keys.shape == b.keys.shape, li
        assert a.get_seq_length() == b.get_seq_length() == total
    assert any(l.is_sliding and l.keys.shape[-2] == 7 for l in merged.layers)


def test_two_bases_per_layer_type_are_used():
    ropes = {r.layer_type: r for r in layer_ropes(tiny("tiny-gemma3").model)}
    base = {lt: 1 / r.inv_freq[1].item() ** (16 / 2) for lt, r in ropes.items()}
    assert math.isclose(base["sliding_attention"], 1e4, rel_tol=1e-4)
    assert math.isclose(base["full_attention"], 1e6, rel_tol=1e-4)


def test_yarn_scale_applied_once():
    # YaRN multiplies cos and sin by attention_scaling, so every cached key already carries the
    # scale once; rerotate must turn keys with the unscaled rotation.
    m = tiny("tiny-yarn")
    s = layer_ropes(m.model)[0].attention_scaling
    assert s > 1.05  # so a doubled scale would be visible far above the tolerances below
    frags = [kvlab.prefill(m, t) for t in TEXTS]
    ref = phase_reference(m, frags)  # each fragment prefilled at its landing positions
    merged = kvlab.merge(frags, "rerotate", m)
    assert rel_max_layer_error(merged, ref) < 5e-6
    n1 = frags[0].length
    for li, rope in enumerate(layer_ropes(m.model)):
        k, kr = merged.layers[li].keys[..., n1:, :], ref.layers[li].keys[..., n1:, :]
        # Norms of the moved keys equal the reference's (scale once) ...
        assert torch.allclose(k.norm(dim=-1), kr.norm(dim=-1), rtol=1e-5, atol=0)
        # ... and not those of the scale applied twice (rotated pairs s times longer).
        r = rope.rotary_dim
        ratio = k[..., :r].norm(dim=-1) / kr[..., :r].norm(dim=-1)
        assert not torch.allclose(ratio, torch.full_like(ratio, s), rtol=1e-2)


def test_partial_rotary_passes_other_dims_through_bit_for_bit():
    m = tiny("tiny-gptneox")
    frags = [kvlab.prefill(m, t) for t in TEXTS[:2]]
    merged = kvlab.merge(frags, "rerotate", m)
    r = layer_ropes(m.model)[0].rotary_dim
    assert r == 4  # rotary_pct 0.25 of head_dim 16
    n1 = frags[0].length
    assert torch.equal(merged.layers[1].keys[..., n1:, r:], frags[1].cache.layers[1].keys[..., r:])
    assert not torch.equal(merged.layers[1].keys[..., n1:, :r], frags[1].cache.layers[1].keys[..., :r])


def test_longrope_within_one_factor_set_is_exact_and_across_is_refused():
    m = tiny("tiny-longrope")  # switch at 64 positions
    short = [kvlab.prefill(m, "short one."), kvlab.prefill(m, " short two.")]
    assert sum(f.length for f in short) <= 64
    assert rel_max_layer_error(kvlab.merge(short, "rerotate", m), phase_reference(m, short)) < 5e-6
    long_ = [kvlab.prefill(m, "x" * 70), kvlab.prefill(m, "y" * 66)]
    assert rel_max_layer_error(kvlab.merge(long_, "rerotate", m), phase_reference(m, long_)) < 5e-6
    crossing = [kvlab.prefill(m, "a" * 40), kvlab.prefill(m, "b" * 40)]
    with pytest.raises(kvlab.UnsupportedRopeError, match="longrope.*original_max_position_embeddings=64"):
        kvlab.merge(crossing, "rerotate", m)


def test_dynamic_ntk_is_refused_never_concatenated():
    m = tiny("tiny-dynamic")
    frags = [kvlab.prefill(m, t) for t in TEXTS[:2]]
    with pytest.raises(kvlab.UnsupportedRopeError, match="dynamic"):
        kvlab.merge(frags, "rerotate", m)


# Measured max |dK| over all layers: SmolLM2 8.6e-6 absolute, 5.8e-7 relative (30 layers;
# a first prototype measured 2.1e-5); Gemma 3 5.2e-5 absolute, 1.8e-6 relative (18 layers; prototype: 2.5e-4).
@pytest.mark.real
@pytest.mark.parametrize("model_fixture", ["smollm2", "gemma3"])
def test_rerotate_matches_phase_reference_on_real_models(model_fixture, request):
    m = request.getfixturevalue(model_fixture)
    frags = [kvlab.prefill(m, t) for t in TEXTS]
    ref = phase_reference(m, frags)
    assert rel_max_layer_error(kvlab.merge(frags, "rerotate", m), ref) < 1e-5
    assert rel_max_layer_error(kvlab.merge(frags, "naive", m), ref) > 1e-1


keys64 = st.integers(min_value=0, max_value=2**31 - 1).map(
    lambda s: torch.randn(1, 2, 3, 16, generator=torch.Generator().manual_seed(s), dtype=torch.float64)
)
inv64 = 1.0 / (10000.0 ** (torch.arange(0, 16, 2, dtype=torch.float64) / 16))
shift = st.integers(min_value=-4096, max_value=4096)


@settings(max_examples=200, deadline=None)
@given(k=keys64, a=shift, b=shift)
def test_rotation_composes(k, a, b):
    # float64: angle arguments up to 8192 rad carry ~1e-12 absolute error in cos/sin.
    once = rotate_keys(k, inv64, a + b)
    twice = rotate_keys(rotate_keys(k, inv64, a), inv64, b)
    assert torch.allclose(once, twice, rtol=0, atol=1e-10)


@settings(max_examples=200, deadline=None)
@given(k=keys64, d=shift)
def test_rotation_inverts_and_preserves_norms(k, d):
    back = rotate_keys(rotate_keys(k, inv64, d), inv64, -d)
    assert torch.allclose(back, k, rtol=0, atol=1e-12)
    assert torch.allclose(rotate_keys(k, inv64, d).norm(dim=-1), k.norm(dim=-1), rtol=1e-13, atol=0)


@settings(max_examples=100, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), d=shift)
def test_rotation_inverts_fp32(seed, d):
    k = torch.randn(1, 2, 3, 16, generator=torch.Generator().manual_seed(seed))
    back = rotate_keys(rotate_keys(k, inv64.float(), d), inv64.float(), -d)
    # Two fp32 rotations: each rounds to ~1 ulp of |k| per pair.
    assert (back - k).abs().max() <= 4 * torch.finfo(torch.float32).eps * k.abs().max()


def test_rotate_keys_leaves_input_alone():
    k = torch.randn(1, 2, 5, 16)
    before = k.clone()
    out = rotate_keys(k, inv64.float(), 7)
    assert torch.equal(k, before) and out.data_ptr() != k.data_ptr()


@pytest.mark.parametrize("layer_type", ["sliding_attention", "full_attention"])
def test_rerotate_only_one_layer_type_is_rerotate_there_and_naive_elsewhere(layer_type):
    from kvlab.cache.repro import RerotateOnly

    m = tiny("tiny-gemma3")
    frags = [kvlab.prefill(m, t) for t in TEXTS]
    part = kvlab.merge(frags, RerotateOnly(layer_type), m)
    rot, naive = kvlab.merge(frags, "rerotate", m), kvlab.merge(frags, "naive", m)
    types = [r.layer_type for r in layer_ropes(m.model)]
    assert {layer_type} < set(types)  # both kinds present, so each branch is exercised
    for li, t in enumerate(types):
        want = rot if t == layer_type else naive
        assert torch.equal(part.layers[li].keys, want.layers[li].keys), li
        assert torch.equal(part.layers[li].values, rot.layers[li].values)
        assert part.layers[li].get_seq_length() == rot.layers[li].get_seq_length()
    with pytest.raises(kvlab.MergeError, match="no 'sliding_attention' layers"):
        kvlab.merge([kvlab.prefill(tiny("tiny-qwen2"), t) for t in TEXTS], RerotateOnly(), tiny("tiny-qwen2"))


@pytest.mark.parametrize("layer_type", ["sliding_attention", "full_attention"])
def test_exact_only_one_layer_type_is_the_joined_prefill_there_and_rerotate_elsewhere(layer_type):
    from kvlab.cache.repro import ExactOnly

    m = tiny("tiny-gemma3")
    frags = [kvlab.prefill(m, t) for t in TEXTS]
    before = [f.cache.layers[0].keys.clone() for f in frags]
    part = kvlab.merge(frags, ExactOnly(layer_type), m)
    rot, joined = kvlab.merge(frags, "rerotate", m), kvlab.merge(frags, "reprefill", m)
    types = [r.layer_type for r in layer_ropes(m.model)]
    assert {layer_type} < set(types)
    for li, t in enumerate(types):
        want = joined if t == layer_type else rot
        assert torch.equal(part.layers[li].keys, want.layers[li].keys), li
        assert torch.equal(part.layers[li].values, want.layers[li].values), li
    # The context gap is real on this model: swapping layers changes the cache.
    assert not all(torch.equal(rot.layers[li].values, part.layers[li].values) for li in range(len(types)))
    assert all(torch.equal(f.cache.layers[0].keys, b) for f, b in zip(frags, before))
    with pytest.raises(kvlab.MergeError, match="no 'sliding_attention' layers"):
        kvlab.merge([kvlab.prefill(tiny("tiny-qwen2"), t) for t in TEXTS], ExactOnly(), tiny("tiny-qwen2"))
