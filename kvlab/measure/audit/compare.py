"""Comparisons of a foreign cache with kvlab's references that survive the foreign cache being wrong.

An audited merge may return layers of the wrong length, never initialized, or holding more
tokens than a sliding window keeps; kvlab's metrics expect caches of one length. Here each layer
of both caches is cut to the tokens both hold (the latest ones, which is what a sliding layer
keeps) so that every line measures its own defect and no other: the phase line compares keys
even where the sliding-window line already failed.

The key error of :func:`key_error_by_kind` goes past certify's angle: a store can get the
magnitude of a rotary pair wrong (a YaRN scale applied twice) or turn dimensions that do not
rotate (a partial-rotary model rotated in full), and neither changes a pair's angle.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from kvlab.cache.fragments import new_cache, set_length
from kvlab.compat import forward, layer_ready
from kvlab.measure.metrics import phase_error
from kvlab.measure.phase import beyond_by_kind
from kvlab.models.layout import layer_ropes
from kvlab.models.loaded import LoadedModel


@dataclass
class LayerView:
    """One layer cut to ``kept`` tokens: keys and values ``[batch, heads, kept, dim]``; ``length`` tokens seen."""

    keys: torch.Tensor
    values: torch.Tensor
    length: int

    def get_seq_length(self) -> int:
        return self.length


@dataclass
class CacheView:
    """Layers of a cache as kvlab's metrics read them (``layers[i].keys``, ``.values``, ``.get_seq_length()``)."""

    layers: list[LayerView]


def structure_problems(cache: DynamicCache, ref: DynamicCache) -> list[str]:
    """Why ``cache`` cannot be compared with ``ref`` layer by layer at all (empty when it can).

    Layer count, and per layer the batch, heads and dims of keys and values; the token count
    may differ (each line that cares checks it).
    """
    if len(cache.layers) != len(ref.layers):
        return [f"the result has {len(cache.layers)} layers, the model {len(ref.layers)}"]
    out = []
    for li, (a, b) in enumerate(zip(cache.layers, ref.layers, strict=True)):
        for slot in ("keys", "values"):
            x, y = getattr(a, slot, None), getattr(b, slot)
            if not isinstance(x, torch.Tensor) or x.ndim != 4 or x.shape[-2] == 0:
                out.append(f"layer {li} holds no {slot}")
            elif (x.shape[0], x.shape[1], x.shape[3]) != (y.shape[0], y.shape[1], y.shape[3]):
                out.append(f"layer {li} {slot} are {list(x.shape)}, the model's {list(y.shape)}")
    return out


def tails(cache: DynamicCache, ref: DynamicCache, total: int) -> tuple[CacheView, CacheView]:
    """Both caches cut, per layer, to the last tokens both hold, each layer seen as holding ``total`` tokens.

    The latest tokens are what a sliding layer keeps, so a layer that kept too many still has
    its latest ones compared with the reference's, at their true positions.
    """
    a_layers, b_layers = [], []
    for a, b in zip(cache.layers, ref.layers, strict=True):
        t = min(a.keys.shape[-2], b.keys.shape[-2], a.values.shape[-2], b.values.shape[-2])
        a_layers.append(LayerView(a.keys[..., -t:, :], a.values[..., -t:, :], total))
        b_layers.append(LayerView(b.keys[..., -t:, :], b.values[..., -t:, :], total))
    return CacheView(a_layers), CacheView(b_layers)


def rel_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    """``max |x - y| / max |y|`` (``inf`` for another shape, the absolute difference where ``y`` is all 0)."""
    if x.shape != y.shape:
        return math.inf
    if x.numel() == 0:
        return 0.0
    d = float((x.double() - y.double()).abs().max())
    scale = float(y.abs().max())
    return d / scale if scale > 0 else d


def other_slot(slot: str) -> str:
    """The slot that carries no phase: the values, or the latent (keys) under latent attention."""
    return "keys" if slot == "values" else "values"


