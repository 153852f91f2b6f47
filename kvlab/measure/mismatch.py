"""Same-shape readers with a difference real deployments have, and what a foreign cache does to them.

:func:`variants` makes a reader with exactly the producer's shapes but other weights:
a dtype cast (``bf16``, ``fp16``), an int8 per-channel quantization round trip
(``int8``), or a short seeded fine-tune on a text shipped with kvlab (``finetune``),
standing in for a base model and its fine-tune. :func:`mismatch_kl` then measures, per
probe, how far the reader's next-token distribution moves when it reads the producer's
cache instead of its own. :func:`mismatch_study` runs it for every variant, and
``kvlab mismatch --model MODEL`` prints the table.
"""

from __future__ import annotations

import copy
import tempfile
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch

from kvlab.cache.fragments import Fragment, clone_cache, prefill, prefill_ids, source_ids
from kvlab.errors import CacheFileWarning, KvlabError, MergeError
from kvlab.files.identity import Difference
from kvlab.files.io import load_with_differences, save_cache
from kvlab.measure.case import FidelityReference
from kvlab.measure.metrics import next_token_kl
from kvlab.measure.span import span_scores
from kvlab.models.loaded import LoadedModel

#: What :func:`variants` can make.
VARIANT_KINDS = ("bf16", "fp16", "int8", "finetune")

#: The cache the mismatch study saves and hands to every variant.
DEFAULT_TEXT = (
    "Marta keeps bees on the roof of the old library in Porto. Every Saturday she sells the honey at "
    "the market, and she gives the wax to a candle maker called Tomas."
)

#: Continuations read right behind the cache.
DEFAULT_PROBES = (
    "\nQ: Where are the bees kept?",
    "\nQ: Who receives the wax?",
    "\nIn one sentence, Marta",
    "\nQ: What does Marta sell on Saturdays?",
    "\nA note to thank Marta:",
)

#: Defaults of the ``finetune`` variant.
FINETUNE_DEFAULTS = {"steps": 6, "lr": 1.5e-4, "seed": 0, "seq_len": 48, "batch": 2}

_CASTS = {"bf16": torch.bfloat16, "fp16": torch.float16}


