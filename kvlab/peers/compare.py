"""kvlab beside llama.cpp on the same GGUF file: conversion fidelity, merges, state files.

Every measure feeds both engines the same token ids (kvlab's tokenizer) and compares
next-token distributions with ``KL(p || q)`` in nats, float64 over the full vocabulary.
Means carry a 95% bootstrap interval over probes (2000 resamples, seed 0).
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from kvlab.errors import FingerprintMismatch, PeerError
from kvlab.measure.metrics import kl_divergence
from kvlab.measure.stats import mean_ci
from kvlab.models.gguf import GGUF_MODELS
from kvlab.models.loaded import LoadedModel
from kvlab.peers.llama_cpp import QUANTISED_KV_TYPES, LlamaEngine

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


# ---------------------------------------------------------------------------- mapping


def gguf_path(name: str) -> Path:
    """The GGUF file llama.cpp runs for a kvlab model name.

    Raises
    ------
    PeerError
        For a model with no GGUF file (the tiny models are built from a config in memory).
    ModelError
        When the model's package is not installed (the message says how to install it).
    """
    from kvlab.models.tiny import TINY_CONFIGS

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


def _bos(model: LoadedModel) -> bool:
    return model.tokenizer.bos_token_id is not None


def _ids(model: LoadedModel, text: str, bos: bool = False) -> torch.Tensor:
    from kvlab.cache.fragments import tokenize

    return tokenize(model, text, bos=bos and _bos(model))


@torch.inference_mode()
def kvlab_log_probs(model: LoadedModel, ids: torch.Tensor) -> torch.Tensor:
    """``[vocab]`` float64 next-token log-probs of kvlab's model after ``[L]`` ids from position 0."""
    logits = model.model(input_ids=ids[None].to(model.device), logits_to_keep=1).logits[0, -1]
    return torch.log_softmax(logits.double(), -1)


def interval(values) -> tuple[float, float]:
    """``(lo, hi)`` of the 95% bootstrap interval of the mean (:func:`kvlab.mean_ci`, seed 0)."""
    ci = mean_ci(values)
    return ci.lo, ci.hi


# ---------------------------------------------------------------------------- conversion fidelity


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
    from kvlab.peers.llama_cpp import requantize

    probes = probes or CONVERSION_PROBES
    rows = []
    src = model_gguf(model)
    with engine_for(model, n_ctx=512, n_seq_max=1, n_threads=n_threads) as eng:
        f32 = LlamaEngine(requantize(src, "F32"), n_ctx=512, n_seq_max=1, n_threads=n_threads) if f32_file else None
        try:
            for probe in probes:
                ids = _ids(model, probe, bos=True)
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
                    "same_ids": eng.tokenize(probe) == _ids(model, probe).tolist(),
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


# ---------------------------------------------------------------------------- merges


@dataclass
class MergeRow:
    """One merge method against its own engine's joined prefill (or another reference).

    ``kls``: per-probe ``KL(p_reference || p_merged)`` in nats; ``top1``: fraction agreeing.
    """

    engine: str
    method: str
    reference: str
    kls: list[float]
    top1: float
    kl_mean: float = 0.0
    kl_ci: tuple[float, float] = (0.0, 0.0)
    kl_max: float = 0.0

    def __post_init__(self):
        self.kl_mean = float(np.mean(self.kls))
        self.kl_ci = interval(self.kls)
        self.kl_max = float(max(self.kls))

    def row(self) -> dict:
        return {
            "engine": self.engine,
            "method": self.method,
            "reference": self.reference,
            "kl_mean": self.kl_mean,
            "kl_lo": self.kl_ci[0],
            "kl_hi": self.kl_ci[1],
            "kl_max": self.kl_max,
            "top1": self.top1,
        }


def _compare(engine, method, reference, lps, lqs) -> MergeRow:
    return MergeRow(
        engine,
        method,
        reference,
        [kl_divergence(p, q) for p, q in zip(lps, lqs, strict=True)],
        sum(int(p.argmax()) == int(q.argmax()) for p, q in zip(lps, lqs)) / len(lps),
    )


