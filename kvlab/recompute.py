"""``recompute``: re-rotate, then recompute a few tokens at every layer (CacheBlend-style).

Re-rotation gets every key's phase right but cannot give a fragment the attention to
earlier fragments it never had (the context error). Recomputing the K and V of a few
chosen tokens, layer by layer, against the merged cache restores part of it, at a cost
that grows with the number of tokens chosen (CacheBlend recomputes about 15%).

The recompute runs the model's own decoder layers (norms, projections, ``q_norm`` /
``k_norm``, RoPE from the model's rotary module, MLP) on the chosen tokens only. Each
layer attends through a stand-in cache object that writes the chosen tokens' fresh K/V
into their slots of that layer's merged K/V and hands the whole layer back, under a mask
that lets the token at position ``p`` see slots ``<= p`` (and, on sliding-window layers,
only slots ``> p - window``). So the chosen tokens see each other's fresh K/V and
everyone else's re-rotated K/V, as in CacheBlend. With every token chosen this is a
prefill of the joined tokens; with none it is ``rerotate``.

The algorithm, in the order of the CacheBlend description, as named functions:

0. re-rotate and concatenate the fragments (:class:`kvlab.strategies.KeyRotator`,
   :func:`kvlab.strategies.concat_layers`);
1. select the tokens (:meth:`Recompute.select_tokens`; ``deviation`` scores them with
   :func:`key_deviation`);
2. give them their positions and mask (:func:`position_embeddings`,
   :func:`attention_mask`, :func:`layer_inputs`);
3. run the layers on them (:func:`run_layers`);
4. write their fresh K/V back (in place, or :func:`write_back` on a sliding layer).

:func:`recompute_tokens` runs steps 2-4; :class:`Decoder` holds the model's parts.

Sliding-window layers keep only the last ``window - 1`` merged tokens. A chosen token
outside them still runs through every layer (its hidden state feeds the layers that do
keep it); inside such a layer it attends to the K/V of its window that exist anywhere:
other chosen tokens' fresh ones and each fragment's own kept tail, re-rotated. Its K/V
are written back only where the layer keeps its slot.
"""
from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from typing import ClassVar

import torch
from transformers import DynamicCache

from .errors import MergeError
from .fragments import Fragment
from .models import LoadedModel
from .rope import find_rotary_module, layer_types
from .strategies import KeyRotator, Rerotate, Strategy, concat_layers, register

POLICIES = ("deviation", "fragment_start", "random")

#: ``config.model_type`` values whose decoder layers were checked against a joined prefill
#: (ratio 1 equals ``reprefill``). Others are refused rather than silently approximated: a
#: family may scale embeddings or mix positions outside its decoder layers.
SUPPORTED_MODEL_TYPES = {"llama", "qwen2", "gemma3_text", "phi", "phi3", "gpt_neox"}


