"""The audit of a store's compaction (``--compact``) and press (``--press``): tokens kept, their phase, the next position.

* compaction: ``fn(cache, keep[, model])``: ``cache`` a ``DynamicCache`` prefilled from 0 with
  ``n`` tokens; ``keep`` one ``[batch, kv_heads, k]`` LongTensor of ascending positions per layer,
  other tokens per head. Returns a cache whose layer ``l``, head ``h``, slot ``j`` holds token
  ``keep[l][b, h, j]``.
* press: ``fn(model, input_ids)``: ``input_ids`` ``[1, n]``. Returns the cache the store keeps
  after prefilling and compressing; the audit finds each slot's token from the values, which carry
  no phase (:func:`identify`).

The store declares where the kept keys sit (``positions``, :mod:`kvlab.cache.compact`): ``kept``
(re-rotated to the kept slots, next token at ``K``) or ``original`` (their own phase, next token at
``n``). Lines:

* ``kept tokens``: every slot holds a token of the input, per head, none twice, ascending for
  ``kept``, and (a compaction) the one ``keep`` asks for;
* ``phase``, per layer kind: against the float64 model, each kept token's exact key turned to its
  declared position (angle, pair norm, non-rotary dims); where the keys follow the other
  convention, the line says so;
* ``values``; ``length``: what transformers reads, and the next-token distribution of 4 tokens read
  with positions taken from the cache (as ``generate`` takes them) against the same tensors at the
  declared next position;
* ``by reference``, ``sliding window`` (a sliding layer keeps no more than its window, now and after
  more tokens), ``dtype and device``; ``keep all`` (a compaction): keeping every token gives the
  input back;
* ``refusal``: ``kept`` on dynamic NTK (or any schedule kvlab refuses to turn) must raise;
* ``context error`` (information): the answer-span KL against the full cache, with kvlab's own
  compaction of the same tokens beside it.
"""

from __future__ import annotations

import copy
import math

import torch
from transformers import DynamicCache

from kvlab.cache.compact import KEPT, ORIGINAL, rebuild
from kvlab.cache.fragments import prefill_ids
from kvlab.compat import forward, layer_ready
from kvlab.measure.audit.compact_context import context_line
from kvlab.measure.audit.compact_reading import Reading, declared_at, identify, kept_tokens_line, prefix_kept
from kvlab.measure.audit.compact_source import (
    CACHE,
    EXPLICIT,
    PROBE_TOKENS,
    RATIOS,
    TOKENS,
    Run,
    Source,
    draw_keep,
    exact_reference,
    keep_all,
    make_source,
    result_view,
)
from kvlab.measure.audit.compare import (
    changes,
    key_error_by_kind,
    next_log_probs,
    other_slot,
    rel_diff,
    shared_storage,
    structure_problems,
)
from kvlab.measure.audit.lines import (
    REFUSAL_WHY,
    Unfit,
    dtype_line,
    guarded,
    kvlab_refusal,
    need,
    refusal_line,
    refusal_model,
    refused_detail,
)
from kvlab.measure.audit.target import COMPACT, Target, TargetRaised
from kvlab.measure.certificate import FAIL, NA, PASS, REFUSED, Line
from kvlab.measure.certify import FLOOR_BOUND
from kvlab.measure.metrics import REL_KEY_NOISE, kl_divergence
from kvlab.measure.sliding import sliding_window
from kvlab.measure.tokens import TokenSource
from kvlab.measure.twin import exact_twin
from kvlab.models.layout import layer_ropes
from kvlab.models.loaded import LoadedModel


