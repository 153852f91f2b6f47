"""What a compaction or press audit reads: the source cache, one run of the target on it, and the references.

The constants of the audit (tokens, keep ratios, probe length, readers) live here, below every line.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from kvlab.cache.compact import held_positions
from kvlab.cache.fragments import clone_cache, prefill_ids
from kvlab.measure.audit.compare import (
    CacheView,
    LayerView,
    own_noise,
    snapshot,
)
from kvlab.measure.audit.target import COMPACT, Target, expect_cache
from kvlab.measure.metrics import REL_KEY_NOISE
from kvlab.models.layout import layer_ropes
from kvlab.models.loaded import LoadedModel
from kvlab.models.rope import check_composable, longrope_inv_freq, rotate_keys

#: Tokens the audited cache holds (past the sliding window and 8 more, where there is one).
TOKENS = 48

#: The fractions of each layer's tokens the audit asks a compaction to keep.
RATIOS = (0.5, 0.25)

#: Tokens fed on top of a result by the length and by-reference lines.
PROBE_TOKENS = 4

#: How a store's reader places the next token: from the cache (``generate``), or passing positions itself.
CACHE, EXPLICIT = "cache", "explicit"
READERS = (CACHE, EXPLICIT)


@dataclass
class Source:
    """What a compaction reads: ``ids`` ``[n]``, their fp32 cache from 0, the float64 one, and its noise."""

    ids: torch.Tensor
    cache: DynamicCache
    exact: DynamicCache
    floor: float

    @property
    def n(self) -> int:
        return int(self.ids.shape[-1])

    @functools.cached_property
    def held(self) -> list[torch.Tensor]:
        """Per layer, ``[held]`` the positions its tokens stand at (computed once)."""
        return held_positions(self.cache)


def make_source(model: LoadedModel, twin: LoadedModel, ids: torch.Tensor) -> Source:
    cache = prefill_ids(model, ids)
    exact = prefill_ids(twin, ids)
    return Source(ids, cache, exact, max(REL_KEY_NOISE, own_noise(cache, exact, model)))


def draw_keep(cache: DynamicCache, ratio: float, seed: int) -> list[torch.Tensor]:
    """Per layer, ``[batch, kv_heads, k]`` ascending positions: ``k = ratio`` of the tokens it holds, drawn per head."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for layer, held in zip(cache.layers, held_positions(cache), strict=True):
        b, h, t, _ = layer.keys.shape
        k = max(1, round(ratio * t))
        rows = [torch.randperm(t, generator=g)[:k].sort().values for _ in range(b * h)]
        out.append((torch.stack(rows) + int(held[0])).reshape(b, h, k))
    return out


def keep_all(cache: DynamicCache) -> list[torch.Tensor]:
    """Per layer, every token it holds, ``[batch, kv_heads, held]``."""
    return [
        held.expand(layer.keys.shape[0], layer.keys.shape[1], -1).clone()
        for layer, held in zip(cache.layers, held_positions(cache), strict=True)
    ]


class Run:
    """One call of the target on a fresh copy of the source: ``result``, and the tokens it was asked to keep."""

    def __init__(self, target: Target, model: LoadedModel, source: Source, keep, label: str):
        self.source, self.keep, self.label = source, keep, label
        if target.kind == COMPACT:
            self.input = clone_cache(source.cache, model.config)
            self.before = snapshot([self.input])
            got = target.call(self.input, [k.clone() for k in keep], model.model)
        else:
            self.input_ids = source.ids[None].clone()
            got = target.call(model.model, self.input_ids)
        self.result = expect_cache(got, target.name, label)


def exact_reference(
    model: LoadedModel, source: Source, tokens, new, total: int
) -> tuple[CacheView, list[torch.Tensor]]:
    """The exact keys and values of ``tokens`` turned to ``new``, and per layer the positions whose rounding counts."""
    layers, where = [], []
    n = source.n
    for rope, layer, k, p, held in zip(layer_ropes(model.model), source.exact.layers, tokens, new, source.held):
        slots = (k - int(held[0])).clamp_min(0)
        keys, values = (
            t.gather(2, slots[..., None].expand(-1, -1, -1, t.shape[-1])) for t in (layer.keys, layer.values)
        )
        if not rope.nope:
            long = check_composable(rope, [(0, n, total - n)]) if rope.rope_type == "longrope" else False
            freqs = longrope_inv_freq(model.model, rope, long) if rope.rope_type == "longrope" else rope.inv_freq
            phased = keys if rope.slot == "keys" else values
            turned = rotate_keys(phased, freqs.double(), (p - k).double(), pairing=rope.pairing)
            keys, values = (turned, values) if rope.slot == "keys" else (keys, turned)
        layers.append(LayerView(keys, values, keys.shape[-2]))
        where.append((k + (p - k).abs())[0].double())
    return CacheView(layers), where


def result_view(cache: DynamicCache) -> CacheView:
    return CacheView([LayerView(x.keys, x.values, x.keys.shape[-2]) for x in cache.layers])
