"""kvlab.fingerprint (kvlab/files/identity.py): every strict field is computed, compared and reported on its own."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from transformers import AutoModelForCausalLM

import kvlab
import kvlab.files.identity as fpmod
from kvlab.files.identity import GEOMETRY_FIELDS, STRICT_FIELDS, Difference, compare, fingerprint
from kvlab.models.loaded import LoadedModel


@pytest.fixture(scope="module")
def llama():
    return kvlab.load_model("tiny-llama")


@pytest.fixture(scope="module")
def fp(llama):
    return fingerprint(llama)


def fields(diffs: list[Difference]) -> set[str]:
    return {d.field for d in diffs}


def test_fingerprint_has_every_strict_field_and_is_json(fp):
    assert set(fp) == {"fingerprint_version", *STRICT_FIELDS, "info"}
    assert set(fp["geometry"]) == set(GEOMETRY_FIELDS)
    assert json.loads(json.dumps(fp)) == fp
    assert {"transformers", "torch"} <= set(fp["info"])


def test_fingerprint_is_stable_and_a_fresh_copy(llama, fp):
    again = fingerprint(llama)
    assert again == fp and again is not fp
    again["dtype"] = "changed"
    assert fingerprint(llama)["dtype"] == "float32"


def test_same_model_compares_equal(llama, fp):
    assert compare(fp, fingerprint(llama)) == []


STRICT_CHANGES = [f for f in STRICT_FIELDS if f != "geometry"] + [f"geometry.{g}" for g in GEOMETRY_FIELDS]


@pytest.mark.parametrize("field", STRICT_CHANGES)
def test_each_strict_field_changed_alone_is_detected(fp, field):
    other = copy.deepcopy(fp)
    if field.startswith("geometry."):
        other["geometry"][field.split(".", 1)[1]] = "something else"
    else:
        other[field] = "something else"
    diffs = compare(other, fp)
    assert fields(diffs) == {field}
    assert str(diffs[0]).startswith(f"{field}: file something else, model ")


@pytest.mark.parametrize("field", ["dtype", "weights_sha256", "geometry.kv_heads"])
def test_a_field_missing_from_the_file_is_a_difference(fp, field):
    other = copy.deepcopy(fp)
    if "." in field:
        del other["geometry"][field.split(".")[1]]
    else:
        del other[field]
    diffs = compare(other, fp)
    assert fields(diffs) == {field} and "file (absent)" in str(diffs[0])


def test_info_fields_are_never_compared(fp):
    other = copy.deepcopy(fp)
    other["info"] = {"transformers": "0.0.1", "torch": "0.1", "model_name": "someone"}
    other["fingerprint_version"] = 99
    assert compare(other, fp) == []


def test_types_do_not_pass_for_each_other(fp):
    other = copy.deepcopy(fp)
    other["geometry"]["kv_heads"] = float(fp["geometry"]["kv_heads"])
    assert fields(compare(other, fp)) == {"geometry.kv_heads"}


def test_not_a_dict_is_one_difference(fp):
    assert fields(compare(["x"], fp)) == {"fingerprint"}


def test_difference_message_names_both_values():
    d = Difference("dtype", "float32", "bfloat16")
    assert str(d) == "dtype: file float32, model bfloat16"
    layers = Difference("geometry.layer_types", ["full_attention"] * 30, ["sliding_attention"] * 3 + ["full_attention"])
    assert str(layers) == (
        "geometry.layer_types: file [30x full_attention], model [3x sliding_attention, full_attention]"
    )
    assert (
        str(Difference("weights_sha256", "ab" * 32, "cd" * 32))
        == "weights_sha256: file abababababababab…, model cdcdcdcdcdcdcdcd…"
    )


def _variant(base: LoadedModel, module=None, tokenizer=None, **source) -> LoadedModel:
    module = module if module is not None else base.model
    return LoadedModel(
        model=module,
        tokenizer=tokenizer or base.tokenizer,
        name=base.name,
        config=module.config,
        source=dict(base.source, **source),
    )


# Real changes, made one at a time to a copy of the model; each is caught by its own field.


def test_dtype_cast_changes_dtype_and_weights_only(llama, fp):
    cast = _variant(llama, copy.deepcopy(llama.model).to(torch.bfloat16))
    assert fields(compare(fp, fingerprint(cast))) == {"dtype", "weights_sha256"}


def test_one_weight_edited_changes_weights_only(llama, fp):
    module = copy.deepcopy(llama.model)
    edited = _variant(llama, module)
    assert compare(fp, fingerprint(edited)) == []
    with torch.no_grad():
        module.model.layers[1].mlp.down_proj.weight[3, 5] += 1e-3
    assert fields(compare(fp, fingerprint(edited))) == {"weights_sha256"}


def test_config_change_changes_config_only(llama, fp):
    module = copy.deepcopy(llama.model)
    module.config.rms_norm_eps = 1e-3
    assert fields(compare(fp, fingerprint(_variant(llama, module)))) == {"config_sha256"}


def test_volatile_config_keys_do_not_change_the_digest(llama):
    config = copy.deepcopy(llama.config)
    before = fpmod.config_digest(config)
    config.transformers_version = "9.9.9"
    config._name_or_path = "/somewhere/else"
    config.use_cache = not config.use_cache
    assert fpmod.config_digest(config) == before


def test_tokenizer_change_changes_tokenizer_only(llama, fp):
    tok = copy.deepcopy(llama.tokenizer)
    tok.add_tokens(["<kvlab-extra>"])
    assert fields(compare(fp, fingerprint(_variant(llama, tokenizer=tok)))) == {"tokenizer_sha256"}


def test_tokenizer_truncation_setting_is_not_identity(llama, fp):
    tok = copy.deepcopy(llama.tokenizer)
    tok.backend_tokenizer.enable_truncation(max_length=7)
    assert fpmod.tokenizer_digest(tok) == fp["tokenizer_sha256"]
    assert tok.backend_tokenizer.truncation["max_length"] == 7  # restored, not cleared


@pytest.mark.parametrize(
    "key,field", [("name", "source"), ("gguf_sha256", "source_sha256"), ("quantization", "quantization")]
)
def test_source_fields_changed_alone(llama, fp, key, field):
    assert fields(compare(fp, fingerprint(_variant(llama, **{key: "other"})))) == {field}


def test_another_architecture_names_architecture_and_geometry(fp):
    gemma = kvlab.load_model("tiny-gemma3")
    got = fields(compare(fp, fingerprint(gemma)))
    assert {"architecture", "geometry.num_layers", "geometry.layer_types", "geometry.sliding_window"} <= got


def test_same_shapes_other_architecture_is_caught(fp):
    qwen = kvlab.load_model("tiny-qwen2")  # same layer count, heads and head_dim as tiny-llama
    got = fields(compare(fp, fingerprint(qwen)))
    assert "architecture" in got and not any(f.startswith("geometry.") and f != "geometry.rope" for f in got)


@pytest.mark.parametrize(
    "name", ["tiny-llama", "tiny-qwen2", "tiny-gemma3", "tiny-gptneox", "tiny-phi", "tiny-yarn", "tiny-longrope"]
)
def test_geometry_matches_the_caches_the_model_makes(name):
    model = kvlab.load_model(name)
    geo = fingerprint(model, weights=False)["geometry"]
    frag = kvlab.prefill(model, "a sentence long enough to fill a window of eight")
    assert geo["num_layers"] == len(frag.cache.layers)
    for layer, kind in zip(frag.cache.layers, geo["layer_types"]):
        assert layer.is_sliding == (kind == "sliding_attention")
        assert layer.keys.shape[1] == geo["kv_heads"] and layer.keys.shape[3] == geo["head_dim"]
        if layer.is_sliding:
            assert layer.sliding_window == geo["sliding_window"]
    ropes = kvlab.layer_ropes(model.model)
    assert {r.layer_type: r.rotary_dim for r in ropes} == {k: v["rotary_dim"] for k, v in geo["rope"].items()}


def test_weights_false_skips_the_digest_and_compare_ignores_it(llama, fp):
    light = fingerprint(llama, weights=False)
    assert light["weights_sha256"] is None
    assert compare(fp, light) == []


def test_tied_weights_are_part_of_the_identity():
    gemma = kvlab.load_model("tiny-gemma3")  # ties lm_head to the embeddings
    assert gemma.model.lm_head.weight is gemma.model.model.embed_tokens.weight
    untied = copy.deepcopy(gemma.model)
    untied.lm_head.weight = torch.nn.Parameter(untied.lm_head.weight.detach().clone())
    assert fpmod.weights_digest(untied) != fpmod.weights_digest(gemma.model)


def test_weights_digest_is_the_documented_function(llama):
    import hashlib

    state = llama.model.state_dict()
    lines = []
    for name in sorted(state):
        t = state[name].contiguous()
        digest = hashlib.sha256(t.view(torch.uint8).numpy().tobytes()).hexdigest()
        lines.append(f"{name}\t{str(t.dtype).removeprefix('torch.')}\t{list(t.shape)}\t{digest}\n")
    expect = hashlib.sha256(b"kvlab-weights-v1\n" + "".join(lines).encode()).hexdigest()
    assert fpmod.weights_digest(llama.model) == expect


def test_sha256_many_matches_hashlib_serial_and_parallel():
    import hashlib

    bufs = [torch.arange(n, dtype=torch.float32).numpy() for n in (0, 3, 5_000_000, 1_000_000)]
    assert fpmod.sha256_many(bufs) == [hashlib.sha256(b).hexdigest() for b in bufs]
    assert fpmod.sha256_many(bufs[:2]) == [hashlib.sha256(b).hexdigest() for b in bufs[:2]]


# The digest kept in a conversion-cache folder, for a model loaded unchanged from it.


@pytest.fixture()
def converted(tmp_path, llama):
    folder = tmp_path / "fake-converted"
    llama.model.save_pretrained(folder)

    def load():
        module = AutoModelForCausalLM.from_pretrained(folder).eval()
        # A fresh tokenizer object too: nothing of the first load is remembered in memory.
        return LoadedModel(
            model=module,
            tokenizer=copy.deepcopy(llama.tokenizer),
            name="fake",
            config=module.config,
            source={
                "name": "fake",
                "package": "fake-pkg",
                "gguf_file": "fake.gguf",
                "gguf_sha256": "ab" * 32,
                "quantization": "Q8_0",
                "folder": str(folder),
            },
        )

    return folder, load


def test_folder_keeps_the_fingerprint_and_a_new_process_reuses_it(converted, monkeypatch):
    folder, load = converted
    first = fingerprint(load())
    stored = json.loads((folder / "fingerprint-float32.json").read_text())
    assert stored["weights"]["sha256"] == first["weights_sha256"]
    kept = json.loads((folder / "fingerprint-tokenizer.json").read_text())
    assert kept["tokenizer"]["sha256"] == first["tokenizer_sha256"]

    def no_hashing(*a, **k):
        raise AssertionError("the folder's digest should have been used")

    fresh = load()
    monkeypatch.setattr(fpmod, "weights_digest", no_hashing)
    monkeypatch.setattr(fpmod, "tokenizer_digest", no_hashing)
    assert fingerprint(fresh) == first


def test_folder_digest_is_not_trusted_after_an_edit(converted):
    folder, load = converted
    first = fingerprint(load())
    edited = load()
    with torch.no_grad():
        edited.model.model.layers[0].self_attn.k_proj.weight.mul_(1.5)  # bumps the version counter
    assert fingerprint(edited)["weights_sha256"] != first["weights_sha256"]
    swapped = load()
    w = swapped.model.model.layers[0].self_attn.v_proj.weight
    w.data = torch.zeros_like(w)  # new storage at version 0: the sampled check catches it
    assert fingerprint(swapped)["weights_sha256"] != first["weights_sha256"]
    assert json.loads((folder / "fingerprint-float32.json").read_text())["weights"]["sha256"] == first["weights_sha256"]


def test_kept_tokenizer_digest_is_not_trusted_after_its_files_change(converted, llama, monkeypatch):
    folder, load = converted
    llama.tokenizer.save_pretrained(folder)
    first = fingerprint(load())
    calls = []
    real = fpmod.tokenizer_digest
    monkeypatch.setattr(fpmod, "tokenizer_digest", lambda tok: calls.append(1) or real(tok))
    assert fingerprint(load()) == first and calls == []  # files unchanged: the kept digest serves
    cfg = folder / "tokenizer_config.json"
    cfg.write_text(cfg.read_text().replace("{", '{"edited_by_hand": true, ', 1))
    assert fingerprint(load())["tokenizer_sha256"] == first["tokenizer_sha256"]  # the live tokenizer is the same
    assert calls == [1]  # ... but it was hashed again, not taken on trust
    assert fingerprint(load()) == first and calls == [1]  # and the refreshed entry serves the next process
