"""kvlab.variants and kvlab.mismatch_kl: same-shape readers, and what a foreign cache does to them."""

from __future__ import annotations

import math

import pytest
import torch

import kvlab
from kvlab.errors import KvlabError, MergeError
from kvlab.files.identity import compare, fingerprint, weights_digest
from kvlab.files.io import save_cache
from kvlab.measure.mismatch import (
    DEFAULT_PROBES,
    VARIANT_KINDS,
    WideLinear,
    finetune_snapshots,
    finetune_text,
    format_study,
    mismatch_kl,
    mismatch_study,
    variants,
)

# Tiny fine-tunes: enough to move every weight, fast enough for a test.
TINY_FT = {"steps": 2, "seq_len": 32, "batch": 2}


@pytest.fixture(scope="module")
def llama():
    return kvlab.load_model("tiny-llama")


@pytest.fixture(scope="module")
def made(llama):
    before = weights_digest(llama.model)
    out = {k: variants(llama, k, **(TINY_FT if k == "finetune" else {})) for k in VARIANT_KINDS}
    assert weights_digest(llama.model) == before, "making variants must not touch the producer"
    return out


@pytest.fixture(scope="module")
def saved(llama, tmp_path_factory):
    frag = kvlab.prefill(llama, "Ines runs the only shop on the island and keeps a notebook.")
    return save_cache(tmp_path_factory.mktemp("variants") / "producer.kvcache", frag, llama)


EXPECTED_FIELDS = {
    "bf16": {"dtype", "weights_sha256"},
    "fp16": {"dtype", "weights_sha256"},
    "int8": {"quantization", "weights_sha256"},
    "finetune": {"source", "weights_sha256"},
}


@pytest.mark.parametrize("kind", VARIANT_KINDS)
def test_variant_has_the_producers_shape_and_its_own_identity(llama, made, kind):
    v = made[kind]
    assert v.name == f"tiny-llama+{kind}" and v.source["variant"] == kind
    assert v.model is not llama.model
    p, r = fingerprint(llama), fingerprint(v)
    assert {d.field for d in compare(p, r)} == EXPECTED_FIELDS[kind]
    assert r["geometry"] == p["geometry"] and r["architecture"] == p["architecture"]
    for (n1, a), (n2, b) in zip(llama.model.state_dict().items(), v.model.state_dict().items()):
        assert n1 == n2 and a.shape == b.shape
    assert not any(t.requires_grad for t in v.model.parameters())


def test_dtype_variants_are_casts(llama, made):
    assert made["bf16"].dtype == torch.bfloat16 and made["fp16"].dtype == torch.float16
    w = llama.model.model.layers[0].self_attn.q_proj.weight
    assert torch.equal(made["bf16"].model.model.layers[0].self_attn.q_proj.weight, w.to(torch.bfloat16))


