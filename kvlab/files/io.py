"""Cache files against a model: save a Fragment with its producer's fingerprint, load it into a reader.

The format itself is :mod:`kvlab.files.format` (the container) and :mod:`kvlab.files.header`.
Before saving, the cache is checked against the model that made it; before loading, the file
against the model that reads it (fingerprint, geometry, positions, vocabulary), then every
tensor's digest as it lands in the new cache. Nothing here unpickles.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import torch
from transformers import DynamicCache

from kvlab.cache.fragments import Fragment, new_cache, set_length
from kvlab.compat import layer_ready
from kvlab.errors import CacheFileError, CacheFileWarning, FingerprintMismatch
from kvlab.files.format import (
    ST_DTYPES,
    TENSOR_DIGEST,
    Container,
    Layout,
    check_tensors,
    content_digest,
    digest_error,
    open_container,
    tensor_digest,
    tensor_names,
    write_container,
)
from kvlab.files.header import FORMAT, FORMAT_VERSION
from kvlab.files.identity import Difference, compare, fingerprint
from kvlab.models.loaded import LoadedModel

__all__ = ["load_cache", "load_with_differences", "save_cache"]


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
        raise FingerprintMismatch(
            f"the fragment was made by {frag.model_name!r} but save_cache was given {model.name!r}; "
            "the file would name the wrong producer"
        )
    layers = frag.cache.layers
    if len(layers) != geo["num_layers"]:
        raise FingerprintMismatch(f"{where} has {len(layers)} layers, the model has {geo['num_layers']}")
    for i, layer in enumerate(layers):
        if not layer_ready(layer) and getattr(layer, "keys", None) is not None and layer.keys.numel():
            raise CacheFileError(
                f"refusing to save: layer {i} holds tensors but was never initialized, so transformers reads it as "
                "empty and drops its tokens (a cache built by assigning .keys); build caches through cache.update"
            )
    length = frag.cache.get_seq_length()
    if length < 1:
        raise CacheFileError("refusing to save an empty cache (0 tokens)")
    for i, layer in enumerate(layers):
        if not layer_ready(layer) or layer.keys is None or layer.keys.numel() == 0:
            raise CacheFileError(f"refusing to save: layer {i} of the cache is empty (the cache holds {length} tokens)")
        kind = "sliding_attention" if layer.is_sliding else "full_attention"
        if kind != geo["layer_types"][i]:
            raise FingerprintMismatch(f"{where}: layer {i} is {kind}, the model's is {geo['layer_types'][i]}")
        k, v = layer.keys, layer.values
        wants = {what: [k.shape[0], geo["kv_heads"], k.shape[2], dim] for what, dim in _dims(geo).items()}
        for what, t in (("keys", k), ("values", v)):
            want = wants[what]
            if t.ndim != 4 or list(t.shape) != want:
                raise FingerprintMismatch(f"{where}: layer {i} {what} are {list(t.shape)}, the model makes {want}")
            if t.dtype != model.dtype:
                raise FingerprintMismatch(f"{where}: layer {i} {what} are {t.dtype}, the model computes {model.dtype}")
        kept = k.shape[2]
        expect = min(length, layer.sliding_window - 1) if layer.is_sliding else length
        if kept != expect or layer.get_seq_length() != length:
            raise CacheFileError(
                f"refusing to save: layer {i} keeps {kept} of {layer.get_seq_length()} tokens, "
                f"expected {expect} of {length}"
            )


def _describe(frag: Fragment, producer: dict) -> tuple[dict, list[tuple[str, torch.Tensor]]]:
    layers, tensors = [], []
    for i, layer in enumerate(frag.cache.layers):
        k, v = layer.keys, layer.values
        layers.append(
            {
                "type": "sliding_attention" if layer.is_sliding else "full_attention",
                "window": int(layer.sliding_window) if layer.is_sliding else None,
                "kept": int(k.shape[2]),
                "keys": list(k.shape),
                "values": list(v.shape),
            }
        )
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


def _write_file(path: Path, tensors: list[tuple[str, torch.Tensor]], header: dict, fill_digests: bool = True) -> None:
    """Write a cache file atomically, after filling in the per-tensor and content digests.

    ``fill_digests=False`` writes ``header`` as it is (tests use it to write edited headers).
    """
    # One host copy per tensor, hashed and written: from an accelerator, hashing and the
    # library's writer would each copy it to the CPU otherwise.
    tensors = [(name, t.detach().cpu().contiguous()) for name, t in tensors]
    if fill_digests:
        digests = {name: tensor_digest(t) for name, t in tensors}
        header["tensors"] = digests
        header["content_digest"] = content_digest([name for name, _ in tensors], digests)
    write_container(path, tensors, header)


# --------------------------------------------------------------------------- reading


def _plain_layout(box: Container, model: LoadedModel) -> Layout:
    """Layout of a safetensors KV dump without kvlab metadata (only with ``allow_unverified``)."""
    got, path = box.entries, box.path
    n = len(got) // 2
    names = tensor_names(n)
    if not got or sorted(got) != sorted(names):
        raise CacheFileError(
            f"{path} has no kvlab header and its tensors are not named layers.<i>.keys / "
            f"layers.<i>.values (found {', '.join(map(repr, sorted(got)[:4])) or 'none'}): not a KV cache"
        )
    dtypes = {e.dtype for e in got.values()}
    if len(dtypes) != 1:
        raise CacheFileError(f"{path}: tensors mix dtypes {sorted(dtypes)}")
    live = new_cache(model.config).layers
    layers = []
    for i in range(n):
        k, v = got[f"layers.{i}.keys"].shape, got[f"layers.{i}.values"].shape
        if len(k) != 4 or len(v) != 4 or k[:3] != v[:3] or 0 in k:
            raise CacheFileError(
                f"{path}: layer {i} keys {k} and values {v} are not [batch, kv_heads, tokens, head_dim]"
            )
        sliding = i < len(live) and live[i].is_sliding
        layers.append(
            {
                "type": "sliding_attention" if sliding else "full_attention",
                "window": int(live[i].sliding_window) if sliding else None,
                "kept": k[2],
                "keys": k,
                "values": v,
            }
        )
    batches = sorted({L["keys"][0] for L in layers})
    if len(batches) != 1:  # a kvlab header is held to one batch size (validate_header); so is a plain dump
        raise CacheFileError(f"{path}: its layers hold different batch sizes {batches}: not one KV cache")
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
            raise CacheFileError(
                f"{path}: sliding layer {i} holds {L['kept']} tokens; a {length}-token cache keeps "
                f"{min(length, L['window'] - 1)}"
            )
    return Layout(0, length, ST_DTYPES[dtypes.pop()], layers, None, None, None)


def _fit(layout: Layout, model: LoadedModel, live: dict) -> list[str]:
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
            out.append(
                f"layer {i} is {L['type']} (window {L['window']}) in the file, {kind} (window {window}) in {model.name}"
            )
            continue
        for what, dim in _dims(geo).items():
            s = L[what]
            want = [s[0], geo["kv_heads"], s[2], dim]
            if s != want:
                out.append(f"layer {i} {what} are {s} in the file, {model.name} needs {want}")
    text_config = model.config.get_text_config()
    limit = getattr(text_config, "max_position_embeddings", None)
    if limit is not None and layout.start + layout.length > limit:
        out.append(
            f"the cache reaches position {layout.start + layout.length - 1}, past {model.name}'s "
            f"max_position_embeddings={limit}"
        )
    vocab = getattr(text_config, "vocab_size", None)
    if layout.token_ids and vocab is not None and max(layout.token_ids) >= vocab:
        out.append(f"token id {max(layout.token_ids)} is outside {model.name}'s vocabulary of {vocab}")
    return out


def _build(box: Container, layout: Layout, model: LoadedModel) -> Fragment:
    """Copy the tensors into a new cache and check their digests.

    The digests are computed over the cache's own copies, not over the file, so a file
    changed during the load cannot slip unverified bytes into the result. Each copy is
    hashed right after it is made, while it is still in the CPU's caches.
    """
    # Where the cache holds exactly the file's bytes (same dtype, on the CPU), hash the
    # cache; otherwise (a cast, another device) hash a private copy taken before converting.
    # LoadedModel.dtype/device walk the parameters; read them once, not per tensor.
    dtype, device = model.dtype, model.device
    same_bytes = layout.dtype == dtype and device.type == "cpu"
    # Hashed inline, while the fresh copy is still in the CPU's caches: a worker thread per
    # tensor measured slower (benchmarks/README.md, "Cache files").
    bad: list[str] = []

    def check(name: str, t: torch.Tensor) -> None:
        if tensor_digest(t) != layout.digests[name]:
            bad.append(name)

    cache = new_cache(model.config)
    for i in range(len(layout.layers)):
        pair = []
        for what in ("keys", "values"):
            name = f"layers.{i}.{what}"
            t = box.tensor(name)  # the library's view of the mapped file; update() below copies it
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
        raise digest_error(box.path, bad)
    ids = torch.tensor(layout.token_ids, dtype=torch.long) if layout.token_ids is not None else None
    return Fragment(
        cache=cache, token_ids=ids, text=layout.text, start=layout.start, model_name=model.name, config=model.config
    )


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
    return load_with_differences(path, model, strict=strict, allow_unverified=allow_unverified)[0]


def load_with_differences(
    path, model: LoadedModel, *, strict: bool = True, allow_unverified: bool = False
) -> tuple[Fragment, list[Difference] | None]:
    """:func:`load_cache`, also returning the fingerprint differences (``None``: no producer recorded)."""
    if not isinstance(model, LoadedModel):
        raise CacheFileError(f"load_cache needs the reading kvlab.LoadedModel, got {type(model).__name__}")
    with open_container(path) as box:
        return _load(box, model, strict, allow_unverified)


def _load(
    box: Container, model: LoadedModel, strict: bool, allow_unverified: bool
) -> tuple[Fragment, list[Difference] | None]:
    path, h = box.path, box.header
    live = fingerprint(model)
    notes: list[str] = []
    diffs: list[Difference] = []
    unknown = h is None or h["producer"] is None
    if unknown:
        if not allow_unverified:
            raise FingerprintMismatch(
                f"{path} carries no producer fingerprint, so nothing says which weights, tokenizer and dtype made it; "
                "kvlab refuses it. Rebuild the cache from its source text, or pass allow_unverified=True to load it "
                "unverified"
            )
        notes.append("it carries no producer fingerprint: the model, tokenizer and dtype that made it are unknown")
        if h is None:
            notes.append("it has no kvlab header: no content digest, start position, tokens or text")
        layout = _plain_layout(box, model) if h is None else check_tensors(box)
    else:
        layout = check_tensors(box)
        diffs = compare(h["producer"], live)
        if diffs and strict:
            raise FingerprintMismatch(_mismatch_message(path, model, diffs, h), diffs)
        notes += [str(d) for d in diffs]
    problems = _fit(layout, model, live)
    if problems:
        lines = "\n  ".join(problems[:6] + (["..."] if len(problems) > 6 else []))
        listed = "".join(f"\n  {d}" for d in diffs)
        raise FingerprintMismatch(
            f"{path} cannot serve as a cache of {model.name}, even with strict=False:\n  {lines}"
            + (f"\nfingerprint differences:{listed}" if listed else ""),
            diffs,
        )
    if layout.dtype != model.dtype:
        notes.append(
            f"its {str(layout.dtype).removeprefix('torch.')} tensors were cast to "
            f"{str(model.dtype).removeprefix('torch.')}"
        )
    fragment = _build(box, layout, model)
    if notes:
        warnings.warn(
            f"{path} loaded into {model.name} unverified:\n  "
            + "\n  ".join(notes)
            + "\nIts keys and values are not what this model computes for the same tokens.",
            CacheFileWarning,
            stacklevel=4,
        )
    return fragment, None if unknown else diffs


def _mismatch_message(path: Path, model: LoadedModel, diffs: list[Difference], h: dict) -> str:
    made_by = h.get("model_name")
    lines = "".join(f"\n  {d}" for d in diffs)
    return (
        f"{path} was made by a different model ({made_by!r}) than the reader {model.name!r}; "
        f"{len(diffs)} field(s) differ:{lines}\n"
        "A KV cache is valid only for the weights, tokenizer and dtype that computed it. Rebuild it from its "
        "source text (kvlab.prefill), or pass strict=False to load it anyway with a warning."
    )


def _dims(geo: dict) -> dict[str, int]:
    """The last dimension of a layer's keys and of its values, as a fingerprint's geometry says."""
    return {"keys": geo["head_dim"], "values": geo.get("value_dim", geo["head_dim"])}
