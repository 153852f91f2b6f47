"""transformers' own cache operations that a store calls, each as a press: prefill, then the operation.

* ``crop``: ``DynamicCache.crop(-r)`` removes the last ``r`` tokens and the sequence goes on at
  ``n - r`` (``positions=kept``: slot ``j`` at ``j``), as speculative decoding and prefix reuse
  call it. The negative form is the one every release reads alike: up to 5.x's layered caches a
  positive ``crop(m)`` kept ``m`` tokens; 5.24 raises ``ValueError`` on it (a clear error, not a
  silent change).
* ``select``: a batch of two sequences, ``reorder_cache`` swaps them and ``batch_select_indices``
  keeps one: every token of it, at its own positions (``positions=original``), as beam search and
  a batched store's eviction of a finished request call them.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from kvlab.compat import forward


@torch.no_grad()
def crop(model, input_ids):
    """Prefill ``input_ids`` ``[1, n]``, then ``cache.crop(-(n - n // 2))``: the first ``n // 2`` tokens stay."""
    n = input_ids.shape[-1]
    cache = DynamicCache(config=model.config)
    forward(model, cache, input_ids=input_ids, use_cache=True)
    cache.crop(-(n - n // 2))
    return cache


@torch.no_grad()
def select(model, input_ids):
    """Prefill ``[other, input_ids]`` (``[2, n]``), ``reorder_cache([1, 0])``, then ``batch_select_indices([0])``."""
    other = (input_ids.flip(-1) + 1) % model.config.vocab_size
    cache = DynamicCache(config=model.config)
    forward(model, cache, input_ids=torch.cat([other, input_ids]), use_cache=True)
    cache.reorder_cache(torch.tensor([1, 0]))
    cache.batch_select_indices(torch.tensor([0]))
    return cache
