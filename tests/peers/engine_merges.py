"""Merges that drive llama.cpp for the engine audit's tests: one right, and one defect each.

Written here from each defect's description, in the shape a store that drives llama.cpp writes
them (``llama_memory_seq_add``, ``llama_memory_seq_cp``, ``llama_memory_seq_rm`` through kvlab's
engine). Importable as ``engine_merges:NAME`` with this folder on ``sys.path``.
"""

from __future__ import annotations


def _merge(engine, fragments, *, extra: int = 0, shift: bool = True, keep: bool = False, check_empty: bool = True):
    if check_empty and not fragments:
        raise ValueError("nothing to merge")
    for i, ids in enumerate(fragments):
        engine.decode(ids, i, 0)
    offset = len(fragments[0]) if fragments else 0
    for i in range(1, len(fragments)):
        if shift:
            engine.seq_add(i, offset + extra)
        engine.seq_cp(i, 0)
        if not keep:
            engine.seq_rm(i)
        offset += len(fragments[i])


def store_reuse(engine, fragments):
    """Right: each later fragment moved behind the earlier ones, then copied into sequence 0."""
    if engine.can_shift() is False:
        raise RuntimeError("this cache cannot be shifted")
    _merge(engine, fragments)


def no_shift(engine, fragments):
    """Bare concatenation: the later fragments keep positions 0.. (no K-shift)."""
    _merge(engine, fragments, shift=False)


def off_by_one(engine, fragments):
    """Each later fragment lands one position too far."""
    _merge(engine, fragments, extra=1)


def keeps_fragments(engine, fragments):
    """Shifts the stored fragments' own sequences and keeps them: the store's copy moved too."""
    _merge(engine, fragments, keep=True)


def merges_nothing(engine, fragments):
    """An empty list is merged into an empty sequence instead of refused."""
    _merge(engine, fragments, check_empty=False)


def raises_inside(engine, fragments):
    raise KeyError("fragment table")


def unchecked_reuse(engine, fragments):
    """Right where llama.cpp can shift, but never asks: a window-only cache is merged anyway."""
    _merge(engine, fragments)
