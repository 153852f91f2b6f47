"""Step 4 of a recompute: write the fresh K/V back (sliding layers too), and steps 2-4 in one call."""

from __future__ import annotations

import torch

from kvlab.cache.recompute.decoder import Decoder


def write_back(decoder: Decoder, layer, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
    """Copy the fresh K/V of the recomputed tokens a sliding layer keeps into that layer.

    The others needed fresh K/V only for the tokens recomputed with them inside this layer.

    Parameters
    ----------
    decoder : Decoder
    layer : DynamicSlidingWindowLayer
        A merged layer keeping its last ``kept`` of ``N`` slots, ``[1, kv_heads, kept, head_dim]``.
    slots : torch.Tensor
        ``[k]`` ascending merged positions that were recomputed.
    keys, values : torch.Tensor
        ``[1, kv_heads, N, head_dim]``, the buffers the layer wrote into.
    """
    first_kept = decoder.total - layer.keys.shape[-2]
    back = slots[slots >= first_kept].to(decoder.device)
    layer.keys.index_copy_(2, back - first_kept, keys.index_select(2, back))
    layer.values.index_copy_(2, back - first_kept, values.index_select(2, back))
