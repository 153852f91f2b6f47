"""Refusals before any work, and the rotation self-test after the weights are in.

A model kvlab cannot treat exactly is refused with :class:`~kvlab.errors.UnsupportedModelError`
naming the reason: from its config alone (:func:`check_config`), from its modules on a
meta-device skeleton (:func:`check_module`: no rotary module, a cache holding recurrent or
convolution state), and, once its weights are in, by a one-token rotation self-test
(:func:`check_rotation`) that holds every layer to the layout :mod:`kvlab.models.layout`
declares for it.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from kvlab.compat import family_problem, forward, rope_parameters, state_layers
from kvlab.errors import UnsupportedModelError, UnsupportedRopeError
from kvlab.models.layout import find_rotary_module, layer_ropes, layer_types, nope_layers
from kvlab.models.loaded import LoadedModel
from kvlab.models.rope import rope_problem, rotate_keys


def is_causal_class(class_name: str) -> bool:
    """Whether a transformers model class name is a causal LM (one with a next-token head)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES  # noqa: PLC0415 - transformers' Auto classes load its model registry, slowly: on first use, not with kvlab

    names = {c for v in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values() for c in ([v] if isinstance(v, str) else v)}
    return class_name in names or class_name.endswith(("ForCausalLM", "LMHeadModel"))


def check_config(config, what: str) -> None:
    """Refuse, from the config alone, a model kvlab cannot treat.

    Encoder-decoder and encoder-only models, configs transformers has no causal-LM class
    for, checkpoints whose weights are for another head, and rope schedules kvlab does not
    know (:func:`kvlab.models.rope.rope_problem`).
    """
    from transformers.models.auto.modeling_auto import (  # noqa: PLC0415 - transformers' Auto classes load its model registry, slowly: on first use, not with kvlab
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    )

    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    family = family_problem(getattr(text, "model_type", ""))
    if family:
        raise UnsupportedModelError(f"{what}: {family}")
    mrope = _mrope_problem(rope_parameters(text))
    if mrope:
        # Before the causal-LM check, whose refusal would name the class, not the reason.
        raise UnsupportedModelError(f"{what}: {mrope}")
    model_type = getattr(config, "model_type", None)
    archs = list(getattr(config, "architectures", None) or [])
    is_causal_arch = [is_causal_class(a) for a in archs]
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModelError(
            f"{what} is an encoder-decoder model ({model_type}): its decoder cache attends over an encoder's output, "
            "not over earlier cached fragments; kvlab treats decoder-only causal language models"
        )
    encoder_only = (
        model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES
        and not getattr(config, "is_decoder", False)
        and not any(is_causal_arch)
    )
    if encoder_only:
        raise UnsupportedModelError(
            f"{what} is an encoder-only model ({model_type}{', ' + '/'.join(archs) if archs else ''}): every token "
            "attends to every other in both directions, so there is no causal KV cache to reuse or merge"
        )
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise UnsupportedModelError(
            f"{what} is not a causal language model: transformers has no causal-LM class for model_type "
            f"{model_type!r}{' (architectures: ' + ', '.join(archs) + ')' if archs else ''}"
        )
    if archs and not any(is_causal_arch):
        raise UnsupportedModelError(
            f"{what} holds weights for {', '.join(archs)}, not a causal LM head; loading it as one would invent "
            "a random head, so kvlab refuses it"
        )
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if getattr(text, "attn_temperature_tuning", False) and any(nope_layers(text)):
        raise UnsupportedModelError(
            f"{what} ({text.model_type}) scales the queries of its NoPE layers by a temperature it computes from the "
            "cache's length, not from each token's position: recomputed tokens and packed probe reads, which sit at "
            "positions other than the cache's length, would be scaled wrong, silently. kvlab refuses it (a config "
            "with attn_temperature_tuning=False merges exactly)"
        )
    chunked = [li for li, t in enumerate(layer_types(text)) if t == "chunked_attention"]
    if chunked:
        raise UnsupportedModelError(
            f"{what} ({text.model_type}) has chunked attention at layer(s) {chunked}: a token attends only to its own "
            "chunk, which transformers caches as a sliding window. kvlab's own attention masks (recompute, packed "
            "probe reads) model a sliding window, so a token would see the chunk before its own, silently. kvlab "
            "refuses it (a config without attention_chunk_size has no chunked layers)"
        )
    params = rope_parameters(text)
    if not params:
        return
    per_type = params if all(isinstance(v, dict) for v in params.values()) else {"default": params}
    for layer_type, p in per_type.items():
        problem = rope_problem(p)
        if problem:
            where = "" if layer_type == "default" else f" ({layer_type} layers)"
            raise UnsupportedModelError(f"{what}{where}: {problem}")


