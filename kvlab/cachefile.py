"""Cache files: a Fragment in safetensors, with who made it and a digest of what it holds.

A cache file is a plain safetensors file (any safetensors reader opens it)::

    8 bytes    little-endian u64: N, the header length
    N bytes    ASCII JSON, padded with spaces to a multiple of 8:
               {"__metadata__": {"kvlab": "<kvlab header JSON>", "kvlab_sha256": "<its sha256>"},
                "layers.0.keys":   {"dtype": "F32", "shape": [b, h, kept, d], "data_offsets": [0, n]},
                "layers.0.values": {...}, ...}
    data       the tensors back to back, in header order

The kvlab header (``format_version`` 2) holds ``format``, ``format_version``,
``producer`` (the :func:`kvlab.fingerprint` of the model that made the cache),
``model_name``, ``start``, ``length``, ``dtype``, ``layers`` (per layer: ``type``,
``window``, ``kept`` and the key and value shapes), ``token_ids``, ``text``,
``tensor_digest`` (the algorithm, ``xxh3-128``), ``tensors`` (that digest of each
tensor's bytes) and ``content_digest`` (the same algorithm over the name/digest lines).

Why XXH3-128 and not sha256 for the tensor data: the digests guard against corruption
(a flipped bit, a truncated copy, a file edited by hand), and for that a 128-bit
non-cryptographic hash is as good as sha256 while running about ten times faster
(5 ms against 53 ms for a 94 MB cache here; ``benchmarks/cachefile.py``). Neither would
stop a deliberate forger: the digest travels in the same file, so whoever edits the
data can rewrite it too, sha256 or not. Authenticating a file needs a signature over it,
which kvlab does not claim to provide. The small kvlab header keeps its own sha256.

Nothing here unpickles, ever: a pickle (a MemOS dump, a ``torch.save`` archive) is
recognised by its first bytes and refused before anything else reads it.
"""
from __future__ import annotations

import hashlib
import io
import json
import mmap
import os
import secrets
import stat
import struct
import warnings
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch
import xxhash
from transformers import DynamicCache

from .errors import CacheFileError, FingerprintMismatch
from .identity import _HEX, Difference, compare, fingerprint, tensor_bytes
from .fragments import Fragment, new_cache, set_length
from .models import LoadedModel

FORMAT = "kvlab-kv-cache"
FORMAT_VERSION = 2
#: The digest of each tensor's bytes (see the module docstring for why not sha256).
TENSOR_DIGEST = "xxh3-128"
_DIGEST_HEX = 32
#: Headers longer than this are refused before being parsed (safetensors itself allows 100 MB).
MAX_HEADER_BYTES = 64 << 20

_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
_ST_NAME = {v: k for k, v in _ST_DTYPES.items()}
_ST_NON_FLOAT = {"I64", "I32", "I16", "I8", "U64", "U32", "U16", "U8", "BOOL", "C64",
                 "F8_E4M3", "F8_E5M2", "F8_E8M0", "F6_E2M3", "F6_E3M2", "F4"}
_TORCH_DTYPES = {str(v).removeprefix("torch."): v for v in _ST_DTYPES.values()}
_HEADER_FIELDS = ("format", "format_version", "producer", "model_name", "start", "length", "dtype", "layers",
                  "token_ids", "text", "tensor_digest", "tensors", "content_digest")
_LAYER_FIELDS = {"type", "window", "kept", "keys", "values"}
_LAYER_TYPES = ("full_attention", "sliding_attention")
_MAX_INT = 1 << 53
_PLACEHOLDER = "0" * _DIGEST_HEX


class CacheFileWarning(UserWarning):
    """A cache file was loaded without full verification (``strict=False`` or ``allow_unverified=True``)."""


# --------------------------------------------------------------------------- saving


def save_cache(path, fragment_or_cache, model: LoadedModel) -> Path:
    """Write a cache and its producer's fingerprint to ``path``, atomically.

    The file is written under a temporary name in the same folder, fsynced, then renamed
    over ``path``: a save killed at any point leaves either the old file or the new one
    at ``path``, never a mix, and never removes the old file early.

    Parameters
    ----------
    path : str or os.PathLike
    fragment_or_cache : Fragment or DynamicCache
        Keys and values ``[batch, kv_heads, kept, head_dim]`` per layer. A bare
        ``DynamicCache`` is saved with ``start=0`` and no tokens or text.
    model : LoadedModel
        The model that computed the cache; its fingerprint goes into the file.

    Raises
    ------
    FingerprintMismatch
        The cache was not made by ``model`` (name, layer count, layer types, shapes or dtype).
    CacheFileError
        An empty cache, or the file cannot be written.
    """
    if not isinstance(model, LoadedModel):
        raise CacheFileError(f"save_cache needs the producing kvlab.LoadedModel, got {type(model).__name__}")
    frag = _as_fragment(fragment_or_cache, model)
    producer = fingerprint(model)
    _check_producer(frag, model, producer)
    header, tensors = _describe(frag, producer)
    path = Path(os.fspath(path))
    _write_file(path, tensors, header)
    return path


def _as_fragment(obj, model: LoadedModel) -> Fragment:
    if isinstance(obj, Fragment):
        return obj
    if isinstance(obj, DynamicCache):
        return Fragment(cache=obj, token_ids=None, text=None, start=0, model_name=model.name, config=model.config)
    raise CacheFileError(f"save_cache takes a kvlab.Fragment or a transformers DynamicCache, got {type(obj).__name__}")


