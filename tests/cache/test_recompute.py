"""recompute: the two exact limits, which slots change, the policies, refusals; and kvlab.fidelity.

Tolerances are fp32 and stated with what was measured (torch 2.13 CPU, transformers 5.24):
every "measured" maximum below was exactly 0.0, because the recompute runs the model's own
layers and sdpa kernels on the same operands as the joined prefill. The tolerances leave
room for other kernels (thread counts, CPUs) without hiding a real error, which is >= 0.1.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvlab
from conftest import assert_unchanged, snapshot, tiny
from kvlab.cache.fragments import prefill_ids
from kvlab.cache.recompute.strategy import POLICIES, Recompute, fragment_start_positions
from kvlab.compat import generate
from kvlab.measure.case import DEFAULT_PROBES, DEFAULT_TEXTS
from kvlab.measure.fidelity import Fidelity, fidelity
from kvlab.measure.metrics import kv_diff, max_diff
from kvlab.measure.references import context_reference
from kvlab.models.tiny import build_tiny

TEXTS = ["Cached keys remember where they were.", " A second fragment of text,", " and a third that lands last."]
#: |K|, |V| against the joined prefill at ratio 1; measured max 0.0 on every model here.
TOL_TINY = 1e-5
#: same on the real models (larger activations); measured max 0.0 on SmolLM2 and Gemma 3.
TOL_REAL = 1e-4


def frags(m, texts=TEXTS):
    return [kvlab.prefill(m, t) for t in texts]


def assert_same(a, b):
    for la, lb in zip(a.layers, b.layers):
        assert torch.equal(la.keys, lb.keys) and torch.equal(la.values, lb.values)
        assert la.get_seq_length() == lb.get_seq_length()


def assert_close(a, b, tol):
    d = kv_diff(a, b)
    assert max_diff(d, "k") <= tol and max_diff(d, "v") <= tol, (max_diff(d, "k"), max_diff(d, "v"))


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2", "tiny-gemma3"])
@pytest.mark.parametrize("policy", POLICIES)
def test_ratio_zero_is_rerotate_bit_for_bit(name, policy):
    m = tiny(name)
    fs = frags(m)
    assert_same(kvlab.merge(fs, "recompute", m, ratio=0.0, policy=policy), kvlab.merge(fs, "rerotate", m))


# tiny-gemma3 (window 8) merges 93 tokens: its sliding layers keep 7, so recomputed tokens
# outside them still need (and get) their neighbours' K/V inside each layer.
@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2", "tiny-gemma3", "tiny-phi", "tiny-gptneox"])
def test_ratio_one_is_reprefill(name):
    m = tiny(name)
    fs = frags(m)
    merged = kvlab.merge(fs, "recompute", m, ratio=1.0)
    assert merged.get_seq_length() == sum(f.length for f in fs)
    assert_close(merged, kvlab.merge(fs, "reprefill", m), TOL_TINY)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gemma3"])
@pytest.mark.parametrize("policy", ["fragment_start", "deviation", "random_later"])
def test_recomputing_every_token_after_the_first_fragment_is_reprefill(name, policy):
    # Fragment 0 was prefilled at position 0 with all the context it ever has (causality),
    # so only the later fragments are wrong; recomputing them all is exact. Every policy but the
    # unfair `random` picks those tokens first, so each reaches the joined prefill at
    # r* = (N - L0) / N: studies/recompute_curve.py ends its curve there.
    m = tiny(name)
    fs = frags(m)
    n = sum(f.length for f in fs)
    ratio = (n - fs[0].length) / n
    merged = kvlab.merge(fs, "recompute", m, ratio=ratio, policy=policy)
    assert_close(merged, kvlab.merge(fs, "reprefill", m), TOL_TINY)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gemma3"])
@pytest.mark.parametrize("policy", ["fragment_start", "deviation", "random_later"])
def test_a_budget_past_r_star_is_still_the_joined_prefill(name, policy):
    # Past r* the policies pick fragment-0 tokens too. Those are exact already and are not run: on
    # tiny-gemma3 (window 8) a run fragment-0 token would attend without the neighbours fragment 0's
    # own sliding cache evicted, and its K would miss the joined prefill's by about 3.
    m = tiny(name)
    fs = frags(m)
    n, first = sum(f.length for f in fs), fs[0].length
    ref = kvlab.merge(fs, "reprefill", m)
    for extra in (3, first - 1):
        assert_close(kvlab.merge(fs, "recompute", m, ratio=(n - first + extra) / n, policy=policy), ref, TOL_TINY)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gemma3"])
@pytest.mark.parametrize("policy", POLICIES)
def test_only_the_selected_slots_change(name, policy):
    m = tiny(name)
    fs = frags(m)
    landings = kvlab.landing_positions(fs)
    strat = Recompute(ratio=0.3, policy=policy)
    chosen = strat.select(fs, landings, m)
    n = sum(f.length for f in fs)
    assert chosen.numel() == round(0.3 * n) and torch.equal(chosen, chosen.unique())
    merged = kvlab.merge(fs, strat, m)
    rot = kvlab.merge(fs, "rerotate", m)
    joined = kvlab.merge(fs, "reprefill", m)
    later = chosen[chosen >= landings[1]]
    changed_somewhere = False
    for li, (a, b, j) in enumerate(zip(merged.layers, rot.layers, joined.layers)):
        first = n - a.keys.shape[-2]  # slot of the first token this layer keeps
        mine = torch.zeros(n, dtype=torch.bool)
        mine[chosen] = True
        mine = mine[first:]
        assert torch.equal(a.keys[..., ~mine, :], b.keys[..., ~mine, :])
        assert torch.equal(a.values[..., ~mine, :], b.values[..., ~mine, :])
        if li == 0 and mine.any():
            # No context yet at layer 0: a recomputed token's K/V are the joined prefill's.
            assert (a.keys[..., mine, :] - j.keys[..., mine, :]).abs().max() <= TOL_TINY
            assert (a.values[..., mine, :] - j.values[..., mine, :]).abs().max() <= TOL_TINY
        elif len(later) and mine.any():
            changed_somewhere |= not torch.equal(a.keys[..., mine, :], b.keys[..., mine, :])
    assert changed_somewhere or len(later) == 0


def test_fragment_start_positions():
    lengths, landings = [5, 3, 4], [0, 5, 8]
    assert fragment_start_positions(lengths, landings, 0).tolist() == []
    # Smallest t with min(t, 3) + min(t, 4) >= 5 is 3, one too many: the last fragment gives one back.
    assert fragment_start_positions(lengths, landings, 5).tolist() == [5, 6, 7, 8, 9]
    assert fragment_start_positions(lengths, landings, 4).tolist() == [5, 6, 8, 9]
    assert fragment_start_positions(lengths, landings, 7).tolist() == [5, 6, 7, 8, 9, 10, 11]
    assert fragment_start_positions(lengths, landings, 9).tolist() == [0, 1, 5, 6, 7, 8, 9, 10, 11]
    assert fragment_start_positions([6], [0], 2).tolist() == [0, 1]


def test_random_policy_is_seeded():
    m = tiny("tiny-llama")
    fs = frags(m)
    landings = kvlab.landing_positions(fs)
    a = Recompute(ratio=0.2, policy="random", seed=1).select(fs, landings, m)
    b = Recompute(ratio=0.2, policy="random", seed=1).select(fs, landings, m)
    c = Recompute(ratio=0.2, policy="random", seed=2).select(fs, landings, m)
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert_same(
        kvlab.merge(fs, "recompute", m, ratio=0.2, policy="random", seed=1),
        kvlab.merge(fs, "recompute", m, ratio=0.2, policy="random", seed=1),
    )


def test_deviation_never_picks_the_first_fragment_while_later_tokens_remain():
    # Fragment 0's keys are exact, so its deviation is 0 (to rounding) at any check layer.
    m = tiny("tiny-llama")
    fs = frags(m)
    later = sum(f.length for f in fs[1:])
    n = fs[0].length + later
    for ratio in (0.1, (later - 1) / n):
        chosen = Recompute(ratio=ratio).select(fs, kvlab.landing_positions(fs), m)
        assert chosen.numel() and int(chosen.min()) >= fs[0].length


def test_random_later_draws_from_the_later_fragments_first_and_is_seeded():
    m = tiny("tiny-llama")
    fs = frags(m)
    landings = kvlab.landing_positions(fs)
    later = sum(f.length for f in fs[1:])
    n = fs[0].length + later
    picks = [Recompute(ratio=(later - 1) / n, policy="random_later", seed=s).select(fs, landings, m) for s in (1, 1, 2)]
    assert all(int(p.min()) >= fs[0].length and p.numel() == later - 1 for p in picks)
    assert torch.equal(picks[0], picks[1]) and not torch.equal(picks[0], picks[2])
    # Past the later tokens it adds fragment 0's, so ratio 1 is still every token.
    over = Recompute(ratio=(later + 3) / n, policy="random_later").select(fs, landings, m)
    assert over.numel() == later + 3 and int((over < fs[0].length).sum()) == 3
    # The unfair control draws from fragment 0 as well.
    assert int((Recompute(ratio=0.5, policy="random").select(fs, landings, m) < fs[0].length).sum()) > 0


def test_deviation_check_layer_must_hold_every_token():
    m = tiny("tiny-gemma3")  # layers 0-2 sliding (keep 7 of 93 tokens here), layer 3 full
    fs = frags(m)
    landings = kvlab.landing_positions(fs)
    default = Recompute(ratio=0.2).select(fs, landings, m)
    assert torch.equal(default, Recompute(ratio=0.2, check_layer=3).select(fs, landings, m))
    with pytest.raises(kvlab.MergeError, match="check_layer 1 is a sliding-window layer"):
        kvlab.merge(fs, "recompute", m, ratio=0.2, check_layer=1)
    with pytest.raises(kvlab.MergeError, match="out of range"):
        kvlab.merge(fs, "recompute", m, ratio=0.2, check_layer=4)
    # Short merges fit in the window: layer 1 holds every token and is the default again.
    short = frags(m, ["ab", "cd", "e"])
    assert torch.equal(
        Recompute(ratio=0.4).select(short, kvlab.landing_positions(short), m),
        Recompute(ratio=0.4, check_layer=1).select(short, kvlab.landing_positions(short), m),
    )


def test_longrope_recompute_uses_the_factor_set_of_the_merged_length():
    # 70 tokens > the switch at 64; the recomputed tokens (0..13) are all below it, and must
    # still use the long factors the whole prefill used. One fragment at 0 is exact context.
    m = tiny("tiny-longrope")
    (f,) = frags(m, ["x" * 70])
    merged = kvlab.merge([f], "recompute", m, ratio=0.2, policy="fragment_start")
    assert_close(merged, f.cache, TOL_TINY)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gemma3"])
def test_never_mutates_or_aliases_inputs(name):
    m = tiny(name)
    fs = frags(m)
    snap = snapshot(fs)
    merged = kvlab.merge(fs, "recompute", m, ratio=0.5)
    assert_unchanged(fs, snap)
    inputs = {t.untyped_storage().data_ptr() for f in fs for l in f.cache.layers for t in (l.keys, l.values)}
    for layer in merged.layers:
        assert layer.keys.untyped_storage().data_ptr() not in inputs
        assert layer.values.untyped_storage().data_ptr() not in inputs
    ids = torch.cat([f.token_ids for f in fs] + [kvlab.tokenize(m, " so")])[None]
    with torch.inference_mode():
        out = generate(m.model, merged, inputs=ids, max_new_tokens=4, min_new_tokens=4, do_sample=False)
    assert out.shape[-1] == ids.shape[-1] + 4
    assert_unchanged(fs, snap)


def test_eager_attention_gets_an_additive_mask():
    # sdpa takes a bool mask, eager attention adds its mask to the scores: both must work.
    model, tokenizer, _ = build_tiny("tiny-gemma3")
    model.set_attn_implementation("eager")
    m = kvlab.LoadedModel(model=model, tokenizer=tokenizer, name="tiny-gemma3", config=model.config)
    fs = frags(m)
    assert_close(kvlab.merge(fs, "recompute", m, ratio=1.0), kvlab.merge(fs, "reprefill", m), TOL_TINY)
    # Same weights under sdpa: measured max 1.5e-6 at ratio 0.3.
    assert_close(
        kvlab.merge(fs, "recompute", m, ratio=0.3),
        kvlab.merge(fs, "recompute", tiny("tiny-gemma3"), ratio=0.3),
        TOL_TINY,
    )


@pytest.mark.parametrize(
    "options, match",
    [
        (dict(ratio=1.5), "ratio must be a number in \\[0, 1\\]"),
        (dict(ratio=-0.1), "ratio must be a number in \\[0, 1\\]"),
        (dict(ratio=float("nan")), "ratio must be"),
        (dict(ratio="0.2"), "ratio must be"),
        (dict(ratio=True), "ratio must be"),
        (dict(policy="top"), "unknown recompute policy 'top'; choose one of deviation, fragment_start, random"),
        (dict(check_layer=-1), "check_layer must be"),
        (dict(bogus=1), "bad options for strategy 'recompute'"),
    ],
)
def test_bad_options_are_refused(options, match):
    fs = frags(tiny("tiny-llama"))
    with pytest.raises(kvlab.MergeError, match=match):
        kvlab.merge(fs, "recompute", tiny("tiny-llama"), **options)


def test_refusals():
    m = tiny("tiny-llama")
    fs = frags(m)
    assert "recompute" in kvlab.strategy_names() and Recompute.summary()
    with pytest.raises(kvlab.MergeError, match="'recompute' needs the model"):
        kvlab.merge(fs, "recompute")
    bare = dataclasses.replace(fs[1], token_ids=None)
    with pytest.raises(kvlab.MergeError, match="fragment 1 has no token ids"):
        kvlab.merge([fs[0], bare], "recompute", m)
    # ratio 0 needs no tokens: it is rerotate.
    assert kvlab.merge([fs[0], bare], "recompute", m, ratio=0).get_seq_length() == fs[0].length + fs[1].length


def test_unchecked_architectures_are_refused(monkeypatch):
    monkeypatch.setattr(kvlab.cache.recompute.decoder, "SUPPORTED_MODEL_TYPES", {"gemma3_text"})
    m = tiny("tiny-llama")
    with pytest.raises(kvlab.MergeError, match="tiny-llama is 'llama'"):
        kvlab.merge(frags(m), "recompute", m)


# --- kvlab.fidelity ------------------------------------------------------------------


def test_fidelity_of_strategies_and_of_ready_caches():
    m = tiny("tiny-llama")
    fs = frags(m)
    probes = [" and then", " so"]
    snap = snapshot(fs)
    ref = context_reference(m, fs)
    exact = fidelity(m, fs, "reprefill", probes=probes, greedy_tokens=4)
    assert isinstance(exact, Fidelity)
    assert exact.kl_max == 0.0 and exact.top1 == 1.0 and exact.greedy_agree == 1.0 and exact.greedy_prefix == 1.0
    assert exact.merge_s > 0 and exact.strategy == "reprefill"
    row = fidelity(m, fs, "recompute", probes=probes, greedy_tokens=4, reference=ref, ratio=0.3).row()
    assert row["strategy"] == "recompute" and row["ratio"] == 0.3 and row["policy"] == "deviation"
    assert {"kl_mean", "kl_max", "top1", "greedy_agree", "greedy_prefix", "greedy_tokens", "merge_s"} <= set(row)
    cache = kvlab.merge(fs, "naive", m)
    n = cache.get_seq_length()
    ready = fidelity(m, fs, cache, probes=probes, greedy_tokens=3, reference=ref)
    assert ready.strategy is None and ready.merge_s is None and ready.kl_mean > 0
    assert 0 <= ready.greedy_agree <= 1 and len(ready.probes) == 2 and "greedy" in ready.probes[0]
    assert cache.get_seq_length() == n and ref.get_seq_length() == n  # both were cloned, not grown
    assert_unchanged(fs, snap)
    with pytest.raises(kvlab.MergeError, match="options were given with a ready cache"):
        fidelity(m, fs, cache, probes=probes, ratio=0.2)
    with pytest.raises(kvlab.MergeError, match="at least one probe"):
        fidelity(m, fs, "rerotate", probes=[])


# --- real models ---------------------------------------------------------------------


@pytest.mark.real
def test_smollm2_limits_and_kl(smollm2):
    m = smollm2
    fs = [kvlab.prefill(m, t, bos=(i == 0)) for i, t in enumerate(DEFAULT_TEXTS)]
    ref = context_reference(m, fs)
    assert_same(kvlab.merge(fs, "recompute", m, ratio=0.0), kvlab.merge(fs, "rerotate", m))
    assert_close(kvlab.merge(fs, "recompute", m, ratio=1.0), ref, TOL_REAL)
    # Measured KL mean on these texts: rerotate 0.193, recompute deviation at 0.15 0.0197.
    rot = fidelity(m, fs, "rerotate", probes=DEFAULT_PROBES, greedy_tokens=0, reference=ref)
    dev = fidelity(m, fs, "recompute", probes=DEFAULT_PROBES, greedy_tokens=0, reference=ref, ratio=0.15)
    assert dev.kl_mean < rot.kl_mean / 3


@pytest.mark.real
def test_gemma3_limits_across_the_sliding_window(gemma3):
    # 2 x 260 tokens: the sliding layers (window 512) keep only the last 511 of 520.
    m = gemma3
    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(100, 20000, (260,), generator=g) for _ in range(2)]
    fs = [kvlab.Fragment(prefill_ids(m, x[None]), x, None, 0, m.name, m.config) for x in ids]
    merged = kvlab.merge(fs, "recompute", m, ratio=1.0)
    assert [l.keys.shape[-2] for l in merged.layers][:6] == [511] * 5 + [520]
    assert_close(merged, prefill_ids(m, torch.cat(ids)[None]), TOL_REAL)
    assert_same(kvlab.merge(fs, "recompute", m, ratio=0.0), kvlab.merge(fs, "rerotate", m))


# --- the recompute-mask defect (a bottom-right-aligned causal mask), beside kvlab's mask -----------


def _mask_args(slots, lo, hi):
    from types import SimpleNamespace

    decoder = SimpleNamespace(device=torch.device("cpu"), eager=False, dtype=torch.float32)
    return decoder, torch.as_tensor(slots, dtype=torch.long), None, None, lo, hi


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_kvlabs_recompute_mask_never_shows_a_token_a_later_slot(data):
    from kvlab.cache.recompute.inputs import attention_mask

    n = data.draw(st.integers(1, 64))
    slots = sorted(data.draw(st.sets(st.integers(0, n - 1), min_size=1)))
    window = data.draw(st.none() | st.integers(1, n + 2))
    avail = torch.tensor(data.draw(st.lists(st.booleans(), min_size=n, max_size=n)))
    lo = 0 if window is None else max(0, slots[0] - window + 1)
    decoder, s, _, _, lo, hi = _mask_args(slots, lo, slots[-1] + 1)
    allowed = attention_mask(decoder, s, avail, window, lo, hi)[0, 0]
    seen = torch.arange(lo, hi)[None, :]
    assert not (allowed & (seen > s[:, None])).any(), "a recomputed token sees a slot after its own position"
    # ...and it sees every earlier slot that holds a K/V and lies in its window.
    want = (seen <= s[:, None]) & avail[lo:hi][None, :]
    if window is not None:
        want &= seen > s[:, None] - window
    assert torch.equal(allowed, want)


def test_the_bottom_right_mask_shows_early_tokens_later_slots_unless_the_tokens_are_a_suffix():
    from kvlab.cache.repro import bottom_right_mask

    # Recomputing slots 2 and 5 of 8: aligned bottom-right, slot 2 sees up to slot 4.
    allowed = bottom_right_mask(*_mask_args([2, 5], 0, 6))[0, 0]
    assert allowed[0].nonzero().flatten().tolist() == [0, 1, 2, 3, 4]
    assert allowed[1].nonzero().flatten().tolist() == [0, 1, 2, 3, 4, 5]
    # A contiguous suffix (what ratio 1, or every token after fragment 0, recomputes) is exactly causal.
    suffix = bottom_right_mask(*_mask_args([3, 4, 5], 0, 6))[0, 0]
    assert torch.equal(suffix, torch.arange(6)[None, :] <= torch.tensor([3, 4, 5])[:, None])


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gemma3"])
def test_the_mask_defect_changes_a_recompute_only_where_the_tokens_are_not_a_suffix(name):
    from kvlab.cache.repro import BottomRightRecompute

    m = tiny(name)
    fs = frags(m)
    lands = kvlab.landing_positions(fs)
    n = sum(f.length for f in fs)
    # Starts of fragments 1 and 2: not a suffix, so the defect lets them see later tokens.
    good = Recompute(ratio=0.15, policy="fragment_start")(fs, lands, m)
    bad = BottomRightRecompute(ratio=0.15, policy="fragment_start")(fs, lands, m)
    assert max_diff(kv_diff(bad, good), "k") > 1e-3
    # Every token after fragment 0: a suffix, where the two masks agree, as do the caches.
    ratio = (n - fs[0].length) / n
    assert_same(
        BottomRightRecompute(ratio=ratio, policy="fragment_start")(fs, lands, m),
        Recompute(ratio=ratio, policy="fragment_start")(fs, lands, m),
    )
