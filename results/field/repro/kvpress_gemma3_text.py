"""kvpress on Gemma 3's text model (``Gemma3ForCausalLM``, what Gemma 3 270M is): sliding layers get tokens past their window.

kvpress skips the sliding-window layers only for ``Gemma3ForConditionalGeneration``; on the text
model (which it warns it has not tested) its hook compresses every layer. Its pipeline's cache is
``DynamicCache()`` with no config, so a sliding layer keeps every token and the press keeps, in a
sliding layer, tokens chosen from the whole context, most of them outside the layer's window.
Also: ``KeyRerotationPress`` reads ``rotary_emb.inv_freq``, which 5.x's Gemma 3 rotary module does
not have (one buffer per layer type). Exit 1 when a sliding layer holds a token outside its
window after the press, or the re-rotation raises.

    python kvpress_gemma3_text.py     # in kvpress's environment
"""

from _tiny import build, ids, prefill, verdict
from kvpress import KeyRerotationPress, KnormPress

WINDOW = 8
model = build(
    "Gemma3TextConfig", "Gemma3ForCausalLM", head_dim=16, sliding_window=WINDOW,
    layer_types=["sliding_attention", "full_attention"],
)  # fmt: skip
x = ids(48)
# As kvpress's pipeline does: DynamicCache() with no config, so every layer keeps every token.
every = prefill(model.model, x, layered=False)
with KnormPress(compression_ratio=0.5)(model):
    cache = prefill(model.model, x, layered=False)
mine, own = cache.layers[0].values, every.layers[0].values  # layer 0 slides over an 8-token window
token = (mine[:, :, :, None, :] - own[:, :, None, :, :]).abs().amax(-1).argmin(-1)  # [b, h, kept]
outside = int((token < x.shape[-1] - (WINDOW - 1)).sum())
print(
    f"KnormPress(0.5) on 48 tokens: sliding layer 0 holds {mine.shape[-2]} tokens per head; {outside} of "
    f"{token.numel()} are outside its {WINDOW}-token window (positions before {x.shape[-1] - WINDOW + 1})"
)
try:
    with KeyRerotationPress(press=KnormPress(compression_ratio=0.5))(model):
        prefill(model.model, ids(48))
    raised = None
except AttributeError as e:
    raised = str(e)
print(f"KeyRerotationPress: {'raised AttributeError: ' + raised if raised else 'ran'}")
verdict(
    outside > 0 or raised is not None,
    "kvpress on Gemma3ForCausalLM: a sliding layer holds tokens outside its window, or the re-rotation raised",
)
