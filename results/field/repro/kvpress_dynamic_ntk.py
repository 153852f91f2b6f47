"""kvpress ``KeyRerotationPress`` re-rotates keys of a dynamic-NTK model instead of refusing.

Dynamic NTK recomputes the rotary frequencies from the sequence length, so a key computed in a
sequence of one length has no rotation to its phase in a sequence of another: no ``inv_freq`` is
right for the turn. Here the context is longer than ``max_position_embeddings``, so the prefill ran
at scaled frequencies, and kvpress turns each kept key with whatever ``inv_freq`` the module holds.
Exit 1 when the press runs without raising.

    python kvpress_dynamic_ntk.py     # in kvpress's environment
"""

from _tiny import build, ids, prefill, verdict
from kvpress import KeyRerotationPress, KnormPress

model = build(
    "LlamaConfig", "LlamaForCausalLM", max_position_embeddings=32, rope_scaling={"rope_type": "dynamic", "factor": 4.0}
)
assert model.model.rotary_emb.rope_type == "dynamic", model.model.rotary_emb.rope_type
with KeyRerotationPress(press=KnormPress(compression_ratio=0.5))(model):
    cache = prefill(model.model, ids(64))
verdict(
    True,
    f"KeyRerotationPress re-rotated {cache.get_seq_length()} kept keys of a dynamic-NTK model (64 tokens, "
    "past max_position_embeddings 32) without refusing",
)