def check_cache_layers(config, what: str) -> None:
    """Refuse a model whose cache holds anything but per-token keys and values.

    Hybrids (Jamba, Bamba, Falcon-H1, Zamba 2, LFM2, Qwen3-Next ...) keep a recurrent or
    convolution state beside their attention layers: one running summary of every token so
    far, not a row per token. Two fragments' states cannot be concatenated or re-rotated, and
    a merge that turned only the attention layers would hand back a state that belongs to no
    prefill of the merged text. Read from the cache transformers itself builds for the config.
    """
    try:
        odd = state_layers(config)
    except (ValueError, TypeError, AttributeError, KeyError) as e:
        raise UnsupportedModelError(f"{what}: transformers cannot build a cache for this config ({e})") from None
    if odd:
        found = "; ".join(f"{kind} at layer(s) {lis}" for kind, lis in odd.items())
        raise UnsupportedModelError(
            f"{what} ({config.model_type}) is a hybrid whose cache holds recurrent or convolution state, not only "
            f"per-token keys and values: {found}. Such a state summarises every token before it, so two fragments' "
            "states cannot be concatenated or re-rotated, and merging only the attention layers would hand back a "
            "state that belongs to no prefill of the merged text; kvlab refuses it (re-prefill the joined text)"
        )


def _mrope_problem(params) -> str | None:
    if not params:
        return None
    per_type = params.values() if all(isinstance(v, dict) for v in params.values()) else [params]
    return next((rope_problem(p) for p in per_type if "mrope_section" in p), None)


def check_module(model: torch.nn.Module, what: str) -> None:
    """Refuse a model kvlab cannot treat, from its modules (a live model or a meta-device skeleton).

    A hybrid cache (:func:`check_cache_layers`), no rotary embedding kvlab can read, or
    ``layer_types`` that do not match the layers.
    """
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    check_cache_layers(config, what)
    try:
        find_rotary_module(model)
    except UnsupportedRopeError:  # re-raised as a model error, with the model's own story
        raise UnsupportedModelError(_no_rope_reason(model, what)) from None
    try:
        layer_ropes(model)
    except (AttributeError, KeyError, TypeError) as e:
        raise UnsupportedModelError(
            f"{what}: its rotary module {type(find_rotary_module(model)).__name__} does not "
            f"expose the inverse frequencies kvlab reads ({e})"
        ) from None
    if len(layer_types(config)) != config.num_hidden_layers:
        raise UnsupportedModelError(
            f"{what}: config.layer_types names {len(layer_types(config))} layers, the model "
            f"has {config.num_hidden_layers}"
        )


#: Position the rotation self-test moves a key to (far enough that every frequency pair turns).
PROBE_SHIFT = 37


