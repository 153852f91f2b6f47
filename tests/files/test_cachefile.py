"""kvlab.save_cache / kvlab.load_cache: exact round trips, atomic saves, and a corpus of bad files."""

from __future__ import annotations

import copy
import json
import os
import re
import struct
import subprocess
import sys
import textwrap
import warnings
import zipfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import save_file

import kvlab
from kvlab.cache.fragments import new_cache
from kvlab.cache.repro import assigned_merge
from kvlab.compat import ASSIGNED_LAYERS_READ_EMPTY, forward
from kvlab.errors import CacheFileError, CacheFileWarning, FingerprintMismatch, KvlabError
from kvlab.files import io as cf
from kvlab.files.format import read_header, verify_file
from kvlab.files.identity import STRICT_FIELDS, fingerprint
from kvlab.files.io import load_cache, save_cache
from kvlab.measure.mismatch import finetune_text
from kvlab.measure.references import next_token_dist

REPO = Path(__file__).resolve().parents[2]
TEXT = "The quick brown fox jumps over the lazy dog, twice."


@pytest.fixture(scope="module")
def llama():
    return kvlab.load_model("tiny-llama")


@pytest.fixture(scope="module")
def gemma():
    return kvlab.load_model("tiny-gemma3")


@pytest.fixture(scope="module")
def frag(llama):
    return kvlab.prefill(llama, TEXT)


@pytest.fixture()
def saved(tmp_path, llama, frag) -> Path:
    return save_cache(tmp_path / "c.kvcache", frag, llama)


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as integers, so -0.0 and NaN payloads compare exactly too."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def assert_same_cache(a, b):
    assert len(a.layers) == len(b.layers)
    for i, (x, y) in enumerate(zip(a.layers, b.layers)):
        assert type(x) is type(y), i
        assert x.keys.dtype == y.keys.dtype and x.keys.shape == y.keys.shape, i
        assert torch.equal(bits(x.keys), bits(y.keys)) and torch.equal(bits(x.values), bits(y.values)), i
        assert x.get_seq_length() == y.get_seq_length(), i


