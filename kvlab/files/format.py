"""The cache-file format: a safetensors container with a kvlab header, and nothing about models.

A cache file is a plain safetensors file, written and read by the ``safetensors``
library (``save_file`` with ``metadata``, ``safe_open``); any safetensors reader opens it.
Its tensors are ``layers.<i>.keys`` and ``layers.<i>.values``, ``[batch, kv_heads, kept,
head_dim]``; its ``__metadata__`` holds exactly two strings: ``kvlab`` (the kvlab header
as JSON) and ``kvlab_sha256`` (the sha256 of that JSON text).

The kvlab header (``format_version`` 2) holds ``format``, ``format_version``,
``producer`` (the :func:`kvlab.fingerprint` of the model that made the cache),
``model_name``, ``start``, ``length``, ``dtype``, ``layers`` (per layer: ``type``,
``window``, ``kept`` and the key and value shapes), ``token_ids``, ``text``,
``tensor_digest`` (the algorithm, ``xxh3-128``), ``tensors`` (that digest of each
tensor's bytes) and ``content_digest`` (the same algorithm over the name/digest lines).

What kvlab adds on top of the library, and why
----------------------------------------------
* The header and its checks (:func:`validate_header`, :func:`check_tensors`): the library
  guarantees a well-formed container (header length, JSON, dtypes, offsets that tile the
  data exactly, its own 100 MB header limit); kvlab checks that the tensors are exactly
  the ones its header describes, with its shapes and dtype.
* Digests. Why XXH3-128 and not sha256 for the tensor data: the digests guard against
  corruption (a flipped bit, a truncated copy, a file edited by hand), and for that a
  128-bit non-cryptographic hash is as good as sha256 while running about ten times faster
  (5 ms against 53 ms for a 94 MB cache here; ``benchmarks/cachefile.py``). Neither would
  stop a deliberate forger: the digest travels in the same file, so whoever edits the data
  can rewrite it too. Authenticating a file needs a signature over it, which kvlab does not
  claim to provide. The small kvlab header keeps its own sha256.
* Refusing other formats before the library sees them (:func:`refuse_foreign`): a pickle
  (a MemOS dump, a ``torch.save`` archive) is recognised by its first bytes and refused,
  never unpickled. kvlab also reads the 8-byte header length itself, only to say
  "empty", "shorter than 8 bytes", "past the end of the file" or "more than kvlab reads"
  in its own words; everything after those 8 bytes is the library's to parse, and a
  container the library refuses becomes a :class:`kvlab.CacheFileError` naming the file,
  what is wrong in kvlab's words, and the library's own message.
* Atomic writes (:func:`kvlab.atomic.atomic_path`): the library writes to a temporary
  name beside the target, which is then fsynced and renamed over it. The digests are
  computed in a pass of their own before the library writes (it takes a file name, not a
  stream, so a tensor can no longer be hashed while it is in the CPU's caches for its
  write): ``save_cache`` measured 1.32-1.59x a raw ``save_file`` against 0.89-1.29x for
  the hand-written writer (``benchmarks/cachefile.py --repeats 5``, two runs each, both
  malloc settings, on a shared 2-core VM), inside the 2x target. Loading is unchanged in
  kind: the library maps the file, and the cache copies each tensor once.

No hand-written container code is left: the byte-for-byte comparison of the outer header
with kvlab's own encoding (the old reader's guard against edits that still parse) is
gone, because the library writes ``__metadata__`` from a hash map in no fixed order. What
it guarded is covered elsewhere: the kvlab header by its sha256, the tensor names, shapes
and dtypes by :func:`check_tensors`, and their bytes by the per-tensor digests.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch
import xxhash
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from kvlab.atomic import atomic_path
from kvlab.errors import CacheFileError
from kvlab.files.identity import tensor_bytes
from kvlab.models.digests import HEX

FORMAT = "kvlab-kv-cache"
FORMAT_VERSION = 2
#: The digest of each tensor's bytes (see the module docstring for why not sha256).
TENSOR_DIGEST = "xxh3-128"
DIGEST_HEX = 32
#: Headers longer than this are refused before being parsed (safetensors itself allows 100 MB).
MAX_HEADER_BYTES = 64 << 20

#: The safetensors dtypes a KV cache may hold, and their torch dtypes.
ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
ST_NAME = {v: k for k, v in ST_DTYPES.items()}
TORCH_DTYPES = {str(v).removeprefix("torch."): v for v in ST_DTYPES.values()}
HEADER_FIELDS = (
    "format",
    "format_version",
    "producer",
    "model_name",
    "start",
    "length",
    "dtype",
    "layers",
    "token_ids",
    "text",
    "tensor_digest",
    "tensors",
    "content_digest",
)
LAYER_FIELDS = {"type", "window", "kept", "keys", "values"}
LAYER_TYPES = ("full_attention", "sliding_attention")
_MAX_INT = 1 << 53


def tensor_names(n_layers: int) -> list[str]:
    """``layers.0.keys, layers.0.values, ...`` for ``n_layers`` layers."""
    return [f"layers.{i}.{w}" for i in range(n_layers) for w in ("keys", "values")]


def tensor_digest(t: torch.Tensor) -> str:
    """XXH3-128 of a tensor's bytes (C order) as 32 hex digits."""
    return xxhash.xxh3_128_hexdigest(tensor_bytes(t))


