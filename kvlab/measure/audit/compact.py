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
import functools
import math
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from kvlab.cache.compact import KEPT, ORIGINAL, compact, declared_positions, held_positions, low_key_norms, rebuild
from kvlab.cache.fragments import clone_cache, prefill_ids, tokenize
from kvlab.compat import forward, layer_ready
from kvlab.errors import KvlabError
from kvlab.measure.audit.compare import (
    CacheView,
    LayerView,
    changes,
    key_error_by_kind,
    next_log_probs,
    other_slot,
    own_noise,
    rel_diff,
    shared_storage,
    snapshot,
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
from kvlab.measure.audit.target import COMPACT, Target, TargetRaised, expect_cache
from kvlab.measure.case import DEFAULT_ANSWERS, DEFAULT_PROBES, DEFAULT_TEXTS
from kvlab.measure.certificate import FAIL, INFO, NA, PASS, REFUSED, Line
from kvlab.measure.certify import FLOOR_BOUND
from kvlab.measure.metrics import REL_KEY_NOISE, kl_divergence
from kvlab.measure.sliding import sliding_window
from kvlab.measure.tokens import TokenSource
from kvlab.measure.twin import exact_twin
from kvlab.models.layout import layer_ropes
from kvlab.models.loaded import LoadedModel
from kvlab.models.rope import check_composable, longrope_inv_freq, rotate_keys

#: Tokens the audited cache holds (past the sliding window and 8 more, where there is one).
TOKENS = 48

#: The fractions of each layer's tokens the audit asks a compaction to keep.
RATIOS = (0.5, 0.25)

#: Tokens fed on top of a result by the length and by-reference lines.
PROBE_TOKENS = 4

#: How a store's reader places the next token: from the cache (``generate``), or passing positions itself.
CACHE, EXPLICIT = "cache", "explicit"
READERS = (CACHE, EXPLICIT)


@dataclass
class Source:
    """What a compaction reads: ``ids`` ``[n]``, their fp32 cache from 0, the float64 one, and its noise."""

    ids: torch.Tensor
    cache: DynamicCache
    exact: DynamicCache
    floor: float

    @property
    def n(self) -> int:
        return int(self.ids.shape[-1])

    @functools.cached_property
    def held(self) -> list[torch.Tensor]:
        """Per layer, ``[held]`` the positions its tokens stand at (computed once)."""
        return held_positions(self.cache)


def make_source(model: LoadedModel, twin: LoadedModel, ids: torch.Tensor) -> Source:
    cache = prefill_ids(model, ids)
    exact = prefill_ids(twin, ids)
    return Source(ids, cache, exact, max(REL_KEY_NOISE, own_noise(cache, exact, model)))


def draw_keep(cache: DynamicCache, ratio: float, seed: int) -> list[torch.Tensor]:
    """Per layer, ``[batch, kv_heads, k]`` ascending positions: ``k = ratio`` of the tokens it holds, drawn per head."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for layer, held in zip(cache.layers, held_positions(cache), strict=True):
        b, h, t, _ = layer.keys.shape
        k = max(1, round(ratio * t))
        rows = [torch.randperm(t, generator=g)[:k].sort().values for _ in range(b * h)]
        out.append((torch.stack(rows) + int(held[0])).reshape(b, h, k))
    return out


def keep_all(cache: DynamicCache) -> list[torch.Tensor]:
    """Per layer, every token it holds, ``[batch, kv_heads, held]``."""
    return [
        held.expand(layer.keys.shape[0], layer.keys.shape[1], -1).clone()
        for layer, held in zip(cache.layers, held_positions(cache), strict=True)
    ]


class Run:
    """One call of the target on a fresh copy of the source: ``result``, and the tokens it was asked to keep."""

    def __init__(self, target: Target, model: LoadedModel, source: Source, keep, label: str):
        self.source, self.keep, self.label = source, keep, label
        if target.kind == COMPACT:
            self.input = clone_cache(source.cache, model.config)
            self.before = snapshot([self.input])
            got = target.call(self.input, [k.clone() for k in keep], model.model)
        else:
            self.input_ids = source.ids[None].clone()
            got = target.call(model.model, self.input_ids)
        self.result = expect_cache(got, target.name, label)


@dataclass
class Reading:
    """What the audit reads in a result: per layer ``[batch, kv_heads, slots]`` tokens (-1: none), and problems."""

    tokens: list[torch.Tensor]
    wrong: list[str]
    unread: int


def identify(model: LoadedModel, result: DynamicCache, source: Source, keep, positions: str) -> Reading:
    """Which input token each slot holds, read from the slot without phase; where values coincide, either serves.

    A slot matches a token whose value vector lies within ``REL_KEY_NOISE`` of the layer's scale.
    Of tokens whose values coincide, the one asked for is taken, else (``original``) the one whose
    key is nearest, else one not yet taken by that head.
    """
    problems = structure_problems(result, source.cache)
    if problems:
        raise Unfit("the result cannot hold these tokens: " + "; ".join(problems[:4]))
    tokens, wrong, unread = [], [], 0
    for li, (rope, a, b, held) in enumerate(
        zip(layer_ropes(model.model), result.layers, source.cache.layers, source.held, strict=True)
    ):
        slot = "values" if rope.nope else other_slot(rope.slot)
        x, y = getattr(a, slot).double().cpu(), getattr(b, slot).double().cpu()
        scale = float(y.abs().max()) or 1.0
        dist = (x[:, :, :, None, :] - y[:, :, None, :, :]).abs().amax(-1) / scale  # [batch, heads, slots, held]
        close = dist <= REL_KEY_NOISE
        pick = dist.argmin(-1)
        if positions == ORIGINAL and not rope.nope:
            kx, ky = getattr(a, rope.slot).double().cpu(), getattr(b, rope.slot).double().cpu()
            kd = (kx[:, :, :, None, :] - ky[:, :, None, :, :]).abs().amax(-1)
            pick = torch.where(close, kd, math.inf).argmin(-1).where(close.any(-1), pick)
        asked = None if keep is None else (keep[li] - int(held[0]))
        ambiguous = (close.sum(-1) > 1).nonzero().tolist()
        for bi, hi, si in ambiguous:
            cands = close[bi, hi, si].nonzero().flatten().tolist()
            if asked is not None and si < asked.shape[-1] and int(asked[bi, hi, si]) in cands:
                pick[bi, hi, si] = int(asked[bi, hi, si])
            elif positions != ORIGINAL or rope.nope:
                # Either serves: the first one after the slot before it, so that order reads as it was kept.
                taken = set(pick[bi, hi, :si].tolist())
                after = int(pick[bi, hi, si - 1]) if si else -1
                free = [c for c in cands if c not in taken]
                pick[bi, hi, si] = next((c for c in free if c > after), free[0] if free else cands[0])
        found = (pick + int(held[0])).where(close.any(-1), -1)
        tokens.append(found)
        for bi, hi, si in (found < 0).nonzero().tolist()[:2]:
            near = int(dist[bi, hi, si].argmin())
            wrong.append(
                f"layer {li} head {hi} slot {si} matches no input token (nearest: {near + int(held[0])}, "
                f"{float(dist[bi, hi, si, near]):.2g} relative)"
            )
        unread += int((found < 0).sum())
    return Reading(tokens, wrong, unread)


def _declared(run: Run, reading: Reading, positions: str) -> tuple[list[torch.Tensor], list[torch.Tensor], int]:
    """The tokens each slot holds by the contract, the positions they declare, and the next position."""
    tokens = run.keep if run.keep is not None else reading.tokens
    new, total = declared_positions([t.cpu() for t in tokens], positions)
    return tokens, new, run.source.n if positions == ORIGINAL else total


def _reference(model: LoadedModel, source: Source, tokens, new, total: int) -> tuple[CacheView, list[torch.Tensor]]:
    """The exact keys and values of ``tokens`` turned to ``new``, and per layer the positions whose rounding counts."""
    layers, where = [], []
    n = source.n
    for rope, layer, k, p, held in zip(layer_ropes(model.model), source.exact.layers, tokens, new, source.held):
        slots = (k - int(held[0])).clamp_min(0)
        keys, values = (
            t.gather(2, slots[..., None].expand(-1, -1, -1, t.shape[-1])) for t in (layer.keys, layer.values)
        )
        if not rope.nope:
            long = check_composable(rope, [(0, n, total - n)]) if rope.rope_type == "longrope" else False
            freqs = longrope_inv_freq(model.model, rope, long) if rope.rope_type == "longrope" else rope.inv_freq
            phased = keys if rope.slot == "keys" else values
            turned = rotate_keys(phased, freqs.double(), (p - k).double(), pairing=rope.pairing)
            keys, values = (turned, values) if rope.slot == "keys" else (keys, turned)
        layers.append(LayerView(keys, values, keys.shape[-2]))
        where.append((k + (p - k).abs())[0].double())
    return CacheView(layers), where


def _view(cache: DynamicCache) -> CacheView:
    return CacheView([LayerView(x.keys, x.values, x.keys.shape[-2]) for x in cache.layers])


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
    lines = _kept_tokens(runs, positions, press, refusal) + lines
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
    lines += _context(model, target, positions, reader, refusal)
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
            tokens, new, total = _declared(run, reading, positions)
            if positions == KEPT and (why := kvlab_refusal(model, [(0, n, total - n)])):
                raise Unfit(f"re-rotated {n} tokens to {total}, a rotation that does not compose: {why[:200]}")
            runs.append((run, reading))
            if reading.unread and keep is None:
                raise Unfit(f"{reading.unread} slots hold no input token (the kept tokens line says which)")
            ref, where = _reference(model, source, tokens, new, total)
            errors = key_error_by_kind(_view(run.result), ref, model, source.floor, positions=where)
            if any(value > 1 for value, _ in errors.values()):
                # Only a failing line is worded by the other convention: its reference is built then.
                flip = ORIGINAL if positions == KEPT else KEPT
                _, new2, total2 = _declared(run, reading, flip)
                ref2, where2 = _reference(model, source, tokens, new2, total2)
                for kind, (value, _) in key_error_by_kind(
                    _view(run.result), ref2, model, source.floor, positions=where2
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


def _kept_tokens(runs: list, positions: str, press: bool, refusal: str | None) -> list[Line]:
    """Every slot holds an input token, per head, none twice, ascending for ``kept``; a compaction's, the one asked for."""
    scope = "every slot of every head" + ("" if press else ", against keep")
    if not runs:
        status = REFUSED if refusal else FAIL
        return [Line("kept tokens", scope, None, 0, "slots wrong", status, "nothing to read (the phase line says why)")]
    problems, count = [], 0
    for run, reading in runs:
        problems += reading.wrong
        count += reading.unread
        for li, found in enumerate(reading.tokens):
            if run.keep is not None:
                asked = run.keep[li].to(found.device)
                if asked.shape != found.shape:
                    problems.append(f"layer {li} holds {found.shape[-1]} slots, keep asks for {asked.shape[-1]}")
                    count += abs(found.shape[-1] - asked.shape[-1])
                    continue
                bad = (found != asked) & (found >= 0)
                count += int(bad.sum())
                for bi, hi, si in bad.nonzero().tolist()[:1]:
                    problems.append(
                        f"{run.label}: layer {li} head {hi} slot {si} holds token {int(found[bi, hi, si])}, "
                        f"keep asks for {int(asked[bi, hi, si])}"
                    )
                continue
            for bi in range(found.shape[0]):
                for hi in range(found.shape[1]):
                    row = [t for t in found[bi, hi].tolist() if t >= 0]
                    twice = len(row) - len(set(row))
                    if twice:
                        count += twice
                        problems.append(f"layer {li} head {hi} holds a token twice")
                    elif positions == KEPT and row != sorted(row):
                        count += 1
                        problems.append(
                            f"layer {li} head {hi} holds its tokens out of order (positions=kept reads slot order as position)"
                        )
    heads = {tuple(t.shape[:2]) for _, r in runs for t in r.tokens}
    detail = "; ".join(problems[:4]) + (f" (+{len(problems) - 4})" if len(problems) > 4 else "")
    kept = sorted({t.shape[-1] for _, r in runs for t in r.tokens})
    ok = f"every slot read from its values; layers keep {kept} slots per head of {sorted(heads)} [batch, heads]"
    return [Line("kept tokens", scope, count, 0, "slots wrong", FAIL if count else PASS, detail or ok)]


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
    _, _, total = _declared(run, reading, positions)
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
    if target.kind != COMPACT and got and _prefix_kept(dyn, got[0], ids):
        why = "the press kept a prefix at its own positions (slot j holds token j, as crop does): no key turned"
        return [Line("refusal", scope, None, None, "", NA, why + ", nothing to refuse")]
    return line


def _prefix_kept(model: LoadedModel, result, ids: torch.Tensor) -> bool:
    """Whether every layer of a press's ``result`` holds tokens ``0 .. k-1`` in slots ``0 .. k-1`` (read from values)."""
    if not isinstance(result, DynamicCache):
        return False
    cache = prefill_ids(model, ids)
    try:
        reading = identify(model, result, Source(ids, cache, cache, REL_KEY_NOISE), None, KEPT)
    except Unfit:
        return False
    return all(torch.equal(t, torch.arange(t.shape[-1]).expand_as(t)) for t in reading.tokens)


@torch.inference_mode()
def answer_span_kl(
    model: LoadedModel, cache: DynamicCache, full: DynamicCache, probe: str, answer: str, start: int | None = None
) -> tuple[float, bool]:
    """Teacher-forced KL (nats per answer token) behind ``cache`` against ``full``, and whether both read the same first token.

    ``probe`` then ``" " + answer`` are fed on copies of both caches, positions taken from each
    cache as ``generate`` takes them (or, behind ``cache``, from ``start`` on, for a reader that
    passes its own); the KL is averaged over the answer's tokens.
    """
    p, a = tokenize(model, probe), tokenize(model, " " + answer)
    ids = torch.cat([p, a])[None].to(model.device)

    def read(c: DynamicCache, at: int | None = None) -> torch.Tensor:
        extra = {} if at is None else {"position_ids": (at + torch.arange(ids.shape[-1]))[None].to(model.device)}
        out = forward(model.model, copy.deepcopy(c), input_ids=ids, use_cache=True, **extra)
        return torch.log_softmax(out.logits[0, len(p) - 1 : -1].double(), -1)

    lq, lp = read(cache, start), read(full)
    kl = float((lp.exp() * (lp - lq)).sum(-1).mean())
    return kl, bool(lp[0].argmax() == lq[0].argmax())


def _context(model: LoadedModel, target: Target, positions: str, reader: str, refusal: str | None) -> list[Line]:
    """What compaction costs (information): answer-span KL against the full cache, kvlab's compaction beside it."""
    ids = torch.cat([tokenize(model, t, bos=(i == 0)) for i, t in enumerate(DEFAULT_TEXTS)])
    full = prefill_ids(model, ids)
    ratio = RATIOS[0]
    scope = f"{len(DEFAULT_TEXTS)} story texts ({ids.numel()} tokens), {len(DEFAULT_PROBES)} probes, keep {ratio:g}"

    def measure() -> list[Line]:
        if target.kind == COMPACT:
            keep = low_key_norms(full, ratio)
            result = expect_cache(target.call(clone_cache(full, model.config), keep, model.model), target.name, scope)
        else:
            result = expect_cache(target.call(model.model, ids[None].clone()), target.name, scope)
            reading = identify(model, result, Source(ids, full, full, REL_KEY_NOISE), None, positions)
            if reading.unread:
                raise Unfit(f"{reading.unread} slots hold no input token")
            # Under original a slot's order changes no attention (kvpress's scorers keep top-k order).
            keep = [t.sort(-1).values for t in reading.tokens] if positions == ORIGINAL else reading.tokens
        start = None
        if reader == EXPLICIT:
            start = ids.numel() if positions == ORIGINAL else max(t.shape[-1] for t in keep)
        rows = [answer_span_kl(model, result, full, p, a, start) for p, a in zip(DEFAULT_PROBES, DEFAULT_ANSWERS)]
        kl = sum(r[0] for r in rows) / len(rows)
        try:
            own = compact(full, keep, model, positions=positions)
            mine = sum(answer_span_kl(model, own, full, p, a)[0] for p, a in zip(DEFAULT_PROBES, DEFAULT_ANSWERS))
            beside = f"; kvlab's compaction of the same tokens {mine / len(rows):.3g}"
        except KvlabError as e:
            beside = f"; kvlab refuses the same compaction: {str(e)[:80]}"
        detail = f"top-1 agrees {sum(r[1] for r in rows)}/{len(rows)}{beside}"
        return [Line("context error", scope, kl, None, "nats/token", INFO, detail)]

    lines = guarded("context error", scope, None, "nats/token", measure, refusal)
    return [Line(x.check, x.scope, x.value, x.bound, x.unit, INFO, x.detail) for x in lines]
