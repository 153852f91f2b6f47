"""Rotary position embedding, read from the model's own rotary module.

A cached key of the token at position ``m`` is ``s * R(m) k`` with ``R(m)`` the block
rotation by angles ``m * inv_freq`` (HF pairs dimension ``i`` with ``i + r/2``,
``rotate_half``) and ``s`` the module's ``attention_scaling``. Because
``R(a) R(b) = R(a + b)``, moving a key by ``d`` positions is an exact re-phasing:
multiply by the *unscaled* ``R(d)`` (the scale is already in the key, once).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

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
            f"rope_type {rope_type!r} with mrope_section {params['mrope_section']}: multimodal rope splits each key "
            "into sections rotated by separate (temporal, height, width) positions, so a shift of the token "
            "position alone is not a rotation kvlab can compute"
        )
    if rope_type not in STATIC_ROPE_TYPES | CONDITIONAL_ROPE_TYPES:
        return (
            f"rope_type {rope_type!r} is not one kvlab knows "
            f"({', '.join(sorted(STATIC_ROPE_TYPES | CONDITIONAL_ROPE_TYPES))}), so it cannot tell whether its "
            "rotations compose (R(a) R(b) = R(a + b)), which every re-rotation relies on"
        )
    return None


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
    """

    layer_type: str
    rope_type: str
    inv_freq: torch.Tensor
    attention_scaling: float
    original_max_position_embeddings: int | None = None

    @property
    def rotary_dim(self) -> int:
        return 2 * self.inv_freq.numel()


def find_rotary_module(model: torch.nn.Module) -> torch.nn.Module:
    """The model's (single, shared) rotary embedding module."""
    found = [m for name, m in model.named_modules() if name.endswith("rotary_emb")]
    if not found:
        raise UnsupportedRopeError(
            f"{type(model).__name__} has no rotary_emb module; kvlab re-rotates RoPE models only"
        )
    return found[0]


def layer_types(config) -> list[str]:
    types = getattr(config, "layer_types", None)
    return list(types) if types else ["default"] * config.num_hidden_layers


def _rope_params(config, layer_type: str) -> dict:
    params = config.rope_parameters
    return params[layer_type] if layer_type in params else params


def layer_ropes(model: torch.nn.Module) -> list[LayerRope]:
    """One :class:`LayerRope` per decoder layer, read from the model's rotary module.

    Gemma 3 keeps per-layer-type buffers (``sliding_attention_inv_freq``, ...); others a
    single ``inv_freq``. ``original_inv_freq`` is used where present because dynamic
    schedules overwrite ``inv_freq`` during a forward.
    """
    rotary = find_rotary_module(model)
    config = model.config
    out, by_type = [], {}
    for lt in layer_types(config):
        if lt not in by_type:
            prefix = f"{lt}_" if hasattr(rotary, f"{lt}_inv_freq") else ""
            params = _rope_params(config, lt)
            rope_type = params.get("rope_type", "default")
            inv_freq = getattr(rotary, f"{prefix}original_inv_freq", None)
            if inv_freq is None:
                inv_freq = getattr(rotary, f"{prefix}inv_freq")
            scaling = getattr(rotary, f"{prefix}attention_scaling", 1.0)
            omax = params.get("original_max_position_embeddings") if rope_type == "longrope" else None
            if omax is None and rope_type == "longrope":
                omax = getattr(config, "original_max_position_embeddings", None)
            # Kept on the model's device (meta included): rotation tables are built where the keys are.
            by_type[lt] = LayerRope(lt, rope_type, inv_freq.detach().float().clone(), float(scaling), omax)
        out.append(by_type[lt])
    return out


def longrope_inv_freq(model: torch.nn.Module, rope: LayerRope, long: bool) -> torch.Tensor:
    """The short or long factor set of a longrope layer, as the rotary module computes it."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if not long:
        return rope.inv_freq
    kwargs = {} if rope.layer_type == "default" else {"layer_type": rope.layer_type}
    inv, _ = ROPE_INIT_FUNCTIONS["longrope"](
        model.config, None, seq_len=rope.original_max_position_embeddings + 1, **kwargs
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
    if rope.rope_type in STATIC_ROPE_TYPES:
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
    inv_freq: torch.Tensor, delta: int | torch.Tensor, dtype: torch.dtype, device=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotation by ``delta`` positions, ready for :func:`apply_rotation`.

    Returns
    -------
    cos2 : torch.Tensor
        ``[r]`` (or ``[T, r]``): ``cos`` repeated for both halves of the rotary dims.
    sin : torch.Tensor
        ``[r/2]`` (or ``[T, r/2]``).
    """
    work = dtype if dtype in (torch.float32, torch.float64) else torch.float32
    cos, sin = delta_cos_sin(inv_freq if device is None else inv_freq.to(device), delta, work)
    return torch.cat([cos, cos], dim=-1), sin


def apply_rotation(
    keys: torch.Tensor, cos2: torch.Tensor, sin: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Apply a rotation from :func:`rotation` to ``[..., head_dim]`` keys (see :func:`rotate_keys`)."""
    half = sin.shape[-1]
    r = 2 * half
    if r > keys.shape[-1]:
        raise UnsupportedRopeError(f"rotary_dim {r} exceeds head_dim {keys.shape[-1]}")
    work = cos2.dtype
    if out is None:
        out = torch.empty_like(keys)
    # Half precision keys are rotated in fp32 and rounded once.
    x = keys if work == keys.dtype else keys.to(work)
    o = out if work == keys.dtype else torch.empty_like(x)
    # x1' = x1 cos - x2 sin, x2' = x2 cos + x1 sin, in three passes over memory: one
    # multiply by [cos, cos] over the whole rotary part, then one fused update per half.
    torch.mul(x[..., :r], cos2, out=o[..., :r])
    o[..., :half].addcmul_(x[..., half:r], sin, value=-1)
    o[..., half:r].addcmul_(x[..., :half], sin)
    if r < keys.shape[-1]:
        o[..., r:] = x[..., r:]
    if o is not out:
        out.copy_(o)
    return out


def rotate_keys(
    keys: torch.Tensor, inv_freq: torch.Tensor, delta: int | torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Rotate cached keys forward by ``delta`` positions (backward if negative).

    Parameters
    ----------
    keys : torch.Tensor
        ``[batch, kv_heads, seq, head_dim]`` cached keys; only the first ``rotary_dim =
        2 * len(inv_freq)`` dims are rotary (partial-rotary models pass the rest through).
    inv_freq : torch.Tensor
        ``[rotary_dim // 2]``.
    delta : int or torch.Tensor
        Shift in positions, scalar or ``[seq]``.
    out : torch.Tensor, optional
        Same shape as ``keys``, written in place (must not alias ``keys``).

    Returns
    -------
    torch.Tensor
        ``[batch, kv_heads, seq, head_dim]``, a new tensor unless ``out`` is given; ``keys`` is not modified.
    """
    cos2, sin = rotation(inv_freq, delta, keys.dtype, keys.device)
    return apply_rotation(keys, cos2, sin, out)


def check_positions(config, end: int, what: str) -> None:
    """Refuse positions past the model's ``max_position_embeddings``."""
    limit = getattr(config, "max_position_embeddings", None)
    if limit is not None and end > limit:
        raise PositionError(f"{what} reaches position {end - 1}, past max_position_embeddings={limit} of this model")