def content_digest(names: list[str], digests: dict) -> str:
    """XXH3-128 over ``name<TAB>digest`` lines, in ``names`` order: one digest for all tensors."""
    h = xxhash.xxh3_128(b"kvlab-cache-content-v2\n")
    for n in names:
        h.update(f"{n}\t{digests[n]}\n".encode())
    return h.hexdigest()


def kvlab_metadata(header: dict) -> dict:
    """The safetensors ``__metadata__`` of a kvlab header: its JSON text and that text's sha256."""
    text = json.dumps(header, ensure_ascii=True, separators=(",", ":"), allow_nan=False)
    return {"kvlab": text, "kvlab_sha256": hashlib.sha256(text.encode()).hexdigest()}


# --------------------------------------------------------------------------- writing


def write_container(path: Path, tensors: list[tuple[str, torch.Tensor]], header: dict) -> None:
    """Write ``tensors`` and ``header`` (digests already filled in) to ``path``, atomically.

    Parameters
    ----------
    path : Path
    tensors : list of (str, torch.Tensor)
        Names and tensors, float64/32/16 or bfloat16.
    header : dict
        The kvlab header, written as it is.

    Raises
    ------
    CacheFileError
        ``path`` is a directory, a tensor has another dtype, or the file cannot be written.
    """
    if path.is_dir():
        raise CacheFileError(f"{path} is a directory; give save_cache a file name")
    for name, t in tensors:
        if t.dtype not in ST_NAME:
            raise CacheFileError(f"tensor {name} is {t.dtype}; cache files hold float64/32/16 or bfloat16")
    meta = kvlab_metadata(header)
    try:
        with atomic_path(path) as tmp:
            save_file({name: t.detach().contiguous() for name, t in tensors}, str(tmp), metadata=meta)
    except OSError as e:
        raise CacheFileError(f"cannot write {path}: {e.strerror or e}") from e
    except SafetensorError as e:
        raise CacheFileError(f"cannot write {path}: {e}") from e


# --------------------------------------------------------------------------- reading


@dataclass
class Entry:
    """One tensor of a container, as its safetensors header declares it."""

    name: str
    dtype: str  # safetensors name: F32, BF16, ...
    shape: list[int]


@dataclass
class Layout:
    """What a cache file holds, checked against its header (or, for a plain dump, inferred)."""

    start: int
    length: int
    dtype: torch.dtype
    layers: list[dict]  # type, window, kept, keys, values
    digests: dict | None
    token_ids: list[int] | None
    text: str | None