class WideLinear(torch.nn.Linear):
    """A half-precision linear layer whose product is summed in float32 and rounded once to its dtype.

    That is what a half-precision GEMM computes on an accelerator (fp32 accumulation, one
    rounding per output) and what torch's own CPU bf16/fp16 GEMM computes too, to the order
    of the sums. Taken as an fp32 GEMM, it runs about 5x faster on AVX2 CPUs without native
    bf16 (``benchmarks/halfgemm.py``), and its result does not move with the thread schedule
    (torch's threaded bf16 GEMM moved notebook 03's bf16 row between runs).

    The float32 copies of the weight and bias are made once and kept (outside the state dict)
    while the parameters keep their storage, dtype and version: casting SmolLM2's 135M weights
    again in every forward pass cost more than the product itself for a one-token decoding step.
    The copies are exact (every bf16/fp16 value is a float32 value), so the result is the same
    bit for bit. Kept only when no gradient flows through the layer.

    Input ``[..., in_features]`` and output ``[..., out_features]`` in the layer's dtype.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = self._wide()
        return torch.nn.functional.linear(x.float(), weight, bias).to(x.dtype)

    def _wide(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The float32 ``[out_features, in_features]`` weight and ``[out_features]`` bias (or ``None``)."""
        params = [p for p in (self.weight, self.bias) if p is not None]
        if torch.is_grad_enabled() and any(p.requires_grad for p in params):
            return self._cast()
        try:
            key = tuple((p.data_ptr(), p.dtype, p.shape, p._version) for p in params)
        except RuntimeError:  # an inference tensor keeps no version counter: cast it each time
            return self._cast()
        kept = self.__dict__.get("_wide_kept")
        if kept is None or kept[0] != key:
            kept = self.__dict__["_wide_kept"] = (key, *self._cast())
        return kept[1], kept[2]

    def _cast(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.weight.float(), None if self.bias is None else self.bias.float()


def widen_linears(module: torch.nn.Module) -> torch.nn.Module:
    """Make every plain ``nn.Linear`` of ``module`` a :class:`WideLinear` in place (same weights, same state dict)."""
    for m in module.modules():
        if type(m) is torch.nn.Linear:
            m.__class__ = WideLinear
    return module


def finetune_text() -> str:
    """The small English text the ``finetune`` variant trains on (``kvlab/data/finetune.txt``)."""
    return resources.files("kvlab").joinpath("data/finetune.txt").read_text(encoding="utf-8")


def variants(model: LoadedModel, kind: str, **finetune) -> LoadedModel:
    """A reader with ``model``'s shapes but a difference that real deployments have.

    ``model`` is never modified: its module is deep-copied first.

    Parameters
    ----------
    model : LoadedModel
        The producer.
    kind : str
        ``bf16`` / ``fp16``: the weights cast to that dtype (what loading the same
        checkpoint with another ``dtype`` gives), every activation in it, each linear
        layer's product summed in float32 and rounded once (:class:`WideLinear`). ``int8``: every 2-D weight (linear
        layers and embeddings) quantized to int8 with one scale per output row
        (``scale = max|w_row| / 127``) and dequantized again; norms and biases are left as
        they are. ``finetune``: ``steps`` AdamW steps (``lr``, ``seed``, windows of
        ``seq_len`` tokens, ``batch`` windows per step) on :func:`finetune_text`, training
        every parameter except the input and output embeddings, in float32, then cast back
        to the producer's dtype. Deterministic for a given seed, torch build and thread count.
    **finetune
        Overrides of :data:`FINETUNE_DEFAULTS` (``finetune`` only).

    Returns
    -------
    LoadedModel
        ``name`` is ``<model>+<kind>``; ``source`` records the variant, so the fingerprint
        differs in ``dtype`` (casts), ``quantization`` (int8) or ``source`` (fine-tune),
        and always in ``weights_sha256``.
    """
    if kind not in VARIANT_KINDS:
        raise KvlabError(f"unknown variant {kind!r}; known: {', '.join(VARIANT_KINDS)}")
    unknown = set(finetune) - set(FINETUNE_DEFAULTS)
    if unknown or (finetune and kind != "finetune"):
        raise KvlabError(f"variant {kind!r} takes no option(s) {', '.join(sorted(unknown or finetune))}")
    module = copy.deepcopy(model.model)
    # Not the converted or digested model any more: its remembered digests do not apply.
    base = {k: v for k, v in (model.source or {}).items() if k not in ("folder", "fingerprint_dir")}
    source = dict(base, variant=kind, base=model.name)
    if kind in _CASTS:
        module = widen_linears(module.to(_CASTS[kind]))
    elif kind == "int8":
        _int8_roundtrip(module)
        q = base.get("quantization")
        source["quantization"] = (
            f"{q} + int8 per-channel round trip" if q and q != "none" else "int8 per-channel round trip"
        )
    else:
        opts = dict(FINETUNE_DEFAULTS, **finetune)
        _finetune(module, model.tokenizer, **opts)
        source = _finetune_source(model, opts)
    return _reader(model, module, kind, source)


def _finetune_source(model: LoadedModel, opts: dict) -> dict:
    """The ``source`` of a ``finetune`` variant of ``model`` made with ``opts`` (all of :data:`FINETUNE_DEFAULTS`)."""
    base = {k: v for k, v in (model.source or {}).items() if k not in ("folder", "fingerprint_dir")}
    derived = (
        f"fine-tune ({opts['steps']} AdamW steps, lr {opts['lr']:g}, seed {opts['seed']}, "
        f"{opts['batch']}x{opts['seq_len']} tokens of kvlab/data/finetune.txt)"
    )
    return dict(
        base,
        variant="finetune",
        base=model.name,
        derived=f"{base['derived']} + {derived}" if base.get("derived") else derived,
    )


def _reader(model: LoadedModel, module: torch.nn.Module, kind: str, source: dict) -> LoadedModel:
    module.eval()
    for p in module.parameters():
        p.requires_grad_(False)
    return LoadedModel(
        model=module, tokenizer=model.tokenizer, name=f"{model.name}+{kind}", config=module.config, source=source
    )


def finetune_snapshots(model: LoadedModel, steps, **finetune) -> Iterator[tuple[int, LoadedModel]]:
    """One fine-tune run of ``model`` and its reader at each of ``steps``: nested snapshots of one training.

    The run is the ``finetune`` variant's (:func:`variants`): the same seed draws the same
    batches, and AdamW at a constant learning rate makes the first ``k`` steps of a longer run
    the whole of a ``k``-step run, so the snapshot at ``k`` is, bit for bit and in its
    fingerprint, ``variants(model, "finetune", steps=k, **finetune)``; it costs ``max(steps)``
    steps instead of ``sum(steps)``. Step 0 is no fine-tune at all: it yields ``model`` itself
    (the producer's weights and identity). ``model`` is never modified.

    Parameters
    ----------
    model : LoadedModel
        The producer.
    steps : iterable of int
        Snapshot steps (``>= 0``); yielded in increasing order, each once.
    **finetune
        Overrides of :data:`FINETUNE_DEFAULTS` other than ``steps``.

    Yields
    ------
    (int, LoadedModel)
        The step and its reader: a copy of the training module at that step, cast back to the
        producer's dtype. Drop each before taking the next to hold one snapshot at a time.
    """
    wanted = sorted(set(steps))
    if not wanted or any(not isinstance(k, int) or isinstance(k, bool) or k < 0 for k in wanted):
        raise KvlabError(f"snapshot steps must be integers >= 0, not {list(steps)!r}")
    unknown = set(finetune) - (set(FINETUNE_DEFAULTS) - {"steps"})
    if unknown:
        raise KvlabError(f"finetune_snapshots takes no option(s) {', '.join(sorted(unknown))}")
    if wanted[0] == 0:
        yield 0, model
    if wanted[-1] == 0:
        return
    opts = dict(FINETUNE_DEFAULTS, **finetune, steps=wanted[-1])
    module = copy.deepcopy(model.model)
    dtype = next(module.parameters()).dtype
    for k in _training(module, model.tokenizer, **opts):
        if k in wanted:
            snap = copy.deepcopy(module).to(dtype)
            yield k, _reader(model, snap, "finetune", _finetune_source(model, dict(opts, steps=k)))
            del snap


@torch.no_grad()
def _int8_roundtrip(module: torch.nn.Module) -> None:
    for p in module.parameters():  # parameters() yields a tied weight once
        if p.ndim != 2 or not p.is_floating_point():
            continue
        w = p.float()
        scale = w.abs().amax(dim=1, keepdim=True) / 127.0
        q = torch.where(scale > 0, (w / scale).round().clamp(-127, 127), torch.zeros_like(w))
        p.copy_((q * scale).to(p.dtype))


def _finetune(
    module: torch.nn.Module, tokenizer, *, steps: int, lr: float, seed: int, seq_len: int, batch: int
) -> None:
    dtype = next(module.parameters()).dtype
    for _ in _training(module, tokenizer, steps=steps, lr=lr, seed=seed, seq_len=seq_len, batch=batch):
        pass
    module.to(dtype)


def _training(
    module: torch.nn.Module, tokenizer, *, steps: int, lr: float, seed: int, seq_len: int, batch: int
) -> Iterator[int]:
    """Train ``module`` in place (cast to float32), yielding ``k`` after AdamW step ``k`` (1..``steps``).

    Gradients are enabled only inside each step, so the caller runs with its own grad mode
    while the generator waits.
    """
    ids = torch.tensor(tokenizer(finetune_text(), add_special_tokens=False)["input_ids"], dtype=torch.long)
    if ids.numel() <= seq_len:
        raise KvlabError(f"the fine-tune text is {ids.numel()} tokens, fewer than seq_len={seq_len}")
    device = next(module.parameters()).device
    module.float()
    # Embeddings are tied in both real models and dominate the optimizer state; a
    # fine-tune of every block already moves every cached key and value.
    frozen = {id(m.weight) for m in (module.get_input_embeddings(), module.get_output_embeddings()) if m is not None}
    params = [p for p in module.parameters() if id(p) not in frozen]
    for p in module.parameters():
        p.requires_grad_(id(p) not in frozen)
    try:  # the fused kernel is several times faster than the per-tensor loop on CPU
        opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0, fused=True)
    except (RuntimeError, TypeError):
        opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(seed)
    module.eval()  # no dropout: the steps are deterministic
    try:
        for k in range(1, steps + 1):
            with torch.inference_mode(False), torch.enable_grad():
                starts = torch.randint(0, ids.numel() - seq_len, (batch,), generator=gen)
                x = torch.stack([ids[s : s + seq_len] for s in starts.tolist()]).to(device)
                loss = module(input_ids=x, labels=x, use_cache=False).loss
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            yield k
    finally:
        del opt


