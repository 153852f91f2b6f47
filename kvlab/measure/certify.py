"""``kvlab certify``: one model's merge machinery checked on its own keys, each line beside its bound.

A cache store that blends or moves cached fragments trusts three things per model: that the
model rotates keys the way the store re-rotates them, at every position it will use; that the
exact strategies are exact (recompute at ratio 0 is rerotate, at ratio 1 the joined prefill),
sliding windows included; and that what cannot be rotated is refused rather than merged. A
:class:`Certificate` measures each of these on the model's own weights, with a bound set by
what fp32 arithmetic explains (never a tolerance fitted to the model), plus the cache-file
round trip, the model's noise floor and its context error against full recompute. Its JSON is
the record a store's CI, a sweep or a report can cite; ``kvlab certify`` exits 1 when any line
fails.

Bounds:

* phase lines: :func:`kvlab.measure.metrics.phase_beyond_rounding` ``<= 1``: every rotary key
  pair agrees with the model's own key at that position to within the angle fp32 rounding
  explains (the model's fp32 angle ``position * inv_freq`` included, so the bound widens with
  the offset exactly as the model's own precision does).
* identities: bit for bit (0 differing elements) where the computation is the same, and
  :data:`REL_KEY_NOISE` relative where it is the same maths in another order.
* the floor: :data:`FLOOR_BOUND` nats; kvlab's findings are KLs of 1e-3 nats and up.
"""

from __future__ import annotations

import copy
import dataclasses
import datetime
import json
import math
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import DynamicCache

from kvlab.atomic import atomic_write_text
from kvlab.cache.fragments import Fragment, clone_cache, joined_prefill, prefill_ids, prefill_tokens
from kvlab.cache.merge import landing_positions, merge
from kvlab.cache.recompute.strategy import POLICIES
from kvlab.cache.shift import shift_
from kvlab.errors import FingerprintMismatch, KvlabError, MergeError, PositionError, UnsupportedRopeError
from kvlab.files.identity import fingerprint, package_versions
from kvlab.files.io import load_cache, save_cache
from kvlab.measure.case import DEFAULT_PROBES, Case
from kvlab.measure.metrics import (
    REL_KEY_NOISE,
    kl_divergence,
    kv_diff,
    next_token_kl,
    phase_beyond_rounding,
    phase_error,
    rel_key_error,
)
from kvlab.measure.mismatch import variants
from kvlab.measure.probes import read_probes
from kvlab.measure.references import phase_reference
from kvlab.models.layout import emits, find_rotary_module, layer_ropes
from kvlab.models.loaded import LoadedModel
from kvlab.models.rope import check_composable, longrope_inv_freq

#: Version of the certificate's JSON layout.
CERTIFICATE_VERSION = 1

#: Largest KL (nats) allowed between two reads that differ only in batching or threads.
FLOOR_BOUND = 1e-6

#: Fragment lengths of the rerotate phase check (two fragments each; capped by the position limit).
LENGTHS = (16, 128, 512)

#: Recompute ratio of the context-error line (CacheBlend's ~15%).
INFO_RATIO = 0.15

PASS, FAIL, REFUSED, NA, INFO = "pass", "FAIL", "REFUSED", "n/a", "info"


@dataclass(frozen=True)
class Line:
    """One measured check of a certificate.

    Attributes
    ----------
    check : str
        What is checked (``rotation``, ``rerotate phase``, ``recompute r=0`` ...).
    scope : str
        What it was measured on (layer type, lengths, offsets).
    value : float, int, str or None
        The measured value (``None`` where nothing could be measured).
    bound : float, int, str or None
        What the value must not exceed (or, for a refusal, the error that must be raised);
        ``None`` on information lines.
    unit : str
    status : str
        ``pass``, ``FAIL``, ``REFUSED`` (kvlab refuses the operation on this model, so the
        check cannot certify it), ``n/a`` or ``info``.
    detail : str
    """

    check: str
    scope: str
    value: float | int | str | None
    bound: float | int | str | None
    unit: str
    status: str
    detail: str = ""

    @property
    def failed(self) -> bool:
        return self.status in (FAIL, REFUSED)


