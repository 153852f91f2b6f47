"""The audit of a merge that runs inside llama.cpp: its cache reuse, or a store's function that drives it.

kvlab cannot read llama.cpp's KV cache as tensors, so every line here reads logits: the
next-token distribution after a probe, behind the merged sequence, against the same probe
behind a reference built in the same engine. The target is ``fn(engine, fragments)`` (see
:mod:`kvlab.measure.audit.target`); :func:`llama_cpp_cache_reuse` is llama.cpp's own move
(``--cache-reuse``: ``llama_memory_seq_add`` then ``llama_memory_seq_cp``). Lines:

* ``phase``, per fragment set: the merge against the *phase reference*, each fragment decoded
  alone at its landing positions (the same missing context, no rotation), on an F32 copy of the
  weights with an f32 cache and no flash attention, so a right K-shift leaves only float32
  rounding. Bound: :data:`FLOOR_BOUND`, or llama.cpp's own distance from exact arithmetic on
  the same reads where that is larger (:func:`exact_reads`: the phase reference computed by the
  float64 twin of the same weights). Figures in docs/audit.md.
* ``length``: sequence 0 holds positions ``0 .. total-1``.
* ``by reference``: a fragment's sequence the merge leaves behind still holds that fragment at
  ``0 .. L-1``, reading as it did (llama.cpp's cells are shared between sequences, so shifting one
  a store keeps moves its copy too).
* ``one fragment``: reads as that fragment's prefill; ``empty list``: refused.
* ``refusal``: where llama.cpp cannot shift the cache (the server's window-only layout of a
  sliding-window model), the merge must raise, not merge.
* ``context error`` (information): at the engine's defaults on the model's own file, the merge
  against llama.cpp's joined prefill, and against the phase reference.
"""

from __future__ import annotations

import copy
import time

import torch

from kvlab.cache.fragments import prefill_tokens
from kvlab.cache.strategies import concat_layers
from kvlab.errors import AuditTargetError, PeerError
from kvlab.files.identity import fingerprint, package_versions
from kvlab.measure.audit.compare import next_log_probs
from kvlab.measure.audit.lines import guarded, refusal_line
from kvlab.measure.audit.target import ENGINE, Target, TargetRaised, resolve
from kvlab.measure.certificate import FAIL, INFO, PASS, Certificate, Line
from kvlab.measure.certify import FLOOR_BOUND
from kvlab.measure.metrics import kl_divergence
from kvlab.measure.tokens import TokenSource
from kvlab.measure.twin import exact_twin
from kvlab.models.loaded import LoadedModel
from kvlab.peers.engine import LlamaEngine
from kvlab.peers.kshift import CacheLayout, refusal_layouts
from kvlab.peers.mapping import engine_for, model_gguf
from kvlab.peers.quantize import requantize

#: Fragment sizes of the phase line: three short ones, and two whose second lands far out.
FRAGMENT_SETS = ((40, 56, 24), (448, 64))

#: Probes read behind every cache, and their length in tokens.
PROBES, PROBE_TOKENS = 4, 8

#: Context of the refusal line's engines: long enough that a window-only cache is smaller than a full one.
REFUSAL_CONTEXT = 4096

#: The exact engine: no flash attention, whose CPU kernel rounds an f32 cache to f16.
EXACT = {"kv_type": "f32", "flash_attn": False}


def llama_cpp_cache_reuse(engine: LlamaEngine, fragments: list) -> None:
    """llama.cpp's own merge (``--cache-reuse``): :meth:`~kvlab.peers.engine.LlamaEngine.shift_merge`."""
    engine.shift_merge(fragments)


def _line(check: str, scope: str, value, bound, unit: str, ok: bool, detail: str) -> list[Line]:
    return [Line(check, scope, value, bound, unit, PASS if ok else FAIL, detail)]


def _reads(engine: LlamaEngine, probes: list[torch.Tensor], seq: int = 0) -> list[torch.Tensor]:
    return [engine.read(p, seq) for p in probes]


def _worst(refs: list[torch.Tensor], got: list[torch.Tensor]) -> float:
    return max(kl_divergence(a, b) for a, b in zip(refs, got, strict=True))


def _merge(engine: LlamaEngine, target: Target, ids: list[torch.Tensor]) -> None:
    """A cleared engine, then the target's merge of fresh copies of ``ids`` (it may keep or change them)."""
    engine.clear()
    target.call(engine, [t.clone() for t in ids])


def _phase_reference(engine: LlamaEngine, ids: list[torch.Tensor], probes: list[torch.Tensor]) -> list[torch.Tensor]:
    engine.phase_merge(ids)
    return _reads(engine, probes)


