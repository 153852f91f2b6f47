"""The audit of a store's merge function: each line names one defect a merge can have.

``fn(caches[, model])`` (see :mod:`kvlab.measure.audit.target`) is called on fresh copies of
fragments prefilled alone from position 0 and held to:

* ``phase``, per layer kind: every fragment's phase-carrying slot against the exact keys where it
  lands (the float64 model, :func:`kvlab.measure.twin.exact_landing`), in units of the
  fragments' own fp32 noise: the angle of every rotary pair, its norm, and the dimensions no
  rotation touches (:func:`kvlab.measure.audit.compare.key_error_by_kind`);
* ``values``: the other slot is the fragments' own, untouched;
* ``length``: ``get_seq_length()`` is the total, and a forward pass on top of the result reads
  what it reads on top of the same tensors in a cache kvlab built (so positions and masks come
  out right: a layer assigned ``.keys`` without ``update`` reads as empty);
* ``by reference``: the inputs unchanged by the merge and by a forward pass through its result,
  which shares no memory with them;
* ``sliding window``: every layer keeps what a joined prefill keeps;
* ``dtype and device``, ``one fragment``, ``empty list``: housekeeping;
* ``refusal``: fragments of a model whose rotations do not compose (dynamic NTK) are refused;
* ``context error`` (information): the answer-span KL behind the merge against the joined prefill.
"""

from __future__ import annotations

import copy

import torch
from transformers import DynamicCache

from kvlab.cache.fragments import Fragment, joined_prefill
from kvlab.cache.merge import merge
from kvlab.compat import layer_ready
from kvlab.errors import KvlabError
from kvlab.measure.audit.compare import (
    first_changes,
    key_error_by_kind,
    next_log_probs,
    other_slot,
    own_noise,
    rebuilt,
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
    spans,
)
from kvlab.measure.audit.target import Target, TargetRaised, expect_cache
from kvlab.measure.case import DEFAULT_ANSWERS, Case
from kvlab.measure.certificate import FAIL, INFO, PASS, REFUSED, Line
from kvlab.measure.certify import FLOOR_BOUND
from kvlab.measure.metrics import REL_KEY_NOISE, kl_divergence
from kvlab.measure.phase import LENGTHS
from kvlab.measure.sliding import identity_fragments, sliding_line, sliding_window
from kvlab.measure.span import span_scores
from kvlab.measure.tokens import TokenSource, position_limit, random_fragments
from kvlab.measure.twin import exact_landing, exact_twin
from kvlab.models.layout import layer_ropes
from kvlab.models.loaded import LoadedModel

# Base lengths of the phase line: certify's LENGTHS, each the first of three unequal fragments
# (sizes()), so that a landing computed from the wrong lengths shows; a base whose three fragments
# pass the model's last position is left out (512 on the tiny models).

#: Tokens fed on top of a result by the length and by-reference lines.
PROBE_TOKENS = 4


