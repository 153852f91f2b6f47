"""Which GGUF file llama.cpp runs for a kvlab model, an engine on it, and the ids and reads both engines share."""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from kvlab.cache.fragments import tokenize
from kvlab.errors import PeerError
from kvlab.measure.stats import mean_ci
from kvlab.models.gguf import GGUF_MODELS
from kvlab.models.loaded import LoadedModel, cache_root
from kvlab.models.tiny import TINY_CONFIGS
from kvlab.peers.engine import LlamaEngine


def gguf_path(name: str) -> Path:
    """The GGUF file llama.cpp runs for a kvlab model name.

    Raises
    ------
    PeerError
        For a model with no GGUF file (the tiny models are built from a config in memory).
    ModelError
        When the model's package is not installed (the message says how to install it).
    """
    if name in TINY_CONFIGS:
        raise PeerError(
            f"cannot map {name!r} to llama.cpp: tiny models are built from a config in memory and have "
            f"no GGUF file; the models kvlab can run in llama.cpp are {', '.join(GGUF_MODELS)}"
        )
    if name not in GGUF_MODELS:
        raise PeerError(
            f"cannot map {name!r} to llama.cpp: unknown model; the models kvlab can run in llama.cpp "
            f"are {', '.join(GGUF_MODELS)}"
        )
    spec = GGUF_MODELS[name]
    return spec.locate(spec)


def model_gguf(model: LoadedModel) -> Path:
    """The GGUF file whose weights ``model`` holds (dequantised), or :class:`PeerError`."""
    src = model.source or {}
    if src.get("kind") == "tiny" or not src.get("gguf_file"):
        return gguf_path(model.name)
    if src.get("derived"):
        raise PeerError(
            f"cannot map {model.name!r} to llama.cpp: it is a derived variant ({src['derived']}) whose "
            "weights are no longer those of its GGUF file"
        )
    if src.get("gguf_path"):
        return Path(src["gguf_path"])
    return gguf_path(model.name)


def check_vocab(model: LoadedModel, engine: LlamaEngine) -> None:
    """Refuse a pairing whose logits do not index the same vocabulary."""
    n_kvlab = model.model.get_output_embeddings().weight.shape[0]
    if n_kvlab != engine.n_vocab:
        raise PeerError(
            f"vocabularies differ: kvlab's {model.name} has {n_kvlab} output tokens, llama.cpp's "
            f"{engine.path.name} has {engine.n_vocab}; token ids cannot be shared"
        )


def engine_for(model: LoadedModel, **options) -> LlamaEngine:
    """A :class:`LlamaEngine` on the GGUF file ``model`` was converted from, vocabulary checked.

    ``options`` go to :class:`LlamaEngine` (``n_ctx``, ``kv_type``, ``swa_full`` ...).
    """
    engine = LlamaEngine(model_gguf(model), **options)
    try:
        check_vocab(model, engine)
    except PeerError:
        engine.close()
        raise
    return engine


def has_bos(model: LoadedModel) -> bool:
    return model.tokenizer.bos_token_id is not None


def token_ids(model: LoadedModel, text: str, bos: bool = False) -> torch.Tensor:
    return tokenize(model, text, bos=bos and has_bos(model))


@torch.inference_mode()
def kvlab_log_probs(model: LoadedModel, ids: torch.Tensor) -> torch.Tensor:
    """``[vocab]`` float64 next-token log-probs of kvlab's model after ``[L]`` ids from position 0."""
    logits = model.model(input_ids=ids[None].to(model.device), logits_to_keep=1).logits[0, -1]
    return torch.log_softmax(logits.double(), -1)


def interval(values) -> tuple[float, float]:
    """``(lo, hi)`` of the 95% bootstrap interval of the mean (:func:`kvlab.mean_ci`, seed 0)."""
    ci = mean_ci(values)
    return ci.lo, ci.hi


def temp_workdir() -> Path:
    """A fresh folder for state files under ``$KVLAB_CACHE/peers``."""
    root = cache_root() / "peers"
    root.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(dir=root, prefix="work-"))
