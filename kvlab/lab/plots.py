"""matplotlib figures for the notebooks; each function returns its Figure.

Every figure names the model and strategy in its title, labels its axes with units and,
for heatmaps, carries a colour bar.
"""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.colors import LogNorm
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from kvlab.measure.metrics import LayerDiff, LayerPhase, layer_position_grid, phase_by_position


def band_slices(n_pairs: int) -> dict[str, slice]:
    """Rotary pairs ``0..n_pairs-1`` are ordered fast to slow; split them into thirds: high, mid, low."""
    a, b = n_pairs // 3, 2 * n_pairs // 3
    return {"high": slice(0, a), "mid": slice(a, b), "low": slice(b, n_pairs)}


def _boundaries(ax, landings):
    for x in landings[1:]:
        ax.axvline(x - 0.5, color="0.5", lw=0.8, ls=":")


def phase_vs_position(
    phases_by_strategy: dict[str, list[LayerPhase]], model_name: str, landings: list[int], layer_type: str | None = None
) -> Figure:
    """Mean phase error (radians, log scale) against position, one panel per frequency band.

    Parameters
    ----------
    phases_by_strategy : dict
        strategy name -> :func:`kvlab.measure.metrics.phase_error` output.
    landings : list of int
        First position of each fragment (drawn as dotted lines).
    """
    # NoPE layers have no pairs: the bands are the rotary layers'.
    n_pairs = next(p for p in next(iter(phases_by_strategy.values())) if not p.nope).angle.shape[-1]
    bands = band_slices(n_pairs)
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6), sharey=True, constrained_layout=True)
    for ax, (band, sl) in zip(axes, bands.items()):
        for name, phases in phases_by_strategy.items():
            pos, err = phase_by_position(phases, layer_type=layer_type, band=sl)
            ax.plot(
                pos.numpy(), np.maximum(err.numpy(), 1e-9), label=name, lw=1.2
            )  # NaN (masked, not held) stays a gap
        _boundaries(ax, landings)
        ax.set_yscale("log")
        ax.set_title(f"{band}-frequency pairs ({sl.stop - sl.start} of {n_pairs})")
        ax.set_xlabel("position in merged cache (tokens)")
    axes[0].set_ylabel("mean phase error (rad)")
    axes[-1].legend(loc="lower right")
    where = f", {layer_type} layers" if layer_type else ""
    fig.suptitle(f"{model_name}: phase error vs position, {' vs '.join(phases_by_strategy)}{where}")
    return fig


def phase_vs_position_head(phase: LayerPhase, head: int, title: str, landings: list[int]) -> Figure:
    """Mean phase error (radians, log scale) against position for one layer and KV head, one line per band.

    ``phase.angle`` is ``[kv_heads, N, rotary_dim // 2]``; the band mean is over its pairs. A NoPE
    layer has no pairs, so no phase to be wrong: the panel says so (its context error is in |K - ref|).
    """
    fig, ax = plt.subplots(figsize=(9, 3.4), constrained_layout=True)
    ax.set_xlabel("position in merged cache (tokens)")
    ax.set_ylabel("mean phase error (rad)")
    ax.set_title(title)
    if phase.nope:
        ax.text(
            0.5,
            0.5,
            f"{phase.kind}: no rotary embedding on this layer, so no phase to be wrong\n"
            "(its keys differ from the reference by context only: see |K - ref|)",
            ha="center",
            va="center",
            transform=ax.transAxes,
        )
        return fig
    for band, sl in band_slices(phase.angle.shape[-1]).items():
        # Masked pairs are NaN; a position with every pair of the band masked stays a gap.
        err = phase.angle[head][:, sl].double().nanmean(-1).cpu().numpy()
        ax.plot(phase.positions.cpu().numpy(), np.maximum(err, 1e-9), label=f"{band}-frequency pairs")
    _boundaries(ax, landings)
    ax.set_yscale("log")
    ax.legend()
    return fig