def sizes(n: int) -> list[int]:
    """The three fragment lengths of base length ``n``."""
    return [n, n + 3, n // 2 + 1]


class MergeRun:
    """One merge of fresh copies of ``frags`` by the target, its result checked to be a cache."""

    def __init__(self, target: Target, model: LoadedModel, frags: list[Fragment]):
        self.frags = frags
        self.inputs = caches(frags)
        self.result = expect_cache(
            target.call(self.inputs, model.model), target.name, f"{len(frags)} fragments of {self.lengths} tokens"
        )

    @property
    def lengths(self) -> list[int]:
        return [f.length for f in self.frags]

    @property
    def total(self) -> int:
        return sum(self.lengths)


def audit_merge(model: LoadedModel, target: Target, *, lengths: tuple[int, ...] = LENGTHS, seed: int = 0) -> list[Line]:
    """Every line of a merge audit on ``model`` (see the module docstring).

    Parameters
    ----------
    model : LoadedModel
    target : Target
        The merge (``kind`` ``merge``).
    lengths : tuple of int
        Base lengths of the phase line (:func:`sizes`), capped by the model's positions.
    seed : int
        Seed of the random token ids the fragments are made of.

    Raises
    ------
    AuditTargetError
        The target returned something other than a ``DynamicCache`` where a merge was expected.
    """
    ids = TokenSource(model, seed)
    lengths = [n for n in lengths if sum(sizes(n)) <= position_limit(model)]
    refusal = model_refusal(model)
    runs: list[MergeRun] = []
    lines, none = _phase(model, target, ids, lengths, runs)
    lines += guarded(
        "values", "the slot without phase", REL_KEY_NOISE, "relative", lambda: _values(model, need(runs, none))
    )
    probe = ids(PROBE_TOKENS)
    lines += guarded(
        "length", "get_seq_length and a forward pass", FLOOR_BOUND, "nats",
        lambda: _length(model, need(runs, none), probe),
    )  # fmt: skip
    small = random_fragments(model, ids, sizes(min(lengths)))
    lines += guarded(
        "by reference", "inputs after the merge and a forward pass", 0, "problems",
        lambda: _by_reference(model, target, small, probe), refusal,
    )  # fmt: skip
    lines += guarded(
        "sliding window", "past the window", 0, "layers wrong", lambda: _sliding(model, target, ids), refusal
    )
    lines += guarded(
        "dtype and device", "every tensor of the result", 0, "tensors",
        lambda: dtype_line([(f"{r.lengths} tokens", r.result) for r in need(runs, none)], small[0].cache.layers[0].keys),
    )  # fmt: skip
    lines += guarded(
        "one fragment", f"1 x {small[0].length} tokens", REL_KEY_NOISE, "relative",
        lambda: _one(model, target, small[0]), refusal,
    )  # fmt: skip
    lines += _empty(model, target)
    lines += _refusal(target)
    lines += _context(model, target, refusal)
    return lines


def _phase(
    model: LoadedModel, target: Target, ids: TokenSource, lengths: list[int], runs: list
) -> tuple[list[Line], str | None]:
    """Every fragment's phase slot against the exact keys where it lands, per layer kind (fills ``runs``).

    Fragments whose rotations do not compose on ``model`` must be refused: a target that raises
    on them is right (their lengths are left out, or the line is ``REFUSED`` where that is all of
    them), one that merges them fails. Returns the lines, and kvlab's refusal where nothing was merged.
    """
    scope = "3 fragments of " + ", ".join("/".join(map(str, sizes(n))) for n in lengths) + " tokens"
    twin = exact_twin(model)
    worst: dict[str, tuple[float, str, int]] = {}
    naive: dict[str, float] = {}
    floors, refused = [], []
    try:
        for n in lengths:
            frags = random_fragments(model, ids, sizes(n))
            refusal = kvlab_refusal(model, spans(frags))
            try:
                run = MergeRun(target, model, frags)
            except TargetRaised as e:
                if refusal is None:
                    raise
                refused.append((n, e.failure, refusal))
                continue
            if refusal is not None:
                raise Unfit(f"merged {run.lengths} tokens, whose rotations do not compose: {refusal[:200]}")
            exact, at_own = exact_landing(twin, run.frags)
            problems = structure_problems(run.result, exact)
            if problems:
                raise Unfit("the result cannot hold these keys: " + "; ".join(problems[:4]))
            runs.append(run)
            floor = max(REL_KEY_NOISE, *(own_noise(f.cache, c, model) for f, c in zip(run.frags, at_own)))
            floors.append(floor)
            errors = key_error_by_kind(*tails(run.result, exact, run.total), model, floor)
            for kind, (value, part) in errors.items():
                if kind not in worst or value > worst[kind][0]:
                    worst[kind] = (value, part, n)
            plain = merge(run.frags, "naive", model)
            for kind, (value, _) in key_error_by_kind(*tails(plain, exact, run.total), model, floor).items():
                naive[kind] = max(naive.get(kind, 0.0), value)
    except TargetRaised as e:
        return [Line("phase", scope, None, 1.0, "x rounding", FAIL, f"raised {e.failure}")], None
    except Unfit as e:
        return [Line("phase", scope, None, 1.0, "x rounding", FAIL, str(e))], None
    finally:
        del twin
    if not runs:
        _, failure, refusal = refused[0]
        return [Line("phase", scope, None, 1.0, "x rounding", REFUSED, refused_detail(failure, refusal))], refusal
    also = f"; refused, as kvlab refuses them, at {[sizes(n) for n, _, _ in refused]}" if refused else ""
    out = []
    for kind, (value, part, n) in sorted(worst.items()):
        ok = value <= 1
        what = "within rounding" if ok else f"{part} wrong"
        out.append(
            Line(
                "phase",
                f"{kind} layers, {scope}",
                value,
                1.0,
                "x rounding",
                PASS if ok else FAIL,
                f"{what} (worst: {part}, fragments of {'/'.join(map(str, sizes(n)))}); against the float64 model "
                f"prefilled where each fragment lands; the fragments' own fp32 noise {max(floors):.2g}; "
                f"a naive concatenation {naive.get(kind, 0.0):.3g} x rounding{also}",
            )
        )
    return out, None


def _values(model: LoadedModel, runs: list[MergeRun]) -> list[Line]:
    """The slot without phase equals the fragments' own (kvlab's naive concatenation of them)."""
    ropes = layer_ropes(model.model)
    worst, where = 0.0, ""
    for run in runs:
        own = merge(run.frags, "naive", model)
        a, b = tails(run.result, own, run.total)
        for li, rope in enumerate(ropes):
            slot = other_slot(rope.slot)
            d = rel_diff(getattr(a.layers[li], slot), getattr(b.layers[li], slot))
            if d > worst:
                worst, where = d, f"layer {li} {slot}, {run.lengths} tokens"
    slots = sorted({other_slot(r.slot) for r in ropes})
    scope = f"{'/'.join(slots)} against the fragments' own"
    detail = "bit for bit" if worst == 0 else f"max relative difference at {where}"
    return [Line("values", scope, worst, REL_KEY_NOISE, "relative", PASS if worst <= REL_KEY_NOISE else FAIL, detail)]


def _length(model: LoadedModel, runs: list[MergeRun], probe: torch.Tensor) -> list[Line]:
    """``get_seq_length()`` is the total, and the next token reads as on the same tensors in a cache kvlab built."""
    run = runs[0]
    total, result = run.total, run.result
    scope = f"{len(run.frags)} fragments, {total} tokens, {PROBE_TOKENS} tokens on top"
    problems = []
    if result.get_seq_length() != total:
        problems.append(f"get_seq_length() is {result.get_seq_length()}, not {total}")
    wrong = [li for li, layer in enumerate(result.layers) if layer.get_seq_length() != total]
    if wrong:
        problems.append(f"layers {wrong} report {sorted({result.layers[li].get_seq_length() for li in wrong})} tokens")
    uninit = [li for li, layer in enumerate(result.layers) if not layer_ready(layer)]
    if uninit:
        problems.append(f"layers {uninit} never initialized (tensors assigned without update: read as empty)")
    try:
        right = next_log_probs(model, rebuilt(result, model, total), probe)
    except ValueError as e:
        problems.append(str(e))
        right = None
    got = next_log_probs(model, copy.deepcopy(result), probe)
    kl = kl_divergence(right, got) if right is not None else None
    if kl is not None and kl > FLOOR_BOUND:
        problems.append(f"the next token reads {kl:.3g} nats away from the same tensors with the right length")
    try:
        kvlab = next_log_probs(model, merge(run.frags, "rerotate", model), probe)
        beside = f"; behind kvlab's rerotate {kl_divergence(kvlab, got):.3g} nats (phase errors included)"
    except KvlabError as e:
        beside = f"; kvlab's rerotate refuses: {str(e)[:80]}"
    detail = ("; ".join(problems) if problems else "continues at the right position") + beside
    return [Line("length", scope, kl, FLOOR_BOUND, "nats", FAIL if problems else PASS, detail)]


def _by_reference(model: LoadedModel, target: Target, frags: list[Fragment], probe: torch.Tensor) -> list[Line]:
    """Inputs unchanged by the merge and by a forward pass through the result; no memory shared with them."""
    inputs = caches(frags)
    before = snapshot(inputs)
    result = expect_cache(target.call(inputs, model.model), target.name, f"{len(frags)} fragments")
    problems = [f"by the merge: {c}" for c in first_changes(inputs, before)]
    problems += [f"the result is fragment {i}'s cache itself" for i, c in enumerate(inputs) if c is result]
    problems += shared_storage(result, inputs)
    note = ""
    try:
        next_log_probs(model, result, probe)
    except (RuntimeError, ValueError, IndexError, TypeError) as e:
        # The result itself is broken (the length or sliding-window line names how): only the merge is checked here.
        note = f"; no forward pass through the result (it raised {type(e).__name__}), so only the merge was checked"
    if not problems:  # changed by the merge already, or sharing memory: the forward pass would say it again
        problems = [f"by a forward pass through the result: {c}" for c in first_changes(inputs, before)]
    scope = f"{len(frags)} fragments, {PROBE_TOKENS} tokens read through the result"
    detail = "; ".join(problems[:4]) + (f" (+{len(problems) - 4})" if len(problems) > 4 else "")
    status = FAIL if problems else PASS
    return [Line("by reference", scope, len(problems), 0, "problems", status, (detail or "inputs intact") + note)]


def _sliding(model: LoadedModel, target: Target, ids: TokenSource) -> list[Line]:
    """Fragments together past the window: every layer keeps what their joined prefill keeps."""
    if sliding_window(model) is None:
        return [sliding_line(model, [], None, None)]
    frags = identity_fragments(model, ids)
    run = MergeRun(target, model, frags)
    joined = joined_prefill(model, frags).cache
    problems = structure_problems(run.result, joined)
    if problems:
        raise Unfit("; ".join(problems[:4]))
    return [sliding_line(model, frags, joined, run.result)]


def _one(model: LoadedModel, target: Target, frag: Fragment) -> list[Line]:
    """A single fragment comes back as itself."""
    run = MergeRun(target, model, [frag])
    problems = structure_problems(run.result, frag.cache)
    if problems:
        raise Unfit("; ".join(problems[:4]))
    a, b = tails(run.result, frag.cache, frag.length)
    worst = max(rel_diff(getattr(x, s), getattr(y, s)) for x, y in zip(a.layers, b.layers) for s in ("keys", "values"))
    kept = [layer.keys.shape[-2] for layer in run.result.layers] == [
        layer.keys.shape[-2] for layer in frag.cache.layers
    ]
    problems = [] if kept else ["layers keep other token counts than the fragment's"]
    if run.result.get_seq_length() != frag.length:
        problems.append(f"get_seq_length() is {run.result.get_seq_length()}, not {frag.length}")
    if worst > REL_KEY_NOISE:
        problems.append(f"K/V differ from the fragment's by {worst:.3g} relative")
    detail = "; ".join(problems) or ("bit for bit" if worst == 0 else "to rounding")
    return [
        Line(
            "one fragment",
            f"1 x {frag.length} tokens",
            worst,
            REL_KEY_NOISE,
            "relative",
            FAIL if problems else PASS,
            detail,
        )
    ]


def _empty(model: LoadedModel, target: Target) -> list[Line]:
    """An empty list is refused (raises), never merged into an empty cache."""
    try:
        got = target.call([], model.model)
    except TargetRaised as e:
        return [Line("empty list", "no fragments", type(e.error).__name__, "raised", "", PASS, e.failure)]
    return [Line("empty list", "no fragments", "returned", "raised", "", FAIL, f"returned a {type(got).__name__}")]


def _refusal(target: Target) -> list[Line]:
    """Fragments of a model whose rotations do not compose are refused, not merged."""
    dyn = refusal_model()
    frags = random_fragments(dyn, TokenSource(dyn, 0), [8, 8])
    return refusal_line(
        f"2 fragments of {dyn.name} (dynamic NTK)",
        lambda: target.call(caches(frags), dyn.model),
        "merged",
        "it merged them: " + REFUSAL_WHY + "; a merge must refuse it",
    )


def _context(model: LoadedModel, target: Target, refusal: str | None) -> list[Line]:
    """What no rotation fixes (information): the answer-span KL behind the merge against the joined prefill."""
    case = Case.from_texts(model)
    scope = f"{len(case.fragments)} story fragments, {len(case.probes)} probes"

    def span(cache: DynamicCache) -> tuple[float, int]:
        rows = span_scores(model, cache, case.reference, case.probes, DEFAULT_ANSWERS)
        return sum(r["span_kl"] for r in rows) / len(rows), sum(r["agree"] for r in rows)

    def measure() -> list[Line]:
        run = MergeRun(target, model, case.fragments)
        kl, agree = span(run.result)
        try:
            kvlab = f"; kvlab's rerotate {span(merge(case.fragments, 'rerotate', model))[0]:.3g}"
        except KvlabError:
            kvlab = ""
        detail = f"top-1 agrees {agree}/{len(case.probes)}{kvlab}"
        return [Line("context error", scope, kl, None, "nats/token", INFO, detail)]

    lines = guarded("context error", scope, None, "nats/token", measure, refusal)
    # Information, never a gate: a failure to read is said, not counted.
    return [Line(x.check, x.scope, x.value, x.bound, x.unit, INFO, x.detail) for x in lines]
