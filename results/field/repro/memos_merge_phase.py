"""MemOS ``KVCacheMemory._concat_caches``: a fragment's keys stay at the positions they were prefilled at.

Two fragments, each prefilled from position 0, are joined. In the joined sequence the second one's
keys stand at positions 8..15, so they must carry that rotary phase: compare them with the same
tokens prefilled alone at positions 8..15 (the same missing context, the right phase). Exit 1 when
they differ beyond float32 rounding. On transformers >= 4.57 it also reports what the merged cache
says its length is (layers given tensors without ``update`` count 0 tokens).

    python memos_merge_phase.py     # in MemoryOS's environment
"""

from types import SimpleNamespace

import torch
from _tiny import build, ids, prefill, verdict
from memos.memories.activation.kv import KVCacheMemory

model = build("LlamaConfig", "LlamaForCausalLM")
a, b = ids(8, 1), ids(8, 2)
memory = object.__new__(KVCacheMemory)
memory.config, memory.kv_cache_memories = SimpleNamespace(memory_filename="m.pickle"), {}
merged = memory._concat_caches([prefill(model, a), prefill(model, b)])
at_place = prefill(model, b, torch.arange(8, 16))
worst = max(
    float((m.keys[..., 8:, :] - r.keys).abs().max() / r.keys.abs().max())
    for m, r in zip(merged.layers, at_place.layers)
)
print(f"merged get_seq_length(): {merged.get_seq_length()} (16 tokens joined)")
verdict(worst > 1e-5, f"second fragment's keys differ from the same tokens at positions 8..15 by {worst:.3g} relative")
