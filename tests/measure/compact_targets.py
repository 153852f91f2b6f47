"""Compactions and presses for the compaction audit's tests: a hand-written right one, and one defect each.

Written from each defect's description, the way a press writes it: the frequencies read off the
model's rotary module, the keys gathered with ``gather`` and turned by ``rotate_half`` maths of its
own. :func:`store_compact` is that compaction done right (it must pass, so the audit rewards the
maths, not kvlab's code); every other ``_compact`` knob is one defect. Importable as
``compact_targets:NAME`` with this folder on ``sys.path``.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from kvlab.cache.compact import rebuild
from kvlab.compat import forward, layer_rope_parameters, rope_parameters, rotary_for
from kvlab.testing import inplace_compact, key_norm_press

# --------------------------------------------------------------------------- a press's rotation, by hand


def _types(model) -> list[str]:
    return list(getattr(model.config, "layer_types", None) or ["full_attention"] * model.config.num_hidden_layers)


def _freqs(model, layer_type: str) -> torch.Tensor:
    module, prefix = rotary_for(model.model, model.model.rotary_emb, layer_type)
    return getattr(module, f"{prefix}inv_freq")


def _turn(x, inv_freq, delta, *, interleaved=False, dims=None):
    """``x`` ``[batch, heads, k, dim]`` with its first ``2 * len(inv_freq)`` dims turned by ``delta`` ``[batch, heads, k]``."""
    r = 2 * inv_freq.numel() if dims is None else dims
    angle = delta.double()[..., None] * inv_freq.double()
    cos, sin = angle.cos(), angle.sin()
    part = x[..., :r].double()
    a, b = (part[..., 0::2], part[..., 1::2]) if interleaved else (part[..., : r // 2], part[..., r // 2 :])
    ta, tb = a * cos - b * sin, b * cos + a * sin
    out = x.clone()
    if interleaved:
        out[..., 0:r:2], out[..., 1:r:2] = ta.to(x.dtype), tb.to(x.dtype)
    else:
        out[..., : r // 2], out[..., r // 2 : r] = ta.to(x.dtype), tb.to(x.dtype)
    return out


def _refuse_dynamic(model) -> None:
    params = rope_parameters(model.config)
    kinds = {p.get("rope_type") for p in params.values()} if "rope_type" not in params else {params["rope_type"]}
    if "dynamic" in kinds:
        raise ValueError("dynamic NTK: frequencies depend on the length, so kept keys cannot be re-rotated")


def _compact(
    cache,
    keep,
    model,
    *,
    rerotate=True,
    off_by=0,
    interleaved=False,
    full_rotary=False,
    global_base=False,
    one_inv_freq=False,
    assign=False,
    trim_input=False,
    plain_sliding=False,
):
    """Gather each head's kept tokens, re-rotated to slots ``0..k-1``; each keyword is one way to get it wrong."""
    if rerotate:
        _refuse_dynamic(model)
    n = cache.get_seq_length()
    types = _types(model)
    out = DynamicCache(config=model.config)
    total = max(k.shape[-1] for k in keep)
    for li, (layer, k) in enumerate(zip(cache.layers, keep)):
        held = layer.keys.shape[-2]
        idx = (k - (n - held))[..., None]
        keys = layer.keys.gather(2, idx.expand(-1, -1, -1, layer.keys.shape[-1]))
        values = layer.values.gather(2, idx.expand(-1, -1, -1, layer.values.shape[-1]))
        if rerotate:
            kind = "full_attention" if global_base else types[li]
            freqs = _freqs(model, kind)
            if one_inv_freq:
                # The defect: the one inv_freq a module of one schedule holds, for every layer type.
                freqs = next(b for name, b in model.model.rotary_emb.named_buffers() if name.endswith("inv_freq"))
            dims = None
            if full_rotary:
                d = keys.shape[-1]
                base = layer_rope_parameters(model.config, types[li])["rope_theta"]
                freqs = 1.0 / base ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
            new = total - k.shape[-1] + torch.arange(k.shape[-1]) + off_by
            keys = _turn(keys, freqs, new - k, interleaved=interleaved, dims=dims)
        if assign:
            # The defect: tensors set on the layer, never through update.
            out.layers[li].keys, out.layers[li].values = keys, values
        else:
            out.update(keys, values, li)
        if trim_input:
            # The defect: the input trimmed to what was kept, to give its memory back.
            layer.keys, layer.values = keys, values
        if out.layers[li].is_sliding:
            out.layers[li].cumulative_length = total
    if plain_sliding or assign or not any(layer.is_sliding for layer in out.layers):
        return out
    # transformers' sliding layer reads its mask from cumulative_length, so one holding fewer tokens than that
    # cannot be attended through: the right press hands its tensors to kvlab's compacted layers.
    return rebuild(out, model.config, total)


