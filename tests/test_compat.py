"""kvlab.compat is the one home of what differs between transformers releases; what the release lacks is refused by name.

Runs in every cell of .ci/matrix (the core's tests) as well as in the main suite.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from packaging.version import Version

import kvlab
from conftest import TINY_HERE, TINY_REFUSED
from kvlab import compat
from kvlab.errors import ModelError, UnsupportedModelError
from kvlab.models.tiny import TINY_CONFIGS

ROOT = Path(__file__).resolve().parents[1]

#: What a version test looks like: the release compared, or an attribute or argument that exists in
#: some releases only probed or spelled. Each pattern names what it catches.
VERSION_TESTS = {
    "a release compared": re.compile(
        r"(transformers\.__version__|\bRELEASE\b|compat\.TRANSFORMERS)\s*(<|>|==|!=|\[|\.startswith|\.split)"
        r"|(version\.parse|Version)\(\s*transformers"
    ),
    "a release-dependent attribute probed": re.compile(
        r"(hasattr|getattr)\([^,()]+,\s*f?[\"'](rope_parameters|rope_theta|rope_scaling|rope_local_base_freq|"
        r"is_initialized|key_cache|layers_block_type|rotary_emb_local|(sliding|full)_attention_inv_freq|\{[a-z_\[\]]+\}_inv_freq)[\"']"
    ),
    "the cache argument spelled": re.compile(r"[\"']past_key_values?[\"']|\bpast_key_values\s*="),
}

#: The module itself, and this file's examples of what the scan catches.
OWN_HOME = {"kvlab/compat.py", "tests/test_compat.py"}


#: A line that compares a release without branching on it (the main suite's venv holds the Makefile's
#: pin) says so, with its reason, after this mark.
EXEMPT = "# compat-exempt: "


def version_tests(text: str) -> list[str]:
    """``"line N: what"`` for each line of ``text`` that tests or spells a release difference."""
    out = []
    for n, row in enumerate(text.splitlines(), 1):
        code, _, comment = row.partition("#")
        if ("#" + comment).startswith(EXEMPT) and len(comment) > len(EXEMPT) + 8:
            continue
        out += [f"line {n}: {what}" for what, pattern in VERSION_TESTS.items() if pattern.search(code)]
    return out


@pytest.mark.parametrize(
    "snippet",
    [
        'if transformers.__version__ >= "5.0":',
        "if Version(transformers.__version__) < Version('4.57'):",
        "kw = 'cache' if RELEASE >= (5, 24, 0) else 'past_key_values'",
        "model(input_ids=ids, past_key_values=cache)",
        'if hasattr(config, "rope_parameters"):',
        'theta = getattr(config, "rope_theta", 1e4)',
        'found = getattr(rotary, f"{kind}_inv_freq", None)',
        'ready = getattr(layer, "is_initialized", False)',
    ],
)
def test_the_scan_catches_each_kind_of_version_test(snippet):
    assert version_tests(snippet), snippet
    assert version_tests(snippet + "  # compat-exempt:"), "an exemption states its reason"
    assert not version_tests(snippet + "  # compat-exempt: the main suite's own pin")


def test_no_version_test_outside_compat():
    hits = []
    for folder in ("kvlab", "tests", "studies", "benchmarks", "scripts"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel not in OWN_HOME:
                hits += [f"{rel} {hit}" for hit in version_tests(path.read_text())]
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        cells = json.loads(path.read_text())["cells"]
        code = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
        hits += [f"{path.name} {hit}" for hit in version_tests(code)]
    assert not hits, "version tests outside kvlab/compat.py:\n" + "\n".join(hits)


def test_the_forward_pass_gets_the_cache_under_the_releases_name():
    # A name the release does not read is swallowed by **kwargs and the cache silently stays empty.
    model = kvlab.load_model("tiny-llama")
    cache = kvlab.prefill(model, "one two three").cache
    before = cache.get_seq_length()
    ids = kvlab.tokenize(model, " four")
    compat.forward(model.model, cache, input_ids=ids[None], use_cache=True)
    assert before > 0 and cache.get_seq_length() == before + len(ids)


def test_every_tiny_model_is_built_or_refused_naming_the_release():
    assert set(TINY_HERE) | set(TINY_REFUSED) == set(TINY_CONFIGS)
    for name, why in TINY_REFUSED.items():
        assert f"transformers {compat.TRANSFORMERS}" in why, (name, why)
        with pytest.raises(UnsupportedModelError, match=re.escape(f"transformers {compat.TRANSFORMERS}")):
            kvlab.load_model(name)


def test_on_the_newest_tested_release_no_tiny_model_is_refused():
    newest = max(compat.TESTED["transformers"], key=Version)
    if compat.TRANSFORMERS != newest:
        # What older releases lack is listed, by name, in the test above.
        assert compat.TRANSFORMERS in compat.TESTED["transformers"]
        return
    assert not TINY_REFUSED


def test_an_architecture_the_release_lacks_is_refused_by_name():
    with pytest.raises(UnsupportedModelError, match=rf"NoSuch is not in transformers {re.escape(compat.TRANSFORMERS)}"):
        compat.config_class("NoSuchConfig")


def test_the_rope_fields_round_trip_through_the_releases_spelling():
    for params in (
        {"rope_type": "default", "rope_theta": 1e5},
        {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 256},
    ):
        config = compat.config_class("LlamaConfig")(**compat.rope_config(params))
        got = compat.rope_parameters(config)
        assert {k: got[k] for k in params} == params


def test_untested_names_a_release_outside_the_cells(monkeypatch):
    monkeypatch.setattr(compat, "TRANSFORMERS", "9.9.9")
    monkeypatch.setattr(torch, "__version__", "9.0.0+cpu")
    assert compat.untested() == ["transformers 9.9.9", "torch 9.0.0+cpu"]


def _tied_folder(tmp_path: Path, drop: tuple[str, ...]) -> tuple[Path, dict]:
    """A tiny tied-embedding Llama saved as kvlab's conversions save one: each tied pair under one name."""
    import transformers as tf
    from safetensors.torch import save_file

    torch.manual_seed(0)
    config = compat.config_class("LlamaConfig")(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        tie_word_embeddings=True,
    )  # fmt: skip
    model = tf.AutoModelForCausalLM.from_config(config)
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k not in drop}
    config.save_pretrained(tmp_path)
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    return tmp_path, state


def test_a_tied_embedding_kept_under_either_name_loads_on_every_release(tmp_path):
    # 4.x ties the output embedding from the input one and left embed_tokens on meta when only lm_head was kept.
    for kept in ("lm_head.weight", "model.embed_tokens.weight"):
        other = "model.embed_tokens.weight" if kept == "lm_head.weight" else "lm_head.weight"
        folder, state = _tied_folder(tmp_path / kept, (other,))
        model = compat.load_causal_lm(folder, torch.float32)
        assert torch.equal(model.get_input_embeddings().weight, state[kept])
        assert model.get_output_embeddings().weight is model.get_input_embeddings().weight


def test_a_weight_the_file_lacks_is_refused_by_name(tmp_path):
    folder, _ = _tied_folder(tmp_path, ("lm_head.weight", "model.layers.0.mlp.up_proj.weight"))
    with pytest.raises(ModelError, match=r"lacks 1 weight\(s\) of its model: model\.layers\.0\.mlp\.up_proj\.weight"):
        compat.load_causal_lm(folder, torch.float32)