def audit_compact(
    model: LoadedModel, target: Target, *, positions: str, reader: str = CACHE, tokens: int = TOKENS, seed: int = 0
) -> list[Line]:
    """Every line of a compaction or press audit on ``model`` (see the module docstring).

    Parameters
    ----------
    target : Target
        A compaction (``kind`` ``compact``) or a press (``press``).
    positions : {"kept", "original"}
        The convention the store declares.
    reader : {"cache", "explicit"}
        How the store's reader places the next token: ``cache``, from the cache's
        ``get_seq_length()`` (as ``generate`` does); ``explicit``, by passing ``position_ids`` at the
        declared next position itself (as kvpress's pipeline does).

    Raises
    ------
    AuditTargetError
        The target returned something other than a ``DynamicCache``.
    """
    window = sliding_window(model)
    n = max(tokens, window + 8) if window else tokens
    ids = TokenSource(model, seed)(n)
    twin = exact_twin(model)
    try:
        source = make_source(model, twin, ids)
    finally:
        del twin
    press = target.kind != COMPACT
    runs: list[tuple[Run, Reading]] = []
    lines, refusal = _phase(model, target, source, positions, seed, runs)
    lines = kept_tokens_line(runs, positions, press, refusal) + lines
    lines += guarded(
        "values",
        "the slot without phase",
        REL_KEY_NOISE,
        "relative",
        lambda: _values(model, need(runs, refusal), positions),
    )
    probe = TokenSource(model, seed + 1)(PROBE_TOKENS)
    lines += guarded(
        "length", "get_seq_length and a forward pass", FLOOR_BOUND, "nats",
        lambda: _length(model, need(runs, refusal), positions, probe, reader),
    )  # fmt: skip
    lines += guarded(
        "by reference", "the input of a compaction" if not press else "the model and input ids of a press", 0,
        "problems", lambda: _by_reference(model, target, source, positions, probe, seed), refusal,
    )  # fmt: skip
    lines += guarded(
        "sliding window", "past the window", 0, "layers wrong", lambda: _sliding(model, need(runs, refusal), window)
    )
    lines += guarded(
        "dtype and device", "every tensor of the result", 0, "tensors",
        lambda: dtype_line([(r.label, r.result) for r, _ in need(runs, refusal)], source.cache.layers[0].keys),
    )  # fmt: skip
    if press:
        lines.append(Line("keep all", "a press chooses what it keeps", None, None, "", NA))
    else:
        lines += guarded(
            "keep all", f"{n} tokens, every one kept", 0 if positions == ORIGINAL else REL_KEY_NOISE, "relative",
            lambda: _keep_all(model, target, source, positions), refusal,
        )  # fmt: skip
    lines += _refusal(target, positions, seed)
    lines += context_line(model, target, positions, reader, refusal)
    return lines


