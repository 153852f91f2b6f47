"""Rotary position embedding, read from the model's own rotary module.

A cached key of the token at position ``m`` is ``s * R(m) k`` with ``R(m)`` the block
rotation by angles ``m * inv_freq`` and ``s`` the module's ``attention_scaling``. Because
``R(a) R(b) = R(a + b)``, moving a key by ``d`` positions is an exact re-phasing:
multiply by the *unscaled* ``R(d)`` (the scale is already in the key, once).

Where the rotary dimensions sit is the layer's :class:`Pairing`: most of HF pairs
dimension ``i`` with ``i + r/2`` (``rotate_half``); Cohere, GLM and GPT-J pair ``2i`` with
``2i + 1``; multi-head latent attention rotates a slice of the cached tensor starting at an
offset. A layer with no rotary dimensions at all (SmolLM3's NoPE layers) has an empty
``inv_freq`` and is never turned. :mod:`kvlab.models.layout` says which layer is which.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlab.compat import rope_init
from kvlab.errors import PositionError, UnsupportedRopeError

#: Rope types whose frequencies do not depend on the sequence length, so rotations compose.
STATIC_ROPE_TYPES = {"default", "linear", "llama3", "yarn"}

#: Rope types kvlab reads but whose rotations compose only for some merges: ``dynamic`` never
#: (refused by re-rotating strategies), ``longrope`` unless a merge crosses its switch
#: length. Models using them load; :func:`check_composable` decides per merge.
CONDITIONAL_ROPE_TYPES = {"dynamic", "longrope"}


def rope_problem(params: dict) -> str | None:
    """Why kvlab cannot treat a rope schedule at all, or ``None`` when it can.

    The one place that says which schedules kvlab knows: :func:`check_composable` refuses a
    merge with it, and loading or wrapping a model refuses the model with it, before any work.

    Parameters
    ----------
    params : dict
        One layer type's ``config.rope_parameters`` (``rope_type``, ``rope_theta``, ...).
    """
    rope_type = params.get("rope_type", "default")
    if "mrope_section" in params:
        return (
            f"rope_type {rope_type!r} with mrope_section {params['mrope_section']} (M-RoPE): each key's frequency "
            "sections turn by a separate temporal, height and width position. Moving all three by the same d is a "
            "plain rotation, but where a fragment lands is not its token count once it holds an image (a picture "
            "advances the positions by its grid), and transformers builds these models only for image-text "
            "generation, with 3-D positions from the processor; kvlab drives causal LMs with 1-D positions"
        )
    if rope_type not in STATIC_ROPE_TYPES | CONDITIONAL_ROPE_TYPES:
        return (
            f"rope_type {rope_type!r} is not one kvlab knows "
            f"({', '.join(sorted(STATIC_ROPE_TYPES | CONDITIONAL_ROPE_TYPES))}), so it cannot tell whether its "
            "rotations compose (R(a) R(b) = R(a + b)), which every re-rotation relies on"
        )
    return None


@dataclass(frozen=True)
class Pairing:
    """Which dimensions of a cached ``[..., head_dim]`` tensor form each rotary pair.

    Attributes
    ----------
    offset : int
        First rotary dimension (0 but for layouts that put a position-free part first).
    interleaved : bool
        Pairs ``(offset + 2i, offset + 2i + 1)`` (Cohere, GLM, GPT-J) instead of
        ``(offset + i, offset + i + r/2)`` (``rotate_half``, most of HF).
    """

    offset: int = 0
    interleaved: bool = False

    def span(self, x: torch.Tensor, r: int) -> torch.Tensor:
        """``[..., r]`` view of the rotary dimensions of ``x`` (``[..., head_dim]``)."""
        return x[..., self.offset : self.offset + r]

    def split(self, x: torch.Tensor, r: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The two members of every pair: ``[..., r/2]`` views of ``x`` (``[..., head_dim]``), pair ``i`` at ``i``."""
        a, h = self.offset, r // 2
        if self.interleaved:
            return x[..., a : a + r : 2], x[..., a + 1 : a + r : 2]
        return x[..., a : a + h], x[..., a + h : a + r]

    def spread(self, c: torch.Tensor) -> torch.Tensor:
        """``[..., r/2]`` per-pair values laid out over the ``r`` rotary dimensions, ``[..., r]``."""
        return c.repeat_interleave(2, dim=-1) if self.interleaved else torch.cat([c, c], dim=-1)

    def describe(self, r: int) -> str:
        kind = "interleaved pairs (2i, 2i+1)" if self.interleaved else "pairs (i, i + r/2)"
        where = f"dims {self.offset}..{self.offset + r - 1}" if self.offset else f"first {r} dims"
        return f"{kind}, {where}"


