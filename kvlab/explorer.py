"""An ipywidgets explorer: pick a merge strategy, fragments, model, layer and head; see
the phase error, the |K - ref| heatmap and the next-token KL update.

``MergeExplorer`` keeps everything it shows in ``.state`` and ``.figures`` so tests can
drive it by setting widget values, with or without a browser.
"""
from __future__ import annotations

import contextlib
import dataclasses
import html
import io

import ipywidgets as W
import matplotlib.pyplot as plt

from .case import DEFAULT_PROBES, DEFAULT_TEXTS, Case
from .errors import KvlabError
from .merge import merge
from .metrics import kv_diff, max_phase_error, next_token_kl, phase_beyond_rounding, phase_error, weighted_phase_error
from .models import DEFAULT_MODEL, LoadedModel
from .sources import load_model
from .plots import kv_heatmap, phase_vs_position_head
from .strategies import STRATEGIES, strategy_names


class MergeExplorer:
    """Widgets to switch merge strategy and watch what changes.

    Parameters
    ----------
    model : str or LoadedModel
        Starting model.
    texts : list of str
        Fragment texts (one text box each).
    probes : list of str
        Probe texts for the next-token KL table.
    models : list of str
        Choices of the model dropdown.
    """

    def __init__(self, model: str | LoadedModel = DEFAULT_MODEL, texts: list[str] | None = None,
                 probes: list[str] | None = None, models: list[str] | None = None):
        self._models: dict[str, LoadedModel] = {}
        if isinstance(model, LoadedModel):
            self._models[model.name] = model
            model = model.name
        self.probes = list(probes or DEFAULT_PROBES)
        texts = list(texts or DEFAULT_TEXTS)
        choices = list(dict.fromkeys([model] + list(models or [DEFAULT_MODEL, "tiny-llama", "tiny-gemma3"])))
        self.strategy = W.Dropdown(options=strategy_names(), value="naive", description="strategy")
        self.model = W.Dropdown(options=choices, value=model, description="model")
        # continuous_update=False: a text change re-prefills every fragment and a ratio change
        # runs the model, so they act when typing stops or the slider is let go, not per key.
        self.texts = [W.Textarea(value=t, description=f"fragment {i}", layout=W.Layout(width="95%"),
                                 continuous_update=False) for i, t in enumerate(texts)]
        self.layer = W.IntSlider(min=0, max=1, value=0, description="layer", continuous_update=False)
        self.head = W.IntSlider(min=0, max=0, value=0, description="KV head", continuous_update=False)
        self.ratio = W.FloatSlider(min=0.0, max=1.0, step=0.05, value=0.15, description="recompute r",
                                   continuous_update=False)
        self.readout = W.HTML()
        self.table = W.HTML()
        # Figures are shown as PNG bytes in Image widgets: plain widget state that any front end
        # draws whenever it renders the explorer (an Output widget capturing display() lost the
        # first render in JupyterLab, and left the inline backend to print stray copies).
        self.images = {"phase": W.Image(format="png"), "heatmap": W.Image(format="png")}
        self.plots = W.VBox(list(self.images.values()))
        self.state: dict = {}
        self.figures: dict = {}
        self._key = None
        self._draw = True
        for w in [self.strategy, self.model, self.ratio, *self.texts]:
            w.observe(self._on_input, names="value")
        for w in (self.layer, self.head):
            w.observe(self._on_view, names="value")
        self._recompute_inputs()
        self.widget = W.VBox([
            W.HBox([self.model, self.strategy, self.ratio]), *self.texts, W.HBox([self.layer, self.head]),
            self.readout, self.plots, self.table,
        ])
        self._sync_ratio_visibility()

    # -- computation -----------------------------------------------------------------

    def _get_model(self) -> LoadedModel:
        name = self.model.value
        if name not in self._models:
            self._models[name] = load_model(name)
        return self._models[name]

    def _options(self) -> dict:
        cls = STRATEGIES[self.strategy.value]
        return {"ratio": self.ratio.value} if "ratio" in getattr(cls, "__dataclass_fields__", {}) else {}

    def _recompute_inputs(self) -> None:
        m = self._get_model()
        key = (m.name, tuple(t.value for t in self.texts))
        if key != self._key:
            self._key = key
            # No render of the old model's merge while the sliders' ranges change below.
            self.merged = None
            self.case = Case.from_texts(m, [t.value for t in self.texts], self.probes)
            self.frags, self.phase_ref, self.joined = self.case.fragments, self.case.phase, self.case.context
            self.joined_dists = self.case.context_dists
            self.landings = self.case.landings
            # Lowering max clamps value (ipywidgets validates it).
            self.layer.max = len(self.phase_ref.layers) - 1
            self.head.max = self.phase_ref.layers[0].keys.shape[1] - 1
        self._merge()

    def _merge(self) -> None:
        m = self._get_model()
        name = self.strategy.value
        self.state = {"model": m.name, "strategy": name, "options": self._options()}
        try:
            self.merged = merge(self.frags, name, m, **self._options())
        except KvlabError as e:
            self.merged = None
            self.state["refused"] = str(e)
            self._render()
            return
        self.phases = phase_error(self.merged, self.phase_ref, m)
        self.diffs = kv_diff(self.merged, self.phase_ref)
        self.kl = next_token_kl(m, self.merged, self.joined, self.probes, self.joined_dists)
        self.state["max_phase_error"] = max_phase_error(self.phases)
        self.state["weighted_phase_error"] = weighted_phase_error(self.phases)
        self.state["phase_beyond_rounding"] = phase_beyond_rounding(self.phases)
        self.state["kl"] = [r["kl"] for r in self.kl]
        self.state["top1_agree"] = sum(r["agree"] for r in self.kl)
        self._render()

    # -- display ---------------------------------------------------------------------

    def _on_input(self, change) -> None:
        self._sync_ratio_visibility()
        self._recompute_inputs()

    def _on_view(self, change) -> None:
        if self.merged is not None:
            self._render()

    def _sync_ratio_visibility(self) -> None:
        self.ratio.layout.display = None if self._options() else "none"

    def _render(self) -> None:
        self.figures = {}
        if "refused" in self.state:
            self.readout.value = f"<b>{self.state['strategy']} refused:</b> {html.escape(self.state['refused'])}"
            self.table.value = ""
            if self._draw:
                self.plots.layout.display = "none"
            return
        li, hi = self.layer.value, self.head.value
        p = self.phases[li]
        head_err = max_phase_error([dataclasses.replace(p, angle=p.angle[hi : hi + 1])])
        self.state.update(layer=li, head=hi, max_phase_error_layer_head=head_err)
        self.readout.value = (
            f"<b>{self.state['model']} / {self.state['strategy']}</b>: max phase error over all layers "
            f"<span class='kvlab-max-phase'>{self.state['max_phase_error']:.3e}</span> rad; layer {li}, head {hi}: "
            f"{head_err:.3e} rad; top-1 agreement with the joined prefill {self.state['top1_agree']}/{len(self.kl)}"
        )
        rows = "".join(
            f"<tr><td>{html.escape(r['probe'])}</td><td>{r['kl']:.4f}</td><td>{html.escape(r['top1_ref'])}</td>"
            f"<td>{html.escape(r['top1'])}</td><td>{'yes' if r['agree'] else 'no'}</td></tr>" for r in self.kl
        )
        self.table.value = ("<table><tr><th>probe</th><th>KL (nats)</th><th>top-1 joined</th><th>top-1 merged</th>"
                            f"<th>agree</th></tr>{rows}</table>")
        if not self._draw:
            return  # hold_drawing() renders once, figures included, when it ends
        title = (f"{self.state['model']} / {self.state['strategy']}: phase error, layer {li} ({p.layer_type}), "
                 f"head {hi}")
        self.figures["phase"] = phase_vs_position_head(p, hi, title, self.landings)
        self.figures["heatmap"] = kv_heatmap(self.diffs, self.state["model"], self.state["strategy"], "phase ref",
                                             self.landings, layer=li)
        for fig in self.figures.values():
            plt.close(fig)  # off pyplot's list, so the inline backend does not print them below the cell
        self._draw_figures()

    def _draw_figures(self) -> None:
        for name, fig in self.figures.items():
            buf = io.BytesIO()
            fig.savefig(buf, format="png", bbox_inches="tight")
            self.images[name].value = buf.getvalue()
        self.plots.layout.display = None

    @contextlib.contextmanager
    def hold_drawing(self):
        """Update state, readout and figures without drawing into the notebook (for scripted runs)."""
        self._draw = False
        try:
            yield self
        finally:
            self._draw = True
            self._render()  # show what the state now says

    def _ipython_display_(self):
        from IPython.display import display

        display(self.widget)