class Container:
    """An open safetensors cache file: its entries, kvlab header and tensors (read lazily).

    Use as a context manager; :meth:`tensor` returns a ``torch.Tensor`` over the mapped
    file (the library's zero-copy view), valid until the container is closed.
    """

    def __init__(self, path: Path, handle, entries: dict[str, Entry], header: dict | None):
        self.path, self._handle, self.entries, self.header = path, handle, entries, header

    def tensor(self, name: str) -> torch.Tensor:
        try:
            return self._handle.get_tensor(name)
        except Exception as e:  # noqa: BLE001 - the library's or torch's refusal of a hostile entry
            raise CacheFileError(f"{self.path}: cannot read tensor {name!r}: {e}") from None

    def close(self) -> None:
        self._handle.__exit__(None, None, None)

    def __enter__(self) -> Container:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_container(path) -> Container:
    """Open a cache file: refuse other formats, let safetensors parse it, check the kvlab header.

    Raises
    ------
    CacheFileError
        Missing, a directory, empty, a pickle or another format, a container the library
        refuses (truncated, corrupt), tensors other than float, or a bad kvlab header.
    """
    path = Path(os.fspath(path))
    head, tail, size = _peek(path)
    if size == 0:
        raise CacheFileError(f"{path} is empty (0 bytes): not a cache file, or a save that never wrote anything")
    refuse_foreign(head, path)
    hint = _pickle_hint(head, tail)
    if size < 8:
        raise CacheFileError(
            f"{path} is {size} bytes, shorter than the 8-byte header length that starts a "
            f"safetensors file: truncated{hint}"
        )
    n = int.from_bytes(head[:8], "little")
    if n > size - 8:
        raise CacheFileError(
            f"{path}: the header length field says {n} bytes, past the end of the file "
            f"({size - 8} bytes follow it): truncated or corrupt{hint}"
        )
    if n > MAX_HEADER_BYTES:
        raise CacheFileError(f"{path}: the header is {n} bytes, more than the {MAX_HEADER_BYTES} kvlab reads")
    handle = _safe_open(path, hint)
    try:
        entries = {}
        for name in handle.keys():
            sl = handle.get_slice(name)
            entries[name] = Entry(name, sl.get_dtype(), list(sl.get_shape()))
        for e in entries.values():
            if e.dtype not in ST_DTYPES:
                raise CacheFileError(
                    f"{path}: tensor {e.name!r} is {e.dtype}; KV cache tensors are F64, F32, F16 or BF16"
                )
        header = kvlab_header(handle.metadata(), path)
    except BaseException:
        handle.__exit__(None, None, None)
        raise
    return Container(path, handle, entries, header)


def _peek(path: Path) -> tuple[bytes, bytes, int]:
    """The first 16 and the last byte of a regular file, and its size."""
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
        head = os.pread(fd, 16, 0)
        tail = os.pread(fd, 1, st.st_size - 1) if st.st_size else b""
        return head, tail, st.st_size
    except OSError as e:
        raise CacheFileError(f"{path}: cannot read: {e.strerror or e}") from None
    finally:
        os.close(fd)


#: The library's messages for a container it refuses, in kvlab's words.
_LIBRARY_ERRORS = (
    ("incomplete metadata", "the header's tensors do not cover the data exactly: truncated, or bytes appended"),
    ("invalid header length", "the header is cut short: truncated or corrupt"),
    ("header too large", "the header is larger than safetensors reads"),
    ("header too small", "the header is too short for a safetensors header"),
    ("invalid header start", "the header does not start with a JSON object: corrupt"),
    ("invalid header", "the header is not valid UTF-8: corrupt"),
    ("invalid offset", "a tensor's data_offsets are invalid: corrupt"),
    ("deserializ", "the safetensors header is malformed: corrupt"),
)


def _safe_open(path: Path, hint: str):
    try:
        handle = safe_open(str(path), framework="pt")
        handle.__enter__()
        return handle
    except Exception as e:  # noqa: BLE001 - any refusal of the library is a bad file
        raise CacheFileError(f"{path}: {_explain(e)}{hint}") from None
    except BaseException as e:  # a Rust panic surfaces as pyo3's PanicException (a BaseException)
        if isinstance(e, (KeyboardInterrupt, SystemExit, GeneratorExit)):
            raise
        raise CacheFileError(f"{path}: {_explain(e)}{hint}") from None


def _explain(e: BaseException) -> str:
    msg = str(e) or type(e).__name__
    low = msg.lower()
    what = next((ours for key, ours in _LIBRARY_ERRORS if key in low), "not a valid safetensors container")
    return f"{what} (safetensors: {_short(msg, 200)})"


def refuse_foreign(head: bytes, path: Path) -> None:
    """Refuse pickles and other formats by their first bytes, before anything parses them."""
    # A safetensors header starts with '{' at byte 8; its 8-byte length can begin with 0x80.
    looks_safetensors = head[8:9] == b"{"
    if head[:1] == b"\x80" and len(head) >= 2 and 2 <= head[1] <= 5 and not looks_safetensors:
        raise CacheFileError(
            f"{path} is a Python pickle (protocol {head[1]}), not a kvlab cache file; kvlab never unpickles, because "
            "unpickling runs whatever code the file names (MemOS activation-memory dumps are such pickles). Rebuild the "
            "cache from its source text with kvlab.prefill and keep it with kvlab.save_cache"
        )
    if head[:4] == b"PK\x03\x04" and not looks_safetensors:
        try:
            with zipfile.ZipFile(path) as z:  # lists member names only; nothing is extracted
                names = z.namelist()
        except (zipfile.BadZipFile, OSError, ValueError, EOFError):
            names = []
        pickled = [n for n in names if n.endswith(".pkl")]
        if pickled:
            raise CacheFileError(
                f"{path} is a torch.save archive (a zip holding {pickled[0]}), not a kvlab cache file; kvlab never "
                "opens it, because reading it means unpickling, which runs whatever code the file names"
            )
        raise CacheFileError(f"{path} is a zip archive, not a kvlab cache file")
    if head[:6] == b"\x93NUMPY":
        raise CacheFileError(f"{path} is a NumPy .npy file, not a kvlab cache file")
    if head[:4] == b"GGUF":
        raise CacheFileError(f"{path} is a GGUF model file, not a kvlab cache file")


