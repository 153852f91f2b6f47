"""What every audit shares: a line that fails with the target's own error, fragments, the refusal model.

:func:`guarded` runs one line's measurement; whatever the audited code raised becomes that line,
failing, with the frame that raised (:func:`~kvlab.measure.audit.target.describe_failure`), and a
result kvlab's measures cannot even read (a layer missing, a tensor of the wrong rank) fails the
line it was read for. Every other line is still measured.
"""

from __future__ import annotations

import functools

from transformers import DynamicCache

from kvlab.cache.fragments import Fragment, clone_cache, prefill_tokens
from kvlab.measure.audit.target import TargetRaised, describe_failure
from kvlab.measure.certify import FAIL, PASS, Line, TokenSource
from kvlab.models.loaded import LoadedModel
from kvlab.models.sources import load_model

#: A catalogue model whose rotations do not compose (dynamic NTK): a merge or shift must refuse it.
REFUSAL_MODEL = "tiny-dynamic"

#: Why :data:`REFUSAL_MODEL`'s caches cannot be moved, for the refusal lines.
REFUSAL_WHY = (
    "dynamic NTK recomputes its frequencies from the sequence length, so no rotation moves a key from one "
    "length's phase to another's"
)


class Unfit(Exception):
    """A result kvlab cannot measure for this line; the message says what is wrong with it."""


def guarded(check: str, scope: str, bound, unit: str, measure) -> list[Line]:
    """``measure()`` (a list of lines), or one failing ``check`` line saying why it could not be measured.

    Parameters
    ----------
    measure : callable
        Returns the lines. :class:`TargetRaised` (the audited code raised), :class:`Unfit`, and
        any error kvlab's own measures raise on a malformed result, become the failing line.
    """
    try:
        return measure()
    except TargetRaised as e:
        return [Line(check, scope, None, bound, unit, FAIL, f"raised {e.failure}")]
    except Unfit as e:
        return [Line(check, scope, None, bound, unit, FAIL, str(e))]
    except (RuntimeError, ValueError, IndexError, TypeError, AttributeError) as e:
        return [Line(check, scope, None, bound, unit, FAIL, f"kvlab could not read the result: {describe_failure(e)}")]


def fragments(model: LoadedModel, ids: TokenSource, sizes: list[int]) -> list[Fragment]:
    """One fragment per size, each ``sizes[i]`` random tokens prefilled alone from position 0."""
    return [prefill_tokens(model, ids(n)) for n in sizes]


def caches(frags: list[Fragment]) -> list[DynamicCache]:
    """Fresh copies of the fragments' caches, so no call of the audited code sees another's leftovers."""
    return [clone_cache(f.cache, f.config) for f in frags]


@functools.cache
def refusal_model() -> LoadedModel:
    """:data:`REFUSAL_MODEL`, loaded once per process (seeded, no files)."""
    return load_model(REFUSAL_MODEL)


def dtype_line(results: list[tuple[str, DynamicCache]], ref) -> list[Line]:
    """``dtype and device``: every tensor of every result in ``ref``'s dtype and on its device.

    Parameters
    ----------
    results : list of (str, DynamicCache)
        What each result was made from (for the detail), and the result.
    ref : torch.Tensor
        A tensor of the input.
    """
    if not results:
        raise Unfit("no result to read (the phase line says why)")
    wrong = [
        f"{label}: layer {li} {slot} {t.dtype} on {t.device}"
        for label, cache in results
        for li, layer in enumerate(cache.layers)
        for slot, t in (("keys", layer.keys), ("values", layer.values))
        if t.dtype != ref.dtype or t.device != ref.device
    ]
    scope = f"{str(ref.dtype).removeprefix('torch.')} on {ref.device}"
    return [Line("dtype and device", scope, len(wrong), 0, "tensors", FAIL if wrong else PASS, "; ".join(wrong[:3]))]


def refusal_line(scope: str, attempt, done: str, why: str) -> list[Line]:
    """``refusal``: ``attempt()`` (a call of the target) must raise; ``done`` names what it did instead."""
    try:
        attempt()
    except TargetRaised as e:
        return [Line("refusal", scope, type(e.error).__name__, "raised", "", PASS, e.failure)]
    return [Line("refusal", scope, done, "raised", "", FAIL, why)]