@torch.inference_mode()
def check_rotation(loaded: LoadedModel) -> float:
    """Check that the model rotates cached keys the way kvlab re-rotates them, at every layer.

    One token prefilled alone attends only to itself, so at every layer its cached tensors at
    position ``s`` must be those at position 0 with the rotary slot turned by ``s`` positions
    in the layout :mod:`kvlab.models.layout` declares (pairing, offset, which slot), and the
    other slot unchanged; a NoPE layer must not change at all. A family declared wrong (or a
    model that applies positions some other way) fails here, where any re-rotation would be
    silently wrong. Skipped on ``meta``.

    Returns
    -------
    float
        The largest relative error ``max|T_s - R(s) T_0| / max|T_s|`` over layers and slots.

    Raises
    ------
    UnsupportedModelError
        Above 1e-3 (float32/64 weights) or 5e-2 (half precision), naming the layers.
    """
    if loaded.device.type == "meta":
        return 0.0
    limit = getattr(loaded.config.get_text_config(), "max_position_embeddings", None) or PROBE_SHIFT + 1
    shift = min(PROBE_SHIFT, limit - 1)
    ids = loaded.tokenizer(" the", add_special_tokens=False)["input_ids"][:1] or [0]
    ids = torch.tensor(ids, dtype=torch.long)
    at0, at_s = _one_token_cache(loaded, ids, 0), _one_token_cache(loaded, ids, shift)
    tol = 1e-3 if loaded.dtype in (torch.float32, torch.float64) else 5e-2
    errors = []
    for li, rope in enumerate(layer_ropes(loaded.model)):
        worst = 0.0
        for slot in ("keys", "values"):
            t0, ts = getattr(at0.layers[li], slot).float(), getattr(at_s.layers[li], slot).float()
            turned = slot == rope.slot and not rope.nope
            want = rotate_keys(t0, rope.inv_freq, shift, pairing=rope.pairing) if turned else t0
            worst = max(worst, float((ts - want).abs().max() / ts.abs().max().clamp_min(1e-30)))
        errors.append(worst)
    bad = [li for li, e in enumerate(errors) if not e <= tol]
    if bad:
        ropes = layer_ropes(loaded.model)
        said = "; ".join(sorted({_declared(ropes[li]) for li in bad}))
        raise UnsupportedModelError(
            f"{loaded.name}: at layer(s) {bad} a token's cache at position {shift} is not its cache at position 0 "
            f"turned by {shift} positions as kvlab reads the layout ({said}; relative error up to "
            f"{max(errors[li] for li in bad):.2g}, allowed {tol:g}). The model applies positions some other way, so "
            "every re-rotation kvlab made would be silently wrong"
        )
    return max(errors, default=0.0)


def _declared(rope) -> str:
    if rope.nope:
        return "no rope on this layer"
    return f"{rope.slot} slot, {rope.pairing.describe(rope.rotary_dim)}"


def _one_token_cache(loaded: LoadedModel, ids: torch.Tensor, position: int):
    """The cache of ``ids`` (one token) prefilled alone at ``position``, straight through transformers."""
    cache = DynamicCache(config=loaded.config)
    positions = torch.tensor([[position]], device=loaded.device)
    forward(
        loaded.model,
        cache,
        input_ids=ids[None].to(loaded.device),
        position_ids=positions,
        use_cache=True,
        logits_to_keep=1,
    )
    return cache


def _no_rope_reason(model: torch.nn.Module, what: str) -> str:
    learned = [
        n
        for n, m in model.named_modules()
        if isinstance(m, torch.nn.Embedding) and any(k in n.split(".")[-1] for k in ("wpe", "position", "pos_emb"))
    ]
    if learned:
        return (
            f"{what} ({type(model).__name__}) has no rotary embedding: it adds learned absolute position "
            f"embeddings ({learned[0]}) to its input, so every cached key and value of every layer depends on the "
            "position it was computed at. A naive merge is wrong there too, and no re-rotation can fix it (the "
            "position is mixed into the hidden state, not a rotation of the key); only a re-prefill is exact. "
            "kvlab treats RoPE models"
        )
    return (
        f"{what} ({type(model).__name__}) has no rotary embedding (positions enter some other way, e.g. ALiBi "
        "biases or none at all); kvlab measures and repairs the RoPE phase of cached keys, so it treats RoPE models only"
    )


def skeleton(config) -> torch.nn.Module:
    """The model's modules on the meta device: no memory, no weights read, just its structure."""
    from transformers import AutoModelForCausalLM  # noqa: PLC0415 - transformers' Auto classes load its model registry, slowly: on first use, not with kvlab

    try:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config)
    except (ValueError, KeyError, TypeError, RuntimeError) as e:
        raise UnsupportedModelError(f"transformers cannot build a causal LM from this config: {e}") from None
