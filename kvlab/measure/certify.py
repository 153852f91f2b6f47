"""``kvlab certify``: one model's merge machinery checked on its own keys, each line beside its bound.

A cache store that blends or moves cached fragments trusts three things per model: that the
model rotates keys the way the store re-rotates them, at every position it will use; that the
exact strategies are exact (recompute at ratio 0 is rerotate, at ratio 1 the joined prefill),
sliding windows included; and that what cannot be rotated is refused rather than merged. A
:class:`Certificate` measures each of these on the model's own weights, with a bound set by
what fp32 arithmetic explains (never a tolerance fitted to the model), plus the cache-file
round trip, the model's noise floor and its context error against full recompute. Its JSON is
the record a store's CI, a sweep or a report can cite; ``kvlab certify`` exits 1 when any line
fails.

Bounds:

* phase lines: :func:`kvlab.measure.metrics.phase_beyond_rounding` ``<= 1``: every rotary key
  pair agrees with the model's own key at that position to within the angle fp32 rounding
  explains (the model's fp32 angle ``position * inv_freq`` included, so the bound widens with
  the offset exactly as the model's own precision does).
* identities: bit for bit (0 differing elements) where the computation is the same, and
  :data:`REL_KEY_NOISE` relative where it is the same maths in another order.
* the floor: :data:`FLOOR_BOUND` nats; kvlab's findings are KLs of 1e-3 nats and up.

This module runs the checks in order and holds the identities, refusals, file round trip, floor
and context lines; the record is :mod:`kvlab.measure.certificate`, the phase lines
:mod:`kvlab.measure.phase` (against the float64 twin of :mod:`kvlab.measure.twin`), the sliding
window's :mod:`kvlab.measure.sliding`, and their token ids :mod:`kvlab.measure.tokens`.
"""

from __future__ import annotations

import dataclasses
import math
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import DynamicCache

from kvlab.cache.fragments import Fragment, joined_prefill, prefill_tokens
from kvlab.cache.merge import merge
from kvlab.cache.recompute.strategy import POLICIES
from kvlab.cache.shift import shift_
from kvlab.errors import FingerprintMismatch, KvlabError, MergeError, PositionError, UnsupportedRopeError
from kvlab.files.identity import fingerprint
from kvlab.files.io import load_cache, save_cache
from kvlab.measure.case import DEFAULT_PROBES, Case
from kvlab.measure.certificate import FAIL, INFO, NA, PASS, REFUSED, Certificate, Line
from kvlab.measure.metrics import REL_KEY_NOISE, kl_divergence, next_token_kl
from kvlab.measure.mismatch import variants
from kvlab.measure.phase import LENGTHS, rerotate_phase_lines, rotation_lines
from kvlab.measure.probes import read_probes
from kvlab.measure.sliding import identity_fragments, sliding_line
from kvlab.measure.tokens import TokenSource, position_limit
from kvlab.models.layout import layer_ropes
from kvlab.models.loaded import LoadedModel
from kvlab.models.rope import check_composable

#: Largest KL (nats) allowed between two reads that differ only in batching or threads.
FLOOR_BOUND = 1e-6

#: Recompute ratio of the context-error line (CacheBlend's ~15%).
INFO_RATIO = 0.15


def certify(model: LoadedModel, *, lengths: tuple[int, ...] = LENGTHS, seed: int = 0) -> Certificate:
    """Run every check of ``kvlab certify`` on ``model``.

    Parameters
    ----------
    model : LoadedModel
    lengths : tuple of int
        Fragment lengths of the rerotate phase check (two fragments each).
    seed : int
        Seed of the random token ids the fragments are made of.

    Returns
    -------
    Certificate
        ``passed`` is True when no line failed or was refused.
    """
    t0 = time.perf_counter()
    ids = TokenSource(model, seed)
    lines = rotation_lines(model) + rerotate_phase_lines(model, ids, lengths)
    exact = _Exact.of(model, identity_fragments(model, ids))
    lines += _sliding(model, exact) + _recompute_identities(model, exact)
    story = Case.from_texts(model)
    lines += _refusals(model, ids) + _file_round_trip(model, exact) + _floor(model, story) + _context(model, story)
    return Certificate(model.name, lines, fingerprint(model), time.perf_counter() - t0)


