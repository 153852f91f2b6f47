"""The two references every comparison in kvlab uses, and reading a probe behind a cache.

* phase reference: every fragment prefilled *alone* at the positions it lands on. Its keys
  differ from a merged fragment's only by rotation, so it isolates the phase error.
* context reference: one prefill of the joined tokens. Past layer 0 it also differs by
  what the fragments would have seen of each other (the context error).
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from kvlab.cache.fragments import Fragment, clone_cache, joined_prefill, prefill_ids, source_ids, tokenize
from kvlab.cache.merge import landing_positions, merge
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


@torch.inference_mode()
def read_probe(
    model: LoadedModel, cache: DynamicCache, probe: str, greedy_tokens: int = 0
) -> tuple[torch.Tensor, list[int]]:
    """Read ``probe`` behind ``cache``: the next token's distribution and a greedy continuation.

    The cache is cloned first: a forward pass appends to the cache it is given.

    Returns
    -------
    log_probs : torch.Tensor
        ``[vocab]`` float64 log-probabilities of the token after ``probe``.
    greedy : list of int
        ``greedy_tokens`` greedy token ids after ``probe`` (the first is the argmax of
        ``log_probs``' logits, from the same forward pass).
    """
    ids = tokenize(model, probe).to(model.device)[None]
    work = clone_cache(cache, model.config)
    at = work.get_seq_length()
    log_probs, greedy = None, []
    for _ in range(max(1, greedy_tokens)):
        pos = torch.arange(at, at + ids.shape[-1], device=model.device)[None]
        # Only the last position's logits are read: the vocabulary projection of every probe
        # token would cost Gemma 3 (262k-token vocabulary) more than its layers do.
        logits = model.model(input_ids=ids, position_ids=pos, cache=work, use_cache=True, logits_to_keep=1).logits[
            0, -1
        ]
        at += ids.shape[-1]
        if log_probs is None:
            log_probs = torch.log_softmax(logits.double(), -1)
        if greedy_tokens:
            greedy.append(int(logits.argmax()))
            ids = torch.tensor([[greedy[-1]]], device=model.device)
    return log_probs, greedy


def next_token_dist(model: LoadedModel, cache: DynamicCache, probe: str) -> torch.Tensor:
    """``[vocab]`` float64 log-probabilities of the token after ``probe``, read behind ``cache`` (cloned)."""
    return read_probe(model, cache, probe)[0]
