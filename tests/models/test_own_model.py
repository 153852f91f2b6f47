"""Bring your own model: local folders, GGUF paths, live objects, any device; and the models kvlab refuses."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers as tf

import kvlab
from conftest import TINY_HERE, assert_unchanged, snapshot, tiny
from kvlab.compat import CONVERSION_FORMAT, META_FORWARD, TRANSFORMERS, rope_parameters, set_rope
from kvlab.models import layout
from kvlab.models.tiny import _COMMON as COMMON
from kvlab.models.tiny import TINY_CONFIGS, TINY_SEED, VOCAB_SIZE, byte_tokenizer

ROOT = Path(__file__).resolve().parents[2]
TEXTS = ["The keeper logged every ship in a blue ledger.", " His daughter moved it to Bergen."]
STRATEGIES = [("naive", {}), ("rerotate", {}), ("reprefill", {}), ("recompute", {"ratio": 0.3})]


def save(model: torch.nn.Module, tokenizer, folder: Path) -> Path:
    # save_pretrained draws a progress bar per shard; keep it out of the test log.
    with contextlib.redirect_stderr(io.StringIO()):
        model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, Path]:
    """Every tiny catalogue model saved with save_pretrained, by name."""
    root = tmp_path_factory.mktemp("own")
    return {name: save(tiny(name).model, tiny(name).tokenizer, root / name) for name in TINY_HERE}


def merges(model: kvlab.LoadedModel) -> dict:
    frags = [kvlab.prefill(model, t, bos=(i == 0)) for i, t in enumerate(TEXTS)]
    out = {}
    for name, opts in STRATEGIES:
        try:
            out[name] = kvlab.merge(frags, name, model, **opts)
        except kvlab.UnsupportedRopeError as e:
            out[name] = f"refused: {e}"
    return out


def same_cache(a, b) -> bool:
    return a.get_seq_length() == b.get_seq_length() and all(
        torch.equal(x.keys, y.keys) and torch.equal(x.values, y.values) for x, y in zip(a.layers, b.layers)
    )


@pytest.mark.parametrize("name", sorted(TINY_HERE))
def test_folder_by_path_merges_bit_for_bit_like_the_catalogue_model(name, saved):
    by_name, by_path = tiny(name), kvlab.load_model(saved[name])
    assert by_path.name == name and by_path.source["kind"] == "folder"
    assert type(by_path.model) is type(by_name.model)
    a, b = merges(by_name), merges(by_path)
    for strategy in a:
        if isinstance(a[strategy], str):
            # Refused schedules (dynamic NTK, longrope across its switch) are refused the same way by path.
            assert a[strategy] == b[strategy], strategy
        else:
            assert same_cache(a[strategy], b[strategy]), (name, strategy)
    assert any(not isinstance(c, str) for c in a.values())


def test_folder_is_read_in_place_and_its_files_name_the_source(saved, tmp_path):
    folder = saved["tiny-llama"]
    before = {p.name: (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.iterdir()}
    m = kvlab.load_model(str(folder))
    fp = kvlab.fingerprint(m)
    # Nothing written into (or copied out of) the user's folder, fingerprint caches included.
    assert {p.name: (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.iterdir()} == before
    assert fp["source"] == "folder:tiny-llama"
    assert set(m.source["files"]) >= {"config.json", "model.safetensors", "tokenizer.json"}
    assert fp["source_sha256"] == kvlab.models.sources.folder_digest(folder)[0]
    # Another checkpoint with the same folder name: one weight changed.
    other = tiny("tiny-llama").model
    twin = tf.AutoModelForCausalLM.from_config(other.config)
    twin.load_state_dict(other.state_dict())
    with torch.no_grad():
        twin.model.layers[0].self_attn.k_proj.weight[0, 0] += 1e-3
    save(twin, tiny("tiny-llama").tokenizer, tmp_path / "tiny-llama")
    m2 = kvlab.load_model(tmp_path / "tiny-llama")
    assert m2.name == m.name
    fp2 = kvlab.fingerprint(m2)
    assert fp2["source"] == fp["source"] and fp2["source_sha256"] != fp["source_sha256"]
    path = tmp_path / "frag.kvc"
    kvlab.save_cache(path, kvlab.prefill(m, TEXTS[0]), m)
    with pytest.raises(kvlab.FingerprintMismatch) as e:
        kvlab.load_cache(path, m2)
    assert {d.field for d in e.value.differences} == {"source_sha256", "weights_sha256"}
    assert kvlab.load_cache(path, kvlab.load_model(folder)).length == kvlab.prefill(m, TEXTS[0]).length


def test_smollm2_through_its_gguf_path_has_the_same_fingerprint(smollm2):
    from kvlab.models.gguf import GGUF_MODELS

    spec = GGUF_MODELS["smollm2-135m"]
    gguf = spec.locate(spec)
    by_path = kvlab.load_model(str(gguf))
    # The same bytes as the catalogue's file: the same conversion folder, nothing converted again.
    assert by_path.source["folder"] == smollm2.source["folder"]
    assert by_path.name == "smollm2-135m"
    assert kvlab.fingerprint(by_path) == kvlab.fingerprint(smollm2)


@pytest.mark.real
def test_gguf_quantization_is_read_from_the_file_header():
    from kvlab.models.gguf import GGUF_MODELS, gguf_quantization

    spec = GGUF_MODELS["smollm2-135m"]
    assert gguf_quantization(spec.locate(spec)) == spec.quantization == "Q4_1"


def test_wrapped_live_model():
    base = tiny("tiny-qwen2")
    live = kvlab.wrap(base.model, base.tokenizer, name="my-qwen")
    assert live.name == "my-qwen" and live.model is base.model and live.source["kind"] == "live"
    fp = kvlab.fingerprint(live)
    assert fp["source"] == "live:my-qwen"
    assert fp["weights_sha256"] == kvlab.fingerprint(base)["weights_sha256"]
    a, b = merges(base), merges(live)
    assert all(same_cache(a[s], b[s]) for s in a)
    assert kvlab.wrap(base.model, base.tokenizer).name == "Qwen2ForCausalLM"


def test_wrap_refuses_a_model_without_a_next_token_head():
    with pytest.raises(kvlab.UnsupportedModelError, match="is a LlamaModel, not a causal LM"):
        kvlab.wrap(tiny("tiny-llama").model.model, tiny("tiny-llama").tokenizer)


def test_wrap_refuses_a_model_in_training_mode_without_changing_it():
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(TINY_CONFIGS["tiny-llama"][1]())
    model.train()
    with pytest.raises(kvlab.ModelError, match="training mode.*model.eval"):
        kvlab.wrap(model, byte_tokenizer())
    assert model.training


# --------------------------------------------------------------------------- refusals


def gpt2() -> tf.PreTrainedModel:
    torch.manual_seed(TINY_SEED)
    return tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=VOCAB_SIZE, n_positions=128, n_embd=32, n_layer=2, n_head=2))


def test_gpt2_is_refused_with_the_reason(tmp_path):
    folder = save(gpt2(), byte_tokenizer(), tmp_path / "gpt2")
    with pytest.raises(kvlab.UnsupportedModelError) as e:
        kvlab.load_model(folder)
    msg = str(e.value)
    assert "no rotary embedding" in msg and "learned absolute position" in msg
    assert "naive merge is wrong there too" in msg and "no re-rotation can fix it" in msg
    with pytest.raises(kvlab.UnsupportedModelError, match="learned absolute position"):
        kvlab.wrap(gpt2().eval(), byte_tokenizer())


def test_refusals_come_before_the_weights_are_read(tmp_path, monkeypatch):
    folder = save(gpt2(), byte_tokenizer(), tmp_path / "gpt2")

    def forbidden(*a, **k):
        raise AssertionError("weights were read before the model was refused")

    monkeypatch.setattr(tf.AutoModelForCausalLM, "from_pretrained", forbidden)
    with pytest.raises(kvlab.UnsupportedModelError):
        kvlab.load_model(folder)


def test_encoder_only_model_is_refused(tmp_path):
    torch.manual_seed(TINY_SEED)
    bert = tf.BertForMaskedLM(
        tf.BertConfig(
            vocab_size=VOCAB_SIZE, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64
        )
    )
    folder = save(bert, byte_tokenizer(), tmp_path / "bert")
    with pytest.raises(kvlab.UnsupportedModelError, match="encoder-only model.*bert.*no causal KV cache"):
        kvlab.load_model(folder)


def test_encoder_decoder_model_is_refused(tmp_path):
    tf.T5Config(vocab_size=VOCAB_SIZE, d_model=32, d_ff=64, num_layers=1, num_heads=2).save_pretrained(tmp_path)
    with pytest.raises(kvlab.UnsupportedModelError, match="encoder-decoder model \\(t5\\)"):
        kvlab.load_model(tmp_path)


def test_folder_that_is_not_a_causal_lm_is_refused(tmp_path):
    tf.ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64).save_pretrained(
        tmp_path / "vit"
    )
    with pytest.raises(kvlab.UnsupportedModelError, match="not a causal language model.*'vit'"):
        kvlab.load_model(tmp_path / "vit")
    # A Llama checkpoint with a classification head: loading it as a causal LM would invent a head.
    torch.manual_seed(TINY_SEED)
    cls = tf.LlamaForSequenceClassification(TINY_CONFIGS["tiny-llama"][1]())
    folder = save(cls, byte_tokenizer(), tmp_path / "classifier")
    with pytest.raises(kvlab.UnsupportedModelError, match="LlamaForSequenceClassification, not a causal LM head"):
        kvlab.load_model(folder)
    (tmp_path / "empty").mkdir()
    with pytest.raises(kvlab.ModelError, match="not a Hugging Face model folder: it has no config.json"):
        kvlab.load_model(tmp_path / "empty")
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(kvlab.ModelError, match="not a .gguf"):
        kvlab.load_model(tmp_path / "notes.txt")


def test_missing_path_and_unknown_name(tmp_path):
    with pytest.raises(kvlab.ModelError, match="no such model folder or GGUF file: .*nowhere"):
        kvlab.load_model(tmp_path / "nowhere")
    with pytest.raises(kvlab.ModelError, match="no such model folder or GGUF file"):
        kvlab.load_model("~/models/no-such-model-kvlab")
    with pytest.raises(kvlab.ModelError, match="unknown model 'nope'.*or give a path"):
        kvlab.load_model("nope")


def test_rope_kvlab_cannot_read_is_refused_at_load(tmp_path):
    config = TINY_CONFIGS["tiny-qwen2"][1]()
    set_rope(config, dict(rope_parameters(config), mrope_section=[2, 3, 3]))
    config.save_pretrained(tmp_path)
    with pytest.raises(kvlab.UnsupportedModelError, match="mrope_section.*M-RoPE.*1-D positions"):
        kvlab.load_model(tmp_path)
    from kvlab.models.rope import rope_problem

    assert "not one kvlab knows" in rope_problem({"rope_type": "made-up"})
    assert rope_problem({"rope_type": "dynamic"}) is None  # loads; re-rotation refused per merge (below)


def test_rope_that_does_not_compose_is_refused_before_any_merge_work(saved):
    m = kvlab.load_model(saved["tiny-dynamic"])
    frags = [kvlab.prefill(m, t, bos=(i == 0)) for i, t in enumerate(TEXTS)]
    snap = snapshot(frags)
    for name in ("rerotate", "recompute"):
        with pytest.raises(kvlab.UnsupportedRopeError, match="'dynamic'.*re-prefill instead"):
            kvlab.merge(frags, name, m)
    assert_unchanged(frags, snap)
    # What does not re-rotate still works: the defect and the exact fix.
    assert kvlab.merge(frags, "reprefill", m).get_seq_length() == sum(f.length for f in frags)


# --------------------------------------------------------------------------- devices and dtypes


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gemma3", "tiny-phi"])
def test_whole_merge_path_runs_on_the_meta_device(name, saved):
    # No tensor may be made on the CPU behind the cache's back: on "meta" any such mix raises.
    if not META_FORWARD:
        with pytest.raises(
            kvlab.UnsupportedModelError, match=f"meta device cannot run a forward in transformers {TRANSFORMERS}"
        ):
            kvlab.load_model(saved[name], device="meta")
        return
    m = kvlab.load_model(saved[name], device="meta")
    assert m.device.type == "meta"
    frags = [kvlab.prefill(m, t, bos=(i == 0)) for i, t in enumerate(TEXTS)]
    total = sum(f.length for f in frags)
    # ``deviation`` ranks tokens by value, which a meta tensor has not; the other policies choose by position.
    for strategy, opts in [
        ("naive", {}),
        ("rerotate", {}),
        ("reprefill", {}),
        ("recompute", {"policy": "fragment_start", "ratio": 0.3}),
        ("recompute", {"policy": "random", "ratio": 0.5}),
    ]:
        cache = kvlab.merge(frags, strategy, m, **opts)
        assert cache.get_seq_length() == total
        for layer, ref in zip(cache.layers, frags[0].cache.layers):
            assert layer.keys.device.type == "meta" and layer.keys.dtype == ref.keys.dtype


def test_bf16_keys_are_rotated_in_fp32_and_rounded_once(saved):
    m = kvlab.load_model(saved["tiny-llama"], dtype=torch.bfloat16)
    assert m.dtype == torch.bfloat16
    frags = [kvlab.prefill(m, t, bos=(i == 0)) for i, t in enumerate(TEXTS)]
    merged = kvlab.merge(frags, "rerotate", m)
    rope = kvlab.layer_ropes(m.model)
    n0 = frags[0].length
    for li, layer in enumerate(merged.layers):
        assert layer.keys.dtype == torch.bfloat16
        k = frags[1].cache.layers[li].keys
        want = kvlab.rotate_keys(k.float(), rope[li].inv_freq, n0).to(torch.bfloat16)
        assert torch.equal(layer.keys[..., n0:, :], want)
    # The rest of the path in bf16: recompute, references, downstream KL.
    rec = kvlab.merge(frags, "recompute", m, ratio=0.3)
    fid = kvlab.fidelity(m, frags, rec, probes=[" and"], greedy_tokens=2)
    assert rec.layers[0].keys.dtype == torch.bfloat16 and fid.kl_mean >= 0


def test_device_argument_moves_catalogue_models_too():
    if not META_FORWARD:
        with pytest.raises(kvlab.UnsupportedModelError, match="meta device"):
            kvlab.load_model("tiny-llama", device="meta")
        return
    m = kvlab.load_model("tiny-llama", device="meta")
    assert m.device.type == "meta" and tiny("tiny-llama").device.type == "cpu"


# --------------------------------------------------------------------------- command line and notebooks


def run_cli(*args) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run(
        [sys.executable, "-m", "kvlab.cli", *args], capture_output=True, text=True, env=env, cwd=ROOT, timeout=600
    )


def test_cli_check_and_inspect_take_a_folder(saved, tmp_path):
    folder = saved["tiny-llama"]
    run = run_cli("check", "--model", str(folder), "--json")
    assert run.returncode == 0, run.stderr[-2000:]
    rows = {r["strategy"]: r for r in json.loads(run.stdout)}
    assert rows["rerotate"]["max_k_phase"] < 1e-4 < rows["naive"]["max_k_phase"]
    m = kvlab.load_model(folder)
    path = tmp_path / "frag.kvc"
    kvlab.save_cache(path, kvlab.prefill(m, TEXTS[0]), m)
    run = run_cli("inspect", str(path), "--model", str(folder))
    assert run.returncode == 0, run.stderr[-2000:]
    assert "folder:tiny-llama" in run.stdout and "loads into tiny-llama: yes" in run.stdout
    run = run_cli("inspect", str(path), "--model", str(saved["tiny-qwen2"]))
    assert (
        run.returncode == 2 and "FingerprintMismatch" in run.stderr and "source: file folder:tiny-llama" in run.stderr
    )


@pytest.mark.lab
def test_report_resolves_a_relative_model_path_for_the_notebooks(saved, monkeypatch):
    from kvlab.lab.report import plan

    folder = saved["tiny-llama"]
    monkeypatch.chdir(folder.parent)
    jobs = plan(["01_phase_error"], {}, f"./{folder.name}")
    assert jobs[0][2]["model_name"] == str(folder.resolve())


@pytest.mark.lab
def test_notebook_takes_a_folder_as_model_name(saved, tmp_path):
    import papermill as pm

    from kvlab.lab.report import NOTEBOOK_DIR, finding

    out = tmp_path / "01.ipynb"
    params = {
        "model_name": str(saved["tiny-gemma3"]),
        "n_fragments": 3,
        "texts": ["Alpha speaks of rivers.", " Beta follows with birds,", " gamma brings rain."],
    }
    pm.execute_notebook(
        str(NOTEBOOK_DIR / "01_phase_error.ipynb"),
        str(out),
        parameters=params,
        progress_bar=False,
        cwd=str(NOTEBOOK_DIR),
        kernel_name="kvlab",
    )
    assert "model tiny-gemma3: 4 layers" in out.read_text()
    assert "tiny-gemma3" in finding(out)


@pytest.mark.parametrize(
    "family, config, declare",
    [
        (
            "interleaved rotary pairs (Cohere) read as rotate_half",
            lambda: tf.CohereConfig(**dict(COMMON, num_key_value_heads=2)),
            lambda mp: mp.setattr(layout, "INTERLEAVED", layout.INTERLEAVED - {"cohere"}),
        ),
        (
            "layers without rope (SmolLM3 NoPE) read as rotary",
            lambda: tf.SmolLM3Config(**dict(COMMON, num_key_value_heads=2, num_hidden_layers=4)),
            lambda mp: mp.setattr(layout, "nope_layers", lambda c: [False] * c.num_hidden_layers),
        ),
    ],
)
def test_model_rotating_keys_another_way_is_refused_by_the_rotation_self_test(family, config, declare, tmp_path):
    # Both families load as kvlab reads them (tests/models/test_architectures.py); read another
    # way, the self-test refuses them before any merge.
    torch.manual_seed(TINY_SEED)
    model = tf.AutoModelForCausalLM.from_config(config()).eval()
    folder = save(model, byte_tokenizer(), tmp_path / "m")
    assert kvlab.load_model(folder).name == "m"
    declare_wrong = pytest.MonkeyPatch()
    declare(declare_wrong)
    try:
        with pytest.raises(kvlab.UnsupportedModelError, match="is not its cache at position 0"):
            kvlab.load_model(folder)
        with pytest.raises(kvlab.UnsupportedModelError, match="would be silently wrong"):
            kvlab.wrap(model, byte_tokenizer())
    finally:
        declare_wrong.undo()


def test_rotation_self_test_passes_every_tiny_architecture():
    from kvlab.models.checks import check_rotation

    for name in TINY_HERE:
        assert check_rotation(tiny(name)) < 1e-5, name


@pytest.mark.lab
def test_explorer_takes_a_folder_path(saved):
    from kvlab.lab.explorer import MergeExplorer

    texts, probes = ["First fragment here.", " And the second one."], [" and"]
    ex = MergeExplorer(str(saved["tiny-gemma3"]), texts=texts, probes=probes)
    assert ex.state["model"] == "tiny-gemma3" and ex.state["max_phase_error"] > 0.1
    ex.strategy.value = "rerotate"
    assert ex.state["max_phase_error"] < 1e-3


@pytest.mark.real
def test_another_gguf_file_is_converted_under_its_own_sha256(tmp_path, monkeypatch):
    """A GGUF that is not the catalogue's file (here SmolLM2's with one header byte changed) gets its own name,
    sha256 and quantization; the conversion itself is the catalogue's (checked above), so it is not rerun here."""
    from kvlab.models import sources
    from kvlab.models.gguf import GGUF_MODELS
    from kvlab.models.gguf import sha256_file as _sha256_file

    spec = GGUF_MODELS["smollm2-135m"]
    monkeypatch.setenv("KVLAB_CACHE", str(tmp_path / "cache"))  # the copy's sha256 stays out of the shared index
    gguf = tmp_path / "my-smollm2.gguf"
    data = bytearray(spec.locate(spec).read_bytes())
    at = data.index(b"Smollm2 135M")
    data[at] = ord("s")  # general.name: same length, so the file stays valid
    gguf.write_bytes(bytes(data))
    seen = {}
    monkeypatch.setattr(sources, "load_gguf", lambda s, dtype: seen.setdefault("spec", s))
    sources.load_gguf_file(gguf, torch.float32)
    got = seen["spec"]
    assert (got.name, got.filename, got.quantization, got.package) == ("my-smollm2", "my-smollm2.gguf", "Q4_1", "")
    assert got.locate(got) == gguf.resolve()
    assert sources._catalogue_spec(spec.locate(spec), _sha256_file(spec.locate(spec))) is spec
    # Once converted, a load reads neither the GGUF header nor its config again.
    done = tmp_path / "cache" / "models" / f"my-smollm2-{_sha256_file(gguf)[:16]}-{CONVERSION_FORMAT}"
    done.mkdir(parents=True)
    (done / "kvlab-source.json").write_text("{}")
    monkeypatch.setattr(sources, "gguf_quantization", None)  # any call fails
    assert sources.load_gguf_file(gguf, torch.float32).name == "my-smollm2"