@dataclass
class _Exact:
    """The fragments of the exact identities, their joined prefill and their rerotate merge, each made once.

    ``rotated`` is ``None`` and ``refusal`` says why where the model's rotations do not compose.
    """

    frags: list[Fragment]
    joined: DynamicCache
    rotated: DynamicCache | None
    refusal: str | None

    @classmethod
    def of(cls, model: LoadedModel, frags: list[Fragment]) -> _Exact:
        joined = joined_prefill(model, frags).cache
        try:
            return cls(frags, joined, merge(frags, "rerotate", model), None)
        except UnsupportedRopeError as e:
            return cls(frags, joined, None, str(e))


def _sliding(model: LoadedModel, exact: _Exact) -> list[Line]:
    """Past the window, every layer of a merge keeps what a joined prefill keeps."""
    return [sliding_line(model, exact.frags, exact.joined, exact.rotated, exact.refusal)]


def unequal_elements(a: DynamicCache, b: DynamicCache) -> int:
    """Elements of K and V that differ (any shape or length difference counts every element)."""
    n = 0
    for la, lb in zip(a.layers, b.layers, strict=True):
        for x, y in ((la.keys, lb.keys), (la.values, lb.values)):
            n += int((x != y).sum()) if x.shape == y.shape else max(x.numel(), y.numel())
        n += la.get_seq_length() != lb.get_seq_length()
    return n


def _rel_error(a: DynamicCache, b: DynamicCache) -> float:
    """``max`` over layers of ``max |X - X_ref| / max |X_ref|``, for K and V."""
    worst = 0.0
    for la, lb in zip(a.layers, b.layers, strict=True):
        for x, y in ((la.keys, lb.keys), (la.values, lb.values)):
            if x.shape != y.shape:
                return math.inf
            scale = float(y.abs().max())
            worst = max(worst, float((x - y).abs().max()) / scale if scale else float((x - y).abs().max()))
    return worst


def _recompute_identities(model: LoadedModel, exact: _Exact) -> list[Line]:
    """Recompute at ratio 0 is rerotate bit for bit (every policy); at ratio 1 the joined prefill."""
    frags, rot = exact.frags, exact.rotated
    scope = f"2 x {frags[0].length} tokens"
    if rot is None:
        return [Line("recompute r=0", scope, None, 0, "elements", REFUSED, exact.refusal)]
    lines = []
    for policy in POLICIES:
        n = unequal_elements(merge(frags, "recompute", model, ratio=0.0, policy=policy), rot)
        lines.append(
            Line("recompute r=0", f"{policy}, {scope}, against rerotate", n, 0, "elements", PASS if n == 0 else FAIL)
        )
    err = _rel_error(merge(frags, "recompute", model, ratio=1.0), exact.joined)
    lines.append(
        Line(
            "recompute r=1",
            f"{scope}, against the joined prefill",
            err,
            REL_KEY_NOISE,
            "relative K/V",
            PASS if err <= REL_KEY_NOISE else FAIL,
        )
    )
    return lines


def _refused(what: str, expected: type[Exception], call, scope: str = "", unchanged=None) -> Line:
    try:
        call()
    except expected as e:
        intact = unchanged() if unchanged else True
        status = PASS if intact else FAIL
        detail = str(e)[:160] + ("" if intact else " -- but the cache was modified")
        return Line(what, scope, type(e).__name__, expected.__name__, "raised", status, detail)
    except KvlabError as e:
        return Line(what, scope, type(e).__name__, expected.__name__, "raised", FAIL, str(e)[:160])
    return Line(what, scope, "accepted", expected.__name__, "raised", FAIL, "kvlab went ahead")


def _refusals(model: LoadedModel, ids: TokenSource) -> list[Line]:
    """What does not compose, or lies outside the model, is refused, and refusing changes nothing."""
    limit = position_limit(model)
    frag = prefill_tokens(model, ids(8))
    keys = [layer.keys.clone() for layer in frag.cache.layers]

    def intact() -> bool:
        return all(torch.equal(k, layer.keys) for k, layer in zip(keys, frag.cache.layers, strict=True))

    rope = layer_ropes(model.model)[0]
    dynamic = dataclasses.replace(rope, rope_type="dynamic")
    longrope = dataclasses.replace(rope, rope_type="longrope", original_max_position_embeddings=64)
    two = [frag, prefill_tokens(model, ids(8))]
    return [
        _refused(
            "refuse past limit",
            PositionError,
            lambda: shift_(frag.cache, limit, model),
            f"shift_ of 8 tokens to position {limit}",
            intact,
        ),
        _refused(
            "refuse before 0", MergeError, lambda: shift_(frag.cache, -1, model), "shift_ by -1 from position 0", intact
        ),
        _refused(
            "refuse dynamic NTK",
            UnsupportedRopeError,
            lambda: check_composable(dynamic, [(0, 8, 0), (0, 8, 8)]),
            "this model's frequencies, rope_type dynamic",
        ),
        _refused(
            "refuse longrope switch",
            UnsupportedRopeError,
            lambda: check_composable(longrope, [(0, 40, 0), (0, 40, 40)]),
            "this model's frequencies, a switch at 64 crossed",
        ),
        _refused("refuse by policy", MergeError, lambda: merge(two, "fail", model), "strategy fail, 2 fragments"),
    ]


