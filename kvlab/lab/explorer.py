"""An ipywidgets explorer: pick a merge strategy (and a recompute ratio and policy), 2 to 8
fragments, model, layer type, layer and head; see the phase error, the |K - ref| heatmap and
the next-token KL update.

``MergeExplorer`` keeps everything it shows in ``.state`` and ``.figures`` so tests can
drive it by setting widget values, with or without a browser. Work that runs longer than
``progress_after`` seconds (a long merge, a recompute, a new model) shows a progress bar
named for its current step, hidden again once the change is drawn.
"""

from __future__ import annotations

import contextlib
import html
import io
import math
import time

import ipywidgets as W
import matplotlib.pyplot as plt

from kvlab.cache.fragments import prefill
from kvlab.cache.merge import merge
from kvlab.cache.recompute.strategy import POLICIES
from kvlab.cache.strategies import STRATEGIES, strategy_names
from kvlab.errors import KvlabError
from kvlab.lab.plots import kv_heatmaps, phase_vs_position_head
from kvlab.measure.case import DEFAULT_PROBES, DEFAULT_TEXTS, Case
from kvlab.measure.metrics import (
    kv_diff,
    max_phase_error,
    next_token_kl,
    phase_beyond_rounding,
    phase_error,
    weighted_phase_error,
)
from kvlab.models.layout import layer_ropes
from kvlab.models.loaded import DEFAULT_MODEL, LoadedModel
from kvlab.models.sources import load_model

#: How many fragments the explorer merges, at least and at most.
MIN_FRAGMENTS, MAX_FRAGMENTS = 2, 8
#: Texts a new fragment box starts with (cycled): longer merges move later fragments to
#: larger offsets, where a naive merge's phase error grows.
PRESET_TEXTS = [
    " The museum opened a second room for the keeper's charts in 1923, after a storm.",
    " A fisherman's diary from the same winter names three of the ships he counted.",
    " The lamp itself was replaced by an electric light, and the old lens went to Oslo.",
    " Visitors can still read the last page, dated the first of March, in his hand.",
    " Maren's own notes, kept in the margin, record the weather on each of those days.",
    " The island has had no keeper since 1978; the light runs itself from the mainland.",
]
ALL_LAYERS = "all layers"
#: Seconds a change may work before its progress bar shows: quicker changes would only flicker it.
PROGRESS_AFTER_S = 0.3


