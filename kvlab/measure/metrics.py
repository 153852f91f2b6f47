"""What a merged cache gets wrong, measured against a reference cache of the same positions.

Two references (see the README):

* phase reference: every fragment prefilled *alone* at the positions it lands on. Its keys
  differ from a merged fragment's only by rotation, so it isolates the phase error.
* context reference: one prefill of the joined tokens. Past layer 0 it also differs by
  what the fragments would have seen of each other (the context error).

All functions take caches whose slot ``j`` holds position ``j`` (the output of
:func:`kvlab.merge`) and batch size 1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from kvlab.measure.probes import read_probes
from kvlab.models.layout import layer_ropes
from kvlab.models.loaded import LoadedModel


@dataclass
class LayerDiff:
    """Element-wise difference of one layer, reduced over ``head_dim`` (CPU tensors, any cache device).

    Attributes
    ----------
    positions : torch.Tensor
        ``[T]`` positions this layer holds (sliding layers hold the last ``window - 1``).
    k, v : torch.Tensor
        ``[kv_heads, T]`` max over ``head_dim`` of ``|K - K_ref|`` and ``|V - V_ref|``.
    """

    positions: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor


def _aligned(cache: DynamicCache, ref: DynamicCache, li: int):
    a, b = cache.layers[li], ref.layers[li]
    n_a, n_b = a.get_seq_length(), b.get_seq_length()
    if n_a != n_b:
        raise ValueError(f"layer {li}: caches hold {n_a} and {n_b} positions; compare caches of the same length")
    t = min(a.keys.shape[-2], b.keys.shape[-2])
    pos = torch.arange(n_a - t, n_a)
    return pos, a.keys[0, :, -t:], b.keys[0, :, -t:], a.values[0, :, -t:], b.values[0, :, -t:]


def kv_diff(cache: DynamicCache, ref: DynamicCache) -> list[LayerDiff]:
    """Per layer, ``max_d |K - K_ref|`` and ``max_d |V - V_ref|`` for every head and position."""
    out = []
    for li in range(len(cache.layers)):
        pos, k, kr, v, vr = _aligned(cache, ref, li)
        # Reduced maps are small and read by plots and tables: they live on the CPU whatever the cache's device.
        out.append(LayerDiff(pos, (k - kr).abs().amax(-1).float().cpu(), (v - vr).abs().amax(-1).float().cpu()))
    return out


def layer_position_grid(diffs: list[LayerDiff], which: str = "k") -> torch.Tensor:
    """``[layers, N]`` max over heads; NaN where a sliding layer keeps no token."""
    n = max(int(d.positions[-1]) + 1 for d in diffs)
    grid = torch.full((len(diffs), n), math.nan)
    for li, d in enumerate(diffs):
        grid[li, d.positions] = getattr(d, which).amax(0)
    return grid


def max_diff(diffs: list[LayerDiff], which: str = "k", positions: slice | None = None) -> float:
    """Largest difference over all layers, heads (and the given positions)."""
    best = 0.0
    for d in diffs:
        x = getattr(d, which)
        if positions is not None:
            mask = (d.positions >= (positions.start or 0)) & (d.positions < (positions.stop or 1 << 62))
            x = x[:, mask]
        if x.numel():
            best = max(best, float(x.max()))
    return best


# Pairs whose norm (in either cache) is below this fraction of the layer's RMS pair norm are
# masked: their angle is set by rounding, not by rotation, and exact zeros have no angle at
# all (atan2 gives 0 or pi there by the signs of the zeros). The measurements behind the
# value: docs/merging.md, "The rounding floor of a phase comparison".
MIN_PAIR_NORM = 1e-3

# Relative element-wise agreement of two fp32 forward passes of the same tokens at different
# absolute positions, with a margin over what the models reach: the noise the angle bound
# (LayerPhase.resolution) allows. Measured in docs/merging.md (same section).
REL_KEY_NOISE = 1e-5

# fp32 unit roundoff: HF computes each rotary angle as float32(position * inv_freq), which is
# off by up to this fraction of itself (the reference carries that; rerotate works in float64).
_FP32_U = 2.0**-24


def rel_key_error(cache: DynamicCache, ref: DynamicCache) -> float:
    """``max`` over layers of ``max |K - K_ref| / max |K_ref|``: a key error on the keys' own scale.

    Comparable across models whose keys differ in size (Gemma 3's are about twice SmolLM2's),
    and with :data:`REL_KEY_NOISE`, the agreement two fp32 forward passes reach.
    """
    worst = 0.0
    for li, d in enumerate(kv_diff(cache, ref)):
        scale = float(ref.layers[li].keys.abs().max())
        if scale > 0:
            worst = max(worst, float(d.k.max()) / scale)
    return worst


@dataclass
class LayerPhase:
    """Rotation angle between merged and reference key pairs of one layer.

    Attributes
    ----------
    positions : torch.Tensor
        ``[T]``, or ``[kv_heads, T]`` where each head holds other tokens (a compacted cache): the
        positions whose fp32 angle rounding the resolution allows for.
    angle : torch.Tensor
        ``[kv_heads, T, rotary_dim // 2]`` in radians, in ``[0, pi]``; pair ``i`` (in the layer's pairing) is
        those two dimensions at frequency ``inv_freq[i]``. NaN where the pair
        is masked (see :func:`phase_error`).
    norm : torch.Tensor
        ``[kv_heads, T, rotary_dim // 2]`` the smaller of the two pairs' Euclidean norms.
    weight : torch.Tensor
        ``[kv_heads, T, rotary_dim // 2]`` ``|x| |y|``, the product of the two pairs' norms
        (zero for an empty pair), used by :func:`weighted_phase_error`.
    inv_freq : torch.Tensor
        ``[rotary_dim // 2]`` radians per position.
    layer_type : str
    key_scale : float
        ``max |K_ref|`` over the layer, the scale of its rounding noise.
    nope : bool
        A layer without rotary embedding: no pairs (``rotary_dim`` 0), so no phase to be wrong.
        Its context error still shows in :func:`kv_diff`.
    """

    positions: torch.Tensor
    angle: torch.Tensor
    inv_freq: torch.Tensor
    layer_type: str
    norm: torch.Tensor
    weight: torch.Tensor
    key_scale: float
    nope: bool = False

    @property
    def kind(self) -> str:
        """The layer type, marked ``(NoPE)`` on a layer without rotary embedding, for labels."""
        return f"{self.layer_type} (NoPE)" if self.nope else self.layer_type

    @property
    def masked(self) -> torch.Tensor:
        """``[kv_heads, T, rotary_dim // 2]`` True where the pair carries too little norm to have an angle."""
        return torch.isnan(self.angle)

    def resolution(self, rel_noise: float = REL_KEY_NOISE) -> torch.Tensor:
        """``[kv_heads, T, rotary_dim // 2]`` the angle (radians) that fp32 rounding alone can explain.

        Two terms: element noise ``rel_noise * key_scale`` turns a pair of norm ``r`` by up to
        ``sqrt(2) * noise / r``; and the reference's fp32 rotary angle ``position * inv_freq``
        is off by up to ``2 * u * position * inv_freq`` (``u = 2**-24``; 2x for the two
        roundings of product and argument). Capped at pi.
        """
        pos = self.positions.to(self.inv_freq.device, torch.float64)
        arg = 2 * _FP32_U * (pos[..., None] * self.inv_freq.double())  # [T, pairs], or [kv_heads, T, pairs]
        noise = math.sqrt(2) * rel_noise * self.key_scale / self.norm.double().clamp_min(1e-30)
        return ((arg[None] if arg.ndim == 2 else arg) + noise).clamp_max(math.pi).float()


def phase_error(
    cache: DynamicCache, ref: DynamicCache, model: LoadedModel, min_norm: float | None = MIN_PAIR_NORM
) -> list[LayerPhase]:
    """Angle between each rotary key pair of ``cache`` and of ``ref``, per layer.

    Computed in float64 as ``atan2(|x cross y|, x . y)`` so tiny angles keep their precision.
    A pair whose norm in either cache is below ``min_norm`` times the layer's RMS pair norm
    (in ``ref``) has no meaningful angle and is masked (NaN), so it neither counts as an
    error nor hides one elsewhere: a zero pair gets 0 or pi from ``atan2`` by the signs of
    its zeros. :func:`weighted_phase_error` needs no threshold: it weights every angle by
    ``|x| |y|``. ``min_norm=0`` masks only exact zeros; ``None`` masks nothing (raw ``atan2``,
    for showing the artefact).
    """
    out = []
    for li, rope in enumerate(layer_ropes(model.model)):
        pos, k, kr, v, vr = _aligned(cache, ref, li)
        if rope.slot == "values":
            k, kr = v, vr
        r = rope.rotary_dim
        x1, x2 = (t.double() for t in rope.pairing.split(k, r))
        y1, y2 = (t.double() for t in rope.pairing.split(kr, r))
        angle = torch.atan2((x1 * y2 - x2 * y1).abs(), x1 * y1 + x2 * y2)
        nx, ny = torch.hypot(x1, x2), torch.hypot(y1, y2)
        rms = float(ny.pow(2).mean().sqrt()) if ny.numel() else 0.0
        norm = torch.minimum(nx, ny)
        if min_norm is not None:
            angle = angle.masked_fill((norm <= min_norm * rms) | (norm == 0), math.nan)
        # Small per-pair maps, read by plots and tables: on the CPU whatever the cache's device.
        out.append(
            LayerPhase(
                pos,
                angle.float().cpu(),
                rope.inv_freq.cpu(),
                rope.layer_type,
                norm=norm.float().cpu(),
                weight=(nx * ny).float().cpu(),
                key_scale=float(kr.abs().max()) if kr.numel() else 0.0,
                nope=rope.nope,
            )
        )
    return out


def _select(phases: list[LayerPhase], layer_type: str | None):
    """The rotary layers of ``phases`` of one layer type or kind (``None``: all); NoPE layers have no pairs."""
    return [p for p in phases if not p.nope and (layer_type is None or layer_type in (p.layer_type, p.kind))]


def max_phase_error(phases: list[LayerPhase], layer_type: str | None = None) -> float:
    """Largest angle (radians) over every unmasked pair of the given layers; NaN if all are masked."""
    vals = [float(a.max()) for p in _select(phases, layer_type) if (a := p.angle[~p.masked]).numel()]
    return max(vals) if vals else math.nan


def weighted_phase_error(phases: list[LayerPhase], layer_type: str | None = None, band: slice | None = None) -> float:
    """Magnitude-weighted mean angle (radians): ``sum(|x||y| angle) / sum(|x||y|)`` over every pair.

    Needs no masking threshold: an empty pair weighs nothing, and a pair counts in
    proportion to how much it contributes to attention scores.
    """
    num = den = 0.0
    for p in _select(phases, layer_type):
        a, w = p.angle, p.weight
        if band is not None:
            a, w = a[..., band], w[..., band]
        w = w.double().masked_fill(torch.isnan(a), 0.0)
        num += float((a.double().nan_to_num(0.0) * w).sum())
        den += float(w.sum())
    return num / den if den > 0 else math.nan


def phase_beyond_rounding(phases: list[LayerPhase], rel_noise: float = REL_KEY_NOISE) -> float:
    """Largest ``angle / resolution`` over unmasked pairs (see :meth:`LayerPhase.resolution`).

    At most 1 means every measurable pair agrees with the reference to within what fp32
    rounding can explain; a phase error shows up as a ratio far above 1.
    """
    worst = 0.0
    for p in phases:
        r = p.angle.double() / p.resolution(rel_noise).double()
        r = r[~torch.isnan(r)]
        if r.numel():
            worst = max(worst, float(r.max()))
    return worst


def phase_by_position(
    phases: list[LayerPhase], layer_type: str | None = None, band: slice | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean phase error per position over layers, heads and the given frequency pairs.

    Masked pairs are left out of the mean. Returns
    -------
    positions : torch.Tensor ``[N]``; error : torch.Tensor ``[N]`` radians (NaN where no layer
    holds the position, or every pair there is masked).
    """
    n = max(int(p.positions[-1]) + 1 for p in phases)
    total, count = torch.zeros(n, dtype=torch.float64), torch.zeros(n, dtype=torch.float64)
    for p in _select(phases, layer_type):
        a = (p.angle if band is None else p.angle[..., band]).double()
        per_pos = a.nanmean(dim=(0, 2)).cpu()
        seen = ~torch.isnan(per_pos)
        pos = p.positions.cpu()
        total[pos[seen]] += per_pos[seen]
        count[pos[seen]] += 1
    return torch.arange(n), (total / count).float()


def kl_divergence(lp: torch.Tensor, lq: torch.Tensor) -> float:
    """``KL(p || q)`` in nats of two ``[vocab]`` log-probability vectors (kvlab's one KL).

    Not clamped at 0: a negative value is rounding, and a caller testing ``abs(kl) <= tol``
    should see it rather than a 0 that hides it. Bit-identical inputs give exactly 0.0.
    """
    return float((lp.exp() * (lp - lq)).sum())


def kl_row(model: LoadedModel, probe: str, lp: torch.Tensor, lq: torch.Tensor) -> dict:
    """``KL(p || q)`` in nats of two ``[vocab]`` log-probability vectors, their top-1 tokens and whether they agree."""
    kl = kl_divergence(lp, lq)
    t_ref, t = int(lp.argmax()), int(lq.argmax())
    return {
        "probe": probe,
        "kl": kl,
        "top1_ref": model.tokenizer.decode([t_ref]),
        "top1": model.tokenizer.decode([t]),
        "agree": t_ref == t,
    }


def next_token_kl(
    model: LoadedModel,
    cache: DynamicCache,
    ref: DynamicCache,
    probes: list[str],
    ref_dists: list[torch.Tensor] | None = None,
) -> list[dict]:
    """Per probe: ``KL(p_ref || p_cache)`` in nats of the next token, and whether top-1 agrees.

    ``ref_dists``: the reference's next-token log-probabilities per probe, when a caller
    compares many caches against one reference (then ``ref`` is not read). All probes are
    read behind each cache in one :func:`kvlab.measure.probes.read_probes` call.
    """
    if ref_dists is None:
        ref_dists = [r.log_probs for r in read_probes(model, ref, probes)]
    return [
        kl_row(model, probe, lp, r.log_probs)
        for probe, lp, r in zip(probes, ref_dists, read_probes(model, cache, probes), strict=True)
    ]
