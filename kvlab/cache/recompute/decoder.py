"""The parts of a model a recompute runs: its decoder layers, norms and rotary module, and one layer's K/V."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache

from kvlab.cache.fragments import Fragment
from kvlab.compat import layer_cache_arg, rotary_modules
from kvlab.errors import MergeError
from kvlab.models.layout import find_rotary_module, layer_types
from kvlab.models.loaded import LoadedModel

#: ``config.model_type`` values whose decoder layers were checked against a joined prefill
#: (ratio 1 equals ``reprefill``). Others are refused rather than silently approximated: a
#: family may scale embeddings or mix positions outside its decoder layers.
SUPPORTED_MODEL_TYPES = {
    "llama",
    "qwen2",
    "gemma3_text",
    "phi",
    "phi3",
    "gpt_neox",
    "cohere",
    "cohere2",
    "glm",
    "gptj",
    "smollm3",
    "llama4_text",
    "deepseek_v2",
    "deepseek_v3",
    "minicpm3",
}


@dataclass(eq=False)
class Decoder:
    """The parts of a model the recompute runs, for one merge of ``fragments``.

    Attributes
    ----------
    fragments, landings
        What is merged and where each fragment lands.
    total : int
        ``N``, the merged length.
    ids : torch.Tensor
        ``[N]`` int64, the merged token ids.
    layers : list of torch.nn.Module
        The decoder layers, run one by one.
    embed, rotary : torch.nn.Module
        The input embedding and the rotary module.
    types : list of str
        Per layer, its rope layer type (``default``, or Gemma 3's ``sliding_attention`` ...).
    rotaries : dict
        Per layer type, the rotary module that computes its embeddings
        (:func:`kvlab.compat.rotary_modules`: one module with per-type frequencies, or 4.x's Gemma 3
        global and local modules).
    cache_kw : str
        The name under which a decoder layer takes its cache.
    eager : bool
        Eager attention (additive float mask) rather than sdpa (bool mask).
    """

    model: LoadedModel
    fragments: list[Fragment]
    landings: list[int]
    total: int
    ids: torch.Tensor
    layers: list
    embed: torch.nn.Module
    rotary: torch.nn.Module
    types: list[str]
    rotaries: dict
    cache_kw: str
    eager: bool
    device: torch.device
    dtype: torch.dtype

    @property
    def later(self) -> int:
        """The first position after fragment 0 (``N`` for one fragment): the tokens a recompute can change start here."""
        return self.landings[1] if len(self.landings) > 1 else self.total

    @classmethod
    def of(cls, model: LoadedModel, fragments: list[Fragment], landings: list[int]) -> Decoder:
        """Check that ``model`` and ``fragments`` can be recomputed, and collect the parts."""
        config = model.config
        model_type = getattr(config, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise MergeError(
                f"strategy 'recompute' runs decoder layers one by one and is checked only for "
                f"{', '.join(sorted(SUPPORTED_MODEL_TYPES))}; {model.name} is {model_type!r} (use 'rerotate' or 'reprefill')"
            )
        impl = getattr(config, "_attn_implementation", None) or "eager"
        if impl not in ("sdpa", "eager"):
            raise MergeError(
                f"strategy 'recompute' needs attention 'sdpa' or 'eager' (it passes its own 4-D mask), not {impl!r}"
            )
        for i, f in enumerate(fragments):
            if f.token_ids is None:
                raise MergeError(
                    f"fragment {i} has no token ids, so its tokens cannot be recomputed; use strategy 'rerotate'"
                )
            if f.token_ids.numel() != f.length:
                raise MergeError(f"fragment {i} has {f.token_ids.numel()} token ids for a cache of {f.length} tokens")
            if f.cache.layers[0].keys.shape[0] != 1:
                raise MergeError(
                    f"strategy 'recompute' handles batch size 1; fragment {i} has batch {f.cache.layers[0].keys.shape[0]}"
                )
        device = model.device
        base, layers = decoder_stack(model.model, config.num_hidden_layers)
        rotary = find_rotary_module(base)
        cache_kw = layer_cache_arg(layers[0])
        if cache_kw is None:
            raise MergeError(f"{type(layers[0]).__name__}.forward takes no cache argument; cannot recompute through it")
        return cls(
            model=model,
            fragments=fragments,
            landings=landings,
            total=landings[-1] + fragments[-1].length,
            ids=torch.cat([f.token_ids.reshape(-1) for f in fragments]).to(device),
            layers=layers,
            embed=base.get_input_embeddings(),
            rotary=rotary,
            types=layer_types(config),
            rotaries=rotary_modules(base, rotary, layer_types(config)),
            cache_kw=cache_kw,
            eager=impl == "eager",
            device=device,
            dtype=model.dtype,
        )


def decoder_stack(model: torch.nn.Module, n_layers: int) -> tuple[torch.nn.Module, list]:
    """The module holding the decoder layers (with the embedding and rotary module) and the layers.

    Found by structure, not by attribute name: GPT-J keeps its blocks as ``h``, most families as
    ``layers``, and Llama 4's causal LM nests its text model one level deeper than its prefix says.
    """
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) == n_layers:
            return model.get_submodule(name.rpartition(".")[0]), list(module)
    raise MergeError(f"{type(model).__name__} holds no list of its {n_layers} decoder layers")


@dataclass
class LayerKV:
    """What one layer of a recompute attends to and writes into.

    Attributes
    ----------
    keys, values : torch.Tensor
        ``[1, kv_heads, N, head_dim]`` full-length buffers: the recomputed tokens' fresh
        K/V are written into their slots, and the layer attends to slots ``lo .. hi-1``.
    avail : torch.Tensor or None
        ``[N]`` bool, the slots that hold a K/V (``None``: all of them).
    window : int or None
        The sliding window (``None``: full attention).
    done : callable or None
        ``done(keys, values)``, called after the layer ran (the write-back of step 4).
    """

    keys: torch.Tensor
    values: torch.Tensor
    avail: torch.Tensor | None
    window: int | None
    done: object = None


def sliding_window(cache: DynamicCache, li: int) -> int | None:
    layer = cache.layers[li]
    return layer.sliding_window if layer.is_sliding else None
