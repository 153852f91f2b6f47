"""The audit of a store's shift function: a cached fragment moved to new positions, line by line.

``fn(cache, delta[, model])`` (see :mod:`kvlab.measure.audit.target`) turns a cache prefilled from
position 0 so that its keys carry positions ``delta ..``: in place (returning ``None`` or the cache)
or into a new cache it returns. Lines:

* ``phase``, per layer kind: the phase slot against the float64 model's keys prefilled at
  ``delta`` (:func:`kvlab.measure.audit.compare.key_error_by_kind`), at 1, 37 and the farthest
  shift the model's positions allow;
* ``values``: the other slot untouched; ``length``: every layer's length and kept tokens unchanged;
* ``by reference``: a new cache leaves its input as it was and shares no memory with it (turning
  in place is allowed);
* ``zero shift``: ``delta = 0`` changes nothing; ``dtype and device`` kept;
* ``refusal``: a cache of a model whose rotations do not compose (dynamic NTK) is refused.
"""

from __future__ import annotations

from kvlab.cache.fragments import Fragment, prefill_ids
from kvlab.compat import layer_ready
from kvlab.measure.audit.compare import (
    changes,
    key_error_by_kind,
    other_slot,
    own_noise,
    rel_diff,
    shared_storage,
    snapshot,
    structure_problems,
    tails,
)
from kvlab.measure.audit.lines import (
    REFUSAL_WHY,
    Unfit,
    caches,
    dtype_line,
    guarded,
    kvlab_refusal,
    model_refusal,
    need,
    refusal_line,
    refusal_model,
    refused_detail,
)
from kvlab.measure.audit.target import Target, TargetRaised, expect_cache
from kvlab.measure.certificate import FAIL, PASS, REFUSED, Line
from kvlab.measure.metrics import REL_KEY_NOISE
from kvlab.measure.sliding import sliding_window
from kvlab.measure.tokens import TokenSource, position_limit, random_fragments
from kvlab.measure.twin import exact_twin
from kvlab.models.layout import layer_ropes
from kvlab.models.loaded import LoadedModel

#: Tokens of the shifted fragment (at least the sliding window and 8 more, where there is one).
TOKENS = 48


class ShiftRun:
    """One shift of a fresh copy of ``frag`` by the target; ``result`` is the turned cache (the input if in place)."""

    def __init__(self, target: Target, model: LoadedModel, frag: Fragment, delta: int):
        self.frag, self.delta = frag, delta
        (self.input,) = caches([frag])
        self.before = snapshot([self.input])
        got = target.call(self.input, delta, model.model)
        self.in_place = got is None or got is self.input
        self.result = self.input if got is None else expect_cache(got, target.name, f"a shift by {delta}")


def deltas(model: LoadedModel, n: int) -> list[int]:
    """1, 37 and the farthest shift of ``n`` tokens the model's positions allow."""
    return sorted({1, 37, position_limit(model) - n} - {0})


def audit_shift(model: LoadedModel, target: Target, *, tokens: int = TOKENS, seed: int = 0) -> list[Line]:
    """Every line of a shift audit on ``model`` (see the module docstring).

    Raises
    ------
    AuditTargetError
        The target returned something other than ``None`` or a ``DynamicCache``.
    """
    ids = TokenSource(model, seed)
    window = sliding_window(model)
    n = max(tokens, window + 8) if window else tokens
    (frag,) = random_fragments(model, ids, [n])
    refusal = model_refusal(model)
    runs: list[ShiftRun] = []
    lines, none = _phase(model, target, frag, runs)
    lines += guarded(
        "values", "the slot without phase", REL_KEY_NOISE, "relative", lambda: _values(model, need(runs, none))
    )
    lines += guarded("length", "every layer", 0, "layers wrong", lambda: _length(need(runs, none)))
    lines += guarded("by reference", "the input of a shift", 0, "problems", lambda: _by_reference(need(runs, none)))
    lines += guarded("zero shift", f"{n} tokens by 0", 0, "elements", lambda: _zero(model, target, frag), refusal)
    lines += guarded(
        "dtype and device", "every tensor of the result", 0, "tensors",
        lambda: dtype_line([(f"shift {r.delta}", r.result) for r in need(runs, none)], frag.cache.layers[0].keys),
    )  # fmt: skip
    lines += _refusal(target)
    return lines


