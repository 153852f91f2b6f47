"""What every audit shares: a line that fails with the target's own error, fragments, refusals.

:func:`guarded` runs one line's measurement; whatever the audited code raised becomes that line,
failing, with the frame that raised (:func:`~kvlab.measure.audit.target.describe_failure`), and a
result kvlab's measures cannot even read (a layer missing, a tensor of the wrong rank) fails the
line it was read for. Every other line is still measured.

Where kvlab itself refuses what a line asks of the target (the model's rotations do not compose
for those positions, :func:`kvlab_refusal`), a target that raises is right to: the line is
``REFUSED``, as ``kvlab certify`` says of kvlab's own strategies, and the model is not certified.
"""

from __future__ import annotations

import functools

from transformers import DynamicCache

from kvlab.cache.fragments import Fragment, clone_cache
from kvlab.cache.merge import landing_positions
from kvlab.errors import PeerError, UnsupportedRopeError
from kvlab.measure.audit.target import TargetRaised, describe_failure
from kvlab.measure.certificate import FAIL, PASS, REFUSED, Line
from kvlab.models.layout import layer_ropes
from kvlab.models.loaded import LoadedModel
from kvlab.models.rope import check_composable
from kvlab.models.sources import load_model

#: A catalogue model whose rotations do not compose (dynamic NTK): a merge or shift must refuse it.
REFUSAL_MODEL = "tiny-dynamic"

#: Why :data:`REFUSAL_MODEL`'s caches cannot be moved, for the refusal lines.
REFUSAL_WHY = (
    "dynamic NTK recomputes its frequencies from the sequence length, so no rotation moves a key from one "
    "length's phase to another's"
)


class Unfit(Exception):
    """A result kvlab cannot measure for this line; the message says what is wrong with it.

    ``status`` is ``REFUSED`` where there is nothing to measure because kvlab refuses it too.
    """

    def __init__(self, message: str, status: str = FAIL):
        super().__init__(message)
        self.status = status


def kvlab_refusal(model: LoadedModel, spans: list[tuple[int, int, int]]) -> str | None:
    """Why kvlab refuses to move keys as ``spans`` say on ``model``, or ``None`` where it does not.

    Parameters
    ----------
    spans : list of (start, length, landing)
        Where each fragment was prefilled and where it lands (a shift: one span).
    """
    try:
        for rope in layer_ropes(model.model):
            check_composable(rope, spans)
    except UnsupportedRopeError as e:
        return str(e)
    return None


def model_refusal(model: LoadedModel) -> str | None:
    """Why kvlab refuses any merge or shift on ``model`` (dynamic NTK), or ``None``."""
    return kvlab_refusal(model, [(0, 8, 0), (0, 8, 8)])


def refused_detail(failure: str, refusal: str) -> str:
    """What the target raised, and why kvlab refuses the same (once, where the target is kvlab's own)."""
    if refusal[:80] in failure:
        return f"raised {failure}; kvlab refuses it too, for the same reason"
    return f"raised {failure}; kvlab refuses it too: {refusal[:200]}"


def need(results: list, refusal: str | None) -> list:
    """``results`` (of the phase line), or :class:`Unfit`: ``REFUSED`` where kvlab refused them all, else failing."""
    if not results:
        if refusal:
            raise Unfit(f"nothing to read: kvlab refuses it too ({refusal[:160]})", REFUSED)
        raise Unfit("nothing to read (the phase line says why)")
    return results


def guarded(check: str, scope: str, bound, unit: str, measure, refusal: str | None = None) -> list[Line]:
    """``measure()`` (a list of lines), or one failing ``check`` line saying why it could not be measured.

    Parameters
    ----------
    measure : callable
        Returns the lines. :class:`TargetRaised` (the audited code raised), :class:`Unfit`, and
        any error kvlab's own measures raise on a malformed result, become the failing line.
    refusal : str, optional
        Why kvlab refuses what this line asks (:func:`model_refusal`): then a target that raised
        is ``REFUSED``, not failing.
    """
    try:
        return measure()
    except TargetRaised as e:
        if refusal:
            return [Line(check, scope, None, bound, unit, REFUSED, refused_detail(e.failure, refusal))]
        return [Line(check, scope, None, bound, unit, FAIL, f"raised {e.failure}")]
    except Unfit as e:
        return [Line(check, scope, None, bound, unit, e.status, str(e))]
    except (RuntimeError, ValueError, IndexError, TypeError, AttributeError, PeerError) as e:
        # PeerError: llama.cpp refused kvlab's own read of what an engine merge left behind
        return [Line(check, scope, None, bound, unit, FAIL, f"kvlab could not read the result: {describe_failure(e)}")]


def spans(frags: list[Fragment]) -> list[tuple[int, int, int]]:
    """``(start, length, landing)`` of each fragment of a merge, for :func:`kvlab_refusal`."""
    return [(f.start, f.length, land) for f, land in zip(frags, landing_positions(frags))]


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