@pytest.mark.parametrize("kind", ["bf16", "fp16"])
def test_half_variants_sum_each_product_in_fp32_and_round_it_once(llama, made, kind):
    v = made[kind]
    linears = [m for m in v.model.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(type(m) is WideLinear for m in linears)
    lin = v.model.model.layers[0].mlp.down_proj
    x = torch.randn(5, lin.in_features, generator=torch.Generator().manual_seed(0)).to(v.dtype)
    out = lin(x)
    want = (x.double() @ lin.weight.double().T).to(v.dtype)  # the exact product, rounded once
    assert out.dtype == v.dtype and torch.equal(
        out, torch.nn.functional.linear(x.float(), lin.weight.float()).to(v.dtype)
    )
    # fp32 summation order aside, the exact product: at most one unit in the last place apart.
    ulp = torch.finfo(v.dtype).eps * want.double().abs().clamp_min(torch.finfo(v.dtype).tiny)
    assert ((out.double() - want.double()).abs() <= ulp).all()
    # torch's own half GEMM computes the same thing, to the order of the sums.
    native = torch.nn.Linear.forward(lin, x)
    assert ((out.double() - native.double()).abs() <= ulp).all()
    ids = torch.tensor([[1, 5, 9, 2, 7]])
    with torch.inference_mode():
        a, b = v.model(input_ids=ids).logits, v.model(input_ids=ids).logits
    assert a.dtype == v.dtype and torch.equal(a, b)


def test_wide_linear_keeps_its_fp32_weights_until_they_change(llama):
    v = variants(llama, "bf16")
    lin = v.model.model.layers[0].mlp.down_proj
    keys = set(v.model.state_dict())
    x = torch.randn(3, lin.in_features, generator=torch.Generator().manual_seed(1)).to(v.dtype)
    first = lin(x)
    kept = lin._wide()[0]
    assert kept.dtype == torch.float32 and torch.equal(kept, lin.weight.float())
    assert lin._wide()[0] is kept, "a second call must not cast the weights again"
    assert set(v.model.state_dict()) == keys, "the kept copy is not part of the state dict"
    with torch.no_grad():
        lin.weight.mul_(2)  # an in-place edit bumps the version: the copy is made again
    assert lin._wide()[0] is not kept
    assert torch.equal(lin(x), torch.nn.functional.linear(x.float(), lin.weight.float()).to(v.dtype))
    assert not torch.equal(lin(x), first)
    lin.weight.requires_grad_(True)  # a gradient must flow to the weight, not stop at a kept copy
    lin(x).float().sum().backward()
    assert lin.weight.grad is not None and lin.weight.grad.abs().sum() > 0


def test_int8_round_trip_is_per_channel_and_bounded(llama, made):
    w = llama.model.model.layers[1].mlp.up_proj.weight.detach()
    q = made["int8"].model.model.layers[1].mlp.up_proj.weight.detach()
    scale = w.abs().amax(dim=1, keepdim=True) / 127
    assert ((q - w).abs() <= scale / 2 + 1e-7).all()
    levels = (q / scale).round()
    assert torch.allclose(levels * scale, q, atol=1e-6) and levels.abs().max() <= 127
    norm = "model.layers.1.input_layernorm.weight"
    assert torch.equal(made["int8"].model.state_dict()[norm], llama.model.state_dict()[norm])  # 1-D: untouched
    assert made["int8"].dtype == torch.float32


def test_finetune_is_deterministic_and_seeded(llama, made):
    again = variants(llama, "finetune", **TINY_FT)
    assert weights_digest(again.model) == weights_digest(made["finetune"].model)
    other = variants(llama, "finetune", **dict(TINY_FT, seed=1))
    assert weights_digest(other.model) != weights_digest(again.model)
    emb = "model.embed_tokens.weight"
    assert torch.equal(again.model.state_dict()[emb], llama.model.state_dict()[emb])  # embeddings frozen
    assert "2 AdamW steps" in fingerprint(again)["source"]


def test_finetune_text_is_shipped():
    text = finetune_text()
    assert len(text.split()) > 200 and text.isascii()


def test_bad_requests_are_kvlab_errors(llama):
    with pytest.raises(KvlabError, match="unknown variant 'int4'"):
        variants(llama, "int4")
    with pytest.raises(KvlabError, match="takes no option"):
        variants(llama, "bf16", steps=3)
    with pytest.raises(KvlabError, match="takes no option"):
        variants(llama, "finetune", epochs=3)


def test_producer_reading_its_own_file_moves_nothing(llama, saved):
    res = mismatch_kl(saved, llama)
    assert res.differences == [] and res.flips == 0
    assert [r.probe for r in res.rows] == list(DEFAULT_PROBES)
    assert all(r.kl == 0.0 for r in res.rows)


@pytest.mark.parametrize("kind", VARIANT_KINDS)
def test_mismatch_kl_of_each_variant(made, saved, kind):
    res = mismatch_kl(saved, made[kind], probes=["\nQ: Who?", "\nShe"])
    assert {d.field for d in res.differences} == EXPECTED_FIELDS[kind]
    assert len(res.rows) == 2 and all(r.kl >= 0 and math.isfinite(r.kl) for r in res.rows)
    assert max(r.kl for r in res.rows) > 0  # other weights: the foreign cache is not what this reader computes
    assert f"reader tiny-llama+{kind}" in res.table()


def test_mismatch_kl_scores_the_answer_span(llama, made, saved):
    probes, answers = ["\nQ: Who keeps the bees? A:", "\nShe sells the"], ["Marta", "honey at the market"]
    own = mismatch_kl(saved, llama, probes=probes, answers=answers)
    # The producer reading its own file: the answer scored behind the same cache twice.
    assert all(r.span_kl == 0.0 and r.nll == r.nll_own > 0 for r in own.rows)
    res = mismatch_kl(saved, made["finetune"], probes=probes, answers=answers)
    assert all(r.span_kl > 0 and math.isfinite(r.nll) and r.nll != r.nll_own for r in res.rows)
    # Without answers: next-token scores only, the same to rounding (the probes are packed otherwise).
    plain = mismatch_kl(saved, made["finetune"], probes=probes)
    assert [r.kl for r in plain.rows] == pytest.approx([r.kl for r in res.rows], rel=1e-4, abs=1e-9)
    assert [r.top1_foreign for r in plain.rows] == [r.top1_foreign for r in res.rows] and plain.rows[0].span_kl is None


def test_mismatch_kl_takes_a_fragment(llama, made):
    frag = kvlab.prefill(llama, "A fragment straight from the producer.")
    res = mismatch_kl(frag, made["finetune"], probes=["\nQ: What?"])
    assert res.differences is None and res.rows[0].kl > 0


def test_mismatch_kl_needs_start_zero_and_source(llama):
    with pytest.raises(MergeError, match="start at position 0"):
        mismatch_kl(kvlab.prefill(llama, "shifted", start=5), llama)
    no_source = kvlab.Fragment(kvlab.prefill(llama, "x").cache, None, None, 0, llama.name, llama.config)
    with pytest.raises(MergeError, match="no source text"):
        mismatch_kl(no_source, llama)


def test_study_table_has_every_variant(llama):
    results = mismatch_study(llama, probes=["\nQ: Where?"], **TINY_FT)
    assert list(results) == ["self", *VARIANT_KINDS]
    table = format_study(results)
    for kind in VARIANT_KINDS:
        assert kind in table


@pytest.mark.real
def test_smollm2_variants_read_a_foreign_cache(tmp_path, smollm2):
    # The smollm2 fine-tune runs in the study (kvlab mismatch), not here: too slow for a test.
    producer = smollm2
    path = save_cache(
        tmp_path / "p.kvcache", kvlab.prefill(producer, "Rui mends nets in the shed behind the shop."), producer
    )
    reader = variants(producer, "int8")
    res = mismatch_kl(path, reader, probes=["\nQ: Who mends nets?"])
    assert {d.field for d in res.differences} == {"quantization", "weights_sha256"}
    assert 0 < res.rows[0].kl < 1
    del reader
    # The bf16 variant is exactly what loading the checkpoint in bf16 gives.
    cast = variants(producer, "bf16")
    loaded = kvlab.load_model("smollm2-135m", dtype=torch.bfloat16)
    assert compare(fingerprint(cast), fingerprint(loaded)) == []


def test_finetune_snapshots_are_the_k_step_fine_tunes_of_one_run(llama):
    # Nested snapshots of one run: at each k, bit for bit and in fingerprint, an independent k-step fine-tune.
    opts = {k: v for k, v in TINY_FT.items() if k != "steps"}
    before = weights_digest(llama.model)
    seen = []
    for k, reader in finetune_snapshots(llama, [3, 0, 1, 3], **opts):
        seen.append(k)
        if k == 0:
            assert reader is llama  # no step taken: the producer itself
            continue
        alone = variants(llama, "finetune", steps=k, **opts)
        mine, theirs = reader.model.state_dict(), alone.model.state_dict()
        assert all(torch.equal(mine[n], theirs[n]) for n in theirs)
        assert fingerprint(reader) == fingerprint(alone) and reader.dtype == llama.dtype
        assert not any(p.requires_grad for p in reader.model.parameters())
    assert seen == [0, 1, 3] and weights_digest(llama.model) == before
    with pytest.raises(KvlabError, match="integers >= 0"):
        next(finetune_snapshots(llama, [-1]))
    with pytest.raises(KvlabError, match="no option"):
        next(finetune_snapshots(llama, [1], epochs=2))