class MergeExplorer:
    """Widgets to switch merge strategy and watch what changes.

    Parameters
    ----------
    model : str or LoadedModel
        Starting model.
    texts : list of str
        Fragment texts (one text box each), 2 to 8; boxes can be added and removed.
    probes : list of str
        Probe texts for the next-token KL table.
    models : list of str
        Choices of the model dropdown.
    progress_after : float
        Seconds a change works before its progress bar shows (0: always shown while working).

    Attributes
    ----------
    draws : int
        How many times the figures were drawn: one per change (tests count redraws with it).
    work : dict
        The last change's work: ``steps`` (labels, in order), ``seconds`` and ``shown`` (whether
        its progress bar appeared).
    """

    def __init__(
        self,
        model: str | LoadedModel = DEFAULT_MODEL,
        texts: list[str] | None = None,
        probes: list[str] | None = None,
        models: list[str] | None = None,
        progress_after: float = PROGRESS_AFTER_S,
    ):
        if isinstance(progress_after, bool) or not (isinstance(progress_after, (int, float)) and progress_after >= 0):
            raise KvlabError(f"progress_after must be seconds >= 0, got {progress_after!r}")
        self.progress_after = float(progress_after)
        self._models: dict[str, LoadedModel] = {}
        if isinstance(model, LoadedModel):
            self._models[model.name] = model
            model = model.name
        self.probes = list(probes or DEFAULT_PROBES)
        texts = list(texts or DEFAULT_TEXTS)
        if not MIN_FRAGMENTS <= len(texts) <= MAX_FRAGMENTS:
            raise KvlabError(
                f"the explorer merges {MIN_FRAGMENTS} to {MAX_FRAGMENTS} fragments, got {len(texts)} texts"
            )
        choices = list(dict.fromkeys([model] + list(models or [DEFAULT_MODEL, "tiny-llama", "tiny-gemma3"])))
        self.strategy = W.Dropdown(options=strategy_names(), value="naive", description="strategy")
        self.model = W.Dropdown(options=choices, value=model, description="model")
        # continuous_update=False: a text change re-prefills every fragment and a ratio change
        # runs the model, so they act when typing stops or the slider is let go, not per key.
        self.texts = [self._text_box(i, t) for i, t in enumerate(texts)]
        self.fragment_box = W.VBox(list(self.texts))
        self.add_fragment = W.Button(description="add fragment", icon="plus")
        self.remove_fragment = W.Button(description="remove last", icon="minus")
        self.add_fragment.on_click(lambda _: self.set_fragment_count(len(self.texts) + 1))
        self.remove_fragment.on_click(lambda _: self.set_fragment_count(len(self.texts) - 1))
        self.policy = W.Dropdown(options=list(POLICIES), value="deviation", description="policy")
        # Shown only for models with more than one layer type (Gemma 3: sliding and full).
        self.layer_type = W.Dropdown(options=[ALL_LAYERS], value=ALL_LAYERS, description="layer type")
        self.layer = W.IntSlider(min=0, max=1, value=0, description="layer", continuous_update=False)
        self.head = W.IntSlider(min=0, max=0, value=0, description="KV head", continuous_update=False)
        self.ratio = W.FloatSlider(
            min=0.0, max=1.0, step=0.05, value=0.15, description="recompute r", continuous_update=False
        )
        self.readout = W.HTML()
        self.table = W.HTML()
        # Classes name the parts a browser test (or a stylesheet) looks for.
        self.table.add_class("kvlab-kl-table")
        # Figures are shown as PNG bytes in Image widgets: plain widget state that any front end
        # draws whenever it renders the explorer (an Output widget capturing display() lost the
        # first render in JupyterLab, and left the inline backend to print stray copies).
        self.images = {"phase": W.Image(format="png"), "heatmap": W.Image(format="png")}
        for name, image in self.images.items():
            image.add_class(f"kvlab-plot-{name}")
        self.plots = W.VBox(list(self.images.values()))
        # Progress of the change being worked on: the bar counts its steps, the label names the
        # current one. Kernel-side updates reach the page while the change still runs (each is
        # its own comm message), so a long merge is not a frozen page.
        self.progress = W.IntProgress(min=0, max=1, value=0, description="working", bar_style="info")
        self.status = W.Label()
        self.busy = W.HBox([self.progress, self.status], layout=W.Layout(display="none"))
        self.busy.add_class("kvlab-progress")
        self.status.add_class("kvlab-progress-step")
        self.draws = 0
        self.work: dict = {}
        self._work: dict | None = None
        self.state: dict = {}
        self.figures: dict = {}
        self._key = None
        self._draw = True
        for w in [self.strategy, self.model, self.ratio, self.policy, *self.texts]:
            w.observe(self._on_input, names="value")
        for w in (self.layer, self.head):
            w.observe(self._on_view, names="value")
        self.layer_type.observe(self._on_layer_type, names="value")
        self._recompute_inputs()
        self.widget = W.VBox(
            [
                W.HBox([self.model, self.strategy, self.ratio, self.policy]),
                self.fragment_box,
                W.HBox([self.add_fragment, self.remove_fragment]),
                W.HBox([self.layer_type, self.layer, self.head]),
                self.busy,
                self.readout,
                self.plots,
                self.table,
            ]
        )
        self._sync_ratio_visibility()

    def _text_box(self, i: int, text: str) -> W.Textarea:
        return W.Textarea(
            value=text, description=f"fragment {i}", layout=W.Layout(width="95%"), continuous_update=False
        )

    def set_fragment_count(self, n: int) -> None:
        """Add preset fragments or drop the last ones until there are ``n`` (2 to 8); recompute once."""
        if not MIN_FRAGMENTS <= n <= MAX_FRAGMENTS:
            raise KvlabError(f"the explorer merges {MIN_FRAGMENTS} to {MAX_FRAGMENTS} fragments, not {n}")
        while len(self.texts) > n:
            self.texts.pop().unobserve(self._on_input, names="value")
        while len(self.texts) < n:
            i = len(self.texts)
            box = self._text_box(i, PRESET_TEXTS[(i - MIN_FRAGMENTS) % len(PRESET_TEXTS)])
            box.observe(self._on_input, names="value")
            self.texts.append(box)
        self.fragment_box.children = tuple(self.texts)
        self.add_fragment.disabled = n >= MAX_FRAGMENTS
        self.remove_fragment.disabled = n <= MIN_FRAGMENTS
        self._recompute_inputs()

    # -- computation -----------------------------------------------------------------

    def _get_model(self) -> LoadedModel:
        name = self.model.value
        if name not in self._models:
            self._step(f"loading {name}")
            self._models[name] = load_model(name)
        return self._models[name]

    # -- progress --------------------------------------------------------------------

    @contextlib.contextmanager
    def _working(self, total: int):
        """One change's work, ``total`` steps; nested calls join the outer one. Hides the bar at the end."""
        if self._work is not None:
            self._work["total"] += total
            yield
            return
        self._work = {"t0": time.monotonic(), "total": total, "steps": [], "shown": False}
        try:
            yield
        finally:
            w, self._work = self._work, None
            self.work = {"steps": w["steps"], "seconds": time.monotonic() - w["t0"], "shown": w["shown"]}
            if w["shown"]:
                self.busy.layout.display = "none"

    def _step(self, label: str) -> None:
        """Start the next step of the current change; show the bar once the change has run
        ``progress_after`` seconds (the step that starts then is the first one shown)."""
        w = self._work
        if w is None:
            return
        done = len(w["steps"])
        w["steps"].append(label)
        if not w["shown"] and time.monotonic() - w["t0"] < self.progress_after:
            return
        if not w["shown"]:
            self.progress.value = 0  # first: lowering max below the last change's value would clamp it
        # Steps are planned before the work starts; a step the plan missed widens the bar.
        self.progress.max = max(w["total"], done + 1)
        self.status.value = f"{label} ({done + 1}/{self.progress.max})"
        self.progress.value = done
        if not w["shown"]:
            w["shown"] = True
            self.busy.layout.display = None

    def _options(self) -> dict:
        fields = getattr(STRATEGIES[self.strategy.value], "__dataclass_fields__", {})
        return {k: w.value for k, w in (("ratio", self.ratio), ("policy", self.policy)) if k in fields}

    def _recompute_inputs(self) -> None:
        texts = [t.value for t in self.texts]
        new = (self.model.value, tuple(texts)) != self._key
        # Steps: [load], prefill per fragment, both references, a reading per probe; then the
        # merge, its errors, a KL per probe and two figures.
        total = (len(texts) + 2 + len(self.probes) if new else 0) + 2 + len(self.probes) + 2
        with self._working(total + (self.model.value not in self._models)):
            self._recompute(texts)

    def _recompute(self, texts: list[str]) -> None:
        m = self._get_model()
        key = (m.name, tuple(texts))
        if key != self._key:
            self._key = key
            # No render of the old model's merge while the sliders' ranges change below.
            self.merged = None
            frags = []
            for i, t in enumerate(texts):
                self._step(f"prefilling fragment {i}")
                frags.append(prefill(m, t, bos=(i == 0)))  # as Case.from_texts does, one step each
            self.case = Case(m, frags, self.probes)
            self._step("phase reference (each fragment at its landing)")
            self.frags, self.phase_ref = self.case.fragments, self.case.phase
            self._step("context reference (the joined prefill)")
            self.joined = self.case.context
            self.joined_dists = []
            for i, p in enumerate(self.probes):
                self._step(f"reading probe {i} behind the joined prefill")
                self.joined_dists.append(self.case.reference.read(p, 0)[0])
            self.landings = self.case.landings
            # Lowering max clamps value (ipywidgets validates it).
            self.layer.max = len(self.phase_ref.layers) - 1
            self.head.max = self.phase_ref.layers[0].keys.shape[1] - 1
            # Layer kinds, NoPE layers apart: a NoPE layer has no phase to be wrong.
            types = list(dict.fromkeys(r.kind for r in layer_ropes(m.model)))
            self.layer_type.options = [ALL_LAYERS] + (types if len(types) > 1 else [])
            self.layer_type.value = ALL_LAYERS
            self.layer_type.layout.display = None if len(types) > 1 else "none"
        self._merge()

    def _merge(self) -> None:
        m = self._get_model()
        name = self.strategy.value
        self.state = {"model": m.name, "strategy": name, "options": self._options()}
        self._step(f"merging {len(self.frags)} fragments: {self._label()}")
        try:
            self.merged = merge(self.frags, name, m, **self._options())
        except KvlabError as e:
            self.merged = None
            self.state["refused"] = str(e)
            self._render()
            return
        self._step("phase error and |K - ref|")
        self.phases = phase_error(self.merged, self.phase_ref, m)
        self.diffs = kv_diff(self.merged, self.phase_ref)
        self.kl = []
        for i, (p, d) in enumerate(zip(self.probes, self.joined_dists, strict=True)):
            self._step(f"next-token KL, probe {i}")
            self.kl += next_token_kl(m, self.merged, self.joined, [p], [d])
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

    def _on_layer_type(self, change) -> None:
        if self.merged is None:
            return  # a model change resets the choice before the new merge exists
        t = change["new"]
        if t != ALL_LAYERS and self.phases[self.layer.value].kind != t:
            # Jump to the first layer of that kind; the layer slider's observer redraws once.
            self.layer.value = next(i for i, p in enumerate(self.phases) if p.kind == t)
        else:
            with self._working(2):
                self._render()

    def _on_view(self, change) -> None:
        if self.merged is not None:
            with self._working(2):  # the two figures
                self._render()

    def _sync_ratio_visibility(self) -> None:
        opts = self._options()
        self.ratio.layout.display = None if "ratio" in opts else "none"
        self.policy.layout.display = None if "policy" in opts else "none"

    def _label(self) -> str:
        """The strategy as the readout and KL table name it, with its recompute options."""
        opts = self.state.get("options") or {}
        shown = ", ".join(f"r={v:g}" if k == "ratio" else f"policy {v}" for k, v in opts.items())
        return f"{self.state['strategy']}" + (f" ({shown})" if shown else "")

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
        head = p.angle[hi][~p.masked[hi]]
        head_err = float(head.max()) if head.numel() else math.nan
        lt = self.layer_type.value
        typed = max_phase_error(self.phases, None if lt == ALL_LAYERS else lt)
        self.state.update(
            layer=li,
            head=hi,
            max_phase_error_layer_head=head_err,
            layer_type=lt,
            max_phase_error_layer_type=typed,
            n_fragments=len(self.frags),
        )
        over = "all layers" if lt == ALL_LAYERS else f"{lt} layers"
        self.readout.value = (
            f"<b>{self.state['model']} / {html.escape(self._label())}</b>, {len(self.frags)} fragments: max phase error "
            f"over all layers <span class='kvlab-max-phase'>{self.state['max_phase_error']:.3e}</span> rad"
            + ("" if lt == ALL_LAYERS else f"; over {over} <span class='kvlab-max-phase-type'>{typed:.3e}</span> rad")
            + f"; layer {li} ({html.escape(p.kind)}), head {hi}: "
            + ("no phase (no rotary embedding)" if p.nope else f"{head_err:.3e} rad")
            + f"; top-1 agreement with the joined prefill {self.state['top1_agree']}/{len(self.kl)}"
        )
        rows = "".join(
            f"<tr><td>{html.escape(r['probe'])}</td><td>{r['kl']:.4f}</td><td>{html.escape(r['top1_ref'])}</td>"
            f"<td>{html.escape(r['top1'])}</td><td>{'yes' if r['agree'] else 'no'}</td></tr>"
            for r in self.kl
        )
        caption = (
            f"next-token KL against the joined prefill: {html.escape(self.state['model'])} / "
            f"{html.escape(self._label())}, {len(self.frags)} fragments"
        )
        self.table.value = (
            f"<table class='kvlab-kl'><caption>{caption}</caption><tr><th>probe</th><th>KL (nats)</th>"
            f"<th>top-1 joined</th><th>top-1 merged</th><th>agree</th></tr>{rows}</table>"
        )
        if not self._draw:
            return  # hold_drawing() renders once, figures included, when it ends
        # Titles name the options too: a figure always says which merge it shows.
        title = f"{self.state['model']} / {self._label()}: phase error, layer {li} ({p.kind}), head {hi}"
        self._step("drawing the phase plot")
        self.figures["phase"] = phase_vs_position_head(p, hi, title, self.landings)
        self._step("drawing the heatmap")
        self.figures["heatmap"] = kv_heatmaps(
            {self._label(): self.diffs}, self.state["model"], "phase ref", self.landings, layer=li
        )
        for fig in self.figures.values():
            plt.close(fig)  # off pyplot's list, so the inline backend does not print them below the cell
        self._draw_figures()

    def _draw_figures(self) -> None:
        # Encode both first, then set both: the page swaps the two images together, once.
        pngs = {}
        for name, fig in self.figures.items():
            buf = io.BytesIO()
            # constrained_layout already fits the figure; "tight" would draw it twice (a third of a redraw).
            fig.savefig(buf, format="png")
            pngs[name] = buf.getvalue()
        for name, png in pngs.items():
            self.images[name].value = png
        self.plots.layout.display = None
        self.draws += 1

    @contextlib.contextmanager
    def hold_drawing(self):
        """Update state, readout and figures without drawing into the notebook (for scripted runs)."""
        self._draw = False
        try:
            yield self
        finally:
            self._draw = True
            with self._working(2):
                self._render()  # show what the state now says

    def _ipython_display_(self):
        from IPython.display import display

        display(self.widget)
