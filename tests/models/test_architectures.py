"""The architectures of 2025-26, each a tiny seeded model of transformers' own classes.

Interleaved rotary pairs (Cohere, GLM, GPT-J, DeepSeek-V2, Llama 4), NoPE layers (SmolLM3,
Cohere 2, Llama 4), multi-head latent attention (DeepSeek-V2/V3, MiniCPM3) are merged,
shifted and recomputed exactly, each checked against the model's own forward pass at the
landing positions, on every layer kind and in both cache slots. Hybrids whose caches hold
recurrent or convolution state, chunked attention, temperature-tuned NoPE layers and M-RoPE
are refused by name, before any work. Each check is also shown failing when the layout kvlab
reads is declared wrong. ``kvlab certify`` on each family is in tests/measure/test_certify.py.
"""

from __future__ import annotations

import re

import pytest
import torch
import transformers as tf

import kvlab
from conftest import assert_unchanged, here, snapshot, tiny
from kvlab.cache.fragments import clone_cache
from kvlab.compat import TRANSFORMERS, config_class, family_problem, mla_cache_layout, rope_config, state_layers
from kvlab.measure.metrics import kv_diff, phase_error
from kvlab.measure.references import phase_reference
from kvlab.models import layout
from kvlab.models.layout import layer_ropes
from kvlab.models.rope import HALF, Pairing
from kvlab.models.tiny import TINY_SEED, byte_tokenizer

#: The families this file adds, with what each exercises.
INTERLEAVED = ["tiny-cohere", "tiny-glm", "tiny-gptj", "tiny-cohere2", "tiny-llama4", "tiny-deepseek-v2"]
NOPE = ["tiny-smollm3", "tiny-cohere2", "tiny-llama4"]
LATENT = ["tiny-deepseek-v3", "tiny-deepseek-v2", "tiny-minicpm3"]
FAMILIES = here(sorted(set(INTERLEAVED + NOPE + LATENT)))
# Three fragments, each longer than tiny-cohere2's window of 8, so its sliding layers drop tokens.
TEXTS = ["Cached keys remember where they were.", " A second fragment of text,", " and a third that lands last."]
#: fp32, relative to the layer's largest element: measured 2.2e-7 .. 8.6e-7 over these models
#: (rerotate and shift_ against the model prefilled at the landing positions); naive is O(1).
TOL = 5e-6

COMMON = dict(
    vocab_size=260,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    bos_token_id=256,
    eos_token_id=257,
    pad_token_id=257,
)


def rel_error(cache, ref, layers=None) -> float:
    """max over layers (and both slots) of max|T - T_ref| / max|T_ref|."""
    worst = 0.0
    for li, (a, b) in enumerate(zip(cache.layers, ref.layers)):
        if layers is not None and li not in layers:
            continue
        for slot in ("keys", "values"):
            x, y = getattr(a, slot), getattr(b, slot)
            worst = max(worst, float((x - y).abs().max() / y.abs().max()))
    return worst


@pytest.mark.parametrize("name", FAMILIES)
def test_rerotate_and_shift_match_the_model_at_the_landing_positions(name):
    m = tiny(name)
    frags = [kvlab.prefill(m, t) for t in TEXTS]
    snap = snapshot(frags)
    ref = phase_reference(m, frags)
    merged = kvlab.merge(frags, "rerotate", m)
    assert rel_error(merged, ref) < TOL
    assert rel_error(kvlab.merge(frags, "naive", m), ref) > 1e-2
    assert merged.get_seq_length() == sum(f.length for f in frags)
    assert_unchanged(frags, snap)
    # shift_ turns fragment 2 in place to where it lands: the model's own cache there.
    moved = kvlab.shift_(clone_cache(frags[1].cache, m.config), frags[0].length, m)
    assert rel_error(moved, kvlab.prefill(m, TEXTS[1], start=frags[0].length).cache) < TOL


@pytest.mark.parametrize("name", FAMILIES)
def test_recompute_limits_are_rerotate_and_the_joined_prefill(name):
    m = tiny(name)
    frags = [kvlab.prefill(m, t) for t in TEXTS]
    r0, rr = kvlab.merge(frags, "recompute", m, ratio=0.0), kvlab.merge(frags, "rerotate", m)
    for a, b in zip(r0.layers, rr.layers):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    # Measured 0.0 on every family: the recompute runs the model's own layers on the same operands.
    assert rel_error(kvlab.merge(frags, "recompute", m, ratio=1.0), kvlab.merge(frags, "reprefill", m)) < 1e-5


