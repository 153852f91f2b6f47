"""Fragments: a KV cache plus the tokens, text and start position it was computed from."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from kvlab.compat import forward
from kvlab.errors import MergeError
from kvlab.models.loaded import LoadedModel
from kvlab.models.rope import check_positions


@dataclass(frozen=True)
class LayerGeometry:
    """What one cache layer holds: ``keys``/``values`` are ``[batch, kv_heads, kept, head_dim]``."""

    sliding_window: int | None  # None for full attention
    batch: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device


@dataclass(frozen=True, eq=False)
class Fragment:
    """A KV cache computed for ``length`` tokens at positions ``start .. start+length-1``.

    Attributes
    ----------
    cache : DynamicCache
        One layer per decoder layer; keys and values ``[batch, kv_heads, kept, head_dim]``
        where ``kept == length`` except on sliding-window layers (the last ``window - 1``).
    token_ids : torch.Tensor or None
        ``[length]`` int64, the tokens the cache was computed from.
    text : str or None
        The source text (``None`` when unknown, e.g. an unverified file).
    start : int
        Position of the first token, i.e. the RoPE phase the keys carry.
    model_name : str
        kvlab name of the producer.
    config : PretrainedConfig
        Config of the producer (layer types, sliding window).
    """

    cache: DynamicCache
    token_ids: torch.Tensor | None
    text: str | None
    start: int
    model_name: str
    config: object = field(repr=False)

    @property
    def length(self) -> int:
        return self.cache.get_seq_length()

    @property
    def end(self) -> int:
        return self.start + self.length

    @property
    def num_layers(self) -> int:
        return len(self.cache.layers)

    def geometry(self) -> list[LayerGeometry]:
        out = []
        for layer in self.cache.layers:
            k = layer.keys
            out.append(
                LayerGeometry(
                    getattr(layer, "sliding_window", None) if layer.is_sliding else None,
                    k.shape[0],
                    k.shape[1],
                    k.shape[3],
                    k.dtype,
                    k.device,
                )
            )
        return out

    def layer_positions(self, layer_idx: int) -> torch.Tensor:
        """``[kept]`` absolute positions of the tokens a layer holds."""
        kept = self.cache.layers[layer_idx].keys.shape[-2]
        return torch.arange(self.end - kept, self.end)


def new_cache(config) -> DynamicCache:
    """An empty cache with the layer types the model's config asks for."""
    return DynamicCache(config=config)


def clone_cache(cache: DynamicCache, config, dtype: torch.dtype | None = None, device=None) -> DynamicCache:
    """A deep copy, built through the cache API (``update``), never by assigning ``.keys``.

    ``dtype``/``device``: cast the copy (keys and values ``[batch, kv_heads, kept, head_dim]``).
    """
    out = new_cache(config)
    for i, layer in enumerate(cache.layers):
        out.update(layer.keys.to(device, dtype, copy=True), layer.values.to(device, dtype, copy=True), i)
        set_length(out.layers[i], layer.get_seq_length())
    return out


def set_length(layer, total: int) -> None:
    """Make a cache layer filled by ``update`` report ``total`` tokens seen.

    A sliding layer keeps only its last ``window - 1`` tokens, but masks
    (``get_mask_sizes``) and ``get_seq_length`` read ``cumulative_length``, which must
    count every token of the sequence, not just the ones handed to ``update``. A full
    layer already counts what it holds and is left alone.
    """
    if layer.is_sliding:
        layer.cumulative_length = total


def tokenize(model: LoadedModel, text: str, bos: bool = False) -> torch.Tensor:
    """``[L]`` int64 token ids of ``text``; a BOS token is prepended only when asked."""
    ids = model.tokenizer(text, add_special_tokens=False)["input_ids"]
    if bos:
        bos_id = model.tokenizer.bos_token_id
        if bos_id is None:
            raise MergeError(f"{model.name}'s tokenizer has no BOS token")
        ids = [bos_id] + list(ids)
    return torch.tensor(ids, dtype=torch.long)


@torch.inference_mode()
def prefill_ids(model: LoadedModel, ids: torch.Tensor, start: int = 0) -> DynamicCache:
    """Run the model on ``ids`` at positions ``start..start+L-1`` and return its cache.

    Parameters
    ----------
    ids : torch.Tensor
        ``[L]`` or ``[batch, L]`` token ids.

    Returns
    -------
    DynamicCache
        keys/values ``[batch, kv_heads, L (or window-1), head_dim]``.
    """
    ids = ids if ids.ndim == 2 else ids[None]
    if ids.shape[-1] == 0:
        raise MergeError("cannot prefill an empty token sequence")
    if start < 0:
        raise MergeError(f"start must be >= 0, got {start}")
    check_positions(model.config, start + ids.shape[-1], "prefill")
    L = ids.shape[-1]
    cache = new_cache(model.config)
    positions = torch.arange(start, start + L, device=model.device)[None].expand(ids.shape[0], -1)
    # Only the cache is wanted: skip the vocabulary projection for all but one token.
    forward(
        model.model, cache, input_ids=ids.to(model.device), position_ids=positions, use_cache=True, logits_to_keep=1
    )
    return cache


def prefill(model: LoadedModel, text: str, start: int = 0, bos: bool = False) -> Fragment:
    """Prefill ``text`` as a stand-alone fragment whose first token sits at ``start``.

    ``start=0`` is how a fragment is cached on its own. ``start=L1`` gives the exact
    phase reference for a fragment that will land behind ``L1`` tokens: same context
    (itself only) but keys at the landing phase.
    """
    ids = tokenize(model, text, bos=bos)
    cache = prefill_ids(model, ids, start)
    return Fragment(cache=cache, token_ids=ids, text=text, start=start, model_name=model.name, config=model.config)


def prefill_tokens(model: LoadedModel, ids: torch.Tensor, start: int = 0) -> Fragment:
    """Like :func:`prefill` but from ``[L]`` token ids (the text is their decoding)."""
    ids = torch.as_tensor(ids, dtype=torch.long)
    cache = prefill_ids(model, ids, start)
    text = model.tokenizer.decode(ids.tolist())
    return Fragment(cache=cache, token_ids=ids, text=text, start=start, model_name=model.name, config=model.config)


def joined_prefill(model: LoadedModel, fragments: list[Fragment]) -> Fragment:
    """The full-context reference: one prefill of all fragments' tokens, in order, at 0."""
    ids = torch.cat([source_ids(f, i) for i, f in enumerate(fragments)])
    texts = [f.text for f in fragments]
    cache = prefill_ids(model, ids, 0)
    text = "".join(texts) if all(t is not None for t in texts) else None
    return Fragment(cache=cache, token_ids=ids, text=text, start=0, model_name=model.name, config=model.config)


def source_ids(fragment: Fragment, index: int) -> torch.Tensor:
    if fragment.text is None or fragment.token_ids is None:
        raise MergeError(
            f"fragment {index} has no source text/token ids, so it cannot be re-prefilled; "
            "keep the source with the cache, or use strategy 'rerotate'"
        )
    return fragment.token_ids
