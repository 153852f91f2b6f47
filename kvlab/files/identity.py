"""Producer fingerprints: which weights, tokenizer, dtype and geometry made a KV cache.

:func:`fingerprint` names the model that computed a cache in a JSON-ready dict: the fields of
``STRICT_FIELDS``, which a cache file must match (see :func:`kvlab.load_cache`), and ``info``
(library versions, recorded, never compared). :func:`compare` lists how two fingerprints
differ, one :class:`Difference` per field. The tokenizer and weights digests are remembered
per live object and in kvlab's conversion folder; ``recompute=True`` hashes everything.

Why each field is strict, and what the digests cost: ``docs/cache-files.md``.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import os
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from kvlab.cache.fragments import new_cache
from kvlab.compat import rope_parameters
from kvlab.models.digests import (
    FINGERPRINT_VERSION,
    is_hex64,
    read_folder_cache,
    store_tokenizer_digest,
    tokenizer_digest,
    tokenizer_files_stat,
    tokenizer_signature,
    write_folder_cache,
)
from kvlab.models.digests import canonical_json as _canonical
from kvlab.models.layout import cache_dims, layer_ropes

#: Fields whose difference refuses a cache file (docs/cache-files.md says why).
STRICT_FIELDS = (
    "source",
    "source_sha256",
    "architecture",
    "config_sha256",
    "tokenizer_sha256",
    "dtype",
    "quantization",
    "geometry",
    "weights_sha256",
)

#: Sub-fields of ``geometry``, each compared (and reported) on its own.
GEOMETRY_FIELDS = ("num_layers", "layer_types", "kv_heads", "head_dim", "sliding_window", "rope")

#: Config keys that describe the run or the library, not the function the model computes.
#: Keys starting with ``_`` (``_name_or_path``, ``_attn_implementation`` ...) are dropped too.
VOLATILE_CONFIG_KEYS = frozenset(
    {
        "transformers_version",
        "dtype",  # its own strict field
        "torch_dtype",
        "architectures",  # its own strict field
        "quantization_config",  # its own strict field
        "use_cache",
        "output_attentions",
        "output_hidden_states",
        "return_dict",
    }
)

_MISSING = object()


# --------------------------------------------------------------------------- hashing


_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()
# Below this many bytes in total, thread hand-off costs more than it saves.
_PARALLEL_MIN_BYTES = 8 << 20


def _pool() -> ThreadPoolExecutor | None:
    global _POOL
    workers = min(4, os.cpu_count() or 1)
    if workers < 2:
        return None
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kvlab-sha256")
        return _POOL


def _sha256_hex(buf) -> str:
    return hashlib.sha256(buf).hexdigest()


def sha256_many(buffers: list) -> list[str]:
    """sha256 hex digests of byte buffers, in order.

    hashlib releases the GIL on large buffers, so when there is enough to hash the
    buffers go to a small thread pool, largest first (the longest job starts first).
    """
    sizes = [memoryview(b).nbytes for b in buffers]
    pool = _pool() if sum(sizes) >= _PARALLEL_MIN_BYTES else None
    if pool is None:
        return [_sha256_hex(b) for b in buffers]
    futures: list = [None] * len(buffers)
    for i in sorted(range(len(buffers)), key=lambda i: -sizes[i]):
        futures[i] = pool.submit(_sha256_hex, buffers[i])
    return [f.result() for f in futures]


def tensor_bytes(t: torch.Tensor):
    """A zero-copy ``uint8`` NumPy view of a contiguous CPU tensor's bytes."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous().reshape(-1)
    return t.view(torch.uint8).numpy()


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# --------------------------------------------------------------------------- fields


def config_digest(config) -> str:
    """sha256 of the canonical config JSON, without volatile or ``_private`` keys."""
    return hashlib.sha256(_canonical(_strip_config(config.to_dict())).encode()).hexdigest()


def _strip_config(obj):
    if isinstance(obj, dict):
        return {
            k: _strip_config(v)
            for k, v in obj.items()
            if not (isinstance(k, str) and (k.startswith("_") or k in VOLATILE_CONFIG_KEYS))
        }
    if isinstance(obj, (list, tuple)):
        return [_strip_config(v) for v in obj]
    return obj


