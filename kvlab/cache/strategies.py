"""Merge strategies, one small class each, behind a registry.

A strategy turns fragments (already validated by :func:`kvlab.merge`) into one
``DynamicCache`` whose slot ``j`` holds the token at position ``j``. Register a new one
with ``@register("name")``; :func:`kvlab.merge` and the explorer pick it up by name.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch
from transformers import DynamicCache

from kvlab.cache.fragments import Fragment, clone_cache, joined_prefill, new_cache, set_length
from kvlab.errors import MergeError
from kvlab.models.layout import layer_ropes
from kvlab.models.loaded import LoadedModel
from kvlab.models.rope import apply_rotation, check_composable, longrope_inv_freq, rotation

STRATEGIES: dict[str, type[Strategy]] = {}


def register(name: str):
    """Class decorator adding a strategy to the registry under ``name``."""

    def deco(cls):
        if name in STRATEGIES:
            raise ValueError(f"strategy {name!r} registered twice")
        cls.name = name
        STRATEGIES[name] = cls
        return cls

    return deco


def strategy_names() -> list[str]:
    return list(STRATEGIES)


class Strategy(ABC):
    """Base class: ``strategy(fragments, landings, model) -> DynamicCache``."""

    name: ClassVar[str]
    needs_model: ClassVar[bool] = False

    @abstractmethod
    def __call__(self, fragments: list[Fragment], landings: list[int], model: LoadedModel | None) -> DynamicCache: ...

    @classmethod
    def summary(cls) -> str:
        return (cls.__doc__ or "").strip().splitlines()[0]


def concat_layers(fragments: list[Fragment], landings: list[int], write_keys=None, slots=None) -> DynamicCache:
    """Concatenate fragments layer by layer, through ``cache.update``.

    ``write_keys(x, layer_idx, fragment, landing, out)`` fills ``out`` (a slice of the merged
    tensor, same shape as ``x``) from the fragment's phase-carrying tensor ``x``: the keys, or
    the values where ``slots[layer_idx] == "values"`` (transformers caches multi-head latent
    attention's rotary key there). The other tensor is copied, as is everything when
    ``write_keys`` is ``None``. Sliding-window layers get only the tokens a real prefill of the
    merged length would keep (the last ``window - 1``), and their length counts every merged token.
    """
    total = landings[-1] + fragments[-1].length
    merged = new_cache(fragments[0].config)
    for li in range(fragments[0].num_layers):
        layer0 = fragments[0].cache.layers[li]
        first_kept = total - (layer0.sliding_window - 1) if layer0.is_sliding else 0
        pieces = []
        for f, land in zip(fragments, landings):
            kept = f.cache.layers[li].keys.shape[-2]
            slot0 = land + f.length - kept  # merged slot of the first token this layer kept
            skip = max(0, first_kept - slot0)
            if skip < kept:
                pieces.append((f, land, skip))
        turned = (slots[li] if slots is not None else "keys") if write_keys is not None else None
        K = _joined(pieces, li, "keys", write_keys if turned == "keys" else None)
        V = _joined(pieces, li, "values", write_keys if turned == "values" else None)
        merged.update(K, V, li)
        set_length(merged.layers[li], total)
    return merged


def _joined(pieces: list, li: int, slot: str, write) -> torch.Tensor:
    """``[batch, heads, n, dim]``: the kept tokens of ``slot`` at layer ``li`` of every piece, in order."""
    parts = [getattr(f.cache.layers[li], slot)[..., skip:, :] for f, _, skip in pieces]
    if write is None:
        return torch.cat(parts, dim=-2)
    x0 = parts[0]
    out = torch.empty(
        x0.shape[0], x0.shape[1], sum(x.shape[-2] for x in parts), x0.shape[3], dtype=x0.dtype, device=x0.device
    )
    at = 0
    for (f, land, _), x in zip(pieces, parts):
        write(x, li, f, land, out[..., at : at + x.shape[-2], :])
        at += x.shape[-2]
    return out


@register("naive")
@dataclass
class Naive(Strategy):
    """Bare per-layer concatenation; keys keep the phase of their own fragment (the defect).

    This is how MemOS merged cached memories: it exists to reproduce the bug. Fragment
    ``j`` lands at slots ``L_0 + ... + L_{j-1}`` onward while its keys still say
    ``0 .. L_j - 1``; values are position-free, so they come out right.
    """

    def __call__(self, fragments, landings, model=None):
        return concat_layers(fragments, landings)


@register("fail")
@dataclass
class Fail(Strategy):
    """Refuse to merge: keys carry their fragment's RoPE phase, so concatenation is wrong."""

    def __call__(self, fragments, landings, model=None):
        if len(fragments) > 1:
            raise MergeError(
                f"refusing to merge {len(fragments)} fragments: cached keys carry the RoPE phase of the positions they "
                "were computed at, so a concatenation puts every fragment after the first at the wrong phase; "
                "use 'rerotate' (exact phase) or 'reprefill' (exact, full context)"
            )
        (f,) = fragments
        if f.start != 0:
            raise MergeError(
                f"refusing a fragment prefilled at start={f.start}: it would sit at slot 0 with the phase of {f.start}"
            )
        return clone_cache(f.cache, f.config)


@register("reprefill")
@dataclass
class Reprefill(Strategy):
    """One prefill of the joined source tokens: exact by construction, and the slowest."""

    needs_model: ClassVar[bool] = True

    def __call__(self, fragments, landings, model):
        return joined_prefill(model, fragments).cache


@register("rerotate")
@dataclass
class Rerotate(Strategy):
    """Rotate each fragment's keys from its own positions to where it lands: exact phase.

    Uses the model's rotary module per layer (Gemma 3's two bases, partial rotary dims) and
    unscaled rotations (the attention scaling is already in the keys, once). Schedules
    that do not compose (dynamic NTK, longrope across its switch) are refused. What it
    cannot fix: fragments never attended to each other (the context error).
    """

    needs_model: ClassVar[bool] = True

    def __call__(self, fragments, landings, model):
        rotator = KeyRotator(model, fragments, landings)
        return concat_layers(fragments, landings, rotator, rotator.slots)


class KeyRotator:
    """Writes a fragment's phase-carrying tensor turned from its own positions to where it lands.

    The writer of :func:`concat_layers` for :class:`Rerotate`, shared with the ``recompute``
    strategy. It follows each layer's layout (:class:`~kvlab.models.rope.LayerRope`): its
    pairing, the slot that carries the phase (:attr:`slots`), and NoPE layers, which it
    copies. Layers of one type share a frequency tensor, so each (frequencies, shift) rotation
    is built once per merge, not once per layer (it dominates short merges otherwise). Refuses
    schedules that do not compose.
    """

    def __init__(self, model: LoadedModel, fragments: list[Fragment], landings: list[int]):
        self.ropes = layer_ropes(model.model)
        self.inv_freqs = rerotation_frequencies(model, fragments, landings, self.ropes)
        #: Per layer, the tensor that carries the phase (``keys`` or ``values``).
        self.slots = [r.slot for r in self.ropes]
        self._rotations: dict = {}

    def __call__(self, k: torch.Tensor, li: int, f: Fragment, land: int, out: torch.Tensor) -> None:
        """Write ``k`` (``[batch, heads, n, dim]``, layer ``li``'s phase slot of ``f``) turned to ``land`` into ``out``."""
        delta = land - f.start
        rope = self.ropes[li]
        if delta == 0 or rope.nope:
            out.copy_(k)
            return
        inv_freq = self.inv_freqs[li]
        key = (id(inv_freq), rope.pairing, delta, k.dtype, k.device)
        if key not in self._rotations:
            self._rotations[key] = rotation(inv_freq, delta, k.dtype, k.device, rope.pairing)
        apply_rotation(k, *self._rotations[key], out=out, pairing=rope.pairing)


def rerotation_frequencies(
    model: LoadedModel, fragments: list[Fragment], landings: list[int], ropes: list | None = None
) -> list[torch.Tensor]:
    """Per layer ``[rotary_dim // 2]`` inverse frequencies in force for this merge (refusing non-composing ones).

    ``ropes``: the model's :func:`~kvlab.models.layout.layer_ropes`, where the caller has them
    already (reading them walks every module of the model).
    """
    spans = [(f.start, f.length, land) for f, land in zip(fragments, landings)]
    out = []
    for rope in ropes if ropes is not None else layer_ropes(model.model):
        long = check_composable(rope, spans)
        out.append(longrope_inv_freq(model.model, rope, long) if rope.rope_type == "longrope" else rope.inv_freq)
    return out
