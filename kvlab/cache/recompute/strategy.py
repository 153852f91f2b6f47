"""``recompute``: re-rotate, then recompute a few tokens at every layer (CacheBlend-style).

The steps, in the order of the CacheBlend description, one module each: re-rotate and
concatenate (:class:`kvlab.cache.strategies.KeyRotator`); select the tokens
(:meth:`Recompute.select_tokens`, ``select``); give them positions and a causal-by-position
mask (``inputs``); run the decoder layers on them (``layers``); write their fresh K/V back
(``write``). :func:`recompute_tokens` runs steps 2-4. Ratio 0 is ``rerotate`` bit for bit,
ratio 1 a prefill of the joined tokens. How the stand-in cache, the mask and sliding-window
layers work: docs/recompute.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
from transformers import DynamicCache

from kvlab.cache.fragments import Fragment
from kvlab.cache.recompute.decoder import Decoder
from kvlab.cache.recompute.inputs import attention_mask, layer_inputs
from kvlab.cache.recompute.layers import run_layers
from kvlab.cache.recompute.select import key_deviation
from kvlab.cache.strategies import KeyRotator, Rerotate, Strategy, concat_layers, register
from kvlab.errors import MergeError
from kvlab.models.loaded import LoadedModel

POLICIES = ("deviation", "fragment_start", "random", "random_later")


@register("recompute")
@dataclass
class Recompute(Strategy):
    """Re-rotate, then recompute K/V of a fraction of the tokens at every layer (CacheBlend).

    Parameters
    ----------
    ratio : float
        Fraction of the merged tokens to recompute, in ``[0, 1]``; ``round(ratio * N)``
        tokens (Python's round, half to even). ``0`` is ``rerotate`` bit for bit, ``1``
        is a prefill of the joined tokens.
    policy : str
        Which tokens: ``deviation`` (CacheBlend: largest squared key deviation between the
        re-rotated cache and a fresh prefill of the first layers, at ``check_layer``),
        ``fragment_start`` (the first tokens of each fragment after the first, as evenly
        as their lengths allow), ``random`` (a seeded control over every token) or
        ``random_later`` (the fair control: seeded, drawn from the tokens after fragment 0,
        the only ones a recompute can change, fragment 0's only once those run out). Every
        policy but ``random`` ranks fragment 0's tokens last, so each reaches the joined
        prefill at ``r* = (N - L0) / N``. Below ratio 1, the fragment-0 tokens a policy picks
        count against the budget but are not run: they are exact already.
    check_layer : int, optional
        Layer whose keys ``deviation`` compares. Default: layer 1, or, when layer 1 is a
        sliding-window layer that no longer holds every merged token, the first later
        layer that does (a deviation needs a cached key for every candidate). Every
        token is prefilled through layers ``0 .. check_layer`` to score it; those fresh
        K/V only score, they are not written, so the policies differ only in the
        tokens they pick.
    seed : int
        Seed of the ``random`` and ``random_later`` policies.
    """

    needs_model: ClassVar[bool] = True
    #: Builds the recomputed tokens' masks: causal by landing position. A class attribute, not a
    #: field: only :class:`kvlab.cache.repro.BottomRightRecompute` (a defect) replaces it.
    mask: ClassVar = staticmethod(attention_mask)
    ratio: float = 0.15
    policy: str = "deviation"
    check_layer: int | None = None
    seed: int = 0

    def __post_init__(self):
        r = self.ratio
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not math.isfinite(r) or not 0 <= r <= 1:
            raise MergeError(
                f"recompute ratio must be a number in [0, 1] (the fraction of tokens recomputed), got {r!r}"
            )
        if self.policy not in POLICIES:
            raise MergeError(f"unknown recompute policy {self.policy!r}; choose one of {', '.join(POLICIES)}")
        c = self.check_layer
        if c is not None and (isinstance(c, bool) or not isinstance(c, int) or c < 0):
            raise MergeError(f"check_layer must be a layer index >= 0 or None, got {c!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise MergeError(f"seed must be an int, got {self.seed!r}")

    def budget(self, total: int) -> int:
        """How many of ``total`` merged tokens are recomputed."""
        return int(round(self.ratio * total))

    def __call__(self, fragments: list[Fragment], landings: list[int], model: LoadedModel) -> DynamicCache:
        # The steps of CacheBlend, in order: re-rotate and concatenate; select the tokens;
        # then, layer by layer, give them positions and a mask, run the layer, write back.
        rotator = KeyRotator(model, fragments, landings)
        merged = concat_layers(fragments, landings, rotator, rotator.slots)
        total = landings[-1] + fragments[-1].length
        if self.budget(total) == 0:
            return merged
        decoder = Decoder.of(model, fragments, landings)
        chosen = self.select_tokens(decoder, merged)
        if chosen.numel() < total:
            # Fragment 0's tokens are exact already (prefilled at position 0 with all their context),
            # so a budget spent on them (random, or past r* = (N - L0) / N) changes nothing. Run, on a
            # sliding-window layer one would attend without the neighbours its fragment's own cache
            # evicted, and be written back wrong (tests/cache/test_recompute.py).
            chosen = chosen[chosen >= decoder.later]
        if chosen.numel():
            recompute_tokens(decoder, merged, chosen, rotator, mask=self.mask)
        return merged

    def select(self, fragments: list[Fragment], landings: list[int], model: LoadedModel) -> torch.Tensor:
        """The positions this strategy recomputes for a merge.

        Returns
        -------
        torch.Tensor
            ``[round(ratio * N)]`` int64 merged positions, ascending.
        """
        total = landings[-1] + fragments[-1].length
        if self.budget(total) == 0:
            return torch.empty(0, dtype=torch.long)
        merged = Rerotate()(fragments, landings, model) if self.policy == "deviation" else None
        return self.select_tokens(Decoder.of(model, fragments, landings), merged)

    def select_tokens(self, decoder: Decoder, merged: DynamicCache | None) -> torch.Tensor:
        """Step 1: which of the ``N`` merged tokens to recompute, by this strategy's policy.

        Parameters
        ----------
        decoder : Decoder
        merged : DynamicCache or None
            The re-rotated merge, ``[1, kv_heads, kept, head_dim]`` per layer (only the
            ``deviation`` policy reads it).

        Returns
        -------
        torch.Tensor
            ``[round(ratio * N)]`` int64 merged positions, ascending.
        """
        k = self.budget(decoder.total)
        if k == decoder.total:
            return torch.arange(decoder.total)
        if self.policy == "random":
            g = torch.Generator().manual_seed(self.seed)
            return torch.randperm(decoder.total, generator=g)[:k].sort().values
        if self.policy == "random_later":
            # Fragment 0 sits where it was prefilled with all the context it ever has: exact already.
            g = torch.Generator().manual_seed(self.seed)
            first = decoder.later
            order = torch.cat(
                [first + torch.randperm(decoder.total - first, generator=g), torch.randperm(first, generator=g)]
            )
            return order[:k].sort().values
        if self.policy == "fragment_start":
            return fragment_start_positions([f.length for f in decoder.fragments], decoder.landings, k)
        layer = self._check_layer(decoder, merged)
        dev = key_deviation(decoder, merged, layer)
        # Fragment 0 is exact already, so its deviation is float noise; on a sliding-window model a
        # later token whose windows never leave its own fragment scores noise too, and the noise
        # could rank fragment 0 first. Ranked last, as random_later ranks it, so a budget of
        # N - L0 tokens recomputes every later one: the joined prefill.
        dev[: decoder.later] = float("-inf")
        # Sorted so the chosen tokens run in position order (any order is exact; this one is cache-friendly).
        return torch.topk(dev, k).indices.sort().values.cpu()

    def _check_layer(self, decoder: Decoder, merged: DynamicCache) -> int:
        n_layers, total = len(merged.layers), decoder.total

        def holds_all(li):
            return merged.layers[li].keys.shape[-2] == total

        if self.check_layer is not None:
            if self.check_layer >= n_layers:
                raise MergeError(f"check_layer {self.check_layer} is out of range: the model has {n_layers} layers")
            if not holds_all(self.check_layer):
                raise MergeError(
                    f"check_layer {self.check_layer} is a sliding-window layer holding only the last "
                    f"{merged.layers[self.check_layer].keys.shape[-2]} of {total} merged tokens, so the others have no "
                    "cached key to compare; pick a full-attention layer (or leave check_layer unset)"
                )
            return self.check_layer
        for li in range(min(1, n_layers - 1), n_layers):
            if holds_all(li):
                return li
        raise MergeError(
            f"no layer of this model holds all {total} merged tokens (every layer is sliding-window), so the "
            "'deviation' policy has nothing to compare; use policy 'fragment_start' or 'random'"
        )


def fragment_start_positions(lengths: list[int], landings: list[int], k: int) -> torch.Tensor:
    """The first tokens of each fragment after the first, ``k`` in all.

    Every later fragment gets ``min(t, L_j)`` tokens for the smallest ``t`` that reaches
    ``k``; any excess is taken back from the last fragments. Past the later fragments'
    total, the first tokens of fragment 0 follow (so ``k = N`` picks every token).

    Returns
    -------
    torch.Tensor
        ``[k]`` int64 merged positions, ascending.
    """
    later = list(range(1, len(lengths)))
    cap = sum(lengths[j] for j in later)
    take = {j: 0 for j in range(len(lengths))}
    if k >= cap:
        take.update({j: lengths[j] for j in later})
        take[0] = k - cap
    else:
        t = 0
        while sum(min(t, lengths[j]) for j in later) < k:
            t += 1
        for j in later:
            take[j] = min(t, lengths[j])
        excess = sum(take.values()) - k
        for j in reversed(later):
            if excess and take[j] == t:
                take[j] -= 1
                excess -= 1
    pos = [torch.arange(landings[j], landings[j] + take[j]) for j in range(len(lengths))]
    return torch.cat(pos).sort().values


@torch.inference_mode()
def recompute_tokens(
    decoder: Decoder, merged: DynamicCache, slots: torch.Tensor, rotator: KeyRotator, mask=attention_mask
) -> None:
    """Steps 2-4: replace, in place, the K/V of the tokens at ``slots`` in every layer of ``merged``.

    Parameters
    ----------
    decoder : Decoder
    merged : DynamicCache
        The re-rotated merge, ``[1, kv_heads, kept, head_dim]`` per layer; owned by the
        caller (nothing in it aliases a fragment).
    slots : torch.Tensor
        ``[k]`` ascending merged positions, ``k >= 1``.
    rotator : KeyRotator
        The merge's key rotator, reused for the fragments' sliding tails.
    mask : callable
        As :func:`kvlab.cache.recompute.layers.run_layers` takes it.
    """
    run_layers(
        decoder, slots, len(decoder.layers), lambda li: layer_inputs(decoder, merged, li, slots, rotator), mask=mask
    )