def _phase(model, target, source: Source, positions: str, seed: int, runs: list) -> tuple[list[Line], str | None]:
    """The phase slot of every kept token against its exact key at the declared position, per layer kind (fills ``runs``)."""
    n = source.n
    press = target.kind != COMPACT
    scope = f"{n} tokens" + ("" if press else f", keeping {' and '.join(f'{r:g}' for r in RATIOS)} of each layer's")
    worst: dict[str, tuple[float, str, str]] = {}
    other: dict[str, float] = {}
    refused = []
    asks = (
        [(None, "a press")]
        if press
        else [(draw_keep(source.cache, r, seed + i), f"keep {r:g}") for i, r in enumerate(RATIOS)]
    )
    try:
        for keep, label in asks:
            total = n if positions == ORIGINAL or keep is None else max(k.shape[-1] for k in keep)
            refusal = kvlab_refusal(model, [(0, n, total - n)]) if positions == KEPT else None
            try:
                run = Run(target, model, source, keep, f"{label} of {n} tokens")
            except TargetRaised as e:
                if refusal is None:
                    raise
                refused.append((label, e.failure, refusal))
                continue
            reading = identify(model, run.result, source, keep, positions)
            tokens, new, total = declared_at(run, reading, positions)
            if positions == KEPT and (why := kvlab_refusal(model, [(0, n, total - n)])):
                raise Unfit(f"re-rotated {n} tokens to {total}, a rotation that does not compose: {why[:200]}")
            runs.append((run, reading))
            if reading.unread and keep is None:
                raise Unfit(f"{reading.unread} slots hold no input token (the kept tokens line says which)")
            ref, where = exact_reference(model, source, tokens, new, total)
            errors = key_error_by_kind(result_view(run.result), ref, model, source.floor, positions=where)
            if any(value > 1 for value, _ in errors.values()):
                # Only a failing line is worded by the other convention: its reference is built then.
                flip = ORIGINAL if positions == KEPT else KEPT
                _, new2, total2 = declared_at(run, reading, flip)
                ref2, where2 = exact_reference(model, source, tokens, new2, total2)
                for kind, (value, _) in key_error_by_kind(
                    result_view(run.result), ref2, model, source.floor, positions=where2
                ).items():
                    other[kind] = max(other.get(kind, 0.0), value)
            else:
                for kind in errors:
                    other[kind] = max(other.get(kind, 0.0), math.inf)
            for kind, (value, part) in errors.items():
                if kind not in worst or value > worst[kind][0]:
                    worst[kind] = (value, part, label)
    except TargetRaised as e:
        return [Line("phase", scope, None, 1.0, "x rounding", FAIL, f"raised {e.failure}")], None
    except Unfit as e:
        return [Line("phase", scope, None, 1.0, "x rounding", FAIL, str(e))], None
    if not runs:
        _, failure, refusal = refused[0]
        return [Line("phase", scope, None, 1.0, "x rounding", REFUSED, refused_detail(failure, refusal))], refusal
    flip = ORIGINAL if positions == KEPT else KEPT
    follows = {
        KEPT: "the keys were re-rotated to the kept slots: they follow positions=kept",
        ORIGINAL: "the keys keep the phase they were computed at: they follow positions=original",
    }[flip]
    out = []
    for kind, (value, part, label) in sorted(worst.items()):
        ok = value <= 1
        what = "within rounding" if ok else f"{part} wrong"
        if not ok and other.get(kind, math.inf) <= 1:
            what += f"; {follows}, not positions={positions}"
        out.append(
            Line(
                "phase",
                f"{kind} layers, {scope}",
                value,
                1.0,
                "x rounding",
                PASS if ok else FAIL,
                f"{what} (worst: {part}, {label}); each kept token's key from the float64 model turned to its "
                f"declared position (positions={positions}); the input's own fp32 noise {source.floor:.2g}",
            )  # fmt: skip
        )
    return out, None


def _values(model: LoadedModel, runs: list, positions: str) -> list[Line]:
    """The slot without phase is the kept token's own, from the input."""
    ropes = layer_ropes(model.model)
    worst, where = 0.0, ""
    for run, reading in runs:
        tokens = run.keep if run.keep is not None else reading.tokens
        for li, (rope, layer, k, held) in enumerate(zip(ropes, run.source.cache.layers, tokens, run.source.held)):
            slot = other_slot(rope.slot)
            t = getattr(layer, slot)
            want = t.gather(2, (k - int(held[0])).clamp_min(0).to(t.device)[..., None].expand(-1, -1, -1, t.shape[-1]))
            d = rel_diff(getattr(run.result.layers[li], slot), want)
            if d > worst:
                worst, where = d, f"layer {li} {slot}, {run.label}"
    detail = "bit for bit" if worst == 0 else f"max relative difference at {where}"
    slots = sorted({other_slot(r.slot) for r in ropes})
    scope = f"{'/'.join(slots)} against the kept tokens' own"
    return [Line("values", scope, worst, REL_KEY_NOISE, "relative", PASS if worst <= REL_KEY_NOISE else FAIL, detail)]


