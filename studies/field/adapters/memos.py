"""MemOS (MemoryOS on PyPI), ``memos/memories/activation/kv.py``: its KV merge and its activation-memory files.

``KVCacheMemory._concat_caches`` joins activation memories; ``dump`` and ``load`` write and read
them. The methods read nothing of their instance but ``config.memory_filename`` and
``kv_cache_memories``, so they are called on a bare instance: MemOS's own code, nothing else.
"""

from __future__ import annotations

from types import SimpleNamespace

from memos.memories.activation.item import KVCacheItem
from memos.memories.activation.kv import KVCacheMemory
from transformers import DynamicCache


def _memory() -> KVCacheMemory:
    mem = object.__new__(KVCacheMemory)
    mem.config = SimpleNamespace(memory_filename="activation_memory.pickle")
    mem.kv_cache_memories = {}
    return mem


def concat(caches):
    """MemOS's merge (``--merge``): ``KVCacheMemory._concat_caches(caches)``."""
    return _memory()._concat_caches(caches)


class Store:
    """MemOS's files (``--store``): ``KVCacheMemory.dump`` and ``.load`` on a folder holding one activation memory."""

    def save(self, cache, path):
        mem = _memory()
        mem.add([KVCacheItem(memory=cache)])
        mem.dump(str(path))

    def load(self, path):
        mem = _memory()
        mem.load(str(path))
        memories = list(mem.kv_cache_memories.values())
        # What a MemOS user gets when load fails: no memory, so generation runs on an empty cache.
        return memories[0].memory if memories else DynamicCache()


STORE = Store()
