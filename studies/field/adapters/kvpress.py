"""kvpress 0.5.5: presses run as its pipeline runs them, ``with press(model)`` around a prefill of the base model.

``KVPressTextGenerationPipeline`` prefills ``model.model`` (no LM head) inside ``with press(model)``
and hands on the cache the hooks compressed. After a ``KeyRerotationPress`` it reads the next token
at ``cache.get_seq_length()``; after any other press at the context's own length, passing
``position_ids`` itself (the audit's ``reader="explicit"``). Its README also shows
``with press(model): model.generate(...)``, where generate takes positions from the cache
(``reader="cache"``).
"""

from __future__ import annotations

import torch
from kvpress import KeyRerotationPress, KnormPress, SnapKVPress, StreamingLLMPress
from transformers import DynamicCache

from kvlab.compat import forward

#: The fraction of the context each press removes (kvpress's ``compression_ratio``).
RATIO = 0.5

#: SnapKV's observation window (its last queries score the keys). kvpress's default, 64, asserts a
#: longer context than the audit's 48 tokens on a model without a sliding window.
SNAPKV_WINDOW = 16


def _pressed(press, model, input_ids) -> DynamicCache:
    cache = DynamicCache()
    # The pipeline runs its forward passes without autograd (transformers' Pipeline.forward).
    with torch.no_grad(), press(model):
        forward(model.model, cache, input_ids=input_ids)
    return cache


def rerotated_knorm(model, input_ids):
    """``KeyRerotationPress(press=KnormPress(0.5))`` (``--press``, ``positions=kept``)."""
    return _pressed(KeyRerotationPress(press=KnormPress(compression_ratio=RATIO)), model, input_ids)


def rerotated_snapkv(model, input_ids):
    """``KeyRerotationPress(press=SnapKVPress(0.5, window_size=16))`` (``--press``, ``positions=kept``)."""
    press = SnapKVPress(compression_ratio=RATIO, window_size=SNAPKV_WINDOW)
    return _pressed(KeyRerotationPress(press=press), model, input_ids)


def streaming_llm(model, input_ids):
    """``StreamingLLMPress(0.5)``: sinks and the recent window, keys left at their phase (``positions=original``)."""
    return _pressed(StreamingLLMPress(compression_ratio=RATIO), model, input_ids)


def knorm(model, input_ids):
    """``KnormPress(0.5)``: keys left at their phase (``positions=original``)."""
    return _pressed(KnormPress(compression_ratio=RATIO), model, input_ids)
