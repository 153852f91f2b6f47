"""Where each decoder layer's rotary dimensions sit in what transformers caches, by family.

transformers writes every family's cache through the same ``cache.update(keys, values)``, but
what lands there differs:

* most families cache the rotated key with pairs ``(i, i + r/2)`` over its first ``r`` dims;
* Cohere, GLM, GPT-J, Llama 4 and their kind pair ``(2i, 2i + 1)`` (:data:`INTERLEAVED`);
* multi-head latent attention (DeepSeek-V2/V3, MiniCPM3) caches the compressed latent in the
  keys slot and the decoupled rotary key in the values slot, one shared head each;
* SmolLM3 and Llama 4 skip rope on the layers ``no_rope_layers`` marks 0, Cohere 2 (and
  EXAONE 4 with a sliding window) on every layer that is not sliding (NoPE: such a layer's
  cache carries no phase at all).

What this module declares, :func:`kvlab.models.checks.check_rotation` verifies on the model's
own forward pass before the model is handed out: a family declared wrong is refused there,
never turned wrong.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlab.compat import layer_rope_parameters, mla_cache_layout, rotary_for
from kvlab.errors import UnsupportedRopeError
from kvlab.models.rope import HALF, LayerRope, Pairing

#: ``config.model_type`` of families whose cached keys pair ``(2i, 2i + 1)``.
INTERLEAVED = {
    "codegen",
    "cohere",
    "cohere2",
    "cohere2_moe",
    "deepseek_v2",
    "ernie4_5",
    "ernie4_5_moe",
    "glm",
    "glm4",
    "gptj",
    "helium",
    "llama4_text",
}

#: How a family's rotary module hands ``cos``/``sin`` to its attention (read by the float64 twin,
#: :mod:`kvlab.measure.twin`, of ``kvlab certify``): ``cat`` ``cat(freqs, freqs)``; ``interleave``
#: ``repeat_interleave(freqs, 2)``; ``sincos`` GPT-J's ``(sin, cos)`` of ``r/2`` each;
#: ``complex`` one ``exp(i freqs)`` per pair.
EMITS = {
    "cohere": "interleave",
    "cohere2": "interleave",
    "cohere2_moe": "interleave",
    "gptj": "sincos",
    "codegen": "sincos",
    "deepseek_v2": "complex",
    "llama4_text": "complex",
}


@dataclass(frozen=True)
class Layout:
    """One layer's rotary layout in the cache.

    Attributes
    ----------
    pairing : Pairing
    slot : str
        ``keys`` or ``values`` (the rotary key of a latent-attention cache).
    nope : bool
        The layer applies no rotary embedding.
    inv_freq : torch.Tensor or None
        ``[r/2]`` inverse frequencies, for rotary modules that keep only a sin/cos table (GPT-J);
        ``None``: read them from the module.
    """

    pairing: Pairing = HALF
    slot: str = "keys"
    nope: bool = False
    inv_freq: torch.Tensor | None = None


def is_latent(config) -> bool:
    """Multi-head latent attention: a compressed KV latent plus a decoupled rotary key."""
    return getattr(config, "kv_lora_rank", None) is not None and getattr(config, "qk_rope_head_dim", None) is not None


def nope_layers(config) -> list[bool]:
    """Per layer, whether it applies no rotary embedding."""
    n = config.num_hidden_layers
    flags = getattr(config, "no_rope_layers", None)
    if flags is not None and config.model_type in ("smollm3", "llama4_text", "llama4"):
        # 1 marks a layer that uses rope, 0 a NoPE layer.
        return [not flags[i] for i in range(n)]
    if config.model_type in ("cohere2", "cohere2_moe"):
        # Cohere 2 rotates on its sliding layers only; its global layers see no position.
        return [t != "sliding_attention" for t in layer_types(config)]
    if config.model_type == "exaone4" and getattr(config, "sliding_window", None) is not None:
        # EXAONE 4 with a sliding window: global layers NoPE, as in Cohere 2.
        return [t != "sliding_attention" for t in layer_types(config)]
    return [False] * n


def cache_dims(config) -> tuple[int, int, int]:
    """``(kv_heads, key_dim, value_dim)`` of the tensors transformers caches per layer for ``config``.

    ``[batch, kv_heads, kept, key_dim]`` keys and ``[..., value_dim]`` values. What a latent-attention
    cache holds depends on the release (:func:`kvlab.compat.mla_cache_layout`): one shared head, the
    latent (``kv_lora_rank``) and the rotary key (``qk_rope_head_dim``), or every head's full key and value.
    """
    if is_latent(config):
        return mla_cache_layout(config)[:3]
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return int(kv_heads), int(head_dim), int(head_dim)


def layout_tags(config) -> list[str]:
    """Short words for what is unusual in a family's layout (``interleaved``, ``MLA``, ``NoPE 1/4``), from its config."""
    tags = ["interleaved"] if config.model_type in INTERLEAVED else []
    if is_latent(config):
        slot, offset = mla_cache_layout(config)[3:]
        tags.append(f"MLA rope {config.qk_rope_head_dim} in {slot}" + (f" from dim {offset}" if offset else ""))
    nope = nope_layers(config)
    if any(nope):
        tags.append(f"NoPE {sum(nope)}/{len(nope)}")
    return tags


