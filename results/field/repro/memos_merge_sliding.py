"""MemOS ``KVCacheMemory._concat_caches`` on a model with sliding-window layers (Gemma 3) raises ``TypeError``.

It builds each merged layer as ``type(layer)()``; ``DynamicSlidingWindowLayer`` needs its window. Exit 1
when the merge raises.

    python memos_merge_sliding.py     # in MemoryOS's environment
"""

from types import SimpleNamespace

from _tiny import build, ids, prefill, verdict
from memos.memories.activation.kv import KVCacheMemory

model = build(
    "Gemma3TextConfig", "Gemma3ForCausalLM", head_dim=16, sliding_window=8,
    layer_types=["sliding_attention", "full_attention"],
)  # fmt: skip
memory = object.__new__(KVCacheMemory)
memory.config, memory.kv_cache_memories = SimpleNamespace(memory_filename="m.pickle"), {}
try:
    memory._concat_caches([prefill(model, ids(12, 1)), prefill(model, ids(12, 2))])
except TypeError as e:
    verdict(True, f"the merge raised TypeError: {e}")
verdict(False, "the merge ran")