def silent_load(path, model, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return load_cache(path, model, **kw)


# --------------------------------------------------------------------------- round trips


def test_round_trip_is_bit_exact_and_silent(saved, llama, frag):
    back = silent_load(saved, llama)
    assert_same_cache(frag.cache, back.cache)
    assert back.start == 0 and back.text == TEXT and torch.equal(back.token_ids, frag.token_ids)
    assert back.model_name == llama.name and back.length == frag.length


def test_round_trip_of_sliding_layers_keeps_window_and_length(tmp_path, gemma):
    frag = kvlab.prefill(gemma, "long enough for the window of eight to slide well past its start")
    assert frag.cache.layers[0].keys.shape[2] == 7 and frag.length > 7
    back = silent_load(save_cache(tmp_path / "g.kvcache", frag, gemma), gemma)
    assert_same_cache(frag.cache, back.cache)
    assert [layer.cumulative_length for layer in back.cache.layers if layer.is_sliding] == [frag.length] * 3


def test_round_trip_of_a_short_sliding_cache(tmp_path, gemma):
    frag = kvlab.prefill(gemma, "abc")  # shorter than the window: sliding layers keep everything
    assert_same_cache(frag.cache, silent_load(save_cache(tmp_path / "s.kvcache", frag, gemma), gemma).cache)


def test_round_trip_bf16_and_start(tmp_path):
    model = kvlab.load_model("tiny-qwen2", dtype=torch.bfloat16)
    frag = kvlab.prefill(model, TEXT, start=17)
    back = silent_load(save_cache(tmp_path / "b.kvcache", frag, model), model)
    assert back.start == 17 and back.cache.layers[0].keys.dtype == torch.bfloat16
    assert_same_cache(frag.cache, back.cache)


def test_bare_dynamic_cache_and_merged_cache(tmp_path, llama, frag):
    other = kvlab.prefill(llama, " And then it ran away.")
    merged = kvlab.merge([frag, other], "rerotate", llama)
    back = silent_load(save_cache(tmp_path / "m.kvcache", merged, llama), llama)
    assert back.text is None and back.token_ids is None and back.start == 0
    assert_same_cache(merged, back.cache)


def test_loaded_fragments_merge_and_continue_exactly(tmp_path, gemma):
    a = kvlab.prefill(gemma, "The first fragment is here. ")
    b = kvlab.prefill(gemma, "And the second one follows it.")
    la = silent_load(save_cache(tmp_path / "a.kvcache", a, gemma), gemma)
    lb = silent_load(save_cache(tmp_path / "b.kvcache", b, gemma), gemma)
    merged_orig = kvlab.merge([a, b], "rerotate", gemma)
    merged_back = kvlab.merge([la, lb], "rerotate", gemma)
    assert_same_cache(merged_orig, merged_back)
    assert torch.equal(next_token_dist(gemma, merged_orig, " Next"), next_token_dist(gemma, merged_back, " Next"))
    assert torch.equal(
        kvlab.merge([la, lb], "reprefill", gemma).layers[3].keys, kvlab.merge([a, b], "reprefill", gemma).layers[3].keys
    )


def test_loaded_cache_is_not_aliased_by_the_next_forward(saved, llama, frag):
    # Two loads of one file must not share storage (with each other, a memory map of the file,
    # or the fragment that was saved): a forward grows the cache it is given, and an in-place
    # edit of one copy must reach no other.
    a, b = load_cache(saved, llama), load_cache(saved, llama)
    ids = kvlab.tokenize(llama, " more")[None]
    with torch.inference_mode():
        forward(
            llama.model,
            a.cache,
            input_ids=ids,
            position_ids=torch.arange(frag.length, frag.length + ids.shape[-1])[None],
            use_cache=True,
        )
        for layer in a.cache.layers:
            layer.keys.add_(1.0)
            layer.values.mul_(-1.0)
    assert a.cache.get_seq_length() == frag.length + ids.shape[-1]
    assert_same_cache(frag.cache, b.cache)
    assert_same_cache(frag.cache, load_cache(saved, llama).cache)


def test_file_is_plain_safetensors(saved, frag):
    with safe_open(str(saved), "pt") as f:
        assert set(f.metadata()) == {"kvlab", "kvlab_sha256"}
        assert torch.equal(f.get_tensor("layers.2.values"), frag.cache.layers[2].values)
    h = read_header(saved)
    assert (
        h["format_version"] == 2
        and h["tensor_digest"] == "xxh3-128"
        and h["producer"]["architecture"] == "LlamaForCausalLM"
    )
    assert h["token_ids"] == frag.token_ids.tolist() and h["text"] == TEXT
    assert len(h["tensors"]) == 2 * len(frag.cache.layers)


# --------------------------------------------------------------------------- saving


def test_save_replaces_atomically_and_leaves_no_temporary(tmp_path, llama, frag):
    path = tmp_path / "c.kvcache"
    save_cache(path, kvlab.prefill(llama, "old"), llama)
    save_cache(path, frag, llama)
    assert silent_load(path, llama).text == TEXT
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.kvcache"]


def test_failed_save_keeps_the_old_file(tmp_path, llama, frag, monkeypatch):
    path = save_cache(tmp_path / "c.kvcache", frag, llama)
    old = path.read_bytes()

    def boom(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(cf.os, "fsync", boom)
    with pytest.raises(CacheFileError, match="No space left"):
        save_cache(path, kvlab.prefill(llama, "new"), llama)
    assert path.read_bytes() == old
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.kvcache"]


KILL_CHILD = textwrap.dedent("""
    import os, signal, sys
    import kvlab
    from kvlab.files import io as cf
    point, path = sys.argv[1], sys.argv[2]
    model = kvlab.load_model("tiny-llama")
    frag = kvlab.prefill(model, "a new cache that must never half-replace the old one " * 4)
    target = {"data": cf, "fsync": cf.os, "rename": cf.os}[point]
    name = {"data": "content_digest", "fsync": "fsync", "rename": "replace"}[point]
    def die(*a, **k):
        os.kill(os.getpid(), signal.SIGKILL)
    setattr(target, name, die)
    cf.save_cache(path, frag, model)
""")


@pytest.mark.parametrize("point", ["data", "fsync", "rename"])
def test_a_save_killed_midway_leaves_the_old_file(tmp_path, llama, frag, point):
    path = save_cache(tmp_path / "c.kvcache", frag, llama)
    old = path.read_bytes()
    run = subprocess.run([sys.executable, "-c", KILL_CHILD, point, str(path)], capture_output=True, timeout=120)
    assert run.returncode == -9, run.stderr.decode()[-2000:]
    assert path.read_bytes() == old
    assert silent_load(path, llama).text == TEXT


def test_a_killed_saves_temporary_is_listed_by_inspect_and_removed_by_the_next_save(tmp_path, llama, frag, capsys):
    from kvlab import cli

    path = save_cache(tmp_path / "c.kvcache", frag, llama)
    run = subprocess.run([sys.executable, "-c", KILL_CHILD, "rename", str(path)], capture_output=True, timeout=120)
    assert run.returncode == -9, run.stderr.decode()[-2000:]
    (left,) = [p for p in tmp_path.iterdir() if p != path]
    # The safetensors library ran in a private folder under kvlab's temporary name; it holds the finished file.
    assert re.fullmatch(r"\.c\.kvcache\.\d+\.[0-9a-f]{8}\.tmp", left.name) and left.is_dir()
    assert [p.name for p in left.iterdir()] == ["c.kvcache"] and (left / "c.kvcache").stat().st_size > 0
    assert cli.main(["inspect", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "1 intact cache file(s), 0 with a problem, 1 temporary file(s) left by saves that died" in out
    assert left.name in out and f"a save of c.kvcache by process {left.name.split('.')[3]}, now gone" in out
    assert cli.main(["inspect", str(path)]) == 0
    assert f"left over  1 temporary file(s) of a save that died: {left.name} (" in capsys.readouterr().out
    save_cache(path, frag, llama)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.kvcache"]
    assert cli.main(["inspect", str(tmp_path)]) == 0
    assert "0 temporary file(s)" in capsys.readouterr().out


def test_inspect_of_a_folder_lists_every_cache_file_and_what_is_wrong(tmp_path, llama, gemma, frag, capsys):
    from kvlab import cli

    save_cache(tmp_path / "a.kvcache", frag, llama)
    save_cache(tmp_path / "g.kvcache", kvlab.prefill(gemma, "another model"), gemma)
    (tmp_path / "cut.kvcache").write_bytes((tmp_path / "a.kvcache").read_bytes()[:100])
    (tmp_path / "notes.txt").write_text("not a cache, and not named like one")
    assert cli.main(["inspect", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert out.startswith(f"{tmp_path}: 2 intact cache file(s), 1 with a problem, 0 temporary file(s)")
    assert "1 other file(s)" in out and "notes.txt" not in out
    assert re.search(r"a\.kvcache +\d+\.\d kB  tiny-llama, \d+ tokens at 0, 3 layers, float32: intact", out)
    assert re.search(r"cut\.kvcache .* CacheFileError: the header length field says \d+ bytes, past the end", out)
    assert cli.main(["inspect", str(tmp_path), "--model", "tiny-llama"]) == 1
    out = capsys.readouterr().out
    assert "intact, loads into tiny-llama" in out and "g.kvcache" in out and "FingerprintMismatch: " in out
    (tmp_path / "cut.kvcache").unlink()
    (tmp_path / "g.kvcache").unlink()
    assert cli.main(["inspect", str(tmp_path)]) == 0


def test_save_refuses_what_it_cannot_vouch_for(tmp_path, llama, gemma, frag):
    with pytest.raises(FingerprintMismatch, match="made by 'tiny-llama' but save_cache was given 'tiny-gemma3'"):
        save_cache(tmp_path / "x", frag, gemma)
    with pytest.raises(CacheFileError, match="empty cache"):
        save_cache(tmp_path / "x", new_cache(llama.config), llama)
    with pytest.raises(CacheFileError, match="directory"):
        save_cache(tmp_path, frag, llama)
    with pytest.raises(CacheFileError, match="Fragment or a transformers DynamicCache"):
        save_cache(tmp_path / "x", {"not": "a cache"}, llama)
    with pytest.raises(FingerprintMismatch, match="layers"):
        save_cache(tmp_path / "x", kvlab.prefill(gemma, "abc").cache, llama)
    if ASSIGNED_LAYERS_READ_EMPTY:
        with pytest.raises(CacheFileError, match="never initialized"):
            save_cache(tmp_path / "x", assigned_merge([frag, kvlab.prefill(llama, "more")]), llama)
    assert not (tmp_path / "x").exists()


# --------------------------------------------------------------------------- fingerprints


def write_with(path: Path, frag, model, edit=None, tensors_edit=None):
    """Write a cache file as save_cache would, after ``edit(header)`` / ``tensors_edit(list)``."""
    producer = fingerprint(model)
    header, tensors = cf._describe(frag, producer)
    if edit:
        edit(header)
    if tensors_edit:
        tensors = tensors_edit(tensors)
    cf._write_file(path, tensors, header)
    return path


STRICT_CHANGES = [f for f in STRICT_FIELDS if f != "geometry"] + ["geometry.rope", "geometry.kv_heads"]


@pytest.mark.parametrize("field", STRICT_CHANGES)
def test_each_strict_field_changed_alone_refuses_the_file(tmp_path, llama, frag, field):
    def edit(h):
        if field.startswith("geometry."):
            h["producer"]["geometry"][field.split(".")[1]] = "another value"
        else:
            h["producer"][field] = "another value"

    path = write_with(tmp_path / "c.kvcache", frag, llama, edit)
    with pytest.raises(FingerprintMismatch) as e:
        load_cache(path, llama)
    assert [d.field for d in e.value.differences] == [field]
    assert f"{field}: file another value, model " in str(e.value)
    with pytest.warns(CacheFileWarning, match=re.escape(f"{field}: file another value, model ")):
        back = load_cache(path, llama, strict=False)
    assert_same_cache(frag.cache, back.cache)


def test_dtype_mismatch_names_both_dtypes_and_casts_when_not_strict(tmp_path, llama, frag):
    path = save_cache(tmp_path / "c.kvcache", frag, llama)
    reader = kvlab.load_model("tiny-llama", dtype=torch.bfloat16)
    with pytest.raises(FingerprintMismatch, match="dtype: file float32, model bfloat16"):
        load_cache(path, reader)
    with pytest.warns(CacheFileWarning, match="cast to bfloat16"):
        back = load_cache(path, reader, strict=False)
    assert back.cache.layers[0].keys.dtype == torch.bfloat16
    assert torch.equal(back.cache.layers[0].keys, frag.cache.layers[0].keys.to(torch.bfloat16))


def test_another_architecture_is_a_named_mismatch_not_a_torch_error(tmp_path, llama, gemma, frag):
    path = save_cache(tmp_path / "c.kvcache", frag, llama)
    with pytest.raises(FingerprintMismatch) as e:
        load_cache(path, gemma)
    msg = str(e.value)
    assert "architecture: file LlamaForCausalLM, model Gemma3ForCausalLM" in msg
    assert "geometry.num_layers: file 3, model 4" in msg and "geometry.layer_types" in msg
    with pytest.raises(FingerprintMismatch, match="cannot serve as a cache of tiny-gemma3, even with strict=False"):
        load_cache(path, gemma, strict=False)


def test_same_layer_count_other_heads_is_refused_even_when_not_strict(tmp_path, llama, frag):
    gptneox = kvlab.load_model("tiny-gptneox")  # 3 layers, 4 KV heads instead of 2
    path = save_cache(tmp_path / "c.kvcache", frag, llama)
    with pytest.raises(
        FingerprintMismatch, match=r"layer 0 keys are \[1, 2, \d+, 16\] in the file, tiny-gptneox needs \[1, 4"
    ):
        load_cache(path, gptneox, strict=False)


def test_no_fingerprint_needs_allow_unverified(tmp_path, llama, frag):
    path = write_with(tmp_path / "c.kvcache", frag, llama, lambda h: h.update(producer=None))
    with pytest.raises(FingerprintMismatch, match="no producer fingerprint"):
        load_cache(path, llama)
    with pytest.warns(CacheFileWarning, match="no producer fingerprint"):
        back = load_cache(path, llama, allow_unverified=True)
    assert_same_cache(frag.cache, back.cache)


def test_plain_safetensors_dump_needs_allow_unverified(tmp_path, gemma):
    frag = kvlab.prefill(gemma, "a plain dump of a cache without kvlab's header")
    tensors = {}
    for i, layer in enumerate(frag.cache.layers):
        tensors[f"layers.{i}.keys"] = layer.keys.contiguous()
        tensors[f"layers.{i}.values"] = layer.values.contiguous()
    path = tmp_path / "plain.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt"})
    with pytest.raises(FingerprintMismatch, match="no producer fingerprint"):
        load_cache(path, gemma)
    with pytest.warns(CacheFileWarning, match="no kvlab header"):
        back = load_cache(path, gemma, allow_unverified=True)
    assert_same_cache(frag.cache, back.cache)


# --------------------------------------------------------------------------- bad files


def corrupt(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def header_end(data: bytes) -> int:
    return 8 + struct.unpack("<Q", data[:8])[0]


def test_truncated_at_ten_offsets(saved, llama, tmp_path):
    data = saved.read_bytes()
    end = header_end(data)
    offsets = [0, 1, 7, 8, 9, end // 2, end - 1, end, end + 1 + (len(data) - end) // 2, len(data) - 1]
    expect = [
        "empty",
        "shorter than the 8-byte",
        "shorter than the 8-byte",
        "past the end",
        "past the end",
        "past the end",
        "past the end",
        "truncated",
        "truncated",
        "truncated",
    ]
    for at, why in zip(offsets, expect):
        p = corrupt(tmp_path / f"t{at}.kvcache", data[:at])
        with pytest.raises(CacheFileError, match=why):
            load_cache(p, llama)


def test_every_flipped_header_byte_is_caught(saved, llama, tmp_path):
    data = saved.read_bytes()
    p = tmp_path / "f.kvcache"
    messages = set()
    for at in range(header_end(data)):
        for mask in (0xFF, 0x01) if at % 5 == 0 else (0xFF,):
            bad = bytearray(data)
            bad[at] ^= mask
            with pytest.raises(CacheFileError) as e:
                load_cache(corrupt(p, bytes(bad)), llama)
            messages.add(re.sub(r"\d+", "N", str(e.value).split(": ", 1)[1])[:50])
    assert len(messages) > 5  # specific messages, not one catch-all


def test_flipped_bytes_in_tensor_data_name_the_tensor(saved, llama, tmp_path):
    data = saved.read_bytes()
    end = header_end(data)
    entries = json.loads(data[8:end])
    for name in ("layers.0.keys", "layers.1.values", "layers.2.values"):
        a, b = entries[name]["data_offsets"]
        for at in (a, (a + b) // 2, b - 1):
            bad = bytearray(data)
            bad[end + at] ^= 0x01
            with pytest.raises(CacheFileError, match=rf"data of {re.escape(name)} does not match its xxh3-128 digest"):
                load_cache(corrupt(tmp_path / "d.kvcache", bytes(bad)), llama)


def test_wrong_format_version(tmp_path, llama, frag):
    for version, why in (
        (3, "format version 3 is not supported \\(written by a newer kvlab\\)"),
        (1, "format version 1 is not supported; this kvlab reads version 2"),
        (0, "format version 0 is not supported"),
        ("2", "format version '2' is not supported"),
    ):
        path = write_with(
            tmp_path / "v.kvcache", frag, llama, lambda h, version=version: h.update(format_version=version)
        )
        with pytest.raises(CacheFileError, match=why):
            load_cache(path, llama)


def test_verify_file_checks_every_tensor_without_a_model(saved, tmp_path):
    assert verify_file(saved) == read_header(saved)
    data = bytearray(saved.read_bytes())
    end = header_end(bytes(data))
    a, b = json.loads(data[8:end])["layers.1.values"]["data_offsets"]
    data[end + (a + b) // 2] ^= 0x40
    with pytest.raises(CacheFileError, match=r"data of layers\.1\.values does not match its xxh3-128 digest"):
        verify_file(corrupt(tmp_path / "v.kvcache", bytes(data)))


def test_unknown_tensor_digest_algorithm(tmp_path, llama, frag):
    path = write_with(tmp_path / "a.kvcache", frag, llama, lambda h: h.update(tensor_digest="sha256"))
    with pytest.raises(CacheFileError, match="tensor_digest 'sha256' is not supported; this kvlab reads 'xxh3-128'"):
        load_cache(path, llama)


def test_digests_are_of_the_tensor_bytes(saved, frag):
    # Independent of kvlab's own helper: XXH3-128 of each tensor's raw bytes, as any reader computes it.
    import xxhash

    # The algorithm is part of the format: pin it to the reference vector (XXH3-128 of no bytes, seed 0).
    assert xxhash.xxh3_128_hexdigest(b"") == "99aa06d3014798d86001c324468d497f"
    h = read_header(saved)
    for i, layer in enumerate(frag.cache.layers):
        raw = layer.keys.contiguous().numpy().tobytes()
        assert h["tensors"][f"layers.{i}.keys"] == xxhash.xxh3_128_hexdigest(raw)


def test_header_length_past_the_end(saved, llama, tmp_path):
    data = saved.read_bytes()
    for n in (len(data), len(data) * 1000, 2**64 - 1):
        with pytest.raises(CacheFileError, match="past the end of the file"):
            load_cache(corrupt(tmp_path / "h.kvcache", struct.pack("<Q", n) + data[8:]), llama)


def test_missing_tensor(tmp_path, llama, frag, saved):
    path = write_with(tmp_path / "m.kvcache", frag, llama, tensors_edit=lambda ts: ts[:-1])
    with pytest.raises(CacheFileError, match="kvlab header: tensors must map exactly"):
        load_cache(path, llama)
    # The header still lists every tensor with its digest, as if one was cut out afterwards.
    _, tensors = cf._describe(frag, None)
    cf._write_file(tmp_path / "m2.kvcache", tensors[:-1], read_header(saved), fill_digests=False)
    with pytest.raises(CacheFileError, match=r"missing tensor\(s\) layers\.2\.values"):
        load_cache(tmp_path / "m2.kvcache", llama)


def test_extra_tensor(tmp_path, llama, frag, saved):
    _, tensors = cf._describe(frag, None)
    header = read_header(saved)
    cf._write_file(tmp_path / "e.kvcache", tensors + [("evil", torch.zeros(3))], header, fill_digests=False)
    with pytest.raises(CacheFileError, match="unexpected tensor\\(s\\) 'evil' not in the header"):
        load_cache(tmp_path / "e.kvcache", llama)


def test_shape_that_disagrees_with_the_header(tmp_path, llama, frag, saved):
    _, tensors = cf._describe(frag, None)
    header = read_header(saved)
    name, t = tensors[3]
    tensors[3] = (name, t.reshape(t.shape[0], t.shape[1], t.shape[3], t.shape[2]))
    cf._write_file(tmp_path / "s.kvcache", tensors, header, fill_digests=False)
    with pytest.raises(CacheFileError, match=r"tensor layers\.1\.values has shape \[1, 2, 16, \d+\] in the file but"):
        load_cache(tmp_path / "s.kvcache", llama)


def test_header_layer_shapes_must_agree_with_its_own_length(tmp_path, llama, frag):
    path = write_with(tmp_path / "k.kvcache", frag, llama, lambda h: h.update(length=h["length"] + 1))
    with pytest.raises(CacheFileError, match="layer 0 keeps"):
        load_cache(path, llama)


def test_empty_file_directory_and_missing_path(tmp_path, llama):
    with pytest.raises(CacheFileError, match=r"is empty \(0 bytes\)"):
        load_cache(corrupt(tmp_path / "empty.kvcache", b""), llama)
    with pytest.raises(CacheFileError, match="is a directory, not a cache file"):
        load_cache(tmp_path, llama)
    with pytest.raises(CacheFileError, match="no such file"):
        load_cache(tmp_path / "nothing-here", llama)


def _pickle_that_creates(path: Path) -> bytes:
    # Hand-assembled opcodes (the project never imports a pickle module): on unpickling,
    # this calls builtins.open(path, "w"), creating the file.
    b = str(path).encode()
    return b"\x80\x04cbuiltins\nopen\n(X" + struct.pack("<I", len(b)) + b + b"X\x01\x00\x00\x00wtR."


def test_a_pickle_is_refused_without_being_unpickled(tmp_path, llama):
    marker = tmp_path / "pwned"
    path = corrupt(tmp_path / "memos_dump.pickle", _pickle_that_creates(marker))
    with pytest.raises(CacheFileError, match=r"is a Python pickle \(protocol 4\).*never unpickles"):
        load_cache(path, llama)
    with pytest.raises(CacheFileError, match="Python pickle"):
        read_header(path)
    assert not marker.exists()


def test_a_torch_save_archive_is_refused_unopened(tmp_path, llama):
    marker = tmp_path / "pwned"
    path = tmp_path / "cache.pt"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("archive/data.pkl", _pickle_that_creates(marker))
        z.writestr("archive/version", "3\n")
    with pytest.raises(CacheFileError, match=r"torch\.save archive \(a zip holding archive/data\.pkl\)"):
        load_cache(path, llama)
    assert not marker.exists()


def test_a_protocol_0_pickle_gets_a_hint(tmp_path, llama):
    path = corrupt(tmp_path / "old.pickle", b"(dp0\nS'kv_cache_memories'\np1\n(dp2\ns.")
    with pytest.raises(CacheFileError, match="protocol 0/1 Python pickle"):
        load_cache(path, llama)


def test_a_safetensors_header_length_starting_with_0x80_is_not_a_pickle(tmp_path, llama, frag):
    # A header of 0x10280 bytes starts the file with 80 02: what a protocol-2 pickle starts with.
    header, tensors = cf._describe(frag, fingerprint(llama))
    header.update(text="", tensors={n: "0" * 32 for n, _ in tensors}, content_digest="0" * 32)
    probe = tmp_path / "probe.kvcache"
    cf._write_file(probe, tensors, header, fill_digests=False)  # same header length as with the real digests
    unpadded = len(probe.read_bytes()[8 : header_end(probe.read_bytes())].rstrip(b" "))
    target = next(t for t in (0x280, 0x380, 0x480, 0x580, 0x10280) if t >= unpadded)
    header["text"] = "y" * (target - unpadded)  # one byte per character, inner and outer JSON alike
    path = tmp_path / "p.kvcache"
    cf._write_file(path, tensors, header)
    assert path.read_bytes()[0] == 0x80 and 2 <= path.read_bytes()[1] <= 5
    assert silent_load(path, llama).text == header["text"]


def test_other_formats_are_named(tmp_path, llama):
    with pytest.raises(CacheFileError, match="NumPy"):
        load_cache(corrupt(tmp_path / "a.npy", b"\x93NUMPY\x01\x00" + b"x" * 40), llama)
    with pytest.raises(CacheFileError, match="GGUF"):
        load_cache(corrupt(tmp_path / "m.gguf", b"GGUF\x03\x00\x00\x00" + b"\x00" * 40), llama)
    with pytest.raises(CacheFileError, match="zip archive"):
        with zipfile.ZipFile(tmp_path / "z.zip", "w") as z:
            z.writestr("readme.txt", "hello")
        load_cache(tmp_path / "z.zip", llama)


def test_no_pickle_anywhere_in_the_project():
    mod = "pick" + "le"
    patterns = [
        rf"\bimport\s+(c?{mod}|_{mod}|dill|cloud{mod}|joblib|shelve)\b",
        rf"\bfrom\s+(c?{mod}|_{mod}|dill|cloud{mod}|joblib|shelve)\b",
        rf"\b(c?{mod}|dill|cloud{mod}|joblib)\.(loads?|dumps?|Unpickler|Pickler)\b",
        r"\btorch\.load\s*\(",
        r"allow_" + mod + r"\s*=\s*True",
        r"weights_only\s*=\s*False",
        rf"__import__\(\s*['\"]{mod}",
        rf"import_module\(\s*['\"]{mod}",
    ]
    rx = re.compile("|".join(patterns))
    skip = {
        ".venv",
        ".git",
        "__pycache__",
        "node_modules",
        ".ipynb_checkpoints",
        ".pytest_cache",
        ".hypothesis",
        "build",
        "dist",
    }
    # Used on purpose, and only as named: a wrong store that unpickles (the defect the audit must
    # name), MemOS's reproduction that writes a payload for MemOS to load, and MemOS's report, which
    # quotes the calls its code makes. kvlab itself imports no pickle module.
    on_purpose = {
        "tests/measure/audit_targets.py": {f"import {mod}", f"{mod}.dumps(", f"{mod}.loads("},
        "results/field/repro/memos_files.py": {f"import {mod}", f"{mod}.dumps(Canary"},
        "docs/field/MemoryOS.md": {f"`{mod}.dump`", f"`{mod}.load` (line 158)", f"{mod}.UnpicklingError"},
    }
    hits = []
    for root, dirs, files in os.walk(REPO):
        dirs[:] = [d for d in dirs if d not in skip and not d.endswith(".egg-info")]
        for f in files:
            path = Path(root) / f
            if path.suffix not in {".py", ".ipynb", ".toml", ".cfg", ".txt", ".md", ".sh"}:
                continue
            for i, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
                if rx.search(line):
                    rel = str(path.relative_to(REPO))
                    if not any(use in line for use in on_purpose.get(rel, ())):
                        hits.append(f"{rel}:{i}: {line.strip()[:100]}")
    assert hits == []


# --------------------------------------------------------------------------- fuzzing

JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


@pytest.fixture(scope="module")
def fuzz(tmp_path_factory, gemma):
    """A tiny-gemma3 cache (hybrid layers) and its parts; module-scoped, so hypothesis may reuse it."""
    model = gemma
    frag = kvlab.prefill(model, "fuzz me, but only with kvlab errors")
    _, tensors = cf._describe(frag, None)
    folder = tmp_path_factory.mktemp("fuzz")
    good = save_cache(folder / "good.kvcache", frag, model).read_bytes()
    return {
        "model": model,
        "header": read_header(folder / "good.kvcache"),
        "tensors": tensors,
        "dir": folder,
        "bytes": good,
        "entries": json.loads(good[8 : header_end(good)]),
        "data": good[header_end(good) :],
    }


def _expect_only_kvlab_errors(path, model):
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", CacheFileWarning)
            frag = load_cache(path, model, strict=False, allow_unverified=True)
    except KvlabError:
        return
    assert frag.length >= 1  # whatever loads is a real cache, never an empty one


PATHS = st.sampled_from(
    [
        ("format",),
        ("format_version",),
        ("producer",),
        ("model_name",),
        ("start",),
        ("length",),
        ("dtype",),
        ("layers",),
        ("token_ids",),
        ("text",),
        ("tensors",),
        ("tensor_digest",),
        ("content_digest",),
        ("layers", 0),
        ("layers", 0, "type"),
        ("layers", 1, "window"),
        ("layers", 3, "kept"),
        ("layers", 2, "keys"),
        ("layers", 0, "values"),
        ("producer", "geometry"),
        ("producer", "dtype"),
        ("producer", "geometry", "num_layers"),
        ("token_ids", 0),
        ("layers", 0, "keys", 2),
        ("tensors", "layers.0.keys"),
    ]
)


@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
@given(path=PATHS, value=JSON, delete=st.booleans())
def test_fuzz_kvlab_header_fields(fuzz, path, value, delete):
    header = copy.deepcopy(fuzz["header"])
    node = header
    try:
        for key in path[:-1]:
            node = node[key]
        if delete and isinstance(node, dict):
            node.pop(path[-1], None)
        else:
            node[path[-1]] = value
    except (KeyError, IndexError, TypeError):
        return
    target = fuzz["dir"] / "h.kvcache"
    try:
        cf._write_file(target, fuzz["tensors"], header, fill_digests=False)
    except (ValueError, TypeError):
        return  # not encodable as JSON (e.g. a huge int is fine, a NaN is not): nothing to read
    _expect_only_kvlab_errors(target, fuzz["model"])


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    edits=st.lists(st.tuples(st.integers(0, 10**9), st.integers(0, 255)), min_size=1, max_size=6),
    cut=st.one_of(st.none(), st.integers(0, 10**9)),
)
def test_fuzz_header_bytes(fuzz, edits, cut):
    data = bytearray(fuzz["bytes"])
    end = header_end(bytes(data))
    for at, byte in edits:
        data[at % end] = byte
    if cut is not None:
        data = data[: cut % (len(data) + 1)]
    target = fuzz["dir"] / "b.kvcache"
    target.write_bytes(bytes(data))
    _expect_only_kvlab_errors(target, fuzz["model"])


@settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck))
@given(name=st.sampled_from(["layers.0.keys", "layers.3.values", "__metadata__", "extra"]), value=JSON)
def test_fuzz_safetensors_entries(fuzz, name, value):
    outer = dict(fuzz["entries"])
    outer[name] = value
    js = json.dumps(outer).encode()
    target = fuzz["dir"] / "e.kvcache"
    target.write_bytes(struct.pack("<Q", len(js)) + js + fuzz["data"])
    _expect_only_kvlab_errors(target, fuzz["model"])


# --------------------------------------------------------------------------- real models


# smollm2 and gemma3 are the session fixtures of tests/conftest.py (gemma3 skips when its extra is missing).


@pytest.mark.real
def test_smollm2_round_trip_is_bit_exact(tmp_path, smollm2):
    frag = kvlab.prefill(smollm2, "The user's cat is called Miso and sleeps on the piano.")
    back = silent_load(save_cache(tmp_path / "s.kvcache", frag, smollm2), smollm2)
    assert_same_cache(frag.cache, back.cache)
    assert torch.equal(back.token_ids, frag.token_ids)


@pytest.mark.real
def test_gemma3_round_trip_is_bit_exact_across_its_hybrid_layers(tmp_path, gemma3):
    # More tokens than the 512-token window, so sliding layers hold only their last 511.
    text = finetune_text()
    frag = kvlab.prefill(gemma3, text + " " + text[:900])
    assert frag.length > 512
    kinds = {(layer.is_sliding, layer.keys.shape[2]) for layer in frag.cache.layers}
    assert kinds == {(True, 511), (False, frag.length)}
    back = silent_load(save_cache(tmp_path / "g.kvcache", frag, gemma3), gemma3)
    assert_same_cache(frag.cache, back.cache)


@pytest.mark.real
def test_smollm2_cache_into_gemma3_names_architecture_and_geometry(tmp_path, smollm2, gemma3):
    path = save_cache(tmp_path / "s.kvcache", kvlab.prefill(smollm2, "hello"), smollm2)
    with pytest.raises(FingerprintMismatch) as e:
        load_cache(path, gemma3)
    msg = str(e.value)
    assert "architecture: file LlamaForCausalLM, model Gemma3ForCausalLM" in msg
    for field in (
        "geometry.num_layers: file 30, model 18",
        "geometry.kv_heads: file 3, model 1",
        "geometry.head_dim: file 64, model 256",
        "tokenizer_sha256",
        "source:",
    ):
        assert field in msg
    with pytest.raises(FingerprintMismatch, match="even with strict=False"):
        load_cache(path, gemma3, strict=False)
