"""kvpress ``KeyRerotationPress`` on a partial-rotary model (Phi-3 config, ``partial_rotary_factor=0.5``) raises.

It re-rotates the full head dimension with cosines built from ``rotary_emb.inv_freq``, which has
``rotary_dim / 2`` entries: the shapes do not broadcast. Phi-3 is in kvpress's supported models.
Exit 1 when the press raises (or, if it runs, whatever it returns is not checked here).

    python kvpress_rerotation_partial.py     # in kvpress's environment
"""

from _tiny import build, ids, prefill, verdict
from kvpress import KeyRerotationPress, KnormPress

model = build("Phi3Config", "Phi3ForCausalLM", partial_rotary_factor=0.5, pad_token_id=0)
try:
    with KeyRerotationPress(press=KnormPress(compression_ratio=0.5))(model):
        prefill(model.model, ids(48))
except RuntimeError as e:
    verdict(True, f"KeyRerotationPress raised on partial rotary: {e}")
verdict(False, "KeyRerotationPress ran on partial rotary")