def _pickle_hint(head: bytes, tail: bytes) -> str:
    # Protocol 0/1 pickles have no magic number, but start with an opcode and end with STOP.
    if len(head) >= 2 and head[:1] in (b"(", b"}", b"]", b"c", b"K", b"X", b"V", b"S") and tail == b".":
        return "; it looks like a protocol 0/1 Python pickle, which kvlab never unpickles"
    return ""


class _Bad(Exception):
    pass


def _loads(text: str, what: str):
    """Strict JSON: no duplicate keys, no NaN or infinities, no constants JSON lacks."""

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


def _short(x, limit: int = 80) -> str:
    s = json.dumps(x, default=str) if not isinstance(x, str) else repr(x)
    return s if len(s) <= limit else s[: limit - 1] + "…"


def kvlab_header(meta: dict | None, path: Path) -> dict | None:
    """The verified kvlab header of a container's metadata, or ``None`` when it has none."""
    meta = meta or {}
    ours = sorted(k for k in meta if k.startswith("kvlab"))
    if not ours:
        return None
    if ours != ["kvlab", "kvlab_sha256"] or len(meta) != 2:
        raise CacheFileError(f"{path}: the metadata must hold exactly kvlab and kvlab_sha256, holds {sorted(meta)}")
    text = meta["kvlab"]
    if hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest() != meta["kvlab_sha256"]:
        raise CacheFileError(
            f"{path}: the kvlab header does not match its sha256: it was corrupted or edited after saving"
        )
    try:
        h = _loads(text, "the kvlab header")
    except _Bad as e:
        raise CacheFileError(f"{path}: {e}") from None
    return validate_header(h, path)


def validate_header(h, path: Path) -> dict:
    """Check every field of a kvlab header; return it, or raise :class:`CacheFileError` naming the field."""

    def bad(msg):
        return CacheFileError(f"{path}: kvlab header: {msg}")

    if not isinstance(h, dict):
        raise bad(f"is a JSON {type(h).__name__}, not an object")
    if h.get("format") != FORMAT:
        raise bad(f"format is {_short(h.get('format'))}, expected {FORMAT!r}")
    version = h.get("format_version")
    if version != FORMAT_VERSION or not _is_int(version):
        newer = " (written by a newer kvlab)" if _is_int(version) and version > FORMAT_VERSION else ""
        raise bad(
            f"format version {_short(version)} is not supported{newer}; this kvlab reads version {FORMAT_VERSION}"
        )
    missing = [k for k in HEADER_FIELDS if k not in h]
    extra = sorted(k for k in h if k not in HEADER_FIELDS)
    if missing or extra:
        raise bad(
            "; ".join(
                filter(
                    None,
                    [
                        missing and f"missing field(s) {', '.join(missing)}",
                        extra and f"unknown field(s) {', '.join(map(repr, extra))}",
                    ],
                )
            )
        )
    if h["producer"] is not None and not isinstance(h["producer"], dict):
        raise bad(f"producer must be a fingerprint object or null, is {type(h['producer']).__name__}")
    if not isinstance(h["model_name"], str):
        raise bad("model_name must be a string")
    if not _is_int(h["start"]):
        raise bad(f"start must be an integer >= 0, is {_short(h['start'])}")
    if not _is_int(h["length"], 1):
        raise bad(f"length must be an integer >= 1, is {_short(h['length'])}")
    if not isinstance(h["dtype"], str) or h["dtype"] not in TORCH_DTYPES:
        raise bad(f"dtype {_short(h['dtype'])} is not one of {', '.join(TORCH_DTYPES)}")
    length, layers = h["length"], h["layers"]
    if not isinstance(layers, list) or not layers:
        raise bad("layers must be a non-empty list")
    batch = None
    for i, L in enumerate(layers):
        if not isinstance(L, dict) or set(L) != LAYER_FIELDS:
            got = sorted(L) if isinstance(L, dict) else type(L).__name__
            raise bad(f"layer {i} must have exactly {', '.join(sorted(LAYER_FIELDS))}, has {got}")
        if L["type"] not in LAYER_TYPES:
            raise bad(f"layer {i} has unknown type {_short(L['type'])}")
        sliding = L["type"] == "sliding_attention"
        if sliding and not _is_int(L["window"], 2):
            raise bad(f"layer {i} is sliding but its window is {_short(L['window'])}")
        if not sliding and L["window"] is not None:
            raise bad(f"layer {i} is full attention but has a window {_short(L['window'])}")
        expect = min(length, L["window"] - 1) if sliding else length
        if L["kept"] != expect or not _is_int(L["kept"]):
            raise bad(
                f"layer {i} keeps {_short(L['kept'])} tokens; a {L['type']} layer of a {length}-token cache keeps {expect}"
            )
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
    names = tensor_names(len(layers))
    digests = h["tensors"]
    if h["tensor_digest"] != TENSOR_DIGEST:
        raise bad(f"tensor_digest {_short(h['tensor_digest'])} is not supported; this kvlab reads {TENSOR_DIGEST!r}")
    if not isinstance(digests, dict) or sorted(digests) != sorted(names):
        raise bad("tensors must map exactly " + ", ".join(names[:2]) + f", ... to their {TENSOR_DIGEST} digests")
    if not all(isinstance(d, str) and len(d) == DIGEST_HEX and set(d) <= HEX for d in digests.values()):
        raise bad(f"every tensor digest must be {DIGEST_HEX} lowercase hex digits")
    if h["content_digest"] != content_digest(names, digests):
        raise bad("content_digest does not match the tensor digests")
    return h