def _check_producer(frag: Fragment, model: LoadedModel, producer: dict) -> None:
    geo = producer["geometry"]
    where = f"the cache given to save_cache with model {model.name!r}"
    if frag.model_name != model.name:
        raise FingerprintMismatch(f"the fragment was made by {frag.model_name!r} but save_cache was given {model.name!r}; "
                                  "the file would name the wrong producer")
    layers = frag.cache.layers
    if len(layers) != geo["num_layers"]:
        raise FingerprintMismatch(f"{where} has {len(layers)} layers, the model has {geo['num_layers']}")
    for i, layer in enumerate(layers):
        if not layer.is_initialized and getattr(layer, "keys", None) is not None and layer.keys.numel():
            raise CacheFileError(
                f"refusing to save: layer {i} holds tensors but was never initialized, so transformers reads it as "
                "empty and drops its tokens (a cache built by assigning .keys); build caches through cache.update")
    length = frag.cache.get_seq_length()
    if length < 1:
        raise CacheFileError("refusing to save an empty cache (0 tokens)")
    for i, layer in enumerate(layers):
        if not layer.is_initialized or layer.keys is None or layer.keys.numel() == 0:
            raise CacheFileError(f"refusing to save: layer {i} of the cache is empty (the cache holds {length} tokens)")
        kind = "sliding_attention" if layer.is_sliding else "full_attention"
        if kind != geo["layer_types"][i]:
            raise FingerprintMismatch(f"{where}: layer {i} is {kind}, the model's is {geo['layer_types'][i]}")
        k, v = layer.keys, layer.values
        want = [k.shape[0], geo["kv_heads"], k.shape[2], geo["head_dim"]]
        for what, t in (("keys", k), ("values", v)):
            if t.ndim != 4 or list(t.shape) != want:
                raise FingerprintMismatch(f"{where}: layer {i} {what} are {list(t.shape)}, the model makes {want}")
            if t.dtype != model.dtype:
                raise FingerprintMismatch(f"{where}: layer {i} {what} are {t.dtype}, the model computes {model.dtype}")
        kept = k.shape[2]
        expect = min(length, layer.sliding_window - 1) if layer.is_sliding else length
        if kept != expect or layer.get_seq_length() != length:
            raise CacheFileError(f"refusing to save: layer {i} keeps {kept} of {layer.get_seq_length()} tokens, "
                                 f"expected {expect} of {length}")


def _describe(frag: Fragment, producer: dict) -> tuple[dict, list[tuple[str, torch.Tensor]]]:
    layers, tensors = [], []
    for i, layer in enumerate(frag.cache.layers):
        k, v = layer.keys, layer.values
        layers.append({"type": "sliding_attention" if layer.is_sliding else "full_attention",
                       "window": int(layer.sliding_window) if layer.is_sliding else None,
                       "kept": int(k.shape[2]), "keys": list(k.shape), "values": list(v.shape)})
        tensors += [(f"layers.{i}.keys", k), (f"layers.{i}.values", v)]
    ids = frag.token_ids
    if ids is not None:
        if ids.ndim == 2 and ids.shape[0] == 1:
            ids = ids[0]
        if ids.ndim != 1:
            raise CacheFileError(f"save_cache stores 1-D token ids; the fragment's are {list(ids.shape)}")
        ids = [int(x) for x in ids.tolist()]
        if len(ids) != frag.length:
            raise CacheFileError(f"the fragment has {len(ids)} token ids for a cache of {frag.length} tokens")
    header = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "producer": producer,
        "model_name": frag.model_name,
        "start": int(frag.start),
        "length": int(frag.length),
        "dtype": str(frag.cache.layers[0].keys.dtype).removeprefix("torch."),
        "layers": layers,
        "token_ids": ids,
        "text": frag.text,
        "tensor_digest": TENSOR_DIGEST,
        "tensors": {},
        "content_digest": "",
    }
    return header, tensors


def tensor_digest(t: torch.Tensor) -> str:
    """XXH3-128 of a tensor's bytes (C order) as 32 hex digits."""
    return xxhash.xxh3_128_hexdigest(tensor_bytes(t))


def content_digest(names: list[str], digests: dict) -> str:
    """XXH3-128 over ``name<TAB>digest`` lines, in ``names`` order: one digest for all tensors."""
    h = xxhash.xxh3_128(b"kvlab-cache-content-v2\n")
    for n in names:
        h.update(f"{n}\t{digests[n]}\n".encode())
    return h.hexdigest()


def _encode(entries: list[tuple[str, str, list, int, int]], meta: dict) -> bytes:
    """The 8-byte length and the padded header, exactly as kvlab writes them."""
    outer = {"__metadata__": meta}
    for name, dt, shape, a, b in entries:
        outer[name] = {"dtype": dt, "shape": list(shape), "data_offsets": [a, b]}
    js = json.dumps(outer, ensure_ascii=True, separators=(",", ":")).encode()
    js += b" " * ((-(8 + len(js))) % 8)  # keep the tensor data 8-byte aligned
    return struct.pack("<Q", len(js)) + js


def _kvlab_meta(header: dict) -> dict:
    text = json.dumps(header, ensure_ascii=True, separators=(",", ":"), allow_nan=False)
    return {"kvlab": text, "kvlab_sha256": hashlib.sha256(text.encode()).hexdigest()}