#: ``rotate_half`` over the first rotary dims: the layout of most of HF.
HALF = Pairing()


@dataclass(frozen=True)
class LayerRope:
    """The rotary schedule one attention layer uses.

    Attributes
    ----------
    layer_type : str
        ``full_attention`` or ``sliding_attention`` (or ``default`` for models without types).
    rope_type : str
        transformers' rope type (``default``, ``yarn``, ``longrope``, ...).
    inv_freq : torch.Tensor
        ``[rotary_dim // 2]`` float32 inverse frequencies, from the model's rotary module.
    attention_scaling : float
        Factor multiplied into cos and sin by the model (so into every cached key, once).
    original_max_position_embeddings : int | None
        Switch length of ``longrope``; ``None`` elsewhere.
    pairing : Pairing
        Where the rotary pairs sit in the cached tensor.
    slot : str
        The cached tensor that carries the phase: ``keys``, or ``values`` where transformers
        caches multi-head latent attention as (latent, rotary key) in the (keys, values) slots.
    """

    layer_type: str
    rope_type: str
    inv_freq: torch.Tensor
    attention_scaling: float
    original_max_position_embeddings: int | None = None
    pairing: Pairing = HALF
    slot: str = "keys"

    @property
    def rotary_dim(self) -> int:
        return 2 * self.inv_freq.numel()

    @property
    def nope(self) -> bool:
        """A layer without rotary position embedding: its cached tensors carry no phase."""
        return self.inv_freq.numel() == 0

    @property
    def kind(self) -> str:
        """``nope`` or the layer type, for labels (a NoPE layer has no phase to be wrong)."""
        return f"{self.layer_type} (NoPE)" if self.nope else self.layer_type


def longrope_inv_freq(model: torch.nn.Module, rope: LayerRope, long: bool) -> torch.Tensor:
    """The short or long factor set of a longrope layer, as the rotary module computes it."""
    if not long:
        return rope.inv_freq
    inv, _ = rope_init(
        "longrope", model.config, None, seq_len=rope.original_max_position_embeddings + 1, layer_type=rope.layer_type
    )
    return inv.float().to(rope.inv_freq.device)


def check_composable(rope: LayerRope, spans: list[tuple[int, int, int]]) -> bool:
    """Refuse schedules where the phase of a key depends on more than its position.

    Parameters
    ----------
    spans : list of (source_start, length, landing_start)
        Where each fragment was prefilled and where it lands.

    Returns
    -------
    bool
        For ``longrope``, whether the long factor set is in force (else ``False``).
    """
    if rope.nope or rope.rope_type in STATIC_ROPE_TYPES:
        return False
    if rope.rope_type == "dynamic":
        raise UnsupportedRopeError(
            "rope_type 'dynamic' (NTK) recomputes its frequencies from the sequence length, so a key's phase "
            "at one length cannot be rotated into its phase at another; re-prefill instead (strategy 'reprefill')"
        )
    if rope.rope_type == "longrope":
        omax = rope.original_max_position_embeddings
        total = max(land + n for _, n, land in spans)
        merged_long = total > omax
        # transformers picks the factor set from max(position_ids) + 1 of each forward.
        sources_long = {src + n > omax for src, n, _ in spans}
        if sources_long != {merged_long}:
            raise UnsupportedRopeError(
                f"rope_type 'longrope' switches factor sets at original_max_position_embeddings={omax}; this merge "
                f"(fragments ending at {[s + n for s, n, _ in spans]}, merged length {total}) crosses it, so the "
                "rotations do not compose; re-prefill instead"
            )
        return merged_long
    raise UnsupportedRopeError(
        rope_problem({"rope_type": rope.rope_type}) or f"rope_type {rope.rope_type!r} does not compose"
    )


