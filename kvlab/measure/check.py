"""``kvlab check``: every strategy on one model, against both references, in one table."""

from __future__ import annotations

import time

from kvlab.cache.merge import merge
from kvlab.cache.strategies import strategy_names
from kvlab.errors import KvlabError
from kvlab.measure.case import DEFAULT_PROBES, DEFAULT_TEXTS, Case
from kvlab.measure.metrics import kv_diff, max_diff, next_token_kl
from kvlab.models.loaded import LoadedModel


def check_rows(model: LoadedModel, texts: list[str] | None = None, probes: list[str] | None = None) -> list[dict]:
    """One row per registered strategy: phase and context error, length and next-token KL.

    Columns: ``max_k_phase`` = max |K - phase reference| over all layers, heads and positions;
    ``max_v_phase`` = same for V; ``seq_len``; ``kl_mean``/``kl_max`` (nats) and
    ``top1_agree`` of the next token after each probe, against the joined prefill.
    """
    case = Case.from_texts(model, texts or DEFAULT_TEXTS, probes or DEFAULT_PROBES)
    frags, phase_ref, joined, probes = case.fragments, case.phase, case.context, case.probes
    joined_dists = case.context_dists  # read once, compared with every strategy
    rows = []
    for name in strategy_names():
        t0 = time.perf_counter()
        try:
            cache = merge(frags, name, model)
        except KvlabError as e:
            rows.append({"strategy": name, "refused": str(e)})
            continue
        ms = (time.perf_counter() - t0) * 1e3
        d = kv_diff(cache, phase_ref)
        kl = next_token_kl(model, cache, joined, probes, joined_dists)
        rows.append(
            {
                "strategy": name,
                "max_k_phase": max_diff(d, "k"),
                "max_v_phase": max_diff(d, "v"),
                "seq_len": cache.get_seq_length(),
                "kl_mean": sum(r["kl"] for r in kl) / len(kl),
                "kl_max": max(r["kl"] for r in kl),
                "top1_agree": f"{sum(r['agree'] for r in kl)}/{len(kl)}",
                "merge_ms": ms,
            }
        )
    return rows


def format_rows(rows: list[dict]) -> str:
    head = (
        f"{'strategy':<10} {'max|K-phase ref|':>17} {'max|V-phase ref|':>17} {'seq_len':>8} "
        f"{'KL mean':>9} {'KL max':>9} {'top-1':>6} {'merge ms':>9}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        if "refused" in r:
            lines.append(f"{r['strategy']:<10} refused: {r['refused'][:100]}")
            continue
        lines.append(
            f"{r['strategy']:<10} {r['max_k_phase']:>17.3e} {r['max_v_phase']:>17.3e} {r['seq_len']:>8d} "
            f"{r['kl_mean']:>9.4f} {r['kl_max']:>9.4f} {r['top1_agree']:>6} {r['merge_ms']:>9.1f}"
        )
    return "\n".join(lines)