def _length(model: LoadedModel, runs: list, positions: str, probe: torch.Tensor, reader: str = CACHE) -> list[Line]:
    """The next token reads as the same tensors read at the declared next position.

    ``reader="cache"``: ``get_seq_length()`` must be that position, since the reader takes it from
    there. ``"explicit"``: the store's reader passes the positions, so the read does too, and what
    ``get_seq_length()`` says is only worded in the detail (a ``generate`` on top would read there).
    """
    run, reading = runs[0]
    n = run.source.n
    _, _, total = declared_at(run, reading, positions)
    result = run.result
    kept = max(layer.keys.shape[-2] for layer in result.layers)
    how = "positions passed by the reader" if reader == EXPLICIT else "positions from the cache"
    scope = f"{run.label}, next token at {total} (positions={positions}, {how}), {PROBE_TOKENS} tokens on top"
    problems, notes = [], []
    seen = result.get_seq_length()
    if seen != total:
        gap = f"; the gap n - kept is {n - kept}" if positions == ORIGINAL and seen == kept else ""
        said = f"get_seq_length() is {seen}, not {total}"
        if reader == EXPLICIT:
            notes.append(f"{said}: a reader taking positions from the cache (generate) would land at {seen}{gap}")
        else:
            problems.append(f"{said}: the next token lands at {seen}{gap}")
    wrong = [
        li for li, layer in enumerate(result.layers) if layer.get_seq_length() != (total if reader == CACHE else seen)
    ]
    if wrong and (seen == total or reader == EXPLICIT):
        problems.append(f"layers {wrong} report {sorted({result.layers[li].get_seq_length() for li in wrong})} tokens")
    uninit = [li for li, layer in enumerate(result.layers) if not layer_ready(layer)]
    if uninit:
        problems.append(f"layers {uninit} never initialized (tensors assigned without update: read as empty)")
    right = next_log_probs(model, rebuild(result, model.config, total), probe)
    got = next_log_probs(model, copy.deepcopy(result), probe, start=total if reader == EXPLICIT else None)
    kl = kl_divergence(right, got)
    if kl > FLOOR_BOUND:
        problems.append(f"the next token reads {kl:.3g} nats away from the same tensors read at position {total}")
    detail = "; ".join(problems + notes) if problems else "; ".join([f"continues at position {total}"] + notes)
    return [Line("length", scope, kl, FLOOR_BOUND, "nats", FAIL if problems else PASS, detail)]


def _by_reference(model, target: Target, source: Source, positions: str, probe, seed: int) -> list[Line]:
    """A compaction leaves its input as it was and shares no memory with it; a press leaves the model and ids as they were."""
    problems = []
    if target.kind == COMPACT:
        run = Run(target, model, source, draw_keep(source.cache, RATIOS[0], seed), "by reference")
        problems += [
            f"by the compaction: input {c.removeprefix('fragment 0 ')}" for c in changes([run.input], run.before)
        ][:2]
        problems += [f"the result {s.removeprefix('layer ')}" for s in shared_storage(run.result, [run.input])][:2]
        if run.result is run.input:
            problems.append("the result is the input cache itself")
        if not problems:
            try:
                next_log_probs(model, run.result, probe)
            except (RuntimeError, ValueError, IndexError, TypeError):
                pass  # a broken result is the length line's; only the compaction is checked here
            problems += [f"by a forward pass through the result: input {c}" for c in changes([run.input], run.before)][
                :2
            ]
        scope = f"keep {RATIOS[0]:g}, {PROBE_TOKENS} tokens read through the result"
    else:
        hooks = _hooks(model.model)
        before = next_log_probs(model, DynamicCache(config=model.config), probe)
        run = Run(target, model, source, None, "by reference")
        if not torch.equal(run.input_ids, source.ids[None]):
            problems.append("the press changed its input_ids")
        if _hooks(model.model) != hooks:
            problems.append(f"the press left hooks on the model ({hooks} before, {_hooks(model.model)} after)")
        after = next_log_probs(model, DynamicCache(config=model.config), probe)
        if not torch.equal(before, after):
            problems.append(f"the model reads {kl_divergence(before, after):.3g} nats otherwise after the press")
        scope = f"hooks, input_ids and a {PROBE_TOKENS}-token read of the model, before and after"
    detail = "; ".join(problems) or "inputs intact"
    return [Line("by reference", scope, len(problems), 0, "problems", FAIL if problems else PASS, detail)]