def emits(config) -> str:
    """How the family's rotary module lays out its output (see :data:`EMITS`)."""
    return EMITS.get(config.model_type, "cat")


def layer_layouts(model: torch.nn.Module) -> list[Layout]:
    """One :class:`Layout` per decoder layer of ``model`` (a live model or a meta skeleton)."""
    config = model.config
    interleaved = config.model_type in INTERLEAVED
    # DeepSeek-V3 and MiniCPM3 turn interleaved weights but write the rotated key de-interleaved.
    slot, offset = mla_cache_layout(config)[3:] if is_latent(config) else ("keys", 0)
    pairing = Pairing(offset, interleaved)
    inv_freq = _table_inv_freq(find_rotary_module(model)) if emits(config) == "sincos" else None
    return [Layout(pairing, slot, nope, inv_freq) for nope in nope_layers(config)]


def _table_inv_freq(rotary: torch.nn.Module) -> torch.Tensor:
    # GPT-J's module keeps only sin/cos rows, built from these frequencies (base 10000, fixed).
    dim = rotary.pos_embd_dim
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=torch.int64) / dim))
    return inv.float().to(_rotary_device(rotary))


def find_rotary_module(model: torch.nn.Module) -> torch.nn.Module:
    """The model's (single, shared) rotary embedding module."""
    found = [m for name, m in model.named_modules() if name.endswith("rotary_emb")]
    if not found:
        raise UnsupportedRopeError(
            f"{type(model).__name__} has no rotary_emb module; kvlab re-rotates RoPE models only"
        )
    return found[0]


def layer_types(config) -> list[str]:
    types = getattr(config, "layer_types", None)
    return list(types) if types else ["default"] * config.num_hidden_layers


def layer_ropes(model: torch.nn.Module) -> list[LayerRope]:
    """One :class:`LayerRope` per decoder layer, read from the model's rotary module.

    Gemma 3 keeps per-layer-type buffers (``sliding_attention_inv_freq``, ...); others a
    single ``inv_freq``. ``original_inv_freq`` is used where present because dynamic
    schedules overwrite ``inv_freq`` during a forward. The pairing, the slot and which layers
    have no rope come from :func:`kvlab.models.layout.layer_layouts`.
    """
    rotary = find_rotary_module(model)
    config = model.config
    layouts = layer_layouts(model)
    out, by_type = [], {}
    for li, lt in enumerate(layer_types(config)):
        layout = layouts[li]
        if layout.nope:
            none = torch.empty(0, dtype=torch.float32, device=_rotary_device(rotary))
            out.append(LayerRope(lt, "none", none, 1.0, None, layout.pairing, layout.slot))
            continue
        if lt not in by_type:
            module, prefix = rotary_for(model, rotary, lt)
            params = layer_rope_parameters(config, lt)
            rope_type = params.get("rope_type", "default")
            inv_freq = layout.inv_freq
            if inv_freq is None:
                inv_freq = getattr(module, f"{prefix}original_inv_freq", None)
            if inv_freq is None:
                inv_freq = getattr(module, f"{prefix}inv_freq")
            scaling = getattr(module, f"{prefix}attention_scaling", 1.0)
            omax = params.get("original_max_position_embeddings") if rope_type == "longrope" else None
            if omax is None and rope_type == "longrope":
                omax = getattr(config, "original_max_position_embeddings", None)
            # Kept on the model's device (meta included): rotation tables are built where the keys are.
            inv_freq = inv_freq.detach().float().clone()
            by_type[lt] = LayerRope(lt, rope_type, inv_freq, float(scaling), omax, layout.pairing, layout.slot)
        out.append(by_type[lt])
    return out


def _rotary_device(rotary: torch.nn.Module) -> torch.device:
    tensors = [*rotary.buffers(), *rotary.parameters()]
    return tensors[0].device if tensors else torch.device("cpu")