def _write_file(path: Path, tensors: list[tuple[str, torch.Tensor]], header: dict, fill_digests: bool = True) -> None:
    """Lay out and write a cache file atomically.

    With ``fill_digests`` the per-tensor and content digests are computed while the data
    is written and then put into ``header``; tests pass ``False`` to write a header as is.
    """
    if path.is_dir():
        raise CacheFileError(f"{path} is a directory; give save_cache a file name")
    arrays, entries, at = [], [], 0
    for name, t in tensors:
        if t.dtype not in _ST_NAME:
            raise CacheFileError(f"tensor {name} is {t.dtype}; cache files hold float64/32/16 or bfloat16")
        b = tensor_bytes(t)
        arrays.append(b)
        entries.append((name, _ST_NAME[t.dtype], list(t.shape), at, at + b.nbytes))
        at += b.nbytes
    names = [e[0] for e in entries]
    if fill_digests:
        # Digests have a fixed length, so the header's size is known before they are.
        header["tensors"] = {n: _PLACEHOLDER for n in names}
        header["content_digest"] = _PLACEHOLDER
    blob = _encode(entries, _kvlab_meta(header))
    tmp = path.parent / f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666)
    except OSError as e:
        raise CacheFileError(f"cannot write {path}: {e.strerror or e}") from e
    try:
        with open(fd, "wb") as f:
            f.seek(len(blob))
            digests = {}
            for name, a in zip(names, arrays):
                if fill_digests:
                    # Hashed right before its write, so the write reads it from the CPU's caches.
                    digests[name] = xxhash.xxh3_128_hexdigest(a)
                f.write(a)
            if fill_digests:
                header["tensors"] = digests
                header["content_digest"] = content_digest(names, digests)
                final = _encode(entries, _kvlab_meta(header))
                assert len(final) == len(blob), "header length changed after filling in digests"
                blob = final
            f.seek(0)
            f.write(blob)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        if isinstance(e, OSError):
            raise CacheFileError(f"cannot write {path}: {e.strerror or e}") from e
        raise
    _fsync_dir(path.parent)


def _fsync_dir(folder: Path) -> None:
    # Makes the rename itself durable; not every platform lets a directory be opened.
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# --------------------------------------------------------------------------- reading


@dataclass
class _Entry:
    name: str
    dtype: str
    shape: list[int]
    begin: int
    end: int


@dataclass
class _Container:
    """The parsed safetensors framing: entries (in data order), metadata, where data starts."""

    entries: list[_Entry]
    metadata: dict | None
    data_start: int
    header: bytes


@dataclass
class _Layout:
    start: int
    length: int
    dtype: torch.dtype
    layers: list[dict]  # type, window, kept, keys, values
    digests: dict | None
    token_ids: list[int] | None
    text: str | None


class _Bad(Exception):
    pass


def _read_file(path: Path) -> torch.Tensor:
    """The whole file as a ``[size]`` uint8 tensor over a private, read-only-in-effect mapping.

    One descriptor from open to map (no check-then-open race). Mapping, as safetensors
    does, saves a full copy over reading: :func:`_build` copies the tensors into the
    cache once and hashes those copies, so what is verified is exactly what is returned,
    whatever happens to the file meanwhile. (Like every memory-mapped reader, a process
    that truncates the file *in place* during a load can crash it with SIGBUS; kvlab's own
    saves never do, they rename a new file over the old one.)
    """
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise CacheFileError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise CacheFileError(f"{path} is a directory, not a cache file") from None
    except OSError as e:
        raise CacheFileError(f"{path}: cannot open: {e.strerror or e}") from None
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise CacheFileError(f"{path} is a directory, not a cache file")
        if not stat.S_ISREG(st.st_mode):
            raise CacheFileError(f"{path} is not a regular file")
        if st.st_size == 0:
            return torch.empty(0, dtype=torch.uint8)
        # ACCESS_COPY (MAP_PRIVATE): writable for torch.frombuffer, never written back.
        mm = mmap.mmap(fd, st.st_size, access=mmap.ACCESS_COPY)
        return torch.frombuffer(mm, dtype=torch.uint8)
    except (OSError, ValueError) as e:
        raise CacheFileError(f"{path}: cannot read: {getattr(e, 'strerror', None) or e}") from None
    finally:
        os.close(fd)  # the mapping keeps its own reference to the file


def _open(path) -> tuple[Path, torch.Tensor, _Container, dict | None]:
    """Map a file and check its framing and kvlab header (``None`` when it has none)."""
    path = Path(os.fspath(path))
    buf = _read_file(path)
    box = _parse_container(buf, path)
    return path, buf, box, _kvlab_header(box, path)


