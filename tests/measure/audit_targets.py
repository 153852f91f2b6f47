"""Merges, shifts and stores for the audit's tests: kvlab's own, a hand-written correct one, and one defect each.

Written here from each defect's description, in the shape a store writes them: a store's merge
reads the frequencies off the model's rotary module and turns the keys with ``rotate_half`` maths
of its own. :func:`store_merge` is that merge done right (it must pass, so the audit rewards the
maths, not kvlab's code); every other ``_merge`` knob is one defect, and the test asserts the line
that names it fails. Importable as ``audit_targets:NAME`` with this folder on ``sys.path``.
"""

from __future__ import annotations

import functools
import hashlib
import json
import pickle
from pathlib import Path

import torch
from transformers import DynamicCache

from kvlab.compat import layer_rope_parameters, rope_parameters, rotary_for
from kvlab.models.tiny import byte_tokenizer
from kvlab.testing import KvlabStore, kvlab_shift, rerotate_merge  # noqa: F401 -- kvlab's own, importable from here

# --------------------------------------------------------------------------- a store's rotation, by hand


def _layer_freqs(model, li: int) -> torch.Tensor:
    types = getattr(model.config, "layer_types", None)
    module, prefix = rotary_for(model.model, model.model.rotary_emb, types[li] if types else "full_attention")
    return getattr(module, f"{prefix}inv_freq")


def _turn(x, inv_freq, delta, *, interleaved=False, angle_dtype=torch.float64, scale=1.0, dims=None):
    """``x`` (``[batch, heads, n, dim]``) with its first ``2 * len(inv_freq)`` dims turned by ``delta`` positions."""
    r = 2 * inv_freq.numel() if dims is None else dims
    angle = (torch.tensor(float(delta), dtype=angle_dtype) * inv_freq.to(angle_dtype)).double()
    cos, sin = angle.cos() * scale, angle.sin() * scale
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
        raise ValueError("dynamic NTK: frequencies depend on the length, so cached keys cannot be moved")


def _merge(
    caches,
    model,
    *,
    sign=1,
    off_by=0,
    turn_values=False,
    interleaved=False,
    angle_dtype=torch.float64,
    scale=1.0,
    full_rotary=False,
    typed_layers=True,
):
    """Concatenate fragments, each turned from 0 to where it lands; each keyword is one way to get it wrong."""
    if not caches:
        raise ValueError("nothing to merge")
    _refuse_dynamic(model)
    out = DynamicCache(config=model.config) if typed_layers else DynamicCache()
    at = 0
    for cache in caches:
        delta = sign * at + (off_by if at else 0)
        for li, layer in enumerate(cache.layers):
            freqs = _layer_freqs(model, li)
            dims = None
            if full_rotary:
                # The defect: frequencies for every dim of the head, as if the whole head rotated.
                d = layer.keys.shape[-1]
                base = layer_rope_parameters(model.config, "full_attention")["rope_theta"]
                freqs = 1.0 / base ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
            how = dict(interleaved=interleaved, angle_dtype=angle_dtype, scale=scale, dims=dims)
            k = _turn(layer.keys, freqs, delta, **how) if delta else layer.keys.clone()
            v = _turn(layer.values, freqs, delta, **how) if delta and turn_values else layer.values.clone()
            out.update(k, v, li)
        at += cache.get_seq_length()
    for layer in out.layers:
        if getattr(layer, "is_sliding", False):
            layer.cumulative_length = at  # a sliding layer counts every token, not only those it keeps
    return out


def store_merge(caches, model):
    """Right: every fragment's keys turned by where it lands, values copied, sliding layers as transformers keeps them."""
    return _merge(caches, model)


def bare_concat(caches):
    """Wrong: fragments concatenated as they are (every later fragment keeps the phase of position 0)."""
    if not caches:
        raise ValueError("nothing to merge")
    out = DynamicCache()
    for cache in caches:
        for li, layer in enumerate(cache.layers):
            out.update(layer.keys.clone(), layer.values.clone(), li)
    return out


def wrong_sign(caches, model):
    return _merge(caches, model, sign=-1)


def off_by_one(caches, model):
    return _merge(caches, model, off_by=1)


def rotated_values(caches, model):
    return _merge(caches, model, turn_values=True)


def interleaved_pairs(caches, model):
    return _merge(caches, model, interleaved=True)


def half_precision_angles(caches, model):
    return _merge(caches, model, angle_dtype=torch.float16)


def yarn_scale_twice(caches, model):
    """Wrong on YaRN: the rotation multiplied by the attention scaling the keys already carry."""
    return _merge(caches, model, scale=model.model.rotary_emb.attention_scaling)


def full_rotary(caches, model):
    return _merge(caches, model, full_rotary=True)


def untruncated_sliding(caches, model):
    """Wrong on sliding layers: a cache of plain layers, so every kept token of every fragment stays."""
    return _merge(caches, model, typed_layers=False)