def _phase(model: LoadedModel, target: Target, frag: Fragment, runs: list) -> tuple[list[Line], str | None]:
    """The phase slot against the float64 model prefilled at ``delta``, per layer kind (fills ``runs``).

    A shift whose rotation does not compose on ``model`` must be refused: a target that raises
    there is right (the shift is left out, or the line is ``REFUSED`` where that is every shift),
    one that turns the keys anyway fails. Returns the lines, and kvlab's refusal where nothing was turned.
    """
    moves = deltas(model, frag.length)
    scope = f"{frag.length} tokens by {', '.join(map(str, moves))}"
    twin = exact_twin(model)
    worst: dict[str, tuple[float, str, int]] = {}
    refused = []
    try:
        floor = max(REL_KEY_NOISE, own_noise(frag.cache, prefill_ids(twin, frag.token_ids), model))
        for delta in moves:
            refusal = kvlab_refusal(model, [(0, frag.length, delta)])
            try:
                run = ShiftRun(target, model, frag, delta)
            except TargetRaised as e:
                if refusal is None:
                    raise
                refused.append((delta, e.failure, refusal))
                continue
            if refusal is not None:
                raise Unfit(
                    f"turned {frag.length} tokens by {delta}, a rotation that does not compose: {refusal[:200]}"
                )
            exact = prefill_ids(twin, frag.token_ids, delta)
            problems = structure_problems(run.result, exact)
            if problems:
                raise Unfit("the result cannot hold these keys: " + "; ".join(problems[:4]))
            runs.append(run)
            errors = key_error_by_kind(*tails(run.result, exact, frag.length), model, floor, offset=delta)
            for kind, (value, part) in errors.items():
                if kind not in worst or value > worst[kind][0]:
                    worst[kind] = (value, part, delta)
    except TargetRaised as e:
        return [Line("phase", scope, None, 1.0, "x rounding", FAIL, f"raised {e.failure}")], None
    except Unfit as e:
        return [Line("phase", scope, None, 1.0, "x rounding", FAIL, str(e))], None
    finally:
        del twin
    if not runs:
        _, failure, refusal = refused[0]
        return [Line("phase", scope, None, 1.0, "x rounding", REFUSED, refused_detail(failure, refusal))], refusal
    also = f"; refused, as kvlab refuses them, at shifts {[d for d, _, _ in refused]}" if refused else ""
    return [
        Line(
            "phase",
            f"{kind} layers, {scope}",
            value,
            1.0,
            "x rounding",
            PASS if value <= 1 else FAIL,
            f"{'within rounding' if value <= 1 else part + ' wrong'} (worst: {part}, shift {delta}); against the "
            f"float64 model prefilled at the new positions; the fragment's own fp32 noise {floor:.2g}{also}",
        )
        for kind, (value, part, delta) in sorted(worst.items())
    ], None


def _values(model: LoadedModel, runs: list[ShiftRun]) -> list[Line]:
    """The slot without phase is the fragment's own."""
    ropes = layer_ropes(model.model)
    worst, where = 0.0, ""
    for run in runs:
        a, b = tails(run.result, run.frag.cache, run.frag.length)
        for li, rope in enumerate(ropes):
            slot = other_slot(rope.slot)
            d = rel_diff(getattr(a.layers[li], slot), getattr(b.layers[li], slot))
            if d > worst:
                worst, where = d, f"layer {li} {slot}, shift {run.delta}"
    detail = "bit for bit" if worst == 0 else f"max relative difference at {where}"
    scope = f"{'/'.join(sorted({other_slot(r.slot) for r in ropes}))} against the fragment's own"
    return [Line("values", scope, worst, REL_KEY_NOISE, "relative", PASS if worst <= REL_KEY_NOISE else FAIL, detail)]


def _length(runs: list[ShiftRun]) -> list[Line]:
    """Every layer keeps its tokens and its length (a shift moves positions, it adds and drops nothing)."""
    wrong = set()
    for run in runs:
        for li, (a, b) in enumerate(zip(run.result.layers, run.frag.cache.layers, strict=True)):
            if a.keys.shape != b.keys.shape or a.get_seq_length() != b.get_seq_length() or not layer_ready(a):
                wrong.add(li)
    n = runs[0].frag.length
    detail = f"layers {sorted(wrong)} hold or report other token counts" if wrong else f"{n} tokens in every layer"
    return [Line("length", f"{n} tokens, every layer", len(wrong), 0, "layers wrong", FAIL if wrong else PASS, detail)]


def _by_reference(runs: list[ShiftRun]) -> list[Line]:
    """A shift into a new cache leaves its input unchanged and shares no memory with it."""
    problems = []
    for run in runs:
        if run.in_place:
            continue
        problems += [
            f"shift {run.delta}: input {c.removeprefix('fragment 0 ')}" for c in changes([run.input], run.before)
        ][:1]
        problems += [f"shift {run.delta}: {s}" for s in shared_storage(run.result, [run.input])][:1]
    how = "turns in place" if all(r.in_place for r in runs) else "returns a new cache"
    detail = "; ".join(problems[:4]) or f"{how}; inputs intact"
    return [Line("by reference", f"{how}", len(problems), 0, "problems", FAIL if problems else PASS, detail)]


def _zero(model: LoadedModel, target: Target, frag: Fragment) -> list[Line]:
    """A shift by 0 changes nothing."""
    run = ShiftRun(target, model, frag, 0)
    problems = structure_problems(run.result, frag.cache)
    if problems:
        raise Unfit("; ".join(problems[:4]))
    differ = sum(
        int((getattr(a, s) != getattr(b, s)).sum())
        if getattr(a, s).shape == getattr(b, s).shape
        else getattr(b, s).numel()
        for a, b in zip(run.result.layers, frag.cache.layers, strict=True)
        for s in ("keys", "values")
    )
    return [
        Line(
            "zero shift",
            f"{frag.length} tokens by 0",
            differ,
            0,
            "elements",
            FAIL if differ else PASS,
            "bit for bit" if not differ else "a shift by 0 changed the cache",
        )
    ]


def _refusal(target: Target) -> list[Line]:
    """A cache of a model whose rotations do not compose is refused, not turned."""
    dyn = refusal_model()
    cache = caches(random_fragments(dyn, TokenSource(dyn, 0), [8]))[0]
    return refusal_line(
        f"8 tokens of {dyn.name} (dynamic NTK) by 8",
        lambda: target.call(cache, 8, dyn.model),
        "turned",
        "it turned them: " + REFUSAL_WHY + "; a shift must refuse it",
    )
