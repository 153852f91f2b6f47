"""The field audit's figure: kvlab's verdict per operation and model (notebook 09)."""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.colors import ListedColormap
from matplotlib.figure import Figure
from matplotlib.patches import Patch

#: The field audit's verdicts, in the order of :data:`kvlab.findings.field.VERDICTS`, and their colours.
VERDICT_COLOURS = ("#3a923a", "#e69a28", "#c8372d", "#9a9a9a")


def field_verdicts(ops: list[str], models: list[str], grid: list[list[str | None]], verdicts: tuple) -> Figure:
    """The field audit's verdict per operation (rows) and model (columns); blank where a cell was not run.

    Parameters
    ----------
    ops, models : list of str
        Row and column labels.
    grid : list of list of str or None
        ``[len(ops)][len(models)]`` verdicts, each one of ``verdicts`` or None.
    verdicts : tuple of str
        The verdict names, in the order of :data:`VERDICT_COLOURS`.
    """
    code = np.full((len(ops), len(models)), np.nan)
    for i, row in enumerate(grid):
        for j, v in enumerate(row):
            if v is not None:
                code[i, j] = verdicts.index(v)
    fig, ax = plt.subplots(figsize=(1.0 + 0.7 * len(models), 0.9 + 0.32 * len(ops)), constrained_layout=True)
    cmap = ListedColormap(VERDICT_COLOURS[: len(verdicts)])
    ax.imshow(np.ma.masked_invalid(code), cmap=cmap, vmin=-0.5, vmax=len(verdicts) - 0.5, aspect="auto")
    ax.set_xticks(range(len(models)), models, rotation=45, ha="right", fontsize=8)
    ax.set_yticks(range(len(ops)), ops, fontsize=7)
    ax.set_xlabel("model (tiny: built from a config; the real ones from their PyPI packages)")
    ax.set_ylabel("package: operation @ transformers release")
    ax.set_title("The field audited: kvlab's verdict per operation and model (blank: not in the grid)")
    ax.legend(
        handles=[Patch(color=c, label=v) for c, v in zip(VERDICT_COLOURS, verdicts, strict=True)],
        loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8, title="verdict",
    )  # fmt: skip
    return fig