def delta_cos_sin(
    inv_freq: torch.Tensor, delta: int | torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of ``delta * inv_freq``, computed in float64 and rounded once.

    Parameters
    ----------
    inv_freq : torch.Tensor
        ``[r/2]`` inverse frequencies.
    delta : int or torch.Tensor
        Shift in positions; a tensor of shape ``[T]`` gives one shift per token.

    Returns
    -------
    cos, sin : torch.Tensor
        ``[r/2]`` (scalar delta) or ``[T, r/2]``; no attention scaling (see module docstring).
    """
    device = inv_freq.device
    # float64 where the frequencies live (CPU, CUDA, meta); MPS has no float64, so its
    # angles are computed on the CPU (a few hundred numbers) and moved once.
    work = torch.device("cpu") if device.type == "mps" else device
    f = inv_freq.to(work, torch.float64)
    d = torch.as_tensor(delta, dtype=torch.float64, device=work)
    ang = d[..., None] * f if d.ndim else d * f
    return ang.cos().to(device, dtype), ang.sin().to(device, dtype)


def rotation(
    inv_freq: torch.Tensor, delta: int | torch.Tensor, dtype: torch.dtype, device=None, pairing: Pairing = HALF
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotation by ``delta`` positions, ready for :func:`apply_rotation` with the same ``pairing``.

    Returns
    -------
    cos2 : torch.Tensor
        ``[r]`` (or ``[T, r]``): ``cos`` laid out over both members of every pair.
    sin : torch.Tensor
        ``[r/2]`` (or ``[T, r/2]``).
    """
    work = dtype if dtype in (torch.float32, torch.float64) else torch.float32
    cos, sin = delta_cos_sin(inv_freq if device is None else inv_freq.to(device), delta, work)
    return pairing.spread(cos), sin


def apply_rotation(
    keys: torch.Tensor,
    cos2: torch.Tensor,
    sin: torch.Tensor,
    out: torch.Tensor | None = None,
    pairing: Pairing = HALF,
) -> torch.Tensor:
    """Apply a rotation from :func:`rotation` to ``[..., head_dim]`` keys (see :func:`rotate_keys`)."""
    half = sin.shape[-1]
    r = 2 * half
    a = pairing.offset
    if a + r > keys.shape[-1]:
        raise UnsupportedRopeError(f"rotary dims {a}..{a + r - 1} exceed head_dim {keys.shape[-1]}")
    work = cos2.dtype
    if out is None:
        out = torch.empty_like(keys)
    # Half precision keys are rotated in fp32 and rounded once.
    x = keys if work == keys.dtype else keys.to(work)
    o = out if work == keys.dtype else torch.empty_like(x)
    # x1' = x1 cos - x2 sin, x2' = x2 cos + x1 sin, in three passes over memory: one
    # multiply by the spread cos over the whole rotary part, then one fused update per member.
    torch.mul(pairing.span(x, r), cos2, out=pairing.span(o, r))
    (o1, o2), (x1, x2) = pairing.split(o, r), pairing.split(x, r)
    o1.addcmul_(x2, sin, value=-1)
    o2.addcmul_(x1, sin)
    if a:
        o[..., :a] = x[..., :a]
    if a + r < keys.shape[-1]:
        o[..., a + r :] = x[..., a + r :]
    if o is not out:
        out.copy_(o)
    return out


def rotate_keys(
    keys: torch.Tensor,
    inv_freq: torch.Tensor,
    delta: int | torch.Tensor,
    out: torch.Tensor | None = None,
    pairing: Pairing = HALF,
) -> torch.Tensor:
    """Rotate cached keys forward by ``delta`` positions (backward if negative).

    Parameters
    ----------
    keys : torch.Tensor
        ``[batch, kv_heads, seq, head_dim]`` cached keys; only the ``rotary_dim =
        2 * len(inv_freq)`` dims that ``pairing`` names are rotary (partial-rotary and latent
        layouts pass the rest through).
    inv_freq : torch.Tensor
        ``[rotary_dim // 2]``.
    delta : int or torch.Tensor
        Shift in positions, scalar or ``[seq]``.
    out : torch.Tensor, optional
        Same shape as ``keys``, written in place (must not alias ``keys``).
    pairing : Pairing
        Where the pairs sit (default ``rotate_half`` over the first dims).

    Returns
    -------
    torch.Tensor
        ``[batch, kv_heads, seq, head_dim]``, a new tensor unless ``out`` is given; ``keys`` is not modified.
    """
    cos2, sin = rotation(inv_freq, delta, keys.dtype, keys.device, pairing)
    return apply_rotation(keys, cos2, sin, out, pairing)


def check_positions(config, end: int, what: str) -> None:
    """Refuse positions past the model's ``max_position_embeddings``."""
    limit = getattr(config, "max_position_embeddings", None)
    if limit is not None and end > limit:
        raise PositionError(f"{what} reaches position {end - 1}, past max_position_embeddings={limit} of this model")