def own_noise(cache: DynamicCache, exact: DynamicCache, model: LoadedModel) -> float:
    """A fp32 cache's own noise against the float64 model at the same positions: the floor of the phase line.

    ``max`` over layers of :func:`rel_diff` of the slot that carries the phase (``keys``, or
    ``values`` under latent attention); both slots of a NoPE layer, which the phase line
    compares element by element.
    """
    worst = 0.0
    for rope, a, b in zip(layer_ropes(model.model), cache.layers, exact.layers, strict=True):
        for slot in ("keys", "values") if rope.nope else (rope.slot,):
            worst = max(worst, rel_diff(getattr(a, slot), getattr(b, slot)))
    return worst


def key_error_by_kind(
    cache: CacheView,
    exact: CacheView,
    model: LoadedModel,
    floor: float,
    offset: int = 0,
    positions: list[torch.Tensor] | None = None,
) -> dict[str, tuple[float, str]]:
    """Per layer kind, the worst error of the phase-carrying slot in units of rounding, and what it was.

    Three parts, each ``<= 1`` when the slot is the exact one to the fragments' own noise
    ``floor`` (relative, of the layer's largest value):

    * ``angle``: :func:`kvlab.measure.phase.beyond_by_kind` (for a NoPE layer, ``elements``:
      both of its slots element by element);
    * ``pair norm``: ``| |x| - |y| |`` of every rotary pair over ``sqrt(2) * floor * max |y|``
      (a rotation keeps a pair's norm; the pair's element noise bounds how far it moves);
    * ``non-rotary dims``: ``max |x - y|`` of the dimensions no rotation touches over
      ``floor`` times the slot's scale.

    Parameters
    ----------
    cache, exact : CacheView
        From :func:`tails`: the cache under test and the float64 reference, same kept tokens.
    offset : int
        Added to every position (a shifted cache holds positions ``offset ..``).
    positions : list of torch.Tensor, optional
        Per layer, ``[kv_heads, T]`` the positions whose fp32 angle rounding to allow for, where
        each head holds other tokens (a compacted cache); replaces the layer's own positions.

    Returns
    -------
    dict
        ``kind -> (value, part)``, ``part`` the one of the three that is worst.
    """
    phases = phase_error(cache, exact, model)
    if positions is not None:
        phases = [dataclasses.replace(p, positions=pos.cpu()) for p, pos in zip(phases, positions, strict=True)]
    if offset:
        phases = [dataclasses.replace(p, positions=p.positions + offset) for p in phases]
    out = {
        kind: (v, "elements" if kind.endswith("(NoPE)") else "angle")
        for kind, v in beyond_by_kind(cache, exact, phases, floor).items()
    }
    for li, rope in enumerate(layer_ropes(model.model)):
        if rope.nope:
            continue
        x = getattr(cache.layers[li], rope.slot).double()
        y = getattr(exact.layers[li], rope.slot).double()
        r, pairing = rope.rotary_dim, rope.pairing
        (x1, x2), (y1, y2) = pairing.split(x, r), pairing.split(y, r)
        nx, ny = torch.hypot(x1, x2), torch.hypot(y1, y2)
        pair_scale = float(ny.max()) if ny.numel() else 0.0
        parts = {}
        if pair_scale > 0:
            parts["pair norm"] = float((nx - ny).abs().max()) / (math.sqrt(2) * floor * pair_scale)
        rest = torch.ones(x.shape[-1], dtype=torch.bool)
        rest[pairing.offset : pairing.offset + r] = False
        if rest.any():
            # Unrotated dims are compared on the slot's scale: a pair's norm bounds its elements whatever its phase.
            scale = max(pair_scale, float(y[..., rest].abs().max()))
            if scale > 0:
                parts["non-rotary dims"] = float((x[..., rest] - y[..., rest]).abs().max()) / (floor * scale)
        for part, value in parts.items():
            if value > out[rope.kind][0]:
                out[rope.kind] = (value, part)
    return out


def snapshot(caches: list[DynamicCache]) -> list[list[tuple]]:
    """Per cache, per layer: its class, whether initialized, its length and copies of its keys and values."""
    out = []
    for cache in caches:
        out.append(
            [
                (
                    type(layer),
                    layer_ready(layer),
                    layer.get_seq_length(),
                    None if layer.keys is None else layer.keys.clone(),
                    None if layer.values is None else layer.values.clone(),
                )
                for layer in cache.layers
            ]
        )
    return out


