"""The two references every comparison in kvlab uses, and a probe's next token behind a cache.

* phase reference: every fragment prefilled *alone* at the positions it lands on. Its keys
  differ from a merged fragment's only by rotation, so it isolates the phase error.
* context reference: one prefill of the joined tokens. Past layer 0 it also differs by
  what the fragments would have seen of each other (the context error).
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from kvlab.cache.fragments import Fragment, joined_prefill, prefill_ids, source_ids
from kvlab.cache.merge import landing_positions, merge
from kvlab.measure.probes import read_probes
from kvlab.models.loaded import LoadedModel


def phase_reference(model: LoadedModel, fragments: list[Fragment]) -> DynamicCache:
    """Each fragment re-prefilled alone at its landing position, then concatenated.

    The phases are right by construction, so concatenation is exact here.
    """
    shifted = []
    for i, (f, land) in enumerate(zip(fragments, landing_positions(fragments))):
        ids = source_ids(f, i)
        shifted.append(Fragment(prefill_ids(model, ids, land), ids, f.text, land, f.model_name, f.config))
    return merge(shifted, "naive")


def context_reference(model: LoadedModel, fragments: list[Fragment]) -> DynamicCache:
    """One prefill of all fragments' tokens: what a merge would be with full context."""
    return joined_prefill(model, fragments).cache


def next_token_dist(model: LoadedModel, cache: DynamicCache, probe: str) -> torch.Tensor:
    """``[vocab]`` float64 log-probabilities of the token after ``probe``, read behind ``cache`` (never modified).

    One probe's :func:`kvlab.measure.probes.read_probes`; read many at once through it.
    """
    return read_probes(model, cache, [probe])[0].log_probs