@torch.inference_mode()
def exact_reads(twin: LoadedModel, ids: list[torch.Tensor], probes: list[torch.Tensor]) -> list[torch.Tensor]:
    """The phase reference in exact arithmetic: each fragment prefilled alone at its landing positions by
    :func:`~kvlab.measure.twin.exact_twin`, concatenated, and each probe read on top.

    Returns
    -------
    list of torch.Tensor
        ``[vocab]`` float64 next-token log-probs per probe.
    """
    landings = [sum(len(t) for t in ids[:i]) for i in range(len(ids))]
    frags = [prefill_tokens(twin, t, land) for t, land in zip(ids, landings)]
    cache = concat_layers(frags, landings)
    return [next_log_probs(twin, copy.deepcopy(cache), p) for p in probes]


def _phase(engine: LlamaEngine, target: Target, ids, probes, twin: LoadedModel) -> list[Line]:
    sizes = [len(t) for t in ids]
    scope = f"{' + '.join(map(str, sizes))} tokens"

    def measure() -> list[Line]:
        refs = _phase_reference(engine, ids, probes)
        # llama.cpp's own arithmetic is further from exact on some models (Gemma 3: about 2e-6 nats)
        # than kvlab's floor; a shift's error inside that is the engine's rounding, not the shift's.
        own = _worst(exact_reads(twin, ids, probes), refs)
        bound = max(FLOOR_BOUND, own)
        _merge(engine, target, ids)
        held = engine.pos_max(0) + 1
        if held <= 0:
            return _line("phase", scope, None, bound, "nats", False, "sequence 0 is empty after the merge")
        worst = _worst(refs, _reads(engine, probes))
        detail = (
            f"worst of {len(probes)} probes against each fragment decoded at its landing positions (F32 weights, "
            f"f32 cache); bound: {FLOOR_BOUND:g} or llama.cpp's own distance from exact arithmetic there ({own:.2g})"
        )
        if held != sum(sizes):
            detail += f"; sequence 0 holds {held} tokens, not {sum(sizes)} (the length line)"
        return _line("phase", scope, worst, bound, "nats", worst <= bound, detail)

    return guarded("phase", scope, FLOOR_BOUND, "nats", measure)


def _length_and_reference(engine: LlamaEngine, target: Target, ids, probes) -> list[Line]:
    sizes = [len(t) for t in ids]
    total = sum(sizes)
    scope, later, single = (
        f"{len(ids)} fragments, {total} tokens",
        f"{len(ids) - 1} later fragments",
        f"1 x {sizes[0]} tokens",
    )
    alone = []
    for t in ids:
        engine.clear()
        engine.prefill(t)
        alone.append(_reads(engine, probes))

    def length() -> list[Line]:
        _merge(engine, target, ids)
        lo, hi = engine.pos_min(0), engine.pos_max(0)
        ok = (lo, hi) == (0, total - 1)
        detail = f"sequence 0 holds positions {lo}..{hi}" + ("" if ok else f", not 0..{total - 1}")
        return _line("length", scope, hi + 1, total, "tokens", ok, detail)

    def by_reference() -> list[Line]:
        _merge(engine, target, ids)
        kept, problems, worst = 0, [], 0.0
        for i, t in enumerate(ids[1:], start=1):
            lo, hi = engine.pos_min(i), engine.pos_max(i)
            if hi < 0:
                continue
            kept += 1
            if (lo, hi) != (0, len(t) - 1):
                problems.append(f"sequence {i} (fragment {i}) now holds positions {lo}..{hi}, not 0..{len(t) - 1}")
                continue
            kl = _worst(alone[i], _reads(engine, probes, i))
            worst = max(worst, kl)
            if kl > FLOOR_BOUND:
                problems.append(f"fragment {i}'s sequence reads {kl:.3g} nats from its own prefill")
        detail = "; ".join(problems) or (
            f"{kept} fragment sequences kept, each as it was" if kept else "no fragment sequence left sharing cells"
        )
        return _line("by reference", later, worst, FLOOR_BOUND, "nats", not problems, detail)

    def one() -> list[Line]:
        _merge(engine, target, ids[:1])
        kl = _worst(alone[0], _reads(engine, probes))
        return _line("one fragment", single, kl, FLOOR_BOUND, "nats", kl <= FLOOR_BOUND, "against its own prefill")

    return (
        guarded("length", scope, total, "tokens", length)
        + guarded("by reference", later, FLOOR_BOUND, "nats", by_reference)
        + guarded("one fragment", single, FLOOR_BOUND, "nats", one)
        + _empty(engine, target)
    )


def _empty(engine: LlamaEngine, target: Target) -> list[Line]:
    engine.clear()
    try:
        target.call(engine, [])
    except TargetRaised as e:
        return [Line("empty list", "no fragments", type(e.error).__name__, "raised", "", PASS, e.failure)]
    held = engine.pos_max(0) + 1
    return _line(
        "empty list", "no fragments", "returned", "raised", "", False, f"returned; sequence 0 holds {held} tokens"
    )


