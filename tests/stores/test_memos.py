"""kvlab's audits on MemOS's own installed code (MemoryOS on PyPI, ``memos/memories/activation/kv.py``).

MemOS joins activation memories with ``KVCacheMemory._concat_caches``: one ``torch.cat`` per layer,
keys left at the phase of the positions each was prefilled at, the tensors assigned onto fresh cache
layers. It stores them with ``KVCacheMemory.dump`` and ``load``: ``pickle`` both ways, and any error
on load swallowed into an empty memory. The adapters below are thin: the methods read nothing of
their instance but ``config.memory_filename``, so they are called on a bare instance.
"""

from __future__ import annotations

from types import SimpleNamespace

from installed import store_module
from transformers import DynamicCache

import kvlab
from kvlab.compat import ASSIGNED_LAYERS_READ_EMPTY
from kvlab.measure.certificate import FAIL, PASS

kv = store_module("MemoryOS", "memos.memories.activation.kv")
item = store_module("MemoryOS", "memos.memories.activation.item")


def _memory():
    mem = object.__new__(kv.KVCacheMemory)
    mem.config = SimpleNamespace(memory_filename="activation_memory.pickle")
    mem.kv_cache_memories = {}
    return mem


def memos_concat(caches):
    """MemOS's merge: ``KVCacheMemory._concat_caches(caches)``."""
    return _memory()._concat_caches(caches)


class MemosStore:
    """MemOS's files: ``KVCacheMemory.dump`` and ``.load`` on a folder, one activation memory in it."""

    def save(self, cache, path):
        mem = _memory()
        mem.add([item.KVCacheItem(memory=cache)])
        mem.dump(str(path))

    def load(self, path):
        mem = _memory()
        mem.load(str(path))
        memories = list(mem.kv_cache_memories.values())
        # What a MemOS user gets when load fails: no memory, so generation runs on an empty cache.
        return memories[0].memory if memories else DynamicCache()


def _failing(cert) -> set[str]:
    return {x.check for x in cert.lines if x.status == FAIL}


def test_memos_concat_fails_on_phase_and_where_the_release_reads_assigned_layers_empty_on_length():
    cert = kvlab.audit(kvlab.load_model("tiny-llama"), merge=memos_concat)
    # One memory is handed back as it is (no layers assigned), so the one-fragment line passes.
    expected = {"phase", "refusal"} | ({"length"} if ASSIGNED_LAYERS_READ_EMPTY else set())
    assert _failing(cert) == expected, cert.table(verbose=True)
    phase = next(x for x in cert.lines if x.check == "phase")
    assert "angle wrong" in phase.detail
    if ASSIGNED_LAYERS_READ_EMPTY:
        length = next(x for x in cert.lines if x.check == "length")
        assert "get_seq_length() is 0" in length.detail and "never initialized" in length.detail
    assert next(x for x in cert.lines if x.check == "values").status == PASS


def test_memos_files_run_a_pickle_and_load_damage_as_an_empty_memory():
    cert = kvlab.audit(kvlab.load_model("tiny-llama"), store=MemosStore())
    assert _failing(cert) == {"foreign reader", "truncated file", "corrupted file", "pickle payload"}, cert.table(
        verbose=True
    )
    payload = next(x for x in cert.lines if x.check == "pickle payload")
    assert payload.value == "ran" and "canary was created" in payload.detail
    assert next(x for x in cert.lines if x.check == "round trip").status == PASS
