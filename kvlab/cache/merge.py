"""``kvlab.merge``: validate fragments, then hand them to a registered strategy."""

from __future__ import annotations

from transformers import DynamicCache

from kvlab.cache.fragments import Fragment
from kvlab.cache.strategies import STRATEGIES, Strategy
from kvlab.errors import MergeError
from kvlab.models.loaded import LoadedModel
from kvlab.models.rope import check_positions


def landing_positions(fragments: list[Fragment]) -> list[int]:
    """Where each fragment's first token lands in the merged cache (slot 0 onward)."""
    out, at = [], 0
    for f in fragments:
        out.append(at)
        at += f.length
    return out


def validate(fragments: list[Fragment], model: LoadedModel | None = None) -> None:
    """Raise :class:`MergeError` naming the first fragment and field that disagree."""
    if not isinstance(fragments, (list, tuple)) or len(fragments) == 0:
        raise MergeError("nothing to merge: the fragment list is empty")
    for i, f in enumerate(fragments):
        if not isinstance(f, Fragment):
            raise MergeError(f"fragment {i} is a {type(f).__name__}, not a kvlab.Fragment")
        if f.length == 0:
            raise MergeError(f"fragment {i} is empty (length 0)")
    ref = fragments[0]
    ref_geo = ref.geometry()
    for i, f in enumerate(fragments[1:], start=1):
        if f.model_name != ref.model_name:
            raise MergeError(f"fragment {i}: model is {f.model_name!r}, fragment 0's is {ref.model_name!r}")
        if f.num_layers != ref.num_layers:
            raise MergeError(f"fragment {i}: layer count is {f.num_layers}, fragment 0 has {ref.num_layers}")
        for li, (a, b) in enumerate(zip(ref_geo, f.geometry())):
            for field in ("batch", "kv_heads", "head_dim", "dtype", "device", "sliding_window"):
                va, vb = getattr(a, field), getattr(b, field)
                if va != vb:
                    raise MergeError(f"fragment {i}, layer {li}: {field} is {vb}, fragment 0 has {va}")
    if model is not None:
        if model.name != ref.model_name:
            raise MergeError(f"the fragments come from {ref.model_name!r} but the model given is {model.name!r}")
        total = sum(f.length for f in fragments)
        check_positions(model.config, total, f"the merged cache of {total} tokens")


def resolve(strategy: str | Strategy, **options) -> Strategy:
    if isinstance(strategy, Strategy):
        if options:
            raise MergeError("pass options to the strategy's constructor, not to merge(), when giving an instance")
        return strategy
    if strategy not in STRATEGIES:
        raise MergeError(f"unknown strategy {strategy!r}; registered: {', '.join(STRATEGIES)}")
    try:
        return STRATEGIES[strategy](**options)
    except TypeError as e:
        raise MergeError(f"bad options for strategy {strategy!r}: {e}") from None


def merge(
    fragments: list[Fragment], strategy: str | Strategy = "rerotate", model: LoadedModel | None = None, **options
) -> DynamicCache:
    """Merge fragments, in order, into one cache whose slot ``j`` is position ``j``.

    Parameters
    ----------
    fragments : list of Fragment
        Each with keys/values ``[batch, kv_heads, kept, head_dim]`` per layer; never
        mutated, never aliased by the result.
    strategy : str or Strategy
        A registered name (``kvlab.strategy_names()``) or an instance.
    model : LoadedModel, optional
        Needed by strategies that run or read the model (``rerotate``, ``reprefill``).

    Returns
    -------
    DynamicCache
        Layers typed as the model's config says; ``get_seq_length()`` is the total token
        count, and a forward pass or ``generate`` accepts it.
    """
    strat = resolve(strategy, **options)
    validate(fragments, model)
    if strat.needs_model and model is None:
        raise MergeError(f"strategy {strat.name!r} needs the model (pass model=...)")
    return strat(list(fragments), landing_positions(fragments), model)
