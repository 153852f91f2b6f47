"""merge(): the strategies' contracts, the naive defect, bad input, and caches a model accepts."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import DynamicCache

import kvlab
from conftest import assert_unchanged, snapshot, tiny
from kvlab.cache import repro
from kvlab.cache.fragments import clone_cache
from kvlab.cache.strategies import STRATEGIES
from kvlab.compat import ASSIGNED_LAYERS_READ_EMPTY, forward, generate
from kvlab.measure.references import phase_reference

TEXTS = ["Cached keys remember where they were.", " A second fragment of text,", " and a third that lands last."]
FAMILIES = ["tiny-llama", "tiny-gemma3", "tiny-gptneox", "tiny-yarn"]


def frags(m, texts=TEXTS):
    return [kvlab.prefill(m, t) for t in texts]


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("strategy", ["naive", "rerotate", "reprefill"])
def test_merge_never_mutates_or_aliases_inputs(name, strategy):
    m = tiny(name)
    fs = frags(m)
    snap = snapshot(fs)
    merged = kvlab.merge(fs, strategy, m)
    assert_unchanged(fs, snap)
    input_ptrs = {t.untyped_storage().data_ptr() for f in fs for l in f.cache.layers for t in (l.keys, l.values)}
    for layer in merged.layers:
        assert layer.keys.untyped_storage().data_ptr() not in input_ptrs
        assert layer.values.untyped_storage().data_ptr() not in input_ptrs
    # Growing the merged cache (a forward pass) leaves the fragments alone too.
    ids = kvlab.tokenize(m, " next")
    n = merged.get_seq_length()
    forward(m.model, merged, input_ids=ids[None], position_ids=torch.arange(n, n + len(ids))[None], use_cache=True)
    assert merged.get_seq_length() == n + len(ids)
    assert_unchanged(fs, snap)


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("strategy", ["naive", "rerotate"])
def test_values_are_copied_bit_for_bit(name, strategy):
    m = tiny(name)
    fs = frags(m)
    merged = kvlab.merge(fs, strategy, m)
    for li, layer in enumerate(merged.layers):
        full = torch.cat([f.cache.layers[li].values for f in fs], dim=-2)
        kept = layer.values.shape[-2]
        assert torch.equal(layer.values, full[..., -kept:, :])


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2", "tiny-phi"])
def test_naive_reproduces_the_seed_observations(name):
    m = tiny(name)
    f1, f2 = frags(m, TEXTS[:2])
    ref = phase_reference(m, [f1, f2])
    naive = kvlab.merge([f1, f2], "naive", m)
    n1 = f1.length
    for li, layer in enumerate(naive.layers):
        # First fragment: already at its landing phase, so identical to the reference.
        assert torch.equal(layer.keys[..., :n1, :], ref.layers[li].keys[..., :n1, :])
        # Second fragment: still at phase 0.., so far from the reference.
        assert (layer.keys[..., n1:, :] - ref.layers[li].keys[..., n1:, :]).abs().max() > 0.1
    # Two identical fragments come out bit-identical under naive, not under rerotate.
    twin = kvlab.prefill(m, TEXTS[1])
    same = kvlab.merge([twin, twin], "naive", m)
    fixed = kvlab.merge([twin, twin], "rerotate", m)
    L = twin.length
    for a, b in zip(same.layers, fixed.layers):
        assert torch.equal(a.keys[..., :L, :], a.keys[..., L:, :])
        assert not torch.equal(b.keys[..., :L, :], b.keys[..., L:, :])
        assert torch.equal(b.values[..., :L, :], b.values[..., L:, :])


@pytest.mark.parametrize("name", FAMILIES)
def test_reprefill_equals_joined_prefill_and_generate_from_scratch(name):
    m = tiny(name)
    fs = frags(m)
    merged = kvlab.merge(fs, "reprefill", m)
    ids = torch.cat([f.token_ids for f in fs])
    probe = kvlab.tokenize(m, " and so")
    full = torch.cat([ids, probe])[None]
    with torch.inference_mode():
        from_cache = generate(m.model, merged, inputs=full, max_new_tokens=6, do_sample=False)
        scratch = m.model.generate(full, max_new_tokens=6, do_sample=False)
    assert torch.equal(from_cache, scratch)


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("strategy", ["naive", "rerotate"])
def test_generate_accepts_merged_caches(name, strategy):
    m = tiny(name)
    fs = frags(m)
    merged = kvlab.merge(fs, strategy, m)
    n = merged.get_seq_length()
    assert n == sum(f.length for f in fs)
    ids = torch.cat([f.token_ids for f in fs] + [kvlab.tokenize(m, " so")])[None]
    with torch.inference_mode():
        out = generate(m.model, merged, inputs=ids, max_new_tokens=5, do_sample=False, min_new_tokens=5)
    assert out.shape[-1] == ids.shape[-1] + 5
    assert merged.get_seq_length() == ids.shape[-1] + 4  # generate does not cache the last new token


def test_single_fragment_rerotate_is_the_fragment():
    m = tiny("tiny-llama")
    (f,) = frags(m, TEXTS[:1])
    merged = kvlab.merge([f], "rerotate", m)
    for a, b in zip(merged.layers, f.cache.layers):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


def test_fail_refuses_with_the_reason():
    m = tiny("tiny-llama")
    fs = frags(m)
    with pytest.raises(kvlab.MergeError, match="RoPE phase"):
        kvlab.merge(fs, "fail", m)
    one = kvlab.merge(fs[:1], "fail")
    assert one.get_seq_length() == fs[0].length


def test_reprefill_needs_source():
    m = tiny("tiny-llama")
    fs = frags(m)
    bare = dataclasses.replace(fs[1], text=None, token_ids=None)
    with pytest.raises(kvlab.MergeError, match="fragment 1 has no source"):
        kvlab.merge([fs[0], bare], "reprefill", m)


def test_strategies_that_need_the_model_say_so():
    fs = frags(tiny("tiny-llama"))
    with pytest.raises(kvlab.MergeError, match="'rerotate' needs the model"):
        kvlab.merge(fs, "rerotate")
    with pytest.raises(kvlab.MergeError, match="unknown strategy 'bogus'"):
        kvlab.merge(fs, "bogus")


def _edit_layers(f, fn):
    """A copy of ``f`` whose layers' keys/values pass through ``fn`` (via the cache API)."""
    cache = DynamicCache(config=f.config)
    for li, l in enumerate(f.cache.layers):
        cache.update(fn(l.keys), fn(l.values), li)
    return dataclasses.replace(f, cache=cache)