@dataclass(frozen=True)
class ProbeKL:
    """One probe read behind the reader's own cache and behind the foreign one.

    ``kl`` is ``KL(p_own || p_foreign)`` of the next token, in nats. Read with the true answer
    (``mismatch_kl(..., answers=)``): ``span_kl``, the same KL per answer token with the answer
    teacher-forced, and ``nll`` / ``nll_own``, the answer's negative log-likelihood behind the
    foreign and the own cache (nats); otherwise ``None``.
    """

    probe: str
    kl: float
    top1_own: str
    top1_foreign: str
    span_kl: float | None = None
    nll: float | None = None
    nll_own: float | None = None

    @property
    def flipped(self) -> bool:
        return self.top1_own != self.top1_foreign


@dataclass
class MismatchResult:
    """What a foreign cache did to one reader, probe by probe."""

    reader: str
    differences: list[Difference] | None  # None when the producer is unknown (a bare Fragment)
    rows: list[ProbeKL]

    @property
    def flips(self) -> int:
        return sum(r.flipped for r in self.rows)

    @property
    def max_kl(self) -> float:
        return max(r.kl for r in self.rows)

    @property
    def mean_kl(self) -> float:
        return sum(r.kl for r in self.rows) / len(self.rows)

    def table(self) -> str:
        fields = "unknown" if self.differences is None else (", ".join(d.field for d in self.differences) or "none")
        lines = [
            f"reader {self.reader}; differing fields: {fields}",
            f"  {'probe':40s} {'KL':>8s}  top-1 own -> foreign",
        ]
        for r in self.rows:
            mark = "  FLIP" if r.flipped else ""
            lines.append(f"  {r.probe!r:40s} {r.kl:8.1e}  {r.top1_own!r} -> {r.top1_foreign!r}{mark}")
        lines.append(f"  mean KL {self.mean_kl:.2e}, max {self.max_kl:.2e}, top-1 flips {self.flips}/{len(self.rows)}")
        return "\n".join(lines)