@pytest.mark.parametrize("name", here(NOPE))
def test_nope_layers_are_not_turned_and_are_labelled(name):
    m = tiny(name)
    ropes = layer_ropes(m.model)
    nope = [li for li, r in enumerate(ropes) if r.nope]
    assert nope and all(r.rotary_dim == 0 and r.kind.endswith("(NoPE)") for r in (ropes[li] for li in nope))
    frags = [kvlab.prefill(m, t) for t in TEXTS[:2]]
    merged = kvlab.merge(frags, "rerotate", m)
    naive = kvlab.merge(frags, "naive", m)
    for li in nope:
        # A NoPE layer's cache carries no phase: rerotate leaves it exactly as a naive merge does.
        assert torch.equal(merged.layers[li].keys, naive.layers[li].keys)
    # ... and it has no phase to be wrong, while its context error is still measured.
    phases = phase_error(merged, kvlab.joined_prefill(m, frags).cache, m)
    assert all(phases[li].nope and phases[li].angle.shape[-1] == 0 for li in nope)
    diffs = kv_diff(naive, kvlab.joined_prefill(m, frags).cache)
    assert max(float(diffs[li].k.max()) for li in nope) > 1e-3


@pytest.mark.parametrize("name", here(LATENT))
def test_latent_attention_turns_only_the_rotary_key_in_the_values_slot(name):
    m = tiny(name)
    # The release says what it caches (kvlab.compat.mla_cache_layout): from 5.15 the latent in the keys
    # slot and the shared rotary key in the values slot; before, every head's cat(k_nope, k_rot) and value.
    kv_heads, key_dim, value_dim, slot, offset = mla_cache_layout(m.config)
    assert all(r.slot == slot and r.pairing.offset == offset and not r.nope for r in layer_ropes(m.model))
    frags = [kvlab.prefill(m, t) for t in TEXTS[:2]]
    merged, naive = kvlab.merge(frags, "rerotate", m), kvlab.merge(frags, "naive", m)
    other = "keys" if slot == "values" else "values"
    for a, b in zip(merged.layers, naive.layers):
        # What carries no position (the latent, or the values and the keys' k_nope) is bit for bit what was cached.
        assert torch.equal(getattr(a, other), getattr(b, other))
        assert torch.equal(getattr(a, slot)[..., :offset], getattr(b, slot)[..., :offset])
        assert not torch.equal(getattr(a, slot)[..., offset:], getattr(b, slot)[..., offset:])
    # A cache file round-trips with the slots' own widths.
    geo = kvlab.fingerprint(m)["geometry"]
    assert (geo["kv_heads"], geo["head_dim"], geo.get("value_dim", geo["head_dim"])) == (kv_heads, key_dim, value_dim)


def test_catalogue_fingerprints_of_other_models_carry_no_value_dim():
    # Added only where values are narrower, so the fingerprints of every saved cache stay as they were.
    assert "value_dim" not in kvlab.fingerprint(tiny("tiny-llama"))["geometry"]


def _wrapped():
    """Families outside the catalogue, wrapped as a user would: tiny configs of transformers' classes."""
    c3 = dict(COMMON, num_hidden_layers=3)
    return {
        "codegen": lambda: tf.CodeGenConfig(
            vocab_size=260, n_embd=64, n_layer=2, n_head=4, rotary_dim=8, n_positions=1024, bos_token_id=256
        ),
        "ernie4_5": lambda: tf.Ernie4_5Config(**c3, head_dim=16),
        "helium": lambda: tf.HeliumConfig(**c3, head_dim=16),
        "glm4": lambda: tf.Glm4Config(**c3, head_dim=16),
        "olmo2": lambda: tf.Olmo2Config(**c3),
        "qwen3": lambda: tf.Qwen3Config(**c3, head_dim=16),
        "mistral": lambda: tf.MistralConfig(**c3, sliding_window=8),
        "gemma2": lambda: tf.Gemma2Config(**c3, head_dim=16, sliding_window=8),
        "granite": lambda: tf.GraniteConfig(**c3),
        "starcoder2": lambda: tf.Starcoder2Config(**c3),
        "stablelm": lambda: tf.StableLmConfig(**c3, partial_rotary_factor=0.25),
        "exaone4": lambda: tf.Exaone4Config(**COMMON, sliding_window=8),
    }


