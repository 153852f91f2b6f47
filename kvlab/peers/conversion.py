"""How close kvlab's dequantised fp32 model comes to llama.cpp running the GGUF it came from.

Both engines get the same token ids (kvlab's tokenizer); next-token distributions are compared
with ``KL(p || q)`` in nats, float64 over the full vocabulary; means carry a 95% bootstrap
interval over probes (2000 resamples, seed 0).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kvlab.measure.metrics import kl_divergence
from kvlab.models.loaded import LoadedModel
from kvlab.peers.engine import LlamaEngine
from kvlab.peers.mapping import engine_for, interval, kvlab_log_probs, model_gguf, token_ids
from kvlab.peers.quantize import requantize

#: Prompts for conversion fidelity: varied topics and lengths, each read from BOS.
CONVERSION_PROBES = [
    "The capital of France is",
    "Water boils at a temperature of",
    "def fibonacci(n):\n    if n <",
    "The lighthouse keeper counted the ships and wrote their names in a",
    "Once upon a time, in a small village by the sea, there lived an old",
    "Photosynthesis turns sunlight, water and carbon dioxide into",
    "1, 2, 3, 5, 8, 13,",
    "The most important rule of the kitchen is to always",
    "In 1969, the first people to walk on the Moon were",
    "She opened the letter, read the first line, and",
    "A prime number is a number that",
    "The train to Bergen leaves from platform",
]


@dataclass
class ConversionFidelity:
    """kvlab's fp32 dequantised model against llama.cpp running the same GGUF.

    Attributes
    ----------
    kl_mean, kl_ci, kl_max : float, (float, float), float
        ``KL(p_llama.cpp || p_kvlab)`` of the next token after each probe, nats.
    top1 : float
        Fraction of probes whose most likely next token agrees.
    kl_f32_mean, kl_f32_ci : float or None, (float, float) or None
        The same KL with llama.cpp running an F32 copy of the file (``requantize(..., "F32")``:
        the dequantised weights, as kvlab holds them). It isolates what the quantised file
        itself costs in llama.cpp: its matrix products round the activations to 8-bit blocks
        for integer dot products with the 4-bit weight blocks; with F32 weights they do not.
        What is left is llama.cpp's f16 KV cache and summation order.
    same_ids : float
        Fraction of probes that llama.cpp's own tokenizer splits into the same ids as kvlab's.
    rows : list of dict
        Per probe: ``probe``, ``tokens``, ``kl``, ``kl_f32``, ``top1_llama``, ``top1_kvlab``, ``agree``, ``same_ids``.
    """

    model: str
    gguf: str
    desc: str
    n: int
    kl_mean: float
    kl_ci: tuple[float, float]
    kl_max: float
    top1: float
    kl_f32_mean: float | None
    kl_f32_ci: tuple[float, float] | None
    same_ids: float
    rows: list[dict] = field(default_factory=list, repr=False)


def conversion_fidelity(
    model: LoadedModel, probes: list[str] | None = None, *, f32_file: bool = True, n_threads: int | None = None
) -> ConversionFidelity:
    """How close kvlab's dequantised fp32 model comes to llama.cpp on the GGUF it came from.

    Parameters
    ----------
    model : LoadedModel
        A GGUF-backed kvlab model (``smollm2-135m``, ``gemma3-270m`` or :func:`kvlab.models.sources.load_gguf_file`).
    probes : list of str
        Prompts, each read from BOS (default :data:`CONVERSION_PROBES`).
    f32_file : bool
        Also run llama.cpp on an F32 requantisation of the file (kept in ``$KVLAB_CACHE/peers``;
        4 bytes per weight), to separate the quantised matmuls from everything else.
    """
    probes = probes or CONVERSION_PROBES
    rows = []
    src = model_gguf(model)
    with engine_for(model, n_ctx=512, n_seq_max=1, n_threads=n_threads) as eng:
        f32 = LlamaEngine(requantize(src, "F32"), n_ctx=512, n_seq_max=1, n_threads=n_threads) if f32_file else None
        try:
            for probe in probes:
                ids = token_ids(model, probe, bos=True)
                lq = kvlab_log_probs(model, ids)
                eng.prefill(ids)
                lp = eng.log_probs()
                row = {
                    "probe": probe,
                    "tokens": len(ids),
                    "kl": kl_divergence(lp, lq),
                    "top1_llama": model.tokenizer.decode([int(lp.argmax())]),
                    "top1_kvlab": model.tokenizer.decode([int(lq.argmax())]),
                    "agree": int(lp.argmax()) == int(lq.argmax()),
                    "same_ids": eng.tokenize(probe) == token_ids(model, probe).tolist(),
                    "kl_f32": None,
                }
                if f32 is not None:
                    f32.prefill(ids)
                    row["kl_f32"] = kl_divergence(f32.log_probs(), lq)
                rows.append(row)
            desc = eng.info.desc
        finally:
            if f32 is not None:
                f32.close()
    kls = [r["kl"] for r in rows]
    kf = [r["kl_f32"] for r in rows] if f32_file else None
    return ConversionFidelity(
        model=model.name,
        gguf=src.name,
        desc=desc,
        n=len(rows),
        kl_mean=float(np.mean(kls)),
        kl_ci=interval(kls),
        kl_max=max(kls),
        top1=sum(r["agree"] for r in rows) / len(rows),
        kl_f32_mean=float(np.mean(kf)) if kf else None,
        kl_f32_ci=interval(kf) if kf else None,
        same_ids=sum(r["same_ids"] for r in rows) / len(rows),
        rows=rows,
    )