def _refusals(model: LoadedModel, target: Target, ids: list[torch.Tensor]) -> list[Line]:
    layouts = [x for x in refusal_layouts(model, ()) if not x.swa_full]
    if not layouts:
        why = "llama.cpp can shift every cache layout of this model"
        return [Line("refusal", "every layout", None, None, "", INFO, why)]
    out = []
    for layout in layouts:
        # A window-only cache is as large as the full one (so it can shift) while the context fits
        # a few windows; the server's contexts are far longer.
        with engine_for(model, n_ctx=REFUSAL_CONTEXT, n_seq_max=len(ids), **_options(layout)) as eng:
            scope = f"{layout.label}, n_ctx {eng.n_ctx}"
            if eng.can_shift():
                out.append(Line("refusal", scope, None, None, "", INFO, "llama.cpp can shift this cache here"))
                continue
            out += refusal_line(
                scope,
                lambda eng=eng: _merge(eng, target, ids),
                "merged",
                "llama.cpp cannot shift this cache (llama_memory_can_shift is false); a merge must refuse it",
            )
    return out


def _options(layout: CacheLayout) -> dict:
    return {k: getattr(layout, k) for k in ("type_k", "type_v", "flash_attn", "swa_full")}


def _context(model: LoadedModel, target: Target, ids, probes, n_ctx: int) -> list[Line]:
    scope = f"{' + '.join(str(len(t)) for t in ids)} tokens, the model's own file, engine defaults"

    def measure() -> list[Line]:
        with engine_for(model, n_ctx=n_ctx, n_seq_max=len(ids)) as eng:
            eng.prefill(torch.cat(ids))
            joined = _reads(eng, probes)
            phase = _phase_reference(eng, ids, probes)
            _merge(eng, target, ids)
            got = _reads(eng, probes)
        kl = sum(kl_divergence(a, b) for a, b in zip(joined, got)) / len(probes)
        beside = sum(kl_divergence(a, b) for a, b in zip(phase, got)) / len(probes)
        detail = f"mean of {len(probes)} probes; against the phase reference {beside:.3g}"
        return [Line("context error", scope, kl, None, "nats", INFO, detail)]

    lines = guarded("context error", scope, None, "nats", measure)
    return [Line(x.check, x.scope, x.value, x.bound, x.unit, INFO, x.detail) for x in lines]


def versions_line() -> Line:
    """The versions the audit ran under, llama-cpp-python's among them."""
    v = package_versions("kvlab", "torch", "transformers", "llama_cpp_python")
    said = ", ".join(f"{k} {x}" for k, x in v.items())
    return Line("versions", "kvlab, torch, transformers, llama-cpp-python", said.split(", ")[-1], None, "", INFO, said)


def audit_engine(
    model: LoadedModel, merge=llama_cpp_cache_reuse, *, fragment_sets=FRAGMENT_SETS, seed: int = 0
) -> Certificate:
    """Audit a merge that runs inside llama.cpp on ``model``'s GGUF file.

    Parameters
    ----------
    model : LoadedModel
        A model with a GGUF file (:func:`kvlab.peers.mapping.model_gguf`).
    merge : callable or str
        ``fn(engine, fragments)`` or ``MODULE:NAME``; default llama.cpp's own cache reuse.
    fragment_sets : tuple of tuple of int
        Fragment sizes of each phase line; the first set also serves every other line.
    seed : int
        Seed of the random token ids of fragments and probes.

    Returns
    -------
    Certificate
        The same lines, bounds and JSON as ``kvlab certify``; ``target`` names the merge.

    Raises
    ------
    AuditTargetError
        A target that cannot be imported or takes other arguments.
    PeerError
        llama.cpp is not installed, or the model has no GGUF file.
    """
    target = resolve(ENGINE, merge)
    if not isinstance(target, Target):
        raise AuditTargetError(f"{target.name} is not an engine merge function")
    t0 = time.perf_counter()
    ids_of = TokenSource(model, seed)
    probes = [ids_of(PROBE_TOKENS) for _ in range(PROBES)]
    sets = [[ids_of(n) for n in sizes] for sizes in fragment_sets]
    n_ctx = 2 * (max(sum(map(len, s)) for s in sets) + PROBE_TOKENS)
    n_seq = max(map(len, sets))
    exact_file = requantize(model_gguf(model), "F32")
    lines = [versions_line()]
    with LlamaEngine(exact_file, n_ctx=n_ctx, n_seq_max=n_seq, **EXACT) as eng:
        if not eng.can_shift():
            raise PeerError(f"llama.cpp cannot shift an f32 cache of {model.name}; nothing to audit against")
        twin = exact_twin(model)
        for ids in sets:
            lines += _phase(eng, target, ids, probes, twin)
        del twin
        lines += _length_and_reference(eng, target, sets[0], probes)
    lines += _refusals(model, target, sets[0])
    lines += _context(model, target, sets[0], probes, n_ctx)
    return Certificate(model.name, lines, fingerprint(model), time.perf_counter() - t0, target=target.name)