@pytest.mark.parametrize("family", sorted(_wrapped()))
def test_wrapped_families_pass_the_self_test_and_merge_exactly(family):
    torch.manual_seed(TINY_SEED)
    config = _wrapped()[family]()
    model = tf.AutoModelForCausalLM.from_config(config).eval()
    problem = family_problem(config.model_type)
    if problem:
        # The release builds the family in a way kvlab cannot drive (CodeGen before its rotary module).
        with pytest.raises(kvlab.UnsupportedModelError, match=f"transformers {re.escape(TRANSFORMERS)}"):
            kvlab.wrap(model, byte_tokenizer(), name=family)
        return
    m = kvlab.wrap(model, byte_tokenizer(), name=family)  # the rotation self-test runs here
    frags = [kvlab.prefill(m, t) for t in TEXTS[:2]]
    ref = phase_reference(m, frags)
    # Measured 2.1e-7 .. 6.8e-7.
    assert rel_error(kvlab.merge(frags, "rerotate", m), ref) < TOL
    assert rel_error(kvlab.merge(frags, "naive", m), ref) > 1e-2


# --- teeth: the same checks fail where the layout kvlab reads is declared wrong ----------------


@pytest.mark.parametrize(
    "name, patch, said",
    [
        (
            "tiny-cohere",
            lambda mp: mp.setattr(layout, "INTERLEAVED", layout.INTERLEAVED - {"cohere"}),
            r"pairs \(i, i \+ r/2\)",
        ),
        (
            "tiny-glm",
            lambda mp: mp.setattr(layout, "INTERLEAVED", layout.INTERLEAVED - {"glm"}),
            r"pairs \(i, i \+ r/2\)",
        ),
        ("tiny-llama", lambda mp: mp.setattr(layout, "INTERLEAVED", layout.INTERLEAVED | {"llama"}), "interleaved"),
        (
            "tiny-smollm3",
            lambda mp: mp.setattr(layout, "nope_layers", lambda c: [False] * c.num_hidden_layers),
            "keys slot",
        ),
        ("tiny-smollm3", lambda mp: mp.setattr(layout, "nope_layers", lambda c: [True] * 4), "no rope"),
        ("tiny-deepseek-v2", lambda mp: mp.setattr(layout, "is_latent", lambda c: False), "keys slot, interleaved"),
    ],
)
def test_a_wrong_layout_fails_the_self_test_and_the_merge(name, patch, said, monkeypatch):
    m = tiny(name)
    frags = [kvlab.prefill(m, t) for t in TEXTS[:2]]
    ref = phase_reference(m, frags)
    patch(monkeypatch)
    from kvlab.models.checks import check_rotation

    with pytest.raises(kvlab.UnsupportedModelError, match=said) as e:
        check_rotation(m)
    assert "silently wrong" in str(e.value)
    assert rel_error(kvlab.merge(frags, "rerotate", m), ref) > 1e-3


def test_interleaved_pairing_is_not_rotate_half():
    # The same numbers turned under the two pairings differ, and each inverts only itself.
    torch.manual_seed(0)
    k = torch.randn(1, 2, 5, 16, dtype=torch.float64)
    inv = 1.0 / (10000 ** (torch.arange(0, 8, 2, dtype=torch.float64) / 8))
    half, inter = HALF, Pairing(4, True)
    a = kvlab.rotate_keys(k, inv, 9, pairing=half)
    b = kvlab.rotate_keys(k, inv, 9, pairing=inter)
    assert not torch.allclose(a, b)
    assert torch.equal(b[..., :4], k[..., :4]) and torch.equal(b[..., 12:], k[..., 12:])
    assert torch.allclose(kvlab.rotate_keys(b, inv, -9, pairing=inter), k, atol=1e-13)
    assert torch.allclose(b.norm(dim=-1), k.norm(dim=-1), rtol=1e-13)
    assert not torch.allclose(kvlab.rotate_keys(b, inv, -9, pairing=half), k, atol=1e-3)


# --- refused by name -------------------------------------------------------------------------------