def phase_by_band_bars(phases_by_strategy: dict[str, list[LayerPhase]], model_name: str) -> Figure:
    """Mean phase error per layer type and frequency band, as bars (radians, log scale)."""
    layer_types = sorted({p.layer_type for ps in phases_by_strategy.values() for p in ps if not p.nope})
    fig, ax = plt.subplots(figsize=(8, 3.6), constrained_layout=True)
    width = 0.8 / max(1, len(phases_by_strategy))
    first = next(iter(phases_by_strategy.values()))
    groups = [
        (lt, band, sl)
        for lt in layer_types
        for band, sl in band_slices(next(p for p in first if p.layer_type == lt and not p.nope).angle.shape[-1]).items()
    ]
    labels = [f"{lt.split('_')[0]}\n{band}" for lt, band, _ in groups]
    for si, (name, phases) in enumerate(phases_by_strategy.items()):
        vals = [
            max(float(np.nanmean(phase_by_position(phases, layer_type=lt, band=sl)[1].numpy())), 1e-9)
            for lt, _, sl in groups
        ]
        ax.bar(np.arange(len(vals)) + si * width, vals, width, label=name)
    ax.set_xticks(np.arange(len(labels)) + width * (len(phases_by_strategy) - 1) / 2, labels)
    ax.set_yscale("log")
    ax.set_ylabel("mean phase error (rad)")
    ax.set_xlabel("layer type / rotary frequency band")
    ax.legend()
    ax.set_title(f"{model_name}: phase error by layer type and band")
    return fig


def _heat_grid(diffs: list[LayerDiff], which: str, layer: int | None) -> tuple[np.ndarray, str]:
    """``[rows, positions]`` max |Δ| over head_dim: layer x position (max over heads), or head x position of ``layer``."""
    if layer is None:
        return layer_position_grid(diffs, which).numpy(), "layer"
    d = diffs[layer]
    grid = np.full((d.k.shape[0], int(d.positions[-1]) + 1), np.nan)
    grid[:, d.positions.numpy()] = getattr(d, which).numpy()
    return grid, f"KV head (layer {layer})"


def kv_heatmaps(
    rows: dict[str, list[LayerDiff]],
    model_name: str,
    reference: str,
    landings: list[int],
    layer: int | None = None,
    vmin: float = 1e-7,
    vmax: float | None = None,
) -> Figure:
    """|K - ref| and |V - ref| heatmaps of several merges on one shared log colour scale.

    One row per merge (``rows``: label -> its :func:`kvlab.measure.metrics.kv_diff`), K left and
    V right, all panels on the same colour scale so that they can be compared cell by cell.
    Values below ``vmin``, exact zeros among them, are drawn at ``vmin``: the floor the colour
    bar labels. Blank cells: tokens a sliding layer no longer holds.
    """
    grids = {(label, which): _heat_grid(d, which, layer) for label, d in rows.items() for which in ("k", "v")}
    top = vmax or max([float(np.nanmax(np.maximum(g, vmin))) for g, _ in grids.values()] + [vmin * 10])
    norm = LogNorm(vmin=vmin, vmax=top)
    fig, axes = plt.subplots(
        len(rows), 2, figsize=(13, 3.4 * len(rows)), constrained_layout=True, squeeze=False, sharex=True
    )
    for r, label in enumerate(rows):
        for ax, which in zip(axes[r], ("k", "v")):
            grid, ylabel = grids[label, which]
            shown = np.where(np.isnan(grid), np.nan, np.maximum(grid, vmin))
            im = ax.imshow(shown, aspect="auto", interpolation="nearest", cmap="magma", norm=norm)
            _boundaries(ax, landings)
            ax.set_ylabel(ylabel)
            ax.yaxis.set_major_locator(MaxNLocator(integer=True))
            ax.set_title(f"{label}: |{which.upper()} - {reference}|")
    for ax in axes[-1]:
        ax.set_xlabel("position in merged cache (tokens)")
    bar = fig.colorbar(
        im, ax=axes, label=f"max |ΔK|, |ΔV| over head_dim\n(activation units; floor {vmin:g} includes 0)"
    )
    bar.ax.axhline(vmin, color="c", lw=2)
    fig.suptitle(f"{model_name}: {', '.join(rows)} vs {reference} (one colour scale)")
    return fig