BAD = {
    "model": lambda f: dataclasses.replace(f, model_name="other-model"),
    "layer count": lambda f: dataclasses.replace(f, cache=_drop_last_layer(f)),
    "kv_heads": lambda f: _edit_layers(f, lambda t: t[:, :1]),
    "head_dim": lambda f: _edit_layers(f, lambda t: t[..., :8]),
    "dtype": lambda f: _edit_layers(f, lambda t: t.to(torch.float16)),
    "device": lambda f: _edit_layers(f, lambda t: torch.empty_like(t, device="meta")),
    "batch": lambda f: _edit_layers(f, lambda t: t.repeat(2, 1, 1, 1)),
}


def _drop_last_layer(f):
    cache = DynamicCache(config=f.config)
    for li, l in enumerate(f.cache.layers[:-1]):
        cache.update(l.keys.clone(), l.values.clone(), li)
    cache.layers = cache.layers[: len(f.cache.layers) - 1]
    return cache


@pytest.mark.parametrize("field", list(BAD))
def test_mismatched_fragments_are_refused_naming_fragment_and_field(field):
    m = tiny("tiny-llama")
    fs = frags(m)
    bad = BAD[field](fs[2])
    snap = snapshot(fs)
    for strategy in ("naive", "rerotate"):
        with pytest.raises(kvlab.MergeError, match=f"fragment 2.*{field}"):
            kvlab.merge([fs[0], fs[1], bad], strategy, m)
    assert_unchanged(fs, snap)


def test_empty_list_is_refused():
    with pytest.raises(kvlab.MergeError, match="empty"):
        kvlab.merge([], "naive")


def test_positions_past_the_model_are_refused():
    m = tiny("tiny-llama")  # max_position_embeddings 1024
    with pytest.raises(kvlab.PositionError, match="max_position_embeddings=1024"):
        kvlab.prefill(m, "abc", start=1022)
    big = [kvlab.prefill(m, "x" * 600), kvlab.prefill(m, "y" * 600)]
    with pytest.raises(kvlab.PositionError, match="1200 tokens"):
        kvlab.merge(big, "rerotate", m)


def test_fragments_from_another_model_are_refused_for_that_model():
    fs = frags(tiny("tiny-llama"))
    with pytest.raises(kvlab.MergeError, match="'tiny-llama'.*'tiny-qwen2'"):
        kvlab.merge(fs, "rerotate", tiny("tiny-qwen2"))


def test_registry_lists_every_strategy_with_a_summary():
    assert {"naive", "fail", "reprefill", "rerotate"} <= set(kvlab.strategy_names())
    for cls in STRATEGIES.values():
        assert cls.summary()


# --- the defects kvlab.cache.repro builds on purpose ---------------------------------------


def test_assigned_merge_reports_length_zero_and_drops_its_tokens():
    m = tiny("tiny-llama")
    fs = frags(m)
    broken = repro.assigned_merge(fs)
    if not ASSIGNED_LAYERS_READ_EMPTY:
        # 4.56 reads the tensors a layer holds, assigned or not: only the phase is wrong.
        assert broken.get_seq_length() == sum(f.length for f in fs)
        return
    assert broken.get_seq_length() == 0
    probe = kvlab.tokenize(m, " next")
    forward(m.model, broken, input_ids=probe[None], use_cache=True)
    # The forward treated the cache as empty: only the probe's tokens are left.
    assert broken.get_seq_length() == len(probe)
    fixed = kvlab.merge(fs, "rerotate", m)
    assert fixed.get_seq_length() == sum(f.length for f in fs)


def test_store_by_reference_grows_every_turn_and_copying_store_does_not():
    m = tiny("tiny-llama")
    (f,) = frags(m, TEXTS[:1])
    query = " q?"
    grow_per_turn = len(kvlab.tokenize(m, query)) + 12 - 1  # the last answer token is not cached
    lengths = {}
    for store_cls in (repro.ByReferenceStore, repro.CopyingStore):
        store = store_cls()
        store.put("mem", clone_cache(f.cache, f.config), f.config)
        seen = [store.stored_length("mem")]
        for _ in range(3):
            repro.chat_turn(m, store.get("mem"), query, new_tokens=12)
            seen.append(store.stored_length("mem"))
        lengths[store_cls.__name__] = seen
    assert lengths["ByReferenceStore"] == [f.length + grow_per_turn * i for i in range(4)]
    assert lengths["CopyingStore"] == [f.length] * 4
