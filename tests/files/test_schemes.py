"""kvlab.files.schemes: which identity scheme refuses which mismatch, and kvlab's row measured."""

from __future__ import annotations

import copy

import pytest
from transformers import AutoModelForCausalLM

import kvlab
from kvlab.compat import rope_parameters, set_rope
from kvlab.errors import KvlabError
from kvlab.files import schemes
from kvlab.models.loaded import LoadedModel


def test_each_scheme_refuses_exactly_the_mismatches_it_can_see():
    by = {s.name: s for s in schemes.SCHEMES}
    lmcache_old, lmcache = by["LMCache, before its dtype field"], by["LMCache"]
    # LMCache's dtype field is what made the casts visible (issue 1856); an int8 round trip of
    # the weights keeps the KV dtype, so neither key sees it.
    assert not schemes.refuses(lmcache_old, "bf16") and schemes.refuses(lmcache, "bf16")
    assert not schemes.refuses(lmcache, "int8") and not schemes.refuses(lmcache, "finetune")
    assert schemes.refuses(by["vLLM KV offload"], "rope factor") and not schemes.refuses(lmcache, "rope factor")
    # Every key hashes token ids: another tokenizer misses.
    assert all(schemes.refuses(s, "tokenizer") for s in schemes.SCHEMES if s.name != "llama.cpp state file")
    # What notebook 06 measured: a requantised reader loads llama.cpp's state file, another architecture does not.
    llama_cpp = by["llama.cpp state file"]
    assert not schemes.refuses(llama_cpp, "requant") and schemes.refuses(llama_cpp, "architecture")
    assert all(schemes.refuses(by["kvlab fingerprint"], m) for m in schemes.MISMATCHES)
    # Another family on the same tokenizer: every token-id key matches; only kvlab and llama.cpp check the model.
    assert [s.name for s in schemes.SCHEMES if schemes.refuses(s, "architecture, same tokenizer")] == [
        "llama.cpp state file",
        "kvlab fingerprint",
    ]
    # A fine-tune under the producer's name: vLLM refuses it by its revision (a new one), kvlab by its
    # weights; the keys of the others load it.
    assert [s.name for s in schemes.SCHEMES if schemes.refuses(s, "finetune")] == [
        "vLLM KV offload",
        "kvlab fingerprint",
    ]
    with pytest.raises(KvlabError, match="unknown mismatch 'nope'"):
        schemes.refuses(lmcache, "nope")


def test_table_marks_each_cell_and_shows_the_effect_with_its_source():
    t = schemes.table({"bf16": "0.0011 nats (notebook 03)"}, mismatches=["bf16", "tokenizer"])
    lines = t.splitlines()
    assert len(lines) == 6 and lines[0].count("|") == len(schemes.SCHEMES) + 3
    assert lines[2].startswith("| bf16 | LOADS | refused |") and lines[2].endswith("| 0.0011 nats (notebook 03) |")
    assert lines[3].endswith("| not measured |") and lines[5].startswith("Measured: kvlab's column")


def _reader(base: LoadedModel, module=None, tokenizer=None) -> LoadedModel:
    module = module if module is not None else base.model
    return LoadedModel(
        model=module, tokenizer=tokenizer or base.tokenizer, name=base.name, config=module.config, source=base.source
    )


def _refused_fields(producer: LoadedModel, reader: LoadedModel, tmp_path) -> set[str]:
    path = kvlab.save_cache(tmp_path / "c.kvcache", kvlab.prefill(producer, "The ledger is kept in"), producer)
    with pytest.raises(kvlab.FingerprintMismatch) as e:
        kvlab.load_cache(path, reader)
    return {d.field for d in e.value.differences}


def test_kvlab_refuses_a_rope_change_of_the_same_weights(tmp_path):
    # vLLM 56311: the same checkpoint served with another rope configuration.
    base = kvlab.load_model("tiny-llama")
    config = copy.deepcopy(base.config)
    params = rope_parameters(config)
    set_rope(config, dict(params, rope_theta=params["rope_theta"] * 4))
    module = AutoModelForCausalLM.from_config(config)
    module.load_state_dict(base.model.state_dict())
    module.eval()
    got = _refused_fields(base, _reader(base, module), tmp_path)
    assert {"config_sha256", "geometry.rope"} <= got and "weights_sha256" not in got


def test_kvlab_refuses_another_tokenizer_and_another_architecture(tmp_path):
    base = kvlab.load_model("tiny-llama")
    tok = copy.deepcopy(base.tokenizer)
    tok.add_tokens(["<kvlab-extra>"])
    assert _refused_fields(base, _reader(base, tokenizer=tok), tmp_path) == {"tokenizer_sha256"}
    assert "architecture" in _refused_fields(base, kvlab.load_model("tiny-qwen2"), tmp_path)
