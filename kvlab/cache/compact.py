"""``compact``: keep some tokens per head of a cache and drop the rest, under one of two position conventions.

A press (kvpress's SnapKV, StreamingLLM, an engine's sinks and window) keeps ``k`` of a layer's
tokens per head. Where those tokens now sit is the press's convention:

* ``kept``: the sequence is now ``K`` tokens long (``K`` the most any layer keeps), and each
  layer's kept tokens end there: slot ``j`` of a layer keeping ``k`` sits at ``K - k + j``. The
  keys are re-rotated to those positions (the same rotary algebra as a merge: exact where the
  schedule composes, refused where it does not) and the next token goes at ``K``.
* ``original``: every key keeps the phase of the position it was computed at, and the next token
  goes at the original length ``n``. A plain cache would report ``k`` tokens, and ``generate``
  takes its positions from that, so the layers are :class:`CompactedLayer` (or its sliding form),
  which report ``n`` and place the mask's kept columns before it.

Either way the layers report the declared next position to ``get_seq_length`` and to the mask,
so a ``generate`` on top of the result reads the next token where the convention says.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from kvlab.cache.fragments import new_cache
from kvlab.compat import mask_query_length
from kvlab.errors import CompactError
from kvlab.models.layout import layer_ropes
from kvlab.models.loaded import LoadedModel
from kvlab.models.rope import check_composable, longrope_inv_freq, rotate_keys

#: The two conventions: where the kept keys sit and where the next token goes.
KEPT, ORIGINAL = "kept", "original"
POSITIONS = (KEPT, ORIGINAL)


class CompactedLayer(DynamicLayer):
    """A full-attention layer that holds fewer tokens than the sequence it stands for.

    ``dropped`` tokens of the sequence are not held: ``get_seq_length`` counts them, and the
    mask places the held columns after them, so new tokens land at the declared position and
    attend to every kept token.
    """

    dropped: int = 0

    def get_seq_length(self) -> int:
        held = super().get_seq_length()
        return held + self.dropped if held else 0

    def get_mask_sizes(self, query) -> tuple[int, int]:
        return super().get_seq_length() + mask_query_length(query), self.dropped


class CompactedSlidingLayer(DynamicSlidingWindowLayer):
    """A sliding layer whose ``cumulative_length`` counts the whole sequence while it holds fewer tokens."""

    def get_mask_sizes(self, query) -> tuple[int, int]:
        held = 0 if self.keys is None or self.keys.numel() == 0 else self.keys.shape[-2]
        return held + mask_query_length(query), self.cumulative_length - held


def held_positions(cache: DynamicCache) -> list[torch.Tensor]:
    """Per layer, ``[held]`` the positions of the tokens it holds (a sliding layer: the last ones)."""
    n = cache.get_seq_length()
    out = []
    for layer in cache.layers:
        held = layer.keys.shape[-2]
        out.append(torch.arange(n - held, n))
    return out


def low_key_norms(cache: DynamicCache, ratio: float) -> list[torch.Tensor]:
    """Per layer and head, the ``ratio`` of the tokens it holds with the smallest key norms, ascending.

    kvpress's Knorm rule, the simplest scorer (a rotation keeps a key's norm, so it reads the same
    under either convention). Not the largest norms: an attention sink's key is small, and on
    SmolLM2 keeping each head's largest half dropped it from most heads and read the story's answers
    2.48 nats/token from the full cache, worse than no cache at all (0.665), where the smallest half
    read 0.146 (docs/audit.md). Returns one ``[batch, kv_heads, k]`` tensor of positions per layer.
    """
    out = []
    for layer, held in zip(cache.layers, held_positions(cache), strict=True):
        k = max(1, round(ratio * layer.keys.shape[-2]))
        low = layer.keys.float().norm(dim=-1).topk(k, dim=-1, largest=False).indices.sort(dim=-1).values
        out.append(low.cpu() + int(held[0]))
    return out


def check_keep(cache: DynamicCache, keep, positions: str) -> list[torch.Tensor]:
    """``keep`` as int64 tensors, or a :class:`CompactError` naming what is wrong with it; nothing is read past it.

    Parameters
    ----------
    cache : DynamicCache
        Keys and values ``[batch, kv_heads, held, head_dim]`` per layer, prefilled from position 0.
    keep : list of torch.Tensor
        One per layer, ``[batch, kv_heads, k]`` positions (not slots) of the tokens the layer keeps,
        strictly ascending along the last dim, each among the positions the layer holds.
    positions : str
        ``kept`` or ``original``.
    """
    if positions not in POSITIONS:
        raise CompactError(f"positions must be one of {POSITIONS}, got {positions!r}")
    if not isinstance(keep, (list, tuple)) or len(keep) != len(cache.layers):
        got = len(keep) if isinstance(keep, (list, tuple)) else type(keep).__name__
        raise CompactError(f"keep must be a list of one tensor per layer ({len(cache.layers)}), got {got}")
    n = cache.get_seq_length()
    if n == 0:
        raise CompactError("cannot compact an empty cache")
    out = []
    for li, (k, layer, held) in enumerate(zip(keep, cache.layers, held_positions(cache), strict=True)):
        b, h = layer.keys.shape[:2]
        if not isinstance(k, torch.Tensor) or k.dtype not in (torch.int64, torch.int32) or k.ndim != 3:
            raise CompactError(f"keep[{li}] must be an integer tensor [batch, kv_heads, kept], got {_what(k)}")
        if tuple(k.shape[:2]) != (b, h) or k.shape[2] == 0:
            raise CompactError(f"keep[{li}] is {list(k.shape)}; layer {li} needs [{b}, {h}, kept >= 1]")
        k = k.long().cpu()
        lo, hi = int(held[0]), int(held[-1])
        if int(k.min()) < lo or int(k.max()) > hi:
            raise CompactError(
                f"keep[{li}] asks for positions {int(k.min())}..{int(k.max())}; layer {li} holds {lo}..{hi}"
            )
        if k.shape[2] > 1 and not bool((k[..., 1:] > k[..., :-1]).all()):
            raise CompactError(
                f"keep[{li}] is not strictly ascending along its last dim (a position twice, or out of order)"
            )
        out.append(k)
    return out


def _what(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"a {x.dtype} tensor of shape {list(x.shape)}"
    return f"a {type(x).__name__}"


def declared_positions(keep: list[torch.Tensor], positions: str) -> tuple[list[torch.Tensor], int]:
    """Per layer, ``[batch, kv_heads, k]`` the position each kept key carries after compaction, and the next position.

    ``original``: the token's own position; the next position is the original length (the
    largest kept position + 1 cannot tell it, so it is the caller's ``n``: see :func:`compact`).
    ``kept``: slot ``j`` of a layer keeping ``k`` of ``K`` sits at ``K - k + j``; next is ``K``.
    """
    if positions == ORIGINAL:
        return [k.clone() for k in keep], -1
    total = max(k.shape[-1] for k in keep)
    return [(total - k.shape[-1] + torch.arange(k.shape[-1])).expand_as(k).clone() for k in keep], total


@torch.inference_mode()
def compact(cache: DynamicCache, keep, model: LoadedModel, *, positions: str = KEPT) -> DynamicCache:
    """A new cache holding, per layer and head, the tokens ``keep`` names, at the positions ``positions`` declares.

    Parameters
    ----------
    cache : DynamicCache
        Keys and values ``[batch, kv_heads, held, head_dim]`` per layer, prefilled from position 0
        (``n = cache.get_seq_length()`` tokens; a sliding layer holds its last ``window - 1``).
        Never changed, and the result shares no memory with it.
    keep : list of torch.Tensor
        One per layer: ``[batch, kv_heads, k]`` strictly ascending positions, per head, among the
        tokens that layer holds (``k`` may differ between layers).
    model : LoadedModel
        The producer: its rotary module gives each layer's frequencies.
    positions : {"kept", "original"}
        The convention (module docstring): ``kept`` re-rotates slot ``j`` to ``K - k + j`` and the
        next token goes at ``K``; ``original`` keeps every key's phase and the next token goes at ``n``.

    Returns
    -------
    DynamicCache
        Layer ``l``, head ``h``, slot ``j`` holds token ``keep[l][b, h, j]``; ``get_seq_length()``
        is the next position (``K`` or ``n``).

    Raises
    ------
    CompactError
        ``keep`` of the wrong length, shape or dtype, not ascending, or outside a layer's tokens.
    UnsupportedRopeError
        ``kept`` on a schedule whose rotations do not compose (dynamic NTK; longrope across its
        switch length), exactly as a merge refuses it. Nothing is computed before these checks.
    """
    keep = check_keep(cache, keep, positions)
    n = cache.get_seq_length()
    ropes = layer_ropes(model.model)
    if len(ropes) != len(cache.layers):
        raise CompactError(f"the cache has {len(cache.layers)} layers, {model.name} has {len(ropes)}")
    new, total = declared_positions(keep, positions)
    total = n if positions == ORIGINAL else total
    freqs = []
    for rope in ropes:
        long = check_composable(rope, [(0, n, total - n)]) if positions == KEPT else False
        freqs.append(longrope_inv_freq(model.model, rope, long) if rope.rope_type == "longrope" else rope.inv_freq)
    out = new_cache(model.config)
    for li, (layer, rope, k, held) in enumerate(zip(cache.layers, ropes, keep, held_positions(cache), strict=True)):
        slots = (k - int(held[0])).to(layer.keys.device)
        keys, values = (_gather(t, slots) for t in (layer.keys, layer.values))
        if positions == KEPT and not rope.nope:
            delta = (new[li] - k).to(layer.keys.device)
            phased = keys if rope.slot == "keys" else values
            turned = rotate_keys(phased, freqs[li], delta, pairing=rope.pairing)
            keys, values = (turned, values) if rope.slot == "keys" else (keys, turned)
        out.update(keys, values, li)
        _declare(out.layers[li], total)
    return out


def _gather(t: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """``t`` (``[batch, heads, held, dim]``) at ``slots`` (``[batch, heads, k]``): ``[batch, heads, k, dim]``, a copy."""
    return t.gather(2, slots[..., None].expand(-1, -1, -1, t.shape[-1]))


def _declare(layer, total: int) -> None:
    """Make a layer filled by ``update`` report ``total`` tokens seen, its held ones last."""
    layer.__class__ = CompactedSlidingLayer if layer.is_sliding else CompactedLayer
    if layer.is_sliding:
        layer.cumulative_length = total
    else:
        layer.dropped = total - layer.keys.shape[-2]


def rebuild(cache: DynamicCache, config, total: int) -> DynamicCache:
    """``cache``'s tensors in a cache kvlab builds (``update``), reporting ``total`` tokens: its content, right bookkeeping.

    Parameters
    ----------
    cache : DynamicCache
        Keys and values ``[batch, kv_heads, held, head_dim]`` per layer (copied).
    total : int
        The next position the layers are to report (``get_seq_length``).
    """
    out = new_cache(config)
    for li, layer in enumerate(cache.layers):
        out.update(layer.keys.clone(), layer.values.clone(), li)
        _declare(out.layers[li], total)
    return out