def store_compact(cache, keep, model):
    """Right (positions=kept): each head's kept keys turned to their slots, values copied, the next token at kept."""
    return _compact(cache, keep, model)


def not_rerotated(cache, keep, model):
    """Declared positions=kept, but the keys keep the phase they were computed at."""
    return _compact(cache, keep, model, rerotate=False)


def off_by_one(cache, keep, model):
    return _compact(cache, keep, model, off_by=1)


def half_on_interleaved(cache, keep, model):
    """``rotate_half`` maths on every model: wrong on Cohere, GLM and GPT-J, whose pairs are (2i, 2i+1)."""
    return _compact(cache, keep, model, interleaved=False)


def store_interleaved(cache, keep, model):
    """Right on Cohere, GLM and GPT-J: pairs (2i, 2i+1)."""
    return _compact(cache, keep, model, interleaved=True)


def full_rotary(cache, keep, model):
    """A partial-rotary head (Phi) turned over all its dims."""
    return _compact(cache, keep, model, full_rotary=True)


def global_base_everywhere(cache, keep, model):
    """Gemma 3's sliding layers turned with the global layers' frequencies."""
    return _compact(cache, keep, model, global_base=True)


def one_inv_freq(cache, keep, model):
    """One ``inv_freq`` for a model whose rotary module holds frequencies per layer type."""
    return _compact(cache, keep, model, one_inv_freq=True)


def plain_sliding_layers(cache, keep, model):
    """Right keys, but sliding layers left as transformers' own, holding fewer tokens than they count."""
    return _compact(cache, keep, model, plain_sliding=True)


def assigned_layers(cache, keep, model):
    return _compact(cache, keep, model, assign=True)


def trims_its_input(cache, keep, model):
    return _compact(cache, keep, model, trim_input=True)


def in_place_at_kept(cache, keep, model):
    """Declared positions=original (keys keep their phase) in a plain cache: ``generate`` puts the next token at kept."""
    return _compact(cache, keep, model, rerotate=False)


def next_tokens(cache, keep, model):
    """Each kept position read one token late: slot j holds token keep[j] + 1."""
    n = cache.get_seq_length()
    return _compact(cache, [(k + 1).clamp_max(n - 1) for k in keep], model)


def store_in_place(cache, keep, model):
    """Right (positions=original): kvlab's in-place compaction, whose layers report the original length."""
    return inplace_compact(cache, keep, model)


# --------------------------------------------------------------------------- presses


def press_at_kept(model, input_ids):
    """A press that keeps positions but hands back a plain cache: the next token lands at kept, not n."""
    cache = key_norm_press(model, input_ids)
    out = DynamicCache(config=model.config)
    for li, layer in enumerate(cache.layers):
        out.update(layer.keys.clone(), layer.values.clone(), li)
    return out


def press_leaving_a_hook(model, input_ids):
    """A press whose forward hook stays on the model after it returns (kvpress registers hooks inside a ``with``)."""
    model.model.layers[0].register_forward_hook(lambda module, args, out: None)
    return key_norm_press(model, input_ids)


def crop_press(model, input_ids):
    """Right (positions=kept): the first half kept where it was computed, the sequence going on after it (crop)."""
    n = input_ids.shape[-1]
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        forward(model, cache, input_ids=input_ids, use_cache=True)
    out = DynamicCache(config=model.config)
    for li, layer in enumerate(cache.layers):
        out.update(layer.keys[..., : n // 2, :].clone(), layer.values[..., : n // 2, :].clone(), li)
    return out
