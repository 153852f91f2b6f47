"""The certificate's phase lines: is every rotary key where the model itself would put it?

* ``rotation`` (:func:`rotation_lines`): one token turned by ``shift_`` to offsets up to the
  model's last position, against the model's own key there;
* ``rerotate phase`` (:func:`rerotate_phase_lines`): two fragments merged by ``rerotate``,
  against the exact keys of the float64 twin (:mod:`kvlab.measure.twin`) where they land.

Bound: :func:`kvlab.measure.metrics.phase_beyond_rounding` ``<= 1`` per layer kind
(:func:`beyond_by_kind`; a NoPE layer's tensors must not move at all).
"""

from __future__ import annotations

import dataclasses

import torch

from kvlab.cache.fragments import clone_cache, prefill_ids
from kvlab.cache.merge import merge
from kvlab.cache.shift import shift_
from kvlab.errors import UnsupportedRopeError
from kvlab.measure.certificate import FAIL, PASS, REFUSED, Line
from kvlab.measure.metrics import REL_KEY_NOISE, kv_diff, phase_beyond_rounding, phase_error, rel_key_error
from kvlab.measure.references import phase_reference
from kvlab.measure.tokens import TokenSource, position_limit, random_fragments
from kvlab.measure.twin import exact_landing, exact_twin
from kvlab.models.layout import layer_ropes
from kvlab.models.loaded import LoadedModel

#: Fragment lengths of the rerotate phase check (two fragments each; capped by the position limit).
LENGTHS = (16, 128, 512)


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


def rotation_lines(model: LoadedModel) -> list[Line]:
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


def rerotate_phase_lines(model: LoadedModel, ids: TokenSource, lengths: tuple[int, ...]) -> list[Line]:
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
        frags = random_fragments(model, ids, [n, n])
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