def _hooks(module: torch.nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in module.modules())


def _sliding(model: LoadedModel, runs: list, window: int | None) -> list[Line]:
    """A sliding layer keeps no more than ``window - 1`` tokens, and still none more after ``window`` more tokens."""
    if window is None:
        return [Line("sliding window", "no sliding layers", None, None, "", NA)]
    run, _ = runs[0]
    types = [r.layer_type for r in layer_ropes(model.model)]
    sliding = [li for li, t in enumerate(types) if t == "sliding_attention"]
    wrong = {li for li in sliding if run.result.layers[li].keys.shape[-2] > window - 1}
    grown = copy.deepcopy(run.result)
    more = TokenSource(model, 99)(window)
    forward(model.model, grown, input_ids=more[None].to(model.device), use_cache=True, logits_to_keep=1)
    wrong |= {li for li in sliding if grown.layers[li].keys.shape[-2] > window - 1}
    detail = (
        f"layers {sorted(wrong)} hold more than {window - 1} tokens (now or after {window} more)"
        if wrong
        else (
            f"sliding layers hold {sorted({run.result.layers[li].keys.shape[-2] for li in sliding})} tokens, "
            f"{window - 1} at most after {window} more"
        )
    )
    scope = f"{len(sliding)} sliding layers, a window of {window}"
    return [Line("sliding window", scope, len(wrong), 0, "layers wrong", FAIL if wrong else PASS, detail)]


def _keep_all(model: LoadedModel, target: Target, source: Source, positions: str) -> list[Line]:
    """Keeping every token gives the input back: bit for bit for ``original``, within rounding for ``kept``."""
    run = Run(target, model, source, keep_all(source.cache), "keep all")
    problems = structure_problems(run.result, source.cache)
    if problems:
        raise Unfit("; ".join(problems[:4]))
    worst = max(
        rel_diff(getattr(a, s), getattr(b, s))
        for a, b in zip(run.result.layers, source.cache.layers, strict=True)
        for s in ("keys", "values")
    )
    bound = 0 if positions == ORIGINAL else REL_KEY_NOISE
    out = []
    if worst > bound:
        out.append(f"K/V differ from the input by {worst:.3g} relative")
    if run.result.get_seq_length() != source.n:
        out.append(f"get_seq_length() is {run.result.get_seq_length()}, not {source.n}")
    detail = "; ".join(out) or ("bit for bit" if worst == 0 else "to rounding")
    return [
        Line("keep all", f"{source.n} tokens, every one kept", worst, bound, "relative", FAIL if out else PASS, detail)
    ]


def _refusal(target: Target, positions: str, seed: int) -> list[Line]:
    """``kept`` on a model whose rotations do not compose is refused, not turned."""
    dyn = refusal_model()
    scope = f"{TOKENS} tokens of {dyn.name} (dynamic NTK)"
    if positions == ORIGINAL:
        return [Line("refusal", scope, None, None, "", NA, "positions=original turns no key: nothing to refuse")]
    ids = TokenSource(dyn, seed)(TOKENS)
    if target.kind == COMPACT:
        cache = prefill_ids(dyn, ids)
        keep = draw_keep(cache, RATIOS[0], seed)
        attempt = lambda: target.call(cache, keep, dyn.model)  # noqa: E731
    else:
        got = []
        attempt = lambda: got.append(target.call(dyn.model, ids[None].clone())) or got[-1]  # noqa: E731
    line = refusal_line(
        scope, attempt, "re-rotated", "it re-rotated them: " + REFUSAL_WHY + "; a compaction must refuse it"
    )
    if target.kind != COMPACT and got and prefix_kept(dyn, got[0], ids):
        why = "the press kept a prefix at its own positions (slot j holds token j, as crop does): no key turned"
        return [Line("refusal", scope, None, None, "", NA, why + ", nothing to refuse")]
    return line
