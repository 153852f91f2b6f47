"""Step 3 of a recompute: run the decoder layers on the chosen tokens, writing their fresh K/V into slots."""

from __future__ import annotations

import torch

from kvlab.cache.recompute.decoder import Decoder
from kvlab.cache.recompute.inputs import attention_mask, position_embeddings


class _SlotWriter:
    """Stands in for a model's cache for one layer call.

    ``update`` writes the new keys/values of the tokens being recomputed into their slots
    of full-length ``[batch, kv_heads, N, head_dim]`` buffers (in place) and returns the
    slots ``lo .. hi-1`` those tokens may attend to.
    """

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor, lo: int, hi: int):
        self.keys, self.values, self.slots, self.lo, self.hi = keys, values, slots, lo, hi

    def update(self, key_states, value_states, layer_idx=None, *args, **kwargs):
        self.keys.index_copy_(2, self.slots, key_states.to(self.keys.dtype))
        self.values.index_copy_(2, self.slots, value_states.to(self.values.dtype))
        return self.keys[:, :, self.lo : self.hi], self.values[:, :, self.lo : self.hi]


class _KVWritten(Exception):
    """Raised by :class:`_StoppingSlotWriter` to leave a layer once its K/V are written."""


class _StoppingSlotWriter(_SlotWriter):
    def update(self, key_states, value_states, layer_idx=None, *args, **kwargs):
        super().update(key_states, value_states)
        raise _KVWritten


@torch.inference_mode()
def run_layers(
    decoder: Decoder, slots: torch.Tensor, n_layers: int, layer_kv, stop_after_kv: bool = False, mask=attention_mask
) -> None:
    """Run decoder layers ``0 .. n_layers-1`` on the tokens at ``slots`` only.

    Each layer attends through a stand-in cache that writes the tokens' fresh K/V into
    their slots of the layer's buffers and hands back slots ``lo .. hi-1``, under
    :func:`attention_mask`; the hidden states of the tokens carry on to the next layer.

    Parameters
    ----------
    decoder : Decoder
    slots : torch.Tensor
        ``[k]`` ascending merged positions of the tokens to run.
    n_layers : int
    layer_kv : callable
        ``layer_kv(li) -> LayerKV``: the buffers layer ``li`` attends to and writes into.
    stop_after_kv : bool
        Leave the last layer as soon as its K/V are written (its attention and MLP
        would only feed layers that are not run).
    mask : callable
        Builds each layer's mask, with :func:`attention_mask`'s signature. Only
        :mod:`kvlab.cache.repro` passes another (a defect, to measure it).
    """
    # Read before the move: on an accelerator int() would sync, and a meta tensor has no values.
    first, last = int(slots[0]), int(slots[-1])
    slots = slots.to(decoder.device)
    pos = slots[None]
    h = decoder.embed(decoder.ids[slots][None])
    pes = position_embeddings(decoder, h, slots)
    everything = first == 0 and last == slots.numel() - 1
    masks = {}
    for li in range(n_layers):
        kv = layer_kv(li)
        window = kv.window
        # Slots past the last token run, or before the first one's window, are never seen.
        lo = 0 if window is None else max(0, first - window + 1)
        hi = last + 1
        if window is not None and window > last:
            window = None  # no token run here reaches past its window
        if everything and window is None and kv.avail is None and not decoder.eager and mask is attention_mask:
            # A plain causal prefill: no mask lets sdpa take its causal path (skips the
            # masked half), as the model's own prefill does.
            layer_mask = None
        elif kv.avail is None:
            if (window, lo, hi) not in masks:
                masks[window, lo, hi] = mask(decoder, slots, None, window, lo, hi)
            layer_mask = masks[window, lo, hi]
        else:
            layer_mask = mask(decoder, slots, kv.avail, window, lo, hi)
        stop = stop_after_kv and li == n_layers - 1
        writer = (_StoppingSlotWriter if stop else _SlotWriter)(kv.keys, kv.values, slots, lo, hi)
        try:
            out = decoder.layers[li](
                h,
                attention_mask=layer_mask,
                position_ids=pos,
                **pes[li],
                **{decoder.cache_kw: writer},
            )
        except _KVWritten:
            out = h
        h = out[0] if isinstance(out, tuple) else out
        if kv.done is not None:
            kv.done(kv.keys, kv.values)
