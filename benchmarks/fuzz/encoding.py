"""Writing a cache file's parts back as bytes: the safetensors container, the kvlab header, re-signed digests."""

from __future__ import annotations

import hashlib
import json

import torch
import xxhash

from kvlab.files.format import content_digest, tensor_names


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