def _refuse_foreign(buf: torch.Tensor, path: Path) -> None:
    """Refuse pickles and other formats by their first bytes, before anything parses them."""
    head = bytes(buf[:16].numpy())
    # A safetensors header starts with '{' at byte 8; its 8-byte length can begin with 0x80.
    looks_safetensors = head[8:9] == b"{"
    if head[:1] == b"\x80" and len(head) >= 2 and 2 <= head[1] <= 5 and not looks_safetensors:
        raise CacheFileError(
            f"{path} is a Python pickle (protocol {head[1]}), not a kvlab cache file; kvlab never unpickles, because "
            "unpickling runs whatever code the file names (MemOS activation-memory dumps are such pickles). Rebuild the "
            "cache from its source text with kvlab.prefill and keep it with kvlab.save_cache")
    if head[:4] == b"PK\x03\x04" and not looks_safetensors:
        try:
            names = zipfile.ZipFile(io.BytesIO(buf.numpy().tobytes())).namelist()
        except (zipfile.BadZipFile, OSError, ValueError, EOFError):
            names = []
        pickled = [n for n in names if n.endswith(".pkl")]
        if pickled:
            raise CacheFileError(
                f"{path} is a torch.save archive (a zip holding {pickled[0]}), not a kvlab cache file; kvlab never "
                "opens it, because reading it means unpickling, which runs whatever code the file names")
        raise CacheFileError(f"{path} is a zip archive, not a kvlab cache file")
    if head[:6] == b"\x93NUMPY":
        raise CacheFileError(f"{path} is a NumPy .npy file, not a kvlab cache file")
    if head[:4] == b"GGUF":
        raise CacheFileError(f"{path} is a GGUF model file, not a kvlab cache file")


def _pickle_hint(buf: torch.Tensor) -> str:
    # Protocol 0/1 pickles have no magic number, but start with an opcode and end with STOP.
    n = buf.numel()
    if n >= 2 and bytes(buf[:1].numpy()) in (b"(", b"}", b"]", b"c", b"K", b"X", b"V", b"S") and bytes(buf[n - 1 :].numpy()) == b".":
        return "; it looks like a protocol 0/1 Python pickle, which kvlab never unpickles"
    return ""


def _loads(text: str, what: str):
    def pairs(items):
        d = {}
        for k, v in items:
            if k in d:
                raise _Bad(f"{what} has the key {k!r} twice")
            d[k] = v
        return d

    def constant(c):
        raise _Bad(f"{what} contains {c}, which is not JSON")

    def number(s):
        x = float(s)
        if x != x or x in (float("inf"), float("-inf")):
            raise _Bad(f"{what} contains the number {s[:20]}, outside the float range")
        return x

    try:
        return json.loads(text, object_pairs_hook=pairs, parse_constant=constant, parse_float=number)
    except _Bad:
        raise
    except json.JSONDecodeError as e:
        raise _Bad(f"{what} is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    except RecursionError:
        raise _Bad(f"{what} is nested too deeply to be a cache header") from None
    except ValueError as e:  # e.g. an integer with more digits than Python converts
        raise _Bad(f"{what} is not valid JSON: {e}") from None


def _is_int(x, lo: int = 0, hi: int = _MAX_INT) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and lo <= x < hi


def _parse_container(buf: torch.Tensor, path: Path) -> _Container:
    size = buf.numel()
    if size == 0:
        raise CacheFileError(f"{path} is empty (0 bytes): not a cache file, or a save that never wrote anything")
    _refuse_foreign(buf, path)
    if size < 8:
        raise CacheFileError(f"{path} is {size} bytes, shorter than the 8-byte header length that starts a "
                             f"safetensors file: truncated{_pickle_hint(buf)}")
    n = int.from_bytes(bytes(buf[:8].numpy()), "little")
    if n > size - 8:
        raise CacheFileError(f"{path}: the header length field says {n} bytes, past the end of the file "
                             f"({size - 8} bytes follow it): truncated or corrupt{_pickle_hint(buf)}")
    if n > MAX_HEADER_BYTES:
        raise CacheFileError(f"{path}: the header is {n} bytes, more than the {MAX_HEADER_BYTES} kvlab reads")
    if n < 2:
        raise CacheFileError(f"{path}: the header length field says {n} bytes, too short for a JSON header")
    raw = bytes(buf[8 : 8 + n].numpy())
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise CacheFileError(f"{path}: the header is not UTF-8 (bad byte at header offset {e.start}): corrupt"
                             f"{_pickle_hint(buf)}") from None
    try:
        obj = _loads(text, "the safetensors header")
    except _Bad as e:
        raise CacheFileError(f"{path}: {e}{_pickle_hint(buf)}") from None
    if not isinstance(obj, dict):
        raise CacheFileError(f"{path}: the safetensors header is a JSON {type(obj).__name__}, not an object")
    meta = obj.pop("__metadata__", None)
    if meta is not None and not (isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())):
        raise CacheFileError(f"{path}: __metadata__ must map names to strings")
    entries = [_parse_entry(name, e, path) for name, e in obj.items()]
    entries.sort(key=lambda e: (e.begin, e.end))
    data_len = size - 8 - n
    at = 0
    for prev, e in zip([None] + entries[:-1], entries):
        if e.begin < at:
            raise CacheFileError(f"{path}: tensors {prev.name} and {e.name} overlap (bytes {e.begin}..{at})")
        if e.begin > at:
            raise CacheFileError(f"{path}: {e.begin - at} unaccounted bytes before tensor {e.name}")
        if e.end > data_len:
            raise CacheFileError(f"{path}: tensor {e.name} ends at data byte {e.end} but the file holds only "
                                 f"{data_len} bytes of data: truncated")
        at = e.end
    if at < data_len:
        raise CacheFileError(f"{path}: {data_len - at} bytes follow the last tensor: data was appended, "
                             "or the header length is wrong")
    return _Container(entries, meta, 8 + n, raw)


