"""kvpress ``KeyRerotationPress`` turns keys with ``rotate_half``, whatever pairing the model's rotary uses.

Cohere rotates interleaved pairs (dims 2i, 2i+1); ``rotate_half`` pairs dim i with i + d/2. The right
re-rotation of a kept key from its position t to its slot j is the model's own rotation by j - t.
This script computes that turn for each kept key and compares kvpress's keys with it: on Llama
(``rotate_half`` is its pairing) they agree to float32 rounding; on Cohere they do not. Exit 1 when
Cohere's differ.

    python kvpress_rerotation_interleaved.py     # in kvpress's environment
"""

import torch
from _tiny import build, ids, prefill, verdict
from kvpress import KeyRerotationPress, KnormPress


def turn(x, inv_freq, delta, interleaved):
    """Rotate each pair of ``x`` ``[b, h, k, d]`` by ``delta`` ``[b, h, k]`` positions."""
    angle = delta[..., None].double() * inv_freq.double()  # [b, h, k, d/2]
    cos, sin = angle.cos(), angle.sin()
    if interleaved:
        a, b = x[..., 0::2].double(), x[..., 1::2].double()
        return torch.stack([a * cos - b * sin, a * sin + b * cos], -1).flatten(-2)
    a, b = x.double().chunk(2, -1)
    return torch.cat([a * cos - b * sin, a * sin + b * cos], -1)


def worst(config_class, model_class, interleaved):
    model = build(config_class, model_class)
    x = ids(48)
    full = prefill(model.model, x)
    with KeyRerotationPress(press=KnormPress(compression_ratio=0.5))(model):
        pressed = prefill(model.model, x)
    inv_freq = model.model.rotary_emb.inv_freq
    out = 0.0
    for f, p in zip(full.layers, pressed.layers):
        # Each kept slot's token, found from the values (which carry no phase).
        tok = (p.values[:, :, :, None, :] - f.values[:, :, None, :, :]).abs().amax(-1).argmin(-1)
        kept = f.keys.gather(2, tok[..., None].expand(-1, -1, -1, f.keys.shape[-1]))
        slot = torch.arange(tok.shape[-1]).expand_as(tok)
        want = turn(kept, inv_freq, slot - tok, interleaved)
        out = max(out, float((p.keys.double() - want).abs().max() / want.abs().max()))
    return out


llama = worst("LlamaConfig", "LlamaForCausalLM", interleaved=False)
cohere = worst("CohereConfig", "CohereForCausalLM", interleaved=True)
print(f"Llama (rotate_half pairs): kvpress's keys vs the right turn: {llama:.2g} relative")
verdict(cohere > 1e-4, f"Cohere (interleaved pairs): kvpress's keys vs the right turn: {cohere:.3g} relative")
