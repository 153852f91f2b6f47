"""Tokenizer digests and the small JSON files that keep digests beside a converted model.

This sits below :mod:`kvlab.models` because a GGUF conversion hashes its tokenizer once,
when it writes the folder (see :func:`store_tokenizer_digest`), and above nothing but the
standard library: :mod:`kvlab.files.identity` builds the fingerprint on top of it.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import tokenizers

from kvlab.atomic import atomic_write_text

#: Version of the fingerprint, and of the digest files kept in a conversion folder.
FINGERPRINT_VERSION = 1

HEX = frozenset("0123456789abcdef")

#: Files a Hugging Face tokenizer folder may hold; their size and mtime guard the kept digest.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
)


def canonical_json(obj) -> str:
    """Sorted, compact, ASCII JSON: equal values give equal text."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, default=str)


def is_hex64(s) -> bool:
    """Whether ``s`` is a sha256 hex digest (64 lowercase hex digits)."""
    return isinstance(s, str) and len(s) == 64 and set(s) <= HEX


def special_token_ids(tokenizer) -> dict:
    return {k: getattr(tokenizer, f"{k}_token_id", None) for k in ("bos", "eos", "pad", "unk")}


def tokenizer_signature(tokenizer) -> str:
    """Cheap facts that change whenever tokens are added or special tokens reassigned.

    They guard a remembered digest; they are not the digest.
    """
    return canonical_json(
        {
            "class": type(tokenizer).__name__,
            "len": len(tokenizer),
            "special": special_token_ids(tokenizer),
            "tokenizers": tokenizers.__version__,
        }
    )


def tokenizer_digest(tokenizer) -> str:
    """sha256 of the full tokenizer (vocabulary, merges, normalizer, added tokens) and its special ids."""
    h = hashlib.sha256(b"kvlab-tokenizer-v1\n")
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        trunc, pad = backend.truncation, backend.padding
        # Truncation and padding are call-time settings that HF leaves on the backend;
        # they do not change which ids a text maps to.
        try:
            if trunc is not None:
                backend.no_truncation()
            if pad is not None:
                backend.no_padding()
            h.update(backend.to_str().encode("utf-8", "surrogatepass"))
        finally:
            if trunc is not None:
                backend.enable_truncation(**trunc)
            if pad is not None:
                backend.enable_padding(**pad)
    else:
        h.update(canonical_json(sorted(tokenizer.get_vocab().items())).encode())
    h.update(canonical_json(special_token_ids(tokenizer)).encode())
    return h.hexdigest()


def read_folder_cache(path: Path | None) -> dict:
    """A digest file of a conversion folder, or ``{}`` when absent, unreadable or of another version."""
    if path is None:
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) and data.get("version") == FINGERPRINT_VERSION else {}


def write_folder_cache(path: Path | None, update: dict) -> None:
    """Merge ``update`` into a digest file, atomically; a read-only folder is left alone."""
    if path is None:
        return
    data = read_folder_cache(path)
    data.update(update, version=FINGERPRINT_VERSION)
    try:
        atomic_write_text(path, json.dumps(data, indent=1, sort_keys=True))
    except OSError:
        pass  # a read-only cache folder only costs a recomputation next time


def tokenizer_files_stat(folder: Path) -> dict:
    """``{file name: [size, mtime_ns]}`` of the tokenizer files present in ``folder``."""
    out = {}
    for name in TOKENIZER_FILES:
        try:
            st = (folder / name).stat()
        except OSError:
            continue
        out[name] = [st.st_size, st.st_mtime_ns]
    return out


def store_tokenizer_digest(folder, tokenizer, digest: str | None = None) -> str:
    """Hash ``tokenizer`` (loaded from ``folder``) and keep the digest in that folder.

    kvlab calls this once, when it converts a GGUF, so that later fingerprints of the
    model read the digest instead of serializing the tokenizer again. ``digest``: the
    tokenizer's :func:`tokenizer_digest`, when the caller has just computed it.
    """
    folder = Path(folder)
    if digest is None:
        digest = tokenizer_digest(tokenizer)
    entry = {"signature": tokenizer_signature(tokenizer), "sha256": digest, "files": tokenizer_files_stat(folder)}
    write_folder_cache(folder / "fingerprint-tokenizer.json", {"tokenizer": entry})
    return digest
