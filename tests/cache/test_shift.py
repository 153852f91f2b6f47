"""shift_: keys turned in place agree bit for bit with rerotate, and it refuses what rerotate refuses."""

from __future__ import annotations

import pytest
import torch

import kvlab
from conftest import tiny
from kvlab.cache.fragments import clone_cache, new_cache
from kvlab.measure.references import phase_reference

COMPOSING = ["tiny-llama", "tiny-qwen2", "tiny-gemma3", "tiny-gptneox", "tiny-phi", "tiny-llama3", "tiny-yarn"]
FIRST, SECOND = "Cached keys remember where", " a fragment that lands later."


def two(m, dtype=None):
    f1, f2 = kvlab.prefill(m, FIRST), kvlab.prefill(m, SECOND)
    if dtype is not None:
        f1, f2 = (kvlab.Fragment(clone_cache(f.cache, m.config, dtype), f.token_ids, f.text, f.start,
                                 f.model_name, f.config) for f in (f1, f2))  # fmt: skip
    return f1, f2


# tiny-gemma3's window is 8 tokens: SECOND (29 byte tokens) has dropped tokens on its sliding layers.
@pytest.mark.parametrize("dtype", [None, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", COMPOSING)
def test_shift_is_rerotate_in_place_bit_for_bit(name, dtype):
    m = tiny(name)
    f1, f2 = two(m, dtype)
    merged = kvlab.merge([f1, f2], "rerotate", m)
    cache = clone_cache(f2.cache, m.config)
    ptrs = [(layer.keys.data_ptr(), layer.values.data_ptr()) for layer in cache.layers]
    values = [layer.values.clone() for layer in cache.layers]
    assert kvlab.shift_(cache, f1.length, m) is cache
    for li, layer in enumerate(cache.layers):
        kept = layer.keys.shape[-2]
        assert torch.equal(layer.keys, merged.layers[li].keys[..., -kept:, :]), li
        assert (layer.keys.data_ptr(), layer.values.data_ptr()) == ptrs[li]  # turned where they lie
        assert torch.equal(layer.values, values[li]) and layer.keys.dtype == f2.cache.layers[li].keys.dtype
    assert cache.get_seq_length() == f2.length


@pytest.mark.parametrize("name", COMPOSING)
def test_shifted_keys_match_the_phase_reference(name):
    m = tiny(name)
    f1, f2 = two(m)
    cache = kvlab.shift_(clone_cache(f2.cache, m.config), f1.length, m)
    ref = phase_reference(m, [f1, f2])
    for li, layer in enumerate(cache.layers):
        want = ref.layers[li].keys[..., -layer.keys.shape[-2] :, :]
        assert (layer.keys - want).abs().max() <= 5e-6 * want.abs().max(), li


def test_shift_and_back_returns_the_keys_to_rounding():
    m = tiny("tiny-llama")
    _, f2 = two(m)
    cache = clone_cache(f2.cache, m.config)
    kvlab.shift_(kvlab.shift_(cache, 37, m), -37, m, start=37)
    for a, b in zip(cache.layers, f2.cache.layers, strict=True):
        assert (a.keys - b.keys).abs().max() <= 1e-6 * b.keys.abs().max()
    assert kvlab.shift_(cache, 0, m) is cache


def _refused(m, cache, offset, error, match, **kw):
    before = [layer.keys.clone() for layer in cache.layers]
    with pytest.raises(error, match=match):
        kvlab.shift_(cache, offset, m, **kw)
    assert all(torch.equal(a.keys, b) for a, b in zip(cache.layers, before, strict=True))  # nothing turned


def test_refusals_leave_the_cache_alone():
    dyn = tiny("tiny-dynamic")
    _refused(dyn, kvlab.prefill(dyn, SECOND).cache, 5, kvlab.UnsupportedRopeError, "dynamic")
    lr = tiny("tiny-longrope")  # switch at 64 positions
    _refused(lr, kvlab.prefill(lr, "b" * 40).cache, 40, kvlab.UnsupportedRopeError, "longrope")
    kvlab.shift_(kvlab.prefill(lr, "b" * 40).cache, 10, lr)  # within one factor set: allowed
    gem = tiny("tiny-gemma3")
    llama = tiny("tiny-llama")
    c = kvlab.prefill(llama, SECOND).cache
    limit = llama.config.max_position_embeddings
    _refused(llama, c, limit, kvlab.PositionError, "max_position_embeddings")
    _refused(llama, c, -1, kvlab.MergeError, "negative")
    _refused(llama, c, 2.0, kvlab.MergeError, "must be an int")
    _refused(llama, kvlab.prefill(gem, SECOND).cache, 3, kvlab.MergeError, "the cache has 4 layers, tiny-llama has 3")
    with pytest.raises(kvlab.MergeError, match="empty"):
        kvlab.shift_(new_cache(llama.config), 3, llama)
