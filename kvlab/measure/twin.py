"""The exact float64 twin of a model, and the exact keys of a merge made with it.

A reference that is to be exact must sit far below the fp32 rounding the certificate's bounds
allow: the twin computes the model's maths in float64, its rotary angles too
(:func:`exact_twin`), and :func:`exact_landing` prefills each fragment alone where it lands.
The phase lines of :mod:`kvlab.measure.phase`, the audits of :mod:`kvlab.measure.audit` and
:mod:`kvlab.peers.audit` measure against it.
"""

from __future__ import annotations

import copy
import dataclasses
import functools

import torch
from transformers import DynamicCache

from kvlab.cache.fragments import Fragment, prefill_ids
from kvlab.cache.merge import landing_positions, merge
from kvlab.compat import rotary_modules
from kvlab.models.layout import emits, find_rotary_module, layer_ropes
from kvlab.models.loaded import LoadedModel
from kvlab.models.rope import longrope_inv_freq


def exact_twin(model: LoadedModel) -> LoadedModel:
    """``model`` computing in float64, its rotary angles too: the maths of the model, far below fp32 rounding.

    transformers computes rotary angles in float32 whatever the weights' dtype, and at position
    1000 that rounding (about 6e-5 rad at one radian per position) moves every later layer's
    keys more than fp32 noise does; a reference that is to be exact computes the angle
    ``position * inv_freq`` in float64 from the model's own (float32) frequencies.
    """
    module = copy.deepcopy(model.model).double()
    if getattr(module.config, "_experts_implementation", None) not in (None, "eager"):
        # Mixture-of-experts kernels (grouped_mm) take no float64; the plain loop over experts does.
        module.config._experts_implementation = "eager"
    # NoPE layers take no angle; every rotating layer type has its own frequencies.
    ropes = {r.layer_type: r for r in layer_ropes(model.model) if not r.nope}
    only = next(iter(ropes.values()))
    form = emits(model.config)

    def forward(x, position_ids, layer_type=None, *args, **kwargs):
        rope = ropes.get(layer_type, only)
        inv = rope.inv_freq
        if rope.rope_type == "longrope":
            inv = longrope_inv_freq(
                model.model, rope, int(position_ids.max()) + 1 > rope.original_max_position_embeddings
            )
        freqs = position_ids[..., None].double() * inv.to(x.device, torch.float64)
        s = rope.attention_scaling
        # Handed to the attention in the form the family's own rotary module uses.
        if form == "sincos":
            return freqs.sin().to(x.dtype), freqs.cos().to(x.dtype)
        if form == "complex":
            return torch.polar(torch.full_like(freqs, s), freqs)
        emb = freqs.repeat_interleave(2, dim=-1) if form == "interleave" else torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * s).to(x.dtype), (emb.sin() * s).to(x.dtype)

    rotary = find_rotary_module(module)
    for t, (found, takes) in rotary_modules(module, rotary, list(ropes) or ["default"]).items():
        # A module of one layer type (4.x's Gemma 3 local one) is told its type; one that takes it is not.
        found.forward = forward if takes else functools.partial(_typed, forward, t)
    return dataclasses.replace(model, model=module)


def _typed(forward, layer_type, x, position_ids, *args, **kwargs):
    return forward(x, position_ids, layer_type)


def exact_landing(twin: LoadedModel, frags: list[Fragment]) -> tuple[DynamicCache, list[DynamicCache]]:
    """The exact keys of a merge of ``frags``, and of each fragment where it was prefilled.

    Parameters
    ----------
    twin : LoadedModel
        The float64 model (:func:`exact_twin`).
    frags : list of Fragment
        In landing order; each lands at the sum of the lengths before it.

    Returns
    -------
    exact : DynamicCache
        float64 keys and values ``[batch, kv_heads, kept, head_dim]`` per layer: every fragment
        prefilled alone where it lands, concatenated (what an exact merge of the fp32 fragments
        approaches, to their own fp32 noise).
    at_own : list of DynamicCache
        Each fragment prefilled in float64 at its own positions (``start``): the fragment's own
        fp32 noise is its cache against this one.
    """
    landings = landing_positions(frags)
    at_land = [prefill_ids(twin, f.token_ids, land) for f, land in zip(frags, landings, strict=True)]
    at_own = [
        c if land == f.start else prefill_ids(twin, f.token_ids, f.start)
        for f, c, land in zip(frags, at_land, landings, strict=True)
    ]
    exact = merge(
        [dataclasses.replace(f, cache=c, start=land) for f, c, land in zip(frags, at_land, landings, strict=True)],
        "naive",
    )
    return exact, at_own
