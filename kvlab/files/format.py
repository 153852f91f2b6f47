"""The cache-file format: a safetensors container with a kvlab header, and nothing about models.

Tensors ``layers.<i>.keys`` / ``layers.<i>.values`` ``[batch, kv_heads, kept, head_dim]``;
``__metadata__`` holds the kvlab header as JSON (``kvlab``, its fields described by
``header.schema.json``) and that text's sha256 (``kvlab_sha256``). The safetensors library
writes and parses the container; kvlab refuses pickles and other formats before it does,
checks the header (its schema and its fields against each other in :mod:`kvlab.files.header`;
here, against the tensors) and the XXH3-128 digest of every tensor. Why it is built so:
``docs/cache-file-format.md``.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
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
from kvlab.files.header import (
    MAX_LAYERS,
    TENSORS_RULE,
    brief,
    header_error,
    listed,
    parse_header,
    validate_header,
)
from kvlab.files.identity import tensor_bytes

#: The digest of each tensor's bytes (why not sha256: ``docs/cache-file-format.md``).
TENSOR_DIGEST = "xxh3-128"
#: Headers longer than this are refused before being parsed (safetensors itself allows 100 MB).
MAX_HEADER_BYTES = 64 << 20
#: A header may also be at most this plus an eighth of the tensor data it describes. Parsed
#: JSON takes many times its size in Python objects; a header that is small beside its data
#: keeps a read within a few times the file's size, and a real cache's header is far smaller
#: than its keys and values (the figures: ``docs/cache-file-format.md``, "Bounds on work").
HEADER_FLOOR = 128 << 10


def header_allowance(data_bytes: int) -> int:
    """The longest header kvlab reads (or writes) before ``data_bytes`` of tensor data."""
    return min(MAX_HEADER_BYTES, HEADER_FLOOR + data_bytes // 8)


#: The safetensors dtypes a KV cache may hold, and their torch dtypes.
ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
ST_NAME = {v: k for k, v in ST_DTYPES.items()}
TORCH_DTYPES = {str(v).removeprefix("torch."): v for v in ST_DTYPES.values()}


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
        # The library writes a temporary of its own beside the name it is given and renames
        # it; in a private folder, what a kill leaves goes with the folder (kvlab.atomic).
        with atomic_path(path, private_folder=True) as tmp:
            save_file({name: t.detach().contiguous() for name, t in tensors}, str(tmp), metadata=meta)
            _check_written(tmp, path)
    except OSError as e:
        raise CacheFileError(f"cannot write {path}: {e.strerror or e}") from e
    except SafetensorError as e:
        raise CacheFileError(f"cannot write {path}: {e}") from e


def _check_written(tmp: Path, path: Path) -> None:
    # Never write what open_container refuses: a header too long for its data (a long text
    # beside few, small tensors) is refused here, before the rename, and the old file kept.
    with open(tmp, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
    data = tmp.stat().st_size - 8 - n
    if n > header_allowance(data):
        raise CacheFileError(
            f"refusing to save {path}: its header would be {n} bytes for {data} bytes of tensors, more than "
            f"load_cache reads ({HEADER_FLOOR >> 10} KiB plus an eighth of the data); store long texts elsewhere"
        )


#: How the safetensors library (Rust's ``tempfile`` crate) names the file it writes before
#: renaming it over the name it was given.
_LIBRARY_TEMP = re.compile(r"^\.tmp[A-Za-z0-9]{6}$")
#: The start of a safetensors header whose metadata is a kvlab header: the library writes
#: ``__metadata__`` first, and kvlab's holds only ``kvlab`` and ``kvlab_sha256``, in either order.
_KVLAB_START = b'{"__metadata__":{"kvlab'


def is_library_temporary(path: Path) -> bool:
    """Whether ``path`` is named as the safetensors library names its temporary files (``.tmpXXXXXX``)."""
    return bool(_LIBRARY_TEMP.match(Path(path).name))


def stray_library_temporaries(folder: Path) -> list[Path]:
    """Files in ``folder`` that the safetensors library began for a kvlab save and never renamed.

    Named as the library names its temporaries, and starting with a safetensors header that
    holds a kvlab header. kvlab now runs the library inside a private temporary folder
    (:func:`write_container`), so these were left by an earlier kvlab, or belong to a save of
    one still running: their names carry no process id, so kvlab lists them (``kvlab
    inspect``) and never deletes them. A file the library had not yet begun to fill cannot be
    told from anyone else's and is not listed.

    Parameters
    ----------
    folder : Path

    Returns
    -------
    list of Path
        Sorted by name; empty if ``folder`` cannot be read.
    """
    out = []
    try:
        entries = list(Path(folder).iterdir())
    except OSError:
        return []
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    for p in entries:
        if not is_library_temporary(p):
            continue
        try:  # O_NONBLOCK: a FIFO under such a name must not hang the listing
            fd = os.open(p, flags)
        except OSError:  # gone meanwhile, a link, or unreadable: not one to vouch for
            continue
        try:
            head = os.pread(fd, 8 + len(_KVLAB_START), 0) if stat.S_ISREG(os.fstat(fd).st_mode) else b""
        except OSError:
            head = b""
        finally:
            os.close(fd)
        if head[8:] == _KVLAB_START:
            out.append(p)
    return sorted(out)


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
    if n > header_allowance(size - 8 - n):
        raise CacheFileError(
            f"{path}: the header is {n} bytes for {size - 8 - n} bytes of tensor data, more than a cache's header "
            f"takes (kvlab reads at most {HEADER_FLOOR >> 10} KiB plus an eighth of the data): corrupt{hint}"
        )
    handle = _safe_open(path, hint)
    try:
        names = handle.keys()
        if len(names) > 2 * MAX_LAYERS:  # refused before each entry is read: a bound on the work
            raise CacheFileError(
                f"{path} holds {len(names)} tensors, more than the {2 * MAX_LAYERS} of a cache of "
                f"{MAX_LAYERS} layers, the most kvlab reads"
            )
        entries = {}
        for name in names:
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
    return f"{what} (safetensors: {brief(msg, 200)})"


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


def kvlab_header(meta: dict | None, path: Path) -> dict | None:
    """The verified kvlab header of a container's metadata, or ``None`` when it has none."""
    meta = meta or {}
    ours = sorted(k for k in meta if k.startswith("kvlab"))
    if not ours:
        return None
    if ours != ["kvlab", "kvlab_sha256"] or len(meta) != 2:
        raise CacheFileError(
            f"{path}: the metadata must hold exactly kvlab and kvlab_sha256, holds {listed(map(repr, sorted(meta)))}"
        )
    text = meta["kvlab"]
    if hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest() != meta["kvlab_sha256"]:
        raise CacheFileError(
            f"{path}: the kvlab header does not match its sha256: it was corrupted or edited after saving"
        )
    h = validate_header(parse_header(text, path), path)
    # What only the container's naming can check: the tensors the header lists, and their joint digest.
    names = tensor_names(len(h["layers"]))
    if sorted(h["tensors"]) != sorted(names):
        raise header_error(path, TENSORS_RULE)
    if h["content_digest"] != content_digest(names, h["tensors"]):
        raise header_error(path, "content_digest does not match the tensor digests")
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