def _hybrids():
    return [
        ("jamba", lambda: tf.JambaConfig(**COMMON, attn_layer_period=2, attn_layer_offset=1, num_experts=2)),
        (
            "bamba",
            lambda: tf.BambaConfig(
                **dict(COMMON, intermediate_size=64),
                attn_layer_indices=[1],
                mamba_n_heads=8,
                mamba_d_head=16,
                mamba_n_groups=1,
                mamba_d_state=8,
                mamba_chunk_size=8,
                mamba_expand=2,
            ),
        ),
        (
            "falcon_h1",
            lambda: tf.FalconH1Config(
                **COMMON, mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8, mamba_n_groups=1
            ),
        ),
        (
            "zamba2",
            lambda: tf.Zamba2Config(
                **dict(COMMON, num_hidden_layers=2),
                layers_block_type=["mamba", "hybrid"],  # 4.x reads only this spelling
                mamba_d_state=8,
                mamba_headdim=16,
                n_mamba_heads=8,
            ),
        ),
        ("lfm2", lambda: tf.Lfm2Config(**COMMON, layer_types=["conv", "full_attention", "conv", "full_attention"])),
        (
            "qwen3_next",
            lambda: config_class("Qwen3NextConfig")(
                **COMMON,
                head_dim=16,
                linear_num_value_heads=2,
                linear_num_key_heads=2,
                linear_key_head_dim=16,
                linear_value_head_dim=16,
                num_experts=2,
                num_experts_per_tok=1,
                moe_intermediate_size=32,
                shared_expert_intermediate_size=32,
            ),
        ),
    ]


@pytest.mark.parametrize("family, config", _hybrids(), ids=[f for f, _ in _hybrids()])
def test_recurrent_and_convolution_hybrids_are_refused_by_name_before_any_work(family, config, tmp_path):
    try:
        cfg = config()
    except kvlab.UnsupportedModelError as e:
        # A family the release does not ship (Qwen3-Next before 4.57) is refused by name instead.
        assert f"is not in transformers {TRANSFORMERS}" in str(e)
        return
    torch.manual_seed(TINY_SEED)
    model = tf.AutoModelForCausalLM.from_config(cfg).eval()
    with pytest.raises(kvlab.UnsupportedModelError, match=rf"\({family}\) is a hybrid") as e:
        kvlab.wrap(model, byte_tokenizer(), name=family)
    # Each kind of state layer is named with its layers, as the release builds the cache (kvlab.compat.state_layers).
    kinds = state_layers(cfg.get_text_config())
    assert kinds and all(f"{kind} at layer(s) {lis}" in str(e.value) for kind, lis in kinds.items())
    # From a folder: refused from the config's skeleton, before a weight is read.
    cfg.save_pretrained(tmp_path)
    byte_tokenizer().save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"not read")
    with pytest.raises(kvlab.UnsupportedModelError, match="is a hybrid"):
        kvlab.load_model(tmp_path)


@pytest.mark.parametrize(
    "config, match",
    [
        (
            lambda: tf.Llama4TextConfig(**COMMON, head_dim=16, num_local_experts=2, attention_chunk_size=None),
            "temperature it computes from the cache's length",
        ),
        (
            lambda: tf.Llama4TextConfig(
                **COMMON, head_dim=16, num_local_experts=2, attention_chunk_size=8, attn_temperature_tuning=False
            ),
            r"chunked attention at layer\(s\) \[0, 1, 2\]",
        ),
    ],
)
def test_llama4_variants_kvlab_cannot_mask_exactly_are_refused(config, match):
    if family_problem("llama4_text"):
        match = "router score"  # 4.56's routing defect is refused first, for every Llama 4
    torch.manual_seed(TINY_SEED)
    model = tf.AutoModelForCausalLM.from_config(config()).eval()
    with pytest.raises(kvlab.UnsupportedModelError, match=match):
        kvlab.wrap(model, byte_tokenizer(), name="llama4")


def test_mrope_is_refused_with_its_reason():
    text = dict(COMMON, **rope_config({"rope_type": "default", "rope_theta": 1e4, "mrope_section": [2, 3, 3]}))
    cfg = tf.Qwen2VLConfig(text_config=text, vision_config=dict(depth=1, embed_dim=32, num_heads=2, hidden_size=64))
    model = tf.AutoModelForImageTextToText.from_config(cfg).eval()
    with pytest.raises(
        kvlab.UnsupportedModelError, match=r"M-RoPE.*Moving all three by the same d is a plain rotation"
    ):
        kvlab.wrap(model, byte_tokenizer(), name="qwen2-vl")
