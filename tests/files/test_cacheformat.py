"""kvlab.files.format: the safetensors library parses the container; its refusals become kvlab errors naming the file."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors.torch import save_file

import kvlab
from conftest import tiny
from kvlab.errors import CacheFileError
from kvlab.files import format as cacheformat
from kvlab.files import header as cacheheader


@pytest.fixture()
def saved(tmp_path):
    m = tiny("tiny-llama")
    return kvlab.save_cache(tmp_path / "c.kvcache", kvlab.prefill(m, "a cache for the format tests"), m)


def test_a_refusal_of_the_library_is_named_in_kvlab_words(saved, tmp_path):
    data = saved.read_bytes()
    bad = tmp_path / "cut.kvcache"
    bad.write_bytes(data[:-3])
    with pytest.raises(CacheFileError) as e:
        cacheformat.read_header(bad)
    msg = str(e.value)
    assert msg.startswith(str(bad)) and "truncated" in msg and "(safetensors: " in msg


def test_overlapping_tensors_are_refused_by_the_library(saved, tmp_path):
    data = saved.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    outer = json.loads(data[8 : 8 + n])
    outer["layers.0.values"]["data_offsets"] = outer["layers.0.keys"]["data_offsets"]  # two tensors, one range
    js = json.dumps(outer, separators=(",", ":")).encode()
    js += b" " * (-len(js) % 8)
    bad = tmp_path / "overlap.kvcache"
    bad.write_bytes(struct.pack("<Q", len(js)) + js + data[8 + n :])
    with pytest.raises(CacheFileError, match=str(bad)):
        kvlab.load_cache(bad, tiny("tiny-llama"))


def test_integer_tensors_are_not_a_kv_cache(tmp_path):
    path = tmp_path / "ints.safetensors"
    save_file({"layers.0.keys": torch.zeros(1, 2, 3, 4, dtype=torch.int32)}, str(path))
    with pytest.raises(CacheFileError, match="is I32; KV cache tensors are F64, F32, F16 or BF16"):
        cacheformat.read_header(path)


def test_the_file_is_written_by_the_library_with_the_kvlab_metadata(saved):
    from safetensors import safe_open

    with safe_open(str(saved), "pt") as f:
        meta = f.metadata()
    assert meta == cacheformat.kvlab_metadata(json.loads(meta["kvlab"]))
    assert cacheformat.verify_file(saved)["format_version"] == cacheheader.FORMAT_VERSION