def _parse_entry(name: str, e, path: Path) -> _Entry:
    if not isinstance(e, dict) or set(e) != {"dtype", "shape", "data_offsets"}:
        got = sorted(e) if isinstance(e, dict) else type(e).__name__
        raise CacheFileError(f"{path}: header entry {name!r} must have exactly dtype, shape and data_offsets, has {got}")
    dt, shape, offsets = e["dtype"], e["shape"], e["data_offsets"]
    if not isinstance(dt, str) or (dt not in _ST_DTYPES and dt not in _ST_NON_FLOAT):
        raise CacheFileError(f"{path}: tensor {name!r} has an unknown dtype {dt!r}")
    if dt not in _ST_DTYPES:
        raise CacheFileError(f"{path}: tensor {name!r} is {dt}; KV cache tensors are F64, F32, F16 or BF16")
    if not isinstance(shape, list) or len(shape) > 8 or not all(_is_int(s) for s in shape):
        raise CacheFileError(f"{path}: tensor {name!r} has an invalid shape {_short(shape)}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(o) for o in offsets)
            and offsets[0] <= offsets[1]):
        raise CacheFileError(f"{path}: tensor {name!r} has invalid data_offsets {_short(offsets)}")
    nbytes = _ST_DTYPES[dt].itemsize
    for s in shape:
        nbytes *= s
    if nbytes != offsets[1] - offsets[0]:
        raise CacheFileError(f"{path}: tensor {name!r} is {shape} x {dt} = {nbytes} bytes but its data_offsets "
                             f"span {offsets[1] - offsets[0]}")
    return _Entry(name, dt, shape, offsets[0], offsets[1])


def _short(x, limit: int = 80) -> str:
    s = json.dumps(x, default=str) if not isinstance(x, str) else repr(x)
    return s if len(s) <= limit else s[: limit - 1] + "…"


def _kvlab_header(box: _Container, path: Path) -> dict | None:
    """The verified kvlab header, or ``None`` for a safetensors file with no kvlab metadata."""
    meta = box.metadata or {}
    ours = sorted(k for k in meta if k.startswith("kvlab"))
    if not ours:
        return None
    if ours != ["kvlab", "kvlab_sha256"] or len(meta) != 2:
        raise CacheFileError(f"{path}: the metadata must hold exactly kvlab and kvlab_sha256, holds {sorted(meta)}")
    text = meta["kvlab"]
    if hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest() != meta["kvlab_sha256"]:
        raise CacheFileError(f"{path}: the kvlab header does not match its sha256: it was corrupted or edited after saving")
    entries = [(e.name, e.dtype, e.shape, e.begin, e.end) for e in box.entries]
    if _encode(entries, meta)[8:] != box.header:
        raise CacheFileError(f"{path}: the safetensors header is not byte for byte what kvlab wrote: it was "
                             "corrupted or edited after saving")
    try:
        h = _loads(text, "the kvlab header")
    except _Bad as e:
        raise CacheFileError(f"{path}: {e}") from None
    return _validate_header(h, path)


def _validate_header(h, path: Path) -> dict:
    def bad(msg):
        return CacheFileError(f"{path}: kvlab header: {msg}")

    if not isinstance(h, dict):
        raise bad(f"is a JSON {type(h).__name__}, not an object")
    if h.get("format") != FORMAT:
        raise bad(f"format is {_short(h.get('format'))}, expected {FORMAT!r}")
    version = h.get("format_version")
    if version != FORMAT_VERSION or not _is_int(version):
        newer = " (written by a newer kvlab)" if _is_int(version) and version > FORMAT_VERSION else ""
        raise bad(f"format version {_short(version)} is not supported{newer}; this kvlab reads version {FORMAT_VERSION}")
    missing = [k for k in _HEADER_FIELDS if k not in h]
    extra = sorted(k for k in h if k not in _HEADER_FIELDS)
    if missing or extra:
        raise bad("; ".join(filter(None, [missing and f"missing field(s) {', '.join(missing)}",
                                          extra and f"unknown field(s) {', '.join(map(repr, extra))}"])))
    if h["producer"] is not None and not isinstance(h["producer"], dict):
        raise bad(f"producer must be a fingerprint object or null, is {type(h['producer']).__name__}")
    if not isinstance(h["model_name"], str):
        raise bad("model_name must be a string")
    if not _is_int(h["start"]):
        raise bad(f"start must be an integer >= 0, is {_short(h['start'])}")
    if not _is_int(h["length"], 1):
        raise bad(f"length must be an integer >= 1, is {_short(h['length'])}")
    if not isinstance(h["dtype"], str) or h["dtype"] not in _TORCH_DTYPES:
        raise bad(f"dtype {_short(h['dtype'])} is not one of {', '.join(_TORCH_DTYPES)}")
    length, layers = h["length"], h["layers"]
    if not isinstance(layers, list) or not layers:
        raise bad("layers must be a non-empty list")
    batch = None
    for i, L in enumerate(layers):
        if not isinstance(L, dict) or set(L) != _LAYER_FIELDS:
            got = sorted(L) if isinstance(L, dict) else type(L).__name__
            raise bad(f"layer {i} must have exactly {', '.join(sorted(_LAYER_FIELDS))}, has {got}")
        if L["type"] not in _LAYER_TYPES:
            raise bad(f"layer {i} has unknown type {_short(L['type'])}")
        sliding = L["type"] == "sliding_attention"
        if sliding and not _is_int(L["window"], 2):
            raise bad(f"layer {i} is sliding but its window is {_short(L['window'])}")
        if not sliding and L["window"] is not None:
            raise bad(f"layer {i} is full attention but has a window {_short(L['window'])}")
        expect = min(length, L["window"] - 1) if sliding else length
        if L["kept"] != expect or not _is_int(L["kept"]):
            raise bad(f"layer {i} keeps {_short(L['kept'])} tokens; a {L['type']} layer of a {length}-token cache keeps {expect}")
        for what in ("keys", "values"):
            s = L[what]
            if not (isinstance(s, list) and len(s) == 4 and all(_is_int(x, 1) for x in s)) or s[2] != expect:
                raise bad(f"layer {i} {what} shape {_short(s)} is not [batch, kv_heads, {expect}, head_dim]")
        if L["keys"][:2] != L["values"][:2]:
            raise bad(f"layer {i}: keys {L['keys']} and values {L['values']} disagree on batch or heads")
        if batch is None:
            batch = L["keys"][0]
        elif L["keys"][0] != batch:
            raise bad(f"layer {i} has batch {L['keys'][0]}, layer 0 has {batch}")
    ids = h["token_ids"]
    if ids is not None:
        if not isinstance(ids, list) or not all(_is_int(x, 0, 1 << 31) for x in ids):
            raise bad("token_ids must be null or a list of integers in [0, 2^31)")
        if len(ids) != length:
            raise bad(f"{len(ids)} token ids for a cache of {length} tokens")
    if h["text"] is not None and not isinstance(h["text"], str):
        raise bad("text must be null or a string")
    names = _tensor_names(len(layers))
    digests = h["tensors"]
    if h["tensor_digest"] != TENSOR_DIGEST:
        raise bad(f"tensor_digest {_short(h['tensor_digest'])} is not supported; this kvlab reads {TENSOR_DIGEST!r}")
    if not isinstance(digests, dict) or sorted(digests) != sorted(names):
        raise bad("tensors must map exactly " + ", ".join(names[:2]) + f", ... to their {TENSOR_DIGEST} digests")
    if not all(isinstance(d, str) and len(d) == _DIGEST_HEX and set(d) <= _HEX for d in digests.values()):
        raise bad(f"every tensor digest must be {_DIGEST_HEX} lowercase hex digits")
    if h["content_digest"] != content_digest(names, digests):
        raise bad("content_digest does not match the tensor digests")
    return h