def error_budget(budget: dict[str, dict[str, np.ndarray]], model_name: str) -> Figure:
    """Per-layer relative K errors: total (vs joined prefill) against phase and context.

    Parameters
    ----------
    budget : dict
        strategy -> {"total": [layers], "phase": [layers], "context": [layers]}: Frobenius norms
        of the key differences, each divided by that layer's norm of the joined prefill's keys.
        Values below 1e-9 (exact zeros) are drawn on the floor.
    """
    fig, axes = plt.subplots(
        1, len(budget), figsize=(5 * len(budget), 3.6), sharey=True, constrained_layout=True, squeeze=False
    )
    for ax, (name, b) in zip(axes[0], budget.items()):
        x = np.arange(len(b["total"]))
        ax.plot(x, np.maximum(b["total"], 1e-9), "k-", lw=2, label="total: |K - joined|")
        ax.plot(x, np.maximum(b["phase"], 1e-9), "C0--", label="phase: |K - phase ref|")
        ax.plot(x, np.maximum(b["context"], 1e-9), "C1:", lw=2, label="context: |phase ref - joined|")
        ax.set_yscale("log")
        ax.set_xlabel("layer")
        ax.set_title(name)
    axes[0][0].set_ylabel("‖ΔK‖ / ‖K_joined‖ per layer (floor 1e-9: 0)")
    axes[0][-1].legend(loc="lower right", fontsize=8)
    fig.suptitle(f"{model_name}: error budget per layer, fragments after the first")
    return fig


def reader_kl(rows: dict, ci: dict, model_name: str, n_caches: int, kinds: list[str], seed: int = 0) -> Figure:
    """Per-question first-token and answer-span KL of each same-shape reader behind the producer's caches.

    Two panels on one log scale (nats): the first answer token's KL, and the answer-span KL per
    token. Each question is a dot coloured by its kind; the black square and bar are the mean
    and its 95% interval over caches. Exact zeros (an fp16 reader can land on them) are drawn
    on a labelled floor line.

    Parameters
    ----------
    rows : dict
        reader kind -> list of dict with ``kl``, ``span_kl`` and ``kind`` (one per question).
    ci : dict
        ``(reader, "kl")`` and ``(reader, "span_kl")`` -> :class:`kvlab.CI`.
    n_caches : int
        Independent caches behind the questions (for the title).
    kinds : list of str
        The question kinds, in legend order.
    seed : int
        Seeds the horizontal jitter of the dots.
    """
    fig, axes = plt.subplots(1, 2, figsize=(12, 4), sharey=True, constrained_layout=True)
    floor = 1e-8
    rng = np.random.default_rng(seed)
    for ax, metric, label in zip(axes, ("kl", "span_kl"), ("first answer token", "answer span, per token")):
        for i, (reader, rs) in enumerate(rows.items()):
            for j, kind in enumerate(kinds):
                v = np.maximum([r[metric] for r in rs if r["kind"] == kind], floor)
                ax.plot(
                    i + rng.uniform(-0.2, 0.2, v.size), v, ".", color=f"C{j}", alpha=0.4, label=kind if i == 0 else None
                )
            c = ci[reader, metric]
            mean, lo, hi = (max(x, floor) for x in (c.mean, c.lo, c.hi))
            ax.errorbar([i + 0.32], [mean], yerr=[[mean - lo], [hi - mean]], fmt="s", color="k", capsize=4)
        ax.axhline(floor, color="grey", lw=0.8, ls=":", label=f"exact 0 (drawn at {floor:g})")
        ax.set(xticks=range(len(rows)), xticklabels=list(rows), yscale="log", xlabel="same-shape reader", title=label)
    axes[0].set_ylabel("KL(own || foreign), nats")
    axes[1].legend(title="question kind", fontsize=8, loc="lower right")
    n = sum(len(rs) for rs in rows.values()) // max(1, len(rows))
    fig.suptitle(
        f"{model_name}: readers behind the producer's caches, {n} questions, {n_caches} caches (black: mean, 95% CI)"
    )
    return fig


def _recompute_label(policy: str, ratio: float) -> str:
    return f"{policy} r={ratio:g}"


