"""``shift_``: turn a cache's keys in place to new positions, for a store that owns its cache.

llama.cpp's server moves a cached chunk with ``llama_memory_seq_add`` (a K-shift of the f16
cells where they lie). ``rerotate`` builds a new fp32 cache instead, which a store that already
owns its cache does not need. :func:`shift_` is the in-place turn: every key stays in its own
tensor and dtype; the rotation is computed in fp32 (float64 angles, rounded once) and rounded
once into the key's dtype, a layer-type's rotation built once per call.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from kvlab.errors import MergeError, UnsupportedRopeError
from kvlab.models.layout import layer_ropes
from kvlab.models.loaded import LoadedModel
from kvlab.models.rope import HALF, Pairing, check_composable, check_positions, longrope_inv_freq, rotation

#: Tokens turned per step: the fp32 working copy stays in cache (about 1 MB at 8 KV heads x 128 dims).
CHUNK = 256


@torch.inference_mode()
def shift_(cache: DynamicCache, offset: int, model: LoadedModel, *, start: int = 0) -> DynamicCache:
    """Rotate every cached key by ``offset`` positions, in place.

    Parameters
    ----------
    cache : DynamicCache
        Keys and values ``[batch, kv_heads, kept, head_dim]`` per layer, computed for the
        positions ``start .. start + L - 1`` (``L = cache.get_seq_length()``). Its keys are
        overwritten; values, lengths and every tensor's identity are kept.
    offset : int
        Positions to move by (negative moves back; ``start + offset`` must stay >= 0).
    model : LoadedModel
        The producer: its rotary module gives each layer's frequencies.
    start : int
        The position the first key carries now.

    Returns
    -------
    DynamicCache
        ``cache`` itself, its keys now at ``start + offset ..``.

    Raises
    ------
    UnsupportedRopeError
        Where a rotation does not compose, exactly as ``rerotate`` refuses: dynamic NTK, longrope
        across its switch length.
    PositionError
        ``start + offset + L`` past ``max_position_embeddings``.
    MergeError
        An empty cache, a non-integer offset, or ``start + offset < 0``.

    Nothing is modified when an error is raised: every check runs before the first key is turned.

    Notes
    -----
    A sliding-window layer that already dropped tokens is turned as it is: it keeps the cache's
    last ``window - 1`` tokens, the only ones a later token can attend to, and a merge with this
    cache last keeps exactly those (``rerotate`` agrees with it bit for bit).
    """
    if isinstance(offset, bool) or not isinstance(offset, int):
        raise MergeError(f"offset must be an int number of positions, got {offset!r}")
    length = cache.get_seq_length()
    if length == 0:
        raise MergeError("cannot shift an empty cache")
    if start + offset < 0:
        raise MergeError(f"start {start} + offset {offset} is negative: keys cannot move before position 0")
    ropes = layer_ropes(model.model)
    if len(ropes) != len(cache.layers):
        raise MergeError(f"the cache has {len(cache.layers)} layers, {model.name} has {len(ropes)}")
    check_positions(model.config.get_text_config(), start + offset + length, "shift_")
    spans = [(start, length, start + offset)]
    freqs = []
    for rope in ropes:
        long = check_composable(rope, spans)
        freqs.append(longrope_inv_freq(model.model, rope, long) if rope.rope_type == "longrope" else rope.inv_freq)
    if offset == 0:
        return cache
    tables: dict = {}
    for li, (layer, rope) in enumerate(zip(cache.layers, ropes)):
        if rope.nope:
            continue
        keys = getattr(layer, rope.slot)
        work = torch.float64 if keys.dtype == torch.float64 else torch.float32
        key = (id(freqs[li]), rope.pairing, keys.device, work)
        if key not in tables:
            tables[key] = rotation(freqs[li], offset, work, keys.device, rope.pairing)
        _turn_(keys, *tables[key], rope.pairing)
    return cache


def _turn_(keys: torch.Tensor, cos2: torch.Tensor, sin: torch.Tensor, pairing: Pairing = HALF) -> None:
    """The rotary dims of ``keys`` (``[batch, heads, n, dim]``) rotated in place, chunk by chunk, in ``cos2``'s dtype.

    The same operations, in the same order, as :func:`kvlab.models.rope.apply_rotation`, so a shift
    and a ``rerotate`` of the same keys agree bit for bit.
    """
    r = 2 * sin.shape[-1]
    if pairing.offset + r > keys.shape[-1]:
        raise UnsupportedRopeError(
            f"rotary dims {pairing.offset}..{pairing.offset + r - 1} exceed head_dim {keys.shape[-1]}"
        )
    local = Pairing(0, pairing.interleaved)
    for a in range(0, keys.shape[-2], CHUNK):
        part = pairing.span(keys[..., a : a + CHUNK, :], r)
        x = part.to(cos2.dtype, copy=True)
        o = x * cos2
        (o1, o2), (x1, x2) = local.split(o, r), local.split(x, r)
        o1.addcmul_(x2, sin, value=-1)
        o2.addcmul_(x1, sin)
        part.copy_(o)
