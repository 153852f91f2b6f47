"""kvpress with ``model.generate`` (its README's alternative to the pipeline): the next token lands at the kept length.

A press that keeps positions (``KnormPress``) leaves each key at the phase of its own position and
the cache reporting ``k`` tokens. kvpress's pipeline passes ``position_ids`` from the context's
length ``n``; ``generate`` takes the next position from ``cache.get_seq_length()``, so it reads the
question at ``k``, ``n - k`` positions too close to every kept key. Exit 1 when the cache reports
fewer tokens than the context had and the next token's logits differ between the two readings.

    python kvpress_generate_position.py     # in kvpress's environment
"""

import copy

import torch
from _tiny import build, ids, prefill, verdict
from kvpress import KnormPress

model = build("LlamaConfig", "LlamaForCausalLM", rope_theta=100.0)  # a short wavelength: position shows
x, probe = ids(48), ids(1, seed=9)
with KnormPress(compression_ratio=0.5)(model):
    cache = prefill(model.model, x)
n, seen = x.shape[-1], cache.get_seq_length()
name = "cache" if "cache" in model.forward.__code__.co_varnames else "past_key_values"
with torch.no_grad():
    as_generate = model(input_ids=probe, **{name: copy.deepcopy(cache)}).logits[0, -1]
    as_pipeline = model(input_ids=probe, position_ids=torch.tensor([[n]]), **{name: copy.deepcopy(cache)}).logits[0, -1]
gap = float((as_generate.log_softmax(-1) - as_pipeline.log_softmax(-1)).abs().max())
print(f"context {n} tokens, cache reports {seen}: generate reads the next token at {seen}, the pipeline at {n}")
verdict(seen < n and gap > 1e-5, f"next-token log-probabilities differ by up to {gap:.3g} between the two readings")