def fidelity_vs_cost(ci: dict, cost: dict, policies: list[str], ratios: list[float], model_name: str) -> Figure:
    """Recompute's KL and answer agreement against its ratio, and KL against measured cost.

    Three panels: mean next-token KL (nats) against the recompute ratio, the fraction of
    answers agreeing with reprefill against the ratio (both with 95% CI bands), and mean KL
    against warm merge time as a fraction of reprefill's (log scale). ``naive`` and
    ``rerotate`` are the dashed references; the dotted line is 10% of rerotate's KL (the gap).

    Parameters
    ----------
    ci : dict
        ``(label, metric) -> CI`` for metrics ``"kl"``, ``"agree"`` and ``"em"``; labels are
        ``"naive"``, ``"rerotate"``, ``"reprefill"`` and ``f"{policy} r={ratio:g}"``.
    cost : dict
        label -> warm merge time as a fraction of reprefill's.
    """
    gap, n = ci["rerotate", "kl"].mean, ci["rerotate", "kl"].n
    fig, axes = plt.subplots(1, 3, figsize=(15, 3.9), constrained_layout=True)
    for i, policy in enumerate(policies):
        c = f"C{i}"
        kl = [ci[_recompute_label(policy, r), "kl"] for r in ratios]
        ag = [ci[_recompute_label(policy, r), "agree"] for r in ratios]
        for ax, vals in ((axes[0], kl), (axes[1], ag)):
            ax.plot(ratios, [v.mean for v in vals], "o-", color=c, label=policy)
            ax.fill_between(ratios, [v.lo for v in vals], [v.hi for v in vals], color=c, alpha=0.15)
        costs = [cost[_recompute_label(policy, r)] for r in ratios]
        yerr = [[k.mean - k.lo for k in kl], [k.hi - k.mean for k in kl]]
        axes[2].errorbar(costs, [k.mean for k in kl], yerr=yerr, fmt="o-", color=c, capsize=3, label=policy)
    for name, colour in (("naive", "C3"), ("rerotate", "k")):
        axes[0].axhline(ci[name, "kl"].mean, color=colour, ls="--", label=name)
        axes[1].axhline(ci[name, "agree"].mean, color=colour, ls="--", label=name)
        axes[2].plot([cost[name]], [ci[name, "kl"].mean], "s", color=colour, label=name)
    for ax in (axes[0], axes[2]):
        ax.axhline(0.1 * gap, color="0.5", ls=":", label="10% of the gap")
    axes[1].axhline(ci["reprefill", "em"].mean, color="C2", ls=":", label="reprefill exact match (ceiling)")
    axes[0].set(
        xlabel="recompute ratio r (fraction of tokens)",
        ylabel="mean next-token KL (nats)",
        title=f"{model_name}: KL vs ratio, 95% CI (n={n})",
    )
    axes[1].set(
        xlabel="recompute ratio r (fraction of tokens)",
        ylabel="answers agreeing with reprefill (fraction)",
        title=f"{model_name}: answer agreement, 95% CI",
        ylim=(-0.05, 1.05),
    )
    axes[2].set(
        xscale="log",
        xlabel="warm merge time (fraction of reprefill)",
        ylabel="mean next-token KL (nats)",
        title=f"{model_name}: KL vs measured cost (reprefill = 1, KL 0)",
    )
    for ax in axes:
        ax.legend(fontsize=7)
    return fig


def engine_merge_kl(rows: list, model_name: str) -> Figure:
    """Next-token KL (nats) of each merge against its engine's joined prefill, as bars with 95% CI.

    Parameters
    ----------
    rows : list
        :class:`kvlab.peers.merges.MergeRow` s (``engine``, ``method``, ``reference``,
        ``kl_mean``, ``kl_ci``); the rows against the joined prefill and the engines' own
        joined-prefill comparison (engine ``"both"``) are drawn.
    """
    shown = [r for r in rows if r.reference == "joined" or r.engine == "both"]
    fig, ax = plt.subplots(figsize=(8, 3.2))
    x = np.arange(len(shown))
    err = np.array([[r.kl_mean - r.kl_ci[0], r.kl_ci[1] - r.kl_mean] for r in shown]).T
    colours = {"llama.cpp": "tab:orange", "kvlab": "tab:blue"}
    ax.bar(x, [r.kl_mean for r in shown], yerr=err, color=[colours.get(r.engine, "tab:gray") for r in shown], capsize=3)
    ax.set_xticks(x, [f"{r.engine}\n{r.method}" for r in shown], fontsize=8)
    ax.set_xlabel("engine / merge method")
    ax.set_ylabel("next-token KL vs joined prefill (nats)")
    ax.set_title(f"{model_name}: merges in llama.cpp (orange) and kvlab (blue); grey: engines' joined prefills")
    fig.tight_layout()
    return fig


