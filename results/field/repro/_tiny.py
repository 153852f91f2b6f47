"""Tiny random models built from transformers' own config classes, for the reproductions beside this file.

Each reproduction imports only transformers, torch and the package it reproduces a defect of (kvlab
is not needed): a maintainer can run one in the package's own environment, from this folder.
"""

from __future__ import annotations

import torch
import transformers

COMMON = dict(
    vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=512,
)  # fmt: skip


def build(config_class: str, model_class: str, **extra):
    """A seeded, randomly initialised ``model_class`` of ``config_class`` with :data:`COMMON` and ``extra``, in eval mode."""
    torch.manual_seed(0)
    config = getattr(transformers, config_class)(**{**COMMON, **extra})
    config._attn_implementation = "eager"
    return getattr(transformers, model_class)(config).eval()


def ids(n: int, seed: int = 1) -> torch.Tensor:
    """``[1, n]`` random token ids."""
    return torch.randint(3, COMMON["vocab_size"], (1, n), generator=torch.Generator().manual_seed(seed))


def prefill(model, input_ids, positions=None, layered=True):
    """A ``DynamicCache`` of ``input_ids`` (at ``positions``, default ``0 .. n-1``), without autograd.

    ``layered``: built from the model's config (sliding layers where it has them); else
    ``DynamicCache()``, every layer full, as kvpress's pipeline builds it.
    """
    cache = transformers.DynamicCache(config=model.config) if layered else transformers.DynamicCache()
    extra = {} if positions is None else {"position_ids": positions[None]}
    name = "cache" if "cache" in model.forward.__code__.co_varnames else "past_key_values"
    with torch.no_grad():
        model(input_ids=input_ids, use_cache=True, **{name: cache}, **extra)
    return cache


def verdict(defect: bool, message: str) -> None:
    """Print what was seen and exit 1 on the defect, 0 without it."""
    print(("DEFECT: " if defect else "ok: ") + message)
    raise SystemExit(1 if defect else 0)
