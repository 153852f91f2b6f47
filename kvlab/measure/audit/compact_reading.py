"""Which input token each slot of a compaction's result holds, read from its values; the kept tokens line on it."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from kvlab.cache.compact import KEPT, ORIGINAL, declared_positions
from kvlab.cache.fragments import prefill_ids
from kvlab.measure.audit.compact_source import Run, Source
from kvlab.measure.audit.compare import (
    other_slot,
    structure_problems,
)
from kvlab.measure.audit.lines import (
    Unfit,
)
from kvlab.measure.certificate import FAIL, PASS, REFUSED, Line
from kvlab.measure.metrics import REL_KEY_NOISE
from kvlab.models.layout import layer_ropes
from kvlab.models.loaded import LoadedModel


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


def declared_at(run: Run, reading: Reading, positions: str) -> tuple[list[torch.Tensor], list[torch.Tensor], int]:
    """The tokens each slot holds by the contract, the positions they declare, and the next position."""
    tokens = run.keep if run.keep is not None else reading.tokens
    new, total = declared_positions([t.cpu() for t in tokens], positions)
    return tokens, new, run.source.n if positions == ORIGINAL else total


def kept_tokens_line(runs: list, positions: str, press: bool, refusal: str | None) -> list[Line]:
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


def prefix_kept(model: LoadedModel, result, ids: torch.Tensor) -> bool:
    """Whether every layer of a press's ``result`` holds tokens ``0 .. k-1`` in slots ``0 .. k-1`` (read from values)."""
    if not isinstance(result, DynamicCache):
        return False
    cache = prefill_ids(model, ids)
    try:
        reading = identify(model, result, Source(ids, cache, cache, REL_KEY_NOISE), None, KEPT)
    except Unfit:
        return False
    return all(torch.equal(t, torch.arange(t.shape[-1]).expand_as(t)) for t in reading.tokens)