def long_context_phase(
    profile: list, landings: list[int], total: int, model_name: str, fragment_tokens: int, window: int | None = None
) -> Figure:
    """Mean phase error (radians) against position of a naive and a re-rotated merge, per layer type.

    Parameters
    ----------
    profile : list
        :class:`kvlab.findings.longctx.PhaseProfile` s, one per layer type.
    landings : list of int
        First position of each fragment (grey lines).
    total : int
        Tokens in the merge; with a sliding ``window`` the positions its layers keep are shaded.
    fragment_tokens : int
        The passages' length cap (for the title).
    """
    fig, ax = plt.subplots(figsize=(12, 3.8), constrained_layout=True)
    for p in profile:
        ax.plot(p.positions, p.naive, lw=0.9, label=f"naive, {p.layer_type}")
        ax.plot(p.positions, p.rerotate, lw=0.9, ls="--", label=f"rerotate, {p.layer_type}")
    for a in landings[1:]:
        ax.axvline(a, color="0.8", lw=0.6)
    if window is not None and total > window - 1:
        ax.axvspan(
            total - (window - 1), total, color="C2", alpha=0.08, label=f"kept by sliding layers (last {window - 1})"
        )
    ax.set(
        xlabel="position in the merged cache (tokens)",
        ylabel="mean phase error (rad)",
        title=f"{model_name}: phase error vs position, {len(landings)} fragments of ≤{fragment_tokens} tokens "
        "(grey: fragment starts)",
    )
    ax.legend(fontsize=8)
    return fig


def _errorbar(ax, x, cis: list, **kw) -> None:
    y = np.array([c.mean for c in cis])
    ax.errorbar(x, y, yerr=np.array([[c.mean - c.lo for c in cis], [c.hi - c.mean for c in cis]]), capsize=3, **kw)


def long_context_answers(
    summary: list[dict], by_offset: list[dict], strategies: list[str], model_name: str, fragment_tokens: int
) -> Figure:
    """Answer-span KL and exact match against fragment count, and exact match by landing offset (95% CI over caches).

    Parameters
    ----------
    summary : list of dict
        :func:`kvlab.findings.longctx.summarize` rows by (``n_fragments``, ``strategy``), each
        with ``span_kl`` and ``em`` CIs.
    by_offset : list of dict
        The same at the largest fragment count, by (``answer_passage``, ``strategy``): the passage
        holding the answer, which lands at the same place in every set.
    strategies : list of str
        In drawing order; points of a strategy are nudged sideways so the intervals do not overlap.
    """
    counts = sorted({r["n_fragments"] for r in summary})
    offsets = sorted({r["answer_passage"] for r in by_offset})
    fig, axes = plt.subplots(1, 3, figsize=(15, 3.8), constrained_layout=True)
    for i, s in enumerate(strategies):
        pts = sorted(((r["n_fragments"], r) for r in summary if r["strategy"] == s), key=lambda p: p[0])
        x = np.array([p[0] for p in pts]) + (i - 1.5) * 0.05
        for ax, m in zip(axes[:2], ("span_kl", "em")):
            _errorbar(ax, x, [p[1][m] for p in pts], fmt="o-", label=s)
        po = sorted(((r["answer_passage"], r) for r in by_offset if r["strategy"] == s), key=lambda p: p[0])
        xo = np.array([p[0] for p in po]) + (i - 1.5) * 0.05
        _errorbar(axes[2], xo, [p[1]["em"] for p in po], fmt="o", label=s)
    axes[0].set(
        xlabel=f"fragments of ≤{fragment_tokens} tokens",
        ylabel="answer-span KL vs joined prefill (nats/token)",
        title=f"{model_name}: answer-span KL (95% CI over caches)",
        xticks=counts,
    )
    axes[1].set(
        xlabel=f"fragments of ≤{fragment_tokens} tokens",
        ylabel="exact match with the truth (fraction)",
        title=f"{model_name}: exact match (reprefill: the ceiling)",
        xticks=counts,
        ylim=(-0.05, 1.05),
    )
    axes[2].set(
        xlabel=f"passage holding the answer (index; lands after about index × {fragment_tokens} tokens)",
        xticks=offsets,
        ylabel="exact match with the truth (fraction)",
        title=f"{model_name}: by offset, {max(counts)} fragments",
        ylim=(-0.05, 1.05),
    )
    axes[0].legend(fontsize=8)
    return fig