def _file_round_trip(model: LoadedModel, exact: _Exact) -> list[Line]:
    """A merged cache saved and loaded is bit for bit the same; a reader with other weights is refused."""
    merged = exact.joined if exact.rotated is None else exact.rotated
    scope = f"{merged.get_seq_length()} tokens"
    with tempfile.TemporaryDirectory(prefix="kvlab-certify-") as tmp:
        path = save_cache(Path(tmp) / "merged.kvcache", merged, model)
        n = unequal_elements(load_cache(path, model).cache, merged)
        foreign = variants(model, "int8")
        try:
            load_cache(path, foreign)
        except FingerprintMismatch as e:
            fields = ", ".join(d.field for d in e.differences)
            refused = Line(
                "foreign reader",
                "int8 round trip of the same weights",
                fields,
                "refused",
                "fields",
                PASS if fields else FAIL,
            )
        else:
            refused = Line("foreign reader", "int8 round trip of the same weights", "loaded", "refused", "fields", FAIL)
        del foreign
    return [Line("file round trip", scope, n, 0, "elements", PASS if n == 0 else FAIL), refused]


def _floor(model: LoadedModel, case: Case) -> list[Line]:
    """KL of the model against itself: probes read packed or alone, on all threads or one."""
    cache = case.context
    probes = list(DEFAULT_PROBES)
    packed = [r.log_probs for r in read_probes(model, cache, probes)]
    alone = [read_probes(model, cache, [p])[0].log_probs for p in probes]
    batch = max(abs(kl_divergence(a, b)) for a, b in zip(packed, alone, strict=True))
    threads = torch.get_num_threads()
    other = 1 if threads > 1 else 2
    torch.set_num_threads(other)
    try:
        moved = [r.log_probs for r in read_probes(model, cache, probes)]
    finally:
        torch.set_num_threads(threads)
    thread = max(abs(kl_divergence(a, b)) for a, b in zip(packed, moved, strict=True))
    quant = (model.source or {}).get("quantization") or "none"
    scope = f"{len(probes)} probes behind {cache.get_seq_length()} tokens"
    lines = [
        Line(
            "floor: batch",
            f"packed vs alone, {scope}",
            batch,
            FLOOR_BOUND,
            "nats",
            PASS if batch <= FLOOR_BOUND else FAIL,
        ),
        Line(
            "floor: threads",
            f"{threads} vs {other} threads, {scope}",
            thread,
            FLOOR_BOUND,
            "nats",
            PASS if thread <= FLOOR_BOUND else FAIL,
        ),
    ]
    if quant != "none":
        lines.append(
            Line(
                "floor: quantised file",
                f"{quant} GGUF",
                None,
                None,
                "nats",
                NA,
                "kvlab computes with this file's weights dequantised to fp32, so that copy is the model certified here; "
                "llama.cpp's own reading of the quantised file is compared in `kvlab peers`",
            )
        )
    return lines


def _context(model: LoadedModel, case: Case) -> list[Line]:
    """What no rotation fixes: next-token KL of each merge against full recompute (information, no bound)."""
    lines = []
    scope = f"{len(case.fragments)} story fragments, {len(case.probes)} probes"
    for name, options in (("naive", {}), ("rerotate", {}), ("recompute", {"ratio": INFO_RATIO})):
        label = f"{name} r={INFO_RATIO}" if options else name
        try:
            cache = merge(case.fragments, name, model, **options)
        except KvlabError as e:
            lines.append(Line("context error", f"{label}, {scope}", None, None, "nats", INFO, f"refused: {e}"[:160]))
            continue
        rows = next_token_kl(model, cache, case.context, case.probes, case.context_dists)
        kl = sum(r["kl"] for r in rows) / len(rows)
        agree = sum(r["agree"] for r in rows)
        lines.append(
            Line(
                "context error", f"{label}, {scope}", kl, None, "nats (mean)", INFO, f"top-1 agrees {agree}/{len(rows)}"
            )
        )
    return lines