def _tensor_names(n: int) -> list[str]:
    return [f"layers.{i}.{w}" for i in range(n) for w in ("keys", "values")]


def _layout(h: dict, box: _Container, path: Path) -> _Layout:
    """Check that the file's tensors are exactly what its kvlab header describes."""
    layers = h["layers"]
    names = _tensor_names(len(layers))
    got = {e.name: e for e in box.entries}
    missing = [n for n in names if n not in got]
    extra = [n for n in got if n not in set(names)]
    if missing:
        raise CacheFileError(f"{path}: missing tensor(s) {', '.join(missing[:6])}{' ...' if len(missing) > 6 else ''} "
                             f"that the header lists")
    if extra:
        raise CacheFileError(f"{path}: unexpected tensor(s) {', '.join(map(repr, extra[:6]))} not in the header")
    st = _ST_NAME[_TORCH_DTYPES[h["dtype"]]]
    for i, L in enumerate(layers):
        for what in ("keys", "values"):
            e = got[f"layers.{i}.{what}"]
            if e.shape != L[what]:
                raise CacheFileError(f"{path}: tensor {e.name} has shape {e.shape} in the file but {L[what]} in the header")
            if e.dtype != st:
                raise CacheFileError(f"{path}: tensor {e.name} is {e.dtype} in the file but the header says {st}")
    return _Layout(h["start"], h["length"], _TORCH_DTYPES[h["dtype"]], layers, h["tensors"], h["token_ids"], h["text"])


def _plain_layout(box: _Container, model: LoadedModel, path: Path) -> _Layout:
    """Layout of a safetensors KV dump without kvlab metadata (only with ``allow_unverified``)."""
    got = {e.name: e for e in box.entries}
    n = len(got) // 2
    names = _tensor_names(n)
    if not got or sorted(got) != sorted(names):
        raise CacheFileError(f"{path} has no kvlab header and its tensors are not named layers.<i>.keys / "
                             f"layers.<i>.values (found {', '.join(sorted(got)[:4]) or 'none'}): not a KV cache")
    dtypes = {e.dtype for e in got.values()}
    if len(dtypes) != 1:
        raise CacheFileError(f"{path}: tensors mix dtypes {sorted(dtypes)}")
    live = new_cache(model.config).layers
    layers = []
    for i in range(n):
        k, v = got[f"layers.{i}.keys"].shape, got[f"layers.{i}.values"].shape
        if len(k) != 4 or len(v) != 4 or k[:3] != v[:3] or 0 in k:
            raise CacheFileError(f"{path}: layer {i} keys {k} and values {v} are not [batch, kv_heads, tokens, head_dim]")
        sliding = i < len(live) and live[i].is_sliding
        layers.append({"type": "sliding_attention" if sliding else "full_attention",
                       "window": int(live[i].sliding_window) if sliding else None, "kept": k[2], "keys": k, "values": v})
    full = {L["kept"] for L in layers if L["type"] == "full_attention"}
    if len(full) > 1:
        raise CacheFileError(f"{path}: full-attention layers hold different token counts {sorted(full)}")
    if full:
        length = full.pop()
    else:
        length = layers[0]["kept"]
        if any(L["kept"] >= L["window"] - 1 for L in layers):
            raise CacheFileError(f"{path}: without a kvlab header the token count of a full sliding window is unknown")
    for i, L in enumerate(layers):
        if L["type"] == "sliding_attention" and L["kept"] != min(length, L["window"] - 1):
            raise CacheFileError(f"{path}: sliding layer {i} holds {L['kept']} tokens; a {length}-token cache keeps "
                                 f"{min(length, L['window'] - 1)}")
    return _Layout(0, length, _ST_DTYPES[dtypes.pop()], layers, None, None, None)