def first_by_reference(caches, model):
    """Wrong: the later fragments' keys turned in place and appended to the first fragment's own cache."""
    if not caches:
        raise ValueError("nothing to merge")
    _refuse_dynamic(model)
    out, at = caches[0], caches[0].get_seq_length()
    for cache in caches[1:]:
        for li, layer in enumerate(cache.layers):
            layer.keys.copy_(_turn(layer.keys, _layer_freqs(model, li), at))
            out.update(layer.keys, layer.values, li)
        at += cache.get_seq_length()
    return out


def assigned_layers(caches, model):
    """Wrong on transformers >= 4.57: tensors assigned onto fresh layers, never initialized (so read as empty)."""
    if not caches:
        raise ValueError("nothing to merge")
    _refuse_dynamic(model)
    out = DynamicCache(config=model.config)
    for li, layer in enumerate(out.layers):
        keys, values, at = [], [], 0
        for cache in caches:
            src = cache.layers[li]
            keys.append(_turn(src.keys, _layer_freqs(model, li), at) if at else src.keys)
            values.append(src.values)
            at += cache.get_seq_length()
        layer.keys, layer.values = torch.cat(keys, -2), torch.cat(values, -2)
    return out


def raises_inside(caches, model):
    """A merge that crashes: the audit must say where, not crash."""
    return {"not": "reached"}[caches[0]]


def raises_in_a_library(caches, model):
    """A merge that crashes inside a library it calls."""
    return json.loads("{not json")


def returns_a_list(caches, model):
    return [c for c in caches]


def three_arguments(caches, model, extra):
    raise AssertionError("never called: the signature is refused first")


# --------------------------------------------------------------------------- shifts


def shift_wrong_sign(cache, delta, model):
    """Wrong: turned back instead of forward, into a new cache."""
    _refuse_dynamic(model)
    out = DynamicCache(config=model.config)
    for li, layer in enumerate(cache.layers):
        k = _turn(layer.keys, _layer_freqs(model, li), -delta) if delta else layer.keys.clone()
        out.update(k, layer.values.clone(), li)
    return out


def shift_sharing_values(cache, delta, model):
    """Wrong: a new cache whose values are the input's own tensors."""
    _refuse_dynamic(model)
    out = DynamicCache(config=model.config)
    for li, layer in enumerate(cache.layers):
        out.update(_turn(layer.keys, _layer_freqs(model, li), delta), layer.values, li)
        out.layers[li].values = layer.values  # update concatenated a copy; keep the input's own tensor instead
    return out


# --------------------------------------------------------------------------- stores


@functools.cache
def _weights_digest(model) -> str:
    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(p.detach().float().contiguous().numpy().tobytes())
    return h.hexdigest()


class PickleStore:
    """Wrong: a pickle file. It checks the producer's weights and a digest of the tensors, but only after unpickling."""

    def save(self, cache, path, model):
        layers = [(l.keys.clone(), l.values.clone(), l.get_seq_length()) for l in cache.layers]
        digest = hashlib.sha256(b"".join(t.numpy().tobytes() for k, v, _ in layers for t in (k, v))).hexdigest()
        Path(path).write_bytes(pickle.dumps({"weights": _weights_digest(model), "digest": digest, "layers": layers}))

    def load(self, path, model):
        data = pickle.loads(Path(path).read_bytes())  # the defect: whatever the file says runs here
        if data["weights"] != _weights_digest(model):
            raise ValueError("made by other weights")
        layers = data["layers"]
        digest = hashlib.sha256(b"".join(t.numpy().tobytes() for k, v, _ in layers for t in (k, v))).hexdigest()
        if digest != data["digest"]:
            raise ValueError("the file's tensors changed")
        out = DynamicCache(config=model.config)
        for li, (k, v, n) in enumerate(layers):
            out.update(k, v, li)
            if getattr(out.layers[li], "is_sliding", False):
                out.layers[li].cumulative_length = n
        return out


kvlab_store = KvlabStore(byte_tokenizer())  # kvlab's own files, for the tiny models' byte tokenizer
pickle_store = PickleStore()


class PlainStore:
    """Wrong twice: bare safetensors, read by anyone (load takes no model) and with no digest of the tensors."""

    def save(self, cache, path):
        from safetensors.torch import save_file

        tensors = {
            f"{i}.{s}": getattr(l, s).contiguous() for i, l in enumerate(cache.layers) for s in ("keys", "values")
        }
        save_file(tensors, path, metadata={"lengths": ",".join(str(l.get_seq_length()) for l in cache.layers)})

    def load(self, path):
        from safetensors import safe_open

        with safe_open(path, "pt") as f:
            lengths = [int(n) for n in f.metadata()["lengths"].split(",")]
            out = DynamicCache()
            for i in range(len(lengths)):
                out.update(f.get_tensor(f"{i}.keys"), f.get_tensor(f"{i}.values"), i)
        return out


class ForgivingStore(KvlabStore):
    """Wrong: kvlab's files, but any error while loading comes back as an empty cache ("a cache miss")."""

    def load(self, path, model):
        try:
            return super().load(path, model)
        except Exception:
            return DynamicCache(config=model.config)


plain_store = PlainStore()
forgiving_store = ForgivingStore(byte_tokenizer())