def mismatch_kl(
    cache_file_or_fragment, reader: LoadedModel, probes=DEFAULT_PROBES, answers: list[str] | None = None
) -> MismatchResult:
    """Per probe, how far the reader moves when it reads a foreign cache instead of its own.

    The reader prefills the cache's own source tokens itself (its own cache) and reads
    each probe behind both caches; a cache file is loaded with ``strict=False`` (its
    warning is swallowed: the differences are returned instead), and a foreign cache in
    another dtype is cast to the reader's, as a non-strict load would.

    Parameters
    ----------
    cache_file_or_fragment : path or Fragment
        Must start at position 0 and keep its token ids.
    reader : LoadedModel
        Same geometry as the producer.
    probes : sequence of str
    answers : list of str, optional
        The true answer to each probe; each row then also scores the answer span
        (:func:`kvlab.measure.span.span_scores`, the reader's own cache as the reference).

    Returns
    -------
    MismatchResult
        ``rows``: per probe ``KL(p_own || p_foreign)`` in nats and the two top-1 tokens;
        ``differences``: the strict fingerprint fields that differ (``None`` for a Fragment).
    """
    if isinstance(cache_file_or_fragment, Fragment):
        foreign, differences = cache_file_or_fragment, None
        # A foreign fragment in another dtype is cast, as a non-strict load would.
        theirs = clone_cache(foreign.cache, reader.config, dtype=reader.dtype, device=reader.device)
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", CacheFileWarning)
            foreign, differences = load_with_differences(
                cache_file_or_fragment, reader, strict=False, allow_unverified=True
            )
        theirs = foreign.cache
    if foreign.start != 0:
        raise MergeError(
            f"mismatch_kl reads probes right behind the cache, so it must start at position 0, not {foreign.start}"
        )
    ids = source_ids(foreign, 0)
    own = prefill_ids(reader, ids, 0)
    probes = list(probes)
    if answers is None:
        rows = [
            ProbeKL(r["probe"], r["kl"], r["top1_ref"], r["top1"]) for r in next_token_kl(reader, theirs, own, probes)
        ]
    else:
        # The answer's passes read the first answer token too: no separate next-token reads.
        rows = [
            ProbeKL(r["probe"], r["kl"], r["top1_ref"], r["top1"], r["span_kl"], r["nll"], r["nll_ref"])
            for r in span_scores(reader, theirs, FidelityReference(reader, own), probes, answers)
        ]
    return MismatchResult(reader=reader.name, differences=differences, rows=rows)