@register("recompute")
@dataclass
class Recompute(Strategy):
    """Re-rotate, then recompute K/V of a fraction of the tokens at every layer (CacheBlend).

    Parameters
    ----------
    ratio : float
        Fraction of the merged tokens to recompute, in ``[0, 1]``; ``round(ratio * N)``
        tokens (Python's round, half to even). ``0`` is ``rerotate`` bit for bit, ``1``
        is a prefill of the joined tokens.
    policy : str
        Which tokens: ``deviation`` (CacheBlend: largest squared key deviation between the
        re-rotated cache and a fresh prefill of the first layers, at ``check_layer``),
        ``fragment_start`` (the first tokens of each fragment after the first, as evenly
        as their lengths allow) or ``random`` (a seeded control).
    check_layer : int, optional
        Layer whose keys ``deviation`` compares. Default: layer 1, or, when layer 1 is a
        sliding-window layer that no longer holds every merged token, the first later
        layer that does (a deviation needs a cached key for every candidate). Every
        token is prefilled through layers ``0 .. check_layer`` to score it; those fresh
        K/V only score, they are not written, so the policies differ only in the
        tokens they pick.
    seed : int
        Seed of the ``random`` policy.
    """

    needs_model: ClassVar[bool] = True
    ratio: float = 0.15
    policy: str = "deviation"
    check_layer: int | None = None
    seed: int = 0

    def __post_init__(self):
        r = self.ratio
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not math.isfinite(r) or not 0 <= r <= 1:
            raise MergeError(f"recompute ratio must be a number in [0, 1] (the fraction of tokens recomputed), got {r!r}")
        if self.policy not in POLICIES:
            raise MergeError(f"unknown recompute policy {self.policy!r}; choose one of {', '.join(POLICIES)}")
        c = self.check_layer
        if c is not None and (isinstance(c, bool) or not isinstance(c, int) or c < 0):
            raise MergeError(f"check_layer must be a layer index >= 0 or None, got {c!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise MergeError(f"seed must be an int, got {self.seed!r}")

    def budget(self, total: int) -> int:
        """How many of ``total`` merged tokens are recomputed."""
        return int(round(self.ratio * total))

    def __call__(self, fragments: list[Fragment], landings: list[int], model: LoadedModel) -> DynamicCache:
        # The steps of CacheBlend, in order: re-rotate and concatenate; select the tokens;
        # then, layer by layer, give them positions and a mask, run the layer, write back.
        rotator = KeyRotator(model, fragments, landings)
        merged = concat_layers(fragments, landings, rotator)
        total = landings[-1] + fragments[-1].length
        if self.budget(total) == 0:
            return merged
        decoder = Decoder.of(model, fragments, landings)
        chosen = self.select_tokens(decoder, merged)
        recompute_tokens(decoder, merged, chosen, rotator)
        return merged

    def select(self, fragments: list[Fragment], landings: list[int], model: LoadedModel) -> torch.Tensor:
        """The positions this strategy recomputes for a merge.

        Returns
        -------
        torch.Tensor
            ``[round(ratio * N)]`` int64 merged positions, ascending.
        """
        total = landings[-1] + fragments[-1].length
        if self.budget(total) == 0:
            return torch.empty(0, dtype=torch.long)
        merged = Rerotate()(fragments, landings, model) if self.policy == "deviation" else None
        return self.select_tokens(Decoder.of(model, fragments, landings), merged)

    def select_tokens(self, decoder: "Decoder", merged: DynamicCache | None) -> torch.Tensor:
        """Step 1: which of the ``N`` merged tokens to recompute, by this strategy's policy.

        Parameters
        ----------
        decoder : Decoder
        merged : DynamicCache or None
            The re-rotated merge, ``[1, kv_heads, kept, head_dim]`` per layer (only the
            ``deviation`` policy reads it).

        Returns
        -------
        torch.Tensor
            ``[round(ratio * N)]`` int64 merged positions, ascending.
        """
        k = self.budget(decoder.total)
        if k == decoder.total:
            return torch.arange(decoder.total)
        if self.policy == "random":
            g = torch.Generator().manual_seed(self.seed)
            return torch.randperm(decoder.total, generator=g)[:k].sort().values
        if self.policy == "fragment_start":
            return fragment_start_positions([f.length for f in decoder.fragments], decoder.landings, k)
        layer = self._check_layer(decoder, merged)
        dev = key_deviation(decoder, merged, layer)
        # Sorted so the chosen tokens run in position order (any order is exact; this one is cache-friendly).
        return torch.topk(dev, k).indices.sort().values.cpu()

    def _check_layer(self, decoder: "Decoder", merged: DynamicCache) -> int:
        n_layers, total = len(merged.layers), decoder.total

        def holds_all(li):
            return merged.layers[li].keys.shape[-2] == total

        if self.check_layer is not None:
            if self.check_layer >= n_layers:
                raise MergeError(f"check_layer {self.check_layer} is out of range: the model has {n_layers} layers")
            if not holds_all(self.check_layer):
                raise MergeError(
                    f"check_layer {self.check_layer} is a sliding-window layer holding only the last "
                    f"{merged.layers[self.check_layer].keys.shape[-2]} of {total} merged tokens, so the others have no "
                    "cached key to compare; pick a full-attention layer (or leave check_layer unset)"
                )
            return self.check_layer
        for li in range(min(1, n_layers - 1), n_layers):
            if holds_all(li):
                return li
        raise MergeError(
            f"no layer of this model holds all {total} merged tokens (every layer is sliding-window), so the "
            "'deviation' policy has nothing to compare; use policy 'fragment_start' or 'random'"
        )


def fragment_start_positions(lengths: list[int], landings: list[int], k: int) -> torch.Tensor:
    """The first tokens of each fragment after the first, ``k`` in all.

    Every later fragment gets ``min(t, L_j)`` tokens for the smallest ``t`` that reaches
    ``k``; any excess is taken back from the last fragments. Past the later fragments'
    total, the first tokens of fragment 0 follow (so ``k = N`` picks every token).

    Returns
    -------
    torch.Tensor
        ``[k]`` int64 merged positions, ascending.
    """
    later = list(range(1, len(lengths)))
    cap = sum(lengths[j] for j in later)
    take = {j: 0 for j in range(len(lengths))}
    if k >= cap:
        take.update({j: lengths[j] for j in later})
        take[0] = k - cap
    else:
        t = 0
        while sum(min(t, lengths[j]) for j in later) < k:
            t += 1
        for j in later:
            take[j] = min(t, lengths[j])
        excess = sum(take.values()) - k
        for j in reversed(later):
            if excess and take[j] == t:
                take[j] -= 1
                excess -= 1
    pos = [torch.arange(landings[j], landings[j] + take[j]) for j in range(len(lengths))]
    return torch.cat(pos).sort().values



# --------------------------------------------------------------------------- the model's parts


@dataclass(eq=False)
class Decoder:
    """The parts of a model the recompute runs, for one merge of ``fragments``.

    Attributes
    ----------
    fragments, landings
        What is merged and where each fragment lands.
    total : int
        ``N``, the merged length.
    ids : torch.Tensor
        ``[N]`` int64, the merged token ids.
    layers : list of torch.nn.Module
        The decoder layers, run one by one.
    embed, rotary : torch.nn.Module
        The input embedding and the rotary module.
    types : list of str
        Per layer, its rope layer type (``default``, or Gemma 3's ``sliding_attention`` ...).
    typed_rotary : bool
        Whether the rotary module takes the layer type (one module, per-type frequencies).
    cache_kw : str
        The name under which a decoder layer takes its cache.
    eager : bool
        Eager attention (additive float mask) rather than sdpa (bool mask).
    """

    model: LoadedModel
    fragments: list[Fragment]
    landings: list[int]
    total: int
    ids: torch.Tensor
    layers: list
    embed: torch.nn.Module
    rotary: torch.nn.Module
    types: list[str]
    typed_rotary: bool
    cache_kw: str
    eager: bool
    device: torch.device
    dtype: torch.dtype

    @classmethod
    def of(cls, model: LoadedModel, fragments: list[Fragment], landings: list[int]) -> "Decoder":
        """Check that ``model`` and ``fragments`` can be recomputed, and collect the parts."""
        config = model.config
        model_type = getattr(config, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise MergeError(
                f"strategy 'recompute' runs decoder layers one by one and is checked only for "
                f"{', '.join(sorted(SUPPORTED_MODEL_TYPES))}; {model.name} is {model_type!r} (use 'rerotate' or 'reprefill')"
            )
        impl = getattr(config, "_attn_implementation", None) or "eager"
        if impl not in ("sdpa", "eager"):
            raise MergeError(f"strategy 'recompute' needs attention 'sdpa' or 'eager' (it passes its own 4-D mask), not {impl!r}")
        for i, f in enumerate(fragments):
            if f.token_ids is None:
                raise MergeError(f"fragment {i} has no token ids, so its tokens cannot be recomputed; use strategy 'rerotate'")
            if f.token_ids.numel() != f.length:
                raise MergeError(f"fragment {i} has {f.token_ids.numel()} token ids for a cache of {f.length} tokens")
            if f.cache.layers[0].keys.shape[0] != 1:
                raise MergeError(f"strategy 'recompute' handles batch size 1; fragment {i} has batch {f.cache.layers[0].keys.shape[0]}")
        device = model.device
        base = model.model.base_model
        layers = list(base.layers)[: config.num_hidden_layers]
        rotary = find_rotary_module(base)
        params = inspect.signature(layers[0].forward).parameters
        cache_kw = next((n for n in ("cache", "past_key_values", "layer_past") if n in params), None)
        if cache_kw is None:
            raise MergeError(f"{type(layers[0]).__name__}.forward takes no cache argument; cannot recompute through it")
        return cls(
            model=model, fragments=fragments, landings=landings, total=landings[-1] + fragments[-1].length,
            ids=torch.cat([f.token_ids.reshape(-1) for f in fragments]).to(device), layers=layers,
            embed=base.get_input_embeddings(), rotary=rotary, types=layer_types(config),
            typed_rotary="layer_type" in inspect.signature(rotary.forward).parameters, cache_kw=cache_kw,
            eager=impl == "eager", device=device, dtype=model.dtype,
        )


@dataclass
class LayerKV:
    """What one layer of a recompute attends to and writes into.

    Attributes
    ----------
    keys, values : torch.Tensor
        ``[1, kv_heads, N, head_dim]`` full-length buffers: the recomputed tokens' fresh
        K/V are written into their slots, and the layer attends to slots ``lo .. hi-1``.
    avail : torch.Tensor or None
        ``[N]`` bool, the slots that hold a K/V (``None``: all of them).
    window : int or None
        The sliding window (``None``: full attention).
    done : callable or None
        ``done(keys, values)``, called after the layer ran (the write-back of step 4).
    """

    keys: torch.Tensor
    values: torch.Tensor
    avail: torch.Tensor | None
    window: int | None
    done: object = None


def _window(cache: DynamicCache, li: int) -> int | None:
    layer = cache.layers[li]
    return layer.sliding_window if layer.is_sliding else None


# --------------------------------------------------------------------------- step 1: select (deviation)


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
        return LayerKV(keys, values, None, _window(merged, li), done)

    run_layers(decoder, torch.arange(decoder.total), layer + 1, layer_kv, stop_after_kv=True)
    diff = merged.layers[layer].keys.float() - fresh["k"].float()
    return diff.pow(2).sum(dim=(0, 1, 3))


# --------------------------------------------------------------------------- step 2: positions and mask


def position_embeddings(decoder: Decoder, hidden: torch.Tensor, slots: torch.Tensor) -> list:
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
    list of (torch.Tensor, torch.Tensor)
        Per layer, ``cos`` and ``sin``, each ``[1, k, rotary_dim]``.
    """
    everything = torch.arange(decoder.total, device=decoder.device)[None]

    def pick(pe):
        return tuple(t.index_select(1, slots) for t in pe)

    if not decoder.typed_rotary:
        pe = pick(decoder.rotary(hidden, everything))
        return [pe] * len(decoder.layers)
    by_type = {t: pick(decoder.rotary(hidden, everything, t)) for t in set(decoder.types)}
    return [by_type[t] for t in decoder.types]


def attention_mask(decoder: Decoder, slots: torch.Tensor, avail: torch.Tensor | None, window: int | None,
                   lo: int, hi: int) -> torch.Tensor:
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
        return (torch.zeros(allowed.shape, dtype=decoder.dtype, device=decoder.device)
                .masked_fill_(~allowed, torch.finfo(decoder.dtype).min))
    return allowed


def layer_inputs(decoder: Decoder, merged: DynamicCache, li: int, slots: torch.Tensor,
                 rotator: KeyRotator) -> LayerKV:
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
    window = _window(merged, li)
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
    shape = (1, k0.shape[1], decoder.total, k0.shape[3])
    keys = torch.zeros(shape, dtype=k0.dtype, device=k0.device)
    values = torch.zeros(shape, dtype=k0.dtype, device=k0.device)
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


# --------------------------------------------------------------------------- step 3: run the layers


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
def run_layers(decoder: Decoder, slots: torch.Tensor, n_layers: int, layer_kv, stop_after_kv: bool = False) -> None:
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
        if everything and window is None and kv.avail is None and not decoder.eager:
            # A plain causal prefill: no mask lets sdpa take its causal path (skips the
            # masked half), as the model's own prefill does.
            mask = None
        elif kv.avail is None:
            if (window, lo, hi) not in masks:
                masks[window, lo, hi] = attention_mask(decoder, slots, None, window, lo, hi)
            mask = masks[window, lo, hi]
        else:
            mask = attention_mask(decoder, slots, kv.avail, window, lo, hi)
        stop = stop_after_kv and li == n_layers - 1
        writer = (_StoppingSlotWriter if stop else _SlotWriter)(kv.keys, kv.values, slots, lo, hi)
        try:
            out = decoder.layers[li](h, attention_mask=mask, position_ids=pos, position_embeddings=pes[li],
                                     **{decoder.cache_kw: writer})
        except _KVWritten:
            out = h
        h = out[0] if isinstance(out, tuple) else out
        if kv.done is not None:
            kv.done(kv.keys, kv.values)


# --------------------------------------------------------------------------- step 4: write back


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


@torch.inference_mode()
def recompute_tokens(decoder: Decoder, merged: DynamicCache, slots: torch.Tensor, rotator: KeyRotator) -> None:
    """Steps 2-4: replace, in place, the K/V of the tokens at ``slots`` in every layer of ``merged``.

    Parameters
    ----------
    decoder : Decoder
    merged : DynamicCache
        The re-rotated merge, ``[1, kv_heads, kept, head_dim]`` per layer; owned by the
        caller (nothing in it aliases a fragment).
    slots : torch.Tensor
        ``[k]`` ascending merged positions, ``k >= 1``.
    rotator : KeyRotator
        The merge's key rotator, reused for the fragments' sliding tails.
    """
    run_layers(decoder, slots, len(decoder.layers), lambda li: layer_inputs(decoder, merged, li, slots, rotator))
