"""Step 1 of a recompute: score tokens by how far their re-rotated keys are from fresh ones (``deviation``)."""

from __future__ import annotations

import torch
from transformers import DynamicCache

from kvlab.cache.recompute.decoder import Decoder, LayerKV, sliding_window
from kvlab.cache.recompute.layers import run_layers


def key_deviation(decoder: Decoder, merged: DynamicCache, layer: int) -> torch.Tensor:
    """How far each merged key is from a fresh prefill's key, at ``layer`` (CacheBlend's score).

    ``K_fresh`` comes from a prefill of every token through layers ``0 .. layer`` (the last
    one only up to its keys).

    Parameters
    ----------
    decoder : Decoder
    merged : DynamicCache
        The re-rotated merge; ``merged.layers[layer]`` holds all ``N`` tokens.
    layer : int

    Returns
    -------
    torch.Tensor
        ``[N]`` float32: ``sum_{heads, dims} (K_merged - K_fresh)^2``.
    """
    fresh = {}

    def layer_kv(li):
        k0 = merged.layers[li].keys
        shape = (1, k0.shape[1], decoder.total, k0.shape[3])
        keys = torch.empty(shape, dtype=k0.dtype, device=k0.device)
        values = torch.empty(shape, dtype=k0.dtype, device=k0.device)
        done = (lambda k, v: fresh.__setitem__("k", k)) if li == layer else None
        return LayerKV(keys, values, None, sliding_window(merged, li), done)

    run_layers(decoder, torch.arange(decoder.total), layer + 1, layer_kv, stop_after_kv=True)
    diff = merged.layers[layer].keys.float() - fresh["k"].float()
    return diff.pow(2).sum(dim=(0, 1, 3))
