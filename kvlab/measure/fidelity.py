"""``kvlab.fidelity``: how close a merged cache comes to the joined prefill, downstream.

Three measures on a set of probe texts read behind each cache: the next-token KL and
top-1 agreement (:func:`kvlab.measure.metrics.next_token_kl`), and the agreement of greedy
continuations, each continued from its own cache. Given the true answers, each probe's
answer span is scored too (:func:`kvlab.measure.span.span_scores`: per-token KL over the
answer and the truth's likelihood). When given a strategy rather than a cache, the merge is
run and its wall time recorded too.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from dataclasses import dataclass, field
from typing import NamedTuple

from transformers import DynamicCache

from kvlab.cache.fragments import Fragment
from kvlab.cache.merge import merge, resolve
from kvlab.cache.strategies import Strategy
from kvlab.errors import MergeError
from kvlab.measure.case import Case, FidelityReference
from kvlab.measure.metrics import kl_row
from kvlab.measure.probes import read_probes
from kvlab.measure.references import context_reference
from kvlab.measure.span import answer_continuations, span_row
from kvlab.models.loaded import LoadedModel


@dataclass
class Fidelity:
    """Downstream agreement of one merged cache with the joined prefill.

    Attributes
    ----------
    strategy : str or None
        Strategy name (``None`` when a ready cache was measured).
    options : dict
        Options the strategy was built with (its dataclass fields).
    kl_mean, kl_max : float
        ``KL(p_joined || p_merged)`` of the next token after each probe, in nats.
    top1 : float
        Fraction of probes whose most likely next token agrees.
    greedy_agree : float
        Fraction of the ``greedy_tokens`` positions, over all probes, where the greedy
        continuation from the merged cache has the same token as the one from the
        joined prefill (each continued from its own cache, so a flip can propagate).
    greedy_prefix : float
        Mean fraction of the continuation before the first disagreement.
    greedy_tokens : int
        Tokens generated per probe.
    merge_s : float or None
        Wall time of the merge in seconds (``None`` when a ready cache was measured).
    span_kl_mean : float or None
        Mean over probes of the answer-span KL, nats per token (``None`` without answers).
    probes : list of dict
        Per probe: ``probe``, ``kl``, ``top1_ref``, ``top1``, ``agree`` (as
        :func:`kvlab.measure.metrics.next_token_kl`), ``greedy_ref``, ``greedy`` (decoded text).
    """

    strategy: str | None
    options: dict
    kl_mean: float
    kl_max: float
    top1: float
    greedy_agree: float
    greedy_prefix: float
    greedy_tokens: int
    merge_s: float | None
    probes: list[dict] = field(default_factory=list, repr=False)
    span_kl_mean: float | None = None

    def row(self) -> dict:
        """One flat table row: the summary fields, options inlined, no per-probe detail."""
        out = {"strategy": self.strategy, **self.options}
        out.update(
            kl_mean=self.kl_mean,
            kl_max=self.kl_max,
            top1=self.top1,
            greedy_agree=self.greedy_agree,
            greedy_prefix=self.greedy_prefix,
            greedy_tokens=self.greedy_tokens,
            merge_s=self.merge_s,
            span_kl_mean=self.span_kl_mean,
        )
        return out


class MergeClocks(NamedTuple):
    """Wall and CPU seconds of the same timed merges, in the order they ran."""

    wall: list[float]
    cpu: list[float]


def merge_clocks(
    model: LoadedModel,
    fragments: list[Fragment],
    strategy: str | Strategy,
    *,
    repeats: int = 5,
    warmup: int = 1,
    **options,
) -> MergeClocks:
    """Both clocks of ``repeats`` merges, after ``warmup`` untimed ones: one set of runs, read twice.

    A first call pays one-time costs (allocator growth, rotation tables, lazy imports) that
    are not the strategy's; a single cold timing of a 10 ms merge can come out slower than a
    1 s prefill. Use these, not :attr:`Fidelity.merge_s`, for cost comparisons: the median
    wall time is the cost to report, the minimum the one to compare when other work shares
    the machine, since preemption only ever adds time (a 10 ms merge hit by one 10 ms time
    slice doubles).

    The CPU clock counts the CPU seconds of this process (every thread,
    :func:`time.process_time`): time the process spent waiting for a core that other work
    held is not counted, so an order of costs taken on a loaded machine is the order on a
    quiet one.
    """
    if repeats < 1 or warmup < 0:
        raise MergeError(f"merge timing needs repeats >= 1 and warmup >= 0, got {repeats} and {warmup}")
    strat = resolve(strategy, **options)
    for _ in range(warmup):
        merge(fragments, strat, model)
    out = MergeClocks([], [])
    for _ in range(repeats):
        w0, c0 = time.perf_counter(), time.process_time()
        merge(fragments, strat, model)
        c1, w1 = time.process_time(), time.perf_counter()
        out.wall.append(w1 - w0)
        out.cpu.append(c1 - c0)
    return out


def merge_times(
    model: LoadedModel,
    fragments: list[Fragment],
    strategy: str | Strategy,
    *,
    repeats: int = 5,
    warmup: int = 1,
    clock: str = "wall",
    **options,
) -> list[float]:
    """Wall times (or ``clock="cpu"``: CPU times) in seconds of ``repeats`` warm merges (:func:`merge_clocks`)."""
    if clock not in MergeClocks._fields:
        raise MergeError(f"merge timing clock must be 'wall' or 'cpu', got {clock!r}")
    return getattr(merge_clocks(model, fragments, strategy, repeats=repeats, warmup=warmup, **options), clock)


def merge_seconds(
    model: LoadedModel,
    fragments: list[Fragment],
    strategy: str | Strategy,
    *,
    repeats: int = 5,
    warmup: int = 1,
    stat: str = "median",
    **options,
) -> float:
    """Warm wall time of one merge: the median (or ``stat="min"``) of :func:`merge_times`."""
    if stat not in ("median", "min"):
        raise MergeError(f"merge_seconds stat must be 'median' or 'min', got {stat!r}")
    times = merge_times(model, fragments, strategy, repeats=repeats, warmup=warmup, **options)
    return statistics.median(times) if stat == "median" else min(times)


def fidelity(
    model: LoadedModel,
    fragments: list[Fragment],
    merged: DynamicCache | str | Strategy = "rerotate",
    *,
    probes: list[str],
    greedy_tokens: int = 16,
    reference: DynamicCache | FidelityReference | Case | None = None,
    answers: list[str] | None = None,
    **options,
) -> Fidelity:
    """Measure a merged cache, or a strategy's merge, against the joined prefill.

    Parameters
    ----------
    model : LoadedModel
    fragments : list of Fragment
        What is merged; their source tokens give the joined-prefill reference.
    merged : DynamicCache, str or Strategy
        A ready cache (slot ``j`` = position ``j``, keys/values ``[1, kv_heads, kept,
        head_dim]``), or a strategy to run through :func:`kvlab.merge` (timed).
    probes : list of str
        Texts read behind each cache; their next token and continuation are compared.
    greedy_tokens : int
        Length of each greedy continuation (``0`` skips them).
    reference : DynamicCache, FidelityReference or Case, optional
        The joined prefill, when already at hand (it is never modified); a
        :class:`FidelityReference`, or a :class:`kvlab.Case` of these fragments (its
        ``reference``), also keeps its probe readings across calls.
    answers : list of str, optional
        The true answer to each probe (a probe ends with the answer's lead): each probe's row
        then also holds ``span_kl``, ``nll``, ``nll_ref`` and ``span_tokens``
        (:func:`kvlab.measure.span.span_scores`), and ``span_kl_mean`` is set.
    **options
        Passed to the strategy (``ratio=``, ``policy=`` ...); not allowed with a cache.

    Returns
    -------
    Fidelity
    """
    if not probes:
        raise MergeError("fidelity needs at least one probe text")
    if greedy_tokens < 0:
        raise MergeError(f"greedy_tokens must be >= 0, got {greedy_tokens}")
    merge_s, name, opts = None, None, {}
    if isinstance(merged, DynamicCache):
        if options:
            raise MergeError("strategy options were given with a ready cache; pass a strategy name instead")
        cache = merged
    else:
        strat = resolve(merged, **options)
        t0 = time.perf_counter()
        cache = merge(fragments, strat, model)
        merge_s = time.perf_counter() - t0
        name = strat.name
        # Every field, defaults included, so rows of one strategy line up in a table.
        opts = (
            {f.name: getattr(strat, f.name) for f in dataclasses.fields(strat)}
            if dataclasses.is_dataclass(strat)
            else {}
        )
    if isinstance(reference, Case):
        reference = reference.reference
    if not isinstance(reference, FidelityReference):
        reference = FidelityReference(
            model, reference if reference is not None else context_reference(model, fragments)
        )
    if cache.get_seq_length() != reference.cache.get_seq_length():
        raise MergeError(
            f"the merged cache holds {cache.get_seq_length()} tokens, "
            f"the joined prefill {reference.cache.get_seq_length()}"
        )
    if answers is not None and len(answers) != len(probes):
        raise MergeError(f"{len(answers)} answers for {len(probes)} probes")
    # With answers, one read gives both the greedy continuation and the answer's scores: the
    # probes, most of a read's tokens, are run once instead of twice.
    conts = None if answers is None else answer_continuations(answers)
    want = reference.reads(probes, greedy_tokens) if conts is None else reference.answered(probes, greedy_tokens, conts)
    # The joined prefill's greedy tokens are the draft: where the merge's argmax agrees with
    # them (most tokens, for a good merge), no decoding step is needed.
    got = read_probes(model, cache, probes, greedy=greedy_tokens, draft=[w.greedy for w in want], continuation=conts)
    rows = []
    agree = prefix = 0.0
    for probe, w, g in zip(probes, want, got):
        row = kl_row(model, probe, w.log_probs, g.log_probs)
        rows.append(row)
        if greedy_tokens:
            same = [a == b for a, b in zip(w.greedy, g.greedy)]
            agree += sum(same) / greedy_tokens
            prefix += (same.index(False) if False in same else greedy_tokens) / greedy_tokens
            row["greedy_ref"], row["greedy"] = model.tokenizer.decode(w.greedy), model.tokenizer.decode(g.greedy)
    span_mean = None
    if answers is not None:
        for row, w, g in zip(rows, want, got, strict=True):
            row.update(span_row(model, w, g))
        span_mean = sum(r["span_kl"] for r in rows) / len(rows)
    n = len(rows)
    kls = [r["kl"] for r in rows]
    return Fidelity(
        strategy=name,
        options=opts,
        kl_mean=sum(kls) / n,
        kl_max=max(kls),
        top1=sum(r["agree"] for r in rows) / n,
        greedy_agree=agree / n if greedy_tokens else float("nan"),
        greedy_prefix=prefix / n if greedy_tokens else float("nan"),
        greedy_tokens=greedy_tokens,
        merge_s=merge_s,
        probes=rows,
        span_kl_mean=span_mean,
    )