def engine_reads(eng: LlamaEngine, ids: list, probe_ids: list) -> tuple[list, list, list]:
    """The probes read behind llama.cpp's joined prefill, its shift-merge and its phase merge.

    Parameters
    ----------
    eng : LlamaEngine
        With ``n_seq_max >= len(ids)`` and room for all fragments plus the longest probe.
    ids : list of torch.Tensor
        ``[L_i]`` token ids per fragment (the first with BOS where the model has one).
    probe_ids : list of torch.Tensor
        ``[P_j]`` token ids per probe, read behind each cache and removed again.

    Returns
    -------
    (joined, shifted, phase) : three lists of torch.Tensor
        ``[n_vocab]`` float64 next-token log-probs per probe: behind one prefill of the
        joined ids, behind :meth:`LlamaEngine.shift_merge` (decoded alone, K-shifted), and
        behind :meth:`LlamaEngine.phase_merge` (decoded alone at the landing positions).
    """
    eng.check_can_shift()  # before the joined prefill: a cache that cannot be shifted is refused at once
    eng.prefill(torch.cat(ids))
    joined = [eng.read(p) for p in probe_ids]
    eng.shift_merge(ids)
    shifted = [eng.read(p) for p in probe_ids]
    eng.phase_merge(ids)
    phase = [eng.read(p) for p in probe_ids]
    return joined, shifted, phase


def merge_side_by_side(
    model: LoadedModel,
    texts: list[str],
    probes: list[str],
    *,
    ratio: float = 0.15,
    engine: LlamaEngine | None = None,
    kvlab_rows: bool = True,
    f32_file: bool = True,
    **engine_options,
) -> list[MergeRow]:
    """llama.cpp's shift-merge and kvlab's merges, each against its own engine's joined prefill.

    The fragments are ``texts`` tokenised by kvlab (the first with BOS), each prefilled
    alone from position 0, and the same ids go to llama.cpp. Rows:

    * llama.cpp ``shift`` (what ``--cache-reuse`` does) and ``phase`` (each fragment decoded
      at its landing positions: no rotation, same missing context) against llama.cpp's
      joined prefill, and ``shift`` against ``phase`` (the K-shift's own error);
    * kvlab ``naive``, ``rerotate`` and ``recompute`` (``ratio``) against kvlab's joined prefill;
    * ``joined`` across engines: llama.cpp's joined prefill against kvlab's (the conversion gap
      on these texts, the floor under any cross-engine comparison).

    * with ``f32_file``, ``shift`` against ``phase`` in llama.cpp on an F32 copy of the file:
      with the quantised file, 8-bit rounding of activations amplifies the rounding of the
      rotated f16 keys; with the dequantised weights only that rounding is left.

    ``kvlab_rows=False`` leaves out kvlab's rows; ``engine_options`` (e.g. ``swa_full=False``)
    go to the :class:`LlamaEngine` made here when no ``engine`` is given.
    """
    from kvlab.cache.fragments import joined_prefill, prefill
    from kvlab.measure.case import FidelityReference
    from kvlab.measure.fidelity import fidelity

    if len(texts) < 2:
        raise PeerError("a merge needs at least two fragment texts")
    frags = [prefill(model, t, bos=(i == 0 and _bos(model))) for i, t in enumerate(texts)]
    ids = [f.token_ids for f in frags]
    probe_ids = [_ids(model, p) for p in probes]
    own = engine is None
    eng = engine or engine_for(
        model,
        n_ctx=max(512, 2 * (sum(map(len, ids)) + max(map(len, probe_ids)))),
        n_seq_max=len(frags),
        **engine_options,
    )
    try:
        joined, shifted, phase = engine_reads(eng, ids, probe_ids)
    finally:
        if own:
            eng.close()
    rows = [
        _compare("llama.cpp", "shift", "joined", joined, shifted),
        _compare("llama.cpp", "phase", "joined", joined, phase),
        _compare("llama.cpp", "shift", "phase", phase, shifted),
    ]
    if f32_file:
        # The same two merges with the dequantised weights: without 8-bit activations the
        # K-shift's only error left is the rounding of rotated f16 keys.
        from kvlab.peers.llama_cpp import requantize

        with LlamaEngine(
            requantize(model_gguf(model), "F32"), n_ctx=eng.n_ctx, n_seq_max=len(frags), **engine_options
        ) as f32:
            f32.shift_merge(ids)
            shifted32 = [f32.read(p) for p in probe_ids]
            f32.phase_merge(ids)
            phase32 = [f32.read(p) for p in probe_ids]
        rows.append(_compare("llama.cpp F32", "shift", "phase", phase32, shifted32))
    if not kvlab_rows:
        return rows
    ref = FidelityReference(model, joined_prefill(model, frags).cache)
    k_joined = [r.log_probs for r in ref.reads(probes, 0)]
    for strategy, opts in (("naive", {}), ("rerotate", {}), ("recompute", {"ratio": ratio})):
        fid = fidelity(model, frags, strategy, probes=probes, greedy_tokens=0, reference=ref, **opts)
        rows.append(
            MergeRow(
                "kvlab", strategy + (f" r={ratio}" if opts else ""), "joined", [r["kl"] for r in fid.probes], fid.top1
            )
        )
    rows.append(_compare("both", "joined", "llama.cpp joined", joined, k_joined))
    return rows


