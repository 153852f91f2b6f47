"""MemOS ``KVCacheMemory.dump`` / ``load``: a pickle both ways, so a file runs code on load, and damage loads as nothing.

1. A file whose pickle creates a canary file: ``load`` runs it.
2. A real dump cut in half: ``load`` raises nothing and the memory is silently empty.
Exit 1 on either.

    python memos_files.py     # in MemoryOS's environment
"""

import pickle
import tempfile
from pathlib import Path
from types import SimpleNamespace

from _tiny import build, ids, prefill, verdict
from memos.memories.activation.item import KVCacheItem
from memos.memories.activation.kv import KVCacheMemory

NAME = "activation_memory.pickle"


def memory():
    m = object.__new__(KVCacheMemory)
    m.config, m.kv_cache_memories = SimpleNamespace(memory_filename=NAME), {}
    return m


class Canary:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (Path.touch, (Path(self.path),))


folder = Path(tempfile.mkdtemp())
canary = folder / "canary"
(folder / NAME).write_bytes(pickle.dumps(Canary(canary)))
memory().load(str(folder))
ran = canary.exists()
print(f"1. a pickle payload {'ran' if ran else 'did not run'} on load")

good = memory()
good.add([KVCacheItem(memory=prefill(build("LlamaConfig", "LlamaForCausalLM"), ids(8)))])
good.dump(str(folder))
data = (folder / NAME).read_bytes()
(folder / NAME).write_bytes(data[: len(data) // 2])
cut = memory()
cut.load(str(folder))
silent = len(cut.kv_cache_memories) == 0
print(f"2. a dump cut to half its bytes loaded as {len(cut.kv_cache_memories)} memories, with no error")
verdict(ran or silent, "MemOS's activation-memory files run code on load and load damage as an empty memory")
