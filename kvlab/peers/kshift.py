"""llama.cpp's K-shift with f16 and quantised K caches, against its own references; the layouts it refuses."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from kvlab.errors import PeerError
from kvlab.findings import longctx
from kvlab.models.loaded import LoadedModel
from kvlab.peers.engine import QUANTISED_KV_TYPES
from kvlab.peers.mapping import engine_for, token_ids
from kvlab.peers.merges import MergeRow, compare_reads, engine_reads, short_number


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
    s = longctx.make_set(model, n_fragments, n_tokens + 48, seed=seed, max_questions=n_probes)
    ids = [token_ids(model, p + " ", bos=(i == 0))[:n_tokens] for i, p in enumerate(s.passages)]
    if min(map(len, ids)) < n_tokens:
        raise PeerError(f"the generated passages have {[len(i) for i in ids]} tokens, fewer than {n_tokens}")
    probes = [f"\nQuestion: {q.text}\nAnswer: {q.lead}".rstrip() for q in s.questions]
    return ids, [token_ids(model, p) for p in probes]


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
        K cache types (:data:`kvlab.peers.engine.KV_TYPES`).
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
                cell.k_shift = compare_reads("llama.cpp", "shift", "phase", phase, shifted)
                cell.shift_joined = compare_reads("llama.cpp", "shift", "joined", joined, shifted)
                cell.phase_joined = compare_reads("llama.cpp", "phase", "joined", joined, phase)
                if base is not None:  # None only when llama.cpp refused the f16 layout itself
                    cell.quantisation = compare_reads("llama.cpp", "joined", "f16 joined", base, joined)
            cell.wall_s = time.perf_counter() - t0
            out.append(cell)
    return out


def format_quantised(cells: list[QuantisedShift]) -> str:
    """A plain-text table of :func:`quantised_shift_table`: mean [95% CI] and max KL per comparison, nats."""

    def cell(r: MergeRow | None) -> str:
        if r is None:
            return "-"
        lo, hi = r.kl_ci
        return f"{short_number(r.kl_mean)} [{short_number(lo)}, {short_number(hi)}] {short_number(r.kl_max)}"

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
