"""Defective caches built on purpose, so notebooks and tests can show each defect beside its fix.

Nothing here is for production use: every function returns something wrong, as the
MemOS bug reports describe, and says what is wrong in its docstring.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from kvlab.cache.fragments import Fragment, clone_cache, joined_prefill
from kvlab.cache.recompute.decoder import Decoder
from kvlab.cache.recompute.inputs import attention_mask
from kvlab.cache.recompute.strategy import Recompute
from kvlab.cache.strategies import KeyRotator, Rerotate, Strategy, concat_layers
from kvlab.compat import forward
from kvlab.errors import MergeError
from kvlab.models.layout import layer_ropes


def assigned_merge(fragments: list[Fragment]) -> DynamicCache:
    """DEFECT: a merge built by assigning ``.keys``/``.values`` onto fresh cache layers.

    The layers are never marked initialized, so on transformers >= 4.57 the cache reports
    ``get_seq_length() == 0`` and the next forward overwrites (drops) every merged token.
    Keys are also concatenated without re-rotation.
    """
    config = fragments[0].config
    cache = DynamicCache(config=config)
    for li in range(fragments[0].num_layers):
        src = fragments[0].cache.layers[li]
        layer = DynamicSlidingWindowLayer(src.sliding_window) if src.is_sliding else DynamicLayer()
        layer.keys = torch.cat([f.cache.layers[li].keys for f in fragments], dim=-2)
        layer.values = torch.cat([f.cache.layers[li].values for f in fragments], dim=-2)
        cache.layers[li] = layer
    return cache


class ByReferenceStore:
    """DEFECT: a cache store that hands out the stored cache object itself.

    ``generate`` appends to the cache it is given, so every turn that reads the store
    grows the stored cache (6 -> 19 -> 32 -> ... tokens in the MemOS report).
    """

    def __init__(self):
        self._items: dict[str, DynamicCache] = {}
        self._configs: dict[str, object] = {}

    def put(self, key: str, cache: DynamicCache, config) -> None:
        self._items[key] = cache
        self._configs[key] = config

    def get(self, key: str) -> DynamicCache:
        return self._items[key]

    def stored_length(self, key: str) -> int:
        return self._items[key].get_seq_length()


class CopyingStore(ByReferenceStore):
    """The fix: store a private copy and hand out copies, so readers cannot grow it."""

    def put(self, key: str, cache: DynamicCache, config) -> None:
        super().put(key, clone_cache(cache, config), config)

    def get(self, key: str) -> DynamicCache:
        return clone_cache(self._items[key], self._configs[key])


@torch.inference_mode()
def chat_turn(model, cache: DynamicCache, query: str, new_tokens: int = 12) -> str:
    """One turn of a chat that reuses a stored cache: read ``query`` behind it, answer greedily.

    The cache given is extended in place, as ``generate`` does: by the query's tokens and
    every answer token but the last.
    """
    device = model.device
    ids = torch.tensor(model.tokenizer(query, add_special_tokens=False)["input_ids"], dtype=torch.long, device=device)[
        None
    ]
    out = []
    for _ in range(new_tokens):
        n = cache.get_seq_length()
        pos = torch.arange(n, n + ids.shape[-1], device=device)[None]
        logits = forward(model.model, cache, input_ids=ids, position_ids=pos, use_cache=True, logits_to_keep=1).logits
        nxt = int(logits[0, -1].argmax())
        out.append(nxt)
        if len(out) == new_tokens:
            break
        ids = torch.tensor([[nxt]], device=device)
    return model.tokenizer.decode(out)


def bottom_right_mask(
    decoder: Decoder, slots: torch.Tensor, avail: torch.Tensor | None, window: int | None, lo: int, hi: int
) -> torch.Tensor:
    """DEFECT: the recomputed tokens' causal mask aligned to the bottom right, as a plain causal
    attention call over ``k`` queries and ``hi - lo`` keys aligns it.

    The ``i``-th recomputed token (of ``k``, ascending) is masked as if it stood at slot
    ``hi - k + i`` whatever its own position, so a token early in the merge attends to slots
    after it: the future leaks into its recomputed K/V. The window and the missing slots are
    applied around that wrong position. Where the tokens are a contiguous suffix (ratio 1, or
    every token after fragment 0) the two alignments agree, which is why checks at those
    ratios never see it. Same shape and dtype convention as
    :func:`kvlab.cache.recompute.inputs.attention_mask`.
    """
    k = slots.numel()
    aligned = hi - k + torch.arange(k, device=slots.device)
    return attention_mask(decoder, aligned, avail, window, lo, hi)


class BottomRightRecompute(Recompute):
    """DEFECT: :class:`kvlab.Recompute` with :func:`bottom_right_mask` in place of the causal-by-position mask.

    The same selection and the same layers; only who each recomputed token attends to differs.
    Not registered as a strategy: build it here to measure the defect beside the fix.
    """

    mask = staticmethod(bottom_right_mask)


@dataclass
class RerotateOnly(Strategy):
    """ABLATION: ``rerotate`` on the layers of one type, a naive merge on every other layer.

    Gemma 3 turns its sliding layers with one rope base and its full layers with another;
    re-rotating one type alone shows which of them carries a naive merge's damage. Not
    registered as a strategy: build it here to measure beside ``naive`` and ``rerotate``.

    Parameters
    ----------
    layer_type : str
        ``sliding_attention`` or ``full_attention`` (as ``config.layer_types`` names them).
    """

    layer_type: str = "sliding_attention"
    needs_model: ClassVar[bool] = True
    name: ClassVar[str] = "rerotate-only"

    def __call__(self, fragments, landings, model):
        types = _layer_types(model, self.layer_type)
        rotate = KeyRotator(model, fragments, landings)

        def write(k, li, f, land, out):
            if types[li] == self.layer_type:
                rotate(k, li, f, land, out)
            else:
                out.copy_(k)

        return concat_layers(fragments, landings, write, rotate.slots)


def _layer_types(model, layer_type: str) -> list[str]:
    types = [r.layer_type for r in layer_ropes(model.model)]
    if layer_type not in types:
        raise MergeError(f"{model.name} has no {layer_type!r} layers (it has {sorted(set(types))})")
    return types


@dataclass
class ExactOnly(Strategy):
    """ABLATION: the joined prefill's keys and values on the layers of one type, ``rerotate``'s on every other layer.

    Rerotate's phase is exact; what it still misses is context: its fragments never attended
    to each other. Giving one layer type the K/V that did see the whole context shows how much
    of that gap lives in those layers' caches. Not registered as a strategy.

    Parameters
    ----------
    layer_type : str
        ``sliding_attention`` or ``full_attention``. The swapped layers keep what the joined
        prefill keeps (a sliding layer: its last ``window - 1`` tokens), as a merge does.
    """

    layer_type: str = "sliding_attention"
    needs_model: ClassVar[bool] = True
    name: ClassVar[str] = "exact-only"

    def __call__(self, fragments, landings, model):
        types = _layer_types(model, self.layer_type)
        cache = Rerotate()(fragments, landings, model)
        joined = joined_prefill(model, fragments).cache
        for li, t in enumerate(types):
            if t == self.layer_type:
                cache.layers[li] = joined.layers[li]
        return cache