def check_tensors(box: Container) -> Layout:
    """Check that the file's tensors are exactly what its kvlab header describes."""
    h, path = box.header, box.path
    layers = h["layers"]
    names = tensor_names(len(layers))
    got = box.entries
    missing = [n for n in names if n not in got]
    extra = sorted(n for n in got if n not in set(names))
    if missing:
        raise CacheFileError(
            f"{path}: missing tensor(s) {', '.join(missing[:6])}{' ...' if len(missing) > 6 else ''} "
            f"that the header lists"
        )
    if extra:
        raise CacheFileError(f"{path}: unexpected tensor(s) {', '.join(map(repr, extra[:6]))} not in the header")
    st = ST_NAME[TORCH_DTYPES[h["dtype"]]]
    for i, L in enumerate(layers):
        for what in ("keys", "values"):
            e = got[f"layers.{i}.{what}"]
            if e.shape != L[what]:
                raise CacheFileError(
                    f"{path}: tensor {e.name} has shape {e.shape} in the file but {L[what]} in the header"
                )
            if e.dtype != st:
                raise CacheFileError(f"{path}: tensor {e.name} is {e.dtype} in the file but the header says {st}")
    return Layout(h["start"], h["length"], TORCH_DTYPES[h["dtype"]], layers, h["tensors"], h["token_ids"], h["text"])


def digest_error(path: Path, bad: list[str]) -> CacheFileError:
    return CacheFileError(
        f"{path}: the data of {', '.join(bad[:4])}{' ...' if len(bad) > 4 else ''} does not match "
        f"its {TENSOR_DIGEST} digest in the header: the file is corrupt or was altered after saving"
    )


def read_header(path) -> dict | None:
    """The verified kvlab header of a cache file (producer, start, tokens, text ...), without loading tensors.

    Returns ``None`` for a safetensors file without kvlab metadata. Raises
    :class:`CacheFileError` as :func:`kvlab.load_cache` does for a bad file; tensor digests
    are not checked (that needs the data, see :func:`verify_file`).
    """
    with open_container(path) as box:
        if box.header is not None:
            check_tensors(box)
        return box.header


def verify_file(path) -> dict | None:
    """Check a cache file's framing, header and every tensor digest, with no model at hand.

    For auditing stored caches: the same checks as :func:`kvlab.load_cache` except the
    fingerprint comparison (which needs the reader). Returns the header (``None`` for a
    plain safetensors file, which carries no digests to check).

    Raises
    ------
    CacheFileError
        Anything :func:`kvlab.load_cache` would call corrupt, truncated or tampered, naming
        the tensors whose data does not match the header.
    """
    with open_container(path) as box:
        if box.header is None:
            return None
        layout = check_tensors(box)
        bad = [
            name for name in tensor_names(len(layout.layers)) if tensor_digest(box.tensor(name)) != layout.digests[name]
        ]
        if bad:
            raise digest_error(box.path, bad)
        return box.header
