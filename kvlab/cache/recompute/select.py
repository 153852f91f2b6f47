"""Step 1 of a recompute: score tokens by how far their re-rotated keys are from fresh ones (``deviation``)."""

from __future__ import annotations

import torch
from transformers import DynamicCache

from kvlab.cache.recompute.decoder import Decoder, LayerKV, sliding_window
from kvlab.cache.recompute.layers import run_layers
from kvlab.models.layout import layer_ropes


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
        ``[N]`` float32: ``sum_{heads, dims} (K_merged - K_fresh)^2``. A latent-attention
        cache holds its key in both slots (latent, rotary part), so both count there.
    """
    fresh = {}

    def layer_kv(li):
        k0, v0 = merged.layers[li].keys, merged.layers[li].values
        keys = k0.new_empty((1, k0.shape[1], decoder.total, k0.shape[3]))
        values = v0.new_empty((1, v0.shape[1], decoder.total, v0.shape[3]))
        done = (lambda k, v: fresh.update(keys=k, values=v)) if li == layer else None
        return LayerKV(keys, values, None, sliding_window(merged, li), done)

    run_layers(decoder, torch.arange(decoder.total), layer + 1, layer_kv, stop_after_kv=True)
    slots = ("keys", "values") if layer_ropes(decoder.model.model)[layer].slot == "values" else ("keys",)
    score = 0
    for slot in slots:
        diff = getattr(merged.layers[layer], slot).float() - fresh[slot].float()
        score = score + diff.pow(2).sum(dim=(0, 1, 3))
    return score
