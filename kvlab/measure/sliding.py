"""The certificate's sliding-window line: past the window, every layer of a merge keeps what a joined
prefill keeps (layer type, shape, length); and the fragments long enough to cross the window."""

from __future__ import annotations

from transformers import DynamicCache

from kvlab.cache.fragments import Fragment
from kvlab.measure.certificate import FAIL, NA, PASS, REFUSED, Line
from kvlab.measure.tokens import TokenSource, random_fragments
from kvlab.models.layout import layer_ropes
from kvlab.models.loaded import LoadedModel


def sliding_window(model: LoadedModel) -> int | None:
    """The window of the model's sliding layers, or ``None`` where it has none."""
    config = model.config.get_text_config()
    types = getattr(config, "layer_types", None) or []
    return getattr(config, "sliding_window", None) if "sliding_attention" in types else None


def identity_fragments(model: LoadedModel, ids: TokenSource) -> list[Fragment]:
    """Two fragments for the exact identities: together past the sliding window where there is one."""
    window = sliding_window(model)
    switch = [r.original_max_position_embeddings for r in layer_ropes(model.model) if r.rope_type == "longrope"]
    # Past a longrope switch, fragments prefilled short and merged long do not compose: stay below it.
    n = window // 2 + 8 if window else (min(switch) // 2 if switch else 64)
    return random_fragments(model, ids, [n, n])


def sliding_line(
    model: LoadedModel,
    frags: list[Fragment],
    joined: DynamicCache,
    merged: DynamicCache | None,
    refusal: str | None = None,
    scope: str = "",
) -> Line:
    """The ``sliding window`` line: every layer of ``merged`` keeps what ``joined`` keeps (type, shape, length).

    Parameters
    ----------
    frags : list of Fragment
        What was merged, together past the model's window.
    joined : DynamicCache
        Their joined prefill: keys and values ``[batch, kv_heads, kept, head_dim]`` per layer.
    merged : DynamicCache or None
        The merge under test; ``None`` where it was refused (``refusal`` says why).
    scope : str
        Put before the line's own scope (what was merged, for an audit).
    """
    window = sliding_window(model)
    total = sum(f.length for f in frags)
    if window is None:
        return Line("sliding window", scope + "no sliding layers", None, None, "", NA)
    what = scope + f"{len(frags)} x {frags[0].length} tokens"
    if merged is None:
        return Line("sliding window", what, None, 0, "layers wrong", REFUSED, refusal or "")
    wrong = [
        li
        for li, (a, b) in enumerate(zip(merged.layers, joined.layers, strict=True))
        if type(a) is not type(b) or a.keys.shape != b.keys.shape or a.get_seq_length() != b.get_seq_length()
    ]
    kept = sorted({layer.keys.shape[-2] for layer in merged.layers})
    return Line(
        "sliding window",
        f"{what} past a window of {window}",
        len(wrong),
        0,
        "layers wrong",
        PASS if not wrong else FAIL,
        f"layers keep {kept} of {total} tokens" + (f"; wrong at layers {wrong}" if wrong else ""),
    )
