"""kvlab.peers: llama.cpp beside kvlab on the same GGUF file.

`make test` installs the `peers` extra, so in CI (CI=true) these tests run and fail when
llama-cpp-python is missing; elsewhere they skip with the install command.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import kvlab
from conftest import GEMMA_MISSING, GEMMA_REASON, IN_CI, missing, tiny
from kvlab.measure.metrics import kl_divergence
from kvlab.peers import llama_cpp as glue
from kvlab.peers.conversion import CONVERSION_PROBES, conversion_fidelity
from kvlab.peers.engine import KV_TYPES, QUANTISED_KV_TYPES, LlamaEngine
from kvlab.peers.kshift import quantised_shift_table
from kvlab.peers.mapping import check_vocab, engine_for, gguf_path
from kvlab.peers.merges import merge_side_by_side
from kvlab.peers.quantize import requantize
from kvlab.peers.state import state_file_study

# In CI (`make test` installs the extra) a missing llama-cpp-python fails these tests instead.
needs_llama = pytest.mark.skipif(
    not glue.available() and not IN_CI, reason="llama-cpp-python not installed: " + glue.INSTALL_HINT
)

TEXTS = [
    "The lighthouse keeper on Skerry Island logged every passing ship in a blue ledger.",
    " His daughter Maren later moved the ledger to the harbour museum in Bergen.",
]
PROBES = [" The ledger is now kept in the city of", " Maren was the keeper's"]


@pytest.fixture(scope="module")
def engine(smollm2):
    with engine_for(smollm2, n_ctx=1024, n_seq_max=2) as eng:
        yield eng


def ids_of(model, text, bos=False):
    return kvlab.tokenize(model, text, bos=bos)


# ----------------------------------------------------------------------------- clear errors


def test_a_wrong_gguf_path_is_a_clear_error(tmp_path):
    with pytest.raises(kvlab.PeerError, match="no GGUF file at .*missing.gguf: the path does not exist"):
        LlamaEngine(tmp_path / "missing.gguf")
    with pytest.raises(kvlab.PeerError, match="is not a file"):
        LlamaEngine(tmp_path)
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"PK\x03\x04 a zip, not a model")
    with pytest.raises(kvlab.PeerError, match=r"fake.gguf is not a GGUF file: it starts with b'PK\\x03\\x04'"):
        LlamaEngine(fake)
    with pytest.raises(kvlab.ModelError, match="no GGUF file at"):
        kvlab.load_gguf_file(tmp_path / "missing.gguf")


def test_a_missing_extra_says_how_to_install_it(monkeypatch):
    monkeypatch.setattr(glue, "_LIB", None)
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # what an absent package looks like to import
    with pytest.raises(kvlab.PeerError, match=r"pip install -e '\.\[peers\]'.*make peers"):
        glue.lib()
    path = gguf_path("smollm2-135m")
    with pytest.raises(kvlab.PeerError, match="need the `peers` extra"):
        LlamaEngine(path)


def test_kvlab_never_imports_llama_cpp_until_asked():
    code = "import sys, kvlab, kvlab.peers; assert 'llama_cpp' not in sys.modules, 'imported'"
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "PYTHONPATH": os.getcwd()})


def test_a_model_kvlab_cannot_map_is_a_clear_error():
    with pytest.raises(kvlab.PeerError, match="cannot map 'tiny-gemma3' to llama.cpp: tiny models .* no GGUF file"):
        gguf_path("tiny-gemma3")
    with pytest.raises(kvlab.PeerError, match="cannot map 'tiny-llama'"):
        engine_for(tiny("tiny-llama"))
    with pytest.raises(kvlab.PeerError, match="cannot map 'gpt-7' to llama.cpp: unknown model"):
        gguf_path("gpt-7")


@needs_llama
def test_vocabularies_must_agree(engine):
    with pytest.raises(kvlab.PeerError, match="vocabularies differ: kvlab's tiny-llama has .* llama.cpp's SmolLM2"):
        check_vocab(tiny("tiny-llama"), engine)
    with pytest.raises(kvlab.PeerError, match=f"token id {engine.n_vocab} is outside llama.cpp's vocabulary"):
        engine.decode([1, engine.n_vocab])


@needs_llama
def test_llama_cpp_refusals_carry_its_reason(engine, smollm2):
    engine.prefill(ids_of(smollm2, TEXTS[0], bos=True))
    at = engine.pos_max(0)
    # Positions must follow on from the sequence's maximum; llama.cpp says why it refuses.
    with pytest.raises(kvlab.PeerError, match=r"refused to decode .* at position 5 .*: .*(pos|position)"):
        engine.decode([42], 0, 5)
    assert engine.pos_max(0) == at  # nothing was appended


# ----------------------------------------------------------------------------- merges


@needs_llama
def test_one_fragment_shifted_by_zero_is_its_prefill(engine, smollm2):
    ids = ids_of(smollm2, TEXTS[0], bos=True)
    probe = ids_of(smollm2, PROBES[0])
    engine.prefill(ids)
    want = engine.read(probe)
    assert engine.shift_merge([ids]) == len(ids)
    assert torch.equal(engine.read(probe), want)


@needs_llama
def test_shift_merge_has_the_phase_right_and_the_context_wrong(engine, smollm2):
    ids = [ids_of(smollm2, TEXTS[0], bos=True), ids_of(smollm2, TEXTS[1])]
    probe = ids_of(smollm2, PROBES[0])
    engine.prefill(torch.cat(ids))
    joined = engine.read(probe)
    assert engine.shift_merge(ids) == sum(map(len, ids))
    assert engine.pos_min(0) == 0 and engine.pos_max(1) == -1  # all in sequence 0, sequence 1 emptied
    shifted = engine.read(probe)
    engine.phase_merge(ids)
    phase = engine.read(probe)
    # Against the fragment decoded at its landing positions the K-shift differs by the rounding
    # of rotated f16 keys, which the 8-bit activations of the Q4_1 file amplify (measured
    # 3.2e-3); against the joined prefill both lack fragment 1's context (measured 0.46).
    assert kl_divergence(joined, shifted) > 20 * kl_divergence(phase, shifted)
    assert kl_divergence(joined, phase) > 1e-2
    # With the dequantised weights (an F32 copy) only the f16 rounding is left (measured 1e-6).
    with LlamaEngine(requantize(engine.path, "F32"), n_ctx=1024, n_seq_max=2) as f32:
        f32.shift_merge(ids)
        shifted32 = f32.read(probe)
        f32.phase_merge(ids)
        assert kl_divergence(f32.read(probe), shifted32) < 1e-4


@needs_llama
def test_merge_side_by_side_rows(smollm2):
    rows = {(r.engine, r.method, r.reference): r for r in merge_side_by_side(smollm2, TEXTS, PROBES)}
    shift = rows[("llama.cpp", "shift", "joined")]
    rerotate = rows[("kvlab", "rerotate", "joined")]
    assert len(shift.kls) == len(PROBES) and all(k >= 0 for k in shift.kls)
    # Both engines lose the same cross-fragment context: same order of magnitude.
    assert 0.2 < shift.kl_mean / rerotate.kl_mean < 5
    assert rows[("kvlab", "naive", "joined")].kl_mean > rerotate.kl_mean


# ----------------------------------------------------------------------------- conversion, state files


@needs_llama
def test_conversion_fidelity_is_small_but_finite(smollm2):
    conv = conversion_fidelity(smollm2, CONVERSION_PROBES[:4])
    assert conv.n == 4 and conv.same_ids == 1.0
    # Not zero: llama.cpp multiplies 4-bit weights with 8-bit-rounded activations and keeps an
    # f16 cache; kvlab runs the dequantised weights in fp32. Measured mean 0.004-0.008 nats.
    assert 1e-5 < conv.kl_mean < 0.05, conv
    assert conv.top1 >= 0.75


@needs_llama
def test_state_files_round_trip_exactly(engine, smollm2, tmp_path):
    ids = ids_of(smollm2, TEXTS[0], bos=True)
    probe = ids_of(smollm2, PROBES[1])
    engine.prefill(ids)
    want = engine.read(probe)
    state = engine.save_state(tmp_path / "a.state", ids)
    seq = engine.save_seq_state(tmp_path / "a.seq", ids)
    assert not list(tmp_path.glob(".*"))  # written under a temporary name, then renamed
    engine.clear()
    assert engine.load_state(state) == ids.tolist()
    assert torch.equal(engine.read(probe), want)
    engine.clear()
    assert engine.load_seq_state(seq) == ids.tolist()
    assert torch.equal(engine.read(probe), want)
    with pytest.raises(kvlab.PeerError, match="no state file at"):
        engine.load_state(tmp_path / "nope.state")
    (tmp_path / "junk.state").write_bytes(b"\0" * 64)
    with pytest.raises(kvlab.PeerError, match="refused the state file junk.state: .*magic"):
        engine.load_state(tmp_path / "junk.state")


@needs_llama
def test_llama_cpp_accepts_a_requantisation_and_refuses_another_architecture(smollm2, tmp_path):
    if GEMMA_MISSING:
        missing(GEMMA_REASON)
    src = gguf_path("smollm2-135m")
    # Into this test's folder: the shared cache already holds the copy `make prepare-peers` made.
    q40 = requantize(src, "Q4_0", out_dir=tmp_path)
    assert q40 == requantize(src, "Q4_0", out_dir=tmp_path)  # kept, not redone
    assert q40.read_bytes() == requantize(src, "Q4_0").read_bytes()  # the prepared copy is the same file
    rows = state_file_study(
        smollm2, TEXTS[0], PROBES, {"same": src, "q4_0": q40, "gemma3": gguf_path("gemma3-270m")}, tmp_path
    )
    by = {(r.reader, r.file): r for r in rows}
    assert by[("same", "state")].accepted and by[("same", "state")].kls == [0.0] * len(PROBES)
    assert by[("q4_0", "state")].accepted and by[("q4_0", "seq")].accepted  # nothing in the file names its weights
    assert by[("q4_0", "state")].kl_mean > 1e-3
    assert not by[("gemma3", "state")].accepted and "wrong model arch" in by[("gemma3", "state")].said
    assert not by[("gemma3", "seq")].accepted


def test_kvlab_peers_takes_a_gguf_path_like_check_does(monkeypatch, capsys):
    # The file's own bytes decide the model (a catalogue file loads as that model); llama.cpp
    # then runs that very file. peer_table itself is exercised above; here only the routing.
    from kvlab.cli import main
    from kvlab.models.gguf import GGUF_MODELS
    from kvlab.peers import mapping, summary

    spec = GGUF_MODELS["smollm2-135m"]
    path = spec.locate(spec)
    monkeypatch.setattr(summary, "peer_table", lambda m: f"{m.name} runs {mapping.model_gguf(m)}")
    assert main(["peers", "--model", str(path)]) == 0
    assert capsys.readouterr().out.strip() == f"smollm2-135m runs {path}"


# ----------------------------------------------------------------------------- quantised K cache


@needs_llama
def test_kv_types_are_llama_cpps_ggml_types():
    L = glue.lib()
    assert KV_TYPES == {
        "f32": L.GGML_TYPE_F32,
        "f16": L.GGML_TYPE_F16,
        "q8_0": L.GGML_TYPE_Q8_0,
        "q4_0": L.GGML_TYPE_Q4_0,
    }
    assert set(QUANTISED_KV_TYPES) <= set(KV_TYPES)


@needs_llama
def test_kv_types_are_accepted_or_refused_by_name(engine):
    with pytest.raises(kvlab.PeerError, match=r"type_k must be one of \['f16', 'f32', 'q4_0', 'q8_0'\], got 'q5_7'"):
        LlamaEngine(engine.path, type_k="q5_7")
    with pytest.raises(kvlab.PeerError, match="kv_type must be one of .* got 'int8'"):
        LlamaEngine(engine.path, kv_type="int8")
    for t in QUANTISED_KV_TYPES:
        with LlamaEngine(engine.path, n_ctx=256, n_seq_max=1, type_k=t) as eng:
            assert (eng.type_k, eng.type_v) == (t, "f16")
        # llama.cpp's own refusal, with the types it was asked for.
        with pytest.raises(
            kvlab.PeerError,
            match=rf"K cache {t}, V cache {t}, flash_attn=False\): .*quantized V cache requires flash_attn",
        ):
            LlamaEngine(engine.path, n_ctx=256, kv_type=t, flash_attn=False)


@needs_llama
def test_a_shift_llama_cpp_cannot_do_names_the_k_cache_type():
    if GEMMA_MISSING:
        missing(GEMMA_REASON)
    # The window-only layout refuses a shift only where it is smaller than the whole cache: at
    # n_ctx=256 the sliding layers' cells (window x sequences + a batch) hold everything anyway.
    path = gguf_path("gemma3-270m")
    with LlamaEngine(path, n_ctx=256, n_seq_max=2, type_k="q4_0", swa_full=False) as eng:
        assert eng.can_shift()
    with LlamaEngine(path, n_ctx=4096, n_seq_max=2, type_k="q4_0", swa_full=False) as eng:
        with pytest.raises(kvlab.PeerError, match=r"cannot shift .* \(K cache q4_0, swa_full=False: .*can_shift"):
            eng.shift_merge([[2, 100, 101], [102, 103]])


@needs_llama
def test_a_quantised_k_shift_costs_more_than_an_f16_one(smollm2):
    cells = quantised_shift_table(smollm2, lengths=(128,), n_probes=4)
    by = {c.layout.label: c for c in cells}
    f16, q8, q4 = by["K f16, V f16"], by["K q8_0, V f16"], by["K q4_0, V f16"]
    assert all(c.n == 4 and c.tokens == 128 and not c.refused for c in (f16, q8, q4))
    # The f16 baseline: no quantisation cost, and the K-shift error of the short pair above (the
    # rounding of rotated f16 keys, amplified by the Q4_1 file's 8-bit activations; measured
    # 1.1e-3 mean here, 3-4e-3 there), far below the missing context (measured 19x).
    assert f16.quantisation.kl_max == 0.0
    assert f16.k_shift.kl_max < 1e-2 and f16.shift_joined.kl_mean > 5 * f16.k_shift.kl_mean
    # Requantising rotated keys to 4 bits costs more than rounding them to f16.
    assert q4.k_shift.kl_mean > 3 * f16.k_shift.kl_mean and q4.quantisation.kl_mean > 0
    assert q8.quantisation.kl_mean > 0
    refused = [c for c in cells if c.refused]
    assert [c.layout.type_v for c in refused] == list(QUANTISED_KV_TYPES)
    assert all(f"V cache {c.layout.type_v}" in c.refused and "flash_attn" in c.refused for c in refused)
    assert json.loads(json.dumps([c.row() for c in cells], default=float))[0]["k_shift"]["kls"] == f16.k_shift.kls


def test_kvlab_peers_quantised_adds_the_quantised_table(monkeypatch, capsys):
    # Routing only (the table itself is measured above): --quantised passes --lengths through.
    from kvlab.cli import main
    from kvlab.peers import kshift, summary

    monkeypatch.setattr(summary, "peer_table", lambda m: "side by side")
    monkeypatch.setattr(kshift, "quantised_shift_table", lambda m, lengths: [m.name, *lengths])
    monkeypatch.setattr(kshift, "format_quantised", lambda cells: f"cells {cells}")
    assert main(["peers", "--quantised", "--lengths", "64", "128"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("side by side\n") and out.rstrip().endswith("cells ['smollm2-135m', 64, 128]")
    assert main(["peers"]) == 0
    assert "cells" not in capsys.readouterr().out