def _fit(layout: _Layout, model: LoadedModel, live: dict) -> list[str]:
    """Why the file's tensors cannot serve as ``model``'s cache at all (empty when they can)."""
    geo = live["geometry"]
    live_layers = new_cache(model.config).layers
    out = []
    if len(layout.layers) != len(live_layers):
        return [f"the file holds {len(layout.layers)} layers, {model.name} has {len(live_layers)}"]
    for i, (L, ll) in enumerate(zip(layout.layers, live_layers)):
        kind = "sliding_attention" if ll.is_sliding else "full_attention"
        window = int(ll.sliding_window) if ll.is_sliding else None
        if (L["type"], L["window"]) != (kind, window):
            out.append(f"layer {i} is {L['type']} (window {L['window']}) in the file, {kind} (window {window}) in {model.name}")
            continue
        for what in ("keys", "values"):
            s = L[what]
            want = [s[0], geo["kv_heads"], s[2], geo["head_dim"]]
            if s != want:
                out.append(f"layer {i} {what} are {s} in the file, {model.name} needs {want}")
    text_config = model.config.get_text_config()
    limit = getattr(text_config, "max_position_embeddings", None)
    if limit is not None and layout.start + layout.length > limit:
        out.append(f"the cache reaches position {layout.start + layout.length - 1}, past {model.name}'s "
                   f"max_position_embeddings={limit}")
    vocab = getattr(text_config, "vocab_size", None)
    if layout.token_ids and vocab is not None and max(layout.token_ids) >= vocab:
        out.append(f"token id {max(layout.token_ids)} is outside {model.name}'s vocabulary of {vocab}")
    return out


def _build(buf: torch.Tensor, box: _Container, layout: _Layout, model: LoadedModel, path: Path) -> Fragment:
    """Copy the tensors into a new cache and check their digests.

    The digests are computed over the cache's own copies, not over the file, so a file
    changed during the load cannot slip unverified bytes into the result. Each copy is
    hashed right after it is made, while it is still in the CPU's caches.
    """
    data = buf[box.data_start :]
    if box.data_start % 8:
        data = data.clone()  # realign: a dtype view needs an offset divisible by the item size
    where = {e.name: e for e in box.entries}
    # Where the cache holds exactly the file's bytes (same dtype, on the CPU), hash the
    # cache; otherwise (a cast, another device) hash a private copy taken before converting.
    # LoadedModel.dtype/device walk the parameters; read them once, not per tensor.
    dtype, device = model.dtype, model.device
    same_bytes = layout.dtype == dtype and device.type == "cpu"
    # Hashed inline: handing each tensor to a worker thread measured slower (17 -> 20 ms for
    # 94 MB) than hashing it here while the fresh copy is still in the CPU's caches.
    bad: list[str] = []

    def check(name: str, t: torch.Tensor) -> None:
        if tensor_digest(t) != layout.digests[name]:
            bad.append(name)

    cache = new_cache(model.config)
    for i, L in enumerate(layout.layers):
        pair = []
        for what in ("keys", "values"):
            name = f"layers.{i}.{what}"
            e = where[name]
            raw = data[e.begin : e.end]
            if raw.storage_offset() % layout.dtype.itemsize:
                raw = raw.clone()
            t = raw.view(layout.dtype).view(L[what])
            if layout.digests and not same_bytes:
                t = t.clone()
                check(name, t)
            pair.append(t.to(device, dtype))
        cache.update(pair[0], pair[1], i)  # update copies: the cache never aliases the file
        set_length(cache.layers[i], layout.length)
        if layout.digests and same_bytes:
            layer = cache.layers[i]
            for what, held in (("keys", layer.keys), ("values", layer.values)):
                check(f"layers.{i}.{what}", held)
    if bad:
        raise _digest_error(path, bad)
    ids = torch.tensor(layout.token_ids, dtype=torch.long) if layout.token_ids is not None else None
    return Fragment(cache=cache, token_ids=ids, text=layout.text, start=layout.start, model_name=model.name,
                    config=model.config)


