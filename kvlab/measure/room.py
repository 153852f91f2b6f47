"""Room for probes behind a cache: its past copied once, new keys/values written in place, and the masks that go with it.

:func:`kvlab.measure.probes.read_probes` packs many probes, their continuations and their
greedy tokens into the slots after one copy of a cache's past (:class:`ProbeCache`), and
tells the model who sees whom with one 4-D mask per kind of layer (:func:`masks`).

Why not the caller's ``DynamicCache``: in transformers 5.24 ``DynamicLayer.update`` (and
``DynamicSlidingWindowLayer.update``) build new tensors with ``torch.cat([self.keys,
key_states])`` and rebind them, never writing into the old ones; so reading behind the
caller's cache would leave it intact only after a clone, and still copy the whole past once
more for every decoded token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache, CacheLayerMixin

from kvlab.errors import MergeError
from kvlab.models.layout import layer_types
from kvlab.models.loaded import LoadedModel

#: What a slot after the past holds, for :func:`visible`: the probe or a greedy token (seen by
#: every later token of its probe), a continuation or a draft token (seen by later tokens of the
#: same kind only), or nothing any more (a rejected draft token).
PROBE, CONTINUATION, DRAFT, DEAD = 0, 1, 2, -1


class ProbeLayer(CacheLayerMixin):
    """One layer's past, copied once, with room after it that new keys/values are written into.

    Stands in for the caller's layer during a read. ``update`` copies the new tokens into
    the room (the past is not copied again) and returns views of every slot written so
    far; :func:`visible`'s mask says which of them each token attends to.

    Parameters
    ----------
    layer : CacheLayerMixin
        The caller's layer: keys/values ``[1, kv_heads, kept, head_dim]`` holding positions
        ``seen - kept .. seen - 1`` (a sliding layer keeps its last ``window - 1``). Only read.
    room : int
        Slots after the past.
    """

    is_compileable = False
    is_croppable = False

    def __init__(self, layer: CacheLayerMixin, room: int):
        super().__init__()
        k, v = layer.keys, layer.values
        self.kept, self.seen = k.shape[-2], layer.get_seq_length()
        self.is_sliding = bool(getattr(layer, "is_sliding", False))
        self.window = getattr(layer, "sliding_window", None) if self.is_sliding else None
        self.keys = k.new_empty((1, k.shape[1], self.kept + room, k.shape[3]))
        self.values = v.new_empty((1, v.shape[1], self.kept + room, v.shape[3]))
        # The one copy of the past in a read: every probe and decoded token attends to these slots.
        self.keys[:, :, : self.kept] = k
        self.values[:, :, : self.kept] = v
        self.fill = self.kept
        self.device, self.is_initialized = k.device, True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor | None = None) -> None:
        pass  # allocated in __init__, from the caller's layer

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Write ``[1, kv_heads, n, head_dim]`` new keys/values after the last slot; return all slots written."""
        n = key_states.shape[-2]
        if self.fill + n > self.keys.shape[-2]:
            raise MergeError(f"a probe read overflows its room: {self.fill + n} > {self.keys.shape[-2]} slots")
        self.keys[:, :, self.fill : self.fill + n] = key_states
        self.values[:, :, self.fill : self.fill + n] = value_states
        self.fill += n
        return self.keys[:, :, : self.fill], self.values[:, :, : self.fill]

    def rewind(self) -> None:
        """Forget the slots written after the past: the next group of probes writes over them."""
        self.fill = self.kept

    def past_positions(self) -> torch.Tensor:
        """``[kept]`` positions of the past's slots."""
        return torch.arange(self.seen - self.kept, self.seen, device=self.device)

    def get_seq_length(self) -> int:
        return self.seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.fill + query_length, 0  # not used: read_probes hands the model its own 4-D masks

    def get_max_length(self) -> int:
        return self.keys.shape[-2]

    def get_max_cache_shape(self) -> int:
        # 4.x's CacheLayerMixin declares it abstract; the room is all the layer will ever hold.
        return self.keys.shape[-2]


class ProbeCache(Cache):
    """The caller's cache as :class:`ProbeLayer` s: its past copied once, with ``room`` slots after it."""

    def __init__(self, cache: DynamicCache, room: int):
        super().__init__(layers=[ProbeLayer(layer, room) for layer in cache.layers])

    def rewind(self) -> None:
        for layer in self.layers:
            layer.rewind()


@dataclass
class Slots:
    """Whose each slot written after the past is, in the order written.

    Attributes
    ----------
    pos : torch.Tensor
        ``[n]`` int64 absolute position.
    seq : torch.Tensor
        ``[n]`` int64 index of the probe (in its group).
    kind : torch.Tensor
        ``[n]`` int64: :data:`PROBE`, :data:`CONTINUATION`, :data:`DRAFT` or :data:`DEAD`.
    """

    pos: torch.Tensor
    seq: torch.Tensor
    kind: torch.Tensor

    def add(self, other: Slots) -> None:
        self.pos, self.seq, self.kind = (torch.cat([a, b]) for a, b in zip(self.astuple(), other.astuple()))

    def astuple(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.pos, self.seq, self.kind


def visible(layer: ProbeLayer, slots: Slots, queries: Slots) -> torch.Tensor:
    """``[Q, kept + n]`` bool: which slots each query token attends to on ``layer``.

    A token at position ``p`` of probe ``i`` sees the past and the slots of probe ``i`` at
    positions ``<= p`` that are probe or greedy tokens, or of its own kind (a continuation
    sees its continuation, a draft its draft); on a sliding layer only positions ``> p -
    window``. That is what it would see read alone behind the cache. ``slots`` holds the
    queries' own slots already: a layer writes them before it attends.
    """
    p = queries.pos[:, None]
    own = (slots.seq[None, :] == queries.seq[:, None]) & (slots.pos[None, :] <= p)
    own &= (slots.kind[None, :] == PROBE) | (slots.kind[None, :] == queries.kind[:, None])
    own &= slots.kind[None, :] != DEAD
    past = torch.ones((len(queries.pos), layer.kept), dtype=torch.bool, device=p.device)
    if layer.window is not None:
        past &= layer.past_positions()[None, :] > p - layer.window
        own &= slots.pos[None, :] > p - layer.window
    return torch.cat([past, own], dim=1)


def masks(model: LoadedModel, cache: ProbeCache, slots: Slots, queries: Slots):
    """The 4-D attention mask(s) of one forward pass, as the model takes them.

    One ``[1, 1, Q, kept + n]`` mask per kind of layer (same ``kept`` and window): a model with
    one kind gets the tensor, a hybrid one (Gemma 3) a dict by layer type. Additive floats (0
    or the dtype's minimum) for sdpa as for eager attention: handed a boolean mask, torch's
    CPU sdpa converts it in every layer (measured: 9% of a read).
    """
    by_type: dict[str, torch.Tensor] = {}
    kinds: dict[tuple, torch.Tensor] = {}
    for t, layer in zip(layer_types(model.config), cache.layers):
        kind = (layer.kept, layer.window)
        if kind not in kinds:
            seen = visible(layer, slots, queries)[None, None]
            kinds[kind] = torch.zeros(seen.shape, dtype=model.dtype, device=seen.device).masked_fill_(
                ~seen, torch.finfo(model.dtype).min
            )
        if by_type.setdefault(t, kinds[kind]) is not kinds[kind]:
            raise MergeError(f"layers of type {t!r} hold different lengths or windows; one mask cannot serve them")
    return next(iter(kinds.values())) if len(kinds) == 1 else by_type