_GEOMETRY_MEMO: weakref.WeakKeyDictionary[torch.nn.Module, tuple[str, dict]] = weakref.WeakKeyDictionary()


def cache_geometry(model) -> dict:
    """What each cache layer of ``model`` holds.

    Returns
    -------
    dict
        ``num_layers``; ``layer_types`` (``full_attention`` / ``sliding_attention`` per
        layer, as ``DynamicCache(config=...)`` builds them); ``kv_heads``; ``head_dim``
        (keys and values are ``[batch, kv_heads, kept, head_dim]``); ``value_dim`` only where
        values are another width (latent attention: see :func:`kvlab.models.layout.cache_dims`); ``sliding_window``
        (``None`` without sliding layers); ``rope``: per layer type, the rope type,
        rotary_dim, attention scaling and the config's rope parameters (``None`` for a
        model without rotary embeddings).
    """
    config = model.config.get_text_config()
    layers = new_cache(model.config).layers
    types = ["sliding_attention" if layer.is_sliding else "full_attention" for layer in layers]
    windows = sorted({int(layer.sliding_window) for layer in layers if layer.is_sliding})
    kv_heads, head_dim, value_dim = cache_dims(config)
    try:
        ropes = layer_ropes(model.model)
    except Exception:  # noqa: BLE001 - no rotary module: a model without RoPE
        ropes = None
    rope = None
    if ropes is not None:
        params = rope_parameters(config)
        rope = {}
        for r in ropes:
            if r.layer_type in rope:
                continue
            p = params.get(r.layer_type, params) if isinstance(params, dict) else {}
            entry = {k: v for k, v in p.items() if isinstance(v, (int, float, str, list, type(None)))}
            entry.update(rope_type=r.rope_type, rotary_dim=r.rotary_dim, attention_scaling=float(r.attention_scaling))
            rope[r.layer_type] = entry
    geo = {
        "num_layers": len(layers),
        "layer_types": types,
        "kv_heads": kv_heads,
        "head_dim": head_dim,
        "sliding_window": (windows[0] if len(windows) == 1 else windows) if windows else None,
        "rope": rope,
    }
    if value_dim != head_dim:
        # Only where they differ (a latent-attention cache), so every other fingerprint stays as it was.
        geo["value_dim"] = value_dim
    return geo


def _geometry_cached(model, config_sha: str) -> dict:
    # Geometry follows from the config (the rotary modules are built from it); a load
    # fingerprints its reader every time, so it is remembered per module and config digest.
    # The memo is shared: callers copy it (fingerprint() round-trips through JSON).
    memo = _GEOMETRY_MEMO.get(model.model)
    if memo is None or memo[0] != config_sha:
        memo = _GEOMETRY_MEMO[model.model] = (config_sha, cache_geometry(model))
    return memo[1]


def weights_digest(module: torch.nn.Module) -> str:
    """sha256 over every tensor of ``module.state_dict()``, in sorted-name order.

    Each tensor's bytes are hashed on their own (in parallel for large models); the digest
    is the sha256 of one line per tensor, ``name, dtype, shape, sha256(bytes)``. A tensor
    that shares storage with an earlier one (tied embeddings) is recorded as an alias of
    it, so tying is part of the identity and shared bytes are hashed once.
    """
    state = module.state_dict()
    lines: list[str] = []
    jobs: list[tuple[int, torch.Tensor]] = []
    seen: dict[tuple, str] = {}
    for name in sorted(state):
        t = state[name].detach()
        # The alias key is taken before any copy to the CPU, which would break the sharing.
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype, t.device)
        if t.numel() and key in seen:
            lines.append(f"{name}\talias\t{seen[key]}\n")
            continue
        seen[key] = name
        jobs.append((len(lines), t))
        lines.append(f"{name}\t{_dtype_name(t.dtype)}\t{list(t.shape)}\t")
    digests = sha256_many([tensor_bytes(t) for _, t in jobs])
    for (i, _), d in zip(jobs, digests):
        lines[i] += d + "\n"
    h = hashlib.sha256(b"kvlab-weights-v1\n")
    for line in lines:
        h.update(line.encode())
    return h.hexdigest()