@dataclass
class Certificate:
    """Every :class:`Line` measured on one model, with the model's fingerprint.

    Attributes
    ----------
    model : str
    lines : list of Line
    fingerprint : dict
        :func:`kvlab.fingerprint` of the model (weights digest included): what was certified.
    seconds : float
        Wall time of the whole run.
    target : str or None
        What was audited on the model (``merge pkg.mod:fn``, see :mod:`kvlab.measure.audit`);
        ``None`` for the model's own certificate.
    """

    model: str
    lines: list[Line]
    fingerprint: dict
    seconds: float
    created: str = field(default_factory=lambda: datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"))
    target: str | None = None

    @property
    def passed(self) -> bool:
        return not any(line.failed for line in self.lines)

    def as_dict(self) -> dict:
        return {
            "certificate_version": CERTIFICATE_VERSION,
            "model": self.model,
            **({"target": self.target} if self.target else {}),
            "passed": self.passed,
            "created": self.created,
            "seconds": round(self.seconds, 2),
            "versions": package_versions("kvlab", "torch", "transformers"),
            "threads": torch.get_num_threads(),
            "fingerprint": self.fingerprint,
            "lines": [dataclasses.asdict(line) for line in self.lines],
        }

    def write_json(self, path) -> Path:
        """Write :meth:`as_dict` to ``path`` atomically."""
        return atomic_write_text(Path(path), json.dumps(self.as_dict(), indent=1) + "\n")

    def table(self, verbose: bool = False) -> str:
        head = f"{'check':<22} {'scope':<50} {'value':>20} {'bound':>20} {'unit':<13} status"
        out = [head, "-" * len(head)]
        for line in self.lines:
            out.append(
                f"{line.check:<22} {line.scope[:50]:<50} {_show(line.value):>20} {_show(line.bound):>20} "
                f"{line.unit:<13} {line.status}"
            )
            if line.detail and (verbose or line.status != PASS):
                out.append(f"{'':<23}{line.detail}")
        verdict = "certified" if self.passed else "NOT certified"
        failed = [f"{line.check} ({line.scope})" for line in self.lines if line.failed]
        subject = f"{self.target} on {self.model}" if self.target else self.model
        out.append(
            f"{subject}: {verdict}" + (f"; failing: {', '.join(failed)}" if failed else "") + f" ({self.seconds:.1f} s)"
        )
        return "\n".join(out)


def _show(x) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return "0" if x == 0 else f"{x:.3g}"
    return str(x)


def certify(model: LoadedModel, *, lengths: tuple[int, ...] = LENGTHS, seed: int = 0) -> Certificate:
    """Run every check of ``kvlab certify`` on ``model``.

    Parameters
    ----------
    model : LoadedModel
    lengths : tuple of int
        Fragment lengths of the rerotate phase check (two fragments each).
    seed : int
        Seed of the random token ids the fragments are made of.

    Returns
    -------
    Certificate
        ``passed`` is True when no line failed or was refused.
    """
    t0 = time.perf_counter()
    ids = TokenSource(model, seed)
    lines = _rotation(model) + _rerotate_phase(model, ids, lengths)
    exact = _Exact.of(model, identity_fragments(model, ids))
    lines += _sliding(model, exact) + _recompute_identities(model, exact)
    story = Case.from_texts(model)
    lines += _refusals(model, ids) + _file_round_trip(model, exact) + _floor(model, story) + _context(model, story)
    return Certificate(model.name, lines, fingerprint(model), time.perf_counter() - t0)


class TokenSource:
    """Seeded random token ids from the middle of the vocabulary (no special tokens)."""

    def __init__(self, model: LoadedModel, seed: int):
        vocab = model.config.get_text_config().vocab_size
        self.low, self.high = min(100, vocab // 4), min(vocab, 20000)
        self.gen = torch.Generator().manual_seed(seed)

    def __call__(self, n: int) -> torch.Tensor:
        return torch.randint(self.low, self.high, (n,), generator=self.gen)


def position_limit(model: LoadedModel) -> int:
    """The model's ``max_position_embeddings``: no key may sit at or past it."""
    return model.config.get_text_config().max_position_embeddings


def beyond_by_kind(cache, ref, phases, floor: float = REL_KEY_NOISE) -> dict[str, float]:
    """Per layer kind (``full_attention``, ``... (NoPE)``), the worst error in units of rounding.

    A rotary layer's is its phase (:func:`phase_beyond_rounding`). A NoPE layer has no phase to
    be wrong: its cached tensors must not move at all, so its error is the elementwise one,
    ``max |T - T_ref| / max |T_ref|`` over both slots, over ``floor``.
    """
    out: dict[str, float] = {}
    diffs = kv_diff(cache, ref) if any(p.nope for p in phases) else None
    for li, p in enumerate(phases):
        if p.nope:
            ref_layer = ref.layers[li]
            rel = max(
                float(diffs[li].k.max()) / max(float(ref_layer.keys.abs().max()), 1e-30),
                float(diffs[li].v.max()) / max(float(ref_layer.values.abs().max()), 1e-30),
            )
            value = rel / floor
        else:
            value = phase_beyond_rounding([p], floor)
        out[p.kind] = max(out.get(p.kind, 0.0), value)
    return out


def _offsets(limit: int) -> list[int]:
    """1, 37, 2^k - 1 up to the limit, and the last position the model has."""
    return sorted({1, 37, limit - 1, *(2**k - 1 for k in range(8, 31) if 2**k - 1 < limit)} - {0})


def _rotation(model: LoadedModel) -> list[Line]:
    """One token at position 0 turned by ``shift_`` to each offset, against the model's own key there.

    A token prefilled alone attends only to itself, so every layer's key at position ``s`` is
    its key at 0 turned by ``s`` exactly: the only differences are the two rotations' rounding.
    Where a schedule switches frequencies (longrope), the turn starts from the switch.
    """
    ropes = layer_ropes(model.model)
    limit = position_limit(model)
    switch = {r.original_max_position_embeddings for r in ropes if r.rope_type == "longrope"} - {None}
    token = model.tokenizer(" the", add_special_tokens=False)["input_ids"][:1] or [0]
    token = torch.tensor(token, dtype=torch.long)
    sources = {s: prefill_ids(model, token, s) for s in [0, *sorted(switch)]}
    worst: dict[str, float] = {}
    rel, refused, done = 0.0, [], []
    for dst in _offsets(limit):
        at_dst = prefill_ids(model, token, dst)
        for src, cache in sources.items():
            try:
                moved = shift_(clone_cache(cache, model.config), dst - src, model, start=src)
            except UnsupportedRopeError as e:
                last = e
                continue
            break
        else:
            refused.append((dst, str(last)))
            continue
        done.append(dst)
        phases = [dataclasses.replace(p, positions=p.positions + dst) for p in phase_error(moved, at_dst, model)]
        for lt, w in beyond_by_kind(moved, at_dst, phases).items():
            worst[lt] = max(worst.get(lt, 0.0), w)
        rel = max(rel, rel_key_error(moved, at_dst))
    types = sorted({r.kind for r in ropes})
    scope = f"offsets 1..{limit - 1} ({len(_offsets(limit))})"
    if not done:
        return [
            Line("rotation", f"{lt} layers, {scope}", None, 1.0, "x rounding", REFUSED, refused[0][1]) for lt in types
        ]
    detail = f"max relative key error {rel:.2g}; offsets {done[0]}..{done[-1]}"
    if refused:
        detail += f"; refused at {len(refused)} offsets ({refused[0][1][:80]})"
    return [
        Line(
            "rotation", f"{lt} layers, {scope}", worst[lt], 1.0, "x rounding", PASS if worst[lt] <= 1 else FAIL, detail
        )
        for lt in types
    ]


def _fragments(model: LoadedModel, ids: TokenSource, lengths: list[int]) -> list[Fragment]:
    return [prefill_tokens(model, ids(n)) for n in lengths]


def exact_twin(model: LoadedModel) -> LoadedModel:
    """``model`` computing in float64, its rotary angles too: the maths of the model, far below fp32 rounding.

    transformers computes rotary angles in float32 whatever the weights' dtype, and at position
    1000 that rounding (about 6e-5 rad at one radian per position) moves every later layer's
    keys more than fp32 noise does; a reference that is to be exact computes the angle
    ``position * inv_freq`` in float64 from the model's own (float32) frequencies.
    """
    module = copy.deepcopy(model.model).double()
    if getattr(module.config, "_experts_implementation", None) not in (None, "eager"):
        # Mixture-of-experts kernels (grouped_mm) take no float64; the plain loop over experts does.
        module.config._experts_implementation = "eager"
    # NoPE layers take no angle; every rotating layer type has its own frequencies.
    ropes = {r.layer_type: r for r in layer_ropes(model.model) if not r.nope}
    only = next(iter(ropes.values()))
    form = emits(model.config)

    def forward(x, position_ids, layer_type=None, *args, **kwargs):
        rope = ropes.get(layer_type, only)
        inv = rope.inv_freq
        if rope.rope_type == "longrope":
            inv = longrope_inv_freq(
                model.model, rope, int(position_ids.max()) + 1 > rope.original_max_position_embeddings
            )
        freqs = position_ids[..., None].double() * inv.to(x.device, torch.float64)
        s = rope.attention_scaling
        # Handed to the attention in the form the family's own rotary module uses.
        if form == "sincos":
            return freqs.sin().to(x.dtype), freqs.cos().to(x.dtype)
        if form == "complex":
            return torch.polar(torch.full_like(freqs, s), freqs)
        emb = freqs.repeat_interleave(2, dim=-1) if form == "interleave" else torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * s).to(x.dtype), (emb.sin() * s).to(x.dtype)

    find_rotary_module(module).forward = forward
    return dataclasses.replace(model, model=module)


def exact_landing(twin: LoadedModel, frags: list[Fragment]) -> tuple[DynamicCache, list[DynamicCache]]:
    """The exact keys of a merge of ``frags``, and of each fragment where it was prefilled.

    Parameters
    ----------
    twin : LoadedModel
        The float64 model (:func:`exact_twin`).
    frags : list of Fragment
        In landing order; each lands at the sum of the lengths before it.

    Returns
    -------
    exact : DynamicCache
        float64 keys and values ``[batch, kv_heads, kept, head_dim]`` per layer: every fragment
        prefilled alone where it lands, concatenated (what an exact merge of the fp32 fragments
        approaches, to their own fp32 noise).
    at_own : list of DynamicCache
        Each fragment prefilled in float64 at its own positions (``start``): the fragment's own
        fp32 noise is its cache against this one.
    """
    landings = landing_positions(frags)
    at_land = [prefill_ids(twin, f.token_ids, land) for f, land in zip(frags, landings, strict=True)]
    at_own = [
        c if land == f.start else prefill_ids(twin, f.token_ids, f.start)
        for f, c, land in zip(frags, at_land, landings, strict=True)
    ]
    exact = merge(
        [dataclasses.replace(f, cache=c, start=land) for f, c, land in zip(frags, at_land, landings, strict=True)],
        "naive",
    )
    return exact, at_own


def _rerotate_phase(model: LoadedModel, ids: TokenSource, lengths: tuple[int, ...]) -> list[Line]:
    """Two fragments merged by ``rerotate``, against the exact keys at their landing positions.

    The exact keys are the float64 model's (:func:`exact_twin`) prefilled alone where each
    fragment lands. ``rerotate`` turns the fp32 keys it is given, so it is held to the noise they
    already carry: the element noise allowed is the fragments' own fp32 prefill against the
    exact one at their own positions (at least :data:`REL_KEY_NOISE`). It grows with the
    fragment; a fixed noise measured on short fragments would count it as a phase error.
    """
    lengths = [n for n in lengths if 2 * n <= position_limit(model)]
    twin = exact_twin(model)
    worst: dict[str, float] = {}
    naive: dict[str, float] = {}
    floors, landed = [], []
    for n in lengths:
        frags = _fragments(model, ids, [n, n])
        try:
            merged = merge(frags, "rerotate", model)
        except UnsupportedRopeError as e:
            return [Line("rerotate phase", f"2 x {n} tokens", None, 1.0, "x rounding", REFUSED, str(e))]
        exact, at_own = exact_landing(twin, frags)
        own = max(rel_key_error(f.cache, c) for f, c in zip(frags, at_own, strict=True))
        floor = max(REL_KEY_NOISE, own)
        floors.append(own)
        landed.append(rel_key_error(phase_reference(model, frags), exact))
        for cache, out in ((merged, worst), (merge(frags, "naive", model), naive)):
            for lt, w in beyond_by_kind(cache, exact, phase_error(cache, exact, model), floor).items():
                out[lt] = max(out.get(lt, 0.0), w)
    del twin
    scope = "2 x " + "/".join(map(str, lengths)) + " tokens"
    show = lambda xs: ", ".join(f"{x:.2g}" for x in xs)  # noqa: E731
    return [
        Line(
            "rerotate phase",
            f"{lt} layers, {scope}",
            w,
            1.0,
            "x rounding",
            PASS if w <= 1 else FAIL,
            f"against the float64 model; the fragments' own fp32 key noise {show(floors)}; the fp32 model prefilled "
            f"at the landing positions {show(landed)}; a naive merge {naive[lt]:.3g} x rounding",
        )
        for lt, w in sorted(worst.items())
    ]


def sliding_window(model: LoadedModel) -> int | None:
    """The window of the model's sliding layers, or ``None`` where it has none."""
    config = model.config.get_text_config()
    types = getattr(config, "layer_types", None) or []
    return getattr(config, "sliding_window", None) if "sliding_attention" in types else None


def identity_fragments(model: LoadedModel, ids: TokenSource) -> list[Fragment]:
    """Two fragments for the exact identities: together past the sliding window where there is one."""
    window = sliding_window(model)
    switch = [r.original_max_position_embeddings for r in layer_ropes(model.model) if r.rope_type == "longrope"]
    # Past a longrope switch, fragments prefilled short and merged long do not compose: stay below it.
    n = window // 2 + 8 if window else (min(switch) // 2 if switch else 64)
    return _fragments(model, ids, [n, n])


@dataclass
class _Exact:
    """The fragments of the exact identities, their joined prefill and their rerotate merge, each made once.

    ``rotated`` is ``None`` and ``refusal`` says why where the model's rotations do not compose.
    """

    frags: list[Fragment]
    joined: DynamicCache
    rotated: DynamicCache | None
    refusal: str | None

    @classmethod
    def of(cls, model: LoadedModel, frags: list[Fragment]) -> _Exact:
        joined = joined_prefill(model, frags).cache
        try:
            return cls(frags, joined, merge(frags, "rerotate", model), None)
        except UnsupportedRopeError as e:
            return cls(frags, joined, None, str(e))


def _sliding(model: LoadedModel, exact: _Exact) -> list[Line]:
    """Past the window, every layer of a merge keeps what a joined prefill keeps."""
    return [sliding_line(model, exact.frags, exact.joined, exact.rotated, exact.refusal)]


def sliding_line(
    model: LoadedModel,
    frags: list[Fragment],
    joined: DynamicCache,
    merged: DynamicCache | None,
    refusal: str | None = None,
    scope: str = "",
) -> Line:
    """The ``sliding window`` line: every layer of ``merged`` keeps what ``joined`` keeps (type, shape, length).

    Parameters
    ----------
    frags : list of Fragment
        What was merged, together past the model's window.
    joined : DynamicCache
        Their joined prefill: keys and values ``[batch, kv_heads, kept, head_dim]`` per layer.
    merged : DynamicCache or None
        The merge under test; ``None`` where it was refused (``refusal`` says why).
    scope : str
        Put before the line's own scope (what was merged, for an audit).
    """
    window = sliding_window(model)
    total = sum(f.length for f in frags)
    if window is None:
        return Line("sliding window", scope + "no sliding layers", None, None, "", NA)
    what = scope + f"{len(frags)} x {frags[0].length} tokens"
    if merged is None:
        return Line("sliding window", what, None, 0, "layers wrong", REFUSED, refusal or "")
    wrong = [
        li
        for li, (a, b) in enumerate(zip(merged.layers, joined.layers, strict=True))
        if type(a) is not type(b) or a.keys.shape != b.keys.shape or a.get_seq_length() != b.get_seq_length()
    ]
    kept = sorted({layer.keys.shape[-2] for layer in merged.layers})
    return Line(
        "sliding window",
        f"{what} past a window of {window}",
        len(wrong),
        0,
        "layers wrong",
        PASS if not wrong else FAIL,
        f"layers keep {kept} of {total} tokens" + (f"; wrong at layers {wrong}" if wrong else ""),
    )


def unequal_elements(a: DynamicCache, b: DynamicCache) -> int:
    """Elements of K and V that differ (any shape or length difference counts every element)."""
    n = 0
    for la, lb in zip(a.layers, b.layers, strict=True):
        for x, y in ((la.keys, lb.keys), (la.values, lb.values)):
            n += int((x != y).sum()) if x.shape == y.shape else max(x.numel(), y.numel())
        n += la.get_seq_length() != lb.get_seq_length()
    return n


def _rel_error(a: DynamicCache, b: DynamicCache) -> float:
    """``max`` over layers of ``max |X - X_ref| / max |X_ref|``, for K and V."""
    worst = 0.0
    for la, lb in zip(a.layers, b.layers, strict=True):
        for x, y in ((la.keys, lb.keys), (la.values, lb.values)):
            if x.shape != y.shape:
                return math.inf
            scale = float(y.abs().max())
            worst = max(worst, float((x - y).abs().max()) / scale if scale else float((x - y).abs().max()))
    return worst


def _recompute_identities(model: LoadedModel, exact: _Exact) -> list[Line]:
    """Recompute at ratio 0 is rerotate bit for bit (every policy); at ratio 1 the joined prefill."""
    frags, rot = exact.frags, exact.rotated
    scope = f"2 x {frags[0].length} tokens"
    if rot is None:
        return [Line("recompute r=0", scope, None, 0, "elements", REFUSED, exact.refusal)]
    lines = []
    for policy in POLICIES:
        n = unequal_elements(merge(frags, "recompute", model, ratio=0.0, policy=policy), rot)
        lines.append(
            Line("recompute r=0", f"{policy}, {scope}, against rerotate", n, 0, "elements", PASS if n == 0 else FAIL)
        )
    err = _rel_error(merge(frags, "recompute", model, ratio=1.0), exact.joined)
    lines.append(
        Line(
            "recompute r=1",
            f"{scope}, against the joined prefill",
            err,
            REL_KEY_NOISE,
            "relative K/V",
            PASS if err <= REL_KEY_NOISE else FAIL,
        )
    )
    return lines


def _refused(what: str, expected: type[Exception], call, scope: str = "", unchanged=None) -> Line:
    try:
        call()
    except expected as e:
        intact = unchanged() if unchanged else True
        status = PASS if intact else FAIL
        detail = str(e)[:160] + ("" if intact else " -- but the cache was modified")
        return Line(what, scope, type(e).__name__, expected.__name__, "raised", status, detail)
    except KvlabError as e:
        return Line(what, scope, type(e).__name__, expected.__name__, "raised", FAIL, str(e)[:160])
    return Line(what, scope, "accepted", expected.__name__, "raised", FAIL, "kvlab went ahead")


def _refusals(model: LoadedModel, ids: TokenSource) -> list[Line]:
    """What does not compose, or lies outside the model, is refused, and refusing changes nothing."""
    limit = position_limit(model)
    frag = prefill_tokens(model, ids(8))
    keys = [layer.keys.clone() for layer in frag.cache.layers]

    def intact() -> bool:
        return all(torch.equal(k, layer.keys) for k, layer in zip(keys, frag.cache.layers, strict=True))

    rope = layer_ropes(model.model)[0]
    dynamic = dataclasses.replace(rope, rope_type="dynamic")
    longrope = dataclasses.replace(rope, rope_type="longrope", original_max_position_embeddings=64)
    two = [frag, prefill_tokens(model, ids(8))]
    return [
        _refused(
            "refuse past limit",
            PositionError,
            lambda: shift_(frag.cache, limit, model),
            f"shift_ of 8 tokens to position {limit}",
            intact,
        ),
        _refused(
            "refuse before 0", MergeError, lambda: shift_(frag.cache, -1, model), "shift_ by -1 from position 0", intact
        ),
        _refused(
            "refuse dynamic NTK",
            UnsupportedRopeError,
            lambda: check_composable(dynamic, [(0, 8, 0), (0, 8, 8)]),
            "this model's frequencies, rope_type dynamic",
        ),
        _refused(
            "refuse longrope switch",
            UnsupportedRopeError,
            lambda: check_composable(longrope, [(0, 40, 0), (0, 40, 40)]),
            "this model's frequencies, a switch at 64 crossed",
        ),
        _refused("refuse by policy", MergeError, lambda: merge(two, "fail", model), "strategy fail, 2 fragments"),
    ]


def _file_round_trip(model: LoadedModel, exact: _Exact) -> list[Line]:
    """A merged cache saved and loaded is bit for bit the same; a reader with other weights is refused."""
    merged = exact.joined if exact.rotated is None else exact.rotated
    scope = f"{merged.get_seq_length()} tokens"
    with tempfile.TemporaryDirectory(prefix="kvlab-certify-") as tmp:
        path = save_cache(Path(tmp) / "merged.kvcache", merged, model)
        n = unequal_elements(load_cache(path, model).cache, merged)
        foreign = variants(model, "int8")
        try:
            load_cache(path, foreign)
        except FingerprintMismatch as e:
            fields = ", ".join(d.field for d in e.differences)
            refused = Line(
                "foreign reader",
                "int8 round trip of the same weights",
                fields,
                "refused",
                "fields",
                PASS if fields else FAIL,
            )
        else:
            refused = Line("foreign reader", "int8 round trip of the same weights", "loaded", "refused", "fields", FAIL)
        del foreign
    return [Line("file round trip", scope, n, 0, "elements", PASS if n == 0 else FAIL), refused]


def _floor(model: LoadedModel, case: Case) -> list[Line]:
    """KL of the model against itself: probes read packed or alone, on all threads or one."""
    cache = case.context
    probes = list(DEFAULT_PROBES)
    packed = [r.log_probs for r in read_probes(model, cache, probes)]
    alone = [read_probes(model, cache, [p])[0].log_probs for p in probes]
    batch = max(abs(kl_divergence(a, b)) for a, b in zip(packed, alone, strict=True))
    threads = torch.get_num_threads()
    other = 1 if threads > 1 else 2
    torch.set_num_threads(other)
    try:
        moved = [r.log_probs for r in read_probes(model, cache, probes)]
    finally:
        torch.set_num_threads(threads)
    thread = max(abs(kl_divergence(a, b)) for a, b in zip(packed, moved, strict=True))
    quant = (model.source or {}).get("quantization") or "none"
    scope = f"{len(probes)} probes behind {cache.get_seq_length()} tokens"
    lines = [
        Line(
            "floor: batch",
            f"packed vs alone, {scope}",
            batch,
            FLOOR_BOUND,
            "nats",
            PASS if batch <= FLOOR_BOUND else FAIL,
        ),
        Line(
            "floor: threads",
            f"{threads} vs {other} threads, {scope}",
            thread,
            FLOOR_BOUND,
            "nats",
            PASS if thread <= FLOOR_BOUND else FAIL,
        ),
    ]
    if quant != "none":
        lines.append(
            Line(
                "floor: quantised file",
                f"{quant} GGUF",
                None,
                None,
                "nats",
                NA,
                "kvlab computes with this file's weights dequantised to fp32, so that copy is the model certified here; "
                "llama.cpp's own reading of the quantised file is compared in `kvlab peers`",
            )
        )
    return lines


def _context(model: LoadedModel, case: Case) -> list[Line]:
    """What no rotation fixes: next-token KL of each merge against full recompute (information, no bound)."""
    lines = []
    scope = f"{len(case.fragments)} story fragments, {len(case.probes)} probes"
    for name, options in (("naive", {}), ("rerotate", {}), ("recompute", {"ratio": INFO_RATIO})):
        label = f"{name} r={INFO_RATIO}" if options else name
        try:
            cache = merge(case.fragments, name, model, **options)
        except KvlabError as e:
            lines.append(Line("context error", f"{label}, {scope}", None, None, "nats", INFO, f"refused: {e}"[:160]))
            continue
        rows = next_token_kl(model, cache, case.context, case.probes, case.context_dists)
        kl = sum(r["kl"] for r in rows) / len(rows)
        agree = sum(r["agree"] for r in rows)
        lines.append(
            Line(
                "context error", f"{label}, {scope}", kl, None, "nats (mean)", INFO, f"top-1 agrees {agree}/{len(rows)}"
            )
        )
    return lines
