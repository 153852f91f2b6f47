"""Defective caches built on purpose, so notebooks and tests can show each defect beside its fix.

Nothing here is for production use: every function returns something wrong, as the
MemOS bug reports describe, and says what is wrong in its docstring.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from kvlab.cache.fragments import Fragment, clone_cache


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
        logits = model.model(input_ids=ids, position_ids=pos, cache=cache, use_cache=True, logits_to_keep=1).logits
        nxt = int(logits[0, -1].argmax())
        out.append(nxt)
        if len(out) == new_tokens:
            break
        ids = torch.tensor([[nxt]], device=device)
    return model.tokenizer.decode(out)
