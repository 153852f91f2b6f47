"""The context error line of a compaction or press audit (information): answer-span KL against the full cache."""

from __future__ import annotations

import copy

import torch
from transformers import DynamicCache

from kvlab.cache.compact import ORIGINAL, compact, low_key_norms
from kvlab.cache.fragments import clone_cache, prefill_ids, tokenize
from kvlab.compat import forward
from kvlab.errors import KvlabError
from kvlab.measure.audit.compact_reading import identify
from kvlab.measure.audit.compact_source import EXPLICIT, RATIOS, Source
from kvlab.measure.audit.lines import (
    Unfit,
    guarded,
)
from kvlab.measure.audit.target import COMPACT, Target, expect_cache
from kvlab.measure.case import DEFAULT_ANSWERS, DEFAULT_PROBES, DEFAULT_TEXTS
from kvlab.measure.certificate import INFO, Line
from kvlab.measure.metrics import REL_KEY_NOISE
from kvlab.models.loaded import LoadedModel


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


def context_line(model: LoadedModel, target: Target, positions: str, reader: str, refusal: str | None) -> list[Line]:
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