def mismatch_study(
    producer: LoadedModel, text: str = DEFAULT_TEXT, probes=DEFAULT_PROBES, kinds=VARIANT_KINDS, **finetune
) -> dict[str, MismatchResult]:
    """Save ``producer``'s cache of ``text`` to a file and read it with every variant.

    Returns
    -------
    dict
        ``"self"`` (the producer reading its own file: the control, KL 0) and one
        :class:`MismatchResult` per kind.
    """
    fragment = prefill(producer, text)
    out = {}
    with tempfile.TemporaryDirectory(prefix="kvlab-mismatch-") as d:
        path = save_cache(Path(d) / "producer.kvcache", fragment, producer)
        out["self"] = mismatch_kl(path, producer, probes)
        for kind in kinds:
            reader = variants(producer, kind, **(finetune if kind == "finetune" else {}))
            out[kind] = mismatch_kl(path, reader, probes)
            del reader
    return out


def format_study(results: dict[str, MismatchResult]) -> str:
    """One line per variant and probe: KL and top-1 tokens; then a summary per variant."""
    probes = next(iter(results.values())).rows
    head = f"{'variant':9s} " + " ".join(f"{'p' + str(i + 1) + ' KL':>9s}" for i in range(len(probes)))
    lines = [
        "probes: " + "; ".join(f"p{i + 1}={r.probe!r}" for i, r in enumerate(probes)),
        "",
        head + "  flips  differing fields",
    ]
    for kind, res in results.items():
        cells = " ".join(f"{r.kl:8.1e}{'*' if r.flipped else ' '}" for r in res.rows)
        fields = "?" if res.differences is None else (", ".join(d.field for d in res.differences) or "-")
        lines.append(f"{kind:9s} {cells}  {res.flips}/{len(res.rows)}    {fields}")
    lines.append("KL(p_own || p_foreign) in nats of the next token; * marks a top-1 flip.")
    return "\n".join(lines)