def changes(caches: list[DynamicCache], snap: list[list[tuple]]) -> list[str]:
    """What differs in ``caches`` from their :func:`snapshot` (``fragment 0 layer 2: keys changed``)."""
    out = []
    for ci, (cache, layers) in enumerate(zip(caches, snap, strict=True)):
        if len(cache.layers) != len(layers):
            out.append(f"fragment {ci}: {len(layers)} layers became {len(cache.layers)}")
            continue
        for li, (layer, (cls, init, length, k, v)) in enumerate(zip(cache.layers, layers, strict=True)):
            what = []
            if type(layer) is not cls or layer_ready(layer) != init:
                what.append("layer object")
            if layer.get_seq_length() != length:
                what.append(f"length {length} -> {layer.get_seq_length()}")
            for slot, before in (("keys", k), ("values", v)):
                now = getattr(layer, slot)
                if (before is None) != (now is None) or (
                    before is not None and (now.shape != before.shape or not torch.equal(now, before))
                ):
                    what.append(slot)
            if what:
                out.append(f"fragment {ci} layer {li}: {', '.join(what)} changed")
    return out


def first_changes(inputs: list[DynamicCache], before) -> list[str]:
    """:func:`changes`, the first per fragment (one names the defect)."""
    seen, out = set(), []
    for c in changes(inputs, before):
        frag = c.split(" layer")[0]
        if frag not in seen:
            seen.add(frag)
            out.append(c)
    return out


def shared_storage(cache: DynamicCache, inputs: list[DynamicCache]) -> list[str]:
    """Layers of ``cache`` whose keys or values share memory with any tensor of ``inputs``."""
    held = {}
    for ci, c in enumerate(inputs):
        for layer in c.layers:
            for t in (layer.keys, layer.values):
                if isinstance(t, torch.Tensor) and t.numel():
                    held[t.untyped_storage().data_ptr()] = ci
    out = []
    for li, layer in enumerate(cache.layers):
        for slot in ("keys", "values"):
            t = getattr(layer, slot, None)
            if isinstance(t, torch.Tensor) and t.numel() and t.untyped_storage().data_ptr() in held:
                out.append(f"layer {li} {slot} share memory with fragment {held[t.untyped_storage().data_ptr()]}")
    return out


def kept(model: LoadedModel, total: int) -> list[int]:
    """Per layer, the tokens a cache of ``total`` tokens keeps (a sliding layer: its last ``window - 1``)."""
    return [
        min(total, layer.sliding_window - 1) if layer.is_sliding else total for layer in new_cache(model.config).layers
    ]


def rebuilt(cache: DynamicCache, model: LoadedModel, total: int) -> DynamicCache:
    """``cache``'s keys and values in a cache kvlab builds (``update``, lengths set): its content, right bookkeeping.

    Raises
    ------
    ValueError
        A layer holds fewer tokens than a cache of ``total`` tokens keeps.
    """
    out = new_cache(model.config)
    for li, (layer, n) in enumerate(zip(cache.layers, kept(model, total), strict=True)):
        if layer.keys.shape[-2] < n or layer.values.shape[-2] < n:
            raise ValueError(f"layer {li} holds {layer.keys.shape[-2]} tokens, a cache of {total} keeps {n}")
        out.update(layer.keys[..., -n:, :].clone(), layer.values[..., -n:, :].clone(), li)
        set_length(out.layers[li], total)
    return out


@torch.inference_mode()
def next_log_probs(
    model: LoadedModel, cache: DynamicCache, ids: torch.Tensor, start: int | None = None
) -> torch.Tensor:
    """``[vocab]`` float64 next-token log-probabilities after ``ids`` (``[n]``), read on top of ``cache``.

    With ``start`` None no positions are given: transformers takes them from the cache
    (``get_seq_length``), as a store's ``generate`` does. Otherwise ``ids`` sit at ``start ..
    start+n-1`` (``position_ids``), as a reader that passes its own positions reads (kvpress's
    pipeline). ``cache`` grows by ``n`` tokens.
    """
    extra = {} if start is None else {"position_ids": (start + torch.arange(ids.shape[-1]))[None].to(model.device)}
    out = forward(model.model, cache, input_ids=ids[None].to(model.device), use_cache=True, logits_to_keep=1, **extra)
    return torch.log_softmax(out.logits[0, -1].double(), -1)
