"""llama.cpp's shift-merge and kvlab's merges, each against its own engine's joined prefill."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvlab.cache.fragments import joined_prefill, prefill
from kvlab.errors import PeerError
from kvlab.measure.case import FidelityReference
from kvlab.measure.fidelity import fidelity
from kvlab.measure.metrics import kl_divergence
from kvlab.models.loaded import LoadedModel
from kvlab.peers.engine import LlamaEngine
from kvlab.peers.mapping import engine_for, has_bos, interval, model_gguf, token_ids
from kvlab.peers.quantize import requantize


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


def compare_reads(engine, method, reference, lps, lqs) -> MergeRow:
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
    if len(texts) < 2:
        raise PeerError("a merge needs at least two fragment texts")
    frags = [prefill(model, t, bos=(i == 0 and has_bos(model))) for i, t in enumerate(texts)]
    ids = [f.token_ids for f in frags]
    probe_ids = [token_ids(model, p) for p in probes]
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
        compare_reads("llama.cpp", "shift", "joined", joined, shifted),
        compare_reads("llama.cpp", "phase", "joined", joined, phase),
        compare_reads("llama.cpp", "shift", "phase", phase, shifted),
    ]
    if f32_file:
        # The same two merges with the dequantised weights: without 8-bit activations the
        # K-shift's only error left is the rounding of rotated f16 keys.
        with LlamaEngine(
            requantize(model_gguf(model), "F32"), n_ctx=eng.n_ctx, n_seq_max=len(frags), **engine_options
        ) as f32:
            f32.shift_merge(ids)
            shifted32 = [f32.read(p) for p in probe_ids]
            f32.phase_merge(ids)
            phase32 = [f32.read(p) for p in probe_ids]
        rows.append(compare_reads("llama.cpp F32", "shift", "phase", phase32, shifted32))
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
    rows.append(compare_reads("both", "joined", "llama.cpp joined", joined, k_joined))
    return rows


def short_number(x: float) -> str:
    # Four decimals hide the small rows (the K-shift on F32 weights is ~1e-6 nats).
    return f"{x:.4f}" if x == 0 or abs(x) >= 1e-3 else f"{x:.1e}"


def format_rows(rows) -> str:
    """A plain-text table of :class:`MergeRow` rows."""
    head = f"{'engine':<13} {'method':<16} {'reference':<17} {'KL mean':>8} {'95% CI':>17} {'KL max':>8} {'top-1':>6}"
    out = [head, "-" * len(head)]
    for r in rows:
        ci = f"[{short_number(r.kl_ci[0])}, {short_number(r.kl_ci[1])}]"
        out.append(
            f"{r.engine:<13} {r.method:<16} {r.reference:<17} {short_number(r.kl_mean):>8} "
            f"{ci:>17} {short_number(r.kl_max):>8} {r.top1:>6.2f}"
        )
    return "\n".join(out)
