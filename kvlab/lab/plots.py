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
    n_pairs = next(iter(phases_by_strategy.values()))[0].angle.shape[-1]
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

    ``phase.angle`` is ``[kv_heads, N, rotary_dim // 2]``; the band mean is over its pairs.
    """
    fig, ax = plt.subplots(figsize=(9, 3.4), constrained_layout=True)
    for band, sl in band_slices(phase.angle.shape[-1]).items():
        # Masked pairs are NaN; a position with every pair of the band masked stays a gap.
        err = phase.angle[head][:, sl].double().nanmean(-1).cpu().numpy()
        ax.plot(phase.positions.cpu().numpy(), np.maximum(err, 1e-9), label=f"{band}-frequency pairs")
    _boundaries(ax, landings)
    ax.set_yscale("log")
    ax.set_xlabel("position in merged cache (tokens)")
    ax.set_ylabel("mean phase error (rad)")
    ax.set_title(title)
    ax.legend()
    return fig


def phase_by_band_bars(phases_by_strategy: dict[str, list[LayerPhase]], model_name: str) -> Figure:
    """Mean phase error per layer type and frequency band, as bars (radians, log scale)."""
    layer_types = sorted({p.layer_type for ps in phases_by_strategy.values() for p in ps})
    fig, ax = plt.subplots(figsize=(8, 3.6), constrained_layout=True)
    width = 0.8 / max(1, len(phases_by_strategy))
    first = next(iter(phases_by_strategy.values()))
    groups = [
        (lt, band, sl)
        for lt in layer_types
        for band, sl in band_slices(next(p for p in first if p.layer_type == lt).angle.shape[-1]).items()
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


def kv_heatmap(
    diffs: list[LayerDiff],
    model_name: str,
    strategy: str,
    reference: str,
    landings: list[int],
    layer: int | None = None,
    vmin: float = 1e-7,
    vmax: float | None = None,
) -> Figure:
    """|K - ref| and |V - ref| heatmaps (log colour scale), max over head_dim.

    With ``layer=None`` the grid is layer x position (max over heads); with a layer index
    it is head x position for that layer. Blank cells: tokens a sliding layer no longer holds.
    """
    fig, axes = plt.subplots(1, 2, figsize=(13, 3.8), constrained_layout=True)
    for ax, which in zip(axes, ("k", "v")):
        if layer is None:
            grid = layer_position_grid(diffs, which).numpy()
            ylabel = "layer"
        else:
            d = diffs[layer]
            n = int(d.positions[-1]) + 1
            grid = np.full((d.k.shape[0], n), np.nan)
            grid[:, d.positions.numpy()] = getattr(d, which).numpy()
            ylabel = f"KV head (layer {layer})"
        shown = np.where(np.isnan(grid), np.nan, np.maximum(grid, vmin))
        top = vmax or max(float(np.nanmax(shown)), vmin * 10)
        im = ax.imshow(shown, aspect="auto", interpolation="nearest", cmap="magma", norm=LogNorm(vmin=vmin, vmax=top))
        _boundaries(ax, landings)
        ax.set_xlabel("position in merged cache (tokens)")
        ax.set_ylabel(ylabel)
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_title(f"|{which.upper()} - {reference}|")
        fig.colorbar(im, ax=ax, label=f"max |Δ{which.upper()}| over head_dim (activation units)")
    fig.suptitle(f"{model_name}: {strategy} vs {reference}")
    return fig


def error_budget(budget: dict[str, dict[str, np.ndarray]], model_name: str) -> Figure:
    """Per-layer K error norms: total (vs joined prefill) against phase + context.

    Parameters
    ----------
    budget : dict
        strategy -> {"total": [layers], "phase": [layers], "context": [layers]} Frobenius norms.
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
    axes[0][0].set_ylabel("Frobenius norm of ΔK (activation units)")
    axes[0][-1].legend(loc="lower right", fontsize=8)
    fig.suptitle(f"{model_name}: error budget per layer, fragments after the first")
    return fig
