"""Step 2 of a recompute: the chosen tokens' positions, rotary tables and causal-by-position mask."""

from __future__ import annotations

import torch
from transformers import DynamicCache

from kvlab.cache.recompute.decoder import Decoder, LayerKV, sliding_window
from kvlab.cache.recompute.write import write_back
from kvlab.cache.strategies import KeyRotator
from kvlab.compat import layer_rope_kwargs, rotary_call


def position_embeddings(decoder: Decoder, hidden: torch.Tensor, slots: torch.Tensor) -> list[dict]:
    """The rotary ``(cos, sin)`` of the tokens at ``slots``, per layer.

    Computed for all ``N`` positions and then indexed: schedules that pick their
    frequencies from the largest position of a forward (longrope) must see the merged
    length, as the joined prefill does, not the last recomputed token.

    Parameters
    ----------
    decoder : Decoder
    hidden : torch.Tensor
        ``[1, k, hidden]``, the tokens' embeddings (the rotary module reads its dtype).
    slots : torch.Tensor
        ``[k]`` ascending merged positions.

    Returns
    -------
    list of dict
        Per layer, the keyword arguments (:func:`kvlab.compat.layer_rope_kwargs`) holding what the
        rotary module hands its attention for those tokens: ``cos`` and ``sin``, each
        ``[1, k, rotary_dim]`` (GPT-J: ``sin``, ``cos`` of ``rotary_dim / 2``), or one complex
        ``[1, k, rotary_dim / 2]``.
    """
    everything = torch.arange(decoder.total, device=decoder.device)[None]

    def pick(pe):
        # One complex exp(i angle) tensor (DeepSeek-V2, Llama 4) or a (cos, sin) pair.
        if isinstance(pe, torch.Tensor):
            return pe.index_select(1, slots)
        return tuple(t.index_select(1, slots) for t in pe)

    by_type = {t: pick(rotary_call(entry, hidden, everything, t)) for t, entry in decoder.rotaries.items()}
    return [layer_rope_kwargs(layer, t, by_type) for layer, t in zip(decoder.layers, decoder.types)]


def attention_mask(
    decoder: Decoder, slots: torch.Tensor, avail: torch.Tensor | None, window: int | None, lo: int, hi: int
) -> torch.Tensor:
    """Which slots each recomputed token may attend to: causal by landing position.

    The token at position ``p`` sees slots ``<= p``; on a sliding-window layer only slots
    ``> p - window``; and only slots that hold a K/V (``avail``).

    Parameters
    ----------
    decoder : Decoder
    slots : torch.Tensor
        ``[k]`` ascending merged positions of the tokens run.
    avail : torch.Tensor or None
        ``[N]`` bool, the slots holding a K/V (``None``: all).
    window : int or None
    lo, hi : int
        The slots the layer attends to, ``lo .. hi-1``.

    Returns
    -------
    torch.Tensor
        ``[1, 1, k, hi - lo]``: bool for sdpa, additive float (0 or the dtype's minimum)
        for eager attention.
    """
    kv = torch.arange(lo, hi, device=decoder.device)
    p = slots[:, None]
    allowed = kv[None, :] <= p
    if window is not None:
        allowed &= kv[None, :] > p - window
    if avail is not None:
        allowed &= avail[lo:hi][None, :]
    allowed = allowed[None, None]
    if decoder.eager:
        return torch.zeros(allowed.shape, dtype=decoder.dtype, device=decoder.device).masked_fill_(
            ~allowed, torch.finfo(decoder.dtype).min
        )
    return allowed


def layer_inputs(decoder: Decoder, merged: DynamicCache, li: int, slots: torch.Tensor, rotator: KeyRotator) -> LayerKV:
    """The K/V buffers layer ``li`` of a recompute attends to, and how its results go back.

    A layer that keeps every merged token (full attention, or a sliding layer not yet
    full) lends its own tensors: the fresh K/V land in place. A sliding layer that keeps
    only its last ``window - 1`` tokens gets full-length buffers (:func:`sliding_buffers`)
    and a ``done`` that writes back only the slots it keeps (:func:`write_back`).

    Parameters
    ----------
    decoder : Decoder
    merged : DynamicCache
        The re-rotated merge, ``[1, kv_heads, kept, head_dim]`` per layer.
    li : int
    slots : torch.Tensor
        ``[k]`` ascending merged positions being recomputed.
    rotator : KeyRotator
        The merge's key rotator (for the fragments' kept tails).

    Returns
    -------
    LayerKV
    """
    layer = merged.layers[li]
    kept = layer.keys.shape[-2]
    window = sliding_window(merged, li)
    if kept == decoder.total:
        return LayerKV(layer.keys, layer.values, None, window, None)
    keys, values, avail = sliding_buffers(decoder, merged, li, rotator)
    avail[slots.to(decoder.device)] = True
    return LayerKV(keys, values, avail, window, lambda k, v: write_back(decoder, layer, slots, k, v))


def sliding_buffers(decoder: Decoder, merged: DynamicCache, li: int, rotator: KeyRotator):
    """Full-length K/V of a sliding layer holding every slot some fragment kept.

    The merged layer keeps only its last ``window - 1`` slots, but each fragment kept
    its own last ``window - 1``: a recomputed token early in the merge attends to
    those (re-rotated), as it would in a merge that kept more.

    Returns
    -------
    keys, values : torch.Tensor
        ``[1, kv_heads, N, head_dim]``.
    avail : torch.Tensor
        ``[N]`` bool, the slots holding a K/V.
    """
    layer = merged.layers[li]
    k0 = layer.keys
    kept = k0.shape[-2]
    tail = decoder.total - kept  # slots from here on are the merged layer's own (already re-rotated)
    v0 = layer.values
    keys = k0.new_zeros((1, k0.shape[1], decoder.total, k0.shape[3]))
    values = v0.new_zeros((1, v0.shape[1], decoder.total, v0.shape[3]))
    avail = torch.zeros(decoder.total, dtype=torch.bool, device=decoder.device)
    for f, land in zip(decoder.fragments, decoder.landings):
        fk, fv = f.cache.layers[li].keys, f.cache.layers[li].values
        end = land + f.length
        s0 = end - fk.shape[-2]
        s1 = min(end, tail)
        if s1 > s0:
            rotator(fk[..., : s1 - s0, :], li, f, land, keys[..., s0:s1, :])
            values[..., s0:s1, :] = fv[..., : s1 - s0, :]
        avail[s0:end] = True
    keys[..., tail:, :] = k0
    values[..., tail:, :] = layer.values
    return keys, values, avail
