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
        rotator = KeyRotator(model, fragments, landings)
        merged = concat_layers(fragments, landings, rotator)
        total = landings[-1] + fragments[-1].length
        if self.budget(total) == 0:
            return merged
        run = _Runner(model, fragments, landings, rotator)
        chosen = self._select(run, merged)
        run.recompute(merged, chosen)
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
        return self._select(_Runner(model, fragments, landings), merged)

    def _select(self, run: "_Runner", merged: DynamicCache | None) -> torch.Tensor:
        k = self.budget(run.total)
        if k == run.total:
            return torch.arange(run.total)
        if self.policy == "random":
            g = torch.Generator().manual_seed(self.seed)
            return torch.randperm(run.total, generator=g)[:k].sort().values
        if self.policy == "fragment_start":
            return fragment_start_positions([f.length for f in run.fragments], run.landings, k)
        layer = self._check_layer(run, merged)
        dev = run.key_deviation(merged, layer)
        # Sorted so the chosen tokens run in position order (any order is exact; this one is cache-friendly).
        return torch.topk(dev, k).indices.sort().values

    def _check_layer(self, run: "_Runner", merged: DynamicCache) -> int:
        n_layers = len(merged.layers)

        def holds_all(li):
            return merged.layers[li].keys.shape[-2] == run.total

        if self.check_layer is not None:
            if self.check_layer >= n_layers:
                raise MergeError(f"check_layer {self.check_layer} is out of range: the model has {n_layers} layers")
            if not holds_all(self.check_layer):
                raise MergeError(
                    f"check_layer {self.check_layer} is a sliding-window layer holding only the last "
                    f"{merged.layers[self.check_layer].keys.shape[-2]} of {run.total} merged tokens, so the others have no "
                    "cached key to compare; pick a full-attention layer (or leave check_layer unset)"
                )
            return self.check_layer
        for li in range(min(1, n_layers - 1), n_layers):
            if holds_all(li):
                return li
        raise MergeError(
            f"no layer of this model holds all {run.total} merged tokens (every layer is sliding-window), so the "
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


class _Runner:
    """Runs the model's decoder layers on a subset of the merged tokens."""

    def __init__(self, model: LoadedModel, fragments: list[Fragment], landings: list[int],
                 rotator: KeyRotator | None = None):
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
        self.model, self.fragments, self.landings = model, fragments, landings
        self.total = landings[-1] + fragments[-1].length
        self.device, self.dtype = model.device, model.dtype
        self.ids = torch.cat([f.token_ids.reshape(-1) for f in fragments]).to(self.device)
        self.eager = impl == "eager"
        base = model.model.base_model
        self.layers = list(base.layers)[: config.num_hidden_layers]
        self.embed = base.get_input_embeddings()
        self.rotary = find_rotary_module(base)
        self.types = layer_types(config)
        self.typed_rotary = "layer_type" in inspect.signature(self.rotary.forward).parameters
        params = inspect.signature(self.layers[0].forward).parameters
        self.cache_kw = next((n for n in ("cache", "past_key_values", "layer_past") if n in params), None)
        if self.cache_kw is None:
            raise MergeError(f"{type(self.layers[0]).__name__}.forward takes no cache argument; cannot recompute through it")
        self._rotator = rotator

    def _position_embeddings(self, h: torch.Tensor, slots: torch.Tensor) -> list:
        """Per layer ``(cos, sin)``, each ``[1, k, rotary_dim]``, for the tokens at ``slots``.

        Computed for all ``N`` positions and then indexed: schedules that pick their
        frequencies from the largest position of a forward (longrope) must see the
        merged length, as the joined prefill does, not the last recomputed token.
        """
        everything = torch.arange(self.total, device=self.device)[None]

        def pick(pe):
            return tuple(t.index_select(1, slots) for t in pe)

        if not self.typed_rotary:
            pe = pick(self.rotary(h, everything))
            return [pe] * len(self.layers)
        by_type = {t: pick(self.rotary(h, everything, t)) for t in set(self.types)}
        return [by_type[t] for t in self.types]

    def _mask(self, slots: torch.Tensor, avail: torch.Tensor | None, window: int | None, lo: int, hi: int) -> torch.Tensor:
        """``[1, 1, k, hi - lo]``: bool for sdpa, additive float for eager attention."""
        kv = torch.arange(lo, hi, device=self.device)
        p = slots[:, None]
        allowed = kv[None, :] <= p
        if window is not None:
            allowed &= kv[None, :] > p - window
        if avail is not None:
            allowed &= avail[lo:hi][None, :]
        allowed = allowed[None, None]
        if self.eager:
            return torch.zeros(allowed.shape, dtype=self.dtype, device=self.device).masked_fill_(~allowed, torch.finfo(self.dtype).min)
        return allowed

    @torch.inference_mode()
    def forward(self, slots: torch.Tensor, n_layers: int, layer_kv, stop_after_kv: bool = False) -> None:
        """Run layers ``0 .. n_layers-1`` on the tokens at ``slots``.

        Parameters
        ----------
        slots : torch.Tensor
            ``[k]`` ascending merged positions of the tokens to run.
        n_layers : int
        layer_kv : callable
            ``layer_kv(li) -> (keys, values, avail, window, done)``: full-length
            ``[1, kv_heads, N, head_dim]`` buffers the layer attends to and writes the
            tokens' fresh K/V into, ``[N]`` bool of the slots holding a K/V (``None``: all),
            the sliding window (``None``: full attention), and ``done(keys, values)``
            called after the layer (or ``None``).
        stop_after_kv : bool
            Leave the last layer as soon as its K/V are written (its attention and MLP
            would only feed layers that are not run).
        """
        slots = slots.to(self.device)
        pos = slots[None]
        h = self.embed(self.ids[slots][None])
        pes = self._position_embeddings(h, slots)
        first, last = int(slots[0]), int(slots[-1])
        everything = first == 0 and last == slots.numel() - 1
        masks = {}
        for li in range(n_layers):
            keys, values, avail, window, done = layer_kv(li)
            # Slots past the last token run, or before the first one's window, are never seen.
            lo = 0 if window is None else max(0, first - window + 1)
            hi = last + 1
            if window is not None and window > last:
                window = None  # no token run here reaches past its window
            if everything and window is None and avail is None and not self.eager:
                # A plain causal prefill: no mask lets sdpa take its causal path (skips the
                # masked half), as the model's own prefill does.
                mask = None
            elif avail is None:
                if (window, lo, hi) not in masks:
                    masks[window, lo, hi] = self._mask(slots, None, window, lo, hi)
                mask = masks[window, lo, hi]
            else:
                mask = self._mask(slots, avail, window, lo, hi)
            stop = stop_after_kv and li == n_layers - 1
            writer = (_StoppingSlotWriter if stop else _SlotWriter)(keys, values, slots, lo, hi)
            try:
                out = self.layers[li](h, attention_mask=mask, position_ids=pos, position_embeddings=pes[li],
                                      **{self.cache_kw: writer})
            except _KVWritten:
                out = h
            h = out[0] if isinstance(out, tuple) else out
            if done is not None:
                done(keys, values)

    def key_deviation(self, merged: DynamicCache, layer: int) -> torch.Tensor:
        """``[N]`` float32: ``sum_{heads, dims} (K_merged - K_fresh)^2`` at ``layer``.

        ``K_fresh`` comes from a prefill of every token through layers ``0 .. layer``
        (the last one only up to its keys).
        """
        fresh = {}

        def layer_kv(li):
            k0 = merged.layers[li].keys
            shape = (1, k0.shape[1], self.total, k0.shape[3])
            keys = torch.empty(shape, dtype=k0.dtype, device=k0.device)
            values = torch.empty(shape, dtype=k0.dtype, device=k0.device)
            window = self._window(merged, li)
            return keys, values, None, window, (lambda k, v: fresh.__setitem__("k", k)) if li == layer else None

        self.forward(torch.arange(self.total), layer + 1, layer_kv, stop_after_kv=True)
        diff = merged.layers[layer].keys.float() - fresh["k"].float()
        return diff.pow(2).sum(dim=(0, 1, 3))

    @staticmethod
    def _window(cache: DynamicCache, li: int) -> int | None:
        layer = cache.layers[li]
        return layer.sliding_window if layer.is_sliding else None

    @torch.inference_mode()
    def recompute(self, merged: DynamicCache, slots: torch.Tensor) -> None:
        """Replace, in place, the K/V of the tokens at ``slots`` in every layer of ``merged``.

        Parameters
        ----------
        merged : DynamicCache
            The re-rotated merge, ``[1, kv_heads, kept, head_dim]`` per layer; owned by
            the caller (nothing in it aliases a fragment).
        slots : torch.Tensor
            ``[k]`` ascending merged positions, ``k >= 1``.
        """
        n = self.total

        def layer_kv(li):
            layer = merged.layers[li]
            kept = layer.keys.shape[-2]
            window = self._window(merged, li)
            if kept == n:
                # Full attention (or a sliding layer still holding everything): the merged
                # tensors themselves are the buffers, so the fresh K/V land in place.
                return layer.keys, layer.values, None, window, None
            keys, values, avail = self._sliding_buffers(merged, li)
            avail[slots.to(self.device)] = True

            def done(k, v):
                # Only the tokens this layer keeps go back; the others needed fresh K/V
                # just for the tokens recomputed with them inside this layer.
                first_kept = n - kept
                back = slots[slots >= first_kept].to(self.device)
                layer.keys.index_copy_(2, back - first_kept, k.index_select(2, back))
                layer.values.index_copy_(2, back - first_kept, v.index_select(2, back))

            return keys, values, avail, window, done

        self.forward(slots, len(self.layers), layer_kv)

    def _sliding_buffers(self, merged: DynamicCache, li: int):
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
        if self._rotator is None:
            self._rotator = KeyRotator(self.model, self.fragments, self.landings)
        layer = merged.layers[li]
        k0 = layer.keys
        kept = k0.shape[-2]
        tail = self.total - kept  # slots from here on are the merged layer's own (already re-rotated)
        shape = (1, k0.shape[1], self.total, k0.shape[3])
        keys = torch.zeros(shape, dtype=k0.dtype, device=k0.device)
        values = torch.zeros(shape, dtype=k0.dtype, device=k0.device)
        avail = torch.zeros(self.total, dtype=torch.bool, device=self.device)
        for f, land in zip(self.fragments, self.landings):
            fk, fv = f.cache.layers[li].keys, f.cache.layers[li].values
            end = land + f.length
            s0 = end - fk.shape[-2]
            s1 = min(end, tail)
            if s1 > s0:
                self._rotator(fk[..., : s1 - s0, :], li, f, land, keys[..., s0:s1, :])
                values[..., s0:s1, :] = fv[..., : s1 - s0, :]
            avail[s0:end] = True
        keys[..., tail:, :] = k0
        values[..., tail:, :] = layer.values
        return keys, values, avail