def _num(x: float) -> str:
    # Four decimals hide the small rows (the K-shift on F32 weights is ~1e-6 nats).
    return f"{x:.4f}" if x == 0 or abs(x) >= 1e-3 else f"{x:.1e}"


def format_rows(rows) -> str:
    """A plain-text table of :class:`MergeRow` rows."""
    head = f"{'engine':<13} {'method':<16} {'reference':<17} {'KL mean':>8} {'95% CI':>17} {'KL max':>8} {'top-1':>6}"
    out = [head, "-" * len(head)]
    for r in rows:
        out.append(
            f"{r.engine:<13} {r.method:<16} {r.reference:<17} {_num(r.kl_mean):>8} "
            f"{'[' + _num(r.kl_ci[0]) + ', ' + _num(r.kl_ci[1]) + ']':>17} {_num(r.kl_max):>8} {r.top1:>6.2f}"
        )
    return "\n".join(out)


# ---------------------------------------------------------------------------- quantised K cache


def long_fragments(
    model: LoadedModel, n_tokens: int, n_fragments: int = 2, n_probes: int = 8, seed: int = 0
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Seeded passages of exactly ``n_tokens`` ids each, and question probes about them.

    The passages and questions are :func:`kvlab.findings.longctx.make_set`'s (as in
    ``studies/llama_cpp_swa.py``), generated a little longer than asked and cut to
    ``n_tokens`` ids, so every fragment has the same length; the first starts with BOS.

    Returns
    -------
    (ids, probe_ids) : list of torch.Tensor, list of torch.Tensor
        ``n_fragments`` tensors ``[n_tokens]``, and ``n_probes`` tensors ``[P_j]`` (no BOS).
    """
    from kvlab.findings import longctx

    s = longctx.make_set(model, n_fragments, n_tokens + 48, seed=seed, max_questions=n_probes)
    ids = [_ids(model, p + " ", bos=(i == 0))[:n_tokens] for i, p in enumerate(s.passages)]
    if min(map(len, ids)) < n_tokens:
        raise PeerError(f"the generated passages have {[len(i) for i in ids]} tokens, fewer than {n_tokens}")
    probes = [f"\nQuestion: {q.text}\nAnswer: {q.lead}".rstrip() for q in s.questions]
    return ids, [_ids(model, p) for p in probes]


@dataclass(frozen=True)
class CacheLayout:
    """A llama.cpp KV cache layout: element types of K and V, flash attention, sliding layers.

    ``flash_attn=None`` keeps llama.cpp's automatic choice; ``swa_full=False`` keeps only the
    window in sliding-window layers (what ``llama-server`` runs).
    """

    type_k: str = "f16"
    type_v: str = "f16"
    flash_attn: bool | None = None
    swa_full: bool = True

    @property
    def label(self) -> str:
        extra = "" if self.flash_attn is None else f", flash_attn={'on' if self.flash_attn else 'off'}"
        extra += "" if self.swa_full else ", swa_full=False"
        return f"K {self.type_k}, V {self.type_v}{extra}"


@dataclass
class QuantisedShift:
    """llama.cpp's K-shift and shift-merge with one cache layout, two fragments of ``tokens`` each.

    Every row compares next-token distributions behind two caches on the same ``n`` probes
    (``KL(p_reference || p_other)``, nats; :class:`MergeRow`).

    Attributes
    ----------
    k_shift : MergeRow or None
        Shift-merge against the phase merge (the second fragment decoded directly at its landing
        positions), both with this layout: the K-shift's own error. With a quantised K cache the
        shift dequantises the keys, rotates them and quantises them again.
    shift_joined : MergeRow or None
        Shift-merge against llama.cpp's joined prefill with the same layout.
    phase_joined : MergeRow or None
        Phase merge against the same joined prefill: the missing cross-fragment context alone.
    quantisation : MergeRow or None
        The joined prefill with this layout against the joined prefill with an f16 K and V cache:
        what the K type costs without any merge (exactly zero for the f16 layout itself).
    refused : str
        llama.cpp's refusal (:class:`PeerError` text) when it refused the layout or the shift;
        every row is then ``None``.
    """

    model: str
    layout: CacheLayout
    tokens: int
    n: int
    k_shift: MergeRow | None = None
    shift_joined: MergeRow | None = None
    phase_joined: MergeRow | None = None
    quantisation: MergeRow | None = None
    refused: str = ""
    wall_s: float = 0.0

    def row(self) -> dict:
        """A flat dict for JSON: the layout, and ``kl_mean``/``kl_lo``/``kl_hi``/``kl_max``/``top1`` per comparison."""
        out = {"model": self.model, "layout": self.layout.label, **vars(self.layout), "tokens": self.tokens}
        out |= {"n": self.n, "refused": self.refused, "wall_s": self.wall_s}
        for name in ("k_shift", "shift_joined", "phase_joined", "quantisation"):
            r = getattr(self, name)
            out[name] = None if r is None else r.row() | {"kls": r.kls}
        return out


def refusal_layouts(model: LoadedModel, kv_types=QUANTISED_KV_TYPES) -> list[CacheLayout]:
    """Layouts llama.cpp is expected to refuse, to record its reasons beside the measured ones.

    A quantised V cache without flash attention (per type); for a model with sliding-window
    layers, the server's window-only layout (``swa_full=False``), where no shift is possible.
    """
    out = [CacheLayout(t, t, flash_attn=False) for t in kv_types if t in QUANTISED_KV_TYPES]
    if getattr(model.config.get_text_config(), "sliding_window", None):
        out.append(CacheLayout("f16", swa_full=False))
    return out


def quantised_shift_table(
    model: LoadedModel,
    lengths=(512, 2048),
    kv_types=("f16",) + QUANTISED_KV_TYPES,
    *,
    refusals: bool = True,
    n_probes: int = 8,
    seed: int = 0,
    swa_full: bool = True,
    n_threads: int | None = None,
) -> list[QuantisedShift]:
    """llama.cpp's K-shift on an f16, q8_0 or q4_0 K cache (V f16), against its own references.

    For each fragment length, two seeded fragments of that many tokens (:func:`long_fragments`)
    are merged by llama.cpp with each K type and read on ``n_probes`` question probes
    (:func:`engine_reads`). The V cache stays f16: a quantised V cache needs flash attention,
    and the K-shift never touches V. The f16 row is the baseline: its ``quantisation`` row is
    zero and its ``k_shift`` row is the rounding of rotated f16 keys (amplified by the quantised
    file's 8-bit activations), so a quantised type's own cost and its shift's are separable.

    Parameters
    ----------
    lengths : sequence of int
        Tokens per fragment (two fragments).
    kv_types : sequence of str
        K cache types (:data:`kvlab.peers.llama_cpp.KV_TYPES`).
    refusals : bool
        Also try :func:`refusal_layouts` and record llama.cpp's reasons as refused rows.
    swa_full : bool
        llama.cpp's sliding-window layout for the measured rows (``True`` keeps every token, so
        a sliding-window model can be shifted).

    Returns
    -------
    list of QuantisedShift
        Per length, one row per K type, then the refused layouts.
    """
    import time

    layouts = [CacheLayout(t, "f16", swa_full=swa_full) for t in kv_types]
    if refusals:
        layouts += [lay for lay in refusal_layouts(model, kv_types) if lay not in layouts]
    f16 = CacheLayout(swa_full=swa_full)
    out = []
    for n_tokens in lengths:
        ids, probe_ids = long_fragments(model, n_tokens, n_probes=n_probes, seed=seed)
        options = {"n_ctx": 2 * n_tokens + 64 + max(map(len, probe_ids)), "n_seq_max": 2, "n_threads": n_threads}
        base = None  # reads behind the f16 joined prefill: the reference of every quantisation row
        if f16 not in layouts:
            with engine_for(model, swa_full=swa_full, **options) as eng:
                eng.prefill(torch.cat(ids))
                base = [eng.read(p) for p in probe_ids]
        for lay in sorted(layouts, key=lambda lay: lay != f16):  # the f16 baseline first
            t0 = time.perf_counter()
            cell = QuantisedShift(model.name, lay, n_tokens, len(probe_ids))
            engine_options = {"type_k": lay.type_k, "type_v": lay.type_v, "flash_attn": lay.flash_attn}
            try:
                with engine_for(model, swa_full=lay.swa_full, **engine_options, **options) as eng:
                    joined, shifted, phase = engine_reads(eng, ids, probe_ids)
            except PeerError as e:
                cell.refused = str(e)
            else:
                base = joined if lay == f16 else base
                cell.k_shift = _compare("llama.cpp", "shift", "phase", phase, shifted)
                cell.shift_joined = _compare("llama.cpp", "shift", "joined", joined, shifted)
                cell.phase_joined = _compare("llama.cpp", "phase", "joined", joined, phase)
                if base is not None:  # None only when llama.cpp refused the f16 layout itself
                    cell.quantisation = _compare("llama.cpp", "joined", "f16 joined", base, joined)
            cell.wall_s = time.perf_counter() - t0
            out.append(cell)
    return out


def format_quantised(cells: list[QuantisedShift]) -> str:
    """A plain-text table of :func:`quantised_shift_table`: mean [95% CI] and max KL per comparison, nats."""

    def cell(r: MergeRow | None) -> str:
        return f"{_num(r.kl_mean)} [{_num(r.kl_ci[0])}, {_num(r.kl_ci[1])}] {_num(r.kl_max)}" if r else "-"

    cols = ("K-shift: shift vs phase", "shift-merge vs joined", "phase vs joined", "joined vs f16 joined")
    head = f"{'cache':<34} {'tokens':>9} {'n':>2}  " + "  ".join(f"{c:<35}" for c in cols)
    out = [head + "  (mean [95% CI] max)", "-" * len(head)]
    for c in cells:
        left = f"{c.layout.label:<34} {'2 x ' + str(c.tokens):>9} {c.n:>2}  "
        if c.refused:
            out.append(left + "REFUSED: " + c.refused)
            continue
        rows = (c.k_shift, c.shift_joined, c.phase_joined, c.quantisation)
        out.append(left + "  ".join(f"{cell(r):<35}" for r in rows))
    return "\n".join(out)


# ---------------------------------------------------------------------------- identity


@dataclass
class StateLoad:
    """What llama.cpp did when a reader model was given a producer's state file.

    ``accepted``: llama.cpp loaded it; ``said``: llama.cpp's reason when it refused;
    ``kls``: per probe ``KL(p_own || p_foreign)``, the reader behind its own prefill of the
    same tokens against behind the loaded file (empty when refused or vocabularies differ);
    ``flips``: probes whose top-1 token changed.
    """

    file: str  # "state" (llama_state_save_file, a session file) or "seq" (llama_state_seq_save_file)
    reader: str
    reader_desc: str
    accepted: bool
    said: str = ""
    kls: list[float] = field(default_factory=list)
    flips: int = 0

    @property
    def kl_mean(self) -> float | None:
        return float(np.mean(self.kls)) if self.kls else None

    @property
    def kl_max(self) -> float | None:
        return float(max(self.kls)) if self.kls else None


def state_file_study(
    model: LoadedModel, text: str, probes: list[str], readers: dict[str, Path], workdir
) -> list[StateLoad]:
    """Write llama.cpp state files from ``model``'s GGUF and offer them to each reader GGUF.

    Parameters
    ----------
    readers : dict of str to Path
        Reader name to GGUF file (e.g. the producer itself, a requantisation, another model).
    workdir : path
        Where the state files are written.
    """
    workdir = Path(workdir)
    ids = _ids(model, text, bos=True)
    probe_ids = [_ids(model, p) for p in probes]
    files = {}
    with engine_for(model, n_ctx=1024, n_seq_max=1) as prod:
        prod.prefill(ids)
        files["state"] = prod.save_state(workdir / "producer.state", ids)
        files["seq"] = prod.save_seq_state(workdir / "producer.seq", ids)
        n_vocab = prod.n_vocab
    out = []
    for name, path in readers.items():
        with LlamaEngine(path, n_ctx=1024, n_seq_max=1) as reader:
            own = None
            if reader.n_vocab == n_vocab:
                reader.prefill(ids)
                own = [reader.read(p) for p in probe_ids]
            for kind, f in files.items():
                reader.clear()
                try:
                    (reader.load_state if kind == "state" else reader.load_seq_state)(f)
                except PeerError as e:
                    out.append(StateLoad(kind, name, reader.info.desc, False, said=str(e).split(": ", 1)[-1]))
                    continue
                row = StateLoad(kind, name, reader.info.desc, True)
                if own is not None:
                    foreign = [reader.read(p) for p in probe_ids]
                    row.kls = [kl_divergence(a, b) for a, b in zip(own, foreign)]
                    row.flips = sum(int(a.argmax()) != int(b.argmax()) for a, b in zip(own, foreign))
                out.append(row)
    return out


def kvlab_refusals(
    model: LoadedModel, text: str, readers: dict[str, LoadedModel], workdir
) -> dict[str, list[str] | None]:
    """kvlab's answer to the same pairs: save a cache file from ``model``, load it into each reader.

    Returns, per reader, the list of differing strict fingerprint fields (``None`` if it loaded).
    """
    from kvlab.cache.fragments import prefill
    from kvlab.files.io import load_cache, save_cache

    path = save_cache(Path(workdir) / "producer.kvcache", prefill(model, text, bos=_bos(model)), model)
    out = {}
    for name, reader in readers.items():
        try:
            load_cache(path, reader)
            out[name] = None
        except FingerprintMismatch as e:
            out[name] = [d.field for d in e.differences]
    return out


# ---------------------------------------------------------------------------- summary


def peer_table(model: LoadedModel, texts: list[str] | None = None, probes: list[str] | None = None) -> str:
    """The side-by-side tables ``kvlab peers`` prints: conversion fidelity, then merges."""
    from kvlab.measure.case import DEFAULT_PROBES, DEFAULT_TEXTS

    conv = conversion_fidelity(model)
    lines = [
        f"kvlab {model.name} (fp32, dequantised) against llama.cpp on {conv.gguf} ({conv.desc})",
        f"conversion: KL(llama.cpp || kvlab) mean {conv.kl_mean:.4f} nats [95% CI {conv.kl_ci[0]:.4f}, "
        f"{conv.kl_ci[1]:.4f}], max {conv.kl_max:.4f}, top-1 agree {conv.top1:.2f}, n={conv.n} prompts; "
        f"llama.cpp on an F32 copy of the file {conv.kl_f32_mean:.2e}; same token ids {conv.same_ids:.2f}",
        "",
        "merges: next-token KL (nats) against each engine's own joined prefill",
    ]
    rows = merge_side_by_side(model, texts or DEFAULT_TEXTS, probes or DEFAULT_PROBES)
    lines.append(format_rows(rows))
    return "\n".join(lines)


def temp_workdir() -> Path:
    """A fresh folder for state files under ``$KVLAB_CACHE/peers``."""
    from kvlab.models.loaded import cache_root

    root = cache_root() / "peers"
    root.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(dir=root, prefix="work-"))


__all__ = [
    "CONVERSION_PROBES",
    "CacheLayout",
    "ConversionFidelity",
    "MergeRow",
    "QuantisedShift",
    "StateLoad",
    "check_vocab",
    "conversion_fidelity",
    "engine_for",
    "engine_reads",
    "format_quantised",
    "format_rows",
    "gguf_path",
    "kvlab_log_probs",
    "kvlab_refusals",
    "long_fragments",
    "merge_side_by_side",
    "model_gguf",
    "peer_table",
    "quantised_shift_table",
    "refusal_layouts",
    "state_file_study",
    "temp_workdir",
]