def _sample_digest(state: dict) -> str:
    # Three 256-byte windows per tensor: enough to notice a different checkpoint or a
    # re-cast, cheap enough (about a millisecond) to run on every new process.
    h = hashlib.sha256(b"kvlab-weights-sample-v1\n")
    for name in sorted(state):
        t = state[name].detach()
        h.update(f"{name}\t{_dtype_name(t.dtype)}\t{list(t.shape)}\n".encode())
        b = tensor_bytes(t)
        n = b.nbytes
        for at in {0, max(0, n // 2 - 128), max(0, n - 256)}:
            h.update(b[at : at + 256])
    return h.hexdigest()


# --------------------------------------------------------------------------- caching

_TOKENIZER_MEMO: weakref.WeakKeyDictionary[object, tuple[str, str]] = weakref.WeakKeyDictionary()
_WEIGHTS_MEMO: weakref.WeakKeyDictionary[torch.nn.Module, tuple[tuple, str]] = weakref.WeakKeyDictionary()


def _model_folder(model) -> Path | None:
    """Where remembered digests of a model loaded unchanged live, else None.

    The conversion-cache folder of a catalogue or GGUF model; for a user's own folder a
    kvlab cache folder named by its file digest (the user's folder is never written to).
    """
    source = model.source or {}
    folder = source.get("folder") or source.get("fingerprint_dir")
    if not folder or source.get("variant") or source.get("derived"):
        return None
    return Path(folder)


def _tokenizer_digest_cached(model, recompute: bool) -> str:
    tok = model.tokenizer
    sig = tokenizer_signature(tok)
    memo = _TOKENIZER_MEMO.get(tok)
    if memo is not None and memo[0] == sig and not recompute:
        return memo[1]
    folder = _model_folder(model)
    if folder is None:
        digest = tokenizer_digest(tok)
    else:
        entry = read_folder_cache(folder / "fingerprint-tokenizer.json").get("tokenizer", {})
        if (
            not recompute
            and entry.get("signature") == sig
            and is_hex64(entry.get("sha256"))
            and entry.get("files") == tokenizer_files_stat(folder)
        ):
            digest = entry["sha256"]
        else:
            digest = store_tokenizer_digest(folder, tok, tokenizer_digest(tok))
    _TOKENIZER_MEMO[tok] = (sig, digest)
    return digest


def _weights_digest_cached(model, recompute: bool) -> str:
    module = model.model
    state = module.state_dict()
    sig = tuple((n, t.data_ptr(), t.dtype, tuple(t.shape), t._version) for n, t in state.items())
    memo = _WEIGHTS_MEMO.get(module)
    if memo is not None and memo[0] == sig and not recompute:
        return memo[1]
    folder = _model_folder(model)
    path = None if folder is None else folder / f"fingerprint-{_dtype_name(model.dtype)}.json"
    # from_pretrained leaves every version counter at 0; any in-place edit since loading
    # bumps one, and then the folder's digest (of the weights as converted) cannot be trusted.
    pristine = all(t._version == 0 for t in state.values())
    entry = read_folder_cache(path).get("weights", {}) if pristine else {}
    digest = None
    if entry and not recompute and is_hex64(entry.get("sha256")):
        if entry.get("sample_sha256") == _sample_digest(state):
            digest = entry["sha256"]
    if digest is None:
        digest = weights_digest(module)
        # Only a first entry is written: a model whose samples disagree with an existing
        # entry is not the converted one, and must not overwrite its digest.
        if pristine and not entry:
            write_folder_cache(path, {"weights": {"sha256": digest, "sample_sha256": _sample_digest(state)}})
    _WEIGHTS_MEMO[module] = (sig, digest)
    return digest


# --------------------------------------------------------------------------- public


def _source(model) -> tuple[str, str | None]:
    s = model.source or {}
    if s.get("gguf_file"):
        # A GGUF from outside the catalogue has no package; its sha256 identifies it.
        base = f"gguf:{s['package']}/{s['gguf_file']}" if s.get("package") else f"gguf:{s['gguf_file']}"
    elif s.get("kind") == "folder":
        # The folder's name, not its path: a moved folder keeps its caches; its files' digest
        # (source_sha256) tells two checkpoints of the same name apart.
        base = f"folder:{s['name']}"
    elif s.get("kind") == "tiny":
        base = f"tiny:{s.get('name', model.name)}"
    else:
        base = f"{s.get('kind', 'model')}:{s.get('name', model.name)}"
    if s.get("derived"):
        base += f" + {s['derived']}"
    return base, s.get("gguf_sha256") or s.get("files_sha256")


@functools.cache
def package_versions(*dists: str) -> dict:
    """``{distribution: installed version or None}``, read once per process.

    importlib.metadata reads files on every call (about 10 ms); versions do not change in a process.
    """
    out = {}
    for dist in dists:
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = None
    return out


def fingerprint(model, *, weights: bool = True, recompute: bool = False) -> dict:
    """Who a KV cache made by ``model`` comes from, as a JSON-ready dict.

    Parameters
    ----------
    model : LoadedModel
    weights : bool
        Include ``weights_sha256`` (hashes every weight once per process, less when kept
        in the conversion-cache folder). ``False`` leaves it ``None``.
    recompute : bool
        Ignore remembered tokenizer and weights digests and hash everything again.

    Returns
    -------
    dict
        ``fingerprint_version``, the strict fields of :data:`STRICT_FIELDS` and ``info``
        (versions and names, never compared). A fresh dict on every call.
    """
    source, source_sha = _source(model)
    config_sha = config_digest(model.config)
    fp = {
        "fingerprint_version": FINGERPRINT_VERSION,
        "source": source,
        "source_sha256": source_sha,
        "architecture": type(model.model).__name__,
        "config_sha256": config_sha,
        "tokenizer_sha256": _tokenizer_digest_cached(model, recompute),
        "dtype": _dtype_name(model.dtype),
        "quantization": (model.source or {}).get("quantization") or "none",
        "geometry": _geometry_cached(model, config_sha),
        "weights_sha256": _weights_digest_cached(model, recompute) if weights else None,
        "info": dict(
            package_versions("kvlab", "transformers", "torch", "tokenizers", "safetensors"),
            model_name=model.name,
            variant=(model.source or {}).get("variant"),
        ),
    }
    # Round-trip through JSON so a live fingerprint compares equal to one read from a file.
    return json.loads(json.dumps(fp))


@dataclass(frozen=True)
class Difference:
    """One strict field that differs between a cache file's producer and a live model."""

    field: str
    file: object
    model: object

    def __str__(self) -> str:
        return f"{self.field}: file {show(self.file)}, model {show(self.model)}"


def show(value, limit: int = 160) -> str:
    """A short human form of a fingerprint value (digests cut to 16 hex digits)."""
    if value is _MISSING:
        return "(absent)"
    if value is None:
        return "none"
    if is_hex64(value):
        return value[:16] + "…"
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        runs: list[list] = []
        for v in value:
            if runs and runs[-1][0] == v:
                runs[-1][1] += 1
            else:
                runs.append([v, 1])
        text = "[" + ", ".join(v if n == 1 else f"{n}x {v}" for v, n in runs) + "]"
    elif isinstance(value, str):
        text = value
    else:
        text = _canonical(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def compare(file_fp, live_fp: dict) -> list[Difference]:
    """Every strict field in which ``file_fp`` differs from ``live_fp``.

    ``geometry`` is compared per sub-field. A live ``weights_sha256`` of ``None`` (computed
    with ``weights=False``) is not compared. Values compare as canonical JSON, so a file
    cannot pass ``1.0`` for ``1`` or ``true`` for ``1``.
    """
    if not isinstance(file_fp, dict):
        return [Difference("fingerprint", file_fp, "a fingerprint dict")]
    out = []
    for field in STRICT_FIELDS:
        a, b = file_fp.get(field, _MISSING), live_fp.get(field)
        if field == "weights_sha256" and b is None:
            continue
        if field == "geometry" and isinstance(a, dict) and isinstance(b, dict):
            for g in GEOMETRY_FIELDS:
                ga, gb = a.get(g, _MISSING), b.get(g)
                if ga is _MISSING or _canonical(ga) != _canonical(gb):
                    out.append(Difference(f"geometry.{g}", ga, gb))
            # Present only where values are narrower than keys (latent attention): absent on both sides is equal.
            va, vb = a.get("value_dim"), b.get("value_dim")
            if _canonical(va) != _canonical(vb):
                out.append(Difference("geometry.value_dim", va, vb))
            continue
        if a is _MISSING or _canonical(a) != _canonical(b):
            out.append(Difference(field, a, b))
    return out