def load_cache(path, model: LoadedModel, *, strict: bool = True, allow_unverified: bool = False) -> Fragment:
    """Read a cache file, verify it against ``model``, and return a Fragment ready for ``merge``.

    Checks, in order: that the file is a safetensors file and not a pickle or another
    format; its framing (header length, offsets that tile the data exactly); the kvlab
    header's digest and format version; that the tensors are the ones the header lists,
    with its shapes; the producer fingerprint against ``model``; that the tensors fit
    ``model``'s cache layers; and the digest of every tensor.

    Parameters
    ----------
    path : str or os.PathLike
    model : LoadedModel
        The reader.
    strict : bool
        ``True``: any differing strict fingerprint field raises. ``False``: load anyway
        and warn (:class:`CacheFileWarning`) with the same list; tensors in another dtype
        are cast. Tensors that do not fit the model's layers are refused either way.
    allow_unverified : bool
        Load a file that carries no fingerprint (with a warning) instead of refusing it.

    Returns
    -------
    Fragment
        Keys and values ``[batch, kv_heads, kept, head_dim]`` per layer, typed as the
        reader's config says, on the reader's device; ``start``, ``token_ids`` and ``text``
        as saved; ``model_name`` is the reader's.

    Raises
    ------
    FingerprintMismatch
        Made by another model (the message names every differing field with both values),
        no fingerprint without ``allow_unverified``, or tensors that do not fit ``model``.
    CacheFileError
        Missing, empty, a directory, truncated, corrupt, tampered, a wrong format version,
        or a pickle (refused unopened).
    """
    if not isinstance(model, LoadedModel):
        raise CacheFileError(f"load_cache needs the reading kvlab.LoadedModel, got {type(model).__name__}")
    return _load(path, model, strict, allow_unverified)[0]


def _load(path, model: LoadedModel, strict: bool, allow_unverified: bool) -> tuple[Fragment, list[Difference] | None]:
    """:func:`load_cache`, also returning the fingerprint differences (``None``: no producer recorded)."""
    path, buf, box, h = _open(path)
    live = fingerprint(model)
    notes: list[str] = []
    diffs: list[Difference] = []
    unknown = h is None or h["producer"] is None
    if unknown:
        if not allow_unverified:
            raise FingerprintMismatch(
                f"{path} carries no producer fingerprint, so nothing says which weights, tokenizer and dtype made it; "
                "kvlab refuses it. Rebuild the cache from its source text, or pass allow_unverified=True to load it "
                "unverified")
        notes.append("it carries no producer fingerprint: the model, tokenizer and dtype that made it are unknown")
        if h is None:
            notes.append("it has no kvlab header: no content digest, start position, tokens or text")
        layout = _plain_layout(box, model, path) if h is None else _layout(h, box, path)
    else:
        layout = _layout(h, box, path)
        diffs = compare(h["producer"], live)
        if diffs and strict:
            raise FingerprintMismatch(_mismatch_message(path, model, diffs, h), diffs)
        notes += [str(d) for d in diffs]
    problems = _fit(layout, model, live)
    if problems:
        lines = "\n  ".join(problems[:6] + (["..."] if len(problems) > 6 else []))
        listed = "".join(f"\n  {d}" for d in diffs)
        raise FingerprintMismatch(f"{path} cannot serve as a cache of {model.name}, even with strict=False:\n  {lines}"
                                  + (f"\nfingerprint differences:{listed}" if listed else ""), diffs)
    if layout.dtype != model.dtype:
        notes.append(f"its {str(layout.dtype).removeprefix('torch.')} tensors were cast to "
                     f"{str(model.dtype).removeprefix('torch.')}")
    fragment = _build(buf, box, layout, model, path)
    if notes:
        warnings.warn(f"{path} loaded into {model.name} unverified:\n  " + "\n  ".join(notes)
                      + "\nIts keys and values are not what this model computes for the same tokens.",
                      CacheFileWarning, stacklevel=3)
    return fragment, None if unknown else diffs


def _mismatch_message(path: Path, model: LoadedModel, diffs: list[Difference], h: dict) -> str:
    made_by = h.get("model_name")
    lines = "".join(f"\n  {d}" for d in diffs)
    return (f"{path} was made by a different model ({made_by!r}) than the reader {model.name!r}; "
            f"{len(diffs)} field(s) differ:{lines}\n"
            "A KV cache is valid only for the weights, tokenizer and dtype that computed it. Rebuild it from its "
            "source text (kvlab.prefill), or pass strict=False to load it anyway with a warning.")


def read_header(path) -> dict | None:
    """The verified kvlab header of a cache file (producer, start, tokens, text ...), without loading tensors.

    Returns ``None`` for a safetensors file without kvlab metadata. Raises
    :class:`CacheFileError` as :func:`load_cache` does for a bad file; tensor digests are
    not checked (that needs the data, see :func:`load_cache`).
    """
    path, _, box, h = _open(path)
    if h is not None:
        _layout(h, box, path)
    return h


def verify_file(path) -> dict | None:
    """Check a cache file's framing, header and every tensor digest, with no model at hand.

    For auditing stored caches: the same checks as :func:`load_cache` except the
    fingerprint comparison (which needs the reader). Returns the header (``None`` for a
    plain safetensors file, which carries no digests to check).

    Raises
    ------
    CacheFileError
        Anything :func:`load_cache` would call corrupt, truncated or tampered, naming the
        tensors whose data does not match the header.
    """
    path, buf, box, h = _open(path)
    if h is None:
        return None
    layout = _layout(h, box, path)
    data = buf[box.data_start :]
    bad = [e.name for e in box.entries
           if xxhash.xxh3_128_hexdigest(data[e.begin : e.end].numpy()) != layout.digests[e.name]]
    if bad:
        raise _digest_error(path, bad)
    return h


def _digest_error(path: Path, bad: list[str]) -> CacheFileError:
    return CacheFileError(f"{path}: the data of {', '.join(bad[:4])}{' ...' if len(bad) > 4 else ''} does not match "
                          f"its {TENSOR_DIGEST} digest in the header: the file is corrupt or was altered after saving")
